//! The launch API through the library under `mpirun`: every process gets its rank's result with
//! the job's world size; one failing rank ends the whole job with an error naming it, long
//! before the timeout its peers (blocked in a collective it never joins) would wait.
//!
//! Each `#[test]` launches `mpirun -np N` on this very test binary, filtered to `mpi_worker`,
//! which is inert unless `BRIGADE_MPI_SCENARIO` is set: then every process runs that scenario
//! as one rank. Needs `mpirun` on the PATH (Open MPI); built only with `--features mpi`.
#![cfg(feature = "mpi")]

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use brigade::comm::{Buffer, Communicator, ReduceOp};
use brigade::launch::{run_ranks, LaunchConfig};
use brigade::Error;

/// How long a rank would wait for a peer: far beyond how long the failing job may take.
const RANK_TIMEOUT: Duration = Duration::from_secs(300);

/// Runs `scenario` on `np` processes; returns (success, combined output, wall time). Panics
/// when the job is still running after `limit`.
fn mpirun(np: usize, scenario: &str, limit: Duration) -> (bool, String, Duration) {
    let exe = std::env::current_exe().expect("test binary path");
    let start = Instant::now();
    let mut child = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", &np.to_string()])
        .arg(exe)
        .args(["--exact", "mpi_launch::mpi_worker", "--nocapture", "--test-threads=1"])
        .env("BRIGADE_MPI_SCENARIO", scenario)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("mpirun must be on the PATH (apt-get install openmpi-bin)");
    while child.try_wait().expect("poll mpirun").is_none() {
        if start.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "mpirun -np {np} {scenario}: still running after {limit:?}\n{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let took = start.elapsed();
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text, took)
}

#[test]
fn every_mpi_rank_returns_its_result_with_the_job_world_size() {
    let (ok, out, _) = mpirun(3, "results", Duration::from_secs(120));
    assert!(ok, "{out}");
    for r in 0..3 {
        // each process: its own rank's result, world size 3, the sum over ranks 1 + 2 + 3
        assert!(
            out.contains(&format!("result of rank {r}: [({r}, (3, 6.0))]")),
            "rank {r}:\n{out}"
        );
    }
}

#[test]
fn one_failing_mpi_rank_ends_the_job_naming_it_within_the_timeout() {
    let (ok, out, took) = mpirun(2, "fail", RANK_TIMEOUT / 2);
    assert!(!ok, "the job must fail:\n{out}");
    assert!(out.contains("rank 1 of 2: rank one's own failure"), "{out}");
    assert!(!out.contains("result of rank"), "no rank may return:\n{out}");
    assert!(took < RANK_TIMEOUT, "took {took:?}");
}

/// One rank of a scenario (inert outside `mpirun`).
#[test]
fn mpi_worker() {
    let Ok(scenario) = std::env::var("BRIGADE_MPI_SCENARIO") else {
        return;
    };
    let cfg = LaunchConfig {
        timeout: RANK_TIMEOUT,
        // the job ends inside the launch: this is how it says why
        on_fatal: Some(Arc::new(|e| eprintln!("error: {e}"))),
        ..LaunchConfig::mpi()
    };
    let launched = run_ranks(
        &cfg,
        |_| Ok(()),
        |ctx, _| {
            if scenario == "fail" && ctx.rank == 1 {
                return Err(Error::Data("rank one's own failure".into()));
            }
            let sum = ctx
                .comm
                .all_reduce(Buffer::F32(vec![ctx.rank as f32 + 1.0]), ReduceOp::Sum, "ranks")
                .wait()?;
            Ok((ctx.world_size, sum.as_f32().unwrap()[0]))
        },
    )
    .expect("a rank error ends the job inside launch");
    let rank = launched.results[0].0;
    println!("result of rank {rank}: {:?}", launched.results);
}
