//! Parameters drawn from a safetensors file range by range: the file's header is read and
//! checked against the model (names, shapes, float dtypes, as [`crate::load_params`] checks
//! them), and each deferred parameter's recipe becomes its tensor's bytes in the file
//! ([`brigade_autograd::InitDraw::Stored`]), so that a policy drawing only its shard of each
//! parameter (ZeRO-3) reads only those bytes.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use brigade_autograd::{InitDraw, ParamInit, ParamStore};
use brigade_tensor::{DType, Tensor};
use safetensors::tensor::Metadata;

use crate::io::{from_st_dtype, tensor_from_bytes, TRAINING_CHECKPOINT_FORMAT};
use crate::{ModelError, Result};

/// Points every parameter of `store` (each still deferred: registered inside
/// [`brigade_autograd::defer_param_init`]) at its values in the safetensors file `path` (a
/// state dict, or a training checkpoint's `model.` tensors), reading only the file's header.
/// The first mismatch is the error, as [`crate::load_params`] words it; a NaN or infinity is
/// found when the values are drawn.
pub fn defer_params_to_file(store: &ParamStore, path: impl AsRef<Path>) -> Result<()> {
    let path = path.as_ref();
    let (data_start, meta) = read_header(path)?;
    let mismatch = |message: String| ModelError::CheckpointMismatch {
        path: path.to_path_buf(),
        message,
    };
    let prefix = match meta.metadata().as_ref().and_then(|m| m.get("format")) {
        Some(f) if f == TRAINING_CHECKPOINT_FORMAT => "model.",
        _ => "",
    };
    let mut plan = Vec::with_capacity(store.len());
    for p in store.params() {
        let name = p.name().unwrap_or_default();
        let want = p.value();
        let Some(info) = meta.info(&format!("{prefix}{name}")) else {
            return Err(mismatch(format!(
                "missing parameter '{name}' (expected shape {:?})",
                want.shape()
            )));
        };
        if info.shape != want.shape() {
            return Err(mismatch(format!(
                "parameter '{name}': expected shape {:?}, found {:?}",
                want.shape(),
                info.shape
            )));
        }
        let stored = from_st_dtype(info.dtype).filter(|d| d.is_float()).ok_or_else(|| {
            mismatch(format!(
                "parameter '{name}': found dtype {:?}, expected a float dtype",
                info.dtype
            ))
        })?;
        let draw = InitDraw::Stored {
            path: path.to_path_buf(),
            offset: data_start + info.data_offsets.0 as u64,
            dtype: stored,
        };
        plan.push((p, draw));
    }
    let known: HashSet<String> = store
        .params()
        .iter()
        .filter_map(|p| Some(format!("{prefix}{}", p.name()?)))
        .collect();
    let unexpected = meta
        .offset_keys()
        .into_iter()
        .filter(|n| n.starts_with(prefix))
        .find(|n| !known.contains(n));
    if let Some(name) = unexpected {
        return Err(mismatch(format!(
            "unexpected tensor '{}' of shape {:?}: the model has no such parameter",
            &name[prefix.len()..],
            meta.info(&name).map(|i| i.shape.clone()).unwrap_or_default()
        )));
    }
    for (p, draw) in plan {
        let init = ParamInit {
            draw,
            dtype: p.value().dtype(),
            from: 0,
        };
        p.set_deferred_init(init)?;
    }
    Ok(())
}

/// One tensor of a safetensors file as its header places it: what [`stored_tensors`] lists
/// and [`StoredTensor::read`] or [`StoredTensor::recipe`] reads without the rest of the file.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredTensor {
    /// The tensor's name in the file.
    pub name: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its dtype in the file.
    pub dtype: DType,
    /// The file.
    pub path: PathBuf,
    /// The byte of the file its first element starts at.
    pub offset: u64,
}

