//! `tessera generate`, `tessera perplexity` and `tessera serve`, run as
//! programs on the Llama fixture with a small word-level tokenizer: batched
//! prompts equal single ones, the chat template, stop strings, token-id
//! prompts, quantized weights, perplexity against its recipe, the HTTP
//! server's answers and its shutdown on SIGTERM, and the errors on bad
//! input.

mod common;
use common::{http, serve};
use std::path::Path;
use std::process::{Command, Output};
use tessera::testing::Scratch;

const WORDS: &[&str] = &["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "to", "park", "and", "then", "it", "was", "good", "user", "assistant", "system"];
const SPECIAL: &[&str] = &["<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"];

/// A copy of the Llama fixture (vocabulary 64, context 64), with a
/// tokenizer and a chat template when `tokenizer` is set.
fn model(name: &str, tokenizer: bool) -> Scratch {
    let dir = Scratch::new(&format!("cli-generate-{name}"));
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures/llama");
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture.join(f), dir.path().join(f)).unwrap();
    }
    if tokenizer {
        let mut vocab = serde_json::Map::new();
        for w in SPECIAL.iter().chain(WORDS) {
            vocab.insert(w.to_string(), vocab.len().into());
        }
        while vocab.len() < 64 {
            vocab.insert(format!("w{}", vocab.len()), vocab.len().into());
        }
        let added: Vec<_> = SPECIAL
            .iter()
            .enumerate()
            .map(|(id, t)| serde_json::json!({"id": id, "content": t, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}))
            .collect();
        let tok = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": added, "normalizer": null,
            "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
            "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": false},
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
        });
        std::fs::write(dir.path().join("tokenizer.json"), tok.to_string()).unwrap();
        let cfg = serde_json::json!({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
            "chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"});
        std::fs::write(dir.path().join("tokenizer_config.json"), cfg.to_string()).unwrap();
    }
    dir
}

fn generate(dir: &Path, args: &[&str]) -> Output {
    tessera("generate", dir, args)
}

fn tessera(command: &str, dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tessera")).arg(command).arg("--model").arg(dir).args(args).output().unwrap()
}

