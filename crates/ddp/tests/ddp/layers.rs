//! ddp's core does not reach up into the tools built on it: no file outside `src/overlap/`
//! (the overlap model and the autotuner, which read step profiles) names `overlap`.

use std::path::{Path, PathBuf};

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn the_core_names_neither_the_overlap_model_nor_the_autotuner() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = vec![];
    sources(&src, &mut files);
    let mut offenders = vec![];
    for f in files {
        let rel = f.strip_prefix(&src).unwrap().to_string_lossy().replace('\\', "/");
        if rel.starts_with("overlap/") {
            continue;
        }
        for (i, line) in std::fs::read_to_string(&f).unwrap().lines().enumerate() {
            let code = line.trim_start();
            // `lib.rs` declares the module and re-exports nothing of it
            if rel == "lib.rs" && code == "pub mod overlap;" {
                continue;
            }
            if code.contains("overlap::") || code.contains("Autotuner") {
                offenders.push(format!("src/{rel}:{}: {code}", i + 1));
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "the core names the overlap layer:\n{}",
        offenders.join("\n")
    );
}
