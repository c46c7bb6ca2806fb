//! The MPI backend under `mpirun`: every collective, dtype and op against the serial reference
//! (as `collectives.rs` does for threads), mismatch and argument errors, timeouts and killed
//! ranks, on each path: the node's shared segment (the default on one host), MPI alone
//! (`BRIGADE_MPI_SHM=0`: the blocking design under its watchdog), and the hierarchy
//! (`BRIGADE_NODE_SIZE=2` on 4 ranks: two nodes of two, the step between them over TCP).
//!
//! Each `#[test]` here launches `mpirun -np N` on this very test binary, filtered to
//! `mpi_worker`, which is inert unless `BRIGADE_MPI_SCENARIO` is set: then every process runs
//! that scenario as one rank and prints `ok rank R`. Needs `mpirun` on the PATH (Open MPI);
//! as root, `--allow-run-as-root` is passed (and `--oversubscribe` for small machines).
#![cfg(feature = "mpi")]

use crate::common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use brigade_comm::{Buffer, CommError, DType, MpiOptions, MpiPath, MpiWorld, ReduceOp, Transport};
use common::*;

const TIMEOUT: Duration = Duration::from_secs(20);
/// The timeout of the scenarios where a peer never joins: short, so the tests end soon, but
/// long enough that the communicator's own setup (a collective, under the same watchdog) never
/// trips it on a loaded machine.
const SHORT: Duration = Duration::from_secs(5);
const SIZES: [usize; 4] = [0, 1, 1031, (1 << 18) + 3];

/// The shared-memory path off: MPI's blocking collectives only.
const NO_SHM: &[(&str, &str)] = &[("BRIGADE_MPI_SHM", "0")];
/// Four ranks as two nodes of two, the step between the nodes over TCP.
const TWO_NODES: &[(&str, &str)] = &[("BRIGADE_NODE_SIZE", "2")];
const TCP: &[&str] = &["--mca", "btl", "tcp,self"];

/// Runs `scenario` on `np` processes, with environment variables for every rank and extra
/// `mpirun` arguments; returns (success, combined output).
fn mpirun_with(
    np: usize,
    scenario: &str,
    env: &[(&str, &str)],
    mpirun_args: &[&str],
    limit: Duration,
) -> (bool, String) {
    let exe = std::env::current_exe().expect("test binary path");
    let mut child = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", &np.to_string()])
        .args(mpirun_args)
        .envs(env.iter().copied())
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
    assert_all_ranks_ok_with(np, scenario, &[], &[]);
}

fn assert_all_ranks_ok_with(np: usize, scenario: &str, env: &[(&str, &str)], mpirun_args: &[&str]) {
    let (ok, out) = mpirun_with(np, scenario, env, mpirun_args, Duration::from_secs(120));
    assert!(ok, "mpirun -np {np} {scenario} {env:?} failed:\n{out}");
    for r in 0..np {
        assert!(
            out.contains(&format!("ok rank {r}")),
            "rank {r} did not finish {scenario} {env:?}:\n{out}"
        );
    }
}

#[test]
fn collectives_match_serial_reference_on_2_and_3_processes() {
    assert_all_ranks_ok(2, "collectives");
    assert_all_ranks_ok(3, "collectives");
}

#[test]
fn collectives_match_serial_reference_through_mpi_alone() {
    assert_all_ranks_ok_with(2, "collectives", NO_SHM, &[]);
    assert_all_ranks_ok_with(3, "collectives", NO_SHM, &[]);
}

#[test]
fn collectives_match_serial_reference_on_two_nodes_of_two() {
    assert_all_ranks_ok_with(4, "collectives", TWO_NODES, TCP);
}

#[test]
fn mismatches_and_bad_arguments_fail_on_every_rank_and_leave_the_communicator_usable() {
    assert_all_ranks_ok(2, "errors");
    assert_all_ranks_ok_with(2, "errors", NO_SHM, &[]);
    assert_all_ranks_ok_with(4, "errors", TWO_NODES, TCP);
}

