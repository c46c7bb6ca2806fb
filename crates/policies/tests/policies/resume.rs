//! A resume through DDP is bit-exact under every built-in policy: 3 steps, then everything a
//! checkpoint holds (parameters, the consolidated optimizer state, every rank's policy state
//! gathered on rank 0) handed to freshly built ranks, then 3 more steps, against 6 straight
//! steps. PowerSGD resumes after its start iteration, with its error feedback and warm-start
//! factors; a rank that lost its state would send uncompressed bytes or other factors.

use crate::common::{data, max_diff, optimizer, rows, Mlp};

use std::sync::Arc;

use brigade_autograd::Optimizer;
use brigade_comm::run_on_threads;
use brigade_ddp::{DdpConfig, DistributedDataParallel};
use brigade_policies::{PolicySpec, Registry};
use brigade_tensor::{set_compute_threads, Tensor};

const WIDTHS: [usize; 4] = [12, 32, 24, 5];
const WORLD: usize = 2;
const MICRO: usize = 4;

/// What a checkpoint holds: rank 0's parameters, the optimizer's state and every rank's policy
/// state (both consolidated on rank 0).
#[derive(Clone)]
struct Saved {
    params: Vec<Vec<f32>>,
    optimizer: Vec<(String, Tensor)>,
    policy: Vec<(String, Tensor)>,
    /// The buckets the run reduced on (a per-bucket policy such as top-k resumes on them).
    grouping: Option<brigade_ddp::BucketGrouping>,
}

/// Steps `from..to` of `spec` with AdamW on `WORLD` ranks, starting from `saved` if given;
/// each rank's losses, and what rank 0 would checkpoint at the end.
fn run(spec: &str, from: usize, to: usize, saved: Option<&Saved>) -> (Vec<Vec<f64>>, Saved) {
    let (x, y) = data(WORLD * MICRO * 8, WIDTHS[0], WIDTHS[3], 3);
    let out = run_on_threads(WORLD, |comm| {
        set_compute_threads(1);
        let rank = comm.rank();
        let comm = Arc::new(comm);
        let m = Mlp::new(&WIDTHS, 42);
        if let Some(s) = saved {
            for (p, v) in m.store.params().iter().zip(&s.params) {
                let t = p.value();
                t.copy_from(&Tensor::from_slice(v, t.shape()).unwrap()).unwrap();
            }
        }
        let cfg = DdpConfig {
            bucket_cap_mb: 0.002,
            first_bucket_cap_mb: 0.001,
            grouping: saved.and_then(|s| s.grouping.clone()),
            ..DdpConfig::default()
        };
        let policy = spec.parse::<PolicySpec>().unwrap().build(&Registry::new()).unwrap();
        let ddp = DistributedDataParallel::new(&m.store, comm, cfg, policy).unwrap();
        let mut full = optimizer("adamw", m.store.params().to_vec());
        if let Some(s) = saved {
            full.load_state_dict(&s.optimizer).unwrap();
            if !s.policy.is_empty() {
                ddp.load_gathered_policy_state(&s.policy).unwrap();
            }
        }
        let mut opt = ddp.optimizer(full, &|p| optimizer("adamw", p)).unwrap();
        let mut losses = vec![];
        for s in from..to {
            let (xb, yb) = rows(&x, &y, (s * WORLD + rank) * MICRO, MICRO);
            m.store.zero_grad().unwrap();
            let loss = m.loss(&xb, &yb);
            losses.push(loss.value().item().unwrap());
            loss.backward().unwrap();
            opt.step().unwrap();
        }
        opt.consolidate_state().unwrap();
        let policy = ddp.gather_policy_state().unwrap();
        let optimizer = if rank == 0 { opt.state_dict().unwrap() } else { vec![] };
        (losses, m.values(), optimizer, policy, ddp.bucket_grouping())
    });
    let out: Vec<_> = out.into_iter().map(|r| r.unwrap()).collect();
    let saved = Saved {
        params: out[0].1.clone(),
        optimizer: out[0].2.clone(),
        policy: out[0].3.clone(),
        grouping: out[0].4.clone(),
    };
    (out.into_iter().map(|o| o.0).collect(), saved)
}

