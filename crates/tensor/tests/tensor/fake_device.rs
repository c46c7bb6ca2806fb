//! The counting fake device: it counts every copy in and out and every host wait, refuses
//! host access that bypasses the contract, runs ops on the stream of the current scope, and
//! refuses a stream's access to memory another stream used unless an event (or a host wait)
//! ordered the two. Each test uses a fake ordinal of its own, so the counts are its own.

use brigade_tensor::fake::{self, FakeCounts, FakeWhat};
use brigade_tensor::{DType, Device, Storage, Stream, Tensor, TensorError};

fn fresh(ordinal: usize) -> Device {
    fake::reset(ordinal);
    Device::Fake(ordinal)
}

#[test]
fn copies_in_and_out_and_host_waits_are_counted_and_kernels_are_not_transfers() {
    let d = fresh(101);
    let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[2, 2])
        .unwrap()
        .to_device(d)
        .unwrap();
    let y = x.matmul(&x).unwrap().relu().unwrap().sum_all().unwrap();
    assert_eq!(
        fake::counts(101),
        FakeCounts {
            to_device: 1,
            to_device_bytes: 16,
            kernels: 3,
            ..FakeCounts::default()
        }
    );
    assert_eq!(y.item().unwrap(), 7.0 + 10.0 + 15.0 + 22.0);
    let c = fake::counts(101);
    assert_eq!((c.to_host, c.to_host_bytes), (1, 4), "item is one 4-byte copy out");
    // a strided view is gathered on the device first: one kernel, then the copy out
    assert_eq!(x.t().unwrap().to_vec::<f32>().unwrap(), vec![1.0, 3.0, 2.0, 4.0]);
    let c = fake::counts(101);
    assert_eq!((c.kernels, c.to_host), (4, 2));
    Stream::compute(d).unwrap().synchronize().unwrap();
    assert_eq!(fake::counts(101).host_waits, 1);
    // the same numbers as the CPU (its kernels)
    let cpu = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[2, 2]).unwrap();
    assert_eq!(
        cpu.matmul(&cpu).unwrap().to_vec::<f32>().unwrap(),
        x.matmul(&x).unwrap().to_vec::<f32>().unwrap()
    );
}

#[test]
fn host_tensors_cannot_meet_fake_ones_in_an_op() {
    let d = fresh(102);
    let on_fake = Tensor::zeros_on(&[3], DType::F32, d).unwrap();
    let on_host = Tensor::ones(&[3], DType::F32);
    for e in [
        on_fake.add(&on_host).unwrap_err(),
        on_fake.add_assign(&on_host).unwrap_err(),
        on_host.matmul(&on_fake.reshape(&[3, 1]).unwrap()).unwrap_err(),
    ] {
        assert!(matches!(e, TensorError::DeviceMismatch { .. }), "{e:?}");
    }
    assert_eq!(fake::counts(102).to_host, 0, "nothing was read back");
    let s = Tensor::zeros_on(&[2], DType::F32, d).unwrap().lend_storage().unwrap();
    let e = s.device_memory(&Stream::compute(Device::Cpu).unwrap()).unwrap_err();
    assert!(matches!(e, TensorError::DeviceMismatch { .. }), "{e:?}");
    // a CPU storage has no device handle
    let host = Storage::from_host_vec(vec![1.0f32], Device::Cpu).unwrap();
    assert!(host.device_memory(&Stream::compute(Device::Cpu).unwrap()).is_err());
}

