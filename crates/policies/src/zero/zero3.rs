//! ZeRO-3 ([`Zero3`]; PyTorch's FSDP with full sharding, DeepSpeed's stage 3): stage 2, and each
//! rank keeps only its f32 shard of every unit's parameters; the parameter tensors hold their
//! values only while a unit runs.
//!
//! The units are the model's scopes (`ParamStore::set_unit` names each parameter's). Each unit
//! is one DDP bucket, padded to a multiple of the world size and fixed for the run, so that a
//! rank's shard of the unit's flat parameters and its shard of the unit's flat gradients are the
//! same elements: the optimizer (a [`super::ZeroOptimizer`] over the masters) steps them with the
//! reduce-scattered gradients, and no all-gather follows the step. Around the uses:
//!
//! ```text
//! forward:   enter unit ── all-gather its shards into the parameters' storage ── ops ── exit: free the storage
//! backward:  first node of the unit ── all-gather again ── its nodes ── its last gradient final: free;
//!            the unit's bucket is reduce-scattered into the rank's gradient shard (DDP's reducer)
//! ```
//!
//! Each gather also issues the next unit's (prefetch: forward order in forward, reverse in
//! backward, [`Zero3::with_prefetch`]), which runs on the comm stream while the unit computes;
//! a gather still in flight when a pass ends, or when the optimizer steps, is waited for and
//! dropped (it holds the shards' old values).
//!
//! Freeing is in place (FSDP's resize-to-zero): the storage is taken out of the parameter
//! tensor, which every view and every backward closure shares, so its bytes go while the graph
//! keeps the tensor; the next gather puts a storage back under the same tensor. A read of a freed
//! parameter is a `StorageLent` error, never a stale value.
//!
//! On a device (NCCL, or the host-staged device group; `brigade_ddp::group::DeviceGroup`) every
//! gather and every reduce-scatter runs on the comm stream, ordered by events, and the host
//! never waits: a gather waits on an event of the compute stream before it reads the shard, and
//! the compute stream waits on the gather's done event only when the unit is needed (so a
//! prefetched gather runs while the unit before it computes); the reduce-scatters run in the
//! buckets' launches, the optimizer's kernels behind their done events. A unit's parameters
//! are freed on the compute stream after their last use there; a buffer a collective still
//! reads or writes (a shard rounded to 16 bits for its gather) is freed behind the
//! collective's event (the keep-alive rule of `brigade_tensor::Stream`).
//!
//! A sharded start: parameters registered without values (`brigade_autograd::defer_param_init`)
//! are never whole on any rank: each rank draws only its shard of each unit from the
//! parameters' recipes (bit for bit the whole draw's elements there), and the first forward
//! gathers the units as every later one does. A model built whole instead is cut into shards,
//! and its first forward after the optimizer is built runs on the whole parameters. Either
//! way the first forward records which units it entered, and its backward checks that the
//! scopes cover every parameter the graph reads (one error line naming the first that is
//! not; after a sharded start, a read outside the unit's scope meets the freed parameter in
//! the forward already), then frees the units.
//!
//! Beside 16-bit parameters (mixed precision, FSDP2's `MixedPrecisionPolicy`) the f32 shard is
//! the master weights and no other master copy is kept: the shards are cut from the f32 masters
//! of the optimizer handed over (which is then dropped), each gather sends the shard rounded
//! once to the parameters' dtype (half the bytes of an f32 gather in bf16 or fp16), the buckets
//! hold the reduce dtype, and the optimizer widens the gradient shard to f32 for the master's
//! step. Under fp16's loss scaling the optimizer takes over the scaler and the ranks agree on a
//! skipped step, which leaves the shards as they were ([`super::ZeroOptimizer`]).
//!
//! ZeRO++'s options ([`Zero3::with_options`], [`super::quantized`]): qwZ gathers the shards as
//! blockwise int8 (the masters stay f32 and exact; gathers for `summon_full_params` stay exact),
//! qgZ reduces the units' gradients as blockwise int8 with stochastic rounding.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use brigade_autograd::{GradReady, GradSubscriber, Optimizer, ScopeHooks, SubscriberError, Var};
use brigade_comm::ReduceOp;
use brigade_ddp::policy::{
    BucketLayout, BucketSpan, BuildOptimizer, GatherPhase, GatherTimes, Group, OptimizerContext, ParamHooks,
    PolicyBucket, PolicyContext, PolicyMemory, ReducerPolicy, Reduction, StepContext, TensorWork, WireModel,
};
use brigade_ddp::{DdpError, MemoryPart};
use brigade_tensor::{DType, Tensor};

