//! The library's training loop (`brigade::fit`) over a model and a data source defined here,
//! outside Brigade's crates: sharding (N ranks == one rank on the whole batch == accumulation),
//! checkpoint/resume, a user's own comm hook per rank, the timeline and profile, and a failing
//! rank named.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use brigade::autograd::{scope, ParamStore, Var};
use brigade::comm::Recorder;
use brigade::config::{CheckpointConfig, Instrumentation};
use brigade::ddp::policy::{Group, PolicyBucket, Reduction};
use brigade::ddp::{Phase, ReducerPolicy};
use brigade::launch::LaunchConfig;
use brigade::models::nn::{Activation, Init, Linear, Params};
use brigade::models::{Batch, Model};
use brigade::policies::AllReduce;
use brigade::source::{DataSource, Microbatch};
use brigade::tensor::{DType, Rng, Tensor};
use brigade::{fit, Error, OptimizerConfig, RunReport, TrainConfig};

const IN: usize = 6;
const CLASSES: usize = 3;

/// `Linear ReLU Linear`, parameters `l1.*`, `l2.*`, one scope per layer.
pub(crate) struct Tiny {
    store: ParamStore,
    l1: Linear,
    l2: Linear,
}

impl Tiny {
    pub(crate) fn new() -> brigade::models::Result<Tiny> {
        let (mut store, mut rng) = (ParamStore::new(), Rng::new(3));
        let mut p = Params::new(&mut store, &mut rng, DType::F32);
        let l1 = Linear::new(&mut p.sub("l1"), IN, 16, true, Init::TorchLinear)?;
        let l2 = Linear::new(&mut p.sub("l2"), 16, CLASSES, true, Init::TorchLinear)?;
        Ok(Tiny { store, l1, l2 })
    }
}

impl Model for Tiny {
    fn params(&self) -> &ParamStore {
        &self.store
    }

    fn loss(&self, batch: &Batch) -> brigade::models::Result<Var> {
        let (inputs, targets) = (batch.tensor("tiny", "inputs")?, batch.tensor("tiny", "targets")?);
        let h = scope("l1", || {
            Activation::Relu.apply(&self.l1.forward(&Var::constant(inputs.clone()))?)
        })?;
        let logits = scope("l2", || self.l2.forward(&h))?;
        Ok(logits.cross_entropy(targets)?)
    }

    fn layer_names(&self) -> Vec<String> {
        vec!["l1".into(), "l2".into()]
    }
}

/// Row `i`: inputs drawn from seed `i`, labelled by which of the first 3 is largest.
pub(crate) struct Rows {
    pub(crate) fingerprint: Option<String>,
    /// Fail on this (rank, step).
    pub(crate) fail_at: Option<(usize, usize)>,
}

impl Rows {
    pub(crate) fn new() -> Rows {
        Rows {
            fingerprint: None,
            fail_at: None,
        }
    }
}

impl DataSource for Rows {
    fn batch(&self, mb: &Microbatch) -> brigade::Result<Batch> {
        if self.fail_at == Some((mb.rank, mb.step)) {
            return Err(Error::Data(format!("no rows for step {}", mb.step)));
        }
        let (mut x, mut y) = (vec![], vec![]);
        for i in mb.first_row()..mb.first_row() + mb.rows {
            let mut rng = Rng::new(i as u64);
            let row: Vec<f32> = (0..IN).map(|_| rng.normal() as f32).collect();
            y.push((0..CLASSES).max_by(|&a, &b| row[a].total_cmp(&row[b])).unwrap() as i64);
            x.extend(row);
        }
        Ok(Batch::classify(
            Tensor::from_vec(x, &[mb.rows, IN])?,
            Tensor::from_vec(y, &[mb.rows])?,
        ))
    }

    fn fingerprint(&self) -> Option<String> {
        self.fingerprint.clone()
    }
}

pub(crate) fn config(steps: usize, batch: usize) -> TrainConfig {
    let sgd = OptimizerConfig::Sgd {
        lr: 0.2,
        momentum: 0.9,
        weight_decay: 0.0,
    };
    {
        let mut c = TrainConfig::new(steps, batch, sgd);
        c.model.name = "tiny".into();
        c.runtime.compute_threads = Some(1);
        c
    }
}

