//! `Var`: a tensor that remembers how it was made, so that gradients can flow back.

use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use brigade_tensor::{DType, Tensor};

use crate::params::ParamInfo;
use crate::Result;

/// The backward of one op: from the gradient of its output to one optional gradient per
/// input (`None` where an input needs none).
pub(crate) type BackwardFn = Box<dyn Fn(&Tensor) -> Result<Vec<Option<Tensor>>> + Send + Sync>;

/// The record of the op that produced a `Var`.
pub(crate) struct Node {
    pub(crate) op: &'static str,
    pub(crate) scope: Option<Arc<str>>,
    pub(crate) inputs: Vec<Var>,
    pub(crate) backward: BackwardFn,
}

pub(crate) struct VarInner {
    /// Creation order: a node's inputs always have smaller ids, so sorting by id
    /// descending is a reverse topological order.
    pub(crate) id: u64,
    pub(crate) data: RwLock<Tensor>,
    pub(crate) grad: Mutex<Option<Tensor>>,
    /// Changeable on leaves only ([`Var::set_requires_grad`]): freezing a parameter.
    pub(crate) requires_grad: AtomicBool,
    pub(crate) node: Option<Node>,
    pub(crate) param: Option<ParamInfo>,
}

/// A node of the autograd graph: a value plus, if it requires grad, the op that made
/// it. Cheap to clone (shared). Leaves that require grad (parameters, inputs of a
/// gradient check) accumulate their gradient in [`Var::grad`].
#[derive(Clone)]
pub struct Var(pub(crate) Arc<VarInner>);

pub(crate) static NEXT_ID: AtomicU64 = AtomicU64::new(0);

thread_local! {
    static GRAD_ENABLED: Cell<bool> = const { Cell::new(true) };
    static SCOPE: RefCell<Vec<Arc<str>>> = const { RefCell::new(Vec::new()) };
    static SCOPE_HOOKS: RefCell<Option<Arc<dyn ScopeHooks>>> = const { RefCell::new(None) };
}

/// Told when the forward enters and leaves a module scope ([`scope`]): where a policy that
/// shards the parameters gathers a unit's parameters before its forward and frees them after
/// (ZeRO-3), and where activation checkpointing keeps a unit's input. Installed per thread
/// ([`set_scope_hooks`]); the methods run on the thread that runs the forward.
pub trait ScopeHooks: Send + Sync {
    /// The forward is about to run `f` under `scope` (the full path, `blocks.0.attn`).
    fn enter(&self, scope: &str) {
        let _ = scope;
    }
    /// The forward under `scope` returned.
    fn exit(&self, scope: &str) {
        let _ = scope;
    }
}

/// Installs `hooks` for this thread's scopes (`None` removes them); returns what was installed.
pub fn set_scope_hooks(hooks: Option<Arc<dyn ScopeHooks>>) -> Option<Arc<dyn ScopeHooks>> {
    SCOPE_HOOKS.with(|h| std::mem::replace(&mut *h.borrow_mut(), hooks))
}

/// The hooks installed on this thread.
pub fn scope_hooks() -> Option<Arc<dyn ScopeHooks>> {
    SCOPE_HOOKS.with(|h| h.borrow().clone())
}

/// Runs `f` without recording a graph (evaluation, optimizer updates).
pub fn no_grad<R>(f: impl FnOnce() -> R) -> R {
    let prev = GRAD_ENABLED.with(|g| g.replace(false));
    let r = f();
    GRAD_ENABLED.with(|g| g.set(prev));
    r
}

/// True unless inside [`no_grad`].
pub fn is_grad_enabled() -> bool {
    GRAD_ENABLED.with(|g| g.get())
}

/// Runs `f` with `name` appended to the current module scope (`blocks.0` then `attn`
/// gives `blocks.0.attn`). Ops record their scope, and backward reports it, so that a
/// timeline can show the backward of each layer.
pub fn scope<R>(name: &str, f: impl FnOnce() -> R) -> R {
    let full = SCOPE.with(|s| {
        let mut s = s.borrow_mut();
        let full: Arc<str> = match s.last() {
            Some(p) => format!("{p}.{name}").into(),
            None => name.into(),
        };
        s.push(full.clone());
        full
    });
    let hooks = scope_hooks();
    if let Some(h) = &hooks {
        h.enter(&full);
    }
    let r = f();
    SCOPE.with(|s| s.borrow_mut().pop());
    if let Some(h) = &hooks {
        h.exit(&full);
    }
    r
}

pub(crate) fn current_scope() -> Option<Arc<str>> {
    SCOPE.with(|s| s.borrow().last().cloned())
}

