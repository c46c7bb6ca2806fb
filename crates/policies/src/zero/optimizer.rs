//! [`ZeroOptimizer`]: any optimizer, stepping only this rank's shard of every bucket.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use brigade_autograd::{AutogradError, GradScaler, Optimizer, ParamStore, StoredState, Var};
use brigade_comm::ReduceOp;
use brigade_ddp::policy::{Buckets, BuildOptimizer, Group, HeldGrad, OptimizerContext, TensorWork};
use brigade_ddp::DdpError;
use brigade_tensor::{DType, Tensor};

use super::shard::{pieces, shard_len, Piece};
use super::ZeroStage;

/// The most bytes one of stage 2's parameter all-gathers returns (the parameters of every
/// rank's part of a chunk of its shard), as DeepSpeed's `allgather_bucket_size` bounds it; the
/// chunks are smaller still when a shard is (scratch never exceeds a shard).
pub const ALL_GATHER_CAP_BYTES: usize = 4 << 20;

type Result<T> = brigade_ddp::Result<T>;

/// An error of the ZeRO policy named `policy` (its spec, as the user gave it).
fn zero_error(policy: &str, reason: String) -> DdpError {
    DdpError::Policy {
        policy: policy.into(),
        reason,
    }
}

/// Where the bucket elements `range` lie in the bucket's parameters `(index, numel)` (laid one
/// after another from element 0): `(parameter, first element in it, length, offset in range)`
/// for each parameter it touches; padding touches none.
fn overlaps(params: &[(usize, usize)], range: Range<usize>) -> Vec<(usize, usize, usize, usize)> {
    let mut out = vec![];
    let mut offset = 0;
    for &(p, n) in params {
        let (start, end) = (offset.max(range.start), (offset + n).min(range.end));
        if start < end {
            out.push((p, start - offset, end - start, start - range.start));
        }
        offset += n;
    }
    out
}

/// One bucket's shard on this rank: its pieces and the optimizer that holds their state.
struct ShardedBucket {
    /// Bucket index (launch order).
    index: usize,
    /// `(parameter, numel)` in bucket order.
    params: Vec<(usize, usize)>,
    /// Elements per rank (the padded shard length).
    per: usize,
    /// This rank's pieces of the parameters.
    pieces: Vec<Piece>,
    /// One leaf per piece: a view of the parameter's elements, stepped in place.
    vars: Vec<Var>,
    /// The inner optimizer over `vars`.
    opt: Box<dyn Optimizer>,
}

/// ZeRO's optimizer (PyTorch's `ZeroRedundancyOptimizer`, DeepSpeed's partitioned optimizer):
/// wraps any [`Optimizer`] so that this rank holds state only for its shard of every DDP bucket.
/// [`Optimizer::step`] steps the shard from the reduce-scattered gradients, then all-gathers
/// each bucket's updated parameters to every rank (bucket `b`'s all-gather runs on the comm
/// stream while bucket `b + 1` is stepped). Built by the ZeRO policy through
/// `DistributedDataParallel::optimizer`; every rank must step it together.
///
/// [`Optimizer::state_dict`] is the consolidated state of every shard, under the same names and
/// shapes as the wrapped optimizer's (so a checkpoint holds every shard's state); every rank
/// must call [`Optimizer::consolidate_state`] first, and only rank 0 keeps the result.
pub struct ZeroOptimizer {
    /// The policy's name (its spec), which every error of the optimizer gives.
    policy: String,
    buckets: Buckets,
    comm: Group,
    stage: ZeroStage,
    shards: Vec<ShardedBucket>,
    /// The bucket layout the shards were cut from.
    generation: u64,
    /// Peak bytes of all-gather scratch alive at once in the last step (shared with the policy's
    /// memory report).
    scratch: Arc<AtomicUsize>,
    /// Every shard's state, gathered by `consolidate_state` (rank 0 only), until `state`
    /// hands it out (so that it is not kept beside the shards).
    consolidated: Mutex<Option<Vec<(String, Tensor)>>>,
    /// The most bytes one stage-2 parameter all-gather returns.
    all_gather_cap: usize,
    /// Per bucket, this rank's f32 shard of the bucket's parameters: the master the pieces
    /// view and the step updates. Stage 3: the parameters are gathered from it by the units,
    /// not here. Stages 1 and 2 beside 16-bit parameters (mixed precision): the shard rounded
    /// to the parameters' dtype is what the step all-gathers into them.
    masters: Option<Vec<Tensor>>,
    /// The masters are f32 beside 16-bit parameters (mixed precision, any stage): they are the
    /// master weights a checkpoint saves and the memory report counts.
    mixed: bool,
    /// With `mixed`: every rank's f32 masters, whole, gathered by `consolidate_state` (rank 0
    /// only), what [`Optimizer::master_weights`] gives a checkpoint.
    consolidated_masters: Mutex<Vec<(String, Tensor)>>,
    /// fp16's dynamic loss scaler, taken over from the optimizer handed over (beside 16-bit
    /// parameters): the gradient shards are unscaled as they are widened, and a step with an
    /// inf/NaN in any rank's shard is skipped on every rank (the shards left as they were).
    scaler: Option<GradScaler>,
    /// What this step's gradient shards are multiplied by: 1 / the scale the loss was scaled
    /// by (taken before the scaler records the step, which may grow it); 1 without a scaler.
    unscale: f64,
}

