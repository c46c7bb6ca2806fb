//! A tensor's memory on the host: one flat vector of one element type.

use half::{bf16, f16};

use crate::DType;

/// A tensor's backing memory on the host: one flat vector of one element type. Only this
/// crate sees it (the CPU backend's storage, and what the fake device keeps behind its
/// contract); other crates copy explicitly.
#[derive(Debug, Clone, PartialEq)]
pub enum CpuStorage {
    F32(Vec<f32>),
    F64(Vec<f64>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    I64(Vec<i64>),
    U8(Vec<u8>),
    I8(Vec<i8>),
}

/// An f64 rounded to `i8` as a quantizing cast does: half to even, saturating at ±127 (the
/// symmetric range: -128 is never produced), NaN to 0.
pub(crate) fn quantize_i8(x: f64) -> i8 {
    if x.is_nan() {
        return 0;
    }
    x.round_ties_even().clamp(-127.0, 127.0) as i8
}

impl CpuStorage {
    /// The element type.
    pub(crate) fn dtype(&self) -> DType {
        match self {
            CpuStorage::F32(_) => DType::F32,
            CpuStorage::F64(_) => DType::F64,
            CpuStorage::F16(_) => DType::F16,
            CpuStorage::BF16(_) => DType::BF16,
            CpuStorage::I64(_) => DType::I64,
            CpuStorage::U8(_) => DType::U8,
            CpuStorage::I8(_) => DType::I8,
        }
    }

    /// Number of elements.
    pub(crate) fn len(&self) -> usize {
        match self {
            CpuStorage::F32(v) => v.len(),
            CpuStorage::F64(v) => v.len(),
            CpuStorage::F16(v) => v.len(),
            CpuStorage::BF16(v) => v.len(),
            CpuStorage::I64(v) => v.len(),
            CpuStorage::U8(v) => v.len(),
            CpuStorage::I8(v) => v.len(),
        }
    }

    /// Bytes of memory held.
    pub(crate) fn bytes(&self) -> usize {
        self.len() * self.dtype().size_in_bytes()
    }

    /// The address of the first element (for identity checks and raw handles; never
    /// dereferenced by this crate through it).
    pub(crate) fn address(&self) -> u64 {
        match self {
            CpuStorage::F32(v) => v.as_ptr() as u64,
            CpuStorage::F64(v) => v.as_ptr() as u64,
            CpuStorage::F16(v) => v.as_ptr() as u64,
            CpuStorage::BF16(v) => v.as_ptr() as u64,
            CpuStorage::I64(v) => v.as_ptr() as u64,
            CpuStorage::U8(v) => v.as_ptr() as u64,
            CpuStorage::I8(v) => v.as_ptr() as u64,
        }
    }

    /// A zero-filled storage.
    pub(crate) fn zeros(dtype: DType, n: usize) -> Self {
        Self::full(dtype, n, 0.0)
    }

    /// `n` copies of `v` converted to `dtype`.
    pub(crate) fn full(dtype: DType, n: usize, v: f64) -> Self {
        match dtype {
            DType::F32 => CpuStorage::F32(vec![v as f32; n]),
            DType::F64 => CpuStorage::F64(vec![v; n]),
            DType::F16 => CpuStorage::F16(vec![f16::from_f64(v); n]),
            DType::BF16 => CpuStorage::BF16(vec![bf16::from_f64(v); n]),
            DType::I64 => CpuStorage::I64(vec![v as i64; n]),
            DType::U8 => CpuStorage::U8(vec![v as u8; n]),
            DType::I8 => CpuStorage::I8(vec![quantize_i8(v); n]),
        }
    }

    /// `dtype` values from f64s (rounded as the type requires: floats to nearest even,
    /// `I64` and `U8` as Rust's `as`, `I8` by [`quantize_i8`]).
    pub(crate) fn from_f64_vec(v: Vec<f64>, dtype: DType) -> Self {
        match dtype {
            DType::F64 => CpuStorage::F64(v),
            DType::F32 => CpuStorage::F32(v.iter().map(|&x| x as f32).collect()),
            DType::F16 => CpuStorage::F16(v.iter().map(|&x| f16::from_f64(x)).collect()),
            DType::BF16 => CpuStorage::BF16(v.iter().map(|&x| bf16::from_f64(x)).collect()),
            DType::I64 => CpuStorage::I64(v.iter().map(|&x| x as i64).collect()),
            DType::U8 => CpuStorage::U8(v.iter().map(|&x| x as u8).collect()),
            DType::I8 => CpuStorage::I8(v.iter().map(|&x| quantize_i8(x)).collect()),
        }
    }

    /// The smallest and largest value of an integer storage (`None` for floats and for an
    /// empty storage): what a device storage remembers of the ids it was given, so that an
    /// index check needs no copy back.
    pub(crate) fn int_range(&self) -> Option<(i64, i64)> {
        fn range(it: impl Iterator<Item = i64>) -> Option<(i64, i64)> {
            it.fold(None, |r, x| match r {
                None => Some((x, x)),
                Some((lo, hi)) => Some((lo.min(x), hi.max(x))),
            })
        }
        match self {
            CpuStorage::I64(v) => range(v.iter().copied()),
            CpuStorage::U8(v) => range(v.iter().map(|&x| i64::from(x))),
            CpuStorage::I8(v) => range(v.iter().map(|&x| i64::from(x))),
            _ => None,
        }
    }
}

/// The range of integer values `range` once converted to `dtype`: the same range when `dtype`
/// is an integer type holding all of it (the conversion keeps every value), else unknown.
pub(crate) fn range_in(range: Option<(i64, i64)>, dtype: DType) -> Option<(i64, i64)> {
    let (lo, hi) = range?;
    let fits = match dtype {
        DType::I64 => true,
        DType::U8 => lo >= 0 && hi <= 255,
        DType::I8 => lo >= -127 && hi <= 127,
        _ => false,
    };
    fits.then_some((lo, hi))
}

#[cfg(test)]
mod tests {
    use super::{quantize_i8, CpuStorage};
    use crate::DType;

    #[test]
    fn the_i8_cast_rounds_half_to_even_and_saturates_at_127() {
        let got: Vec<i8> = [0.5, 1.5, 2.5, -0.5, -1.5, 126.5, 127.4, 200.0, -127.6, -1e9, f64::NAN]
            .into_iter()
            .map(quantize_i8)
            .collect();
        assert_eq!(got, [0, 2, 2, 0, -2, 126, 127, 127, -127, -127, 0]);
        let s = CpuStorage::from_f64_vec(vec![-3.0, 250.0, 2.5], DType::I8);
        assert_eq!(s, CpuStorage::I8(vec![-3, 127, 2]));
        assert_eq!(s.int_range(), Some((-3, 127)));
        assert_eq!(super::range_in(Some((-3, 127)), DType::I64), Some((-3, 127)));
        assert_eq!(super::range_in(Some((-3, 127)), DType::U8), None);
        assert_eq!(super::range_in(Some((0, 200)), DType::I8), None);
        assert_eq!(super::range_in(Some((0, 200)), DType::F32), None);
        assert_eq!(CpuStorage::zeros(DType::F32, 3).int_range(), None);
    }
}