/// The JSON lines of a successful run.
fn json(dir: &Path, args: &[&str]) -> Vec<serde_json::Value> {
    let out = generate(dir, &[args, &["--json"]].concat());
    assert!(out.status.success(), "tessera generate {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

fn fails(dir: &Path, args: &[&str], needles: &[&str]) {
    let out = generate(dir, args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "tessera generate {args:?} should fail");
    for n in needles {
        assert!(stderr.contains(n), "{stderr:?} should mention {n:?}");
    }
}

#[test]
fn batched_prompts_give_what_each_gives_alone() {
    let dir = model("batch", true);
    let prompts = ["the cat sat on the", "a dog ran to the park and then", "it"];
    let mut args = vec!["--max-tokens", "10"];
    for p in &prompts {
        args.extend(["--prompt", p]);
    }
    let together = json(dir.path(), &args);
    assert_eq!(together.len(), 3);
    for (p, t) in prompts.iter().zip(&together) {
        let alone = json(dir.path(), &["--max-tokens", "10", "--prompt", p]);
        assert_eq!(alone[0]["tokens"], t["tokens"], "prompt {p:?}");
        assert_eq!(alone[0]["text"], t["text"]);
        assert_eq!(t["tokens"].as_array().unwrap().len(), 10);
        assert_eq!(t["finish"], "Stop(MaxTokens)");
    }
    // Speculation by prompt lookup leaves greedy text as it is.
    let spec = json(dir.path(), &[&args[..], &["--speculate", "3"]].concat());
    assert_eq!(spec, together);
    // The same seed repeats a sampled text.
    let sampled = |seed: &str| json(dir.path(), &["--max-tokens", "12", "--temperature", "1.0", "--seed", seed, "--prompt", "the cat"]);
    assert_eq!(sampled("7"), sampled("7"));
}

#[test]
fn chat_prompts_go_through_the_template_and_stop_strings_cut_the_text() {
    let dir = model("chat", true);
    let chat = json(dir.path(), &["--chat", "--system", "be good", "--prompt", "the dog", "--max-tokens", "6"]);
    let plain = json(dir.path(), &["--prompt", "the dog", "--max-tokens", "6"]);
    assert_ne!(chat[0]["tokens"], plain[0]["tokens"], "the template changes the prompt");
    // Cut at the first word the greedy text has beyond its first.
    let text = plain[0]["text"].as_str().unwrap().to_string();
    let second = text.split_whitespace().nth(1).unwrap();
    let stopped = json(dir.path(), &["--prompt", "the dog", "--max-tokens", "6", "--stop", second]);
    let cut = stopped[0]["text"].as_str().unwrap();
    assert!(text.starts_with(cut) && !cut.contains(second), "{cut:?} should be {text:?} cut before {second:?}");
    assert!(stopped[0]["finish"].as_str().unwrap().contains("StopString"));
}

#[test]
fn token_ids_serve_a_model_without_a_tokenizer() {
    let dir = model("ids", false);
    let out = json(dir.path(), &["--ids", "1,5,9;3", "--max-tokens", "4"]);
    assert_eq!(out.len(), 2);
    assert!(out.iter().all(|o| o["tokens"].as_array().unwrap().len() == 4));
    fails(dir.path(), &["--prompt", "the cat"], &["tokenizer.json", "--ids"]);
}

#[test]
fn bad_input_is_named() {
    let dir = model("errors", true);
    fails(Path::new("/nonexistent/model"), &["--prompt", "x"], &["not a directory"]);
    let empty = Scratch::new("cli-generate-empty");
    fails(empty.path(), &["--prompt", "x"], &["config.json", "tessera train"]);
    fails(dir.path(), &["--prompt", "the", "--top-p", "0"], &["top_p"]);
    fails(dir.path(), &["--ids", "1,999"], &["999", "vocabulary"]);
    let long: Vec<String> = (0..70).map(|i| (i % 60).to_string()).collect();
    fails(dir.path(), &["--ids", &long.join(",")], &["context"]);
    fails(dir.path(), &["--ids", "1,x"], &["token ids"]);
    let no_template = model("no-template", true);
    std::fs::write(no_template.path().join("tokenizer_config.json"), r#"{"eos_token": "</s>"}"#).unwrap();
    fails(no_template.path(), &["--chat", "--prompt", "the"], &["template"]);
}

#[test]
fn quantized_weights_generate_and_bad_formats_are_named() {
    let dir = model("quantize", true);
    for format in ["int8", "int4:8", "w8a8"] {
        let out = generate(dir.path(), &["--quantize", format, "--prompt", "the cat", "--max-tokens", "5", "--json"]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "--quantize {format}: {stderr}");
        assert!(stderr.contains("quantized 11 linear weights to"), "{stderr}");
        let line: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(line["tokens"].as_array().unwrap().len(), 5);
    }
    // The fixture's 32 input features take no group of 128, and the error says which would.
    fails(dir.path(), &["--quantize", "int4", "--prompt", "the"], &["group size 128", "group_size"]);
    fails(dir.path(), &["--quantize", "fp8", "--prompt", "the"], &["fp8", "int8", "w8a8"]);
    fails(dir.path(), &["--quantize", "int4:7", "--prompt", "the"], &["even"]);
}

/// The JSON line of a successful `tessera perplexity`.
fn perplexity(dir: &Path, args: &[&str]) -> serde_json::Value {
    let out = tessera("perplexity", dir, &[args, &["--json"]].concat());
    assert!(out.status.success(), "tessera perplexity {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn perplexity_scores_a_text_and_quantization_moves_it_little() {
    let dir = model("perplexity", true);
    let text = Scratch::new("cli-perplexity-text");
    let file = text.path().join("held-out.txt");
    let words: Vec<&str> = (0..60).map(|i| WORDS[(i * 7 + i / 3) % 15]).collect();
    std::fs::write(&file, words.join(" ")).unwrap();
    let file = file.to_str().unwrap();
    let f32 = perplexity(dir.path(), &["--text", file]);
    assert_eq!(f32["tokens"], 59, "one window (the context, 64) over 60 words: all but the first scored");
    let ppl = f32["perplexity"].as_f64().unwrap();
    // A random model over 64 tokens: near uniform, so near 64.
    assert!(ppl.is_finite() && ppl > 1.0 && (ppl / 64.0 - 1.0).abs() < 0.5, "{f32}");
    assert!((f32["nll"].as_f64().unwrap().exp() - ppl).abs() < 1e-9 * ppl);
    // Windows of 32 without overlap lose each window's first token; with stride 8 none.
    assert_eq!(perplexity(dir.path(), &["--text", file, "--window", "32"])["tokens"], 58);
    assert_eq!(perplexity(dir.path(), &["--text", file, "--window", "32", "--stride", "8"])["tokens"], 59);
    for (format, within) in [("int8", 0.01), ("w8a8", 0.02), ("int4:8", 0.1)] {
        let q = perplexity(dir.path(), &["--text", file, "--quantize", format]);
        let change = q["perplexity"].as_f64().unwrap() / ppl - 1.0;
        assert!(change.abs() < within, "{format}: perplexity {} against {ppl}", q["perplexity"]);
        assert!(q["quantize"].as_str().unwrap().starts_with(&format[..4]), "{q}");
    }
    // Errors name the flag and the fix.
    let fails = |dir: &Path, args: &[&str], needles: &[&str]| {
        let out = tessera("perplexity", dir, args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} should fail");
        for n in needles {
            assert!(stderr.contains(n), "{stderr:?} should mention {n:?}");
        }
    };
    fails(dir.path(), &["--text", file, "--window", "1"], &["--window 1", "2 to 64"]);
    fails(dir.path(), &["--text", file, "--window", "65"], &["--window 65"]);
    fails(dir.path(), &["--text", file, "--window", "16", "--stride", "17"], &["--stride 17"]);
    fails(dir.path(), &["--text", file, "--stride", "0"], &["--stride 0"]);
    fails(dir.path(), &["--text", "/nonexistent/text.txt"], &["/nonexistent/text.txt"]);
    let short = text.path().join("short.txt");
    std::fs::write(&short, "the").unwrap();
    fails(dir.path(), &["--text", short.to_str().unwrap()], &["1 token", "at least 2"]);
    let bare = model("perplexity-bare", false);
    fails(bare.path(), &["--text", file], &["tokenizer.json", "--tokenizer"]);
    // A tokenizer from elsewhere gives the same figure.
    let other = perplexity(bare.path(), &["--text", file, "--tokenizer", dir.path().to_str().unwrap()]);
    assert_eq!(other["perplexity"], f32["perplexity"]);
}

#[test]
fn serve_answers_the_openai_api_and_stops_cleanly_on_sigterm() {
    let dir = model("http", true);
    let mut served = serve(dir.path(), &["--api-key", "k", "--served-model-name", "fixture"]);
    let addr = served.addr.clone();
    let (status, body) = http(&addr, "GET", "/v1/models", "", Some("k"));
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"fixture\""), "{body}");
    assert_eq!(http(&addr, "GET", "/v1/models", "", None).0, 401);
    // The same greedy text as `tessera generate --chat`.
    let want = json(dir.path(), &["--chat", "--prompt", "the dog", "--max-tokens", "6"]);
    let chat = serde_json::json!({"model": "fixture", "messages": [{"role": "user", "content": "the dog"}], "max_tokens": 6, "temperature": 0});
    let (status, body) = http(&addr, "POST", "/v1/chat/completions", &chat.to_string(), Some("k"));
    assert_eq!(status, 200, "{body}");
    let reply: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(reply["choices"][0]["message"]["content"], want[0]["text"], "{body}");
    assert_eq!(reply["usage"]["completion_tokens"], want[0]["tokens"].as_array().unwrap().len());

    // A request in flight when SIGTERM comes (its body half sent) is still
    // answered in full.
    use std::io::{Read as _, Write as _};
    let stream = serde_json::json!({"model": "fixture", "prompt": "the cat", "max_tokens": 40, "ignore_eos": true, "stream": true}).to_string();
    let (first, second) = stream.split_at(stream.len() / 2);
    let mut s = std::net::TcpStream::connect(&addr).unwrap();
    write!(s, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nAuthorization: Bearer k\r\nContent-Length: {}\r\n\r\n{first}", stream.len()).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(200));
    let killed = Command::new("kill").args(["-TERM", &served.child.id().to_string()]).status().unwrap();
    assert!(killed.success());
    std::thread::sleep(std::time::Duration::from_millis(200));
    s.write_all(second.as_bytes()).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(120))).unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 200") && answer.contains("data: [DONE]"), "{answer}");
    let exit = served.child.wait().unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut served.stderr, &mut rest).unwrap();
    assert!(exit.success(), "tessera serve exited with {exit}: {rest}");
    assert!(rest.contains("shutting down") && rest.contains("stopped"), "{rest}");
}

