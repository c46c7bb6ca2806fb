//! Setting up one rank: the data's lengths checked, the checkpoint resumed, the recipe checked
//! against it, the data feed placed, the replica moved to its device and wrapped in DDP.

use brigade_autograd::{Optimizer, Var};
use brigade_comm::CommMeter;
use brigade_ddp::{DdpConfig, DistributedDataParallel, ReducerPolicy};
use brigade_models::{load_params, Model, SamplerCursor, SamplerPosition};
use brigade_tensor::{set_compute_threads, Device};

use crate::checkpoint::{load_checkpoint, load_checkpoint_by_shards, CheckpointIdentity, DistributedState, Resumed};
use crate::checkpoint_files::{Lineage, RunFile, INIT_FIELD};
use crate::config::{OptimizerConfig, TrainConfig};
use crate::error::{CheckpointMismatch, Error, Result};
use crate::field::{DEVICE, JOIN, POLICY, PRECISION, REDUCE_DTYPE};
use crate::join::{self, JoinRun};
use crate::launch::{nccl, RankContext};
use crate::resume::{
    check_resume, check_rows_per_step, defaulted_t_note, dropout_world_note, loss_scale_note, regrouped_buckets_note,
    sampled_batch_note, ResumeError,
};
use crate::source::{DataLength, DataOrder, DataSource};

use super::{
    compute_threads, state_layout, Feed, InstalledMeter, Progress, Records, Replica, ResumeNotes, Saves, Trainer,
};

impl<'a> Trainer<'a> {
    /// Takes this rank's `model` (loading `init` into it if given), builds the optimizer,
    /// resumes from the checkpoint if asked, and wraps the model in DDP over the rank's
    /// communicator.
    pub fn new(
        cfg: &'a TrainConfig,
        mut model: Box<dyn Model>,
        data: &'a dyn DataSource,
        ctx: &'a RankContext,
    ) -> Result<Self> {
        set_compute_threads(compute_threads(cfg, ctx));
        refuse_before_any_work(cfg)?;
        // `fit` meters the rank's thread from before the model is built; a trainer made on a
        // thread without a meter installs its own (the storages made before it not counted)
        let (memory, installed_meter) = InstalledMeter::on_this_thread();
        let by_shards = start_parameters(cfg, model.as_ref())?;
        model.set_activation_checkpointing(cfg.model.activation_checkpointing)?;
        let lengths = check_lengths(cfg, data, ctx)?;
        let opt = {
            let _part = brigade_ddp::MemoryPart::Optimizer.enter();
            cfg.recipe.optimizer.build(model.params().params().to_vec())
        };
        // This rank's policy, made first: a checkpoint names the policy it was written under.
        let policy = make_policy(cfg, ctx)?;
        let policy_name = policy.as_ref().map(|p| p.name());
        let (mut resumed, mut opt) = resume(cfg, data, ctx, model.as_mut(), opt, policy_name.as_deref(), by_shards)?;
        let (schedule, changes) = check_recipe(cfg, resumed.as_ref())?;
        let resume = ResumeNotes {
            changes,
            notes: resumed
                .as_ref()
                .map(|r| resume_notes(cfg, r, ctx.world_size))
                .unwrap_or_default(),
        };
        let first_step = resumed.as_ref().map_or(0, |r: &Resumed| r.step);
        let feed = Feed::new(cfg, data, ctx, lengths, resumed.as_ref(), first_step)?;
        if cfg.recipe.precision.is_mixed() {
            // the masters are made from rank 0's f32 values, as DDP's broadcast makes the
            // parameters: ranks that initialised differently would otherwise keep their own
            if cfg.ddp().is_some_and(|d| d.broadcast_parameters) && policy.is_some() {
                brigade_ddp::broadcast_from_rank0(model.params().params(), ctx.comm.as_ref())?;
            }
            opt = master_weights(cfg, model.as_ref(), opt.as_ref(), policy_name.as_deref())?;
        }
        let distributed = resumed.as_mut().map(|r| std::mem::take(&mut r.distributed));
        let autotuned = distributed.as_ref().and_then(|d| d.autotune);
        let replica = Replica::new(cfg, ctx, model, opt, policy, distributed.unwrap_or_default())?;
        if let (Some(ddp), true) = (&replica.ddp, cfg.autotunes()) {
            brigade_ddp::overlap::Autotuner::check(ddp)?;
        }
        Ok(Trainer {
            at: Progress::at_start(
                first_step,
                &feed,
                &replica,
                resumed
                    .as_ref()
                    .and_then(|r| r.metadata.get(crate::checkpoint::LAST_LOSS_KEY).cloned()),
            ),
            cfg,
            data,
            ctx,
            replica,
            feed,
            schedule,
            resume,
            saves: Saves::new(Lineage::continuing(resumed.as_ref().map(|r| &r.metadata))),
            records: Records::new(cfg, autotuned, memory, installed_meter)?,
        })
    }
}

