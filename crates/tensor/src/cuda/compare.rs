//! The GEMM benchmark's output comparison and timing record: pure, so it is built and tested
//! without CUDA.

/// How two outputs of the same computation compare, element by element.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OutputComparison {
    /// Elements compared (the longer length when the lengths differ).
    pub elements: usize,
    /// Elements outside the tolerance (every element when the lengths differ; a NaN on either
    /// side always counts).
    pub mismatches: usize,
    /// The element with the largest difference (NaN counts as largest).
    pub worst_index: usize,
    /// Its absolute difference.
    pub worst_abs_diff: f64,
    /// The tolerance of an element `w` of the reference: `rel_tol * max(|w|, rms(reference))`.
    pub rel_tol: f64,
}

impl OutputComparison {
    /// True when no element is outside the tolerance.
    pub fn passed(&self) -> bool {
        self.mismatches == 0
    }
}

/// Compares `got` with the reference `want` element by element: an element passes when
/// `|got - want| <= rel_tol * max(|want|, rms(want))` (the root mean square keeps elements
/// near zero from demanding an absolute zero difference). One wrong element fails it.
pub fn compare_outputs(got: &[f64], want: &[f64], rel_tol: f64) -> OutputComparison {
    let n = got.len().max(want.len());
    if got.len() != want.len() {
        return OutputComparison {
            elements: n,
            mismatches: n,
            worst_index: got.len().min(want.len()),
            worst_abs_diff: f64::INFINITY,
            rel_tol,
        };
    }
    let rms = (want.iter().map(|w| w * w).sum::<f64>() / n.max(1) as f64).sqrt();
    let mut c = OutputComparison {
        elements: n,
        mismatches: 0,
        worst_index: 0,
        worst_abs_diff: 0.0,
        rel_tol,
    };
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let d = (g - w).abs();
        let bad = d.is_nan() || d > rel_tol * w.abs().max(rms);
        if bad {
            c.mismatches += 1;
        }
        // the first NaN stays the worst
        if (d.is_nan() || d > c.worst_abs_diff) && !c.worst_abs_diff.is_nan() {
            c.worst_index = i;
            c.worst_abs_diff = d;
        }
    }
    c
}

/// Seconds per call of one GEMM, Brigade's and cuBLAS's (medians of the same repetitions),
/// and how their outputs compare.
#[derive(Debug, Clone, Copy)]
pub struct GemmTiming {
    /// Brigade's matmul (the view → cuBLAS plan, then cuBLAS).
    pub brigade_s: f64,
    /// `cublas{S,H,Bf16}gemm` called directly on row-major buffers.
    pub cublas_s: f64,
    /// Brigade's output against cuBLAS's, element by element.
    pub outputs: OutputComparison,
}

#[cfg(test)]
mod tests {
    use super::compare_outputs;

    #[test]
    fn one_wrong_element_fails_the_comparison_and_is_named() {
        let want: Vec<f64> = (0..1000).map(|i| ((i * 7919) % 1000) as f64 / 100.0 - 5.0).collect();
        let mut got = want.clone();
        assert!(compare_outputs(&got, &want, 1e-5).passed());
        // rounding-sized differences pass
        got.iter_mut().for_each(|g| *g *= 1.0 + 1e-7);
        assert!(compare_outputs(&got, &want, 1e-5).passed());
        got[417] += 0.01;
        let c = compare_outputs(&got, &want, 1e-5);
        assert!(!c.passed());
        assert_eq!((c.mismatches, c.worst_index), (1, 417));
        got[417] = f64::NAN;
        let c = compare_outputs(&got, &want, 1e-5);
        assert_eq!((c.mismatches, c.worst_index), (1, 417));
        assert!(c.worst_abs_diff.is_nan());
        // a short output fails entirely
        assert_eq!(compare_outputs(&want[..999], &want, 1e-5).mismatches, 1000);
    }
}
