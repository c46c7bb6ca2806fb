//! Training data addressed by row, so that data-parallel ranks can each take their own
//! slice: rank `r` of `w` reads `batch(step * w * b + r * b, b)`.
//!
//! Built in: a teacher-labelled classification set for the MLP and an English-like
//! text corpus for the GPT, both generated from a seed; or a safetensors file.

use std::path::Path;

use brigade_tensor::{DType, Rng, Tensor};

use crate::{Batch, ModelError, ModelKind, Result};

/// Hidden width of the random teacher network that labels [`Dataset::teacher`].
pub const TEACHER_HIDDEN: usize = 32;
/// Size of the corpus behind [`Dataset::builtin_text`] (256 KiB).
pub const BUILTIN_TEXT_BYTES: usize = 256 * 1024;

#[derive(Clone)]
enum TokenStore {
    U8(Vec<u8>),
    I64(Vec<i64>),
}

#[derive(Clone)]
enum Rows {
    /// Row `r` is `inputs[r * in_dim..][..in_dim]` with label `targets[r]`.
    Classify {
        inputs: Vec<f32>,
        targets: Vec<i64>,
        in_dim: usize,
    },
    /// Row `r` is `tokens[r * stride..][..row_len]`.
    Tokens {
        tokens: TokenStore,
        row_len: usize,
        stride: usize,
        rows: usize,
    },
}

/// A dataset of fixed-size rows; [`Dataset::batch`] takes consecutive rows, wrapping
/// around at the end.
#[derive(Clone)]
pub struct Dataset {
    name: String,
    rows: Rows,
    /// [`Dataset::fingerprint`], computed once.
    fingerprint: std::sync::OnceLock<String>,
}

impl std::fmt::Debug for Dataset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Dataset({}, {} rows)", self.name, self.len())
    }
}

impl Dataset {
    /// `n_rows` inputs drawn from N(0, 1) in `in_dim` dimensions, labelled with the
    /// argmax of a fixed random teacher `x -> tanh(x W1 + b1) W2` (hidden width
    /// [`TEACHER_HIDDEN`]), all drawn from `seed`. A student MLP can fit it.
    pub fn teacher(n_rows: usize, in_dim: usize, n_classes: usize, seed: u64) -> Result<Dataset> {
        if n_rows == 0 || in_dim == 0 || n_classes < 2 {
            return Err(data_err(
                "teacher",
                format!("needs n_rows > 0, in_dim > 0 and n_classes >= 2 (got {n_rows}, {in_dim}, {n_classes})"),
            ));
        }
        let mut rng = Rng::new(seed ^ 0x7EAC_0E55);
        let h = TEACHER_HIDDEN;
        let w1: Vec<f64> = (0..in_dim * h).map(|_| rng.normal() / (in_dim as f64).sqrt()).collect();
        let b1: Vec<f64> = (0..h).map(|_| 0.1 * rng.normal()).collect();
        let w2: Vec<f64> = (0..h * n_classes).map(|_| rng.normal()).collect();
        let mut rng = Rng::new(seed);
        let inputs: Vec<f32> = (0..n_rows * in_dim).map(|_| rng.normal() as f32).collect();
        let mut targets = Vec::with_capacity(n_rows);
        let mut hidden = vec![0.0f64; h];
        for x in inputs.chunks_exact(in_dim) {
            for (j, hj) in hidden.iter_mut().enumerate() {
                let s: f64 = x.iter().enumerate().map(|(i, &xi)| xi as f64 * w1[i * h + j]).sum();
                *hj = (s + b1[j]).tanh();
            }
            let logit = |c: usize| {
                hidden
                    .iter()
                    .enumerate()
                    .map(|(j, &hj)| hj * w2[j * n_classes + c])
                    .sum::<f64>()
            };
            let best = (0..n_classes)
                .map(|c| (c, logit(c)))
                .fold((0, f64::NEG_INFINITY), |a, b| if b.1 > a.1 { b } else { a });
            targets.push(best.0 as i64);
        }
        Ok(Dataset {
            name: format!("teacher(seed {seed})"),
            rows: Rows::Classify {
                inputs,
                targets,
                in_dim,
            },
            fingerprint: Default::default(),
        })
    }

    /// The built-in English-like corpus ([`BUILTIN_TEXT_BYTES`] bytes generated from
    /// `seed`: sentences from a small grammar over a few hundred words), cut into rows
    /// of `context + 1` bytes as by [`Dataset::text`].
    pub fn builtin_text(context: usize, seed: u64) -> Result<Dataset> {
        let bytes = crate::corpus::english_like(seed, BUILTIN_TEXT_BYTES);
        let mut d = Self::text(bytes, context)?;
        d.name = format!("builtin_text(seed {seed})");
        Ok(d)
    }

