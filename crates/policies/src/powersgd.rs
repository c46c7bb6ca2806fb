//! PowerSGD (Vogels et al. 2019; PyTorch's `powerSGD_hook`): each gradient matrix M (n × m) is
//! sent as two thin factors, P = M·Q (n × r) and Q = Mᵀ·P (m × r), found by one step of power
//! iteration, with error feedback so what compression drops now is sent later.
//!
//! Per bucket, once `start_iter` iterations have run with plain all-reduce:
//! 1. error feedback: add the error each parameter left last time; keep a copy of the input;
//! 2. tensors that would not compress (1-D, or `(n + m)·r·min_compression_rate ≥ n·m`) are
//!    sent uncompressed, in the all-reduce of step 3 (one buffer: these tensors, then the
//!    P's), and divided by the world size;
//! 3. P = M·Q, with Q from the last iteration (warm start) or drawn from a generator that every
//!    rank seeds alike; all-reduce P; orthogonalize P's columns (Gram–Schmidt);
//! 4. Q = Mᵀ·P; all-reduce Q; divide by the world size;
//! 5. M ≈ P·Qᵀ written into the bucket; the error is the input minus that.
//!
//! Everything is tensor ops on the bucket's device. The error feedback and Q are kept **per
//! parameter**, so they survive DDP's bucket rebuilds and cap changes (PyTorch keys them by
//! bucket index and so must start after the rebuild); they are this rank's state in
//! checkpoints. Buckets are processed one after the other (each bucket's collectives are
//! issued once the previous bucket's are done), so every rank issues the same collectives in
//! the same order.
//!
//! Under fp16's dynamic loss scaling ([`StepContext::loss_scale`]) the buckets hold scaled
//! gradients, so the error feedback is kept in the scaled units of the next step: after each
//! step it is multiplied by the scale change (a power of two, exact), and after a skipped step
//! (its gradients held an inf or a NaN, which reach every rank's factors) the error feedback
//! and the warm-start Q are put back as they were before that step. Q needs no rescaling: the
//! power iteration normalizes P, so Q's scale does not reach the approximation.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use brigade_comm::ReduceOp;
use brigade_ddp::policy::{
    BucketSpan, Group, PolicyBucket, PolicyDiagnostic, PolicyMemory, ReducerPolicy, Reduction, StepContext, TensorWork,
    WireModel,
};
use brigade_ddp::DdpError;
use brigade_tensor::{DType, Rng, Tensor};

use crate::error::PolicyError;
use crate::spec::{spec_error, PolicySpec, DEFAULT_POWERSGD_START};

/// PowerSGD's settings; defaults follow PyTorch's `PowerSGDState` except `start_iter`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PowerSgdConfig {
    /// Rank r of the approximation (PyTorch: `matrix_approximation_rank`, default 1).
    pub rank: usize,
    /// Iterations reduced with plain all-reduce before compression starts (PyTorch:
    /// `start_powerSGD_iter`).
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

impl PowerSgdConfig {
    /// The rule for a gradient of `shape` (`len` elements): a matrix `n × m` (n = `shape[0]`)
    /// is sent as factors P (`n × r'`) and Q (`m × r'`) of rank r' = min(rank, n, m) when
    /// `(n + m)·r'·min_compression_rate < n·m`: `Some((n, m, r'))`; anything else is sent whole.
    pub fn low_rank(&self, shape: &[usize], len: usize) -> Option<(usize, usize, usize)> {
        if shape.len() < 2 || len == 0 {
            return None;
        }
        let (n, m) = (shape[0], len / shape[0]);
        let r = self.rank.min(n).min(m);
        ((((n + m) * r) as f64) * self.min_compression_rate < (n * m) as f64).then_some((n, m, r))
    }
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
    pub fn validate(&self) -> Result<(), PolicyError> {
        let fail = |reason: String| {
            Err(PolicyError::Config {
                policy: "powersgd".into(),
                reason,
            })
        };
        if self.rank == 0 {
            return fail("PowerSGD rank must be at least 1".into());
        }
        if !(self.min_compression_rate >= 1.0 && self.min_compression_rate.is_finite()) {
            return fail(format!(
                "PowerSGD min compression rate must be finite and >= 1, got {}",
                self.min_compression_rate
            ));
        }
        Ok(())
    }
}

