//! Padding a vocabulary to a size the tensor-parallel degree divides, as
//! Megatron's `make-vocab-size-divisible-by` does: GPT-2's 50 257 ids cannot
//! be split over 2 or 4 ranks, 50 304 can. The padding rows of the embedding
//! are never looked up (no token has their id), and the head masks their
//! logits to −∞ ([`Linear::with_valid_outputs`](tessera::nn::Linear::with_valid_outputs)),
//! so they never win a softmax or a sample; Hugging Face checkpoints are
//! read into the first rows and written back without the padding.

use crate::error::{Error, Result};
use tessera::nn::{Embedding, Linear};

/// The vocabulary size a model split over `tp` tensor-parallel ranks is
/// built with: `vocab` itself when `tp` divides it, else the next multiple
/// of lcm(64, `tp`), so that the power-of-two degrees up to 64 all pad to the
/// same size (a checkpoint of such a run reshards between them). Should that
/// leave a rank with padding only (a degree that is not a power of two), the
/// next multiple of `tp` instead: every rank holds real ids when `vocab` is at
/// least `tp`².
pub fn padded_vocab(vocab: usize, tp: usize) -> usize {
    let tp = tp.max(1);
    if vocab.is_multiple_of(tp) {
        return vocab;
    }
    let step = lcm(64, tp);
    let wide = vocab.div_ceil(step) * step;
    if wide - vocab < wide / tp {
        wide
    } else {
        vocab.div_ceil(tp) * tp
    }
}

/// A token embedding and output head of `padded` ids in place of `wte` and
/// `head` (tied again if they were), the head masking the ids past the
/// real vocabulary.
pub(crate) fn padded_vocab_layers(wte: &Embedding, head: &Linear, padded: usize) -> Result<(Embedding, Linear)> {
    let (vocab, d) = (head.valid_outputs(), head.in_features());
    if padded < vocab {
        return Err(Error::Tessera(tessera::Error::invalid("with_vocab_padded_to", format!("{padded} ids cannot hold a vocabulary of {vocab}"))));
    }
    let tied = head.weight().same(wte.weight());
    let embedding = Embedding::new(padded, d)?;
    let mut lm_head = Linear::new(d, padded, head.bias().is_some())?.with_valid_outputs(vocab)?;
    if tied {
        lm_head.tie_weight(embedding.weight())?;
    }
    Ok((embedding, lm_head))
}

fn lcm(a: usize, b: usize) -> usize {
    let (mut x, mut y) = (a, b);
    while y != 0 {
        (x, y) = (y, x % y);
    }
    a / x * b
}

#[cfg(test)]
mod tests {
    use super::padded_vocab;

    #[test]
    fn a_vocabulary_is_padded_only_when_the_degree_does_not_divide_it() {
        assert_eq!(padded_vocab(50257, 1), 50257);
        assert_eq!(padded_vocab(50257, 2), 50304);
        assert_eq!(padded_vocab(50257, 4), 50304);
        assert_eq!(padded_vocab(50257, 8), 50304);
        assert_eq!(padded_vocab(32000, 8), 32000);
        assert_eq!(padded_vocab(301, 3), 384);
        // 192 would leave rank 2 of 3 with padding only.
        assert_eq!(padded_vocab(100, 3), 102);
        for tp in 1..=16 {
            for vocab in tp * tp..tp * tp + 300 {
                let p = padded_vocab(vocab, tp);
                assert!(p >= vocab && p.is_multiple_of(tp), "{vocab} over {tp}: {p}");
                // Every rank holds at least one real id, so no shard is all padding.
                assert!(p - vocab < p / tp || p == vocab, "{vocab} over {tp}: {p}");
            }
        }
    }
}
