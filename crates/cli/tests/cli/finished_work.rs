//! A run that ends badly still writes the work it finished: a diverged run its losses (and
//! its loss chart) up to the step that diverged, a run whose final checkpoint cannot be written its other outputs.

use crate::common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{bin, brigade, dir, s};

const MLP: &[&str] = &["--model", "mlp", "--widths", "8,16,4", "--batch-size", "4", "--quiet"];

fn error_line(out: &std::process::Output) -> String {
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "should fail");
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "one error line: {err}");
    assert!(lines[0].starts_with("error: "), "{err}");
    lines[0].to_string()
}

#[test]
fn a_diverged_run_writes_the_losses_of_every_step_before_it() {
    let d = dir("diverged-losses");
    let (losses, save, plot) = (d.join("losses.csv"), d.join("model.safetensors"), d.join("loss.svg"));
    // an earlier run's model at the --save path
    let sane = brigade(&[&["train"], MLP, &["--lr", "0.01", "--steps", "2", "--save", s(&save)]].concat());
    assert!(sane.status.success());
    let model = std::fs::read(&save).unwrap();
    let out = brigade(
        &[
            &["train"],
            MLP,
            &[
                "--lr",
                "1e30",
                "--steps",
                "50",
                "--losses",
                s(&losses),
                "--save",
                s(&save),
                "--plot",
                s(&plot),
            ],
        ]
        .concat(),
    );
    assert_eq!(
        std::fs::read(&save).unwrap(),
        model,
        "diverged parameters replaced the earlier --save file"
    );
    let line = error_line(&out);
    // "step N: the loss is NaN ..."
    let step: usize = line
        .split("step ")
        .nth(1)
        .unwrap()
        .split(':')
        .next()
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let text = std::fs::read_to_string(&losses).unwrap_or_else(|e| panic!("no losses file after {line}: {e}"));
    let rows: Vec<&str> = text.lines().skip(1).collect();
    assert_eq!(
        rows.len(),
        step,
        "the {step} finished steps, and not the diverged one: {text}"
    );
    assert!(rows
        .iter()
        .all(|r| r.split(',').nth(1).unwrap().parse::<f64>().unwrap().is_finite()));
    // the loss chart draws the same finished steps (beside its 2-point legend line)
    let svg = std::fs::read_to_string(&plot).unwrap_or_else(|e| panic!("no --plot file after {line}: {e}"));
    let mut want = vec![2, step];
    want.sort_unstable();
    assert_eq!(
        common::polyline_points(&svg, "#3498DB"),
        want,
        "the training loss of {step} steps"
    );
}

#[test]
fn a_checkpoint_that_cannot_be_written_stops_the_run_and_loses_nothing_else() {
    let d = dir("ckpt-fails");
    let ck_dir = d.join("ck");
    std::fs::create_dir_all(&ck_dir).unwrap();
    let (ck, losses, save) = (
        ck_dir.join("c.safetensors"),
        d.join("losses.csv"),
        d.join("final.safetensors"),
    );
    let child = Command::new(bin())
        .args(
            [
                &["train"],
                MLP,
                &["--lr", "0.01", "--steps", "4000", "--checkpoint-every", "5"],
            ]
            .concat(),
        )
        .args(["--checkpoint", s(&ck), "--losses", s(&losses), "--save", s(&save)])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // once training provably runs (the first periodic checkpoint exists), the checkpoint's
    // directory becomes a file: the next checkpoint cannot be written, the run stops
    let t0 = Instant::now();
    while !ck.exists() {
        assert!(t0.elapsed() < Duration::from_secs(60), "no checkpoint after 60 s");
        std::thread::sleep(Duration::from_millis(5));
    }
    // (a rename, atomic even while the run writes a temp file inside the directory)
    std::fs::rename(&ck_dir, d.join("ck-moved-away")).unwrap();
    std::fs::write(&ck_dir, b"in the way").unwrap();
    let out = child.wait_with_output().unwrap();
    let line = error_line(&out);
    assert!(line.contains("--checkpoint"), "{line}");
    let text = std::fs::read_to_string(&losses).unwrap();
    let steps: Vec<usize> = text
        .lines()
        .skip(1)
        .map(|l| l.split(',').next().unwrap().parse().unwrap())
        .collect();
    assert!(steps.len() >= 5, "{} steps", steps.len());
    assert_eq!(
        steps,
        (0..steps.len()).collect::<Vec<_>>(),
        "every finished step's loss is written"
    );
    assert!(save.exists(), "--save is written too");
}

/// A simulated link on which a collective of the 16-256-4 MLP's parameters (5,380 f32, 21.5 kB)
/// takes 172 ms at least: building DDP broadcasts them once (172 ms, well within
/// --timeout-s 1), and top-k at ratio 1 all-gathers values and indices from 8 ranks (2.4 s,
/// past it, every time).
const SLOW_LINK: &[&str] = &[
    "--model",
    "mlp",
    "--widths",
    "16,256,4",
    "--batch-size",
    "4",
    "--world-size",
    "8",
    "--threads-per-rank",
    "1",
    "--net-gbps",
    "0.001",
    "--timeout-s",
    "1",
];

#[test]
fn a_study_whose_policy_fails_while_training_writes_the_policies_that_finished() {
    let d = dir("study-fails-partway");
    let out = d.join("out");
    // diloco:100 syncs nothing in 4 steps; topk:1 times out in its first step
    let run = brigade(
        &[
            &["study"],
            SLOW_LINK,
            &["--steps", "4", "--target-loss", "1", "--out", s(&out)],
            &["--policy", "diloco:100,topk:1,allreduce"],
        ]
        .concat(),
    );
    assert_eq!(run.status.code(), Some(1));
    let line = error_line(&run);
    assert!(line.contains("--policy topk:1 failed"), "{line}");
    assert!(line.contains("did not complete within"), "{line}");
    assert!(line.contains("--out holds the 1 of 3 policies"), "{line}");
    let summary = std::fs::read_to_string(out.join("study_summary.csv")).expect("the finished policy is written");
    let policies: Vec<&str> = summary.lines().skip(1).map(|l| l.split(',').next().unwrap()).collect();
    assert_eq!(policies, ["diloco:100"], "the finished policy alone:\n{summary}");
    assert!(out.join("study.csv").exists() && out.join("study.svg").exists());
}

#[test]
fn a_run_that_a_collective_timeout_stops_partway_writes_its_finished_steps() {
    let d = dir("train-fails-partway");
    let (losses, timeline, ck) = (d.join("l.csv"), d.join("t.json"), d.join("c.ckpt"));
    // DiLoCo every 3 steps: steps 0 and 1 sync nothing; the checkpoint after step 1 gathers
    // every rank's DiLoCo state (8 ranks' copies of the parameters, past --timeout-s 1 on this
    // link every time, where building DDP's one broadcast of them takes 172 ms)
    let run = brigade(
        &[
            &["train"],
            SLOW_LINK,
            &["--steps", "6", "--policy", "diloco:3", "--quiet"],
            &["--losses", s(&losses), "--timeline", s(&timeline)],
            &["--checkpoint", s(&ck), "--checkpoint-every", "2"],
        ]
        .concat(),
    );
    assert_eq!(run.status.code(), Some(1));
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(err.contains("did not complete within"), "{err}");
    let rows = common::losses(&losses);
    assert_eq!(
        rows.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
        [0, 1],
        "the finished steps' losses"
    );
    assert!(timeline.exists(), "the last finished step's timeline");
    assert!(!ck.exists(), "no checkpoint from a state whose gather failed");
}