/// `powersgd:R[@START]` read (`spec` is the whole spec, for the error).
pub(crate) fn read_spec(spec: &str, arg: Option<&str>) -> Result<PolicySpec, PolicyError> {
    let arg = arg.ok_or_else(|| spec_error(spec, "PowerSGD needs its rank: powersgd:R or powersgd:R@START"))?;
    let (rank, start) = match arg.split_once('@') {
        Some((r, st)) => (r, Some(st)),
        None => (arg, None),
    };
    let rank: usize = rank.parse().ok().filter(|&r| r > 0).ok_or_else(|| {
        spec_error(
            spec,
            format!("PowerSGD's rank must be a whole number >= 1, got '{rank}'"),
        )
    })?;
    let start_iter = match start {
        None => DEFAULT_POWERSGD_START,
        Some(st) => st.parse().map_err(|_| {
            spec_error(
                spec,
                format!("PowerSGD's start iteration must be a whole number, got '{st}'"),
            )
        })?,
    };
    Ok(PolicySpec::PowerSgd { rank, start_iter })
}

/// `R[@START]` of a PowerSGD spec (`@START` left out at the default start).
pub(crate) fn write_spec(spec: &PolicySpec) -> Option<String> {
    match *spec {
        PolicySpec::PowerSgd { rank, start_iter } if start_iter == DEFAULT_POWERSGD_START => Some(rank.to_string()),
        PolicySpec::PowerSgd { rank, start_iter } => Some(format!("{rank}@{start_iter}")),
        _ => None,
    }
}

/// A plan measures PowerSGD per rank: the start does not change a profiled step's compute.
pub(crate) fn family(spec: &PolicySpec) -> PolicySpec {
    match *spec {
        PolicySpec::PowerSgd { rank, .. } => PolicySpec::PowerSgd {
            rank,
            start_iter: DEFAULT_POWERSGD_START,
        },
        ref other => other.clone(),
    }
}

/// What a plan tries when no profile recorded PowerSGD: rank 1, to say it was not profiled.
pub(crate) fn plan_default() -> PolicySpec {
    PolicySpec::PowerSgd {
        rank: 1,
        start_iter: DEFAULT_POWERSGD_START,
    }
}

/// One rank's PowerSGD of `spec`.
pub(crate) fn build_spec(spec: &PolicySpec) -> Result<Box<dyn ReducerPolicy>, PolicyError> {
    let PolicySpec::PowerSgd { rank, start_iter } = *spec else {
        unreachable!("the powersgd entry builds PowerSGD specs")
    };
    Ok(Box::new(PowerSgd::new(PowerSgdConfig {
        rank,
        start_iter,
        ..PowerSgdConfig::default()
    })?))
}

/// The code of the diagnostic a PowerSGD run that compressed nothing leaves
/// ([`brigade_ddp::policy::PolicyDiagnostic::code`]): every byte went as a plain all-reduce.
pub const NEVER_COMPRESSED: &str = "never-compressed";

/// PowerSGD's settings as values of their own (a report's keys, an older command line's
/// flags): its rank and its start iteration.
pub const POWERSGD_SETTINGS: [&str; 2] = ["powersgd_rank", "powersgd_start_iter"];

impl PolicySpec {
    /// The spec's settings as values of their own, by name ([`POWERSGD_SETTINGS`] for
    /// PowerSGD; none for the others).
    pub fn settings(&self) -> Vec<(&'static str, usize)> {
        match *self {
            PolicySpec::PowerSgd { rank, start_iter } => {
                vec![(POWERSGD_SETTINGS[0], rank), (POWERSGD_SETTINGS[1], start_iter)]
            }
            _ => vec![],
        }
    }

    /// Whether the policy keeps state per bucket, so that its buckets may not regroup mid-run.
    pub fn keeps_state_per_bucket(&self) -> bool {
        matches!(self, PolicySpec::PowerSgd { .. })
    }
}

