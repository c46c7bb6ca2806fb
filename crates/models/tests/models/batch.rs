//! The open batch: named tensors of any dtype and shape, a model's declaration of
//! them, checked when data is opened; `classify` and `tokens` as ready-made declarations.

use brigade_models::{
    save_safetensors, Batch, BatchSchema, Dataset, GptConfig, Mlp, MlpConfig, Model, ModelError, ModelKind, TensorSpec,
};
use brigade_tensor::{DType, Tensor};

fn named(v: Vec<(&str, Tensor)>) -> Vec<(String, Tensor)> {
    v.into_iter().map(|(n, t)| (n.to_string(), t)).collect()
}

/// A regression model's declaration: 3 F32 inputs and 2 F32 targets per row.
fn regression() -> BatchSchema {
    BatchSchema::new(vec![
        TensorSpec::new("inputs", DType::F32, &[3]),
        TensorSpec::new("targets", DType::F32, &[2]),
    ])
}

fn tmp(name: &str) -> crate::common::Scratch {
    crate::common::Scratch::file(&format!("batch-{name}"))
}

#[test]
fn a_regression_target_of_the_wrong_dtype_is_one_error_line_naming_the_tensor() {
    // The case: the right shape in the wrong dtype (I64 where the model declares F32
    // regression targets), then the wrong shape too.
    let inputs = Tensor::from_vec((0..12).map(|x| x as f32).collect(), &[4, 3]).unwrap();
    let path = tmp("regression.safetensors");
    for (targets, found) in [
        (
            Tensor::from_vec((0..8i64).collect(), &[4, 2]).unwrap(),
            "found I64 [4, 2]",
        ),
        (Tensor::from_vec(vec![0i64, 1, 2, 3], &[4]).unwrap(), "found I64 [4]"),
    ] {
        save_safetensors(
            &path,
            &named(vec![("inputs", inputs.clone()), ("targets", targets)]),
            None,
        )
        .unwrap();
        let e = Dataset::from_safetensors(&path, regression()).unwrap_err();
        assert!(matches!(e, ModelError::Data { .. }), "{e:?}");
        let msg = e.to_string();
        assert!(
            msg.contains("tensor 'targets': expected F32 [4, 2]") && msg.contains(found),
            "{msg}"
        );
        assert!(!msg.contains('\n') && msg.contains("regression.safetensors"), "{msg}");
    }

    // The right file opens, and its batches carry the declared names, dtypes and shapes.
    let targets = Tensor::from_vec((0..8).map(|x| x as f32 / 8.0).collect(), &[4, 2]).unwrap();
    save_safetensors(
        &path,
        &named(vec![
            ("extra", Tensor::zeros(&[7], DType::U8)),
            ("targets", targets),
            ("inputs", inputs),
        ]),
        None,
    )
    .unwrap();
    let d = Dataset::from_safetensors(&path, regression()).unwrap();
    assert_eq!(
        d.schema(),
        regression(),
        "declared order, the undeclared 'extra' ignored"
    );
    let b = d.batch(3, 2).unwrap();
    assert_eq!(b.names(), ["inputs", "targets"]);
    assert_eq!(b.get("targets").unwrap().shape(), [2, 2]);
    assert_eq!(
        b.get("targets").unwrap().to_vec::<f32>().unwrap(),
        [0.75, 0.875, 0.0, 0.125]
    );
    regression().check_batch(&b).unwrap();
}

#[test]
fn batches_of_any_names_dtypes_and_shapes() {
    let b = Batch::new(named(vec![
        ("image", Tensor::zeros(&[2, 3, 4, 4], DType::F16)),
        ("mask", Tensor::zeros(&[2, 4, 4], DType::U8)),
        ("score", Tensor::zeros(&[2], DType::F64)),
    ]))
    .unwrap();
    assert_eq!(b.rows(), 2);
    assert_eq!(b.get("mask").unwrap().dtype(), DType::U8);
    assert!(b.get("label").is_none());
    let e = b.tensor("mine", "label").unwrap_err();
    assert!(matches!(e, ModelError::WrongBatch { model: "mine", .. }), "{e}");
    assert!(
        e.to_string().contains("'label'") && e.to_string().contains("\"image\""),
        "{e}"
    );

    // every tensor has one row per example; names are unique; at least one tensor
    let rows = Batch::new(named(vec![
        ("a", Tensor::zeros(&[2, 3], DType::F32)),
        ("b", Tensor::zeros(&[3], DType::F32)),
    ]));
    assert!(rows.unwrap_err().to_string().contains("'b'"));
    let twice = Batch::new(named(vec![
        ("a", Tensor::zeros(&[2], DType::F32)),
        ("a", Tensor::zeros(&[2], DType::F32)),
    ]));
    assert!(twice.unwrap_err().to_string().contains("twice"));
    assert!(Batch::new(vec![]).is_err());
    let scalar = Batch::new(named(vec![("s", Tensor::scalar(1.0, DType::F32))]));
    assert!(scalar.is_err());

    // moving every tensor keeps names and order
    let moved = b.try_map(|_, t| t.to_dtype(DType::F32)).unwrap();
    assert_eq!(moved.names(), ["image", "mask", "score"]);
    assert!(moved.tensors().iter().all(|(_, t)| t.dtype() == DType::F32));
}

