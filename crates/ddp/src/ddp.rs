//! `DistributedDataParallel`: the user-facing wrapper.

use std::sync::Arc;

use brigade_autograd::{AutogradError, GradBus, GradSubscriber, Optimizer, ParamStore, Var};
use brigade_comm::{all_gather_bytes, CommStream, Communicator, Transport};
use brigade_tensor::Tensor;

use crate::memory::{self, MemoryReport};

use crate::group::{Group, HostGroup};
use crate::policy::{
    state, AfterStepWire, Buckets, BuildOptimizer, HeldGrad, LossScaleStep, OptimizerContext, ParamHooks,
    PolicyDiagnostic, ReducerPolicy, Replicas, StepContext, WireModel,
};
use crate::reducer::{BucketGrouping, PassTimes, Reducer};
use crate::signature::{adopt_rank0_recipes, broadcast_parameters, check_f32, check_same_model};
use crate::{DdpConfig, DdpError, Result};

/// One bucket as built: which parameters, how many bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct BucketInfo {
    /// Position in launch order.
    pub index: usize,
    /// Parameter names in the order their gradients sit in the flat buffer.
    pub params: Vec<String>,
    /// Size of the flat buffer (padding included).
    pub bytes: usize,
}

/// Wraps one rank's model replica: gradients become views into flat buckets, and each bucket
/// is handed to the rank's reducer policy ([`ReducerPolicy`]: PyTorch's communication hook and
/// ZeRO as one contract) as soon as backward has produced all of its gradients, while backward
/// goes on with earlier layers. `backward()` returns once every bucket's reduction landed, so
/// the optimizer step that follows ([`DistributedDataParallel::optimizer`]) sees the result.
///
/// Construction is a collective: every rank must call it, with the same model and a policy of
/// the same kind.
pub struct DistributedDataParallel {
    reducer: Arc<Reducer>,
    bus: GradBus,
    subscriber: Arc<dyn GradSubscriber>,
    /// The policy's hooks around the parameters' uses (ZeRO-3), installed on the thread that
    /// built DDP.
    param_hooks: Option<Arc<dyn ParamHooks>>,
}

impl DistributedDataParallel {
    /// Checks that every rank holds the same parameters (names, shapes, dtypes, which ones
    /// require grad), broadcasts rank 0's values, builds the buckets of the parameters that
    /// require grad as `policy` lays them out (frozen ones are left out: freeze before
    /// wrapping) and subscribes to the store's gradient-ready bus. Collectives run on the host
    /// group over the rank's comm stream `comm` (traced or simulated as the stream is), which
    /// also carries the model check, the parameter broadcast and the bucket rebuild. Parameters
    /// whose values are not drawn yet are drawn whole here, unless the policy starts sharded
    /// ([`ReducerPolicy::starts_sharded`]): then each rank takes rank 0's recipes of them (with
    /// the broadcast), and the policy draws its shards.
    pub fn new<T: Transport>(
        store: &ParamStore,
        comm: Arc<CommStream<T>>,
        cfg: DdpConfig,
        policy: Box<dyn ReducerPolicy>,
    ) -> Result<Self> {
        let group = Arc::new(HostGroup::new(comm.clone()));
        Self::with_group(store, comm, group, cfg, policy)
    }

    /// Like [`DistributedDataParallel::new`], with the policy's collectives on `group` (the
    /// collective contract, [`crate::group`]): e.g. NCCL's device group on the GPU, or a
    /// [`crate::group::Recording`] of the host group in tests. `comm` still carries the
    /// model check, the parameter broadcast and the bucket rebuild.
    pub fn with_group(
        store: &ParamStore,
        comm: Arc<dyn Communicator>,
        group: Group,
        cfg: DdpConfig,
        policy: Box<dyn ReducerPolicy>,
    ) -> Result<Self> {
        let caps_ok = |mb: f64| mb > 0.0 && mb.is_finite();
        if !(caps_ok(cfg.bucket_cap_mb) && caps_ok(cfg.first_bucket_cap_mb)) {
            return Err(DdpError::BucketCap {
                bucket_cap_mb: cfg.bucket_cap_mb,
                first_bucket_cap_mb: cfg.first_bucket_cap_mb,
            });
        }
        let params = store.params().to_vec();
        check_same_model(&params, comm.as_ref())?;
        check_f32(&params)?;
        if cfg.broadcast_parameters {
            broadcast_parameters(&params, comm.as_ref())?;
            adopt_rank0_recipes(&params, comm.as_ref())?;
        }
        // drawn from rank 0's recipes: rank 0's values, with nothing whole sent
        if !policy.starts_sharded() {
            params.iter().try_for_each(Var::materialize)?;
        }
        let units = (0..params.len()).map(|i| store.unit(i).map(str::to_string)).collect();
        let reducer = Arc::new(Reducer::new(params, comm, group, cfg, policy, units)?);
        let subscriber: Arc<dyn GradSubscriber> = reducer.clone();
        store.bus().subscribe(subscriber.clone());
        let param_hooks = reducer.lock_policy().param_hooks();
        if let Some(hooks) = &param_hooks {
            store.bus().subscribe(hooks.clone());
            brigade_autograd::set_scope_hooks(Some(hooks.clone()));
        }
        Ok(DistributedDataParallel {
            reducer,
            bus: store.bus().clone(),
            subscriber,
            param_hooks,
        })
    }

