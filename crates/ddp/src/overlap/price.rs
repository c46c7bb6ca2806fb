//! Pricing a policy's collectives on the one ring cost model ([`brigade_comm::RingOp`]): what
//! each bucket's collectives and the after-step collective of a [`WireModel`] cost on `n`
//! ranks, in messages (each waits a link latency α), link bytes (each takes `1/B`) and wire
//! bytes (what a rank sends).

use brigade_comm::RingOp;
use serde::Serialize;

use crate::policy::{AfterStepWire, FragmentPart, WireModel};

/// One collective (or a sum of them) as the ring prices it on `n` ranks.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct RingPrice {
    /// Messages it waits for, one after the other (each costs the link's latency).
    pub messages: f64,
    /// Bytes that cross one link one after the other (each costs `1/B`).
    pub link_bytes: f64,
    /// Bytes one rank sends.
    pub wire_bytes: f64,
}

impl RingPrice {
    /// `op` on a buffer of `payload` bytes handed in by each rank (an all-gather's: its piece),
    /// on `n` ranks; zero on one rank.
    pub fn of(op: RingOp, payload: f64, n: usize) -> RingPrice {
        if n < 2 {
            return RingPrice::default();
        }
        RingPrice {
            messages: op.messages(n),
            link_bytes: op.link_bytes(payload, n),
            wire_bytes: op.wire_bytes(payload, n),
        }
    }

    /// Seconds on links of latency `alpha` and `per_byte` seconds a byte.
    pub fn seconds(&self, alpha: f64, per_byte: f64) -> f64 {
        self.messages * alpha + self.link_bytes * per_byte
    }

    /// This price and `other`'s, one after the other.
    pub fn then(self, other: RingPrice) -> RingPrice {
        RingPrice {
            messages: self.messages + other.messages,
            link_bytes: self.link_bytes + other.link_bytes,
            wire_bytes: self.wire_bytes + other.wire_bytes,
        }
    }
}

impl WireModel {
    /// The collectives one bucket issues on `n` ranks, each as `(op, bytes each rank hands
    /// in)`: the bucket holds the parameters `group` (registration indices) whose f32
    /// gradients have `param_bytes[i]` bytes. Zero-byte pieces are left out.
    pub fn bucket_ops(&self, group: &[usize], param_bytes: &[usize], n: usize) -> Vec<(RingOp, f64)> {
        let bytes: usize = group.iter().map(|&i| param_bytes[i]).sum();
        let elements = bytes as f64 / 4.0;
        let ops = match self {
            WireModel::AllReduce { bytes_per_element } => vec![(RingOp::AllReduce, elements * bytes_per_element)],
            // one reduce-scatter of the bucket padded to a multiple of the ranks
            // qgZ: each rank's whole bucket, a byte an element and a scale a block of its chunks
            WireModel::Zero3 {
                quantized_gradients: Some(block),
                ..
            } => {
                let n = n.max(1);
                let blocks = (bytes / 4).div_ceil(n).div_ceil((*block).max(1));
                vec![(RingOp::AllGather, (n * blocks * (block + 4)) as f64)]
            }
            WireModel::ReduceScatter | WireModel::Zero3 { .. } => {
                let padded = ((bytes / 4).div_ceil(n.max(1)) * n.max(1) * 4) as f64;
                vec![(RingOp::ReduceScatter, padded)]
            }
            // each rank's piece: its entries and the bucket's header
            WireModel::AllGather {
                bytes_per_element,
                bytes_per_bucket,
                density,
            } => vec![(
                RingOp::AllGather,
                (density * elements).ceil() * bytes_per_element + bytes_per_bucket,
            )],
            WireModel::Local => vec![],
            // the uncompressed tensors with the P factors in one all-reduce, the Q factors in
            // another (none when nothing compresses)
            WireModel::LowRank { factors, .. } => {
                let (mut plain, mut p, mut q) = (0.0, 0.0, 0.0);
                for &i in group {
                    match factors.get(i).copied().flatten() {
                        Some((n_p, n_q)) => (p, q) = (p + 4.0 * n_p as f64, q + 4.0 * n_q as f64),
                        None => plain += param_bytes[i] as f64,
                    }
                }
                vec![(RingOp::AllReduce, plain + p), (RingOp::AllReduce, q)]
            }
        };
        ops.into_iter().filter(|&(_, b)| b > 0.0).collect()
    }

