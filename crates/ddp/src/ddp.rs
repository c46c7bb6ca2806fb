//! `DistributedDataParallel`: the user-facing wrapper.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use brigade_autograd::{GradBus, GradSubscriber, Optimizer, ParamStore, Var};
use brigade_comm::Communicator;

use crate::reducer::grad_bytes;
use crate::reducer::{PassTimes, Reducer};
use crate::signature::{broadcast_parameters, check_f32, check_same_model};
use crate::stream::{BucketStream, HostStream};
use crate::zero::{self, RankMemory, ZeroOptimizer, ZeroStage};
use crate::{DdpConfig, DdpError, Result};

/// One bucket as built: which parameters, how many bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct BucketInfo {
    /// Position in launch order.
    pub index: usize,
    /// Parameter names in the order their gradients sit in the flat buffer.
    pub params: Vec<String>,
    /// Size of the flat buffer.
    pub bytes: usize,
}

/// Per-rank gradient memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryReport {
    /// What one copy of every trainable parameter's gradient takes (`sum(numel * dtype size)`).
    pub gradient_bytes: usize,
    /// What the bucket buffers take.
    pub bucket_bytes: usize,
    /// Gradient bytes held outside the buckets (0: every gradient is a view into one).
    pub gradient_bytes_outside_buckets: usize,
}

impl MemoryReport {
    /// Gradients plus buckets, counted once each storage.
    pub fn total_bytes(&self) -> usize {
        self.bucket_bytes + self.gradient_bytes_outside_buckets
    }
}

/// Wraps one rank's model replica: gradients become views into flat buckets, and each
/// bucket is all-reduced (averaged over ranks) on the comm stream as soon as backward
/// has produced all of its gradients, while backward goes on with earlier layers.
/// `backward()` returns once every bucket is reduced, so the optimizer step that follows
/// sees the average gradient.
///
/// Construction is a collective: every rank must call it, with the same model.
pub struct DistributedDataParallel {
    reducer: Arc<Reducer>,
    bus: GradBus,
    subscriber: Arc<dyn GradSubscriber>,
    /// ZeRO's communication scratch of the last step, written by its optimizer.
    zero_scratch: Arc<AtomicUsize>,
}

impl DistributedDataParallel {
    /// Checks that every rank holds the same parameters (names, shapes, dtypes, which ones
    /// require grad), broadcasts rank 0's values, builds the buckets of the parameters that
    /// require grad (frozen ones are left out: freeze before wrapping) and subscribes to the
    /// store's gradient-ready bus.
    pub fn new(store: &ParamStore, comm: Arc<dyn Communicator>, cfg: DdpConfig) -> Result<Self> {
        // ZeRO reduce-scatters each bucket instead of running the comm hook (refused below
        // unless the hook is the default all-reduce).
        let hook: Arc<dyn crate::hooks::CommHook> = match cfg.zero {
            ZeroStage::Off => cfg.comm_hook.clone(),
            stage => Arc::new(zero::ReduceScatterHook(stage)),
        };
        let stream = Arc::new(HostStream::new(comm.clone(), hook));
        Self::build(store, comm, stream, cfg)
    }

    /// Like [`DistributedDataParallel::new`], with full buckets reduced through `stream` (the
    /// stream/event contract, [`crate::stream`]): e.g. an NCCL stream on the GPU, or a
    /// [`crate::stream::Recording`] of the host stream in tests. `comm` still carries the
    /// model check, the parameter broadcast and the bucket rebuild.
    pub fn with_stream(
        store: &ParamStore,
        comm: Arc<dyn Communicator>,
        stream: Arc<dyn BucketStream>,
        cfg: DdpConfig,
    ) -> Result<Self> {
        if cfg.zero != ZeroStage::Off {
            return Err(DdpError::Zero(format!(
                "ZeRO stage {} reduce-scatters its buckets on the host stream DistributedDataParallel::new builds; it does not run over the '{}' bucket stream",
                cfg.zero.level(),
                stream.name()
            )));
        }
        Self::build(store, comm, stream, cfg)
    }

