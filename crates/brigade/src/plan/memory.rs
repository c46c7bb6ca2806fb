//! The memory model: the most bytes one rank holds at once during a step, part by part, for
//! a configuration that has not run (`--memory-budget`, [`crate::plan`]): the parameters,
//! gradients and optimizer state as the policy keeps them, the tensors a forward pass leaves to
//! its backward (the GPT's counted op by op, checkpointed blocks keeping only their output) and
//! backward's working set on top of them, in a steady step or at the first step's moments that
//! no later step repeats, whichever holds more. It meets the run's measured peak
//! ([`MemoryReport::peak`](brigade_ddp::MemoryReport::peak), every step's) within 10% for the
//! MLP and the GPT at world 1, 2, 4 and 8 under ZeRO 0 to 3, the GPT with and without
//! activation checkpointing (`scripts/plan-validation.py --memory-grid`; the CLI's tests check
//! smaller models over the same grid). A reducer policy's own bytes
//! are counted where it makes them: fp16/bf16 compression's 16-bit copy of the gradients and
//! PowerSGD's working copy of a matrix on the rank's thread (in the measured peak), PowerSGD's
//! error feedback and factors kept across steps as `policy_state` (made on the comm stream's
//! thread, which the measured peak does not see: the report's `policy_state`). Other
//! communication scratch on the comm stream's thread is not counted, as the measured peak does
//! not count it. Every size goes through checked arithmetic: `None` is more than 2^64 bytes.
//! The parameters are counted in f32 (a 16-bit run's compute copies and master weights are not
//! modelled apart).

use brigade_models::{GptConfig, ModelKind};
use brigade_policies::PolicySpec;
use serde::{Deserialize, Serialize};

/// The share of the measured peak within which the model is held to predict it (see the module's
/// documentation): a plan that must fit a budget keeps this margin under it.
pub const ACCURACY: f64 = 0.10;

/// Bytes of an f32.
const F32: u64 = 4;

/// `a * b`, or `None` on overflow.
pub fn mul(a: u64, b: u64) -> Option<u64> {
    a.checked_mul(b)
}

/// The sum of `terms`, or `None` on overflow.
pub fn sum(terms: impl IntoIterator<Item = Option<u64>>) -> Option<u64> {
    terms.into_iter().try_fold(0u64, |acc, t| acc.checked_add(t?))
}

/// Elements of a `rows x cols` matrix.
pub fn matrix(rows: usize, cols: usize) -> Option<u64> {
    mul(rows as u64, cols as u64)
}

/// What [`predict_peak`] is asked about: one rank of a run.
#[derive(Clone, Copy, Debug)]
pub struct PeakQuery<'a> {
    /// The model.
    pub kind: &'a ModelKind,
    /// Rows a microbatch.
    pub rows: usize,
    /// Optimizer values per parameter (AdamW 2, SGD with momentum 1, plain SGD 0).
    pub state_per_param: u64,
    /// The reducer policy: what it shards over the ranks, and what it keeps beside the buckets.
    pub policy: &'a PolicySpec,
    /// Ranks.
    pub world: usize,
    /// Every how many GPT blocks one is checkpointed (0: none).
    pub checkpoint_every: usize,
}

/// One rank's predicted peak during a step, by part, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeakPrediction {
    /// The parameters (under ZeRO-3 the rank's shard and the units gathered at once).
    pub parameters: u64,
    /// The gradients at their most (under ZeRO-2 the full gradients of backward and the shards).
    pub gradients: u64,
    /// The optimizer's state (sharded under ZeRO-1 and 2).
    pub optimizer_state: u64,
    /// What the forward pass leaves for backward.
    pub activations: u64,
    /// Backward's working set beside them: the gradients in flight through the widest layer
    /// (for the MLP also its largest weight's gradient, made before it is added into its
    /// bucket), one checkpointed block recomputed, and the policy's scratch (fp16/bf16
    /// compression's 16-bit copy of the gradients, PowerSGD's copy of its largest matrix).
    pub backward: u64,
    /// What the policy keeps across steps: PowerSGD's error feedback (an f32 value per
    /// gradient value) and its warm-start factors; 0 for the others.
    #[serde(default)]
    pub policy_state: u64,
}

