//! Policy state across ranks: each rank's state dict in one byte string, so that rank 0 can
//! hold every rank's (a checkpoint is written by rank 0; PowerSGD's error feedback differs per
//! rank).

use brigade_tensor::{DType, Tensor};

use crate::{DdpError, Result};

/// `name`, dtype, shape and little-endian elements of each entry.
pub(crate) fn encode(state: &[(String, Tensor)]) -> Result<Vec<u8>> {
    let mut out = vec![];
    put(&mut out, state.len() as u64);
    for (name, t) in state {
        put(&mut out, name.len() as u64);
        out.extend(name.as_bytes());
        let code = DType::ALL
            .iter()
            .position(|&d| d == t.dtype())
            .expect("every dtype is listed") as u64;
        put(&mut out, code);
        put(&mut out, t.shape().len() as u64);
        for &d in t.shape() {
            put(&mut out, d as u64);
        }
        let bytes = elements(t)?;
        put(&mut out, bytes.len() as u64);
        out.extend(bytes);
    }
    Ok(out)
}

fn put(out: &mut Vec<u8>, x: u64) {
    out.extend(x.to_le_bytes());
}

fn elements(t: &Tensor) -> Result<Vec<u8>> {
    Ok(match t.dtype() {
        DType::F32 => t.to_vec::<f32>()?.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::F64 => t.to_vec::<f64>()?.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::F16 => t.to_vec::<half::f16>()?.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::BF16 => t.to_vec::<half::bf16>()?.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::I64 => t.to_vec::<i64>()?.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::U8 => t.to_vec::<u8>()?,
        DType::I8 => t.to_vec::<i8>()?.iter().map(|&x| x as u8).collect(),
    })
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8]> {
        if self.0.len() < n {
            return Err(DdpError::PolicyState("a rank's policy state is truncated".into()));
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }

    fn u64(&mut self) -> Result<usize> {
        let b = self.take(8)?;
        Ok(u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize)
    }
}

/// The entries [`encode`] wrote.
pub(crate) fn decode(bytes: &[u8]) -> Result<Vec<(String, Tensor)>> {
    let mut r = Reader(bytes);
    let n = r.u64()?;
    let mut out = Vec::with_capacity(n.min(1 << 16));
    for _ in 0..n {
        let len = r.u64()?;
        let name = String::from_utf8_lossy(r.take(len)?).into_owned();
        let dtype = *DType::ALL
            .get(r.u64()?)
            .ok_or_else(|| DdpError::PolicyState(format!("entry '{name}' has an unknown dtype")))?;
        let dims = r.u64()?;
        let shape = (0..dims).map(|_| r.u64()).collect::<Result<Vec<_>>>()?;
        let len = r.u64()?;
        let b = r.take(len)?;
        out.push((name, tensor(dtype, &shape, b)?));
    }
    Ok(out)
}

fn tensor(dtype: DType, shape: &[usize], b: &[u8]) -> Result<Tensor> {
    fn go<T: brigade_tensor::Element, const N: usize>(
        b: &[u8],
        shape: &[usize],
        f: fn([u8; N]) -> T,
    ) -> Result<Tensor> {
        let v: Vec<T> = b.chunks_exact(N).map(|c| f(c.try_into().expect("N bytes"))).collect();
        Ok(Tensor::from_vec(v, shape)?)
    }
    match dtype {
        DType::F32 => go(b, shape, f32::from_le_bytes),
        DType::F64 => go(b, shape, f64::from_le_bytes),
        DType::F16 => go(b, shape, half::f16::from_le_bytes),
        DType::BF16 => go(b, shape, half::bf16::from_le_bytes),
        DType::I64 => go(b, shape, i64::from_le_bytes),
        DType::U8 => go(b, shape, |c: [u8; 1]| c[0]),
        DType::I8 => go(b, shape, i8::from_le_bytes),
    }
}