    /// Runs `f` (forward and backward of microbatches) without communicating: gradients
    /// accumulate locally in the bucket views. The first backward after it reduces the
    /// accumulated sum. With k microbatches, scale each loss by 1/k for the mean.
    pub fn no_sync<R>(&self, f: impl FnOnce() -> R) -> R {
        /// Restores the previous mode even if `f` panics.
        struct Restore<'a>(&'a Reducer, bool);
        impl Drop for Restore<'_> {
            fn drop(&mut self) {
                self.0.lock().sync = self.1;
            }
        }
        let prev = std::mem::replace(&mut self.reducer.lock().sync, false);
        let _restore = Restore(&self.reducer, prev);
        f()
    }

    /// Runs `f` (forward and backward of a microbatch after the step's first) as a
    /// synchronized pass whose reduced shards add into the ones the passes before it left:
    /// each bucket is reduced as it fills and its full buffer freed, as in a step of one
    /// microbatch, and the rank's gradient shard accumulates the microbatches (in the order
    /// they ran: another summation order than `no_sync`'s full buffers, equal within rounding).
    /// Run the step's first microbatch as a plain synchronized pass; with k microbatches,
    /// scale each loss by 1/k for the mean. Only for a policy that reduces each bucket to a
    /// shard and frees its full buffer (ZeRO-2, ZeRO-3): under another, the pass fails with
    /// [`DdpError::Policy`] once a bucket lands.
    pub fn accumulate_into_shard<R>(&self, f: impl FnOnce() -> R) -> R {
        /// Ends the accumulation even if `f` panics.
        struct Restore<'a>(&'a Reducer);
        impl Drop for Restore<'_> {
            fn drop(&mut self) {
                self.0.lock().into_shard = false;
            }
        }
        self.reducer.lock().into_shard = true;
        let _restore = Restore(&self.reducer);
        f()
    }

    /// Takes part in a step without data (uneven inputs, PyTorch's `Join`): instead of a
    /// backward pass, every bucket is reduced from zeros through the policy's
    /// [`ReducerPolicy::reduce_joined`], so this rank issues the collectives the ranks with data
    /// issue in their backward, and their result (their sum divided by the group's size) lands
    /// here too. Step the optimizer afterwards as usual: every rank keeps the same parameters.
    pub fn join(&self) -> Result<()> {
        self.reducer.join_pass()
    }

    /// The buckets in launch order.
    pub fn buckets(&self) -> Vec<BucketInfo> {
        let st = self.reducer.lock();
        st.buckets
            .iter()
            .enumerate()
            .map(|(i, b)| BucketInfo {
                index: i,
                params: b
                    .params
                    .iter()
                    .map(|&p| self.reducer.params[p].name().unwrap_or("<unnamed>").to_string())
                    .collect(),
                bytes: b.bytes(),
            })
            .collect()
    }

    /// When things happened in the last synchronized backward pass (ready times, bucket
    /// launches, their collectives' times and wire bytes): what a step profile is made of.
    pub fn last_pass(&self) -> PassTimes {
        self.reducer.lock().pass.clone()
    }

    /// Regroups the buckets under new caps, keeping their parameter order (rank 0's ready order
    /// once rebuilt), e.g. when the autotuner picks another cap. Not a collective:
    /// every rank must call it with the same caps between the same two steps (the autotuner
    /// broadcasts rank 0's choice), and then every rank holds the same buckets. Gradients keep
    /// their values; only between backward passes; refused when the policy fixes its layout.
    pub fn set_bucket_caps(&self, bucket_cap_mb: f64, first_bucket_cap_mb: f64) -> Result<()> {
        let caps_ok = |mb: f64| mb > 0.0 && mb.is_finite();
        if !(caps_ok(bucket_cap_mb) && caps_ok(first_bucket_cap_mb)) {
            return Err(DdpError::BucketCap {
                bucket_cap_mb,
                first_bucket_cap_mb,
            });
        }
        let mut st = self.reducer.lock();
        self.reducer.set_caps(&mut st, (bucket_cap_mb, first_bucket_cap_mb))
    }

    /// The bucket caps in effect, in MiB: (every bucket but the first, the first).
    pub fn bucket_caps(&self) -> (f64, f64) {
        self.reducer.lock().caps
    }

    /// Whether the policy lets DDP regroup its buckets (rebuild, new caps).
    pub fn buckets_can_change(&self) -> bool {
        self.reducer.layout.regroup
    }

    /// This rank's communicator (the one the buckets are reduced over).
    pub(crate) fn comm(&self) -> &Arc<dyn Communicator> {
        &self.reducer.comm
    }

    /// The parameters, in registration order.
    pub(crate) fn params(&self) -> &[Var] {
        &self.reducer.params
    }

    /// True once the buckets were rebuilt from the observed ready order.
    pub fn buckets_rebuilt(&self) -> bool {
        self.reducer.lock().rebuilt
    }

    /// The buckets' grouping once DDP regrouped them (after the first iteration, or under new
    /// caps), for a checkpoint: a resume built with it ([`DdpConfig::grouping`](crate::DdpConfig::grouping)) reduces
    /// on the same buckets. `None` while the buckets are still the ones construction grouped,
    /// and under a policy that fixes its buckets: a fresh DDP builds the same ones.
    pub fn bucket_grouping(&self) -> Option<BucketGrouping> {
        self.reducer.grouping()
    }

    /// The order (parameter names) in which gradients became ready in the last
    /// synchronized backward.
    pub fn last_ready_order(&self) -> Vec<String> {
        let st = self.reducer.lock();
        st.ready_order
            .iter()
            .map(|&p| self.reducer.params[p].name().unwrap_or("<unnamed>").to_string())
            .collect()
    }

    /// The policy's name (`allreduce`, `powersgd:4@10`, `zero2`, a user's).
    pub fn policy_name(&self) -> String {
        self.reducer.policy_name.clone()
    }

    /// How the overlap model costs the policy's collectives (`None`: it cannot), and what it
    /// sends after the step.
    pub(crate) fn wire_model(&self) -> (Option<WireModel>, Option<AfterStepWire>) {
        let shapes: Vec<Vec<usize>> = self.reducer.params.iter().map(|p| p.shape()).collect();
        let world = self.reducer.comm.world_size();
        let policy = self.reducer.lock_policy();
        (
            policy.wire_model(&shapes, world),
            policy.after_step_wire(&shapes, world),
        )
    }

    /// What the policy wants its caller to know about the run so far (e.g. that PowerSGD never
    /// compressed).
    pub fn policy_diagnostics(&self) -> Vec<PolicyDiagnostic> {
        self.reducer.lock_policy().diagnostics()
    }

    /// The optimizer to step: the policy builds it ([`ReducerPolicy::optimizer`]) from `full`,
    /// the user's optimizer over every parameter (its state, e.g. loaded from a checkpoint, and
    /// learning rate carry over), and `build`, which makes another of the same kind over other
    /// parameters (ZeRO's shard views). Its [`Optimizer::step`] steps it and then runs the
    /// policy's [`ReducerPolicy::after_step`]; [`Optimizer::set_lr`] reaches every part of it.
    pub fn optimizer(&self, full: Box<dyn Optimizer>, build: BuildOptimizer<'_>) -> Result<DdpOptimizer> {
        let ctx = OptimizerContext {
            buckets: self.bucket_view(),
            comm: self.reducer.metered(),
        };
        // the policy's optimizer state (a policy names its own parts inside, e.g. ZeRO-3's shards)
        let inner = {
            let _part = crate::peak_parts::MemoryPart::Optimizer.enter();
            self.reducer.lock_policy().optimizer(full, build, &ctx)?
        };
        Ok(DdpOptimizer {
            inner,
            reducer: self.reducer.clone(),
            after_steps: Default::default(),
        })
    }

    /// The live view of the buckets a policy reads.
    fn bucket_view(&self) -> Buckets {
        Buckets {
            source: self.reducer.clone(),
        }
    }

    /// The squared L2 norm of the reduced gradients, over every rank's shards when the policy
    /// shards them ([`ReducerPolicy::grad_norm_sq`]; for global gradient clipping). A
    /// collective under a sharding policy: every rank calls it after the same backward.
    pub fn grad_norm_sq(&self) -> Result<f64> {
        let buckets = self.bucket_view();
        let n = self.reducer.lock().buckets.len();
        let held: Vec<HeldGrad> = (0..n).map(|b| buckets.held(b)).collect::<Result<_>>()?;
        self.reducer.lock_policy().grad_norm_sq(&held, &self.reducer.metered())
    }

    /// Multiplies the reduced gradients this rank holds by `factor`, in place: the whole
    /// gradients, or this rank's shard of them under a sharding policy (what its optimizer
    /// steps). Global gradient clipping, after [`DistributedDataParallel::grad_norm_sq`].
    pub fn scale_grads(&self, factor: f64) -> Result<()> {
        let buckets = self.bucket_view();
        let n = self.reducer.lock().buckets.len();
        for b in 0..n {
            let t = match buckets.held(b)? {
                HeldGrad::Full(t) => t,
                HeldGrad::Shard { tensor, .. } => tensor,
            };
            t.copy_from(&t.mul_scalar(factor)?)?;
        }
        Ok(())
    }

    /// This rank's policy state ([`ReducerPolicy::state_dict`]) for a checkpoint: refused for a
    /// policy that does not declare its state ([`crate::policy::check_checkpointable`]).
    pub fn policy_state_dict(&self) -> Result<Vec<(String, Tensor)>> {
        let policy = self.reducer.lock_policy();
        crate::policy::check_checkpointable(&**policy)?;
        policy.state_dict()
    }

    /// Finishes the collectives the policy holds across steps ([`ReducerPolicy::finish_in_flight`]),
    /// waiting at most the group's timeout: every rank calls it before a checkpoint gathers the
    /// policy state.
    pub fn finish_in_flight(&self) -> Result<()> {
        let timeout = self.reducer.metered().timeout();
        self.reducer.lock_policy().finish_in_flight(timeout)
    }

    /// Restores this rank's policy state ([`ReducerPolicy::load_state_dict`]).
    pub fn load_policy_state_dict(&self, state: &[(String, Tensor)]) -> Result<()> {
        self.reducer.lock_policy().load_state_dict(state)
    }

    /// Every rank's policy state, on rank 0, for a checkpoint written by rank 0: entries
    /// `rank{r}/{name}` (a policy's state differs per rank: PowerSGD's error feedback). A
    /// collective; the other ranks get an empty list. The collectives the policy holds across
    /// steps are finished first ([`DistributedDataParallel::finish_in_flight`]).
    pub fn gather_policy_state(&self) -> Result<Vec<(String, Tensor)>> {
        self.finish_in_flight()?;
        let mine = state::encode(&self.policy_state_dict()?)?;
        let all = all_gather_bytes(self.comm().as_ref(), mine, "ddp.policy_state")?;
        if self.comm().rank() != 0 {
            return Ok(vec![]);
        }
        let mut out = vec![];
        for (r, bytes) in all.iter().enumerate() {
            out.extend(
                state::decode(bytes)?
                    .into_iter()
                    .map(|(k, t)| (format!("rank{r}/{k}"), t)),
            );
        }
        Ok(out)
    }

    /// Restores this rank's part of what [`DistributedDataParallel::gather_policy_state`] gave
    /// rank 0 (every rank reads the same checkpoint). Not a collective.
    pub fn load_gathered_policy_state(&self, all: &[(String, Tensor)]) -> Result<()> {
        let prefix = format!("rank{}/", self.comm().rank());
        let world = self.comm().world_size();
        if let Some((k, _)) = all.iter().find(|(k, _)| rank_of(k).is_none_or(|r| r >= world)) {
            return Err(DdpError::PolicyState(format!(
                "entry '{k}' belongs to no rank of a group of {world}: the policy state was saved by another group size"
            )));
        }
        let mine: Vec<(String, Tensor)> = all
            .iter()
            .filter_map(|(k, t)| k.strip_prefix(&prefix).map(|k| (k.to_string(), t.clone())))
            .collect();
        self.load_policy_state_dict(&mine)
    }

    /// Whether the policy's ranks hold the same parameters and optimizer state after every step
    /// ([`ReducerPolicy::replicas`]).
    pub fn replicas(&self) -> Replicas {
        self.reducer.lock_policy().replicas()
    }

    /// Every rank's own parameters and optimizer state, on rank 0, for a checkpoint written by
    /// rank 0, when the policy lets them diverge between syncs ([`Replicas::Diverge`]; what its
    /// [`crate::RankState`] names): entries `rank{r}/params/{name}` (the f32 master weights `opt`
    /// keeps beside 16-bit parameters, else the parameters) and `rank{r}/optimizer/{key}`
    /// (`opt`'s state dict). A collective then; the other ranks get an empty list. Under
    /// [`Replicas::Identical`] empty on every rank, with no collective (every rank answers
    /// alike); refused under [`Replicas::DivergeUnsaved`].
    pub fn gather_rank_state(&self, opt: &dyn Optimizer) -> Result<Vec<(String, Tensor)>> {
        let keep = {
            let policy = self.reducer.lock_policy();
            crate::policy::check_checkpointable(&**policy)?;
            match policy.replicas() {
                Replicas::Diverge(keep) => keep,
                _ => return Ok(vec![]),
            }
        };
        let mut mine = vec![];
        if keep.params {
            let weights = match opt.master_weights() {
                masters if masters.is_empty() => self.params().iter().enumerate().map(named_value).collect(),
                masters => masters,
            };
            mine.extend(weights.into_iter().map(|(n, t)| (format!("{RANK_PARAMS}{n}"), t)));
        }
        if keep.optimizer {
            let state = opt.state_dict()?;
            mine.extend(state.into_iter().map(|(k, t)| (format!("{RANK_OPTIMIZER}{k}"), t)));
        }
        let all = all_gather_bytes(self.comm().as_ref(), state::encode(&mine)?, "ddp.rank_state")?;
        if self.comm().rank() != 0 {
            return Ok(vec![]);
        }
        let mut out = vec![];
        for (r, bytes) in all.iter().enumerate() {
            out.extend(
                state::decode(bytes)?
                    .into_iter()
                    .map(|(k, t)| (format!("rank{r}/{k}"), t)),
            );
        }
        Ok(out)
    }

    /// Restores this rank's part of what [`DistributedDataParallel::gather_rank_state`] gave rank
    /// 0 (every rank reads the same checkpoint): its parameters (and the f32 master weights `opt`
    /// keeps beside 16-bit parameters, the parameters their rounding) and `opt`'s state. Call it
    /// after construction, which broadcast rank 0's parameters, and before
    /// [`DistributedDataParallel::optimizer`], which is handed `opt` (the module docs of
    /// [`crate::policy`] give the whole load order). Entries of a rank outside this group (a
    /// checkpoint of another number of ranks) are refused. Not a collective.
    pub fn load_rank_state(&self, all: &[(String, Tensor)], opt: &mut dyn Optimizer) -> Result<()> {
        let (rank, world) = (self.comm().rank(), self.comm().world_size());
        if let Some((k, _)) = all.iter().find(|(k, _)| rank_of(k).is_none_or(|r| r >= world)) {
            return Err(DdpError::RankState(format!(
                "entry '{k}' belongs to no rank of a group of {world}: it was saved by another number of ranks"
            )));
        }
        let prefix = format!("rank{rank}/");
        let mine = || all.iter().filter_map(|(k, t)| Some((k.strip_prefix(&prefix)?, t)));
        let params: Vec<(&str, &Tensor)> = mine()
            .filter_map(|(k, t)| Some((k.strip_prefix(RANK_PARAMS)?, t)))
            .collect();
        if !params.is_empty() {
            self.load_rank_params(rank, &params, opt)?;
        }
        let optimizer: Vec<(String, Tensor)> = mine()
            .filter_map(|(k, t)| Some((k.strip_prefix(RANK_OPTIMIZER)?.to_string(), t.clone())))
            .collect();
        if !optimizer.is_empty() {
            let device = self.params().first().map(|p| p.value().device());
            let on_device = (optimizer.into_iter())
                .map(|(k, t)| match device {
                    Some(d) => Ok((k, t.to_device(d)?)),
                    None => Ok((k, t)),
                })
                .collect::<Result<Vec<_>>>()?;
            opt.load_state_dict(&on_device)?;
        }
        Ok(())
    }

    /// Writes rank `rank`'s saved `params` (every parameter's, by name) into the parameters, or
    /// into `opt`'s master weights and their rounding into the parameters.
    fn load_rank_params(&self, rank: usize, params: &[(&str, &Tensor)], opt: &dyn Optimizer) -> Result<()> {
        let masters: std::collections::HashMap<String, Tensor> = opt.master_weights().into_iter().collect();
        let saved: std::collections::HashMap<&str, &Tensor> = params.iter().copied().collect();
        let ours: Vec<(String, Tensor)> = self.params().iter().enumerate().map(named_value).collect();
        if let Some((name, _)) = params.iter().find(|(n, _)| !ours.iter().any(|(o, _)| o == n)) {
            return Err(DdpError::RankState(format!(
                "rank {rank}'s saved parameters hold '{name}', which names no parameter of this model"
            )));
        }
        for (name, value) in ours {
            let t = saved
                .get(name.as_str())
                .ok_or_else(|| DdpError::RankState(format!("rank {rank}'s saved parameters leave out '{name}'")))?;
            if t.shape() != value.shape() {
                return Err(DdpError::RankState(format!(
                    "rank {rank}'s saved '{name}' has shape {:?}, the parameter {:?}",
                    t.shape(),
                    value.shape()
                )));
            }
            let t = t.to_device(value.device())?;
            if let Some(master) = masters.get(&name) {
                master.copy_from(&t.to_dtype(master.dtype())?)?;
            }
            value.copy_from(&t.to_dtype(value.dtype())?)?;
        }
        Ok(())
    }

    /// Runs `f` with every parameter gathered whole into its tensor, then frees them again (FSDP's
    /// `summon_full_params`): how a checkpoint reads a model whose parameters a policy shards
    /// (ZeRO-3). A collective: every rank calls it. Under any other policy it just runs `f`.
    pub fn summon_full_params<R>(&self, f: impl FnOnce() -> R) -> Result<R> {
        self.gather_full_params()?;
        let r = f();
        self.release_full_params()?;
        Ok(r)
    }

    /// The first half of [`DistributedDataParallel::summon_full_params`]: every parameter whole
    /// until [`DistributedDataParallel::release_full_params`] (a collective; nothing to do when
    /// the policy does not shard the parameters).
    pub fn gather_full_params(&self) -> Result<()> {
        match &self.param_hooks {
            Some(hooks) => hooks.gather_all(),
            None => Ok(()),
        }
    }

    /// Frees what [`DistributedDataParallel::gather_full_params`] gathered.
    pub fn release_full_params(&self) -> Result<()> {
        match &self.param_hooks {
            Some(hooks) => hooks.release_all(),
            None => Ok(()),
        }
    }

    /// The parameter gathers of the last pass whose backward finished (ZeRO-3's; none when
    /// the policy keeps the parameters whole).
    pub fn param_gathers(&self) -> Vec<crate::policy::GatherTimes> {
        self.param_hooks.as_ref().map_or_else(Vec::new, |h| h.gathers())
    }

    /// The error the policy's parameter hooks met in this forward and have not reported yet (a
    /// ZeRO-3 gather that failed, e.g. because a peer is gone), taken; `None` without hooks. A
    /// forward that failed calls it: the hooks' error, when there is one, is the cause.
    pub fn take_hooks_error(&self) -> Option<brigade_autograd::SubscriberError> {
        self.param_hooks.as_ref().and_then(|h| h.take_error())
    }

    /// Whether the policy shards the parameters themselves (ZeRO-3): then they are whole only
    /// inside their unit's forward and backward, or [`DistributedDataParallel::summon_full_params`].
    pub fn shards_parameters(&self) -> bool {
        self.param_hooks.is_some()
    }

    /// This rank's memory, measured from live allocations: parameters, gradients and buckets,
    /// `opt`'s state, the policy's state and its communication scratch ([`MemoryReport`]).
    pub fn rank_memory(&self, opt: &dyn Optimizer) -> Result<MemoryReport> {
        let policy = self.reducer.lock_policy().memory();
        memory::measure(&self.reducer, opt, policy)
    }
}