    /// Byte-level rows over `bytes`: row `r` is `bytes[r*s .. r*s + context + 1]` with
    /// stride `s = max(context / 2, 1)`, so consecutive rows overlap by half and every
    /// byte after the first row is a target in two rows. Rows are U8.
    pub fn text(bytes: Vec<u8>, context: usize) -> Result<Dataset> {
        let row_len = context + 1;
        if context == 0 || bytes.len() < row_len {
            return Err(data_err(
                "text",
                format!("{} bytes cannot fill one row of context {context} + 1", bytes.len()),
            ));
        }
        let stride = (context / 2).max(1);
        let rows = (bytes.len() - row_len) / stride + 1;
        Ok(Dataset {
            name: "text".into(),
            rows: Rows::Tokens {
                tokens: TokenStore::U8(bytes),
                row_len,
                stride,
                rows,
            },
            fingerprint: Default::default(),
        })
    }

    /// Reads a dataset for `kind` from a safetensors file: for the MLP, `inputs` (F32
    /// `[N, in]`) and `targets` (I64 `[N]`, each below the class count); for the GPT,
    /// `tokens` (I64 or U8 `[N, context + 1]`, each below the vocabulary size).
    pub fn from_safetensors(path: impl AsRef<Path>, kind: &ModelKind) -> Result<Dataset> {
        let path = path.as_ref();
        let source = path.display().to_string();
        let err = |m: String| data_err(&source, m);
        let tensors = crate::io::load_safetensors(path)?;
        let get = |name: &str| -> Result<&Tensor> {
            let names: Vec<&str> = tensors.iter().map(|(n, _)| n.as_str()).collect();
            tensors.iter().find(|(n, _)| n == name).map(|(_, t)| t).ok_or_else(|| {
                err(format!(
                    "missing tensor '{name}' (a {} dataset needs it; the file has {names:?})",
                    kind.name()
                ))
            })
        };
        let rows = match kind {
            ModelKind::Mlp(cfg) => {
                let (inputs, targets) = (get("inputs")?, get("targets")?);
                let in_dim = cfg.in_dim();
                if inputs.dtype() != DType::F32 || inputs.rank() != 2 || inputs.shape()[1] != in_dim {
                    return Err(err(format!(
                        "tensor 'inputs': expected F32 [N, {in_dim}], found {:?} {:?}",
                        inputs.dtype(),
                        inputs.shape()
                    )));
                }
                let n = inputs.shape()[0];
                if targets.dtype() != DType::I64 || targets.shape() != [n] {
                    return Err(err(format!(
                        "tensor 'targets': expected I64 [{n}] (one label per input row), found {:?} {:?}",
                        targets.dtype(),
                        targets.shape()
                    )));
                }
                crate::io::check_finite(path, &[("inputs".to_string(), inputs.clone())])?;
                let targets = targets.to_vec::<i64>()?;
                let classes = cfg.n_classes() as i64;
                if let Some((i, t)) = targets.iter().enumerate().find(|(_, &t)| t < 0 || t >= classes) {
                    return Err(err(format!(
                        "tensor 'targets': row {i} has label {t}, expected 0..{classes}"
                    )));
                }
                Rows::Classify {
                    inputs: inputs.to_vec::<f32>()?,
                    targets,
                    in_dim,
                }
            }
            ModelKind::Gpt(cfg) => {
                let tokens = get("tokens")?;
                let row_len = cfg.context + 1;
                if tokens.rank() != 2
                    || tokens.shape()[1] != row_len
                    || !matches!(tokens.dtype(), DType::I64 | DType::U8)
                {
                    return Err(err(format!(
                        "tensor 'tokens': expected I64 or U8 [N, {row_len}] (context {} + 1), found {:?} {:?}",
                        cfg.context,
                        tokens.dtype(),
                        tokens.shape()
                    )));
                }
                let store = match tokens.dtype() {
                    DType::U8 => TokenStore::U8(tokens.to_vec::<u8>()?),
                    _ => TokenStore::I64(tokens.to_vec::<i64>()?),
                };
                let vocab = cfg.vocab as i64;
                let bad = match &store {
                    TokenStore::U8(v) => v
                        .iter()
                        .position(|&t| i64::from(t) >= vocab)
                        .map(|i| (i, i64::from(v[i]))),
                    TokenStore::I64(v) => v.iter().position(|&t| t < 0 || t >= vocab).map(|i| (i, v[i])),
                };
                if let Some((i, t)) = bad {
                    return Err(err(format!(
                        "tensor 'tokens': row {} has token {t}, expected 0..{vocab}",
                        i / row_len
                    )));
                }
                Rows::Tokens {
                    tokens: store,
                    row_len,
                    stride: row_len,
                    rows: tokens.shape()[0],
                }
            }
        };
        let d = Dataset {
            name: source.clone(),
            rows,
            fingerprint: Default::default(),
        };
        if d.is_empty() {
            return Err(err("the file holds no rows".into()));
        }
        Ok(d)
    }

