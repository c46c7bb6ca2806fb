//! A [`ProcessGroup`] wrapper that writes down the order of the stream hooks' calls, so tests
//! check the reducer's event logic from the recorded sequence, not from clocks.

use std::sync::{Arc, Mutex};

use std::time::Duration;

use brigade_comm::{CommMeter, ReduceOp, SpanId};
use brigade_tensor::{Stream, Tensor};

use super::{Group, ProcessGroup, ReadyEvent, SparseGather, TensorWork};

/// One call of the contract, as [`Recording`] saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamEvent {
    /// The compute side recorded bucket `b`'s ready event.
    Ready(usize),
    /// The comm side was handed bucket `b`'s collective.
    Launch(usize),
    /// The compute side waited on bucket `b`'s completion.
    Wait(usize),
    /// A mark the caller put down ([`Recording::mark_step`]): the optimizer step.
    Step,
    /// Backward's kernels from now on belong to a new timeline span (recording only).
    ScopeOpen,
    /// The open backward span ended.
    ScopeClose,
}

/// Forwards every call to `inner` and records it, in call order.
pub struct Recording {
    inner: Group,
    events: Arc<Mutex<Vec<StreamEvent>>>,
}

impl Recording {
    /// Records the calls made on `inner`.
    pub fn new(inner: Group) -> Self {
        Recording {
            inner,
            events: Arc::default(),
        }
    }

    /// Every call so far, in order.
    pub fn events(&self) -> Vec<StreamEvent> {
        self.lock().clone()
    }

    /// Forgets what was recorded (between steps).
    pub fn clear(&self) {
        self.lock().clear();
    }

    /// Puts down [`StreamEvent::Step`]: the caller is about to run the optimizer step.
    pub fn mark_step(&self) {
        self.lock().push(StreamEvent::Step);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<StreamEvent>> {
        self.events.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl ProcessGroup for Recording {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn timeout(&self) -> Duration {
        self.inner.timeout()
    }
    fn enqueues(&self) -> bool {
        self.inner.enqueues()
    }
    fn check(&self) -> crate::Result<()> {
        self.inner.check()
    }
    fn all_reduce(&self, t: &Tensor, op: ReduceOp, tag: &str) -> TensorWork<Tensor> {
        self.inner.all_reduce(t, op, tag)
    }
    fn reduce_scatter_into(&self, input: &Tensor, output: &Tensor, op: ReduceOp, tag: &str) -> TensorWork<Tensor> {
        self.inner.reduce_scatter_into(input, output, op, tag)
    }
    fn all_gather_into(&self, input: &Tensor, output: &Tensor, tag: &str) -> TensorWork<Tensor> {
        self.inner.all_gather_into(input, output, tag)
    }
    fn broadcast(&self, t: &Tensor, root: usize, tag: &str) -> TensorWork<Tensor> {
        self.inner.broadcast(t, root, tag)
    }
    fn barrier(&self, tag: &str) -> TensorWork<()> {
        self.inner.barrier(tag)
    }
    fn reduce_scatter(&self, t: &Tensor, op: ReduceOp, tag: &str) -> TensorWork<Tensor> {
        self.inner.reduce_scatter(t, op, tag)
    }
    fn all_gather(&self, t: &Tensor, tag: &str) -> TensorWork<Tensor> {
        self.inner.all_gather(t, tag)
    }
    fn all_gather_with_side(&self, payload: &Tensor, side: &Tensor, tag: &str) -> TensorWork<(Tensor, Tensor)> {
        self.inner.all_gather_with_side(payload, side, tag)
    }
    fn all_gather_sparse(
        &self,
        values: &Tensor,
        indices: &Tensor,
        capacity: usize,
        tag: &str,
    ) -> TensorWork<SparseGather> {
        self.inner.all_gather_sparse(values, indices, capacity, tag)
    }

    fn record_ready(&self, index: usize, flat: &Tensor) -> crate::Result<ReadyEvent> {
        self.lock().push(StreamEvent::Ready(index));
        self.inner.record_ready(index, flat)
    }

    fn launch(&self, index: usize, ready: ReadyEvent) -> crate::Result<Option<Stream>> {
        self.lock().push(StreamEvent::Launch(index));
        self.inner.launch(index, ready)
    }

    fn launched(&self, index: usize, meter: &CommMeter) -> crate::Result<()> {
        self.inner.launched(index, meter)
    }

    fn wait(&self, index: usize) -> crate::Result<()> {
        let waited = self.inner.wait(index);
        self.lock().push(StreamEvent::Wait(index));
        waited
    }

    fn compute_scope(&self, span: Option<SpanId>) {
        self.lock().push(match span {
            Some(_) => StreamEvent::ScopeOpen,
            None => StreamEvent::ScopeClose,
        });
        self.inner.compute_scope(span)
    }
}