impl StoredTensor {
    /// The tensor, whole: only its bytes are read from the file.
    pub fn read(&self) -> Result<Tensor> {
        let numel: usize = self.shape.iter().product();
        let mut bytes = vec![0u8; numel * self.dtype.size_in_bytes()];
        File::open(&self.path)
            .and_then(|mut f| {
                f.seek(SeekFrom::Start(self.offset))?;
                f.read_exact(&mut bytes)
            })
            .map_err(|e| ModelError::io(&self.path, format!("cannot read tensor '{}': {e}", self.name)))?;
        tensor_from_bytes(self.dtype, &self.shape, &bytes)
    }

    /// The tensor's values as a recipe that reads any flat range of them from the file
    /// ([`InitDraw::Stored`], each element kept in the file's float dtype); an error for a
    /// tensor of another dtype.
    pub fn recipe(&self) -> Result<ParamInit> {
        if !self.dtype.is_float() {
            return Err(ModelError::Corrupt {
                path: self.path.clone(),
                message: format!("tensor '{}' is {}, expected a float dtype", self.name, self.dtype),
            });
        }
        Ok(ParamInit {
            draw: InitDraw::Stored {
                path: self.path.clone(),
                offset: self.offset,
                dtype: self.dtype,
            },
            dtype: self.dtype,
            from: 0,
        })
    }
}

/// Every tensor of the safetensors file at `path`, in file order, and the file's string
/// metadata, from its header alone: every tensor's bytes are checked to lie inside the file
/// (a truncated file is an error here, before any is read).
pub fn stored_tensors(path: impl AsRef<Path>) -> Result<(Vec<StoredTensor>, HashMap<String, String>)> {
    let path = path.as_ref();
    let (data_start, meta) = read_header(path)?;
    let mut tensors = vec![];
    for name in meta.offset_keys() {
        let info = meta.info(&name).expect("a key of the header");
        let dtype = from_st_dtype(info.dtype).ok_or_else(|| ModelError::Corrupt {
            path: path.to_path_buf(),
            message: format!(
                "tensor '{name}' has dtype {:?}, which Brigade does not read",
                info.dtype
            ),
        })?;
        tensors.push(StoredTensor {
            offset: data_start + info.data_offsets.0 as u64,
            shape: info.shape.clone(),
            dtype,
            path: path.to_path_buf(),
            name,
        });
    }
    Ok((tensors, meta.metadata().clone().unwrap_or_default()))
}

/// The byte where the file's tensor data starts, and its header, checked against the file's
/// length (every tensor's bytes inside the file).
fn read_header(path: &Path) -> Result<(u64, Metadata)> {
    let corrupt = |message: String| ModelError::Corrupt {
        path: path.to_path_buf(),
        message: format!("{message} (truncated or not safetensors? re-save it)"),
    };
    let mut file = File::open(path).map_err(|e| ModelError::io(path, format!("cannot read: {e}")))?;
    let len = file
        .metadata()
        .map_err(|e| ModelError::io(path, format!("cannot read: {e}")))?
        .len();
    let mut n = [0u8; 8];
    file.read_exact(&mut n)
        .map_err(|e| corrupt(format!("no header length: {e}")))?;
    let n = u64::from_le_bytes(n);
    if n.saturating_add(8) > len || n > 100_000_000 {
        return Err(corrupt(format!("a header of {n} bytes in a file of {len}")));
    }
    let mut header = vec![0u8; n as usize];
    file.read_exact(&mut header)
        .map_err(|e| corrupt(format!("cannot read the header: {e}")))?;
    let meta: Metadata = serde_json::from_slice(&header).map_err(|e| corrupt(format!("an unreadable header: {e}")))?;
    let data_start = 8 + n;
    for name in meta.offset_keys() {
        let info = meta.info(&name).expect("a key of the header");
        let size = from_st_dtype(info.dtype).map_or(1, |d| d.size_in_bytes());
        let (s, e) = info.data_offsets;
        let numel: usize = info.shape.iter().product();
        if e < s || e - s != numel * size || data_start + e as u64 > len {
            return Err(corrupt(format!(
                "tensor '{name}': bytes {s}..{e} for {numel} elements, in {} bytes of data",
                len - data_start
            )));
        }
    }
    Ok((data_start, meta))
}
