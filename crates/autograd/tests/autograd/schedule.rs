//! Learning-rate schedules against their formulas at every step, written out
//! here independently of the library's code.

use std::f64::consts::PI;

use brigade_autograd::{AutogradError, LrSchedule, Optimizer, ParamStore, ScheduleKind, Sgd};
use brigade_tensor::Tensor;

const LR: f64 = 3e-3;
const MIN: f64 = 3e-4;

/// `s < W`: `lr·(s+1)/W`; `W <= s < T`: `min + ½(lr − min)(1 + cos(π(s − W)/(T − W)))`;
/// `s >= T`: `min`.
fn cosine(s: u64, w: u64, t: u64) -> f64 {
    if s < w {
        LR * (s + 1) as f64 / w as f64
    } else if s < t {
        MIN + 0.5 * (LR - MIN) * (1.0 + (PI * (s - w) as f64 / (t - w) as f64).cos())
    } else {
        MIN
    }
}

/// The same warmup, then a straight line from `lr` (at `W`) to `min` (at `T`).
fn linear(s: u64, w: u64, t: u64) -> f64 {
    if s < w {
        LR * (s + 1) as f64 / w as f64
    } else if s < t {
        let f = (s - w) as f64 / (t - w) as f64;
        LR * (1.0 - f) + MIN * f
    } else {
        MIN
    }
}

fn assert_close(s: u64, got: f64, want: f64) {
    assert!(
        (got - want).abs() <= 1e-12 * want.abs().max(1e-300),
        "step {s}: got {got:e}, formula {want:e}"
    );
}

#[test]
fn cosine_with_warmup_follows_the_formula_at_every_step() {
    for (w, t) in [(0, 1), (0, 50), (1, 2), (7, 50), (10, 11), (25, 400)] {
        let s = LrSchedule::new(
            LR,
            w,
            ScheduleKind::Cosine {
                decay_steps: t,
                min_lr: MIN,
            },
        )
        .unwrap();
        for step in 0..t + 30 {
            assert_close(step, s.lr_at(step), cosine(step, w, t));
        }
        // the landmarks, by hand: the peak right after the warmup, the floor from T on
        assert_eq!(s.lr_at(w), LR, "W={w} T={t}");
        assert_eq!(s.lr_at(t), MIN);
        assert_eq!(s.lr_at(u64::MAX), MIN);
        if w > 0 {
            assert_close(0, s.lr_at(0), LR / w as f64);
        }
    }
}

#[test]
fn linear_decays_to_min_lr_at_t_and_holds_it() {
    for (w, t) in [(0, 1), (0, 40), (5, 40), (39, 40)] {
        let s = LrSchedule::new(
            LR,
            w,
            ScheduleKind::Linear {
                decay_steps: t,
                min_lr: MIN,
            },
        )
        .unwrap();
        for step in 0..t + 10 {
            assert_close(step, s.lr_at(step), linear(step, w, t));
        }
        assert_eq!(s.lr_at(w), LR);
        assert_eq!(s.lr_at(t + 1000), MIN);
    }
}

#[test]
fn step_multiplies_by_gamma_every_step_size_steps() {
    for w in [0u64, 4] {
        let s = LrSchedule::new(
            LR,
            w,
            ScheduleKind::Step {
                step_size: 3,
                gamma: 0.5,
            },
        )
        .unwrap();
        let mut want = LR;
        for step in w..w + 30 {
            // multiply by hand at each multiple of step_size past the warmup
            if step > w && (step - w) % 3 == 0 {
                want *= 0.5;
            }
            assert_close(step, s.lr_at(step), want);
        }
        for step in 0..w {
            assert_close(step, s.lr_at(step), LR * (step + 1) as f64 / w as f64);
        }
    }
}

#[test]
fn constant_is_lr_after_its_warmup() {
    let s = LrSchedule::new(LR, 4, ScheduleKind::Constant).unwrap();
    let got: Vec<f64> = (0..7).map(|i| s.lr_at(i)).collect();
    assert_eq!(got, [LR / 4.0, LR / 2.0, LR * 3.0 / 4.0, LR, LR, LR, LR]);
    assert!((0..100).all(|i| LrSchedule::constant(LR).unwrap().lr_at(i) == LR));
}

#[test]
fn a_decay_that_ends_before_its_warmup_is_one_error_line() {
    for kind in [
        ScheduleKind::Cosine {
            decay_steps: 10,
            min_lr: 0.0,
        },
        ScheduleKind::Linear {
            decay_steps: 5,
            min_lr: 0.0,
        },
    ] {
        let e = LrSchedule::new(LR, 10, kind).unwrap_err();
        assert!(matches!(e, AutogradError::Schedule(_)), "{e:?}");
        let msg = e.to_string();
        assert!(
            msg.contains("must exceed the warmup W = 10") && !msg.contains('\n'),
            "{msg}"
        );
    }
    let bad = [
        LrSchedule::new(f64::NAN, 0, ScheduleKind::Constant),
        LrSchedule::new(-1.0, 0, ScheduleKind::Constant),
        LrSchedule::new(
            LR,
            0,
            ScheduleKind::Cosine {
                decay_steps: 10,
                min_lr: 2.0 * LR,
            },
        ),
        LrSchedule::new(
            LR,
            0,
            ScheduleKind::Step {
                step_size: 0,
                gamma: 0.5,
            },
        ),
        LrSchedule::new(
            LR,
            0,
            ScheduleKind::Step {
                step_size: 1,
                gamma: f64::INFINITY,
            },
        ),
    ];
    for r in bad {
        assert!(matches!(r, Err(AutogradError::Schedule(_))), "{r:?}");
    }
}

#[test]
fn a_resume_that_extends_the_run_continues_the_same_curve() {
    // The schedule is a function of the global step alone: the LRs of steps 0..100 of one run
    // are those of a run stopped at 60 and resumed to 100 (and hold min_lr past T).
    let s = LrSchedule::new(
        LR,
        10,
        ScheduleKind::Cosine {
            decay_steps: 80,
            min_lr: MIN,
        },
    )
    .unwrap();
    let whole: Vec<f64> = (0..100).map(|i| s.lr_at(i)).collect();
    let resumed = s; // rebuilt from what the checkpoint records (Copy + PartialEq)
    let mut split: Vec<f64> = (0..60).map(|i| s.lr_at(i)).collect();
    split.extend((60..100).map(|i| resumed.lr_at(i)));
    assert_eq!(whole, split);
    assert!(whole[80..].iter().all(|&lr| lr == MIN));
}

#[test]
fn apply_sets_the_optimizer_lr_and_display_names_every_parameter() {
    let mut store = ParamStore::new();
    store.add("p", Tensor::zeros(&[2], brigade_tensor::DType::F32)).unwrap();
    let mut opt = Sgd::new(store.params().to_vec(), 1.0, 0.0, 0.0);
    let s = LrSchedule::new(
        LR,
        2,
        ScheduleKind::Linear {
            decay_steps: 12,
            min_lr: MIN,
        },
    )
    .unwrap();
    assert_eq!(s.apply(&mut opt, 0), LR / 2.0);
    assert_eq!(opt.lr(), LR / 2.0);
    s.apply(&mut opt, 50);
    assert_eq!(opt.lr(), MIN);
    assert_eq!(s.to_string(), "linear lr=0.003 warmup=2 T=12 min_lr=0.0003");
}
