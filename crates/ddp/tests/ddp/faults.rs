//! Bad setups and dead ranks: clear errors, never a hang.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use brigade_autograd::{AutogradError, GradReady, GradSubscriber, Optimizer, ParamStore, Sgd, SubscriberError};
use brigade_comm::{run_on_threads, run_on_threads_with_timeout, CommError};
use brigade_ddp::{DdpConfig, DdpError, DistributedDataParallel};
use brigade_tensor::{set_compute_threads, DType, Tensor};
use common::{data, max_diff, rows, Mlp};

#[test]
fn ranks_with_different_models_fail_naming_the_first_difference() {
    let errs = run_on_threads(2, |comm| {
        set_compute_threads(1);
        let widths: &[usize] = if comm.rank() == 0 {
            &[8, 16, 16, 4]
        } else {
            &[8, 16, 12, 4]
        };
        let m = Mlp::new(widths, 0);
        match DistributedDataParallel::new(&m.store, Arc::new(comm), DdpConfig::default(), common::average()) {
            Ok(_) => String::new(),
            Err(e) => {
                assert!(matches!(e, DdpError::ModelMismatch { index: 2, .. }), "{e}");
                e.to_string()
            }
        }
    });
    for e in errs {
        let e = e.unwrap();
        assert!(
            e.contains("'layers.1.weight' [16, 16]") && e.contains("'layers.1.weight' [12, 16]"),
            "{e}"
        );
    }
}

#[test]
fn an_unused_parameter_is_an_error_unless_find_unused_parameters() {
    for find_unused in [false, true] {
        let results = run_on_threads(2, |comm| {
            set_compute_threads(1);
            let mut m = Mlp::new(&[6, 8, 3], 0);
            let extra = m.store.add("unused.weight", Tensor::ones(&[5], DType::F32)).unwrap();
            let cfg = DdpConfig {
                find_unused_parameters: find_unused,
                ..DdpConfig::default()
            };
            let _ddp = DistributedDataParallel::new(&m.store, Arc::new(comm), cfg, common::average()).unwrap();
            let (x, y) = data(4, 6, 3, 1);
            m.store.zero_grad().unwrap();
            let r = m.loss(&x, &y).backward().map_err(|e| e.to_string());
            (r, extra.grad().map(|g| g.to_vec::<f32>().unwrap()))
        });
        for r in results {
            let (r, extra_grad) = r.unwrap();
            if find_unused {
                r.unwrap();
                assert_eq!(
                    extra_grad.unwrap(),
                    vec![0.0; 5],
                    "an unused parameter keeps a zero gradient"
                );
            } else {
                let e = r.unwrap_err();
                assert!(
                    e.contains("unused.weight") && e.contains("find_unused_parameters"),
                    "{e}"
                );
            }
        }
    }
}

/// Panics on the first gradient-ready event: a rank dying in the middle of backward.
struct Die;
impl GradSubscriber for Die {
    fn grad_ready(&self, _: GradReady<'_>) -> Result<(), SubscriberError> {
        panic!("rank 1 dies mid-backward");
    }
}

