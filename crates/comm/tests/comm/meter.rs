//! `Metered`: every collective's payload and ring wire bytes, counted per rank.

use std::time::Duration;

use brigade_comm::{run_on_threads_with_timeout, Buffer, CommBytes, CommMeter, Communicator, Metered, ReduceOp};
use half::f16;

const TIMEOUT: Duration = Duration::from_secs(20);

/// Issues one of each collective through a metered communicator and waits for them all;
/// returns each rank's totals.
fn one_of_each(world: usize) -> Vec<CommBytes> {
    run_on_threads_with_timeout(world, TIMEOUT, |comm| {
        let meter = CommMeter::new();
        let comm = Metered::new(comm, meter.clone());
        let p = comm.world_size();
        comm.all_reduce(Buffer::F32(vec![1.0; 1000]), ReduceOp::Sum, "f32")
            .wait()
            .unwrap();
        comm.all_reduce(Buffer::F16(vec![f16::ONE; 1000]), ReduceOp::Sum, "f16")
            .wait()
            .unwrap();
        comm.reduce_scatter(Buffer::F32(vec![1.0; 250 * p]), ReduceOp::Sum, "rs")
            .wait()
            .unwrap();
        comm.all_gather(Buffer::F32(vec![1.0; 250]), "ag").wait().unwrap();
        comm.broadcast(Buffer::U8(vec![7; 100]), 0, "bc").wait().unwrap();
        comm.barrier("b").wait().unwrap();
        meter.totals()
    })
    .into_iter()
    .map(|r| r.unwrap())
    .collect()
}

#[test]
fn payload_is_the_buffer_handed_in_and_wire_bytes_follow_the_ring() {
    for rank_totals in one_of_each(4) {
        // payload: 4000 (f32) + 2000 (f16) + 4000 (reduce_scatter of 4 x 250 f32) + 1000
        // (all_gather piece) + 100 (u8 broadcast) + 0 (barrier) = 11100
        // wire, p = 4: 2*3/4*4000 = 6000, 2*3/4*2000 = 3000, 3/4*4000 = 3000, 3*1000 = 3000,
        // 3/4*100 = 75, 0: 15075
        assert_eq!(
            rank_totals,
            CommBytes {
                collectives: 6,
                payload_bytes: 11100,
                wire_bytes: 15075.0
            }
        );
    }
}

#[test]
fn one_rank_sends_nothing_on_the_wire_but_still_hands_its_buffers_over() {
    let totals = one_of_each(1);
    // payload: 4000 + 2000 + 1000 (reduce_scatter of 1 x 250) + 1000 + 100 = 8100
    assert_eq!(
        totals[0],
        CommBytes {
            collectives: 6,
            payload_bytes: 8100,
            wire_bytes: 0.0
        }
    );
}

#[test]
fn readings_subtract_to_what_happened_between_them() {
    let meter = CommMeter::new();
    meter.count(brigade_comm::RingOp::AllReduce, 400, 2);
    let before = meter.totals();
    meter.count(brigade_comm::RingOp::AllGather, 100, 3);
    // all_gather on 3 ranks sends its 100-byte piece twice
    assert_eq!(
        meter.totals() - before,
        CommBytes {
            collectives: 1,
            payload_bytes: 100,
            wire_bytes: 200.0
        }
    );
}
