//! DiLoCo (Douillard et al. 2023, as torchft runs it): each rank's optimizer (the inner one)
//! takes H steps on its own gradients, no gradient crossing the ranks; after every H-th step the
//! pseudo-gradient, the last synced parameters (the snapshot) minus the rank's current ones, is
//! averaged over the ranks (in `after_step`, one all-reduce of one flat buffer holding every
//! parameter's, as torchft's DiLoCo all-reduces a fragment in buckets rather than a tensor at a
//! time: on a link of high latency the sync costs one latency, not one a parameter), an outer
//! Nesterov SGD steps the snapshot with it, and the stepped snapshot becomes every rank's
//! parameters. The inner optimizer's state stays each rank's own. The ranks diverge between syncs, so a
//! checkpoint keeps every rank's parameters and optimizer state ([`Replicas::Diverge`]), and the
//! snapshot, the outer momentum and the step count are the policy's state.
//!
//! With an SGD inner optimizer, H = 1, outer lr 1 and no outer momentum it is DDP's step up to
//! f32 rounding: the rank steps to `θ − ηg_r`, and the average of `θ − (θ − ηg_r)` is `η·mean g`
//! rounded to the grid of `θ`, not the product DDP's optimizer subtracts.

use std::cmp::Ordering;
use std::hash::{Hash, Hasher};

use brigade_autograd::{Optimizer, Var};
use brigade_comm::ReduceOp;
use brigade_ddp::policy::{AfterStepWire, WireModel, WireOp};
use brigade_ddp::policy::{
    BuildOptimizer, Group, OptimizerContext, PolicyBucket, PolicyDiagnostic, PolicyMemory, Reduction, StepContext,
    TensorWork,
};
use brigade_ddp::{DdpError, KeepsState, RankState, ReducerPolicy, Replicas};
use brigade_tensor::{DType, Tensor};

use crate::error::PolicyError;
use crate::spec::{compact, spec_error, PolicySpec};

/// The DiLoCo paper's outer learning rate.
pub const DEFAULT_OUTER_LR: f64 = 0.7;
/// The DiLoCo paper's outer Nesterov momentum (tuned for language models under AdamW with H in
/// the hundreds). Over an inner SGD with momentum 0.9 at H = 10 it overshoots: on a
/// 128-512-512-10 MLP at 2 ranks, 300 steps, the last 20 losses average 1.44 against 0.53 for
/// all-reduce, and 0.52 with outer momentum 0.3 (`diloco:10:0.7:0.3`); docs/BENCHMARKS.md
/// holds the sweep.
pub const DEFAULT_OUTER_MOMENTUM: f64 = 0.9;

/// The outer optimizer of DiLoCo and streaming DiLoCo: Nesterov SGD (PyTorch's, no dampening)
/// on the averaged pseudo-gradient.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OuterSgd {
    /// The outer learning rate (more than 0).
    pub lr: f64,
    /// The outer Nesterov momentum (0 to under 1; 0: plain SGD, no buffer kept).
    pub momentum: f64,
}

impl Default for OuterSgd {
    fn default() -> Self {
        OuterSgd {
            lr: DEFAULT_OUTER_LR,
            momentum: DEFAULT_OUTER_MOMENTUM,
        }
    }
}

impl OuterSgd {
    fn key(&self) -> (u64, u64) {
        (self.lr.to_bits(), self.momentum.to_bits())
    }

    /// Refuses a learning rate that is not a positive finite number and a momentum outside
    /// `[0, 1)`.
    pub fn validate(&self, policy: &str) -> Result<(), PolicyError> {
        let bad = |reason: String| PolicyError::Config {
            policy: policy.into(),
            reason,
        };
        if !(self.lr > 0.0 && self.lr.is_finite()) {
            return Err(bad(format!(
                "the outer learning rate must be more than 0, got {}",
                self.lr
            )));
        }
        if !(0.0..1.0).contains(&self.momentum) {
            return Err(bad(format!(
                "the outer momentum must be at least 0 and under 1, got {}",
                self.momentum
            )));
        }
        Ok(())
    }

