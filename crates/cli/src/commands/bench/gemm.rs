//! `brigade bench gemm`: Brigade's matmul beside a direct call of a library, on the same shapes
//! in the same run: on the CPU Brigade's matmul (through the library it chose: oneDNN or the
//! `gemm` crate, named in the output; `BRIGADE_GEMM` forces either) in f32, bf16 or f16, beside
//! the `gemm` crate called directly in f32 (numpy's figure, from `../shared/tools/roofline.py`,
//! printed beside it when given); on a GPU cuBLAS, in f32, f16 and bf16.

use crate::report::stdout::outln;
use std::time::Instant;

use brigade_tensor::{set_compute_threads, DType, Device, Rng, Tensor};
use clap::Args;
use serde::Serialize;

use crate::args::check_threads;
use crate::error::{Error, Result};
use crate::footprint;

/// Options of `brigade bench gemm`.
#[derive(Args, Clone, Debug)]
pub struct GemmArgs {
    /// Shapes `MxKxN`, comma-separated (the MLP's own 64x2048x2048 among the defaults).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1024x1024x1024,2048x2048x2048,64x2048x2048"
    )]
    pub shapes: Vec<String>,
    /// Compute threads (default: every core).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Timed repetitions per shape (the median is reported).
    #[arg(long, default_value_t = 5)]
    pub reps: usize,
    /// numpy's GFLOP/s for each shape (same order), measured in the same sitting.
    #[arg(long, value_delimiter = ',')]
    pub numpy_gflops: Option<Vec<f64>>,
    /// `cpu`, or `cuda` / `cuda:N` (needs a GPU).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Dtypes to time, comma-separated: `f32`, `f16`, `bf16` (16-bit: f32 accumulation, one
    /// rounding per output).
    #[arg(long, value_delimiter = ',', default_value = "f32")]
    pub dtypes: Vec<String>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// One shape's figures on the CPU.
#[derive(Debug, Serialize)]
pub struct GemmRow {
    /// `[m, k, n]`.
    pub shape: [usize; 3],
    /// `f32`, `bf16` or `f16`: the dtype of Brigade's operands.
    pub dtype: String,
    /// The library under Brigade's matmul: `"onednn 2.6.3 (avx512_core)"` or `"gemm crate"`.
    pub cpu_gemm: String,
    /// Brigade's `Tensor::matmul`, GFLOP/s.
    pub brigade_gflops: f64,
    /// The `gemm` crate called directly in f32, GFLOP/s.
    pub direct_gflops: f64,
    /// numpy's figure, when given.
    pub numpy_gflops: Option<f64>,
}

fn parse_shape(s: &str) -> Result<[usize; 3]> {
    let dims: Vec<usize> = s
        .split('x')
        .map(|d| d.trim().parse())
        .collect::<std::result::Result<_, _>>()
        .map_err(|_| Error::Usage(format!("--shapes: '{s}' is not MxKxN (e.g. 1024x1024x1024)")))?;
    match dims[..] {
        [m, k, n] if m > 0 && k > 0 && n > 0 => Ok([m, k, n]),
        _ => Err(Error::Usage(format!(
            "--shapes: '{s}' is not MxKxN with every size >= 1"
        ))),
    }
}

/// The elements of a GEMM's three matrices (`None`: more than 2^64).
fn elements(&[m, k, n]: &[usize; 3]) -> Option<u64> {
    footprint::sum([
        footprint::matrix(m, k),
        footprint::matrix(k, n),
        footprint::matrix(m, n),
    ])
}

/// `MxKxN`.
fn shape_name([m, k, n]: &[usize; 3]) -> String {
    format!("{m}x{k}x{n}")
}

fn parse_dtype(s: &str) -> Result<DType> {
    match s.trim() {
        "f32" => Ok(DType::F32),
        "f16" => Ok(DType::F16),
        "bf16" => Ok(DType::BF16),
        d => Err(Error::Usage(format!("--dtypes: '{d}' is not f32, f16 or bf16"))),
    }
}

/// One shape and dtype on a GPU: Brigade's matmul beside cuBLAS called directly.
#[derive(Debug, Serialize)]
pub struct CudaGemmRow {
    /// `[m, k, n]`.
    pub shape: [usize; 3],
    /// `f32`, `f16` or `bf16`.
    pub dtype: String,
    /// Brigade's matmul, TFLOP/s.
    pub brigade_tflops: f64,
    /// cuBLAS called directly on the same buffers, TFLOP/s.
    pub cublas_tflops: f64,
    /// Whether Brigade's output equals cuBLAS's, element by element (within rounding).
    pub outputs_equal: bool,
}