use super::optimizer::ZeroOptimizer;
use super::quantized::{self, QgzState, ZeroPlusPlus};
use super::shard::{pieces, shard_len};
use super::ZeroStage;

type Result<T> = brigade_ddp::Result<T>;

fn zero3_error(reason: String) -> DdpError {
    DdpError::Policy {
        policy: "zero3".into(),
        reason,
    }
}

/// One unit: its parameters (in its bucket's order) and this rank's shard of them.
struct Unit {
    /// The unit's scope (`blocks.0`).
    name: String,
    /// Registration indices, in the order their elements sit in the unit's flat buffer.
    params: Vec<usize>,
    /// Elements of the unit's parameters.
    numel: usize,
    /// This rank's f32 shard of the unit's flat (padded) parameters: the master (whatever the
    /// parameters' dtype).
    shard: Option<Tensor>,
    /// Whether the parameter tensors hold their values now.
    gathered: bool,
    /// Trainable parameters of the unit whose gradient is not final yet in this backward.
    pending: usize,
    /// The unit's backward finished in this pass (it is not gathered again for later nodes).
    done: bool,
    /// Entered by the forward since the last check (the first forward's coverage check).
    entered: bool,
}

/// What the hooks share: the units, the parameters, the collectives.
struct Gather {
    units: Vec<Unit>,
    /// The unit of each registered parameter (`None`: frozen, or not sharded).
    unit_of: Vec<Option<usize>>,
    /// Every registered parameter (set when the optimizer is built).
    vars: Vec<Var>,
    comm: Option<Group>,
    /// The first forward after the optimizer was built runs on whole parameters (a model
    /// built whole: its first backward checks the scopes' coverage).
    probing: bool,
    /// The first backward checks that the scopes cover the parameters the graph reads.
    unchecked: bool,
    /// Every unit gathered by `gather_all`: the hooks leave them be until `release_all`.
    summoned: bool,
    /// Bytes of parameters gathered now, and the most at once since the last report.
    live: usize,
    peak: usize,
    /// The most bytes gathered at once in the last step (from one optimizer step to the next).
    last_peak: usize,
    /// The first error a hook met (hooks return none): the next backward event returns it.
    error: Option<DdpError>,
    /// Gathers issued ahead of their unit (prefetch), in issue order, each with its entry in
    /// `log`.
    in_flight: VecDeque<(usize, TensorWork<Tensor>, usize)>,
    /// The gathers since the last backward ended or the optimizer stepped, in issue order: the
    /// pass under way's.
    log: Vec<GatherTimes>,
    /// Between a backward's start and its end (a recompute's gathers serve the backward).
    in_backward: bool,
    /// The gathers of the last pass whose backward finished.
    last_log: Vec<GatherTimes>,
    /// How many units ahead a gather is issued (0: none).
    prefetch: usize,
    /// The parameters' dtype: what a gather sends and brings (the shards stay f32).
    param_dtype: DType,
    /// The most bytes of prefetched parameters in flight at once.
    prefetch_cap: usize,
    /// qwZ: the pass's gathers in blockwise int8 ([`quantized`]).
    qwz: bool,
    /// Gathers for `gather_all` (a checkpoint, an evaluation): exact whatever `qwz`.
    exact: bool,
}

/// The hooks of [`Zero3`] (forward scopes and the backward bus).
pub(crate) struct Gatherer {
    state: Mutex<Gather>,
}

impl Gatherer {
    fn lock(&self) -> MutexGuard<'_, Gather> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `f`, keeping its first error for the next backward event.
    fn record(&self, f: impl FnOnce(&mut Gather) -> Result<()>) {
        let mut g = self.lock();
        if let Err(e) = f(&mut g) {
            g.error.get_or_insert(e);
        }
    }

    fn take(&self) -> std::result::Result<(), SubscriberError> {
        match self.lock().error.take() {
            Some(e) => Err(Box::new(e)),
            None => Ok(()),
        }
    }
}

