//! The launch API through the library under `mpirun`: every process gets its rank's result with
//! the job's world size; one failing rank ends the whole job with an error naming it, long
//! before the timeout its peers (blocked in a collective it never joins) would wait; and DDP
//! over MPI starts reducing its first bucket while backward still runs.
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

/// Bucket 0 (the last two layers) is issued and starts its all-reduce on each MPI rank's comm
/// stream before the first layer runs its backward, every step: proven from the recorded event
/// order, not from clocks. When `layers.1.weight`'s gradient is announced, a subscriber holds
/// backward until the rank's recorder has seen bucket 0 start (or a deadline passed). A reducer
/// that issued its buckets only at the end of backward, or a stream that ran nothing until
/// then, never gets there, however the scheduler shares the cores.
#[test]
fn an_mpi_rank_reduces_bucket0_while_backward_still_runs() {
    let (ok, out, _) = mpirun(2, "overlap", Duration::from_secs(120));
    assert!(ok, "{out}");
    for r in 0..2 {
        assert!(
            out.contains(&format!(
                "rank {r}: bucket 0 started before layers.1's backward in steps [0, 1, 2]"
            )),
            "rank {r}:\n{out}"
        );
    }
}

/// Holds backward at `layers.1.weight` until this rank's comm stream has started bucket 0 once
/// more than before (one step each time), as the recorder saw it; an error past the deadline.
struct AwaitBucket0Start {
    recorder: brigade::comm::Recorder,
    rank: usize,
    seen: std::sync::Mutex<Vec<usize>>,
}

impl brigade::autograd::GradSubscriber for AwaitBucket0Start {
    fn grad_ready(&self, r: brigade::autograd::GradReady<'_>) -> Result<(), brigade::autograd::SubscriberError> {
        if r.name != "layers.1.weight" {
            return Ok(());
        }
        let mut seen = self.seen.lock().unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let started = self
                .recorder
                .events()
                .iter()
                .filter(|e| e.rank == self.rank && e.name == "bucket0" && e.start.is_some())
                .count();
            if started > seen.len() {
                let step = seen.len();
                seen.push(step);
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err("bucket 0's all-reduce did not start while backward was still running".into());
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// [`an_mpi_rank_reduces_bucket0_while_backward_still_runs`] on one rank: a 16-32-32-32-8 MLP
/// under DDP, bucket 0 = layers 3 and 2, 3 steps of 8 rows.
fn overlap(ctx: &brigade::launch::RankContext) -> brigade::Result<String> {
    use brigade::ddp::{DdpConfig, DistributedDataParallel};
    use brigade::models::{Dataset, Mlp, MlpConfig, Model};
    let recorder = ctx.recorder.clone().expect("the launch records the collectives");
    let m = Mlp::new(MlpConfig::new(vec![16, 32, 32, 32, 8]), 1)?;
    // floats of layers 3 and 2: 32 x 8 + 8 and 32 x 32 + 32; layers 1 and 0 go to bucket 1
    let two_layers_mib = ((264 + 1056) * 4) as f64 / (1024.0 * 1024.0);
    let cfg = DdpConfig {
        first_bucket_cap_mb: two_layers_mib,
        bucket_cap_mb: 1.0,
        recorder: Some(recorder.clone()),
        ..DdpConfig::default()
    };
    let policy = brigade::policies::PolicySpec::AllReduce.build(&brigade::policies::Registry::new())?;
    let _ddp = DistributedDataParallel::with_group(m.params(), ctx.comm.clone(), ctx.group.clone(), cfg, policy)?;
    let hold = Arc::new(AwaitBucket0Start {
        recorder,
        rank: ctx.rank,
        seen: Default::default(),
    });
    m.params().bus().subscribe(hold.clone());
    let data = Dataset::teacher(2 * 8 * 3, 16, 8, 5)?;
    for step in 0..3 {
        m.params().zero_grad()?;
        m.loss(&data.batch((step * 2 + ctx.rank) * 8, 8)?)?.backward()?;
    }
    let steps = hold.seen.lock().unwrap().clone();
    Ok(format!(
        "rank {}: bucket 0 started before layers.1's backward in steps {steps:?}",
        ctx.rank
    ))
}

/// One rank of a scenario (inert outside `mpirun`).
#[test]
fn mpi_worker() {
    let Ok(scenario) = std::env::var("BRIGADE_MPI_SCENARIO") else {
        return;
    };
    if scenario == "overlap" {
        let cfg = LaunchConfig {
            timeout: Duration::from_secs(120),
            recorder: Some(brigade::comm::Recorder::new()),
            on_fatal: Some(Arc::new(|e| eprintln!("error: {e}"))),
            ..LaunchConfig::mpi()
        };
        let launched = run_ranks(&cfg, |_| Ok(()), |ctx, _| overlap(ctx)).expect("a rank error ends the job");
        println!("{}", launched.results[0].1);
        return;
    }
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