/// The parameter a state entry `NAME.SUFFIX` belongs to (the longest parameter name that
/// prefixes it), and the suffix; `None` for entries of no parameter (AdamW's `step`).
fn split_key<'a>(key: &'a str, names: &[String]) -> Option<(usize, &'a str)> {
    names
        .iter()
        .enumerate()
        .filter_map(|(i, n)| key.strip_prefix(n.as_str())?.strip_prefix('.').map(|s| (i, n.len(), s)))
        .max_by_key(|&(_, len, _)| len)
        .map(|(i, _, s)| (i, s))
}

fn optimizer_error(e: DdpError) -> AutogradError {
    AutogradError::Optimizer { source: Box::new(e) }
}

fn names(params: &[Var]) -> Vec<String> {
    params
        .iter()
        .map(|p| p.name().unwrap_or("<unnamed>").to_string())
        .collect()
}

/// A gathered chunk in flight: bucket, chunk of the shard, the all-gather.
type Gather = (usize, Range<usize>, TensorWork<Tensor>);

impl ZeroOptimizer {
    /// `policy` is the policy's name (its spec), which the optimizer's errors give.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        ctx: &OptimizerContext,
        policy: String,
        stage: ZeroStage,
        scratch: Arc<AtomicUsize>,
        full: &dyn Optimizer,
        build: BuildOptimizer<'_>,
        all_gather_cap: usize,
        masters: Option<Vec<Tensor>>,
    ) -> Result<ZeroOptimizer> {
        let (rank, world) = (ctx.comm.rank(), ctx.comm.world_size());
        let params = ctx.buckets.params();
        let names = names(params);
        let param_dtype = params.first().map_or(DType::F32, |p| p.value().dtype());
        let mixed = masters.is_some() && param_dtype != DType::F32;
        let mut scaler = full.grad_scaler().filter(|_| mixed);
        let state = match &mut scaler {
            Some(s) => s.load_from(&full.state_dict()?)?,
            None => whole_state(full, &names)?,
        };
        let mut shards = vec![];
        for (b, span) in ctx.buckets.spans().into_iter().enumerate() {
            let bucket: Vec<(usize, usize)> = span.params.iter().map(|p| (p.index, p.len())).collect();
            let pieces = pieces(&bucket, world, rank);
            let mut store = ParamStore::new();
            for piece in &pieces {
                let value = match &masters {
                    Some(m) => m[b].flat_view(piece.shard_offset, &[piece.len])?,
                    None => params[piece.param]
                        .value()
                        .flat_view(piece.param_offset, &[piece.len])?,
                };
                store.add(names[piece.param].clone(), value)?;
            }
            let vars = store.params().to_vec();
            let mut opt = build(vars.clone());
            opt.set_lr(full.lr());
            let mut sliced = slice_state(&policy, &state, &names, &pieces)?;
            sliced.extend(stored_pieces(&policy, full.state_in_file(), &names, &pieces)?);
            opt.load_state_dict(&sliced)?;
            shards.push(ShardedBucket {
                index: span.index,
                per: shard_len(span.grad_numel, world),
                params: bucket,
                pieces,
                vars,
                opt,
            });
        }
        Ok(ZeroOptimizer {
            policy,
            generation: ctx.buckets.generation(),
            buckets: ctx.buckets.clone(),
            comm: ctx.comm.clone(),
            stage,
            shards,
            scratch,
            consolidated: Mutex::new(None),
            all_gather_cap,
            masters,
            mixed,
            consolidated_masters: Mutex::new(vec![]),
            scaler,
            unscale: 1.0,
        })
    }

    /// The dtype the parameters compute in (the dtype stage 2 gathers them in).
    fn param_dtype(&self) -> DType {
        self.buckets.params().first().map_or(DType::F32, |p| p.value().dtype())
    }

    /// Steps bucket `b`'s shard in place (the pieces are views of the parameters).
    fn step_bucket(&mut self, b: usize) -> Result<()> {
        let sb = &mut self.shards[b];
        let grads = match self.buckets.held(sb.index)? {
            HeldGrad::Shard { tensor, .. } => tensor,
            HeldGrad::Full(_) => {
                return Err(zero_error(
                    &self.policy,
                    format!("bucket {} holds whole gradients, not this rank's shard", sb.index),
                ))
            }
        };
        let params = self.buckets.params();
        for (piece, var) in sb.pieces.iter().zip(&sb.vars) {
            let value = match &self.masters {
                Some(m) => m[b].flat_view(piece.shard_offset, &[piece.len])?,
                None => params[piece.param]
                    .value()
                    .flat_view(piece.param_offset, &[piece.len])?,
            };
            var.set_value(value)?;
            let grad = grads.flat_view(piece.shard_offset, &[piece.len])?;
            // a 16-bit gradient shard is widened for the f32 master it steps
            let grad = match grad.dtype() == var.value().dtype() {
                true => grad,
                false => grad.to_dtype(var.value().dtype())?,
            };
            let grad = match self.scaler {
                Some(_) => grad.mul_scalar(self.unscale)?,
                None => grad,
            };
            var.set_grad(Some(grad))?;
        }
        sb.opt.step()?;
        for var in &sb.vars {
            // the shard's gradient is not this optimizer's to keep (stage 2 frees it)
            var.set_grad(None)?;
        }
        Ok(())
    }

    /// This rank's updated parameters in `chunk` of its shard of bucket `b` (zeros for padding),
    /// in `dtype`. Beside f32 masters: the masters rounded to the parameters' dtype (the
    /// compute copy every rank then holds), carried in `dtype`.
    fn send_chunk(&self, b: usize, chunk: Range<usize>, dtype: DType) -> Result<Tensor> {
        if let (Some(m), true) = (&self.masters, self.mixed) {
            let rounded = m[b].narrow(0, chunk.start, chunk.len())?.to_dtype(self.param_dtype())?;
            return Ok(match rounded.dtype() == dtype {
                true => rounded,
                false => rounded.to_dtype(dtype)?,
            });
        }
        let sb = &self.shards[b];
        let params = self.buckets.params();
        let send = Tensor::zeros_on(&[chunk.len()], dtype, self.device())?;
        let lo = self.comm.rank() * sb.per + chunk.start;
        for (p, at, len, out) in overlaps(&sb.params, lo..lo + chunk.len()) {
            send.narrow(0, out, len)?
                .copy_from(&params[p].value().flat_view(at, &[len])?)?;
        }
        Ok(send)
    }

    /// Writes `gathered` (every rank's part of `chunk` of bucket `b`, rank-major, `world × chunk`
    /// elements) into the parameters.
    fn write_chunk(&self, b: usize, chunk: Range<usize>, gathered: &Tensor) -> Result<()> {
        let sb = &self.shards[b];
        let params = self.buckets.params();
        let gathered = gathered.reshape(&[gathered.numel()])?;
        let gathered = match gathered.dtype() == self.param_dtype() {
            true => gathered,
            false => gathered.to_dtype(self.param_dtype())?,
        };
        for r in 0..self.comm.world_size() {
            let lo = r * sb.per + chunk.start;
            for (p, at, len, out) in overlaps(&sb.params, lo..lo + chunk.len()) {
                let param = params[p].value().flat_view(at, &[len])?;
                param.copy_from(&gathered.narrow(0, r * chunk.len() + out, len)?)?;
            }
        }
        Ok(())
    }

    fn tag(&self, b: usize, chunk: &Range<usize>) -> String {
        format!("zero.params{}.{}", self.shards[b].index, chunk.start)
    }

    /// Stage 1: every bucket's updated parameters are gathered into its own full gradient
    /// buffer, idle once its shard is stepped (zeroed afterwards, as after `zero_grad`): no
    /// buffer beside it but this rank's shard of parameters, sent.
    fn step_in_place(&mut self) -> Result<usize> {
        let mut in_flight: Option<Gather> = None;
        let mut peak = 0;
        for b in 0..self.shards.len() {
            self.step_bucket(b)?;
            let finish = in_flight.take().map(|(pb, pc, w)| (pb, pc, w.wait()));
            let per = self.shards[b].per;
            let buffer = self.buckets.buffer(self.shards[b].index)?;
            let send = self.send_chunk(b, 0..per, buffer.dtype())?;
            peak = peak.max(per * buffer.dtype().size_in_bytes());
            let tag = self.tag(b, &(0..per));
            in_flight = Some((b, 0..per, self.comm.all_gather_into(&send, &buffer, &tag)));
            if let Some((pb, pc, gathered)) = finish {
                self.write_gathered(pb, pc, gathered?)?;
            }
        }
        if let Some((pb, pc, w)) = in_flight {
            self.write_gathered(pb, pc, w.wait()?)?;
        }
        Ok(peak)
    }

    fn write_gathered(&self, b: usize, chunk: Range<usize>, buffer: Tensor) -> Result<()> {
        self.write_chunk(b, chunk, &buffer)?;
        buffer.fill(0.0)?;
        Ok(())
    }

    /// Stage 2: the full buffers are freed, so the parameters are gathered in chunks: three
    /// gathered chunks alive at most (two in flight, one being written), each at most a third of
    /// a shard's worth (and the all-gather cap).
    fn step_chunked(&mut self) -> Result<usize> {
        let world = self.comm.world_size().max(1);
        // the gathered parameters travel in their own dtype (16-bit under mixed precision)
        let dtype = self.param_dtype();
        let elem_bytes = dtype.size_in_bytes();
        let mut in_flight: VecDeque<Gather> = VecDeque::new();
        let mut peak = 0;
        let alive = |q: &VecDeque<Gather>| -> usize { q.iter().map(|(_, c, _)| c.len() * world * elem_bytes).sum() };
        for b in 0..self.shards.len() {
            self.step_bucket(b)?;
            let per = self.shards[b].per;
            let chunk_len = (self.all_gather_cap / elem_bytes / world).min(per / (3 * world)).max(1);
            for start in (0..per).step_by(chunk_len) {
                let chunk = start..(start + chunk_len).min(per);
                let send = self.send_chunk(b, chunk.clone(), dtype)?;
                let tag = self.tag(b, &chunk);
                in_flight.push_back((b, chunk, self.comm.all_gather(&send, &tag)));
                while in_flight.len() > 2 {
                    peak = peak.max(alive(&in_flight));
                    let (pb, pc, w) = in_flight.pop_front().expect("three in flight");
                    self.write_chunk(pb, pc, &w.wait()?)?;
                }
            }
        }
        peak = peak.max(alive(&in_flight));
        while let Some((pb, pc, w)) = in_flight.pop_front() {
            self.write_chunk(pb, pc, &w.wait()?)?;
        }
        Ok(peak)
    }

    fn step_all(&mut self) -> Result<()> {
        if self.buckets.generation() != self.generation {
            return Err(zero_error(&self.policy,
                "the DDP buckets were regrouped after the ZeRO optimizer was built; its shards and their optimizer state \
                 are cut from the buckets, so the bucket caps must stay fixed under ZeRO"
                    .into(),
            ));
        }
        if !self.agree_to_step()? {
            return Ok(());
        }
        let peak = match self.stage {
            ZeroStage::Three => {
                // the masters are the shards: nothing to gather here (the units gather them)
                for b in 0..self.shards.len() {
                    self.step_bucket(b)?;
                }
                0
            }
            ZeroStage::Two => self.step_chunked()?,
            _ => self.step_in_place()?,
        };
        self.scratch.store(peak, Ordering::Relaxed);
        Ok(())
    }

    /// Under loss scaling: whether every rank's gradient shards are finite (an all-reduce of
    /// the ranks' verdicts), recorded in the scaler, which skips the step on every rank alike
    /// when one is not. Without a scaler: always.
    fn agree_to_step(&mut self) -> Result<bool> {
        let Some(mut scaler) = self.scaler else {
            return Ok(true);
        };
        let mut found_inf = false;
        for sb in &self.shards {
            if let HeldGrad::Shard { tensor, .. } = self.buckets.held(sb.index)? {
                found_inf |= !tensor.to_dtype(DType::F64)?.sqr()?.sum_all()?.item()?.is_finite();
            }
        }
        let flag = Tensor::from_vec(vec![if found_inf { 1.0f32 } else { 0.0 }], &[1])?.to_device(self.device())?;
        let any = self
            .comm
            .all_reduce(&flag, ReduceOp::Max, "zero.found_inf")
            .wait()?
            .item()?
            > 0.0;
        self.unscale = 1.0 / scaler.scale();
        let step = scaler
            .update(any)
            .map_err(|e| zero_error(&self.policy, e.to_string()))?;
        self.scaler = Some(scaler);
        Ok(step)
    }

    /// The parameters' device, where the collectives move memory (a device stream moves
    /// device memory only).
    fn device(&self) -> brigade_tensor::Device {
        self.buckets
            .params()
            .first()
            .map_or(brigade_tensor::Device::Cpu, |p| p.value().device())
    }

    /// Every rank's byte string, in rank order (two all-gathers: lengths, then padded bytes).
    fn gather_bytes(&self, bytes: Vec<u8>, tag: &str) -> Result<Vec<Vec<u8>>> {
        let device = self.device();
        let len = Tensor::from_vec((bytes.len() as u64).to_le_bytes().to_vec(), &[8])?.to_device(device)?;
        let lens: Vec<usize> = self
            .comm
            .all_gather(&len, &format!("{tag}.len"))
            .wait()?
            .to_vec::<u8>()?
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")) as usize)
            .collect();
        let max = lens.iter().copied().max().unwrap_or(0);
        let mut padded = bytes;
        padded.resize(max, 0);
        let all = self
            .comm
            .all_gather(&Tensor::from_vec(padded, &[max])?.to_device(device)?, tag)
            .wait()?
            .to_vec::<u8>()?;
        Ok(lens
            .iter()
            .enumerate()
            .map(|(r, &l)| all[r * max..r * max + l].to_vec())
            .collect())
    }

    /// Gathers every rank's state of every bucket into whole tensors named like the wrapped
    /// optimizer's (collective; rank 0 keeps them).
    fn consolidate(&mut self) -> Result<()> {
        let rank = self.comm.rank();
        let params = self.buckets.params().to_vec();
        let names = names(&params);
        let mut out: Vec<(String, Tensor)> = vec![];
        for (i, sb) in self.shards.iter().enumerate() {
            let state = sb.opt.state_dict()?;
            // The suffixes some rank holds for this bucket (a rank may own no piece of it).
            let mut mine: Vec<String> = state
                .iter()
                .filter_map(|(k, _)| split_key(k, &names).map(|(_, s)| s.to_string()))
                .collect();
            mine.sort();
            mine.dedup();
            let all = self.gather_bytes(mine.join("\n").into_bytes(), &format!("zero.state{i}.keys"))?;
            let mut suffixes: Vec<String> = all
                .iter()
                .flat_map(|b| {
                    String::from_utf8_lossy(b)
                        .split('\n')
                        .map(str::to_string)
                        .collect::<Vec<_>>()
                })
                .filter(|s| !s.is_empty())
                .collect();
            suffixes.sort();
            suffixes.dedup();
            for suffix in &suffixes {
                let send = Tensor::zeros(&[sb.per], DType::F32);
                for piece in &sb.pieces {
                    let key = format!("{}.{suffix}", names[piece.param]);
                    if let Some((_, t)) = state.iter().find(|(k, _)| *k == key) {
                        let v = t.to_dtype(DType::F32)?.to_device(brigade_tensor::Device::Cpu)?;
                        send.narrow(0, piece.shard_offset, piece.len)?
                            .copy_from(&v.reshape(&[piece.len])?)?;
                    }
                }
                let tag = format!("zero.state{i}.{suffix}");
                let gathered = self
                    .comm
                    .all_gather(&send.to_device(self.device())?, &tag)
                    .wait()?
                    .to_device(brigade_tensor::Device::Cpu)?;
                if rank != 0 {
                    continue;
                }
                let gathered = gathered.reshape(&[gathered.numel()])?;
                let mut offset = 0;
                for &(p, n) in &sb.params {
                    let t = gathered.narrow(0, offset, n)?.reshape(&params[p].shape())?.copy()?;
                    out.push((format!("{}.{suffix}", names[p]), t));
                    offset += n;
                }
            }
            // Entries of no parameter (AdamW's `step`) are the same in every bucket's optimizer.
            if i == 0 && rank == 0 {
                out.extend(state.into_iter().filter(|(k, _)| split_key(k, &names).is_none()));
                if let Some(s) = &self.scaler {
                    out.extend(s.state_dict().map_err(|e| zero_error(&self.policy, e.to_string()))?);
                }
            }
        }
        *self.consolidated.get_mut().unwrap_or_else(|e| e.into_inner()) = (rank == 0).then_some(out);
        if self.mixed {
            let masters = self.gather_masters()?;
            *self.consolidated_masters.get_mut().unwrap_or_else(|e| e.into_inner()) = masters;
        }
        Ok(())
    }

    /// Every rank's f32 master shards gathered into whole tensors named and shaped like the
    /// parameters (collective; rank 0 keeps them, the other ranks get none).
    fn gather_masters(&self) -> Result<Vec<(String, Tensor)>> {
        let Some(masters) = &self.masters else {
            return Ok(vec![]);
        };
        let params = self.buckets.params();
        let names = names(params);
        let mut out = vec![];
        for (sb, master) in self.shards.iter().zip(masters) {
            let tag = format!("zero.masters{}", sb.index);
            // a collective may move its input's storage: send a copy, the shard stays
            let gathered = self
                .comm
                .all_gather(&master.copy()?, &tag)
                .wait()?
                .to_device(brigade_tensor::Device::Cpu)?;
            if self.comm.rank() != 0 {
                continue;
            }
            let gathered = gathered.reshape(&[gathered.numel()])?;
            let mut offset = 0;
            for &(p, n) in &sb.params {
                let t = gathered.narrow(0, offset, n)?.reshape(&params[p].shape())?.copy()?;
                out.push((names[p].clone(), t));
                offset += n;
            }
        }
        // in the parameters' order, as an f32 model's named values
        out.sort_by_key(|(n, _)| names.iter().position(|m| m == n));
        Ok(out)
    }
}

