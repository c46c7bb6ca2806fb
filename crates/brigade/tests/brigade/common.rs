//! Helpers shared by the checkpoint tests: a fresh directory (removed after a passing test),
//! and a config that writes or resumes a checkpoint.

use std::path::{Path, PathBuf};

use brigade::config::{CheckpointConfig, TrainConfig};

/// A fresh, empty directory for test `name` of `suite`, unique to this process: removed when
/// the test passes (bind it for the whole test), kept when it fails.
pub fn tmp(suite: &str, name: &str) -> Scratch {
    let path = std::env::temp_dir().join(format!("brigade-{suite}-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&path);
    std::fs::create_dir_all(&path).unwrap();
    Scratch { path }
}

/// A test's scratch directory: dropped while its test panics it stays, its path printed, so
/// that what the failed test wrote can be read; otherwise it is removed.
pub struct Scratch {
    path: PathBuf,
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
        } else {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// `cfg`, writing its checkpoint to `path`.
pub fn writing(cfg: TrainConfig, path: &Path) -> TrainConfig {
    let mut c = cfg;
    c.runtime.checkpoint = CheckpointConfig {
        path: Some(path.to_path_buf()),
        ..CheckpointConfig::default()
    };
    c
}

/// `cfg`, resuming from the checkpoint at `path`.
pub fn resuming(cfg: TrainConfig, path: &Path) -> TrainConfig {
    let mut c = cfg;
    c.runtime.checkpoint = CheckpointConfig {
        resume: Some(path.to_path_buf()),
        ..CheckpointConfig::default()
    };
    c
}
