//! Brigade's models: the reference MLP and a byte-level GPT, the data they train on,
//! and the files they read and write.
//!
//! Every model implements [`Model`]: it owns a [`ParamStore`] (whose registration order
//! is the DDP bucket order), computes a mean loss on a [`Batch`] of named tensors (and its
//! outputs through [`Model::forward`]), declares what its batches hold ([`BatchSchema`]), and
//! records each layer's ops under a module scope (listed by [`Model::layer_names`]), so that
//! backward can be attributed per layer on a timeline. Parameter names and layouts match the
//! PyTorch modules described in [`mlp`] and [`gpt`], so state dicts move both ways
//! through [`io`].
//!
//! Data: a [`Dataset`] (built in, safetensors, `.npy`/`.npz` through [`npy`], UTF-8 text
//! with a validation split as bytes or GPT-2 tokens ([`Tokenizer`]), llm.c's and nanoGPT's
//! token files through [`tokens`]), of which a [`DistributedSampler`] gives each rank its share per
//! epoch. Text out: [`generate()`] decodes from a [`Gpt`] with a KV cache.
//!
//! ```
//! use std::ops::ControlFlow;
//!
//! use brigade_autograd::no_grad;
//! use brigade_models::{generate_text, Dataset, DistributedSampler, Gpt, GptConfig, Model, SampleOptions, SamplerOptions, Tokenizer, ValSplit};
//!
//! # let path = std::env::temp_dir().join(format!("brigade-doc-text-{}.txt", std::process::id()));
//! # std::fs::write(&path, "the cat sat on the mat. ".repeat(50)).unwrap();
//! let cfg = GptConfig { d_model: 32, n_layers: 1, n_heads: 2, d_ff: 64, context: 16, ..GptConfig::default() };
//! let mut gpt = Gpt::new(cfg.clone(), 0)?;
//! // a UTF-8 file: rows of context + 1 bytes, the last 10% for validation
//! let text = Dataset::from_text_file(&path, cfg.context, &ValSplit::Fraction(0.1), Tokenizer::Bytes)?;
//! text.train.check(&cfg.batch_schema())?;
//! // rank 1 of 2 in epoch 3: its share of that epoch's permutation, 8 rows at a time
//! let mut sampler = DistributedSampler::new(text.train.len(), 2, 1, SamplerOptions::default())?;
//! sampler.set_epoch(3);
//! let rows = sampler.indices();
//! let loss = gpt.loss(&text.train.gather(&rows[..8])?)?;
//! loss.backward()?;
//! // evaluation: eval mode (no dropout), no graph
//! gpt.eval();
//! let val = text.val.as_ref().expect("a validation split");
//! let val_loss = no_grad(|| gpt.loss(&val.batch(0, 4)?))?;
//! assert!(val_loss.value().item()? > 0.0);
//! // text out, streamed as it comes
//! let opts = SampleOptions { max_new_tokens: 20, temperature: 0.8, top_k: Some(40), seed: 1 };
//! let sample = generate_text(&gpt, "the ", &opts, |s| {
//!     print!("{s}");
//!     ControlFlow::Continue(())
//! })?;
//! # std::fs::remove_file(&path).unwrap();
//! # Ok::<(), brigade_models::ModelError>(())
//! ```

#![warn(missing_docs)]

mod batch;
mod corpus;
pub mod data;
mod error;
pub mod family;
pub mod generate;
pub mod gpt;
pub mod io;
pub mod mlp;
pub mod nn;
pub mod npy;
pub mod sampler;
mod stored;
mod text;
pub mod tokenizer;
pub mod tokens;

use brigade_autograd::{ParamStore, Var};

pub use batch::{Batch, BatchSchema, IndexRange, TensorSpec};
pub use data::Dataset;
pub use error::{ModelError, Result};
pub use family::GptFamily;
pub use generate::{
    generate, generate_text, generate_text_with, generate_uncached, Generated, SampleOptions, Utf8Stream,
};
pub use gpt::{Gpt, GptConfig};
pub use io::{
    check_finite, load_params, load_params_from_tensors, load_params_from_tensors_nonfinite, load_safetensors,
    load_safetensors_with_metadata, model_state_of_checkpoint, row_major_index, save_params, save_safetensors,
    write_atomic, NamedTensors, TRAINING_CHECKPOINT_FORMAT,
};
pub use mlp::{Mlp, MlpConfig};
pub use nn::RngState;
pub use npy::{load_npy, load_npz, save_npy, save_npz};
pub use sampler::{DistributedSampler, Remainder, SamplerCursor, SamplerOptions, SamplerPosition};
pub use stored::{defer_params_to_file, stored_tensors, StoredTensor};
pub use text::{text_file_tokens, TextData, ValSplit};
pub use tokenizer::{Tokenizer, GPT2_END_OF_TEXT, GPT2_VOCAB};
pub use tokens::{write_llmc_shard, TokenFormat};

