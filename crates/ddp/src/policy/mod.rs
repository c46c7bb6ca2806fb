//! The reducer-policy contract: one trait, [`ReducerPolicy`], for everything that decides how a
//! data-parallel step communicates and steps — PyTorch's communication hook,
//! `ZeroRedundancyOptimizer` and `hook_with_zero_step` as one idea.
//!
//! The reducer knows no policy by name. It fills buckets in the order gradients become ready,
//! hands each full bucket, strictly in bucket order and the same on every rank, to the policy's
//! [`ReducerPolicy::reduce`], and at the end of backward puts what the policy's future returns
//! back under the gradients. Everything else is the policy's decision:
//!
//! | decision | method | default |
//! |---|---|---|
//! | bucket padding, dtype, whether buckets may be regrouped | [`ReducerPolicy::layout`] | no padding, the parameters' dtype, regroup |
//! | how a ready bucket is reduced: the averaged bucket or this rank's shard, the full buffer kept or freed | [`ReducerPolicy::reduce`] | (required) |
//! | how a rank with no data this step takes part | [`ReducerPolicy::reduce_joined`] | `reduce` on a zero bucket |
//! | what the optimizer steps (full parameters or shard views), built from the user's optimizer config; its learning rate stays settable | [`ReducerPolicy::optimizer`] | the user's optimizer over every parameter |
//! | the squared norm of the gradients held, summed over ranks when sharded | [`ReducerPolicy::grad_norm_sq`] | exactly that |
//! | what runs after the optimizer step | [`ReducerPolicy::after_step`] | nothing |
//! | finishing collectives it holds across steps before a checkpoint | [`ReducerPolicy::finish_in_flight`] | nothing held |
//! | whether it keeps state across steps, and where | [`ReducerPolicy::keeps_state`] | undeclared: checkpoints are refused |
//! | its state for checkpoints | [`ReducerPolicy::state_dict`], [`ReducerPolicy::load_state_dict`] ([`ParamState`] keys per-parameter state by name) | none |
//! | whether its ranks' parameters and optimizer state diverge between syncs, and what a checkpoint keeps of every rank | [`ReducerPolicy::replicas`] | identical on every rank |
//! | what to do when buckets are rebuilt | [`ReducerPolicy::buckets_built`] + [`PerBucket`] | nothing |
//! | which parameters share a bucket | [`ReducerPolicy::bucket_groups`] | DDP's caps |
//! | gathering and freeing sharded parameters around their uses | [`ReducerPolicy::param_hooks`] | none: parameters stay whole |
//!
//! Policies see tensors, never host vectors or communicators: a bucket is a flat [`Tensor`] on
//! the parameters' device, computed on with tensor ops, and collectives go through the
//! ddp-owned [`ProcessGroup`] (shared as a [`Group`]: clone it into a continuation), whose
//! futures ([`TensorWork`]) chain continuations. The
//! built-in policies (`brigade-policies`) are written against this module alone.
//!
//! **State across the bucket rebuild.** DDP rebuilds its buckets once after the first
//! iteration (from the observed ready order) and whenever the caps change, unless the layout
//! says `regroup: false`; every rebuild is announced ([`ReducerPolicy::buckets_built`]) before
//! the first bucket of the new layout is reduced, and each [`PolicyBucket`] carries its layout's
//! generation. State kept per bucket index must live in a [`PerBucket`], which drops it when the
//! generation changes; state that must survive is keyed by parameter.
//!
//! **Checkpoints and resume.** A checkpoint holds rank 0's parameters and optimizer state,
//! every rank's [`ReducerPolicy::state_dict`], and the buckets' grouping once DDP regrouped
//! them ([`crate::BucketGrouping`]: a resume reduces on the same buckets, so a policy whose
//! result depends on which gradients share a bucket, such as one scale per bucket, continues
//! exactly). A policy whose ranks diverge between syncs (local SGD, DiLoCo) declares it
//! ([`ReducerPolicy::replicas`], [`Replicas::Diverge`] naming which of each rank's parameters
//! and optimizer state differ): the checkpoint then keeps those of every rank
//! ([`crate::DistributedDataParallel::gather_rank_state`]) and resumes on as many ranks only. A
//! resume loads in this order, which a policy may rely on:
//! 1. the checkpoint: rank 0's parameters and optimizer state into the model and the user's
//!    optimizer;
//! 2. DDP's construction (on the recorded grouping), which broadcasts rank 0's parameters;
//! 3. under [`Replicas::Diverge`], this rank's own parameters and optimizer state
//!    ([`crate::DistributedDataParallel::load_rank_state`]);
//! 4. this rank's policy state ([`ReducerPolicy::load_state_dict`]: it sees the rank's own
//!    parameters);
//! 5. [`ReducerPolicy::optimizer`], handed the user's optimizer with this rank's state.
//!
//! A policy may hold collectives across steps (streaming DiLoCo issues a fragment's sync in one
//! [`ReducerPolicy::after_step`] and merges it some steps later). [`ReducerPolicy::state_dict`]
//! takes `&self` and cannot wait on them, so every rank calls [`ReducerPolicy::finish_in_flight`]
//! before its state is gathered for a checkpoint
//! ([`crate::DistributedDataParallel::gather_policy_state`] does, through
//! [`crate::DistributedDataParallel::finish_in_flight`]): the policy waits for what it holds,
//! within the timeout, and keeps the landed results (still unmerged) in its state, so that a
//! resume merges them at the step the straight run does.
//!
//! **Threads.** `reduce` runs on the compute thread inside backward and must return at once;
//! continuations run on the comm stream's thread. A policy that updates its state from a
//! continuation shares it (`Arc<Mutex<..>>`) and never holds its own lock while chaining (a
//! continuation of a work that already completed runs at once, on the caller's thread).

