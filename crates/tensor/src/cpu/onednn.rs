//! oneDNN, the CPU library under PyTorch's CPU matrix products, loaded at run time the way the
//! CUDA libraries are: `libdnnl.so.2` (Debian's `libdnnl2`), or the file `BRIGADE_ONEDNN` names.
//! Its f32 GEMM (`dnnl_sgemm`: row-major, either operand read transposed at no cost) computes
//! the CPU's f32 products, and its bf16 matmul primitive the bf16 ones wherever oneDNN's
//! implementation for the shape runs on AMX tiles (elsewhere bf16 is widened and goes
//! through `dnnl_sgemm`, which is no slower than oneDNN's AVX-512 bf16 code).
//!
//! Threads: Debian's oneDNN runs on OpenMP, whose thread count belongs to the calling thread.
//! Every call first sets the calling thread's count to its share (its compute threads, or 1
//! inside a parallel batch loop), so two ranks' threads never oversubscribe each other and a
//! product's summation order, which depends on the thread count, is the same run to run. Idle
//! OpenMP threads sleep instead of spinning against the communication thread
//! (`OMP_WAIT_POLICY=passive`, set before the library loads unless the user set it).
//! oneDNN's scratch memory is its own: the memory meter does not count it.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

use libloading::Library;

use crate::{Result, TensorError};

/// Which library computes the CPU's f32 and bf16 matrix products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CpuGemm {
    /// oneDNN, loaded at run time (`dnnl_sgemm`, and its bf16 matmul on AMX).
    OneDnn,
    /// The `gemm` crates, compiled in: every CPU, no library needed.
    GemmCrate,
}

/// `dnnl_sgemm(transa, transb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc)`, row-major.
type Sgemm = unsafe extern "C" fn(
    c_char,
    c_char,
    i64,
    i64,
    i64,
    f32,
    *const f32,
    i64,
    *const f32,
    i64,
    f32,
    *mut f32,
    i64,
) -> c_int;

/// oneDNN's C API as Brigade calls it (the 2.x ABI of `libdnnl.so.2`).
struct Api {
    sgemm: Sgemm,
    /// `omp_set_num_threads`, found through oneDNN's own dependencies (`None`: a sequential build).
    omp_set_num_threads: Option<unsafe extern "C" fn(c_int)>,
    engine_create: unsafe extern "C" fn(*mut *mut c_void, c_int, usize) -> c_int,
    stream_create: unsafe extern "C" fn(*mut *mut c_void, *mut c_void, u32) -> c_int,
    md_init_by_strides: unsafe extern "C" fn(*mut MemoryDesc, c_int, *const i64, c_int, *const i64) -> c_int,
    matmul_desc_init: unsafe extern "C" fn(
        *mut MatmulDesc,
        *const MemoryDesc,
        *const MemoryDesc,
        *const MemoryDesc,
        *const MemoryDesc,
    ) -> c_int,
    pd_create:
        unsafe extern "C" fn(*mut *mut c_void, *const c_void, *const c_void, *mut c_void, *const c_void) -> c_int,
    pd_query: unsafe extern "C" fn(*const c_void, c_int, c_int, *mut c_void) -> c_int,
    pd_destroy: unsafe extern "C" fn(*mut c_void) -> c_int,
    primitive_create: unsafe extern "C" fn(*mut *mut c_void, *const c_void) -> c_int,
    primitive_execute: unsafe extern "C" fn(*const c_void, *mut c_void, c_int, *const ExecArg) -> c_int,
    memory_create: unsafe extern "C" fn(*mut *mut c_void, *const MemoryDesc, *mut c_void, *mut c_void) -> c_int,
    memory_set_data_handle: unsafe extern "C" fn(*mut c_void, *mut c_void) -> c_int,
    stream_wait: unsafe extern "C" fn(*mut c_void) -> c_int,
}

/// `dnnl_memory_desc_t` (696 bytes in oneDNN 2.6, 8-aligned): filled and read by oneDNN only.
#[repr(C, align(8))]
struct MemoryDesc([u8; 1024]);
/// `dnnl_matmul_desc_t` (2,800 bytes in oneDNN 2.6): filled and read by oneDNN only.
#[repr(C, align(8))]
struct MatmulDesc([u8; 4096]);
/// `dnnl_exec_arg_t`.
#[repr(C)]
struct ExecArg {
    arg: c_int,
    memory: *mut c_void,
}

