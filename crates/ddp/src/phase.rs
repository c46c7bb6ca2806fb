//! The training loop's words for its trace spans: a step, a forward pass, backward through a
//! scope, the wait for the buckets, the optimizer's update (PyTorch's profiler uses the same:
//! `ProfilerStep#N`, forward, backward, `Optimizer.step`, the DDP reducer's bucket
//! all-reduces). comm records spans with a caller's label and collectives with a caller's
//! number; a [`Phase`] is that label, and a bucket's index is that number.

use brigade_comm::EventKind;

/// One phase of a training step, as a trace span.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Phase {
    /// One whole training step (the enclosing compute span of everything the step did).
    Step(usize),
    /// A forward pass (one microbatch).
    Forward,
    /// Backward through the ops of one scope (e.g. `"layers.3"`); `None`: ops outside every
    /// scope (the loss).
    Backward {
        /// The scope the ops were recorded under.
        scope: Option<String>,
    },
    /// Waiting for the gradient buckets' all-reduces at the end of backward.
    WaitForBuckets,
    /// The optimizer's update.
    Optimizer,
    /// Any other compute span, named by the caller.
    Other(String),
}

const STEP: &str = "step";
const FORWARD: &str = "forward";
const BACKWARD: &str = "backward";
const BACKWARD_LOSS: &str = "backward loss";
const WAIT_FOR_BUCKETS: &str = "wait for buckets";
const OPTIMIZER: &str = "optimizer";

impl Phase {
    /// Backward through the ops of `scope` (`None`: outside every scope).
    pub fn backward(scope: Option<&str>) -> Phase {
        Phase::Backward {
            scope: scope.map(str::to_string),
        }
    }

    /// The trace span's kind, whose name is the phase's: `"step 3"`, `"forward"`,
    /// `"backward layers.0"`, `"backward loss"`, `"wait for buckets"`, `"optimizer"`.
    pub fn kind(&self) -> EventKind {
        match self {
            Phase::Step(s) => EventKind::indexed(STEP, *s),
            Phase::Forward => EventKind::span(FORWARD),
            Phase::Backward { scope: Some(scope) } => EventKind::scoped(BACKWARD, scope),
            Phase::Backward { scope: None } => EventKind::span(BACKWARD_LOSS),
            Phase::WaitForBuckets => EventKind::span(WAIT_FOR_BUCKETS),
            Phase::Optimizer => EventKind::span(OPTIMIZER),
            Phase::Other(name) => EventKind::span(name),
        }
    }

    /// The phase a span's kind records, or `None` for a collective.
    pub fn of(kind: &EventKind) -> Option<Phase> {
        let EventKind::Span { label, index, scope } = kind else {
            return None;
        };
        Some(match (label.as_str(), index, scope) {
            (STEP, Some(s), None) => Phase::Step(*s),
            (FORWARD, None, None) => Phase::Forward,
            (BACKWARD, None, Some(scope)) => Phase::backward(Some(scope)),
            (BACKWARD_LOSS, None, None) => Phase::backward(None),
            (WAIT_FOR_BUCKETS, None, None) => Phase::WaitForBuckets,
            (OPTIMIZER, None, None) => Phase::Optimizer,
            _ => Phase::Other(kind.to_string()),
        })
    }
}

impl From<Phase> for EventKind {
    fn from(phase: Phase) -> EventKind {
        phase.kind()
    }
}

/// The bucket a collective reduces, if DDP issued it for one (DDP tags a bucket's collectives
/// with the bucket's index, in launch order).
pub fn bucket_of(kind: &EventKind) -> Option<usize> {
    kind.tag()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_phase_reads_back_from_its_kind_and_keeps_its_name() {
        let phases = [
            (Phase::Step(3), "step 3"),
            (Phase::Forward, "forward"),
            (Phase::backward(Some("layers.0")), "backward layers.0"),
            (Phase::backward(None), "backward loss"),
            (Phase::WaitForBuckets, "wait for buckets"),
            (Phase::Optimizer, "optimizer"),
            (Phase::Other("join".into()), "join"),
        ];
        for (phase, name) in phases {
            let kind = phase.kind();
            assert_eq!(kind.to_string(), name);
            assert_eq!(Phase::of(&kind), Some(phase));
        }
        assert_eq!(Phase::of(&EventKind::Collective { tag: Some(2) }), None);
        assert_eq!(bucket_of(&EventKind::Collective { tag: Some(2) }), Some(2));
    }
}
