//! The device contract: what a backend (`cpu/`, `cuda/`, the counting fake device `fake/`)
//! provides so that every [`crate::Tensor`] op, stream and event can run on its device.
//!
//! The front end (`Tensor` and `src/ops/`, `Stream` and `Event` in `stream.rs`) owns everything
//! device-independent: shape and dtype checks, broadcasting, views, index validation, errors
//! that name the op. It then locks the storages, checks that none is lent out, and calls exactly
//! one method of this contract on the backend that holds them, through the one dispatch over
//! [`crate::storage::DeviceStorage`] (`dispatch!` in `storage.rs`; `on_device!` there for what
//! is made on a device: allocations, copies in, streams). A backend therefore only allocates,
//! copies in and out, orders its streams, and runs the kernels below, and it may rely on the
//! preconditions each method states: they are checked before it is called.
//!
//! The contract is spelled once, here: [`BackendStorage`] (memory, copies, streams) with one
//! supertrait per family of kernels ([`Elementwise`], [`Reduce`], [`Matmul`], [`Nn`],
//! [`Attention`], [`InPlace`], [`Indexing`]), and [`BackendStream`] / [`BackendEvent`]. Each backend
//! implements each trait once, the kernel in the method itself, in the file of its family
//! (`cpu/elementwise.rs` is `impl Elementwise for Buffer`). A backend runs every call on the
//! stream current for its device ([`crate::Stream::scope`], else the device's compute stream)
//! and never waits on the host inside a method, except in [`BackendStorage::to_cpu`].
//!
//! Conventions for every method:
//! - Each storage comes with the [`Layout`] of the view being read or written (shape,
//!   strides in elements, offset into the storage). Unless a method says *any layout*, the
//!   front end passes a contiguous layout (row-major, no gaps) that may start at a
//!   nonzero offset: a gradient is a view into a flat DDP bucket.
//! - Outputs are fresh contiguous storages, offset 0, exactly the output's element
//!   count, on the same device as the inputs, of the inputs' dtype unless stated.
//! - Float kernels are called with float storages only (`DType::is_float`); all operands
//!   of one call share one dtype and one device. `F16` and `BF16` storages compute as
//!   autocast does: the CPU widens the operands to f32 exactly, runs its f32 kernel (f32
//!   accumulation in GEMMs, reductions, softmax, layer norm and the loss) and rounds each
//!   output once to the storage's dtype (`cpu/f16_storage.rs`); a backend without 16-bit
//!   kernels refuses them with a typed `UnsupportedDType` saying so. The fused optimizer
//!   steps take f32 only.
//! - The numbers are the CPU backend's (`src/cpu/`): the expressions written in these
//!   docs, evaluated left to right in the storage's dtype, without fused multiply-add
//!   unless the doc says "any order". A GPU backend matches them to rounding; the fused
//!   optimizer steps are specified exactly so that a backend can match them bit for bit.
//! - Errors are [`crate::TensorError`]s; a device fault is `DeviceUnavailable` naming
//!   what failed, never a panic.
//!
//! **Adding a backend.**
//! 1. A folder of its own (`src/<name>/`) with a storage type implementing [`BackendStorage`]:
//!    its properties (`dtype`, `device`, `len`, `empty_like`, `int_range`); `zeros_on` and
//!    `upload` (what `Tensor::zeros_on`, `Tensor::to_device` and `Storage::from_buffer` /
//!    `from_host_vec` reach); `to_cpu` and `into_cpu` (what `Tensor::to_vec` / `to_buffer` and
//!    `Storage::into_buffer` / `into_host_vec` reach); `copy_strided` and `to_dtype`; `lend_raw`
//!    (what `Storage::device_memory` reaches); `compute_stream`, `new_stream` and
//!    `scoped_stream` (what `Stream::compute`, `Stream::new` and `Stream::current` reach).
//!    Then the seven kernel families, one `impl` each, in files named as the CPU's
//!    (`crate::composed` builds attention from the other families for a backend without a
//!    fused kernel, as CUDA does).
//! 2. A stream type implementing [`BackendStream`] and an event type implementing
//!    [`BackendEvent`]: [`crate::Stream`] and [`crate::Event`] hold them; `Stream::scope`
//!    pushes [`BackendStream::scoped`] on the scope stack (`scope.rs`), where the backend's
//!    own ops and its `scoped_stream` find it.
//! 3. In `storage.rs`: a [`Device`] variant (with its name in `Display`), a
//!    [`crate::storage::DeviceStorage`] variant, its `variant!` line, and its arm in
//!    `dispatch!` (both forms) and in `on_device!`.
//! 4. Its device in `test_device!` (`testing.rs`), so that every op's test and
//!    `every_piece_of_the_device_contract_answers` (below) run on it.
//!
//! The compiler refuses a backend that lacks a method, a variant or an arm; the test refuses
//! one whose piece only answers with an error.

