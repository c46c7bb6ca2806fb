//! Which ranks share a node, found once when a communicator is made: MPI's own grouping by
//! host (`MPI_Comm_split_type` with `MPI_COMM_TYPE_SHARED`), or consecutive ranks in groups of
//! a declared size (`BRIGADE_NODE_SIZE`, to test the hierarchy on one host). Then the node's
//! shared segment (an `MPI_Win_allocate_shared` window) and, across nodes, the communicator of
//! the ranks with the same local rank.

use std::time::Duration;

use super::raw::{self, RawComm, SharedWindow};
use crate::collective::all_agree;
use crate::heap;
use crate::shm::{ShmNode, REGION_BYTES};
use crate::CommError;

/// The environment variable that declares the node size.
pub(crate) const NODE_SIZE_VAR: &str = "BRIGADE_NODE_SIZE";

/// How this process's collectives reach its peers.
pub(crate) struct NodePath {
    /// The node's segment.
    pub(crate) shm: ShmNode,
    /// The window that maps it (freed with the transport when it is healthy).
    pub(crate) window: Option<SharedWindow>,
    /// The node's communicator.
    pub(crate) node_comm: Option<RawComm>,
    /// The ranks with this local rank on every node, when there is more than one node.
    pub(crate) cross: Option<RawComm>,
    /// Scratch: this rank's f32 shard of a hierarchical all-reduce.
    pub(crate) shard: Vec<f32>,
}

impl NodePath {
    /// Whether the whole job is this one node.
    pub(crate) fn single_node(&self) -> bool {
        self.cross.is_none()
    }

    /// Frees the MPI objects (collective over the node and across nodes).
    pub(crate) fn free(mut self) {
        if let Some(window) = self.window.take() {
            window.free();
        }
        if let Some(comm) = self.cross.take() {
            comm.free();
        }
        if let Some(comm) = self.node_comm.take() {
            comm.free();
        }
    }
}

/// What [`discover`] found, for the bench and the logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Topology {
    /// Ranks on this process's node.
    pub(crate) node_size: usize,
    /// Nodes of the job (when they all have `node_size` ranks; otherwise `None`).
    pub(crate) nodes: Option<usize>,
}

/// Checks that every rank was given the same node size and shared-memory setting: every rank
/// must take the same path through `discover`. Collective over `world`.
fn agree_on_settings(
    world: &RawComm,
    rank: usize,
    declared: Option<usize>,
    shared_memory: bool,
) -> Result<(), CommError> {
    let mut words = setting_words(declared.map_or(0, |k| k as u64), u64::from(shared_memory));
    world.all_reduce_u64(rank, &mut words, raw::band_op(), "MPI_Allreduce(settings)")?;
    if !all_agree(&words) {
        return Err(CommError::InvalidArgument(format!(
            "{NODE_SIZE_VAR} and BRIGADE_MPI_SHM must be the same on every rank (rank {rank} has {} and {}); \
             pass them to every process (mpirun -x {NODE_SIZE_VAR})",
            declared.map_or("unset".to_string(), |k| k.to_string()),
            if shared_memory { "on" } else { "off" },
        )));
    }
    Ok(())
}

/// The node of `rank` when the user declared nodes of `k` ranks: checked to divide the job
/// and to share memory. Collective over `world`.
#[allow(clippy::manual_is_multiple_of)] // `is_multiple_of` is newer than the workspace MSRV
fn declared_node(world: &RawComm, rank: usize, size: usize, k: usize) -> Result<RawComm, CommError> {
    if k == 0 || size % k != 0 {
        return Err(CommError::InvalidArgument(format!(
            "{NODE_SIZE_VAR}={k} does not divide the {size} ranks of the job into nodes of equal size"
        )));
    }
    let node = world.split(rank, rank / k, rank)?;
    // The declared node must really share memory.
    let shared = node.split_shared(rank)?;
    let (_, shared_size) = shared.rank_and_size();
    shared.free();
    let mut ok = [u64::from(shared_size == k)];
    world.all_reduce_u64(rank, &mut ok, raw::band_op(), "MPI_Allreduce(node check)")?;
    if ok[0] == 0 {
        node.free();
        return Err(CommError::InvalidArgument(format!(
            "{NODE_SIZE_VAR}={k} groups ranks that do not share memory (ranks {}..{} are not all on one \
             host); unset it to group ranks by host",
            rank / k * k,
            rank / k * k + k - 1
        )));
    }
    Ok(node)
}

