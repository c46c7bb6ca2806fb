//! Matrix products through the `gemm` crate (packed, SIMD, arbitrary strides: transposed
//! views cost nothing).

use rayon::prelude::*;

use crate::layout::broadcast_shape;
use crate::threads::{compute_threads, install};
use crate::{Float, Layout, Result, Tensor, TensorError};

/// Pointers into storages that the batch loop shares between threads; each output
/// matrix is written by exactly one task, inputs are only read.
#[derive(Clone, Copy)]
struct SendPtr<T>(*const T);
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}

/// How many threads one GEMM of this size should use: small products are not worth
/// the fork.
pub fn gemm_threads_for(m: usize, n: usize, k: usize) -> usize {
    let t = compute_threads();
    if t > 1 && m * n * k >= 64 * 64 * 64 {
        t
    } else {
        1
    }
}

/// One `[m,k] x [k,n]` product into a contiguous `[m,n]` output.
///
/// # Safety
/// `lhs`/`rhs` must address every element their shapes and strides name; `dst` must hold
/// `m*n` writable elements that nothing else touches meanwhile.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_one<T: Float>(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut T,
    lhs: *const T,
    lhs_rs: usize,
    lhs_cs: usize,
    rhs: *const T,
    rhs_rs: usize,
    rhs_cs: usize,
    threads: usize,
) {
    if k == 0 {
        std::ptr::write_bytes(dst, 0, m * n);
        return;
    }
    let par = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    gemm::gemm(
        m,
        n,
        k,
        dst,
        1,
        n as isize,
        false,
        lhs,
        lhs_cs as isize,
        lhs_rs as isize,
        rhs,
        rhs_cs as isize,
        rhs_rs as isize,
        T::ZERO,
        T::ONE,
        false,
        false,
        false,
        par,
    );
}

fn matmul_impl<T: Float>(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let op = "matmul";
    if a.dtype() != b.dtype() {
        return Err(TensorError::DTypeMismatch {
            op,
            lhs: a.dtype(),
            rhs: b.dtype(),
        });
    }
    if a.rank() < 2 || b.rank() < 2 {
        return Err(TensorError::Invalid {
            op,
            msg: format!("needs rank >= 2 operands, got {:?} x {:?}", a.shape(), b.shape()),
        });
    }
    let (ra, rb) = (a.rank(), b.rank());
    let (m, k) = (a.shape()[ra - 2], a.shape()[ra - 1]);
    let (k2, n) = (b.shape()[rb - 2], b.shape()[rb - 1]);
    if k != k2 {
        return Err(TensorError::ShapeMismatch {
            op,
            lhs: a.shape().to_vec(),
            rhs: b.shape().to_vec(),
        });
    }
    // A batched lhs times a plain matrix: fold the batch into the rows, one big GEMM.
    if rb == 2 && ra > 2 {
        let rows: usize = a.shape()[..ra - 1].iter().product();
        let a2 = a.reshape(&[rows, k])?;
        let out = matmul_impl::<T>(&a2, b)?;
        let mut shape = a.shape()[..ra - 1].to_vec();
        shape.push(n);
        return out.reshape(&shape);
    }
    let batch = broadcast_shape(op, &a.shape()[..ra - 2], &b.shape()[..rb - 2])?;
    let nb: usize = batch.iter().product();
    let mut full_a = batch.clone();
    full_a.extend([m, k]);
    let mut full_b = batch.clone();
    full_b.extend([k, n]);
    let la = a.layout().broadcast_to(&full_a)?;
    let lb = b.layout().broadcast_to(&full_b)?;
    let mut out_shape = batch.clone();
    out_shape.extend([m, n]);
    let mut out = vec![T::ZERO; nb * m * n];
    if m * n == 0 {
        return Tensor::from_vec(out, &out_shape);
    }
    // Offset of batch `i` in a layout whose last two dims are the matrix.
    let batch_offset = |l: &Layout, mut i: usize| {
        let r = l.rank();
        let mut o = l.offset();
        for d in (0..r - 2).rev() {
            o += (i % l.shape()[d]) * l.strides()[d];
            i /= l.shape()[d];
        }
        o
    };
    let (sa, sb) = (la.strides(), lb.strides());
    let (a_rs, a_cs, b_rs, b_cs) = (sa[sa.len() - 2], sa[sa.len() - 1], sb[sb.len() - 2], sb[sb.len() - 1]);
    a.with_storage(op, |da: &[T], _| {
        b.with_storage(op, |db: &[T], _| {
            let (pa, pb) = (SendPtr(da.as_ptr()), SendPtr(db.as_ptr()));
            let threads = compute_threads();
            let run = |i: usize, dst: &mut [T], t: usize| {
                let (oa, ob) = (batch_offset(&la, i), batch_offset(&lb, i));
                // SAFETY: the layouts were checked against the storages (with_storage) and
                // `dst` is this batch's own m*n output block.
                unsafe {
                    let (pa, pb) = (pa, pb);
                    gemm_one::<T>(
                        m,
                        n,
                        k,
                        dst.as_mut_ptr(),
                        pa.0.add(oa),
                        a_rs,
                        a_cs,
                        pb.0.add(ob),
                        b_rs,
                        b_cs,
                        t,
                    )
                }
            };
            if nb >= threads && threads > 1 {
                install(|| {
                    out.par_chunks_mut(m * n)
                        .enumerate()
                        .for_each(|(i, dst)| run(i, dst, 1))
                });
            } else {
                let t = gemm_threads_for(m, n, k);
                for (i, dst) in out.chunks_mut(m * n).enumerate() {
                    install(|| run(i, dst, t));
                }
            }
        })
    })??;
    Tensor::from_vec(out, &out_shape)
}

