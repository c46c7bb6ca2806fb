//! ZeRO (Rajbhandari et al., 2020; DeepSpeed, PyTorch's `ZeroRedundancyOptimizer`): shard the
//! optimizer state (stage 1) and the gradients (stage 2) over the ranks instead of holding
//! them whole on every rank — written on DDP's policy contract like any user's policy.
//!
//! The layout pads each bucket to a multiple of the world size and fixes it (no rebuild, no new
//! caps: the shards, and the optimizer state in them, are cut from the buckets, as in
//! DeepSpeed); rank `r` owns the contiguous shard `r` of every bucket ([`shard`]). A full bucket
//! is reduced by one averaging **reduce-scatter**, so a rank receives only the average of its
//! shard: stage 1 keeps the full buffer (the shard in place, zeros elsewhere), stage 2 frees it
//! and keeps the shard alone. The optimizer is a [`ZeroOptimizer`]: one inner optimizer per
//! bucket over this rank's pieces of the parameters (state only for them), stepping its shard
//! and then **all-gathering** the updated parameters bucket by bucket, each bucket's all-gather
//! overlapping the next bucket's step. Its communication scratch stays within one shard: stage 1
//! gathers into the bucket's own idle gradient buffer, stage 2 in chunks of at most a third of a
//! shard's worth of gathered parameters, three alive at once. On one rank there is nothing to
//! shard: ZeRO is plain DDP there, buckets, memory and all.
//!
//! Beside 16-bit parameters (mixed precision: the optimizer handed over keeps f32 masters) the
//! buckets hold the reduce dtype, and each rank keeps only its f32 **master shard** of every
//! bucket: the gradient shard is widened to f32, the shard stepped in f32, and the shard rounded
//! to the parameters' dtype is what the all-gather brings to every rank (half the bytes in
//! bf16). A checkpoint gathers the whole masters ([`Optimizer::consolidate_state`]). Under
//! fp16's loss scaling the optimizer takes over the scaler ([`Optimizer::grad_scaler`]): the
//! shards are unscaled as they are widened, and the ranks all-reduce their inf/NaN verdicts so
//! that a step is skipped on every rank or on none.

mod optimizer;
pub mod quantized;
pub mod shard;
mod zero3;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use brigade_autograd::Optimizer;
use brigade_comm::ReduceOp;
use brigade_ddp::policy::{
    BucketLayout, BuildOptimizer, Group, OptimizerContext, PolicyBucket, PolicyContext, PolicyMemory, ReducerPolicy,
    Reduction, WireModel,
};
use brigade_tensor::{DType, Device, Tensor};

use crate::error::PolicyError;
use crate::spec::PolicySpec;

pub use optimizer::{ZeroOptimizer, ALL_GATHER_CAP_BYTES};
pub use quantized::ZeroPlusPlus;
pub use shard::{padded_len, shard_len};
pub use zero3::{Zero3, DEFAULT_PREFETCH_CAP_BYTES};

/// How much of the training state is sharded over the ranks (`--zero 0|1|2|3`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ZeroStage {
    /// Plain DDP: every rank holds everything (stage 0).
    #[default]
    Off,
    /// Stage 1: optimizer state sharded; gradients reduce-scattered, parameters all-gathered.
    One,
    /// Stage 2: stage 1, and each rank keeps only its shard of the reduced gradients.
    Two,
    /// Stage 3: stage 2, and each rank keeps only its shard of the parameters, gathered per
    /// unit around its forward and backward ([`Zero3`]).
    Three,
}

impl ZeroStage {
    /// The stage for `--zero LEVEL` (0, 1, 2 or 3).
    pub fn from_level(level: u8) -> Option<ZeroStage> {
        match level {
            0 => Some(ZeroStage::Off),
            1 => Some(ZeroStage::One),
            2 => Some(ZeroStage::Two),
            3 => Some(ZeroStage::Three),
            _ => None,
        }
    }

    /// The stage's number (0, 1, 2).
    pub fn level(self) -> u8 {
        match self {
            ZeroStage::Off => 0,
            ZeroStage::One => 1,
            ZeroStage::Two => 2,
            ZeroStage::Three => 3,
        }
    }
}

