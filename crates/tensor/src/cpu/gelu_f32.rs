//! GELU and its derivative for f32 without a library call per element: `erf` and `exp`
//! as branch-free polynomials, so that the loops over a tensor vectorize (the scalar
//! `libm::erff` and `expf` calls made GELU an eighth of a GPT step). f64 keeps the
//! library functions: it is the dtype of the gradient checks.

/// `1/sqrt(2*pi)`.
const INV_SQRT_2PI: f32 = 0.398_942_3;

/// `erf(x)`: Eigen's rational approximation on `[-4, 4]` (outside, erf is ±1 in f32);
/// largest error against the exact erf 4.5e-7 (a few ulp near ±1).
/// The constants are Eigen's, digit for digit, though f32 cannot hold every digit.
#[inline(always)]
#[allow(clippy::excessive_precision)]
pub(super) fn erf(x: f32) -> f32 {
    let x = x.clamp(-4.0, 4.0);
    let x2 = x * x;
    let mut p = x2 * -2.726_142_3e-10 + 2.770_681_4e-8;
    p = x2 * p + -2.101_024e-6;
    p = x2 * p + -5.692_506_4e-5;
    p = x2 * p + -7.349_906_3e-4;
    p = x2 * p + -2.954_600e-3;
    p = x2 * p + -1.609_603_3e-2;
    let mut q = x2 * -1.456_607_2e-5 + -2.133_740_6e-4;
    q = x2 * q + -1.682_827e-3;
    q = x2 * q + -7.373_329e-3;
    q = x2 * q + -1.426_474e-2;
    x * p / q
}

/// `e^a` for `a <= 0` (Cephes' `expf` reduction and polynomial); below -87 it returns
/// `e^-87` (1.6e-38) instead of a denormal or zero. Relative error below 2e-7. The constants
/// are Cephes', digit for digit.
#[inline(always)]
#[allow(clippy::excessive_precision)]
pub(super) fn exp_nonpositive(a: f32) -> f32 {
    // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer
    const ROUND: f32 = 12_582_912.0;
    let a = if a < -87.0 { -87.0 } else { a };
    let t = a * std::f32::consts::LOG2_E + ROUND;
    let n = t - ROUND;
    let r = a - n * 0.693_359_4 - n * -2.121_944_4e-4;
    let mut p = 1.987_569_1e-4;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 5.000_000_1e-1;
    let y = p * (r * r) + r + 1.0;
    // the integer n sits in the low mantissa bits of t: 2^n without a float-to-int cast
    let n_int = t.to_bits().wrapping_sub(ROUND.to_bits());
    y * f32::from_bits(n_int.wrapping_add(127) << 23)
}

/// `0.5 * x * (1 + erf(x / sqrt 2))`.
#[inline(always)]
pub(super) fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + erf(x * std::f32::consts::FRAC_1_SQRT_2))
}

/// `gelu'(x) = cdf + x * pdf`.
#[inline(always)]
pub(super) fn gelu_grad(x: f32) -> f32 {
    let cdf = 0.5 * (1.0 + erf(x * std::f32::consts::FRAC_1_SQRT_2));
    let pdf = INV_SQRT_2PI * exp_nonpositive(-(x * x) * 0.5);
    cdf + x * pdf
}

/// `out[i] = gelu(x[i])`, sixteen lanes at a time where the CPU has AVX-512F, eight where
/// it has AVX2 (the same bits as one at a time: no fused multiply-add, every operation
/// rounded as written).
pub(super) fn gelu_slice(x: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F, checked just above.
            return unsafe { gelu_slice_avx512(x, out) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2, checked just above.
            return unsafe { gelu_slice_avx2(x, out) };
        }
    }
    gelu_slice_any(x, out)
}

