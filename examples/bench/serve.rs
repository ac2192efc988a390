//! `bench serve`: the serving engine against what a user would otherwise
//! run, each pair measured in the same run on the same model and kernels.
//!
//! * `continuous`: a workload of `--requests` requests with mixed prompt
//!   and output lengths (long-tailed, as chat traffic is), run by the engine
//!   with continuous batching, against static batching of the same requests
//!   (batches of `--batch`, 32, in arrival order, prompts padded to the batch's
//!   longest, every sequence decoding until the batch's longest output is
//!   done, as a `generate` call over a padded batch does). Both count only
//!   the tokens the requests asked for. Figure: the ratio of output tokens/s.
//! * `speculative`: batch 1, greedy, with a draft that agrees often (the
//!   target's own first layers: self-speculation, on a target whose later
//!   layers refine, see `refined`) against plain decoding; the text must be
//!   identical. Figures: tokens/s ratio, acceptance rate,
//!   tokens per target forward.
//! * `paged`: how many of the workload's sequences run at once in one KV
//!   memory budget: the engine's peak (blocks of 16, prefix sharing, no
//!   reservation) against reserving the context length per sequence.
//! * `quant`: batch-1 greedy decoding of a Llama (untied head, 134M
//!   parameters by default, so its weights fit no cache and decoding is
//!   bound by memory bandwidth) with int8, int4 (groups of 128) and W8A8
//!   weights (`nn::quantize_linears`, every linear layer and the head)
//!   against the same model in f32. Engines over copies of the model (one
//!   seed) decode the same prompt in turn, `--rounds` times. Figures: decode
//!   tokens/s (the steps after the one that prefills the prompt and samples
//!   the first token), the median ratio to f32 over the rounds, the bytes
//!   one token reads and the bandwidth that makes, and how often the greedy
//!   tokens agree with f32's (no assertion: random weights leave small
//!   logit margins).
//!
//! Every case prints one JSON line (`quant`: one per format), e.g.
//! `{"bench":"serve","case":"continuous","ratio":3.4,...}`.

use anyhow::{bail, ensure, Result};
use std::time::Instant;
use tessera::module::{self, Act, Cx, Module};
use tessera::nn::quantize_linears;
use tessera::ops::QuantFormat;
use tessera::serve::engine::{DraftModel, Engine, EngineConfig, KvMemory, RequestOutput};
use tessera::serve::sampling::SamplingParams;
use tessera::{Device, Tensor};
use tessera_models::gpt2::{Gpt2, Gpt2Config};
use tessera_models::llama::{Llama, LlamaConfig};

