//! The files of a run's checkpoints: the `{step}` in [`CheckpointConfig::path`] and the
//! newest [`CheckpointConfig::keep_last`] of them kept.

use std::path::{Path, PathBuf};

use crate::config::CheckpointConfig;
use crate::error::{Error, Result};

/// What [`CheckpointConfig::path`] replaces by the step.
const STEP: &str = "{step}";

impl CheckpointConfig {
    /// The file the checkpoint that resumes at `step` is written to: [`CheckpointConfig::path`]
    /// with `{step}` replaced by `step` (`None` without a path).
    pub fn path_at(&self, step: usize) -> Option<PathBuf> {
        let path = self.path.as_ref()?;
        Some(match file_name(path) {
            Some(name) if name.contains(STEP) => path.with_file_name(name.replace(STEP, &step.to_string())),
            _ => path.clone(),
        })
    }

    /// Refuses what would not do what it says: `{step}` outside the file name (the directory
    /// is not a template), `keep_last` of 0, or `keep_last` without a path holding `{step}`
    /// (one file is always the newest alone).
    pub(crate) fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Config(m));
        if let Some(path) = &self.path {
            let in_dir = path.parent().is_some_and(|d| d.to_string_lossy().contains(STEP));
            if in_dir {
                return bad(format!(
                    "checkpoint path '{}': {STEP} may appear in the file name only",
                    path.display()
                ));
            }
        }
        match (self.keep_last, self.path.as_deref().and_then(file_name)) {
            (Some(0), _) => bad("keep_last must be at least 1 (checkpoints to keep)".into()),
            (Some(k), name) if !name.is_some_and(|n| n.contains(STEP)) => bad(format!(
                "keep_last {k} needs {STEP} in the checkpoint path (each checkpoint replaces the last without it)"
            )),
            _ => Ok(()),
        }
    }

    /// Removes the oldest checkpoints of a `{step}` path beyond the newest `keep_last` (rank 0,
    /// after a write). Files the template does not name are never touched.
    pub(crate) fn prune(&self) -> Result<()> {
        let (Some(keep), Some(path)) = (self.keep_last, &self.path) else {
            return Ok(());
        };
        let Some((head, tail)) = file_name(path).and_then(|n| n.split_once(STEP)) else {
            return Ok(());
        };
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let io = |source| Error::Io {
            path: dir.display().to_string(),
            source,
        };
        let mut written: Vec<(usize, PathBuf)> = vec![];
        for entry in std::fs::read_dir(&dir).map_err(io)? {
            let entry = entry.map_err(io)?;
            let name = entry.file_name();
            let Some(digits) = name.to_str().and_then(|n| n.strip_prefix(head)?.strip_suffix(tail)) else {
                continue;
            };
            if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
                if let Ok(step) = digits.parse::<usize>() {
                    written.push((step, entry.path()));
                }
            }
        }
        written.sort();
        let excess = written.len().saturating_sub(keep);
        for (_, old) in &written[..excess] {
            std::fs::remove_file(old).map_err(|source| Error::Io {
                path: old.display().to_string(),
                source,
            })?;
        }
        Ok(())
    }
}

fn file_name(path: &Path) -> Option<&str> {
    path.file_name()?.to_str()
}
