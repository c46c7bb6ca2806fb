//! One training run on N ranks: the loop every rank executes, and the plumbing that
//! starts the ranks, collects their results and picks the error to show.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use brigade_autograd::{AdamW, Optimizer, Sgd};
use brigade_comm::{
    launch_with_timeout, Buffer, CommError, Communicator, NetModel, Recorder, ReduceOp, SimulatedNetwork, Traced,
};
use brigade_ddp::{BucketInfo, DdpConfig, DistributedDataParallel, MemoryReport};
use brigade_models::{
    load_params, load_params_from_tensors, load_safetensors_with_metadata, save_safetensors, Dataset, Model, ModelKind,
};
use brigade_tensor::{set_compute_threads, Tensor};
use indicatif::{ProgressBar, ProgressStyle};

use crate::args::{OptimizerName, RunArgs};
use crate::error::{CliError, Result};

/// What a run does besides training.
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    /// Reduce gradients (DDP). Off: the same ranks train independently, with no
    /// communication at all (the sweep's compute-only baseline).
    pub compute_only: bool,
    /// Record compute and comm events for a timeline.
    pub record: bool,
    /// Draw a progress bar on rank 0.
    pub progress: bool,
    /// Resume from this checkpoint.
    pub resume: Option<PathBuf>,
    /// Write a checkpoint (parameters + optimizer state) here, from rank 0.
    pub checkpoint: Option<PathBuf>,
    /// Also checkpoint every this many steps.
    pub checkpoint_every: Option<usize>,
}

/// What a run produced, as seen from rank 0 (losses are global means over ranks).
pub struct RunReport {
    /// World size.
    pub world_size: usize,
    /// First step run (non-zero after a resume).
    pub first_step: usize,
    /// Global mean loss of each step run, before its update.
    pub losses: Vec<f64>,
    /// Rank 0's wall time of each step run, in milliseconds.
    pub step_ms: Vec<f64>,
    /// DDP buckets after the last step (empty when compute-only).
    pub buckets: Vec<BucketInfo>,
    /// Rank 0's gradient memory (absent when compute-only).
    pub memory: Option<MemoryReport>,
    /// The recorded events, when recording.
    pub recorder: Option<Recorder>,
    /// The last step's events of every rank, when they were gathered from other processes
    /// (MPI); `None` means: take them from `recorder`.
    pub last_step_events: Option<Vec<brigade_comm::Event>>,
    /// Rank 0's final parameters.
    pub params: Vec<(String, Tensor)>,
}

/// What one rank returns.
pub struct RankOut {
    first_step: usize,
    local_losses: Vec<f64>,
    global_losses: Vec<f64>,
    step_ms: Vec<f64>,
    buckets: Vec<BucketInfo>,
    memory: Option<MemoryReport>,
    params: Vec<(String, Tensor)>,
}

/// Loads the dataset the flags name and checks it can feed one global step.
pub fn load_data(args: &RunArgs, kind: &ModelKind) -> Result<Dataset> {
    let data = match (&args.data, kind) {
        (Some(path), _) => Dataset::from_safetensors(path, kind)?,
        (None, ModelKind::Mlp(c)) => Dataset::teacher(8192, c.in_dim(), c.n_classes(), args.seed)?,
        (None, ModelKind::Gpt(c)) => Dataset::builtin_text(c.context, args.seed)?,
    };
    let global = args.world_size * args.rows_per_rank();
    if data.len() < global {
        return Err(CliError::Usage(format!(
            "one step needs {global} rows (world size {} x accum {} x batch size {}) but {} has {} rows",
            args.world_size,
            args.accum,
            args.batch_size,
            data.name(),
            data.len()
        )));
    }
    Ok(data)
}

fn make_optimizer(args: &RunArgs, model: &dyn Model) -> Box<dyn Optimizer> {
    let params = model.params().params().to_vec();
    match args.optimizer {
        OptimizerName::Sgd => Box::new(Sgd::new(params, args.lr, args.momentum(), args.weight_decay())),
        OptimizerName::Adamw => Box::new(AdamW::with_options(
            params,
            args.lr,
            (0.9, 0.999),
            1e-8,
            args.weight_decay(),
        )),
    }
}

const CHECKPOINT_FORMAT: &str = "brigade-checkpoint-v1";

