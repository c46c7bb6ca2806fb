//! The reducer: listens on the gradient-ready bus, counts each bucket down, and issues a
//! bucket's all-reduce on the comm stream the moment it is full, strictly in bucket order.
//!
//! Vocabulary follows PyTorch's `Reducer` (`reducer.cpp`): `autograd_hook` is
//! [`GradSubscriber::grad_ready`], `mark_variable_ready` decrements the bucket's
//! `pending`, `mark_bucket_ready` launches every leading full bucket, and
//! `finalize_backward` is [`GradSubscriber::backward_finished`].

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use brigade_autograd::{GradReady, GradSubscriber, SubscriberError, Var};
use brigade_comm::{Buffer, Communicator, EventKind, Recorder, SpanId};
use brigade_tensor::{DType, Device, Storage, Tensor};

use crate::bucket::{assign_buckets, Bucket};
use crate::hooks::BucketParam;
use crate::stream::{BucketStream, Contents, Failed, ReadyBucket};
use crate::zero::{self, ZeroStage};
use crate::{DdpConfig, DdpError, Result};

/// Tag of bucket `i`'s all-reduce (shows up in traces and errors).
pub fn bucket_tag(i: usize) -> String {
    format!("bucket{i}")
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
    in_backward: bool,
    pub(crate) rebuilt: bool,
    /// The bucket caps in effect, in MiB: (every bucket but the first, the first).
    pub(crate) caps: (f64, f64),
    span: Option<(EventKind, SpanId)>,
    /// When things happened in the current (or last) synchronized pass.
    pub(crate) pass: PassTimes,
}

/// When things happened in one synchronized backward pass, for step profiles
/// ([`crate::overlap::RankProfile`]).
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
}

/// One bucket of a [`PassTimes`].
#[derive(Debug, Clone)]
pub struct PassBucket {
    /// Its parameters, in bucket order.
    pub params: Vec<usize>,
    /// Bytes reduced.
    pub bytes: usize,
    /// When its collective was issued.
    pub launched: Instant,
    /// When it ran on the comm stream (start, finish), once it completed.
    pub ran: Option<(Instant, Instant)>,
}

pub(crate) struct Reducer {
    pub(crate) params: Vec<Var>,
    /// Which parameters required grad at construction: only those are bucketed, expected
    /// in every backward pass and reduced (frozen ones are left alone, as in PyTorch).
    trainable: Vec<bool>,
    pub(crate) comm: Arc<dyn Communicator>,
    /// Where full buckets go: the stream/event contract (host comm stream or NCCL).
    stream: Arc<dyn BucketStream>,
    cfg: DdpConfig,
    recorder: Option<Recorder>,
    pub(crate) state: Mutex<State>,
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

/// Builds buckets for `groups` and points every parameter's gradient at its slice; each flat
/// buffer is padded to a multiple of `pad_to` elements (ZeRO's equal shards; 1: no padding).
pub(crate) fn build_buckets(
    params: &[Var],
    groups: Vec<Vec<usize>>,
    pad_to: usize,
) -> Result<(Vec<Bucket>, Vec<usize>)> {
    let mut bucket_of = vec![usize::MAX; params.len()];
    let mut buckets = Vec::with_capacity(groups.len());
    for (b, group) in groups.into_iter().enumerate() {
        let numel: usize = group.iter().map(|&p| params[p].value().numel()).sum();
        // The bucket lives beside its parameters (a CUDA model gets CUDA buckets).
        let device = group.first().map_or(Device::Cpu, |&p| params[p].value().device());
        let flat = Tensor::zeros_on(&[zero::padded_len(numel, pad_to)], DType::F32, device)?;
        let mut offset = 0;
        for &p in &group {
            let shape = params[p].shape();
            params[p].set_grad_buffer(flat.flat_view(offset, &shape)?)?;
            offset += shape.iter().product::<usize>();
            bucket_of[p] = b;
        }
        buckets.push(Bucket {
            pending: group.len(),
            params: group,
            flat,
            work: None,
            grad_shard: None,
        });
    }
    Ok((buckets, bucket_of))
}

impl Reducer {
    pub(crate) fn new(
        params: Vec<Var>,
        comm: Arc<dyn Communicator>,
        stream: Arc<dyn BucketStream>,
        cfg: DdpConfig,
    ) -> Result<Reducer> {
        let trainable: Vec<bool> = params.iter().map(Var::requires_grad).collect();
        let order: Vec<usize> = (0..params.len()).rev().filter(|&p| trainable[p]).collect();
        let caps = (cfg.bucket_cap_mb, cfg.first_bucket_cap_mb);
        let groups = group_params(&params, &order, caps);
        let (buckets, bucket_of) = build_buckets(&params, groups, zero::pad_to(cfg.zero, comm.world_size()))?;
        let n = params.len();
        Ok(Reducer {
            recorder: cfg.recorder.clone(),
            params,
            trainable,
            comm,
            stream,
            state: Mutex::new(State {
                buckets,
                bucket_of,
                next_launch: 0,
                ready: vec![false; n],
                ready_order: vec![],
                sync: true,
                in_backward: false,
                // ZeRO's shards are cut from the buckets: they are never rebuilt (zero/mod.rs).
                rebuilt: !cfg.rebuild_buckets || cfg.zero != ZeroStage::Off,
                caps,
                span: None,
                pass: PassTimes::default(),
            }),
            cfg,
        })
    }

