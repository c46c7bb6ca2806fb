//! Text to token ids and back: bytes (the vocabulary of 256, one token per UTF-8 byte) or
//! GPT-2's byte-pair encoding (the vocabulary of 50,257 of GPT-2, nanoGPT and llm.c:
//! `tiktoken`'s `r50k_base`, whose ranks ship inside the `tiktoken-rs` crate, so no download).
//!
//! ```
//! use brigade_models::Tokenizer;
//!
//! let gpt2: Tokenizer = "gpt2".parse()?;
//! let ids = gpt2.encode("Hello world");
//! assert_eq!(ids, vec![15496, 995]);
//! assert_eq!(gpt2.decode(&ids)?, "Hello world");
//! assert_eq!(Tokenizer::Bytes.encode("Hi"), vec![72, 105]);
//! # Ok::<(), brigade_models::ModelError>(())
//! ```

use std::fmt;
use std::str::FromStr;

use crate::{ModelError, Result};

/// GPT-2's vocabulary: 50,000 merges, 256 bytes and `<|endoftext|>`.
pub const GPT2_VOCAB: usize = 50_257;
/// GPT-2's `<|endoftext|>`, the last id of its vocabulary (llm.c puts it before each document).
pub const GPT2_END_OF_TEXT: u32 = 50_256;

/// How text becomes token ids.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Tokenizer {
    /// One token per UTF-8 byte (vocabulary 256).
    #[default]
    Bytes,
    /// GPT-2's byte-pair encoding (vocabulary [`GPT2_VOCAB`]).
    Gpt2,
}

impl Tokenizer {
    /// Both, in the order the command line lists them.
    pub const ALL: [Tokenizer; 2] = [Tokenizer::Bytes, Tokenizer::Gpt2];

    /// `bytes` or `gpt2`: the name on the command line and in checkpoints.
    pub fn name(self) -> &'static str {
        match self {
            Tokenizer::Bytes => "bytes",
            Tokenizer::Gpt2 => "gpt2",
        }
    }

    /// The number of distinct ids: the GPT's vocabulary.
    pub fn vocab(self) -> usize {
        match self {
            Tokenizer::Bytes => 256,
            Tokenizer::Gpt2 => GPT2_VOCAB,
        }
    }

    /// The ids of `text`. GPT-2's special token is not parsed: `<|endoftext|>` in a text is
    /// text (as GPT-2's own encoder and `tiktoken`'s `encode_ordinary` treat it).
    pub fn encode(self, text: &str) -> Vec<u32> {
        match self {
            Tokenizer::Bytes => text.bytes().map(u32::from).collect(),
            Tokenizer::Gpt2 => tiktoken_rs::r50k_base_singleton().encode_ordinary(text),
        }
    }

    /// The bytes token `id` stands for (a GPT-2 token may hold part of a character), or an
    /// error naming an id outside the vocabulary.
    pub fn token_bytes(self, id: u32) -> Result<Vec<u8>> {
        let outside = || {
            ModelError::Generate(format!(
                "token {id} is outside the {} tokenizer's vocabulary 0..{}",
                self.name(),
                self.vocab()
            ))
        };
        match self {
            Tokenizer::Bytes => u8::try_from(id).map(|b| vec![b]).map_err(|_| outside()),
            Tokenizer::Gpt2 => tiktoken_rs::r50k_base_singleton()
                .decode_bytes(&[id])
                .map_err(|_| outside()),
        }
    }

    /// The text of `ids` (bytes that do not form UTF-8 become U+FFFD).
    pub fn decode(self, ids: &[u32]) -> Result<String> {
        let mut bytes = vec![];
        for &id in ids {
            bytes.extend(self.token_bytes(id)?);
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }
}

impl fmt::Display for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Tokenizer {
    type Err = ModelError;

    /// `bytes` or `gpt2`.
    fn from_str(s: &str) -> Result<Tokenizer> {
        Tokenizer::ALL.into_iter().find(|t| t.name() == s).ok_or_else(|| {
            ModelError::Unsupported(format!("unknown tokenizer '{s}': the tokenizers are bytes and gpt2"))
        })
    }
}
