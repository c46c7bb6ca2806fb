//! Tracing: ordered events per rank and track, recorded without `wait`, and Chrome trace JSON.

use std::time::{Duration, Instant};

use brigade_comm::{
    run_on_threads_with_timeout, tagging_collectives, Buffer, EventKind, Recorder, ReduceOp, TraceEvent, Track,
};

const TIMEOUT: Duration = Duration::from_secs(20);

/// Waits until `ready` (generously: a loaded machine may take seconds to run the threads that
/// record).
fn wait_until(mut ready: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !ready() {
        assert!(Instant::now() < deadline, "timed out waiting for the recorder");
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn find<'a>(events: &'a [TraceEvent], rank: usize, name: &str) -> &'a TraceEvent {
    events
        .iter()
        .find(|e| e.rank == rank && e.name == name)
        .unwrap_or_else(|| panic!("no `{name}` on rank {rank}"))
}

#[test]
fn traced_collectives_and_compute_spans_are_ordered() {
    let recorder = Recorder::new();
    run_on_threads_with_timeout(2, TIMEOUT, |comm| {
        let rank = comm.rank();
        let comm = comm.traced(recorder.clone());
        let layer1 = recorder.begin(rank, EventKind::scoped("backward", "layer 1"));
        let work = tagging_collectives(0, || {
            comm.all_reduce(Buffer::F32(vec![1.0; 1000]), ReduceOp::Sum, "grad 0")
        });
        recorder.end(layer1);
        {
            let _span = recorder.span(rank, EventKind::scoped("backward", "layer 0"));
        }
        // Never waited on: the recorder must still learn when it started and finished.
        drop(work);
        let bad = comm.all_reduce(Buffer::F32(vec![1.0; 1 + rank]), ReduceOp::Sum, "grad 1");
        assert!(bad.wait().is_err());
    })
    .into_iter()
    .for_each(|r| r.unwrap());
    wait_until(|| recorder.events().iter().all(|e| e.end.is_some()));
    let events = recorder.events();
    assert_eq!(events.len(), 8);
    for rank in 0..2 {
        let bucket = find(&events, rank, "grad 0");
        let (issued, start, end) = (bucket.issued.unwrap(), bucket.start.unwrap(), bucket.end.unwrap());
        assert_eq!(
            (bucket.track, bucket.op.as_str(), bucket.bytes),
            (Track::Comm, "all_reduce", 4000)
        );
        assert_eq!(
            bucket.kind,
            EventKind::Collective { tag: Some(0) },
            "issued inside tagging_collectives(0)"
        );
        assert!(issued.seq < start.seq && start.seq < end.seq);
        assert!(issued.at <= start.at && start.at <= end.at);
        let l1 = find(&events, rank, "backward layer 1");
        let l0 = find(&events, rank, "backward layer 0");
        assert_eq!(l0.track, Track::Compute);
        assert!(
            l1.start.unwrap().seq < issued.seq,
            "layer 1 began before the bucket was issued"
        );
        assert!(issued.seq < l1.end.unwrap().seq);
        assert!(l1.end.unwrap().seq < l0.start.unwrap().seq && l0.start.unwrap().seq < l0.end.unwrap().seq);
        assert_eq!(
            l1.kind,
            EventKind::Span {
                label: "backward".into(),
                index: None,
                scope: Some("layer 1".into())
            }
        );
        let bad = find(&events, rank, "grad 1");
        assert_eq!(bad.kind, EventKind::Collective { tag: None }, "issued outside any tag");
        assert!(bad.error.as_deref().unwrap().contains("mismatch"), "{:?}", bad.error);
    }
    let mut seqs: Vec<u64> = events
        .iter()
        .flat_map(|e| [e.issued, e.start, e.end])
        .flatten()
        .map(|s| s.seq)
        .collect();
    let n = seqs.len();
    seqs.sort_unstable();
    seqs.dedup();
    assert_eq!(seqs.len(), n, "sequence numbers must be unique");
}