const STATUS_SUCCESS: c_int = 0;
const ENGINE_CPU: c_int = 1;
const STREAM_DEFAULT: u32 = 1;
const DT_BF16: c_int = 2;
const QUERY_IMPL_INFO_STR: c_int = 8;
const ARG_SRC: c_int = 1;
const ARG_DST: c_int = 17;
const ARG_WEIGHTS: c_int = 33;
const ARG_BIAS: c_int = 41;
/// `DNNL_RUNTIME_SEQ`, `DNNL_RUNTIME_OMP`.
const RUNTIME_SEQ: u32 = 1;
const RUNTIME_OMP: u32 = 2;

/// `dnnl_version_t`.
#[repr(C)]
struct Version {
    major: c_int,
    minor: c_int,
    patch: c_int,
    hash: *const c_char,
    cpu_runtime: u32,
    gpu_runtime: u32,
}

/// oneDNN, loaded.
pub(crate) struct OneDnn {
    api: Api,
    /// The engine every bf16 primitive is created on (one CPU engine per process).
    engine: usize,
    /// Whether oneDNN dispatches to AMX on this CPU (so bf16 primitives are tried at all).
    amx: bool,
    /// "onednn 2.6.3 (avx512_core_amx)".
    name: String,
    _lib: Library,
}

/// The words for oneDNN's `dnnl_cpu_isa_t`.
fn isa_name(isa: c_int) -> String {
    match isa {
        0x1 => "sse41".into(),
        0x3 => "avx".into(),
        0x7 => "avx2".into(),
        0x407 => "avx2_vnni".into(),
        0x27 => "avx512_core".into(),
        0x67 => "avx512_core_vnni".into(),
        0xe7 => "avx512_core_bf16".into(),
        0x3e7 => "avx512_core_amx".into(),
        i => format!("isa {i:#x}"),
    }
}

/// The library file: `BRIGADE_ONEDNN`, else Debian's soname.
fn library_path() -> String {
    std::env::var("BRIGADE_ONEDNN").unwrap_or_else(|_| "libdnnl.so.2".into())
}

