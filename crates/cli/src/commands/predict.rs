//! `brigade predict`: replay a recorded step (`brigade train --profile`) under other bucket
//! caps, links and world sizes, without running anything (the overlap model,
//! `brigade_ddp::overlap`).

use crate::report::stdout::outln;
use std::io::Read;
use std::path::{Path, PathBuf};

use brigade_ddp::overlap::{
    replay_with, BucketOrder, LaunchCost, LaunchOverhead, LinkCost, ReplayConfig, ReplayResult, StepProfile,
};
use clap::Args;

use crate::args::check_link;
use crate::error::{Error, Result};

/// Largest `--world-size` to predict for.
const MAX_WORLD: usize = 1 << 20;

/// Options of `brigade predict`.
#[derive(Args, Clone, Debug)]
pub struct PredictArgs {
    /// A step profile written by `brigade train --profile`.
    #[arg(long)]
    pub profile: PathBuf,
    /// Bucket caps to predict, in MiB.
    #[arg(long, value_delimiter = ',', default_value = "0.25,1,5,25,100")]
    pub bucket_mb: Vec<f64>,
    /// The first bucket's cap in MiB (default 1), never above the bucket cap (as `brigade train`).
    #[arg(long)]
    pub first_bucket_mb: Option<f64>,
    /// The link to cost the collectives on.
    #[command(flatten)]
    pub link: LinkArgs,
    /// Cost the collectives for this many ranks (default: the profile's).
    #[arg(long)]
    pub world_size: Option<usize>,
    /// Print the predictions as JSON.
    #[arg(long)]
    pub json: bool,
}

/// The link `brigade predict` and `brigade plan` cost collectives on: a ring of simulated links,
/// or the one the profiled runs had (exactly one).
#[derive(Args, Clone, Debug)]
pub struct LinkArgs {
    /// A ring of links of this many gigabits per second (with --net-latency-us).
    #[arg(long)]
    pub net_gbps: Option<f64>,
    /// Latency per message of those links, in microseconds.
    #[arg(long, default_value_t = 0.0)]
    pub net_latency_us: f64,
    /// The link the profiled runs had, fitted from their recorded buckets (instead of
    /// --net-gbps).
    #[arg(long)]
    pub measured_link: bool,
}

impl LinkArgs {
    /// The link `--net-gbps G [--net-latency-us L]` or `--measured-link` names.
    pub fn cost(&self) -> Result<LinkCost> {
        let (net_gbps, net_latency_us) = (self.net_gbps, self.net_latency_us);
        let bad = |m: String| Err(Error::Usage(m));
        match (net_gbps, self.measured_link) {
            (Some(_), true) => bad("--net-gbps and --measured-link name two links: pick one".into()),
            (None, false) => {
                bad("say which link to predict for: --net-gbps G [--net-latency-us L], or --measured-link".into())
            }
            (None, true) if net_latency_us != 0.0 => bad(format!(
            "--net-latency-us {net_latency_us} goes with --net-gbps; --measured-link fits the latency from the profile"
        )),
            (None, true) => Ok(LinkCost::Measured),
            (Some(g), false) => {
                check_link(Some(g), net_latency_us)?;
                Ok(LinkCost::Ring(brigade::launch::net_model(g, net_latency_us)))
            }
        }
    }
}

/// Checks `--world-size` (when given) and the caps of `--bucket-mb` and `--first-bucket-mb`.
pub fn check_caps_and_world(bucket_mb: &[f64], first_bucket_mb: Option<f64>, world: Option<usize>) -> Result<()> {
    if let Some(n) = world.filter(|n| !(1..=MAX_WORLD).contains(n)) {
        return Err(Error::Usage(format!(
            "--world-size must be between 1 and {MAX_WORLD}, got {n}"
        )));
    }
    if let Some(c) = bucket_mb
        .iter()
        .chain(&first_bucket_mb)
        .find(|&&c| !crate::args::cap_in_range(c))
    {
        return Err(Error::Usage(format!(
            "--bucket-mb and --first-bucket-mb must be finite, at least one byte ({:e}) and at most {}, got {}",
            crate::args::MIN_BUCKET_MB,
            crate::args::MAX_BUCKET_MB,
            if c.is_finite() && c.abs() < 1e7 {
                c.to_string()
            } else {
                format!("{c:e}")
            }
        )));
    }
    if let Some(c) = crate::args::listed_twice(bucket_mb) {
        return Err(Error::Usage(format!(
            "--bucket-mb lists {c} twice: each cap is one row"
        )));
    }
    Ok(())
}

/// The step profiles of the file at `path`: one step (`--profile`) or a list of steps
/// (`--profile-steps`); one line when it is neither.
pub fn read_profiles(path: &Path) -> Result<Vec<StepProfile>> {
    let text = read_profile(path)?;
    match serde_json::from_str::<StepProfile>(&text) {
        Ok(p) => Ok(vec![p]),
        Err(e) => match serde_json::from_str::<Vec<StepProfile>>(&text) {
            Ok(list) if !list.is_empty() => Ok(list),
            _ => Err(Error::Usage(format!(
                "{}: not a step profile (written by brigade train --profile): {e}",
                path.display()
            ))),
        },
    }
}

/// Largest profile file `brigade predict` reads (a step profile is kilobytes; a list of
/// thousands of steps, megabytes).
const MAX_PROFILE_BYTES: u64 = 256 << 20;

