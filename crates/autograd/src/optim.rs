//! Optimizers with PyTorch's semantics: SGD (momentum, weight decay) and AdamW.
//!
//! Both update parameters in place, skip parameters without a gradient, and expose
//! their state as named tensors so that checkpoints can save and restore it exactly.

use brigade_tensor::{AdamWStep, DType, SgdStep, Tensor};

use crate::{AutogradError, Result, Var};

/// One optimizer over a fixed list of parameters.
pub trait Optimizer: Send {
    /// Applies one update from the parameters' current gradients.
    fn step(&mut self) -> Result<()>;
    /// The parameters this optimizer steps, in its order: what a reducer policy snapshots or
    /// averages between syncs (DiLoCo's outer step) without browsing the model. An optimizer
    /// stepping f32 masters beside 16-bit parameters ([`crate::MasterWeights`]) lists the
    /// masters; one wrapping another lists the inner one's. The default is empty: an
    /// optimizer that keeps no list of its own says so by listing nothing.
    fn params(&self) -> &[Var] {
        &[]
    }
    /// The learning rate.
    fn lr(&self) -> f64;
    /// Changes the learning rate (schedules).
    fn set_lr(&mut self, lr: f64);
    /// The state as `(name, tensor)` pairs (`step` is stored as a 1-element f64 tensor).
    fn state_dict(&self) -> Result<Vec<(String, Tensor)>>;
    /// Restores state produced by [`Optimizer::state_dict`] for the same parameters.
    fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> Result<()>;
    /// The state entries this optimizer left in a file ([`crate::StateInFile`]: a resume under
    /// a policy that keeps each rank's shard of the state): such a policy reads its ranges of
    /// them and nothing more, where [`Optimizer::state_dict`] reads them whole. Empty by
    /// default.
    fn state_in_file(&self) -> &[crate::StoredState] {
        &[]
    }
    /// Bytes of state this optimizer holds live (memory reports). The default measures a copy
    /// of [`Optimizer::state_dict`]; the built-in optimizers measure their own tensors.
    fn state_bytes(&self) -> Result<usize> {
        Ok(self.state_dict()?.iter().map(|(_, t)| tensor_bytes(t)).sum())
    }
    /// Collective for optimizers whose state is sharded over ranks (ZeRO): every rank calls it
    /// before rank 0 calls [`Optimizer::state_dict`] for a checkpoint, so that rank 0 holds every
    /// shard's state (PyTorch's `ZeroRedundancyOptimizer.consolidate_state_dict`). A no-op for
    /// optimizers that hold all of their state.
    fn consolidate_state(&mut self) -> Result<()> {
        Ok(())
    }
    /// The f32 master weights by parameter name when the optimizer steps masters beside
    /// 16-bit parameters ([`crate::MasterWeights`]): what a checkpoint saves as the model.
    /// Empty for optimizers that step the parameters themselves.
    fn master_weights(&self) -> Vec<(String, Tensor)> {
        vec![]
    }
    /// Bytes of f32 master weights this optimizer holds live (memory reports): by default
    /// those of [`Optimizer::master_weights`]; a sharded optimizer counts its own shards.
    fn master_weight_bytes(&self) -> usize {
        self.master_weights().iter().map(|(_, t)| tensor_bytes(t)).sum()
    }
    /// The factor the loss is multiplied by before backward under dynamic loss scaling (fp16:
    /// [`crate::GradScaler`]); the gradients the optimizer is handed are then that many times
    /// too large, and it unscales them. `None`: no scaling.
    fn loss_scale(&self) -> Option<f64> {
        None
    }
    /// Steps skipped so far because the scaled gradients were not finite (loss scaling).
    fn skipped_steps(&self) -> u64 {
        0
    }
    /// The dynamic loss scaler this optimizer keeps (fp16), as it stands: what a sharded
    /// optimizer built from this one takes over. `None`: no scaling.
    fn grad_scaler(&self) -> Option<crate::GradScaler> {
        None
    }
    /// One step from `grads` (f32, or the copies' 16-bit dtype) in place of the parameters'
    /// own gradients, writing each updated parameter, rounded to nearest even, into `copies[i]`
    /// in the same pass over memory: how [`crate::MasterWeights`] steps f32 masters beside
    /// their 16-bit compute copy. `Ok(false)`: this optimizer does not fuse the copy and did
    /// nothing (the caller then widens, steps and rounds in separate passes).
    fn step_with_copies(&mut self, grads: &[Option<Tensor>], copies: &[Tensor]) -> Result<bool> {
        let _ = (grads, copies);
        Ok(false)
    }
}

/// The gradients and copies of [`Optimizer::step_with_copies`]: one of each per parameter.
fn check_copies(n: usize, grads: &[Option<Tensor>], copies: &[Tensor]) -> Result<()> {
    if grads.len() != n || copies.len() != n {
        return Err(AutogradError::Invalid(format!(
            "a step with copies takes one gradient and one copy per parameter: {n} parameters, {} gradients, {} copies",
            grads.len(),
            copies.len()
        )));
    }
    Ok(())
}

