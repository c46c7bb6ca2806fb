//! Bad setups and dead ranks: clear errors, never a hang.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use brigade_autograd::{GradReady, GradSubscriber, Var};
use brigade_comm::{launch, launch_with_timeout, Communicator};
use brigade_ddp::{DdpConfig, DdpError, DistributedDataParallel};
use brigade_tensor::{set_compute_threads, DType, Tensor};
use common::{data, rows, Mlp};

#[test]
fn ranks_with_different_models_fail_naming_the_first_difference() {
    let errs = launch(2, |comm| {
        set_compute_threads(1);
        let widths: &[usize] = if comm.rank() == 0 {
            &[8, 16, 16, 4]
        } else {
            &[8, 16, 12, 4]
        };
        let m = Mlp::new(widths, 0);
        match DistributedDataParallel::new(&m.store, Arc::new(comm), DdpConfig::default()) {
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
        let results = launch(2, |comm| {
            set_compute_threads(1);
            let mut m = Mlp::new(&[6, 8, 3], 0);
            let extra = m.store.add("unused.weight", Tensor::ones(&[5], DType::F32)).unwrap();
            let cfg = DdpConfig {
                find_unused_parameters: find_unused,
                ..DdpConfig::default()
            };
            let ddp = DistributedDataParallel::new(&m.store, Arc::new(comm), cfg).unwrap();
            let (x, y) = data(4, 6, 3, 1);
            m.store.zero_grad().unwrap();
            let r = m.loss(&x, &y).backward().map_err(|e| e.to_string());
            (r, extra.grad().map(|g| g.to_vec::<f32>().unwrap()), ddp.memory())
        });
        for r in results {
            let (r, extra_grad, _) = r.unwrap();
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
    fn grad_ready(&self, _: GradReady<'_>) -> Result<(), String> {
        panic!("rank 1 dies mid-backward");
    }
}

#[test]
fn a_rank_that_panics_mid_backward_makes_the_others_fail_in_bounded_time() {
    let t0 = Instant::now();
    let timeout = Duration::from_secs(20);
    let results = launch_with_timeout(2, timeout, |comm| {
        set_compute_threads(1);
        let rank = comm.rank();
        let m = Mlp::new(&[6, 8, 8, 3], 0);
        // tiny buckets, so rank 0 launches collectives that rank 1 never joins
        let cfg = DdpConfig {
            bucket_cap_mb: 1e-4,
            first_bucket_cap_mb: 1e-4,
            ..DdpConfig::default()
        };
        let _ddp = DistributedDataParallel::new(&m.store, Arc::new(comm), cfg).unwrap();
        if rank == 1 {
            m.store.bus().subscribe(Arc::new(Die));
        }
        let (x, y) = data(4, 6, 3, 1);
        m.loss(&x, &y).backward().map_err(|e| e.to_string())
    });
    assert!(
        t0.elapsed() < timeout,
        "the survivors must not wait for the full timeout"
    );
    assert!(
        matches!(&results[1], Err(brigade_comm::CommError::Panicked { rank: 1, .. })),
        "{:?}",
        results[1]
    );
    let err = results[0].as_ref().unwrap().as_ref().unwrap_err();
    assert!(err.contains("rank 1"), "rank 0's error names the dead rank: {err}");
}

#[test]
fn gradients_live_in_the_buckets_only() {
    let reports = launch(2, |comm| {
        set_compute_threads(1);
        let rank = comm.rank();
        let m = Mlp::new(&[10, 20, 20, 4], 3);
        let cfg = DdpConfig {
            bucket_cap_mb: 0.001,
            first_bucket_cap_mb: 0.0005,
            ..DdpConfig::default()
        };
        let ddp = DistributedDataParallel::new(&m.store, Arc::new(comm), cfg).unwrap();
        let (x, y) = data(8, 10, 4, 2);
        let mut out = vec![];
        for _ in 0..2 {
            let (xb, yb) = rows(&x, &y, rank * 4, 4);
            m.store.zero_grad().unwrap();
            m.loss(&xb, &yb).backward().unwrap();
            out.push((ddp.memory(), ddp.buckets().len()));
        }
        let grads_are_views = m.store.params().iter().all(|p: &Var| p.grad().is_some());
        (out, grads_are_views)
    });
    for r in reports {
        let (out, all) = r.unwrap();
        assert!(all);
        for (mem, nb) in out {
            assert!(nb > 1);
            assert_eq!(mem.gradient_bytes_outside_buckets, 0);
            assert_eq!(
                mem.total_bytes(),
                mem.gradient_bytes,
                "{mem:?}: gradients + buckets must equal one copy of the gradients"
            );
        }
    }
}
