//! Construction-time agreement: every rank holds the same model, and starts from rank
//! 0's parameter values.

use brigade_autograd::{ParamInit, Var};
use brigade_comm::{all_gather_bytes, Communicator};
use brigade_tensor::DType;

use crate::{DdpError, Result};

/// `'name' [shape] dtype` for each parameter, in registration order, with `frozen` for
/// those that do not require grad (the ranks must agree: frozen ones have no bucket).
fn entries(params: &[Var]) -> Vec<String> {
    params
        .iter()
        .map(|p| {
            let v = p.value();
            let frozen = if p.requires_grad() { "" } else { " frozen" };
            let init = if p.deferred_init().is_some() {
                " not drawn yet"
            } else {
                ""
            };
            format!(
                "'{}' {:?} {:?}{frozen}{init}",
                p.name().unwrap_or("<unnamed>"),
                v.shape(),
                v.dtype()
            )
        })
        .collect()
}

/// Exchanges every rank's parameter list and fails, on every rank alike, naming the
/// first parameter where some rank differs from rank 0.
pub(crate) fn check_same_model(params: &[Var], comm: &dyn Communicator) -> Result<()> {
    let mine = entries(params).join("\n").into_bytes();
    let lists: Vec<Vec<String>> = all_gather_bytes(comm, mine, "ddp.signature")?
        .iter()
        .map(|b| String::from_utf8_lossy(b).lines().map(str::to_string).collect())
        .collect();
    let reference = &lists[0];
    for (rank, list) in lists.iter().enumerate().skip(1) {
        let n = reference.len().max(list.len());
        for i in 0..n {
            let (a, b) = (reference.get(i), list.get(i));
            if a != b {
                let none = || "no parameter".to_string();
                return Err(DdpError::ModelMismatch {
                    index: i,
                    rank_a: 0,
                    entry_a: a.cloned().unwrap_or_else(none),
                    rank_b: rank,
                    entry_b: b.cloned().unwrap_or_else(none),
                });
            }
        }
    }
    Ok(())
}

/// Fails naming the first parameter whose dtype buckets cannot hold: every parameter is f32,
/// or every one is of one 16-bit float dtype (bf16 or f16: a mixed-precision run's compute
/// copy), the dtype of buckets and broadcasts.
pub(crate) fn check_f32(params: &[Var]) -> Result<()> {
    let first = params.first().map_or(DType::F32, |p| p.value().dtype());
    let want = if matches!(first, DType::BF16 | DType::F16) {
        first
    } else {
        DType::F32
    };
    match params.iter().find(|p| p.value().dtype() != want) {
        Some(p) => Err(DdpError::UnsupportedDType {
            param: p.name().unwrap_or("<unnamed>").to_string(),
            dtype: p.value().dtype(),
        }),
        None => Ok(()),
    }
}

/// Checks that every rank holds the same parameters (`check_same_model`, `check_f32`) and
/// overwrites every rank's values with rank 0's, as [`crate::DistributedDataParallel::new`]
/// does: a collective. Mixed precision calls it on the f32 parameters before their f32 master
/// copies are made (DDP's own broadcast then moves the 16-bit compute copy), so that every
/// rank's masters are rank 0's whatever each rank initialised.
pub fn broadcast_from_rank0(params: &[Var], comm: &dyn Communicator) -> Result<()> {
    check_same_model(params, comm)?;
    check_f32(params)?;
    broadcast_parameters(params, comm)
}

/// The fewest bytes one broadcast of DDP's construction may pack ([`broadcast_from_rank0`],
/// [`crate::DistributedDataParallel::new`]): rank 0's parameters go in registration order,
/// packed into flat buffers of up to this size or the largest parameter's, whichever is larger
/// (a parameter larger than the pack goes alone), so that a model of many small parameters pays
/// a link's per-message latency a few times, not once per parameter (PyTorch's
/// `_sync_module_states` packs up to 250 MB), while the host copy made beside the model stays
/// within what broadcasting the largest parameter alone would take, or 1 MiB.
pub const PARAMETER_BROADCAST_MIN_PACK_BYTES: usize = 1 << 20;

