//! In-place updates through a view on the CPU: gradient accumulation, fills, and the
//! fused optimizer steps.

use super::f16_storage::{half_dtype, narrow, widen};
use super::{float_kernel, same, same_mut, view};
use crate::backend::{AdamWScalars, InPlace, SgdScalars};
use crate::Buffer;
use crate::{Element, Layout, Result, TensorError};

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
        let (lr, mom, wd) = (s.lr, s.momentum, s.weight_decay);
        match buf {
            Some((b, bl)) => {
                let bv = f32_mut(op, b, bl)?;
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
        let (b1, b2, one_m_b1, one_m_b2) = (s.beta1, s.beta2, s.one_minus_beta1, s.one_minus_beta2);
        let (decay, step_size, bc2_sqrt, eps) = (s.decay, s.step_size, s.bias_correction2_sqrt, s.eps);
        for (((p, m), v), &g) in pv.iter_mut().zip(mv.iter_mut()).zip(vv.iter_mut()).zip(gv) {
            *p *= decay;
            *m = b1 * *m + one_m_b1 * g;
            *v = b2 * *v + one_m_b2 * g * g;
            *p -= step_size * *m / (v.sqrt() / bc2_sqrt + eps);
        }
        Ok(())
    }
}
