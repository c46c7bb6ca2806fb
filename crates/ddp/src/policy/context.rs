//! What DDP tells a policy beyond a bucket: the model and group it serves, the live buckets
//! its optimizer reads, the step that just ran, and what it reports back (memory, diagnostics).

use std::sync::Arc;
use std::time::Instant;

use brigade_autograd::{GradSubscriber, Optimizer, ScopeHooks, SubscriberError, Var};
use brigade_tensor::{DType, Device, Tensor};

use super::BucketParam;
use crate::group::Group;
use crate::Result;

/// The model and group a policy serves, when DDP is built.
#[derive(Debug, Clone)]
pub struct PolicyContext {
    /// This rank.
    pub rank: usize,
    /// Ranks in the group.
    pub world_size: usize,
    /// Every registered parameter, in registration order (frozen ones included: `trainable`
    /// says which are bucketed).
    pub params: Vec<ParamInfo>,
    /// The dtype asked for the buckets ([`crate::DdpConfig::reduce_dtype`]); `None`: the
    /// parameters'.
    pub reduce_dtype: Option<DType>,
}

impl PolicyContext {
    /// The dtype of the trainable parameters (the first one's; f32 when none is trainable):
    /// what gradient buckets hold unless a policy says otherwise.
    pub fn param_dtype(&self) -> DType {
        self.params.iter().find(|p| p.trainable).map_or(DType::F32, |p| p.dtype)
    }

    /// The dtype the buckets are reduced in: the one asked for
    /// ([`crate::DdpConfig::reduce_dtype`]), else the parameters' ([`PolicyContext::param_dtype`]).
    pub fn reduce_dtype(&self) -> DType {
        self.reduce_dtype.unwrap_or_else(|| self.param_dtype())
    }
}

/// One parameter as a policy sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamInfo {
    /// Its name.
    pub name: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its dtype.
    pub dtype: DType,
    /// Its device (and its bucket's).
    pub device: Device,
    /// Whether it requires grad (only those are bucketed and reduced).
    pub trainable: bool,
    /// Its unit, the module scope whose forward reads it, if the model named one
    /// (`ParamStore::set_unit`): what ZeRO-3 gathers and frees as one.
    pub unit: Option<String>,
}

/// One bucket of the current layout.
#[derive(Debug, Clone, PartialEq)]
pub struct BucketSpan {
    /// Its index (launch order).
    pub index: usize,
    /// Its parameters, in buffer order.
    pub params: Vec<BucketParam>,
    /// Elements of its buffer, padding included.
    pub numel: usize,
    /// Elements that are gradients.
    pub grad_numel: usize,
}

/// What a bucket holds once its reduction landed: what an optimizer steps from and what the
/// gradient norm is taken over.
#[derive(Debug, Clone)]
pub enum HeldGrad {
    /// The whole bucket's gradients (identical on every rank once reduced): its first
    /// `grad_numel` elements.
    Full(Tensor),
    /// This rank's shard of the reduced bucket: elements `offset..offset + len` of the padded
    /// buffer (padding included at the end of the last shards).
    Shard {
        /// The shard.
        tensor: Tensor,
        /// Where it starts in the padded buffer.
        offset: usize,
    },
}

/// What [`Buckets`] reads: DDP's reducer implements it (kept behind a trait so that the
/// policy's side of the contract does not import the reducer that calls it).
pub(crate) trait BucketSource: Send + Sync {
    /// Every registered parameter, in registration order.
    fn params(&self) -> &[Var];
    /// The current layout's buckets, in launch order.
    fn spans(&self) -> Vec<BucketSpan>;
    /// The layout's generation.
    fn generation(&self) -> u64;
    /// Bucket `index`'s full flat buffer.
    fn buffer(&self, index: usize) -> Result<Tensor>;
    /// What bucket `index` holds now.
    fn held(&self, index: usize) -> Result<HeldGrad>;
}

/// A live view of DDP's buckets for a policy's optimizer (ZeRO steps each bucket's shard from
/// it): cheap to clone; every call reads the current state.
#[derive(Clone)]
pub struct Buckets {
    pub(crate) source: Arc<dyn BucketSource>,
}

impl Buckets {
    /// Every registered parameter, in registration order.
    pub fn params(&self) -> &[Var] {
        self.source.params()
    }

    /// The current layout's buckets, in launch order.
    pub fn spans(&self) -> Vec<BucketSpan> {
        self.source.spans()
    }

    /// The layout's generation (it changes when the buckets are rebuilt).
    pub fn generation(&self) -> u64 {
        self.source.generation()
    }

    /// Bucket `index`'s full flat buffer (padding included): its gradients, or, after a
    /// reduction that kept only a shard, a freed buffer that reads `StorageLent`.
    pub fn buffer(&self, index: usize) -> Result<Tensor> {
        self.source.buffer(index)
    }

    /// What bucket `index` holds now (after a synchronized backward: the reduced gradients).
    pub fn held(&self, index: usize) -> Result<HeldGrad> {
        self.source.held(index)
    }
}

/// What [`crate::ReducerPolicy::optimizer`] builds the optimizer from.
pub struct OptimizerContext {
    /// The buckets, live.
    pub buckets: Buckets,
    /// The process group, metered (for a step that communicates: ZeRO's all-gather).
    pub comm: Group,
}

/// Makes an optimizer of the user's kind (their optimizer config) over a list of parameters.
pub type BuildOptimizer<'a> = &'a dyn Fn(Vec<Var>) -> Box<dyn Optimizer>;

