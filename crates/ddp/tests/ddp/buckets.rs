//! Buckets as measured from the outside: where the gradients' memory is, and the one
//! rebuild after the first iteration, identical on every rank.

use crate::common;

use std::collections::BTreeMap;
use std::sync::Arc;

use brigade_autograd::{ParamStore, Var};
use brigade_comm::{run_on_threads, Communicator, Recorder};
use brigade_ddp::{BucketInfo, DdpConfig, DistributedDataParallel};
use brigade_tensor::{set_compute_threads, DType, Rng, Tensor};
use common::{data, rows, Mlp};

/// Where a gradient lives: the address and length of its whole storage (not just the view),
/// and the element range the view covers in it.
#[derive(Debug)]
struct Placement {
    name: String,
    storage: (usize, usize),
    range: (usize, usize),
}

fn placement(p: &Var) -> Placement {
    let g = p
        .grad()
        .unwrap_or_else(|| panic!("{} has no gradient", p.name().unwrap()));
    let (storage, offset, contiguous) = (
        (g.storage_id(), g.storage_numel()),
        g.layout().offset(),
        g.is_contiguous(),
    );
    assert!(contiguous, "{}: the gradient view is not contiguous", p.name().unwrap());
    Placement {
        name: p.name().unwrap().to_string(),
        storage,
        range: (offset, offset + g.numel()),
    }
}

/// Measures, from the tensors themselves: every gradient is a view into one of the bucket
/// storages, each storage is tiled exactly by its views in the bucket's order (no gap, no
/// overlap, nothing else), the storages are the buckets, and they add up to one copy of the
/// gradients.
fn assert_gradients_live_in_the_buckets(params: &[Var], buckets: &[BucketInfo], what: &str) {
    let mut by_storage: BTreeMap<(usize, usize), Vec<Placement>> = BTreeMap::new();
    for p in params {
        let pl = placement(p);
        by_storage.entry(pl.storage).or_default().push(pl);
    }
    assert_eq!(
        by_storage.len(),
        buckets.len(),
        "{what}: gradient storages vs buckets: {by_storage:?}"
    );
    let mut total = 0;
    for ((_, len), mut views) in by_storage {
        views.sort_by_key(|v| v.range);
        let mut end = 0;
        for v in &views {
            assert_eq!(
                v.range.0, end,
                "{what}: {} starts at {} in its bucket, the previous view ended at {end}",
                v.name, v.range.0
            );
            end = v.range.1;
        }
        assert_eq!(end, len, "{what}: views cover {end} of their bucket's {len} elements");
        let names: Vec<String> = views.into_iter().map(|v| v.name).collect();
        let bucket = buckets.iter().find(|b| b.params == names);
        let bucket = bucket.unwrap_or_else(|| panic!("{what}: no bucket holds exactly {names:?}: {buckets:?}"));
        assert_eq!(bucket.bytes, len * 4, "{what}: {names:?}");
        total += len;
    }
    let numel: usize = params.iter().map(|p| p.value().numel()).sum();
    assert_eq!(
        total, numel,
        "{what}: the buckets hold exactly one copy of the gradients"
    );
}

#[test]
fn gradients_live_in_the_buckets_only() {
    let results = run_on_threads(2, |comm| {
        set_compute_threads(1);
        let rank = comm.rank();
        let m = Mlp::new(&[10, 20, 20, 4], 3);
        let cfg = DdpConfig {
            bucket_cap_mb: 0.001,
            first_bucket_cap_mb: 0.0005,
            ..DdpConfig::default()
        };
        let ddp = DistributedDataParallel::new(&m.store, Arc::new(comm), cfg, common::average()).unwrap();
        let (x, y) = data(8, 10, 4, 2);
        assert!(ddp.buckets().len() > 1);
        assert_gradients_live_in_the_buckets(m.store.params(), &ddp.buckets(), "at construction");
        for step in 0..3 {
            let (xb, yb) = rows(&x, &y, rank * 4, 4);
            m.store.zero_grad().unwrap();
            m.loss(&xb, &yb).backward().unwrap();
            // after step 0 the buckets were rebuilt: the new ones must hold the gradients alone
            assert_gradients_live_in_the_buckets(
                m.store.params(),
                &ddp.buckets(),
                &format!("rank {rank} after step {step}"),
            );
        }
    });
    for r in results {
        r.unwrap();
    }
}

