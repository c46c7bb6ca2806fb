//! The reducer: listens on the gradient-ready bus, counts each bucket down, and hands a full
//! bucket to the reducer policy the moment it is full, strictly in bucket order; at the end of
//! backward it puts what the policy's future returns back under the gradients.
//!
//! Vocabulary follows PyTorch's `Reducer` (`reducer.cpp`): `autograd_hook` is
//! [`GradSubscriber::grad_ready`], `mark_variable_ready` decrements the bucket's
//! `pending`, `mark_bucket_ready` launches every leading full bucket, and
//! `finalize_backward` is [`GradSubscriber::backward_finished`]. The reducer knows no policy
//! by name: what a policy asked for (its [`BucketLayout`], a [`Reduction`] of the full bucket or
//! of a shard) is all it acts on.
//!
//! Its buckets ([`Bucket`]) are flat buffers whose slices are the gradients, grouped by
//! [`assign_buckets`] (PyTorch's `compute_bucket_assignment_by_size`).
//!
//! One backward pass as the reducer lives it: set up when backward starts (which parameters are
//! in the graph, the buckets rebuilt in the order gradients arrived), each gradient attached and
//! counted as it becomes ready, each full bucket launched and, when backward ends, landed (or
//! given back when it aborts); besides, the join pass of a rank without data, and the bucket
//! caps changed between passes.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use brigade_autograd::{GradReady, GradSubscriber, SubscriberError, Var};
use brigade_comm::{Buffer, CommMeter, Communicator, EventKind, OpTiming, Recorder, RingOp, SpanId};
use brigade_tensor::{DType, Device, Tensor};

use crate::group::{Group, LinkTime, Metered};
use crate::peak_parts::MemoryPart;
use crate::phase::Phase;
use crate::policy::{
    BucketLayout, BucketParam, BucketSource, BucketSpan, HeldGrad, PolicyBucket, ReducerPolicy, Reduction,
};
use crate::{DdpConfig, DdpError, Result};

/// Groups parameters into buckets, visiting them in `order` (PyTorch: reverse
/// registration order at first, then the observed ready order). A bucket is closed
/// once it holds at least its cap: `first_cap` bytes for bucket 0, `cap` for the rest
/// (so a parameter larger than the cap gets a bucket of its own).
pub fn assign_buckets(param_bytes: &[usize], order: &[usize], first_cap: usize, cap: usize) -> Vec<Vec<usize>> {
    let mut buckets = vec![];
    let mut current = vec![];
    let mut bytes = 0;
    for &p in order {
        current.push(p);
        bytes += param_bytes[p];
        let limit = if buckets.is_empty() { first_cap } else { cap };
        if bytes >= limit {
            buckets.push(std::mem::take(&mut current));
            bytes = 0;
        }
    }
    if !current.is_empty() {
        buckets.push(current);
    }
    buckets
}

/// The buckets' grouping as DDP holds it after regrouping them (from the observed ready order
/// after the first iteration, or under new caps): what a checkpoint records
/// ([`crate::DistributedDataParallel::bucket_grouping`]) so that a resume reduces on the same
/// buckets ([`DdpConfig::grouping`]). A policy whose reduction of a bucket depends on which
/// gradients share it (one int8 scale per bucket, a top-k over the bucket) continues exactly
/// only on them.
#[derive(Debug, Clone, PartialEq)]
pub struct BucketGrouping {
    /// Each bucket's parameters by name, in launch order, each in buffer order.
    pub buckets: Vec<Vec<String>>,
    /// The bucket caps they were grouped under, in MiB: (every bucket but the first, the first).
    pub caps_mb: (f64, f64),
    /// The layout's generation ([`crate::policy::PolicyBucket::generation`]).
    pub generation: u64,
}

/// A bucket's reduction in flight: what the end of backward waits on.
pub(crate) struct InFlight {
    /// The policy's reduction.
    reduction: Reduction,
    /// What the bucket's collectives sent so far (its part of DDP's meter).
    meter: CommMeter,
    /// How long its collectives ran so far.
    link: LinkTime,
}

/// One bucket: a flat buffer whose slices are its parameters' gradients (padded to the policy's
/// layout).
pub(crate) struct Bucket {
    /// Parameter registration indices, in the order their slices sit in `flat`.
    pub(crate) params: Vec<usize>,
    /// The flat buffer; each parameter's `.grad` is a view into it.
    pub(crate) flat: Tensor,
    /// Elements of `flat` that are gradients (the rest is padding).
    pub(crate) grad_numel: usize,
    /// Parameters not yet ready in the current synchronized backward.
    pub(crate) pending: usize,
    /// The bucket's reduction in flight (the bucket belongs to the policy meanwhile).
    pub(crate) work: Option<InFlight>,
    /// What the bucket holds once its reduction landed (`None`: nothing reduced yet, before the
    /// first synchronized pass or during one).
    pub(crate) held: Option<HeldGrad>,
    /// Under [`State::into_shard`]: the shard the step's passes before this one reduced, taken
    /// from `held` when this pass gave the bucket its zeros again; the pass's own shard adds
    /// into it when it lands.
    pub(crate) carry: Option<Tensor>,
}

impl Bucket {
    /// Bytes of the flat buffer.
    pub(crate) fn bytes(&self) -> usize {
        self.flat.numel() * self.flat.dtype().size_in_bytes()
    }
}

pub(crate) struct State {
    pub(crate) buckets: Vec<Bucket>,
    /// Parameter index -> bucket index.
    pub(crate) bucket_of: Vec<usize>,
    next_launch: usize,
    ready: Vec<bool>,
    /// Order in which parameters became ready in the current synchronized backward.
    pub(crate) ready_order: Vec<usize>,
    pub(crate) sync: bool,
    /// The synchronized passes add their shards into the ones the passes before left
    /// ([`crate::DistributedDataParallel::accumulate_into_shard`]).
    pub(crate) into_shard: bool,
    in_backward: bool,
    /// The current pass is a rank without data taking part ([`Reducer::join_pass`]).
    joined: bool,
    pub(crate) rebuilt: bool,
    /// The layout's generation: bumped at every rebuild.
    pub(crate) generation: u64,
    /// The bucket caps in effect, in MiB: (every bucket but the first, the first).
    pub(crate) caps: (f64, f64),
    span: Option<(EventKind, SpanId)>,
    /// When things happened in the current (or last) synchronized pass.
    pub(crate) pass: PassTimes,
    /// The most bytes of full bucket buffers alive at once since the last synchronized
    /// backward started ([`State::full_bytes`]).
    pub(crate) full_peak: usize,
}