/// Where the parameters start: drawn whole from their recipes (a run that does not start
/// sharded), or left deferred for each rank to draw its shards, and loaded from `model.init`,
/// whole or (started sharded) by the ranges each rank reads. Returns whether the run resumes
/// by shards too ([`crate::checkpoint::load_checkpoint_by_shards`]): started sharded, unless
/// it takes non-finite values (the ranged reads refuse them) or some parameter holds its
/// values already (a model built without recipes), where the checkpoint loads whole and is
/// then sharded.
fn start_parameters(cfg: &TrainConfig, model: &dyn Model) -> Result<bool> {
    let params = model.params().params();
    let resumes = cfg.runtime.checkpoint.resume.is_some();
    // started sharded: each rank reads only its shards' bytes of a file
    let read_shards = cfg.starts_sharded() && params.iter().all(|p| p.deferred_init().is_some());
    let resume_by_shards = read_shards && resumes && !cfg.recipe.allow_nonfinite;
    let whole = !cfg.starts_sharded() || (!read_shards && cfg.model.init.is_some()) || (resumes && !resume_by_shards);
    if whole {
        // a model built with deferred parameters, in a run that loads them whole
        params.iter().try_for_each(Var::materialize)?;
    }
    match &cfg.model.init {
        Some(init) if !whole => brigade_models::defer_params_to_file(model.params(), init)?,
        Some(init) => load_params(model.params(), init)?,
        None => {}
    }
    Ok(resume_by_shards)
}

/// What to tell of a resume from `r` on `world` ranks: see [`crate::resume`]. Dropout masks
/// are told of where the checkpoint's run drew some (its generators moved) and this run's
/// recorded model configuration, if any, has a dropout above 0.
fn resume_notes(cfg: &TrainConfig, r: &Resumed, world: usize) -> Vec<String> {
    let drew = r.dropout_rng.iter().any(|s| s.offset > 0);
    let draws = cfg
        .model
        .config
        .as_deref()
        .and_then(|c| serde_json::from_str::<serde_json::Value>(c).ok())
        .and_then(|c| c.get("dropout")?.as_f64())
        .is_none_or(|p| p > 0.0);
    [
        defaulted_t_note(cfg, &r.metadata),
        loss_scale_note(cfg, &r.metadata, r.loss_scale),
        sampled_batch_note(cfg, &r.metadata),
        dropout_world_note(if drew && draws { r.dropout_rng.len() } else { 0 }, world),
        regrouped_buckets_note(cfg, &r.distributed),
    ]
    .into_iter()
    .flatten()
    .collect()
}

