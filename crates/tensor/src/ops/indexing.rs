//! Sorting and moving elements by integer index: `sort`, `argsort` and `topk` along the last
//! dim; `gather`, `scatter_add` and `index_add` along any dim. Indices are `I64` tensors (`U8`
//! is taken too); an index outside its dim is one `OutOfRange` error naming it, checked here
//! before any kernel runs.

use super::nn::check_indices;
use super::{compute_dtype, same_device, same_dtype};
use crate::storage::dispatch;
use crate::{Result, Tensor, TensorError};

/// The size of the last dim (the sorted one).
fn last_dim(op: &'static str, x: &Tensor) -> Result<usize> {
    x.shape().last().copied().ok_or(TensorError::Invalid {
        op,
        msg: "needs rank >= 1 (it works along the last dim)".into(),
    })
}

/// `(values, indices)` of each last-dim row sorted, cut to its first `k`.
fn sort_impl(op: &'static str, x: &Tensor, descending: bool, k: usize) -> Result<(Tensor, Tensor)> {
    compute_dtype(op, x)?;
    let n = last_dim(op, x)?;
    if k > n {
        return Err(TensorError::OutOfRange {
            op,
            msg: format!("k = {k} is larger than the last dim ({n}) of shape {:?}", x.shape()),
        });
    }
    let x = x.contiguous_for(op)?;
    let (v, i) = dispatch!(&*x.storage(op)?, s => s.sort_last(x.layout(), descending, k))?;
    let mut shape = x.shape().to_vec();
    *shape.last_mut().expect("rank >= 1") = k;
    Ok((Tensor::from_storage(v, &shape), Tensor::from_storage(i, &shape)))
}

/// An index tensor fits `x` along `dim`: same rank, no larger in any other dim, `dim < rank`.
fn check_index_shape(op: &'static str, x: &Tensor, dim: usize, ids: &Tensor) -> Result<()> {
    if dim >= x.rank() {
        return Err(TensorError::DimOutOfRange {
            op,
            dim,
            rank: x.rank(),
        });
    }
    let fits = ids.rank() == x.rank() && (0..x.rank()).all(|d| d == dim || ids.shape()[d] <= x.shape()[d]);
    if fits {
        Ok(())
    } else {
        Err(TensorError::Invalid {
            op,
            msg: format!(
                "the index {:?} must have the rank of the tensor {:?} and be no larger in any dim but {dim}",
                ids.shape(),
                x.shape()
            ),
        })
    }
}

impl Tensor {
    /// The `k` largest elements of each row of the last dim, largest first, and their `I64`
    /// positions in the row: `([.., k], [.., k])`, as `torch.topk(x, k)`. Equal values come
    /// lowest position first; NaN counts as larger than every number (so NaNs come first),
    /// `-0.0` as equal to `0.0`. `k` larger than the last dim is an `OutOfRange` error.
    pub fn topk(&self, k: usize) -> Result<(Tensor, Tensor)> {
        sort_impl("topk", self, true, k)
    }

    /// Each row of the last dim sorted, and the `I64` positions the values came from:
    /// ascending (NaNs last) or `descending` (NaNs first), stable in both directions (equal
    /// values, NaNs among them, keep their order: lower position first). `-0.0` and `0.0`
    /// are equal.
    pub fn sort(&self, descending: bool) -> Result<(Tensor, Tensor)> {
        let n = last_dim("sort", self)?;
        sort_impl("sort", self, descending, n)
    }

    /// The `I64` positions that sort each row of the last dim: the indices of
    /// [`Tensor::sort`], same order rules.
    pub fn argsort(&self, descending: bool) -> Result<Tensor> {
        let n = last_dim("argsort", self)?;
        Ok(sort_impl("argsort", self, descending, n)?.1)
    }

