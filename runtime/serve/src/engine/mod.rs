//! The engine: requests in, tokens out, one model forward per step over
//! every request that has work, with continuous batching.
//!
//! Each [`step`](Engine::step) schedules (see the scheduling policy in docs/serving.md), runs the
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
mod layout;
mod output;
mod request;
mod schedule;
mod speculate;

pub use config::{EngineConfig, KvMemory};
pub use output::{FinishReason, RequestId, RequestOutput, TokenOut};
pub use request::PieceDecoder;
pub use speculate::{DraftInput, DraftModel, Drafter, PromptLookup, Proposal};

use crate::kv::BlockManager;
use crate::prompt::{Detokenizer, ModelTokenizer};
use crate::sampling::{History, Sampler, SamplingParams, StopChecker};
use layout::StepBatch;
use request::Request;
use schedule::Planned;
use std::collections::VecDeque;
use std::sync::Arc;
use tessera_core::ops::PagedBatch;
use tessera_core::{DType, Device, Error, Result, Tensor};
use tessera_data::SpecialTokens;
use tessera_nn::module::{Act, Cx, Decode, KvCache, Module, Replicated, SplitHidden};

/// Makes a request's [`PieceDecoder`] from its prompt.
pub type TextFactory = Arc<dyn Fn(&[u32]) -> PieceDecoder + Send + Sync>;

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
    /// Tokens proposed by the speculative drafter.
    pub draft_proposed: u64,
    /// Proposed tokens the target accepted.
    pub draft_accepted: u64,
}

impl EngineStats {
    /// The fraction of proposed tokens accepted (0 without speculation).
    pub fn acceptance_rate(&self) -> f64 {
        if self.draft_proposed == 0 {
            0.0
        } else {
            self.draft_accepted as f64 / self.draft_proposed as f64
        }
    }

