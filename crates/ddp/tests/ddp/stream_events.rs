//! The reducer's stream/event contract, checked from the recorded order of its calls on the
//! host comm stream: the same calls, in the same order, drive the NCCL stream on a GPU.

use crate::common;

use std::sync::Arc;

use brigade_comm::run_on_threads;
use brigade_ddp::group::{HostGroup, Recording, StreamEvent};
use brigade_ddp::Group;
use brigade_ddp::{DdpConfig, DistributedDataParallel};
use brigade_tensor::set_compute_threads;
use common::{data, rows, Mlp};

const WIDTHS: [usize; 4] = [6, 8, 8, 3];

/// Caps of one byte: every parameter closes its own bucket (6 buckets).
fn one_param_per_bucket() -> DdpConfig {
    let byte = 1.0 / (1024.0 * 1024.0);
    DdpConfig {
        first_bucket_cap_mb: byte,
        bucket_cap_mb: byte,
        ..DdpConfig::default()
    }
}

/// Checks one synchronized step's events: every bucket's ready event is recorded just before
/// its launch, launches run 0, 1, 2, ... (bucket order), and every bucket's completion is
/// waited on, in bucket order, after the last launch and before the step.
fn assert_one_synchronized_step(events: &[StreamEvent], buckets: usize) {
    let mut expected = Vec::new();
    for b in 0..buckets {
        expected.push(StreamEvent::Ready(b));
        expected.push(StreamEvent::Launch(b));
    }
    expected.extend((0..buckets).map(StreamEvent::Wait));
    expected.push(StreamEvent::Step);
    assert_eq!(events, expected.as_slice());
}

#[test]
fn buckets_launch_in_order_and_every_completion_is_waited_before_the_step() {
    let world = 2;
    let (x, y) = data(world * 4 * 3, WIDTHS[0], WIDTHS[3], 7);
    let grads = run_on_threads(world, |comm| {
        set_compute_threads(1);
        let rank = comm.rank();
        let comm = Arc::new(comm);
        let m = Mlp::new(&WIDTHS, 3);
        let cfg = one_param_per_bucket();
        let stream = Arc::new(Recording::new(Arc::new(HostGroup::new(comm.clone()))));
        let as_contract: Group = stream.clone();
        let ddp = DistributedDataParallel::with_group(&m.store, comm, as_contract, cfg, common::average()).unwrap();
        assert_eq!(ddp.buckets().len(), 6);
        let mut last_grads = vec![];
        for step in 0..3 {
            let (xb, yb) = rows(&x, &y, step * world * 4 + rank * 4, 4);
            m.store.zero_grad().unwrap();
            stream.clear();
            if step == 1 {
                // no_sync: gradients accumulate locally, nothing reaches the stream.
                ddp.no_sync(|| m.loss(&xb, &yb).backward().unwrap());
                assert_eq!(stream.events(), vec![], "no_sync launched something");
                continue;
            }
            m.loss(&xb, &yb).backward().unwrap();
            stream.mark_step();
            // Step 2 runs on the buckets rebuilt after step 0.
            assert!(ddp.buckets_rebuilt());
            assert_one_synchronized_step(&stream.events(), ddp.buckets().len());
            last_grads = m
                .store
                .params()
                .iter()
                .map(|p| p.grad().unwrap().to_vec::<f32>().unwrap())
                .collect::<Vec<_>>();
        }
        last_grads
    });
    let grads: Vec<_> = grads.into_iter().map(|r| r.unwrap()).collect();
    // The averaged gradients (the first synchronized step after no_sync reduces the sum of two
    // microbatches' gradients) are the same on both ranks.
    assert_eq!(grads[0], grads[1]);
    assert!(grads[0].iter().flatten().any(|&g| g != 0.0));
}

#[test]
fn a_failed_collective_gives_the_bucket_storage_back_and_names_the_collective() {
    // Rank 1 leaves before the first backward: rank 0's bucket collectives fail, and its
    // gradient views are not left without storage.
    let world = 2;
    let (x, y) = data(8, WIDTHS[0], WIDTHS[3], 7);
    let out = run_on_threads(world, |comm| {
        set_compute_threads(1);
        let rank = comm.rank();
        let comm = Arc::new(comm);
        let m = Mlp::new(&WIDTHS, 3);
        let cfg = one_param_per_bucket();
        let stream = Arc::new(Recording::new(Arc::new(HostGroup::new(comm.clone()))));
        let ddp = DistributedDataParallel::with_group(&m.store, comm, stream.clone(), cfg, common::average()).unwrap();
        if rank == 1 {
            return None;
        }
        let (xb, yb) = rows(&x, &y, 0, 4);
        let err = m.loss(&xb, &yb).backward().unwrap_err().to_string();
        let waits = stream
            .events()
            .iter()
            .filter(|e| matches!(e, StreamEvent::Wait(_)))
            .count();
        // Every launched bucket was waited on, and every gradient reads (zeros) again.
        let grads_readable = m
            .store
            .params()
            .iter()
            .all(|p| p.grad().unwrap().to_vec::<f32>().is_ok());
        drop(ddp);
        Some((err, waits, grads_readable))
    });
    let (err, waits, grads_readable) = out[0].as_ref().unwrap().clone().unwrap();
    assert!(err.contains("bucket"), "{err}");
    assert_eq!(waits, 6);
    assert!(grads_readable);
}