/// What the configuration alone refuses, before the model or the data is touched: a checkpoint
/// path that cannot be written or may land on the initial parameters, a reduce dtype other
/// than the parameters' or f32, and ZeRO-3 with a join mode.
fn refuse_before_any_work(cfg: &TrainConfig) -> Result<()> {
    cfg.runtime.checkpoint.validate()?;
    let init: Vec<RunFile> = cfg.model.init.iter().map(|p| RunFile::read(INIT_FIELD, p)).collect();
    cfg.runtime.checkpoint.check_files(&init)?;
    let p = cfg.recipe.precision;
    if p.reduce_dtype != p.param_dtype && p.reduce_dtype != brigade_tensor::DType::F32 {
        return Err(Error::Config(format!(
            "{REDUCE_DTYPE} {}: beside {} parameters the gradients are reduced in their own dtype or in f32; a \
             narrower sum would round the accumulated gradients (the compression policies send 16-bit shares of \
             f32 ones)",
            dtype_name(p.reduce_dtype),
            dtype_name(p.param_dtype)
        )));
    }
    let policy = cfg.distributed.as_ref().map(|d| &d.policy);
    if let (Some(policy), Some(_)) = (policy.filter(|p| p.shards_params()), cfg.data.join) {
        return Err(Error::Config(format!(
            "{} does not combine with a join mode ({JOIN}): a rank without data would skip the gathers of the \
             units that every forward and backward of the others issues; run without a join mode, or under a \
             policy that keeps the whole parameters on every rank",
            policy
                .name()
                .unwrap_or_else(|| "a policy that shards the parameters".into())
        )));
    }
    refuse_accum_into_shard(cfg)
}

/// Accumulation into the gradient shard without a policy that shards the gradients, or
/// without microbatches to accumulate.
fn refuse_accum_into_shard(cfg: &TrainConfig) -> Result<()> {
    if !cfg.data.accum_into_shard {
        return Ok(());
    }
    let policy = cfg.distributed.as_ref().map(|d| &d.policy);
    if !policy.is_some_and(|p| p.shards_grads()) {
        let under = policy
            .and_then(|p| p.name())
            .map_or_else(|| "without DDP".to_string(), |n| format!("under {n}"));
        return Err(Error::Config(format!(
            "accumulating into the gradient shard needs a policy that keeps each rank's shard of the gradients \
             (ZeRO stage 2 or 3); {under} there is no shard to accumulate into"
        )));
    }
    if cfg.data.accum < 2 {
        return Err(Error::Config(format!(
            "accumulating into the gradient shard needs 2 or more microbatches a step (accum is {}): one \
             microbatch already reduces straight into the shard",
            cfg.data.accum
        )));
    }
    Ok(())
}

/// This rank's policy (none without DDP), refused before any step when the run checkpoints and
/// the policy may keep state it does not save (its resume would be inexact).
fn make_policy(cfg: &TrainConfig, ctx: &RankContext) -> Result<Option<Box<dyn brigade_ddp::ReducerPolicy>>> {
    let policy = cfg.distributed.as_ref().map(|d| d.policy.make(ctx.rank)).transpose()?;
    if let (Some(p), Some(_)) = (&policy, &cfg.runtime.checkpoint.path) {
        brigade_ddp::policy::check_checkpointable(p.as_ref())?;
    }
    Ok(policy)
}

/// The optimizer of a mixed-precision run: f32 master weights taken from the (built,
/// initialised, resumed) f32 parameters, which become their rounded 16-bit compute copy, and
/// `opt`'s kind, state and learning rate stepping the masters (fp16: with dynamic loss
/// scaling, its scale and counter resumed from the checkpoint). Under ZeRO-1/2/3 the policy keeps
/// this rank's shard of these masters only (ZeRO-3's shard is its master; the whole masters are
/// dropped once it is cut). Refused with one line where the combination is not
/// built: a device other than the CPU (its kernels compute f32 only), and the policies
/// [`refused_under`] names.
fn master_weights(
    cfg: &TrainConfig,
    model: &dyn Model,
    opt: &dyn Optimizer,
    policy: Option<&str>,
) -> Result<Box<dyn Optimizer>> {
    let p = cfg.recipe.precision;
    let refuse = |why: String| Err(Error::Config(format!("{PRECISION} {}: {why}", p.name())));
    if !matches!(
        cfg.runtime.device,
        crate::placement::DevicePlacement::Cpu | crate::placement::DevicePlacement::Fake(_)
    ) {
        return refuse(format!("16-bit kernels run on the CPU only so far; use {DEVICE} cpu"));
    }
    if let Some(why) = policy.and_then(|name| refused_under(p, name)) {
        return refuse(why);
    }
    let mut state = opt.state_dict()?;
    let params = model.params().params().to_vec();
    let build = |masters: Vec<Var>| cfg.recipe.optimizer.build(masters);
    let mut mixed = brigade_autograd::MasterWeights::new(params, p.param_dtype, build, &[])?;
    if p.param_dtype == brigade_tensor::DType::F16 {
        mixed = mixed.with_loss_scaling(cfg.recipe.loss_scale_growth_interval);
        // the f32 optimizer `opt` resumed into keeps no scaler: its entries come from the file
        if let Some(path) = &cfg.runtime.checkpoint.resume {
            let saved = brigade_models::load_safetensors(path)?;
            state.extend(
                saved
                    .into_iter()
                    .filter_map(|(k, t)| Some((k.strip_prefix("optim.")?.to_string(), t)))
                    .filter(|(k, _)| k.starts_with("grad_scaler.")),
            );
        }
    }
    if !state.is_empty() {
        mixed.load_state_dict(&state)?;
    }
    mixed.set_lr(opt.lr());
    Ok(Box::new(mixed))
}

