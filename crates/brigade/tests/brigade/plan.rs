//! `brigade::plan` on profiles recorded here, in process: a small GPT at world 2, three steps
//! under allreduce, fp16 and ZeRO-2, and allreduce with its blocks checkpointed. The plan's
//! steps are the overlap model's replays of each family's own profile, its peaks the memory
//! model's, its over-budget candidates exactly those whose peak exceeds the budget, and what
//! no profile measured is "not predicted".

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use brigade::comm::NetModel;
use brigade::ddp::overlap::{replay_with, BucketOrder, LaunchOverhead, LinkCost, ReplayConfig, StepProfile};
use brigade::launch::{LaunchConfig, RankContext};
use brigade::models::{Dataset, Gpt, GptConfig, Model, ModelKind};
use brigade::plan::memory::{predict_peak, PeakQuery};
use brigade::plan::{plan, Plan, PlanQuery};
use brigade::policies::PolicySpec;
use brigade::{fit, OptimizerConfig, TrainConfig};

fn gpt() -> GptConfig {
    GptConfig {
        vocab: 256,
        d_model: 64,
        n_layers: 2,
        n_heads: 2,
        d_ff: 128,
        context: 16,
        ..GptConfig::default()
    }
}

const CONFIG: &str = r#"{"vocab":256,"d_model":64,"n_layers":2,"n_heads":2,"d_ff":128,"context":16,"dropout":0.0}"#;

/// The last of 3 steps at world 2 under `policy`, its blocks checkpointed every `every`.
fn profile(policy: PolicySpec, every: usize) -> StepProfile {
    let mut c = TrainConfig::new(3, 4, OptimizerConfig::adamw(1e-3, None));
    c.model.name = "gpt".into();
    c.model.config = Some(CONFIG.into());
    c.model.activation_checkpointing = every;
    c.runtime.compute_threads = Some(1);
    c.runtime.instrument.profile = true;
    let d = c.distributed.get_or_insert_default();
    d.policy = Arc::new(policy);
    d.ddp.bucket_cap_mb = 0.05;
    d.ddp.first_bucket_cap_mb = 0.05;
    let r = fit(
        &LaunchConfig::threads(2),
        &c,
        |_| Dataset::builtin_text(16, 0).map_err(Into::into),
        |_ctx: &RankContext| Ok(Box::new(Gpt::new(gpt(), 1)?) as Box<dyn Model>),
    )
    .unwrap();
    r.outcome.profile.expect("a profile")
}

/// allreduce, fp16, zero2, allreduce checkpointed: recorded once for every test here.
fn profiles() -> &'static [StepProfile] {
    static P: OnceLock<Vec<StepProfile>> = OnceLock::new();
    P.get_or_init(|| {
        vec![
            profile(PolicySpec::AllReduce, 0),
            profile(PolicySpec::Fp16, 0),
            profile(PolicySpec::Zero2, 0),
            profile(PolicySpec::AllReduce, 1),
        ]
    })
}

fn link() -> LinkCost {
    LinkCost::Ring(NetModel {
        latency: Duration::from_micros(20),
        bandwidth_bytes_per_s: 1e9 / 8.0,
    })
}

fn peak(policy: PolicySpec, every: usize) -> u64 {
    predict_peak(&PeakQuery {
        kind: &ModelKind::Gpt(gpt()),
        rows: 4,
        state_per_param: 2,
        policy: &policy,
        world: 2,
        checkpoint_every: every,
    })
    .unwrap()
    .total()
}

/// A budget between ZeRO-2 without checkpointing and allreduce without it: some fit, some not.
fn query() -> PlanQuery {
    PlanQuery::new(
        (peak(PolicySpec::Zero2, 0) + peak(PolicySpec::AllReduce, 0)) / 2,
        link(),
    )
}

fn reason(p: &Plan, policy: &str) -> Vec<String> {
    p.candidates
        .iter()
        .filter(|c| c.policy.to_string() == policy)
        .map(|c| c.step.clone().err().unwrap_or_default())
        .collect()
}

#[test]
fn a_profile_records_what_ran_and_what_rank_0_measured() {
    let p = &profiles()[0];
    let run = p.run.as_ref().expect("the run's facts");
    assert_eq!(
        (run.model.as_str(), run.rows, run.optimizer_state_per_param),
        ("gpt", 4, 2)
    );
    assert_eq!(
        (run.precision.as_str(), run.model_config.as_deref()),
        ("f32", Some(CONFIG))
    );
    let m = run.memory.expect("rank 0's memory");
    assert!(m.peak > m.parameters && m.activations > 0, "{m:?}");
    assert!(run.command.is_empty(), "the library records no command line");
    assert_eq!(profiles()[3].activation_checkpointing, 1);
    // a profile from before the run was recorded still reads
    let mut v = serde_json::to_value(p).unwrap();
    v.as_object_mut().unwrap().remove("run");
    let old: StepProfile = serde_json::from_value(v).unwrap();
    assert!(old.run.is_none());
}

