//! Streaming DiLoCo (Douillard et al. 2025): DiLoCo whose parameters are cut into FRAGMENTS
//! fragments (runs of the optimizer's parameters in its order, of about equal elements), each
//! synced once every H inner steps on a staggered schedule, so that the link carries one
//! fragment at a time. Fragment `f` is issued after every step `c` (counted from 1) with
//! `c % H == f·H / FRAGMENTS` (fragment 0 at `c % H == 0`): the average of its
//! pseudo-gradients, one all-reduce of one flat buffer of the fragment's parameters, is issued
//! and held while the next DELAY inner steps run, and merged after step `c + DELAY`: the step
//! waits for it (it has normally landed), the outer Nesterov SGD steps the fragment's snapshot,
//! and the snapshot replaces the fragment's parameters (torchft's `fragment_update_alpha = 0`:
//! the fragment's inner steps during the overlap are dropped). With one fragment and DELAY 0 it
//! is `diloco:H` bit for bit.
//!
//! A checkpoint taken while a sync is in flight first waits for it
//! ([`ReducerPolicy::finish_in_flight`]) and keeps the landed, unmerged average beside the step
//! that merges it: the resumed run merges the same values at the same step.

use std::time::{Duration, Instant};

use brigade_autograd::Optimizer;
use brigade_comm::ReduceOp;
use brigade_ddp::policy::{AfterStepWire, FragmentPart, WireModel, WireOp};
use brigade_ddp::policy::{
    BuildOptimizer, Group, OptimizerContext, PolicyBucket, PolicyDiagnostic, PolicyMemory, Reduction, StepContext,
    TensorWork,
};
use brigade_ddp::{DdpError, KeepsState, RankState, ReducerPolicy, Replicas};
use brigade_tensor::{DType, Tensor};

use crate::diloco::{never_synced, read_steps, whole, Outer, OuterSgd};
use crate::error::PolicyError;
use crate::spec::{spec_error, PolicySpec};

/// Inner steps a fragment's sync overlaps when a spec does not say.
pub const DEFAULT_DELAY: usize = 1;

/// `streaming-diloco:H:FRAGMENTS[:DELAY[:OUTER_LR[:MOMENTUM]]][:bf16|:int8]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamingConfig {
    /// The DiLoCo each fragment follows: its period H and outer optimizer.
    pub diloco: crate::DilocoConfig,
    /// Fragments (1 to H, and at most the parameters the optimizer steps).
    pub fragments: usize,
    /// Inner steps each fragment's sync overlaps before it is merged (under H).
    pub delay: usize,
    /// What a fragment's pseudo-gradient is sent as.
    pub outer_precision: OuterPrecision,
}

/// What streaming DiLoCo sends a fragment's pseudo-gradient as (the paper quantizes it: the
/// outer step tolerates coarse outer gradients). Spelled as the spec's last field,
/// `streaming-diloco:H:FRAGMENTS[:DELAY[:OUTER_LR[:MOMENTUM]]][:bf16|:int8]`, with the names
/// of the policies that compress the same way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum OuterPrecision {
    /// f32, all-reduced (the default).
    #[default]
    F32,
    /// Rounded to bf16 and all-reduced (the backends sum in f32 and round once): half the bytes.
    Bf16,
    /// Each rank's pseudo-gradient quantized to int8 with one scale per fragment (its largest
    /// magnitude over 127, by the int8 cast: half to even), all-gathered with the scale and
    /// dequantized and averaged in f32 in rank order: a quarter of the bytes per rank (an
    /// all-gather: each rank receives every rank's piece).
    Int8,
}

impl OuterPrecision {
    /// The spec's word for it (`None`: f32, written as nothing).
    pub fn word(self) -> Option<&'static str> {
        match self {
            OuterPrecision::F32 => None,
            OuterPrecision::Bf16 => Some("bf16"),
            OuterPrecision::Int8 => Some("int8"),
        }
    }

    /// The precision a spec field names (`None`: not a precision's word).
    fn read(field: &str) -> Option<OuterPrecision> {
        [OuterPrecision::Bf16, OuterPrecision::Int8]
            .into_iter()
            .find(|p| p.word() == Some(field))
    }

    /// Bytes each rank sends per element.
    fn bytes_per_element(self) -> f64 {
        match self {
            OuterPrecision::F32 => 4.0,
            OuterPrecision::Bf16 => 2.0,
            OuterPrecision::Int8 => 1.0,
        }
    }
}

