//! `bench serve-http`: what the HTTP layer costs. The same workload (the
//! long-tailed requests of `bench serve`, arriving as a Poisson process) is
//! run by clients of the engine in the same process (a [`Driver`], each
//! request submitted from its own thread at its arrival time) and by HTTP
//! clients of `tessera-server` on 127.0.0.1 (one streaming connection per
//! request, raw HTTP/1.1), alternating for `--rounds` rounds on fresh
//! engines over the same weights.
//!
//! Figures per side: output tokens/s over the run (first arrival to last
//! answer), time to first token and time per output token (p50 and p99),
//! requests completed, refused and lost. The ratio of HTTP to in-process
//! throughput (median over rounds) is the figure of merit; nothing may be
//! lost: every request ends with all its tokens or with an error.
//!
//! Each side prints one JSON line per round, then one summary line:
//! `{"bench":"serve-http","case":"summary","ratio":0.98,...}`.

use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use serde_json::json;
use tessera::module::{self, Cx};
use tessera::serve::driver::{Driver, DriverLimits, Event};
use tessera::serve::engine::{Engine, EngineConfig, KvMemory};
use tessera::serve::sampling::SamplingParams;
use tessera::Device;
use tessera_models::gpt2::{Gpt2, Gpt2Config};
use tessera_server::{router, ServerState};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

use crate::serve::{median, workload, Job};

/// Arguments of `bench serve-http`.
#[derive(clap::Args)]
pub struct Args {
    /// Requests in the workload.
    #[arg(long, default_value_t = 64)]
    requests: usize,
    /// Mean arrivals per second (Poisson); high rates saturate the engine,
    /// which is where a slow HTTP layer would show.
    #[arg(long, default_value_t = 50.0)]
    rate: f64,
    /// Seconds a round may take before it is called lost.
    #[arg(long, default_value_t = 600)]
    max_seconds: u64,
    /// Sequences per engine step at most.
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// Width of the model (GPT-2 architecture).
    #[arg(long, default_value_t = 384)]
    d_model: usize,
    /// Layers of the model.
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// Vocabulary of the model.
    #[arg(long, default_value_t = 4096)]
    vocab: usize,
    /// Context length.
    #[arg(long, default_value_t = 512)]
    ctx: usize,
    /// Rounds (in-process and HTTP alternating); the median ratio is reported.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
}

/// What one request saw, in seconds from its arrival.
#[derive(Clone, Debug, Default)]
struct Seen {
    tokens: usize,
    first: Option<f64>,
    last: f64,
    error: Option<String>,
}

/// One side's round.
struct Round {
    seconds: f64,
    seen: Vec<Seen>,
}

fn driver(args: &Args) -> Result<Driver> {
    let cfg = Gpt2Config {
        vocab_size: args.vocab,
        n_positions: args.ctx,
        n_embd: args.d_model,
        n_layer: args.layers,
        n_head: args.d_model / 64,
        ..Gpt2Config::default()
    };
    let config = EngineConfig { kv_memory: KvMemory::Blocks(4096), max_num_seqs: args.batch, ..EngineConfig::new(args.ctx) };
    let requests = args.requests;
    Ok(Driver::spawn(
        move || {
            let cx = Cx::new(Device::cpu());
            let model = module::build(Gpt2::new(&cfg).map_err(|e| tessera::Error::invalid("bench", e.to_string()))?, &cx)?;
            Engine::new(model, cx, config)
        },
        DriverLimits { max_pending: requests.max(1) },
    )?)
}

/// Seeded Poisson arrival times (seconds from the start), the first at 0.
fn arrivals(n: usize, rate: f64) -> Vec<f64> {
    let mut s = 0xa441_u64;
    let mut t = 0.0;
    (0..n)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = ((s >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
            if i > 0 {
                t += -u.ln() / rate;
            }
            t
        })
        .collect()
}

fn params(job: &Job) -> SamplingParams {
    SamplingParams { max_tokens: job.max_tokens, ignore_eos: true, ..SamplingParams::greedy() }
}

