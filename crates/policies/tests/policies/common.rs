//! A small MLP, data, and a fingerprint of training results for the policy tests.

#![allow(dead_code)]

use brigade_autograd::{scope, ParamStore, Var};
use brigade_tensor::{DType, Rng, Tensor};

/// An MLP whose layer `i` is recorded under scope `layers.{i}`.
pub struct Mlp {
    pub store: ParamStore,
    pub layers: Vec<(Var, Var)>,
}

impl Mlp {
    pub fn new(widths: &[usize], seed: u64) -> Mlp {
        let mut rng = Rng::new(seed);
        let mut store = ParamStore::new();
        let layers = widths
            .windows(2)
            .enumerate()
            .map(|(i, w)| {
                let s = 1.0 / (w[0] as f64).sqrt();
                let weight = store
                    .add(
                        format!("layers.{i}.weight"),
                        Tensor::rand_uniform(&[w[1], w[0]], -s, s, DType::F32, &mut rng),
                    )
                    .unwrap();
                let bias = store
                    .add(
                        format!("layers.{i}.bias"),
                        Tensor::rand_uniform(&[w[1]], -s, s, DType::F32, &mut rng),
                    )
                    .unwrap();
                (weight, bias)
            })
            .collect();
        Mlp { store, layers }
    }

    pub fn loss(&self, x: &Tensor, y: &Tensor) -> Var {
        let mut h = Var::constant(x.clone());
        for (i, (w, b)) in self.layers.iter().enumerate() {
            h = scope(&format!("layers.{i}"), || {
                let z = h.linear(w, Some(b))?;
                if i + 1 < self.layers.len() {
                    z.relu()
                } else {
                    Ok(z)
                }
            })
            .unwrap();
        }
        h.cross_entropy(y).unwrap()
    }

    pub fn values(&self) -> Vec<Vec<f32>> {
        self.store
            .params()
            .iter()
            .map(|p| p.value().to_vec::<f32>().unwrap())
            .collect()
    }
}

/// `n` rows of inputs `[n, d]` and labels in `0..c`.
pub fn data(n: usize, d: usize, c: usize, seed: u64) -> (Tensor, Tensor) {
    let mut rng = Rng::new(seed);
    let x = Tensor::randn(&[n, d], 1.0, DType::F32, &mut rng);
    let y: Vec<i64> = (0..n).map(|_| rng.below(c as u64) as i64).collect();
    (x, Tensor::from_vec(y, &[n]).unwrap())
}

/// Rows `start..start+len` of `(x, y)`.
pub fn rows(x: &Tensor, y: &Tensor, start: usize, len: usize) -> (Tensor, Tensor) {
    (
        x.narrow(0, start, len).unwrap().contiguous().unwrap(),
        y.narrow(0, start, len).unwrap().contiguous().unwrap(),
    )
}

pub fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (p - q).abs()))
        .fold(0.0, f32::max)
}

/// FNV-1a over the bytes: a fingerprint of exact bit patterns.
pub fn fnv(bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes.into_iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The fingerprint of losses (their f64 bits).
pub fn fnv_losses(losses: &[f64]) -> u64 {
    fnv(losses.iter().flat_map(|l| l.to_bits().to_le_bytes()))
}

/// The fingerprint of parameters (their f32 bits, in registration order).
pub fn fnv_params(params: &[Vec<f32>]) -> u64 {
    fnv(params.iter().flatten().flat_map(|x| x.to_bits().to_le_bytes()))
}
