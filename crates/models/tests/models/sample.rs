//! Text out: decoding with a KV cache, greedy or sampled, streamed token by token.

use std::collections::HashMap;
use std::ops::ControlFlow;

use brigade_autograd::{no_grad, AdamW, LrSchedule, Optimizer, ScheduleKind};
use brigade_models::{
    generate, generate_text, generate_uncached, Dataset, Gpt, GptConfig, Model, ModelError, SampleOptions, Utf8Stream,
};
use brigade_tensor::{DType, Rng, Tensor};

fn cfg(dtype: DType, context: usize) -> GptConfig {
    GptConfig {
        vocab: 32,
        d_model: 16,
        n_layers: 2,
        n_heads: 4,
        d_ff: 32,
        context,
        dtype,
        dropout: 0.0,
    }
}

/// A GPT whose parameters are redrawn from N(0, 0.3²): logits far apart, so that greedy
/// choices are not near-ties, and samples vary.
fn model(dtype: DType, context: usize, seed: u64) -> Gpt {
    let m = Gpt::new(cfg(dtype, context), seed).unwrap();
    let mut rng = Rng::new(seed + 100);
    no_grad(|| {
        for p in m.params().params() {
            p.value()
                .copy_from(&Tensor::randn(&p.shape(), 0.3, dtype, &mut rng))
                .unwrap();
        }
    });
    m
}

fn greedy(n: usize) -> SampleOptions {
    SampleOptions {
        max_new_tokens: n,
        temperature: 0.0,
        ..SampleOptions::default()
    }
}

fn go() -> impl FnMut(i64) -> ControlFlow<()> {
    |_| ControlFlow::Continue(())
}

/// Full-forward logits `[T, vocab]` of one sequence, as f64.
fn full_logits(m: &Gpt, seq: &[i64]) -> Vec<Vec<f64>> {
    let t = Tensor::from_vec(seq.to_vec(), &[1, seq.len()]).unwrap();
    let v = no_grad(|| m.logits(&t)).unwrap().value().to_f64_vec().unwrap();
    v.chunks(m.config().vocab).map(<[f64]>::to_vec).collect()
}

fn argmax(v: &[f64]) -> i64 {
    v.iter()
        .enumerate()
        .fold((0, f64::NEG_INFINITY), |b, (i, &x)| if x > b.1 { (i, x) } else { b })
        .0 as i64
}

#[test]
fn greedy_is_the_argmax_of_a_full_forward_at_every_position() {
    let m = model(DType::F64, 16, 1);
    let prompt = [3i64, 17, 5];
    let out = generate(&m, &prompt, &greedy(13), go()).unwrap();
    assert_eq!(out.tokens.len(), 13);
    let seq: Vec<i64> = prompt.iter().chain(&out.tokens).copied().collect();
    assert_eq!(
        seq.len(),
        16,
        "the whole sequence fits the context: one full forward checks it"
    );
    let logits = full_logits(&m, &seq[..15]);
    for p in prompt.len() - 1..15 {
        assert_eq!(seq[p + 1], argmax(&logits[p]), "position {p}");
    }
    // deterministic: the same again
    assert_eq!(generate(&m, &prompt, &greedy(13), go()).unwrap(), out);
    let distinct: std::collections::HashSet<_> = out.tokens.iter().collect();
    assert!(distinct.len() > 2, "a non-degenerate model: {:?}", out.tokens);
}

#[test]
fn the_kv_cache_path_equals_the_no_cache_path() {
    // logits: a prompt chunk, then single tokens and a chunk of 3, against one full forward
    let m = model(DType::F32, 12, 2);
    let seq: Vec<i64> = (0..12).map(|i| (i * 7 % 32) as i64).collect();
    let full = full_logits(&m, &seq);
    let mut cache = m.new_cache(1).unwrap();
    let mut pos = 0;
    for chunk in [4, 1, 1, 3, 1, 2] {
        let t = Tensor::from_vec(seq[pos..pos + chunk].to_vec(), &[1, chunk]).unwrap();
        let got = m.forward_cached(&t, &mut cache).unwrap().value();
        assert_eq!(got.shape(), [1, chunk, 32]);
        for (i, row) in got.to_f64_vec().unwrap().chunks(32).enumerate() {
            for (a, b) in row.iter().zip(&full[pos + i]) {
                assert!(
                    (a - b).abs() < 2e-5 * (1.0 + b.abs()),
                    "position {}: {a} vs {b}",
                    pos + i
                );
            }
        }
        pos += chunk;
        assert_eq!(cache.len(), pos);
    }
    // the cache is full: one more position is an error, not a wrong answer
    let e = m
        .forward_cached(&Tensor::from_vec(vec![1i64], &[1, 1]).unwrap(), &mut cache)
        .unwrap_err();
    assert!(
        matches!(e, ModelError::ContextTooLong { found: 13, context: 12 }),
        "{e}"
    );

    // whole generations, well past the context (windows restart), greedy and sampled
    let m = model(DType::F64, 8, 3);
    for opts in [
        greedy(40),
        SampleOptions {
            max_new_tokens: 40,
            temperature: 0.9,
            top_k: Some(10),
            seed: 5,
        },
    ] {
        for prompt in [vec![1i64], (0..11).collect::<Vec<i64>>()] {
            let cached = generate(&m, &prompt, &opts, go()).unwrap();
            let uncached = generate_uncached(&m, &prompt, &opts, go()).unwrap();
            assert_eq!(cached.tokens, uncached.tokens, "{opts:?} prompt {prompt:?}");
        }
    }
}