/// One matrix of a bucket that is sent compressed.
#[derive(Debug, Clone, Copy)]
struct Matrix {
    param: usize,
    offset: usize,
    n: usize,
    m: usize,
    r: usize,
}

struct State {
    /// Iterations seen (one per backward pass: counted at each pass's last bucket).
    iter: usize,
    /// Fresh Q draws so far (the generator is replayed from the seed on load).
    draws: u64,
    rng: Rng,
    /// Per parameter: what compression dropped last time.
    error: HashMap<usize, Tensor>,
    /// Per compressed matrix parameter: its last Q (m × r).
    q: HashMap<usize, Tensor>,
    /// Matrices sent compressed so far.
    compressed: u64,
    /// Completes when the last bucket handed to the policy has been reduced.
    tail: Option<TensorWork<()>>,
    /// Under loss scaling, `error` and `q` as the current step started (what a skipped step
    /// puts back); `None` otherwise.
    before_step: Option<Feedback>,
}

/// The error feedback and the warm-start factors, as a step started.
type Feedback = (HashMap<usize, Tensor>, HashMap<usize, Tensor>);

impl State {
    fn feedback(&self) -> Feedback {
        (self.error.clone(), self.q.clone())
    }
}

/// The PowerSGD reducer policy (see the module docs).
pub struct PowerSgd {
    cfg: PowerSgdConfig,
    state: Arc<Mutex<State>>,
    /// Parameter names and registration indices (for state dicts), from the bucket layout.
    names: HashMap<usize, String>,
}

fn lock(s: &Mutex<State>) -> MutexGuard<'_, State> {
    s.lock().unwrap_or_else(|e| e.into_inner())
}

impl PowerSgd {
    /// A policy with `cfg` (checked).
    pub fn new(cfg: PowerSgdConfig) -> Result<PowerSgd, PolicyError> {
        cfg.validate()?;
        Ok(PowerSgd {
            state: Arc::new(Mutex::new(State {
                iter: 0,
                draws: 0,
                rng: Rng::new(cfg.seed),
                error: HashMap::new(),
                q: HashMap::new(),
                compressed: 0,
                tail: None,
                before_step: Some(Default::default()),
            })),
            cfg,
            names: HashMap::new(),
        })
    }

    /// Iterations seen so far.
    pub fn iteration(&self) -> usize {
        lock(&self.state).iter
    }

    /// Matrices sent compressed so far (0: the run never compressed).
    pub fn compressed_matrices(&self) -> u64 {
        lock(&self.state).compressed
    }

    /// The error-feedback memory of parameter `index` (what compression dropped last time).
    pub fn error(&self, index: usize) -> Option<Vec<f32>> {
        lock(&self.state).error.get(&index).and_then(|t| t.to_vec().ok())
    }
}

/// Smallest positive normal f32: a column whose norm is below it is zero, and stays zero.
const TINY: f64 = f32::MIN_POSITIVE as f64;

/// Gram–Schmidt over the columns of a contiguous `rows × cols` tensor, in place; a column with
/// no norm left becomes zero (never NaN).
fn orthogonalize_columns(a: &Tensor) -> brigade_ddp::Result<()> {
    let cols = a.shape()[1];
    for i in 0..cols {
        let col = a.narrow(1, i, 1)?;
        let norm = col.sqr()?.sum_all()?.sqrt()?;
        // max(norm, TINY): x / TINY is 0 for a zero column
        let safe = norm.add_scalar(-TINY)?.relu()?.add_scalar(TINY)?;
        let unit = col.div(&safe)?;
        col.copy_from(&unit)?;
        for j in i + 1..cols {
            let other = a.narrow(1, j, 1)?;
            let dot = unit.mul(&other)?.sum_all()?;
            other.copy_from(&other.sub(&unit.mul(&dot)?)?)?;
        }
    }
    Ok(())
}

fn scalar_i64(x: u64) -> brigade_ddp::Result<Tensor> {
    Ok(Tensor::from_vec(vec![x as i64], &[1])?)
}

