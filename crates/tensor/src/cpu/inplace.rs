//! In-place updates through a view on the CPU: gradient accumulation, fills, and the
//! fused optimizer steps.

use super::f16_storage::{half_chunk, half_dtype, narrow, widen, HalfFloat, HALF_CHUNK};
use super::{float_kernel, same, same_mut, view};
use crate::backend::{AdamWScalars, InPlace, SgdScalars};
use crate::Buffer;
use crate::{Element, Layout, Result, TensorError};
use brigade_dtype::convert;
use half::{bf16, f16};

fn f32_mut<'a>(op: &'static str, s: &'a mut Buffer, l: &Layout) -> Result<&'a mut [f32]> {
    let d = same_mut::<f32>(op, s)?;
    Ok(&mut d[l.offset()..l.offset() + l.numel()])
}

fn f32_ref<'a>(op: &'static str, s: &'a Buffer, l: &Layout) -> Result<&'a [f32]> {
    Ok(view(same::<f32>(op, s)?, l))
}

impl InPlace for Buffer {
    fn fill(&mut self, l: &Layout, v: f64) -> Result<()> {
        let s = self;
        fn go<T: Element>(data: &mut [T], l: &Layout, v: f64) {
            let v = T::from_f64(v);
            if l.is_contiguous() {
                data[l.offset()..l.offset() + l.numel()].fill(v);
            } else {
                l.for_each_offset(|o| data[o] = v);
            }
        }
        match s {
            Buffer::F32(d) => go(d, l, v),
            Buffer::F64(d) => go(d, l, v),
            Buffer::F16(d) => go(d, l, v),
            Buffer::BF16(d) => go(d, l, v),
            Buffer::I64(d) => go(d, l, v),
            Buffer::U8(d) => go(d, l, v),
            Buffer::I8(d) => go(d, l, v),
        }
        Ok(())
    }

    fn copy_from(&mut self, l: &Layout, src: (&Buffer, &Layout)) -> Result<()> {
        let dst = self;
        fn go<T: Element>(data: &mut [T], l: &Layout, src: &Buffer, sl: &Layout) -> Result<()> {
            let s = view(same::<T>("copy_from", src)?, sl);
            if l.is_contiguous() {
                data[l.offset()..l.offset() + l.numel()].copy_from_slice(s);
            } else {
                let mut i = 0;
                l.for_each_offset(|o| {
                    data[o] = s[i];
                    i += 1;
                });
            }
            Ok(())
        }
        match dst {
            Buffer::F32(d) => go(d, l, src.0, src.1),
            Buffer::F64(d) => go(d, l, src.0, src.1),
            Buffer::F16(d) => go(d, l, src.0, src.1),
            Buffer::BF16(d) => go(d, l, src.0, src.1),
            Buffer::I64(d) => go(d, l, src.0, src.1),
            Buffer::U8(d) => go(d, l, src.0, src.1),
            Buffer::I8(d) => go(d, l, src.0, src.1),
        }
    }

    fn add_scaled_assign(&mut self, l: &Layout, src: (&Buffer, &Layout), scale: f64) -> Result<()> {
        if let (Some(_), true, true) = (half_dtype(self), l.is_contiguous(), src.1.is_contiguous()) {
            return add_scaled_assign_half(self, l, src, scale);
        }
        if let Some(h) = half_dtype(self) {
            let (mut acc, al) = widen(self, l);
            let (s, sl) = widen(src.0, src.1);
            acc.to_mut().add_scaled_assign(&al, (&s, &sl), scale)?;
            let sum = narrow(acc.into_owned(), h);
            return self.copy_from(l, (&sum, &al));
        }
        let dst = self;
        float_kernel!("add_assign", dst, data: T => {
            let s = view(same::<T>("add_assign", src.0)?, src.1);
            let scale = T::from_f64(scale);
            if l.is_contiguous() {
                for (d, &s) in data[l.offset()..l.offset() + l.numel()].iter_mut().zip(s) {
                    *d += scale * s;
                }
            } else {
                let mut i = 0;
                l.for_each_offset(|o| {
                    data[o] += scale * s[i];
                    i += 1;
                });
            }
            Ok(())
        })
    }

