//! The training loop as one call, over a user's model and data: [`fit()`] starts the ranks
//! ([`crate::launch`]), has every rank build its own model and run a [`Trainer`] on its shard
//! of the data, and returns rank 0's view of the run as a [`RunReport`]: what `brigade train`
//! runs, with the same sharding, `no_sync` accumulation, checkpoint/resume, timeline and step
//! profile. Progress goes to the configuration's observer ([`crate::observe`]).

use std::sync::{Mutex, PoisonError};
use std::time::Instant;

use brigade_comm::{all_gather_bytes, TraceEvent};
use brigade_models::Model;
use brigade_tensor::MemoryMeter;

use crate::config::TrainConfig;
use crate::error::{Error, Result};
use crate::launch::{run_ranks, CommBackend, LaunchConfig, RankContext};
use crate::outcome::TrainOutcome;
use crate::source::DataSource;
use crate::trace_gather::gather_step_events;
use crate::trainer::Trainer;

/// One step of every rank, recorded.
pub struct StepTimeline {
    /// The step.
    pub step: usize,
    /// Every rank's events of the step.
    pub events: Vec<TraceEvent>,
    /// Time zero of the trace.
    pub origin: Instant,
}

/// What a run produced, as seen from rank `rank` (rank 0 with threads; this process's rank under
/// MPI). Losses are global means over the ranks.
pub struct RunReport {
    /// The rank whose view this is: only rank 0's outcome holds the final parameters.
    pub rank: usize,
    /// World size.
    pub world_size: usize,
    /// That rank's training outcome, with every rank's entries in its step profiles.
    pub outcome: TrainOutcome,
    /// The last step run, recorded on every rank (when the launch had a recorder and a step ran).
    pub timeline: Option<StepTimeline>,
}

/// What one rank returns: its training outcome, and under MPI the recorded last step of
/// every rank (each process records only its own).
struct RankOut {
    train: TrainOutcome,
    gathered: Option<Vec<TraceEvent>>,
}

/// Trains on every rank `launch_cfg` starts. `data(world_size)` prepares the data once per
/// process (under MPI every process's must succeed, or all fail with the first failing rank's
/// error); `model(ctx)` builds rank `ctx.rank`'s own model (DDP then starts every rank from rank
/// 0's values). Returns this process's lowest rank's view of the run, or the root-cause error
/// naming its rank. A rank that fails after a step finished (a collective timeout) still
/// returns rank 0's record of the finished steps: [`TrainOutcome::stopped`] holds the error,
/// and the report has no parameters (nor, on more than one rank, profiles).
///
/// ```
/// use brigade::launch::LaunchConfig;
/// use brigade::models::{Dataset, Mlp, MlpConfig};
/// use brigade::{OptimizerConfig, TrainConfig};
///
/// let cfg = TrainConfig::new(5, 32, OptimizerConfig::adamw(1e-3, None));
/// let report = brigade::fit(
///     &LaunchConfig::threads(2),
///     &cfg,
///     |_world| Dataset::teacher(4096, 16, 4, 0).map_err(Into::into),
///     |_ctx| Ok(Box::new(Mlp::new(MlpConfig::new(vec![16, 64, 4]), 0)?)),
/// )?;
/// assert_eq!(report.outcome.losses().len(), 5); // the mean loss over the ranks of each step
/// assert_eq!(report.outcome.params.len(), 4); // rank 0's trained `layers.{0,1}.{weight,bias}`
/// # Ok::<(), brigade::Error>(())
/// ```
pub fn fit<D: DataSource>(
    launch_cfg: &LaunchConfig,
    cfg: &TrainConfig,
    data: impl FnOnce(usize) -> Result<D>,
    model: impl Fn(&RankContext) -> Result<Box<dyn Model>> + Sync,
) -> Result<RunReport> {
    // rank 0's finished steps, when a rank's failure stops the run after some
    let finished = Mutex::new(None);
    let launched = match run_ranks(launch_cfg, data, |ctx, data| {
        // every tensor this rank's thread makes from its model on counts to its memory
        let before = MemoryMeter::install(Some(MemoryMeter::new()));
        // under a sharded start the model's parameters are recipes until each rank draws its shards
        let built = {
            let _part = brigade_ddp::MemoryPart::Parameters.enter();
            match cfg.starts_sharded() {
                true => brigade_autograd::defer_param_init(|| model(ctx)),
                false => model(ctx),
            }
        };
        let out = built.and_then(|m| rank_main(ctx, cfg, m, data, &finished));
        MemoryMeter::install(before);
        out
    }) {
        Ok(l) => l,
        Err(e) => {
            return match finished.into_inner().unwrap_or_else(PoisonError::into_inner) {
                Some(outcome) => Ok(partway(launch_cfg, outcome, e)),
                None => Err(e),
            }
        }
    };
    let world_size = launched.world_size;
    let (rank, RankOut { train, gathered }) = launched
        .results
        .into_iter()
        .next()
        .ok_or_else(|| Error::Launch("the launch ran no rank in this process".into()))?;
    let timeline = match (&launch_cfg.recorder, train.last_step()) {
        (Some(rec), Some(step)) => Some(StepTimeline {
            step,
            events: gathered.unwrap_or_else(|| rec.events_during(&brigade_ddp::Phase::Step(step).kind())),
            origin: rec.origin(),
        }),
        _ => None,
    };
    Ok(RunReport {
        rank,
        world_size,
        outcome: train,
        timeline,
    })
}