impl Gather {
    fn active(&self) -> bool {
        self.comm.is_some() && !self.probing && !self.summoned
    }

    /// The unit whose scope is `scope` or holds it (`blocks.0.attn` lies in `blocks.0`).
    fn unit_in(&self, scope: &str) -> Option<usize> {
        self.units.iter().position(|u| {
            scope == u.name
                || (scope.len() > u.name.len() && scope.starts_with(&u.name) && scope.as_bytes()[u.name.len()] == b'.')
        })
    }

    /// All-gathers unit `u`'s shards for `phase` and puts each parameter's values back under
    /// its tensor.
    fn gather(&mut self, u: usize, phase: GatherPhase) -> Result<()> {
        if self.units[u].gathered {
            return Ok(());
        }
        let needed = Instant::now();
        let _part = MemoryPart::Gathered.enter();
        if !self.in_flight.iter().any(|(v, _, _)| *v == u) {
            self.issue(u, phase)?;
        }
        let at = self.in_flight.iter().position(|(v, _, _)| *v == u).expect("issued");
        let (_, work, entry) = self.in_flight.remove(at).expect("in flight");
        let (full, timing) = work.wait_timed()?;
        if let Some(times) = self.log.get_mut(entry) {
            times.needed = Some(needed);
            times.ran = Some((timing.started, timing.finished));
        }
        let unit = &self.units[u];
        let mut offset = 0;
        for &p in &unit.params {
            let value = self.vars[p].value();
            let n = value.numel();
            let own = full.narrow(0, offset, n)?.copy()?;
            value.restore_storage(own.lend_storage()?)?;
            offset += n;
        }
        self.units[u].gathered = true;
        Ok(())
    }

    /// Issues unit `u`'s all-gather for `phase` on the comm stream (its bytes count as gathered
    /// from now), logged in the pass under way.
    fn issue(&mut self, u: usize, phase: GatherPhase) -> Result<()> {
        let comm = self.comm.clone().expect("active");
        let _part = MemoryPart::Gathered.enter();
        let unit = &self.units[u];
        let shard = unit.shard.clone().expect("cut when the optimizer was built");
        let tag = format!("zero3.gather.{}", unit.name);
        let world = comm.world_size();
        let phase = if self.in_backward { GatherPhase::Backward } else { phase };
        let quantize = self.qwz && !self.exact && world > 1;
        let bytes = match quantize {
            true => world * quantized::chunk_bytes(shard.numel()),
            false => world * shard.numel() * self.param_dtype.size_in_bytes(),
        };
        self.log.push(GatherTimes {
            unit: unit.name.clone(),
            bytes,
            phase,
            issued: Instant::now(),
            needed: None,
            ran: None,
        });
        let work = match quantize {
            true => quantized::gather_weights(&comm, &shard, self.param_dtype, &tag)?,
            false => {
                // the shard rounded once to the parameters' dtype (an f32 shard as it is)
                let send = match shard.dtype() == self.param_dtype {
                    true => shard,
                    false => shard.to_dtype(self.param_dtype)?,
                };
                // into a buffer of our own: `all_gather` would consume the shard's storage
                let full = Tensor::zeros_on(&[world * send.numel()], self.param_dtype, send.device())?;
                comm.all_gather_into(&send, &full, &tag)
            }
        };
        self.in_flight.push_back((u, work, self.log.len() - 1));
        self.live += self.unit_bytes(u);
        self.peak = self.peak.max(self.live);
        Ok(())
    }

    /// Bytes of unit `u`'s parameters gathered (in the parameters' dtype).
    fn unit_bytes(&self, u: usize) -> usize {
        self.units[u].numel * self.param_dtype.size_in_bytes()
    }

    /// Issues the gathers of the next `prefetch` units after `u` in the pass's order (`step`:
    /// -1 in forward, the units' order; +1 in backward) that are neither gathered, in flight nor
    /// done, while the bytes in flight stay within the cap.
    fn prefetch_after(&mut self, u: usize, step: isize, phase: GatherPhase) -> Result<()> {
        let mut next = u as isize;
        for _ in 0..self.prefetch {
            next += step;
            if next < 0 || next as usize >= self.units.len() {
                return Ok(());
            }
            let v = next as usize;
            let unit = &self.units[v];
            if unit.gathered || unit.done || self.in_flight.iter().any(|(w, _, _)| *w == v) {
                continue;
            }
            let in_flight: usize = self.in_flight.iter().map(|(w, _, _)| self.unit_bytes(*w)).sum();
            if in_flight + self.unit_bytes(v) > self.prefetch_cap {
                return Ok(());
            }
            self.issue(v, phase)?;
        }
        Ok(())
    }

