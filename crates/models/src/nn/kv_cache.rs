//! The KV cache of incremental decoding, and attention over it.

use brigade_autograd::{no_grad, Var};
use brigade_tensor::{DType, Device, Tensor};

use crate::{ModelError, Result};

use super::CausalSelfAttention;

/// The keys and values one attention layer has computed: `k` and `v` of `[B, H, capacity,
/// head_dim]`, of which a [`KvCache`] says how many positions are filled.
pub struct LayerKvCache {
    k: Tensor,
    v: Tensor,
}

/// A transformer's KV cache for incremental decoding: per block, the keys and values of every
/// position seen so far, so that a new token costs one position of compute instead of the
/// whole context.
pub struct KvCache {
    layers: Vec<LayerKvCache>,
    len: usize,
    capacity: usize,
    batch: usize,
}

impl KvCache {
    /// An empty cache for `n_layers` blocks of `n_heads` heads of `head_dim`, `batch` rows,
    /// up to `capacity` positions, in `dtype` on `device`.
    pub fn new(
        n_layers: usize,
        batch: usize,
        n_heads: usize,
        head_dim: usize,
        capacity: usize,
        dtype: DType,
        device: Device,
    ) -> Result<KvCache> {
        let shape = [batch, n_heads, capacity, head_dim];
        let layers = (0..n_layers)
            .map(|_| {
                Ok(LayerKvCache {
                    k: Tensor::zeros_on(&shape, dtype, device)?,
                    v: Tensor::zeros_on(&shape, dtype, device)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(KvCache {
            layers,
            len: 0,
            capacity,
            batch,
        })
    }

    /// Positions filled.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when no position is filled.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Positions it can hold (the model's context).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Rows (sequences decoded side by side).
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Forgets every position (the memory is kept).
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Block `i`'s keys and values.
    pub fn layer(&self, i: usize) -> &LayerKvCache {
        &self.layers[i]
    }

    /// Number of blocks.
    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }

    /// Marks `n` more positions filled (after every block has written them).
    pub fn advance(&mut self, n: usize) {
        self.len += n;
    }
}

impl CausalSelfAttention {
    /// Inference on `h [B, n, d]` at positions `start..start + n`: writes this chunk's keys and
    /// values into `cache` at those positions, then lets each query attend to every cached
    /// position up to its own (`0..=start + i`). With `start = 0` and `n = T` this is
    /// [`CausalSelfAttention::forward`]'s result (to rounding: composed ops, not the fused one);
    /// with `n = 1` a new token costs one query against the cache. No graph is recorded.
    pub fn forward_cached(&self, h: &Var, cache: &LayerKvCache, start: usize) -> Result<Var> {
        no_grad(|| {
            let shape = h.shape();
            let (b, n, d, nh) = (shape[0], shape[1], self.proj.weight.shape()[0], self.n_heads);
            let hd = d / nh;
            let capacity = cache.k.shape()[2];
            if start + n > capacity {
                return Err(ModelError::ContextTooLong {
                    found: start + n,
                    context: capacity,
                });
            }
            let qkv = self.qkv.forward(h)?.value();
            // [B, n, d] -> [B, n, H, hd] -> [B, H, n, hd]
            let heads = |i: usize| -> Result<Tensor> {
                Ok(qkv
                    .narrow(2, i * d, d)?
                    .reshape(&[b, n, nh, hd])?
                    .permute(&[0, 2, 1, 3])?)
            };
            let q = heads(0)?;
            cache.k.narrow(2, start, n)?.copy_from(&heads(1)?)?;
            cache.v.narrow(2, start, n)?.copy_from(&heads(2)?)?;
            let (keys, values) = (cache.k.narrow(2, 0, start + n)?, cache.v.narrow(2, 0, start + n)?);
            let scores = q.matmul(&keys.transpose(2, 3)?)?.mul_scalar(1.0 / (hd as f64).sqrt())?;
            // bottom-right aligned: query i (position start + i) sees keys 0..=start + i
            let scores = if n > 1 {
                scores.causal_fill(f64::NEG_INFINITY)?
            } else {
                scores
            };
            let y = scores
                .softmax_last()?
                .matmul(&values)?
                .permute(&[0, 2, 1, 3])?
                .reshape(&[b, n, d])?;
            self.proj.forward(&Var::constant(y))
        })
    }
}