/// Rank 0's report of a run that a rank's failure (`error`) stopped after `outcome`'s steps
/// had finished: those steps, the last one's timeline, and the error in
/// [`TrainOutcome::stopped`]. Its profiles hold every rank's entries only on one rank (gathering
/// the others' needs the collectives that failed): with more, none are kept.
fn partway(launch_cfg: &LaunchConfig, mut outcome: TrainOutcome, error: Error) -> RunReport {
    if launch_cfg.world_size > 1 {
        outcome.profile = None;
        outcome.profiles.clear();
    }
    outcome.stopped = Some(error);
    let timeline = match (&launch_cfg.recorder, outcome.last_step()) {
        (Some(rec), Some(step)) => Some(StepTimeline {
            step,
            events: rec.events_during(&brigade_ddp::Phase::Step(step).kind()),
            origin: rec.origin(),
        }),
        _ => None,
    };
    RunReport {
        rank: 0,
        world_size: launch_cfg.world_size,
        outcome,
        timeline,
    }
}

/// One rank: train; gather every rank's profile entry, and under MPI the recorded last step.
fn rank_main(
    ctx: &RankContext,
    cfg: &TrainConfig,
    model: Box<dyn Model>,
    data: &dyn DataSource,
    finished: &Mutex<Option<TrainOutcome>>,
) -> Result<RankOut> {
    let mut train = Trainer::new(cfg, model, data, ctx)?.run_keeping(finished)?;
    // every rank's entries, on every rank (rank 0 writes the file); every rank kept as many
    for profile in train.profile.iter_mut().chain(train.profiles.iter_mut()) {
        let mine = serde_json::to_vec(&profile.ranks[0]).map_err(|e| Error::json("step profile", e))?;
        let all = all_gather_bytes(ctx.control.as_ref(), mine, "profile")?;
        profile.ranks = all
            .iter()
            .map(|b| serde_json::from_slice(b))
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| Error::json("step profile from a peer", e))?;
    }
    let gathered = match (&ctx.recorder, ctx.launcher, train.last_step()) {
        (Some(rec), CommBackend::Mpi, Some(last)) => Some(gather_step_events(ctx.control.as_ref(), rec, last)?),
        _ => None,
    };
    Ok(RankOut { train, gathered })
}