use std::any::Any;
use std::sync::Arc;
use std::time::Duration;

use crate::scope::ScopedStream;
use crate::{Buffer, DType, Device, Layout, Result, TensorError};

/// Elementwise maps of one tensor (the front end's `neg`, `exp`, ... `affine`, `powf`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum UnaryOp {
    /// `-x`.
    Neg,
    /// `e^x`.
    Exp,
    /// Natural logarithm.
    Ln,
    /// Square root.
    Sqrt,
    /// `x <= 0 ? 0 : x` (a NaN stays NaN, as in PyTorch; written so on every backend).
    Relu,
    /// `0.5 * x * (1 + erf(x * FRAC_1_SQRT_2))`, constants rounded to the dtype. (The
    /// CPU's f32 evaluates erf by a polynomial within 5e-7 of it, so that it vectorizes.)
    Gelu,
    /// `x * x`.
    Sqr,
    /// `x * mul + add`, with `mul` and `add` rounded to the dtype first.
    Affine { mul: f64, add: f64 },
    /// `powf(x, p)`, with `p` rounded to the dtype first.
    Powf(f64),
    /// `sin(x)`.
    Sin,
    /// `cos(x)`.
    Cos,
    /// `|x|`.
    Abs,
    /// `x > 0 ? 1 : (x < 0 ? -1 : x * 0)`: 0 at 0, a NaN stays NaN.
    Sign,
    /// `x` rounded to the nearest integer, half to even (`round_ties_even`, CUDA's `rint`).
    Round,
    /// `x < min ? min : (x > max ? max : x)`, bounds rounded to the dtype first (a NaN stays
    /// NaN; an infinite bound clamps nothing on that side).
    Clamp { min: f64, max: f64 },
    /// `min <= x && x <= max ? 1 : 0`, bounds rounded to the dtype first: where a clamp
    /// passes its gradient.
    InRange { min: f64, max: f64 },
    /// `x == 0 ? 1 : 0`: which elements equal a reduction's result once it is subtracted.
    IsZero,
}

/// Elementwise maps of two tensors broadcast to one shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BinaryOp {
    /// `a + b`.
    Add,
    /// `a - b`.
    Sub,
    /// `a * b`.
    Mul,
    /// `a / b`.
    Div,
    /// `a > 0 ? b : 0` (`a = x`, `b = g`): the ReLU derivative applied to a gradient.
    ReluBackward,
    /// `b * gelu'(a)` with `gelu'(x) = cdf + x * pdf`,
    /// `cdf = 0.5 * (1 + erf(x * FRAC_1_SQRT_2))`, `pdf = (1/sqrt(2 pi)) * exp(-(x * x) * 0.5)`
    /// (the CPU's f32 with polynomial erf and exp, as for `Gelu`).
    GeluBackward,
}

/// Reductions over a set of dimensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReduceOp {
    /// Sum (any order: the CPU adds rows when the reduced dims lead, else runs left to right).
    Sum,
    /// Maximum (`-inf` for an empty run); any NaN in the run gives NaN, wherever it comes
    /// (PyTorch's `max`), so the result does not depend on the order of the reduction.
    Max,
}

