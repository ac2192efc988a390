//! What a request asks of the sampler, and the check that it asks for something
//! meaningful.

use tessera_core::{Error, Result};

/// The most top alternatives a request may ask to have reported per token
/// (the bound OpenAI's API and vLLM's default use).
pub const MAX_LOGPROBS: usize = 20;

const OP: &str = "SamplingParams::validate";

/// How one request turns logits into tokens, and when it stops.
///
/// The fields follow vLLM's `SamplingParams` and Hugging Face's `generate`;
/// each value that switches a feature off is named in its doc. Call
/// [`SamplingParams::validate`] (the [`Sampler`](super::Sampler) does) before use.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Divides the logits before the softmax; 0 means greedy (the most likely
    /// token, ties to the lowest id). Must be finite and >= 0.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 is off. A value at or above
    /// the vocabulary size is accepted and means off, since a client may send
    /// one `top_k` to models of any vocabulary.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability adds up
    /// to at least `top_p`; 1 is off. Must be in (0, 1].
    pub top_p: f32,
    /// Drop the tokens less likely than `min_p` times the most likely one; 0 is
    /// off. Must be in [0, 1].
    pub min_p: f32,
    /// Hugging Face's repetition penalty over every token of the prompt and the
    /// output: a positive logit is divided by it, a negative one multiplied; 1
    /// is off. Must be finite and > 0.
    pub repetition_penalty: f32,
    /// OpenAI's presence penalty: subtracted once from the logit of every token
    /// already generated (the prompt does not count); 0 is off. Must be finite.
    pub presence_penalty: f32,
    /// OpenAI's frequency penalty: subtracted from a token's logit once per time
    /// it was generated (the prompt does not count); 0 is off. Must be finite.
    pub frequency_penalty: f32,
    /// The seed of the request's random draws; `None` takes the seed the
    /// engine gives the request. Greedy decoding ignores it.
    pub seed: Option<u64>,
    /// The most tokens to generate. Must be >= 1.
    pub max_tokens: usize,
    /// Tokens that end the generation; their text is not emitted. Each must be
    /// below the vocabulary size.
    pub stop_token_ids: Vec<u32>,
    /// Strings that end the generation; the output is cut before the first
    /// one to complete. None may be empty.
    pub stop: Vec<String>,
    /// The model's end-of-sequence token (the engine fills it in from the
    /// tokenizer); `None` if it has none. Must be below the vocabulary size.
    pub eos_token_id: Option<u32>,
    /// Keep generating past the end-of-sequence token (for benchmarks).
    pub ignore_eos: bool,
    /// How many most likely alternatives to report with each token, at most
    /// [`MAX_LOGPROBS`]; `None` reports none. The chosen token's own log
    /// probability is always reported.
    pub logprobs: Option<usize>,
}

impl Default for SamplingParams {
    /// vLLM's defaults: plain sampling at temperature 1, every filter and
    /// penalty off, 16 tokens.
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            max_tokens: 16,
            stop_token_ids: Vec::new(),
            stop: Vec::new(),
            eos_token_id: None,
            ignore_eos: false,
            logprobs: None,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding (temperature 0) with the other defaults.
    pub fn greedy() -> Self {
        Self { temperature: 0.0, ..Self::default() }
    }

    /// Whether the token is chosen by argmax rather than drawn.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Checks every field against a vocabulary of `vocab` tokens; the error
    /// names the first field out of range, its value and the range allowed.
    pub fn validate(&self, vocab: usize) -> Result<()> {
        if vocab == 0 {
            return Err(Error::invalid(OP, "the vocabulary is empty; a model needs at least one token to sample"));
        }
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(bad("temperature", self.temperature, "a finite value >= 0 (0 is greedy)"));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(bad("top_p", self.top_p, "(0, 1] (1 is off)"));
        }
        if !(self.min_p >= 0.0 && self.min_p <= 1.0) {
            return Err(bad("min_p", self.min_p, "[0, 1] (0 is off)"));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return Err(bad("repetition_penalty", self.repetition_penalty, "a finite value > 0 (1 is off)"));
        }
        if !self.presence_penalty.is_finite() {
            return Err(bad("presence_penalty", self.presence_penalty, "a finite value (0 is off)"));
        }
        if !self.frequency_penalty.is_finite() {
            return Err(bad("frequency_penalty", self.frequency_penalty, "a finite value (0 is off)"));
        }
        if self.max_tokens == 0 {
            return Err(bad("max_tokens", 0, "an integer >= 1"));
        }
        if let Some(n) = self.logprobs.filter(|&n| n > MAX_LOGPROBS) {
            return Err(bad("logprobs", n, &format!("[0, {MAX_LOGPROBS}]")));
        }
        if let Some(&id) = self.stop_token_ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(bad("stop_token_ids", id, &format!("token ids in [0, {vocab})")));
        }
        if let Some(id) = self.eos_token_id.filter(|&id| id as usize >= vocab) {
            return Err(bad("eos_token_id", id, &format!("a token id in [0, {vocab})")));
        }
        if let Some(i) = self.stop.iter().position(String::is_empty) {
            return Err(Error::invalid(OP, format!("stop[{i}] is the empty string, which would stop before the first token; remove it")));
        }
        Ok(())
    }
}

