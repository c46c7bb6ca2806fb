//! ZeRO-3 against plain all-reduce: the same losses and parameters bit for bit (SGD with
//! momentum and AdamW, one to three ranks, sizes the world does not divide, microbatches), the
//! parameters really freed between their units' uses, the next unit's gather in flight while
//! one computes (prefetch, within its cap), and one error line for scopes that do not
//! cover the parameters or units that nest.

use crate::common::{data, max_diff, optimizer, rows, Mlp};

use std::sync::Arc;

use brigade_autograd::{scope, ParamStore, Var};
use brigade_comm::{run_on_threads, Recorder, Track};
use brigade_ddp::{DdpConfig, DistributedDataParallel, MemoryReport, ReducerPolicy};
use brigade_policies::{AllReduce, Zero, Zero3, ZeroStage};
use brigade_tensor::{set_compute_threads, MemoryMeter, Tensor};

// 416 + 1056 + 792 + 125 parameters: no unit divides evenly by 2 or 3, so shards are padded.
const WIDTHS: [usize; 5] = [12, 32, 32, 24, 5];
const STEPS: usize = 4;
const ACCUM: usize = 2;
const MICRO: usize = 4;

/// One rank's run.
struct RankRun {
    losses: Vec<f64>,
    params: Vec<Vec<f32>>,
    memory: MemoryReport,
    /// `op tag` of every collective it issued.
    ops: Vec<String>,
    /// Bytes of every parameter's storage after the last step (0: freed).
    stored_after: Vec<usize>,
}

/// Each rank trains the MLP with `policy()`: `ACCUM` microbatches a step, global-norm clipping
/// at `clip` if given.
fn run(
    kind: &str,
    world: usize,
    clip: Option<f64>,
    policy: impl Fn() -> Box<dyn ReducerPolicy> + Sync,
) -> Vec<RankRun> {
    let recorder = Recorder::new();
    let (x, y) = data(world * MICRO * ACCUM * STEPS, WIDTHS[0], WIDTHS[4], 3);
    let ranks = run_on_threads(world, |comm| {
        set_compute_threads(1);
        let rank = comm.rank();
        let comm = Arc::new(comm.traced(recorder.clone()));
        let m = Mlp::new(&WIDTHS, 42 + rank as u64);
        let ddp = DistributedDataParallel::new(&m.store, comm, DdpConfig::default(), policy()).unwrap();
        let full = optimizer(kind, m.store.params().to_vec());
        let mut opt = ddp.optimizer(full, &|p| optimizer(kind, p)).unwrap();
        let mut losses = vec![];
        for s in 0..STEPS {
            m.store.zero_grad().unwrap();
            let base = (s * world + rank) * MICRO * ACCUM;
            let mut step_loss = 0.0;
            for j in 0..ACCUM {
                let (xb, yb) = rows(&x, &y, base + j * MICRO, MICRO);
                let loss = m.loss(&xb, &yb).mul_scalar(1.0 / ACCUM as f64).unwrap();
                step_loss += loss.value().item().unwrap();
                if j + 1 < ACCUM {
                    ddp.no_sync(|| loss.backward()).unwrap();
                } else {
                    loss.backward().unwrap();
                }
            }
            if let Some(c) = clip {
                let norm = ddp.grad_norm_sq().unwrap().sqrt();
                if norm > c {
                    ddp.scale_grads(c / norm).unwrap();
                }
            }
            losses.push(step_loss);
            brigade_autograd::Optimizer::step(&mut opt).unwrap();
        }
        let stored_after = m.store.params().iter().map(|p| p.value().storage_numel() * 4).collect();
        RankRun {
            losses,
            params: ddp.summon_full_params(|| m.values()).unwrap(),
            memory: ddp.rank_memory(&opt).unwrap(),
            ops: vec![],
            stored_after,
        }
    });
    let events = recorder.events();
    ranks
        .into_iter()
        .enumerate()
        .map(|(rank, r)| {
            let mut r = r.unwrap();
            r.ops = events
                .iter()
                .filter(|e| e.rank == rank && e.track == Track::Comm)
                .map(|e| format!("{} {}", e.op, e.name))
                .collect();
            r
        })
        .collect()
}

