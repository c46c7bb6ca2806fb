//! How a tensor's elements sit in its storage: shape, strides (in elements) and offset.

use crate::{Result, TensorError};

/// Shape, strides and start offset of a view into a flat storage. Views (transpose,
/// narrow, broadcast) only change the layout; the storage is shared.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    shape: Vec<usize>,
    strides: Vec<usize>,
    offset: usize,
}

/// Row-major strides of a contiguous tensor of this shape.
pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![0; shape.len()];
    let mut acc = 1;
    for (s, &d) in strides.iter_mut().zip(shape).rev() {
        *s = acc;
        acc *= d;
    }
    strides
}

/// The shape two shapes broadcast to (NumPy rules), or an error naming both.
pub fn broadcast_shape(op: &'static str, a: &[usize], b: &[usize]) -> Result<Vec<usize>> {
    let n = a.len().max(b.len());
    let mut out = vec![0; n];
    for i in 0..n {
        let da = if i + a.len() >= n { a[i + a.len() - n] } else { 1 };
        let db = if i + b.len() >= n { b[i + b.len() - n] } else { 1 };
        out[i] = if da == db || db == 1 {
            da
        } else if da == 1 {
            db
        } else {
            return Err(TensorError::Broadcast {
                op,
                lhs: a.to_vec(),
                rhs: b.to_vec(),
            });
        };
    }
    Ok(out)
}

impl Layout {
    /// A contiguous row-major layout starting at offset 0.
    pub fn contiguous(shape: &[usize]) -> Self {
        Layout {
            shape: shape.to_vec(),
            strides: contiguous_strides(shape),
            offset: 0,
        }
    }

    /// A layout from its parts (checked by the caller against the storage length).
    pub fn new(shape: Vec<usize>, strides: Vec<usize>, offset: usize) -> Self {
        debug_assert_eq!(shape.len(), strides.len());
        Layout { shape, strides, offset }
    }