#[test]
fn the_ready_made_declarations_are_the_built_in_models() {
    assert_eq!(
        BatchSchema::classify(5, 3).to_string(),
        "inputs: F32 [N, 5], targets: I64 [N] (label < 3)"
    );
    assert_eq!(
        BatchSchema::tokens(4, 256).to_string(),
        "tokens: I64 or U8 [N, 5] (token < 256)"
    );
    let mlp = Mlp::new(MlpConfig::new(vec![5, 8, 3]), 0).unwrap();
    assert_eq!(mlp.batch_schema(), Some(BatchSchema::classify(5, 3)));
    let gpt = ModelKind::Gpt(GptConfig {
        context: 4,
        vocab: 50,
        ..GptConfig::default()
    });
    assert_eq!(BatchSchema::from(&gpt), BatchSchema::tokens(4, 50));
    assert_eq!(gpt.build(0).unwrap().batch_schema(), Some(BatchSchema::tokens(4, 50)));

    // the built-in data fits its model; the wrong model is one error line
    let teacher = Dataset::teacher(16, 5, 3, 0).unwrap();
    teacher.check(&BatchSchema::classify(5, 3)).unwrap();
    let e = teacher.check(&BatchSchema::classify(6, 3)).unwrap_err().to_string();
    assert!(
        e.contains("tensor 'inputs': expected F32 [N, 6], found F32 [N, 5]"),
        "{e}"
    );
    let e = teacher.check(&BatchSchema::tokens(4, 256)).unwrap_err().to_string();
    assert!(e.contains("missing tensor 'tokens'"), "{e}");
    let text = Dataset::builtin_text(4, 0).unwrap();
    text.check(&BatchSchema::tokens(4, 256)).unwrap();
    // bytes of the built-in corpus are ASCII letters: a vocabulary of 100 cannot hold them
    let e = text.check(&BatchSchema::tokens(4, 100)).unwrap_err().to_string();
    assert!(e.contains("has token") && e.contains("expected 0..100"), "{e}");
}

#[test]
fn in_memory_data_of_a_users_own_declaration() {
    let x = Tensor::from_vec((0..10).map(|v| v as f64).collect(), &[5, 2]).unwrap();
    let y = Tensor::from_vec(vec![1u8, 0, 1, 1, 0], &[5]).unwrap();
    let d = Dataset::from_tensors("mine", &named(vec![("x", x), ("flag", y)])).unwrap();
    assert_eq!(d.len(), 5);
    let b = d.gather(&[4, 0, 4]).unwrap();
    assert_eq!(
        b.get("x").unwrap().to_vec::<f64>().unwrap(),
        [8.0, 9.0, 0.0, 1.0, 8.0, 9.0]
    );
    assert_eq!(b.get("flag").unwrap().to_vec::<u8>().unwrap(), [0, 1, 0]);
    assert!(d
        .gather(&[5])
        .unwrap_err()
        .to_string()
        .contains("row 5 is out of range"));
    let nan = Tensor::from_vec(vec![1.0f32, f32::NAN], &[2]).unwrap();
    let e = Dataset::from_tensors("bad", &named(vec![("x", nan)])).unwrap_err();
    assert!(e.to_string().contains("NaN") && e.to_string().contains("'x'"), "{e}");
}

/// FNV-1a as the earlier `Dataset::fingerprint` computed it (the format checkpoints hold).
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &b in *part {
            h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    h
}

#[test]
fn fingerprints_of_classification_and_token_data_are_those_earlier_checkpoints_hold() {
    // classification: in_dim, then the inputs' f32 bits, then the i64 labels, little-endian
    let d = Dataset::teacher(6, 3, 2, 9).unwrap();
    let b = d.batch(0, 6).unwrap();
    let x: Vec<u8> = b
        .get("inputs")
        .unwrap()
        .to_vec::<f32>()
        .unwrap()
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let y: Vec<u8> = b
        .get("targets")
        .unwrap()
        .to_vec::<i64>()
        .unwrap()
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let want = fnv1a(&[&3u64.to_le_bytes(), &x, &y]);
    assert_eq!(d.fingerprint(), format!("6 rows, fnv1a {want:016x}"));
    // text: row length, stride, rows, then the bytes
    let bytes: Vec<u8> = (0..=40).collect();
    let d = Dataset::text(bytes.clone(), 8).unwrap();
    let want = fnv1a(&[&9u64.to_le_bytes(), &4u64.to_le_bytes(), &9u64.to_le_bytes(), &bytes]);
    assert_eq!(d.fingerprint(), format!("9 rows, fnv1a {want:016x}"));
    // other data hashes its names too: the same values under other names differ
    let v = Tensor::from_vec(vec![1.0f32, 2.0], &[2]).unwrap();
    let a = Dataset::from_tensors("a", &named(vec![("a", v.clone())])).unwrap();
    let b = Dataset::from_tensors("b", &named(vec![("b", v)])).unwrap();
    assert_ne!(a.fingerprint(), b.fingerprint());
}
