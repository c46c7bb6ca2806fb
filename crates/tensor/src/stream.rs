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
use std::time::{Duration, Instant};

use crate::fake::{FakeEvent, FakeStream};
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
    kind: StreamKind,
}

#[derive(Clone)]
enum StreamKind {
    Host,
    Fake(FakeStream),
    #[cfg(feature = "cuda")]
    Cuda(Arc<crate::cuda::CudaStreamRef>),
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

#[cfg(not(feature = "cuda"))]
fn no_cuda(device: Device) -> TensorError {
    crate::cuda::probe::Unavailable::NotBuilt.on(device)
}

impl Stream {
    /// The stream ops on `device` run on outside any [`Stream::scope`]: its compute stream.
    pub fn compute(device: Device) -> Result<Stream> {
        let kind = match device {
            Device::Cpu => StreamKind::Host,
            Device::Fake(i) => StreamKind::Fake(FakeStream {
                dev: crate::fake::device(i),
                id: 0,
            }),
            #[cfg(feature = "cuda")]
            Device::Cuda(i) => StreamKind::Cuda(Arc::new(crate::cuda::CudaStreamRef::compute(i)?)),
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => return Err(no_cuda(device)),
        };
        Ok(Stream { device, kind })
    }

    /// The stream this thread's ops on `device` run on now: the innermost scope's, else the
    /// compute stream.
    pub fn current(device: Device) -> Result<Stream> {
        if let Some(s) = crate::scope::current(device) {
            if let Some(f) = s.downcast_ref::<FakeStream>() {
                return Ok(Stream {
                    device,
                    kind: StreamKind::Fake(f.clone()),
                });
            }
            #[cfg(feature = "cuda")]
            if let Ok(c) = s.downcast::<crate::cuda::CudaStreamRef>() {
                return Ok(Stream {
                    device,
                    kind: StreamKind::Cuda(c),
                });
            }
        }
        Stream::compute(device)
    }

