//! The request bodies of `/v1/completions` and `/v1/chat/completions`, as
//! OpenAI's API defines them, and what they become for the engine: token
//! ids and [`SamplingParams`].
//!
//! Fields this server does not know are ignored (clients send `user`,
//! `logit_bias`, ...); a known field with a wrong type or value is a 400
//! naming it. Beyond OpenAI's fields the engine's own sampling knobs are
//! accepted as vLLM accepts them: `top_k`, `min_p`, `repetition_penalty`,
//! `ignore_eos`, `stop_token_ids`.

use serde::de::DeserializeOwned;
use serde::Deserialize;
use tessera_serve::prompt::ChatMessage;
use tessera_serve::sampling::{SamplingParams, MAX_LOGPROBS};

use crate::error::ApiError;

/// Reads a request body as a JSON object.
pub fn body(bytes: &[u8]) -> Result<serde_json::Value, ApiError> {
    let value: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| ApiError::invalid(format!("the body is not valid JSON: {e}"), None))?;
    if !value.is_object() {
        return Err(ApiError::invalid("the body must be a JSON object", None));
    }
    Ok(value)
}

/// A part of a request from its body, naming the field at fault when it
/// does not fit (`param` in the error).
pub fn part<T: DeserializeOwned>(body: &serde_json::Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(body).map_err(|e| {
        let path = e.path().to_string();
        let param = (path != "." && !path.is_empty()).then_some(path);
        let inner = e.into_inner();
        let message = match &param {
            Some(p) => format!("`{p}`: {inner}"),
            None => format!("the request {inner}"),
        };
        ApiError::invalid(message, param.as_deref())
    })
}

/// One string or several (`stop`).
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    /// A single string.
    One(String),
    /// A list.
    Many(Vec<String>),
}

impl OneOrMany {
    fn into_vec(self) -> Vec<String> {
        match self {
            OneOrMany::One(s) => vec![s],
            OneOrMany::Many(v) => v,
        }
    }
}

/// A completion's prompt: text or token ids, one or a batch.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum PromptInput {
    /// One text.
    Text(String),
    /// Several texts, each its own choices.
    Texts(Vec<String>),
    /// One prompt as token ids.
    Ids(Vec<u32>),
    /// Several prompts as token ids.
    IdLists(Vec<Vec<u32>>),
}

/// `stream_options`.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with the usage counts.
    #[serde(default)]
    pub include_usage: bool,
}

/// The sampling fields both endpoints share.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Sampling {
    /// Tokens to generate at most (must be ≥ 1).
    pub max_tokens: Option<i64>,
    /// Sampling temperature (0: greedy); OpenAI's default is 1.
    pub temperature: Option<f32>,
    /// Nucleus sampling.
    pub top_p: Option<f32>,
    /// Choices per prompt.
    pub n: Option<i64>,
    /// Strings that end the text (not included).
    pub stop: Option<OneOrMany>,
    /// Seed of the draws: the same seed gives the same text.
    pub seed: Option<u64>,
    /// OpenAI's presence penalty.
    pub presence_penalty: Option<f32>,
    /// OpenAI's frequency penalty.
    pub frequency_penalty: Option<f32>,
    /// Stream the answer as server-sent events.
    #[serde(default)]
    pub stream: bool,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Keep the `top_k` most likely tokens (vLLM's extension; 0 or -1: off).
    pub top_k: Option<i64>,
    /// Drop tokens below this share of the most likely one (vLLM's extension).
    pub min_p: Option<f32>,
    /// Repetition penalty (vLLM's extension; 1: off).
    pub repetition_penalty: Option<f32>,
    /// Keep generating past the end-of-sequence token (vLLM's extension).
    #[serde(default)]
    pub ignore_eos: bool,
    /// Token ids that end the text (vLLM's extension).
    #[serde(default)]
    pub stop_token_ids: Vec<u32>,
}

/// The body of `POST /v1/completions`.
#[derive(Clone, Debug, Deserialize)]
pub struct CompletionRequest {
    /// The model asked for.
    pub model: String,
    /// The prompt.
    pub prompt: PromptInput,
    /// Report log probabilities, with this many alternatives per token.
    pub logprobs: Option<i64>,
    /// Repeat the prompt before the completion.
    #[serde(default)]
    pub echo: bool,
    /// Sampling and streaming: read from the same body by [`part`] (a
    /// flattened field would lose the path of an error in it).
    #[serde(skip)]
    pub sampling: Sampling,
}

/// A chat message's content: text, or parts of which the text ones count.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Content parts (`{"type": "text", "text": ...}`).
    Parts(Vec<ContentPart>),
}

/// One part of a message's content.
#[derive(Clone, Debug, Deserialize)]
pub struct ContentPart {
    /// The part's type; only `text` is served.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    pub text: Option<String>,
}

