//! The library's GPT trained on any UTF-8 text file, byte-level, by 2 thread ranks reading
//! shuffled shards (a new permutation each epoch): the last tenth of the file is the validation
//! split, evaluated (eval mode, under `no_grad`) before training and every `EVERY` steps; the
//! run goes on from its checkpoint between evaluations, on the same row of the same permutation.
//! Then a greedy sample through the KV cache. Exits non-zero if the validation loss did not fall.
//!
//! `cargo run --release -p brigade --example gpt_on_text -- FILE [STEPS]`
//! (e.g. `/usr/share/common-licenses/GPL-3`)

use std::ops::ControlFlow;

use brigade::autograd::no_grad;
use brigade::config::CheckpointConfig;
use brigade::launch::LaunchConfig;
use brigade::models::{
    generate_text, load_params_from_tensors, Dataset, Gpt, GptConfig, Model, SampleOptions, Tokenizer, ValSplit,
};
use brigade::source::DataOrder;
use brigade::{OptimizerConfig, TrainConfig};

/// Steps between evaluations.
const EVERY: usize = 10;
/// Validation rows per evaluation (the first ones of the split: the same each time).
const VAL_ROWS: usize = 64;

fn config() -> GptConfig {
    GptConfig {
        d_model: 64,
        n_layers: 2,
        n_heads: 4,
        d_ff: 256,
        context: 32,
        ..GptConfig::default()
    }
}

/// Mean next-byte loss of `params` on the validation rows: eval mode, no graph recorded.
fn val_loss(params: &[(String, brigade::tensor::Tensor)], val: &Dataset) -> brigade::models::Result<f64> {
    let mut model = Gpt::new(config(), 0)?;
    if !params.is_empty() {
        load_params_from_tensors(model.params(), params)?;
    }
    model.eval();
    let rows: Vec<usize> = (0..val.len().min(VAL_ROWS)).collect();
    let batch = val.gather(&rows)?;
    no_grad(|| -> brigade::models::Result<f64> { Ok(model.loss(&batch)?.value().item()?) })
}

#[allow(clippy::neg_cmp_op_on_partial_ord)] // a NaN loss did not fall either
fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    brigade::tensor::retain_freed_host_memory();
    let mut args = std::env::args().skip(1);
    let path = args.next().ok_or("usage: gpt_on_text FILE [STEPS]")?;
    let steps: usize = args.next().map_or(Ok(40), |s| s.parse())?;
    if steps == 0 {
        return Err("give STEPS >= 1".into());
    }
    let text = Dataset::from_text_file(&path, config().context, &ValSplit::Fraction(0.1), Tokenizer::Bytes)?;
    let val = text.val.ok_or("no validation split")?;
    println!(
        "{path}: {} training rows, {} validation rows of {} bytes",
        text.train.len(),
        val.len(),
        config().context + 1
    );
    let dir = std::env::temp_dir().join(format!("brigade-gpt-on-text-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let ckpt = dir.join("gpt.ckpt");

    let first_val = val_loss(&[], &val)?;
    println!("step 0: validation loss {first_val:.3}");
    let (mut params, mut last_val, mut done) = (vec![], first_val, 0);
    while done < steps {
        let until = (done + EVERY).min(steps);
        let cfg = {
            let mut c = TrainConfig::new(until, 8, OptimizerConfig::adamw(3e-3, None));
            c.model.name = "gpt".into();
            c.data.order = DataOrder::shuffle(0, false);
            c.runtime.checkpoint = CheckpointConfig {
                resume: (done > 0).then(|| ckpt.clone()),
                path: Some(ckpt.clone()),
                every: None,
                keep_last: None,
                metadata: vec![],
            };
            c
        };
        let train = &text.train;
        let report = brigade::fit(
            &LaunchConfig::threads(2),
            &cfg,
            |_world| Ok(train),
            |_ctx| Ok(Box::new(Gpt::new(config(), 0)?)),
        )?;
        params = report.outcome.params;
        last_val = val_loss(&params, &val)?;
        let at = report
            .outcome
            .sampler
            .map(|p| format!(" (epoch {}, row {})", p.epoch, p.index));
        println!(
            "step {until}: training loss {:.3}, validation loss {last_val:.3}{}",
            report.outcome.steps.last().map_or(f64::NAN, |r| r.loss),
            at.unwrap_or_default()
        );
        done = until;
    }
    let _ = std::fs::remove_dir_all(&dir);

    let mut model = Gpt::new(config(), 0)?;
    load_params_from_tensors(model.params(), &params)?;
    model.eval();
    let opts = SampleOptions {
        max_new_tokens: 60,
        temperature: 0.0,
        ..SampleOptions::default()
    };
    print!("sample: ");
    let sample = generate_text(&model, "The ", &opts, |piece| {
        print!("{piece}");
        ControlFlow::Continue(())
    })?;
    println!();
    if sample.is_empty() {
        return Err("the sample is empty".into());
    }
    if !(last_val < first_val) {
        return Err(format!("the validation loss did not fall: {first_val:.3} -> {last_val:.3}").into());
    }
    Ok(())
}
