//! The ZeRO stages ordered at the peak as the ZeRO paper promises: over a whole run, a rank of
//! ZeRO-2 holds no more bytes at once than one of ZeRO-1, and ZeRO-1 no more than plain DDP,
//! on a GPT with its blocks checkpointed (where each block's gradients arrive within one
//! recompute) and with DDP's default buckets, which hold this model whole (so ZeRO-2 frees no
//! bucket earlier than ZeRO-1 and must not hold more than it either).

use std::sync::Arc;

use brigade::ddp::MemoryReport;
use brigade::launch::LaunchConfig;
use brigade::models::{Dataset, Gpt, GptConfig, Model};
use brigade::policies::PolicySpec;
use brigade::{fit, Error, OptimizerConfig, TrainConfig};

/// The GPT of the ZeRO-3 issue's table (d 128, 4 blocks, context 64): DDP's default caps hold
/// it in two buckets.
fn gpt() -> GptConfig {
    GptConfig {
        vocab: 256,
        d_model: 128,
        n_layers: 4,
        n_heads: 4,
        d_ff: 512,
        context: 64,
        dropout: 0.0,
        ..GptConfig::default()
    }
}

/// Rank 0's memory over a 3-step run of `policy` at world 4, every block checkpointed.
fn memory(policy: PolicySpec) -> MemoryReport {
    let mut c = TrainConfig::new(3, 4, OptimizerConfig::adamw(1e-3, Some(0.01)));
    c.model.name = "gpt".into();
    c.model.activation_checkpointing = 1;
    c.runtime.compute_threads = Some(1);
    c.distributed.get_or_insert_default().policy = Arc::new(policy);
    let report = fit(
        &LaunchConfig::threads(4),
        &c,
        |_| Dataset::builtin_text(64, 0).map_err(Error::from),
        |_| Ok(Box::new(Gpt::new(gpt(), 3)?) as Box<dyn Model>),
    )
    .unwrap();
    report.outcome.memory.unwrap()
}

#[test]
fn zero_2_peaks_no_higher_than_zero_1_and_zero_1_no_higher_than_plain_ddp() {
    let [plain, z1, z2] = [PolicySpec::AllReduce, PolicySpec::Zero1, PolicySpec::Zero2].map(memory);
    for (name, m) in [("plain", &plain), ("zero1", &z1), ("zero2", &z2)] {
        eprintln!("{name}: peak {} at step {:?}, {:?}", m.peak, m.peak_step, m.peak_parts);
    }
    assert!(
        z1.peak <= plain.peak,
        "ZeRO-1 peaks at {} bytes, plain DDP at {}",
        z1.peak,
        plain.peak
    );
    // Whether a bucket's reduce-scatter still holds its scratch at an instant is the comm
    // thread's timing (4 ranks on the test machine's cores), and the recorder keeps the parts
    // of the highest instant only, reductions included: ZeRO-1's highest instant with
    // reductions in flight may fall where backward holds less than at ZeRO-2's. What the
    // ordering asserts, timing apart: ZeRO-2's bytes other than reductions in flight, at its
    // peak, stay within what ZeRO-1 held at its own (a bound on ZeRO-1's held bytes at every
    // instant).
    let held = z2.peak - z2.peak_parts.reductions;
    assert!(
        held <= z1.peak,
        "ZeRO-2 peaks at {} bytes ({} of them reductions in flight), ZeRO-1 at {}; backward {} against {}",
        z2.peak,
        z2.peak_parts.reductions,
        z1.peak,
        z2.peak_parts.backward,
        z1.peak_parts.backward
    );
}