/// The f32 scalars of one fused SGD update, derived from the hyper-parameters by the
/// front end (`Tensor::sgd_step`) so that every backend computes with the same bits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct SgdScalars {
    /// Learning rate, `lr as f32`.
    pub lr: f32,
    /// Momentum, `momentum as f32` (the buffer is used iff one is passed).
    pub momentum: f32,
    /// L2 weight decay, `weight_decay as f32`; skipped when exactly 0.
    pub weight_decay: f32,
    /// The buffer is set to the gradient instead of decayed into (PyTorch's first step).
    pub is_first_step: bool,
}

/// The f32 scalars of one fused AdamW update, derived from the hyper-parameters and the
/// step count by the front end (`Tensor::adamw_step`) exactly as `torch.optim.AdamW` does.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct AdamWScalars {
    /// `(1 - lr * weight_decay) as f32`: decoupled weight decay.
    pub decay: f32,
    /// `beta1 as f32`.
    pub beta1: f32,
    /// `(1 - beta1) as f32`.
    pub one_minus_beta1: f32,
    /// `beta2 as f32`.
    pub beta2: f32,
    /// `(1 - beta2) as f32`.
    pub one_minus_beta2: f32,
    /// `(lr / (1 - beta1^t)) as f32`.
    pub step_size: f32,
    /// `sqrt(1 - beta2^t) as f32`.
    pub bias_correction2_sqrt: f32,
    /// `eps as f32`.
    pub eps: f32,
}

/// The storage of one backend: memory on one device, how it is allocated, copied and lent, the
/// streams that order work on it, and (through the supertraits, one per family of kernels) every
/// kernel the front end calls. Methods taking `&mut self` write through the given view in place;
/// all others return new storage. Preconditions named in a method's doc are checked by the
/// front end.
pub(crate) trait BackendStorage:
    Sized + Elementwise + Reduce + Matmul + Nn + Attention + InPlace + Indexing
{
    /// The element type.
    fn dtype(&self) -> DType;

    /// The device the memory lives on.
    fn device(&self) -> Device;

    /// Number of elements.
    fn len(&self) -> usize;

    /// A zero-length storage of the same dtype and device: what stays behind in a tensor
    /// whose storage is lent out (`Tensor::lend_storage`), so any access fails.
    fn empty_like(&self) -> Self;

    /// What the storage knows of its integer values without reading them: the smallest and
    /// largest id it was uploaded with (device storages remember it from the host copy in,
    /// and a gather keeps it), `None` when unknown. The front end's index checks use it so
    /// that validating ids on a device needs no copy back; with `None` they read the ids.
    fn int_range(&self) -> Option<(i64, i64)> {
        None
    }

    /// `n` zeros of `dtype` on device `ordinal` of this backend (the CPU has only 0): the
    /// allocation half of the contract. A device is opened (and probed) on first use: a
    /// missing driver, library or GPU is a typed `DeviceUnavailable` naming what is missing.
    fn zeros_on(ordinal: usize, dtype: DType, n: usize) -> Result<Self>;

    /// Copy in: host data onto device `ordinal` (the buffer itself on the CPU, no copy).
    fn upload(ordinal: usize, data: Buffer) -> Result<Self>;

    /// The address of the memory for code outside the contract (a collective) that reads and
    /// writes it on the current stream, which the storage counts as a use there (the
    /// keep-alive rule of [`crate::Stream`]). Host memory has no device handle: the CPU
    /// refuses.
    fn lend_raw(&self) -> Result<u64>;

    /// Device `ordinal`'s compute stream: where its ops run outside any [`crate::Stream::scope`].
    fn compute_stream(ordinal: usize) -> Result<Arc<dyn BackendStream>>;

    /// A new stream of device `ordinal`, independent of its compute stream.
    fn new_stream(ordinal: usize) -> Result<Arc<dyn BackendStream>>;

    /// The stream a [`crate::Stream::scope`] of this backend entered, from what the scope
    /// stack holds for the device ([`BackendStream::scoped`]).
    fn scoped_stream(entered: &ScopedStream) -> Option<Arc<dyn BackendStream>>;

    /// Copy out: the whole storage (not just a view) into host memory.
    fn to_cpu(&self) -> Result<Buffer>;

    /// Copy out, consuming the storage: [`BackendStorage::to_cpu`], without a copy where the
    /// memory already is the host's.
    fn into_cpu(self) -> Result<Buffer> {
        self.to_cpu()
    }

    /// The elements of the view `layout` (*any layout*: transposed, narrowed, broadcast)
    /// gathered row-major into a new contiguous storage. Behind `contiguous`, `copy`,
    /// `reshape` of a strided view, and every kernel that needs contiguous input.
    fn copy_strided(&self, layout: &Layout) -> Result<Self>;

    /// The view (*any layout*) converted to `dtype` (any dtype to any dtype; floats round
    /// to nearest even; to `I64` and `U8` truncates toward zero and saturates, as Rust's
    /// `as`; to `I8` rounds half to even and saturates at ±127, a NaN giving 0: the
    /// quantizing cast).
    fn to_dtype(&self, layout: &Layout, dtype: DType) -> Result<Self>;
}

