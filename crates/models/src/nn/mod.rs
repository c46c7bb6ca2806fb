//! Layers to build models from, PyTorch style: each registers its parameters under a name
//! prefix in a [`ParamStore`] (so state dicts carry PyTorch's names) and computes with the
//! autograd ops. A layer records its ops under whatever [`brigade_autograd::scope`] its caller
//! opened: a model opens one scope per block (`layers.2`, `blocks.0`), which is what the
//! gradient-ready bus reports and a timeline shows as one backward span.
//!
//! [`Sequential`] chains layers (each a [`Layer`]) into a whole model with its [`Loss`], its
//! parameters in a store of its own: a model without hand-made `ParamStore` wiring.
//!
//! Layers whose behaviour depends on the mode ([`Dropout`]) have a `set_training` switch,
//! passed down by the blocks and models that hold them (PyTorch's `module.train(mode)`).
//!
//! ```
//! use brigade_models::nn::{Activation, Init, Linear, Params};
//! use brigade_autograd::ParamStore;
//! use brigade_tensor::{DType, Rng};
//!
//! let mut store = ParamStore::new();
//! let mut rng = Rng::new(0);
//! let mut p = Params::new(&mut store, &mut rng, DType::F32);
//! let fc = Linear::new(&mut p.sub("layers.0"), 4, 8, true, Init::TorchLinear).unwrap();
//! assert_eq!(fc.weight.name(), Some("layers.0.weight"));
//! # let _ = Activation::Relu;
//! ```

use std::cell::Cell;

use brigade_autograd::{param_init_deferred, InitDraw, ParamInit, ParamStore, Var};
use brigade_tensor::{DType, Rng, Tensor};

use crate::Result;

mod dropout;
mod kv_cache;
mod sequential;

pub use dropout::{Dropout, DropoutRng, RngState};
pub use kv_cache::{KvCache, LayerKvCache};
pub use sequential::{Layer, Loss, Sequential};

/// Registers parameters under a name prefix, drawing initial values from one generator in
/// registration order (so the same seed gives the same model, parameter for parameter). Inside
/// [`brigade_autograd::defer_param_init`] it registers them without values, each with the
/// recipe that draws any range of them exactly as the whole draw would.
pub struct Params<'a> {
    store: &'a mut ParamStore,
    rng: &'a mut Rng,
    dtype: DType,
    prefix: String,
}

impl<'a> Params<'a> {
    /// Parameters of `dtype` registered in `store`, initial values drawn from `rng`.
    pub fn new(store: &'a mut ParamStore, rng: &'a mut Rng, dtype: DType) -> Params<'a> {
        Params {
            store,
            rng,
            dtype,
            prefix: String::new(),
        }
    }

    /// The same store under the prefix `name` (`blocks.0`, then `attn` gives `blocks.0.attn`).
    pub fn sub(&mut self, name: &str) -> Params<'_> {
        let prefix = if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.prefix)
        };
        Params {
            store: self.store,
            rng: self.rng,
            dtype: self.dtype,
            prefix,
        }
    }

    /// The parameter dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    fn full_name(&self, name: &str) -> String {
        if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.prefix)
        }
    }

    /// Registers `value` as `prefix.name`.
    pub fn add(&mut self, name: &str, value: Tensor) -> Result<Var> {
        Ok(self.store.add(self.full_name(name), value)?)
    }

    /// Registers `prefix.name` of `shape` without values, drawn later by the recipe of `draw`
    /// from the generator as it stands; the generator moves past the whole parameter now, as
    /// drawing it would have moved it ([`brigade_autograd::ParamInit`]).
    fn add_deferred(&mut self, name: &str, shape: &[usize], draw: InitDraw) -> Result<Var> {
        let init = ParamInit::new(draw, self.dtype, self.rng);
        let numel: usize = shape.iter().product();
        self.rng.skip(init.outputs_per_element() * numel as u64);
        Ok(self.store.add_deferred(self.full_name(name), shape, self.dtype, init)?)
    }

    /// A parameter drawn from `U(-bound, bound)`.
    pub fn uniform(&mut self, name: &str, shape: &[usize], bound: f64) -> Result<Var> {
        if param_init_deferred() {
            return self.add_deferred(name, shape, InitDraw::Uniform { lo: -bound, hi: bound });
        }
        let t = Tensor::rand_uniform(shape, -bound, bound, self.dtype, self.rng);
        self.add(name, t)
    }

    /// A parameter drawn from `N(0, std²)`.
    pub fn normal(&mut self, name: &str, shape: &[usize], std: f64) -> Result<Var> {
        if param_init_deferred() {
            return self.add_deferred(name, shape, InitDraw::Normal { std });
        }
        let t = Tensor::randn(shape, std, self.dtype, self.rng);
        self.add(name, t)
    }

    /// A parameter filled with `v` (draws nothing).
    pub fn full(&mut self, name: &str, shape: &[usize], v: f64) -> Result<Var> {
        if param_init_deferred() {
            return self.add_deferred(name, shape, InitDraw::Full { value: v });
        }
        let t = Tensor::full(shape, v, self.dtype);
        self.add(name, t)
    }
}

