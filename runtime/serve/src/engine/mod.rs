//! The engine: requests in, tokens out, one model forward per step over
//! every request that has work, with continuous batching.
//!
//! Each [`step`](Engine::step) schedules (see [`schedule`]), runs the
//! model's own forward on the scheduled tokens flattened into one row with
//! the decoding state in the context ([`Decode`]), and samples the requests
//! whose last known token was computed. Requests join between any two
//! steps and leave as soon as they finish; a long prompt is prefilled in
//! chunks that share steps with the decoding of others; when the cache runs
//! out, the newest requests are preempted and later recomputed.
//!
//! A request's tokens do not depend on what else runs: its attention reads
//! its own cache, its products are batch-invariant, its draws are keyed by
//! its seed and token count. Greedy requests give the same tokens alone or
//! in any batch, and a preempted request repeats itself.

mod config;
mod output;
mod request;
mod schedule;

pub use config::{EngineConfig, KvMemory};
pub use output::{FinishReason, RequestId, RequestOutput, TokenOut};
pub use request::PieceDecoder;

use crate::kv::BlockManager;
use crate::sampling::{History, Sampler, SamplingParams, StopChecker};
use request::Request;
use schedule::Planned;
use std::collections::VecDeque;
use std::sync::Arc;
use tessera_core::ops::PagedBatch;
use tessera_core::{DType, Error, Result, Tensor};
use tessera_nn::module::{Act, Cx, Decode, KvCache, Module, Replicated, SplitHidden};

/// Counts of what the engine has done, for benchmarks and tests.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Steps run (model forwards).
    pub steps: u64,
    /// Tokens run through the model (prefill and decode).
    pub tokens_computed: u64,
    /// Prompt tokens whose K/V came from the prefix cache instead.
    pub prefix_cached_tokens: u64,
    /// Tokens generated.
    pub tokens_generated: u64,
    /// Preemptions (each a later recomputation).
    pub preemptions: u64,
}

/// The serving engine over a model `M` (any model from token ids to
/// vocabulary logits: GPT-2, Llama, Mixtral, a user's).
///
/// ```
/// use tessera::module::{self, Cx};
/// use tessera::serve::engine::{Engine, EngineConfig};
/// use tessera::serve::sampling::SamplingParams;
/// use tessera::Device;
/// use tessera_models::gpt2::{Gpt2, Gpt2Config};
///
/// let cx = Cx::new(Device::cpu());
/// let model = module::build(Gpt2::new(&Gpt2Config::tiny(64, 32, 4, 2, 32))?, &cx)?;
/// let mut engine = Engine::new(model, cx, EngineConfig::new(32))?;
/// let id = engine.add_request(vec![1, 2, 3], SamplingParams { max_tokens: 5, ..SamplingParams::greedy() })?;
/// let mut tokens = Vec::new();
/// while engine.has_unfinished() {
///     for out in engine.step()? {
///         assert_eq!(out.id, id);
///         tokens.extend(out.tokens.iter().map(|t| t.id));
///     }
/// }
/// assert_eq!(tokens.len(), 5);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Engine<M> {
    model: M,
    cx: Cx,
    config: EngineConfig,
    cache: Arc<KvCache>,
    blocks: BlockManager,
    waiting: VecDeque<Request>,
    running: Vec<Request>,
    /// Outputs of requests that ended outside a step (aborts, errors), given with the next step's.
    ended: Vec<RequestOutput>,
    next_id: RequestId,
    vocab: usize,
    text: Option<Arc<dyn Fn() -> PieceDecoder + Send + Sync>>,
    stats: EngineStats,
}

impl<M: Module<In = Replicated, Out = SplitHidden>> Engine<M> {
    /// An engine serving `model`, materialised in `cx` (one rank; on a
    /// tensor-parallel group every rank makes its own engine, adds the same
    /// requests in the same order, and all get the same tokens).
    ///
    /// Runs one token through the model to check it serves and to measure
    /// its vocabulary and the cache bytes one token takes; the error says
    /// what is wrong with a model that does not.
    pub fn new(model: M, mut cx: Cx, config: EngineConfig) -> Result<Engine<M>> {
        config.validate()?;
        cx.set_training(false);
        let dtype = if cx.compute_dtype().is_float() { cx.compute_dtype() } else { DType::F32 };
        let probe = Arc::new(KvCache::new(cx.device().clone(), dtype, 1, config.block_size)?);
        let logits = run_forward(
            &model,
            &mut cx,
            &probe,
            &[0],
            PagedBatch { block_size: config.block_size, positions: vec![0], token_seq: vec![0], slots: vec![0], block_tables: vec![0], table_width: 1 },
            vec![0],
        )?;
        let vocab = logits.len();
        if probe.layers() == 0 {
            return Err(Error::invalid(
                "Engine::new",
                "the model has no attention layer that reads the decoding state; serve models built from tessera::nn::CausalAttention",
            ));
        }
        let slot_bytes = probe.bytes_per_slot();
        let blocks = match config.kv_memory {
            KvMemory::Blocks(n) => n,
            KvMemory::Bytes(b) => b / (slot_bytes * config.block_size).max(1),
        };
        if blocks == 0 {
            return Err(Error::InsufficientMemory {
                detail: format!(
                    "a KV cache budget of {:?} holds no block of {} tokens ({} bytes each); give the cache more memory",
                    config.kv_memory,
                    config.block_size,
                    slot_bytes * config.block_size
                ),
            });
        }
        let watermark = ((blocks as f64 * config.watermark) as usize).min(blocks - 1);
        let manager = BlockManager::new(blocks, config.block_size)?.with_watermark(watermark)?;
        let cache = Arc::new(KvCache::new(cx.device().clone(), dtype, blocks, config.block_size)?);
        Ok(Engine {
            model,
            cx,
            config,
            cache,
            blocks: manager,
            waiting: VecDeque::new(),
            running: Vec::new(),
            ended: Vec::new(),
            next_id: 0,
            vocab,
            text: None,
            stats: EngineStats::default(),
        })
    }

