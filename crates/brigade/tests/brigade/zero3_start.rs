//! ZeRO-3's sharded start through `fit`: each rank's model is built as recipes and every rank
//! draws only its shard of each unit, so the run trains as plain DDP does bit for bit (two and
//! three ranks, a different seed per rank: rank 0's recipes are drawn), its first forward
//! gathers the units as every later one does (the same collectives every step), its first step
//! peaks no higher than a steady one, and a model whose whole parameters pass a memory budget
//! starts within it.

use std::sync::{Arc, Mutex};

use brigade::launch::LaunchConfig;
use brigade::models::{Dataset, Gpt, GptConfig, Model};
use brigade::policies::PolicySpec;
use brigade::tensor::{DType, MemoryMeter};
use brigade::{fit, Error, OptimizerConfig, RunReport, TrainConfig};

fn gpt(n_layers: usize) -> GptConfig {
    GptConfig {
        vocab: 256,
        d_model: 16,
        n_layers,
        n_heads: 2,
        d_ff: 32,
        context: 8,
        dtype: DType::F32,
        dropout: 0.1,
    }
}

fn config(steps: usize, policy: PolicySpec) -> TrainConfig {
    let opt = OptimizerConfig::AdamW {
        lr: 3e-3,
        betas: (0.9, 0.999),
        eps: 1e-8,
        weight_decay: 0.01,
    };
    let mut c = TrainConfig::new(steps, 2, opt);
    c.model.name = "gpt".into();
    c.runtime.compute_threads = Some(1);
    c.distributed.get_or_insert_default().policy = Arc::new(policy);
    c
}

/// The run, and the bytes each rank's model held once built (before DDP or a step).
fn run(world: usize, n_layers: usize, cfg: &TrainConfig) -> (RunReport, Vec<usize>) {
    let built = Mutex::new(vec![0; world]);
    let report = fit(
        &LaunchConfig::threads(world),
        cfg,
        |_| Dataset::builtin_text(8, 0).map_err(Error::from),
        |ctx| {
            // a different seed per rank: every rank starts from rank 0's parameters
            let m = Gpt::new(gpt(n_layers), 7 + ctx.rank as u64)?;
            built.lock().unwrap()[ctx.rank] = MemoryMeter::current().map_or(0, |m| m.live());
            Ok(Box::new(m) as Box<dyn Model>)
        },
    )
    .unwrap();
    (report, built.into_inner().unwrap())
}

fn bits(r: &RunReport) -> Vec<(String, Vec<u32>)> {
    (r.outcome.params.iter())
        .map(|(n, t)| {
            (
                n.clone(),
                t.to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect(),
            )
        })
        .collect()
}

fn psi_bytes(n_layers: usize) -> usize {
    4 * Gpt::new(gpt(n_layers), 0).unwrap().params().numel()
}

#[test]
fn zero_3_from_a_sharded_start_trains_as_plain_ddp_bit_for_bit() {
    for world in [2, 3] {
        let (plain, _) = run(world, 2, &config(3, PolicySpec::AllReduce));
        let (z3, built) = run(world, 2, &config(3, PolicySpec::Zero3));
        assert_eq!(z3.outcome.losses(), plain.outcome.losses(), "world {world}");
        assert_eq!(bits(&z3), bits(&plain), "world {world}");
        // no rank built the model's values
        assert!(built.iter().all(|&b| b < psi_bytes(2) / 8), "world {world}: {built:?}");
        // the first forward gathers the units as every later one does
        let sent: Vec<u64> = z3.outcome.sent().iter().map(|s| s.payload_bytes).collect();
        assert!(sent.iter().all(|&b| b == sent[0]), "world {world}: {sent:?}");
    }
}

#[test]
fn zero_3_s_first_step_peaks_no_higher_than_a_steady_step() {
    for world in [2, 4] {
        let peak = |steps| {
            run(world, 4, &config(steps, PolicySpec::Zero3))
                .0
                .outcome
                .memory
                .unwrap()
                .peak
        };
        let (first, steady) = (peak(1), peak(3));
        assert!(
            first <= steady,
            "world {world}: step 0 peaks at {first} bytes, step 2 at {steady}"
        );
    }
}

#[test]
fn a_model_whose_whole_parameters_pass_the_budget_starts_sharded_and_trains() {
    // 12 blocks at world 4: the whole parameters are more than the budget, a rank's shards and
    // a unit far less
    let (world, n_layers) = (4, 12);
    let psi = psi_bytes(n_layers);
    let budget = psi * 3 / 4;
    let (z3, built) = run(world, n_layers, &config(2, PolicySpec::Zero3));
    assert!(
        built.iter().all(|&b| b <= budget / 8),
        "{built:?} against a budget of {budget}"
    );
    assert_eq!(z3.outcome.losses().len(), 2);
    assert!(z3.outcome.losses().iter().all(|l| l.is_finite()));
    let m = z3.outcome.memory.unwrap();
    assert!(m.parameters * world <= psi + 64 * world, "{m:?}");
    // the whole parameters and AdamW's two moments of them pass a budget the start keeps to
    let states_budget = 3 * psi * 3 / 4;
    assert!(
        m.construction_peak <= states_budget / 4,
        "built at {} bytes against a budget of {states_budget}",
        m.construction_peak
    );
    eprintln!("psi {psi} budget {budget} peak {} {m:?}", m.peak);
}

#[test]
fn building_a_zero_run_peaks_within_its_shards_and_no_higher_than_a_steady_step() {
    // AdamW holds two moments per element: a rank builds only its shard of them (2Ψ/N), beside
    // the parameters it holds (Ψ, or its shards Ψ/N under ZeRO-3) and, under ZeRO-1, the whole
    // gradient buckets it keeps (Ψ); a quarter of Ψ covers the rest (the model's buffers, the
    // ranks' plumbing, the shards' padding)
    let (world, n_layers) = (4, 4);
    let psi = psi_bytes(n_layers);
    for (policy, held, buckets) in [
        (PolicySpec::Zero1, psi, psi),
        (PolicySpec::Zero2, psi, 0),
        (PolicySpec::Zero3, psi / world, 0),
    ] {
        let name = policy.to_string();
        let m = run(world, n_layers, &config(3, policy)).0.outcome.memory.unwrap();
        let bound = held + buckets + 2 * psi / world + psi / 4;
        eprintln!(
            "{name}: construction {} peak {} bound {bound} psi {psi}",
            m.construction_peak, m.peak
        );
        assert!(
            m.construction_peak <= bound,
            "{name}: built at {} bytes > {bound}",
            m.construction_peak
        );
        assert!(
            m.construction_peak <= m.peak,
            "{name}: built at {} bytes, stepped at {}",
            m.construction_peak,
            m.peak
        );
    }
}
