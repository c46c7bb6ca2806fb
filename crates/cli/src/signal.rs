//! SIGINT and SIGTERM become a stop request that the training loop honours at the next step
//! boundary (every rank agrees on the step), so an interrupted run still writes its losses, its
//! timeline and its checkpoint. A second signal ends the process at once, as by default.
//!
//! The handler only sets an atomic flag (async-signal-safe); it is installed through libc's
//! `signal`, which the standard library already links. [`StopOnSignal`] hands the flag to the
//! run as its observer's stop request.

use std::sync::atomic::{AtomicBool, Ordering};

use brigade::observe::TrainObserver;

/// Set once SIGINT or SIGTERM arrived.
static STOP: AtomicBool = AtomicBool::new(false);

#[cfg(unix)]
mod unix {
    use super::{Ordering, STOP};

    const SIGINT: i32 = 2;
    const SIGTERM: i32 = 15;
    const SIG_DFL: usize = 0;
    const SIG_IGN: usize = 1;

    extern "C" {
        fn signal(signum: i32, handler: usize) -> usize;
        fn raise(signum: i32) -> i32;
    }

    extern "C" fn on_signal(signum: i32) {
        if STOP.swap(true, Ordering::SeqCst) {
            // The second time: the user insists; die of the signal as the default action would.
            unsafe {
                signal(signum, SIG_DFL);
                raise(signum);
            }
        }
    }

    pub fn install() {
        for signum in [SIGINT, SIGTERM] {
            // SAFETY: `on_signal` only touches an atomic and async-signal-safe libc calls.
            unsafe {
                let previous = signal(signum, on_signal as extern "C" fn(i32) as usize);
                if previous == SIG_IGN {
                    // Started with the signal ignored (e.g. `nohup`): keep it so.
                    signal(signum, SIG_IGN);
                }
            }
        }
    }
}

/// Asks the run to stop once SIGINT or SIGTERM arrived (every rank polls it once a step).
pub struct StopOnSignal(());

impl StopOnSignal {
    /// Turns SIGINT and SIGTERM into a stop request for the rest of this process.
    pub fn install() -> StopOnSignal {
        #[cfg(unix)]
        unix::install();
        StopOnSignal(())
    }
}

impl TrainObserver for StopOnSignal {
    fn stop_requested(&self) -> bool {
        STOP.load(Ordering::SeqCst)
    }
}
