//! Text in: a dataset of bytes or GPT-2 tokens from any UTF-8 file, with a validation split.

use std::path::{Path, PathBuf};

use crate::{Dataset, ModelError, Result, Tokenizer};

/// Where the validation text comes from.
#[derive(Debug, Clone, PartialEq)]
pub enum ValSplit {
    /// No validation set.
    None,
    /// The last fraction of the file (in `(0, 1)`), cut at a character boundary; training
    /// reads the rest.
    Fraction(f64),
    /// A separate UTF-8 file; training reads all of the first.
    File(PathBuf),
}

/// A text file cut into training rows and, if asked, validation rows.
#[derive(Debug, Clone)]
pub struct TextData {
    /// Rows of `context + 1` tokens every `max(context / 2, 1)` tokens (as [`Dataset::text`]
    /// for bytes).
    pub train: Dataset,
    /// Rows of `context + 1` tokens every `context` tokens, so that each token after the first
    /// is a target once ([`Dataset::text_with_stride`] for bytes); `None` for
    /// [`ValSplit::None`].
    pub val: Option<Dataset>,
}

/// The largest text file read (1 GiB): the whole file is held in memory, and a stream without
/// an end (`/dev/zero`) must stop somewhere.
pub const MAX_TEXT_BYTES: u64 = 1 << 30;

/// The bytes of `path`, which must be non-empty UTF-8 text of at least `min_bytes` bytes and
/// at most [`MAX_TEXT_BYTES`]: a device (`/dev/zero`), a directory or a larger file is refused
/// before it is read; a pipe is read up to the bound.
fn read_utf8(path: &Path, min_bytes: usize, context: usize) -> Result<Vec<u8>> {
    use std::io::Read;
    use std::os::unix::fs::FileTypeExt;
    let source = path.display().to_string();
    let cannot = |e: std::io::Error| ModelError::io(path, format!("cannot read: {e}"));
    let kind = std::fs::metadata(path).map_err(cannot)?;
    if !(kind.is_file() || kind.file_type().is_fifo()) {
        let what = if kind.is_dir() {
            "a directory"
        } else {
            "not a regular file (a device or a socket)"
        };
        return Err(ModelError::data(
            &source,
            format!("it is {what}; give the path of a UTF-8 text file"),
        ));
    }
    if kind.len() > MAX_TEXT_BYTES {
        return Err(ModelError::data(
            &source,
            format!(
                "it is {} bytes, more than {MAX_TEXT_BYTES} bytes (1 GiB), the most a text file may hold (it is read whole into memory); give a smaller file",
                kind.len()
            ),
        ));
    }
    let mut bytes = vec![];
    std::fs::File::open(path)
        .and_then(|f| f.take(MAX_TEXT_BYTES + 1).read_to_end(&mut bytes))
        .map_err(cannot)?;
    if bytes.len() as u64 > MAX_TEXT_BYTES {
        return Err(ModelError::data(
            &source,
            format!(
                "more than {MAX_TEXT_BYTES} bytes (1 GiB), the most a text file may hold (it is read whole into memory); give a smaller file"
            ),
        ));
    }
    if bytes.is_empty() {
        let need = match context {
            0 => "a UTF-8 text".to_string(),
            _ => format!("a UTF-8 text of at least context {context} + 1 bytes"),
        };
        return Err(ModelError::data(&source, format!("the file is empty; give {need}")));
    }
    if let Err(e) = std::str::from_utf8(&bytes) {
        let at = e.valid_up_to();
        let line = 1 + bytes[..at].iter().filter(|&&b| b == b'\n').count();
        let what = match e.error_len() {
            Some(_) => format!("invalid byte 0x{:02x} at byte offset {at} (line {line})", bytes[at]),
            None => format!("a truncated character at byte offset {at} (line {line}, the end of the file)"),
        };
        return Err(ModelError::data(
            &source,
            format!("not UTF-8 text: {what}; byte-level training reads UTF-8 text files"),
        ));
    }
    if bytes.len() < min_bytes {
        return Err(ModelError::data(
            &source,
            format!(
                "{} bytes cannot fill one row of context {context} + 1; give a longer text or a smaller context",
                bytes.len()
            ),
        ));
    }
    Ok(bytes)
}

