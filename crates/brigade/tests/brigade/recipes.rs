//! Training recipes through `fit`: learning-rate schedules, global-norm clipping, what a
//! checkpoint records of them and how a resume treats a change, state dicts from checkpoints.

use std::f64::consts::PI;
use std::sync::{Arc, Mutex};

use brigade::config::{CheckpointConfig, Instrumentation};
use brigade::models::{load_params, Model};
use brigade::observe::TrainObserver;
use brigade::policies::PolicySpec;
use brigade::recipe::{EvalConfig, EvalSource, HyperparameterChange};
use brigade::source::{DataSource, Microbatch};
use brigade::tensor::DType;
use brigade::{OptimizerConfig, ScheduleConfig, ScheduleName, TrainConfig};

use crate::library::{config, run, tmp, Rows, Tiny};

/// SGD without momentum: the step is `lr * grad`, so the learning rate shows in the parameters.
fn plain_sgd(steps: usize, batch: usize, lr: f64) -> TrainConfig {
    let mut c = config(steps, batch);
    c.recipe.optimizer = OptimizerConfig::Sgd {
        lr,
        momentum: 0.0,
        weight_decay: 0.0,
    };
    c
}

fn cosine(warmup: u64, t: Option<u64>, min_lr: f64) -> ScheduleConfig {
    ScheduleConfig {
        name: ScheduleName::Cosine,
        warmup_steps: warmup,
        decay_steps: t,
        min_lr,
        ..ScheduleConfig::default()
    }
}

/// The formula, written out here rather than taken from the library.
fn cosine_lr(lr: f64, min_lr: f64, w: u64, t: u64, s: u64) -> f64 {
    if s < w {
        lr * (s + 1) as f64 / w as f64
    } else if s < t {
        min_lr + 0.5 * (lr - min_lr) * (1.0 + (PI * (s - w) as f64 / (t - w) as f64).cos())
    } else {
        min_lr
    }
}

fn assert_lrs(got: &[f64], want: impl Fn(u64) -> f64, first: u64, what: &str) {
    for (i, g) in got.iter().enumerate() {
        let s = first + i as u64;
        assert!((g - want(s)).abs() <= 1e-15, "{what}: step {s}: {g} vs {}", want(s));
    }
}

#[test]
fn every_schedule_sets_the_learning_rate_of_every_step_by_its_formula() {
    // cosine with warmup, run past T: warmup, decay, then min_lr held
    let cfg = {
        let mut c = plain_sgd(9, 8, 0.2);
        c.recipe.schedule = cosine(2, Some(6), 0.01);
        c
    };
    let r = run(1, &cfg, Rows::new()).unwrap();
    assert_eq!(r.outcome.lrs().len(), 9);
    assert_lrs(&r.outcome.lrs(), |s| cosine_lr(0.2, 0.01, 2, 6, s), 0, "cosine W=2 T=6");
    // W = 0, T defaulting to the run's steps; linear; step
    let cfg = {
        let mut c = plain_sgd(5, 8, 0.2);
        c.recipe.schedule = cosine(0, None, 0.0);
        c
    };
    let r = run(1, &cfg, Rows::new()).unwrap();
    assert_lrs(
        &r.outcome.lrs(),
        |s| cosine_lr(0.2, 0.0, 0, 5, s),
        0,
        "cosine W=0 T=steps",
    );
    let cfg = {
        let mut c = plain_sgd(6, 8, 0.2);
        c.recipe.schedule = ScheduleConfig {
            name: ScheduleName::Linear,
            decay_steps: Some(4),
            min_lr: 0.02,
            ..ScheduleConfig::default()
        };
        c
    };
    let r = run(1, &cfg, Rows::new()).unwrap();
    let linear = |s: u64| {
        if s >= 4 {
            0.02
        } else {
            0.2 + (0.02 - 0.2) * s as f64 / 4.0
        }
    };
    assert_lrs(&r.outcome.lrs(), linear, 0, "linear T=4");
    let cfg = {
        let mut c = plain_sgd(6, 8, 0.2);
        c.recipe.schedule = ScheduleConfig {
            name: ScheduleName::Step,
            warmup_steps: 1,
            step_size: 2,
            gamma: 0.5,
            ..ScheduleConfig::default()
        };
        c
    };
    let r = run(1, &cfg, Rows::new()).unwrap();
    let step = |s: u64| {
        if s < 1 {
            0.2
        } else {
            0.2 * 0.5f64.powi(((s - 1) / 2) as i32)
        }
    };
    assert_lrs(&r.outcome.lrs(), step, 0, "step W=1");
    // the default is the constant optimizer lr, as before schedules
    let r = run(1, &plain_sgd(3, 8, 0.2), Rows::new()).unwrap();
    assert_eq!(r.outcome.lrs(), [0.2; 3]);
}