impl State {
    /// Bytes of the full bucket buffers alive now: those holding their storage, and those lent
    /// to a reduction in flight (on the comm stream until it lands).
    pub(crate) fn full_bytes(&self) -> usize {
        (self.buckets.iter())
            .filter(|b| !is_lent(&b.flat) || b.work.is_some())
            .map(Bucket::bytes)
            .sum()
    }

    fn note_full(&mut self) {
        self.full_peak = self.full_peak.max(self.full_bytes());
    }
}

/// When things happened in one synchronized backward pass, for step profiles
/// (the overlap model's `RankProfile`).
#[derive(Debug, Clone, Default)]
pub struct PassTimes {
    /// When backward began.
    pub started: Option<Instant>,
    /// When backward's compute ended (before waiting for the buckets).
    pub compute_end: Option<Instant>,
    /// When each parameter's gradient became ready (registration order; `None`: frozen or not
    /// announced).
    pub grad_ready: Vec<Option<Instant>>,
    /// The buckets in launch order.
    pub buckets: Vec<PassBucket>,
    /// Seconds the policy spent inside [`crate::ReducerPolicy::reduce`] (on the compute thread,
    /// within backward), summed over the buckets.
    pub reduce_s: f64,
    /// The policy's [`crate::ReducerPolicy::after_step`] after the step's optimizer: its
    /// seconds, and the seconds its collectives held the comm stream (`None` until it ran).
    pub after_step: Option<(f64, f64)>,
    /// When the collectives the policy issued in earlier steps' `after_step` had last left the
    /// comm stream, as this step's `after_step` began (`None`: it issued none yet). One still in
    /// flight at the step's start holds the stream against the step's own collectives.
    pub earlier_after_step_left: Option<Instant>,
}

/// One bucket of a [`PassTimes`].
#[derive(Debug, Clone)]
pub struct PassBucket {
    /// Its parameters, in bucket order.
    pub params: Vec<usize>,
    /// Bytes of its buffer (padding included).
    pub bytes: usize,
    /// Bytes this rank sent on the wire for it, under the ring algorithms (every collective the
    /// policy issued for the bucket), once it landed.
    pub wire_bytes: f64,
    /// When it was handed to the policy.
    pub launched: Instant,
    /// When the policy's `reduce` returned (its compute before its collectives done, they
    /// issued).
    pub issued: Instant,
    /// When its collectives ran (first start, last finish), once it completed.
    pub ran: Option<(Instant, Instant)>,
    /// Seconds its collectives held the comm stream, once it completed: the rest of `ran` is
    /// the policy's own compute between them (PowerSGD's orthogonalisation).
    pub link_s: f64,
}

pub(crate) struct Reducer {
    pub(crate) params: Vec<Var>,
    /// Which parameters required grad at construction: only those are bucketed, expected
    /// in every backward pass and reduced (frozen ones are left alone, as in PyTorch).
    trainable: Vec<bool>,
    pub(crate) comm: Arc<dyn Communicator>,
    /// Where full buckets go: the process group (the host group, or a device group). Policies
    /// get it metered by `DdpConfig::meter`; each bucket's reduction counts into its own part.
    group: Group,
    cfg: DdpConfig,
    recorder: Option<Recorder>,
    pub(crate) state: Mutex<State>,
    policy: Mutex<Box<dyn ReducerPolicy>>,
    pub(crate) policy_name: String,
    pub(crate) layout: BucketLayout,
    /// The policy fixes its buckets itself ([`ReducerPolicy::bucket_groups`]).
    fixed_groups: bool,
}

/// Bytes of `p`'s gradient in a bucket (buckets hold the parameter's dtype).
pub(crate) fn grad_bytes(p: &Var) -> usize {
    let v = p.value();
    v.numel() * v.dtype().size_in_bytes()
}

/// Buckets for `params` visited in `order`, with the caps `(bucket, first bucket)` (MiB to bytes).
fn group_params(params: &[Var], order: &[usize], caps: (f64, f64)) -> Vec<Vec<usize>> {
    let bytes = |mib: f64| (mib * 1024.0 * 1024.0).max(1.0) as usize;
    let sizes: Vec<usize> = params.iter().map(grad_bytes).collect();
    assign_buckets(&sizes, order, bytes(caps.1), bytes(caps.0))
}

/// Whether `t`'s storage is lent out (or was freed by a policy's reduction).
pub(crate) fn is_lent(t: &Tensor) -> bool {
    t.storage_numel() < t.layout().storage_extent()
}

/// A bucket's zeros: on the CPU, in the process's shared heap when it has one
/// ([`brigade_comm::host_vec`]), so that its all-reduce under mpirun runs in place in the
/// peers' memory instead of copying through the node's segment; elsewhere as any tensor.
/// True when a bucket of `bucket` dtype can hold the gradients of a parameter of `param` dtype:
/// the same dtype, or f32 beside 16-bit parameters (mixed precision reducing in f32).
fn bucket_holds(bucket: DType, param: DType) -> bool {
    bucket == param || (bucket == DType::F32 && matches!(param, DType::BF16 | DType::F16))
}