/// Four layers in two branches, registered `b0 b1 a0 a1` (so reverse registration order is
/// `a1 a0 b1 b0`). The branch computed last runs its backward first, so a rank that
/// computes `a` first becomes ready in the order `b1 b0 a1 a0`, and one that computes `b`
/// first in `a1 a0 b1 b0`.
struct Branches {
    store: ParamStore,
}

impl Branches {
    fn new(seed: u64) -> Branches {
        let mut rng = Rng::new(seed);
        let mut store = ParamStore::new();
        for (name, shape) in [("b0", [8, 6]), ("b1", [3, 8]), ("a0", [8, 6]), ("a1", [3, 8])] {
            store
                .add(name, Tensor::rand_uniform(&shape, -0.4, 0.4, DType::F32, &mut rng))
                .unwrap();
        }
        Branches { store }
    }

    fn loss(&self, x: &Tensor, y: &Tensor, a_first: bool) -> Var {
        let x = Var::constant(x.clone());
        let branch = |l0: &str, l1: &str| {
            let p = |n: &str| self.store.get(n).unwrap().clone();
            x.linear(&p(l0), None)
                .unwrap()
                .relu()
                .unwrap()
                .linear(&p(l1), None)
                .unwrap()
        };
        let logits = if a_first {
            let a = branch("a0", "a1");
            a.add(&branch("b0", "b1")).unwrap()
        } else {
            let b = branch("b0", "b1");
            branch("a0", "a1").add(&b).unwrap()
        };
        logits.cross_entropy(y).unwrap()
    }
}

#[test]
fn buckets_are_rebuilt_exactly_once_from_rank_0s_ready_order_on_every_rank() {
    let recorder = Recorder::new();
    let (x, y) = data(2 * 4 * 4, 6, 3, 9);
    let results = run_on_threads(2, |comm| {
        set_compute_threads(1);
        let rank = comm.rank();
        let m = Branches::new(5);
        let comm = Arc::new(comm.traced(recorder.clone()));
        // 200-byte buckets: each holds one or two of the parameters (128 or 192 bytes each)
        let cfg = DdpConfig {
            bucket_cap_mb: 200.0 / 1048576.0,
            first_bucket_cap_mb: 200.0 / 1048576.0,
            ..DdpConfig::default()
        };
        let ddp = DistributedDataParallel::new(&m.store, comm, cfg, common::average()).unwrap();
        let initial = ddp.buckets();
        let mut layouts = vec![];
        let mut orders = vec![];
        for step in 0..4 {
            let (xb, yb) = rows(&x, &y, step * 8 + rank * 4, 4);
            m.store.zero_grad().unwrap();
            // rank 0 computes branch a first, rank 1 branch b: their ready orders differ
            m.loss(&xb, &yb, rank == 0).backward().unwrap();
            layouts.push(ddp.buckets());
            orders.push(ddp.last_ready_order());
        }
        (initial, layouts, orders, ddp.buckets_rebuilt())
    });
    let results: Vec<_> = results.into_iter().map(|r| r.unwrap()).collect();
    let names = |bs: &[BucketInfo]| -> Vec<String> { bs.iter().flat_map(|b| b.params.clone()).collect() };
    let (initial, _, orders0, _) = &results[0];
    assert_eq!(
        names(initial),
        ["a1", "a0", "b1", "b0"],
        "reverse registration order at first"
    );
    // the premise: the ranks' ready orders differ
    assert_eq!(orders0[0], ["b1", "b0", "a1", "a0"]);
    assert_eq!(results[1].2[0], ["a1", "a0", "b1", "b0"]);
    for (rank, (_, layouts, orders, rebuilt)) in results.iter().enumerate() {
        assert!(rebuilt, "rank {rank}");
        // rebuilt after the first step from rank 0's order, and never again
        for (step, layout) in layouts.iter().enumerate() {
            assert_eq!(names(layout), orders0[0], "rank {rank} step {step}: bucket order");
            assert_eq!(
                layout, &results[0].1[step],
                "rank {rank} step {step}: every rank has rank 0's layout"
            );
        }
        assert_eq!(orders.len(), 4);
        let rebuilds = recorder
            .events()
            .iter()
            .filter(|e| e.rank == rank && e.name == "ddp.rebuild_buckets")
            .count();
        assert_eq!(rebuilds, 1, "rank {rank}: rebuilds over 4 steps");
    }
}