impl ReducerPolicy for PowerSgd {
    fn name(&self) -> String {
        PolicySpec::PowerSgd {
            rank: self.cfg.rank,
            start_iter: self.cfg.start_iter,
        }
        .to_string()
    }

    fn keeps_state(&self) -> brigade_ddp::KeepsState {
        brigade_ddp::KeepsState::InStateDict
    }

    fn buckets_built(&mut self, buckets: &[BucketSpan], _generation: u64) -> brigade_ddp::Result<()> {
        for p in buckets.iter().flat_map(|b| &b.params) {
            self.names.insert(p.index, p.name.clone());
        }
        Ok(())
    }

    fn reduce(&mut self, bucket: PolicyBucket, comm: &Group) -> brigade_ddp::Result<Reduction> {
        let (tail, tail_done) = TensorWork::<()>::pending(comm.rank(), "powersgd order", comm.timeout());
        let previous = lock(&self.state).tail.replace(tail);
        let start = previous.unwrap_or_else(|| comm.ready(()));
        let (state, cfg, comm2) = (self.state.clone(), self.cfg, comm.clone());
        let work = start
            .and_then(move |()| reduce_bucket(&state, cfg, &comm2, bucket))
            .then(move |t| {
                tail_done.complete(Ok(()));
                Ok(t)
            });
        Ok(Reduction::Full(work))
    }

    fn state_dict(&self) -> brigade_ddp::Result<Vec<(String, Tensor)>> {
        let st = lock(&self.state);
        let mut out = vec![
            ("iteration".to_string(), scalar_i64(st.iter as u64)?),
            ("draws".to_string(), scalar_i64(st.draws)?),
            ("compressed".to_string(), scalar_i64(st.compressed)?),
        ];
        let name = |p: &usize| self.names.get(p).cloned().unwrap_or_else(|| format!("param{p}"));
        let mut keyed: Vec<(String, Tensor)> = st
            .error
            .iter()
            .map(|(p, t)| (format!("error.{}", name(p)), t.clone()))
            .chain(st.q.iter().map(|(p, t)| (format!("q.{}", name(p)), t.clone())))
            .collect();
        keyed.sort_by(|a, b| a.0.cmp(&b.0));
        out.extend(keyed);
        Ok(out)
    }

    fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> brigade_ddp::Result<()> {
        let bad = |reason: String| DdpError::PolicyState(format!("{}: {reason}", self.name()));
        let count = |key: &str| -> brigade_ddp::Result<u64> {
            let t = state
                .iter()
                .find(|(k, _)| k == key)
                .map(|(_, t)| t)
                .ok_or_else(|| bad(format!("the state has no '{key}'")))?;
            Ok(t.item()? as u64)
        };
        let by_name: HashMap<&str, usize> = self.names.iter().map(|(&i, n)| (n.as_str(), i)).collect();
        let mut st = lock(&self.state);
        st.iter = count("iteration")? as usize;
        st.draws = count("draws")?;
        st.compressed = count("compressed")?;
        st.rng = Rng::new(self.cfg.seed);
        for _ in 0..st.draws {
            st.rng.next_u64();
        }
        st.error.clear();
        st.q.clear();
        for (key, t) in state {
            let (map, name) = if let Some(n) = key.strip_prefix("error.") {
                (&mut st.error, n)
            } else if let Some(n) = key.strip_prefix("q.") {
                (&mut st.q, n)
            } else {
                continue;
            };
            let p = *by_name
                .get(name)
                .ok_or_else(|| bad(format!("'{key}' names no parameter of this model")))?;
            map.insert(p, t.to_dtype(DType::F32)?.copy()?);
        }
        st.tail = None;
        st.before_step = Some(st.feedback());
        Ok(())
    }

    fn after_step(&mut self, step: &StepContext<'_>, _comm: &Group) -> brigade_ddp::Result<()> {
        let mut st = lock(&self.state);
        let Some(scaling) = step.loss_scale else {
            st.before_step = None;
            return Ok(());
        };
        if scaling.skipped {
            if let Some((error, q)) = st.before_step.take() {
                (st.error, st.q) = (error, q);
            }
        }
        let rescale = scaling.rescale();
        if rescale != 1.0 {
            for e in st.error.values_mut() {
                *e = e.mul_scalar(rescale)?;
            }
        }
        st.before_step = Some(st.feedback());
        Ok(())
    }

