//! `brigade train` with a recipe: --lr-schedule and its flags, --clip-grad-norm, the `lr` and
//! `grad_norm` columns, and what a resume does with a changed recipe.

use std::f64::consts::PI;
use std::process::Command;

use super::common::{bin, cat, dir, fails, ok, s};

const BASE: &[&str] = &[
    "train",
    "--model",
    "mlp",
    "--widths",
    "8,16,4",
    "--batch-size",
    "8",
    "--optimizer",
    "sgd",
    "--lr",
    "0.1",
    "--quiet",
];

/// `(lr, grad_norm)` of every row of a `--losses` file.
fn columns(path: &std::path::Path) -> Vec<(f64, Option<f64>)> {
    let text = std::fs::read_to_string(path).unwrap();
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("step,loss,lr,grad_norm,val_loss"), "{text}");
    lines
        .map(|l| {
            let cells: Vec<&str> = l.split(',').collect();
            assert_eq!(cells.len(), 5, "{l}");
            (cells[2].parse().unwrap(), cells[3].parse().ok())
        })
        .collect()
}

fn cosine(s: usize, lr: f64, min_lr: f64, w: usize, t: usize) -> f64 {
    if s < w {
        lr * (s + 1) as f64 / w as f64
    } else if s < t {
        min_lr + 0.5 * (lr - min_lr) * (1.0 + (PI * (s - w) as f64 / (t - w) as f64).cos())
    } else {
        min_lr
    }
}

#[test]
fn the_losses_file_has_the_scheduled_lr_and_the_clipped_norm_of_every_step() {
    let d = dir("recipe-columns");
    let losses = d.join("losses.csv");
    let sched = [
        "--steps",
        "6",
        "--lr-schedule",
        "cosine",
        "--warmup-steps",
        "2",
        "--min-lr",
        "0.01",
        "--clip-grad-norm",
        "0.05",
        "--losses",
        s(&losses),
    ];
    ok(&cat(&[BASE, &sched]));
    let rows = columns(&losses);
    assert_eq!(rows.len(), 6);
    for (step, (lr, norm)) in rows.iter().enumerate() {
        let want = cosine(step, 0.1, 0.01, 2, 6);
        assert!((lr - want).abs() < 1e-12, "step {step}: {lr} vs {want}");
        assert!(norm.is_some_and(|n| n > 0.0), "step {step}: {norm:?}");
    }
    // without clipping the column is empty, with the constant lr
    ok(&cat(&[BASE, &["--steps", "2", "--losses", s(&losses)]]));
    assert_eq!(columns(&losses), [(0.1, None), (0.1, None)]);
}

#[test]
fn a_schedule_that_cannot_decay_is_one_error_line() {
    let e = fails(&cat(&[
        BASE,
        &["--steps", "4", "--lr-schedule", "cosine", "--warmup-steps", "4"],
    ]));
    assert!(
        e.contains("--lr-schedule cosine") && e.contains("T = 4") && e.contains("W = 4"),
        "{e}"
    );
    let e = fails(&cat(&[BASE, &["--clip-grad-norm", "0"]]));
    assert!(e.contains("--clip-grad-norm"), "{e}");
}

#[test]
fn a_resume_keeps_the_schedule_and_says_which_hyperparameter_it_changed() {
    let d = dir("recipe-resume");
    let (ck, losses) = (d.join("ck.safetensors"), d.join("losses.csv"));
    let sched = ["--lr-schedule", "cosine", "--min-lr", "0.01"];
    ok(&cat(&[BASE, &sched, &["--steps", "4", "--checkpoint", s(&ck)]]));
    // extending --steps continues the curve of T = 4: min_lr from step 4 on
    ok(&cat(&[
        BASE,
        &sched,
        &["--steps", "6", "--resume", s(&ck), "--losses", s(&losses)],
    ]));
    let lrs: Vec<f64> = columns(&losses).iter().map(|(lr, _)| *lr).collect();
    assert_eq!(lrs, [0.01, 0.01]);
    // another T is refused in one line
    let e = fails(&cat(&[
        BASE,
        &sched,
        &["--steps", "6", "--lr-decay-steps", "6", "--resume", s(&ck)],
    ]));
    assert!(e.contains("schedule 'cosine warmup=0 T=4 min_lr=0.01'"), "{e}");
    // another --lr is used, and said in one line on stderr
    let out = Command::new(bin())
        .args(cat(&[
            &BASE[..BASE.len() - 3],
            &["--lr", "0.2", "--quiet"],
            &sched,
            &["--steps", "5", "--resume", s(&ck)],
        ]))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let err = String::from_utf8_lossy(&out.stderr);
    let said: Vec<&str> = err.lines().filter(|l| l.contains("resuming with")).collect();
    assert_eq!(
        said,
        ["note: resuming with lr 0.1 -> 0.2 (this run's values, not the checkpoint's)"],
        "{err}"
    );
}

#[test]
fn eval_every_writes_the_held_out_loss_on_its_steps() {
    let d = dir("recipe-eval");
    let losses = d.join("losses.csv");
    let out = ok(&cat(&[
        BASE,
        &[
            "--steps",
            "5",
            "--eval-every",
            "2",
            "--val-fraction",
            "0.1",
            "--losses",
            s(&losses),
            "--json",
        ],
    ]));
    let text = std::fs::read_to_string(&losses).unwrap();
    let val: Vec<Option<f64>> = text
        .lines()
        .skip(1)
        .map(|l| l.split(',').nth(4).unwrap().parse().ok())
        .collect();
    // after steps 1, 3 (every 2) and 4 (the last)
    let on: Vec<usize> = (0..5).filter(|&s| val[s].is_some()).collect();
    assert_eq!(on, [1, 3, 4], "{text}");
    let json: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    let last = json["last_val_loss"].as_f64().unwrap();
    assert!((last - val[4].unwrap()).abs() < 1e-8, "{out}");
    let e = fails(&cat(&[BASE, &["--eval-every", "2"]]));
    assert!(e.contains("--val-fraction") && e.contains("--eval-data"), "{e}");
}