#[test]
fn a_rank_that_panics_mid_backward_makes_the_others_fail_in_bounded_time() {
    let t0 = Instant::now();
    let timeout = Duration::from_secs(20);
    let results = run_on_threads_with_timeout(2, timeout, |comm| {
        set_compute_threads(1);
        let rank = comm.rank();
        let m = Mlp::new(&[6, 8, 8, 3], 0);
        // tiny buckets, so rank 0 launches collectives that rank 1 never joins
        let cfg = DdpConfig {
            bucket_cap_mb: 1e-4,
            first_bucket_cap_mb: 1e-4,
            ..DdpConfig::default()
        };
        let _ddp = DistributedDataParallel::new(&m.store, Arc::new(comm), cfg, common::average()).unwrap();
        if rank == 1 {
            m.store.bus().subscribe(Arc::new(Die));
        }
        let (x, y) = data(4, 6, 3, 1);
        m.loss(&x, &y).backward()
    });
    assert!(
        t0.elapsed() < timeout,
        "the survivors must not wait for the full timeout"
    );
    assert!(
        matches!(&results[1], Err(CommError::Panicked { rank: 1, .. })),
        "{:?}",
        results[1].as_ref().err()
    );
    let err = results[0].as_ref().unwrap().as_ref().unwrap_err();
    assert!(
        err.to_string().contains("rank 1"),
        "rank 0's error names the dead rank: {err}"
    );
    // The root cause crosses the gradient-ready bus typed: backward's error has the reducer's
    // DdpError as its source, and that the CommError naming the dead rank.
    let ddp_err = std::error::Error::source(err).and_then(|s| s.downcast_ref::<DdpError>());
    assert!(matches!(ddp_err, Some(DdpError::Comm(_))), "{err:?}");
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(err);
    let comm_err = std::iter::from_fn(|| {
        let e = cause?;
        cause = e.source();
        Some(e)
    })
    .find_map(|e| e.downcast_ref::<CommError>());
    assert!(
        matches!(comm_err, Some(CommError::RankFailed { rank: 1, .. })),
        "{err:?}"
    );
}

/// Every rank builds `make(rank)` and wraps it; returns each rank's error text.
fn construction_errors(make: impl Fn(usize) -> ParamStore + Sync) -> Vec<String> {
    run_on_threads(2, |comm| {
        let store = make(comm.rank());
        match DistributedDataParallel::new(&store, Arc::new(comm), DdpConfig::default(), common::average()) {
            Ok(_) => panic!("DDP construction must fail"),
            Err(e) => {
                assert!(matches!(e, DdpError::ModelMismatch { .. }), "{e}");
                e.to_string()
            }
        }
    })
    .into_iter()
    .map(|r| r.unwrap())
    .collect()
}

fn store_of(params: &[(&str, &[usize], DType)]) -> ParamStore {
    let mut store = ParamStore::new();
    for (name, shape, dtype) in params {
        store.add(*name, Tensor::zeros(shape, *dtype)).unwrap();
    }
    store
}

#[test]
fn ranks_that_differ_in_a_name_a_dtype_or_the_count_fail_on_every_rank_naming_it() {
    let f32 = DType::F32;
    // (rank 1's parameters, text both ranks' errors must contain)
    let cases: Vec<(Vec<(&str, &[usize], DType)>, [&str; 2])> = vec![
        (
            vec![("w", &[2, 3], f32), ("c", &[3], f32)],
            ["'b' [3] F32", "'c' [3] F32"],
        ),
        (
            vec![("w", &[2, 3], f32), ("b", &[3], DType::F64)],
            ["'b' [3] F32", "'b' [3] F64"],
        ),
        (
            vec![("w", &[2, 3], f32), ("b", &[3], f32), ("extra", &[1], f32)],
            ["no parameter", "'extra' [1] F32"],
        ),
        (vec![("w", &[2, 3], f32)], ["'b' [3] F32", "no parameter"]),
    ];
    for (theirs, want) in cases {
        let errors = construction_errors(|rank| {
            if rank == 0 {
                store_of(&[("w", &[2, 3], f32), ("b", &[3], f32)])
            } else {
                store_of(&theirs)
            }
        });
        for (rank, e) in errors.iter().enumerate() {
            assert!(
                want.iter().all(|w| e.contains(w)) && e.contains("rank 1"),
                "rank {rank}: {e}"
            );
        }
    }
    // a parameter frozen on one rank only: its buckets would differ
    let errors = construction_errors(|rank| {
        let store = store_of(&[("w", &[2, 3], f32), ("b", &[3], f32)]);
        if rank == 1 {
            store.get("b").unwrap().set_requires_grad(false).unwrap();
        }
        store
    });
    for e in errors {
        assert!(e.contains("'b' [3] F32 frozen"), "{e}");
    }
}