/// Prefix of a rank's parameters among its own state ([`DistributedDataParallel::gather_rank_state`]).
const RANK_PARAMS: &str = "params/";
/// Prefix of a rank's optimizer state among its own state.
const RANK_OPTIMIZER: &str = "optimizer/";

/// A parameter's name (`param{i}` when it has none, as the optimizers name it) and value.
fn named_value((i, p): (usize, &Var)) -> (String, Tensor) {
    let name = p.name().map(str::to_string).unwrap_or_else(|| format!("param{i}"));
    (name, p.value())
}

/// The rank an entry `rank{r}/...` belongs to.
fn rank_of(key: &str) -> Option<usize> {
    key.strip_prefix("rank")?.split('/').next()?.parse().ok()
}

impl Drop for DistributedDataParallel {
    fn drop(&mut self) {
        self.bus.unsubscribe(&self.subscriber);
        if let Some(hooks) = self.param_hooks.take() {
            let as_sub: Arc<dyn GradSubscriber> = hooks.clone();
            self.bus.unsubscribe(&as_sub);
            let ours: Arc<dyn brigade_autograd::ScopeHooks> = hooks;
            if let Some(installed) = brigade_autograd::set_scope_hooks(None) {
                if !Arc::ptr_eq(&installed, &ours) {
                    brigade_autograd::set_scope_hooks(Some(installed));
                }
            }
        }
    }
}

