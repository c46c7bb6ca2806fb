//! The run: steps until `steps` or a stop, evaluating and checkpointing on the way, telling
//! the observer, and the outcome with every output the run made.

use crate::error::{Error, Result};
use crate::join;
use crate::launch::{binding_note, CommBackend};
use crate::observe::{RunStart, TrainObserver};
use crate::outcome::{CheckpointFailure, StepRecord, TrainOutcome};

use super::{compute_threads, Trainer};

use std::sync::{Mutex, PoisonError};

impl Trainer<'_> {
    /// Steps until `steps` (or a stop request), checkpointing every `checkpoint.every` steps and
    /// at the end. On rank 0 the run's observer is told when the run starts, after every step and
    /// when it ends (also when it fails).
    pub fn run(self) -> Result<TrainOutcome> {
        self.run_keeping(&Mutex::new(None))
    }

    /// [`Trainer::run`], and when a failure that is not agreed (a collective that timed out)
    /// stops rank 0 after steps finished, rank 0 leaves its outcome of those steps in
    /// `finished` (no parameters: gathering them needs the collectives that failed) before it
    /// returns the error: what [`crate::fit()`] reports of such a run.
    pub fn run_keeping(self, finished: &Mutex<Option<TrainOutcome>>) -> Result<TrainOutcome> {
        let observer = self
            .cfg
            .runtime
            .instrument
            .observer
            .clone()
            .filter(|_| self.ctx.rank == 0);
        if let Some(o) = &observer {
            if self.ctx.launcher == CommBackend::Mpi {
                if let Some(note) = binding_note(self.ctx.local_ranks, compute_threads(self.cfg, self.ctx)) {
                    o.note(&note);
                }
            }
            if !self.resume.changes.is_empty() {
                o.resumed(&self.resume.changes);
            }
            for note in &self.resume.notes {
                o.note(note);
            }
            o.run_started(&RunStart {
                world_size: self.ctx.world_size,
                first_step: self.at.first_step,
                steps: self.cfg.recipe.steps,
            });
        }
        let outcome = self.run_steps(observer.as_deref(), finished);
        if let Some(o) = &observer {
            o.run_finished(outcome.as_ref());
        }
        outcome
    }

    /// The steps, one after the other, until `steps`, a stop, an agreed error or the end of
    /// every rank's data; then the end of the run ([`Trainer::finish`]).
    fn run_steps(
        mut self,
        observer: Option<&dyn TrainObserver>,
        finished: &Mutex<Option<TrainOutcome>>,
    ) -> Result<TrainOutcome> {
        let mut ended = Ended::default();
        while self.at.next_step < self.cfg.recipe.steps {
            // a join run ends when no rank has data left; its last step is then evaluated as
            // the last step of `steps` is (every rank ends here together)
            if self.agree_on_data()?.is_some_and(|a| a.none_active()) {
                self.evaluate_last(&mut ended.steps)?;
                break;
            }
            let outcome = match self.step() {
                Ok(s) => s,
                Err(e) if e.is_agreed() => {
                    ended.stopped = Some(e);
                    break;
                }
                // rank 0 keeps what finished: its steps, for the caller to write
                Err(e) if self.ctx.rank == 0 && !ended.steps.is_empty() => {
                    *finished.lock().unwrap_or_else(PoisonError::into_inner) = Some(self.finished_part(ended));
                    return Err(e);
                }
                Err(e) => return Err(e),
            };
            let record = self.keep(outcome.record, &mut ended)?;
            if let Some(o) = observer {
                o.step_finished(&record);
            }
            if outcome.stop {
                ended.interrupted = self.at.next_step < self.cfg.recipe.steps;
                break;
            }
            // Due now, written by the next step once its loss is finite (or at the end).
            self.saves.due = self
                .cfg
                .runtime
                .checkpoint
                .every
                .is_some_and(|e| e > 0 && self.at.next_step.is_multiple_of(e));
        }
        self.finish(&mut ended)?;
        self.outcome(ended)
    }

    /// The step's record, with its validation loss when the step evaluates, kept in `ended`. A
    /// periodic checkpoint that rank 0 could not write in the step stops every rank after the
    /// next step (they agree on it then); the outputs are written before the error.
    fn keep(&mut self, mut record: StepRecord, ended: &mut Ended) -> Result<StepRecord> {
        record.val_loss = match &self.cfg.recipe.eval {
            Some(e) if (record.step + 1).is_multiple_of(e.every.max(1)) || record.step + 1 == self.cfg.recipe.steps => {
                Some(self.evaluate(e.data.as_ref())?)
            }
            _ => None,
        };
        ended.steps.push(record);
        if let Some(error) = self.saves.failed.take() {
            ended
                .checkpoint_error
                .get_or_insert(CheckpointFailure { periodic: true, error });
            self.saves.stop_requested = true;
        }
        Ok(record)
    }

    /// Evaluates after the last step run when it did not (a join run whose data ended).
    fn evaluate_last(&mut self, steps: &mut [StepRecord]) -> Result<()> {
        if let (Some(e), Some(last)) = (&self.cfg.recipe.eval, steps.last_mut()) {
            if last.val_loss.is_none() {
                last.val_loss = Some(self.evaluate(e.data.as_ref())?);
            }
        }
        Ok(())
    }

    /// The end of the run: the final checkpoint (also of a run of zero steps, or an interrupted
    /// one), unless the run diverged (the last good checkpoint stays), a failed write reported
    /// with the other outputs, which are still written; under a join mode, the ranks' proof
    /// that they hold the same parameters (a collective).
    fn finish(&mut self, ended: &mut Ended) -> Result<()> {
        let diverged = matches!(ended.stopped, Some(Error::NonFinite { .. }));
        if !diverged && ended.checkpoint_error.is_none() && self.saves.written != Some(self.at.next_step) {
            match self.checkpoint() {
                Ok(()) => {}
                Err(e) if e.is_agreed() => ended.stopped = ended.stopped.take().or(Some(e)),
                Err(error) => ended.checkpoint_error = Some(CheckpointFailure { periodic: false, error }),
            }
        }
        // (a policy whose ranks diverge between syncs may end with other parameters on each)
        let identical = |d: &brigade_ddp::DistributedDataParallel| d.replicas() == brigade_ddp::Replicas::Identical;
        if let (Some(_), Some(true), false) = (&self.feed.join, self.replica.ddp.as_ref().map(identical), diverged) {
            let params = self.replica.model.params().named_values();
            match join::check_replicas(self.ctx.control.as_ref(), &params) {
                Ok(()) => {}
                Err(e) if e.is_agreed() => ended.stopped = ended.stopped.take().or(Some(e)),
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// The run's outcome on this rank: `ended`, and what the replica, its DDP and the join hold.
    fn outcome(mut self, ended: Ended) -> Result<TrainOutcome> {
        let ddp = self.replica.ddp.as_ref();
        let measured = self.records.step_memory;
        let memory = ddp
            .map(|d| d.rank_memory(self.replica.opt.as_ref()))
            .transpose()?
            .map(|m| self.records.run_peak.report(measured, m));
        // ZeRO beside 16-bit parameters: rank 0 gathers every rank's f32 master shards
        // (a collective; a no-op for optimizers holding whole masters)
        if ddp.is_some() && self.cfg.recipe.precision.is_mixed() {
            self.replica.opt.consolidate_state()?;
        }
        let params = self.whole_params()?;
        let join = self.feed.join.as_ref();
        Ok(TrainOutcome {
            first_step: self.at.first_step,
            steps: ended.steps,
            resume_changes: std::mem::take(&mut self.resume.changes),
            interrupted: ended.interrupted,
            stopped: ended.stopped,
            checkpoint_error: ended.checkpoint_error,
            profile: self.records.profile.take(),
            profiles: std::mem::take(&mut self.records.profiles),
            autotune: self.records.autotune.as_ref().zip(ddp).map(|(t, d)| t.report(d)),
            buckets: ddp.map(|d| d.buckets()).unwrap_or_default(),
            memory,
            params,
            rank_lengths: self.feed.lengths.clone(),
            sampler: self.at.next_position,
            policy_diagnostics: ddp.map(|d| d.policy_diagnostics()).unwrap_or_default(),
            join: join.map(|j| j.mode),
            joined_at: join.map(|j| j.joined_at.clone()).unwrap_or_default(),
            data_ended: join.and_then(|j| j.ended_at),
        })
    }

    /// The outcome of the steps that finished before a rank failed, made without a collective
    /// (they may be what failed): the steps and this rank's profiles; no parameters, buckets
    /// or memory.
    fn finished_part(mut self, ended: Ended) -> TrainOutcome {
        TrainOutcome {
            first_step: self.at.first_step,
            steps: ended.steps,
            resume_changes: std::mem::take(&mut self.resume.changes),
            interrupted: false,
            stopped: None,
            checkpoint_error: ended.checkpoint_error,
            profile: self.records.profile.take(),
            profiles: std::mem::take(&mut self.records.profiles),
            autotune: None,
            buckets: vec![],
            memory: None,
            params: vec![],
            rank_lengths: self.feed.lengths.clone(),
            sampler: self.at.next_position,
            policy_diagnostics: vec![],
            join: self.feed.join.as_ref().map(|j| j.mode),
            joined_at: vec![],
            data_ended: None,
        }
    }

    /// Rank 0's copy of the whole model as the run ends (the other ranks: none): its full
    /// weights (the f32 masters beside 16-bit parameters, once consolidated); under ZeRO-3 the
    /// parameters gathered from every rank's shard (a collective, which every rank joins).
    fn whole_params(&self) -> Result<Vec<(String, brigade_tensor::Tensor)>> {
        // f32 ZeRO-3 gathers the whole parameters (a collective); under mixed precision the
        // consolidated f32 masters are the whole weights
        Ok(match self.replica.ddp.as_ref() {
            Some(d) if d.shards_parameters() && !self.cfg.recipe.precision.is_mixed() => {
                let whole = d.summon_full_params(|| -> Result<Vec<(String, brigade_tensor::Tensor)>> {
                    match self.ctx.rank {
                        0 => self
                            .replica
                            .model
                            .params()
                            .named_values()
                            .into_iter()
                            .map(|(n, t)| Ok((n, t.copy()?)))
                            .collect(),
                        _ => Ok(vec![]),
                    }
                })?;
                whole?
            }
            _ => match self.ctx.rank {
                0 => crate::checkpoint::full_weights(self.replica.model.as_ref(), self.replica.opt.as_ref()),
                _ => vec![],
            },
        })
    }
}

/// How the steps went, gathered as they run.
#[derive(Default)]
struct Ended {
    steps: Vec<StepRecord>,
    interrupted: bool,
    stopped: Option<Error>,
    checkpoint_error: Option<CheckpointFailure>,
}
