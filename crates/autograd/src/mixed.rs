//! Mixed precision: the dtypes of a run ([`MixedPrecision`], FSDP2's `MixedPrecisionPolicy`),
//! and the f32 master weights an optimizer steps beside 16-bit parameters ([`MasterWeights`],
//! as llm.c and PyTorch's AMP recipes keep them).
//!
//! The parameters the model reads (the compute copy) are in `param_dtype`; the optimizer steps
//! f32 masters (its moments f32 too) from the gradients widened to f32, and each step writes
//! the masters, rounded to `param_dtype`, back into the compute copy in place.

use brigade_tensor::{DType, Tensor};

use crate::scaler::GradScaler;
use crate::{AutogradError, Optimizer, ParamStore, Result, Var};

/// The dtypes of a mixed-precision run: parameters and activations (`param_dtype`), the
/// gradient buckets reduced over the ranks (`reduce_dtype`), and the model's outputs
/// (`output_dtype`: the loss is computed in f32 whatever it says, as autocast does).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MixedPrecision {
    /// The compute copy of the parameters, the activations and the GEMMs.
    pub param_dtype: DType,
    /// The gradient buckets and the collectives that reduce them.
    pub reduce_dtype: DType,
    /// The logits the model returns.
    pub output_dtype: DType,
}

impl MixedPrecision {
    /// Everything in `dtype` (f32: full precision, no master copy).
    pub fn uniform(dtype: DType) -> MixedPrecision {
        MixedPrecision {
            param_dtype: dtype,
            reduce_dtype: dtype,
            output_dtype: dtype,
        }
    }

    /// Parses the CLI's `--precision` value: `f32`, `bf16` or `fp16` (also `f16`).
    pub fn parse(s: &str) -> std::result::Result<MixedPrecision, String> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "fp32" => Ok(Self::uniform(DType::F32)),
            "bf16" => Ok(Self::uniform(DType::BF16)),
            "fp16" | "f16" => Ok(Self::uniform(DType::F16)),
            _ => Err(format!("unknown precision '{s}' (f32, bf16, fp16)")),
        }
    }

    /// The name `--precision` takes (`f32`, `bf16`, `fp16`).
    pub fn name(&self) -> &'static str {
        match self.param_dtype {
            DType::BF16 => "bf16",
            DType::F16 => "fp16",
            _ => "f32",
        }
    }

    /// True when the parameters compute in 16 bits (an f32 master copy is kept).
    pub fn is_mixed(&self) -> bool {
        matches!(self.param_dtype, DType::BF16 | DType::F16)
    }
}

impl Default for MixedPrecision {
    fn default() -> Self {
        Self::uniform(DType::F32)
    }
}

/// An optimizer stepping f32 master weights beside 16-bit parameters: each step widens the
/// parameters' gradients to f32 onto the masters, runs the inner optimizer on the masters,
/// and writes the masters rounded to the parameters' dtype back into the parameters (in
/// place: the parameter tensors stay the ones the model and DDP hold). Without loss scaling,
/// an inner optimizer that fuses it ([`Optimizer::step_with_copies`]: SGD and AdamW) does all
/// three in one pass over memory, with the same bits. Its state is the inner
/// optimizer's, under the parameters' names, so a checkpoint of it reads as an f32 run's.
///
/// With loss scaling ([`MasterWeights::with_loss_scaling`], fp16) the widened gradients are
/// divided by the scale in f32, and a step whose gradients hold an inf or a NaN is skipped (the
/// masters and the parameters stay as they were) and the scale halved ([`GradScaler`]); the
/// scale and its counter are part of the state. The verdict is this rank's: under DDP's
/// all-reduce every rank holds the same averaged gradients (an inf anywhere reaches every
/// rank's sum), so every rank skips alike.
pub struct MasterWeights {
    compute: Vec<Var>,
    masters: ParamStore,
    inner: Box<dyn Optimizer>,
    scaler: Option<GradScaler>,
}

impl MasterWeights {
    /// Takes `params` holding f32 values (built, initialised, resumed): those values become
    /// the masters (moved, not copied), the parameters are given their rounded `param_dtype`
    /// copies, and `build` makes the inner optimizer over the masters. `state` (the state of
    /// an optimizer of the same kind over the f32 parameters, possibly empty) is loaded into it.
    pub fn new(
        params: Vec<Var>,
        param_dtype: DType,
        build: impl FnOnce(Vec<Var>) -> Box<dyn Optimizer>,
        state: &[(String, Tensor)],
    ) -> Result<MasterWeights> {
        let mut masters = ParamStore::new();
        for (i, p) in params.iter().enumerate() {
            let v = p.value();
            if v.dtype() != DType::F32 {
                return Err(AutogradError::Invalid(format!(
                    "master weights start from f32 parameters; '{}' is {}",
                    p.name().unwrap_or("<unnamed>"),
                    v.dtype()
                )));
            }
            let name = p.name().map(str::to_string).unwrap_or_else(|| format!("param{i}"));
            let m = masters.add(name, v.clone())?;
            m.set_requires_grad(p.requires_grad())?;
            p.set_value_cast(v.to_dtype(param_dtype)?)?;
        }
        let mut inner = build(masters.params().to_vec());
        if !state.is_empty() {
            inner.load_state_dict(state)?;
        }
        Ok(MasterWeights {
            compute: params,
            masters,
            inner,
            scaler: None,
        })
    }

