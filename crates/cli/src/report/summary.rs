//! The summary `brigade train` ends with (stdout): a few lines, or one JSON object with
//! `--json`, printed from rank 0's outcome once the run's files are written
//! ([`print_summary`]); and the observer of the run ([`brigade::observe::TrainObserver`]) that
//! prints its notes on stderr ([`PrintNotes`]).

use crate::report::stdout::outln;
use brigade::observe::TrainObserver;
use brigade::outcome::TrainOutcome;
use brigade::recipe::HyperparameterChange;
use serde_json::json;

use brigade::policies::PolicySpec;

use crate::args::{compact, flag_name, ModelName, RunArgs};
use crate::plan_auto::Choice;
use crate::sent::SentSummary;

/// Median and minimum of a slice (NaN when empty).
pub fn median_min(v: &[f64]) -> (f64, f64) {
    if v.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    (s[s.len() / 2], s[0])
}

/// The numbers a run ends with (NaN for what a run of no step cannot measure).
pub struct Summary {
    /// The first step's loss.
    pub first_loss: f64,
    /// The last step's loss.
    pub last_loss: f64,
    /// Median step time after `--untimed-steps`.
    pub median_step_ms: f64,
    /// Fastest step after `--untimed-steps`.
    pub min_step_ms: f64,
    /// Global rows per second at the median step.
    pub samples_per_s: f64,
}

/// Summarises an outcome of `world_size` ranks, leaving the first `--untimed-steps` steps out of the
/// timing.
pub fn summarize(args: &RunArgs, world_size: usize, outcome: &TrainOutcome) -> Summary {
    let timed = &outcome.ms()[args.runtime.untimed_steps.min(outcome.ms().len())..];
    let (median, min) = median_min(timed);
    // the run's world size: under MPI it comes from mpirun, not from --world-size
    let global_batch = world_size as f64 * args.rows_per_rank() as f64;
    Summary {
        first_loss: outcome.losses().first().copied().unwrap_or(f64::NAN),
        last_loss: outcome.losses().last().copied().unwrap_or(f64::NAN),
        median_step_ms: median,
        min_step_ms: min,
        samples_per_s: global_batch / (median / 1e3),
    }
}

/// Prints the notes of a run (stderr) as they come.
pub struct PrintNotes;

impl TrainObserver for PrintNotes {
    fn note(&self, message: &str) {
        eprintln!("note: {}", crate::argv::in_flag_terms(message));
    }

    fn resumed(&self, changes: &[HyperparameterChange]) {
        let changes: Vec<String> = changes.iter().map(ToString::to_string).collect();
        eprintln!(
            "note: resuming with {} (this run's values, not the checkpoint's)",
            changes.join(", ")
        );
    }
}

/// Prints the summary of a run of `args` over `world_size` ranks (stdout), as JSON when `json`.
pub fn print_summary(args: &RunArgs, json: bool, world_size: usize, outcome: &TrainOutcome, plan: Option<&Choice>) {
    if json {
        let mut summary = json_summary(args, world_size, outcome);
        if let (Some(s), Some(plan)) = (summary.as_object_mut(), plan) {
            s.insert("plan".into(), json!(plan));
        }
        outln!("{summary}");
    } else {
        print_lines(args, world_size, outcome);
    }
}

/// The report's `zero` (the ZeRO stage, 0 without ZeRO) and `comm_hook` (the bucket reduction
/// beside it: the policy's name, an f32 all-reduce under ZeRO) of `policy`.
/// The stage is the number the policy's state layout records (what a checkpoint records).
fn zero_and_hook(policy: &PolicySpec) -> (u8, String) {
    match policy.state_layout().record() {
        0 => (0, policy.name().to_string()),
        stage => (stage, PolicySpec::AllReduce.name().to_string()),
    }
}

