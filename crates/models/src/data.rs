//! Training data addressed by row, so that data-parallel ranks can each take their own
//! slice: rank `r` of `w` reads `batch(step * w * b + r * b, b)`, or the rows a
//! [`crate::DistributedSampler`] gives it ([`Dataset::gather`]).
//!
//! A dataset is named columns of fixed-size rows (any dtype, any row shape), which become
//! the named tensors of a [`Batch`]. Built in: a teacher-labelled classification set for the
//! MLP and an English-like text corpus for the GPT, both generated from a seed. From files:
//! safetensors, `.npy`/`.npz` ([`Dataset::open`]), checked against the model's
//! [`BatchSchema`] when opened; UTF-8 text with a validation split, as bytes or GPT-2 tokens
//! ([`Dataset::from_text_file`]); llm.c's and nanoGPT's token files, read where they lie
//! ([`Dataset::from_token_files`], [`crate::tokens`]).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use brigade_tensor::{DType, Rng, Tensor};

use crate::batch::first_out_of_range;
use crate::io::{tensor_bytes, tensor_from_bytes};
use crate::tokens::{TokenFormat, TokenStore};
use crate::{Batch, BatchSchema, ModelError, Result, TensorSpec};

/// Hidden width of the random teacher network that labels [`Dataset::teacher`].
pub const TEACHER_HIDDEN: usize = 32;
/// Size of the corpus behind [`Dataset::builtin_text`] (256 KiB).
pub const BUILTIN_TEXT_BYTES: usize = 256 * 1024;

/// One named column: row `r` is the `row_elems` elements from element `r * stride` of its
/// store. `stride < row_elems` lets rows overlap (text windows).
#[derive(Clone)]
struct Column {
    name: String,
    dtype: DType,
    row_shape: Vec<usize>,
    store: Store,
    row_elems: usize,
    stride: usize,
}

/// Where a column's elements are.
#[derive(Clone)]
enum Store {
    /// In memory, little-endian values of the column's dtype.
    Bytes(Vec<u8>),
    /// `uint16` token ids (token files, or GPT-2 tokens of a text), gathered as I64.
    Tokens(TokenStore),
}

impl Column {
    /// The rows of `t [N, ..]`, one per index of dimension 0.
    fn from_tensor(name: &str, t: &Tensor) -> Result<Column> {
        let row_shape = t.shape()[1..].to_vec();
        let row_elems = row_shape.iter().product();
        Ok(Column {
            name: name.to_string(),
            dtype: t.dtype(),
            row_shape,
            store: Store::Bytes(tensor_bytes(t)?),
            row_elems,
            stride: row_elems,
        })
    }

    /// The rows `idx`, stacked: `[idx.len(), ..row_shape]`.
    fn gather(&self, idx: &[usize]) -> Result<Tensor> {
        let mut shape = vec![idx.len()];
        shape.extend_from_slice(&self.row_shape);
        let bytes = match &self.store {
            Store::Bytes(bytes) => bytes,
            Store::Tokens(store) => {
                let mut out = Vec::with_capacity(idx.len() * self.row_elems);
                for &r in idx {
                    store.read_row(r, &mut out)?;
                }
                return Ok(Tensor::from_vec(out, &shape)?);
            }
        };
        let size = self.dtype.size_in_bytes();
        let (row_bytes, stride_bytes) = (self.row_elems * size, self.stride * size);
        let mut out = Vec::with_capacity(idx.len() * row_bytes);
        for &r in idx {
            out.extend_from_slice(&bytes[r * stride_bytes..][..row_bytes]);
        }
        tensor_from_bytes(self.dtype, &shape, &out)
    }

    /// The bytes of a column in memory (none for a token store, which is hashed by its own
    /// rule).
    fn memory_bytes(&self) -> &[u8] {
        match &self.store {
            Store::Bytes(b) => b,
            Store::Tokens(_) => &[],
        }
    }

    /// The elements that some row covers, as a flat tensor (for range checks of columns in
    /// memory).
    fn covered(&self, bytes: &[u8], rows: usize) -> Result<Tensor> {
        let elems = if rows == 0 {
            0
        } else {
            (rows - 1) * self.stride + self.row_elems
        };
        let size = self.dtype.size_in_bytes();
        tensor_from_bytes(self.dtype, &[elems], &bytes[..elems * size])
    }
}