/// Overwrites every rank's parameters with rank 0's (in flat broadcasts packed as
/// [`PARAMETER_BROADCAST_MIN_PACK_BYTES`] says, in their one dtype, checked by [`check_f32`]), but for
/// those not drawn yet: they take rank 0's recipes ([`adopt_rank0_recipes`]).
pub(crate) fn broadcast_parameters(params: &[Var], comm: &dyn Communicator) -> Result<()> {
    match params.first().map(|p| p.value().dtype()) {
        Some(DType::BF16) => broadcast_as::<half::bf16>(params, comm),
        Some(DType::F16) => broadcast_as::<half::f16>(params, comm),
        _ => broadcast_as::<f32>(params, comm),
    }
}

/// Consecutive runs of `numels` whose elements together fit `cap` (a run of one where a
/// single one does not), in order.
fn packs(numels: &[usize], cap: usize) -> Vec<std::ops::Range<usize>> {
    let mut out: Vec<std::ops::Range<usize>> = Vec::new();
    let mut filled = 0;
    for (i, &n) in numels.iter().enumerate() {
        match out.last_mut() {
            Some(last) if filled + n <= cap => {
                last.end = i + 1;
                filled += n;
            }
            _ => {
                out.push(i..i + 1);
                filled = n;
            }
        }
    }
    out
}

fn broadcast_as<T: brigade_tensor::Element>(params: &[Var], comm: &dyn Communicator) -> Result<()> {
    // parameters not drawn yet get rank 0's recipes instead ([`adopt_rank0_recipes`])
    let drawn: Vec<&Var> = params.iter().filter(|p| p.deferred_init().is_none()).collect();
    let numels: Vec<usize> = drawn.iter().map(|p| p.value().numel()).collect();
    let floor = (PARAMETER_BROADCAST_MIN_PACK_BYTES / std::mem::size_of::<T>()).max(1);
    let cap = numels.iter().copied().max().unwrap_or(0).max(floor);
    for (i, pack) in packs(&numels, cap).into_iter().enumerate() {
        let pack = &drawn[pack];
        let mut flat = Vec::with_capacity(pack.iter().map(|p| p.value().numel()).sum());
        for p in pack {
            flat.extend(p.value().to_vec::<T>()?);
        }
        let tag = format!("ddp.broadcast_parameters.{i}");
        let back = comm.broadcast(T::wrap(flat), 0, &tag).wait()?;
        let found = back.dtype().to_string();
        let flat = T::unwrap(back).ok_or(DdpError::BufferDType {
            what: "ddp.broadcast_parameters".into(),
            expected: T::DTYPE,
            found,
        })?;
        let mut offset = 0;
        for p in pack {
            let v = p.value();
            let n = v.numel();
            let values = brigade_tensor::Tensor::from_slice(&flat[offset..offset + n], v.shape())?;
            v.copy_from(&values.to_device(v.device())?)?;
            offset += n;
        }
    }
    Ok(())
}

/// Gives every rank's parameters that are not drawn yet rank 0's recipes of their initial
/// values (one line each, gathered once), so that each rank's shard of them is drawn from
/// rank 0's values, as the broadcast of drawn ones does. [`check_same_model`] first: the ranks
/// agree on which parameters are not drawn yet (and so all skip the gather when none is).
pub(crate) fn adopt_rank0_recipes(params: &[Var], comm: &dyn Communicator) -> Result<()> {
    let deferred: Vec<&Var> = params.iter().filter(|p| p.deferred_init().is_some()).collect();
    // every rank alike: the model check compared which parameters are not drawn yet
    if deferred.is_empty() {
        return Ok(());
    }
    let mine: Vec<String> = deferred
        .iter()
        .filter_map(|p| Some(p.deferred_init()?.describe()))
        .collect();
    let all = all_gather_bytes(comm, mine.join("\n").into_bytes(), "ddp.recipes")?;
    let rank0 = String::from_utf8_lossy(&all[0]).into_owned();
    for (p, line) in deferred.iter().zip(rank0.lines()) {
        p.set_deferred_init(ParamInit::parse(line)?)?;
    }
    Ok(())
}