/// Elementwise maps (`cpu/elementwise.rs`).
pub(crate) trait Elementwise: Sized {
    /// `op` applied to each element.
    fn unary(&self, layout: &Layout, op: UnaryOp) -> Result<Self>;

    /// `op(a, b)` elementwise. `lhs` and `rhs` are *any layout* of one common shape (the
    /// front end has broadcast them: broadcast dims have stride 0); the output is
    /// contiguous of that shape.
    fn binary(&self, lhs: &Layout, rhs: &Self, rhs_layout: &Layout, op: BinaryOp) -> Result<Self>;
}

/// Reductions over dimensions (`cpu/reduce.rs`).
pub(crate) trait Reduce: Sized {
    /// Reduces `dims` (sorted, distinct, each `< rank`; empty: a copy) of the view (*any
    /// layout*); the output is contiguous over the kept dims in order (the front end
    /// reshapes for `keepdim`).
    fn reduce(&self, layout: &Layout, dims: &[usize], op: ReduceOp) -> Result<Self>;
}

/// Matrix products (`cpu/matmul.rs`).
pub(crate) trait Matmul: Sized + Elementwise {
    /// Batched matrix product `[batch.., m, k] x [batch.., k, n] -> [batch.., m, n]`.
    /// Both layouts have the same rank `>= 2` and the same batch dims, and are *any
    /// layout*: row and column strides are arbitrary (a transposed operand has row stride
    /// 1), a broadcast batch dim has stride 0. The output is contiguous
    /// `[batch.., m, n]`; `m * n > 0` is guaranteed, `k == 0` gives zeros. The CPU
    /// accumulates in the dtype through the `gemm` crate (any order); f32 must be true
    /// f32 (no TF32).
    fn matmul(&self, lhs: &Layout, rhs: &Self, rhs_layout: &Layout) -> Result<Self>;

    /// `lhs [m, k] x rhs [k, n] + bias`, the bias `[n]` (contiguous) added to every row:
    /// a linear layer's forward. Both matrices are rank 2, *any layout*, as for
    /// [`Matmul::matmul`]; `m * n > 0`. The default composes `matmul` and `binary`;
    /// the CPU starts each output row from the bias and lets the GEMM accumulate onto it,
    /// saving a pass over the output.
    fn matmul_bias(&self, lhs: &Layout, rhs: &Self, rhs_layout: &Layout, bias: (&Self, &Layout)) -> Result<Self> {
        let y = self.matmul(lhs, rhs, rhs_layout)?;
        let shape = [lhs.shape()[0], rhs_layout.shape()[1]];
        let bl = bias.1.broadcast_to(&shape)?;
        y.binary(&Layout::contiguous(&shape), bias.0, &bl, BinaryOp::Add)
    }
}

/// The layers' kernels: rows of the last axis (contiguous layouts, row length = last dim),
/// embeddings, the causal mask, cross-entropy (`cpu/nn.rs`).
pub(crate) trait Nn: Sized {
    /// Softmax (or log-softmax when `log`) of each row: `m = max`, `e = exp(x - m)`,
    /// `s = sum e`; softmax `e * (1 / s)`, log-softmax `x - (ln s + m)`.
    fn softmax_last(&self, layout: &Layout, log: bool) -> Result<Self>;

