//! What a user asks a model: a plain text, or a conversation of chat messages.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// One message of a conversation, as the OpenAI chat API and Hugging Face's
/// `apply_chat_template` take it: a `role` (`system`, `user`, `assistant`,
/// `tool`, or whatever the model's template knows) and its `content`.
///
/// The chat template sees the message as a dict with exactly these keys, in
/// this order, followed by `extra` (`tool_calls`, `name`, `tool_call_id`, ...):
/// templates test for keys (`'tool_calls' in message`), so a key is there
/// only when it was given.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// Who speaks.
    pub role: String,
    /// What is said: usually a string; `null` for an assistant turn that only
    /// calls tools, or a list of parts (`[{"type": "text", "text": ...}]`)
    /// for templates that take them.
    #[serde(default)]
    pub content: Value,
    /// Any other keys of the message, passed to the template as they are.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl ChatMessage {
    /// A message of `role` whose content is the string `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage { role: role.into(), content: Value::String(content.into()), extra: Map::new() }
    }

    /// A `system` message.
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }

    /// A `user` message.
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }

    /// An `assistant` message.
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }

    /// This message with one more key (`tool_calls`, `name`, ...).
    pub fn with(mut self, key: impl Into<String>, value: Value) -> Self {
        self.extra.insert(key.into(), value);
        self
    }
}

/// How a conversation is rendered, beyond its messages: the arguments of
/// Hugging Face's `apply_chat_template`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ChatOptions {
    /// End the prompt with the header of an assistant turn (`<|im_start|>assistant\n`),
    /// so that what the model writes next is the answer. On for generation.
    pub add_generation_prompt: bool,
    /// The tool (function) schemas a tool-calling template lists, as JSON
    /// (OpenAI's `{"type": "function", "function": {...}}`). `None` is passed
    /// to the template as `none`, as transformers does.
    pub tools: Option<Vec<Value>>,
    /// Documents for retrieval-augmented templates (`{"title", "text"}`); `None` as for `tools`.
    pub documents: Option<Vec<Value>>,
    /// Which of the model's named templates to use (`tool_use`, `rag`);
    /// `None` is the default one.
    pub template: Option<String>,
    /// Further variables for the template (vLLM's `chat_template_kwargs`,
    /// such as `enable_thinking`); they override the special-token strings
    /// of the same name.
    pub kwargs: Map<String, Value>,
}

impl ChatOptions {
    /// The options of a prompt to generate from: `add_generation_prompt` on.
    pub fn generation() -> Self {
        ChatOptions { add_generation_prompt: true, ..ChatOptions::default() }
    }
}

/// A prompt as `tessera generate` and the server receive it.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    /// A plain text, encoded as it is (with the tokenizer's special tokens:
    /// BOS for Llama); no chat template is applied. Every model takes one.
    Text(String),
    /// A conversation, rendered by the model's chat template with a
    /// generation prompt; a model without a template refuses it.
    Chat(Vec<ChatMessage>),
}