/// The run's flags as the summary's `flags` object, with the ZeRO stage the report names `zero`.
fn json_flags(a: &RunArgs) -> (u8, serde_json::Value) {
    let m = &a.model;
    let shape = match m.model {
        ModelName::Mlp => json!({ "widths": m.widths }),
        ModelName::Gpt => json!({
            "d_model": m.d_model, "layers": m.layers, "heads": m.heads, "d_ff": m.d_ff, "context": m.context,
            "activation_checkpointing": m.activation_checkpointing.unwrap_or(0),
        }),
    };
    // the policy's settings, each under its own name (PowerSGD's rank and start)
    let policy = a.hook_spec();
    let hook: serde_json::Map<String, serde_json::Value> = policy
        .settings()
        .into_iter()
        .map(|(k, v)| (k.to_string(), json!(v)))
        .collect();
    let hook = serde_json::Value::Object(hook);
    let (zero, comm_hook) = zero_and_hook(&policy);
    let mut flags = json!({
        "model": flag_name(&a.model.model),
        "steps": a.recipe.steps, "batch_size": a.data.batch_size, "accum": a.data.accum, "lr": a.recipe.lr,
        "optimizer": flag_name(&a.recipe.optimizer), "seed": a.model.seed, "comm_hook": comm_hook,
        "backend": a.distributed.backend.name(),
        "bucket_mb": if a.bucket_auto() { json!("auto") } else { json!(a.bucket_cap().ok()) },
        "first_bucket_mb": a.distributed.first_bucket_mb,
        "net_gbps": a.distributed.net_gbps, "net_latency_us": a.distributed.net_latency_us, "warmup": a.runtime.untimed_steps,
        "zero": zero,
        "lr_schedule": flag_name(&a.recipe.lr_schedule), "warmup_steps": a.recipe.warmup_steps, "min_lr": a.recipe.min_lr,
        "lr_decay_steps": a.recipe.lr_decay_steps, "lr_gamma": a.recipe.lr_gamma, "lr_step_size": a.recipe.lr_step_size,
        "clip_grad_norm": a.recipe.clip_grad_norm, "eval_every": a.recipe.eval_every, "val_fraction": a.data.val_fraction,
        "threads_per_rank": a.runtime.threads_per_rank.unwrap_or_else(|| brigade::launch::default_threads(a.distributed.world_size)),
    });
    // the model's shape and the hook's settings: every flag that changes what trains
    for extra in [shape, hook] {
        if let (Some(f), serde_json::Value::Object(extra)) = (flags.as_object_mut(), extra) {
            f.extend(extra);
        }
    }
    (zero, flags)
}

