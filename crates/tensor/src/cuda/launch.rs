//! What kernel launches share: the by-value layout argument and the grid shapes.

use cudarc::driver::{DeviceRepr, LaunchConfig};

use crate::{Layout, Result, TensorError};

/// Highest rank a strided kernel argument carries (`BRIGADE_MAX_RANK` in `common.cuh`).
pub const MAX_RANK: usize = 8;

/// Threads per block (`BRIGADE_BLOCK` in `common.cuh`: row kernels rely on it).
pub const BLOCK: u32 = 256;

/// A view passed by value to a kernel; mirrors `struct StridedLayout` in `common.cuh`
/// field for field (`repr(C)`, 64-bit counts).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct StridedLayout {
    rank: u32,
    pad: u32,
    shape: [u64; MAX_RANK],
    strides: [u64; MAX_RANK],
    offset: u64,
}

// SAFETY: plain `repr(C)` data with the same layout as the CUDA struct.
unsafe impl DeviceRepr for StridedLayout {}

impl StridedLayout {
    /// The kernel argument for `layout`; views of rank above [`MAX_RANK`] are refused.
    pub fn of(op: &'static str, layout: &Layout) -> Result<Self> {
        let rank = layout.rank();
        if rank > MAX_RANK {
            return Err(TensorError::Invalid {
                op,
                msg: format!(
                    "the CUDA backend handles views of rank <= {MAX_RANK}, got {:?}",
                    layout.shape()
                ),
            });
        }
        let mut l = StridedLayout {
            rank: rank as u32,
            pad: 0,
            shape: [1; MAX_RANK],
            strides: [0; MAX_RANK],
            offset: 0,
        };
        for d in 0..rank {
            l.shape[d] = layout.shape()[d] as u64;
            l.strides[d] = layout.strides()[d] as u64;
        }
        l.offset = layout.offset() as u64;
        Ok(l)
    }
}

/// A grid-stride launch over `n` elements.
pub fn for_elements(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(BLOCK as usize).clamp(1, 1 << 16) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block per row (rows beyond the grid loop), [`BLOCK`] threads each.
pub fn for_rows(rows: usize) -> LaunchConfig {
    let blocks = rows.clamp(1, 1 << 16) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A single block (block-wide reductions to one value).
pub fn single_block() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}