    /// Backward of [`Nn::softmax_last`] from its output `y` (self) and the
    /// gradient `g` (same shape): softmax `y * (g - sum(g * y))`, log-softmax
    /// `g - exp(y) * sum(g)`, row-wise.
    fn softmax_backward(&self, layout: &Layout, g: &Self, g_layout: &Layout, log: bool) -> Result<Self>;

    /// Layer norm of each row of `x` (self, `[rows, d]` flattened) with `weight`, `bias`
    /// (`[d]`): `mean = sum x * (1/d)`, `var = sum (x - mean)^2 * (1/d)`,
    /// `rstd = 1 / sqrt(var + eps)`, `y = (x - mean) * rstd * w + b` (the sums in any
    /// order: the CPU adds 16 interleaved partial sums, so that its loops vectorize).
    /// Returns `(y, mean [rows], rstd [rows])`.
    fn layer_norm(
        &self,
        layout: &Layout,
        weight: (&Self, &Layout),
        bias: (&Self, &Layout),
        eps: f64,
    ) -> Result<(Self, Self, Self)>;

    /// Gradients `(dx, dweight, dbias)` of [`Nn::layer_norm`] from `x` (self),
    /// `weight`, the saved `mean` and `rstd` (`[rows]`) and the output gradient `gy`.
    fn layer_norm_backward(
        &self,
        layout: &Layout,
        weight: (&Self, &Layout),
        mean: (&Self, &Layout),
        rstd: (&Self, &Layout),
        gy: (&Self, &Layout),
    ) -> Result<(Self, Self, Self)>;

    /// Embedding gather: row `ids[i]` of the table `[vocab, d]` (self) for each id, giving
    /// `[ids.numel(), d]`. `ids` is an `I64` or `U8` storage on the same device; every id
    /// has been checked to be `< vocab`.
    fn embedding(&self, layout: &Layout, ids: (&Self, &Layout)) -> Result<Self>;

    /// Embedding backward: scatter-add of the gradient rows (self, `[ids.numel(), d]`)
    /// into a zeroed `[vocab, d]` table (repeated ids add up, in any order). `ids` as for
    /// [`Nn::embedding`].
    fn embedding_backward(&self, layout: &Layout, ids: (&Self, &Layout), vocab: usize) -> Result<Self>;

    /// Causal mask of `[.., t, s]` scores (`t <= s`): element `(i, j)` of each matrix
    /// becomes `value` when `j > i + (s - t)`, else is copied.
    fn causal_fill(&self, layout: &Layout, value: f64) -> Result<Self>;

    /// Mean cross-entropy of `[n, c]` logits (self) against `n` targets (`I64`/`U8`,
    /// checked `< c`). Returns `(loss, probs)`: `loss` is one element,
    /// `sum_r (lse_r - x[r, t_r]) / max(n, 1)` with `lse = ln(sum exp(x - m)) + m`
    /// per row, accumulated in f64 and rounded to the dtype; `probs` is the softmax of
    /// each row, as [`Nn::softmax_last`].
    fn cross_entropy(&self, layout: &Layout, targets: (&Self, &Layout)) -> Result<(Self, Self)>;

    /// Gradient of [`Nn::cross_entropy`] from `probs` (self, `[n, c]`):
    /// `(probs - onehot(targets)) * scale` with `scale = g / max(n, 1)` computed in f64 and
    /// rounded to the dtype, as `o = probs; o[t] += -1; o *= scale`. The upstream gradient `g`
    /// is a one-element storage of the same dtype and device (the loss's gradient, which lives
    /// on the device: reading it on the host would stall the step).
    fn cross_entropy_backward(&self, layout: &Layout, targets: (&Self, &Layout), g: (&Self, &Layout)) -> Result<Self>;
}