/// The whole-parameter state of `full` that the shards' states are cut from: its state dict,
/// or where it left its state in a file ([`Optimizer::state_in_file`]) the entries of no
/// parameter read whole (AdamW's `step`); the parameters' entries are then read by range
/// ([`stored_pieces`]), never whole.
fn whole_state(full: &dyn Optimizer, names: &[String]) -> Result<Vec<(String, Tensor)>> {
    if full.state_in_file().is_empty() {
        return Ok(full.state_dict()?);
    }
    (full.state_in_file().iter())
        .filter(|e| split_key(&e.name, names).is_none())
        .map(|e| Ok((e.name.clone(), e.read()?)))
        .collect()
}

/// This rank's `pieces` of the parameters' entries left in a file (`stored`), each read from
/// the file alone (shape `[len]`, f32), as [`slice_state`] cuts them from whole entries.
fn stored_pieces(
    policy: &str,
    stored: &[StoredState],
    names: &[String],
    pieces: &[Piece],
) -> Result<Vec<(String, Tensor)>> {
    let mut out = vec![];
    for entry in stored {
        let Some((p, _)) = split_key(&entry.name, names) else {
            continue;
        };
        let Some(piece) = pieces.iter().find(|piece| piece.param == p) else {
            continue;
        };
        let numel: usize = entry.shape.iter().product();
        if numel < piece.param_offset + piece.len {
            return Err(zero_error(
                policy,
                format!(
                    "optimizer state '{}' has {numel} elements, its parameter more",
                    entry.name
                ),
            ));
        }
        let v = (entry.init.draw(piece.param_offset, piece.len))
            .map_err(|e| zero_error(policy, format!("optimizer state '{}': {e}", entry.name)))?
            .to_dtype(DType::F32)?;
        out.push((entry.name.clone(), v));
    }
    Ok(out)
}

