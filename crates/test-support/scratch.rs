//! A test's scratch path in the system temp dir, one type for every test crate of the
//! workspace and for the unit tests of the crates that have any (each includes this file:
//! `#[path = ".../crates/test-support/scratch.rs"] mod scratch;`). Dropped while its test panics it stays, its path printed, so that what the
//! failed test (and any process it ran) wrote can be read; otherwise it is removed. Bind it for
//! as long as the test uses the path.

use std::path::{Path, PathBuf};

pub struct Scratch {
    path: PathBuf,
}

#[allow(dead_code)] // each test crate uses the constructors it needs
impl Scratch {
    /// `path`, made an empty directory.
    pub fn empty_dir(path: PathBuf) -> Scratch {
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).unwrap();
        Scratch { path }
    }

    /// `path`, a file not there yet.
    pub fn absent_file(path: PathBuf) -> Scratch {
        let _ = std::fs::remove_file(&path);
        Scratch { path }
    }

    /// `path`, nothing there yet: a file or a directory the test makes.
    pub fn absent(path: PathBuf) -> Scratch {
        let _ = std::fs::remove_dir_all(&path);
        let _ = std::fs::remove_file(&path);
        Scratch { path }
    }
}

impl std::ops::Deref for Scratch {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.path
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.path
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("kept the failed test's files: {}", self.path.display());
        } else if self.path.is_dir() {
            let _ = std::fs::remove_dir_all(&self.path);
        } else {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}