mod context;
mod param_state;
pub(crate) mod state;

use std::collections::HashMap;

use brigade_autograd::Optimizer;
use brigade_comm::ReduceOp;
use brigade_tensor::{DType, Tensor};
use serde::{Deserialize, Serialize};

pub(crate) use context::BucketSource;
pub use context::{
    BucketSpan, Buckets, BuildOptimizer, GatherPhase, GatherTimes, HeldGrad, LossScaleStep, OptimizerContext,
    ParamHooks, ParamInfo, PolicyContext, PolicyDiagnostic, PolicyMemory, StepContext,
};
pub use param_state::ParamState;

pub use crate::group::{Group, ProcessGroup, SparseGather, TensorPromise, TensorWork};
use crate::{DdpError, Result};

/// A reducer policy: how one rank's gradient buckets are reduced, what its optimizer steps,
/// and what it keeps (see the module docs for the decisions and their defaults). A policy holds
/// one rank's state: every rank builds its own.
pub trait ReducerPolicy: Send {
    /// The policy's name as a spec reads it (`allreduce`, `fp16`, `powersgd:4@10`, `zero2`, a
    /// user's name): step profiles, reports and checkpoints record it.
    fn name(&self) -> String;

    /// The buckets this policy needs. Asked once, when DDP is built (a collective every rank
    /// makes, so every rank must answer alike). The default holds the reduce dtype
    /// ([`PolicyContext::reduce_dtype`]: the trainable parameters' unless DDP was asked for
    /// another; gradients accumulate in it): bf16 parameters get bf16 buckets, half the bytes.
    fn layout(&self, ctx: &PolicyContext) -> BucketLayout {
        BucketLayout {
            dtype: ctx.reduce_dtype(),
            ..BucketLayout::default()
        }
    }

    /// The buckets were built: at construction (generation 0) and after every rebuild, before
    /// the first bucket of the new layout is reduced.
    fn buckets_built(&mut self, buckets: &[BucketSpan], generation: u64) -> Result<()> {
        let _ = (buckets, generation);
        Ok(())
    }

    /// The buckets this policy fixes itself, as lists of parameter registration indices in
    /// launch order (each trainable parameter in exactly one; ZeRO-3: one bucket per unit), or
    /// `None` for DDP's own grouping by the caps. Asked once, after [`ReducerPolicy::layout`];
    /// an error here fails DDP's construction.
    fn bucket_groups(&self, ctx: &PolicyContext) -> Result<Option<Vec<Vec<usize>>>> {
        let _ = ctx;
        Ok(None)
    }

    /// Hooks around the parameters' uses, for a policy that shards the parameters themselves
    /// (ZeRO-3): DDP installs them when it is built. `None` (the default): the parameters stay
    /// whole on every rank.
    fn param_hooks(&self) -> Option<std::sync::Arc<dyn ParamHooks>> {
        None
    }

