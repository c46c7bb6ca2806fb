//! Layers one after another, as a whole [`Model`]: PyTorch's `nn.Sequential` with its loss,
//! built without a hand-wired [`ParamStore`].

use brigade_autograd::{scope, ParamStore, Var};
use brigade_tensor::{DType, Rng, Tensor};

use super::{Activation, Dropout, DropoutRng, Init, LayerNorm, Linear, MlpBlock, Params, RngState, TransformerBlock};
use crate::{Batch, Model, ModelError, Result};

/// One step of a [`Sequential`]: a function of one input with its own parameters (registered
/// when it is built, under its index), and a mode if its behaviour depends on one.
pub trait Layer: Send {
    /// `x -> y`.
    fn forward(&self, x: &Var) -> Result<Var>;

    /// Training or evaluation mode (see [`Model::set_training`]); the default does nothing.
    fn set_training(&mut self, training: bool) {
        let _ = training;
    }
}

impl Layer for Linear {
    fn forward(&self, x: &Var) -> Result<Var> {
        Linear::forward(self, x)
    }
}

impl Layer for LayerNorm {
    fn forward(&self, x: &Var) -> Result<Var> {
        LayerNorm::forward(self, x)
    }
}

impl Layer for Activation {
    fn forward(&self, x: &Var) -> Result<Var> {
        self.apply(x)
    }
}

impl Layer for MlpBlock {
    fn forward(&self, x: &Var) -> Result<Var> {
        MlpBlock::forward(self, x)
    }
}

impl Layer for Dropout {
    fn forward(&self, x: &Var) -> Result<Var> {
        Dropout::forward(self, x)
    }

    fn set_training(&mut self, training: bool) {
        Dropout::set_training(self, training)
    }
}

impl Layer for TransformerBlock {
    fn forward(&self, x: &Var) -> Result<Var> {
        TransformerBlock::forward(self, x)
    }

    fn set_training(&mut self, training: bool) {
        TransformerBlock::set_training(self, training)
    }
}

/// The loss a [`Sequential`] computes between its output and the batch's `targets`, by the
/// mean (PyTorch's default reduction).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Loss {
    /// [`Var::mse_loss`]: regression (`targets` F32 of the output's element count).
    Mse,
    /// [`Var::l1_loss`].
    L1,
    /// [`Var::smooth_l1_loss`] with `beta`.
    SmoothL1 {
        /// Where the loss turns from quadratic to linear.
        beta: f64,
    },
    /// [`Var::huber_loss`] with `delta`.
    Huber {
        /// Where the loss turns from quadratic to linear.
        delta: f64,
    },
    /// [`Var::binary_cross_entropy_with_logits`]: the output is logits, `targets` in `[0, 1]`.
    BceWithLogits,
    /// [`Var::cross_entropy`]: the output is `[B, classes]` logits, `targets` I64 `[B]`.
    CrossEntropy,
}

/// Layers applied in order to the batch's `inputs`, then a [`Loss`] against its `targets`: a
/// whole [`Model`] in a few lines, its parameters in a store of its own, drawn from one seed in
/// build order. Parameters are named by the layer's index as in PyTorch's `nn.Sequential`
/// (`0.weight`, `0.bias`, then `1.weight` ...; an activation takes an index and holds none),
/// so its state dict loads into the PyTorch module of the same layers. Each layer's ops run
/// under the scope of its index (what a timeline shows).
///
/// ```
/// use brigade_models::nn::{Loss, Sequential};
/// use brigade_models::{Batch, Model};
/// use brigade_tensor::Tensor;
///
/// // PyTorch: nn.Sequential(nn.Linear(8, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 1))
/// let model = Sequential::new(0).linear(8, 64)?.layer_norm(64)?.gelu().linear(64, 1)?.loss(Loss::Mse);
/// let names: Vec<String> = model.params().named_values().into_iter().map(|(n, _)| n).collect();
/// assert_eq!(names, ["0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias"]);
/// let batch = Batch::new(vec![
///     ("inputs".into(), Tensor::zeros(&[4, 8], brigade_tensor::DType::F32)),
///     ("targets".into(), Tensor::zeros(&[4, 1], brigade_tensor::DType::F32)),
/// ])?;
/// assert_eq!(Model::loss(&model, &batch)?.value().shape(), &[] as &[usize]);
/// # Ok::<(), brigade_models::ModelError>(())
/// ```
pub struct Sequential {
    store: ParamStore,
    rng: Rng,
    dtype: DType,
    dropout_rng: DropoutRng,
    has_dropout: bool,
    layers: Vec<(String, Box<dyn Layer>)>,
    loss: Loss,
}

/// Mixed into the seed for the dropout generator, so that it does not replay the init draws.
const DROPOUT_SEED: u64 = 0xD50F_5EED_0000_0001;

