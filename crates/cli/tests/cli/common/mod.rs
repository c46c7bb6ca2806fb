//! What every CLI test file needs: run the binary, expect success or one clean error line,
//! and a fresh directory per test (tests of one binary run in parallel), removed after a
//! passing test.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use brigade_models::save_safetensors;
use brigade_tensor::{DType, Rng, Tensor};

#[path = "../../../../test-support/scratch.rs"]
mod scratch;
pub use scratch::Scratch;

/// The binary under test: this build's, or `$BRIGADE_BIN` (to run the suite against
/// another build, e.g. to see a test fail without the fix it tests).
pub fn bin() -> PathBuf {
    std::env::var_os("BRIGADE_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_brigade")))
}

/// Runs `brigade` with `args`.
pub fn brigade(args: &[&str]) -> Output {
    Command::new(bin()).args(args).output().expect("run brigade")
}

/// Stdout of a run that must succeed.
pub fn ok(args: &[&str]) -> String {
    let out = brigade(args);
    assert!(
        out.status.success(),
        "brigade {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The error line of a run that must fail cleanly: non-zero exit, exactly one line on
/// stderr starting with `error: `, no panic.
pub fn fails(args: &[&str]) -> String {
    let out = brigade(args);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "brigade {args:?} should fail; stdout:\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(!err.contains("panicked"), "a panic instead of an error: {err}");
    assert!(err.starts_with("error: "), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "the error must be one line: {err}");
    err
}

/// A fresh, empty directory for the test `name` (its own: no two tests share a file), removed
/// when the test passes: bind it for the whole test, past the end of every `brigade` it runs.
pub fn dir(name: &str) -> Scratch {
    Scratch::empty_dir(path_of(name))
}

/// `brigade-cli-{name}-{pid}` in the system temp dir.
fn path_of(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("brigade-cli-{name}-{}", std::process::id()))
}

/// Whether a thread of this test binary panicked (a test failed) since the first
/// [`shared_dir`].
static PANICKED: AtomicBool = AtomicBool::new(false);
/// The directories [`shared_dir`] made, removed when the binary exits.
static SHARED: Mutex<Vec<PathBuf>> = Mutex::new(vec![]);

/// A fresh, empty directory `name` for inputs that several tests of this binary read (written
/// once, kept in a static, which is never dropped): removed when the test binary exits, unless
/// a test failed meanwhile; then it stays, its path printed.
pub fn shared_dir(name: &str) -> PathBuf {
    extern "C" {
        fn atexit(f: extern "C" fn()) -> i32;
    }
    extern "C" fn remove_shared() {
        for d in SHARED.lock().unwrap_or_else(|p| p.into_inner()).drain(..) {
            if PANICKED.load(Ordering::SeqCst) {
                eprintln!("kept the files the tests shared: {}", d.display());
            } else {
                let _ = std::fs::remove_dir_all(&d);
            }
        }
    }
    let d = path_of(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    let mut dirs = SHARED.lock().unwrap_or_else(|p| p.into_inner());
    if dirs.is_empty() {
        let report = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            PANICKED.store(true, Ordering::SeqCst);
            report(info)
        }));
        // SAFETY: registers a function without arguments to run at exit (the tests have ended).
        assert_eq!(unsafe { atexit(remove_shared) }, 0, "atexit");
    }
    dirs.push(d.clone());
    d
}

/// A path as a flag value.
pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `args` joined into one argument list.
pub fn cat<'a>(parts: &[&[&'a str]]) -> Vec<&'a str> {
    parts.concat()
}

/// The small MLP every test trains.
pub const MLP: &[&str] = &["--model", "mlp", "--widths", "16,32,32,4", "--lr", "0.05", "--quiet"];
/// The small GPT.
pub const GPT: &[&str] = &[
    "--model",
    "gpt",
    "--d-model",
    "32",
    "--layers",
    "2",
    "--heads",
    "2",
    "--d-ff",
    "64",
    "--context",
    "16",
    "--lr",
    "0.003",
    "--quiet",
];

