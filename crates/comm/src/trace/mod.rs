//! Tracing: per-rank timelines of compute and communication.
//!
//! A [`Recorder`] collects [`TraceEvent`]s; every recorded instant gets a global sequence number
//! ([`Stamp::seq`]) taken when the recorder learns of it, so tests can check the order of events
//! exactly, without relying on clock resolution. A traced comm stream ([`crate::CommStream::traced`]) records every collective of a
//! communicator; training code records compute spans itself.
//!
//! Every event has a typed [`EventKind`]: a compute span with the caller's label (and, if the
//! caller gives them, an index and a scope), or a collective with the caller's number. Readers
//! select events by kind, never by parsing names; the caller's own layer owns the words. The
//! name stays beside it for people (Chrome trace, charts).

mod chrome;
mod traced;

use std::cell::Cell;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use serde::{Deserialize, Serialize};

pub use chrome::chrome_trace;
pub(crate) use traced::Tracing;

/// Which timeline of a rank an event belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Track {
    /// The rank's compute thread (the caller's spans).
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

/// What an event is: a span the caller labelled, or a collective. comm knows no caller's
/// vocabulary; a training loop, for instance, labels its spans with its phases and tags the
/// collectives that serve one unit of its work with that unit's number.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum EventKind {
    /// A compute span, in the caller's words.
    Span {
        /// What ran (e.g. `"forward"`).
        label: String,
        /// Which one of a numbered series it is, if any (e.g. an iteration).
        index: Option<usize>,
        /// Where it ran, if the caller names a part of its program (e.g. `"layers.3"`).
        scope: Option<String>,
    },
    /// A collective on the comm stream; `tag` is the caller's number for what it serves (set
    /// by [`tagging_collectives`]), or `None`.
    Collective {
        /// The caller's number, or `None` for a collective issued outside every tag.
        tag: Option<usize>,
    },
}

impl EventKind {
    /// A span labelled `label`, with no index and no scope.
    pub fn span(label: &str) -> EventKind {
        EventKind::Span {
            label: label.to_string(),
            index: None,
            scope: None,
        }
    }

    /// A span labelled `label`, the `index`th of its series.
    pub fn indexed(label: &str, index: usize) -> EventKind {
        EventKind::Span {
            label: label.to_string(),
            index: Some(index),
            scope: None,
        }
    }

    /// A span labelled `label` that ran in `scope`.
    pub fn scoped(label: &str, scope: &str) -> EventKind {
        EventKind::Span {
            label: label.to_string(),
            index: None,
            scope: Some(scope.to_string()),
        }
    }

    /// The caller's tag of this collective, if it is a tagged collective.
    pub fn tag(&self) -> Option<usize> {
        match self {
            EventKind::Collective { tag } => *tag,
            EventKind::Span { .. } => None,
        }
    }
}

/// The name shown in traces: a span's label, then its index and its scope when it has them
/// (`"forward"`, `"step 3"`, `"backward layers.0"`); a collective shows as `"collective"` (its
/// event's name is its text tag).
impl fmt::Display for EventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EventKind::Span { label, index, scope } => {
                f.write_str(label)?;
                if let Some(i) = index {
                    write!(f, " {i}")?;
                }
                if let Some(s) = scope {
                    write!(f, " {s}")?;
                }
                Ok(())
            }
            EventKind::Collective { .. } => f.write_str("collective"),
        }
    }
}

thread_local! {
    /// The tag of collectives issued on this thread (see [`tagging_collectives`]).
    static TAG: Cell<Option<usize>> = const { Cell::new(None) };
}

/// Runs `issue` with every collective it issues on this thread tagged `tag`: a traced comm
/// stream ([`crate::CommStream::traced`]) records them as [`EventKind::Collective`] `{ tag: Some(tag) }`. (Like
/// `torch.profiler.record_function`, a scope on the calling thread: collectives are issued on
/// the caller's thread, whatever wrappers lie between it and the backend.)
pub fn tagging_collectives<R>(tag: usize, issue: impl FnOnce() -> R) -> R {
    let outer = TAG.with(|t| t.replace(Some(tag)));
    let out = issue();
    TAG.with(|t| t.set(outer));
    out
}

