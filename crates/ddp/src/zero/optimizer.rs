//! [`ZeroOptimizer`]: any optimizer, stepping only this rank's shard of every bucket.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use brigade_autograd::{AutogradError, Optimizer, ParamStore, Var};
use brigade_comm::{all_gather_bytes, reducing_bucket, Buffer, Work};
use brigade_tensor::{DType, Tensor};

use super::shard::{pieces, shard_len, Piece};
use super::{grad_shard, into_f32, ZeroStage};
use crate::reducer::Reducer;
use crate::{DdpError, Result};

/// The most bytes one of the step's parameter all-gathers returns (the parameters of every
/// rank's part of a chunk of its shard), as DeepSpeed's `allgather_bucket_size` bounds it.
pub const ALL_GATHER_CAP_BYTES: usize = 4 << 20;

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

/// Builds the inner optimizer of one bucket's shard over its pieces (each a parameter named
/// like the parameter it is cut from, with shape `[len]`).
pub type BuildOptimizer<'a> = &'a dyn Fn(Vec<Var>) -> Box<dyn Optimizer>;

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
/// stream while bucket `b + 1` is stepped). Built by
/// [`crate::DistributedDataParallel::zero_optimizer`]; every rank must step it together.
///
/// [`Optimizer::state`] is the consolidated state of every shard, under the same names and
/// shapes as the wrapped optimizer's (so a checkpoint holds every shard's state); every rank
/// must call [`Optimizer::consolidate_state`] first, and only rank 0 keeps the result.
pub struct ZeroOptimizer {
    reducer: Arc<Reducer>,
    stage: ZeroStage,
    buckets: Vec<ShardedBucket>,
    /// Peak bytes of all-gather buffers alive at once in the last step (shared with DDP's
    /// memory report).
    scratch: Arc<AtomicUsize>,
    /// Every shard's state, gathered by `consolidate_state` (rank 0 only), until `state`
    /// hands it out (so that it is not kept beside the shards).
    consolidated: Mutex<Option<Vec<(String, Tensor)>>>,
    /// The most bytes one parameter all-gather returns.
    all_gather_cap: usize,
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

impl ZeroOptimizer {
    pub(crate) fn new(
        reducer: Arc<Reducer>,
        stage: ZeroStage,
        scratch: Arc<AtomicUsize>,
        full: &dyn Optimizer,
        build: BuildOptimizer<'_>,
    ) -> Result<ZeroOptimizer> {
        let (rank, world) = (reducer.comm.rank(), reducer.comm.world_size());
        let names: Vec<String> = reducer
            .params
            .iter()
            .map(|p| p.name().unwrap_or("<unnamed>").to_string())
            .collect();
        let state = full.state()?;
        let layout: Vec<Vec<usize>> = reducer.lock().buckets.iter().map(|b| b.params.clone()).collect();
        let mut buckets = vec![];
        for (index, group) in layout.into_iter().enumerate() {
            let params: Vec<(usize, usize)> = group.iter().map(|&p| (p, reducer.params[p].value().numel())).collect();
            let numel = params.iter().map(|&(_, n)| n).sum();
            let pieces = pieces(&params, world, rank);
            let mut store = ParamStore::new();
            for piece in &pieces {
                let value = reducer.params[piece.param]
                    .value()
                    .flat_view(piece.param_offset, &[piece.len])?;
                store.add(names[piece.param].clone(), value)?;
            }
            let vars = store.params().to_vec();
            let mut opt = build(vars.clone());
            opt.set_lr(full.lr());
            opt.load_state(&slice_state(&state, &names, &pieces)?)?;
            buckets.push(ShardedBucket {
                index,
                params,
                per: shard_len(numel, world),
                pieces,
                vars,
                opt,
            });
        }
        Ok(ZeroOptimizer {
            reducer,
            stage,
            buckets,
            scratch,
            consolidated: Mutex::new(None),
            all_gather_cap: ALL_GATHER_CAP_BYTES,
        })
    }

