//! The library's error type ([`Error`], `brigade::Error`): what launching ranks, training and
//! checkpoints can fail with, typed per cause, in the library's own terms (a program over it
//! words them for its users: the `brigade` binary names its flags).

use std::path::PathBuf;

use brigade_autograd::AutogradError;
use brigade_comm::CommError;
use brigade_ddp::DdpError;
use brigade_models::ModelError;
use brigade_policies::PolicyError;
use brigade_tensor::TensorError;

/// Everything the `brigade` library can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A configuration that cannot work: a value out of range, settings that do not go
    /// together, a device or library this machine cannot serve.
    #[error("{0}")]
    Config(String),
    /// A data source could not serve a batch (the source's own words).
    #[error("{0}")]
    Data(String),
    /// Reading or writing a file.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// What the operating system said.
        source: std::io::Error,
    },
    /// Encoding or decoding JSON (a step profile, a timeline exchanged between ranks).
    #[error("{what}: {source}")]
    Json {
        /// What was being encoded or decoded.
        what: String,
        /// What serde said.
        source: serde_json::Error,
    },
    /// Starting the ranks failed: a rank's setup, or a launch that ran no rank here.
    #[error("{0}")]
    Launch(String),
    /// The MPI backend was asked for in a build without the `mpi` feature.
    #[error(
        "the MPI backend needs a build with MPI support: install OpenMPI (apt-get install openmpi-bin \
         libopenmpi-dev libclang-dev) and build with the `mpi` feature"
    )]
    MpiNotBuilt,
    /// A plan that cannot be made from its profiles (the `plan` module).
    #[error("{0}")]
    Plan(String),
    /// A peer's control message was not what this rank expected.
    #[error("{0}")]
    Protocol(String),
    /// A model, layer, dataset or safetensors file failed (`brigade::models`).
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The DDP reducer or a reducer policy failed (`brigade::ddp`).
    #[error(transparent)]
    Ddp(#[from] DdpError),
    /// A policy spec, setting or registry lookup failed (`brigade::policies`).
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// A collective failed or timed out, or a peer is gone (`brigade::comm`).
    #[error(transparent)]
    Comm(#[from] CommError),
    /// Backward or an optimizer failed (`brigade::autograd`).
    #[error(transparent)]
    Autograd(#[from] AutogradError),
    /// A tensor op failed: shapes, dtypes, devices (`brigade::tensor`).
    #[error(transparent)]
    Tensor(#[from] TensorError),
    /// A checkpoint that does not fit this run.
    #[error("checkpoint {path}: {mismatch}")]
    Checkpoint {
        /// The checkpoint file.
        path: String,
        /// What does not fit.
        mismatch: CheckpointMismatch,
    },
    /// A checkpoint the run may write would land on another file of the run (found before step
    /// 0 by `CheckpointConfig::check_files`).
    #[error("{}", .0.describe(.0.field, &.0.other))]
    CheckpointClash(Box<FileClash>),
    /// A path that takes `{step}` holds another `{...}` token (`{STEP}`, `{rank}`): typed as a
    /// placeholder, it would stay in the file name as it is (found before step 0).
    #[error(
        "{field} '{path}': {token} is not a placeholder; the one placeholder there is {{step}} (the checkpoint's step)"
    )]
    NotAPlaceholder {
        /// The configuration field of the path (`checkpoint_files::PATH_FIELD`).
        field: &'static str,
        /// The path, as given.
        path: String,
        /// The token, braces included.
        token: String,
    },
    /// One rank's failure (the root cause among the ranks' errors).
    #[error("rank {rank} of {world}: {source}")]
    OnRank {
        /// The rank that failed.
        rank: usize,
        /// The number of ranks.
        world: usize,
        /// That rank's own error.
        source: Box<Error>,
    },
    /// A study's policy that cannot run on the study's model and ranks (its construction
    /// failed): found by building every policy before the first trains, so nothing trained.
    #[error(
        "policy {policy} cannot run in this study (each policy is built before any trains, so none did): {source}"
    )]
    StudyPolicyRefused {
        /// The policy's spec.
        policy: String,
        /// Why its construction failed.
        source: Box<Error>,
    },
    /// A study's policy failed while it trained: the study stopped there (the studies of the
    /// `finished` policies before it are [`crate::study::Studied::policies`]); the policies after
    /// it did not run.
    #[error("policy {policy} failed, so the study stopped ({finished} policies finished before it): {source}")]
    StudyPolicyFailed {
        /// The policy's spec.
        policy: String,
        /// How many policies finished before it.
        finished: usize,
        /// Why it failed.
        source: Box<Error>,
    },
    /// A loss or parameter stopped being finite: the run diverged (every rank stops at the same
    /// step, before that step's update).
    #[error(
        "step {step}: {what} is {value}: the run diverged. The last good checkpoint was kept and \
         no diverged parameters were saved; lower the learning rate, or allow non-finite values \
         (RecipeConfig::allow_nonfinite) to train on"
    )]
    NonFinite {
        /// The step whose loss (or update) was not finite.
        step: usize,
        /// What was not finite (the loss, or which parameter).
        what: String,
        /// The value found (NaN or an infinity).
        value: f64,
    },
    /// The ranks read different numbers of rows (`rows`, by rank) and the run has no join mode
    /// (every rank finds it before step 0, from the lengths every rank knows).
    #[error(
        "the ranks read different numbers of rows (shortest: rank {} with {}, longest: rank {} with {}): uneven inputs need a join mode (DataConfig::join: divide-initial, divide-active or throw), or give every rank as many rows",
        shortest(rows), rows[shortest(rows)], longest(rows), rows[longest(rows)]
    )]
    UnevenInputs {
        /// Rows of each rank, by rank.
        rows: Vec<usize>,
    },
    /// Under a join mode, every rank's data (`rows`, by rank) holds fewer rows than one step
    /// reads (`rows_per_step`: batch size times accumulation): no step could run (every rank
    /// finds it before step 0).
    #[error(
        "every rank's data is shorter than one step of {rows_per_step} rows (batch size x accumulation; rows by rank: {rows:?}): no step can run"
    )]
    NoStep {
        /// Rows of each rank, by rank.
        rows: Vec<usize>,
        /// Rows one step reads on a rank.
        rows_per_step: usize,
    },
    /// Under join mode `throw` (uneven inputs): at step `step` rank `rank`'s data had ended
    /// while other ranks still had data, and every rank stopped there together.
    #[error(
        "step {step}: rank {rank}'s data ended ({rows} rows: {steps} steps) while other ranks still have data; join mode throw stops every rank here (divide-initial or divide-active train on with the ranks that have data)"
    )]
    OutOfData {
        /// The first step that rank had no data for.
        step: usize,
        /// The lowest rank without data at that step.
        rank: usize,
        /// Its rows.
        rows: usize,
        /// The whole steps those rows hold.
        steps: usize,
    },
    /// After a join run the ranks' parameters differ (their checksums, by rank): the replicas
    /// fell out of step, which must not happen.
    #[error(
        "after training the ranks hold different parameters (checksums by rank: {}): the replicas fell out of step; the outputs were written from rank 0's",
        checksums.iter().enumerate().map(|(r, c)| format!("{r}: {c:016x}")).collect::<Vec<_>>().join(", ")
    )]
    ReplicasDiffer {
        /// Each rank's parameter checksum, by rank.
        checksums: Vec<u64>,
    },
}