impl StreamingConfig {
    /// Refuses fragments outside `1..=H`, a delay of H or more, and a bad DiLoCo.
    pub fn validate(&self) -> Result<(), PolicyError> {
        let bad = |reason: String| PolicyError::Config {
            policy: "streaming-diloco".into(),
            reason,
        };
        let h = self.diloco.period;
        if h == 0 {
            return Err(bad("the period H must be at least 1 inner step".into()));
        }
        if self.fragments == 0 || self.fragments > h {
            return Err(bad(format!(
                "FRAGMENTS must be 1 to H = {h} (each fragment syncs at its own step of the period), got {}",
                self.fragments
            )));
        }
        if self.delay >= h {
            return Err(bad(format!(
                "DELAY must be under H = {h} (a fragment's sync lands before it syncs again), got {}",
                self.delay
            )));
        }
        self.diloco.outer.validate("streaming-diloco")
    }

    /// The step within the period (`c % H`) at which fragment `f` is issued.
    pub fn offset(&self, f: usize) -> u64 {
        (f * self.diloco.period / self.fragments) as u64
    }
}

/// The spec of `streaming-diloco:ARGS`.
pub(crate) fn read_spec(spec: &str, arg: Option<&str>) -> Result<PolicySpec, PolicyError> {
    let form = "streaming-diloco:H:FRAGMENTS[:DELAY[:OUTER_LR[:MOMENTUM]]][:bf16|:int8]";
    let arg =
        arg.ok_or_else(|| spec_error(spec, format!("streaming DiLoCo needs its period and fragments: {form}")))?;
    let mut fields: Vec<&str> = arg.split(':').collect();
    let outer_precision = match fields.last().and_then(|f| OuterPrecision::read(f)) {
        Some(p) if fields.len() > 2 => {
            fields.pop();
            p
        }
        _ => OuterPrecision::F32,
    };
    if fields.len() < 2 {
        return Err(spec_error(
            spec,
            format!("streaming DiLoCo needs its period and fragments: {form}"),
        ));
    }
    let period = whole(spec, "streaming DiLoCo's period H", fields[0])?;
    let fragments = whole(spec, "streaming DiLoCo's FRAGMENTS", fields[1])?;
    let delay = match fields.get(2) {
        None => DEFAULT_DELAY,
        Some(d) => d
            .parse()
            .map_err(|_| spec_error(spec, format!("DELAY must be a whole number of inner steps, got '{d}'")))?,
    };
    let cfg = StreamingConfig {
        diloco: crate::DilocoConfig {
            period,
            outer: OuterSgd::read(spec, fields.get(3..).unwrap_or(&[]))?,
        },
        fragments,
        delay,
        outer_precision,
    };
    cfg.validate().map_err(|e| spec_error(spec, e.to_string()))?;
    Ok(PolicySpec::StreamingDiloco(cfg))
}

/// `H:FRAGMENTS[:DELAY[:OUTER_LR[:MOMENTUM]]][:bf16|:int8]` of a streaming DiLoCo spec.
pub(crate) fn write_spec(spec: &PolicySpec) -> Option<String> {
    match spec {
        PolicySpec::StreamingDiloco(c) => {
            let outer = c.diloco.outer.write();
            let delay = match (c.delay, outer.is_empty()) {
                (DEFAULT_DELAY, true) => String::new(),
                (d, _) => format!(":{d}"),
            };
            let precision = c.outer_precision.word().map(|w| format!(":{w}")).unwrap_or_default();
            Some(format!("{}:{}{delay}{outer}{precision}", c.diloco.period, c.fragments))
        }
        _ => None,
    }
}

