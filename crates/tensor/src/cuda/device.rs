//! One CUDA device as Brigade uses it: a context (cudarc's per-slice event tracking off:
//! explicit events order the streams), one compute stream, cuBLAS handles per stream, the
//! kernel modules compiled for it so far, a memory pool that keeps its memory, and the
//! buffers whose free waits for another stream (the keep-alive rule).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaEvent, CudaFunction, CudaModule, CudaStream};
use cudarc::nvrtc::Ptx;

use super::element::CudaBuffer;
use super::nvrtc::{self, KernelFile};
use super::probe;
use crate::{Device, Result, TensorError};

/// A buffer freed while other streams still had work queued on it: the events recorded on
/// those streams at that moment. Freed (on its own stream) once every event completed.
struct Deferred {
    _buf: CudaBuffer,
    events: Vec<CudaEvent>,
}

/// A stream of one CUDA device (what the scope stack holds for it; its part of the contract is in
/// `streams.rs`).
#[derive(Clone)]
pub(crate) struct CudaStreamRef {
    pub(crate) dev: Arc<CudaDevice>,
    pub(crate) stream: Arc<CudaStream>,
}

/// A CUDA device, created once per ordinal and shared by every tensor on it.
pub(crate) struct CudaDevice {
    ordinal: usize,
    ctx: Arc<CudaContext>,
    compute: Arc<CudaStream>,
    /// One cuBLAS handle per stream (keyed by the `CUstream`): a handle is bound to one
    /// stream, and rank threads may use the device's streams at the same time.
    blas: Mutex<HashMap<usize, Arc<CudaBlas>>>,
    arch: String,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    deferred: Mutex<Vec<Deferred>>,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaDevice(cuda:{}, {})", self.ordinal, self.arch)
    }
}

