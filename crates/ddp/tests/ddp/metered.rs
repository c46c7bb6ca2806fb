//! DDP's meter (`group::Metered`): every collective's payload and ring wire bytes, counted per
//! rank, once, whatever group it wraps.

use std::sync::Arc;
use std::time::Duration;

use brigade_comm::{run_on_threads_with_timeout, CommBytes, CommMeter, ReduceOp};
use brigade_ddp::group::{HostGroup, Metered};
use brigade_ddp::{Group, ProcessGroup};
use brigade_tensor::{DType, Tensor};

const TIMEOUT: Duration = Duration::from_secs(20);

/// Issues one of each collective through a metered host group and waits for them all;
/// returns each rank's totals.
fn one_of_each(world: usize) -> Vec<CommBytes> {
    run_on_threads_with_timeout(world, TIMEOUT, |comm| {
        let meter = CommMeter::new();
        let comm = Arc::new(comm);
        let host: Group = Arc::new(HostGroup::new(comm));
        let group = Metered::new(host, meter.clone());
        let p = group.world_size();
        let ones = |n: usize, dtype: DType| Tensor::ones(&[n], dtype);
        group
            .all_reduce(&ones(1000, DType::F32), ReduceOp::Sum, "f32")
            .wait()
            .unwrap();
        group
            .all_reduce(&ones(1000, DType::F16), ReduceOp::Sum, "f16")
            .wait()
            .unwrap();
        group
            .reduce_scatter(&ones(250 * p, DType::F32), ReduceOp::Sum, "rs")
            .wait()
            .unwrap();
        group.all_gather(&ones(250, DType::F32), "ag").wait().unwrap();
        group.broadcast(&ones(100, DType::U8), 0, "bc").wait().unwrap();
        group.barrier("b").wait().unwrap();
        meter.totals()
    })
    .into_iter()
    .map(|r| r.unwrap())
    .collect()
}

#[test]
fn payload_is_the_tensor_handed_in_and_wire_bytes_follow_the_ring() {
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
fn one_rank_sends_nothing_on_the_wire_but_still_hands_its_tensors_over() {
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
