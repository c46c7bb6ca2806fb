//! Per-parameter state a policy keeps across steps, keyed by the parameter's name.

use std::collections::BTreeMap;

use brigade_tensor::Tensor;

use super::{BucketParam, BucketSpan};
use crate::{DdpError, Result};

/// One tensor per parameter that a policy keeps from one step to the next (an error-feedback
/// residual, a warm-start factor), keyed by the parameter's name: it survives DDP's bucket
/// rebuilds and other bucket caps, and its state dict needs no key of the policy's own making.
/// A policy with several kinds of state keeps one `ParamState` per kind. Told the layout
/// ([`ParamState::buckets_built`], from the policy's own), it loads only a state of the
/// model's parameters.
///
/// ```
/// # use brigade_ddp::policy::ParamState;
/// # fn f(residual: &mut ParamState, p: &brigade_ddp::policy::BucketParam, e: brigade_tensor::Tensor) {
/// residual.insert(p, e);              // in reduce, per parameter of the bucket
/// let saved = residual.state_dict();  // in ReducerPolicy::state_dict: one entry per parameter
/// # }
/// ```
#[derive(Debug, Clone, Default)]
pub struct ParamState {
    by_name: BTreeMap<String, Tensor>,
    /// Every bucketed parameter's element count, by name, once a layout was announced.
    params: Option<BTreeMap<String, usize>>,
}

impl ParamState {
    /// The state kept for `param`, if any.
    pub fn get(&self, param: &BucketParam) -> Option<&Tensor> {
        self.by_name.get(&param.name)
    }

    /// Keeps `state` for `param` (replacing what it held).
    pub fn insert(&mut self, param: &BucketParam, state: Tensor) {
        self.by_name.insert(param.name.clone(), state);
    }

    /// True when nothing is kept.
    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }

    /// Every entry, `(parameter name, tensor)`, in name order: what
    /// [`super::ReducerPolicy::state_dict`] returns for a policy with this one kind of state.
    pub fn state_dict(&self) -> Vec<(String, Tensor)> {
        self.by_name.iter().map(|(k, t)| (k.clone(), t.clone())).collect()
    }

    /// Learns the model's parameters from the layout DDP announced (call it from
    /// [`super::ReducerPolicy::buckets_built`]): [`ParamState::load_state_dict`] then refuses
    /// a state of another model.
    pub fn buckets_built(&mut self, buckets: &[BucketSpan]) {
        let params = buckets
            .iter()
            .flat_map(|b| &b.params)
            .map(|p| (p.name.clone(), p.len()));
        self.params = Some(params.collect());
    }

    /// Replaces everything kept with what [`ParamState::state_dict`] gave. Once a layout was
    /// announced ([`ParamState::buckets_built`]), an entry naming no bucketed parameter, or
    /// holding another number of elements than its parameter, is refused (a checkpoint of
    /// another model); before, every entry is taken.
    pub fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> Result<()> {
        if let Some(params) = &self.params {
            for (name, t) in state {
                match params.get(name) {
                    None => {
                        return Err(DdpError::PolicyState(format!(
                            "the policy state holds '{name}', which names no parameter of this model"
                        )))
                    }
                    Some(&n) if n != t.numel() => {
                        return Err(DdpError::PolicyState(format!(
                            "the policy state of '{name}' holds {} elements, the parameter {n}",
                            t.numel()
                        )))
                    }
                    Some(_) => {}
                }
            }
        }
        self.by_name = state.iter().map(|(k, t)| (k.clone(), t.clone())).collect();
        Ok(())
    }
}
