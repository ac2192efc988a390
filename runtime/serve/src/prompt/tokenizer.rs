//! A model directory's tokenizer with everything the prompt side needs
//! around it: the special tokens, BOS and EOS behaviour, the ids that end
//! generation, and the chat templates.

use super::files::{self, GenerationIds, TokenTexts, DEFAULT_TEMPLATE, GENERATION_CONFIG, MODEL_CONFIG, SPECIAL_TOKENS_MAP, TOKENIZER_CONFIG};
use super::message::{ChatMessage, ChatOptions, Prompt};
use super::template::ChatTemplate;
use crate::sampling::SamplingParams;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tessera_core::{Error, Result};
use tessera_data::{SpecialTokens, Tokenizer};

/// The tokenizer file of a model directory.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// A special token: its text and its id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpecialToken {
    /// How it is spelt (`<s>`, `<|eot_id|>`); chat templates write this text.
    pub text: String,
    /// Its id in the vocabulary.
    pub id: u32,
}

/// The tokenizer of a model directory (a Hugging Face model, or a
/// Tessera export or run that kept its tokenizer files): text and chat
/// messages to token ids, and ids back to text.
///
/// [`ModelTokenizer::from_dir`] reads `tokenizer.json` with the data crate's
/// loader, and beside it, where present, transformers' files:
///
/// - `tokenizer_config.json`: the special tokens (`bos_token`, `eos_token`,
///   `unk_token`, `pad_token`), `add_bos_token` / `add_eos_token`, and
///   `chat_template` (a string, or a list of named templates of which
///   `default` is used unless another is asked for);
/// - `special_tokens_map.json`: special tokens that override the config's,
///   as transformers lets them;
/// - `chat_template.jinja` and `additional_chat_templates/NAME.jinja`, where
///   recent transformers saves templates (they override the config's);
/// - `generation_config.json` (or, without it, `config.json`): `bos_token_id`,
///   `pad_token_id` and `eos_token_id`, which may list several ids (Llama 3
///   Instruct ends a turn with `<|eot_id|>` and a text with `<|end_of_text|>`).
///
/// Cloning is cheap: the tokenizer is shared, as one serves every request.
#[derive(Clone, Debug)]
pub struct ModelTokenizer {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    dir: PathBuf,
    tokenizer: Tokenizer,
    /// Counted once: `tokenizers` counts by building the whole vocabulary map.
    vocab_size: usize,
    bos: Option<SpecialToken>,
    eos: Option<SpecialToken>,
    unk: Option<SpecialToken>,
    pad: Option<SpecialToken>,
    /// Every id that ends generation: `eos`'s first, then the generation config's.
    eos_ids: Vec<u32>,
    add_bos: Option<bool>,
    add_eos: Option<bool>,
    templates: Vec<NamedTemplate>,
}

/// A chat template as found in the directory. One that does not compile is
/// kept as its error: plain prompts still work, and a chat reports it.
#[derive(Debug)]
struct NamedTemplate {
    name: String,
    path: PathBuf,
    compiled: std::result::Result<ChatTemplate, String>,
}

impl ModelTokenizer {
    /// Loads the tokenizer of the model directory `dir`. Every file but
    /// `tokenizer.json` is optional; one that is there must be well formed,
    /// and the error of one that is not names the file, the field and the
    /// fix. A chat template that does not compile is reported when a chat
    /// is rendered, not here.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<ModelTokenizer> {
        let dir = dir.as_ref();
        if !dir.is_dir() {
            return Err(Error::data_file(dir, "is not a directory; pass the model's directory (the one holding tokenizer.json and config.json)"));
        }
        let tokenizer_path = dir.join(TOKENIZER_FILE);
        if !tokenizer_path.is_file() {
            return Err(Error::data_file(
                &tokenizer_path,
                "is missing; the model directory needs its tokenizer.json (a directory with only a SentencePiece `tokenizer.model` can be converted with \
                 transformers: `AutoTokenizer.from_pretrained(dir).save_pretrained(dir)`)",
            ));
        }
        let tokenizer = Tokenizer::load(&tokenizer_path)?;