pub(crate) fn run(world: usize, cfg: &TrainConfig, rows: Rows) -> brigade::Result<RunReport> {
    fit(
        &LaunchConfig::threads(world),
        cfg,
        |_| Ok(rows),
        |_| Ok(Box::new(Tiny::new()?)),
    )
}

pub(crate) fn tmp(name: &str) -> crate::common::Scratch {
    crate::common::tmp("library", name)
}

fn assert_close(a: &[f64], b: &[f64], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (s, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= 1e-5 * x.abs().max(1.0), "{what}: step {s}: {x} vs {y}");
    }
}

#[test]
fn a_user_model_on_two_ranks_matches_one_rank_on_the_whole_batch_and_accumulation() {
    let two = run(2, &config(5, 8), Rows::new()).unwrap();
    let one = run(1, &config(5, 16), Rows::new()).unwrap();
    let accum = run(
        1,
        &{
            let mut c = config(5, 8);
            c.data.accum = 2;
            c
        },
        Rows::new(),
    )
    .unwrap();
    assert_eq!(two.outcome.losses().len(), 5);
    assert!(
        two.outcome.losses()[4] < two.outcome.losses()[0],
        "it learns: {:?}",
        two.outcome.losses()
    );
    assert_close(
        &two.outcome.losses(),
        &one.outcome.losses(),
        "2 ranks x 8 rows vs 1 rank x 16 rows",
    );
    assert_close(
        &accum.outcome.losses(),
        &one.outcome.losses(),
        "2 microbatches of 8 vs one of 16",
    );
    let names: Vec<&str> = two.outcome.params.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["l1.weight", "l1.bias", "l2.weight", "l2.bias"]);
}

#[test]
fn a_user_model_resumes_from_its_checkpoint_as_if_never_stopped() {
    let d = tmp("resume");
    let ckpt = d.join("tiny.ckpt");
    let rows = || Rows {
        fingerprint: Some("rows v1".into()),
        fail_at: None,
    };
    let straight = run(2, &config(4, 8), rows()).unwrap();
    let first = {
        let mut c = config(2, 8);
        c.runtime.checkpoint = CheckpointConfig {
            path: Some(ckpt.clone()),
            metadata: vec![("plan".into(), "zero2 at 5 MiB".into()), ("step".into(), "mine".into())],
            ..CheckpointConfig::default()
        };
        c
    };
    run(2, &first, rows()).unwrap();
    // the caller's entries come back under their prefix, never in place of Brigade's
    let meta = brigade::checkpoint::load_model_tensors(&ckpt).unwrap().metadata;
    assert_eq!(meta.get("user.plan").map(String::as_str), Some("zero2 at 5 MiB"));
    assert_eq!(meta.get("user.step").map(String::as_str), Some("mine"));
    assert_eq!(meta.get("step").map(String::as_str), Some("2"));
    let resume = {
        let mut c = config(4, 8);
        c.runtime.checkpoint = CheckpointConfig {
            resume: Some(ckpt.clone()),
            ..CheckpointConfig::default()
        };
        c
    };
    let resumed = run(2, &resume, rows()).unwrap();
    assert_eq!(resumed.outcome.first_step, 2);
    assert_eq!(resumed.outcome.losses(), straight.outcome.losses()[2..], "bit for bit");

    // Other data, or another model's checkpoint, is refused with the reason.
    let other = Rows {
        fingerprint: Some("rows v2".into()),
        fail_at: None,
    };
    let e = run(2, &resume, other).err().expect("other data").to_string();
    assert!(e.contains("rows v1") && e.contains("rows v2"), "{e}");
    let renamed = {
        let mut c = resume.clone();
        c.model.name = "other".into();
        c
    };
    let e = run(2, &renamed, rows()).err().expect("another model").to_string();
    assert!(e.contains("model 'tiny'") && e.contains("'other'"), "{e}");
}

/// Counts each rank's reductions around the default all-reduce.
struct Counting(Arc<AtomicUsize>);

impl ReducerPolicy for Counting {
    fn name(&self) -> String {
        "counting".into()
    }

    fn reduce(&mut self, bucket: PolicyBucket, comm: &Group) -> brigade::ddp::Result<Reduction> {
        self.0.fetch_add(1, Ordering::Relaxed);
        AllReduce.reduce(bucket, comm)
    }
}