fn bucket_zeros(numel: usize, dtype: DType, device: Device) -> Result<Tensor> {
    use brigade_comm::host_vec;
    use half::{bf16, f16};
    let _part = MemoryPart::BucketGradients.enter();
    let shape = [numel];
    Ok(match (device, dtype) {
        (Device::Cpu, DType::F32) => Tensor::from_vec(host_vec(numel, 0f32), &shape)?,
        (Device::Cpu, DType::F16) => Tensor::from_vec(host_vec(numel, f16::ZERO), &shape)?,
        (Device::Cpu, DType::BF16) => Tensor::from_vec(host_vec(numel, bf16::ZERO), &shape)?,
        _ => Tensor::zeros_on(&shape, dtype, device)?,
    })
}

/// A bucket's landed `shard` added into the one the step's microbatches before it left, when
/// accumulating into the shard (`carried`), or alone.
fn add_carried(carried: Option<Tensor>, shard: Tensor) -> Result<Tensor> {
    let Some(sum) = carried else {
        return Ok(shard);
    };
    sum.add_assign(&shard)?;
    Ok(sum)
}

/// Zeros of `flat`'s length as its storage, if it has none (a failed or consuming collective).
fn restore_zeros(flat: &Tensor) -> Result<()> {
    if is_lent(flat) {
        // charged to the buffer's part when its storage was freed
        let _part = MemoryPart::BucketGradients.enter();
        let zeros = bucket_zeros(flat.numel(), flat.dtype(), flat.device())?;
        let storage = zeros.lend_storage()?;
        // the bytes are charged once, to `flat`: the tensor that lent them goes first (it
        // would count them a second time until it dropped, a full buffer the peak never held)
        drop(zeros);
        flat.restore_storage(storage)?;
    }
    Ok(())
}

/// `groups` as a policy fixed them, checked: every trainable parameter in exactly one bucket,
/// no frozen one, no empty bucket.
fn check_groups(groups: Vec<Vec<usize>>, trainable: &[bool], policy: &str) -> Result<Vec<Vec<usize>>> {
    let fail = |reason: String| DdpError::Policy {
        policy: policy.to_string(),
        reason,
    };
    let mut seen = vec![0usize; trainable.len()];
    for (b, g) in groups.iter().enumerate() {
        if g.is_empty() {
            return Err(fail(format!("its bucket {b} holds no parameter")));
        }
        for &p in g {
            match trainable.get(p) {
                None => {
                    return Err(fail(format!(
                        "its bucket {b} names parameter {p}, which does not exist"
                    )))
                }
                Some(false) => return Err(fail(format!("its bucket {b} holds parameter {p}, which is frozen"))),
                Some(true) => seen[p] += 1,
            }
        }
    }
    if let Some(p) = (0..trainable.len()).find(|&p| trainable[p] && seen[p] != 1) {
        return Err(fail(format!(
            "its buckets hold parameter {p} {} times, not once",
            seen[p]
        )));
    }
    Ok(groups)
}

/// The buckets of a recorded grouping ([`DdpConfig::grouping`]) by registration index, and
/// their generation: the recorded buckets under the recorded caps, or, under other `caps`, the
/// recorded order grouped by them (a new layout: the next generation). Every trainable
/// parameter must be named exactly once, and no other.
fn restore_groups(
    params: &[Var],
    trainable: &[bool],
    recorded: &BucketGrouping,
    caps: (f64, f64),
) -> Result<(Vec<Vec<usize>>, u64)> {
    let fail = |reason: String| DdpError::BucketGrouping(reason);
    let index: std::collections::HashMap<&str, usize> = (params.iter().enumerate())
        .filter(|&(p, _)| trainable[p])
        .map(|(p, v)| (v.name().unwrap_or("<unnamed>"), p))
        .collect();
    let mut seen = vec![false; params.len()];
    let mut groups = Vec::with_capacity(recorded.buckets.len());
    for names in &recorded.buckets {
        let mut group = Vec::with_capacity(names.len());
        for name in names {
            let &p = index.get(name.as_str()).ok_or_else(|| {
                fail(format!(
                    "it names '{name}', which is no trainable parameter of this model"
                ))
            })?;
            if std::mem::replace(&mut seen[p], true) {
                return Err(fail(format!("it names '{name}' twice")));
            }
            group.push(p);
        }
        if group.is_empty() {
            return Err(fail("it holds an empty bucket".into()));
        }
        groups.push(group);
    }
    if let Some(p) = (0..params.len()).find(|&p| trainable[p] && !seen[p]) {
        let name = params[p].name().unwrap_or("<unnamed>");
        return Err(fail(format!("it leaves out the trainable parameter '{name}'")));
    }
    if recorded.caps_mb == caps {
        return Ok((groups, recorded.generation));
    }
    let order: Vec<usize> = groups.into_iter().flatten().collect();
    Ok((group_params(params, &order, caps), recorded.generation + 1))
}

/// Builds buckets for `groups` and points every parameter's gradient at its slice; each flat
/// buffer is padded to a multiple of `layout.pad_to` elements. A group `later` says so of is
/// left without storage (and its parameters without gradients) as soon as it is made, so that
/// no more than one such buffer is ever whole here: it is made as its first gradient arrives.
pub(crate) fn build_buckets(
    params: &[Var],
    groups: Vec<Vec<usize>>,
    layout: &BucketLayout,
    later: &dyn Fn(&[usize]) -> bool,
) -> Result<(Vec<Bucket>, Vec<usize>)> {
    let mut bucket_of = vec![usize::MAX; params.len()];
    let mut buckets = Vec::with_capacity(groups.len());
    for (b, group) in groups.into_iter().enumerate() {
        let numel: usize = group.iter().map(|&p| params[p].value().numel()).sum();
        // The bucket lives beside its parameters (a CUDA model gets CUDA buckets).
        let device = group.first().map_or(Device::Cpu, |&p| params[p].value().device());
        let pad = layout.pad_to.max(1);
        let padded = numel.div_ceil(pad) * pad;
        group.iter().for_each(|&p| bucket_of[p] = b);
        // the gradients are moved into their slices as they arrive
        let flat = match (later(&group), device) {
            (true, Device::Cpu) => Tensor::unallocated(&[padded], layout.dtype),
            (later, _) => {
                let flat = bucket_zeros(padded, layout.dtype, device)?;
                let mut offset = 0;
                for &p in &group {
                    let shape = params[p].shape();
                    params[p].set_grad_buffer(flat.flat_view(offset, &shape)?)?;
                    offset += shape.iter().product::<usize>();
                }
                if later {
                    flat.free_storage()?;
                }
                flat
            }
        };
        if later(&group) {
            group.iter().try_for_each(|&p| params[p].set_grad(None))?;
        }
        buckets.push(Bucket {
            pending: group.len(),
            params: group,
            flat,
            grad_numel: numel,
            work: None,
            held: None,
            carry: None,
        });
    }
    Ok((buckets, bucket_of))
}

