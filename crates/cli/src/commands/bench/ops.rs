//! `brigade bench ops`: where each millisecond of one training step goes, by op kind,
//! forward and backward (plus the optimizer), on the reference workloads of
//! `../shared/torchref/` — the same table `scripts/torch_ops_profile.py` prints for PyTorch.

use crate::report::stdout::outln;
use std::time::{Duration, Instant};

use brigade_autograd::profile::mark_forward_start;
use brigade_autograd::{profile_ops, AdamW, MasterWeights, MixedPrecision, OpProfile, Optimizer, Sgd, Var};
use brigade_models::nn::with_reference_attention;
use brigade_models::{Batch, GptConfig, MlpConfig, ModelKind};
use brigade_tensor::{set_compute_threads, DType, Rng, Tensor};
use clap::Args;

use crate::args::check_threads;
use crate::error::{Error, Result};
use crate::footprint;

/// Options of `brigade bench ops`.
#[derive(Args, Clone, Debug)]
pub struct OpsArgs {
    /// `gpt` (batch 8 x 128 tokens, AdamW lr 3e-4) or `mlp` (batch 64, SGD lr 0.01): the
    /// torchref workloads.
    #[arg(long, default_value = "gpt")]
    pub model: String,
    /// Rows per step (default: the workload's per-rank batch, 8 or 64).
    #[arg(long)]
    pub batch_size: Option<usize>,
    /// Compute threads (one rank's share; the torchref comparison uses 1).
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Untimed steps first.
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// Profiled steps (the table shows the mean per step).
    #[arg(long, default_value_t = 10)]
    pub steps: usize,
    /// A/B in one run: alternate steps with the fused attention and with the reference
    /// attention composed of primitive ops (before the fused op existed), and print both
    /// tables and the ratio of their median steps.
    #[arg(long)]
    pub ab: bool,
    /// `f32`, or `bf16`/`fp16`: the parameters and activations in 16 bits, the optimizer
    /// stepping f32 master weights (as `train --precision`; fp16 without loss scaling here).
    #[arg(long, default_value = "f32")]
    pub precision: String,
}

/// Forward, backward and optimizer wall time of one step.
type StepWall = (Duration, Duration, Duration);

/// Runs `brigade bench ops`.
pub fn bench_ops(a: OpsArgs) -> Result<()> {
    let (kind, batch_size) = workload(&a)?;
    let precision = MixedPrecision::parse(&a.precision).map_err(|e| Error::Usage(format!("--precision: {e}")))?;
    set_compute_threads(a.threads);
    let model = kind.build(0)?;
    let mut opt = optimizer(&kind, model.params().params().to_vec(), precision)?;
    let batch = batch(&kind, batch_size)?;
    let mut step = |walls: &mut Vec<StepWall>, reference: bool| -> Result<()> {
        let start = Instant::now();
        // as PyTorch's reference loop (zero_grad(set_to_none=True)): no DDP buckets here
        model.params().set_grads_to_none()?;
        mark_forward_start();
        let loss = if reference {
            with_reference_attention(|| model.loss(&batch))?
        } else {
            model.loss(&batch)?
        };
        let fwd_end = Instant::now();
        loss.backward()?;
        let bwd_end = Instant::now();
        opt.step()?;
        let end = Instant::now();
        walls.push((fwd_end - start, bwd_end - fwd_end, end - bwd_end));
        Ok(())
    };
    let variants: &[bool] = if a.ab { &[false, true] } else { &[false] };
    let results = profile_interleaved(&a, variants, &mut step)?;
    let mut medians = vec![];
    for (k, (profile, walls)) in results.iter().enumerate() {
        if a.ab {
            outln!(
                "\n== {} attention ==",
                if variants[k] { "reference (unfused)" } else { "fused" }
            );
        }
        medians.push(print_table(&a, batch_size, profile, walls));
    }
    if let [fused, reference] = medians[..] {
        outln!(
            "\nA/B, interleaved: median step fused {fused:.2} ms, reference {reference:.2} ms, fused / reference {:.3}",
            fused / reference
        );
    }
    Ok(())
}

/// The model and rows per step the options name, each option checked, and the training's
/// memory checked against the machine's.
fn workload(a: &OpsArgs) -> Result<(ModelKind, usize)> {
    if a.steps == 0 {
        return Err(Error::Usage("--steps must be at least 1".into()));
    }
    check_threads("--threads", a.threads)?;
    let (kind, batch_size) = match a.model.as_str() {
        "gpt" => (ModelKind::Gpt(GptConfig::default()), a.batch_size.unwrap_or(8)),
        "mlp" => (
            ModelKind::Mlp(MlpConfig::new(vec![512, 2048, 2048, 2048, 10])),
            a.batch_size.unwrap_or(64),
        ),
        m => return Err(Error::Usage(format!("--model must be gpt or mlp, got '{m}'"))),
    };
    if batch_size == 0 {
        return Err(Error::Usage("--batch-size must be at least 1".into()));
    }
    if a.ab && !matches!(kind, ModelKind::Gpt(_)) {
        return Err(Error::Usage(format!(
            "--ab compares the fused attention with the reference one, and --model {} has no attention: use --model gpt",
            a.model
        )));
    }
    let state = match kind {
        ModelKind::Gpt(_) => 2, // AdamW
        ModelKind::Mlp(_) => 0, // SGD without momentum
    };
    footprint::check_fits(
        &format!("--model {} with --batch-size {batch_size}", a.model),
        footprint::training_bytes(&kind, batch_size, state),
    )?;
    Ok((kind, batch_size))
}

