//! The layout of a node's shared segment, and how a process waits on its peers there: a short
//! spin, then a futex on the node's doorbell (a process that has nothing to do gives its core
//! back), never past the collective's deadline.
//!
//! Each local rank owns one region of [`REGION_BYTES`]: a [`Control`] block (its phase
//! counter, its descriptor of the current collective, whether it is dead and why) and
//! [`SLOTS`] data slots of [`SLOT_BYTES`] (phase `q` writes slot `q % SLOTS`). Only the owner
//! writes its region's control block and slots' own parts; peers read them. The counter only
//! grows.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicU32, AtomicU64};
use std::time::Duration;

use crate::collective::DESC_BYTES;

/// Bytes of a rank's control block (page-sized, so that the data halves stay page-aligned).
pub(crate) const CONTROL_BYTES: usize = 4096;
/// Bytes of one data slot: a block of a collective. Small enough that a block's round trip
/// through the segment (written by one core, read by the others) stays in the last-level
/// cache; large enough that the one handshake per block costs little, also when the ranks
/// share their cores with compute threads and a handshake can mean a sleep.
pub(crate) const SLOT_BYTES: usize = 1 << 20;
/// Data slots per rank: a slot written in phase `q` is read by the peers in phases `q + 1`
/// (the input it holds, reduced) and `q + 1` again (the result left in its own part), and
/// written again in phase `q + 3`, by which time every peer has finished phase `q + 1`.
pub(crate) const SLOTS: usize = 3;
/// Bytes of one rank's region: its control block and its data slots.
pub(crate) const REGION_BYTES: usize = CONTROL_BYTES + SLOTS * SLOT_BYTES;
/// A [`DescSlot::heap_offset`] that says the buffer is not in the rank's shared heap.
pub(crate) const NOT_IN_HEAP: u64 = u64::MAX;
/// Longest tag kept in the segment (longer tags are compared by hash and shown cut).
pub(crate) const MAX_TAG_BYTES: usize = 256;
/// Longest reason a dead rank leaves for its peers.
pub(crate) const MAX_REASON_BYTES: usize = 512;

/// A value on its own cache line (counters written by one process and polled by others must
/// not share lines).
#[repr(C, align(64))]
pub(crate) struct Line<T>(pub(crate) T);

/// One rank's descriptor of a collective, with its tag text.
#[repr(C)]
pub(crate) struct DescSlot {
    pub(crate) bytes: [u8; DESC_BYTES],
    /// Where the rank's buffer lies in its shared heap ([`NOT_IN_HEAP`] when it does not).
    pub(crate) heap_offset: u64,
    pub(crate) tag_len: u32,
    pub(crate) tag: [u8; MAX_TAG_BYTES],
}

/// Why a rank is dead, written before its `dead` flag is raised.
#[repr(C)]
pub(crate) struct DeathNote {
    pub(crate) len: u32,
    pub(crate) text: [u8; MAX_REASON_BYTES],
}

/// The head of a rank's region. All-zero bytes are its initial state.
#[repr(C)]
pub(crate) struct Control {
    /// Phases this rank has finished writing (see `node`'s protocol).
    pub(crate) phase: Line<AtomicU64>,
    /// The node's doorbell (used in local rank 0's block only): bumped, and the futex woken,
    /// when a counter moves while someone sleeps.
    pub(crate) doorbell: Line<AtomicU32>,
    /// Processes asleep on the doorbell (local rank 0's block only).
    pub(crate) sleepers: Line<AtomicU32>,
    /// Non-zero once this rank left (a `node::Death`); `death` says why.
    pub(crate) dead: Line<AtomicU32>,
    pub(crate) death: UnsafeCell<DeathNote>,
    /// Descriptors, by phase parity: a rank writes phase `q + 2`'s only after every rank
    /// finished phase `q + 1`, i.e. finished reading phase `q`'s.
    pub(crate) descs: UnsafeCell<[DescSlot; 2]>,
}

const _: () = assert!(std::mem::size_of::<Control>() <= CONTROL_BYTES);

/// Elements `lo..hi` of rank `rank`'s part when a block of `len` elements is split over `size`
/// ranks: the thread backend's split, chunk boundaries on multiples of 32 elements.
pub(crate) fn chunk(len: usize, size: usize, rank: usize) -> (usize, usize) {
    let per = len.div_ceil(size).next_multiple_of(32);
    ((rank * per).min(len), ((rank + 1) * per).min(len))
}

#[cfg(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64")))]
mod futex {
    //! `futex(2)` on a word of the shared segment (not `FUTEX_PRIVATE`: the sleepers are
    //! other processes), through libc's `syscall`, which every Rust program on Linux links.

    use std::ffi::{c_int, c_long};
    use std::sync::atomic::AtomicU32;
    use std::time::Duration;

    extern "C" {
        fn syscall(num: c_long, ...) -> c_long;
    }

    #[cfg(target_arch = "x86_64")]
    const SYS_FUTEX: c_long = 202;
    #[cfg(target_arch = "aarch64")]
    const SYS_FUTEX: c_long = 98;
    const FUTEX_WAIT: c_int = 0;
    const FUTEX_WAKE: c_int = 1;

    #[repr(C)]
    struct Timespec {
        tv_sec: i64,
        tv_nsec: i64,
    }

    /// Sleeps while `word` holds `expected`, at most `timeout` (spurious wake-ups are fine:
    /// every caller re-checks).
    pub(crate) fn wait(word: &AtomicU32, expected: u32, timeout: Duration) {
        let ts = Timespec {
            tv_sec: timeout.as_secs() as i64,
            tv_nsec: i64::from(timeout.subsec_nanos()),
        };
        // SAFETY: FUTEX_WAIT reads the aligned u32 at `word` and the timespec; both outlive
        // the call. An error (EAGAIN: the word changed; EINTR; ETIMEDOUT) is a wake-up.
        unsafe {
            syscall(SYS_FUTEX, word.as_ptr(), FUTEX_WAIT, expected, &ts as *const Timespec);
        }
    }

    /// Wakes every process asleep on `word`.
    pub(crate) fn wake_all(word: &AtomicU32) {
        // SAFETY: FUTEX_WAKE only uses the address as a key.
        unsafe {
            syscall(SYS_FUTEX, word.as_ptr(), FUTEX_WAKE, c_int::MAX);
        }
    }
}

#[cfg(not(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64"))))]
mod futex {
    //! Without futexes: short naps (the waiters re-check after each).

    use std::sync::atomic::AtomicU32;
    use std::time::Duration;

    pub(crate) fn wait(_word: &AtomicU32, _expected: u32, timeout: Duration) {
        std::thread::sleep(timeout.min(Duration::from_micros(50)));
    }

    pub(crate) fn wake_all(_word: &AtomicU32) {}
}

pub(crate) use futex::{wait as futex_wait, wake_all as futex_wake_all};

/// Longest single sleep on the doorbell: a bound on how late a waiter notices a death that
/// rang no bell (a killed process rings nothing) or its own deadline.
pub(crate) const MAX_NAP: Duration = Duration::from_millis(50);
