//! Uneven inputs (PyTorch's `Join`): ranks whose data ends early join the others' collectives with
//! zeros. Every run here is checked against one process that trains on exactly the batches the
//! ranks with data see, with the mode's divisor; every run is bounded by a deadline far below
//! the collective timeout, so a rank left waiting fails the test instead of hanging it.

use std::path::Path;
use std::sync::{mpsc, Arc};
use std::time::Duration;

use brigade::comm::EventKind;
use brigade::config::CheckpointConfig;
use brigade::ddp::DdpConfig;
use brigade::ddp::{bucket_of, Phase};
use brigade::join::JoinMode;
use brigade::launch::{run_ranks, LaunchConfig};
use brigade::models::{Dataset, Mlp, MlpConfig, Model};
use brigade::policies::PolicySpec;
use brigade::source::{DataOrder, RankShards};
use brigade::trainer::{Trainer, JOIN_SPAN};
use brigade::{fit, Error, OptimizerConfig, RunReport, TrainConfig};

const WIDTHS: [usize; 3] = [6, 16, 3];
const BATCH: usize = 8;
/// How long a test may take: far below the collectives' timeout (two minutes), so that a rank
/// left waiting in a collective fails the test here.
const DEADLINE: Duration = Duration::from_secs(40);

/// Runs `f` on its own thread and fails the test if it takes longer than [`DEADLINE`].
fn within_deadline<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(DEADLINE) {
        Ok(v) => v,
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("the run hung: no result within {DEADLINE:?}"),
        Err(mpsc::RecvTimeoutError::Disconnected) => panic!("the run panicked"),
    }
}

/// Rank r's shard: `rows[r]` rows of its own (different data on every rank).
fn shards(rows: &[usize]) -> Vec<Dataset> {
    rows.iter()
        .enumerate()
        .map(|(r, &n)| Dataset::teacher(n, WIDTHS[0], WIDTHS[2], 10 + r as u64).unwrap())
        .collect()
}

fn sgd() -> OptimizerConfig {
    OptimizerConfig::Sgd {
        lr: 0.1,
        momentum: 0.9,
        weight_decay: 0.0,
    }
}

fn config(steps: usize, join: Option<JoinMode>, policy: PolicySpec, optimizer: OptimizerConfig) -> TrainConfig {
    let mut c = TrainConfig::new(steps, BATCH, optimizer);
    c.model.name = "mlp".into();
    c.runtime.compute_threads = Some(1);
    c.data.join = join;
    c.distributed.get_or_insert_default().policy = Arc::new(policy);
    // several buckets of this small model (its first layer alone is 384 bytes)
    c.distributed.get_or_insert_default().ddp = DdpConfig {
        bucket_cap_mb: 0.0004,
        first_bucket_cap_mb: 0.0004,
        ..DdpConfig::default()
    };
    c
}

fn model() -> brigade::Result<Box<dyn Model>> {
    Ok(Box::new(Mlp::new(MlpConfig::new(WIDTHS.to_vec()), 0)?))
}

fn run(rows: &[usize], cfg: TrainConfig) -> brigade::Result<RunReport> {
    let (world, data) = (rows.len(), shards(rows));
    within_deadline(move || {
        fit(
            &LaunchConfig::threads(world),
            &cfg,
            |_| Ok(RankShards::new(data)),
            |_| model(),
        )
    })
}

