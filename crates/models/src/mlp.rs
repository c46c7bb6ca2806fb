//! The reference MLP classifier: `Linear ReLU Linear ReLU Linear ReLU Linear` with
//! cross-entropy, default widths `[512, 2048, 2048, 2048, 10]`.
//!
//! Parameters are `layers.{i}.weight` (`[out, in]`) and `layers.{i}.bias` (`[out]`)
//! for the i-th Linear: exactly the state dict of a PyTorch module holding an
//! `nn.ModuleList` named `layers` of `nn.Linear` modules (ReLUs carry no parameters and
//! are applied functionally), so checkpoints load in either direction.

use brigade_autograd::{scope, ParamStore, Var};
use brigade_tensor::{DType, Rng, Tensor};

use crate::nn::{Activation, Init, Linear, Params};
use crate::{Batch, Model, ModelError, Result};

/// Shape of the MLP.
#[derive(Debug, Clone, PartialEq)]
pub struct MlpConfig {
    /// Input width, hidden widths, number of classes: `widths.len() - 1` Linear layers.
    pub widths: Vec<usize>,
    /// Parameter dtype: F32 for training, F64 for gradient checks.
    pub dtype: DType,
}

impl Default for MlpConfig {
    /// The reference: `[512, 2048, 2048, 2048, 10]` in F32.
    fn default() -> Self {
        MlpConfig {
            widths: vec![512, 2048, 2048, 2048, 10],
            dtype: DType::F32,
        }
    }
}

impl MlpConfig {
    /// A config with these widths, in F32.
    pub fn new(widths: Vec<usize>) -> Self {
        MlpConfig {
            widths,
            dtype: DType::F32,
        }
    }

    /// Input width.
    pub fn in_dim(&self) -> usize {
        self.widths.first().copied().unwrap_or(0)
    }

    /// Number of classes (output width).
    pub fn n_classes(&self) -> usize {
        self.widths.last().copied().unwrap_or(0)
    }

    /// Errors unless there are at least two widths, all positive, and the dtype is F32 or F64.
    pub fn validate(&self) -> Result<()> {
        let err = |message: String| Err(ModelError::Config { model: "mlp", message });
        if self.widths.len() < 2 {
            return err(format!(
                "widths {:?} need at least an input and an output width",
                self.widths
            ));
        }
        if self.widths.contains(&0) {
            return err(format!("widths {:?} must all be positive", self.widths));
        }
        if !self.dtype.is_compute() {
            return err(format!(
                "dtype {:?} cannot be trained; use F32 (or F64 for gradient checks)",
                self.dtype
            ));
        }
        Ok(())
    }
}

/// The MLP: its parameters and its Linear layers.
pub struct Mlp {
    cfg: MlpConfig,
    store: ParamStore,
    layers: Vec<Linear>,
}

impl Mlp {
    /// Builds the MLP with PyTorch's `nn.Linear` initialisation (kaiming-uniform with
    /// `a = sqrt(5)`, i.e. weight and bias both `U(-1/sqrt(in), 1/sqrt(in))`), drawn from
    /// `seed` in registration order.
    pub fn new(cfg: MlpConfig, seed: u64) -> Result<Mlp> {
        cfg.validate()?;
        let (mut rng, mut store) = (Rng::new(seed), ParamStore::new());
        let mut p = Params::new(&mut store, &mut rng, cfg.dtype);
        let layers = cfg
            .widths
            .windows(2)
            .enumerate()
            .map(|(i, w)| Linear::new(&mut p.sub(&format!("layers.{i}")), w[0], w[1], true, Init::TorchLinear))
            .collect::<Result<Vec<_>>>()?;
        Ok(Mlp { cfg, store, layers })
    }

    /// The configuration it was built from.
    pub fn config(&self) -> &MlpConfig {
        &self.cfg
    }

    /// Class logits `[B, n_classes]` of inputs `[B, in]` (any float dtype; converted to
    /// the parameters' dtype). Layer `i` runs under scope `layers.{i}`.
    pub fn logits(&self, inputs: &Tensor) -> Result<Var> {
        let in_dim = self.cfg.in_dim();
        if inputs.rank() != 2 || inputs.shape()[1] != in_dim {
            return Err(ModelError::BadBatch {
                model: "mlp",
                message: format!("inputs have shape {:?}, expected [batch, {in_dim}]", inputs.shape()),
            });
        }
        let x = if inputs.dtype() == self.cfg.dtype {
            inputs.clone()
        } else {
            inputs.to_dtype(self.cfg.dtype)?
        };
        let mut h = Var::constant(x);
        let last = self.layers.len() - 1;
        for (i, layer) in self.layers.iter().enumerate() {
            h = scope(&format!("layers.{i}"), || -> Result<Var> {
                let y = layer.forward(&h)?;
                if i < last {
                    Activation::Relu.apply(&y)
                } else {
                    Ok(y)
                }
            })?;
        }
        Ok(h)
    }
}

impl Model for Mlp {
    fn params(&self) -> &ParamStore {
        &self.store
    }

    fn loss(&self, batch: &Batch) -> Result<Var> {
        let Batch::Classify { inputs, targets } = batch else {
            return Err(ModelError::WrongBatch {
                model: "mlp",
                expected: "classify",
                found: batch.kind(),
            });
        };
        let logits = self.logits(inputs)?;
        let last = self.layers.len() - 1;
        Ok(scope(&format!("layers.{last}"), || logits.cross_entropy(targets))?)
    }

    fn layer_names(&self) -> Vec<String> {
        (0..self.layers.len()).map(|i| format!("layers.{i}")).collect()
    }
}