    /// Waits for the gathers still in flight and drops them (a pass ended without using them).
    fn drain(&mut self) -> Result<()> {
        let mut first = Ok(());
        while let Some((u, work, entry)) = self.in_flight.pop_front() {
            self.live -= self.unit_bytes(u);
            match work.wait_timed() {
                Ok((_, timing)) => {
                    if let Some(times) = self.log.get_mut(entry) {
                        times.ran = Some((timing.started, timing.finished));
                    }
                }
                Err(e) => first = first.and(Err(e)),
            }
        }
        first
    }

    /// Frees unit `u`'s parameters in place (their tensors stay, their storage goes).
    fn release(&mut self, u: usize) -> Result<()> {
        if !self.units[u].gathered {
            return Ok(());
        }
        for &p in &self.units[u].params {
            self.vars[p].value().free_storage()?;
        }
        self.units[u].gathered = false;
        self.live -= self.unit_bytes(u);
        Ok(())
    }

    fn release_all(&mut self) -> Result<()> {
        self.drain()?;
        (0..self.units.len()).try_for_each(|u| self.release(u))
    }

    /// The first forward's check: every parameter the graph reads lies in a unit it entered.
    fn check_coverage(&self, in_graph: &[usize]) -> Result<()> {
        for &p in in_graph {
            let Some(u) = self.unit_of.get(p).copied().flatten() else {
                continue;
            };
            let unit = &self.units[u];
            if !unit.entered {
                return Err(zero3_error(format!(
                    "parameter '{}' is read by the forward, but its unit's scope '{}' was never entered: the scopes \
                     must cover every parameter (run the ops that read it inside scope(\"{}\", ..), or set its unit to \
                     the scope that does)",
                    self.vars[p].name().unwrap_or("<unnamed>"),
                    unit.name,
                    unit.name
                )));
            }
        }
        Ok(())
    }
}

impl ScopeHooks for Gatherer {
    fn enter(&self, scope: &str) {
        self.record(|g| {
            let Some(u) = g.units.iter().position(|u| u.name == scope) else {
                return Ok(());
            };
            g.units[u].entered = true;
            if g.active() {
                g.gather(u, GatherPhase::Forward)?;
                g.prefetch_after(u, -1, GatherPhase::Forward)?;
            }
            Ok(())
        });
    }

    fn exit(&self, scope: &str) {
        self.record(|g| {
            let Some(u) = g.units.iter().position(|u| u.name == scope) else {
                return Ok(());
            };
            if g.active() {
                g.release(u)?;
            }
            Ok(())
        });
    }
}

impl GradSubscriber for Gatherer {
    fn backward_started(&self, in_graph: &[usize]) -> std::result::Result<(), SubscriberError> {
        self.take()?;
        let mut g = self.lock();
        if g.comm.is_none() {
            return Ok(());
        }
        g.in_backward = true;
        if g.unchecked {
            // after a probing forward the units stay gathered from the whole parameters; each
            // is freed when its backward ends, as in every later pass
            g.check_coverage(in_graph)?;
            g.unchecked = false;
            g.probing = false;
        }
        for u in &mut g.units {
            u.pending = 0;
            u.done = false;
            u.entered = false;
        }
        for &p in in_graph {
            if let Some(u) = g.unit_of.get(p).copied().flatten() {
                g.units[u].pending += 1;
            }
        }
        Ok(())
    }

    fn node_backward(&self, scope: Option<&str>, _op: &str) {
        self.record(|g| {
            let Some(u) = scope.and_then(|s| g.unit_in(s)) else {
                return Ok(());
            };
            if g.active() && !g.units[u].done && !g.units[u].gathered {
                g.gather(u, GatherPhase::Backward)?;
                g.prefetch_after(u, 1, GatherPhase::Backward)?;
            }
            Ok(())
        });
    }