    /// Whether the policy takes parameters whose values are not drawn yet (registered inside
    /// `brigade_autograd::defer_param_init`) and draws each rank's shard of them itself, from
    /// their recipes, when it builds the optimizer: a sharded start, no rank ever holding the
    /// whole model. `false` (the default): DDP draws them whole when it is built.
    fn starts_sharded(&self) -> bool {
        false
    }

    /// Reduces a full bucket over the ranks: issues its collectives through `comm` and returns
    /// the future of what goes back under the gradients. Called on the compute thread inside
    /// backward, in bucket order, the same on every rank; must not block. An error fails this
    /// rank's backward (every rank must fail alike, or the others time out: return errors that
    /// depend only on what every rank shares). The bucket is in the reduce dtype (f32 by
    /// default; bf16 or fp16 beside 16-bit parameters, see [`PolicyBucket::tensor`]), and what
    /// the future returns must be too: a policy that computes in f32 widens the bucket and
    /// rounds its result back, and lets an inf or a NaN reach the result (under fp16 the loss
    /// scaler skips that step).
    fn reduce(&mut self, bucket: PolicyBucket, comm: &Group) -> Result<Reduction>;

    /// Reduces a bucket for a rank that has no data this step (uneven inputs): its bucket is all
    /// zeros, and it must issue the same collectives as the ranks that have data, so that the
    /// result is their sum divided by the group's size (PyTorch's `Join` with
    /// `divide_by_initial_world_size`). The default reduces the zero bucket like any other.
    fn reduce_joined(&mut self, bucket: PolicyBucket, comm: &Group) -> Result<Reduction> {
        self.reduce(bucket, comm)
    }

    /// The optimizer DDP steps ([`crate::DistributedDataParallel::optimizer`]): `full` is the
    /// user's optimizer over every parameter (possibly with state loaded from a checkpoint, its
    /// learning rate set), `build` makes another of the same kind over other parameters (shard
    /// views). The default steps `full` itself.
    fn optimizer(
        &mut self,
        full: Box<dyn Optimizer>,
        build: BuildOptimizer<'_>,
        ctx: &OptimizerContext,
    ) -> Result<Box<dyn Optimizer>> {
        let _ = (build, ctx);
        Ok(full)
    }

    /// The squared L2 norm of the reduced gradients this rank holds, summed over ranks when they
    /// are sharded (for global gradient clipping). A collective when any bucket is sharded.
    fn grad_norm_sq(&self, held: &[HeldGrad], comm: &Group) -> Result<f64> {
        default_grad_norm_sq(held, comm)
    }

    /// Runs after each optimizer step of DDP's optimizer (local SGD averages the models here).
    /// Every rank runs it after the same step. Under dynamic loss scaling (fp16) `step` says
    /// the step's scale, the next one's and whether the step was skipped
    /// ([`StepContext::loss_scale`]): what a policy keeping state derived from the gradients
    /// needs to keep it through skipped steps and scale changes.
    fn after_step(&mut self, step: &StepContext<'_>, comm: &Group) -> Result<()> {
        let _ = (step, comm);
        Ok(())
    }

    /// Waits, at most `timeout` in all, for the collectives this policy issued and still holds
    /// across steps (a streaming sync issued in one [`ReducerPolicy::after_step`] and merged in a
    /// later one), keeping their landed results for the step that uses them: called on every
    /// rank before every checkpoint's [`ReducerPolicy::state_dict`], which cannot wait (it takes
    /// `&self`) and may then refuse state still in flight. Finishing must not change what the
    /// policy computes, only when it waits: the straight run and a resumed one merge the same
    /// values at the same step. The default holds nothing and returns at once.
    fn finish_in_flight(&mut self, timeout: std::time::Duration) -> Result<()> {
        let _ = timeout;
        Ok(())
    }

    /// Whether this policy keeps state from one step to the next (an error-feedback residual,
    /// a warm-start factor, a step count), and whether [`ReducerPolicy::state_dict`] holds all
    /// of it: what decides whether a resume from a checkpoint can be exact. With the default,
    /// [`KeepsState::Undeclared`], checkpoints of the run are refused ([`check_checkpointable`]);
    /// every rank must answer alike.
    fn keeps_state(&self) -> KeepsState {
        KeepsState::Undeclared
    }

