//! What Brigade's f32 matmul adds around oneDNN's `dnnl_sgemm`, measured so that other load on
//! the machine does not blur it: per call, the calling thread's CPU time
//! (`CLOCK_THREAD_CPUTIME_ID`) and its minor page faults (`getrusage(RUSAGE_THREAD)`), for
//! `Tensor::matmul` and for `dnnl_sgemm` called directly (into a buffer kept across calls, and
//! into a fresh zeroed one each call), interleaved round by round, one thread.
//!
//! `cargo run --release -p brigade-tensor --example gemm_overhead [-- MxKxN [ROUNDS]]`
//! (needs Debian's `libdnnl2`; prints medians and the ratio of each to the direct call).

use brigade_tensor::{set_compute_threads, DType, Rng, Tensor};
use std::os::raw::{c_char, c_int};

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

#[repr(C)]
struct Timespec {
    sec: i64,
    nsec: i64,
}

#[repr(C)]
struct Rusage {
    times: [i64; 4],
    maxrss: i64,
    ixrss: i64,
    idrss: i64,
    isrss: i64,
    minflt: i64,
    rest: [i64; 9],
}

extern "C" {
    fn clock_gettime(clock: c_int, ts: *mut Timespec) -> c_int;
    fn getrusage(who: c_int, usage: *mut Rusage) -> c_int;
}

const CLOCK_THREAD_CPUTIME_ID: c_int = 3;
const RUSAGE_THREAD: c_int = 1;

/// This thread's CPU seconds and minor faults so far.
fn now() -> (f64, i64) {
    let mut ts = Timespec { sec: 0, nsec: 0 };
    let mut ru = Rusage {
        times: [0; 4],
        maxrss: 0,
        ixrss: 0,
        idrss: 0,
        isrss: 0,
        minflt: 0,
        rest: [0; 9],
    };
    // SAFETY: plain libc calls writing into the structs above.
    unsafe {
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &mut ts);
        getrusage(RUSAGE_THREAD, &mut ru);
    }
    (ts.sec as f64 + ts.nsec as f64 * 1e-9, ru.minflt)
}