    /// The ZeRO stage this reducer was built with.
    pub(crate) fn zero_stage(&self) -> ZeroStage {
        self.cfg.zero
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn name(&self, p: usize) -> &str {
        self.params[p].name().unwrap_or("<unnamed>")
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
        }
        Ok(())
    }

    /// Records bucket `b`'s ready event and hands its flat buffer (no copy) to the comm side,
    /// which waits on the event and runs the bucket's collective.
    fn launch(&self, st: &mut State, b: usize) -> Result<()> {
        let is_last = b + 1 == st.buckets.len();
        let bucket = &mut st.buckets[b];
        let mut offset = 0;
        let params = bucket
            .params
            .iter()
            .map(|&p| {
                let shape = self.params[p].shape();
                let param = BucketParam {
                    index: p,
                    name: self.name(p).to_string(),
                    offset,
                    shape,
                };
                offset += param.len();
                param
            })
            .collect();
        let storage = bucket.flat.lend_storage()?;
        let ready = self.stream.record_ready(b, &storage)?;
        let in_flight = self.stream.launch(ReadyBucket {
            index: b,
            params,
            is_last,
            storage,
            ready,
        })?;
        let launched = in_flight.launched;
        bucket.work = Some(in_flight);
        let (params, bytes) = (bucket.params.clone(), bucket.bytes());
        st.pass.buckets.push(PassBucket {
            params,
            bytes,
            launched,
            ran: None,
        });
        Ok(())
    }

    fn end_span(&self, st: &mut State) {
        if let (Some(rec), Some((_, id))) = (&self.recorder, st.span.take()) {
            rec.end(id);
            // a stream that times the compute stream moves the span onto its clock
            self.stream.compute_scope(None);
        }
    }

