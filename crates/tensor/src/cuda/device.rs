//! One CUDA device as Brigade uses it: a context, one compute stream, a cuBLAS handle, and
//! the kernel modules compiled for it so far.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream};
use cudarc::nvrtc::Ptx;

use super::nvrtc::{self, KernelFile};
use super::probe;
use crate::{Device, Result, TensorError};

/// A CUDA device, created once per ordinal and shared by every tensor on it.
pub struct CudaDevice {
    ordinal: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    arch: String,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaDevice(cuda:{}, {})", self.ordinal, self.arch)
    }
}

/// The crate's error for a failed CUDA, cuBLAS or NVRTC call on `device`: the backend
/// contract reports device faults as `DeviceUnavailable`, naming what failed.
pub fn fault(device: Device, what: &str, e: impl std::fmt::Debug) -> TensorError {
    TensorError::DeviceUnavailable {
        device,
        reason: format!("{what} failed: {e:?}"),
    }
}

fn devices() -> &'static Mutex<HashMap<usize, Arc<CudaDevice>>> {
    static DEVICES: OnceLock<Mutex<HashMap<usize, Arc<CudaDevice>>>> = OnceLock::new();
    DEVICES.get_or_init(|| Mutex::new(HashMap::new()))
}

impl CudaDevice {
    /// The device with this ordinal, opened on first use: everything it needs is probed
    /// first ([`probe::require`]), so a missing driver, library or GPU is a typed error.
    pub fn get(ordinal: usize) -> Result<Arc<CudaDevice>> {
        let mut map = devices().lock().unwrap_or_else(|p| p.into_inner());
        if let Some(d) = map.get(&ordinal) {
            return Ok(d.clone());
        }
        let device = Device::Cuda(ordinal);
        probe::require(ordinal).map_err(|u| u.on(device))?;
        let ctx = CudaContext::new(ordinal).map_err(|e| fault(device, "creating the CUDA context", e))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| fault(device, "reading the compute capability", e))?;
        let stream = ctx
            .new_stream()
            .map_err(|e| fault(device, "creating the compute stream", e))?;
        let blas = CudaBlas::new(stream.clone()).map_err(|e| fault(device, "creating the cuBLAS handle", e))?;
        let d = Arc::new(CudaDevice {
            ordinal,
            ctx,
            stream,
            blas,
            arch: format!("sm_{major}{minor}"),
            modules: Mutex::new(HashMap::new()),
        });
        map.insert(ordinal, d.clone());
        Ok(d)
    }

    /// The [`Device`] this is.
    pub fn location(&self) -> Device {
        Device::Cuda(self.ordinal)
    }

    /// The compute stream every kernel, copy and GEMM of this device runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The cuBLAS handle, bound to the compute stream (default math mode: f32 GEMMs are
    /// true f32, no TF32).
    pub fn blas(&self) -> &CudaBlas {
        &self.blas
    }

    /// The architecture kernels are compiled for (`sm_90` on an H100/H200).
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// Kernel `name` from `file`, compiling and loading the file on first use.
    pub fn function(&self, file: KernelFile, name: &str) -> Result<CudaFunction> {
        let device = self.location();
        let module = {
            let mut modules = self.modules.lock().unwrap_or_else(|p| p.into_inner());
            match modules.get(file.name) {
                Some(m) => m.clone(),
                None => {
                    let compiled = nvrtc::compile(file, &self.arch).map_err(|e| TensorError::DeviceUnavailable {
                        device,
                        reason: e.to_string(),
                    })?;
                    let m = self
                        .ctx
                        .load_module(Ptx::from_binary(compiled.cubin))
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
    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| fault(self.location(), "synchronizing the compute stream", e))
    }
}