        let config_path = dir.join(TOKENIZER_CONFIG);
        let config = match files::read_object(&config_path)? {
            Some(map) => files::tokenizer_config(&config_path, &map)?,
            None => files::TokenizerConfig::default(),
        };
        let map_path = dir.join(SPECIAL_TOKENS_MAP);
        let mapped = match files::read_object(&map_path)? {
            Some(map) => files::token_texts(&map_path, &map)?,
            None => TokenTexts::default(),
        };
        // Which file each token's text came from, to name it in errors.
        let source = |from_map: bool| if from_map { &map_path } else { &config_path };
        let sources = (source(mapped.bos.is_some()).clone(), source(mapped.eos.is_some()).clone());
        let texts = config.tokens.clone().overridden_by(mapped);

        let (ids, ids_path) = generation_ids(dir)?;
        let bos = resolve(&tokenizer, texts.bos.as_deref(), &sources.0, "bos_token", ids.bos, &ids_path, "bos_token_id")?;
        let eos = resolve(&tokenizer, texts.eos.as_deref(), &sources.1, "eos_token", ids.eos.first().copied(), &ids_path, "eos_token_id")?;
        // UNK and PAD matter for neither prompts nor stopping: a name the
        // vocabulary lacks is dropped rather than refused.
        let lenient = |text: Option<&str>, id: Option<u32>| match text {
            Some(text) => tokenizer.token_id(text).map(|id| SpecialToken { text: text.to_string(), id }),
            None => id.and_then(|id| tokenizer.token(id).map(|text| SpecialToken { text, id })),
        };
        let unk = lenient(texts.unk.as_deref(), None);
        let pad = lenient(texts.pad.as_deref(), ids.pad);

        let vocab = tokenizer.vocab_size();
        let mut eos_ids: Vec<u32> = eos.iter().map(|t| t.id).collect();
        for (i, &id) in ids.eos.iter().enumerate() {
            if id as usize >= vocab {
                return Err(Error::data_file(
                    &ids_path,
                    format!(
                        "field `eos_token_id` lists id {id} (entry {i}), outside the tokenizer's {vocab} ids; the file belongs to another model's tokenizer"
                    ),
                ));
            }
            if !eos_ids.contains(&id) {
                eos_ids.push(id);
            }
        }
        for (flag, field, token, role) in [(config.add_bos_token, "add_bos_token", &bos, "BOS"), (config.add_eos_token, "add_eos_token", &eos, "EOS")] {
            if flag == Some(true) && token.is_none() {
                return Err(Error::data_file(
                    &config_path,
                    format!(
                        "field `{field}` is true but the tokenizer has no {role} token; name it (`{}`) or set `{field}` to false",
                        field.replace("add_", "")
                    ),
                ));
            }
        }

