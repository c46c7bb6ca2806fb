//! Bytes sent per step per rank, summarized for `brigade train`'s report and the policy sweep.
//!
//! DDP meters what it sends (`DdpConfig::meter`): every collective DDP or its reducer policy
//! issues during a step is counted on the rank that issued it — the gradient reduction and,
//! in step 0, the one-off bucket rebuild; not the trainer's own
//! per-step loss agreement (12 bytes). Two figures: *payload* (bytes of the buffers handed to
//! the collectives: what a policy compresses) and *wire* (what the rank sends under the ring
//! algorithms, e.g. `2(n-1)/n` × payload for an all-reduce on `n` ranks). Rank 0's figures
//! are reported; every built-in policy sends the same on every rank.

use brigade_comm::CommBytes;
use serde::Serialize;
use serde_json::{json, Value};

/// Rank 0's bytes over the steps of a run.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SentSummary {
    /// Mean payload bytes per step.
    pub payload_per_step: f64,
    /// Payload bytes of the last step (a policy's steady state, e.g. PowerSGD after its start).
    pub payload_last_step: u64,
    /// Payload bytes of the whole run.
    pub payload_total: u64,
    /// Mean ring wire bytes per step.
    pub wire_per_step: f64,
    /// Ring wire bytes of the whole run.
    pub wire_total: f64,
}

impl SentSummary {
    /// The summary of `sent` (one entry per step run); `None` when no step ran.
    pub fn of(sent: &[CommBytes]) -> Option<SentSummary> {
        let last = sent.last()?;
        let payload_total: u64 = sent.iter().map(|s| s.payload_bytes).sum();
        let wire_total: f64 = sent.iter().map(|s| s.wire_bytes).sum();
        Some(SentSummary {
            payload_per_step: payload_total as f64 / sent.len() as f64,
            payload_last_step: last.payload_bytes,
            payload_total,
            wire_per_step: wire_total / sent.len() as f64,
            wire_total,
        })
    }

    /// The summary's fields for `brigade train --json`, with the payload of every step.
    pub fn json_fields(sent: &[CommBytes]) -> Value {
        let s = SentSummary::of(sent);
        json!({
            "sent_bytes_per_step": s.map(|s| s.payload_per_step),
            "sent_bytes_last_step": s.map(|s| s.payload_last_step),
            "sent_bytes_total": s.map(|s| s.payload_total),
            "wire_bytes_per_step": s.map(|s| s.wire_per_step),
            "wire_bytes_total": s.map(|s| s.wire_total),
            "sent_bytes_by_step": sent.iter().map(|s| s.payload_bytes).collect::<Vec<_>>(),
        })
    }

    /// One line for `brigade train`'s summary: the wire bytes labelled by `formula`, the
    /// policy's collectives ([`brigade::policies::PolicySpec::wire_formula`]; `None`: unlabelled).
    pub fn line(&self, formula: Option<String>) -> String {
        format!(
            "sent per rank: {}/step (last step {}, run {}); ring wire bytes {}/step{}",
            human_bytes(self.payload_per_step),
            human_bytes(self.payload_last_step as f64),
            human_bytes(self.payload_total as f64),
            human_bytes(self.wire_per_step),
            formula.map_or_else(String::new, |f| format!(" ({f})")),
        )
    }
}

/// `1.50 MiB`, `832 B`.
pub fn human_bytes(b: f64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if b < 1024.0 {
        return format!("{b:.0} B");
    }
    let mut v = b / 1024.0;
    let mut unit = UNITS[0];
    for u in &UNITS[1..] {
        if v < 1024.0 {
            break;
        }
        v /= 1024.0;
        unit = u;
    }
    format!("{v:.2} {unit}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(payload: u64, wire: f64) -> CommBytes {
        CommBytes {
            collectives: 1,
            payload_bytes: payload,
            wire_bytes: wire,
        }
    }

    #[test]
    fn the_summary_averages_the_steps_and_keeps_the_last() {
        let s = SentSummary::of(&[step(1000, 1500.0), step(100, 150.0), step(100, 150.0)]).unwrap();
        // (1000 + 100 + 100) / 3 = 400 per step; wire 1800 / 3 = 600
        assert_eq!(s.payload_per_step, 400.0);
        assert_eq!((s.payload_last_step, s.payload_total), (100, 1200));
        assert_eq!((s.wire_per_step, s.wire_total), (600.0, 1800.0));
        assert_eq!(SentSummary::of(&[]), None);
    }

    #[test]
    fn bytes_read_as_people_write_them() {
        assert_eq!(human_bytes(832.0), "832 B");
        assert_eq!(human_bytes(1536.0), "1.50 KiB");
        assert_eq!(human_bytes(3.0 * 1024.0 * 1024.0), "3.00 MiB");
    }
}
