//! `brigade train` with a recipe: --lr-schedule and its flags, --clip-grad-norm, the `lr` and
//! `grad_norm` columns, what a resume does with a changed recipe, --dropout (a resume stays
//! exact) and the --plot chart.

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
    // T left to default is what is wrong there: the line says where it came from; not beside
    // a fault no T mends
    assert!(e.contains("--lr-decay-steps defaults to --steps"), "{e}");
    let e = fails(&cat(&[BASE, &["--lr-schedule", "step", "--lr-gamma", "0"]]));
    assert!(e.contains("gamma") && !e.contains("--lr-decay-steps"), "{e}");
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
    // The lines a resume with `flags` says about what it changed (it must succeed).
    let resume_notes = |flags: &[&str]| {
        let out = Command::new(bin())
            .args(cat(&[flags, &sched, &["--steps", "5", "--resume", s(&ck)]]))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{err}");
        let said: Vec<String> = err
            .lines()
            .filter(|l| l.contains("resuming with"))
            .map(str::to_string)
            .collect();
        (said, err)
    };
    // another --lr is used, and said in one line on stderr
    let (said, err) = resume_notes(&cat(&[&BASE[..BASE.len() - 3], &["--lr", "0.2", "--quiet"]]));
    assert_eq!(
        said,
        ["note: resuming with lr 0.1 -> 0.2 (this run's values, not the checkpoint's)"],
        "{err}"
    );
    // another --dropout is a change of the model's recipe: used, and said in the same way
    let (said, err) = resume_notes(&cat(&[BASE, &["--dropout", "0.25"]]));
    assert_eq!(
        said,
        ["note: resuming with model.dropout 0.0 -> 0.25 (this run's values, not the checkpoint's)"],
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

/// The loss file's rows and the saved parameters of a run.
fn rows_and_params(losses: &std::path::Path, params: &std::path::Path) -> (Vec<String>, Vec<(String, Vec<u8>)>) {
    let rows = std::fs::read_to_string(losses)
        .unwrap()
        .lines()
        .skip(1)
        .map(String::from)
        .collect();
    let params = brigade_models::load_safetensors(params)
        .unwrap()
        .into_iter()
        .map(|(n, t)| {
            (
                n,
                t.to_vec::<f32>()
                    .unwrap()
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect(),
            )
        })
        .collect();
    (rows, params)
}

#[test]
fn dropout_resumes_exactly_on_one_and_two_ranks() {
    // 2 steps + --resume + 2 steps against 4 straight, at --dropout 0.3: the same loss rows and
    // the same parameters bit for bit (the MLP on one rank, the GPT on two)
    let gpt: &[&str] = &cat(&[
        &["train"],
        super::common::GPT,
        &["--world-size", "2", "--batch-size", "4"],
    ]);
    for (name, base) in [("mlp", BASE), ("gpt", gpt)] {
        let d = dir(&format!("dropout-resume-{name}"));
        let f = |n: &str| d.join(n);
        let flags = ["--dropout", "0.3"];
        ok(&cat(&[
            base,
            &flags,
            &["--steps", "4", "--losses", s(&f("a.csv")), "--save", s(&f("a.st"))],
        ]));
        ok(&cat(&[base, &flags, &["--steps", "2", "--checkpoint", s(&f("ck"))]]));
        ok(&cat(&[
            base,
            &flags,
            &[
                "--steps",
                "4",
                "--resume",
                s(&f("ck")),
                "--losses",
                s(&f("b.csv")),
                "--save",
                s(&f("b.st")),
            ],
        ]));
        let (straight, straight_params) = rows_and_params(&f("a.csv"), &f("a.st"));
        let (resumed, resumed_params) = rows_and_params(&f("b.csv"), &f("b.st"));
        assert_eq!(resumed, straight[2..], "{name}: the loss rows of steps 2 and 3");
        assert!(resumed_params == straight_params, "{name}: parameters, bit for bit");
        // and the dropout is on: without it the losses differ
        ok(&cat(&[
            base,
            &["--steps", "4", "--losses", s(&f("c.csv")), "--save", s(&f("c.st"))],
        ]));
        assert_ne!(rows_and_params(&f("c.csv"), &f("c.st")).0, straight, "{name}");
    }
    for bad in ["1", "-0.1", "NaN"] {
        let e = fails(&cat(&[BASE, &["--dropout", bad]]));
        assert!(e.contains("--dropout must be a probability in [0, 1)"), "{e}");
    }
}

/// The `#RRGGBB` of the chart's training loss, validation loss and learning rate.
const TRAIN_RGB: &str = "#3498DB";
const VAL_RGB: &str = "#E74C3C";
const LR_RGB: &str = "#27AE60";

#[test]
fn plot_draws_the_training_and_validation_loss_and_the_lr_of_every_step() {
    let d = dir("recipe-plot");
    let (plot, losses, ck) = (d.join("run.svg"), d.join("losses.csv"), d.join("ck"));
    let recipe = [
        "--lr-schedule",
        "cosine",
        "--warmup-steps",
        "2",
        "--eval-every",
        "2",
        "--val-fraction",
        "0.1",
        "--losses",
        s(&losses),
        "--plot",
        s(&plot),
    ];
    ok(&cat(&[BASE, &recipe, &["--steps", "6"]]));
    let svg = std::fs::read_to_string(&plot).unwrap();
    super::common::assert_well_formed_xml(&svg);
    let texts = super::common::svg_texts(&svg);
    for legend in ["training loss", "validation loss", "learning rate (right axis)"] {
        assert!(texts.iter().any(|t| t == legend), "legend entry {legend}: {texts:?}");
    }
    // one curve per series beside its 2-point legend line: 6 steps, evaluated after 1, 3, 5
    let points = |rgb| super::common::polyline_points(&svg, rgb);
    assert_eq!(points(TRAIN_RGB), [2, 6]);
    assert_eq!(points(VAL_RGB), [2, 3]);
    assert_eq!(points(LR_RGB), [2, 6]);
    // a resumed run draws the steps before the resume from --losses, then its own
    ok(&cat(&[BASE, &recipe, &["--steps", "3", "--checkpoint", s(&ck)]]));
    ok(&cat(&[BASE, &recipe, &["--steps", "6", "--resume", s(&ck)]]));
    let svg = std::fs::read_to_string(&plot).unwrap();
    assert_eq!(super::common::polyline_points(&svg, TRAIN_RGB), [2, 6]);
}

#[test]
fn a_bad_plot_path_is_one_error_line_before_training() {
    let d = dir("recipe-plot-bad");
    let losses = d.join("losses.csv");
    for (plot, says) in [
        (d.join("no-such-dir").join("p.svg"), "--plot"),
        (d.join("p.png"), "give a FILE.svg"),
        (d.to_path_buf(), "--plot"),
    ] {
        let e = fails(&cat(&[
            BASE,
            &["--steps", "2", "--losses", s(&losses), "--plot", s(&plot)],
        ]));
        assert!(e.contains(says), "{e}");
        assert!(!losses.exists(), "nothing trained, nothing written: {e}");
    }
    // the same file as another output
    let svg = d.join("l.svg");
    let e = fails(&cat(&[BASE, &["--losses", s(&svg), "--plot", s(&svg)]]));
    assert!(e.contains("the same file"), "{e}");
}