/// `out[i] = g[i] * gelu'(x[i])`, as [`gelu_slice`].
pub(super) fn gelu_backward_slice(x: &[f32], g: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F, checked just above.
            return unsafe { gelu_backward_slice_avx512(x, g, out) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2, checked just above.
            return unsafe { gelu_backward_slice_avx2(x, g, out) };
        }
    }
    gelu_backward_slice_any(x, g, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn gelu_slice_avx512(x: &[f32], out: &mut [f32]) {
    gelu_slice_any(x, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn gelu_backward_slice_avx512(x: &[f32], g: &[f32], out: &mut [f32]) {
    gelu_backward_slice_any(x, g, out)
}

#[inline(always)]
fn gelu_slice_any(x: &[f32], out: &mut [f32]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = gelu(v);
    }
}

#[inline(always)]
fn gelu_backward_slice_any(x: &[f32], g: &[f32], out: &mut [f32]) {
    for ((o, &v), &gv) in out.iter_mut().zip(x).zip(g) {
        *o = gv * gelu_grad(v);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn gelu_slice_avx2(x: &[f32], out: &mut [f32]) {
    gelu_slice_any(x, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn gelu_backward_slice_avx2(x: &[f32], g: &[f32], out: &mut [f32]) {
    gelu_backward_slice_any(x, g, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every 1e-4 over [-6, 6] (and the exponent's range for exp).
    fn grid(lo: f32, hi: f32) -> impl Iterator<Item = f32> {
        let n = ((hi - lo) / 1e-4) as usize;
        (0..=n).map(move |i| lo + i as f32 * 1e-4)
    }

    #[test]
    fn erf_and_exp_are_within_a_few_ulp_of_the_library() {
        let worst_erf = grid(-6.0, 6.0)
            .map(|x| (erf(x) as f64 - libm::erf(x as f64)).abs())
            .fold(0.0, f64::max);
        assert!(worst_erf < 5e-7, "erf: {worst_erf:e}");
        let worst_exp = grid(-87.0, 0.0)
            .map(|a| {
                let want = (a as f64).exp();
                (exp_nonpositive(a) as f64 - want).abs() / want
            })
            .fold(0.0, f64::max);
        assert!(worst_exp < 3e-7, "exp: {worst_exp:e}");
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert!(exp_nonpositive(-1e4) > 0.0 && exp_nonpositive(-1e4) < 2e-38);
        assert!(erf(f32::NAN).is_nan() && gelu(f32::NAN).is_nan() && gelu_grad(f32::NAN).is_nan());
    }

    #[test]
    fn the_slice_kernels_give_the_scalar_bits() {
        let x: Vec<f32> = grid(-6.0, 6.0).collect();
        let g: Vec<f32> = x.iter().map(|v| 1.0 - v * 0.3).collect();
        let (mut y, mut dx) = (vec![0.0; x.len()], vec![0.0; x.len()]);
        gelu_slice(&x, &mut y);
        gelu_backward_slice(&x, &g, &mut dx);
        for i in 0..x.len() {
            assert_eq!(y[i].to_bits(), gelu(x[i]).to_bits(), "gelu({})", x[i]);
            assert_eq!(dx[i].to_bits(), (g[i] * gelu_grad(x[i])).to_bits(), "gelu'({})", x[i]);
        }
    }

    #[test]
    fn gelu_and_its_derivative_match_the_f64_formulas() {
        for x in grid(-6.0, 6.0) {
            let xd = x as f64;
            let want = 0.5 * xd * (1.0 + libm::erf(xd / std::f64::consts::SQRT_2));
            let cdf = 0.5 * (1.0 + libm::erf(xd / std::f64::consts::SQRT_2));
            let want_grad = cdf + xd * (-(xd * xd) / 2.0).exp() / (2.0 * std::f64::consts::PI).sqrt();
            assert!((gelu(x) as f64 - want).abs() < 2e-6 * xd.abs().max(1.0), "gelu({x})");
            assert!((gelu_grad(x) as f64 - want_grad).abs() < 2e-6, "gelu'({x})");
        }
    }
}
