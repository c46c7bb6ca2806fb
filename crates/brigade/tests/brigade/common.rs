//! Helpers shared by the checkpoint tests: a fresh directory (removed after a passing test),
//! and a config that writes or resumes a checkpoint.

use std::path::Path;

use brigade::config::{CheckpointConfig, TrainConfig};

#[path = "../../../test-support/scratch.rs"]
mod scratch;
pub use scratch::Scratch;

/// A fresh, empty directory for test `name` of `suite`, unique to this process: removed when
/// the test passes (bind it for the whole test), kept when it fails.
pub fn tmp(suite: &str, name: &str) -> Scratch {
    Scratch::empty_dir(std::env::temp_dir().join(format!("brigade-{suite}-{name}-{}", std::process::id())))
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