#[test]
fn the_hierarchical_all_reduce_matches_the_flat_one_on_two_nodes_of_two() {
    assert_all_ranks_ok_with(4, "hierarchy", &[], TCP);
}

#[test]
fn buffers_in_the_shared_heaps_are_reduced_in_place_on_2_and_3_processes() {
    assert_all_ranks_ok(2, "in_place");
    assert_all_ranks_ok(3, "in_place");
    assert_all_ranks_ok_with(2, "in_place", &[("BRIGADE_SHM_HEAP", "0")], &[]);
}

#[test]
fn a_missing_peer_times_out_and_breaks_the_transport() {
    assert_all_ranks_ok(2, "timeout");
}

/// The blocking design: a peer that is alive but never joins costs the timeout, then the
/// watchdog ends the job, naming the collective and the rank that waited.
#[test]
fn a_missing_peer_under_the_blocking_design_ends_the_job_at_the_timeout() {
    let t = Instant::now();
    let (ok, out) = mpirun_with(2, "watchdog", NO_SHM, &[], Duration::from_secs(60));
    let took = t.elapsed();
    assert!(!ok, "the job should have been aborted:\n{out}");
    assert!(
        out.contains("rank 0: collective barrier(tag `lonely`)")
            && out.contains("did not complete within 5s; ending the job (MPI_Abort)"),
        "{out}"
    );
    assert!(!out.contains("ok rank"), "{out}");
    // Rank 1 sleeps 60 s without calling MPI: the job ended at rank 0's deadline, not then.
    assert!(took < Duration::from_secs(40), "took {took:?}:\n{out}");
}

/// A killed rank ends the job within the timeout: its peers neither spin nor block forever,
/// in the shared segment or in MPI's blocking calls. `--enable-recovery` keeps `mpirun` from
/// ending the job itself when a process dies: the survivor must notice.
#[test]
fn a_killed_rank_ends_the_job_within_the_timeout_on_every_path() {
    for env in [&[][..], NO_SHM] {
        let t = Instant::now();
        let (_, out) = mpirun_with(2, "killed", env, &["--enable-recovery"], Duration::from_secs(60));
        let took = t.elapsed();
        assert!(!out.contains("ok rank 0"), "{env:?}: {out}");
        // Rank 0 ended the job at its 5 s deadline: its wait in the segment returned a
        // timeout, or the watchdog ended the blocking call (whichever came first).
        assert!(
            out.contains("rank 0 gave up: rank 0: collective `b20` did not complete within 5s")
                || out.contains("rank 0: collective all_reduce(sum, 65536 x f32, tag `b20`)"),
            "{env:?}: {out}"
        );
        assert!(took < Duration::from_secs(40), "{env:?}: took {took:?}:\n{out}");
    }
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
            "watchdog" => watchdog(&world),
            "killed" => killed(&world),
            "hierarchy" => hierarchy(&world),
            "in_place" => in_place(&world),
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
    let want = (0..comm.world_size()).sum::<usize>() as f32;
    assert_eq!(out.as_f32().unwrap(), &[want; 3]);
}

