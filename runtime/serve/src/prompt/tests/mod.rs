//! Tests of the prompt side, on small tokenizers written here in the two
//! shapes real models ship (byte-level BPE as GPT-2, Llama 3 and Qwen;
//! SentencePiece BPE with byte fallback as Llama 2 and Mistral) and on real
//! chat templates copied from the models' `tokenizer_config.json`.

mod detokenizer;
mod fuzz;
mod loading;
mod templates;

use serde_json::{json, Value};
use std::path::Path;
use tessera::testing::{byte_chars, Scratch};

/// The special tokens of the byte-level fixture, after its 256 byte tokens
/// and its merges: Llama 3's.
pub(super) const BPE_SPECIALS: [&str; 4] = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>"];

/// The texts whose bytes become merged tokens of the byte-level fixture.
/// Several cut a multi-byte character (😀 is F0 9F 98 80; there are tokens
/// for F0 9F, 98 80, " " F0 9F and 80 "!"), so encoded texts and random id
/// sequences split characters in every way. Each is two earlier tokens merged.
const BPE_MERGED: [&[u8]; 17] = [
    b" t",
    b"he",
    b" the",
    b"ll",
    b"llo",
    b" w",
    "é".as_bytes(),
    b"\xF0\x9F",
    // Before 98 80, so that "😀!" encodes as F0 9F | 98 | 80 "!".
    b"\x80!",
    b" \xF0\x9F",
    b"\x98\x80",
    "😀".as_bytes(),
    b"\xE6\x97",
    "日".as_bytes(),
    b"\xE6\x9C",
    "本".as_bytes(),
    "日本".as_bytes(),
];

/// A byte-level BPE `tokenizer.json` in Llama 3's shape: ids 0..256 are the
/// bytes, then one id per [`BPE_MERGED`] entry, then [`BPE_SPECIALS`]; the
/// post-processor adds `<|begin_of_text|>`.
pub(super) fn byte_level_bpe() -> Value {
    let chars = byte_chars();
    let spell = |bytes: &[u8]| bytes.iter().map(|&b| chars[b as usize]).collect::<String>();
    let mut vocab = serde_json::Map::new();
    for b in 0..=255u8 {
        vocab.insert(spell(&[b]), json!(b));
    }
    // Each merged text is made of two halves already in the vocabulary:
    // the longest known prefix and the rest.
    let mut merges = Vec::new();
    for (i, bytes) in BPE_MERGED.iter().enumerate() {
        let cut = (1..bytes.len()).rev().find(|&k| vocab.contains_key(&spell(&bytes[..k])) && vocab.contains_key(&spell(&bytes[k..]))).unwrap_or(1);
        merges.push(format!("{} {}", spell(&bytes[..cut]), spell(&bytes[cut..])));
        vocab.insert(spell(bytes), json!(256 + i));
    }
    let first_special = 256 + BPE_MERGED.len();
    let added: Vec<Value> = BPE_SPECIALS.iter().enumerate().map(|(i, t)| added_token(first_special + i, t)).collect();
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [first_special], "tokens": ["<|begin_of_text|>"]}}
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": false, "byte_fallback": false, "ignore_merges": false, "vocab": vocab, "merges": merges
        }
    })
}

/// The id of special token `text` in [`byte_level_bpe`].
pub(super) fn bpe_special(text: &str) -> u32 {
    let Some(i) = BPE_SPECIALS.iter().position(|t| *t == text) else { panic!("{text} is not a special token of the fixture") };
    (256 + BPE_MERGED.len() + i) as u32
}

/// Words of the SentencePiece fixture, after `<unk>`, `<s>`, `</s>` and the
/// 256 byte tokens `<0x00>`..`<0xFF>`.
pub(super) const SP_PIECES: [&str; 12] = ["▁", "▁Hello", "▁world", "▁the", "!", "▁é", "é", "a", "b", "▁a", "日", "▁日本"];

/// A SentencePiece-style `tokenizer.json` as Llama 2's and Mistral's: spaces
/// become `▁` and one is prepended; characters without a piece fall back to
/// their UTF-8 bytes (`<0xF0>`...); the decoder turns `▁` back into spaces,
/// fuses the bytes and strips the one leading space. BOS is `<s>` (id 1).
pub(super) fn sentencepiece() -> Value {
    let mut vocab = serde_json::Map::new();
    for (i, t) in ["<unk>", "<s>", "</s>"].iter().enumerate() {
        vocab.insert(t.to_string(), json!(i));
    }
    for b in 0..=255u32 {
        vocab.insert(format!("<0x{b:02X}>"), json!(3 + b));
    }
    for (i, piece) in SP_PIECES.iter().enumerate() {
        vocab.insert(piece.to_string(), json!(259 + i));
    }
    // Merges that build the multi-character pieces from single characters.
    let merges = ["▁ H", "e l", "el l", "ell o", "▁H ello", "▁ w", "o r", "or l", "orl d", "▁w orld", "▁ t", "h e", "▁t he", "▁ é", "▁ a", "▁ 日", "▁日 本"];
    // The intermediate pieces the merges produce must be in the vocabulary.
    let intermediates = ["H", "e", "l", "o", "w", "r", "d", "t", "h", "本", "el", "ell", "ello", "▁H", "▁w", "or", "orl", "orld", "▁t", "he", "▁日"];
    let mut next = 259 + SP_PIECES.len();
    for piece in intermediates {
        if !vocab.contains_key(piece) {
            vocab.insert(piece.to_string(), json!(next));
            next += 1;
        }
    }
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [added_token(0, "<unk>"), added_token(1, "<s>"), added_token(2, "</s>")],
        "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
        "pre_tokenizer": null,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}
        },
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}
        ]},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": true, "byte_fallback": true, "ignore_merges": false, "vocab": vocab, "merges": merges
        }
    })
}

/// An entry of `added_tokens`.
fn added_token(id: usize, content: &str) -> Value {
    json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true})
}

/// A model directory holding `files` (name, contents).
pub(super) fn model_dir(name: &str, files: &[(&str, String)]) -> Scratch {
    let dir = Scratch::new(&format!("prompt-{name}"));
    write_files(&dir, files);
    dir
}

/// Writes `files` (name, contents) into `dir`, creating subdirectories.
pub(super) fn write_files(dir: &Path, files: &[(&str, String)]) {
    for (name, contents) in files {
        let path = dir.join(name);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).unwrap();
        }
        std::fs::write(path, contents).unwrap();
    }
}

/// A model directory in Llama 3 Instruct's shape, on the byte-level fixture.
pub(super) fn llama3_dir() -> Scratch {
    model_dir(
        "llama3",
        &[
            ("tokenizer.json", byte_level_bpe().to_string()),
            (
                "tokenizer_config.json",
                json!({
                    "bos_token": "<|begin_of_text|>",
                    "eos_token": "<|eot_id|>",
                    "chat_template": include_str!("chat_templates/llama-3-instruct.jinja"),
                    "clean_up_tokenization_spaces": true,
                    "model_max_length": 131072,
                    "tokenizer_class": "PreTrainedTokenizerFast"
                })
                .to_string(),
            ),
            (
                "generation_config.json",
                json!({"bos_token_id": bpe_special("<|begin_of_text|>"), "eos_token_id": [bpe_special("<|end_of_text|>"), bpe_special("<|eot_id|>")], "do_sample": true})
                    .to_string(),
            ),
        ],
    )
}
