//! The files of a Hugging Face model directory that say how to tokenize for
//! the model, beside `tokenizer.json`: which tokens are special, whether BOS
//! is added, where generation ends, and the chat template.
//!
//! Each is read as JSON and then field by field, so that a wrong value is
//! reported by file and field with what it should be, and a field the
//! prompt side does not use can hold anything.

use serde_json::{Map, Value};
use std::path::{Path, PathBuf};
use tessera_core::{Error, Result};

/// The tokenizer's own settings (transformers' `tokenizer_config.json`).
pub(crate) const TOKENIZER_CONFIG: &str = "tokenizer_config.json";
/// The special tokens as `save_pretrained` writes them separately.
pub(crate) const SPECIAL_TOKENS_MAP: &str = "special_tokens_map.json";
/// The generation defaults, where `eos_token_id` may list several ids.
pub(crate) const GENERATION_CONFIG: &str = "generation_config.json";
/// The model's configuration, whose token ids stand in for a missing `generation_config.json`.
pub(crate) const MODEL_CONFIG: &str = "config.json";
/// The default chat template as transformers 4.43 and later save it.
pub(crate) const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";
/// The named templates as transformers saves them, one `NAME.jinja` each.
pub(crate) const CHAT_TEMPLATES_DIR: &str = "additional_chat_templates";

/// The name of the template used when none is asked for.
pub(crate) const DEFAULT_TEMPLATE: &str = "default";

/// The special tokens' text, by role; `None` where the file does not set one.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct TokenTexts {
    pub bos: Option<String>,
    pub eos: Option<String>,
    pub unk: Option<String>,
    pub pad: Option<String>,
}

impl TokenTexts {
    /// These texts, each replaced by `other`'s where `other` has one.
    pub fn overridden_by(self, other: TokenTexts) -> TokenTexts {
        TokenTexts { bos: other.bos.or(self.bos), eos: other.eos.or(self.eos), unk: other.unk.or(self.unk), pad: other.pad.or(self.pad) }
    }
}

/// What `tokenizer_config.json` says.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct TokenizerConfig {
    pub tokens: TokenTexts,
    /// Whether encoding adds BOS; `None` leaves it to `tokenizer.json`'s post-processor.
    pub add_bos_token: Option<bool>,
    /// Whether encoding adds EOS; `None` as for BOS.
    pub add_eos_token: Option<bool>,
    /// `(name, source)`: one `default` for a plain string, or the named list.
    pub chat_templates: Vec<(String, String)>,
}

/// The token ids of `generation_config.json` (or `config.json`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct GenerationIds {
    pub bos: Option<u32>,
    /// Every id that ends generation, in the file's order.
    pub eos: Vec<u32>,
    pub pad: Option<u32>,
}

/// `path`'s JSON object, or `None` when there is no such file.
pub(crate) fn read_object(path: &Path) -> Result<Option<Map<String, Value>>> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::data_file_io(path, "cannot be read", e, "; check its permissions, or remove it")),
    };
    parse_object(path, &text).map(Some)
}

/// `text` (the contents of `path`) as a JSON object.
pub(crate) fn parse_object(path: &Path, text: &str) -> Result<Map<String, Value>> {
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(other) => {
            Err(Error::data_file(path, format!("holds a JSON {}, not an object; it must be a `{{...}}` object as Hugging Face writes it", kind(&other))))
        }
        Err(e) => Err(Error::data_file(path, format!("is not valid JSON ({e}); repair it, or copy it again from the model's repository"))),
    }
}

/// `tokenizer_config.json`'s fields.
pub(crate) fn tokenizer_config(path: &Path, map: &Map<String, Value>) -> Result<TokenizerConfig> {
    Ok(TokenizerConfig {
        tokens: token_texts(path, map)?,
        add_bos_token: flag(path, map, "add_bos_token")?,
        add_eos_token: flag(path, map, "add_eos_token")?,
        chat_templates: chat_templates(path, map)?,
    })
}

/// The special tokens' text in `map` (`tokenizer_config.json` or `special_tokens_map.json`).
pub(crate) fn token_texts(path: &Path, map: &Map<String, Value>) -> Result<TokenTexts> {
    Ok(TokenTexts {
        bos: token_text(path, map, "bos_token")?,
        eos: token_text(path, map, "eos_token")?,
        unk: token_text(path, map, "unk_token")?,
        pad: token_text(path, map, "pad_token")?,
    })
}

/// A special token's text: a string, or transformers' serialised
/// `AddedToken` (`{"content": "<s>", "lstrip": false, ...}`), or null.
fn token_text(path: &Path, map: &Map<String, Value>, field: &str) -> Result<Option<String>> {
    match map.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Object(token)) => match token.get("content") {
            Some(Value::String(s)) => Ok(Some(s.clone())),
            _ => Err(field_error(path, field, "is an object without a `content` string; write the token as a string, such as \"<s>\"")),
        },
        Some(other) => Err(field_error(
            path,
            field,
            &format!("is a JSON {}; it must be the token's text (a string), an object with a `content` string, or null", kind(other)),
        )),
    }
}