impl PeakPrediction {
    /// The predicted peak: every part at once.
    pub fn total(&self) -> u64 {
        self.parameters + self.gradients + self.optimizer_state + self.activations + self.backward + self.policy_state
    }

    /// The largest part, by name (`activations`, `parameters`, ...).
    pub fn largest(&self) -> (&'static str, u64) {
        [
            ("parameters", self.parameters),
            ("gradients", self.gradients),
            ("optimizer state", self.optimizer_state),
            ("activations", self.activations),
            ("backward working set", self.backward),
            ("policy state", self.policy_state),
        ]
        .into_iter()
        .fold(("parameters", 0), |a, b| if b.1 > a.1 { b } else { a })
    }
}

/// Every parameter of the model, biases and norms included.
pub fn exact_parameters(kind: &ModelKind) -> Option<u64> {
    match kind {
        ModelKind::Mlp(c) => sum(c
            .widths
            .windows(2)
            .map(|w| sum([matrix(w[0], w[1]), Some(w[1] as u64)]))),
        ModelKind::Gpt(c) => {
            let (d, ff) = (c.d_model as u64, c.d_ff as u64);
            // ln1, qkv, proj, ln2, fc, proj: weights and biases
            let block = sum([
                Some(2 * d),
                sum([mul(3 * d, d), Some(3 * d)]),
                sum([mul(d, d), Some(d)]),
                Some(2 * d),
                sum([mul(ff, d), Some(ff)]),
                sum([mul(d, ff), Some(d)]),
            ]);
            sum([
                matrix(c.vocab, c.d_model),
                matrix(c.context, c.d_model),
                mul(block?, c.n_layers as u64),
                Some(2 * d),
                matrix(c.vocab, c.d_model),
            ])
        }
    }
}

/// f32 values per position a GPT block leaves for backward when it is not checkpointed: the
/// outputs of its two LayerNorms (with their mean and rstd), the packed projection `3d`, the
/// attention's output and its probabilities (`heads x context`), the head-major copy the output
/// projection reads, both projections, the feed-forward's two `d_ff` tensors, the two residual
/// sums, and with dropout each mask and its product.
fn gpt_block_values(c: &GptConfig) -> u64 {
    let (d, ff) = (c.d_model as u64, c.d_ff as u64);
    let dropout = if c.dropout > 0.0 { 4 * d } else { 0 };
    10 * d + 2 * ff + 4 + (c.n_heads * c.context) as u64 + dropout
}

/// Elements of the model's largest ZeRO-3 unit (its scopes: the GPT's embedding, each block and
/// the head with the final norm; the MLP's layers), padded to a multiple of `world` as the
/// unit's flat parameters are.
pub fn largest_unit(kind: &ModelKind, world: u64) -> Option<u64> {
    Some(units(kind, world)?.into_iter().max().unwrap_or(0))
}

/// Elements ZeRO-3 holds whole at once in backward, at the unit where they are the most:
/// `(gathered, gradients)`. While unit `i`'s backward runs (the units run last to first), its
/// parameters and the prefetched ones of unit `i - 1` are gathered, and its full gradients are
/// being filled beside unit `i + 1`'s, whose reduce-scatter is in flight.
fn units_in_flight(kind: &ModelKind, world: u64) -> Option<(u64, u64)> {
    let u = units(kind, world)?;
    let at = |i: Option<usize>| i.and_then(|i| u.get(i)).copied().unwrap_or(0);
    (0..u.len())
        .map(|i| (u[i] + at(i.checked_sub(1)), u[i] + at(Some(i + 1))))
        .max_by_key(|&(gathered, grads)| gathered + grads)
        .or(Some((0, 0)))
}

