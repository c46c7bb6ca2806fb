//! A small transformer built from the layers, trained on the bundled text by 2 thread ranks with
//! DDP and `no_sync` gradient accumulation (2 microbatches a step), then asked for a few bytes.
//!
//! `cargo run --release -p brigade --example gpt_from_scratch [-- STEPS]`

use std::time::Duration;

use brigade::autograd::{scope, AdamW, Optimizer, ParamStore, Var};
use brigade::ddp::{DdpConfig, DistributedDataParallel};
use brigade::launch::{launch, Backend, LaunchConfig};
use brigade::models::nn::{Activation, CausalSelfAttention, Embedding, Init, LayerNorm, Linear, MlpBlock, Params};
use brigade::models::{Batch, Dataset, Result};
use brigade::tensor::{DType, Rng, Tensor};

const D: usize = 64;
const CONTEXT: usize = 32;
const INIT: Init = Init::Normal { std: 0.02 };

struct Block {
    ln1: LayerNorm,
    attn: CausalSelfAttention,
    ln2: LayerNorm,
    mlp: MlpBlock,
}

struct Gpt {
    store: ParamStore,
    tok: Embedding,
    pos: Embedding,
    blocks: Vec<Block>,
    ln_f: LayerNorm,
    head: Linear,
}

impl Gpt {
    fn new(layers: usize, seed: u64) -> Result<Gpt> {
        let (mut store, mut rng) = (ParamStore::new(), Rng::new(seed));
        let mut p = Params::new(&mut store, &mut rng, DType::F32);
        let tok = Embedding::new(&mut p.sub("tok_emb"), 256, D, 0.02)?;
        let pos = Embedding::new(&mut p.sub("pos_emb"), CONTEXT, D, 0.02)?;
        let mut blocks = vec![];
        for i in 0..layers {
            let mut b = p.sub(&format!("blocks.{i}"));
            blocks.push(Block {
                ln1: LayerNorm::new(&mut b.sub("ln1"), D, 1e-5)?,
                attn: CausalSelfAttention::new(&mut b.sub("attn"), D, 4, INIT)?,
                ln2: LayerNorm::new(&mut b.sub("ln2"), D, 1e-5)?,
                mlp: MlpBlock::new(&mut b.sub("mlp"), D, 4 * D, Activation::Gelu, INIT)?,
            });
        }
        let ln_f = LayerNorm::new(&mut p.sub("ln_f"), D, 1e-5)?;
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
        for (i, b) in self.blocks.iter().enumerate() {
            x = scope(&format!("blocks.{i}"), || -> Result<Var> {
                let x = x.add(&b.attn.forward(&b.ln1.forward(&x)?)?)?;
                Ok(x.add(&b.mlp.forward(&b.ln2.forward(&x)?)?)?)
            })?;
        }
        self.head.forward(&self.ln_f.forward(&x)?)
    }

    fn loss(&self, batch: &Batch) -> Result<Var> {
        let Batch::Tokens { tokens } = batch else {
            unreachable!("text data")
        };
        let (b, n) = (tokens.shape()[0], tokens.shape()[1]);
        let inputs = tokens.narrow(1, 0, n - 1)?.contiguous()?;
        let targets = tokens
            .narrow(1, 1, n - 1)?
            .to_dtype(DType::I64)?
            .reshape(&[b * (n - 1)])?;
        Ok(self
            .logits(&inputs)?
            .reshape(&[b * (n - 1), 256])?
            .cross_entropy(&targets)?)
    }

    /// Greedy continuation of `prompt` by `n` bytes.
    fn sample(&self, prompt: &[u8], n: usize) -> Result<Vec<u8>> {
        let mut out = prompt.to_vec();
        for _ in 0..n {
            let window: Vec<i64> = out[out.len().saturating_sub(CONTEXT)..]
                .iter()
                .map(|&c| i64::from(c))
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

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let steps: usize = std::env::args().nth(1).map_or(Ok(80), |s| s.parse())?;
    let (batch, accum) = (8, 2);
    let cfg = LaunchConfig {
        backend: Backend::Thread,
        world_size: 2,
        timeout: Duration::from_secs(120),
        net: None,
        recorder: None,
    };
    let data = Dataset::builtin_text(CONTEXT, 0)?;
    let launched = launch(
        &cfg,
        |_| Ok(data),
        |ctx, data| {
            let model = Gpt::new(2, 0)?;
            let ddp = DistributedDataParallel::new(&model.store, ctx.comm.clone(), DdpConfig::default())?;
            let mut opt = AdamW::new(model.store.params().to_vec(), 3e-3);
            let mut losses = vec![];
            for s in 0..steps {
                model.store.zero_grad()?;
                let mut step_loss = 0.0;
                for j in 0..accum {
                    let row = ((s * ctx.world_size + ctx.rank) * accum + j) * batch;
                    let loss = model.loss(&data.batch(row, batch)?)?.mul_scalar(1.0 / accum as f64)?;
                    step_loss += loss.value().item()?;
                    if j + 1 < accum {
                        ddp.no_sync(|| loss.backward())?; // accumulate locally, no communication
                    } else {
                        loss.backward()?; // the last microbatch reduces the summed gradients
                    }
                }
                opt.step()?;
                losses.push(step_loss);
            }
            let text = if ctx.rank == 0 {
                model.sample(b"The ", 40)?
            } else {
                vec![]
            };
            Ok((losses, text))
        },
    )?;
    let (_, (losses, text)) = &launched.results[0];
    println!(
        "loss (rank 0): step 0 {:.3}, step {} {:.3}",
        losses[0],
        losses.len() - 1,
        losses[losses.len() - 1]
    );
    println!("sample: {:?}", String::from_utf8_lossy(text));
    if !(losses.last() < losses.first()) {
        return Err("the loss did not go down".into());
    }
    Ok(())
}