/// What a policy is told of the run: this rank, the world, and every parameter as it sees it.
fn policy_context(
    params: &[Var],
    comm: &dyn Communicator,
    units: &[Option<String>],
    reduce_dtype: Option<DType>,
) -> crate::policy::PolicyContext {
    crate::policy::PolicyContext {
        rank: comm.rank(),
        world_size: comm.world_size(),
        params: params
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let v = p.value();
                crate::policy::ParamInfo {
                    name: p.name().unwrap_or("<unnamed>").to_string(),
                    shape: v.shape().to_vec(),
                    dtype: v.dtype(),
                    device: v.device(),
                    trainable: p.requires_grad(),
                    unit: units.get(i).cloned().flatten(),
                }
            })
            .collect(),
        reduce_dtype,
    }
}

/// Checks that the buckets of `layout` can hold every trainable parameter's gradient.
fn check_bucket_dtype(params: &[Var], layout: &BucketLayout, policy_name: &str) -> Result<()> {
    if let Some(p) = params
        .iter()
        .find(|p| p.requires_grad() && !bucket_holds(layout.dtype, p.value().dtype()))
    {
        return Err(DdpError::Policy {
        policy: policy_name.to_string(),
        reason: format!(
            "its buckets hold {}, but parameter '{}' is {} (gradients accumulate in their parameter's dtype, or in f32 beside 16-bit parameters)",
            layout.dtype,
            p.name().unwrap_or("<unnamed>"),
            p.value().dtype()
        ),
    });
    }
    Ok(())
}