/// The optimizer a [`DistributedDataParallel`] steps: the one its policy built, followed by the
/// policy's [`ReducerPolicy::after_step`]. Every rank must step it together.
pub struct DdpOptimizer {
    inner: Box<dyn Optimizer>,
    reducer: Arc<Reducer>,
    /// The link time of every step's `after_step` collectives (when the last of them left the
    /// comm stream: a later step's first collective may have waited for it).
    after_steps: crate::group::LinkTime,
}

impl DdpOptimizer {
    /// The optimizer the policy built (e.g. to downcast it).
    pub fn inner(&self) -> &dyn Optimizer {
        self.inner.as_ref()
    }
}

fn optimizer_error(e: DdpError) -> AutogradError {
    AutogradError::Optimizer { source: Box::new(e) }
}

impl Optimizer for DdpOptimizer {
    fn step(&mut self) -> brigade_autograd::Result<()> {
        let (scale, skipped_before) = (self.inner.loss_scale(), self.inner.skipped_steps());
        self.inner.step()?;
        let loss_scale = scale
            .zip(self.inner.loss_scale())
            .map(|(scale, next_scale)| LossScaleStep {
                scale,
                next_scale,
                skipped: self.inner.skipped_steps() > skipped_before,
            });
        let ctx = StepContext {
            params: &self.reducer.params,
            loss_scale,
        };
        // the earlier steps' after-step collectives, as far as they had left the comm stream
        let earlier_left = self.after_steps.left();
        let link = crate::group::LinkTime::within(&self.after_steps);
        let began = std::time::Instant::now();
        let done = self
            .reducer
            .lock_policy()
            .after_step(&ctx, &self.reducer.metered_timing(link.clone()));
        let took = began.elapsed().as_secs_f64();
        let mut st = self.reducer.lock();
        st.pass.after_step = Some((took, link.seconds()));
        st.pass.earlier_after_step_left = earlier_left;
        drop(st);
        done.map_err(optimizer_error)
    }

    fn params(&self) -> &[Var] {
        self.inner.params()
    }

    fn lr(&self) -> f64 {
        self.inner.lr()
    }

    fn set_lr(&mut self, lr: f64) {
        self.inner.set_lr(lr)
    }

    fn state_dict(&self) -> brigade_autograd::Result<Vec<(String, Tensor)>> {
        self.inner.state_dict()
    }

    fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> brigade_autograd::Result<()> {
        self.inner.load_state_dict(state)
    }

    fn state_bytes(&self) -> brigade_autograd::Result<usize> {
        self.inner.state_bytes()
    }

    fn consolidate_state(&mut self) -> brigade_autograd::Result<()> {
        self.inner.consolidate_state()
    }

    fn master_weights(&self) -> Vec<(String, Tensor)> {
        self.inner.master_weights()
    }

    fn master_weight_bytes(&self) -> usize {
        self.inner.master_weight_bytes()
    }

    fn loss_scale(&self) -> Option<f64> {
        self.inner.loss_scale()
    }

    fn skipped_steps(&self) -> u64 {
        self.inner.skipped_steps()
    }

    fn grad_scaler(&self) -> Option<brigade_autograd::GradScaler> {
        self.inner.grad_scaler()
    }
}