/// One process training on exactly the batches the ranks with data see: at step `s`, every
/// rank whose shard still holds a whole step contributes the gradient of its microbatches
/// (rows from `(s * accum + j) * BATCH`, each loss scaled by `1/accum`), and the sum is divided
/// by the world size (`DivideInitial`) or by the number of ranks with data (`DivideActive`).
/// Returns the final parameters and each step's loss (the mean over the ranks with data).
fn replay(rows: &[usize], cfg: &TrainConfig) -> (Vec<(String, Vec<f64>)>, Vec<f64>) {
    let data = shards(rows);
    let (world, k) = (rows.len(), cfg.data.accum);
    let steps_of: Vec<usize> = rows.iter().map(|n| n / (BATCH * k)).collect();
    let m = model().unwrap();
    let params = m.params().params().to_vec();
    let mut opt = cfg.recipe.optimizer.build(params.clone());
    let mut losses = vec![];
    for s in 0..cfg.recipe.steps {
        let active: Vec<usize> = (0..world).filter(|&r| s < steps_of[r]).collect();
        if active.is_empty() {
            break;
        }
        let divisor = match cfg.data.join {
            Some(JoinMode::DivideActive) => active.len(),
            _ => world,
        } as f64;
        let mut sum: Vec<Vec<f64>> = params.iter().map(|p| vec![0.0; p.value().numel()]).collect();
        let mut loss = 0.0;
        for &r in &active {
            for j in 0..k {
                m.params().zero_grad().unwrap();
                let batch = data[r].batch((s * k + j) * BATCH, BATCH).unwrap();
                let l = m.loss(&batch).unwrap().mul_scalar(1.0 / k as f64).unwrap();
                loss += l.value().to_f64_vec().unwrap()[0];
                l.backward().unwrap();
                for (acc, p) in sum.iter_mut().zip(&params) {
                    let g = p.grad().unwrap().to_f64_vec().unwrap();
                    acc.iter_mut().zip(g).for_each(|(a, g)| *a += g);
                }
            }
        }
        for (acc, p) in sum.iter().zip(&params) {
            let g = p.grad().unwrap();
            let mean: Vec<f32> = acc.iter().map(|a| (a / divisor) as f32).collect();
            g.copy_from(&brigade::tensor::Tensor::from_vec(mean, g.shape()).unwrap())
                .unwrap();
        }
        opt.step().unwrap();
        losses.push(loss / active.len() as f64);
    }
    let params = m
        .params()
        .named_values()
        .into_iter()
        .map(|(n, t)| (n, t.to_f64_vec().unwrap()))
        .collect();
    (params, losses)
}

/// The largest difference between the run's final parameters (rank 0's) and `expected`.
fn max_diff(report: &RunReport, expected: &[(String, Vec<f64>)]) -> f64 {
    assert_eq!(report.outcome.params.len(), expected.len());
    let mut worst = 0.0f64;
    for ((name, t), (en, e)) in report.outcome.params.iter().zip(expected) {
        assert_eq!(name, en);
        for (a, b) in t.to_f64_vec().unwrap().iter().zip(e) {
            worst = worst.max((a - b).abs());
        }
    }
    worst
}

/// Runs `cfg` on shards of `rows` and checks it against the replay (to `tol`), that the
/// divisor matters (the other divisor's replay is far off), and what the outcome reports.
fn check_against_replay(rows: &[usize], cfg: TrainConfig, tol: f64) -> RunReport {
    let (expected, losses) = replay(rows, &cfg);
    let report = run(rows, cfg.clone()).unwrap();
    assert!(report.outcome.stopped.is_none(), "{:?}", report.outcome.stopped);
    // each step's loss is the mean over the ranks with data (agreed in f32)
    assert_eq!(report.outcome.losses().len(), losses.len());
    for (s, (a, b)) in report.outcome.losses().iter().zip(&losses).enumerate() {
        assert!(
            (a - b).abs() < 1e-5 * b.abs().max(1.0),
            "step {s}: loss {a} vs the replay's {b}"
        );
    }
    let d = max_diff(&report, &expected);
    assert!(
        d < tol,
        "{:?} under {}: the join run differs from the replay by {d}",
        cfg.data.join,
        policy_of(&cfg)
    );
    let other = match cfg.data.join {
        Some(JoinMode::DivideActive) => JoinMode::DivideInitial,
        _ => JoinMode::DivideActive,
    };
    let d = max_diff(
        &report,
        &replay(rows, &{
            let mut c = cfg.clone();
            c.data.join = Some(other);
            c
        })
        .0,
    );
    assert!(d > 1e-4, "the test cannot tell the divisors apart ({d})");
    // every rank's steps, the step each joined at, and where the data ended
    let k = cfg.data.accum;
    let steps_of: Vec<usize> = rows.iter().map(|n| n / (BATCH * k)).collect();
    let longest = *steps_of.iter().max().unwrap();
    assert_eq!(report.outcome.losses().len(), longest.min(cfg.recipe.steps));
    let joined: Vec<Option<usize>> = steps_of.iter().map(|&n| (n < longest).then_some(n)).collect();
    assert_eq!(report.outcome.joined_at, joined);
    assert_eq!(
        report.outcome.data_ended,
        (longest < cfg.recipe.steps).then_some(longest)
    );
    report
}

