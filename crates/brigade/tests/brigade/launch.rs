//! The launch API through the library, thread backend: N ranks return N results in rank order;
//! one failing rank fails the call with its own error, naming it, long before the timeout (its
//! peers, blocked in a collective it never joins, learn that it is gone); a failing setup fails
//! before any rank runs. (`mpi_launch.rs` checks the same under `mpirun`.)

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use brigade::comm::{Buffer, Communicator, ReduceOp};
use brigade::launch::{run_ranks, LaunchConfig};
use brigade::Error;

#[test]
fn n_thread_ranks_return_n_results_in_rank_order() {
    let launched = run_ranks(
        &LaunchConfig::threads(3),
        |world| Ok(world * 100),
        |ctx, shared| {
            let sum = ctx
                .comm
                .all_reduce(Buffer::F32(vec![ctx.rank as f32 + 1.0]), ReduceOp::Sum, "ranks")
                .wait()?;
            Ok((ctx.world_size, *shared, sum.as_f32().unwrap()[0]))
        },
    )
    .unwrap();
    assert_eq!(launched.world_size, 3);
    // every rank saw the world size, the shared setup and its peers (1 + 2 + 3)
    assert_eq!(
        launched.results,
        [(0, (3, 300, 6.0)), (1, (3, 300, 6.0)), (2, (3, 300, 6.0))]
    );
    assert_eq!(launched.into_rank0(), Some((3, 300, 6.0)));
}

#[test]
fn one_failing_rank_fails_the_call_naming_it_within_the_timeout() {
    let timeout = Duration::from_secs(60);
    let cfg = LaunchConfig {
        timeout,
        ..LaunchConfig::threads(3)
    };
    let start = Instant::now();
    let result = run_ranks(
        &cfg,
        |_| Ok(()),
        |ctx, _| {
            if ctx.rank == 1 {
                return Err(Error::Data("rank one's own failure".into()));
            }
            // The others wait for rank 1 in a collective it never joins.
            ctx.comm.barrier("never complete").wait()?;
            Ok(())
        },
    );
    let took = start.elapsed();
    let e = result.err().expect("rank 1 failed");
    assert_eq!(e.to_string(), "rank 1 of 3: rank one's own failure");
    assert!(matches!(&e, Error::OnRank { rank: 1, world: 3, source } if matches!(**source, Error::Data(_))));
    // Not a timeout: the peers learned at once that rank 1 is gone.
    assert!(took < timeout, "took {took:?}");
}

#[test]
fn a_failing_setup_fails_before_any_rank_runs() {
    let ran = AtomicUsize::new(0);
    let result = run_ranks(
        &LaunchConfig::threads(2),
        |world| -> brigade::Result<()> { Err(Error::Data(format!("no data for {world} ranks"))) },
        |_, _| {
            ran.fetch_add(1, Ordering::SeqCst);
            Ok(())
        },
    );
    assert_eq!(result.err().map(|e| e.to_string()), Some("no data for 2 ranks".into()));
    assert_eq!(ran.load(Ordering::SeqCst), 0);
}
