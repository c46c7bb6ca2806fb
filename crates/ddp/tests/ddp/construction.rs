//! What DDP's construction sends: the model check, and rank 0's parameters packed into few
//! broadcasts of at most [`PARAMETER_BROADCAST_CAP_BYTES`] each.

use std::sync::Arc;

use brigade_comm::{run_on_threads, Recorder};
use brigade_ddp::{DdpConfig, DistributedDataParallel, PARAMETER_BROADCAST_CAP_BYTES};
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
fn construction_broadcasts_pack_parameters_up_to_the_cap_and_a_larger_one_goes_alone() {
    // 2,560 x 2,560 floats = 25 MiB exactly: a weight fills a broadcast by itself, and the
    // broadcast before it holds the first layer's weight and bias, the one after it its bias
    // and the last layer
    let widths = [4, 2560, 2560, 2];
    let (values, sent) = construct(&widths);
    assert_eq!(values[1], values[0], "every rank starts from rank 0's parameters");
    let numels: Vec<usize> = values[0].iter().map(Vec::len).collect();
    assert_eq!(4 * numels[2], PARAMETER_BROADCAST_CAP_BYTES);
    let bytes = |r: std::ops::Range<usize>| 4 * numels[r].iter().sum::<usize>();
    for (rank, sent) in sent.iter().enumerate() {
        let broadcasts: Vec<usize> = sent
            .iter()
            .filter(|(_, op, _)| op == "broadcast")
            .map(|&(_, _, b)| b)
            .collect();
        assert_eq!(
            broadcasts,
            [bytes(0..2), bytes(2..3), bytes(3..6)],
            "rank {rank}: {sent:?}"
        );
        assert!(broadcasts.iter().all(|&b| b <= PARAMETER_BROADCAST_CAP_BYTES));
    }
}
