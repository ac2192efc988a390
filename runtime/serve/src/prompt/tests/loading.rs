//! Loading a model directory: special tokens from each of transformers'
//! files, BOS/EOS behaviour, stop ids, templates, and the errors of files
//! that are missing or wrong.

use super::super::{ChatMessage, ChatOptions, ModelTokenizer, Prompt};
use super::{bpe_special, byte_level_bpe, llama3_dir, model_dir, sentencepiece, write_files};
use crate::sampling::SamplingParams;
use serde_json::json;
use tessera_core::Error;
use tessera_data::SpecialTokens;

const MISTRAL: &str = include_str!("chat_templates/mistral-instruct.jinja");

#[test]
fn a_llama_3_directory() {
    let dir = llama3_dir();
    let tok = ModelTokenizer::from_dir(&dir).unwrap();
    let (bot, eot, eotext) = (bpe_special("<|begin_of_text|>"), bpe_special("<|eot_id|>"), bpe_special("<|end_of_text|>"));
    assert_eq!(tok.bos().map(|t| (t.text.as_str(), t.id)), Some(("<|begin_of_text|>", bot)));
    assert_eq!(tok.eos().map(|t| (t.text.as_str(), t.id)), Some(("<|eot_id|>", eot)));
    // The tokenizer's EOS first, then generation_config.json's list, once each.
    assert_eq!(tok.eos_ids(), [eot, eotext]);
    assert_eq!(tok.add_bos_token(), None);

    // No add_bos_token: the post-processor decides, and it adds BOS.
    let plain = tok.encode("hello the world", SpecialTokens::Omitted).unwrap();
    assert_eq!(tok.encode("hello the world", SpecialTokens::Added).unwrap(), [&[bot][..], &plain].concat());
    assert_eq!(tok.decode(&plain, SpecialTokens::Added).unwrap(), "hello the world");

    // A chat: the template writes BOS, encoding adds none (no double BOS),
    // and the special tokens in the text are single ids.
    let messages = [ChatMessage::system("Be brief."), ChatMessage::user("hello 😀")];
    let text = tok.render_chat(&messages, &ChatOptions::generation()).unwrap();
    let ids = tok.chat(&messages, true).unwrap();
    assert_eq!(ids[0], bot);
    assert_eq!(ids.iter().filter(|&&id| id == bot).count(), 1);
    assert_eq!(ids.iter().filter(|&&id| id == eot).count(), 2);
    assert_eq!(tok.decode(&ids, SpecialTokens::Added).unwrap(), text);
    assert_eq!(tok.encode_prompt(&Prompt::Chat(messages.to_vec())).unwrap(), ids);
    assert_eq!(tok.encode_prompt(&Prompt::Text("hello".into())).unwrap(), tok.encode("hello", SpecialTokens::Added).unwrap());

    let mut params = SamplingParams::default();
    tok.set_stop_ids(&mut params);
    assert_eq!((params.eos_token_id, params.stop_token_ids.clone()), (Some(eot), vec![eotext]));
    tok.set_stop_ids(&mut params);
    assert_eq!(params.stop_token_ids, [eotext], "setting the stops twice adds nothing");
}

/// A Mistral-style directory on the SentencePiece fixture, with `extra`
/// fields in its tokenizer_config.json.
fn mistral_dir(name: &str, extra: serde_json::Value) -> tessera::testing::Scratch {
    let mut config = json!({
        // transformers' serialised AddedToken, as older files hold them.
        "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": false, "normalized": false, "rstrip": false, "single_word": false},
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": null,
        "chat_template": MISTRAL,
        "add_bos_token": true,
        "add_eos_token": false,
        "added_tokens_decoder": {"0": {"content": "<unk>", "special": true}}
    });
    for (k, v) in extra.as_object().into_iter().flatten() {
        config[k] = v.clone();
    }
    model_dir(
        name,
        &[
            ("tokenizer.json", sentencepiece().to_string()),
            ("tokenizer_config.json", config.to_string()),
            ("generation_config.json", json!({"bos_token_id": 1, "eos_token_id": 2}).to_string()),
        ],
    )
}

#[test]
fn add_bos_token_and_add_eos_token_decide_over_the_post_processor() {
    let tok = ModelTokenizer::from_dir(mistral_dir("mistral", json!({}))).unwrap();
    assert_eq!((tok.bos().map(|t| t.id), tok.eos().map(|t| t.id), tok.unk().map(|t| t.id), tok.pad()), (Some(1), Some(2), Some(0), None));
    assert_eq!(tok.eos_ids(), [2]);
    let body = tok.encode("Hello world", SpecialTokens::Omitted).unwrap();
    assert_eq!(tok.encode("Hello world", SpecialTokens::Added).unwrap(), [&[1][..], &body].concat());
    assert_eq!(tok.decode(&body, SpecialTokens::Added).unwrap(), "Hello world");
    // The chat prompt has the template's BOS only.
    let ids = tok.chat(&[ChatMessage::user("Hello")], true).unwrap();
    assert_eq!(ids.iter().filter(|&&id| id == 1).count(), 1, "{ids:?}");

    // add_bos_token false: no BOS although the post-processor adds one.
    let tok = ModelTokenizer::from_dir(mistral_dir("mistral-nobos", json!({"add_bos_token": false}))).unwrap();
    assert_eq!(tok.encode("Hello world", SpecialTokens::Added).unwrap(), body);
    // add_eos_token true: EOS after the text.
    let tok = ModelTokenizer::from_dir(mistral_dir("mistral-eos", json!({"add_eos_token": true}))).unwrap();
    assert_eq!(tok.encode("Hello world", SpecialTokens::Added).unwrap(), [&[1][..], &body, &[2]].concat());
}

