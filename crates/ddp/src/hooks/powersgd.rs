//! PowerSGD (Vogels et al. 2019; PyTorch's `powerSGD_hook`): each gradient matrix M (n × m) is
//! sent as two thin factors, P = M·Q (n × r) and Q = Mᵀ·P (m × r), found by one step of power
//! iteration, with error feedback so what compression drops now is sent later.
//!
//! Per bucket, once `start_iter` iterations have run with plain all-reduce (DDP rebuilds its
//! buckets after the first iteration, so per-bucket state must start after it):
//! 1. error feedback: add the error this bucket left last time; keep a copy of the input;
//! 2. tensors that would not compress (1-D, or `(n + m)·r·min_compression_rate ≥ n·m`) are
//!    all-reduced together uncompressed and divided by the world size;
//! 3. P = M·Q, with Q from the last iteration (warm start) or drawn from a generator that every
//!    rank seeds alike; all-reduce P; orthogonalize P's columns (Gram–Schmidt);
//! 4. Q = Mᵀ·P; all-reduce Q; divide by the world size;
//! 5. M ≈ P·Qᵀ written into the bucket; the error is the input minus that.
//!
//! Buckets are processed one after the other (each bucket's collectives are issued once the
//! previous bucket's are done), so every rank issues the same collectives in the same order.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use brigade_comm::{Buffer, CommError, Communicator, ReduceOp, Work};
use brigade_tensor::Rng;

use super::{into_f32, CommHook, GradBucket};
use crate::{bucket_tag, DdpError};

/// PowerSGD's settings; defaults follow PyTorch's `PowerSGDState` except `start_iter`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PowerSgdConfig {
    /// Rank r of the approximation (PyTorch: `matrix_approximation_rank`, default 1).
    pub rank: usize,
    /// Iterations reduced with plain all-reduce before compression starts (PyTorch:
    /// `start_powerSGD_iter`); at least 2 with error feedback or warm start.
    pub start_iter: usize,
    /// Add back what compression dropped last time (default on).
    pub use_error_feedback: bool,
    /// Start each power iteration from the last Q (default on).
    pub warm_start: bool,
    /// Compress a matrix only if it shrinks at least this much: `(n + m)·r·rate < n·m`
    /// (PyTorch's `min_compression_rate`, default 2).
    pub min_compression_rate: f64,
    /// Seed of the generator every rank draws Q from.
    pub seed: u64,
}

impl Default for PowerSgdConfig {
    fn default() -> Self {
        PowerSgdConfig {
            rank: 1,
            start_iter: 10,
            use_error_feedback: true,
            warm_start: true,
            min_compression_rate: 2.0,
            seed: 0,
        }
    }
}

impl PowerSgdConfig {
    /// Checks the settings; the message says what to change.
    pub fn validate(&self) -> Result<(), DdpError> {
        self.check().map_err(|reason| DdpError::HookConfig {
            hook: "powersgd".into(),
            reason,
        })
    }

    fn check(&self) -> Result<(), String> {
        if self.rank == 0 {
            return Err("PowerSGD rank must be at least 1".into());
        }
        if (self.use_error_feedback || self.warm_start) && self.start_iter < 2 {
            return Err(format!(
                "PowerSGD start iteration {} with error feedback or warm start: it must be at least 2, because DDP \
                 rebuilds its buckets after the first iteration and per-bucket state would not fit them",
                self.start_iter
            ));
        }
        if !(self.min_compression_rate >= 1.0 && self.min_compression_rate.is_finite()) {
            return Err(format!(
                "PowerSGD min compression rate must be finite and >= 1, got {}",
                self.min_compression_rate
            ));
        }
        Ok(())
    }
}

/// One matrix of a bucket that is sent compressed.
#[derive(Debug, Clone, Copy)]
struct Matrix {
    offset: usize,
    n: usize,
    m: usize,
    r: usize,
}