    /// Waits for every launched bucket and gives the buffers back to their views.
    fn wait_all(&self, st: &mut State) -> Result<()> {
        let span = self
            .recorder
            .as_ref()
            .map(|r| r.begin(self.comm.rank(), EventKind::WaitForBuckets));
        let mut first_err = None;
        for (b, bucket) in st.buckets.iter_mut().enumerate() {
            if let Some(in_flight) = bucket.work.take() {
                match self.stream.wait(in_flight) {
                    Ok(landed) => {
                        if let Some(pb) = st.pass.buckets.get_mut(b) {
                            pb.ran = landed.ran;
                        }
                        match landed.contents {
                            // ZeRO-2 keeps only this rank's shard of the reduce-scatter.
                            Contents::Host(v) if self.cfg.zero == ZeroStage::Two => {
                                if let Err(e) = zero::keep_grad_shard(bucket, v, &self.params, self.comm.world_size()) {
                                    first_err.get_or_insert(e);
                                }
                            }
                            Contents::Storage(s) => bucket.flat.restore_storage(s)?,
                            Contents::Host(v) if v.len() == bucket.flat.numel() => {
                                let device = bucket.flat.device();
                                bucket.flat.restore_storage(Storage::from_host_vec(v, device)?)?
                            }
                            Contents::Host(v) => {
                                // Give the views storage back (zeros) before reporting the hook's mistake.
                                let zeros =
                                    Storage::from_host_vec(vec![0.0f32; bucket.flat.numel()], bucket.flat.device())?;
                                bucket.flat.restore_storage(zeros)?;
                                first_err.get_or_insert(DdpError::HookResult {
                                    hook: self.cfg.comm_hook.name(),
                                    bucket: b,
                                    expected: bucket.flat.numel(),
                                    found: v.len(),
                                });
                            }
                        }
                    }
                    Err(Failed { error, storage }) => {
                        // Give the views their storage back before reporting.
                        if let Some(storage) = storage {
                            bucket.flat.restore_storage(storage)?;
                        }
                        first_err.get_or_insert(error);
                    }
                }
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

    /// After the first synchronized iteration: rebuild the buckets once from the order in
    /// which gradients became ready on rank 0 (broadcast, so every rank agrees).
    fn rebuild(&self, st: &mut State) -> Result<()> {
        let bytes: Vec<u8> = st.ready_order.iter().flat_map(|&p| (p as u32).to_le_bytes()).collect();
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
        // set_grad_buffer copies each gradient (this step's reduced values) into its new slice.
        let (buckets, bucket_of) = build_buckets(
            &self.params,
            groups,
            zero::pad_to(self.cfg.zero, self.comm.world_size()),
        )?;
        st.buckets = buckets;
        st.bucket_of = bucket_of;
        st.rebuilt = true;
        Ok(())
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
        if self.cfg.zero != ZeroStage::Off {
            return Err(DdpError::Zero(
                "the bucket caps cannot change under ZeRO: its optimizer shards are cut from the buckets".into(),
            ));
        }
        let order: Vec<usize> = st.buckets.iter().flat_map(|b| b.params.iter().copied()).collect();
        let groups = group_params(&self.params, &order, caps);
        let (buckets, bucket_of) = build_buckets(&self.params, groups, 1)?;
        st.buckets = buckets;
        st.bucket_of = bucket_of;
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
        st.in_backward = true;
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
            self.attach_for_zero2(st, p)?;
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
}

impl Reducer {
    /// ZeRO-2 frees each full bucket after its reduce-scatter: a gradient that became final
    /// moves back into its (re-allocated) bucket here, in synchronized and `no_sync` passes.
    fn attach_for_zero2(&self, st: &mut State, p: usize) -> Result<()> {
        if self.cfg.zero != ZeroStage::Two || !self.trainable[p] {
            return Ok(());
        }
        let b = st.bucket_of[p];
        zero::attach_grad(&mut st.buckets[b], &self.params, p)
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
        let kind = EventKind::backward(scope);
        if st.span.as_ref().is_some_and(|(k, _)| *k == kind) {
            return;
        }
        self.end_span(&mut st);
        let id = rec.begin(self.comm.rank(), kind.clone());
        self.stream.compute_scope(Some(id));
        st.span = Some((kind, id));
    }

    fn grad_ready(&self, ready: GradReady<'_>) -> std::result::Result<(), SubscriberError> {
        let mut st = self.lock();
        self.attach_for_zero2(&mut st, ready.index)?;
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
