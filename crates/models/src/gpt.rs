//! A byte-level decoder-only transformer (GPT-2 style, pre-LayerNorm).
//!
//! `x = drop(tok_emb[t] + pos_emb[p])`; per block `x = x + drop(attn(ln1(x)));
//! x = x + drop(mlp(ln2(x)))` with causal multi-head attention scaled by `1/sqrt(head_dim)` and
//! an exact-GELU MLP; then `ln_f` and an untied, bias-free output head. The loss is next-token
//! cross-entropy averaged over every position. Dropout (nanoGPT's places, `GptConfig::dropout`,
//! 0 by default) acts only in training mode; [`Gpt::forward_cached`] decodes with a KV cache
//! ([`crate::generate`](mod@crate::generate)).
//!
//! Parameter names, layouts and registration order (the DDP bucket order):
//! `tok_emb.weight [vocab, d]`, `pos_emb.weight [context, d]`, then per block `i`:
//! `blocks.{i}.ln1.{weight,bias} [d]`, `blocks.{i}.attn.qkv.weight [3d, d]` (q, k, v
//! stacked in that order) and `.bias [3d]`, `blocks.{i}.attn.proj.{weight [d, d], bias}`,
//! `blocks.{i}.ln2.{weight,bias}`, `blocks.{i}.mlp.fc.{weight [d_ff, d], bias}`,
//! `blocks.{i}.mlp.proj.{weight [d, d_ff], bias}`; finally `ln_f.{weight,bias}` and
//! `head.weight [vocab, d]`. Linear weights are PyTorch `[out, in]`.

use brigade_autograd::{checkpoint_scope, no_grad, scope, ParamStore, Var};
use brigade_tensor::{DType, Rng, Tensor};

use crate::nn::{Dropout, DropoutRng, Embedding, Init, KvCache, LayerNorm, Linear, Params, RngState, TransformerBlock};
use crate::{Batch, BatchSchema, Model, ModelError, Result};

/// LayerNorm epsilon (PyTorch's default).
const LN_EPS: f64 = 1e-5;
/// Standard deviation of GPT-2's weight initialisation.
const INIT_STD: f64 = 0.02;

/// Shape of the GPT.
#[derive(Debug, Clone, PartialEq)]
pub struct GptConfig {
    /// Vocabulary size (256 for bytes).
    pub vocab: usize,
    /// Residual width `d`.
    pub d_model: usize,
    /// Number of transformer blocks.
    pub n_layers: usize,
    /// Attention heads; must divide `d_model`.
    pub n_heads: usize,
    /// Hidden width of each block's MLP.
    pub d_ff: usize,
    /// Longest sequence the model reads (rows of the positional embedding).
    pub context: usize,
    /// Parameter dtype: F32 for training, F64 for gradient checks.
    pub dtype: DType,
    /// Dropout probability after the embeddings and on each block's two residual branches
    /// (in training mode only); 0 turns it off and leaves the computation bit for bit as
    /// without it.
    pub dropout: f64,
}

impl Default for GptConfig {
    /// The reference: vocab 256, d 256, 4 layers, 4 heads, d_ff 1024, context 128, F32, no
    /// dropout.
    fn default() -> Self {
        GptConfig {
            vocab: 256,
            d_model: 256,
            n_layers: 4,
            n_heads: 4,
            d_ff: 1024,
            context: 128,
            dtype: DType::F32,
            dropout: 0.0,
        }
    }
}

