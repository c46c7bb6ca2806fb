//! How many cores the kernels of the calling thread may use.
//!
//! Each rank of an in-process group runs on its own thread and sets its own share
//! (`--threads-per-rank`), so that N ranks do not oversubscribe the machine. A thread
//! that never calls [`set_compute_threads`] uses rayon's global pool.

use std::cell::RefCell;
use std::sync::Arc;

use rayon::prelude::*;
use rayon::ThreadPool;

thread_local! {
    static POOL: RefCell<Option<(usize, Option<Arc<ThreadPool>>)>> = const { RefCell::new(None) };
}

/// Sets the number of compute threads for kernels called from this thread (1 = run
/// serially on the calling thread). Threads are created here, not in the kernels.
pub fn set_compute_threads(n: usize) {
    let n = n.max(1);
    let pool = if n == 1 {
        None
    } else {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build()
            .ok()
            .map(Arc::new)
    };
    POOL.with(|p| *p.borrow_mut() = Some((n, pool)));
}

/// The number of compute threads kernels called from this thread use.
pub fn compute_threads() -> usize {
    POOL.with(|p| p.borrow().as_ref().map(|(n, _)| *n))
        .unwrap_or_else(rayon::current_num_threads)
}

/// Runs `f` inside this thread's pool (or the global one).
pub(crate) fn install<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    let pool = POOL.with(|p| p.borrow().as_ref().and_then(|(_, pool)| pool.clone()));
    match pool {
        Some(pool) => pool.install(f),
        None => f(),
    }
}

/// Splits `data` into chunks of at least `grain` elements and calls `f(start, chunk)` on
/// each, in parallel when this thread has more than one compute thread.
pub(crate) fn par_chunks_mut<T: Send>(data: &mut [T], grain: usize, f: impl Fn(usize, &mut [T]) + Sync + Send) {
    let t = compute_threads();
    if t <= 1 || data.len() <= grain {
        f(0, data);
        return;
    }
    let chunk = grain.max(data.len().div_ceil(4 * t));
    install(|| {
        data.par_chunks_mut(chunk)
            .enumerate()
            .for_each(|(i, c)| f(i * chunk, c))
    });
}

/// Calls `f(row, row_slice)` for each `row_len`-sized row of `data`, in parallel when
/// this thread has more than one compute thread and the work is large enough.
pub(crate) fn par_rows_mut<T: Send>(data: &mut [T], row_len: usize, f: impl Fn(usize, &mut [T]) + Sync + Send) {
    if row_len == 0 {
        return;
    }
    let t = compute_threads();
    if t <= 1 || data.len() < 32 * 1024 {
        for (i, r) in data.chunks_mut(row_len).enumerate() {
            f(i, r);
        }
        return;
    }
    let rows_per_chunk = (data.len() / row_len).div_ceil(4 * t).max(1);
    install(|| {
        data.par_chunks_mut(rows_per_chunk * row_len)
            .enumerate()
            .for_each(|(c, chunk)| {
                for (i, r) in chunk.chunks_mut(row_len).enumerate() {
                    f(c * rows_per_chunk + i, r);
                }
            })
    });
}
