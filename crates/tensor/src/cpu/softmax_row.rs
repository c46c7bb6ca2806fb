//! The softmax of one row, shared by `softmax_last` and the fused attention so that the
//! two attention paths keep giving the same bits. In f32 the exponentials are the
//! branch-free polynomial of [`super::gelu_f32`] and the max and the sum run in
//! [`LANES`] interleaved lanes, so the row vectorizes (the scalar `expf` call per score
//! was most of the attention forward); f64, the dtype of the gradient checks, keeps the
//! library `exp` and one running sum.

use super::gelu_f32::exp_nonpositive;
use crate::{DType, Float};

/// Interleaved partial maxima and sums: two AVX2 registers of f32.
const LANES: usize = 16;

/// Replaces `row` by its softmax: `m = max`, `e = exp(x - m)`, `s = sum e`, `e * (1 / s)`,
/// and returns `(m, s)` (the row's log-sum-exp is `ln s + m`).
/// A `-inf` score gets exactly 0, so a row of scores followed by masked `-inf` ones gives,
/// on its unmasked prefix, the bits of the prefix alone (f32: element `j` always adds into
/// lane `j % LANES`, and the masked ones add zeros).
pub(super) fn softmax_in_place<T: Float>(row: &mut [T]) -> (T, T) {
    if T::DTYPE == DType::F32 {
        // SAFETY: `T` is `f32` (the dtype says so), so the slice is a `[f32]`.
        let row = unsafe { &mut *(row as *mut [T] as *mut [f32]) };
        let (m, s) = softmax_f32(row);
        return (T::from_f64(f64::from(m)), T::from_f64(f64::from(s)));
    }
    let m = row
        .iter()
        .copied()
        .fold(T::NEG_INFINITY, |a, b| if b > a { b } else { a });
    let mut sum = T::ZERO;
    for v in row.iter_mut() {
        *v = (*v - m).exp();
        sum += *v;
    }
    let inv = T::ONE / sum;
    for v in row.iter_mut() {
        *v *= inv;
    }
    (m, sum)
}

/// `e^a` for `a <= 0`, and exactly 0 below -87 (where [`exp_nonpositive`] stops at
/// `e^-87`), so that `-inf` (a masked score) contributes nothing.
#[inline(always)]
fn exp_softmax(a: f32) -> f32 {
    let e = exp_nonpositive(a);
    if a < -87.0 {
        0.0
    } else {
        e
    }
}

fn softmax_f32(row: &mut [f32]) -> (f32, f32) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, checked just above.
        return unsafe { softmax_f32_avx2(row) };
    }
    softmax_f32_any(row)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn softmax_f32_avx2(row: &mut [f32]) -> (f32, f32) {
    softmax_f32_any(row)
}

#[inline(always)]
fn softmax_f32_any(row: &mut [f32]) -> (f32, f32) {
    let mut mx = [f32::NEG_INFINITY; LANES];
    for (j, &v) in row.iter().enumerate() {
        let l = j % LANES;
        mx[l] = if v > mx[l] { v } else { mx[l] };
    }
    let m = mx
        .iter()
        .copied()
        .fold(f32::NEG_INFINITY, |a, b| if b > a { b } else { a });
    let mut acc = [0.0f32; LANES];
    let mut chunks = row.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for l in 0..LANES {
            let e = exp_softmax(c[l] - m);
            c[l] = e;
            acc[l] += e;
        }
    }
    for (l, v) in chunks.into_remainder().iter_mut().enumerate() {
        let e = exp_softmax(*v - m);
        *v = e;
        acc[l] += e;
    }
    let mut sum = 0.0f32;
    for a in acc {
        sum += a;
    }
    let inv = 1.0 / sum;
    for v in row.iter_mut() {
        *v *= inv;
    }
    (m, sum)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scores(n: usize) -> Vec<f32> {
        (0..n).map(|j| ((j * 37 % 101) as f32 - 50.0) * 0.173).collect()
    }

    #[test]
    fn f32_rows_match_the_f64_softmax() {
        for n in [1, 5, 16, 37, 128] {
            let x = scores(n);
            let mut y = x.clone();
            softmax_in_place(&mut y);
            let m = x.iter().copied().fold(f64::NEG_INFINITY, |a, b| a.max(b as f64));
            let s: f64 = x.iter().map(|&v| (v as f64 - m).exp()).sum();
            for (j, (&v, &got)) in x.iter().zip(&y).enumerate() {
                let want = (v as f64 - m).exp() / s;
                assert!(
                    (got as f64 - want).abs() <= 1e-6 * want.max(1e-30) + 1e-38,
                    "n {n}, j {j}: {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn masked_scores_change_no_bit_of_the_prefix() {
        let x = scores(45);
        for i in [0, 15, 16, 30, 44] {
            let mut prefix = x[..=i].to_vec();
            softmax_in_place(&mut prefix);
            let mut masked = x.clone();
            masked[i + 1..].fill(f32::NEG_INFINITY);
            softmax_in_place(&mut masked);
            for j in 0..=i {
                assert_eq!(prefix[j].to_bits(), masked[j].to_bits(), "row {i}, key {j}");
            }
            assert!(masked[i + 1..].iter().all(|&v| v == 0.0));
        }
    }
}
