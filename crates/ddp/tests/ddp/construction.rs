//! What DDP's construction sends: the model check, and rank 0's parameters packed into few
//! broadcasts, each at most [`PARAMETER_BROADCAST_MIN_PACK_BYTES`] or the largest parameter.

use std::sync::Arc;

use brigade_comm::{run_on_threads, Recorder};
use brigade_ddp::{DdpConfig, DistributedDataParallel, PARAMETER_BROADCAST_MIN_PACK_BYTES};
use brigade_tensor::set_compute_threads;

use crate::common::{self, Mlp};

/// Each rank's collectives: (tag, op, bytes).
type Sent = Vec<Vec<(String, String, usize)>>;

/// Builds DDP over `widths` on 2 ranks (each rank's parameters drawn from its own seed) on a
/// traced stream; returns each rank's parameter values after construction and, per rank, the
/// (name, op, bytes) of each collective construction issued.
fn construct(widths: &[usize]) -> (Vec<Vec<Vec<f32>>>, Sent) {
    let recorder = Recorder::new();
    let values = run_on_threads(2, |comm| {
        set_compute_threads(1);
        let rank = comm.rank();
        let m = Mlp::new(widths, 7 + rank as u64);
        let comm = Arc::new(comm.traced(recorder.clone()));
        let _ddp = DistributedDataParallel::new(&m.store, comm, DdpConfig::default(), common::average()).unwrap();
        m.values()
    })
    .into_iter()
    .map(|r| r.unwrap())
    .collect();
    let events = recorder.events();
    let sent = (0..2)
        .map(|rank| {
            events
                .iter()
                .filter(|e| e.rank == rank && !e.op.is_empty())
                .map(|e| (e.name.clone(), e.op.clone(), e.bytes))
                .collect()
        })
        .collect();
    (values, sent)
}

/// The bytes of each broadcast one rank sent, in order.
fn broadcast_bytes(sent: &[(String, String, usize)]) -> Vec<usize> {
    sent.iter()
        .filter(|(_, op, _)| op == "broadcast")
        .map(|&(_, _, b)| b)
        .collect()
}

#[test]
fn construction_sends_a_model_of_small_parameters_in_one_broadcast_after_the_model_check() {
    // ten parameters, 979 floats in all
    let widths = [6, 16, 16, 16, 16, 3];
    let (values, sent) = construct(&widths);
    assert_eq!(values[1], values[0], "every rank starts from rank 0's parameters");
    assert_ne!(values[0], Mlp::new(&widths, 8).values(), "rank 1 drew other values");
    let model_bytes: usize = values[0].iter().map(|v| 4 * v.len()).sum();
    for (rank, sent) in sent.iter().enumerate() {
        let names: Vec<&str> = sent.iter().map(|(name, _, _)| name.as_str()).collect();
        // the model check's two gathers (the lists' lengths, then the lists), no gather of
        // recipes (every parameter is drawn), one broadcast
        assert_eq!(
            names,
            ["ddp.signature.len", "ddp.signature", "ddp.broadcast_parameters.0"],
            "rank {rank}: {sent:?}"
        );
        assert_eq!(sent[2].1, "broadcast", "rank {rank}: {sent:?}");
        assert_eq!(
            sent[2].2, model_bytes,
            "rank {rank}: the broadcast carries the whole model"
        );
    }
}

#[test]
fn construction_packs_up_to_the_largest_parameter_and_one_larger_than_the_floor_goes_alone() {
    // the middle weight, 600 x 600 floats (1.37 MiB), is the largest parameter and above the
    // 1 MiB floor: it is the pack's size and fills a broadcast by itself; the broadcast before
    // it holds the first layer's weight and bias, the one after it its bias and the last layer
    let widths = [4, 600, 600, 2];
    let (values, sent) = construct(&widths);
    assert_eq!(values[1], values[0], "every rank starts from rank 0's parameters");
    let numels: Vec<usize> = values[0].iter().map(Vec::len).collect();
    let largest = 4 * numels.iter().max().unwrap();
    assert_eq!(largest, 4 * numels[2]);
    assert!(largest > PARAMETER_BROADCAST_MIN_PACK_BYTES);
    let bytes = |r: std::ops::Range<usize>| 4 * numels[r].iter().sum::<usize>();
    for (rank, sent) in sent.iter().enumerate() {
        let broadcasts = broadcast_bytes(sent);
        assert_eq!(
            broadcasts,
            [bytes(0..2), bytes(2..3), bytes(3..6)],
            "rank {rank}: {sent:?}"
        );
        // the host copy beside the model: never more than the largest parameter
        assert!(broadcasts.iter().all(|&b| b <= largest));
    }
}

#[test]
fn construction_packs_small_parameters_up_to_the_floor() {
    // 300 x 300 floats (352 KiB) weights: two layers fit the 1 MiB floor, the next two make a
    // second pack
    let widths = [300, 300, 300, 300, 300];
    let (values, sent) = construct(&widths);
    assert_eq!(values[1], values[0], "every rank starts from rank 0's parameters");
    let numels: Vec<usize> = values[0].iter().map(Vec::len).collect();
    for (rank, sent) in sent.iter().enumerate() {
        let broadcasts = broadcast_bytes(sent);
        assert_eq!(broadcasts.len(), 2, "rank {rank}: {sent:?}");
        assert!(broadcasts.iter().all(|&b| b <= PARAMETER_BROADCAST_MIN_PACK_BYTES));
        assert_eq!(broadcasts.iter().sum::<usize>(), 4 * numels.iter().sum::<usize>());
    }
}
