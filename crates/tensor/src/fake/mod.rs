//! The counting fake device ([`crate::Device::Fake`]): host memory behind the device contract.
//!
//! It stands in for a GPU in CPU tests. Its kernels are the CPU backend's (so its numbers are
//! the CPU's, bit for bit), but everything around them behaves as on a device:
//! - the host reaches its memory only through the contract's copies in and out, each counted
//!   ([`FakeCounts`]); an op that mixes it with host tensors is a device mismatch, as on CUDA;
//! - every op runs on a stream (the compute stream, or one made with [`crate::Stream::new`]
//!   and entered with [`crate::Stream::scope`]), and the device checks, with one vector clock
//!   per stream, that a stream touching memory another stream wrote (or is reading, for a
//!   write) was ordered after that use by an event wait or a host wait: an unordered access
//!   is refused with an error naming both streams, where a GPU would silently race;
//! - events record where their stream was; explicit host waits are counted;
//! - an optional log keeps every op with its stream, so tests check the order of the work
//!   on each stream ([`start_log`], [`take_log`]).
//!
//! Each ordinal keeps its own counts: a test that pins counts uses an ordinal of its own.

mod state;

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

pub(crate) use state::{device, FakeDevice, FakeEvent, FakeStream};
pub use state::{FakeCounts, FakeOp, FakeWhat};

use state::Stamp;

use crate::backend::{
    event_of, AdamWScalars, Attention, BackendEvent, BackendStorage, BackendStream, BinaryOp, Elementwise, InPlace,
    Indexing, Matmul, Nn, Reduce, ReduceOp, SgdScalars, UnaryOp,
};
use crate::scope::ScopedStream;
use crate::Buffer;
use crate::{DType, Device, Layout, Result, TensorError};

/// What fake device `ordinal` counted so far.
pub fn counts(ordinal: usize) -> FakeCounts {
    device(ordinal).lock().counts
}

/// Sets fake device `ordinal`'s counts back to zero.
pub fn reset(ordinal: usize) {
    device(ordinal).lock().counts = FakeCounts::default();
}

/// Starts (or restarts, empty) the log of fake device `ordinal`'s ops.
pub fn start_log(ordinal: usize) {
    device(ordinal).lock().log_start();
}

/// The ops logged since [`start_log`] (the log goes on, empty).
pub fn take_log(ordinal: usize) -> Vec<FakeOp> {
    device(ordinal).lock().log_take()
}

/// The stream this thread's ops on `dev` run on now.
pub(crate) fn current_stream(dev: &FakeDevice) -> u64 {
    crate::scope::current(Device::Fake(dev.ordinal))
        .and_then(|s| s.downcast_ref::<FakeStream>().map(|s| s.id))
        .unwrap_or(0)
}

/// Who used a storage last: its writer, the latest read of each stream, and the stream it
/// was allocated on.
#[derive(Debug, Default)]
struct Access {
    alloc: u64,
    write: Option<Stamp>,
    reads: Vec<Stamp>,
}

impl Access {
    fn read(&mut self, (s, q): Stamp) {
        match self.reads.iter_mut().find(|r| r.0 == s) {
            Some(r) => r.1 = r.1.max(q),
            None => self.reads.push((s, q)),
        }
    }
}

/// Memory on a fake device: host memory the host may only reach through the contract.
pub(crate) struct FakeStorage {
    data: Buffer,
    dev: Arc<FakeDevice>,
    /// The smallest and largest value of integer data uploaded from the host (None once
    /// written on the device).
    int_range: Option<(i64, i64)>,
    access: Mutex<Access>,
}

impl std::fmt::Debug for FakeStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "FakeStorage({:?} x {} on fake:{})",
            self.data.dtype(),
            self.data.len(),
            self.dev.ordinal
        )
    }
}

