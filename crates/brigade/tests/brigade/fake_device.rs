//! A GPT training step on the counting fake device (`brigade::tensor::fake`): what it copies to
//! and from the device and how often the host waits, pinned. On a GPU each copy back drains the
//! stream, so a step must read back nothing but its loss (single rank), and, with DDP
//! host-staged, the loss and each bucket it stages through the host. A host read added inside
//! the step (an index check that copies the ids back, a `to_vec` of a gradient) changes these
//! counts and fails the test.
//!
//! The counts of one step are the difference between a 3-step and a 1-step run, halved: the
//! setup (parameters and optimizer state moved to the device, the initial broadcast) cancels.

use brigade::config::{OptimizerConfig, TrainConfig};
use brigade::launch::LaunchConfig;
use brigade::models::{Dataset, Gpt, GptConfig, Model};
use brigade::placement::DevicePlacement;
use brigade::tensor::fake::{self, FakeCounts};
use brigade::tensor::DType;
use brigade::{fit, Error};

pub(crate) fn small_gpt() -> GptConfig {
    GptConfig {
        vocab: 256,
        d_model: 32,
        n_layers: 2,
        n_heads: 2,
        d_ff: 64,
        context: 16,
        dtype: DType::F32,
        dropout: 0.0,
    }
}

/// Runs `steps` steps of the small GPT on fake device `ordinal` with `world` thread ranks and
/// returns the device's counts and the losses.
fn run(steps: usize, world: usize, ordinal: usize, ddp: bool) -> (FakeCounts, Vec<f64>) {
    fake::reset(ordinal);
    let mut cfg = TrainConfig::new(
        steps,
        4 / world,
        OptimizerConfig::Sgd {
            lr: 0.1,
            momentum: 0.0,
            weight_decay: 0.0,
        },
    );
    cfg.runtime.device = DevicePlacement::Fake(ordinal);
    if !ddp {
        cfg.distributed = None;
    }
    let report = fit(
        &LaunchConfig::threads(world),
        &cfg,
        |_world| Dataset::builtin_text(16, 0).map_err(Error::from),
        |_ctx| Ok(Box::new(Gpt::new(small_gpt(), 0)?)),
    )
    .unwrap();
    (fake::counts(ordinal), report.outcome.losses())
}

/// The counts of one step from a 1-step and a 3-step run: (3 steps - 1 step) / 2 (steps 2
/// and 3 must count alike).
pub(crate) fn step_counts(one: FakeCounts, three: FakeCounts) -> FakeCounts {
    let d = |a: u64, b: u64| {
        assert_eq!((a - b) % 2, 0, "steps 2 and 3 differ: {three:?} vs {one:?}");
        (a - b) / 2
    };
    FakeCounts {
        to_device: d(three.to_device, one.to_device),
        to_device_bytes: d(three.to_device_bytes, one.to_device_bytes),
        to_host: d(three.to_host, one.to_host),
        to_host_bytes: d(three.to_host_bytes, one.to_host_bytes),
        host_waits: d(three.host_waits, one.host_waits),
        kernels: d(three.kernels, one.kernels),
        deferred_frees: d(three.deferred_frees, one.deferred_frees),
    }
}

/// The counts of one step: (3 steps - 1 step) / 2.
fn per_step(world: usize, ordinal: usize, ddp: bool) -> (FakeCounts, Vec<f64>) {
    let (one, _) = run(1, world, ordinal, ddp);
    let (three, losses) = run(3, world, ordinal, ddp);
    (step_counts(one, three), losses)
}

#[test]
fn a_gpt_step_on_one_rank_reads_back_its_loss_and_nothing_else() {
    let (c, losses) = per_step(1, 201, false);
    println!("one rank, per step: {c:?}");
    // in: the step's tokens [4, 17] (bytes); out: the loss, one f64
    assert_eq!((c.to_device, c.to_device_bytes), (1, 4 * 17), "{c:?}");
    assert_eq!((c.to_host, c.to_host_bytes), (1, 8), "{c:?}");
    assert_eq!((c.host_waits, c.deferred_frees), (0, 0), "{c:?}");
    assert!(c.kernels > 50, "{c:?}");
    // the same losses as on the CPU (the fake device runs the CPU's kernels)
    let mut cpu = TrainConfig::new(
        3,
        4,
        OptimizerConfig::Sgd {
            lr: 0.1,
            momentum: 0.0,
            weight_decay: 0.0,
        },
    );
    cpu.distributed = None;
    let want = fit(
        &LaunchConfig::threads(1),
        &cpu,
        |_world| Dataset::builtin_text(16, 0).map_err(Error::from),
        |_ctx| Ok(Box::new(Gpt::new(small_gpt(), 0)?)),
    )
    .unwrap()
    .outcome
    .losses();
    assert_eq!(losses, want);
}

#[test]
fn a_ddp_step_host_staged_reads_back_the_loss_and_each_bucket_once() {
    // two ranks on one fake device: every count is both ranks'
    let (c, losses) = per_step(2, 202, true);
    println!("two ranks, host-staged DDP, per step: {c:?}");
    // The small GPT's 0.2 MB of f32 gradients fit DDP's first bucket cap (1 MiB) at first and
    // one 25 MiB bucket after the rebuild: one bucket per rank and step. Per rank: in, its
    // tokens [2, 17] and its averaged bucket; out, its loss and its bucket.
    let params: u64 = Gpt::new(small_gpt(), 0)
        .unwrap()
        .params()
        .params()
        .iter()
        .map(|p| p.value().numel() as u64)
        .sum();
    assert_eq!(c.to_device, 2 * 2, "{c:?}");
    assert_eq!(c.to_device_bytes, 2 * (2 * 17 + 4 * params), "{c:?}");
    assert_eq!(c.to_host, 2 * 2, "{c:?}");
    assert_eq!(c.to_host_bytes, 2 * (8 + 4 * params), "{c:?}");
    assert_eq!((c.host_waits, c.deferred_frees), (0, 0), "{c:?}");
    assert_eq!(losses.len(), 3);
    assert!(losses.iter().all(|l| l.is_finite()));
}
