//! The server over real sockets on 127.0.0.1, spoken to in raw HTTP/1.1:
//! answers against the engine run directly, streaming, every error status,
//! and a client that leaves mid-stream.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tessera::module::{self, Cx};
use tessera::serve::driver::{Driver, DriverLimits};
use tessera::serve::engine::{Engine, EngineConfig, KvMemory};
use tessera::serve::prompt::{ChatMessage, ModelTokenizer};
use tessera::serve::sampling::SamplingParams;
use tessera::testing::{byte_chars, Scratch};
use tessera::Device;
use tessera_models::gpt2::{Gpt2, Gpt2Config};
use tessera_server::{router, ServerState};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// 256 byte tokens, then `<|endoftext|>`.
const VOCAB: usize = 257;
const CTX: usize = 512;
const MODEL: &str = "tiny-gpt2";

fn engine() -> tessera::Result<Engine<Gpt2>> {
    let cx = Cx::new(Device::cpu());
    let model = module::build(Gpt2::new(&Gpt2Config::tiny(VOCAB, 32, 4, 2, CTX)).expect("a valid config"), &cx)?;
    let config = EngineConfig { block_size: 4, kv_memory: KvMemory::Blocks(320), ..EngineConfig::new(CTX) };
    Engine::new(model, cx, config)
}

/// A byte-level tokenizer without merges and a plain chat template.
fn tokenizer() -> (Scratch, ModelTokenizer) {
    let chars = byte_chars();
    let vocab: serde_json::Map<String, Value> = (0..256).map(|b| (chars[b].to_string(), json!(b))).collect();
    let special = json!({"id": 256, "content": "<|endoftext|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true});
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [special], "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false, "vocab": vocab, "merges": []}
    });
    let config = json!({
        "eos_token": "<|endoftext|>",
        "chat_template": "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    });
    let dir = Scratch::new("server-tokenizer");
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    let t = ModelTokenizer::from_dir(&dir).unwrap();
    (dir, t)
}

/// A server on a free port of 127.0.0.1; its state stays reachable.
struct Server {
    addr: std::net::SocketAddr,
    state: Arc<ServerState>,
    _dir: Option<Scratch>,
}

async fn start(with_tokenizer: bool, api_key: Option<&str>, max_pending: usize) -> Server {
    let (dir, tok) = if with_tokenizer { Some(tokenizer()).map(|(d, t)| (Some(d), Some(t))).unwrap() } else { (None, None) };
    let text = tok.clone();
    let driver = Driver::spawn(
        move || {
            let e = engine()?;
            Ok(match &text {
                Some(t) => e.with_tokenizer(t),
                None => e,
            })
        },
        DriverLimits { max_pending },
    )
    .unwrap();
    let state = Arc::new(ServerState::new(driver, tok, MODEL, api_key.map(str::to_string)));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = router(Arc::clone(&state));
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    Server { addr, state, _dir: dir }
}

/// A response: status, headers (lower-case names), body.
struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }

    /// The `data:` payloads of a server-sent event stream.
    fn events(&self) -> Vec<String> {
        self.body.lines().filter_map(|l| l.strip_prefix("data: ")).map(str::to_string).collect()
    }
}

fn request_bytes(method: &str, path: &str, body: &str, extra: &[(&str, &str)]) -> Vec<u8> {
    let mut head =
        format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n", body.len());
    for (k, v) in extra {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    let mut bytes = head.into_bytes();
    bytes.extend_from_slice(body.as_bytes());
    bytes
}

/// Sends one request and reads the whole answer (chunked bodies joined).
async fn call(server: &Server, method: &str, path: &str, body: &str, extra: &[(&str, &str)]) -> Reply {
    let mut s = TcpStream::connect(server.addr).await.unwrap();
    s.write_all(&request_bytes(method, path, body, extra)).await.unwrap();
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(120), s.read_to_end(&mut raw)).await.expect("the server never finished").unwrap();
    let raw = String::from_utf8(raw).unwrap();
    let (head, rest) = raw.split_once("\r\n\r\n").unwrap();
    let mut lines = head.lines();
    let status = lines.next().unwrap().split(' ').nth(1).unwrap().parse().unwrap();
    let headers: Vec<(String, String)> = lines.filter_map(|l| l.split_once(':')).map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string())).collect();
    let chunked = headers.iter().any(|(k, v)| k == "transfer-encoding" && v == "chunked");
    let body = if chunked { dechunk(rest) } else { rest.to_string() };
    Reply { status, headers, body }
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap();
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
    out
}