impl OneDnn {
    /// Loads oneDNN (an error says which file and why).
    fn load() -> std::result::Result<OneDnn, String> {
        let path = library_path();
        // read by OpenMP when it starts, which is when oneDNN loads
        if std::env::var_os("OMP_WAIT_POLICY").is_none() {
            std::env::set_var("OMP_WAIT_POLICY", "passive");
        }
        // SAFETY: loading runs the library's initialisers; oneDNN's only set up its own state.
        let lib = unsafe { Library::new(&path) }.map_err(|e| format!("cannot load oneDNN ({path}): {e}"))?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol's type is oneDNN 2.x's C signature of that name.
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .map_err(|e| format!("{path} is not oneDNN 2.x: {e}"))?
            };
        }
        let version: unsafe extern "C" fn() -> *const Version = sym!("dnnl_version");
        let effective_isa: unsafe extern "C" fn() -> c_int = sym!("dnnl_get_effective_cpu_isa");
        // SAFETY: dnnl_version returns a pointer to a static struct.
        let v = unsafe { &*version() };
        if v.major != 2 {
            return Err(format!("{path} is oneDNN {}.{}, not 2.x", v.major, v.minor));
        }
        let omp_set_num_threads = match v.cpu_runtime {
            RUNTIME_SEQ => None,
            // SAFETY: OpenMP's `void omp_set_num_threads(int)`, from oneDNN's dependencies.
            RUNTIME_OMP => Some(
                *unsafe { lib.get(b"omp_set_num_threads\0") }
                    .map_err(|e| format!("{path} runs on OpenMP but omp_set_num_threads is not found: {e}"))?,
            ),
            r => {
                return Err(format!(
                    "{path} runs on threading runtime {r} (Brigade sets threads through OpenMP only)"
                ))
            }
        };
        let api = Api {
            sgemm: sym!("dnnl_sgemm"),
            omp_set_num_threads,
            engine_create: sym!("dnnl_engine_create"),
            stream_create: sym!("dnnl_stream_create"),
            md_init_by_strides: sym!("dnnl_memory_desc_init_by_strides"),
            matmul_desc_init: sym!("dnnl_matmul_desc_init"),
            pd_create: sym!("dnnl_primitive_desc_create"),
            pd_query: sym!("dnnl_primitive_desc_query"),
            pd_destroy: sym!("dnnl_primitive_desc_destroy"),
            primitive_create: sym!("dnnl_primitive_create"),
            primitive_execute: sym!("dnnl_primitive_execute"),
            memory_create: sym!("dnnl_memory_create"),
            memory_set_data_handle: sym!("dnnl_memory_set_data_handle"),
            stream_wait: sym!("dnnl_stream_wait"),
        };
        // SAFETY: plain C calls of the signatures above.
        let isa = unsafe { effective_isa() };
        let mut engine = std::ptr::null_mut();
        // SAFETY: as above; the engine lives as long as the process.
        let engine_ok = unsafe { (api.engine_create)(&mut engine, ENGINE_CPU, 0) } == STATUS_SUCCESS;
        let amx = engine_ok && isa == 0x3e7;
        let name = format!(
            "onednn {}.{}.{} ({}{})",
            v.major,
            v.minor,
            v.patch,
            isa_name(isa),
            if amx { ", bf16 on amx" } else { "" }
        );
        Ok(OneDnn {
            api,
            engine: engine as usize,
            amx,
            name,
            _lib: lib,
        })
    }

    /// Whether bf16 products may try oneDNN's AMX matmul here.
    pub(crate) fn has_amx(&self) -> bool {
        self.amx
    }

    /// Sets the calling thread's OpenMP thread count for the next call.
    fn use_threads(&self, threads: usize) {
        thread_local! {
            static SET: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
        }
        if let Some(set) = self.api.omp_set_num_threads {
            if SET.with(|s| s.replace(threads)) != threads {
                // SAFETY: sets an OpenMP setting of the calling thread.
                unsafe { set(threads.clamp(1, c_int::MAX as usize) as c_int) }
            }
        }
    }

    /// `dst = lhs·rhs` (`dst += lhs·rhs` when `accumulate`) through `dnnl_sgemm` with `threads`
    /// OpenMP threads; `false` (nothing done) when a stride has no row-major form.
    ///
    /// # Safety
    /// As the `gemm` crate's call: every element the shapes and strides name addressable, `dst`'s
    /// writable and touched by nothing else meanwhile (and initialised when `accumulate`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn sgemm(
        &self,
        (m, n, k): (usize, usize, usize),
        dst: (*mut f32, usize, usize),
        accumulate: bool,
        lhs: (*const f32, usize, usize),
        rhs: (*const f32, usize, usize),
        threads: usize,
    ) -> bool {
        let (Some((ta, lda)), Some((tb, ldb)), Some(('N', ldc))) = (
            row_major(m, k, lhs.1, lhs.2),
            row_major(k, n, rhs.1, rhs.2),
            row_major(m, n, dst.1, dst.2),
        ) else {
            return false;
        };
        self.use_threads(threads);
        let status = (self.api.sgemm)(
            ta as c_char,
            tb as c_char,
            m as i64,
            n as i64,
            k as i64,
            1.0,
            lhs.0,
            lda,
            rhs.0,
            ldb,
            if accumulate { 1.0 } else { 0.0 },
            dst.0,
            ldc,
        );
        status == STATUS_SUCCESS
    }
}

/// How `dnnl_sgemm` reads a `rows x cols` matrix with these strides: `('N', ld)` row by row,
/// `('T', ld)` as the transpose of a row-major `cols x rows`; `None` when neither fits.
fn row_major(rows: usize, cols: usize, rs: usize, cs: usize) -> Option<(char, i64)> {
    if cs == 1 || cols == 1 {
        let ld = if rows == 1 { cols.max(1) } else { rs };
        if ld >= cols.max(1) {
            return Some(('N', ld as i64));
        }
    }
    if rs == 1 || rows == 1 {
        let ld = if cols == 1 { rows.max(1) } else { cs };
        if ld >= rows.max(1) {
            return Some(('T', ld as i64));
        }
    }
    None
}