        let templates = templates(dir, &config_path, config.chat_templates, &texts)?;
        Ok(ModelTokenizer {
            inner: Arc::new(Inner {
                dir: dir.to_path_buf(),
                tokenizer,
                vocab_size: vocab,
                bos,
                eos,
                unk,
                pad,
                eos_ids,
                add_bos: config.add_bos_token,
                add_eos: config.add_eos_token,
                templates,
            }),
        })
    }

    /// The directory the tokenizer was loaded from.
    pub fn dir(&self) -> &Path {
        &self.inner.dir
    }

    /// The tokenizer itself.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.inner.tokenizer
    }

    /// The number of ids the tokenizer produces (special tokens included);
    /// a model's vocabulary may be larger (padded), never smaller.
    pub fn vocab_size(&self) -> usize {
        self.inner.vocab_size
    }

    /// The beginning-of-sequence token, if the model has one.
    pub fn bos(&self) -> Option<&SpecialToken> {
        self.inner.bos.as_ref()
    }

    /// The end-of-sequence token: `eos_token`, or the first id of the
    /// generation config when no text names it.
    pub fn eos(&self) -> Option<&SpecialToken> {
        self.inner.eos.as_ref()
    }

    /// The unknown-token token, if it is in the vocabulary.
    pub fn unk(&self) -> Option<&SpecialToken> {
        self.inner.unk.as_ref()
    }

    /// The padding token, if it is in the vocabulary.
    pub fn pad(&self) -> Option<&SpecialToken> {
        self.inner.pad.as_ref()
    }

    /// Every id that ends generation: [`eos`](Self::eos)'s first, then those
    /// of `generation_config.json`'s `eos_token_id`, without repeats.
    pub fn eos_ids(&self) -> &[u32] {
        &self.inner.eos_ids
    }

    /// `tokenizer_config.json`'s `add_bos_token`: whether [`encode`](Self::encode)
    /// with special tokens adds BOS (`None`: as `tokenizer.json`'s post-processor says).
    pub fn add_bos_token(&self) -> Option<bool> {
        self.inner.add_bos
    }

    /// Sets `params`' end of generation from the model, as vLLM does: the
    /// EOS token becomes `eos_token_id` (unless one is set), and the other
    /// ids of [`eos_ids`](Self::eos_ids) join `stop_token_ids`.
    pub fn set_stop_ids(&self, params: &mut SamplingParams) {
        if params.eos_token_id.is_none() {
            params.eos_token_id = self.inner.eos_ids.first().copied();
        }
        for &id in &self.inner.eos_ids {
            if params.eos_token_id != Some(id) && !params.stop_token_ids.contains(&id) {
                params.stop_token_ids.push(id);
            }
        }
    }

    /// The token ids of `text`. With [`SpecialTokens::Added`] the special
    /// tokens are added as Hugging Face's `encode` adds them: where
    /// `tokenizer_config.json` sets `add_bos_token` or `add_eos_token`, BOS
    /// and EOS as they say (an absent one is false), as transformers' Llama
    /// and Gemma tokenizers rebuild their post-processor from them;
    /// otherwise as `tokenizer.json`'s post-processor says. Special tokens
    /// written in the text (`<|eot_id|>`) are always recognised.
    pub fn encode(&self, text: &str, special: SpecialTokens) -> Result<Vec<u32>> {
        let inner = &*self.inner;
        if special == SpecialTokens::Omitted || (inner.add_bos.is_none() && inner.add_eos.is_none()) {
            return inner.tokenizer.encode_with(text, special);
        }
        let body = inner.tokenizer.encode_with(text, SpecialTokens::Omitted)?;
        let bos = inner.bos.as_ref().filter(|_| inner.add_bos == Some(true)).map(|t| t.id);
        let eos = inner.eos.as_ref().filter(|_| inner.add_eos == Some(true)).map(|t| t.id);
        Ok(bos.into_iter().chain(body).chain(eos).collect())
    }

    /// The text of `ids`, with or without the special tokens' text.
    pub fn decode(&self, ids: &[u32], special: SpecialTokens) -> Result<String> {
        self.inner.tokenizer.decode_with(ids, special)
    }

    /// Whether the model has a default chat template.
    pub fn has_chat_template(&self) -> bool {
        self.inner.templates.iter().any(|t| t.name == DEFAULT_TEMPLATE)
    }

    /// The names of the model's chat templates (`default`, `tool_use`, ...).
    pub fn chat_template_names(&self) -> Vec<&str> {
        self.inner.templates.iter().map(|t| t.name.as_str()).collect()
    }

    /// The chat template named `name`, or the default one: an
    /// [`Error::InvalidArgument`] when there is none, an
    /// [`Error::DataFile`] naming the file when it does not compile.
    pub fn chat_template(&self, name: Option<&str>) -> Result<&ChatTemplate> {
        const OP: &str = "ModelTokenizer::chat";
        let wanted = name.unwrap_or(DEFAULT_TEMPLATE);
        let Some(found) = self.inner.templates.iter().find(|t| t.name == wanted) else {
            let dir = self.inner.dir.display();
            return Err(if self.inner.templates.is_empty() {
                Error::invalid(
                    OP,
                    format!(
                        "the model in `{dir}` has no chat template (no `chat_template` in {TOKENIZER_CONFIG}, no {}), so chat messages cannot be made into a prompt; \
                         send a plain text prompt, or add the template the model was trained with",
                        files::CHAT_TEMPLATE_FILE
                    ),
                )
            } else {
                Error::invalid(OP, format!("the model in `{dir}` has no chat template named `{wanted}`; it has {}", self.chat_template_names().join(", ")))
            });
        };
        found.compiled.as_ref().map_err(|e| Error::data_file(&found.path, format!("chat template `{}` {e}", found.name)))
    }

    /// The prompt text of a conversation: the chat template
    /// (`options.template`, or the default) rendered with `messages`.
    pub fn render_chat(&self, messages: &[ChatMessage], options: &ChatOptions) -> Result<String> {
        self.chat_template(options.template.as_deref())?.render(messages, options)
    }

    /// The prompt ids of a conversation, with the assistant's turn opened
    /// when `add_generation_prompt` is on: the rendered template, encoded
    /// without adding special tokens (the template writes BOS itself, as
    /// Hugging Face's `apply_chat_template` does).
    pub fn chat(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<Vec<u32>> {
        self.chat_with(messages, &ChatOptions { add_generation_prompt, ..ChatOptions::default() })
    }

    /// [`chat`](Self::chat) with every option of the render (tools, a
    /// named template, template variables).
    pub fn chat_with(&self, messages: &[ChatMessage], options: &ChatOptions) -> Result<Vec<u32>> {
        let text = self.render_chat(messages, options)?;
        self.encode(&text, SpecialTokens::Omitted)
    }

    /// The prompt ids of a `tessera generate` or server prompt: a plain text
    /// is encoded with the special tokens (a model without a chat template
    /// takes only this); a conversation goes through the chat template with
    /// the generation prompt.
    pub fn encode_prompt(&self, prompt: &Prompt) -> Result<Vec<u32>> {
        match prompt {
            Prompt::Text(text) => self.encode(text, SpecialTokens::Added),
            Prompt::Chat(messages) => self.chat(messages, true),
        }
    }
}

