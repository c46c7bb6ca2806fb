//! Sorting and moving elements by index on CUDA (`indexing.cu`): the sort of each row behind
//! `sort`, `argsort` and `topk`, gather and scatter-add along a dim. Every result equals the
//! CPU's (`cpu/indexing.rs`) bit for bit: the sort's order is the CPU's total order, gather
//! moves bits, and scatter-add adds repeated targets in the index's row-major order without
//! atomics, so a run repeats its sums exactly (see [`Indexing::scatter_add`] below for why).

use super::super::element::CudaElement;
use super::super::launch::{for_elements, for_rows, StridedLayout};
use super::super::nvrtc::INDEXING;
use super::super::storage::{launch, CudaStorage};
use super::float_only;
use crate::backend::{BackendStorage, Indexing};
use crate::{DType, Layout, Result};

/// Elements of a row one block sorts in shared memory (`SORT_TILE` in `indexing.cu`); a longer
/// row is sorted in tiles of this many and the runs merged in passes.
const SORT_TILE: usize = 2048;

impl CudaStorage {
    /// The first `k` of each of `rows` rows of `n` sorted (`k >= 1`): one block per row when a
    /// row fits a tile; else tiles, each keeping its first `k`, then merge passes, each
    /// merged run keeping its first `k`, until one run of `k` is left in each row.
    fn sort_rows<T: CudaElement>(
        &self,
        layout: &Layout,
        (rows, n): (usize, usize),
        descending: bool,
        k: usize,
    ) -> Result<(Self, Self)> {
        let op = "sort";
        let dev = self.dev();
        let x = self.contiguous_view::<T>(op, layout)?;
        let (r64, n64, flag) = (rows as u64, n as u64, i32::from(descending));
        let tiles = n.div_ceil(SORT_TILE);
        let keep = k.min(SORT_TILE);
        // a row after the tiles: runs of `keep`, the last tile's maybe shorter
        let mut len = (tiles - 1) * keep + (n - (tiles - 1) * SORT_TILE).min(keep);
        let (mut va, mut ia) = (Self::alloc::<T>(dev, rows * len)?, Self::alloc::<i64>(dev, rows * len)?);
        let (len64, keep64) = (len as u64, keep as u64);
        let name = format!("sort_tiles_{}", T::SUFFIX);
        launch!(
            dev,
            INDEXING,
            name,
            for_rows(rows * tiles),
            &x,
            &mut va,
            &mut ia,
            &r64,
            &n64,
            &len64,
            &keep64,
            &flag
        )?;
        if len > keep {
            let (mut vb, mut ib) = (Self::alloc::<T>(dev, rows * len)?, Self::alloc::<i64>(dev, rows * len)?);
            let name = format!("merge_runs_{}", T::SUFFIX);
            let mut w = keep;
            while len > w {
                let (next, pairs) = ((2 * w).min(k), len.div_ceil(2 * w));
                let out = (pairs - 1) * next + (len - (pairs - 1) * 2 * w).min(next);
                let (l64, w64, k64, o64) = (len as u64, w as u64, next as u64, out as u64);
                launch!(
                    dev,
                    INDEXING,
                    name,
                    for_elements(rows * len),
                    &va,
                    &ia,
                    &mut vb,
                    &mut ib,
                    &r64,
                    &l64,
                    &w64,
                    &k64,
                    &o64,
                    &flag
                )?;
                std::mem::swap(&mut va, &mut vb);
                std::mem::swap(&mut ia, &mut ib);
                (len, w) = (out, next);
            }
        }
        // one run of k a row, at a row stride of k; the scratch may be longer: its head
        let (v, i) = (Self::from_slice(dev, va), Self::from_slice(dev, ia));
        if v.len() == rows * k {
            return Ok((v, i));
        }
        let head = Layout::contiguous(&[rows, k]);
        Ok((v.copy_strided(&head)?, i.copy_strided(&head)?))
    }

    /// [`Indexing::scatter_add`] into `out` (a contiguous copy of self) for f32 and f64.
    fn scatter_lines<T: CudaElement>(
        out: &mut Self,
        shape: &[usize],
        dim: usize,
        ids: (&Self, &Layout),
        src: (&Self, &Layout),
    ) -> Result<()> {
        let op = "scatter_add";
        let n = ids.1.numel();
        // one line per position of the index outside dim; n > 0, so the dim is not empty
        let lines = n / ids.1.shape()[dim];
        let (lx, li) = (
            StridedLayout::of(op, &Layout::contiguous(shape))?,
            StridedLayout::of(op, ids.1)?,
        );
        let (d32, l64) = (dim as u32, lines as u64);
        let s = Self::source_view::<T>(op, src, n)?;
        let dev = out.dev().clone();
        let o = out.data_mut::<T>(op)?;
        let name = format!("scatter_add_lines_{}_{}", T::SUFFIX, Self::index_suffix(op, ids.0)?);
        if ids.0.dtype() == DType::I64 {
            let iv = ids.0.data::<i64>(op)?;
            launch!(dev, INDEXING, name, for_rows(lines), o, &s, iv, &lx, &li, &d32, &l64)
        } else {
            let iv = ids.0.data::<u8>(op)?;
            launch!(dev, INDEXING, name, for_rows(lines), o, &s, iv, &lx, &li, &d32, &l64)
        }
    }

