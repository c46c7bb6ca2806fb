//! What kernel launches share: the by-value layout argument and the grid shapes.

use cudarc::driver::{DeviceRepr, LaunchConfig};

use crate::{Layout, Result, TensorError};

/// Highest rank a strided kernel argument carries (`BRIGADE_MAX_RANK` in `common.cuh`).
pub(crate) const MAX_RANK: usize = 8;

/// Threads per block (`BRIGADE_BLOCK` in `common.cuh`: row kernels rely on it).
pub(crate) const BLOCK: u32 = 256;

/// A view passed by value to a kernel; mirrors `struct StridedLayout` in `common.cuh`
/// field for field (`repr(C)`, 64-bit counts). `contiguous` is 1 when the view is row-major
/// without gaps: the kernels then index `offset + i` without dividing per dimension.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct StridedLayout {
    rank: u32,
    contiguous: u32,
    shape: [u64; MAX_RANK],
    strides: [u64; MAX_RANK],
    offset: u64,
}

// SAFETY: plain `repr(C)` data with the same layout as the CUDA struct.
unsafe impl DeviceRepr for StridedLayout {}

impl StridedLayout {
    /// The kernel argument for `layout`; views of rank above [`MAX_RANK`] are refused.
    pub(crate) fn of(op: &'static str, layout: &Layout) -> Result<Self> {
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
            contiguous: u32::from(layout.is_contiguous()),
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
pub(crate) fn for_elements(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(BLOCK as usize).clamp(1, 1 << 16) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block per row (rows beyond the grid loop), [`BLOCK`] threads each.
pub(crate) fn for_rows(rows: usize) -> LaunchConfig {
    let blocks = rows.clamp(1, 1 << 16) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Rows per chunk of the first stage of a column reduction (`COL_CHUNK` in `nn.cu`).
pub(crate) const COL_CHUNK: usize = 64;

/// The first stage of a column reduction over `[rows, d]`: blocks of 32 columns x 8 rows of
/// threads, one block per 32 columns and per chunk of [`COL_CHUNK`] rows (`chunks` of them).
pub(crate) fn for_column_chunks(d: usize, chunks: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            d.div_ceil(32).clamp(1, 1 << 30) as u32,
            chunks.clamp(1, 65535) as u32,
            1,
        ),
        block_dim: (32, 8, 1),
        shared_mem_bytes: 0,
    }
}

/// A single block (block-wide reductions to one value).
pub(crate) fn single_block() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}