    /// Whether the ranks hold the same parameters and optimizer state after every step (the
    /// default: every rank reduces the same gradients and steps alike), or let them diverge
    /// between syncs (local SGD, DiLoCo), and then which of each rank's a checkpoint must keep:
    /// what decides whether a checkpoint holding rank 0's alone resumes exactly. Asked before
    /// the first step and at every checkpoint; every rank must answer alike, the same all run.
    fn replicas(&self) -> Replicas {
        Replicas::Identical
    }

    /// This rank's state, for checkpoints (`name -> tensor`; names are the policy's own).
    fn state_dict(&self) -> Result<Vec<(String, Tensor)>> {
        Ok(vec![])
    }

    /// Restores what [`ReducerPolicy::state_dict`] gave (on the same rank of a group of the same
    /// size). The default accepts only an empty state.
    fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> Result<()> {
        match state.first() {
            None => Ok(()),
            Some((name, _)) => Err(DdpError::PolicyState(format!(
                "policy '{}' keeps no state, but the checkpoint holds '{name}' for it (was it saved under another policy?)",
                self.name()
            ))),
        }
    }

    /// Memory the policy holds beside DDP's buckets.
    fn memory(&self) -> PolicyMemory {
        PolicyMemory::default()
    }

    /// How the overlap model costs the collectives this policy issues for each bucket, for a
    /// model whose parameters have `shapes` (registration order; step profiles record it) on
    /// `world_size` ranks; `None`: the model cannot, and refuses to replay its profiles. The
    /// replay prices what it says on the ring cost model at any world size.
    fn wire_model(&self, shapes: &[Vec<usize>], world_size: usize) -> Option<WireModel> {
        let _ = (shapes, world_size);
        None
    }

    /// What this policy sends in [`ReducerPolicy::after_step`], for a model whose parameters
    /// have `shapes` on `world_size` ranks: the overlap model charges it, amortised over its
    /// period, after the optimizer. `None` (the default): nothing.
    fn after_step_wire(&self, shapes: &[Vec<usize>], world_size: usize) -> Option<AfterStepWire> {
        let _ = (shapes, world_size);
        None
    }

    /// What the caller should know about the run so far (e.g. that PowerSGD never compressed).
    fn diagnostics(&self) -> Vec<PolicyDiagnostic> {
        vec![]
    }
}

/// What a policy keeps from one step to the next ([`ReducerPolicy::keeps_state`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeepsState {
    /// Nothing: each step's reduction depends on that step's gradients alone (all-reduce, a
    /// cast to fp16). A checkpoint holds no policy state and a resume is exact.
    Nothing,
    /// State that [`ReducerPolicy::state_dict`] returns in full and
    /// [`ReducerPolicy::load_state_dict`] restores (PowerSGD): a resume is exact.
    InStateDict,
    /// The policy does not say (the default). It trains as any other, but a checkpoint of it is
    /// refused ([`check_checkpointable`]): it may keep a residual that a resume would silently
    /// lose, and an empty or a full `state_dict` does not tell which.
    Undeclared,
}

/// Whether a policy's ranks hold the same parameters and optimizer state after every step
/// ([`ReducerPolicy::replicas`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replicas {
    /// After every step every rank holds the same parameters and optimizer state (all-reduce,
    /// compression, PowerSGD, ZeRO, whose sharded state is one state): a checkpoint keeps rank
    /// 0's, and resumes on any number of ranks.
    Identical,
    /// The ranks' replicas differ between syncs (local SGD, DiLoCo: each rank steps on its own
    /// gradients) in what the [`RankState`] names: a checkpoint keeps that of every rank, each
    /// rank resumes from its own (see the module docs for the load order), on as many ranks as
    /// wrote it. State of the policy's own that drifts per rank (DiLoCo's outer optimizer, its
    /// copy of the last synced parameters) belongs in its [`ReducerPolicy::state_dict`], which
    /// is every rank's too.
    Diverge(RankState),
    /// The ranks' replicas differ between syncs in what a checkpoint cannot keep (neither the
    /// parameters and optimizer state DDP keeps per rank nor the policy's state dict hold it):
    /// the policy trains as any other, but a run that would write a checkpoint is refused
    /// before its first step ([`check_checkpointable`]).
    DivergeUnsaved,
}