#[test]
fn the_optimizer_steps_with_the_scheduled_learning_rate() {
    // cosine down to 0 at T = 3: steps 3.. move nothing, so 6 steps end where 3 steps end
    let cfg = |steps| {
        let mut c = plain_sgd(steps, 8, 0.2);
        c.recipe.schedule = cosine(0, Some(3), 0.0);
        c
    };
    let three = run(2, &cfg(3), Rows::new()).unwrap();
    let six = run(2, &cfg(6), Rows::new()).unwrap();
    assert_eq!(six.outcome.params.len(), three.outcome.params.len());
    for ((n, a), (_, b)) in six.outcome.params.iter().zip(&three.outcome.params) {
        assert_eq!(a.to_f64_vec().unwrap(), b.to_f64_vec().unwrap(), "{n}");
    }
    // and the first steps did move them (lr 0.2, not 0)
    let one = run(2, &cfg(1), Rows::new()).unwrap();
    assert_ne!(
        one.outcome.params[0].1.to_f64_vec().unwrap(),
        Tiny::new().unwrap().params().named_values()[0].1.to_f64_vec().unwrap()
    );
}

#[test]
fn a_decaying_schedule_with_t_not_past_the_warmup_is_one_error() {
    let cfg = {
        let mut c = plain_sgd(8, 8, 0.2);
        c.recipe.schedule = cosine(5, Some(5), 0.0);
        c
    };
    let e = run(1, &cfg, Rows::new()).err().expect("T <= W").to_string();
    assert!(e.contains("T = 5") && e.contains("W = 5") && !e.contains('\n'), "{e}");
}

fn with_checkpoint(cfg: TrainConfig, write: Option<&std::path::Path>, resume: Option<&std::path::Path>) -> TrainConfig {
    let mut c = cfg;
    c.runtime.checkpoint = CheckpointConfig {
        path: write.map(Into::into),
        resume: resume.map(Into::into),
        every: None,
        keep_last: None,
        metadata: vec![],
    };
    c
}

#[test]
fn a_resume_that_extends_the_steps_continues_the_same_curve() {
    let d = tmp("schedule-resume");
    let ckpt = d.join("c.ckpt");
    // 4 steps of a cosine over T = 6, then resumed until step 9 with T left to default
    let first = {
        let mut c = plain_sgd(4, 8, 0.2);
        c.recipe.schedule = cosine(1, Some(6), 0.01);
        c
    };
    run(2, &with_checkpoint(first, Some(&ckpt), None), Rows::new()).unwrap();
    let more = {
        let mut c = plain_sgd(9, 8, 0.2);
        c.recipe.schedule = cosine(1, None, 0.01);
        c
    };
    let resumed = run(2, &with_checkpoint(more, None, Some(&ckpt)), Rows::new()).unwrap();
    assert_eq!(resumed.outcome.first_step, 4);
    assert!(resumed.outcome.resume_changes.is_empty());
    assert_lrs(&resumed.outcome.lrs(), |s| cosine_lr(0.2, 0.01, 1, 6, s), 4, "resumed");
    // bit for bit the uninterrupted run of the same curve
    let straight = {
        let mut c = plain_sgd(9, 8, 0.2);
        c.recipe.schedule = cosine(1, Some(6), 0.01);
        c
    };
    let straight = run(2, &straight, Rows::new()).unwrap();
    assert_eq!(resumed.outcome.losses(), straight.outcome.losses()[4..]);
    assert_eq!(resumed.outcome.lrs(), straight.outcome.lrs()[4..]);
}

