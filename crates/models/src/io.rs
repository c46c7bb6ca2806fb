//! Safetensors checkpoints: tensors to and from files, and model parameters checked
//! name by name and shape by shape against a file.

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::path::Path;

use brigade_autograd::{no_grad, ParamStore};
use brigade_tensor::{DType, Element, Tensor};
use safetensors::{Dtype, SafeTensors};

use crate::{ModelError, Result};

/// Tensors with their names, as in a state dict (file order when read).
pub type NamedTensors = Vec<(String, Tensor)>;

fn to_st_dtype(d: DType) -> Dtype {
    match d {
        DType::F32 => Dtype::F32,
        DType::F64 => Dtype::F64,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::I64 => Dtype::I64,
        DType::U8 => Dtype::U8,
    }
}

fn from_st_dtype(d: Dtype) -> Option<DType> {
    Some(match d {
        Dtype::F32 => DType::F32,
        Dtype::F64 => DType::F64,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::I64 => DType::I64,
        Dtype::U8 => DType::U8,
        _ => return None,
    })
}

/// Little-endian bytes of a tensor's elements in row-major order.
fn tensor_bytes(t: &Tensor) -> Result<Vec<u8>> {
    fn go<T: Element>(t: &Tensor, n: usize, le: impl Fn(T) -> [u8; 8]) -> Result<Vec<u8>> {
        let v = t.to_vec::<T>()?;
        let mut out = Vec::with_capacity(v.len() * n);
        for x in v {
            out.extend_from_slice(&le(x)[..n]);
        }
        Ok(out)
    }
    fn pad<const N: usize>(b: [u8; N]) -> [u8; 8] {
        let mut o = [0u8; 8];
        o[..N].copy_from_slice(&b);
        o
    }
    match t.dtype() {
        DType::F32 => go::<f32>(t, 4, |x| pad(x.to_le_bytes())),
        DType::F64 => go::<f64>(t, 8, |x| x.to_le_bytes()),
        DType::F16 => go::<half::f16>(t, 2, |x| pad(x.to_le_bytes())),
        DType::BF16 => go::<half::bf16>(t, 2, |x| pad(x.to_le_bytes())),
        DType::I64 => go::<i64>(t, 8, |x| x.to_le_bytes()),
        DType::U8 => go::<u8>(t, 1, |x| pad([x])),
    }
}

/// A tensor from little-endian bytes.
fn tensor_from_bytes(dtype: DType, shape: &[usize], bytes: &[u8]) -> Result<Tensor> {
    fn go<T: Element, const N: usize>(bytes: &[u8], shape: &[usize], f: impl Fn([u8; N]) -> T) -> Result<Tensor> {
        let v: Vec<T> = bytes
            .chunks_exact(N)
            .map(|c| f(c.try_into().expect("chunk of N bytes")))
            .collect();
        Ok(Tensor::from_vec(v, shape)?)
    }
    match dtype {
        DType::F32 => go(bytes, shape, f32::from_le_bytes),
        DType::F64 => go(bytes, shape, f64::from_le_bytes),
        DType::F16 => go(bytes, shape, half::f16::from_le_bytes),
        DType::BF16 => go(bytes, shape, half::bf16::from_le_bytes),
        DType::I64 => go(bytes, shape, i64::from_le_bytes),
        DType::U8 => go(bytes, shape, |b: [u8; 1]| b[0]),
    }
}

/// Writes `tensors` (names must be unique) and optional string `metadata` to `path` as
/// safetensors, atomically: the bytes go to a temporary file in the same directory,
/// are synced, and the temporary is renamed over `path`, so a crash never leaves a
/// half-written checkpoint behind under the real name.
pub fn save_safetensors(
    path: impl AsRef<Path>,
    tensors: &[(String, Tensor)],
    metadata: Option<HashMap<String, String>>,
) -> Result<()> {
    let path = path.as_ref();
    let mut seen = HashSet::new();
    let mut encoded = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        if !seen.insert(name.as_str()) {
            return Err(ModelError::io(
                path,
                format!("tensor name '{name}' appears twice; names in a checkpoint must be unique"),
            ));
        }
        encoded.push((
            name.as_str(),
            to_st_dtype(t.dtype()),
            t.shape().to_vec(),
            tensor_bytes(t)?,
        ));
    }
    let views = encoded
        .iter()
        .map(|(name, dt, shape, bytes)| {
            let view = safetensors::tensor::TensorView::new(*dt, shape.clone(), bytes)
                .map_err(|e| ModelError::io(path, format!("tensor '{name}': {e}")))?;
            Ok((*name, view))
        })
        .collect::<Result<Vec<_>>>()?;
    let buf = safetensors::serialize(views, metadata).map_err(|e| ModelError::io(path, e))?;

    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let file_name = path
        .file_name()
        .ok_or_else(|| ModelError::io(path, "not a file path"))?;
    let tmp = dir.join(format!(".{}.tmp-{}", file_name.to_string_lossy(), std::process::id()));
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&buf)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    };
    if let Err(e) = write() {
        let _ = std::fs::remove_file(&tmp);
        return Err(ModelError::io(
            path,
            format!("could not write checkpoint: {e} (does the directory exist and is it writable?)"),
        ));
    }
    Ok(())
}

