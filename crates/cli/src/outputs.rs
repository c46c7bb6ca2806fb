//! The files a run writes: checked before step 0 (so a typo costs seconds, not a whole
//! training), and written at the end all together, one failure never costing the others.

use std::io::ErrorKind;
use std::path::{Path, PathBuf};

use brigade::checkpoint_files::RunFile;

use crate::error::{Error, Result};

/// Writes `bytes` to `path` atomically (see [`brigade_models::write_atomic`]: a unique
/// temporary beside the target, synced, then renamed; a symbolic link keeps pointing at
/// the file it names, which is what gets written).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    brigade_models::write_atomic(path, bytes).map_err(|source| Error::Io {
        path: path.display().to_string(),
        source: match source.kind() {
            // say what happened in words: "disk full", "file size limit"
            ErrorKind::StorageFull | ErrorKind::QuotaExceeded | ErrorKind::FileTooLarge => std::io::Error::new(
                source.kind(),
                format!("{source} ({})", brigade_models::io::write_error_hint(&source)),
            ),
            _ => source,
        },
    })
}

/// One output a run will write: the flag that asked for it and its path.
#[derive(Clone, Debug)]
pub struct Output {
    /// `--save`, `--losses`, ... (for messages).
    pub flag: String,
    /// Where it goes.
    pub path: PathBuf,
}

impl Output {
    /// An output requested by `flag`.
    pub fn new(flag: &str, path: &Path) -> Self {
        Output {
            flag: flag.to_string(),
            path: path.to_path_buf(),
        }
    }
}

/// Where a write of `path` really lands, absolute: symbolic links followed, the directory
/// resolved, so that two spellings of one file compare equal.
fn landing(o: &Output) -> Result<PathBuf> {
    let usage = |m: String| Error::Usage(format!("{} {}: {m}", o.flag, o.path.display()));
    // `out/` or `out/.` names a directory, though the path's last component reads `out`: the
    // write would fail (not a directory) after the whole run
    let spelled = o.path.as_os_str().as_encoded_bytes();
    if spelled.ends_with(b"/") || spelled.ends_with(b"/.") || spelled == b"." {
        return Err(usage("names a directory, not a file; give a file name".into()));
    }
    let target = brigade_models::io::write_target(&o.path).map_err(|e| usage(e.to_string()))?;
    if target.is_dir() {
        return Err(usage("is a directory; give a file name".into()));
    }
    if std::fs::metadata(&target).is_ok_and(|m| !m.is_file()) {
        // an output is written beside its path and renamed over it: a device or a pipe would
        // be replaced by a plain file
        return Err(usage(
            "is not a regular file (a device, pipe or socket); give a file path".into(),
        ));
    }
    let name = target
        .file_name()
        .ok_or_else(|| usage("not a file name".into()))?
        .to_owned();
    let dir = match target.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let dir = std::fs::canonicalize(&dir).map_err(|e| usage(format!("directory {}: {e}", dir.display())))?;
    if !dir.is_dir() {
        return Err(usage(format!("{} is not a directory", dir.display())));
    }
    Ok(dir.join(name))
}

/// Whether a file can be created in `dir`: creates and removes a probe file (permission
/// bits do not tell: root ignores them, and `/proc` refuses regardless).
fn writable(dir: &Path) -> std::io::Result<()> {
    let probe = dir.join(format!(
        ".brigade-probe-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    // a signal while the run starts ends it at once: the probe goes with it
    let made = crate::signal::create_removable(&probe, || {
        std::fs::OpenOptions::new().write(true).create_new(true).open(&probe)
    });
    let removed = made.and_then(|_| std::fs::remove_file(&probe));
    crate::signal::unregister_cleanup(&probe);
    removed
}

/// Checks every output before any work: its directory exists and takes new files, it is
/// not a directory, and no two outputs land on the same file. One line names the first
/// problem.
pub fn check_outputs(outputs: &[Output]) -> Result<()> {
    let mut seen: Vec<(PathBuf, &Output)> = vec![];
    for o in outputs {
        let at = landing(o)?;
        if let Some((_, first)) = seen.iter().find(|(p, _)| *p == at) {
            return Err(Error::Usage(format!(
                "{} {} and {} {} are the same file {}: give each output its own path",
                first.flag,
                first.path.display(),
                o.flag,
                o.path.display(),
                at.display()
            )));
        }
        let dir = at.parent().expect("landing() returns dir/name");
        writable(dir).map_err(|e| {
            Error::Usage(format!(
                "{} {}: cannot create files in {}: {e}",
                o.flag,
                o.path.display(),
                dir.display()
            ))
        })?;
        seen.push((at, o));
    }
    Ok(())
}

/// Where the file `path` (named by `flag`) really is, absolute, symbolic links followed; `None`
/// when that cannot be told (the path's own check names what is wrong with it).
pub fn resolved(flag: &str, path: &Path) -> Option<PathBuf> {
    landing(&Output::new(flag, path)).ok()
}

/// One file a run reads: its flag, its path, which of its files it is (a rank's, for a path
/// with `{rank}`), and the flags of the outputs that may replace it (`--checkpoint` may
/// continue the `--resume` file in place).
#[derive(Clone, Debug)]
pub struct Input<'a> {
    /// `--data`, `--text`, ... (for messages).
    pub flag: &'a str,
    /// The file it reads.
    pub path: PathBuf,
    /// Whose file it is, when the flag names several (`rank 1's`).
    pub whose: Option<String>,
    /// Outputs that may write over it.
    pub may_replace: &'a [&'a str],
}

