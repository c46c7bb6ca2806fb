//! `brigade train --resume` with flags that move where the data is read, with a `--losses`
//! file another run wrote, and past the end of a schedule whose T defaulted: the run continues
//! where the checkpoint stood, or says in one line what it cannot continue.

use std::path::Path;
use std::process::Command;

use crate::common::{argmax_rows, bin, cat, dir, fails, losses, mlp_data, ok, s, without, write_rows, MLP};

/// Rank `rank`'s file for the small MLP: `rows` rows of its own.
fn shard(dir: &Path, rank: usize, rows: usize) {
    let (x, y) = argmax_rows(rows, 16, 4, 40 + rank as u64);
    write_rows(&dir.join(format!("shard-{rank}.safetensors")), x, y, 16);
}

#[test]
fn a_resume_on_in_order_data_with_other_rows_a_step_is_one_error_line() {
    let d = dir("drift-batch");
    let data = mlp_data(&d, None);
    let ck = d.join("ck.safetensors");
    let base = cat(&[&["train"], MLP, &["--data", s(&data), "--optimizer", "sgd"]]);
    ok(&cat(&[
        &base,
        &["--steps", "2", "--batch-size", "8", "--checkpoint", s(&ck)],
    ]));
    // 16 rows were read; another --batch-size or --accum would start elsewhere
    for other in [&["--batch-size", "16"][..], &["--batch-size", "8", "--accum", "2"]] {
        let e = fails(&cat(&[&base, other, &["--steps", "4", "--resume", s(&ck)]]));
        assert!(
            e.contains("8 rows a step") && e.contains("--batch-size") && e.contains("--accum"),
            "{e}"
        );
    }
    // the same rows a step, split otherwise, read the same rows: that resume is the straight run
    resumed_is_straight(
        &d,
        &cat(&[
            &base,
            &["--batch-size", "4", "--accum", "2", "--steps", "4", "--resume", s(&ck)],
        ]),
        &cat(&[&base, &["--batch-size", "8", "--steps", "4"]]),
    );
}

/// Runs `resumed` (a resume, at step 2, of a run that wrote no `--losses`) and `straight` (the
/// same 4 steps from step 0), each writing its `--losses` in `d`, and checks that the resumed
/// file holds steps 2 and 3, with the straight run's losses.
fn resumed_is_straight(d: &Path, resumed: &[&str], straight: &[&str]) {
    let (l, straight_l) = (d.join("l.csv"), d.join("straight.csv"));
    ok(&cat(&[resumed, &["--losses", s(&l)]]));
    ok(&cat(&[straight, &["--losses", s(&straight_l)]]));
    let (a, b) = (losses(&l), losses(&straight_l));
    assert_eq!(a.len(), 2);
    for ((sa, la), (sb, lb)) in a.iter().zip(&b[2..]) {
        assert_eq!(sa, sb);
        assert!((la - lb).abs() < 1e-5, "step {sa}: {la} against {lb}");
    }
}

#[test]
fn a_join_resume_after_a_rank_joined_continues_the_straight_run() {
    let d = dir("drift-join");
    // rank 0: 5 steps of 8 rows, rank 1: 3 (it joins at step 3)
    shard(&d, 0, 40);
    shard(&d, 1, 24);
    let pattern = d.join("shard-{rank}.safetensors");
    let base = cat(&[
        &["train"],
        MLP,
        &["--world-size", "2", "--optimizer", "sgd", "--join", "divide-initial"],
        &["--data", s(&pattern)],
    ]);
    let (ck, l, straight) = (d.join("ck.safetensors"), d.join("l.csv"), d.join("straight.csv"));
    ok(&cat(&[
        &base,
        &["--batch-size", "8", "--steps", "4", "--checkpoint", s(&ck)],
    ]));
    ok(&cat(&[
        &base,
        &[
            "--batch-size",
            "8",
            "--steps",
            "5",
            "--resume",
            s(&ck),
            "--losses",
            s(&l),
        ],
    ]));
    ok(&cat(&[
        &base,
        &["--batch-size", "8", "--steps", "5", "--losses", s(&straight)],
    ]));
    let (a, b) = (losses(&l), losses(&straight));
    // the first run wrote no --losses: the file holds the resumed step alone
    assert_eq!(a.len(), 1);
    let out = Command::new(bin())
        .args(cat(&[
            &base,
            &[
                "--batch-size",
                "8",
                "--steps",
                "5",
                "--resume",
                s(&ck),
                "--losses",
                s(&d.join("new.csv")),
            ],
        ]))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && !err.contains("--losses"),
        "no file, nothing to say of it: {err}"
    );
    assert_eq!((a[0].0, b[4].0), (4, 4));
    assert!((a[0].1 - b[4].1).abs() < 1e-5, "{a:?} against {b:?}");
    // another --batch-size would put the ranks' positions and joins elsewhere: one line
    // naming what the checkpoint was written with
    for other in ["4", "16"] {
        let e = fails(&cat(&[
            &base,
            &["--batch-size", other, "--steps", "5", "--resume", s(&ck)],
        ]));
        assert!(e.contains("8 rows a step") && e.contains("--batch-size"), "{e}");
        assert!(!e.contains("ranks joined"), "{e}");
    }
}

