//! Watching a run: the library draws nothing and prints nothing; progress, logging and per-step
//! reports go to a [`TrainObserver`] the caller sets in
//! [`Instrumentation::observer`](crate::config::Instrumentation::observer) (the `brigade`
//! binary's progress bar and summary are one). Rank 0 tells it when the run starts
//! ([`RunStart`]), after every step ([`StepRecord`]: the ranks agree on each step's loss, so
//! rank 0's view is the run's) and when the run ends; every rank asks it once a step whether
//! to stop. [`on_step`] makes an observer of a closure called after every step.

use crate::error::Error;
use crate::outcome::{StepRecord, TrainOutcome};
use crate::recipe::HyperparameterChange;

/// The run about to start, as rank 0 sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct RunStart {
    /// The number of ranks.
    pub world_size: usize,
    /// The first step to run (non-zero after a resume).
    pub first_step: usize,
    /// The step the run trains until.
    pub steps: usize,
}

/// Watches a run. Every method has a default that does nothing, so an observer implements
/// only what it needs. `Sync`: the ranks of one process share it.
pub trait TrainObserver: Send + Sync {
    /// Rank 0 is about to run its first step.
    fn run_started(&self, _start: &RunStart) {}

    /// Something the user should know before the run, which does not stop it (for example that
    /// mpirun left this rank fewer cores than the host has for it: [`crate::launch::binding_note`]).
    /// Told before [`TrainObserver::run_started`].
    fn note(&self, _message: &str) {}

    /// Rank 0 resumed a checkpoint and this run changed some of its hyperparameters (the run
    /// uses its own; told before [`TrainObserver::run_started`], only when something changed).
    fn resumed(&self, _changes: &[HyperparameterChange]) {}

    /// Rank 0 finished a step (every rank agreed on its loss).
    fn step_finished(&self, _record: &StepRecord) {}

    /// Rank 0's run ended: what it produced (also when the ranks agreed to stop early: see
    /// [`TrainOutcome::stopped`] and [`TrainOutcome::interrupted`]), or the error that ended it.
    fn run_finished(&self, _outcome: Result<&TrainOutcome, &Error>) {}

    /// Whether to stop after the current step (asked on every rank once a step, before the
    /// ranks agree on it: any rank's yes stops every rank after that step). E.g. on a signal.
    fn stop_requested(&self) -> bool {
        false
    }
}

/// Two observers, each told everything; stop when either asks.
impl<A: TrainObserver, B: TrainObserver> TrainObserver for (A, B) {
    fn run_started(&self, start: &RunStart) {
        self.0.run_started(start);
        self.1.run_started(start);
    }

    fn note(&self, message: &str) {
        self.0.note(message);
        self.1.note(message);
    }

    fn resumed(&self, changes: &[HyperparameterChange]) {
        self.0.resumed(changes);
        self.1.resumed(changes);
    }

    fn step_finished(&self, record: &StepRecord) {
        self.0.step_finished(record);
        self.1.step_finished(record);
    }

    fn run_finished(&self, outcome: Result<&TrainOutcome, &Error>) {
        self.0.run_finished(outcome);
        self.1.run_finished(outcome);
    }

    fn stop_requested(&self) -> bool {
        self.0.stop_requested() || self.1.stop_requested()
    }
}

/// A shared observer (one the caller keeps a handle to, to read back after the run: a
/// [`crate::tensorboard::TensorBoard`]'s failure), told everything.
impl<T: TrainObserver + ?Sized> TrainObserver for std::sync::Arc<T> {
    fn run_started(&self, start: &RunStart) {
        (**self).run_started(start);
    }

    fn note(&self, message: &str) {
        (**self).note(message);
    }

    fn resumed(&self, changes: &[HyperparameterChange]) {
        (**self).resumed(changes);
    }

    fn step_finished(&self, record: &StepRecord) {
        (**self).step_finished(record);
    }

    fn run_finished(&self, outcome: Result<&TrainOutcome, &Error>) {
        (**self).run_finished(outcome);
    }

    fn stop_requested(&self) -> bool {
        (**self).stop_requested()
    }
}

/// An observer that may be absent (a flag not given): `None` watches nothing.
impl<T: TrainObserver> TrainObserver for Option<T> {
    fn run_started(&self, start: &RunStart) {
        if let Some(o) = self {
            o.run_started(start);
        }
    }

    fn note(&self, message: &str) {
        if let Some(o) = self {
            o.note(message);
        }
    }

    fn resumed(&self, changes: &[HyperparameterChange]) {
        if let Some(o) = self {
            o.resumed(changes);
        }
    }

    fn step_finished(&self, record: &StepRecord) {
        if let Some(o) = self {
            o.step_finished(record);
        }
    }

    fn run_finished(&self, outcome: Result<&TrainOutcome, &Error>) {
        if let Some(o) = self {
            o.run_finished(outcome);
        }
    }

    fn stop_requested(&self) -> bool {
        self.as_ref().is_some_and(|o| o.stop_requested())
    }
}

/// An observer that calls `f` after every step (on rank 0) and does nothing else: per-step
/// printing in one line,
/// `instrument: Instrumentation { observer: Some(on_step(|s| println!("{} {:.4}", s.step, s.loss))), ..Default::default() }`.
pub fn on_step<F: Fn(&StepRecord) + Send + Sync + 'static>(f: F) -> std::sync::Arc<dyn TrainObserver> {
    std::sync::Arc::new(OnStep(f))
}

/// What [`on_step`] makes.
struct OnStep<F>(F);

impl<F: Fn(&StepRecord) + Send + Sync> TrainObserver for OnStep<F> {
    fn step_finished(&self, record: &StepRecord) {
        (self.0)(record)
    }
}
