//! The thin layer over the MPI C API that the transport needs: checked calls, the datatypes of
//! Brigade's buffers, the NaN-propagating `max` operator, `MPI_IN_PLACE`, `Send` handles for
//! communicators and shared-memory windows.

use std::ffi::{c_int, c_void};
use std::sync::OnceLock;

use ::mpi::ffi;

use crate::collective::nan_max;
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

/// `MPI_UINT64_T` (descriptor words).
pub(crate) fn u64_datatype() -> ffi::MPI_Datatype {
    // SAFETY: reading a constant handle.
    unsafe { ffi::RSMPI_UINT64_T }
}

/// `MPI_BAND` (descriptor agreement).
pub(crate) fn band_op() -> ffi::MPI_Op {
    // SAFETY: reading a constant handle.
    unsafe { ffi::RSMPI_BAND }
}

/// The MPI library's own description (`MPI_Get_library_version`).
pub(crate) fn library_version() -> String {
    let mut buf = vec![0u8; 8192]; // MPI_MAX_LIBRARY_VERSION_STRING is at most a few KiB
    let mut len: c_int = 0;
    // SAFETY: `buf` is larger than MPI_MAX_LIBRARY_VERSION_STRING; callable before MPI_Init.
    let rc = unsafe { ffi::MPI_Get_library_version(buf.as_mut_ptr().cast(), &mut len) };
    if rc != ffi::MPI_SUCCESS as c_int {
        return String::new();
    }
    buf.truncate(len.clamp(0, 8192) as usize);
    String::from_utf8_lossy(&buf).into_owned()
}

/// `MPI_IN_PLACE`, which the bindings cannot export (it is a cast in a C macro): `(void *) 1`
/// in Open MPI, `(void *) -1` in MPICH and its derivatives (Intel MPI, MVAPICH, Cray MPICH).
/// `None` for another library: the transport then reduces out of a copy.
pub(crate) fn in_place() -> Option<*const c_void> {
    static IN_PLACE: OnceLock<Option<usize>> = OnceLock::new();
    let value = *IN_PLACE.get_or_init(|| {
        let version = library_version();
        if version.contains("Open MPI") {
            Some(1)
        } else if ["MPICH", "Intel(R) MPI", "MVAPICH"].iter().any(|n| version.contains(n)) {
            Some(usize::MAX)
        } else {
            None
        }
    });
    value.map(|v| v as *const c_void)
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
/// `Send`; moving one between threads is sound because MPI is initialized with
/// `MPI_THREAD_MULTIPLE` (or `SERIALIZED`) and its transport is used by one thread at a time
/// (the comm stream's, or a caller's that runs a collective while the stream is idle).
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

    /// The ranks of `self` that share memory with this process (`MPI_Comm_split_type` with
    /// `MPI_COMM_TYPE_SHARED`), ordered by their rank in `self`. Collective over `self`.
    pub(crate) fn split_shared(&self, rank: usize) -> Result<RawComm, CommError> {
        // SAFETY: reading constant handles; `comm` is overwritten by the call.
        let mut comm = unsafe { ffi::RSMPI_COMM_NULL };
        mpi_check!(rank, "MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)", unsafe {
            ffi::MPI_Comm_split_type(self.0, ffi::RSMPI_COMM_TYPE_SHARED, 0, ffi::RSMPI_INFO_NULL, &mut comm)
        })?;
        Self::returning_errors(comm, rank)
    }

    /// The ranks of `self` that passed the same `color`, ordered by `key`. Collective.
    pub(crate) fn split(&self, rank: usize, color: usize, key: usize) -> Result<RawComm, CommError> {
        // SAFETY: as above.
        let mut comm = unsafe { ffi::RSMPI_COMM_NULL };
        mpi_check!(rank, "MPI_Comm_split", unsafe {
            ffi::MPI_Comm_split(self.0, color as c_int, key as c_int, &mut comm)
        })?;
        Self::returning_errors(comm, rank)
    }

    fn returning_errors(comm: ffi::MPI_Comm, rank: usize) -> Result<RawComm, CommError> {
        let comm = RawComm(comm);
        mpi_check!(rank, "MPI_Comm_set_errhandler(MPI_ERRORS_RETURN)", unsafe {
            ffi::MPI_Comm_set_errhandler(comm.0, ffi::RSMPI_ERRORS_RETURN)
        })?;
        Ok(comm)
    }

    /// This process's rank in the communicator, and its size.
    pub(crate) fn rank_and_size(&self) -> (usize, usize) {
        let (mut rank, mut size): (c_int, c_int) = (0, 0);
        // SAFETY: a valid communicator; both calls only write their output.
        unsafe {
            ffi::MPI_Comm_rank(self.0, &mut rank);
            ffi::MPI_Comm_size(self.0, &mut size);
        }
        (rank.max(0) as usize, size.max(0) as usize)
    }

    /// Blocking in-place all-reduce of `words` (small control data, e.g. descriptors).
    pub(crate) fn all_reduce_u64(
        &self,
        rank: usize,
        words: &mut [u64],
        op: ffi::MPI_Op,
        what: &str,
    ) -> Result<(), CommError> {
        let len = words.len() as c_int;
        let out = words.as_mut_ptr().cast::<c_void>();
        match in_place() {
            Some(in_place) => mpi_check!(rank, what, unsafe {
                ffi::MPI_Allreduce(in_place, out, len, u64_datatype(), op, self.0)
            }),
            None => {
                let send = words.to_vec();
                mpi_check!(rank, what, unsafe {
                    ffi::MPI_Allreduce(send.as_ptr().cast(), out, len, u64_datatype(), op, self.0)
                })
            }
        }
    }

    /// Frees the communicator (no operation may be pending on it).
    pub(crate) fn free(mut self) {
        // SAFETY: the handle came from MPI_Comm_dup or a split and is freed once.
        unsafe { ffi::MPI_Comm_free(&mut self.0) };
    }
}

