//! The comm stream: asynchronous issue, in-order execution, ownership round trip, observers,
//! object safety.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use brigade_comm::{run_on_threads_with_timeout, Buffer, Communicator, ReduceOp, Work, WorkEvent};

const TIMEOUT: Duration = Duration::from_secs(20);

#[test]
fn collectives_run_in_issue_order() {
    run_on_threads_with_timeout(3, TIMEOUT, |comm| {
        let works: Vec<Work<Buffer>> = (0..24)
            .map(|k| {
                let n = [10, 100_000, 1, 5000][k % 4];
                comm.all_reduce(Buffer::F32(vec![k as f32; n]), ReduceOp::Sum, &format!("op {k}"))
            })
            .collect();
        let mut works = works;
        let last = works.pop().unwrap();
        last.wait().unwrap();
        assert!(
            works.iter().all(|w| w.is_completed()),
            "an earlier collective was still pending"
        );
        let timings: Vec<_> = works
            .into_iter()
            .enumerate()
            .map(|(k, w)| {
                let (buf, t) = w.wait_timed().unwrap();
                assert!(buf.as_f32().unwrap().iter().all(|&x| x == 3.0 * k as f32));
                t
            })
            .collect();
        for pair in timings.windows(2) {
            assert!(
                pair[1].started >= pair[0].finished,
                "collectives overlapped on the stream"
            );
        }
    })
    .into_iter()
    .for_each(|r| r.unwrap());
}

#[test]
fn issuing_returns_at_once_and_the_caller_keeps_computing() {
    // Rank 1 issues only after rank 0's issue has returned and rank 0 has checked its handle:
    // an issue that blocked until the collective completed would never get there (and the
    // test would fail with a timeout), whatever the machine's load. No clock involved.
    let issued = AtomicBool::new(false);
    let gate = AtomicBool::new(false);
    run_on_threads_with_timeout(2, TIMEOUT, |comm| {
        if comm.rank() == 1 {
            // (a deadline, not a barrier: if rank 0 fails first, this rank fails too, no hang)
            let deadline = Instant::now() + TIMEOUT * 2;
            while !gate.load(Ordering::SeqCst) {
                assert!(Instant::now() < deadline, "rank 0 never got past its issue");
                std::thread::sleep(Duration::from_millis(1));
            }
            issued.store(true, Ordering::SeqCst);
        }
        let work = comm.all_reduce(Buffer::F32(vec![1.0; 1 << 16]), ReduceOp::Sum, "bucket 0");
        if comm.rank() == 0 {
            assert!(!work.is_completed(), "completed before rank 1 issued");
            assert!(work.timing().is_none());
            gate.store(true, Ordering::SeqCst);
        }
        let buf = work.wait().unwrap();
        assert!(issued.load(Ordering::SeqCst));
        assert!(buf.as_f32().unwrap().iter().all(|&x| x == 2.0));
    })
    .into_iter()
    .for_each(|r| r.unwrap());
}

#[test]
fn observers_hear_start_and_finish_without_wait_and_dropped_work_still_runs() {
    run_on_threads_with_timeout(2, TIMEOUT, |comm| {
        let log = Arc::new(Mutex::new(Vec::new()));
        let work = comm.all_reduce(Buffer::F32(vec![1.0; 1000]), ReduceOp::Sum, "observed");
        let sink = log.clone();
        work.observe(move |e| {
            sink.lock().unwrap().push(match e {
                WorkEvent::Started(_) => "started",
                WorkEvent::Finished { error: None, .. } => "finished",
                WorkEvent::Finished { error: Some(_), .. } => "failed",
            })
        });
        drop(work);
        comm.barrier("after").wait().unwrap();
        assert_eq!(*log.lock().unwrap(), vec!["started", "finished"]);
    })
    .into_iter()
    .for_each(|r| r.unwrap());
}

#[test]
fn works_through_arc_dyn_communicator_and_handles_are_send() {
    fn assert_send<T: Send>() {}
    assert_send::<Work<Buffer>>();
    assert_send::<Work<()>>();
    run_on_threads_with_timeout(2, TIMEOUT, |comm| {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let work = comm.all_reduce(Buffer::F32(vec![comm.rank() as f32; 4]), ReduceOp::Max, "dyn");
        let buf = std::thread::scope(|s| s.spawn(move || work.wait()).join().unwrap()).unwrap();
        assert_eq!(buf, Buffer::F32(vec![1.0; 4]));
    })
    .into_iter()
    .for_each(|r| r.unwrap());
}
