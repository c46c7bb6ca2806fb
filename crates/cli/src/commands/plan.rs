//! `brigade plan`: the fastest configuration that fits a memory budget per rank, from one
//! profiled step per policy family (`brigade train --profile`), without running anything
//! ([`brigade::plan`]).

use std::path::PathBuf;

use brigade::ddp::overlap::{LinkCost, StepProfile};
use brigade::plan::{median_step, plan, Candidate, Plan, PlanQuery};
use brigade::policies::PolicySpec;
use clap::Args;
use serde_json::json;

use crate::args::compact;
use crate::commands::predict::{check_caps_and_world, read_profiles, recorded_link, LinkArgs, RecordedLink};
use crate::error::{Error, Result};
use crate::report::stdout::outln;

/// `--profile`'s help, naming the policies a plan weighs from the list its refusal names them
/// by ([`brigade::policies::registry::planned_names`]).
fn profile_help() -> String {
    format!(
        "Step profiles written by `brigade train --profile`, one run under each policy to weigh ({}; \
         the default policy's run with --activation-checkpointing too, to measure the recompute). Repeat the flag or list the files; \
         a file of several steps (--profile-steps) counts its median step.",
        brigade::policies::registry::planned_names()
    )
}

/// Options of `brigade plan`.
#[derive(Args, Clone, Debug)]
pub struct PlanArgs {
    /// Step profiles written by `brigade train --profile`, one run under each policy to weigh
    /// (the help names them: [`profile_help`]).
    #[arg(long, num_args = 1.., value_delimiter = ',', help = profile_help())]
    pub profile: Vec<PathBuf>,
    /// Most MB (MiB) one rank may hold at once during a step.
    #[arg(long, value_name = "MB", allow_negative_numbers = true)]
    pub memory_budget: f64,
    /// Plan for this many ranks (default: the profiles').
    #[arg(long)]
    pub world_size: Option<usize>,
    /// Bucket caps to weigh, in MiB.
    #[arg(long, value_delimiter = ',', default_value = "1,5,25")]
    pub bucket_mb: Vec<f64>,
    /// The first bucket's cap in MiB (default 1), never above the bucket cap.
    #[arg(long)]
    pub first_bucket_mb: Option<f64>,
    /// The link to cost the collectives on.
    #[command(flatten)]
    pub link: LinkArgs,
    /// Print the plan as JSON.
    #[arg(long)]
    pub json: bool,
}

const MIB: f64 = 1048576.0;

/// Runs `brigade plan`.
pub fn run_plan(a: PlanArgs) -> Result<()> {
    if a.profile.is_empty() {
        return Err(Error::Usage(
            "give at least one --profile FILE (written by brigade train --profile) to plan from".into(),
        ));
    }
    let link = a.link.cost()?;
    check_caps_and_world(&a.bucket_mb, a.first_bucket_mb, a.world_size)?;
    let mb = a.memory_budget;
    let budget_bytes = crate::footprint::budget_bytes(mb)?;
    let mut profiles = vec![];
    for path in &a.profile {
        let steps = read_profiles(path)?;
        profiles.push(median_step(steps).expect("read_profiles returns at least one step"));
    }
    if matches!(link, LinkCost::Measured) {
        check_one_link(&a.profile, &profiles)?;
    }
    let query = PlanQuery {
        budget_bytes,
        world_size: a.world_size,
        link,
        bucket_caps_mb: a.bucket_mb.clone(),
        first_bucket_cap_mb: a.first_bucket_mb,
    };
    let p = plan(&profiles, &query).map_err(|e| {
        let msg = e.to_string();
        // the library numbers the profiles: name the files
        let named = a.profile.iter().enumerate().fold(msg, |m, (i, path)| {
            m.replace(&format!("profile {i} "), &format!("--profile {} ", path.display()))
        });
        Error::Usage(crate::argv::in_flag_terms(&named))
    })?;
    for note in &p.notes {
        eprintln!("note: {note}");
    }
    if a.json {
        outln!(
            "{}",
            serde_json::to_string_pretty(&plan_json(&p, &query)).map_err(|e| Error::json("the plan", e))?
        );
    } else {
        print_table(&p, &query, &profiles);
    }
    match p.winner() {
        Some(_) => Ok(()),
        None => Err(Error::Usage(no_winner(&p, mb))),
    }
}

/// `--measured-link` prices each policy on the link its own profile measured: profiles of
/// runs on different links (as their command lines state them) would compare the links, not
/// the policies. One line naming both.
fn check_one_link(paths: &[PathBuf], profiles: &[StepProfile]) -> Result<()> {
    let links: Vec<(&PathBuf, RecordedLink)> = paths
        .iter()
        .zip(profiles)
        .filter_map(|(path, p)| recorded_link(p).map(|l| (path, l)))
        .collect();
    let Some((first_path, first)) = links.first() else {
        return Ok(());
    };
    match links.iter().find(|(_, l)| l != first) {
        None => Ok(()),
        Some((path, l)) => Err(Error::Usage(format!(
            "--measured-link: --profile {} was recorded on {l}, --profile {} on {first}: each policy would be \
             priced on its own run's link, so the plan would compare the links; price them on one link with \
             --net-gbps G [--net-latency-us L], or profile every policy on one link",
            path.display(),
            first_path.display()
        ))),
    }
}

