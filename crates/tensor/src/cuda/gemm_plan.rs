//! How a row-major matrix product over strided views becomes cuBLAS's column-major
//! arguments, without copying: a pure function, tested on the CPU.
//!
//! cuBLAS computes `C = op(A) op(B)` on column-major matrices. Brigade's output is a
//! contiguous row-major `[.., m, n]`, which read column-major is `Cᵀ` (`n × m`, leading
//! dimension `n`). Since `Cᵀ = Bᵀ Aᵀ`, cuBLAS's `A` argument is Brigade's right operand and
//! its `B` argument is Brigade's left operand. A row-major view `X` (`r × c`, strides
//! `(rs, cs)`) supplies `Xᵀ` either as a column-major matrix with leading dimension `rs`
//! (when `cs == 1`: no transpose) or as `X` itself read column-major with leading dimension
//! `cs` (when `rs == 1`: transpose). So plain, transposed and narrowed views need no copy;
//! a view with neither stride 1 (or a broadcast row) does.
//!
//! Batch dims are merged where all three operands step through them evenly; the largest
//! merged dim becomes cuBLAS's strided batch (stride 0 for a broadcast operand) and any
//! other dims become a short list of calls (attention's `[B, H, T, hd]` views, permuted
//! from `[B, T, H, hd]`, are `B` strided-batched calls of `H` products each).

use crate::Layout;

/// cuBLAS's `op` for one operand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transpose {
    /// `CUBLAS_OP_N`: the operand as stored.
    No,
    /// `CUBLAS_OP_T`: the operand's transpose.
    Yes,
}

/// Where one strided-batched cuBLAS call starts, in elements from the start of each storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallOffsets {
    /// Into cuBLAS's `A` (Brigade's right operand's storage).
    pub a: usize,
    /// Into cuBLAS's `B` (Brigade's left operand's storage).
    pub b: usize,
    /// Into the contiguous output.
    pub c: usize,
}

/// Everything a `cublas<t>gemmStridedBatched` call needs, in cuBLAS's (column-major) terms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GemmPlan {
    /// `op` applied to cuBLAS's `A` (Brigade's right operand).
    pub transa: Transpose,
    /// `op` applied to cuBLAS's `B` (Brigade's left operand).
    pub transb: Transpose,
    /// cuBLAS's `m`: Brigade's `n` (columns of the output).
    pub m: usize,
    /// cuBLAS's `n`: Brigade's `m` (rows of the output).
    pub n: usize,
    /// The inner dimension.
    pub k: usize,
    /// Leading dimension of cuBLAS's `A`.
    pub lda: usize,
    /// Leading dimension of cuBLAS's `B`.
    pub ldb: usize,
    /// Leading dimension of the output (Brigade's `n`).
    pub ldc: usize,
    /// Elements between consecutive matrices of `A` in one call (0: broadcast).
    pub stride_a: usize,
    /// Elements between consecutive matrices of `B` in one call (0: broadcast).
    pub stride_b: usize,
    /// Elements between consecutive output matrices in one call.
    pub stride_c: usize,
    /// Matrices per call.
    pub batch_count: usize,
    /// One strided-batched call per entry (empty when the output is empty).
    pub calls: Vec<CallOffsets>,
}

/// Which operand of `lhs · rhs`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operand {
    /// The left operand (`[.., m, k]`).
    Lhs,
    /// The right operand (`[.., k, n]`).
    Rhs,
}

/// Why a product cannot be handed to cuBLAS as it is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// This operand's matrix strides fit neither cuBLAS layout: make it contiguous first
    /// (after which planning always succeeds).
    #[error("the {0:?} operand's strides fit no cuBLAS layout: it needs a contiguous copy first")]
    NeedsCopy(Operand),
    /// The operands' shapes do not form a product (`[.., m, k] x [.., k, n]`, equal batch dims).
    #[error("matmul: shapes {lhs:?} x {rhs:?} do not form a batched product")]
    Shape {
        /// The left operand's shape.
        lhs: Vec<usize>,
        /// The right operand's shape.
        rhs: Vec<usize>,
    },
    /// A dimension exceeds cuBLAS's 32-bit integer arguments.
    #[error("matmul: {what} = {value} exceeds cuBLAS's 32-bit limit")]
    TooLarge {
        /// Which argument.
        what: &'static str,
        /// Its value.
        value: usize,
    },
}

/// How a row-major `r × c` view with strides `(rs, cs)` supplies its transpose (`c × r`)
/// as a column-major cuBLAS operand: the `op` and leading dimension, or `None` if neither
/// layout fits. Strides of size-1 dims do not matter, so they never force a copy.
pub fn transposed_operand(r: usize, c: usize, rs: usize, cs: usize) -> Option<(Transpose, usize)> {
    // No transpose: element (i, j) of Xᵀ sits at i*cs + j*rs, column-major with ld = rs.
    if cs == 1 || c <= 1 {
        let ld = if r <= 1 { c.max(1) } else { rs };
        if ld >= c.max(1) {
            return Some((Transpose::No, ld));
        }
    }
    // Transpose: X itself read column-major, element (i, j) at i*rs + j*cs, ld = cs.
    if rs == 1 || r <= 1 {
        let ld = if c <= 1 { r.max(1) } else { cs };
        if ld >= r.max(1) {
            return Some((Transpose::Yes, ld));
        }
    }
    None
}

/// One batch dim after merging: its size and each operand's stride through it.
#[derive(Debug, Clone, Copy)]
struct BatchDim {
    size: usize,
    lhs: usize,
    rhs: usize,
    out: usize,
}