    /// Number of rows.
    pub fn len(&self) -> usize {
        match &self.rows {
            Rows::Classify { targets, .. } => targets.len(),
            Rows::Tokens { rows, .. } => *rows,
        }
    }

    /// True when there are no rows.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// What identifies the rows: their count and a 64-bit FNV-1a hash of their contents,
    /// e.g. `8192 rows, fnv1a 5f1c…`. A checkpoint stores it, so that a resumed run can
    /// refuse data other than what it started on (another file, or another `--seed`).
    pub fn fingerprint(&self) -> &str {
        self.fingerprint.get_or_init(|| self.hash_rows())
    }

    fn hash_rows(&self) -> String {
        const PRIME: u64 = 0x100_0000_01b3;
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let mut eat = |bytes: &[u8]| {
            for &b in bytes {
                h = (h ^ u64::from(b)).wrapping_mul(PRIME);
            }
        };
        match &self.rows {
            Rows::Classify {
                inputs,
                targets,
                in_dim,
            } => {
                eat(&(*in_dim as u64).to_le_bytes());
                inputs.iter().for_each(|x| eat(&x.to_bits().to_le_bytes()));
                targets.iter().for_each(|t| eat(&t.to_le_bytes()));
            }
            Rows::Tokens {
                tokens,
                row_len,
                stride,
                rows,
            } => {
                for d in [*row_len, *stride, *rows] {
                    eat(&(d as u64).to_le_bytes());
                }
                match tokens {
                    TokenStore::U8(v) => eat(v),
                    TokenStore::I64(v) => v.iter().for_each(|t| eat(&t.to_le_bytes())),
                }
            }
        }
        format!("{} rows, fnv1a {h:016x}", self.len())
    }

    /// Where the data came from, for logs.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Rows `start_row .. start_row + rows`, each taken modulo [`Dataset::len`] (so a
    /// batch may wrap around the end).
    pub fn batch(&self, start_row: usize, rows: usize) -> Result<Batch> {
        if rows == 0 || self.is_empty() {
            return Err(data_err(
                &self.name,
                format!("cannot take {rows} rows from a dataset of {}", self.len()),
            ));
        }
        let n = self.len();
        let idx = (0..rows).map(|i| (start_row % n + i) % n);
        Ok(match &self.rows {
            Rows::Classify {
                inputs,
                targets,
                in_dim,
            } => {
                let mut x = Vec::with_capacity(rows * in_dim);
                let mut y = Vec::with_capacity(rows);
                for r in idx {
                    x.extend_from_slice(&inputs[r * in_dim..(r + 1) * in_dim]);
                    y.push(targets[r]);
                }
                Batch::Classify {
                    inputs: Tensor::from_vec(x, &[rows, *in_dim])?,
                    targets: Tensor::from_vec(y, &[rows])?,
                }
            }
            Rows::Tokens {
                tokens,
                row_len,
                stride,
                ..
            } => {
                fn gather<T: brigade_tensor::Element>(
                    v: &[T],
                    idx: impl Iterator<Item = usize>,
                    rows: usize,
                    len: usize,
                    stride: usize,
                ) -> Result<Tensor> {
                    let mut out = Vec::with_capacity(rows * len);
                    for r in idx {
                        out.extend_from_slice(&v[r * stride..r * stride + len]);
                    }
                    Ok(Tensor::from_vec(out, &[rows, len])?)
                }
                let tokens = match tokens {
                    TokenStore::U8(v) => gather(v, idx, rows, *row_len, *stride)?,
                    TokenStore::I64(v) => gather(v, idx, rows, *row_len, *stride)?,
                };
                Batch::Tokens { tokens }
            }
        })
    }
}

fn data_err(source: &str, message: String) -> ModelError {
    ModelError::Data {
        source_name: source.to_string(),
        message,
    }
}
