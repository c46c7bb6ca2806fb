//! The reverse pass: walks the graph from an output back to the leaves, and announces
//! each parameter on its bus the moment its last contribution has been added.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use brigade_tensor::Tensor;

use crate::bus::GradSubscriber;
use crate::{AutogradError, GradBus, GradReady, Result, Var};

/// Every var reachable from `root` through vars that require grad, sorted newest first
/// (a reverse topological order: inputs are always older than their outputs).
pub(crate) fn reachable(root: &Var) -> Vec<Var> {
    let mut seen = HashSet::new();
    let mut stack = vec![root.clone()];
    let mut out = vec![];
    while let Some(v) = stack.pop() {
        if !v.requires_grad() || !seen.insert(v.0.id) {
            continue;
        }
        if let Some(node) = &v.0.node {
            stack.extend(node.inputs.iter().cloned());
        }
        out.push(v);
    }
    out.sort_by_key(|b| std::cmp::Reverse(b.0.id));
    out
}

impl Var {
    /// Backward from a scalar output (gradient 1).
    pub fn backward(&self) -> Result<()> {
        let v = self.value();
        if v.numel() != 1 {
            return Err(AutogradError::NotScalar(v.shape().to_vec()));
        }
        // the seed on the output's device: no host tensor to copy up (or to mismatch)
        self.backward_with(Tensor::full_on(v.shape(), 1.0, v.dtype(), v.device())?)
    }

    /// Backward from this output with the given seed gradient.
    ///
    /// Gradients accumulate into the leaves' `.grad` (adding to what previous backward
    /// passes left, until zeroed). Each parameter is announced with
    /// [`crate::GradSubscriber::grad_ready`] on its store's bus as soon as every
    /// contribution it will receive in this pass has been added, not at the end.
    pub fn backward_with(&self, seed: Tensor) -> Result<()> {
        if !self.requires_grad() {
            return Err(AutogradError::NoGraph);
        }
        let order = reachable(self);
        // How many contributions each parameter will receive, and who listens.
        let mut pending: HashMap<u64, usize> = HashMap::new();
        // (parameters frozen with `set_requires_grad(false)` receive nothing)
        let mut buses: Vec<GradBus> = vec![];
        for v in &order {
            if let Some(node) = &v.0.node {
                for inp in node.inputs.iter().filter(|i| i.requires_grad()) {
                    if let Some(p) = &inp.0.param {
                        *pending.entry(inp.0.id).or_default() += 1;
                        if !buses.iter().any(|b| b.same(&p.bus)) {
                            buses.push(p.bus.clone());
                        }
                    }
                }
            }
        }
        let mut subscribers: Vec<Arc<dyn GradSubscriber>> = vec![];
        for bus in &buses {
            let mut in_graph: Vec<usize> = order
                .iter()
                .filter_map(|v| v.0.param.as_ref().filter(|p| p.bus.same(bus)).map(|p| p.index))
                .collect();
            in_graph.sort_unstable();
            for s in bus.snapshot() {
                subscribers.push(s.clone());
                if let Err(source) = s.backward_started(&in_graph) {
                    subscribers.iter().for_each(|s| s.backward_aborted());
                    return Err(AutogradError::Subscriber {
                        param: "<backward start>".into(),
                        source,
                    });
                }
            }
        }
        let result = self.run_nodes(seed, &order, pending, &subscribers);
        if result.is_err() {
            subscribers.iter().for_each(|s| s.backward_aborted());
        }
        result
    }

    /// Runs every node of `order` and announces each parameter when its `pending` count
    /// reaches zero; then tells `subscribers` that backward finished.
    fn run_nodes(
        &self,
        seed: Tensor,
        order: &[Var],
        mut pending: HashMap<u64, usize>,
        subscribers: &[Arc<dyn GradSubscriber>],
    ) -> Result<()> {
        let announce = |p: &Var| -> Result<()> {
            let info = p.0.param.as_ref().expect("announced vars are parameters");
            for s in info.bus.snapshot() {
                s.grad_ready(GradReady {
                    index: info.index,
                    name: &info.name,
                })
                .map_err(|source| AutogradError::Subscriber {
                    param: format!("parameter '{}'", info.name),
                    source,
                })?;
            }
            Ok(())
        };
        // The output itself may be a parameter (a loss that is just a weight).
        if self.0.node.is_none() {
            self.accumulate_grad(seed)?;
            if self.0.param.is_some() {
                announce(self)?;
            }
            return Ok(());
        }
        propagate(self, seed, order, subscribers, &mut |inp: &Var| {
            let left = pending.get_mut(&inp.0.id).expect("counted above");
            *left -= 1;
            if *left == 0 {
                announce(inp)?;
            }
            Ok(())
        })?;
        for s in subscribers {
            s.backward_finished().map_err(|source| AutogradError::Subscriber {
                param: "<backward end>".into(),
                source,
            })?;
        }
        Ok(())
    }
}

/// Runs every node of `order` (reverse topological, `root` first, `root` having a node) from
/// `seed`: each node's backward, its input gradients summed into the nodes below or added into
/// the leaves' `.grad`; `contributed` is told each time a parameter has received one
/// contribution (or a `None` from a node it feeds). The engine of [`Var::backward_with`], and of
/// a checkpointed scope's recompute, which runs its own nodes without announcing.
pub(crate) fn propagate(
    root: &Var,
    seed: Tensor,
    order: &[Var],
    subscribers: &[Arc<dyn GradSubscriber>],
    contributed: &mut dyn FnMut(&Var) -> Result<()>,
) -> Result<()> {
    let mut grads: HashMap<u64, Tensor> = HashMap::new();
    grads.insert(root.0.id, seed);
    let profiling = crate::profile::enabled();
    for v in order {
        let Some(node) = &v.0.node else { continue };
        let g = grads.remove(&v.0.id);
        let input_grads = match &g {
            Some(g) => {
                for s in subscribers {
                    s.node_backward(node.scope.as_deref(), node.op);
                }
                if profiling {
                    let start = Instant::now();
                    let grads = (node.backward)(g)?;
                    crate::profile::backward_op(node.op, start.elapsed());
                    grads
                } else {
                    (node.backward)(g)?
                }
            }
            None => vec![None; node.inputs.len()],
        };
        for (inp, ig) in node.inputs.iter().zip(input_grads) {
            if !inp.requires_grad() {
                continue;
            }
            if let Some(ig) = ig {
                let start = profiling.then(Instant::now);
                if inp.0.node.is_some() {
                    match grads.get_mut(&inp.0.id) {
                        Some(acc) => *acc = acc.add(&ig)?,
                        None => {
                            grads.insert(inp.0.id, ig);
                        }
                    }
                } else {
                    inp.accumulate_grad(ig)?;
                }
                if let Some(start) = start {
                    crate::profile::backward_op("accumulate_grad", start.elapsed());
                }
            }
            if inp.0.param.is_some() {
                contributed(inp)?;
            }
        }
    }
    Ok(())
}
