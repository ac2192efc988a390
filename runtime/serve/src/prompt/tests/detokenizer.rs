//! Streaming detokenization equals decoding all at once, however the ids
//! split characters, and keeps the spaces a SentencePiece decoder gives a
//! token in context.

use super::super::{Detokenizer, ModelTokenizer};
use super::{bpe_special, byte_level_bpe, model_dir, sentencepiece};
use crate::test_data::Gen;
use tessera_core::Error;
use tessera_data::SpecialTokens;

/// The pieces of `ids` streamed after `prompt`, then what `finish` flushes.
fn stream(tok: &ModelTokenizer, prompt: &[u32], ids: &[u32], special: SpecialTokens) -> (Vec<Option<String>>, String) {
    let mut detok = Detokenizer::new(tok, prompt, special);
    let pieces = ids.iter().map(|&id| detok.push(id).unwrap()).collect();
    (pieces, detok.finish().unwrap())
}

fn concat(pieces: &[Option<String>], tail: &str) -> String {
    pieces.iter().flatten().map(String::as_str).chain([tail]).collect()
}

fn byte_level() -> (tessera::testing::Scratch, ModelTokenizer) {
    let dir = model_dir("detok-bpe", &[("tokenizer.json", byte_level_bpe().to_string())]);
    let tok = ModelTokenizer::from_dir(&dir).unwrap();
    (dir, tok)
}

#[test]
fn byte_level_ids_that_split_an_emoji_wait_for_the_whole_character() {
    let (_dir, tok) = byte_level();
    let ids = tok.encode("the 😀!", SpecialTokens::Omitted).unwrap();
    // The fixture's merges cut the emoji: " \xF0\x9F" + "\x98" + "\x80!".
    let pieces: Vec<String> = ids.iter().map(|&id| tok.decode(&[id], SpecialTokens::Added).unwrap()).collect();
    assert!(pieces.iter().any(|p| p.contains('\u{FFFD}')), "the fixture must split the emoji: {pieces:?}");
    let (streamed, tail) = stream(&tok, &[], &ids, SpecialTokens::Added);
    assert!(streamed.iter().flatten().all(|p| !p.contains('\u{FFFD}')), "{streamed:?}");
    assert_eq!(concat(&streamed, &tail), "the 😀!");
    assert_eq!(tail, "");

    // Cut off inside the character, the end shows what a one-shot decode shows.
    let cut = &ids[..ids.len() - 1];
    let (streamed, tail) = stream(&tok, &[], cut, SpecialTokens::Added);
    assert_eq!(concat(&streamed, &tail), tok.decode(cut, SpecialTokens::Added).unwrap());
    assert!(tail.ends_with('\u{FFFD}'), "{tail:?}");
}

#[test]
fn byte_level_streaming_equals_one_shot_decoding_on_random_ids() {
    let (_dir, tok) = byte_level();
    let vocab = tok.vocab_size();
    let mut g = Gen::new(11);
    for case in 0..400 {
        // Half the cases draw from every id; half from the merged tokens,
        // the specials and a few bytes, where characters are split most.
        let ids: Vec<u32> =
            (0..g.below(40)).map(|_| if case % 2 == 0 || g.below(4) == 0 { g.below(vocab) as u32 } else { (256 + g.below(vocab - 256)) as u32 }).collect();
        for special in [SpecialTokens::Added, SpecialTokens::Omitted] {
            let (pieces, tail) = stream(&tok, &[], &ids, special);
            assert_eq!(concat(&pieces, &tail), tok.decode(&ids, special).unwrap(), "case {case} {special:?}: {ids:?}");
            // Only the end may show an incomplete character.
            assert!(pieces.iter().flatten().all(|p| !p.ends_with('\u{FFFD}')), "case {case}: {pieces:?}");
        }
        // After a prompt, the pieces continue its text.
        let split = g.below(ids.len() + 1);
        let (prompt, generated) = ids.split_at(split);
        let (pieces, tail) = stream(&tok, prompt, generated, SpecialTokens::Added);
        let shown = tok.decode(prompt, SpecialTokens::Added).unwrap();
        let shown = shown.trim_end_matches('\u{FFFD}');
        assert_eq!(format!("{shown}{}", concat(&pieces, &tail)), tok.decode(&ids, SpecialTokens::Added).unwrap(), "case {case}: {prompt:?} {generated:?}");
    }
}

