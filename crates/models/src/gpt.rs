//! A byte-level decoder-only transformer (GPT-2 style, pre-LayerNorm).
//!
//! `x = tok_emb[t] + pos_emb[p]`; per block `x = x + attn(ln1(x)); x = x + mlp(ln2(x))`
//! with causal multi-head attention scaled by `1/sqrt(head_dim)` and an exact-GELU MLP;
//! then `ln_f` and an untied, bias-free output head. The loss is next-token
//! cross-entropy averaged over every position.
//!
//! Parameter names, layouts and registration order (the DDP bucket order):
//! `tok_emb.weight [vocab, d]`, `pos_emb.weight [context, d]`, then per block `i`:
//! `blocks.{i}.ln1.{weight,bias} [d]`, `blocks.{i}.attn.qkv.weight [3d, d]` (q, k, v
//! stacked in that order) and `.bias [3d]`, `blocks.{i}.attn.proj.{weight [d, d], bias}`,
//! `blocks.{i}.ln2.{weight,bias}`, `blocks.{i}.mlp.fc.{weight [d_ff, d], bias}`,
//! `blocks.{i}.mlp.proj.{weight [d, d_ff], bias}`; finally `ln_f.{weight,bias}` and
//! `head.weight [vocab, d]`. Linear weights are PyTorch `[out, in]`.

use brigade_autograd::{scope, ParamStore, Var};
use brigade_tensor::{DType, Rng, Tensor};

use crate::{Batch, Model, ModelError, Result};

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
}

impl Default for GptConfig {
    /// The reference: vocab 256, d 256, 4 layers, 4 heads, d_ff 1024, context 128, F32.
    fn default() -> Self {
        GptConfig {
            vocab: 256,
            d_model: 256,
            n_layers: 4,
            n_heads: 4,
            d_ff: 1024,
            context: 128,
            dtype: DType::F32,
        }
    }
}

impl GptConfig {
    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.d_model / self.n_heads.max(1)
    }

    /// Errors on zero sizes, heads that do not divide `d_model`, or a non-compute dtype.
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
        if !self.dtype.is_compute() {
            return err(format!(
                "dtype {:?} cannot be trained; use F32 (or F64 for gradient checks)",
                self.dtype
            ));
        }
        Ok(())
    }
}

/// One transformer block's parameters.
struct Block {
    ln1: (Var, Var),
    qkv: (Var, Var),
    attn_proj: (Var, Var),
    ln2: (Var, Var),
    fc: (Var, Var),
    mlp_proj: (Var, Var),
}

/// The GPT: its parameters and handles to them.
pub struct Gpt {
    cfg: GptConfig,
    store: ParamStore,
    tok_emb: Var,
    pos_emb: Var,
    blocks: Vec<Block>,
    ln_f: (Var, Var),
    head: Var,
}

/// Registers parameters in order, drawing GPT-2 initial values from one generator.
struct Init<'a> {
    store: &'a mut ParamStore,
    rng: Rng,
    dtype: DType,
}

impl Init<'_> {
    /// A weight drawn from N(0, 0.02).
    fn normal(&mut self, name: &str, shape: &[usize]) -> Result<Var> {
        let t = Tensor::randn(shape, INIT_STD, self.dtype, &mut self.rng);
        Ok(self.store.add(name, t)?)
    }

    /// A constant-filled parameter (biases 0, LayerNorm weight 1).
    fn full(&mut self, name: &str, shape: &[usize], v: f64) -> Result<Var> {
        Ok(self.store.add(name, Tensor::full(shape, v, self.dtype))?)
    }

    fn linear(&mut self, prefix: &str, out: usize, inp: usize) -> Result<(Var, Var)> {
        Ok((
            self.normal(&format!("{prefix}.weight"), &[out, inp])?,
            self.full(&format!("{prefix}.bias"), &[out], 0.0)?,
        ))
    }

    fn layer_norm(&mut self, prefix: &str, d: usize) -> Result<(Var, Var)> {
        Ok((
            self.full(&format!("{prefix}.weight"), &[d], 1.0)?,
            self.full(&format!("{prefix}.bias"), &[d], 0.0)?,
        ))
    }
}

