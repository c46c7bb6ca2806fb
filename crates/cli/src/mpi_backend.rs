//! `--backend mpi`: one rank per process under `mpirun`; rank and world size come from MPI.
//!
//! Every process runs [`crate::run::rank_main`] over an MPI communicator (the same DDP, flags
//! and semantics as the thread backend). Setup errors (a missing file, too little data) are
//! agreed on by all ranks before training, so every rank fails with the same message. An error
//! during training ends the whole job at once (`MPI_Abort`), so that no rank waits for a dead
//! peer until its timeout; a killed process is noticed by `mpirun`, which ends the others.
//! Rank 0 alone draws the progress bar and returns the report (so it alone prints and writes
//! files); the other ranks finalize MPI and exit 0 once training succeeded.
//!
//! `--timeline`: every rank sends rank 0 its last step's events, with instants as offsets
//! from the start of that step on its own clock; rank 0 lays them out from its own step
//! start (the steps begin together, give or take the skew the trace itself shows).

#[cfg(not(feature = "mpi"))]
mod disabled {
    use crate::args::RunArgs;
    use crate::error::{CliError, Result};
    use crate::run::{RunOptions, RunReport};

    /// Explains how to get a build with MPI.
    pub fn run(_args: &RunArgs, _opts: &RunOptions) -> Result<RunReport> {
        Err(CliError::Usage(
            "--backend mpi needs a build with MPI support: install OpenMPI (apt-get install openmpi-bin libopenmpi-dev libclang-dev) \
             and build with `cargo build --release --features mpi`"
                .into(),
        ))
    }
}

#[cfg(not(feature = "mpi"))]
pub use disabled::run;

#[cfg(feature = "mpi")]
pub use enabled::run;

#[cfg(feature = "mpi")]
mod enabled {
    use std::sync::Arc;
    use std::time::Duration;

    use std::time::Instant;

    use brigade_comm::{
        all_gather_bytes, Buffer, Communicator, Event, MpiComm, MpiWorld, NetModel, Recorder, SimulatedNetwork, Stamp,
        Traced, Track,
    };
    use brigade_models::{Dataset, ModelKind};

    use crate::args::RunArgs;
    use crate::error::{CliError, Result};
    use crate::run::{collect, load_data, rank_main, RunOptions, RunReport};
    use crate::timeline::step_events;

    /// Bytes of a setup error message exchanged between ranks.
    const MESSAGE_BYTES: usize = 1024;

    /// Trains on this process's rank of the MPI job (see the module docs).
    pub fn run(args: &RunArgs, opts: &RunOptions) -> Result<RunReport> {
        let world = MpiWorld::init()?;
        let (rank, size) = (world.rank(), world.world_size());
        let timeout = Duration::from_secs_f64(args.timeout_s);
        let comm = Arc::new(world.communicator(timeout)?);
        let mut args = args.clone();
        let setup = if args.world_size != 1 && args.world_size != size {
            Err(CliError::Usage(format!(
                "--world-size {} but mpirun started {size} processes: drop --world-size (MPI's size is used) or pass -np {}",
                args.world_size, args.world_size
            )))
        } else {
            args.world_size = size;
            prepare(&args, opts)
        };
        if let Err(e) = agree(&comm, rank, setup.as_ref().err().map(|e| e.to_string())) {
            // Every rank prints before any exits: mpirun ends the job at the first non-zero exit.
            eprintln!("error: {e}");
            let _ = comm.barrier("setup failed").wait();
            drop(comm);
            drop(world);
            std::process::exit(1);
        }
        let (kind, data) = setup.expect("agreed: every rank's setup succeeded");

        let threads = args.threads_per_rank.unwrap_or_else(|| default_threads(size));
        let recorder = opts.record.then(Recorder::new);
        let train_comm: Option<Arc<dyn Communicator>> = if opts.compute_only {
            None
        } else {
            let c: Arc<dyn Communicator> = match args.net_gbps {
                Some(g) => Arc::new(SimulatedNetwork::new(
                    comm.clone(),
                    NetModel {
                        latency: Duration::from_secs_f64(args.net_latency_us * 1e-6),
                        bandwidth_bytes_per_s: g * 1e9 / 8.0,
                    },
                )),
                None => comm.clone(),
            };
            Some(match &recorder {
                Some(r) => Arc::new(Traced::new(c, r.clone())),
                None => c,
            })
        };
        let out = rank_main(
            &args,
            opts,
            &kind,
            &data,
            rank,
            size,
            train_comm,
            recorder.as_ref(),
            threads,
        );
        let out = match out {
            Ok(out) => out,
            Err(e) => {
                // The peers may be blocked in a collective this rank will never join.
                eprintln!("error: rank {rank} of {size}: {e}");
                world.abort(1);
            }
        };
        let gathered = match &recorder {
            Some(rec) if args.steps > 0 => match gather_last_step(&comm, rec, args.steps - 1) {
                Ok(events) => Some(events),
                Err(e) => {
                    eprintln!("error: rank {rank} of {size}: gathering the timeline: {e}");
                    world.abort(1);
                }
            },
            _ => None,
        };
        drop(comm);
        drop(world); // waits for the comm stream to end, then MPI_Finalize
        if rank != 0 {
            std::process::exit(0);
        }
        let mut report = collect(vec![Ok(Ok(out))], size, recorder)?;
        report.last_step_events = gathered;
        Ok(report)
    }

