//! Parameters registered before their values exist (PyTorch's meta-device construction, as
//! FSDP starts a model too large for one rank): the parameter's tensor has its shape and dtype
//! but no storage, and a [`ParamInit`] draws any flat range of its initial values on demand,
//! bit for bit what the whole draw would give there. A policy that shards the parameters
//! (ZeRO-3) draws only its rank's shard of each, so no rank ever holds the whole model.
//!
//! Models register this way inside [`defer_param_init`] (the layers ask
//! [`param_init_deferred`]); [`Var::materialize`] draws a deferred parameter whole, and
//! [`Var::set_value`] (a load) ends the deferral.

use std::cell::Cell;
use std::fmt;
use std::sync::Arc;

use brigade_tensor::Tensor;

use crate::{Result, Var};

/// The recipe of a deferred parameter's initial values.
#[derive(Clone)]
pub struct ParamInit {
    describe: String,
    draw: Arc<dyn Fn(usize, usize) -> Result<Tensor> + Send + Sync>,
}

impl fmt::Debug for ParamInit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ParamInit({})", self.describe)
    }
}

impl ParamInit {
    /// `draw(start, len)` gives elements `start..start + len` of the parameter's flattened
    /// values (a 1-d tensor of its dtype on the CPU); `describe` names the recipe so that ranks
    /// can tell whether they would draw the same values (the same description must mean the
    /// same values: a generator's state, a distribution and its parameters).
    pub fn new(
        describe: impl Into<String>,
        draw: impl Fn(usize, usize) -> Result<Tensor> + Send + Sync + 'static,
    ) -> Self {
        ParamInit {
            describe: describe.into(),
            draw: Arc::new(draw),
        }
    }

    /// What the ranks compare (`normal std=0.02 from Rng { state: .. }`).
    pub fn describe(&self) -> &str {
        &self.describe
    }

    /// Elements `start..start + len` of the parameter's flattened initial values.
    pub fn draw(&self, start: usize, len: usize) -> Result<Tensor> {
        (self.draw)(start, len)
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

    /// Draws a deferred parameter's whole initial values into its tensor (a no-op for a
    /// parameter that has its values).
    pub fn materialize(&self) -> Result<()> {
        let Some(init) = self.deferred_init() else {
            return Ok(());
        };
        let value = self.value();
        let whole = init.draw(0, value.numel())?;
        value.restore_storage(whole.contiguous()?.lend_storage()?)?;
        self.end_deferral();
        Ok(())
    }

    /// Forgets the recipe: the parameter holds (or is about to hold) its values.
    pub(crate) fn end_deferral(&self) {
        if let Some(info) = &self.0.param {
            *info.init.lock().unwrap_or_else(|e| e.into_inner()) = None;
        }
    }
}