/// Which of each rank's own state a checkpoint keeps under [`Replicas::Diverge`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RankState {
    /// The parameters (the f32 master weights beside 16-bit parameters): they drift between
    /// the syncs that average them.
    pub params: bool,
    /// The state of the optimizer DDP steps (a momentum or Adam's moments follow the rank's own
    /// gradients, also across a sync that averages the parameters alone).
    pub optimizer: bool,
}

impl RankState {
    /// Each rank's parameters and optimizer state (local SGD, DiLoCo's inner optimizer).
    pub const ALL: RankState = RankState {
        params: true,
        optimizer: true,
    };
}

/// Refuses a checkpoint of `policy` when it does not declare what it keeps across steps
/// ([`KeepsState::Undeclared`]): it may keep a residual that the checkpoint would lose, so that
/// the resume would silently differ from the run it continues; and when its ranks diverge in
/// what a checkpoint cannot keep ([`Replicas::DivergeUnsaved`]). Decided from the declarations
/// alone, so every rank answers alike; `fit` asks before its first step when it will write a
/// checkpoint, and [`crate::DistributedDataParallel::gather_policy_state`] asks again.
pub fn check_checkpointable(policy: &dyn ReducerPolicy) -> Result<()> {
    if policy.keeps_state() == KeepsState::Undeclared {
        return Err(DdpError::PolicyState(format!(
            "policy '{}' does not declare whether it keeps state across steps, so a checkpoint could \
             silently lose what it keeps (an error-feedback residual) and its resume would not be exact: \
             implement ReducerPolicy::keeps_state (KeepsState::Nothing, or KeepsState::InStateDict with \
             state_dict and load_state_dict)",
            policy.name()
        )));
    }
    if policy.replicas() == Replicas::DivergeUnsaved {
        return Err(DdpError::PolicyState(format!(
            "policy '{}' lets its ranks diverge between syncs in state a checkpoint cannot keep \
             (Replicas::DivergeUnsaved), so its resume would not be exact: declare \
             Replicas::Diverge(RankState) when what differs is the ranks' parameters and optimizer state \
             (a checkpoint then keeps every rank's), or keep the rest in state_dict, or run without a checkpoint",
            policy.name()
        )));
    }
    Ok(())
}

/// Sum of squares of every held gradient (in f64); when any bucket is sharded the partial sums
/// are all-reduced (each shard counted on the rank that holds it).
pub fn default_grad_norm_sq(held: &[HeldGrad], comm: &Group) -> Result<f64> {
    let sq = |t: &Tensor| -> Result<f64> { Ok(t.to_dtype(DType::F64)?.sqr()?.sum_all()?.item()?) };
    let (mut full, mut sharded, mut shard_on) = (0.0, 0.0, None);
    for h in held {
        match h {
            HeldGrad::Full(t) => full += sq(t)?,
            HeldGrad::Shard { tensor, .. } => {
                sharded += sq(tensor)?;
                shard_on = Some(tensor.device());
            }
        }
    }
    let Some(device) = shard_on else {
        return Ok(full);
    };
    // The partial sums travel as f32 (buffers carry no f64): plenty for a norm; on the shards'
    // device (a device stream moves device memory).
    let partial = Tensor::from_vec(vec![sharded as f32], &[1])?.to_device(device)?;
    let summed = comm.all_reduce(&partial, ReduceOp::Sum, "ddp.grad_norm").wait()?;
    Ok(full + summed.item()?)
}

