//! One simulated link per group: every rank sees each collective start and finish at the same
//! instants, so per-bucket link times add up to the ring model's time for the whole gradient,
//! however the ranks' compute threads are scheduled.

use std::time::{Duration, Instant};

use brigade_comm::{run_on_threads_with_timeout, Buffer, NetModel, OpTiming, ReduceOp, SharedLink};

const TIMEOUT: Duration = Duration::from_secs(60);

/// Bucket sizes in f32 elements: a large first one, then smaller ones, as a backward pass
/// hands them out.
const BUCKETS: [usize; 5] = [1 << 17, 1 << 15, 1 << 16, 1 << 12, 1 << 14];

fn model() -> NetModel {
    NetModel {
        latency: Duration::from_micros(20),
        bandwidth_bytes_per_s: 200e6,
    }
}

/// Each rank issues the buckets with a rank-dependent pause before some of them (a rank that
/// runs its backward late), and returns every collective's timing.
fn run(shared: bool) -> Vec<Vec<OpTiming>> {
    let link = SharedLink::new(model());
    run_on_threads_with_timeout(2, TIMEOUT, |comm| {
        let rank = comm.rank();
        let sim = if shared {
            comm.on_link(&link)
        } else {
            comm.simulated(model())
        };
        let mut works = vec![];
        for (i, &n) in BUCKETS.iter().enumerate() {
            if (i + rank) % 2 == 1 {
                std::thread::sleep(Duration::from_millis(3));
            }
            works.push(sim.all_reduce(Buffer::F32(vec![1.0; n]), ReduceOp::Sum, &format!("bucket{i}")));
        }
        works.into_iter().map(|w| w.wait_timed().unwrap().1).collect::<Vec<_>>()
    })
    .into_iter()
    .map(|r| r.unwrap())
    .collect()
}

/// Sum over buckets of "finished on rank 0" minus "the last rank started it": the sweep's
/// per-bucket link time.
fn summed_bucket_time(t: &[Vec<OpTiming>]) -> Duration {
    (0..BUCKETS.len())
        .map(|b| {
            let joined: Instant = t.iter().map(|r| r[b].started).max().unwrap();
            t[0][b].finished.saturating_duration_since(joined)
        })
        .sum()
}

#[test]
fn every_rank_sees_one_start_and_one_finish_per_collective() {
    let t = run(true);
    for b in 0..BUCKETS.len() {
        assert_eq!(
            t[0][b].started, t[1][b].started,
            "bucket {b} started at different instants"
        );
        assert_eq!(
            t[0][b].finished, t[1][b].finished,
            "bucket {b} finished at different instants"
        );
    }
    // the link carries one collective at a time, in issue order
    for b in 1..BUCKETS.len() {
        assert!(
            t[0][b].started >= t[0][b - 1].finished,
            "bucket {b} overlapped bucket {}",
            b - 1
        );
    }
}

#[test]
fn bucket_times_add_up_to_the_model_time_of_the_whole_gradient() {
    let m = model();
    let want: Duration = BUCKETS.iter().map(|&n| m.all_reduce_time(4 * n, 2)).sum();
    let got = summed_bucket_time(&run(true));
    let err = (got.as_secs_f64() - want.as_secs_f64()).abs() / want.as_secs_f64();
    assert!(
        err <= 0.01,
        "buckets took {got:?} on the link, the ring model says {want:?} ({:.2}% off)",
        100.0 * err
    );
}

#[test]
fn a_new_rank_local_link_is_not_shared() {
    // The control: with a link per rank, the ranks' slots differ when their compute is skewed
    // (what the shared link exists to fix), so the tests above can tell the two apart.
    let t = run(false);
    let differs =
        (0..BUCKETS.len()).any(|b| t[0][b].started != t[1][b].started || t[0][b].finished != t[1][b].finished);
    assert!(
        differs,
        "per-rank links agreed to the nanosecond: the control cannot tell them apart"
    );
}

