//! Parameters: named leaves with stable registration indices, sharing one gradient bus.

use std::sync::{Arc, Mutex};

use brigade_tensor::{DType, Tensor};

use crate::{AutogradError, GradBus, ParamInit, Result, Var};

/// What makes a leaf a parameter.
#[derive(Clone)]
pub(crate) struct ParamInfo {
    pub(crate) index: usize,
    pub(crate) name: String,
    pub(crate) bus: GradBus,
    /// The recipe of its initial values while they are not drawn ([`crate::deferred`]).
    pub(crate) init: Arc<Mutex<Option<ParamInit>>>,
}

/// The parameters of one model (one rank's replica), in registration order, with the
/// bus their gradient-ready events go to.
#[derive(Clone, Default)]
pub struct ParamStore {
    params: Vec<Var>,
    /// Each parameter's unit: the module scope whose forward reads it (see [`ParamStore::set_unit`]).
    units: Vec<Option<String>>,
    bus: GradBus,
}

impl ParamStore {
    /// An empty store with a fresh bus.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers a parameter; names must be unique.
    pub fn add(&mut self, name: impl Into<String>, value: Tensor) -> Result<Var> {
        self.register(name.into(), value, None)
    }

    /// Registers a parameter of `shape` and `dtype` whose values are not drawn yet: its tensor
    /// holds no storage until `init` draws them, whole ([`Var::materialize`]) or a shard at a
    /// time by a policy that shards the parameters ([`crate::ParamInit`]).
    pub fn add_deferred(
        &mut self,
        name: impl Into<String>,
        shape: &[usize],
        dtype: DType,
        init: ParamInit,
    ) -> Result<Var> {
        self.register(name.into(), Tensor::unallocated(shape, dtype), Some(init))
    }

    fn register(&mut self, name: String, value: Tensor, init: Option<ParamInit>) -> Result<Var> {
        if self.get(&name).is_some() {
            return Err(AutogradError::Invalid(format!("parameter '{name}' registered twice")));
        }
        let info = ParamInfo {
            index: self.params.len(),
            name,
            bus: self.bus.clone(),
            init: Arc::new(Mutex::new(init)),
        };
        let v = Var::new_inner(value, true, None, Some(info));
        self.params.push(v.clone());
        self.units.push(None);
        Ok(v)
    }

    /// Names the unit of parameter `name`: the module scope ([`crate::scope`], e.g. `blocks.0`)
    /// under which the model's forward reads it. Units are what a sharding policy gathers and
    /// frees as one (ZeRO-3): every op that reads the parameter must run inside that scope.
    pub fn set_unit(&mut self, name: &str, unit: &str) -> Result<()> {
        let index = self
            .params
            .iter()
            .position(|p| p.name() == Some(name))
            .ok_or_else(|| AutogradError::Invalid(format!("set_unit: no parameter '{name}'")))?;
        if unit.is_empty() {
            return Err(AutogradError::Invalid(format!("set_unit: empty unit for '{name}'")));
        }
        self.units[index] = Some(unit.to_string());
        Ok(())
    }

    /// The unit of the parameter registered `index`-th, if one was set ([`ParamStore::set_unit`]).
    pub fn unit(&self, index: usize) -> Option<&str> {
        self.units.get(index).and_then(|u| u.as_deref())
    }

    /// All parameters in registration order.
    pub fn params(&self) -> &[Var] {
        &self.params
    }

    /// The parameter called `name`.
    pub fn get(&self, name: &str) -> Option<&Var> {
        self.params.iter().find(|p| p.name() == Some(name))
    }

    /// Number of parameters.
    pub fn len(&self) -> usize {
        self.params.len()
    }

    /// True when no parameter is registered.
    pub fn is_empty(&self) -> bool {
        self.params.is_empty()
    }

    /// Total number of scalar elements.
    pub fn numel(&self) -> usize {
        self.params.iter().map(|p| p.value().numel()).sum()
    }

    /// The bus that backward announces these parameters' gradients on.
    pub fn bus(&self) -> &GradBus {
        &self.bus
    }

    /// Zeroes every gradient in place (buffers stay where they are).
    pub fn zero_grad(&self) -> Result<()> {
        self.params.iter().try_for_each(Var::zero_grad)
    }

    /// Drops every gradient, as PyTorch's `zero_grad(set_to_none=True)`: the next backward
    /// keeps each parameter's first gradient as the op produced it instead of adding it to
    /// zeros (a step saves the fill and an add over all parameters). Not for parameters
    /// whose gradient is a bucket view (DDP): [`ParamStore::zero_grad`] keeps those in place.
    pub fn set_grads_to_none(&self) -> Result<()> {
        self.params.iter().try_for_each(|p| p.set_grad(None))
    }

    /// `(name, value)` pairs in registration order.
    pub fn named_values(&self) -> Vec<(String, Tensor)> {
        self.params
            .iter()
            .map(|p| (p.name().unwrap_or_default().to_string(), p.value()))
            .collect()
    }
}
