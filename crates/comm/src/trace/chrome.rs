//! Chrome trace export (the JSON that Perfetto and chrome://tracing open).

use std::io::Write;
use std::path::Path;
use std::time::Instant;

use serde_json::{json, Value};

use super::{Recorder, TraceEvent, Track};

/// Thread id of the compute track inside a rank's process.
const COMPUTE_TID: u64 = 0;
/// Thread id of the comm-stream track.
const COMM_TID: u64 = 1;

impl Recorder {
    /// The events as a Chrome trace: one process (pid = rank) per rank, with a "compute"
    /// thread and a "comm stream" thread; spans are complete events (`"ph": "X"`, microseconds
    /// since the recorder was created); each collective also leaves an instant event on the
    /// compute track where it was issued. Unfinished spans are left out.
    pub fn to_chrome_trace(&self) -> Value {
        chrome_trace(&self.events(), self.origin())
    }

    /// Writes [`Recorder::to_chrome_trace`] to `path` atomically: to a temporary file beside
    /// it, then renamed over `path`, so a reader never sees half a trace.
    pub fn write_chrome_trace(&self, path: impl AsRef<Path>) -> std::io::Result<()> {
        let path = path.as_ref();
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(format!(".tmp{}", std::process::id()));
        let tmp = std::path::PathBuf::from(tmp);
        let result = (|| {
            let mut file = std::fs::File::create(&tmp)?;
            file.write_all(serde_json::to_string(&self.to_chrome_trace())?.as_bytes())?;
            file.sync_all()?;
            std::fs::rename(&tmp, path)
        })();
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        result
    }
}

/// `events` (a subset of a recorder's, e.g. the events during one span) as a Chrome trace, times in
/// microseconds since `origin`: the format of [`Recorder::to_chrome_trace`].
pub fn chrome_trace(events: &[TraceEvent], origin: Instant) -> Value {
    let us = |t: Instant| t.saturating_duration_since(origin).as_secs_f64() * 1e6;
    let mut out = Vec::new();
    let mut ranks: Vec<usize> = events.iter().map(|e| e.rank).collect();
    ranks.sort_unstable();
    ranks.dedup();
    for rank in ranks {
        out.push(
            json!({"ph": "M", "name": "process_name", "pid": rank, "tid": COMPUTE_TID,
                        "args": {"name": format!("rank {rank}")}}),
        );
        out.push(
            json!({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": COMPUTE_TID,
                        "args": {"sort_index": rank}}),
        );
        out.push(
            json!({"ph": "M", "name": "thread_name", "pid": rank, "tid": COMPUTE_TID,
                        "args": {"name": "compute"}}),
        );
        out.push(json!({"ph": "M", "name": "thread_name", "pid": rank, "tid": COMM_TID,
                        "args": {"name": "comm stream"}}));
    }
    for e in events {
        let tid = match e.track {
            Track::Compute => COMPUTE_TID,
            Track::Comm => COMM_TID,
        };
        if let Some(issued) = e.issued {
            out.push(
                json!({"ph": "i", "s": "t", "name": format!("issue {} `{}`", e.op, e.name),
                            "cat": "comm", "pid": e.rank, "tid": COMPUTE_TID, "ts": us(issued.at),
                            "args": {"bytes": e.bytes, "seq": issued.seq}}),
            );
        }
        let (Some(start), Some(end)) = (e.start, e.end) else {
            continue;
        };
        let mut args = json!({"start_seq": start.seq, "end_seq": end.seq, "kind": e.kind});
        let name = match e.track {
            Track::Compute => e.name.clone(),
            Track::Comm => {
                args["op"] = json!(e.op);
                args["tag"] = json!(e.name);
                args["bytes"] = json!(e.bytes);
                if let Some(issued) = e.issued {
                    args["queued_us"] = json!(us(start.at) - us(issued.at));
                }
                if let Some(err) = &e.error {
                    args["error"] = json!(err);
                }
                format!("{} `{}`", e.op, e.name)
            }
        };
        out.push(json!({"ph": "X", "name": name,
                        "cat": if e.track == Track::Comm { "comm" } else { "compute" },
                        "pid": e.rank, "tid": tid, "ts": us(start.at),
                        "dur": (us(end.at) - us(start.at)).max(0.0), "args": args}));
    }
    json!({"traceEvents": out, "displayTimeUnit": "ms"})
}
