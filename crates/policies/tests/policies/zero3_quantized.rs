//! ZeRO-3's ZeRO++ options: off, ZeRO-3 bit for bit; qwZ gathers every unit as its exact
//! masters quantized blockwise (within half a block's scale) while the masters step in f32;
//! qgZ reduces within a bound of stochastic rounding's, and its rounding state resumes exactly.

use crate::common::{data, max_diff, optimizer, rows, Mlp};
use crate::direct::{bucket, on_ranks, randn};

use std::sync::Arc;

use brigade_autograd::{scope, Var};
use brigade_comm::run_on_threads;
use brigade_ddp::policy::{Reduction, WireModel};
use brigade_ddp::{DdpConfig, DistributedDataParallel, ReducerPolicy};
use brigade_policies::zero::quantized::{dequantize_rows, quantize_rows, BLOCK};
use brigade_policies::{PolicySpec, Zero3, ZeroPlusPlus};
use brigade_tensor::{set_compute_threads, Tensor};

// layers of 416, 1056, 792 and 125 parameters: shards padded, several blocks, short last blocks
const WIDTHS: [usize; 5] = [12, 32, 32, 24, 5];
const STEPS: usize = 4;
const MICRO: usize = 4;

fn options(qwz: bool, qgz: bool) -> ZeroPlusPlus {
    ZeroPlusPlus { qwz, qgz }
}

/// One rank's run: per step, each layer's weight and bias as its forward read them, and as the
/// exact parameters (summoned) were before the step; the losses and the final parameters.
struct Seen {
    read: Vec<Vec<(Vec<f32>, Vec<f32>)>>,
    exact: Vec<Vec<Vec<f32>>>,
    losses: Vec<f64>,
    params: Vec<Vec<f32>>,
}

fn train(world: usize, kind: &str, policy: impl Fn() -> Box<dyn ReducerPolicy> + Sync) -> Vec<Seen> {
    let (x, y) = data(world * MICRO * STEPS, WIDTHS[0], WIDTHS[4], 3);
    run_on_threads(world, |comm| {
        set_compute_threads(1);
        let rank = comm.rank();
        let m = Mlp::new(&WIDTHS, 42 + rank as u64);
        let ddp = DistributedDataParallel::new(&m.store, Arc::new(comm), DdpConfig::default(), policy()).unwrap();
        let mut opt = ddp
            .optimizer(optimizer(kind, m.store.params().to_vec()), &|p| optimizer(kind, p))
            .unwrap();
        let mut seen = Seen {
            read: vec![],
            exact: vec![],
            losses: vec![],
            params: vec![],
        };
        for s in 0..STEPS {
            seen.exact.push(ddp.summon_full_params(|| m.values()).unwrap());
            m.store.zero_grad().unwrap();
            let (xb, yb) = rows(&x, &y, (s * world + rank) * MICRO, MICRO);
            let mut read = vec![];
            let mut h = Var::constant(xb);
            for (i, (w, b)) in m.layers.iter().enumerate() {
                h = scope(&format!("layers.{i}"), || {
                    read.push((w.value().to_vec::<f32>()?, b.value().to_vec::<f32>()?));
                    let z = h.linear(w, Some(b))?;
                    if i + 1 < m.layers.len() {
                        z.relu()
                    } else {
                        Ok(z)
                    }
                })
                .unwrap();
            }
            let loss = h.cross_entropy(&yb).unwrap();
            seen.losses.push(loss.value().item().unwrap());
            loss.backward().unwrap();
            seen.read.push(read);
            brigade_autograd::Optimizer::step(&mut opt).unwrap();
        }
        seen.params = ddp.summon_full_params(|| m.values()).unwrap();
        seen
    })
    .into_iter()
    .map(|r| r.unwrap())
    .collect()
}

/// What qwZ gathers of a unit whose exact flat values (bias then weight: the bucket's order)
/// are `flat`: each rank's shard of the padded flat, quantized blockwise and back.
fn quantized_unit(flat: &[f32], world: usize) -> Vec<f32> {
    let per = flat.len().div_ceil(world);
    let mut padded = flat.to_vec();
    padded.resize(per * world, 0.0);
    let mut out = vec![];
    for chunk in padded.chunks(per) {
        let row = Tensor::from_vec(chunk.to_vec(), &[1, per]).unwrap();
        let (q, s) = quantize_rows(&row, None).unwrap();
        out.extend(dequantize_rows(&q, &s, per).unwrap().to_vec::<f32>().unwrap());
    }
    out.truncate(flat.len());
    out
}