/// A trainable model as the CLI and the DDP tests drive it.
///
/// Only [`Model::params`] and [`Model::loss`] are required; the others have defaults for a
/// model without an inference path, without a declared batch, without named layers, or without
/// anything that depends on the mode (no dropout). [`nn::Sequential`] is a whole model built
/// from layers.
pub trait Model: Send {
    /// The parameters, in registration order (the DDP bucket order).
    fn params(&self) -> &ParamStore;
    /// Forward pass + mean loss on one batch (graph recorded unless under `no_grad`).
    fn loss(&self, batch: &Batch) -> Result<Var>;
    /// Module scopes in forward order (e.g. `["layers.0", ..]` or
    /// `["embed", "blocks.0", .., "head"]`): the scopes its layers' ops run under, as a
    /// timeline shows them. Nothing in training reads it; the default is an empty list (not
    /// declared).
    fn layer_names(&self) -> Vec<String> {
        vec![]
    }

    /// Inference: the model's outputs (logits) for the batch's inputs, as [`Model::loss`]
    /// computes them before the loss. To evaluate, run it in [`Model::eval`] mode under
    /// [`brigade_autograd::no_grad`]. The default is an error saying the model lacks it.
    fn forward(&self, batch: &Batch) -> Result<Var> {
        let _ = batch;
        Err(ModelError::Unsupported(
            "this model implements no Model::forward (inference); implement it to evaluate or sample".into(),
        ))
    }

    /// What each batch must hold, for data to be checked against when opened; `None` (the
    /// default): not declared, not checked.
    fn batch_schema(&self) -> Option<BatchSchema> {
        None
    }

    /// Training (`true`, the mode a model starts in) or evaluation (`false`) mode for every
    /// layer whose behaviour depends on it (dropout), like PyTorch's `module.train(mode)`. The
    /// default does nothing: a model without such layers behaves the same in both.
    fn set_training(&mut self, training: bool) {
        let _ = training;
    }

    /// Training mode: `set_training(true)`.
    fn train(&mut self) {
        self.set_training(true);
    }

    /// Evaluation mode: `set_training(false)` (dropout off).
    fn eval(&mut self) {
        self.set_training(false);
    }

    /// Activation checkpointing of every `every`-th block (blocks `0, every, 2 * every, ..`;
    /// 1 = every block, 0 = none, the default): each checkpointed block keeps only its input
    /// through forward and recomputes its forward inside backward
    /// ([`brigade_autograd::checkpoint_scope`]), with the same gradients. The default, for a
    /// model without blocks, accepts 0 only and is an error otherwise.
    fn set_activation_checkpointing(&mut self, every: usize) -> Result<()> {
        if every == 0 {
            return Ok(());
        }
        Err(ModelError::Unsupported(
            "this model has no blocks to checkpoint (activation checkpointing is for the GPT)".into(),
        ))
    }

    /// The state of the generator the model's dropout draws from, for a checkpoint (`None`,
    /// the default: the model draws nothing at random).
    fn rng_state(&self) -> Option<RngState> {
        None
    }

    /// Restores a [`Model::rng_state`], so that a resumed run draws the same dropout masks as
    /// an uninterrupted one. The default, for a model without a generator, is an error.
    fn set_rng_state(&mut self, state: RngState) -> Result<()> {
        let _ = state;
        Err(ModelError::Unsupported(
            "this model has no random generator to restore (its Model::rng_state is None)".into(),
        ))
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

    /// What a batch for this model holds: [`BatchSchema::classify`] or
    /// [`BatchSchema::tokens`] of its sizes.
    pub fn batch_schema(&self) -> BatchSchema {
        match self {
            ModelKind::Mlp(c) => c.batch_schema(),
            ModelKind::Gpt(c) => c.batch_schema(),
        }
    }
}

/// The schema of the model a kind builds, so that data can be opened for a `ModelKind`.
impl From<&ModelKind> for BatchSchema {
    fn from(kind: &ModelKind) -> BatchSchema {
        kind.batch_schema()
    }
}

/// A copy, so that data can be opened for a borrowed schema.
impl From<&BatchSchema> for BatchSchema {
    fn from(schema: &BatchSchema) -> BatchSchema {
        schema.clone()
    }
}