/// The summary as one JSON object (NaN as null: a run of no step has no loss or time).
fn json_summary(a: &RunArgs, world_size: usize, outcome: &TrainOutcome) -> serde_json::Value {
    let s = summarize(a, world_size, outcome);
    let (zero, flags) = json_flags(a);
    let mut out = json!({
        "first_loss": s.first_loss, "last_loss": s.last_loss,
        "median_step_ms": s.median_step_ms, "min_step_ms": s.min_step_ms,
        "samples_per_s": s.samples_per_s, "world_size": world_size,
        "first_step": outcome.first_step, "steps_run": outcome.losses().len(), "buckets": outcome.buckets.len(),
        "epoch": outcome.sampler.map(|p| p.epoch), "epoch_row": outcome.sampler.map(|p| p.index),
        "lr": outcome.lrs(), "last_lr": outcome.lrs().last(),
        "grad_norm": outcome.grad_norms(),
        // fp16 loss scaling: each step's scale (null without it) and the steps skipped
        "scale": outcome.scales(), "skipped_steps": outcome.skipped_steps(),
        "val_loss": outcome.val_losses(), "last_val_loss": outcome.val_losses().iter().rev().flatten().next(), "last_grad_norm": outcome.grad_norms().last().copied().flatten(),
        "gradient_bytes": outcome.memory.map(|m| m.gradients),
        "gradient_and_bucket_bytes": outcome.memory.map(|m| m.gradients),
        "autotune": outcome.autotune,
        // the reducer policy's spec, as checkpoints and profiles record it, and what it says
        "policy": a.hook_spec().to_string(),
        "policy_notes": outcome.policy_diagnostics.iter().map(|d| d.message.clone()).collect::<Vec<_>>(),
        "memory": outcome.memory.map(|m| json!({
            "zero": zero, "parameter_bytes": m.parameters, "gradient_bytes": m.gradients,
            "bucket_bytes": m.buckets, "optimizer_state_bytes": m.optimizer_state,
            "policy_state_bytes": m.policy_state, "comm_scratch_bytes": m.comm_scratch, "gathered_bytes": m.gathered, "master_weight_bytes": m.master_weights, "total_bytes": m.total(),
            "activation_bytes": m.activations, "peak_bytes": m.peak,
            // ZeRO-3: what the compute waited for the parameter gathers, median over the steps
            "gather_wait_ms": (m.gathered > 0).then(|| median_min(&outcome.gather_wait_ms()).0),
            "predicted_peak_bytes": a
                .predicted_peak(&a.hook_spec(), a.model.activation_checkpointing.unwrap_or(0), a.data.batch_size)
                .map(|p| p.total()),
            "activation_checkpointing": a.model.activation_checkpointing.unwrap_or(0),
        })),
        "flags": flags,
        "cpu_gemm": cpu_gemm(a),
        // uneven data: the join mode, the step each rank joined at (null: never), where the data ended
        "join": outcome.join.map(|m| m.name()),
        "joined_at": outcome.joined_at,
        "data_ended": outcome.data_ended,
    });
    // each step's loss (before its update) and rank 0's wall time of it, in milliseconds
    if let Some(o) = out.as_object_mut() {
        o.insert("loss".into(), json!(outcome.losses()));
        o.insert("step_ms".into(), json!(outcome.ms()));
    }
    // bytes DDP sent per step on rank 0 (see `sent.rs`)
    if let (Some(o), serde_json::Value::Object(sent)) = (out.as_object_mut(), SentSummary::json_fields(&outcome.sent()))
    {
        o.extend(sent);
    }
    // the run's peak (from the model's construction on): when, what held it, the last step's
    if let (Some(m), Some(serde_json::Value::Object(o))) = (outcome.memory, out.get_mut("memory")) {
        o.extend([
            ("peak_step".to_string(), json!(m.peak_step)),
            ("peak_parts".to_string(), json!(m.peak_parts)),
            ("last_step_peak_bytes".to_string(), json!(m.last_step_peak)),
            ("construction_peak_bytes".to_string(), json!(m.construction_peak)),
            ("gradients_in_flight_bytes".to_string(), json!(m.gradients_in_flight)),
        ]);
    }
    out
}

/// The library under the CPU's matrix products, in words (`None` on a GPU run).
fn cpu_gemm(a: &RunArgs) -> Option<String> {
    match a.runtime.device {
        brigade::placement::DevicePlacement::Cpu => {
            Some(brigade::tensor::cpu_gemm_name().unwrap_or_else(|e| e.to_string()))
        }
        _ => None,
    }
}

/// The summary as a few lines.
fn print_lines(a: &RunArgs, world_size: usize, outcome: &TrainOutcome) {
    let ran = outcome.losses().len();
    outln!(
        "model {} | world size {} | {} rows/rank x accum {} | steps {}..{} | {} lr {}",
        flag_name(&a.model.model),
        world_size,
        a.data.batch_size,
        a.data.accum,
        outcome.first_step,
        a.recipe.steps,
        flag_name(&a.recipe.optimizer),
        compact(a.recipe.lr)
    );
    if ran == 0 {
        outln!(
            "no step run: the run starts at step {} and --steps is {}",
            outcome.first_step,
            a.recipe.steps
        );
    } else {
        let s = summarize(a, world_size, outcome);
        outln!("loss: first {:.4}  last {:.4}", s.first_loss, s.last_loss);
        if let Some(line) = join_line(outcome) {
            outln!("{line}");
        }
        print_data_line(outcome);
        print_recipe_lines(a, outcome);
        print_time_lines(a, &s, ran);
        if let Some(gemm) = cpu_gemm(a) {
            outln!("CPU GEMM: {gemm}");
        }
    }
    if let Some(t) = &outcome.autotune {
        crate::bucket_cap::print_autotune(t);
    }
    print_gradient_memory_lines(a, world_size, outcome);
    for d in &outcome.policy_diagnostics {
        outln!("note: {}", d.message);
    }
    if let Some(Some(scale)) = outcome.scales().last() {
        outln!(
            "fp16 loss scaling: {} of {} steps skipped (inf/NaN gradients), last scale {scale}",
            outcome.skipped_steps(),
            outcome.steps.len()
        );
    }
    print_memory_line(a, world_size, outcome);
}