#[test]
fn a_parameter_of_another_dtype_is_refused_by_name() {
    for r in run_on_threads(2, |comm| {
        let store = store_of(&[("w", &[2], DType::F32), ("half", &[2], DType::F64)]);
        match DistributedDataParallel::new(&store, Arc::new(comm), DdpConfig::default(), common::average()) {
            Err(DdpError::UnsupportedDType {
                param,
                dtype: DType::F64,
            }) => assert_eq!(param, "half"),
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("an f64 parameter must be refused"),
        }
    }) {
        r.unwrap();
    }
}

/// Fails the pass when `name` becomes ready (on every rank alike).
struct FailAt(&'static str);
impl GradSubscriber for FailAt {
    fn grad_ready(&self, r: GradReady<'_>) -> Result<(), SubscriberError> {
        if r.name == self.0 {
            return Err(format!("injected failure at {}", r.name).into());
        }
        Ok(())
    }
}

#[test]
fn after_a_failed_backward_the_gradients_can_be_zeroed_and_training_goes_on() {
    // What the reducer promises: backward returns the failure; the buckets it had launched
    // are waited for and given back (no gradient view stays lent), so zero_grad and the next
    // steps work, and training continues as if the failed pass had not happened.
    const WIDTHS: [usize; 4] = [6, 8, 8, 3];
    let (x, y) = data(2 * 4 * 3, 6, 3, 1);
    let reference = Mlp::new(&WIDTHS, 0);
    let mut opt = Sgd::new(reference.store.params().to_vec(), 0.1, 0.9, 0.0);
    for step in 0..2 {
        let (xb, yb) = rows(&x, &y, (step + 1) * 8, 8);
        reference.store.zero_grad().unwrap();
        reference.loss(&xb, &yb).backward().unwrap();
        opt.step().unwrap();
    }
    let results = run_on_threads(2, |comm| {
        set_compute_threads(1);
        let rank = comm.rank();
        let m = Mlp::new(&WIDTHS, 0);
        // one bucket per parameter: by layers.0.weight the later buckets are in flight
        let cfg = DdpConfig {
            bucket_cap_mb: 1e-6,
            first_bucket_cap_mb: 1e-6,
            ..DdpConfig::default()
        };
        let ddp = DistributedDataParallel::new(&m.store, Arc::new(comm), cfg, common::average()).unwrap();
        let fail: Arc<dyn GradSubscriber> = Arc::new(FailAt("layers.0.weight"));
        m.store.bus().subscribe(fail.clone());
        let (xb, yb) = rows(&x, &y, rank * 4, 4);
        m.store.zero_grad().unwrap();
        let err = m.loss(&xb, &yb).backward().unwrap_err();
        m.store.bus().unsubscribe(&fail);
        let mut opt = Sgd::new(m.store.params().to_vec(), 0.1, 0.9, 0.0);
        for step in 0..2 {
            let (xb, yb) = rows(&x, &y, (step + 1) * 8 + rank * 4, 4);
            m.store
                .zero_grad()
                .map_err(|e| format!("zero_grad after the failed pass: {e}"))?;
            m.loss(&xb, &yb).backward().map_err(|e| format!("step {step}: {e}"))?;
            opt.step().unwrap();
        }
        assert!(ddp.buckets_rebuilt());
        Ok::<_, String>((err, m.values()))
    });
    for (rank, r) in results.into_iter().enumerate() {
        let (err, values) = r.unwrap().unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert!(
            matches!(&err, AutogradError::Subscriber { param, .. } if param == "parameter 'layers.0.weight'"),
            "{err}"
        );
        assert!(err.to_string().contains("injected failure at layers.0.weight"), "{err}");
        let d = max_diff(&values, &reference.values());
        assert!(d < 2e-5, "rank {rank}: params differ by {d}");
    }
}
