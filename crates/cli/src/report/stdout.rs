//! Printing to stdout without panicking (`println!` panics when the write fails). A reader that
//! went away (`brigade ... | head`) is no error: what is left to print is dropped, and the
//! command ends as it would have. Any other failure (a full disk) is kept, and the command
//! fails with it at the end ([`failure`]), after everything else it does, its files included.

use std::io::{ErrorKind, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use crate::error::{Error, Result};

/// Set once a write to stdout failed: nothing more is printed.
static FAILED: AtomicBool = AtomicBool::new(false);

/// The first failure that was not a closed pipe.
static FAILURE: Mutex<Option<std::io::Error>> = Mutex::new(None);

/// Writes `args` to stdout and flushes it, unless an earlier write failed; a failure is kept
/// (see the module docs).
pub fn write_fmt(args: std::fmt::Arguments<'_>) {
    if FAILED.load(Ordering::Relaxed) {
        return;
    }
    let mut out = std::io::stdout().lock();
    if let Err(e) = out.write_fmt(args).and_then(|()| out.flush()) {
        FAILED.store(true, Ordering::Relaxed);
        if e.kind() != ErrorKind::BrokenPipe {
            FAILURE.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e);
        }
    }
}

/// The failure to print, if there was one other than a closed pipe, as the command's error.
pub fn failure() -> Result<()> {
    match FAILURE.lock().unwrap_or_else(|p| p.into_inner()).take() {
        Some(source) => Err(Error::Io {
            path: "stdout (the files were written; this text was not)".into(),
            source,
        }),
        None => Ok(()),
    }
}

/// `print!` through [`write_fmt`].
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::report::stdout::write_fmt(format_args!($($arg)*))
    };
}

/// `println!` through [`write_fmt`].
macro_rules! outln {
    () => {
        $crate::report::stdout::write_fmt(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::report::stdout::write_fmt(format_args!("{}\n", format_args!($($arg)*)))
    };
}

pub(crate) use {out, outln};