    /// `:LR[:MOMENTUM]` as a spec writes it: nothing at the defaults.
    pub(crate) fn write(&self) -> String {
        if *self == OuterSgd::default() {
            String::new()
        } else if self.momentum == DEFAULT_OUTER_MOMENTUM {
            format!(":{}", compact(self.lr))
        } else {
            format!(":{}:{}", compact(self.lr), compact(self.momentum))
        }
    }

    /// The outer optimizer from `[LR[, MOMENTUM]]` (`spec` is the whole spec, for the error).
    pub(crate) fn read(spec: &str, fields: &[&str]) -> Result<OuterSgd, PolicyError> {
        let number = |what: &str, s: &str| {
            s.parse::<f64>()
                .map_err(|_| spec_error(spec, format!("the outer {what} must be a number, got '{s}'")))
        };
        let mut outer = OuterSgd::default();
        match fields {
            [] => {}
            [lr] => outer.lr = number("learning rate", lr)?,
            [lr, m] => (outer.lr, outer.momentum) = (number("learning rate", lr)?, number("momentum", m)?),
            _ => return Err(spec_error(spec, "too many fields")),
        }
        // one zero (-0 and 0 are one momentum)
        outer.momentum += 0.0;
        outer.validate(spec)?;
        Ok(outer)
    }
}

/// `diloco:H[:OUTER_LR[:MOMENTUM]]`: the inner steps between syncs and the outer optimizer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DilocoConfig {
    /// Inner steps between syncs (H, at least 1).
    pub period: usize,
    /// The outer optimizer.
    pub outer: OuterSgd,
}

impl DilocoConfig {
    /// H inner steps between syncs, the paper's outer optimizer (lr 0.7, Nesterov 0.9).
    pub fn new(period: usize) -> DilocoConfig {
        DilocoConfig {
            period,
            outer: OuterSgd::default(),
        }
    }

    fn key(&self) -> (usize, (u64, u64)) {
        (self.period, self.outer.key())
    }

    /// Refuses a period of 0 and a bad outer optimizer.
    pub fn validate(&self) -> Result<(), PolicyError> {
        if self.period == 0 {
            return Err(PolicyError::Config {
                policy: "diloco".into(),
                reason: "the period H must be at least 1 inner step".into(),
            });
        }
        self.outer.validate("diloco")
    }
}

impl Eq for DilocoConfig {}

impl Hash for DilocoConfig {
    fn hash<S: Hasher>(&self, state: &mut S) {
        self.key().hash(state)
    }
}

