//! A model written as a `Sequential` (no hand-made parameter store) trains through `fit` on two
//! ranks, and an `on_step` closure sees every step.

use std::sync::{Arc, Mutex};

use brigade::config::Instrumentation;
use brigade::launch::LaunchConfig;
use brigade::models::nn::{Loss, Sequential};
use brigade::models::{Dataset, Model};
use brigade::observe::on_step;
use brigade::tensor::{DType, Rng, Tensor};
use brigade::{fit, OptimizerConfig, TrainConfig};

/// `y = sin(x . w)` for 256 rows of 8 inputs.
fn regression() -> Dataset {
    let x = Tensor::randn(&[256, 8], 1.0, DType::F32, &mut Rng::new(1));
    let w = Tensor::randn(&[8, 1], 0.5, DType::F32, &mut Rng::new(2));
    let y = x.matmul(&w).unwrap().sin().unwrap();
    Dataset::from_tensors("sine", &[("inputs".into(), x), ("targets".into(), y)]).unwrap()
}

#[test]
fn a_sequential_regressor_trains_through_fit_and_on_step_sees_every_step() {
    let seen = Arc::new(Mutex::new(vec![]));
    let log = seen.clone();
    let mut cfg = TrainConfig::new(30, 16, OptimizerConfig::adamw(1e-2, None));
    cfg.runtime.compute_threads = Some(1);
    cfg.runtime.instrument = Instrumentation {
        observer: Some(on_step(move |s| log.lock().unwrap().push((s.step, s.loss)))),
        ..Instrumentation::default()
    };
    let report = fit(
        &LaunchConfig::threads(2),
        &cfg,
        |_| Ok(regression()),
        |_| -> brigade::Result<Box<dyn Model>> {
            let m = Sequential::new(0)
                .linear(8, 32)?
                .layer_norm(32)?
                .gelu()
                .linear(32, 1)?
                .loss(Loss::Mse);
            Ok(Box::new(m))
        },
    )
    .unwrap();
    let losses = report.outcome.losses();
    let seen = seen.lock().unwrap().clone();
    assert_eq!(
        seen.iter().map(|s| s.0).collect::<Vec<_>>(),
        (0..30).collect::<Vec<_>>()
    );
    assert_eq!(
        seen.iter().map(|s| s.1).collect::<Vec<_>>(),
        losses,
        "the losses the run reports"
    );
    let (first, last) = (losses[..5].iter().sum::<f64>(), losses[25..].iter().sum::<f64>());
    assert!(last < 0.5 * first, "it learns: {losses:?}");
    let names: Vec<&str> = report.outcome.params.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        ["0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias"]
    );
}
