//! A rank's communicator stack: the backend's comm stream, on the simulated link and traced
//! when configured, handed to DDP's host group and to the control collectives alike.

use std::sync::Arc;
use std::time::Duration;

use brigade_comm::{CommStream, Communicator, NetModel, Recorder, SharedLink, Transport};
use brigade_ddp::group::{Group, HostGroup};

/// The simulated network under a rank's collectives.
pub enum SimLink<'a> {
    /// One link every rank of the group shares (ranks as threads): a collective starts and
    /// finishes at the same instant on every rank, as on one real ring.
    Shared(&'a SharedLink),
    /// A link of this rank's own (ranks in other processes cannot share a clock).
    Own(NetModel),
}

/// The one place a rank's training stream is built: `stream` (a thread or MPI comm stream) on
/// the simulated link and traced when configured; returned as the communicator of the
/// training's control collectives (loss agreement, parameter broadcast, DDP's model check)
/// and, the same stream, as the host group DDP reduces its buckets on.
pub fn comm_stack<T: Transport>(
    stream: CommStream<T>,
    net: Option<SimLink<'_>>,
    recorder: Option<&Recorder>,
) -> (Arc<dyn Communicator>, Group) {
    let stream = match net {
        Some(SimLink::Shared(link)) => stream.on_link(link),
        Some(SimLink::Own(model)) => stream.simulated(model),
        None => stream,
    };
    let stream = Arc::new(match recorder {
        Some(r) => stream.traced(r.clone()),
        None => stream,
    });
    let group: Group = Arc::new(HostGroup::new(stream.clone()));
    (stream, group)
}

/// A link of `gbps` gigabits per second and `latency_us` microseconds per message.
pub fn net_model(gbps: f64, latency_us: f64) -> NetModel {
    NetModel {
        latency: Duration::from_secs_f64(latency_us * 1e-6),
        bandwidth_bytes_per_s: gbps * 1e9 / 8.0,
    }
}