/// A shuffled run's data line: rows per epoch, and where the next step reads.
fn print_data_line(outcome: &TrainOutcome) {
    if let (Some(p), brigade::source::DataLength::PerEpoch(rows)) = (outcome.sampler, &outcome.rank_lengths) {
        // the position is rank 0's: the ranks stand at the same row only when their
        // epochs are equally long
        match rows.split_first() {
            Some((first, rest)) if rest.iter().any(|r| r != first) => outln!(
                "data: shuffled, rows per epoch by rank: {}; next (rank 0): epoch {} row {}",
                rows.iter().map(ToString::to_string).collect::<Vec<_>>().join(", "),
                p.epoch,
                p.index
            ),
            _ => outln!(
                "data: shuffled, {} rows per rank per epoch; next: epoch {} row {}",
                rows.first().copied().unwrap_or(0),
                p.epoch,
                p.index
            ),
        }
    }
}

/// The schedule's learning rates, the last validation loss and the gradient clipping, where the
/// run has them.
fn print_recipe_lines(a: &RunArgs, outcome: &TrainOutcome) {
    let ran = outcome.losses().len();
    if let (Some(first), Some(last)) = (outcome.lrs().first(), outcome.lrs().last()) {
        if a.recipe.lr_schedule != crate::args::ScheduleFlag::Constant || a.recipe.warmup_steps > 0 {
            outln!(
                "lr: {} schedule, first {} last {}",
                flag_name(&a.recipe.lr_schedule),
                compact(*first),
                compact(*last)
            );
        }
    }
    if let Some((s, v)) = outcome
        .val_losses()
        .iter()
        .enumerate()
        .rev()
        .find_map(|(i, v)| Some((i, (*v)?)))
    {
        outln!("val loss: {v:.4} after step {}", outcome.first_step + s);
    }
    if let (Some(c), Some(Some(norm))) = (a.recipe.clip_grad_norm, outcome.grad_norms().last()) {
        let clipped = outcome.grad_norms().iter().flatten().filter(|n| **n > c).count();
        outln!(
            "gradient norm: last {norm:.4}, clipped to {} in {clipped} of {ran} steps",
            compact(c)
        );
    }
}

/// The step time and throughput (or that no step was timed).
fn print_time_lines(a: &RunArgs, s: &Summary, ran: usize) {
    let timed = ran.saturating_sub(a.runtime.untimed_steps);
    if timed == 0 {
        outln!(
            "step time: none measured (all {ran} steps run are --untimed-steps {})",
            a.runtime.untimed_steps
        );
    } else {
        outln!(
            "step time: median {:.2} ms  min {:.2} ms  (first {} steps excluded)",
            s.median_step_ms,
            s.min_step_ms,
            a.runtime.untimed_steps
        );
        outln!("throughput: {:.1} samples/s", s.samples_per_s);
    }
}

/// MiB of `b` bytes.
fn mib(b: usize) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

/// Without ZeRO: the gradients' memory in buckets; under every policy: the bytes sent a step.
fn print_gradient_memory_lines(a: &RunArgs, world_size: usize, outcome: &TrainOutcome) {
    // (under ZeRO the measured line below is the account: shards are not whole buckets)
    let spec = a.hook_spec();
    let (zero, _) = zero_and_hook(&spec);
    if let (Some(m), 0) = (outcome.memory, zero) {
        let n = outcome.buckets.len();
        outln!(
            "gradient memory per rank: {:.2} MiB in {n} {} (gradients + buckets: {:.2} MiB, one copy)",
            mib(m.gradients),
            if n == 1 { "bucket" } else { "buckets" },
            mib(m.gradients)
        );
    }
    if let (Some(_), Some(sent)) = (outcome.memory, SentSummary::of(&outcome.sent())) {
        outln!("{}", sent.line(spec.wire_formula(world_size)));
    }
}