fn policy_of(cfg: &TrainConfig) -> String {
    let d = cfg.distributed.as_ref().expect("a DDP run");
    d.policy.make(0).map(|p| p.name()).unwrap_or_default()
}

#[test]
fn two_ranks_with_uneven_shards_train_as_one_process_on_the_batches_they_see() {
    // rank 0: 5 steps, rank 1: 3; --steps 10 counts the longest rank's: the run ends at step 5
    for mode in [JoinMode::DivideInitial, JoinMode::DivideActive] {
        check_against_replay(&[40, 24], config(10, Some(mode), PolicySpec::AllReduce, sgd()), 1e-6);
    }
}

#[test]
fn four_ranks_join_one_after_another_under_zero_and_accumulation() {
    // steps per rank: 5, 2, 1, 4 (rank 2 joins at step 1, rank 1 at 2, rank 3 at 4)
    let rows = [40, 16, 8, 32];
    check_against_replay(
        &rows,
        config(8, Some(JoinMode::DivideInitial), PolicySpec::Zero1, sgd()),
        1e-6,
    );
    let adamw = OptimizerConfig::adamw(1e-2, None);
    check_against_replay(
        &rows,
        config(8, Some(JoinMode::DivideActive), PolicySpec::Zero2, adamw),
        1e-6,
    );
    // two microbatches a step: the same steps from twice the rows, a rank that cannot fill a
    // whole step joins (rank 2's 24 rows are one step and a half)
    let rows = [80, 32, 24, 64];
    let cfg = {
        let mut c = config(8, Some(JoinMode::DivideActive), PolicySpec::AllReduce, sgd());
        c.data.accum = 2;
        c
    };
    check_against_replay(&rows, cfg, 1e-6);
}

#[test]
fn fp16_compression_joins_with_zeros_within_its_rounding() {
    // fp16 rounds every bucket it sends: within its rounding of the replay, and the divisors
    // still apart
    let cfg = config(10, Some(JoinMode::DivideInitial), PolicySpec::Fp16, sgd());
    check_against_replay(&[40, 16, 24, 32], cfg, 2e-3);
}

#[test]
fn the_steps_flag_stops_before_the_longest_rank_s_data_ends() {
    let report = check_against_replay(
        &[40, 24],
        config(4, Some(JoinMode::DivideInitial), PolicySpec::AllReduce, sgd()),
        1e-6,
    );
    assert_eq!(report.outcome.losses().len(), 4);
    assert_eq!(report.outcome.data_ended, None);
}

#[test]
fn throw_stops_every_rank_at_the_step_the_first_rank_runs_out() {
    // ranks 1 and 3 run out at step 2; rank 2 at step 3: every rank stops at step 2 naming rank 1
    let rows = [40usize, 16, 24, 16];
    let cfg = config(10, Some(JoinMode::Throw), PolicySpec::AllReduce, sgd());
    let data = shards(&rows);
    let launched = within_deadline(move || {
        run_ranks(
            &LaunchConfig::threads(4),
            |_| Ok(RankShards::new(data)),
            |ctx, data| Trainer::new(&cfg, model()?, data, ctx)?.run(),
        )
    })
    .unwrap();
    assert_eq!(launched.results.len(), 4);
    for (rank, outcome) in launched.results {
        assert_eq!(
            outcome.losses().len(),
            2,
            "rank {rank} ran {} steps",
            outcome.losses().len()
        );
        match outcome.stopped {
            Some(Error::OutOfData {
                step: 2,
                rank: 1,
                rows: 16,
                steps: 2,
            }) => {}
            other => panic!("rank {rank} stopped with {other:?}"),
        }
    }
    // the one error line names the rank and the step
    let report = run(&rows, config(10, Some(JoinMode::Throw), PolicySpec::AllReduce, sgd())).unwrap();
    let e = report.outcome.stopped.unwrap().to_string();
    assert!(e.contains("step 2: rank 1's data ended"), "{e}");
}

