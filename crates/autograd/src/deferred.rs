//! Parameters registered before their values exist (PyTorch's meta-device construction, as
//! FSDP starts a model too large for one rank): the parameter's tensor has its shape and dtype
//! but no storage, and its [`ParamInit`] draws any flat range of its initial values on demand,
//! bit for bit what the whole draw gives there. A policy that shards the parameters (ZeRO-3)
//! draws only its rank's shard of each, so no rank ever holds the whole model.
//!
//! Models register this way inside [`defer_param_init`] (the layers ask
//! [`param_init_deferred`]); [`Var::materialize`] draws a deferred parameter whole, and
//! [`Var::set_value`] (a load) ends the deferral. A recipe is data (a distribution and where
//! the generator stood), written and read back as one line ([`ParamInit::describe`],
//! [`ParamInit::parse`]), so that every rank can draw from rank 0's.

use std::cell::Cell;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use brigade_tensor::{DType, Rng, Tensor};

use crate::{AutogradError, Optimizer, Result, Var};

/// The distribution of a deferred parameter's elements, or the file that holds them.
#[derive(Debug, Clone, PartialEq)]
pub enum InitDraw {
    /// `N(0, std²)`: two generator outputs per element (Box-Muller, [`Tensor::randn`]).
    Normal {
        /// The standard deviation.
        std: f64,
    },
    /// `U(lo, hi)`: one generator output per element ([`Tensor::rand_uniform`]).
    Uniform {
        /// The lower bound.
        lo: f64,
        /// The upper bound.
        hi: f64,
    },
    /// Every element `value` (no draw).
    Full {
        /// The value.
        value: f64,
    },
    /// The elements stored in a file, little-endian, from byte `offset` on (a safetensors
    /// tensor's data): a range is read from the file, never the whole tensor.
    Stored {
        /// The file.
        path: PathBuf,
        /// The byte offset of the first element in the file.
        offset: u64,
        /// The dtype stored (each element converted to the parameter's).
        dtype: DType,
    },
}

/// The recipe of a deferred parameter's initial values: its elements in order, drawn from a
/// generator standing at `from` when the parameter's first element is drawn.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamInit {
    /// The distribution.
    pub draw: InitDraw,
    /// The parameter's dtype (each element rounded from f64 to it).
    pub dtype: DType,
    /// [`Rng::position`] before the first element's draw.
    pub from: u64,
}

impl ParamInit {
    /// The recipe of drawing the parameter from `rng` as it stands now.
    pub fn new(draw: InitDraw, dtype: DType, rng: &Rng) -> ParamInit {
        ParamInit {
            draw,
            dtype,
            from: rng.position(),
        }
    }

    /// Generator outputs each element takes.
    pub fn outputs_per_element(&self) -> u64 {
        match self.draw {
            InitDraw::Normal { .. } => 2,
            InitDraw::Uniform { .. } => 1,
            InitDraw::Full { .. } | InitDraw::Stored { .. } => 0,
        }
    }

    /// Elements `start..start + len` of the parameter's flattened initial values, as a 1-d
    /// tensor of its dtype on the CPU. Stored elements are read from their file (an error for
    /// a file that cannot be read there, or a NaN or infinity among them).
    pub fn draw(&self, start: usize, len: usize) -> Result<Tensor> {
        let mut rng = Rng::at(self.from);
        rng.skip(self.outputs_per_element() * start as u64);
        Ok(match &self.draw {
            &InitDraw::Normal { std } => Tensor::randn(&[len], std, self.dtype, &mut rng),
            &InitDraw::Uniform { lo, hi } => Tensor::rand_uniform(&[len], lo, hi, self.dtype, &mut rng),
            &InitDraw::Full { value } => Tensor::full(&[len], value, self.dtype),
            InitDraw::Stored { path, offset, dtype } => {
                read_stored(path, *offset, *dtype, start, len)?.to_dtype(self.dtype)?
            }
        })
    }

