//! Text out: decoding from a [`Gpt`] one token at a time with a KV cache, greedy or sampled
//! (temperature, top-k, seed), each token handed to a callback as it comes.
//!
//! The model reads a window of the sequence: the prompt's last `context` tokens, then every
//! token generated. When the window outgrows the context it restarts from the sequence's last
//! `max(context / 2, 1)` tokens (a learned positional embedding cannot slide), which the
//! cached path recomputes in one chunk; so a new token costs one position, and every
//! `context / 2` tokens one chunk. [`generate_uncached`] reads the same windows with a full
//! forward per token: the reference the cached path is tested against.
//!
//! ```
//! use brigade_models::{generate_text, Gpt, GptConfig, Model, SampleOptions};
//! use brigade_tensor::DType;
//!
//! let cfg = GptConfig { d_model: 16, n_layers: 1, n_heads: 2, d_ff: 32, context: 8, ..GptConfig::default() };
//! let mut model = Gpt::new(cfg, 0).unwrap();
//! model.eval();
//! let greedy = SampleOptions { max_new_tokens: 5, temperature: 0.0, ..SampleOptions::default() };
//! let mut streamed = String::new();
//! let text = generate_text(&model, "Hi", &greedy, |s| {
//!     streamed.push_str(s);
//!     std::ops::ControlFlow::Continue(())
//! })
//! .unwrap();
//! assert_eq!(text, streamed); // an untrained model: 5 bytes, maybe not printable
//! ```

use std::ops::ControlFlow;

use brigade_tensor::{Rng, Tensor};

use crate::nn::KvCache;
use crate::{Gpt, ModelError, Result, Tokenizer};

/// How to pick each new token.
#[derive(Debug, Clone, PartialEq)]
pub struct SampleOptions {
    /// Tokens to generate after the prompt.
    pub max_new_tokens: usize,
    /// 0 picks the most likely token (greedy, deterministic); above 0 divides the logits before
    /// sampling (below 1 sharper, above 1 flatter).
    pub temperature: f64,
    /// Sample only among the `k` most likely tokens (ties at the k-th kept); `None`: all.
    pub top_k: Option<usize>,
    /// Seeds the draws: the same seed, model and prompt give the same tokens.
    pub seed: u64,
}

impl Default for SampleOptions {
    /// 256 tokens at temperature 1, no top-k, seed 0.
    fn default() -> Self {
        SampleOptions {
            max_new_tokens: 256,
            temperature: 1.0,
            top_k: None,
            seed: 0,
        }
    }
}

/// What a generation produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Generated {
    /// The new tokens (the prompt not included).
    pub tokens: Vec<i64>,
    /// Positions the model computed: for the cached path the prompt's window, one per new
    /// token after the first, and one chunk per window restart.
    pub positions: usize,
    /// True when the callback stopped the generation early.
    pub stopped: bool,
}

/// Decodes up to `opts.max_new_tokens` tokens after `prompt` with a KV cache, calling
/// `on_token` with each as it is picked (return `ControlFlow::Break(())` to stop). Dropout is
/// never applied. Errors on an empty prompt, a token outside the vocabulary, a temperature
/// that is negative or not finite, `top_k = Some(0)`, or non-finite logits.
pub fn generate(
    model: &Gpt,
    prompt: &[i64],
    opts: &SampleOptions,
    on_token: impl FnMut(i64) -> ControlFlow<()>,
) -> Result<Generated> {
    let cache = model.new_cache(1)?;
    run(model, prompt, opts, on_token, Decoder::Cached { cache, fed: 0 })
}

/// [`generate`] without a cache: a full forward over the window for each new token (cost
/// growing with the window). The reference for tests and benchmarks. It follows the model's
/// mode, so with dropout it needs [`crate::Model::eval`] first (an error otherwise).
pub fn generate_uncached(
    model: &Gpt,
    prompt: &[i64],
    opts: &SampleOptions,
    on_token: impl FnMut(i64) -> ControlFlow<()>,
) -> Result<Generated> {
    if model.is_training() && model.config().dropout > 0.0 {
        return Err(ModelError::Generate(
            "the model is in training mode with dropout; call eval() before generating".into(),
        ));
    }
    run(model, prompt, opts, on_token, Decoder::Full)
}

