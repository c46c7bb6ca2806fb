//! How the trainer gets each rank's communication hook: a hook holds one rank's state (error
//! feedback, PowerSGD's factors), so a run carries a recipe, [`MakeCommHook`], and every rank
//! makes its own. A built-in [`HookSpec`] is one recipe, and so is any closure
//! `Fn(rank) -> Arc<dyn CommHook>`: that is where a user's own reducer policy plugs in.

use std::sync::Arc;

use brigade_ddp::hooks::{CommHook, HookSpec};

use crate::error::Result;

/// Makes one rank's [`CommHook`] (called once per rank, on that rank).
pub trait MakeCommHook: Send + Sync {
    /// A new hook for `rank`.
    fn make(&self, rank: usize) -> Result<Arc<dyn CommHook>>;
}

impl MakeCommHook for HookSpec {
    fn make(&self, _rank: usize) -> Result<Arc<dyn CommHook>> {
        Ok(self.build()?)
    }
}

impl<F> MakeCommHook for F
where
    F: Fn(usize) -> Arc<dyn CommHook> + Send + Sync,
{
    fn make(&self, rank: usize) -> Result<Arc<dyn CommHook>> {
        Ok(self(rank))
    }
}