/// `bench gemm --device cuda:N`: every shape in every dtype, Brigade beside direct cuBLAS.
fn bench_cuda(a: &GemmArgs, shapes: &[[usize; 3]], dtypes: &[DType], ordinal: usize) -> Result<()> {
    use brigade_tensor::cuda::CudaHandle;
    let dev = CudaHandle::open(ordinal)?;
    let mut rows = vec![];
    for &shape in shapes {
        let flops = 2.0 * shape[0] as f64 * shape[1] as f64 * shape[2] as f64;
        for &dtype in dtypes {
            let t = dev.gemm_vs_cublas(shape, dtype, a.reps)?;
            rows.push(CudaGemmRow {
                shape,
                dtype: format!("{dtype:?}").to_lowercase(),
                brigade_tflops: flops / t.brigade_s / 1e12,
                cublas_tflops: flops / t.cublas_s / 1e12,
                outputs_equal: t.outputs.passed(),
            });
        }
    }
    if a.json {
        outln!(
            "{}",
            serde_json::to_string_pretty(&rows).map_err(|e| Error::json("the GEMM rows", e))?
        );
        return Ok(());
    }
    outln!(
        "GEMM on {} ({}), median of {} calls",
        Device::Cuda(ordinal),
        dev.arch(),
        a.reps
    );
    outln!(
        "{:>18} {:>6} {:>14} {:>13} {:>9} {:>8}",
        "m x k x n",
        "dtype",
        "brigade TF/s",
        "cuBLAS TF/s",
        "ratio",
        "outputs"
    );
    for r in &rows {
        outln!(
            "{:>18} {:>6} {:>14.1} {:>13.1} {:>9.2} {:>8}",
            format!("{}x{}x{}", r.shape[0], r.shape[1], r.shape[2]),
            r.dtype,
            r.brigade_tflops,
            r.cublas_tflops,
            r.brigade_tflops / r.cublas_tflops,
            if r.outputs_equal { "equal" } else { "DIFFER" }
        );
    }
    Ok(())
}

/// Most timed calls per shape (`--reps`): each one's time is kept.
const MAX_REPS: usize = 100_000;

/// Median seconds of `reps` calls after one warm-up.
fn median_secs(reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let mut t = Vec::with_capacity(reps);
    for _ in 0..reps {
        let s = Instant::now();
        f()?;
        t.push(s.elapsed().as_secs_f64());
    }
    t.sort_by(f64::total_cmp);
    Ok(t[reps / 2])
}

/// Runs `brigade bench gemm`.
pub fn bench_gemm(a: GemmArgs) -> Result<()> {
    let (shapes, device, dtypes) = parse_gemm_args(&a)?;
    if let Device::Cuda(ordinal) = device {
        return bench_cuda(&a, &shapes, &dtypes, ordinal);
    }
    let cpu_gemm = brigade_tensor::cpu_gemm_name()?;
    let threads = a
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    check_threads("--threads", threads)?;
    for shape in &shapes {
        // Brigade's three matrices, and the copies the direct call works on
        let bytes = footprint::f32_bytes(elements(shape)).and_then(|b| footprint::mul(b, 2));
        footprint::check_fits(&format!("--shapes {}", shape_name(shape)), bytes)?;
    }
    set_compute_threads(threads);
    let mut rng = Rng::new(0);
    let mut rows = vec![];
    for (i, &[m, k, n]) in shapes.iter().enumerate() {
        let flops = 2.0 * m as f64 * k as f64 * n as f64;
        let (x, y) = (
            Tensor::randn(&[m, k], 1.0, DType::F32, &mut rng),
            Tensor::randn(&[k, n], 1.0, DType::F32, &mut rng),
        );
        let mut brigade = vec![];
        for &dtype in &dtypes {
            let (x, y) = (x.to_dtype(dtype)?, y.to_dtype(dtype)?);
            brigade.push(median_secs(a.reps, || x.matmul(&y).map(|_| ()).map_err(Into::into))?);
        }
        let direct = time_gemm_crate(&x, &y, threads, a.reps)?;
        for (&dtype, brigade) in dtypes.iter().zip(brigade) {
            rows.push(GemmRow {
                shape: [m, k, n],
                dtype: format!("{dtype:?}").to_lowercase(),
                cpu_gemm: cpu_gemm.clone(),
                brigade_gflops: flops / brigade / 1e9,
                direct_gflops: flops / direct / 1e9,
                numpy_gflops: a.numpy_gflops.as_ref().map(|g| g[i]),
            });
        }
    }
    if a.json {
        outln!(
            "{}",
            serde_json::to_string_pretty(&rows).map_err(|e| Error::json("the GEMM rows", e))?
        );
        return Ok(());
    }
    print_cpu_rows(&rows, &cpu_gemm, threads, a.reps);
    Ok(())
}