    /// [`Indexing::gather`] for elements of `T`'s size (bits moved as they are).
    fn gather_bits<T: CudaElement>(&self, layout: &Layout, dim: usize, ids: (&Self, &Layout)) -> Result<Self> {
        let op = "gather";
        let n = ids.1.numel();
        let (lx, li) = (
            StridedLayout::of(op, &Layout::contiguous(layout.shape()))?,
            StridedLayout::of(op, ids.1)?,
        );
        let (d32, n64) = (dim as u32, n as u64);
        let x = self.contiguous_view::<T>(op, layout)?;
        let mut out = Self::alloc::<T>(self.dev(), n)?;
        let name = format!(
            "gather_along_b{}_{}",
            std::mem::size_of::<T>(),
            Self::index_suffix(op, ids.0)?
        );
        if ids.0.dtype() == DType::I64 {
            let iv = ids.0.data::<i64>(op)?;
            launch!(
                self.dev(),
                INDEXING,
                name,
                for_elements(n),
                &x,
                iv,
                &mut out,
                &lx,
                &li,
                &d32,
                &n64
            )?;
        } else {
            let iv = ids.0.data::<u8>(op)?;
            launch!(
                self.dev(),
                INDEXING,
                name,
                for_elements(n),
                &x,
                iv,
                &mut out,
                &lx,
                &li,
                &d32,
                &n64
            )?;
        }
        Ok(Self::from_slice(self.dev(), out))
    }
}

impl Indexing for CudaStorage {
    /// The indices know their range (`0..n`) without a read, so a scatter of them checks
    /// nothing on the host.
    fn sort_last(&self, layout: &Layout, descending: bool, k: usize) -> Result<(Self, Self)> {
        let op = "sort";
        let (rows, n) = Self::rows_of(layout, op)?;
        if rows * k == 0 {
            return Ok((self.empty_like(), Self::empty(self.dev(), DType::I64)));
        }
        let (v, i) = float_dispatch!(op, self.dtype(), T => self.sort_rows::<T>(layout, (rows, n), descending, k))?;
        Ok((v, i.with_int_range(Some((0, n as i64 - 1)))))
    }

    fn gather(&self, layout: &Layout, dim: usize, ids: (&Self, &Layout)) -> Result<Self> {
        let op = "gather";
        if ids.1.numel() == 0 {
            return Ok(self.empty_like());
        }
        ids.0.check_extent(op, ids.1)?;
        match self.dtype() {
            DType::F32 => self.gather_bits::<f32>(layout, dim, ids),
            DType::F64 => self.gather_bits::<f64>(layout, dim, ids),
            DType::F16 => self.gather_bits::<half::f16>(layout, dim, ids),
            DType::BF16 => self.gather_bits::<half::bf16>(layout, dim, ids),
            d => Err(float_only(op, d)),
        }
    }

    /// Deterministic, and the CPU's sums bit for bit: repeated targets are added in the
    /// index's row-major order by one thread, not by atomics (whose order, and so whose f32
    /// rounding, changes from run to run). A target can repeat only along `dim`, so one
    /// block per line along `dim` runs the lines in parallel; a single long line (a 1-d
    /// `index_add` of top-k values into a flat gradient) runs on one block. 16-bit storages
    /// are widened to f32, added there and rounded once, as on the CPU.
    fn scatter_add(&self, layout: &Layout, dim: usize, ids: (&Self, &Layout), src: (&Self, &Layout)) -> Result<Self> {
        let op = "scatter_add";
        if matches!(self.dtype(), DType::F16 | DType::BF16) {
            let wide = self.to_dtype(layout, DType::F32)?;
            let wide_src = src.0.to_dtype(src.1, DType::F32)?;
            let (l, sl) = (Layout::contiguous(layout.shape()), Layout::contiguous(src.1.shape()));
            let sum = wide.scatter_add(&l, dim, ids, (&wide_src, &sl))?;
            return sum.to_dtype(&l, self.dtype());
        }
        let mut out = self.copy_strided(layout)?;
        if ids.1.numel() == 0 {
            return Ok(out);
        }
        ids.0.check_extent(op, ids.1)?;
        match self.dtype() {
            DType::F32 => Self::scatter_lines::<f32>(&mut out, layout.shape(), dim, ids, src)?,
            DType::F64 => Self::scatter_lines::<f64>(&mut out, layout.shape(), dim, ids, src)?,
            d => return Err(float_only(op, d)),
        }
        Ok(out)
    }
}
