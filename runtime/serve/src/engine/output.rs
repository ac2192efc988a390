//! What a step reports for each request it advanced.

use crate::sampling::StopReason;

/// A request's handle, unique within one engine.
pub type RequestId = u64;

/// Why a request finished.
#[derive(Clone, Debug, PartialEq)]
pub enum FinishReason {
    /// A stop condition of its sampling parameters: end of sequence, a stop
    /// token or string, or `max_tokens`.
    Stop(StopReason),
    /// Prompt and output reached the model's context length.
    Length,
    /// The client cancelled it ([`Engine::abort`](super::Engine::abort)).
    Aborted,
    /// It could not go on (its logits were not finite, the cache cannot hold
    /// it, ...); the message names the problem. The other requests go on.
    Error(String),
}

/// One generated token with its log probability.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenOut {
    /// The token.
    pub id: u32,
    /// Its log probability (see [`Sampled`](crate::sampling::Sampled)).
    pub logprob: f32,
    /// The most likely alternatives, if the request asked for them.
    pub top: Vec<(u32, f32)>,
}

/// What one step did for one request: the tokens it generated (none while
/// its prompt is being prefilled in chunks), the text now safe to show, and
/// whether it finished.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestOutput {
    /// The request.
    pub id: RequestId,
    /// Tokens generated in this step.
    pub tokens: Vec<TokenOut>,
    /// Text to append to the output (empty without a detokenizer).
    pub text: String,
    /// Set on the request's last output.
    pub finished: Option<FinishReason>,
}