    fn memory(&self) -> PolicyMemory {
        let st = lock(&self.state);
        let bytes = |t: &Tensor| t.numel() * t.dtype().size_in_bytes();
        PolicyMemory {
            state_bytes: st.error.values().chain(st.q.values()).map(bytes).sum(),
            scratch_bytes: 0,
            ..PolicyMemory::default()
        }
    }

    fn wire_model(&self, shapes: &[Vec<usize>], _world_size: usize) -> Option<WireModel> {
        let cfg = &self.cfg;
        Some(WireModel::LowRank {
            start_iter: cfg.start_iter,
            factors: shapes
                .iter()
                .map(|s| {
                    let len = s.iter().product();
                    cfg.low_rank(s, len).map(|(n, m, r)| (n * r, m * r))
                })
                .collect(),
        })
    }

    fn diagnostics(&self) -> Vec<PolicyDiagnostic> {
        let st = lock(&self.state);
        if st.iter == 0 || st.compressed > 0 {
            return vec![];
        }
        let message = if st.iter <= self.cfg.start_iter {
            format!(
                "{} never compressed: the run ended after {} iteration(s), before its start iteration {}; every \
                 byte went uncompressed",
                self.name(),
                st.iter,
                self.cfg.start_iter
            )
        } else {
            format!(
                "{} compressed no tensor in {} iterations: every gradient is 1-D or shrinks less than the min \
                 compression rate {} at rank {}; every byte went uncompressed",
                self.name(),
                st.iter,
                self.cfg.min_compression_rate,
                self.cfg.rank
            )
        };
        vec![PolicyDiagnostic {
            code: NEVER_COMPRESSED,
            message,
        }]
    }
}

/// Issues `bucket`'s collectives (the previous bucket's are done): a plain average before
/// `start_iter`, else PowerSGD's two all-reduces: the tensors sent whole together with the
/// P's in one buffer, then the Q's (a bucket with no matrix to compress: the first alone).
fn reduce_bucket(
    state: &Arc<Mutex<State>>,
    cfg: PowerSgdConfig,
    comm: &Group,
    bucket: PolicyBucket,
) -> brigade_ddp::Result<TensorWork<Tensor>> {
    let tag = bucket.tag();
    let mut st = lock(state);
    let iter = st.iter;
    if bucket.is_last {
        st.iter += 1;
    }
    if iter < cfg.start_iter {
        drop(st);
        return Ok(comm.all_reduce(&bucket.tensor, ReduceOp::Avg, &tag));
    }
    let work = BucketWork::new(&mut st, cfg, &bucket)?;
    drop(st);
    let world = Tensor::full_on(&[], comm.world_size() as f64, DType::F32, work.input.device())?;
    let sent = work.pack_plain_and_ps()?;
    let first = match sent.numel() {
        0 => comm.ready(sent),
        _ => comm.all_reduce(&sent, ReduceOp::Sum, &tag),
    };
    let finish = Finish {
        state: state.clone(),
        cfg,
        params: bucket.params,
    };
    let comm2 = comm.clone();
    Ok(first.and_then(move |sum| {
        let plain_len = work.plain_len();
        if plain_len > 0 {
            work.unpack_plain(&sum.narrow(0, 0, plain_len)?.div(&world)?)?;
        }
        if work.matrices.is_empty() {
            return Ok(comm2.ready(finish.land(work, vec![])?));
        }
        let ps = sum.narrow(0, plain_len, sum.numel() - plain_len)?;
        let (qflat, pviews) = work.qs_from_ps(&ps)?;
        Ok(comm2.all_reduce(&qflat, ReduceOp::Sum, &tag).then(move |qsum| {
            let qs = work.approximate(&pviews, &qsum.div(&world)?)?;
            finish.land(work, qs)
        }))
    }))
}