/// A boolean field, or `None` when absent or null.
fn flag(path: &Path, map: &Map<String, Value>, field: &str) -> Result<Option<bool>> {
    match map.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(other) => Err(field_error(path, field, &format!("is a JSON {}; it must be true, false or null", kind(other)))),
    }
}

/// `chat_template`: a string, or a list of `{"name", "template"}` objects.
fn chat_templates(path: &Path, map: &Map<String, Value>) -> Result<Vec<(String, String)>> {
    match map.get("chat_template") {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![(DEFAULT_TEMPLATE.to_string(), s.clone())]),
        Some(Value::Array(list)) => {
            let mut templates: Vec<(String, String)> = Vec::with_capacity(list.len());
            for (i, entry) in list.iter().enumerate() {
                let (Some(Value::String(name)), Some(Value::String(template))) = (entry.get("name"), entry.get("template")) else {
                    return Err(field_error(
                        path,
                        &format!("chat_template[{i}]"),
                        "must be an object with a `name` string and a `template` string, as transformers writes named templates",
                    ));
                };
                if templates.iter().any(|(n, _)| n == name) {
                    return Err(field_error(
                        path,
                        &format!("chat_template[{i}]"),
                        &format!("repeats the template name `{name}`; give each template its own name"),
                    ));
                }
                templates.push((name.clone(), template.clone()));
            }
            Ok(templates)
        }
        Some(other) => Err(field_error(
            path,
            "chat_template",
            &format!("is a JSON {}; it must be the template's Jinja source (a string), or a list of `{{\"name\", \"template\"}}` objects", kind(other)),
        )),
    }
}

/// The token ids of `generation_config.json` or `config.json`.
pub(crate) fn generation_ids(path: &Path, map: &Map<String, Value>) -> Result<GenerationIds> {
    let eos = match map.get("eos_token_id") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(ids)) => {
            let mut eos = Vec::with_capacity(ids.len());
            for (i, id) in ids.iter().enumerate() {
                eos.push(token_id(path, &format!("eos_token_id[{i}]"), id)?);
            }
            eos
        }
        Some(id) => vec![token_id(path, "eos_token_id", id)?],
    };
    let single = |field: &str| match map.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(id) => token_id(path, field, id).map(Some),
    };
    Ok(GenerationIds { bos: single("bos_token_id")?, eos, pad: single("pad_token_id")? })
}

/// A token id: a JSON integer in `0..2^32`.
fn token_id(path: &Path, field: &str, value: &Value) -> Result<u32> {
    value
        .as_u64()
        .and_then(|id| u32::try_from(id).ok())
        .ok_or_else(|| field_error(path, field, &format!("is {value}; a token id must be an integer from 0 to {}", u32::MAX)))
}

/// The chat templates saved as files: `chat_template.jinja` (the default)
/// and `additional_chat_templates/NAME.jinja`, in name order.
pub(crate) fn template_files(dir: &Path) -> Result<Vec<(String, String, PathBuf)>> {
    let mut found = Vec::new();
    let default = dir.join(CHAT_TEMPLATE_FILE);
    if let Some(source) = read_text(&default)? {
        found.push((DEFAULT_TEMPLATE.to_string(), source, default));
    }
    let named = dir.join(CHAT_TEMPLATES_DIR);
    let entries = match std::fs::read_dir(&named) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(found),
        Err(e) => return Err(Error::data_file_io(&named, "cannot be listed", e, "; check its permissions")),
    };
    let mut files: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.extension().is_some_and(|x| x == "jinja")).collect();
    files.sort();
    for path in files {
        let Some(name) = path.file_stem().and_then(|s| s.to_str()).map(str::to_string) else {
            continue;
        };
        if let Some(source) = read_text(&path)? {
            found.push((name, source, path));
        }
    }
    Ok(found)
}

/// A text file, or `None` when there is no such file.
fn read_text(path: &Path) -> Result<Option<String>> {
    match std::fs::read(path) {
        Ok(bytes) => String::from_utf8(bytes).map(Some).map_err(|_| Error::data_file(path, "is not UTF-8 text; save the template as UTF-8")),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::data_file_io(path, "cannot be read", e, "; check its permissions, or remove it")),
    }
}

/// An error on `field` of `path`.
fn field_error(path: &Path, field: &str, detail: &str) -> Error {
    Error::data_file(path, format!("field `{field}` {detail}"))
}

/// The JSON kind of `v`, for messages.
fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}
