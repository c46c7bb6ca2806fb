//! A small transformer built from the layers (embeddings, `TransformerBlock`s, a head), trained
//! through the library's loop on the bundled text by 2 thread ranks with DDP and `no_sync`
//! gradient accumulation (2 microbatches a step), then asked for a few bytes.
//!
//! `cargo run --release -p brigade --example gpt_from_scratch [-- STEPS]`

use brigade::autograd::{scope, ParamStore, Var};
use brigade::launch::LaunchConfig;
use brigade::models::nn::{Embedding, Init, LayerNorm, Linear, Params, TransformerBlock};
use brigade::models::{load_params_from_tensors, Batch, Dataset, Model, Result};
use brigade::tensor::{DType, Rng, Tensor};
use brigade::{OptimizerConfig, TrainConfig};

const D: usize = 64;
const CONTEXT: usize = 32;
const INIT: Init = Init::Normal { std: 0.02 };

struct Gpt {
    store: ParamStore,
    tok: Embedding,
    pos: Embedding,
    blocks: Vec<TransformerBlock>,
    ln_f: LayerNorm,
    head: Linear,
}

impl Gpt {
    fn new(layers: usize, seed: u64) -> Result<Gpt> {
        let (mut store, mut rng) = (ParamStore::new(), Rng::new(seed));
        let mut p = Params::new(&mut store, &mut rng, DType::F32);
        let tok = Embedding::new(&mut p.sub("tok_emb"), 256, D, 0.02)?;
        let pos = Embedding::new(&mut p.sub("pos_emb"), CONTEXT, D, 0.02)?;
        let blocks = (0..layers)
            .map(|i| TransformerBlock::new(&mut p.sub(&format!("blocks.{i}")), D, 4, 4 * D, INIT))
            .collect::<Result<_>>()?;
        let ln_f = LayerNorm::new(&mut p.sub("ln_f"), D, LayerNorm::DEFAULT_EPS)?;
        let head = Linear::new(&mut p.sub("head"), D, 256, false, INIT)?;
        Ok(Gpt {
            store,
            tok,
            pos,
            blocks,
            ln_f,
            head,
        })
    }

    /// Next-byte logits `[B, T, 256]` of byte ids `[B, T]`.
    fn logits(&self, ids: &Tensor) -> Result<Var> {
        let t = ids.shape()[1];
        let mut x = self.tok.forward(ids)?.add(&self.pos.weight.narrow(0, 0, t)?)?;
        for (i, block) in self.blocks.iter().enumerate() {
            x = scope(&format!("blocks.{i}"), || block.forward(&x))?; // one backward span each
        }
        self.head.forward(&self.ln_f.forward(&x)?)
    }

    /// Greedy continuation of `prompt` by `n` bytes.
    fn sample(&self, prompt: &[u8], n: usize) -> Result<Vec<u8>> {
        let mut out = prompt.to_vec();
        for _ in 0..n {
            let window: Vec<i64> = out[out.len().saturating_sub(CONTEXT)..]
                .iter()
                .map(|&c| c.into())
                .collect();
            let t = window.len();
            let logits = self
                .logits(&Tensor::from_vec(window, &[1, t])?)?
                .value()
                .to_vec::<f32>()?;
            let last = &logits[(t - 1) * 256..];
            out.push((0..256).max_by(|&a, &b| last[a].total_cmp(&last[b])).unwrap_or(0) as u8);
        }
        Ok(out)
    }
}

impl Model for Gpt {
    fn params(&self) -> &ParamStore {
        &self.store
    }

    /// Mean next-byte cross-entropy of rows `tokens [B, T + 1]`.
    fn loss(&self, batch: &Batch) -> Result<Var> {
        let (inputs, targets) = batch.shifted_tokens("gpt")?; // [B, T] and [B * T]
        Ok(self
            .logits(&inputs)?
            .reshape(&[targets.numel(), 256])?
            .cross_entropy(&targets)?)
    }

    fn layer_names(&self) -> Vec<String> {
        (0..self.blocks.len()).map(|i| format!("blocks.{i}")).collect()
    }
}

#[allow(clippy::neg_cmp_op_on_partial_ord)] // a NaN loss did not go down either
fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    brigade::tensor::retain_freed_host_memory(); // reuse freed activations: no page faults
    let steps: usize = std::env::args().nth(1).map_or(Ok(80), |s| s.parse())?;
    // 2 ranks x 2 microbatches of 8 rows: the first microbatch accumulates under `no_sync`,
    // the last one's backward all-reduces the summed gradients.
    let cfg = {
        let mut c = TrainConfig::new(steps, 8, OptimizerConfig::adamw(3e-3, None));
        c.data.accum = 2;
        c
    };
    let report = brigade::fit(
        &LaunchConfig::threads(2),
        &cfg,
        |_world| Ok(Dataset::builtin_text(CONTEXT, 0)?),
        |_ctx| Ok(Box::new(Gpt::new(2, 0)?)),
    )?;
    let steps = &report.outcome.steps;
    let (Some(first), Some(last)) = (steps.first().map(|r| r.loss), steps.last().map(|r| r.loss)) else {
        return Err("no step ran: give STEPS >= 1".into());
    };
    println!("loss: step 0 {first:.3}, step {} {last:.3}", steps.len() - 1);
    // The trained parameters (rank 0's) in a fresh model, for sampling.
    let model = Gpt::new(2, 0)?;
    load_params_from_tensors(model.params(), &report.outcome.params)?;
    println!("sample: {:?}", String::from_utf8_lossy(&model.sample(b"The ", 40)?));
    if !(last < first) {
        return Err("the loss did not go down".into());
    }
    Ok(())
}