impl Tensor {
    /// Matrix product over the last two dims, batch dims broadcast:
    /// `[.., m, k] x [.., k, n] -> [.., m, n]`.
    pub fn matmul(&self, rhs: &Tensor) -> Result<Tensor> {
        float_dispatch!("matmul", self.dtype(), T => matmul_impl::<T>(self, rhs))
    }
}

#[cfg(test)]
mod tests {
    use crate::{DType, Rng, Tensor};

    fn naive(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
            }
        }
        c
    }

    #[test]
    fn matches_the_definition_on_plain_transposed_and_batched_operands() {
        let mut rng = Rng::new(1);
        let a = Tensor::randn(&[2, 5, 3], 1.0, DType::F64, &mut rng);
        let b = Tensor::randn(&[4, 3], 1.0, DType::F64, &mut rng);
        let (av, bv) = (a.to_vec::<f64>().unwrap(), b.to_vec::<f64>().unwrap());
        // b is [4,3]; b.t() is the [3,4] view: bt[p][j] = b[j][p]
        let bt: Vec<f64> = (0..3)
            .flat_map(|p| (0..4).map(move |j| (p, j)))
            .map(|(p, j)| bv[j * 3 + p])
            .collect();
        let c = a.matmul(&b.t().unwrap()).unwrap();
        assert_eq!(c.shape(), &[2, 5, 4]);
        let got = c.to_vec::<f64>().unwrap();
        for bi in 0..2 {
            let want = naive(&av[bi * 15..(bi + 1) * 15], &bt, 5, 3, 4);
            for (g, w) in got[bi * 20..(bi + 1) * 20].iter().zip(&want) {
                assert!((g - w).abs() < 1e-12);
            }
        }
        // batch x batch, with a transposed lhs view
        let x = Tensor::randn(&[3, 4, 6], 1.0, DType::F64, &mut rng);
        let y = Tensor::randn(&[3, 4, 2], 1.0, DType::F64, &mut rng);
        let z = x.transpose(1, 2).unwrap().matmul(&y).unwrap();
        assert_eq!(z.shape(), &[3, 6, 2]);
        let (xv, yv, zv) = (
            x.to_vec::<f64>().unwrap(),
            y.to_vec::<f64>().unwrap(),
            z.to_vec::<f64>().unwrap(),
        );
        for bi in 0..3 {
            for i in 0..6 {
                for j in 0..2 {
                    let w: f64 = (0..4).map(|p| xv[bi * 24 + p * 6 + i] * yv[bi * 8 + p * 2 + j]).sum();
                    assert!((zv[bi * 12 + i * 2 + j] - w).abs() < 1e-12);
                }
            }
        }
    }

    #[test]
    fn inner_dimension_mismatch_is_an_error() {
        let a = Tensor::zeros(&[2, 3], DType::F32);
        let b = Tensor::zeros(&[4, 2], DType::F32);
        assert!(a.matmul(&b).is_err());
    }
}