    fn build(
        store: &ParamStore,
        comm: Arc<dyn Communicator>,
        stream: Arc<dyn BucketStream>,
        cfg: DdpConfig,
    ) -> Result<Self> {
        let caps_ok = |mb: f64| mb > 0.0 && mb.is_finite();
        if !(caps_ok(cfg.bucket_cap_mb) && caps_ok(cfg.first_bucket_cap_mb)) {
            return Err(DdpError::BucketCap {
                bucket_cap_mb: cfg.bucket_cap_mb,
                first_bucket_cap_mb: cfg.first_bucket_cap_mb,
            });
        }
        if cfg.zero != ZeroStage::Off && cfg.comm_hook.name() != "allreduce" {
            return Err(DdpError::Zero(format!(
                "ZeRO stage {} reduce-scatters each bucket itself; it does not combine with the '{}' communication hook (use the default all-reduce)",
                cfg.zero.level(),
                cfg.comm_hook.name()
            )));
        }
        let params = store.params().to_vec();
        check_same_model(&params, comm.as_ref())?;
        check_f32(&params)?;
        if cfg.broadcast_parameters {
            broadcast_parameters(&params, comm.as_ref())?;
        }
        let reducer = Arc::new(Reducer::new(params, comm, stream, cfg)?);
        let subscriber: Arc<dyn GradSubscriber> = reducer.clone();
        store.bus().subscribe(subscriber.clone());
        Ok(DistributedDataParallel {
            reducer,
            bus: store.bus().clone(),
            subscriber,
            zero_scratch: Arc::default(),
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
    /// launches and their time on the comm stream): what a step profile is made of.
    pub fn last_pass(&self) -> PassTimes {
        self.reducer.lock().pass.clone()
    }

    /// Regroups the buckets under new caps, keeping their parameter order (rank 0's ready order
    /// once rebuilt), e.g. when [`crate::overlap::Autotuner`] picks another cap. Not a collective:
    /// every rank must call it with the same caps between the same two steps (the autotuner
    /// broadcasts rank 0's choice), and then every rank holds the same buckets. Gradients keep
    /// their values; only between backward passes.
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

    /// This rank's communicator (the one the buckets are reduced over).
    pub(crate) fn comm(&self) -> &Arc<dyn Communicator> {
        &self.reducer.comm
    }

    /// The bytes of each parameter's gradient in a bucket, in registration order (0 for a
    /// frozen parameter): the `params` of a step profile.
    pub fn param_profiles(&self) -> Vec<crate::overlap::ParamProfile> {
        self.reducer
            .params
            .iter()
            .map(|p| crate::overlap::ParamProfile {
                name: p.name().unwrap_or("<unnamed>").to_string(),
                bytes: if p.requires_grad() { grad_bytes(p) } else { 0 },
            })
            .collect()
    }

    /// True once the buckets were rebuilt from the observed ready order.
    pub fn buckets_rebuilt(&self) -> bool {
        self.reducer.lock().rebuilt
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

    /// ZeRO: wraps `full` (an optimizer over the model's parameters, possibly with state loaded
    /// from a checkpoint) into a [`ZeroOptimizer`] that keeps state only for this rank's shard
    /// of every bucket; `build` makes an optimizer of the same kind over a list of parameters
    /// (one per bucket shard is built). Fails unless DDP was built with a ZeRO stage.
    pub fn zero_optimizer(
        &self,
        full: &dyn Optimizer,
        build: &dyn Fn(Vec<Var>) -> Box<dyn Optimizer>,
    ) -> Result<ZeroOptimizer> {
        let stage = self.reducer.zero_stage();
        if stage == ZeroStage::Off {
            return Err(DdpError::Zero(
                "zero_optimizer needs DDP built with DdpConfig::zero set to a stage".into(),
            ));
        }
        ZeroOptimizer::new(self.reducer.clone(), stage, self.zero_scratch.clone(), full, build)
    }

    /// This rank's memory, measured from live allocations: parameters, gradients and buckets,
    /// `opt`'s state, and the communication scratch of the last ZeRO step
    /// ([`zero::RankMemory`]).
    pub fn rank_memory(&self, opt: &dyn Optimizer) -> Result<RankMemory> {
        zero::memory_of(&self.reducer, opt, self.zero_scratch.load(Ordering::Relaxed))
    }

    /// Gradient memory on this rank: buckets are the only gradient storage.
    pub fn memory(&self) -> MemoryReport {
        let st = self.reducer.lock();
        let gradient_bytes = self
            .reducer
            .params
            .iter()
            .filter(|p| p.requires_grad())
            .map(grad_bytes)
            .sum();
        let bucket_bytes = st.buckets.iter().map(|b| b.bytes()).sum();
        let outside = self
            .reducer
            .params
            .iter()
            .filter_map(|p| p.grad())
            .filter(|g| !st.buckets.iter().any(|b| b.flat.shares_storage(g)))
            .map(|g| g.numel() * g.dtype().size_in_bytes())
            .sum();
        MemoryReport {
            gradient_bytes,
            bucket_bytes,
            gradient_bytes_outside_buckets: outside,
        }
    }
}

impl Drop for DistributedDataParallel {
    fn drop(&mut self) {
        self.bus.unsubscribe(&self.subscriber);
    }
}
