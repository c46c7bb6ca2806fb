//! Contract methods with a default built from other contract methods: what a backend
//! without its own fused kernel runs (CUDA's attention). Each step is one call of the
//! device contract on strided views, so it works on any backend.

use crate::backend::{BackendStorage, UnaryOp};
use crate::{Layout, Result};

/// Views of one packed `qkv [B, T, 3d]` (contiguous at `offset`) as per-head matrices.
struct Heads {
    b: usize,
    t: usize,
    nh: usize,
    hd: usize,
    offset: usize,
}

impl Heads {
    fn new(l: &Layout, n_heads: usize) -> Heads {
        let (b, t, w) = (l.shape()[0], l.shape()[1], l.shape()[2]);
        Heads {
            b,
            t,
            nh: n_heads,
            hd: w / 3 / n_heads,
            offset: l.offset(),
        }
    }

    fn d(&self) -> usize {
        self.nh * self.hd
    }

    /// Part `part` (0 q, 1 k, 2 v) as `[B, H, T, hd]`, or transposed `[B, H, hd, T]`.
    fn part(&self, part: usize, transposed: bool, offset: usize) -> Layout {
        let w = 3 * self.d();
        let o = offset + part * self.d();
        if transposed {
            Layout::new(
                vec![self.b, self.nh, self.hd, self.t],
                vec![self.t * w, self.hd, 1, w],
                o,
            )
        } else {
            Layout::new(
                vec![self.b, self.nh, self.t, self.hd],
                vec![self.t * w, self.hd, w, 1],
                o,
            )
        }
    }

    /// `[B, T, d]` at `offset` seen as `[B, H, T, hd]`.
    fn merged(&self, offset: usize) -> Layout {
        let d = self.d();
        Layout::new(
            vec![self.b, self.nh, self.t, self.hd],
            vec![self.t * d, self.hd, d, 1],
            offset,
        )
    }

    fn scores(&self) -> Layout {
        Layout::contiguous(&[self.b, self.nh, self.t, self.t])
    }

    fn per_head(&self) -> Layout {
        Layout::contiguous(&[self.b, self.nh, self.t, self.hd])
    }
}

/// [`BackendStorage::causal_attention`] from `matmul`, `unary`, `causal_fill`,
/// `softmax_last` and `copy_strided`.
pub(crate) fn causal_attention<S: BackendStorage>(qkv: &S, l: &Layout, n_heads: usize, scale: f64) -> Result<(S, S)> {
    let h = Heads::new(l, n_heads);
    let sl = h.scores();
    let s = qkv.matmul(&h.part(0, false, h.offset), qkv, &h.part(1, true, h.offset))?;
    let s = s.unary(&sl, UnaryOp::Affine { mul: scale, add: 0.0 })?;
    let s = s.causal_fill(&sl, f64::NEG_INFINITY)?;
    let p = s.softmax_last(&sl, false)?;
    let y = p.matmul(&sl, qkv, &h.part(2, false, h.offset))?;
    // [B, H, T, hd] read as [B, T, H, hd]: the heads side by side in each row
    let (t, hd, nh) = (h.t, h.hd, h.nh);
    let as_rows = Layout::new(vec![h.b, t, nh, hd], vec![nh * t * hd, hd, t * hd, 1], 0);
    Ok((y.copy_strided(&as_rows)?, p))
}

/// [`BackendStorage::causal_attention_backward`] from `matmul`, `softmax_backward`,
/// `causal_fill`, `unary`, `copy_strided` and `copy_from`.
pub(crate) fn causal_attention_backward<S: BackendStorage>(
    qkv: &S,
    l: &Layout,
    probs: (&S, &Layout),
    gy: (&S, &Layout),
    n_heads: usize,
    scale: f64,
) -> Result<S> {
    let h = Heads::new(l, n_heads);
    let (sl, hl) = (h.scores(), h.per_head());
    let gyh = h.merged(gy.1.offset());
    let dp = gy.0.matmul(&gyh, qkv, &h.part(2, true, h.offset))?;
    let ds = probs.0.softmax_backward(probs.1, &dp, &sl, false)?;
    let ds = ds.causal_fill(&sl, 0.0)?;
    let ds = ds.unary(&sl, UnaryOp::Affine { mul: scale, add: 0.0 })?;
    let dq = ds.matmul(&sl, qkv, &h.part(1, false, h.offset))?;
    let dkt = qkv.matmul(&h.part(0, true, h.offset), &ds, &sl)?;
    let p_t = probs.1.transpose(2, 3)?;
    let dv = probs.0.matmul(&p_t, gy.0, &gyh)?;
    // every element of this copy is overwritten by the three parts below
    let mut dqkv = qkv.copy_strided(l)?;
    dqkv.copy_from(&h.part(0, false, 0), (&dq, &hl))?;
    dqkv.copy_from(
        &h.part(1, true, 0),
        (&dkt, &Layout::contiguous(&[h.b, h.nh, h.hd, h.t])),
    )?;
    dqkv.copy_from(&h.part(2, false, 0), (&dv, &hl))?;
    Ok(dqkv)
}
