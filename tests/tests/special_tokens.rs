//! Special tokens follow the tokenizer file's post-processor, as Hugging
//! Face's `encode` does: a Llama-style template adds BOS to every text, and a
//! prepared document gets it once however many pieces it is encoded in;
//! `SpecialTokens::Omitted` (`tessera prepare --no-special-tokens`) leaves
//! them out.

use std::path::Path;
use tessera::ckpt::serde_json::{self, json};
use tessera::data::{prepare, Dataset, SpecialTokens, Tokenizer, TokenizerSource};
use tessera::testing::Scratch;

const UNK: u32 = 0;
const BOS: u32 = 1;
const EOS: u32 = 2;
const HELLO: u32 = 3;
const WORLD: u32 = 4;

/// A word-level `tokenizer.json` whose post-processor wraps a sequence in
/// `before` and `after` (special tokens by name).
fn write_tokenizer(path: &Path, before: &[&str], after: &[&str]) {
    let special = |name: &str| json!({ "SpecialToken": { "id": name, "type_id": 0 } });
    let mut single: Vec<_> = before.iter().map(|n| special(n)).collect();
    single.push(json!({ "Sequence": { "id": "A", "type_id": 0 } }));
    single.extend(after.iter().map(|n| special(n)));
    let ids = |name: &str| if name == "<s>" { BOS } else { EOS };
    let specials: serde_json::Map<_, _> = before.iter().chain(after).map(|n| (n.to_string(), json!({ "id": n, "ids": [ids(n)], "tokens": [n] }))).collect();
    let added = |id: u32, content: &str| json!({ "id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true });
    let file = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [added(UNK, "<unk>"), added(BOS, "<s>"), added(EOS, "</s>")],
        "normalizer": null,
        "pre_tokenizer": { "type": "Whitespace" },
        "post_processor": { "type": "TemplateProcessing", "single": single, "pair": [], "special_tokens": specials },
        "decoder": null,
        "model": { "type": "WordLevel", "vocab": { "<unk>": UNK, "<s>": BOS, "</s>": EOS, "hello": HELLO, "world": WORLD }, "unk_token": "<unk>" }
    });
    std::fs::write(path, serde_json::to_vec_pretty(&file).unwrap()).unwrap();
}

fn all_tokens(dir: &Path) -> Vec<u32> {
    let data = Dataset::open(dir).unwrap();
    (0..data.shard_count()).flat_map(|s| data.tokens(s, 0, data.shard_tokens(s) as usize).unwrap()).collect()
}

#[test]
fn encoding_adds_what_the_post_processor_adds_unless_told_not_to() {
    let scratch = Scratch::new("special-encode");
    for (before, after) in [(&["<s>"][..], &[][..]), (&["<s>"], &["</s>"]), (&[], &["</s>"]), (&[], &[])] {
        let path = scratch.path().join("tokenizer.json");
        write_tokenizer(&path, before, after);
        let tok = Tokenizer::load(&path).unwrap();
        let prefix: Vec<u32> = before.iter().map(|_| BOS).collect();
        let suffix: Vec<u32> = after.iter().map(|_| EOS).collect();
        let text = [HELLO, WORLD, HELLO];
        assert_eq!(tok.encode("hello world hello").unwrap(), [&prefix[..], &text, &suffix].concat(), "{before:?} {after:?}");
        assert_eq!(tok.encode_with("hello world hello", SpecialTokens::Omitted).unwrap(), text);
        assert_eq!(tok.special_affixes().unwrap(), (prefix, suffix), "{before:?} {after:?}");
    }
}

#[test]
fn a_prepared_document_gets_the_special_tokens_once_however_long_it_is() {
    let scratch = Scratch::new("special-prepare");
    let tokenizer = scratch.path().join("tokenizer.json");
    write_tokenizer(&tokenizer, &["<s>"], &["</s>"]);
    // The long document is encoded in several pieces of about 1 MiB.
    let long = "hello world\n".repeat(200_000);
    let docs = [scratch.path().join("a.txt"), scratch.path().join("b.txt")];
    std::fs::write(&docs[0], &long).unwrap();
    std::fs::write(&docs[1], "world hello").unwrap();
    let body: Vec<u32> = [HELLO, WORLD].repeat(200_000);

    let with = scratch.path().join("with");
    prepare(&docs, &with, &TokenizerSource::File(tokenizer.clone()), 1 << 20, SpecialTokens::Added).unwrap();
    let expected = [&[BOS][..], &body, &[EOS, BOS, WORLD, HELLO, EOS]].concat();
    let got = all_tokens(&with);
    assert_eq!(got.len(), expected.len());
    assert!(got == expected, "BOS and EOS once per document, nowhere else");

    let without = scratch.path().join("without");
    prepare(&docs, &without, &TokenizerSource::File(tokenizer), 1 << 20, SpecialTokens::Omitted).unwrap();
    assert!(all_tokens(&without) == [&body[..], &[WORLD, HELLO]].concat());
}
