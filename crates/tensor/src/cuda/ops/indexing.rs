//! Sorting and moving elements by index on CUDA: no kernels yet. Each method is the typed
//! `NotOnDevice` error naming the op, so a caller learns to run it on the CPU instead of
//! meeting a panic or a silent host round trip.

use super::super::storage::CudaStorage;
use crate::backend::Indexing;
use crate::{Layout, Result, TensorError};

fn not_yet<T>(op: &'static str, s: &CudaStorage) -> Result<T> {
    Err(TensorError::NotOnDevice { op, device: s.device() })
}

impl Indexing for CudaStorage {
    fn sort_last(&self, _layout: &Layout, _descending: bool, _k: usize) -> Result<(Self, Self)> {
        not_yet("sort", self)
    }

    fn gather(&self, _layout: &Layout, _dim: usize, _ids: (&Self, &Layout)) -> Result<Self> {
        not_yet("gather", self)
    }

    fn scatter_add(
        &self,
        _layout: &Layout,
        _dim: usize,
        _ids: (&Self, &Layout),
        _src: (&Self, &Layout),
    ) -> Result<Self> {
        not_yet("scatter_add", self)
    }
}