/// The crate's error for a failed CUDA, cuBLAS or NVRTC call on `device`: the backend
/// contract reports device faults as `DeviceUnavailable`, naming what failed.
pub(crate) fn fault(device: Device, what: &str, e: impl std::fmt::Debug) -> TensorError {
    TensorError::DeviceUnavailable {
        device,
        reason: format!("{what} failed: {e:?}"),
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn devices() -> &'static Mutex<HashMap<usize, Arc<CudaDevice>>> {
    static DEVICES: OnceLock<Mutex<HashMap<usize, Arc<CudaDevice>>>> = OnceLock::new();
    DEVICES.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Keeps freed memory in the device's default pool instead of handing it back to the driver
/// at every synchronize (the pool's release threshold is 0 by default, so each step would
/// map its activations anew).
fn keep_pool_memory(ctx: &CudaContext) -> std::result::Result<(), cudarc::driver::DriverError> {
    if !ctx.has_async_alloc() {
        return Ok(());
    }
    ctx.bind_to_thread()?;
    // SAFETY: the device comes from a live context; the attribute takes a u64 threshold.
    unsafe {
        let pool = cudarc::driver::result::device::get_default_mem_pool(ctx.cu_device())?;
        let mut threshold = u64::MAX;
        cudarc::driver::sys::cuMemPoolSetAttribute(
            pool,
            cudarc::driver::sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut threshold as *mut u64 as *mut std::ffi::c_void,
        )
        .result()
    }
}

impl CudaDevice {
    /// The device with this ordinal, opened on first use: everything it needs is probed
    /// first ([`probe::require`]), so a missing driver, library or GPU is a typed error.
    pub(crate) fn get(ordinal: usize) -> Result<Arc<CudaDevice>> {
        let mut map = lock(devices());
        if let Some(d) = map.get(&ordinal) {
            return Ok(d.clone());
        }
        let device = Device::Cuda(ordinal);
        probe::require(ordinal).map_err(|u| u.on(device))?;
        let ctx = CudaContext::new(ordinal).map_err(|e| fault(device, "creating the CUDA context", e))?;
        // Explicit events order the streams (ready, done, and the keep-alive rule of
        // `crate::stream`): cudarc's per-slice events (a record and a wait per kernel argument,
        // two event creations per allocation) would only repeat them. Must precede every
        // allocation and stream of this context.
        // SAFETY: every cross-stream use of Brigade's memory is ordered by those events.
        unsafe { ctx.disable_event_tracking() };
        keep_pool_memory(&ctx).map_err(|e| fault(device, "keeping the memory pool's memory", e))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| fault(device, "reading the compute capability", e))?;
        let compute = ctx
            .new_stream()
            .map_err(|e| fault(device, "creating the compute stream", e))?;
        let d = Arc::new(CudaDevice {
            ordinal,
            ctx,
            compute,
            blas: Mutex::new(HashMap::new()),
            arch: format!("sm_{major}{minor}"),
            modules: Mutex::new(HashMap::new()),
            deferred: Mutex::new(Vec::new()),
        });
        map.insert(ordinal, d.clone());
        Ok(d)
    }

    /// The [`Device`] this is.
    pub(crate) fn location(&self) -> Device {
        Device::Cuda(self.ordinal)
    }

    /// The context.
    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The device's compute stream.
    pub(crate) fn compute_stream(&self) -> &Arc<CudaStream> {
        &self.compute
    }

    /// The stream this thread's ops run on now: the innermost [`crate::Stream::scope`] of
    /// this device, else the compute stream.
    pub(crate) fn stream(&self) -> Arc<CudaStream> {
        crate::scope::current(self.location())
            .and_then(|s| s.downcast_ref::<CudaStreamRef>().map(|r| r.stream.clone()))
            .unwrap_or_else(|| self.compute.clone())
    }

    /// The cuBLAS handle of the current stream (default math mode: f32 GEMMs are true f32, no
    /// TF32), created on first use.
    pub(crate) fn blas(&self) -> Result<Arc<CudaBlas>> {
        let stream = self.stream();
        let key = stream.cu_stream() as usize;
        let mut map = lock(&self.blas);
        if let Some(b) = map.get(&key) {
            return Ok(b.clone());
        }
        let b = Arc::new(CudaBlas::new(stream).map_err(|e| fault(self.location(), "creating a cuBLAS handle", e))?);
        map.insert(key, b.clone());
        Ok(b)
    }

    /// The architecture kernels are compiled for (`sm_90` on an H100/H200).
    pub(crate) fn arch(&self) -> &str {
        &self.arch
    }

    /// Kernel `name` from `file`, compiling and loading the file on first use.
    pub(crate) fn function(&self, file: KernelFile, name: &str) -> Result<CudaFunction> {
        let device = self.location();
        let module = {
            let mut modules = lock(&self.modules);
            match modules.get(file.name) {
                Some(m) => m.clone(),
                None => {
                    let cubin =
                        nvrtc::compile_cached(file, &self.arch).map_err(|e| TensorError::DeviceUnavailable {
                            device,
                            reason: e.to_string(),
                        })?;
                    let m = self
                        .ctx
                        .load_module(Ptx::from_binary(cubin))
                        .map_err(|e| fault(device, &format!("loading the CUBIN of {}", file.name), e))?;
                    modules.insert(file.name, m.clone());
                    m
                }
            }
        };
        module
            .load_function(name)
            .map_err(|e| fault(device, &format!("finding kernel {name} in {}", file.name), e))
    }

    /// Waits until all work queued on the compute stream has finished.
    pub(crate) fn synchronize(&self) -> Result<()> {
        self.compute
            .synchronize()
            .map_err(|e| fault(self.location(), "synchronizing the compute stream", e))?;
        self.reap();
        Ok(())
    }

    /// Frees `buf` (on its own stream) once every one of `events` completed: the keep-alive
    /// rule for memory another stream still uses.
    pub(crate) fn defer_free(&self, buf: CudaBuffer, events: Vec<CudaEvent>) {
        lock(&self.deferred).push(Deferred { _buf: buf, events });
        self.reap();
    }

    /// Frees the deferred buffers whose events completed (asks the events, never waits).
    pub(crate) fn reap(&self) {
        let mut d = lock(&self.deferred);
        if d.is_empty() {
            return;
        }
        // a failed query keeps the buffer: leaking beats freeing memory still in use
        d.retain(|x| !x.events.iter().all(|e| e.try_is_complete().unwrap_or(false)));
    }
}
