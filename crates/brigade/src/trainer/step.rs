//! One optimizer step: microbatches (or the join pass), DDP, clipping, the ranks' agreement
//! on the loss and on stopping, the update; and the evaluation between steps.

use std::time::Instant;

use brigade_autograd::no_grad;
use brigade_comm::{Buffer, CommBytes, Communicator, EventKind, ReduceOp};
use brigade_ddp::overlap::{RankProfile, StepInstants, StepProfile};
use brigade_models::SamplerCursor;
use brigade_tensor::{DType, Tensor};

use crate::data::Microbatch;
use crate::error::{Error, Result};
use crate::join::{Agreement, JoinMode};
use crate::outcome::StepOutcome;
use crate::recipe::{clip_factor, EvalSource};

use super::{batch_on, Trainer, EVAL_TAG, JOIN_SPAN, STEP_STATUS_TAG};

/// What the ranks agreed on at the end of a step.
struct StepStatus {
    loss: f64,
    nonfinite: bool,
    stop: bool,
    /// Under a join mode, the averaged slots of which ranks have data for the next step.
    next_active: Option<Vec<f32>>,
}

impl Trainer<'_> {
    /// Runs one optimizer step on this rank's shard of the global batch. Fails with
    /// [`Error::NonFinite`] on every rank, before the update, when the mean loss is not
    /// finite (unless `allow_nonfinite`).
    ///
    /// Under a join mode the step starts with the ranks' agreement on which of them have data
    /// ([`Trainer::agree_on_data`]); a rank without data joins (DDP's join pass, then the rest
    /// of the step as every rank runs it). Under [`JoinMode::Throw`] a step at which some rank
    /// has no data fails with [`Error::OutOfData`] on every rank; a step at which no rank has
    /// data is a configuration error (the run ends before it).
    pub fn step(&mut self) -> Result<StepOutcome> {
        let s = self.next_step;
        let (rank, world) = (self.ctx.rank, self.ctx.world_size);
        let (b, k) = (self.cfg.batch_size, self.cfg.accum);
        let t0 = Instant::now();
        let agreement = self.agree_on_data()?;
        if let Some(a) = &agreement {
            if let Some(e) = self.join.as_ref().and_then(|j| j.throw(a)) {
                return Err(e);
            }
            if a.none_active() {
                return Err(Error::Config(format!(
                    "step {s}: every rank's data has ended, there is nothing to train on"
                )));
            }
        }
        let has_data = agreement.as_ref().is_none_or(|a| a.active[rank]);
        // a due checkpoint holds the policy state this step starts from (a collective)
        self.policy_state_at_start = match (&self.ddp, self.checkpoint_due) {
            (Some(ddp), true) => Some(ddp.gather_policy_state()?),
            _ => None,
        };
        let sent_before = self.meter.totals();
        let step_span = self.begin(EventKind::Step(s));
        let lr = self.schedule.apply(self.opt.as_mut(), s as u64);
        self.model.params().zero_grad()?;
        // The microbatches' losses add up where they are computed; read back once per step.
        let mut step_loss: Option<Tensor> = None;
        if !has_data {
            // joined: every bucket reduced from zeros, the collectives of the others' backward
            if let Some(ddp) = &self.ddp {
                let span = self.begin(EventKind::Other(JOIN_SPAN.into()));
                let joined = ddp.join();
                self.end(span);
                if let Err(e) = joined {
                    self.end(step_span);
                    return Err(e.into());
                }
            }
        }
        for j in (0..k).filter(|_| has_data) {
            let mb = Microbatch {
                step: s,
                index: j,
                accum: k,
                rank,
                world_size: world,
                rows: b,
            };
            let batch = match self.cursor.as_mut() {
                None => self.data.batch(&mb)?,
                Some(cursor) => self.data.gather(rank, &cursor.next_rows(b))?,
            };
            let batch = batch_on(batch, self.device)?;
            let fwd = self.begin(EventKind::Forward);
            let loss = self.model.loss(&batch)?.mul_scalar(1.0 / k as f64)?;
            self.end(fwd);
            // f64, so the sum is the one the host loop computed before (f32 -> f64 is exact).
            let value = loss.value().to_dtype(DType::F64)?;
            step_loss = Some(match step_loss {
                Some(sum) => sum.add(&value)?,
                None => value,
            });
            match (&self.ddp, j + 1 < k) {
                (Some(ddp), true) => ddp.no_sync(|| loss.backward())?,
                _ => loss.backward()?,
            }
        }
        let local_loss = match step_loss {
            Some(sum) => sum.item()?,
            None => 0.0,
        };
        let mut status = self.agree(local_loss, agreement.as_ref())?;
        if let (Some(j), Some(slots)) = (self.join.as_mut(), status.next_active.take()) {
            j.agreed_next(s, &slots);
        }
        if status.nonfinite && !self.cfg.allow_nonfinite {
            self.end(step_span);
            let what = if world == 1 {
                "the loss".to_string()
            } else {
                format!("the loss (mean over {world} ranks)")
            };
            return Err(Error::NonFinite {
                step: s,
                what,
                value: status.loss,
            });
        }
        // divide-active: the policy divided the sum over the ranks with data by the world size
        if let (Some(a), Some(JoinMode::DivideActive), Some(ddp)) = (&agreement, self.cfg.join, &self.ddp) {
            let active = a.active_count();
            if active < world {
                ddp.scale_grads(world as f64 / active as f64)?;
            }
        }
        // what a periodic checkpoint sends (optimizer and policy state to rank 0) is not the step's
        let mut checkpoint_sent = CommBytes::default();
        if std::mem::take(&mut self.checkpoint_due) {
            // the state this step started from gave a finite loss: it is a good checkpoint
            let before = self.meter.totals();
            let written = self.checkpoint();
            checkpoint_sent = self.meter.totals() - before;
            match written {
                Ok(()) => {}
                Err(e) if e.is_agreed() => {
                    self.end(step_span);
                    return Err(e);
                }
                Err(e) => self.checkpoint_failed = Some(e),
            }
        }
        let grad_norm = match self.cfg.clip_grad_norm {
            Some(max) => Some(self.clip_grads(max)?),
            None => None,
        };
        let os = self.begin(EventKind::Optimizer);
        let optimizer_start = Instant::now();
        // without DDP (ranks training apart) a rank without data has no gradient to step on
        if has_data || self.ddp.is_some() {
            self.opt.step()?;
        }
        let optimizer_end = Instant::now();
        self.end(os);
        self.end(step_span);
        self.next_step += 1;
        self.next_position = self.cursor.as_ref().map(SamplerCursor::position);
        self.next_rng = self.model.rng_state();
        if let Some(ddp) = &self.ddp {
            let at = StepInstants {
                start: t0,
                optimizer_start,
                optimizer_end,
                end: Instant::now(),
            };
            // the profile holds the caps this step ran with: recorded before the autotuner
            // may change them
            let instrument = &self.cfg.instrument;
            if instrument.profile {
                self.profile = StepProfile::record(ddp, &at);
                if let (Some(p), Some(range)) = (&self.profile, &instrument.profile_steps) {
                    if range.contains(&s) {
                        self.profiles.push(p.clone());
                    }
                }
            }
            if let Some(tuner) = self.autotune.as_mut() {
                tuner.observe(ddp, s, RankProfile::record(ddp, &at))?;
            }
        }
        Ok(StepOutcome {
            step: s,
            loss: status.loss,
            ms: t0.elapsed().as_secs_f64() * 1e3,
            lr,
            grad_norm,
            stop: status.stop,
            sent: (self.meter.totals() - sent_before) - checkpoint_sent,
            sampler: self.next_position,
        })
    }

    /// Global-norm clipping of the averaged gradients (`torch.nn.utils.clip_grad_norm_`):
    /// returns the total norm before clipping. Under DDP the norm is the policy's (over every
    /// rank's shard when it shards them: a collective, run by every rank after the same
    /// backward) and what the policy holds is scaled; without DDP, this rank's gradients.
    fn clip_grads(&self, max: f64) -> Result<f64> {
        let norm = match &self.ddp {
            Some(ddp) => ddp.grad_norm_sq()?.sqrt(),
            None => {
                let mut sq = 0.0;
                for p in self.model.params().params() {
                    if let Some(g) = p.grad() {
                        sq += g.to_dtype(DType::F64)?.sqr()?.sum_all()?.item()?;
                    }
                }
                sq.sqrt()
            }
        };
        if let Some(factor) = clip_factor(norm, max) {
            match &self.ddp {
                Some(ddp) => ddp.scale_grads(factor)?,
                None => {
                    for p in self.model.params().params() {
                        if let Some(g) = p.grad() {
                            g.copy_from(&g.mul_scalar(factor)?)?;
                        }
                    }
                }
            }
        }
        Ok(norm)
    }

    /// The loss on held-out data: in eval mode, under `no_grad`, this rank's mean per row
    /// averaged over the ranks (a collective: every rank evaluates after the same step).
    pub fn evaluate(&mut self, data: &dyn EvalSource) -> Result<f64> {
        let batches = data.batches(self.ctx.rank, self.ctx.world_size)?;
        self.model.eval();
        let summed = no_grad(|| -> Result<(f64, usize)> {
            let (mut sum, mut rows) = (0.0, 0);
            for batch in batches {
                let n = batch.rows();
                let loss = self.model.loss(&batch_on(batch, self.device)?)?;
                sum += loss.value().to_dtype(DType::F64)?.item()? * n as f64;
                rows += n;
            }
            Ok((sum, rows))
        });
        self.model.train();
        let (sum, rows) = summed?;
        let mine = if rows == 0 { f64::NAN } else { sum / rows as f64 };
        if self.ctx.world_size == 1 {
            return Ok(mine);
        }
        let all = self
            .ctx
            .comm
            .all_reduce_blocking(Buffer::F32(vec![mine as f32]), ReduceOp::Avg, EVAL_TAG)?;
        match all.as_f32() {
            Some(&[v]) => Ok(f64::from(v)),
            _ => Err(Error::Protocol(format!(
                "the evaluation all-reduce returned {all:?}, expected 1 f32"
            ))),
        }
    }

    /// Under a join mode, the ranks' agreement on which of them have data for the next step (a
    /// collective, made once a step; [`crate::join`]); `None` without a join mode.
    pub fn agree_on_data(&mut self) -> Result<Option<Agreement>> {
        let s = self.next_step;
        match self.join.as_mut() {
            Some(j) => Ok(Some(j.agree(self.ctx.comm.as_ref(), s)?)),
            None => Ok(None),
        }
    }

    /// The ranks' one all-reduce per step: mean loss, whether any rank's loss is not finite,
    /// whether any rank was asked to stop. Under a join mode the mean is over the ranks with
    /// data (`agreement`; a joined rank sends no loss), and a slot per rank carries which ranks
    /// have data for the next step (the next step's agreement, without a collective of its own).
    fn agree(&self, local_loss: f64, agreement: Option<&Agreement>) -> Result<StepStatus> {
        let stop = self.stop_requested || self.observer().is_some_and(|o| o.stop_requested());
        let nonfinite = !local_loss.is_finite();
        if self.ctx.world_size == 1 {
            return Ok(StepStatus {
                loss: local_loss,
                nonfinite,
                stop,
                next_active: None,
            });
        }
        let flag = |b: bool| if b { 1.0 } else { 0.0 };
        let (rank, world) = (self.ctx.rank, self.ctx.world_size);
        let mut mine = vec![local_loss as f32, flag(nonfinite), flag(stop)];
        let next = self.join.as_ref().map(|j| j.next_slots(rank, world, self.next_step));
        mine.extend(next.iter().flatten());
        let expected = mine.len();
        let all = self
            .ctx
            .comm
            .all_reduce_blocking(Buffer::F32(mine), ReduceOp::Avg, STEP_STATUS_TAG)?;
        let Some((&[loss, nonfinite, stop], slots)) = all
            .as_f32()
            .filter(|v| v.len() == expected)
            .map(|v| v.split_at(3))
            .and_then(|(head, slots)| Some((<&[f32; 3]>::try_from(head).ok()?, slots)))
        else {
            return Err(Error::Protocol(format!(
                "the step status all-reduce returned {all:?}, expected {expected} f32"
            )));
        };
        let mut loss = f64::from(loss);
        if let Some(active) = agreement
            .map(Agreement::active_count)
            .filter(|&n| n > 0 && n < self.ctx.world_size)
        {
            loss *= self.ctx.world_size as f64 / active as f64;
        }
        Ok(StepStatus {
            loss,
            nonfinite: nonfinite > 0.0 || !loss.is_finite(),
            stop: stop > 0.0,
            next_active: next.map(|_| slots.to_vec()),
        })
    }
}