    /// One line that [`ParamInit::parse`] reads back to the same recipe
    /// (`normal 0.02 f32 @1234`).
    pub fn describe(&self) -> String {
        let (dtype, from) = (self.dtype, self.from);
        match &self.draw {
            InitDraw::Normal { std } => format!("normal {std} {dtype} @{from}"),
            InitDraw::Uniform { lo, hi } => format!("uniform {lo} {hi} {dtype} @{from}"),
            InitDraw::Full { value } => format!("full {value} {dtype} @{from}"),
            InitDraw::Stored {
                path,
                offset,
                dtype: stored,
            } => {
                format!("stored {offset} {stored} {dtype} @{from} {}", path.display())
            }
        }
    }

    /// The recipe [`ParamInit::describe`] wrote.
    pub fn parse(line: &str) -> Result<ParamInit> {
        let bad = || AutogradError::Invalid(format!("not a parameter's initialisation recipe: '{line}'"));
        let words: Vec<&str> = line.split_whitespace().collect();
        let num = |w: &str| f64::from_str(w).map_err(|_| bad());
        let dtype_of = |w: &str| DType::from_str(w).map_err(|_| bad());
        if let ["stored", offset, stored, dtype, from, ..] = words.as_slice() {
            // the path is the rest of the line, spaces and all
            let path = line.splitn(6, ' ').nth(5).filter(|p| !p.is_empty()).ok_or_else(bad)?;
            return Ok(ParamInit {
                draw: InitDraw::Stored {
                    path: PathBuf::from(path),
                    offset: offset.parse().map_err(|_| bad())?,
                    dtype: dtype_of(stored)?,
                },
                dtype: dtype_of(dtype)?,
                from: from.strip_prefix('@').and_then(|f| f.parse().ok()).ok_or_else(bad)?,
            });
        }
        let (draw, rest) = match words.as_slice() {
            ["normal", std, rest @ ..] => (InitDraw::Normal { std: num(std)? }, rest),
            ["uniform", lo, hi, rest @ ..] => (
                InitDraw::Uniform {
                    lo: num(lo)?,
                    hi: num(hi)?,
                },
                rest,
            ),
            ["full", value, rest @ ..] => (InitDraw::Full { value: num(value)? }, rest),
            _ => return Err(bad()),
        };
        let [dtype, from] = rest else { return Err(bad()) };
        Ok(ParamInit {
            draw,
            dtype: DType::from_str(dtype).map_err(|_| bad())?,
            from: from.strip_prefix('@').and_then(|f| f.parse().ok()).ok_or_else(bad)?,
        })
    }
}

