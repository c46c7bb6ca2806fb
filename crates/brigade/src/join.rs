//! Uneven inputs (PyTorch's `Join`, `DistributedDataParallel.join`): ranks whose data ends at
//! different steps train together until every rank's data has ended.
//!
//! Under a [`JoinMode`] each rank's data is one pass over its rows
//! ([`crate::source::DataSource::rank_lengths`]: `rows / (batch_size * accum)` whole steps; the
//! rows left over are not read). At the start of every step the ranks agree on which of them
//! still have data: before the first step in one small all-reduce of its own ([`JOIN_TAG`]),
//! after it in a slot per rank of the step status all-reduce of the step before (each rank
//! knows whether its own data holds the next step). A rank whose data has ended
//! *joins*: instead of forward and backward it runs DDP's join pass
//! ([`brigade_ddp::DistributedDataParallel::join`]: every bucket reduced from zeros through the
//! policy's `reduce_joined`), and from there on it runs the rest of the step like the others —
//! the loss agreement (contributing no loss), the clipping norm, the optimizer step on the
//! reduced gradient (ZeRO's all-gathers included), the evaluation, the checkpoint's gathers, the
//! autotuner's and profile's exchanges — so that it issues every collective the ranks with data
//! issue, and its parameters and optimizer state stay those of every other rank. The run ends
//! when every rank's data has ended (or at `steps`); the ranks then compare a checksum of their
//! parameters ([`check_replicas`]).
//!
//! The gradient of a step is the sum over the ranks with data divided by the initial world size
//! ([`JoinMode::DivideInitial`], PyTorch's default `divide_by_initial_world_size=True`) or by
//! the number of ranks with data ([`JoinMode::DivideActive`]); [`JoinMode::Throw`] stops every
//! rank at the first step at which some rank has no data, with one error naming it.
//!
//! Where Brigade differs from PyTorch: a joined rank keeps stepping its optimizer on the reduced
//! gradient, so that it ends with the same parameters and optimizer state as the others (under
//! ZeRO it must: it owns a shard of them); PyTorch's joined rank stops stepping and receives the
//! final model by broadcast. With plain SGD the final parameters are the same.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

use brigade_comm::{all_gather_bytes, Buffer, Communicator, ReduceOp};
use brigade_tensor::Tensor;

use crate::error::{CheckpointMismatch, Error, Result};
use crate::source::DataLength;

/// Tag of the per-step all-reduce in which the ranks agree on which of them still have data.
pub const JOIN_TAG: &str = "join: ranks with data";

/// Tag of the end-of-run exchange of the parameters' checksums.
pub const CHECKSUM_TAG: &str = "join: parameter checksums";

/// How a run treats ranks whose data ends at different steps ([`crate::config::DataConfig::join`];
/// `None` there: uneven data is refused before step 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JoinMode {
    /// A rank without data joins with zeros; the gradient is the sum over the ranks with data
    /// divided by the initial world size (PyTorch's default).
    DivideInitial,
    /// A rank without data joins with zeros; the gradient is the sum over the ranks with data
    /// divided by their number.
    DivideActive,
    /// Every rank stops, with one error naming the first rank whose data ended, at the first
    /// step at which some (not every) rank has no data.
    Throw,
}

impl JoinMode {
    /// Every mode.
    pub const ALL: [JoinMode; 3] = [JoinMode::DivideInitial, JoinMode::DivideActive, JoinMode::Throw];

    /// The mode's name (`divide-initial`, `divide-active`, `throw`), as checkpoints record it.
    pub fn name(self) -> &'static str {
        match self {
            JoinMode::DivideInitial => "divide-initial",
            JoinMode::DivideActive => "divide-active",
            JoinMode::Throw => "throw",
        }
    }
}

impl fmt::Display for JoinMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for JoinMode {
    type Err = String;

    /// A mode by its [`name`](JoinMode::name).
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| format!("unknown join mode '{s}' (divide-initial, divide-active, throw)"))
    }
}

/// The refusal of uneven data without a join mode, naming the shortest and the longest rank.
pub fn uneven_refusal(rows: &[usize]) -> Error {
    Error::UnevenInputs { rows: rows.to_vec() }
}

/// The ranks' agreement at the start of a step: which of them still have data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Agreement {
    /// The step.
    pub step: usize,
    /// Whether each rank has data for the step, by rank.
    pub active: Vec<bool>,
}

