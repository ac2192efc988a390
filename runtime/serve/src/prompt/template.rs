//! A model's chat template: the Jinja program that lays out a conversation
//! as the text the model was trained on.

use super::globals::{self, Clock};
use super::message::{ChatMessage, ChatOptions};
use minijinja::value::Serde;
use minijinja::{Environment, ErrorKind, Value};
use std::collections::BTreeMap;
use std::time::SystemTime;
use tessera_core::{Error, Result};

/// The operation named in the errors of rendering.
const OP: &str = "chat template";

/// The name the source is compiled under; it carries no extension, so no
/// auto-escaping applies (a `.html` name would turn on HTML escaping).
const TEMPLATE_NAME: &str = "chat_template";

/// The variables transformers passes itself; a `kwargs` entry may not reuse them.
const RESERVED: [&str; 4] = ["messages", "tools", "documents", "add_generation_prompt"];

/// A compiled chat template, rendered as Hugging Face's `apply_chat_template`
/// renders it: Jinja with `trim_blocks` and `lstrip_blocks`, loop controls,
/// Python's string methods, transformers' `tojson`, `raise_exception` and
/// `strftime_now`, and the model's special tokens (`bos_token`,
/// `eos_token`, ...) as variables.
///
/// A template that calls `raise_exception` refuses the conversation: the
/// render fails with [`Error::InvalidArgument`] carrying the template's own
/// message (Mistral's "Conversation roles must alternate ..."). Any other
/// failure at render time is [`Error::Unsupported`]; a source that does not
/// compile is refused by [`ChatTemplate::new`].
///
/// `strftime_now` formats the current time in UTC (transformers uses the
/// machine's local time; a server's time zone says nothing about its users).
///
/// ```
/// use tessera::serve::prompt::{ChatMessage, ChatOptions, ChatTemplate};
/// # fn main() -> tessera::Result<()> {
/// let chatml = "{% for m in messages %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endfor %}\
///               {% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
/// let template = ChatTemplate::new(chatml)?;
/// let text = template.render(&[ChatMessage::user("Hi")], &ChatOptions::generation())?;
/// assert_eq!(text, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct ChatTemplate {
    source: String,
    env: Environment<'static>,
    /// `bos_token`, `eos_token`, ...: the special tokens' text, passed to every render.
    special_tokens: BTreeMap<String, String>,
}

impl ChatTemplate {
    /// Compiles `source`. A syntax error is an [`Error::InvalidArgument`]
    /// naming the line.
    pub fn new(source: impl Into<String>) -> Result<ChatTemplate> {
        let source = source.into();
        let mut env = globals::environment(Clock::System);
        env.add_template_owned(TEMPLATE_NAME, generation_blocks_as_ifs(&source))
            .map_err(|e| Error::invalid(OP, format!("the template does not compile: {}; correct the template's Jinja", describe(&e))))?;
        Ok(ChatTemplate { source, env, special_tokens: BTreeMap::new() })
    }

    /// This template with the special token `name` (`bos_token`,
    /// `eos_token`, `unk_token`, `pad_token`) spelt `text` in every render.
    pub fn with_special_token(mut self, name: impl Into<String>, text: impl Into<String>) -> Self {
        self.special_tokens.insert(name.into(), text.into());
        self
    }

    /// This template with `strftime_now` answering `time` rather than the
    /// clock's time: a prompt that writes today's date renders the same way
    /// on every run.
    pub fn with_fixed_time(mut self, time: SystemTime) -> Self {
        globals::set_clock(&mut self.env, Clock::Fixed(time));
        self
    }

    /// The Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The special tokens' text each render receives, by variable name.
    pub fn special_tokens(&self) -> &BTreeMap<String, String> {
        &self.special_tokens
    }

