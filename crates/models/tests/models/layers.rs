//! The `nn` layers: PyTorch names under a prefix, and f64 finite-difference gradients with
//! respect to the input and every parameter.

use brigade_autograd::{gradcheck, ParamStore, Var};
use brigade_models::nn::{
    Activation, CausalSelfAttention, Dropout, Embedding, Init, LayerNorm, Linear, MlpBlock, Params, TransformerBlock,
};
use brigade_tensor::{DType, Rng, Tensor};

fn names(store: &ParamStore) -> Vec<(String, Vec<usize>)> {
    store
        .params()
        .iter()
        .map(|p| (p.name().unwrap().to_string(), p.shape()))
        .collect()
}

#[test]
fn layers_register_pytorch_names_under_their_prefix_in_order() {
    let (mut store, mut rng) = (ParamStore::new(), Rng::new(0));
    let mut p = Params::new(&mut store, &mut rng, DType::F32);
    let mut blk = p.sub("blocks.3");
    LayerNorm::new(&mut blk.sub("ln1"), 8, 1e-5).unwrap();
    CausalSelfAttention::new(&mut blk.sub("attn"), 8, 2, Init::Normal { std: 0.02 }).unwrap();
    MlpBlock::new(&mut blk.sub("mlp"), 8, 16, Activation::Gelu, Init::Normal { std: 0.02 }).unwrap();
    Embedding::new(&mut p.sub("tok_emb"), 10, 8, 0.02).unwrap();
    Linear::new(&mut p.sub("head"), 8, 10, false, Init::TorchLinear).unwrap();
    let want: Vec<(&str, Vec<usize>)> = vec![
        ("blocks.3.ln1.weight", vec![8]),
        ("blocks.3.ln1.bias", vec![8]),
        ("blocks.3.attn.qkv.weight", vec![24, 8]),
        ("blocks.3.attn.qkv.bias", vec![24]),
        ("blocks.3.attn.proj.weight", vec![8, 8]),
        ("blocks.3.attn.proj.bias", vec![8]),
        ("blocks.3.mlp.fc.weight", vec![16, 8]),
        ("blocks.3.mlp.fc.bias", vec![16]),
        ("blocks.3.mlp.proj.weight", vec![8, 16]),
        ("blocks.3.mlp.proj.bias", vec![8]),
        ("tok_emb.weight", vec![10, 8]),
        ("head.weight", vec![10, 8]),
    ];
    let got = names(&store);
    assert_eq!(
        got.iter().map(|(n, s)| (n.as_str(), s.clone())).collect::<Vec<_>>(),
        want
    );
}

#[test]
fn initialisation_follows_pytorch_and_gpt2() {
    let (mut store, mut rng) = (ParamStore::new(), Rng::new(1));
    let mut p = Params::new(&mut store, &mut rng, DType::F64);
    let torch = Linear::new(&mut p.sub("a"), 100, 50, true, Init::TorchLinear).unwrap();
    let gpt = Linear::new(&mut p.sub("b"), 100, 50, true, Init::Normal { std: 0.02 }).unwrap();
    let ln = LayerNorm::new(&mut p.sub("ln"), 5, 1e-5).unwrap();
    let bound = 0.1; // 1/sqrt(100)
    for v in [&torch.weight, torch.bias.as_ref().unwrap()] {
        let x = v.value().to_f64_vec().unwrap();
        assert!(x.iter().all(|x| x.abs() <= bound) && x.iter().any(|x| x.abs() > 0.9 * bound));
    }
    let w = gpt.weight.value().to_f64_vec().unwrap();
    let std = (w.iter().map(|x| x * x).sum::<f64>() / w.len() as f64).sqrt();
    assert!((std - 0.02).abs() < 0.002, "std {std}");
    assert!(gpt
        .bias
        .unwrap()
        .value()
        .to_f64_vec()
        .unwrap()
        .iter()
        .all(|&b| b == 0.0));
    assert!(ln.weight.value().to_f64_vec().unwrap().iter().all(|&g| g == 1.0));
}

fn rand(shape: &[usize], seed: u64) -> Tensor {
    Tensor::randn(shape, 0.5, DType::F64, &mut Rng::new(seed))
}

fn check(f: impl Fn(&[Var]) -> brigade_autograd::Result<Var>, inputs: &[Tensor]) {
    gradcheck(f, inputs, 1e-6, 1e-6).unwrap();
}

fn linear(w: &Var, b: &Var) -> Linear {
    Linear {
        weight: w.clone(),
        bias: Some(b.clone()),
    }
}

fn model_err(e: brigade_models::ModelError) -> brigade_autograd::AutogradError {
    brigade_autograd::AutogradError::Invalid(e.to_string())
}

#[test]
fn linear_gradients_match_finite_differences() {
    check(
        |v| linear(&v[1], &v[2]).forward(&v[0]).map_err(model_err),
        &[rand(&[2, 3, 4], 1), rand(&[5, 4], 2), rand(&[5], 3)],
    );
}

