//! `tessera prepare`, run as a program: the bundled task written directly and
//! through its text, BPE training and reuse of the tokenizer, and the errors
//! on bad input.

use std::path::Path;
use std::process::{Command, Output};
use tessera::data::{Dataset, END_OF_TEXT};
use tessera::testing::Scratch;

fn scratch(name: &str) -> Scratch {
    Scratch::new(&format!("cli-prepare-{name}"))
}

fn prepare(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tessera")).arg("prepare").args(args).output().unwrap()
}

fn ok(args: &[&str]) {
    let out = prepare(args);
    assert!(out.status.success(), "tessera prepare {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
}

fn fails(args: &[&str], needles: &[&str]) {
    let out = prepare(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "tessera prepare {args:?} should fail");
    for n in needles {
        assert!(stderr.contains(n), "{stderr:?} should mention {n:?}");
    }
}

fn all_tokens(dir: &Path) -> Vec<u32> {
    let data = Dataset::open(dir).unwrap();
    (0..data.shard_count()).flat_map(|s| data.tokens(s, 0, data.shard_tokens(s) as usize).unwrap()).collect()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn the_bundled_task_prepares_the_same_directly_and_through_its_text() {
    let dir = scratch("bundled");
    let (text, direct, via_text) = (dir.join("text"), dir.join("direct"), dir.join("via-text"));
    ok(&["--bundled", "arith", "--train-size", "500", "--text", "--out", s(&text)]);
    ok(&["--bundled", "arith", "--train-size", "500", "--out", s(&direct), "--shard-tokens", "1040"]);
    ok(&["--input", s(&text.join("arith-train.txt")), "--chars", "--out", s(&via_text)]);
    let tokens = all_tokens(&direct);
    assert_eq!(tokens.len(), 500 * 13);
    assert_eq!(Dataset::open(&direct).unwrap().shard_count(), 7);
    assert_eq!(all_tokens(&via_text), tokens);
    let tok = Dataset::open(&via_text).unwrap().tokenizer().unwrap();
    assert_eq!(tok.decode(&tokens).unwrap(), std::fs::read_to_string(text.join("arith-train.txt")).unwrap());
}

#[test]
fn a_trained_bpe_tokenizes_every_file_and_can_be_reused() {
    let dir = scratch("bpe");
    let input = dir.join("input");
    std::fs::create_dir_all(input.join("nested")).unwrap();
    let first = "one small document about tokenizers and shards.\n".repeat(30);
    let second = "a second document, in a nested directory. ünïcode ✓\n".repeat(30);
    std::fs::write(input.join("a.txt"), &first).unwrap();
    std::fs::write(input.join("nested/b.txt"), &second).unwrap();
    std::fs::write(input.join(".hidden"), "never read").unwrap();
    let (trained, reused) = (dir.join("trained"), dir.join("reused"));
    ok(&["--input", s(&input), "--train-bpe", "300", "--out", s(&trained), "--shard-tokens", "100"]);
    let data = Dataset::open(&trained).unwrap();
    assert_eq!(data.index().documents, 2);
    assert!(data.shard_count() > 1);
    let tokens = all_tokens(&trained);
    let tok = data.tokenizer().unwrap();
    assert_eq!(tok.decode(&tokens).unwrap(), format!("{first}{END_OF_TEXT}{second}"));
    ok(&["--input", s(&input), "--tokenizer", s(&trained.join("tokenizer.json")), "--out", s(&reused), "--shard-tokens", "100"]);
    assert_eq!(all_tokens(&reused), tokens);
}

#[test]
fn bad_input_gets_an_error_that_names_it() {
    let dir = scratch("errors");
    let text = dir.join("text.txt");
    std::fs::write(&text, "hello\n").unwrap();
    let out = dir.join("out");
    fails(&["--input", s(&dir.join("missing.txt")), "--chars", "--out", s(&out)], &["missing.txt", "does not exist"]);
    fails(&["--input", s(&text), "--out", s(&out)], &["--tokenizer", "--train-bpe", "--chars"]);
    fails(&["--input", s(&text), "--chars", "--out", s(&dir)], &["not empty"]);
    fails(&["--input", s(&text), "--train-bpe", "10", "--out", s(&out)], &["at least 257"]);
    fails(&["--input", s(&text), "--tokenizer", s(&text), "--out", s(&out)], &["text.txt", "not a tokenizer.json"]);
    fails(&["--bundled", "arith", "--chars", "--out", s(&out)], &["cannot be used with"]);
    fails(&["--bundled", "arith", "--train-size", "0", "--out", s(&out)], &["--train-size 0", "at least 1"]);
    let binary = dir.join("binary.bin");
    std::fs::write(&binary, [0x66, 0xff, 0xfe]).unwrap();
    fails(&["--input", s(&binary), "--chars", "--out", s(&out)], &["binary.bin", "not UTF-8"]);
    assert!(!out.join("index.json").exists(), "no index is written for a failed run");
}