/// How a policy lays a run's training state out over the ranks, as a checkpoint records it: a
/// checkpoint resumes only under the layout it was written with. Its record is a number: 0
/// when every rank holds the whole state, else the ZeRO stage that shards it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StateLayout(ZeroStage);

impl StateLayout {
    /// Every rank holds the whole state.
    pub const WHOLE: StateLayout = StateLayout(ZeroStage::Off);

    /// The number a checkpoint records.
    pub fn record(self) -> u8 {
        self.0.level()
    }
}

impl PolicySpec {
    /// The ZeRO stage this spec shards at (`Off` for every other policy).
    pub fn zero_stage(&self) -> ZeroStage {
        match self {
            PolicySpec::Zero1 => ZeroStage::One,
            PolicySpec::Zero2 => ZeroStage::Two,
            PolicySpec::Zero3 | PolicySpec::Zero3Quantized(_) => ZeroStage::Three,
            _ => ZeroStage::Off,
        }
    }

    /// The ZeRO policy of `stage` (`None` for `Off`).
    pub fn zero(stage: ZeroStage) -> Option<PolicySpec> {
        match stage {
            ZeroStage::Off => None,
            ZeroStage::One => Some(PolicySpec::Zero1),
            ZeroStage::Two => Some(PolicySpec::Zero2),
            ZeroStage::Three => Some(PolicySpec::Zero3),
        }
    }

    /// How the policy lays the training state out over the ranks ([`StateLayout`]).
    pub fn state_layout(&self) -> StateLayout {
        StateLayout(self.zero_stage())
    }

    /// Whether each rank keeps only its shard of the optimizer state (ZeRO-1, 2, 3).
    pub fn shards_optimizer_state(&self) -> bool {
        self.zero_stage() != ZeroStage::Off
    }

    /// Whether each rank keeps only its shard of the reduced gradients (ZeRO-2, 3).
    pub fn shards_grads(&self) -> bool {
        matches!(self.zero_stage(), ZeroStage::Two | ZeroStage::Three)
    }

    /// Whether each rank keeps only its shard of the parameters, gathered per unit (ZeRO-3).
    pub fn shards_params(&self) -> bool {
        self.zero_stage() == ZeroStage::Three
    }
}

/// This rank's f32 shard of every bucket cut from the whole f32 `masters` (by parameter
/// name), zeros where the shard is padding; its errors name the policy `policy`.
fn master_shards(
    ctx: &OptimizerContext,
    policy: &str,
    masters: &[(String, Tensor)],
) -> brigade_ddp::Result<Vec<Tensor>> {
    let (rank, world) = (ctx.comm.rank(), ctx.comm.world_size());
    let params = ctx.buckets.params();
    let mut out = vec![];
    for span in ctx.buckets.spans() {
        let flat: Vec<(usize, usize)> = span.params.iter().map(|p| (p.index, p.len())).collect();
        let device = span
            .params
            .first()
            .map_or(Device::Cpu, |p| params[p.index].value().device());
        let shard = Tensor::zeros_on(&[shard_len(span.grad_numel, world)], DType::F32, device)?;
        for piece in shard::pieces(&flat, world, rank) {
            let name = params[piece.param].name().unwrap_or("<unnamed>");
            let Some((_, master)) = masters.iter().find(|(n, _)| n == name) else {
                return Err(brigade_ddp::DdpError::Policy {
                    policy: policy.into(),
                    reason: format!("the optimizer keeps no f32 master of parameter '{name}'"),
                });
            };
            let master = master.to_device(device)?.contiguous()?;
            shard
                .narrow(0, piece.shard_offset, piece.len)?
                .copy_from(&master.flat_view(piece.param_offset, &[piece.len])?)?;
        }
        out.push(shard);
    }
    Ok(out)
}

/// The ZeRO reducer policy (see the module docs).
pub struct Zero {
    stage: ZeroStage,
    /// The group's size, learnt when DDP asks for the layout (1: plain DDP).
    world: AtomicUsize,
    /// Peak bytes of all-gather scratch in the last step (written by the optimizer).
    scratch: Arc<AtomicUsize>,
    all_gather_cap: usize,
}

