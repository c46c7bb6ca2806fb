//! The reducer's stream/event contract: how a full bucket goes from the compute side to the
//! comm side and back, written once for every kind of stream.
//!
//! The life of one bucket (PyTorch's ProcessGroupNCCL, llm.c's
//! `multi_gpu_async_reduce_gradient`):
//!
//! 1. [`BucketStream::record_ready`]: on the compute side, the moment the bucket's last
//!    gradient is written, a *ready event* is recorded (CUDA: an event on the compute stream;
//!    CPU: the host thread wrote every gradient before announcing it, so readiness is the call
//!    itself).
//! 2. [`BucketStream::launch`]: the comm side waits on that event and runs the bucket's
//!    collective (in place, averaging over ranks); its completion is a *completion event*.
//!    Buckets are launched strictly in bucket order, the same on every rank.
//! 3. [`BucketStream::wait`]: at the end of backward, the compute side waits on every
//!    completion event before the optimizer step (CPU: the host waits for the [`Work`];
//!    CUDA: the compute stream waits on the comm stream's event, the host does not wait) and
//!    the bucket's storage goes back under its gradient views.
//!
//! [`HostStream`] fulfils it over any [`brigade_comm::Communicator`] and
//! [`crate::hooks::CommHook`] (a device bucket is staged through the host); `NcclStream` (the
//! `cuda` feature) over an NCCL communicator on a comm stream of the bucket's GPU. Streams and
//! events are the tensor crate's ([`brigade_tensor::Stream`], [`brigade_tensor::Event`]), and
//! device memory reaches NCCL as comm's raw handles: this crate names no CUDA type.
//! [`Recording`] wraps either stream and writes down the order of the calls, which is how the
//! CPU tests check the logic that also drives NCCL.

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
mod gpu_clock;
mod host;
mod recording;

use std::sync::Arc;
use std::time::Instant;

use brigade_comm::{SpanId, Work};
use brigade_tensor::{Device, Event, Storage};

use crate::hooks::BucketParam;
use crate::DdpError;

#[cfg(feature = "cuda")]
pub use cuda::NcclStream;
pub use host::HostStream;
pub use recording::{Recording, StreamEvent};

/// What the compute side recorded when a bucket's last gradient was written.
#[derive(Debug, Clone)]
pub enum ReadyEvent {
    /// The host wrote every gradient before announcing it: nothing left to wait on.
    Host,
    /// An event on the bucket device's compute stream, after the kernels that wrote it.
    Device(Event),
}

/// A full bucket handed to the comm side.
#[derive(Debug)]
pub struct ReadyBucket {
    /// The bucket's index: its place in the launch order, the same on every rank.
    pub index: usize,
    /// The parameters in its flat buffer, in buffer order.
    pub params: Vec<BucketParam>,
    /// Whether this is the last bucket of the backward pass.
    pub is_last: bool,
    /// The bucket's memory, lent by its flat tensor (the gradient views are empty meanwhile).
    pub storage: Storage,
    /// What the comm side waits on before touching `storage`.
    pub ready: ReadyEvent,
}

/// A bucket's collective in flight: what the compute side waits on before the step.
pub struct InFlight {
    /// The bucket's index.
    pub index: usize,
    /// Elements in the bucket.
    pub numel: usize,
    /// Where the bucket's memory lives (and goes back to).
    pub device: Device,
    /// When the collective was issued.
    pub launched: Instant,
    pub(crate) op: InFlightOp,
}

/// The backend-specific part of an [`InFlight`].
pub(crate) enum InFlightOp {
    /// The hook's work; the bucket's new contents come back through the host.
    Host(Work<Vec<f32>>),
    /// Enqueued on a device's comm stream: the storage (reduced in place) and the completion
    /// event.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Device {
        /// The bucket's memory, kept alive (lent) until the compute stream waited on `done`.
        storage: Storage,
        /// Recorded on the comm stream after the collective.
        done: Event,
    },
}

impl std::fmt::Debug for InFlight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.op {
            InFlightOp::Host(_) => "host",
            InFlightOp::Device { .. } => "device",
        };
        write!(
            f,
            "InFlight(bucket {}, {} x f32 on {}, {kind})",
            self.index, self.numel, self.device
        )
    }
}

/// A bucket back on the compute side: its reduced contents and when its collective ran, where
/// the stream knows it on the host clock.
#[derive(Debug)]
pub struct Landed {
    /// The bucket's index.
    pub index: usize,
    /// What the collective gave back.
    pub contents: Contents,
    /// When the collective ran (start, finish) on the host clock, when known.
    pub ran: Option<(Instant, Instant)>,
}

/// What a bucket's collective gave back, for the reducer to put under the gradient views.
#[derive(Debug)]
pub enum Contents {
    /// The hook's result on the host (normally the bucket's new contents, element for element;
    /// the reducer checks the length and copies it onto the bucket's device).
    Host(Vec<f32>),
    /// The bucket's own memory, reduced in place (NCCL).
    Storage(Storage),
}

/// A bucket whose collective failed: the error, and the storage when it could be given back
/// (so the gradient views are not left empty).
#[derive(Debug)]
pub struct Failed {
    /// What went wrong (names the rank and the collective).
    pub error: DdpError,
    /// The bucket's memory, when the stream still had it.
    pub storage: Option<Storage>,
}

/// The contract the reducer is written against (see the module docs). Calls come from the
/// compute thread: `record_ready` then `launch` for each full bucket in bucket order, then
/// `wait` for every launched bucket, in bucket order, before the optimizer step.
pub trait BucketStream: Send + Sync {
    /// A short name for reports (`host`, `nccl`).
    fn name(&self) -> &'static str;

    /// Compute side: bucket `index`, held in `storage`, is fully written; record its ready
    /// event.
    fn record_ready(&self, index: usize, storage: &Storage) -> crate::Result<ReadyEvent>;

    /// Comm side: wait on `bucket.ready`, then run the bucket's collective; returns at once.
    fn launch(&self, bucket: ReadyBucket) -> crate::Result<InFlight>;

    /// Compute side: wait on the bucket's completion (the host, or the compute stream) and
    /// take its storage back.
    fn wait(&self, in_flight: InFlight) -> Result<Landed, Failed>;

    /// Compute side, for the timeline: backward's kernels from now on belong to the host span
    /// `span` the reducer just began (`None`: the open one ended). A stream that times the
    /// compute stream itself (NCCL: a CUDA event at every change) moves the span onto the GPU
    /// clock once its events completed ([`brigade_comm::Recorder::retime`]); the host stream's
    /// spans are already right.
    fn compute_scope(&self, span: Option<SpanId>) {
        let _ = span;
    }
}

impl<S: BucketStream + ?Sized> BucketStream for Arc<S> {
    fn name(&self) -> &'static str {
        (**self).name()
    }
    fn record_ready(&self, index: usize, storage: &Storage) -> crate::Result<ReadyEvent> {
        (**self).record_ready(index, storage)
    }
    fn launch(&self, bucket: ReadyBucket) -> crate::Result<InFlight> {
        (**self).launch(bucket)
    }
    fn wait(&self, in_flight: InFlight) -> Result<Landed, Failed> {
        (**self).wait(in_flight)
    }
    fn compute_scope(&self, span: Option<SpanId>) {
        (**self).compute_scope(span)
    }
}