/// One bf16 matmul primitive of one shape and set of strides, with the memory objects its
/// arguments are handed through (`None`: oneDNN's implementation for it is not AMX).
struct Bf16Primitive {
    primitive: usize,
    memories: [usize; 4],
}

/// A bf16 primitive's identity: `m, k, n`, the operands' strides, the bias's column stride
/// (`None`: no bias), the output's row stride.
type Bf16Key = (usize, usize, usize, [usize; 4], Option<usize>, usize);

thread_local! {
    /// This thread's stream and bf16 primitives (a primitive runs on the thread that created it).
    static BF16: RefCell<(usize, HashMap<Bf16Key, Option<Bf16Primitive>>)> = RefCell::new((0, HashMap::new()));
}

/// Strides with those of a size-1 dimension replaced by a plain row-major value (oneDNN's
/// implementations recognise plain and transposed layouts by their strides).
fn tidy(rows: usize, cols: usize, rs: usize, cs: usize) -> (usize, usize) {
    match (rows, cols) {
        (1, 1) => (1, 1),
        (1, _) => (cols * cs, cs),
        (_, 1) => (rs, 1),
        _ => (rs, cs),
    }
}

impl OneDnn {
    /// `dst = lhs·rhs (+ bias on every row)` on bf16 operands, f32 accumulation, each output
    /// rounded once to bf16, through oneDNN's AMX matmul; `false` (nothing done) when oneDNN has
    /// no AMX implementation for it on this CPU.
    ///
    /// # Safety
    /// Every element the shapes and strides name addressable (`bias`: `n` elements along its
    /// stride), `dst` holds `m` rows of `n` elements at row stride `ldc`, touched by nothing else.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn bf16_matmul(
        &self,
        (m, n, k): (usize, usize, usize),
        dst: (*mut u16, usize),
        lhs: (*const u16, usize, usize),
        rhs: (*const u16, usize, usize),
        bias: Option<(*const u16, usize)>,
        threads: usize,
    ) -> bool {
        if !self.amx || m == 0 || n == 0 || k == 0 {
            return false;
        }
        let (a_rs, a_cs) = tidy(m, k, lhs.1, lhs.2);
        let (b_rs, b_cs) = tidy(k, n, rhs.1, rhs.2);
        let key: Bf16Key = (m, k, n, [a_rs, a_cs, b_rs, b_cs], bias.map(|b| b.1), dst.1);
        BF16.with(|cell| {
            let mut cell = cell.borrow_mut();
            let (stream, cache) = &mut *cell;
            if *stream == 0 {
                let mut s = std::ptr::null_mut();
                if (self.api.stream_create)(&mut s, self.engine as *mut c_void, STREAM_DEFAULT) != STATUS_SUCCESS {
                    return false;
                }
                *stream = s as usize;
            }
            let prim = cache.entry(key).or_insert_with(|| self.bf16_primitive(key));
            let Some(p) = prim else {
                return false;
            };
            let handles = [
                lhs.0 as *mut c_void,
                rhs.0 as *mut c_void,
                dst.0 as *mut c_void,
                bias.map_or(std::ptr::null_mut(), |b| b.0 as *mut c_void),
            ];
            for (mem, h) in p.memories.iter().zip(handles) {
                if *mem != 0 && (self.api.memory_set_data_handle)(*mem as *mut c_void, h) != STATUS_SUCCESS {
                    return false;
                }
            }
            let args = [
                ExecArg {
                    arg: ARG_SRC,
                    memory: p.memories[0] as *mut c_void,
                },
                ExecArg {
                    arg: ARG_WEIGHTS,
                    memory: p.memories[1] as *mut c_void,
                },
                ExecArg {
                    arg: ARG_DST,
                    memory: p.memories[2] as *mut c_void,
                },
                ExecArg {
                    arg: ARG_BIAS,
                    memory: p.memories[3] as *mut c_void,
                },
            ];
            let nargs = if bias.is_some() { 4 } else { 3 };
            self.use_threads(threads);
            (self.api.primitive_execute)(
                p.primitive as *const c_void,
                *stream as *mut c_void,
                nargs,
                args.as_ptr(),
            ) == STATUS_SUCCESS
                && (self.api.stream_wait)(*stream as *mut c_void) == STATUS_SUCCESS
        })
    }

    /// Creates the bf16 matmul primitive of `key`, kept only when its implementation is AMX.
    /// Primitives and their memory objects live as long as the thread's cache (the process).
    unsafe fn bf16_primitive(&self, (m, k, n, s, bias, ldc): Bf16Key) -> Option<Bf16Primitive> {
        let api = &self.api;
        let md = |dims: [i64; 2], strides: [i64; 2]| -> Option<Box<MemoryDesc>> {
            let mut d = Box::new(MemoryDesc([0; 1024]));
            let (mut dd, mut ss) = ([0i64; 12], [0i64; 12]);
            dd[..2].copy_from_slice(&dims);
            ss[..2].copy_from_slice(&strides);
            ((api.md_init_by_strides)(&mut *d, 2, dd.as_ptr(), DT_BF16, ss.as_ptr()) == STATUS_SUCCESS).then_some(d)
        };
        let (m, k, n) = (m as i64, k as i64, n as i64);
        let a = md([m, k], [s[0] as i64, s[1] as i64])?;
        let b = md([k, n], [s[2] as i64, s[3] as i64])?;
        let c = md([m, n], [ldc as i64, 1])?;
        let bias_md = match bias {
            Some(cs) => Some(md([1, n], [n * cs as i64, cs as i64])?),
            None => None,
        };
        let mut desc = Box::new(MatmulDesc([0; 4096]));
        let bias_ptr = bias_md.as_deref().map_or(std::ptr::null(), |b| b as *const MemoryDesc);
        if (api.matmul_desc_init)(&mut *desc, &*a, &*b, bias_ptr, &*c) != STATUS_SUCCESS {
            return None;
        }
        let mut pd = std::ptr::null_mut();
        let engine = self.engine as *mut c_void;
        let desc_ptr = &*desc as *const MatmulDesc as *const c_void;
        if (api.pd_create)(&mut pd, desc_ptr, std::ptr::null(), engine, std::ptr::null()) != STATUS_SUCCESS {
            return None;
        }
        let mut info: *const c_char = std::ptr::null();
        let amx = (api.pd_query)(pd, QUERY_IMPL_INFO_STR, 0, &mut info as *mut _ as *mut c_void) == STATUS_SUCCESS
            && !info.is_null()
            && CStr::from_ptr(info).to_string_lossy().contains("amx");
        let mut primitive = std::ptr::null_mut();
        let created = amx && (api.primitive_create)(&mut primitive, pd) == STATUS_SUCCESS;
        (api.pd_destroy)(pd);
        if !created {
            return None;
        }
        let mut memories = [0usize; 4];
        for (slot, d) in memories
            .iter_mut()
            .zip([Some(&a), Some(&b), Some(&c), bias_md.as_ref()])
        {
            if let Some(d) = d {
                let mut mem = std::ptr::null_mut();
                // a placeholder handle: each call sets its own
                if (api.memory_create)(&mut mem, &**d, engine, std::ptr::null_mut()) != STATUS_SUCCESS {
                    return None;
                }
                *slot = mem as usize;
            }
        }
        Some(Bf16Primitive {
            primitive: primitive as usize,
            memories,
        })
    }
}

