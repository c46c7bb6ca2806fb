//! Reducer policies through DDP: hooks see the bucket layout the reducer built, the default
//! hook is today's reduction bit for bit, compression trains close to plain DDP, and a hook's
//! mistakes are typed errors.

use crate::common;

use std::sync::{Arc, Mutex};

use brigade_autograd::{Optimizer, Sgd};
use brigade_comm::{run_on_threads, Communicator, Work};
use brigade_ddp::hooks::{AllReduceHook, CommHook, CompressHook, GradBucket, HalfType, PowerSgdConfig, PowerSgdHook};
use brigade_ddp::{DdpConfig, DdpError, DistributedDataParallel};
use brigade_tensor::set_compute_threads;
use common::{data, max_diff, rows, Mlp};

const WIDTHS: [usize; 4] = [12, 32, 24, 5];
const STEPS: usize = 5;
const PER_RANK: usize = 8;

/// Trains 2 ranks, each with its own `hook()` (small buckets: several per step); each rank's
/// (losses, params).
fn train(hook: impl Fn() -> Arc<dyn CommHook> + Sync) -> Vec<(Vec<f64>, Vec<Vec<f32>>)> {
    let world = 2;
    let (x, y) = data(world * PER_RANK * STEPS, WIDTHS[0], WIDTHS[3], 5);
    run_on_threads(world, |comm| {
        set_compute_threads(1);
        let rank = comm.rank();
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let m = Mlp::new(&WIDTHS, 7);
        let cfg = DdpConfig {
            bucket_cap_mb: 0.0005,
            first_bucket_cap_mb: 0.0001,
            comm_hook: hook(),
            ..DdpConfig::default()
        };
        let _ddp = DistributedDataParallel::new(&m.store, comm, cfg).unwrap();
        let mut opt = Sgd::new(m.store.params().to_vec(), 0.1, 0.0, 0.0);
        let mut losses = vec![];
        for s in 0..STEPS {
            let (xb, yb) = rows(&x, &y, (s * world + rank) * PER_RANK, PER_RANK);
            m.store.zero_grad().unwrap();
            let loss = m.loss(&xb, &yb);
            losses.push(loss.value().item().unwrap());
            loss.backward().unwrap();
            opt.step().unwrap();
        }
        (losses, m.values())
    })
    .into_iter()
    .map(|r| r.unwrap())
    .collect()
}

/// A user's hook: checks the layout it is handed, then does the default reduction.
struct LayoutChecker {
    seen: Mutex<Vec<(usize, usize, Vec<String>, bool)>>,
}

impl CommHook for LayoutChecker {
    fn name(&self) -> String {
        "layout-checker".into()
    }

    fn reduce(&self, comm: &Arc<dyn Communicator>, bucket: GradBucket) -> Work<Vec<f32>> {
        // the parameters tile the buffer exactly, in order
        let mut at = 0;
        for p in &bucket.params {
            assert_eq!(p.offset, at, "{} in bucket {}", p.name, bucket.index);
            at += p.len();
        }
        assert_eq!(at, bucket.buffer.len());
        let names = bucket.params.iter().map(|p| p.name.clone()).collect();
        self.seen
            .lock()
            .unwrap()
            .push((comm.rank(), bucket.index, names, bucket.is_last));
        AllReduceHook.reduce(comm, bucket)
    }
}

#[test]
fn a_users_hook_sees_each_bucket_once_in_order_with_its_layout() {
    let checker = Arc::new(LayoutChecker {
        seen: Mutex::new(vec![]),
    });
    let with_checker = train(|| checker.clone());
    let plain = train(|| Arc::new(AllReduceHook));
    // delegating to the default reduction changes nothing, bit for bit
    assert_eq!(with_checker[0].0, plain[0].0);
    assert_eq!(max_diff(&with_checker[0].1, &plain[0].1), 0.0);
    let all = checker.seen.lock().unwrap();
    assert_eq!(
        all.iter().filter(|s| s.0 == 1).count() * 2,
        all.len(),
        "both ranks hand over the same buckets"
    );
    let seen: Vec<_> = all
        .iter()
        .filter(|s| s.0 == 0)
        .map(|s| (s.1, s.2.clone(), s.3))
        .collect();
    // split rank 0's calls at is_last: one group per step, indices 0..k in order, and each group
    // holds every parameter exactly once (so is_last marked the end of a backward pass)
    let mut groups: Vec<Vec<(usize, Vec<String>)>> = vec![vec![]];
    for (index, names, last) in seen {
        groups.last_mut().unwrap().push((index, names));
        if last {
            groups.push(vec![]);
        }
    }
    assert!(groups.pop().unwrap().is_empty(), "calls after the last is_last");
    assert_eq!(groups.len(), STEPS);
    let mut want: Vec<String> = (0..3)
        .flat_map(|i| [format!("layers.{i}.bias"), format!("layers.{i}.weight")])
        .collect();
    want.sort();
    for g in &groups {
        assert!(g.len() >= 3, "small caps should give several buckets, got {}", g.len());
        assert_eq!(
            g.iter().map(|c| c.0).collect::<Vec<_>>(),
            (0..g.len()).collect::<Vec<_>>(),
            "index order"
        );
        let mut names: Vec<String> = g.iter().flat_map(|c| c.1.clone()).collect();
        names.sort();
        assert_eq!(names, want, "each parameter in exactly one bucket per step");
    }
}

