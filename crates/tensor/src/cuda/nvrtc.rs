//! Brigade's CUDA C kernels and their compilation by NVRTC.
//!
//! The `.cu` files live beside this module and are embedded with `include_str!`; each is
//! compiled on first use to machine code for the architecture of the device that runs it,
//! and cached per device by `CudaDevice`. NVRTC needs no GPU, so [`compile`] also runs on
//! CPU-only machines: the test `crates/tensor/tests/tensor/cuda_nvrtc.rs` compiles every file
//! for sm_80 and sm_90 with [`compile_strict`] (through `cuda::probe`, which re-exports them).

use std::ffi::{c_char, CString};

use super::probe::{self, Unavailable};

/// Text prepended to every kernel file: shared types and helpers.
pub const COMMON: &str = include_str!("kernels/common.cuh");

/// One `.cu` file of kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KernelFile {
    /// The file name, e.g. `"nn.cu"`; also the NVRTC program name.
    pub name: &'static str,
    /// The file's CUDA C source (without the shared `common.cuh`).
    pub source: &'static str,
}

/// Elementwise unary and broadcasting binary maps.
pub const ELEMENTWISE: KernelFile = KernelFile {
    name: "elementwise.cu",
    source: include_str!("kernels/elementwise.cu"),
};
/// Strided gathers, fills, scaled accumulation and dtype casts.
pub const COPY: KernelFile = KernelFile {
    name: "copy.cu",
    source: include_str!("kernels/copy.cu"),
};
/// Row reductions (sum, max).
pub const REDUCE: KernelFile = KernelFile {
    name: "reduce.cu",
    source: include_str!("kernels/reduce.cu"),
};
/// Softmax, layer norm, embedding, causal mask, cross-entropy.
pub const NN: KernelFile = KernelFile {
    name: "nn.cu",
    source: include_str!("kernels/nn.cu"),
};
/// Fused SGD and AdamW steps.
pub const OPTIM: KernelFile = KernelFile {
    name: "optim.cu",
    source: include_str!("kernels/optim.cu"),
};
/// The sort of rows (sort, argsort, topk), gather and scatter-add along a dim.
pub const INDEXING: KernelFile = KernelFile {
    name: "indexing.cu",
    source: include_str!("kernels/indexing.cu"),
};
/// The simulated link's spin kernel.
pub const LINK: KernelFile = KernelFile {
    name: "link.cu",
    source: include_str!("kernels/link.cu"),
};

/// Every kernel file, in the order the NVRTC test compiles them.
pub const KERNEL_FILES: [KernelFile; 7] = [ELEMENTWISE, COPY, REDUCE, NN, OPTIM, INDEXING, LINK];

/// Why a kernel file did not compile cleanly.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CompileFailure {
    /// NVRTC could not be loaded.
    #[error(transparent)]
    Unavailable(#[from] Unavailable),
    /// NVRTC refused the source; `log` is its diagnostic output.
    #[error("NVRTC could not compile {file} for {arch}: {status}\n{log}")]
    Error {
        /// The kernel file.
        file: &'static str,
        /// The target architecture (`sm_80`, ...).
        arch: String,
        /// NVRTC's status code.
        status: String,
        /// NVRTC's log.
        log: String,
    },
    /// NVRTC compiled the source but printed warnings: Brigade treats them as errors.
    #[error("NVRTC compiled {file} for {arch} with warnings (treated as errors):\n{log}")]
    Warnings {
        /// The kernel file.
        file: &'static str,
        /// The target architecture.
        arch: String,
        /// NVRTC's log.
        log: String,
    },
    /// An NVRTC call failed outside compilation (creating the program, reading its output).
    #[error("NVRTC {during} failed for {file}: {status}")]
    Call {
        /// The kernel file.
        file: &'static str,
        /// The NVRTC call.
        during: &'static str,
        /// NVRTC's status code.
        status: String,
    },
}