/// How a reducer policy's collectives for one bucket are costed by the overlap model (a policy
/// declares it: [`ReducerPolicy::wire_model`]; step profiles record it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum WireModel {
    /// One all-reduce per bucket carrying `bytes_per_element` bytes per gradient element (f32:
    /// 4; fp16 and bf16 compression: 2).
    AllReduce {
        /// Bytes per gradient element on the wire.
        bytes_per_element: f64,
    },
    /// A low-rank policy (PowerSGD): before `start_iter` one f32 all-reduce per bucket; then
    /// each parameter with `factors` is sent as its two f32 factors P and Q (their elements,
    /// as the policy sized them), the other tensors whole in f32: a bucket's whole tensors and
    /// P's in one all-reduce, its Q's in another (none when no parameter of it has factors).
    LowRank {
        /// Iterations reduced plainly first.
        start_iter: usize,
        /// Each parameter's factors `(P, Q)` in elements, in registration order (`None`: sent
        /// whole).
        factors: Vec<Option<(usize, usize)>>,
    },
    /// ZeRO: each (padded) bucket is reduce-scattered in f32 during backward; the updated
    /// parameters are all-gathered within the optimizer step (the recorded step's optimizer
    /// span holds them).
    ReduceScatter,
    /// Each rank's piece of every bucket is all-gathered: of a bucket of `n` gradient elements
    /// each rank sends `bytes_per_element` bytes for each of `ceil(density × n)` entries plus
    /// `bytes_per_bucket` (int8: every element, one byte each, and an f32 scale; top-k: its
    /// ratio, an f32 value and an i64 index each, and its count; 1-bit signs: an eighth, one
    /// byte, and the scale). The ring sends each rank's piece to every other rank: the bytes
    /// grow with the ranks.
    AllGather {
        /// Bytes per entry of each rank's piece (per gradient element when `density` is 1).
        bytes_per_element: f64,
        /// Bytes each rank adds once per bucket.
        #[serde(default)]
        bytes_per_bucket: f64,
        /// The fraction of the bucket's elements sent as entries, in `(0, 1]` (1: all).
        #[serde(default = "all_entries")]
        density: f64,
    },
    /// ZeRO-3: each unit is one (padded) bucket, reduce-scattered in f32 as its backward ends
    /// (the units fix the buckets, whatever the caps); each unit's parameters are all-gathered
    /// before its forward and again before its backward (the step profile's `gathers`), on the
    /// same comm stream, and the unit's compute waits for its gather (priced from the bytes the
    /// profile recorded for each gather).
    Zero3 {
        /// ZeRO++'s qgZ: instead of the f32 reduce-scatter, each rank's whole padded bucket is
        /// all-gathered as int8 with an f32 scale per block of this many elements of each rank's
        /// chunk (`None`: the reduce-scatter).
        #[serde(default)]
        quantized_gradients: Option<usize>,
        /// ZeRO++'s qwZ: each gather sends the rank's shard as int8 with an f32 scale per block
        /// of this many elements (`None`: in the parameters' dtype); the recorded gathers hold
        /// the bytes sent.
        #[serde(default)]
        quantized_gathers: Option<usize>,
    },
    /// No collective per bucket: the gradients stay on each rank during backward (DiLoCo,
    /// streaming DiLoCo); what the policy sends, it sends after the optimizer step
    /// ([`ReducerPolicy::after_step_wire`]).
    Local,
}

/// The density of a dense all-gather (serde's default for [`WireModel::AllGather`]).
fn all_entries() -> f64 {
    1.0
}

/// A collective of the ring cost model, as a wire model names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WireOp {
    /// Every rank ends with the reduction of every rank's buffer.
    AllReduce,
    /// Every rank ends with its shard of the reduction.
    ReduceScatter,
    /// Every rank ends with every rank's piece.
    AllGather,
    /// Every rank ends with the root's buffer.
    Broadcast,
}

impl WireOp {
    /// The ring collective the cost model prices.
    pub fn ring(self) -> brigade_comm::RingOp {
        use brigade_comm::RingOp;
        match self {
            WireOp::AllReduce => RingOp::AllReduce,
            WireOp::ReduceScatter => RingOp::ReduceScatter,
            WireOp::AllGather => RingOp::AllGather,
            WireOp::Broadcast => RingOp::Broadcast,
        }
    }
}

