//! The checks clap cannot make on `brigade train` and `brigade sweep` flags: every number
//! finite and in range, flags that only make sense together, and whether the run fits in
//! this machine's memory. Each fails with one line naming the flag and the value.

use brigade::launch::CommBackend;
use brigade::placement::DevicePlacement;
use brigade::policies::{PolicySpec, PowerSgdConfig, POWERSGD_SETTINGS};

use super::{
    cap_in_range, check_link, check_threads, compact, flag_name, join, ModelName, OptimizerName, RunArgs,
    MAX_BUCKET_MB, MAX_THREAD_RANKS, MAX_TIMEOUT_S, MIN_BUCKET_MB,
};
use crate::error::{Error, Result};
use crate::footprint;
use brigade_models::Tokenizer;

impl RunArgs {
    /// Checks values that clap cannot: every number finite and in range, flags that only
    /// make sense together. One line naming the flag and the value.
    pub fn validate(&self) -> Result<()> {
        self.check_settings_flags(std::slice::from_ref(&self.distributed.policy), false)?;
        self.validate_under(&self.hook_spec(), true)
    }

    /// The settings flags of a policy (`--powersgd-rank`, `--powersgd-start-iter`) given at
    /// other than their defaults while none of `policies` has those settings; `listed`: the
    /// policies are a sweep's list.
    pub fn check_settings_flags(&self, policies: &[PolicySpec], listed: bool) -> Result<()> {
        let d = &self.distributed;
        let psgd = PowerSgdConfig::default();
        let given = d.powersgd_rank != psgd.rank || d.powersgd_start_iter != psgd.start_iter;
        let owner = PolicySpec::PowerSgd {
            rank: psgd.rank,
            start_iter: psgd.start_iter,
        };
        if given && !policies.iter().any(|p| p.name() == owner.name()) {
            let flags = crate::policy::settings_flags(&POWERSGD_SETTINGS);
            let owner = match listed {
                true => format!("a {} policy in --policy", owner.name()),
                false => format!("--policy {}", owner.name()),
            };
            return Err(Error::Usage(format!("{} are for {owner}", flags.join(" and "))));
        }
        Ok(())
    }

    /// Refuses the run's own policy spelled as `--comm-hook` or `--zero` beside a command's
    /// list of policies (sweep's and study's `--policy`), which would otherwise go unread.
    pub fn check_no_policy_alias(&self) -> Result<()> {
        let d = &self.distributed;
        if let Some(hook) = &d.comm_hook_alias {
            return Err(Error::Usage(format!(
                "--comm-hook {hook} with --policy: name every hook in --policy instead"
            )));
        }
        if d.zero != 0 {
            let spec = brigade::policies::ZeroStage::from_level(d.zero).and_then(PolicySpec::zero);
            return Err(Error::Usage(format!(
                "--zero {} with --policy: name {} in --policy instead",
                d.zero,
                spec.map_or(String::new(), |p| p.to_string())
            )));
        }
        Ok(())
    }

    /// [`RunArgs::validate`] for a run under `policy` rather than the run's own (a policy
    /// sweep's rows): every flag, and the flags that do not combine with `policy`.
    pub fn validate_for(&self, policy: &PolicySpec) -> Result<()> {
        self.validate_under(policy, false)
    }

    /// [`RunArgs::validate_for`]; `own`: `policy` is the run's own (its `--policy`, `--zero`
    /// or the default), not one of a command's list, which decides the flag a fix names.
    fn validate_under(&self, policy: &PolicySpec, own: bool) -> Result<()> {
        self.validate_run()?;
        self.check_policy(policy)?;
        self.validate_nccl()?;
        self.check_memory(policy, own)
    }

    /// The checks of [`RunArgs::validate_for`] that no policy changes: a flag they refuse is
    /// wrong under every policy.
    pub fn validate_run(&self) -> Result<()> {
        self.model.validate()?;
        self.check_ranks()?;
        self.check_recipe()?;
        self.check_data()?;
        self.validate_schedule_flags()?;
        self.check_model_data()?;
        self.validate_autotune()?;
        self.check_runtime()
    }

