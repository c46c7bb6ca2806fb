//! NumPy files: `.npy` (one array) and `.npz` (a zip of named `.npy` arrays, what
//! `numpy.savez` and `numpy.savez_compressed` write), read and written through the `npyz`
//! crate (the format) and the `zip` crate (the archive).
//!
//! Read: float16/32/64 become F16/F32/F64, uint8 U8, int64 I64; the other integers (int8,
//! int16, int32, uint16, uint32, uint64) widen to I64 without loss (a uint64 above `i64::MAX`
//! is an error), bool becomes U8; Fortran-ordered arrays are read in their logical order.
//! Written: every Brigade dtype but BF16, which NumPy has no dtype for. Files are written
//! atomically.
//!
//! ```
//! use brigade_models::{load_npz, save_npz};
//! use brigade_tensor::Tensor;
//!
//! let path = std::env::temp_dir().join(format!("doc-npz-{}.npz", std::process::id()));
//! let x = Tensor::from_vec(vec![1.5f32, -2.0, 0.25, 8.0], &[2, 2]).unwrap();
//! save_npz(&path, &[("x".to_string(), x)]).unwrap();
//! let back = load_npz(&path).unwrap();
//! assert_eq!(back[0].0, "x");
//! assert_eq!(back[0].1.to_vec::<f32>().unwrap(), [1.5, -2.0, 0.25, 8.0]);
//! # std::fs::remove_file(&path).unwrap();
//! ```

use std::io::{Cursor, Read, Write};
use std::path::Path;

use brigade_tensor::{DType, Element, Tensor};
use npyz::{NpyFile, Order, TypeChar, WriterBuilder};

use crate::{ModelError, NamedTensors, Result};

fn npy_err(path: &Path, message: String) -> ModelError {
    ModelError::Npy {
        path: path.to_path_buf(),
        message,
    }
}

/// Reads the one array of a `.npy` file.
pub fn load_npy(path: impl AsRef<Path>) -> Result<Tensor> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|e| ModelError::io(path, format!("cannot read: {e}")))?;
    npy_to_tensor(&bytes).map_err(|m| npy_err(path, m))
}

/// Writes `tensor` to `path` as a `.npy` file (little-endian, C order), atomically.
pub fn save_npy(path: impl AsRef<Path>, tensor: &Tensor) -> Result<()> {
    let path = path.as_ref();
    let bytes = tensor_to_npy(tensor).map_err(|m| npy_err(path, m))?;
    crate::io::write_atomic(path, &bytes).map_err(|e| ModelError::io(path, format!("could not write: {e}")))
}

/// Reads every array of a `.npz` archive, in archive order, named as `numpy.load` names them
/// (the member's name without `.npy`). Members that are not `.npy` files are skipped.
pub fn load_npz(path: impl AsRef<Path>) -> Result<NamedTensors> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|e| ModelError::io(path, format!("cannot read: {e}")))?;
    let mut zip = zip::ZipArchive::new(Cursor::new(bytes))
        .map_err(|e| npy_err(path, format!("not a .npz (zip) archive: {e}")))?;
    let mut out = Vec::with_capacity(zip.len());
    for i in 0..zip.len() {
        let mut member = zip.by_index(i).map_err(|e| npy_err(path, format!("member {i}: {e}")))?;
        let Some(name) = npyz::npz::array_name_from_file_name(member.name()).map(str::to_string) else {
            continue;
        };
        let mut npy = Vec::with_capacity(member.size() as usize);
        member
            .read_to_end(&mut npy)
            .map_err(|e| npy_err(path, format!("array '{name}': {e}")))?;
        let t = npy_to_tensor(&npy).map_err(|m| npy_err(path, format!("array '{name}': {m}")))?;
        out.push((name, t));
    }
    Ok(out)
}

