//! The thin layer over the MPI C API that the transport needs: checked calls, the datatypes of
//! Brigade's buffers, the NaN-propagating `max` operator, and a `Send` communicator handle.

use std::ffi::{c_int, c_void};

use ::mpi::ffi;

use crate::buffer::nan_max;
use crate::{CommError, DType};

/// Runs an MPI call and turns a non-success code into `CommError::Internal` naming the call,
/// the rank and MPI's own message (our communicators return errors instead of aborting).
macro_rules! mpi_check {
    ($rank:expr, $what:expr, $call:expr) => {{
        // SAFETY: the caller of the macro upholds the call's contract.
        let code: std::ffi::c_int = $call;
        if code == ::mpi::ffi::MPI_SUCCESS as std::ffi::c_int {
            Ok(())
        } else {
            Err($crate::CommError::Internal(format!(
                "rank {}: {} failed ({}:{}): {}",
                $rank,
                $what,
                file!(),
                line!(),
                $crate::mpi::raw::error_string(code)
            )))
        }
    }};
}
pub(crate) use mpi_check;

/// MPI's description of an error code.
pub(crate) fn error_string(code: c_int) -> String {
    let mut buf = vec![0u8; ffi::MPI_MAX_ERROR_STRING as usize + 1];
    let mut len: c_int = 0;
    // SAFETY: `buf` holds MPI_MAX_ERROR_STRING bytes, as the call requires.
    let rc = unsafe { ffi::MPI_Error_string(code, buf.as_mut_ptr().cast(), &mut len) };
    if rc != ffi::MPI_SUCCESS as c_int {
        return format!("MPI error code {code}");
    }
    buf.truncate(len.max(0) as usize);
    format!("{} (code {code})", String::from_utf8_lossy(&buf))
}

/// The MPI datatype that moves elements of `dtype` unchanged (f16/bf16 travel as 16-bit words;
/// they are reduced through f32 scratch buffers, never by MPI).
pub(crate) fn datatype(dtype: DType) -> ffi::MPI_Datatype {
    // SAFETY: reading the library's constant handles.
    unsafe {
        match dtype {
            DType::F32 => ffi::RSMPI_FLOAT,
            DType::F16 | DType::BF16 => ffi::RSMPI_UINT16_T,
            DType::U8 => ffi::RSMPI_UINT8_T,
            DType::F64 => ffi::RSMPI_DOUBLE,
            DType::I64 => ffi::RSMPI_INT64_T,
            DType::I8 => ffi::RSMPI_INT8_T,
        }
    }
}

/// `MPI_FLOAT`, the type every reduction runs in.
pub(crate) fn f32_datatype() -> ffi::MPI_Datatype {
    // SAFETY: reading a constant handle.
    unsafe { ffi::RSMPI_FLOAT }
}

/// `MPI_SUM`.
pub(crate) fn sum_op() -> ffi::MPI_Op {
    // SAFETY: reading a constant handle.
    unsafe { ffi::RSMPI_SUM }
}

/// Element-wise [`nan_max`] (a NaN on any rank wins, as in the thread backend; MPI's built-in
/// `MPI_MAX` keeps or drops NaNs depending on the order of its operands).
unsafe extern "C" fn max_f32(
    invec: *mut c_void,
    inoutvec: *mut c_void,
    len: *mut c_int,
    _datatype: *mut ffi::MPI_Datatype,
) {
    // SAFETY: MPI passes two arrays of `*len` MPI_FLOATs, the only type this operator is used
    // with; they do not overlap.
    unsafe {
        let n = (*len).max(0) as usize;
        let xs = std::slice::from_raw_parts(invec as *const f32, n);
        let acc = std::slice::from_raw_parts_mut(inoutvec as *mut f32, n);
        for (a, x) in acc.iter_mut().zip(xs) {
            *a = nan_max(*a, *x);
        }
    }
}

/// A user-defined MPI operator owned by one transport (`Send` for the reason given at
/// [`RawComm`]).
pub(crate) struct RawOp(pub(crate) ffi::MPI_Op);

// SAFETY: as for `RawComm`.
unsafe impl Send for RawOp {}

impl RawOp {
    /// The commutative [`nan_max`] operator.
    pub(crate) fn max_f32(rank: usize) -> Result<RawOp, CommError> {
        let mut op = sum_op(); // overwritten by the call
        mpi_check!(rank, "MPI_Op_create(max)", unsafe {
            ffi::MPI_Op_create(Some(max_f32), 1, &mut op)
        })?;
        Ok(RawOp(op))
    }

    /// Frees the operator (no collective may be using it).
    pub(crate) fn free(mut self) {
        // SAFETY: the handle came from MPI_Op_create and is freed once.
        unsafe { ffi::MPI_Op_free(&mut self.0) };
    }
}

/// An MPI communicator handle owned by one transport. MPI handles are plain pointers, hence not
/// `Send`; moving one to the comm stream's thread is sound because MPI is initialized with
/// `MPI_THREAD_MULTIPLE` (or `SERIALIZED`) and only that thread uses it afterwards.
pub(crate) struct RawComm(pub(crate) ffi::MPI_Comm);

// SAFETY: see the type's docs.
unsafe impl Send for RawComm {}

impl RawComm {
    /// A duplicate of `MPI_COMM_WORLD` (collective over all processes) that returns errors to
    /// the caller instead of aborting the job, so that they surface as `CommError`s.
    pub(crate) fn dup_world(rank: usize) -> Result<RawComm, CommError> {
        // SAFETY: reading a constant handle; overwritten by the call.
        let mut comm = unsafe { ffi::RSMPI_COMM_NULL };
        mpi_check!(rank, "MPI_Comm_dup(MPI_COMM_WORLD)", unsafe {
            ffi::MPI_Comm_dup(ffi::RSMPI_COMM_WORLD, &mut comm)
        })?;
        mpi_check!(rank, "MPI_Comm_set_errhandler(MPI_ERRORS_RETURN)", unsafe {
            ffi::MPI_Comm_set_errhandler(comm, ffi::RSMPI_ERRORS_RETURN)
        })?;
        Ok(RawComm(comm))
    }

    /// Frees the communicator (no operation may be pending on it).
    pub(crate) fn free(mut self) {
        // SAFETY: the handle came from MPI_Comm_dup and is freed once.
        unsafe { ffi::MPI_Comm_free(&mut self.0) };
    }
}
