//! The policies beside 16-bit parameters that compute from the bucket themselves: fp16
//! compression of fp16 gradients (a pass-through), PowerSGD and int8 (in f32 from the 16-bit
//! bucket, their error feedback kept through the loss scaler's skipped steps and scale changes)
//! and a user's policy (the `own_hook` example's int8) train the MLP and the GPT on 2 ranks
//! under bf16 and fp16, each within its compression's error of the same precision's all-reduce.

use std::sync::{Arc, Mutex};

use brigade::config::TrainConfig;
use brigade::ddp::policy::{
    BucketLayout, BucketSpan, Group, PolicyBucket, PolicyContext, PolicyMemory, Reduction, StepContext,
};
use brigade::ddp::{KeepsState, ReducerPolicy};
use brigade::policies::{PolicySpec, Registry};
use brigade::policy::MakePolicy;
use brigade::tensor::{DType, Tensor};
use brigade::RunReport;

use crate::fake_policies::own_hook;
use crate::mixed_precision::{config, fp16_config, gpt, mlp, worst_relative};

/// Rank 0's error-feedback state (its f32 tensors, as bits) after each step.
type Log = Arc<Mutex<Vec<Vec<(String, Vec<u32>)>>>>;

/// A user's policy that runs a built-in one and records rank 0's f32 state after each step.
struct Recorded {
    inner: Box<dyn ReducerPolicy>,
    rank: usize,
    log: Log,
}

impl ReducerPolicy for Recorded {
    fn name(&self) -> String {
        self.inner.name()
    }

    fn keeps_state(&self) -> KeepsState {
        self.inner.keeps_state()
    }

    fn layout(&self, ctx: &PolicyContext) -> BucketLayout {
        self.inner.layout(ctx)
    }

    fn buckets_built(&mut self, buckets: &[BucketSpan], generation: u64) -> brigade::ddp::Result<()> {
        self.inner.buckets_built(buckets, generation)
    }

    fn reduce(&mut self, bucket: PolicyBucket, comm: &Group) -> brigade::ddp::Result<Reduction> {
        self.inner.reduce(bucket, comm)
    }

    fn after_step(&mut self, step: &StepContext<'_>, comm: &Group) -> brigade::ddp::Result<()> {
        self.inner.after_step(step, comm)?;
        if self.rank == 0 {
            let state = self.inner.state_dict()?;
            let bits = |t: &Tensor| -> Vec<u32> { t.to_vec::<f32>().unwrap().iter().map(|x| x.to_bits()).collect() };
            let f32s = state.iter().filter(|(_, t)| t.dtype() == DType::F32);
            self.log
                .lock()
                .unwrap()
                .push(f32s.map(|(k, t)| (k.clone(), bits(t))).collect());
        }
        Ok(())
    }

    fn state_dict(&self) -> brigade::ddp::Result<Vec<(String, Tensor)>> {
        self.inner.state_dict()
    }

    fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> brigade::ddp::Result<()> {
        self.inner.load_state_dict(state)
    }

    fn memory(&self) -> PolicyMemory {
        self.inner.memory()
    }
}

fn with_policy(cfg: &TrainConfig, policy: &str) -> TrainConfig {
    let mut c = cfg.clone();
    let make: Arc<dyn MakePolicy> = match policy {
        "own_hook" => Arc::new(|_rank: usize| own_hook::Int8::default()),
        spec => Arc::new(spec.parse::<PolicySpec>().unwrap()),
    };
    c.distributed.as_mut().unwrap().policy = make;
    c
}

/// PowerSGD and int8 under fp16 whose scale doubles every 2 clean steps until the scaled
/// gradients overflow: each overflow is a skipped step (the inf reached the scaler through the
/// policy's factors or its int8 scale), after which the error feedback is the one from before
/// the step in the halved scale's units (bit for bit: halved) and PowerSGD's warm-start Q the
/// one from before; the run trains on with finite losses.
#[test]
fn fp16_error_feedback_survives_a_skipped_step_and_the_scale_change() {
    for spec in ["powersgd:2@1", "int8"] {
        let log: Log = Arc::default();
        let mut c = fp16_config(24);
        let (l, s) = (log.clone(), spec.to_string());
        c.distributed.as_mut().unwrap().policy = Arc::new(move |rank: usize| Recorded {
            inner: s.parse::<PolicySpec>().unwrap().build(&Registry::new()).unwrap(),
            rank,
            log: l.clone(),
        });
        let r = mlp(&c).unwrap();
        let (steps, log) = (&r.outcome.steps, log.lock().unwrap());
        assert_eq!(log.len(), steps.len(), "{spec}: one record a step");
        let skipped: Vec<usize> = steps
            .iter()
            .filter(|s| s.skipped && s.step >= 2 && s.step + 1 < steps.len())
            .map(|s| s.step)
            .collect();
        assert!(
            !skipped.is_empty(),
            "{spec}: no step skipped after the residual started"
        );
        for &k in &skipped {
            let (before, after) = (&log[k - 1], &log[k]);
            assert!(
                before.iter().any(|(n, _)| !n.starts_with("q.")),
                "{spec}: a residual before step {k}"
            );
            assert_eq!(
                steps[k + 1].scale.unwrap(),
                steps[k].scale.unwrap() / 2.0,
                "{spec}: backed off"
            );
            for ((n, b), (m, a)) in before.iter().zip(after) {
                assert_eq!(n, m);
                let want: Vec<u32> = match n.starts_with("q.") {
                    true => b.clone(),
                    false => b.iter().map(|x| (f32::from_bits(*x) * 0.5).to_bits()).collect(),
                };
                assert!(
                    a == &want,
                    "{spec}: '{n}' after the skipped step {k} is not the halved one before it"
                );
            }
        }
        let losses = r.outcome.losses();
        assert!(losses.iter().all(|x| x.is_finite()), "{spec}: {losses:?}");
        assert!(
            losses.last().unwrap() < &losses[0],
            "{spec} learns despite its skips: {losses:?}"
        );
        assert!(
            r.outcome.skipped_steps() < steps.len() / 2,
            "{spec}: {} skipped",
            r.outcome.skipped_steps()
        );
    }
}

