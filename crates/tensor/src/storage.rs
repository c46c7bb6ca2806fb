//! Flat element buffers that tensors view through a [`crate::Layout`].

use half::{bf16, f16};

use crate::DType;

/// A tensor's backing memory on the host: one flat vector of one element type.
#[derive(Debug, Clone, PartialEq)]
pub enum CpuStorage {
    F32(Vec<f32>),
    F64(Vec<f64>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    I64(Vec<i64>),
    U8(Vec<u8>),
}

impl CpuStorage {
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            CpuStorage::F32(_) => DType::F32,
            CpuStorage::F64(_) => DType::F64,
            CpuStorage::F16(_) => DType::F16,
            CpuStorage::BF16(_) => DType::BF16,
            CpuStorage::I64(_) => DType::I64,
            CpuStorage::U8(_) => DType::U8,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            CpuStorage::F32(v) => v.len(),
            CpuStorage::F64(v) => v.len(),
            CpuStorage::F16(v) => v.len(),
            CpuStorage::BF16(v) => v.len(),
            CpuStorage::I64(v) => v.len(),
            CpuStorage::U8(v) => v.len(),
        }
    }

    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A zero-filled storage.
    pub fn zeros(dtype: DType, n: usize) -> Self {
        match dtype {
            DType::F32 => CpuStorage::F32(vec![0.0; n]),
            DType::F64 => CpuStorage::F64(vec![0.0; n]),
            DType::F16 => CpuStorage::F16(vec![f16::ZERO; n]),
            DType::BF16 => CpuStorage::BF16(vec![bf16::ZERO; n]),
            DType::I64 => CpuStorage::I64(vec![0; n]),
            DType::U8 => CpuStorage::U8(vec![0; n]),
        }
    }

    /// An empty storage of the same type (what is left behind when the data is lent out).
    pub(crate) fn empty_like(&self) -> Self {
        Self::zeros(self.dtype(), 0)
    }
}

/// Storage on some device. Only the host variant exists in this build; a CUDA variant
/// slots in beside it, and every kernel dispatches on this enum.
#[derive(Debug, Clone, PartialEq)]
pub enum Storage {
    Cpu(CpuStorage),
}

impl Storage {
    /// The device this storage lives on.
    pub fn device(&self) -> crate::Device {
        match self {
            Storage::Cpu(_) => crate::Device::Cpu,
        }
    }
}