/// A plan groups streaming DiLoCo by its whole spec (every setting changes what a step measures).
pub(crate) fn family(spec: &PolicySpec) -> PolicySpec {
    spec.clone()
}

/// What a plan tries when no profile recorded it.
pub(crate) fn plan_default() -> PolicySpec {
    PolicySpec::StreamingDiloco(StreamingConfig {
        diloco: crate::DilocoConfig::new(10),
        fragments: 2,
        delay: DEFAULT_DELAY,
        outer_precision: OuterPrecision::F32,
    })
}

/// One rank's streaming DiLoCo of `spec`.
pub(crate) fn build_spec(spec: &PolicySpec) -> Result<Box<dyn ReducerPolicy>, PolicyError> {
    let PolicySpec::StreamingDiloco(cfg) = *spec else {
        unreachable!("the streaming-diloco entry builds streaming DiLoCo specs")
    };
    Ok(Box::new(StreamingDiloco::new(cfg)?))
}

/// A fragment's average: one flat f32 buffer of its parameters' (as
/// [`Outer::flat_delta`] lays them out).
enum Landing {
    /// Issued, perhaps not landed.
    InFlight(TensorWork<Tensor>),
    /// Landed (waited for before a checkpoint, or loaded from one).
    Landed(Tensor),
}

/// A fragment's sync between its issue and its merge.
struct Pending {
    /// The step count after which it is merged.
    merge_at: u64,
    /// Its parameters, by their places in the optimizer's list, in the order of the average.
    ids: Vec<usize>,
    /// Its parameters' averaged pseudo-gradients.
    average: Landing,
}

/// Streaming DiLoCo on one rank (see the module docs).
pub struct StreamingDiloco {
    cfg: StreamingConfig,
    outer: Outer,
    /// Each fragment's parameters (places in the optimizer's list), once the optimizer is known.
    fragments: Vec<Vec<usize>>,
    /// Each fragment's sync in flight.
    pending: Vec<Option<Pending>>,
    /// Inner steps taken since the run began.
    steps: u64,
}

impl StreamingDiloco {
    /// One rank's streaming DiLoCo of `cfg` (refused when [`StreamingConfig::validate`] refuses).
    pub fn new(cfg: StreamingConfig) -> Result<StreamingDiloco, PolicyError> {
        cfg.validate()?;
        Ok(StreamingDiloco {
            cfg,
            outer: Outer::new(cfg.diloco.outer),
            fragments: vec![],
            pending: (0..cfg.fragments).map(|_| None).collect(),
            steps: 0,
        })
    }

    /// Merges fragment `f`'s sync: waits for what is in flight, steps the snapshot, writes it.
    fn merge(&mut self, f: usize, step: &StepContext<'_>) -> brigade_ddp::Result<()> {
        let Some(pending) = self.pending[f].take() else {
            return Ok(());
        };
        let avg = match pending.average {
            Landing::InFlight(w) => w.wait()?,
            Landing::Landed(t) => t,
        };
        self.outer.merge_flat(&pending.ids, &avg)?;
        self.outer.round_into_model(&self.fragments[f], step)
    }

    /// Issues the average over the ranks of fragment `f`'s pseudo-gradients in one collective
    /// of one flat buffer, sent as [`StreamingConfig::outer_precision`] says; it lands in f32.
    fn issue(&self, f: usize, comm: &Group) -> brigade_ddp::Result<Landing> {
        let tag = format!("streaming-diloco.fragment{f}");
        let ids = &self.fragments[f];
        let work = match self.cfg.outer_precision {
            OuterPrecision::F32 => self.outer.issue(ids, comm, &tag)?,
            OuterPrecision::Bf16 => {
                let delta = self.outer.flat_delta(ids)?.to_dtype(DType::BF16)?;
                let avg = comm.all_reduce(&delta, ReduceOp::Avg, &tag);
                avg.then(|t| Ok(t.to_dtype(DType::F32)?))
            }
            OuterPrecision::Int8 => {
                let delta = self.outer.flat_delta(ids)?;
                let scale = fragment_scale(&delta)?;
                let world = comm.world_size() as f64;
                let q = delta.div(&scale)?.to_dtype(DType::I8)?;
                let gathered = comm.all_gather_with_side(&q, &scale, &tag);
                gathered.then(move |(q, s)| {
                    let sum = q.to_dtype(DType::F32)?.mul(&s)?.sum(&[0], false)?;
                    Ok(sum.mul_scalar(1.0 / world)?)
                })
            }
        };
        Ok(Landing::InFlight(work))
    }
}