#[test]
fn special_tokens_map_overrides_the_config_and_ids_fill_in() {
    let dir = mistral_dir("mistral-map", json!({"eos_token": null, "bos_token": null}));
    // special_tokens_map.json names EOS; BOS comes from generation_config.json's id.
    write_files(&dir, &[("special_tokens_map.json", json!({"eos_token": {"content": "</s>", "lstrip": false}, "pad_token": "<unk>"}).to_string())]);
    let tok = ModelTokenizer::from_dir(&dir).unwrap();
    assert_eq!(tok.eos().map(|t| t.id), Some(2));
    assert_eq!(tok.bos().map(|t| (t.text.as_str(), t.id)), Some(("<s>", 1)));
    assert_eq!(tok.pad().map(|t| t.id), Some(0));
    // The template sees only the texts the files name, as in transformers.
    let t = tok.chat_template(None).unwrap();
    assert_eq!(t.special_tokens().get("eos_token").map(String::as_str), Some("</s>"));
    assert_eq!(t.special_tokens().get("bos_token"), None);

    // Without generation_config.json, config.json's ids stand in.
    let dir = model_dir(
        "config-ids",
        &[
            ("tokenizer.json", byte_level_bpe().to_string()),
            ("config.json", json!({"eos_token_id": [bpe_special("<|eot_id|>")], "bos_token_id": null, "hidden_size": 8}).to_string()),
        ],
    );
    let tok = ModelTokenizer::from_dir(&dir).unwrap();
    assert_eq!((tok.eos().map(|t| t.text.as_str()), tok.bos()), (Some("<|eot_id|>"), None));
}

#[test]
fn named_templates_and_template_files() {
    let dir = mistral_dir(
        "named",
        json!({"chat_template": [{"name": "default", "template": MISTRAL}, {"name": "tool_use", "template": "TOOLS {{ tools | length }}"}]}),
    );
    let tok = ModelTokenizer::from_dir(&dir).unwrap();
    assert_eq!(tok.chat_template_names(), ["default", "tool_use"]);
    let options = ChatOptions { template: Some("tool_use".into()), tools: Some(vec![json!({}), json!({})]), ..ChatOptions::default() };
    assert_eq!(tok.render_chat(&[ChatMessage::user("x")], &options).unwrap(), "TOOLS 2");
    let e = tok.render_chat(&[], &ChatOptions { template: Some("rag".into()), ..ChatOptions::default() }).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }) && e.to_string().contains("default, tool_use"), "{e}");

    // chat_template.jinja replaces the config's default; additional_chat_templates/ adds names.
    write_files(&dir, &[("chat_template.jinja", "FILE {{ messages[0].content }}".into()), ("additional_chat_templates/rag.jinja", "RAG".into())]);
    let tok = ModelTokenizer::from_dir(&dir).unwrap();
    assert_eq!(tok.chat_template_names(), ["default", "tool_use", "rag"]);
    assert_eq!(tok.render_chat(&[ChatMessage::user("x")], &ChatOptions::default()).unwrap(), "FILE x");

    // A list without `default`: chats must name a template.
    let dir = mistral_dir("no-default", json!({"chat_template": [{"name": "tool_use", "template": "T"}]}));
    let tok = ModelTokenizer::from_dir(&dir).unwrap();
    assert!(!tok.has_chat_template());
    let e = tok.chat(&[ChatMessage::user("x")], true).unwrap_err();
    assert!(e.to_string().contains("no chat template named `default`; it has tool_use"), "{e}");
}