/// How one op touches its operands.
enum Kind {
    Kernel(&'static str),
    ToHost,
    Lend,
}

impl FakeStorage {
    fn access(&self) -> MutexGuard<'_, Access> {
        self.access.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A fresh storage written at `stamp`.
    fn fresh(dev: &Arc<FakeDevice>, data: Buffer, stamp: Stamp, int_range: Option<(i64, i64)>) -> Self {
        FakeStorage {
            data,
            dev: dev.clone(),
            int_range,
            access: Mutex::new(Access {
                alloc: stamp.0,
                write: Some(stamp),
                reads: Vec::new(),
            }),
        }
    }

    /// A result of this device, written by the op stamped `stamp`.
    fn out(&self, data: Buffer, stamp: Stamp) -> Self {
        Self::fresh(&self.dev, data, stamp, None)
    }

    /// Runs a read-only kernel over `self` and `others`.
    fn kernel<R>(
        &self,
        name: &'static str,
        others: &[&FakeStorage],
        f: impl FnOnce() -> Result<R>,
    ) -> Result<(R, Stamp)> {
        let mut reads = vec![self];
        reads.extend_from_slice(others);
        let stamp = begin(&self.dev, Kind::Kernel(name), &reads, &[])?;
        Ok((f()?, stamp))
    }
}

/// Starts one op on the current stream: checks that every operand's earlier uses on other
/// streams are ordered before it (reads: the last write; writes: the last write and every
/// read), counts and logs it, and stamps the operands with it.
fn begin(dev: &Arc<FakeDevice>, kind: Kind, reads: &[&FakeStorage], writes: &[&FakeStorage]) -> Result<Stamp> {
    let stream = current_stream(dev);
    let mut d = dev.lock();
    let name = match kind {
        Kind::Kernel(n) => n,
        Kind::ToHost => "copy to the host",
        Kind::Lend => "lending raw memory",
    };
    let unordered = |by: Stamp, what: &str| TensorError::Invalid {
        op: name,
        msg: format!(
            "fake:{}: stream {stream} {what} memory that stream {} used in its op {} without an event wait or \
             host wait ordering that use first (on a GPU this is a race)",
            dev.ordinal, by.0, by.1
        ),
    };
    for s in reads.iter().chain(writes) {
        if !Arc::ptr_eq(&s.dev, dev) {
            return Err(TensorError::DeviceMismatch {
                op: name,
                lhs: Device::Fake(dev.ordinal),
                rhs: Device::Fake(s.dev.ordinal),
            });
        }
        let a = s.access();
        if let Some(w) = a.write {
            if !d.ordered(stream, w) {
                return Err(unordered(w, "reads"));
            }
        }
    }
    for s in writes {
        let a = s.access();
        if let Some(&r) = a.reads.iter().find(|&&r| !d.ordered(stream, r)) {
            return Err(unordered(r, "overwrites"));
        }
    }
    let stamp = d.issue(stream);
    match kind {
        Kind::Kernel(n) => {
            d.counts.kernels += 1;
            d.log(stream, FakeWhat::Kernel(n));
        }
        Kind::ToHost => {
            let bytes: u64 = reads.iter().map(|s| s.data.byte_len() as u64).sum();
            d.counts.to_host += 1;
            d.counts.to_host_bytes += bytes;
            d.log(stream, FakeWhat::ToHost(bytes));
            // the copy drains the stream: the host has waited for it
            d.host_waited_for_stream(stream);
        }
        Kind::Lend => d.log(stream, FakeWhat::Lent),
    }
    drop(d);
    for s in reads {
        s.access().read(stamp);
    }
    for s in writes {
        let mut a = s.access();
        a.write = Some(stamp);
        a.read(stamp);
    }
    Ok(stamp)
}

impl Drop for FakeStorage {
    fn drop(&mut self) {
        let a = self.access();
        let uses = a.write.iter().chain(&a.reads).filter(|u| u.0 != a.alloc);
        let d = self.dev.lock();
        let pending = uses.clone().any(|&u| !d.ordered(a.alloc, u));
        drop(d);
        if pending {
            self.dev.lock().counts.deferred_frees += 1;
        }
    }
}

/// Streams and events are tracked exactly: each op is stamped with its stream's clock, and an
/// event carries the clock of its stream when it was recorded.
impl BackendStream for FakeStream {
    fn scoped(&self) -> ScopedStream {
        Arc::new(self.clone())
    }