/// One bucket under compression: its f32 input (the error feedback added), a copy of it for
/// the next error, its low-rank matrices with their starting Q's, its tensors sent whole.
struct BucketWork {
    input: Tensor,
    input_copy: Option<Tensor>,
    bucket_dtype: DType,
    matrices: Vec<Matrix>,
    qs: Vec<Tensor>,
    /// `(offset, len)` of each tensor sent whole.
    plain: Vec<(usize, usize)>,
}

impl BucketWork {
    /// `bucket` widened to f32 (a 16-bit bucket is compressed from an f32 copy and rounded
    /// once at the end), its error feedback added, split into matrices and plain tensors.
    fn new(st: &mut State, cfg: PowerSgdConfig, bucket: &PolicyBucket) -> brigade_ddp::Result<BucketWork> {
        let bucket_dtype = bucket.tensor.dtype();
        let input = match bucket_dtype {
            DType::F32 => bucket.tensor.clone(),
            _ => bucket.tensor.to_dtype(DType::F32)?,
        };
        let mut input_copy = None;
        if cfg.use_error_feedback {
            for p in &bucket.params {
                if let Some(e) = st.error.get(&p.index).filter(|e| e.numel() == p.len()) {
                    input.narrow(0, p.offset, p.len())?.add_assign(e)?;
                }
            }
            input_copy = Some(input.copy()?);
        }
        let (mut plain, mut matrices) = (vec![], vec![]);
        for p in &bucket.params {
            match cfg.low_rank(&p.shape, p.len()) {
                Some((n, m, r)) => matrices.push(Matrix {
                    param: p.index,
                    offset: p.offset,
                    n,
                    m,
                    r,
                }),
                None => plain.push((p.offset, p.len())),
            }
        }
        let qs = starting_qs(st, cfg, &matrices, input.device())?;
        st.compressed += matrices.len() as u64;
        Ok(BucketWork {
            input,
            input_copy,
            bucket_dtype,
            matrices,
            qs,
            plain,
        })
    }

    /// Elements of the tensors sent whole.
    fn plain_len(&self) -> usize {
        self.plain.iter().map(|&(_, l)| l).sum()
    }

    /// What the first all-reduce sends, in one buffer: the tensors sent whole, then every
    /// matrix's `P = M Q` (empty: the bucket holds neither).
    fn pack_plain_and_ps(&self) -> brigade_ddp::Result<Tensor> {
        let p_len: usize = self.matrices.iter().map(|mx| mx.n * mx.r).sum();
        let buf = Tensor::zeros_on(&[self.plain_len() + p_len], DType::F32, self.input.device())?;
        let mut at = 0;
        for &(o, l) in &self.plain {
            buf.narrow(0, at, l)?.copy_from(&self.input.narrow(0, o, l)?)?;
            at += l;
        }
        for (mx, q) in self.matrices.iter().zip(&self.qs) {
            let p = self.matrix(mx)?.matmul(q)?;
            buf.narrow(0, at, mx.n * mx.r)?.copy_from(&p.reshape(&[mx.n * mx.r])?)?;
            at += mx.n * mx.r;
        }
        Ok(buf)
    }

    /// Writes the averaged plain tensors back into the input.
    fn unpack_plain(&self, avg: &Tensor) -> brigade_ddp::Result<()> {
        let mut at = 0;
        for &(o, l) in &self.plain {
            self.input.narrow(0, o, l)?.copy_from(&avg.narrow(0, at, l)?)?;
            at += l;
        }
        Ok(())
    }

    /// Matrix `mx` of the input, `[n, m]`.
    fn matrix(&self, mx: &Matrix) -> brigade_ddp::Result<Tensor> {
        Ok(self.input.narrow(0, mx.offset, mx.n * mx.m)?.reshape(&[mx.n, mx.m])?)
    }