/// What a policy sends in [`ReducerPolicy::after_step`] ([`ReducerPolicy::after_step_wire`]):
/// every `every` steps each parameter element crosses the ranks once, `bytes_per_element` bytes
/// each (the buffer each rank hands in; for an all-gather, its piece), in `fragments`
/// collectives at staggered steps (of about equal bytes, or as [`AfterStepWire::parts`] says).
/// A fragment's collective with `overlap_steps` > 0 runs behind the compute that follows it
/// until the next collective on the comm stream (the next step's first: its buckets, or the
/// ranks' agreement after backward) queues behind it. A step is charged `fragments / every`
/// fragment collectives, each less the compute it runs behind.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AfterStepWire {
    /// The collective.
    pub op: WireOp,
    /// Bytes per parameter element of the buffer each rank hands in.
    pub bytes_per_element: f64,
    /// Every how many steps each parameter is sent (1: every step).
    pub every: usize,
    /// Collectives the parameters are sent in, at staggered steps (1: all at once).
    #[serde(default = "one_fragment")]
    pub fragments: usize,
    /// Steps of compute each fragment's collective runs behind (0: the step waits for it).
    #[serde(default)]
    pub overlap_steps: usize,
    /// Collectives each fragment is sent in, one after the other, each waiting the link's
    /// latency (1: one collective of the whole fragment; a policy that all-reduces each
    /// parameter in a tensor of its own issues one per parameter).
    #[serde(default = "one_fragment")]
    pub collectives: usize,
    /// Each fragment's part, in the order they are sent (empty: `fragments` equal shares of the
    /// parameters' elements, of `collectives` collectives each).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub parts: Vec<FragmentPart>,
}

/// One fragment of an [`AfterStepWire`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct FragmentPart {
    /// Its share of the parameters' elements (the parts' shares add up to 1).
    pub share: f64,
    /// Collectives it is sent in, one after the other, each waiting the link's latency.
    pub collectives: usize,
}

/// Serde's default for [`AfterStepWire::fragments`] and [`AfterStepWire::collectives`].
fn one_fragment() -> usize {
    1
}

/// Where one parameter's gradient sits in its bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketParam {
    /// Registration index of the parameter (stable across bucket rebuilds: key state by it).
    pub index: usize,
    /// Its name (`layers.0.weight`).
    pub name: String,
    /// First element of its gradient in the bucket's buffer.
    pub offset: usize,
    /// Its shape (the gradient has `shape.iter().product()` elements).
    pub shape: Vec<usize>,
}

impl BucketParam {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// True for a zero-size parameter.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Tag of bucket `i`'s collectives (shows up in traces and errors).
pub fn bucket_tag(i: usize) -> String {
    format!("bucket{i}")
}

/// One full bucket handed to [`crate::ReducerPolicy::reduce`] (PyTorch's `GradBucket`).
#[derive(Debug, Clone)]
pub struct PolicyBucket {
    /// The bucket's index: its place in the launch order, the same on every rank.
    pub index: usize,
    /// The bucket's flat buffer on the parameters' device: this rank's gradients, **not**
    /// divided by the world size, then zeros up to the layout's padding. The gradients are
    /// views into it: from `reduce` until the end of backward the bucket belongs to the policy.
    /// Its dtype is the reduce dtype ([`BucketLayout::dtype`]; by default
    /// [`crate::policy::PolicyContext::reduce_dtype`]): f32 in an f32 run, bf16 or fp16 beside
    /// 16-bit parameters unless f32 was asked for. Under fp16's dynamic loss scaling it holds the
    /// scaled gradients, and an inf or a NaN in it is a skipped step, not an error (see
    /// [`crate::policy::StepContext::loss_scale`]).
    pub tensor: Tensor,
    /// The parameters in the buffer, in buffer order.
    pub params: Vec<BucketParam>,
    /// Elements that are gradients (the rest of `tensor` is padding).
    pub grad_numel: usize,
    /// Whether this is the last bucket of the backward pass (PyTorch's `is_last`).
    pub is_last: bool,
    /// The layout's generation: it changes whenever the buckets are rebuilt (see
    /// [`crate::ReducerPolicy::buckets_built`] and [`PerBucket`]).
    pub generation: u64,
}

impl PolicyBucket {
    /// The tag of this bucket's collectives (`bucket3`).
    pub fn tag(&self) -> String {
        bucket_tag(self.index)
    }
}

/// How a policy reduces a bucket: the future of what DDP puts back under the gradients
/// (`Reduction<Tensor>`: what it gave, once the future completed).
pub enum Reduction<W = TensorWork<Tensor>> {
    /// The bucket's new contents, normally the average over ranks: a tensor of the bucket's
    /// length and dtype (the bucket tensor itself when reduced in place; another tensor is moved
    /// under the gradient views without a copy when it spans its storage).
    Full(W),
    /// This rank's shard of the reduced bucket: elements `rank*n..(rank+1)*n` of the padded
    /// buffer, `n = len / world` (ZeRO). With `keep_full` the full buffer stays allocated (the
    /// shard written in place, the rest zeroed: this rank does not know it); without, it is
    /// freed after the collective and the parameters' gradients are dropped until the next
    /// backward makes one of them final (ZeRO-2).
    Shard {
        /// The shard (its future).
        shard: W,
        /// Keep the full buffer allocated.
        keep_full: bool,
    },
}

impl Reduction {
    /// Waits (on the host) for the reduction's future: what it gave, and when its collectives
    /// ran.
    pub(crate) fn wait_timed(self) -> Result<(Reduction<Tensor>, brigade_comm::OpTiming)> {
        Ok(match self {
            Reduction::Full(w) => {
                let (t, timing) = w.wait_timed()?;
                (Reduction::Full(t), timing)
            }
            Reduction::Shard { shard, keep_full } => {
                let (shard, timing) = shard.wait_timed()?;
                (Reduction::Shard { shard, keep_full }, timing)
            }
        })
    }
}

/// The buckets a policy needs (asked once, when DDP is built).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketLayout {
    /// Each bucket's buffer is padded with zeros to a multiple of this many elements (1: none;
    /// ZeRO: the world size, for equal shards).
    pub pad_to: usize,
    /// The buffers' element type: the reduce dtype unless the policy asks for another
    /// ([`crate::ReducerPolicy::layout`]; f32 in an f32 run, bf16 or fp16 beside 16-bit
    /// parameters).
    pub dtype: DType,
    /// Whether DDP may regroup the buckets: rebuild them after the first iteration from the
    /// observed ready order, and under new caps (`set_bucket_caps`, the autotuner). `false` keeps
    /// the first layout for the whole run (ZeRO: its optimizer state is cut from the buckets).
    pub regroup: bool,
}

