//! Writing the checkpoint of the state after the last step: the finite check, the
//! collectives that bring every rank's part to rank 0, and rank 0's write.

use brigade_comm::all_gather_bytes;
use brigade_models::RngState;

use crate::checkpoint::{save_checkpoint, CheckpointIdentity, DistributedState};
use crate::error::{Error, Result};
use crate::resume::recipe_metadata;

use super::{state_layout, Trainer};

impl Trainer<'_> {
    /// Writes the checkpoint (rank 0) of the state after the last step run, to
    /// [`crate::config::CheckpointConfig::path_at`] that step, in the run's lineage, then removes
    /// the lineage's checkpoints beyond `keep_last` ([`crate::checkpoint_files`]). Unless
    /// `allow_nonfinite`, first checks that every parameter is finite, so that a diverged run
    /// never overwrites the last good checkpoint.
    pub fn checkpoint(&mut self) -> Result<()> {
        let Some(path) = self.cfg.runtime.checkpoint.path_at(self.at.next_step) else {
            return Ok(());
        };
        // ZeRO-3: the model whole on every rank while it is checked and written (a collective)
        if let Some(ddp) = &self.replica.ddp {
            ddp.gather_full_params()?;
        }
        let written = self.checkpoint_whole(&path);
        if let Some(ddp) = &self.replica.ddp {
            ddp.release_full_params()?;
        }
        written
    }

    /// [`Trainer::checkpoint`] of the whole parameters.
    fn checkpoint_whole(&mut self, path: &std::path::Path) -> Result<()> {
        if !self.cfg.recipe.allow_nonfinite {
            self.check_finite()?;
        }
        // ZeRO: every rank sends its shard of the optimizer state to rank 0 (a collective).
        self.replica.opt.consolidate_state()?;
        // Every rank's policy state, on rank 0, and the buckets (a collective unless the step
        // gathered them); under a diverging policy every rank's own parameters and optimizer
        // state (a collective; the step has not updated them yet).
        let (distributed, policy_name) = match &self.replica.ddp {
            Some(ddp) => {
                let mut state = match self.saves.at_start.take() {
                    Some(state) => state,
                    None => DistributedState {
                        policy: ddp.gather_policy_state()?,
                        ranks: vec![],
                        buckets: ddp.bucket_grouping(),
                        autotune: None,
                    },
                };
                state.ranks = ddp.gather_rank_state(self.replica.opt.as_ref())?;
                // the autotuner has not observed the step a due checkpoint is written in yet
                state.autotune = self.records.autotune.as_ref().map(|t| t.progress());
                (state, Some(ddp.policy_name()))
            }
            None => (DistributedState::default(), None),
        };
        // Every rank's dropout generator, on rank 0 (a collective).
        let dropout_rng = self.gather_rngs()?;
        if self.ctx.rank == 0 {
            let files = &self.cfg.runtime.checkpoint;
            let lineage = &mut self.saves.lineage;
            let generation = match lineage.generation {
                Some(g) => g,
                None => *lineage.generation.insert(files.next_generation(lineage)),
            };
            let mut id = self.identity(policy_name.as_deref(), dropout_rng);
            id.lineage = self.saves.lineage.metadata(generation).to_vec();
            let (model, opt) = (self.replica.model.as_ref(), self.replica.opt.as_ref());
            save_checkpoint(path, &id, model, opt, &distributed, self.at.next_step)?;
            files.prune(&self.saves.lineage, path)?;
        }
        self.saves.written = Some(self.at.next_step);
        Ok(())
    }

    /// Every parameter is finite. Every rank holds the same parameters under DDP, so every
    /// rank reaches the same verdict; under a policy whose ranks diverge the ranks agree on the
    /// first rank's (a collective), so that none goes on to the checkpoint's gathers alone.
    fn check_finite(&self) -> Result<()> {
        let mut found = None;
        for (name, t) in self.replica.model.params().named_values() {
            if let Some(&v) = t.to_f64_vec()?.iter().find(|v| !v.is_finite()) {
                found = Some((format!("parameter '{name}' after the update"), v));
                break;
            }
        }
        let diverging = (self.replica.ddp.as_ref()).is_some_and(|d| d.replicas() != brigade_ddp::Replicas::Identical);
        if diverging && self.ctx.world_size > 1 {
            let mine = found.map(|(what, v)| format!("{what}\t{v}")).unwrap_or_default();
            let all = all_gather_bytes(self.ctx.control.as_ref(), mine.into_bytes(), "parameters finite")?;
            found = all.iter().enumerate().find(|(_, b)| !b.is_empty()).map(|(r, b)| {
                let text = String::from_utf8_lossy(b);
                let (what, v) = text.rsplit_once('\t').unwrap_or((&text, "NaN"));
                (format!("rank {r}'s {what}"), v.parse().unwrap_or(f64::NAN))
            });
        }
        match found {
            Some((what, value)) => Err(Error::NonFinite {
                step: self.at.next_step.saturating_sub(1),
                what,
                value,
            }),
            None => Ok(()),
        }
    }

    /// What the checkpoint of the state before step `next_step` records of the run.
    fn identity<'s>(&'s self, policy: Option<&'s str>, dropout_rng: Vec<RngState>) -> CheckpointIdentity<'s> {
        let mut recipe = recipe_metadata(self.cfg, &self.schedule);
        recipe.extend(self.feed.join.iter().flat_map(|j| j.metadata(self.at.next_step)));
        recipe.extend(
            self.at
                .last_loss
                .iter()
                .map(|l| (crate::checkpoint::LAST_LOSS_KEY.to_string(), l.clone())),
        );
        recipe.extend(
            self.cfg
                .runtime
                .checkpoint
                .metadata
                .iter()
                .map(|(k, v)| (format!("{}{k}", crate::checkpoint::USER_PREFIX), v.clone())),
        );
        CheckpointIdentity {
            model: &self.cfg.model.name,
            optimizer: self.cfg.recipe.optimizer.name(),
            seed: self.cfg.model.seed,
            data: self.data.fingerprint(),
            layout: state_layout(self.cfg),
            world_size: self.ctx.world_size,
            data_order: self.cfg.data.order.describe(),
            sampler: self.at.next_position,
            model_config: self.cfg.model.config.clone(),
            recipe,
            policy,
            dropout_rng,
            lineage: vec![],
            allow_nonfinite: self.cfg.recipe.allow_nonfinite,
        }
    }

    /// Every rank's dropout generator as it stood when step `next_step` began, by rank (on
    /// every rank; a collective over the bare communicator when there are several ranks).
    /// Empty when the model draws nothing on some rank.
    fn gather_rngs(&self) -> Result<Vec<RngState>> {
        let encode = |s: Option<RngState>| -> Vec<u8> {
            s.map(|s| [s.seed.to_le_bytes(), s.offset.to_le_bytes()].concat())
                .unwrap_or_default()
        };
        let all = if self.ctx.world_size == 1 {
            vec![encode(self.at.next_rng)]
        } else {
            all_gather_bytes(self.ctx.control.as_ref(), encode(self.at.next_rng), "dropout rng")?
        };
        let decode = |b: &Vec<u8>| -> Option<RngState> {
            let (seed, offset) = b.split_at_checked(8)?;
            Some(RngState {
                seed: u64::from_le_bytes(seed.try_into().ok()?),
                offset: u64::from_le_bytes(offset.try_into().ok()?),
            })
        };
        Ok(all.iter().map(decode).collect::<Option<Vec<_>>>().unwrap_or_default())
    }
}
