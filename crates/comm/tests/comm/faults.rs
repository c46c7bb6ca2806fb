//! Faults: timeouts, dead ranks and mismatched collectives fail promptly with an error that
//! names the rank and the tag; nothing hangs.

use std::sync::Barrier;
use std::time::{Duration, Instant};

use brigade_comm::{run_on_threads_with_timeout, Buffer, CommError, Communicator, ReduceOp};

/// Long enough that a test which only passes by timing out would be noticed.
const LONG: Duration = Duration::from_secs(30);

fn f32s(n: usize, x: f32) -> Buffer {
    Buffer::F32(vec![x; n])
}

#[test]
fn a_missing_peer_times_out_and_then_counts_as_dead() {
    let timeout = Duration::from_millis(300);
    let gate = Barrier::new(2);
    let results = run_on_threads_with_timeout(2, timeout, |comm| {
        if comm.rank() == 0 {
            let t = Instant::now();
            // Waiting far longer than the group timeout: the stream's own wait must give up.
            let work = comm.all_reduce(f32s(8, 1.0), ReduceOp::Sum, "bucket 7");
            let err = work.wait_timeout(LONG).unwrap_err();
            let elapsed = t.elapsed();
            gate.wait();
            (Some(err), elapsed)
        } else {
            // Rank 1 stays alive but issues nothing until rank 0 gave up.
            gate.wait();
            let t = Instant::now();
            let err = comm
                .all_reduce(f32s(8, 1.0), ReduceOp::Sum, "bucket 7")
                .wait()
                .unwrap_err();
            (Some(err), t.elapsed())
        }
    });
    let (err0, t0) = results[0].as_ref().unwrap();
    match err0.as_ref().unwrap() {
        CommError::Timeout { rank: 0, tag, .. } => assert_eq!(tag, "bucket 7"),
        e => panic!("rank 0 expected a timeout, got {e}"),
    }
    // It gave up at the group timeout, not at the end of its own much longer wait (bounds
    // that a loaded machine cannot break: the two candidates are 100 times apart).
    assert!(*t0 >= timeout && *t0 < LONG / 2, "rank 0 waited {t0:?}");
    let (err1, t1) = results[1].as_ref().unwrap();
    match err1.as_ref().unwrap() {
        CommError::RankFailed { rank: 0, reason, .. } => assert!(reason.contains("timed out"), "{reason}"),
        e => panic!("rank 1 expected rank 0 dead, got {e}"),
    }
    // Rank 1 failed because rank 0 is dead, not after a timeout of its own (that would be a
    // `Timeout` naming rank 1, checked above).
    assert!(*t1 < LONG / 2, "rank 1 should fail at once, took {t1:?}");
}

