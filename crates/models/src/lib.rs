//! Brigade's models: the reference MLP and a byte-level GPT, the data they train on,
//! and safetensors checkpoints.
//!
//! Every model implements [`Model`]: it owns a [`ParamStore`] (whose registration order
//! is the DDP bucket order), computes a mean loss on a [`Batch`], and records each
//! layer's ops under a module scope listed by [`Model::layer_names`], so that backward
//! can be attributed per layer on a timeline. Parameter names and layouts match the
//! PyTorch modules described in [`mlp`] and [`gpt`], so state dicts move both ways
//! through [`io`].

#![warn(missing_docs)]

mod corpus;
pub mod data;
mod error;
pub mod gpt;
pub mod io;
pub mod mlp;
pub mod nn;

use brigade_autograd::{ParamStore, Var};
use brigade_tensor::{DType, Tensor};

pub use data::Dataset;
pub use error::{ModelError, Result};
pub use gpt::{Gpt, GptConfig};
pub use io::{
    check_finite, load_params, load_params_from_tensors, load_safetensors, load_safetensors_with_metadata, save_params,
    save_safetensors, write_atomic, NamedTensors,
};
pub use mlp::{Mlp, MlpConfig};

/// A trainable model as the CLI and the DDP tests drive it.
pub trait Model: Send {
    /// The parameters, in registration order (the DDP bucket order).
    fn params(&self) -> &ParamStore;
    /// Forward pass + mean loss on one batch (graph recorded unless under `no_grad`).
    fn loss(&self, batch: &Batch) -> Result<Var>;
    /// Module scopes in forward order (e.g. `["layers.0", ..]` or
    /// `["embed", "blocks.0", .., "head"]`), for timelines.
    fn layer_names(&self) -> Vec<String>;
}

/// One batch of training data.
#[derive(Debug, Clone)]
pub enum Batch {
    /// Classification: F32 `inputs [B, in]` and I64 `targets [B]` (class indices).
    Classify {
        /// F32 `[B, in]`.
        inputs: Tensor,
        /// I64 `[B]`.
        targets: Tensor,
    },
    /// Next-token prediction: I64 or U8 `tokens [B, ctx + 1]`; the model reads
    /// `tokens[:, :-1]` and predicts `tokens[:, 1:]`.
    Tokens {
        /// I64 or U8 `[B, ctx + 1]`.
        tokens: Tensor,
    },
}

impl Batch {
    /// Number of rows (examples or sequences).
    pub fn rows(&self) -> usize {
        match self {
            Batch::Classify { targets, .. } => targets.shape().first().copied().unwrap_or(0),
            Batch::Tokens { tokens } => tokens.shape().first().copied().unwrap_or(0),
        }
    }

    /// `"classify"` or `"tokens"`, for error messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Batch::Classify { .. } => "classify",
            Batch::Tokens { .. } => "tokens",
        }
    }

    /// A next-token batch shifted for a language model: the inputs `tokens[:, :-1]` `[B, T]`
    /// (contiguous, dtype kept) and the targets `tokens[:, 1:]` as I64 `[B * T]`, ready for a
    /// cross-entropy over `[B * T, vocab]` logits. `model` names the model in the errors (a
    /// classification batch, or rows of fewer than 2 tokens).
    pub fn shifted_tokens(&self, model: &'static str) -> Result<(Tensor, Tensor)> {
        let Batch::Tokens { tokens } = self else {
            return Err(ModelError::WrongBatch {
                model,
                expected: "tokens",
                found: self.kind(),
            });
        };
        if tokens.rank() != 2 || tokens.shape()[1] < 2 {
            return Err(ModelError::BadBatch {
                model,
                message: format!(
                    "tokens have shape {:?}, expected [batch, context + 1] with at least 2 columns",
                    tokens.shape()
                ),
            });
        }
        let (b, n) = (tokens.shape()[0], tokens.shape()[1]);
        let inputs = tokens.narrow(1, 0, n - 1)?.contiguous()?;
        let targets = tokens
            .narrow(1, 1, n - 1)?
            .to_dtype(DType::I64)?
            .reshape(&[b * (n - 1)])?;
        Ok((inputs, targets))
    }
}

/// Which model, with its configuration: what the CLI builds and what a dataset file is
/// checked against.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelKind {
    /// The MLP classifier.
    Mlp(MlpConfig),
    /// The byte-level GPT.
    Gpt(GptConfig),
}

impl ModelKind {
    /// Builds the model with parameters initialised from `seed`.
    pub fn build(&self, seed: u64) -> Result<Box<dyn Model>> {
        Ok(match self {
            ModelKind::Mlp(c) => Box::new(Mlp::new(c.clone(), seed)?),
            ModelKind::Gpt(c) => Box::new(Gpt::new(c.clone(), seed)?),
        })
    }

    /// `"mlp"` or `"gpt"`.
    pub fn name(&self) -> &'static str {
        match self {
            ModelKind::Mlp(_) => "mlp",
            ModelKind::Gpt(_) => "gpt",
        }
    }
}
