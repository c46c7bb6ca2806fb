//! The sparse all-gather ([`super::ProcessGroup::all_gather_sparse`]): every rank's values and
//! their `I64` indices, of any count up to a capacity every rank passes alike, in one
//! all-gather of fixed size (the values padded to the capacity, the indices behind their count
//! in the side buffer), so it runs on any group that all-gathers, in issue order like every
//! other collective, and completes without reading anything back to the host.

use brigade_comm::CommError;
use brigade_tensor::{DType, Tensor};

use crate::{DdpError, Result};

/// What a sparse all-gather completes with: every rank's entries, rank-major, each row padded
/// with zeros (value 0 at index 0) after its rank's count.
#[derive(Debug, Clone)]
pub struct SparseGather {
    /// `[world, capacity]`, in the values' dtype.
    pub values: Tensor,
    /// `[world, capacity]` `I64` positions of the values.
    pub indices: Tensor,
    /// `[world]` `I64`: how many entries of each row are its rank's.
    pub counts: Tensor,
}

impl SparseGather {
    /// The dense sum of every rank's entries over `len` positions (on the values' device, in
    /// their dtype): each position's entries added in rank order from `-0.0` (the exact
    /// identity of addition, so a position one rank sent is that rank's value, bit for bit);
    /// the padding adds `0.0` at position 0.
    pub fn sum_dense(&self, len: usize) -> Result<Tensor> {
        let v = &self.values;
        let zero = Tensor::full_on(&[len], -0.0, v.dtype(), v.device())?;
        let n = v.numel();
        Ok(zero.scatter_add(0, &self.indices.reshape(&[n])?, &v.reshape(&[n])?)?)
    }
}

/// `values` and `indices` laid out for one all-gather: the values padded to `capacity`, and the
/// side `[count, indices.., zeros..]` (`1 + capacity` `I64`s).
pub(crate) fn pack(values: &Tensor, indices: &Tensor, capacity: usize, tag: &str) -> Result<(Tensor, Tensor)> {
    let bad = |why: String| DdpError::Comm(CommError::InvalidArgument(format!("sparse all-gather `{tag}`: {why}")));
    let k = values.numel();
    if values.rank() != 1 || indices.shape() != [k] {
        return Err(bad(format!(
            "values and indices must be 1-d of one length, got {:?} and {:?}",
            values.shape(),
            indices.shape()
        )));
    }
    if indices.dtype() != DType::I64 {
        return Err(bad(format!("the indices must be i64, got {}", indices.dtype())));
    }
    if k > capacity {
        return Err(bad(format!("{k} entries are more than the capacity {capacity}")));
    }
    let on = values.device();
    let padded = Tensor::zeros_on(&[capacity], values.dtype(), on)?;
    padded.narrow(0, 0, k)?.copy_from(values)?;
    let side = Tensor::zeros_on(&[1 + capacity], DType::I64, on)?;
    side.narrow(0, 0, 1)?
        .copy_from(&Tensor::from_vec(vec![k as i64], &[1])?.to_device(on)?)?;
    side.narrow(0, 1, k)?.copy_from(&indices.to_device(on)?)?;
    Ok((padded, side))
}

/// The gathered `[world, capacity]` values and `[world, 1 + capacity]` sides as a
/// [`SparseGather`].
pub(crate) fn unpack(values: Tensor, side: Tensor, capacity: usize) -> Result<SparseGather> {
    let world = values.shape()[0];
    Ok(SparseGather {
        values,
        indices: side.narrow(1, 1, capacity)?.contiguous()?,
        counts: side.narrow(1, 0, 1)?.contiguous()?.reshape(&[world])?,
    })
}
