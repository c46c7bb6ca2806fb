//! NCCL: collectives on GPU memory, on one dedicated CUDA comm stream per rank.
//!
//! - [`DeviceBuffer`]: a flat f32 buffer in GPU memory, the device counterpart of
//!   [`crate::Buffer`] (comm still knows no tensors), with the event its producer recorded
//!   (*ready*) and, after a collective, the event the comm stream recorded (*done*).
//! - [`NcclComm`]: one rank of an NCCL communicator. It fulfils the [`crate::Communicator`]
//!   contract on host buffers (staged through the GPU, for control messages) and reduces
//!   [`DeviceBuffer`]s in place with [`NcclComm::all_reduce_device`], ordered by events only:
//!   the host never waits for a device collective.
//! - Bootstrap: [`NcclId`] (rank 0 creates it) and [`exchange_id`], which hands its 128 bytes
//!   to every rank over any communicator (threads: in memory; MPI: a 128-byte broadcast).
//! - Faults (PyTorch's watchdog): a thread polls every collective's completion event and
//!   `ncclCommGetAsyncError` against the communicator's timeout; on an error or a timeout it
//!   aborts the communicator, and every later call fails with a [`crate::CommError::Nccl`]
//!   naming the rank and the collective.
//!
//! cudarc loads libnccl at run time: [`nccl_present`] is asked before any NCCL call, so an
//! absent library is a typed [`crate::CommError::Unavailable`], never a panic.
//!
//! **Compile-checked only**: nothing in this module has run on a GPU yet.

mod buffer;
mod comm;
mod id;
mod raw;
mod watchdog;

pub use buffer::DeviceBuffer;
pub use comm::NcclComm;
pub use id::{exchange_id, NcclId};

/// True when libnccl can be loaded (asks the loader only; calls no NCCL function).
pub fn nccl_present() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { cudarc::nccl::sys::is_culib_present() }
}

/// True when the CUDA driver library can be loaded.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// `Ok` when NCCL and the CUDA driver can be loaded; otherwise the typed error naming the
/// missing library.
pub fn require_nccl() -> Result<(), crate::CommError> {
    if !driver_present() {
        return Err(crate::CommError::Unavailable(
            "NCCL needs the CUDA driver library libcuda.so.1, which was not found (is an NVIDIA driver installed?)"
                .into(),
        ));
    }
    if !nccl_present() {
        return Err(crate::CommError::Unavailable(
            "libnccl.so was not found (install the nvidia-nccl wheel and put a libnccl.so link to its libnccl.so.2 \
             in a directory on LD_LIBRARY_PATH)"
                .into(),
        ));
    }
    Ok(())
}
