//! A rank's communicator stack: the backend's communicator, then the simulated network, then
//! tracing outermost (so the trace shows what the caller saw).

use std::sync::Arc;
use std::time::Duration;

use brigade_comm::{Communicator, NetModel, Recorder, SharedLink, SimulatedNetwork, Traced};

/// The simulated network under a rank's collectives.
pub enum SimLink<'a> {
    /// One link every rank of the group shares (ranks as threads): a collective starts and
    /// finishes at the same instant on every rank, as on one real ring.
    Shared(&'a SharedLink),
    /// A link of this rank's own (ranks in other processes cannot share a clock).
    Own(NetModel),
}

/// The one place the communicator stack is built: `base` (a thread or MPI communicator), then
/// the simulated network, then tracing outermost.
pub fn comm_stack(
    base: Arc<dyn Communicator>,
    net: Option<SimLink<'_>>,
    recorder: Option<&Recorder>,
) -> Arc<dyn Communicator> {
    let c: Arc<dyn Communicator> = match net {
        Some(SimLink::Shared(link)) => Arc::new(SimulatedNetwork::on_link(base, link)),
        Some(SimLink::Own(model)) => Arc::new(SimulatedNetwork::new(base, model)),
        None => base,
    };
    match recorder {
        Some(r) => Arc::new(Traced::new(c, r.clone())),
        None => c,
    }
}

/// A link of `gbps` gigabits per second and `latency_us` microseconds per message.
pub fn net_model(gbps: f64, latency_us: f64) -> NetModel {
    NetModel {
        latency: Duration::from_secs_f64(latency_us * 1e-6),
        bandwidth_bytes_per_s: gbps * 1e9 / 8.0,
    }
}