/// A checkpoint path that may land on another file of the run: which, and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileClash {
    /// The configuration field of the checkpoint path
    /// (`checkpoint_files::PATH_FIELD`).
    pub field: &'static str,
    /// The checkpoint path, as given.
    pub path: String,
    /// The other file's name (`RunFile::name`).
    pub other: String,
    /// The other file's path, as given.
    pub other_path: String,
    /// Whose file it is, when its name stands for several (`rank 1's`).
    pub whose: Option<String>,
    /// Whether the run writes the other file (else it reads it).
    pub other_written: bool,
    /// How the checkpoint would land on it.
    pub clash: Clash,
}

/// How a checkpoint would land on another file of the run ([`Error::CheckpointClash`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Clash {
    /// A checkpoint would be written in the other file's place: at this step (`None`: the path
    /// holds no `{step}`), through the symbolic link `via` when one stands at that name.
    Lands {
        /// The step (its digits) of the checkpoint, for a `{step}` path.
        step: Option<String>,
        /// The link at the checkpoint's name that points at the file.
        via: Option<PathBuf>,
    },
    /// The other file is a pattern of files to read that matches names of the checkpoints (a
    /// later run would read the checkpoints among its data).
    PatternReads,
    /// What stands at a checkpoint's name is not a file (a folder, a pipe, a device): the
    /// checkpoint could not be written in its place.
    NotAFile {
        /// The step (its digits) of the checkpoint, for a `{step}` path.
        step: Option<String>,
        /// What it is.
        what: &'static str,
    },
}