/// The token ids of `generation_config.json`, or of `config.json` without it,
/// and the file they came from.
fn generation_ids(dir: &Path) -> Result<(GenerationIds, PathBuf)> {
    for name in [GENERATION_CONFIG, MODEL_CONFIG] {
        let path = dir.join(name);
        if let Some(map) = files::read_object(&path)? {
            return Ok((files::generation_ids(&path, &map)?, path));
        }
    }
    Ok((GenerationIds::default(), dir.join(GENERATION_CONFIG)))
}

/// A special token from its text (`text`, set in `text_path`'s `text_field`)
/// or, without one, from an id (`id`, in `id_path`'s `id_field`). A text
/// or id the vocabulary lacks is an error: the prompt or the stop would
/// silently be wrong.
fn resolve(
    tokenizer: &Tokenizer,
    text: Option<&str>,
    text_path: &Path,
    text_field: &str,
    id: Option<u32>,
    id_path: &Path,
    id_field: &str,
) -> Result<Option<SpecialToken>> {
    if let Some(text) = text {
        return match tokenizer.token_id(text) {
            Some(id) => Ok(Some(SpecialToken { text: text.to_string(), id })),
            None => Err(Error::data_file(
                text_path,
                format!("field `{text_field}` is {text:?}, which is not a token of {TOKENIZER_FILE}; the files come from different tokenizers, or the name is misspelt"),
            )),
        };
    }
    match id {
        None => Ok(None),
        Some(id) => match tokenizer.token(id) {
            Some(text) => Ok(Some(SpecialToken { text, id })),
            None => Err(Error::data_file(
                id_path,
                format!("field `{id_field}` is {id}, outside the tokenizer's {} ids; the file belongs to another model's tokenizer", tokenizer.vocab_size()),
            )),
        },
    }
}

/// The chat templates of `dir`: `tokenizer_config.json`'s, overridden by
/// the template files of the same name; each compiled with the special
/// tokens' text.
fn templates(dir: &Path, config_path: &Path, from_config: Vec<(String, String)>, texts: &TokenTexts) -> Result<Vec<NamedTemplate>> {
    let mut sources: Vec<(String, String, PathBuf)> = from_config.into_iter().map(|(name, source)| (name, source, config_path.to_path_buf())).collect();
    for (name, source, path) in files::template_files(dir)? {
        match sources.iter_mut().find(|(n, _, _)| *n == name) {
            Some(entry) => *entry = (name, source, path),
            None => sources.push((name, source, path)),
        }
    }
    let special = [("bos_token", &texts.bos), ("eos_token", &texts.eos), ("unk_token", &texts.unk), ("pad_token", &texts.pad)];
    Ok(sources
        .into_iter()
        .map(|(name, source, path)| {
            let compiled = ChatTemplate::new(source)
                .map(|t| {
                    special
                        .iter()
                        .filter_map(|(var, text)| text.as_ref().map(|text| (var, text)))
                        .fold(t, |t, (var, text)| t.with_special_token(*var, text.clone()))
                })
                .map_err(|e| e.to_string());
            NamedTemplate { name, path, compiled }
        })
        .collect())
}
