//! Greedy decoding from the reference GPT (vocab 256, d 256, 4 layers, context 128), with the KV
//! cache or, with `--no-cache`, with a full forward over the window for every token. Prints the
//! tokens per second and the positions the model computed.
//!
//! `cargo run --release -p brigade-models --example decode -- [--no-cache] [TOKENS]`

use std::ops::ControlFlow;
use std::time::Instant;

use brigade_models::{generate, generate_uncached, Gpt, GptConfig, Model, SampleOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let cached = !args.iter().any(|a| a == "--no-cache");
    let tokens: usize = args
        .iter()
        .find(|a| !a.starts_with("--"))
        .map_or(Ok(256), |s| s.parse())?;
    let mut model = Gpt::new(GptConfig::default(), 0)?;
    model.eval();
    let prompt: Vec<i64> = b"The ".iter().map(|&b| i64::from(b)).collect();
    let opts = SampleOptions {
        max_new_tokens: tokens,
        temperature: 0.0,
        ..SampleOptions::default()
    };
    let go = |_| ControlFlow::Continue(());
    let start = Instant::now();
    let out = if cached {
        generate(&model, &prompt, &opts, go)?
    } else {
        generate_uncached(&model, &prompt, &opts, go)?
    };
    let secs = start.elapsed().as_secs_f64();
    println!(
        "{} tokens in {secs:.3} s ({:.1} tokens/s), {} positions computed, {}",
        out.tokens.len(),
        out.tokens.len() as f64 / secs,
        out.positions,
        if cached { "KV cache" } else { "no cache" }
    );
    Ok(())
}