    /// A new stream of `device`, independent of its compute stream (on the CPU: the host,
    /// where work is done when the call returns).
    pub fn new(device: Device) -> Result<Stream> {
        let kind = match device {
            Device::Cpu => StreamKind::Host,
            Device::Fake(i) => {
                let dev = crate::fake::device(i);
                let id = dev.lock().new_stream();
                StreamKind::Fake(FakeStream { dev, id })
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(i) => StreamKind::Cuda(Arc::new(crate::cuda::CudaStreamRef::new(i)?)),
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => return Err(no_cuda(device)),
        };
        Ok(Stream { device, kind })
    }

    /// The device this stream belongs to.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Runs `f` with this stream as the stream of this thread's ops on its device (the ops of
    /// other threads, and of other devices, are unaffected); the previous stream is back when
    /// `f` returns or panics. Scopes nest.
    pub fn scope<R>(&self, f: impl FnOnce() -> R) -> R {
        // each backend finds its own stream type on the scope stack
        let payload: crate::scope::ScopedStream = match &self.kind {
            StreamKind::Host => Arc::new(()),
            StreamKind::Fake(s) => Arc::new(s.clone()),
            #[cfg(feature = "cuda")]
            StreamKind::Cuda(s) => s.clone(),
        };
        crate::scope::with_stream(self.device, payload, f)
    }

    /// An event recording the work queued on this stream so far (timing enabled).
    pub fn record_event(&self) -> Result<Event> {
        let kind = match &self.kind {
            StreamKind::Host => EventKind::Host(Instant::now()),
            StreamKind::Fake(s) => {
                let (id, clock) = s.dev.lock().record(s.id);
                EventKind::Fake(Arc::new(FakeEvent {
                    dev: s.dev.clone(),
                    id,
                    stream: s.id,
                    clock,
                    at: Instant::now(),
                }))
            }
            #[cfg(feature = "cuda")]
            StreamKind::Cuda(s) => EventKind::Cuda(Arc::new(s.record()?)),
        };
        Ok(Event {
            device: self.device,
            kind,
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
        match (&self.kind, &event.kind) {
            (StreamKind::Host, EventKind::Host(_)) => Ok(()),
            (StreamKind::Fake(s), EventKind::Fake(e)) => {
                s.dev.lock().wait(s.id, e.id, e.stream, &e.clock);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            (StreamKind::Cuda(s), EventKind::Cuda(e)) => s.wait(e),
            _ => Err(TensorError::Invalid {
                op: "wait_event",
                msg: "the event comes from another backend".into(),
            }),
        }
    }

    /// The host waits until everything queued on this stream finished (counted on the fake
    /// device: inside a training step this is a stall).
    pub fn synchronize(&self) -> Result<()> {
        match &self.kind {
            StreamKind::Host => Ok(()),
            StreamKind::Fake(s) => {
                let mut d = s.dev.lock();
                d.host_waited_for_stream(s.id);
                d.counts.host_waits += 1;
                d.log(s.id, crate::fake::FakeWhat::HostWait);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            StreamKind::Cuda(s) => s.synchronize(),
        }
    }

    /// Occupies this stream for `duration` of device time (a kernel that spins on the GPU's
    /// clock), so that a simulated link's transfer time really passes on the stream and shows
    /// against the other streams' work. On the CPU the calling thread sleeps; on the fake
    /// device it is logged.
    pub fn spin(&self, duration: Duration) -> Result<()> {
        match &self.kind {
            StreamKind::Host => {
                std::thread::sleep(duration);
                Ok(())
            }
            StreamKind::Fake(s) => {
                let mut d = s.dev.lock();
                d.issue(s.id);
                d.counts.kernels += 1;
                d.log(s.id, crate::fake::FakeWhat::Spin(duration));
                Ok(())
            }
            #[cfg(feature = "cuda")]
            StreamKind::Cuda(s) => s.spin(duration),
        }
    }

    /// The stream's raw handle: the `CUstream` on CUDA (what the collectives' raw handles
    /// carry), the stream's number on the fake device (0 for its compute stream), 0 on the CPU.
    pub fn raw_handle(&self) -> u64 {
        match &self.kind {
            StreamKind::Host => 0,
            StreamKind::Fake(s) => s.id,
            #[cfg(feature = "cuda")]
            StreamKind::Cuda(s) => s.raw(),
        }
    }
}

/// A point in one stream's work, recorded by [`Stream::record_event`] (cheap to clone).
#[derive(Clone)]
pub struct Event {
    device: Device,
    kind: EventKind,
}

#[derive(Clone)]
enum EventKind {
    Host(Instant),
    Fake(Arc<FakeEvent>),
    #[cfg(feature = "cuda")]
    Cuda(Arc<crate::cuda::CudaEventRef>),
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
        match &self.kind {
            EventKind::Host(_) => Ok(true),
            // the fake device runs each op when it is issued
            EventKind::Fake(_) => Ok(true),
            #[cfg(feature = "cuda")]
            EventKind::Cuda(e) => e.is_complete(),
        }
    }

    /// The host waits until the work it recorded finished (counted on the fake device).
    pub fn synchronize(&self) -> Result<()> {
        match &self.kind {
            EventKind::Host(_) => Ok(()),
            EventKind::Fake(e) => {
                e.dev.lock().host_wait(e.stream, &e.clock);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            EventKind::Cuda(e) => e.synchronize(),
        }
    }

    /// Milliseconds from this event to `end` on the device's clock (both must have completed).
    pub fn elapsed_ms(&self, end: &Event) -> Result<f64> {
        match (&self.kind, &end.kind) {
            (EventKind::Host(a), EventKind::Host(b)) => Ok(signed_ms(*a, *b)),
            (EventKind::Fake(a), EventKind::Fake(b)) => Ok(signed_ms(a.at, b.at)),
            #[cfg(feature = "cuda")]
            (EventKind::Cuda(a), EventKind::Cuda(b)) => a.elapsed_ms(b),
            _ => Err(TensorError::Invalid {
                op: "elapsed_ms",
                msg: "the events come from different backends".into(),
            }),
        }
    }

    /// The event's raw handle: the `CUevent` on CUDA, its number on the fake device, 0 on the
    /// CPU.
    pub fn raw_handle(&self) -> u64 {
        match &self.kind {
            EventKind::Host(_) => 0,
            EventKind::Fake(e) => e.id,
            #[cfg(feature = "cuda")]
            EventKind::Cuda(e) => e.raw(),
        }
    }
}

fn signed_ms(a: Instant, b: Instant) -> f64 {
    if b >= a {
        (b - a).as_secs_f64() * 1e3
    } else {
        -((a - b).as_secs_f64() * 1e3)
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