/// One int8 scale for a fragment's flat pseudo-gradients: their largest magnitude over 127 (at
/// least 1e-30 / 127, so that an all-zero fragment sends zeros), shape `[1]`.
fn fragment_scale(delta: &Tensor) -> brigade_ddp::Result<Tensor> {
    Ok(delta
        .abs()?
        .amax(&[0], true)?
        .clamp(1e-30, f64::INFINITY)?
        .mul_scalar(1.0 / 127.0)?)
}

/// The tensors one after the other in one flat f32 tensor (a fragment's average as a checkpoint
/// lists it, a tensor per parameter, laid out as [`Outer::flat_delta`] lays out the parameters).
fn concat(parts: &[(usize, Tensor)]) -> brigade_ddp::Result<Tensor> {
    let total = parts.iter().map(|(_, t)| t.numel()).sum::<usize>();
    let on = parts.first().map(|(_, t)| t.device()).unwrap_or_default();
    let flat = Tensor::zeros_on(&[total], DType::F32, on)?;
    let mut offset = 0;
    for (_, t) in parts {
        let n = t.numel();
        flat.narrow(0, offset, n)?.copy_from(&t.reshape(&[n])?)?;
        offset += n;
    }
    Ok(flat)
}

/// `sizes` cut into `n` runs in order, each of about `total / n` elements and none empty.
pub(crate) fn split(sizes: &[usize], n: usize) -> Vec<Vec<usize>> {
    let total: usize = sizes.iter().sum();
    let mut out: Vec<Vec<usize>> = vec![vec![]; n];
    let (mut f, mut seen) = (0, 0usize);
    for (i, &s) in sizes.iter().enumerate() {
        // move on once this fragment holds its share, keeping a parameter for each one left
        let left = sizes.len() - i;
        if !out[f].is_empty() && f + 1 < n && (seen * n >= (f + 1) * total || left <= n - 1 - f) {
            f += 1;
        }
        out[f].push(i);
        seen += s;
    }
    out
}

impl ReducerPolicy for StreamingDiloco {
    fn name(&self) -> String {
        PolicySpec::StreamingDiloco(self.cfg).to_string()
    }

    fn reduce(&mut self, bucket: PolicyBucket, comm: &Group) -> brigade_ddp::Result<Reduction> {
        Ok(Reduction::Full(comm.ready(bucket.tensor)))
    }

    fn optimizer(
        &mut self,
        full: Box<dyn Optimizer>,
        _build: BuildOptimizer<'_>,
        _ctx: &OptimizerContext,
    ) -> brigade_ddp::Result<Box<dyn Optimizer>> {
        let name = self.name();
        self.outer.attach(full.as_ref(), &name)?;
        if self.outer.len() < self.cfg.fragments {
            return Err(DdpError::Policy {
                policy: name,
                reason: format!(
                    "{} fragments, but the optimizer steps {} parameters: at most that many fragments",
                    self.cfg.fragments,
                    self.outer.len()
                ),
            });
        }
        self.fragments = split(&self.outer.sizes(), self.cfg.fragments);
        let n = self.outer.len();
        let beyond = (self.pending.iter().flatten()).any(|p| p.ids.iter().any(|i| *i >= n));
        if beyond {
            return Err(DdpError::PolicyState(format!(
                "{name}: the checkpoint's fragment sync names a parameter beyond the optimizer's {n}"
            )));
        }
        let sizes = self.outer.sizes();
        let device = full.params()[0].value().device();
        for p in self.pending.iter_mut().flatten() {
            let Landing::Landed(t) = &p.average else { continue };
            let want: usize = p.ids.iter().map(|&i| sizes[i]).sum();
            if t.numel() != want {
                return Err(DdpError::PolicyState(format!(
                    "{name}: the checkpoint's fragment sync holds {} elements for parameters of {want}",
                    t.numel()
                )));
            }
            p.average = Landing::Landed(t.to_device(device)?);
        }
        Ok(full)
    }