impl FileClash {
    /// The one line that says so, naming the checkpoint path `field` and the other file
    /// `other` (a program over the library passes its own names for them: its flags).
    pub fn describe(&self, field: &str, other: &str) -> String {
        let (path, other_path) = (&self.path, &self.other_path);
        let whose = self.whose.as_ref().map(|w| format!(" ({w})")).unwrap_or_default();
        let (step, via) = match &self.clash {
            Clash::Lands { step, via } => (step.as_deref(), via.as_deref()),
            Clash::PatternReads | Clash::NotAFile { .. } => (None, None),
        };
        let via = via
            .map(|l| format!(" through the link {}", l.display()))
            .unwrap_or_default();
        match (&self.clash, self.other_written, step) {
            (Clash::NotAFile { step, what }, ..) => format!(
                "{field} {path} names {other_path}{}, which is {what}: a checkpoint is written as a file in its \
                 place; move it or give another path",
                step.as_ref()
                    .map(|s| format!(" (its checkpoint of step {s})"))
                    .unwrap_or_default()
            ),
            (Clash::PatternReads, ..) => format!(
                "{field} {path} names files that the {other} pattern {other_path} reads (a run would read the \
                 checkpoints as its data): give it its own path"
            ),
            (_, false, step) => format!(
                "{field} {path} would write over the {other} file {other_path}{whose}{}{via}: give it its own path",
                step.map(|s| format!(" with its checkpoint of step {s}"))
                    .unwrap_or_default()
            ),
            (_, true, Some(s)) => format!(
                "{field} {path} would write its checkpoint of step {s} over {other} {other_path}{via}: give each \
                 output its own path"
            ),
            (_, true, None) => {
                format!("{field} {path} and {other} {other_path} are the same file{via}: give each output its own path")
            }
        }
    }
}

/// How a checkpoint does not fit the run that tries to resume from it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CheckpointMismatch {
    /// The file is not a Brigade checkpoint.
    #[error("not a brigade checkpoint")]
    NotACheckpoint,
    /// It records no step to continue from.
    #[error("no step recorded")]
    NoStep,
    /// A sampled run's checkpoint without the sampler's position (epoch and row).
    #[error("it records the data order but not the sampler's position (epoch and row)")]
    NoSamplerPosition,
    /// Written for another model or optimizer (`what`: `model`, `optimizer`).
    #[error("it was written for {what} '{written}', this run uses '{this_run}'")]
    Written {
        /// What differs.
        what: &'static str,
        /// What the checkpoint records.
        written: String,
        /// What this run has.
        this_run: String,
    },
    /// A sampled run's checkpoint resumed on another number of ranks: its position in the
    /// data is per rank.
    #[error("it was written at world size {written} and this run uses {this_run}: a sampled (shuffled) run's position in its data is per rank, so it resumes on as many ranks only")]
    SampledWorldSize {
        /// The world size it was written at (as recorded).
        written: String,
        /// This run's.
        this_run: usize,
    },
    /// Written with another seed (which chooses the built-in data).
    #[error("it was written with seed {written}, this run has seed {this_run}: resume with what it was written with")]
    Seed {
        /// The checkpoint's seed.
        written: String,
        /// This run's seed.
        this_run: u64,
    },
    /// Written on other data (the data sources' fingerprints differ).
    #[error("it was written with data {written}, this run has data {this_run}: resume with what it was written with")]
    Data {
        /// The checkpoint's data fingerprint.
        written: String,
        /// This run's.
        this_run: String,
    },
    /// Written under another ZeRO stage.
    #[error(
        "it was written with ZeRO stage {written_stage}, this run has ZeRO stage {stage}: a checkpoint resumes \
         under the ZeRO stage it was written with (on any number of ranks)"
    )]
    Sharding {
        /// The checkpoint's stage (0: no ZeRO).
        written_stage: u8,
        /// This run's stage.
        stage: u8,
    },
    /// Written under another learning-rate schedule (kind, warmup, `T`, floor or factor).
    #[error("it was written with schedule '{written}', this run has '{this_run}': resume with the schedule it was written with (a resume may change the learning rate, not the schedule)")]
    Schedule {
        /// The checkpoint's schedule.
        written: String,
        /// This run's.
        this_run: String,
    },
    /// It holds per-rank policy state written by another number of ranks.
    #[error(
        "it holds policy '{policy}' state of {} ranks, this run has {world}: resume on as many ranks as wrote it",
        written_world.map(|w| w.to_string()).unwrap_or_else(|| "an unrecorded number of".into())
    )]
    PolicyWorld {
        /// The policy the checkpoint records.
        policy: String,
        /// The checkpoint's world size (absent in older checkpoints).
        written_world: Option<usize>,
        /// This run's world size.
        world: usize,
    },
    /// It holds every rank's own parameters and optimizer state (a policy whose ranks diverge
    /// between syncs wrote it), of another number of ranks than this run's.
    #[error(
        "it holds each of its {} ranks' own parameters and optimizer state (policy '{policy}' lets its ranks \
         diverge between syncs), and this run has {world}: resume on as many ranks as wrote it",
        written_world.map(|w| w.to_string()).unwrap_or_else(|| "(unrecorded)".into())
    )]
    DivergedWorld {
        /// The policy the checkpoint records.
        policy: String,
        /// The checkpoint's world size (absent in older checkpoints).
        written_world: Option<usize>,
        /// This run's world size.
        world: usize,
    },
    /// Its ranks' own parameters and optimizer state do not fit this run (DDP's words).
    #[error("its ranks' own parameters and optimizer state do not fit: {0}")]
    RankState(String),
    /// Its record of the buckets' grouping cannot be read or does not fit the model.
    #[error("its bucket grouping does not fit: {0}")]
    BucketGrouping(String),
    /// It holds the dropout generators of another number of ranks, at different states (the
    /// ranks drew different masks): only as many ranks can continue them.
    #[error(
        "it holds the dropout generators of {written_world} ranks, at different states, and this run has {world}: \
         resume on {written_world} ranks, so that each continues its own masks"
    )]
    DropoutRngWorld {
        /// How many ranks wrote their generator.
        written_world: usize,
        /// This run's world size.
        world: usize,
    },
    /// Its dropout generators cannot be read, or this run's model cannot take them.
    #[error("its dropout generator state does not fit: {0}")]
    DropoutRng(String),
    /// Its policy state does not fit this run's policy (the policy's own words).
    #[error("its policy state does not fit: {0}")]
    PolicyState(String),
    /// It was written by a run that read another number of rows a step (over all ranks; under
    /// a join mode, per rank on as many ranks), and this run's data position follows from the
    /// step (in order, or under a join mode).
    #[error(
        "it was written at {written} rows a step per rank (batch size x accum) on {written_world} ranks, this run \
         reads {this_run} on {world}: the data would continue at another row; resume with ranks x batch size x accum \
         = {written_world} x {written} (under a join mode, on {written_world} ranks at {written} rows each)"
    )]
    RowsPerStep {
        /// The checkpoint's rows a step per rank.
        written: usize,
        /// The checkpoint's ranks.
        written_world: usize,
        /// This run's rows a step per rank.
        this_run: usize,
        /// This run's ranks.
        world: usize,
    },
    /// It holds a NaN or an infinity (a run that trains on through them wrote it), and this run
    /// does not take them (`RecipeConfig::allow_nonfinite`).
    #[error(
        "tensor '{tensor}' holds {value} at index {index}: a run that trains on through non-finite values \
         (allow_nonfinite) wrote it; resume with allow_nonfinite to continue it"
    )]
    NonFinite {
        /// The tensor's name in the file.
        tensor: String,
        /// The first non-finite element's multi-index.
        index: String,
        /// That element (NaN, inf or -inf).
        value: String,
    },
    /// It is at a step past the run's last.
    #[error("it is at step {step}, past the run's end (step {steps})")]
    PastTheEnd {
        /// The checkpoint's step.
        step: usize,
        /// The step this run trains until.
        steps: usize,
    },
}