/// The engine's own clients: a thread per request submits at its arrival
/// time and reads its events.
fn in_process(args: &Args, jobs: &[Job], at: &[f64]) -> Result<Round> {
    let driver = driver(args)?;
    let start = Instant::now();
    let limit = Duration::from_secs(args.max_seconds);
    let seen: Vec<Seen> = std::thread::scope(|scope| {
        let handles: Vec<_> = jobs
            .iter()
            .zip(at)
            .map(|(job, &t)| {
                let driver = &driver;
                scope.spawn(move || {
                    std::thread::sleep(Duration::from_secs_f64(t).saturating_sub(start.elapsed()));
                    let arrived = Instant::now();
                    let mut seen = Seen::default();
                    let (tx, rx) = mpsc::channel();
                    if let Err(e) = driver.submit(job.prompt.clone(), params(job), tx) {
                        seen.error = Some(e.to_string());
                        return seen;
                    }
                    loop {
                        match rx.recv_timeout(limit) {
                            Ok(Event::Admitted(_)) => {}
                            Ok(Event::Rejected(e)) => {
                                seen.error = Some(e.to_string());
                                return seen;
                            }
                            Ok(Event::Output(out)) => {
                                if !out.tokens.is_empty() {
                                    let now = arrived.elapsed().as_secs_f64();
                                    seen.first.get_or_insert(now);
                                    seen.last = now;
                                    seen.tokens += out.tokens.len();
                                }
                                if out.finished.is_some() {
                                    return seen;
                                }
                            }
                            Err(_) => {
                                seen.error = Some("no answer in time".into());
                                return seen;
                            }
                        }
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_default()).collect()
    });
    let seconds = start.elapsed().as_secs_f64();
    driver.shutdown(false)?;
    Ok(Round { seconds, seen })
}

/// HTTP clients of the server: a task per request opens a connection at
/// its arrival time and reads the event stream.
fn over_http(args: &Args, jobs: &[Job], at: &[f64]) -> Result<Round> {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let state = Arc::new(ServerState::new(driver(args)?, None, "bench", None));
    let limit = Duration::from_secs(args.max_seconds);
    let (seconds, seen) = runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let app = router(Arc::clone(&state));
        let server = tokio::spawn(async move { axum::serve(listener, app).await });
        let start = tokio::time::Instant::now();
        let tasks: Vec<_> = jobs
            .iter()
            .zip(at)
            .map(|(job, &t)| {
                let body = json!({"model": "bench", "prompt": job.prompt, "max_tokens": job.max_tokens, "temperature": 0,
                                  "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}})
                .to_string();
                tokio::spawn(async move {
                    tokio::time::sleep_until(start + Duration::from_secs_f64(t)).await;
                    let arrived = Instant::now();
                    match tokio::time::timeout(limit, stream_one(addr, &body, arrived)).await {
                        Ok(Ok(seen)) => seen,
                        Ok(Err(e)) => Seen { error: Some(format!("{e:#}")), ..Seen::default() },
                        Err(_) => Seen { error: Some("no answer in time".into()), ..Seen::default() },
                    }
                })
            })
            .collect();
        let mut seen = Vec::with_capacity(tasks.len());
        for t in tasks {
            seen.push(t.await.unwrap_or_default());
        }
        let seconds = start.elapsed().as_secs_f64();
        server.abort();
        anyhow::Ok((seconds, seen))
    })?;
    drop(runtime);
    let state = Arc::try_unwrap(state).map_err(|_| anyhow::anyhow!("the server still holds the engine"))?;
    state.driver.shutdown(false)?;
    Ok(Round { seconds, seen })
}

/// One streaming completion over a fresh connection: when its chunks came
/// (each carries the tokens of one engine step) and, from the usage chunk,
/// how many tokens it got.
async fn stream_one(addr: std::net::SocketAddr, body: &str, arrived: Instant) -> Result<Seen> {
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let head = format!("POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n", body.len());
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await?;
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    reader.read_line(&mut line).await?;
    if !line.starts_with("HTTP/1.1 200") {
        bail!("the server answered {}", line.trim());
    }
    loop {
        line.clear();
        reader.read_line(&mut line).await?;
        if line == "\r\n" {
            break;
        }
    }
    // The body is chunked: take whole chunks, then whole events.
    let (mut events, mut seen) = (String::new(), Seen::default());
    loop {
        line.clear();
        reader.read_line(&mut line).await?;
        let size = usize::from_str_radix(line.trim(), 16).with_context(|| format!("a chunk size, not {line:?}"))?;
        if size == 0 {
            bail!("the stream ended without [DONE]");
        }
        let mut chunk = vec![0u8; size + 2];
        reader.read_exact(&mut chunk).await?;
        events.push_str(std::str::from_utf8(&chunk[..size])?);
        while let Some(end) = events.find("\n\n") {
            let event: String = events.drain(..end + 2).collect();
            let Some(data) = event.trim_end().strip_prefix("data: ") else { continue };
            if data == "[DONE]" {
                return Ok(seen);
            }
            let v: serde_json::Value = serde_json::from_str(data)?;
            if let Some(e) = v.get("error") {
                seen.error = Some(e.to_string());
                continue;
            }
            if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                seen.tokens = n as usize;
            } else if v["choices"].as_array().is_some_and(|c| !c.is_empty()) {
                let now = arrived.elapsed().as_secs_f64();
                seen.first.get_or_insert(now);
                seen.last = now;
            }
        }
    }
}

/// p-th percentile (0..=100) of `v`, nearest rank.
fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[((p / 100.0 * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1]
}

/// A round's figures as JSON, checking that nothing was lost.
fn figures(side: &str, round: usize, r: &Round, jobs: &[Job]) -> Result<serde_json::Value> {
    let complete = r.seen.iter().zip(jobs).filter(|(s, j)| s.error.is_none() && s.tokens == j.max_tokens).count();
    let refused = r.seen.iter().filter(|s| s.error.is_some()).count();
    let lost = jobs.len() - complete - refused;
    ensure!(lost == 0, "{side}, round {round}: {lost} requests ended without all their tokens and without an error");
    let tokens: usize = r.seen.iter().map(|s| s.tokens).sum();
    let mut ttft: Vec<f64> = r.seen.iter().filter_map(|s| s.first).collect();
    let mut tpot: Vec<f64> = r.seen.iter().filter(|s| s.tokens > 1).filter_map(|s| s.first.map(|f| (s.last - f) / (s.tokens - 1) as f64)).collect();
    Ok(json!({
        "bench": "serve-http", "case": side, "round": round, "requests": jobs.len(), "complete": complete, "refused": refused, "lost": lost,
        "tokens": tokens, "seconds": r.seconds, "tokens_per_s": tokens as f64 / r.seconds,
        "ttft_p50_ms": percentile(&mut ttft, 50.0) * 1e3, "ttft_p99_ms": percentile(&mut ttft, 99.0) * 1e3,
        "tpot_p50_ms": percentile(&mut tpot, 50.0) * 1e3, "tpot_p99_ms": percentile(&mut tpot, 99.0) * 1e3,
    }))
}

pub fn run(args: &Args) -> Result<()> {
    ensure!(
        args.requests > 0 && args.rounds > 0 && args.rate > 0.0 && args.d_model.is_multiple_of(64),
        "--requests, --rounds and --rate must be positive, --d-model a multiple of 64"
    );
    let jobs = workload(args.requests, args.vocab, args.ctx);
    let at = arrivals(jobs.len(), args.rate);
    let (mut ratios, mut lines) = (Vec::new(), Vec::new());
    for round in 0..args.rounds {
        let direct = figures("in-process", round, &in_process(args, &jobs, &at)?, &jobs)?;
        let http = figures("http", round, &over_http(args, &jobs, &at)?, &jobs)?;
        let ratio = http["tokens_per_s"].as_f64().unwrap_or(0.0) / direct["tokens_per_s"].as_f64().unwrap_or(f64::NAN);
        eprintln!(
            "serve-http: round {round}: in-process {:.0} tokens/s, HTTP {:.0} tokens/s ({ratio:.3}); TTFT p50 {:.0} / {:.0} ms, TPOT p50 {:.1} / {:.1} ms",
            direct["tokens_per_s"].as_f64().unwrap_or(0.0),
            http["tokens_per_s"].as_f64().unwrap_or(0.0),
            direct["ttft_p50_ms"].as_f64().unwrap_or(0.0),
            http["ttft_p50_ms"].as_f64().unwrap_or(0.0),
            direct["tpot_p50_ms"].as_f64().unwrap_or(0.0),
            http["tpot_p50_ms"].as_f64().unwrap_or(0.0),
        );
        ratios.push(ratio);
        lines.push(direct);
        lines.push(http);
    }
    for l in &lines {
        println!("{l}");
    }
    let ratio = median(ratios.clone());
    println!(
        "{}",
        json!({"bench": "serve-http", "case": "summary", "requests": args.requests, "rate": args.rate, "ratio": (ratio * 1000.0).round() / 1000.0,
               "ratios": ratios.iter().map(|r| (r * 1000.0).round() / 1000.0).collect::<Vec<_>>(), "http_cost": ((1.0 - ratio) * 1000.0).round() / 1000.0})
    );
    Ok(())
}