#[test]
fn uploaded_ids_are_checked_without_a_copy_back_and_unknown_ones_are_read() {
    let d = fresh(103);
    let table = Tensor::zeros_on(&[10, 4], DType::F32, d).unwrap();
    let ids = Tensor::from_vec(vec![9i64, 0, 3], &[3]).unwrap().to_device(d).unwrap();
    table.embedding(&ids).unwrap();
    table.embedding(&ids.narrow(0, 1, 2).unwrap()).unwrap();
    assert_eq!(fake::counts(103).to_host, 0, "uploaded ids carry their range");
    // a bad id is still one clear error (read back to name it)
    let bad = Tensor::from_vec(vec![1i64, 10], &[2]).unwrap().to_device(d).unwrap();
    let e = table.embedding(&bad).unwrap_err().to_string();
    assert!(e.contains("index 10 at position 1 is outside 0..10"), "{e}");
    assert_eq!(fake::counts(103).to_host, 1);
    // ids written on the device have no known range: they are read
    let made = Tensor::from_vec(vec![2.0f32, 5.0], &[2]).unwrap().to_device(d).unwrap();
    let made = made.to_dtype(DType::I64).unwrap();
    table.embedding(&made).unwrap();
    assert_eq!(fake::counts(103).to_host, 2);
    let written = Tensor::zeros_on(&[2], DType::I64, d).unwrap();
    written.copy_from(&ids.narrow(0, 0, 2).unwrap()).unwrap();
    table.embedding(&written).unwrap();
    assert_eq!(fake::counts(103).to_host, 3);
}

#[test]
fn topk_indices_feed_a_scatter_add_without_a_copy_back() {
    // a top-k policy's sparse round trip on the device: select, then add back at the indices
    let d = fresh(106);
    let g: Vec<f32> = (0..1000).map(|i| ((i * 7919) % 1000) as f32 - 500.0).collect();
    let g = Tensor::from_vec(g, &[1000]).unwrap().to_device(d).unwrap();
    let (vals, ids) = g.topk(10).unwrap();
    let dense = Tensor::zeros_on(&[1000], DType::F32, d).unwrap();
    let back = dense.scatter_add(0, &ids, &vals).unwrap();
    let back = back.index_add(0, &ids, &vals).unwrap();
    assert_eq!(fake::counts(106).to_host, 0, "the sort's indices carry their range");
    let v = back.to_vec::<f32>().unwrap();
    // 7919 i mod 1000 takes every value once: the ten largest are 490..=499, each added twice
    let mut kept: Vec<f32> = v.into_iter().filter(|&x| x != 0.0).collect();
    kept.sort_by(|a, b| a.partial_cmp(b).unwrap());
    assert_eq!(kept, (490..500).map(|x| 2.0 * x as f32).collect::<Vec<_>>());
}

#[test]
fn a_sort_and_the_gathers_and_scatters_of_its_indices_read_nothing_back() {
    // sort a [rows, n] block, pick the rows' values in sorted order and add a gradient back
    // at them: every index came from the sort (its range known), so nothing is read
    let d = fresh(107);
    let x: Vec<f32> = (0..60).map(|i| ((i * 37) % 60) as f32).collect();
    let x = Tensor::from_vec(x, &[4, 15]).unwrap().to_device(d).unwrap();
    let order = x.argsort(true).unwrap();
    let picked = x.gather(1, &order).unwrap();
    let back = Tensor::zeros_on(&[4, 15], DType::F32, d)
        .unwrap()
        .scatter_add(1, &order, &picked)
        .unwrap();
    let first = order.narrow(1, 0, 1).unwrap().reshape(&[4]).unwrap();
    let cols = x.index_select(1, &first).unwrap();
    let summed = back.index_add(1, &first, &cols).unwrap();
    assert_eq!(fake::counts(107).to_host, 0, "an index of known range is not read");
    assert_eq!(
        picked.sort(true).unwrap().0.to_vec::<f32>().unwrap(),
        picked.to_vec::<f32>().unwrap()
    );
    assert_eq!(back.to_vec::<f32>().unwrap(), x.to_vec::<f32>().unwrap());
    assert_eq!(summed.shape(), &[4, 15]);
}

