//! Safetensors checkpoints: tensors to and from files, and model parameters checked
//! name by name and shape by shape against a file.

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};

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
        DType::I8 => Dtype::I8,
    }
}

pub(crate) fn from_st_dtype(d: Dtype) -> Option<DType> {
    Some(match d {
        Dtype::F32 => DType::F32,
        Dtype::F64 => DType::F64,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::I64 => DType::I64,
        Dtype::U8 => DType::U8,
        Dtype::I8 => DType::I8,
        _ => return None,
    })
}

/// Little-endian bytes of a tensor's elements in row-major order.
pub(crate) fn tensor_bytes(t: &Tensor) -> Result<Vec<u8>> {
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
        DType::I8 => go::<i8>(t, 1, |x| pad(x.to_le_bytes())),
    }
}

/// A tensor from little-endian bytes.
pub(crate) fn tensor_from_bytes(dtype: DType, shape: &[usize], bytes: &[u8]) -> Result<Tensor> {
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
        DType::I8 => go(bytes, shape, i8::from_le_bytes),
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

    write_atomic(path, &buf)
        .map_err(|e| ModelError::io(path, format!("could not write: {e} ({})", write_error_hint(&e))))
}

/// What to do about a failed write, in words: a full disk and the file size limit (`ulimit
/// -f`, EFBIG once SIGXFSZ is ignored) say so; anything else asks about the directory.
pub fn write_error_hint(e: &std::io::Error) -> &'static str {
    match e.kind() {
        std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded => {
            "disk full: free some space or write elsewhere"
        }
        std::io::ErrorKind::FileTooLarge => "file size limit reached (ulimit -f): raise it or write a smaller file",
        _ => "does the directory exist and is it writable?",
    }
}

/// Numbers the temporary files of this process, so that two writes (from two threads,
/// or of two targets) never share a temporary name.
static TMP_COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The file a write of `path` lands in: `path` itself, or, when `path` is a symbolic
/// link (or a chain of them), the file it points to, so that writing keeps the link.
pub fn write_target(path: &Path) -> std::io::Result<PathBuf> {
    let mut target = path.to_path_buf();
    for _ in 0..40 {
        match std::fs::symlink_metadata(&target) {
            Ok(m) if m.file_type().is_symlink() => {
                let link = std::fs::read_link(&target)?;
                target = match target.parent() {
                    Some(dir) if link.is_relative() => dir.join(link),
                    _ => link,
                };
            }
            _ => return Ok(target),
        }
    }
    Err(std::io::Error::other(format!(
        "{}: too many levels of symbolic links",
        path.display()
    )))
}

/// The prefix of every temporary file of a write of `target`: `.NAME.tmp-`, in the same
/// directory, followed by the writer's process id and a per-process counter.
fn tmp_prefix(target: &Path) -> std::io::Result<(PathBuf, String)> {
    let dir = match target.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = target
        .file_name()
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a file path"))?;
    Ok((dir, format!(".{}.tmp-", name.to_string_lossy())))
}

/// Whether process `pid` is alive (Linux: `/proc/PID`; elsewhere, unknown counts as gone).
fn process_alive(pid: u32) -> bool {
    pid == std::process::id() || Path::new("/proc").join(pid.to_string()).exists()
}

/// Removes the temporary files of `target` that a killed writer left behind
/// (`.NAME.tmp-PID` or `.NAME.tmp-PID-N` whose process is gone). Best effort.
fn remove_stale_temporaries(dir: &Path, prefix: &str) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(prefix)) else {
            continue;
        };
        let Ok(pid) = rest.split('-').next().unwrap_or_default().parse::<u32>() else {
            continue;
        };
        if !process_alive(pid) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// Writes `bytes` to `path` atomically: into a temporary file `.NAME.tmp-PID-N` in the