    fn record(&self) -> Result<Arc<dyn BackendEvent>> {
        let (id, clock) = self.dev.lock().record(self.id);
        Ok(Arc::new(FakeEvent {
            dev: self.dev.clone(),
            id,
            stream: self.id,
            clock,
            at: Instant::now(),
        }))
    }

    fn wait(&self, event: &dyn BackendEvent) -> Result<()> {
        let e = event_of::<FakeEvent>("wait_event", event)?;
        self.dev.lock().wait(self.id, e.id, e.stream, &e.clock);
        Ok(())
    }

    /// Counted: inside a training step this is a stall.
    fn synchronize(&self) -> Result<()> {
        let mut d = self.dev.lock();
        d.host_waited_for_stream(self.id);
        d.counts.host_waits += 1;
        d.log(self.id, FakeWhat::HostWait);
        Ok(())
    }

    /// Logged.
    fn spin(&self, duration: Duration) -> Result<()> {
        let mut d = self.dev.lock();
        d.issue(self.id);
        d.counts.kernels += 1;
        d.log(self.id, FakeWhat::Spin(duration));
        Ok(())
    }

    fn raw(&self) -> u64 {
        self.id
    }
}

impl BackendEvent for FakeEvent {
    /// The fake device runs each op when it is issued.
    fn is_complete(&self) -> Result<bool> {
        Ok(true)
    }

    /// Counted.
    fn synchronize(&self) -> Result<()> {
        self.dev.lock().host_wait(self.stream, &self.clock);
        Ok(())
    }

    fn elapsed_ms(&self, end: &dyn BackendEvent) -> Result<f64> {
        Ok(crate::cpu::signed_ms(
            self.at,
            event_of::<FakeEvent>("elapsed_ms", end)?.at,
        ))
    }

    fn raw(&self) -> u64 {
        self.id
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Borrows the CPU storage inside each `(storage, layout)` pair.
fn cpu<'a>(x: (&'a FakeStorage, &'a Layout)) -> (&'a Buffer, &'a Layout) {
    (&x.0.data, x.1)
}

impl BackendStorage for FakeStorage {
    fn dtype(&self) -> DType {
        self.data.dtype()
    }

    fn device(&self) -> Device {
        Device::Fake(self.dev.ordinal)
    }

    fn len(&self) -> usize {
        self.data.len()
    }

    fn empty_like(&self) -> Self {
        let a = self.access().alloc;
        Self::fresh(&self.dev, Buffer::zeros(self.dtype(), 0), (a, 0), None)
    }

    fn int_range(&self) -> Option<(i64, i64)> {
        self.int_range
    }

    /// A memset on the current stream.
    fn zeros_on(ordinal: usize, dtype: DType, n: usize) -> Result<Self> {
        let dev = device(ordinal);
        let stamp = begin(&dev, Kind::Kernel("zeros"), &[], &[])?;
        Ok(Self::fresh(&dev, Buffer::zeros(dtype, n), stamp, None))
    }

    /// Counted.
    fn upload(ordinal: usize, data: Buffer) -> Result<Self> {
        let dev = device(ordinal);
        let stream = current_stream(&dev);
        let bytes = data.byte_len() as u64;
        let stamp = {
            let mut d = dev.lock();
            let stamp = d.issue(stream);
            d.counts.to_device += 1;
            d.counts.to_device_bytes += bytes;
            d.log(stream, FakeWhat::ToDevice(bytes));
            stamp
        };
        let range = crate::cpu::int_range(&data);
        Ok(Self::fresh(&dev, data, stamp, range))
    }

    /// Recorded as a read and a write on the current stream.
    fn lend_raw(&self) -> Result<u64> {
        begin(&self.dev, Kind::Lend, &[], &[self])?;
        Ok(self.data.as_ptr() as u64)
    }

    fn compute_stream(ordinal: usize) -> Result<Arc<dyn BackendStream>> {
        Ok(Arc::new(FakeStream {
            dev: device(ordinal),
            id: 0,
        }))
    }