/// Writes `tensors` (names unique) to `path` as a `.npz` archive (uncompressed, like
/// `numpy.savez`), atomically.
pub fn save_npz(path: impl AsRef<Path>, tensors: &[(String, Tensor)]) -> Result<()> {
    let path = path.as_ref();
    let mut zip = zip::ZipWriter::new(Cursor::new(Vec::new()));
    for (i, (name, t)) in tensors.iter().enumerate() {
        if tensors[..i].iter().any(|(n, _)| n == name) {
            return Err(npy_err(
                path,
                format!("array name '{name}' appears twice; names in a .npz must be unique"),
            ));
        }
        let npy = tensor_to_npy(t).map_err(|m| npy_err(path, format!("array '{name}': {m}")))?;
        let options = zip::write::SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Stored)
            .large_file(npy.len() as u64 >= u64::from(u32::MAX));
        zip.start_file(npyz::npz::file_name_from_array_name(name), options)
            .and_then(|()| zip.write_all(&npy).map_err(Into::into))
            .map_err(|e| npy_err(path, format!("array '{name}': {e}")))?;
    }
    let bytes = zip.finish().map_err(|e| npy_err(path, e.to_string()))?.into_inner();
    crate::io::write_atomic(path, &bytes).map_err(|e| ModelError::io(path, format!("could not write: {e}")))
}

/// Refuses a `.npy` header whose shape holds more elements than the file has bytes (every
/// element takes at least one), before `npyz` multiplies the dimensions (which overflows on a
/// shape like `(2**62, 2**62)`) or sizes a buffer by them. A header this cannot read is left
/// to `npyz`'s own error.
fn check_shape_fits(bytes: &[u8]) -> std::result::Result<(), String> {
    // the magic and the version (6 + 2 bytes), then the header's length: 2 bytes little-endian
    // in version 1, 4 in versions 2 and 3
    let width = match bytes.get(6) {
        Some(1) => 2,
        Some(2 | 3) => 4,
        _ => return Ok(()),
    };
    let Some(len) = bytes.get(8..8 + width) else {
        return Ok(());
    };
    let header_len = len.iter().rev().fold(0usize, |acc, &b| acc << 8 | usize::from(b));
    let start = 8 + width;
    let Some(header) = bytes.get(start..start.saturating_add(header_len)) else {
        return Ok(());
    };
    let header = String::from_utf8_lossy(header);
    let Some(tuple) = header
        .split_once("'shape'")
        .and_then(|(_, rest)| rest.split_once('('))
        .and_then(|(_, rest)| rest.split_once(')'))
        .map(|(inside, _)| inside)
    else {
        return Ok(());
    };
    let dims: Vec<u64> = tuple
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .filter_map(|d| d.trim_end_matches('L').parse().ok())
        .collect();
    let elements = dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d));
    match elements {
        Some(n) if n <= bytes.len() as u64 => Ok(()),
        _ => Err(format!(
            "its header's shape ({tuple}) holds more elements than the file's {} bytes (a damaged header?)",
            bytes.len()
        )),
    }
}