    /// Elements picked along `dim` by an `I64` index of the output's shape:
    /// `out[i][j] = self[ids[i][j]][j]` for `dim = 0`, `self[i][ids[i][j]]` for `dim = 1`
    /// (`torch.gather`). The index has this tensor's rank and is no larger in other dims;
    /// an index value outside `0..self.shape()[dim]` is an `OutOfRange` error.
    pub fn gather(&self, dim: usize, ids: &Tensor) -> Result<Tensor> {
        let op = "gather";
        check_index_shape(op, self, dim, ids)?;
        check_indices(op, ids, self.shape()[dim])?;
        gather_checked(op, self, dim, ids)
    }

    /// A copy of this tensor with `src` added at the positions an `I64` index of `src`'s
    /// shape names along `dim`: `out[ids[i][j]][j] += src[i][j]` for `dim = 0`
    /// (`torch.scatter_add`); repeated positions add up in the index's row-major order, on
    /// every device (deterministic: the same bits on every run). The index has this tensor's
    /// rank and is no larger in other dims; an index value outside `0..self.shape()[dim]` is
    /// an `OutOfRange` error.
    pub fn scatter_add(&self, dim: usize, ids: &Tensor, src: &Tensor) -> Result<Tensor> {
        let op = "scatter_add";
        check_index_shape(op, self, dim, ids)?;
        check_indices(op, ids, self.shape().get(dim).copied().unwrap_or(0))?;
        scatter_add_checked(op, self, dim, ids, src)
    }

    /// A copy of this tensor with slice `i` of `src` along `dim` added to slice `ids[i]`
    /// (`torch.index_add`): `ids` is a 1-d `I64` index of `n` positions, `src` this tensor's
    /// shape with `n` at `dim`; repeated positions add up. An index value outside
    /// `0..self.shape()[dim]` is an `OutOfRange` error.
    pub fn index_add(&self, dim: usize, ids: &Tensor, src: &Tensor) -> Result<Tensor> {
        let op = "index_add";
        if dim >= self.rank() {
            return Err(TensorError::DimOutOfRange {
                op,
                dim,
                rank: self.rank(),
            });
        }
        let n = match ids.shape() {
            [n] => *n,
            s => {
                return Err(TensorError::Invalid {
                    op,
                    msg: format!("the index must be 1-d, got shape {s:?}"),
                })
            }
        };
        let mut want = self.shape().to_vec();
        want[dim] = n;
        if src.shape() != want {
            return Err(TensorError::ShapeMismatch {
                op,
                lhs: want,
                rhs: src.shape().to_vec(),
            });
        }
        check_indices(op, ids, self.shape()[dim])?;
        scatter_add_checked(op, self, dim, &spread_index(ids, dim, &want)?, src)
    }

    /// `self.index_select(dim, ids)` (`torch.index_select`): the slices `ids[i]` along `dim`,
    /// `ids` a 1-d `I64` index. The gradient of [`Tensor::index_add`]'s `src`.
    pub fn index_select(&self, dim: usize, ids: &Tensor) -> Result<Tensor> {
        let op = "index_select";
        if dim >= self.rank() {
            return Err(TensorError::DimOutOfRange {
                op,
                dim,
                rank: self.rank(),
            });
        }
        let [n] = ids.shape() else {
            return Err(TensorError::Invalid {
                op,
                msg: format!("the index must be 1-d, got shape {:?}", ids.shape()),
            });
        };
        let mut shape = self.shape().to_vec();
        shape[dim] = *n;
        check_indices(op, ids, self.shape()[dim])?;
        gather_checked(op, self, dim, &spread_index(ids, dim, &shape)?)
    }
}

/// [`Tensor::gather`] once the index's shape and values have been checked.
fn gather_checked(op: &'static str, x: &Tensor, dim: usize, ids: &Tensor) -> Result<Tensor> {
    compute_dtype(op, x)?;
    same_device(op, x, ids)?;
    let xc = x.contiguous_for(op)?;
    let out = dispatch!(&*xc.storage(op)?, s, other => s.gather(xc.layout(), dim, (other(&*ids.storage(op)?)?, ids.layout())))?;
    Ok(Tensor::from_storage(out, ids.shape()))
}

