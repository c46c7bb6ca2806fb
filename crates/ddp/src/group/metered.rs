//! DDP's meter, as a wrapper of any [`ProcessGroup`]: every collective a policy issues is
//! counted once, into the wrapper's [`CommMeter`] (what this rank hands over, and what it sends
//! under the ring algorithms, [`brigade_comm::RingOp::wire_bytes`]); within a bucket's
//! reduction each collective, including those issued later from a continuation through a clone
//! of the group, is attributed to that bucket: in traces, and in the bucket's part of the meter,
//! which step profiles record.

use std::time::Duration;

use brigade_comm::{tagging_collectives, CommMeter, ReduceOp, RingOp, SpanId};
use brigade_tensor::{Stream, Tensor};

use super::{bytes, Group, ProcessGroup, ReadyEvent, SparseGather, TensorWork};

/// `inner`, each collective counted into `meter` (and attributed to `bucket`, when set).
pub struct Metered {
    inner: Group,
    meter: CommMeter,
    bucket: Option<usize>,
    link: Option<LinkTime>,
}

/// Seconds the collectives of one wrapper held the link, added up as they complete (clones
/// share it), each its comm-level work's span ([`super::TensorWork::on_ran`]: a simulated
/// link's slot, not the continuations after it): what a step profile separates from a policy's
/// own compute; with when the last of them left the link, and a wrapper it also reports to
/// ([`LinkTime::within`]). A span that overlaps those counted before it (a link that does not
/// serialise them, a stream timed from its take-up) adds only its part after them: the seconds
/// are the union of the spans, never more than the time they covered.
#[derive(Debug, Clone, Default)]
pub(crate) struct LinkTime(std::sync::Arc<std::sync::Mutex<Held>>);

/// What a [`LinkTime`] has added up.
#[derive(Debug, Default)]
struct Held {
    seconds: f64,
    left: Option<std::time::Instant>,
    outer: Option<LinkTime>,
}

impl LinkTime {
    /// A new count that also adds into `outer` (which outlives it: the collectives of every
    /// step's `after_step`).
    pub(crate) fn within(outer: &LinkTime) -> LinkTime {
        let t = LinkTime::default();
        t.lock().outer = Some(outer.clone());
        t
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Held> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn add(&self, d: Duration, left: std::time::Instant) {
        let outer = {
            let mut h = self.lock();
            // the stream starts and completes its collectives in order: what this span shares
            // with the union so far lies before the last one left
            let start = left.checked_sub(d).unwrap_or(left);
            let from = h.left.map_or(start, |l| l.max(start));
            h.seconds += left.saturating_duration_since(from).as_secs_f64();
            h.left = Some(h.left.map_or(left, |l| l.max(left)));
            h.outer.clone()
        };
        if let Some(o) = outer {
            o.add(d, left);
        }
    }

    /// The seconds added so far.
    pub(crate) fn seconds(&self) -> f64 {
        self.lock().seconds
    }

    /// When the last of its collectives left the comm stream (`None`: none has yet).
    pub(crate) fn left(&self) -> Option<std::time::Instant> {
        self.lock().left
    }
}

impl Metered {
    /// `inner`, counting into `meter`.
    pub fn new(inner: Group, meter: CommMeter) -> Metered {
        Metered {
            inner,
            meter,
            bucket: None,
            link: None,
        }
    }

    /// `inner`, its collectives attributed to bucket `index` and counted into `meter` (a part
    /// of DDP's meter, [`CommMeter::part`]).
    pub fn for_bucket(inner: Group, meter: CommMeter, index: usize) -> Metered {
        Metered {
            inner,
            meter,
            bucket: Some(index),
            link: None,
        }
    }

    /// This wrapper, also adding up into `link` how long its collectives ran.
    pub(crate) fn timing_into(mut self, link: LinkTime) -> Metered {
        self.link = Some(link);
        self
    }

    /// What this wrapper's collectives sent so far.
    pub fn meter(&self) -> &CommMeter {
        &self.meter
    }