/// The token ids of the UTF-8 text file `path` as `tokenizer` cuts it, as an llm.c shard holds
/// them: for GPT-2, `<|endoftext|>` first (llm.c starts each document with it), for bytes the
/// bytes alone. Errors in one line: an empty file, bytes that are not UTF-8, a file over
/// 1 GiB.
pub fn text_file_tokens(path: impl AsRef<Path>, tokenizer: Tokenizer) -> Result<Vec<u16>> {
    let path = path.as_ref();
    let bytes = read_utf8(path, 1, 0)?;
    let text = String::from_utf8(bytes)
        .map_err(|e| ModelError::data(&path.display().to_string(), format!("not UTF-8: {e}")))?;
    let mut ids = match tokenizer {
        Tokenizer::Gpt2 => vec![crate::GPT2_END_OF_TEXT as u16],
        Tokenizer::Bytes => vec![],
    };
    ids.extend(tokenizer.encode(&text).into_iter().map(|t| t as u16));
    Ok(ids)
}

impl Dataset {
    /// Training rows (and validation rows) of `context + 1` tokens from the UTF-8 text file
    /// `path`, as `tokenizer` cuts it: bytes (a U8 column) or GPT-2 tokens (I64, held as
    /// `uint16`; the split is made in the text, at a character boundary, and each part
    /// tokenized alone). Errors in one line each: an empty or too short file, bytes that are
    /// not UTF-8 (naming the byte offset and line), a fraction outside `(0, 1)`, or a split
    /// whose part cannot fill one row.
    pub fn from_text_file(
        path: impl AsRef<Path>,
        context: usize,
        val: &ValSplit,
        tokenizer: Tokenizer,
    ) -> Result<TextData> {
        let path = path.as_ref();
        let source = path.display().to_string();
        if context == 0 {
            return Err(ModelError::data(&source, "context must be positive".into()));
        }
        let row = context + 1;
        let named = |mut d: Dataset, name: String| {
            d.set_name(name);
            d
        };
        let bytes = read_utf8(path, row, context)?;
        let (train, val) = match val {
            ValSplit::None => (bytes, None),
            ValSplit::File(vpath) => {
                let vbytes = read_utf8(vpath, row, context)?;
                let vsource = vpath.display().to_string();
                (bytes, Some((vbytes, vsource)))
            }
            &ValSplit::Fraction(f) => {
                if !(f > 0.0 && f < 1.0) {
                    return Err(ModelError::data(
                        &source,
                        format!("the validation fraction must be in (0, 1), got {f}"),
                    ));
                }
                let n = bytes.len();
                // the split moves forward to a character boundary (the text is valid UTF-8)
                let mut at = n - ((n as f64 * f).ceil() as usize).min(n);
                while at < n && (bytes[at] & 0xC0) == 0x80 {
                    at += 1;
                }
                let (t, v) = bytes.split_at(at);
                for (part, len) in [("training part", t.len()), ("validation part", v.len())] {
                    if len < row {
                        return Err(ModelError::data(
                            &source,
                            format!(
                                "the {part} of a {f} split holds {len} of the file's {n} bytes, less than one row of context {context} + 1; use a longer text, a smaller context or another fraction"
                            ),
                        ));
                    }
                }
                let vsource = format!("{source} (last {f} of the bytes)");
                (t.to_vec(), Some((v.to_vec(), vsource)))
            }
        };
        let rows = |bytes: Vec<u8>, name: String, stride: usize| -> Result<Dataset> {
            match tokenizer {
                Tokenizer::Bytes => Ok(named(Dataset::text_with_stride(bytes, context, stride)?, name)),
                Tokenizer::Gpt2 => {
                    // checked UTF-8 and split at a character boundary, so this holds
                    let text =
                        String::from_utf8(bytes).map_err(|e| ModelError::data(&name, format!("not UTF-8: {e}")))?;
                    let ids = tokenizer.encode(&text).into_iter().map(|t| t as u16).collect();
                    Dataset::token_ids(&name, ids, context, stride)
                }
            }
        };
        let train = rows(train, source, (context / 2).max(1))?;
        let val = match val {
            Some((v, name)) => Some(rows(v, name, context)?),
            None => None,
        };
        Ok(TextData { train, val })
    }
}