/// Why policy `name` does not run under `precision` (16-bit parameters), or `None` where it
/// does: every policy but two combinations. The policies get buckets in the reduce dtype (user
/// policies too: [`brigade_ddp::policy::PolicyBucket::tensor`]); ZeRO-1/2/3 keep f32 master
/// shards (under fp16 the ranks agree on a skipped step; ZeRO-3 gathers its units in the
/// parameters' dtype), PowerSGD and int8 compute in
/// f32 from the 16-bit gradients and keep their error feedback through the loss scaler's skipped
/// steps and scale changes, and a compression policy of the bucket's own type is a pass-through.
/// Refused: the compression policies beside an f32 reduce dtype (16-bit shares of an f32 sum)
/// and bf16 compression of fp16 gradients (the same bytes, fewer mantissa bits).
fn refused_under(precision: brigade_autograd::MixedPrecision, name: &str) -> Option<String> {
    use brigade_policies::{AllReduce, Compress, HalfType};
    let half = HalfType::of_policy(name)?;
    if precision.reduce_dtype == brigade_tensor::DType::F32 {
        return Some(format!(
            "the {name} compression policy sends 16-bit shares, which defeats {REDUCE_DTYPE} f32's f32 sum; drop one of the two"
        ));
    }
    (half == HalfType::BF16 && precision.param_dtype == brigade_tensor::DType::F16).then(|| {
        format!(
            "the {name} compression policy sends no fewer bytes than {} gradients and rounds them to fewer \
             mantissa bits for nothing; use {POLICY} {} (a pass-through) or {}",
            dtype_name(precision.param_dtype),
            Compress::new(HalfType::F16).name(),
            AllReduce.name()
        )
    })
}

/// The name `--precision` and `--reduce-dtype` give `dtype`.
fn dtype_name(dtype: brigade_tensor::DType) -> &'static str {
    brigade_autograd::MixedPrecision::uniform(dtype).name()
}

/// Every rank's length, known before step 0: without a join mode, ranks that would run out at
/// different steps are refused here (with one, a rank with fewer rows than a step joins at
/// step 0; when every rank has, no step could run).
fn check_lengths(cfg: &TrainConfig, data: &dyn DataSource, ctx: &RankContext) -> Result<DataLength> {
    let lengths = data.rank_lengths(ctx.world_size, &cfg.data.order)?;
    let DataLength::PerEpoch(rows) = &lengths else {
        return Ok(lengths);
    };
    let rows_per_step = cfg.rows_per_step();
    match cfg.data.join {
        None if !lengths.is_even() => Err(join::uneven_refusal(rows)),
        None if rows[ctx.rank] < cfg.data.batch_size => Err(Error::Config(format!(
            "rank {} reads {} rows per epoch, fewer than one microbatch of {}",
            ctx.rank, rows[ctx.rank], cfg.data.batch_size
        ))),
        Some(_) if rows.iter().all(|&n| n < rows_per_step) => Err(Error::NoStep {
            rows: rows.clone(),
            rows_per_step,
        }),
        _ => Ok(lengths),
    }
}