/// Finds the nodes and, if `shared_memory` and some node holds more than one rank, maps the
/// node's segment. Collective over `world`; every rank returns the same verdict (errors name
/// the offending setting).
pub(crate) fn discover(
    world: &RawComm,
    rank: usize,
    size: usize,
    declared: Option<usize>,
    shared_memory: bool,
    timeout: Duration,
) -> Result<(Topology, Option<NodePath>), CommError> {
    agree_on_settings(world, rank, declared, shared_memory)?;
    let node_comm = match declared {
        Some(k) => declared_node(world, rank, size, k)?,
        None => world.split_shared(rank)?,
    };
    let (local, node_size) = node_comm.rank_and_size();
    let mut same = setting_words(node_size as u64, 0);
    world.all_reduce_u64(rank, &mut same, raw::band_op(), "MPI_Allreduce(node sizes)")?;
    let uniform = all_agree(&same);
    let topology = Topology {
        node_size,
        nodes: uniform.then(|| size / node_size),
    };
    // The segment only pays with a second rank on the node, and the hierarchy needs nodes of
    // one size (each local rank owns the same share of every buffer on every node).
    if !shared_memory || !uniform || node_size < 2 {
        node_comm.free();
        return Ok((topology, None));
    }
    let window = SharedWindow::allocate(&node_comm, rank, REGION_BYTES);
    let mut ok = [u64::from(window.is_ok())];
    world.all_reduce_u64(rank, &mut ok, raw::band_op(), "MPI_Allreduce(window check)")?;
    let window = match (ok[0], window) {
        (1, Ok(window)) => window,
        (_, window) => {
            match window {
                Ok(window) => window.free(),
                Err(e) => eprintln!("brigade-comm: rank {rank}: no shared-memory segment: {e}"),
            }
            if rank == 0 {
                eprintln!("brigade-comm: shared memory is unavailable on some node; collectives go through MPI only");
            }
            node_comm.free();
            return Ok((topology, None));
        }
    };
    // SAFETY: no peer uses the segment before the barrier below.
    unsafe { ShmNode::reset_own_control(window.parts[local]) };
    let world_ranks = gather_world_ranks(&node_comm, rank, node_size)?;
    let cross = match topology.nodes {
        Some(nodes) if nodes > 1 => Some(world.split(rank, local, rank)?),
        _ => None,
    };
    // Every control block is zeroed before anyone reads one.
    let mut barrier = [0u64];
    node_comm.all_reduce_u64(rank, &mut barrier, raw::band_op(), "MPI_Allreduce(segment ready)")?;
    let heaps = map_heaps(&node_comm, rank, node_size)?;
    if heaps.is_some() {
        heap::set_color(local, node_size);
    }
    // SAFETY: the window maps every local rank's region of REGION_BYTES until it is freed,
    // which happens only after the `ShmNode` is dropped (`NodePath::free` takes it last).
    let shm = unsafe { ShmNode::new(window.parts.clone(), local, world_ranks, timeout) };
    // SAFETY: heaps stay mapped until the process ends; every local rank got the same verdict.
    let shm = match heaps {
        Some(heaps) => unsafe { shm.with_heaps(heaps) },
        None => shm,
    };
    Ok((
        topology,
        Some(NodePath {
            shm,
            window: Some(window),
            node_comm: Some(node_comm),
            cross,
            shard: Vec::new(),
        }),
    ))
}

/// Every local rank's shared heap (`crate::heap`), mapped in this process, in local rank
/// order: `Some` on every local rank when every one has a heap and mapped all the others',
/// `None` on every one otherwise (printing why on the rank that failed). Collective over the
/// node.
fn map_heaps(node: &RawComm, rank: usize, node_size: usize) -> Result<Option<Vec<(*mut u8, usize)>>, CommError> {
    let (local, _) = node.rank_and_size();
    // Four words per local rank, this rank's in its place: pid + 1 (0: no heap), fd, bytes,
    // nonce.
    const W: usize = 4;
    let mut words = vec![0u64; W * node_size];
    if let Some(e) = heap::heap_or_make().map(|h| h.exposure()) {
        words[W * local..W * (local + 1)].copy_from_slice(&[
            u64::from(e.pid) + 1,
            e.fd as u64,
            e.bytes as u64,
            e.nonce,
        ]);
    }
    node.all_reduce_u64(rank, &mut words, raw::sum_op(), "MPI_Allreduce(heaps)")?;
    let mut mapped = Vec::with_capacity(node_size);
    for w in words.chunks(W) {
        if w[0] == 0 {
            break;
        }
        let peer = heap::Exposure {
            pid: (w[0] - 1) as u32,
            fd: w[1] as i32,
            bytes: w[2] as usize,
            nonce: w[3],
        };
        match heap::map_peer(peer) {
            Ok(base) => mapped.push((base, peer.bytes)),
            Err(e) => {
                eprintln!("brigade-comm: rank {rank}: cannot map a peer's shared heap ({e}); collectives copy");
                break;
            }
        }
    }
    let mut all = [u64::from(mapped.len() == node_size)];
    node.all_reduce_u64(rank, &mut all, raw::band_op(), "MPI_Allreduce(heaps mapped)")?;
    Ok((all[0] == 1).then_some(mapped))
}

/// `[a, b, !a, !b]`: all equal on every rank iff their `MPI_BAND` passes [`all_agree`]'s test
/// (padded to its width).
fn setting_words(a: u64, b: u64) -> [u64; 2 * crate::collective::AGREE_WORDS] {
    let mut w = [0u64; 2 * crate::collective::AGREE_WORDS];
    let n = crate::collective::AGREE_WORDS;
    w[0] = a;
    w[1] = b;
    for i in 0..n {
        w[n + i] = !w[i];
    }
    w
}

/// The world rank of every local rank (the node communicator orders them by world rank, but
/// with a split by host they need not be consecutive).
fn gather_world_ranks(node: &RawComm, rank: usize, node_size: usize) -> Result<Vec<usize>, CommError> {
    let (local, _) = node.rank_and_size();
    // One word per local rank, this rank's in its place: a sum all-reduce gathers them.
    let mut words = vec![0u64; node_size];
    words[local] = rank as u64;
    node.all_reduce_u64(rank, &mut words, raw::sum_op(), "MPI_Allreduce(node ranks)")?;
    Ok(words.into_iter().map(|r| r as usize).collect())
}
