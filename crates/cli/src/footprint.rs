//! How much memory the flags ask for, computed with checked arithmetic, and whether this
//! machine holds it: a model, a batch, a GEMM shape or a buffer too large for memory is one
//! line naming the flag before anything is allocated (not a "capacity overflow" panic, an
//! allocator abort or a segfault). Those figures are lower bounds, what the run certainly holds
//! at once, so a run that fits this machine is never refused.
//!
//! Beside them, [`predict_peak`] (the library's memory model, [`brigade::plan::memory`])
//! predicts the most bytes one rank holds at once during a step, part by part, for
//! `--memory-budget`.

use brigade_models::{GptConfig, ModelKind};

use crate::error::{Error, Result};

pub use brigade::plan::memory::{matrix, mul, predict_peak, sum, PeakPrediction, PeakQuery};

/// Bytes of an f32.
const F32: u64 = 4;

/// Bytes of a MiB, the unit of `--memory-budget`.
const MIB: f64 = 1048576.0;

/// `--memory-budget MB` in bytes, checked the one way every command checks it (`train`,
/// `train --plan auto` before it calibrates, `sweep`, `plan`): a finite number of MB (MiB)
/// above 0 whose bytes a u64 holds (below 2^44 MB); one line naming the flag otherwise.
pub fn budget_bytes(mb: f64) -> Result<u64> {
    let bytes = mb * MIB;
    if !(mb.is_finite() && mb > 0.0 && bytes >= 1.0 && bytes < u64::MAX as f64) {
        return Err(Error::Usage(format!(
            "--memory-budget must be a positive number of MB below 2^44 (17592186044416, 2^64 bytes), got {}",
            crate::args::compact(mb)
        )));
    }
    Ok(bytes as u64)
}

/// What to say after a run under `--memory-budget mb` whose measured peak per rank (rank 0's,
/// `measured` bytes) passed it: by how much, beside the memory model's prediction (`None`
/// when the peak stayed within the budget).
pub fn over_budget_note(mb: f64, measured: u64, predicted: Option<u64>) -> Option<String> {
    let budget = budget_bytes(mb).ok()?;
    (measured > budget).then(|| {
        let over = measured - budget;
        format!(
            "the measured peak per rank, {}, passed --memory-budget {} MB by {} ({:.1}%); the memory model, \
             which predicted {}, is held to about {}% of the measured peak",
            human(measured),
            crate::args::compact(mb),
            human(over),
            over as f64 / budget as f64 * 100.0,
            predicted.map_or_else(|| "nothing".to_string(), human),
            brigade::plan::memory::ACCURACY * 100.0
        )
    })
}

/// This machine's memory in bytes (`MemTotal` of `/proc/meminfo`), when it can be read.
pub fn machine_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse()
        .ok()?;
    kib.checked_mul(1024)
}

/// `bytes` as people read them (`3.50 GiB`).
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = bytes as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.2} {}", UNITS[unit])
    }
}

/// Checks that `bytes` (what `what` needs, `None`: more than 2^64 bytes) fits in this machine's
/// memory; the error names `what` and both figures.
pub fn check_fits(what: &str, bytes: Option<u64>) -> Result<()> {
    let Some(bytes) = bytes else {
        return Err(Error::Usage(format!(
            "{what} needs more than 2^64 bytes of memory: no machine holds it"
        )));
    };
    match machine_memory() {
        Some(total) if bytes > total => Err(Error::Usage(format!(
            "{what} needs at least {} of memory, this machine has {}",
            human(bytes),
            human(total)
        ))),
        _ => Ok(()),
    }
}

/// Bytes of `elements` f32 values.
pub fn f32_bytes(elements: Option<u64>) -> Option<u64> {
    mul(elements?, F32)
}

/// The model's parameters (`None`: more than 2^64): every weight matrix and embedding table,
/// biases and norms left out (a lower bound).
pub fn parameters(kind: &ModelKind) -> Option<u64> {
    match kind {
        ModelKind::Mlp(c) => sum(c.widths.windows(2).map(|w| matrix(w[0], w[1]))),
        ModelKind::Gpt(c) => {
            let (d, ff) = (c.d_model, c.d_ff);
            let block = sum([mul(matrix(d, d)?, 4), mul(matrix(d, ff)?, 2)]);
            sum([
                matrix(c.vocab, d),   // token embedding
                matrix(c.context, d), // positions
                mul(block?, c.n_layers as u64),
                matrix(d, c.vocab), // the head
            ])
        }
    }
}

/// What a GPT's vocabulary costs, in f32 values: the token embedding `[vocab, d]`, the head
/// `[vocab, d]` (each with its gradient and optimizer state in [`training_bytes`]), and one
/// copy of the logits `[rows * context, vocab]` of a microbatch. At GPT-2's 50,257 the logits
/// dominate: the loss keeps them and their softmax for backward, two copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VocabMemory {
    /// The token embedding's values.
    pub embedding: u64,
    /// The head's values.
    pub head: u64,
    /// One copy of a microbatch's logits.
    pub logits: u64,
}