#[test]
fn compressed_hooks_train_within_16_bit_error_of_plain_ddp() {
    let plain = train(|| Arc::new(AllReduceHook));
    for (half, tol) in [(HalfType::F16, 2e-3), (HalfType::BF16, 2e-2)] {
        let got = train(|| Arc::new(CompressHook::new(half)));
        let d = max_diff(&got[0].1, &plain[0].1);
        assert!(d < tol, "{half:?}: parameters moved {d} from plain DDP");
        assert!(d > 0.0, "{half:?}: not a bit changed: the hook did not run");
        assert_eq!(got[0].1, got[1].1, "{half:?}: the ranks disagree");
    }
}

#[test]
fn one_powersgd_hook_shared_by_two_ranks_is_an_error_not_a_hang() {
    let shared: Arc<dyn CommHook> = Arc::new(PowerSgdHook::new(PowerSgdConfig::default()).unwrap());
    let results = run_on_threads(2, |comm| {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let m = Mlp::new(&WIDTHS, 7);
        let _ddp = DistributedDataParallel::new(
            &m.store,
            comm,
            DdpConfig {
                comm_hook: shared.clone(),
                ..DdpConfig::default()
            },
        )
        .unwrap();
        let (x, y) = data(4, WIDTHS[0], WIDTHS[3], 1);
        m.loss(&x, &y)
            .backward()
            .map_err(|e| format!("{e}: {:?}", std::error::Error::source(&e)))
    });
    let errors: Vec<String> = results.into_iter().filter_map(|r| r.unwrap().err()).collect();
    assert!(errors.iter().any(|e| e.contains("one hook per rank")), "{errors:?}");
}

#[test]
fn powersgd_under_ddp_matches_plain_ddp_until_it_starts_and_keeps_ranks_identical() {
    let plain = train(|| Arc::new(AllReduceHook));
    let cfg = PowerSgdConfig {
        rank: 2,
        start_iter: 3,
        ..PowerSgdConfig::default()
    };
    let got = train(|| Arc::new(PowerSgdHook::new(cfg).unwrap()));
    // steps 0..2 reduce plainly (the losses of steps 0..=3 are computed before any compressed update)
    assert_eq!(got[0].0[..4], plain[0].0[..4]);
    assert_ne!(got[0].0[4], plain[0].0[4], "compression changed nothing");
    assert_eq!(got[0].1, got[1].1, "the ranks disagree");
}

/// A hook that forgets an element.
struct Truncating;

impl CommHook for Truncating {
    fn name(&self) -> String {
        "truncating".into()
    }

    fn reduce(&self, comm: &Arc<dyn Communicator>, mut bucket: GradBucket) -> Work<Vec<f32>> {
        bucket.buffer.pop();
        let (w, p) = Work::pending(comm.rank(), "truncating", comm.timeout());
        p.complete(Ok(bucket.buffer));
        w
    }
}

#[test]
fn a_hook_that_returns_the_wrong_length_is_a_typed_error_naming_it() {
    let results = run_on_threads(1, |comm| {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let m = Mlp::new(&WIDTHS, 7);
        let _ddp = DistributedDataParallel::new(
            &m.store,
            comm,
            DdpConfig {
                comm_hook: Arc::new(Truncating),
                ..DdpConfig::default()
            },
        )
        .unwrap();
        let (x, y) = data(4, WIDTHS[0], WIDTHS[3], 1);
        let err = m.loss(&x, &y).backward().unwrap_err();
        // the typed DdpError travels through the bus as the error's source
        let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&err);
        let mut found = None;
        while let Some(e) = source {
            if let Some(d) = e.downcast_ref::<DdpError>() {
                found = Some(d.to_string());
            }
            source = e.source();
        }
        let msg = found.expect("a DdpError in the chain");
        assert!(msg.contains("truncating") && msg.contains("element"), "{msg}");
        // the gradients have storage again: readable, not lent
        assert!(m.store.params()[0].grad().unwrap().to_vec::<f32>().is_ok());
    });
    results.into_iter().for_each(|r| r.unwrap());
}
