//! f32 matmul throughput: square sizes 512..2048 and the reference models' shapes.
//! Criterion reports time; GFLOP/s = 2*m*n*k / time (set as throughput "elements" = flops).
//!
//! `cargo bench -p brigade-benches --bench matmul` (1 thread: `BRIGADE_THREADS=1`).

use brigade_tensor::{set_compute_threads, DType, Rng, Tensor};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

fn threads() -> usize {
    std::env::var("BRIGADE_THREADS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2)
}

fn bench(c: &mut Criterion) {
    set_compute_threads(threads());
    let mut rng = Rng::new(0);
    let mut g = c.benchmark_group(format!("matmul_f32_t{}", threads()));
    g.sample_size(10);
    // (name, m, k, n): x[m,k] @ w^T[k,n] as the models run them
    let mut shapes: Vec<(String, usize, usize, usize)> = [512, 1024, 2048]
        .iter()
        .map(|&s| (format!("square{s}"), s, s, s))
        .collect();
    shapes.push(("mlp_fc1_b64".into(), 64, 512, 2048));
    shapes.push(("mlp_fc2_b64".into(), 64, 2048, 2048));
    shapes.push(("gpt_qkv_b16".into(), 16 * 128, 256, 768));
    shapes.push(("gpt_mlp_fc_b16".into(), 16 * 128, 256, 1024));
    shapes.push(("gpt_head_b16".into(), 16 * 128, 256, 256));
    for (name, m, k, n) in shapes {
        let a = Tensor::randn(&[m, k], 1.0, DType::F32, &mut rng);
        // weights are [out, in]: multiply by the transposed view, as Linear does
        let w = Tensor::randn(&[n, k], 1.0, DType::F32, &mut rng);
        let wt = w.t().unwrap();
        g.throughput(Throughput::Elements((2 * m * n * k) as u64));
        g.bench_with_input(BenchmarkId::new(name, format!("{m}x{k}x{n}")), &(), |b, _| {
            b.iter(|| a.matmul(&wt).unwrap())
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