/// [`generate`] for a byte-level GPT (vocabulary of at most 256): the prompt's UTF-8 bytes in,
/// text out. `on_text` receives the new text as soon as it forms whole characters (bytes that
/// are not UTF-8 come out as U+FFFD). Returns the new text.
pub fn generate_text(
    model: &Gpt,
    prompt: &str,
    opts: &SampleOptions,
    on_text: impl FnMut(&str) -> ControlFlow<()>,
) -> Result<String> {
    generate_text_with(model, Tokenizer::Bytes, prompt, opts, on_text)
}

/// [`generate_text`] for a GPT of `tokenizer`'s vocabulary: the prompt encoded by it, each new
/// token's bytes streamed as whole UTF-8 characters (a GPT-2 token may end inside one).
pub fn generate_text_with(
    model: &Gpt,
    tokenizer: Tokenizer,
    prompt: &str,
    opts: &SampleOptions,
    mut on_text: impl FnMut(&str) -> ControlFlow<()>,
) -> Result<String> {
    let vocab = model.config().vocab;
    if vocab > tokenizer.vocab() {
        return Err(ModelError::Generate(match tokenizer {
            Tokenizer::Bytes => format!(
                "text in and out needs a byte-level model (vocabulary <= 256), this one has {vocab}; use generate() with token ids"
            ),
            Tokenizer::Gpt2 => format!(
                "the model's vocabulary {vocab} is larger than the {tokenizer} tokenizer's {}",
                tokenizer.vocab()
            ),
        }));
    }
    let prompt: Vec<i64> = tokenizer.encode(prompt).into_iter().map(i64::from).collect();
    let mut stream = Utf8Stream::new();
    let mut text = String::new();
    let mut failed = None;
    generate(model, &prompt, opts, |token| {
        let bytes = match tokenizer.token_bytes(token as u32) {
            Ok(b) => b,
            Err(e) => {
                failed = Some(e);
                return ControlFlow::Break(());
            }
        };
        let piece: String = bytes.into_iter().map(|b| stream.push(b)).collect();
        text.push_str(&piece);
        if piece.is_empty() {
            ControlFlow::Continue(())
        } else {
            on_text(&piece)
        }
    })?;
    if let Some(e) = failed {
        return Err(e);
    }
    let rest = stream.finish();
    if !rest.is_empty() {
        text.push_str(&rest);
        let _ = on_text(&rest);
    }
    Ok(text)
}

/// How the logits after a window are computed.
enum Decoder {
    /// Incrementally: the cache holds the window's first `fed` tokens.
    Cached { cache: KvCache, fed: usize },
    /// A full forward over the window each time.
    Full,
}

impl Decoder {
    /// The logits after `window` (the last position's), and the positions computed for them.
    /// `restarted`: the window no longer extends the cached one.
    fn last_logits(&mut self, model: &Gpt, window: &[i64], restarted: bool) -> Result<(Vec<f64>, usize)> {
        let (logits, n) = match self {
            Decoder::Cached { cache, fed } => {
                if restarted {
                    cache.clear();
                    *fed = 0;
                }
                let chunk = &window[*fed..];
                let logits = model.forward_cached(&Tensor::from_vec(chunk.to_vec(), &[1, chunk.len()])?, cache)?;
                *fed = window.len();
                (logits.value(), chunk.len())
            }
            Decoder::Full => {
                let tokens = Tensor::from_vec(window.to_vec(), &[1, window.len()])?;
                let logits = brigade_autograd::no_grad(|| model.logits(&tokens))?;
                (logits.value(), window.len())
            }
        };
        let last = logits.narrow(1, n - 1, 1)?.to_f64_vec()?;
        Ok((last, n))
    }
}