impl<'a> Input<'a> {
    /// The file `path` read for `flag`, which no output may replace.
    pub fn new(flag: &'a str, path: &Path) -> Self {
        Input {
            flag,
            path: path.to_path_buf(),
            whose: None,
            may_replace: &[],
        }
    }
}

/// Checks that no output of `outputs` lands on an input of `inputs` (both resolved: symbolic
/// links followed, directories canonical), except those the input allows. One line names the
/// pair.
pub fn check_inputs_kept(inputs: &[Input<'_>], outputs: &[Output]) -> Result<()> {
    let landed: Vec<(&Output, PathBuf)> = outputs.iter().filter_map(|o| Some((o, landing(o).ok()?))).collect();
    for input in inputs {
        let Some(at) = resolved(input.flag, &input.path) else {
            continue;
        };
        let mut clash = landed
            .iter()
            .filter(|(o, p)| *p == at && !input.may_replace.contains(&o.flag.as_str()));
        if let Some((o, _)) = clash.next() {
            let whose = input.whose.as_ref().map(|w| format!(" ({w})")).unwrap_or_default();
            return Err(Error::Usage(format!(
                "{} {} would write over the {} file {}{whose}: give it its own path",
                o.flag,
                o.path.display(),
                input.flag,
                input.path.display()
            )));
        }
    }
    Ok(())
}

/// Checks that no output of `outputs` is a file that an input pattern of `inputs` (`*` or `?`
/// in its file name) would read: a later run of the same flags would read it as its data. One
/// line names the pair.
pub fn check_patterns_kept(inputs: &[Input<'_>], outputs: &[Output]) -> Result<()> {
    for input in inputs {
        let Some(glob) = input.path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if !glob.contains(['*', '?']) {
            continue;
        }
        let dir = match input.path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        let Ok(dir) = std::fs::canonicalize(dir) else {
            continue;
        };
        for o in outputs {
            let Ok(at) = landing(o) else { continue };
            let name = at.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            if at.parent() == Some(dir.as_path()) && brigade_models::tokens::glob_matches(glob, name) {
                return Err(Error::Usage(format!(
                    "{} {} is a file the {} pattern {} reads (a run would read it as its data): give it its own path",
                    o.flag,
                    o.path.display(),
                    input.flag,
                    input.path.display()
                )));
            }
        }
    }
    Ok(())
}

/// The files of a run as the library's check of its checkpoint path takes them
/// ([`brigade::config::CheckpointConfig::check_files`]), named by their flags: every input but
/// `--resume` (a checkpoint may continue it in place), every output in `outputs`.
pub fn run_files(inputs: &[Input<'_>], outputs: &[Output]) -> Vec<RunFile> {
    let read = inputs.iter().filter(|i| i.flag != "--resume").map(|i| RunFile {
        whose: i.whose.clone(),
        ..RunFile::read(i.flag, &i.path)
    });
    let written = outputs.iter().map(|o| RunFile::written(&o.flag, &o.path));
    read.chain(written).collect()
}

/// Checks that every input but `--text` (which is read once, as a stream, up to its bound) is
/// a regular file where it exists: the data formats are opened more than once (sniffed, then
/// read by row), so a pipe, a device or a directory is one line naming the flag. A file that
/// does not exist is its reader's error.
pub fn check_inputs_are_files(inputs: &[Input<'_>]) -> Result<()> {
    for input in inputs.iter().filter(|i| i.flag != "--text") {
        if let Ok(m) = std::fs::metadata(&input.path) {
            check_is_file(input.flag, &input.path, &m, false)?;
        }
    }
    Ok(())
}

/// One line naming `flag` when `path` (whose metadata is `m`) is a directory or something else
/// than a regular file (a pipe passes when `pipe_ok`: an input read once, as a stream).
pub fn check_is_file(flag: &str, path: &Path, m: &std::fs::Metadata, pipe_ok: bool) -> Result<()> {
    use std::os::unix::fs::FileTypeExt;
    if m.is_file() || (pipe_ok && m.file_type().is_fifo()) {
        return Ok(());
    }
    let what = if m.is_dir() {
        "a directory"
    } else {
        "not a regular file"
    };
    Err(Error::Usage(format!(
        "{flag} {} is {what}: give the path of a file",
        path.display()
    )))
}

/// One write of the end of a run.
pub type Write<'a> = (Output, Box<dyn FnOnce() -> Result<()> + 'a>);

/// Runs every write, even after one failed; then fails with one line naming every
/// output that could not be written (flag, path, cause), if any.
pub fn write_all(writes: Vec<Write<'_>>) -> Result<()> {
    let mut failed = vec![];
    for (o, write) in writes {
        if let Err(e) = write() {
            let cause = e.to_string().replace('\n', " ");
            failed.push(format!("{} {}: {cause}", o.flag, o.path.display()));
        }
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(Error::Outputs(failed))
    }
}

/// The lock file of an output: `.NAME.lock` beside the file a write of it lands in (a lock on
/// the output itself would not survive the atomic rename that replaces it).
pub fn lock_path(o: &Output) -> Result<PathBuf> {
    let at = landing(o)?;
    let name = at.file_name().expect("landing() returns dir/name").to_string_lossy();
    Ok(at.with_file_name(format!(".{name}.lock")))
}

/// One output locked for this run's lifetime: an exclusive `flock` on its lock file, which
/// holds this process's id (for the message of a run that finds it taken). Dropping it removes
/// the lock file (while still holding the lock); a process that dies holding it loses the lock
/// with it (the kernel releases it), and a later run reuses the file.
#[derive(Debug)]
pub struct OutputLock {
    path: PathBuf,
    _file: std::fs::File,
}

impl OutputLock {
    /// Locks `o`, or fails with one line naming the output, its lock file and the process
    /// that holds it.
    pub fn acquire(o: &Output) -> Result<OutputLock> {
        use std::io::Write as _;
        use std::os::unix::fs::MetadataExt;
        let path = lock_path(o)?;
        let io = |source| Error::Io {
            path: format!("{} {}: lock file {}", o.flag, o.path.display(), path.display()),
            source,
        };
        // a holder that finishes removes the file: a lock taken on a file no longer at `path`
        // is retaken on the new one
        for _ in 0..100 {
            // A file this run creates is registered for removal before it exists, so that a
            // signal at any instant while starting leaves nothing behind; one that was already
            // there (another run's, or left by a killed one) is registered once it is locked.
            let mut file = match crate::signal::create_removable(&path, || {
                std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create_new(true)
                    .open(&path)
            }) {
                Ok(file) => file,
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    crate::signal::unregister_cleanup(&path);
                    match std::fs::OpenOptions::new().read(true).write(true).open(&path) {
                        Ok(file) => file,
                        // removed by its holder meanwhile: try again
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                        Err(e) => return Err(io(e)),
                    }
                }
                Err(e) => {
                    crate::signal::unregister_cleanup(&path);
                    return Err(io(e));
                }
            };
            match file.try_lock() {
                Ok(()) => {}
                Err(std::fs::TryLockError::WouldBlock) => {
                    crate::signal::unregister_cleanup(&path);
                    let holder = std::fs::read_to_string(&path).unwrap_or_default();
                    let holder = match holder.trim() {
                        "" => "another process".to_string(),
                        pid => format!("process {pid}"),
                    };
                    return Err(Error::Usage(format!(
                        "{} {} is being written by another run ({holder}, lock {}): wait for it to end or give another path",
                        o.flag,
                        o.path.display(),
                        path.display()
                    )));
                }
                Err(std::fs::TryLockError::Error(e)) => {
                    crate::signal::unregister_cleanup(&path);
                    return Err(io(e));
                }
            }
            let same = match (file.metadata(), std::fs::metadata(&path)) {
                (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
                _ => false,
            };
            if !same {
                crate::signal::unregister_cleanup(&path);
                continue;
            }
            crate::signal::register_cleanup(&path);
            file.set_len(0).map_err(io)?;
            writeln!(file, "{}", std::process::id()).map_err(io)?;
            return Ok(OutputLock { path, _file: file });
        }
        Err(io(std::io::Error::other("kept being replaced while locking it")))
    }
}

impl Drop for OutputLock {
    fn drop(&mut self) {
        // removed while still locked: a run that opened it meanwhile sees it gone and retries
        crate::signal::unregister_cleanup(&self.path);
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The outputs a run locks, taken by the process of rank 0 (the one that writes them) once it
/// starts, held until this is dropped.
#[derive(Debug, Default)]
pub struct OutputLocks {
    outputs: Vec<Output>,
    held: std::sync::Mutex<Vec<OutputLock>>,
}

impl OutputLocks {
    /// Will lock `outputs` (nothing is locked yet: see [`OutputLocks::take`]).
    pub fn new(outputs: Vec<Output>) -> Self {
        OutputLocks {
            outputs,
            held: Default::default(),
        }
    }

    /// Locks every output (all or none; again is a no-op).
    pub fn take(&self) -> Result<()> {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        if held.is_empty() {
            *held = self.outputs.iter().map(OutputLock::acquire).collect::<Result<_>>()?;
        }
        Ok(())
    }
}

/// The directories a command is about to make for its outputs (the missing ones of a path and
/// its parents, deepest first), removed again when this is dropped unless [`MadeDirs::keep`]:
/// a refused or failed command leaves no directory it made. Only empty ones are removed: a
/// directory that holds anything (an output written, a file put there meanwhile) stays.
#[must_use = "the directories are removed when this is dropped"]
pub struct MadeDirs(Vec<PathBuf>);

impl MadeDirs {
    /// The directories of `dirs` (each and its parents) that do not exist yet, deepest first;
    /// call before making them.
    pub fn missing<'a>(dirs: impl IntoIterator<Item = &'a Path>) -> MadeDirs {
        let mut made: Vec<PathBuf> = dirs
            .into_iter()
            .flat_map(|dir| dir.ancestors().take_while(|p| !p.as_os_str().is_empty() && !p.exists()))
            .map(Path::to_path_buf)
            .collect();
        made.sort_by_key(|d| std::cmp::Reverse(d.components().count()));
        made.dedup();
        MadeDirs(made)
    }

    /// Keeps them: the command wrote its outputs there.
    pub fn keep(mut self) {
        self.0.clear();
    }
}

impl Drop for MadeDirs {
    fn drop(&mut self) {
        // deepest first, so that each parent is empty once its child is gone
        for d in &self.0 {
            let _ = std::fs::remove_dir(d);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::scratch::Scratch;

    /// A fresh, empty directory in the system temp dir that a passing test removes.
    fn dir(name: &str) -> Scratch {
        Scratch::empty_dir(std::env::temp_dir().join(format!("brigade-outputs-{name}-{}", std::process::id())))
    }

    #[test]
    fn a_failed_write_does_not_stop_the_others_and_every_failure_is_named() {
        let d = dir("write-all");
        let (a, b, c) = (d.join("a.csv"), d.join("missing").join("b.json"), d.join("c.csv"));
        let write = |p: PathBuf| -> Box<dyn FnOnce() -> Result<()>> { Box::new(move || write_atomic(&p, b"x")) };
        let e = write_all(vec![
            (Output::new("--losses", &a), write(a.clone())),
            (Output::new("--timeline", &b), write(b.clone())),
            (Output::new("--save", &c), write(c.clone())),
            (
                Output::new("--checkpoint", Path::new("/proc/x.ckpt")),
                write(PathBuf::from("/proc/x.ckpt")),
            ),
        ])
        .unwrap_err()
        .to_string();
        assert!(a.exists() && c.exists(), "the writes after a failure still happen");
        assert!(
            e.contains("--timeline") && e.contains("b.json") && e.contains("--checkpoint /proc/x.ckpt"),
            "{e}"
        );
        assert!(!e.contains("--losses") && !e.contains("--save"), "{e}");
        assert_eq!(e.lines().count(), 1, "{e}");
    }
}