struct State {
    /// The rank this hook serves (its state is one rank's): set on first use.
    rank: Option<usize>,
    iter: usize,
    rng: Rng,
    /// Per bucket: what compression dropped last time.
    error: HashMap<usize, Vec<f32>>,
    /// Per bucket: each compressed matrix's Q, stored transposed (r × m, row-major).
    q: HashMap<usize, Vec<Vec<f32>>>,
    /// Completes when the last bucket handed to the hook has been reduced.
    tail: Option<Work<()>>,
}

/// The PowerSGD communication hook (see the module docs).
pub struct PowerSgdHook {
    cfg: PowerSgdConfig,
    state: Arc<Mutex<State>>,
}

impl PowerSgdHook {
    /// A hook with `cfg` (checked).
    pub fn new(cfg: PowerSgdConfig) -> Result<PowerSgdHook, DdpError> {
        cfg.validate()?;
        Ok(PowerSgdHook {
            state: Arc::new(Mutex::new(State {
                rank: None,
                iter: 0,
                rng: Rng::new(cfg.seed),
                error: HashMap::new(),
                q: HashMap::new(),
                tail: None,
            })),
            cfg,
        })
    }

    /// Iterations seen so far (one per backward pass: counted at each pass's last bucket).
    pub fn iteration(&self) -> usize {
        lock(&self.state).iter
    }

    /// The error-feedback memory of bucket `index` (what compression dropped last time).
    pub fn error(&self, index: usize) -> Option<Vec<f32>> {
        lock(&self.state).error.get(&index).cloned()
    }
}

fn lock(s: &Mutex<State>) -> MutexGuard<'_, State> {
    s.lock().unwrap_or_else(|e| e.into_inner())
}

/// A work already completed with `value` (its waits, and those of what is chained on it, use
/// `comm`'s timeout).
fn done<T: Send + 'static>(comm: &dyn Communicator, tag: &str, value: T) -> Work<T> {
    let (w, p) = Work::pending(comm.rank(), tag, comm.timeout());
    p.complete(Ok(value));
    w
}

impl CommHook for PowerSgdHook {
    fn name(&self) -> String {
        format!("powersgd:{}", self.cfg.rank)
    }

    fn reduce(&self, comm: &Arc<dyn Communicator>, bucket: GradBucket) -> Work<Vec<f32>> {
        let (tail, tail_done) = Work::<()>::pending(comm.rank(), "powersgd order", comm.timeout());
        let mut st = lock(&self.state);
        if *st.rank.get_or_insert(comm.rank()) != comm.rank() {
            let msg = format!(
                "one PowerSgdHook was handed to ranks {} and {}: it holds one rank's state (error feedback, \
                 Q, the order of its collectives), so create one hook per rank",
                st.rank.unwrap_or_default(),
                comm.rank()
            );
            return done(comm.as_ref(), &bucket_tag(bucket.index), ())
                .then(move |()| Err(CommError::InvalidArgument(msg)));
        }
        let previous = st.tail.replace(tail);
        drop(st);
        let start = previous.unwrap_or_else(|| done(comm.as_ref(), &bucket_tag(bucket.index), ()));
        let (state, cfg, comm) = (self.state.clone(), self.cfg, comm.clone());
        start
            .and_then(move |()| Ok(reduce_bucket(&state, cfg, comm, bucket)))
            .then(move |v| {
                tail_done.complete(Ok(()));
                Ok(v)
            })
    }
}