    /// From the summed P's: each P orthogonalized (in place, a view of `ps`) and `Q = Mᵀ P`,
    /// the Q's packed in one buffer.
    fn qs_from_ps(&self, ps: &Tensor) -> brigade_ddp::Result<(Tensor, Vec<Tensor>)> {
        let q_len: usize = self.matrices.iter().map(|mx| mx.m * mx.r).sum();
        let qflat = Tensor::zeros_on(&[q_len], DType::F32, self.input.device())?;
        let (mut pat, mut qat) = (0, 0);
        let mut pviews = vec![];
        for mx in &self.matrices {
            let p = ps.narrow(0, pat, mx.n * mx.r)?.reshape(&[mx.n, mx.r])?;
            orthogonalize_columns(&p)?;
            let q = self.matrix(mx)?.t()?.matmul(&p)?;
            qflat
                .narrow(0, qat, mx.m * mx.r)?
                .copy_from(&q.reshape(&[mx.m * mx.r])?)?;
            pviews.push(p);
            pat += mx.n * mx.r;
            qat += mx.m * mx.r;
        }
        Ok((qflat, pviews))
    }

    /// Writes each matrix's approximation `P Qᵀ` (from the averaged Q's) into the input;
    /// returns the Q's, for the next warm start.
    fn approximate(&self, pviews: &[Tensor], qavg: &Tensor) -> brigade_ddp::Result<Vec<Tensor>> {
        let mut qat = 0;
        let mut qs = vec![];
        for (mx, p) in self.matrices.iter().zip(pviews) {
            let q = qavg.narrow(0, qat, mx.m * mx.r)?.reshape(&[mx.m, mx.r])?.copy()?;
            let approx = p.matmul(&q.t()?)?;
            self.input
                .narrow(0, mx.offset, mx.n * mx.m)?
                .copy_from(&approx.reshape(&[mx.n * mx.m])?)?;
            qs.push(q);
            qat += mx.m * mx.r;
        }
        Ok(qs)
    }
}

/// The Q's a bucket's matrices start from: last step's (warm start, when every matrix has one
/// of its shape), else one draw per bucket from the shared generator, orthogonalized (every
/// rank gets the same Q's).
fn starting_qs(
    st: &mut State,
    cfg: PowerSgdConfig,
    matrices: &[Matrix],
    device: brigade_tensor::Device,
) -> brigade_ddp::Result<Vec<Tensor>> {
    let warm = cfg.warm_start
        && matrices
            .iter()
            .all(|mx| st.q.get(&mx.param).is_some_and(|q| q.shape() == [mx.m, mx.r]));
    if warm {
        return Ok(matrices.iter().map(|mx| st.q[&mx.param].clone()).collect());
    }
    let mut rng = Rng::new(st.rng.next_u64());
    st.draws += 1;
    matrices
        .iter()
        .map(|mx| {
            let v: Vec<f32> = (0..mx.r * mx.m).map(|_| rng.normal() as f32).collect();
            let q = Tensor::from_vec(v, &[mx.r, mx.m])?
                .to_device(device)?
                .t()?
                .contiguous()?;
            orthogonalize_columns(&q)?;
            Ok(q)
        })
        .collect()
}

/// What a bucket's reduction keeps once it landed: the new error feedback and the Q's.
struct Finish {
    state: Arc<Mutex<State>>,
    cfg: PowerSgdConfig,
    params: Vec<brigade_ddp::policy::BucketParam>,
}

impl Finish {
    /// Stores the error (the input before compression minus its approximation) and the Q's
    /// (`qs`, one per matrix); returns the result in the bucket's dtype.
    fn land(self, work: BucketWork, qs: Vec<Tensor>) -> brigade_ddp::Result<Tensor> {
        let mut st = lock(&self.state);
        if let Some(copy) = &work.input_copy {
            let error = copy.sub(&work.input)?;
            for p in &self.params {
                st.error.insert(p.index, error.narrow(0, p.offset, p.len())?.copy()?);
            }
        }
        if self.cfg.warm_start {
            for (mx, q) in work.matrices.iter().zip(qs) {
                st.q.insert(mx.param, q);
            }
        }
        Ok(match work.bucket_dtype {
            DType::F32 => work.input,
            _ => work.input.to_dtype(work.bucket_dtype)?,
        })
    }
}