/// The tag set by an enclosing [`tagging_collectives`] on this thread.
fn current_tag() -> Option<usize> {
    TAG.with(|t| t.get())
}

/// One span on a rank's timeline.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceEvent {
    /// Index in recording order (what [`SpanId`] refers to).
    pub id: usize,
    /// The rank.
    pub rank: usize,
    /// Compute or comm stream.
    pub track: Track,
    /// What the event is: select events by this, not by name.
    pub kind: EventKind,
    /// For people: for compute, the kind's name (e.g. `"forward"`); for comm, the collective's
    /// text tag.
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
    events: Mutex<Vec<TraceEvent>>,
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

    fn events_mut(&self) -> MutexGuard<'_, Vec<TraceEvent>> {
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
        kind: EventKind,
        name: String,
        op: &str,
        bytes: usize,
    ) -> (MutexGuard<'_, Vec<TraceEvent>>, usize) {
        let mut events = self.events_mut();
        let id = events.len();
        events.push(TraceEvent {
            id,
            rank,
            track,
            kind,
            name,
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

    /// Records, now, that a compute span of `kind` on `rank` begins; end it with [`Recorder::end`].
    pub fn begin(&self, rank: usize, kind: EventKind) -> SpanId {
        let name = kind.to_string();
        let (mut events, id) = self.push(rank, Track::Compute, kind, name, "", 0);
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
    pub fn span(&self, rank: usize, kind: EventKind) -> SpanGuard {
        SpanGuard {
            recorder: self.clone(),
            id: self.begin(rank, kind),
        }
    }

    /// Records a finished compute span after the fact (both instants get sequence numbers now).
    pub fn compute_span(&self, rank: usize, kind: EventKind, start: Instant, end: Instant) -> SpanId {
        let name = kind.to_string();
        let (mut events, id) = self.push(rank, Track::Compute, kind, name, "", 0);
        events[id].start = Some(self.stamp(start));
        events[id].end = Some(self.stamp(end));
        SpanId(id)
    }

    /// Moves a span's instants to `start` and `end` (measured after the fact, e.g. on a GPU
    /// clock), keeping the order in which it was recorded, so that it stays inside the spans around it.
    pub fn retime(&self, span: SpanId, start: Instant, end: Instant) {
        let mut events = self.events_mut();
        let e = &mut events[span.0];
        match e.start.as_mut() {
            Some(s) => s.at = start,
            None => e.start = Some(self.stamp(start)),
        }
        match e.end.as_mut() {
            Some(s) => s.at = end,
            None => e.end = Some(self.stamp(end)),
        }
    }

    /// Records, now, that `rank` issued collective `op` (e.g. `"all_reduce"`) tagged `tag` on
    /// `bytes` bytes, with the caller's number `number` if any (see [`tagging_collectives`]).
    /// Used by a traced comm stream ([`crate::CommStream::traced`]).
    pub fn comm_issued(&self, rank: usize, op: &str, tag: &str, bytes: usize, number: Option<usize>) -> SpanId {
        let kind = EventKind::Collective { tag: number };
        let (mut events, id) = self.push(rank, Track::Comm, kind, tag.to_string(), op, bytes);
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
    pub fn events(&self) -> Vec<TraceEvent> {
        self.events_mut().clone()
    }

    /// The events during the compute spans of kind `kind` on every rank: each rank's spans of
    /// that kind and everything that rank issued or began while one lasted (sequence numbers,
    /// not clocks, decide). Empty when no rank recorded such a span.
    pub fn events_during(&self, kind: &EventKind) -> Vec<TraceEvent> {
        let events = self.events();
        let bounds: Vec<(usize, u64, u64)> = events
            .iter()
            .filter(|e| e.track == Track::Compute && e.kind == *kind)
            .filter_map(|e| e.start.map(|s| (e.rank, s.seq, e.end.map_or(u64::MAX, |end| end.seq))))
            .collect();
        events
            .into_iter()
            .filter(|e| {
                let Some(first) = e.issued.or(e.start) else {
                    return false;
                };
                bounds
                    .iter()
                    .any(|&(r, begin, end)| r == e.rank && first.seq >= begin && first.seq < end)
            })
            .collect()
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
