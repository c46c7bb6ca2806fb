//! SIGINT and SIGTERM become a stop request that the training loop honours at the next step
//! boundary (every rank agrees on the step), so an interrupted run still writes its losses, its
//! timeline and its checkpoint.
//!
//! - **During setup** (before this process's ranks first ask whether to stop, i.e. before any
//!   step finished) there is nothing to keep: the process exits at once with status 130,
//!   removing the lock files it took ([`register_cleanup`]) and writing nothing else.
//! - **A repeat within [`GRACE`]** of the first signal is the same request: GNU `timeout` sends
//!   SIGTERM to the child and then to its process group, 1 ms apart, and a shell's Ctrl-C
//!   reaches every process of the group.
//! - **A later signal** while the run trains (or writes its outputs) is the same request too:
//!   the run still ends at the step boundary, writes its outputs and removes its lock files;
//!   the handler says so in one line on stderr (SIGKILL ends the process at once).
//!
//! SIGXFSZ is ignored ([`ignore_file_size_signal`]): a write past `ulimit -f` then fails with
//! EFBIG and is reported like a full disk, instead of killing the process silently.
//!
//! The handler touches only atomics and async-signal-safe libc calls (`clock_gettime`, `write`,
//! `unlink`, `_exit`, `signal`, `raise`), which the standard library already links.
//!
//! It runs on a thread of its own: [`StopOnSignal::install`] blocks SIGINT and SIGTERM in the
//! calling thread, and so in every thread started after it (the ranks, their compute pools,
//! OpenMP's and MPI's threads), and starts one thread that takes them. A signal handled on a
//! thread inside oneDNN's JIT-compiled `dnnl_sgemm` corrupts the heap (glibc then aborts with
//! "corrupted size vs. prev_size while consolidating" in the GEMM's `free`), so no compute thread
//! may ever run the handler.
//! [`StopOnSignal`] hands the flag to the run as its observer's stop request.

use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use brigade::observe::TrainObserver;

/// A repeated SIGINT/SIGTERM within this time of the first is the same request.
pub const GRACE: Duration = Duration::from_secs(1);

/// Set once SIGINT or SIGTERM arrived.
static STOP: AtomicBool = AtomicBool::new(false);
/// When the first signal arrived (monotonic clock, nanoseconds, +1 so that 0 means never).
static FIRST_NS: AtomicU64 = AtomicU64::new(0);
/// Set once a rank of this process asked whether to stop: from then on every signal stops the
/// run at a step boundary; before, the first ends the process at once.
static TRAINING: AtomicBool = AtomicBool::new(false);

/// Files to remove when a signal ends the process during setup (NUL-terminated paths, leaked:
/// the handler may read them at any time).
static CLEANUP: [AtomicPtr<std::ffi::c_char>; 16] = [const { AtomicPtr::new(std::ptr::null_mut()) }; 16];

/// Removes `path` if a signal ends the process during setup (a lock file it created). At most
/// 16 paths; later ones are not registered.
pub fn register_cleanup(path: &std::path::Path) {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
        return;
    };
    let raw = c.into_raw();
    for slot in &CLEANUP {
        if slot
            .compare_exchange(std::ptr::null_mut(), raw, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            return;
        }
    }
    // SAFETY: `raw` came from `CString::into_raw` and was not stored.
    drop(unsafe { std::ffi::CString::from_raw(raw) });
}

/// Threads inside [`create_removable`] now: a signal while starting waits for them (briefly)
/// before it removes the registered files, so that none is created after the removal.
static CREATING: AtomicUsize = AtomicUsize::new(0);

/// Runs `create`, which makes the file at `path`, so that a signal ending the process while
/// it starts removes that file whichever thread creates it and whenever the signal comes:
/// `path` is registered before the file exists, the handler waits for a creation in progress,
/// and after a signal nothing more is created (an `Interrupted` error instead).
pub fn create_removable<T>(path: &std::path::Path, create: impl FnOnce() -> std::io::Result<T>) -> std::io::Result<T> {
    CREATING.fetch_add(1, Ordering::SeqCst);
    let made = if STOP.load(Ordering::SeqCst) {
        Err(std::io::Error::new(
            std::io::ErrorKind::Interrupted,
            "the run is being stopped",
        ))
    } else {
        register_cleanup(path);
        create()
    };
    CREATING.fetch_sub(1, Ordering::SeqCst);
    made
}

/// Forgets `path` (its lock file was removed normally).
pub fn unregister_cleanup(path: &std::path::Path) {
    use std::os::unix::ffi::OsStrExt;
    for slot in &CLEANUP {
        let p = slot.load(Ordering::SeqCst);
        // SAFETY: non-null slots hold leaked `CString`s, never freed while registered.
        if !p.is_null() && unsafe { std::ffi::CStr::from_ptr(p) }.to_bytes() == path.as_os_str().as_bytes() {
            slot.store(std::ptr::null_mut(), Ordering::SeqCst);
            // leaked on purpose: the handler may be reading it right now
            return;
        }
    }
}