fn run(
    model: &Gpt,
    prompt: &[i64],
    opts: &SampleOptions,
    mut on_token: impl FnMut(i64) -> ControlFlow<()>,
    mut decoder: Decoder,
) -> Result<Generated> {
    let (vocab, context) = (model.config().vocab, model.config().context);
    let err = |m: String| Err(ModelError::Generate(m));
    if prompt.is_empty() {
        return err("the prompt is empty; give at least one token (the model predicts what follows it)".into());
    }
    if let Some((i, t)) = prompt
        .iter()
        .enumerate()
        .find(|(_, &t)| t < 0 || t as u64 >= vocab as u64)
    {
        return err(format!("prompt token {i} is {t}, outside the vocabulary 0..{vocab}"));
    }
    if !(opts.temperature.is_finite() && opts.temperature >= 0.0) {
        return err(format!(
            "temperature must be finite and >= 0 (0 is greedy), got {}",
            opts.temperature
        ));
    }
    if opts.top_k == Some(0) {
        return err("top_k must be at least 1 (or none)".into());
    }
    let keep = (context / 2).max(1);
    let mut seq = prompt.to_vec();
    let mut start = seq.len().saturating_sub(context);
    let mut restarted = true;
    let mut rng = Rng::new(opts.seed);
    let mut out = Generated {
        // grown as tokens come: a huge `max_new_tokens` is a bound, not an allocation
        tokens: Vec::with_capacity(opts.max_new_tokens.min(context.max(1))),
        positions: 0,
        stopped: false,
    };
    while out.tokens.len() < opts.max_new_tokens {
        if seq.len() - start > context {
            start = seq.len() - keep;
            restarted = true;
        }
        let (logits, positions) = decoder.last_logits(model, &seq[start..], restarted)?;
        restarted = false;
        out.positions += positions;
        let token = pick(&logits, opts, &mut rng)?;
        seq.push(token);
        out.tokens.push(token);
        if on_token(token).is_break() {
            out.stopped = true;
            break;
        }
    }
    Ok(out)
}

/// The next token from `logits`: the first maximum at temperature 0, else a draw from
/// `softmax(logits / T)` restricted to the top `k`.
fn pick(logits: &[f64], opts: &SampleOptions, rng: &mut Rng) -> Result<i64> {
    if let Some(i) = logits.iter().position(|l| !l.is_finite()) {
        return Err(ModelError::Generate(format!(
            "the model gave logit {} for token {i}; its parameters are not finite (diverged training?)",
            logits[i]
        )));
    }
    let argmax = |v: &[f64]| {
        v.iter()
            .enumerate()
            .fold(
                (0, f64::NEG_INFINITY),
                |best, (i, &x)| if x > best.1 { (i, x) } else { best },
            )
            .0
    };
    if opts.temperature == 0.0 {
        return Ok(argmax(logits) as i64);
    }
    let mut scaled: Vec<f64> = logits.iter().map(|l| l / opts.temperature).collect();
    if let Some(k) = opts.top_k.filter(|&k| k < scaled.len()) {
        let mut sorted = scaled.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        let kth = sorted[k - 1];
        scaled
            .iter_mut()
            .filter(|x| **x < kth)
            .for_each(|x| *x = f64::NEG_INFINITY);
    }
    let max = scaled[argmax(&scaled)];
    let weights: Vec<f64> = scaled.iter().map(|x| (x - max).exp()).collect();
    let mut u = rng.uniform() * weights.iter().sum::<f64>();
    for (i, w) in weights.iter().enumerate() {
        if u < *w {
            return Ok(i as i64);
        }
        u -= w;
    }
    // rounding left `u` past the last weight: the last token with any weight
    Ok(weights.iter().rposition(|&w| w > 0.0).unwrap_or(0) as i64)
}

/// Turns a stream of bytes into text as soon as they form whole UTF-8 characters, so that
/// generated bytes can be printed one by one; bytes that cannot be UTF-8 become U+FFFD.
#[derive(Debug, Default, Clone)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    /// An empty stream.
    pub fn new() -> Utf8Stream {
        Utf8Stream::default()
    }

    /// Adds `byte`; returns the text it completes (empty while a character is unfinished).
    pub fn push(&mut self, byte: u8) -> String {
        self.pending.push(byte);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    out.push_str(std::str::from_utf8(&self.pending[..valid]).expect("checked valid"));
                    match e.error_len() {
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..valid + bad);
                        }
                        None => {
                            self.pending.drain(..valid);
                            return out;
                        }
                    }
                }
            }
        }
    }

    /// The rest: an unfinished character at the end becomes U+FFFD.
    pub fn finish(self) -> String {
        String::from_utf8_lossy(&self.pending).into_owned()
    }
}