#[test]
fn chrome_trace_has_a_process_per_rank_and_two_tracks() {
    let recorder = Recorder::new();
    let t0 = Instant::now();
    recorder.compute_span(0, EventKind::span("forward"), t0, t0 + Duration::from_millis(2));
    recorder.compute_span(1, EventKind::span("forward"), t0, t0 + Duration::from_millis(3));
    let c = recorder.comm_issued(1, "all_reduce", "grad 0", 64, Some(0));
    recorder.comm_started(c, t0 + Duration::from_millis(3));
    recorder.comm_finished(c, t0 + Duration::from_millis(5), None);
    let trace = recorder.to_chrome_trace();
    let evs = trace["traceEvents"].as_array().unwrap();
    let named = |pid: u64, tid: u64, what: &str| {
        evs.iter()
            .any(|e| e["ph"] == "M" && e["pid"] == pid && e["tid"] == tid && e["args"]["name"] == what)
    };
    assert!(named(0, 0, "rank 0") && named(1, 0, "rank 1"));
    assert!(named(0, 0, "compute") && named(0, 1, "comm stream") && named(1, 1, "comm stream"));
    let spans: Vec<_> = evs.iter().filter(|e| e["ph"] == "X").collect();
    assert_eq!(spans.len(), 3);
    let comm = spans.iter().find(|e| e["cat"] == "comm").unwrap();
    assert_eq!((comm["pid"].as_u64(), comm["tid"].as_u64()), (Some(1), Some(1)));
    assert_eq!(comm["args"]["bytes"], 64);
    assert_eq!(comm["name"], "all_reduce `grad 0`", "the tag stays readable");
    assert_eq!(comm["args"]["kind"], serde_json::json!({"Collective": {"tag": 0}}));
    assert!((comm["dur"].as_f64().unwrap() - 2000.0).abs() < 1.0, "{comm}");
    let fwd0 = spans.iter().find(|e| e["pid"] == 0).unwrap();
    assert_eq!(fwd0["tid"], 0);
    assert_eq!(fwd0["name"], "forward");
    assert!((fwd0["dur"].as_f64().unwrap() - 2000.0).abs() < 1.0);
    assert!(evs.iter().any(|e| e["ph"] == "i" && e["pid"] == 1 && e["tid"] == 0));

    let dir = crate::common::Scratch::dir("trace-test");
    let path = dir.join("trace.json");
    recorder.write_chrome_trace(&path).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    assert_eq!(text, serde_json::to_string(&trace).unwrap());
    let back: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(back["traceEvents"].as_array().unwrap().len(), evs.len());
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        1,
        "temporary file left behind"
    );
}

#[test]
fn events_during_select_each_ranks_span_by_kind() {
    let recorder = Recorder::new();
    // A span named like step 1 but of another kind, around step 0: not a step marker.
    let fake = recorder.begin(0, EventKind::span("step 1"));
    for step in 0..2 {
        for rank in 0..2 {
            let s = recorder.begin(rank, EventKind::indexed("step", step));
            recorder.span(rank, EventKind::span("forward"));
            let c = recorder.comm_issued(rank, "all_reduce", "grad0", 4, Some(0));
            recorder.comm_started(c, Instant::now());
            recorder.comm_finished(c, Instant::now(), None);
            recorder.end(s);
        }
        if step == 0 {
            recorder.end(fake);
        }
    }
    let events = recorder.events_during(&EventKind::indexed("step", 1));
    assert_eq!(events.len(), 6, "{events:#?}");
    assert!(events.iter().all(|e| e.id >= 7 && e.id < 13), "{events:#?}");
    assert_eq!(
        events
            .iter()
            .filter(|e| e.kind == EventKind::indexed("step", 1))
            .count(),
        2
    );
    assert_eq!(events.iter().filter(|e| e.kind.tag() == Some(0)).count(), 2);
    assert!(recorder.events_during(&EventKind::indexed("step", 2)).is_empty());
}

#[test]
fn a_retimed_span_takes_the_new_instants_and_stays_in_its_step() {
    let recorder = Recorder::new();
    let step0 = recorder.begin(0, EventKind::indexed("step", 0));
    let span = recorder.begin(0, EventKind::scoped("backward", "layers.1"));
    recorder.end(span);
    recorder.end(step0);
    // Measured later (a GPU clock read during the next step): earlier instants than the host's.
    let step1 = recorder.begin(0, EventKind::indexed("step", 1));
    let origin = recorder.origin();
    let (start, end) = (origin + Duration::from_micros(10), origin + Duration::from_micros(30));
    recorder.retime(span, start, end);
    recorder.end(step1);
    let events = recorder.events_during(&EventKind::indexed("step", 0));
    let e = events
        .iter()
        .find(|e| e.kind == EventKind::scoped("backward", "layers.1"))
        .expect("the retimed span is still in step 0");
    assert_eq!((e.start.unwrap().at, e.end.unwrap().at), (start, end));
    assert!(recorder
        .events_during(&EventKind::indexed("step", 1))
        .iter()
        .all(|e| e.kind != EventKind::scoped("backward", "layers.1")));
}

#[test]
fn a_plain_handle_shares_the_traced_stream_without_being_traced_and_keeps_it_open() {
    let recorder = Recorder::new();
    let sums = run_on_threads_with_timeout(2, TIMEOUT, |comm| {
        let plain = comm.plain();
        let traced = comm.traced(recorder.clone());
        let a = traced
            .all_reduce(Buffer::F32(vec![1.0]), ReduceOp::Sum, "traced")
            .wait()
            .unwrap();
        let b = plain
            .all_reduce(Buffer::F32(vec![2.0]), ReduceOp::Sum, "control")
            .wait()
            .unwrap();
        // the stream stays open for the plain handle once the traced one is gone
        drop(traced);
        let c = plain
            .all_reduce(Buffer::F32(vec![3.0]), ReduceOp::Sum, "after")
            .wait()
            .unwrap();
        [a, b, c].map(|x| match x {
            Buffer::F32(v) => v[0],
            other => panic!("an f32 all-reduce returned {}", other.dtype()),
        })
    });
    for s in sums {
        assert_eq!(s.unwrap(), [2.0, 4.0, 6.0]);
    }
    wait_until(|| recorder.events().iter().all(|e| e.end.is_some()));
    let names: Vec<String> = recorder.events().into_iter().map(|e| e.name).collect();
    assert_eq!(
        names,
        ["traced", "traced"],
        "only the traced handle's collective, on each rank"
    );
}