impl PartialOrd for DilocoConfig {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for DilocoConfig {
    fn cmp(&self, other: &Self) -> Ordering {
        self.key().cmp(&other.key())
    }
}

/// The spec of `diloco:ARGS`.
pub(crate) fn read_spec(spec: &str, arg: Option<&str>) -> Result<PolicySpec, PolicyError> {
    let arg = arg.ok_or_else(|| spec_error(spec, "DiLoCo needs its period: diloco:H[:OUTER_LR[:MOMENTUM]]"))?;
    let fields: Vec<&str> = arg.split(':').collect();
    let period = whole(spec, "DiLoCo's period H", fields[0])?;
    let cfg = DilocoConfig {
        period,
        outer: OuterSgd::read(spec, &fields[1..])?,
    };
    Ok(PolicySpec::Diloco(cfg))
}

/// A whole number of at least 1 from a spec's field.
pub(crate) fn whole(spec: &str, what: &str, s: &str) -> Result<usize, PolicyError> {
    s.parse()
        .ok()
        .filter(|&n: &usize| n > 0)
        .ok_or_else(|| spec_error(spec, format!("{what} must be a whole number >= 1, got '{s}'")))
}

/// `H[:OUTER_LR[:MOMENTUM]]` of a DiLoCo spec.
pub(crate) fn write_spec(spec: &PolicySpec) -> Option<String> {
    match spec {
        PolicySpec::Diloco(c) => Some(format!("{}{}", c.period, c.outer.write())),
        _ => None,
    }
}

/// A plan groups DiLoCo by its whole spec (every setting changes what a step measures).
pub(crate) fn family(spec: &PolicySpec) -> PolicySpec {
    spec.clone()
}

/// What a plan tries when no profile recorded it.
pub(crate) fn plan_default() -> PolicySpec {
    PolicySpec::Diloco(DilocoConfig::new(10))
}

/// One rank's DiLoCo of `spec`.
pub(crate) fn build_spec(spec: &PolicySpec) -> Result<Box<dyn ReducerPolicy>, PolicyError> {
    let PolicySpec::Diloco(cfg) = *spec else {
        unreachable!("the diloco entry builds DiLoCo specs")
    };
    Ok(Box::new(Diloco::new(cfg)?))
}

/// The outer side both DiLoCos share: the parameters the inner optimizer steps, the snapshot of
/// their last synced values, the outer momentum, and the step that syncs a group of them.
#[derive(Default)]
pub(crate) struct Outer {
    sgd: OuterSgd,
    /// What the inner optimizer steps (the f32 masters beside 16-bit parameters).
    params: Vec<Var>,
    /// The parameters as last synced (every rank's alike).
    snapshot: Vec<Tensor>,
    /// The outer Nesterov buffer per parameter, once it stepped (never under no momentum).
    momentum: Vec<Option<Tensor>>,
}

impl Outer {
    pub(crate) fn new(sgd: OuterSgd) -> Outer {
        Outer {
            sgd,
            ..Outer::default()
        }
    }

    /// Learns the inner optimizer's parameters: the snapshot is their values now (after DDP's
    /// broadcast), unless a checkpoint's state was loaded, which must be of as many parameters
    /// of the same sizes.
    pub(crate) fn attach(&mut self, opt: &dyn Optimizer, policy: &str) -> brigade_ddp::Result<()> {
        let params = opt.params().to_vec();
        if params.is_empty() {
            return Err(DdpError::Policy {
                policy: policy.into(),
                reason: "the optimizer lists no parameters (Optimizer::params), and DiLoCo steps them between syncs"
                    .into(),
            });
        }
        if self.snapshot.is_empty() {
            self.snapshot = params.iter().map(|p| p.value().copy()).collect::<Result<_, _>>()?;
            self.momentum = vec![None; params.len()];
        } else {
            let sizes = |v: &mut dyn Iterator<Item = usize>| v.collect::<Vec<usize>>();
            let mine = sizes(&mut params.iter().map(|p| p.value().numel()));
            let saved = sizes(&mut self.snapshot.iter().map(Tensor::numel));
            if mine != saved {
                return Err(DdpError::PolicyState(format!(
                    "{policy}: the checkpoint's snapshot holds parameters of {saved:?} elements, the optimizer steps {mine:?}"
                )));
            }
            let device = params[0].value().device();
            self.snapshot = (self.snapshot.iter())
                .zip(&params)
                .map(|(t, p)| t.to_device(device)?.reshape(&p.shape()))
                .collect::<Result<_, _>>()?;
            self.momentum = (self.momentum.iter())
                .zip(&params)
                .map(|(m, p)| m.as_ref().map(|t| t.to_device(device)?.reshape(&p.shape())).transpose())
                .collect::<Result<_, _>>()?;
        }
        self.params = params;
        Ok(())
    }

    pub(crate) fn len(&self) -> usize {
        self.params.len()
    }

    /// Element counts of the parameters, in the optimizer's order.
    pub(crate) fn sizes(&self) -> Vec<usize> {
        self.snapshot.iter().map(Tensor::numel).collect()
    }

