//! All-reduce bandwidth benchmark (behind `brigade bench comm`), with the single-thread memcpy
//! bandwidth of the same machine measured in the same run as the yardstick, and (under MPI)
//! the library's own all-reduce timed in the same run, interleaved with Brigade's.
//!
//! Definitions follow nccl-tests: `algbw = bytes / time`, `busbw = algbw * 2(n-1)/n` for
//! all-reduce over `n` ranks (the bandwidth each link would need in a ring).
//!
//! Several ways of doing the same all-reduce ([`Contender`]s) are timed in turns: each size's
//! iterations are split into [`ROUNDS`] rounds, and every round times each contender once, so
//! that a machine whose speed drifts (other jobs, frequency) drifts under all of them alike.

use std::time::Instant;

use serde::Serialize;

use crate::{run_on_threads, Buffer, CommError, Communicator, ReduceOp};

/// Rounds each size's iterations are split into (fewer with fewer iterations; see the module
/// docs).
pub const ROUNDS: usize = 4;

/// What to measure.
#[derive(Debug, Clone)]
pub struct CommBenchConfig {
    /// Ranks of the thread group.
    pub world_size: usize,
    /// Buffer sizes in bytes (f32 buffers: rounded down to a multiple of 4).
    pub sizes: Vec<usize>,
    /// Timed iterations per size; `None` picks `clamp(512 MiB / size, 5, 1000)`.
    pub iters: Option<usize>,
    /// Bytes copied by the memcpy yardstick (it allocates twice this).
    pub memcpy_bytes: usize,
}

/// The largest memcpy yardstick, in bytes.
pub const MAX_MEMCPY_BYTES: usize = 256 << 20;

impl CommBenchConfig {
    /// All-reduces of `sizes` on `world_size` ranks, `iters` each (`None`: the default), the
    /// memcpy yardstick copying as many bytes as the largest size (at most
    /// [`MAX_MEMCPY_BYTES`]): a run of small sizes allocates no large buffers.
    pub fn new(world_size: usize, sizes: Vec<usize>, iters: Option<usize>) -> Self {
        let memcpy_bytes = sizes.iter().copied().max().unwrap_or(0).min(MAX_MEMCPY_BYTES);
        CommBenchConfig {
            world_size,
            sizes,
            iters,
            memcpy_bytes,
        }
    }

    /// Refuses a run that would report no figure or a meaningless one: no size, a size too
    /// small to give each of `world` ranks one f32, or a memcpy yardstick of no bytes (its
    /// bandwidth, every row's denominator, would be 0/0).
    pub fn check(&self, world: usize) -> Result<(), CommError> {
        let least = 4 * world.max(1);
        let bad = |what: String| Err(CommError::InvalidArgument(format!("comm bench: {what}")));
        if self.sizes.is_empty() {
            return bad("no buffer size to time; give at least one".into());
        }
        if let Some(small) = self.sizes.iter().find(|&&b| b < least) {
            return bad(format!(
                "a size of {small} B is too small to split among {world} ranks; each needs at least {least} B"
            ));
        }
        if self.memcpy_bytes == 0 {
            return bad("the memcpy yardstick copies no bytes; give it at least one".into());
        }
        Ok(())
    }
}

impl Default for CommBenchConfig {
    /// [`default_sizes`] on 2 ranks.
    fn default() -> Self {
        CommBenchConfig::new(2, default_sizes(), None)
    }
}

/// 1 KiB to 64 MiB, by factors of 4.
pub fn default_sizes() -> Vec<usize> {
    (0..9).map(|i| 1024usize << (2 * i)).collect()
}

/// One measured size.
#[derive(Debug, Clone, Serialize)]
pub struct AllReduceRow {
    /// Buffer size in bytes.
    pub bytes: usize,
    /// Timed iterations.
    pub iters: usize,
    /// Mean time per all-reduce in seconds (rank 0's clock).
    pub time_s: f64,
    /// `bytes / time`, bytes per second.
    pub algbw: f64,
    /// `algbw * 2(n-1)/n`, bytes per second.
    pub busbw: f64,
    /// Fastest single all-reduce in seconds.
    pub best_s: f64,
    /// Median single all-reduce in seconds: where the mean sits far above it, a few slow
    /// iterations (a descheduled rank, a late wake-up) carry the mean.
    pub median_s: f64,
    /// Single-thread memcpy bandwidth (bytes per second) measured by rank 0 just before this
    /// size, so that both see the same machine load.
    pub memcpy_bw: f64,
    /// Seconds of CPU time the hypervisor stole from this machine (all its CPUs together) while
    /// this size's all-reduces ran ([`stolen_s`]); `None` where `/proc/stat` cannot say. On a
    /// virtual machine a mean far above the median usually comes with stolen time.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stolen_s: Option<f64>,
}