/// Arguments of `bench serve`.
#[derive(clap::Args)]
pub struct Args {
    /// Requests in the workload.
    #[arg(long, default_value_t = 64)]
    requests: usize,
    /// Sequences per batch (static) and at most per step (continuous).
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// The paged case's KV budget, in sequences of the full context length.
    #[arg(long, default_value_t = 16)]
    paged_budget: usize,
    /// Width of the model (GPT-2 architecture).
    #[arg(long, default_value_t = 384)]
    d_model: usize,
    /// Layers of the model (the continuous and paged cases).
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// Rounds of the continuous case (static and continuous alternating)
    /// and of the quant case (every format in turn); the median ratio is reported.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Vocabulary of the model.
    #[arg(long, default_value_t = 4096)]
    vocab: usize,
    /// Context length.
    #[arg(long, default_value_t = 512)]
    ctx: usize,
    /// Layers of the speculative case's target (deeper than the others':
    /// the draft's share of the work is what speculation saves against).
    #[arg(long, default_value_t = 12)]
    spec_layers: usize,
    /// Speculative tokens per step.
    #[arg(long, default_value_t = 5)]
    k: usize,
    /// Layers of the self-speculative draft.
    #[arg(long, default_value_t = 1)]
    draft_layers: usize,
    /// Scale of the output projections of the target's blocks past the
    /// draft's (see `refined`): how much its later layers change.
    #[arg(long, default_value_t = 0.03)]
    refine_scale: f32,
    /// Output tokens of the speculative case.
    #[arg(long, default_value_t = 128)]
    spec_tokens: usize,
    /// Width of the quant case's Llama (heads of 64).
    #[arg(long, default_value_t = 768)]
    quant_hidden: usize,
    /// Layers of the quant case's Llama.
    #[arg(long, default_value_t = 12)]
    quant_layers: usize,
    /// Width of the quant case's MLP (`intermediate_size`).
    #[arg(long, default_value_t = 2048)]
    quant_ffn: usize,
    /// Vocabulary of the quant case's Llama (its untied head is quantized too).
    #[arg(long, default_value_t = 32000)]
    quant_vocab: usize,
    /// Prompt tokens of the quant case.
    #[arg(long, default_value_t = 16)]
    quant_prompt: usize,
    /// Output tokens per request of the quant case (the first comes with
    /// the prefill; the other ones are the timed decode steps).
    #[arg(long, default_value_t = 64)]
    quant_tokens: usize,
    /// Weight formats the quant case compares with f32 (comma-separated):
    /// int8, int4 (groups of 128), w8a8.
    #[arg(long, value_delimiter = ',', default_value = "int8,int4,w8a8")]
    quant_formats: Vec<String>,
    /// Cases to run (comma-separated): continuous, speculative, paged, quant.
    #[arg(long, value_delimiter = ',', default_value = "continuous,speculative,paged")]
    cases: Vec<String>,
}

/// One request of the workload: prompt and the tokens it asks for.
pub(crate) struct Job {
    pub(crate) prompt: Vec<u32>,
    pub(crate) max_tokens: usize,
}

/// A seeded long-tailed workload: prompt lengths log-uniform in [8, 256],
/// output lengths log-uniform in [4, 256] (most short, a few long).
pub(crate) fn workload(n: usize, vocab: usize, ctx: usize) -> Vec<Job> {
    let mut s = 0x5eed_u64;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 11) as f64 / (1u64 << 53) as f64
    };
    let log_uniform = |u: f64, lo: f64, hi: f64| (lo.ln() + u * (hi.ln() - lo.ln())).exp().round() as usize;
    (0..n)
        .map(|_| {
            let plen = log_uniform(next(), 8.0, 256.0).min(ctx / 2);
            let out = log_uniform(next(), 4.0, 256.0).min(ctx - plen - 1);
            Job { prompt: (0..plen).map(|_| (next() * vocab as f64) as u32).collect(), max_tokens: out }
        })
        .collect()
}

fn config(args: &Args, layers: usize) -> Gpt2Config {
    Gpt2Config { vocab_size: args.vocab, n_positions: args.ctx, n_embd: args.d_model, n_layer: layers, n_head: args.d_model / 64, ..Gpt2Config::default() }
}

fn engine(args: &Args, layers: usize, cfg: EngineConfig) -> Result<Engine<Gpt2>> {
    let cx = Cx::new(Device::cpu());
    let model = module::build(Gpt2::new(&config(args, layers))?, &cx)?;
    Ok(Engine::new(model, cx, cfg)?)
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams { max_tokens, ignore_eos: true, ..SamplingParams::greedy() }
}

/// The model with the blocks past the draft's scaled down to refinements:
/// their output projections times `--refine-scale`. A trained network's
/// later layers refine what its early ones computed, so its first layers
/// agree with it often (the premise of self-speculative decoding); a
/// randomly initialised one's do not, so this gives the benchmark a target
/// with that structure. The acceptance rate it reaches is reported.
fn refined(e: Engine<Gpt2>, args: &Args) -> Result<Engine<Gpt2>> {
    module::visit_params(e.model(), |p| {
        let deep = p.name.strip_prefix("h.").and_then(|r| r.split('.').next()).and_then(|i| i.parse::<usize>().ok()).is_some_and(|i| i >= args.draft_layers);
        if deep && p.name.ends_with("c_proj.weight") {
            let v = p.param.value()?;
            let scaled: Vec<f32> = v.to_f32_vec()?.iter().map(|x| x * args.refine_scale).collect();
            p.param.set_value(tessera::Tensor::from_vec(scaled, v.dims(), v.device())?)?;
        }
        Ok(())
    })?;
    Ok(e)
}

