//! The reducer's stream/event contract: how a full bucket goes from the compute side to the
//! comm side (and its policy) and back, written once for every kind of stream.
//!
//! The life of one bucket (PyTorch's ProcessGroupNCCL, llm.c's
//! `multi_gpu_async_reduce_gradient`):
//!
//! 1. [`BucketStream::record_ready`]: on the compute side, the moment the bucket's last
//!    gradient is written, a *ready event* is recorded (CUDA: an event on the compute stream;
//!    CPU: the host thread wrote every gradient before announcing it, so readiness is the call
//!    itself).
//! 2. [`BucketStream::launch`]: the bucket goes to the reducer policy with the stream's
//!    [`Collectives`] handle, scoped to the bucket; the policy issues its collectives (which
//!    wait on the ready event) and returns the future of its [`crate::policy::Reduction`].
//!    Buckets are launched strictly in bucket order, the same on every rank.
//! 3. [`BucketStream::wait`]: at the end of backward, the compute side waits on every
//!    bucket's completion before the optimizer step (CPU: the host waits for the future;
//!    CUDA: the compute stream waits on the comm stream's events, the host does not wait) and
//!    the reducer puts the result back under the gradient views.
//!
//! [`HostStream`] fulfils it over any [`brigade_comm::Communicator`] (a device bucket is staged
//! through the host by each collective, on the compute side); [`DeviceStream`] on a comm
//! stream of the bucket's device, every policy's compute and collectives enqueued there behind
//! the ready event, over a [`crate::policy::CollectiveBackend`] that enqueues on the device:
//! `NcclStream` (the `cuda` feature) is NCCL's, and [`HostStagedComm`] any communicator's,
//! which runs the NCCL stream's own code on the counting fake device in CPU tests. Streams and events are the tensor crate's
//! ([`brigade_tensor::Stream`], [`brigade_tensor::Event`]), and device memory reaches NCCL as
//! comm's raw handles: this crate names no CUDA type. [`Recording`] wraps either stream and
//! writes down the order of the calls, which is how the CPU tests check the logic that also
//! drives NCCL.

#[cfg(feature = "cuda")]
mod cuda;
mod device;
mod device_collectives;
mod gpu_clock;
mod host;
mod host_staged;
mod recording;

use std::sync::Arc;
use std::time::Instant;

use brigade_comm::{CommMeter, SpanId};
use brigade_tensor::{Event, Tensor};

use crate::collectives::Collectives;
use crate::policy::{PolicyBucket, ReducerPolicy, Reduction};
use crate::DdpError;

#[cfg(feature = "cuda")]
pub use cuda::NcclStream;
pub use device::DeviceStream;
pub use host::HostStream;
pub use host_staged::HostStagedComm;
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
    /// The bucket as the policy sees it.
    pub bucket: PolicyBucket,
    /// What the comm side waits on before touching the bucket.
    pub ready: ReadyEvent,
    /// This rank has no data this step: the bucket is zeros and goes to
    /// [`ReducerPolicy::reduce_joined`].
    pub joined: bool,
}

/// A bucket's reduction in flight: what the compute side waits on before the step.
pub struct InFlight {
    /// The bucket's index.
    pub index: usize,
    /// When the bucket was handed to the policy.
    pub launched: Instant,
    /// The policy's reduction.
    pub(crate) reduction: Reduction,
    /// What the bucket's collectives sent so far (its part of DDP's meter).
    pub(crate) meter: CommMeter,
    /// Which stream launched it.
    pub(crate) launched_by: &'static str,
}

impl std::fmt::Debug for InFlight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "InFlight(bucket {}, on the {} stream)", self.index, self.launched_by)
    }
}

/// What a bucket's reduction gave back, for the reducer to put under the gradient views.
#[derive(Debug)]
pub enum Landing {
    /// The bucket's new contents.
    Full(Tensor),
    /// This rank's shard, and whether the full buffer is kept.
    Shard {
        /// The shard.
        tensor: Tensor,
        /// Keep the full buffer allocated.
        keep_full: bool,
    },
}