/// A shared-memory window over a node's communicator (`MPI_Win_allocate_shared`): every rank
/// maps every rank's part. `Send` for the reason given at [`RawComm`].
pub(crate) struct SharedWindow {
    win: ffi::MPI_Win,
    /// Base of each rank's part, in the node communicator's rank order.
    pub(crate) parts: Vec<*mut u8>,
}

// SAFETY: as for `RawComm`; the mapped parts are used only by the thread that owns the window.
unsafe impl Send for SharedWindow {}

impl SharedWindow {
    /// Allocates `bytes` for this rank in a window over `node` (collective over `node`, whose
    /// ranks must share memory) and looks up every rank's part, each aligned to a page (MPI
    /// may put a header before a part: the allocation is one page larger, and since every
    /// process maps the segment at a page boundary, every process finds the same aligned
    /// start).
    pub(crate) fn allocate(node: &RawComm, rank: usize, bytes: usize) -> Result<SharedWindow, CommError> {
        const PAGE: usize = 4096;
        let (_, size) = node.rank_and_size();
        let asked = bytes;
        let bytes = bytes + PAGE;
        let mut base: *mut u8 = std::ptr::null_mut();
        // SAFETY: reading a constant handle; overwritten by the call.
        let mut win = unsafe { ffi::RSMPI_WIN_NULL };
        mpi_check!(rank, "MPI_Win_allocate_shared", unsafe {
            ffi::MPI_Win_allocate_shared(
                bytes as ffi::MPI_Aint,
                1,
                ffi::RSMPI_INFO_NULL,
                node.0,
                (&mut base as *mut *mut u8).cast(),
                &mut win,
            )
        })?;
        let mut window = SharedWindow { win, parts: Vec::new() };
        for peer in 0..size {
            let mut part: *mut u8 = std::ptr::null_mut();
            let (mut len, mut unit): (ffi::MPI_Aint, c_int) = (0, 0);
            mpi_check!(rank, "MPI_Win_shared_query", unsafe {
                ffi::MPI_Win_shared_query(
                    window.win,
                    peer as c_int,
                    &mut len,
                    &mut unit,
                    (&mut part as *mut *mut u8).cast(),
                )
            })?;
            let skip = (part as usize).next_multiple_of(PAGE) - part as usize;
            if part.is_null() || (len as usize) < skip + asked {
                return Err(CommError::Internal(format!(
                    "rank {rank}: the shared window's part of node rank {peer} is unusable ({len} bytes at \
                     {part:?}; {bytes} bytes were asked for)"
                )));
            }
            // SAFETY: `skip + asked <= len`: still inside the part.
            window.parts.push(unsafe { part.add(skip) });
        }
        Ok(window)
    }

    /// Frees the window (collective over the node; no peer may still read it).
    pub(crate) fn free(mut self) {
        // SAFETY: the handle came from MPI_Win_allocate_shared and is freed once.
        unsafe { ffi::MPI_Win_free(&mut self.win) };
    }
}