    /// Decodes generated tokens into text with decoders this makes, one per
    /// request; stop strings need it.
    pub fn with_detokenizer(mut self, make: Arc<dyn Fn() -> PieceDecoder + Send + Sync>) -> Engine<M> {
        self.text = Some(make);
        self
    }

    /// The model served.
    pub fn model(&self) -> &M {
        &self.model
    }

    /// The engine's configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The vocabulary size (the width of the model's logits, padding included).
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// The block manager (blocks in use, cached, free).
    pub fn blocks(&self) -> &BlockManager {
        &self.blocks
    }

    /// The KV cache (its size, its bytes per token).
    pub fn cache(&self) -> &KvCache {
        &self.cache
    }

    /// What the engine has done so far.
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// Queues a request for `prompt` (token ids); it joins the next step
    /// that has room. The error (for this request only) names what is wrong:
    /// an empty prompt, an id outside the vocabulary, a prompt that leaves no
    /// room in the context or can never fit the cache, bad sampling parameters.
    pub fn add_request(&mut self, prompt: Vec<u32>, params: SamplingParams) -> Result<RequestId> {
        const OP: &str = "Engine::add_request";
        if prompt.is_empty() {
            return Err(Error::invalid(OP, "the prompt is empty; give at least one token"));
        }
        if let Some(&t) = prompt.iter().find(|&&t| t as usize >= self.vocab) {
            return Err(Error::invalid(OP, format!("token id {t} is outside the model's vocabulary of {}", self.vocab)));
        }
        if prompt.len() >= self.config.max_model_len {
            return Err(Error::invalid(
                OP,
                format!(
                    "the prompt has {} tokens and the model's context is {}; shorten the prompt to leave room for output",
                    prompt.len(),
                    self.config.max_model_len
                ),
            ));
        }
        let need = prompt.len().div_ceil(self.config.block_size);
        if need + self.blocks.watermark() > self.blocks.num_blocks() {
            return Err(Error::InsufficientMemory {
                detail: format!(
                    "a {}-token prompt needs {need} KV cache blocks and the cache admits at most {}; give the cache more memory or shorten the prompt",
                    prompt.len(),
                    self.blocks.num_blocks() - self.blocks.watermark()
                ),
            });
        }
        let id = self.next_id;
        let default_seed = self.config.seed ^ id.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let sampler = Sampler::new(params, self.vocab, default_seed)?;
        self.next_id += 1;
        let stop = StopChecker::new(sampler.params());
        self.waiting.push_back(Request {
            id,
            history: History::new(&prompt),
            tokens: prompt,
            sampler,
            stop,
            text: self.text.as_ref().map(|f| f()),
            table: None,
            computed: 0,
            preemptions: 0,
        });
        Ok(id)
    }

    /// Cancels a request: it leaves at once, its blocks are freed, and the
    /// next step reports it finished with [`FinishReason::Aborted`]. Returns
    /// whether the request was still unfinished.
    pub fn abort(&mut self, id: RequestId) -> bool {
        let found = if let Some(i) = self.running.iter().position(|r| r.id == id) {
            Some(self.running.remove(i))
        } else {
            self.waiting.iter().position(|r| r.id == id).and_then(|i| self.waiting.remove(i))
        };
        match found {
            Some(mut r) => {
                if let Some(t) = r.table.take() {
                    self.blocks.free(t);
                }
                self.ended.push(r.end(FinishReason::Aborted));
                true
            }
            None => false,
        }
    }

    /// Whether any request is waiting or running (or has an ending to report).
    pub fn has_unfinished(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty() || !self.ended.is_empty()
    }

