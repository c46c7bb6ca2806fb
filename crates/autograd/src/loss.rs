//! The losses of `torch.nn.functional` a regression or classification model reaches for, on
//! [`Var`], with PyTorch's reduction semantics: each method reduces by the mean over every
//! element (PyTorch's default `reduction='mean'`); its `_with` twin takes a [`Reduction`].
//! Input and target have one shape (no broadcasting between them: PyTorch warns there and
//! it is almost always a bug); the target may be a constant or need a gradient itself.
//! [`Var::cross_entropy`] is the classification loss over integer targets.

use brigade_tensor::TensorError;

use crate::{Result, Var};

/// How a loss reduces its elementwise values (PyTorch's `reduction=` argument).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Reduction {
    /// The mean over every element (PyTorch's default).
    #[default]
    Mean,
    /// The sum over every element.
    Sum,
    /// No reduction: the elementwise losses, the input's shape.
    None,
}

impl Reduction {
    /// `loss` reduced.
    fn apply(self, loss: Var) -> Result<Var> {
        match self {
            Reduction::Mean => loss.mean_all(),
            Reduction::Sum => loss.sum_all(),
            Reduction::None => Ok(loss),
        }
    }
}

fn same_shape(op: &'static str, input: &Var, target: &Var) -> Result<()> {
    let (a, b) = (input.shape(), target.shape());
    if a != b {
        return Err(TensorError::ShapeMismatch { op, lhs: a, rhs: b }.into());
    }
    Ok(())
}

impl Var {
    /// Mean squared error, `mean((x - y)^2)` (`F.mse_loss`).
    pub fn mse_loss(&self, target: &Var) -> Result<Var> {
        self.mse_loss_with(target, Reduction::Mean)
    }

    /// `(x - y)^2`, reduced.
    pub fn mse_loss_with(&self, target: &Var, reduction: Reduction) -> Result<Var> {
        same_shape("mse_loss", self, target)?;
        reduction.apply(self.sub(target)?.sqr()?)
    }

    /// Mean absolute error, `mean(|x - y|)` (`F.l1_loss`); the gradient at `x = y` is 0.
    pub fn l1_loss(&self, target: &Var) -> Result<Var> {
        self.l1_loss_with(target, Reduction::Mean)
    }

    /// `|x - y|`, reduced.
    pub fn l1_loss_with(&self, target: &Var, reduction: Reduction) -> Result<Var> {
        same_shape("l1_loss", self, target)?;
        reduction.apply(self.sub(target)?.abs()?)
    }

    /// `F.smooth_l1_loss` with `beta`: `0.5 d^2 / beta` where `|d| < beta`, else
    /// `|d| - 0.5 beta`, for `d = x - y`, by the mean. `beta = 0` is the L1 loss (as in
    /// PyTorch); a negative or NaN `beta` is an error.
    pub fn smooth_l1_loss(&self, target: &Var, beta: f64) -> Result<Var> {
        self.smooth_l1_loss_with(target, beta, Reduction::Mean)
    }

    /// [`Var::smooth_l1_loss`]'s elementwise values, reduced.
    pub fn smooth_l1_loss_with(&self, target: &Var, beta: f64, reduction: Reduction) -> Result<Var> {
        reduction.apply(self.smooth_l1("smooth_l1_loss", target, beta)?)
    }

    /// `F.huber_loss` with `delta`: `0.5 d^2` where `|d| < delta`, else
    /// `delta (|d| - 0.5 delta)`, by the mean: `delta` times the smooth L1 loss with
    /// `beta = delta`. `delta` must be positive.
    pub fn huber_loss(&self, target: &Var, delta: f64) -> Result<Var> {
        self.huber_loss_with(target, delta, Reduction::Mean)
    }

    /// [`Var::huber_loss`]'s elementwise values, reduced.
    pub fn huber_loss_with(&self, target: &Var, delta: f64, reduction: Reduction) -> Result<Var> {
        if !(delta > 0.0) {
            return Err(invalid("huber_loss", format!("delta must be positive, got {delta}")));
        }
        reduction.apply(self.smooth_l1("huber_loss", target, delta)?.mul_scalar(delta)?)
    }

    /// The elementwise smooth L1 loss: with `a = |d|` and `m = min(a, beta)`,
    /// `0.5 m^2 / beta + (a - m)`, which is `0.5 a^2 / beta` below `beta` and `a - 0.5 beta`
    /// above it, with no select and the right gradient on both sides.
    fn smooth_l1(&self, op: &'static str, target: &Var, beta: f64) -> Result<Var> {
        same_shape(op, self, target)?;
        if !(beta >= 0.0) {
            return Err(invalid(op, format!("beta must be >= 0, got {beta}")));
        }
        let a = self.sub(target)?.abs()?;
        if beta == 0.0 {
            return Ok(a);
        }
        let m = a.clamp(f64::NEG_INFINITY, beta)?;
        m.sqr()?.mul_scalar(0.5 / beta)?.add(&a.sub(&m)?)
    }

    /// `F.binary_cross_entropy_with_logits`: logits `x`, targets `y` in `[0, 1]`, by the mean.
    pub fn binary_cross_entropy_with_logits(&self, target: &Var) -> Result<Var> {
        self.binary_cross_entropy_with_logits_with(target, Reduction::Mean)
    }

    /// The elementwise `-(y ln sigmoid(x) + (1 - y) ln(1 - sigmoid(x)))` in its stable form
    /// `max(x, 0) - x y + ln(1 + e^-|x|)` (no overflow for any finite logit), reduced. One
    /// op, so that the gradient is exactly `sigmoid(x) - y` for the logits (also at `x = 0`,
    /// where the form's `max` and `|x|` have kinks) and `-x` for the targets.
    pub fn binary_cross_entropy_with_logits_with(&self, target: &Var, reduction: Reduction) -> Result<Var> {
        same_shape("binary_cross_entropy_with_logits", self, target)?;
        let (x, y) = (self.value(), target.value());
        let soft = x.abs()?.neg()?.exp()?.add_scalar(1.0)?.ln()?;
        let loss = x.relu()?.sub(&x.mul(&y)?)?.add(&soft)?;
        let elementwise = Var::from_op("binary_cross_entropy_with_logits", loss, &[self, target], move |g| {
            // sigmoid(x) = 1 / (1 + e^-x): e^-x overflows to inf for very negative x, giving 0
            let sigmoid = x.neg()?.exp()?.add_scalar(1.0)?.powf(-1.0)?;
            Ok(vec![Some(g.mul(&sigmoid.sub(&y)?)?), Some(g.mul(&x)?.neg()?)])
        });
        reduction.apply(elementwise)
    }
}

fn invalid(op: &'static str, msg: String) -> crate::AutogradError {
    TensorError::Invalid { op, msg }.into()
}
