//! Token files: llm.c's shards and nanoGPT's raw `uint16` files, read where they lie.
//!
//! An llm.c shard (`.bin`) is a header of 256 little-endian `int32` (magic [`LLMC_MAGIC`],
//! version [`LLMC_VERSION`], the token count, the rest zero) followed by that many `uint16`
//! tokens; nanoGPT's `train.bin`/`val.bin` are the `uint16` tokens alone. Neither is loaded
//! whole: a batch reads its rows from the file by offset ([`std::os::unix::fs::FileExt::read_at`],
//! one read per row), so a shard larger than memory trains as well as a small one, and the
//! page cache keeps what is read often.
//!
//! Rows are windows of `context + 1` tokens every `context` tokens (llm.c's layout: each token
//! after a window's first is a target once), within one file: a window never spans two
//! shards. The ids become I64 tensors when a batch is gathered.

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::{ModelError, Result};

/// The first `int32` of an llm.c shard.
pub const LLMC_MAGIC: i32 = 20_240_520;
/// The version of an llm.c shard of `uint16` tokens (llm.c's version 2 holds `uint32`).
pub const LLMC_VERSION: i32 = 1;
/// Bytes of an llm.c header (256 `int32`).
pub const LLMC_HEADER_BYTES: usize = 256 * 4;

/// How a token file lays out its tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TokenFormat {
    /// llm.c's shard: the 1024-byte header, then `uint16` tokens.
    Llmc,
    /// nanoGPT's raw `uint16` tokens (`train.bin`, `val.bin`), no header.
    NanoGpt,
}

impl TokenFormat {
    /// `llmc` or `nanogpt`.
    pub fn name(self) -> &'static str {
        match self {
            TokenFormat::Llmc => "llmc",
            TokenFormat::NanoGpt => "nanogpt",
        }
    }

    /// Whether `head` (a file's first bytes) starts with llm.c's magic.
    pub fn is_llmc(head: &[u8]) -> bool {
        head.len() >= 4 && head[..4] == LLMC_MAGIC.to_le_bytes()
    }
}

/// The bytes of an llm.c shard holding `tokens`: the header, then the tokens.
pub fn llmc_shard_bytes(tokens: &[u16]) -> Result<Vec<u8>> {
    let count = i32::try_from(tokens.len()).map_err(|_| {
        ModelError::data(
            "llm.c shard",
            format!(
                "{} tokens do not fit the header's int32 count (at most {}); cut the text into several shards",
                tokens.len(),
                i32::MAX
            ),
        )
    })?;
    let mut out = Vec::with_capacity(LLMC_HEADER_BYTES + 2 * tokens.len());
    let mut header = [0i32; 256];
    header[0] = LLMC_MAGIC;
    header[1] = LLMC_VERSION;
    header[2] = count;
    for v in header {
        out.extend_from_slice(&v.to_le_bytes());
    }
    for t in tokens {
        out.extend_from_slice(&t.to_le_bytes());
    }
    Ok(out)
}

/// Writes `tokens` as an llm.c shard to `path`, atomically (a temporary beside it, then a
/// rename).
pub fn write_llmc_shard(path: impl AsRef<Path>, tokens: &[u16]) -> Result<()> {
    let path = path.as_ref();
    let bytes = llmc_shard_bytes(tokens)?;
    crate::io::write_atomic(path, &bytes).map_err(|e| ModelError::io(path, format!("cannot write: {e}")))
}

/// Where one part's tokens are.
enum Tokens {
    /// In memory (a text tokenized at load).
    Memory(Vec<u16>),
    /// In a file, from byte `offset` on (past llm.c's header), read by offset.
    File { file: File, offset: u64, bytes: u64 },
}

/// One file's (or one text's) tokens and the windows over them.
struct Part {
    /// The file, for errors and logs.
    source: String,
    tokens: Tokens,
    /// Tokens it holds.
    len: usize,
}

/// A view of some of a part's windows: rows `first .. first + rows` of the store are the
/// part's windows `from .. from + rows`.
#[derive(Clone, Copy)]
struct Span {
    part: usize,
    from: usize,
    rows: usize,
    first: usize,
}

/// Token ids in windows of `row_len` every `stride`, over one or more parts; cheap to clone
/// and to cut ([`TokenStore::rows`]), read by row.
#[derive(Clone)]
pub(crate) struct TokenStore {
    parts: Arc<Vec<Part>>,
    spans: Vec<Span>,
    row_len: usize,
    stride: usize,
}