impl Zero {
    /// ZeRO at `stage` (1 or 2; stage 3 is [`Zero3`]).
    pub fn new(stage: ZeroStage) -> Result<Zero, PolicyError> {
        if stage == ZeroStage::Off {
            return Err(PolicyError::Config {
                policy: "zero".into(),
                reason: "stage 0 is plain DDP: use the allreduce policy".into(),
            });
        }
        if stage == ZeroStage::Three {
            return Err(PolicyError::Config {
                policy: "zero".into(),
                reason: "stage 3 shards the parameters too: use the zero3 policy (Zero3)".into(),
            });
        }
        Ok(Zero {
            stage,
            world: AtomicUsize::new(0),
            scratch: Arc::default(),
            all_gather_cap: ALL_GATHER_CAP_BYTES,
        })
    }

    /// Caps the bytes one of stage 2's parameter all-gathers returns (default
    /// [`ALL_GATHER_CAP_BYTES`]; DeepSpeed's `allgather_bucket_size`): smaller caps mean less
    /// communication scratch and more, smaller collectives. Every rank must use the same cap.
    pub fn with_all_gather_cap(mut self, bytes: usize) -> Self {
        self.all_gather_cap = bytes.max(1);
        self
    }

    /// The stage.
    pub fn stage(&self) -> ZeroStage {
        self.stage
    }

    fn sharded(&self, world: usize) -> bool {
        world > 1
    }
}

impl ReducerPolicy for Zero {
    fn name(&self) -> String {
        format!("zero{}", self.stage.level())
    }

    fn keeps_state(&self) -> brigade_ddp::KeepsState {
        brigade_ddp::KeepsState::Nothing
    }

    fn layout(&self, ctx: &PolicyContext) -> BucketLayout {
        self.world.store(ctx.world_size, Ordering::Relaxed);
        if !self.sharded(ctx.world_size) {
            return BucketLayout::default();
        }
        BucketLayout {
            pad_to: ctx.world_size,
            dtype: ctx.reduce_dtype(),
            regroup: false,
        }
    }

    fn reduce(&mut self, bucket: PolicyBucket, comm: &Group) -> brigade_ddp::Result<Reduction> {
        if !self.sharded(comm.world_size()) {
            return Ok(Reduction::Full(comm.all_reduce(
                &bucket.tensor,
                ReduceOp::Avg,
                &bucket.tag(),
            )));
        }
        Ok(Reduction::Shard {
            shard: comm.reduce_scatter(&bucket.tensor, ReduceOp::Avg, &bucket.tag()),
            keep_full: self.stage == ZeroStage::One,
        })
    }

    fn optimizer(
        &mut self,
        full: Box<dyn Optimizer>,
        build: BuildOptimizer<'_>,
        ctx: &OptimizerContext,
    ) -> brigade_ddp::Result<Box<dyn Optimizer>> {
        if !self.sharded(ctx.comm.world_size()) {
            return Ok(full);
        }
        // Beside 16-bit parameters `full` steps f32 masters of every parameter: this rank keeps
        // its shard of them (dropping `full` frees the rest) and steps that.
        let masters = full.master_weights();
        let masters = (!masters.is_empty())
            .then(|| master_shards(ctx, &self.name(), &masters))
            .transpose()?;
        Ok(Box::new(ZeroOptimizer::new(
            ctx,
            self.name(),
            self.stage,
            self.scratch.clone(),
            full.as_ref(),
            build,
            self.all_gather_cap,
            masters,
        )?))
    }

    fn memory(&self) -> PolicyMemory {
        PolicyMemory {
            state_bytes: 0,
            scratch_bytes: self.scratch.load(Ordering::Relaxed),
            ..PolicyMemory::default()
        }
    }

    fn wire_model(&self, _shapes: &[Vec<usize>], _world_size: usize) -> Option<WireModel> {
        Some(if self.sharded(self.world.load(Ordering::Relaxed)) {
            WireModel::ReduceScatter
        } else {
            WireModel::AllReduce { bytes_per_element: 4.0 }
        })
    }
}
