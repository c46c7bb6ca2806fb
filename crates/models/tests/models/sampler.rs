//! The distributed sampler (library side): PyTorch's `DistributedSampler`
//! semantics, checked exhaustively over small datasets and worlds.

use std::collections::BTreeMap;

use brigade_models::{DistributedSampler, ModelError, Remainder, SamplerCursor, SamplerOptions, SamplerPosition};

const REMAINDERS: [Remainder; 3] = [Remainder::Pad, Remainder::Drop, Remainder::Uneven];

fn opts(shuffle: bool, seed: u64, remainder: Remainder) -> SamplerOptions {
    SamplerOptions {
        shuffle,
        seed,
        remainder,
    }
}

fn samplers(len: usize, world: usize, o: SamplerOptions) -> Option<Vec<DistributedSampler>> {
    (0..world)
        .map(|r| DistributedSampler::new(len, world, r, o).ok())
        .collect()
}

/// How often each row is read in one epoch, over all ranks.
fn counts(ranks: &[DistributedSampler], epoch: u64) -> BTreeMap<usize, usize> {
    let mut c = BTreeMap::new();
    for s in ranks {
        for i in s.indices_of(s.rank(), epoch) {
            *c.entry(i).or_insert(0) += 1;
        }
    }
    c
}

#[test]
fn every_row_is_read_once_per_epoch_across_ranks() {
    for len in 1..=13 {
        for world in 1..=5 {
            for remainder in REMAINDERS {
                for shuffle in [false, true] {
                    let o = opts(shuffle, 7, remainder);
                    let Some(ranks) = samplers(len, world, o) else {
                        assert!(remainder == Remainder::Drop && len < world, "{len} {world} {o:?}");
                        continue;
                    };
                    for epoch in 0..3 {
                        let c = counts(&ranks, epoch);
                        let lens: Vec<usize> = ranks.iter().map(|s| s.indices_of(s.rank(), epoch).len()).collect();
                        assert_eq!(lens, ranks[0].rank_lengths(), "lengths known up front");
                        assert_eq!(lens.iter().sum::<usize>(), ranks[0].total_size());
                        let case = format!("len {len} world {world} {o:?} epoch {epoch}");
                        match remainder {
                            // every row once, the first len % world ranks one more
                            Remainder::Uneven => {
                                assert!(c.len() == len && c.values().all(|&n| n == 1), "{case}: {c:?}");
                                let want: Vec<usize> =
                                    (0..world).map(|r| len / world + usize::from(r < len % world)).collect();
                                assert_eq!(lens, want, "{case}");
                            }
                            // every rank ceil(len / world); each row at least once, the padding
                            // a repeat of rows, no row more than twice more than another
                            Remainder::Pad => {
                                assert_eq!(c.len(), len, "{case}: {c:?}");
                                assert!(lens.iter().all(|&n| n == len.div_ceil(world)), "{case}");
                                let (lo, hi) = (c.values().min().unwrap(), c.values().max().unwrap());
                                assert!(*lo >= 1 && hi - lo <= 1 + world / len, "{case}: {c:?}");
                            }
                            // every rank floor(len / world); rows at most once, len % world left out
                            Remainder::Drop => {
                                assert!(c.values().all(|&n| n == 1), "{case}: {c:?}");
                                assert_eq!(c.len(), len - len % world, "{case}");
                                assert!(lens.iter().all(|&n| n == len / world), "{case}");
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn pytorch_semantics_worked_by_hand() {
    // no shuffle, 10 rows, 4 ranks, padding: order 0..10 + [0, 1]; rank r takes r, r+4, r+8
    let s = |rank, remainder| DistributedSampler::new(10, 4, rank, opts(false, 0, remainder)).unwrap();
    assert_eq!(s(0, Remainder::Pad).indices(), [0, 4, 8]);
    assert_eq!(s(1, Remainder::Pad).indices(), [1, 5, 9]);
    assert_eq!(s(2, Remainder::Pad).indices(), [2, 6, 0]);
    assert_eq!(s(3, Remainder::Pad).indices(), [3, 7, 1]);
    // drop_last: order cut to 8
    assert_eq!(s(2, Remainder::Drop).indices(), [2, 6]);
    // uneven: ranks 0 and 1 read 3 rows, 2 and 3 read 2
    assert_eq!(s(1, Remainder::Uneven).indices(), [1, 5, 9]);
    assert_eq!(s(3, Remainder::Uneven).indices(), [3, 7]);
    // padding longer than the data repeats it: 2 rows over 5 ranks -> [0, 1, 0, 1, 0]
    let tiny: Vec<Vec<usize>> = (0..5)
        .map(|r| {
            DistributedSampler::new(2, 5, r, opts(false, 0, Remainder::Pad))
                .unwrap()
                .indices()
        })
        .collect();
    assert_eq!(tiny, [vec![0], vec![1], vec![0], vec![1], vec![0]]);
    // PyTorch's defaults: shuffle, seed 0, pad
    assert_eq!(SamplerOptions::default(), opts(true, 0, Remainder::Pad));
}

#[test]
fn the_same_seed_gives_the_same_order_and_each_epoch_its_own() {
    let mk = |seed| DistributedSampler::new(1000, 3, 1, opts(true, seed, Remainder::Pad)).unwrap();
    let (mut a, mut b) = (mk(5), mk(5));
    for epoch in [0, 1, 7] {
        a.set_epoch(epoch);
        b.set_epoch(epoch);
        assert_eq!(a.indices(), b.indices(), "epoch {epoch}");
        assert_eq!(a.epoch(), epoch);
    }
    a.set_epoch(0);
    b.set_epoch(1);
    assert_ne!(a.indices(), b.indices(), "set_epoch changes the permutation");
    let c = mk(6);
    a.set_epoch(0);
    assert_ne!(a.indices(), c.indices(), "another seed, another permutation");
    // the permutation is PyTorch's seed + epoch: seed 5 epoch 1 is seed 6 epoch 0
    b.set_epoch(1);
    assert_eq!(b.indices(), c.indices());
    // a shuffled epoch is a permutation of the rows, padded with its own first rows
    // (1000 rows over 3 ranks: 1002)
    let order = a.epoch_order(0);
    assert_eq!(order.len(), 1002);
    assert_eq!(order[1000..], order[..2]);
    let mut rows = order[..1000].to_vec();
    rows.sort_unstable();
    assert_eq!(rows, (0..1000).collect::<Vec<_>>());
    assert_ne!(order[..1000], (0..1000).collect::<Vec<_>>()[..], "shuffled");
}

#[test]
fn a_global_batch_reads_the_same_rows_for_any_world_size() {
    // world w, per-rank batch b, global batch w*b: step s reads the rows of positions
    // [s*w*b, (s+1)*w*b) of the epoch's order, whatever w (when w divides the data)
    let (len, global) = (48, 12);
    for world in [1, 2, 3, 4, 6] {
        let per_rank = global / world;
        let mut cursors: Vec<SamplerCursor> = (0..world)
            .map(|r| {
                let s = DistributedSampler::new(len, world, r, opts(true, 3, Remainder::Pad)).unwrap();
                SamplerCursor::new(s, SamplerPosition { epoch: 0, index: 0 }).unwrap()
            })
            .collect();
        let reference = DistributedSampler::new(len, 1, 0, opts(true, 3, Remainder::Pad)).unwrap();
        for step in 0..10 {
            let mut rows: Vec<usize> = cursors.iter_mut().flat_map(|c| c.next_rows(per_rank)).collect();
            rows.sort_unstable();
            let k = (step * global) % len;
            let epoch = (step * global / len) as u64;
            let mut want = reference.epoch_order(epoch)[k..k + global].to_vec();
            want.sort_unstable();
            assert_eq!(rows, want, "world {world} step {step}");
        }
    }
}

#[test]
fn resume_from_epoch_and_index_is_exact() {
    for remainder in REMAINDERS {
        let s = DistributedSampler::new(23, 3, 2, opts(true, 11, remainder)).unwrap();
        let mut whole = SamplerCursor::new(s.clone(), SamplerPosition { epoch: 0, index: 0 }).unwrap();
        let stream: Vec<usize> = (0..9).flat_map(|_| whole.next_rows(5)).collect();
        for consumed in [0usize, 1, 4, 7, 8, 15, 21, 40] {
            let at = s.position_after(consumed as u64);
            let per_epoch = s.num_samples();
            assert_eq!(
                at,
                SamplerPosition {
                    epoch: (consumed / per_epoch) as u64,
                    index: consumed % per_epoch
                }
            );
            let mut resumed = SamplerCursor::new(s.clone(), at).unwrap();
            assert_eq!(resumed.position(), at);
            let tail = resumed.next_rows(stream.len() - consumed);
            assert_eq!(tail[..], stream[consumed..], "{remainder:?} resumed after {consumed}");
        }
        // a cursor reads epoch after epoch: its stream is the epochs' indices back to back
        let mut epochs = vec![];
        for e in 0..(stream.len() / s.num_samples() + 1) as u64 {
            epochs.extend(s.indices_of(2, e));
        }
        assert_eq!(stream[..], epochs[..stream.len()], "{remainder:?}");
    }
}

#[test]
fn samplers_that_cannot_be_are_errors() {
    let e = |r: Result<DistributedSampler, ModelError>| r.unwrap_err().to_string();
    assert!(e(DistributedSampler::new(0, 2, 0, SamplerOptions::default())).contains("no rows"));
    assert!(e(DistributedSampler::new(5, 2, 2, SamplerOptions::default())).contains("rank 2 is not in a world of 2"));
    assert!(e(DistributedSampler::new(5, 0, 0, SamplerOptions::default())).contains("world of 0"));
    let drop = opts(true, 0, Remainder::Drop);
    assert!(e(DistributedSampler::new(3, 4, 0, drop)).contains("3 rows cannot give each of 4 ranks"));
    // an uneven rank without rows: its length says so before step 0, and a cursor refuses it
    let last = DistributedSampler::new(3, 4, 3, opts(true, 0, Remainder::Uneven)).unwrap();
    assert_eq!(last.rank_lengths(), [1, 1, 1, 0]);
    assert!(SamplerCursor::new(last, SamplerPosition { epoch: 0, index: 0 }).is_err());
}