/// How a [`Linear`] (and the layers built of it) is initialised.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// PyTorch's `nn.Linear` default (kaiming-uniform with `a = sqrt(5)`): weight and bias both
    /// from `U(-1/sqrt(in), 1/sqrt(in))`, weight drawn first.
    TorchLinear,
    /// GPT-2's: weight from `N(0, std²)`, bias zero.
    Normal {
        /// Standard deviation of the weight.
        std: f64,
    },
}

/// An activation function.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `max(x, 0)`.
    Relu,
    /// The exact (erf) GELU, PyTorch's default.
    Gelu,
}

impl Activation {
    /// Applies the function.
    pub fn apply(self, x: &Var) -> Result<Var> {
        Ok(match self {
            Activation::Relu => x.relu()?,
            Activation::Gelu => x.gelu()?,
        })
    }
}

/// `y = x Wᵀ + b` over the last dimension, with PyTorch's `[out, in]` weight.
#[derive(Clone)]
pub struct Linear {
    /// `weight [out, in]`.
    pub weight: Var,
    /// `bias [out]`, if any.
    pub bias: Option<Var>,
}

impl Linear {
    /// Registers `weight` (and `bias`) under `p`'s prefix.
    pub fn new(p: &mut Params, inp: usize, out: usize, bias: bool, init: Init) -> Result<Linear> {
        let (weight, bias) = match init {
            Init::TorchLinear => {
                let bound = 1.0 / (inp as f64).sqrt();
                let w = p.uniform("weight", &[out, inp], bound)?;
                (
                    w,
                    if bias {
                        Some(p.uniform("bias", &[out], bound)?)
                    } else {
                        None
                    },
                )
            }
            Init::Normal { std } => {
                let w = p.normal("weight", &[out, inp], std)?;
                (w, if bias { Some(p.full("bias", &[out], 0.0)?) } else { None })
            }
        };
        Ok(Linear { weight, bias })
    }

    /// `x [.., in] -> [.., out]`.
    pub fn forward(&self, x: &Var) -> Result<Var> {
        Ok(x.linear(&self.weight, self.bias.as_ref())?)
    }
}

/// A lookup table `weight [num, dim]`: row `i` is token `i`'s vector.
#[derive(Clone)]
pub struct Embedding {
    /// `weight [num, dim]`.
    pub weight: Var,
}

impl Embedding {
    /// Registers `weight`, drawn from `N(0, std²)`.
    pub fn new(p: &mut Params, num: usize, dim: usize, std: f64) -> Result<Embedding> {
        Ok(Embedding {
            weight: p.normal("weight", &[num, dim], std)?,
        })
    }

    /// The rows of I64 or U8 `ids [..]`: `[.., dim]`.
    pub fn forward(&self, ids: &Tensor) -> Result<Var> {
        Ok(self.weight.embedding(ids)?)
    }
}

/// Layer normalisation over the last dimension with a learned scale and shift.
#[derive(Clone)]
pub struct LayerNorm {
    /// Scale `[d]` (initialised to 1).
    pub weight: Var,
    /// Shift `[d]` (initialised to 0).
    pub bias: Var,
    /// Added to the variance (PyTorch's default 1e-5).
    pub eps: f64,
}

impl LayerNorm {
    /// PyTorch's epsilon.
    pub const DEFAULT_EPS: f64 = 1e-5;

    /// Registers `weight` (ones) and `bias` (zeros).
    pub fn new(p: &mut Params, d: usize, eps: f64) -> Result<LayerNorm> {
        Ok(LayerNorm {
            weight: p.full("weight", &[d], 1.0)?,
            bias: p.full("bias", &[d], 0.0)?,
            eps,
        })
    }