#[test]
fn a_resume_that_changes_the_schedule_or_its_t_is_refused() {
    let d = tmp("schedule-refused");
    let ckpt = d.join("c.ckpt");
    let first = {
        let mut c = plain_sgd(2, 8, 0.2);
        c.recipe.schedule = cosine(1, Some(6), 0.01);
        c
    };
    run(1, &with_checkpoint(first, Some(&ckpt), None), Rows::new()).unwrap();
    for (what, schedule) in [
        ("another T", cosine(1, Some(8), 0.01)),
        (
            "another kind",
            ScheduleConfig {
                name: ScheduleName::Linear,
                ..cosine(1, Some(6), 0.01)
            },
        ),
        ("no schedule", ScheduleConfig::default()),
    ] {
        let cfg = {
            let mut c = plain_sgd(6, 8, 0.2);
            c.recipe.schedule = schedule;
            c
        };
        let e = run(1, &with_checkpoint(cfg, None, Some(&ckpt)), Rows::new())
            .err()
            .unwrap_or_else(|| panic!("{what} accepted"))
            .to_string();
        assert!(
            e.contains("schedule 'cosine warmup=1 T=6 min_lr=0.01'") && !e.contains('\n'),
            "{what}: {e}"
        );
    }
}

#[test]
fn a_resume_that_changes_the_optimizer_kind_is_refused() {
    let d = tmp("optimizer-refused");
    let ckpt = d.join("c.ckpt");
    run(
        1,
        &with_checkpoint(plain_sgd(2, 8, 0.2), Some(&ckpt), None),
        Rows::new(),
    )
    .unwrap();
    let adamw = {
        let mut c = plain_sgd(4, 8, 0.2);
        c.recipe.optimizer = OptimizerConfig::adamw(0.2, None);
        c
    };
    let e = run(1, &with_checkpoint(adamw, None, Some(&ckpt)), Rows::new())
        .err()
        .expect("another optimizer")
        .to_string();
    assert!(e.contains("optimizer 'sgd'") && e.contains("'adamw'"), "{e}");
}

/// Remembers what the observer was told of a resume.
#[derive(Default)]
struct Changes(Mutex<Vec<HyperparameterChange>>);

impl TrainObserver for Changes {
    fn resumed(&self, changes: &[HyperparameterChange]) {
        self.0.lock().unwrap().extend_from_slice(changes);
    }
}

#[test]
fn a_resume_that_changes_a_hyperparameter_uses_it_and_says_which() {
    let d = tmp("hp-change");
    let ckpt = d.join("c.ckpt");
    run(
        1,
        &with_checkpoint(plain_sgd(2, 8, 0.2), Some(&ckpt), None),
        Rows::new(),
    )
    .unwrap();
    let seen = Arc::new(Changes::default());
    let cfg = {
        let mut c = plain_sgd(4, 8, 0.05);
        c.recipe.clip_grad_norm = Some(0.5);
        c.runtime.instrument = Instrumentation {
            observer: Some(seen.clone()),
            ..Instrumentation::default()
        };
        c
    };
    let r = run(1, &with_checkpoint(cfg, None, Some(&ckpt)), Rows::new()).unwrap();
    let said: Vec<String> = seen.0.lock().unwrap().iter().map(ToString::to_string).collect();
    assert_eq!(said, ["lr 0.2 -> 0.05", "clip_grad_norm none -> 0.5"]);
    assert_eq!(r.outcome.resume_changes.len(), 2);
    assert_eq!(r.outcome.lrs(), [0.05, 0.05], "the new learning rate is used");
    assert!(r.outcome.grad_norms().iter().all(Option::is_some), "and the clipping");
    // an unchanged resume says nothing
    let seen = Arc::new(Changes::default());
    let same = {
        let mut c = plain_sgd(3, 8, 0.2);
        c.runtime.instrument = Instrumentation {
            observer: Some(seen.clone()),
            ..Instrumentation::default()
        };
        c
    };
    run(1, &with_checkpoint(same, None, Some(&ckpt)), Rows::new()).unwrap();
    assert!(seen.0.lock().unwrap().is_empty());
}