#[test]
fn each_candidate_is_its_familys_replay_and_the_ranking_follows_it() {
    let ps = profiles();
    let q = query();
    let p = plan(ps, &q).unwrap();
    let overhead = LaunchOverhead::fit(&ps.iter().collect::<Vec<_>>());
    // 3 caps x (allreduce, fp16, bf16, powersgd:1, topk:0.01, efsign, zero1, zero2, zero3,
    // diloco:10, streaming-diloco:10:2) x checkpointing 0, 1
    assert_eq!(p.candidates.len(), 3 * 11 * 2);
    let mut same_ac = 0;
    for c in &p.candidates {
        let Ok(s) = &c.step else { continue };
        let family = &ps[s.profile];
        let recorded = family.policy.as_ref().unwrap().name.as_str();
        let name = c.policy.to_string();
        assert_eq!(recorded, name, "{} replays its own profile", c.policy);
        if family.activation_checkpointing == c.activation_checkpointing {
            let r = replay_with(
                family,
                &ReplayConfig {
                    bucket_cap_mb: c.bucket_cap_mb,
                    first_bucket_cap_mb: c.first_bucket_cap_mb,
                    link: link(),
                    world_size: Some(2),
                    order: BucketOrder::recorded(family),
                },
                overhead,
            )
            .unwrap();
            assert_eq!(s.step_s, r.predicted_step_s, "{} at {} MiB", c.policy, c.bucket_cap_mb);
            assert_eq!(s.compute_s, r.compute_step_s);
            same_ac += 1;
        }
        if c.policy == PolicySpec::AllReduce {
            assert_eq!(s.policy_compute_s, Some(0.0));
        } else {
            assert!(
                s.policy_compute_s.is_some(),
                "{}: an allreduce profile at its checkpointing",
                c.policy
            );
        }
    }
    // allreduce, fp16, zero2 at 3 caps without checkpointing; allreduce with it
    assert_eq!(same_ac, 3 * 3 + 3);
    // fitting and predicted first, fastest first; then over the budget; then not predicted
    let class = |c: &brigade::plan::Candidate| match (&c.step, c.over_budget) {
        (Ok(_), None) => 0,
        (_, Some(_)) => 1,
        (Err(_), None) => 2,
    };
    let classes: Vec<i32> = p.candidates.iter().map(class).collect();
    assert!(classes.windows(2).all(|w| w[0] <= w[1]), "{classes:?}");
    let fitting: Vec<f64> = p
        .candidates
        .iter()
        .filter(|c| class(c) == 0)
        .map(|c| c.step.as_ref().unwrap().step_s)
        .collect();
    assert!(!fitting.is_empty());
    assert!(fitting.windows(2).all(|w| w[0] <= w[1]), "{fitting:?}");
    assert_eq!(p.winner, Some(0));
    assert_eq!(p.winner().unwrap().step.as_ref().unwrap().step_s, fitting[0]);
}

#[test]
fn over_budget_are_exactly_the_candidates_whose_peak_exceeds_it() {
    let q = query();
    let p = plan(profiles(), &q).unwrap();
    let mut over = 0;
    for c in &p.candidates {
        let expected = peak(c.policy.clone(), c.activation_checkpointing);
        assert_eq!(
            c.memory.total(),
            expected,
            "{} ac {}",
            c.policy,
            c.activation_checkpointing
        );
        match c.over_budget {
            Some((part, by)) => {
                over += 1;
                assert!(expected > q.budget_bytes);
                assert_eq!(by, expected - q.budget_bytes);
                assert_eq!(part, c.memory.largest().0);
            }
            None => assert!(expected <= q.budget_bytes, "{} fits", c.policy),
        }
    }
    // allreduce, fp16, bf16 and powersgd without checkpointing are over
    assert!(over >= 4 * 3, "{over}");
    assert!(p.winner().is_some_and(|w| w.over_budget.is_none()));
    // a budget nothing fits: no winner
    let none = plan(profiles(), &PlanQuery::new(1, link())).unwrap();
    assert_eq!(none.winner, None);
    assert!(none.candidates.iter().all(|c| c.over_budget.is_some()));
}

