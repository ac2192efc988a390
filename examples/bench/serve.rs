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
//!
//! Every case prints one JSON line, e.g.
//! `{"bench":"serve","case":"continuous","ratio":3.4,...}`.

use anyhow::{ensure, Result};
use std::time::Instant;
use tessera::module::{self, Cx};
use tessera::serve::engine::{DraftModel, Engine, EngineConfig, KvMemory};
use tessera::serve::sampling::SamplingParams;
use tessera::Device;
use tessera_models::gpt2::{Gpt2, Gpt2Config};

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
    /// Rounds of the continuous case (static and continuous alternating); the median ratio is reported.
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
    /// Cases to run (comma-separated): continuous, speculative, paged.
    #[arg(long, value_delimiter = ',', default_value = "continuous,speculative,paged")]
    cases: Vec<String>,
}

/// One request of the workload: prompt and the tokens it asks for.
struct Job {
    prompt: Vec<u32>,
    max_tokens: usize,
}

/// A seeded long-tailed workload: prompt lengths log-uniform in [8, 256],
/// output lengths log-uniform in [4, 256] (most short, a few long).
fn workload(n: usize, vocab: usize, ctx: usize) -> Vec<Job> {
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
            other => anyhow::bail!("unknown case `{other}`; the cases are continuous, speculative, paged"),
        }
    }
    Ok(())
}