fn save_checkpoint(
    path: &Path,
    args: &RunArgs,
    kind: &ModelKind,
    data: &Dataset,
    model: &dyn Model,
    opt: &dyn Optimizer,
    step: usize,
) -> Result<()> {
    let mut tensors: Vec<(String, Tensor)> = model
        .params()
        .named_values()
        .into_iter()
        .map(|(n, t)| (format!("model.{n}"), t))
        .collect();
    tensors.extend(opt.state()?.into_iter().map(|(n, t)| (format!("optim.{n}"), t)));
    let meta = [
        ("format", CHECKPOINT_FORMAT.to_string()),
        ("step", step.to_string()),
        ("model", kind.name().to_string()),
        ("optimizer", format!("{:?}", args.optimizer).to_lowercase()),
        ("seed", args.seed.to_string()),
        ("data", data.fingerprint().to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    save_safetensors(path, &tensors, Some(meta))?;
    Ok(())
}

/// Loads a checkpoint into the model and optimizer; returns the step to continue from.
fn load_checkpoint(
    path: &Path,
    args: &RunArgs,
    kind: &ModelKind,
    data: &Dataset,
    model: &dyn Model,
    opt: &mut dyn Optimizer,
) -> Result<usize> {
    let err = |msg: String| CliError::Checkpoint {
        path: path.display().to_string(),
        msg,
    };
    let (tensors, meta) = load_safetensors_with_metadata(path)?;
    if meta.get("format").map(String::as_str) != Some(CHECKPOINT_FORMAT) {
        return Err(err("not a brigade checkpoint (written by --checkpoint)".into()));
    }
    let want_opt = format!("{:?}", args.optimizer).to_lowercase();
    for (key, want) in [("model", kind.name().to_string()), ("optimizer", want_opt)] {
        let got = meta.get(key).cloned().unwrap_or_default();
        if got != want {
            return Err(err(format!("it was written for {key} '{got}', this run uses '{want}'")));
        }
    }
    // the seed chooses the built-in data; the fingerprint tells any data apart (older
    // checkpoints have neither)
    let seed = args.seed.to_string();
    for (key, flag, want) in [("seed", "--seed", seed.as_str()), ("data", "data", data.fingerprint())] {
        if let Some(got) = meta.get(key).filter(|got| *got != want) {
            return Err(err(format!(
                "it was written with {flag} {got}, this run has {flag} {want}: resume with what it was written with"
            )));
        }
    }
    brigade_models::check_finite(path, &tensors)?;
    let step: usize = meta
        .get("step")
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| err("no step recorded".into()))?;
    let strip = |prefix: &str| -> Vec<(String, Tensor)> {
        tensors
            .iter()
            .filter_map(|(n, t)| n.strip_prefix(prefix).map(|n| (n.to_string(), t.clone())))
            .collect()
    };
    load_params_from_tensors(model.params(), &strip("model.")).map_err(|e| e.at_path(path))?;
    opt.load_state(&strip("optim."))?;
    Ok(step)
}

/// The loop every rank runs. `comm` is `None` for compute-only runs.
#[allow(clippy::too_many_arguments)]
pub fn rank_main(
    args: &RunArgs,
    opts: &RunOptions,
    kind: &ModelKind,
    data: &Dataset,
    rank: usize,
    world: usize,
    comm: Option<Arc<dyn Communicator>>,
    recorder: Option<&Recorder>,
    threads: usize,
) -> Result<RankOut> {
    set_compute_threads(threads);
    let model = kind.build(args.seed)?;
    if let Some(init) = &args.init {
        load_params(model.params(), init)?;
    }
    let mut opt = make_optimizer(args, model.as_ref());
    let first_step = match &opts.resume {
        Some(path) => load_checkpoint(path, args, kind, data, model.as_ref(), opt.as_mut())?,
        None => 0,
    };
    if first_step > args.steps {
        return Err(CliError::Usage(format!(
            "the checkpoint is at step {first_step}, past --steps {}",
            args.steps
        )));
    }
    let ddp = match &comm {
        Some(c) => Some(DistributedDataParallel::new(
            model.params(),
            c.clone(),
            DdpConfig {
                bucket_cap_mb: args.bucket_cap()?,
                first_bucket_cap_mb: args.first_bucket_mb,
                find_unused_parameters: args.find_unused_parameters,
                recorder: recorder.cloned(),
                ..DdpConfig::default()
            },
        )?),
        None => None,
    };
    let progress = (opts.progress && rank == 0).then(|| {
        let bar = ProgressBar::new((args.steps - first_step) as u64);
        bar.set_style(
            ProgressStyle::with_template("{bar:30} {pos}/{len} steps | {msg} | eta {eta}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar
    });
    let (b, k) = (args.batch_size, args.accum);
    let mut out = RankOut {
        first_step,
        local_losses: vec![],
        global_losses: vec![],
        step_ms: vec![],
        buckets: vec![],
        memory: None,
        params: vec![],
    };
    let span = |name: &str| recorder.map(|r| r.begin(rank, name));
    let end = |id: Option<brigade_comm::SpanId>| {
        if let (Some(r), Some(id)) = (recorder, id) {
            r.end(id)
        }
    };
    for s in first_step..args.steps {
        let t0 = Instant::now();
        let step_span = span(&format!("step {s}"));
        model.params().zero_grad()?;
        let base = s * world * k * b + rank * k * b;
        let mut step_loss = 0.0;
        for j in 0..k {
            let batch = data.batch(base + j * b, b)?;
            let fwd = span("forward");
            let loss = model.loss(&batch)?.mul_scalar(1.0 / k as f64)?;
            end(fwd);
            step_loss += loss.value().item()?;
            match (&ddp, j + 1 < k) {
                (Some(ddp), true) => ddp.no_sync(|| loss.backward())?,
                _ => loss.backward()?,
            }
        }
        let os = span("optimizer");
        opt.step()?;
        end(os);
        end(step_span);
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        out.local_losses.push(step_loss);
        out.step_ms.push(ms);
        if let Some(bar) = &progress {
            bar.set_message(format!("loss {step_loss:.4} (rank 0) | {ms:.1} ms/step"));
            bar.inc(1);
        }
        let done = s + 1;
        if rank == 0 {
            if let Some(path) = &opts.checkpoint {
                if done == args.steps || opts.checkpoint_every.is_some_and(|e| e > 0 && done % e == 0) {
                    save_checkpoint(path, args, kind, data, model.as_ref(), opt.as_ref(), done)?;
                }
            }
        }
    }
    if let (0, Some(path)) = (args.steps - first_step, &opts.checkpoint) {
        // no step run: the checkpoint asked for is the state the run starts from
        if rank == 0 {
            save_checkpoint(path, args, kind, data, model.as_ref(), opt.as_ref(), first_step)?;
        }
    }
    if let Some(bar) = progress {
        bar.finish_and_clear();
    }
    // Global losses: one all-reduce at the end instead of a sync point in every step.
    out.global_losses = match &comm {
        Some(c) if world > 1 && !out.local_losses.is_empty() => {
            let v: Vec<f32> = out.local_losses.iter().map(|&x| x as f32).collect();
            match c.all_reduce(Buffer::F32(v), ReduceOp::Avg, "losses").wait()? {
                Buffer::F32(v) => v.into_iter().map(f64::from).collect(),
                _ => unreachable!("f32 in, f32 out"),
            }
        }
        _ => out.local_losses.clone(),
    };
    if let Some(ddp) = &ddp {
        out.buckets = ddp.buckets();
        out.memory = Some(ddp.memory());
    }
    if rank == 0 {
        out.params = model.params().named_values();
    }
    Ok(out)
}

/// The root cause among the ranks' errors: a rank's own failure beats the "a peer is
/// gone" errors it caused on the others.
fn pick_error(errors: Vec<CliError>) -> CliError {
    let secondary = |e: &CliError| {
        let s = e.to_string();
        s.contains("is gone") || s.contains("comm stream closed")
    };
    let mut errors = errors;
    match errors.iter().position(|e| !secondary(e)) {
        Some(i) => errors.swap_remove(i),
        None => errors.swap_remove(0),
    }
}

/// Default compute threads per rank: the cores shared out among the ranks.
pub fn default_threads(world: usize) -> usize {
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    (cores / world).max(1)
}

/// Runs the training the flags describe on the thread backend.
pub fn run(args: &RunArgs, opts: &RunOptions) -> Result<RunReport> {
    args.validate()?;
    args.bucket_cap()?;
    if args.backend == crate::args::BackendName::Mpi {
        return crate::mpi_backend::run(args, opts);
    }
    let kind = args.model.kind();
    let data = load_data(args, &kind)?;
    let world = args.world_size;
    let threads = args.threads_per_rank.unwrap_or_else(|| default_threads(world));
    let recorder = opts.record.then(Recorder::new);
    let net = args.net_gbps.map(|g| NetModel {
        latency: Duration::from_secs_f64(args.net_latency_us * 1e-6),
        bandwidth_bytes_per_s: g * 1e9 / 8.0,
    });
    let timeout = Duration::from_secs_f64(args.timeout_s);
    let results = launch_with_timeout(world, timeout, |comm| {
        let rank = comm.rank();
        let comm: Option<Arc<dyn Communicator>> = if opts.compute_only {
            None
        } else {
            let c: Arc<dyn Communicator> = match net {
                Some(m) => Arc::new(SimulatedNetwork::new(comm, m)),
                None => Arc::new(comm),
            };
            Some(match &recorder {
                Some(r) => Arc::new(Traced::new(c, r.clone())),
                None => c,
            })
        };
        rank_main(args, opts, &kind, &data, rank, world, comm, recorder.as_ref(), threads)
    });
    collect(results, world, recorder)
}

/// Turns the ranks' results into rank 0's report, or the most telling error.
pub fn collect(
    results: Vec<std::result::Result<Result<RankOut>, CommError>>,
    world: usize,
    recorder: Option<Recorder>,
) -> Result<RunReport> {
    let mut outs = vec![];
    let mut errors = vec![];
    for r in results {
        match r {
            Ok(Ok(o)) => outs.push(o),
            Ok(Err(e)) => errors.push(e),
            Err(e) => errors.push(e.into()),
        }
    }
    if !errors.is_empty() {
        return Err(pick_error(errors));
    }
    let first = outs.swap_remove(0);
    Ok(RunReport {
        world_size: world,
        first_step: first.first_step,
        losses: first.global_losses,
        step_ms: first.step_ms,
        buckets: first.buckets,
        memory: first.memory,
        recorder,
        last_step_events: None,
        params: first.params,
    })
}
