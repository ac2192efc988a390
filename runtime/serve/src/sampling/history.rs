//! The tokens a request has seen, counted for the penalties.

use std::collections::HashMap;

use tessera_core::{Error, Result};

use super::SamplingParams;

/// How often one token occurs in a request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Occurrences {
    in_prompt: u32,
    in_output: u32,
}

/// A request's prompt and generated tokens, with per-token counts kept up to
/// date as tokens are pushed, so that applying the penalties costs one visit
/// per distinct token seen rather than a scan of the whole sequence.
#[derive(Clone, Debug, Default)]
pub struct History {
    prompt: Vec<u32>,
    generated: Vec<u32>,
    counts: HashMap<u32, Occurrences>,
}

impl History {
    /// The history of a request that has generated nothing yet.
    pub fn new(prompt: &[u32]) -> Self {
        let mut counts: HashMap<u32, Occurrences> = HashMap::new();
        for &t in prompt {
            counts.entry(t).or_default().in_prompt += 1;
        }
        Self { prompt: prompt.to_vec(), generated: Vec::new(), counts }
    }

    /// Records a generated token.
    pub fn push(&mut self, token: u32) {
        self.generated.push(token);
        self.counts.entry(token).or_default().in_output += 1;
    }

    /// The prompt's tokens.
    pub fn prompt(&self) -> &[u32] {
        &self.prompt
    }

    /// The tokens generated so far, oldest first.
    pub fn generated(&self) -> &[u32] {
        &self.generated
    }

    /// How many times `token` was generated.
    pub fn output_count(&self, token: u32) -> u32 {
        self.counts.get(&token).map_or(0, |c| c.in_output)
    }

    /// Whether `token` occurs in the prompt or the output.
    pub fn contains(&self, token: u32) -> bool {
        self.counts.contains_key(&token)
    }

    /// Applies the repetition penalty (every token seen), then the frequency
    /// and presence penalties (generated tokens only), to raw logits, in
    /// vLLM's order. Masked (-inf) logits stay masked.
    pub(crate) fn apply_penalties(&self, params: &SamplingParams, logits: &mut [f64]) -> Result<()> {
        let repetition = f64::from(params.repetition_penalty);
        let (presence, frequency) = (f64::from(params.presence_penalty), f64::from(params.frequency_penalty));
        if repetition == 1.0 && presence == 0.0 && frequency == 0.0 {
            return Ok(());
        }
        for (&token, seen) in &self.counts {
            let Some(logit) = logits.get_mut(token as usize) else {
                return Err(Error::invalid("Sampler::sample", format!("the history holds token {token}, outside the vocabulary of {}", logits.len())));
            };
            if *logit == f64::NEG_INFINITY {
                continue;
            }
            *logit = if *logit > 0.0 { *logit / repetition } else { *logit * repetition };
            if seen.in_output > 0 {
                *logit -= frequency * f64::from(seen.in_output) + presence;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_data::Gen;

    /// The penalties as the papers and vLLM's docs state them, recounted from
    /// the raw token lists for each logit.
    fn reference(params: &SamplingParams, prompt: &[u32], output: &[u32], logits: &[f32]) -> Vec<f64> {
        let mut out: Vec<f64> = logits.iter().map(|&l| f64::from(l)).collect();
        for (t, l) in out.iter_mut().enumerate() {
            let t = t as u32;
            let n_out = output.iter().filter(|&&o| o == t).count() as f64;
            let seen = n_out > 0.0 || prompt.contains(&t);
            if seen && l.is_finite() {
                let r = f64::from(params.repetition_penalty);
                *l = if *l > 0.0 { *l / r } else { *l * r };
            }
            if n_out > 0.0 && l.is_finite() {
                *l -= f64::from(params.frequency_penalty) * n_out + f64::from(params.presence_penalty);
            }
        }
        out
    }

    #[test]
    fn penalties_match_a_recount_of_the_history_on_random_histories() {
        let mut g = Gen::new(2);
        for case in 0..300 {
            let vocab = 1 + g.below(50);
            let prompt = g.tokens(30, vocab);
            let output = g.tokens(30, vocab);
            let params = SamplingParams {
                repetition_penalty: [1.0, 0.5 + 2.0 * g.uniform() as f32][g.below(2)],
                presence_penalty: [0.0, (4.0 * g.uniform() - 2.0) as f32][g.below(2)],
                frequency_penalty: [0.0, (4.0 * g.uniform() - 2.0) as f32][g.below(2)],
                ..SamplingParams::default()
            };
            let logits = g.logits(vocab);
            let mut history = History::new(&prompt);
            for &t in &output {
                history.push(t);
            }
            let mut got: Vec<f64> = logits.iter().map(|&l| f64::from(l)).collect();
            history.apply_penalties(&params, &mut got).unwrap();
            let want = reference(&params, &prompt, &output, &logits);
            for (t, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(g == w || (g - w).abs() <= 1e-12 * w.abs().max(1.0), "case {case}, token {t}: {g} != {w} ({params:?})");
            }
            assert_eq!(history.generated(), &output[..]);
            assert_eq!(history.prompt(), &prompt[..]);
        }
    }

    #[test]
    fn a_history_token_outside_the_vocabulary_is_an_error() {
        let history = History::new(&[3]);
        let params = SamplingParams { repetition_penalty: 1.2, ..SamplingParams::default() };
        assert!(history.apply_penalties(&params, &mut [0.0; 3]).is_err());
    }
}
