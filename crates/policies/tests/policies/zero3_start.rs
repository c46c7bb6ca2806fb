//! ZeRO-3's sharded start on the policy contract: over parameters registered as recipes
//! (`ParamStore::add_deferred`, a different generator per rank), each rank draws only its
//! shard of every unit from rank 0's recipes and trains as plain DDP over rank 0's drawn
//! values does, bit for bit; no parameter holds a byte before its unit's first gather; a
//! policy that does not start sharded gets them drawn whole.

use crate::common::{data, optimizer, rows, Mlp};

use std::sync::Arc;

use brigade_autograd::{InitDraw, Optimizer, ParamInit, ParamStore};
use brigade_comm::run_on_threads;
use brigade_ddp::{DdpConfig, DistributedDataParallel, ReducerPolicy};
use brigade_policies::{AllReduce, Zero3};
use brigade_tensor::{set_compute_threads, DType, Rng};

// 416 + 1056 + 792 + 125 parameters: no unit divides evenly by 2 or 3
const WIDTHS: [usize; 5] = [12, 32, 32, 24, 5];
const STEPS: usize = 3;
const MICRO: usize = 4;

/// The common MLP's parameters as recipes: what `Mlp::new(&WIDTHS, seed)` would draw.
fn deferred_mlp(seed: u64) -> Mlp {
    let mut rng = Rng::new(seed);
    let mut store = ParamStore::new();
    let mut add = |store: &mut ParamStore, name: String, shape: &[usize], s: f64| {
        let init = ParamInit::new(InitDraw::Uniform { lo: -s, hi: s }, DType::F32, &rng);
        rng.skip(shape.iter().product::<usize>() as u64);
        store.add_deferred(name, shape, DType::F32, init).unwrap()
    };
    let layers = (WIDTHS.windows(2).enumerate())
        .map(|(i, w)| {
            let s = 1.0 / (w[0] as f64).sqrt();
            let weight = add(&mut store, format!("layers.{i}.weight"), &[w[1], w[0]], s);
            let bias = add(&mut store, format!("layers.{i}.bias"), &[w[1]], s);
            for p in ["weight", "bias"] {
                store
                    .set_unit(&format!("layers.{i}.{p}"), &format!("layers.{i}"))
                    .unwrap();
            }
            (weight, bias)
        })
        .collect();
    Mlp { store, layers }
}

/// Each rank's losses and the whole parameters after the steps, and the bytes its parameters
/// held once the optimizer was built.
fn run(
    world: usize,
    deferred: bool,
    policy: impl Fn() -> Box<dyn ReducerPolicy> + Sync,
) -> Vec<(Vec<f64>, Vec<Vec<f32>>, usize)> {
    let (x, y) = data(world * MICRO * STEPS, WIDTHS[0], WIDTHS[4], 3);
    run_on_threads(world, |comm| {
        set_compute_threads(1);
        let rank = comm.rank();
        let comm = Arc::new(comm);
        // a different seed per rank: every rank starts from rank 0's parameters
        let m = match deferred {
            true => deferred_mlp(42 + rank as u64),
            false => Mlp::new(&WIDTHS, 42 + rank as u64),
        };
        let ddp = DistributedDataParallel::new(&m.store, comm, DdpConfig::default(), policy()).unwrap();
        let mut opt = ddp
            .optimizer(optimizer("adamw", m.store.params().to_vec()), &|p| {
                optimizer("adamw", p)
            })
            .unwrap();
        let held = m.store.params().iter().map(|p| p.value().storage_numel()).sum();
        let mut losses = vec![];
        for s in 0..STEPS {
            m.store.zero_grad().unwrap();
            let (xb, yb) = rows(&x, &y, (s * world + rank) * MICRO, MICRO);
            let loss = m.loss(&xb, &yb);
            losses.push(loss.value().item().unwrap());
            loss.backward().unwrap();
            opt.step().unwrap();
        }
        (losses, ddp.summon_full_params(|| m.values()).unwrap(), held)
    })
    .into_iter()
    .map(|r| r.unwrap())
    .collect()
}

#[test]
fn zero_3_over_recipes_trains_as_plain_ddp_without_a_whole_parameter() {
    for world in [2, 3] {
        let plain = run(world, false, || Box::new(AllReduce));
        let sharded = run(world, true, || Box::new(Zero3::new()));
        let drawn_whole = run(world, true, || Box::new(AllReduce));
        for (rank, ((p, z), w)) in plain.iter().zip(&sharded).zip(&drawn_whole).enumerate() {
            let what = format!("world {world} rank {rank}");
            assert_eq!(z.0, p.0, "{what}: losses");
            assert_eq!(z.1, p.1, "{what}: parameters");
            assert_eq!(
                z.2, 0,
                "{what}: no parameter holds bytes before its unit's first gather"
            );
            assert_eq!(
                (&w.0, &w.1),
                (&p.0, &p.1),
                "{what}: drawn whole for a policy that does not start sharded"
            );
        }
    }
}