/// The name of the thread that SIGINT and SIGTERM are handled on.
const SIGNAL_THREAD: &str = "brigade-signals";

mod unix {
    use super::{Ordering, CLEANUP, CREATING, FIRST_NS, GRACE, SIGNAL_THREAD, STOP, TRAINING};

    const SIGINT: i32 = 2;
    const SIGTERM: i32 = 15;
    const SIGXFSZ: i32 = 25;
    const SIG_DFL: usize = 0;
    const SIG_IGN: usize = 1;
    const CLOCK_MONOTONIC: i32 = 1;

    #[repr(C)]
    struct Timespec {
        tv_sec: i64,
        tv_nsec: i64,
    }

    extern "C" {
        fn signal(signum: i32, handler: usize) -> usize;
        fn raise(signum: i32) -> i32;
        fn clock_gettime(clock: i32, tp: *mut Timespec) -> i32;
        fn write(fd: i32, buf: *const u8, count: usize) -> isize;
        fn unlink(path: *const std::ffi::c_char) -> i32;
        fn _exit(status: i32) -> !;
        fn pthread_sigmask(how: i32, set: *const SigSet, old: *mut SigSet) -> i32;
        fn sigemptyset(set: *mut SigSet) -> i32;
        fn sigaddset(set: *mut SigSet, signum: i32) -> i32;
        #[cfg(test)]
        fn sigismember(set: *const SigSet, signum: i32) -> i32;
        fn pause() -> i32;
    }

    const SIG_BLOCK: i32 = 0;
    const SIG_UNBLOCK: i32 = 1;

    /// glibc's `sigset_t` (1024 bits).
    #[repr(C)]
    pub(super) struct SigSet([u64; 16]);

    /// SIGINT and SIGTERM.
    fn stop_signals() -> SigSet {
        let mut set = SigSet([0; 16]);
        // SAFETY: `set` is a valid sigset_t; both numbers are valid signals.
        unsafe {
            sigemptyset(&mut set);
            sigaddset(&mut set, SIGINT);
            sigaddset(&mut set, SIGTERM);
        }
        set
    }

    /// Whether the calling thread blocks SIGINT and SIGTERM.
    #[cfg(test)]
    pub(super) fn stop_signals_blocked() -> bool {
        let mut now = SigSet([0; 16]);
        // SAFETY: a null `set` only reads the calling thread's mask into `now`.
        unsafe { pthread_sigmask(SIG_BLOCK, std::ptr::null(), &mut now) };
        // SAFETY: `now` is a valid sigset_t.
        unsafe { sigismember(&now, SIGINT) == 1 && sigismember(&now, SIGTERM) == 1 }
    }

    /// Blocks SIGINT and SIGTERM in the calling thread (and so in the threads it starts from
    /// now on) and starts, once per process, the thread that takes them: it unblocks them and
    /// sleeps, so the handler runs there and never on a thread inside a kernel.
    fn route_to_own_thread() {
        static STARTED: std::sync::Once = std::sync::Once::new();
        let set = stop_signals();
        // SAFETY: changes the calling thread's signal mask only.
        unsafe { pthread_sigmask(SIG_BLOCK, &set, std::ptr::null_mut()) };
        STARTED.call_once(|| {
            let started = std::thread::Builder::new().name(SIGNAL_THREAD.into()).spawn(|| {
                let set = stop_signals();
                // SAFETY: changes this thread's signal mask only.
                unsafe { pthread_sigmask(SIG_UNBLOCK, &set, std::ptr::null_mut()) };
                loop {
                    // SAFETY: sleeps until a signal's handler returned.
                    unsafe { pause() };
                }
            });
            if started.is_err() {
                // no thread to take them: unblocked again, handled wherever they land
                // SAFETY: changes the calling thread's signal mask only.
                unsafe { pthread_sigmask(SIG_UNBLOCK, &set, std::ptr::null_mut()) };
            }
        });
    }

    fn now_ns() -> u64 {
        let mut t = Timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: clock_gettime is async-signal-safe and writes only `t`.
        unsafe { clock_gettime(CLOCK_MONOTONIC, &mut t) };
        (t.tv_sec as u64)
            .wrapping_mul(1_000_000_000)
            .wrapping_add(t.tv_nsec as u64)
    }