/// Elements of each ZeRO-3 unit in registration order ([`largest_unit`]'s units, padded alike).
fn units(kind: &ModelKind, world: u64) -> Option<Vec<u64>> {
    let units: Vec<Option<u64>> = match kind {
        ModelKind::Mlp(c) => c
            .widths
            .windows(2)
            .map(|w| sum([matrix(w[0], w[1]), Some(w[1] as u64)]))
            .collect(),
        ModelKind::Gpt(c) => {
            let d = c.d_model as u64;
            let one_block = ModelKind::Gpt(GptConfig {
                n_layers: 1,
                ..c.clone()
            });
            let no_block = ModelKind::Gpt(GptConfig {
                n_layers: 0,
                ..c.clone()
            });
            let block = exact_parameters(&one_block)?.checked_sub(exact_parameters(&no_block)?);
            let mut units = vec![sum([matrix(c.vocab, c.d_model), matrix(c.context, c.d_model)])];
            units.extend(std::iter::repeat_n(block, c.n_layers));
            units.push(sum([matrix(c.vocab, c.d_model), Some(2 * d)]));
            units
        }
    };
    let world = world.max(1);
    units.into_iter().map(|u| mul(u?.div_ceil(world), world)).collect()
}

/// Every weight matrix of the model as its gradient is shaped (`[rows, cols]`: Linear weights
/// `[out, in]`, embeddings `[entries, dim]`), in no particular order.
fn matrices(kind: &ModelKind) -> Vec<[usize; 2]> {
    match kind {
        ModelKind::Mlp(c) => c.widths.windows(2).map(|w| [w[1], w[0]]).collect(),
        ModelKind::Gpt(c) => {
            let (d, ff) = (c.d_model, c.d_ff);
            let block = [[3 * d, d], [d, d], [ff, d], [d, ff]];
            let mut all = vec![[c.vocab, d], [c.context, d], [c.vocab, d]];
            for _ in 0..c.n_layers {
                all.extend(block);
            }
            all
        }
    }
}

/// Elements of every parameter's gradient in registration order (weights, then their bias).
fn param_sizes(kind: &ModelKind) -> Vec<u64> {
    match kind {
        ModelKind::Mlp(c) => (c.widths.windows(2))
            .flat_map(|w| [(w[0] * w[1]) as u64, w[1] as u64])
            .collect(),
        ModelKind::Gpt(c) => {
            let (d, ff) = (c.d_model as u64, c.d_ff as u64);
            let block = [d, d, 3 * d * d, 3 * d, d * d, d, d, d, ff * d, ff, d * ff, d];
            let mut all = vec![(c.vocab * c.d_model) as u64, (c.context * c.d_model) as u64];
            for _ in 0..c.n_layers {
                all.extend(block);
            }
            all.extend([d, d, (c.vocab * c.d_model) as u64]);
            all
        }
    }
}

/// Bytes of the DDP bucket that lands last under the default caps ([`brigade_ddp::DdpConfig`]:
/// the parameters grouped in reverse registration order as DDP groups them before any
/// rebuild, the last bucket holding the first registered), `None` inside when the model is
/// one bucket.
fn last_bucket(kind: &ModelKind) -> Option<Option<u64>> {
    let bytes: Vec<usize> = (param_sizes(kind).iter())
        .map(|&n| usize::try_from(mul(n, F32)?).ok())
        .collect::<Option<_>>()?;
    let caps = brigade_ddp::DdpConfig::default();
    let mib = |m: f64| (m * (1u64 << 20) as f64) as usize;
    let order: Vec<usize> = (0..bytes.len()).rev().collect();
    let groups = brigade_ddp::assign_buckets(&bytes, &order, mib(caps.first_bucket_cap_mb), mib(caps.bucket_cap_mb));
    if groups.len() < 2 {
        return Some(None);
    }
    let last = groups.last()?;
    Some(Some(sum(last.iter().map(|&p| Some(bytes[p] as u64)))?))
}