#[test]
fn a_model_without_a_template_takes_plain_text_only() {
    let dir = model_dir("base", &[("tokenizer.json", byte_level_bpe().to_string())]);
    let tok = ModelTokenizer::from_dir(&dir).unwrap();
    assert!(!tok.has_chat_template() && tok.eos().is_none() && tok.eos_ids().is_empty());
    let ids = tok.encode_prompt(&Prompt::Text("the hello".into())).unwrap();
    assert_eq!(tok.decode(&ids, SpecialTokens::Omitted).unwrap(), "the hello");
    let e = tok.encode_prompt(&Prompt::Chat(vec![ChatMessage::user("hi")])).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { op: "ModelTokenizer::chat", .. }), "{e}");
    assert!(e.to_string().contains("has no chat template") && e.to_string().contains("plain text prompt"), "{e}");

    // A Tessera character tokenizer (what `tessera prepare` writes for a tiny model).
    let dir = model_dir("chars", &[("tokenizer.json", json!({"tessera": "char-tokenizer", "version": 1, "alphabet": "0123456789+= \n"}).to_string())]);
    let tok = ModelTokenizer::from_dir(&dir).unwrap();
    let ids = tok.encode_prompt(&Prompt::Text("12+34=".into())).unwrap();
    assert_eq!(ids, [1, 2, 10, 3, 4, 11]);
    assert_eq!(tok.decode(&ids, SpecialTokens::Added).unwrap(), "12+34=");
}

#[test]
fn a_template_that_does_not_compile_fails_the_chat_not_the_load() {
    let dir = mistral_dir("broken", json!({"chat_template": "{% for m in messages %}{{ m.content }"}));
    let tok = ModelTokenizer::from_dir(&dir).unwrap();
    assert!(tok.encode("Hello", SpecialTokens::Added).is_ok());
    let e = tok.chat(&[ChatMessage::user("x")], true).unwrap_err();
    assert!(matches!(e, Error::DataFile { ref path, .. } if path.ends_with("tokenizer_config.json")), "{e}");
    assert!(e.to_string().contains("chat template `default`") && e.to_string().contains("does not compile"), "{e}");
}

/// The error of loading a Mistral-style directory whose tokenizer_config.json
/// has `extra` fields, or whose file `name` holds `contents`.
fn load_error(case: &str, extra: serde_json::Value, file: Option<(&str, &str)>) -> Error {
    let dir = mistral_dir(case, extra);
    if let Some((name, contents)) = file {
        write_files(&dir, &[(name, contents.to_string())]);
    }
    ModelTokenizer::from_dir(&dir).unwrap_err()
}

#[test]
fn wrong_files_are_errors_that_name_the_file_the_field_and_the_fix() {
    let missing = tessera::testing::Scratch::new("prompt-missing");
    let e = ModelTokenizer::from_dir(missing.join("nope")).unwrap_err();
    assert!(e.to_string().contains("is not a directory"), "{e}");
    let e = ModelTokenizer::from_dir(&missing).unwrap_err();
    assert!(e.to_string().contains("tokenizer.json") && e.to_string().contains("is missing"), "{e}");

    // (case, tokenizer_config.json fields, a file to write, what the message must contain)
    type Case<'a> = (&'a str, serde_json::Value, Option<(&'a str, &'a str)>, &'a [&'a str]);
    let cases: [Case; 11] = [
        ("bad-json", json!({}), Some(("tokenizer_config.json", "{\"bos_token\": ")), &["tokenizer_config.json", "is not valid JSON"]),
        ("not-object", json!({}), Some(("generation_config.json", "[1, 2]")), &["generation_config.json", "not an object"]),
        ("bos-type", json!({"bos_token": 7}), None, &["tokenizer_config.json", "field `bos_token`", "string"]),
        ("bos-object", json!({"bos_token": {"lstrip": true}}), None, &["field `bos_token`", "`content`"]),
        ("eos-unknown", json!({"eos_token": "<|im_end|>"}), None, &["field `eos_token`", "\"<|im_end|>\"", "not a token of tokenizer.json"]),
        ("flag-type", json!({"add_bos_token": "yes"}), None, &["field `add_bos_token`", "true, false or null"]),
        ("bos-needed", json!({"add_bos_token": true, "bos_token": null}), Some(("generation_config.json", "{}")), &["field `add_bos_token`", "no BOS token"]),
        ("template-type", json!({"chat_template": 3}), None, &["field `chat_template`", "Jinja source"]),
        ("template-list", json!({"chat_template": [{"name": "default"}]}), None, &["field `chat_template[0]`", "`template` string"]),
        (
            "eos-id",
            json!({}),
            Some(("generation_config.json", "{\"eos_token_id\": [2, -1]}")),
            &["generation_config.json", "field `eos_token_id[1]`", "integer"],
        ),
        ("eos-range", json!({}), Some(("generation_config.json", "{\"eos_token_id\": [2, 4000000]}")), &["generation_config.json", "4000000", "another model"]),
    ];
    for (case, extra, file, wanted) in cases {
        let e = load_error(case, extra, file);
        assert!(matches!(e, Error::DataFile { .. }), "{case}: {e:?}");
        let message = e.to_string();
        for w in wanted {
            assert!(message.contains(w), "{case}: {message:?} lacks {w:?}");
        }
    }
}

#[test]
fn the_tokenizer_and_detokenizer_can_cross_threads() {
    // A server shares one tokenizer between its request threads.
    fn shared<T: Send + Sync>() {}
    shared::<ModelTokenizer>();
    shared::<super::super::Detokenizer>();
    shared::<super::super::ChatTemplate>();
}
