//! The run: steps until `steps` or a stop, evaluating and checkpointing on the way, telling
//! the observer, and the outcome with every output the run made.

use crate::error::{Error, Result};
use crate::join;
use crate::launch::{binding_note, CommBackend};
use crate::observe::{RunStart, StepRecord, TrainObserver};
use crate::outcome::{CheckpointFailure, TrainOutcome};

use super::{compute_threads, Trainer};

impl Trainer<'_> {
    /// Steps until `steps` (or a stop request), checkpointing every `checkpoint.every` steps and
    /// at the end. On rank 0 the run's observer is told when the run starts, after every step and
    /// when it ends (also when it fails).
    pub fn run(self) -> Result<TrainOutcome> {
        let observer = self.cfg.instrument.observer.clone().filter(|_| self.ctx.rank == 0);
        if let Some(o) = &observer {
            if self.ctx.launcher == CommBackend::Mpi {
                if let Some(note) = binding_note(self.ctx.local_ranks, compute_threads(self.cfg, self.ctx)) {
                    o.note(&note);
                }
            }
            if !self.resume_changes.is_empty() {
                o.resumed(&self.resume_changes);
            }
            if let Some(note) = &self.resume_note {
                o.note(note);
            }
            o.run_started(&RunStart {
                world_size: self.ctx.world_size,
                first_step: self.first_step,
                steps: self.cfg.steps,
            });
        }
        let outcome = self.run_steps(observer.as_deref());
        if let Some(o) = &observer {
            o.run_finished(outcome.as_ref());
        }
        outcome
    }

    fn run_steps(mut self, observer: Option<&dyn TrainObserver>) -> Result<TrainOutcome> {
        let (mut losses, mut step_ms, mut sent, mut interrupted) = (vec![], vec![], vec![], false);
        let (mut lrs, mut grad_norms, mut val_losses) = (vec![], vec![], vec![]);
        let (mut stopped, mut checkpoint_error) = (None, None);
        while self.next_step < self.cfg.steps {
            // a join run ends when no rank has data left; its last step is then evaluated as
            // the last step of `steps` is (every rank ends here together)
            if self.agree_on_data()?.is_some_and(|a| a.none_active()) {
                if let (Some(e), Some(last @ None)) = (&self.cfg.eval, val_losses.last_mut()) {
                    *last = Some(self.evaluate(e.data.as_ref())?);
                }
                break;
            }
            let s = match self.step() {
                Ok(s) => s,
                Err(e) if e.is_agreed() => {
                    stopped = Some(e);
                    break;
                }
                Err(e) => return Err(e),
            };
            let val_loss = match &self.cfg.eval {
                Some(e) if (s.step + 1) % e.every.max(1) == 0 || s.step + 1 == self.cfg.steps => {
                    Some(self.evaluate(e.data.as_ref())?)
                }
                _ => None,
            };
            val_losses.push(val_loss);
            losses.push(s.loss);
            lrs.push(s.lr);
            grad_norms.push(s.grad_norm);
            step_ms.push(s.ms);
            sent.push(s.sent);
            if let Some(o) = observer {
                o.step_finished(&StepRecord {
                    step: s.step,
                    loss: s.loss,
                    step_ms: s.ms,
                    lr: s.lr,
                    grad_norm: s.grad_norm,
                    val_loss,
                    sent: s.sent,
                });
            }
            // Rank 0 could not write the step's periodic checkpoint: every rank stops after the
            // next step (they agree on it then), and the outputs are written before the error.
            if let Some(error) = self.checkpoint_failed.take() {
                checkpoint_error.get_or_insert(CheckpointFailure { periodic: true, error });
                self.stop_requested = true;
            }
            if s.stop {
                interrupted = self.next_step < self.cfg.steps;
                break;
            }
            // Due now, written by the next step once its loss is finite (or at the end).
            self.checkpoint_due = self
                .cfg
                .checkpoint
                .every
                .is_some_and(|e| e > 0 && self.next_step.is_multiple_of(e));
        }
        // The end (also of a run of zero steps, or an interrupted one) is always checkpointed,
        // unless the run diverged (the last good checkpoint stays). A failed write there is
        // reported with the other outputs, which are still written.
        let diverged = matches!(stopped, Some(Error::NonFinite { .. }));
        if !diverged && checkpoint_error.is_none() && self.checkpointed != Some(self.next_step) {
            match self.checkpoint() {
                Ok(()) => {}
                Err(e) if e.is_agreed() => stopped = stopped.or(Some(e)),
                Err(error) => checkpoint_error = Some(CheckpointFailure { periodic: false, error }),
            }
        }
        // a join run: the ranks prove they hold the same parameters (a collective)
        if let (Some(_), Some(_), false) = (&self.join, &self.ddp, diverged) {
            match join::check_replicas(self.ctx.control.as_ref(), &self.model.params().named_values()) {
                Ok(()) => {}
                Err(e) if e.is_agreed() => stopped = stopped.or(Some(e)),
                Err(e) => return Err(e),
            }
        }
        let (buckets, memory, rank_memory) = match &self.ddp {
            Some(ddp) => (
                ddp.buckets(),
                Some(ddp.memory()),
                Some(ddp.rank_memory(self.opt.as_ref())?),
            ),
            None => (vec![], None, None),
        };
        let params = if self.ctx.rank == 0 {
            self.model.params().named_values()
        } else {
            vec![]
        };
        Ok(TrainOutcome {
            first_step: self.first_step,
            losses,
            lrs,
            grad_norms,
            val_losses,
            resume_changes: std::mem::take(&mut self.resume_changes),
            step_ms,
            sent,
            interrupted,
            stopped,
            checkpoint_error,
            profile: self.profile.take(),
            profiles: std::mem::take(&mut self.profiles),
            autotune: self.autotune.as_ref().zip(self.ddp.as_ref()).map(|(t, d)| t.report(d)),
            buckets,
            memory,
            rank_memory,
            params,
            rank_lengths: self.lengths.clone(),
            sampler: self.next_position,
            policy_diagnostics: self.ddp.as_ref().map(|d| d.policy_diagnostics()).unwrap_or_default(),
            join: self.join.as_ref().map(|j| j.mode),
            joined_at: self.join.as_ref().map(|j| j.joined_at.clone()).unwrap_or_default(),
            data_ended: self.join.as_ref().and_then(|j| j.ended_at),
        })
    }
}