    fn new_stream(ordinal: usize) -> Result<Arc<dyn BackendStream>> {
        let dev = device(ordinal);
        let id = dev.lock().new_stream();
        Ok(Arc::new(FakeStream { dev, id }))
    }

    fn scoped_stream(entered: &ScopedStream) -> Option<Arc<dyn BackendStream>> {
        let s = entered.downcast_ref::<FakeStream>()?;
        Some(Arc::new(s.clone()))
    }

    fn to_cpu(&self) -> Result<Buffer> {
        begin(&self.dev, Kind::ToHost, &[self], &[])?;
        Ok(self.data.clone())
    }

    fn copy_strided(&self, layout: &Layout) -> Result<Self> {
        let (d, st) = self.kernel("copy_strided", &[], || self.data.copy_strided(layout))?;
        // a gather of integer data stays inside the range of what it was gathered from
        Ok(Self::fresh(&self.dev, d, st, self.int_range))
    }

    fn to_dtype(&self, layout: &Layout, dtype: DType) -> Result<Self> {
        let (d, st) = self.kernel("to_dtype", &[], || self.data.to_dtype(layout, dtype))?;
        Ok(Self::fresh(
            &self.dev,
            d,
            st,
            crate::cpu::range_in(self.int_range, dtype),
        ))
    }
}

impl Elementwise for FakeStorage {
    fn unary(&self, layout: &Layout, op: UnaryOp) -> Result<Self> {
        let (d, st) = self.kernel("unary", &[], || self.data.unary(layout, op))?;
        Ok(self.out(d, st))
    }

    fn binary(&self, lhs: &Layout, rhs: &Self, rhs_layout: &Layout, op: BinaryOp) -> Result<Self> {
        let (d, st) = self.kernel("binary", &[rhs], || self.data.binary(lhs, &rhs.data, rhs_layout, op))?;
        Ok(self.out(d, st))
    }
}

impl Reduce for FakeStorage {
    fn reduce(&self, layout: &Layout, dims: &[usize], op: ReduceOp) -> Result<Self> {
        let (d, st) = self.kernel("reduce", &[], || self.data.reduce(layout, dims, op))?;
        Ok(self.out(d, st))
    }
}

impl Matmul for FakeStorage {
    fn matmul(&self, lhs: &Layout, rhs: &Self, rhs_layout: &Layout) -> Result<Self> {
        let (d, st) = self.kernel("matmul", &[rhs], || self.data.matmul(lhs, &rhs.data, rhs_layout))?;
        Ok(self.out(d, st))
    }

    fn matmul_bias(&self, lhs: &Layout, rhs: &Self, rhs_layout: &Layout, bias: (&Self, &Layout)) -> Result<Self> {
        let (d, st) = self.kernel("matmul_bias", &[rhs, bias.0], || {
            self.data.matmul_bias(lhs, &rhs.data, rhs_layout, cpu(bias))
        })?;
        Ok(self.out(d, st))
    }
}

impl Nn for FakeStorage {
    fn softmax_last(&self, layout: &Layout, log: bool) -> Result<Self> {
        let (d, st) = self.kernel("softmax_last", &[], || self.data.softmax_last(layout, log))?;
        Ok(self.out(d, st))
    }

    fn softmax_backward(&self, layout: &Layout, g: &Self, g_layout: &Layout, log: bool) -> Result<Self> {
        let (d, st) = self.kernel("softmax_backward", &[g], || {
            self.data.softmax_backward(layout, &g.data, g_layout, log)
        })?;
        Ok(self.out(d, st))
    }

    fn layer_norm(
        &self,
        layout: &Layout,
        weight: (&Self, &Layout),
        bias: (&Self, &Layout),
        eps: f64,
    ) -> Result<(Self, Self, Self)> {
        let ((y, m, r), st) = self.kernel("layer_norm", &[weight.0, bias.0], || {
            self.data.layer_norm(layout, cpu(weight), cpu(bias), eps)
        })?;
        Ok((self.out(y, st), self.out(m, st), self.out(r, st)))
    }

