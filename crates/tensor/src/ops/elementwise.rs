//! Elementwise maps: unary, scalar and broadcasting binary ops, activation derivatives.

use crate::layout::broadcast_shape;
use crate::threads::{par_chunks_mut, par_rows_mut};
use crate::{Element, Float, Result, Tensor, TensorError};

const GRAIN: usize = 16 * 1024;

/// `1/sqrt(2*pi)`.
const INV_SQRT_2PI: f64 = 0.398_942_280_401_432_7;

fn unary<T: Float>(op: &'static str, x: &Tensor, f: impl Fn(T) -> T + Sync + Send) -> Result<Tensor> {
    let mut out = vec![T::ZERO; x.numel()];
    x.with_contiguous(op, |src: &[T]| {
        par_chunks_mut(&mut out, GRAIN, |start, chunk| {
            let len = chunk.len();
            for (o, &s) in chunk.iter_mut().zip(&src[start..start + len]) {
                *o = f(s);
            }
        })
    })?;
    Tensor::from_vec(out, x.shape())
}

/// Applies `f(a, b)` elementwise after broadcasting `a` and `b` to a common shape.
pub(crate) fn binary<T: Float>(
    op: &'static str,
    a: &Tensor,
    b: &Tensor,
    f: impl Fn(T, T) -> T + Sync + Send,
) -> Result<Tensor> {
    if a.dtype() != b.dtype() {
        return Err(TensorError::DTypeMismatch {
            op,
            lhs: a.dtype(),
            rhs: b.dtype(),
        });
    }
    let shape = broadcast_shape(op, a.shape(), b.shape())?;
    let n: usize = shape.iter().product();
    let mut out = vec![T::ZERO; n];
    if a.shape() == b.shape() && a.is_contiguous() && b.is_contiguous() {
        a.with_contiguous(op, |sa: &[T]| {
            b.with_contiguous(op, |sb: &[T]| {
                par_chunks_mut(&mut out, GRAIN, |start, chunk| {
                    let len = chunk.len();
                    let (xa, xb) = (&sa[start..start + len], &sb[start..start + len]);
                    for ((o, &x), &y) in chunk.iter_mut().zip(xa).zip(xb) {
                        *o = f(x, y);
                    }
                })
            })
        })??;
        return Tensor::from_vec(out, &shape);
    }
    let la = a.layout().broadcast_to(&shape)?;
    let lb = b.layout().broadcast_to(&shape)?;
    let inner = shape.last().copied().unwrap_or(1);
    let (sa_in, sb_in) = (
        la.strides().last().copied().unwrap_or(0),
        lb.strides().last().copied().unwrap_or(0),
    );
    a.with_storage(op, |da: &[T], _| {
        b.with_storage(op, |db: &[T], _| {
            par_rows_mut(&mut out, inner, |row, o| {
                let (mut ia, mut ib) = (la.row_offset(row), lb.row_offset(row));
                for v in o.iter_mut() {
                    *v = f(da[ia], db[ib]);
                    ia += sa_in;
                    ib += sb_in;
                }
            })
        })
    })??;
    Tensor::from_vec(out, &shape)
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

macro_rules! unary_op {
    ($(#[$doc:meta])* $name:ident, |$x:ident| $e:expr) => {
        $(#[$doc])*
        pub fn $name(&self) -> Result<Tensor> {
            float_dispatch!(stringify!($name), self.dtype(), T => unary::<T>(stringify!($name), self, |$x: T| $e))
        }
    };
}

macro_rules! binary_op {
    ($(#[$doc:meta])* $name:ident, |$a:ident, $b:ident| $e:expr) => {
        $(#[$doc])*
        pub fn $name(&self, rhs: &Tensor) -> Result<Tensor> {
            float_dispatch!(stringify!($name), self.dtype(), T => binary::<T>(stringify!($name), self, rhs, |$a: T, $b: T| $e))
        }
    };
}

impl Tensor {
    unary_op!(
        /// `-x`.
        neg, |x| -x);
    unary_op!(
        /// `e^x`.
        exp, |x| x.exp());
    unary_op!(
        /// Natural logarithm.
        ln, |x| x.ln());
    unary_op!(
        /// Square root.
        sqrt, |x| x.sqrt());
    unary_op!(
        /// `max(x, 0)`.
        relu, |x| if x > T::ZERO { x } else { T::ZERO });
    unary_op!(
        /// GELU, exact erf form: `0.5 x (1 + erf(x / sqrt 2))` (PyTorch's default).
        gelu, |x| gelu(x));
    unary_op!(
        /// `x^2`.
        sqr, |x| x * x);

    binary_op!(
        /// `a + b`, broadcasting.
        add, |a, b| a + b);
    binary_op!(
        /// `a - b`, broadcasting.
        sub, |a, b| a - b);
    binary_op!(
        /// `a * b`, broadcasting.
        mul, |a, b| a * b);
    binary_op!(
        /// `a / b`, broadcasting.
        div, |a, b| a / b);
    binary_op!(
        /// `g * (x > 0)` with `self = x` and `rhs = g`: the ReLU derivative applied to a gradient.
        relu_backward, |x, g| if x > T::ZERO { g } else { T::ZERO });
    binary_op!(
        /// `g * gelu'(x)` with `self = x` and `rhs = g`.
        gelu_backward, |x, g| g * gelu_grad(x));

    /// `x * mul + add`, elementwise.
    pub fn affine(&self, mul: f64, add: f64) -> Result<Tensor> {
        float_dispatch!("affine", self.dtype(), T => {
            let (m, a) = (T::from_f64(mul), T::from_f64(add));
            unary::<T>("affine", self, move |x: T| x * m + a)
        })
    }

    /// `x + s`.
    pub fn add_scalar(&self, s: f64) -> Result<Tensor> {
        self.affine(1.0, s)
    }

    /// `x * s`.
    pub fn mul_scalar(&self, s: f64) -> Result<Tensor> {
        self.affine(s, 0.0)
    }

    /// `x^p`.
    pub fn powf(&self, p: f64) -> Result<Tensor> {
        float_dispatch!("powf", self.dtype(), T => {
            let p = T::from_f64(p);
            unary::<T>("powf", self, move |x: T| x.powf(p))
        })
    }
}

#[cfg(test)]
mod tests {
    use crate::{DType, Tensor};

    #[test]
    fn broadcasting_add_of_a_row_and_a_column() {
        let a = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], &[3, 1]).unwrap();
        let b = Tensor::from_vec(vec![10.0f32, 20.0], &[2]).unwrap();
        let c = a.add(&b).unwrap();
        assert_eq!(c.shape(), &[3, 2]);
        assert_eq!(c.to_vec::<f32>().unwrap(), vec![11.0, 21.0, 12.0, 22.0, 13.0, 23.0]);
    }

    #[test]
    fn ops_on_a_transposed_view_see_the_view() {
        let a = Tensor::from_vec(vec![1.0f64, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]).unwrap();
        let t = a.t().unwrap();
        assert_eq!(
            t.mul_scalar(2.0).unwrap().to_vec::<f64>().unwrap(),
            vec![2.0, 8.0, 4.0, 10.0, 6.0, 12.0]
        );
    }

    #[test]
    fn integer_tensors_are_refused_by_float_kernels() {
        let a = Tensor::zeros(&[2], DType::I64);
        assert!(a.exp().is_err());
    }
}