/// Sorting and moving elements by integer index (`cpu/indexing.rs`). Index operands are `I64`
/// (or `U8`) storages on the same device, every value checked by the front end to lie in range.
pub(crate) trait Indexing: Sized {
    /// Sorts each row of the last axis (self contiguous, rows of `n = last dim`) and keeps the
    /// first `k <= n` of each: `(values, indices)`, both `[rows.., k]`, the indices `I64`
    /// positions in the row. The order is total and stable: NaN is larger than every number
    /// (NaNs equal among themselves), `-0.0` equals `0.0`, and equal values keep their
    /// positions' order (lower index first) whether `descending` or not. `topk` is the
    /// descending sort cut at `k`. A backend may record the indices' range (`0..n`, as the
    /// fake device does), so that checking them before a scatter reads nothing back.
    fn sort_last(&self, layout: &Layout, descending: bool, k: usize) -> Result<(Self, Self)>;

    /// `out[i][j][k] = self[ids[i][j][k]][j][k]` for `dim = 0` (likewise for any `dim`): `self`
    /// contiguous, `ids` *any layout* (a broadcast index has stride 0) of the output's shape,
    /// of self's rank, no larger than self in any dim but `dim`.
    fn gather(&self, layout: &Layout, dim: usize, ids: (&Self, &Layout)) -> Result<Self>;

    /// A copy of `self` (contiguous) with `src[i][j][k]` added at `[ids[i][j][k]][j][k]` for
    /// `dim = 0` (likewise for any `dim`): `ids` *any layout* and `src` contiguous, both of
    /// one shape, of self's rank, no larger than self in any dim but `dim`. Repeated indices
    /// add up in the index's row-major order (on the CPU and on CUDA: the same bits, on
    /// every run).
    fn scatter_add(&self, layout: &Layout, dim: usize, ids: (&Self, &Layout), src: (&Self, &Layout)) -> Result<Self>;
}

/// Fused causal self-attention (`cpu/attention.rs`).
pub(crate) trait Attention: Sized {
    /// Causal multi-head self-attention from packed projections: `self` is `qkv`
    /// `[B, T, 3d]` (queries, keys, values side by side, each split into `n_heads` heads of
    /// `d / n_heads` columns; contiguous, `B, T >= 1`). Per head, `S = Q Kᵀ` then
    /// `x * scale + 0` (scale rounded to the dtype), positions after the query set to
    /// `-inf`, `P = softmax` (as [`Nn::softmax_last`]), `Y = P V`. Returns
    /// `(y [B, T, d] with head h in columns h*hd.., probs P [B, n_heads, T, T])`.
    /// A backend without a fused kernel (CUDA) composes it from the contract's `matmul`,
    /// `unary`, `causal_fill`, `softmax_last` and `copy_strided` (`crate::composed`); the
    /// CPU's kernel computes the same steps without the copies.
    fn causal_attention(&self, layout: &Layout, n_heads: usize, scale: f64) -> Result<(Self, Self)>;

    /// Gradient `dqkv [B, T, 3d]` of [`Attention::causal_attention`] from `qkv`
    /// (self), the saved `probs` and the output gradient `gy [B, T, d]` (all contiguous):
    /// `dP = dY Vᵀ`, `dS = softmax_backward(P, dP)` zeroed after the query, times the
    /// scale (`x * scale + 0`), then `dQ = dS K`, `dKᵀ = Qᵀ dS`, `dV = Pᵀ dY`.
    fn causal_attention_backward(
        &self,
        layout: &Layout,
        probs: (&Self, &Layout),
        gy: (&Self, &Layout),
        n_heads: usize,
        scale: f64,
    ) -> Result<Self>;
}

/// In-place updates through a view: fills, copies, gradient accumulation, the fused optimizer
/// steps (`cpu/inplace.rs`).
pub(crate) trait InPlace: Sized {
    /// Sets every element of the view (*any layout*, any dtype) to `v` rounded to the dtype.
    fn fill(&mut self, layout: &Layout, v: f64) -> Result<()>;

    /// `dst = src` through the view `layout` (*any layout*, no stride 0), bit for bit, any
    /// dtype; `src` is contiguous of the same shape and dtype and a different storage. A copy,
    /// not `fill(0)` then `+= src`: `-0.0` stays `-0.0`, and integers copy.
    fn copy_from(&mut self, layout: &Layout, src: (&Self, &Layout)) -> Result<()>;