/// The entries of the whole-parameter `state` that belong to `pieces`, cut to them (shape
/// `[len]`), and every entry of no parameter as it is.
fn slice_state(
    policy: &str,
    state: &[(String, Tensor)],
    names: &[String],
    pieces: &[Piece],
) -> Result<Vec<(String, Tensor)>> {
    let mut out = vec![];
    for (key, t) in state {
        match split_key(key, names) {
            None => out.push((key.clone(), t.clone())),
            Some((p, _)) => {
                let Some(piece) = pieces.iter().find(|piece| piece.param == p) else {
                    continue;
                };
                let flat = t.contiguous()?.to_dtype(DType::F32)?;
                if flat.numel() < piece.param_offset + piece.len {
                    return Err(zero_error(
                        policy,
                        format!(
                            "optimizer state '{key}' has {} elements, its parameter more",
                            flat.numel()
                        ),
                    ));
                }
                let v = flat
                    .reshape(&[flat.numel()])?
                    .narrow(0, piece.param_offset, piece.len)?
                    .copy()?;
                out.push((key.clone(), v));
            }
        }
    }
    Ok(out)
}

impl Optimizer for ZeroOptimizer {
    fn step(&mut self) -> brigade_autograd::Result<()> {
        self.step_all().map_err(optimizer_error)
    }

