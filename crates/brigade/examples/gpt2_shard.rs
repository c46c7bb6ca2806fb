//! The library's GPT at GPT-2's vocabulary (50,257 tokens) trained on an llm.c token shard made
//! from any UTF-8 text file: the text tokenized with GPT-2's byte-pair encoding and written as
//! an llm.c shard, the shard opened where it lies (read by row, never whole), its last tenth of
//! rows held out, 2 thread ranks reading shuffled disjoint shares at a small batch. The
//! validation loss before and after, then a sample decoded by GPT-2's tokenizer. Exits
//! non-zero if the validation loss did not fall.
//!
//! `cargo run --release -p brigade --example gpt2_shard -- FILE [STEPS]`
//! (e.g. `/usr/share/common-licenses/GPL-3`)

use std::ops::ControlFlow;

use brigade::autograd::no_grad;
use brigade::launch::LaunchConfig;
use brigade::models::{
    generate_text_with, load_params_from_tensors, text_file_tokens, write_llmc_shard, Dataset, Gpt, GptConfig, Model,
    SampleOptions, Tokenizer,
};
use brigade::source::DataOrder;
use brigade::{OptimizerConfig, TrainConfig};

/// Rows per rank per step.
const BATCH: usize = 4;

fn config() -> GptConfig {
    GptConfig {
        vocab: Tokenizer::Gpt2.vocab(),
        d_model: 64,
        n_layers: 2,
        n_heads: 4,
        d_ff: 256,
        context: 32,
        ..GptConfig::default()
    }
}

/// Mean next-token loss of `params` on every validation row: eval mode, no graph recorded.
fn val_loss(params: &[(String, brigade::tensor::Tensor)], val: &Dataset) -> brigade::models::Result<f64> {
    let mut model = Gpt::new(config(), 0)?;
    if !params.is_empty() {
        load_params_from_tensors(model.params(), params)?;
    }
    model.eval();
    let batch = val.gather(&(0..val.len()).collect::<Vec<_>>())?;
    no_grad(|| -> brigade::models::Result<f64> { Ok(model.loss(&batch)?.value().item()?) })
}

#[allow(clippy::neg_cmp_op_on_partial_ord)] // a NaN loss did not fall either
fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    brigade::tensor::retain_freed_host_memory();
    let mut args = std::env::args().skip(1);
    let path = args.next().ok_or("usage: gpt2_shard FILE [STEPS]")?;
    let steps: usize = args.next().map_or(Ok(40), |s| s.parse())?;
    if steps == 0 {
        return Err("give STEPS >= 1".into());
    }
    let dir = std::env::temp_dir().join(format!("brigade-gpt2-shard-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let shard = dir.join("text.bin");
    let ids = text_file_tokens(&path, Tokenizer::Gpt2)?;
    write_llmc_shard(&shard, &ids)?;
    let all = Dataset::from_token_files(std::slice::from_ref(&shard), None, config().batch_schema())?;
    let held = (all.len() / 10).max(1);
    let (train, val) = (all.rows(0..all.len() - held)?, all.rows(all.len() - held..all.len())?);
    println!(
        "{path}: {} GPT-2 tokens in {}, {} training rows and {} validation rows of {} tokens",
        ids.len(),
        shard.display(),
        train.len(),
        val.len(),
        config().context + 1
    );

    let first_val = val_loss(&[], &val)?;
    println!(
        "step 0: validation loss {first_val:.3} (ln 50257 = {:.3})",
        (50257f64).ln()
    );
    let mut cfg = TrainConfig::new(steps, BATCH, OptimizerConfig::adamw(3e-3, None));
    cfg.model.name = "gpt".into();
    cfg.data.order = DataOrder::shuffle(0, false);
    let report = brigade::fit(
        &LaunchConfig::threads(2),
        &cfg,
        |_world| Ok(&train),
        |_ctx| Ok(Box::new(Gpt::new(config(), 0)?)),
    )?;
    let last_loss = report.outcome.losses().last().copied().unwrap_or(f64::NAN);
    let params = report.outcome.params;
    let last_val = val_loss(&params, &val)?;
    println!(
        "step {steps}: training loss {:.3}, validation loss {last_val:.3}",
        last_loss
    );
    let _ = std::fs::remove_dir_all(&dir);

    let mut model = Gpt::new(config(), 0)?;
    load_params_from_tensors(model.params(), &params)?;
    model.eval();
    // drawn (a greedy decode of so short a training repeats the commonest token, a space)
    let opts = SampleOptions {
        max_new_tokens: 30,
        temperature: 0.8,
        top_k: Some(40),
        seed: 1,
    };
    print!("sample: The");
    let sample = generate_text_with(&model, Tokenizer::Gpt2, "The", &opts, |piece| {
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