#[test]
fn serve_names_a_port_it_cannot_take_and_a_bad_limit() {
    let dir = model("http-port", true);
    let served = serve(dir.path(), &[]);
    let port = served.addr.rsplit(':').next().unwrap().to_string();
    let out = tessera("serve", dir.path(), &["--port", &port]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("cannot listen on") && stderr.contains("--port"), "{stderr}");
    // A bad engine limit is named before anything listens.
    let out = tessera("serve", dir.path(), &["--port", "0", "--max-num-seqs", "0"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("max_num_seqs (0)"), "{stderr}");
    drop(served);
}

/// Real clients against `tessera serve`: the official `openai` Python
/// package (the Python of `$TESSERA_OPENAI_PYTHON`, a virtual environment
/// scripts/openai-client.sh makes and `.ci/run` sets) for completions,
/// chat, streaming and errors, and curl for the raw event stream. Where
/// either is missing the test says it was skipped.
#[test]
fn the_openai_python_client_and_curl_talk_to_tessera_serve() {
    use tessera::backend::cuda::report_skip;
    const TEST: &str = "the_openai_python_client_and_curl_talk_to_tessera_serve";
    let python = std::env::var_os("TESSERA_OPENAI_PYTHON");
    let curl = Command::new("curl").arg("--version").output().is_ok_and(|o| o.status.success());
    if python.is_none() || !curl {
        report_skip(TEST, "needs the openai Python client (eval \"$(scripts/openai-client.sh)\") and curl");
        return;
    }
    let dir = model("clients", true);
    let served = serve(dir.path(), &["--api-key", "k", "--served-model-name", "fixture"]);
    let base = format!("http://{}/v1", served.addr);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/clients/openai_client.py");
    let out = Command::new(python.unwrap()).arg(&script).args([&base, "k", "fixture"]).output().unwrap();
    assert!(out.status.success(), "the openai client failed: {}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let seen: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let want = json(dir.path(), &["--chat", "--prompt", "the dog", "--max-tokens", "6"]);
    assert_eq!(seen["chat"]["text"], want[0]["text"], "{seen}");
    assert_eq!(seen["stream"]["text"], want[0]["text"], "{seen}");
    assert_eq!(seen["stream"]["tokens"], seen["chat"]["tokens"], "{seen}");
    assert_eq!((seen["not_found"].as_u64(), seen["unauthorized"].as_u64()), (Some(404), Some(401)), "{seen}");
    assert_eq!(seen["bad_request"], serde_json::json!({"status": 400, "param": "max_tokens"}), "{seen}");
    assert_eq!(seen["models"], serde_json::json!(["fixture"]));

    // curl -N: the raw server-sent events, each `data:` line a chunk, then [DONE].
    let body = serde_json::json!({"model": "fixture", "prompt": "the cat", "max_tokens": 4, "ignore_eos": true, "stream": true}).to_string();
    let out = Command::new("curl")
        .args(["-sSN", "--fail-with-body", "-H", "Authorization: Bearer k", "-H", "Content-Type: application/json", "-d", &body])
        .arg(format!("{base}/completions"))
        .output()
        .unwrap();
    assert!(out.status.success(), "curl failed: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.trim().is_empty()).collect();
    assert!(events.iter().all(|e| e.starts_with("data: ")), "{text}");
    assert_eq!(events.last(), Some(&"data: [DONE]"), "{text}");
    let chunks: Vec<serde_json::Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(&e["data: ".len()..]).unwrap()).collect();
    assert_eq!(chunks.len(), 4, "{text}");
    assert_eq!(chunks[3]["choices"][0]["finish_reason"], "length");
    drop(served);
}

#[test]
fn serve_with_a_draft_model_gives_the_plain_greedy_text() {
    let dir = model("http-draft", true);
    // The model as its own draft: every proposal is accepted, and greedy
    // text is the target's either way.
    let served = serve(dir.path(), &["--draft", dir.path().to_str().unwrap(), "--speculate", "3", "--served-model-name", "m"]);
    let want = json(dir.path(), &["--prompt", "the cat sat", "--max-tokens", "12"]);
    let body = serde_json::json!({"model": "m", "prompt": "the cat sat", "max_tokens": 12, "temperature": 0}).to_string();
    let (status, reply) = http(&served.addr, "POST", "/v1/completions", &body, None);
    assert_eq!(status, 200, "{reply}");
    let reply: serde_json::Value = serde_json::from_str(&reply).unwrap();
    assert_eq!(reply["choices"][0]["text"], want[0]["text"], "{reply}");
    // The draft did propose, and the model (itself) accepted every proposal.
    let (_, metrics) = http(&served.addr, "GET", "/metrics", "", None);
    let value = |name: &str| -> f64 {
        let line = metrics.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("no {name}: {metrics}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    let proposed = value("tessera_spec_proposed_tokens_total ");
    assert!(proposed > 0.0 && value("tessera_spec_accepted_tokens_total ") == proposed, "{metrics}");
    drop(served);

    let out = tessera("serve", dir.path(), &["--port", "0", "--draft", "/nonexistent/draft"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("the draft model in `/nonexistent/draft`"), "{stderr}");
}

#[test]
fn serve_splits_the_model_over_tensor_parallel_ranks() {
    let dir = model("http-tp", true);
    // Two ranks, each with half the heads, and the model as its own draft
    // split the same way: the greedy text of one rank without a draft.
    let served = serve(dir.path(), &["--tp", "2", "--draft", dir.path().to_str().unwrap(), "--speculate", "2", "--served-model-name", "m"]);
    for prompt in ["the cat sat", "a dog ran to the park"] {
        let want = json(dir.path(), &["--prompt", prompt, "--max-tokens", "10"]);
        let body = serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": 10, "temperature": 0}).to_string();
        let (status, reply) = http(&served.addr, "POST", "/v1/completions", &body, None);
        assert_eq!(status, 200, "{reply}");
        let reply: serde_json::Value = serde_json::from_str(&reply).unwrap();
        assert_eq!(reply["choices"][0]["text"], want[0]["text"], "{reply}");
    }
    // Sampled text with a seed is the same twice (the ranks draw alike, or
    // the group would have stopped), and the stream ends properly.
    let body = serde_json::json!({"model": "m", "prompt": "the", "max_tokens": 12, "temperature": 1.0, "seed": 5, "n": 2}).to_string();
    let choices = || {
        let (status, reply) = http(&served.addr, "POST", "/v1/completions", &body, None);
        assert_eq!(status, 200, "{reply}");
        serde_json::from_str::<serde_json::Value>(&reply).unwrap()["choices"].clone()
    };
    let first = choices();
    assert_eq!(first.as_array().map(Vec::len), Some(2), "{first}");
    assert_eq!(choices(), first);
    let stream = serde_json::json!({"model": "m", "prompt": "the", "max_tokens": 5, "stream": true}).to_string();
    let (status, events) = http(&served.addr, "POST", "/v1/completions", &stream, None);
    assert!(status == 200 && events.contains("data: [DONE]"), "{events}");
    let (_, health) = http(&served.addr, "GET", "/health", "", None);
    assert!(health.contains("ok") || health.is_empty(), "{health}");
    drop(served);

    // Three ranks cannot split four heads: said before anything listens, as
    // a refusal naming the cause, not a panic or a hang.
    let start = std::time::Instant::now();
    let out = tessera("serve", dir.path(), &["--port", "0", "--tp", "3"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("3 tensor-parallel ranks") && !stderr.contains("panicked"), "{stderr}");
    assert!(start.elapsed() < std::time::Duration::from_secs(30), "the refusal took {:?}", start.elapsed());
    let out = tessera("serve", dir.path(), &["--port", "0", "--tp", "0"]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("--tp"));
}
