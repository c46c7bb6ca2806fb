//! The shared-memory path with threads standing in for processes (the segment is one
//! allocation of this process): results against a serial reference, agreement, timeouts.

use std::time::{Duration, Instant};

use half::{bf16, f16};

use super::segment::SLOT_BYTES;
use super::{ShmNode, REGION_BYTES};
use crate::collective::OpDesc;
use crate::kernels::Element;
use crate::{CommError, DType, ReduceOp};

use crate::collective::OpKind;
use crate::heap;

/// A zeroed segment for `size` local ranks, and each rank's region.
struct Segment {
    words: Vec<u64>,
    size: usize,
}

impl Segment {
    fn new(size: usize) -> Self {
        Segment {
            words: vec![0u64; size * REGION_BYTES / 8 + 8],
            size,
        }
    }

    fn regions(&mut self) -> Vec<usize> {
        let base = self.words.as_mut_ptr() as usize;
        let base = base.next_multiple_of(64);
        (0..self.size).map(|r| base + r * REGION_BYTES).collect()
    }
}

/// Runs `f(node, local rank)` on `size` threads sharing one segment; results in rank order.
fn on_node<R: Send>(size: usize, timeout: Duration, f: impl Fn(&mut ShmNode, usize) -> R + Sync) -> Vec<R> {
    on_node_with(size, timeout, false, f)
}

