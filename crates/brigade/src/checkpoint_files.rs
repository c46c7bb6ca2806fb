//! The files of a run's checkpoints: the `{step}` in [`CheckpointConfig::path`], the check that
//! no checkpoint lands on another file of the run ([`CheckpointConfig::check_files`]), and the
//! newest [`CheckpointConfig::keep_last`] checkpoints of the run's lineage kept.
//!
//! **Lineage.** Every checkpoint records a lineage id (metadata `lineage`): drawn when a run
//! starts afresh, carried on by a run that resumes a checkpoint (a checkpoint written before
//! lineages were recorded starts a new one), and a generation (`lineage_generation`): one more
//! than the highest generation of the lineage found beside the run's checkpoints (and than the
//! resumed checkpoint's), taken when the run writes its first checkpoint. `keep_last` removes
//! only files that the path names (its head, digits, its tail) and that are checkpoints of this
//! run's lineage: never a file that is not a Brigade checkpoint, another lineage's checkpoint,
//! or one that records no lineage.
//!
//! **Newest.** Of one lineage, the newest checkpoint is the one of the highest generation, and
//! within a generation (one run) the one of the highest step: the order the checkpoints were
//! written in. So a run keeps what it just wrote even where an older run of its lineage left a
//! higher step (a run resumed from an earlier checkpoint, a rollback: the abandoned steps are
//! older), and another lineage's checkpoints (an earlier run started afresh, whatever its steps)
//! are not counted and stay. The checkpoint just written is never removed.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::config::CheckpointConfig;
use crate::error::{Error, Result};

/// What [`CheckpointConfig::path`] replaces by the step.
const STEP: &str = "{step}";

/// Checkpoint metadata key of the lineage id.
pub(crate) const LINEAGE_KEY: &str = "lineage";

/// Checkpoint metadata key of the lineage generation.
pub(crate) const GENERATION_KEY: &str = "lineage_generation";

/// The configuration field of the checkpoint path, as errors name it.
pub const PATH_FIELD: &str = "runtime.checkpoint.path";

/// The configuration field of the initial parameters, as errors name it.
pub const INIT_FIELD: &str = "model.init";

/// A file of a run beside its checkpoints, which no checkpoint may write over: one the run reads
/// (a data file; a pattern with `*` or `?` in its file name stands for every file it matches)
/// or another output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunFile {
    /// Its name in messages: a configuration field ([`INIT_FIELD`]) or the caller's name (the
    /// `brigade` binary gives its flags).
    pub name: String,
    /// The file, or a pattern of files to read.
    pub path: PathBuf,
    /// Whose file it is, when the name stands for several (`rank 1's`).
    pub whose: Option<String>,
    /// Whether the run writes it (else it reads it).
    pub written: bool,
}

impl RunFile {
    /// A file (or pattern of files) the run reads, named `name`.
    pub fn read(name: &str, path: &Path) -> RunFile {
        RunFile {
            name: name.to_string(),
            path: path.to_path_buf(),
            whose: None,
            written: false,
        }
    }

    /// A file the run writes, named `name`.
    pub fn written(name: &str, path: &Path) -> RunFile {
        RunFile {
            written: true,
            ..RunFile::read(name, path)
        }
    }
}

/// How a checkpoint would land on another file of the run: its type lives with the error that
/// carries it.
pub use crate::error::Clash;

/// The lineage of a run's checkpoints (see the module's documentation).
#[derive(Clone, Debug)]
pub(crate) struct Lineage {
    /// The id every checkpoint of the lineage records.
    pub id: String,
    /// The resumed checkpoint's generation (0 for a run started afresh).
    pub resumed_generation: u64,
    /// This run's generation, taken at its first checkpoint.
    pub generation: Option<u64>,
}

impl Lineage {
    /// The lineage of a run that resumes a checkpoint of metadata `resumed` (a fresh one when
    /// there is none, or it records none).
    pub fn continuing(resumed: Option<&HashMap<String, String>>) -> Lineage {
        match resumed.and_then(|m| Some((m.get(LINEAGE_KEY)?, m))) {
            Some((id, meta)) if !id.is_empty() => Lineage {
                id: id.clone(),
                resumed_generation: generation_of(meta),
                generation: None,
            },
            _ => Lineage {
                id: fresh_lineage_id(),
                resumed_generation: 0,
                generation: None,
            },
        }
    }