/// Loads the checkpoint to resume, if any, into `model` and `opt` (refused if it is not of
/// this run: another model, optimizer, seed, data, policy...), whole or, `by_shards`, left in
/// the file for each rank to read its shards of ([`load_checkpoint_by_shards`]), and this
/// rank's dropout generator from it; returns the optimizer resumed.
fn resume(
    cfg: &TrainConfig,
    data: &dyn DataSource,
    ctx: &RankContext,
    model: &mut dyn Model,
    mut opt: Box<dyn Optimizer>,
    policy: Option<&str>,
    by_shards: bool,
) -> Result<(Option<Resumed>, Box<dyn Optimizer>)> {
    let Some(path) = &cfg.runtime.checkpoint.resume else {
        return Ok((None, opt));
    };
    let id = CheckpointIdentity {
        model: &cfg.model.name,
        optimizer: cfg.recipe.optimizer.name(),
        seed: cfg.model.seed,
        data: data.fingerprint(),
        layout: state_layout(cfg),
        world_size: ctx.world_size,
        data_order: cfg.data.order.describe(),
        sampler: None,
        model_config: None,
        recipe: vec![],
        policy,
        dropout_rng: vec![],
        lineage: vec![],
        allow_nonfinite: cfg.recipe.allow_nonfinite,
    };
    let resumed = match by_shards {
        true => {
            let (resumed, in_file) = load_checkpoint_by_shards(path, &id, model, opt)?;
            opt = in_file;
            resumed
        }
        false => load_checkpoint(path, &id, model, opt.as_mut())?,
    };
    // this rank's dropout generator continues where the checkpoint's stood
    if let Some(state) = resumed.dropout_rng_of(ctx.rank) {
        model
            .set_rng_state(state)
            .map_err(|e| Error::checkpoint(path, CheckpointMismatch::DropoutRng(e.to_string())))?;
    }
    Ok((Some(resumed), opt))
}

/// The schedule (T from the checkpoint unless given) and what this run changed of the
/// checkpoint's recipe, refused where a resume may not change it; and the clipping norm checked.
fn check_recipe(
    cfg: &TrainConfig,
    resumed: Option<&Resumed>,
) -> Result<(brigade_autograd::LrSchedule, Vec<crate::recipe::HyperparameterChange>)> {
    let checked =
        check_resume(cfg, resumed.map(|r| &r.metadata)).map_err(|e| match (e, &cfg.runtime.checkpoint.resume) {
            (ResumeError::Refused(mismatch), Some(path)) => Error::checkpoint(path, mismatch),
            (ResumeError::Refused(mismatch), None) => Error::Config(mismatch.to_string()),
            (ResumeError::Config(e), _) => e,
        })?;
    if let Some(max) = cfg.recipe.clip_grad_norm.filter(|m| !(m.is_finite() && *m > 0.0)) {
        return Err(Error::Config(format!(
            "the gradient clipping norm must be finite and > 0, got {max}"
        )));
    }
    Ok(checked)
}

impl Feed {
    /// The join run (under a join mode) and this rank's sampler cursor, standing where the
    /// resumed checkpoint left them; refused when the checkpoint does not fit them or is past
    /// the run's end.
    fn new(
        cfg: &TrainConfig,
        data: &dyn DataSource,
        ctx: &RankContext,
        lengths: DataLength,
        resumed: Option<&Resumed>,
        first_step: usize,
    ) -> Result<Feed> {
        let rows_per_step = cfg.rows_per_step();
        let join = cfg
            .data
            .join
            .map(|mode| JoinRun::new(mode, &lengths, rows_per_step, ctx.world_size, first_step));
        if let (Some(r), Some(path)) = (resumed, &cfg.runtime.checkpoint.resume) {
            let position_from_step = join.is_some() || matches!(cfg.data.order, DataOrder::InOrder);
            check_rows_per_step(cfg, &r.metadata, position_from_step, ctx.world_size)
                .map_err(|mismatch| Error::checkpoint(path, mismatch))?;
            join::check_resume(&r.metadata, join.as_ref()).map_err(|mismatch| Error::checkpoint(path, mismatch))?;
        }
        let cursor = sampler_cursor(cfg, data, ctx, join.as_ref(), resumed, first_step)?;
        if let (Some(path), true) = (&cfg.runtime.checkpoint.resume, first_step > cfg.recipe.steps) {
            return Err(Error::checkpoint(
                path,
                CheckpointMismatch::PastTheEnd {
                    step: first_step,
                    steps: cfg.recipe.steps,
                },
            ));
        }
        Ok(Feed { lengths, cursor, join })
    }
}

