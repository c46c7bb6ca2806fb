//! Elementwise maps on the CPU: unary, scalar and broadcasting binary ops, activation
//! derivatives.

use super::f16_storage::{half_dtype, narrow, widen, zip_half};
use super::{float_kernel, same, view};
use crate::backend::{BinaryOp, Elementwise, UnaryOp};
use crate::threads::{par_chunks_mut, par_rows_mut};
use crate::Buffer;
use crate::{Element, Float, Layout, Result};

const GRAIN: usize = 16 * 1024;

/// `1/sqrt(2*pi)`.
const INV_SQRT_2PI: f64 = 0.398_942_280_401_432_7;

fn map<T: Float>(src: &[T], f: impl Fn(T) -> T + Sync + Send) -> Buffer {
    let mut out = vec![T::ZERO; src.len()];
    par_chunks_mut(&mut out, GRAIN, |start, chunk| {
        let len = chunk.len();
        for (o, &s) in chunk.iter_mut().zip(&src[start..start + len]) {
            *o = f(s);
        }
    });
    T::wrap(out)
}

fn gelu<T: Float>(x: T) -> T {
    let half = T::from_f64(0.5);
    half * x * (T::ONE + (x * T::from_f64(std::f64::consts::FRAC_1_SQRT_2)).erf())
}

fn gelu_grad<T: Float>(x: T) -> T {
    let half = T::from_f64(0.5);
    let cdf = half * (T::ONE + (x * T::from_f64(std::f64::consts::FRAC_1_SQRT_2)).erf());
    let pdf = T::from_f64(INV_SQRT_2PI) * (-(x * x) * half).exp();
    cdf + x * pdf
}

/// `f(a, b)` over two views broadcast to one shape, into a contiguous output.
fn zip_with<T: Float>(da: &[T], la: &Layout, db: &[T], lb: &Layout, f: impl Fn(T, T) -> T + Sync + Send) -> Buffer {
    let shape = la.shape();
    let mut out = vec![T::ZERO; la.numel()];
    if la.is_contiguous() && lb.is_contiguous() {
        let (sa, sb) = (view(da, la), view(db, lb));
        par_chunks_mut(&mut out, GRAIN, |start, chunk| {
            let len = chunk.len();
            let (xa, xb) = (&sa[start..start + len], &sb[start..start + len]);
            for ((o, &x), &y) in chunk.iter_mut().zip(xa).zip(xb) {
                *o = f(x, y);
            }
        });
        return T::wrap(out);
    }
    let inner = shape.last().copied().unwrap_or(1);
    let (sa_in, sb_in) = (
        la.strides().last().copied().unwrap_or(0),
        lb.strides().last().copied().unwrap_or(0),
    );
    par_rows_mut(&mut out, inner, |row, o| {
        let (mut ia, mut ib) = (la.row_offset(row), lb.row_offset(row));
        for v in o.iter_mut() {
            *v = f(da[ia], db[ib]);
            ia += sa_in;
            ib += sb_in;
        }
    });
    T::wrap(out)
}