/// The elements of the model's largest weight matrix.
fn largest_matrix(kind: &ModelKind) -> Option<u64> {
    matrices(kind)
        .iter()
        .try_fold(0u64, |m, &[r, c]| Some(m.max(matrix(r, c)?)))
}

/// What `policy` holds beside DDP's buckets, in f32 values: its scratch during backward on the
/// rank's thread, and its state across steps (see [`PeakPrediction`]).
fn policy_values(policy: &PolicySpec, kind: &ModelKind, psi: u64) -> Option<(u64, u64)> {
    Some(match *policy {
        // a 16-bit value per gradient value: half an f32's
        PolicySpec::Fp16 | PolicySpec::Bf16 => (psi.div_ceil(2), 0),
        PolicySpec::PowerSgd { rank, start_iter } => {
            let cfg = brigade_policies::PowerSgdConfig {
                rank,
                start_iter,
                ..Default::default()
            };
            let q = sum(matrices(kind)
                .iter()
                .filter_map(|&[r, c]| cfg.low_rank(&[r, c], r * c))
                .map(|(_, m, k)| matrix(m, k)))?;
            (largest_matrix(kind)?, sum([Some(psi), Some(q)])?)
        }
        // the error-feedback residual: a value per parameter
        PolicySpec::TopK { .. } | PolicySpec::EfSign => (0, psi),
        // the snapshot at the last sync and the outer momentum
        PolicySpec::Diloco(_) => (0, sum([Some(psi), Some(psi)])?),
        // and a fragment's average in flight
        PolicySpec::StreamingDiloco(ref c) => (
            0,
            sum([Some(psi), Some(psi), Some(psi.div_ceil(c.fragments.max(1) as u64))])?,
        ),
        _ => (0, 0),
    })
}

/// f32 values of what the forward pass leaves for backward, of backward's working set (the
/// gradients in flight through the widest layer; for the MLP also its largest weight's
/// gradient, made before it is added into its bucket) and of one checkpointed block
/// recomputed (0 without checkpointing).
fn activation_values(q: &PeakQuery<'_>) -> Option<(u64, u64, u64)> {
    Some(match q.kind {
        ModelKind::Gpt(c) => {
            let tokens = matrix(q.rows, c.context)?;
            let (d, ff, v) = (c.d_model as u64, c.d_ff as u64, c.vocab as u64);
            let every = q.checkpoint_every;
            let checkpointed = if every == 0 {
                0
            } else {
                c.n_layers.div_ceil(every) as u64
            };
            let plain = c.n_layers as u64 - checkpointed;
            let block = gpt_block_values(c);
            let embed = if c.dropout > 0.0 { 4 * d } else { 2 * d };
            // ln_f (output, mean, rstd), the logits and the loss's probabilities
            let head = d + 2 + 2 * v;
            let per_token = sum([mul(plain, block), mul(checkpointed, d), Some(embed), Some(head)])?;
            let recompute = if checkpointed > 0 { block } else { 0 };
            (
                mul(tokens, per_token)?,
                mul(tokens, 2 * ff + d)?,
                mul(tokens, recompute)?,
            )
        }
        ModelKind::Mlp(c) => {
            let rows = q.rows as u64;
            let dropout = if c.dropout > 0.0 { 2 } else { 0 };
            // each layer's output and its activation (or the loss's probabilities)
            let per_row = sum(c.widths.iter().skip(1).map(|&w| mul(w as u64, 2 + dropout)))?;
            let widest = c.widths.iter().copied().max().unwrap_or(0) as u64;
            // the largest weight's gradient, made whole by its GEMM before it is added into
            // its bucket's view
            (
                mul(rows, per_row)?,
                sum([mul(rows, 2 * widest), largest_matrix(q.kind)])?,
                0,
            )
        }
    })
}