    fn after_step(&mut self, step: &StepContext<'_>, comm: &Group) -> brigade_ddp::Result<()> {
        self.steps += 1;
        let c = self.steps;
        let h = self.cfg.diloco.period as u64;
        for f in 0..self.cfg.fragments {
            if self.pending[f].as_ref().is_some_and(|p| p.merge_at == c) {
                self.merge(f, step)?;
            }
            if c % h == self.cfg.offset(f) {
                let average = self.issue(f, comm)?;
                self.pending[f] = Some(Pending {
                    merge_at: c + self.cfg.delay as u64,
                    ids: self.fragments[f].clone(),
                    average,
                });
                if self.cfg.delay == 0 {
                    self.merge(f, step)?;
                }
            }
        }
        Ok(())
    }

    fn finish_in_flight(&mut self, timeout: Duration) -> brigade_ddp::Result<()> {
        let deadline = Instant::now() + timeout;
        for (f, pending) in self.pending.iter_mut().enumerate() {
            for landing in pending.iter_mut().map(|p| &mut p.average) {
                let Landing::InFlight(w) = landing else { continue };
                while !w.is_completed() {
                    if Instant::now() >= deadline {
                        return Err(DdpError::Policy {
                            policy: "streaming-diloco".into(),
                            reason: format!(
                                "fragment {f}'s sync did not land within {timeout:?} before the checkpoint"
                            ),
                        });
                    }
                    std::thread::sleep(Duration::from_micros(200));
                }
                let Landing::InFlight(w) =
                    std::mem::replace(landing, Landing::Landed(Tensor::from_vec(vec![0f32], &[1])?))
                else {
                    unreachable!("in flight")
                };
                *landing = Landing::Landed(w.wait()?);
            }
        }
        Ok(())
    }

    fn keeps_state(&self) -> KeepsState {
        KeepsState::InStateDict
    }

    fn replicas(&self) -> Replicas {
        Replicas::Diverge(RankState::ALL)
    }

    /// The step count, the snapshot, the outer momentum and each landed, unmerged fragment
    /// sync (`pending.F.merge_at`, `pending.F.I`); refused while a sync is in flight (the
    /// checkpoint finishes them first).
    fn state_dict(&self) -> brigade_ddp::Result<Vec<(String, Tensor)>> {
        let mut out = vec![("steps".to_string(), Tensor::from_vec(vec![self.steps as i64], &[1])?)];
        out.extend(self.outer.state_dict());
        for (f, p) in self.pending.iter().enumerate() {
            let Some(p) = p else { continue };
            out.push((
                format!("pending.{f}.merge_at"),
                Tensor::from_vec(vec![p.merge_at as i64], &[1])?,
            ));
            match &p.average {
                Landing::Landed(t) => {
                    for (i, avg) in self.outer.unflatten(&p.ids, t)? {
                        out.push((format!("pending.{f}.{i}"), avg.copy()?));
                    }
                }
                Landing::InFlight(_) => {
                    return Err(DdpError::PolicyState(format!(
                        "{}: fragment {f}'s sync is still in flight: finish_in_flight before state_dict",
                        self.name()
                    )))
                }
            }
        }
        Ok(out)
    }

    fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> brigade_ddp::Result<()> {
        let name = self.name();
        self.steps = read_steps(state, &name)?;
        self.outer.load_state_dict(state, &name)?;
        // each fragment's step to merge at and its parameters' averages, as the state lists them
        let mut pending: Vec<Option<(u64, Vec<(usize, Tensor)>)>> = (0..self.cfg.fragments).map(|_| None).collect();
        for (k, t) in state {
            let Some(rest) = k.strip_prefix("pending.") else {
                continue;
            };
            let parsed = rest
                .split_once('.')
                .and_then(|(f, what)| Some((f.parse::<usize>().ok()?, what)));
            let Some((f, what)) = parsed.filter(|(f, _)| *f < self.cfg.fragments) else {
                return Err(DdpError::PolicyState(format!(
                    "{name}: '{k}' names no fragment of {}",
                    self.cfg.fragments
                )));
            };
            let (merge_at, averages) = pending[f].get_or_insert_with(|| (0, vec![]));
            match what {
                "merge_at" => *merge_at = t.item()? as u64,
                i => {
                    let i = i.parse::<usize>().map_err(|_| {
                        DdpError::PolicyState(format!("{name}: '{k}' names no parameter of fragment {f}"))
                    })?;
                    averages.push((i, t.to_dtype(DType::F32)?));
                }
            }
        }
        let mut flat: Vec<Option<Pending>> = (0..self.cfg.fragments).map(|_| None).collect();
        for (slot, p) in flat.iter_mut().zip(pending) {
            let Some((merge_at, mut averages)) = p else { continue };
            if merge_at <= self.steps {
                return Err(DdpError::PolicyState(format!(
                    "{name}: a fragment sync merged after step {merge_at} in a state of step {}",
                    self.steps
                )));
            }
            averages.sort_by_key(|(i, _)| *i);
            *slot = Some(Pending {
                merge_at,
                ids: averages.iter().map(|(i, _)| *i).collect(),
                average: Landing::Landed(concat(&averages)?),
            });
        }
        self.pending = flat;
        Ok(())
    }

    fn memory(&self) -> PolicyMemory {
        let bytes = |t: &Tensor| t.numel() * t.dtype().size_in_bytes();
        let landed: usize = (self.pending.iter().flatten())
            .map(|p| match &p.average {
                Landing::Landed(t) => bytes(t),
                Landing::InFlight(_) => 0,
            })
            .sum();
        PolicyMemory {
            state_bytes: self.outer.state_bytes() + landed,
            ..PolicyMemory::default()
        }
    }

    fn wire_model(&self, _shapes: &[Vec<usize>], _world_size: usize) -> Option<WireModel> {
        Some(WireModel::Local)
    }

    fn diagnostics(&self) -> Vec<PolicyDiagnostic> {
        // fragment f is issued after the steps c with c % H == its offset: the first at its
        // offset, or at H for the fragment whose offset is 0
        let h = self.cfg.diloco.period as u64;
        let first = (0..self.cfg.fragments)
            .map(|f| Some(self.cfg.offset(f)).filter(|&o| o > 0).unwrap_or(h))
            .min()
            .unwrap_or(h);
        never_synced(&self.name(), self.steps, first)
    }

    fn after_step_wire(&self, shapes: &[Vec<usize>], _world_size: usize) -> Option<AfterStepWire> {
        // the fragments as cut (over the optimizer's parameters), else as they will be
        let sizes: Vec<usize> = if self.fragments.is_empty() {
            shapes.iter().map(|s| s.iter().product()).collect()
        } else {
            self.outer.sizes()
        };
        let fragments = if self.fragments.is_empty() {
            split(&sizes, self.cfg.fragments.min(sizes.len()).max(1))
        } else {
            self.fragments.clone()
        };
        let total = sizes.iter().sum::<usize>().max(1) as f64;
        // each fragment is sent in one collective of one flat buffer (`issue`)
        let parts = fragments
            .iter()
            .map(|ids| FragmentPart {
                share: ids.iter().map(|&i| sizes[i]).sum::<usize>() as f64 / total,
                collectives: 1,
            })
            .collect();
        Some(AfterStepWire {
            op: match self.cfg.outer_precision {
                OuterPrecision::Int8 => WireOp::AllGather,
                _ => WireOp::AllReduce,
            },
            bytes_per_element: self.cfg.outer_precision.bytes_per_element(),
            every: self.cfg.diloco.period,
            fragments: self.cfg.fragments,
            overlap_steps: self.cfg.delay,
            collectives: 1,
            parts,
        })
    }
}
