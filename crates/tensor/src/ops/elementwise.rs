//! Elementwise maps: unary, scalar and broadcasting binary ops, activation derivatives.

use super::{compute_dtype, same_device, same_dtype};
use crate::backend::{BinaryOp, UnaryOp};
use crate::layout::broadcast_shape;
use crate::storage::dispatch;
use crate::{Result, Tensor};

/// Applies `op` to each element (a strided view is gathered first).
fn unary(name: &'static str, x: &Tensor, op: UnaryOp) -> Result<Tensor> {
    compute_dtype(name, x)?;
    let x = x.contiguous_for(name)?;
    let out = dispatch!(&*x.storage(name)?, s => s.unary(x.layout(), op))?;
    Ok(Tensor::from_storage(out, x.shape()))
}

/// Applies `op(a, b)` elementwise after broadcasting `a` and `b` to a common shape.
fn binary(name: &'static str, a: &Tensor, b: &Tensor, op: BinaryOp) -> Result<Tensor> {
    compute_dtype(name, a)?;
    same_dtype(name, a, b)?;
    same_device(name, a, b)?;
    let shape = broadcast_shape(name, a.shape(), b.shape())?;
    let (la, lb) = (a.layout().broadcast_to(&shape)?, b.layout().broadcast_to(&shape)?);
    let out = dispatch!(&*a.storage(name)?, s, other => s.binary(&la, other(&*b.storage(name)?)?, &lb, op))?;
    Ok(Tensor::from_storage(out, &shape))
}

