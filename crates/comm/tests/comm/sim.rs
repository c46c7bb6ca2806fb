//! Simulated network: collectives take at least the ring-model time, back-to-back collectives
//! queue on the link, and the simulated wait leaves the CPU to compute.

use std::time::{Duration, Instant};

use brigade_comm::{run_on_threads_with_timeout, Buffer, NetModel, ReduceOp};

const TIMEOUT: Duration = Duration::from_secs(20);

#[test]
fn model_times_follow_the_ring_formulas() {
    let m = NetModel {
        latency: Duration::from_micros(10),
        bandwidth_bytes_per_s: 1e9,
    };
    // 2(p-1)a + 2(p-1)/p n/B with p = 4, n = 1e6: 60 us + 1.5 ms.
    assert_eq!(m.all_reduce_time(1_000_000, 4), Duration::from_micros(1560));
    assert_eq!(m.reduce_scatter_time(1_000_000, 4), Duration::from_micros(780));
    assert_eq!(m.all_gather_time(1_000_000, 4), Duration::from_micros(3030));
    assert_eq!(m.broadcast_time(1_000_000, 4), Duration::from_micros(1030));
    assert_eq!(m.barrier_time(4), Duration::from_micros(60));
    assert_eq!(m.all_reduce_time(1_000_000, 1), Duration::ZERO);
}

#[test]
fn all_reduce_takes_at_least_the_model_time_and_queues_on_the_link() {
    let model = NetModel {
        latency: Duration::from_millis(3),
        bandwidth_bytes_per_s: 100e6,
    };
    let n = 1 << 18; // 1 MiB of f32
    let expected = model.all_reduce_time(4 * n, 2); // 6 ms + 10.5 ms
    run_on_threads_with_timeout(2, TIMEOUT, |comm| {
        let sim = comm.simulated(model);
        let t = Instant::now();
        let a = sim.all_reduce(Buffer::F32(vec![1.0; n]), ReduceOp::Sum, "bucket 0");
        let b = sim.all_reduce(Buffer::F32(vec![2.0; n]), ReduceOp::Sum, "bucket 1");
        let (buf_a, ta) = a.wait_timed().unwrap();
        let (buf_b, tb) = b.wait_timed().unwrap();
        let wall = t.elapsed();
        assert!(
            buf_a.as_f32().unwrap().iter().all(|&x| x == 2.0),
            "data must still move"
        );
        assert!(buf_b.as_f32().unwrap().iter().all(|&x| x == 4.0));
        assert!(ta.duration() >= expected, "{:?} < model {expected:?}", ta.duration());
        assert!(
            tb.started >= ta.finished,
            "the second collective must wait for the link"
        );
        assert!(tb.duration() >= expected);
        assert!(wall >= expected * 2, "two collectives took {wall:?}");
        // Not absurdly slower than the model either (generous slack for a loaded machine:
        // a wrapper that waited for its own timeout would take 20 s).
        assert!(wall < expected * 2 + TIMEOUT / 4, "took {wall:?}");
    })
    .into_iter()
    .for_each(|r| r.unwrap());
}

#[test]
fn an_early_rank_waits_for_the_late_one_before_the_link_time_starts() {
    let model = NetModel {
        latency: Duration::ZERO,
        bandwidth_bytes_per_s: 100e6,
    };
    let n = 1 << 18; // 1 MiB of f32: 10.5 ms on the model link
    let expected = model.all_reduce_time(4 * n, 2);
    let late = Duration::from_millis(60);
    let t0 = Instant::now();
    let finished: Vec<Instant> = run_on_threads_with_timeout(2, TIMEOUT, |comm| {
        let rank = comm.rank();
        let sim = comm.simulated(model);
        if rank == 1 {
            std::thread::sleep(late);
        }
        let (_, timing) = sim
            .all_reduce(Buffer::F32(vec![1.0; n]), ReduceOp::Sum, "late")
            .wait_timed()
            .unwrap();
        timing.finished
    })
    .into_iter()
    .map(|r| r.unwrap())
    .collect();
    for (rank, f) in finished.iter().enumerate() {
        // the transfer cannot begin before rank 1 has joined
        assert!(
            f.duration_since(t0) >= late + expected,
            "rank {rank} finished after {:?}",
            f.duration_since(t0)
        );
    }
}

/// CPU time the calling thread has used (Linux: `CLOCK_THREAD_CPUTIME_ID`).
#[cfg(target_os = "linux")]
fn thread_cpu_time() -> Duration {
    #[repr(C)]
    struct Timespec {
        tv_sec: i64,
        tv_nsec: i64,
    }
    extern "C" {
        fn clock_gettime(clock: i32, tp: *mut Timespec) -> i32;
    }
    const CLOCK_THREAD_CPUTIME_ID: i32 = 3;
    let mut t = Timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `t` is a valid timespec (two 64-bit fields on 64-bit Linux) for the call to fill.
    let rc = unsafe { clock_gettime(CLOCK_THREAD_CPUTIME_ID, &mut t) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

#[cfg(all(target_os = "linux", target_pointer_width = "64"))]
#[test]
fn the_simulated_wait_does_not_burn_a_core() {
    use std::sync::{Arc, Mutex};

    use brigade_comm::WorkEvent;

    let model = NetModel {
        latency: Duration::from_millis(200),
        bandwidth_bytes_per_s: 1e9,
    };
    let expected = model.all_reduce_time(4, 2); // 400 ms of pure latency
    let results = run_on_threads_with_timeout(2, TIMEOUT, |comm| {
        let sim = comm.simulated(model);
        let t = Instant::now();
        let compute0 = thread_cpu_time();
        let work = sim.all_reduce(Buffer::F32(vec![1.0]), ReduceOp::Sum, "slow link");
        // The simulated link completes the work on its own thread, the one that waits out the
        // model time: the observer runs there and reads that thread's own CPU time.
        let seen: Arc<Mutex<Option<(String, Duration)>>> = Arc::default();
        let sink = seen.clone();
        work.observe(move |e| {
            if let WorkEvent::Finished { .. } = e {
                let thread = std::thread::current().name().unwrap_or("").to_string();
                *sink.lock().unwrap() = Some((thread, thread_cpu_time()));
            }
        });
        // Meanwhile this rank computes; the work must make progress while the link is busy.
        let mut progress = 0u64;
        let mut x = 1u64;
        while !work.is_completed() {
            for _ in 0..10_000 {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            }
            progress += 1;
        }
        std::hint::black_box(x);
        let compute = thread_cpu_time() - compute0;
        work.wait().unwrap();
        let seen = seen.lock().unwrap().clone();
        (
            t.elapsed(),
            progress,
            compute,
            seen.expect("the observer heard the finish"),
        )
    });
    for (rank, r) in results.iter().enumerate() {
        let (wall, progress, compute, (thread, link)) = r.as_ref().unwrap();
        assert!(*wall >= expected, "rank {rank}: {wall:?} < model {expected:?}");
        assert!(
            *progress > 100,
            "rank {rank}: compute made no progress during the simulated wait"
        );
        assert_eq!(
            thread,
            &format!("sim-net-{rank}"),
            "the finish must be observed on the link's thread"
        );
        // The link thread's whole life (waiting for the inner collective, then the model's
        // 400 ms) against the compute thread's CPU over the same wait. Both would be runnable
        // all along if the link spun, and the scheduler would give them similar shares of a
        // core, however loaded the machine; a sleeping link costs microseconds.
        assert!(
            *link * 10 < *compute,
            "rank {rank}: the link thread used {link:?} of CPU while compute used {compute:?}"
        );
    }
}
