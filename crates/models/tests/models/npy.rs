//! NumPy `.npy`/`.npz` data: every supported dtype round-trips, files NumPy wrote
//! read as NumPy reads them, and a wrong dtype or shape is one error line.

use std::path::{Path, PathBuf};

use brigade_models::{
    load_npy, load_npz, save_npy, save_npz, BatchSchema, Dataset, GptConfig, MlpConfig, ModelError, ModelKind,
};
use brigade_tensor::{DType, Tensor};

use crate::common::Scratch;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

fn tmp(name: &str) -> Scratch {
    Scratch::file(&format!("npy-{name}"))
}

/// Little-endian bytes of every element: equal bytes mean a bit-exact round trip (NaN too).
fn bits(t: &Tensor) -> Vec<u8> {
    match t.dtype() {
        DType::F32 => t
            .to_vec::<f32>()
            .unwrap()
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        DType::F64 => t
            .to_vec::<f64>()
            .unwrap()
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        DType::F16 => t
            .to_vec::<half::f16>()
            .unwrap()
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        DType::BF16 => t
            .to_vec::<half::bf16>()
            .unwrap()
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        DType::I64 => t
            .to_vec::<i64>()
            .unwrap()
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        DType::U8 => t.to_vec::<u8>().unwrap(),
        DType::I8 => t.to_vec::<i8>().unwrap().iter().map(|&v| v as u8).collect(),
    }
}

/// One tensor of each dtype NumPy has, with awkward values (NaN, infinities, subnormals,
/// extremes) and shapes (a scalar, an empty dimension, rank 3).
fn every_dtype() -> Vec<(String, Tensor)> {
    let f = |v: Vec<f64>, shape: &[usize], d: DType| Tensor::from_f64_vec(v, shape, d);
    let awkward = vec![f64::NAN, f64::INFINITY, -0.0, 1e-310, -3.5, 7.0];
    vec![
        ("f32".into(), f(awkward.clone(), &[2, 3], DType::F32)),
        ("f64".into(), f(awkward.clone(), &[3, 1, 2], DType::F64)),
        ("f16".into(), f(awkward, &[6], DType::F16)),
        (
            "i64".into(),
            Tensor::from_vec(vec![i64::MIN, -1, 0, i64::MAX], &[2, 2]).unwrap(),
        ),
        ("u8".into(), Tensor::from_vec(vec![0u8, 1, 254, 255], &[4]).unwrap()),
        ("scalar".into(), Tensor::from_vec(vec![2.5f64], &[]).unwrap()),
        ("empty".into(), Tensor::from_vec(Vec::<f32>::new(), &[0, 3]).unwrap()),
    ]
}

#[test]
fn every_supported_dtype_round_trips_through_npy_and_npz() {
    let tensors = every_dtype();
    for (name, t) in &tensors {
        let path = tmp(&format!("{name}.npy"));
        save_npy(&path, t).unwrap();
        let back = load_npy(&path).unwrap();
        assert_eq!((back.dtype(), back.shape()), (t.dtype(), t.shape()), "{name}");
        assert_eq!(bits(&back), bits(t), "{name}");
    }
    let path = tmp("all.npz");
    save_npz(&path, &tensors).unwrap();
    let back = load_npz(&path).unwrap();
    assert_eq!(back.len(), tensors.len());
    for ((n, t), (m, u)) in tensors.iter().zip(&back) {
        assert_eq!(n, m, "archive order is file order");
        assert_eq!((u.dtype(), u.shape(), bits(u)), (t.dtype(), t.shape(), bits(t)), "{n}");
    }
}

#[test]
fn bf16_has_no_numpy_dtype_and_names_must_be_unique() {
    let t = Tensor::from_f64_vec(vec![1.0, 2.0], &[2], DType::BF16);
    let e = save_npy(tmp("bf16.npy"), &t).unwrap_err();
    assert!(
        matches!(e, ModelError::Npy { .. }) && e.to_string().contains("BF16 has no NumPy dtype"),
        "{e}"
    );
    let npz = tmp("bf16.npz");
    let e = save_npz(&npz, &[("w".into(), t)]).unwrap_err().to_string();
    assert!(e.contains("array 'w'") && e.contains("BF16"), "{e}");
    assert!(!npz.exists(), "nothing written on error");
    let x = Tensor::zeros(&[1], DType::F32);
    let e = save_npz(tmp("twice.npz"), &[("x".into(), x.clone()), ("x".into(), x)]).unwrap_err();
    assert!(e.to_string().contains("appears twice"), "{e}");
}