/// The measured memory per rank, part by part.
fn print_memory_line(a: &RunArgs, world_size: usize, outcome: &TrainOutcome) {
    let (zero, _) = zero_and_hook(&a.hook_spec());
    if let Some(m) = outcome.memory {
        // ZeRO-3: the units gathered at once, beside the shards counted as parameters
        let gathered = match m.gathered {
            0 => String::new(),
            g => format!(
                ", gathered {:.2} MiB (the compute waited {:.2} ms a step for the gathers)",
                mib(g),
                median_min(&outcome.gather_wait_ms()).0
            ),
        };
        outln!(
            "memory per rank (zero {}, measured): parameters {:.2} MiB, gradients {:.2} MiB (buckets {:.2}), optimizer state {:.2} MiB, comm scratch {:.2} MiB{gathered},{} total {:.2} MiB; in the last step: activations {:.2} MiB{}, peak {:.2} MiB; the run's peak {}{}",
            zero,
            mib(m.parameters),
            mib(m.gradients),
            mib(m.buckets),
            mib(m.optimizer_state),
            mib(m.comm_scratch),
            match m.master_weights {
                0 => String::new(),
                b => format!(" master weights {:.2} MiB (f32),", mib(b)),
            },
            mib(m.total()),
            mib(m.activations),
            match a.model.activation_checkpointing {
                Some(1) => " (every block checkpointed)".to_string(),
                Some(n) => format!(" (every {n}th block checkpointed)"),
                None => String::new(),
            },
            mib(m.last_step_peak),
            run_peak(&m),
            gathered_outweigh_shards(&m, world_size).map_or_else(String::new, |note| format!("; {note}")),
        );
    }
}

/// Under ZeRO-3, when the units gathered at the run's peak hold more than sharding the
/// parameters saves (the whole parameters every rank of ZeRO-2 holds, less this rank's shards):
/// a model whose units are large beside it, where ZeRO-2 may peak lower.
fn gathered_outweigh_shards(m: &brigade::ddp::MemoryReport, world_size: usize) -> Option<String> {
    let gathered = m.peak_parts.gathered;
    let saved = m.parameters * world_size.saturating_sub(1);
    (gathered > saved).then(|| {
        format!(
            "the units gathered at the peak ({:.2} MiB) cost more than sharding the parameters saves ({:.2} MiB): \
             with units this large beside the model, ZeRO-2 may peak lower",
            mib(gathered),
            mib(saved)
        )
    })
}

/// The run's peak, when it was reached and what held it: `19.33 MiB at step 2 = parameters
/// 1.33 + gathered 2.52 + ...` (parts of 0 bytes left out).
fn run_peak(m: &brigade::ddp::MemoryReport) -> String {
    let mib = |b: usize| b as f64 / (1024.0 * 1024.0);
    let p = &m.peak_parts;
    let parts = [
        ("parameters", p.parameters),
        ("gathered units", p.gathered),
        ("gradients in flight", p.bucket_gradients),
        ("reductions", p.reductions),
        ("activations", p.activations),
        ("backward", p.backward),
        ("optimizer", p.optimizer),
        ("other", p.other),
    ];
    let split: Vec<String> = (parts.iter())
        .filter(|(_, b)| *b > 0)
        .map(|(name, b)| format!("{name} {:.2}", mib(*b)))
        .collect();
    let when = match m.peak_step {
        Some(s) => format!("at step {s}"),
        None => "(no step ran)".to_string(),
    };
    format!(
        "{:.2} MiB {when} = {} (building the model, its optimizer and DDP: {:.2} MiB)",
        mib(m.peak),
        split.join(" + "),
        mib(m.construction_peak)
    )
}

/// The join's line of the summary (uneven data): the step each rank joined at, and where every
/// rank's data had ended (`None` without a join mode).
pub fn join_line(outcome: &TrainOutcome) -> Option<String> {
    let mode = outcome.join?;
    let ranks: Vec<String> = outcome
        .joined_at
        .iter()
        .enumerate()
        .map(|(r, j)| match j {
            Some(s) => format!("rank {r} at step {s}"),
            None => format!("rank {r} never"),
        })
        .collect();
    let end = match outcome.data_ended {
        Some(s) => format!("; every rank's data had ended at step {s}"),
        None => String::new(),
    };
    Some(format!("join ({}): joined {}{end}", mode.name(), ranks.join(", ")))
}