#[test]
fn a_new_token_costs_one_position() {
    // context 32: a prompt of 5 then 10 tokens. The cache computes the prompt once and one
    // position per token after the first; without it each token recomputes its window.
    let m = model(DType::F32, 32, 4);
    let prompt = [1i64, 2, 3, 4, 5];
    let cached = generate(&m, &prompt, &greedy(10), go()).unwrap();
    assert_eq!(cached.positions, 5 + 9);
    let uncached = generate_uncached(&m, &prompt, &greedy(10), go()).unwrap();
    assert_eq!(uncached.positions, (5..15).sum::<usize>());
    // context 8, past it: windows of 8 restart from the last 4 tokens. Token k (0-based) of 20
    // sees a window that the cache extends by one, except at a restart, which recomputes 4.
    let m = model(DType::F32, 8, 4);
    let out = generate(&m, &prompt, &greedy(20), go()).unwrap();
    // prompt 5 -> tokens 1..3 extend to 8; then every 4 tokens a restart of 4 and 3 single steps
    let mut want = 5;
    let (mut len, mut window) = (5, 5);
    for _ in 1..20 {
        len += 1;
        window += 1;
        if window > 8 {
            window = 4;
            want += 4;
        } else {
            want += 1;
        }
    }
    assert_eq!((len, out.positions), (24, want));
}

#[test]
fn sampling_is_seeded_and_top_k_restricts_the_draws() {
    let m = model(DType::F64, 16, 5);
    let prompt = [7i64, 7];
    let opts = |seed, top_k| SampleOptions {
        max_new_tokens: 14,
        temperature: 1.0,
        top_k,
        seed,
    };
    let a = generate(&m, &prompt, &opts(1, None), go()).unwrap().tokens;
    assert_eq!(
        a,
        generate(&m, &prompt, &opts(1, None), go()).unwrap().tokens,
        "same seed"
    );
    assert_ne!(
        a,
        generate(&m, &prompt, &opts(2, None), go()).unwrap().tokens,
        "another seed"
    );
    // top-k 1 is greedy at any temperature
    let top1 = generate(&m, &prompt, &opts(3, Some(1)), go()).unwrap().tokens;
    assert_eq!(top1, generate(&m, &prompt, &greedy(14), go()).unwrap().tokens);
    // top-k 3: every draw among the 3 largest logits of its position
    let t3 = generate(&m, &prompt, &opts(4, Some(3)), go()).unwrap().tokens;
    let seq: Vec<i64> = prompt.iter().chain(&t3).copied().collect();
    let logits = full_logits(&m, &seq[..seq.len() - 1]);
    for (k, &tok) in t3.iter().enumerate() {
        let row = &logits[prompt.len() - 1 + k];
        let mut sorted = row.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        assert!(row[tok as usize] >= sorted[2], "token {k} = {tok} is not in the top 3");
    }
    // a low temperature concentrates on the greedy choice
    let cold = SampleOptions {
        temperature: 1e-3,
        ..opts(9, None)
    };
    assert_eq!(generate(&m, &prompt, &cold, go()).unwrap().tokens, top1);
}