/// [`Tensor::scatter_add`] once the index's shape and values have been checked.
fn scatter_add_checked(op: &'static str, x: &Tensor, dim: usize, ids: &Tensor, src: &Tensor) -> Result<Tensor> {
    compute_dtype(op, x)?;
    same_dtype(op, x, src)?;
    same_device(op, x, src)?;
    same_device(op, x, ids)?;
    if ids.shape() != src.shape() {
        return Err(TensorError::ShapeMismatch {
            op,
            lhs: ids.shape().to_vec(),
            rhs: src.shape().to_vec(),
        });
    }
    let (xc, src) = (x.contiguous_for(op)?, src.contiguous_for(op)?);
    let out = dispatch!(&*xc.storage(op)?, s, other => s.scatter_add(
        xc.layout(),
        dim,
        (other(&*ids.storage(op)?)?, ids.layout()),
        (other(&*src.storage(op)?)?, src.layout()),
    ))?;
    Ok(Tensor::from_storage(out, x.shape()))
}

/// A 1-d index `[n]` seen as `shape` (with `n` at `dim`) through stride-0 dims: no copy.
fn spread_index(ids: &Tensor, dim: usize, shape: &[usize]) -> Result<Tensor> {
    let mut one = vec![1; shape.len()];
    one[dim] = shape[dim];
    ids.reshape(&one)?.broadcast_to(shape)
}

#[cfg(test)]
mod tests {
    use std::cmp::Ordering;

    use crate::{test_device, Device, Rng, Tensor, TensorError};

    /// `[rows, n]` values from a small set (many ties), with `-0.0`, `0.0` and NaNs among them.
    fn tied_with_nans(rows: usize, n: usize, seed: u64) -> Vec<f64> {
        let pool = [-1.5, -0.0, 0.0, 2.0, 3.25, f64::NAN, f64::INFINITY, f64::NEG_INFINITY];
        let mut rng = Rng::new(seed);
        (0..rows * n)
            .map(|_| pool[rng.below(pool.len() as u64) as usize])
            .collect()
    }

    /// The reference order, written apart from the kernel's: NaN above every number.
    fn before(a: f64, b: f64, descending: bool) -> bool {
        let o = match (a.is_nan(), b.is_nan()) {
            (true, true) => Ordering::Equal,
            (true, false) => Ordering::Greater,
            (false, true) => Ordering::Less,
            _ => a.partial_cmp(&b).unwrap(),
        };
        if descending {
            o == Ordering::Greater
        } else {
            o == Ordering::Less
        }
    }

    /// Brute force: element `i` of a row goes to the place counting the elements strictly
    /// before it plus the equal ones at lower positions (a stable sort), O(n^2).
    fn reference_sort(row: &[f64], descending: bool) -> Vec<usize> {
        let mut at = vec![0; row.len()];
        for i in 0..row.len() {
            let place = (0..row.len())
                .filter(|&j| before(row[j], row[i], descending) || (j < i && !before(row[i], row[j], descending)))
                .count();
            at[place] = i;
        }
        at
    }