/// Reads every tensor of a safetensors file, in file order, with its string metadata
/// (empty when the file has none). F32, F64, F16, BF16, I64 and U8 are supported.
pub fn load_safetensors_with_metadata(path: impl AsRef<Path>) -> Result<(NamedTensors, HashMap<String, String>)> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|e| ModelError::io(path, format!("cannot read: {e}")))?;
    let corrupt = |message: String| ModelError::Corrupt {
        path: path.to_path_buf(),
        message,
    };
    let (_, meta) = SafeTensors::read_metadata(&bytes)
        .map_err(|e| corrupt(format!("{e:?} (truncated or not safetensors? re-save it)")))?;
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| corrupt(format!("{e:?} (truncated or not safetensors? re-save it)")))?;
    let mut out = Vec::with_capacity(st.len());
    for name in meta.offset_keys() {
        let view = st
            .tensor(&name)
            .map_err(|e| corrupt(format!("tensor '{name}': {e:?}")))?;
        let dtype = from_st_dtype(view.dtype()).ok_or_else(|| {
            corrupt(format!(
                "tensor '{name}' has dtype {:?}; supported are F32, F64, F16, BF16, I64, U8",
                view.dtype()
            ))
        })?;
        out.push((name, tensor_from_bytes(dtype, view.shape(), view.data())?));
    }
    Ok((out, meta.metadata().clone().unwrap_or_default()))
}

/// Reads every tensor of a safetensors file, in file order.
pub fn load_safetensors(path: impl AsRef<Path>) -> Result<NamedTensors> {
    Ok(load_safetensors_with_metadata(path)?.0)
}

/// Saves a model's parameters (its state dict) to `path`.
pub fn save_params(store: &ParamStore, path: impl AsRef<Path>) -> Result<()> {
    save_safetensors(path, &store.named_values(), None)
}

/// Loads a checkpoint into a model's parameters. Names and shapes must match exactly;
/// the first mismatch (in parameter registration order: a missing name or a shape
/// difference; then any unexpected name in the file) is the error. Values are converted
/// to each parameter's dtype (so an f16/bf16 PyTorch state dict loads) and written in
/// place. Nothing is written unless everything matches.
pub fn load_params(store: &ParamStore, path: impl AsRef<Path>) -> Result<()> {
    let path = path.as_ref();
    load_params_from_tensors(store, &load_safetensors(path)?).map_err(|e| match e {
        ModelError::CheckpointMismatch { message, .. } => ModelError::CheckpointMismatch {
            path: path.to_path_buf(),
            message,
        },
        e => e,
    })
}

/// [`load_params`] from tensors already in memory (errors report the path as `<memory>`).
pub fn load_params_from_tensors(store: &ParamStore, tensors: &[(String, Tensor)]) -> Result<()> {
    let mismatch = |message: String| ModelError::CheckpointMismatch {
        path: "<memory>".into(),
        message,
    };
    let by_name: HashMap<&str, &Tensor> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let mut plan = Vec::with_capacity(store.len());
    for p in store.params() {
        let name = p.name().unwrap_or_default();
        let want = p.value();
        let Some(t) = by_name.get(name) else {
            return Err(mismatch(format!(
                "missing parameter '{name}' (expected shape {:?})",
                want.shape()
            )));
        };
        if t.shape() != want.shape() {
            return Err(mismatch(format!(
                "parameter '{name}': expected shape {:?}, found {:?}",
                want.shape(),
                t.shape()
            )));
        }
        if !t.dtype().is_float() {
            return Err(mismatch(format!(
                "parameter '{name}': found dtype {:?}, expected a float dtype",
                t.dtype()
            )));
        }
        plan.push((want, *t));
    }
    let known: HashSet<&str> = store.params().iter().filter_map(|p| p.name()).collect();
    if let Some((name, t)) = tensors.iter().find(|(n, _)| !known.contains(n.as_str())) {
        return Err(mismatch(format!(
            "unexpected tensor '{name}' of shape {:?}: the model has no such parameter",
            t.shape()
        )));
    }
    no_grad(|| -> Result<()> {
        for (dst, src) in plan {
            dst.copy_from(&src.to_dtype(dst.dtype())?)?;
        }
        Ok(())
    })
}
