//! A reducer policy written outside Brigade's crates, against the public policy contract
//! (`brigade::ddp::ReducerPolicy`) alone: int8 quantization with error feedback. Each rank adds
//! the error it kept from last time, quantizes the bucket with one scale (its largest magnitude
//! over 127), sends the int8 payload with the scale beside it, and keeps the rounding error;
//! int8s are not summed as int8s: the ranks' pieces are all-gathered, dequantized with their own
//! scales and summed in f32. Trains the same MLP through the library's loop (`brigade::fit`) on
//! 2 thread ranks under all-reduce and under int8, and prints loss and wire bytes side by side
//! (int8 sends a quarter of all-reduce's bytes, plus 4 bytes of scale per bucket). The error it
//! keeps is state across steps: the policy says so ([`ReducerPolicy::keeps_state`]) and saves it
//! ([`ReducerPolicy::state_dict`]), so that a checkpoint resumes it exactly (a policy that said
//! nothing and saved nothing would have its checkpoints refused).
//!
//! `cargo run --release -p brigade --example own_hook [-- STEPS]`

use std::sync::Arc;

use brigade::ddp::policy::{BucketSpan, Group, ParamState, PolicyBucket, Reduction};
use brigade::ddp::{KeepsState, ReducerPolicy};
use brigade::launch::LaunchConfig;
use brigade::models::{Dataset, Mlp, MlpConfig};
use brigade::tensor::{DType, Tensor};
use brigade::{OptimizerConfig, RunReport, TrainConfig};

/// Int8 with error feedback. One policy per rank (the error it keeps is its own), keyed by
/// parameter name, which survives DDP's bucket rebuild after the first iteration. Every step
/// is a tensor op on the bucket's device (the scale too: nothing is read back to the host), so
/// the same policy runs on a GPU. The bucket comes in the reduce dtype (f32, or bf16 under
/// `--precision bf16`): it is quantized from its f32 widening and the result rounded back.
#[derive(Default)]
pub(crate) struct Int8 {
    error: ParamState,
}

impl ReducerPolicy for Int8 {
    fn name(&self) -> String {
        "int8".into()
    }

    fn keeps_state(&self) -> KeepsState {
        KeepsState::InStateDict
    }

    fn buckets_built(&mut self, buckets: &[BucketSpan], _generation: u64) -> brigade::ddp::Result<()> {
        self.error.buckets_built(buckets);
        Ok(())
    }

    fn state_dict(&self) -> brigade::ddp::Result<Vec<(String, Tensor)>> {
        Ok(self.error.state_dict())
    }

    fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> brigade::ddp::Result<()> {
        self.error.load_state_dict(state)
    }

    fn reduce(&mut self, bucket: PolicyBucket, comm: &Group) -> brigade::ddp::Result<Reduction> {
        let dtype = bucket.tensor.dtype();
        let g = bucket.tensor.to_dtype(DType::F32)?.copy()?;
        for p in &bucket.params {
            if let Some(e) = self.error.get(p) {
                g.narrow(0, p.offset, p.len())?.add_assign(e)?; // error feedback
            }
        }
        // the scale, a one-element tensor on the bucket's device: max(largest magnitude, the
        // smallest normal f32) / 127, so that an all-zero bucket quantizes to zeros
        let largest = g.sqr()?.max_dim(0, false)?.sqrt()?;
        let tiny = f32::MIN_POSITIVE as f64;
        let scale = largest
            .add_scalar(-tiny)?
            .relu()?
            .add_scalar(tiny)?
            .mul_scalar(1.0 / 127.0)?;
        let q = g.div(&scale)?.to_dtype(DType::I8)?;
        let error = g.sub(&q.to_dtype(DType::F32)?.mul(&scale)?)?;
        for p in &bucket.params {
            self.error.insert(p, error.narrow(0, p.offset, p.len())?.copy()?);
        }
        let world = comm.world_size() as f64;
        let scale = scale.reshape(&[1])?;
        // the payload and its scale in one all-gather: [world, n] int8s and [world, 1] scales
        let gathered = comm.all_gather_with_side(&q, &scale, &bucket.tag());
        Ok(Reduction::Full(gathered.then(move |(q, s)| {
            let mean = q
                .to_dtype(DType::F32)?
                .mul(&s)?
                .sum(&[0], false)?
                .mul_scalar(1.0 / world)?;
            Ok(mean.to_dtype(dtype)?)
        })))
    }
}

fn wire_bytes(r: &RunReport) -> f64 {
    r.outcome.sent().iter().map(|s| s.wire_bytes).sum()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let steps: usize = std::env::args().nth(1).map_or(Ok(60), |s| s.parse())?;
    let sgd = OptimizerConfig::Sgd {
        lr: 0.05,
        momentum: 0.9,
        weight_decay: 0.0,
    };
    let train = |cfg: &TrainConfig| {
        brigade::fit(
            &LaunchConfig::threads(2),
            cfg,
            |_| Ok(Dataset::teacher(4096, 32, 4, 1)?),
            |_| Ok(Box::new(Mlp::new(MlpConfig::new(vec![32, 128, 128, 4]), 0)?)),
        )
    };
    let plain = train(&TrainConfig::new(steps, 32, sgd))?;
    let cfg = {
        let mut c = TrainConfig::new(steps, 32, sgd);
        // each rank makes its own policy
        c.distributed.get_or_insert_default().policy = Arc::new(|_rank: usize| Int8::default());
        c
    };
    let int8 = train(&cfg)?;
    let (a, b) = (&plain.outcome.losses(), &int8.outcome.losses());
    println!("{:>6} {:>12} {:>12}", "step", "allreduce", "int8+EF");
    for s in (0..steps).filter(|s| s % 10 == 0 || s + 1 == steps) {
        println!("{s:>6} {:>12.4} {:>12.4}", a[s], b[s]);
    }
    // wire bytes as the meter counts them (ring algorithms, rank 0)
    let (plain_wire, int8_wire) = (wire_bytes(&plain), wire_bytes(&int8));
    let ratio = int8_wire / plain_wire;
    println!("wire bytes per rank: allreduce {plain_wire:.0}, int8 {int8_wire:.0} ({ratio:.4} of all-reduce's)");
    // a quarter, plus 4 bytes of scale per bucket a step (and the one-off bucket-order agreement)
    let scales = (4 * steps * int8.outcome.buckets.len()) as f64;
    if int8_wire > plain_wire / 4.0 + scales + 64.0 {
        return Err(
            format!("int8 sent {int8_wire} wire bytes, more than a quarter of {plain_wire} plus scales").into(),
        );
    }
    match (b.first(), b.last()) {
        (Some(first), Some(last)) if last < first => {}
        _ => return Err("int8 did not train".into()),
    }
    Ok(())
}
