//! `brigade sample`: text out of a trained GPT's checkpoint, streamed to stdout as it is
//! generated (a KV cache: each new token costs one position), through the library's
//! [`generate_text`]. Also how a checkpoint records the model's shape
//! ([`model_config_json`]), so that sampling needs no training flags.

use std::io::Write;
use std::ops::ControlFlow;
use std::path::PathBuf;

use brigade::checkpoint::load_model_tensors;
use brigade_models::{
    generate_text_with, load_params_from_tensors, Gpt, GptConfig, ModelKind, SampleOptions, Tokenizer,
};
use clap::Args;
use serde_json::json;

use crate::error::{Error, Result};

/// The most tokens one `brigade sample` generates.
const MAX_NEW_TOKENS: usize = 1 << 24;

/// `brigade sample`'s flags.
#[derive(Args, Clone, Debug)]
pub struct SampleArgs {
    /// A GPT's checkpoint (`brigade train --model gpt --checkpoint FILE`).
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// The text the generation continues (encoded by the checkpoint's tokenizer: its UTF-8
    /// bytes, or its GPT-2 tokens).
    #[arg(long)]
    pub prompt: String,
    /// The tokenizer the checkpoint's run trained with, which it records (default: that one;
    /// another is an error).
    #[arg(long, value_parser = crate::args::tokenizer_parser())]
    pub tokenizer: Option<Tokenizer>,
    /// Tokens (bytes, or GPT-2 tokens) to generate after the prompt, at most 16777216 (2^24:
    /// the text is kept as it streams).
    #[arg(long, default_value_t = 256)]
    pub max_new_tokens: usize,
    /// 0: the most likely byte each time (greedy, deterministic); above 0 divides the logits
    /// before sampling (below 1 sharper, above 1 flatter).
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f64,
    /// Sample among the K most likely bytes only (K >= 1; default: all).
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Seed of the draws: the same seed, checkpoint and prompt give the same text.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// The shape of a model as its checkpoint records it (`model_config`): a JSON object of the
/// GPT's sizes and its tokenizer, or the MLP's widths, each with its dropout (a resume
/// reports a changed one).
pub fn model_config_json(kind: &ModelKind, tokenizer: Tokenizer) -> String {
    match kind {
        ModelKind::Gpt(c) => json!({
            "vocab": c.vocab, "d_model": c.d_model, "n_layers": c.n_layers, "n_heads": c.n_heads,
            "d_ff": c.d_ff, "context": c.context, "dropout": c.dropout, "tokenizer": tokenizer.name(),
        }),
        ModelKind::Mlp(c) => json!({ "widths": c.widths, "dropout": c.dropout }),
    }
    .to_string()
}

/// The GPT configuration a checkpoint's `model_config` records (F32 parameters).
fn gpt_config(path: &str, text: &str) -> Result<GptConfig> {
    let bad = |why: String| Error::Usage(format!("--checkpoint {path}: its model configuration {why}"));
    let v: serde_json::Value = serde_json::from_str(text).map_err(|e| bad(format!("is not JSON ({e})")))?;
    let size = |k: &str| {
        v.get(k)
            .and_then(serde_json::Value::as_u64)
            .map(|n| n as usize)
            .ok_or_else(|| bad(format!("has no size `{k}`: {text}")))
    };
    let cfg = GptConfig {
        vocab: size("vocab")?,
        d_model: size("d_model")?,
        n_layers: size("n_layers")?,
        n_heads: size("n_heads")?,
        d_ff: size("d_ff")?,
        context: size("context")?,
        dropout: v.get("dropout").and_then(serde_json::Value::as_f64).unwrap_or(0.0),
        ..GptConfig::default()
    };
    cfg.validate()?;
    Ok(cfg)
}

/// The tokenizer a `model_config` records (one without the key: bytes, the only one of the
/// runs that did not record it); `path` names the checkpoint in the error.
fn config_tokenizer(path: &str, config: &str) -> Result<Tokenizer> {
    let v: serde_json::Value = serde_json::from_str(config).unwrap_or_default();
    match v.get("tokenizer").and_then(serde_json::Value::as_str) {
        None => Ok(Tokenizer::Bytes),
        Some(name) => name
            .parse()
            .map_err(|e| Error::Usage(format!("--checkpoint {path}: its model configuration: {e}"))),
    }
}

/// The tokenizer the GPT checkpoint at `path` records in its metadata, read from the
/// safetensors header alone (`None`: the file or its header cannot be read, or it records no
/// model configuration: whatever reads it next names the problem).
pub fn recorded_tokenizer(path: &std::path::Path) -> Result<Option<Tokenizer>> {
    use std::io::Read;
    let header = || -> Option<serde_json::Value> {
        let mut f = std::fs::File::open(path).ok()?;
        let mut n = [0u8; 8];
        f.read_exact(&mut n).ok()?;
        let n = u64::from_le_bytes(n);
        // a safetensors header is JSON of at most 100 MB (the format's own limit)
        if n > 100_000_000 {
            return None;
        }
        let mut text = vec![0u8; n as usize];
        f.read_exact(&mut text).ok()?;
        serde_json::from_slice(&text).ok()
    };
    let Some(config) = header().and_then(|h| h.get("__metadata__")?.get("model_config")?.as_str().map(String::from))
    else {
        return Ok(None);
    };
    config_tokenizer(&path.display().to_string(), &config).map(Some)
}

/// The one line that says a run's tokenizer is not its checkpoint's.
pub fn tokenizer_mismatch(flag: &str, path: &std::path::Path, recorded: Tokenizer, given: Tokenizer) -> Error {
    Error::Usage(format!(
        "{flag} {} was trained with --tokenizer {recorded} (vocabulary {}), not {given}: pass --tokenizer {recorded}",
        path.display(),
        recorded.vocab()
    ))
}

/// The GPT a checkpoint holds, its parameters loaded, in eval mode, and the tokenizer it
/// records.
pub fn load_gpt(path: &std::path::Path) -> Result<(Gpt, Tokenizer)> {
    let shown = path.display().to_string();
    let ckpt = load_model_tensors(path)?;
    if ckpt.name != "gpt" {
        return Err(Error::Usage(format!(
            "--checkpoint {shown} holds model '{}', not a GPT: brigade sample reads checkpoints of brigade train --model gpt",
            ckpt.name
        )));
    }
    let Some(config) = &ckpt.config else {
        return Err(Error::Usage(format!(
            "--checkpoint {shown} records no model configuration (written by an older brigade): train again with --checkpoint to sample from it"
        )));
    };
    let cfg = gpt_config(&shown, config)?;
    let tokenizer = config_tokenizer(&shown, config)?;
    if cfg.vocab > tokenizer.vocab() {
        return Err(Error::Usage(format!(
            "--checkpoint {shown}: its model's vocabulary {} is larger than its tokenizer {tokenizer}'s {}",
            cfg.vocab,
            tokenizer.vocab()
        )));
    }
    // the configuration must describe the tensors before a model of its size is built: a
    // context or width it claims beyond them would allocate what the file never held
    let held: u64 = ckpt.params.iter().map(|(_, t)| t.numel() as u64).sum();
    match crate::footprint::parameters(&ModelKind::Gpt(cfg.clone())) {
        Some(needed) if needed <= held => {}
        needed => {
            let needed = needed.map_or("more than 2^64".into(), |n| n.to_string());
            return Err(Error::Usage(format!(
                "--checkpoint {shown}: its model configuration ({config}) needs at least {needed} parameters, its tensors hold {held}: the configuration does not describe them"
            )));
        }
    }
    let mut gpt = Gpt::new(cfg, 0)?;
    load_params_from_tensors(brigade_models::Model::params(&gpt), &ckpt.params).map_err(|e| e.at_path(path))?;
    brigade_models::Model::eval(&mut gpt);
    Ok((gpt, tokenizer))
}

/// Runs `brigade sample`: the prompt's continuation on stdout, as it is generated.
pub fn sample(a: SampleArgs) -> Result<()> {
    if !(a.temperature >= 0.0 && a.temperature.is_finite()) {
        return Err(Error::Usage(format!(
            "--temperature must be a finite number >= 0 (0: greedy), got {}",
            crate::args::compact(a.temperature)
        )));
    }
    if a.top_k == Some(0) {
        return Err(Error::Usage(
            "--top-k must be at least 1 (or left out: all bytes)".into(),
        ));
    }
    if a.max_new_tokens > MAX_NEW_TOKENS {
        return Err(Error::Usage(format!(
            "--max-new-tokens must be at most {MAX_NEW_TOKENS} (the text generated is kept in memory as it streams), got {}",
            a.max_new_tokens
        )));
    }
    if a.prompt.is_empty() {
        return Err(Error::Usage(
            "--prompt is empty: give the text the generation continues".into(),
        ));
    }
    let (gpt, tokenizer) = load_gpt(&a.checkpoint)?;
    if let Some(given) = a.tokenizer.filter(|&t| t != tokenizer) {
        return Err(tokenizer_mismatch("--checkpoint", &a.checkpoint, tokenizer, given));
    }
    let opts = SampleOptions {
        max_new_tokens: a.max_new_tokens,
        temperature: a.temperature,
        top_k: a.top_k,
        seed: a.seed,
    };
    let mut out = std::io::stdout().lock();
    let mut write_error = None;
    generate_text_with(&gpt, tokenizer, &a.prompt, &opts, |piece| {
        match out.write_all(piece.as_bytes()).and_then(|()| out.flush()) {
            Ok(()) => ControlFlow::Continue(()),
            Err(e) => {
                write_error = Some(e);
                ControlFlow::Break(())
            }
        }
    })?;
    // a reader that went away (`| head -c 100`) wanted no more: no error
    let written = match write_error {
        Some(e) => Err(e),
        None => writeln!(out),
    };
    match written {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(Error::Io {
            path: "stdout".into(),
            source: e,
        }),
        _ => Ok(()),
    }
}
