//! The reference MLP classifier: `Linear ReLU Linear ReLU Linear ReLU Linear` with
//! cross-entropy, default widths `[512, 2048, 2048, 2048, 10]`; optional dropout after each
//! hidden ReLU (`MlpConfig::dropout`, training mode only).
//!
//! Parameters are `layers.{i}.weight` (`[out, in]`) and `layers.{i}.bias` (`[out]`)
//! for the i-th Linear: exactly the state dict of a PyTorch module holding an
//! `nn.ModuleList` named `layers` of `nn.Linear` modules (ReLUs carry no parameters and
//! are applied functionally), so checkpoints load in either direction.

use brigade_autograd::{scope, ParamStore, Var};
use brigade_tensor::{DType, Rng, Tensor};

use crate::nn::{Activation, Dropout, DropoutRng, Init, Linear, Params, RngState};
use crate::{Batch, BatchSchema, Model, ModelError, Result};

/// Shape of the MLP.
#[derive(Debug, Clone, PartialEq)]
pub struct MlpConfig {
    /// Input width, hidden widths, number of classes: `widths.len() - 1` Linear layers.
    pub widths: Vec<usize>,
    /// Parameter dtype: F32 for training, F64 for gradient checks.
    pub dtype: DType,
    /// Dropout probability after each hidden activation (in training mode only); 0 turns it
    /// off and leaves the computation bit for bit as without it.
    pub dropout: f64,
}

impl Default for MlpConfig {
    /// The reference: `[512, 2048, 2048, 2048, 10]` in F32, no dropout.
    fn default() -> Self {
        MlpConfig {
            widths: vec![512, 2048, 2048, 2048, 10],
            dtype: DType::F32,
            dropout: 0.0,
        }
    }
}

impl MlpConfig {
    /// A config with these widths, in F32, without dropout.
    pub fn new(widths: Vec<usize>) -> Self {
        MlpConfig {
            widths,
            dtype: DType::F32,
            dropout: 0.0,
        }
    }

    /// What a batch for this MLP holds: [`BatchSchema::classify`] of its input width and
    /// class count.
    pub fn batch_schema(&self) -> BatchSchema {
        BatchSchema::classify(self.in_dim(), self.n_classes())
    }

    /// Input width.
    pub fn in_dim(&self) -> usize {
        self.widths.first().copied().unwrap_or(0)
    }

    /// Number of classes (output width).
    pub fn n_classes(&self) -> usize {
        self.widths.last().copied().unwrap_or(0)
    }

    /// Errors unless there are at least two widths, all positive, the dtype is F32 or F64 and
    /// the dropout a probability.
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
        if !self.dtype.is_float() {
            return err(format!(
                "dtype {:?} cannot be trained; use F32 (F64 for gradient checks, BF16/F16 for mixed precision)",
                self.dtype
            ));
        }
        if !(0.0..=1.0).contains(&self.dropout) {
            return err(format!("dropout must be a probability in [0, 1], got {}", self.dropout));
        }
        Ok(())
    }
}

/// Mixed into the model seed for the dropout generator.
const DROPOUT_SEED: u64 = 0xD50F_0A7E_8765_4321;

/// The MLP: its parameters and its Linear layers.
pub struct Mlp {
    cfg: MlpConfig,
    store: ParamStore,
    layers: Vec<Linear>,
    /// One after each hidden activation.
    dropouts: Vec<Dropout>,
    rng: DropoutRng,
    training: bool,
}

impl Mlp {
    /// Builds the MLP with PyTorch's `nn.Linear` initialisation (kaiming-uniform with
    /// `a = sqrt(5)`, i.e. weight and bias both `U(-1/sqrt(in), 1/sqrt(in))`), drawn from
    /// `seed` in registration order; in training mode.
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
        // layer i runs under scope `layers.{i}` (`layers.3.weight` -> `layers.3`)
        crate::nn::set_units(&mut store, |name| {
            name.rsplit_once('.').map_or(name, |(unit, _)| unit).to_string()
        })?;
        let dropout_rng = DropoutRng::new(seed ^ DROPOUT_SEED);
        let dropouts = (1..layers.len())
            .map(|_| Dropout::new(cfg.dropout, &dropout_rng))
            .collect::<Result<Vec<_>>>()?;
        Ok(Mlp {
            cfg,
            store,
            layers,
            dropouts,
            rng: dropout_rng,
            training: true,
        })
    }

    /// The configuration it was built from.
    pub fn config(&self) -> &MlpConfig {
        &self.cfg
    }

    /// True in training mode (the default), false after [`Model::eval`].
    pub fn is_training(&self) -> bool {
        self.training
    }

    /// Class logits `[B, n_classes]` of inputs `[B, in]` (any float dtype; converted to
    /// the parameters' dtype). Layer `i` runs under scope `layers.{i}`. Dropout acts in
    /// training mode.
    pub fn logits(&self, inputs: &Tensor) -> Result<Var> {
        self.logits_then(inputs, Ok)
    }

    /// [`Mlp::logits`], then `then` of them inside the last layer's scope: a loss computed
    /// there runs while a sharded last layer is still gathered, not in a second entry of its
    /// scope that would gather it again.
    fn logits_then(&self, inputs: &Tensor, then: impl FnOnce(Var) -> Result<Var>) -> Result<Var> {
        let in_dim = self.cfg.in_dim();
        if inputs.rank() != 2 || inputs.shape()[1] != in_dim {
            return Err(ModelError::BadBatch {
                model: "mlp",
                message: format!("inputs have shape {:?}, expected [batch, {in_dim}]", inputs.shape()),
            });
        }
        // the parameters' dtype as they are now: a mixed-precision run casts them after building
        let dtype = self.layers[0].weight.value().dtype();
        let x = if inputs.dtype() == dtype {
            inputs.clone()
        } else {
            inputs.to_dtype(dtype)?
        };
        let mut h = Var::constant(x);
        let last = self.layers.len() - 1;
        for (i, layer) in self.layers[..last].iter().enumerate() {
            h = scope(&format!("layers.{i}"), || -> Result<Var> {
                self.dropouts[i].forward(&Activation::Relu.apply(&layer.forward(&h)?)?)
            })?;
        }
        scope(&format!("layers.{last}"), || then(self.layers[last].forward(&h)?))
    }
}

impl Model for Mlp {
    fn params(&self) -> &ParamStore {
        &self.store
    }

    fn loss(&self, batch: &Batch) -> Result<Var> {
        let targets = batch.tensor("mlp", "targets")?;
        self.logits_then(batch.tensor("mlp", "inputs")?, |logits| {
            Ok(crate::nn::loss_in_f32(&logits)?.cross_entropy(targets)?)
        })
    }

    /// Class logits `[B, n_classes]` of the batch's `inputs` (its `targets`, if any, unread).
    fn forward(&self, batch: &Batch) -> Result<Var> {
        self.logits(batch.tensor("mlp", "inputs")?)
    }

    fn layer_names(&self) -> Vec<String> {
        (0..self.layers.len()).map(|i| format!("layers.{i}")).collect()
    }

    fn batch_schema(&self) -> Option<BatchSchema> {
        Some(self.cfg.batch_schema())
    }

    fn set_training(&mut self, training: bool) {
        self.training = training;
        self.dropouts.iter_mut().for_each(|d| d.set_training(training));
    }

    fn rng_state(&self) -> Option<RngState> {
        Some(self.rng.state())
    }

    fn set_rng_state(&mut self, state: RngState) -> Result<()> {
        self.rng.set_state(state);
        Ok(())
    }
}
