//! The gradient-ready event bus: backward announces each parameter the moment its
//! gradient is final, so that communication can start while backward goes on.

use std::sync::{Arc, RwLock};

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
    fn backward_started(&self, _params_in_graph: &[usize]) -> Result<(), SubscriberError> {
        Ok(())
    }
    /// The backward of one op is about to run; `scope` is the module path it was
    /// recorded under (e.g. `layers.1`), if any.
    fn node_backward(&self, _scope: Option<&str>, _op: &str) {}
    /// A parameter's gradient is final for this backward pass. An error aborts the
    /// backward pass and is returned from `backward()`.
    fn grad_ready(&self, ready: GradReady<'_>) -> Result<(), SubscriberError>;
    /// Backward ran its last node (after every `grad_ready`). A subscriber may finish
    /// its own work here (the DDP reducer waits for its buckets); an error is returned
    /// from `backward()`.
    fn backward_finished(&self) -> Result<(), SubscriberError> {
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