/// Issues bucket's collectives (the previous bucket's are done).
fn reduce_bucket(
    state: &Arc<Mutex<State>>,
    cfg: PowerSgdConfig,
    comm: Arc<dyn Communicator>,
    bucket: GradBucket,
) -> Work<Vec<f32>> {
    let tag = bucket_tag(bucket.index);
    let world = comm.world_size();
    let mut st = lock(state);
    let iter = st.iter;
    if bucket.is_last {
        st.iter += 1;
    }
    if iter < cfg.start_iter {
        drop(st);
        return comm
            .all_reduce(Buffer::F32(bucket.buffer), ReduceOp::Avg, &tag)
            .then(into_f32);
    }
    let index = bucket.index;
    let mut input = bucket.buffer;
    if cfg.use_error_feedback {
        if let Some(e) = st.error.get(&index).filter(|e| e.len() == input.len()) {
            input.iter_mut().zip(e).for_each(|(x, e)| *x += e);
        }
    }
    let input_copy = cfg.use_error_feedback.then(|| input.clone());

    let mut plain: Vec<(usize, usize)> = vec![];
    let mut matrices: Vec<Matrix> = vec![];
    for p in &bucket.params {
        let len = p.len();
        if p.shape.len() >= 2 && len > 0 {
            let (n, m) = (p.shape[0], len / p.shape[0]);
            let r = cfg.rank.min(n).min(m);
            if (((n + m) * r) as f64) * cfg.min_compression_rate < (n * m) as f64 {
                matrices.push(Matrix {
                    offset: p.offset,
                    n,
                    m,
                    r,
                });
                continue;
            }
        }
        plain.push((p.offset, len));
    }

    let warm = cfg.warm_start
        && st.q.get(&index).is_some_and(|qs| {
            qs.len() == matrices.len() && qs.iter().zip(&matrices).all(|(q, mx)| q.len() == mx.r * mx.m)
        });
    let qs: Vec<Vec<f32>> = if warm {
        st.q[&index].clone()
    } else {
        // one draw per bucket from the shared generator: every rank gets the same Q
        let mut rng = Rng::new(st.rng.next_u64());
        matrices
            .iter()
            .map(|mx| {
                let mut q: Vec<f32> = (0..mx.r * mx.m).map(|_| rng.normal() as f32).collect();
                orthogonalize_rows(&mut q, mx.r, mx.m);
                q
            })
            .collect()
    };
    drop(st);

    let ps: Vec<f32> = matrices
        .iter()
        .zip(&qs)
        .flat_map(|(mx, q)| m_times_qt(&input[mx.offset..], *mx, q))
        .collect();
    let plain_buf: Vec<f32> = plain
        .iter()
        .flat_map(|&(o, l)| input[o..o + l].iter().copied())
        .collect();
    let first = if plain_buf.is_empty() {
        done(comm.as_ref(), &tag, Buffer::F32(vec![]))
    } else {
        comm.all_reduce(Buffer::F32(plain_buf), ReduceOp::Sum, &tag)
    };
    let state = state.clone();
    first.and_then(move |reduced| {
        let reduced = into_f32(reduced)?;
        let mut at = 0;
        for &(o, l) in &plain {
            for (x, r) in input[o..o + l].iter_mut().zip(&reduced[at..at + l]) {
                *x = r / world as f32;
            }
            at += l;
        }
        let comm2 = comm.clone();
        Ok(comm
            .all_reduce(Buffer::F32(ps), ReduceOp::Sum, &tag)
            .and_then(move |ps| {
                let mut ps = into_f32(ps)?;
                let mut qs_new = vec![];
                let mut at = 0;
                for mx in &matrices {
                    let p = &mut ps[at..at + mx.n * mx.r];
                    orthogonalize_columns(p, mx.n, mx.r);
                    qs_new.push(mt_times_p(&input[mx.offset..], *mx, p));
                    at += mx.n * mx.r;
                }
                let qflat: Vec<f32> = qs_new.into_iter().flatten().collect();
                Ok(comm2
                    .all_reduce(Buffer::F32(qflat), ReduceOp::Sum, &tag)
                    .then(move |qb| {
                        let mut qflat = into_f32(qb)?;
                        qflat.iter_mut().for_each(|q| *q /= world as f32);
                        let (mut pat, mut qat) = (0, 0);
                        let mut qs_keep = vec![];
                        for mx in &matrices {
                            let (p, q) = (&ps[pat..pat + mx.n * mx.r], &qflat[qat..qat + mx.r * mx.m]);
                            p_times_qt(&mut input[mx.offset..mx.offset + mx.n * mx.m], *mx, p, q);
                            qs_keep.push(q.to_vec());
                            pat += mx.n * mx.r;
                            qat += mx.r * mx.m;
                        }
                        let mut st = lock(&state);
                        if let Some(copy) = input_copy {
                            st.error
                                .insert(index, copy.iter().zip(&input).map(|(a, b)| a - b).collect());
                        }
                        if cfg.warm_start {
                            st.q.insert(index, qs_keep);
                        }
                        Ok(input)
                    }))
            }))
    })
}

