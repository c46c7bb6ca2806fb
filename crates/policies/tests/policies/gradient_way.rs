//! One gradient's way, as small as it gets: one parameter, so one bucket, on two thread ranks,
//! reduced by the built-in all-reduce policy and stepped by SGD. The test checks the result;
//! `scripts/gradient-way.sh` runs it under callgrind, which zeroes its counters in
//! [`way_starts`] and dumps them in [`way_ends`], and lists the source files of every function
//! that ran between them, on every thread: from `backward()` to the optimizer's step
//! (docs/ARCHITECTURE.md).

use std::hint::black_box;
use std::sync::{Arc, Barrier};

use brigade_autograd::{Optimizer, ParamStore, Sgd};
use brigade_comm::run_on_threads;
use brigade_ddp::{DdpConfig, DistributedDataParallel};
use brigade_tensor::Tensor;

use crate::common::spec;

/// Both ranks are built and about to call `backward()` (callgrind zeroes its counters here).
#[inline(never)]
fn way_starts() {
    black_box(());
}

/// Both ranks have stepped (callgrind dumps its counters here).
#[inline(never)]
fn way_ends() {
    black_box(());
}

#[test]
fn one_bucket_on_two_thread_ranks_is_averaged_and_stepped() {
    let world = 2;
    let (built, stepped) = (Barrier::new(world), Barrier::new(world));
    let finals = run_on_threads(world, |comm| {
        let rank = comm.rank();
        let mut store = ParamStore::new();
        // rank r's loss is (r + 1) * sum(w): its gradient is r + 1 everywhere, averaged 1.5
        let w = store
            .add("w", Tensor::from_vec(vec![1.0f32; 4], &[4]).unwrap())
            .unwrap();
        let comm = Arc::new(comm);
        // the buckets as built (no rebuild after the first step), the same values on every rank
        let cfg = DdpConfig {
            rebuild_buckets: false,
            broadcast_parameters: false,
            ..DdpConfig::default()
        };
        let ddp = DistributedDataParallel::new(&store, comm, cfg, spec("allreduce")(rank)).unwrap();
        let plain = Box::new(Sgd::new(store.params().to_vec(), 0.5, 0.0, 0.0));
        let mut opt = ddp.optimizer(plain, &|p| Box::new(Sgd::new(p, 0.5, 0.0, 0.0))).unwrap();
        let loss = w.sum_all().unwrap().mul_scalar((rank + 1) as f64).unwrap();
        if built.wait().is_leader() {
            way_starts();
        }
        built.wait();
        loss.backward().unwrap();
        opt.step().unwrap();
        if stepped.wait().is_leader() {
            way_ends();
        }
        w.value().to_vec::<f32>().unwrap()
    });
    for r in finals {
        // one step of 0.5 * 1.5 from 1
        assert_eq!(r.unwrap(), vec![1.0 - 0.75; 4]);
    }
}