    /// Issues the average over the ranks of the pseudo-gradients of parameters `ids` (snapshot
    /// minus this rank's values), all-reduced in one collective of one flat f32 buffer (the
    /// parameters in `ids`' order, as [`Outer::flat_delta`] lays them out).
    pub(crate) fn issue(&self, ids: &[usize], comm: &Group, tag: &str) -> brigade_ddp::Result<TensorWork<Tensor>> {
        let delta = self.flat_delta(ids)?;
        Ok(comm.all_reduce(&delta, ReduceOp::Avg, tag))
    }

    /// The pseudo-gradients of parameters `ids` on this rank, one after the other in one flat
    /// f32 tensor (parameter `ids[k]` at the elements after those of `ids[..k]`).
    pub(crate) fn flat_delta(&self, ids: &[usize]) -> brigade_ddp::Result<Tensor> {
        let total = ids.iter().map(|&i| self.snapshot[i].numel()).sum::<usize>();
        let on = self.snapshot.first().map(|t| t.device()).unwrap_or_default();
        let flat = Tensor::zeros_on(&[total], DType::F32, on)?;
        let mut offset = 0;
        for &i in ids {
            let n = self.snapshot[i].numel();
            flat.narrow(0, offset, n)?.copy_from(&self.delta(i)?.reshape(&[n])?)?;
            offset += n;
        }
        Ok(flat)
    }

    /// Parameter `ids[k]`'s part of a flat buffer laid out as [`Outer::flat_delta`] lays out
    /// `ids`, in the parameter's shape, for each `k` (views of `flat`).
    pub(crate) fn unflatten(&self, ids: &[usize], flat: &Tensor) -> brigade_ddp::Result<Vec<(usize, Tensor)>> {
        let total = ids.iter().map(|&i| self.snapshot[i].numel()).sum::<usize>();
        if flat.numel() != total {
            return Err(DdpError::PolicyState(format!(
                "an outer average of {} elements for parameters of {total}",
                flat.numel()
            )));
        }
        let flat = flat.reshape(&[total])?;
        let mut offset = 0;
        let mut out = Vec::with_capacity(ids.len());
        for &i in ids {
            let n = self.snapshot[i].numel();
            out.push((i, flat.narrow(0, offset, n)?.reshape(self.snapshot[i].shape())?));
            offset += n;
        }
        Ok(out)
    }

    /// Merges the averaged pseudo-gradients of parameters `ids`, one flat buffer laid out as
    /// [`Outer::flat_delta`] lays out `ids` (see [`Outer::merge`]).
    pub(crate) fn merge_flat(&mut self, ids: &[usize], flat: &Tensor) -> brigade_ddp::Result<()> {
        for (i, avg) in self.unflatten(ids, flat)? {
            self.merge(i, &avg)?;
        }
        Ok(())
    }

    /// Parameter `i`'s pseudo-gradient on this rank: its snapshot minus its value (f32).
    pub(crate) fn delta(&self, i: usize) -> brigade_ddp::Result<Tensor> {
        Ok(self.snapshot[i].sub(&self.params[i].value())?)
    }

    /// Steps parameter `i`'s snapshot with its averaged pseudo-gradient `avg` (Nesterov: `b ←
    /// μb + avg`, `snapshot ← snapshot − lr(avg + μb)`) and makes it the parameter's value.
    pub(crate) fn merge(&mut self, i: usize, avg: &Tensor) -> brigade_ddp::Result<()> {
        let OuterSgd { lr, momentum } = self.sgd;
        let update = if momentum > 0.0 {
            let b = match self.momentum[i].take() {
                Some(b) => {
                    let b = b.mul_scalar(momentum)?;
                    b.add_assign(avg)?;
                    b
                }
                None => avg.copy()?,
            };
            let u = avg.copy()?;
            u.add_scaled_assign(&b, momentum)?;
            self.momentum[i] = Some(b);
            u
        } else {
            avg.clone()
        };
        self.snapshot[i].add_scaled_assign(&update, -lr)?;
        self.params[i].value().copy_from(&self.snapshot[i])?;
        Ok(())
    }

