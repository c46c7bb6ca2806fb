//! One training step (forward, backward, AdamW) of each reference model, single process.
//!
//! `cargo bench -p brigade-benches --bench train_step`

use brigade_autograd::{AdamW, Optimizer};
use brigade_models::{Dataset, GptConfig, MlpConfig, ModelKind};
use brigade_tensor::set_compute_threads;
use criterion::{criterion_group, criterion_main, Criterion};

fn bench(c: &mut Criterion) {
    set_compute_threads(
        std::env::var("BRIGADE_THREADS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(2),
    );
    let mut g = c.benchmark_group("train_step");
    g.sample_size(10);
    let mlp = MlpConfig::default();
    let gpt = GptConfig::default();
    let cases = [
        (
            ModelKind::Mlp(mlp.clone()),
            Dataset::teacher(256, mlp.in_dim(), mlp.n_classes(), 0).unwrap(),
            64,
        ),
        (
            ModelKind::Gpt(gpt.clone()),
            Dataset::builtin_text(gpt.context, 0).unwrap(),
            8,
        ),
    ];
    for (kind, data, batch) in cases {
        let model = kind.build(0).unwrap();
        let mut opt = AdamW::new(model.params().params().to_vec(), 1e-3);
        let batch_t = data.batch(0, batch).unwrap();
        g.bench_function(format!("{}_b{batch}", kind.name()), |b| {
            b.iter(|| {
                model.params().zero_grad().unwrap();
                model.loss(&batch_t).unwrap().backward().unwrap();
                opt.step().unwrap();
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