/// Runs `f` recording a graph, under the full scope path `full` whatever the current scope is:
/// how a checkpointed scope's forward is recomputed inside backward, under the names it first
/// ran with.
pub(crate) fn rerun_in_scope<R>(full: Option<Arc<str>>, f: impl FnOnce() -> R) -> R {
    let prev_grad = GRAD_ENABLED.with(|g| g.replace(true));
    let prev_scope = SCOPE.with(|s| std::mem::replace(&mut *s.borrow_mut(), full.into_iter().collect()));
    let r = f();
    SCOPE.with(|s| *s.borrow_mut() = prev_scope);
    GRAD_ENABLED.with(|g| g.set(prev_grad));
    r
}

impl std::fmt::Debug for Var {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let t = self.value();
        match &self.0.param {
            Some(p) => write!(f, "Param({}, {:?})", p.name, t.shape()),
            None => write!(f, "Var({:?}, requires_grad={})", t.shape(), self.requires_grad()),
        }
    }
}

impl Var {
    pub(crate) fn new_inner(data: Tensor, requires_grad: bool, node: Option<Node>, param: Option<ParamInfo>) -> Var {
        Var(Arc::new(VarInner {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            data: RwLock::new(data),
            grad: Mutex::new(None),
            requires_grad: AtomicBool::new(requires_grad),
            node,
            param,
        }))
    }

    /// A constant (no gradient).
    pub fn constant(data: Tensor) -> Var {
        Self::new_inner(data, false, None, None)
    }

    /// A leaf that accumulates a gradient but is not a registered parameter (e.g. an
    /// input whose gradient a test wants).
    pub fn leaf(data: Tensor) -> Var {
        Self::new_inner(data, true, None, None)
    }

    /// The result of an op: records `backward` if grad is enabled and any input needs it.
    pub(crate) fn from_op(
        op: &'static str,
        value: Tensor,
        inputs: &[&Var],
        backward: impl Fn(&Tensor) -> Result<Vec<Option<Tensor>>> + Send + Sync + 'static,
    ) -> Var {
        crate::profile::forward_op(op);
        if !is_grad_enabled() || !inputs.iter().any(|v| v.requires_grad()) {
            return Var::constant(value);
        }
        let node = Node {
            op,
            scope: current_scope(),
            inputs: inputs.iter().map(|&v| v.clone()).collect(),
            backward: Box::new(backward),
        };
        Self::new_inner(value, true, Some(node), None)
    }

