//! The comm stream: asynchronous issue, in-order execution, ownership round trip, observers,
//! object safety, and who runs a collective (a caller that waits at once, or the worker).

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
        let comm = Arc::new(comm);
        let work = comm.all_reduce(Buffer::F32(vec![comm.rank() as f32; 4]), ReduceOp::Max, "dyn");
        let buf = std::thread::scope(|s| s.spawn(move || work.wait()).join().unwrap()).unwrap();
        assert_eq!(buf, Buffer::F32(vec![1.0; 4]));
    })
    .into_iter()
    .for_each(|r| r.unwrap());
}

/// A one-rank transport that notes which thread ran each collective, and can hold one until
/// released.
struct Noting {
    ran: Ran,
    hold: Option<std::sync::mpsc::Receiver<()>>,
}

impl brigade_comm::Transport for Noting {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn all_reduce(&mut self, _buf: &mut Buffer, _op: ReduceOp, tag: &str) -> Result<(), brigade_comm::CommError> {
        if tag == "held" {
            if let Some(hold) = &self.hold {
                let _ = hold.recv_timeout(TIMEOUT);
            }
        }
        let thread = std::thread::current().name().unwrap_or("?").to_string();
        self.ran.lock().unwrap().push((tag.to_string(), thread));
        Ok(())
    }
    fn broadcast(&mut self, _: &mut Buffer, _: usize, _: &str) -> Result<(), brigade_comm::CommError> {
        Ok(())
    }
    fn all_gather(&mut self, _: &mut Buffer, _: &str) -> Result<(), brigade_comm::CommError> {
        Ok(())
    }
    fn reduce_scatter(&mut self, _: &mut Buffer, _: ReduceOp, _: &str) -> Result<(), brigade_comm::CommError> {
        Ok(())
    }
    fn barrier(&mut self, _: &str) -> Result<(), brigade_comm::CommError> {
        Ok(())
    }
}

/// Which collective (tag) ran on which thread (name), in the order they ran.
type Ran = Arc<Mutex<Vec<(String, String)>>>;

fn noting(hold: Option<std::sync::mpsc::Receiver<()>>) -> (brigade_comm::CommStream<Noting>, Ran) {
    let ran = Arc::new(Mutex::new(Vec::new()));
    let stream = brigade_comm::CommStream::new(Noting { ran: ran.clone(), hold }, TIMEOUT);
    (stream, ran)
}

fn one() -> Buffer {
    Buffer::F32(vec![1.0])
}

/// Waiting for a collective that is next in line on an idle stream runs it on the waiting
/// thread (no hand-off to the worker and back); one issued ahead runs on the worker while the
/// caller does something else.
#[test]
fn a_collective_waited_for_at_once_runs_on_the_waiting_thread() {
    std::thread::Builder::new()
        .name("caller".into())
        .spawn(|| {
            let (stream, ran) = noting(None);
            for i in 0..50 {
                stream
                    .all_reduce(one(), ReduceOp::Sum, &format!("now {i}"))
                    .wait()
                    .unwrap();
            }
            let ahead = stream.all_reduce(one(), ReduceOp::Sum, "ahead");
            let t = Instant::now();
            while !ahead.is_completed() && t.elapsed() < TIMEOUT {
                std::thread::sleep(Duration::from_millis(1)); // the caller computes meanwhile
            }
            ahead.wait().unwrap();
            let ran = ran.lock().unwrap().clone();
            let on_caller = ran
                .iter()
                .filter(|(tag, thread)| tag.starts_with("now") && thread == "caller")
                .count();
            // The worker may win the race for some of them (it is woken at every issue, and the
            // caller may lose its core between issue and wait on a busy machine).
            assert!(
                on_caller >= 25,
                "only {on_caller} of 50 ran on the waiting thread: {ran:?}"
            );
            assert_eq!(ran.last().unwrap(), &("ahead".to_string(), "comm-stream-0".to_string()));
        })
        .unwrap()
        .join()
        .unwrap();
}

/// A blocking all-reduce on an idle stream runs on the calling thread, every time (the worker
/// is not woken to race for it); one issued while the stream is busy waits its turn behind the
/// others, and runs after them.
#[test]
fn a_blocking_all_reduce_runs_on_the_caller_unless_the_stream_is_busy() {
    std::thread::Builder::new()
        .name("caller".into())
        .spawn(|| {
            let (release, hold) = std::sync::mpsc::channel();
            let (stream, ran) = noting(Some(hold));
            for i in 0..1000 {
                stream
                    .all_reduce_blocking(one(), ReduceOp::Sum, &format!("now {i}"))
                    .unwrap();
            }
            let held = stream.all_reduce(one(), ReduceOp::Sum, "held");
            std::thread::sleep(Duration::from_millis(50)); // the worker has taken "held"
            let releaser = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                release.send(()).unwrap();
            });
            stream.all_reduce_blocking(one(), ReduceOp::Sum, "behind").unwrap();
            held.wait().unwrap();
            releaser.join().unwrap();
            let ran = ran.lock().unwrap().clone();
            let off_caller: Vec<_> = ran
                .iter()
                .filter(|(tag, thread)| tag.starts_with("now") && thread != "caller")
                .collect();
            assert!(off_caller.is_empty(), "ran on the worker: {off_caller:?}");
            let tags: Vec<&str> = ran[1000..].iter().map(|(t, _)| t.as_str()).collect();
            assert_eq!(tags, ["held", "behind"]);
        })
        .unwrap()
        .join()
        .unwrap();
}

/// A waiter never runs a collective out of turn, nor one that a shorter wait could not see
/// through: while an earlier collective is running, a later one waits its turn.
#[test]
fn a_waiter_runs_only_the_next_collective_in_line() {
    let (release, hold) = std::sync::mpsc::channel();
    let (stream, ran) = noting(Some(hold));
    let held = stream.all_reduce(one(), ReduceOp::Sum, "held");
    let next = stream.all_reduce(one(), ReduceOp::Sum, "next");
    std::thread::sleep(Duration::from_millis(50)); // the worker has taken "held"
    let err = next.wait_timeout(Duration::from_millis(50)).unwrap_err();
    assert!(matches!(err, brigade_comm::CommError::Timeout { .. }), "{err}");
    release.send(()).unwrap();
    held.wait().unwrap();
    let later = stream.all_reduce(one(), ReduceOp::Sum, "later");
    later.wait().unwrap();
    let tags: Vec<String> = ran.lock().unwrap().iter().map(|(t, _)| t.clone()).collect();
    assert_eq!(tags, ["held", "next", "later"]);
}