#[test]
fn without_a_join_mode_uneven_shards_are_refused_before_step_0() {
    let e = run(&[40, 24, 48], config(3, None, PolicySpec::AllReduce, sgd()))
        .err()
        .expect("uneven")
        .to_string();
    assert!(
        e.contains("shortest: rank 1 with 24") && e.contains("longest: rank 2 with 48") && e.contains("join"),
        "{e}"
    );
    // even shards need none: they are read in order, wrapping around
    let report = run(&[16, 16], config(5, None, PolicySpec::AllReduce, sgd())).unwrap();
    assert_eq!(report.outcome.losses().len(), 5);
    assert!(report.outcome.joined_at.is_empty());
}

#[test]
fn a_joined_rank_s_timeline_shows_its_shadow_collectives() {
    let (world, data) = (2, shards(&[40, 24]));
    let recorder = brigade::comm::Recorder::new();
    let launch = LaunchConfig {
        recorder: Some(recorder.clone()),
        ..LaunchConfig::threads(world)
    };
    let cfg = config(10, Some(JoinMode::DivideInitial), PolicySpec::AllReduce, sgd());
    let report = within_deadline(move || fit(&launch, &cfg, |_| Ok(RankShards::new(data)), |_| model())).unwrap();
    let tl = report.timeline.expect("a timeline of the last step");
    assert_eq!(tl.step, 4);
    let on =
        |rank: usize, f: &dyn Fn(&EventKind) -> bool| tl.events.iter().filter(|e| e.rank == rank && f(&e.kind)).count();
    let join_span = |k: &EventKind| matches!(Phase::of(k), Some(Phase::Other(n)) if n == JOIN_SPAN);
    let bucket = |k: &EventKind| bucket_of(k).is_some();
    assert_eq!(on(1, &join_span), 1, "rank 1 (joined at step 3) shows its join pass");
    assert_eq!(on(0, &join_span), 0, "rank 0 trains");
    assert!(on(1, &bucket) > 1, "rank 1 reduces every bucket in the others' place");
    assert_eq!(
        on(1, &bucket),
        on(0, &bucket),
        "one bucket collective for each of rank 0's"
    );
    // the agreement on who has data needs its own all-reduce once, before step 0: every later
    // one travels in the step status of the step before
    let agreements = recorder
        .events()
        .iter()
        .filter(|e| e.rank == 0 && e.name == brigade::join::JOIN_TAG)
        .count();
    assert_eq!(agreements, 1);
}

#[test]
fn a_join_run_resumes_where_it_stopped_with_the_ranks_that_had_joined() {
    let dir = crate::common::tmp("join", "resume");
    let ckpt = dir.join("c.safetensors");
    let rows = [40, 24];
    let base = config(10, Some(JoinMode::DivideActive), PolicySpec::Zero1, sgd());
    let straight = run(&rows, base.clone()).unwrap();
    // 4 steps (rank 1 joined at step 3), then on to the end
    let with = |steps: usize, resume: Option<&Path>| {
        let mut c = base.clone();
        c.recipe.steps = steps;
        c.runtime.checkpoint = CheckpointConfig {
            path: Some(ckpt.clone()),
            resume: resume.map(Path::to_path_buf),
            every: None,
            keep_last: None,
            metadata: vec![],
        };
        c
    };
    let first = run(&rows, with(4, None)).unwrap();
    assert_eq!(first.outcome.joined_at, vec![None, Some(3)]);
    let second = run(&rows, with(10, Some(&ckpt))).unwrap();
    assert_eq!(second.outcome.first_step, 4);
    assert_eq!(second.outcome.joined_at, vec![None, Some(3)]);
    let mut losses = first.outcome.losses().clone();
    losses.extend(&second.outcome.losses());
    assert_eq!(losses, straight.outcome.losses());
    let exact = |a: &RunReport, b: &RunReport| {
        a.outcome
            .params
            .iter()
            .zip(&b.outcome.params)
            .all(|((_, x), (_, y))| x.to_f64_vec().unwrap() == y.to_f64_vec().unwrap())
    };
    assert!(
        exact(&second, &straight),
        "the resumed run's parameters differ from the straight run's"
    );
    // another join mode is refused, naming both
    let e = run(&rows, {
        let mut c = with(10, Some(&ckpt));
        c.data.join = Some(JoinMode::DivideInitial);
        c
    })
    .err()
    .expect("another mode")
    .to_string();
    assert!(
        e.contains("join mode") && e.contains("divide-active") && e.contains("divide-initial"),
        "{e}"
    );
}