    /// Writes the merged parameters `indices` into the registered parameters the model computes
    /// with when the optimizer steps f32 masters beside them (their rounding, as the optimizer
    /// writes it after a step).
    pub(crate) fn round_into_model(&self, indices: &[usize], step: &StepContext<'_>) -> brigade_ddp::Result<()> {
        let model: Vec<&Var> = step.params.iter().filter(|p| p.requires_grad()).collect();
        for &i in indices {
            let p = &self.params[i];
            let Some(m) = model.get(i) else {
                return Err(DdpError::Policy {
                    policy: "diloco".into(),
                    reason: format!(
                        "the optimizer steps {} parameters, the model trains {}",
                        self.params.len(),
                        model.len()
                    ),
                });
            };
            if !m.same(p) {
                let v = m.value();
                v.copy_from(&p.value().to_dtype(v.dtype())?)?;
            }
        }
        Ok(())
    }

    /// The snapshot and the outer momentum, by the parameter's place in the optimizer's list.
    pub(crate) fn state_dict(&self) -> Vec<(String, Tensor)> {
        let mut out: Vec<(String, Tensor)> = (self.snapshot.iter().enumerate())
            .map(|(i, t)| (format!("snapshot.{i}"), t.clone()))
            .collect();
        for (i, m) in self.momentum.iter().enumerate() {
            if let Some(m) = m {
                out.push((format!("outer_momentum.{i}"), m.clone()));
            }
        }
        out
    }

    /// Restores [`Outer::state_dict`]'s entries (the others are the caller's).
    pub(crate) fn load_state_dict(&mut self, state: &[(String, Tensor)], policy: &str) -> brigade_ddp::Result<()> {
        let index = |k: &str, prefix: &str| k.strip_prefix(prefix).and_then(|i| i.parse::<usize>().ok());
        let mut snapshot: Vec<(usize, Tensor)> = (state.iter())
            .filter_map(|(k, t)| Some((index(k, "snapshot.")?, t.clone())))
            .collect();
        snapshot.sort_by_key(|(i, _)| *i);
        if snapshot.iter().enumerate().any(|(j, (i, _))| j != *i) || snapshot.is_empty() {
            return Err(DdpError::PolicyState(format!(
                "{policy}: the state holds no whole snapshot of the parameters (snapshot.0, snapshot.1, ...)"
            )));
        }
        let mut momentum = vec![None; snapshot.len()];
        for (k, t) in state {
            if let Some(i) = index(k, "outer_momentum.") {
                let slot = momentum.get_mut(i).ok_or_else(|| {
                    DdpError::PolicyState(format!("{policy}: '{k}' names no parameter of the snapshot"))
                })?;
                *slot = Some(t.to_dtype(DType::F32)?);
            }
        }
        self.snapshot = snapshot.into_iter().map(|(_, t)| t).collect();
        self.momentum = momentum;
        Ok(())
    }

