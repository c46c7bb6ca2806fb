//! fp16, PowerSGD and ZeRO-1 under the NCCL stream's contract, on the counting fake device:
//! the same `DeviceGroup` code that drives NCCL on a GPU, its collectives staged through the
//! host (`HostStaged`) on the comm stream, two thread ranks each on a fake device of its
//! own. The fake device refuses, with an error, any access its streams' events do not order
//! (a race on a GPU), so a collective not behind its bucket's ready event, or a step not
//! behind a bucket's done event, fails the run; the recorded calls and the device's log then
//! show the contract itself: each bucket's ready event before its launch, the policy's compute
//! and collectives on the comm stream behind it, every done event waited on by the compute
//! stream before the optimizer's first kernel, and the losses of the host comm stream, bit for
//! bit.

use crate::common::{max_diff, optimizer, rows, teacher_data, Mlp};

use std::sync::Arc;

use brigade_comm::run_on_threads;
use brigade_ddp::group::{DeviceGroup, HostGroup, Recording, StreamEvent};
use brigade_ddp::Group;
use brigade_ddp::{DdpConfig, DistributedDataParallel};
use brigade_tensor::fake::{self, FakeOp, FakeWhat};
use brigade_tensor::{set_compute_threads, Device, Tensor};

const WIDTHS: [usize; 4] = [16, 32, 32, 4];
const STEPS: usize = 3;
const ROWS: usize = 8;

/// Caps of 2 KiB: two or more buckets (ZeRO keeps its first layout), so that buckets
/// launch while backward still computes.
fn small_buckets() -> DdpConfig {
    let kib = 1.0 / 1024.0;
    DdpConfig {
        first_bucket_cap_mb: 2.0 * kib,
        bucket_cap_mb: 2.0 * kib,
        ..DdpConfig::default()
    }
}

/// What one rank saw in the last step.
struct LastStep {
    losses: Vec<f64>,
    params: Vec<Vec<f32>>,
    calls: Vec<StreamEvent>,
    log: Vec<FakeOp>,
    comm_stream: u64,
}

/// Trains `policy` for [`STEPS`] steps on 2 thread ranks: on fake devices `ordinal + rank`
/// through the device stream (host-staged comm side), or on the CPU through the host stream.
fn train(policy: &str, ordinal: Option<usize>) -> Vec<LastStep> {
    let world = 2;
    let (x, y) = teacher_data(world * ROWS * STEPS, WIDTHS[0], WIDTHS[3], 5);
    run_on_threads(world, |comm| {
        set_compute_threads(1);
        let rank = comm.rank();
        let comm = Arc::new(comm);
        let device = ordinal.map_or(Device::Cpu, |o| Device::Fake(o + rank));
        let m = Mlp::new(&WIDTHS, 42);
        for p in m.store.params() {
            p.set_value(p.value().to_device(device).unwrap()).unwrap();
        }
        let (stream, comm_stream): (Group, u64) = match ordinal {
            Some(_) => {
                let s = DeviceGroup::host_staged(device, comm.clone()).unwrap();
                let id = s.comm_stream().raw_handle();
                (Arc::new(s), id)
            }
            None => (Arc::new(HostGroup::new(comm.clone())), 0),
        };
        let recording = Arc::new(Recording::new(stream));
        let as_contract: Group = recording.clone();
        let spec = policy.parse::<brigade_policies::PolicySpec>().unwrap();
        let built = spec.build(&brigade_policies::Registry::new()).unwrap();
        let ddp = DistributedDataParallel::with_group(&m.store, comm, as_contract, small_buckets(), built).unwrap();
        let full = optimizer("plain-sgd", m.store.params().to_vec());
        let mut opt = ddp.optimizer(full, &|p| optimizer("plain-sgd", p)).unwrap();
        let mut losses = vec![];
        let mut log = vec![];
        for step in 0..STEPS {
            let (xb, yb) = rows(&x, &y, (step * world + rank) * ROWS, ROWS);
            let (xb, yb): (Tensor, Tensor) = (xb.to_device(device).unwrap(), yb.to_device(device).unwrap());
            m.store.zero_grad().unwrap();
            recording.clear();
            let last = step + 1 == STEPS;
            if let (true, Some(o)) = (last, ordinal) {
                fake::start_log(o + rank);
            }
            let loss = m.loss(&xb, &yb);
            loss.backward().unwrap();
            recording.mark_step();
            brigade_autograd::Optimizer::step(&mut opt).unwrap();
            if let (true, Some(o)) = (last, ordinal) {
                log = fake::take_log(o + rank);
            }
            losses.push(loss.value().item().unwrap());
        }
        LastStep {
            losses,
            params: m.values(),
            calls: recording.events(),
            log,
            comm_stream,
        }
    })
    .into_iter()
    .map(|r| r.unwrap())
    .collect()
}

