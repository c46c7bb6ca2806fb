//! Tracing: per-rank timelines of compute and communication.
//!
//! A [`Recorder`] collects [`Event`]s; every recorded instant gets a global sequence number
//! ([`Stamp::seq`]) taken when the recorder learns of it, so tests can check the order of events
//! exactly, without relying on clock resolution. [`Traced`] records every collective of a
//! communicator; training code records compute spans itself.

mod chrome;
mod traced;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

pub use chrome::chrome_trace;
pub use traced::Traced;

/// Which timeline of a rank an event belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Track {
    /// The rank's compute thread (forward, backward, optimizer, ...).
    Compute,
    /// The rank's comm stream.
    Comm,
}

/// A recorded instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp {
    /// Global order in which the recorder learned of the instants (strictly increasing, shared
    /// by all ranks and tracks).
    pub seq: u64,
    /// When it happened.
    pub at: Instant,
}

/// One span on a rank's timeline.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// Index in recording order (what [`SpanId`] refers to).
    pub id: usize,
    /// The rank.
    pub rank: usize,
    /// Compute or comm stream.
    pub track: Track,
    /// For compute: the span's name (e.g. `"backward layer 3"`). For comm: the collective's tag.
    pub name: String,
    /// For comm: the collective (`"all_reduce"`, ...); empty for compute.
    pub op: String,
    /// For comm: bytes of the buffer passed in; 0 for compute.
    pub bytes: usize,
    /// For comm: when the collective was issued by the caller.
    pub issued: Option<Stamp>,
    /// When the span began (comm: started on the comm stream).
    pub start: Option<Stamp>,
    /// When the span ended (comm: finished on the comm stream).
    pub end: Option<Stamp>,
    /// For comm: the error, when the collective failed.
    pub error: Option<String>,
}

/// Identifies an event of a [`Recorder`], to stamp its later instants.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SpanId(pub usize);

struct Inner {
    origin: Instant,
    seq: AtomicU64,
    events: Mutex<Vec<Event>>,
}

/// Thread-safe event collector; cloning is cheap and clones share the same events.
#[derive(Clone)]
pub struct Recorder {
    inner: Arc<Inner>,
}

impl Default for Recorder {
    fn default() -> Self {
        Self::new()
    }
}

impl Recorder {
    /// An empty recorder; its creation instant is time zero of the exported trace.
    pub fn new() -> Self {
        Recorder {
            inner: Arc::new(Inner {
                origin: Instant::now(),
                seq: AtomicU64::new(0),
                events: Mutex::new(Vec::new()),
            }),
        }
    }

    fn events_mut(&self) -> MutexGuard<'_, Vec<Event>> {
        self.inner.events.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Stamps `at` with the next sequence number. Callers hold the events lock, so sequence
    /// order and insertion order agree.
    fn stamp(&self, at: Instant) -> Stamp {
        Stamp {
            seq: self.inner.seq.fetch_add(1, Ordering::Relaxed),
            at,
        }
    }

    fn push(
        &self,
        rank: usize,
        track: Track,
        name: &str,
        op: &str,
        bytes: usize,
    ) -> (MutexGuard<'_, Vec<Event>>, usize) {
        let mut events = self.events_mut();
        let id = events.len();
        events.push(Event {
            id,
            rank,
            track,
            name: name.to_string(),
            op: op.to_string(),
            bytes,
            issued: None,
            start: None,
            end: None,
            error: None,
        });
        (events, id)
    }

    /// Time zero of the exported trace.
    pub fn origin(&self) -> Instant {
        self.inner.origin
    }

    /// Records, now, that compute span `name` of `rank` begins; end it with [`Recorder::end`].
    pub fn begin(&self, rank: usize, name: &str) -> SpanId {
        let (mut events, id) = self.push(rank, Track::Compute, name, "", 0);
        events[id].start = Some(self.stamp(Instant::now()));
        SpanId(id)
    }

    /// Records, now, the end of a span begun with [`Recorder::begin`].
    pub fn end(&self, span: SpanId) {
        let mut events = self.events_mut();
        let stamp = self.stamp(Instant::now());
        events[span.0].end = Some(stamp);
    }

    /// Begins a compute span that ends when the guard is dropped.
    pub fn span(&self, rank: usize, name: &str) -> SpanGuard {
        SpanGuard {
            recorder: self.clone(),
            id: self.begin(rank, name),
        }
    }

    /// Records a finished compute span after the fact (both instants get sequence numbers now).
    pub fn compute_span(&self, rank: usize, name: &str, start: Instant, end: Instant) -> SpanId {
        let (mut events, id) = self.push(rank, Track::Compute, name, "", 0);
        events[id].start = Some(self.stamp(start));
        events[id].end = Some(self.stamp(end));
        SpanId(id)
    }

    /// Records, now, that `rank` issued collective `op` (e.g. `"all_reduce"`) tagged `tag` on
    /// `bytes` bytes. Used by [`Traced`]; other wrappers may call it too.
    pub fn comm_issued(&self, rank: usize, op: &str, tag: &str, bytes: usize) -> SpanId {
        let (mut events, id) = self.push(rank, Track::Comm, tag, op, bytes);
        events[id].issued = Some(self.stamp(Instant::now()));
        SpanId(id)
    }

    /// Records that the collective started on the comm stream at `at`.
    pub fn comm_started(&self, span: SpanId, at: Instant) {
        let mut events = self.events_mut();
        let stamp = self.stamp(at);
        events[span.0].start = Some(stamp);
    }

    /// Records that the collective finished at `at`, with its error if it failed.
    pub fn comm_finished(&self, span: SpanId, at: Instant, error: Option<String>) {
        let mut events = self.events_mut();
        let stamp = self.stamp(at);
        events[span.0].end = Some(stamp);
        events[span.0].error = error;
    }

    /// A snapshot of every event so far, in recording order.
    pub fn events(&self) -> Vec<Event> {
        self.events_mut().clone()
    }
}

/// Ends its compute span when dropped.
pub struct SpanGuard {
    recorder: Recorder,
    id: SpanId,
}

impl SpanGuard {
    /// The span being recorded.
    pub fn id(&self) -> SpanId {
        self.id
    }
}

impl Drop for SpanGuard {
    fn drop(&mut self) {
        self.recorder.end(self.id);
    }
}