impl Reducer {
    pub(crate) fn new(
        params: Vec<Var>,
        comm: Arc<dyn Communicator>,
        group: Group,
        cfg: DdpConfig,
        policy: Box<dyn ReducerPolicy>,
        units: Vec<Option<String>>,
    ) -> Result<Reducer> {
        let trainable: Vec<bool> = params.iter().map(Var::requires_grad).collect();
        let ctx = policy_context(&params, comm.as_ref(), &units, cfg.reduce_dtype);
        let layout = policy.layout(&ctx);
        let policy_name = policy.name();
        check_bucket_dtype(&params, &layout, &policy_name)?;
        let order: Vec<usize> = (0..params.len()).rev().filter(|&p| trainable[p]).collect();
        let caps = (cfg.bucket_cap_mb, cfg.first_bucket_cap_mb);
        let fixed = policy.bucket_groups(&ctx)?;
        let fixed_groups = fixed.is_some();
        // A layout that cannot regroup keeps its first buckets.
        let mut rebuilt = !cfg.rebuild_buckets || !layout.regroup;
        let mut generation = 0;
        let groups = match (fixed, &cfg.grouping) {
            (Some(groups), _) => check_groups(groups, &trainable, &policy_name)?,
            (None, Some(recorded)) if layout.regroup => {
                let (groups, recorded_generation) = restore_groups(&params, &trainable, recorded, caps)?;
                (rebuilt, generation) = (true, recorded_generation);
                groups
            }
            (None, _) => group_params(&params, &order, caps),
        };
        let had_grad: Vec<bool> = params.iter().map(|p| p.grad().is_some()).collect();
        // a fixed layout (ZeRO) makes each buffer as its first gradient arrives: under ZeRO-2
        // and 3 a bucket's full buffer lives from there until its reduce-scatter lands
        let later = |group: &[usize]| !layout.regroup && group.iter().all(|&p| !had_grad[p]);
        let (buckets, bucket_of) = build_buckets(&params, groups, &layout, &later)?;
        let n = params.len();
        let reducer = Reducer {
            recorder: cfg.recorder.clone(),
            params,
            trainable,
            comm,
            group,
            state: Mutex::new(State {
                buckets,
                bucket_of,
                next_launch: 0,
                ready: vec![false; n],
                ready_order: vec![],
                sync: true,
                into_shard: false,
                in_backward: false,
                joined: false,
                rebuilt,
                generation,
                caps,
                span: None,
                pass: PassTimes::default(),
                full_peak: 0,
            }),
            policy: Mutex::new(policy),
            policy_name,
            layout,
            fixed_groups,
            cfg,
        };
        reducer.announce(&reducer.lock())?;
        Ok(reducer)
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn lock_policy(&self) -> MutexGuard<'_, Box<dyn ReducerPolicy>> {
        self.policy.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn name(&self, p: usize) -> &str {
        self.params[p].name().unwrap_or("<unnamed>")
    }

    /// Where each of `params` (registration indices, bucket order) sits in its bucket.
    pub(crate) fn bucket_params(&self, params: &[usize]) -> Vec<BucketParam> {
        let mut offset = 0;
        params
            .iter()
            .map(|&p| {
                let param = BucketParam {
                    index: p,
                    name: self.name(p).to_string(),
                    offset,
                    shape: self.params[p].shape(),
                };
                offset += param.len();
                param
            })
            .collect()
    }

    /// Tells the policy the current layout (construction and every rebuild).
    fn announce(&self, st: &State) -> Result<()> {
        let spans = self.bucket_spans(st);
        self.lock_policy().buckets_built(&spans, st.generation)
    }

    /// What a policy sees of each bucket of the current layout.
    fn bucket_spans(&self, st: &State) -> Vec<BucketSpan> {
        st.buckets
            .iter()
            .enumerate()
            .map(|(index, b)| BucketSpan {
                index,
                params: self.bucket_params(&b.params),
                numel: b.flat.numel(),
                grad_numel: b.grad_numel,
            })
            .collect()
    }

    /// `mark_variable_ready`: counts the parameter's bucket down and launches what is full.
    fn mark_ready(&self, st: &mut State, p: usize) -> Result<()> {
        if st.ready[p] {
            return Err(DdpError::ReadyTwice {
                param: self.name(p).to_string(),
            });
        }
        st.ready[p] = true;
        st.ready_order.push(p);
        st.pass.grad_ready[p] = Some(Instant::now());
        let b = st.bucket_of[p];
        st.buckets[b].pending -= 1;
        // Launch strictly in bucket order: a later bucket that fills first waits its turn.
        while st.next_launch < st.buckets.len() && st.buckets[st.next_launch].pending == 0 {
            self.launch(st, st.next_launch)?;
            st.next_launch += 1;
            self.land_freed_before(st, st.next_launch - 1)?;
        }
        Ok(())
    }

    /// Records bucket `b`'s ready event and hands the bucket to the policy on the comm side.
    fn launch(&self, st: &mut State, b: usize) -> Result<()> {
        let is_last = b + 1 == st.buckets.len();
        let (generation, joined) = (st.generation, st.joined);
        let bucket = &mut st.buckets[b];
        let ready = self.group.record_ready(b, &bucket.flat)?;
        let policy_bucket = PolicyBucket {
            index: b,
            tensor: bucket.flat.clone(),
            params: self.bucket_params(&bucket.params),
            grad_numel: bucket.grad_numel,
            is_last,
            generation,
        };
        bucket.held = None;
        let meter = self.cfg.meter.part();
        let link = LinkTime::default();
        let comm: Group = Arc::new(Metered::for_bucket(self.group.clone(), meter.clone(), b).timing_into(link.clone()));
        let on = self.group.launch(b, ready)?;
        let launched = Instant::now();
        let reduction = {
            // the shard, a policy's scratch: here and on the comm stream's thread
            let _part = MemoryPart::Reductions.enter();
            let _time = ReduceTime(&mut st.pass.reduce_s, launched);
            let mut policy = self.lock_policy();
            let reduce = || match joined {
                true => policy.reduce_joined(policy_bucket, &comm),
                false => policy.reduce(policy_bucket, &comm),
            };
            match on {
                Some(stream) => stream.scope(reduce),
                None => reduce(),
            }
        }?;
        let issued = Instant::now();
        self.group.launched(b, &meter)?;
        let bucket = &mut st.buckets[b];
        bucket.work = Some(InFlight { reduction, meter, link });
        let (params, bytes) = (bucket.params.clone(), bucket.bytes());
        st.pass.buckets.push(PassBucket {
            params,
            bytes,
            wire_bytes: 0.0,
            launched,
            issued,
            ran: None,
            link_s: 0.0,
        });
        Ok(())
    }

    fn end_span(&self, st: &mut State) {
        if let (Some(rec), Some((_, id))) = (&self.recorder, st.span.take()) {
            rec.end(id);
            // a stream that times the compute stream moves the span onto its clock
            self.group.compute_scope(None);
        }
    }

    /// Puts what bucket `b`'s reduction returned back under its gradients.
    fn land(&self, b: usize, bucket: &mut Bucket, landing: Reduction<Tensor>) -> Result<()> {
        let flat = &bucket.flat;
        let wrong = |found: usize, dtype: DType| DdpError::PolicyResult {
            policy: self.policy_name.clone(),
            bucket: b,
            expected: format!("{} x {}", flat.numel(), flat.dtype()),
            found: format!("{found} x {dtype}"),
        };
        match landing {
            Reduction::Full(t) => {
                if t.numel() != flat.numel() || t.dtype() != flat.dtype() {
                    restore_zeros(flat)?;
                    return Err(wrong(t.numel(), t.dtype()));
                }
                if t.shares_storage(flat) {
                    if is_lent(flat) {
                        restore_zeros(flat)?;
                        return Err(DdpError::Policy {
                            policy: self.policy_name.clone(),
                            reason: format!(
                                "bucket {b} came back without its storage (a consuming collective took it): return the result of an in-place collective, or another tensor"
                            ),
                        });
                    }
                } else if t.spans_storage() && t.device() == flat.device() {
                    // moved under the gradient views without a copy
                    flat.restore_storage(t.lend_storage()?)?;
                } else {
                    restore_zeros(flat)?;
                    flat.copy_from(&t)?;
                }
                bucket.held = Some(HeldGrad::Full(flat.narrow(0, 0, bucket.grad_numel)?));
            }
            Reduction::Shard {
                shard: tensor,
                keep_full,
            } => {
                let world = self.comm.world_size();
                let per = flat.numel() / world.max(1);
                if tensor.numel() != per || tensor.dtype() != flat.dtype() {
                    restore_zeros(flat)?;
                    return Err(wrong(tensor.numel(), tensor.dtype()));
                }
                if self.layout.regroup {
                    restore_zeros(flat)?;
                    return Err(DdpError::Policy {
                        policy: self.policy_name.clone(),
                        reason:
                            "it reduces buckets to shards but lets DDP regroup its buckets: a rebuild would move the \
                                 gradients out from under the shards (set BucketLayout::regroup to false)"
                                .into(),
                    });
                }
                let offset = self.comm.rank() * per;
                if keep_full {
                    if is_lent(flat) {
                        restore_zeros(flat)?;
                    } else {
                        flat.fill(0.0)?;
                    }
                    flat.narrow(0, offset, per)?.copy_from(&tensor)?;
                    bucket.held = Some(HeldGrad::Shard {
                        tensor: flat.narrow(0, offset, per)?,
                        offset,
                    });
                } else {
                    let tensor = add_carried(bucket.carry.take(), tensor)?;
                    // its bytes go now (a consuming collective took them already)
                    flat.free_storage()?;
                    // PyTorch's `p.grad = None`: the gradients went with the full buffer.
                    for &p in &bucket.params {
                        self.params[p].set_grad(None)?;
                    }
                    bucket.held = Some(HeldGrad::Shard { tensor, offset });
                }
            }
        }
        Ok(())
    }

    /// Waits for every launched bucket and puts the results back under the gradients.
    fn wait_all(&self, st: &mut State) -> Result<()> {
        let span = self
            .recorder
            .as_ref()
            .map(|r| r.begin(self.comm.rank(), Phase::WaitForBuckets.kind()));
        let mut first_err = None;
        for b in 0..st.buckets.len() {
            if let Err(e) = self.wait_one(st, b) {
                first_err.get_or_insert(e);
            }
        }
        if let (Some(r), Some(s)) = (&self.recorder, span) {
            r.end(s);
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Waits for bucket `b`'s reduction, if one is in flight, and puts its result back under
    /// the gradients (on an error, the views get zeros back before it is reported).
    fn wait_one(&self, st: &mut State, b: usize) -> Result<()> {
        let bucket = &mut st.buckets[b];
        let Some(in_flight) = bucket.work.take() else {
            return Ok(());
        };
        match self.finish(b, in_flight) {
            Ok((landing, timing, wire_bytes, link_s)) => {
                if st.into_shard && !matches!(landing, Reduction::Shard { keep_full: false, .. }) {
                    restore_zeros(&st.buckets[b].flat)?;
                    return Err(DdpError::Policy {
                        policy: self.policy_name.clone(),
                        reason: format!(
                            "bucket {b} came back whole, not as a shard with its full buffer freed: there is no \
                             gradient shard to accumulate the microbatches into (accumulate under no_sync)"
                        ),
                    });
                }
                if let Some(pb) = st.pass.buckets.get_mut(b) {
                    pb.ran = Some((timing.started, timing.finished));
                    pb.wire_bytes = wire_bytes;
                    pb.link_s = link_s;
                }
                self.land(b, &mut st.buckets[b], landing)
            }
            Err(error) => {
                restore_zeros(&bucket.flat)?;
                Err(error)
            }
        }
    }

    /// After bucket `b` was launched with a reduction that frees its full buffer (a shard
    /// without `keep_full`): lands the buckets before it whose reductions free theirs, so that
    /// at most two full buffers of such buckets are alive at once, the one being reduced and the
    /// one being filled (FSDP's reduce-scatter of each unit as its backward ends). The wait
    /// for the bucket before overlaps bucket `b`'s collective and the backward up to here.
    fn land_freed_before(&self, st: &mut State, b: usize) -> Result<()> {
        let frees = |bucket: &Bucket| {
            matches!(
                bucket.work,
                Some(InFlight {
                    reduction: Reduction::Shard { keep_full: false, .. },
                    ..
                })
            )
        };
        if !frees(&st.buckets[b]) {
            return Ok(());
        }
        for before in 0..b {
            if frees(&st.buckets[before]) {
                self.wait_one(st, before)?;
            }
        }
        Ok(())
    }

    /// The process group as policies see it outside a bucket's reduction (the optimizer's
    /// step, the gradient norm, `after_step`): counted into DDP's meter.
    pub(crate) fn metered(&self) -> Group {
        Arc::new(Metered::new(self.group.clone(), self.cfg.meter.clone()))
    }

    /// [`Reducer::metered`], also adding up into `link` how long its collectives ran.
    pub(crate) fn metered_timing(&self, link: LinkTime) -> Group {
        Arc::new(Metered::new(self.group.clone(), self.cfg.meter.clone()).timing_into(link))
    }

    /// Bucket `b`'s reduction, once the compute side is ordered behind it and its future
    /// completed: what it gave, when its collectives ran, the bytes they sent on the wire and
    /// the seconds they held the comm stream.
    fn finish(&self, b: usize, in_flight: InFlight) -> Result<(Reduction<Tensor>, OpTiming, f64, f64)> {
        self.group.wait(b)?;
        let (landing, timing) = in_flight.reduction.wait_timed()?;
        self.group.check()?;
        Ok((
            landing,
            timing,
            in_flight.meter.totals().wire_bytes,
            in_flight.link.seconds(),
        ))
    }

    /// Regroups the buckets as `groups`, announces the new layout to the policy.
    fn regroup(&self, st: &mut State, groups: Vec<Vec<usize>>) -> Result<()> {
        // set_grad_buffer copies each gradient (e.g. this step's reduced values) into its new slice.
        let (buckets, bucket_of) = build_buckets(&self.params, groups, &self.layout, &|_| false)?;
        st.buckets = buckets;
        st.bucket_of = bucket_of;
        for b in st.buckets.iter_mut() {
            b.held = Some(HeldGrad::Full(b.flat.narrow(0, 0, b.grad_numel)?));
        }
        st.generation += 1;
        self.announce(st)
    }

    /// After the first synchronized iteration: rebuild the buckets once from the order in
    /// which gradients became ready on rank 0 (broadcast, so every rank agrees).
    fn rebuild(&self, st: &mut State) -> Result<()> {
        let bytes: Vec<u8> = st.ready_order.iter().flat_map(|&p| (p as u32).to_le_bytes()).collect();
        let world = self.comm.world_size();
        self.cfg.meter.count(RingOp::Broadcast, bytes.len(), world);
        let got = self
            .comm
            .broadcast(Buffer::U8(bytes), 0, "ddp.rebuild_buckets")
            .wait()?;
        let Buffer::U8(bytes) = got else {
            let found = got.dtype().to_string();
            return Err(DdpError::BufferDType {
                what: "ddp.rebuild_buckets".into(),
                expected: DType::U8,
                found,
            });
        };
        let order: Vec<usize> = bytes
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as usize)
            .collect();
        let expected = self.trainable.iter().filter(|&&t| t).count();
        let mut seen = vec![false; self.params.len()];
        for &p in &order {
            if p >= seen.len() || !self.trainable[p] || std::mem::replace(&mut seen[p], true) {
                return Err(DdpError::RebuildOrder { order, expected });
            }
        }
        if order.len() != expected {
            return Err(DdpError::RebuildOrder { order, expected });
        }
        let groups = group_params(&self.params, &order, st.caps);
        self.regroup(st, groups)?;
        st.rebuilt = true;
        Ok(())
    }
}

impl Reducer {
    /// The grouping to record once the buckets were regrouped (see
    /// [`crate::DistributedDataParallel::bucket_grouping`]).
    pub(crate) fn grouping(&self) -> Option<BucketGrouping> {
        let st = self.lock();
        if !st.rebuilt || !self.layout.regroup || self.fixed_groups {
            return None;
        }
        let buckets = st
            .buckets
            .iter()
            .map(|b| b.params.iter().map(|&p| self.name(p).to_string()).collect())
            .collect();
        Some(BucketGrouping {
            buckets,
            caps_mb: st.caps,
            generation: st.generation,
        })
    }
}

impl BucketSource for Reducer {
    fn params(&self) -> &[Var] {
        &self.params
    }

    fn spans(&self) -> Vec<BucketSpan> {
        self.bucket_spans(&self.lock())
    }

    fn generation(&self) -> u64 {
        self.lock().generation
    }

    fn buffer(&self, index: usize) -> Result<Tensor> {
        let st = self.lock();
        st.buckets
            .get(index)
            .map(|b| b.flat.clone())
            .ok_or_else(|| DdpError::Policy {
                policy: self.policy_name.clone(),
                reason: format!("bucket {index} does not exist ({} buckets)", st.buckets.len()),
            })
    }

    fn held(&self, index: usize) -> Result<HeldGrad> {
        let st = self.lock();
        let b = st.buckets.get(index).ok_or_else(|| DdpError::Policy {
            policy: self.policy_name.clone(),
            reason: format!("bucket {index} does not exist ({} buckets)", st.buckets.len()),
        })?;
        b.held.clone().ok_or_else(|| DdpError::Policy {
            policy: self.policy_name.clone(),
            reason: format!(
                "bucket {index} holds no reduced gradient: the optimizer stepped before a synchronized backward"
            ),
        })
    }
}

impl Reducer {
    /// Regroups the buckets, in their current parameter order, under new caps (between passes
    /// only: no bucket may be in flight). Deterministic: ranks that call it with the same caps
    /// get the same buckets.
    pub(crate) fn set_caps(&self, st: &mut State, caps: (f64, f64)) -> Result<()> {
        if st.in_backward {
            return Err(DdpError::RebuildDuringBackward);
        }
        if !self.layout.regroup {
            return Err(DdpError::Policy {
                policy: self.policy_name.clone(),
                reason:
                    "it fixes its buckets (e.g. its optimizer state is cut from them): the bucket caps cannot change"
                        .into(),
            });
        }
        let order: Vec<usize> = st.buckets.iter().flat_map(|b| b.params.iter().copied()).collect();
        let groups = group_params(&self.params, &order, caps);
        self.regroup(st, groups)?;
        st.caps = caps;
        Ok(())
    }

    /// PyTorch's `prepare_for_backward`: resets the pass and marks unused parameters.
    fn start_pass(&self, st: &mut State, in_graph: &[usize]) -> Result<()> {
        if st.in_backward {
            // A pass that failed without telling us (backward_aborted not called): take
            // back what it launched before starting afresh.
            self.abort_pass(st);
        }
        if !st.sync {
            return Ok(());
        }
        if !st.into_shard {
            st.buckets.iter_mut().for_each(|b| b.carry = None);
        }
        st.in_backward = true;
        st.joined = false;
        st.next_launch = 0;
        st.ready.iter_mut().for_each(|r| *r = false);
        st.ready_order.clear();
        st.pass = PassTimes {
            started: Some(Instant::now()),
            grad_ready: vec![None; self.params.len()],
            ..PassTimes::default()
        };
        for b in st.buckets.iter_mut() {
            b.pending = b.params.len();
        }
        st.full_peak = st.full_bytes();
        let mut used = vec![false; self.params.len()];
        for &p in in_graph {
            used[p] = true;
        }
        let unused: Vec<usize> = (0..self.params.len())
            .filter(|&p| self.trainable[p] && !used[p])
            .collect();
        if unused.is_empty() {
            return Ok(());
        }
        if !self.cfg.find_unused_parameters {
            st.in_backward = false;
            let params = unused.iter().map(|&p| self.name(p).to_string()).collect();
            return Err(DdpError::UnusedParameters {
                rank: self.comm.rank(),
                params,
            });
        }
        // PyTorch's find_unused_parameters: mark them ready up front so no bucket waits on them.
        for p in unused {
            self.attach(st, p)?;
            self.mark_ready(st, p)?;
        }
        Ok(())
    }

    /// PyTorch's `finalize_backward`: waits for every bucket, then rebuilds them once.
    fn finish_pass(&self, st: &mut State) -> Result<()> {
        st.in_backward = false;
        st.pass.compute_end = Some(Instant::now());
        if st.next_launch < st.buckets.len() {
            let params = (0..self.params.len())
                .filter(|&p| self.trainable[p] && !st.ready[p])
                .map(|p| self.name(p).to_string())
                .collect();
            // Give back whatever was launched before reporting.
            let _ = self.wait_all(st);
            return Err(DdpError::NeverReady {
                rank: self.comm.rank(),
                params,
            });
        }
        self.wait_all(st)?;
        if !st.rebuilt {
            self.rebuild(st)?;
        }
        Ok(())
    }

    /// A pass that failed midway: waits for the buckets it launched so that every gradient
    /// view has its storage back (their values are partial: zero them before the next
    /// pass). The comm streams of the ranks stay in step only if every rank launched the
    /// same buckets; otherwise the next collective fails on every rank as a mismatch.
    fn abort_pass(&self, st: &mut State) {
        if st.in_backward {
            let _ = self.wait_all(st);
            st.in_backward = false;
        }
    }

    /// A synchronized pass for a rank with no data this step (uneven inputs): every bucket is
    /// zero and goes to the policy's `reduce_joined`, in bucket order, so that this rank issues
    /// the collectives the others issue in their backward.
    pub(crate) fn join_pass(&self) -> Result<()> {
        let mut st = self.lock();
        if !st.sync {
            return Err(DdpError::Policy {
                policy: self.policy_name.clone(),
                reason: "a rank cannot join (take part without data) inside no_sync: nothing is reduced there".into(),
            });
        }
        let all: Vec<usize> = (0..self.params.len()).filter(|&p| self.trainable[p]).collect();
        self.start_pass(&mut st, &all)?;
        st.joined = true;
        for b in 0..st.buckets.len() {
            let params = st.buckets[b].params.clone();
            for &p in &params {
                self.attach(&mut st, p)?;
            }
            st.buckets[b].flat.fill(0.0)?;
        }
        let order: Vec<usize> = st.buckets.iter().flat_map(|b| b.params.clone()).collect();
        let marked = order.into_iter().try_for_each(|p| self.mark_ready(&mut st, p));
        let finished = match marked {
            Ok(()) => self.finish_pass(&mut st),
            Err(e) => {
                self.abort_pass(&mut st);
                Err(e)
            }
        };
        st.joined = false;
        finished
    }

    /// When parameter `p`'s gradient becomes final: if its bucket's full buffer was freed by a
    /// shard reduction (ZeRO-2), gives it zeros again (the last step's shard is dropped) and
    /// points every parameter of the bucket at its slice, as a bucket that was never freed
    /// holds them: gradients made already (inside a checkpointed scope, before the scope's end
    /// announces them) move in, and the contributions still to come add in place instead of
    /// each becoming a tensor of its own beside the buffer. Else moves `p`'s gradient into its
    /// slice unless it already accumulates there. In synchronized and `no_sync` passes alike.
    fn attach(&self, st: &mut State, p: usize) -> Result<()> {
        if !self.trainable[p] {
            return Ok(());
        }
        let b = st.bucket_of[p];
        let into_shard = st.into_shard;
        let bucket = &mut st.buckets[b];
        if !(is_lent(&bucket.flat) && bucket.work.is_none()) {
            return self.point_at_slice(bucket, p);
        }
        if let (true, Some(HeldGrad::Shard { tensor, .. })) = (into_shard, bucket.held.take()) {
            bucket.carry = Some(tensor);
        }
        restore_zeros(&bucket.flat)?;
        st.note_full();
        let bucket = &st.buckets[b];
        bucket.params.iter().try_for_each(|&q| self.point_at_slice(bucket, q))
    }

    /// Makes `bucket`'s slice of parameter `p` the storage its gradient accumulates into (the
    /// gradient it holds, if any, copied in), unless it already is.
    fn point_at_slice(&self, bucket: &Bucket, p: usize) -> Result<()> {
        if self.params[p].grad().is_some_and(|g| g.shares_storage(&bucket.flat)) {
            return Ok(());
        }
        let offset: usize = bucket
            .params
            .iter()
            .take_while(|&&q| q != p)
            .map(|&q| self.params[q].value().numel())
            .sum();
        self.params[p].set_grad_buffer(bucket.flat.flat_view(offset, &self.params[p].shape())?)?;
        Ok(())
    }
}

impl GradSubscriber for Reducer {
    fn backward_started(&self, in_graph: &[usize]) -> std::result::Result<(), SubscriberError> {
        let mut st = self.lock();
        Ok(self.start_pass(&mut st, in_graph)?)
    }

    fn node_backward(&self, scope: Option<&str>, _op: &str) {
        let Some(rec) = &self.recorder else { return };
        let mut st = self.lock();
        let kind = Phase::backward(scope).kind();
        if st.span.as_ref().is_some_and(|(k, _)| *k == kind) {
            return;
        }
        self.end_span(&mut st);
        let id = rec.begin(self.comm.rank(), kind.clone());
        self.group.compute_scope(Some(id));
        st.span = Some((kind, id));
    }

    fn grad_ready(&self, ready: GradReady<'_>) -> std::result::Result<(), SubscriberError> {
        let mut st = self.lock();
        self.attach(&mut st, ready.index)?;
        if !st.sync {
            return Ok(());
        }
        if !st.in_backward {
            return Err(Box::new(DdpError::ReadyOutsideBackward {
                param: ready.name.to_string(),
            }));
        }
        Ok(self.mark_ready(&mut st, ready.index)?)
    }

    fn backward_finished(&self) -> std::result::Result<(), SubscriberError> {
        let mut st = self.lock();
        self.end_span(&mut st);
        if !st.sync {
            return Ok(());
        }
        Ok(self.finish_pass(&mut st)?)
    }

    fn backward_aborted(&self) {
        let mut st = self.lock();
        self.end_span(&mut st);
        self.abort_pass(&mut st);
    }
}

/// Adds the seconds since its start to its total when dropped (also on an error's return).
struct ReduceTime<'a>(&'a mut f64, Instant);

impl Drop for ReduceTime<'_> {
    fn drop(&mut self) {
        *self.0 += self.1.elapsed().as_secs_f64();
    }
}

#[cfg(test)]
mod tests {
    use super::assign_buckets;

    #[test]
    fn first_bucket_is_small_and_each_bucket_closes_at_its_cap() {
        // sizes of params 0..5; reverse order 4,3,2,1,0
        let sizes = [100, 40, 40, 30, 10];
        let order = [4, 3, 2, 1, 0];
        // first cap 35: [4(10), 3(30)] closes at 40 >= 35; then cap 70: [2,1] = 80 closes; [0] rest
        assert_eq!(
            assign_buckets(&sizes, &order, 35, 70),
            vec![vec![4, 3], vec![2, 1], vec![0]]
        );
        // a huge cap: everything in one bucket after the first
        assert_eq!(
            assign_buckets(&sizes, &order, 1, 1 << 30),
            vec![vec![4], vec![3, 2, 1, 0]]
        );
    }
}