impl Sequential {
    /// No layers yet, F32 parameters drawn from `seed`, the [`Loss::Mse`] loss.
    pub fn new(seed: u64) -> Sequential {
        Sequential {
            store: ParamStore::new(),
            rng: Rng::new(seed),
            dtype: DType::F32,
            dropout_rng: DropoutRng::new(seed ^ DROPOUT_SEED),
            has_dropout: false,
            layers: vec![],
            loss: Loss::Mse,
        }
    }

    /// Appends the layer `build` makes, its parameters registered under the layer's index
    /// (`build` gets the [`Params`] to register them with: any layer of [`super`], or one of
    /// the user's own implementing [`Layer`]).
    pub fn push<L: Layer + 'static>(mut self, build: impl FnOnce(&mut Params) -> Result<L>) -> Result<Sequential> {
        let name = self.layers.len().to_string();
        let mut p = Params::new(&mut self.store, &mut self.rng, self.dtype);
        let layer = build(&mut p.sub(&name))?;
        self.layers.push((name, Box::new(layer)));
        Ok(self)
    }

    /// `nn.Linear(inp, out)`: with bias, PyTorch's initialisation.
    pub fn linear(self, inp: usize, out: usize) -> Result<Sequential> {
        self.push(|p| Linear::new(p, inp, out, true, Init::TorchLinear))
    }

    /// `nn.LayerNorm(d)` (epsilon 1e-5).
    pub fn layer_norm(self, d: usize) -> Result<Sequential> {
        self.push(|p| LayerNorm::new(p, d, LayerNorm::DEFAULT_EPS))
    }

    /// `nn.GELU()` (the exact erf form).
    pub fn gelu(self) -> Sequential {
        self.activation(Activation::Gelu)
    }

    /// `nn.ReLU()`.
    pub fn relu(self) -> Sequential {
        self.activation(Activation::Relu)
    }

    fn activation(self, a: Activation) -> Sequential {
        self.push(|_| Ok(a)).expect("an activation registers nothing")
    }

    /// `nn.Dropout(p)`: off in evaluation mode; its masks come from the model's generator,
    /// which a checkpoint carries ([`Model::rng_state`]).
    pub fn dropout(mut self, p: f64) -> Result<Sequential> {
        let dropout = Dropout::new(p, &self.dropout_rng)?;
        self.has_dropout = true;
        self.push(|_| Ok(dropout))
    }

    /// The loss [`Model::loss`] computes (the default is [`Loss::Mse`]).
    pub fn loss(mut self, loss: Loss) -> Sequential {
        self.loss = loss;
        self
    }

    /// Every layer applied to `x`, in order.
    pub fn forward_var(&self, x: &Var) -> Result<Var> {
        let mut h = x.clone();
        for (name, layer) in &self.layers {
            h = scope(name, || layer.forward(&h))?;
        }
        Ok(h)
    }
}

fn bad(message: String) -> ModelError {
    ModelError::Config {
        model: "sequential",
        message,
    }
}

impl Model for Sequential {
    fn params(&self) -> &ParamStore {
        &self.store
    }

    fn loss(&self, batch: &Batch) -> Result<Var> {
        let out = self.forward(batch)?;
        let targets = batch.tensor("sequential", "targets")?;
        if self.loss == Loss::CrossEntropy {
            return Ok(out.cross_entropy(targets)?);
        }
        // [B] targets for a [B, 1] output, as a regression's data often has them
        let targets: Tensor = if targets.numel() == out.value().numel() && targets.shape() != out.shape() {
            targets.reshape(&out.shape())?
        } else {
            targets.clone()
        };
        let y = Var::constant(targets);
        Ok(match self.loss {
            Loss::Mse => out.mse_loss(&y)?,
            Loss::L1 => out.l1_loss(&y)?,
            Loss::SmoothL1 { beta } => out.smooth_l1_loss(&y, beta)?,
            Loss::Huber { delta } => out.huber_loss(&y, delta)?,
            Loss::BceWithLogits => out.binary_cross_entropy_with_logits(&y)?,
            Loss::CrossEntropy => unreachable!("returned above"),
        })
    }

    fn layer_names(&self) -> Vec<String> {
        self.layers.iter().map(|(n, _)| n.clone()).collect()
    }

    fn forward(&self, batch: &Batch) -> Result<Var> {
        let x = batch.tensor("sequential", "inputs")?;
        if self.layers.is_empty() {
            return Err(bad("the model has no layers".into()));
        }
        self.forward_var(&Var::constant(x.clone()))
    }

    fn set_training(&mut self, training: bool) {
        for (_, layer) in &mut self.layers {
            layer.set_training(training);
        }
    }

    fn rng_state(&self) -> Option<RngState> {
        self.has_dropout.then(|| self.dropout_rng.state())
    }

    fn set_rng_state(&mut self, state: RngState) -> Result<()> {
        if !self.has_dropout {
            return Err(bad("this model has no dropout, so no generator to restore".into()));
        }
        self.dropout_rng.set_state(state);
        Ok(())
    }
}