fn zero3() -> Box<dyn ReducerPolicy> {
    Box::new(Zero3::new())
}

#[test]
fn zero_3_matches_plain_ddp_bit_for_bit_with_the_parameters_sharded() {
    let psi: usize = WIDTHS.windows(2).map(|w| w[0] * w[1] + w[1]).sum();
    for kind in ["sgd", "adamw"] {
        for world in [1, 2, 3] {
            let plain = run(kind, world, None, || Box::new(AllReduce));
            let sharded = run(kind, world, None, zero3);
            // without prefetch: one unit gathered at a time, the largest
            let unfetched = run(kind, world, None, || Box::new(Zero3::new().with_prefetch(0, 0)));
            for (u, p) in unfetched.iter().zip(&plain) {
                assert_eq!(
                    max_diff(&u.params, &p.params),
                    0.0,
                    "{kind} world {world}: without prefetch"
                );
                assert_eq!(u.losses, p.losses, "{kind} world {world}: without prefetch");
                assert_eq!(u.memory.gathered, 4 * 1056, "{kind} world {world}");
            }
            // prefetch 1 without room for it is no prefetch
            let capped = run(kind, world, None, || Box::new(Zero3::new().with_prefetch(1, 4 * 100)));
            assert_eq!(capped[0].memory.gathered, 4 * 1056, "{kind} world {world}");
            for (rank, (p, z)) in plain.iter().zip(&sharded).enumerate() {
                let what = format!("{kind} world {world} rank {rank}");
                assert_eq!(
                    max_diff(&z.params, &p.params),
                    0.0,
                    "{what}: parameters differ from plain DDP"
                );
                assert_eq!(z.losses, p.losses, "{what}: losses");
                let count = |prefix: &str| z.ops.iter().filter(|o| o.starts_with(prefix)).count();
                // per step: 4 units reduce-scattered once, and gathered for each microbatch's
                // forward and again for its backward; less the first microbatch's pass (it runs
                // on the whole parameters: the coverage check), plus the summon at the end
                let (rs, gathers) = (count("reduce_scatter "), count("all_gather zero3.gather."));
                assert_eq!(rs, 4 * STEPS, "{what}: {:?}", z.ops);
                assert_eq!(gathers, 4 * (2 * ACCUM * STEPS - 2) + 4, "{what}");
                assert_eq!(count("all_reduce "), 0, "{what}: {:?}", z.ops);
                // between steps no parameter tensor holds its bytes: only the shards
                assert!(z.stored_after.iter().all(|&b| b == 0), "{what}: {:?}", z.stored_after);
                let shards = 4 * [416, 1056, 792, 125]
                    .iter()
                    .map(|&n: &usize| n.div_ceil(world))
                    .sum::<usize>();
                assert_eq!(z.memory.parameters, shards, "{what}");
                assert_eq!(p.memory.parameters, 4 * psi, "{what}");
                // a unit and the next one, prefetched while it computes: at most layers 1 and 2
                assert_eq!(z.memory.gathered, 4 * (1056 + 792), "{what}");
                assert_eq!(p.memory.gathered, 0, "{what}");
            }
            for r in &sharded[1..] {
                assert_eq!(max_diff(&r.params, &sharded[0].params), 0.0, "{kind} world {world}");
            }
            assert!(max_diff(&plain[0].params, &Mlp::new(&WIDTHS, 42).values()) > 1e-3);
        }
    }
}

#[test]
fn zero_3_clips_as_zero_2_does() {
    // the clipping norm of sharded gradients is the sum of the ranks' partial sums, as ZeRO-2's
    // (its buckets are cut otherwise, so the sums round otherwise): within rounding of plain
    // DDP's and ZeRO-2's, as ZeRO-1 and 2 are of plain DDP's
    for kind in ["sgd", "adamw"] {
        let z2 = run(kind, 2, Some(0.05), || Box::new(Zero::new(ZeroStage::Two).unwrap()));
        let z3 = run(kind, 2, Some(0.05), zero3);
        let plain = run(kind, 2, Some(0.05), || Box::new(AllReduce));
        let unclipped = run(kind, 2, None, zero3);
        assert!(max_diff(&z3[0].params, &z2[0].params) < 1e-6, "{kind}");
        assert!(max_diff(&z3[0].params, &plain[0].params) < 1e-6, "{kind}");
        for (a, b) in z3[0].losses.iter().zip(&plain[0].losses) {
            assert!((a - b).abs() <= 1e-6 * b.abs(), "{kind}: {a} vs {b}");
        }
        assert!(
            max_diff(&z3[0].params, &unclipped[0].params) > 1e-4,
            "{kind}: clipping acted"
        );
    }
}