/// Another way of doing the same all-reduces, timed in the same run (e.g. the MPI library's
/// own `MPI_Allreduce`).
#[derive(Debug, Clone, Serialize)]
pub struct ReferenceRows {
    /// What was timed (`MPI_Allreduce (blocking, in place)`).
    pub name: String,
    /// One row per size, as [`CommBenchReport::rows`].
    pub rows: Vec<AllReduceRow>,
}

/// The whole run.
#[derive(Debug, Clone, Serialize)]
pub struct CommBenchReport {
    /// Backend measured (`"thread"`, `"mpi"`).
    pub backend: String,
    /// How Brigade's all-reduce travelled (`"threads"`, `"shared memory"`, `"hierarchical"`,
    /// `"MPI"`).
    pub path: String,
    /// Ranks.
    pub world_size: usize,
    /// Single-thread memcpy bandwidth in bytes per second (best of several copies), measured
    /// before the all-reduces.
    pub memcpy_bw: f64,
    /// Bytes per memcpy.
    pub memcpy_bytes: usize,
    /// One row per size: Brigade's all-reduce.
    pub rows: Vec<AllReduceRow>,
    /// Other ways timed in the same run, interleaved with `rows`; the first is the yardstick
    /// of the ratios in the table.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub references: Vec<ReferenceRows>,
}

/// One in-place f32 sum all-reduce of a buffer, handed back.
pub type AllReduceFn<'a> = Box<dyn FnMut(Vec<f32>) -> Result<Vec<f32>, CommError> + 'a>;

/// One way of doing an in-place f32 sum all-reduce, timed by [`time_contenders`].
pub struct Contender<'a> {
    /// What it is, for the table.
    pub name: String,
    /// One all-reduce.
    pub run: AllReduceFn<'a>,
}

impl<'a> Contender<'a> {
    /// A contender that all-reduces through `comm`, blocking
    /// ([`Communicator::all_reduce_blocking`]), as `MPI_Allreduce` is.
    pub fn communicator(name: &str, comm: &'a dyn Communicator) -> Contender<'a> {
        Contender {
            name: name.to_string(),
            run: Box::new(move |v: Vec<f32>| {
                let out = comm.all_reduce_blocking(Buffer::F32(v), ReduceOp::Sum, "bench")?;
                out.into_f32()
                    .map_err(|b| CommError::Internal(format!("an f32 all-reduce returned {}", b.dtype())))
            }),
        }
    }
}

/// Single-thread memcpy bandwidth (bytes copied per second), best of `reps` copies of `bytes`.
pub fn memcpy_bandwidth(bytes: usize, reps: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes]; // written, so its pages are mapped before timing
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        best = best.min(t.elapsed().as_secs_f64());
        std::hint::black_box(&mut dst);
    }
    bytes as f64 / best
}

/// Seconds of CPU time the hypervisor has stolen from this machine since boot, all CPUs
/// together: the `steal` column of `/proc/stat`'s `cpu` line. `None` off Linux or where the
/// kernel does not count it.
pub fn stolen_s() -> Option<f64> {
    steal_ticks(&std::fs::read_to_string("/proc/stat").ok()?).map(|t| t as f64 / USER_HZ)
}

/// `/proc/stat` counts in `USER_HZ` ticks, which Linux fixes at 100 per second for user space.
const USER_HZ: f64 = 100.0;

/// The `steal` ticks of `/proc/stat`'s aggregate `cpu` line (its 8th number).
fn steal_ticks(stat: &str) -> Option<u64> {
    let line = stat.lines().find(|l| l.split_whitespace().next() == Some("cpu"))?;
    line.split_whitespace().nth(8)?.parse().ok()
}

fn default_iters(bytes: usize) -> usize {
    ((512usize << 20) / bytes.max(1)).clamp(5, 1000)
}

/// One rank's part of the all-reduce benchmark (every rank calls it with the same `cfg`):
/// f32 sum all-reduces of each size through `comm`, after two warm-up runs; rank 0 measures
/// memcpy just before each size while the others wait in a barrier. Returns this rank's
/// timings.
pub fn time_all_reduce(comm: &dyn Communicator, cfg: &CommBenchConfig) -> Result<Vec<AllReduceRow>, CommError> {
    let mut contenders = [Contender::communicator("brigade", comm)];
    Ok(time_contenders(comm, cfg, &mut contenders)?.remove(0))
}