/// As [`on_node`]; with `heaps`, every rank's node also maps the process's shared heap (one
/// process: the same mapping stands for every rank's).
fn on_node_with<R: Send>(
    size: usize,
    timeout: Duration,
    heaps: bool,
    f: impl Fn(&mut ShmNode, usize) -> R + Sync,
) -> Vec<R> {
    let heap = heaps.then(|| heap::heap_or_make().expect("the comm tests install SharedHeap"));
    let heap = heap.map(|h| h.base() as usize);
    let mut segment = Segment::new(size);
    let regions = segment.regions();
    let f = &f;
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..size)
            .map(|me| {
                let regions = regions.clone();
                s.spawn(move || {
                    let ptrs = regions.iter().map(|&p| p as *mut u8).collect();
                    // SAFETY: the segment outlives the scope and starts zeroed.
                    let mut node = unsafe { ShmNode::new(ptrs, me, (0..size).collect(), timeout) };
                    if let Some(base) = heap {
                        // SAFETY: the process's heap is mapped until it ends.
                        node = unsafe { node.with_heaps(vec![(base as *mut u8, heap::HEAP_BYTES); size]) };
                    }
                    f(&mut node, me)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Deterministic, rank- and index-dependent values that are exact in every dtype.
fn value(rank: usize, i: usize, salt: usize) -> f32 {
    let h = (rank * 7919 + i * 104_729 + salt * 31) % 2001;
    (h as f32 - 1000.0) / 64.0
}

fn input<E: Element>(rank: usize, n: usize, salt: usize) -> Vec<E> {
    (0..n).map(|i| E::from_f32(value(rank, i, salt))).collect()
}

/// f32 accumulation in rank order, rounded once: what the thread backend computes.
fn reference<E: Element>(size: usize, n: usize, salt: usize, op: ReduceOp) -> Vec<E> {
    (0..n)
        .map(|i| {
            let mut acc = E::from_f32(value(0, i, salt)).to_f32();
            for r in 1..size {
                let x = E::from_f32(value(r, i, salt)).to_f32();
                acc = match op {
                    ReduceOp::Max => acc.max(x),
                    _ => acc + x,
                };
            }
            if op == ReduceOp::Avg {
                acc /= size as f32;
            }
            E::from_f32(acc)
        })
        .collect()
}

fn bits<E: Element>(v: &[E]) -> Vec<u32> {
    v.iter().map(|x| x.to_f32().to_bits()).collect()
}

fn desc(slot: u64, op: ReduceOp, dtype: DType, n: usize, tag: &str) -> OpDesc {
    OpDesc::new(slot, OpKind::AllReduce(op), Some(dtype), n, tag)
}

fn far() -> Instant {
    Instant::now() + Duration::from_secs(30)
}

/// Where each rank's buffer lives.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Placement {
    /// Process-private memory: through the segment's slots.
    Private,
    /// Every rank's in its shared heap: in place.
    Heap,
    /// Rank 0's in its heap, the others' private: through the slots.
    Mixed,
}

impl Placement {
    /// Rank `me`'s input where this placement puts it: copied into the shared heap, or as is.
    fn place<E: Element>(self, data: Vec<E>, me: usize) -> Vec<E> {
        if self == Placement::Heap || (self == Placement::Mixed && me == 0) {
            let mut shared = heap::host_vec(data.len(), E::from_f32(0.0));
            shared.copy_from_slice(&data);
            shared
        } else {
            data
        }
    }
}

fn check_all_reduce<E: Element>(dtype: DType, placement: Placement) {
    let per_block = SLOT_BYTES / std::mem::size_of::<E>();
    // Empty, one element, odd, one block exactly, several blocks and an odd tail.
    let lens = [0, 1, 1031, per_block, 3 * per_block + 77];
    let heaps = placement != Placement::Private;
    for size in 1..=4 {
        let results = on_node_with(size, Duration::from_secs(30), heaps, |node, me| {
            let mut salt = 0;
            let mut slot = 0;
            let mut out = Vec::new();
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
                for n in lens {
                    salt += 1;
                    let d = desc(slot, op, dtype, n, "ar");
                    slot += 1;
                    let mut data: Vec<E> = placement.place(input(me, n, salt), me);
                    unsafe {
                        node.all_reduce(&d, data.as_mut_ptr(), n, op, size as f32, "ar", size, far())
                            .unwrap()
                    };
                    out.push((op, n, salt, data));
                }
            }
            (out, node.in_place_count())
        });
        let non_empty = 3 * lens.iter().filter(|&&n| n > 0).count() as u64;
        for (me, (_, in_place)) in results.iter().enumerate() {
            // One rank alone is "every rank" also when mixed.
            let all_in_heap = placement == Placement::Heap || (placement == Placement::Mixed && size == 1);
            let want = if all_in_heap { non_empty } else { 0 };
            assert_eq!(
                *in_place, want,
                "{dtype} {placement:?}, {size} ranks, rank {me}: all-reduces in place"
            );
        }
        let results: Vec<_> = results.into_iter().map(|(out, _)| out).collect();
        // each case's reference once, against every rank's result
        for (case, &(op, n, salt, _)) in results[0].iter().enumerate() {
            let want = bits(&reference::<E>(size, n, salt, op));
            for (me, rank_results) in results.iter().enumerate() {
                let data = &rank_results[case].3;
                assert_eq!(bits(data), want, "{dtype} {op} x {n}, {size} ranks, rank {me}");
            }
        }
    }
}

#[test]
fn all_reduce_matches_rank_order_f32_accumulation_bit_for_bit() {
    check_all_reduce::<f32>(DType::F32, Placement::Private);
    check_all_reduce::<f16>(DType::F16, Placement::Private);
    check_all_reduce::<bf16>(DType::BF16, Placement::Private);
}

#[test]
fn buffers_in_every_ranks_heap_are_reduced_in_place_to_the_same_bits() {
    let _one = heap::tests::HEAP_TESTS.lock().unwrap_or_else(|e| e.into_inner());
    check_all_reduce::<f32>(DType::F32, Placement::Heap);
    check_all_reduce::<f16>(DType::F16, Placement::Heap);
    check_all_reduce::<bf16>(DType::BF16, Placement::Heap);
}

#[test]
fn one_rank_outside_its_heap_sends_every_rank_through_the_slots() {
    let _one = heap::tests::HEAP_TESTS.lock().unwrap_or_else(|e| e.into_inner());
    check_all_reduce::<f32>(DType::F32, Placement::Mixed);
    check_all_reduce::<bf16>(DType::BF16, Placement::Mixed);
}

#[test]
fn reduce_scatter_then_all_gather_equals_the_all_reduce() {
    let _one = heap::tests::HEAP_TESTS.lock().unwrap_or_else(|e| e.into_inner());
    let n = 2 * (SLOT_BYTES / 2) + 333;
    for placement in [Placement::Private, Placement::Heap, Placement::Mixed] {
        for size in [2, 3] {
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
                let results = on_node_with(
                    size,
                    Duration::from_secs(30),
                    placement != Placement::Private,
                    |node, me| {
                        let mut data: Vec<bf16> = placement.place(input(me, n, 5), me);
                        let mut shard = Vec::new();
                        unsafe {
                            node.reduce_scatter_f32(data.as_ptr(), n, op, &mut shard, "rs", far())
                                .unwrap();
                            node.all_gather_f32(&shard, data.as_mut_ptr(), n, op, size as f32, "ag", far())
                                .unwrap();
                        }
                        (data, node.in_place_count())
                    },
                );
                let want = reference::<bf16>(size, n, 5, op);
                for (me, (out, in_place)) in results.iter().enumerate() {
                    assert_eq!(bits(out), bits(&want), "{op} on {size} ranks, {placement:?}, rank {me}");
                    let expected = u64::from(placement == Placement::Heap);
                    assert_eq!(
                        *in_place, expected,
                        "{op} on {size} ranks, {placement:?}, rank {me}: in place"
                    );
                }
            }
        }
    }
}

#[test]
fn a_mismatch_fails_every_rank_with_both_descriptions_and_the_next_collective_runs() {
    let results = on_node(3, Duration::from_secs(30), |node, me| {
        let (n, tag) = if me == 2 { (7, "grad 2") } else { (8, "grad 0") };
        let mut data = vec![me as f32; n];
        let d = desc(0, ReduceOp::Sum, DType::F32, n, tag);
        let first = unsafe { node.all_reduce(&d, data.as_mut_ptr(), n, ReduceOp::Sum, 3.0, tag, 3, far()) };
        let second = node.agree(&desc(1, ReduceOp::Sum, DType::F32, 4, "next"), "next", 3, far());
        let mut data = vec![me as f32; 4];
        let d = desc(2, ReduceOp::Sum, DType::F32, 4, "next");
        unsafe { node.all_reduce(&d, data.as_mut_ptr(), 4, ReduceOp::Sum, 3.0, "next", 3, far()) }.unwrap();
        (first, second, data)
    });
    for (me, (first, second, data)) in results.into_iter().enumerate() {
        match first {
            Err(CommError::Mismatch {
                slot: 0,
                expected_rank: 0,
                found_rank: 2,
                expected,
                found,
                tag,
            }) => {
                assert_eq!(tag, "grad 0");
                assert_eq!(expected, "all_reduce(sum, 8 x f32, tag `grad 0`)");
                assert_eq!(found, "all_reduce(sum, 7 x f32, tag `grad 2`)");
            }
            other => panic!("rank {me}: expected the mismatch, got {other:?}"),
        }
        second.unwrap();
        assert_eq!(data, vec![3.0; 4], "rank {me}");
    }
}

#[test]
fn a_missing_peer_times_out_and_the_late_one_fails_at_once() {
    let timeout = Duration::from_millis(300);
    let gate = std::sync::Barrier::new(2);
    let results = on_node(2, timeout, |node, me| {
        let d = desc(0, ReduceOp::Sum, DType::F32, 8, "grad 7");
        if me == 1 {
            // Joins only after rank 0 gave up.
            gate.wait();
        }
        // Rank 1's own deadline is a minute: failing at once and failing at its deadline are
        // far apart, whatever the machine's load.
        let deadline = if me == 0 { timeout } else { Duration::from_secs(60) };
        let t = Instant::now();
        let got = node.agree(&d, "grad 7", 2, Instant::now() + deadline);
        let took = t.elapsed();
        if me == 0 {
            gate.wait();
        }
        (got, took)
    });
    match &results[0] {
        (Err(CommError::Timeout { rank: 0, tag, .. }), took) => {
            assert_eq!(tag, "grad 7");
            assert!(*took >= timeout && *took < Duration::from_secs(10), "{took:?}");
        }
        other => panic!("rank 0: {other:?}"),
    }
    match &results[1] {
        (Err(CommError::RankFailed { rank: 0, reason, .. }), took) => {
            assert!(reason.contains("timed out") && reason.contains("[1]"), "{reason}");
            // At once, not after its own deadline.
            assert!(*took < Duration::from_secs(30), "{took:?}");
        }
        other => panic!("rank 1: {other:?}"),
    }
}

#[test]
fn collectives_of_changing_lengths_back_to_back_keep_their_blocks_apart() {
    // Many small and multi-block all-reduces in a row exercise the double-buffered halves
    // and descriptors: a rank refilling a half too early would corrupt a peer's block.
    let per_block = SLOT_BYTES / 4;
    let lens = [1usize, 2 * per_block + 1, 3, per_block, 16, 3 * per_block - 5, 5];
    let results = on_node(3, Duration::from_secs(30), |node, me| {
        let mut out = Vec::new();
        for (i, &n) in lens.iter().cycle().take(40).enumerate() {
            let d = desc(i as u64, ReduceOp::Sum, DType::F32, n, "b");
            let mut data: Vec<f32> = input(me, n, i);
            unsafe { node.all_reduce(&d, data.as_mut_ptr(), n, ReduceOp::Sum, 3.0, "b", 3, far()) }.unwrap();
            if i % 3 == 0 {
                // Phases without data in between shift which slot each block uses.
                node.agree(&OpDesc::new(i as u64, OpKind::Barrier, None, 0, "x"), "x", 3, far())
                    .unwrap();
            }
            out.push(data);
        }
        out
    });
    for (i, &n) in lens.iter().cycle().take(40).enumerate() {
        let want = reference::<f32>(3, n, i, ReduceOp::Sum);
        for (me, out) in results.iter().enumerate() {
            assert_eq!(bits(&out[i]), bits(&want), "collective {i} ({n} elements), rank {me}");
        }
    }
}