impl Agreement {
    /// How many ranks have data.
    pub fn active_count(&self) -> usize {
        self.active.iter().filter(|&&a| a).count()
    }

    /// Whether no rank has data (the run ends before this step).
    pub fn none_active(&self) -> bool {
        self.active_count() == 0
    }

    /// The lowest rank without data, if some rank has none.
    pub fn first_joined(&self) -> Option<usize> {
        self.active.iter().position(|&a| !a)
    }
}

/// One small all-reduce (a slot per rank, summed): which ranks have data for step `step`.
pub fn agree_on_data(comm: &dyn Communicator, step: usize, has_data: bool) -> Result<Agreement> {
    let (rank, world) = (comm.rank(), comm.world_size());
    if world == 1 {
        return Ok(Agreement {
            step,
            active: vec![has_data],
        });
    }
    let mut mine = vec![0.0f32; world];
    mine[rank] = if has_data { 1.0 } else { 0.0 };
    let all = comm.all_reduce_blocking(Buffer::F32(mine), ReduceOp::Sum, JOIN_TAG)?;
    match all.as_f32() {
        Some(v) if v.len() == world => Ok(Agreement {
            step,
            active: v.iter().map(|&x| x > 0.5).collect(),
        }),
        _ => Err(Error::Protocol(format!(
            "the join agreement all-reduce returned {all:?}, expected {world} f32"
        ))),
    }
}

/// A checksum of parameters (FNV-1a over every value's bits, names and shapes in order): equal
/// on two ranks exactly when they hold the same parameters.
pub fn param_checksum(params: &[(String, Tensor)]) -> Result<u64> {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    for (name, t) in params {
        eat(name.as_bytes());
        for d in t.shape() {
            eat(&(*d as u64).to_le_bytes());
        }
        for v in t.to_f64_vec()? {
            eat(&v.to_bits().to_le_bytes());
        }
    }
    Ok(h)
}

/// Compares this rank's parameter checksum with every other rank's (a collective over `comm`):
/// [`Error::ReplicasDiffer`] on every rank when any two differ.
pub fn check_replicas(comm: &dyn Communicator, params: &[(String, Tensor)]) -> Result<()> {
    let mine = param_checksum(params)?;
    if comm.world_size() == 1 {
        return Ok(());
    }
    let all = all_gather_bytes(comm, mine.to_le_bytes().to_vec(), CHECKSUM_TAG)?;
    let sums: Vec<u64> = all
        .iter()
        .map(|b| {
            b.as_slice()
                .try_into()
                .map(u64::from_le_bytes)
                .map_err(|_| Error::Protocol(format!("a parameter checksum of {} bytes, expected 8", b.len())))
        })
        .collect::<Result<_>>()?;
    if sums.windows(2).all(|w| w[0] == w[1]) {
        return Ok(());
    }
    Err(Error::ReplicasDiffer { checksums: sums })
}

