//! Matrix products on the CPU: f32 through oneDNN's `dnnl_sgemm` where it is the path chosen
//! ([`super::onednn`]), otherwise (and f64 always) through the `gemm` family of crates (packed,
//! SIMD, arbitrary strides): `gemm-f32` and `gemm-f64`, the kernels the `gemm` crate's generic
//! entry dispatches to, each picking AVX-512, AVX2 or NEON code at run time. Both read
//! transposed views in place. bf16 goes through oneDNN's AMX matmul where it has one, 16-bit
//! storage otherwise widened to f32 (`f16_storage.rs`).

use crate::backend::Matmul;
use std::any::TypeId;
use std::mem::MaybeUninit;

use gemm_common::Parallelism;
use half::bf16;
use rayon::prelude::*;

use super::f16_storage::{half_dtype, narrow, widen};
use super::onednn::{onednn, OneDnn};
use super::{float_kernel, same, view};
use crate::threads::{compute_threads, install};
use crate::Buffer;
use crate::{Element, Float, Layout, Result};

/// Pointers into storages that the batch loop shares between threads; each output
/// matrix is written by exactly one task, inputs are only read.
#[derive(Clone, Copy)]
struct SendPtr<T>(*const T);
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}

/// `dst = alpha·dst + beta·lhs·rhs` (`alpha` read only when `read_dst`, nothing
/// conjugated) through the f32 or f64 kernel, in the `gemm` crate's argument order (column
/// strides first).
///
/// # Safety
/// As `gemm_f32::gemm::f32::get_gemm_fn()`: every element the shapes and strides name must be
/// addressable, `dst`'s writable and touched by nothing else meanwhile.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm<T: Float>(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut T,
    dst_cs: isize,
    dst_rs: isize,
    read_dst: bool,
    lhs: *const T,
    lhs_cs: isize,
    lhs_rs: isize,
    rhs: *const T,
    rhs_cs: isize,
    rhs_rs: isize,
    alpha: T,
    beta: T,
    par: Parallelism,
) {
    // the same call in each element type: the pointers and scalars reinterpreted as it
    macro_rules! call {
        ($e:ty, $kernel:expr) => {{
            let s = |x: T| *(&x as *const T as *const $e);
            $kernel(
                m,
                n,
                k,
                dst as *mut $e,
                dst_cs,
                dst_rs,
                read_dst,
                lhs as *const $e,
                lhs_cs,
                lhs_rs,
                rhs as *const $e,
                rhs_cs,
                rhs_rs,
                s(alpha),
                s(beta),
                false,
                false,
                false,
                par,
            )
        }};
    }
    if TypeId::of::<T>() == TypeId::of::<f32>() {
        call!(f32, gemm_f32::gemm::f32::get_gemm_fn())
    } else if TypeId::of::<T>() == TypeId::of::<f64>() {
        call!(f64, gemm_f64::gemm::f64::get_gemm_fn())
    } else {
        unreachable!("Float is implemented for f32 and f64 only")
    }
}

/// How many threads one GEMM of this size should use: small products are not worth
/// the fork.
pub fn gemm_threads_for(m: usize, n: usize, k: usize) -> usize {
    let t = compute_threads();
    if t > 1 && m * n * k >= 64 * 64 * 64 {
        t
    } else {
        1
    }
}

/// One `[m,k] x [k,n]` product into a contiguous `[m,n]` output.
///
/// # Safety
/// `lhs`/`rhs` must address every element their shapes and strides name; `dst` must hold
/// `m*n` writable elements that nothing else touches meanwhile.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_one<T: Float>(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut T,
    lhs: *const T,
    lhs_rs: usize,
    lhs_cs: usize,
    rhs: *const T,
    rhs_rs: usize,
    rhs_cs: usize,
    threads: usize,
) {
    gemm_strided(m, n, k, (dst, n, 1), lhs, lhs_rs, lhs_cs, rhs, rhs_rs, rhs_cs, threads)
}