impl TokenStore {
    /// Windows of `row_len` tokens every `stride` over `tokens` in memory.
    pub(crate) fn memory(source: &str, tokens: Vec<u16>, row_len: usize, stride: usize) -> Result<TokenStore> {
        let len = tokens.len();
        Self::new(
            vec![Part {
                source: source.to_string(),
                tokens: Tokens::Memory(tokens),
                len,
            }],
            row_len,
            stride,
        )
    }

    /// Windows over the token files `paths` in `format`, each file's header checked.
    pub(crate) fn open(
        paths: &[PathBuf],
        format: Option<TokenFormat>,
        row_len: usize,
        stride: usize,
    ) -> Result<TokenStore> {
        let parts = paths.iter().map(|p| open_part(p, format)).collect::<Result<Vec<_>>>()?;
        Self::new(parts, row_len, stride)
    }

    fn new(parts: Vec<Part>, row_len: usize, stride: usize) -> Result<TokenStore> {
        let mut spans = vec![];
        let mut first = 0;
        for (i, p) in parts.iter().enumerate() {
            if p.len < row_len {
                return Err(ModelError::data(
                    &p.source,
                    format!(
                        "{} tokens cannot fill one row of context {} + 1; give a longer file or a smaller context",
                        p.len,
                        row_len - 1
                    ),
                ));
            }
            let rows = (p.len - row_len) / stride + 1;
            spans.push(Span {
                part: i,
                from: 0,
                rows,
                first,
            });
            first += rows;
        }
        Ok(TokenStore {
            parts: Arc::new(parts),
            spans,
            row_len,
            stride,
        })
    }

    /// Number of rows.
    pub(crate) fn len(&self) -> usize {
        self.spans.last().map_or(0, |s| s.first + s.rows)
    }

    /// Tokens per row.
    pub(crate) fn row_len(&self) -> usize {
        self.row_len
    }

    /// The files (or texts) the rows come from, joined with `+`.
    pub(crate) fn sources(&self) -> String {
        let names: Vec<&str> = self.parts.iter().map(|p| p.source.as_str()).collect();
        names.join(" + ")
    }

    /// The rows `range` as a store of their own (sharing the files).
    pub(crate) fn rows(&self, range: std::ops::Range<usize>) -> TokenStore {
        let spans = self
            .spans
            .iter()
            .filter_map(|s| {
                let lo = range.start.max(s.first);
                let hi = range.end.min(s.first + s.rows);
                (lo < hi).then(|| Span {
                    part: s.part,
                    from: s.from + (lo - s.first),
                    rows: hi - lo,
                    first: lo - range.start,
                })
            })
            .collect();
        TokenStore {
            parts: self.parts.clone(),
            spans,
            row_len: self.row_len,
            stride: self.stride,
        }
    }

    /// The span holding row `r` (which is below [`TokenStore::len`]).
    fn span(&self, r: usize) -> &Span {
        let i = self.spans.partition_point(|s| s.first + s.rows <= r);
        &self.spans[i]
    }

    /// Row `r`'s tokens appended to `out` as I64.
    pub(crate) fn read_row(&self, r: usize, out: &mut Vec<i64>) -> Result<()> {
        let s = self.span(r);
        let part = &self.parts[s.part];
        let at = (s.from + r - s.first) * self.stride;
        match &part.tokens {
            Tokens::Memory(v) => out.extend(v[at..at + self.row_len].iter().map(|&t| i64::from(t))),
            Tokens::File { file, offset, .. } => {
                let mut buf = vec![0u8; 2 * self.row_len];
                file.read_exact_at(&mut buf, offset + 2 * at as u64)
                    .map_err(|e| ModelError::io(Path::new(&part.source), format!("cannot read tokens: {e}")))?;
                out.extend(buf.chunks_exact(2).map(|b| i64::from(u16::from_le_bytes([b[0], b[1]]))));
            }
        }
        Ok(())
    }