/// target's directory, synced, then renamed over the target, so that a crash never leaves
/// a half-written file under the real name. A symbolic link is kept: its target is
/// written. Temporary files of the same target left by a killed run are removed first.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let target = write_target(path)?;
    if target.is_dir() {
        return Err(std::io::Error::other("is a directory"));
    }
    let (dir, prefix) = tmp_prefix(&target)?;
    remove_stale_temporaries(&dir, &prefix);
    let n = TMP_COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!("{prefix}{}-{n}", std::process::id()));
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, &target)
    };
    let result = write();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
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
///
/// A training checkpoint (`brigade train --checkpoint`, [`TRAINING_CHECKPOINT_FORMAT`] in its
/// metadata) is read as the state dict of its model: its `model.`-prefixed tensors, the prefix
/// stripped, and its optimizer state left out.
pub fn load_params(store: &ParamStore, path: impl AsRef<Path>) -> Result<()> {
    let path = path.as_ref();
    let (tensors, meta) = load_safetensors_with_metadata(path)?;
    let tensors = if meta.get("format").map(String::as_str) == Some(TRAINING_CHECKPOINT_FORMAT) {
        model_state_of_checkpoint(tensors)
    } else {
        tensors
    };
    load_params_from_tensors(store, &tensors).map_err(|e| e.at_path(path))
}

/// The `format` metadata of a training checkpoint (written by the `brigade` library).
pub const TRAINING_CHECKPOINT_FORMAT: &str = "brigade-checkpoint-v1";

/// The model's tensors of a training checkpoint's: those named `model.NAME`, as `NAME`.
pub fn model_state_of_checkpoint(tensors: NamedTensors) -> NamedTensors {
    tensors
        .into_iter()
        .filter_map(|(n, t)| n.strip_prefix("model.").map(|n| (n.to_string(), t)))
        .collect()
}

/// The multi-index and value of the first NaN or infinity of a float tensor, in
/// row-major order; `None` when every element is finite (or the dtype is an integer).
pub fn first_non_finite(t: &Tensor) -> Result<Option<(Vec<usize>, f64)>> {
    if !t.dtype().is_float() {
        return Ok(None);
    }
    let values = t.to_f64_vec()?;
    let Some(flat) = values.iter().position(|v| !v.is_finite()) else {
        return Ok(None);
    };
    Ok(Some((row_major_index(flat, t.shape()), values[flat])))
}

/// The row-major multi-index of element `flat` of a tensor of `shape`.
pub fn row_major_index(mut flat: usize, shape: &[usize]) -> Vec<usize> {
    let mut index = vec![0; shape.len()];
    for (i, &dim) in shape.iter().enumerate().rev() {
        index[i] = flat % dim.max(1);
        flat /= dim.max(1);
    }
    index
}

/// Errors with [`ModelError::NonFinite`] (naming `path`, the tensor and the first index)
/// unless every float in `tensors` is finite.
pub fn check_finite(path: &Path, tensors: &[(String, Tensor)]) -> Result<()> {
    for (name, t) in tensors {
        if let Some((index, value)) = first_non_finite(t)? {
            return Err(ModelError::NonFinite {
                path: path.to_path_buf(),
                tensor: name.clone(),
                index,
                value,
            });
        }
    }
    Ok(())
}

/// [`load_params`] from tensors already in memory (errors report the path as `<memory>`;
/// [`ModelError::at_path`] puts the file back). A NaN or infinity is refused like a
/// mismatch: nothing is written.
pub fn load_params_from_tensors(store: &ParamStore, tensors: &[(String, Tensor)]) -> Result<()> {
    load_params_checked(store, tensors, true)
}

/// [`load_params_from_tensors`], taking NaN and infinity as any value: for resuming a run
/// that trains on through them (a checkpoint that run wrote holds them).
pub fn load_params_from_tensors_nonfinite(store: &ParamStore, tensors: &[(String, Tensor)]) -> Result<()> {
    load_params_checked(store, tensors, false)
}

/// Loads `tensors` into `store`, refusing a non-finite value when `finite`.
fn load_params_checked(store: &ParamStore, tensors: &[(String, Tensor)], finite: bool) -> Result<()> {
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
        if let Some((index, value)) = if finite { first_non_finite(t)? } else { None } {
            return Err(ModelError::NonFinite {
                path: "<memory>".into(),
                tensor: name.to_string(),
                index,
                value,
            });
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