/// This rank's sampler cursor under a sampled data order, where the run resumes (a join run is
/// one pass: each rank stands where its own steps left it; the checkpoint records rank 0's
/// position); `None` for rows in order, and for a rank of a join run whose data holds no step.
fn sampler_cursor(
    cfg: &TrainConfig,
    data: &dyn DataSource,
    ctx: &RankContext,
    join: Option<&JoinRun>,
    resumed: Option<&Resumed>,
    first_step: usize,
) -> Result<Option<SamplerCursor>> {
    let DataOrder::Sampled(options) = cfg.data.order else {
        return Ok(None);
    };
    let own_steps = join.and_then(|j| j.steps_of(ctx.rank));
    if own_steps == Some(0) {
        return Ok(None);
    }
    let sampler = data.sampler(ctx.rank, ctx.world_size, options)?;
    let joined_position = own_steps.map(|n| SamplerPosition {
        epoch: 0,
        index: first_step.min(n) * cfg.rows_per_step(),
    });
    let at = joined_position
        .or(resumed.and_then(|r| r.sampler))
        .unwrap_or(SamplerPosition { epoch: 0, index: 0 });
    Ok(Some(SamplerCursor::new(sampler, at)?))
}

impl Replica {
    /// The replica on its device, wrapped in DDP under `policy` (without DDP, as it is) on the
    /// resumed checkpoint's buckets, each rank's own state and its policy's state loaded from
    /// `resumed` and its optimizer the one the policy builds (the load order the policy contract
    /// states, [`brigade_ddp::policy`]).
    fn new(
        cfg: &TrainConfig,
        ctx: &RankContext,
        model: Box<dyn Model>,
        mut opt: Box<dyn Optimizer>,
        policy: Option<Box<dyn ReducerPolicy>>,
        resumed: DistributedState,
    ) -> Result<Replica> {
        let device = cfg.runtime.device.for_rank(nccl::gpu_rank(ctx))?;
        if device != Device::Cpu {
            opt = move_to_device(model.as_ref(), opt.as_ref(), &cfg.recipe.optimizer, device)?;
        }
        let meter = CommMeter::new();
        let ddp = match (cfg.ddp(), policy) {
            (Some(d), Some(policy)) => {
                // the autotuner continues from the caps its checks had set
                let (bucket_cap_mb, first_bucket_cap_mb) = match (&resumed.buckets, resumed.autotune) {
                    (Some(g), Some(p)) if p.checks > 0 && cfg.autotunes() => g.caps_mb,
                    _ => (d.bucket_cap_mb, d.first_bucket_cap_mb),
                };
                let d = DdpConfig {
                    reduce_dtype: Some(cfg.recipe.precision.reduce_dtype),
                    grouping: resumed.buckets,
                    bucket_cap_mb,
                    first_bucket_cap_mb,
                    ..d.clone()
                };
                Some(wrap(&d, ctx, model.as_ref(), device, &meter, policy).map_err(|e| in_checkpoint(cfg, e))?)
            }
            _ => None,
        };
        // A diverging policy's rank takes its own parameters and optimizer state back (after
        // DDP broadcast rank 0's), then every rank its own part of the policy state (before the
        // optimizer is built: a policy may build it from its state).
        if let (Some(ddp), false) = (&ddp, resumed.ranks.is_empty()) {
            ddp.load_rank_state(&resumed.ranks, opt.as_mut())
                .map_err(|e| in_checkpoint(cfg, Error::Ddp(e)))?;
        }
        if let (Some(ddp), false) = (&ddp, resumed.policy.is_empty()) {
            ddp.load_gathered_policy_state(&resumed.policy)
                .map_err(|e| match &cfg.runtime.checkpoint.resume {
                    Some(path) => Error::checkpoint(path, CheckpointMismatch::PolicyState(e.to_string())),
                    None => e.into(),
                })?;
        }
        // The policy builds what is stepped (ZeRO: this rank's shard of every bucket only).
        if let Some(ddp) = &ddp {
            let build = |params: Vec<Var>| cfg.recipe.optimizer.build(params);
            opt = Box::new(
                ddp.optimizer(opt, &build)
                    .map_err(|e| in_checkpoint(cfg, Error::Ddp(e)))?,
            );
        }
        Ok(Replica {
            model,
            device,
            opt,
            ddp,
            meter,
        })
    }
}