    /// The link bytes the parameters `group` cost on `n` ranks however they are bucketed: the
    /// part of [`WireModel::bucket_price`]'s `link_bytes` that grows with the bytes, without
    /// what a bucket pays once (padding to a multiple of the ranks, a header or a scale, a
    /// count rounded up). Over a bucket's parameters it never exceeds that bucket's
    /// `link_bytes`, so a link draining each parameter's floor bounds any bucketing from below.
    pub fn link_bytes_floor(&self, group: &[usize], param_bytes: &[usize], n: usize) -> f64 {
        if n < 2 {
            return 0.0;
        }
        let bytes = group.iter().map(|&i| param_bytes[i]).sum::<usize>() as f64;
        let elements = bytes / 4.0;
        match self {
            WireModel::AllReduce { bytes_per_element } => RingOp::AllReduce.link_bytes(elements * bytes_per_element, n),
            // each rank's chunk of `elements / n` in blocks: a byte an element and a 4-byte
            // scale a block, at least
            WireModel::Zero3 {
                quantized_gradients: Some(block),
                ..
            } => {
                let block = (*block).max(1) as f64;
                RingOp::AllGather.link_bytes(elements * (block + 4.0) / block, n)
            }
            WireModel::ReduceScatter | WireModel::Zero3 { .. } => RingOp::ReduceScatter.link_bytes(bytes, n),
            WireModel::AllGather {
                bytes_per_element,
                density,
                ..
            } => RingOp::AllGather.link_bytes(density * elements * bytes_per_element, n),
            WireModel::Local => 0.0,
            // each parameter's factors (or whole tensor) in the bucket's two all-reduces: no
            // cost a bucket pays once
            WireModel::LowRank { .. } => self.bucket_price(group, param_bytes, n).link_bytes,
        }
    }

    /// What one bucket's collectives cost on `n` ranks (see [`WireModel::bucket_ops`]).
    pub fn bucket_price(&self, group: &[usize], param_bytes: &[usize], n: usize) -> RingPrice {
        self.bucket_ops(group, param_bytes, n)
            .into_iter()
            .map(|(op, b)| RingPrice::of(op, b, n))
            .fold(RingPrice::default(), RingPrice::then)
    }
}

impl AfterStepWire {
    /// Each fragment's collectives on `n` ranks for parameters of `param_bytes` f32 bytes, in
    /// the order they are sent: its share of the bytes, and the latency of each of its
    /// collectives ([`AfterStepWire::parts`]; `fragments` equal ones when it names none).
    pub fn fragment_prices(&self, param_bytes: &[usize], n: usize) -> Vec<RingPrice> {
        let elements = param_bytes.iter().sum::<usize>() as f64 / 4.0;
        let fragments = self.fragments.max(1);
        let equal = FragmentPart {
            share: 1.0 / fragments as f64,
            collectives: self.collectives,
        };
        let parts = if self.parts.is_empty() {
            vec![equal; fragments]
        } else {
            self.parts.clone()
        };
        parts
            .iter()
            .map(|p| {
                let one = RingPrice::of(self.op.ring(), elements * self.bytes_per_element * p.share, n);
                RingPrice {
                    messages: one.messages * p.collectives.max(1) as f64,
                    ..one
                }
            })
            .collect()
    }

    /// What one fragment's collectives cost on `n` ranks, on average over the fragments (all
    /// the parameters when [`AfterStepWire::fragments`] is 1): its bytes, and the latency of
    /// each of its collectives (see [`AfterStepWire::fragment_prices`]).
    pub fn price(&self, param_bytes: &[usize], n: usize) -> RingPrice {
        let all = self.fragment_prices(param_bytes, n);
        let k = all.len().max(1) as f64;
        let sum = all.into_iter().fold(RingPrice::default(), RingPrice::then);
        RingPrice {
            messages: sum.messages / k,
            link_bytes: sum.link_bytes / k,
            wire_bytes: sum.wire_bytes / k,
        }
    }

    /// What a step waits for, on average, on links of latency `alpha` and `per_byte` seconds a
    /// byte: each fragment's collectives, `fragments / every` of them a step, less `hidden`
    /// seconds of compute each runs behind when it overlaps the steps that follow it (the
    /// compute before the next collective on the comm stream queues behind it).
    pub fn step_share(&self, param_bytes: &[usize], n: usize, alpha: f64, per_byte: f64, hidden: f64) -> f64 {
        let hidden = if self.overlap_steps > 0 { hidden } else { 0.0 };
        let exposed: f64 = self
            .fragment_prices(param_bytes, n)
            .iter()
            .map(|p| (p.seconds(alpha, per_byte) - hidden).max(0.0))
            .sum();
        exposed / self.every.max(1) as f64
    }
}