fn timeout(world: &MpiWorld) {
    let short = SHORT;
    let comm = world.communicator(short).unwrap();
    if comm.rank() == 0 {
        // Rank 1 never joins: the transport gives up at its deadline, not later.
        let t = Instant::now();
        let err = comm
            .barrier("lonely")
            .wait_timeout(Duration::from_secs(120))
            .unwrap_err();
        let took = t.elapsed();
        assert!(matches!(err, CommError::Timeout { rank: 0, .. }), "{err}");
        // At the transport's deadline, not at the end of the caller's 24 times longer wait (a
        // bound that a loaded machine cannot break).
        assert!(
            took >= short && took < Duration::from_secs(60),
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

fn watchdog(world: &MpiWorld) {
    let comm = world.communicator(SHORT).unwrap();
    if comm.rank() == 0 {
        // Rank 1 never joins: the blocking call outlives its deadline and the watchdog ends
        // the job; this wait would return a `Timeout` only after 30 s.
        let result = comm.barrier("lonely").wait_timeout(Duration::from_secs(30));
        panic!("rank 0: the watchdog did not end the job: {result:?}");
    } else {
        std::thread::sleep(Duration::from_secs(60));
    }
}

fn killed(world: &MpiWorld) {
    let comm = world.communicator(SHORT).unwrap();
    let rank = comm.rank();
    for i in 0..1000 {
        if rank == 1 && i == 20 {
            let me = std::process::id().to_string();
            let _ = Command::new("kill").args(["-KILL", &me]).status();
            std::thread::sleep(Duration::from_secs(60));
        }
        // In the shared heap (in place) and out of it (through the slots), in turns.
        let buf = Buffer::F32(if i % 2 == 0 {
            brigade_comm::host_vec(1 << 16, 1.0)
        } else {
            vec![1.0; 1 << 16]
        });
        // Far longer than the communicator's timeout: only the transport's own deadline (or
        // its watchdog) can end this wait in time.
        let work = comm.all_reduce(buf, ReduceOp::Sum, &format!("b{i}"));
        if let Err(e) = work.wait_timeout(Duration::from_secs(100)) {
            // As the launcher does: a rank that cannot go on ends the job.
            eprintln!("rank {rank} gave up: {e}");
            world.abort(1);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Buffers in every rank's shared heap (`host_vec`) are reduced in place, to the serial
/// reference's bits; with the heap off (`BRIGADE_SHM_HEAP=0`, checked by the caller) none is.
fn in_place(world: &MpiWorld) {
    let mut transport = world.transport_with(&MpiOptions::from_env(TIMEOUT).unwrap()).unwrap();
    let heap_on = std::env::var(brigade_comm::HEAP_VAR).map_or(true, |v| v != "0");
    assert_eq!(transport.path(), MpiPath::SharedMemory);
    assert_eq!(transport.has_shared_heaps(), heap_on);
    let (rank, n) = (world.rank(), world.world_size());
    let (mut salt, mut non_empty) = (0, 0);
    for &d in &DTYPES {
        for &op in &OPS {
            for len in [0, 1, 1031, 3 * 262_144 + 77] {
                salt += 1;
                let inputs: Vec<Buffer> = (0..n).map(|r| input(d, r, len, salt)).collect();
                let mut buf = shared_buffer(&inputs[rank]);
                transport.all_reduce(&mut buf, op, "in place").unwrap();
                assert_same(
                    &buf,
                    &reference_reduce(&inputs, op),
                    &format!("rank {rank}/{n} {d} {op} x {len}"),
                );
                non_empty += u64::from(len > 0);
            }
        }
    }
    let want = if heap_on { non_empty } else { 0 };
    assert_eq!(
        transport.in_place_all_reduces(),
        want,
        "rank {rank}: all-reduces in place"
    );
}

/// `buf` copied into a `host_vec` (see [`shared_copy`]).
fn shared_buffer(buf: &Buffer) -> Buffer {
    match buf {
        Buffer::F32(v) => Buffer::F32(shared_copy(v)),
        Buffer::F16(v) => Buffer::F16(shared_copy(v)),
        Buffer::BF16(v) => Buffer::BF16(shared_copy(v)),
        other => panic!("{other:?}"),
    }
}

/// `v` copied into a `host_vec` (this rank's shared heap when it has one).
fn shared_copy<T: Copy + Default>(v: &[T]) -> Vec<T> {
    let mut out = brigade_comm::host_vec(v.len(), T::default());
    out.copy_from_slice(v);
    out
}

/// The hierarchical all-reduce against the flat one, on the same inputs: within f32
/// tolerance (the order of the additions differs: in the node first, then across nodes).
fn hierarchy(world: &MpiWorld) {
    let opts = |shared_memory, node_size| MpiOptions {
        timeout: TIMEOUT,
        shared_memory,
        node_size,
    };
    let mut flat = world.transport_with(&opts(false, None)).unwrap();
    let mut hier = world.transport_with(&opts(true, Some(2))).unwrap();
    assert_eq!(flat.path(), MpiPath::Mpi);
    assert_eq!(hier.path(), MpiPath::Hierarchical);
    assert_eq!(hier.node_size(), 2);
    let (rank, n) = (world.rank(), world.world_size());
    // Inputs whose sums round differently in another order (not multiples of a power of 2).
    let x = |r: usize, i: usize, salt: usize| value(r, i, salt) * 1.000_123 + (i % 7) as f32 * 0.013_7;
    // Odd lengths, one of them several blocks of the segment for every dtype.
    let mut salt = 0;
    for &d in &DTYPES {
        for &op in &OPS {
            for len in [1, 3, 1031, 3 * 65_536 + 77] {
                salt += 1;
                let mine = from_f32(d, (0..len).map(|i| x(rank, i, salt)).collect());
                let mut a = mine.clone();
                let mut b = mine;
                flat.all_reduce(&mut a, op, "flat").unwrap();
                hier.all_reduce(&mut b, op, "hier").unwrap();
                let (a, b) = (to_f32(&a), to_f32(&b));
                for i in 0..len {
                    let abs_sum: f32 = (0..n).map(|r| to_f32(&from_f32(d, vec![x(r, i, salt)]))[0].abs()).sum();
                    // Two orders of n - 1 f32 additions, then at most one step of rounding to
                    // the dtype apart.
                    let big = a[i].abs().max(b[i].abs());
                    let ulp = match d {
                        DType::F32 => 0.0,
                        DType::F16 => big.max(6.1e-5) * 2f32.powi(-10),
                        _ => big * 2f32.powi(-7),
                    };
                    let tol = 2.0 * (n as f32) * f32::EPSILON * abs_sum + ulp;
                    let ok = if op == ReduceOp::Max {
                        a[i] == b[i]
                    } else {
                        (a[i] - b[i]).abs() <= tol
                    };
                    assert!(
                        ok,
                        "rank {rank} {d} {op} x {len}: element {i} is {} hierarchically but {} flat (tolerance {tol})",
                        b[i], a[i]
                    );
                }
            }
        }
    }
    // Buffers in the shared heaps: inside each node the reduce-scatter and the all-gather run in
    // place, to the same bits as through the slots; also when only one node's buffers are in
    // its heaps (the shards the nodes reduce between them keep one layout).
    let before = hier.in_place_all_reduces();
    for mixed in [false, true] {
        for &d in &DTYPES {
            for &op in &OPS {
                salt += 1;
                let len = 3 * 65_536 + 77;
                let mine = from_f32(d, (0..len).map(|i| x(rank, i, salt)).collect());
                let mut slots = mine.clone();
                hier.all_reduce(&mut slots, op, "slots").unwrap();
                let mut heap = if mixed && rank >= 2 { mine } else { shared_buffer(&mine) };
                hier.all_reduce(&mut heap, op, "heap").unwrap();
                assert_same(&heap, &slots, &format!("rank {rank} {d} {op} x {len}, mixed {mixed}"));
            }
        }
    }
    // 9 in place on every rank; 9 more on the node whose buffers were all in its heaps.
    let want = if rank < 2 { 18 } else { 9 };
    assert_eq!(hier.in_place_all_reduces() - before, want, "rank {rank}: in place");
    // Both still agree on what comes next: a mismatch on the hierarchical path fails every
    // rank with the same error as the flat one.
    let len = if rank == 3 { 5 } else { 4 };
    let err = hier
        .all_reduce(&mut Buffer::F32(vec![1.0; len]), ReduceOp::Sum, "odd one")
        .unwrap_err();
    assert!(
        matches!(err, CommError::Mismatch { found_rank: 3, .. }),
        "rank {rank}: {err}"
    );
}
