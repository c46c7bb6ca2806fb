//! `--tensorboard DIR` (`train`, `sweep`, `study`): the run's scalars as TensorBoard event files,
//! written by the library's observer ([`brigade::tensorboard::TensorBoard`]) as the run goes.
//! Here: DIR checked before any run, a sweep's run directories, and a failed write worded with
//! its flag (the run goes on; the failure ends the command's exit status, once).

use std::path::Path;

use brigade::tensorboard::TensorBoard;

use crate::error::{Error, Result};
use crate::outputs::{check_outputs, Output};

/// Makes `dir` ready before any run: not a file nor under one, created when missing, and
/// takes new files. One usage line names what is wrong.
pub fn prepare(dir: &Path) -> Result<()> {
    if let Some(file) = dir.ancestors().find(|p| p.exists() && !p.is_dir()) {
        return Err(Error::Usage(format!(
            "--tensorboard {}: {} is not a directory; --tensorboard names a directory (created if missing) for the event files",
            dir.display(),
            file.display()
        )));
    }
    std::fs::create_dir_all(dir).map_err(|source| Error::Io {
        path: format!("--tensorboard {}", dir.display()),
        source,
    })?;
    check_outputs(&[Output::new("--tensorboard", &dir.join("events.out.tfevents"))])
}

/// [`prepare`] for a run that writes `outputs` too, whose own checks (`check`) follow: refuses a
/// directory on the path of one of them, and removes the directories it made when `check`
/// fails (a refused run leaves nothing behind).
pub fn prepare_then(dir: &Path, outputs: &[Output], check: impl FnOnce() -> Result<()>) -> Result<()> {
    let here = crate::outputs::resolved("--tensorboard", dir);
    if let Some(o) = outputs
        .iter()
        .find(|o| here.is_some() && crate::outputs::resolved(&o.flag, &o.path) == here)
    {
        return Err(Error::Usage(format!(
            "--tensorboard {} and {} {} are the same path: give the event files' directory its own",
            dir.display(),
            o.flag,
            o.path.display()
        )));
    }
    // a directory that holds anything by then is not ours to remove
    let made = crate::outputs::MadeDirs::missing([dir]);
    let checked = prepare(dir).and_then(|()| check());
    if checked.is_ok() {
        made.keep();
    }
    checked
}

/// The directory of one run of a sweep or study in `dir` ([`brigade::tensorboard::run_dir`]).
pub fn run_dir(dir: &Path, name: &str) -> std::path::PathBuf {
    brigade::tensorboard::run_dir(dir, name)
}

/// `written` (the other outputs' result) with the first write `boards` could not make, named
/// by its flag and directory, among the failures (the others were written).
pub fn with_failures<'a>(written: Result<()>, boards: impl IntoIterator<Item = &'a TensorBoard>) -> Result<()> {
    let failures: Vec<String> = boards
        .into_iter()
        .filter_map(|tb| {
            let e = tb.take_failure()?;
            let hint = match &e {
                // say what happened in words, as the other outputs do: "disk full", "file size limit"
                brigade::Error::Io { source, .. } => format!(" ({})", brigade_models::io::write_error_hint(source)),
                _ => String::new(),
            };
            Some(format!("--tensorboard {}: {e}{hint}", tb.dir().display()))
        })
        .collect();
    if failures.is_empty() {
        return written;
    }
    match written {
        Ok(()) => Err(Error::Outputs(failures)),
        Err(Error::Outputs(mut earlier)) => {
            earlier.extend(failures);
            Err(Error::Outputs(earlier))
        }
        Err(e) => Err(Error::Outputs(std::iter::once(e.to_string()).chain(failures).collect())),
    }
}