/// Every policy newly allowed beside 16-bit parameters, 2 ranks, a few steps: finite losses
/// within the stated relative tolerance of the same precision's all-reduce run, buckets of the
/// same bytes.
#[test]
fn the_policies_train_the_mlp_and_the_gpt_in_bf16_and_fp16() {
    type Run = fn(&TrainConfig) -> brigade::Result<RunReport>;
    let bf16: &[(&str, f64)] = &[("int8", 0.03), ("own_hook", 0.03)];
    let fp16: &[(&str, f64)] = &[("fp16", 1e-3), ("powersgd:4@2", 0.05), ("int8", 0.03)];
    for (precision, policies) in [(DType::BF16, bf16), (DType::F16, fp16)] {
        for (model, run, steps, batch) in [("mlp", mlp as Run, 8, 16), ("gpt", gpt as Run, 6, 4)] {
            let cfg = config(steps, batch, precision);
            let plain = run(&cfg).unwrap();
            let l = plain.outcome.losses();
            for &(policy, tolerance) in policies {
                let r = run(&with_policy(&cfg, policy)).unwrap();
                let losses = r.outcome.losses();
                assert!(
                    losses.iter().all(|x| x.is_finite()),
                    "{model} {policy} {precision}: {losses:?}"
                );
                let worst = worst_relative(&l, &losses);
                eprintln!("{model} {policy} {precision}: worst relative loss difference to the all-reduce {worst:e}");
                assert!(worst <= tolerance, "{model} {policy} {precision}: {losses:?} vs {l:?}");
                let (m, p) = (r.outcome.memory.unwrap(), plain.outcome.memory.unwrap());
                assert_eq!(
                    m.buckets, p.buckets,
                    "{model} {policy} {precision}: buckets in the reduce dtype"
                );
            }
        }
    }
}

/// PowerSGD and int8 under fp16 resume bit for bit: their error feedback is saved in the units
/// of the scale the checkpoint's scaler holds (the scale changes every 2 steps here), so 6
/// steps + resume + 6 are 12 straight.
#[test]
fn fp16_error_feedback_resumes_bit_for_bit_across_scale_changes() {
    use crate::common::{resuming, tmp, writing};
    let dir = tmp("mixed-policies", "resume");
    for spec in ["powersgd:2@1", "int8"] {
        let cfg = |steps| with_policy(&fp16_config(steps), spec);
        let half = dir.join(format!("{spec}.safetensors"));
        let straight = mlp(&cfg(12)).unwrap();
        mlp(&writing(cfg(6), &half)).unwrap();
        let resumed = mlp(&resuming(cfg(12), &half)).unwrap();
        let tail = |r: &RunReport| -> Vec<(u64, Option<f64>, bool)> {
            r.outcome
                .steps
                .iter()
                .map(|s| (s.loss.to_bits(), s.scale, s.skipped))
                .collect()
        };
        assert_eq!(tail(&resumed), tail(&straight)[6..].to_vec(), "{spec}");
        let bits = |r: &RunReport| -> Vec<Vec<u32>> {
            (r.outcome.params.iter())
                .map(|(_, t)| t.to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect())
                .collect()
        };
        assert!(
            bits(&resumed) == bits(&straight),
            "{spec}: the masters after 6 + 6 steps are those after 12"
        );
    }
}

/// fp16 compression of fp16 gradients is a pass-through whose overflow stop does not pre-empt
/// the loss scaler: with the scale doubling every 2 clean steps it skips, backs off and grows as
/// the fp16 all-reduce run does (the same scales and skips), its losses within 1e-3.
#[test]
fn fp16_compression_of_fp16_gradients_leaves_the_overflows_to_the_scaler() {
    let verdicts =
        |r: &RunReport| -> Vec<(Option<f64>, bool)> { r.outcome.steps.iter().map(|s| (s.scale, s.skipped)).collect() };
    let plain = mlp(&fp16_config(40)).unwrap();
    assert!(
        plain.outcome.skipped_steps() > 0,
        "the all-reduce run skips: {:?}",
        verdicts(&plain)
    );
    let fp16 = mlp(&with_policy(&fp16_config(40), "fp16")).unwrap();
    assert_eq!(verdicts(&fp16), verdicts(&plain), "fp16 compression: scales and skips");
    let worst = worst_relative(&plain.outcome.losses(), &fp16.outcome.losses());
    eprintln!("fp16 compression under fp16: worst relative loss difference {worst:e}");
    assert!(
        worst < 1e-3,
        "{:?} vs {:?}",
        fp16.outcome.losses(),
        plain.outcome.losses()
    );
}