/// One `[m,k] x [k,n]` product written (not accumulated) into a strided `[m,n]` output
/// `(pointer, row stride, column stride)`: a kernel can write one head's block straight into
/// its place in a wider matrix.
///
/// # Safety
/// `lhs`/`rhs` must address every element their shapes and strides name; the `m*n`
/// elements `dst` names must be writable and touched by nothing else meanwhile.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn gemm_strided<T: Float>(
    m: usize,
    n: usize,
    k: usize,
    dst: (*mut T, usize, usize),
    lhs: *const T,
    lhs_rs: usize,
    lhs_cs: usize,
    rhs: *const T,
    rhs_rs: usize,
    rhs_cs: usize,
    threads: usize,
) {
    gemm_into(m, n, k, dst, false, lhs, lhs_rs, lhs_cs, rhs, rhs_rs, rhs_cs, threads)
}

/// [`gemm_strided`], but when `accumulate` the product is added onto what `dst` holds
/// (`dst = dst + lhs rhs`, each element rounded once as `acc + dst`) instead of replacing it.
///
/// # Safety
/// As [`gemm_strided`]; with `accumulate` the `m*n` elements must also be initialised.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn gemm_into<T: Float>(
    m: usize,
    n: usize,
    k: usize,
    dst: (*mut T, usize, usize),
    accumulate: bool,
    lhs: *const T,
    lhs_rs: usize,
    lhs_cs: usize,
    rhs: *const T,
    rhs_rs: usize,
    rhs_cs: usize,
    threads: usize,
) {
    let (dst, dst_rs, dst_cs) = dst;
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                for j in 0..n {
                    *dst.add(i * dst_rs + j * dst_cs) = T::ZERO;
                }
            }
        }
        return;
    }
    if TypeId::of::<T>() == TypeId::of::<f32>() {
        if let Some(d) = onednn() {
            let f = |p: *const T| p as *const f32;
            if d.sgemm(
                (m, n, k),
                (dst as *mut f32, dst_rs, dst_cs),
                accumulate,
                (f(lhs), lhs_rs, lhs_cs),
                (f(rhs), rhs_rs, rhs_cs),
                threads,
            ) {
                return;
            }
        }
    }
    let par = if threads > 1 {
        Parallelism::Rayon(threads)
    } else {
        Parallelism::None
    };
    gemm(
        m,
        n,
        k,
        dst,
        dst_cs as isize,
        dst_rs as isize,
        accumulate,
        lhs,
        lhs_cs as isize,
        lhs_rs as isize,
        rhs,
        rhs_cs as isize,
        rhs_rs as isize,
        if accumulate { T::ONE } else { T::ZERO },
        T::ONE,
        par,
    );
}

/// Offset of batch `i` in a layout whose last two dims are the matrix.
fn batch_offset(l: &Layout, mut i: usize) -> usize {
    let r = l.rank();
    let mut o = l.offset();
    for d in (0..r - 2).rev() {
        o += (i % l.shape()[d]) * l.strides()[d];
        i /= l.shape()[d];
    }
    o
}

/// Calls `f(a_offset, b_offset, out_block, threads)` for every matrix of a batched product
/// `[batch.., m, k] x [batch.., k, n]` (each output block `m*n` elements of `out`): in parallel,
/// one thread each, when there are at least as many matrices as compute threads, otherwise one
/// after the other with the threads a product of this size is worth. `in_pool`: run in this
/// thread's rayon pool (the `gemm` crate forks there; oneDNN forks its own OpenMP threads).
fn for_each_batch<U: Send>(
    la: &Layout,
    lb: &Layout,
    out: &mut [U],
    in_pool: bool,
    f: impl Fn(usize, usize, &mut [U], usize) + Sync + Send,
) {
    let r = la.rank();
    let (m, k, n) = (la.shape()[r - 2], la.shape()[r - 1], lb.shape()[r - 1]);
    if m * n == 0 {
        return;
    }
    let threads = compute_threads();
    let nb = out.len() / (m * n);
    if nb >= threads && threads > 1 {
        install(|| {
            out.par_chunks_mut(m * n)
                .enumerate()
                .for_each(|(i, dst)| f(batch_offset(la, i), batch_offset(lb, i), dst, 1))
        });
    } else {
        let t = gemm_threads_for(m, n, k);
        for (i, dst) in out.chunks_mut(m * n).enumerate() {
            let mut run = || f(batch_offset(la, i), batch_offset(lb, i), dst, t);
            if in_pool {
                install(run)
            } else {
                run()
            }
        }
    }
}