/// A bucket back on the compute side: what its reduction gave, when its collectives ran (on
/// the host clock, when known) and what they sent.
#[derive(Debug)]
pub struct Landed {
    /// The bucket's index.
    pub index: usize,
    /// What the reduction gave back.
    pub landing: Landing,
    /// When its collectives ran (first start, last finish) on the host clock, when known.
    pub ran: Option<(Instant, Instant)>,
    /// Bytes this rank sent on the wire for the bucket (ring algorithms).
    pub wire_bytes: f64,
}

/// A bucket whose reduction failed (the reducer gives its views zeros before reporting).
#[derive(Debug)]
pub struct Failed {
    /// What went wrong (names the rank and the collective).
    pub error: DdpError,
}

/// The contract the reducer is written against (see the module docs). Calls come from the
/// compute thread: `record_ready` then `launch` for each full bucket in bucket order, then
/// `wait` for every launched bucket, in bucket order, before the optimizer step.
pub trait BucketStream: Send + Sync {
    /// A short name for reports (`host`, `nccl`).
    fn name(&self) -> &'static str;

    /// The handle policies issue collectives through on this stream (DDP gives it its meter and
    /// hands it back to [`BucketStream::launch`]).
    fn collectives(&self) -> Collectives;

    /// Compute side: bucket `index`, whose flat buffer is `flat`, is fully written; record its
    /// ready event.
    fn record_ready(&self, index: usize, flat: &Tensor) -> crate::Result<ReadyEvent>;

    /// Comm side: hand `bucket` to `policy` with `collectives` (this stream's, metered); returns
    /// at once.
    fn launch(
        &self,
        bucket: ReadyBucket,
        policy: &mut dyn ReducerPolicy,
        collectives: &Collectives,
    ) -> crate::Result<InFlight>;

    /// Compute side: wait on the bucket's completion (the host, or the compute stream) and take
    /// what its reduction gave back.
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
    fn collectives(&self) -> Collectives {
        (**self).collectives()
    }
    fn record_ready(&self, index: usize, flat: &Tensor) -> crate::Result<ReadyEvent> {
        (**self).record_ready(index, flat)
    }
    fn launch(
        &self,
        bucket: ReadyBucket,
        policy: &mut dyn ReducerPolicy,
        collectives: &Collectives,
    ) -> crate::Result<InFlight> {
        (**self).launch(bucket, policy, collectives)
    }
    fn wait(&self, in_flight: InFlight) -> Result<Landed, Failed> {
        (**self).wait(in_flight)
    }
    fn compute_scope(&self, span: Option<SpanId>) {
        (**self).compute_scope(span)
    }
}

/// Hands `ready` to `policy` with `collectives` scoped to the bucket (what every stream's
/// `launch` does once the bucket may be touched).
pub(crate) fn hand_to_policy(
    collectives: &Collectives,
    ready: ReadyBucket,
    policy: &mut dyn ReducerPolicy,
    launched_by: &'static str,
) -> crate::Result<InFlight> {
    let index = ready.bucket.index;
    let comm = collectives.for_bucket(index);
    let launched = Instant::now();
    let reduction = if ready.joined {
        policy.reduce_joined(ready.bucket, &comm)?
    } else {
        policy.reduce(ready.bucket, &comm)?
    };
    Ok(InFlight {
        index,
        launched,
        reduction,
        meter: comm.meter().clone(),
        launched_by,
    })
}

/// Waits (on the host) for a reduction's future and turns it into what lands.
pub(crate) fn wait_reduction(in_flight: InFlight) -> Result<Landed, Failed> {
    let InFlight {
        index,
        reduction,
        meter,
        ..
    } = in_flight;
    let waited = match reduction {
        Reduction::Full(w) => w.wait_timed().map(|(t, timing)| (Landing::Full(t), timing)),
        Reduction::Shard { shard, keep_full } => shard
            .wait_timed()
            .map(|(tensor, timing)| (Landing::Shard { tensor, keep_full }, timing)),
    };
    let wire_bytes = meter.totals().wire_bytes;
    match waited {
        Ok((landing, timing)) => Ok(Landed {
            index,
            landing,
            ran: Some((timing.started, timing.finished)),
            wire_bytes,
        }),
        Err(error) => Err(Failed { error }),
    }
}