    /// `dst += scale * src` through the view `layout` (*any layout*, no stride 0); `src`
    /// is contiguous of the same shape and a different storage; `scale` is rounded to
    /// the dtype first.
    fn add_scaled_assign(&mut self, layout: &Layout, src: (&Self, &Layout), scale: f64) -> Result<()>;

    /// One fused SGD update of an f32 parameter (self) from its f32 gradient, in place on
    /// the parameter and on the momentum buffer when one is passed (all contiguous, same
    /// shape, distinct storages). Per element, in f32:
    /// ```text
    /// g = grad
    /// if weight_decay != 0 { g = g + weight_decay * p }
    /// if buffer given { b = is_first_step ? g : momentum * b + g;  g = b }
    /// p = p - lr * g
    /// ```
    fn sgd_step(
        &mut self,
        layout: &Layout,
        grad: (&Self, &Layout),
        momentum_buffer: Option<(&mut Self, &Layout)>,
        s: &SgdScalars,
    ) -> Result<()>;

    /// One fused AdamW update of an f32 parameter (self) from its f32 gradient, in place
    /// on the parameter and its first and second moments `m`, `v` (all contiguous, same
    /// shape, distinct storages). Per element, in f32, in exactly this order:
    /// ```text
    /// p = p * decay
    /// m = beta1 * m + one_minus_beta1 * g
    /// v = beta2 * v + (one_minus_beta2 * g) * g
    /// p = p - (step_size * m) / (sqrt(v) / bias_correction2_sqrt + eps)
    /// ```
    fn adamw_step(
        &mut self,
        layout: &Layout,
        grad: (&Self, &Layout),
        m: (&mut Self, &Layout),
        v: (&mut Self, &Layout),
        s: &AdamWScalars,
    ) -> Result<()>;

    /// [`InPlace::sgd_step`] of f32 master weights (self) beside their 16-bit compute copy
    /// `copy` (`F16` or `BF16`, contiguous, the same shape): the gradient is f32 or in the
    /// copy's dtype (widened exactly, per element), and each updated master is written, rounded
    /// to nearest even, into `copy` in the same pass over memory. The same bits as widening the
    /// gradient, stepping, and rounding the masters as three passes. Backends without it say so
    /// (the front end then runs those passes).
    fn sgd_step_with_copy(
        &mut self,
        _layout: &Layout,
        _grad: (&Self, &Layout),
        _momentum_buffer: Option<(&mut Self, &Layout)>,
        _copy: (&mut Self, &Layout),
        _s: &SgdScalars,
    ) -> Result<()> {
        Err(TensorError::Invalid {
            op: "sgd_step_with_copy",
            msg: "not fused on this device".into(),
        })
    }

    /// [`InPlace::adamw_step`] of f32 master weights beside their 16-bit copy, as
    /// [`InPlace::sgd_step_with_copy`].
    fn adamw_step_with_copy(
        &mut self,
        _layout: &Layout,
        _grad: (&Self, &Layout),
        _m: (&mut Self, &Layout),
        _v: (&mut Self, &Layout),
        _copy: (&mut Self, &Layout),
        _s: &AdamWScalars,
    ) -> Result<()> {
        Err(TensorError::Invalid {
            op: "adamw_step_with_copy",
            msg: "not fused on this device".into(),
        })
    }
}

/// One stream of a device ([`crate::Stream`] holds one): it runs the work queued on it in order,
/// and is ordered against the device's other streams only by events.
pub(crate) trait BackendStream: Send + Sync {
    /// What [`crate::Stream::scope`] puts on the scope stack for this stream, so that the
    /// backend's ops find it ([`BackendStorage::scoped_stream`]).
    fn scoped(&self) -> ScopedStream;

    /// An event recording the work queued on this stream so far (timing enabled).
    fn record(&self) -> Result<Arc<dyn BackendEvent>>;

    /// Work queued from now on starts only after `event` (of the same backend and device:
    /// checked by the front end) completed. The host does not wait.
    fn wait(&self, event: &dyn BackendEvent) -> Result<()>;