/// Bytes of the elements of `t`'s whole storage (what it holds live, not just the view).
fn tensor_bytes(t: &Tensor) -> usize {
    t.storage_numel() * t.dtype().size_in_bytes()
}

fn name_of(p: &Var, i: usize) -> String {
    p.name().map(str::to_string).unwrap_or_else(|| format!("param{i}"))
}

fn find<'a>(state: &'a [(String, Tensor)], key: &str) -> Result<&'a Tensor> {
    state
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, t)| t)
        .ok_or_else(|| AutogradError::OptimizerState(format!("missing entry '{key}'")))
}

/// An f32 copy of the state entry `t` named `key`, which must have `shape`.
fn loaded_as(shape: &[usize], t: &Tensor, key: &str) -> Result<Tensor> {
    if t.shape() != shape {
        return Err(AutogradError::OptimizerState(format!(
            "'{key}' has shape {:?}, expected {:?}",
            t.shape(),
            shape
        )));
    }
    Ok(t.to_dtype(DType::F32)?.copy()?)
}

/// Stochastic gradient descent: `g += wd * p; buf = momentum * buf + g; p -= lr * buf`
/// (the first step sets `buf = g`), as `torch.optim.SGD` with dampening 0.
pub struct Sgd {
    params: Vec<Var>,
    lr: f64,
    momentum: f64,
    weight_decay: f64,
    bufs: Vec<Option<Tensor>>,
}

impl Sgd {
    /// SGD over `params`.
    pub fn new(params: Vec<Var>, lr: f64, momentum: f64, weight_decay: f64) -> Self {
        let bufs = vec![None; params.len()];
        Sgd {
            params,
            lr,
            momentum,
            weight_decay,
            bufs,
        }
    }
}

impl Sgd {
    /// One update of every parameter that has a gradient (`grads[i]`, else its own),
    /// rounded into `copies[i]` too when copies are given.
    fn update(&mut self, grads: Option<&[Option<Tensor>]>, copies: Option<&[Tensor]>) -> Result<()> {
        let with_momentum = self.momentum as f32 != 0.0;
        for (i, p) in self.params.iter().enumerate() {
            let g = match grads {
                Some(gs) => gs[i].clone(),
                None => p.grad(),
            };
            let Some(g) = g else { continue };
            let w = p.value();
            let is_first_step = with_momentum && self.bufs[i].is_none();
            if is_first_step {
                self.bufs[i] = Some(w.zeros_like()?);
            }
            let buf = if with_momentum { self.bufs[i].as_ref() } else { None };
            let hp = SgdStep {
                lr: self.lr,
                momentum: self.momentum,
                weight_decay: self.weight_decay,
                is_first_step,
            };
            match copies {
                Some(c) => w.sgd_step_with_copy(&g.contiguous()?, buf, hp, &c[i])?,
                None => w.sgd_step(&g.to_dtype(DType::F32)?, buf, hp)?,
            }
        }
        Ok(())
    }
}

impl Optimizer for Sgd {
    fn params(&self) -> &[Var] {
        &self.params
    }

    fn step(&mut self) -> Result<()> {
        self.update(None, None)
    }

    fn step_with_copies(&mut self, grads: &[Option<Tensor>], copies: &[Tensor]) -> Result<bool> {
        check_copies(self.params.len(), grads, copies)?;
        self.update(Some(grads), Some(copies))?;
        Ok(true)
    }

    fn lr(&self) -> f64 {
        self.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }

    fn state_dict(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = vec![];
        for (i, (p, b)) in self.params.iter().zip(&self.bufs).enumerate() {
            if let Some(b) = b {
                out.push((format!("{}.momentum_buffer", name_of(p, i)), b.copy()?));
            }
        }
        Ok(out)
    }

    fn state_bytes(&self) -> Result<usize> {
        Ok(self.bufs.iter().flatten().map(tensor_bytes).sum())
    }

    fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> Result<()> {
        for (i, p) in self.params.iter().enumerate() {
            let key = format!("{}.momentum_buffer", name_of(p, i));
            self.bufs[i] = match find(state, &key) {
                Ok(t) => Some(loaded_as(&p.shape(), t, &key)?),
                Err(_) => None,
            };
        }
        Ok(())
    }
}

/// AdamW (`torch.optim.AdamW`): decoupled weight decay `p *= 1 - lr*wd`, then Adam with
/// bias correction. Defaults ([`AdamW::DEFAULT_BETAS`], ...): PyTorch's.
///
/// A parameter's moments are made (zeros) at its first update or when a state holding them is
/// loaded, as PyTorch's are: an optimizer that never steps a parameter (the whole-model one a
/// sharding policy takes its shards' state from) holds no bytes for it, and its state lists no
/// entry for it.
pub struct AdamW {
    params: Vec<Var>,
    lr: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
    step: u64,
    m: Vec<Option<Tensor>>,
    v: Vec<Option<Tensor>>,
}