/// Gram–Schmidt over the `cols` columns of a row-major `rows × cols` matrix; a column with no
/// norm left becomes zero (never NaN).
fn orthogonalize_columns(a: &mut [f32], rows: usize, cols: usize) {
    for i in 0..cols {
        let norm = (0..rows).map(|k| a[k * cols + i] * a[k * cols + i]).sum::<f32>().sqrt();
        for k in 0..rows {
            a[k * cols + i] = if norm > 0.0 { a[k * cols + i] / norm } else { 0.0 };
        }
        for j in i + 1..cols {
            let dot: f32 = (0..rows).map(|k| a[k * cols + i] * a[k * cols + j]).sum();
            for k in 0..rows {
                a[k * cols + j] -= dot * a[k * cols + i];
            }
        }
    }
}

/// Gram–Schmidt over the `rows` rows of a row-major `rows × cols` matrix (Q's columns, as Qᵀ).
fn orthogonalize_rows(a: &mut [f32], rows: usize, cols: usize) {
    for i in 0..rows {
        let (head, tail) = a.split_at_mut((i + 1) * cols);
        let row = &mut head[i * cols..];
        let norm = row.iter().map(|x| x * x).sum::<f32>().sqrt();
        row.iter_mut()
            .for_each(|x| *x = if norm > 0.0 { *x / norm } else { 0.0 });
        for other in tail.chunks_mut(cols) {
            let dot: f32 = row.iter().zip(other.iter()).map(|(a, b)| a * b).sum();
            other.iter_mut().zip(row.iter()).for_each(|(o, r)| *o -= dot * r);
        }
    }
}

/// P = M·Q (n × r, row-major) for M at the start of `m`, with Q given as Qᵀ (r × m).
fn m_times_qt(m: &[f32], mx: Matrix, qt: &[f32]) -> Vec<f32> {
    let mut p = vec![0.0f32; mx.n * mx.r];
    for i in 0..mx.n {
        let row = &m[i * mx.m..(i + 1) * mx.m];
        for k in 0..mx.r {
            p[i * mx.r + k] = row.iter().zip(&qt[k * mx.m..(k + 1) * mx.m]).map(|(a, b)| a * b).sum();
        }
    }
    p
}

/// Qᵀ = (Mᵀ·P)ᵀ = Pᵀ·M (r × m, row-major).
fn mt_times_p(m: &[f32], mx: Matrix, p: &[f32]) -> Vec<f32> {
    let mut qt = vec![0.0f32; mx.r * mx.m];
    for i in 0..mx.n {
        let row = &m[i * mx.m..(i + 1) * mx.m];
        for k in 0..mx.r {
            let pik = p[i * mx.r + k];
            qt[k * mx.m..(k + 1) * mx.m]
                .iter_mut()
                .zip(row)
                .for_each(|(q, x)| *q += pik * x);
        }
    }
    qt
}

/// M = P·Qᵀ written into `out` (n × m), with Q given as Qᵀ (r × m).
fn p_times_qt(out: &mut [f32], mx: Matrix, p: &[f32], qt: &[f32]) {
    for i in 0..mx.n {
        let row = &mut out[i * mx.m..(i + 1) * mx.m];
        row.iter_mut().for_each(|x| *x = 0.0);
        for k in 0..mx.r {
            let pik = p[i * mx.r + k];
            row.iter_mut()
                .zip(&qt[k * mx.m..(k + 1) * mx.m])
                .for_each(|(x, q)| *x += pik * q);
        }
    }
}