#[test]
fn load_params_and_init_read_a_training_checkpoints_model_weights() {
    let d = tmp("state-dict");
    let ckpt = d.join("c.ckpt");
    let trained = run(1, &with_checkpoint(config(3, 8), Some(&ckpt), None), Rows::new()).unwrap();
    let fresh = Tiny::new().unwrap();
    load_params(fresh.params(), &ckpt).unwrap();
    for ((n, want), (m, got)) in trained.outcome.params.iter().zip(fresh.params().named_values()) {
        assert_eq!(n, &m);
        assert_eq!(want.to_f64_vec().unwrap(), got.to_f64_vec().unwrap(), "{n}");
    }
    // --init: a run that starts from the checkpoint's weights (0 steps: they come out as is)
    let init = {
        let mut c = config(0, 8);
        c.model.init = Some(ckpt.clone());
        c
    };
    let r = run(1, &init, Rows::new()).unwrap();
    for ((n, want), (_, got)) in trained.outcome.params.iter().zip(&r.outcome.params) {
        assert_eq!(want.to_f64_vec().unwrap(), got.to_f64_vec().unwrap(), "{n}");
    }
}

/// The total gradient norm of `Tiny` on the first `rows` rows, computed here by hand.
fn grad_norm_by_hand(rows: usize) -> f64 {
    let m = Tiny::new().unwrap();
    let mb = Microbatch {
        step: 0,
        index: 0,
        accum: 1,
        rank: 0,
        world_size: 1,
        rows,
    };
    let batch = Rows::new().batch(&mb).unwrap();
    m.loss(&batch).unwrap().backward().unwrap();
    let mut sq = 0.0;
    for p in m.params().params() {
        let g = p.grad().unwrap().to_dtype(DType::F64).unwrap().to_f64_vec().unwrap();
        sq += g.iter().map(|v| v * v).sum::<f64>();
    }
    sq.sqrt()
}

fn assert_close6(a: &[f64], b: &[f64], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (s, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= 1e-6 * x.abs().max(1.0), "{what}: step {s}: {x} vs {y}");
    }
}

fn norms(r: &brigade::RunReport) -> Vec<f64> {
    r.outcome
        .grad_norms()
        .iter()
        .map(|n| n.expect("a norm every step"))
        .collect()
}

#[test]
fn clipping_is_the_same_on_one_rank_two_ranks_and_accumulation() {
    let clip = |cfg: TrainConfig| {
        let mut c = cfg;
        c.recipe.clip_grad_norm = Some(0.05);
        c
    };
    let one = run(1, &clip(config(6, 16)), Rows::new()).unwrap();
    let two = run(2, &clip(config(6, 8)), Rows::new()).unwrap();
    let accum = run(
        1,
        &clip({
            let mut c = config(6, 8);
            c.data.accum = 2;
            c
        }),
        Rows::new(),
    )
    .unwrap();
    let by_hand = grad_norm_by_hand(16);
    assert!(
        (norms(&one)[0] - by_hand).abs() <= 1e-6 * by_hand,
        "{} vs {by_hand}",
        norms(&one)[0]
    );
    assert!(
        norms(&one).iter().all(|n| *n > 0.05),
        "every step clips: {:?}",
        norms(&one)
    );
    assert_close6(&norms(&two), &norms(&one), "norms: 2 ranks x 8 vs 1 x 16");
    assert_close6(&norms(&accum), &norms(&one), "norms: accum 2 x 8 vs 1 x 16");
    assert_close6(
        &two.outcome.losses(),
        &one.outcome.losses(),
        "losses: 2 ranks x 8 vs 1 x 16",
    );
    assert_close6(
        &accum.outcome.losses(),
        &one.outcome.losses(),
        "losses: accum 2 x 8 vs 1 x 16",
    );
    // clipping changed the run (it is not a no-op)
    let unclipped = run(1, &config(6, 16), Rows::new()).unwrap();
    assert!((unclipped.outcome.losses()[5] - one.outcome.losses()[5]).abs() > 1e-4);
    assert!(unclipped.outcome.grad_norms().iter().all(Option::is_none));
}