#[test]
fn special_tokens_are_shown_or_skipped() {
    let (_dir, tok) = byte_level();
    let eot = bpe_special("<|eot_id|>");
    let hello = tok.encode("hello", SpecialTokens::Omitted).unwrap();
    let ids = [&hello[..], &[eot], &hello].concat();
    let (pieces, _) = stream(&tok, &[], &ids, SpecialTokens::Omitted);
    assert_eq!(pieces[hello.len()], None, "a skipped special token completes no text");
    assert_eq!(concat(&pieces, ""), "hellohello");
    let (pieces, _) = stream(&tok, &[], &ids, SpecialTokens::Added);
    assert_eq!(concat(&pieces, ""), "hello<|eot_id|>hello");
}

#[test]
fn sentencepiece_tokens_keep_their_leading_space_after_the_prompt() {
    let dir = model_dir("detok-sp", &[("tokenizer.json", sentencepiece().to_string())]);
    let tok = ModelTokenizer::from_dir(&dir).unwrap();
    let prompt = tok.encode("Hello", SpecialTokens::Added).unwrap();
    assert_eq!(prompt, [1, tok.tokenizer().token_id("▁Hello").unwrap()]);
    let text = " world 😀 é日本!";
    let all = tok.encode(&format!("Hello{text}"), SpecialTokens::Added).unwrap();
    let generated = &all[prompt.len()..];
    // Alone, the first token reads "world": the decoder strips a text's leading space.
    assert_eq!(tok.decode(&generated[..1], SpecialTokens::Omitted).unwrap(), "world");
    let (pieces, tail) = stream(&tok, &prompt, generated, SpecialTokens::Omitted);
    assert_eq!(pieces[0].as_deref(), Some(" world"));
    // The emoji falls back to four byte tokens: three wait, the fourth shows it.
    let emoji_at = pieces.iter().position(|p| p.as_deref() == Some("😀")).unwrap();
    assert_eq!(&pieces[emoji_at - 3..emoji_at], [None, None, None]);
    assert_eq!(concat(&pieces, &tail), text);
}

#[test]
fn sentencepiece_streaming_equals_one_shot_decoding_on_random_texts() {
    let dir = model_dir("detok-sp-random", &[("tokenizer.json", sentencepiece().to_string())]);
    let tok = ModelTokenizer::from_dir(&dir).unwrap();
    // Words with pieces, characters that fall back to bytes, and spaces.
    let words = ["Hello", "world", "the", "é", "日本", "😀", "ü", "a", "b", "!", "€", " ", "  "];
    let mut g = Gen::new(23);
    for case in 0..300 {
        let text: String = (0..g.below(12)).map(|_| words[g.below(words.len())]).collect::<Vec<_>>().join(if g.below(2) == 0 { " " } else { "" });
        let ids = tok.encode(&text, SpecialTokens::Added).unwrap();
        let split = 1 + g.below(ids.len());
        let (prompt, generated) = ids.split_at(split);
        let (pieces, tail) = stream(&tok, prompt, generated, SpecialTokens::Omitted);
        let shown = tok.decode(prompt, SpecialTokens::Omitted).unwrap();
        let whole = tok.decode(&ids, SpecialTokens::Omitted).unwrap();
        assert_eq!(format!("{}{}", shown.trim_end_matches('\u{FFFD}'), concat(&pieces, &tail)), whole, "case {case}: {text:?} split at {split}");
    }
}

#[test]
fn an_id_outside_the_vocabulary_is_an_error_and_the_stream_goes_on() {
    let (_dir, tok) = byte_level();
    let mut detok = Detokenizer::new(&tok, &[], SpecialTokens::Added);
    let e = detok.push(tok.vocab_size() as u32).unwrap_err();
    assert!(matches!(e, Error::IndexOutOfRange { op: "Detokenizer::push", position: 0, .. }), "{e}");
    let ids = tok.encode("hello", SpecialTokens::Omitted).unwrap();
    let text: String = ids.iter().filter_map(|&id| detok.push(id).unwrap()).collect();
    assert_eq!(text, "hello");
    // A prompt with such an id only loses its context.
    let mut detok = Detokenizer::new(&tok, &[u32::MAX], SpecialTokens::Added);
    assert_eq!(ids.iter().filter_map(|&id| detok.push(id).unwrap()).collect::<String>(), "hello");
}