/// Runs every request to completion; returns (wall seconds, tokens generated).
fn drain(e: &mut Engine<Gpt2>) -> Result<(f64, usize)> {
    let t = Instant::now();
    let mut tokens = 0;
    while e.has_unfinished() {
        tokens += e.step()?.iter().map(|o| o.tokens.len()).sum::<usize>();
    }
    Ok((t.elapsed().as_secs_f64(), tokens))
}

/// Runs the cases and prints one JSON line each.
pub fn run(args: &Args) -> Result<()> {
    ensure!(
        args.requests > 0 && args.batch > 0 && args.rounds > 0 && args.d_model.is_multiple_of(64),
        "--requests, --batch and --rounds must be positive, --d-model a multiple of 64"
    );
    let jobs = workload(args.requests, args.vocab, args.ctx);
    let params = (config(args, args.layers).n_embd * config(args, args.layers).n_embd * 12 * args.layers + 2 * args.vocab * args.d_model) as f64 / 1e6;
    let base = EngineConfig { kv_memory: KvMemory::Blocks(4096), max_num_seqs: args.batch, max_num_batched_tokens: 512, ..EngineConfig::new(args.ctx) };
    let wanted: usize = jobs.iter().map(|j| j.max_tokens).sum();
    for case in &args.cases {
        match case.as_str() {
            "continuous" => {
                // Static: batches in arrival order, prompts left-padded to the batch's longest,
                // every sequence decoding to the batch's longest output.
                let run_static = || -> Result<f64> {
                    let mut e = engine(args, args.layers, base.clone())?;
                    let mut secs = 0.0;
                    for batch in jobs.chunks(args.batch) {
                        let plen = batch.iter().map(|j| j.prompt.len()).max().unwrap_or(1);
                        let out = batch.iter().map(|j| j.max_tokens).max().unwrap_or(1);
                        for j in batch {
                            let mut p = vec![0u32; plen - j.prompt.len()];
                            p.extend(&j.prompt);
                            e.add_request(p, greedy(out))?;
                        }
                        secs += drain(&mut e)?.0;
                    }
                    Ok(secs)
                };
                let run_continuous = || -> Result<(f64, u64)> {
                    let mut e = engine(args, args.layers, base.clone())?;
                    for j in &jobs {
                        e.add_request(j.prompt.clone(), greedy(j.max_tokens))?;
                    }
                    let (secs, generated) = drain(&mut e)?;
                    ensure!(generated == wanted, "continuous batching generated {generated} of {wanted} tokens");
                    Ok((secs, e.stats().steps))
                };
                // Rounds alternate which runs first, so a change in the machine's load
                // between the two halves does not lean one way; the median ratio is reported.
                let mut ratios = Vec::new();
                let (mut cont_best, mut stat_best, mut steps) = (f64::MAX, f64::MAX, 0);
                for round in 0..args.rounds {
                    let (stat, (cont, st)) = if round % 2 == 0 {
                        let s = run_static()?;
                        (s, run_continuous()?)
                    } else {
                        let c = run_continuous()?;
                        (run_static()?, c)
                    };
                    ratios.push(stat / cont);
                    (cont_best, stat_best, steps) = (cont_best.min(cont), stat_best.min(stat), st);
                }
                ratios.sort_by(f64::total_cmp);
                println!(
                    "{}",
                    serde_json::json!({"bench": "serve", "case": "continuous", "requests": jobs.len(), "batch": args.batch, "params_m": params,
                        "output_tokens": wanted, "continuous_tok_s": wanted as f64 / cont_best, "static_tok_s": wanted as f64 / stat_best,
                        "ratio": ratios[ratios.len() / 2], "ratios": ratios, "steps": steps})
                );
            }
            "speculative" => {
                let prompt = jobs[0].prompt.clone();
                let mut plain = refined(engine(args, args.spec_layers, base.clone())?, args)?;
                plain.add_request(prompt.clone(), greedy(args.spec_tokens))?;
                let mut want = Vec::new();
                let t = Instant::now();
                while plain.has_unfinished() {
                    want.extend(plain.step()?.iter().flat_map(|o| o.tokens.iter().map(|t| t.id)));
                }
                let plain_s = t.elapsed().as_secs_f64();
                // The draft: the target's first layers with its embeddings and head (the
                // same seed draws the same values for the parameters the two share).
                let cx = Cx::new(Device::cpu());
                let draft = DraftModel::new(module::build(Gpt2::new(&config(args, args.draft_layers))?, &cx)?, cx, 256, 16)?;
                let mut spec = refined(engine(args, args.spec_layers, base.clone())?, args)?.with_speculation(args.k, Box::new(draft))?;
                spec.add_request(prompt, greedy(args.spec_tokens))?;
                let mut got = Vec::new();
                let t = Instant::now();
                while spec.has_unfinished() {
                    got.extend(spec.step()?.iter().flat_map(|o| o.tokens.iter().map(|t| t.id)));
                }
                let spec_s = t.elapsed().as_secs_f64();
                ensure!(got == want, "speculative decoding changed the greedy text");
                let s = spec.stats();
                println!(
                    "{}",
                    serde_json::json!({"bench": "serve", "case": "speculative", "k": args.k, "draft_layers": args.draft_layers, "layers": args.spec_layers,
                        "tokens": want.len(), "plain_tok_s": want.len() as f64 / plain_s, "spec_tok_s": got.len() as f64 / spec_s,
                        "ratio": plain_s / spec_s, "acceptance": s.acceptance_rate(), "tokens_per_forward": s.tokens_per_step(), "identical": true})
                );
            }
            "paged" => {
                // A budget that holds `--paged-budget` sequences reserved at the full context length.
                let budget_blocks = args.paged_budget * args.ctx / base.block_size;
                let cfg = EngineConfig { kv_memory: KvMemory::Blocks(budget_blocks), max_num_seqs: 1024, ..base.clone() };
                let mut e = engine(args, 2, cfg)?;
                for j in &jobs {
                    e.add_request(j.prompt.clone(), greedy(j.max_tokens))?;
                }
                let (mut peak, mut generated) = (0, 0);
                while e.has_unfinished() {
                    generated += e.step()?.iter().map(|o| o.tokens.len()).sum::<usize>();
                    peak = peak.max(e.num_running());
                }
                ensure!(generated == wanted, "the paged run generated {generated} of {wanted} tokens");
                println!(
                    "{}",
                    serde_json::json!({"bench": "serve", "case": "paged", "kv_slots": budget_blocks * base.block_size, "ctx": args.ctx,
                        "reserved_seqs": args.paged_budget, "paged_peak_seqs": peak, "ratio": peak as f64 / args.paged_budget as f64, "preemptions": e.stats().preemptions})
                );
            }
            "quant" => {
                for line in quant(args)? {
                    println!("{line}");
                }
            }
            other => bail!("unknown case `{other}`; the cases are continuous, speculative, paged, quant"),
        }
    }
    Ok(())
}