/// Plans `lhs · rhs` for layouts `[batch.., m, k]` and `[batch.., k, n]` with equal batch
/// dims (broadcast already applied: stride 0 on broadcast dims), into a contiguous
/// `[batch.., m, n]` output.
pub fn plan_gemm(lhs: &Layout, rhs: &Layout) -> Result<GemmPlan, PlanError> {
    let shape_err = || PlanError::Shape {
        lhs: lhs.shape().to_vec(),
        rhs: rhs.shape().to_vec(),
    };
    let (ra, rb) = (lhs.rank(), rhs.rank());
    if ra < 2 || ra != rb || lhs.shape()[..ra - 2] != rhs.shape()[..rb - 2] {
        return Err(shape_err());
    }
    let (m, k) = (lhs.shape()[ra - 2], lhs.shape()[ra - 1]);
    let (k2, n) = (rhs.shape()[rb - 2], rhs.shape()[rb - 1]);
    if k != k2 {
        return Err(shape_err());
    }
    let (sl, sr) = (lhs.strides(), rhs.strides());
    // cuBLAS's A supplies Bᵀ (n × k) from Brigade's rhs; its B supplies Aᵀ (k × m) from lhs.
    let (transa, lda) = transposed_operand(k, n, sr[rb - 2], sr[rb - 1]).ok_or(PlanError::NeedsCopy(Operand::Rhs))?;
    let (transb, ldb) = transposed_operand(m, k, sl[ra - 2], sl[ra - 1]).ok_or(PlanError::NeedsCopy(Operand::Lhs))?;

    let batch_shape = &lhs.shape()[..ra - 2];
    let (inner, outer) = split_batch(merged_batch_dims(batch_shape, sl, sr, m * n));
    let total: usize = batch_shape.iter().product::<usize>() * m * n;
    let calls = if total > 0 {
        call_offsets(&outer, lhs, rhs)
    } else {
        Vec::new()
    };
    let plan = GemmPlan {
        transa,
        transb,
        m: n,
        n: m,
        k,
        lda,
        ldb,
        ldc: n.max(1),
        stride_a: inner.rhs,
        stride_b: inner.lhs,
        stride_c: inner.out,
        batch_count: inner.size,
        calls,
    };
    check_fits_cublas(&plan)?;
    Ok(plan)
}

/// The batch dims of `batch_shape` (size-1 dims dropped) with each operand's stride and the
/// contiguous output's, neighbours merged where every operand steps evenly across both
/// (`mn`: the elements of one output matrix).
fn merged_batch_dims(batch_shape: &[usize], sl: &[usize], sr: &[usize], mn: usize) -> Vec<BatchDim> {
    let mut out_stride = mn;
    let mut dims: Vec<BatchDim> = Vec::new();
    for d in (0..batch_shape.len()).rev() {
        let size = batch_shape[d];
        if size != 1 {
            dims.push(BatchDim {
                size,
                lhs: sl[d],
                rhs: sr[d],
                out: out_stride,
            });
        }
        out_stride *= size;
    }
    dims.reverse();
    // Merge d into d+1 where every operand steps evenly across both.
    let mut merged: Vec<BatchDim> = Vec::new();
    for dim in dims.into_iter().rev() {
        match merged.last_mut() {
            Some(inner)
                if dim.lhs == inner.lhs * inner.size
                    && dim.rhs == inner.rhs * inner.size
                    && dim.out == inner.out * inner.size =>
            {
                inner.size *= dim.size;
            }
            _ => merged.push(dim),
        }
    }
    merged.reverse();
    merged
}

/// The largest merged dim, which one strided-batched call covers (size 1 when there is none),
/// and the others, looped over by separate calls.
fn split_batch(merged: Vec<BatchDim>) -> (BatchDim, Vec<BatchDim>) {
    let batched = merged.iter().enumerate().max_by_key(|(_, d)| d.size).map(|(i, _)| i);
    let inner = batched.map(|i| merged[i]).unwrap_or(BatchDim {
        size: 1,
        lhs: 0,
        rhs: 0,
        out: 0,
    });
    let outer: Vec<BatchDim> = merged
        .iter()
        .enumerate()
        .filter(|(i, _)| Some(*i) != batched)
        .map(|(_, d)| *d)
        .collect();
    (inner, outer)
}

/// The operands' offsets of each call, one per index of the `outer` dims (cuBLAS's A is
/// Brigade's rhs, its B the lhs).
fn call_offsets(outer: &[BatchDim], lhs: &Layout, rhs: &Layout) -> Vec<CallOffsets> {
    let n_calls: usize = outer.iter().map(|d| d.size).product();
    (0..n_calls)
        .map(|mut idx| {
            let mut at = CallOffsets {
                a: rhs.offset(),
                b: lhs.offset(),
                c: 0,
            };
            for d in outer.iter().rev() {
                let i = idx % d.size;
                idx /= d.size;
                at.a += i * d.rhs;
                at.b += i * d.lhs;
                at.c += i * d.out;
            }
            at
        })
        .collect()
}

/// Every size and leading dimension of the plan within cuBLAS's `int`.
fn check_fits_cublas(plan: &GemmPlan) -> Result<(), PlanError> {
    let limit = i32::MAX as usize;
    for (what, value) in [
        ("m", plan.m),
        ("n", plan.n),
        ("k", plan.k),
        ("lda", plan.lda),
        ("ldb", plan.ldb),
        ("ldc", plan.ldc),
        ("batch_count", plan.batch_count),
    ] {
        if value > limit {
            return Err(PlanError::TooLarge { what, value });
        }
    }
    Ok(())
}

#[cfg(test)]
#[path = "gemm_plan_tests.rs"]
mod tests;
