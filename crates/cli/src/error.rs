//! The command line's error type: a flag misused, a file, a chart, the outputs of a finished
//! run, an interruption, or the library's error, worded here in the command line's terms (the
//! library names its settings; the user typed flags). `main` prints one line and exits with
//! [`Error::exit_code`].

use brigade::error::CheckpointMismatch;

/// Everything a `brigade` subcommand can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Flags that cannot work together or values out of range.
    #[error("{0}")]
    Usage(String),
    /// Reading or writing a file.
    #[error("{path}: {source}")]
    Io {
        /// The file (with the flag that named it, when there is one).
        path: String,
        /// What the operating system said.
        source: std::io::Error,
    },
    /// Encoding or decoding JSON.
    #[error("{what}: {source}")]
    Json {
        /// What was being encoded or decoded.
        what: String,
        /// What serde said.
        source: serde_json::Error,
    },
    /// Rendering a chart.
    #[error("chart {path}: {msg}")]
    Chart {
        /// The chart file.
        path: String,
        /// What the renderer said.
        msg: String,
    },
    /// Outputs of a finished run that could not be written (each: flag, path, cause); the
    /// others were written.
    #[error("{} of the outputs could not be written (the others were): {}", .0.len(), .0.join("; "))]
    Outputs(Vec<String>),
    /// SIGINT or SIGTERM stopped the run after a step (exit status 130).
    #[error("interrupted after step {step} of {steps}: the outputs hold every finished step")]
    Interrupted {
        /// The last step run.
        step: usize,
        /// The step the run was to train until.
        steps: usize,
    },
    /// SIGINT or SIGTERM stopped a sweep (exit status 130): `--out` holds the `runs` runs of
    /// the `of` asked for that finished, written before this error (none: nothing written).
    #[error("{}", match .runs {
        0 => "interrupted before a run of the sweep finished: nothing was written to --out".to_string(),
        n => format!("interrupted after {n} of {} runs: --out holds the runs that finished", .of),
    })]
    SweepInterrupted {
        /// Runs that finished (each cap's, every round).
        runs: usize,
        /// Runs the sweep was to make.
        of: usize,
    },
    /// SIGINT or SIGTERM stopped a study (exit status 130): `--out` holds the `policies` of the
    /// `of` asked for that finished, written before this error (none: nothing written).
    #[error("{}", match .policies {
        0 => "interrupted before a policy of the study finished: nothing was written to --out".to_string(),
        n => format!("interrupted after {n} of {} policies: --out holds the policies that finished", .of),
    })]
    StudyInterrupted {
        /// Policies whose run finished.
        policies: usize,
        /// Policies the study was to run.
        of: usize,
    },
    /// A study's policy failed while it trained: the study stopped there, and `--out` holds the
    /// `finished` policies of the `of` asked for that finished before it, written before this
    /// error (none: nothing written); the `not_run` policies after it did not run.
    #[error("--policy {policy} failed, so the study stopped: {}; {}{}", in_flag_terms(.source), match .finished {
        0 => "no policy finished before it: nothing was written to --out".to_string(),
        n => format!("--out holds the {n} of {} policies that finished before it", .of),
    }, match .not_run.len() {
        0 => String::new(),
        _ => format!("; not run: {}", .not_run.join(", ")),
    })]
    StudyPolicyFailed {
        /// The policy's spec.
        policy: String,
        /// Why it failed (the library's error).
        source: Box<brigade::Error>,
        /// Policies whose run finished before it.
        finished: usize,
        /// Policies the study was to run.
        of: usize,
        /// The specs of the policies after it, which did not run.
        not_run: Vec<String>,
    },
    /// The library's error (launching, training, checkpoints, models, collectives).
    #[error("{}", in_flag_terms(.0))]
    Run(#[from] brigade::Error),
}