impl GptConfig {
    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.d_model / self.n_heads.max(1)
    }

    /// Errors on zero sizes, heads that do not divide `d_model`, a non-compute dtype, or a
    /// dropout outside `[0, 1]`.
    pub fn validate(&self) -> Result<()> {
        let err = |message: String| Err(ModelError::Config { model: "gpt", message });
        let sizes = [
            ("vocab", self.vocab),
            ("d_model", self.d_model),
            ("n_layers", self.n_layers),
            ("n_heads", self.n_heads),
            ("d_ff", self.d_ff),
            ("context", self.context),
        ];
        if let Some((name, _)) = sizes.iter().find(|(_, v)| *v == 0) {
            return err(format!("`{name}` must be positive"));
        }
        if self.d_model / self.n_heads * self.n_heads != self.d_model {
            return err(format!(
                "n_heads {} does not divide d_model {}",
                self.n_heads, self.d_model
            ));
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

    /// What a batch for this GPT holds: [`BatchSchema::tokens`] of its context and vocabulary.
    pub fn batch_schema(&self) -> BatchSchema {
        BatchSchema::tokens(self.context, self.vocab)
    }
}

/// Mixed into the model seed for the dropout generator, so that it draws apart from the
/// parameter initialisation.
const DROPOUT_SEED: u64 = 0xD50F_0A7E_1234_5678;

/// The GPT: its parameters and its layers.
pub struct Gpt {
    cfg: GptConfig,
    store: ParamStore,
    tok_emb: Embedding,
    pos_emb: Embedding,
    embed_dropout: Dropout,
    blocks: Vec<TransformerBlock>,
    ln_f: LayerNorm,
    head: Linear,
    rng: DropoutRng,
    training: bool,
    /// Every how many blocks one is checkpointed (0: none).
    checkpoint_every: usize,
}

impl Gpt {
    /// Builds the GPT with GPT-2 initialisation from `seed`: N(0, 0.02) for embedding
    /// and linear weights (drawn in registration order), zero biases, LayerNorm 1 and 0. The
    /// dropout generator starts from `seed` too (apart from the initialisation); the model
    /// starts in training mode.
    pub fn new(cfg: GptConfig, seed: u64) -> Result<Gpt> {
        cfg.validate()?;
        let (v, d, init) = (cfg.vocab, cfg.d_model, Init::Normal { std: INIT_STD });
        let (mut rng, mut store) = (Rng::new(seed), ParamStore::new());
        let dropout_rng = DropoutRng::new(seed ^ DROPOUT_SEED);
        let mut p = Params::new(&mut store, &mut rng, cfg.dtype);
        let tok_emb = Embedding::new(&mut p.sub("tok_emb"), v, d, INIT_STD)?;
        let pos_emb = Embedding::new(&mut p.sub("pos_emb"), cfg.context, d, INIT_STD)?;
        let blocks = (0..cfg.n_layers)
            .map(|i| {
                TransformerBlock::new(&mut p.sub(&format!("blocks.{i}")), d, cfg.n_heads, cfg.d_ff, init)?
                    .with_dropout(cfg.dropout, &dropout_rng)
            })
            .collect::<Result<Vec<_>>>()?;
        let ln_f = LayerNorm::new(&mut p.sub("ln_f"), d, LN_EPS)?;
        let head = Linear::new(&mut p.sub("head"), d, v, false, init)?;
        // the scopes `logits` runs them under: the embeddings in `embed`, block i in `blocks.{i}`,
        // the final norm and the head in `head`
        crate::nn::set_units(&mut store, |name| {
            let top = name.split('.').next().unwrap_or(name);
            match top {
                "tok_emb" | "pos_emb" => "embed".to_string(),
                "ln_f" | "head" => "head".to_string(),
                _ => name.split('.').take(2).collect::<Vec<_>>().join("."),
            }
        })?;
        Ok(Gpt {
            embed_dropout: Dropout::new(cfg.dropout, &dropout_rng)?,
            cfg,
            store,
            tok_emb,
            pos_emb,
            blocks,
            ln_f,
            head,
            rng: dropout_rng,
            training: true,
            checkpoint_every: 0,
        })
    }

    /// The configuration it was built from.
    pub fn config(&self) -> &GptConfig {
        &self.cfg
    }

    /// Every how many blocks one is checkpointed (0: none): [`Model::set_activation_checkpointing`].
    pub fn activation_checkpointing(&self) -> usize {
        self.checkpoint_every
    }

    /// True in training mode (the default), false after [`Model::eval`].
    pub fn is_training(&self) -> bool {
        self.training
    }

    /// Checks `tokens` is I64 or U8 `[B, T]` with `1 <= T`; returns `T`.
    fn check_tokens(tokens: &Tensor) -> Result<usize> {
        if tokens.rank() != 2 || tokens.shape()[1] == 0 {
            return Err(ModelError::BadBatch {
                model: "gpt",
                message: format!(
                    "tokens have shape {:?}, expected [batch, time] with time >= 1",
                    tokens.shape()
                ),
            });
        }
        if !matches!(tokens.dtype(), DType::I64 | DType::U8) {
            return Err(ModelError::BadBatch {
                model: "gpt",
                message: format!("tokens are {:?}, expected I64 or U8", tokens.dtype()),
            });
        }
        Ok(tokens.shape()[1])
    }

    /// Next-token logits `[B, T, vocab]` for I64 or U8 `tokens [B, T]`, `T <= context`.
    /// Ops run under scopes `embed`, `blocks.{i}` and `head`; the blocks that
    /// [`Model::set_activation_checkpointing`] names are checkpointed scopes. Dropout acts in
    /// training mode.
    pub fn logits(&self, tokens: &Tensor) -> Result<Var> {
        self.logits_then(tokens, Ok)
    }

    /// [`Gpt::logits`], then `then` of them inside the `head` scope: a loss computed there
    /// runs while a sharded head is still gathered, not in a second entry of its scope that
    /// would gather it again.
    fn logits_then(&self, tokens: &Tensor, then: impl FnOnce(Var) -> Result<Var>) -> Result<Var> {
        let t = Self::check_tokens(tokens)?;
        if t > self.cfg.context {
            return Err(ModelError::ContextTooLong {
                found: t,
                context: self.cfg.context,
            });
        }
        let mut x = scope("embed", || -> Result<Var> {
            let tok = self.tok_emb.forward(tokens)?;
            self.embed_dropout
                .forward(&tok.add(&self.pos_emb.weight.narrow(0, 0, t)?)?)
        })?;
        for (i, blk) in self.blocks.iter().enumerate() {
            let name = format!("blocks.{i}");
            x = if self.checkpoint_every > 0 && i % self.checkpoint_every == 0 {
                let blk = blk.clone();
                checkpoint_scope(&name, &x, self.rng.clone(), move |x: &Var| blk.forward(x))?
            } else {
                scope(&name, || blk.forward(&x))?
            };
        }
        scope("head", || then(self.head.forward(&self.ln_f.forward(&x)?)?))
    }

    /// An empty KV cache for `batch` sequences of up to `context` positions, beside the
    /// parameters (their dtype and device).
    pub fn new_cache(&self, batch: usize) -> Result<KvCache> {
        let w = self.tok_emb.weight.value();
        KvCache::new(
            self.cfg.n_layers,
            batch,
            self.cfg.n_heads,
            self.cfg.head_dim(),
            self.cfg.context,
            w.dtype(),
            w.device(),
        )
    }

    /// Inference with a KV cache: logits `[B, n, vocab]` of `tokens [B, n]` at positions
    /// `cache.len() .. cache.len() + n`, attending to everything the cache holds; the cache
    /// then holds these positions too. Feeding a prompt and then one token at a time gives
    /// [`Gpt::logits`] of the whole sequence (to rounding) while each new token costs one
    /// position. No dropout, no graph. Errors when the cache would pass the context.
    pub fn forward_cached(&self, tokens: &Tensor, cache: &mut KvCache) -> Result<Var> {
        let n = Self::check_tokens(tokens)?;
        let start = cache.len();
        if start + n > self.cfg.context {
            return Err(ModelError::ContextTooLong {
                found: start + n,
                context: self.cfg.context,
            });
        }
        if tokens.shape()[0] != cache.batch() || cache.n_layers() != self.blocks.len() {
            return Err(ModelError::BadBatch {
                model: "gpt",
                message: format!(
                    "tokens have {} rows for a cache of {} rows and {} blocks (the model has {}); build it with Gpt::new_cache",
                    tokens.shape()[0],
                    cache.batch(),
                    cache.n_layers(),
                    self.blocks.len()
                ),
            });
        }
        let logits = no_grad(|| -> Result<Var> {
            let tok = self.tok_emb.forward(tokens)?;
            let mut x = tok.add(&self.pos_emb.weight.narrow(0, start, n)?)?;
            for (i, blk) in self.blocks.iter().enumerate() {
                x = blk.forward_cached(&x, cache.layer(i), start)?;
            }
            self.head.forward(&self.ln_f.forward(&x)?)
        })?;
        cache.advance(n);
        Ok(logits)
    }
}

impl Model for Gpt {
    fn params(&self) -> &ParamStore {
        &self.store
    }

    fn loss(&self, batch: &Batch) -> Result<Var> {
        let (inputs, targets) = batch.shifted_tokens("gpt")?;
        self.logits_then(&inputs, |logits| {
            let logits = logits.reshape(&[targets.numel(), self.cfg.vocab])?;
            Ok(crate::nn::loss_in_f32(&logits)?.cross_entropy(&targets)?)
        })
    }

    /// Logits `[B, T, vocab]` of the batch's `tokens [B, T]` (inputs only: `T <= context`).
    fn forward(&self, batch: &Batch) -> Result<Var> {
        self.logits(batch.tensor("gpt", "tokens")?)
    }

    fn layer_names(&self) -> Vec<String> {
        let mut names = vec!["embed".to_string()];
        names.extend((0..self.blocks.len()).map(|i| format!("blocks.{i}")));
        names.push("head".to_string());
        names
    }

    fn batch_schema(&self) -> Option<BatchSchema> {
        Some(self.cfg.batch_schema())
    }

    fn set_training(&mut self, training: bool) {
        self.training = training;
        self.embed_dropout.set_training(training);
        self.blocks.iter_mut().for_each(|b| b.set_training(training));
    }

    fn set_activation_checkpointing(&mut self, every: usize) -> Result<()> {
        self.checkpoint_every = every;
        Ok(())
    }

    fn rng_state(&self) -> Option<RngState> {
        Some(self.rng.state())
    }

    fn set_rng_state(&mut self, state: RngState) -> Result<()> {
        self.rng.set_state(state);
        Ok(())
    }
}
