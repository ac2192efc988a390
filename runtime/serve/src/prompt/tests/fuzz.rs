//! Fuzzing of everything the prompt side reads from outside: the JSON files
//! beside `tokenizer.json` and the chat templates. A loader may refuse any
//! input with an error; none may panic or hang.

use super::super::{ChatMessage, ChatOptions, ChatTemplate, ModelTokenizer, Prompt};
use super::{bpe_special, byte_level_bpe, model_dir, sentencepiece};
use crate::test_data::Gen;
use serde_json::{json, Value};
use std::path::Path;
use std::time::Duration;
use tessera::testing::fuzz::{cases, fuzz};
use tessera_data::SpecialTokens;

const LIMIT: Duration = Duration::from_secs(5);

const TEMPLATES: [&str; 7] = [
    include_str!("chat_templates/llama-3-instruct.jinja"),
    include_str!("chat_templates/llama-3.2-instruct.jinja"),
    include_str!("chat_templates/qwen2-chatml.jinja"),
    include_str!("chat_templates/qwen2.5-instruct.jinja"),
    include_str!("chat_templates/mistral-instruct.jinja"),
    include_str!("chat_templates/zephyr.jinja"),
    include_str!("chat_templates/gemma.jinja"),
];

fn conversation() -> Vec<ChatMessage> {
    vec![ChatMessage::system("sys"), ChatMessage::user("Hello 😀"), ChatMessage::assistant("Hi"), ChatMessage::user("Again")]
}

/// Loads `dir` and, when that works, uses everything loaded: a loaded
/// tokenizer must encode, chat (or refuse to) and detokenize without panicking.
fn load_and_use(dir: &Path) -> bool {
    let Ok(tok) = ModelTokenizer::from_dir(dir) else { return false };
    let _ = tok.encode_prompt(&Prompt::Text("Hello world".into()));
    let _ = tok.chat(&conversation(), true);
    let _ = tok.chat_with(&conversation(), &ChatOptions { tools: Some(vec![json!({"type": "function"})]), ..ChatOptions::generation() });
    if let Ok(ids) = tok.encode("Hello", SpecialTokens::Added) {
        let mut detok = super::super::Detokenizer::new(&tok, &ids, SpecialTokens::Omitted);
        for &id in tok.eos_ids() {
            let _ = detok.push(id);
        }
    }
    true
}

/// Fuzzes the file `name` of a directory that holds `base` (the other
/// files), starting from `seeds`.
fn fuzz_file(case: &str, base: &[(&str, String)], name: &str, seeds: &[Value], n: usize) {
    let dir = model_dir(case, base);
    let seeds: Vec<Vec<u8>> = seeds.iter().map(|s| serde_json::to_vec_pretty(s).unwrap()).collect();
    let path = dir.join(name);
    fuzz(case, &seeds, cases(n), LIMIT, |bytes| {
        std::fs::write(&path, bytes).unwrap();
        load_and_use(&dir)
    });
}

