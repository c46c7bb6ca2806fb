//! Helpers shared by the checkpoint tests: a fresh directory, and a config that writes or
//! resumes a checkpoint.

use std::path::{Path, PathBuf};

use brigade::config::{CheckpointConfig, TrainConfig};

/// A fresh, empty directory for test `name` of `suite`, unique to this process.
pub fn tmp(suite: &str, name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("brigade-{suite}-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
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
