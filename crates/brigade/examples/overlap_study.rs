//! Record one DDP step, then ask the overlap model what other bucket caps and networks would
//! expose, without running them: the study `brigade sweep` does by re-running, from one step.
//!
//! `cargo run --release -p brigade --example overlap_study`

use brigade::config::Instrumentation;
use brigade::ddp::overlap::{replay, LinkCost, ReplayConfig};
use brigade::launch::{net_model, LaunchConfig};
use brigade::models::{Dataset, Mlp, MlpConfig};
use brigade::{OptimizerConfig, TrainConfig};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // 2 ranks over a simulated 10 Gb/s network; 3 steps (step 0 rebuilds the buckets), the
    // last one's profile kept: every rank's gradient-ready times and bucket launches.
    let launch = LaunchConfig {
        net: Some(net_model(10.0, 20.0)),
        ..LaunchConfig::threads(2)
    };
    let sgd = OptimizerConfig::Sgd {
        lr: 0.01,
        momentum: 0.0,
        weight_decay: 0.0,
    };
    let cfg = {
        let mut c = TrainConfig::new(3, 32, sgd);
        c.runtime.instrument = Instrumentation {
            profile: true,
            ..Instrumentation::default()
        };
        c
    };
    let mlp = MlpConfig::new(vec![256, 1024, 1024, 1024, 10]);
    let report = brigade::fit(
        &launch,
        &cfg,
        |_| Ok(Dataset::teacher(1024, 256, 10, 0)?),
        |_| Ok(Box::new(Mlp::new(mlp.clone(), 0)?)),
    )?;
    let profile = report.outcome.profile.ok_or("no step was profiled")?;

    println!(
        "{:>10} {:>10} {:>10} {:>12} {:>12}",
        "network", "cap MiB", "buckets", "exposed ms", "bound ms"
    );
    for (name, cost) in [
        ("measured", LinkCost::Measured),
        ("1 Gb/s", LinkCost::Ring(net_model(1.0, 20.0))),
        ("100 Gb/s", LinkCost::Ring(net_model(100.0, 5.0))),
    ] {
        for cap in [0.25, 1.0, 5.0, 25.0, 100.0] {
            let r = replay(
                &profile,
                &ReplayConfig {
                    bucket_cap_mb: cap,
                    first_bucket_cap_mb: cap.min(1.0),
                    link: cost,
                    world_size: None,
                    order: Default::default(),
                },
            )?;
            println!(
                "{name:>10} {cap:>10} {:>10} {:>12.2} {:>12.2}",
                r.buckets.len(),
                r.exposed_comm_s * 1e3,
                r.lower_bound_exposed_s * 1e3
            );
        }
    }
    Ok(())
}