/// Checks the contract on one rank's last step (see the module docs); returns the kernels the
/// comm stream ran.
fn assert_contract(r: &LastStep) -> Vec<&'static str> {
    // the calls: ready then launch, bucket by bucket in order; every bucket waited, in order,
    // before the step
    let buckets = r.calls.iter().filter(|e| matches!(e, StreamEvent::Launch(_))).count();
    assert!(buckets >= 2, "{:?}", r.calls);
    let mut want = vec![];
    for b in 0..buckets {
        want.extend([StreamEvent::Ready(b), StreamEvent::Launch(b)]);
    }
    want.extend((0..buckets).map(StreamEvent::Wait));
    want.push(StreamEvent::Step);
    let calls: Vec<_> = r
        .calls
        .iter()
        .copied()
        .filter(|e| !matches!(e, StreamEvent::ScopeOpen | StreamEvent::ScopeClose))
        .collect();
    assert_eq!(calls, want);

    // the device's log: the comm stream stages no collective before it waited on an event of
    // the compute stream (the bucket's ready event, or the caller's for a collective issued
    // outside a launch), and every event it records is waited on by the compute stream before
    // the optimizer's first kernel (a bucket's done event) or before the compute stream's next
    // op (a collective issued from it)
    let comm = r.comm_stream;
    assert_ne!(comm, 0);
    let mut behind_compute = false;
    let mut kernels = vec![];
    let mut recorded: Vec<u64> = vec![];
    let mut first_step = None;
    for (i, op) in r.log.iter().enumerate() {
        match (&op.what, op.stream) {
            (FakeWhat::Wait { recorded_on: 0, .. }, s) if s == comm => behind_compute = true,
            (FakeWhat::ToHost(_), s) if s == comm => {
                assert!(
                    behind_compute,
                    "op {i}: a collective staged before any wait: {:?}",
                    r.log
                )
            }
            (FakeWhat::Kernel(k), s) if s == comm => kernels.push(*k),
            (FakeWhat::Record(e), s) if s == comm => recorded.push(*e),
            (FakeWhat::Kernel("sgd_step"), 0) if first_step.is_none() => first_step = Some(i),
            _ => {}
        }
    }
    let first_step = first_step.expect("the optimizer stepped on the compute stream");
    for e in recorded {
        let waited = r.log.iter().position(
            |op| matches!(op.what, FakeWhat::Wait { event, recorded_on } if event == e && recorded_on == comm),
        );
        let recorded_at = r.log.iter().position(|op| op.what == FakeWhat::Record(e)).unwrap();
        match waited {
            Some(w) => assert!(
                w > recorded_at && (w < first_step || recorded_at > first_step),
                "event {e} of the comm stream was waited on at op {w}, after the optimizer's first kernel at op {first_step}"
            ),
            None => panic!("event {e} of the comm stream was never waited on by the compute stream"),
        }
    }
    kernels
}

fn assert_like_the_host_stream(policy: &str, ordinal: usize) -> Vec<Vec<&'static str>> {
    let device = train(policy, Some(ordinal));
    let host = train(policy, None);
    for (d, h) in device.iter().zip(&host) {
        assert_eq!(d.losses, h.losses, "{policy}: losses");
        assert_eq!(max_diff(&d.params, &h.params), 0.0, "{policy}: parameters");
    }
    device.iter().map(assert_contract).collect()
}

#[test]
fn fp16_casts_and_all_reduces_on_the_comm_stream_behind_each_ready_event() {
    for kernels in assert_like_the_host_stream("fp16", 230) {
        // the division and both casts ran on the comm stream, not on the compute stream
        assert!(kernels.iter().filter(|&&k| k == "to_dtype").count() >= 2, "{kernels:?}");
    }
}

#[test]
fn powersgd_multiplies_and_orthogonalizes_on_the_comm_stream_behind_each_ready_event() {
    for kernels in assert_like_the_host_stream("powersgd:1@0", 232) {
        assert!(kernels.contains(&"matmul"), "{kernels:?}");
    }
}

#[test]
fn zero1_reduce_scatters_behind_each_ready_event_and_gathers_behind_the_shard_step() {
    assert_like_the_host_stream("zero1", 234);
}