    /// The first token some row covers at or above `below`: `(row, token)`. Reads every file
    /// once, a MiB at a time.
    pub(crate) fn first_at_or_above(&self, below: u64) -> Result<Option<(usize, u16)>> {
        for s in &self.spans {
            let part = &self.parts[s.part];
            let start = s.from * self.stride;
            let end = (s.from + s.rows - 1) * self.stride + self.row_len;
            // a row that covers the part's token `start + i`: the one starting at or before it
            let row_of = |i: usize| s.first + ((start + i) / self.stride).min(s.from + s.rows - 1) - s.from;
            let hit = |chunk: &[u16], base: usize| {
                chunk
                    .iter()
                    .position(|&t| u64::from(t) >= below)
                    .map(|i| (row_of(base + i), chunk[i]))
            };
            match &part.tokens {
                Tokens::Memory(v) => {
                    if let Some(h) = hit(&v[start..end], 0) {
                        return Ok(Some(h));
                    }
                }
                Tokens::File { file, offset, .. } => {
                    const CHUNK: usize = 1 << 19;
                    let mut buf = vec![0u8; 2 * CHUNK];
                    let mut at = start;
                    while at < end {
                        let n = CHUNK.min(end - at);
                        file.read_exact_at(&mut buf[..2 * n], offset + 2 * at as u64)
                            .map_err(|e| ModelError::io(Path::new(&part.source), format!("cannot read tokens: {e}")))?;
                        let chunk: Vec<u16> = buf[..2 * n]
                            .chunks_exact(2)
                            .map(|b| u16::from_le_bytes([b[0], b[1]]))
                            .collect();
                        if let Some(h) = hit(&chunk, at - start) {
                            return Ok(Some(h));
                        }
                        at += n;
                    }
                }
            }
        }
        Ok(None)
    }

    /// What identifies the rows without reading every file: per part its length, and for a
    /// file its first 4 KiB (llm.c's header among them), its last 4 KiB and 32 windows of 4 KiB
    /// spaced evenly between; a text in memory is hashed whole. Fed to `eat`.
    pub(crate) fn fingerprint(&self, eat: &mut dyn FnMut(&[u8])) -> Result<()> {
        const WINDOW: u64 = 4096;
        const SAMPLES: u64 = 32;
        eat(b"brigade tokens u16 v1");
        for v in [self.row_len, self.stride, self.len()] {
            eat(&(v as u64).to_le_bytes());
        }
        for s in &self.spans {
            for v in [s.from, s.rows] {
                eat(&(v as u64).to_le_bytes());
            }
            let part = &self.parts[s.part];
            eat(&(part.len as u64).to_le_bytes());
            match &part.tokens {
                Tokens::Memory(v) => v.iter().for_each(|t| eat(&t.to_le_bytes())),
                Tokens::File { file, offset, bytes } => {
                    let total = offset + bytes;
                    let mut starts = vec![0, total.saturating_sub(WINDOW)];
                    starts.extend((1..=SAMPLES).map(|i| total * i / (SAMPLES + 1)));
                    let mut buf = vec![0u8; WINDOW as usize];
                    for at in starts {
                        let n = WINDOW.min(total - at.min(total)) as usize;
                        file.read_exact_at(&mut buf[..n], at)
                            .map_err(|e| ModelError::io(Path::new(&part.source), format!("cannot read: {e}")))?;
                        eat(&buf[..n]);
                    }
                }
            }
        }
        Ok(())
    }
}