#[test]
fn layer_norm_gradients_match_finite_differences() {
    check(
        |v| {
            LayerNorm {
                weight: v[1].clone(),
                bias: v[2].clone(),
                eps: 1e-5,
            }
            .forward(&v[0])
            .map_err(model_err)
        },
        &[rand(&[3, 6], 4), rand(&[6], 5), rand(&[6], 6)],
    );
}

#[test]
fn embedding_gradients_match_finite_differences() {
    let ids = Tensor::from_vec(vec![2i64, 0, 2, 3], &[2, 2]).unwrap();
    check(
        |v| Embedding { weight: v[0].clone() }.forward(&ids).map_err(model_err),
        &[rand(&[4, 3], 7)],
    );
}

#[test]
fn attention_gradients_match_finite_differences() {
    check(
        |v| {
            let attn = CausalSelfAttention {
                qkv: linear(&v[1], &v[2]),
                proj: linear(&v[3], &v[4]),
                n_heads: 2,
            };
            attn.forward(&v[0]).map_err(model_err)
        },
        &[
            rand(&[2, 3, 4], 8),
            rand(&[12, 4], 9),
            rand(&[12], 10),
            rand(&[4, 4], 11),
            rand(&[4], 12),
        ],
    );
}

#[test]
fn mlp_block_gradients_match_finite_differences() {
    for activation in [Activation::Gelu, Activation::Relu] {
        check(
            |v| {
                let mlp = MlpBlock {
                    fc: linear(&v[1], &v[2]),
                    proj: linear(&v[3], &v[4]),
                    activation,
                };
                mlp.forward(&v[0]).map_err(model_err)
            },
            &[
                rand(&[2, 4], 13),
                rand(&[6, 4], 14),
                rand(&[6], 15),
                rand(&[4, 6], 16),
                rand(&[4], 17),
            ],
        );
    }
}

#[test]
fn a_transformer_block_registers_gpt2_names_in_order() {
    let (mut store, mut rng) = (ParamStore::new(), Rng::new(0));
    let mut p = Params::new(&mut store, &mut rng, DType::F32);
    TransformerBlock::new(&mut p.sub("blocks.1"), 8, 2, 16, Init::Normal { std: 0.02 }).unwrap();
    let want: Vec<(&str, Vec<usize>)> = vec![
        ("blocks.1.ln1.weight", vec![8]),
        ("blocks.1.ln1.bias", vec![8]),
        ("blocks.1.attn.qkv.weight", vec![24, 8]),
        ("blocks.1.attn.qkv.bias", vec![24]),
        ("blocks.1.attn.proj.weight", vec![8, 8]),
        ("blocks.1.attn.proj.bias", vec![8]),
        ("blocks.1.ln2.weight", vec![8]),
        ("blocks.1.ln2.bias", vec![8]),
        ("blocks.1.mlp.fc.weight", vec![16, 8]),
        ("blocks.1.mlp.fc.bias", vec![16]),
        ("blocks.1.mlp.proj.weight", vec![8, 16]),
        ("blocks.1.mlp.proj.bias", vec![8]),
    ];
    let got = names(&store);
    let got: Vec<(&str, Vec<usize>)> = got.iter().map(|(n, s)| (n.as_str(), s.clone())).collect();
    assert_eq!(got, want);
}

#[test]
fn transformer_block_gradients_match_finite_differences() {
    // x [2, 3, 4]; ln1, attn (qkv, proj), ln2, mlp (fc, proj): both residual paths and every
    // parameter against central differences.
    check(
        |v| {
            let ln = |w: &Var, b: &Var| LayerNorm {
                weight: w.clone(),
                bias: b.clone(),
                eps: 1e-5,
            };
            let block = TransformerBlock {
                ln1: ln(&v[1], &v[2]),
                attn: CausalSelfAttention {
                    qkv: linear(&v[3], &v[4]),
                    proj: linear(&v[5], &v[6]),
                    n_heads: 2,
                },
                ln2: ln(&v[7], &v[8]),
                mlp: MlpBlock {
                    fc: linear(&v[9], &v[10]),
                    proj: linear(&v[11], &v[12]),
                    activation: Activation::Gelu,
                },
                attn_dropout: Dropout::off(),
                mlp_dropout: Dropout::off(),
            };
            block.forward(&v[0]).map_err(model_err)
        },
        &[
            rand(&[2, 3, 4], 20),
            rand(&[4], 21),
            rand(&[4], 22),
            rand(&[12, 4], 23),
            rand(&[12], 24),
            rand(&[4, 4], 25),
            rand(&[4], 26),
            rand(&[4], 27),
            rand(&[4], 28),
            rand(&[6, 4], 29),
            rand(&[6], 30),
            rand(&[4, 6], 31),
            rand(&[4], 32),
        ],
    );
}