    fn sgd_step(
        &mut self,
        l: &Layout,
        grad: (&Buffer, &Layout),
        buf: Option<(&mut Buffer, &Layout)>,
        s: &SgdScalars,
    ) -> Result<()> {
        let p = self;
        let op = "sgd_step";
        let (pv, gv) = (f32_mut(op, p, l)?, f32_ref(op, grad.0, grad.1)?);
        let bv = match buf {
            Some((b, bl)) => Some(f32_mut(op, b, bl)?),
            None => None,
        };
        sgd_loop(pv, bv, gv, s);
        Ok(())
    }

    fn adamw_step(
        &mut self,
        l: &Layout,
        grad: (&Buffer, &Layout),
        m: (&mut Buffer, &Layout),
        v: (&mut Buffer, &Layout),
        s: &AdamWScalars,
    ) -> Result<()> {
        let p = self;
        let op = "adamw_step";
        let (pv, gv) = (f32_mut(op, p, l)?, f32_ref(op, grad.0, grad.1)?);
        let (mv, vv) = (f32_mut(op, m.0, m.1)?, f32_mut(op, v.0, v.1)?);
        if [gv.len(), mv.len(), vv.len()] != [pv.len(); 3] {
            return Err(TensorError::Invalid {
                op,
                msg: "parameter, gradient and moments differ in length".into(),
            });
        }
        adamw_loop(pv, mv, vv, gv, s);
        Ok(())
    }

    fn sgd_step_with_copy(
        &mut self,
        l: &Layout,
        grad: (&Buffer, &Layout),
        buf: Option<(&mut Buffer, &Layout)>,
        copy: (&mut Buffer, &Layout),
        s: &SgdScalars,
    ) -> Result<()> {
        let op = "sgd_step_with_copy";
        let pv = f32_mut(op, self, l)?;
        let mut bv = match buf {
            Some((b, bl)) => Some(f32_mut(op, b, bl)?),
            None => None,
        };
        let (g, c) = (Wide::of(op, grad)?, Narrow::of(op, copy)?);
        if g.len() != pv.len() || c.len() != pv.len() || bv.as_ref().is_some_and(|b| b.len() != pv.len()) {
            return Err(length_mismatch(op));
        }
        in_chunks(pv, g, c, |range, p, g| {
            sgd_loop(p, bv.as_mut().map(|b| &mut b[range]), g, s)
        });
        Ok(())
    }

    fn adamw_step_with_copy(
        &mut self,
        l: &Layout,
        grad: (&Buffer, &Layout),
        m: (&mut Buffer, &Layout),
        v: (&mut Buffer, &Layout),
        copy: (&mut Buffer, &Layout),
        s: &AdamWScalars,
    ) -> Result<()> {
        let op = "adamw_step_with_copy";
        let pv = f32_mut(op, self, l)?;
        let (mv, vv) = (f32_mut(op, m.0, m.1)?, f32_mut(op, v.0, v.1)?);
        let (g, c) = (Wide::of(op, grad)?, Narrow::of(op, copy)?);
        if [g.len(), c.len(), mv.len(), vv.len()] != [pv.len(); 4] {
            return Err(length_mismatch(op));
        }
        in_chunks(pv, g, c, |range, p, g| {
            adamw_loop(p, &mut mv[range.clone()], &mut vv[range], g, s)
        });
        Ok(())
    }
}