    /// The current value (shares storage).
    pub fn value(&self) -> Tensor {
        self.0.data.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Replaces the value of a leaf (loading a checkpoint, broadcasting rank 0's
    /// parameters). The shape must stay the same. A deferred parameter's recipe is forgotten:
    /// it holds `t` ([`crate::defer_param_init`]).
    pub fn set_value(&self, t: Tensor) -> Result<()> {
        let mut d = self.0.data.write().unwrap_or_else(|e| e.into_inner());
        if d.shape() != t.shape() {
            return Err(brigade_tensor::TensorError::ShapeMismatch {
                op: "set_value",
                lhs: d.shape().to_vec(),
                rhs: t.shape().to_vec(),
            }
            .into());
        }
        if d.dtype() != t.dtype() {
            return Err(brigade_tensor::TensorError::DTypeMismatch {
                op: "set_value",
                lhs: d.dtype(),
                rhs: t.dtype(),
            }
            .into());
        }
        *d = t;
        drop(d);
        self.end_deferral();
        Ok(())
    }

    /// Replaces the value with `t` of the same shape and any dtype: how mixed precision gives a
    /// parameter its 16-bit compute copy ([`crate::MasterWeights`]), before DDP is built over it.
    pub(crate) fn set_value_cast(&self, t: Tensor) -> Result<()> {
        let mut d = self.0.data.write().unwrap_or_else(|e| e.into_inner());
        if d.shape() != t.shape() {
            return Err(brigade_tensor::TensorError::ShapeMismatch {
                op: "set_value",
                lhs: d.shape().to_vec(),
                rhs: t.shape().to_vec(),
            }
            .into());
        }
        *d = t;
        drop(d);
        self.end_deferral();
        Ok(())
    }

    /// Shape of the value.
    pub fn shape(&self) -> Vec<usize> {
        self.value().shape().to_vec()
    }

    /// True when gradients flow into or through this var.
    pub fn requires_grad(&self) -> bool {
        self.0.requires_grad.load(Ordering::Relaxed)
    }

    /// Freezes (`false`) or unfreezes (`true`) a leaf, as PyTorch's `p.requires_grad_(False)`:
    /// ops recorded afterwards do not differentiate through it, backward computes and announces
    /// no gradient for it, and freezing discards its accumulated gradient (`p.grad = None`), so
    /// optimizers, which skip parameters without a gradient, leave it unchanged. Freeze before
    /// wrapping the model in DDP: the buckets are built from the parameters that require grad
    /// then. Fails on a var that an op produced.
    pub fn set_requires_grad(&self, requires_grad: bool) -> Result<()> {
        if let Some(node) = &self.0.node {
            return Err(crate::AutogradError::NotALeaf { op: node.op });
        }
        self.0.requires_grad.store(requires_grad, Ordering::Relaxed);
        if !requires_grad {
            *self.0.grad.lock().unwrap_or_else(|e| e.into_inner()) = None;
        }
        Ok(())
    }

    /// The accumulated gradient of a leaf (a view into a bucket when one was attached).
    pub fn grad(&self) -> Option<Tensor> {
        self.0.grad.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Parameter name, if this is a registered parameter.
    pub fn name(&self) -> Option<&str> {
        self.0.param.as_ref().map(|p| p.name.as_str())
    }

    /// Registration index, if this is a registered parameter.
    pub fn param_index(&self) -> Option<usize> {
        self.0.param.as_ref().map(|p| p.index)
    }

    /// True when both handles are the same graph node.
    pub fn same(&self, other: &Var) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// Makes `buffer` the storage this leaf's gradient accumulates into (for example a
    /// view into a DDP bucket's flat buffer). Any gradient already accumulated is copied
    /// over, so nothing is lost. The buffer holds the value's dtype, or f32 beside a 16-bit
    /// value (mixed precision reducing in f32: the 16-bit gradients are widened as they
    /// accumulate, the sum exact in f32).
    pub fn set_grad_buffer(&self, buffer: Tensor) -> Result<()> {
        let v = self.value();
        if buffer.shape() != v.shape() || !grad_dtype_fits(buffer.dtype(), v.dtype()) {
            return Err(crate::AutogradError::GradBuffer {
                param: self.name().unwrap_or("<leaf>").to_string(),
                expected: v.shape().to_vec(),
                found: buffer.shape().to_vec(),
                dtype: v.dtype(),
            });
        }
        let mut g = self.0.grad.lock().unwrap_or_else(|e| e.into_inner());
        match g.as_ref() {
            Some(old) if old.dtype() != buffer.dtype() => buffer.copy_from(&old.to_dtype(buffer.dtype())?)?,
            Some(old) => buffer.copy_from(old)?,
            None => buffer.fill(0.0)?,
        }
        *g = Some(buffer);
        Ok(())
    }

    /// Replaces this leaf's gradient with `grad` as it is, sharing its storage, or drops it
    /// (`None`), as PyTorch's `p.grad = g` / `p.grad = None`: how a sharded optimizer points a
    /// parameter piece at its gradient shard, and how ZeRO-2 frees the full gradient.
    pub fn set_grad(&self, grad: Option<Tensor>) -> Result<()> {
        if let Some(g) = &grad {
            let v = self.value();
            if g.shape() != v.shape() || !grad_dtype_fits(g.dtype(), v.dtype()) {
                return Err(crate::AutogradError::GradBuffer {
                    param: self.name().unwrap_or("<leaf>").to_string(),
                    expected: v.shape().to_vec(),
                    found: g.shape().to_vec(),
                    dtype: v.dtype(),
                });
            }
        }
        *self.0.grad.lock().unwrap_or_else(|e| e.into_inner()) = grad;
        Ok(())
    }

    /// Sets the accumulated gradient to zero, keeping its storage (and so any bucket
    /// view) in place.
    pub fn zero_grad(&self) -> Result<()> {
        if let Some(g) = self.0.grad.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            g.fill(0.0)?;
        }
        Ok(())
    }

    /// Adds `g` into this leaf's gradient: in place when a gradient (or buffer) exists;
    /// otherwise `g` itself becomes the gradient when nothing else views its storage
    /// (PyTorch's AccumulateGrad steals it the same way), else a contiguous copy of it (never
    /// aliasing a tensor that something else holds).
    pub(crate) fn accumulate_grad(&self, g: Tensor) -> Result<()> {
        let mut slot = self.0.grad.lock().unwrap_or_else(|e| e.into_inner());
        match slot.as_ref() {
            Some(acc) if acc.dtype() != g.dtype() => acc.add_assign(&g.to_dtype(acc.dtype())?)?,
            Some(acc) => acc.add_assign(&g)?,
            None if g.is_sole_owner() => *slot = Some(g),
            None => *slot = Some(g.copy()?),
        }
        Ok(())
    }

    /// Detaches: the same value as a constant.
    pub fn detach(&self) -> Var {
        Var::constant(self.value())
    }
}

/// True when a gradient of dtype `grad` may stand beside a value of dtype `value`: the same
/// dtype, or f32 beside a 16-bit float value (a mixed-precision run reducing in f32).
fn grad_dtype_fits(grad: DType, value: DType) -> bool {
    grad == value || (grad == DType::F32 && matches!(value, DType::BF16 | DType::F16))
}
