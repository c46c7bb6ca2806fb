//! What every backend says about a collective: its kind, how it reads in an error
//! message, and whether it can run at all. Shared so that the thread and MPI backends
//! reach the same verdicts with the same words.

use crate::{CommError, DType, ReduceOp};

/// Which collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OpKind {
    AllReduce(ReduceOp),
    Broadcast { root: usize },
    AllGather,
    ReduceScatter(ReduceOp),
    Barrier,
}

/// `all_reduce(sum, 1024 x f32, tag `bucket0`)`.
pub(crate) fn describe(kind: OpKind, dtype: Option<DType>, len: u64, tag: &str) -> String {
    let mut args = Vec::new();
    let name = match kind {
        OpKind::AllReduce(op) => {
            args.push(op.to_string());
            "all_reduce"
        }
        OpKind::Broadcast { root } => {
            args.push(format!("root {root}"));
            "broadcast"
        }
        OpKind::AllGather => "all_gather",
        OpKind::ReduceScatter(op) => {
            args.push(op.to_string());
            "reduce_scatter"
        }
        OpKind::Barrier => "barrier",
    };
    if let Some(dtype) = dtype {
        args.push(format!("{len} x {dtype}"));
    }
    args.push(format!("tag `{tag}`"));
    format!("{name}({})", args.join(", "))
}

/// [`check_runnable`] for the host transports (threads, MPI), whose kernels reduce f32, f16 and
/// bf16 (with f32 accumulation) but not f64.
pub(crate) fn check_runnable_on_host(
    kind: OpKind,
    dtype: Option<DType>,
    len: u64,
    world: usize,
    tag: &str,
) -> Result<(), CommError> {
    if matches!(kind, OpKind::AllReduce(_) | OpKind::ReduceScatter(_)) && dtype == Some(DType::F64) {
        return Err(CommError::Unsupported(format!(
            "reduction on f64 buffers: {}; the host collectives reduce f32, f16 and bf16",
            describe(kind, dtype, len, tag)
        )));
    }
    check_runnable(kind, dtype, len, world, tag)
}

/// Checks that a collective all ranks agreed on can run in a group of `world` ranks.
#[allow(clippy::manual_is_multiple_of)] // `is_multiple_of` is newer than the workspace MSRV
pub(crate) fn check_runnable(
    kind: OpKind,
    dtype: Option<DType>,
    len: u64,
    world: usize,
    tag: &str,
) -> Result<(), CommError> {
    let described = || describe(kind, dtype, len, tag);
    match kind {
        OpKind::AllReduce(_) | OpKind::ReduceScatter(_)
            if matches!(dtype, Some(DType::U8 | DType::I8 | DType::I64)) =>
        {
            Err(CommError::Unsupported(format!(
                "reduction on {} buffers: {}; integer payloads are not summed in their own type: all-gather \
                 the payloads with their scales (all_gather_with_side) and sum in f32",
                dtype.map_or("", DType::name),
                described()
            )))
        }
        OpKind::ReduceScatter(_) if len % world as u64 != 0 => Err(CommError::InvalidArgument(format!(
            "{}: input length {len} is not a multiple of the world size {world}",
            described()
        ))),
        OpKind::Broadcast { root } if root >= world => Err(CommError::InvalidArgument(format!(
            "{}: root {root} is not a rank of a group of {world}",
            described()
        ))),
        _ => Ok(()),
    }
}
