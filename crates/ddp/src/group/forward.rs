//! The forwarding of [`super::ProcessGroup`]'s methods to an inner group, written once for
//! every wrapper ([`super::Metered`], [`super::Recording`], [`super::DeviceGroup`]): inside an
//! `impl ProcessGroup for ...`, `forward_group!(inner: identity, collectives)` writes the methods
//! of the named parts as calls of the same method on `self.inner`; the wrapper writes the
//! others itself. A method added to the contract is added to its part here.
//!
//! The parts: `identity` (`name`, `rank`, `world_size`, `timeout`, `check`), `enqueues`,
//! `collectives` (every collective), `hooks` (`record_ready`, `launch`, `launched`, `wait`,
//! `compute_scope`).

macro_rules! forward_group {
    ($inner:ident: $($part:ident),+ $(,)?) => {
        $(forward_group!(@$part $inner);)+
    };
    (@identity $inner:ident) => {
        fn name(&self) -> &'static str {
            self.$inner.name()
        }
        fn rank(&self) -> usize {
            self.$inner.rank()
        }
        fn world_size(&self) -> usize {
            self.$inner.world_size()
        }
        fn timeout(&self) -> std::time::Duration {
            self.$inner.timeout()
        }
        fn check(&self) -> crate::Result<()> {
            self.$inner.check()
        }
    };
    (@enqueues $inner:ident) => {
        fn enqueues(&self) -> bool {
            self.$inner.enqueues()
        }
    };
    (@collectives $inner:ident) => {
        fn all_reduce(&self, t: &Tensor, op: ReduceOp, tag: &str) -> TensorWork<Tensor> {
            self.$inner.all_reduce(t, op, tag)
        }
        fn reduce_scatter_into(&self, input: &Tensor, output: &Tensor, op: ReduceOp, tag: &str) -> TensorWork<Tensor> {
            self.$inner.reduce_scatter_into(input, output, op, tag)
        }
        fn all_gather_into(&self, input: &Tensor, output: &Tensor, tag: &str) -> TensorWork<Tensor> {
            self.$inner.all_gather_into(input, output, tag)
        }
        fn broadcast(&self, t: &Tensor, root: usize, tag: &str) -> TensorWork<Tensor> {
            self.$inner.broadcast(t, root, tag)
        }
        fn barrier(&self, tag: &str) -> TensorWork<()> {
            self.$inner.barrier(tag)
        }
        fn reduce_scatter(&self, t: &Tensor, op: ReduceOp, tag: &str) -> TensorWork<Tensor> {
            self.$inner.reduce_scatter(t, op, tag)
        }
        fn all_gather(&self, t: &Tensor, tag: &str) -> TensorWork<Tensor> {
            self.$inner.all_gather(t, tag)
        }
        fn all_gather_with_side(&self, payload: &Tensor, side: &Tensor, tag: &str) -> TensorWork<(Tensor, Tensor)> {
            self.$inner.all_gather_with_side(payload, side, tag)
        }
        fn all_gather_sparse(
            &self,
            values: &Tensor,
            indices: &Tensor,
            capacity: usize,
            tag: &str,
        ) -> TensorWork<crate::group::SparseGather> {
            self.$inner.all_gather_sparse(values, indices, capacity, tag)
        }
    };
    (@hooks $inner:ident) => {
        fn record_ready(&self, index: usize, flat: &Tensor) -> crate::Result<ReadyEvent> {
            self.$inner.record_ready(index, flat)
        }
        fn launch(&self, index: usize, ready: ReadyEvent) -> crate::Result<Option<Stream>> {
            self.$inner.launch(index, ready)
        }
        fn launched(&self, index: usize, meter: &CommMeter) -> crate::Result<()> {
            self.$inner.launched(index, meter)
        }
        fn wait(&self, index: usize) -> crate::Result<()> {
            self.$inner.wait(index)
        }
        fn compute_scope(&self, span: Option<SpanId>) {
            self.$inner.compute_scope(span)
        }
    };
}
