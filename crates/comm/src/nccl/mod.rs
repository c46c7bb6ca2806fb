//! NCCL: collectives on GPU memory, on one CUDA comm stream per rank (with the `cuda` feature).
//!
//! - Device memory arrives as raw handles defined in this crate ([`crate::DeviceSpan`]: device
//!   pointer, element count, dtype, device ordinal; [`crate::RawStream`], [`crate::RawEvent`]):
//!   comm still knows no tensors. `ddp` takes them from the tensor crate and passes them here.
//! - [`NcclComm`]: one rank of an NCCL communicator on a comm stream the caller owns. It runs
//!   [`NcclComm::all_reduce_device`],
//!   [`NcclComm::reduce_scatter_device`] and [`NcclComm::all_gather_device`] on device memory,
//!   ordered by events only: the comm stream waits on the caller's *ready* event, runs the
//!   collective, records the caller's *done* event; the host never waits.
//! - Bootstrap: [`NcclId`] (rank 0 creates it) and [`exchange_id`], which hands its 128 bytes
//!   to every rank over any communicator (threads: in memory; MPI: a 128-byte broadcast).
//! - Faults (PyTorch's watchdog): a thread, with the device's CUDA context bound, polls every
//!   collective's completion event, `ncclCommGetAsyncError` and the enqueue in progress against
//!   the communicator's timeout; on an error or a timeout it aborts the communicator (also
//!   under an enqueue blocked inside NCCL: the abort does not wait for it), and every later
//!   call fails with a [`crate::CommError::Nccl`] naming the rank and the collective.
//!
//! cudarc loads libnccl at run time: [`nccl_present`] is asked before any NCCL call, so an
//! absent library is a typed [`crate::CommError::Unavailable`], never a panic.
//!
//! **Compile-checked only**: nothing in this module has run on a GPU yet.

mod comm;
mod id;
mod raw;
mod watchdog;

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
