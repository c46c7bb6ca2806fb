//! One optimizer step: microbatches (or the join pass), DDP, clipping, the ranks' agreement
//! on the loss and on stopping, the update; and the evaluation between steps.

use std::time::Instant;

use brigade_autograd::no_grad;
use brigade_comm::{Buffer, CommBytes, Communicator, ReduceOp, RingOp};
use brigade_ddp::overlap::{ControlProfile, ProfileRun, RankProfile, StepInstants, StepProfile};
use brigade_ddp::policy::WireOp;
use brigade_ddp::{MemoryPart, Phase};
use brigade_models::SamplerCursor;
use brigade_tensor::{DType, Tensor};

use crate::checkpoint::DistributedState;
use crate::error::{Error, Result};
use crate::join::{Agreement, JoinMode};
use crate::outcome::{StepOutcome, StepRecord};
use crate::recipe::{clip_factor, EvalSource};
use crate::source::Microbatch;

use super::{batch_on, StepMemory, Trainer, EVAL_TAG, JOIN_SPAN, STEP_STATUS_TAG};

/// What the ranks agreed on at the end of a step.
struct StepStatus {
    loss: f64,
    nonfinite: bool,
    stop: bool,
    /// Under a join mode, the averaged slots of which ranks have data for the next step.
    next_active: Option<Vec<f32>>,
    /// Bytes each rank handed to the agreement's all-reduce (0 on one rank: none ran).
    bytes: usize,
    /// When the agreement's all-reduce finished (its slot's finish on a simulated link, the
    /// same instant on every rank); `None` on one rank.
    finished: Option<Instant>,
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
    ///
    /// The phases, in order: [`Trainer::agree_on_data`], `forward_backward`, `agree_on_loss`,
    /// `scale_for_active`, `checkpoint_if_due`, `clip`, `optimizer_step`, `advance`,
    /// `record_profile`.
    pub fn step(&mut self) -> Result<StepOutcome> {
        let s = self.at.next_step;
        let t0 = Instant::now();
        self.records.memory.reset_peak();
        self.records.step_memory = StepMemory::default();
        let agreement = self.agree_on_data()?;
        let has_data = self.has_data(agreement.as_ref())?;
        // a due checkpoint holds the policy state and the buckets this step starts from (a
        // collective)
        self.saves.at_start = match (&self.replica.ddp, self.saves.due) {
            (Some(ddp), true) => Some(DistributedState {
                policy: ddp.gather_policy_state()?,
                ranks: vec![],
                buckets: ddp.bucket_grouping(),
                autotune: None,
            }),
            _ => None,
        };
        let sent_before = self.replica.meter.totals();
        let step_span = self.span(Phase::Step(s));
        let lr = self.schedule.apply(self.replica.opt.as_mut(), s as u64);
        let (scale, skipped_before) = (self.replica.opt.loss_scale(), self.replica.opt.skipped_steps());
        let local_loss = self.forward_backward(has_data)?;
        let status = self.agree_on_loss(local_loss, agreement.as_ref(), t0)?;
        self.scale_for_active(agreement.as_ref())?;
        let checkpoint_sent = self.checkpoint_if_due()?;
        let (grad_norm, optimizer) = {
            let _part = MemoryPart::Optimizer.enter();
            (self.clip()?, self.optimizer_step(has_data)?)
        };
        self.records.step_memory.peak = self.records.memory.peak();
        self.records.run_peak.observe(&self.records.memory, s);
        drop(step_span);
        self.advance(status.loss);
        self.record_profile(s, t0, optimizer)?;
        Ok(StepOutcome {
            record: StepRecord {
                step: s,
                loss: status.loss,
                ms: t0.elapsed().as_secs_f64() * 1e3,
                lr,
                grad_norm,
                val_loss: None,
                scale,
                skipped: self.replica.opt.skipped_steps() > skipped_before,
                sent: (self.replica.meter.totals() - sent_before) - checkpoint_sent,
                gather_wait_ms: self.replica.ddp.as_ref().map_or(0.0, |d| {
                    d.param_gathers().iter().map(|g| g.waited_s()).sum::<f64>() * 1e3
                }),
            },
            stop: status.stop,
            sampler: self.at.next_position,
        })
    }

    /// Whether this rank has data for the step the ranks agreed on (without a join mode,
    /// always); under [`JoinMode::Throw`] a step some rank has no data for is an error, and a
    /// step no rank has data for is one under every mode.
    fn has_data(&self, agreement: Option<&Agreement>) -> Result<bool> {
        let Some(a) = agreement else {
            return Ok(true);
        };
        if let Some(e) = self.feed.join.as_ref().and_then(|j| j.throw(a)) {
            return Err(e);
        }
        if a.none_active() {
            return Err(Error::Config(format!(
                "step {}: every rank's data has ended, there is nothing to train on",
                self.at.next_step
            )));
        }
        Ok(a.active[self.ctx.rank])
    }