/// `dst += scale * src` on contiguous 16-bit views a chunk at a time (each widened, summed in
/// f32 with `scale` rounded to f32, and rounded back): the bits of widening both whole.
fn add_scaled_assign_half(dst: &mut Buffer, l: &Layout, src: (&Buffer, &Layout), scale: f64) -> Result<()> {
    fn go<H: HalfFloat>(d: &mut [H], s: &[H], scale: f32) {
        for (dc, sc) in d.chunks_mut(HALF_CHUNK).zip(s.chunks(HALF_CHUNK)) {
            let mut acc = [H::default(); HALF_CHUNK];
            let acc = &mut acc[..dc.len()];
            acc.copy_from_slice(dc);
            half_chunk(acc, Some(sc), dc, &|a, b, o| {
                for ((o, &a), &b) in o.iter_mut().zip(a).zip(b) {
                    *o = a + scale * b;
                }
            });
        }
    }
    let op = "add_assign";
    let range = l.offset()..l.offset() + l.numel();
    let scale = scale as f32;
    match (dst, src.0) {
        (Buffer::BF16(d), Buffer::BF16(s)) => go(&mut d[range], view(s, src.1), scale),
        (Buffer::F16(d), Buffer::F16(s)) => go(&mut d[range], view(s, src.1), scale),
        (d, s) => {
            return Err(TensorError::DTypeMismatch {
                op,
                lhs: d.dtype(),
                rhs: s.dtype(),
            })
        }
    }
    Ok(())
}

fn length_mismatch(op: &'static str) -> TensorError {
    TensorError::Invalid {
        op,
        msg: "parameter, gradient, state and copy differ in length".into(),
    }
}

/// The SGD update of [`InPlace::sgd_step`] over slices of one length, compiled for AVX-512 or
/// AVX2 where the CPU has it (the same bits: no fused multiply-add).
fn sgd_loop(pv: &mut [f32], bv: Option<&mut [f32]>, gv: &[f32], s: &SgdScalars) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F, checked just above.
            return unsafe { sgd_loop_avx512(pv, bv, gv, s) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2, checked just above.
            return unsafe { sgd_loop_avx2(pv, bv, gv, s) };
        }
    }
    sgd_loop_any(pv, bv, gv, s)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn sgd_loop_avx512(pv: &mut [f32], bv: Option<&mut [f32]>, gv: &[f32], s: &SgdScalars) {
    sgd_loop_any(pv, bv, gv, s)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sgd_loop_avx2(pv: &mut [f32], bv: Option<&mut [f32]>, gv: &[f32], s: &SgdScalars) {
    sgd_loop_any(pv, bv, gv, s)
}

#[inline(always)]
fn sgd_loop_any(pv: &mut [f32], bv: Option<&mut [f32]>, gv: &[f32], s: &SgdScalars) {
    let (lr, mom, wd) = (s.lr, s.momentum, s.weight_decay);
    match bv {
        Some(bv) => {
            for ((p, b), &g) in pv.iter_mut().zip(bv.iter_mut()).zip(gv) {
                let mut g = g;
                if wd != 0.0 {
                    g += wd * *p;
                }
                *b = if s.is_first_step { g } else { mom * *b + g };
                g = *b;
                *p -= lr * g;
            }
        }
        None => {
            for (p, &g) in pv.iter_mut().zip(gv) {
                let mut g = g;
                if wd != 0.0 {
                    g += wd * *p;
                }
                *p -= lr * g;
            }
        }
    }
}

/// The AdamW update of [`InPlace::adamw_step`] over slices of one length: the square root
/// and the division vectorize, eight or sixteen lanes where the CPU has AVX2 or AVX-512 (the
/// same bits: no fused multiply-add, every operation rounded as written).
fn adamw_loop(pv: &mut [f32], mv: &mut [f32], vv: &mut [f32], gv: &[f32], s: &AdamWScalars) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F, checked just above.
            return unsafe { adamw_loop_avx512(pv, mv, vv, gv, s) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2, checked just above.
            return unsafe { adamw_loop_avx2(pv, mv, vv, gv, s) };
        }
    }
    adamw_loop_any(pv, mv, vv, gv, s)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn adamw_loop_avx512(pv: &mut [f32], mv: &mut [f32], vv: &mut [f32], gv: &[f32], s: &AdamWScalars) {
    adamw_loop_any(pv, mv, vv, gv, s)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn adamw_loop_avx2(pv: &mut [f32], mv: &mut [f32], vv: &mut [f32], gv: &[f32], s: &AdamWScalars) {
    adamw_loop_any(pv, mv, vv, gv, s)
}

#[inline(always)]
fn adamw_loop_any(pv: &mut [f32], mv: &mut [f32], vv: &mut [f32], gv: &[f32], s: &AdamWScalars) {
    let (b1, b2, one_m_b1, one_m_b2) = (s.beta1, s.beta2, s.one_minus_beta1, s.one_minus_beta2);
    let (decay, step_size, bc2_sqrt, eps) = (s.decay, s.step_size, s.bias_correction2_sqrt, s.eps);
    for (((p, m), v), &g) in pv.iter_mut().zip(mv.iter_mut()).zip(vv.iter_mut()).zip(gv) {
        *p *= decay;
        *m = b1 * *m + one_m_b1 * g;
        *v = b2 * *v + one_m_b2 * g * g;
        *p -= step_size * *m / (v.sqrt() / bc2_sqrt + eps);
    }
}

/// A gradient the mixed steps read: f32 as it is, or 16 bits widened a chunk at a time.
#[derive(Clone, Copy)]
enum Wide<'a> {
    F32(&'a [f32]),
    BF16(&'a [bf16]),
    F16(&'a [f16]),
}

impl<'a> Wide<'a> {
    fn of(op: &'static str, (b, l): (&'a Buffer, &Layout)) -> Result<Wide<'a>> {
        Ok(match b {
            Buffer::F32(d) => Wide::F32(view(d, l)),
            Buffer::BF16(d) => Wide::BF16(view(d, l)),
            Buffer::F16(d) => Wide::F16(view(d, l)),
            b => return Err(mixed_dtype(op, "the gradient", b.dtype())),
        })
    }

    fn len(&self) -> usize {
        match self {
            Wide::F32(d) => d.len(),
            Wide::BF16(d) => d.len(),
            Wide::F16(d) => d.len(),
        }
    }
}

/// The 16-bit copy the mixed steps write.
enum Narrow<'a> {
    BF16(&'a mut [bf16]),
    F16(&'a mut [f16]),
}

impl<'a> Narrow<'a> {
    fn of(op: &'static str, (b, l): (&'a mut Buffer, &Layout)) -> Result<Narrow<'a>> {
        let range = l.offset()..l.offset() + l.numel();
        Ok(match b {
            Buffer::BF16(d) => Narrow::BF16(&mut d[range]),
            Buffer::F16(d) => Narrow::F16(&mut d[range]),
            b => return Err(mixed_dtype(op, "the copy", b.dtype())),
        })
    }

    fn len(&self) -> usize {
        match self {
            Narrow::BF16(d) => d.len(),
            Narrow::F16(d) => d.len(),
        }
    }
}

