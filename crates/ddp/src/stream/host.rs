//! The CPU comm stream behind the contract: a bucket goes to a [`CommHook`] over any
//! [`Communicator`] (threads, MPI, simulated, traced) as a host vector, and comes back when its
//! [`Work`](brigade_comm::Work) completes. A CUDA bucket is staged through the host (copied
//! out when it is launched, copied back when it is waited on): the correctness baseline NCCL
//! replaces.

use std::sync::Arc;
use std::time::Instant;

use brigade_comm::{reducing_bucket, Communicator};
use brigade_tensor::Storage;

use super::{BucketStream, Contents, Failed, InFlight, InFlightOp, Landed, ReadyBucket, ReadyEvent};
use crate::hooks::{CommHook, GradBucket};
use crate::DdpError;

/// The host comm stream: collectives on a [`Communicator`]'s own comm stream (a worker thread),
/// completion = the hook's work completing.
pub struct HostStream {
    comm: Arc<dyn Communicator>,
    hook: Arc<dyn CommHook>,
}

impl HostStream {
    /// Buckets reduced by `hook` over `comm`.
    pub fn new(comm: Arc<dyn Communicator>, hook: Arc<dyn CommHook>) -> Self {
        HostStream { comm, hook }
    }
}

impl BucketStream for HostStream {
    fn name(&self) -> &'static str {
        "host"
    }

    fn record_ready(&self, _index: usize, _storage: &Storage) -> crate::Result<ReadyEvent> {
        // The host computed every gradient of the bucket before announcing it (a CUDA bucket's
        // copy out in `launch` waits for the compute stream).
        Ok(ReadyEvent::Host)
    }

    fn launch(&self, bucket: ReadyBucket) -> crate::Result<InFlight> {
        let (numel, device) = (bucket.storage.len(), bucket.storage.device());
        // The bucket's own vector on the CPU (no copy); a host-staged copy of device memory.
        let buffer = bucket.storage.into_host_vec::<f32>()?;
        let grad_bucket = GradBucket {
            index: bucket.index,
            buffer,
            params: bucket.params,
            is_last: bucket.is_last,
        };
        let launched = Instant::now();
        // Collectives the hook issues on this thread are traced as this bucket's.
        let work = reducing_bucket(bucket.index, || self.hook.reduce(&self.comm, grad_bucket));
        Ok(InFlight {
            index: bucket.index,
            numel,
            device,
            launched,
            op: InFlightOp::Host(work),
        })
    }

    fn wait(&self, in_flight: InFlight) -> Result<Landed, Failed> {
        let InFlight {
            index,
            numel,
            device,
            op,
            ..
        } = in_flight;
        let InFlightOp::Host(work) = op else {
            return Err(Failed {
                error: DdpError::WrongStream {
                    bucket: index,
                    stream: "host",
                    launched_by: "nccl",
                },
                storage: None,
            });
        };
        let zeros = || Storage::from_host_vec(vec![0.0f32; numel], device).ok();
        match work.wait_timed() {
            Ok((v, timing)) => Ok(Landed {
                index,
                contents: Contents::Host(v),
                ran: Some((timing.started, timing.finished)),
            }),
            // Give the views storage back (zeros) before reporting the failure.
            Err(e) => Err(Failed {
                error: e.into(),
                storage: zeros(),
            }),
        }
    }
}
