//! The NCCL stream's timeline on the GPU clock: each bucket's collective (start and completion
//! events on the comm stream), each bucket's ready event and backward's compute scopes (events
//! on the compute stream at every change of scope), placed on
//! the host clock through one anchor event, and written to the run's [`Recorder`] as today's
//! comm spans (the ready event as a zero-length marker `bucketN ready (compute stream, GPU
//! clock)`), so the Chrome trace and SVG show a GPU step. Times are read only once the
//! events completed (the next pass): never a host wait inside a step; when the stream is
//! dropped at the end of the run, the host waits for the last events once.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use brigade_comm::{Recorder, SpanId};
use brigade_tensor::{Event, Stream};

/// Times on one GPU relative to an anchor event whose host instant is known.
pub(crate) struct GpuClock {
    anchor: Event,
    anchor_at: Instant,
}

impl GpuClock {
    /// Records the anchor on `stream` and waits for it once (at setup, not in a step).
    pub(crate) fn new(stream: &Stream) -> brigade_tensor::Result<GpuClock> {
        let anchor = stream.record_event()?;
        anchor.synchronize()?;
        Ok(GpuClock {
            anchor,
            anchor_at: Instant::now(),
        })
    }

    /// The host instant of a completed event; `None` if it has not completed.
    fn at(&self, e: &Event) -> Option<Instant> {
        if !e.is_complete().ok()? {
            return None;
        }
        let ms = self.anchor.elapsed_ms(e).ok()?;
        let d = Duration::from_secs_f64(ms.abs() / 1e3);
        Some(if ms >= 0.0 {
            self.anchor_at + d
        } else {
            self.anchor_at.checked_sub(d)?
        })
    }
}

/// One bucket's events waiting to be timed.
struct Pending {
    span: SpanId,
    /// The marker of the bucket's ready event (recorded at issue, so that it belongs to the
    /// step that issued it).
    ready_span: Option<SpanId>,
    ready: Option<Event>,
    started: Option<Event>,
    done: Option<Event>,
}

/// A scope of backward on the compute stream: its host span and the events at its two ends.
struct ComputeSpan {
    span: SpanId,
    start: Event,
    end: Event,
}

/// The compute scope open now (its span and start event), and closed ones not yet timed.
type ComputeScopes = (Option<(SpanId, Event)>, Vec<ComputeSpan>);

/// Collectives and backward's compute scopes whose GPU times go into `recorder` once their
/// events completed.
pub(crate) struct GpuTimeline {
    rank: usize,
    recorder: Recorder,
    clock: GpuClock,
    pending: Mutex<Vec<Pending>>,
    /// The compute scope open now (its kind and start event), and closed ones not yet timed.
    compute: Mutex<ComputeScopes>,
}

impl GpuTimeline {
    pub(crate) fn new(rank: usize, recorder: Recorder, clock: GpuClock) -> Self {
        GpuTimeline {
            rank,
            recorder,
            clock,
            pending: Mutex::new(Vec::new()),
            compute: Mutex::new((None, Vec::new())),
        }
    }

    /// Backward's kernels enqueued from now on belong to `span` (`None`: the open one ended):
    /// `event`, just recorded on the compute stream, closes the open scope and opens the next.
    pub(crate) fn compute_scope(&self, span: Option<SpanId>, event: Event) {
        let mut c = self.compute.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((open, start)) = c.0.take() {
            c.1.push(ComputeSpan {
                span: open,
                start,
                end: event.clone(),
            });
        }
        c.0 = span.map(|s| (s, event));
    }

    /// Bucket `bucket`'s collective was issued now (the span belongs to the current step).
    pub(crate) fn issued(
        &self,
        bucket: usize,
        tag: &str,
        bytes: usize,
        ready: Option<Event>,
        started: Option<Event>,
        done: Option<Event>,
    ) {
        let span = self
            .recorder
            .comm_issued(self.rank, "all_reduce", tag, bytes, Some(bucket));
        let ready_span = ready.as_ref().map(|_| {
            let marker = format!("{tag} ready (compute stream, GPU clock)");
            self.recorder.comm_issued(self.rank, "ready", &marker, 0, None)
        });
        self.lock().push(Pending {
            span,
            ready_span,
            ready,
            started,
            done,
        });
    }

    /// Writes the times of every collective whose events completed.
    pub(crate) fn flush(&self) {
        let mut pending = self.lock();
        pending.retain(|p| {
            let (Some(start), Some(end)) = (
                p.started.as_ref().and_then(|e| self.clock.at(e)),
                p.done.as_ref().and_then(|e| self.clock.at(e)),
            ) else {
                return true;
            };
            if let (Some(marker), Some(ready)) = (p.ready_span, p.ready.as_ref().and_then(|e| self.clock.at(e))) {
                // The compute stream's moment the bucket was full: a zero-length marker.
                self.recorder.comm_started(marker, ready);
                self.recorder.comm_finished(marker, ready, None);
            }
            self.recorder.comm_started(p.span, start);
            self.recorder.comm_finished(p.span, end, None);
            false
        });
        drop(pending);
        let mut c = self.compute.lock().unwrap_or_else(|p| p.into_inner());
        c.1.retain(|span| {
            let (Some(start), Some(end)) = (self.clock.at(&span.start), self.clock.at(&span.end)) else {
                return true;
            };
            self.recorder.retime(span.span, start, end);
            false
        });
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Pending>> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for GpuTimeline {
    /// The run is over (not a step): the host waits for the last events, so the last step's
    /// collectives and compute scopes are in the timeline too.
    fn drop(&mut self) {
        for p in self.lock().iter() {
            if let Some(done) = &p.done {
                let _ = done.synchronize();
            }
        }
        {
            let c = self.compute.lock().unwrap_or_else(|p| p.into_inner());
            for span in &c.1 {
                let _ = span.end.synchronize();
            }
        }
        self.flush();
    }
}