/// NVRTC's options for Brigade's kernels: C++17, IEEE division and square root, and the
/// given architecture. `fmad` stays on (as nvcc's default); the optimizer kernels use
/// explicitly rounded intrinsics where the CPU's arithmetic must be matched exactly.
pub fn compile_options(arch: &str) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
        "--prec-div=true".to_string(),
        "--prec-sqrt=true".to_string(),
    ]
}

/// A compiled kernel file: machine code (CUBIN) for one architecture, and NVRTC's log.
///
/// CUBIN rather than PTX: the driver loads it without JIT-compiling, so an NVRTC newer than
/// the driver (CUDA minor-version compatibility) still works, where its PTX would be refused.
#[derive(Debug, Clone)]
pub struct CompiledKernels {
    /// The file it came from.
    pub file: KernelFile,
    /// The architecture it was compiled for.
    pub arch: String,
    /// The CUBIN image.
    pub cubin: Vec<u8>,
    /// NVRTC's log (empty when there was nothing to say; warnings otherwise).
    pub log: String,
}

fn c_chars_to_string(v: &[c_char]) -> String {
    let bytes: Vec<u8> = v.iter().map(|&c| c as u8).take_while(|&b| b != 0).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Owns an NVRTC program so it is destroyed on every path.
struct Program(cudarc::nvrtc::sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program was created by nvrtcCreateProgram and is destroyed once. A
        // failure to destroy leaks the program; there is nothing better to do in drop.
        let _ = unsafe { cudarc::nvrtc::result::destroy_program(self.0) };
    }
}

/// Compiles `file` (with the shared `common.cuh` prepended) to CUBIN for `arch` (e.g. `"sm_90"`).
/// Warnings do not fail this call (the run-time path); [`compile_strict`] refuses them.
pub fn compile(file: KernelFile, arch: &str) -> Result<CompiledKernels, CompileFailure> {
    if !probe::nvrtc_present() {
        return Err(Unavailable::Nvrtc.into());
    }
    let call = |during: &'static str| {
        move |e: cudarc::nvrtc::result::NvrtcError| CompileFailure::Call {
            file: file.name,
            during,
            status: format!("{:?}", e.0),
        }
    };
    let src = format!("{COMMON}\n#line 1 \"{}\"\n{}", file.name, file.source);
    let src = CString::new(src).map_err(|_| CompileFailure::Call {
        file: file.name,
        during: "reading the source (it holds a NUL byte)",
        status: String::new(),
    })?;
    let name = CString::new(file.name).map_err(|_| CompileFailure::Call {
        file: file.name,
        during: "naming the program",
        status: String::new(),
    })?;
    let prog = Program(cudarc::nvrtc::result::create_program(&src, Some(&name)).map_err(call("nvrtcCreateProgram"))?);
    let options = compile_options(arch);
    // SAFETY: `prog` is a live program; the options are plain strings.
    let compiled = unsafe { cudarc::nvrtc::result::compile_program(prog.0, &options) };
    // SAFETY: `prog` is a live program.
    let log = unsafe { cudarc::nvrtc::result::get_program_log(prog.0) }.map_err(call("nvrtcGetProgramLog"))?;
    let log = c_chars_to_string(&log).trim().to_string();
    if let Err(e) = compiled {
        return Err(CompileFailure::Error {
            file: file.name,
            arch: arch.to_string(),
            status: format!("{:?}", e.0),
            log,
        });
    }
    let mut size = 0usize;
    // SAFETY: `prog` compiled successfully; `size` is a valid out-pointer.
    unsafe { cudarc::nvrtc::sys::nvrtcGetCUBINSize(prog.0, &mut size) }
        .result()
        .map_err(call("nvrtcGetCUBINSize"))?;
    let mut cubin = vec![0u8; size];
    // SAFETY: `cubin` holds exactly the size NVRTC reported.
    unsafe { cudarc::nvrtc::sys::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr() as *mut c_char) }
        .result()
        .map_err(call("nvrtcGetCUBIN"))?;
    Ok(CompiledKernels {
        file,
        arch: arch.to_string(),
        cubin,
        log,
    })
}

