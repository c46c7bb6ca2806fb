//! Which reducer policy reaches a target loss soonest at a target scale, with a policy of your
//! own among the built-in ones: register it by name in a [`Registry`] and hand it to
//! [`brigade::study::study`]. Every policy trains the same MLP from the same data, seed and
//! initial weights on 2 thread ranks over a simulated 1 Gb/s, 20 µs link; its steps are
//! profiled and the overlap model predicts its step on that link and at 8 ranks. Prints, per
//! policy, the steps and predicted seconds to the target loss, the bytes sent per step and the
//! prediction's error band on its own profiles; fails if a policy's model did not learn.
//!
//! The policy here, `bf16mean`, averages each bucket in bf16 (half the bytes of an f32
//! all-reduce) and declares its wire model, so that the overlap model can cost it.
//!
//! `cargo run --release -p brigade --example policy_study [-- STEPS]`

use brigade::ddp::policy::{Group, PolicyBucket, ReducerPolicy, Reduction, WireModel};
use brigade::ddp::KeepsState;
use brigade::launch::{net_model, LaunchConfig};
use brigade::models::{Dataset, Mlp, MlpConfig};
use brigade::policies::Registry;
use brigade::study::{study, StudyConfig};
use brigade::tensor::DType;
use brigade::{OptimizerConfig, TrainConfig};

/// Each bucket rounded to bf16, averaged by one all-reduce, widened back.
struct Bf16Mean;

impl ReducerPolicy for Bf16Mean {
    fn name(&self) -> String {
        "bf16mean".into()
    }

    fn keeps_state(&self) -> KeepsState {
        KeepsState::Nothing
    }

    fn reduce(&mut self, bucket: PolicyBucket, comm: &Group) -> brigade::ddp::Result<Reduction> {
        let dtype = bucket.tensor.dtype();
        let half = bucket.tensor.to_dtype(DType::BF16)?;
        let work = comm.all_reduce(&half, brigade::comm::ReduceOp::Avg, &bucket.tag());
        Ok(Reduction::Full(work.then(move |t| Ok(t.to_dtype(dtype)?))))
    }

    fn wire_model(&self, _shapes: &[Vec<usize>], _world_size: usize) -> Option<WireModel> {
        Some(WireModel::AllReduce { bytes_per_element: 2.0 })
    }
}

fn main() -> Result<(), brigade::Error> {
    let steps: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(60);
    let mut registry = Registry::new();
    registry
        .register_about("bf16mean", "a bf16 all-reduce, of your own", |_arg| {
            Ok(Box::new(Bf16Mean))
        })
        .expect("a free name");
    let sgd = OptimizerConfig::Sgd {
        lr: 0.05,
        momentum: 0.9,
        weight_decay: 0.0,
    };
    let cfg = TrainConfig::new(steps, 16, sgd);
    let link = net_model(1.0, 20.0);
    let mut launch = LaunchConfig::threads(2);
    launch.net = Some(link);
    let target = 0.9;
    let sc = StudyConfig {
        other_worlds: vec![8],
        ..StudyConfig::new(vec![link], vec![target])
    };
    let policies = ["allreduce", "fp16", "bf16mean"].map(String::from);
    let studied = study(
        &launch,
        &cfg,
        &registry,
        &policies,
        &sc,
        |_world| Dataset::teacher(4096, 32, 4, 0).map_err(Into::into),
        |_ctx| Ok(Box::new(Mlp::new(MlpConfig::new(vec![32, 128, 128, 4]), 0)?)),
    )?;
    // a policy that failed while it trained stopped the study (`studied.policies` holds the
    // ones that finished before it)
    if let Some(e) = studied.stopped {
        return Err(e.into());
    }
    let results = studied.policies;
    println!(
        "{:>10} {:>13} {:>12} {:>16} {:>14} {:>16} {:>12}",
        "policy", "steps to 0.9", "seconds", "ms/step 2 ranks", "own band", "ms/step 8 ranks", "wire/step"
    );
    for r in &results {
        let (here, at8) = (&r.predictions[0], &r.predictions[1]);
        let reached = here.reached[0];
        let ms = |s: Option<f64>| s.map_or("-".into(), |s| format!("{:.2}", 1e3 * s));
        println!(
            "{:>10} {:>13} {:>12} {:>16} {:>14} {:>16} {:>12.0}",
            r.policy,
            reached.steps.map_or("-".into(), |n| n.to_string()),
            reached.seconds.map_or("-".into(), |s| format!("{s:.3}")),
            ms(here.step_s),
            r.own_band.map_or("-".into(), |b| format!(
                "{:+.0}%..{:+.0}%",
                100.0 * b.low,
                100.0 * b.high
            )),
            ms(at8.step_s),
            r.wire_bytes_per_step
        );
        let (first, last) = (r.losses[0], r.losses[r.losses.len() - 1]);
        if !(last < first) {
            return Err(brigade::Error::Config(format!(
                "{}: the model did not learn (loss {first} -> {last})",
                r.policy
            )));
        }
    }
    Ok(())
}