/// The workload's optimizer (the GPT's AdamW, the MLP's SGD), on f32 master weights under a
/// 16-bit precision.
fn optimizer(kind: &ModelKind, params: Vec<Var>, precision: MixedPrecision) -> Result<Box<dyn Optimizer>> {
    let build = |params: Vec<Var>| -> Box<dyn Optimizer> {
        match kind {
            ModelKind::Gpt(_) => Box::new(AdamW::with_options(params, 3e-4, (0.9, 0.999), 1e-8, 0.01)),
            ModelKind::Mlp(_) => Box::new(Sgd::new(params, 0.01, 0.0, 0.0)),
        }
    };
    Ok(if precision.is_mixed() {
        Box::new(MasterWeights::new(params, precision.param_dtype, build, &[])?)
    } else {
        build(params)
    })
}

/// One batch of random tokens (GPT) or features and labels (MLP), the same every step.
fn batch(kind: &ModelKind, batch_size: usize) -> Result<Batch> {
    let mut rng = Rng::new(0);
    Ok(match kind {
        ModelKind::Gpt(c) => {
            let n = batch_size
                .checked_mul(c.context + 1)
                .ok_or_else(|| Error::Usage(format!("--batch-size {batch_size}: more tokens than memory holds")))?;
            let tokens: Vec<i64> = (0..n).map(|_| rng.below(c.vocab as u64) as i64).collect();
            Batch::tokens(Tensor::from_vec(tokens, &[batch_size, c.context + 1])?)
        }
        ModelKind::Mlp(_) => Batch::classify(
            Tensor::randn(&[batch_size, 512], 1.0, DType::F32, &mut rng),
            Tensor::from_vec(
                (0..batch_size).map(|_| rng.below(10) as i64).collect::<Vec<_>>(),
                &[batch_size],
            )?,
        ),
    })
}

/// The warm-up steps, then the profiled steps of each variant (`true`: the reference
/// attention), alternating which goes first so that neither always follows the other.
fn profile_interleaved(
    a: &OpsArgs,
    variants: &[bool],
    step: &mut dyn FnMut(&mut Vec<StepWall>, bool) -> Result<()>,
) -> Result<Vec<(OpProfile, Vec<StepWall>)>> {
    let mut scratch = vec![];
    for _ in 0..a.warmup {
        for &r in variants {
            step(&mut scratch, r)?;
        }
    }
    let mut results: Vec<(OpProfile, Vec<StepWall>)> = variants.iter().map(|_| Default::default()).collect();
    for i in 0..a.steps {
        for k in 0..variants.len() {
            let k = (k + i) % variants.len();
            let (profile, walls) = &mut results[k];
            let (r, p) = profile_ops(|| step(walls, variants[k]));
            r?;
            profile.merge(&p);
        }
    }
    Ok(results)
}

fn ms(d: Duration, steps: usize) -> f64 {
    d.as_secs_f64() * 1e3 / steps as f64
}

/// Prints the table of one variant and returns its median step in ms.
fn print_table(a: &OpsArgs, batch: usize, p: &OpProfile, walls: &[StepWall]) -> f64 {
    let n = walls.len();
    let sum = |f: fn(&StepWall) -> Duration| walls.iter().map(f).sum::<Duration>();
    let (fwd, bwd, opt) = (sum(|w| w.0), sum(|w| w.1), sum(|w| w.2));
    let total = fwd + bwd + opt;
    let mut steps: Vec<f64> = walls.iter().map(|w| (w.0 + w.1 + w.2).as_secs_f64() * 1e3).collect();
    steps.sort_by(f64::total_cmp);
    outln!(
        "{} step, {}, batch {batch}, {} thread(s): mean of {n} profiled steps (median step {:.2} ms)",
        a.model,
        a.precision,
        a.threads,
        steps[n / 2]
    );
    outln!(
        "{:<22} {:>10} {:>8} {:>10} {:>8} {:>7}",
        "op",
        "fwd ms",
        "calls",
        "bwd ms",
        "calls",
        "share"
    );
    let mut ops: Vec<&str> = p.forward.keys().chain(p.backward.keys()).copied().collect();
    ops.sort_unstable();
    ops.dedup();
    let both = |op: &str| {
        let f = p.forward.get(op).copied().unwrap_or_default();
        let b = p.backward.get(op).copied().unwrap_or_default();
        (f, b)
    };
    ops.sort_by(|x, y| {
        let (fx, bx) = both(x);
        let (fy, by) = both(y);
        (fy.total + by.total).cmp(&(fx.total + bx.total))
    });
    for op in ops {
        let (f, b) = both(op);
        outln!(
            "{:<22} {:>10.3} {:>8.1} {:>10.3} {:>8.1} {:>6.1}%",
            op,
            ms(f.total, n),
            f.calls as f64 / n as f64,
            ms(b.total, n),
            b.calls as f64 / n as f64,
            100.0 * (f.total + b.total).as_secs_f64() / total.as_secs_f64()
        );
    }
    let other_f = fwd.saturating_sub(p.forward_total());
    let other_b = bwd.saturating_sub(p.backward_total());
    outln!(
        "{:<22} {:>10.3} {:>8} {:>10.3} {:>8} {:>6.1}%",
        "(outside ops)",
        ms(other_f, n),
        "",
        ms(other_b, n),
        "",
        100.0 * (other_f + other_b).as_secs_f64() / total.as_secs_f64()
    );
    outln!(
        "{:<22} {:>10} {:>8} {:>10.3} {:>8} {:>6.1}%",
        "optimizer step",
        "",
        "",
        ms(opt, n),
        "",
        100.0 * opt.as_secs_f64() / total.as_secs_f64()
    );
    outln!(
        "{:<22} {:>10.3} {:>8} {:>10.3} {:>8}  total {:.3} ms/step",
        "forward / backward",
        ms(fwd, n),
        "",
        ms(bwd, n),
        "",
        ms(total, n)
    );
    steps[n / 2]
}
