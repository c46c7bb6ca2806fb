//! The reducer: listens on the gradient-ready bus, counts each bucket down, and issues a
//! bucket's all-reduce on the comm stream the moment it is full, strictly in bucket order.
//!
//! Vocabulary follows PyTorch's `Reducer` (`reducer.cpp`): `autograd_hook` is
//! [`GradSubscriber::grad_ready`], `mark_variable_ready` decrements the bucket's
//! `pending`, `mark_bucket_ready` launches every leading full bucket, and
//! `finalize_backward` is [`GradSubscriber::backward_finished`].

use std::sync::{Arc, Mutex, MutexGuard};

use brigade_autograd::{GradReady, GradSubscriber, Var};
use brigade_comm::{reducing_bucket, Buffer, Communicator, EventKind, Recorder, ReduceOp, SpanId};
use brigade_tensor::{CpuStorage, DType, Tensor};

use crate::bucket::{assign_buckets, Bucket};
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
    span: Option<(EventKind, SpanId)>,
}

pub(crate) struct Reducer {
    pub(crate) params: Vec<Var>,
    comm: Arc<dyn Communicator>,
    cfg: DdpConfig,
    recorder: Option<Recorder>,
    pub(crate) state: Mutex<State>,
}

/// Buckets for `params` visited in `order`, with the configured caps (MiB to bytes).
fn group_params(params: &[Var], order: &[usize], cfg: &DdpConfig) -> Vec<Vec<usize>> {
    let bytes = |mib: f64| (mib * 1024.0 * 1024.0).max(1.0) as usize;
    let sizes: Vec<usize> = params.iter().map(|p| p.value().numel() * 4).collect();
    assign_buckets(&sizes, order, bytes(cfg.first_bucket_cap_mb), bytes(cfg.bucket_cap_mb))
}

/// Builds buckets for `groups` and points every parameter's gradient at its slice.
fn build_buckets(params: &[Var], groups: Vec<Vec<usize>>) -> Result<(Vec<Bucket>, Vec<usize>)> {
    let mut bucket_of = vec![usize::MAX; params.len()];
    let mut buckets = Vec::with_capacity(groups.len());
    for (b, group) in groups.into_iter().enumerate() {
        let numel: usize = group.iter().map(|&p| params[p].value().numel()).sum();
        let flat = Tensor::zeros(&[numel], DType::F32);
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
        });
    }
    Ok((buckets, bucket_of))
}

impl Reducer {
    pub(crate) fn new(params: Vec<Var>, comm: Arc<dyn Communicator>, cfg: DdpConfig) -> Result<Reducer> {
        let order: Vec<usize> = (0..params.len()).rev().collect();
        let groups = group_params(&params, &order, &cfg);
        let (buckets, bucket_of) = build_buckets(&params, groups)?;
        let n = params.len();
        Ok(Reducer {
            recorder: cfg.recorder.clone(),
            params,
            comm,
            state: Mutex::new(State {
                buckets,
                bucket_of,
                next_launch: 0,
                ready: vec![false; n],
                ready_order: vec![],
                sync: true,
                in_backward: false,
                rebuilt: !cfg.rebuild_buckets,
                span: None,
            }),
            cfg,
        })
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn name(&self, p: usize) -> &str {
        self.params[p].name().unwrap_or("<unnamed>")
    }

    /// `mark_variable_ready`: counts the parameter's bucket down and launches what is full.
    fn mark_ready(&self, st: &mut State, p: usize) -> std::result::Result<(), String> {
        if st.ready[p] {
            return Err(format!(
                "parameter '{}' was marked ready twice in one backward pass",
                self.name(p)
            ));
        }
        st.ready[p] = true;
        st.ready_order.push(p);
        let b = st.bucket_of[p];
        st.buckets[b].pending -= 1;
        // Launch strictly in bucket order: a later bucket that fills first waits its turn.
        while st.next_launch < st.buckets.len() && st.buckets[st.next_launch].pending == 0 {
            self.launch(st, st.next_launch).map_err(|e| e.to_string())?;
            st.next_launch += 1;
        }
        Ok(())
    }

    /// Hands bucket `b`'s flat buffer to the comm stream (no copy) and issues its all-reduce.
    fn launch(&self, st: &mut State, b: usize) -> Result<()> {
        let bucket = &mut st.buckets[b];
        let CpuStorage::F32(v) = bucket.flat.lend_storage()? else {
            return Err(DdpError::Config("bucket buffers are f32".into()));
        };
        bucket.work = Some(reducing_bucket(b, || {
            self.comm.all_reduce(Buffer::F32(v), ReduceOp::Avg, &bucket_tag(b))
        }));
        Ok(())
    }

    fn end_span(&self, st: &mut State) {
        if let (Some(rec), Some((_, id))) = (&self.recorder, st.span.take()) {
            rec.end(id);
        }
    }

    /// Waits for every launched bucket and gives the buffers back to their views.
    fn wait_all(&self, st: &mut State) -> Result<()> {
        let span = self
            .recorder
            .as_ref()
            .map(|r| r.begin(self.comm.rank(), EventKind::WaitForBuckets));
        let mut first_err = None;
        for bucket in st.buckets.iter_mut() {
            if let Some(work) = bucket.work.take() {
                match work.wait() {
                    Ok(Buffer::F32(v)) => bucket.flat.restore_storage(CpuStorage::F32(v))?,
                    Ok(_) => return Err(DdpError::Config("all-reduce returned a buffer of another dtype".into())),
                    Err(e) => {
                        first_err.get_or_insert(e);
                    }
                }
            }
        }
        if let (Some(r), Some(s)) = (&self.recorder, span) {
            r.end(s);
        }
        match first_err {
            Some(e) => Err(e.into()),
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
            return Err(DdpError::Config("rebuild order came back as another dtype".into()));
        };
        let order: Vec<usize> = bytes
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as usize)
            .collect();
        let mut seen = vec![false; self.params.len()];
        for &p in &order {
            if p >= seen.len() || std::mem::replace(&mut seen[p], true) {
                return Err(DdpError::Config(format!(
                    "rank 0's ready order {order:?} is not a permutation of the parameters"
                )));
            }
        }
        if seen.iter().any(|s| !s) {
            return Err(DdpError::Config("rank 0's ready order misses parameters".into()));
        }
        let groups = group_params(&self.params, &order, &self.cfg);
        // set_grad_buffer copies each gradient (this step's reduced values) into its new slice.
        let (buckets, bucket_of) = build_buckets(&self.params, groups)?;
        st.buckets = buckets;
        st.bucket_of = bucket_of;
        st.rebuilt = true;
        Ok(())
    }
}