#[test]
fn a_blocking_all_reduce_on_the_caller_takes_its_slot_on_the_shared_link() {
    // rank 0 agrees through the blocking call (on its own thread: its stream and link are
    // idle), rank 1 through the stream's work; the next collective of each is the same slot
    let link = SharedLink::new(model());
    let t = run_on_threads_with_timeout(2, TIMEOUT, |comm| {
        let sim = comm.on_link(&link);
        let agreed = if sim.rank() == 0 {
            sim.all_reduce_blocking(Buffer::F32(vec![1.0; 3]), ReduceOp::Sum, "agree")
                .unwrap()
        } else {
            sim.all_reduce(Buffer::F32(vec![1.0; 3]), ReduceOp::Sum, "agree")
                .wait()
                .unwrap()
        };
        assert_eq!(agreed.as_f32().unwrap(), &[2.0; 3]);
        let next = sim.all_reduce(Buffer::F32(vec![1.0; 1 << 12]), ReduceOp::Sum, "next");
        next.wait_timed().unwrap().1
    })
    .into_iter()
    .map(|r| r.unwrap())
    .collect::<Vec<_>>();
    assert_eq!(t[0].started, t[1].started, "the next collective took other slots");
    assert_eq!(t[0].finished, t[1].finished);
    let link_s = (t[0].finished - t[0].started).as_secs_f64();
    let want = model().time(brigade_comm::RingOp::AllReduce, 4 << 12, 2).as_secs_f64();
    assert!(
        (link_s - want).abs() < 1e-6,
        "{link_s} s on the link, the model says {want} s"
    );
}

#[test]
fn a_timed_blocking_all_reduce_returns_the_slot_every_rank_shares() {
    // rank 0 agrees through the blocking call on its own thread, rank 1 after a pause (it comes
    // late) through the same call: each returns when its own thread got back, and both report
    // the one slot, starting when the last rank came and lasting the model's time
    let link = SharedLink::new(model());
    let t = run_on_threads_with_timeout(2, TIMEOUT, |comm| {
        let sim = comm.on_link(&link);
        if sim.rank() == 1 {
            std::thread::sleep(Duration::from_millis(3));
        }
        let (agreed, timing) = sim
            .all_reduce_blocking_timed(Buffer::F32(vec![1.0; 3]), ReduceOp::Sum, "agree")
            .unwrap();
        assert_eq!(agreed.as_f32().unwrap(), &[2.0; 3]);
        timing
    })
    .into_iter()
    .map(|r| r.unwrap())
    .collect::<Vec<_>>();
    assert_eq!(t[0].started, t[1].started, "the ranks report other slots");
    assert_eq!(t[0].finished, t[1].finished);
    let link_s = (t[0].finished - t[0].started).as_secs_f64();
    let want = model().time(brigade_comm::RingOp::AllReduce, 12, 2).as_secs_f64();
    assert!(
        (link_s - want).abs() < 1e-6,
        "{link_s} s on the link, the model says {want} s"
    );
}

#[test]
fn a_collectives_slot_counts_from_when_the_last_comm_thread_took_it_up() {
    // Each rank first queues a 64 MiB all-reduce on a plain handle of its stream (no link), then
    // a 64 MiB one on the link, so fast that its model time is microseconds. The comm thread
    // takes the second up only once the first is done: the slot cannot start before that. Its
    // real transfer (tens of milliseconds of copying and summing) then runs inside the slot, as
    // a network's transfer is its link time: the slot starts well before the data has moved.
    let model = NetModel {
        latency: Duration::ZERO,
        bandwidth_bytes_per_s: 1e15,
    };
    let n = 16 << 20;
    let link = SharedLink::new(model);
    let t = run_on_threads_with_timeout(2, TIMEOUT, |comm| {
        let sim = comm.on_link(&link);
        let (first, second) = (Buffer::F32(vec![1.0; n]), Buffer::F32(vec![1.0; n]));
        let busy = sim.plain().all_reduce(first, ReduceOp::Sum, "busy");
        let work = sim.all_reduce(second, ReduceOp::Sum, "big");
        let (_, busy) = busy.wait_timed().unwrap();
        let (sum, timing) = work.wait_timed().unwrap();
        let moved = Instant::now();
        assert_eq!(sum.as_f32().unwrap()[n - 1], 2.0);
        (busy.finished, timing, moved)
    })
    .into_iter()
    .map(|r| r.unwrap())
    .collect::<Vec<_>>();
    let started = t[0].1.started;
    for (rank, (busy_done, _, _)) in t.iter().enumerate() {
        assert!(
            started >= *busy_done,
            "the slot started {:?} before rank {rank}'s comm thread was free to take it up",
            busy_done.duration_since(started)
        );
    }
    let moved = t.iter().map(|r| r.2).min().unwrap();
    assert!(
        moved.duration_since(started) >= Duration::from_millis(1),
        "the slot started only {:?} before the data had moved: it waited for the transfer",
        moved.duration_since(started)
    );
}