#[test]
fn every_rank_makes_its_own_policy_from_a_closure() {
    let made: Arc<Mutex<BTreeMap<usize, Arc<AtomicUsize>>>> = Arc::default();
    let m = made.clone();
    let cfg = {
        let mut c = config(3, 8);
        c.distributed.get_or_insert_default().policy = Arc::new(move |rank: usize| {
            let calls = Arc::new(AtomicUsize::new(0));
            m.lock().unwrap().insert(rank, calls.clone());
            Counting(calls)
        });
        c
    };
    let report = run(2, &cfg, Rows::new()).unwrap();
    let made = made.lock().unwrap();
    assert_eq!(made.keys().copied().collect::<Vec<_>>(), [0, 1], "one hook per rank");
    for (rank, calls) in made.iter() {
        // every bucket of every step went through the rank's own hook
        assert_eq!(
            calls.load(Ordering::Relaxed),
            3 * report.outcome.buckets.len(),
            "rank {rank}"
        );
    }
}

#[test]
fn the_timeline_and_profile_cover_every_rank_and_the_user_model_layers() {
    let launch = LaunchConfig {
        recorder: Some(Recorder::new()),
        ..LaunchConfig::threads(2)
    };
    let cfg = {
        let mut c = config(3, 8);
        c.runtime.instrument = Instrumentation {
            profile: true,
            ..Instrumentation::default()
        };
        c
    };
    let report = fit(&launch, &cfg, |_| Ok(Rows::new()), |_| Ok(Box::new(Tiny::new()?))).unwrap();
    let timeline = report.timeline.expect("a recorded last step");
    assert_eq!(timeline.step, 2);
    for rank in 0..2 {
        let scopes: Vec<String> = timeline
            .events
            .iter()
            .filter(|e| e.rank == rank)
            .filter_map(|e| match Phase::of(&e.kind) {
                Some(Phase::Backward { scope: Some(scope) }) => Some(scope),
                _ => None,
            })
            .collect();
        assert!(
            scopes.iter().any(|s| s == "l1") && scopes.iter().any(|s| s == "l2"),
            "rank {rank}: {scopes:?}"
        );
    }
    let profile = report.outcome.profile.expect("a step profile");
    assert_eq!(profile.ranks.iter().map(|r| r.rank).collect::<Vec<_>>(), [0, 1]);
    assert_eq!(profile.params.len(), 4);
}

#[test]
fn a_failing_data_source_fails_the_run_naming_its_rank() {
    let rows = Rows {
        fingerprint: None,
        fail_at: Some((1, 2)),
    };
    // steps 0 and 1 finished: the report holds them, with the failure that stopped the run
    let report = run(2, &config(4, 8), rows).expect("the finished steps' report");
    let steps: Vec<usize> = report.outcome.steps.iter().map(|s| s.step).collect();
    assert_eq!(steps, [0, 1]);
    assert!(report.outcome.params.is_empty(), "no parameters from a failed run");
    let e = report.outcome.stopped.expect("rank 1 fails at step 2");
    match &e {
        Error::OnRank {
            rank: 1,
            world: 2,
            source,
        } => {
            assert!(source.to_string().contains("no rows for step 2"), "{e}")
        }
        other => panic!("expected rank 1's own error, got {other}"),
    }
}

#[test]
fn a_step_that_fails_midway_leaves_no_span_of_the_timeline_open() {
    // rank 0's data fails at step 1, after the step's span began: every span it began ends
    let recorder = Recorder::new();
    let launch = LaunchConfig {
        recorder: Some(recorder.clone()),
        ..LaunchConfig::threads(1)
    };
    let rows = Rows {
        fingerprint: None,
        fail_at: Some((0, 1)),
    };
    let report = fit(&launch, &config(3, 8), |_| Ok(rows), |_| Ok(Box::new(Tiny::new()?))).expect("step 0's report");
    let e = report.outcome.stopped.expect("rank 0 fails at step 1");
    assert!(e.to_string().contains("no rows for step 1"), "{e}");
    let compute: Vec<_> = recorder
        .events()
        .into_iter()
        .filter(|e| e.track == brigade::comm::Track::Compute)
        .collect();
    assert!(compute.iter().any(|e| e.kind == Phase::Step(1).kind()), "{compute:?}");
    let open: Vec<_> = compute.iter().filter(|e| e.end.is_none()).map(|e| &e.kind).collect();
    assert!(open.is_empty(), "spans left open: {open:?}");
}