    fn grad_ready(&self, ready: GradReady<'_>) -> std::result::Result<(), SubscriberError> {
        self.take()?;
        let mut g = self.lock();
        let Some(u) = g.unit_of.get(ready.index).copied().flatten() else {
            return Ok(());
        };
        if !g.active() {
            return Ok(());
        }
        let unit = &mut g.units[u];
        unit.pending = unit.pending.saturating_sub(1);
        if unit.pending == 0 {
            // every node that reads the unit's parameters has run: they are not needed again
            unit.done = true;
            g.release(u)?;
        }
        Ok(())
    }

    fn backward_finished(&self) -> std::result::Result<(), SubscriberError> {
        self.take()?;
        let mut g = self.lock();
        if g.active() {
            g.release_all()?;
        }
        g.in_backward = false;
        g.last_log = std::mem::take(&mut g.log);
        // the next forward prefetches every unit again
        for u in &mut g.units {
            u.done = false;
        }
        Ok(())
    }

    fn backward_aborted(&self) {
        self.record(|g| {
            g.in_backward = false;
            g.log.clear();
            for u in &mut g.units {
                u.done = false;
            }
            if g.active() {
                g.release_all()
            } else {
                Ok(())
            }
        });
    }
}

impl ParamHooks for Gatherer {
    fn gather_all(&self) -> Result<()> {
        let mut g = self.lock();
        if let Some(e) = g.error.take() {
            return Err(e);
        }
        if !g.active() {
            return Ok(());
        }
        g.exact = true;
        let gathered = (0..g.units.len()).try_for_each(|u| g.gather(u, GatherPhase::Forward));
        g.exact = false;
        gathered?;
        // not a pass's: a step profile does not record them
        g.log.clear();
        g.summoned = true;
        Ok(())
    }

    fn release_all(&self) -> Result<()> {
        let mut g = self.lock();
        if !g.summoned {
            return Ok(());
        }
        g.summoned = false;
        g.release_all()
    }

    fn gathers(&self) -> Vec<GatherTimes> {
        self.lock().last_log.clone()
    }

    fn take_error(&self) -> Option<SubscriberError> {
        self.take().err()
    }
}

/// The ZeRO-3 reducer policy (see the module docs): `PolicySpec` `zero3`, `--zero 3`.
pub struct Zero3 {
    hooks: Arc<Gatherer>,
    world: AtomicUsize,
    options: ZeroPlusPlus,
    /// qgZ's rounding draws.
    qgz: QgzState,
}

impl Default for Zero3 {
    fn default() -> Self {
        Self::new()
    }
}

/// The most bytes of parameters that [`Zero3`] prefetches at once by default (FSDP limits its
/// all-gathers in flight in the same spirit).
pub const DEFAULT_PREFETCH_CAP_BYTES: usize = 64 << 20;

impl Zero3 {
    /// Gathers each unit `depth` units ahead (forward order in forward, reverse in backward;
    /// default 1, 0 for none), the next unit's gather running on the comm stream while the
    /// current one computes, with at most `cap_bytes` of prefetched parameters in flight. Every
    /// rank must use the same settings.
    pub fn with_prefetch(self, depth: usize, cap_bytes: usize) -> Zero3 {
        {
            let mut g = self.hooks.lock();
            g.prefetch = depth;
            g.prefetch_cap = cap_bytes;
        }
        self
    }

    /// ZeRO++'s quantized gathers (qwZ) and reductions (qgZ), see [`quantized`]; on one rank
    /// nothing is sent, so nothing is quantized. Every rank must use the same options.
    pub fn with_options(mut self, options: ZeroPlusPlus) -> Zero3 {
        self.hooks.lock().qwz = options.qwz;
        self.options = options;
        self
    }

    /// ZeRO-3 over the units the model's parameters name.
    pub fn new() -> Zero3 {
        Zero3 {
            hooks: Arc::new(Gatherer {
                state: Mutex::new(Gather {
                    units: vec![],
                    unit_of: vec![],
                    vars: vec![],
                    comm: None,
                    probing: true,
                    unchecked: true,
                    summoned: false,
                    live: 0,
                    peak: 0,
                    last_peak: 0,
                    error: None,
                    in_flight: VecDeque::new(),
                    log: vec![],
                    in_backward: false,
                    last_log: vec![],
                    prefetch: 1,
                    prefetch_cap: DEFAULT_PREFETCH_CAP_BYTES,
                    param_dtype: DType::F32,
                    qwz: false,
                    exact: false,
                }),
            }),
            world: AtomicUsize::new(0),
            options: ZeroPlusPlus::default(),
            qgz: QgzState::default(),
        }
    }
}