#[test]
fn clipping_under_zero_1_and_2_equals_plain_ddp() {
    let cfg = |hook: PolicySpec| {
        let mut c = config(6, 8);
        c.recipe.clip_grad_norm = Some(0.05);
        c.distributed.get_or_insert_default().policy = Arc::new(hook);
        c
    };
    let plain = run(2, &cfg(PolicySpec::AllReduce), Rows::new()).unwrap();
    for (name, hook) in [("zero1", PolicySpec::Zero1), ("zero2", PolicySpec::Zero2)] {
        let z = run(2, &cfg(hook), Rows::new()).unwrap();
        assert_close6(&norms(&z), &norms(&plain), &format!("{name}: norms"));
        assert_close6(&z.outcome.losses(), &plain.outcome.losses(), &format!("{name}: losses"));
        for ((n, a), (_, b)) in z.outcome.params.iter().zip(&plain.outcome.params) {
            assert_close6(
                &a.to_f64_vec().unwrap(),
                &b.to_f64_vec().unwrap(),
                &format!("{name}: {n}"),
            );
        }
    }
}

/// The same rows every step: rank `r` of `world` gets rows `r * rows ..` (the step is ignored).
struct SameRows;

impl DataSource for SameRows {
    fn batch(&self, mb: &Microbatch) -> brigade::Result<brigade::models::Batch> {
        Rows::new().batch(&Microbatch { step: 0, ..*mb })
    }
}

impl EvalSource for SameRows {
    fn batches(&self, rank: usize, world_size: usize) -> brigade::Result<Vec<brigade::models::Batch>> {
        let mb = Microbatch {
            step: 0,
            index: 0,
            accum: 1,
            rank,
            world_size,
            rows: 8,
        };
        Ok(vec![Rows::new().batch(&mb)?])
    }
}

#[test]
fn the_eval_loss_equals_the_training_loss_of_the_same_batch_before_the_next_step() {
    for world in [1, 2] {
        let cfg = {
            let mut c = config(7, 8);
            c.recipe.eval = Some(EvalConfig {
                every: 2,
                data: Arc::new(SameRows),
            });
            c
        };
        let r = brigade::fit(
            &brigade::launch::LaunchConfig::threads(world),
            &cfg,
            |_| Ok(SameRows),
            |_| Ok(Box::new(Tiny::new()?)),
        )
        .unwrap();
        let (val, loss) = (&r.outcome.val_losses(), &r.outcome.losses());
        // after steps 1, 3, 5 (every 2) and 6 (the last)
        let evaluated: Vec<usize> = (0..7).filter(|&s| val[s].is_some()).collect();
        assert_eq!(evaluated, [1, 3, 5, 6], "world {world}");
        for s in [1, 3, 5] {
            let (v, l) = (val[s].unwrap(), loss[s + 1]);
            // the state after step s, on the batch step s + 1 trains on, before its update
            assert!((v - l).abs() <= 1e-6 * l.abs(), "world {world}, step {s}: {v} vs {l}");
        }
        assert!(val[6].unwrap() < loss[0], "it learned");
    }
}