    /// Bytes of the snapshot and the momentum.
    pub(crate) fn state_bytes(&self) -> usize {
        let bytes = |t: &Tensor| t.numel() * t.dtype().size_in_bytes();
        self.snapshot.iter().map(bytes).sum::<usize>() + self.momentum.iter().flatten().map(bytes).sum::<usize>()
    }
}

/// The step count a DiLoCo state holds.
/// The note of a run of `policy` that took `steps` inner steps, all before its first sync (after
/// `first` steps): none when it took none or synced.
pub(crate) fn never_synced(policy: &str, steps: u64, first: u64) -> Vec<PolicyDiagnostic> {
    if steps == 0 || steps >= first {
        return vec![];
    }
    vec![PolicyDiagnostic {
        code: "never-synced",
        message: format!(
            "{policy} never synced in {steps} steps (its first sync comes after {first}): every rank trained on its \
             own gradients alone, and a prediction prices the sync from its wire model, with no measured sync to \
             check it against"
        ),
    }]
}

pub(crate) fn read_steps(state: &[(String, Tensor)], policy: &str) -> brigade_ddp::Result<u64> {
    let steps = state.iter().find(|(k, _)| k == "steps").map(|(_, t)| t);
    let steps = steps.ok_or_else(|| DdpError::PolicyState(format!("{policy}: no 'steps' in its state")))?;
    Ok(steps.item()? as u64)
}

/// DiLoCo on one rank (see the module docs).
pub struct Diloco {
    cfg: DilocoConfig,
    outer: Outer,
    /// Inner steps taken since the run began.
    steps: u64,
}

impl Diloco {
    /// One rank's DiLoCo of `cfg` (refused when [`DilocoConfig::validate`] refuses it).
    pub fn new(cfg: DilocoConfig) -> Result<Diloco, PolicyError> {
        cfg.validate()?;
        Ok(Diloco {
            cfg,
            outer: Outer::new(cfg.outer),
            steps: 0,
        })
    }
}

impl ReducerPolicy for Diloco {
    fn name(&self) -> String {
        PolicySpec::Diloco(self.cfg).to_string()
    }

    fn reduce(&mut self, bucket: PolicyBucket, comm: &Group) -> brigade_ddp::Result<Reduction> {
        // the rank's own gradients, untouched: the inner optimizer steps on them alone
        Ok(Reduction::Full(comm.ready(bucket.tensor)))
    }

    fn optimizer(
        &mut self,
        full: Box<dyn Optimizer>,
        _build: BuildOptimizer<'_>,
        _ctx: &OptimizerContext,
    ) -> brigade_ddp::Result<Box<dyn Optimizer>> {
        self.outer.attach(full.as_ref(), &self.name())?;
        Ok(full)
    }

    #[allow(clippy::manual_is_multiple_of)] // `is_multiple_of` is newer than the workspace MSRV
    fn after_step(&mut self, step: &StepContext<'_>, comm: &Group) -> brigade_ddp::Result<()> {
        self.steps += 1;
        if self.steps % self.cfg.period as u64 != 0 {
            return Ok(());
        }
        let all: Vec<usize> = (0..self.outer.len()).collect();
        let avg = self.outer.issue(&all, comm, "diloco")?.wait()?;
        self.outer.merge_flat(&all, &avg)?;
        self.outer.round_into_model(&all, step)
    }

    fn keeps_state(&self) -> KeepsState {
        KeepsState::InStateDict
    }

    fn replicas(&self) -> Replicas {
        Replicas::Diverge(RankState::ALL)
    }

    fn state_dict(&self) -> brigade_ddp::Result<Vec<(String, Tensor)>> {
        let mut out = vec![("steps".to_string(), Tensor::from_vec(vec![self.steps as i64], &[1])?)];
        out.extend(self.outer.state_dict());
        Ok(out)
    }

    fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> brigade_ddp::Result<()> {
        let name = self.name();
        self.steps = read_steps(state, &name)?;
        self.outer.load_state_dict(state, &name)
    }

    fn memory(&self) -> PolicyMemory {
        PolicyMemory {
            state_bytes: self.outer.state_bytes(),
            ..PolicyMemory::default()
        }
    }

    fn wire_model(&self, _shapes: &[Vec<usize>], _world_size: usize) -> Option<WireModel> {
        Some(WireModel::Local)
    }

    fn diagnostics(&self) -> Vec<PolicyDiagnostic> {
        never_synced(&self.name(), self.steps, self.cfg.period as u64)
    }

    fn after_step_wire(&self, _shapes: &[Vec<usize>], _world_size: usize) -> Option<AfterStepWire> {
        Some(AfterStepWire {
            op: WireOp::AllReduce,
            bytes_per_element: 4.0,
            every: self.cfg.period,
            fragments: 1,
            overlap_steps: 0,
            // one all-reduce of every parameter in one flat buffer (`Outer::issue`)
            collectives: 1,
            parts: vec![],
        })
    }
}
