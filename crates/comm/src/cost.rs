//! The wire-cost model of the ring collectives, said once: how many messages a rank waits for
//! and how many bytes it sends for each collective on `p` ranks. The simulated network
//! ([`crate::CommStream::simulated`]) sleeps its time, the meter ([`crate::CommMeter`]) adds up its
//! bytes, the bandwidth benchmark reports its bus bandwidth, and the overlap model replays a
//! step with it.
//!
//! For a buffer of `n` bytes handed in on `p` ranks (all zero when `p == 1`):
//!
//! | collective       | messages  | wire bytes (this rank sends) | link bytes (time at `B`) |
//! |------------------|-----------|------------------------------|--------------------------|
//! | `all_reduce`     | `2(p-1)`  | `2(p-1)/p · n`               | the wire bytes           |
//! | `reduce_scatter` | `p-1`     | `(p-1)/p · n` (`n`: the whole input) | the wire bytes   |
//! | `all_gather`     | `p-1`     | `(p-1) · n` (`n`: this rank's piece) | the wire bytes   |
//! | `broadcast`      | `p-1`     | `(p-1)/p · n` (a pipelined chain: every rank but the last forwards `n`; averaged over the ranks) | `n` |
//! | `barrier`        | `2(p-1)`  | 0 (an all-reduce of nothing) | 0                        |
//!
//! A collective's time on a link of latency `alpha` and bandwidth `B` is
//! `messages · alpha + link bytes / B` ([`NetModel::time`]).

use std::time::Duration;

/// A ring collective, as the cost model sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RingOp {
    /// Sends `2(p-1)/p` of its buffer in `2(p-1)` messages.
    AllReduce,
    /// Sends `(p-1)/p` of its (whole) input in `p-1` messages.
    ReduceScatter,
    /// Sends its piece `p-1` times.
    AllGather,
    /// A pipelined chain: `p-1` messages, `n` bytes over each link.
    Broadcast,
    /// Sends no payload, in `2(p-1)` messages.
    Barrier,
}

impl RingOp {
    /// The collective's name in traces (`all_reduce`, `reduce_scatter`, `all_gather`,
    /// `broadcast`, `barrier`).
    pub fn name(self) -> &'static str {
        match self {
            RingOp::AllReduce => "all_reduce",
            RingOp::ReduceScatter => "reduce_scatter",
            RingOp::AllGather => "all_gather",
            RingOp::Broadcast => "broadcast",
            RingOp::Barrier => "barrier",
        }
    }

    /// Messages (latencies) one collective on `p` ranks waits for.
    pub fn messages(self, p: usize) -> f64 {
        let q = p.saturating_sub(1) as f64;
        match self {
            RingOp::AllReduce | RingOp::Barrier => 2.0 * q,
            RingOp::ReduceScatter | RingOp::AllGather | RingOp::Broadcast => q,
        }
    }

    /// Bytes one rank sends for a buffer of `bytes` on `p` ranks (0 on one rank).
    pub fn wire_bytes(self, bytes: f64, p: usize) -> f64 {
        let (q, p) = (p.saturating_sub(1) as f64, p.max(1) as f64);
        match self {
            RingOp::AllReduce => 2.0 * q / p * bytes,
            RingOp::ReduceScatter | RingOp::Broadcast => q / p * bytes,
            RingOp::AllGather => q * bytes,
            RingOp::Barrier => 0.0,
        }
    }

    /// Bytes that cross one link one after the other, which is what takes the bandwidth's time.
    pub fn link_bytes(self, bytes: f64, p: usize) -> f64 {
        match self {
            RingOp::Broadcast if p > 1 => bytes,
            op => op.wire_bytes(bytes, p),
        }
    }

    /// Seconds of one collective of `bytes` on `p` ranks, `latency_s` per message and `per_byte_s`
    /// per link byte.
    pub fn seconds(self, bytes: f64, p: usize, latency_s: f64, per_byte_s: f64) -> f64 {
        self.messages(p) * latency_s + self.link_bytes(bytes, p) * per_byte_s
    }
}

/// Link model: every message pays `latency` (alpha) plus `bytes / bandwidth_bytes_per_s` (B);
/// see the module docs for each collective's messages and bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NetModel {
    /// Per-message latency (alpha).
    pub latency: Duration,
    /// Link bandwidth B in bytes per second.
    pub bandwidth_bytes_per_s: f64,
}

impl NetModel {
    /// Model time of `op` on a buffer of `bytes` over `p` ranks.
    pub fn time(&self, op: RingOp, bytes: usize, p: usize) -> Duration {
        self.latency.mul_f64(op.messages(p))
            + Duration::from_secs_f64(op.link_bytes(bytes as f64, p) / self.bandwidth_bytes_per_s)
    }

    /// `2(p-1)*alpha + 2(p-1)/p * n/B`.
    pub fn all_reduce_time(&self, bytes: usize, p: usize) -> Duration {
        self.time(RingOp::AllReduce, bytes, p)
    }

    /// `(p-1)*alpha + (p-1)/p * n/B` for an input of `bytes`.
    pub fn reduce_scatter_time(&self, bytes: usize, p: usize) -> Duration {
        self.time(RingOp::ReduceScatter, bytes, p)
    }

    /// `(p-1)*alpha + (p-1) * n/B` for an input of `bytes` per rank.
    pub fn all_gather_time(&self, bytes: usize, p: usize) -> Duration {
        self.time(RingOp::AllGather, bytes, p)
    }

    /// `(p-1)*alpha + n/B` (zero when `p == 1`).
    pub fn broadcast_time(&self, bytes: usize, p: usize) -> Duration {
        self.time(RingOp::Broadcast, bytes, p)
    }

    /// `2(p-1)*alpha`.
    pub fn barrier_time(&self, p: usize) -> Duration {
        self.time(RingOp::Barrier, 0, p)
    }
}