/// [`VocabMemory`] of the GPT `c` at `rows` rows a microbatch (`None`: more than 2^64).
pub fn gpt_vocab(c: &GptConfig, rows: usize) -> Option<VocabMemory> {
    Some(VocabMemory {
        embedding: matrix(c.vocab, c.d_model)?,
        head: matrix(c.d_model, c.vocab)?,
        logits: mul(matrix(rows, c.context)?, c.vocab as u64)?,
    })
}

/// f32 values a forward pass over `rows` rows certainly holds (a lower bound): the MLP's input
/// and every layer's output; the GPT's residual stream after every block, its logits and their
/// softmax (the cross-entropy's saved probabilities), and one layer's attention probabilities
/// (`rows x heads x context x context`: every layer makes them, so a long context is refused
/// here rather than by the allocator).
pub fn activations(kind: &ModelKind, rows: usize) -> Option<u64> {
    match kind {
        ModelKind::Mlp(c) => mul(rows as u64, sum(c.widths.iter().map(|&w| Some(w as u64)))?),
        ModelKind::Gpt(c) => {
            let tokens = matrix(rows, c.context)?;
            sum([
                mul(mul(tokens, c.d_model as u64)?, c.n_layers as u64),
                mul(gpt_vocab(c, rows)?.logits, 2),
                mul(matrix(rows, c.n_heads)?, matrix(c.context, c.context)?),
            ])
        }
    }
}

/// Bytes one rank certainly holds while training `kind` on `rows` rows a microbatch: the
/// parameters, their gradients, `state_per_param` optimizer values each, and the activations.
pub fn training_bytes(kind: &ModelKind, rows: usize, state_per_param: u64) -> Option<u64> {
    let params = parameters(kind)?;
    f32_bytes(sum([mul(params, 2 + state_per_param), activations(kind, rows)]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_that_overflow_are_none_and_named_as_too_large() {
        assert_eq!(matrix(1 << 32, 1 << 32), None);
        assert_eq!(sum([Some(u64::MAX), Some(1)]), None);
        assert_eq!(sum([Some(2), Some(3)]), Some(5));
        let e = check_fits("--widths 16,18446744073709551615,4", None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--widths") && e.contains("2^64"), "{e}");
        if let Some(total) = machine_memory() {
            let e = check_fits("the model", Some(total + 1)).unwrap_err().to_string();
            assert!(e.contains("this machine has"), "{e}");
            assert!(check_fits("the model", Some(1)).is_ok());
        }
        assert_eq!(human(832), "832 B");
        // [16, 32, 4]: 16*32 + 32*4 weights; 2 rows keep 2 * (16 + 32 + 4) values
        let mlp = ModelKind::Mlp(brigade_models::MlpConfig::new(vec![16, 32, 4]));
        assert_eq!(parameters(&mlp), Some(640));
        assert_eq!(activations(&mlp, 2), Some(104));
        // AdamW: value, gradient and two moments per parameter, f32
        assert_eq!(training_bytes(&mlp, 2, 2), Some((640 * 4 + 104) * 4));
        // the default GPT at GPT-2's vocabulary, 32 rows: the figures of docs/MEMORY.md
        let gpt = brigade_models::GptConfig {
            vocab: 50_257,
            ..brigade_models::GptConfig::default()
        };
        let v = gpt_vocab(&gpt, 32).unwrap();
        assert_eq!(f32_bytes(Some(v.logits)), Some(32 * 128 * 50_257 * 4));
        assert_eq!(human(f32_bytes(Some(v.logits)).unwrap()), "785.27 MiB");
        assert_eq!(human(f32_bytes(Some(v.embedding)).unwrap()), "49.08 MiB");
        assert_eq!(v.head, v.embedding);
        let kind = ModelKind::Gpt(gpt.clone());
        // the blocks: 4 x (4 d^2 + 2 d d_ff) = 4 x 786,432; positions 128 x 256
        assert_eq!(parameters(&kind), Some(2 * 50_257 * 256 + 128 * 256 + 4 * 786_432));
        // the residual stream of 4 blocks, the logits twice, one layer's 4 heads of 128 x 128
        assert_eq!(
            activations(&kind, 32),
            Some(32 * 128 * 256 * 4 + 2 * v.logits + 32 * 4 * 128 * 128)
        );
        assert_eq!(human(training_bytes(&kind, 32, 2).unwrap()), "1.99 GiB");
        // a context of 100,000 at 2 rows and 2 heads: 2 x 2 x 10^10 probabilities, 160 GB
        let long = ModelKind::Gpt(brigade_models::GptConfig {
            d_model: 32,
            n_layers: 1,
            n_heads: 2,
            d_ff: 64,
            context: 100_000,
            ..brigade_models::GptConfig::default()
        });
        assert!(training_bytes(&long, 2, 2).unwrap() > 160_000_000_000);
        let huge = ModelKind::Mlp(brigade_models::MlpConfig::new(vec![16, usize::MAX, 4]));
        assert_eq!(parameters(&huge), None);
        assert_eq!(human(3 << 29), "1.50 GiB");
    }
}