fn measure(f: &mut dyn FnMut()) -> (f64, i64) {
    let (t0, f0) = now();
    f();
    let (t1, f1) = now();
    (t1 - t0, f1 - f0)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let shape = args.get(1).map_or("1024x256x768", |s| s.as_str());
    let dims: Vec<usize> = shape.split('x').map(|d| d.parse().expect("MxKxN")).collect();
    let (m, k, n) = (dims[0], dims[1], dims[2]);
    let rounds: usize = args.get(2).map_or(40, |r| r.parse().expect("ROUNDS"));
    set_compute_threads(1);
    println!("cpu gemm: {}", brigade_tensor::cpu_gemm_name().expect("cpu gemm"));
    // SAFETY: loading the same library Brigade loads; the symbols have the signatures above.
    let lib = unsafe { libloading::Library::new("libdnnl.so.2") }.expect("libdnnl.so.2");
    let sgemm: Sgemm = *unsafe { lib.get::<Sgemm>(b"dnnl_sgemm\0") }.expect("dnnl_sgemm");
    let gomp = unsafe { libloading::Library::new("libgomp.so.1") }.expect("libgomp.so.1");
    let set_threads: unsafe extern "C" fn(c_int) =
        *unsafe { gomp.get::<unsafe extern "C" fn(c_int)>(b"omp_set_num_threads\0") }.expect("omp");
    unsafe { set_threads(1) };

    let mut rng = Rng::new(0);
    let x = Tensor::randn(&[m, k], 1.0, DType::F32, &mut rng);
    let y = Tensor::randn(&[k, n], 1.0, DType::F32, &mut rng);
    let (xv, yv) = (x.to_vec::<f32>().unwrap(), y.to_vec::<f32>().unwrap());
    let mut kept = vec![0f32; m * n];
    let mut kept2 = vec![0f32; m * n];
    // the same inputs at a 64-byte boundary (a cache line)
    let aligned = |v: &[f32]| {
        let mut buf = vec![0f32; v.len() + 16];
        let skip = buf.as_ptr().align_offset(64);
        buf[skip..skip + v.len()].copy_from_slice(v);
        (buf, skip)
    };
    let ((xa, xs), (ya, ys)) = (aligned(&xv), aligned(&yv));
    let off16 = |v: &[f32]| {
        let (mut buf, skip) = aligned(v);
        buf.copy_within(skip..skip + v.len(), skip + 4);
        (buf, skip + 4)
    };
    let ((xm, xs16), (ym, ys16)) = (off16(&xv), off16(&yv));
    let mut kept3 = vec![0f32; m * n];
    let (xt, yt) = (
        Tensor::from_slice(&xa[xs..xs + m * k], &[m, k]).unwrap(),
        Tensor::from_slice(&ya[ys..ys + k * n], &[k, n]).unwrap(),
    );
    println!(
        "input addresses mod 64: direct {} {}, aligned {} {}",
        xv.as_ptr() as usize % 64,
        yv.as_ptr() as usize % 64,
        xa[xs..].as_ptr() as usize % 64,
        ya[ys..].as_ptr() as usize % 64
    );
    let direct_on = |a: *const f32, b: *const f32, out: *mut f32| unsafe {
        // SAFETY: row-major buffers of exactly m*k, k*n and m*n elements.
        sgemm(
            b'N' as c_char,
            b'N' as c_char,
            m as i64,
            n as i64,
            k as i64,
            1.0,
            a,
            k as i64,
            b,
            n as i64,
            0.0,
            out,
            n as i64,
        )
    };
    let direct = |out: *mut f32| unsafe {
        // SAFETY: row-major buffers of exactly m*k, k*n and m*n elements.
        sgemm(
            b'N' as c_char,
            b'N' as c_char,
            m as i64,
            n as i64,
            k as i64,
            1.0,
            xv.as_ptr(),
            k as i64,
            yv.as_ptr(),
            n as i64,
            0.0,
            out,
            n as i64,
        )
    };
    let names = [
        "brigade matmul",
        "sgemm, kept output",
        "sgemm, fresh zeroed output",
        "sgemm, fresh unwritten output",
        "sgemm, aligned inputs",
        "brigade, tensors from_slice",
        "sgemm, inputs 16 past a line",
    ];
    let mut secs = vec![vec![]; names.len()];
    let mut faults = vec![vec![]; names.len()];
    for round in 0..rounds + 3 {
        let mut runs: [Box<dyn FnMut()>; 7] = [
            Box::new(|| drop(std::hint::black_box(x.matmul(&y).unwrap()))),
            Box::new(|| {
                direct(kept.as_mut_ptr());
            }),
            Box::new(|| {
                let mut out = vec![0f32; m * n];
                direct(out.as_mut_ptr());
                drop(std::hint::black_box(out));
            }),
            Box::new(|| {
                let mut out = Vec::<f32>::with_capacity(m * n);
                direct(out.as_mut_ptr());
                // SAFETY: dnnl_sgemm with beta 0 wrote all m*n elements.
                unsafe { out.set_len(m * n) };
                drop(std::hint::black_box(out));
            }),
            Box::new(|| {
                direct_on(xa[xs..].as_ptr(), ya[ys..].as_ptr(), kept2.as_mut_ptr());
            }),
            Box::new(|| drop(std::hint::black_box(xt.matmul(&yt).unwrap()))),
            Box::new(|| {
                direct_on(xm[xs16..].as_ptr(), ym[ys16..].as_ptr(), kept3.as_mut_ptr());
            }),
        ];
        // each round in another order, so that no variant always follows the same one
        let order: Vec<usize> = (0..runs.len()).map(|i| (i + round) % runs.len()).collect();
        for i in order {
            let run = &mut runs[i];
            let (s, f) = measure(run.as_mut());
            // the first rounds warm the caches and the allocator
            if round >= 3 {
                secs[i].push(s);
                faults[i].push(f as f64);
            }
        }
    }
    let flops = 2.0 * (m * k * n) as f64;
    let base = median(&mut secs[1].clone());
    println!("{m}x{k}x{n}, one thread, median of {rounds} interleaved rounds, thread CPU time");
    for (i, name) in names.iter().enumerate() {
        let s = median(&mut secs[i]);
        let f = median(&mut faults[i]);
        println!(
            "{name:>28}: {:8.3} ms  {:6.1} GF/s  {:5.0} minor faults  {:.3}x the direct call's time",
            s * 1e3,
            flops / s / 1e9,
            f,
            s / base
        );
    }
}

/// Allocations of a page or more start on a cache line, as PyTorch's CPU allocator's do, when
/// the program runs with `ALIGN64=1` (read once, at the first large allocation).
struct Aligned;

static ALIGN64: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

fn bumped(l: std::alloc::Layout) -> std::alloc::Layout {
    if l.size() >= 4096 && *ALIGN64.get_or_init(|| std::env::var("ALIGN64").as_deref() == Ok("1")) {
        std::alloc::Layout::from_size_align(l.size(), l.align().max(64)).unwrap()
    } else {
        l
    }
}

unsafe impl std::alloc::GlobalAlloc for Aligned {
    unsafe fn alloc(&self, l: std::alloc::Layout) -> *mut u8 {
        std::alloc::System.alloc(bumped(l))
    }
    unsafe fn dealloc(&self, p: *mut u8, l: std::alloc::Layout) {
        std::alloc::System.dealloc(p, bumped(l))
    }
}

#[global_allocator]
static ALLOC: Aligned = Aligned;