/// Opens one token file and checks its layout: llm.c's header (magic, version, the count
/// against the file's length) or an even length for nanoGPT's raw tokens. `format` `None`:
/// llm.c's, which a file without its magic is told it is not.
fn open_part(path: &Path, format: Option<TokenFormat>) -> Result<Part> {
    let source = path.display().to_string();
    let file = File::open(path).map_err(|e| ModelError::io(path, format!("cannot read: {e}")))?;
    let bytes = file
        .metadata()
        .map_err(|e| ModelError::io(path, format!("cannot read: {e}")))?
        .len();
    let bad = |m: String| Err(ModelError::data(&source, m));
    match format.unwrap_or(TokenFormat::Llmc) {
        TokenFormat::NanoGpt => {
            if bytes % 2 != 0 {
                return bad(format!(
                    "{bytes} bytes is not a whole number of uint16 tokens (nanoGPT's raw format: 2 bytes a token)"
                ));
            }
            Ok(Part {
                source,
                tokens: Tokens::File { file, offset: 0, bytes },
                len: (bytes / 2) as usize,
            })
        }
        TokenFormat::Llmc => {
            let mut header = vec![];
            (&file)
                .take(LLMC_HEADER_BYTES as u64)
                .read_to_end(&mut header)
                .map_err(|e| ModelError::io(path, format!("cannot read: {e}")))?;
            if !TokenFormat::is_llmc(&header) {
                let found = header.get(..4).map_or("fewer than 4 bytes".into(), |b| {
                    format!("{}", i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                });
                return bad(format!(
                    "not an llm.c shard: its first int32 is {found}, an llm.c shard's is the magic {LLMC_MAGIC} (for nanoGPT's raw uint16 tokens give --data-format nanogpt)"
                ));
            }
            if header.len() < LLMC_HEADER_BYTES {
                return bad(format!(
                    "an llm.c shard's header is {LLMC_HEADER_BYTES} bytes (256 int32), the file has {bytes}"
                ));
            }
            let word =
                |i: usize| i32::from_le_bytes([header[4 * i], header[4 * i + 1], header[4 * i + 2], header[4 * i + 3]]);
            let (version, count) = (word(1), word(2));
            if version != LLMC_VERSION {
                return bad(format!(
                    "llm.c shard version {version}: Brigade reads version {LLMC_VERSION} (uint16 tokens){}",
                    if version == 2 {
                        "; version 2 holds uint32 tokens"
                    } else {
                        ""
                    }
                ));
            }
            let body = bytes - LLMC_HEADER_BYTES as u64;
            if count < 0 || body != 2 * count as u64 {
                return bad(format!(
                    "the header counts {count} tokens ({} bytes after the header), the file holds {body} bytes after its header",
                    2 * i64::from(count)
                ));
            }
            Ok(Part {
                source,
                tokens: Tokens::File {
                    file,
                    offset: LLMC_HEADER_BYTES as u64,
                    bytes: body,
                },
                len: count as usize,
            })
        }
    }
}

/// The files a token-file pattern names: the path itself, or, when its file name holds `*`
/// or `?`, every file of its directory the name matches, sorted (at least one).
pub fn expand_glob(pattern: &Path) -> Result<Vec<PathBuf>> {
    let shown = pattern.display().to_string();
    let Some(name) = pattern.file_name().and_then(|n| n.to_str()) else {
        return Ok(vec![pattern.to_path_buf()]);
    };
    if !name.contains(['*', '?']) {
        return Ok(vec![pattern.to_path_buf()]);
    }
    let dir = match pattern.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if dir.to_str().is_some_and(|d| d.contains(['*', '?'])) {
        return Err(ModelError::data(
            &shown,
            "a pattern may hold * and ? in its file name only, not in its directories".into(),
        ));
    }
    let entries = std::fs::read_dir(&dir).map_err(|e| ModelError::io(&dir, format!("cannot list: {e}")))?;
    let mut found: Vec<PathBuf> = entries
        .filter_map(|e| e.ok())
        .filter(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| glob_match(name.as_bytes(), n.as_bytes()))
        })
        .filter(|e| e.file_type().is_ok_and(|t| !t.is_dir()))
        .map(|e| {
            if pattern.parent().is_some_and(|p| p.as_os_str().is_empty()) {
                PathBuf::from(e.file_name())
            } else {
                e.path()
            }
        })
        .collect();
    found.sort();
    if found.is_empty() {
        return Err(ModelError::data(&shown, "the pattern matches no file".into()));
    }
    Ok(found)
}

/// Whether the file name `name` matches the pattern `pattern` of [`expand_glob`] (`*`: any run
/// of bytes, `?`: one byte).
pub fn glob_matches(pattern: &str, name: &str) -> bool {
    glob_match(pattern.as_bytes(), name.as_bytes())
}

/// Whether `name` matches `pattern` (`*`: any run of bytes, `?`: one byte).
fn glob_match(pattern: &[u8], name: &[u8]) -> bool {
    match (pattern.first(), name.first()) {
        (None, None) => true,
        (Some(b'*'), _) => glob_match(&pattern[1..], name) || (!name.is_empty() && glob_match(pattern, &name[1..])),
        (Some(b'?'), Some(_)) => glob_match(&pattern[1..], &name[1..]),
        (Some(p), Some(n)) if p == n => glob_match(&pattern[1..], &name[1..]),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn glob_matches_stars_and_question_marks() {
        use super::glob_match as m;
        assert!(m(b"train_*.bin", b"train_000001.bin"));
        assert!(m(b"train_*.bin", b"train_.bin"));
        assert!(!m(b"train_*.bin", b"val_000000.bin"));
        assert!(m(b"shard?.bin", b"shard7.bin"));
        assert!(!m(b"shard?.bin", b"shard10.bin"));
        assert!(m(b"*", b"anything"));
    }
}
