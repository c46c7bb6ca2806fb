//! What a rank puts on the wire, counted: a [`CommMeter`] adds up every collective it is told
//! of, so that a communication policy's cost is measured from the buffers it actually issues,
//! not assumed from its design. DDP's process group counts the collectives its policy issues
//! (on any backend, once each) into the meter of its configuration.
//!
//! Two figures per collective on a group of `p` ranks, for a buffer of `n` bytes handed in:
//! - **payload bytes**: `n`, the buffer this rank handed to the collective (the figure
//!   PyTorch's hooks and the PowerSGD paper compare: an f32 all-reduce of a bucket of `k`
//!   gradients is `4k`, its fp16 hook `2k`);
//! - **wire bytes**: what this rank sends under the ring algorithms of the cost model
//!   ([`RingOp::wire_bytes`]). With one rank nothing leaves it: 0.

use std::sync::{Arc, Mutex, MutexGuard};

use serde::Serialize;

use crate::RingOp;

/// Totals of a rank's collectives (see the module docs for the two byte figures).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct CommBytes {
    /// Collectives issued (barriers included).
    pub collectives: u64,
    /// Bytes of the buffers handed to them.
    pub payload_bytes: u64,
    /// Bytes this rank sends under the ring algorithms.
    pub wire_bytes: f64,
}

impl std::ops::Sub for CommBytes {
    type Output = CommBytes;

    /// What was counted between two readings of one meter (`later - earlier`).
    fn sub(self, earlier: CommBytes) -> CommBytes {
        CommBytes {
            collectives: self.collectives - earlier.collectives,
            payload_bytes: self.payload_bytes - earlier.payload_bytes,
            wire_bytes: self.wire_bytes - earlier.wire_bytes,
        }
    }
}

/// Running totals of one rank's collectives; clones share them (cheap, thread-safe). A meter
/// made by [`CommMeter::part`] counts a share of its parent's collectives (one bucket's): what
/// it counts, its parent counts too, once.
#[derive(Clone, Debug, Default)]
pub struct CommMeter {
    totals: Arc<Mutex<CommBytes>>,
    parent: Option<Arc<CommMeter>>,
}

impl CommMeter {
    /// A meter at zero.
    pub fn new() -> CommMeter {
        CommMeter::default()
    }

    /// A new meter at zero whose counts also go to this one.
    pub fn part(&self) -> CommMeter {
        CommMeter {
            totals: Arc::default(),
            parent: Some(Arc::new(self.clone())),
        }
    }

    fn lock(&self) -> MutexGuard<'_, CommBytes> {
        self.totals.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Everything counted so far; subtract two readings for what happened between them.
    pub fn totals(&self) -> CommBytes {
        *self.lock()
    }

    /// Counts one collective of `op` on a buffer of `bytes` in a group of `world` ranks.
    pub fn count(&self, op: RingOp, bytes: usize, world: usize) {
        let mut t = self.lock();
        t.collectives += 1;
        t.payload_bytes += bytes as u64;
        t.wire_bytes += op.wire_bytes(bytes as f64, world);
        drop(t);
        if let Some(parent) = &self.parent {
            parent.count(op, bytes, world);
        }
    }
}
