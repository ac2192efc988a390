//! `tessera generate`: text from a model, through the serving engine.
//!
//! The model is a Hugging Face directory or a training run (see
//! [`crate::model`]), its linear layers optionally quantized (`--quantize`). Prompts are plain text, chat messages rendered by the model's
//! chat template (`--chat`), or token ids (`--ids`, for a model without a
//! tokenizer). One prompt streams its text as it is generated; several are
//! decoded together (continuous batching) and printed in order.

use crate::model::{with_model, UseModel};
use anyhow::{bail, Context};
use std::io::Write as _;
use std::path::PathBuf;
use std::time::Instant;
use tessera::data::SpecialTokens;
use tessera::module::{Cx, Module, Replicated, SplitHidden};
use tessera::ops::QuantFormat;
use tessera::serve::engine::{Engine, EngineConfig, FinishReason, PromptLookup, RequestId};
use tessera::serve::prompt::{ChatMessage, ModelTokenizer, TOKENIZER_FILE};
use tessera::serve::sampling::SamplingParams;

/// Arguments of `tessera generate`.
#[derive(clap::Args)]
pub struct Args {
    /// A Hugging Face model directory, or a training run's directory.
    #[arg(long, value_name = "DIR")]
    model: PathBuf,
    /// A prompt; repeat for several (decoded together).
    #[arg(long, required_unless_present = "ids")]
    prompt: Vec<String>,
    /// Render each prompt as a user message with the model's chat template.
    #[arg(long)]
    chat: bool,
    /// A system message before each chat prompt.
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// A prompt as token ids (`1,5,9`), for a model without a tokenizer; repeat for several.
    #[arg(long, value_delimiter = ';')]
    ids: Vec<String>,
    /// The most tokens to generate per prompt.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Keep the `top_k` most likely tokens (0: all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Nucleus sampling: keep the most likely tokens up to this probability.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Drop tokens less likely than this times the most likely one.
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// Penalise tokens of the prompt and output (1: off).
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    /// Seed of the draws (same seed, same text).
    #[arg(long)]
    seed: Option<u64>,
    /// A string that ends the generation; repeat for several.
    #[arg(long)]
    stop: Vec<String>,
    /// Speculative decoding by prompt lookup, proposing this many tokens per step (0: off).
    #[arg(long, default_value_t = 0)]
    speculate: usize,
    /// KV cache blocks (of 16 tokens).
    #[arg(long, default_value_t = 1024)]
    kv_blocks: usize,
    /// Print one JSON line per prompt (tokens, text, finish reason) instead of text.
    #[arg(long)]
    json: bool,
    /// Quantize the linear layers' weights when loading: int8, int4 (groups of 128), int4:N or w8a8.
    #[arg(long, value_name = "FORMAT")]
    quantize: Option<QuantFormat>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let quantize = args.quantize;
    with_model(&args.model.clone(), quantize, Generate(args))
}

/// Generation, as a use of the loaded model.
struct Generate(Args);

impl UseModel for Generate {
    type Output = ();

    fn run<M: Module<In = Replicated, Out = SplitHidden> + 'static>(
        self,
        model: M,
        cx: Cx,
        tokenizer: Option<ModelTokenizer>,
        context: usize,
    ) -> anyhow::Result<()> {
        serve(&self.0, model, cx, tokenizer, context)
    }
}

/// The sampling parameters the flags set, with the model's stop ids.
fn params(args: &Args, tokenizer: Option<&ModelTokenizer>) -> SamplingParams {
    let mut p = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        repetition_penalty: args.repetition_penalty,
        seed: args.seed,
        max_tokens: args.max_tokens,
        stop: args.stop.clone(),
        ..SamplingParams::default()
    };
    if let Some(t) = tokenizer {
        t.set_stop_ids(&mut p);
    }
    p
}

/// The token ids of every prompt the flags give.
fn prompts(args: &Args, tokenizer: Option<&ModelTokenizer>) -> anyhow::Result<Vec<Vec<u32>>> {
    let mut out = Vec::new();
    for text in &args.prompt {
        let Some(t) = tokenizer else {
            bail!("this model has no {TOKENIZER_FILE}; give prompts as token ids with --ids (e.g. --ids 1,5,9)");
        };
        let ids = if args.chat {
            let mut messages: Vec<ChatMessage> = args.system.iter().map(ChatMessage::system).collect();
            messages.push(ChatMessage::user(text));
            t.chat(&messages, true)?
        } else {
            t.encode(text, SpecialTokens::Added)?
        };
        out.push(ids);
    }
    for list in &args.ids {
        let ids: Vec<u32> = list
            .split(',')
            .map(|s| s.trim().parse::<u32>())
            .collect::<Result<_, _>>()
            .with_context(|| format!("--ids {list:?} is not a comma-separated list of token ids"))?;
        out.push(ids);
    }
    Ok(out)
}

fn serve<M: Module<In = Replicated, Out = SplitHidden>>(args: &Args, model: M, cx: Cx, tokenizer: Option<ModelTokenizer>, ctx: usize) -> anyhow::Result<()> {
    let prompts = prompts(args, tokenizer.as_ref())?;
    let params = params(args, tokenizer.as_ref());
    let config = EngineConfig { kv_memory: tessera::serve::engine::KvMemory::Blocks(args.kv_blocks), ..EngineConfig::new(ctx) };
    let mut engine = Engine::new(model, cx, config)?;
    if args.speculate > 0 {
        engine = engine.with_speculation(args.speculate, Box::new(PromptLookup::default()))?;
    }
    // Text per request: the engine detokenizes each through its own
    // decoder, holding back what a stop string may still cut.
    if let Some(t) = &tokenizer {
        engine = engine.with_tokenizer(t);
    }
    let mut ids: Vec<RequestId> = Vec::new();
    for p in &prompts {
        ids.push(engine.add_request(p.clone(), params.clone()).with_context(|| format!("prompt {}", ids.len() + 1))?);
    }
    let stream = prompts.len() == 1 && !args.json && tokenizer.is_some();
    let started = Instant::now();
    let mut results: Vec<(Vec<u32>, String, Option<FinishReason>)> = vec![(Vec::new(), String::new(), None); ids.len()];
    while engine.has_unfinished() {
        for out in engine.step()? {
            let Some(i) = ids.iter().position(|&id| id == out.id) else { continue };
            let r = &mut results[i];
            r.0.extend(out.tokens.iter().map(|t| t.id));
            r.1.push_str(&out.text);
            if stream {
                print!("{}", out.text);
                std::io::stdout().flush().ok();
            }
            if out.finished.is_some() {
                r.2 = out.finished;
            }
        }
    }
    let secs = started.elapsed().as_secs_f64();
    if stream {
        say!("");
    }
    for (i, (tokens, text, finish)) in results.iter().enumerate() {
        let reason = match finish {
            Some(FinishReason::Error(e)) => bail!("prompt {}: {e}", i + 1),
            Some(f) => format!("{f:?}"),
            None => "unfinished".into(),
        };
        if args.json {
            say!("{}", serde_json::json!({"prompt": i, "tokens": tokens, "text": text, "finish": reason}));
        } else if !stream {
            let shown = if tokenizer.is_some() { text.clone() } else { format!("{tokens:?}") };
            if results.len() == 1 {
                say!("{shown}");
            } else {
                say!("[{}] {shown}", i + 1);
            }
        }
    }
    let s = engine.stats();
    eprintln!("{} tokens in {secs:.2}s ({:.1} tokens/s, {} steps)", s.tokens_generated, s.tokens_generated as f64 / secs.max(1e-9), s.steps);
    Ok(())
}