#[test]
fn sampled_shards_join_too() {
    // each rank shuffles its own shard (one pass): the run trains and the ranks agree
    let cfg = {
        let mut c = config(10, Some(JoinMode::DivideInitial), PolicySpec::AllReduce, sgd());
        c.data.order = DataOrder::shuffle(3, false);
        c
    };
    let report = run(&[40, 24], cfg).unwrap();
    assert!(report.outcome.stopped.is_none(), "{:?}", report.outcome.stopped);
    assert_eq!(report.outcome.losses().len(), 5);
    assert_eq!(report.outcome.joined_at, vec![None, Some(3)]);
}

#[test]
fn every_built_in_policy_joins_without_a_hang_and_the_ranks_end_equal() {
    // bf16 and PowerSGD (compressing from step 2) approximate the sum, so no replay: the run
    // ends where the data does, each rank's join is reported, and the end-of-run checksum
    // (a `ReplicasDiffer` error otherwise) found every rank's parameters equal
    let policies = [PolicySpec::Bf16, PolicySpec::PowerSgd { rank: 1, start_iter: 2 }];
    for policy in policies {
        for mode in [JoinMode::DivideInitial, JoinMode::DivideActive] {
            let name = policy.to_string();
            let report = run(&[40, 16, 24], config(10, Some(mode), policy.clone(), sgd())).unwrap();
            assert!(
                report.outcome.stopped.is_none(),
                "{name} {mode}: {:?}",
                report.outcome.stopped
            );
            assert_eq!(report.outcome.losses().len(), 5, "{name} {mode}");
            assert_eq!(report.outcome.joined_at, vec![None, Some(2), Some(3)], "{name} {mode}");
            assert!(report.outcome.losses().iter().all(|l| l.is_finite()), "{name} {mode}");
        }
    }
}

/// A policy that reduces nothing: each rank keeps its own gradient (the replicas drift apart).
struct KeepLocal;

impl brigade::ddp::ReducerPolicy for KeepLocal {
    fn name(&self) -> String {
        "keep-local".into()
    }

    fn reduce(
        &mut self,
        bucket: brigade::ddp::policy::PolicyBucket,
        comm: &brigade::ddp::policy::Group,
    ) -> brigade::ddp::Result<brigade::ddp::policy::Reduction> {
        Ok(brigade::ddp::policy::Reduction::Full(comm.ready(bucket.tensor)))
    }
}

#[test]
fn ranks_whose_parameters_drift_apart_are_caught_at_the_end() {
    // the end-of-run checksum is what proves the ranks agree: under a policy that reduces
    // nothing every rank steps its own gradient, and the run ends with one agreed error
    let cfg = {
        let mut c = config(10, Some(JoinMode::DivideInitial), PolicySpec::AllReduce, sgd());
        c.distributed.get_or_insert_default().policy = Arc::new(|_rank: usize| KeepLocal);
        c
    };
    let report = run(&[40, 24], cfg).unwrap();
    match report.outcome.stopped {
        Some(Error::ReplicasDiffer { ref checksums }) => {
            assert_eq!(checksums.len(), 2);
            assert_ne!(checksums[0], checksums[1]);
        }
        ref other => panic!("{other:?}"),
    }
    // the losses of the finished steps are kept
    assert_eq!(report.outcome.losses().len(), 5);
}