fn mixed_dtype(op: &'static str, what: &str, dtype: crate::DType) -> TensorError {
    TensorError::Invalid {
        op,
        msg: format!("{what} is {dtype}; a master-weight step takes f32, bf16 or f16 gradients and a bf16 or f16 copy"),
    }
}

/// Elements per chunk of a mixed step: the widened gradient and the updated masters stay in
/// the first-level cache between the step and the rounding.
const CHUNK: usize = 1024;

/// Runs `step(range, masters, grad)` over `pv` a [`CHUNK`] at a time, the gradient widened to
/// f32 first, and rounds each updated chunk of masters into `copy`: one pass over memory.
fn in_chunks(
    pv: &mut [f32],
    g: Wide<'_>,
    mut copy: Narrow<'_>,
    mut step: impl FnMut(std::ops::Range<usize>, &mut [f32], &[f32]),
) {
    let mut wide = [0.0f32; CHUNK];
    for start in (0..pv.len()).step_by(CHUNK) {
        let range = start..(start + CHUNK).min(pv.len());
        let n = range.len();
        let gc: &[f32] = match g {
            Wide::F32(d) => &d[range.clone()],
            Wide::BF16(d) => {
                convert::bf16_to_f32(&d[range.clone()], &mut wide[..n]);
                &wide[..n]
            }
            Wide::F16(d) => {
                convert::f16_to_f32(&d[range.clone()], &mut wide[..n]);
                &wide[..n]
            }
        };
        let p = &mut pv[range.clone()];
        step(range.clone(), p, gc);
        match &mut copy {
            Narrow::BF16(c) => convert::f32_to_bf16(p, &mut c[range]),
            Narrow::F16(c) => convert::f32_to_f16(p, &mut c[range]),
        }
    }
}
