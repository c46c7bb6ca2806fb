//! Int8 quantization with error feedback: a quarter of all-reduce's bytes on the wire.

use brigade_ddp::policy::{BucketSpan, Group, PolicyBucket, ReducerPolicy, Reduction, StepContext, WireModel};
use brigade_ddp::KeepsState;
use brigade_tensor::{DType, Tensor};

use crate::residual::Residual;

/// Int8 with error feedback, one per rank (the error it keeps is its own). Each rank adds the
/// rounding error it kept from the last step to its bucket, quantizes it with one scale (its
/// largest magnitude over 127, at least 1e-30 so that an all-zero bucket gives zeros) by the
/// int8 cast (half to even, saturating at ±127), keeps the new rounding error, and all-gathers
/// the int8 payload with the scale beside it; the ranks' pieces are dequantized with their own
/// scales and averaged in f32 (int8s are not summed as int8s). Every step is a tensor op on the
/// bucket's device. The error is state across steps, keyed by parameter name and saved in
/// [`ReducerPolicy::state_dict`], so a checkpoint resumes it exactly.
///
/// A 16-bit bucket (mixed precision) is quantized from its f32 widening, the error kept in
/// f32, and the averaged result rounded once into the bucket's dtype. A non-finite gradient
/// makes its rank's scale non-finite (the largest magnitude propagates an inf or a NaN), so
/// every rank's dequantized sum is NaN: the run's checks see it (under fp16, the loss scaler
/// skips the step) instead of a finite int8 value. Under loss scaling the error is kept in the
/// next step's scaled units (multiplied by each scale change) and put back as it was before a
/// skipped step ([`brigade_ddp::policy::StepContext::loss_scale`]).
#[derive(Debug, Default)]
pub struct Int8 {
    /// The rounding error kept.
    residual: Residual,
}

impl ReducerPolicy for Int8 {
    fn name(&self) -> String {
        "int8".into()
    }

    fn keeps_state(&self) -> KeepsState {
        KeepsState::InStateDict
    }

    fn buckets_built(&mut self, buckets: &[BucketSpan], _generation: u64) -> brigade_ddp::Result<()> {
        self.residual.buckets_built(buckets);
        Ok(())
    }

    fn state_dict(&self) -> brigade_ddp::Result<Vec<(String, Tensor)>> {
        Ok(self.residual.state_dict())
    }

    fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> brigade_ddp::Result<()> {
        self.residual.load_state_dict(state)
    }

    fn after_step(&mut self, step: &StepContext<'_>, _comm: &Group) -> brigade_ddp::Result<()> {
        self.residual.after_step(step)
    }

    fn wire_model(&self, _shapes: &[Vec<usize>], _world_size: usize) -> Option<WireModel> {
        Some(WireModel::AllGather {
            bytes_per_element: 1.0,
            bytes_per_bucket: 4.0,
            density: 1.0,
        })
    }

    fn reduce(&mut self, bucket: PolicyBucket, comm: &Group) -> brigade_ddp::Result<Reduction> {
        let dtype = bucket.tensor.dtype();
        let g = self.residual.added_to(&bucket)?;
        let scale = g
            .abs()?
            .amax(&[0], true)?
            .clamp(1e-30, f64::INFINITY)?
            .mul_scalar(1.0 / 127.0)?;
        let q = g.div(&scale)?.to_dtype(DType::I8)?;
        let error = g.sub(&q.to_dtype(DType::F32)?.mul(&scale)?)?;
        self.residual.keep(&bucket, &error)?;
        let world = comm.world_size() as f64;
        // the payload and its scale in one all-gather: [world, n] int8s and [world, 1] scales
        let gathered = comm.all_gather_with_side(&q, &scale, &bucket.tag());
        Ok(Reduction::Full(gathered.then(move |(q, s)| {
            let mean = q
                .to_dtype(DType::F32)?
                .mul(&s)?
                .sum(&[0], false)?
                .mul_scalar(1.0 / world)?;
            Ok(match dtype {
                DType::F32 => mean,
                _ => mean.to_dtype(dtype)?,
            })
        })))
    }
}
