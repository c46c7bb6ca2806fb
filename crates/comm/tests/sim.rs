//! Simulated network: collectives take at least the ring-model time, back-to-back collectives
//! queue on the link, and the simulated wait leaves the CPU to compute.

use std::time::{Duration, Instant};

use brigade_comm::{launch_with_timeout, Buffer, Communicator, NetModel, ReduceOp, SimulatedNetwork};

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
    launch_with_timeout(2, TIMEOUT, |comm| {
        let sim = SimulatedNetwork::new(comm, model);
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
        // Not absurdly slower than the model either (generous slack for a loaded machine).
        assert!(wall < expected * 2 + Duration::from_millis(400), "took {wall:?}");
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
    let finished: Vec<Instant> = launch_with_timeout(2, TIMEOUT, |comm| {
        let rank = comm.rank();
        let sim = SimulatedNetwork::new(comm, model);
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

/// CPU time of this process (all threads), from /proc.
#[cfg(target_os = "linux")]
fn process_cpu_time() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the file, 12 and 13 after the name; in clock
    // ticks of 1/100 s on Linux.
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    Duration::from_millis(ticks * 10)
}

#[cfg(target_os = "linux")]
#[test]
fn the_simulated_wait_does_not_burn_a_core() {
    let model = NetModel {
        latency: Duration::from_millis(200),
        bandwidth_bytes_per_s: 1e9,
    };
    let expected = model.all_reduce_time(4, 2); // 400 ms of pure latency
    let results = launch_with_timeout(2, TIMEOUT, |comm| {
        let sim = SimulatedNetwork::new(comm, model);
        sim.barrier("warm up").wait_timeout(Duration::from_secs(5)).unwrap();
        let cpu0 = process_cpu_time();
        let t = Instant::now();
        let work = sim.all_reduce(Buffer::F32(vec![1.0]), ReduceOp::Sum, "slow link");
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
        work.wait().unwrap();
        (t.elapsed(), progress, cpu0)
    });
    let cpu = process_cpu_time();
    let (wall, _, cpu0) = *results[0].as_ref().unwrap();
    assert!(wall >= expected);
    for r in &results {
        assert!(
            r.as_ref().unwrap().1 > 100,
            "compute made no progress during the simulated wait"
        );
    }
    // Two compute threads are busy for `wall`; a spinning simulated wait would add two more
    // cores' worth on top (more than the 2 cores of a small machine can give).
    let used = cpu.saturating_sub(cpu0);
    assert!(used < wall * 2 + wall / 4, "process used {used:?} of CPU in {wall:?}");
}