macro_rules! unary_op {
    ($(#[$doc:meta])* $name:ident, $op:expr) => {
        $(#[$doc])*
        pub fn $name(&self) -> Result<Tensor> {
            unary(stringify!($name), self, $op)
        }
    };
}

macro_rules! binary_op {
    ($(#[$doc:meta])* $name:ident, $op:expr) => {
        $(#[$doc])*
        pub fn $name(&self, rhs: &Tensor) -> Result<Tensor> {
            binary(stringify!($name), self, rhs, $op)
        }
    };
}

impl Tensor {
    unary_op!(
        /// `-x`.
        neg, UnaryOp::Neg);
    unary_op!(
        /// `e^x`.
        exp, UnaryOp::Exp);
    unary_op!(
        /// Natural logarithm.
        ln, UnaryOp::Ln);
    unary_op!(
        /// Square root.
        sqrt, UnaryOp::Sqrt);
    unary_op!(
        /// `max(x, 0)`.
        relu, UnaryOp::Relu);
    unary_op!(
        /// GELU, exact erf form: `0.5 x (1 + erf(x / sqrt 2))` (PyTorch's default).
        gelu, UnaryOp::Gelu);
    unary_op!(
        /// `x^2`.
        sqr, UnaryOp::Sqr);
    unary_op!(
        /// Sine (radians).
        sin, UnaryOp::Sin);
    unary_op!(
        /// Cosine (radians).
        cos, UnaryOp::Cos);
    unary_op!(
        /// `|x|`.
        abs, UnaryOp::Abs);
    unary_op!(
        /// The sign: 1 for positive, -1 for negative, 0 for zero; a NaN stays NaN
        /// (`torch.sign`).
        sign, UnaryOp::Sign);
    unary_op!(
        /// The nearest integer, half to even (`torch.round`: `round(2.5) = 2`,
        /// `round(-0.5) = -0`).
        round, UnaryOp::Round);
    unary_op!(
        /// 1 where the element is exactly 0, else 0 (a NaN gives 0).
        is_zero, UnaryOp::IsZero);

    binary_op!(
        /// `a + b`, broadcasting.
        add, BinaryOp::Add);
    binary_op!(
        /// `a - b`, broadcasting.
        sub, BinaryOp::Sub);
    binary_op!(
        /// `a * b`, broadcasting.
        mul, BinaryOp::Mul);
    binary_op!(
        /// `a / b`, broadcasting.
        div, BinaryOp::Div);
    binary_op!(
        /// `g * (x > 0)` with `self = x` and `rhs = g`: the ReLU derivative applied to a gradient.
        relu_backward, BinaryOp::ReluBackward);
    binary_op!(
        /// `g * gelu'(x)` with `self = x` and `rhs = g`.
        gelu_backward, BinaryOp::GeluBackward);

    /// `x * mul + add`, elementwise.
    pub fn affine(&self, mul: f64, add: f64) -> Result<Tensor> {
        unary("affine", self, UnaryOp::Affine { mul, add })
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
        unary("powf", self, UnaryOp::Powf(p))
    }

    /// `x^p` (`torch.pow` with a scalar exponent): the same as [`Tensor::powf`].
    pub fn pow(&self, p: f64) -> Result<Tensor> {
        self.powf(p)
    }

    /// Each element limited to `[min, max]` (`torch.clamp`); pass `f64::NEG_INFINITY` or
    /// `f64::INFINITY` for a side without a bound. A NaN stays NaN. `min > max` is an error
    /// (PyTorch would set every element to `max`).
    pub fn clamp(&self, min: f64, max: f64) -> Result<Tensor> {
        check_bounds("clamp", min, max)?;
        unary("clamp", self, UnaryOp::Clamp { min, max })
    }

    /// 1 where `min <= x <= max`, else 0 (a NaN gives 0): where [`Tensor::clamp`] passes its
    /// gradient.
    pub fn in_range(&self, min: f64, max: f64) -> Result<Tensor> {
        check_bounds("in_range", min, max)?;
        unary("in_range", self, UnaryOp::InRange { min, max })
    }
}

/// Clamp bounds: neither NaN, `min <= max`.
fn check_bounds(op: &'static str, min: f64, max: f64) -> Result<()> {
    if min.is_nan() || max.is_nan() || min > max {
        return Err(crate::TensorError::Invalid {
            op,
            msg: format!("needs min <= max, got min {min} and max {max}"),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::{test_device, DType, Device, Tensor};

    fn on(t: Tensor, d: Device) -> Tensor {
        t.to_device(d).unwrap()
    }

    fn broadcasting_add_of_a_row_and_a_column(d: Device) {
        let a = on(Tensor::from_vec(vec![1.0f32, 2.0, 3.0], &[3, 1]).unwrap(), d);
        let b = on(Tensor::from_vec(vec![10.0f32, 20.0], &[2]).unwrap(), d);
        let c = a.add(&b).unwrap();
        assert_eq!((c.shape(), c.device()), (&[3usize, 2][..], d));
        assert_eq!(c.to_vec::<f32>().unwrap(), vec![11.0, 21.0, 12.0, 22.0, 13.0, 23.0]);
    }
    test_device!(broadcasting_add_of_a_row_and_a_column);

    fn ops_on_a_transposed_view_see_the_view(d: Device) {
        let a = on(
            Tensor::from_vec(vec![1.0f64, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]).unwrap(),
            d,
        );
        let t = a.t().unwrap();
        assert_eq!(
            t.mul_scalar(2.0).unwrap().to_vec::<f64>().unwrap(),
            vec![2.0, 8.0, 4.0, 10.0, 6.0, 12.0]
        );
        // x - 2 x^T...: a binary op over two strided views, one of them transposed.
        let s = t.sub(&t.mul_scalar(3.0).unwrap()).unwrap();
        assert_eq!(s.to_vec::<f64>().unwrap(), vec![-2.0, -8.0, -4.0, -10.0, -6.0, -12.0]);
    }
    test_device!(ops_on_a_transposed_view_see_the_view);

    fn unary_maps_and_activation_derivatives(d: Device) {
        let x = on(Tensor::from_vec(vec![-1.0f64, 0.5, 2.0], &[3]).unwrap(), d);
        let got = |t: Tensor| t.to_vec::<f64>().unwrap();
        assert_eq!(got(x.relu().unwrap()), vec![0.0, 0.5, 2.0]);
        assert_eq!(got(x.affine(2.0, 1.0).unwrap()), vec![-1.0, 2.0, 5.0]);
        assert_eq!(got(x.sqr().unwrap()), vec![1.0, 0.25, 4.0]);
        // gelu(x) = x Phi(x); Phi(-1) = 0.158655253931457, Phi(2) = 0.977249868051821
        let g = got(x.gelu().unwrap());
        assert!((g[0] + 0.158_655_253_931_457).abs() < 1e-12 && (g[2] - 2.0 * 0.977_249_868_051_821).abs() < 1e-12);
        let ones = on(Tensor::ones(&[3], DType::F64), d);
        assert_eq!(got(x.relu_backward(&ones).unwrap()), vec![0.0, 1.0, 1.0]);
        // a NaN is not lost (torch.relu(nan) is nan): a NaN weight must not vanish silently
        let nan = on(Tensor::from_vec(vec![f64::NAN, -1.0], &[2]).unwrap(), d);
        assert!(got(nan.relu().unwrap())[0].is_nan());
    }
    test_device!(unary_maps_and_activation_derivatives);

    fn trigonometry_magnitude_rounding_and_clamping(d: Device) {
        let x = on(
            Tensor::from_vec(vec![-2.5f64, -0.5, 0.0, 0.5, 1.5, 2.5], &[6]).unwrap(),
            d,
        );
        let got = |t: Tensor| t.to_vec::<f64>().unwrap();
        // half to even: -2.5 -> -2, -0.5 -> -0, 0.5 -> 0, 1.5 -> 2, 2.5 -> 2
        assert_eq!(got(x.round().unwrap()), vec![-2.0, -0.0, 0.0, 0.0, 2.0, 2.0]);
        assert_eq!(got(x.abs().unwrap()), vec![2.5, 0.5, 0.0, 0.5, 1.5, 2.5]);
        assert_eq!(got(x.sign().unwrap()), vec![-1.0, -1.0, 0.0, 1.0, 1.0, 1.0]);
        assert_eq!(got(x.clamp(-1.0, 1.0).unwrap()), vec![-1.0, -0.5, 0.0, 0.5, 1.0, 1.0]);
        assert_eq!(
            got(x.clamp(f64::NEG_INFINITY, 0.0).unwrap()),
            vec![-2.5, -0.5, 0.0, 0.0, 0.0, 0.0]
        );
        // the bounds themselves are inside
        assert_eq!(got(x.in_range(-0.5, 1.5).unwrap()), vec![0.0, 1.0, 1.0, 1.0, 1.0, 0.0]);
        assert_eq!(got(x.is_zero().unwrap()), vec![0.0, 0.0, 1.0, 0.0, 0.0, 0.0]);
        assert!(x.clamp(1.0, -1.0).is_err());
        // sin(pi/6) = 1/2, cos(pi/3) = 1/2
        let a = on(
            Tensor::from_vec(vec![std::f64::consts::FRAC_PI_6, std::f64::consts::FRAC_PI_3], &[2]).unwrap(),
            d,
        );
        assert!((got(a.sin().unwrap())[0] - 0.5).abs() < 1e-15);
        assert!((got(a.cos().unwrap())[1] - 0.5).abs() < 1e-15);
        // a NaN stays NaN through clamp and sign; it is out of every range
        let nan = on(Tensor::from_vec(vec![f64::NAN], &[1]).unwrap(), d);
        assert!(got(nan.clamp(-1.0, 1.0).unwrap())[0].is_nan());
        assert!(got(nan.sign().unwrap())[0].is_nan());
        assert_eq!(got(nan.in_range(-1.0, 1.0).unwrap()), vec![0.0]);
    }
    test_device!(trigonometry_magnitude_rounding_and_clamping);

    fn integer_tensors_are_refused_by_float_kernels(d: Device) {
        let a = on(Tensor::zeros(&[2], DType::I64), d);
        assert!(a.exp().is_err());
    }
    test_device!(integer_tensors_are_refused_by_float_kernels);
}