fn bad(field: &str, value: impl std::fmt::Display, range: &str) -> Error {
    Error::invalid(OP, format!("{field} is {value}; pass {range}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_data::Gen;

    const VOCAB: usize = 100;

    fn rejects(params: &SamplingParams, field: &str) {
        let err = params.validate(VOCAB).expect_err(&format!("{params:?} should be rejected")).to_string();
        assert!(err.contains(field), "the error `{err}` should name `{field}`");
    }

    #[test]
    fn defaults_and_greedy_are_valid() {
        SamplingParams::default().validate(VOCAB).unwrap();
        SamplingParams::greedy().validate(VOCAB).unwrap();
        SamplingParams::default().validate(1).unwrap();
    }

    #[test]
    fn every_out_of_range_value_is_rejected_with_its_field_named() {
        let mut g = Gen::new(1);
        let base = SamplingParams::default();
        let non_finite = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY];
        for _ in 0..200 {
            let negative = -g.uniform() as f32 * 10.0 - f32::MIN_POSITIVE;
            let above_one = 1.0 + f32::EPSILON + g.uniform() as f32 * 10.0;
            let nf = non_finite[g.below(3)];
            rejects(&SamplingParams { temperature: negative, ..base.clone() }, "temperature");
            rejects(&SamplingParams { temperature: nf, ..base.clone() }, "temperature");
            rejects(&SamplingParams { top_p: negative, ..base.clone() }, "top_p");
            rejects(&SamplingParams { top_p: 0.0, ..base.clone() }, "top_p");
            rejects(&SamplingParams { top_p: above_one, ..base.clone() }, "top_p");
            rejects(&SamplingParams { top_p: nf, ..base.clone() }, "top_p");
            rejects(&SamplingParams { min_p: negative, ..base.clone() }, "min_p");
            rejects(&SamplingParams { min_p: above_one, ..base.clone() }, "min_p");
            rejects(&SamplingParams { min_p: nf, ..base.clone() }, "min_p");
            rejects(&SamplingParams { repetition_penalty: negative, ..base.clone() }, "repetition_penalty");
            rejects(&SamplingParams { repetition_penalty: 0.0, ..base.clone() }, "repetition_penalty");
            rejects(&SamplingParams { repetition_penalty: nf, ..base.clone() }, "repetition_penalty");
            rejects(&SamplingParams { presence_penalty: nf, ..base.clone() }, "presence_penalty");
            rejects(&SamplingParams { frequency_penalty: nf, ..base.clone() }, "frequency_penalty");
            rejects(&SamplingParams { logprobs: Some(MAX_LOGPROBS + 1 + g.below(1000)), ..base.clone() }, "logprobs");
            let bad_id = (VOCAB + g.below(1000)) as u32;
            rejects(&SamplingParams { stop_token_ids: vec![g.below(VOCAB) as u32, bad_id], ..base.clone() }, "stop_token_ids");
            rejects(&SamplingParams { eos_token_id: Some(bad_id), ..base.clone() }, "eos_token_id");
        }
        rejects(&SamplingParams { max_tokens: 0, ..base.clone() }, "max_tokens");
        rejects(&SamplingParams { stop: vec!["ok".into(), String::new()], ..base.clone() }, "stop[1]");
        assert!(base.validate(0).is_err(), "an empty vocabulary is rejected");
    }

    #[test]
    fn the_edges_of_every_range_are_accepted() {
        let base = SamplingParams::default();
        for params in [
            SamplingParams { temperature: 0.0, ..base.clone() },
            SamplingParams { top_p: 1.0, ..base.clone() },
            SamplingParams { top_p: f32::MIN_POSITIVE, ..base.clone() },
            SamplingParams { min_p: 0.0, ..base.clone() },
            SamplingParams { min_p: 1.0, ..base.clone() },
            SamplingParams { top_k: VOCAB * 10, ..base.clone() },
            SamplingParams { presence_penalty: -2.0, frequency_penalty: 2.0, ..base.clone() },
            SamplingParams { logprobs: Some(MAX_LOGPROBS), ..base.clone() },
            SamplingParams { stop_token_ids: vec![0, VOCAB as u32 - 1], eos_token_id: Some(VOCAB as u32 - 1), ..base.clone() },
        ] {
            params.validate(VOCAB).unwrap_or_else(|e| panic!("{params:?} should be valid: {e}"));
        }
    }
}