    /// One event as offsets in seconds from the step's start (JSON).
    fn encode(e: &Event, t0: Instant) -> serde_json::Value {
        let off = |s: Option<Stamp>| s.map(|s| offset(s.at, t0));
        serde_json::json!({
            "rank": e.rank, "comm": e.track == Track::Comm, "name": e.name, "op": e.op,
            "bytes": e.bytes, "issued": off(e.issued), "start": off(e.start), "end": off(e.end), "error": e.error,
        })
    }

    /// Seconds from `t0` to `at`, negative when `at` came first.
    fn offset(at: Instant, t0: Instant) -> f64 {
        if at >= t0 {
            (at - t0).as_secs_f64()
        } else {
            -(t0 - at).as_secs_f64()
        }
    }

    fn decode(v: &serde_json::Value, t0: Instant, seq: &mut u64) -> Option<Event> {
        let mut stamp = |k: &str| {
            v[k].as_f64().map(|off| {
                *seq += 1;
                let at = if off >= 0.0 {
                    t0 + Duration::from_secs_f64(off)
                } else {
                    t0 - Duration::from_secs_f64(-off)
                };
                Stamp { seq: *seq, at }
            })
        };
        let (issued, start, end) = (stamp("issued"), stamp("start"), stamp("end"));
        Some(Event {
            id: 0,
            rank: v["rank"].as_u64()? as usize,
            track: if v["comm"].as_bool()? {
                Track::Comm
            } else {
                Track::Compute
            },
            name: v["name"].as_str()?.to_string(),
            op: v["op"].as_str()?.to_string(),
            bytes: v["bytes"].as_u64()? as usize,
            issued,
            start,
            end,
            error: v["error"].as_str().map(str::to_string),
        })
    }

    /// All ranks' events of `step`, laid out on rank 0's clock (every rank calls this).
    fn gather_last_step(comm: &MpiComm, rec: &Recorder, step: usize) -> Result<Vec<Event>> {
        let events = step_events(rec, step);
        let marker = format!("step {step}");
        let t0 = events
            .iter()
            .find(|e| e.track == Track::Compute && e.name == marker)
            .and_then(|e| e.start)
            .map(|s| s.at)
            .unwrap_or_else(Instant::now);
        let mine = serde_json::to_vec(&events.iter().map(|e| encode(e, t0)).collect::<Vec<_>>())
            .map_err(|e| CliError::Usage(format!("timeline: {e}")))?;
        let mut seq = 0;
        let mut out = vec![];
        for bytes in all_gather_bytes(comm, mine, "timeline")? {
            let list: Vec<serde_json::Value> =
                serde_json::from_slice(&bytes).map_err(|e| CliError::Usage(format!("timeline from a peer: {e}")))?;
            out.extend(list.iter().filter_map(|v| decode(v, t0, &mut seq)));
        }
        Ok(out)
    }

    /// What each rank must have before training: the model and the data (every file it reads
    /// must exist on this rank).
    fn prepare(args: &RunArgs, opts: &RunOptions) -> Result<(ModelKind, Dataset)> {
        for (flag, path) in [
            ("--init", &args.init),
            ("--resume", &opts.resume),
            ("--data", &args.data),
        ] {
            if let Some(path) = path {
                std::fs::metadata(path).map_err(|e| CliError::Io {
                    path: format!("{flag} {}", path.display()),
                    source: e,
                })?;
            }
        }
        let kind = args.model.kind();
        let data = load_data(args, &kind)?;
        Ok((kind, data))
    }

    /// Every rank learns whether any rank failed its setup; then all fail with the first failing
    /// rank's message, or all go on.
    fn agree(comm: &MpiComm, rank: usize, error: Option<String>) -> Result<()> {
        let mut msg = error.map(|e| format!("!{e}")).unwrap_or_default().into_bytes();
        msg.truncate(MESSAGE_BYTES);
        msg.resize(MESSAGE_BYTES, 0);
        let all = comm.all_gather(Buffer::U8(msg), "setup status").wait()?;
        let all = all.as_u8().expect("u8 in, u8 out");
        let failed: Vec<(usize, String)> = all
            .chunks(MESSAGE_BYTES)
            .enumerate()
            .filter(|(_, m)| m[0] == b'!')
            .map(|(r, m)| (r, String::from_utf8_lossy(&m[1..]).trim_end_matches('\0').to_string()))
            .collect();
        let Some((first, message)) = failed.first() else {
            return Ok(());
        };
        let others: Vec<usize> = failed.iter().skip(1).map(|(r, _)| *r).collect();
        let also = if others.is_empty() {
            String::new()
        } else {
            format!(" (ranks {others:?} failed too)")
        };
        let whose = if *first == rank {
            "this rank".to_string()
        } else {
            format!("rank {first}")
        };
        Err(CliError::Usage(format!(
            "setup failed on {whose} of {}: {message}{also}",
            all.len() / MESSAGE_BYTES
        )))
    }

    /// Compute threads per rank: the cores shared among the ranks on this host.
    fn default_threads(size: usize) -> usize {
        let local = std::env::var("OMPI_COMM_WORLD_LOCAL_SIZE")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(size);
        crate::run::default_threads(local)
    }
}