impl GradSubscriber for Reducer {
    fn backward_started(&self, in_graph: &[usize]) -> std::result::Result<(), String> {
        let mut st = self.lock();
        if st.in_backward {
            return Err(
                "a previous synchronized backward pass did not finish (it failed midway); \
                        its buckets are in an unknown state: rebuild the DistributedDataParallel wrapper"
                    .into(),
            );
        }
        if !st.sync {
            return Ok(());
        }
        st.in_backward = true;
        st.next_launch = 0;
        st.ready.iter_mut().for_each(|r| *r = false);
        st.ready_order.clear();
        for b in st.buckets.iter_mut() {
            b.pending = b.params.len();
        }
        let mut used = vec![false; self.params.len()];
        for &p in in_graph {
            used[p] = true;
        }
        let unused: Vec<usize> = (0..self.params.len()).filter(|&p| !used[p]).collect();
        if unused.is_empty() {
            return Ok(());
        }
        if !self.cfg.find_unused_parameters {
            let names: Vec<&str> = unused.iter().map(|&p| self.name(p)).collect();
            st.in_backward = false;
            return Err(format!(
                "rank {}: these parameters receive no gradient in this backward pass: {names:?}. \
                 Every parameter must take part in the loss on every rank, or construct DDP with \
                 find_unused_parameters = true (CLI: --find-unused-parameters) so that they are marked \
                 ready and reduced as they are",
                self.comm.rank()
            ));
        }
        // PyTorch's find_unused_parameters: mark them ready up front so no bucket waits on them.
        for p in unused {
            self.mark_ready(&mut st, p)?;
        }
        Ok(())
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
        st.span = Some((kind, id));
    }

    fn grad_ready(&self, ready: GradReady<'_>) -> std::result::Result<(), String> {
        let mut st = self.lock();
        if !st.sync {
            return Ok(());
        }
        if !st.in_backward {
            return Err("gradient announced outside a backward pass".into());
        }
        self.mark_ready(&mut st, ready.index)
    }

    fn backward_finished(&self) -> std::result::Result<(), String> {
        let mut st = self.lock();
        self.end_span(&mut st);
        if !st.sync {
            return Ok(());
        }
        st.in_backward = false;
        if st.next_launch < st.buckets.len() {
            let missing: Vec<&str> = (0..self.params.len())
                .filter(|&p| !st.ready[p])
                .map(|p| self.name(p))
                .collect();
            // Give back whatever was launched before reporting.
            let _ = self.wait_all(&mut st);
            return Err(format!(
                "backward finished but these parameters were never ready: {missing:?}"
            ));
        }
        self.wait_all(&mut st).map_err(|e| e.to_string())?;
        if !st.rebuilt {
            self.rebuild(&mut st).map_err(|e| e.to_string())?;
        }
        Ok(())
    }
}