impl AdamW {
    /// PyTorch's default `betas` (decay of the first and second moment estimates).
    pub const DEFAULT_BETAS: (f64, f64) = (0.9, 0.999);
    /// PyTorch's default `eps` (added to the denominator for stability).
    pub const DEFAULT_EPS: f64 = 1e-8;
    /// PyTorch's default decoupled weight decay.
    pub const DEFAULT_WEIGHT_DECAY: f64 = 0.01;

    /// AdamW over `params` with PyTorch's defaults for everything but the learning rate.
    pub fn new(params: Vec<Var>, lr: f64) -> Self {
        Self::with_options(
            params,
            lr,
            Self::DEFAULT_BETAS,
            Self::DEFAULT_EPS,
            Self::DEFAULT_WEIGHT_DECAY,
        )
    }

    /// AdamW with every hyper-parameter given.
    pub fn with_options(params: Vec<Var>, lr: f64, betas: (f64, f64), eps: f64, weight_decay: f64) -> Self {
        let (m, v) = (vec![None; params.len()], vec![None; params.len()]);
        AdamW {
            params,
            lr,
            beta1: betas.0,
            beta2: betas.1,
            eps,
            weight_decay,
            step: 0,
            m,
            v,
        }
    }
}

impl AdamW {
    /// One update of every parameter that has a gradient (`grads[i]`, else its own),
    /// rounded into `copies[i]` too when copies are given.
    fn update(&mut self, grads: Option<&[Option<Tensor>]>, copies: Option<&[Tensor]>) -> Result<()> {
        self.step += 1;
        let hp = AdamWStep {
            lr: self.lr,
            betas: (self.beta1, self.beta2),
            eps: self.eps,
            weight_decay: self.weight_decay,
            step: self.step,
        };
        for (i, p) in self.params.iter().enumerate() {
            let g = match grads {
                Some(gs) => gs[i].clone(),
                None => p.grad(),
            };
            let Some(g) = g else { continue };
            let g = g.contiguous()?;
            let w = p.value();
            for moment in [&mut self.m[i], &mut self.v[i]] {
                if moment.is_none() {
                    *moment = Some(Tensor::zeros_on(&w.shape(), DType::F32, w.device())?);
                }
            }
            let (m, v) = (self.m[i].as_ref().expect("made"), self.v[i].as_ref().expect("made"));
            match copies {
                Some(c) => w.adamw_step_with_copy(&g, m, v, &hp, &c[i])?,
                None => w.adamw_step(&g, m, v, &hp)?,
            }
        }
        Ok(())
    }
}

impl Optimizer for AdamW {
    fn params(&self) -> &[Var] {
        &self.params
    }

    fn step(&mut self) -> Result<()> {
        self.update(None, None)
    }

    fn step_with_copies(&mut self, grads: &[Option<Tensor>], copies: &[Tensor]) -> Result<bool> {
        check_copies(self.params.len(), grads, copies)?;
        self.update(Some(grads), Some(copies))?;
        Ok(true)
    }

    fn lr(&self) -> f64 {
        self.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }

    fn state_dict(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = vec![("step".to_string(), Tensor::from_vec(vec![self.step as f64], &[1])?)];
        for (i, p) in self.params.iter().enumerate() {
            let n = name_of(p, i);
            if let (Some(m), Some(v)) = (&self.m[i], &self.v[i]) {
                out.push((format!("{n}.exp_avg"), m.copy()?));
                out.push((format!("{n}.exp_avg_sq"), v.copy()?));
            }
        }
        Ok(out)
    }

    fn state_bytes(&self) -> Result<usize> {
        Ok(self.m.iter().chain(&self.v).flatten().map(tensor_bytes).sum())
    }

    /// Restores the step and each parameter's moments; a parameter without entries keeps none
    /// (it was never updated), which only a state of no step may say of a parameter.
    fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> Result<()> {
        let step = find(state, "step")?.item()? as u64;
        let mut loaded = vec![];
        for (i, p) in self.params.iter().enumerate() {
            let n = name_of(p, i);
            let (km, kv) = (format!("{n}.exp_avg"), format!("{n}.exp_avg_sq"));
            let (m, v) = match (find(state, &km), find(state, &kv)) {
                (Ok(m), Ok(v)) => (m, v),
                (Err(_), Err(_)) if step == 0 => {
                    loaded.push((None, None));
                    continue;
                }
                (Err(e), _) | (_, Err(e)) => return Err(e),
            };
            loaded.push((
                Some(loaded_as(&p.shape(), m, &km)?),
                Some(loaded_as(&p.shape(), v, &kv)?),
            ));
        }
        self.step = step;
        (self.m, self.v) = loaded.into_iter().unzip();
        Ok(())
    }
}