#[test]
fn resuming_is_bit_exact_under_every_policy() {
    for spec in [
        "allreduce",
        "fp16",
        "bf16",
        "powersgd:2@2",
        "zero1",
        "zero2",
        "topk:0.1",
        "efsign",
    ] {
        let (straight, end) = run(spec, 0, 6, None);
        let (first, saved) = run(spec, 0, 3, None);
        let (second, resumed_end) = run(spec, 3, 6, Some(&saved));
        for rank in 0..WORLD {
            let mut resumed = first[rank].clone();
            resumed.extend(&second[rank]);
            assert_eq!(resumed, straight[rank], "{spec} rank {rank}: losses");
        }
        assert_eq!(max_diff(&resumed_end.params, &end.params), 0.0, "{spec}: parameters");
        if spec.starts_with("topk") || spec == "efsign" {
            // every rank's residual was in the checkpoint
            for r in 0..WORLD {
                assert!(saved.policy.iter().any(|(k, _)| k.starts_with(&format!("rank{r}/"))));
            }
        }
        if spec.starts_with("powersgd") {
            // every rank's error feedback and factors were in the checkpoint
            for r in 0..WORLD {
                let prefix = format!("rank{r}/error.");
                assert!(
                    saved.policy.iter().any(|(k, _)| k.starts_with(&prefix)),
                    "{:?}",
                    saved.policy.len()
                );
                assert!(saved.policy.iter().any(|(k, _)| k.starts_with(&format!("rank{r}/q."))));
            }
        }
    }
}

#[test]
fn powersgd_resumed_without_its_state_is_not_the_same_run() {
    // The test above can tell: without its state the resumed PowerSGD starts over (two plain
    // steps, fresh factors, no error feedback) and the run differs.
    let (straight, _) = run("powersgd:2@2", 0, 6, None);
    let (_, mut saved) = run("powersgd:2@2", 0, 3, None);
    saved.policy.clear();
    let (second, _) = run("powersgd:2@2", 3, 6, Some(&saved));
    assert_ne!(second[0], straight[0][3..].to_vec());
}

#[test]
fn int8_loads_only_a_state_of_the_model_s_parameters_and_says_which_entry_is_not() {
    use brigade_ddp::policy::{BucketParam, BucketSpan};
    use brigade_ddp::ReducerPolicy;
    let param = |index: usize, name: &str, offset: usize, shape: &[usize]| BucketParam {
        index,
        name: name.into(),
        offset,
        shape: shape.to_vec(),
    };
    let span = BucketSpan {
        index: 0,
        params: vec![param(0, "0.weight", 0, &[4, 2]), param(1, "0.bias", 8, &[4])],
        numel: 12,
        grad_numel: 12,
    };
    let zeros = |n: usize| brigade_tensor::Tensor::zeros(&[n], brigade_tensor::DType::F32);
    let mut int8 = brigade_policies::Int8::default();
    int8.buckets_built(std::slice::from_ref(&span), 0).unwrap();
    let good = vec![("0.bias".to_string(), zeros(4)), ("0.weight".to_string(), zeros(8))];
    int8.load_state_dict(&good).unwrap();
    assert_eq!(int8.state_dict().unwrap().len(), 2);
    let other = vec![("layers.0.bias".to_string(), zeros(4))];
    let e = int8.load_state_dict(&other).unwrap_err().to_string();
    assert!(
        !e.contains('\n') && e.contains("'layers.0.bias'") && e.contains("no parameter"),
        "{e}"
    );
    let e = int8
        .load_state_dict(&[("0.bias".to_string(), zeros(5))])
        .unwrap_err()
        .to_string();
    assert!(
        !e.contains('\n') && e.contains("'0.bias'") && e.contains("5 elements"),
        "{e}"
    );
    // a refused state leaves what was loaded
    assert_eq!(int8.state_dict().unwrap().len(), 2);
}
