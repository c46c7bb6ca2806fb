//! Activation checkpointing: a scope that keeps only its input through forward and
//! recomputes its own forward inside backward, right before its own backward runs
//! (`torch.utils.checkpoint` with `use_reentrant=False`).
//!
//! The unit's forward runs once as usual; then its graph is dropped, so every tensor its ops
//! saved is freed, and one `checkpoint` node stands in for it, holding the unit's input and
//! the leaves (parameters) the forward read. When backward reaches that node it restores the
//! state the forward drew from ([`RecomputeState`]: a dropout generator), runs the forward
//! again under the same scope path, puts the state back, and runs the recomputed graph's
//! backward: the parameters' gradients are added into their `.grad` in the same order as
//! without checkpointing, and the outer pass counts each parameter's contribution as coming
//! from the `checkpoint` node, so the gradient-ready bus announces each parameter once, after
//! the unit's backward. The gradients are those of the uncheckpointed graph bit for bit when
//! the recompute draws what the forward drew and the unit's input has no other consumer (a
//! gradient reaching the input from outside is then added to the unit's in one sum instead of
//! term by term).

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use brigade_tensor::Tensor;

use crate::backward::GradSubscriber;
use crate::backward::{propagate, reachable};
use crate::var::{current_scope, rerun_in_scope, NEXT_ID};
use crate::{is_grad_enabled, scope, AutogradError, GradBus, Result, Var};

/// State a checkpointed forward draws from (a dropout generator, as PyTorch's
/// `preserve_rng_state`): saved before the forward, restored for its recompute inside
/// backward, and put back afterwards to where the recompute found it.
pub trait RecomputeState: Send + Sync + 'static {
    /// What [`RecomputeState::save`] keeps.
    type Saved: Send + Sync + 'static;
    /// The state now.
    fn save(&self) -> Self::Saved;
    /// Continues from `saved`.
    fn restore(&self, saved: &Self::Saved);
}

/// A forward that draws nothing at random.
impl RecomputeState for () {
    type Saved = ();
    fn save(&self) {}
    fn restore(&self, _: &()) {}
}

/// Runs `forward(input)` under the scope `name` (as [`scope`]) flagged for activation
/// checkpointing: through forward the unit keeps only `input` (and the leaves it reads);
/// backward recomputes `forward` from `input`, with `state` restored to what it was here,
/// right before the unit's own backward. `forward` must compute from `input`, parameters and
/// constants only (an error names the op otherwise), and must be a pure function of them and
/// `state`. Without a graph being recorded ([`crate::no_grad`]) this is [`scope`].
pub fn checkpoint_scope<S, E, F>(name: &str, input: &Var, state: S, forward: F) -> std::result::Result<Var, E>
where
    S: RecomputeState,
    E: From<AutogradError> + std::error::Error + Send + Sync + 'static,
    F: Fn(&Var) -> std::result::Result<Var, E> + Send + Sync + 'static,
{
    scope(name, || {
        if !is_grad_enabled() {
            return forward(input);
        }
        let full = current_scope();
        let saved = state.save();
        let x = input.value();
        let watermark = NEXT_ID.load(Ordering::Relaxed);
        let probe = probe_of(&x, input.requires_grad());
        let y = forward(&probe)?;
        if !y.requires_grad() {
            return Ok(y);
        }
        let unit = full.as_deref().unwrap_or(name).to_string();
        let leaves = unit_leaves(&y, &probe, watermark, &unit)?;
        let value = y.value();
        // dropping the unit's graph frees every tensor its ops saved
        drop(y);
        drop(probe);
        let kept = leaves.clone();
        let mut inputs = vec![input];
        inputs.extend(kept.iter());
        let n_leaves = leaves.len();
        let needs_x = input.requires_grad();
        let out_shape = value.shape().to_vec();
        let backward = move |g: &Tensor| -> Result<Vec<Option<Tensor>>> {
            let now = state.save();
            state.restore(&saved);
            let r = crate::profile::paused(|| {
                recompute_backward(&x, needs_x, &full, &unit, &out_shape, &leaves, g, &forward)
            });
            state.restore(&now);
            let gx = r?;
            let mut grads = vec![gx];
            grads.extend(std::iter::repeat_n(None, n_leaves));
            Ok(grads)
        };
        Ok(Var::from_op("checkpoint", value, &inputs, backward))
    })
}

/// A stand-in for the unit's input: a leaf that collects its gradient, or a constant.
fn probe_of(x: &Tensor, requires_grad: bool) -> Var {
    if requires_grad {
        Var::leaf(x.clone())
    } else {
        Var::constant(x.clone())
    }
}

/// The leaves that require grad which the unit's graph under `y` reads, other than `probe`;
/// an error if it reads a var an op made before the unit began (an id under `watermark`).
fn unit_leaves(y: &Var, probe: &Var, watermark: u64, unit: &str) -> Result<Vec<Var>> {
    let mut seen = HashSet::new();
    let mut stack = vec![y.clone()];
    let mut leaves = vec![];
    while let Some(v) = stack.pop() {
        if !v.requires_grad() || v.same(probe) || !seen.insert(v.0.id) {
            continue;
        }
        match &v.0.node {
            Some(node) if v.0.id < watermark => {
                return Err(AutogradError::CheckpointInput {
                    scope: unit.to_string(),
                    op: node.op,
                })
            }
            Some(node) => stack.extend(node.inputs.iter().cloned()),
            None => leaves.push(v),
        }
    }
    // creation order, the same on every rank and every step
    leaves.sort_by_key(|v| v.0.id);
    Ok(leaves)
}

/// The unit's forward run again from `x`, then its backward from `g`: the leaves' gradients
/// added into their `.grad`, the input's gradient returned.
#[allow(clippy::too_many_arguments)]
fn recompute_backward<E, F>(
    x: &Tensor,
    needs_x: bool,
    full: &Option<Arc<str>>,
    unit: &str,
    out_shape: &[usize],
    leaves: &[Var],
    g: &Tensor,
    forward: &F,
) -> Result<Option<Tensor>>
where
    E: std::error::Error + Send + Sync + 'static,
    F: Fn(&Var) -> std::result::Result<Var, E>,
{
    let probe = probe_of(x, needs_x);
    let y = rerun_in_scope(full.clone(), || forward(&probe)).map_err(|e| AutogradError::Recompute {
        scope: unit.to_string(),
        source: Box::new(e),
    })?;
    if y.value().shape() != out_shape {
        return Err(AutogradError::Invalid(format!(
            "recomputing checkpointed scope '{unit}' gave shape {:?}, its forward gave {out_shape:?}",
            y.value().shape()
        )));
    }
    if y.same(&probe) {
        return Ok(Some(g.clone()));
    }
    if y.0.node.is_none() {
        // the unit returned one of its leaves as it is
        y.accumulate_grad(g.clone())?;
        return Ok(None);
    }
    let order = reachable(&y);
    let mut buses: Vec<GradBus> = vec![];
    for p in leaves.iter().filter_map(|v| v.0.param.as_ref()) {
        if !buses.iter().any(|b| b.same(&p.bus)) {
            buses.push(p.bus.clone());
        }
    }
    let subscribers: Vec<Arc<dyn GradSubscriber>> = buses.iter().flat_map(GradBus::snapshot).collect();
    propagate(&y, g.clone(), &order, &subscribers, &mut |_| Ok(()))?;
    Ok(probe.grad())
}
