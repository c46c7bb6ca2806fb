//! Text in: a byte-level dataset from any UTF-8 file, with a validation split;
//! one clear error line for an empty, too short or non-UTF-8 file.

use brigade_models::{Batch, Dataset, ModelError, Tokenizer, ValSplit};

use crate::common::Scratch;

fn file(name: &str, bytes: &[u8]) -> Scratch {
    let path = Scratch::file(&format!("text-{name}"));
    std::fs::write(&path, bytes).unwrap();
    path
}

fn rows(d: &Dataset) -> Vec<Vec<u8>> {
    let b: Batch = d.batch(0, d.len()).unwrap();
    let t = b.get("tokens").unwrap();
    let w = t.shape()[1];
    t.to_vec::<u8>().unwrap().chunks(w).map(<[u8]>::to_vec).collect()
}

fn one_line(e: ModelError) -> String {
    let s = e.to_string();
    assert!(!s.contains('\n'), "{s}");
    s
}

#[test]
fn a_utf8_file_becomes_rows_of_context_plus_one_bytes() {
    let text = "héllo wörld, ünïcode ☃ text!\n".repeat(3);
    let path = file("plain.txt", text.as_bytes());
    let data = Dataset::from_text_file(&path, 8, &ValSplit::None, Tokenizer::Bytes).unwrap();
    assert!(data.val.is_none());
    let train = rows(&data.train);
    // stride context / 2 = 4: row r is bytes[4r .. 4r + 9]
    assert_eq!(train.len(), (text.len() - 9) / 4 + 1);
    for (r, row) in train.iter().enumerate() {
        assert_eq!(row[..], text.as_bytes()[4 * r..4 * r + 9], "row {r}");
    }
    assert!(data.train.name().ends_with("plain.txt"));
}

#[test]
fn the_last_fraction_is_the_validation_split_cut_at_a_character_boundary() {
    // 101 bytes: 'x', "ab" * 44, then six 2-byte characters from byte 89 on
    let mut text = "x".to_string();
    text.push_str(&"ab".repeat(44));
    text.push_str("éééééé");
    let bytes = text.as_bytes();
    assert_eq!(bytes.len(), 101);
    let path = file("split.txt", bytes);
    // 10% of 101 = ceil(10.1) = 11 bytes -> the split at 90, inside the first 'é' (89..91);
    // it moves forward to 91
    let data = Dataset::from_text_file(&path, 4, &ValSplit::Fraction(0.1), Tokenizer::Bytes).unwrap();
    let val = data.val.unwrap();
    let val_rows = rows(&val);
    // validation rows: stride = context = 4, rows of 5 over bytes[91..101] (10 bytes): 2 rows
    assert_eq!(val_rows.len(), 2);
    assert_eq!(val_rows[0][..], bytes[91..96]);
    assert_eq!(val_rows[1][..], bytes[95..100]);
    assert!(std::str::from_utf8(&bytes[91..]).is_ok());
    // training reads bytes[..91]: the last row ends at or before byte 91
    let train = rows(&data.train);
    let last = train.len() - 1;
    assert_eq!(train[last][..], bytes[2 * last..2 * last + 5]);
    assert!(2 * last + 5 <= 91 && 2 * (last + 1) + 5 > 91);
    // every target byte of the validation part is predicted exactly once (stride = context)
    let targets: Vec<u8> = val_rows.iter().flat_map(|r| r[1..].to_vec()).collect();
    assert_eq!(targets[..], bytes[92..100]);
}

#[test]
fn a_separate_validation_file() {
    let train = file("train.txt", "the cat sat on the mat. ".repeat(4).as_bytes());
    let val = file("val.txt", b"a dog ran in the fog.");
    let data = Dataset::from_text_file(&train, 8, &ValSplit::File(val.to_path_buf()), Tokenizer::Bytes).unwrap();
    assert_eq!(data.train.len(), (96 - 9) / 4 + 1, "all of the training file");
    let v = data.val.unwrap();
    assert_eq!(rows(&v)[0], b"a dog ran");
    assert_eq!(v.len(), (21 - 9) / 8 + 1);
    // the validation file is checked like the training file
    let bad = file(
        "bad-val.txt",
        &[b'o', b'k', 0xC0, b'!', b' ', b' ', b' ', b' ', b' ', b' '],
    );
    let e =
        one_line(Dataset::from_text_file(&train, 8, &ValSplit::File(bad.to_path_buf()), Tokenizer::Bytes).unwrap_err());
    assert!(e.contains("bad-val.txt") && e.contains("byte offset 2"), "{e}");
}

#[test]
fn empty_short_or_non_utf8_files_are_one_error_line() {
    let e =
        one_line(Dataset::from_text_file(file("empty.txt", b""), 8, &ValSplit::None, Tokenizer::Bytes).unwrap_err());
    assert!(e.contains("empty.txt") && e.contains("the file is empty"), "{e}");
    let e = one_line(
        Dataset::from_text_file(file("short.txt", b"tiny"), 8, &ValSplit::None, Tokenizer::Bytes).unwrap_err(),
    );
    assert!(e.contains("4 bytes cannot fill one row of context 8 + 1"), "{e}");
    // an invalid byte on line 3, at byte offset 12
    let mut bytes = b"line one\nok\n\xFFbad".to_vec();
    bytes.extend_from_slice(&[b'x'; 20]);
    let e = one_line(
        Dataset::from_text_file(file("latin1.txt", &bytes), 8, &ValSplit::None, Tokenizer::Bytes).unwrap_err(),
    );
    assert!(
        e.contains("not UTF-8") && e.contains("invalid byte 0xff at byte offset 12 (line 3)"),
        "{e}"
    );
    // a character cut at the end of the file
    let mut cut = "0123456789".repeat(2).into_bytes();
    cut.extend_from_slice(&"€".as_bytes()[..2]);
    let e = one_line(Dataset::from_text_file(file("cut.txt", &cut), 8, &ValSplit::None, Tokenizer::Bytes).unwrap_err());
    assert!(e.contains("truncated character at byte offset 20"), "{e}");
    let absent = std::env::temp_dir().join(format!("brigade-models-text-{}-nothing.txt", std::process::id()));
    let e = one_line(Dataset::from_text_file(absent, 8, &ValSplit::None, Tokenizer::Bytes).unwrap_err());
    assert!(e.contains("nothing.txt") && e.contains("cannot read"), "{e}");
}

#[test]
fn a_split_that_leaves_a_part_without_a_row_is_one_error_line() {
    let path = file("twenty.txt", "abcdefghijklmnopqrst".as_bytes());
    for f in [0.0, 1.0, -0.5, f64::NAN] {
        let e = one_line(Dataset::from_text_file(&path, 4, &ValSplit::Fraction(f), Tokenizer::Bytes).unwrap_err());
        assert!(e.contains("fraction must be in (0, 1)"), "{f}: {e}");
    }
    // 10% of 20 bytes = 2 bytes < one row of 5
    let e = one_line(Dataset::from_text_file(&path, 4, &ValSplit::Fraction(0.1), Tokenizer::Bytes).unwrap_err());
    assert!(
        e.contains("validation part") && e.contains("2 of the file's 20 bytes"),
        "{e}"
    );
    // 90% leaves 2 bytes to train on
    let e = one_line(Dataset::from_text_file(&path, 4, &ValSplit::Fraction(0.9), Tokenizer::Bytes).unwrap_err());
    assert!(e.contains("training part"), "{e}");
    assert!(Dataset::from_text_file(&path, 4, &ValSplit::Fraction(0.5), Tokenizer::Bytes).is_ok());
}