/// A vector of `len` elements, each written by `fill` (which must write every one of them): the
/// output of a product is not zeroed first only for the GEMM to overwrite it.
///
/// # Safety
/// `fill` must initialise all `len` elements of the slice it is given.
unsafe fn filled<T>(len: usize, fill: impl FnOnce(&mut [MaybeUninit<T>])) -> Vec<T> {
    let mut out = Vec::with_capacity(len);
    fill(&mut out.spare_capacity_mut()[..len]);
    out.set_len(len);
    out
}

fn matmul_impl<T: Float>(da: &[T], la: &Layout, db: &[T], lb: &Layout) -> Vec<T> {
    let r = la.rank();
    let (m, k, n) = (la.shape()[r - 2], la.shape()[r - 1], lb.shape()[r - 1]);
    let nb: usize = la.shape()[..r - 2].iter().product();
    let (sa, sb) = (la.strides(), lb.strides());
    let (a_rs, a_cs, b_rs, b_cs) = (sa[sa.len() - 2], sa[sa.len() - 1], sb[sb.len() - 2], sb[sb.len() - 1]);
    let (pa, pb) = (SendPtr(da.as_ptr()), SendPtr(db.as_ptr()));
    let in_pool = TypeId::of::<T>() != TypeId::of::<f32>() || onednn().is_none();
    let fill = |out: &mut [MaybeUninit<T>]| {
        for_each_batch(la, lb, out, in_pool, |oa, ob, dst: &mut [MaybeUninit<T>], t| {
            // SAFETY: the front end checked both layouts against their storages, and `dst`
            // is this batch's own m*n output block.
            unsafe {
                let (pa, pb) = (pa, pb);
                gemm_one::<T>(
                    m,
                    n,
                    k,
                    dst.as_mut_ptr() as *mut T,
                    pa.0.add(oa),
                    a_rs,
                    a_cs,
                    pb.0.add(ob),
                    b_rs,
                    b_cs,
                    t,
                )
            }
        })
    };
    // SAFETY: every m*n block is written whole: the GEMM replaces (never reads) its output.
    unsafe { filled(nb * m * n, fill) }
}

/// A bf16 product (and bias) through oneDNN's AMX matmul, each output rounded once from its
/// f32 sum; `None` where oneDNN has no AMX implementation for it (the caller widens instead).
fn bf16_matmul(
    d: &OneDnn,
    (da, la): (&[bf16], &Layout),
    (db, lb): (&[bf16], &Layout),
    bias: Option<(&[bf16], &Layout)>,
) -> Option<Vec<bf16>> {
    let r = la.rank();
    let (m, k, n) = (la.shape()[r - 2], la.shape()[r - 1], lb.shape()[r - 1]);
    let nb: usize = la.shape()[..r - 2].iter().product();
    let mut out = vec![bf16::ZERO; nb * m * n];
    let (sa, sb) = (la.strides(), lb.strides());
    let (a_rs, a_cs, b_rs, b_cs) = (sa[sa.len() - 2], sa[sa.len() - 1], sb[sb.len() - 2], sb[sb.len() - 1]);
    let (pa, pb) = (SendPtr(da.as_ptr()), SendPtr(db.as_ptr()));
    let bias = bias.map(|(b, l)| (SendPtr(b[l.offset()..].as_ptr()), l.strides()[0]));
    let ok = std::sync::atomic::AtomicBool::new(true);
    for_each_batch(la, lb, &mut out, false, |oa, ob, dst: &mut [bf16], t| {
        let (pa, pb, bias) = (pa, pb, bias);
        // SAFETY: the front end checked the layouts against their storages (the bias: `n`
        // elements along its stride); `dst` is this batch's own m*n block.
        let done = unsafe {
            d.bf16_matmul(
                (m, n, k),
                (dst.as_mut_ptr() as *mut u16, n),
                (pa.0.add(oa) as *const u16, a_rs, a_cs),
                (pb.0.add(ob) as *const u16, b_rs, b_cs),
                bias.map(|(p, s)| (p.0 as *const u16, s)),
                t,
            )
        };
        if !done {
            ok.store(false, std::sync::atomic::Ordering::Relaxed);
        }
    });
    ok.into_inner().then_some(out)
}