    /// Dynamic loss scaling (fp16): the scale starts at 2^16 and doubles after
    /// `growth_interval` clean steps. State loaded before this call keeps its scaler entries
    /// for the inner optimizer: call it before loading a checkpoint's state.
    pub fn with_loss_scaling(mut self, growth_interval: u64) -> MasterWeights {
        self.scaler = Some(GradScaler::new(growth_interval));
        self
    }

    /// The f32 masters, by parameter name (what a checkpoint saves as the model).
    pub fn masters(&self) -> Vec<(String, Tensor)> {
        self.masters.named_values()
    }

    /// Bytes of the f32 masters.
    pub fn master_bytes(&self) -> usize {
        self.masters
            .params()
            .iter()
            .map(|m| m.value().numel() * DType::F32.size_in_bytes())
            .sum()
    }
}

impl Optimizer for MasterWeights {
    /// The f32 masters: what the inner optimizer steps.
    fn params(&self) -> &[Var] {
        self.inner.params()
    }

    fn step(&mut self) -> Result<()> {
        // Without loss scaling the inner optimizer reads the 16-bit gradients and writes the
        // rounded masters into the parameters in its own pass, where it can.
        if self.scaler.is_none() {
            let copies: Vec<Tensor> = self.compute.iter().map(Var::value).collect();
            if copies.iter().all(Tensor::is_contiguous) {
                let grads: Vec<Option<Tensor>> = self.compute.iter().map(Var::grad).collect();
                if self.inner.step_with_copies(&grads, &copies)? {
                    return Ok(());
                }
            }
        }
        let inv = self.scaler.map(|s| 1.0 / s.scale());
        let mut found_inf = false;
        for (p, m) in self.compute.iter().zip(self.masters.params()) {
            let g = match p.grad() {
                None => None,
                Some(g) => {
                    let wide = g.to_dtype(DType::F32)?;
                    let wide = match inv {
                        Some(inv) => wide.mul_scalar(inv)?,
                        None => wide,
                    };
                    if inv.is_some() && !found_inf {
                        found_inf = !wide.to_dtype(DType::F64)?.sqr()?.sum_all()?.item()?.is_finite();
                    }
                    Some(wide)
                }
            };
            m.set_grad(g)?;
        }
        if let Some(scaler) = &mut self.scaler {
            if !scaler.update(found_inf)? {
                for m in self.masters.params() {
                    m.set_grad(None)?;
                }
                return Ok(());
            }
        }
        self.inner.step()?;
        for (p, m) in self.compute.iter().zip(self.masters.params()) {
            let v = p.value();
            v.copy_from(&m.value().to_dtype(v.dtype())?)?;
        }
        Ok(())
    }

    fn lr(&self) -> f64 {
        self.inner.lr()
    }

    fn set_lr(&mut self, lr: f64) {
        self.inner.set_lr(lr)
    }

    fn state_dict(&self) -> Result<Vec<(String, Tensor)>> {
        let mut state = self.inner.state_dict()?;
        if let Some(s) = &self.scaler {
            state.extend(s.state_dict()?);
        }
        Ok(state)
    }

    fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> Result<()> {
        match &mut self.scaler {
            Some(s) => {
                let rest = s.load_from(state)?;
                self.inner.load_state_dict(&rest)
            }
            None => self.inner.load_state_dict(state),
        }
    }

    fn loss_scale(&self) -> Option<f64> {
        self.scaler.map(|s| s.scale())
    }

    fn skipped_steps(&self) -> u64 {
        self.scaler.map_or(0, |s| s.skipped())
    }

    fn grad_scaler(&self) -> Option<GradScaler> {
        self.scaler
    }

    fn state_bytes(&self) -> Result<usize> {
        self.inner.state_bytes()
    }

    fn consolidate_state(&mut self) -> Result<()> {
        self.inner.consolidate_state()
    }

    fn master_weights(&self) -> Vec<(String, Tensor)> {
        self.masters()
    }

    fn master_weight_bytes(&self) -> usize {
        self.master_bytes()
    }
}
