//! Streams and events of a device, and the raw handles of device memory: what code that
//! orders work across streams (DDP's comm stream, a reducer policy) needs from the tensor
//! crate, on every device.
//!
//! A device runs its ops in issue order on its *compute stream*. [`Stream::new`] makes another
//! stream of the same device, and [`Stream::scope`] runs a closure whose ops (on this thread,
//! on that device) go to it, as `with torch.cuda.stream(s):` does. Streams are ordered only by
//! events: [`Stream::record_event`] on one, [`Stream::wait_event`] on the other; nobody waits
//! on the host unless it calls [`Stream::synchronize`] or [`Event::synchronize`].
//!
//! On the CPU every stream is the calling thread: work is done when the call returns, events
//! are complete when recorded. On the counting fake device ([`crate::fake`]) streams and
//! events are tracked exactly, so tests check the ordering a GPU would need.
//!
//! **Keep-alive rule.** Device memory belongs to the stream it was allocated on and is freed
//! there. Memory used on another stream (an op in a scope of that stream, or raw memory handed
//! out with [`crate::Storage::device_memory`] for that stream) is not freed when its last
//! tensor goes away: the CUDA backend records an event on each such stream at that moment and
//! frees the memory once those events completed (PyTorch's `recordStream`), so a collective
//! still reading a buffer never sees it reused.

use std::sync::Arc;
use std::time::Duration;

use crate::backend::{BackendEvent, BackendStream};
use crate::storage::on_device;
use crate::{DType, Device, Result, TensorError};

/// One stream of a device (cheap to clone; clones are the same stream).
///
/// **Keep-alive rule.** Device memory belongs to the stream it was allocated on and is freed
/// there. Memory used on another stream (an op in a scope of that stream, or raw memory handed
/// out with [`crate::Storage::device_memory`] for that stream) is not freed when its last
/// tensor goes away: the CUDA backend records an event on each such stream at that moment and
/// frees the memory once those events completed (PyTorch's `recordStream`), so a collective
/// still reading a buffer never sees it reused. (The fake device counts such frees.)
#[derive(Clone)]
pub struct Stream {
    device: Device,
    inner: Arc<dyn BackendStream>,
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Stream({}, {:#x})", self.device, self.raw_handle())
    }
}

impl PartialEq for Stream {
    fn eq(&self, other: &Stream) -> bool {
        self.device == other.device && self.raw_handle() == other.raw_handle()
    }
}

impl Eq for Stream {}

impl Stream {
    /// The stream ops on `device` run on outside any [`Stream::scope`]: its compute stream.
    pub fn compute(device: Device) -> Result<Stream> {
        let inner = on_device!(device, B, i => B::compute_stream(i))?;
        Ok(Stream { device, inner })
    }

    /// The stream this thread's ops on `device` run on now: the innermost scope's, else the
    /// compute stream.
    pub fn current(device: Device) -> Result<Stream> {
        if let Some(entered) = crate::scope::current(device) {
            let inner: Result<_> = on_device!(device, B, _i => Ok(B::scoped_stream(&entered)));
            if let Some(inner) = inner? {
                return Ok(Stream { device, inner });
            }
        }
        Stream::compute(device)
    }

    /// A new stream of `device`, independent of its compute stream (on the CPU: the host,
    /// where work is done when the call returns).
    pub fn new(device: Device) -> Result<Stream> {
        let inner = on_device!(device, B, i => B::new_stream(i))?;
        Ok(Stream { device, inner })
    }

    /// The device this stream belongs to.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Runs `f` with this stream as the stream of this thread's ops on its device (the ops of
    /// other threads, and of other devices, are unaffected); the previous stream is back when
    /// `f` returns or panics. Scopes nest.
    pub fn scope<R>(&self, f: impl FnOnce() -> R) -> R {
        crate::scope::with_stream(self.device, self.inner.scoped(), f)
    }

    /// An event recording the work queued on this stream so far (timing enabled).
    pub fn record_event(&self) -> Result<Event> {
        Ok(Event {
            device: self.device,
            inner: self.inner.record()?,
        })
    }

    /// Work queued on this stream from now on starts only after `event` completed. The host
    /// does not wait.
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        if event.device != self.device {
            return Err(TensorError::DeviceMismatch {
                op: "wait_event",
                lhs: self.device,
                rhs: event.device,
            });
        }
        self.inner.wait(&*event.inner)
    }

    /// The host waits until everything queued on this stream finished (counted on the fake
    /// device: inside a training step this is a stall).
    pub fn synchronize(&self) -> Result<()> {
        self.inner.synchronize()
    }

    /// Occupies this stream for `duration` of device time (a kernel that spins on the GPU's
    /// clock), so that a simulated link's transfer time really passes on the stream and shows
    /// against the other streams' work. On the CPU the calling thread sleeps; on the fake
    /// device it is logged.
    pub fn spin(&self, duration: Duration) -> Result<()> {
        self.inner.spin(duration)
    }

    /// The stream's raw handle: the `CUstream` on CUDA (what the collectives' raw handles
    /// carry), the stream's number on the fake device (0 for its compute stream), 0 on the CPU.
    pub fn raw_handle(&self) -> u64 {
        self.inner.raw()
    }
}

/// A point in one stream's work, recorded by [`Stream::record_event`] (cheap to clone).
#[derive(Clone)]
pub struct Event {
    device: Device,
    inner: Arc<dyn BackendEvent>,
}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Event({}, {:#x})", self.device, self.raw_handle())
    }
}

impl Event {
    /// The device whose stream recorded it.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Whether the work it recorded has finished (asks, never waits).
    pub fn is_complete(&self) -> Result<bool> {
        self.inner.is_complete()
    }

    /// The host waits until the work it recorded finished (counted on the fake device).
    pub fn synchronize(&self) -> Result<()> {
        self.inner.synchronize()
    }

    /// Milliseconds from this event to `end` on the device's clock (both must have completed).
    pub fn elapsed_ms(&self, end: &Event) -> Result<f64> {
        self.inner.elapsed_ms(&*end.inner)
    }

    /// The event's raw handle: the `CUevent` on CUDA, its number on the fake device, 0 on the
    /// CPU.
    pub fn raw_handle(&self) -> u64 {
        self.inner.raw()
    }
}

/// The raw handles of a contiguous run of device memory, for code outside the tensor crate
/// that hands it to a collective (NCCL) on a stream: the address of the first element, the
/// element count and type, and the device. Valid while the storage it came from is alive and
/// not written by anyone else; see [`crate::Storage::device_memory`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceMemory {
    /// Address of the first element (a `CUdeviceptr` on CUDA; a host address on the fake
    /// device, never to be dereferenced outside the tensor crate).
    pub ptr: u64,
    /// Number of elements.
    pub len: usize,
    /// Element type.
    pub dtype: DType,
    /// The device.
    pub device: Device,
}
