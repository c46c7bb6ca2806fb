//! Integer tensors through the collectives, and the sparse all-gather (each rank's values and
//! `I64` indices, of a different count on every rank) on every group that runs it: the host
//! group, metered, and the host-staged device group on the counting fake device.

use std::sync::Arc;
use std::time::Duration;

use brigade_comm::{run_on_threads_with_timeout, CommMeter, ThreadComm};
use brigade_ddp::group::{DeviceGroup, HostGroup, Metered};
use brigade_ddp::{Group, ProcessGroup};
use brigade_tensor::{DType, Device, Tensor};

const TIMEOUT: Duration = Duration::from_secs(20);
const CAPACITY: usize = 5;

/// Rank `r` sends `r + 1` entries (at most `CAPACITY`): values `10r + j`, indices `7r + j`.
fn payload(rank: usize) -> (Vec<f32>, Vec<i64>) {
    let k = rank + 1;
    (
        (0..k).map(|j| (10 * rank + j) as f32).collect(),
        (0..k).map(|j| (7 * rank + j) as i64).collect(),
    )
}

/// Each rank's gathered values, indices and counts, read back to the host.
type Gathered = (Vec<f32>, Vec<i64>, Vec<i64>);

fn gather_on(world: usize, group: impl Fn(Arc<ThreadComm>, usize) -> Group + Sync) -> Vec<Gathered> {
    run_on_threads_with_timeout(world, TIMEOUT, |comm| {
        let rank = comm.rank();
        let g = group(Arc::new(comm), rank);
        let (v, i) = payload(rank);
        let k = v.len();
        let on = |t: Tensor| t.to_device(device_of(&g, rank)).unwrap();
        let values = on(Tensor::from_vec(v, &[k]).unwrap());
        let indices = on(Tensor::from_vec(i, &[k]).unwrap());
        let got = g
            .all_gather_sparse(&values, &indices, CAPACITY, "sparse")
            .wait()
            .unwrap();
        assert_eq!(got.values.shape(), &[world, CAPACITY]);
        assert_eq!(got.indices.shape(), &[world, CAPACITY]);
        assert_eq!(got.indices.dtype(), DType::I64);
        let host = |t: &Tensor| t.to_device(Device::Cpu).unwrap();
        (
            host(&got.values).to_vec::<f32>().unwrap(),
            host(&got.indices).to_vec::<i64>().unwrap(),
            host(&got.counts).to_vec::<i64>().unwrap(),
        )
    })
    .into_iter()
    .map(|r| r.unwrap())
    .collect()
}

fn device_of(g: &Group, rank: usize) -> Device {
    if g.enqueues() {
        Device::Fake(250 + rank)
    } else {
        Device::Cpu
    }
}

/// What every rank must hold: each rank's entries, rank-major, zeros after its count.
fn expected(world: usize) -> Gathered {
    let (mut v, mut i, mut c) = (vec![0.0; world * CAPACITY], vec![0; world * CAPACITY], vec![]);
    for r in 0..world {
        let (rv, ri) = payload(r);
        c.push(rv.len() as i64);
        v[r * CAPACITY..r * CAPACITY + rv.len()].copy_from_slice(&rv);
        i[r * CAPACITY..r * CAPACITY + ri.len()].copy_from_slice(&ri);
    }
    (v, i, c)
}

#[test]
fn a_sparse_all_gather_of_a_different_count_on_each_rank_reaches_every_rank() {
    for world in [2, 3] {
        let got = gather_on(world, |comm, _| Arc::new(HostGroup::new(comm)));
        for (rank, g) in got.iter().enumerate() {
            assert_eq!(g, &expected(world), "world {world} rank {rank}");
        }
    }
}

#[test]
fn a_sparse_all_gather_runs_staged_through_the_host_on_a_device_group() {
    let got = gather_on(3, |comm, rank| {
        Arc::new(DeviceGroup::host_staged(Device::Fake(250 + rank), comm).unwrap())
    });
    for g in &got {
        assert_eq!(g, &expected(3));
    }
}

#[test]
fn a_metered_sparse_all_gather_counts_its_values_indices_and_count() {
    let got = run_on_threads_with_timeout(2, TIMEOUT, |comm| {
        let meter = CommMeter::new();
        let host: Group = Arc::new(HostGroup::new(Arc::new(comm)));
        let g = Metered::new(host, meter.clone());
        let values = Tensor::from_vec(vec![1.0f32, 2.0], &[2]).unwrap();
        let indices = Tensor::from_vec(vec![3i64, 4], &[2]).unwrap();
        g.all_gather_sparse(&values, &indices, 4, "s").wait().unwrap();
        meter.totals().payload_bytes
    });
    for b in got {
        // what goes on the wire: the capacity's values (f32) and indices (i64), and the count
        assert_eq!(b.unwrap(), (4 * 4 + 4 * 8 + 8) as u64);
    }
}

#[test]
fn integer_indices_move_through_an_all_gather_and_a_broadcast() {
    let got = run_on_threads_with_timeout(2, TIMEOUT, |comm| {
        let rank = comm.rank() as i64;
        let g: Group = Arc::new(HostGroup::new(Arc::new(comm)));
        let t = Tensor::from_vec(vec![rank, 1 << 40], &[2]).unwrap();
        let all = g.all_gather(&t, "i64").wait().unwrap().to_vec::<i64>().unwrap();
        let b = Tensor::from_vec(vec![rank + 5], &[1]).unwrap();
        let b = g.broadcast(&b, 1, "b").wait().unwrap().to_vec::<i64>().unwrap();
        (all, b)
    });
    for r in got {
        assert_eq!(r.unwrap(), (vec![0, 1 << 40, 1, 1 << 40], vec![6]));
    }
}

#[test]
fn a_sparse_all_gather_refuses_more_entries_than_its_capacity_and_float_indices() {
    let got = run_on_threads_with_timeout(1, TIMEOUT, |comm| {
        let g: Group = Arc::new(HostGroup::new(Arc::new(comm)));
        let v = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], &[3]).unwrap();
        let i = Tensor::from_vec(vec![0i64, 1, 2], &[3]).unwrap();
        let over = g.all_gather_sparse(&v, &i, 2, "s").wait().err().unwrap().to_string();
        let f = g.all_gather_sparse(&v, &v, 3, "s").wait().err().unwrap().to_string();
        (over, f)
    });
    let (over, f) = got.into_iter().next().unwrap().unwrap();
    assert!(over.contains("capacity 2") && over.contains('3'), "{over}");
    assert!(f.contains("i64"), "{f}");
}