/// [`PeakPrediction`] of `q` (`None`: more than 2^64 bytes): the higher of a steady step's
/// peak ([`steady_peak`]) and the moments its parts do not describe (the first step's bucket
/// rebuild of a regrouping policy, ZeRO-1's and ZeRO-2's last bucket landing), the parts of
/// the higher one.
pub fn predict_peak(q: &PeakQuery<'_>) -> Option<PeakPrediction> {
    let steady = steady_peak(q)?;
    Some(match landing_peak(q, &steady)? {
        Some(first) if first.total() > steady.total() => first,
        _ => steady,
    })
}

/// The peak of the moments a steady step's parts do not describe, where it passes a steady
/// step's, from `steady`'s parts (`None` inside the option: no such moment). The first step's
/// come before the first update, when the optimizer has made no state yet (AdamW makes a
/// parameter's moments at its first update). Under a policy whose buckets are regrouped after
/// the first backward (plain DDP, the compressing policies; ZeRO on one rank), the new buckets
/// are made and the gradients copied into them while the old ones and the whole graph's
/// activations are alive: the gradients twice, nothing of backward's working set. Under ZeRO-1
/// (more than one rank) and more than one bucket, the last bucket lands with a second
/// buffer of its size alive beside every full gradient (measured as bucket gradients; a model
/// of one bucket shows none) and its reduce-scatter's shard, with backward's working set (no
/// checkpointed block recomputed): the first step's (no optimizer state yet), and in every
/// later step the bucket lands after backward's working set is gone, beside the optimizer's
/// state. ZeRO-2 lands each bucket into its shard with no second buffer beside it; its last
/// bucket's shard is made after backward's working set is gone: every full gradient and the
/// whole shard, without backward's working set.
fn landing_peak(q: &PeakQuery<'_>, steady: &PeakPrediction) -> Option<Option<PeakPrediction>> {
    let n = q.world.max(1) as u64;
    let full_grads = mul(exact_parameters(q.kind)?, F32)?;
    if q.policy.shards_params() {
        return Some(None);
    }
    if n == 1 || !q.policy.shards_optimizer_state() {
        return Some(Some(PeakPrediction {
            gradients: mul(full_grads, 2)?,
            optimizer_state: 0,
            backward: 0,
            ..*steady
        }));
    }
    if q.policy.shards_grads() {
        // ZeRO-2 lands each bucket into its shard without a second buffer; the last bucket's
        // shard (a model of one bucket: the whole shard) is made after backward's working set
        // is gone
        let landed = PeakPrediction {
            gradients: sum([Some(full_grads), Some(full_grads.div_ceil(n))])?,
            backward: 0,
            ..*steady
        };
        return Some((landed.total() > steady.total()).then_some(landed));
    }
    let Some(bucket) = last_bucket(q.kind)? else {
        return Some(None);
    };
    let (_, backward, _) = activation_values(q)?;
    let landing = PeakPrediction {
        gradients: sum([Some(full_grads), Some(bucket), Some(bucket.div_ceil(n))])?,
        backward: mul(backward, F32)?,
        ..*steady
    };
    let first = PeakPrediction {
        optimizer_state: 0,
        ..landing
    };
    let later = PeakPrediction { backward: 0, ..landing };
    Some(Some(if first.total() > later.total() { first } else { later }))
}