#[test]
fn a_resume_writes_the_losses_up_to_its_step_from_the_file_and_no_gap() {
    let d = dir("drift-losses");
    let data = mlp_data(&d, None);
    let base = cat(&[&["train"], MLP, &["--data", s(&data), "--batch-size", "8"]]);
    let (ck, l) = (d.join("ck.safetensors"), d.join("l.csv"));
    // a longer run's file: its rows past the checkpoint's step are not this run's
    ok(&cat(&[&base, &["--steps", "3", "--checkpoint", s(&ck)]]));
    ok(&cat(&[&base, &["--steps", "6", "--losses", s(&l)]]));
    ok(&cat(&[&base, &["--steps", "5", "--resume", s(&ck), "--losses", s(&l)]]));
    let steps: Vec<usize> = losses(&l).iter().map(|r| r.0).collect();
    assert_eq!(steps, [0, 1, 2, 3, 4]);
    // a file that lacks steps before the checkpoint's: said in one line, and no gap
    ok(&cat(&[&base, &["--steps", "1", "--losses", s(&l)]]));
    let out = Command::new(bin())
        .args(cat(&[&base, &["--steps", "5", "--resume", s(&ck), "--losses", s(&l)]]))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let said: Vec<&str> = err.lines().filter(|line| line.contains("--losses")).collect();
    assert_eq!(said.len(), 1, "{err}");
    assert!(said[0].contains("steps 1 to 2") && said[0].contains("step 3"), "{err}");
    let steps: Vec<usize> = losses(&l).iter().map(|r| r.0).collect();
    assert_eq!(steps, [3, 4]);
}

#[test]
fn a_resume_past_a_defaulted_t_says_so_naming_lr_decay_steps() {
    let d = dir("drift-t");
    let data = mlp_data(&d, None);
    let ck = d.join("ck.safetensors");
    let base = cat(&[
        &["train"],
        MLP,
        &["--data", s(&data), "--batch-size", "8", "--lr-schedule", "cosine"],
    ]);
    ok(&cat(&[&base, &["--steps", "3", "--checkpoint", s(&ck)]]));
    let notes = |flags: &[&str]| -> Vec<String> {
        let out = Command::new(bin())
            .args(cat(&[&base, flags, &["--resume", s(&ck)]]))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{err}");
        err.lines()
            .filter(|l| l.contains("--lr-decay-steps"))
            .map(str::to_string)
            .collect()
    };
    let said = notes(&["--steps", "6"]);
    assert_eq!(said.len(), 1, "{said:?}");
    assert!(said[0].starts_with("note: ") && said[0].contains("T = 3"), "{said:?}");
    // within T, or T given: nothing to say
    assert!(notes(&["--steps", "3"]).is_empty());
    let _ = std::fs::remove_file(&ck);
    ok(&cat(&[
        &base,
        &["--steps", "3", "--lr-decay-steps", "3", "--checkpoint", s(&ck)],
    ]));
    assert!(notes(&["--steps", "6", "--lr-decay-steps", "3"]).is_empty());
}

#[test]
fn a_checkpoint_written_under_allow_nonfinite_resumes_with_it_and_only_with_it() {
    let d = dir("drift-nonfinite");
    let ck = d.join("ck.safetensors");
    // a learning rate this large turns the parameters into NaN within the first steps
    let base = cat(&[
        &["train"],
        &without(MLP, "--lr"),
        &["--lr", "1e300", "--batch-size", "8"],
    ]);
    ok(&cat(&[
        &base,
        &["--steps", "3", "--allow-nonfinite", "--checkpoint", s(&ck)],
    ]));
    ok(&cat(&[
        &base,
        &["--steps", "5", "--allow-nonfinite", "--resume", s(&ck)],
    ]));
    // without the flag the non-finite values are one line naming it
    let e = fails(&cat(&[&base, &["--steps", "5", "--resume", s(&ck)]]));
    assert!(e.contains("NaN") && e.contains("--allow-nonfinite"), "{e}");
}

#[test]
fn a_zero_3_resume_reading_its_shards_names_a_non_finite_value_as_the_whole_read_does() {
    let d = dir("drift-nonfinite-zero3");
    let ck = d.join("ck.safetensors");
    let base = cat(&[
        &["train"],
        &without(MLP, "--lr"),
        &["--lr", "1e300", "--batch-size", "8", "--world-size", "2", "--zero", "3"],
    ]);
    ok(&cat(&[
        &base,
        &["--steps", "3", "--allow-nonfinite", "--checkpoint", s(&ck)],
    ]));
    // each rank reads only its shards of the parameters, and finds the NaN there
    let e = fails(&cat(&[&base, &["--steps", "5", "--resume", s(&ck)]]));
    assert!(
        e.contains("tensor 'model.layers.") && e.contains("NaN at index [") && e.contains("--allow-nonfinite"),
        "{e}"
    );
    ok(&cat(&[
        &base,
        &["--steps", "5", "--allow-nonfinite", "--resume", s(&ck)],
    ]));
}

