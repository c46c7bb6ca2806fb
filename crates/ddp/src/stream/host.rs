//! The CPU comm stream behind the contract: a bucket goes to the policy with collectives over
//! any [`Communicator`] (threads, MPI, simulated, traced, metered); its reduction completes
//! when its futures do. A CUDA bucket is staged through the host by the collectives (copied
//! out when a collective takes it, copied back when it lands): the correctness baseline NCCL
//! replaces.

use std::sync::Arc;

use brigade_comm::Communicator;
use brigade_tensor::Tensor;

use super::{hand_to_policy, wait_reduction, BucketStream, Failed, InFlight, Landed, ReadyBucket, ReadyEvent};
use crate::collectives::Collectives;
use crate::policy::ReducerPolicy;
use crate::DdpError;

/// The host comm stream: collectives on a [`Communicator`]'s own comm stream (a worker thread),
/// completion = the policy's future completing.
pub struct HostStream {
    collectives: Collectives,
}

impl HostStream {
    /// Buckets reduced over `comm`.
    pub fn new(comm: Arc<dyn Communicator>) -> Self {
        HostStream {
            collectives: Collectives::host(comm),
        }
    }
}

impl BucketStream for HostStream {
    fn name(&self) -> &'static str {
        "host"
    }

    fn collectives(&self) -> Collectives {
        self.collectives.clone()
    }

    fn record_ready(&self, _index: usize, _flat: &Tensor) -> crate::Result<ReadyEvent> {
        // The host computed every gradient of the bucket before announcing it (a CUDA bucket's
        // copy out when a collective takes it waits for the compute stream).
        Ok(ReadyEvent::Host)
    }

    fn launch(
        &self,
        bucket: ReadyBucket,
        policy: &mut dyn ReducerPolicy,
        collectives: &Collectives,
    ) -> crate::Result<InFlight> {
        hand_to_policy(collectives, bucket, policy, "host")
    }

    fn wait(&self, in_flight: InFlight) -> Result<Landed, Failed> {
        if in_flight.launched_by != "host" {
            return Err(Failed {
                error: DdpError::WrongStream {
                    bucket: in_flight.index,
                    stream: "host",
                    launched_by: in_flight.launched_by,
                },
            });
        }
        wait_reduction(in_flight)
    }
}