    /// The metadata entries of a checkpoint of generation `generation` of this lineage.
    pub fn metadata(&self, generation: u64) -> [(String, String); 2] {
        [
            (LINEAGE_KEY.to_string(), self.id.clone()),
            (GENERATION_KEY.to_string(), generation.to_string()),
        ]
    }
}

/// The generation a checkpoint's metadata records (0 when none).
fn generation_of(meta: &HashMap<String, String>) -> u64 {
    meta.get(GENERATION_KEY).and_then(|g| g.parse().ok()).unwrap_or(0)
}

/// 64 bits no other run draws: the process's random hasher keys over the time and the process id.
fn fresh_lineage_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    h.write_u128(now);
    h.write_u32(std::process::id());
    format!("{:016x}", h.finish())
}

/// The first `{...}` in `path` other than `{step}` (`{STEP}`, `{rank}`, `{}`), braces included:
/// `None` when every brace pair is a `{step}`.
pub fn stray_placeholder(path: &Path) -> Option<String> {
    let text = path.to_string_lossy();
    let mut rest = text.as_ref();
    while let Some(open) = rest.find('{') {
        let after = &rest[open + 1..];
        let Some(close) = after.find(['{', '}']) else {
            return None;
        };
        if after.as_bytes()[close] == b'{' {
            rest = &after[close..];
            continue;
        }
        let token = &rest[open..open + close + 2];
        if token != STEP {
            return Some(token.to_string());
        }
        rest = &after[close + 1..];
    }
    None
}

/// Refuses a path of the configuration field `field` that takes `{step}` but holds another
/// `{...}` ([`stray_placeholder`]): typed as a placeholder, it would stay in the file name as it
/// is. [`Error::NotAPlaceholder`].
pub fn check_placeholders(field: &'static str, path: &Path) -> Result<()> {
    match stray_placeholder(path) {
        Some(token) => Err(Error::NotAPlaceholder {
            field,
            path: path.display().to_string(),
            token,
        }),
        None => Ok(()),
    }
}

/// A checkpoint path's file names: its directory, and its file name split at `{step}` (`tail`
/// `None`: a plain name, `head` the whole of it).
struct Names {
    dir: PathBuf,
    head: String,
    tail: Option<String>,
}

impl Names {
    /// The names of `path` as written (its directory as spelled), `None` without a file name.
    fn of(path: &Path) -> Option<Names> {
        let name = file_name(path)?;
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        Some(match name.split_once(STEP) {
            Some((head, tail)) => Names {
                dir,
                head: head.to_string(),
                tail: Some(tail.to_string()),
            },
            None => Names {
                dir,
                head: name.to_string(),
                tail: None,
            },
        })
    }

