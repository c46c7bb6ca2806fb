//! A study's predictions from a policy's profiled steps: its step on each link and world, the
//! steps and seconds to each target loss, and the error band of its own profiles' replays.

use brigade_ddp::overlap::{
    measured_link, replay_with, BucketOrder, LaunchOverhead, LinkCost, ReplayConfig, StepProfile,
};
use serde::Serialize;

use super::{Prediction, Reached, StudyConfig};

/// The relative error of a policy's own profiles replayed on the link they were recorded on
/// (each step's own fit where it recorded something on the link, else the fit to every
/// profiled step at once, [`brigade_ddp::overlap::measured_link`]: a policy that syncs every
/// few steps sends nothing in the others) against the steps they measured: `(predicted -
/// measured) / measured`, the lowest and the highest over the profiled steps.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct OwnBand {
    /// The lowest relative error.
    pub low: f64,
    /// The highest relative error.
    pub high: f64,
}

/// What [`predict`] found.
pub(super) struct Predicted {
    pub measured_step_s: Option<f64>,
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

/// The mean of `v` (`None`: empty): a step's time to a target counts every step, so the step
/// it is measured and predicted at is the mean, a policy's rare slow step (a sync every few
/// steps) included.
fn mean(v: &[f64]) -> Option<f64> {
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

/// The mean over `profiles` (at least one) of their replays under `link` at `world` ranks, each at its
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
    mean(&steps).ok_or_else(|| "no profiled step".into())
}

/// The link each of `profiles` was recorded on, as `brigade predict --measured-link` takes it:
/// the step's own fit where it recorded something on the link, else the fit to every profile
/// at once ([`measured_link`]); one line when none recorded anything on the link.
fn own_links(profiles: &[StepProfile]) -> Result<Vec<LinkCost>, String> {
    let joint = measured_link(&profiles.iter().collect::<Vec<_>>()).map_err(|e| e.to_string())?;
    // syncs that run behind the next steps: a step's profile holds only what had run of them
    // when its `after_step` returned
    let overlapped = profiles.iter().any(|p| {
        (p.policy.as_ref())
            .and_then(|p| p.after_step.as_ref())
            .is_some_and(|a| a.overlap_steps > 0)
    });
    profiles
        .iter()
        .map(|p| match measured_link(&[p]).map_err(|e| e.to_string())? {
            Some(_) => Ok(LinkCost::Measured),
            None => joint.map(LinkCost::Ring).ok_or_else(|| match overlapped {
                true => "its collectives run behind the next steps, and a profiled step holds only what had run of \
                         them when it ended: there is no whole collective on the link to replay its own steps on"
                    .into(),
                false => {
                    "no profiled step recorded anything on the link: there is no link to replay its own steps on".into()
                }
            }),
        })
        .collect()
}

/// The band of the relative errors of replaying each of `profiles` (a run on `world` ranks) on
/// its own link against its measured step (`None` without profiles); why there is none.
fn own_band(profiles: &[StepProfile], world: usize, overhead: LaunchOverhead) -> Result<Option<OwnBand>, String> {
    if world < 2 {
        return Err("on one rank nothing crosses a link, so there is no link to replay its own steps on".into());
    }
    if profiles.is_empty() {
        return Ok(None);
    }
    let links = own_links(profiles)?;
    let errors = (profiles.iter().zip(links))
        .map(|(p, link)| {
            replayed(std::slice::from_ref(p), overhead, link, None).map(|s| (s - measured(p)) / measured(p))
        })
        .collect::<Result<Vec<f64>, String>>()?;
    Ok(Some(OwnBand {
        low: errors.iter().copied().fold(f64::INFINITY, f64::min),
        high: errors.iter().copied().fold(f64::NEG_INFINITY, f64::max),
    }))
}

/// Predicts from the profiled steps `profiles` of a run on `world` ranks whose losses were
/// `losses`.
pub(super) fn predict(profiles: &[StepProfile], world: usize, losses: &[f64], sc: &StudyConfig) -> Predicted {
    let overhead = LaunchOverhead::fit(&profiles.iter().collect::<Vec<_>>());
    let measured_step_s = mean(&profiles.iter().map(measured).collect::<Vec<_>>());
    // every note the prediction leaves, each once, in the order they arose
    let mut notes: Vec<String> = vec![];
    let mut note = |n: String| {
        if !notes.contains(&n) {
            notes.push(n);
        }
    };
    let own_band = match own_band(profiles, world, overhead) {
        Ok(band) => band,
        Err(e) => {
            note(format!("no error band: {e}"));
            None
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
                        note(format!("not predicted: {e}"));
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
        note: notes.join("; "),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A step of a policy that sends every parameter after every second optimizer step (one
    /// 1 MiB parameter, 2 ranks, 10 ms of backward): `after_link_s` of the optimizer's span on
    /// the link (0 in a step that did not sync).
    fn step(after_link_s: f64) -> StepProfile {
        let rank = |r: usize| {
            serde_json::json!({
                "rank": r, "backward_start_s": 0.0, "backward_end_s": 0.010,
                "optimizer_start_s": 0.010, "optimizer_end_s": 0.011 + after_link_s,
                "step_end_s": 0.011 + after_link_s, "grad_ready_s": [0.010], "buckets": [],
                "policy_s": { "reduce_s": 0.0, "after_step_s": after_link_s, "after_step_link_s": after_link_s }
            })
        };
        serde_json::from_value(serde_json::json!({
            "version": 2, "world_size": 2, "bucket_cap_mb": 25.0, "first_bucket_cap_mb": 1.0,
            "policy": { "name": "periodic", "wire": { "kind": "local" },
                        "after_step": { "op": "all_reduce", "bytes_per_element": 4.0, "every": 2 } },
            "params": [ { "name": "w", "bytes": 1 << 20, "shape": [512, 512] } ],
            "ranks": [rank(0), rank(1)]
        }))
        .unwrap()
    }

    #[test]
    fn a_step_that_sent_nothing_is_replayed_on_the_link_the_others_measured() {
        // The step that did not sync measured no link of its own: it is replayed on the one
        // the syncing step measured, and the band covers both steps.
        let profiles = [step(0.004), step(0.0)];
        let sc = StudyConfig::new(vec![], vec![]);
        let p = predict(&profiles, 2, &[], &sc);
        assert_eq!(p.note, "");
        let band = p.own_band.expect("an error band over both steps");
        assert!(band.low.is_finite() && band.high.is_finite() && band.low <= band.high);
        // both steps are charged half the sync (every 2 steps): the syncing step measured all
        // of it, the other none, so one replays under its step and the other over it
        assert!(band.low < 0.0 && band.high > 0.0, "{band:?}");
    }

    #[test]
    fn the_measured_and_predicted_step_are_the_mean_of_the_profiled_steps() {
        // one step in three syncs: the time to a target counts it, and so must the step
        let profiles = [step(0.030), step(0.0), step(0.0)];
        let sc = StudyConfig::new(vec![crate::launch::net_model(1.0, 20.0)], vec![]);
        let p = predict(&profiles, 2, &[], &sc);
        let each: Vec<f64> = profiles.iter().map(measured).collect();
        let mean = each.iter().sum::<f64>() / 3.0;
        let got = p.measured_step_s.expect("three profiled steps");
        assert!(
            (got - mean).abs() <= 1e-12 * mean,
            "{got} against the mean {mean} of {each:?}"
        );
        let (link, overhead) = (
            LinkCost::Ring(sc.links[0]),
            LaunchOverhead::fit(&profiles.iter().collect::<Vec<_>>()),
        );
        let one = |q: &StepProfile| replayed(std::slice::from_ref(q), overhead, link, Some(2)).unwrap();
        let predicted: f64 = profiles.iter().map(one).sum::<f64>() / 3.0;
        let step_s = p.predictions[0].step_s.expect("predicted");
        assert!(
            (step_s - predicted).abs() <= 1e-12 * predicted,
            "{step_s} against {predicted}"
        );
    }

    #[test]
    fn a_run_with_no_profiled_step_has_no_measured_step() {
        let p = predict(&[], 2, &[], &StudyConfig::new(vec![], vec![]));
        assert_eq!(p.measured_step_s, None);
    }

    #[test]
    fn every_note_the_prediction_leaves_is_kept_once() {
        // one rank (no error band) and a profile the replay refuses at both links: the first
        // note is kept beside the second, and the second, met twice, is said once
        let mut broken = step(0.0);
        broken.ranks.truncate(1);
        let link = |gbps: f64| crate::launch::net_model(gbps, 20.0);
        let sc = StudyConfig::new(vec![link(1.0), link(10.0)], vec![]);
        let p = predict(&[broken], 1, &[], &sc);
        let notes: Vec<&str> = p.note.split("; ").collect();
        assert_eq!(notes.len(), 2, "{}", p.note);
        assert!(notes[0].starts_with("no error band: "), "{}", p.note);
        assert!(notes[1].starts_with("not predicted: "), "{}", p.note);
    }

    #[test]
    fn a_run_on_one_rank_says_why_it_has_no_error_band() {
        let p = predict(&[step(0.0)], 1, &[], &StudyConfig::new(vec![], vec![]));
        assert!(p.own_band.is_none());
        assert!(
            p.note.starts_with("no error band: ") && p.note.contains("one rank"),
            "{}",
            p.note
        );
    }
}