    /// Normalises `x [.., d]`.
    pub fn forward(&self, x: &Var) -> Result<Var> {
        Ok(x.layer_norm(&self.weight, &self.bias, self.eps)?)
    }
}

/// Causal multi-head self-attention: `qkv` (q, k, v stacked in that order) projects, each head
/// attends to earlier positions with scores scaled by `1/sqrt(head_dim)`, `proj` mixes heads.
#[derive(Clone)]
pub struct CausalSelfAttention {
    /// `[3d, d]` input projection (registered as `qkv`).
    pub qkv: Linear,
    /// `[d, d]` output projection (registered as `proj`).
    pub proj: Linear,
    /// Number of heads (divides `d`).
    pub n_heads: usize,
}

impl CausalSelfAttention {
    /// Registers `qkv` and `proj` under `p`'s prefix.
    pub fn new(p: &mut Params, d: usize, n_heads: usize, init: Init) -> Result<CausalSelfAttention> {
        let qkv = Linear::new(&mut p.sub("qkv"), d, 3 * d, true, init)?;
        let proj = Linear::new(&mut p.sub("proj"), d, d, true, init)?;
        Ok(CausalSelfAttention { qkv, proj, n_heads })
    }

    /// `h [B, T, d] -> [B, T, d]`: the heads attend in one fused op
    /// ([`Var::causal_attention`]) straight from the packed projection (or, inside
    /// [`with_reference_attention`], through [`CausalSelfAttention::forward_reference`]).
    pub fn forward(&self, h: &Var) -> Result<Var> {
        if REFERENCE_ATTENTION.with(Cell::get) {
            return self.forward_reference(h);
        }
        let qkv = self.qkv.forward(h)?;
        self.proj.forward(&qkv.causal_attention(self.n_heads)?)
    }

    /// The same attention composed of primitive ops (per-head copies, a batched matmul, a
    /// separate scale, mask and softmax): the reference the fused op is tested and
    /// benchmarked against. It gives the same bits as [`CausalSelfAttention::forward`].
    pub fn forward_reference(&self, h: &Var) -> Result<Var> {
        let shape = h.shape();
        let (b, t, d, nh) = (shape[0], shape[1], self.proj.weight.shape()[0], self.n_heads);
        let hd = d / nh;
        let qkv = self.qkv.forward(h)?;
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
        self.proj.forward(&y)
    }
}