/// The text of the profile file at `path`, reading at most [`MAX_PROFILE_BYTES`] (so that a
/// device such as `/dev/zero` or `/dev/urandom` is refused instead of read forever).
fn read_profile(path: &Path) -> Result<String> {
    let io = |source| Error::Io {
        path: path.display().to_string(),
        source,
    };
    let mut bytes = vec![];
    std::fs::File::open(path)
        .map_err(io)?
        .take(MAX_PROFILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(io)?;
    let not_a_profile = |why: String| {
        Error::Usage(format!(
            "{}: not a step profile (written by brigade train --profile): {why}",
            path.display()
        ))
    };
    if bytes.len() as u64 > MAX_PROFILE_BYTES {
        return Err(not_a_profile(format!(
            "it is larger than {} MiB",
            MAX_PROFILE_BYTES >> 20
        )));
    }
    String::from_utf8(bytes).map_err(|_| not_a_profile("it is not text".into()))
}

/// Runs `brigade predict`.
pub fn predict(a: PredictArgs) -> Result<()> {
    let link = a.link.cost()?;
    check_caps_and_world(&a.bucket_mb, a.first_bucket_mb, a.world_size)?;
    let profiles = read_profiles(&a.profile)?;
    let profile = &profiles[0];
    if let Some((i, p)) = profiles
        .iter()
        .enumerate()
        .find(|(_, p)| p.world_size != profile.world_size)
    {
        return Err(Error::Usage(format!(
            "{}: step {i} of the list recorded {} ranks, step 0 {}: one run's steps, please",
            a.profile.display(),
            p.world_size,
            profile.world_size
        )));
    }
    // the backend's launch overhead, fitted once from every recorded step
    let overhead = LaunchOverhead::fit(&profiles.iter().collect::<Vec<_>>());
    let mut rows = vec![];
    for &cap in &a.bucket_mb {
        let cfg = ReplayConfig {
            bucket_cap_mb: cap,
            first_bucket_cap_mb: a.first_bucket_mb.unwrap_or(1.0).min(cap),
            link,
            world_size: a.world_size,
            order: BucketOrder::recorded(&profiles[0]),
        };
        let mut steps = profiles
            .iter()
            .enumerate()
            .map(|(i, p)| {
                replay_with(p, &cfg, overhead).map_err(|e| {
                    let step = if profiles.len() > 1 {
                        format!(" (step {i} of the list)")
                    } else {
                        String::new()
                    };
                    Error::Usage(format!("{}{step}: {e}", a.profile.display()))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        // several steps: the one whose predicted step time is the median
        steps.sort_by(|x, y| x.predicted_step_s.total_cmp(&y.predicted_step_s));
        rows.push(steps.swap_remove(steps.len() / 2));
    }
    if a.json {
        outln!(
            "{}",
            serde_json::to_string_pretty(&rows).map_err(|e| Error::json("the predictions", e))?
        );
    } else {
        if profiles.len() > 1 {
            outln!(
                "{} steps recorded: each row is the step with the median predicted step time",
                profiles.len()
            );
        }
        print_table(profile, &rows);
    }
    Ok(())
}

fn print_table(profile: &StepProfile, rows: &[ReplayResult]) {
    const MIB: f64 = 1048576.0;
    let ms = |s: f64| s * 1e3;
    outln!(
        "profile: {} ranks, recorded at bucket cap {} MiB; predictions for {} ranks",
        profile.world_size,
        profile.bucket_cap_mb,
        rows.first().map_or(profile.world_size, |r| r.world_size)
    );
    if let Some(o) = rows
        .first()
        .map(|r| r.launch_overhead)
        .filter(|_| profile.world_size > 1)
    {
        let cost = |c: LaunchCost| format!("{:.3} ms + {:.3} ms/MiB", ms(c.fixed_s), ms(c.per_byte_s) * MIB);
        outln!(
            "launch overhead fitted from the recorded buckets: {} during backward, {} after",
            cost(o.during_backward),
            cost(o.after_backward)
        );
    }
    outln!(
        "{:>10} {:>7} {:>10} {:>12} {:>9} {:>11} {:>13}  exposed buckets",
        "bucket_MiB",
        "buckets",
        "step_ms",
        "compute_ms",
        "comm_ms",
        "exposed_ms",
        "lower_bound_ms"
    );
    for r in rows {
        let exposed: Vec<String> = r
            .buckets
            .iter()
            .enumerate()
            .filter(|(_, b)| b.exposed_s > 0.0)
            .map(|(i, b)| format!("{i} ({:.2} ms)", ms(b.exposed_s)))
            .collect();
        outln!(
            "{:>10} {:>7} {:>10.2} {:>12.2} {:>9.2} {:>11.2} {:>13.2}  {}",
            r.bucket_cap_mb,
            r.buckets.len(),
            ms(r.predicted_step_s),
            ms(r.compute_step_s),
            ms(r.comm_s),
            ms(r.exposed_comm_s),
            ms(r.lower_bound_exposed_s),
            if exposed.is_empty() {
                "none".to_string()
            } else {
                exposed.join(", ")
            }
        );
    }
    if let Some(r) = rows.first().filter(|r| !r.gathers.is_empty()) {
        let waited: Vec<String> = rows.iter().map(|r| format!("{:.2}", ms(r.exposed_gather_s))).collect();
        outln!(
            "parameter gathers: {} per step; the compute waited {:.2} ms for them in the recorded step, \
             predicted per row: {} ms",
            r.gathers.len(),
            ms(profile.gather_waited_s()),
            waited.join(", ")
        );
    }
}
