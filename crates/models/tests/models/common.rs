//! What the tests that write files share: a fresh path in the system temp dir, removed after a
//! passing test.

use std::path::{Path, PathBuf};

/// A test's scratch directory or file in the system temp dir, unique to this process: dropped
/// while its test panics it stays, its path printed, so that what the failed test wrote can
/// be read; otherwise it is removed. Bind it for as long as the test uses the path.
pub struct Scratch {
    path: PathBuf,
}

impl Scratch {
    /// A fresh, empty directory `brigade-models-{name}-{pid}`.
    pub fn dir(name: &str) -> Scratch {
        let path = std::env::temp_dir().join(format!("brigade-models-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).unwrap();
        Scratch { path }
    }

    /// The path of a file `brigade-models-{pid}-{name}` (`name` keeps its extension last),
    /// not there yet.
    pub fn file(name: &str) -> Scratch {
        let path = std::env::temp_dir().join(format!("brigade-models-{}-{name}", std::process::id()));
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