/// Half the scale of the block each element of `flat` lies in (blocks cut within each rank's
/// shard), computed here from the values.
fn half_scales(flat: &[f32], world: usize) -> Vec<f32> {
    let per = flat.len().div_ceil(world);
    (0..flat.len())
        .map(|i| {
            let start = i / per * per + (i % per) / BLOCK * BLOCK;
            let end = (start + BLOCK).min((i / per + 1) * per).min(flat.len());
            flat[start..end].iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0 / 2.0
        })
        .collect()
}

#[test]
fn zero_3_with_its_options_off_or_on_one_rank_is_zero_3_bit_for_bit() {
    for world in [1, 2] {
        let plain = train(world, "adamw", || Box::new(Zero3::new()));
        let off = train(world, "adamw", || {
            Box::new(Zero3::new().with_options(options(false, false)))
        });
        for (p, o) in plain.iter().zip(&off) {
            assert_eq!(p.losses, o.losses, "world {world}");
            assert_eq!(max_diff(&p.params, &o.params), 0.0, "world {world}");
        }
    }
    // one rank sends nothing, so nothing is quantized
    let plain = train(1, "sgd", || Box::new(Zero3::new()));
    let both = train(1, "sgd", || Box::new(Zero3::new().with_options(options(true, true))));
    assert_eq!(plain[0].losses, both[0].losses);
    assert_eq!(max_diff(&plain[0].params, &both[0].params), 0.0);
}

#[test]
fn qwz_gathers_the_exact_masters_quantized_blockwise_and_steps_the_masters_in_f32() {
    for world in [2, 3] {
        let runs = train(world, "sgd", || {
            Box::new(Zero3::new().with_options(options(true, false)))
        });
        for (rank, r) in runs.iter().enumerate() {
            // the first forward too (a resumed run's first step reads what the straight one did)
            let mut off_grid = 0;
            for s in 0..STEPS {
                for (i, (w, b)) in r.read[s].iter().enumerate() {
                    let (ew, eb) = (&r.exact[s][2 * i], &r.exact[s][2 * i + 1]);
                    let flat: Vec<f32> = eb.iter().chain(ew).copied().collect();
                    let read: Vec<f32> = b.iter().chain(w).copied().collect();
                    let what = format!("world {world} rank {rank} step {s} layer {i}");
                    assert_eq!(read, quantized_unit(&flat, world), "{what}: not the masters quantized");
                    for ((g, e), h) in read.iter().zip(&flat).zip(half_scales(&flat, world)) {
                        assert!((g - e).abs() <= h * (1.0 + 1e-6), "{what}: {g} against {e} (bound {h})");
                    }
                    off_grid += read.iter().zip(&flat).filter(|(g, e)| g != e).count();
                }
            }
            // the masters are stepped in f32, not replaced by what the gathers brought
            assert!(off_grid > 1000, "world {world} rank {rank}: {off_grid}");
        }
        for r in &runs[1..] {
            assert_eq!(max_diff(&r.params, &runs[0].params), 0.0, "world {world}");
        }
        // quantized weights train close to the exact ones
        let plain = train(world, "sgd", || Box::new(Zero3::new()));
        let d = max_diff(&plain[0].params, &runs[0].params);
        assert!(d > 0.0 && d < 2e-2, "world {world}: {d}");
    }
}

/// Each rank's gradient bucket of `n` elements, and this rank's reduced shard through `policy`.
fn reduce_qgz(policy: &mut Zero3, g: Vec<f32>, comm: &brigade_ddp::policy::Group) -> Vec<f32> {
    let n = g.len();
    match policy.reduce(bucket(0, g, &[&[n]], true), comm).unwrap() {
        Reduction::Shard { shard, .. } => shard.wait().unwrap().to_vec::<f32>().unwrap(),
        Reduction::Full(_) => panic!("ZeRO-3 reduces into shards"),
    }
}

