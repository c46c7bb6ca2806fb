//! The tracing of a comm stream ([`crate::CommStream::traced`]): each collective recorded into
//! a [`Recorder`].

use super::{current_tag, Recorder, SpanId};
use crate::{RingOp, Work, WorkEvent};

/// Records a stream's collectives: issued (when called, on the caller's thread, with its tag
/// from [`super::tagging_collectives`]), started and finished on the comm stream (when they
/// happen, whether or not anyone waits).
pub(crate) struct Tracing {
    recorder: Recorder,
}

impl Tracing {
    pub(crate) fn new(recorder: Recorder) -> Self {
        Tracing { recorder }
    }

    pub(crate) fn recorder(&self) -> &Recorder {
        &self.recorder
    }

    /// Records, now, that `rank` issued collective `kind` tagged `tag` on `bytes` bytes.
    pub(crate) fn issue(&self, rank: usize, kind: RingOp, tag: &str, bytes: usize) -> SpanId {
        self.recorder.comm_issued(rank, kind.name(), tag, bytes, current_tag())
    }

    /// `work`, recording into `span` when it starts and finishes.
    pub(crate) fn watch<T>(&self, span: SpanId, work: Work<T>) -> Work<T> {
        let recorder = self.recorder.clone();
        work.observe(move |event| match event {
            WorkEvent::Started(at) => recorder.comm_started(span, at),
            WorkEvent::Finished { at, error } => recorder.comm_finished(span, at, error.map(|e| e.to_string())),
        });
        work
    }
}
