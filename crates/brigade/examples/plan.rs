//! Profile one short run under each of three policy families, then ask `brigade::plan` for the
//! fastest policy and bucket cap that fit a memory budget per rank, without running them; a
//! tighter budget strikes the pick out.
//!
//! `cargo run --release -p brigade --example plan [-- STEPS]` (steps per profiled run, 2 to 5;
//! default 3)

use std::sync::Arc;

use brigade::ddp::overlap::{LinkCost, StepProfile};
use brigade::launch::{net_model, LaunchConfig};
use brigade::models::{Dataset, Mlp, MlpConfig};
use brigade::plan::{plan, PlanQuery};
use brigade::policies::PolicySpec;
use brigade::{OptimizerConfig, TrainConfig};

const WIDTHS: [usize; 5] = [256, 1024, 1024, 1024, 10];

/// The last step's profile of `steps` steps at world 2 under `policy`, over a simulated
/// 10 Gb/s link.
fn profile(policy: PolicySpec, steps: usize) -> Result<StepProfile, Box<dyn std::error::Error>> {
    let launch = LaunchConfig {
        net: Some(net_model(10.0, 20.0)),
        ..LaunchConfig::threads(2)
    };
    let mut cfg = TrainConfig::new(steps, 32, OptimizerConfig::adamw(1e-3, None));
    // what the memory model reads: the model's name and shape
    cfg.model.name = "mlp".into();
    cfg.model.config = Some(format!(r#"{{"widths":{WIDTHS:?},"dropout":0.0}}"#));
    cfg.runtime.instrument.profile = true;
    cfg.distributed.get_or_insert_default().policy = Arc::new(policy);
    let mlp = MlpConfig::new(WIDTHS.to_vec());
    let report = brigade::fit(
        &launch,
        &cfg,
        |_| Ok(Dataset::teacher(1024, 256, 10, 0)?),
        |_| Ok(Box::new(Mlp::new(mlp.clone(), 0)?)),
    )?;
    Ok(report.outcome.profile.ok_or("no step was profiled")?)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let steps = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(3usize)
        .clamp(2, 5);
    let profiles = [PolicySpec::AllReduce, PolicySpec::Fp16, PolicySpec::Zero2]
        .into_iter()
        .map(|p| profile(p, steps))
        .collect::<Result<Vec<_>, _>>()?;
    let link = LinkCost::Ring(net_model(1.0, 20.0));
    // a budget between ZeRO-2's peak and allreduce's: some candidates fit, some do not
    let peaks = plan(&profiles, &PlanQuery::new(u64::MAX, link))?;
    let totals: Vec<u64> = peaks.candidates.iter().map(|c| c.memory.total()).collect();
    let budget = (totals.iter().min().unwrap() + totals.iter().max().unwrap()) / 2;
    let p = plan(&profiles, &PlanQuery::new(budget, link))?;
    println!("budget {:.1} MiB per rank on a 1 Gb/s link:", budget as f64 / 1048576.0);
    for c in &p.candidates {
        let step = match &c.step {
            Ok(s) => format!("{:8.2} ms", s.step_s * 1e3),
            Err(why) => format!("not predicted: {why}"),
        };
        let fits = c.over_budget.map_or("fits".to_string(), |(part, by)| {
            format!("over by {:.2} MiB in {part}", by as f64 / 1048576.0)
        });
        println!(
            "{:>12} {:>4} MiB  peak {:6.1} MiB  {fits:<36} {step}",
            c.policy.to_string(),
            c.bucket_cap_mb,
            c.memory.total() as f64 / 1048576.0
        );
    }
    let winner = p.winner().ok_or("nothing fits the budget")?;
    assert!(winner.over_budget.is_none() && winner.memory.total() <= budget);
    println!(
        "pick: {} at a {} MiB bucket cap (first {} MiB), activation checkpointing {}, {} ranks",
        winner.policy,
        winner.bucket_cap_mb,
        winner.first_bucket_cap_mb,
        winner.activation_checkpointing,
        winner.world_size
    );

    // a budget one byte under the pick's peak strikes it out
    let tighter = plan(&profiles, &PlanQuery::new(winner.memory.total() - 1, link))?;
    let same = tighter
        .candidates
        .iter()
        .find(|c| c.policy == winner.policy && c.bucket_cap_mb == winner.bucket_cap_mb)
        .ok_or("the pick is a candidate")?;
    assert!(same.over_budget.is_some(), "a tighter budget strikes the pick");
    match tighter.winner() {
        Some(w) => println!("one byte tighter: {} at {} MiB instead", w.policy, w.bucket_cap_mb),
        None => println!("one byte tighter: nothing fits"),
    }
    Ok(())
}
