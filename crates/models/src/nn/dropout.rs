//! Dropout and its generator: masks drawn from a seed and a count, so that a checkpoint can
//! carry where the generator stands and a resume draws the same masks.

use std::sync::{Arc, Mutex};

use brigade_autograd::{RecomputeState, Var};
use brigade_tensor::{Device, Rng, Tensor};

use crate::{ModelError, Result};

/// What a dropout generator has done: its seed and how many masks it has drawn. Saving it with
/// a checkpoint and restoring it ([`DropoutRng::set_state`]) makes a resume draw the same masks
/// as an uninterrupted run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RngState {
    /// The seed the generator started from.
    pub seed: u64,
    /// Masks drawn so far: mask `i` is a pure function of `(seed, i)`.
    pub offset: u64,
}

/// The generator every [`Dropout`] of one model draws from, in forward order (a per-model
/// stand-in for PyTorch's default generator). Counter-based, so its whole state is a
/// [`RngState`]: mask `i` comes from `(seed, i)` alone. Clones share the state.
#[derive(Debug, Clone)]
pub struct DropoutRng(Arc<Mutex<RngState>>);

impl DropoutRng {
    /// A generator at the start of `seed`'s sequence.
    pub fn new(seed: u64) -> DropoutRng {
        DropoutRng(Arc::new(Mutex::new(RngState { seed, offset: 0 })))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, RngState> {
        // a panic elsewhere cannot leave a half-written (seed, offset): take it as it is
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The current state.
    pub fn state(&self) -> RngState {
        *self.lock()
    }

    /// Continues from `state` (e.g. one read from a checkpoint).
    pub fn set_state(&self, state: RngState) {
        *self.lock() = state;
    }

    /// The generator of the next mask.
    fn next_mask_rng(&self) -> Rng {
        let mut s = self.lock();
        let rng = Rng::new(mix64(s.seed ^ mix64(s.offset.wrapping_add(0x5851_F42D_4C95_7F2D))));
        s.offset += 1;
        rng
    }
}

/// A checkpointed block's recompute draws the masks its forward drew: the generator is put
/// back where it stood before the forward, then where the recompute found it.
impl RecomputeState for DropoutRng {
    type Saved = RngState;
    fn save(&self) -> RngState {
        self.state()
    }
    fn restore(&self, saved: &RngState) {
        self.set_state(*saved);
    }
}

/// SplitMix64's finaliser: a bijection that scatters nearby inputs.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Inverted dropout (`torch.nn.Dropout`): in training mode each element is zeroed with
/// probability `p` and the others scaled by `1/(1 - p)`; in evaluation mode, or at `p = 0`, the
/// input passes through untouched (the same `Var`: no op recorded, the same bits).
#[derive(Clone)]
pub struct Dropout {
    p: f64,
    training: bool,
    rng: DropoutRng,
}

impl Dropout {
    /// Dropout of probability `p` (in `[0, 1]`) drawing its masks from `rng`; in training mode.
    pub fn new(p: f64, rng: &DropoutRng) -> Result<Dropout> {
        if !(0.0..=1.0).contains(&p) {
            return Err(ModelError::Config {
                model: "dropout",
                message: format!("p must be a probability in [0, 1], got {p}"),
            });
        }
        Ok(Dropout {
            p,
            training: true,
            rng: rng.clone(),
        })
    }

    /// Dropout that never drops (`p = 0`).
    pub fn off() -> Dropout {
        Dropout {
            p: 0.0,
            training: true,
            rng: DropoutRng::new(0),
        }
    }

    /// The drop probability.
    pub fn p(&self) -> f64 {
        self.p
    }

    /// True in training mode (the default), false in evaluation mode.
    pub fn is_training(&self) -> bool {
        self.training
    }

    /// Training (drops) or evaluation (identity) mode.
    pub fn set_training(&mut self, training: bool) {
        self.training = training;
    }

    /// `x` with dropout applied (training mode, `p > 0`), or `x` itself.
    pub fn forward(&self, x: &Var) -> Result<Var> {
        if !self.training || self.p == 0.0 {
            return Ok(x.clone());
        }
        let value = x.value();
        let keep = if self.p < 1.0 { 1.0 / (1.0 - self.p) } else { 0.0 };
        let mut rng = self.rng.next_mask_rng();
        let mask: Vec<f64> = (0..value.numel())
            .map(|_| if rng.uniform() < self.p { 0.0 } else { keep })
            .collect();
        let mask = Tensor::from_f64_vec(mask, value.shape(), value.dtype());
        let mask = match value.device() {
            Device::Cpu => mask,
            device => mask.to_device(device)?,
        };
        Ok(x.mul(&Var::constant(mask))?)
    }
}
