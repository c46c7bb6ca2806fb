//! The wire model's pricing rules on the ring cost model: for each collective a policy may
//! issue, the messages (latencies), link bytes (bandwidth time) and wire bytes at 2, 3 and 4
//! ranks, from the formula's parts.

use brigade_comm::RingOp;
use brigade_ddp::overlap::{RingPrice, WireModel};
use brigade_ddp::policy::{AfterStepWire, WireOp};

/// Two parameters of 1200 and 400 f32 bytes (300 and 100 elements), one bucket holding both.
const PARAMS: [usize; 2] = [1200, 400];
const BUCKET: [usize; 2] = [0, 1];
const ELEMENTS: f64 = 400.0;

fn price(w: &WireModel, n: usize) -> RingPrice {
    w.bucket_price(&BUCKET, &PARAMS, n)
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * b.abs().max(1.0)
}

fn assert_price(got: RingPrice, messages: f64, link: f64, wire: f64, what: &str) {
    assert!(
        close(got.messages, messages) && close(got.link_bytes, link) && close(got.wire_bytes, wire),
        "{what}: got {got:?}, want {messages} messages, {link} link bytes, {wire} wire bytes"
    );
}

#[test]
fn an_all_reduce_waits_two_laps_of_the_ring_and_sends_two_shares_of_the_buffer() {
    let w = WireModel::AllReduce { bytes_per_element: 2.0 };
    for n in [2usize, 3, 4] {
        let (q, s) = ((n - 1) as f64, ELEMENTS * 2.0);
        let share = 2.0 * q / n as f64 * s;
        assert_price(price(&w, n), 2.0 * q, share, share, &format!("all-reduce on {n}"));
    }
}

#[test]
fn a_reduce_scatter_pads_the_bucket_to_the_ranks_and_sends_one_share() {
    for n in [2usize, 3, 4] {
        let q = (n - 1) as f64;
        let padded = ((400usize).div_ceil(n) * n * 4) as f64;
        let share = q / n as f64 * padded;
        assert_price(
            price(&WireModel::ReduceScatter, n),
            q,
            share,
            share,
            &format!("reduce-scatter on {n}"),
        );
    }
}

#[test]
fn a_dense_all_gather_sends_its_piece_to_every_other_rank() {
    // int8: one byte per element and a 4-byte scale per bucket
    let w = WireModel::AllGather {
        bytes_per_element: 1.0,
        bytes_per_bucket: 4.0,
        density: 1.0,
    };
    for n in [2usize, 3, 4] {
        let q = (n - 1) as f64;
        let sent = q * (ELEMENTS + 4.0);
        assert_price(price(&w, n), q, sent, sent, &format!("all-gather on {n}"));
    }
}

#[test]
fn a_sparse_all_gathers_bytes_grow_with_the_ranks() {
    // top-k at 5%: a value (4 bytes) and an index (8 bytes) per kept element
    let w = WireModel::AllGather {
        bytes_per_element: 12.0,
        bytes_per_bucket: 0.0,
        density: 0.05,
    };
    let piece = ELEMENTS * 0.05 * 12.0;
    let mut last = 0.0;
    for n in [2usize, 3, 4] {
        let q = (n - 1) as f64;
        let p = price(&w, n);
        assert_price(p, q, q * piece, q * piece, &format!("sparse all-gather on {n}"));
        assert!(p.wire_bytes > last, "a sparse all-gather sends more on more ranks");
        last = p.wire_bytes;
    }
}

#[test]
fn a_low_rank_bucket_is_two_all_reduces_the_plain_tensors_with_the_ps_then_the_qs() {
    // parameter 0 compresses into P of 40 and Q of 30 elements, parameter 1 is sent whole
    let w = WireModel::LowRank {
        start_iter: 0,
        factors: vec![Some((40, 30)), None],
    };
    assert_eq!(
        w.bucket_ops(&BUCKET, &PARAMS, 3),
        vec![(RingOp::AllReduce, 400.0 + 160.0), (RingOp::AllReduce, 120.0)]
    );
    for n in [2usize, 3, 4] {
        let q = (n - 1) as f64;
        let share = 2.0 * q / n as f64 * (400.0 + 160.0 + 120.0);
        assert_price(price(&w, n), 2.0 * 2.0 * q, share, share, &format!("low rank on {n}"));
    }
    // a bucket of the plain tensor alone: its one all-reduce
    assert_eq!(w.bucket_ops(&[1], &PARAMS, 3), vec![(RingOp::AllReduce, 400.0)]);
}

#[test]
fn a_broadcast_after_the_step_crosses_each_link_once_in_a_chain() {
    let w = AfterStepWire {
        op: WireOp::Broadcast,
        bytes_per_element: 4.0,
        every: 10,
        fragments: 1,
        overlap_steps: 0,
        collectives: 1,
        parts: vec![],
    };
    for n in [2usize, 3, 4] {
        let q = (n - 1) as f64;
        let s = ELEMENTS * 4.0;
        assert_price(
            w.price(&PARAMS, n),
            q,
            s,
            q / n as f64 * s,
            &format!("broadcast on {n}"),
        );
    }
}

#[test]
fn an_all_reduce_after_the_step_is_priced_like_a_buckets() {
    let w = AfterStepWire {
        op: WireOp::AllReduce,
        bytes_per_element: 4.0,
        every: 1,
        fragments: 1,
        overlap_steps: 0,
        collectives: 1,
        parts: vec![],
    };
    for n in [2usize, 3, 4] {
        let bucket = WireModel::AllReduce { bytes_per_element: 4.0 };
        assert_eq!(w.price(&PARAMS, n), price(&bucket, n), "on {n}");
    }
}

#[test]
fn one_rank_sends_nothing() {
    let w = WireModel::AllGather {
        bytes_per_element: 1.0,
        bytes_per_bucket: 4.0,
        density: 1.0,
    };
    assert_eq!(price(&w, 1), RingPrice::default());
    assert_eq!(
        RingPrice::of(RingOp::AllGather, 100.0, 4).seconds(1e-3, 1e-6),
        3.0 * 1e-3 + 300.0 * 1e-6
    );
}

#[test]
fn an_after_step_sent_in_several_collectives_waits_each_ones_latency() {
    // One all-reduce per parameter: the same bytes as one all-reduce of them all, and the
    // ring's 2(n−1) messages for each of the collectives.
    let one = AfterStepWire {
        op: WireOp::AllReduce,
        bytes_per_element: 4.0,
        every: 1,
        fragments: 1,
        overlap_steps: 0,
        collectives: 1,
        parts: vec![],
    };
    let each = AfterStepWire {
        collectives: 3,
        parts: vec![],
        ..one.clone()
    };
    for n in [2usize, 3, 4] {
        let (a, b) = (one.price(&PARAMS, n), each.price(&PARAMS, n));
        assert_eq!(b.messages, 3.0 * a.messages, "on {n}");
        assert_eq!((b.link_bytes, b.wire_bytes), (a.link_bytes, a.wire_bytes), "on {n}");
    }
}