#[test]
fn clipping_evaluation_the_profile_and_the_autotuner_run_on_joined_ranks_too() {
    // every collective beside the buckets has a partner on a joined rank: the clipping norm
    // (a collective under ZeRO), the evaluation's all-reduce, the profile's gather and the
    // autotuner's exchanges; none of them leaves a rank waiting, and the replicas end equal
    let held = Dataset::teacher(16, WIDTHS[0], WIDTHS[2], 99).unwrap();
    for policy in [PolicySpec::AllReduce, PolicySpec::Zero2] {
        let name = policy.to_string();
        let zero = policy == PolicySpec::Zero2;
        let cfg = {
            let mut c = config(10, Some(JoinMode::DivideActive), policy, sgd());
            c.recipe.clip_grad_norm = Some(0.05);
            c.recipe.eval = Some(brigade::recipe::EvalConfig {
                every: 2,
                data: Arc::new(brigade::recipe::HeldOut::new(held.clone(), BATCH)),
            });
            // ZeRO fixes its buckets: no autotuner there
            c.distributed.get_or_insert_default().autotune = (!zero).then(|| brigade::ddp::overlap::AutotuneConfig {
                every: Some(1),
                candidates_mb: vec![0.0002, 0.0004, 0.001],
                first_bucket_cap_mb: 0.0002,
                min_gain: -1.0,
                link: None,
            });
            c.runtime.instrument = brigade::config::Instrumentation {
                profile: true,
                ..Default::default()
            };
            c
        };
        let report = run(&[40, 16, 24], cfg).unwrap();
        let o = &report.outcome;
        assert!(o.stopped.is_none(), "{name}: {:?}", o.stopped);
        assert_eq!(o.losses().len(), 5, "{name}");
        assert_eq!(o.joined_at, vec![None, Some(2), Some(3)], "{name}");
        assert!(o.grad_norms().iter().all(|n| n.is_some_and(f64::is_finite)), "{name}");
        let evaluated: Vec<usize> = (0..5).filter(|&s| o.val_losses()[s].is_some()).collect();
        assert_eq!(evaluated, [1, 3, 4], "{name}: after steps 2 and 4, and the last");
        assert_eq!(o.profile.as_ref().expect("a profile").ranks.len(), 3, "{name}");
        assert_eq!(o.autotune.is_some(), !zero, "{name}");
    }
}

#[test]
fn ranks_training_apart_join_too() {
    // no DDP (the sweep's compute-only baseline): a rank without data takes part in the loss
    // agreement only, and does not step; the run still ends where the longest rank's data does
    let cfg = {
        let mut c = config(10, Some(JoinMode::DivideInitial), PolicySpec::AllReduce, sgd());
        c.distributed = None;
        c
    };
    let report = run(&[40, 24], cfg).unwrap();
    assert!(report.outcome.stopped.is_none(), "{:?}", report.outcome.stopped);
    assert_eq!(report.outcome.losses().len(), 5);
    assert_eq!(report.outcome.joined_at, vec![None, Some(3)]);
}

/// How far the run's final parameters (rank 0's) are from `expected`, relative to how far
/// `expected` moved from the initial parameters: `|run - expected| / |expected - initial|`
/// (L2 over every parameter).
fn relative_diff(report: &RunReport, expected: &[(String, Vec<f64>)]) -> f64 {
    let initial = model().unwrap().params().named_values();
    let (mut off, mut moved) = (0.0f64, 0.0f64);
    for (((name, t), (en, e)), (_, i)) in report.outcome.params.iter().zip(expected).zip(&initial) {
        assert_eq!(name, en);
        let (t, i) = (t.to_f64_vec().unwrap(), i.to_f64_vec().unwrap());
        for ((a, b), i) in t.iter().zip(e).zip(&i) {
            off += (a - b).powi(2);
            moved += (b - i).powi(2);
        }
    }
    (off / moved).sqrt()
}

#[test]
fn three_ranks_where_a_second_rank_joins_match_the_replay_under_either_divisor() {
    // steps per rank: 8, 5, 3 (rank 2 joins at step 3, rank 1 at step 5): steps 3 and 4 are
    // two ranks of three, steps 5-7 one. Plain SGD, so each step moves the parameters by
    // lr times the replay's gradient alone: (g0 + g1) / 3 at steps 3-4 under divide-initial,
    // (g0 + g1) / 2 under divide-active
    let rows = [8 * BATCH, 5 * BATCH, 3 * BATCH];
    let plain = OptimizerConfig::Sgd {
        lr: 0.1,
        momentum: 0.0,
        weight_decay: 0.0,
    };
    for mode in [JoinMode::DivideInitial, JoinMode::DivideActive] {
        let cfg = config(8, Some(mode), PolicySpec::AllReduce, plain.clone());
        let report = check_against_replay(&rows, cfg.clone(), 1e-6);
        assert_eq!(report.outcome.joined_at, vec![None, Some(5), Some(3)]);
        // f32 rounding of a sum over three ranks, not a different rule: within 1e-5 of how far
        // the parameters moved
        let d = relative_diff(&report, &replay(&rows, &cfg).0);
        assert!(
            d < 1e-5,
            "{mode}: the run is {d} of the parameters' movement off the replay"
        );
    }
}