    /// The prompt text of `messages`. The context is what transformers
    /// passes: `messages`, `tools`, `documents`, `add_generation_prompt`,
    /// the special tokens, then `options.kwargs`.
    pub fn render(&self, messages: &[ChatMessage], options: &ChatOptions) -> Result<String> {
        let mut context: BTreeMap<String, Value> = BTreeMap::new();
        for (name, text) in &self.special_tokens {
            context.insert(name.clone(), Value::from(text.as_str()));
        }
        for (name, value) in &options.kwargs {
            if RESERVED.contains(&name.as_str()) {
                return Err(Error::invalid(
                    OP,
                    format!("the template variable `{name}` is set by the renderer itself; pass it through its own option, not `kwargs`"),
                ));
            }
            context.insert(name.clone(), Value::from(Serde(value)));
        }
        context.insert("messages".into(), Value::from(Serde(messages)));
        context.insert("tools".into(), options.tools.as_ref().map_or(Value::from(()), |t| Value::from(Serde(t))));
        context.insert("documents".into(), options.documents.as_ref().map_or(Value::from(()), |d| Value::from(Serde(d))));
        context.insert("add_generation_prompt".into(), Value::from(options.add_generation_prompt));
        let template = self.env.get_template(TEMPLATE_NAME).map_err(|e| Error::Unsupported { op: OP, detail: describe(&e) })?;
        template.render(Value::from(context)).map_err(|e| render_error(&e))
    }
}

/// The error of a failed render: the template's refusal, or its failure.
fn render_error(e: &minijinja::Error) -> Error {
    if let Some(message) = globals::raised_message(e) {
        return Error::invalid(OP, format!("the model's chat template refuses these messages: {message}"));
    }
    if e.kind() == ErrorKind::OutOfFuel {
        return Error::invalid(
            OP,
            format!("rendering took more than {} steps and was stopped; shorten the conversation, or the template loops without end", globals::RENDER_FUEL),
        );
    }
    Error::Unsupported {
        op: OP,
        detail: format!(
            "rendering failed: {}; the messages may not have the shape the template expects (check roles and content), or the template uses Jinja that Tessera's engine (minijinja) lacks",
            describe(e)
        ),
    }
}

/// A minijinja error in one line: what, and where in the template.
fn describe(e: &minijinja::Error) -> String {
    let what = e.detail().map_or_else(|| e.kind().to_string(), |d| format!("{}: {d}", e.kind()));
    match e.line() {
        Some(line) => format!("{what} (line {line})"),
        None => what,
    }
}

/// `source` with transformers' `{% generation %}` ... `{% endgeneration %}`
/// blocks written as `{% if true %}` ... `{% endif %}`. Training templates
/// mark the assistant's tokens with them (transformers' `AssistantTracker`
/// extension); when rendering a prompt the block is plain output, as an `if
/// true` is. The tag's whitespace control (`{%-`, `-%}`) is kept, so the
/// output is the same to the byte.
fn generation_blocks_as_ifs(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        let Some(end) = tag.find("%}") else {
            break;
        };
        let inner = &tag[2..end];
        let (open_mark, body) = match inner.strip_prefix(['-', '+']) {
            Some(b) => (&inner[..1], b),
            None => ("", inner),
        };
        let (body, close_mark) = match body.strip_suffix(['-', '+']) {
            Some(b) => (b, &body[b.len()..]),
            None => (body, ""),
        };
        let replacement = match body.trim() {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(r) => out.push_str(&format!("{{%{open_mark} {r} {close_mark}%}}")),
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_tags_become_ifs_with_their_whitespace_control() {
        assert_eq!(
            generation_blocks_as_ifs("a{% generation %}b{%- endgeneration -%} {%+generation%}{% if x %}{{ '%}' }}{% endif %}{% endgeneration"),
            "a{% if true %}b{%- endif -%} {%+ if true %}{% if x %}{{ '%}' }}{% endif %}{% endgeneration"
        );
        let t = ChatTemplate::new("{% for m in messages %}{%- generation -%}\n  [{{ m.content }}]\n{% endgeneration %}\n{% endfor %}").unwrap();
        assert_eq!(t.render(&[ChatMessage::user("a"), ChatMessage::assistant("b")], &ChatOptions::default()).unwrap(), "[a]\n[b]\n");
    }
}