// SAFETY: the library's functions may be called from any thread; the engine is thread-safe.
unsafe impl Send for OneDnn {}
unsafe impl Sync for OneDnn {}

/// oneDNN as loaded at the first ask (the error says why not).
fn loaded() -> &'static std::result::Result<OneDnn, String> {
    static ONEDNN: OnceLock<std::result::Result<OneDnn, String>> = OnceLock::new();
    ONEDNN.get_or_init(OneDnn::load)
}

/// The choice made by [`set_cpu_gemm`]: 0 none (the environment decides), 1 oneDNN, 2 the
/// `gemm` crate.
static FORCED: AtomicU8 = AtomicU8::new(0);

/// The choice `BRIGADE_GEMM` makes (`None`: unset or empty), read once.
fn env_choice() -> Result<Option<CpuGemm>> {
    static CHOICE: OnceLock<Result<Option<CpuGemm>>> = OnceLock::new();
    CHOICE.get_or_init(read_env_choice).clone()
}

fn read_env_choice() -> Result<Option<CpuGemm>> {
    match std::env::var("BRIGADE_GEMM").unwrap_or_default().trim() {
        "" => Ok(None),
        "onednn" => Ok(Some(CpuGemm::OneDnn)),
        "gemm" => Ok(Some(CpuGemm::GemmCrate)),
        other => Err(TensorError::CpuGemm(format!(
            "BRIGADE_GEMM={other} is neither `onednn` nor `gemm`"
        ))),
    }
}