    /// The dimensions.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Strides in elements.
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }

    /// Index of the first element in the storage.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// True when the elements are laid out row-major without gaps (size-1 dims ignored).
    pub fn is_contiguous(&self) -> bool {
        let mut acc = 1;
        for (&d, &s) in self.shape.iter().zip(&self.strides).rev() {
            if d != 1 && s != acc {
                return false;
            }
            acc *= d;
        }
        true
    }

    /// One past the largest storage index this layout touches (0 when empty).
    pub fn storage_extent(&self) -> usize {
        if self.numel() == 0 {
            return 0;
        }
        self.offset
            + self
                .shape
                .iter()
                .zip(&self.strides)
                .map(|(&d, &s)| (d - 1) * s)
                .sum::<usize>()
            + 1
    }

    /// Swaps two dimensions.
    pub fn transpose(&self, a: usize, b: usize) -> Result<Layout> {
        let rank = self.rank();
        for d in [a, b] {
            if d >= rank {
                return Err(TensorError::DimOutOfRange {
                    op: "transpose",
                    dim: d,
                    rank,
                });
            }
        }
        let mut l = self.clone();
        l.shape.swap(a, b);
        l.strides.swap(a, b);
        Ok(l)
    }

    /// Reorders the dimensions: dimension `i` of the result is dimension `perm[i]` here.
    pub fn permute(&self, perm: &[usize]) -> Result<Layout> {
        let rank = self.rank();
        let mut seen = vec![false; rank];
        if perm.len() != rank {
            return Err(TensorError::Invalid {
                op: "permute",
                msg: format!("permutation {perm:?} for rank {rank}"),
            });
        }
        for &p in perm {
            if p >= rank || seen[p] {
                return Err(TensorError::Invalid {
                    op: "permute",
                    msg: format!("{perm:?} is not a permutation of 0..{rank}"),
                });
            }
            seen[p] = true;
        }
        Ok(Layout {
            shape: perm.iter().map(|&p| self.shape[p]).collect(),
            strides: perm.iter().map(|&p| self.strides[p]).collect(),
            offset: self.offset,
        })
    }

    /// The elements `start..start+len` along `dim`.
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Layout> {
        let rank = self.rank();
        if dim >= rank {
            return Err(TensorError::DimOutOfRange {
                op: "narrow",
                dim,
                rank,
            });
        }
        if start + len > self.shape[dim] {
            return Err(TensorError::OutOfRange {
                op: "narrow",
                msg: format!("{start}..{} along dim {dim} of size {}", start + len, self.shape[dim]),
            });
        }
        let mut l = self.clone();
        l.shape[dim] = len;
        if len > 0 {
            l.offset += start * self.strides[dim];
        }
        Ok(l)
    }

    /// A view of this layout broadcast to `shape` (stride 0 on the broadcast dims).
    pub fn broadcast_to(&self, shape: &[usize]) -> Result<Layout> {
        let err = || TensorError::Broadcast {
            op: "broadcast_to",
            lhs: self.shape.clone(),
            rhs: shape.to_vec(),
        };
        if shape.len() < self.rank() {
            return Err(err());
        }
        let extra = shape.len() - self.rank();
        let mut strides = vec![0; shape.len()];
        for i in 0..self.rank() {
            let (d, s) = (self.shape[i], self.strides[i]);
            if d == shape[extra + i] {
                strides[extra + i] = s;
            } else if d == 1 {
                strides[extra + i] = 0;
            } else {
                return Err(err());
            }
        }
        Ok(Layout {
            shape: shape.to_vec(),
            strides,
            offset: self.offset,
        })
    }

    /// A layout of a different shape over the same elements, when the elements are
    /// contiguous (reshaping a strided view needs a copy first).
    pub fn reshape(&self, shape: &[usize]) -> Result<Layout> {
        let numel: usize = shape.iter().product();
        if numel != self.numel() {
            return Err(TensorError::ElementCount {
                op: "reshape",
                len: self.numel(),
                shape: shape.to_vec(),
                numel,
            });
        }
        if !self.is_contiguous() {
            return Err(TensorError::Invalid {
                op: "reshape",
                msg: "view is not contiguous".into(),
            });
        }
        Ok(Layout {
            shape: shape.to_vec(),
            strides: contiguous_strides(shape),
            offset: self.offset,
        })
    }

    /// Calls `f(storage_index)` for every element in row-major order of this layout.
    pub fn for_each_offset(&self, mut f: impl FnMut(usize)) {
        let n = self.numel();
        if n == 0 {
            return;
        }
        let rank = self.rank();
        if rank == 0 {
            f(self.offset);
            return;
        }
        let inner = self.shape[rank - 1];
        let inner_stride = self.strides[rank - 1];
        let mut idx = vec![0usize; rank];
        let mut base = self.offset;
        loop {
            let mut o = base;
            for _ in 0..inner {
                f(o);
                o += inner_stride;
            }
            // advance the outer index (dims 0..rank-1)
            let mut d = rank - 1;
            loop {
                if d == 0 {
                    return;
                }
                d -= 1;
                idx[d] += 1;
                base += self.strides[d];
                if idx[d] < self.shape[d] {
                    break;
                }
                base -= self.strides[d] * self.shape[d];
                idx[d] = 0;
            }
        }
    }

    /// Storage offset of the `row`-th run of the last dimension (row-major over the
    /// leading dims).
    pub fn row_offset(&self, mut row: usize) -> usize {
        let rank = self.rank();
        let mut o = self.offset;
        for d in (0..rank.saturating_sub(1)).rev() {
            let i = row % self.shape[d];
            row /= self.shape[d];
            o += i * self.strides[d];
        }
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn for_each_offset_follows_a_transposed_view() {
        let l = Layout::contiguous(&[2, 3]).transpose(0, 1).unwrap();
        let mut seen = vec![];
        l.for_each_offset(|o| seen.push(o));
        assert_eq!(seen, vec![0, 3, 1, 4, 2, 5]);
        assert!(!l.is_contiguous());
    }

    #[test]
    fn broadcast_rules() {
        assert_eq!(broadcast_shape("t", &[4, 1, 3], &[5, 1]).unwrap(), vec![4, 5, 3]);
        assert!(broadcast_shape("t", &[2, 3], &[4]).is_err());
        let b = Layout::contiguous(&[3]).broadcast_to(&[2, 3]).unwrap();
        assert_eq!(b.strides(), &[0, 1]);
        assert_eq!(b.row_offset(1), 0);
    }
}
