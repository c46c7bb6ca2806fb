//! Per-op timing of a training step: where each millisecond went, by op kind, forward and
//! backward (the autograd-level view of PyTorch's `torch.profiler` "group by op" table).
//!
//! Off unless a thread opens [`profile_ops`]; then, on that thread only, each recorded op
//! is charged the wall time since the previous op was recorded (its forward kernel plus the
//! glue that led to it), and each backward closure is charged its own run. Gradient sums
//! between nodes are charged to `accumulate_grad`. The cost when off is one thread-local
//! read per op.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Calls and total time of one op kind in one direction.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct OpTime {
    /// How many times it ran.
    pub calls: usize,
    /// Wall time over all calls.
    pub total: Duration,
}

/// The per-op times gathered while [`profile_ops`] ran.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OpProfile {
    /// Forward time per op name (`linear`, `layer_norm`, `attention`, ...).
    pub forward: BTreeMap<&'static str, OpTime>,
    /// Backward time per op name, plus `accumulate_grad` (summing gradients between nodes
    /// and into leaves).
    pub backward: BTreeMap<&'static str, OpTime>,
}

impl OpProfile {
    /// Total forward time.
    pub fn forward_total(&self) -> Duration {
        self.forward.values().map(|t| t.total).sum()
    }

    /// Total backward time.
    pub fn backward_total(&self) -> Duration {
        self.backward.values().map(|t| t.total).sum()
    }

    /// Adds another profile's calls and times into this one (several steps, several ranks).
    pub fn merge(&mut self, other: &OpProfile) {
        for (mine, theirs) in [
            (&mut self.forward, &other.forward),
            (&mut self.backward, &other.backward),
        ] {
            for (op, t) in theirs {
                let e = mine.entry(op).or_default();
                e.calls += t.calls;
                e.total += t.total;
            }
        }
    }
}

struct Recorder {
    profile: OpProfile,
    last_mark: Instant,
}

thread_local! {
    static RECORDER: RefCell<Option<Recorder>> = const { RefCell::new(None) };
}

/// Runs `f` with per-op timing on for this thread and returns its result with the profile.
/// Nested calls are not supported: the inner one takes over and the outer one sees nothing
/// of the inner part.
pub fn profile_ops<R>(f: impl FnOnce() -> R) -> (R, OpProfile) {
    RECORDER.with(|r| {
        *r.borrow_mut() = Some(Recorder {
            profile: OpProfile::default(),
            last_mark: Instant::now(),
        })
    });
    let out = f();
    let profile = RECORDER
        .with(|r| r.borrow_mut().take())
        .map(|r| r.profile)
        .unwrap_or_default();
    (out, profile)
}

/// Restarts the forward clock: time from here to the next recorded op is charged to it.
/// Call before the first op of a forward pass so that earlier work (data loading, the
/// optimizer) is not charged to it.
pub fn mark_forward_start() {
    RECORDER.with(|r| {
        if let Some(r) = r.borrow_mut().as_mut() {
            r.last_mark = Instant::now();
        }
    });
}

/// Charges the time since the last mark to the forward of `op` (called as each op is recorded).
pub(crate) fn forward_op(op: &'static str) {
    RECORDER.with(|r| {
        if let Some(r) = r.borrow_mut().as_mut() {
            let now = Instant::now();
            let e = r.profile.forward.entry(op).or_default();
            e.calls += 1;
            e.total += now - r.last_mark;
            r.last_mark = now;
        }
    });
}

/// True while this thread profiles (so backward only reads the clock when asked to).
pub(crate) fn enabled() -> bool {
    RECORDER.with(|r| r.borrow().is_some())
}

/// Charges `took` to the backward of `op`.
pub(crate) fn backward_op(op: &'static str, took: Duration) {
    RECORDER.with(|r| {
        if let Some(r) = r.borrow_mut().as_mut() {
            let e = r.profile.backward.entry(op).or_default();
            e.calls += 1;
            e.total += took;
        }
    });
}

/// Runs `f` with this thread's per-op timing paused (nothing it records is charged), e.g. a
/// checkpointed scope's recompute, whose whole time its `checkpoint` node is charged with.
pub(crate) fn paused<R>(f: impl FnOnce() -> R) -> R {
    let saved = RECORDER.with(|r| r.borrow_mut().take());
    let out = f();
    if let Some(saved) = saved {
        RECORDER.with(|r| *r.borrow_mut() = Some(saved));
    }
    out
}