/// The quant case's Llama: heads of 64 (as many key/value heads as query
/// heads), an untied head, Hugging Face's defaults otherwise.
fn quant_config(args: &Args) -> LlamaConfig {
    let heads = args.quant_hidden / 64;
    LlamaConfig::tiny(args.quant_vocab, args.quant_hidden, heads, heads, args.quant_ffn, args.quant_layers, args.quant_prompt + args.quant_tokens)
}

/// One engine of the quant case: its format's name, the engine, and the
/// bytes of weights one decoded token reads.
struct QuantEngine {
    name: &'static str,
    engine: Engine<Llama>,
    weight_bytes: usize,
}

/// The quant case's model built with seed 0 (every call draws the same
/// values), its linear layers quantized to `format` unless `None`, in an
/// engine. Weight bytes per token: every linear layer's weight (the head's
/// included), the norms, and the one row of the embedding a token looks up.
fn quant_engine(args: &Args, format: Option<QuantFormat>) -> Result<QuantEngine> {
    let cx = Cx::new(Device::cpu());
    let model = module::build(Llama::new(&quant_config(args))?, &cx)?;
    let (mut linear, mut other) = (0, 0);
    module::visit_params(&model, |p| {
        let n = p.param.global_shape().elem_count();
        if p.param.is_quantizable() {
            linear += 4 * n;
        } else if !p.name.starts_with("embed_tokens.") {
            other += 4 * n;
        }
        Ok(())
    })?;
    if let Some(f) = format {
        let report = quantize_linears(&model, &cx, f)?;
        ensure!(report.skipped.is_empty(), "{f}: weights left in f32: {:?}", report.skipped);
        ensure!(report.bytes_before == linear, "{f}: quantized {} bytes of the {linear} of the linear layers", report.bytes_before);
        linear = report.bytes_after;
    }
    let ctx = args.quant_prompt + args.quant_tokens;
    let cfg = EngineConfig { kv_memory: KvMemory::Blocks(4 * ctx.div_ceil(16) + 4), max_num_seqs: 1, ..EngineConfig::new(ctx) };
    let engine = Engine::new(model, cx, cfg)?;
    Ok(QuantEngine { name: format.map_or("f32", QuantFormat::name), engine, weight_bytes: linear + other + 4 * args.quant_hidden })
}