    /// Caps the bytes one of the step's parameter all-gathers returns (default
    /// [`ALL_GATHER_CAP_BYTES`]; DeepSpeed's `allgather_bucket_size`): smaller caps mean less
    /// communication scratch and more, smaller collectives. Every rank must use the same cap.
    pub fn with_all_gather_cap(mut self, bytes: usize) -> Self {
        self.all_gather_cap = bytes;
        self
    }

    /// Steps bucket `b`'s shard in place (the pieces are views of the parameters).
    fn step_bucket(&mut self, b: usize) -> Result<()> {
        let (rank, world) = (self.reducer.comm.rank(), self.reducer.comm.world_size());
        let sb = &mut self.buckets[b];
        let grads = grad_shard(&self.reducer.lock().buckets[sb.index], self.stage, world, rank)?;
        for (piece, var) in sb.pieces.iter().zip(&sb.vars) {
            let param = self.reducer.params[piece.param].value();
            var.set_value(param.flat_view(piece.param_offset, &[piece.len])?)?;
            var.set_grad(Some(grads.flat_view(piece.shard_offset, &[piece.len])?))?;
        }
        sb.opt.step()?;
        for var in &sb.vars {
            // the shard's gradient is not this optimizer's to keep (stage 2 frees it)
            var.set_grad(None)?;
        }
        Ok(())
    }

    /// Issues the all-gather of `chunk` (elements of every rank's shard) of bucket `b`: this
    /// rank sends its shard's updated parameters there (zeros for padding).
    fn gather_chunk(&self, b: usize, chunk: Range<usize>) -> Result<Work<Buffer>> {
        let sb = &self.buckets[b];
        let lo = self.reducer.comm.rank() * sb.per + chunk.start;
        let mut send = vec![0.0f32; chunk.len()];
        for (p, at, len, out) in overlaps(&sb.params, lo..lo + chunk.len()) {
            let v = self.reducer.params[p].value().flat_view(at, &[len])?.to_vec::<f32>()?;
            send[out..out + len].copy_from_slice(&v);
        }
        let comm = &self.reducer.comm;
        let tag = format!("zero.params{}.{}", sb.index, chunk.start);
        Ok(reducing_bucket(sb.index, || comm.all_gather(Buffer::F32(send), &tag)))
    }

    /// Writes a gathered `chunk` of bucket `b` (every rank's part, rank-major) into the
    /// parameters; returns the bytes the gathered buffer held.
    fn write_chunk(&self, b: usize, chunk: Range<usize>, work: Work<Buffer>) -> Result<usize> {
        let gathered = into_f32(work.wait()?)?;
        let sb = &self.buckets[b];
        for r in 0..self.reducer.comm.world_size() {
            let lo = r * sb.per + chunk.start;
            for (p, at, len, out) in overlaps(&sb.params, lo..lo + chunk.len()) {
                let param = self.reducer.params[p].value().flat_view(at, &[len])?;
                let from = r * chunk.len() + out;
                let values = Tensor::from_slice(&gathered[from..from + len], &[len])?;
                param.copy_from(&values.to_device(param.device())?)?;
            }
        }
        Ok(gathered.capacity() * DType::F32.size_in_bytes())
    }

    /// The shards are cut from the buckets as they were when this optimizer was built; buckets
    /// regrouped since (new caps, a rebuild) would pair this rank's state with other elements.
    fn check_layout(&self) -> Result<()> {
        let st = self.reducer.lock();
        let same = st.buckets.len() == self.buckets.len()
            && st
                .buckets
                .iter()
                .zip(&self.buckets)
                .all(|(b, sb)| b.params.iter().copied().eq(sb.params.iter().map(|&(p, _)| p)));
        if same {
            return Ok(());
        }
        Err(DdpError::Zero(
            "the DDP buckets were regrouped after the ZeRO optimizer was built; its shards and their optimizer state are cut from the buckets, so the bucket caps must stay fixed under ZeRO".into(),
        ))
    }