    /// `--world-size` against the backend, `--batch-size` and `--accum`.
    fn check_ranks(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Usage(m));
        if self.distributed.world_size == 0 {
            return bad("--world-size must be at least 1".into());
        }
        if self.distributed.backend != CommBackend::Mpi && self.distributed.world_size > MAX_THREAD_RANKS {
            return bad(format!(
                "--world-size {} is more ranks than one process runs as threads (at most {MAX_THREAD_RANKS}): \
                 start them under mpirun with --backend mpi",
                self.distributed.world_size
            ));
        }
        if self.data.batch_size == 0 || self.data.accum == 0 {
            return bad("--batch-size and --accum must be at least 1".into());
        }
        if self.data.batch_size.checked_mul(self.data.accum).is_none() {
            return bad(format!(
                "--batch-size {} x --accum {} rows per step is more than this machine can count",
                self.data.batch_size, self.data.accum
            ));
        }
        Ok(())
    }

    /// The optimizer's numbers, the schedule and the clipping.
    fn check_recipe(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Usage(m));
        if !(self.recipe.lr > 0.0 && self.recipe.lr.is_finite()) {
            return bad(format!(
                "--lr must be a finite number > 0, got {}",
                compact(self.recipe.lr)
            ));
        }
        if let Some(wd) = self.recipe.weight_decay.filter(|wd| !(*wd >= 0.0 && wd.is_finite())) {
            return bad(format!(
                "--weight-decay must be a finite number >= 0, got {}",
                compact(wd)
            ));
        }
        if let Some(c) = self.recipe.clip_grad_norm.filter(|c| !(*c > 0.0 && c.is_finite())) {
            return bad(format!(
                "--clip-grad-norm must be a finite number > 0, got {}",
                compact(c)
            ));
        }
        self.check_schedule()?;
        if let Some(m) = self.recipe.momentum {
            if self.recipe.optimizer != OptimizerName::Sgd {
                return bad(format!(
                    "--momentum is for --optimizer sgd; {} has its own betas (drop --momentum)",
                    flag_name(&self.recipe.optimizer)
                ));
            }
            if !(0.0..1.0).contains(&m) {
                return bad(format!("--momentum must be in [0, 1), got {}", compact(m)));
            }
        }
        Ok(())
    }

    /// The learning-rate schedule builds over the run's steps.
    fn check_schedule(&self) -> Result<()> {
        let t = self.recipe.lr_decay_steps.unwrap_or(self.recipe.steps as u64);
        self.schedule().build(self.recipe.lr, t).map_err(|e| {
            let what = e.to_string();
            let what = what.strip_prefix("configuration: ").unwrap_or(&what).to_string();
            // where T is what is wrong (another T would do) and T was left to default, say so
            let t_defaulted =
                self.recipe.lr_decay_steps.is_none() && self.schedule().build(self.recipe.lr, 1 << 40).is_ok();
            let hint = if t_defaulted {
                " (--lr-decay-steps defaults to --steps)"
            } else {
                ""
            };
            Error::Usage(format!(
                "--lr-schedule {}: {what}{hint}",
                flag_name(&self.recipe.lr_schedule)
            ))
        })?;
        Ok(())
    }

    /// The held-out data and its evaluation.
    fn check_held_out(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Usage(m));
        if let (Some(text), Some(flag)) = (
            &self.data.text,
            (self.data.val_fraction.map(|_| "--val-fraction")).or(self.data.eval_data.as_ref().map(|_| "--eval-data")),
        ) {
            return bad(format!(
                "--text {} keeps its last tenth apart as the held-out data of --eval-every: drop {flag}",
                text.display()
            ));
        }
        match (self.recipe.eval_every, self.data.val_fraction, &self.data.eval_data) {
            (Some(0), _, _) => return bad("--eval-every must be at least 1 (steps between evaluations)".into()),
            (Some(_), None, None) if self.data.text.is_none() => {
                return bad(
                    "--eval-every needs held-out data: --val-fraction F, --eval-data FILE, or --text FILE's last tenth"
                        .into(),
                )
            }
            (_, Some(_), Some(_)) => {
                return bad("--val-fraction and --eval-data both name held-out data: give one".into())
            }
            (None, Some(_), _) | (None, _, Some(_)) => {
                return bad("--val-fraction and --eval-data are for --eval-every N (how often to evaluate)".into())
            }
            _ => {}
        }
        if let Some(f) = self.data.val_fraction.filter(|f| !(*f > 0.0 && *f < 1.0)) {
            return bad(format!("--val-fraction must be in (0, 1), got {}", compact(f)));
        }
        Ok(())
    }

    /// The held-out data, the bucket caps, the data's order and files.
    fn check_data(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Usage(m));
        self.check_held_out()?;
        if self.distributed.bucket_mb.is_empty()
            || !(self
                .distributed
                .bucket_mb
                .iter()
                .all(|b| b.mib().is_none_or(cap_in_range))
                && cap_in_range(self.distributed.first_bucket_mb))
        {
            let caps: Vec<String> = self.distributed.bucket_mb.iter().map(|b| b.to_string()).collect();
            return bad(format!(
                "--bucket-mb and --first-bucket-mb must be finite, at least one byte ({MIN_BUCKET_MB:e}) and at most {MAX_BUCKET_MB}, got [{}] and {}",
                caps.join(", "),
                compact(self.distributed.first_bucket_mb)
            ));
        }
        if self.data.drop_last && !self.data.shuffle {
            return bad("--drop-last is for --shuffle (rows in order have no epochs to cut): add --shuffle".into());
        }
        if let (Some(_), Some(f)) = (self.rank_data(), self.data.val_fraction) {
            return bad(format!(
                "--val-fraction {f} holds out the rows of one file, but --data names a file per rank: give the held-out rows as --eval-data FILE"
            ));
        }
        if let (Some(mode), None) = (self.data.join, self.rank_data()) {
            let data = match (&self.data.text, &self.data.data) {
                (Some(t), _) => format!("--text {}", t.display()),
                (None, Some(d)) => format!("--data {}", d.display()),
                (None, None) => "the built-in data".into(),
            };
            return bad(format!(
                "--join {mode} is for a file per rank of any length (--data 'shard-{{rank}}.safetensors'); {data} is one dataset cut evenly among the ranks, so no rank's data ends early: drop --join"
            ));
        }
        Ok(())
    }

    /// The data flags that only the GPT reads.
    fn check_model_data(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Usage(m));
        if self.data.text.is_some() && self.model.model != ModelName::Gpt {
            return bad("--text trains the byte-level GPT: add --model gpt".into());
        }
        if self.model.tokenizer != Tokenizer::Bytes && self.model.model != ModelName::Gpt {
            return bad(format!(
                "--tokenizer {} sets the GPT's vocabulary: add --model gpt",
                self.model.tokenizer
            ));
        }
        if let (Some(f), None) = (self.data.data_format, &self.data.data) {
            return bad(format!(
                "--data-format {} says how --data's token files lay out their tokens: add --data FILE",
                flag_name(&f)
            ));
        }
        Ok(())
    }

    /// The simulated link, the threads, the wait and the steps timed.
    fn check_runtime(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Usage(m));
        check_link(self.distributed.net_gbps, self.distributed.net_latency_us)?;
        if self.distributed.net_latency_us != 0.0 && self.distributed.net_gbps.is_none() {
            return bad(format!(
                "--net-latency-us {} needs --net-gbps: the simulated network is on only with a bandwidth",
                self.distributed.net_latency_us
            ));
        }
        if let Some(t) = self.runtime.threads_per_rank {
            check_threads("--threads-per-rank", t)?;
        }
        if !(self.distributed.timeout_s > 0.0 && self.distributed.timeout_s <= MAX_TIMEOUT_S) {
            return bad(format!(
                "--timeout-s must be a number of seconds > 0 and at most {}, got {}",
                compact(MAX_TIMEOUT_S),
                compact(self.distributed.timeout_s)
            ));
        }
        let latency_s = self.distributed.net_latency_us * 1e-6;
        if self.distributed.net_gbps.is_some() && latency_s >= self.distributed.timeout_s {
            return bad(format!(
                "--net-latency-us {} is {} s a message, at least --timeout-s {}: every collective would time out; \
                 raise --timeout-s or lower the latency",
                compact(self.distributed.net_latency_us),
                compact(latency_s),
                compact(self.distributed.timeout_s)
            ));
        }
        if self.runtime.untimed_steps >= self.recipe.steps && self.recipe.steps > 0 {
            return bad(format!(
                "--untimed-steps {} leaves no step of --steps {} to time",
                self.runtime.untimed_steps, self.recipe.steps
            ));
        }
        Ok(())
    }

    /// The flags that do not combine with `policy`, and the policy's own settings.
    fn check_policy(&self, policy: &PolicySpec) -> Result<()> {
        let named = match &self.distributed.policy_given {
            Some(given) if *policy == self.distributed.policy => given.clone(),
            _ => format!("--policy {policy}"),
        };
        if self.data.accum_into_shard && !policy.shards_grads() {
            return Err(Error::Usage(format!(
                "--accum-into-shard adds each microbatch's reduced gradients into the rank's gradient shard: \
                 {named} keeps no such shard (ZeRO stage 2 or 3 does)"
            )));
        }
        if self.data.accum_into_shard && self.data.accum < 2 {
            return Err(Error::Usage(format!(
                "--accum-into-shard needs --accum 2 or more (got {}): one microbatch already reduces into the shard",
                self.data.accum
            )));
        }
        if policy.shards_optimizer_state() && self.bucket_auto() {
            return Err(Error::Usage(format!(
                "{named} cuts its optimizer shards from fixed buckets and does not combine with --bucket-mb auto: give a cap in MiB"
            )));
        }
        if let PolicySpec::PowerSgd { rank, start_iter } = *policy {
            let cfg = PowerSgdConfig {
                rank,
                start_iter,
                ..PowerSgdConfig::default()
            };
            cfg.validate().map_err(|e| {
                let flags = crate::policy::settings_flags(&POWERSGD_SETTINGS);
                Error::Usage(format!("--policy {}: {e} ({})", policy.name(), flags.join(", ")))
            })?;
        }
        Ok(())
    }

    /// Checks that the model, its gradients, the optimizer's state and one microbatch's
    /// activations fit in this machine's memory for every rank this process runs (a lower
    /// bound: see [`crate::footprint`]).
    fn check_memory(&self, policy: &PolicySpec, own: bool) -> Result<()> {
        // sharded over the ranks, or optimizer values per parameter
        let state = if policy.shards_optimizer_state() {
            0
        } else {
            self.state_per_param()
        };
        let ranks = if self.distributed.backend == CommBackend::Mpi {
            1
        } else {
            self.distributed.world_size
        };
        let kind = self.model.kind();
        let bytes =
            footprint::training_bytes(&kind, self.data.batch_size, state).and_then(|b| footprint::mul(b, ranks as u64));
        let shape = match self.model.model {
            ModelName::Mlp => format!("--widths {}", join(&self.model.widths)),
            ModelName::Gpt => format!(
                "--d-model {} --layers {} --d-ff {} --context {} --tokenizer {}",
                self.model.d_model, self.model.layers, self.model.d_ff, self.model.context, self.model.tokenizer
            ),
        };
        // at a large vocabulary the logits are most of it: say so
        let logits = match &kind {
            brigade_models::ModelKind::Gpt(c) => footprint::gpt_vocab(c, self.data.batch_size)
                .and_then(|v| footprint::f32_bytes(footprint::mul(v.logits, 2 * ranks as u64)))
                .filter(|l| bytes.is_some_and(|b| *l * 2 > b))
                .map(|l| format!(", of which {} are the logits and their softmax", footprint::human(l))),
            _ => None,
        };
        let what = format!(
            "the model ({shape}) with --batch-size {} on {ranks} {} in this process{}",
            self.data.batch_size,
            if ranks == 1 { "rank" } else { "ranks" },
            logits.unwrap_or_default()
        );
        footprint::check_fits(&what, bytes)?;
        self.check_budget(policy, own)
    }

    /// Optimizer values per parameter before any sharding (AdamW 2, SGD with momentum 1, else 0).
    fn state_per_param(&self) -> u64 {
        match self.recipe.optimizer {
            OptimizerName::Adamw => 2,
            OptimizerName::Sgd => u64::from(self.momentum() != 0.0),
        }
    }

    /// The predicted peak of one rank of this run under `policy`, `checkpoint_every` and `rows`.
    pub fn predicted_peak(
        &self,
        policy: &PolicySpec,
        checkpoint_every: usize,
        rows: usize,
    ) -> Option<footprint::PeakPrediction> {
        footprint::predict_peak(&footprint::PeakQuery {
            kind: &self.model.kind(),
            rows,
            state_per_param: self.state_per_param(),
            policy,
            world: self.distributed.world_size,
            checkpoint_every,
        })
    }

    /// `--memory-budget`: refuses a run whose predicted peak per rank exceeds it, naming the
    /// largest part and the first of activation checkpointing, ZeRO-2 and a smaller
    /// `--batch-size` that would fit; ZeRO-2 as the run can ask for it ([`RunArgs::zero2_fix`]).
    fn check_budget(&self, policy: &PolicySpec, own: bool) -> Result<()> {
        let Some(mb) = self.runtime.memory_budget else {
            return Ok(());
        };
        let budget = footprint::budget_bytes(mb)?;
        let every = self.model.activation_checkpointing.unwrap_or(0);
        let rows = self.data.batch_size;
        let fits = |p: Option<footprint::PeakPrediction>| p.filter(|p| p.total() <= budget).map(|p| p.total());
        let Some(p) = self.predicted_peak(policy, every, rows) else {
            return Err(Error::Usage(format!(
                "--memory-budget {} MB: this run needs more than 2^64 bytes per rank",
                compact(mb)
            )));
        };
        if p.total() <= budget {
            return Ok(());
        }
        let mut fixes = vec![];
        if self.model.model == ModelName::Gpt && every != 1 {
            fixes.push((
                "--activation-checkpointing".to_string(),
                fits(self.predicted_peak(policy, 1, rows)),
            ));
        }
        if self.distributed.world_size > 1 && !policy.shards_grads() {
            fixes.push((
                self.zero2_fix(policy, own),
                fits(self.predicted_peak(&PolicySpec::Zero2, every, rows)),
            ));
        }
        let smaller = (1..rows)
            .rev()
            .find(|&b| fits(self.predicted_peak(policy, every, b)).is_some());
        let fix = fixes
            .iter()
            .find_map(|(flag, t)| t.map(|t| format!("{flag} would bring it to {}", footprint::human(t))))
            .or_else(|| smaller.map(|b| format!("--batch-size {b} would fit")))
            .unwrap_or_else(|| "neither activation checkpointing, ZeRO-2 nor a smaller --batch-size fits it: a smaller model or more ranks would".to_string());
        let (part, bytes) = p.largest();
        Err(Error::Usage(format!(
            "--memory-budget {} MB: this run is predicted to hold {} per rank at its peak, the largest part {part} ({}); {fix}",
            compact(mb),
            footprint::human(p.total()),
            footprint::human(bytes)
        )))
    }

    /// ZeRO-2 in place of `policy`, spelled as this command takes it: `--zero 2` for the run's
    /// own policy when it was the default or given as `--zero` (`--zero` does not combine with
    /// `--policy` or `--comm-hook`), else `--policy zero2` in place of the flag that named it; for a
    /// policy of a command's list, zero2 in place of it there.
    fn zero2_fix(&self, policy: &PolicySpec, own: bool) -> String {
        match (&self.distributed.policy_given, own) {
            (None, true) => "--zero 2".into(),
            (Some(given), true) if given.starts_with("--zero") => "--zero 2".into(),
            (Some(given), true) => format!("--policy {} in place of {given}", PolicySpec::Zero2),
            (_, false) => format!("{} in place of {policy}", PolicySpec::Zero2),
        }
    }

    /// Flags that cannot work with `--backend nccl` (every reducer policy runs there: its
    /// compute and collectives on the NCCL comm stream, behind each bucket's ready event).
    /// The schedule flags the schedule in use reads: one given to a schedule that ignores it
    /// is an error naming the schedules that read it (a flag at its default counts as not given).
    fn validate_schedule_flags(&self) -> Result<()> {
        use crate::args::ScheduleFlag as S;
        let decays = matches!(self.recipe.lr_schedule, S::Cosine | S::Linear);
        let given = [
            ("--min-lr", self.recipe.min_lr != 0.0, decays, "cosine or linear"),
            (
                "--lr-decay-steps",
                self.recipe.lr_decay_steps.is_some(),
                decays,
                "cosine or linear",
            ),
            (
                "--lr-gamma",
                self.recipe.lr_gamma != 0.1,
                self.recipe.lr_schedule == S::Step,
                "step",
            ),
            (
                "--lr-step-size",
                self.recipe.lr_step_size != 1,
                self.recipe.lr_schedule == S::Step,
                "step",
            ),
        ];
        match given.into_iter().find(|&(_, given, read, _)| given && !read) {
            Some((flag, _, _, readers)) => Err(Error::Usage(format!(
                "{flag} is read by --lr-schedule {readers}, not by {} (the schedule in use): drop {flag} or pick a schedule that reads it",
                flag_name(&self.recipe.lr_schedule)
            ))),
            None => Ok(()),
        }
    }

    fn validate_nccl(&self) -> Result<()> {
        if self.distributed.backend != CommBackend::Nccl {
            return Ok(());
        }
        if self.runtime.device == DevicePlacement::Cpu {
            return Err(Error::Usage(
                "--backend nccl reduces gradients in GPU memory: pass --device cuda (or cuda:N); \
                 on the CPU use --backend thread or mpi"
                    .into(),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use crate::args::*;

    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        run: RunArgs,
    }

    fn flags(args: &[&str]) -> RunArgs {
        let mut run = Flags::try_parse_from(std::iter::once("brigade").chain(args.iter().copied()))
            .unwrap()
            .run;
        run.take_old_spellings();
        run
    }

    #[test]
    fn device_flags_parse_and_bad_ones_say_what_is_expected() {
        assert_eq!(parse_device("cpu"), Ok(DevicePlacement::Cpu));
        assert_eq!(parse_device("cuda"), Ok(DevicePlacement::Cuda(None)));
        assert_eq!(parse_device("cuda:3"), Ok(DevicePlacement::Cuda(Some(3))));
        for bad in ["gpu", "cuda:", "cuda:x", "cuda:-1", "CUDA"] {
            assert!(parse_device(bad).unwrap_err().contains("cpu, cuda or cuda:N"), "{bad}");
        }
    }

    #[test]
    fn nccl_needs_a_cuda_device_and_takes_every_policy() {
        assert!(flags(&["--backend", "nccl", "--device", "cuda"]).validate().is_ok());
        assert!(flags(&["--backend", "thread"]).validate().is_ok());
        let e = flags(&["--backend", "nccl"]).validate().unwrap_err();
        assert!(e.to_string().contains("--device cuda"), "{e}");
        for policy in [
            &["--comm-hook", "fp16"][..],
            &["--comm-hook", "bf16"],
            &["--comm-hook", "powersgd"],
            &["--zero", "1"],
            &["--zero", "2"],
        ] {
            let f = flags(&[&["--backend", "nccl", "--device", "cuda"][..], policy].concat());
            assert!(f.validate().is_ok(), "{policy:?}: {:?}", f.validate());
        }
    }
}