    /// The model's parameters, whose shards this rank's optimizers step.
    fn params(&self) -> &[Var] {
        self.buckets.params()
    }

    fn lr(&self) -> f64 {
        self.shards.first().map_or(0.0, |b| b.opt.lr())
    }

    fn set_lr(&mut self, lr: f64) {
        for b in &mut self.shards {
            b.opt.set_lr(lr);
        }
    }

    /// The consolidated state (see the type's docs), handed out once; an error unless
    /// `consolidate_state` ran on every rank since the last call and this is rank 0.
    fn state_dict(&self) -> brigade_autograd::Result<Vec<(String, Tensor)>> {
        self.consolidated.lock().unwrap_or_else(|e| e.into_inner()).take().ok_or_else(|| {
            AutogradError::OptimizerState(
                "a ZeRO optimizer's state is sharded over the ranks: call consolidate_state on every rank, then state on rank 0".into(),
            )
        })
    }

    /// Loads whole-parameter state (as [`Optimizer::state_dict`] gives it), keeping this rank's pieces.
    fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> brigade_autograd::Result<()> {
        let names = names(self.buckets.params());
        let state = match &mut self.scaler {
            Some(s) => s.load_from(state)?,
            None => state.to_vec(),
        };
        for sb in &mut self.shards {
            let sliced = slice_state(&self.policy, &state, &names, &sb.pieces).map_err(optimizer_error)?;
            sb.opt.load_state_dict(&sliced)?;
        }
        Ok(())
    }