thread_local! {
    static REFERENCE_ATTENTION: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with every [`CausalSelfAttention`] on this thread computed by
/// [`CausalSelfAttention::forward_reference`]: the A/B switch of `brigade bench ops --ab`
/// and of the parity tests (thread-local, so parallel tests do not see it).
pub fn with_reference_attention<R>(f: impl FnOnce() -> R) -> R {
    let prev = REFERENCE_ATTENTION.with(|r| r.replace(true));
    let out = f();
    REFERENCE_ATTENTION.with(|r| r.set(prev));
    out
}

/// A transformer block's feed-forward part: `proj(act(fc(x)))`.
#[derive(Clone)]
pub struct MlpBlock {
    /// `[d_ff, d]` (registered as `fc`).
    pub fc: Linear,
    /// `[d, d_ff]` (registered as `proj`).
    pub proj: Linear,
    /// Applied between the two.
    pub activation: Activation,
}

impl MlpBlock {
    /// Registers `fc` and `proj` under `p`'s prefix.
    pub fn new(p: &mut Params, d: usize, d_ff: usize, activation: Activation, init: Init) -> Result<MlpBlock> {
        let fc = Linear::new(&mut p.sub("fc"), d, d_ff, true, init)?;
        let proj = Linear::new(&mut p.sub("proj"), d_ff, d, true, init)?;
        Ok(MlpBlock { fc, proj, activation })
    }

    /// `x [.., d] -> [.., d]`.
    pub fn forward(&self, x: &Var) -> Result<Var> {
        self.proj.forward(&self.activation.apply(&self.fc.forward(x)?)?)
    }
}

/// A pre-LayerNorm transformer block (GPT-2's): `x + drop(attn(ln1(x)))`, then
/// `x + drop(mlp(ln2(x)))`, parameters under `ln1`, `attn`, `ln2`, `mlp` (GELU feed-forward).
/// The residual dropouts (nanoGPT's) are off unless [`TransformerBlock::with_dropout`] turns
/// them on; the attention probabilities are not dropped (the fused attention has no dropout).
#[derive(Clone)]
pub struct TransformerBlock {
    /// Normalises the attention's input.
    pub ln1: LayerNorm,
    /// Causal self-attention.
    pub attn: CausalSelfAttention,
    /// Normalises the feed-forward's input.
    pub ln2: LayerNorm,
    /// The feed-forward part.
    pub mlp: MlpBlock,
    /// Applied to the attention's output before the residual add.
    pub attn_dropout: Dropout,
    /// Applied to the feed-forward's output before the residual add.
    pub mlp_dropout: Dropout,
}

impl TransformerBlock {
    /// Registers `ln1`, `attn`, `ln2`, `mlp` under `p`'s prefix: width `d`, `n_heads` heads, a
    /// `d_ff`-wide GELU feed-forward, LayerNorms with PyTorch's epsilon; no dropout.
    pub fn new(p: &mut Params, d: usize, n_heads: usize, d_ff: usize, init: Init) -> Result<TransformerBlock> {
        Ok(TransformerBlock {
            ln1: LayerNorm::new(&mut p.sub("ln1"), d, LayerNorm::DEFAULT_EPS)?,
            attn: CausalSelfAttention::new(&mut p.sub("attn"), d, n_heads, init)?,
            ln2: LayerNorm::new(&mut p.sub("ln2"), d, LayerNorm::DEFAULT_EPS)?,
            mlp: MlpBlock::new(&mut p.sub("mlp"), d, d_ff, Activation::Gelu, init)?,
            attn_dropout: Dropout::off(),
            mlp_dropout: Dropout::off(),
        })
    }

    /// The same block with residual dropout of probability `p` drawn from `rng` (the model's
    /// generator). `p = 0` keeps it off.
    pub fn with_dropout(mut self, p: f64, rng: &DropoutRng) -> Result<TransformerBlock> {
        self.attn_dropout = Dropout::new(p, rng)?;
        self.mlp_dropout = Dropout::new(p, rng)?;
        Ok(self)
    }

    /// Training (dropout on) or evaluation (dropout off) mode.
    pub fn set_training(&mut self, training: bool) {
        self.attn_dropout.set_training(training);
        self.mlp_dropout.set_training(training);
    }

    /// `x [B, T, d] -> [B, T, d]`.
    pub fn forward(&self, x: &Var) -> Result<Var> {
        let a = self.attn_dropout.forward(&self.attn.forward(&self.ln1.forward(x)?)?)?;
        let x = x.add(&a)?;
        let m = self.mlp_dropout.forward(&self.mlp.forward(&self.ln2.forward(&x)?)?)?;
        Ok(x.add(&m)?)
    }

    /// Inference on `x [B, n, d]` at positions `start..start + n`, attending to the keys and
    /// values `cache` holds for `0..start` and writing its own there
    /// ([`CausalSelfAttention::forward_cached`]). No dropout (as in evaluation mode), no graph.
    pub fn forward_cached(&self, x: &Var, cache: &LayerKvCache, start: usize) -> Result<Var> {
        let x = x.add(&self.attn.forward_cached(&self.ln1.forward(x)?, cache, start)?)?;
        Ok(x.add(&self.mlp.forward(&self.ln2.forward(&x)?)?)?)
    }
}

/// Names each parameter's unit (`ParamStore::set_unit`): the module scope, `unit(name)`, under
/// which the model's forward reads it (what a parameter-sharding policy gathers as one).
pub fn set_units(store: &mut ParamStore, unit: impl Fn(&str) -> String) -> Result<()> {
    let names: Vec<String> = store
        .params()
        .iter()
        .map(|p| p.name().unwrap_or_default().to_string())
        .collect();
    for name in names {
        store.set_unit(&name, &unit(&name))?;
    }
    Ok(())
}

/// The logits a loss reads: 16-bit logits widened to f32 (the gradient narrowed back), as
/// autocast runs the loss in f32; f32 and f64 logits as they are.
pub fn loss_in_f32(logits: &Var) -> Result<Var> {
    Ok(match logits.value().dtype() {
        DType::BF16 | DType::F16 => logits.to_dtype(DType::F32)?,
        _ => logits.clone(),
    })
}
