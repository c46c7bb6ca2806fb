//! GPT-2's tokenizer against ids made without `tiktoken-rs`'s rank table, and token files:
//! llm.c's shards (written by Brigade, read back to llm.c's spec here) and nanoGPT's raw
//! `uint16` files read by row, their headers checked, their ids below the vocabulary.

use std::path::{Path, PathBuf};

use brigade_models::{
    write_llmc_shard, BatchSchema, Dataset, ModelError, TokenFormat, Tokenizer, ValSplit, GPT2_VOCAB,
};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

fn dir(name: &str) -> crate::common::Scratch {
    crate::common::Scratch::dir(&format!("tokens-{name}"))
}

fn one_line(e: ModelError) -> String {
    let s = e.to_string();
    assert!(!s.contains('\n'), "{s}");
    s
}

/// The ids of every row of `d`, as I64.
fn rows(d: &Dataset) -> Vec<Vec<i64>> {
    let t = d.batch(0, d.len()).unwrap().get("tokens").unwrap().clone();
    let w = t.shape()[1];
    t.to_vec::<i64>().unwrap().chunks(w).map(<[i64]>::to_vec).collect()
}

/// An llm.c shard as llm.c's `dev/data/data_common.py` (`write_datafile`) lays it out and its
/// `dataloader.h` reads it: 256 little-endian int32 (magic 20240520, version 1, the token
/// count), then the tokens as little-endian uint16. Written here from the spec, not from
/// Brigade's reader.
fn read_llmc_to_spec(path: &Path) -> Vec<u16> {
    let bytes = std::fs::read(path).unwrap();
    assert!(bytes.len() >= 1024, "a header of 256 int32");
    let header: Vec<i32> = bytes[..1024]
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(header[0], 20240520, "magic");
    assert_eq!(header[1], 1, "version");
    let n = header[2] as usize;
    assert!(header[3..].iter().all(|&v| v == 0), "the rest of the header is zero");
    assert_eq!(bytes.len(), 1024 + 2 * n, "the count against the file's length");
    bytes[1024..]
        .chunks_exact(2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
        .collect()
}

#[test]
fn gpt2_ids_match_gpt2s_own_encoder_over_its_encoder_json() {
    // tests/fixtures/make_gpt2_fixture.py wrote the ids with GPT-2's original byte-pair
    // algorithm over the encoder.json and vocab.bpe that ship in the tiktoken-rs crate
    let text = std::fs::read_to_string(fixture("gpt2_sample.txt")).unwrap();
    let expected: Vec<u32> = std::fs::read_to_string(fixture("gpt2_sample.ids"))
        .unwrap()
        .split_whitespace()
        .map(|t| t.parse().unwrap())
        .collect();
    assert_eq!(expected.len(), 290);
    let ids = Tokenizer::Gpt2.encode(&text);
    assert_eq!(ids, expected);
    assert_eq!(Tokenizer::Gpt2.decode(&ids).unwrap(), text);
    assert_eq!(Tokenizer::Gpt2.vocab(), GPT2_VOCAB);
    // byte-level: one id per UTF-8 byte
    let bytes = Tokenizer::Bytes.encode(&text);
    assert_eq!(bytes.len(), text.len());
    assert_eq!(Tokenizer::Bytes.decode(&bytes).unwrap(), text);
    assert!(one_line(Tokenizer::Gpt2.token_bytes(50_257).unwrap_err()).contains("outside"));
    let e = one_line("gpt3".parse::<Tokenizer>().unwrap_err());
    assert!(e.contains("bytes and gpt2"), "{e}");
}

#[test]
fn a_shard_brigade_writes_is_an_llmc_shard_and_reads_back_by_row() {
    let scratch = dir("written");
    let ids: Vec<u16> = (0..1000u32).map(|i| ((i * 7919) % 50_257) as u16).collect();
    let path = scratch.join("written.bin");
    write_llmc_shard(&path, &ids).unwrap();
    assert_eq!(read_llmc_to_spec(&path), ids);
    // rows of context + 1 every context tokens (llm.c's windows)
    let d = Dataset::from_token_files(&[path], None, BatchSchema::tokens(16, GPT2_VOCAB)).unwrap();
    assert_eq!(d.len(), (1000 - 17) / 16 + 1);
    for (r, row) in rows(&d).iter().enumerate() {
        let want: Vec<i64> = ids[16 * r..16 * r + 17].iter().map(|&t| i64::from(t)).collect();
        assert_eq!(*row, want, "row {r}");
    }
    // any rows, in any order
    let b = d.gather(&[3, 0, 3]).unwrap();
    let t = b.get("tokens").unwrap().to_vec::<i64>().unwrap();
    assert_eq!(t[..17], rows(&d)[3][..]);
    assert_eq!(t[17..34], rows(&d)[0][..]);
}

#[test]
fn several_shards_are_one_dataset_whose_rows_stay_within_a_file() {
    let scratch = dir("glob");
    let d0 = scratch.join("glob_000.bin");
    let d1 = scratch.join("glob_001.bin");
    write_llmc_shard(&d0, &(0..40).collect::<Vec<u16>>()).unwrap();
    write_llmc_shard(&d1, &(100..125).collect::<Vec<u16>>()).unwrap();
    let paths = brigade_models::tokens::expand_glob(&scratch.join("glob_*.bin")).unwrap();
    assert_eq!(paths, vec![d0, d1]);
    let d = Dataset::from_token_files(&paths, None, BatchSchema::tokens(8, 256)).unwrap();
    // 40 tokens: rows at 0, 8, .., 31 (4 rows); 25: rows at 0, 8, 16 (3 rows)
    let r = rows(&d);
    assert_eq!(r.len(), 7);
    assert_eq!(r[3], (24..33).collect::<Vec<i64>>());
    assert_eq!(r[4], (100..109).collect::<Vec<i64>>());
    assert_eq!(r[6], (116..125).collect::<Vec<i64>>());
    // a view of rows 3..5 reads the same rows, and is identified as other rows
    let v = d.rows(3..5).unwrap();
    assert_eq!(rows(&v), r[3..5].to_vec());
    assert_ne!(v.fingerprint(), d.fingerprint());
    let e = one_line(brigade_models::tokens::expand_glob(&scratch.join("none_*.bin")).unwrap_err());
    assert!(e.contains("matches no file"), "{e}");
}

#[test]
fn nanogpts_raw_uint16_files_read_with_their_format() {
    let scratch = dir("nanogpt");
    let path = scratch.join("train.bin");
    let ids: Vec<u16> = (0..50).map(|i| 50_000 + i).collect();
    std::fs::write(&path, ids.iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
    let d = Dataset::from_token_files(
        std::slice::from_ref(&path),
        Some(TokenFormat::NanoGpt),
        BatchSchema::tokens(4, GPT2_VOCAB),
    )
    .unwrap();
    assert_eq!(rows(&d)[2], (50_008..50_013).collect::<Vec<i64>>());
    // read as llm.c's, the file is told what it is not
    let e = one_line(Dataset::from_token_files(&[path.clone()], None, BatchSchema::tokens(4, GPT2_VOCAB)).unwrap_err());
    assert!(
        e.contains("not an llm.c shard") && e.contains("--data-format nanogpt"),
        "{e}"
    );
    // ids past a byte vocabulary: the row and the id named
    let e = one_line(
        Dataset::from_token_files(&[path], Some(TokenFormat::NanoGpt), BatchSchema::tokens(4, 256)).unwrap_err(),
    );
    assert!(e.contains("row 0 has token 50000, expected 0..256"), "{e}");
}

#[test]
fn a_bad_header_is_one_line_naming_what_is_wrong() {
    let scratch = dir("header");
    let good = scratch.join("good.bin");
    write_llmc_shard(&good, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]).unwrap();
    let bytes = std::fs::read(&good).unwrap();
    let open = |name: &str, b: &[u8]| {
        let p = scratch.join(name);
        std::fs::write(&p, b).unwrap();
        one_line(Dataset::from_token_files(&[p], None, BatchSchema::tokens(4, 256)).unwrap_err())
    };
    let mut v2 = bytes.clone();
    v2[4..8].copy_from_slice(&2i32.to_le_bytes());
    let e = open("v2.bin", &v2);
    assert!(e.contains("version 2") && e.contains("uint32"), "{e}");
    let e = open("cut.bin", &bytes[..bytes.len() - 2]);
    assert!(e.contains("counts 10 tokens") && e.contains("holds 18 bytes"), "{e}");
    let e = open("short.bin", &bytes[..100]);
    assert!(e.contains("header is 1024 bytes"), "{e}");
    let e = open("odd.bin", b"hello");
    assert!(e.contains("not an llm.c shard"), "{e}");
    let odd = scratch.join("odd.bin");
    let e = one_line(
        Dataset::from_token_files(&[odd], Some(TokenFormat::NanoGpt), BatchSchema::tokens(1, 256)).unwrap_err(),
    );
    assert!(e.contains("5 bytes is not a whole number"), "{e}");
    let e = one_line(Dataset::from_token_files(&[good], None, BatchSchema::tokens(10, 256)).unwrap_err());
    assert!(e.contains("10 tokens cannot fill one row of context 10"), "{e}");
}

#[test]
fn a_shards_fingerprint_samples_the_file_and_notices_other_tokens() {
    let scratch = dir("print");
    // 300k tokens (600 KB): the fingerprint reads 34 windows of 4 KiB, not the file
    let ids: Vec<u16> = (0..300_000u32).map(|i| (i % 256) as u16).collect();
    let path = scratch.join("print.bin");
    write_llmc_shard(&path, &ids).unwrap();
    let open = || Dataset::from_token_files(std::slice::from_ref(&path), None, BatchSchema::tokens(8, 256)).unwrap();
    let a = open().fingerprint().to_string();
    assert_eq!(a, open().fingerprint());
    assert!(a.ends_with("(sampled)"), "{a}");
    // a token inside the 16th of the 32 windows between the first and the last (they start at
    // total * i / 33 bytes)
    let mut other = ids.clone();
    let total = 1024 + 2 * ids.len();
    let k = (total * 16 / 33 + 100 - 1024) / 2;
    other[k] = ((k + 1) % 256) as u16;
    write_llmc_shard(&path, &other).unwrap();
    assert_ne!(open().fingerprint(), a);
    // one token more: another length
    write_llmc_shard(&path, &[&ids[..], &[0]].concat()).unwrap();
    assert_ne!(open().fingerprint(), a);
}

#[test]
fn a_text_file_becomes_gpt2_tokens_with_its_validation_split() {
    let scratch = dir("text");
    let text = "The quick brown fox jumps over the lazy dog. ".repeat(40);
    let path = scratch.join("fox.txt");
    std::fs::write(&path, &text).unwrap();
    let data = Dataset::from_text_file(&path, 8, &ValSplit::Fraction(0.1), Tokenizer::Gpt2).unwrap();
    let n = text.len();
    let at = n - (n as f64 * 0.1).ceil() as usize;
    let train_ids: Vec<i64> = Tokenizer::Gpt2.encode(&text[..at]).into_iter().map(i64::from).collect();
    let val_ids: Vec<i64> = Tokenizer::Gpt2.encode(&text[at..]).into_iter().map(i64::from).collect();
    // training rows every context / 2 = 4 tokens, validation rows every context = 8
    let train = rows(&data.train);
    assert_eq!(train.len(), (train_ids.len() - 9) / 4 + 1);
    assert_eq!(train[5], train_ids[20..29]);
    let val = rows(data.val.as_ref().unwrap());
    assert_eq!(val.len(), (val_ids.len() - 9) / 8 + 1);
    assert_eq!(val[1], val_ids[8..17]);
    data.train.check(&BatchSchema::tokens(8, GPT2_VOCAB)).unwrap();
    // 10 bytes of text are fewer tokens than a row
    let short = scratch.join("short.txt");
    std::fs::write(&short, "aaaa bbbb cccc").unwrap();
    let e = one_line(Dataset::from_text_file(&short, 8, &ValSplit::None, Tokenizer::Gpt2).unwrap_err());
    assert!(e.contains("tokens cannot fill one row of context 8"), "{e}");
}