/// DDP built on a recorded grouping (a checkpoint's) holds those buckets from the start and
/// rebuilds no more; under other caps it regroups the recorded order by them; a grouping that
/// does not fit the model is one error naming the parameter.
#[test]
fn a_recorded_grouping_is_the_buckets_and_is_never_rebuilt() {
    let caps = DdpConfig {
        bucket_cap_mb: 0.001,
        first_bucket_cap_mb: 0.0005,
        ..DdpConfig::default()
    };
    let results = run_on_threads(2, move |comm| {
        set_compute_threads(1);
        let comm = Arc::new(comm);
        let rank = comm.rank();
        let (x, y) = data(8, 10, 4, 2);
        let step = |m: &Mlp| {
            let (xb, yb) = rows(&x, &y, rank * 4, 4);
            m.store.zero_grad().unwrap();
            m.loss(&xb, &yb).backward().unwrap();
        };
        let names = |ddp: &DistributedDataParallel| ddp.buckets().into_iter().map(|b| b.params).collect::<Vec<_>>();
        let m = Mlp::new(&[10, 20, 20, 4], 3);
        let ddp = DistributedDataParallel::new(&m.store, comm.clone(), caps.clone(), common::average()).unwrap();
        assert_eq!(ddp.bucket_grouping(), None, "nothing to record before the rebuild");
        step(&m);
        let recorded = ddp.bucket_grouping().expect("rebuilt after the first step");
        assert_eq!(recorded.buckets, names(&ddp));
        assert_eq!((recorded.caps_mb, recorded.generation), ((0.001, 0.0005), 1));
        drop(ddp);

        // the same caps: the recorded buckets, generation and all, and no rebuild after a step
        let m = Mlp::new(&[10, 20, 20, 4], 3);
        let cfg = DdpConfig {
            grouping: Some(recorded.clone()),
            ..caps.clone()
        };
        let ddp = DistributedDataParallel::new(&m.store, comm.clone(), cfg, common::average()).unwrap();
        assert!(ddp.buckets_rebuilt());
        assert_eq!(names(&ddp), recorded.buckets);
        step(&m);
        assert_eq!(ddp.bucket_grouping(), Some(recorded.clone()));
        assert_gradients_live_in_the_buckets(m.store.params(), &ddp.buckets(), "on the recorded grouping");
        drop(ddp);

        // other caps: the recorded order, grouped by them (one bucket), a new generation
        let m = Mlp::new(&[10, 20, 20, 4], 3);
        let cfg = DdpConfig {
            grouping: Some(recorded.clone()),
            ..DdpConfig::default()
        };
        let ddp = DistributedDataParallel::new(&m.store, comm.clone(), cfg, common::average()).unwrap();
        let order: Vec<String> = recorded.buckets.concat();
        assert_eq!(names(&ddp), vec![order]);
        assert_eq!(ddp.bucket_grouping().map(|g| g.generation), Some(2));
        drop(ddp);

        // a grouping of another model
        let mut other = recorded.clone();
        other.buckets[0][0] = "layers.9.weight".into();
        let m = Mlp::new(&[10, 20, 20, 4], 3);
        let cfg = DdpConfig {
            grouping: Some(other),
            ..caps.clone()
        };
        let e = DistributedDataParallel::new(&m.store, comm, cfg, common::average())
            .err()
            .expect("a grouping naming no parameter")
            .to_string();
        assert!(!e.contains('\n') && e.contains("'layers.9.weight'"), "{e}");
    });
    for r in results {
        r.unwrap();
    }
}