/// The MLP's forward with `look` called inside each layer's scope.
fn loss_looking(m: &Mlp, x: &Tensor, y: &Tensor, look: &mut dyn FnMut(usize)) -> Var {
    let mut h = Var::constant(x.clone());
    for (i, (w, b)) in m.layers.iter().enumerate() {
        h = scope(&format!("layers.{i}"), || {
            look(i);
            let z = h.linear(w, Some(b))?;
            if i + 1 < m.layers.len() {
                z.relu()
            } else {
                Ok(z)
            }
        })
        .unwrap();
    }
    h.cross_entropy(y).unwrap()
}

#[test]
fn a_units_parameters_hold_bytes_only_while_it_runs() {
    let (x, y) = data(16, WIDTHS[0], WIDTHS[4], 3);
    let seen = run_on_threads(2, |comm| {
        let m = Mlp::new(&WIDTHS, 42);
        let ddp = DistributedDataParallel::new(&m.store, Arc::new(comm), DdpConfig::default(), zero3()).unwrap();
        let mut opt = ddp
            .optimizer(optimizer("sgd", m.store.params().to_vec()), &|p| optimizer("sgd", p))
            .unwrap();
        let (xb, yb) = rows(&x, &y, 0, 8);
        // the first pass: whole parameters, then freed unit by unit in its backward
        m.store.zero_grad().unwrap();
        m.loss(&xb, &yb).backward().unwrap();
        brigade_autograd::Optimizer::step(&mut opt).unwrap();
        let stored = |m: &Mlp| -> Vec<usize> {
            m.layers
                .iter()
                .map(|(w, b)| w.value().storage_numel() + b.value().storage_numel())
                .collect()
        };
        let mut inside = vec![];
        m.store.zero_grad().unwrap();
        let loss = loss_looking(&m, &xb, &yb, &mut |i| inside.push((i, stored(&m))));
        let after_forward = stored(&m);
        loss.backward().unwrap();
        (inside, after_forward, stored(&m))
    });
    let sizes: Vec<usize> = WIDTHS.windows(2).map(|w| w[0] * w[1] + w[1]).collect();
    for r in seen {
        let (inside, after_forward, after_backward) = r.unwrap();
        for (i, now) in inside {
            // inside layer i's scope only layer i holds its parameters
            let want: Vec<usize> = (0..sizes.len()).map(|j| if j == i { sizes[j] } else { 0 }).collect();
            assert_eq!(now, want, "inside layers.{i}");
        }
        // the graph keeps the parameter tensors, not their bytes
        assert_eq!(after_forward, vec![0; sizes.len()]);
        assert_eq!(after_backward, vec![0; sizes.len()]);
    }
}