/// A data file for the small MLP in `dir`: 64 rows of 16 inputs, labelled by the largest
/// of the first 4 inputs (learnable); `nan_at` puts a NaN at that flat index.
pub fn mlp_data(dir: &Path, nan_at: Option<usize>) -> PathBuf {
    let path = dir.join(if nan_at.is_some() {
        "mlp-data-nan.safetensors"
    } else {
        "mlp-data.safetensors"
    });
    let (mut xv, labels) = argmax_rows(64, 16, 4, 9);
    if let Some(i) = nan_at {
        xv[i] = f32::NAN;
    }
    write_rows(&path, xv, labels, 16);
    path
}

/// `rows` rows of `inputs` standard-normal features drawn from `seed`, each labelled with the
/// index of the largest of its first `classes` features: a task an MLP learns.
pub fn argmax_rows(rows: usize, inputs: usize, classes: usize, seed: u64) -> (Vec<f32>, Vec<i64>) {
    let mut rng = Rng::new(seed);
    let x = Tensor::randn(&[rows, inputs], 1.0, DType::F32, &mut rng)
        .to_vec::<f32>()
        .unwrap();
    let labels = x
        .chunks(inputs)
        .map(|r| (0..classes).max_by(|&a, &b| r[a].total_cmp(&r[b])).unwrap() as i64)
        .collect();
    (x, labels)
}

/// Writes rows of `inputs` features and their labels as the `inputs` and `targets` tensors of
/// a safetensors file.
pub fn write_rows(path: &Path, x: Vec<f32>, labels: Vec<i64>, inputs: usize) {
    let rows = labels.len();
    let x = Tensor::from_vec(x, &[rows, inputs]).unwrap();
    let y = Tensor::from_vec(labels, &[rows]).unwrap();
    save_safetensors(path, &[("inputs".into(), x), ("targets".into(), y)], None).unwrap();
}

/// `(step, loss)` rows of a `--losses` file.
pub fn losses(path: &Path) -> Vec<(usize, f64)> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .skip(1)
        .map(|l| {
            let mut cells = l.split(',');
            let (s, v) = (cells.next().unwrap(), cells.next().unwrap());
            (s.parse().unwrap(), v.parse().unwrap())
        })
        .collect()
}

/// The numbers of a JSON list (`--json`'s losses, bytes by step).
pub fn numbers(v: &serde_json::Value) -> Vec<f64> {
    v.as_array().unwrap().iter().map(|l| l.as_f64().unwrap()).collect()
}

/// `base` without `flag` and its value (to give that flag another value).
pub fn without<'a>(base: &[&'a str], flag: &str) -> Vec<&'a str> {
    let mut out = vec![];
    let mut skip = false;
    for &a in base {
        if skip {
            skip = false;
        } else if a == flag {
            skip = true;
        } else {
            out.push(a);
        }
    }
    out
}

/// The texts of an SVG's `<text>` elements, trimmed.
pub fn svg_texts(svg: &str) -> Vec<String> {
    svg.split("<text")
        .skip(1)
        .filter_map(|t| Some(t.split_once('>')?.1.split_once("</text>")?.0.trim().to_string()))
        .collect()
}