#[test]
fn profiled_steps_before_the_step_a_resume_continues_from_are_refused() {
    let d = dir("drift-profile-steps");
    let (ck, p) = (d.join("ck.safetensors"), d.join("steps.json"));
    let base = cat(&[&["train"], MLP]);
    ok(&cat(&[&base, &["--steps", "4", "--checkpoint", s(&ck)]]));
    let resumed = cat(&[&base, &["--steps", "8", "--resume", s(&ck), "--profile", s(&p)]]);
    let e = fails(&cat(&[&resumed, &["--profile-steps", "2..6"]]));
    assert!(
        e.contains("--profile-steps 2..6 starts before step 4, where --resume continues"),
        "{e}"
    );
    assert!(!p.exists());
    ok(&cat(&[&resumed, &["--profile-steps", "4..6"]]));
    assert!(p.exists());
}

#[test]
fn a_resume_on_in_order_data_on_other_ranks_reads_on_from_the_row_the_step_reached() {
    let d = dir("drift-world");
    let data = mlp_data(&d, None);
    let ck = d.join("ck.safetensors");
    let base = cat(&[&["train"], MLP, &["--data", s(&data), "--optimizer", "sgd"]]);
    // 2 ranks x 4 rows: a step reads 8 rows, 16 by step 2
    ok(&cat(&[
        &base,
        &[
            "--world-size",
            "2",
            "--batch-size",
            "4",
            "--steps",
            "2",
            "--checkpoint",
            s(&ck),
        ],
    ]));
    // 1 or 4 ranks at 4 rows a rank would read 4 or 16 rows a step: step 2 would start at row 8
    // or 32, not 16
    for world in ["1", "4"] {
        let e = fails(&cat(&[
            &base,
            &[
                "--world-size",
                world,
                "--batch-size",
                "4",
                "--steps",
                "4",
                "--resume",
                s(&ck),
            ],
        ]));
        assert!(
            e.contains("4 rows a step per rank") && e.contains("on 2 ranks") && e.contains("--world-size"),
            "{world} ranks: {e}"
        );
    }
    // 1 rank x 8 rows reads the same 8 rows a step: that resume is the straight run on 2 ranks
    resumed_is_straight(
        &d,
        &cat(&[
            &base,
            &[
                "--world-size",
                "1",
                "--batch-size",
                "8",
                "--steps",
                "4",
                "--resume",
                s(&ck),
            ],
        ]),
        &cat(&[&base, &["--world-size", "2", "--batch-size", "4", "--steps", "4"]]),
    );
}

#[test]
fn a_resumed_losses_file_under_eval_every_is_the_straight_runs_file() {
    let d = dir("drift-eval");
    let base = cat(&[
        &["train"],
        MLP,
        &["--world-size", "2", "--val-fraction", "0.25", "--eval-every", "4"],
    ]);
    let (ck, l, straight) = (d.join("ck.safetensors"), d.join("l.csv"), d.join("straight.csv"));
    ok(&cat(&[&base, &["--steps", "10", "--losses", s(&straight)]]));
    // the first part evaluates after its own last step, 5, which the straight run does not
    ok(&cat(&[
        &base,
        &["--steps", "6", "--losses", s(&l), "--checkpoint", s(&ck)],
    ]));
    let first = std::fs::read_to_string(&l).unwrap();
    assert!(first.lines().nth(6).is_some_and(|r| !r.ends_with(',')), "{first}");
    ok(&cat(&[
        &base,
        &["--steps", "10", "--losses", s(&l), "--resume", s(&ck)],
    ]));
    assert_eq!(
        std::fs::read_to_string(&l).unwrap(),
        std::fs::read_to_string(&straight).unwrap()
    );
}

#[test]
fn a_losses_file_of_another_run_is_refused_by_a_resume_before_step_0() {
    let d = dir("drift-other-losses");
    let (ck, l) = (d.join("ck.safetensors"), d.join("l.csv"));
    // run A writes the file; run B, at another --lr, the checkpoint resumed with A's file
    ok(&cat(&[&["train"], MLP, &["--steps", "6", "--losses", s(&l)]]));
    let before = std::fs::read(&l).unwrap();
    let b = without(MLP, "--lr");
    let b = cat(&[&["train"], &b, &["--lr", "0.02"]]);
    ok(&cat(&[&b, &["--steps", "3", "--checkpoint", s(&ck)]]));
    let e = fails(&cat(&[&b, &["--steps", "6", "--resume", s(&ck), "--losses", s(&l)]]));
    assert!(e.contains("holds another run's rows") && e.contains("step 2"), "{e}");
    assert_eq!(std::fs::read(&l).unwrap(), before, "run A's record is kept");
    // its own file, kept before the resume step: every row
    let own = d.join("own.csv");
    ok(&cat(&[&b, &["--steps", "3", "--losses", s(&own)]]));
    let out = Command::new(bin())
        .args(cat(&[&b, &["--steps", "6", "--resume", s(&ck), "--losses", s(&own)]]))
        .output()
        .unwrap();
    assert!(
        out.status.success() && out.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(losses(&own).len(), 6);
}