/// [`compile`], but any warning in NVRTC's log is a failure: what the kernel test uses, so
/// the kernels stay warning-free on every architecture.
pub fn compile_strict(file: KernelFile, arch: &str) -> Result<CompiledKernels, CompileFailure> {
    let c = compile(file, arch)?;
    if !c.log.is_empty() {
        return Err(CompileFailure::Warnings {
            file: file.name,
            arch: arch.to_string(),
            log: c.log,
        });
    }
    Ok(c)
}

/// The environment variable naming a directory where compiled kernel files are kept between
/// processes (the GPU check sets it: each `brigade` run would otherwise compile its kernels
/// anew).
pub const CACHE_ENV: &str = "BRIGADE_KERNEL_CACHE";

/// FNV-1a, 64 bits: the cache key of a source, options and NVRTC version (not a security
/// boundary: the directory is the user's own).
fn fnv64(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for &b in *p {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// [`compile`]'s CUBIN, read from `$BRIGADE_KERNEL_CACHE` when an earlier process compiled the
/// same source with the same options and NVRTC, else compiled and written there (atomically:
/// a temporary file renamed into place). Without the variable, or on any cache error, it
/// compiles.
pub fn compile_cached(file: KernelFile, arch: &str) -> Result<Vec<u8>, CompileFailure> {
    let Some(dir) = std::env::var_os(CACHE_ENV).map(std::path::PathBuf::from) else {
        return compile(file, arch).map(|c| c.cubin);
    };
    if !probe::nvrtc_present() {
        return Err(Unavailable::Nvrtc.into());
    }
    let (mut major, mut minor) = (0i32, 0i32);
    // SAFETY: two valid out-pointers; NVRTC is loadable (checked above).
    let _ = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    let options = compile_options(arch).join(" ");
    let version = format!("{major}.{minor}");
    let key = fnv64(&[
        COMMON.as_bytes(),
        file.source.as_bytes(),
        options.as_bytes(),
        version.as_bytes(),
    ]);
    let path = dir.join(format!("{}-{arch}-{key:016x}.cubin", file.name));
    if let Ok(cubin) = std::fs::read(&path) {
        if !cubin.is_empty() {
            return Ok(cubin);
        }
    }
    let cubin = compile(file, arch)?.cubin;
    let tmp = dir.join(format!(".{}.{}.tmp", file.name, std::process::id()));
    let stored = std::fs::create_dir_all(&dir)
        .and_then(|()| std::fs::write(&tmp, &cubin))
        .and_then(|()| std::fs::rename(&tmp, &path));
    if stored.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    Ok(cubin)
}

#[cfg(test)]
mod cache_tests {
    use super::{compile_cached, CACHE_ENV, COPY, LINK};

    #[test]
    fn a_compiled_file_is_kept_and_read_back_and_the_key_follows_the_source() {
        if !super::probe::nvrtc_present() {
            crate::testing::report_skip("nvrtc::cache_tests", &"libnvrtc is not on LD_LIBRARY_PATH");
            return;
        }
        let dir = std::env::temp_dir().join(format!("brigade-kernel-cache-{}", std::process::id()));
        let _scratch = crate::scratch::Scratch::absent(dir.clone());
        // no other test of this binary reads the variable
        std::env::set_var(CACHE_ENV, &dir);
        let first = compile_cached(LINK, "sm_80").unwrap();
        let files: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
        assert_eq!(files.len(), 1, "{files:?}");
        // a stored file is what comes back (doctor it: the cache, not NVRTC, answered)
        std::fs::write(&files[0], b"cached").unwrap();
        assert_eq!(compile_cached(LINK, "sm_80").unwrap(), b"cached");
        assert_ne!(
            compile_cached(COPY, "sm_80").unwrap(),
            first,
            "another source, another key"
        );
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 2);
        std::env::remove_var(CACHE_ENV);
    }
}