/// oneDNN when it is the path chosen (for the kernels: `None` means the `gemm` crate).
pub(crate) fn onednn() -> Option<&'static OneDnn> {
    match cpu_gemm() {
        Ok(CpuGemm::OneDnn) => loaded().as_ref().ok(),
        _ => None,
    }
}

/// The library the CPU's f32 and bf16 products go through: the one [`set_cpu_gemm`] or
/// `BRIGADE_GEMM` (`onednn` or `gemm`) names, else oneDNN where it loads (`libdnnl.so.2`, or the
/// file `BRIGADE_ONEDNN` names) on x86-64, else the `gemm` crate. An error when oneDNN is named
/// and cannot be loaded, or `BRIGADE_GEMM` names neither (the kernels then use the `gemm` crate).
pub fn cpu_gemm() -> Result<CpuGemm> {
    let choice = match FORCED.load(Ordering::Relaxed) {
        1 => Some(CpuGemm::OneDnn),
        2 => Some(CpuGemm::GemmCrate),
        _ => env_choice()?,
    };
    match choice {
        Some(CpuGemm::GemmCrate) => Ok(CpuGemm::GemmCrate),
        Some(CpuGemm::OneDnn) => match loaded() {
            Ok(_) => Ok(CpuGemm::OneDnn),
            Err(e) => Err(TensorError::CpuGemm(format!(
                "oneDNN was asked for, but {e} (install libdnnl2, or name the file with BRIGADE_ONEDNN)"
            ))),
        },
        None if cfg!(target_arch = "x86_64") && loaded().is_ok() => Ok(CpuGemm::OneDnn),
        None => Ok(CpuGemm::GemmCrate),
    }
}

/// The path [`cpu_gemm`] chose, in words for a run's summary: `"onednn 2.6.3 (avx512_core_amx,
/// bf16 on amx)"` or `"gemm crate"`.
pub fn cpu_gemm_name() -> Result<String> {
    Ok(match cpu_gemm()? {
        CpuGemm::OneDnn => loaded().as_ref().map_or_else(Clone::clone, |d| d.name.clone()),
        CpuGemm::GemmCrate => "gemm crate".into(),
    })
}

