//! Streams and events of a CUDA device behind [`crate::Stream`] and [`crate::Event`], and
//! the spin kernel that occupies a stream for a set time (the simulated link).

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaStream, LaunchConfig};

use super::device::{fault, CudaDevice, CudaStreamRef};
use super::nvrtc::LINK;
use super::storage::launch;
use crate::backend::{event_of, BackendEvent, BackendStream};
use crate::scope::ScopedStream;
use crate::Result;

impl CudaStreamRef {
    /// Device `ordinal`'s compute stream.
    pub(crate) fn compute(ordinal: usize) -> Result<CudaStreamRef> {
        let dev = CudaDevice::get(ordinal)?;
        let stream = dev.compute_stream().clone();
        Ok(CudaStreamRef { dev, stream })
    }

    /// A new stream of device `ordinal`.
    pub(crate) fn new(ordinal: usize) -> Result<CudaStreamRef> {
        let dev = CudaDevice::get(ordinal)?;
        let stream = dev
            .context()
            .new_stream()
            .map_err(|e| fault(dev.location(), "creating a stream", e))?;
        Ok(CudaStreamRef { dev, stream })
    }
}

impl BackendStream for CudaStreamRef {
    fn scoped(&self) -> ScopedStream {
        Arc::new(self.clone())
    }

    fn record(&self) -> Result<Arc<dyn BackendEvent>> {
        let event = self
            .stream
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| fault(self.dev.location(), "recording an event", e))?;
        Ok(Arc::new(CudaEventRef {
            dev: self.dev.clone(),
            event,
        }))
    }

    fn wait(&self, event: &dyn BackendEvent) -> Result<()> {
        let e = event_of::<CudaEventRef>("wait_event", event)?;
        self.stream
            .wait(&e.event)
            .map_err(|err| fault(self.dev.location(), "making a stream wait on an event", err))
    }

    /// Reaps the frees that waited for the stream.
    fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| fault(self.dev.location(), "synchronizing a stream", e))?;
        self.dev.reap();
        Ok(())
    }

    /// A one-thread kernel that spins on the GPU's nanosecond clock.
    fn spin(&self, duration: Duration) -> Result<()> {
        let ns = duration.as_nanos().min(u64::MAX as u128) as u64;
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        };
        let this = CudaStreamScope(self);
        launch!(this, LINK, "spin_ns", cfg, &ns)
    }

    fn raw(&self) -> u64 {
        self.stream.cu_stream() as u64
    }
}

/// Launches on a given stream (the `launch!` macro asks its target for `function`,
/// `stream` and `location`).
struct CudaStreamScope<'a>(&'a CudaStreamRef);

impl CudaStreamScope<'_> {
    fn function(&self, file: super::nvrtc::KernelFile, name: &str) -> Result<cudarc::driver::CudaFunction> {
        self.0.dev.function(file, name)
    }

    fn stream(&self) -> Arc<CudaStream> {
        self.0.stream.clone()
    }

    fn location(&self) -> crate::Device {
        self.0.dev.location()
    }
}

/// An event of a CUDA device.
pub(crate) struct CudaEventRef {
    dev: Arc<CudaDevice>,
    event: CudaEvent,
}

impl BackendEvent for CudaEventRef {
    fn is_complete(&self) -> Result<bool> {
        self.event
            .try_is_complete()
            .map_err(|e| fault(self.dev.location(), "querying an event", e))
    }

    fn synchronize(&self) -> Result<()> {
        self.event
            .synchronize()
            .map_err(|e| fault(self.dev.location(), "waiting for an event", e))
    }

    fn elapsed_ms(&self, end: &dyn BackendEvent) -> Result<f64> {
        let end = event_of::<CudaEventRef>("elapsed_ms", end)?;
        self.event
            .elapsed_ms(&end.event)
            .map(f64::from)
            .map_err(|e| fault(self.dev.location(), "timing two events", e))
    }

    fn raw(&self) -> u64 {
        self.event.cu_event() as u64
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
