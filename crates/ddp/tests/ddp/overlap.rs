//! Overlap, checked from the recorded event order (sequence numbers), not from timing.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use brigade_autograd::{GradReady, GradSubscriber, SubscriberError};
use brigade_comm::{run_on_threads, EventKind, Recorder, Track};
use brigade_ddp::{bucket_of, DdpConfig, DistributedDataParallel, Phase};
use brigade_tensor::set_compute_threads;
use common::{data, rows, Mlp};

// floats per layer: l0 16*32+32 = 544, l1 = l2 = 32*32+32 = 1056, l3 = 32*8+8 = 264
const WIDTHS: [usize; 5] = [16, 32, 32, 32, 8];
// bucket 0 = layers 3 and 2 = (264 + 1056) * 4 bytes; bucket 1 = layers 1 and 0
const TWO_LAYERS_BYTES: f64 = ((264 + 1056) * 4) as f64;

/// When `layers.1.weight` is announced (bucket 0 = layers 3 and 2 is already issued, layers
/// 1 and 0 still have to run their backward), waits until this rank's comm stream has
/// *started* bucket 0's transfer, as the recorder saw it. A reducer that issued its buckets
/// only at the end of backward, or a stream that ran nothing until then, never gets there.
struct AwaitBucket0Start {
    recorder: Recorder,
    rank: usize,
    seen: std::sync::Mutex<usize>,
}

impl GradSubscriber for AwaitBucket0Start {
    fn grad_ready(&self, r: GradReady<'_>) -> Result<(), SubscriberError> {
        if r.name != "layers.1.weight" {
            return Ok(());
        }
        let mut seen = self.seen.lock().unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let started = self
                .recorder
                .events()
                .iter()
                .filter(|e| e.rank == self.rank && e.name == "bucket0" && e.start.is_some())
                .count();
            if started > *seen {
                *seen = started;
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err("bucket0's transfer did not start while backward was still running".into());
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

#[test]
fn bucket0_starts_before_the_first_layer_runs_backward_and_bucket_order_agrees() {
    let world = 2;
    let recorder = Recorder::new();
    let (x, y) = data(world * 8 * 2, WIDTHS[0], WIDTHS[4], 5);
    let buckets = run_on_threads(world, |comm| {
        set_compute_threads(1);
        let rank = comm.rank();
        let comm = Arc::new(comm.traced(recorder.clone()));
        let m = Mlp::new(&WIDTHS, 1);
        let cfg = DdpConfig {
            first_bucket_cap_mb: TWO_LAYERS_BYTES / (1024.0 * 1024.0),
            bucket_cap_mb: 1.0,
            recorder: Some(recorder.clone()),
            ..DdpConfig::default()
        };
        let ddp = DistributedDataParallel::new(&m.store, comm, cfg, common::average()).unwrap();
        m.store.bus().subscribe(Arc::new(AwaitBucket0Start {
            recorder: recorder.clone(),
            rank,
            seen: Default::default(),
        }));
        for step in 0..2 {
            let (xb, yb) = rows(&x, &y, step * world * 8 + rank * 8, 8);
            m.store.zero_grad().unwrap();
            m.loss(&xb, &yb).backward().unwrap();
        }
        ddp.buckets()
    })
    .into_iter()
    .map(|r| r.unwrap())
    .collect::<Vec<_>>();

    let names = |i: usize| buckets[0][i].params.clone();
    assert_eq!(buckets[0].len(), 2, "{:?}", buckets[0]);
    // After the first iteration the buckets were rebuilt from the ready order: the fused
    // linear op hands out its weight's gradient, then its bias's.
    assert_eq!(
        names(0),
        ["layers.3.weight", "layers.3.bias", "layers.2.weight", "layers.2.bias"]
    );
    assert_eq!(
        names(1),
        ["layers.1.weight", "layers.1.bias", "layers.0.weight", "layers.0.bias"]
    );

    let events = recorder.events();
    for rank in 0..world {
        let tags: Vec<&str> = events
            .iter()
            .filter(|e| e.rank == rank && e.track == Track::Comm && e.op == "all_reduce")
            .map(|e| e.name.as_str())
            .collect();
        assert_eq!(
            tags,
            ["bucket0", "bucket1", "bucket0", "bucket1"],
            "rank {rank} bucket order"
        );
        let kinds: Vec<Option<usize>> = events
            .iter()
            .filter(|e| e.rank == rank && e.track == Track::Comm && e.op == "all_reduce")
            .map(|e| bucket_of(&e.kind))
            .collect();
        assert_eq!(
            kinds,
            [Some(0), Some(1), Some(0), Some(1)],
            "rank {rank}: the reducer records each bucket's kind"
        );

        let bucket0: Vec<_> = events
            .iter()
            .filter(|e| e.rank == rank && e.kind == EventKind::Collective { tag: Some(0) })
            .collect();
        let issued: Vec<u64> = bucket0.iter().map(|e| e.issued.unwrap().seq).collect();
        let started: Vec<u64> = bucket0.iter().map(|e| e.start.unwrap().seq).collect();
        let layer0: Vec<u64> = events
            .iter()
            .filter(|e| e.rank == rank && e.kind == Phase::backward(Some("layers.0")).kind())
            .map(|e| e.start.unwrap().seq)
            .collect();
        let layer1: Vec<u64> = events
            .iter()
            .filter(|e| e.rank == rank && e.kind == Phase::backward(Some("layers.1")).kind())
            .map(|e| e.start.unwrap().seq)
            .collect();
        // backward's last node ran inside the span of layers.0: its end is the end of backward
        let layer0_end: Vec<u64> = events
            .iter()
            .filter(|e| e.rank == rank && e.track == Track::Compute && e.name == "backward layers.0")
            .map(|e| e.end.unwrap().seq)
            .collect();
        assert_eq!(
            (issued.len(), layer0.len(), layer1.len(), layer0_end.len()),
            (2, 2, 2, 2)
        );
        for it in 0..2 {
            // the transfer itself was under way before the first layer's backward began, so
            // long before backward ended
            assert!(
                started[it] < layer0[it],
                "rank {rank} iteration {it}: bucket0 started at {} after layers.0 backward began at {}",
                started[it],
                layer0[it]
            );
            assert!(
                started[it] < layer0_end[it],
                "rank {rank} iteration {it}: bucket0 started at {} after backward ended at {}",
                started[it],
                layer0_end[it]
            );
            assert!(
                issued[it] < layer1[it],
                "rank {rank} iteration {it}: bucket0 issued at {} after layers.1 backward began at {}",
                issued[it],
                layer1[it]
            );
            assert!(
                issued[it] < layer0[it],
                "rank {rank} iteration {it}: bucket0 issued at {} after layers.0 backward began at {}",
                issued[it],
                layer0[it]
            );
        }
    }
}
