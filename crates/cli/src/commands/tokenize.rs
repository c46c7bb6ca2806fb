//! `brigade tokenize`: a UTF-8 text file as an llm.c shard of token ids, for `brigade train
//! --data FILE.bin` (and for llm.c itself): GPT-2's tokens by default, `<|endoftext|>` first as
//! llm.c starts each document; the shard written atomically.

use std::path::PathBuf;

use brigade_models::{text_file_tokens, write_llmc_shard, Tokenizer};
use clap::Args;

use crate::error::Result;
use crate::outputs::{check_inputs_kept, check_outputs, Input, Output};

/// `brigade tokenize`'s flags.
#[derive(Args, Clone, Debug)]
pub struct TokenizeArgs {
    /// The UTF-8 text file to tokenize (at most 1 GiB).
    #[arg(long)]
    pub text: PathBuf,
    /// The llm.c shard to write (a 256 x int32 header: magic 20240520, version 1, the token
    /// count; then the tokens as uint16).
    #[arg(long)]
    pub out: PathBuf,
    /// How the text becomes tokens.
    #[arg(long, value_parser = crate::args::tokenizer_parser(), default_value_t = Tokenizer::Gpt2)]
    pub tokenizer: Tokenizer,
}

/// Runs `brigade tokenize`: reads `--text`, writes `--out`, says how many tokens.
pub fn tokenize(a: TokenizeArgs) -> Result<()> {
    let outputs = [Output::new("--out", &a.out)];
    check_outputs(&outputs)?;
    check_inputs_kept(&[Input::new("--text", &a.text)], &outputs)?;
    let ids = text_file_tokens(&a.text, a.tokenizer)?;
    write_llmc_shard(&a.out, &ids)?;
    crate::report::stdout::write_fmt(format_args!(
        "wrote {} {} tokens of {} to {} (an llm.c shard)\n",
        ids.len(),
        a.tokenizer,
        a.text.display(),
        a.out.display()
    ));
    Ok(())
}
