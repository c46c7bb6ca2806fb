//! Datasets: row addressing with wrap-around, the built-in data, and safetensors files
//! checked against the model they feed.

use brigade_models::{save_safetensors, Batch, Dataset, GptConfig, MlpConfig, ModelError, ModelKind};
use brigade_tensor::{DType, Tensor};

fn tokens(b: &Batch) -> Vec<u8> {
    b.get("tokens").expect("a tokens batch").to_vec::<u8>().unwrap()
}

/// The `inputs` and `targets` of a classification batch.
fn classify(b: Batch) -> (Tensor, Tensor) {
    (b.get("inputs").unwrap().clone(), b.get("targets").unwrap().clone())
}

#[test]
fn text_rows_overlap_by_half_and_batches_wrap_around() {
    let bytes: Vec<u8> = (0..=40).collect();
    let d = Dataset::text(bytes, 8).unwrap();
    // stride 4, rows of 9: starts 0, 4, .., 32
    assert_eq!(d.len(), 9);
    assert_eq!(tokens(&d.batch(1, 1).unwrap()), (4..13).collect::<Vec<u8>>());
    let wrapped = tokens(&d.batch(8, 2).unwrap());
    assert_eq!(&wrapped[..9], &(32..41).collect::<Vec<u8>>()[..]);
    assert_eq!(&wrapped[9..], &(0..9).collect::<Vec<u8>>()[..]);
    assert_eq!(tokens(&d.batch(9 * 3 + 1, 1).unwrap()), tokens(&d.batch(1, 1).unwrap()));
    assert!(d.batch(0, 0).is_err());
    assert!(Dataset::text(vec![1, 2, 3], 8).is_err());
}

#[test]
fn builtin_text_is_a_few_hundred_kib_of_deterministic_ascii() {
    let a = Dataset::builtin_text(128, 0).unwrap();
    let b = Dataset::builtin_text(128, 0).unwrap();
    assert!(a.len() > 3000, "{} rows", a.len());
    let (ra, rb) = (tokens(&a.batch(100, 4).unwrap()), tokens(&b.batch(100, 4).unwrap()));
    assert_eq!(ra, rb);
    assert_ne!(
        ra,
        tokens(&Dataset::builtin_text(128, 1).unwrap().batch(100, 4).unwrap())
    );
    assert!(ra.is_ascii() && ra.contains(&b' ') && ra.iter().any(u8::is_ascii_lowercase));
}

#[test]
fn teacher_labels_are_deterministic_and_use_every_class() {
    let d = Dataset::teacher(1000, 16, 5, 4).unwrap();
    assert_eq!(d.len(), 1000);
    let (inputs, targets) = classify(d.batch(0, 1000).unwrap());
    assert_eq!((inputs.shape(), inputs.dtype()), (&[1000, 16][..], DType::F32));
    let t = targets.to_vec::<i64>().unwrap();
    let mut counts = [0usize; 5];
    t.iter().for_each(|&c| counts[c as usize] += 1);
    assert!(counts.iter().all(|&c| c >= 20), "every class should appear: {counts:?}");
    let (_, again) = classify(Dataset::teacher(1000, 16, 5, 4).unwrap().batch(0, 1000).unwrap());
    assert_eq!(t, again.to_vec::<i64>().unwrap());
}

fn file(name: &str, tensors: Vec<(&str, Tensor)>) -> crate::common::Scratch {
    let path = crate::common::Scratch::file(&format!("data-{name}"));
    let tensors: Vec<(String, Tensor)> = tensors.into_iter().map(|(n, t)| (n.to_string(), t)).collect();
    save_safetensors(&path, &tensors, None).unwrap();
    path
}

fn data_error(path: &std::path::Path, kind: &ModelKind) -> String {
    let e = Dataset::from_safetensors(path, kind).unwrap_err();
    assert!(matches!(e, ModelError::Data { .. }), "{e}");
    e.to_string()
}

#[test]
fn safetensors_datasets_load_and_mismatches_name_the_tensor() {
    let mlp = ModelKind::Mlp(MlpConfig::new(vec![3, 8, 2]));
    let inputs = Tensor::from_vec((0..12).map(|x| x as f32).collect(), &[4, 3]).unwrap();
    let targets = Tensor::from_vec(vec![0i64, 1, 1, 0], &[4]).unwrap();
    let ok = file(
        "mlp.safetensors",
        vec![("inputs", inputs.clone()), ("targets", targets.clone())],
    );
    let d = Dataset::from_safetensors(&ok, &mlp).unwrap();
    let (x, y) = classify(d.batch(3, 2).unwrap());
    assert_eq!(x.to_vec::<f32>().unwrap(), [9.0, 10.0, 11.0, 0.0, 1.0, 2.0]);
    assert_eq!(y.to_vec::<i64>().unwrap(), [0, 0]);

    let e = data_error(&file("no-targets.safetensors", vec![("inputs", inputs.clone())]), &mlp);
    assert!(e.contains("missing tensor 'targets'"), "{e}");
    let short = Tensor::from_vec(vec![0i64, 1, 1], &[3]).unwrap();
    let e = data_error(
        &file(
            "short.safetensors",
            vec![("inputs", inputs.clone()), ("targets", short)],
        ),
        &mlp,
    );
    assert!(
        e.contains("'targets'") && e.contains("expected I64 [4]") && e.contains("[3]"),
        "{e}"
    );
    let wide = ModelKind::Mlp(MlpConfig::new(vec![5, 2]));
    let e = data_error(&ok, &wide);
    assert!(
        e.contains("'inputs'") && e.contains("expected F32 [N, 5]") && e.contains("[4, 3]"),
        "{e}"
    );
    let bad_label = Tensor::from_vec(vec![0i64, 1, 2, 0], &[4]).unwrap();
    let e = data_error(
        &file("label.safetensors", vec![("inputs", inputs), ("targets", bad_label)]),
        &mlp,
    );
    assert!(e.contains("row 2 has label 2"), "{e}");

    let gpt = ModelKind::Gpt(GptConfig {
        context: 4,
        vocab: 50,
        ..GptConfig::default()
    });
    let toks = Tensor::from_vec((0..10u8).collect(), &[2, 5]).unwrap();
    let d = Dataset::from_safetensors(file("gpt.safetensors", vec![("tokens", toks.clone())]), &gpt).unwrap();
    assert_eq!(d.len(), 2);
    assert_eq!(tokens(&d.batch(1, 1).unwrap()), [5, 6, 7, 8, 9]);
    let e = data_error(
        &file("ctx.safetensors", vec![("tokens", toks.reshape(&[5, 2]).unwrap())]),
        &gpt,
    );
    assert!(
        e.contains("'tokens'") && e.contains("[N, 5]") && e.contains("[5, 2]"),
        "{e}"
    );
    let big = Tensor::from_vec(vec![1i64, 2, 3, 4, 50], &[1, 5]).unwrap();
    let e = data_error(&file("vocab.safetensors", vec![("tokens", big)]), &gpt);
    assert!(e.contains("token 50") && e.contains("0..50"), "{e}");
}