async fn post(server: &Server, path: &str, body: Value) -> Reply {
    call(server, "POST", path, &body.to_string(), &[]).await
}

/// Token ids from `token_id:N` log-probability entries (a server without a tokenizer).
fn ids_of(tokens: &Value) -> Vec<u32> {
    tokens.as_array().unwrap().iter().map(|t| t.as_str().unwrap().strip_prefix("token_id:").unwrap().parse().unwrap()).collect()
}

fn prompt(i: usize) -> Vec<u32> {
    (0..4 + i % 5).map(|t| ((i * 31 + t * 7) % 256) as u32).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_give_the_engines_tokens_collected_and_streamed() {
    let server = start(false, None, 64).await;
    let prompts: Vec<Vec<u32>> = (0..3).map(prompt).collect();
    let greedy = SamplingParams { max_tokens: 7, ignore_eos: true, ..SamplingParams::greedy() };
    let want = engine().unwrap().generate(&prompts, &greedy).unwrap();

    let body = json!({"model": MODEL, "prompt": prompts, "max_tokens": 7, "temperature": 0, "ignore_eos": true, "logprobs": 2});
    let r = post(&server, "/v1/completions", body.clone()).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["model"], MODEL);
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["finish_reason"], "length");
        assert_eq!(ids_of(&c["logprobs"]["tokens"]), want[i], "choice {i}");
        assert_eq!(c["logprobs"]["top_logprobs"].as_array().unwrap().len(), 7);
        assert!(c["logprobs"]["token_logprobs"].as_array().unwrap().iter().all(|l| l.as_f64().unwrap() <= 0.0));
    }
    let prompt_tokens: usize = prompts.iter().map(Vec::len).sum();
    assert_eq!(v["usage"], json!({"prompt_tokens": prompt_tokens, "completion_tokens": 21, "total_tokens": prompt_tokens + 21}));

    // The same, streamed: chunks per choice that join to the same tokens.
    let mut streamed = body;
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let r = post(&server, "/v1/completions", streamed).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.header("content-type").unwrap().starts_with("text/event-stream"));
    let events = r.events();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let mut got = vec![Vec::new(); 3];
    let mut offsets = vec![Vec::new(); 3];
    let mut finished = 0;
    for e in &events[..events.len() - 2] {
        let chunk: Value = serde_json::from_str(e).unwrap();
        for c in chunk["choices"].as_array().unwrap_or_else(|| panic!("not a chunk: {chunk}")) {
            let i = c["index"].as_u64().unwrap() as usize;
            offsets[i].extend(c["logprobs"]["text_offset"].as_array().unwrap().iter().map(|o| o.as_u64().unwrap()));
            got[i].extend(ids_of(&c["logprobs"]["tokens"]));
            finished += usize::from(c["finish_reason"] == "length");
        }
    }
    assert_eq!((got, finished), (want, 3));
    // Text offsets run on across chunks as in the collected answer.
    for (i, c) in choices.iter().enumerate() {
        let collected: Vec<u64> = c["logprobs"]["text_offset"].as_array().unwrap().iter().map(|o| o.as_u64().unwrap()).collect();
        assert_eq!(offsets[i], collected, "choice {i}");
        assert!(collected.windows(2).all(|w| w[0] < w[1]), "{collected:?}");
    }
    let usage: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 21);
    assert_eq!(server.state.driver.pending(), 0);

    // Both answers are in the metrics: two requests, six generations.
    assert_eq!(post(&server, "/v1/completions", json!({"model": "other", "prompt": [1]})).await.status, 404);
    let m = call(&server, "GET", "/metrics", "", &[]).await;
    assert_eq!(m.status, 200);
    assert!(m.header("content-type").unwrap().starts_with("text/plain; version=0.0.4"));
    let metric = |line: &str| -> f64 {
        let found = m.body.lines().find(|l| l.starts_with(line)).unwrap_or_else(|| panic!("no {line} in {}", m.body));
        found.rsplit(' ').next().unwrap().parse().unwrap()
    };
    assert_eq!(metric("tessera_requests_total{endpoint=\"completions\",status=\"200\"}"), 2.0);
    assert_eq!(metric("tessera_requests_total{endpoint=\"completions\",status=\"404\"}"), 1.0);
    assert_eq!(metric("tessera_generation_tokens_total "), 42.0);
    assert_eq!(metric("tessera_prompt_tokens_total "), 2.0 * prompt_tokens as f64);
    assert_eq!(metric("tessera_time_to_first_token_seconds_count "), 6.0);
    assert_eq!(metric("tessera_time_per_output_token_seconds_count "), 6.0);
    assert_eq!(metric("tessera_time_to_first_token_seconds_bucket{le=\"+Inf\"} "), 6.0);
    assert_eq!(metric("tessera_requests_running "), 0.0);
    assert_eq!(metric("tessera_requests_pending "), 0.0);
    assert!((0.0..=1.0).contains(&metric("tessera_kv_cache_usage_ratio ")));
    assert!(metric("tessera_engine_steps_total ") >= 7.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_renders_the_template_and_seeds_repeat() {
    let server = start(true, None, 64).await;
    let (_dir, tok) = tokenizer();
    let messages = [ChatMessage::system("be brief"), ChatMessage::user("hello there")];
    let prompt_tokens = tok.chat(&messages, true).unwrap().len();
    let body = json!({
        "model": MODEL,
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}]}],
        "max_tokens": 5, "temperature": 0.9, "seed": 7, "ignore_eos": true, "n": 2, "logprobs": true, "top_logprobs": 1, "user": "ignored",
    });
    let r = post(&server, "/v1/chat/completions", body.clone()).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["usage"]["prompt_tokens"], prompt_tokens);
    assert_eq!(v["usage"]["completion_tokens"], 10);
    for c in v["choices"].as_array().unwrap() {
        assert_eq!(c["message"]["role"], "assistant");
        assert_eq!(c["logprobs"]["content"].as_array().unwrap().len(), 5);
        assert_eq!(c["logprobs"]["content"][0]["top_logprobs"].as_array().unwrap().len(), 1);
    }
    // The same seed gives the same choices again.
    let again = post(&server, "/v1/chat/completions", body.clone()).await.json();
    assert_eq!(again["choices"], v["choices"]);

    let mut streamed = body;
    streamed["stream"] = json!(true);
    let r = post(&server, "/v1/chat/completions", streamed).await;
    let events = r.events();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk"), "{chunks:?}");
    assert_eq!(chunks.iter().filter(|c| c["choices"][0]["delta"]["role"] == "assistant").count(), 2);
    assert_eq!(chunks.iter().filter(|c| c["choices"][0]["finish_reason"] == "length").count(), 2);
    let tokens: usize = chunks.iter().map(|c| c["choices"][0]["logprobs"]["content"].as_array().map_or(0, Vec::len)).sum();
    assert_eq!(tokens, 10);

    let models = call(&server, "GET", "/v1/models", "", &[]).await.json();
    assert_eq!(models["data"][0]["id"], MODEL);
    assert_eq!(call(&server, "GET", "/health", "", &[]).await.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_openai_errors_with_the_right_status() {
    let server = start(true, Some("sesame"), 1).await;
    let auth = [("Authorization", "Bearer sesame")];
    let ask = |body: String| {
        let server = &server;
        async move { call(server, "POST", "/v1/completions", &body, &auth).await }
    };
    let cases: Vec<(String, u16, Option<&str>, &str)> = vec![
        ("{\"model\": ".into(), 400, None, "not valid JSON"),
        (json!({"model": MODEL, "prompt": "hi", "max_tokens": 0}).to_string(), 400, Some("max_tokens"), "at least 1"),
        (json!({"model": MODEL, "prompt": "hi", "max_tokens": -3}).to_string(), 400, Some("max_tokens"), "at least 1"),
        (json!({"model": MODEL, "prompt": "hi", "temperature": "hot"}).to_string(), 400, Some("temperature"), "invalid type"),
        (json!({"model": MODEL, "prompt": "hi", "n": 0}).to_string(), 400, Some("n"), "n must be"),
        (json!({"model": MODEL, "prompt": "hi", "logprobs": 99}).to_string(), 400, Some("logprobs"), "logprobs must be"),
        (json!({"model": MODEL, "prompt": "hi", "top_p": 7.0}).to_string(), 400, None, "top_p"),
        (json!({"model": MODEL}).to_string(), 400, None, "prompt"),
        (json!({"model": MODEL, "prompt": []}).to_string(), 400, Some("prompt"), "empty"),
        (json!({"model": MODEL, "prompt": "x".repeat(CTX + 5)}).to_string(), 400, None, "context"),
        (json!({"model": MODEL, "prompt": [[3, 999]]}).to_string(), 400, None, "vocabulary"),
        (json!({"model": "gpt-4", "prompt": "hi"}).to_string(), 404, Some("model"), "does not exist"),
    ];
    for (body, status, param, says) in cases {
        let r = ask(body.clone()).await;
        assert_eq!(r.status, status, "{body}: {}", r.body);
        let e = &r.json()["error"];
        assert!(e["message"].as_str().unwrap().contains(says), "{body}: {e}");
        assert!(e["type"].is_string(), "{body}: {e}");
        if let Some(p) = param {
            assert_eq!(e["param"], p, "{body}: {e}");
        }
    }
    // Without the key, or with another: 401; /health needs none.
    let body = json!({"model": MODEL, "prompt": "hi", "max_tokens": 2}).to_string();
    for extra in [&[][..], &[("Authorization", "Bearer nope")][..]] {
        let r = call(&server, "POST", "/v1/completions", &body, extra).await;
        assert_eq!((r.status, r.json()["error"]["code"].as_str()), (401, Some("invalid_api_key")));
    }
    assert_eq!(call(&server, "GET", "/health", "", &[]).await.status, 200);

    // A full queue (one request at most): 429 with Retry-After, then room again.
    let long = json!({"model": MODEL, "prompt": "a", "max_tokens": 50, "ignore_eos": true, "stream": true}).to_string();
    let mut first = TcpStream::connect(server.addr).await.unwrap();
    first.write_all(&request_bytes("POST", "/v1/completions", &long, &auth)).await.unwrap();
    let start = Instant::now();
    while server.state.driver.pending() == 0 {
        assert!(start.elapsed() < Duration::from_secs(60));
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let r = ask(body.clone()).await;
    assert_eq!(r.status, 429, "{}", r.body);
    assert_eq!(r.header("retry-after"), Some("1"));
    let mut rest = Vec::new();
    first.read_to_end(&mut rest).await.unwrap();
    assert!(String::from_utf8_lossy(&rest).contains("data: [DONE]"));
    let start = Instant::now();
    while server.state.driver.pending() > 0 {
        assert!(start.elapsed() < Duration::from_secs(60));
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert_eq!(ask(body).await.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_mid_stream_frees_its_blocks() {
    let server = start(false, None, 8).await;
    let all = server.state.driver.state().kv_blocks;
    let body = json!({"model": MODEL, "prompt": [prompt(1), prompt(2)], "max_tokens": 480, "ignore_eos": true, "stream": true}).to_string();
    let mut s = TcpStream::connect(server.addr).await.unwrap();
    s.write_all(&request_bytes("POST", "/v1/completions", &body, &[])).await.unwrap();
    // Read until a few chunks have come, then hang up.
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while String::from_utf8_lossy(&seen).matches("data: ").count() < 4 {
        let n = tokio::time::timeout(Duration::from_secs(60), s.read(&mut buf)).await.unwrap().unwrap();
        assert!(n > 0, "the stream ended early");
        seen.extend_from_slice(&buf[..n]);
    }
    assert!(server.state.driver.pending() == 2);
    drop(s);
    let start = Instant::now();
    loop {
        let st = server.state.driver.state();
        if server.state.driver.pending() == 0 && st.running == 0 && st.kv_blocks_available == all {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "the requests were not cancelled: {st:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(server.state.driver.state().stats.tokens_generated < 480, "{:?}", server.state.driver.state().stats);
}
