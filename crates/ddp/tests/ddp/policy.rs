//! The reducer-policy contract through DDP, with policies written here against the public
//! contract only: what a policy is handed (layout, order, generations), what DDP refuses from
//! it (a wrong result, shards under a regrouping layout), uneven inputs (a rank joining with no
//! data), the gradient norm, after-step work, and policy state gathered for a checkpoint.

use crate::common;

use std::sync::{Arc, Mutex};

use brigade_autograd::{Optimizer, Sgd};
use brigade_comm::{run_on_threads, ReduceOp};
use brigade_ddp::policy::{
    BucketLayout, BucketSpan, Group, PerBucket, PolicyBucket, PolicyContext, Reduction, StepContext,
};
use brigade_ddp::{DdpConfig, DdpError, DistributedDataParallel, ReducerPolicy};
use brigade_tensor::{set_compute_threads, DType, Tensor};
use common::{average, data, max_diff, rows, Average, Mlp};

const WIDTHS: [usize; 4] = [12, 32, 24, 5];
const STEPS: usize = 5;
const PER_RANK: usize = 8;

/// Small buckets: several per step.
fn small() -> DdpConfig {
    DdpConfig {
        bucket_cap_mb: 0.0005,
        first_bucket_cap_mb: 0.0001,
        ..DdpConfig::default()
    }
}