#[test]
fn a_bucket_that_fills_early_waits_for_the_buckets_before_it() {
    // Without the rebuild, buckets follow reverse registration order, which is not the order
    // backward finishes the gradients in: some later bucket fills before an earlier one, and
    // must still be launched after it.
    let world = 2;
    let (x, y) = data(world * 4, WIDTHS[0], WIDTHS[3], 7);
    let out = run_on_threads(world, |comm| {
        set_compute_threads(1);
        let rank = comm.rank();
        let comm = Arc::new(comm);
        let m = Mlp::new(&WIDTHS, 3);
        let cfg = DdpConfig {
            rebuild_buckets: false,
            ..one_param_per_bucket()
        };
        let stream = Arc::new(Recording::new(Arc::new(HostGroup::new(comm.clone()))));
        let ddp = DistributedDataParallel::with_group(&m.store, comm, stream.clone(), cfg, common::average()).unwrap();
        let (xb, yb) = rows(&x, &y, rank * 4, 4);
        m.loss(&xb, &yb).backward().unwrap();
        stream.mark_step();
        let bucket_order: Vec<String> = ddp.buckets().into_iter().map(|b| b.params[0].clone()).collect();
        (stream.events(), bucket_order, ddp.last_ready_order())
    });
    for r in out {
        let (events, bucket_order, ready_order) = r.unwrap();
        assert_ne!(
            bucket_order, ready_order,
            "the test needs a ready order that differs from bucket order"
        );
        assert_one_synchronized_step(&events, bucket_order.len());
    }
}

#[test]
fn every_backward_span_is_handed_to_the_stream_and_closed_before_the_buckets_are_waited() {
    // With a timeline, the reducer tells the stream each backward scope it opens and closes (the
    // NCCL stream retimes them on the GPU clock): opens and closes alternate, and the last one
    // closes before the first wait.
    let (x, y) = data(4, WIDTHS[0], WIDTHS[3], 7);
    let events = run_on_threads(1, |comm| {
        set_compute_threads(1);
        let comm = Arc::new(comm);
        let m = Mlp::new(&WIDTHS, 3);
        let cfg = DdpConfig {
            recorder: Some(brigade_comm::Recorder::new()),
            ..one_param_per_bucket()
        };
        let stream = Arc::new(Recording::new(Arc::new(HostGroup::new(comm.clone()))));
        let as_contract: Group = stream.clone();
        let _ddp = DistributedDataParallel::with_group(&m.store, comm, as_contract, cfg, common::average()).unwrap();
        m.loss(&x, &y).backward().unwrap();
        stream.events()
    })
    .into_iter()
    .next()
    .unwrap()
    .unwrap();
    let scopes: Vec<StreamEvent> = events
        .iter()
        .copied()
        .filter(|e| matches!(e, StreamEvent::ScopeOpen | StreamEvent::ScopeClose))
        .collect();
    assert!(!scopes.is_empty(), "{events:?}");
    for (i, e) in scopes.iter().enumerate() {
        let want = if i % 2 == 0 {
            StreamEvent::ScopeOpen
        } else {
            StreamEvent::ScopeClose
        };
        assert_eq!(*e, want, "{events:?}");
    }
    assert_eq!(scopes.len() % 2, 0, "a scope left open: {events:?}");
    let last_close = events.iter().rposition(|e| *e == StreamEvent::ScopeClose).unwrap();
    let first_wait = events.iter().position(|e| matches!(e, StreamEvent::Wait(_))).unwrap();
    assert!(last_close < first_wait, "{events:?}");
}

/// One all-gather issued on a host-staged device group on fake device `ordinal` from its compute
/// stream, then one kernel on the compute stream, with the work waited for after the kernel
/// (`wait`) or dropped before it; the device's log, and the comm stream's handle.
fn gather_then_compute(ordinal: usize, wait: bool) -> (Vec<brigade_tensor::fake::FakeOp>, u64) {
    use brigade_ddp::group::DeviceGroup;
    use brigade_ddp::ProcessGroup;
    use brigade_tensor::{fake, DType, Device, Tensor};
    let device = Device::Fake(ordinal);
    fake::reset(ordinal);
    run_on_threads(1, |comm| {
        let group = DeviceGroup::host_staged(device, Arc::new(comm)).unwrap();
        let shard = Tensor::full_on(&[4], 1.5, DType::F32, device).unwrap();
        let full = Tensor::zeros_on(&[4], DType::F32, device).unwrap();
        fake::start_log(ordinal);
        let work = group.all_gather_into(&shard, &full, "gather");
        if !wait {
            drop(work);
            Tensor::zeros_on(&[3], DType::F32, device).unwrap();
        } else {
            Tensor::zeros_on(&[3], DType::F32, device).unwrap();
            work.wait().unwrap();
        }
        (fake::take_log(ordinal), group.comm_stream().raw_handle())
    })
    .pop()
    .unwrap()
    .unwrap()
}

#[test]
fn the_compute_stream_waits_on_a_device_gather_when_its_work_is_waited_for_or_dropped() {
    use brigade_tensor::fake::FakeWhat;
    for (wait, ordinal) in [(true, 254), (false, 255)] {
        let (log, comm) = gather_then_compute(ordinal, wait);
        let on_compute = |f: &dyn Fn(&FakeWhat) -> bool| {
            log.iter()
                .position(|op| op.stream != comm && f(&op.what))
                .unwrap_or_else(|| panic!("{log:?}"))
        };
        let waited = on_compute(&|w| matches!(w, FakeWhat::Wait { recorded_on, .. } if *recorded_on == comm));
        let kernel = on_compute(&|w| *w == FakeWhat::Kernel("zeros"));
        // waited for: the kernel issued before the wait runs beside the gather; dropped: the
        // compute stream is ordered behind the gather at once
        assert_eq!(waited > kernel, wait, "{log:?}");
    }
}
