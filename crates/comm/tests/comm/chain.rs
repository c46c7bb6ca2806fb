//! Chaining work after a collective without blocking the caller (`Work::then`, `and_then`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use brigade_comm::{run_on_threads_with_timeout, Buffer, CommError, Communicator, ReduceOp, Work};

const TIMEOUT: Duration = Duration::from_secs(30);

#[test]
fn then_transforms_the_result_once_the_collective_completes() {
    run_on_threads_with_timeout(2, TIMEOUT, |comm| {
        let r = comm.rank() as f32;
        // sum of [1+r, 2+r] over ranks 0 and 1 = [3, 5]; the step halves it
        let work = comm
            .all_reduce(Buffer::F32(vec![1.0 + r, 2.0 + r]), ReduceOp::Sum, "halve")
            .then(|b| {
                let v = b.into_f32().expect("f32 in, f32 out");
                Ok(v.into_iter().map(|x| x / 2.0).collect::<Vec<f32>>())
            });
        assert_eq!(work.wait().unwrap(), vec![1.5, 2.5]);
    })
    .into_iter()
    .for_each(|r| r.unwrap());
}

#[test]
fn then_does_not_block_the_caller_and_runs_after_completion() {
    // Rank 1 issues its half of the collective only once rank 0's `then` has returned and
    // rank 0 has seen that its step has not run: a `then` that blocked until the collective
    // completed would never return (and the test would fail at the deadline), whatever the
    // machine's load. No clock involved.
    let returned = AtomicBool::new(false);
    run_on_threads_with_timeout(2, TIMEOUT, |comm| {
        if comm.rank() == 1 {
            // (a deadline, not a barrier: if rank 0 fails first, this rank fails too, no hang)
            let deadline = Instant::now() + TIMEOUT;
            while !returned.load(Ordering::SeqCst) {
                assert!(Instant::now() < deadline, "rank 0's then never returned");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        let ran = Arc::new(AtomicBool::new(false));
        let flag = ran.clone();
        let work = comm
            .all_reduce(Buffer::F32(vec![1.0]), ReduceOp::Sum, "late peer")
            .then(move |b| {
                flag.store(true, Ordering::SeqCst);
                Ok(b)
            });
        if comm.rank() == 0 {
            assert!(
                !ran.load(Ordering::SeqCst),
                "the step ran before the collective completed"
            );
            returned.store(true, Ordering::SeqCst);
        }
        assert_eq!(work.wait().unwrap().as_f32().unwrap(), &[2.0]);
        assert!(ran.load(Ordering::SeqCst));
    })
    .into_iter()
    .for_each(|r| r.unwrap());
}

#[test]
fn errors_pass_through_the_chain_and_a_failing_step_fails_the_work() {
    run_on_threads_with_timeout(2, TIMEOUT, |comm| {
        // a root out of range fails the collective itself: the step never runs
        let failed: Work<Buffer> = comm
            .broadcast(Buffer::F32(vec![1.0]), 7, "bad root")
            .then(|_| panic!("must not run"));
        assert!(matches!(failed.wait(), Err(CommError::InvalidArgument(_))));
        // a step's own error completes the chained work with it
        let refused = comm
            .all_reduce(Buffer::F32(vec![1.0]), ReduceOp::Sum, "refused")
            .then(|_| -> Result<(), CommError> { Err(CommError::Unsupported("decompression failed".into())) });
        assert!(matches!(refused.wait(), Err(CommError::Unsupported(m)) if m.contains("decompression")));
    })
    .into_iter()
    .for_each(|r| r.unwrap());
}

#[test]
fn and_then_issues_the_next_collective_and_completes_with_its_result() {
    run_on_threads_with_timeout(3, TIMEOUT, |comm| {
        let comm = Arc::new(comm);
        let c2 = comm.clone();
        let r = comm.rank() as f32;
        // first: sum of r = 3; then each rank adds its rank and the second sum is 3*3 + 3 = 12
        let work = comm
            .all_reduce(Buffer::F32(vec![r]), ReduceOp::Sum, "first")
            .and_then(move |b| {
                let s = b.as_f32().unwrap()[0];
                Ok(c2.all_reduce(Buffer::F32(vec![s + c2.rank() as f32]), ReduceOp::Sum, "second"))
            });
        assert_eq!(work.wait().unwrap().as_f32().unwrap(), &[12.0]);
    })
    .into_iter()
    .for_each(|r| r.unwrap());
}

#[test]
fn chaining_after_completion_runs_the_step_at_once() {
    run_on_threads_with_timeout(1, TIMEOUT, |comm| {
        let work = comm.all_reduce(Buffer::F32(vec![4.0]), ReduceOp::Sum, "done");
        while !work.is_completed() {
            std::thread::sleep(Duration::from_millis(1));
        }
        let chained = work.then(|b| Ok(b.as_f32().unwrap()[0] * 2.0));
        assert!(
            chained.is_completed(),
            "the step should have run on the caller's thread"
        );
        assert_eq!(chained.wait().unwrap(), 8.0);
    })
    .into_iter()
    .for_each(|r| r.unwrap());
}