    /// Requests waiting for admission.
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Requests admitted (prefilling or decoding).
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// One step: schedules, runs the model once on every scheduled token,
    /// samples, and returns an output for each request that generated a
    /// token or finished.
    pub fn step(&mut self) -> Result<Vec<RequestOutput>> {
        let mut outputs = std::mem::take(&mut self.ended);
        let plan = schedule::schedule(self)?;
        outputs.append(&mut std::mem::take(&mut self.ended));
        if plan.is_empty() {
            return Ok(outputs);
        }
        let (ids, batch, rows, samples) = self.lay_out(&plan);
        let logits = run_forward(&self.model, &mut self.cx, &self.cache, &ids, batch, rows)?;
        self.stats.steps += 1;
        self.stats.tokens_computed += ids.len() as u64;
        let vocab = self.vocab;
        let mut finished = Vec::new();
        let mut sampled = 0;
        for p in &plan {
            let r = &mut self.running[p.index];
            r.computed += p.tokens;
            if let Some(t) = r.table.as_mut() {
                self.blocks.commit(t, r.computed);
            }
            if !samples.contains(&p.index) {
                continue;
            }
            let row = &logits[sampled * vocab..(sampled + 1) * vocab];
            sampled += 1;
            let out = match r.sampler.sample(row, &r.history) {
                Ok(s) => r.accept(s, self.config.max_model_len),
                Err(e) => r.end(FinishReason::Error(e.to_string())),
            };
            self.stats.tokens_generated += out.tokens.len() as u64;
            if out.finished.is_some() {
                finished.push(p.index);
            }
            outputs.push(out);
        }
        finished.sort_unstable();
        for i in finished.into_iter().rev() {
            let mut r = self.running.remove(i);
            if let Some(t) = r.table.take() {
                self.blocks.free(t);
            }
        }
        Ok(outputs)
    }

    /// Runs every request to completion; returns each request's generated
    /// tokens, in the order of `prompts`. A request that fails to be added
    /// fails the call; one that ends in error mid-way ends its tokens there.
    pub fn generate(&mut self, prompts: &[Vec<u32>], params: &SamplingParams) -> Result<Vec<Vec<u32>>> {
        let ids: Vec<RequestId> = prompts.iter().map(|p| self.add_request(p.clone(), params.clone())).collect::<Result<_>>()?;
        let mut out: std::collections::HashMap<RequestId, Vec<u32>> = ids.iter().map(|&i| (i, Vec::new())).collect();
        while self.has_unfinished() {
            for o in self.step()? {
                if let Some(v) = out.get_mut(&o.id) {
                    v.extend(o.tokens.iter().map(|t| t.id));
                }
            }
        }
        Ok(ids.iter().map(|i| out.remove(i).unwrap_or_default()).collect())
    }

    /// The step's flattened token ids, its paged batch, the rows to take
    /// logits from and which running requests those rows belong to.
    fn lay_out(&self, plan: &[Planned]) -> (Vec<u32>, PagedBatch, Vec<u32>, Vec<usize>) {
        let bs = self.config.block_size;
        let width = plan.iter().map(|p| self.running[p.index].table.as_ref().map_or(0, |t| t.blocks().len())).max().unwrap_or(1).max(1);
        let mut batch = PagedBatch { block_size: bs, table_width: width, ..PagedBatch::default() };
        let (mut ids, mut rows, mut samples) = (Vec::new(), Vec::new(), Vec::new());
        for (s, p) in plan.iter().enumerate() {
            let r = &self.running[p.index];
            let table = r.table.as_ref().expect("scheduled requests are admitted");
            let mut row = table.blocks().to_vec();
            row.resize(width, 0);
            batch.block_tables.extend(row);
            for pos in r.computed..r.computed + p.tokens {
                ids.push(r.tokens[pos]);
                batch.positions.push(pos as u32);
                batch.token_seq.push(s as u32);
                batch.slots.push(table.slot(pos).expect("the table holds every known token").flat(bs) as u32);
            }
            if r.computed + p.tokens == r.tokens.len() {
                rows.push(ids.len() as u32 - 1);
                samples.push(p.index);
            }
        }
        (ids, batch, rows, samples)
    }
}

/// One forward of `ids` with the decoding state set; the logits of `rows`,
/// gathered over the vocabulary-parallel group, as f32.
fn run_forward<M: Module<In = Replicated, Out = SplitHidden>>(
    model: &M,
    cx: &mut Cx,
    cache: &Arc<KvCache>,
    ids: &[u32],
    batch: PagedBatch,
    rows: Vec<u32>,
) -> Result<Vec<f32>> {
    let n = rows.len();
    let decode = Decode { batch, cache: cache.clone(), logit_rows: Some(rows) };
    let input = Tensor::from_vec(ids.to_vec(), [1, ids.len()], cx.device())?;
    let previous = cx.set_decode(Some(Arc::new(decode)));
    let result = model.forward(cx, Act::new(input));
    cx.set_decode(previous);
    let logits = result?.0.into_tensor();
    let logits = if cx.tp().size() > 1 { cx.tp().all_gather(&logits, logits.rank() - 1)? } else { logits };
    if logits.elem_count() % n.max(1) != 0 || logits.dims().first() != Some(&1) || logits.dims().get(1) != Some(&n) {
        return Err(Error::shape(
            "Engine",
            format!("the model gave logits {} for {n} sampled rows; a served model must end in a vocabulary head (`#[shard(vocab)]` Linear)", logits.shape()),
        ));
    }
    logits.to_dtype(DType::F32)?.to_f32_vec()
}