/// The units of `ctx`'s trainable parameters, in the order they are first registered, each with
/// its parameters in registration order; an error for a parameter without a unit and for units
/// that nest (a scope's parameters would be gathered twice).
fn units_of(ctx: &PolicyContext) -> Result<Vec<(String, Vec<usize>)>> {
    let mut units: Vec<(String, Vec<usize>)> = vec![];
    for (i, p) in ctx.params.iter().enumerate().filter(|(_, p)| p.trainable) {
        let Some(unit) = &p.unit else {
            return Err(zero3_error(format!(
                "parameter '{}' belongs to no unit, so ZeRO-3 cannot tell when to gather it: name the scope whose \
                 forward reads it (ParamStore::set_unit)",
                p.name
            )));
        };
        match units.iter_mut().find(|(n, _)| n == unit) {
            Some((_, ps)) => ps.push(i),
            None => units.push((unit.clone(), vec![i])),
        }
    }
    let names: BTreeMap<&str, ()> = units.iter().map(|(n, _)| (n.as_str(), ())).collect();
    for (n, _) in &units {
        if let Some(outer) = names
            .keys()
            .find(|o| n.len() > o.len() && n.starts_with(**o) && n.as_bytes()[o.len()] == b'.')
        {
            return Err(zero3_error(format!(
                "unit '{n}' lies inside unit '{outer}': the scope '{n}' would be gathered twice (once for each); \
                 give its parameters the unit '{outer}' or make the units disjoint"
            )));
        }
    }
    Ok(units)
}

impl ReducerPolicy for Zero3 {
    fn name(&self) -> String {
        self.options.spec().to_string()
    }

    /// The master shards are the optimizer's parameters, saved with the model and the
    /// optimizer state: nothing of the policy's own but qgZ's draw counter.
    fn keeps_state(&self) -> brigade_ddp::KeepsState {
        match self.options.qgz {
            true => brigade_ddp::KeepsState::InStateDict,
            false => brigade_ddp::KeepsState::Nothing,
        }
    }

    fn state_dict(&self) -> Result<Vec<(String, Tensor)>> {
        Ok(match self.options.qgz {
            true => self.qgz.state_dict(),
            false => vec![],
        })
    }

    fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> Result<()> {
        if self.options.qgz {
            self.qgz = QgzState::load(state)?;
        }
        Ok(())
    }

    fn layout(&self, ctx: &PolicyContext) -> BucketLayout {
        self.world.store(ctx.world_size, Ordering::Relaxed);
        BucketLayout {
            pad_to: ctx.world_size.max(1),
            dtype: ctx.reduce_dtype(),
            regroup: false,
        }
    }

    /// One bucket per unit, the last unit first (backward order), each unit's parameters in
    /// reverse registration order (the order their gradients become final).
    fn bucket_groups(&self, ctx: &PolicyContext) -> Result<Option<Vec<Vec<usize>>>> {
        let units = units_of(ctx)?;
        let groups: Vec<Vec<usize>> = units
            .iter()
            .rev()
            .map(|(_, ps)| ps.iter().rev().copied().collect())
            .collect();
        let mut g = self.hooks.lock();
        g.unit_of = vec![None; ctx.params.len()];
        g.units = units
            .iter()
            .rev()
            .zip(&groups)
            .enumerate()
            .map(|(b, ((name, _), group))| {
                for &p in group {
                    g.unit_of[p] = Some(b);
                }
                Unit {
                    name: name.clone(),
                    params: group.clone(),
                    numel: group
                        .iter()
                        .map(|&p| ctx.params[p].shape.iter().product::<usize>())
                        .sum(),
                    shard: None,
                    gathered: true,
                    pending: 0,
                    done: false,
                    entered: false,
                }
            })
            .collect();
        Ok(Some(groups))
    }

    fn param_hooks(&self) -> Option<Arc<dyn ParamHooks>> {
        Some(self.hooks.clone())
    }

    /// Each rank draws its shard of every unit from the recipes of parameters not drawn yet
    /// (see the module docs).
    fn starts_sharded(&self) -> bool {
        true
    }