    fn state_bytes(&self) -> brigade_autograd::Result<usize> {
        self.shards.iter().map(|b| b.opt.state_bytes()).sum()
    }

    fn consolidate_state(&mut self) -> brigade_autograd::Result<()> {
        self.consolidate().map_err(optimizer_error)
    }

    fn loss_scale(&self) -> Option<f64> {
        self.scaler.map(|s| s.scale())
    }

    fn skipped_steps(&self) -> u64 {
        self.scaler.map_or(0, |s| s.skipped())
    }

    fn grad_scaler(&self) -> Option<GradScaler> {
        self.scaler
    }

    /// Beside 16-bit parameters: the whole f32 masters gathered by the last
    /// [`Optimizer::consolidate_state`] (rank 0; empty before it and on the other ranks).
    fn master_weights(&self) -> Vec<(String, Tensor)> {
        match self.mixed {
            true => self
                .consolidated_masters
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
            false => vec![],
        }
    }

    /// This rank's f32 master shards beside 16-bit parameters (an f32 stage 3's shards are the
    /// parameters, counted there).
    fn master_weight_bytes(&self) -> usize {
        match (&self.masters, self.mixed) {
            (Some(m), true) => m.iter().map(|t| t.numel() * DType::F32.size_in_bytes()).sum(),
            _ => 0,
        }
    }
}