#[test]
fn qgz_reduces_each_shard_within_a_rounding_step_of_each_rank_and_unbiased() {
    for world in [2, 4] {
        // per rank 700 elements: three blocks, the last short; magnitudes that differ by block
        let n = 700 * world;
        let grads = |rank: usize| -> Vec<f32> {
            randn(n, 11 + rank as u64)
                .iter()
                .enumerate()
                .map(|(i, v)| v * [0.01, 1.0, 100.0][(i % 700) / BLOCK])
                .collect()
        };
        let out = on_ranks(world, |rank, comm| {
            let mut policy = Zero3::new().with_options(options(false, true));
            reduce_qgz(&mut policy, grads(rank), &comm)
        });
        let all: Vec<Vec<f32>> = (0..world).map(grads).collect();
        let (mut signed, mut steps) = (0.0f64, 0.0f64);
        for (rank, shard) in out.iter().enumerate() {
            assert_eq!(shard.len(), 700);
            for (j, got) in shard.iter().enumerate() {
                let i = rank * 700 + j;
                let exact = all.iter().map(|g| g[i] as f64).sum::<f64>() / world as f64;
                // each rank's element moves by less than one step of its block: the mean by
                // less than the mean of the steps
                let block =
                    rank * 700 + j / BLOCK * BLOCK..(rank * 700 + (j / BLOCK + 1) * BLOCK).min((rank + 1) * 700);
                let step = all
                    .iter()
                    .map(|g| g[block.clone()].iter().fold(0f32, |m, v| m.max(v.abs())) as f64 / 127.0)
                    .sum::<f64>()
                    / world as f64;
                let err = *got as f64 - exact;
                assert!(
                    err.abs() <= step * (1.0 + 1e-5),
                    "world {world} element {i}: {err} over {step}"
                );
                signed += err / step;
                steps += 1.0;
            }
        }
        // unbiased: the errors, in steps, average near zero (nearest rounding of these values
        // would not be biased either, but a floor or a constant offset would)
        let mean = signed / steps;
        assert!(mean.abs() < 0.05, "world {world}: mean error {mean} steps");
    }
}

#[test]
fn qgz_rounding_state_resumes_exactly_from_its_state_dict() {
    let world = 2;
    let n = 600 * world;
    let out = on_ranks(world, |rank, comm| {
        let bucket_of = |s: usize| randn(n, (100 * s + rank) as u64);
        let mut straight = Zero3::new().with_options(options(false, true));
        let mut saved = vec![];
        let mut results = vec![];
        for s in 0..3 {
            if s == 2 {
                saved = straight.state_dict().unwrap();
            }
            results.push(reduce_qgz(&mut straight, bucket_of(s), &comm));
        }
        let mut resumed = Zero3::new().with_options(options(false, true));
        resumed.load_state_dict(&saved).unwrap();
        let again = reduce_qgz(&mut resumed, bucket_of(2), &comm);
        let mut fresh = Zero3::new().with_options(options(false, true));
        let unresumed = reduce_qgz(&mut fresh, bucket_of(2), &comm);
        (results, again, unresumed, saved)
    });
    for (rank, (results, again, unresumed, saved)) in out.iter().enumerate() {
        assert!(!saved.is_empty(), "rank {rank}: qgZ keeps its rounding state");
        assert_eq!(&results[2], again, "rank {rank}: resumed rounding differs");
        assert_ne!(&results[2], unresumed, "rank {rank}: the state must matter");
    }
    assert!(Zero3::new().state_dict().unwrap().is_empty());
}

#[test]
fn the_options_are_spelled_in_the_spec_and_priced_in_the_wire_model() {
    for (s, canonical, o) in [
        ("zero3", "zero3", options(false, false)),
        ("zero3:qwz", "zero3:qwz", options(true, false)),
        ("zero3:qgz", "zero3:qgz", options(false, true)),
        ("zero3:qgz:qwz", "zero3:qwz:qgz", options(true, true)),
    ] {
        let spec: PolicySpec = s.parse().unwrap();
        assert_eq!(spec.to_string(), canonical);
        assert_eq!(spec, o.spec());
        assert_eq!(spec.zero_stage(), brigade_policies::ZeroStage::Three);
        let policy = spec.build(&brigade_policies::Registry::new()).unwrap();
        assert_eq!(policy.name(), canonical);
    }
    for bad in ["zero3:qwz:qwz", "zero3:hpz", "zero3:"] {
        let e = bad.parse::<PolicySpec>().unwrap_err().to_string();
        assert!(e.contains(bad), "{bad}: {e}");
    }
    // a unit of 1000 f32 elements at world 4: the reduce-scatter hands in 4000 bytes; qgZ each
    // rank's whole bucket, 4 chunks of 250 elements in one block of 256 bytes and a scale each
    let qgz = options(false, true)
        .spec()
        .build(&brigade_policies::Registry::new())
        .unwrap();
    let wire = qgz.wire_model(&[vec![1000]], 4).unwrap();
    let ops = wire.bucket_ops(&[0], &[4000], 4);
    assert_eq!(ops, vec![(brigade_comm::RingOp::AllGather, 4.0 * (256.0 + 4.0))]);
    let plain = WireModel::Zero3 {
        quantized_gradients: None,
        quantized_gathers: None,
    };
    assert_eq!(
        plain.bucket_ops(&[0], &[4000], 4),
        vec![(brigade_comm::RingOp::ReduceScatter, 4000.0)]
    );
}
