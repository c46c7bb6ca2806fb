//! A study's predictions from a policy's profiled steps: its step on each link and world, the
//! steps and seconds to each target loss, and the error band of its own profiles' replays.

use brigade_ddp::overlap::{replay_with, BucketOrder, LaunchOverhead, LinkCost, ReplayConfig, StepProfile};
use serde::Serialize;

use super::{Prediction, Reached, StudyConfig};

/// The relative error of a policy's own profiles replayed on the link they were recorded on
/// (fitted from their buckets) against the steps they measured: `(predicted - measured) /
/// measured`, the lowest and the highest over the profiled steps.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct OwnBand {
    /// The lowest relative error.
    pub low: f64,
    /// The highest relative error.
    pub high: f64,
}

/// What [`predict`] found.
pub(super) struct Predicted {
    pub measured_step_s: f64,
    pub own_band: Option<OwnBand>,
    pub predictions: Vec<Prediction>,
    pub note: String,
}

/// Steps run up to and including the first whose loss is at most `target` (`None`: never).
pub fn reach(losses: &[f64], target: f64) -> Option<usize> {
    losses.iter().position(|&l| l <= target).map(|i| i + 1)
}

/// The measured step of a profile: the mean over the ranks of its end.
fn measured(p: &StepProfile) -> f64 {
    p.ranks.iter().map(|r| r.step_end_s).sum::<f64>() / p.ranks.len().max(1) as f64
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => 0.5 * (v[n / 2 - 1] + v[n / 2]),
    }
}

/// The median over `profiles` of their replays under `link` at `world` ranks, each at its
/// recorded caps and bucket order.
fn replayed(
    profiles: &[StepProfile],
    overhead: LaunchOverhead,
    link: LinkCost,
    world: Option<usize>,
) -> Result<f64, String> {
    let steps = profiles
        .iter()
        .map(|p| {
            let cfg = ReplayConfig {
                bucket_cap_mb: p.bucket_cap_mb,
                first_bucket_cap_mb: p.first_bucket_cap_mb,
                link,
                world_size: world,
                order: BucketOrder::recorded(p),
            };
            replay_with(p, &cfg, overhead).map(|r| r.predicted_step_s)
        })
        .collect::<Result<Vec<f64>, _>>()
        .map_err(|e| e.to_string())?;
    Ok(median(steps))
}

/// Predicts from the profiled steps `profiles` of a run on `world` ranks whose losses were
/// `losses`.
pub(super) fn predict(profiles: &[StepProfile], world: usize, losses: &[f64], sc: &StudyConfig) -> Predicted {
    let overhead = LaunchOverhead::fit(&profiles.iter().collect::<Vec<_>>());
    let measured_step_s = median(profiles.iter().map(measured).collect());
    let mut note = String::new();
    let own_band = if world < 2 || profiles.is_empty() {
        None
    } else {
        let errors: Result<Vec<f64>, String> = profiles
            .iter()
            .map(|p| {
                replayed(std::slice::from_ref(p), overhead, LinkCost::Measured, None)
                    .map(|s| (s - measured(p)) / measured(p))
            })
            .collect();
        match errors {
            Ok(e) => Some(OwnBand {
                low: e.iter().copied().fold(f64::INFINITY, f64::min),
                high: e.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            }),
            Err(e) => {
                note = e;
                None
            }
        }
    };
    let worlds = std::iter::once(world).chain(sc.other_worlds.iter().copied().filter(|&w| w != world));
    let mut predictions = vec![];
    for w in worlds {
        for link in &sc.links {
            let step_s = if profiles.is_empty() {
                None
            } else {
                match replayed(profiles, overhead, LinkCost::Ring(*link), Some(w)) {
                    Ok(s) => Some(s),
                    Err(e) => {
                        note = e;
                        None
                    }
                }
            };
            let reached = if w == world {
                sc.targets
                    .iter()
                    .map(|&target| {
                        let steps = reach(losses, target);
                        Reached {
                            target,
                            steps,
                            seconds: steps.zip(step_s).map(|(n, s)| n as f64 * s),
                        }
                    })
                    .collect()
            } else {
                vec![]
            };
            predictions.push(Prediction {
                world_size: w,
                net_gbps: link.bandwidth_bytes_per_s * 8.0 / 1e9,
                net_latency_us: link.latency.as_secs_f64() * 1e6,
                step_s,
                reached,
            });
        }
    }
    Predicted {
        measured_step_s,
        own_band,
        predictions,
        note,
    }
}