impl Gpt {
    /// Builds the GPT with GPT-2 initialisation from `seed`: N(0, 0.02) for embedding
    /// and linear weights (drawn in registration order), zero biases, LayerNorm 1 and 0.
    pub fn new(cfg: GptConfig, seed: u64) -> Result<Gpt> {
        cfg.validate()?;
        let (v, d, ff) = (cfg.vocab, cfg.d_model, cfg.d_ff);
        let mut store = ParamStore::new();
        let mut init = Init {
            store: &mut store,
            rng: Rng::new(seed),
            dtype: cfg.dtype,
        };
        let tok_emb = init.normal("tok_emb.weight", &[v, d])?;
        let pos_emb = init.normal("pos_emb.weight", &[cfg.context, d])?;
        let mut blocks = Vec::with_capacity(cfg.n_layers);
        for i in 0..cfg.n_layers {
            let p = format!("blocks.{i}");
            blocks.push(Block {
                ln1: init.layer_norm(&format!("{p}.ln1"), d)?,
                qkv: init.linear(&format!("{p}.attn.qkv"), 3 * d, d)?,
                attn_proj: init.linear(&format!("{p}.attn.proj"), d, d)?,
                ln2: init.layer_norm(&format!("{p}.ln2"), d)?,
                fc: init.linear(&format!("{p}.mlp.fc"), ff, d)?,
                mlp_proj: init.linear(&format!("{p}.mlp.proj"), d, ff)?,
            });
        }
        let ln_f = init.layer_norm("ln_f", d)?;
        let head = init.normal("head.weight", &[v, d])?;
        Ok(Gpt {
            cfg,
            store,
            tok_emb,
            pos_emb,
            blocks,
            ln_f,
            head,
        })
    }

    /// The configuration it was built from.
    pub fn config(&self) -> &GptConfig {
        &self.cfg
    }

    /// Next-token logits `[B, T, vocab]` for I64 or U8 `tokens [B, T]`, `T <= context`.
    /// Ops run under scopes `embed`, `blocks.{i}` and `head`.
    pub fn logits(&self, tokens: &Tensor) -> Result<Var> {
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
        let (b, t) = (tokens.shape()[0], tokens.shape()[1]);
        if t > self.cfg.context {
            return Err(ModelError::ContextTooLong {
                found: t,
                context: self.cfg.context,
            });
        }
        let mut x = scope("embed", || -> Result<Var> {
            let tok = self.tok_emb.embedding(tokens)?;
            Ok(tok.add(&self.pos_emb.narrow(0, 0, t)?)?)
        })?;
        for (i, blk) in self.blocks.iter().enumerate() {
            x = scope(&format!("blocks.{i}"), || self.block(blk, &x, b, t))?;
        }
        scope("head", || -> Result<Var> {
            let h = x.layer_norm(&self.ln_f.0, &self.ln_f.1, LN_EPS)?;
            Ok(h.linear(&self.head, None)?)
        })
    }

    fn block(&self, blk: &Block, x: &Var, b: usize, t: usize) -> Result<Var> {
        let h = x.layer_norm(&blk.ln1.0, &blk.ln1.1, LN_EPS)?;
        let x = x.add(&self.attention(blk, &h, b, t)?)?;
        let h = x.layer_norm(&blk.ln2.0, &blk.ln2.1, LN_EPS)?;
        let h = h.linear(&blk.fc.0, Some(&blk.fc.1))?.gelu()?;
        let h = h.linear(&blk.mlp_proj.0, Some(&blk.mlp_proj.1))?;
        Ok(x.add(&h)?)
    }

    /// Causal multi-head self-attention of `h [B, T, d]`.
    fn attention(&self, blk: &Block, h: &Var, b: usize, t: usize) -> Result<Var> {
        let (d, nh, hd) = (self.cfg.d_model, self.cfg.n_heads, self.cfg.head_dim());
        let qkv = h.linear(&blk.qkv.0, Some(&blk.qkv.1))?;
        let heads = |i: usize| -> Result<Var> {
            // [B, T, d] -> [B, T, H, hd] -> [B, H, T, hd]
            Ok(qkv
                .narrow(2, i * d, d)?
                .contiguous()?
                .reshape(&[b, t, nh, hd])?
                .permute(&[0, 2, 1, 3])?)
        };
        let (q, k, v) = (heads(0)?, heads(1)?, heads(2)?);
        let scores = q.matmul(&k.transpose(2, 3)?)?.mul_scalar(1.0 / (hd as f64).sqrt())?;
        let att = scores.causal_mask()?.softmax()?;
        let y = att.matmul(&v)?.permute(&[0, 2, 1, 3])?.reshape(&[b, t, d])?;
        Ok(y.linear(&blk.attn_proj.0, Some(&blk.attn_proj.1))?)
    }
}

impl Model for Gpt {
    fn params(&self) -> &ParamStore {
        &self.store
    }

    fn loss(&self, batch: &Batch) -> Result<Var> {
        let Batch::Tokens { tokens } = batch else {
            return Err(ModelError::WrongBatch {
                model: "gpt",
                expected: "tokens",
                found: batch.kind(),
            });
        };
        if tokens.rank() != 2 || tokens.shape()[1] < 2 {
            return Err(ModelError::BadBatch {
                model: "gpt",
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
        let logits = self.logits(&inputs)?;
        scope("head", || -> Result<Var> {
            Ok(logits
                .reshape(&[b * (n - 1), self.cfg.vocab])?
                .cross_entropy(&targets)?)
        })
    }

    fn layer_names(&self) -> Vec<String> {
        let mut names = vec!["embed".to_string()];
        names.extend((0..self.blocks.len()).map(|i| format!("blocks.{i}")));
        names.push("head".to_string());
        names
    }
}