/// Why there is no winner: every candidate is over the budget (the smallest named), or none
/// that fits was predicted.
fn no_winner(p: &Plan, mb: f64) -> String {
    let smallest = p.candidates.iter().min_by_key(|c| c.memory.total());
    match smallest {
        Some(c) if p.candidates.iter().all(|c| c.over_budget.is_some()) => format!(
            "--memory-budget {} MB: every candidate is over it; the smallest, {}, is predicted to peak at {:.1} MiB per rank",
            compact(mb),
            label(c),
            c.memory.total() as f64 / MIB
        ),
        _ => {
            let why = p
                .candidates
                .iter()
                .find_map(|c| c.step.as_ref().err().filter(|_| c.over_budget.is_none()))
                .cloned()
                .unwrap_or_default();
            format!(
                "--memory-budget {} MB: no candidate that fits could be predicted ({why}): profile the family of one that fits",
                compact(mb)
            )
        }
    }
}

/// `fp16 5 MiB`, `zero2 25 MiB ac1`.
fn label(c: &Candidate) -> String {
    let ac = if c.activation_checkpointing > 0 {
        format!(" ac{}", c.activation_checkpointing)
    } else {
        String::new()
    };
    format!("{} {} MiB{ac}", c.policy, c.bucket_cap_mb)
}

fn print_table(p: &Plan, q: &PlanQuery, profiles: &[brigade::ddp::overlap::StepProfile]) {
    let ms = |s: f64| format!("{:.2}", s * 1e3);
    let run = profiles[0].run.as_ref();
    let recorded: Vec<String> = profiles
        .iter()
        .map(|pr| {
            // a profile that names no policy ran an f32 all-reduce
            let name = pr
                .policy
                .as_ref()
                .map_or(PolicySpec::AllReduce.name(), |x| x.name.as_str());
            match pr.activation_checkpointing {
                0 => name.to_string(),
                n => format!("{name} ac{n}"),
            }
        })
        .collect();
    outln!(
        "plan: {} at {} ranks, {}, budget {:.1} MiB per rank; profiled: {}",
        run.map_or("?", |r| r.model.as_str()),
        p.candidates.first().map_or(profiles[0].world_size, |c| c.world_size),
        p.precision,
        q.budget_bytes as f64 / MIB,
        recorded.join(", ")
    );
    outln!(
        "  {:<24} {:>9} {:>11} {:>10} {:>9}  fits",
        "candidate",
        "step_ms",
        "exposed_ms",
        "policy_ms",
        "peak_MiB"
    );
    for c in &p.candidates {
        let peak = format!("{:.1}", c.memory.total() as f64 / MIB);
        let fits = match c.over_budget {
            None => "yes".to_string(),
            Some((part, by)) => format!("over by {} in {part}", crate::footprint::human(by)),
        };
        let mark = if c.over_budget.is_some() { "x" } else { " " };
        match &c.step {
            Ok(s) => outln!(
                "{mark} {:<24} {:>9} {:>11} {:>10} {:>9}  {fits}",
                label(c),
                ms(s.step_s),
                ms(s.exposed_comm_s),
                s.policy_compute_s.map_or("-".to_string(), ms),
                peak
            ),
            Err(why) => outln!(
                "{mark} {:<24} {:>9} {:>11} {:>10} {:>9}  {fits}; not predicted: {why}",
                label(c),
                "-",
                "-",
                "-",
                peak
            ),
        }
    }
    if let Some(w) = p.winner {
        outln!("winner: {}", crate::argv::plan_command(p, w).join(" "));
    }
}

fn plan_json(p: &Plan, q: &PlanQuery) -> serde_json::Value {
    let candidates: Vec<serde_json::Value> = p
        .candidates
        .iter()
        .map(|c| {
            let m = &c.memory;
            json!({
                "policy": c.policy.to_string(),
                "bucket_cap_mb": c.bucket_cap_mb,
                "first_bucket_cap_mb": c.first_bucket_cap_mb,
                "activation_checkpointing": c.activation_checkpointing,
                "world_size": c.world_size,
                "fits": c.over_budget.is_none(),
                "over_budget": c.over_budget.map(|(part, bytes)| json!({ "part": part, "bytes": bytes })),
                "memory": {
                    "parameters": m.parameters,
                    "gradients": m.gradients,
                    "optimizer_state": m.optimizer_state,
                    "activations": m.activations,
                    "backward": m.backward,
                    "policy_state": m.policy_state,
                    "total": m.total(),
                },
                "step": c.step.as_ref().ok(),
                "not_predicted": c.step.as_ref().err(),
            })
        })
        .collect();
    json!({
        "budget_bytes": q.budget_bytes,
        "precision": p.precision,
        "candidates": candidates,
        "winner": p.winner,
        "command": p.winner.map(|w| crate::argv::plan_command(p, w)),
    })
}