fn config_seeds() -> Vec<Value> {
    vec![
        json!({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": TEMPLATES[0], "model_max_length": 131072}),
        json!({
            "bos_token": {"__type": "AddedToken", "content": "<|begin_of_text|>", "lstrip": false},
            "eos_token": {"content": "<|eot_id|>"}, "add_bos_token": true, "add_eos_token": false, "pad_token": null,
            "chat_template": [{"name": "default", "template": TEMPLATES[4]}, {"name": "tool_use", "template": TEMPLATES[3]}]
        }),
        json!({"eos_token": "<|end_of_text|>", "unk_token": "<|eot_id|>", "chat_template": TEMPLATES[1]}),
    ]
}

#[test]
fn tokenizer_config_json() {
    fuzz_file("fuzz-config", &[("tokenizer.json", byte_level_bpe().to_string())], "tokenizer_config.json", &config_seeds(), 1500);
}

#[test]
fn special_tokens_map_and_generation_config_json() {
    let base = [
        ("tokenizer.json", sentencepiece().to_string()),
        ("tokenizer_config.json", json!({"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATES[4]}).to_string()),
    ];
    let maps = [json!({"bos_token": "<s>", "eos_token": {"content": "</s>", "lstrip": false, "normalized": false}, "unk_token": "<unk>", "pad_token": "</s>"})];
    fuzz_file("fuzz-map", &base, "special_tokens_map.json", &maps, 1000);
    let generation = [json!({"bos_token_id": 1, "eos_token_id": [2, 0], "pad_token_id": 0, "do_sample": true, "temperature": 0.6}), json!({"eos_token_id": 2})];
    fuzz_file("fuzz-generation", &base, "generation_config.json", &generation, 1000);
}

#[test]
fn chat_template_sources() {
    // Mutated templates: compiling and rendering either works or fails
    // with an error, and fuel stops a template that would not end.
    let seeds: Vec<Vec<u8>> = TEMPLATES.iter().map(|t| t.as_bytes().to_vec()).collect();
    let options = ChatOptions { tools: Some(vec![json!({"type": "function", "function": {"name": "f"}})]), ..ChatOptions::generation() };
    fuzz("chat template", &seeds, cases(1500), LIMIT, |bytes| {
        let Ok(source) = std::str::from_utf8(bytes) else { return false };
        let Ok(template) = ChatTemplate::new(source) else { return false };
        let template = template.with_special_token("bos_token", "<s>").with_special_token("eos_token", "</s>");
        let plain = template.render(&conversation()[1..], &ChatOptions::generation()).is_ok();
        let tools = template.render(&conversation(), &options).is_ok();
        plain || tools
    });
}

/// A JSON value of a random kind: the types a field should not have.
fn random_value(g: &mut Gen, depth: usize) -> Value {
    match g.below(if depth > 2 { 8 } else { 10 }) {
        0 => Value::Null,
        1 => json!(g.below(2) == 0),
        2 => json!(g.below(300)),
        3 => json!(-(g.below(5) as i64) - 1),
        4 => json!(u64::MAX - g.below(3) as u64),
        5 => json!(g.uniform() * 1e10),
        6 => json!(["<s>", "</s>", "<|eot_id|>", "{{ x }}", "{% for %}", ""][g.below(6)]),
        7 => json!(bpe_special("<|eot_id|>")),
        8 => Value::Array((0..g.below(4)).map(|_| random_value(g, depth + 1)).collect()),
        _ => {
            let keys = ["content", "name", "template", "__type", "x"];
            Value::Object((0..g.below(4)).map(|_| (keys[g.below(keys.len())].to_string(), random_value(g, depth + 1))).collect())
        }
    }
}

/// A value of the kind field `name` takes, though not always a right one.
fn plausible_value(g: &mut Gen, name: &str) -> Value {
    let token = ["<|begin_of_text|>", "<|eot_id|>", "<|end_of_text|>", "<s>"][g.below(4)];
    match name {
        "add_bos_token" | "add_eos_token" => json!(g.below(2) == 0),
        "chat_template" => match g.below(3) {
            0 => json!(TEMPLATES[g.below(TEMPLATES.len())]),
            1 => json!([{"name": "default", "template": TEMPLATES[g.below(TEMPLATES.len())]}, {"name": "x", "template": "{{ bos_token }}"}]),
            _ => json!("{{ raise_exception('no') }}"),
        },
        n if n.ends_with("_id") => match g.below(3) {
            0 => json!(bpe_special(super::BPE_SPECIALS[g.below(super::BPE_SPECIALS.len())])),
            1 => json!([bpe_special("<|eot_id|>"), g.below(300)]),
            _ => json!(g.below(256)),
        },
        _ => match g.below(3) {
            0 => json!({"content": token, "lstrip": false}),
            _ => json!(token),
        },
    }
}

#[test]
fn fields_of_every_type() {
    // Each known field given values of random kinds, in every file at once.
    let dir = model_dir("fuzz-types", &[("tokenizer.json", byte_level_bpe().to_string())]);
    let config_fields = ["bos_token", "eos_token", "unk_token", "pad_token", "add_bos_token", "add_eos_token", "chat_template"];
    let id_fields = ["bos_token_id", "eos_token_id", "pad_token_id"];
    let mut g = Gen::new(5);
    let mut loaded = 0;
    for _ in 0..cases(600) {
        let mut file = |names: &[&str]| -> String {
            let mut map = serde_json::Map::new();
            for name in names {
                match g.below(3) {
                    0 => {}
                    1 => _ = map.insert(name.to_string(), plausible_value(&mut g, name)),
                    _ => _ = map.insert(name.to_string(), random_value(&mut g, 0)),
                }
            }
            Value::Object(map).to_string()
        };
        let (config, map, generation) = (file(&config_fields), file(&config_fields[..4]), file(&id_fields));
        super::write_files(&dir, &[("tokenizer_config.json", config), ("special_tokens_map.json", map), ("generation_config.json", generation)]);
        loaded += load_and_use(&dir) as usize;
    }
    eprintln!("fields of every type: {loaded} of {} combinations loaded", cases(600));
    assert!(loaded > 0, "no random combination loaded; the generator does not reach past the first check");
}
