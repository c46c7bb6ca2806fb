//! A flat f32 buffer in GPU memory, with the events that order it across streams.

use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaSlice};

/// GPU memory handed to a device collective by value and handed back, the same allocation,
/// never a copy (the device counterpart of [`crate::Buffer`]).
#[derive(Debug)]
pub struct DeviceBuffer {
    data: CudaSlice<f32>,
    ready: Option<Arc<CudaEvent>>,
    started: Option<Arc<CudaEvent>>,
    done: Option<Arc<CudaEvent>>,
}

impl DeviceBuffer {
    /// `data`, to be read by the comm stream once `ready` (recorded by whoever wrote it, e.g.
    /// on the compute stream) has completed; `None`: no wait needed.
    pub fn new(data: CudaSlice<f32>, ready: Option<Arc<CudaEvent>>) -> Self {
        DeviceBuffer {
            data,
            ready,
            started: None,
            done: None,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.data.len()
    }

    /// True when the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// The event the comm stream waits on before reading.
    pub fn ready(&self) -> Option<&Arc<CudaEvent>> {
        self.ready.as_ref()
    }

    /// The event the comm stream recorded after the last collective on this buffer: whoever
    /// reads the result waits on it (a stream wait, not a host wait).
    pub fn done(&self) -> Option<&Arc<CudaEvent>> {
        self.done.as_ref()
    }

    /// The memory (and the completion event, if a collective ran on it).
    pub fn into_parts(self) -> (CudaSlice<f32>, Option<Arc<CudaEvent>>) {
        (self.data, self.done)
    }

    pub(crate) fn data_mut(&mut self) -> &mut CudaSlice<f32> {
        &mut self.data
    }

    /// The event the comm stream recorded just before the last collective on this buffer
    /// (with [`DeviceBuffer::done`]: the collective's span on the GPU clock, for timelines).
    pub fn started(&self) -> Option<&Arc<CudaEvent>> {
        self.started.as_ref()
    }

    pub(crate) fn set_done(&mut self, started: Arc<CudaEvent>, done: Arc<CudaEvent>) {
        self.ready = None;
        self.started = Some(started);
        self.done = Some(done);
    }
}