impl Error {
    /// The process exit status for this error: 130 for an interrupted run (as shells report
    /// SIGINT), 1 otherwise.
    pub fn exit_code(&self) -> u8 {
        match self {
            Error::Interrupted { .. } | Error::SweepInterrupted { .. } | Error::StudyInterrupted { .. } => 130,
            _ => 1,
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

macro_rules! through_the_library {
    ($($t:ty),*) => {$(
        impl From<$t> for Error {
            fn from(e: $t) -> Self {
                Error::Run(e.into())
            }
        }
    )*};
}

through_the_library!(
    brigade::models::ModelError,
    brigade::tensor::TensorError,
    brigade::comm::CommError,
    brigade::ddp::DdpError,
    brigade::autograd::AutogradError
);

/// A diverged run's error (the library's [`brigade::Error::NonFinite`]) as one line that
/// advises `lower`; `None` for any other error.
fn diverged_line(e: &brigade::Error, lower: &str) -> Option<String> {
    let brigade::Error::NonFinite { step, what, value } = e else {
        return None;
    };
    Some(format!(
        "step {step}: {what} is {value}: the run diverged. Nothing was written from the diverged state (a \
         checkpoint written before it is kept); {lower}, or pass --allow-nonfinite to train on"
    ))
}

/// What to lower when a run under `policy` diverges: `--lr`, and the policy's outer lr when it
/// steps an outer optimizer of its own (DiLoCo's, a streaming DiLoCo's).
pub fn lower_lr_advice(policy: &brigade::policies::PolicySpec) -> String {
    match policy.outer_lr_form() {
        Some(form) => format!("lower --lr or the policy's outer lr ({form})"),
        None => "lower --lr".into(),
    }
}

/// The library's error `e` from a run under `policy`: a divergence advises what to lower for
/// that policy ([`lower_lr_advice`]); any other error as [`Error::Run`].
pub fn under_policy(e: brigade::Error, policy: &brigade::policies::PolicySpec) -> Error {
    match diverged_line(&e, &lower_lr_advice(policy)) {
        Some(line) => Error::Usage(line),
        None => Error::Run(e),
    }
}

/// Result alias for the command line.
pub type Result<T> = std::result::Result<T, Error>;

/// The library's error as one line naming the flags that control what it names.
pub fn in_flag_terms(e: &brigade::Error) -> String {
    use brigade::Error as E;
    match e {
        E::NonFinite { .. } => diverged_line(e, "lower --lr").unwrap_or_default(),
        E::MpiNotBuilt => "--backend mpi needs a build with MPI support: install OpenMPI (apt-get install \
                           openmpi-bin libopenmpi-dev libclang-dev) and build with `cargo build --release --features mpi`"
            .into(),
        E::CheckpointClash(c) => c.describe(flag_of_field(c.field), flag_of_field(&c.other)),
        E::NotAPlaceholder { field, path, token } => format!(
            "{} {path}: {token} is not a placeholder; the one placeholder there is {{step}} (each checkpoint's step: run-{{step}}.ckpt)",
            flag_of_field(field)
        ),
        E::Checkpoint { path, mismatch } => format!("checkpoint {path}: {}", mismatch_in_flag_terms(mismatch)),
        E::OnRank { rank, world, source } => format!("rank {rank} of {world}: {}", in_flag_terms(source)),
        E::StudyPolicyRefused { policy, source } => format!(
            "--policy {policy} cannot run in this study (each policy is built before any trains, so none did): {}",
            in_flag_terms(source)
        ),
        E::StudyPolicyFailed { policy, finished, source } => format!(
            "--policy {policy} failed, so the study stopped ({finished} policies finished before it): {}",
            in_flag_terms(source)
        ),
        E::UnevenInputs { rows } => {
            let (short, long) = e.shortest_and_longest().unwrap_or_default();
            format!(
                "the ranks' data differ in length (shortest: rank {short} with {} rows, longest: rank {long} with {}): pass --join divide-initial, divide-active or throw to train on uneven data, or give every rank as many rows",
                rows[short], rows[long]
            )
        }
        E::NoStep { rows, rows_per_step } => format!(
            "every rank's file is shorter than one step of {rows_per_step} rows (--batch-size x --accum; rows by rank: {}): no step can run; give longer files or a smaller --batch-size",
            rows.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
        ),
        E::OutOfData { step, rank, rows, steps } => format!(
            "step {step}: rank {rank}'s data ended ({rows} rows: {steps} steps) while other ranks still have data; --join throw stops every rank here (--join divide-initial or divide-active trains on)"
        ),
        e => crate::argv::in_flag_terms(&e.to_string()),
    }
}

/// The flag that sets the library's configuration field `field` (a name of this program's own,
/// a flag already, as it is).
fn flag_of_field(field: &str) -> &str {
    crate::argv::FIELD_FLAGS
        .iter()
        .find(|(f, _)| *f == field)
        .map_or(field, |(_, flag)| flag)
}

fn mismatch_in_flag_terms(m: &CheckpointMismatch) -> String {
    use CheckpointMismatch as M;
    match m {
        M::NotACheckpoint => "not a brigade checkpoint (written by --checkpoint)".into(),
        M::Seed { written, this_run } => format!(
            "it was written with --seed {written}, this run has --seed {this_run}: resume with what it was written with"
        ),
        M::Sharding { written_stage, stage } => format!(
            "it was written with --zero {written_stage}, this run has --zero {stage}: a checkpoint resumes under \
             the --zero it was written with (on any number of ranks)"
        ),
        M::RowsPerStep {
            written,
            written_world,
            this_run,
            world,
        } => format!(
            "it was written at {written} rows a step per rank (--batch-size x --accum) on {written_world} ranks, this \
             run reads {this_run} on {world}: data read in order would continue at another row; resume with \
             --world-size x --batch-size x --accum = {} (under --join: {written_world} ranks at {written} rows each)",
            written_world * written
        ),
        M::NonFinite { tensor, index, value } => format!(
            "tensor '{tensor}' holds {value} at index {index}: a run under --allow-nonfinite wrote it; \
             resume with --allow-nonfinite to continue it"
        ),
        M::PastTheEnd { step, steps } => format!("it is at step {step}, past --steps {steps}"),
        M::Written {
            what: "data order",
            written,
            this_run,
        } => format!(
            "it was written with data order '{written}', this run has '{this_run}': resume with the --shuffle, --drop-last and --seed it was written with"
        ),
        m => m.to_string(),
    }
}

/// A checkpoint rank 0 could not write, as one entry of [`Error::Outputs`].
pub fn checkpoint_failure(f: &brigade::outcome::CheckpointFailure) -> String {
    let e = in_flag_terms(&f.error);
    if f.periodic {
        format!("--checkpoint (training stopped after the next step): {e}")
    } else {
        format!("--checkpoint: {e}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn library_errors_name_the_flags_that_control_them() {
        let diverged = brigade::Error::NonFinite {
            step: 3,
            what: "the loss".into(),
            value: f64::NAN,
        };
        let line = Error::Run(diverged.on_rank(0, 1)).to_string();
        assert!(line.contains("--allow-nonfinite") && line.contains("--lr"), "{line}");
        let zero = brigade::Error::Checkpoint {
            path: "c.ckpt".into(),
            mismatch: CheckpointMismatch::Sharding {
                written_stage: 1,
                stage: 2,
            },
        };
        let on_rank = brigade::Error::OnRank {
            rank: 1,
            world: 2,
            source: Box::new(zero),
        };
        let line = Error::from(on_rank).to_string();
        assert!(
            line.starts_with("rank 1 of 2: checkpoint c.ckpt: ") && line.contains("--zero 1, this run has --zero 2"),
            "{line}"
        );
    }
    #[test]
    fn a_study_stopped_by_a_failed_policy_names_the_policies_that_did_not_run() {
        let failed = |not_run: &[&str]| {
            Error::StudyPolicyFailed {
                policy: "int8".into(),
                source: Box::new(brigade::Error::Launch("rank 1 is gone".into())),
                finished: 1,
                of: 2 + not_run.len(),
                not_run: not_run.iter().map(|p| p.to_string()).collect(),
            }
            .to_string()
        };
        let line = failed(&["topk:0.01", "fp16"]);
        assert!(
            line.starts_with("--policy int8 failed, so the study stopped: rank 1 is gone; ")
                && line.contains("the 1 of 4 policies that finished before it")
                && line.ends_with("; not run: topk:0.01, fp16"),
            "{line}"
        );
        assert!(!failed(&[]).contains("not run"), "the last policy leaves none unrun");
    }
}