    /// The host waits until everything queued so far finished.
    fn synchronize(&self) -> Result<()>;

    /// Occupies the stream for `duration` of device time (the simulated link).
    fn spin(&self, duration: Duration) -> Result<()>;

    /// The raw handle: the `CUstream` on CUDA, the stream's number on the fake device, 0 on
    /// the CPU.
    fn raw(&self) -> u64;
}

/// A point in one stream's work ([`crate::Event`] holds one).
pub(crate) trait BackendEvent: Any + Send + Sync {
    /// Whether the work it recorded finished (asks, never waits).
    fn is_complete(&self) -> Result<bool>;

    /// The host waits until the work it recorded finished.
    fn synchronize(&self) -> Result<()>;

    /// Milliseconds from this event to `end` (of the same backend: checked by the front end)
    /// on the device's clock.
    fn elapsed_ms(&self, end: &dyn BackendEvent) -> Result<f64>;

    /// The raw handle: the `CUevent` on CUDA, its number on the fake device, 0 on the CPU.
    fn raw(&self) -> u64;

    /// The event as `Any`, so that a backend finds its own type behind `&dyn BackendEvent`.
    fn as_any(&self) -> &dyn Any;
}

/// `event` as backend `E`'s event, or an error naming `op` when it comes from another backend.
pub(crate) fn event_of<'a, E: BackendEvent>(op: &'static str, event: &'a dyn BackendEvent) -> Result<&'a E> {
    event.as_any().downcast_ref::<E>().ok_or(TensorError::Invalid {
        op,
        msg: "the event comes from another backend".into(),
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::{test_device, DType, Device, Storage, Stream, Tensor};

    /// Every piece a backend provides besides its kernels, reached through the front end: an
    /// allocation, a copy in and out (of a view and of a whole lent storage), raw device memory
    /// (refused by the CPU only), streams (compute, new, the current one inside a scope) and
    /// events. A backend missing one of them fails here on its device.
    fn every_piece_of_the_device_contract_answers(d: Device) {
        let z = Tensor::zeros_on(&[2, 3], DType::F32, d).unwrap();
        assert_eq!((z.device(), z.to_vec::<f32>().unwrap()), (d, vec![0.0; 6]));
        let t = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[2, 2])
            .unwrap()
            .to_device(d)
            .unwrap();
        assert_eq!(t.t().unwrap().to_vec::<f32>().unwrap(), [1.0, 3.0, 2.0, 4.0]);
        assert_eq!(
            t.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap(),
            [1.0, 2.0, 3.0, 4.0]
        );
        let ids = Tensor::from_vec(vec![3i64, 0], &[2]).unwrap().to_device(d).unwrap();
        assert_eq!(ids.copy().unwrap().to_vec::<i64>().unwrap(), [3, 0]);

        let (compute, side) = (Stream::compute(d).unwrap(), Stream::new(d).unwrap());
        assert_eq!(Stream::current(d).unwrap(), compute);
        side.scope(|| assert_eq!(Stream::current(d).unwrap(), side));
        let lent = t.lend_storage().unwrap();
        match lent.device_memory(&side) {
            Ok(m) => assert_eq!((m.len, m.dtype, m.device), (4, DType::F32, d)),
            Err(e) => assert!(d == Device::Cpu, "{d}: {e}"),
        }
        let done = side.record_event().unwrap();
        compute.wait_event(&done).unwrap();
        compute.spin(Duration::from_micros(1)).unwrap();
        let end = compute.record_event().unwrap();
        end.synchronize().unwrap();
        assert!(end.is_complete().unwrap());
        assert!(done.elapsed_ms(&end).unwrap().is_finite());
        side.synchronize().unwrap();
        let back = Storage::from_buffer(lent.into_buffer().unwrap(), d).unwrap();
        t.restore_storage(back).unwrap();
        assert_eq!(t.to_vec::<f32>().unwrap(), [1.0, 2.0, 3.0, 4.0]);
    }
    test_device!(every_piece_of_the_device_contract_answers);
}