/// One request decoded alone: its tokens and the seconds (wall, and the
/// process's on-CPU) of the steps after the first; the first step prefills
/// the prompt and samples the first token.
struct Decoded {
    tokens: Vec<u32>,
    wall: f64,
    cpu: f64,
}

fn decode_alone(e: &mut Engine<Llama>, prompt: &[u32], n: usize) -> Result<Decoded> {
    let ids = |outs: Vec<RequestOutput>| outs.into_iter().flat_map(|o| o.tokens.into_iter().map(|t| t.id)).collect::<Vec<_>>();
    e.add_request(prompt.to_vec(), greedy(n))?;
    let mut tokens = ids(e.step()?);
    ensure!(tokens.len() == 1, "the first step gave {} tokens, not the prompt's one", tokens.len());
    let (t, c) = (Instant::now(), super::process_cpu_time());
    while e.has_unfinished() {
        tokens.extend(ids(e.step()?));
    }
    let (wall, cpu) = (t.elapsed().as_secs_f64(), (super::process_cpu_time() - c).as_secs_f64());
    ensure!(tokens.len() == n, "decoded {} of {n} tokens", tokens.len());
    Ok(Decoded { tokens, wall, cpu })
}

/// The logits `model` gives after each prefix `prompt + want[..i]` (`want.len()`
/// rows of the vocabulary), from one full forward: teacher forcing, every
/// position sees the f32 engine's text.
fn forced_logits(model: &Llama, prompt: &[u32], want: &[u32]) -> Result<Vec<f32>> {
    let cx = &mut Cx::new(Device::cpu());
    cx.set_training(false);
    let ids: Vec<u32> = prompt.iter().chain(&want[..want.len() - 1]).copied().collect();
    let (logits, _) = model.forward(cx, Act::new(Tensor::from_vec(ids.clone(), [1, ids.len()], cx.device())?))?;
    let logits = logits.tensor().to_f32_vec()?;
    let vocab = logits.len() / ids.len();
    Ok(logits[(prompt.len() - 1) * vocab..].to_vec())
}

