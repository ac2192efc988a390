//! What transformers adds to Jinja for chat templates, on a minijinja
//! environment: the same settings, functions and filters, so that a
//! template renders here to the bytes it renders to in Python.
//!
//! transformers compiles a template in an `ImmutableSandboxedEnvironment`
//! with `trim_blocks`, `lstrip_blocks` and the loop-controls extension,
//! replaces `tojson`, and adds the globals `raise_exception(message)` and
//! `strftime_now(format)`. Python's string and dict methods (`.strip()`,
//! `.items()`) come with Jinja for free; here they come from
//! minijinja-contrib's `pycompat`.

use super::pyjson::tojson_filter;
use super::strftime::UtcTime;
use minijinja::syntax::SyntaxConfig;
use minijinja::{Environment, Error, ErrorKind, Value};
use std::time::SystemTime;

/// The work one render may do (about one unit per instruction, and one per
/// 64 bytes of data). A long real conversation through Llama 3.2's template
/// needs a few hundred thousand; this leaves room for very long chats while
/// a template that loops over `range(10**9)` stops in a fraction of a second.
pub(crate) const RENDER_FUEL: u64 = 50_000_000;

/// The error a template raised with `raise_exception(message)`: a refusal of
/// the conversation it was given, not a fault of the template.
#[derive(Debug)]
pub(crate) struct TemplateRaised(pub String);

impl std::fmt::Display for TemplateRaised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for TemplateRaised {}

/// Where `strftime_now` takes the time from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub(crate) enum Clock {
    /// The system clock, at each call.
    #[default]
    System,
    /// A fixed time: reproducible prompts and tests.
    Fixed(SystemTime),
}

impl Clock {
    fn now(self) -> SystemTime {
        match self {
            Clock::System => SystemTime::now(),
            Clock::Fixed(t) => t,
        }
    }
}

/// An environment set up as transformers sets up its own.
pub(crate) fn environment(clock: Clock) -> Environment<'static> {
    let mut env = Environment::new();
    // The builder fails only for delimiters that collide; these are Jinja's own.
    if let Ok(syntax) = SyntaxConfig::builder().trim_blocks(true).lstrip_blocks(true).build() {
        env.set_syntax(syntax);
    }
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_fuel(Some(RENDER_FUEL));
    // Python prints `None` where minijinja would print `none`.
    env.set_formatter(
        |out, state, value| {
            if value.is_none() {
                out.write_str("None").map_err(Error::from)
            } else {
                minijinja::escape_formatter(out, state, value)
            }
        },
    );
    env.add_filter("tojson", tojson_filter);
    env.add_function("raise_exception", raise_exception);
    set_clock(&mut env, clock);
    env
}

/// Points `strftime_now` at `clock`.
pub(crate) fn set_clock(env: &mut Environment<'static>, clock: Clock) {
    env.add_function("strftime_now", move |format: &str| -> Value { Value::from(UtcTime::of(clock.now()).format(format)) });
}

/// `raise_exception(message)`: fails the render with the template's message,
/// marked so that the caller can tell it from a broken template.
fn raise_exception(message: &Value) -> Result<Value, Error> {
    let message = match message.as_str() {
        Some(s) => s.to_string(),
        None => message.to_string(),
    };
    Err(Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(TemplateRaised(message)))
}

/// The message of the `raise_exception` call behind `error`, if it was one.
pub(crate) fn raised_message(error: &Error) -> Option<&str> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(error);
    while let Some(e) = source {
        if let Some(raised) = e.downcast_ref::<TemplateRaised>() {
            return Some(&raised.0);
        }
        source = e.source();
    }
    None
}