/// The shapes, device and dtypes the options name, each option checked.
fn parse_gemm_args(a: &GemmArgs) -> Result<(Vec<[usize; 3]>, Device, Vec<DType>)> {
    let shapes: Vec<[usize; 3]> = a.shapes.iter().map(|s| parse_shape(s)).collect::<Result<_>>()?;
    if !(1..=MAX_REPS).contains(&a.reps) {
        return Err(Error::Usage(format!(
            "--reps must be between 1 and {MAX_REPS} (timed calls per shape), got {}",
            a.reps
        )));
    }
    if let Some(np) = &a.numpy_gflops {
        if np.len() != shapes.len() || np.iter().any(|g| !(g.is_finite() && *g > 0.0)) {
            return Err(Error::Usage(format!(
                "--numpy-gflops takes one positive figure per shape ({} shapes), got {np:?}",
                shapes.len()
            )));
        }
    }
    let device = match a.device.as_str() {
        "cpu" => Device::Cpu,
        "cuda" => Device::Cuda(0),
        d => match d.strip_prefix("cuda:").and_then(|n| n.parse().ok()) {
            Some(n) => Device::Cuda(n),
            None => return Err(Error::Usage(format!("--device must be cpu, cuda or cuda:N, got '{d}'"))),
        },
    };
    let dtypes: Vec<DType> = a.dtypes.iter().map(|d| parse_dtype(d)).collect::<Result<_>>()?;
    if let Some(shape) = shapes.iter().find(|s| elements(s).is_none()) {
        return Err(Error::Usage(format!(
            "--shapes {}: its matrices hold more than 2^64 elements",
            shape_name(shape)
        )));
    }
    Ok((shapes, device, dtypes))
}

/// The median seconds of the `gemm` crate called directly on copies of `x [m, k]` and
/// `y [k, n]` (f32), with `threads` threads.
fn time_gemm_crate(x: &Tensor, y: &Tensor, threads: usize, reps: usize) -> Result<f64> {
    let (m, k, n) = (x.shape()[0], x.shape()[1], y.shape()[1]);
    let (xv, yv) = (x.to_vec::<f32>()?, y.to_vec::<f32>()?);
    // m * n fits: checked against memory above
    let mut out = vec![0f32; m * n];
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| Error::Usage(format!("a pool of {threads} threads: {e}")))?;
    median_secs(reps, || {
        pool.install(|| unsafe {
            // SAFETY: row-major buffers of exactly m*k, k*n and m*n elements.
            gemm_f32::gemm::f32::get_gemm_fn()(
                m,
                n,
                k,
                out.as_mut_ptr(),
                1,
                n as isize,
                false,
                xv.as_ptr(),
                1,
                k as isize,
                yv.as_ptr(),
                1,
                n as isize,
                0.0f32,
                1.0f32,
                false,
                false,
                false,
                if threads > 1 {
                    gemm_common::Parallelism::Rayon(threads)
                } else {
                    gemm_common::Parallelism::None
                },
            )
        });
        Ok(())
    })
}

/// The CPU's table: Brigade's GFLOP/s beside the `gemm` crate's (and numpy's, when given).
fn print_cpu_rows(rows: &[GemmRow], cpu_gemm: &str, threads: usize, reps: usize) {
    outln!(
        "GEMM on the CPU through {cpu_gemm}, {threads} threads, median of {} calls (the gemm crate called directly in f32 beside it)",
        reps
    );
    outln!(
        "{:>18} {:>6} {:>14} {:>17} {:>9} {:>13} {:>9}",
        "m x k x n",
        "dtype",
        "brigade GF/s",
        "gemm crate GF/s",
        "ratio",
        "numpy GF/s",
        "ratio"
    );
    for r in rows {
        let np = r.numpy_gflops.map_or(("-".to_string(), "-".to_string()), |g| {
            (format!("{g:.1}"), format!("{:.2}", r.brigade_gflops / g))
        });
        outln!(
            "{:>18} {:>6} {:>14.1} {:>17.1} {:>9.2} {:>13} {:>9}",
            format!("{}x{}x{}", r.shape[0], r.shape[1], r.shape[2]),
            r.dtype,
            r.brigade_gflops,
            r.direct_gflops,
            r.brigade_gflops / r.direct_gflops,
            np.0,
            np.1
        );
    }
}