    fn reduce(&mut self, bucket: PolicyBucket, comm: &Group) -> Result<Reduction> {
        let shard = match self.options.qgz && comm.world_size() > 1 {
            true => quantized::reduce_gradients(comm, &bucket.tensor, &mut self.qgz, &bucket.tag())?,
            false => comm.reduce_scatter(&bucket.tensor, ReduceOp::Avg, &bucket.tag()),
        };
        Ok(Reduction::Shard {
            shard,
            keep_full: false,
        })
    }

    /// Cuts this rank's f32 shard of every unit from the (whole, broadcast) parameters, or
    /// beside 16-bit parameters from `full`'s f32 master weights (dropping `full` frees the rest
    /// of them), frees the parameter tensors' storage after the first forward, and steps the
    /// shards only.
    fn optimizer(
        &mut self,
        full: Box<dyn Optimizer>,
        build: BuildOptimizer<'_>,
        ctx: &OptimizerContext,
    ) -> Result<Box<dyn Optimizer>> {
        let world = ctx.comm.world_size();
        let params = ctx.buckets.params().to_vec();
        let spans = ctx.buckets.spans();
        let mut g = self.hooks.lock();
        if g.comm.is_some() {
            return Err(zero3_error(
                "its optimizer was built already: the shards are the parameters, so build it once".into(),
            ));
        }
        for (b, span) in spans.iter().enumerate() {
            let unit = &g.units[b];
            if span.params.iter().map(|p| p.index).ne(unit.params.iter().copied()) {
                return Err(zero3_error(format!("DDP's bucket {b} is not unit '{}'", unit.name)));
            }
        }
        // a sharded start: the trainable parameters were never whole, so nothing is gathered
        // and the first forward gathers each unit as every later one does
        let started_sharded = g
            .units
            .iter()
            .flat_map(|u| &u.params)
            .any(|&p| params[p].deferred_init().is_some());
        let built = build_shards(ctx, &self.name(), full.as_ref(), build, &spans, &params);
        let (masters, opt) = agree_on_shards(&ctx.comm, built, started_sharded)?;
        for (unit, master) in g.units.iter_mut().zip(&masters) {
            unit.shard = Some(master.clone());
        }
        g.param_dtype = params.first().map_or(DType::F32, |p| p.value().dtype());
        // under qwZ the first forward gathers too: a resumed run's first step reads as the straight run's
        let gather_first = started_sharded || (g.qwz && world > 1);
        for (i, param) in params.iter().enumerate() {
            match g.unit_of.get(i).copied().flatten() {
                // its shard is drawn: the tensor stays without storage until a gather
                Some(_) => {
                    param.end_deferral();
                    if gather_first && param.value().storage_numel() > 0 {
                        param.value().free_storage()?;
                    }
                }
                // frozen: whole on every rank
                None => param.materialize()?,
            }
        }
        g.vars = params;
        g.comm = Some(ctx.comm.clone());
        g.probing = !gather_first;
        g.unchecked = true;
        for u in &mut g.units {
            u.gathered = !gather_first;
        }
        g.live = (0..g.units.len())
            .filter(|&u| g.units[u].gathered)
            .map(|u| g.unit_bytes(u))
            .sum();
        g.peak = g.live;
        Ok(Box::new(opt))
    }

    /// The shards are the parameters held between steps; beside 16-bit parameters they are the
    /// f32 master weights instead, which the optimizer counts (each storage once).
    fn memory(&self) -> PolicyMemory {
        let g = self.hooks.lock();
        let shards = match g.param_dtype {
            DType::F32 => g
                .units
                .iter()
                .filter_map(|u| u.shard.as_ref())
                .map(|s| s.numel() * DType::F32.size_in_bytes())
                .sum(),
            _ => 0,
        };
        PolicyMemory {
            parameter_bytes: shards,
            gathered_bytes: g.last_peak,
            ..PolicyMemory::default()
        }
    }

    fn after_step(&mut self, _step: &StepContext<'_>, _comm: &Group) -> Result<()> {
        let mut g = self.hooks.lock();
        if let Some(e) = g.error.take() {
            return Err(e);
        }
        // a gather issued before the step holds the old values
        g.drain()?;
        g.log.clear();
        g.last_peak = g.peak;
        g.peak = g.live;
        Ok(())
    }