    /// Forward and backward of the step's microbatches (the first `accum - 1` under
    /// `no_sync`), or, on a rank without data, DDP's join pass (every bucket reduced from
    /// zeros, the collectives of the others' backward). Returns this rank's loss of the step
    /// (0 without data).
    fn forward_backward(&mut self, has_data: bool) -> Result<f64> {
        self.replica.model.params().zero_grad()?;
        if !has_data {
            if let Some(ddp) = &self.replica.ddp {
                let _span = self.span(Phase::Other(JOIN_SPAN.into()));
                ddp.join()?;
            }
            return Ok(0.0);
        }
        let k = self.cfg.data.accum;
        // The microbatches' losses add up where they are computed; read back once per step.
        let mut step_loss: Option<Tensor> = None;
        for j in 0..k {
            let batch = self.microbatch(j)?;
            let before = self.records.memory.live();
            let loss = {
                let _span = self.span(Phase::Forward);
                let _part = MemoryPart::Activations.enter();
                let loss = self
                    .replica
                    .model
                    .loss(&batch)
                    .map_err(|e| self.forward_cause(e.into()))?;
                loss.mul_scalar(1.0 / k as f64)?
            };
            let held = self.records.memory.live().saturating_sub(before);
            let m = &mut self.records.step_memory;
            m.activations = m.activations.max(held);
            // f64, so the sum is the one the host loop computed before (f32 -> f64 is exact).
            let value = loss.value().to_dtype(DType::F64)?;
            step_loss = Some(match step_loss {
                Some(sum) => sum.add(&value)?,
                None => value,
            });
            // fp16: backward from the loss times the scale (the optimizer unscales)
            let loss = match self.replica.opt.loss_scale() {
                Some(scale) => loss.mul_scalar(scale)?,
                None => loss,
            };
            let _part = MemoryPart::Backward.enter();
            match (&self.replica.ddp, j + 1 < k) {
                (Some(ddp), _) if self.cfg.data.accum_into_shard && j > 0 => {
                    ddp.accumulate_into_shard(|| loss.backward())?
                }
                (Some(ddp), true) if !self.cfg.data.accum_into_shard => ddp.no_sync(|| loss.backward())?,
                _ => loss.backward()?,
            }
        }
        step_loss.map_or(Ok(0.0), |sum| Ok(sum.item()?))
    }

    /// What made a forward fail: the error the policy's parameter hooks met in it (a ZeRO-3
    /// gather that failed, leaving its parameters without their values) when there is one, or
    /// the forward's own error.
    fn forward_cause(&self, e: Error) -> Error {
        match self.replica.ddp.as_ref().and_then(|d| d.take_hooks_error()) {
            Some(source) => Error::Autograd(brigade_autograd::AutogradError::Subscriber {
                param: "<forward>".into(),
                source,
            }),
            None => e,
        }
    }

    /// This rank's microbatch `index` of the step, on the replica's device.
    fn microbatch(&mut self, index: usize) -> Result<brigade_models::Batch> {
        let (rank, rows) = (self.ctx.rank, self.cfg.data.batch_size);
        let batch = match self.feed.cursor.as_mut() {
            None => self.data.batch(&Microbatch {
                step: self.at.next_step,
                index,
                accum: self.cfg.data.accum,
                rank,
                world_size: self.ctx.world_size,
                rows,
            })?,
            Some(cursor) => self.data.gather(rank, &cursor.next_rows(rows))?,
        };
        batch_on(batch, self.replica.device)
    }

