//! What goes into a model: a [`Batch`] of named tensors, and the [`BatchSchema`] a model
//! declares for them (names, dtypes, per-row shapes, index ranges), checked when data is
//! opened so that a wrong file is one error line naming the tensor, not a NaN at step 300.
//!
//! Like a PyTorch collate function's dict: any names, any dtypes, any shapes, every tensor
//! with one row per example along dimension 0. [`BatchSchema::classify`] and
//! [`BatchSchema::tokens`] are the ready-made declarations of the built-in MLP and GPT;
//! [`Batch::classify`] and [`Batch::tokens`] build their batches.
//!
//! ```
//! use brigade_models::{Batch, BatchSchema, TensorSpec};
//! use brigade_tensor::{DType, Tensor};
//!
//! // A regression model declares F32 targets of 2 values per row.
//! let schema = BatchSchema::new(vec![
//!     TensorSpec::new("inputs", DType::F32, &[3]),
//!     TensorSpec::new("targets", DType::F32, &[2]),
//! ]);
//! let good = Batch::new(vec![
//!     ("inputs".into(), Tensor::zeros(&[4, 3], DType::F32)),
//!     ("targets".into(), Tensor::zeros(&[4, 2], DType::F32)),
//! ])
//! .unwrap();
//! assert!(schema.check_batch(&good).is_ok());
//! let wrong = Batch::classify(Tensor::zeros(&[4, 3], DType::F32), Tensor::zeros(&[4], DType::I64));
//! let e = schema.check_batch(&wrong).unwrap_err().to_string();
//! assert!(e.contains("tensor 'targets': expected F32 [4, 2]") && e.contains("found I64 [4]"), "{e}");
//! ```

use std::fmt;

use brigade_tensor::{DType, Tensor};

use crate::{ModelError, Result};

/// One batch: named tensors, each with one row per example along dimension 0.
///
/// The names are the model's to choose ([`BatchSchema`] declares them); the built-in MLP reads
/// `inputs` and `targets`, the GPT reads `tokens`.
#[derive(Debug, Clone)]
pub struct Batch {
    tensors: Vec<(String, Tensor)>,
}

impl Batch {
    /// A batch of `tensors` (at least one, names unique, all of rank >= 1 with the same number
    /// of rows), in the given order.
    pub fn new(tensors: Vec<(String, Tensor)>) -> Result<Batch> {
        let bad = |message: String| ModelError::BadBatch {
            model: "batch",
            message,
        };
        let Some((first, t0)) = tensors.first() else {
            return Err(bad("a batch needs at least one tensor".into()));
        };
        let rows = t0.shape().first().copied();
        for (i, (name, t)) in tensors.iter().enumerate() {
            if tensors[..i].iter().any(|(n, _)| n == name) {
                return Err(bad(format!("tensor name '{name}' appears twice")));
            }
            if t.rank() == 0 || t.shape().first().copied() != rows {
                return Err(bad(format!(
                    "tensor '{name}' has shape {:?}; every tensor needs the {} rows of '{first}' along dimension 0",
                    t.shape(),
                    rows.unwrap_or(0)
                )));
            }
        }
        Ok(Batch { tensors })
    }

    /// A classification batch, [`BatchSchema::classify`]'s tensors: `inputs [B, in]` (F32) and
    /// `targets [B]` (I64 class indices). Not checked here: the model (or
    /// [`BatchSchema::check_batch`]) says what is wrong.
    pub fn classify(inputs: Tensor, targets: Tensor) -> Batch {
        Batch {
            tensors: vec![("inputs".into(), inputs), ("targets".into(), targets)],
        }
    }

    /// A next-token batch, [`BatchSchema::tokens`]'s tensor: `tokens [B, ctx + 1]` (I64 or U8);
    /// a language model reads `tokens[:, :-1]` and predicts `tokens[:, 1:]`
    /// ([`Batch::shifted_tokens`]). Not checked here.
    pub fn tokens(tokens: Tensor) -> Batch {
        Batch {
            tensors: vec![("tokens".into(), tokens)],
        }
    }

    /// Number of rows (examples or sequences): dimension 0 of the first tensor.
    pub fn rows(&self) -> usize {
        self.tensors
            .first()
            .and_then(|(_, t)| t.shape().first().copied())
            .unwrap_or(0)
    }