    fn wire_model(&self, _shapes: &[Vec<usize>], _world_size: usize) -> Option<WireModel> {
        Some(WireModel::Zero3 {
            quantized_gradients: self.options.qgz.then_some(quantized::BLOCK),
            quantized_gathers: self.options.qwz.then_some(quantized::BLOCK),
        })
    }
}

/// This rank's f32 shard of every unit (the masters), cut from the parameters or beside 16-bit
/// parameters from `full`'s f32 master weights, and the optimizer that steps them, its state
/// cut from `full`'s; the errors name the policy `policy` (its spec).
fn build_shards(
    ctx: &OptimizerContext,
    policy: &str,
    full: &dyn Optimizer,
    build: BuildOptimizer<'_>,
    spans: &[BucketSpan],
    params: &[Var],
) -> Result<(Vec<Tensor>, ZeroOptimizer)> {
    let part = MemoryPart::Parameters.enter();
    let whole_masters = full.master_weights();
    let masters = match whole_masters.is_empty() {
        // mixed precision: the masters are f32 beside the 16-bit parameters
        false => super::master_shards(ctx, policy, &whole_masters)?,
        true => own_master_shards(policy, spans, params, ctx.comm.world_size(), ctx.comm.rank())?,
    };
    drop(whole_masters);
    // the optimizer's state is its own part
    drop(part);
    let opt = ZeroOptimizer::new(
        ctx,
        policy.to_string(),
        ZeroStage::Three,
        Arc::default(),
        full,
        build,
        usize::MAX,
        Some(masters.clone()),
    )?;
    Ok((masters, opt))
}

/// `built` (this rank's shards and their optimizer), once every rank has built its own: under
/// a sharded start each rank reads only its ranges of the recipes or of a file (`--init`, a
/// resumed checkpoint), so a rank may fail alone (a NaN in its range), and the others stop
/// with it, told which rank failed, rather than wait for it at the next collective.
fn agree_on_shards<T>(comm: &Group, built: Result<T>, started_sharded: bool) -> Result<T> {
    if !started_sharded || comm.world_size() < 2 {
        return built;
    }
    let rank = comm.rank();
    // the highest failed rank, plus one (0: none failed)
    let mine = if built.is_err() { rank as f32 + 1.0 } else { 0.0 };
    let tag = "zero3.shards_built";
    let failed = comm
        .all_reduce(&Tensor::from_vec(vec![mine], &[1])?, ReduceOp::Max, tag)
        .wait()?
        .item()?;
    match built {
        Ok(_) if failed > 0.0 => Err(DdpError::Comm(brigade_comm::CommError::RankFailed {
            rank: failed as usize - 1,
            tag: tag.into(),
            reason: "it could not draw or read its shards of the parameters or of the optimizer state".into(),
        })),
        built => built,
    }
}

/// This rank's f32 shard of every unit, cut from the (whole, broadcast) parameters; a
/// parameter not drawn yet has only this rank's piece of it drawn.
fn own_master_shards(
    policy: &str,
    spans: &[BucketSpan],
    params: &[Var],
    world: usize,
    rank: usize,
) -> Result<Vec<Tensor>> {
    let mut masters = vec![];
    for span in spans {
        let per = shard_len(span.grad_numel, world);
        let device = params[span.params[0].index].value().device();
        let master = Tensor::zeros_on(&[per], DType::F32, device)?;
        let flat: Vec<(usize, usize)> = span.params.iter().map(|p| (p.index, p.len())).collect();
        for piece in pieces(&flat, world, rank) {
            let param = &params[piece.param];
            // a parameter not drawn yet: only this rank's piece of it is drawn
            let values = match param.deferred_init() {
                Some(init) => (init.draw(piece.param_offset, piece.len))
                    .map_err(|source| DdpError::InitialValues {
                        policy: policy.into(),
                        param: param.name().unwrap_or("?").into(),
                        shape: param.shape().to_vec(),
                        source,
                    })?
                    .to_device(device)?,
                None => param.value().flat_view(piece.param_offset, &[piece.len])?,
            };
            master.narrow(0, piece.shard_offset, piece.len)?.copy_from(&values)?;
        }
        masters.push(master);
    }
    Ok(masters)
}