    fn same_bits(a: &[f64], b: &[f64]) -> bool {
        a.len() == b.len()
            && a.iter()
                .zip(b)
                .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()))
    }

    fn sort_argsort_and_topk_match_a_brute_force_reference(d: Device) {
        let (rows, n) = (6, 11);
        let v = tied_with_nans(rows, n, 7);
        let x = Tensor::from_vec(v.clone(), &[rows, n]).unwrap().to_device(d).unwrap();
        for descending in [false, true] {
            let (vals, ids) = x.sort(descending).unwrap();
            let (vals, ids) = (vals.to_vec::<f64>().unwrap(), ids.to_vec::<i64>().unwrap());
            let args = x.argsort(descending).unwrap().to_vec::<i64>().unwrap();
            for r in 0..rows {
                let row = &v[r * n..(r + 1) * n];
                let want = reference_sort(row, descending);
                let got: Vec<usize> = ids[r * n..(r + 1) * n].iter().map(|&i| i as usize).collect();
                assert_eq!(got, want, "row {r} {row:?} descending {descending}");
                assert_eq!(&args[r * n..(r + 1) * n], &ids[r * n..(r + 1) * n]);
                let want_vals: Vec<f64> = want.iter().map(|&i| row[i]).collect();
                assert!(same_bits(&vals[r * n..(r + 1) * n], &want_vals), "row {r}");
            }
        }
        for k in [0, 1, 4, n] {
            let (vals, ids) = x.topk(k).unwrap();
            assert_eq!(vals.shape(), &[rows, k]);
            let (vals, ids) = (vals.to_vec::<f64>().unwrap(), ids.to_vec::<i64>().unwrap());
            for r in 0..rows {
                let row = &v[r * n..(r + 1) * n];
                let want = &reference_sort(row, true)[..k];
                let got: Vec<usize> = ids[r * k..(r + 1) * k].iter().map(|&i| i as usize).collect();
                assert_eq!(got, want, "topk {k} of row {r} {row:?}");
                let want_vals: Vec<f64> = want.iter().map(|&i| row[i]).collect();
                assert!(same_bits(&vals[r * k..(r + 1) * k], &want_vals));
            }
        }
        // a strided view sorts as its copy; f32 as f64
        let t = x.t().unwrap();
        assert_eq!(
            t.argsort(false).unwrap().to_vec::<i64>().unwrap(),
            t.copy().unwrap().argsort(false).unwrap().to_vec::<i64>().unwrap()
        );
        // f32 and bf16 (widened exactly) sort as f64: the pool's values are exact in both
        for dtype in [crate::DType::F32, crate::DType::BF16] {
            let xd = x.to_dtype(dtype).unwrap();
            assert_eq!(
                xd.topk(3).unwrap().1.to_vec::<i64>().unwrap(),
                x.topk(3).unwrap().1.to_vec::<i64>().unwrap()
            );
            let (v, _) = xd.sort(true).unwrap();
            assert_eq!(v.dtype(), dtype);
            let back = v.to_dtype(crate::DType::F64).unwrap().to_vec::<f64>().unwrap();
            assert!(same_bits(&back, &x.sort(true).unwrap().0.to_vec::<f64>().unwrap()));
        }
    }
    test_device!(sort_argsort_and_topk_match_a_brute_force_reference);

    /// Row-major coordinates of element `e` of `shape`.
    fn coords(mut e: usize, shape: &[usize]) -> Vec<usize> {
        let mut c = vec![0; shape.len()];
        for d in (0..shape.len()).rev() {
            c[d] = e % shape[d];
            e /= shape[d];
        }
        c
    }

    fn offset(c: &[usize], shape: &[usize]) -> usize {
        c.iter().zip(shape).fold(0, |o, (&c, &s)| o * s + c)
    }

    fn gather_scatter_add_and_index_add_match_a_brute_force_reference(d: Device) {
        let shape = [3, 4, 5];
        let mut rng = Rng::new(11);
        let xv: Vec<f64> = (0..60).map(|_| rng.normal()).collect();
        let x = Tensor::from_vec(xv.clone(), &shape).unwrap().to_device(d).unwrap();
        for dim in 0..3 {
            // the index: smaller than x in the other dims, longer along dim, repeats certain
            let mut ishape = [2, 3, 4];
            ishape[dim] = 7;
            let numel: usize = ishape.iter().product();
            let ids: Vec<i64> = (0..numel).map(|_| rng.below(shape[dim] as u64) as i64).collect();
            let src: Vec<f64> = (0..numel).map(|_| rng.normal()).collect();
            let it = Tensor::from_vec(ids.clone(), &ishape).unwrap().to_device(d).unwrap();
            let st = Tensor::from_vec(src.clone(), &ishape).unwrap().to_device(d).unwrap();
            let (mut want_g, mut want_s) = (vec![0.0; numel], xv.clone());
            for e in 0..numel {
                let mut c = coords(e, &ishape);
                c[dim] = ids[e] as usize;
                want_g[e] = xv[offset(&c, &shape)];
                want_s[offset(&c, &shape)] += src[e];
            }
            let g = x.gather(dim, &it).unwrap();
            assert_eq!(g.to_vec::<f64>().unwrap(), want_g, "gather along {dim}");
            let s = x.scatter_add(dim, &it, &st).unwrap().to_vec::<f64>().unwrap();
            assert_eq!(s, want_s, "scatter_add along {dim}");
            // bf16 adds in f32 and rounds once: within bf16's rounding of the f64 sums
            let bf = crate::DType::BF16;
            let sb = x
                .to_dtype(bf)
                .unwrap()
                .scatter_add(dim, &it, &st.to_dtype(bf).unwrap())
                .unwrap();
            let sb = sb.to_dtype(crate::DType::F64).unwrap().to_vec::<f64>().unwrap();
            for (a, b) in sb.iter().zip(&want_s) {
                assert!((a - b).abs() <= 0.02 * (1.0 + b.abs()), "bf16 scatter_add {a} vs {b}");
            }

            // index_add: slice i of src added to slice ids[i]; index_select picks them back
            let n = 6;
            let ids: Vec<i64> = (0..n).map(|_| rng.below(shape[dim] as u64) as i64).collect();
            let mut sshape = shape;
            sshape[dim] = n;
            let sn: usize = sshape.iter().product();
            let src: Vec<f64> = (0..sn).map(|_| rng.normal()).collect();
            let (mut want_a, mut want_sel) = (xv.clone(), vec![0.0; sn]);
            for e in 0..sn {
                let mut c = coords(e, &sshape);
                c[dim] = ids[c[dim]] as usize;
                want_a[offset(&c, &shape)] += src[e];
                want_sel[e] = xv[offset(&c, &shape)];
            }
            let it = Tensor::from_vec(ids, &[n]).unwrap().to_device(d).unwrap();
            let st = Tensor::from_vec(src, &sshape).unwrap().to_device(d).unwrap();
            assert_eq!(x.index_add(dim, &it, &st).unwrap().to_vec::<f64>().unwrap(), want_a);
            assert_eq!(x.index_select(dim, &it).unwrap().to_vec::<f64>().unwrap(), want_sel);
        }
    }
    test_device!(gather_scatter_add_and_index_add_match_a_brute_force_reference);

    fn an_index_outside_its_dim_is_one_clear_error(d: Device) {
        let on = |t: Tensor| t.to_device(d).unwrap();
        let x = on(Tensor::zeros(&[2, 3], crate::DType::F32));
        let src = on(Tensor::from_vec(vec![1.0f32, 2.0], &[1, 2]).unwrap());
        for bad in [3i64, -1] {
            let ids = on(Tensor::from_vec(vec![0i64, bad], &[1, 2]).unwrap());
            let want = format!("index {bad} at position 1 is outside 0..3");
            for r in [x.scatter_add(1, &ids, &src), x.gather(1, &ids)] {
                match r {
                    Err(TensorError::OutOfRange { msg, .. }) => assert_eq!(msg, want),
                    r => panic!("{r:?}"),
                }
            }
            let ids = on(Tensor::from_vec(vec![bad], &[1]).unwrap());
            let one = on(Tensor::from_vec(vec![1.0f32, 2.0], &[2, 1]).unwrap());
            assert!(matches!(
                x.index_add(1, &ids, &one),
                Err(TensorError::OutOfRange { .. })
            ));
            assert!(matches!(x.index_select(1, &ids), Err(TensorError::OutOfRange { .. })));
        }
        let e = x.topk(4).unwrap_err();
        assert_eq!(
            e.to_string(),
            "topk: k = 4 is larger than the last dim (3) of shape [2, 3]"
        );
        let ids = on(Tensor::from_vec(vec![0i64, 1], &[2]).unwrap());
        assert!(matches!(x.scatter_add(1, &ids, &src), Err(TensorError::Invalid { .. })));
        assert!(matches!(x.gather(2, &ids), Err(TensorError::DimOutOfRange { .. })));
        assert!(matches!(
            x.index_add(1, &ids, &src),
            Err(TensorError::ShapeMismatch { .. })
        ));
    }
    test_device!(an_index_outside_its_dim_is_one_clear_error);
}