    fn issue<T: Send + 'static>(
        &self,
        op: RingOp,
        bytes: usize,
        f: impl FnOnce(&dyn ProcessGroup) -> TensorWork<T>,
    ) -> TensorWork<T> {
        self.meter.count(op, bytes, self.inner.world_size());
        let work = match self.bucket {
            Some(index) => tagging_collectives(index, || f(self.inner.as_ref())),
            None => f(self.inner.as_ref()),
        };
        if let Some(link) = &self.link {
            let link = link.clone();
            work.on_ran(move |d, left| link.add(d, left));
        }
        work
    }
}

impl ProcessGroup for Metered {
    forward_group!(inner: identity, enqueues, hooks);

    fn all_reduce(&self, t: &Tensor, op: ReduceOp, tag: &str) -> TensorWork<Tensor> {
        self.issue(RingOp::AllReduce, bytes(t), |g| g.all_reduce(t, op, tag))
    }
    fn reduce_scatter_into(&self, input: &Tensor, output: &Tensor, op: ReduceOp, tag: &str) -> TensorWork<Tensor> {
        self.issue(RingOp::ReduceScatter, bytes(input), |g| {
            g.reduce_scatter_into(input, output, op, tag)
        })
    }
    fn all_gather_into(&self, input: &Tensor, output: &Tensor, tag: &str) -> TensorWork<Tensor> {
        self.issue(RingOp::AllGather, bytes(input), |g| {
            g.all_gather_into(input, output, tag)
        })
    }
    fn broadcast(&self, t: &Tensor, root: usize, tag: &str) -> TensorWork<Tensor> {
        self.issue(RingOp::Broadcast, bytes(t), |g| g.broadcast(t, root, tag))
    }
    fn barrier(&self, tag: &str) -> TensorWork<()> {
        self.issue(RingOp::Barrier, 0, |g| g.barrier(tag))
    }
    fn reduce_scatter(&self, t: &Tensor, op: ReduceOp, tag: &str) -> TensorWork<Tensor> {
        self.issue(RingOp::ReduceScatter, bytes(t), |g| g.reduce_scatter(t, op, tag))
    }
    fn all_gather(&self, t: &Tensor, tag: &str) -> TensorWork<Tensor> {
        self.issue(RingOp::AllGather, bytes(t), |g| g.all_gather(t, tag))
    }
    fn all_gather_with_side(&self, payload: &Tensor, side: &Tensor, tag: &str) -> TensorWork<(Tensor, Tensor)> {
        self.issue(RingOp::AllGather, bytes(payload) + bytes(side), |g| {
            g.all_gather_with_side(payload, side, tag)
        })
    }
    fn all_gather_sparse(
        &self,
        values: &Tensor,
        indices: &Tensor,
        capacity: usize,
        tag: &str,
    ) -> TensorWork<SparseGather> {
        // the capacity's values and indices, and the count, as they go on the wire
        let sent = capacity * (values.dtype().size_in_bytes() + indices.dtype().size_in_bytes()) + 8;
        self.issue(RingOp::AllGather, sent, |g| {
            g.all_gather_sparse(values, indices, capacity, tag)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn spans_that_overlap_are_counted_once() {
        // Three collectives issued together: the first on the link 0..1 ms, the second timed
        // from 0.5 ms (taken up while the first held the link) to 2 ms, the third 3..4 ms after
        // a gap. Their union is 0..2 and 3..4 ms: 3 ms, where their durations add up to 3.5 ms.
        let t0 = Instant::now();
        let ms = |m: f64| t0 + Duration::from_secs_f64(m * 1e-3);
        let outer = LinkTime::default();
        let link = LinkTime::within(&outer);
        link.add(Duration::from_micros(1000), ms(1.0));
        link.add(Duration::from_micros(1500), ms(2.0));
        link.add(Duration::from_micros(1000), ms(4.0));
        for (what, l) in [("the wrapper", &link), ("the one it reports to", &outer)] {
            assert!((l.seconds() - 3e-3).abs() < 1e-9, "{what}: {} s", l.seconds());
        }
        assert_eq!(link.left(), Some(ms(4.0)));
    }
}