impl Error {
    /// The checkpoint at `path` does not fit this run (or is not a checkpoint), for `mismatch`.
    pub(crate) fn checkpoint(path: &std::path::Path, mismatch: CheckpointMismatch) -> Self {
        Error::Checkpoint {
            path: path.display().to_string(),
            mismatch,
        }
    }

    /// Whether every rank reaches this error together (so it names no rank and needs no abort).
    pub fn is_agreed(&self) -> bool {
        matches!(
            self,
            Error::NonFinite { .. }
                | Error::UnevenInputs { .. }
                | Error::NoStep { .. }
                | Error::OutOfData { .. }
                | Error::ReplicasDiffer { .. }
        )
    }

    /// This error as rank `rank`'s of `world` (unchanged when it is agreed or the world is one rank).
    pub fn on_rank(self, rank: usize, world: usize) -> Error {
        if world == 1 || self.is_agreed() {
            return self;
        }
        Error::OnRank {
            rank,
            world,
            source: Box::new(self),
        }
    }

    /// A JSON failure while handling `what`.
    pub fn json(what: impl Into<String>, source: serde_json::Error) -> Error {
        Error::Json {
            what: what.into(),
            source,
        }
    }
}

/// Result alias for the library.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// Of [`Error::UnevenInputs`], the rank with the fewest rows and the one with the most
    /// (the lowest such ranks); `None` for any other error.
    pub fn shortest_and_longest(&self) -> Option<(usize, usize)> {
        match self {
            Error::UnevenInputs { rows } => Some((shortest(rows), longest(rows))),
            _ => None,
        }
    }
}

/// The rank with the fewest rows (the lowest such rank); 0 when there is none.
fn shortest(rows: &[usize]) -> usize {
    (0..rows.len()).min_by_key(|&r| (rows[r], r)).unwrap_or(0)
}

/// The rank with the most rows (the lowest such rank); 0 when there is none.
fn longest(rows: &[usize]) -> usize {
    (0..rows.len()).max_by_key(|&r| (rows[r], usize::MAX - r)).unwrap_or(0)
}
