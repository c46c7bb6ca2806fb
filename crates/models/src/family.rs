//! A GPT family of many equal blocks, one member per width: the models `brigade bench fit`
//! searches for the largest that trains under a memory budget. The depth is fixed (48 blocks by
//! default) and the width varies, so that every member's units (its blocks, which ZeRO-3 gathers
//! one at a time) stay the same small share of it (about 1/48) while its size grows as the
//! square of the width and its activations only linearly: the larger the member, the more its
//! parameters, gradients and optimizer state dominate its memory, as in the models ZeRO is
//! for. Varying the depth instead would keep a unit's size fixed but let the activations grow
//! with the model; varying both would change two things at once.

use crate::gpt::GptConfig;
use brigade_tensor::DType;

/// The family: every member has `blocks` blocks of `heads` heads, a feed-forward of four times
/// its width, `context` positions and `vocab` tokens; only the width differs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GptFamily {
    /// Transformer blocks of every member.
    pub blocks: usize,
    /// Attention heads; a member's width is a multiple of it.
    pub heads: usize,
    /// Positions a member reads.
    pub context: usize,
    /// Vocabulary size.
    pub vocab: usize,
}

impl Default for GptFamily {
    /// 48 blocks of 2 heads, context 32, the 256 bytes.
    fn default() -> Self {
        GptFamily {
            blocks: 48,
            heads: 2,
            context: 32,
            vocab: 256,
        }
    }
}

impl GptFamily {
    /// The member `width` wide: d_model `width`, d_ff `4 * width`, f32, no dropout (`width` a
    /// multiple of [`GptFamily::heads`]; [`GptConfig::validate`] says so otherwise).
    pub fn member(&self, width: usize) -> GptConfig {
        GptConfig {
            vocab: self.vocab,
            d_model: width,
            n_layers: self.blocks,
            n_heads: self.heads,
            d_ff: 4 * width,
            context: self.context,
            dtype: DType::F32,
            dropout: 0.0,
        }
    }

    /// Every parameter of the member `width` wide: the two embeddings, per block its two
    /// LayerNorms, attention (`3d^2 + 3d`, `d^2 + d`) and feed-forward (`8d^2 + 5d`), the final
    /// LayerNorm and the head.
    pub fn parameters(&self, width: usize) -> u64 {
        let (d, v, t, b) = (width as u64, self.vocab as u64, self.context as u64, self.blocks as u64);
        let block = 12 * d * d + 13 * d;
        v * d + t * d + b * block + 2 * d + v * d
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Gpt, Model};

    #[test]
    fn a_member_has_the_parameters_the_family_counts_and_its_blocks_are_a_small_part() {
        let f = GptFamily {
            blocks: 40,
            ..GptFamily::default()
        };
        for width in [2, 16, 38] {
            let built = Gpt::new(f.member(width), 0).unwrap();
            assert_eq!(built.params().numel() as u64, f.parameters(width), "width {width}");
        }
        // one block of the 64-wide member: 12 * 64^2 + 13 * 64 of 40 such and the embeddings
        let block = 12 * 64 * 64 + 13 * 64;
        assert!(block * 40 <= f.parameters(64) && f.parameters(64) < block * 43);
        assert!(f.member(3).validate().is_err(), "2 heads do not divide 3");
    }
}