    /// Whether the path names the file `name`: `Some(digits)` of its step for a `{step}`
    /// path, `Some("")` for a plain name, `None` when it does not.
    fn step_of<'n>(&self, name: &'n str) -> Option<&'n str> {
        match &self.tail {
            None => (name == self.head).then_some(""),
            Some(tail) => {
                let digits = name.strip_prefix(self.head.as_str())?.strip_suffix(tail.as_str())?;
                (!digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())).then_some(digits)
            }
        }
    }

    /// The files of the directory the path names, with their steps' digits.
    fn entries(&self) -> std::io::Result<Vec<(PathBuf, String)>> {
        let mut found = vec![];
        for entry in std::fs::read_dir(&self.dir)? {
            let entry = entry?;
            let name = entry.file_name();
            if let Some(digits) = name.to_str().and_then(|n| self.step_of(n)) {
                found.push((entry.path(), digits.to_string()));
            }
        }
        Ok(found)
    }
}

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

    /// Refuses what would not do what it says: a `{...}` other than `{step}`
    /// ([`check_placeholders`]), `{step}` outside the file name (the directory
    /// is not a template) or more than once in it (its files would not be told apart by one
    /// step), `keep_last` of 0, or `keep_last` without a path holding `{step}` (one file is
    /// always the newest alone).
    pub(crate) fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Config(m));
        if let Some(path) = &self.path {
            check_placeholders(PATH_FIELD, path)?;
            let in_dir = path.parent().is_some_and(|d| d.to_string_lossy().contains(STEP));
            let twice = file_name(path).is_some_and(|n| n.matches(STEP).count() > 1);
            if in_dir || twice {
                return bad(format!(
                    "checkpoint path '{}': {STEP} may appear once, in the file name",
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

    /// Refuses, before step 0, a checkpoint path that does not do what it says (see the
    /// configuration's fields) or that may land on another file of the run:
    /// one of `files` (the data it reads, the caller's other outputs, [`INIT_FIELD`]'s initial
    /// parameters), compared where they really are (symbolic links followed, directories
    /// resolved). A path with `{step}` is compared by its pattern: any file of its directory
    /// that its head, digits and tail name (the checkpoint of a stop request or of the end of
    /// a join run falls at another step than the period's); a pattern of files to read that
    /// matches such names is refused too (a later run would read the checkpoints as its data).
    /// The [`CheckpointConfig::resume`] file may be continued in place. One error naming the
    /// pair, [`Error::CheckpointClash`].
    pub fn check_files(&self, files: &[RunFile]) -> Result<()> {
        self.validate()?;
        let Some(path) = &self.path else {
            return Ok(());
        };
        let Some(names) = Names::of(path).and_then(|n| {
            Some(Names {
                dir: std::fs::canonicalize(&n.dir).ok()?,
                ..n
            })
        }) else {
            // a directory that does not exist is the outputs' check (and the write's) to name
            return Ok(());
        };
        let resume = self.resume.as_deref().and_then(read_target);
        not_files(path, &names)?;
        let links = links_at(&names);
        let clash = |file: &RunFile, clash: Clash| {
            Err(Error::CheckpointClash(Box::new(crate::error::FileClash {
                field: PATH_FIELD,
                path: path.display().to_string(),
                other: file.name.clone(),
                other_path: file.path.display().to_string(),
                whose: file.whose.clone(),
                other_written: file.written,
                clash,
            })))
        };
        let step = |digits: &str| (!digits.is_empty()).then(|| digits.to_string());
        for file in files {
            let Some(landings) = landings(file, &names) else {
                return clash(file, Clash::PatternReads);
            };
            for at in landings.iter().filter(|at| Some(*at) != resume.as_ref()) {
                let direct = (at.parent() == Some(names.dir.as_path()))
                    .then(|| at.file_name().and_then(|n| n.to_str()).and_then(|n| names.step_of(n)))
                    .flatten();
                if let Some(digits) = direct {
                    return clash(
                        file,
                        Clash::Lands {
                            step: step(digits),
                            via: None,
                        },
                    );
                }
                if let Some((link, digits, _)) = links.iter().find(|(_, _, target)| target == at) {
                    return clash(
                        file,
                        Clash::Lands {
                            step: step(digits),
                            via: Some(link.clone()),
                        },
                    );
                }
            }
        }
        Ok(())
    }

    /// The generation of this run's checkpoints in `lineage`: one more than the highest of the
    /// lineage among the files the path names, and than the resumed checkpoint's.
    pub(crate) fn next_generation(&self, lineage: &Lineage) -> u64 {
        let highest = self
            .lineage_files(lineage)
            .unwrap_or_default()
            .into_iter()
            .map(|f| f.generation)
            .max()
            .unwrap_or(0);
        highest.max(lineage.resumed_generation) + 1
    }

    /// The checkpoints of `lineage` among the files the path names.
    fn lineage_files(&self, lineage: &Lineage) -> Result<Vec<LineageFile>> {
        let Some(names) = self.path.as_deref().and_then(Names::of) else {
            return Ok(vec![]);
        };
        let io = |source| Error::Io {
            path: names.dir.display().to_string(),
            source,
        };
        let mut found = vec![];
        for (path, digits) in names.entries().map_err(io)? {
            let Some(meta) = crate::checkpoint::read_metadata(&path) else {
                continue;
            };
            if meta.get(LINEAGE_KEY) != Some(&lineage.id) {
                continue;
            }
            // the step it records (a copy under another step's name keeps its own)
            let step = meta.get("step").unwrap_or(&digits).parse().unwrap_or(u128::MAX);
            found.push(LineageFile {
                generation: generation_of(&meta),
                step,
                path,
            });
        }
        Ok(found)
    }

    /// Removes the checkpoints of `lineage` that the path names beyond the newest `keep_last`
    /// (rank 0, after writing `written`, which stays): oldest first, by generation, then step.
    /// Files that are not checkpoints of the lineage are never touched.
    pub(crate) fn prune(&self, lineage: &Lineage, written: &Path) -> Result<()> {
        let Some(keep) = self.keep_last else {
            return Ok(());
        };
        if !self
            .path
            .as_deref()
            .and_then(file_name)
            .is_some_and(|n| n.contains(STEP))
        {
            return Ok(());
        }
        let mut files = self.lineage_files(lineage)?;
        files.sort_by_key(|f| std::cmp::Reverse((f.generation, f.step)));
        let written = written.file_name();
        for old in files.iter().skip(keep).filter(|f| f.path.file_name() != written) {
            std::fs::remove_file(&old.path).map_err(|source| Error::Io {
                path: old.path.display().to_string(),
                source,
            })?;
        }
        Ok(())
    }
}

/// A checkpoint of the run's lineage found beside its checkpoints.
struct LineageFile {
    path: PathBuf,
    generation: u64,
    step: u128,
}

/// Where a read of `path` lands: the file itself, links followed (`None` when that cannot be
/// told: its directory does not exist).
fn read_target(path: &Path) -> Option<PathBuf> {
    std::fs::canonicalize(path).ok().or_else(|| resolved(path))
}

/// `path` with its directory resolved (canonical, links followed), its file name kept.
fn resolved(path: &Path) -> Option<PathBuf> {
    let name = path.file_name()?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    Some(std::fs::canonicalize(dir).ok()?.join(name))
}

/// Whether the pattern of files `pattern` (`*`: any run of bytes, `?`: one byte, in its file
/// name) matches a name of a checkpoint of `names`, in the same (resolved) directory.
fn reads_checkpoints(pattern: &Path, names: &Names) -> bool {
    let Some(glob) = file_name(pattern) else {
        return false;
    };
    let dir = match pattern.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if std::fs::canonicalize(dir).ok().as_deref() != Some(names.dir.as_path()) {
        return false;
    }
    glob_meets_names(glob.as_bytes(), names)
}

/// Whether some file name of `names` (head, one or more digits, tail; or the plain name)
/// matches `glob`: the glob run against the names' automaton, state by state.
fn glob_meets_names(glob: &[u8], names: &Names) -> bool {
    /// Where a name stands: in its head, in its digits (one read), in its tail.
    #[derive(Clone, Copy, PartialEq, Eq, Hash)]
    enum At {
        Head(usize),
        Digits,
        Tail(usize),
    }
    /// A byte a name emits: this one, or any digit.
    #[derive(Clone, Copy)]
    enum Byte {
        Is(u8),
        Digit,
    }
    let head = names.head.as_bytes();
    let tail = names.tail.as_ref().map(|t| t.as_bytes());
    let emits = |s: At| -> Vec<(Byte, At)> {
        match (s, tail) {
            (At::Head(i), _) if i < head.len() => vec![(Byte::Is(head[i]), At::Head(i + 1))],
            (At::Head(_), None) => vec![],
            (At::Head(_), Some(_)) => vec![(Byte::Digit, At::Digits)],
            (At::Digits, Some(t)) => {
                let mut v = vec![(Byte::Digit, At::Digits)];
                v.extend(t.first().map(|&b| (Byte::Is(b), At::Tail(1))));
                v
            }
            (At::Tail(j), Some(t)) if j < t.len() => vec![(Byte::Is(t[j]), At::Tail(j + 1))],
            _ => vec![],
        }
    };
    let accepts = |s: At| match (s, tail) {
        (At::Head(i), None) => i == head.len(),
        (At::Digits, Some(t)) => t.is_empty(),
        (At::Tail(j), Some(t)) => j == t.len(),
        _ => false,
    };
    let mut seen = std::collections::HashSet::new();
    let mut todo = vec![(0usize, At::Head(0))];
    while let Some((g, s)) = todo.pop() {
        if !seen.insert((g, s)) {
            continue;
        }
        match glob.get(g) {
            None if accepts(s) => return true,
            None => {}
            Some(b'*') => {
                todo.push((g + 1, s));
                todo.extend(emits(s).into_iter().map(|(_, t)| (g, t)));
            }
            Some(b'?') => todo.extend(emits(s).into_iter().map(|(_, t)| (g + 1, t))),
            Some(&c) => todo.extend(
                emits(s)
                    .into_iter()
                    .filter(|(b, _)| match b {
                        Byte::Is(b) => *b == c,
                        Byte::Digit => c.is_ascii_digit(),
                    })
                    .map(|(_, t)| (g + 1, t)),
            ),
        }
    }
    false
}

fn file_name(path: &Path) -> Option<&str> {
    path.file_name()?.to_str()
}

/// A checkpoint is written as a file in its name's place: a folder, a pipe or a device at one
/// of `names` would fail the write (after training) or be replaced.
fn not_files(path: &Path, names: &Names) -> Result<()> {
    for (entry, digits) in names.entries().unwrap_or_default() {
        if let Ok(m) = std::fs::metadata(&entry) {
            if !m.is_file() {
                return Err(Error::CheckpointClash(Box::new(crate::error::FileClash {
                    field: PATH_FIELD,
                    path: path.display().to_string(),
                    other: String::new(),
                    other_path: entry.display().to_string(),
                    whose: None,
                    other_written: false,
                    clash: Clash::NotAFile {
                        step: (!digits.is_empty()).then_some(digits),
                        what: if m.is_dir() { "a folder" } else { "not a regular file" },
                    },
                })));
            }
        }
    }
    Ok(())
}

/// The symbolic links that stand at the checkpoints' names now (a write goes through them):
/// each with its step's digits and where it leads.
fn links_at(names: &Names) -> Vec<(PathBuf, String, PathBuf)> {
    names
        .entries()
        .unwrap_or_default()
        .into_iter()
        .filter(|(p, _)| std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_symlink()))
        .filter_map(|(p, digits)| {
            let target = brigade_models::io::write_target(&p).ok()?;
            Some((p, digits, resolved(&target)?))
        })
        .collect()
}

/// Where a run's file really is (symbolic links followed): every file a pattern of files to
/// read matches, or the one file; `None` when the pattern would read the checkpoints.
fn landings(file: &RunFile, names: &Names) -> Option<Vec<PathBuf>> {
    let pattern = !file.written && file_name(&file.path).is_some_and(|n| n.contains(['*', '?']));
    Some(if pattern {
        if reads_checkpoints(&file.path, names) {
            return None;
        }
        brigade_models::tokens::expand_glob(&file.path)
            .unwrap_or_default()
            .iter()
            .filter_map(|p| read_target(p))
            .collect()
    } else if file.written {
        brigade_models::io::write_target(&file.path)
            .ok()
            .and_then(|t| resolved(&t))
            .into_iter()
            .collect()
    } else {
        read_target(&file.path).into_iter().collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(template: &str) -> Names {
        Names::of(Path::new(template)).unwrap()
    }

    #[test]
    fn a_glob_meets_the_names_of_a_step_path_exactly_where_one_of_them_matches() {
        let run = names("run-{step}.ckpt");
        for (glob, meets) in [
            ("*", true),
            ("*.ckpt", true),
            ("run-*", true),
            ("run-?.ckpt", true),
            ("run-??.ckpt", true),
            ("run-1?.ckpt", true),
            ("run-x*.ckpt", false),
            ("run-.ckpt", false),
            ("run-*.bin", false),
            ("run-?", false),
            ("*-*", true),
            ("r*9.ckpt", true),
            ("run-*a.ckpt", false),
            ("other-*", false),
        ] {
            assert_eq!(glob_meets_names(glob.as_bytes(), &run), meets, "{glob}");
        }
        // no head, no tail: any digits
        let bare = names("{step}");
        assert!(glob_meets_names(b"1*", &bare) && !glob_meets_names(b"a*", &bare));
        assert!(!glob_meets_names(b"", &bare));
        // a plain name is its own only name
        let plain = names("last.ckpt");
        assert!(glob_meets_names(b"*.ckpt", &plain) && glob_meets_names(b"last.ckpt", &plain));
        assert!(!glob_meets_names(b"last-*.ckpt", &plain));
    }

    #[test]
    fn a_stray_placeholder_is_the_first_brace_token_other_than_step() {
        for (path, stray) in [
            ("run-{step}.ckpt", None),
            ("run.ckpt", None),
            ("run-{STEP}.ckpt", Some("{STEP}")),
            ("d/{rank}/run-{step}.ckpt", Some("{rank}")),
            ("run-{step}-{}.ckpt", Some("{}")),
            ("run-{{step}.ckpt", None),
            ("run-{step.ckpt", None),
            ("run-{a}-{b}.ckpt", Some("{a}")),
        ] {
            assert_eq!(stray_placeholder(Path::new(path)).as_deref(), stray, "{path}");
        }
    }

    #[test]
    fn a_step_path_names_its_head_digits_and_tail_only() {
        let run = names("run-{step}.ckpt");
        assert_eq!(run.step_of("run-12.ckpt"), Some("12"));
        for other in [
            "run-.ckpt",
            "run-1a.ckpt",
            "run-12.ckpt.bak",
            "xrun-1.ckpt",
            "run-+1.ckpt",
        ] {
            assert_eq!(run.step_of(other), None, "{other}");
        }
        assert_eq!(names("c.ckpt").step_of("c.ckpt"), Some(""));
    }
}