/// How many rows of `logits` (rows of `vocab`) have their largest value at `want`'s token.
fn greedy_hits(logits: &[f32], vocab: usize, want: &[u32]) -> usize {
    let argmax = |row: &[f32]| row.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &x)| if x > b.1 { (i, x) } else { b }).0 as u32;
    logits.chunks(vocab).zip(want).filter(|&(row, &t)| argmax(row) == t).count()
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The quant case: returns one JSON line per format.
fn quant(args: &Args) -> Result<Vec<serde_json::Value>> {
    ensure!(
        args.quant_hidden.is_multiple_of(128) && args.quant_ffn.is_multiple_of(128) && args.quant_prompt > 0 && args.quant_tokens > 1,
        "--quant-hidden and --quant-ffn must be multiples of 128 (heads of 64, int4 groups of 128), --quant-prompt positive, --quant-tokens at least 2"
    );
    let formats = args
        .quant_formats
        .iter()
        .map(|f| match f.as_str() {
            "int8" => Ok(QuantFormat::Int8),
            "int4" => Ok(QuantFormat::int4()),
            "w8a8" => Ok(QuantFormat::W8A8),
            other => bail!("unknown quant format `{other}`; the formats are int8, int4, w8a8"),
        })
        .collect::<Result<Vec<_>>>()?;
    let mut engines = vec![quant_engine(args, None)?];
    let mut params = 0;
    module::visit_params(engines[0].engine.model(), |p| {
        params += p.param.global_shape().elem_count();
        Ok(())
    })?;
    for &f in &formats {
        engines.push(quant_engine(args, Some(f))?);
    }
    // K and V of every layer for each earlier position, read by each decode step's attention (f32 cache).
    let (n, p) = (args.quant_tokens, args.quant_prompt);
    let kv_slot = 2 * args.quant_layers * args.quant_hidden * 4;
    let kv_bytes = (p + 1..p + n).map(|t| kv_slot * t).sum::<usize>() / (n - 1);
    eprintln!(
        "quant: Llama {:.1}M parameters; weight bytes per token: {}",
        params as f64 / 1e6,
        engines.iter().map(|e| format!("{} {:.1} MB", e.name, e.weight_bytes as f64 / 1e6)).collect::<Vec<_>>().join(", ")
    );
    eprintln!(
        "quant: KV cache read per decode step {:.1} MB on average; prompt {p}, {n} tokens ({} timed decode steps) per request, {} rounds",
        kv_bytes as f64 / 1e6,
        n - 1,
        args.rounds
    );
    for e in &mut engines {
        decode_alone(&mut e.engine, &[1, 2, 3], 2)?;
    }
    // Per round and engine: decode seconds per token (wall, CPU) and the tokens.
    let mut runs: Vec<Vec<(f64, f64, Vec<u32>)>> = vec![Vec::new(); engines.len()];
    let mut prompts = Vec::new();
    for round in 0..args.rounds {
        let prompt: Vec<u32> =
            (0..p).map(|i| (((round * p + i + 1) as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40) as u32 % args.quant_vocab as u32).collect();
        for (e, r) in engines.iter_mut().zip(&mut runs) {
            let d = decode_alone(&mut e.engine, &prompt, n)?;
            let steps = (n - 1) as f64;
            eprintln!(
                "quant: round {round} {:<5} {:>7.1} tokens/s decode ({:.1} ms/token, {:.1} ms on CPU)",
                e.name,
                steps / d.wall,
                d.wall / steps * 1e3,
                d.cpu / steps * 1e3
            );
            r.push((d.wall / steps, d.cpu / steps, d.tokens));
        }
        prompts.push(prompt);
    }
    let f32_s = median(runs[0].iter().map(|r| r.0).collect());
    // f32's own full forward at every position of the f32 engine's text, once per round; how often it
    // picks the engine's token says what the kernels' different summation orders alone change.
    let vocab = args.quant_vocab;
    let f32_logits = runs[0].iter().zip(&prompts).map(|(f, prompt)| forced_logits(engines[0].engine.model(), prompt, &f.2)).collect::<Result<Vec<_>>>()?;
    let f32_forced = runs[0].iter().zip(&f32_logits).map(|(f, l)| greedy_hits(l, vocab, &f.2)).sum::<usize>() as f64 / (n * args.rounds) as f64;
    eprintln!("quant: f32's full forward picks the f32 engine's greedy token at {f32_forced:.3} of the positions");
    let f32_bytes = engines[0].weight_bytes + kv_bytes;
    let mut lines = Vec::new();
    for (e, r) in engines.iter().zip(&runs).skip(1) {
        let ratios: Vec<f64> = runs[0].iter().zip(r).map(|(f, q)| f.0 / q.0).collect();
        let cpu_ratio = median(runs[0].iter().zip(r).map(|(f, q)| f.1 / q.1).collect());
        let secs = median(r.iter().map(|q| q.0).collect());
        // Agreement with f32's greedy tokens: position by position as each decoded
        // freely (after a first difference the texts part), and with every prefix
        // f32's (one full forward of the quantized model per round), where the
        // logits' error is also taken: the root mean square of their difference to
        // f32's over that of f32's.
        let (mut same, mut forced, mut prefix, mut err2, mut ref2) = (0, 0, 0, 0.0, 0.0);
        for (((f, q), prompt), fl) in runs[0].iter().zip(r).zip(&prompts).zip(&f32_logits) {
            same += f.2.iter().zip(&q.2).filter(|(a, b)| a == b).count();
            prefix += f.2.iter().zip(&q.2).take_while(|(a, b)| a == b).count();
            let ql = forced_logits(e.engine.model(), prompt, &f.2)?;
            forced += greedy_hits(&ql, vocab, &f.2);
            err2 += ql.iter().zip(fl).map(|(a, b)| ((a - b) as f64).powi(2)).sum::<f64>();
            ref2 += fl.iter().map(|&b| (b as f64).powi(2)).sum::<f64>();
        }
        let logit_err = (err2 / ref2).sqrt();
        let total = (n * args.rounds) as f64;
        let bytes = e.weight_bytes + kv_bytes;
        let ratio = median(ratios.clone());
        eprintln!(
            "quant: {:<5} {:.1} tokens/s vs f32 {:.1}: {ratio:.2}x (rounds {ratios:.2?}); {:.1} vs {:.1} MB per token ({:.2}x fewer), {:.1} vs {:.1} GB/s; greedy agreement {:.2} forced, {:.2} free; logits off by {logit_err:.3} (relative rms)",
            e.name,
            1.0 / secs,
            1.0 / f32_s,
            bytes as f64 / 1e6,
            f32_bytes as f64 / 1e6,
            f32_bytes as f64 / bytes as f64,
            bytes as f64 / secs / 1e9,
            f32_bytes as f64 / f32_s / 1e9,
            forced as f64 / total,
            same as f64 / total
        );
        let r2 = |x: f64| (x * 100.0).round() / 100.0;
        lines.push(serde_json::json!({"bench": "serve", "case": "quant", "format": e.name, "params_m": r2(params as f64 / 1e6), "batch": 1, "prompt": p,
            "decode_tokens": n - 1, "timed": "decode", "clock": "wall", "f32_tok_s": r2(1.0 / f32_s), "quant_tok_s": r2(1.0 / secs), "ratio": r2(ratio),
            "ratios": ratios.into_iter().map(r2).collect::<Vec<_>>(), "cpu_time_ratio": r2(cpu_ratio), "f32_weight_bytes": engines[0].weight_bytes,
            "quant_weight_bytes": e.weight_bytes, "kv_bytes": kv_bytes, "bytes_ratio": r2(f32_bytes as f64 / bytes as f64),
            "f32_gb_per_s": r2(f32_bytes as f64 / f32_s / 1e9), "quant_gb_per_s": r2(bytes as f64 / secs / 1e9),
            "agree_forced": r2(forced as f64 / total), "f32_agree_forced": r2(f32_forced), "agree_free": r2(same as f64 / total), "logit_rel_rms_err": (logit_err * 1e4).round() / 1e4, "same_prefix": r2(prefix as f64 / args.rounds as f64)}));
    }
    Ok(lines)
}