thread_local! {
    static DEFER: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` (a model's construction) with parameter initialisation deferred on this thread:
/// the layers register each parameter without values ([`crate::ParamStore::add_deferred`]).
pub fn defer_param_init<T>(f: impl FnOnce() -> T) -> T {
    /// Restores the previous mode even if `f` panics.
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            DEFER.with(|d| d.set(self.0));
        }
    }
    let _restore = Restore(DEFER.with(|d| d.replace(true)));
    f()
}

/// Elements `start..start + len` of a tensor stored in `path` from byte `offset` on, as `dtype`:
/// only their bytes are read.
fn read_stored(path: &Path, offset: u64, dtype: DType, start: usize, len: usize) -> Result<Tensor> {
    let size = dtype.size_in_bytes();
    let fail = |what: String| AutogradError::Invalid(format!("{}: {what}", path.display()));
    let mut bytes = vec![0u8; len * size];
    let at = offset + (start * size) as u64;
    File::open(path)
        .and_then(|mut f| {
            f.seek(SeekFrom::Start(at))?;
            f.read_exact(&mut bytes)
        })
        .map_err(|e| fail(format!("cannot read {} bytes at byte {at}: {e}", bytes.len())))?;
    fn words<const N: usize>(bytes: &[u8]) -> impl Iterator<Item = [u8; N]> + '_ {
        bytes.chunks_exact(N).map(|c| c.try_into().expect("chunk of N bytes"))
    }
    let t = match dtype {
        DType::F32 => Tensor::from_vec(words(&bytes).map(f32::from_le_bytes).collect::<Vec<_>>(), &[len])?,
        DType::F64 => Tensor::from_vec(words(&bytes).map(f64::from_le_bytes).collect::<Vec<_>>(), &[len])?,
        DType::F16 => Tensor::from_vec(words(&bytes).map(half::f16::from_le_bytes).collect::<Vec<_>>(), &[len])?,
        DType::BF16 => Tensor::from_vec(words(&bytes).map(half::bf16::from_le_bytes).collect::<Vec<_>>(), &[len])?,
        other => {
            return Err(fail(format!(
                "a stored parameter of dtype {other}: expected a float dtype"
            )))
        }
    };
    let values = t.to_dtype(DType::F64)?.to_vec::<f64>()?;
    if let Some(i) = values.iter().position(|v| !v.is_finite()) {
        return Err(AutogradError::NonFiniteStored {
            path: path.to_path_buf(),
            offset,
            element: start + i,
            value: values[i],
        });
    }
    Ok(t)
}

/// Whether parameters registered now on this thread should be deferred ([`defer_param_init`]).
pub fn param_init_deferred() -> bool {
    DEFER.with(Cell::get)
}

impl Var {
    /// The recipe of this parameter's initial values while they are not drawn yet (`None` once
    /// they are, or for a parameter registered with its values).
    pub fn deferred_init(&self) -> Option<ParamInit> {
        let info = self.0.param.as_ref()?;
        info.init.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Replaces the recipe of a parameter still deferred (every rank drawing rank 0's); an
    /// error for one that holds its values, or a recipe of another dtype.
    pub fn set_deferred_init(&self, init: ParamInit) -> Result<()> {
        let name = self.name().unwrap_or("<unnamed>");
        let (Some(info), true) = (&self.0.param, self.deferred_init().is_some()) else {
            return Err(AutogradError::Invalid(format!(
                "parameter '{name}' holds its values: it has no recipe to replace"
            )));
        };
        if init.dtype != self.value().dtype() {
            return Err(AutogradError::Invalid(format!(
                "parameter '{name}' is {}, the recipe draws {}",
                self.value().dtype(),
                init.dtype
            )));
        }
        *info.init.lock().unwrap_or_else(|e| e.into_inner()) = Some(init);
        Ok(())
    }

    /// Draws a deferred parameter's whole initial values into its tensor (a no-op for a
    /// parameter that has its values).
    pub fn materialize(&self) -> Result<()> {
        let Some(init) = self.deferred_init() else {
            return Ok(());
        };
        let value = self.value();
        let whole = init.draw(0, value.numel())?.to_device(value.device())?;
        value.restore_storage(whole.lend_storage()?)?;
        self.end_deferral();
        Ok(())
    }

    /// Forgets the recipe: the parameter holds (or is about to hold) its values, or a policy
    /// drew the part of them it keeps ([`crate::defer_param_init`]).
    pub fn end_deferral(&self) {
        if let Some(info) = &self.0.param {
            *info.init.lock().unwrap_or_else(|e| e.into_inner()) = None;
        }
    }
}

/// An optimizer state entry whose values are still in a file: its name (as
/// [`Optimizer::state_dict`] names it), its shape and the recipe that reads any flat range of
/// it ([`InitDraw::Stored`]).
#[derive(Debug, Clone, PartialEq)]
pub struct StoredState {
    /// The entry's name (`<param>.exp_avg`, `step`).
    pub name: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Where its values are.
    pub init: ParamInit,
}

impl StoredState {
    /// The entry's values, whole, in its shape.
    pub fn read(&self) -> Result<Tensor> {
        let numel = self.shape.iter().product();
        Ok(self.init.draw(0, numel)?.reshape(&self.shape)?)
    }
}

/// An optimizer resumed with its state left in the checkpoint file (a resume under a policy
/// that keeps only each rank's shard of the state, ZeRO-3): the entries are listed by
/// [`Optimizer::state_in_file`], and a policy that shards the state reads its ranges of them
/// and nothing more. Whatever else asks for the state ([`Optimizer::state_dict`], a step of
/// this optimizer itself) reads it whole first, so the wrapper is the inner optimizer resumed,
/// only later.
pub struct StateInFile {
    inner: Box<dyn Optimizer>,
    entries: Vec<StoredState>,
}

impl StateInFile {
    /// `inner` (built, not stepped), its state `entries` in a file.
    pub fn new(inner: Box<dyn Optimizer>, entries: Vec<StoredState>) -> StateInFile {
        StateInFile { inner, entries }
    }

    /// Every entry read whole.
    fn whole(&self) -> Result<Vec<(String, Tensor)>> {
        self.entries.iter().map(|e| Ok((e.name.clone(), e.read()?))).collect()
    }

    /// Loads the entries whole into the inner optimizer (once).
    fn load_whole(&mut self) -> Result<()> {
        if !self.entries.is_empty() {
            let state = self.whole()?;
            self.inner.load_state_dict(&state)?;
            self.entries.clear();
        }
        Ok(())
    }
}

impl Optimizer for StateInFile {
    fn step(&mut self) -> Result<()> {
        self.load_whole()?;
        self.inner.step()
    }

    fn params(&self) -> &[Var] {
        self.inner.params()
    }

    fn lr(&self) -> f64 {
        self.inner.lr()
    }

    fn set_lr(&mut self, lr: f64) {
        self.inner.set_lr(lr);
    }

    /// The state read whole from the file (the inner optimizer's once it was loaded).
    fn state_dict(&self) -> Result<Vec<(String, Tensor)>> {
        match self.entries.is_empty() {
            true => self.inner.state_dict(),
            false => self.whole(),
        }
    }

    /// Replaces the state in the file by `state`.
    fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> Result<()> {
        self.entries.clear();
        self.inner.load_state_dict(state)
    }

    fn state_bytes(&self) -> Result<usize> {
        self.inner.state_bytes()
    }

    fn state_in_file(&self) -> &[StoredState] {
        &self.entries
    }

    fn consolidate_state(&mut self) -> Result<()> {
        self.inner.consolidate_state()
    }

    fn master_weights(&self) -> Vec<(String, Tensor)> {
        self.inner.master_weights()
    }

    fn loss_scale(&self) -> Option<f64> {
        self.inner.loss_scale()
    }

    fn skipped_steps(&self) -> u64 {
        self.inner.skipped_steps()
    }

    fn grad_scaler(&self) -> Option<crate::GradScaler> {
        self.inner.grad_scaler()
    }
}

#[cfg(test)]
mod tests {
    use super::{InitDraw, ParamInit};
    use brigade_tensor::{DType, Rng};

    #[test]
    fn a_recipe_reads_back_from_its_line() {
        let rng = Rng::new(9);
        for draw in [
            InitDraw::Normal { std: 0.02 },
            InitDraw::Uniform {
                lo: -0.1,
                hi: 1.0 / 3.0,
            },
            InitDraw::Full { value: 1.0 },
            InitDraw::Stored {
                path: "a dir/with  spaces.safetensors".into(),
                offset: 120,
                dtype: DType::BF16,
            },
        ] {
            let init = ParamInit::new(draw, DType::F32, &rng);
            assert_eq!(ParamInit::parse(&init.describe()).unwrap(), init);
        }
        assert!(ParamInit::parse("normal x f32 @1").is_err());
        assert!(ParamInit::parse("normal 0.1 f32").is_err());
        assert!(ParamInit::parse("stored 8 f32 f32 @0").is_err());
    }

    /// An optimizer whose state is left in a file reads it whole when asked for it or stepped
    /// itself: the same state and the same step as the optimizer that wrote it.
    #[test]
    fn an_optimizer_with_its_state_in_a_file_steps_as_the_one_that_wrote_it() {
        use super::{StateInFile, StoredState};
        use crate::{AdamW, Optimizer, ParamStore};
        use brigade_tensor::Tensor;
        let params = |values: &[f32]| {
            let mut store = ParamStore::new();
            store
                .add("w", Tensor::from_vec(values.to_vec(), &[2, 2]).unwrap())
                .unwrap();
            store.params().to_vec()
        };
        let grad = |p: &crate::Var, g: f32| {
            let t = Tensor::from_vec(vec![g, -g, 2.0 * g, 0.5], &[2, 2]).unwrap();
            p.set_grad(Some(t)).unwrap();
        };
        let start = [0.5f32, -1.0, 2.0, 0.25];
        let (written, later) = (params(&start), params(&start));
        let mut opt = AdamW::new(written.clone(), 1e-2);
        grad(&written[0], 0.3);
        opt.step().unwrap();
        let state = opt.state_dict().unwrap();
        // every entry's bytes, one after another, in a file: f64 `step`, f32 moments
        let path = std::env::temp_dir().join(format!("brigade-state-in-file-{}.bin", std::process::id()));
        let _scratch = crate::scratch::Scratch::absent(path.clone());
        let (mut bytes, mut entries) = (vec![], vec![]);
        for (name, t) in &state {
            let dtype = t.dtype();
            let draw = InitDraw::Stored {
                path: path.clone(),
                offset: bytes.len() as u64,
                dtype,
            };
            match dtype {
                DType::F64 => bytes.extend(t.to_vec::<f64>().unwrap().iter().flat_map(|v| v.to_le_bytes())),
                _ => bytes.extend(t.to_vec::<f32>().unwrap().iter().flat_map(|v| v.to_le_bytes())),
            }
            let init = ParamInit { draw, dtype, from: 0 };
            entries.push(StoredState {
                name: name.clone(),
                shape: t.shape().to_vec(),
                init,
            });
        }
        std::fs::write(&path, &bytes).unwrap();
        later[0].set_value(written[0].value().copy().unwrap()).unwrap();
        let mut in_file = StateInFile::new(Box::new(AdamW::new(later.clone(), 1e-2)), entries.clone());
        assert_eq!(in_file.state_in_file(), entries.as_slice());
        let bits = |s: Vec<(String, Tensor)>| -> Vec<(String, Vec<u64>)> {
            (s.into_iter())
                .map(|(n, t)| (n, t.to_f64_vec().unwrap().iter().map(|v| v.to_bits()).collect()))
                .collect()
        };
        assert_eq!(bits(in_file.state_dict().unwrap()), bits(state));
        for (p, o) in [(&written[0], &mut opt as &mut dyn Optimizer), (&later[0], &mut in_file)] {
            grad(p, -0.7);
            o.step().unwrap();
        }
        assert!(in_file.state_in_file().is_empty(), "loaded whole by its own step");
        let values = |p: &crate::Var| p.value().to_vec::<f32>().unwrap();
        assert_eq!(values(&later[0]), values(&written[0]));
        assert_eq!(bits(in_file.state_dict().unwrap()), bits(opt.state_dict().unwrap()));
    }

    #[test]
    fn a_stored_recipe_reads_its_range_of_the_file_and_refuses_a_nan() {
        let path = std::env::temp_dir().join(format!("brigade-stored-{}.bin", std::process::id()));
        let _scratch = crate::scratch::Scratch::absent(path.clone());
        let values = [1.5f32, -2.0, 0.25, 8.0, f32::NAN];
        let mut bytes = vec![7u8; 5]; // bytes before the tensor
        bytes.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        std::fs::write(&path, &bytes).unwrap();
        let init = ParamInit {
            draw: InitDraw::Stored {
                path: path.clone(),
                offset: 5,
                dtype: DType::F32,
            },
            dtype: DType::F32,
            from: 0,
        };
        assert_eq!(init.draw(1, 3).unwrap().to_vec::<f32>().unwrap(), [-2.0, 0.25, 8.0]);
        let e = init.draw(2, 3).unwrap_err().to_string();
        assert!(e.contains("element 4") && e.contains("NaN"), "{e}");
        assert!(init.draw(3, 4).is_err(), "past the file's end");
    }
}