    /// The ranks' agreement on the step's loss and on stopping ([`Trainer::agree`]), the join's
    /// record of who has data next; fails with [`Error::NonFinite`] when the mean loss is not
    /// finite (unless `allow_nonfinite`). `step_start`: when the step started, the origin of its
    /// profile's times.
    fn agree_on_loss(
        &mut self,
        local_loss: f64,
        agreement: Option<&Agreement>,
        step_start: Instant,
    ) -> Result<StepStatus> {
        let (s, world) = (self.at.next_step, self.ctx.world_size);
        let mut status = self.agree(local_loss, agreement)?;
        let finish_s = status
            .finished
            .map(|f| f.saturating_duration_since(step_start).as_secs_f64());
        self.records.step_control = self.control_collective(status.bytes, finish_s);
        if let (Some(j), Some(slots)) = (self.feed.join.as_mut(), status.next_active.take()) {
            j.agreed_next(s, &slots);
        }
        if status.nonfinite && !self.cfg.recipe.allow_nonfinite {
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
        Ok(status)
    }

    /// The agreement's all-reduce of `bytes` as the step's profile records it, with the time it
    /// held a simulated link and when it finished (`finish_s`, from the step's start); none when
    /// it did not run.
    fn control_collective(&self, bytes: usize, finish_s: Option<f64>) -> Vec<ControlProfile> {
        if bytes == 0 {
            return vec![];
        }
        let link_s = self.ctx.net.map_or(0.0, |m| {
            m.time(RingOp::AllReduce, bytes, self.ctx.world_size).as_secs_f64()
        });
        vec![ControlProfile {
            op: WireOp::AllReduce,
            bytes,
            link_s,
            finish_s,
        }]
    }

    /// Under divide-active, the policy divided the sum over the ranks with data by the world
    /// size: the gradients are scaled to the mean over the ranks with data.
    fn scale_for_active(&self, agreement: Option<&Agreement>) -> Result<()> {
        let world = self.ctx.world_size;
        if let (Some(a), Some(JoinMode::DivideActive), Some(ddp)) = (agreement, self.cfg.data.join, &self.replica.ddp) {
            let active = a.active_count();
            if active < world {
                ddp.scale_grads(world as f64 / active as f64)?;
            }
        }
        Ok(())
    }

    /// Writes the periodic checkpoint that is due (the state this step started from gave a
    /// finite loss: it is a good checkpoint). Returns what it sent (optimizer and policy state
    /// to rank 0), which is not the step's; a failure of rank 0's write is kept, not returned.
    fn checkpoint_if_due(&mut self) -> Result<CommBytes> {
        if !std::mem::take(&mut self.saves.due) {
            return Ok(CommBytes::default());
        }
        let before = self.replica.meter.totals();
        let written = self.checkpoint();
        let sent = self.replica.meter.totals() - before;
        match written {
            Ok(()) => {}
            Err(e) if e.is_agreed() => return Err(e),
            Err(e) => self.saves.failed = Some(e),
        }
        Ok(sent)
    }

    /// Clips the gradients when the run clips ([`Trainer::clip_grads`]): the norm before.
    fn clip(&self) -> Result<Option<f64>> {
        self.cfg
            .recipe
            .clip_grad_norm
            .map(|max| self.clip_grads(max))
            .transpose()
    }

    /// The optimizer's update, in its timeline span; returns when it started and ended. Without
    /// DDP (ranks training apart) a rank without data has no gradient to step on.
    fn optimizer_step(&mut self, has_data: bool) -> Result<(Instant, Instant)> {
        let _span = self.span(Phase::Optimizer);
        let start = Instant::now();
        if has_data || self.replica.ddp.is_some() {
            self.replica.opt.step()?;
        }
        Ok((start, Instant::now()))
    }

    /// The step is done: the next one starts where the cursor and the dropout generator stand.
    fn advance(&mut self, loss: f64) {
        self.at.next_step += 1;
        self.at.last_loss = Some(loss.to_string());
        self.at.next_position = self.feed.cursor.as_ref().map(SamplerCursor::position);
        self.at.next_rng = self.replica.model.rng_state();
    }

    /// Under DDP, step `s`'s profile (when profiling; kept when `s` is in `profile_steps`) and
    /// what the autotuner learns from it. The profile holds the caps this step ran with: it is
    /// recorded before the autotuner may change them.
    fn record_profile(
        &mut self,
        s: usize,
        start: Instant,
        (optimizer_start, optimizer_end): (Instant, Instant),
    ) -> Result<()> {
        let Some(ddp) = &self.replica.ddp else {
            return Ok(());
        };
        let at = StepInstants {
            start,
            optimizer_start,
            optimizer_end,
            end: Instant::now(),
        };
        let instrument = &self.cfg.runtime.instrument;
        if instrument.profile {
            let run = self.profile_run()?;
            self.records.profile = StepProfile::record(ddp, &at).map(|mut p| {
                p.activation_checkpointing = self.cfg.model.activation_checkpointing;
                p.run = Some(run);
                if let Some(mine) = p.ranks.first_mut() {
                    mine.control = self.records.step_control.clone();
                }
                p
            });
        }
        let records = &mut self.records;
        if instrument.profile {
            if let (Some(p), Some(range)) = (&records.profile, &instrument.profile_steps) {
                if range.contains(&s) {
                    records.profiles.push(p.clone());
                }
            }
        }
        if let Some(tuner) = records.autotune.as_mut() {
            tuner.observe(ddp, s, RankProfile::record(ddp, &at))?;
        }
        Ok(())
    }

    /// What ran in this step, for its profile: the model, the rows of a microbatch, the
    /// optimizer's state per parameter, the precision and, on rank 0, the memory it measured.
    fn profile_run(&self) -> Result<ProfileRun> {
        let memory = match (&self.replica.ddp, self.ctx.rank) {
            (Some(ddp), 0) => {
                let measured = self.records.step_memory;
                Some(
                    self.records
                        .run_peak
                        .report(measured, ddp.rank_memory(self.replica.opt.as_ref())?),
                )
            }
            _ => None,
        };
        Ok(ProfileRun {
            model: self.cfg.model.name.clone(),
            model_config: self.cfg.model.config.clone(),
            rows: self.cfg.data.batch_size,
            optimizer_state_per_param: self.cfg.recipe.optimizer.state_per_param(),
            precision: match self.cfg.recipe.precision.param_dtype {
                DType::BF16 => "bf16",
                DType::F16 => "fp16",
                _ => "f32",
            }
            .into(),
            memory,
            command: vec![],
        })
    }

    /// Global-norm clipping of the averaged gradients (`torch.nn.utils.clip_grad_norm_`):
    /// returns the total norm before clipping. Under DDP the norm is the policy's (over every
    /// rank's shard when it shards them: a collective, run by every rank after the same
    /// backward) and what the policy holds is scaled; without DDP, this rank's gradients.
    fn clip_grads(&self, max: f64) -> Result<f64> {
        let norm = match &self.replica.ddp {
            Some(ddp) => ddp.grad_norm_sq()?.sqrt(),
            None => {
                let mut sq = 0.0;
                for p in self.replica.model.params().params() {
                    if let Some(g) = p.grad() {
                        sq += g.to_dtype(DType::F64)?.sqr()?.sum_all()?.item()?;
                    }
                }
                sq.sqrt()
            }
        };
        // under loss scaling the gradients are `scale` times too large: the norm is divided by
        // it (clipping is a factor, the same on scaled or unscaled gradients); a non-finite
        // norm means a step the optimizer skips, so nothing is clipped
        let norm = norm / self.replica.opt.loss_scale().unwrap_or(1.0);
        if !norm.is_finite() && self.replica.opt.loss_scale().is_some() {
            return Ok(norm);
        }
        if let Some(factor) = clip_factor(norm, max) {
            match &self.replica.ddp {
                Some(ddp) => ddp.scale_grads(factor)?,
                None => {
                    for p in self.replica.model.params().params() {
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
        self.replica.model.eval();
        // ZeRO-3: the model whole for the evaluation, whose batches differ between ranks (a
        // collective before and after, not one per forward)
        if let Some(ddp) = &self.replica.ddp {
            ddp.gather_full_params()?;
        }
        let summed = no_grad(|| -> Result<(f64, usize)> {
            let (mut sum, mut rows) = (0.0, 0);
            for batch in batches {
                let n = batch.rows();
                let loss = self.replica.model.loss(&batch_on(batch, self.replica.device)?)?;
                sum += loss.value().to_dtype(DType::F64)?.item()? * n as f64;
                rows += n;
            }
            Ok((sum, rows))
        });
        self.replica.model.train();
        if let Some(ddp) = &self.replica.ddp {
            ddp.release_full_params()?;
        }
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
        let s = self.at.next_step;
        match self.feed.join.as_mut() {
            Some(j) => Ok(Some(j.agree(self.ctx.comm.as_ref(), s)?)),
            None => Ok(None),
        }
    }

    /// The ranks' one all-reduce per step: mean loss, whether any rank's loss is not finite,
    /// whether any rank was asked to stop. Under a join mode the mean is over the ranks with
    /// data (`agreement`; a joined rank sends no loss), and a slot per rank carries which ranks
    /// have data for the next step (the next step's agreement, without a collective of its own).
    fn agree(&self, local_loss: f64, agreement: Option<&Agreement>) -> Result<StepStatus> {
        let stop = self.saves.stop_requested || self.observer().is_some_and(|o| o.stop_requested());
        let nonfinite = !local_loss.is_finite();
        if self.ctx.world_size == 1 {
            return Ok(StepStatus {
                loss: local_loss,
                nonfinite,
                stop,
                next_active: None,
                bytes: 0,
                finished: None,
            });
        }
        let flag = |b: bool| if b { 1.0 } else { 0.0 };
        let (rank, world) = (self.ctx.rank, self.ctx.world_size);
        let mut mine = vec![local_loss as f32, flag(nonfinite), flag(stop)];
        let next = self
            .feed
            .join
            .as_ref()
            .map(|j| j.next_slots(rank, world, self.at.next_step));
        mine.extend(next.iter().flatten());
        let expected = mine.len();
        let (all, timing) =
            self.ctx
                .comm
                .all_reduce_blocking_timed(Buffer::F32(mine), ReduceOp::Avg, STEP_STATUS_TAG)?;
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
            bytes: 4 * expected,
            finished: Some(timing.finished),
        })
    }
}