/// The optimizer step that just ran, for [`crate::ReducerPolicy::after_step`] (a policy that
/// acts every H steps counts them itself, in its state, so that a resumed run keeps the phase).
pub struct StepContext<'a> {
    /// Every registered parameter, in registration order (`requires_grad` says which train).
    pub params: &'a [Var],
    /// The optimizer's dynamic loss scaling at this step (fp16), `None` without it: the buckets
    /// the policy reduced held the gradients times a scale, and the step may have been skipped.
    pub loss_scale: Option<LossScaleStep>,
}

/// What dynamic loss scaling ([`brigade_autograd::GradScaler`]) did at one step, for a policy
/// that keeps state derived from the gradients (an error-feedback residual): such state is in
/// the scaled units of the step it came from. After a skipped step it should be what it was
/// before the step (that step's gradients held an inf or a NaN, and no parameter moved); when
/// the scale changes, state kept in scaled units is multiplied by `next_scale / scale` so that
/// the next step's gradients find it in their own units.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossScaleStep {
    /// The factor this step's gradients (the buckets reduced) were multiplied by.
    pub scale: f64,
    /// The factor the next step's gradients are multiplied by: `scale`, halved after a skipped
    /// step, doubled after the growth interval's clean steps.
    pub next_scale: f64,
    /// Whether the optimizer skipped this step.
    pub skipped: bool,
}

impl LossScaleStep {
    /// What multiplies state kept in this step's scaled units to bring it to the next step's:
    /// `next_scale / scale` (1 when the scale stays; a power of two, so exact in f32).
    pub fn rescale(&self) -> f64 {
        self.next_scale / self.scale
    }
}

/// Memory a policy holds beside DDP's buckets, in bytes (counted in
/// [`crate::MemoryReport`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PolicyMemory {
    /// State kept across steps (PowerSGD's error feedback and factors).
    pub state_bytes: usize,
    /// Communication scratch the last step held at once (ZeRO's all-gathered parameters).
    pub scratch_bytes: usize,
    /// Parameters the policy holds in place of the parameter tensors (ZeRO-3's f32 shards).
    pub parameter_bytes: usize,
    /// The most bytes of parameters gathered at once since the last report (ZeRO-3).
    pub gathered_bytes: usize,
}

/// What a policy that shards the parameters themselves (ZeRO-3) does around their uses: as
/// [`ScopeHooks`] it gathers a unit's parameters into their tensors when the forward enters the
/// unit's scope and frees them when it leaves; as a [`GradSubscriber`] on the model's bus it
/// gathers them again when backward reaches the unit and frees them once the unit's gradients
/// are final. DDP installs both on the thread that builds it ([`crate::ReducerPolicy::param_hooks`]).
pub trait ParamHooks: ScopeHooks + GradSubscriber {
    /// Gathers every parameter whole into its tensor (a collective: every rank calls it), for
    /// reading the full model (a checkpoint, an evaluation whose forwards differ between
    /// ranks); the hooks gather and free nothing until [`ParamHooks::release_all`].
    fn gather_all(&self) -> Result<()>;
    /// Frees what [`ParamHooks::gather_all`] gathered.
    fn release_all(&self) -> Result<()>;
    /// The gathers of the last pass whose backward finished (its forward's and its backward's),
    /// in the order they were issued: what a step profile records. The default: none.
    fn gathers(&self) -> Vec<GatherTimes> {
        vec![]
    }
    /// The error a hook met since the last pass began and has not reported yet (scope hooks
    /// return nothing: a gather that failed in forward is reported at backward's start), taken.
    /// A forward that fails on a parameter such a gather left without its values asks for it:
    /// it is the cause. The default: none.
    fn take_error(&self) -> Option<SubscriberError> {
        None
    }
}

/// Which pass a parameter gather served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GatherPhase {
    /// Before the unit's forward.
    Forward,
    /// Before the unit's backward.
    Backward,
}

/// One all-gather of a unit's parameters as it ran ([`ParamHooks::gathers`]).
#[derive(Debug, Clone, PartialEq)]
pub struct GatherTimes {
    /// The unit (its scope: `blocks.0`).
    pub unit: String,
    /// Bytes of the gathered buffer (every rank's shard, padding included).
    pub bytes: usize,
    /// The pass it served.
    pub phase: GatherPhase,
    /// When it was issued on the comm stream (before `needed` when prefetched).
    pub issued: Instant,
    /// When the compute needed it (the scope was entered, backward reached the unit); `None`:
    /// prefetched and never used (dropped at the end of the pass).
    pub needed: Option<Instant>,
    /// When it ran on the link (first start, last finish).
    pub ran: Option<(Instant, Instant)>,
}

impl GatherTimes {
    /// What the compute waited for it, in seconds: from when it was needed to when it
    /// finished (0 when prefetched in time, or never used).
    pub fn waited_s(&self) -> f64 {
        match (self.needed, self.ran) {
            (Some(needed), Some((_, finished))) => finished.saturating_duration_since(needed).as_secs_f64(),
            _ => 0.0,
        }
    }
}

/// Something a policy wants its caller to know about the run so far (a sweep row and a run's
/// summary show them): e.g. that PowerSGD never compressed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyDiagnostic {
    /// A stable short code (`never-compressed`).
    pub code: &'static str,
    /// One line for people.
    pub message: String,
}