    /// The tensor named `name`, if the batch has it.
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.tensors.iter().find(|(n, _)| n == name).map(|(_, t)| t)
    }

    /// The tensor named `name`, or [`ModelError::WrongBatch`] naming `model`, the tensor and
    /// the names the batch has.
    pub fn tensor(&self, model: &'static str, name: &str) -> Result<&Tensor> {
        self.get(name).ok_or_else(|| ModelError::WrongBatch {
            model,
            missing: name.to_string(),
            found: self.names().iter().map(|n| n.to_string()).collect(),
        })
    }

    /// The tensors with their names, in order.
    pub fn tensors(&self) -> &[(String, Tensor)] {
        &self.tensors
    }

    /// The names, in order.
    pub fn names(&self) -> Vec<&str> {
        self.tensors.iter().map(|(n, _)| n.as_str()).collect()
    }

    /// The tensors with their names, in order.
    pub fn into_tensors(self) -> Vec<(String, Tensor)> {
        self.tensors
    }

    /// The same names with each tensor replaced by `f(name, tensor)` (e.g. moved to a device).
    pub fn try_map<E>(
        self,
        mut f: impl FnMut(&str, Tensor) -> std::result::Result<Tensor, E>,
    ) -> std::result::Result<Batch, E> {
        let tensors = self
            .tensors
            .into_iter()
            .map(|(n, t)| {
                let t = f(&n, t)?;
                Ok((n, t))
            })
            .collect::<std::result::Result<_, E>>()?;
        Ok(Batch { tensors })
    }

    /// The `tokens` of a next-token batch shifted for a language model: the inputs
    /// `tokens[:, :-1]` `[B, T]` (contiguous, dtype kept) and the targets `tokens[:, 1:]` as I64
    /// `[B * T]`, ready for a cross-entropy over `[B * T, vocab]` logits. `model` names the
    /// model in the errors (no `tokens`, or rows of fewer than 2 tokens).
    pub fn shifted_tokens(&self, model: &'static str) -> Result<(Tensor, Tensor)> {
        let tokens = self.tensor(model, "tokens")?;
        if tokens.rank() != 2 || tokens.shape()[1] < 2 {
            return Err(ModelError::BadBatch {
                model,
                message: format!(
                    "tokens have shape {:?}, expected [batch, context + 1] with at least 2 columns",
                    tokens.shape()
                ),
            });
        }
        let (b, n) = (tokens.shape()[0], tokens.shape()[1]);
        let inputs = tokens.narrow(1, 0, n - 1)?.contiguous()?;
        let targets = tokens
            .narrow(1, 1, n - 1)?
            .to_dtype(DType::I64)?
            .reshape(&[b * (n - 1)])?;
        Ok((inputs, targets))
    }
}

/// Integer values of a tensor must be indices below `below` (class labels, token ids).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexRange {
    /// Every value must be in `0..below`.
    pub below: u64,
    /// What one value is, for errors: `label`, `token`.
    pub noun: &'static str,
}

/// One tensor a model reads from each batch: its name, the dtypes it accepts, the shape of
/// one row (the tensor is `[N, ..row_shape]`), and optionally the range of its values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// The name in the batch and in data files.
    pub name: String,
    /// Accepted dtypes (at least one; the first is the preferred one).
    pub dtypes: Vec<DType>,
    /// Shape of one row: `[]` for one value per row, `[in]` for a vector.
    pub row_shape: Vec<usize>,
    /// Integer values must lie in this range (checked when data is opened).
    pub index_range: Option<IndexRange>,
}

impl TensorSpec {
    /// A tensor `name` of `dtype` with rows of `row_shape`.
    pub fn new(name: &str, dtype: DType, row_shape: &[usize]) -> TensorSpec {
        TensorSpec {
            name: name.to_string(),
            dtypes: vec![dtype],
            row_shape: row_shape.to_vec(),
            index_range: None,
        }
    }

    /// Accepts `dtypes` instead (e.g. tokens as I64 or U8).
    pub fn with_dtypes(mut self, dtypes: &[DType]) -> TensorSpec {
        self.dtypes = dtypes.to_vec();
        self
    }

    /// Requires every value to be an index in `0..below`; `noun` names one value in errors.
    pub fn with_index_range(mut self, below: u64, noun: &'static str) -> TensorSpec {
        self.index_range = Some(IndexRange { below, noun });
        self
    }

    /// `F32`, `I64 or U8`.
    pub(crate) fn dtypes_text(&self) -> String {
        let names: Vec<String> = self.dtypes.iter().map(|d| format!("{d:?}")).collect();
        names.join(" or ")
    }

    /// `[N, 5]` (rows unknown) or `[4, 5]` (rows fixed by an earlier tensor).
    pub(crate) fn shape_text(&self, rows: Option<usize>) -> String {
        let mut dims = vec![rows.map_or("N".to_string(), |r| r.to_string())];
        dims.extend(self.row_shape.iter().map(|d| d.to_string()));
        format!("[{}]", dims.join(", "))
    }
}

/// What a model reads from each batch: its [`TensorSpec`]s, in order. Data is checked
/// against it when opened ([`BatchSchema::check`]); tensors it does not declare are ignored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchSchema {
    /// The declared tensors, in the order batches hold them.
    pub tensors: Vec<TensorSpec>,
}

impl BatchSchema {
    /// A schema of these tensors.
    pub fn new(tensors: Vec<TensorSpec>) -> BatchSchema {
        BatchSchema { tensors }
    }