#[test]
fn files_numpy_wrote_read_as_numpy_reads_them() {
    // tests/fixtures/make_numpy_fixtures.py wrote these with numpy 2.4 (savez, savez_compressed)
    let got = load_npz(fixture("numpy_dtypes.npz")).unwrap();
    let get = |name: &str| &got.iter().find(|(n, _)| n == name).unwrap().1;
    let f16 = get("f16");
    assert_eq!((f16.dtype(), f16.shape()), (DType::F16, &[2, 2][..]));
    assert_eq!(f16.to_f64_vec().unwrap(), [0.5, -2.0, 65504.0, 0.0]);
    assert_eq!(get("f32").to_vec::<f32>().unwrap(), [0.0, 0.25, 0.5, 0.75, 1.0, 1.25]);
    assert_eq!(get("f64").to_vec::<f64>().unwrap(), [1e300, -1e-300, 3.25]);
    // the narrower integers widen to I64 without loss, uint8 stays U8, bool becomes U8
    assert_eq!(get("i8").to_vec::<i64>().unwrap(), [-128, 127]);
    assert_eq!(get("i16").to_vec::<i64>().unwrap(), [-32768, 32767]);
    let i32s = get("i32");
    assert_eq!((i32s.dtype(), i32s.shape()), (DType::I64, &[2, 1][..]));
    assert_eq!(i32s.to_vec::<i64>().unwrap(), [-7, (1 << 31) - 1]);
    assert_eq!(get("i64").to_vec::<i64>().unwrap(), [i64::MIN, i64::MAX]);
    assert_eq!(get("u8").to_vec::<u8>().unwrap(), [0, 255]);
    assert_eq!(get("u16").to_vec::<i64>().unwrap(), [65535]);
    assert_eq!(get("u32").to_vec::<i64>().unwrap(), [(1 << 32) - 1]);
    assert_eq!(get("u64").to_vec::<i64>().unwrap(), [i64::MAX]);
    assert_eq!(get("b").to_vec::<u8>().unwrap(), [1, 0, 1]);

    // savez_compressed (deflate) opens as a dataset for the MLP
    let mlp = ModelKind::Mlp(MlpConfig::new(vec![3, 8, 2]));
    let d = Dataset::open(fixture("numpy_compressed.npz"), &mlp).unwrap();
    let b = d.batch(3, 2).unwrap();
    assert_eq!(
        b.get("inputs").unwrap().to_vec::<f32>().unwrap(),
        [9.0, 10.0, 11.0, 0.0, 1.0, 2.0]
    );
    assert_eq!(b.get("targets").unwrap().to_vec::<i64>().unwrap(), [0, 0]);

    // big-endian and Fortran-ordered: [[0, 1, 2], [3, 4, 5]] in its logical order
    let t = load_npy(fixture("numpy_fortran_be.npy")).unwrap();
    assert_eq!((t.dtype(), t.shape()), (DType::F64, &[2, 3][..]));
    assert_eq!(t.to_vec::<f64>().unwrap(), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
}

fn one_line(e: ModelError) -> String {
    let s = e.to_string();
    assert!(!s.contains('\n'), "{s}");
    s
}

#[test]
fn a_wrong_dtype_or_shape_in_a_numpy_file_is_one_error_line() {
    let mlp = ModelKind::Mlp(MlpConfig::new(vec![3, 8, 2]));
    let inputs = Tensor::from_vec((0..12).map(|x| x as f32).collect(), &[4, 3]).unwrap();
    let path = tmp("f32-targets.npz");
    save_npz(
        &path,
        &[
            ("inputs".into(), inputs.clone()),
            ("targets".into(), Tensor::zeros(&[4], DType::F32)),
        ],
    )
    .unwrap();
    let e = one_line(Dataset::open(&path, &mlp).unwrap_err());
    assert!(
        e.contains("f32-targets.npz")
            && e.contains("tensor 'targets': expected I64 [4]")
            && e.contains("found F32 [4]"),
        "{e}"
    );
    save_npz(
        &path,
        &[
            ("inputs".into(), inputs.reshape(&[3, 4]).unwrap()),
            ("targets".into(), Tensor::zeros(&[3], DType::I64)),
        ],
    )
    .unwrap();
    let e = one_line(Dataset::from_npz(&path, &mlp).unwrap_err());
    assert!(
        e.contains("tensor 'inputs': expected F32 [N, 3], found F32 [3, 4]"),
        "{e}"
    );

    // a .npy of token rows feeds the GPT; the wrong width, or several tensors, is one line
    let gpt = ModelKind::Gpt(GptConfig {
        context: 4,
        vocab: 256,
        ..GptConfig::default()
    });
    let rows = tmp("tokens.npy");
    save_npy(&rows, &Tensor::from_vec((0..10u8).collect(), &[2, 5]).unwrap()).unwrap();
    let d = Dataset::open(&rows, &gpt).unwrap();
    assert_eq!(
        d.batch(1, 1).unwrap().get("tokens").unwrap().to_vec::<u8>().unwrap(),
        [5, 6, 7, 8, 9]
    );
    save_npy(&rows, &Tensor::from_vec((0..10u8).collect(), &[5, 2]).unwrap()).unwrap();
    let e = one_line(Dataset::open(&rows, &gpt).unwrap_err());
    assert!(
        e.contains("tensor 'tokens': expected I64 or U8 [N, 5], found U8 [5, 2]"),
        "{e}"
    );
    let e = one_line(Dataset::open(&rows, &mlp).unwrap_err());
    assert!(e.contains("a .npy file holds one array") && e.contains(".npz"), "{e}");
    let e = one_line(Dataset::open(tmp("data.csv"), BatchSchema::tokens(4, 256)).unwrap_err());
    assert!(e.contains("unknown data format"), "{e}");
}

#[test]
fn damaged_or_foreign_files_are_one_error_line() {
    let good = tmp("good.npy");
    save_npy(&good, &Tensor::zeros(&[64], DType::F64)).unwrap();
    let bytes = std::fs::read(&good).unwrap();
    let cut = tmp("cut.npy");
    std::fs::write(&cut, &bytes[..bytes.len() - 8]).unwrap();
    let e = load_npy(&cut).unwrap_err();
    assert!(matches!(e, ModelError::Npy { .. }), "{e:?}");
    assert!(one_line(e).contains("cut.npy"));
    let junk = tmp("junk.npz");
    std::fs::write(&junk, b"not a zip archive at all").unwrap();
    let e = one_line(load_npz(&junk).unwrap_err());
    assert!(e.contains("junk.npz") && e.contains("not a .npz"), "{e}");
    let e = one_line(load_npy(tmp("absent.npy")).unwrap_err());
    assert!(e.contains("absent.npy") && e.contains("cannot read"), "{e}");
    // a header whose shape overflows 2^64 elements, or holds far more than the file: one line,
    // before anything multiplies the dimensions or sizes a buffer by them
    for (name, shape) in [
        ("overflow.npy", "(4611686018427387904, 4611686018427387904)"),
        ("lying.npy", "(1099511627776,)"),
    ] {
        let dict = format!("{{'descr': '<i8', 'fortran_order': False, 'shape': {shape}, }}");
        let mut header = dict.into_bytes();
        while (10 + header.len() + 1) % 64 != 0 {
            header.push(b' ');
        }
        header.push(b'\n');
        let mut file = b"\x93NUMPY\x01\x00".to_vec();
        file.extend((header.len() as u16).to_le_bytes());
        file.extend(header);
        file.extend([0u8; 64]);
        let path = tmp(name);
        std::fs::write(&path, file).unwrap();
        let e = one_line(load_npy(&path).unwrap_err());
        assert!(
            e.contains(name) && e.contains("holds more elements than the file"),
            "{e}"
        );
    }
}