/// A steady step's [`PeakPrediction`] of `q` (`None`: more than 2^64 bytes). Under ZeRO-3 the parameters are
/// the rank's shard and two units gathered at once (the one running and the next, prefetched);
/// the gradients are the shard and two units' full gradients (the unit being filled and the one
/// whose reduce-scatter is in flight: each is freed as it lands), at the unit of backward where
/// the four add up to the most.
/// Under ZeRO-2 the full gradients of backward beside the shards of every bucket but the last,
/// which lands after backward (`landing_peak`'s moment; a model of one bucket has none).
pub fn steady_peak(q: &PeakQuery<'_>) -> Option<PeakPrediction> {
    let psi = exact_parameters(q.kind)?;
    let n = q.world.max(1) as u64;
    // one rank has nothing to shard with: a sharding policy keeps what DDP keeps
    let sharded = |yes: bool| yes && n > 1;
    let shard = |b: u64| {
        if sharded(q.policy.shards_optimizer_state()) {
            b.div_ceil(n)
        } else {
            b
        }
    };
    let full_grads = mul(psi, F32)?;
    // ZeRO-3 gathers its units (copies of its own whole shard) on one rank too
    let (gathered, grads_in_flight) = units_in_flight(q.kind, n)?;
    let gradients = if q.policy.shards_params() {
        sum([Some(full_grads.div_ceil(n)), mul(grads_in_flight, F32)])?
            .min(sum([Some(full_grads), Some(full_grads.div_ceil(n))])?)
    } else if sharded(q.policy.shards_grads()) {
        // backward's working set is alive while every bucket but the last lands into its
        // shard (the last lands after it: `landing_peak`'s moment)
        let last = last_bucket(q.kind)?.unwrap_or(full_grads);
        sum([Some(full_grads), Some((full_grads - last.min(full_grads)).div_ceil(n))])?
    } else {
        full_grads
    };
    let (activations, backward, recompute) = activation_values(q)?;
    let backward = sum([Some(backward), Some(recompute)])?;
    let (scratch, policy_state) = policy_values(q.policy, q.kind, psi)?;
    let parameters = if q.policy.shards_params() {
        sum([Some(mul(psi, F32)?.div_ceil(n)), mul(gathered, F32)])?
    } else {
        mul(psi, F32)?
    };
    Some(PeakPrediction {
        parameters,
        gradients,
        optimizer_state: shard(mul(psi, mul(q.state_per_param, F32)?)?),
        activations: mul(activations, F32)?,
        backward: mul(sum([Some(backward), Some(scratch)])?, F32)?,
        policy_state: mul(policy_state, F32)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peak_counts_every_parameter_and_what_zero_and_checkpointing_keep() {
        // every parameter of a d 128, d_ff 512, context 64, 4-block GPT: tok 256 x 128, pos
        // 64 x 128, per block 2d + (3d^2 + 3d) + (d^2 + d) + 2d + (ff d + ff) + (d ff + d) =
        // 198,272, ln_f 2d, head 256 x 128 (the trainer measures 3,468,288 bytes of them)
        let small = ModelKind::Gpt(brigade_models::GptConfig {
            d_model: 128,
            d_ff: 512,
            context: 64,
            ..brigade_models::GptConfig::default()
        });
        assert_eq!(
            exact_parameters(&small),
            Some(32_768 + 8_192 + 4 * 198_272 + 256 + 32_768)
        );
        assert_eq!(exact_parameters(&small).map(|p| p * 4), Some(3_468_288));
        let q = PeakQuery {
            kind: &small,
            rows: 8,
            state_per_param: 2,
            policy: &PolicySpec::Zero2,
            world: 4,
            checkpoint_every: 0,
        };
        let p = steady_peak(&q).unwrap();
        // ZeRO-2 on 4 ranks: in backward, the full gradients and a quarter shard of every bucket
        // but the last (the default caps' first, past 1 MiB: the head, ln_f, the last block and
        // the third block's second feed-forward bias and weight), a quarter of AdamW's two
        // moments
        let last = 3_468_288 - (32_768 + 256 + 198_272 + 128 + 65_536) * 4;
        assert_eq!(last_bucket(&small), Some(Some(last)));
        assert_eq!(
            (p.gradients, p.optimizer_state),
            (3_468_288 + (3_468_288 - last) / 4, 3_468_288 / 2)
        );
        // the last bucket lands into the whole shard after backward's working set is gone,
        // which held more
        assert_eq!(predict_peak(&q), Some(p));
        let one = steady_peak(&PeakQuery { world: 1, ..q }).unwrap();
        assert_eq!(
            (one.gradients, one.optimizer_state),
            (3_468_288, 2 * 3_468_288),
            "nothing to shard with"
        );
        let ck = steady_peak(&PeakQuery {
            checkpoint_every: 1,
            ..q
        })
        .unwrap();
        assert!(
            ck.activations * 5 < p.activations && ck.backward > p.backward,
            "{ck:?} {p:?}"
        );
        assert_eq!(p.largest().0, "activations");
        // ZeRO-3 on 4 ranks: a quarter of the parameters and two blocks (the largest unit,
        // 198,272 elements) gathered; the gradients and optimizer state as ZeRO-2's
        assert_eq!(largest_unit(&small, 4), Some(198_272));
        let z3 = steady_peak(&PeakQuery {
            policy: &PolicySpec::Zero3,
            ..q
        })
        .unwrap();
        assert_eq!(z3.parameters, 3_468_288 / 4 + 2 * 198_272 * 4);
        // the gradients' shard and two units' full gradients in flight
        assert_eq!(
            (z3.gradients, z3.optimizer_state),
            (3_468_288 / 4 + 2 * 198_272 * 4, p.optimizer_state)
        );
        assert_eq!(
            z3.total(),
            p.total() - 3_468_288 + z3.parameters - p.gradients + z3.gradients
        );
    }

    #[test]
    fn a_policy_s_own_bytes_are_counted_where_it_makes_them() {
        // the reference MLP's shape: 512 -> 2048 -> 2048 -> 10
        let mlp = ModelKind::Mlp(brigade_models::MlpConfig {
            widths: vec![512, 2048, 2048, 10],
            ..brigade_models::MlpConfig::default()
        });
        let psi = exact_parameters(&mlp).unwrap();
        let at = |policy: &PolicySpec| {
            steady_peak(&PeakQuery {
                kind: &mlp,
                rows: 64,
                state_per_param: 0,
                policy,
                world: 2,
                checkpoint_every: 0,
            })
            .unwrap()
        };
        let plain = at(&PolicySpec::AllReduce);
        // backward: the widest layer's gradients in flight and the largest weight's gradient
        assert_eq!(plain.backward, (64 * 2 * 2048 + 2048 * 2048) * 4);
        assert_eq!(plain.policy_state, 0);
        // fp16 and bf16 compression: a 16-bit copy of every gradient
        for half in [PolicySpec::Fp16, PolicySpec::Bf16] {
            let p = at(&half);
            assert_eq!(p.backward - plain.backward, psi.div_ceil(2) * 4, "{half}");
            assert_eq!(p.total() - plain.total(), psi.div_ceil(2) * 4);
        }
        // PowerSGD rank 2: a copy of the largest matrix while it runs; the error feedback of
        // every gradient and Q (m x 2) of each matrix that compresses (all three here)
        let p = at(&PolicySpec::PowerSgd { rank: 2, start_iter: 0 });
        assert_eq!(p.backward - plain.backward, 2048 * 2048 * 4);
        assert_eq!(p.policy_state, (psi + (512 + 2048 + 2048) * 2) * 4);
        // ZeRO keeps nothing of its own beyond its stage
        assert_eq!(at(&PolicySpec::Zero1).backward, plain.backward);
    }

    #[test]
    fn the_first_step_s_moments_raise_the_peak_where_they_pass_a_steady_step() {
        // the reference MLP: 512 -> 2048 -> 2048 -> 2048 -> 10, 36.1 MiB of gradients
        let mlp = ModelKind::Mlp(brigade_models::MlpConfig {
            widths: vec![512, 2048, 2048, 2048, 10],
            ..brigade_models::MlpConfig::default()
        });
        let g = exact_parameters(&mlp).unwrap() * 4;
        let at_with = |policy: &PolicySpec, world, state_per_param| {
            let q = PeakQuery {
                kind: &mlp,
                rows: 64,
                state_per_param,
                policy,
                world,
                checkpoint_every: 0,
            };
            (steady_peak(&q).unwrap(), predict_peak(&q).unwrap())
        };
        let at = |policy: &PolicySpec, world| at_with(policy, world, 2);
        // plain DDP regroups its buckets after the first backward, before the first update:
        // the gradients twice beside the whole graph's activations and no optimizer state,
        // more than a steady step under plain SGD, less under AdamW (its two moments)
        let (steady, first) = at_with(&PolicySpec::AllReduce, 2, 0);
        assert_eq!(first.gradients, 2 * g);
        assert_eq!(first.total(), steady.total() + g - steady.backward);
        let (steady, first) = at(&PolicySpec::AllReduce, 2);
        assert_eq!(first, steady);
        // ZeRO-1 on 2 ranks: the last bucket (the default caps, the first 1 MiB: layers 4
        // and 3 first, then layers 2 and 1 together under 25 MiB) lands beside a second buffer
        // of its size and its half shard
        let bucket = (2048 * 2048 + 2048 + 512 * 2048 + 2048) * 4;
        assert_eq!(last_bucket(&mlp), Some(Some(bucket)));
        let (steady, first) = at(&PolicySpec::Zero1, 2);
        assert_eq!(first.gradients, g + bucket + bucket / 2);
        assert!(first.total() > steady.total());
        // ZeRO-2 on 2 ranks, a last bucket of four 1024 x 1024 layers and the first: in
        // backward the shard of the first bucket (the head and one 1024 x 1024 layer); the
        // last bucket's half shard, made after backward's working set is gone, is more
        let deep = ModelKind::Mlp(brigade_models::MlpConfig {
            widths: vec![64, 1024, 1024, 1024, 1024, 1024, 1024, 10],
            ..brigade_models::MlpConfig::default()
        });
        let deep_g = exact_parameters(&deep).unwrap() * 4;
        let last = (4 * (1024 * 1024 + 1024) + 64 * 1024 + 1024) * 4;
        assert_eq!(last_bucket(&deep), Some(Some(last)));
        let q = PeakQuery {
            kind: &deep,
            rows: 64,
            state_per_param: 2,
            policy: &PolicySpec::Zero2,
            world: 2,
            checkpoint_every: 0,
        };
        let (steady, landed) = (steady_peak(&q).unwrap(), predict_peak(&q).unwrap());
        assert_eq!(steady.gradients, deep_g + (deep_g - last) / 2);
        assert_eq!((landed.gradients, landed.backward), (deep_g + deep_g / 2, 0));
        assert!(landed.total() > steady.total());
        // ZeRO-2 on 2 ranks, eight 64 x 64 layers in one bucket, a row a microbatch: the whole
        // half shard lands after backward, more than backward's working set (the trainer
        // measures 470,296 bytes: this landing, its activations and 272 bytes of other)
        let small = ModelKind::Mlp(brigade_models::MlpConfig {
            widths: vec![64; 9],
            ..brigade_models::MlpConfig::default()
        });
        assert_eq!(last_bucket(&small), Some(None));
        let small_g = exact_parameters(&small).unwrap() * 4;
        let q = PeakQuery {
            kind: &small,
            rows: 1,
            ..q
        };
        let landed = predict_peak(&q).unwrap();
        assert_eq!((landed.gradients, landed.backward), (small_g + small_g / 2, 0));
        // a model of one bucket: ZeRO-1's steady step
        let one = ModelKind::Mlp(brigade_models::MlpConfig {
            widths: vec![16, 32, 32, 4],
            ..brigade_models::MlpConfig::default()
        });
        assert_eq!(last_bucket(&one), Some(None));
        // ZeRO-3 makes no bucket whole at once; on one rank it still gathers its units
        let (steady, first) = at(&PolicySpec::Zero3, 1);
        assert_eq!(steady, first);
        // (the most at the second layer's backward: it and the first, prefetched, gathered;
        // its gradients and the third's, in flight)
        let (first_layer, unit) = (512 * 2048 + 2048, 2048 * 2048 + 2048);
        assert_eq!(first.parameters, g + (unit + first_layer) * 4);
        assert_eq!(first.gradients, g.min(2 * unit * 4) + g);
    }
}