impl Default for BucketLayout {
    fn default() -> Self {
        BucketLayout {
            pad_to: 1,
            dtype: DType::F32,
            regroup: true,
        }
    }
}

/// Per-bucket state that cannot outlive its layout: the rule across bucket rebuilds, enforced.
/// A bucket index names different parameters once DDP has rebuilt its buckets (after the first
/// iteration, or under new caps), so state stored for bucket `i` of one layout is dropped, not
/// read, under the next ([`PolicyBucket::generation`]). State that must survive a rebuild is
/// keyed by parameter ([`BucketParam::index`]) instead, as PowerSGD's is.
#[derive(Debug, Clone)]
pub struct PerBucket<T> {
    generation: Option<u64>,
    state: HashMap<usize, T>,
}

impl<T> Default for PerBucket<T> {
    fn default() -> Self {
        PerBucket {
            generation: None,
            state: HashMap::new(),
        }
    }
}

impl<T> PerBucket<T> {
    /// No state.
    pub fn new() -> Self {
        Self::default()
    }

    /// Forgets everything stored under another generation than `bucket`'s.
    fn align(&mut self, bucket: &PolicyBucket) {
        if self.generation != Some(bucket.generation) {
            self.state.clear();
            self.generation = Some(bucket.generation);
        }
    }

    /// `bucket`'s state, if it was stored under the same layout.
    pub fn get(&mut self, bucket: &PolicyBucket) -> Option<&mut T> {
        self.align(bucket);
        self.state.get_mut(&bucket.index)
    }

    /// Stores `bucket`'s state (dropping what other layouts left).
    pub fn insert(&mut self, bucket: &PolicyBucket, value: T) {
        self.align(bucket);
        self.state.insert(bucket.index, value);
    }

    /// `bucket`'s state, made by `make` if there is none under this layout.
    pub fn get_or_insert_with(&mut self, bucket: &PolicyBucket, make: impl FnOnce() -> T) -> &mut T {
        self.align(bucket);
        self.state.entry(bucket.index).or_insert_with(make)
    }

    /// Number of buckets with state.
    pub fn len(&self) -> usize {
        self.state.len()
    }

    /// True when no bucket has state.
    pub fn is_empty(&self) -> bool {
        self.state.is_empty()
    }

    /// Every bucket's state, in no particular order.
    pub fn values(&self) -> impl Iterator<Item = &T> {
        self.state.values()
    }
}