impl Elementwise for Buffer {
    /// `unary` on a contiguous view.
    fn unary(&self, l: &Layout, op: UnaryOp) -> Result<Buffer> {
        if let (Some(_), UnaryOp::Gelu) = (half_dtype(self), op) {
            if let Some(out) = zip_half((self, l), None, |x, _, o| super::gelu_f32::gelu_slice(x, o)) {
                return Ok(out);
            }
        }
        if let Some(h) = half_dtype(self) {
            let (x, xl) = widen(self, l);
            return Ok(narrow(x.unary(&xl, op)?, h));
        }
        let s = self;
        if let (UnaryOp::Gelu, Buffer::F32(data)) = (op, s) {
            let src = view(data, l);
            let mut out = vec![0.0f32; src.len()];
            par_chunks_mut(&mut out, GRAIN, |start, chunk| {
                super::gelu_f32::gelu_slice(&src[start..start + chunk.len()], chunk)
            });
            return Ok(Buffer::F32(out));
        }
        float_kernel!("unary", s, data: T => {
            let src = view(data, l);
            Ok(match op {
                UnaryOp::Neg => map(src, |x: T| -x),
                UnaryOp::Exp => map(src, |x: T| x.exp()),
                UnaryOp::Ln => map(src, |x: T| x.ln()),
                UnaryOp::Sqrt => map(src, |x: T| x.sqrt()),
                // NaN passes through, as in PyTorch (`x > 0 ? x : 0` would turn it into 0)
                UnaryOp::Relu => map(src, |x: T| if x <= T::ZERO { T::ZERO } else { x }),
                UnaryOp::Gelu => map(src, |x: T| gelu(x)),
                UnaryOp::Sqr => map(src, |x: T| x * x),
                UnaryOp::Affine { mul, add } => {
                    let (m, a) = (T::from_f64(mul), T::from_f64(add));
                    map(src, move |x: T| x * m + a)
                }
                UnaryOp::Powf(p) => {
                    let p = T::from_f64(p);
                    map(src, move |x: T| x.powf(p))
                }
                UnaryOp::Sin => map(src, |x: T| x.sin()),
                UnaryOp::Cos => map(src, |x: T| x.cos()),
                UnaryOp::Abs => map(src, |x: T| x.abs()),
                UnaryOp::Sign => map(src, |x: T| {
                    if x > T::ZERO {
                        T::ONE
                    } else if x < T::ZERO {
                        -T::ONE
                    } else {
                        x * T::ZERO
                    }
                }),
                UnaryOp::Round => map(src, |x: T| x.round_ties_even()),
                UnaryOp::Clamp { min, max } => {
                    let (lo, hi) = (T::from_f64(min), T::from_f64(max));
                    map(src, move |x: T| if x < lo { lo } else if x > hi { hi } else { x })
                }
                UnaryOp::InRange { min, max } => {
                    let (lo, hi) = (T::from_f64(min), T::from_f64(max));
                    map(src, move |x: T| if lo <= x && x <= hi { T::ONE } else { T::ZERO })
                }
                UnaryOp::IsZero => map(src, |x: T| if x == T::ZERO { T::ONE } else { T::ZERO }),
            })
        })
    }

    /// `binary`: any two layouts of one shape.
    fn binary(&self, la: &Layout, b: &Buffer, lb: &Layout, op: BinaryOp) -> Result<Buffer> {
        if half_dtype(self).is_some() {
            let fused = match op {
                BinaryOp::GeluBackward => zip_half((self, la), Some((b, lb)), |x, g, o| {
                    super::gelu_f32::gelu_backward_slice(x, g, o)
                }),
                BinaryOp::Add => zip_half((self, la), Some((b, lb)), |x, y, o| {
                    for ((o, &x), &y) in o.iter_mut().zip(x).zip(y) {
                        *o = x + y;
                    }
                }),
                BinaryOp::Mul => zip_half((self, la), Some((b, lb)), |x, y, o| {
                    for ((o, &x), &y) in o.iter_mut().zip(x).zip(y) {
                        *o = x * y;
                    }
                }),
                _ => None,
            };
            if let Some(out) = fused {
                return Ok(out);
            }
        }
        if let Some(h) = half_dtype(self) {
            let ((x, xl), (y, yl)) = (widen(self, la), widen(b, lb));
            return Ok(narrow(x.binary(&xl, &y, &yl, op)?, h));
        }
        let a = self;
        if let (BinaryOp::GeluBackward, Buffer::F32(da), Buffer::F32(db)) = (op, a, b) {
            if la.is_contiguous() && lb.is_contiguous() {
                let (x, g) = (view(da, la), view(db, lb));
                let mut out = vec![0.0f32; x.len()];
                par_chunks_mut(&mut out, GRAIN, |start, chunk| {
                    let end = start + chunk.len();
                    super::gelu_f32::gelu_backward_slice(&x[start..end], &g[start..end], chunk)
                });
                return Ok(Buffer::F32(out));
            }
            return Ok(zip_with(da, la, db, lb, |x: f32, g: f32| {
                g * super::gelu_f32::gelu_grad(x)
            }));
        }
        float_kernel!("binary", a, da: T => {
            let db = same::<T>("binary", b)?;
            Ok(match op {
                BinaryOp::Add => zip_with(da, la, db, lb, |a: T, b: T| a + b),
                BinaryOp::Sub => zip_with(da, la, db, lb, |a: T, b: T| a - b),
                BinaryOp::Mul => zip_with(da, la, db, lb, |a: T, b: T| a * b),
                BinaryOp::Div => zip_with(da, la, db, lb, |a: T, b: T| a / b),
                BinaryOp::ReluBackward => zip_with(da, la, db, lb, |x: T, g: T| if x > T::ZERO { g } else { T::ZERO }),
                BinaryOp::GeluBackward => zip_with(da, la, db, lb, |x: T, g: T| g * gelu_grad(x)),
            })
        })
    }
}