/// Panics unless `text` is well-formed XML: one root element, every element closed in order,
/// attribute values quoted, `&` only as an entity (a small checker, enough for the SVG that
/// plotters writes: no CDATA).
pub fn assert_well_formed_xml(text: &str) {
    let (mut open, mut roots, mut rest) = (Vec::<String>::new(), 0, text);
    let entity_ok = |t: &str| {
        t.match_indices('&').all(|(i, _)| {
            let after = &t[i..];
            ["&amp;", "&lt;", "&gt;", "&quot;", "&apos;", "&#"]
                .iter()
                .any(|e| after.starts_with(e))
        })
    };
    while let Some(start) = rest.find('<') {
        let between = &rest[..start];
        assert!(entity_ok(between), "a bare & in text: {between}");
        assert!(
            !open.is_empty() || between.trim().is_empty(),
            "text outside the root: {between}"
        );
        let tag_and_rest = &rest[start..];
        let end = if tag_and_rest.starts_with("<!--") {
            tag_and_rest.find("-->").map(|e| e + 3)
        } else {
            tag_and_rest.find('>').map(|e| e + 1)
        }
        .unwrap_or_else(|| panic!("a tag never closed: {}", &tag_and_rest[..tag_and_rest.len().min(80)]));
        let tag = &tag_and_rest[..end];
        rest = &tag_and_rest[end..];
        if tag.starts_with("<?") || tag.starts_with("<!") {
            continue;
        }
        assert!(tag.matches('"').count() % 2 == 0, "unbalanced quotes: {tag}");
        assert!(entity_ok(tag), "a bare & in a tag: {tag}");
        let name: String = tag
            .trim_start_matches("</")
            .trim_start_matches('<')
            .chars()
            .take_while(|c| !c.is_whitespace() && *c != '>' && *c != '/')
            .collect();
        assert!(!name.is_empty(), "a tag without a name: {tag}");
        if tag.starts_with("</") {
            assert_eq!(open.pop().as_deref(), Some(name.as_str()), "closed out of order: {tag}");
        } else if !tag.ends_with("/>") {
            if open.is_empty() {
                roots += 1;
            }
            open.push(name);
        } else if open.is_empty() {
            roots += 1;
        }
    }
    assert!(rest.trim().is_empty() && open.is_empty(), "unclosed elements {open:?}");
    assert_eq!(roots, 1, "one root element");
}

/// The number of points of every `<polyline>` drawn in `color` (`#RRGGBB`), sorted.
pub fn polyline_points(svg: &str, color: &str) -> Vec<usize> {
    let mut counts: Vec<usize> = svg
        .split("<polyline")
        .skip(1)
        .map(|p| &p[..p.find('>').unwrap_or(p.len())])
        .filter(|p| p.contains(&format!("stroke=\"{color}\"")))
        .map(|p| {
            let points = p
                .split("points=\"")
                .nth(1)
                .and_then(|r| r.split('"').next())
                .unwrap_or("");
            points.split_whitespace().count()
        })
        .collect();
    counts.sort_unstable();
    counts
}

/// Waits (at most 120 s) until `path` exists while `child` runs.
pub fn wait_for_file(child: &mut Child, path: &Path) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while !path.exists() {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("brigade ended before {} existed: {status}", path.display());
        }
        assert!(Instant::now() < deadline, "no {} within 120 s", path.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Sends `child` `SIG{signal}` (`INT`, `TERM`).
pub fn send_signal(child: &Child, signal: &str) {
    assert!(Command::new("kill")
        .args([&format!("-{signal}"), &child.id().to_string()])
        .status()
        .unwrap()
        .success());
}

/// Waits (at most 120 s) for `child` to end: its status and its stderr.
pub fn wait_to_end(child: &mut Child) -> (ExitStatus, String) {
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("brigade still running after 120 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let err = std::io::read_to_string(child.stderr.take().unwrap()).unwrap();
    (status, err)
}

/// Waits (at most 120 s) for `child`'s first checkpoint at `ck`, sends it `SIG{signal}`
/// (`INT`, `TERM`) and waits (at most 120 s) for it to end: its status and its stderr.
pub fn signal_after_first_checkpoint(child: &mut Child, ck: &Path, signal: &str) -> (ExitStatus, String) {
    wait_for_file(child, ck);
    send_signal(child, signal);
    wait_to_end(child)
}

/// Sets SIGINT and SIGTERM back to their default action (in a child, before exec: a shell
/// that starts the suite in the background ignores SIGINT for its children, and brigade keeps
/// an ignored signal ignored).
pub fn default_disposition() {
    extern "C" {
        fn signal(signum: i32, handler: usize) -> usize;
    }
    const SIGINT: i32 = 2;
    const SIGTERM: i32 = 15;
    const SIG_DFL: usize = 0;
    // SAFETY: resetting a disposition to the default is async-signal-safe.
    unsafe {
        signal(SIGINT, SIG_DFL);
        signal(SIGTERM, SIG_DFL);
    }
}
