//! The reverse pass: walks the graph from an output back to the leaves, and announces
//! each parameter on its bus the moment its last contribution has been added.
//!
//! The gradient-ready bus ([`GradBus`]) is what it announces on: each [`GradSubscriber`] hears
//! the pass start, each node's backward, each parameter whose gradient is final, and the pass
//! end (or its abort), so that communication can start while backward goes on.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, RwLock};
use std::time::Instant;

use brigade_tensor::Tensor;

use crate::{AutogradError, Result, Var};

/// What a subscriber's failure carries across the bus: its own error, boxed but typed, so
/// that the caller of `backward()` can downcast it from [`crate::AutogradError::Subscriber`]'s
/// `source()` (the DDP reducer sends its `DdpError`, which keeps the `CommError` below it).
pub type SubscriberError = Box<dyn std::error::Error + Send + Sync>;

/// What a subscriber learns about a parameter whose gradient just became final.
#[derive(Debug, Clone, Copy)]
pub struct GradReady<'a> {
    /// Registration index of the parameter (stable, identical on every rank).
    pub index: usize,
    /// The parameter's name, e.g. `layers.2.weight`.
    pub name: &'a str,
}

/// Receives backward events. Methods run on the backward thread, in the order the
/// events happen, so they must be cheap (record, mark, hand off; never block long).
pub trait GradSubscriber: Send + Sync {
    /// Backward is about to run its first node. `params_in_graph` lists (by registration
    /// index) the parameters of this subscriber's store that will receive a gradient in
    /// this pass; the others are unused by this pass's graph. An error aborts the pass.
    fn backward_started(&self, _params_in_graph: &[usize]) -> std::result::Result<(), SubscriberError> {
        Ok(())
    }
    /// The backward of one op is about to run; `scope` is the module path it was
    /// recorded under (e.g. `layers.1`), if any.
    fn node_backward(&self, _scope: Option<&str>, _op: &str) {}
    /// A parameter's gradient is final for this backward pass. An error aborts the
    /// backward pass and is returned from `backward()`.
    fn grad_ready(&self, ready: GradReady<'_>) -> std::result::Result<(), SubscriberError>;
    /// Backward ran its last node (after every `grad_ready`). A subscriber may finish
    /// its own work here (the DDP reducer waits for its buckets); an error is returned
    /// from `backward()`.
    fn backward_finished(&self) -> std::result::Result<(), SubscriberError> {
        Ok(())
    }
    /// The pass that `backward_started` began failed before `backward_finished` (an op's
    /// backward, another subscriber or this one returned an error, which `backward()`
    /// returns). A subscriber takes back what it handed out (the DDP reducer waits for the
    /// buckets it launched), so that the gradients can be zeroed and the next pass run.
    /// Called at most once per pass, possibly after a failed `backward_finished`.
    fn backward_aborted(&self) {}
}

/// A list of subscribers shared by all parameters of one [`crate::ParamStore`].
#[derive(Clone, Default)]
pub struct GradBus {
    subscribers: Arc<RwLock<Vec<Arc<dyn GradSubscriber>>>>,
}

impl GradBus {
    /// Adds a subscriber; it sees every later backward pass.
    pub fn subscribe(&self, s: Arc<dyn GradSubscriber>) {
        self.subscribers.write().unwrap_or_else(|e| e.into_inner()).push(s);
    }

    /// Removes a subscriber (compared by pointer).
    pub fn unsubscribe(&self, s: &Arc<dyn GradSubscriber>) {
        self.subscribers
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|x| !Arc::ptr_eq(x, s));
    }

    pub(crate) fn snapshot(&self) -> Vec<Arc<dyn GradSubscriber>> {
        self.subscribers.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// True when both handles are the same bus.
    pub fn same(&self, other: &GradBus) -> bool {
        Arc::ptr_eq(&self.subscribers, &other.subscribers)
    }
}

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
                        // in place when nothing else holds the sum so far (PyTorch's input
                        // buffer does the same): no new tensor per extra use of a value; the
                        // same bits as `acc + ig`
                        Some(acc) if acc.is_sole_owner() && acc.dtype() == ig.dtype() && acc.shape() == ig.shape() => {
                            acc.add_assign(&ig)?
                        }
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