/// One message of a chat.
#[derive(Clone, Debug, Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: String,
    /// What it says (absent or null: empty).
    pub content: Option<Content>,
}

/// The body of `POST /v1/chat/completions`.
#[derive(Clone, Debug, Deserialize)]
pub struct ChatRequest {
    /// The model asked for.
    pub model: String,
    /// The conversation so far.
    pub messages: Vec<Message>,
    /// Whether to return the chosen tokens' log probabilities.
    #[serde(default)]
    pub logprobs: bool,
    /// Alternatives per token, with `logprobs`.
    pub top_logprobs: Option<i64>,
    /// OpenAI's newer name for `max_tokens`.
    pub max_completion_tokens: Option<i64>,
    /// Sampling and streaming: read from the same body by [`part`] (a
    /// flattened field would lose the path of an error in it).
    #[serde(skip)]
    pub sampling: Sampling,
}

impl ChatRequest {
    /// The messages as the chat template takes them.
    pub fn chat_messages(&self) -> Result<Vec<ChatMessage>, ApiError> {
        self.messages
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let text = match &m.content {
                    None => String::new(),
                    Some(Content::Text(t)) => t.clone(),
                    Some(Content::Parts(parts)) => {
                        let mut text = String::new();
                        for (j, p) in parts.iter().enumerate() {
                            match (p.kind.as_str(), &p.text) {
                                ("text", Some(t)) => text.push_str(t),
                                ("text", None) => return Err(ApiError::invalid("a text part needs `text`", Some(&format!("messages[{i}].content[{j}].text")))),
                                (other, _) => {
                                    return Err(ApiError::invalid(
                                        format!("content parts of type `{other}` are not served; this model reads text"),
                                        Some(&format!("messages[{i}].content[{j}].type")),
                                    ))
                                }
                            }
                        }
                        text
                    }
                };
                Ok(ChatMessage::new(m.role.clone(), text))
            })
            .collect()
    }
}

/// The most choices per prompt a request may ask for.
pub const MAX_N: i64 = 16;

impl Sampling {
    /// The engine's parameters for a model of `vocab` tokens, checked;
    /// `max_tokens` defaults to `default_max` and `logprobs` is the
    /// alternatives per token to report, if any.
    pub fn params(&self, default_max: usize, logprobs: Option<i64>, vocab: usize) -> Result<SamplingParams, ApiError> {
        let max_tokens = match self.max_tokens {
            Some(m) if m <= 0 => return Err(ApiError::invalid(format!("max_tokens must be at least 1, not {m}"), Some("max_tokens"))),
            Some(m) => usize::try_from(m).unwrap_or(usize::MAX),
            None => default_max,
        };
        let top_k = match self.top_k {
            None | Some(-1) | Some(0) => 0,
            Some(k) if k < 0 => return Err(ApiError::invalid(format!("top_k must be -1 (off) or at least 1, not {k}"), Some("top_k"))),
            Some(k) => usize::try_from(k).unwrap_or(usize::MAX),
        };
        let logprobs = match logprobs {
            None => None,
            Some(k) if !(0..=MAX_LOGPROBS as i64).contains(&k) => {
                return Err(ApiError::invalid(format!("logprobs must be 0 to {MAX_LOGPROBS}, not {k}"), Some("logprobs")))
            }
            Some(k) => Some(k as usize),
        };
        let defaults = SamplingParams::default();
        let params = SamplingParams {
            // OpenAI's default temperature is 1, as is the engine's.
            temperature: self.temperature.unwrap_or(defaults.temperature),
            top_p: self.top_p.unwrap_or(defaults.top_p),
            top_k,
            min_p: self.min_p.unwrap_or(defaults.min_p),
            repetition_penalty: self.repetition_penalty.unwrap_or(defaults.repetition_penalty),
            presence_penalty: self.presence_penalty.unwrap_or(defaults.presence_penalty),
            frequency_penalty: self.frequency_penalty.unwrap_or(defaults.frequency_penalty),
            seed: self.seed,
            max_tokens,
            stop: self.stop.clone().map(OneOrMany::into_vec).unwrap_or_default(),
            stop_token_ids: self.stop_token_ids.clone(),
            ignore_eos: self.ignore_eos,
            logprobs,
            ..defaults
        };
        params.validate(vocab).map_err(|e| ApiError::invalid(e.to_string(), None))?;
        Ok(params)
    }

    /// Choices per prompt, checked.
    pub fn choices(&self) -> Result<usize, ApiError> {
        match self.n.unwrap_or(1) {
            n if (1..=MAX_N).contains(&n) => Ok(n as usize),
            n => Err(ApiError::invalid(format!("n must be 1 to {MAX_N}, not {n}"), Some("n"))),
        }
    }
}