/// A dataset of fixed-size rows in named columns; [`Dataset::batch`] takes consecutive rows,
/// wrapping around at the end, [`Dataset::gather`] any rows.
#[derive(Clone)]
pub struct Dataset {
    name: String,
    columns: Vec<Column>,
    rows: usize,
    /// [`Dataset::fingerprint`], computed once.
    fingerprint: OnceLock<String>,
}

impl std::fmt::Debug for Dataset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Dataset({}, {} rows: {})", self.name, self.len(), self.schema())
    }
}

impl Dataset {
    fn with_columns(name: String, columns: Vec<Column>, rows: usize) -> Dataset {
        Dataset {
            name,
            columns,
            rows,
            fingerprint: OnceLock::new(),
        }
    }

    /// `n_rows` inputs drawn from N(0, 1) in `in_dim` dimensions, labelled with the
    /// argmax of a fixed random teacher `x -> tanh(x W1 + b1) W2` (hidden width
    /// [`TEACHER_HIDDEN`]), all drawn from `seed`. A student MLP can fit it. Columns:
    /// [`BatchSchema::classify`]'s.
    pub fn teacher(n_rows: usize, in_dim: usize, n_classes: usize, seed: u64) -> Result<Dataset> {
        if n_rows == 0 || in_dim == 0 || n_classes < 2 {
            return Err(ModelError::data(
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
        let columns = vec![
            Column::from_tensor("inputs", &Tensor::from_vec(inputs, &[n_rows, in_dim])?)?,
            Column::from_tensor("targets", &Tensor::from_vec(targets, &[n_rows])?)?,
        ];
        Ok(Self::with_columns(format!("teacher(seed {seed})"), columns, n_rows))
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
    /// byte after the first row is a target in two rows. One U8 column, `tokens`.
    pub fn text(bytes: Vec<u8>, context: usize) -> Result<Dataset> {
        Self::text_with_stride(bytes, context, (context / 2).max(1))
    }

    /// Byte-level rows of `context + 1` bytes starting every `stride` bytes. With
    /// `stride = context` each byte after the first is a target exactly once (an evaluation
    /// set); the remainder after the last whole row is not read.
    pub fn text_with_stride(bytes: Vec<u8>, context: usize, stride: usize) -> Result<Dataset> {
        let row_len = context + 1;
        if context == 0 || stride == 0 || bytes.len() < row_len {
            return Err(ModelError::data(
                "text",
                format!(
                    "{} bytes cannot fill one row of context {context} + 1 (stride {stride})",
                    bytes.len()
                ),
            ));
        }
        let rows = (bytes.len() - row_len) / stride + 1;
        let column = Column {
            name: "tokens".into(),
            dtype: DType::U8,
            row_shape: vec![row_len],
            store: Store::Bytes(bytes),
            row_elems: row_len,
            stride,
        };
        Ok(Self::with_columns("text".into(), vec![column], rows))
    }

    /// Rows of `context + 1` token ids starting every `stride` ids of `ids` (e.g. a text's GPT-2
    /// tokens), held as `uint16`: one I64 column, `tokens`. The remainder after the last whole
    /// row is not read.
    pub fn token_ids(name: &str, ids: Vec<u16>, context: usize, stride: usize) -> Result<Dataset> {
        if context == 0 || stride == 0 {
            return Err(ModelError::data(
                name,
                format!("context {context} and stride {stride} must be positive"),
            ));
        }
        Ok(Self::from_store(
            name,
            TokenStore::memory(name, ids, context + 1, stride)?,
        ))
    }

    /// The rows of llm.c's shards (or nanoGPT's raw `uint16` files, `format`
    /// [`TokenFormat::NanoGpt`]; `None` is llm.c's) `paths`, in order: windows of `context + 1`
    /// tokens every `context` tokens within each file, `context` and the vocabulary from
    /// `schema` (the GPT's `tokens`), every id checked below the vocabulary. Each header is
    /// checked (magic, version, the count against the file's length), one error line naming
    /// what is wrong. The files are read by row as batches need them, never whole.
    pub fn from_token_files(
        paths: &[PathBuf],
        format: Option<TokenFormat>,
        schema: impl Into<BatchSchema>,
    ) -> Result<Dataset> {
        let schema = schema.into();
        let shown = paths.first().map_or("token files".into(), |p| p.display().to_string());
        let [spec] = &schema.tensors[..] else {
            return Err(ModelError::data(
                &shown,
                format!("a token file holds one sequence of token ids, but the model reads {schema}"),
            ));
        };
        let (&[row_len], true) = (&spec.row_shape[..], spec.dtypes.contains(&DType::I64)) else {
            return Err(ModelError::data(
                &shown,
                format!("a token file's rows are I64 [N, context + 1], but the model reads {schema}"),
            ));
        };
        if paths.is_empty() || row_len < 2 {
            return Err(ModelError::data(
                &shown,
                "needs at least one file and a context of at least 1".into(),
            ));
        }
        let store = TokenStore::open(paths, format, row_len, row_len - 1)?;
        let mut d = Self::from_store(&store.sources(), store);
        d.columns[0].name = spec.name.clone();
        d.check(&schema)?;
        Ok(d)
    }

    fn from_store(name: &str, store: TokenStore) -> Dataset {
        let row_len = store.row_len();
        let rows = store.len();
        let column = Column {
            name: "tokens".into(),
            dtype: DType::I64,
            row_shape: vec![row_len],
            row_elems: row_len,
            stride: 0, // rows are addressed by the store
            store: Store::Tokens(store),
        };
        Self::with_columns(name.to_string(), vec![column], rows)
    }

    /// The rows `range` as a dataset of their own, named after them (e.g. a validation split):
    /// a view over token files (nothing is read), a copy of rows held in memory.
    pub fn rows(&self, range: std::ops::Range<usize>) -> Result<Dataset> {
        if range.start >= range.end || range.end > self.rows {
            return Err(ModelError::data(
                &self.name,
                format!(
                    "rows {}..{} are not a part of the {} rows",
                    range.start, range.end, self.rows
                ),
            ));
        }
        let name = format!("{} rows {}..{}", self.name, range.start, range.end);
        if let [Column {
            store: Store::Tokens(store),
            name: column,
            ..
        }] = &self.columns[..]
        {
            let mut d = Self::from_store(&name, store.rows(range));
            d.columns[0].name = column.clone();
            return Ok(d);
        }
        let batch = self.gather(&range.collect::<Vec<_>>())?;
        Self::from_tensors(&name, batch.tensors())
    }

    /// A dataset of `tensors` held in memory (a user's own data): each `[N, ..]` with the same
    /// `N >= 1`, names unique, floats finite. Not checked against any model: see
    /// [`Dataset::check`].
    pub fn from_tensors(name: &str, tensors: &[(String, Tensor)]) -> Result<Dataset> {
        let batch = Batch::new(tensors.to_vec()).map_err(|e| ModelError::data(name, e.to_string()))?;
        let schema = BatchSchema::new(
            tensors
                .iter()
                .map(|(n, t)| TensorSpec::new(n, t.dtype(), &t.shape()[1..]))
                .collect(),
        );
        Self::from_checked(name, batch.tensors(), &schema)
    }

    /// The declared tensors of `tensors` after [`BatchSchema::check`], in the schema's order.
    fn from_checked(source: &str, tensors: &[(String, Tensor)], schema: &BatchSchema) -> Result<Dataset> {
        let rows = schema.check(source, tensors)?;
        if rows == 0 {
            return Err(ModelError::data(source, "the data holds no rows".into()));
        }
        let columns = schema
            .tensors
            .iter()
            .map(|spec| {
                let (_, t) = tensors
                    .iter()
                    .find(|(n, _)| *n == spec.name)
                    .expect("checked: every declared tensor is present");
                Column::from_tensor(&spec.name, t)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self::with_columns(source.to_string(), columns, rows))
    }

    /// Reads a dataset from a safetensors file, checked against `schema` (a
    /// [`BatchSchema`], or a `&ModelKind` for its model's: for the MLP `inputs` F32 `[N, in]`
    /// and `targets` I64 `[N]` below the class count, for the GPT `tokens` I64 or U8
    /// `[N, context + 1]` below the vocabulary size). Tensors the schema does not declare are
    /// ignored; a missing one, or one of the wrong dtype or shape, is one error line naming it.
    pub fn from_safetensors(path: impl AsRef<Path>, schema: impl Into<BatchSchema>) -> Result<Dataset> {
        let path = path.as_ref();
        let tensors = crate::io::load_safetensors(path)?;
        Self::from_checked(&path.display().to_string(), &tensors, &schema.into())
    }

    /// Reads a dataset from a NumPy `.npz` archive (one array per declared tensor, by name),
    /// checked against `schema` as [`Dataset::from_safetensors`].
    pub fn from_npz(path: impl AsRef<Path>, schema: impl Into<BatchSchema>) -> Result<Dataset> {
        let path = path.as_ref();
        let tensors = crate::npy::load_npz(path)?;
        Self::from_checked(&path.display().to_string(), &tensors, &schema.into())
    }

    /// Reads a dataset from a NumPy `.npy` file: one array, so only for a schema of one tensor
    /// (the GPT's `tokens`), which it becomes.
    pub fn from_npy(path: impl AsRef<Path>, schema: impl Into<BatchSchema>) -> Result<Dataset> {
        let path = path.as_ref();
        let schema = schema.into();
        let source = path.display().to_string();
        let [spec] = &schema.tensors[..] else {
            return Err(ModelError::data(
                &source,
                format!(
                    "a .npy file holds one array, but the model reads {} tensors ({schema}); save them in one .npz (numpy.savez) or a safetensors file",
                    schema.tensors.len()
                ),
            ));
        };
        let tensor = crate::npy::load_npy(path)?;
        Self::from_checked(&source, &[(spec.name.clone(), tensor)], &schema)
    }

    /// Reads a dataset by the file's extension: `.safetensors`, `.npz` or `.npy`.
    pub fn open(path: impl AsRef<Path>, schema: impl Into<BatchSchema>) -> Result<Dataset> {
        let path = path.as_ref();
        match path.extension().and_then(|e| e.to_str()) {
            Some("npz") => Self::from_npz(path, schema),
            Some("npy") => Self::from_npy(path, schema),
            Some("safetensors") => Self::from_safetensors(path, schema),
            _ => Err(ModelError::data(
                &path.display().to_string(),
                "unknown data format: name a .safetensors, .npz or .npy file (or give UTF-8 text as text)".into(),
            )),
        }
    }

    /// Number of rows.
    pub fn len(&self) -> usize {
        self.rows
    }

    /// True when there are no rows.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// What the rows hold: one [`TensorSpec`] per column (its dtype and row shape; no
    /// index ranges).
    pub fn schema(&self) -> BatchSchema {
        BatchSchema::new(
            self.columns
                .iter()
                .map(|c| TensorSpec::new(&c.name, c.dtype, &c.row_shape))
                .collect(),
        )
    }

    /// Checks the rows against a model's declaration: every declared tensor present, of an
    /// accepted dtype and row shape, indices in range. One error line naming the tensor.
    pub fn check(&self, schema: &BatchSchema) -> Result<()> {
        let err = |message: String| ModelError::data(&self.name, message);
        for spec in &schema.tensors {
            let Some(c) = self.columns.iter().find(|c| c.name == spec.name) else {
                return Err(err(format!(
                    "missing tensor '{}' (the model reads {:?}; the data has {:?})",
                    spec.name,
                    schema.names(),
                    self.schema().names()
                )));
            };
            if !spec.dtypes.contains(&c.dtype) || spec.row_shape != c.row_shape {
                let found = TensorSpec::new(&c.name, c.dtype, &c.row_shape);
                return Err(err(format!(
                    "tensor '{}': expected {} {}, found {} {}",
                    spec.name,
                    spec.dtypes_text(),
                    spec.shape_text(None),
                    found.dtypes_text(),
                    found.shape_text(None)
                )));
            }
            if let (Some(range), Store::Tokens(store)) = (&spec.index_range, &c.store) {
                if let Some((row, v)) = store.first_at_or_above(range.below)? {
                    return Err(err(format!(
                        "tensor '{}': row {row} has {} {v}, expected 0..{}{}",
                        spec.name,
                        range.noun,
                        range.below,
                        if range.below == 256 && v < 50_257 {
                            " (GPT-2's ids? the gpt2 tokenizer's vocabulary is 50257)"
                        } else {
                            ""
                        }
                    )));
                }
            } else if let (Some(range), Store::Bytes(bytes)) = (&spec.index_range, &c.store) {
                if let Some((elem, v)) = first_out_of_range(&c.covered(bytes, self.rows)?, range.below)? {
                    return Err(err(format!(
                        "tensor '{}': row {} has {} {v}, expected 0..{}",
                        spec.name,
                        elem / c.stride,
                        range.noun,
                        range.below
                    )));
                }
            }
        }
        Ok(())
    }

    /// What identifies the rows: their count and a 64-bit FNV-1a hash of their contents,
    /// e.g. `8192 rows, fnv1a 5f1c…`. A checkpoint stores it, so that a resumed run can
    /// refuse data other than what it started on (another file, or another `--seed`). The
    /// hash of classification and token data is the one earlier versions computed.
    ///
    /// Rows read from token files are identified without reading them whole: each file's
    /// length, its first and last 4 KiB (llm.c's header among them) and 32 windows of 4 KiB
    /// between, so that another file, another length or other tokens in those windows is
    /// noticed, and a resume does not read a corpus of gigabytes first.
    pub fn fingerprint(&self) -> &str {
        self.fingerprint.get_or_init(|| self.hash_rows())
    }

    fn hash_rows(&self) -> String {
        if let [Column {
            store: Store::Tokens(store),
            ..
        }] = &self.columns[..]
        {
            const PRIME: u64 = 0x100_0000_01b3;
            let mut h: u64 = 0xcbf2_9ce4_8422_2325;
            let mut eat = |bytes: &[u8]| {
                for &b in bytes {
                    h = (h ^ u64::from(b)).wrapping_mul(PRIME);
                }
            };
            // unreadable now: the rows cannot be read either, and the fingerprint says so
            return match store.fingerprint(&mut eat) {
                Ok(()) => format!("{} rows, fnv1a {h:016x} (sampled)", self.len()),
                Err(e) => format!("{} rows, unreadable ({e})", self.len()),
            };
        }
        let bytes = Column::memory_bytes;
        const PRIME: u64 = 0x100_0000_01b3;
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let mut eat = |bytes: &[u8]| {
            for &b in bytes {
                h = (h ^ u64::from(b)).wrapping_mul(PRIME);
            }
        };
        let u64s = |v: &[usize]| v.iter().flat_map(|&d| (d as u64).to_le_bytes()).collect::<Vec<u8>>();
        let names: Vec<&str> = self.columns.iter().map(|c| c.name.as_str()).collect();
        let dtypes: Vec<DType> = self.columns.iter().map(|c| c.dtype).collect();
        match (&names[..], &dtypes[..]) {
            // the layouts of earlier versions, hashed as they were
            (["inputs", "targets"], [DType::F32, DType::I64])
                if self.columns[0].row_shape.len() == 1 && self.columns[1].row_shape.is_empty() =>
            {
                eat(&u64s(&self.columns[0].row_shape));
                eat(bytes(&self.columns[0]));
                eat(bytes(&self.columns[1]));
            }
            (["tokens"], [DType::U8 | DType::I64]) if self.columns[0].row_shape.len() == 1 => {
                let c = &self.columns[0];
                eat(&u64s(&[c.row_elems, c.stride, self.rows]));
                eat(bytes(c));
            }
            _ => {
                eat(b"brigade columns v1");
                eat(&u64s(&[self.rows]));
                for c in &self.columns {
                    eat(c.name.as_bytes());
                    eat(format!("{:?}", c.dtype).as_bytes());
                    eat(&u64s(&c.row_shape));
                    eat(&u64s(&[c.stride]));
                    eat(bytes(c));
                }
            }
        }
        format!("{} rows, fnv1a {h:016x}", self.len())
    }

    /// Where the data came from, for logs.
    pub fn name(&self) -> &str {
        &self.name
    }

    pub(crate) fn set_name(&mut self, name: String) {
        self.name = name;
    }

    /// Rows `start_row .. start_row + rows`, each taken modulo [`Dataset::len`] (so a
    /// batch may wrap around the end).
    pub fn batch(&self, start_row: usize, rows: usize) -> Result<Batch> {
        if rows == 0 || self.is_empty() {
            return Err(ModelError::data(
                &self.name,
                format!("cannot take {rows} rows from a dataset of {}", self.len()),
            ));
        }
        let n = self.len();
        let idx: Vec<usize> = (0..rows).map(|i| (start_row % n + i) % n).collect();
        self.gather(&idx)
    }

    /// The rows `indices` (in that order, repeats allowed), e.g. those a
    /// [`crate::DistributedSampler`] gives a rank.
    pub fn gather(&self, indices: &[usize]) -> Result<Batch> {
        if indices.is_empty() {
            return Err(ModelError::data(&self.name, "cannot take 0 rows".into()));
        }
        if let Some(&r) = indices.iter().find(|&&r| r >= self.rows) {
            return Err(ModelError::data(
                &self.name,
                format!("row {r} is out of range: the dataset has {} rows", self.rows),
            ));
        }
        let tensors = self
            .columns
            .iter()
            .map(|c| Ok((c.name.clone(), c.gather(indices)?)))
            .collect::<Result<Vec<_>>>()?;
        Batch::new(tensors)
    }
}