    extern "C" fn on_signal(signum: i32) {
        let now = now_ns().wrapping_add(1);
        match FIRST_NS.compare_exchange(0, now, Ordering::SeqCst, Ordering::SeqCst) {
            Ok(_) => {
                STOP.store(true, Ordering::SeqCst);
                if !TRAINING.load(Ordering::SeqCst) {
                    // still setting up: nothing finished to keep; leave as if never started
                    const MSG: &[u8] = b"error: interrupted before step 0 (while starting): nothing was written\n";
                    // a file being created now on another thread is registered already: wait
                    // for it to exist (bounded: this thread may be the one creating it)
                    let mut spins = 0u32;
                    while CREATING.load(Ordering::SeqCst) > 0 && spins < 20_000_000 {
                        std::hint::spin_loop();
                        spins += 1;
                    }
                    // SAFETY: write, unlink and _exit are async-signal-safe; the paths are
                    // leaked NUL-terminated strings.
                    unsafe {
                        for slot in &CLEANUP {
                            let p = slot.load(Ordering::SeqCst);
                            if !p.is_null() {
                                unlink(p);
                            }
                        }
                        write(2, MSG.as_ptr(), MSG.len());
                        _exit(130);
                    }
                }
            }
            Err(first) if now.saturating_sub(first) < GRACE.as_nanos() as u64 => {
                // the same request again (e.g. `timeout`: to the child, then to its group)
            }
            Err(_) if TRAINING.load(Ordering::SeqCst) => {
                // a later signal: the stop is under way; ending now would lose the finished
                // steps' outputs and leave the lock files
                const MSG: &[u8] = b"note: stopping after the step in progress, then writing the outputs (SIGKILL ends at once, writing nothing)\n";
                // SAFETY: write is async-signal-safe.
                unsafe { write(2, MSG.as_ptr(), MSG.len()) };
            }
            Err(_) => {
                // a later signal while the start-up exit is under way (it removes the files):
                // the default action, as before the handler
                // SAFETY: signal and raise are async-signal-safe.
                unsafe {
                    signal(signum, SIG_DFL);
                    raise(signum);
                }
            }
        }
    }

    pub fn install() {
        route_to_own_thread();
        for signum in [SIGINT, SIGTERM] {
            // SAFETY: `on_signal` only touches atomics and async-signal-safe libc calls.
            unsafe {
                let previous = signal(signum, on_signal as extern "C" fn(i32) as usize);
                if previous == SIG_IGN {
                    // Started with the signal ignored (e.g. `nohup`): keep it so.
                    signal(signum, SIG_IGN);
                }
            }
        }
    }

    pub fn ignore_file_size_signal() {
        // SAFETY: ignoring a signal has no handler to be unsafe in.
        unsafe { signal(SIGXFSZ, SIG_IGN) };
    }
}

/// Ignores SIGXFSZ for the rest of this process: a write past the file size limit (`ulimit -f`)
/// fails with EFBIG, which the write reports, instead of killing the process with no message.
pub fn ignore_file_size_signal() {
    unix::ignore_file_size_signal();
}

/// Asks the run to stop once SIGINT or SIGTERM arrived (every rank polls it once a step).
#[derive(Clone, Copy)]
pub struct StopOnSignal(());

impl StopOnSignal {
    /// Turns SIGINT and SIGTERM into a stop request for the rest of this process (an exit
    /// with status 130 while the run is still starting).
    pub fn install() -> StopOnSignal {
        unix::install();
        StopOnSignal(())
    }
}

impl TrainObserver for StopOnSignal {
    fn stop_requested(&self) -> bool {
        // from the first time a rank asks on, a signal is honoured at a step boundary: the
        // flag is read after the phase changes, so a signal is seen by one path or the other
        TRAINING.store(true, Ordering::SeqCst);
        STOP.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The names and blocked-signal masks (`SigBlk`, hex) of this process's threads.
    fn thread_masks() -> Vec<(String, u64)> {
        let mut out = vec![];
        for task in std::fs::read_dir("/proc/self/task").expect("/proc/self/task") {
            let dir = task.expect("a task").path();
            let (Ok(name), Ok(status)) = (
                std::fs::read_to_string(dir.join("comm")),
                std::fs::read_to_string(dir.join("status")),
            ) else {
                continue; // ended meanwhile
            };
            let blocked = status
                .lines()
                .find_map(|l| l.strip_prefix("SigBlk:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
                .expect("SigBlk");
            out.push((name.trim().to_string(), blocked));
        }
        out
    }

    /// SIGINT (2) and SIGTERM (15) as bits of a `SigBlk` mask.
    const STOP_BITS: u64 = (1 << (2 - 1)) | (1 << (15 - 1));

    #[test]
    fn the_handler_runs_on_its_own_thread_never_on_a_compute_thread() {
        StopOnSignal::install();
        assert!(unix::stop_signals_blocked(), "the installing thread blocks them");
        let compute = std::thread::spawn(unix::stop_signals_blocked).join().unwrap();
        assert!(compute, "a thread started afterwards (a rank, a pool) blocks them");
        let takers: Vec<String> = thread_masks()
            .into_iter()
            .filter(|(_, blocked)| blocked & STOP_BITS == 0)
            .map(|(name, _)| name)
            .collect();
        assert!(
            takers.iter().any(|n| n == SIGNAL_THREAD),
            "one thread takes them: {takers:?}"
        );
    }
}