    fn layer_norm_backward(
        &self,
        layout: &Layout,
        weight: (&Self, &Layout),
        mean: (&Self, &Layout),
        rstd: (&Self, &Layout),
        gy: (&Self, &Layout),
    ) -> Result<(Self, Self, Self)> {
        let ((dx, dw, db), st) = self.kernel("layer_norm_backward", &[weight.0, mean.0, rstd.0, gy.0], || {
            self.data
                .layer_norm_backward(layout, cpu(weight), cpu(mean), cpu(rstd), cpu(gy))
        })?;
        Ok((self.out(dx, st), self.out(dw, st), self.out(db, st)))
    }

    fn embedding(&self, layout: &Layout, ids: (&Self, &Layout)) -> Result<Self> {
        let (d, st) = self.kernel("embedding", &[ids.0], || self.data.embedding(layout, cpu(ids)))?;
        Ok(self.out(d, st))
    }

    fn embedding_backward(&self, layout: &Layout, ids: (&Self, &Layout), vocab: usize) -> Result<Self> {
        let (d, st) = self.kernel("embedding_backward", &[ids.0], || {
            self.data.embedding_backward(layout, cpu(ids), vocab)
        })?;
        Ok(self.out(d, st))
    }

    fn causal_fill(&self, layout: &Layout, value: f64) -> Result<Self> {
        let (d, st) = self.kernel("causal_fill", &[], || self.data.causal_fill(layout, value))?;
        Ok(self.out(d, st))
    }

    fn cross_entropy(&self, layout: &Layout, targets: (&Self, &Layout)) -> Result<(Self, Self)> {
        let ((loss, probs), st) = self.kernel("cross_entropy", &[targets.0], || {
            self.data.cross_entropy(layout, cpu(targets))
        })?;
        Ok((self.out(loss, st), self.out(probs, st)))
    }

    fn cross_entropy_backward(&self, layout: &Layout, targets: (&Self, &Layout), g: (&Self, &Layout)) -> Result<Self> {
        let (d, st) = self.kernel("cross_entropy_backward", &[targets.0, g.0], || {
            self.data.cross_entropy_backward(layout, cpu(targets), cpu(g))
        })?;
        Ok(self.out(d, st))
    }
}

impl Attention for FakeStorage {
    fn causal_attention(&self, layout: &Layout, n_heads: usize, scale: f64) -> Result<(Self, Self)> {
        let ((y, p), st) = self.kernel("causal_attention", &[], || {
            self.data.causal_attention(layout, n_heads, scale)
        })?;
        Ok((self.out(y, st), self.out(p, st)))
    }

    fn causal_attention_backward(
        &self,
        layout: &Layout,
        probs: (&Self, &Layout),
        gy: (&Self, &Layout),
        n_heads: usize,
        scale: f64,
    ) -> Result<Self> {
        let (d, st) = self.kernel("causal_attention_backward", &[probs.0, gy.0], || {
            self.data
                .causal_attention_backward(layout, cpu(probs), cpu(gy), n_heads, scale)
        })?;
        Ok(self.out(d, st))
    }
}

impl InPlace for FakeStorage {
    fn fill(&mut self, layout: &Layout, v: f64) -> Result<()> {
        begin(&self.dev, Kind::Kernel("fill"), &[], &[&*self])?;
        self.int_range = None;
        self.data.fill(layout, v)
    }

    fn copy_from(&mut self, layout: &Layout, src: (&Self, &Layout)) -> Result<()> {
        begin(&self.dev, Kind::Kernel("copy_from"), &[src.0], &[&*self])?;
        self.int_range = None;
        self.data.copy_from(layout, cpu(src))
    }

    fn add_scaled_assign(&mut self, layout: &Layout, src: (&Self, &Layout), scale: f64) -> Result<()> {
        begin(&self.dev, Kind::Kernel("add_scaled_assign"), &[src.0], &[&*self])?;
        self.int_range = None;
        self.data.add_scaled_assign(layout, cpu(src), scale)
    }

