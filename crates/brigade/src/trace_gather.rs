//! Gathering one step's events of every rank onto every rank, when each process records only
//! its own (MPI): every rank sends its events of the step with instants as offsets from the
//! start of that step on its own clock; the receiver lays them out from its own step start
//! (the steps begin together, give or take the skew the trace itself shows).

use std::time::{Duration, Instant};

use brigade_comm::{all_gather_bytes, Communicator, EventKind, Recorder, Stamp, TraceEvent, Track};
use brigade_ddp::Phase;

use crate::error::{Error, Result};

/// One event as offsets in seconds from the step's start (JSON).
fn encode(e: &TraceEvent, t0: Instant) -> serde_json::Value {
    let off = |s: Option<Stamp>| s.map(|s| offset(s.at, t0));
    serde_json::json!({
        "rank": e.rank, "track": e.track, "kind": e.kind, "name": e.name, "op": e.op,
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

fn decode(v: &serde_json::Value, t0: Instant, seq: &mut u64) -> Option<TraceEvent> {
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
    Some(TraceEvent {
        id: 0,
        rank: v["rank"].as_u64()? as usize,
        track: serde_json::from_value::<Track>(v["track"].clone()).ok()?,
        kind: serde_json::from_value::<EventKind>(v["kind"].clone()).ok()?,
        name: v["name"].as_str()?.to_string(),
        op: v["op"].as_str()?.to_string(),
        bytes: v["bytes"].as_u64()? as usize,
        issued,
        start,
        end,
        error: v["error"].as_str().map(str::to_string),
    })
}

/// Every rank's events of `step` (from each rank's own `recorder`), laid out on this rank's
/// clock; every rank must call it. `comm` should be the bare communicator (not traced).
pub fn gather_step_events(comm: &dyn Communicator, recorder: &Recorder, step: usize) -> Result<Vec<TraceEvent>> {
    let events: Vec<TraceEvent> = recorder
        .events_during(&Phase::Step(step).kind())
        .into_iter()
        .filter(|e| e.rank == comm.rank())
        .collect();
    let t0 = events
        .iter()
        .find(|e| e.kind == Phase::Step(step).kind())
        .and_then(|e| e.start)
        .map(|s| s.at)
        .unwrap_or_else(Instant::now);
    let mine = serde_json::to_vec(&events.iter().map(|e| encode(e, t0)).collect::<Vec<_>>())
        .map_err(|e| Error::json("timeline", e))?;
    let mut seq = 0;
    let mut out = vec![];
    for bytes in all_gather_bytes(comm, mine, "timeline")? {
        let list: Vec<serde_json::Value> =
            serde_json::from_slice(&bytes).map_err(|e| Error::json("timeline from a peer", e))?;
        out.extend(list.iter().filter_map(|v| decode(v, t0, &mut seq)));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use brigade_comm::run_on_threads;

    #[test]
    fn each_process_records_its_own_rank_and_every_rank_gets_all_kinds() {
        let got = run_on_threads(2, |comm| {
            // One recorder per rank, as with one process per rank.
            let rec = Recorder::new();
            let rank = comm.rank();
            let step = rec.begin(rank, Phase::Step(4).kind());
            rec.span(rank, Phase::backward(Some("layers.1")).kind());
            let c = rec.comm_issued(rank, "all_reduce", "bucket0", 8, Some(0));
            rec.comm_started(c, Instant::now());
            rec.comm_finished(c, Instant::now(), None);
            rec.end(step);
            gather_step_events(&comm, &rec, 4).unwrap()
        });
        for events in got {
            let events = events.unwrap();
            assert_eq!(events.len(), 6, "{events:#?}");
            for rank in 0..2 {
                let mine: Vec<EventKind> = events
                    .iter()
                    .filter(|e| e.rank == rank)
                    .map(|e| e.kind.clone())
                    .collect();
                assert_eq!(
                    mine,
                    [
                        Phase::Step(4).kind(),
                        Phase::backward(Some("layers.1")).kind(),
                        EventKind::Collective { tag: Some(0) }
                    ]
                );
            }
            let bucket = events
                .iter()
                .find(|e| brigade_ddp::bucket_of(&e.kind) == Some(0))
                .unwrap();
            assert_eq!(
                (bucket.track, bucket.name.as_str(), bucket.bytes),
                (Track::Comm, "bucket0", 8)
            );
            assert!(bucket.issued.unwrap().seq < bucket.end.unwrap().seq);
        }
    }
}