/// `e` as a mismatch of the resumed checkpoint where it is one (DDP refused the checkpoint's
/// bucket grouping or a rank's own state, or a policy reading its shards of the checkpoint's
/// parameters found a NaN or an infinity, as the whole read names it), else as it is.
fn in_checkpoint(cfg: &TrainConfig, e: Error) -> Error {
    use brigade_autograd::AutogradError::NonFiniteStored;
    use brigade_ddp::DdpError;
    let Some(resumed) = &cfg.runtime.checkpoint.resume else {
        return e;
    };
    let mismatch = match &e {
        Error::Ddp(DdpError::BucketGrouping(why)) => CheckpointMismatch::BucketGrouping(why.clone()),
        Error::Ddp(DdpError::RankState(why)) => CheckpointMismatch::RankState(why.clone()),
        Error::Ddp(DdpError::InitialValues {
            param,
            shape,
            source: NonFiniteStored {
                path, element, value, ..
            },
            ..
        }) if path == resumed => CheckpointMismatch::NonFinite {
            tensor: format!("model.{param}"),
            index: format!("{:?}", brigade_models::row_major_index(*element, shape)),
            value: value.to_string(),
        },
        _ => return e,
    };
    Error::checkpoint(resumed, mismatch)
}

/// `model` wrapped in DDP under `policy`, its recorder the rank's and its meter `meter`: NCCL's
/// device group on the GPU's comm stream, or the host group over the communicator.
fn wrap(
    d: &DdpConfig,
    ctx: &RankContext,
    model: &dyn Model,
    device: Device,
    meter: &CommMeter,
    policy: Box<dyn ReducerPolicy>,
) -> Result<DistributedDataParallel> {
    let comm = ctx.comm.clone();
    let d = DdpConfig {
        recorder: ctx.recorder.clone(),
        meter: meter.clone(),
        ..d.clone()
    };
    Ok(match nccl::device_group(ctx, device, ctx.net)? {
        Some(group) => DistributedDataParallel::with_group(model.params(), comm, group, d, policy)?,
        None => DistributedDataParallel::with_group(model.params(), comm, ctx.group.clone(), d, policy)?,
    })
}

/// Moves the parameters (built, initialised and resumed on the CPU) to `device`, and rebuilds
/// the optimizer with its state moved there too, its learning rate kept. DDP, built after
/// this, then allocates its gradient buckets beside the parameters.
fn move_to_device(
    model: &dyn Model,
    opt: &dyn Optimizer,
    cfg: &OptimizerConfig,
    device: Device,
) -> Result<Box<dyn Optimizer>> {
    let state = opt
        .state_dict()?
        .into_iter()
        .map(|(k, t)| Ok((k, t.to_device(device)?)))
        .collect::<Result<Vec<_>>>()?;
    let params = model.params().params().to_vec();
    for p in &params {
        p.set_value(p.value().to_device(device)?)?;
    }
    let mut moved = cfg.build(params);
    moved.load_state_dict(&state)?;
    moved.set_lr(opt.lr());
    Ok(moved)
}