    fn sgd_step(
        &mut self,
        layout: &Layout,
        grad: (&Self, &Layout),
        momentum_buffer: Option<(&mut Self, &Layout)>,
        s: &SgdScalars,
    ) -> Result<()> {
        match momentum_buffer {
            Some((buf, bl)) => {
                begin(&self.dev, Kind::Kernel("sgd_step"), &[grad.0], &[&*self, &*buf])?;
                self.data.sgd_step(layout, cpu(grad), Some((&mut buf.data, bl)), s)
            }
            None => {
                begin(&self.dev, Kind::Kernel("sgd_step"), &[grad.0], &[&*self])?;
                self.data.sgd_step(layout, cpu(grad), None, s)
            }
        }
    }

    fn adamw_step(
        &mut self,
        layout: &Layout,
        grad: (&Self, &Layout),
        m: (&mut Self, &Layout),
        v: (&mut Self, &Layout),
        s: &AdamWScalars,
    ) -> Result<()> {
        begin(
            &self.dev,
            Kind::Kernel("adamw_step"),
            &[grad.0],
            &[&*self, &*m.0, &*v.0],
        )?;
        self.data
            .adamw_step(layout, cpu(grad), (&mut m.0.data, m.1), (&mut v.0.data, v.1), s)
    }

    fn sgd_step_with_copy(
        &mut self,
        layout: &Layout,
        grad: (&Self, &Layout),
        momentum_buffer: Option<(&mut Self, &Layout)>,
        copy: (&mut Self, &Layout),
        s: &SgdScalars,
    ) -> Result<()> {
        let kind = Kind::Kernel("sgd_step_with_copy");
        match momentum_buffer {
            Some((buf, bl)) => {
                begin(&self.dev, kind, &[grad.0], &[&*self, &*buf, &*copy.0])?;
                let c = (&mut copy.0.data, copy.1);
                self.data
                    .sgd_step_with_copy(layout, cpu(grad), Some((&mut buf.data, bl)), c, s)
            }
            None => {
                begin(&self.dev, kind, &[grad.0], &[&*self, &*copy.0])?;
                let c = (&mut copy.0.data, copy.1);
                self.data.sgd_step_with_copy(layout, cpu(grad), None, c, s)
            }
        }
    }

    fn adamw_step_with_copy(
        &mut self,
        layout: &Layout,
        grad: (&Self, &Layout),
        m: (&mut Self, &Layout),
        v: (&mut Self, &Layout),
        copy: (&mut Self, &Layout),
        s: &AdamWScalars,
    ) -> Result<()> {
        begin(
            &self.dev,
            Kind::Kernel("adamw_step_with_copy"),
            &[grad.0],
            &[&*self, &*m.0, &*v.0, &*copy.0],
        )?;
        self.data.adamw_step_with_copy(
            layout,
            cpu(grad),
            (&mut m.0.data, m.1),
            (&mut v.0.data, v.1),
            (&mut copy.0.data, copy.1),
            s,
        )
    }
}

impl Indexing for FakeStorage {
    /// The indices output knows its range without a read: positions in a row of `n`.
    fn sort_last(&self, layout: &Layout, descending: bool, k: usize) -> Result<(Self, Self)> {
        let ((v, i), st) = self.kernel("sort", &[], || self.data.sort_last(layout, descending, k))?;
        let n = layout.shape().last().copied().unwrap_or(1) as i64;
        let range = (k > 0 && n > 0).then_some((0, n - 1));
        Ok((self.out(v, st), Self::fresh(&self.dev, i, st, range)))
    }

    fn gather(&self, layout: &Layout, dim: usize, ids: (&Self, &Layout)) -> Result<Self> {
        let (d, st) = self.kernel("gather", &[ids.0], || self.data.gather(layout, dim, cpu(ids)))?;
        Ok(self.out(d, st))
    }

    fn scatter_add(&self, layout: &Layout, dim: usize, ids: (&Self, &Layout), src: (&Self, &Layout)) -> Result<Self> {
        let (d, st) = self.kernel("scatter_add", &[ids.0, src.0], || {
            self.data.scatter_add(layout, dim, cpu(ids), cpu(src))
        })?;
        Ok(self.out(d, st))
    }
}
