//! Finite-difference gradient checking in f64.

use brigade_tensor::{DType, Rng, Tensor};

use crate::{AutogradError, Result, Var};

/// The worst disagreement found by [`gradcheck`].
#[derive(Debug, Clone)]
pub struct GradcheckReport {
    /// Which input, which element, analytic and numeric values.
    pub worst: Option<(usize, usize, f64, f64)>,
    /// Largest `|analytic - numeric| / max(1, |numeric|)`; infinite when some analytic or
    /// numeric value is NaN or infinite.
    pub max_error: f64,
}

/// `|analytic - numeric| / max(1, |numeric|)`, and infinity when either value or the result
/// is not finite: a NaN must fail a check, never vanish in a `max`.
pub(crate) fn relative_error(analytic: f64, numeric: f64) -> f64 {
    let err = (analytic - numeric).abs() / numeric.abs().max(1.0);
    if err.is_finite() && analytic.is_finite() && numeric.is_finite() {
        err
    } else {
        f64::INFINITY
    }
}

/// Compares the gradients that backward computes for `f` at `inputs` (f64 tensors, may
/// be non-contiguous views) with central finite differences `(L(x+h) - L(x-h)) / 2h`,
/// where `L = sum(f(x) * R)` for a fixed random `R` (so non-scalar outputs are checked
/// in every direction at once). Returns an error naming the worst element when the
/// relative error exceeds `tol`.
pub fn gradcheck(f: impl Fn(&[Var]) -> Result<Var>, inputs: &[Tensor], h: f64, tol: f64) -> Result<GradcheckReport> {
    for t in inputs {
        if t.dtype() != DType::F64 {
            return Err(AutogradError::Invalid(format!(
                "gradcheck needs f64 inputs, got {:?}",
                t.dtype()
            )));
        }
    }
    let vars: Vec<Var> = inputs.iter().map(|t| Var::leaf(t.clone())).collect();
    let out = f(&vars)?;
    let mut rng = Rng::new(0x5eed);
    let r = Tensor::randn(out.value().shape(), 1.0, DType::F64, &mut rng);
    let loss = |o: &Var| -> Result<f64> { Ok(o.value().mul(&r)?.sum_all()?.item()?) };
    let rv = Var::constant(r.clone());
    out.mul(&rv)?.sum_all()?.backward()?;
    let mut report = GradcheckReport {
        worst: None,
        max_error: 0.0,
    };
    for (i, x) in inputs.iter().enumerate() {
        let analytic = match vars[i].grad() {
            Some(g) => g.to_vec::<f64>()?,
            None => vec![0.0; x.numel()],
        };
        let base = x.to_vec::<f64>()?;
        for j in 0..base.len() {
            let eval = |delta: f64| -> Result<f64> {
                let mut v = base.clone();
                v[j] += delta;
                let xs: Vec<Var> = inputs
                    .iter()
                    .enumerate()
                    .map(|(k, t)| {
                        if k == i {
                            Ok(Var::constant(Tensor::from_vec(v.clone(), t.shape())?))
                        } else {
                            Ok(Var::constant(t.clone()))
                        }
                    })
                    .collect::<Result<_>>()?;
                crate::no_grad(|| loss(&f(&xs)?))
            };
            let numeric = (eval(h)? - eval(-h)?) / (2.0 * h);
            let err = relative_error(analytic[j], numeric);
            if report.worst.is_none() || err > report.max_error {
                report.max_error = err;
                report.worst = Some((i, j, analytic[j], numeric));
            }
        }
    }
    if report.max_error > tol {
        let (i, j, a, n) = report.worst.unwrap_or_default();
        return Err(AutogradError::Invalid(format!(
            "gradcheck failed: input {i} element {j}: analytic {a:.9e} vs numeric {n:.9e} (relative error {:.3e} > {tol:.1e})",
            report.max_error
        )));
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::relative_error;

    #[test]
    fn non_finite_values_are_an_infinite_error() {
        assert_eq!(relative_error(3.0, 1.0), 2.0);
        assert_eq!(relative_error(0.5, 0.25), 0.25);
        for (a, n) in [
            (f64::NAN, 1.0),
            (1.0, f64::NAN),
            (f64::INFINITY, 1.0),
            (1.0, f64::NEG_INFINITY),
            (f64::INFINITY, f64::INFINITY),
        ] {
            assert_eq!(relative_error(a, n), f64::INFINITY, "analytic {a}, numeric {n}");
        }
    }
}