/// Times every contender on every size of `cfg`, in turns (see the module docs); `sync` is
/// the group's communicator, for the barriers that start each round and the world size.
/// Every rank calls it with the same contenders. Returns, per contender, this rank's rows.
pub fn time_contenders(
    sync: &dyn Communicator,
    cfg: &CommBenchConfig,
    contenders: &mut [Contender<'_>],
) -> Result<Vec<Vec<AllReduceRow>>, CommError> {
    let world = sync.world_size();
    cfg.check(world)?;
    let mut rows: Vec<Vec<AllReduceRow>> = contenders.iter().map(|_| Vec::new()).collect();
    for &bytes in &cfg.sizes {
        let len = bytes / 4;
        let iters = cfg.iters.unwrap_or_else(|| default_iters(bytes));
        // Where DDP's buckets live: the shared heap, when the process has one.
        let mut buf = crate::host_vec(len, 0.5f32);
        for c in contenders.iter_mut() {
            for _ in 0..2 {
                buf = (c.run)(buf)?;
            }
        }
        // The other ranks park in this barrier while rank 0 copies.
        let memcpy_bw = if sync.rank() == 0 {
            memcpy_bandwidth(cfg.memcpy_bytes, 3)
        } else {
            0.0
        };
        let stolen_before = stolen_s();
        let mut total = vec![0.0f64; contenders.len()];
        let mut each: Vec<Vec<f64>> = contenders.iter().map(|_| Vec::with_capacity(iters)).collect();
        let mut done = vec![0usize; contenders.len()];
        let iters = iters.max(1);
        let rounds = ROUNDS.min(iters);
        for round in 0..rounds {
            // The `iters` spread evenly over the rounds.
            let n = iters * (round + 1) / rounds - iters * round / rounds;
            for (k, c) in contenders.iter_mut().enumerate() {
                sync.barrier("bench round").wait()?;
                let t = Instant::now();
                for _ in 0..n {
                    let t1 = Instant::now();
                    buf = (c.run)(buf)?;
                    each[k].push(t1.elapsed().as_secs_f64());
                }
                total[k] += t.elapsed().as_secs_f64();
                done[k] += n;
            }
        }
        let stolen = stolen_before.zip(stolen_s()).map(|(a, b)| b - a);
        for k in 0..contenders.len() {
            let time_s = total[k] / done[k] as f64;
            each[k].sort_by(f64::total_cmp);
            let algbw = (len * 4) as f64 / time_s;
            rows[k].push(AllReduceRow {
                bytes: len * 4,
                iters: done[k],
                time_s,
                algbw,
                busbw: crate::RingOp::AllReduce.wire_bytes(algbw, world),
                best_s: each[k][0],
                median_s: each[k][each[k].len() / 2],
                memcpy_bw,
                stolen_s: stolen,
            });
        }
    }
    Ok(rows)
}

/// Times f32 sum all-reduces of each size on a thread group; returns rank 0's measurements.
pub fn bench_all_reduce(cfg: &CommBenchConfig) -> Result<Vec<AllReduceRow>, CommError> {
    let results = run_on_threads(cfg.world_size, |comm| time_all_reduce(&comm, cfg));
    results.into_iter().next().expect("at least one rank")?
}

/// Runs the memcpy yardstick and the all-reduce sizes.
pub fn run_comm_bench(cfg: &CommBenchConfig) -> Result<CommBenchReport, CommError> {
    cfg.check(cfg.world_size)?;
    let memcpy_bw = memcpy_bandwidth(cfg.memcpy_bytes, 5);
    let rows = bench_all_reduce(cfg)?;
    Ok(CommBenchReport {
        backend: "thread".to_string(),
        path: "threads".to_string(),
        world_size: cfg.world_size,
        memcpy_bw,
        memcpy_bytes: cfg.memcpy_bytes,
        rows,
        references: Vec::new(),
    })
}

/// Human-readable size: `1 KiB`, `16 MiB`, or bytes.
pub fn format_bytes(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

impl CommBenchReport {
    /// The report as a text table (GB/s = 1e9 bytes per second).
    pub fn to_table(&self) -> String {
        let gb = 1e9;
        let mut s = format!(
            "all_reduce (f32, sum), backend {} ({}), world size {}\n\
             single-thread memcpy ({}): {:.2} GB/s before the run; per-size column `memcpy` is \
             re-measured just before each size\n\
             bandwidths in GB/s (1e9 B/s); busbw = algbw * 2(n-1)/n; `time` is the mean; \
             `stolen` is CPU time the hypervisor took from this machine during the size\n\n",
            self.backend,
            self.path,
            self.world_size,
            format_bytes(self.memcpy_bytes),
            self.memcpy_bw / gb
        );
        s += &format!(
            "{:>8} {:>5} {:>10} {:>10} {:>10} {:>8} {:>8} {:>11} {:>8} {:>9} {:>9}\n",
            "size",
            "iters",
            "time us",
            "median us",
            "best us",
            "algbw",
            "busbw",
            "busbw best",
            "memcpy",
            "busbw/mc",
            "stolen ms"
        );
        for r in &self.rows {
            let factor = r.busbw / r.algbw;
            s += &format!(
                "{:>8} {:>5} {:>10.1} {:>10.1} {:>10.1} {:>8.2} {:>8.2} {:>11.2} {:>8.2} {:>9.2} {:>9}\n",
                format_bytes(r.bytes),
                r.iters,
                r.time_s * 1e6,
                r.median_s * 1e6,
                r.best_s * 1e6,
                r.algbw / gb,
                r.busbw / gb,
                r.bytes as f64 / r.best_s * factor / gb,
                r.memcpy_bw / gb,
                r.busbw / r.memcpy_bw,
                r.stolen_s.map_or("-".to_string(), |s| format!("{:.0}", s * 1e3))
            );
        }
        if let Some(yardstick) = self.references.first() {
            s += &format!(
                "\nsame run, in turns: mean time per all-reduce in us (busbw GB/s); `x {}` = busbw over its busbw\n",
                yardstick.name
            );
            let brigade = ReferenceRows {
                name: format!("brigade ({})", self.path),
                rows: self.rows.clone(),
            };
            let all: Vec<&ReferenceRows> = self.references.iter().chain(std::iter::once(&brigade)).collect();
            let width = |name: &str| name.len().max(16);
            s += &format!("{:>8}", "size");
            for r in &all {
                s += &format!(" {:>w$}", r.name, w = width(&r.name));
            }
            for r in &all[1..] {
                s += &format!(" {:>w$}", format!("x raw: {}", r.name), w = width(&r.name) + 7);
            }
            s += "\n";
            for (i, row) in self.rows.iter().enumerate() {
                s += &format!("{:>8}", format_bytes(row.bytes));
                for r in &all {
                    let x = &r.rows[i];
                    let cell = format!("{:.1} ({:.2})", x.time_s * 1e6, x.busbw / gb);
                    s += &format!(" {:>w$}", cell, w = width(&r.name));
                }
                for r in &all[1..] {
                    let ratio = r.rows[i].busbw / yardstick.rows[i].busbw;
                    s += &format!(" {:>w$.2}", ratio, w = width(&r.name) + 7);
                }
                s += "\n";
            }
        }
        s
    }
}

/// Parses a size such as `4096`, `64K`, `16M`, `1G` (binary units; `KiB`/`MiB` also accepted).
pub fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let t = t.strip_suffix("iB").or_else(|| t.strip_suffix('B')).unwrap_or(t);
    let (num, shift) = match t.chars().last() {
        Some('K' | 'k') => (&t[..t.len() - 1], 10),
        Some('M' | 'm') => (&t[..t.len() - 1], 20),
        Some('G' | 'g') => (&t[..t.len() - 1], 30),
        _ => (t, 0),
    };
    let n = num
        .trim()
        .parse::<usize>()
        .map_err(|e| format!("bad size `{s}`: {e}"))?;
    n.checked_mul(1 << shift)
        .ok_or_else(|| format!("bad size `{s}`: more bytes than this machine can address"))
}

#[cfg(test)]
mod tests {
    use super::{run_comm_bench, steal_ticks, CommBenchConfig};

    #[test]
    fn a_bench_with_nothing_to_time_is_refused_before_it_runs() {
        for (cfg, says) in [
            (CommBenchConfig::new(2, vec![], Some(1)), "no buffer size"),
            (CommBenchConfig::new(2, vec![1024, 4], Some(1)), "4 B is too small"),
            (
                CommBenchConfig {
                    memcpy_bytes: 0,
                    ..CommBenchConfig::new(2, vec![1024], Some(1))
                },
                "copies no bytes",
            ),
        ] {
            let e = run_comm_bench(&cfg).unwrap_err().to_string();
            assert!(e.contains(says), "{e}");
        }
        let ran = run_comm_bench(&CommBenchConfig::new(2, vec![1024], Some(1))).unwrap();
        assert!(ran.memcpy_bw.is_finite() && ran.memcpy_bw > 0.0);
    }

    #[test]
    fn steal_is_the_eighth_number_of_the_aggregate_cpu_line() {
        let stat = "cpu  4705 356 584 3699 23 23 0 1234 0 0\n\
                    cpu0 1393 280 290 1820 8 13 0 617 0 0\n\
                    intr 114930548 113199788 3 0 5 263 0 4 [...]\n";
        assert_eq!(steal_ticks(stat), Some(1234));
        // A kernel too old to count steal, or no aggregate line: no number, not a wrong one.
        assert_eq!(steal_ticks("cpu  4705 356 584 3699 23 23 0\n"), None);
        assert_eq!(steal_ticks("cpu0 1 2 3 4 5 6 7 8\n"), None);
    }
}
