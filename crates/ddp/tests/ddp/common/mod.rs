//! A small MLP and data for the DDP tests.

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
                // the unit a parameter-sharding policy gathers: the scope `loss` runs it under
                for p in ["weight", "bias"] {
                    store
                        .set_unit(&format!("layers.{i}.{p}"), &format!("layers.{i}"))
                        .unwrap();
                }
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

/// The averaging all-reduce, as a test-local policy (the built-in ones live in
/// `brigade-policies`, which depends on this crate): what DDP did before policies.
pub struct Average;

impl brigade_ddp::ReducerPolicy for Average {
    fn name(&self) -> String {
        "average".into()
    }

    fn reduce(
        &mut self,
        bucket: brigade_ddp::policy::PolicyBucket,
        comm: &brigade_ddp::Group,
    ) -> brigade_ddp::Result<brigade_ddp::policy::Reduction> {
        Ok(brigade_ddp::policy::Reduction::Full(comm.all_reduce(
            &bucket.tensor,
            brigade_comm::ReduceOp::Avg,
            &bucket.tag(),
        )))
    }

    fn wire_model(&self, _shapes: &[Vec<usize>], _world_size: usize) -> Option<brigade_ddp::policy::WireModel> {
        Some(brigade_ddp::policy::WireModel::AllReduce { bytes_per_element: 4.0 })
    }
}

/// One rank's [`Average`] policy.
pub fn average() -> Box<dyn brigade_ddp::ReducerPolicy> {
    Box::new(Average)
}