/// Trains 2 ranks, each with its own `policy(rank)`, SGD through DDP's optimizer; each rank's
/// (losses, params).
fn train(policy: impl Fn(usize) -> Box<dyn ReducerPolicy> + Sync) -> Vec<(Vec<f64>, Vec<Vec<f32>>)> {
    let world = 2;
    let (x, y) = data(world * PER_RANK * STEPS, WIDTHS[0], WIDTHS[3], 5);
    run_on_threads(world, |comm| {
        set_compute_threads(1);
        let rank = comm.rank();
        let comm = Arc::new(comm);
        let m = Mlp::new(&WIDTHS, 7);
        let ddp = DistributedDataParallel::new(&m.store, comm, small(), policy(rank)).unwrap();
        let full = Box::new(Sgd::new(m.store.params().to_vec(), 0.1, 0.0, 0.0));
        let mut opt = ddp.optimizer(full, &|p| Box::new(Sgd::new(p, 0.1, 0.0, 0.0))).unwrap();
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

/// What a [`LayoutChecker`] saw: rank, bucket, parameter names, is_last, generation.
type Seen = (usize, usize, Vec<String>, bool, u64);

/// A user's policy: checks the bucket it is handed, records it, then averages. Also records
/// every layout DDP announces.
struct LayoutChecker {
    rank: usize,
    seen: Arc<Mutex<Vec<Seen>>>,
    announced: Arc<Mutex<Vec<(usize, u64, usize)>>>,
}

impl ReducerPolicy for LayoutChecker {
    fn name(&self) -> String {
        "layout-checker".into()
    }

    fn buckets_built(&mut self, buckets: &[BucketSpan], generation: u64) -> brigade_ddp::Result<()> {
        self.announced
            .lock()
            .unwrap()
            .push((self.rank, generation, buckets.len()));
        Ok(())
    }

    fn reduce(&mut self, bucket: PolicyBucket, comm: &Group) -> brigade_ddp::Result<Reduction> {
        // the parameters tile the buffer exactly, in order
        let mut at = 0;
        for p in &bucket.params {
            assert_eq!(p.offset, at, "{} in bucket {}", p.name, bucket.index);
            at += p.len();
        }
        assert_eq!(at, bucket.grad_numel);
        assert_eq!(bucket.tensor.numel(), bucket.grad_numel, "no padding asked for");
        let names = bucket.params.iter().map(|p| p.name.clone()).collect();
        self.seen
            .lock()
            .unwrap()
            .push((comm.rank(), bucket.index, names, bucket.is_last, bucket.generation));
        Average.reduce(bucket, comm)
    }
}

#[test]
fn a_users_policy_sees_each_bucket_once_in_order_with_its_layout_and_every_rebuild_announced() {
    let seen = Arc::new(Mutex::new(vec![]));
    let announced = Arc::new(Mutex::new(vec![]));
    let with_checker = train(|rank| {
        Box::new(LayoutChecker {
            rank,
            seen: seen.clone(),
            announced: announced.clone(),
        })
    });
    let plain = train(|_| average());
    // delegating to the averaging reduction changes nothing, bit for bit
    assert_eq!(with_checker[0].0, plain[0].0);
    assert_eq!(max_diff(&with_checker[0].1, &plain[0].1), 0.0);
    // generation 0 at construction, 1 after the rebuild that follows the first iteration
    let mut announced = announced.lock().unwrap().clone();
    announced.sort();
    let gens: Vec<(usize, u64)> = announced.iter().map(|a| (a.0, a.1)).collect();
    assert_eq!(gens, [(0, 0), (0, 1), (1, 0), (1, 1)]);
    let all = seen.lock().unwrap();
    assert_eq!(
        all.iter().filter(|s| s.0 == 1).count() * 2,
        all.len(),
        "both ranks hand over the same buckets"
    );
    // split rank 0's calls at is_last: one group per step, indices 0..k in order, and each group
    // holds every parameter exactly once (so is_last marked the end of a backward pass); the first
    // pass ran under generation 0, every later one under 1
    let mut groups: Vec<Vec<(usize, Vec<String>, u64)>> = vec![vec![]];
    for (_, index, names, last, generation) in all.iter().filter(|s| s.0 == 0).cloned() {
        groups.last_mut().unwrap().push((index, names, generation));
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
    for (step, g) in groups.iter().enumerate() {
        assert!(g.len() >= 3, "small caps should give several buckets, got {}", g.len());
        assert_eq!(
            g.iter().map(|c| c.0).collect::<Vec<_>>(),
            (0..g.len()).collect::<Vec<_>>(),
            "index order"
        );
        assert!(g.iter().all(|c| c.2 == (step > 0) as u64), "step {step}: generation");
        let mut names: Vec<String> = g.iter().flat_map(|c| c.1.clone()).collect();
        names.sort();
        assert_eq!(names, want, "each parameter in exactly one bucket per step");
    }
}

/// A policy that forgets an element of its result.
struct Truncating;

impl ReducerPolicy for Truncating {
    fn name(&self) -> String {
        "truncating".into()
    }

    fn reduce(&mut self, bucket: PolicyBucket, comm: &Group) -> brigade_ddp::Result<Reduction> {
        let short = bucket.tensor.narrow(0, 0, bucket.grad_numel - 1)?.copy()?;
        Ok(Reduction::Full(comm.ready(short)))
    }
}

/// The first [`DdpError`] in `err`'s source chain.
fn ddp_error(err: &(dyn std::error::Error + 'static)) -> String {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = source {
        if let Some(d) = e.downcast_ref::<DdpError>() {
            return d.to_string();
        }
        source = e.source();
    }
    panic!("no DdpError in the chain of {err}");
}

#[test]
fn a_policy_that_returns_the_wrong_length_is_a_typed_error_naming_it() {
    let results = run_on_threads(1, |comm| {
        let comm = Arc::new(comm);
        let m = Mlp::new(&WIDTHS, 7);
        let _ddp = DistributedDataParallel::new(&m.store, comm, DdpConfig::default(), Box::new(Truncating)).unwrap();
        let (x, y) = data(4, WIDTHS[0], WIDTHS[3], 1);
        let err = m.loss(&x, &y).backward().unwrap_err();
        let msg = ddp_error(&err);
        assert!(msg.contains("truncating") && msg.contains("x f32"), "{msg}");
        // the gradients have storage again: readable, not lent
        assert!(m.store.params()[0].grad().unwrap().to_vec::<f32>().is_ok());
    });
    results.into_iter().for_each(|r| r.unwrap());
}

/// Reduces to shards while leaving the layout regroupable: DDP must refuse.
struct ShardsButRegroups;

impl ReducerPolicy for ShardsButRegroups {
    fn name(&self) -> String {
        "shards-but-regroups".into()
    }

    fn layout(&self, ctx: &PolicyContext) -> BucketLayout {
        BucketLayout {
            pad_to: ctx.world_size,
            ..BucketLayout::default()
        }
    }

    fn reduce(&mut self, bucket: PolicyBucket, comm: &Group) -> brigade_ddp::Result<Reduction> {
        Ok(Reduction::Shard {
            shard: comm.reduce_scatter(&bucket.tensor, ReduceOp::Avg, &bucket.tag()),
            keep_full: true,
        })
    }
}

#[test]
fn shards_under_a_layout_that_may_be_regrouped_are_refused() {
    let out = run_on_threads(2, |comm| {
        let m = Mlp::new(&WIDTHS, 7);
        let _ddp = DistributedDataParallel::new(
            &m.store,
            Arc::new(comm),
            DdpConfig::default(),
            Box::new(ShardsButRegroups),
        )
        .unwrap();
        let (x, y) = data(4, WIDTHS[0], WIDTHS[3], 1);
        ddp_error(&m.loss(&x, &y).backward().unwrap_err())
    });
    for msg in out {
        let msg = msg.unwrap();
        assert!(msg.contains("regroup") && msg.contains("shards"), "{msg}");
    }
}

/// Keeps one number per bucket index in a [`PerBucket`], and records whether the state it found
/// belonged to this bucket's parameters.
struct PerBucketState {
    state: PerBucket<Vec<String>>,
    stale: Arc<Mutex<usize>>,
    found: Arc<Mutex<usize>>,
}

impl ReducerPolicy for PerBucketState {
    fn name(&self) -> String {
        "per-bucket".into()
    }

    fn reduce(&mut self, bucket: PolicyBucket, comm: &Group) -> brigade_ddp::Result<Reduction> {
        let names: Vec<String> = bucket.params.iter().map(|p| p.name.clone()).collect();
        if let Some(kept) = self.state.get(&bucket) {
            *self.found.lock().unwrap() += 1;
            if *kept != names {
                *self.stale.lock().unwrap() += 1;
            }
        }
        self.state.insert(&bucket, names);
        Average.reduce(bucket, comm)
    }
}

#[test]
fn per_bucket_state_never_outlives_the_layout_it_was_stored_under() {
    // The first iteration's buckets (reverse registration order) and the rebuilt ones (ready
    // order) hold different parameters under the same indices; state kept in a PerBucket is
    // dropped at the rebuild, never read for the wrong parameters.
    let (stale, found) = (Arc::new(Mutex::new(0)), Arc::new(Mutex::new(0)));
    train(|_| {
        Box::new(PerBucketState {
            state: PerBucket::new(),
            stale: stale.clone(),
            found: found.clone(),
        })
    });
    assert_eq!(*stale.lock().unwrap(), 0, "state read under another layout");
    assert!(*found.lock().unwrap() > 0, "state was never kept: the test cannot tell");
    // what a plain map keyed by bucket index would have done: the rebuild moved parameters
    let before = run_on_threads(1, |comm| {
        let m = Mlp::new(&WIDTHS, 7);
        let ddp = DistributedDataParallel::new(&m.store, Arc::new(comm), small(), average()).unwrap();
        let first = ddp.buckets();
        let (x, y) = data(4, WIDTHS[0], WIDTHS[3], 1);
        m.loss(&x, &y).backward().unwrap();
        (first, ddp.buckets())
    });
    let (first, rebuilt) = before.into_iter().next().unwrap().unwrap();
    assert_ne!(
        first.iter().map(|b| &b.params).collect::<Vec<_>>(),
        rebuilt.iter().map(|b| &b.params).collect::<Vec<_>>(),
        "the rebuild kept every bucket: the test cannot tell"
    );
}

#[test]
fn a_rank_without_data_joins_with_zeros_and_every_rank_keeps_the_same_parameters() {
    // 3 ranks; rank 2 has no data from step 2 on. PyTorch's Join (divide by the initial world
    // size): each step's gradient is the sum over the ranks with data divided by 3. Replayed here
    // in one process: per step, the sum of the ranks' gradients (computed one after the other)
    // divided by 3.
    let world = 3;
    let has_data = |rank: usize, step: usize| rank < 2 || step < 2;
    let (x, y) = data(world * PER_RANK * STEPS, WIDTHS[0], WIDTHS[3], 9);
    let lr = 0.1;
    let replay = |divisor: f32| {
        let m = Mlp::new(&WIDTHS, 7);
        for s in 0..STEPS {
            let mut sum: Vec<Vec<f32>> = m.values().iter().map(|v| vec![0.0; v.len()]).collect();
            for r in (0..world).filter(|&r| has_data(r, s)) {
                let (xb, yb) = rows(&x, &y, (s * world + r) * PER_RANK, PER_RANK);
                m.store.zero_grad().unwrap();
                m.loss(&xb, &yb).backward().unwrap();
                for (acc, p) in sum.iter_mut().zip(m.store.params()) {
                    let g = p.grad().unwrap().to_vec::<f32>().unwrap();
                    acc.iter_mut().zip(g).for_each(|(a, g)| *a += g);
                }
            }
            for (acc, p) in sum.iter().zip(m.store.params()) {
                let v = p.value();
                let new: Vec<f32> = v
                    .to_vec::<f32>()
                    .unwrap()
                    .iter()
                    .zip(acc)
                    .map(|(w, g)| w - (lr as f32) * (g / divisor))
                    .collect();
                v.copy_from(&Tensor::from_vec(new, v.shape()).unwrap()).unwrap();
            }
        }
        m.values()
    };
    let reference = replay(world as f32);
    let ranks = run_on_threads(world, |comm| {
        set_compute_threads(1);
        let rank = comm.rank();
        let m = Mlp::new(&WIDTHS, 7);
        let ddp = DistributedDataParallel::new(&m.store, Arc::new(comm), small(), average()).unwrap();
        let full = Box::new(Sgd::new(m.store.params().to_vec(), lr, 0.0, 0.0));
        let mut opt = ddp.optimizer(full, &|p| Box::new(Sgd::new(p, lr, 0.0, 0.0))).unwrap();
        for s in 0..STEPS {
            m.store.zero_grad().unwrap();
            if has_data(rank, s) {
                let (xb, yb) = rows(&x, &y, (s * world + rank) * PER_RANK, PER_RANK);
                m.loss(&xb, &yb).backward().unwrap();
            } else {
                ddp.join().unwrap();
            }
            opt.step().unwrap();
        }
        m.values()
    });
    let ranks: Vec<_> = ranks.into_iter().map(|r| r.unwrap()).collect();
    for r in &ranks[1..] {
        assert_eq!(max_diff(r, &ranks[0]), 0.0, "the ranks disagree");
    }
    // the sums run in another order than the ring's: f32 rounding apart
    let d = max_diff(&ranks[0], &reference);
    assert!(d < 1e-6, "joined training differs from the replay by {d}");
    // dividing by the ranks that had data instead (2, not 3) would have shown
    let d = max_diff(&ranks[0], &replay(2.0));
    assert!(d > 1e-4, "the test cannot tell the divisors apart ({d})");
}

#[test]
fn the_gradient_norm_is_that_of_the_averaged_gradients() {
    let out = run_on_threads(2, |comm| {
        let rank = comm.rank();
        let m = Mlp::new(&WIDTHS, 7);
        let ddp = DistributedDataParallel::new(&m.store, Arc::new(comm), small(), average()).unwrap();
        let (x, y) = data(16, WIDTHS[0], WIDTHS[3], 2);
        let (xb, yb) = rows(&x, &y, rank * 8, 8);
        m.loss(&xb, &yb).backward().unwrap();
        let by_hand: f64 = m
            .store
            .params()
            .iter()
            .flat_map(|p| p.grad().unwrap().to_vec::<f32>().unwrap())
            .map(|g| (g as f64) * (g as f64))
            .sum();
        (ddp.grad_norm_sq().unwrap(), by_hand)
    });
    for r in out {
        let (norm, by_hand) = r.unwrap();
        assert!((norm - by_hand).abs() <= 1e-12 * by_hand, "{norm} vs {by_hand}");
        assert!(by_hand > 0.0);
    }
}

/// Counts its after-step calls and keeps one number of state per rank (its rank plus the
/// reductions it ran), to check what DDP does with policy state and after-step work.
struct Stateful {
    rank: usize,
    reductions: u64,
    after: u64,
}

impl ReducerPolicy for Stateful {
    fn name(&self) -> String {
        "stateful".into()
    }

    fn reduce(&mut self, bucket: PolicyBucket, comm: &Group) -> brigade_ddp::Result<Reduction> {
        self.reductions += 1;
        Average.reduce(bucket, comm)
    }

    fn after_step(&mut self, _step: &StepContext<'_>, _comm: &Group) -> brigade_ddp::Result<()> {
        self.after += 1;
        Ok(())
    }

    fn keeps_state(&self) -> brigade_ddp::KeepsState {
        brigade_ddp::KeepsState::InStateDict
    }

    fn state_dict(&self) -> brigade_ddp::Result<Vec<(String, Tensor)>> {
        let v = vec![self.rank as i64, self.reductions as i64, self.after as i64];
        Ok(vec![("counts".into(), Tensor::from_vec(v, &[3])?)])
    }

    fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> brigade_ddp::Result<()> {
        let v = state[0].1.to_vec::<i64>()?;
        assert_eq!(v[0] as usize, self.rank, "rank {} got rank {}'s state", self.rank, v[0]);
        (self.reductions, self.after) = (v[1] as u64, v[2] as u64);
        Ok(())
    }
}

#[test]
fn policy_state_is_gathered_on_rank_0_per_rank_and_restored_to_each_rank() {
    let world = 2;
    let saved = run_on_threads(world, |comm| {
        let rank = comm.rank();
        let m = Mlp::new(&WIDTHS, 7);
        let policy = Box::new(Stateful {
            rank,
            reductions: 0,
            after: 0,
        });
        let ddp = DistributedDataParallel::new(&m.store, Arc::new(comm), small(), policy).unwrap();
        let full = Box::new(Sgd::new(m.store.params().to_vec(), 0.1, 0.0, 0.0));
        let mut opt = ddp.optimizer(full, &|p| Box::new(Sgd::new(p, 0.1, 0.0, 0.0))).unwrap();
        let (x, y) = data(8 * world, WIDTHS[0], WIDTHS[3], 2);
        let (xb, yb) = rows(&x, &y, rank * 8, 8);
        for _ in 0..3 {
            m.store.zero_grad().unwrap();
            m.loss(&xb, &yb).backward().unwrap();
            opt.step().unwrap();
        }
        let mine = ddp.policy_state_dict().unwrap()[0].1.to_vec::<i64>().unwrap();
        (ddp.gather_policy_state().unwrap(), mine)
    });
    let saved: Vec<_> = saved.into_iter().map(|r| r.unwrap()).collect();
    let gathered = saved[0].0.clone();
    assert!(saved[1].0.is_empty(), "only rank 0 holds the gathered state");
    let names: Vec<&str> = gathered.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(names, ["rank0/counts", "rank1/counts"]);
    // every rank reads the same file and takes its own entry back
    let restored = run_on_threads(world, |comm| {
        let rank = comm.rank();
        let m = Mlp::new(&WIDTHS, 7);
        let policy = Box::new(Stateful {
            rank,
            reductions: 0,
            after: 0,
        });
        let ddp = DistributedDataParallel::new(&m.store, Arc::new(comm), small(), policy).unwrap();
        ddp.load_gathered_policy_state(&gathered).unwrap();
        ddp.policy_state_dict().unwrap()[0].1.to_vec::<i64>().unwrap()
    });
    for (rank, r) in restored.into_iter().enumerate() {
        let r = r.unwrap();
        assert_eq!(r, saved[rank].1, "rank {rank}");
        assert_eq!(
            (r[0], r[2]),
            (rank as i64, 3),
            "rank {rank}: its own entry, three steps"
        );
        assert!(r[1] >= 9, "rank {rank}: {} reductions", r[1]);
    }
    // a group of another size refuses it in one line
    let other = run_on_threads(1, |comm| {
        let m = Mlp::new(&WIDTHS, 7);
        let policy = Box::new(Stateful {
            rank: 0,
            reductions: 0,
            after: 0,
        });
        let ddp = DistributedDataParallel::new(&m.store, Arc::new(comm), small(), policy).unwrap();
        ddp.load_gathered_policy_state(&gathered).unwrap_err().to_string()
    });
    let e = other.into_iter().next().unwrap().unwrap();
    assert!(e.contains("rank1/counts") && e.contains("group of 1"), "{e}");
    // and a policy that keeps no state refuses state saved for another
    let e = run_on_threads(1, |comm| {
        let m = Mlp::new(&WIDTHS, 7);
        let ddp = DistributedDataParallel::new(&m.store, Arc::new(comm), small(), average()).unwrap();
        ddp.load_policy_state_dict(&[("counts".into(), Tensor::zeros(&[3], DType::I64))])
            .unwrap_err()
            .to_string()
    });
    let e = e.into_iter().next().unwrap().unwrap();
    assert!(e.contains("average") && e.contains("counts"), "{e}");
}

#[test]
fn ddps_optimizer_lists_the_parameters_its_inner_optimizer_steps() {
    run_on_threads(2, |comm| {
        let comm = Arc::new(comm);
        let m = Mlp::new(&WIDTHS, 7);
        let ddp = DistributedDataParallel::new(&m.store, comm, small(), average()).unwrap();
        let full = Box::new(Sgd::new(m.store.params().to_vec(), 0.1, 0.0, 0.0));
        let opt = ddp.optimizer(full, &|p| Box::new(Sgd::new(p, 0.1, 0.0, 0.0))).unwrap();
        let names = |ps: &[brigade_autograd::Var]| ps.iter().map(|p| p.name().map(str::to_string)).collect::<Vec<_>>();
        assert_eq!(names(opt.params()), names(m.store.params()));
    })
    .into_iter()
    .for_each(|r| r.unwrap());
}
