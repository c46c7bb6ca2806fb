//! A communicator wrapper that records every collective into a [`Recorder`].

use std::time::Duration;

use super::{current_tag, Recorder, SpanId};
use crate::{Buffer, Communicator, ReduceOp, Work, WorkEvent};

/// Wraps a communicator and records each collective: issued (when called), started and
/// finished on the comm stream (when they happen, whether or not anyone waits). A collective
/// issued inside [`super::tagging_collectives`] is recorded with its tag.
pub struct Traced<C> {
    inner: C,
    recorder: Recorder,
}

impl<C: Communicator> Traced<C> {
    /// Records `inner`'s collectives into `recorder`.
    pub fn new(inner: C, recorder: Recorder) -> Self {
        Traced { inner, recorder }
    }

    /// The recorder.
    pub fn recorder(&self) -> &Recorder {
        &self.recorder
    }

    /// The wrapped communicator.
    pub fn inner(&self) -> &C {
        &self.inner
    }

    fn watch<T>(&self, span: SpanId, work: Work<T>) -> Work<T> {
        let recorder = self.recorder.clone();
        work.observe(move |event| match event {
            WorkEvent::Started(at) => recorder.comm_started(span, at),
            WorkEvent::Finished { at, error } => recorder.comm_finished(span, at, error.map(|e| e.to_string())),
        });
        work
    }

    fn issue(&self, op: &str, tag: &str, bytes: usize) -> SpanId {
        self.recorder
            .comm_issued(self.inner.rank(), op, tag, bytes, current_tag())
    }
}

impl<C: Communicator> Communicator for Traced<C> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn timeout(&self) -> Duration {
        self.inner.timeout()
    }

    fn all_reduce(&self, buf: Buffer, op: ReduceOp, tag: &str) -> Work<Buffer> {
        let span = self.issue("all_reduce", tag, buf.byte_len());
        self.watch(span, self.inner.all_reduce(buf, op, tag))
    }

    fn broadcast(&self, buf: Buffer, root: usize, tag: &str) -> Work<Buffer> {
        let span = self.issue("broadcast", tag, buf.byte_len());
        self.watch(span, self.inner.broadcast(buf, root, tag))
    }

    fn all_gather(&self, buf: Buffer, tag: &str) -> Work<Buffer> {
        let span = self.issue("all_gather", tag, buf.byte_len());
        self.watch(span, self.inner.all_gather(buf, tag))
    }

    fn reduce_scatter(&self, buf: Buffer, op: ReduceOp, tag: &str) -> Work<Buffer> {
        let span = self.issue("reduce_scatter", tag, buf.byte_len());
        self.watch(span, self.inner.reduce_scatter(buf, op, tag))
    }

    fn barrier(&self, tag: &str) -> Work<()> {
        let span = self.issue("barrier", tag, 0);
        self.watch(span, self.inner.barrier(tag))
    }
}