#[test]
fn what_no_profile_measured_is_not_predicted_with_its_reason() {
    let ps = profiles();
    let p = plan(ps, &query()).unwrap();
    for r in reason(&p, "powersgd:1") {
        assert_eq!(r, "no profiled step under powersgd");
    }
    for r in reason(&p, "zero3") {
        assert!(!r.is_empty(), "zero3 was never profiled");
    }
    // ZeRO-1 and bf16 are their own families: ZeRO-2's and fp16's profiles do not stand in
    for policy in ["zero1", "bf16"] {
        let r = reason(&p, policy);
        assert!(!r.is_empty());
        for r in r {
            assert_eq!(r, format!("no profiled step under {policy}"));
        }
    }
    // without the checkpointed allreduce the recompute is not measured
    let without: Vec<StepProfile> = ps[..3].to_vec();
    let p = plan(&without, &query()).unwrap();
    let profiled = |c: &&brigade::plan::Candidate| {
        !matches!(
            c.policy,
            PolicySpec::PowerSgd { .. }
                | PolicySpec::Bf16
                | PolicySpec::Zero1
                | PolicySpec::Zero3
                | PolicySpec::TopK { .. }
                | PolicySpec::EfSign
                | PolicySpec::Diloco(_)
                | PolicySpec::StreamingDiloco(_)
        )
    };
    let checkpointed: Vec<_> = p
        .candidates
        .iter()
        .filter(|c| c.activation_checkpointing == 1)
        .filter(profiled)
        .collect();
    assert_eq!(checkpointed.len(), 3 * 3);
    for c in checkpointed {
        assert_eq!(
            c.step.as_ref().unwrap_err(),
            "no profiled step with activation checkpointing",
            "{}",
            c.policy
        );
    }
    // with it, fp16 checkpointed is fp16's backward stretched by allreduce's recompute
    let p = plan(ps, &query()).unwrap();
    let at = |policy: PolicySpec, ac: usize| {
        p.candidates
            .iter()
            .find(|c| c.policy == policy && c.activation_checkpointing == ac && c.bucket_cap_mb == 25.0)
            .unwrap()
            .step
            .clone()
            .unwrap()
    };
    let (plain, ck) = (at(PolicySpec::Fp16, 0), at(PolicySpec::Fp16, 1));
    assert_eq!((plain.profile, ck.profile), (1, 1));
    let span = |p: &StepProfile| {
        p.ranks
            .iter()
            .map(|r| r.backward_end_s - r.backward_start_s)
            .sum::<f64>()
    };
    if span(&ps[3]) > span(&ps[0]) {
        assert!(ck.compute_s > plain.compute_s, "{ck:?} {plain:?}");
    }
    // a PowerSGD rank other than the profiled one
    let mut ranked = ps[..1].to_vec();
    let mut psgd = ps[1].clone();
    psgd.policy.as_mut().unwrap().name = "powersgd:4".into();
    ranked.push(psgd);
    let p = plan(&ranked, &query()).unwrap();
    assert!(p.candidates.iter().any(|c| c.policy.to_string() == "powersgd:4"));
    assert!(
        reason(&p, "powersgd:1").is_empty(),
        "only the profiled ranks are candidates"
    );
}

#[test]
fn a_family_of_several_profiled_steps_is_read_at_its_median_step() {
    // three copies of one step, rank 0 and rank 1 ending at these ms: the measured steps (the
    // slowest rank's end) are 30, 25 and 20 ms; rank 0 alone would say 30, 5 and 20
    let ends = [(0.030, 0.015), (0.005, 0.025), (0.020, 0.010)];
    let steps: Vec<StepProfile> = ends
        .iter()
        .enumerate()
        .map(|(i, &(r0, r1))| {
            let mut p = profiles()[0].clone();
            p.bucket_cap_mb = i as f64;
            p.ranks[0].step_end_s = r0;
            p.ranks[1].step_end_s = r1;
            p
        })
        .collect();
    let median = |s: &[StepProfile]| brigade::plan::median_step(s.to_vec()).map(|p| p.bucket_cap_mb);
    assert_eq!(
        median(&steps),
        Some(1.0),
        "neither the first, the last nor rank 0's median"
    );
    // an even count: the lower of the two middle steps; one step: itself; none: none
    assert_eq!(median(&steps[..2]), Some(1.0));
    assert_eq!(median(&steps[2..]), Some(2.0));
    assert_eq!(median(&[]), None);
}

#[test]
fn the_plan_is_a_configuration_with_the_recorded_command_and_the_costed_link() {
    // the plan names no flags: it keeps the profiled command as recorded, and the link it
    // costed; the command line of a candidate is the program's to write (the CLI's argv)
    let mut ps = profiles().to_vec();
    let argv: Vec<String> = ["prog", "--anything", "1"].map(String::from).to_vec();
    ps[0].run.as_mut().unwrap().command = argv.clone();
    let p = plan(&ps, &query()).unwrap();
    assert_eq!(p.command, argv);
    assert_eq!(p.link, query().link);
    let w = p.winner().unwrap();
    assert_eq!(w.world_size, 2);
    assert!(w.bucket_cap_mb > 0.0 && w.first_bucket_cap_mb <= w.bucket_cap_mb);
    let lib = plan(profiles(), &query()).unwrap();
    assert!(lib.command.is_empty(), "a library profile records no command");
}

