//! The MPI backend under `mpirun`: every collective, dtype and op against the serial reference
//! (as `collectives.rs` does for threads), mismatch and argument errors, and the timeout.
//!
//! Each `#[test]` here launches `mpirun -np N` on this very test binary, filtered to
//! `mpi_worker`, which is inert unless `BRIGADE_MPI_SCENARIO` is set: then every process runs
//! that scenario as one rank and prints `ok rank R`. Needs `mpirun` on the PATH (Open MPI);
//! as root, `--allow-run-as-root` is passed (and `--oversubscribe` for small machines).
#![cfg(feature = "mpi")]

use crate::common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use brigade_comm::{Buffer, CommError, Communicator, DType, MpiWorld, ReduceOp};
use common::*;

const TIMEOUT: Duration = Duration::from_secs(20);
const SIZES: [usize; 4] = [0, 1, 1031, (1 << 18) + 3];

/// Runs `scenario` on `np` processes; returns (success, combined output).
fn mpirun(np: usize, scenario: &str, limit: Duration) -> (bool, String) {
    let exe = std::env::current_exe().expect("test binary path");
    let mut child = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", &np.to_string()])
        .arg(exe)
        .args([
            "--exact",
            "mpi_collectives::mpi_worker",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("BRIGADE_MPI_SCENARIO", scenario)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("mpirun must be on the PATH (apt-get install openmpi-bin)");
    let start = Instant::now();
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
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn assert_all_ranks_ok(np: usize, scenario: &str) {
    let (ok, out) = mpirun(np, scenario, Duration::from_secs(60));
    assert!(ok, "mpirun -np {np} {scenario} failed:\n{out}");
    for r in 0..np {
        assert!(
            out.contains(&format!("ok rank {r}")),
            "rank {r} did not finish {scenario}:\n{out}"
        );
    }
}

#[test]
fn collectives_match_serial_reference_on_2_and_3_processes() {
    assert_all_ranks_ok(2, "collectives");
    assert_all_ranks_ok(3, "collectives");
}

#[test]
fn mismatches_and_bad_arguments_fail_on_every_rank_and_leave_the_communicator_usable() {
    assert_all_ranks_ok(2, "errors");
}

#[test]
fn a_missing_peer_times_out_and_breaks_the_transport() {
    assert_all_ranks_ok(2, "timeout");
}

/// The entry point of every MPI process (does nothing under plain `cargo test`).
#[test]
fn mpi_worker() {
    let Ok(scenario) = std::env::var("BRIGADE_MPI_SCENARIO") else {
        return;
    };
    let world = MpiWorld::init().expect("MPI init");
    let rank = world.rank();
    {
        match scenario.as_str() {
            "collectives" => collectives(&world),
            "errors" => errors(&world),
            "timeout" => timeout(&world),
            other => panic!("unknown scenario {other}"),
        }
    }
    println!("ok rank {rank}");
    drop(world);
}

fn collectives(world: &MpiWorld) {
    let comm = world.communicator(TIMEOUT).unwrap();
    let (rank, n) = (comm.rank(), comm.world_size());
    assert_eq!((rank, n), (world.rank(), world.world_size()));
    let mut salt = 0;
    for &d in &DTYPES {
        for &op in &OPS {
            for &len in &SIZES {
                salt += 1;
                let inputs: Vec<Buffer> = (0..n).map(|r| input(d, r, len, salt)).collect();
                let what = format!("rank {rank}/{n} {d} {op} x {len}");
                // all-reduce, in place: the same allocation comes back.
                let buf = inputs[rank].clone();
                let ptr = buf.as_ptr();
                let out = comm.all_reduce(buf, op, "ar").wait().unwrap();
                assert_same(&out, &reference_reduce(&inputs, op), &format!("all_reduce {what}"));
                if len > 0 {
                    assert_eq!(out.as_ptr(), ptr, "{what}: the buffer came back copied");
                }
                // reduce-scatter over n chunks of `len` elements.
                let big: Vec<Buffer> = (0..n).map(|r| input(d, r, len * n, salt)).collect();
                let full = to_f32(&reference_reduce(&big, op));
                let out = comm.reduce_scatter(big[rank].clone(), op, "rs").wait().unwrap();
                let want = from_f32(d, full[rank * len..(rank + 1) * len].to_vec());
                assert_same(&out, &want, &format!("reduce_scatter {what}"));
            }
        }
    }
    // A NaN on any rank wins under Max, whatever the order of the operands (as torch.max,
    // and as the thread backend): element r is NaN on rank r only, element n on no rank.
    let mut v = vec![1.0f32; n + 1];
    v[rank] = f32::NAN;
    v[n] = rank as f32;
    let out = comm.all_reduce(Buffer::F32(v), ReduceOp::Max, "nan").wait().unwrap();
    let out = out.as_f32().unwrap();
    assert!(out[..n].iter().all(|x| x.is_nan()), "rank {rank}: {out:?}");
    assert_eq!(out[n], (n - 1) as f32, "rank {rank}: {out:?}");
    for d in [DType::F32, DType::F16, DType::BF16, DType::U8] {
        for &len in &SIZES {
            salt += 1;
            let mine = input(d, rank, len, salt);
            let out = comm.all_gather(mine, "ag").wait().unwrap();
            let mut want = Vec::new();
            for r in 0..n {
                want.extend(to_f32(&input(d, r, len, salt)));
            }
            assert_same(&out, &from_f32(d, want), &format!("all_gather rank {rank} {d} x {len}"));
            for root in 0..n {
                let buf = input(d, rank, len, salt + root);
                let ptr = buf.as_ptr();
                let out = comm.broadcast(buf, root, "bc").wait().unwrap();
                assert_same(
                    &out,
                    &input(d, root, len, salt + root),
                    &format!("broadcast root {root} {d}"),
                );
                if len > 0 {
                    assert_eq!(out.as_ptr(), ptr);
                }
            }
        }
    }
    // Issued back to back without waiting: they run in issue order and all complete.
    let works: Vec<_> = (0..8)
        .map(|i| {
            comm.all_reduce(
                Buffer::F32(vec![(rank * 8 + i) as f32; 1000]),
                ReduceOp::Sum,
                &format!("b{i}"),
            )
        })
        .collect();
    comm.barrier("end").wait().unwrap();
    for (i, w) in works.into_iter().enumerate() {
        let want = (0..n).map(|r| (r * 8 + i) as f32).sum::<f32>();
        assert!(w.wait().unwrap().as_f32().unwrap().iter().all(|&x| x == want));
    }
}

fn errors(world: &MpiWorld) {
    let comm = world.communicator(TIMEOUT).unwrap();
    let rank = comm.rank();
    // Rank 1 issues a different length and tag in slot 0: both ranks learn both descriptions.
    let len = if rank == 1 { 7 } else { 8 };
    let err = comm
        .all_reduce(Buffer::F32(vec![1.0; len]), ReduceOp::Sum, &format!("bucket {rank}"))
        .wait()
        .unwrap_err();
    match &err {
        CommError::Mismatch {
            slot,
            expected_rank,
            found_rank,
            expected,
            found,
            tag,
        } => {
            assert_eq!((*slot, *expected_rank, *found_rank), (0, 0, 1), "{err}");
            assert_eq!(tag, "bucket 0");
            assert_eq!(expected, "all_reduce(sum, 8 x f32, tag `bucket 0`)");
            assert_eq!(found, "all_reduce(sum, 7 x f32, tag `bucket 1`)");
        }
        other => panic!("rank {rank}: expected a mismatch, got {other}"),
    }
    let err = comm
        .all_reduce(Buffer::U8(vec![1; 4]), ReduceOp::Sum, "bytes")
        .wait()
        .unwrap_err();
    assert!(matches!(err, CommError::Unsupported(_)), "{err}");
    let err = comm
        .reduce_scatter(Buffer::F32(vec![1.0; 5]), ReduceOp::Sum, "odd")
        .wait()
        .unwrap_err();
    assert!(matches!(err, CommError::InvalidArgument(_)), "{err}");
    let err = comm.broadcast(Buffer::F32(vec![1.0; 5]), 9, "root").wait().unwrap_err();
    assert!(matches!(err, CommError::InvalidArgument(_)), "{err}");
    // Nothing was mixed up: the next collective works.
    let out = comm
        .all_reduce(Buffer::F32(vec![rank as f32; 3]), ReduceOp::Sum, "after")
        .wait()
        .unwrap();
    assert_eq!(out.as_f32().unwrap(), &[1.0; 3]);
}

fn timeout(world: &MpiWorld) {
    let short = Duration::from_millis(500);
    let comm = world.communicator(short).unwrap();
    if comm.rank() == 0 {
        // Rank 1 never joins: the transport gives up at its deadline, not later.
        let t = Instant::now();
        let err = comm
            .barrier("lonely")
            .wait_timeout(Duration::from_secs(30))
            .unwrap_err();
        let took = t.elapsed();
        assert!(matches!(err, CommError::Timeout { rank: 0, .. }), "{err}");
        // At the transport's deadline, not at the end of the caller's 60 times longer wait (a
        // bound that a loaded machine cannot break).
        assert!(
            took >= short && took < Duration::from_secs(15),
            "timed out after {took:?}"
        );
        // Broken for good, and says why, at once.
        let t = Instant::now();
        let err = comm
            .all_reduce(Buffer::F32(vec![1.0]), ReduceOp::Sum, "next")
            .wait()
            .unwrap_err();
        // At once: the error is `RankFailed`, checked below, not a second `Timeout` after `short`.
        assert!(t.elapsed() < Duration::from_secs(15), "took {:?}", t.elapsed());
        match &err {
            CommError::RankFailed { rank: 0, reason, .. } => assert!(reason.contains("lonely"), "{err}"),
            other => panic!("expected RankFailed, got {other}"),
        }
    } else {
        std::thread::sleep(short * 2);
    }
}