/// What a checkpoint records of a join run: the mode, and for each rank the step at which it
/// joined (`-`: it has data still), e.g. `0:-,1:3`.
fn describe_joined(joined_at: &[Option<usize>]) -> String {
    joined_at
        .iter()
        .enumerate()
        .map(|(r, j)| match j {
            Some(s) => format!("{r}:{s}"),
            None => format!("{r}:-"),
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// For each rank, the step at which it joined if it did before step `step` (rank `r`'s data
/// holds `steps[r]` steps, so it joins at step `steps[r]`).
pub fn joined_before(steps: &[usize], step: usize) -> Vec<Option<usize>> {
    steps.iter().map(|&n| (n < step).then_some(n)).collect()
}

/// Metadata key of the join mode in a checkpoint (absent: no join mode).
const JOIN_KEY: &str = "join";

/// Metadata key of the ranks that had joined by a checkpoint's step ([`describe_joined`]).
const JOINED_KEY: &str = "join_joined";

/// One rank's view of a run under a [`JoinMode`]: how many steps each rank's data holds, which
/// ranks have joined, and the current step's [`Agreement`].
pub(crate) struct JoinRun {
    pub(crate) mode: JoinMode,
    /// Rows of each rank's data (empty for endless data).
    rows: Vec<usize>,
    /// Whole steps of each rank's data (`None`: endless).
    steps: Option<Vec<usize>>,
    /// For each rank, the step at which it joined (its first step without data).
    pub(crate) joined_at: Vec<Option<usize>>,
    /// The step at which no rank had data left (the run ended there).
    pub(crate) ended_at: Option<usize>,
    agreed: Option<Agreement>,
}

impl JoinRun {
    /// A run under `mode` over data of `lengths`, `rows_per_step` rows a step per rank, from
    /// step `first_step` (ranks whose data ended before it have joined).
    pub(crate) fn new(
        mode: JoinMode,
        lengths: &DataLength,
        rows_per_step: usize,
        world_size: usize,
        first_step: usize,
    ) -> JoinRun {
        // whole steps each rank's data holds (`None`: endless data, so no rank ever joins)
        let steps = lengths.batches(rows_per_step);
        let rows = match lengths {
            DataLength::PerEpoch(v) => v.clone(),
            DataLength::Endless => vec![],
        };
        let joined_at = match &steps {
            Some(v) => joined_before(v, first_step),
            None => vec![None; world_size],
        };
        JoinRun {
            mode,
            rows,
            steps,
            joined_at,
            ended_at: None,
            agreed: None,
        }
    }

    /// Whole steps rank `rank`'s data holds (`None`: endless).
    pub(crate) fn steps_of(&self, rank: usize) -> Option<usize> {
        self.steps.as_ref().map(|v| v[rank])
    }

    /// Whether rank `rank` has data for step `step`.
    pub(crate) fn has_data(&self, rank: usize, step: usize) -> bool {
        self.steps_of(rank).is_none_or(|n| step < n)
    }

    /// The ranks' agreement on step `step` (one all-reduce, made once a step): which ranks have
    /// data. Records the step at which each rank without data joined, and the step at which
    /// none had data left.
    /// An agreement reached beside another collective (the step status of the step before,
    /// [`JoinRun::next_slots`]) is used without a collective of its own.
    pub(crate) fn agree(&mut self, comm: &dyn Communicator, step: usize) -> Result<Agreement> {
        let a = match self.agreed.take().filter(|a| a.step == step) {
            Some(a) => a,
            None => agree_on_data(comm, step, self.has_data(comm.rank(), step))?,
        };
        self.record(&a);
        self.agreed = Some(a.clone());
        Ok(a)
    }

    /// Who joined and whether the data ended, once the run reaches `a`'s step: a rank joins
    /// when its data ends while others still train; when every rank's data has ended the run
    /// ends there, and no rank joins.
    fn record(&mut self, a: &Agreement) {
        if a.none_active() {
            self.ended_at.get_or_insert(a.step);
        } else {
            for (r, &active) in a.active.iter().enumerate() {
                if !active && self.joined_at.get(r).is_some_and(Option::is_none) {
                    self.joined_at[r] = Some(a.step);
                }
            }
        }
    }

    /// This rank's slots in step `step`'s status all-reduce (averaged): a slot per rank,
    /// non-zero at this rank's when it has data for step `step + 1`. So the next step's
    /// agreement travels with this step's status, and costs no collective of its own.
    pub(crate) fn next_slots(&self, rank: usize, world_size: usize, step: usize) -> Vec<f32> {
        let mut v = vec![0.0; world_size];
        v[rank] = if self.has_data(rank, step + 1) { 1.0 } else { 0.0 };
        v
    }

    /// The status all-reduce of step `step` came back with `slots` (the averaged
    /// [`JoinRun::next_slots`]): the agreement on step `step + 1`, recorded when the run gets
    /// there.
    pub(crate) fn agreed_next(&mut self, step: usize, slots: &[f32]) {
        self.agreed = Some(Agreement {
            step: step + 1,
            active: slots.iter().map(|&x| x > 0.0).collect(),
        });
    }

    /// Under [`JoinMode::Throw`], the error every rank stops with at `a`'s step when some (not
    /// every) rank has no data.
    pub(crate) fn throw(&self, a: &Agreement) -> Option<Error> {
        if self.mode != JoinMode::Throw || a.none_active() {
            return None;
        }
        let rank = a.first_joined()?;
        Some(Error::OutOfData {
            step: a.step,
            rank,
            rows: self.rows.get(rank).copied().unwrap_or(0),
            steps: self.steps_of(rank).unwrap_or(0),
        })
    }

    /// What a checkpoint of the state before step `next_step` records of the join (its
    /// metadata entries): the ranks that joined before that step (a periodic checkpoint is
    /// written during the step, after its agreement).
    pub(crate) fn metadata(&self, next_step: usize) -> Vec<(String, String)> {
        let before: Vec<Option<usize>> = self.joined_at.iter().map(|j| j.filter(|&s| s < next_step)).collect();
        vec![
            (JOIN_KEY.into(), self.mode.name().into()),
            (JOINED_KEY.into(), describe_joined(&before)),
        ]
    }
}

/// Checks what a checkpoint records of the join (`meta`) against this run (`join`): the same
/// mode, or none on both; and the same ranks joined by its step, at the same steps (data whose
/// lengths changed would put the ranks elsewhere).
pub(crate) fn check_resume(
    meta: &HashMap<String, String>,
    join: Option<&JoinRun>,
) -> std::result::Result<(), CheckpointMismatch> {
    let written = meta.get(JOIN_KEY).map(String::as_str).unwrap_or("none");
    let this_run = join.map_or("none", |j| j.mode.name());
    if written != this_run {
        return Err(CheckpointMismatch::Written {
            what: "join mode",
            written: written.into(),
            this_run: this_run.into(),
        });
    }
    if let (Some(written), Some(j)) = (meta.get(JOINED_KEY), join) {
        let this_run = describe_joined(&j.joined_at);
        if *written != this_run {
            return Err(CheckpointMismatch::Written {
                what: "ranks joined (rank:step)",
                written: written.clone(),
                this_run,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_read_back_by_name() {
        for m in JoinMode::ALL {
            assert_eq!(m.name().parse::<JoinMode>(), Ok(m));
        }
        assert!("divide".parse::<JoinMode>().unwrap_err().contains("divide-initial"));
    }

    #[test]
    fn the_refusal_names_the_shortest_and_the_longest_rank() {
        let e = uneven_refusal(&[40, 24, 48, 24]).to_string();
        assert!(
            e.contains("shortest: rank 1 with 24") && e.contains("longest: rank 2 with 48"),
            "{e}"
        );
    }

    #[test]
    fn a_checkpoint_records_the_ranks_that_joined_before_its_step() {
        // rank 1's data holds 3 steps: it joins at step 3. A periodic checkpoint written during
        // step 3 (after its agreement) holds the state before it: a resume at step 3 finds
        // rank 1 not yet joined, and so must the checkpoint
        let lengths = DataLength::PerEpoch(vec![40, 24]);
        let mut run = JoinRun::new(JoinMode::DivideInitial, &lengths, 8, 2, 0);
        run.agreed_next(2, &[0.5, 0.0]);
        let comm = brigade_comm::ThreadGroup::new(1).into_iter().next().unwrap();
        let a = run.agree(&comm, 3).unwrap();
        assert_eq!(a.active, [true, false]);
        assert_eq!(run.joined_at, [None, Some(3)]);
        let meta: HashMap<String, String> = run.metadata(3).into_iter().collect();
        let resumed = JoinRun::new(JoinMode::DivideInitial, &lengths, 8, 2, 3);
        assert_eq!(check_resume(&meta, Some(&resumed)), Ok(()));
        let meta: HashMap<String, String> = run.metadata(4).into_iter().collect();
        assert_eq!(meta[JOINED_KEY], "0:-,1:3");
        let resumed = JoinRun::new(JoinMode::DivideInitial, &lengths, 8, 2, 4);
        assert_eq!(check_resume(&meta, Some(&resumed)), Ok(()));
    }

    #[test]
    fn checksums_differ_on_one_bit() {
        let a = vec![("w".to_string(), Tensor::from_vec(vec![1.0f32, 2.0], &[2]).unwrap())];
        let b = vec![(
            "w".to_string(),
            Tensor::from_vec(vec![1.0f32, f32::from_bits(2.0f32.to_bits() + 1)], &[2]).unwrap(),
        )];
        assert_ne!(param_checksum(&a).unwrap(), param_checksum(&b).unwrap());
        assert_eq!(param_checksum(&a).unwrap(), param_checksum(&a.clone()).unwrap());
    }
}
