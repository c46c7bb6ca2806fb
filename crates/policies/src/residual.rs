//! What an error-feedback policy keeps between steps: per parameter, what it did not send.

use brigade_ddp::policy::{BucketSpan, ParamState, PolicyBucket, StepContext};
use brigade_tensor::{DType, Tensor};

/// The residual of an error-feedback compressor (int8, top-k, EF-SignSGD), one per rank: per
/// parameter, the part of its gradient the policy did not send, added to the next step's.
/// Keyed by parameter name and saved in the policy's state dict, so a checkpoint resumes it
/// exactly. Under loss scaling it is kept in the next step's scaled units, and put back as
/// it was when a step is skipped.
#[derive(Debug, Clone)]
pub(crate) struct Residual {
    kept: ParamState,
    /// Under loss scaling, the residual as the current step started; `None` otherwise.
    before_step: Option<ParamState>,
}

impl Default for Residual {
    fn default() -> Self {
        Residual {
            kept: ParamState::default(),
            before_step: Some(ParamState::default()),
        }
    }
}

impl Residual {
    /// The policy's `buckets_built`: the residual follows the new buckets.
    pub(crate) fn buckets_built(&mut self, buckets: &[BucketSpan]) {
        self.kept.buckets_built(buckets);
    }

    /// The policy's `state_dict`: the residual by parameter name.
    pub(crate) fn state_dict(&self) -> Vec<(String, Tensor)> {
        self.kept.state_dict()
    }

    /// The policy's `load_state_dict`: the residual a checkpoint saved.
    pub(crate) fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> brigade_ddp::Result<()> {
        self.kept.load_state_dict(state)?;
        self.before_step = Some(self.kept.clone());
        Ok(())
    }

    /// The policy's `after_step`: under loss scaling, the residual in the next step's scaled
    /// units, put back as it was before a skipped step.
    pub(crate) fn after_step(&mut self, step: &StepContext<'_>) -> brigade_ddp::Result<()> {
        let Some(scaling) = step.loss_scale else {
            self.before_step = None;
            return Ok(());
        };
        if scaling.skipped {
            if let Some(before) = self.before_step.take() {
                self.kept = before;
            }
        }
        let rescale = scaling.rescale();
        if rescale != 1.0 {
            let scaled = (self.kept.state_dict().into_iter())
                .map(|(name, e)| Ok((name, e.mul_scalar(rescale)?)))
                .collect::<brigade_ddp::Result<Vec<_>>>()?;
            self.kept.load_state_dict(&scaled)?;
        }
        self.before_step = Some(self.kept.clone());
        Ok(())
    }

    /// The bucket widened to f32 (a copy), with each parameter's kept residual added.
    pub(crate) fn added_to(&self, bucket: &PolicyBucket) -> brigade_ddp::Result<Tensor> {
        let g = match bucket.tensor.dtype() {
            DType::F32 => bucket.tensor.copy()?,
            _ => bucket.tensor.to_dtype(DType::F32)?,
        };
        for p in &bucket.params {
            if let Some(e) = self.kept.get(p) {
                g.narrow(0, p.offset, p.len())?.add_assign(e)?;
            }
        }
        Ok(g)
    }

    /// Keeps `left` (the bucket's f32 elements not sent) as each parameter's residual.
    pub(crate) fn keep(&mut self, bucket: &PolicyBucket, left: &Tensor) -> brigade_ddp::Result<()> {
        for p in &bucket.params {
            self.kept.insert(p, left.narrow(0, p.offset, p.len())?.copy()?);
        }
        Ok(())
    }
}