/// The bf16 operands of a product as slices, when oneDNN's AMX matmul may take them.
fn amx_operands<'a>(a: &'a Buffer, b: &'a Buffer) -> Option<(&'static OneDnn, &'a [bf16], &'a [bf16])> {
    match (a, b, onednn()) {
        (Buffer::BF16(x), Buffer::BF16(y), Some(d)) if d.has_amx() => Some((d, x, y)),
        _ => None,
    }
}

impl Matmul for Buffer {
    /// `matmul`: `[batch.., m, k] x [batch.., k, n]`, any
    /// strides, into a contiguous `[batch.., m, n]`.
    fn matmul(&self, la: &Layout, b: &Buffer, lb: &Layout) -> Result<Buffer> {
        if let Some((d, x, y)) = amx_operands(self, b) {
            if let Some(out) = bf16_matmul(d, (x, la), (y, lb), None) {
                return Ok(Buffer::BF16(out));
            }
        }
        if let Some(h) = half_dtype(self) {
            let ((x, xl), (y, yl)) = (widen(self, la), widen(b, lb));
            return Ok(narrow(x.matmul(&xl, &y, &yl)?, h));
        }
        let a = self;
        float_kernel!("matmul", a, da: T => {
            let db = same::<T>("matmul", b)?;
            Ok(T::wrap(matmul_impl::<T>(da, la, db, lb)))
        })
    }

    /// `matmul_bias`: every output row starts as the bias and
    /// the GEMM accumulates the product onto it, so the bias costs no pass of its own.
    fn matmul_bias(&self, la: &Layout, b: &Buffer, lb: &Layout, bias: (&Buffer, &Layout)) -> Result<Buffer> {
        if let (Some((d, x, y)), Buffer::BF16(c)) = (amx_operands(self, b), bias.0) {
            if let Some(out) = bf16_matmul(d, (x, la), (y, lb), Some((c, bias.1))) {
                return Ok(Buffer::BF16(out));
            }
        }
        if let Some(h) = half_dtype(self) {
            let ((x, xl), (y, yl), (c, cl)) = (widen(self, la), widen(b, lb), widen(bias.0, bias.1));
            return Ok(narrow(x.matmul_bias(&xl, &y, &yl, (&c, &cl))?, h));
        }
        let a = self;
        float_kernel!("matmul_bias", a, da: T => {
            let db = same::<T>("matmul_bias", b)?;
            let bias = view(same::<T>("matmul_bias", bias.0)?, bias.1);
            let (m, k, n) = (la.shape()[0], la.shape()[1], lb.shape()[1]);
            let mut out = Vec::with_capacity(m * n);
            for _ in 0..m {
                out.extend_from_slice(bias);
            }
            let (sa, sb) = (la.strides(), lb.strides());
            let (pa, pb) = (SendPtr(da.as_ptr()), SendPtr(db.as_ptr()));
            let dst = out.as_mut_slice();
            let mut gemm = || {
                let (pa, pb) = (pa, pb);
                // SAFETY: the front end checked both layouts against their storages; `dst`
                // holds the m*n initialised elements of the output.
                unsafe {
                    gemm_into::<T>(
                        m,
                        n,
                        k,
                        (dst.as_mut_ptr(), n, 1),
                        true,
                        pa.0.add(la.offset()),
                        sa[0],
                        sa[1],
                        pb.0.add(lb.offset()),
                        sb[0],
                        sb[1],
                        gemm_threads_for(m, n, k),
                    )
                }
            };
            // the gemm crate forks in this thread's pool, oneDNN its own OpenMP threads
            if TypeId::of::<T>() == TypeId::of::<f32>() && onednn().is_some() {
                gemm()
            } else {
                install(gemm)
            }
            Ok(T::wrap(out))
        })
    }
}