#[test]
fn ops_run_on_the_scoped_stream_and_an_unordered_access_is_refused() {
    let d = fresh(104);
    let compute = Stream::compute(d).unwrap();
    let side = Stream::new(d).unwrap();
    assert_ne!(side, compute);
    assert_eq!(Stream::current(d).unwrap(), compute);
    fake::start_log(104);
    let x = Tensor::from_vec(vec![1.0f32, -2.0], &[2])
        .unwrap()
        .to_device(d)
        .unwrap();
    let y = x.relu().unwrap(); // compute stream
                               // the side stream reads y without waiting: a race on a GPU, an error here
    let e = side.scope(|| y.neg()).unwrap_err().to_string();
    assert!(e.contains("stream 1 reads memory that stream 0 used"), "{e}");
    // ordered by an event: fine, and logged on the side stream
    let ready = compute.record_event().unwrap();
    side.wait_event(&ready).unwrap();
    let z = side.scope(|| {
        assert_eq!(Stream::current(d).unwrap(), side);
        y.neg().unwrap()
    });
    assert_eq!(Stream::current(d).unwrap(), compute, "the scope ended");
    // compute writing into y while the side stream's read of it is not ordered: refused
    let e = y.fill(0.0).unwrap_err().to_string();
    assert!(e.contains("overwrites memory that stream 1 used"), "{e}");
    let done = side.record_event().unwrap();
    compute.wait_event(&done).unwrap();
    y.fill(0.0).unwrap();
    assert_eq!(z.to_vec::<f32>().unwrap(), vec![-1.0, 0.0]);
    let log = fake::take_log(104);
    let on_side: Vec<&FakeWhat> = log
        .iter()
        .filter(|o| o.stream == side.raw_handle())
        .map(|o| &o.what)
        .collect();
    assert!(
        matches!(
            on_side.as_slice(),
            [
                FakeWhat::Wait { recorded_on: 0, .. },
                FakeWhat::Kernel("unary"),
                FakeWhat::Record(_)
            ]
        ),
        "{on_side:?}"
    );
    // a host wait orders everything before it, for every stream
    let w = side.scope(|| z.neg().unwrap());
    side.synchronize().unwrap();
    w.relu().unwrap();
}

#[test]
fn memory_lent_to_another_stream_is_ordered_and_kept_alive_until_that_stream_is_done() {
    let d = fresh(105);
    let (compute, comm) = (Stream::compute(d).unwrap(), Stream::new(d).unwrap());
    let bucket = Tensor::from_vec(vec![1.0f32; 8], &[8]).unwrap().to_device(d).unwrap();
    let storage = bucket.lend_storage().unwrap();
    // the comm stream must not touch it before the compute stream's ready event
    let e = storage.device_memory(&comm).unwrap_err().to_string();
    assert!(e.contains("reads memory that stream 0 used"), "{e}");
    comm.wait_event(&compute.record_event().unwrap()).unwrap();
    let raw = storage.device_memory(&comm).unwrap();
    assert_eq!((raw.len, raw.dtype, raw.device), (8, DType::F32, d));
    bucket.restore_storage(storage).unwrap();
    // back on the compute stream without waiting for the comm stream's done event: refused
    assert!(bucket.mul_scalar(2.0).is_err());
    compute.wait_event(&comm.record_event().unwrap()).unwrap();
    assert_eq!(bucket.mul_scalar(2.0).unwrap().to_vec::<f32>().unwrap(), vec![2.0; 8]);
    // freed while another stream's use of it is not yet ordered before its own stream: the
    // case CUDA defers (keep-alive); counted here
    let other = Tensor::from_vec(vec![1.0f32; 4], &[4]).unwrap().to_device(d).unwrap();
    comm.wait_event(&compute.record_event().unwrap()).unwrap();
    comm.scope(|| other.neg().unwrap());
    assert_eq!(fake::counts(105).deferred_frees, 0);
    drop(other);
    assert_eq!(fake::counts(105).deferred_frees, 1);
    drop(bucket); // its comm-stream use was waited for: freed at once
    assert_eq!(fake::counts(105).deferred_frees, 1);
}