    /// Tokens generated per model forward.
    pub fn tokens_per_step(&self) -> f64 {
        if self.steps == 0 {
            0.0
        } else {
            self.tokens_generated as f64 / self.steps as f64
        }
    }
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
    text: Option<TextFactory>,
    speculation: Option<(usize, Box<dyn Drafter>)>,
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
        let (dtype, vocab, slot_bytes) = probe_slots(&model, &mut cx, config.block_size)?;
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
            speculation: None,
            stats: EngineStats::default(),
        })
    }

    /// Decodes generated tokens into text with decoders `make` builds, one
    /// per request from its prompt; stop strings need it.
    pub fn with_detokenizer(mut self, make: TextFactory) -> Engine<M> {
        self.text = Some(make);
        self
    }

    /// Decodes generated tokens into text with `tokenizer` (special tokens
    /// left out), as a client wants to read them: the usual
    /// [`with_detokenizer`](Self::with_detokenizer).
    pub fn with_tokenizer(self, tokenizer: &ModelTokenizer) -> Engine<M> {
        let tokenizer = tokenizer.clone();
        self.with_detokenizer(Arc::new(move |prompt: &[u32]| -> PieceDecoder {
            let mut d = Detokenizer::new(&tokenizer, prompt, SpecialTokens::Omitted);
            // An id the tokenizer cannot show adds no text; the token itself
            // is still reported.
            Box::new(move |id| d.push(id).ok().flatten().unwrap_or_default())
        }))
    }

    /// Decodes speculatively: each step, `drafter` proposes up to `k` tokens
    /// per decoding request and the model verifies them in the same forward
    /// ([`Sampler::verify`]): the same output distribution (greedy: the same
    /// tokens), more tokens per forward when the proposals are good. An
    /// error if `k` is 0 or the drafter's vocabulary is not the model's.
    pub fn with_speculation(mut self, k: usize, drafter: Box<dyn Drafter>) -> Result<Engine<M>> {
        if k == 0 {
            return Err(Error::invalid("Engine::with_speculation", "k is 0; propose at least one token per step (4 is common)"));
        }
        if let Some(v) = drafter.vocab().filter(|&v| v != self.vocab) {
            return Err(Error::invalid(
                "Engine::with_speculation",
                format!("the draft model has a vocabulary of {v} and the target {}; a draft must share the target's tokenizer", self.vocab),
            ));
        }
        self.speculation = Some((k, drafter));
        Ok(self)
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
        let text = self.text.as_ref().map(|f| f(&prompt));
        self.waiting.push_back(Request {
            id,
            history: History::new(&prompt),
            tokens: prompt,
            sampler,
            stop,
            text,
            table: None,
            computed: 0,
            preemptions: 0,
            draft: Vec::new(),
            draft_dists: None,
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
                if let Some((_, d)) = self.speculation.as_mut() {
                    d.finished(id);
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
        // A step's operations hand their parallel parts to the kernels'
        // thread pool one by one, a few hundred per token at batch 1. From
        // outside the pool each hand-off wakes a worker, puts the caller to
        // sleep and wakes it again; from a pool thread the caller works on
        // its own part and nobody sleeps. So a single-rank CPU engine runs
        // the whole step on a pool thread (one hand-off per step). Not with
        // tensor parallelism: rank threads wait for each other in
        // collectives, which must not hold the pool's threads; nor on a GPU,
        // whose context is bound to the calling thread.
        let on_cpu = matches!(self.cx.device(), Device::Cpu(_));
        if on_cpu && self.cx.tp().size() == 1 && rayon::current_thread_index().is_none() {
            return rayon::scope(|_| self.step_here());
        }
        self.step_here()
    }

    /// [`Engine::step`] on the calling thread.
    fn step_here(&mut self) -> Result<Vec<RequestOutput>> {
        let mut outputs = std::mem::take(&mut self.ended);
        let mut plan = schedule::schedule(self)?;
        outputs.append(&mut std::mem::take(&mut self.ended));
        if plan.is_empty() {
            return Ok(outputs);
        }
        if self.speculation.is_some() {
            self.draft(&mut plan)?;
        }
        let (ids, batch, rows, samples) = self.lay_out(&plan);
        let logits = run_forward(&self.model, &mut self.cx, &self.cache, &ids, batch, rows)?;
        self.stats.steps += 1;
        self.stats.tokens_computed += ids.len() as u64;
        let vocab = self.vocab;
        let mut finished = Vec::new();
        let mut row = 0;
        for p in &plan {
            let r = &mut self.running[p.index];
            r.computed += p.tokens;
            let Some(&(_, n_rows)) = samples.iter().find(|s| s.0 == p.index) else {
                if let Some(t) = r.table.as_mut() {
                    self.blocks.commit(t, r.computed);
                }
                continue;
            };
            let rows = &logits[row * vocab..(row + n_rows) * vocab];
            row += n_rows;
            let out = self.decide(p.index, rows)?;
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
            if let Some((_, d)) = self.speculation.as_mut() {
                d.finished(r.id);
            }
        }
        Ok(outputs)
    }

    /// Turns running request `i`'s logits rows into its next tokens: one
    /// sample, or with drafts the verification of each then one more.
    /// Leaves its table holding exactly the tokens whose K/V are valid.
    fn decide(&mut self, i: usize, rows: &[f32]) -> Result<RequestOutput> {
        let (vocab, max_len) = (self.vocab, self.config.max_model_len);
        let r = &mut self.running[i];
        let drafts = std::mem::take(&mut r.draft);
        let dists = r.draft_dists.take();
        // The tokens before the drafts, all computed now; the drafts are re-added as accepted.
        let base = r.tokens.len() - drafts.len();
        r.tokens.truncate(base);
        let mut out = RequestOutput { id: r.id, tokens: Vec::new(), text: String::new(), finished: None };
        let mut accepted = 0;
        for (j, &d) in drafts.iter().enumerate() {
            let q = dists.as_ref().map(|q| &q[j][..]);
            let step = match r.sampler.verify(&rows[j * vocab..(j + 1) * vocab], &r.history, d, q) {
                Ok((s, ok)) => {
                    accepted += ok as usize;
                    let o = r.accept(s, max_len);
                    (o, ok)
                }
                Err(e) => (r.end(FinishReason::Error(e.to_string())), false),
            };
            merge(&mut out, step.0);
            if out.finished.is_some() || !step.1 {
                break;
            }
        }
        if out.finished.is_none() && accepted == drafts.len() {
            let row = &rows[drafts.len() * vocab..(drafts.len() + 1) * vocab];
            let o = match r.sampler.sample(row, &r.history) {
                Ok(s) => r.accept(s, max_len),
                Err(e) => r.end(FinishReason::Error(e.to_string())),
            };
            merge(&mut out, o);
        }
        // Valid K/V: the tokens before the drafts and the accepted drafts.
        r.computed = base + accepted;
        if let Some(t) = r.table.as_mut() {
            if t.len() > r.computed {
                self.blocks.truncate(t, r.computed.max(1))?;
            }
            self.blocks.commit(t, r.computed);
        }
        if !drafts.is_empty() {
            self.stats.draft_proposed += drafts.len() as u64;
            self.stats.draft_accepted += accepted as u64;
            if let Some((_, d)) = self.speculation.as_mut() {
                d.accepted(r.id, r.computed);
            }
        }
        Ok(out)
    }

    /// Asks the drafter for proposals for the decoding requests of `plan`
    /// and adds those that get cache slots to the step.
    fn draft(&mut self, plan: &mut [Planned]) -> Result<()> {
        let (k, _) = self.speculation.as_ref().expect("speculating");
        let k = *k;
        let max_len = self.config.max_model_len;
        let mut chosen = Vec::new();
        for (pi, p) in plan.iter().enumerate() {
            let r = &self.running[p.index];
            let left = r.sampler.params().max_tokens.saturating_sub(r.history.generated().len() + 1);
            let room = max_len.saturating_sub(r.tokens.len() + 1);
            let k = k.min(left).min(room);
            if p.tokens == 1 && r.pending() == 1 && k > 0 {
                chosen.push((pi, k));
            }
        }
        if chosen.is_empty() {
            return Ok(());
        }
        let inputs: Vec<DraftInput<'_>> = chosen
            .iter()
            .map(|&(pi, k)| {
                let r = &self.running[plan[pi].index];
                DraftInput { id: r.id, tokens: &r.tokens, k, params: r.sampler.params(), history: &r.history, seed: r.sampler.seed() }
            })
            .collect();
        let proposals = self.speculation.as_mut().expect("speculating").1.propose(&inputs)?;
        drop(inputs);
        let mut copies = Vec::new();
        for ((pi, k), prop) in chosen.into_iter().zip(proposals) {
            let r = &mut self.running[plan[pi].index];
            let table = r.table.as_mut().expect("running requests are admitted");
            let mut taken = 0;
            for &t in prop.tokens.iter().take(k) {
                if t as usize >= self.vocab || !self.blocks.can_append(table) {
                    break;
                }
                if let Some(c) = self.blocks.append(table, t)? {
                    copies.push((c.src as usize, c.dst as usize));
                }
                r.tokens.push(t);
                taken += 1;
            }
            r.draft = r.tokens[r.tokens.len() - taken..].to_vec();
            r.draft_dists = prop.dists.map(|d| d.into_iter().take(taken).collect());
            plan[pi].tokens += taken;
        }
        if !copies.is_empty() {
            self.cache.copy_blocks(&copies)?;
        }
        Ok(())
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
    /// logits from, and which running requests those rows belong to (with
    /// how many rows each).
    fn lay_out(&self, plan: &[Planned]) -> StepLayout {
        let mut step = StepBatch::new(self.config.block_size, plan.iter().filter_map(|p| self.running[p.index].table.as_ref()));
        let (mut rows, mut samples) = (Vec::new(), Vec::new());
        for p in plan {
            let r = &self.running[p.index];
            let table = r.table.as_ref().expect("scheduled requests are admitted");
            step.push(table, &r.tokens, r.computed..r.computed + p.tokens);
            if r.computed + p.tokens == r.tokens.len() {
                // The last token's logits, and each draft's predecessor's.
                let (n, end) = (1 + r.draft.len(), step.ids.len());
                rows.extend((end - n..end).map(|x| x as u32));
                samples.push((p.index, n));
            }
        }
        (step.ids, step.batch, rows, samples)
    }
}

/// Runs one token through `model` with a one-block cache: checks it serves,
/// and measures its cache dtype, vocabulary and the cache bytes of one token.
fn probe_slots<M: Module<In = Replicated, Out = SplitHidden>>(model: &M, cx: &mut Cx, block_size: usize) -> Result<(DType, usize, usize)> {
    let dtype = if cx.compute_dtype().is_float() { cx.compute_dtype() } else { DType::F32 };
    let cache = Arc::new(KvCache::new(cx.device().clone(), dtype, 1, block_size)?);
    let batch = PagedBatch { block_size, positions: vec![0], token_seq: vec![0], slots: vec![0], block_tables: vec![0], table_width: 1 };
    let vocab = run_forward(model, cx, &cache, &[0], batch, vec![0])?.len();
    if cache.layers() == 0 {
        return Err(Error::invalid(
            "Engine",
            "the model has no attention layer that reads the decoding state; serve models built from tessera::nn::CausalAttention",
        ));
    }
    Ok((dtype, vocab, cache.bytes_per_slot()))
}

/// A step's flattened token ids, paged batch, logit rows, and (running
/// index, rows) of each request sampled.
type StepLayout = (Vec<u32>, PagedBatch, Vec<u32>, Vec<(usize, usize)>);

/// Appends a step's output for a request to the outputs of earlier tokens of the same step.
fn merge(into: &mut RequestOutput, o: RequestOutput) {
    into.tokens.extend(o.tokens);
    into.text.push_str(&o.text);
    if o.finished.is_some() {
        into.finished = o.finished;
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
    let shaped = |l: &Tensor| l.rank() == 3 && l.dims()[0] == 1 && l.dims()[1] == n;
    // Checked before the gather too: a tensor without a vocabulary dimension has nothing to gather along.
    let logits = if cx.tp().size() > 1 && shaped(&logits) { cx.tp().all_gather(&logits, 2)? } else { logits };
    if !shaped(&logits) {
        return Err(Error::shape(
            "Engine",
            format!("the model gave logits {} for {n} sampled rows; a served model must end in a vocabulary head (`#[shard(vocab)]` Linear)", logits.shape()),
        ));
    }
    logits.to_dtype(DType::F32)?.to_f32_vec()
}
