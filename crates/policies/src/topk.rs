//! Top-k sparsification with error feedback (DGC-style): each rank sends its largest entries,
//! values and indices, and keeps the rest for the next step.

use brigade_ddp::policy::{BucketSpan, Group, PolicyBucket, ReducerPolicy, Reduction, StepContext, WireModel};
use brigade_ddp::KeepsState;
use brigade_tensor::{DType, Tensor};

use crate::error::Result;
use crate::residual::Residual;
use crate::spec::{spec_error, PolicySpec, Ratio};

/// Bytes each rank sends per kept entry: an f32 value and an `I64` index.
const ENTRY_BYTES: f64 = 12.0;
/// Bytes each rank sends per bucket beside its entries: the count.
const COUNT_BYTES: f64 = 8.0;

/// Top-k with error feedback, one per rank (the residual it keeps is its own). Each rank adds
/// the residual it kept to its bucket (in f32), picks the `k = ceil(ratio × n)` entries of
/// largest magnitude (ties: lowest position first), all-gathers their values and `I64` indices
/// ([`brigade_ddp::ProcessGroup::all_gather_sparse`]), sums every rank's entries into a dense
/// bucket in rank order and divides by the world size; the residual keeps what it did not send
/// (the sent positions become zero). At ratio 1 every entry is sent and the result is the
/// all-reduce's, bit for bit, on the host backends (whose sums run in rank order, as this one
/// does). The residual is state across steps, keyed by parameter name and saved in
/// [`ReducerPolicy::state_dict`], so a checkpoint resumes it exactly; under loss scaling it is
/// kept as int8's error is (see [`crate::Int8`]).
#[derive(Debug)]
pub struct TopK {
    ratio: f64,
    residual: Residual,
}

impl TopK {
    /// A policy sending the fraction `ratio` (in `(0, 1]`) of each bucket.
    pub fn new(ratio: f64) -> Result<TopK> {
        if !(ratio > 0.0 && ratio <= 1.0) {
            return Err(spec_error(
                &format!("topk:{ratio}"),
                "the ratio of entries sent must be more than 0 and at most 1",
            ));
        }
        Ok(TopK {
            ratio,
            residual: Residual::default(),
        })
    }

    /// Entries sent of a bucket of `n` elements: at least one.
    fn k(&self, n: usize) -> usize {
        ((self.ratio * n as f64).ceil() as usize).clamp(1, n.max(1))
    }
}

impl ReducerPolicy for TopK {
    fn name(&self) -> String {
        format!("topk:{}", self.ratio)
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

    fn reduce(&mut self, bucket: PolicyBucket, comm: &Group) -> brigade_ddp::Result<Reduction> {
        let dtype = bucket.tensor.dtype();
        let n = bucket.tensor.numel();
        if n == 0 {
            return Ok(Reduction::Full(comm.ready(bucket.tensor)));
        }
        let g = self.residual.added_to(&bucket)?;
        let k = self.k(n);
        let (_, idx) = g.abs()?.topk(k)?;
        let values = g.gather(0, &idx)?;
        // the sent positions become exactly zero (x + -x)
        let residual = g.scatter_add(0, &idx, &values.mul_scalar(-1.0)?)?;
        self.residual.keep(&bucket, &residual)?;
        let (world, on) = (comm.world_size(), g.device());
        let gathered = comm.all_gather_sparse(&values, &idx, k, &bucket.tag());
        Ok(Reduction::Full(gathered.then(move |s| {
            // divided, not multiplied by a reciprocal: the all-reduce's average
            let mean = s
                .sum_dense(n)?
                .div(&Tensor::full_on(&[], world as f64, DType::F32, on)?)?;
            Ok(match dtype {
                DType::F32 => mean,
                _ => mean.to_dtype(dtype)?,
            })
        })))
    }

    fn wire_model(&self, _shapes: &[Vec<usize>], _world_size: usize) -> Option<WireModel> {
        Some(WireModel::AllGather {
            bytes_per_element: ENTRY_BYTES,
            bytes_per_bucket: COUNT_BYTES,
            density: self.ratio,
        })
    }
}

/// `topk:RATIO`'s spec from its argument.
pub(crate) fn read_spec(spec: &str, args: Option<&str>) -> Result<PolicySpec> {
    let ratio: f64 = args
        .ok_or_else(|| {
            spec_error(
                spec,
                "topk takes the ratio of entries sent: topk:RATIO (e.g. topk:0.01)",
            )
        })?
        .parse()
        .map_err(|_| spec_error(spec, "the ratio must be a number in (0, 1] (e.g. topk:0.01)"))?;
    TopK::new(ratio)?;
    Ok(PolicySpec::TopK { ratio: Ratio(ratio) })
}

/// `RATIO` of a `topk:RATIO` spec.
pub(crate) fn write_spec(spec: &PolicySpec) -> Option<String> {
    match spec {
        PolicySpec::TopK { ratio } => Some(crate::spec::compact(ratio.0)),
        _ => None,
    }
}

/// Builds a `topk:RATIO` spec.
pub(crate) fn build_spec(spec: &PolicySpec) -> Result<Box<dyn ReducerPolicy>> {
    match spec {
        PolicySpec::TopK { ratio } => Ok(Box::new(TopK::new(ratio.0)?)),
        _ => unreachable!("built from its own entry"),
    }
}