#[test]
fn wait_timeout_returns_while_the_collective_is_pending() {
    let gate = Barrier::new(2);
    let results = run_on_threads_with_timeout(2, LONG, |comm| {
        if comm.rank() == 0 {
            // Rank 1 joins only after this wait gave up: it cannot return by completing.
            let work = comm.barrier("late peer");
            let t = Instant::now();
            let err = work.wait_timeout(Duration::from_millis(50)).unwrap_err();
            let waited = t.elapsed();
            gate.wait();
            (Err(err), waited)
        } else {
            gate.wait();
            // The collective rank 0 stopped waiting for still runs and completes on both ranks.
            (comm.barrier("late peer").wait(), Duration::ZERO)
        }
    });
    match results[0].as_ref().unwrap() {
        (Err(CommError::Timeout { rank: 0, tag, after }), waited) => {
            assert_eq!(tag, "late peer");
            assert_eq!(*after, Duration::from_millis(50));
            assert!(*waited >= *after && *waited < LONG / 2, "waited {waited:?}");
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    match results[1].as_ref().unwrap() {
        (Ok(()), _) => {}
        other => panic!("rank 1: the barrier rank 0 stopped waiting for must still complete, got {other:?}"),
    }
}

#[test]
fn a_panicking_rank_fails_the_others_promptly() {
    let t = Instant::now();
    let results = run_on_threads_with_timeout(4, LONG, |comm| {
        if comm.rank() == 2 {
            panic!("rank 2 blew up");
        }
        let first = comm.all_reduce(f32s(1000, 1.0), ReduceOp::Sum, "bucket 0").wait();
        let later = comm.barrier("after the crash").wait();
        (first, later)
    });
    // Promptly: well before the 30 s timeout a hang would run into.
    assert!(t.elapsed() < LONG / 2, "took {:?}", t.elapsed());
    for (rank, result) in results.into_iter().enumerate() {
        if rank == 2 {
            match result {
                Err(CommError::Panicked { rank: 2, message }) => assert!(message.contains("blew up")),
                other => panic!("rank 2: {:?}", other.map(|_| ())),
            }
            continue;
        }
        let (first, later) = result.unwrap();
        for (err, tag) in [
            (first.unwrap_err(), "bucket 0"),
            (later.unwrap_err(), "after the crash"),
        ] {
            match &err {
                CommError::RankFailed {
                    rank: 2,
                    tag: t,
                    reason,
                } => {
                    assert_eq!(t, tag);
                    assert!(reason.contains("panicked"), "{reason}");
                    assert!(err.to_string().contains("rank 2"), "{err}");
                }
                e => panic!("rank {rank}: expected rank 2 dead, got {e}"),
            }
        }
    }
}

#[test]
fn a_rank_returning_early_fails_pending_collectives() {
    let t = Instant::now();
    let results = run_on_threads_with_timeout(3, LONG, |comm| {
        if comm.rank() == 1 {
            std::thread::sleep(Duration::from_millis(100));
            return None; // drops its communicator
        }
        Some(comm.all_reduce(f32s(10, 1.0), ReduceOp::Avg, "bucket 3").wait())
    });
    assert!(t.elapsed() < LONG / 2, "took {:?}", t.elapsed());
    for rank in [0, 2] {
        match results[rank].as_ref().unwrap().as_ref().unwrap() {
            Err(CommError::RankFailed { rank: 1, tag, reason }) => {
                assert_eq!(tag, "bucket 3");
                assert!(reason.contains("dropped"), "{reason}");
            }
            other => panic!("rank {rank}: {other:?}"),
        }
    }
}

#[test]
fn a_rank_leaving_after_its_last_collective_does_not_fail_peers() {
    for _ in 0..20 {
        let results = run_on_threads_with_timeout(3, LONG, |comm| {
            let out = comm.all_reduce(f32s(64, 1.0), ReduceOp::Sum, "last").wait();
            if comm.rank() != 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
            out
        });
        for r in results {
            assert_eq!(r.unwrap().unwrap(), f32s(64, 3.0));
        }
    }
}

#[test]
fn mismatched_collectives_are_reported_not_mixed() {
    // (rank 0's collective, rank 1's collective, text rank 1's side must mention)
    type Issue = fn(&dyn Communicator) -> Result<(), CommError>;
    let cases: Vec<(Issue, Issue, &str)> = vec![
        (
            |c| c.all_reduce(f32s(10, 1.0), ReduceOp::Sum, "bucket 0").wait().map(drop),
            |c| c.all_reduce(f32s(12, 1.0), ReduceOp::Sum, "bucket 0").wait().map(drop),
            "12 x f32",
        ),
        (
            // A small all-reduce (one rendezvous) against a large one (two): still one verdict.
            |c| c.all_reduce(f32s(10, 1.0), ReduceOp::Sum, "bucket 0").wait().map(drop),
            |c| {
                c.all_reduce(f32s(1 << 18, 1.0), ReduceOp::Sum, "bucket 0")
                    .wait()
                    .map(drop)
            },
            "262144 x f32",
        ),
        (
            |c| c.all_reduce(f32s(10, 1.0), ReduceOp::Sum, "bucket 0").wait().map(drop),
            |c| c.all_reduce(f32s(10, 1.0), ReduceOp::Sum, "bucket 1").wait().map(drop),
            "bucket 1",
        ),
        (
            |c| c.all_reduce(f32s(10, 1.0), ReduceOp::Sum, "x").wait().map(drop),
            |c| c.broadcast(f32s(10, 1.0), 0, "x").wait().map(drop),
            "broadcast",
        ),
        (
            |c| c.all_reduce(f32s(10, 1.0), ReduceOp::Sum, "x").wait().map(drop),
            |c| {
                c.all_reduce(Buffer::zeros(brigade_comm::DType::F16, 10), ReduceOp::Sum, "x")
                    .wait()
                    .map(drop)
            },
            "f16",
        ),
        (
            |c| c.all_reduce(f32s(10, 1.0), ReduceOp::Sum, "x").wait().map(drop),
            |c| c.all_reduce(f32s(10, 1.0), ReduceOp::Max, "x").wait().map(drop),
            "max",
        ),
    ];
    for (i, (zero, one, found_text)) in cases.into_iter().enumerate() {
        let results = run_on_threads_with_timeout(2, LONG, |comm| {
            let err = if comm.rank() == 0 { zero(&comm) } else { one(&comm) }.unwrap_err();
            // The slot was consumed consistently: the group still works.
            let ok = comm.all_reduce(f32s(3, 1.0), ReduceOp::Sum, "after").wait().unwrap();
            (err, ok)
        });
        for r in results {
            let (err, ok) = r.unwrap();
            match &err {
                CommError::Mismatch {
                    expected_rank: 0,
                    found_rank: 1,
                    found,
                    slot: 0,
                    ..
                } => {
                    assert!(found.contains(found_text), "case {i}: {err}")
                }
                e => panic!("case {i}: expected a mismatch, got {e}"),
            }
            assert_eq!(ok, f32s(3, 2.0));
        }
    }
}