/// The tensor of one `.npy` file's bytes (the error without the path).
fn npy_to_tensor(bytes: &[u8]) -> std::result::Result<Tensor, String> {
    check_shape_fits(bytes)?;
    let npy = NpyFile::new(bytes).map_err(|e| format!("{e} (truncated, or not a .npy file?)"))?;
    let npyz::DType::Plain(ts) = npy.dtype() else {
        return Err(format!(
            "structured dtype {} is not supported; save each field as its own array",
            npy.dtype().descr()
        ));
    };
    let shape: Vec<usize> = npy.shape().iter().map(|&d| d as usize).collect();
    let fortran = npy.order() == Order::Fortran && shape.len() > 1;
    // the elements in file order: C order of the reversed shape for a Fortran array
    let file_shape: Vec<usize> = if fortran {
        shape.iter().rev().copied().collect()
    } else {
        shape.clone()
    };
    let read_err = |e: std::io::Error| format!("{e} (truncated?)");
    fn tensor<T: Element>(v: Vec<T>, shape: &[usize]) -> std::result::Result<Tensor, String> {
        Tensor::from_vec(v, shape).map_err(|e| e.to_string())
    }
    fn widen<T: Into<i64>>(v: Vec<T>, shape: &[usize]) -> std::result::Result<Tensor, String> {
        tensor(v.into_iter().map(Into::into).collect::<Vec<i64>>(), shape)
    }
    let t = match (ts.type_char(), ts.size_field()) {
        (TypeChar::Float, 2) => tensor(npy.into_vec::<half::f16>().map_err(read_err)?, &file_shape)?,
        (TypeChar::Float, 4) => tensor(npy.into_vec::<f32>().map_err(read_err)?, &file_shape)?,
        (TypeChar::Float, 8) => tensor(npy.into_vec::<f64>().map_err(read_err)?, &file_shape)?,
        (TypeChar::Int, 1) => widen(npy.into_vec::<i8>().map_err(read_err)?, &file_shape)?,
        (TypeChar::Int, 2) => widen(npy.into_vec::<i16>().map_err(read_err)?, &file_shape)?,
        (TypeChar::Int, 4) => widen(npy.into_vec::<i32>().map_err(read_err)?, &file_shape)?,
        (TypeChar::Int, 8) => tensor(npy.into_vec::<i64>().map_err(read_err)?, &file_shape)?,
        (TypeChar::Uint, 1) => tensor(npy.into_vec::<u8>().map_err(read_err)?, &file_shape)?,
        (TypeChar::Uint, 2) => widen(npy.into_vec::<u16>().map_err(read_err)?, &file_shape)?,
        (TypeChar::Uint, 4) => widen(npy.into_vec::<u32>().map_err(read_err)?, &file_shape)?,
        (TypeChar::Uint, 8) => {
            let v = npy.into_vec::<u64>().map_err(read_err)?;
            if let Some((i, x)) = v.iter().enumerate().find(|(_, &x)| i64::try_from(x).is_err()) {
                return Err(format!(
                    "uint64 value {x} at flat index {i} does not fit in I64 (the integer dtype tensors use)"
                ));
            }
            tensor(v.into_iter().map(|x| x as i64).collect::<Vec<i64>>(), &file_shape)?
        }
        (TypeChar::Bool, 1) => tensor(
            npy.into_vec::<bool>()
                .map_err(read_err)?
                .into_iter()
                .map(u8::from)
                .collect::<Vec<u8>>(),
            &file_shape,
        )?,
        _ => {
            return Err(format!(
                "dtype '{ts}' is not supported; use float16/32/64, int8/16/32/64, uint8/16/32/64 or bool"
            ))
        }
    };
    if !fortran {
        return Ok(t);
    }
    let reverse: Vec<usize> = (0..shape.len()).rev().collect();
    t.permute(&reverse)
        .and_then(|t| t.contiguous())
        .map_err(|e| e.to_string())
}

/// One `.npy` file's bytes for `t` (the error without the path).
fn tensor_to_npy(t: &Tensor) -> std::result::Result<Vec<u8>, String> {
    fn write<T: Element + npyz::AutoSerialize>(t: &Tensor) -> std::result::Result<Vec<u8>, String> {
        let shape: Vec<u64> = t.shape().iter().map(|&d| d as u64).collect();
        let values = t.to_vec::<T>().map_err(|e| e.to_string())?;
        let mut buf = Vec::new();
        let mut w = npyz::WriteOptions::<T>::new()
            .default_dtype()
            .shape(&shape)
            .writer(&mut buf)
            .begin_nd()
            .map_err(|e| e.to_string())?;
        w.extend(values).map_err(|e| e.to_string())?;
        w.finish().map_err(|e| e.to_string())?;
        Ok(buf)
    }
    match t.dtype() {
        DType::F32 => write::<f32>(t),
        DType::F64 => write::<f64>(t),
        DType::F16 => write::<half::f16>(t),
        DType::I64 => write::<i64>(t),
        DType::U8 => write::<u8>(t),
        DType::I8 => write::<i8>(t),
        DType::BF16 => Err("BF16 has no NumPy dtype; convert it to F32 first, or save it as safetensors".into()),
    }
}
