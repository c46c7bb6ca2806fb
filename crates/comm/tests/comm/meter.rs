//! `CommMeter`: every collective's payload and ring wire bytes, counted per rank (ddp's
//! `group::Metered` counts into it; its tests are ddp's).

use brigade_comm::{CommBytes, CommMeter};

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
