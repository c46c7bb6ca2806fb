//! Record one DDP step, then ask the overlap model what other bucket caps and networks would
//! expose, without running them: the study `brigade sweep` does by re-running, from one step.
//!
//! `cargo run --release -p brigade --example overlap_study`

use std::time::{Duration, Instant};

use brigade::comm::NetModel;
use brigade::ddp::overlap::{replay, LinkCost, ParamProfile, RankProfile, ReplayConfig, StepProfile, PROFILE_VERSION};
use brigade::ddp::{DdpConfig, DistributedDataParallel};
use brigade::launch::{launch, Backend, LaunchConfig};
use brigade::models::{Dataset, Mlp, MlpConfig, Model};

fn link(gbps: f64, latency_us: f64) -> NetModel {
    NetModel {
        latency: Duration::from_secs_f64(latency_us * 1e-6),
        bandwidth_bytes_per_s: gbps * 1e9 / 8.0,
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (world, batch, cap_mb) = (2, 32, 25.0);
    let mlp = MlpConfig::new(vec![256, 1024, 1024, 1024, 10]);
    let cfg = LaunchConfig {
        backend: Backend::Thread,
        world_size: world,
        timeout: Duration::from_secs(120),
        net: Some(link(10.0, 20.0)), // the recorded run's network: simulated 10 Gb/s
        recorder: None,
    };
    let data = Dataset::teacher(1024, 256, 10, 0)?;
    let launched = launch(
        &cfg,
        |_| Ok(data),
        |ctx, data| {
            let model = Mlp::new(mlp.clone(), 0)?;
            let ddp_cfg = DdpConfig {
                bucket_cap_mb: cap_mb,
                ..DdpConfig::default()
            };
            let ddp = DistributedDataParallel::new(model.params(), ctx.comm.clone(), ddp_cfg)?;
            let mut profile = None;
            for s in 0..3 {
                // step 0 rebuilds the buckets; the last step is the one recorded
                let t0 = Instant::now();
                model.params().zero_grad()?;
                model
                    .loss(&data.batch((s * world + ctx.rank) * batch, batch)?)?
                    .backward()?;
                let opt = (Instant::now(), Instant::now()); // (no optimizer here: an SGD step is tiny)
                profile = RankProfile::from_pass(ctx.rank, t0, &ddp.last_pass(), opt, Instant::now());
            }
            let params = model
                .params()
                .params()
                .iter()
                .map(|p| ParamProfile {
                    name: p.name().unwrap_or("?").into(),
                    bytes: p.value().numel() * 4,
                })
                .collect::<Vec<_>>();
            Ok((params, profile))
        },
    )?;
    let params = launched.results[0].1 .0.clone();
    let ranks: Vec<RankProfile> = launched.results.into_iter().filter_map(|(_, (_, p))| p).collect();
    let profile = StepProfile {
        version: PROFILE_VERSION,
        world_size: world,
        bucket_cap_mb: cap_mb,
        first_bucket_cap_mb: 1.0,
        params,
        ranks,
    };

    println!(
        "{:>10} {:>10} {:>10} {:>12} {:>12}",
        "network", "cap MiB", "buckets", "exposed ms", "bound ms"
    );
    for (name, cost) in [
        ("measured", LinkCost::Measured),
        ("1 Gb/s", LinkCost::Ring(link(1.0, 20.0))),
        ("100 Gb/s", LinkCost::Ring(link(100.0, 5.0))),
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