/// Makes every later CPU product of this process go through `choice`, whatever
/// `BRIGADE_GEMM` says (a benchmark's or test's side-by-side runs); an error, and nothing
/// changed, when `choice` is oneDNN and it cannot be loaded.
pub fn set_cpu_gemm(choice: CpuGemm) -> Result<()> {
    if choice == CpuGemm::OneDnn {
        if let Err(e) = loaded() {
            return Err(TensorError::CpuGemm(format!("oneDNN was asked for, but {e}")));
        }
    }
    FORCED.store(
        match choice {
            CpuGemm::OneDnn => 1,
            CpuGemm::GemmCrate => 2,
        },
        Ordering::Relaxed,
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{loaded, row_major};

    #[test]
    fn strides_map_to_transposes() {
        // a [3,4] row-major view, its transpose, a row of a wider matrix, and a broadcast
        assert_eq!(row_major(3, 4, 4, 1), Some(('N', 4)));
        assert_eq!(row_major(3, 4, 6, 1), Some(('N', 6)));
        assert_eq!(row_major(3, 4, 1, 3), Some(('T', 3)));
        assert_eq!(row_major(1, 4, 0, 1), Some(('N', 4)));
        assert_eq!(row_major(3, 1, 5, 0), Some(('N', 5)));
        assert_eq!(row_major(3, 4, 0, 1), None);
        assert_eq!(row_major(3, 4, 8, 2), None);
    }

    /// The elements a `rows x cols` view with these strides names: its last one's index + 1.
    fn span(rows: usize, cols: usize, rs: usize, cs: usize) -> usize {
        if rows == 0 || cols == 0 {
            0
        } else {
            (rows - 1) * rs + (cols - 1) * cs + 1
        }
    }

    /// `dnnl_sgemm` on exactly-sized operands with a guard region after each: for every shape
    /// and stride the kernels pass (plain, transposed, rows of a wider matrix, one row, one
    /// column, one inner dim, a strided output), nothing outside the named elements is written
    /// and the product is right. Skipped where oneDNN does not load.
    #[test]
    fn sgemm_stays_inside_the_named_elements() {
        let Ok(d) = loaded() else {
            eprintln!("oneDNN not loaded: skipped");
            return;
        };
        const GUARD: usize = 64;
        const SENTINEL: f32 = -7.25;
        // (m, n, k), lhs (rs, cs), rhs (rs, cs), dst (rs, cs)
        type Case = ((usize, usize, usize), (usize, usize), (usize, usize), (usize, usize));
        let cases: &[Case] = &[
            ((3, 4, 5), (5, 1), (4, 1), (4, 1)),
            ((3, 4, 5), (1, 3), (1, 5), (4, 1)),
            ((3, 4, 5), (7, 1), (1, 6), (9, 1)),
            ((1, 4, 5), (0, 1), (4, 1), (0, 1)),
            ((1, 4, 5), (9, 2), (1, 5), (4, 1)),
            ((3, 1, 5), (5, 1), (1, 0), (2, 0)),
            ((3, 4, 1), (1, 0), (0, 1), (4, 1)),
            ((1, 1, 7), (0, 1), (1, 0), (1, 1)),
            ((33, 17, 65), (65, 1), (1, 65), (20, 1)),
            ((64, 64, 64), (1, 64), (64, 1), (64, 1)),
        ];
        for &((m, n, k), (ars, acs), (brs, bcs), (crs, ccs)) in cases {
            for (threads, accumulate) in [(1, false), (2, false), (2, true)] {
                let (na, nb, nc) = (span(m, k, ars, acs), span(k, n, brs, bcs), span(m, n, crs, ccs));
                let a: Vec<f32> = (0..na + GUARD)
                    .map(|i| if i < na { (i % 7) as f32 - 3.0 } else { SENTINEL })
                    .collect();
                let b: Vec<f32> = (0..nb + GUARD)
                    .map(|i| if i < nb { (i % 5) as f32 - 2.0 } else { SENTINEL })
                    .collect();
                let mut c = vec![SENTINEL; nc + GUARD];
                for i in 0..m {
                    for j in 0..n {
                        c[i * crs + j * ccs] = 0.5;
                    }
                }
                // SAFETY: each buffer holds every element its shape and strides name.
                let done = unsafe {
                    d.sgemm(
                        (m, n, k),
                        (c.as_mut_ptr(), crs, ccs),
                        accumulate,
                        (a.as_ptr(), ars, acs),
                        (b.as_ptr(), brs, bcs),
                        threads,
                    )
                };
                assert!(done, "{m}x{n}x{k}: oneDNN took it");
                let case = format!("{m}x{n}x{k} a({ars},{acs}) b({brs},{bcs}) c({crs},{ccs}) threads {threads}");
                assert!(c[nc..].iter().all(|&x| x == SENTINEL), "{case}: wrote past the output");
                for i in 0..m {
                    for j in 0..n {
                        let sum: f32 = (0..k).map(|l| a[i * ars + l * acs] * b[l * brs + j * bcs]).sum();
                        let want = sum + if accumulate { 0.5 } else { 0.0 };
                        assert_eq!(c[i * crs + j * ccs], want, "{case}: element {i},{j}");
                    }
                }
                let named: std::collections::HashSet<usize> =
                    (0..m).flat_map(|i| (0..n).map(move |j| i * crs + j * ccs)).collect();
                for (i, &x) in c[..nc].iter().enumerate() {
                    assert!(
                        named.contains(&i) || x == SENTINEL,
                        "{case}: wrote element {i} between rows"
                    );
                }
            }
        }
    }
}