    fn step_all(&mut self) -> Result<()> {
        self.check_layout()?;
        let world = self.reducer.comm.world_size();
        let f32_bytes = DType::F32.size_in_bytes();
        // Each all-gather returns at most `all_gather_cap` bytes (DeepSpeed's
        // `allgather_bucket_size`), and at most two are in flight while the next chunk is
        // issued or the next bucket steps: the communication scratch stays a few caps, not a
        // copy of the parameters.
        let chunk_len = (self.all_gather_cap / f32_bytes / world.max(1)).max(1);
        let mut in_flight: VecDeque<(usize, Range<usize>, Work<Buffer>)> = VecDeque::new();
        let mut peak = 0;
        for b in 0..self.buckets.len() {
            self.step_bucket(b)?;
            let per = self.buckets[b].per;
            for start in (0..per).step_by(chunk_len) {
                let chunk = start..(start + chunk_len).min(per);
                in_flight.push_back((b, chunk.clone(), self.gather_chunk(b, chunk)?));
                while in_flight.len() > 2 {
                    let (pb, pc, w) = in_flight.pop_front().expect("three in flight");
                    let others: usize = in_flight.iter().map(|(_, c, _)| c.len() * world * f32_bytes).sum();
                    peak = peak.max(self.write_chunk(pb, pc, w)? + others);
                }
            }
        }
        while let Some((pb, pc, w)) = in_flight.pop_front() {
            let others: usize = in_flight.iter().map(|(_, c, _)| c.len() * world * f32_bytes).sum();
            peak = peak.max(self.write_chunk(pb, pc, w)? + others);
        }
        self.scratch.store(peak, Ordering::Relaxed);
        Ok(())
    }

    /// Gathers every rank's state of every bucket into whole tensors named like the wrapped
    /// optimizer's (collective; rank 0 keeps them).
    fn consolidate(&mut self) -> Result<()> {
        let comm = self.reducer.comm.clone();
        let rank = comm.rank();
        let names: Vec<String> = self
            .reducer
            .params
            .iter()
            .map(|p| p.name().unwrap_or("<unnamed>").to_string())
            .collect();
        let mut out: Vec<(String, Tensor)> = vec![];
        for (i, sb) in self.buckets.iter().enumerate() {
            let state = sb.opt.state()?;
            // The suffixes some rank holds for this bucket (a rank may own no piece of it).
            let mut mine: Vec<String> = state
                .iter()
                .filter_map(|(k, _)| split_key(k, &names).map(|(_, s)| s.to_string()))
                .collect();
            mine.sort();
            mine.dedup();
            let all = all_gather_bytes(
                comm.as_ref(),
                mine.join("\n").into_bytes(),
                &format!("zero.state{i}.keys"),
            )?;
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
                let mut send = vec![0.0f32; sb.per];
                for piece in &sb.pieces {
                    let key = format!("{}.{suffix}", names[piece.param]);
                    if let Some((_, t)) = state.iter().find(|(k, _)| *k == key) {
                        let v = t.to_dtype(DType::F32)?.to_vec::<f32>()?;
                        send[piece.shard_offset..piece.shard_offset + piece.len].copy_from_slice(&v);
                    }
                }
                let tag = format!("zero.state{i}.{suffix}");
                let gathered = into_f32(comm.all_gather(Buffer::F32(send), &tag).wait()?)?;
                if rank != 0 {
                    continue;
                }
                let mut offset = 0;
                for &(p, n) in &sb.params {
                    let shape = self.reducer.params[p].shape();
                    let t = Tensor::from_slice(&gathered[offset..offset + n], &shape)?;
                    out.push((format!("{}.{suffix}", names[p]), t));
                    offset += n;
                }
            }
            // Entries of no parameter (AdamW's `step`) are the same in every bucket's optimizer.
            if i == 0 && rank == 0 {
                out.extend(state.into_iter().filter(|(k, _)| split_key(k, &names).is_none()));
            }
        }
        *self.consolidated.get_mut().unwrap_or_else(|e| e.into_inner()) = (rank == 0).then_some(out);
        Ok(())
    }
}