    /// Classification, the MLP's: `inputs` F32 `[N, in_dim]` and `targets` I64 `[N]`, each a
    /// class index below `n_classes`.
    pub fn classify(in_dim: usize, n_classes: usize) -> BatchSchema {
        BatchSchema::new(vec![
            TensorSpec::new("inputs", DType::F32, &[in_dim]),
            TensorSpec::new("targets", DType::I64, &[]).with_index_range(n_classes as u64, "label"),
        ])
    }

    /// Next-token prediction, the GPT's: `tokens` I64 or U8 `[N, context + 1]`, each below
    /// `vocab`.
    pub fn tokens(context: usize, vocab: usize) -> BatchSchema {
        BatchSchema::new(vec![TensorSpec::new("tokens", DType::I64, &[context + 1])
            .with_dtypes(&[DType::I64, DType::U8])
            .with_index_range(vocab as u64, "token")])
    }

    /// The declared names, in order.
    pub fn names(&self) -> Vec<&str> {
        self.tensors.iter().map(|s| s.name.as_str()).collect()
    }

    /// Checks `tensors` (a file's, in any order, extra ones allowed) against the declaration:
    /// every declared tensor present, of an accepted dtype and shape `[N, ..row_shape]` with
    /// the same `N` for all, floats finite, indices in range. Returns `N`. The error is
    /// [`ModelError::Data`] naming `source` and the first offending tensor, expected versus
    /// found, in one line.
    pub fn check(&self, source: &str, tensors: &[(String, Tensor)]) -> Result<usize> {
        let err = |message: String| ModelError::Data {
            source_name: source.to_string(),
            message,
        };
        let mut rows: Option<(usize, &str)> = None;
        for spec in &self.tensors {
            let Some((_, t)) = tensors.iter().find(|(n, _)| *n == spec.name) else {
                let have: Vec<&str> = tensors.iter().map(|(n, _)| n.as_str()).collect();
                return Err(err(format!(
                    "missing tensor '{}' (the model reads {:?}; found {have:?})",
                    spec.name,
                    self.names()
                )));
            };
            let shape_ok = t.rank() == spec.row_shape.len() + 1
                && t.shape()[1..] == spec.row_shape[..]
                && rows.is_none_or(|(n, _)| t.shape()[0] == n);
            if !spec.dtypes.contains(&t.dtype()) || !shape_ok {
                let after = rows.map_or(String::new(), |(_, first)| format!(" (one row per row of '{first}')"));
                return Err(err(format!(
                    "tensor '{}': expected {} {}{after}, found {:?} {:?}",
                    spec.name,
                    spec.dtypes_text(),
                    spec.shape_text(rows.map(|(n, _)| n)),
                    t.dtype(),
                    t.shape()
                )));
            }
            rows.get_or_insert((t.shape()[0], &spec.name));
            if let Some((index, value)) = crate::io::first_non_finite(t)? {
                return Err(err(format!(
                    "tensor '{}' holds {value} at index {index:?}; every value must be finite",
                    spec.name
                )));
            }
            if let Some(range) = &spec.index_range {
                check_indices(&spec.name, t, range).map_err(err)?;
            }
        }
        Ok(rows.map_or(0, |(n, _)| n))
    }

    /// [`BatchSchema::check`] on a batch (source `batch`).
    pub fn check_batch(&self, batch: &Batch) -> Result<()> {
        self.check("batch", batch.tensors()).map(|_| ())
    }
}

impl fmt::Display for BatchSchema {
    /// `inputs: F32 [N, 512], targets: I64 [N] (label < 10)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, s) in self.tensors.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{}: {} {}", s.name, s.dtypes_text(), s.shape_text(None))?;
            if let Some(r) = &s.index_range {
                write!(f, " ({} < {})", r.noun, r.below)?;
            }
        }
        Ok(())
    }
}

/// The first value of `t` outside `range`, as `row R has NOUN V, expected 0..B`.
fn check_indices(name: &str, t: &Tensor, range: &IndexRange) -> std::result::Result<(), String> {
    let row_len = t.shape()[1..].iter().product::<usize>().max(1);
    match first_out_of_range(t, range.below).map_err(|e| e.to_string())? {
        Some((i, v)) => Err(format!(
            "tensor '{name}': row {} has {} {v}, expected 0..{}",
            i / row_len,
            range.noun,
            range.below
        )),
        None => Ok(()),
    }
}

/// The flat index and value of the first element of an integer tensor outside `0..below`
/// (`None` for float tensors, which hold no indices).
pub(crate) fn first_out_of_range(t: &Tensor, below: u64) -> Result<Option<(usize, i64)>> {
    Ok(match t.dtype() {
        DType::U8 => {
            let v = t.to_vec::<u8>()?;
            v.iter()
                .position(|&x| u64::from(x) >= below)
                .map(|i| (i, i64::from(v[i])))
        }
        DType::I64 => {
            let v = t.to_vec::<i64>()?;
            v.iter().position(|&x| x < 0 || x as u64 >= below).map(|i| (i, v[i]))
        }
        _ => None,
    })
}