#[test]
fn scopes_that_miss_a_parameter_and_units_that_nest_are_one_error_each() {
    let (x, y) = data(8, WIDTHS[0], WIDTHS[4], 3);
    // a forward that reads layer 1 outside its scope
    let missed = run_on_threads(1, |comm| {
        let m = Mlp::new(&WIDTHS, 42);
        let ddp = DistributedDataParallel::new(&m.store, Arc::new(comm), DdpConfig::default(), zero3()).unwrap();
        let _opt = ddp
            .optimizer(optimizer("sgd", m.store.params().to_vec()), &|p| optimizer("sgd", p))
            .unwrap();
        let h = Var::constant(x.clone());
        let h = scope("layers.0", || h.linear(&m.layers[0].0, Some(&m.layers[0].1))).unwrap();
        let h = h.linear(&m.layers[1].0, Some(&m.layers[1].1)).unwrap();
        let h = scope("layers.2", || h.linear(&m.layers[2].0, Some(&m.layers[2].1))).unwrap();
        let h = scope("layers.3", || h.linear(&m.layers[3].0, Some(&m.layers[3].1))).unwrap();
        h.cross_entropy(&y).unwrap().backward().unwrap_err().to_string()
    });
    let e = missed.into_iter().next().unwrap().unwrap();
    assert!(
        e.contains("parameter 'layers.1.") && e.contains("'layers.1' was never entered"),
        "{e}"
    );
    assert_eq!(e.lines().count(), 1, "{e}");
    // units inside units, and a parameter without one
    for (unit, want) in [
        ("layers.0.inner", "lies inside unit 'layers.0'"),
        ("", "belongs to no unit"),
    ] {
        let r = run_on_threads(1, |comm| {
            let mut store = ParamStore::new();
            store
                .add("layers.0.weight", Tensor::zeros(&[2, 2], brigade_tensor::DType::F32))
                .unwrap();
            store
                .add("layers.0.inner.weight", Tensor::zeros(&[2], brigade_tensor::DType::F32))
                .unwrap();
            store.set_unit("layers.0.weight", "layers.0").unwrap();
            if !unit.is_empty() {
                store.set_unit("layers.0.inner.weight", unit).unwrap();
            }
            DistributedDataParallel::new(&store, Arc::new(comm), DdpConfig::default(), zero3())
                .err()
                .map(|e| e.to_string())
        });
        let e = r.into_iter().next().unwrap().unwrap().expect("refused");
        assert!(e.contains(want), "{e}");
        assert_eq!(e.lines().count(), 1, "{e}");
    }
}

#[test]
fn a_units_full_gradients_live_only_until_its_reduce_scatter_lands() {
    // 24 equal units, one row a rank: the model's gradients are many times one unit's, and
    // everything beside the model's state is small
    const LAYERS: usize = 24;
    const WIDTH: usize = 64;
    const WORLD: usize = 4;
    let widths = [WIDTH; LAYERS + 1];
    let unit = (WIDTH * WIDTH + WIDTH) * 4;
    let psi = LAYERS * unit;
    let shards = LAYERS * (WIDTH * WIDTH + WIDTH).div_ceil(WORLD) * 4;
    let (x, y) = data(WORLD * 3, WIDTH, WIDTH, 3);
    let seen = run_on_threads(WORLD, |comm| {
        set_compute_threads(1);
        let rank = comm.rank();
        let meter = MemoryMeter::new();
        let before = MemoryMeter::install(Some(meter.clone()));
        let m = Mlp::new(&widths, 42);
        let ddp = DistributedDataParallel::new(&m.store, Arc::new(comm), DdpConfig::default(), zero3()).unwrap();
        let mut opt = ddp
            .optimizer(optimizer("plain-sgd", m.store.params().to_vec()), &|p| {
                optimizer("plain-sgd", p)
            })
            .unwrap();
        let mut peaks = vec![];
        for s in 0..3 {
            meter.reset_peak();
            let (xb, yb) = rows(&x, &y, s * WORLD + rank, 1);
            m.store.zero_grad().unwrap();
            m.loss(&xb, &yb).backward().unwrap();
            brigade_autograd::Optimizer::step(&mut opt).unwrap();
            peaks.push((meter.peak(), ddp.rank_memory(&opt).unwrap().gradients_in_flight));
        }
        MemoryMeter::install(before);
        peaks
    });
    for r in seen {
        // from the second step on (the first starts from the whole model)
        for (peak, in_flight) in r.unwrap().into_iter().skip(1) {
            // one unit's bucket filling while the one before it is reduce-scattered
            assert!(
                in_flight <= 2 * unit,
                "{in_flight} bytes of full gradients at once, a unit is {unit}"
            );
            // the shards and the gradient shards, three units gathered (one running, one
            // prefetched, one being freed), four of gradients (two buckets, the gradients being
            // computed, their reduced shard), the rows and their activations (a few units)
            let bound = 2 * shards + 10 * unit;
            assert!(
                peak <= bound,
                "peak {peak} bytes over {bound} (model {psi}, shards {shards}, a unit {unit})"
            );
        }
    }
}