#[test]
fn the_callback_sees_each_token_as_it_comes_and_can_stop() {
    let m = model(DType::F32, 16, 6);
    let mut seen = vec![];
    let out = generate(&m, &[1, 2], &greedy(10), |t| {
        seen.push(t);
        if seen.len() == 3 {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    })
    .unwrap();
    assert_eq!(out.tokens, seen);
    assert!(out.stopped && seen.len() == 3);
    assert!(generate(&m, &[1], &greedy(0), go()).unwrap().tokens.is_empty());
}

#[test]
fn requests_that_cannot_be_served_are_one_error_line() {
    let mut m = Gpt::new(
        GptConfig {
            dropout: 0.1,
            ..cfg(DType::F32, 8)
        },
        0,
    )
    .unwrap();
    let e = |r: brigade_models::Result<brigade_models::Generated>| {
        let e = r.unwrap_err();
        assert!(matches!(e, ModelError::Generate(_)), "{e:?}");
        e.to_string()
    };
    assert!(e(generate(&m, &[], &greedy(3), go())).contains("prompt is empty"));
    assert!(e(generate(&m, &[1, 32], &greedy(3), go())).contains("prompt token 1 is 32, outside the vocabulary 0..32"));
    let bad_t = SampleOptions {
        temperature: -1.0,
        ..greedy(3)
    };
    assert!(e(generate(&m, &[1], &bad_t, go())).contains("temperature"));
    let bad_k = SampleOptions {
        top_k: Some(0),
        temperature: 1.0,
        ..greedy(3)
    };
    assert!(e(generate(&m, &[1], &bad_k, go())).contains("top_k"));
    assert!(e(generate_uncached(&m, &[1], &greedy(3), go())).contains("call eval()"));
    m.eval();
    assert!(generate_uncached(&m, &[1], &greedy(3), go()).is_ok());
    // the cached path never drops, whatever the mode
    m.train();
    let a = generate(&m, &[1], &greedy(5), go()).unwrap();
    m.eval();
    assert_eq!(a, generate(&m, &[1], &greedy(5), go()).unwrap());
}

#[test]
fn utf8_stream_emits_whole_characters() {
    let mut s = Utf8Stream::new();
    let pieces: Vec<String> = "a€ß☃".bytes().map(|b| s.push(b)).collect();
    assert_eq!(pieces, ["a", "", "", "€", "", "ß", "", "", "☃"]);
    assert_eq!(s.finish(), "");
    let mut s = Utf8Stream::new();
    assert_eq!(s.push(0xFF), "\u{FFFD}");
    assert_eq!(s.push(0xE2), "");
    assert_eq!(s.push(b'x'), "\u{FFFD}x", "an unfinished character then ASCII");
    assert_eq!(s.push(0xE2), "");
    assert_eq!(s.finish(), "\u{FFFD}");
}

/// Trains a tiny byte-level GPT on `text` for `steps` steps of 16 random rows: AdamW, 20 steps
/// of warmup to 1e-2, then a cosine down to 1e-3 (without the decay some seeds end noisy).
fn train_on(text: &[u8], steps: usize, seed: u64) -> Gpt {
    let cfg = GptConfig {
        vocab: 256,
        d_model: 48,
        n_layers: 2,
        n_heads: 4,
        d_ff: 96,
        context: 24,
        dtype: DType::F32,
        dropout: 0.0,
    };
    let model = Gpt::new(cfg, seed).unwrap();
    let data = Dataset::text(text.to_vec(), 24).unwrap();
    let mut opt = AdamW::with_options(model.params().params().to_vec(), 1e-2, (0.9, 0.99), 1e-8, 0.0);
    let schedule = LrSchedule::new(
        1e-2,
        20,
        ScheduleKind::Cosine {
            decay_steps: steps as u64,
            min_lr: 1e-3,
        },
    )
    .unwrap();
    let mut rng = Rng::new(seed + 1);
    for step in 0..steps {
        schedule.apply(&mut opt, step as u64);
        let rows: Vec<usize> = (0..16).map(|_| rng.below(data.len() as u64) as usize).collect();
        model.params().zero_grad().unwrap();
        model.loss(&data.gather(&rows).unwrap()).unwrap().backward().unwrap();
        opt.step().unwrap();
    }
    model
}

#[test]
fn a_model_trained_on_a_text_reproduces_its_frequent_words() {
    let sentences = [
        "the cat sat on the mat.",
        "the dog ran to the park.",
        "a bird sang in the tree.",
        "the cat saw the dog.",
        "the dog saw a bird.",
        "a cat ran to the tree.",
    ];
    let mut rng = Rng::new(0);
    let mut text = String::new();
    while text.len() < 6000 {
        text.push_str(sentences[rng.below(sentences.len() as u64) as usize]);
        text.push(' ');
    }
    let mut freq: HashMap<&str, usize> = HashMap::new();
    for w in text.split(|c: char| !c.is_ascii_alphabetic()).filter(|w| !w.is_empty()) {
        *freq.entry(w).or_default() += 1;
    }
    let vocabulary: Vec<&str> = freq.keys().copied().collect();
    let mut frequent: Vec<(&str, usize)> = freq.into_iter().collect();
    frequent.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    let frequent: Vec<&str> = frequent.iter().take(6).map(|(w, _)| *w).collect();

    // 8 seeds gave whole sentences of the text after 300 steps; seed 0 is tested
    let mut model = train_on(text.as_bytes(), 300, 0);
    model.eval();
    let mut streamed = String::new();
    let out = generate_text(&model, "the ", &greedy(60), |s| {
        streamed.push_str(s);
        ControlFlow::Continue(())
    })
    .unwrap();
    assert_eq!(out, streamed, "streamed as generated");
    // the last word may be cut off by the token budget
    let words: Vec<&str> = out
        .split(|c: char| !c.is_ascii_alphabetic())
        .filter(|w| !w.is_empty())
        .collect();
    let whole = &words[..words.len() - 1];
    let in_text = whole.iter().filter(|w| vocabulary.contains(*w)).count();
    let distinct: std::collections::HashSet<&&str> = whole.iter().filter(|w| frequent.contains(w)).collect();
    assert!(
        in_text * 10 >= whole.len() * 9 && distinct.len() >= 3,
        "generated {out:?}: {in_text} of {} words from the text, {} of its frequent {frequent:?}",
        whole.len(),
        distinct.len()
    );
}