#[test]
fn an_fp16_overflow_on_the_device_stream_is_reported_after_the_step_with_no_read_in_backward() {
    use brigade_ddp::policy::{BucketParam, PolicyBucket, Reduction, StepContext};
    use brigade_ddp::ReducerPolicy;
    use brigade_policies::{Compress, HalfType};
    // rank 1 holds a gradient of 2e5: its share (1e5 on 2 ranks) is past fp16's 65504
    let out = run_on_threads(2, |comm| {
        let rank = comm.rank();
        let ordinal = 240 + rank;
        let comm = Arc::new(comm);
        let device = Device::Fake(ordinal);
        let collectives: Group = Arc::new(DeviceGroup::host_staged(device, comm).unwrap());
        let mut g: Vec<f32> = (0..64).map(|i| i as f32 * 0.01).collect();
        if rank == 1 {
            g[17] = 2.0e5;
        }
        let bucket = PolicyBucket {
            index: 3,
            tensor: Tensor::from_vec(g, &[64]).unwrap().to_device(device).unwrap(),
            params: vec![BucketParam {
                index: 0,
                name: "w".into(),
                offset: 0,
                shape: vec![8, 8],
            }],
            grad_numel: 64,
            is_last: true,
            generation: 0,
        };
        let mut fp16 = Compress::new(HalfType::F16);
        fake::reset(ordinal);
        let Reduction::Full(work) = fp16.reduce(bucket, &collectives).unwrap() else {
            panic!("fp16 reduces whole buckets")
        };
        // the reduction itself succeeds: nothing was read back but the staged half bucket
        work.wait().unwrap();
        let staged = fake::counts(ordinal).to_host_bytes;
        let e = fp16
            .after_step(
                &StepContext {
                    params: &[],
                    loss_scale: None,
                },
                &collectives,
            )
            .unwrap_err()
            .to_string();
        (staged, e)
    });
    for r in out {
        let (staged, e) = r.unwrap();
        assert_eq!(staged, 2 * 64, "a host read inside the bucket's reduction");
        assert!(e.contains("overflow in bucket 3") && e.contains("2.0000e5"), "{e}");
    }
}

#[test]
fn the_simulated_link_spins_each_collectives_modelled_time_on_the_comm_stream_before_it() {
    use brigade_comm::NetModel;
    use std::time::Duration;
    // ZeRO-1 at world 2 on one bucket of 64 f32 gradients (one 8 x 8 parameter): the bucket's
    // reduce-scatter (256 bytes in), then the optimizer's all-gather of this rank's 32 updated
    // parameters (128 bytes per rank), each after a delay of its ring model at world 2
    let link = NetModel {
        latency: Duration::from_micros(20),
        bandwidth_bytes_per_s: 1.25e9,
    };
    let logs = run_on_threads(2, |comm| {
        set_compute_threads(1);
        let rank = comm.rank();
        let ordinal = 250 + rank;
        let comm = Arc::new(comm);
        let device = Device::Fake(ordinal);
        let mut store = brigade_autograd::ParamStore::new();
        let w = store
            .add(
                "w".to_string(),
                Tensor::full_on(&[8, 8], 0.5, brigade_tensor::DType::F32, device).unwrap(),
            )
            .unwrap();
        let stream = DeviceGroup::host_staged(device, comm.clone())
            .unwrap()
            .with_simulated_link(Some(link));
        let comm_stream = stream.comm_stream().raw_handle();
        let built = brigade_policies::PolicySpec::Zero1
            .build(&brigade_policies::Registry::new())
            .unwrap();
        let ddp =
            DistributedDataParallel::with_group(&store, comm, Arc::new(stream), DdpConfig::default(), built).unwrap();
        let mut opt = ddp
            .optimizer(optimizer("plain-sgd", store.params().to_vec()), &|p| {
                optimizer("plain-sgd", p)
            })
            .unwrap();
        fake::start_log(ordinal);
        let scale = Tensor::full_on(&[8, 8], (rank + 1) as f64, brigade_tensor::DType::F32, device).unwrap();
        let loss = w
            .mul(&brigade_autograd::Var::constant(scale))
            .unwrap()
            .sum_all()
            .unwrap();
        loss.backward().unwrap();
        brigade_autograd::Optimizer::step(&mut opt).unwrap();
        let log = fake::take_log(ordinal);
        // what the comm stream ran: each delay, then the staged copy out it precedes
        let comm_ops: Vec<FakeWhat> = log
            .into_iter()
            .filter(|op| op.stream == comm_stream && matches!(op.what, FakeWhat::Spin(_) | FakeWhat::ToHost(_)))
            .map(|op| op.what)
            .collect();
        (comm_ops, w.value().to_vec::<f32>().unwrap())
    });
    let want = vec![
        FakeWhat::Spin(link.reduce_scatter_time(256, 2)),
        FakeWhat::ToHost(256),
        FakeWhat::Spin(link.all_gather_time(128, 2)),
        FakeWhat::ToHost(128),
    ];
    for r in logs {
        let (comm_ops, w) = r.unwrap();
        assert_eq!(comm_ops, want);
        // the averaged gradient of w is (1 + 2) / 2 everywhere: one SGD step of 0.1 from 0.5
        assert!(w.iter().all(|&x| (x - (0.5 - 0.1 * 1.5)).abs() < 1e-6), "{w:?}");
    }
}
