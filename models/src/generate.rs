//! Greedy decoding on one rank, for evaluating a trained model.

use tessera::module::{Act, Cx, Module, Replicated, SplitHidden};
use tessera::Tensor;

/// Greedy completions of equal-length `prompts` by a model holding its whole
/// vocabulary (one rank): each of the `new_tokens` tokens is the most likely
/// one after the prompt and what was written so far (padded vocabulary ids,
/// whose logits the head masks, are never chosen). Returns the written ids.
/// Each token reruns the whole sequence: the models keep no KV cache.
pub fn greedy<M: Module<In = Replicated, Out = SplitHidden>>(
    model: &M,
    cx: &mut Cx,
    prompts: &[Vec<u32>],
    new_tokens: usize,
) -> tessera::Result<Vec<Vec<u32>>> {
    let Some(first) = prompts.first() else { return Ok(Vec::new()) };
    if prompts.iter().any(|p| p.len() != first.len() || p.is_empty()) {
        return Err(tessera::Error::invalid("greedy", "the prompts must be non-empty and of one length (they are decoded as one batch)"));
    }
    let mut seqs: Vec<Vec<u32>> = prompts.to_vec();
    for _ in 0..new_tokens {
        let (b, t) = (seqs.len(), seqs[0].len());
        let ids = Tensor::from_vec(seqs.concat(), [b, t], cx.device())?;
        let (logits, _) = model.forward(cx, Act::new(ids))?;
        let vocab = logits.tensor().dims()[2];
        let last = logits.tensor().narrow(1, t - 1, 1)?.contiguous()?.to_vec::<f32>()?;
        for (s, row) in seqs.iter_mut().zip(last.chunks(vocab)) {
            let best = row.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map_or(0, |(i, _)| i);
            s.push(best as u32);
        }
    }
    Ok(seqs.into_iter().zip(prompts).map(|(s, p)| s[p.len()..].to_vec()).collect())
}