#[test]
fn profiles_a_plan_cannot_compare_are_one_error_each() {
    let ps = profiles();
    let e = |ps: &[StepProfile]| plan(ps, &query()).unwrap_err().to_string();
    assert!(e(&[]).contains("no step profile"), "{}", e(&[]));
    let mut bare = ps[0].clone();
    bare.run = None;
    assert!(e(&[bare]).contains("re-record it with this build's runtime.instrument.profile"));
    let mut bf16 = ps[1].clone();
    bf16.run.as_mut().unwrap().precision = "bf16".into();
    let msg = e(&[ps[0].clone(), bf16]);
    assert!(msg.contains("profile 1") && msg.contains("precision"), "{msg}");
    let mut other = ps[1].clone();
    other.run.as_mut().unwrap().model_config = Some(CONFIG.replace("\"n_layers\":2", "\"n_layers\":3"));
    assert!(e(&[ps[0].clone(), other]).contains("model"));
    let mut q = query();
    q.bucket_caps_mb = vec![f64::NAN];
    assert!(plan(ps, &q).unwrap_err().to_string().contains("positive number of MiB"));
}

/// The last of 3 steps of a small MLP at world 2 under `policy` (SGD).
fn mlp_profile(policy: &str) -> StepProfile {
    let mut c = TrainConfig::new(
        3,
        8,
        OptimizerConfig::Sgd {
            lr: 0.05,
            momentum: 0.9,
            weight_decay: 0.0,
        },
    );
    c.model.name = "mlp".into();
    c.model.config = Some(r#"{"widths":[16,64,4],"dropout":0.0}"#.into());
    c.runtime.compute_threads = Some(1);
    c.runtime.instrument.profile = true;
    let d = c.distributed.get_or_insert_default();
    d.policy = Arc::new(policy.parse::<PolicySpec>().unwrap());
    let r = fit(
        &LaunchConfig::threads(2),
        &c,
        |_| Dataset::teacher(256, 16, 4, 0).map_err(Into::into),
        |_ctx: &RankContext| {
            Ok(Box::new(brigade::models::Mlp::new(
                brigade::models::MlpConfig::new(vec![16, 64, 4]),
                0,
            )?) as Box<dyn Model>)
        },
    )
    .unwrap();
    r.outcome.profile.expect("a profile")
}

#[test]
fn a_plan_weighs_top_k_ef_sign_and_both_dilocos_from_their_own_profiles() {
    let recorded = ["allreduce", "topk:0.01", "efsign", "diloco:2", "streaming-diloco:2:2"];
    let ps: Vec<StepProfile> = recorded.iter().map(|p| mlp_profile(p)).collect();
    let p = plan(&ps, &PlanQuery::new(u64::MAX, link())).unwrap();
    let overhead = LaunchOverhead::fit(&ps.iter().collect::<Vec<_>>());
    for (i, name) in recorded.iter().enumerate() {
        let of: Vec<_> = p.candidates.iter().filter(|c| c.policy.to_string() == *name).collect();
        assert_eq!(of.len(), 3, "{name}: one candidate per default cap");
        for c in of {
            // each replays its own profile, on the plan's link
            let s = c.step.as_ref().unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(s.profile, i, "{name}");
            let r = replay_with(
                &ps[i],
                &ReplayConfig {
                    bucket_cap_mb: c.bucket_cap_mb,
                    first_bucket_cap_mb: c.first_bucket_cap_mb,
                    link: link(),
                    world_size: Some(2),
                    order: BucketOrder::recorded(&ps[i]),
                },
                overhead,
            )
            .unwrap();
            assert_eq!(s.step_s, r.predicted_step_s, "{name}");
        }
    }
    // the memory model counts what each keeps across steps beside DDP's: the error-feedback
    // residual (a value per parameter), DiLoCo's snapshot and outer momentum (two)
    let state = |name: &str| {
        p.candidates
            .iter()
            .find(|c| c.policy.to_string() == name)
            .unwrap()
            .memory
            .policy_state
    };
    let psi = (16 * 64 + 64 + 64 * 4 + 4) as u64;
    assert_eq!(state("allreduce"), 0);
    assert_eq!(state("topk:0.01"), 4 * psi);
    assert_eq!(state("efsign"), 4 * psi);
    assert_eq!(state("diloco:2"), 8 * psi);
    assert!(state("streaming-diloco:2:2") >= 8 * psi);
}