/// The entries of the whole-parameter `state` that belong to `pieces`, cut to them (shape
/// `[len]`), and every entry of no parameter as it is.
fn slice_state(state: &[(String, Tensor)], names: &[String], pieces: &[Piece]) -> Result<Vec<(String, Tensor)>> {
    let mut out = vec![];
    for (key, t) in state {
        match split_key(key, names) {
            None => out.push((key.clone(), t.clone())),
            Some((p, _)) => {
                let Some(piece) = pieces.iter().find(|piece| piece.param == p) else {
                    continue;
                };
                let flat = t.contiguous()?.to_dtype(DType::F32)?;
                let all = flat.to_vec::<f32>()?;
                if all.len() < piece.param_offset + piece.len {
                    return Err(DdpError::Zero(format!(
                        "optimizer state '{key}' has {} elements, its parameter more",
                        all.len()
                    )));
                }
                let v = all[piece.param_range()].to_vec();
                out.push((key.clone(), Tensor::from_vec(v, &[piece.len])?.to_device(t.device())?));
            }
        }
    }
    Ok(out)
}

impl Optimizer for ZeroOptimizer {
    fn step(&mut self) -> brigade_autograd::Result<()> {
        self.step_all().map_err(optimizer_error)
    }

    fn lr(&self) -> f64 {
        self.buckets.first().map_or(0.0, |b| b.opt.lr())
    }

    fn set_lr(&mut self, lr: f64) {
        for b in &mut self.buckets {
            b.opt.set_lr(lr);
        }
    }

    /// The consolidated state (see the type's docs), handed out once; an error unless
    /// `consolidate_state` ran on every rank since the last call and this is rank 0.
    fn state(&self) -> brigade_autograd::Result<Vec<(String, Tensor)>> {
        self.consolidated.lock().unwrap_or_else(|e| e.into_inner()).take().ok_or_else(|| {
            AutogradError::OptimizerState(
                "a ZeRO optimizer's state is sharded over the ranks: call consolidate_state on every rank, then state on rank 0".into(),
            )
        })
    }

    /// Loads whole-parameter state (as [`Optimizer::state`] gives it), keeping this rank's pieces.
    fn load_state(&mut self, state: &[(String, Tensor)]) -> brigade_autograd::Result<()> {
        let names: Vec<String> = self
            .reducer
            .params
            .iter()
            .map(|p| p.name().unwrap_or("<unnamed>").to_string())
            .collect();
        for sb in &mut self.buckets {
            let sliced = slice_state(state, &names, &sb.pieces).map_err(optimizer_error)?;
            sb.opt.load_state(&sliced)?;
        }
        Ok(())
    }

    fn state_bytes(&self) -> brigade_autograd::Result<usize> {
        self.buckets.iter().map(|b| b.opt.state_bytes()).sum()
    }

    fn consolidate_state(&mut self) -> brigade_autograd::Result<()> {
        self.consolidate().map_err(optimizer_error)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use brigade_autograd::{Optimizer, ParamStore, Sgd};
    use brigade_tensor::{DType, Tensor};

    use crate::zero::ZeroStage;
    use crate::{DdpConfig, DistributedDataParallel};

    #[test]
    fn stepping_after_the_buckets_were_regrouped_is_an_error() {
        let out = brigade_comm::run_on_threads(2, |comm| {
            let mut store = ParamStore::new();
            for i in 0..3 {
                store.add(format!("p{i}"), Tensor::zeros(&[300], DType::F32)).unwrap();
            }
            // 1200-byte parameters against a 1000-byte cap: one bucket each
            let cfg = DdpConfig {
                bucket_cap_mb: 0.001,
                first_bucket_cap_mb: 0.001,
                zero: ZeroStage::One,
                ..DdpConfig::default()
            };
            let ddp = DistributedDataParallel::new(&store, Arc::new(comm), cfg).unwrap();
            let full = Sgd::new(store.params().to_vec(), 0.1, 0.0, 0.0);
            let build = |p| Box::new(Sgd::new(p, 0.1, 0.0, 0.0)) as Box<dyn Optimizer>;
            let mut opt = ddp.zero_optimizer(&full, &build).unwrap();
            opt.step().unwrap();
            opt.reducer.lock().buckets.reverse();
            opt.step().unwrap_err().to_string()
        });
        for err in out {
            let err = err.unwrap();
            assert!(err.contains("regrouped"), "{err}");
        }
    }
}
