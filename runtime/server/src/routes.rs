//! The handlers: each request becomes one engine request per (prompt,
//! choice), submitted to the driver; the answer is collected, or streamed
//! as server-sent events while the engine produces it.

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use tessera_data::SpecialTokens;
use tessera_serve::driver::{Event, Sink};
use tessera_serve::engine::{FinishReason, TokenOut};
use tessera_serve::sampling::{SamplingParams, StopReason};
use tokio::sync::mpsc::{self, UnboundedReceiver, UnboundedSender};
use tokio_stream::wrappers::{ReceiverStream, UnboundedReceiverStream};
use tokio_stream::{StreamExt, StreamMap};

use crate::api::{self, ChatRequest, CompletionRequest, PromptInput, Sampling};
use crate::error::ApiError;
use crate::{unix_now, ServerState};

type Shared = State<Arc<ServerState>>;

/// Completions' `max_tokens` when the request gives none (OpenAI's).
const DEFAULT_COMPLETION_TOKENS: usize = 16;

/// `POST /v1/completions`.
pub async fn completions(State(state): Shared, headers: HeaderMap, body: Bytes) -> Response {
    let answer = completion(&state, &headers, &body).await;
    counted(&state, "completions", answer)
}

/// `POST /v1/chat/completions`.
pub async fn chat(State(state): Shared, headers: HeaderMap, body: Bytes) -> Response {
    let answer = chat_completion(&state, &headers, &body).await;
    counted(&state, "chat", answer)
}

/// The response, its status counted for `/metrics`.
fn counted(state: &ServerState, endpoint: &'static str, answer: Result<Response, ApiError>) -> Response {
    let response = answer.unwrap_or_else(IntoResponse::into_response);
    state.metrics.request(endpoint, response.status().as_u16());
    response
}

/// `GET /metrics`.
pub async fn metrics(State(state): Shared) -> Response {
    let text = state.metrics.render(&state.driver);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response()
}

async fn completion(state: &Arc<ServerState>, headers: &HeaderMap, body: &[u8]) -> Result<Response, ApiError> {
    authorize(state, headers)?;
    let body = api::body(body)?;
    let req = CompletionRequest { sampling: api::part(&body)?, ..api::part(&body)? };
    check_model(state, &req.model)?;
    let prompts = completion_prompts(state, &req.prompt)?;
    let params = engine_params(state, &req.sampling, DEFAULT_COMPLETION_TOKENS, req.logprobs)?;
    let echo = if req.echo { prompts.iter().map(|p| text_of(state, p)).collect() } else { vec![String::new(); prompts.len()] };
    let answer = Answer { flavor: Flavor::Completion, id: format!("cmpl-{}", next_id(state)), top: req.logprobs.map(|k| k as usize), echo };
    run(Arc::clone(state), answer, prompts, &req.sampling, params).await
}

async fn chat_completion(state: &Arc<ServerState>, headers: &HeaderMap, body: &[u8]) -> Result<Response, ApiError> {
    authorize(state, headers)?;
    let body = api::body(body)?;
    let mut req = ChatRequest { sampling: api::part(&body)?, ..api::part(&body)? };
    check_model(state, &req.model)?;
    let Some(tokenizer) = &state.tokenizer else {
        return Err(ApiError::invalid("this model has no tokenizer, so no chat template; use /v1/completions with token ids", Some("messages")));
    };
    if req.messages.is_empty() {
        return Err(ApiError::invalid("messages is empty; send at least one message", Some("messages")));
    }
    let prompt = tokenizer.chat(&req.chat_messages()?, true).map_err(|e| ApiError::invalid(e.to_string(), Some("messages")))?;
    if req.sampling.max_tokens.is_none() {
        req.sampling.max_tokens = req.max_completion_tokens;
    }
    // Without a limit a reply may run to the end of the context.
    let room = state.driver.info().max_model_len.saturating_sub(prompt.len()).max(1);
    let top = req.logprobs.then(|| req.top_logprobs.unwrap_or(0));
    let params = engine_params(state, &req.sampling, room, top)?;
    let answer = Answer { flavor: Flavor::Chat, id: format!("chatcmpl-{}", next_id(state)), top: top.map(|k| k as usize), echo: vec![String::new()] };
    run(Arc::clone(state), answer, vec![prompt], &req.sampling, params).await
}

/// `GET /v1/models`.
pub async fn models(State(state): Shared, headers: HeaderMap) -> Result<Json<Value>, ApiError> {
    authorize(&state, &headers)?;
    Ok(Json(json!({
        "object": "list",
        "data": [{
            "id": state.model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "tessera",
            "max_model_len": state.driver.info().max_model_len,
        }],
    })))
}

/// `GET /health`: 200 while the engine runs.
pub async fn health(State(state): Shared) -> Response {
    match state.driver.state().stopped {
        None => (StatusCode::OK, "ok").into_response(),
        Some(reason) => (StatusCode::SERVICE_UNAVAILABLE, reason).into_response(),
    }
}

/// Refuses a request without the server's API key, when it has one.
fn authorize(state: &ServerState, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = &state.api_key else { return Ok(()) };
    let given = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
    if given.is_some_and(|g| g.trim() == key) {
        Ok(())
    } else {
        Err(ApiError::unauthorized())
    }
}

fn check_model(state: &ServerState, asked: &str) -> Result<(), ApiError> {
    if asked == state.model_name {
        Ok(())
    } else {
        Err(ApiError::unknown_model(asked, &state.model_name))
    }
}

fn next_id(state: &ServerState) -> u64 {
    state.next_id.fetch_add(1, Ordering::Relaxed)
}

/// The token ids of every prompt of a completion request.
fn completion_prompts(state: &ServerState, prompt: &PromptInput) -> Result<Vec<Vec<u32>>, ApiError> {
    let encode = |text: &str| -> Result<Vec<u32>, ApiError> {
        let Some(t) = &state.tokenizer else {
            return Err(ApiError::invalid("this model has no tokenizer; send the prompt as token ids", Some("prompt")));
        };
        t.encode(text, SpecialTokens::Added).map_err(|e| ApiError::invalid(e.to_string(), Some("prompt")))
    };
    let prompts = match prompt {
        PromptInput::Text(t) => vec![encode(t)?],
        PromptInput::Texts(ts) => ts.iter().map(|t| encode(t)).collect::<Result<_, _>>()?,
        PromptInput::Ids(ids) => vec![ids.clone()],
        PromptInput::IdLists(lists) => lists.clone(),
    };
    if prompts.is_empty() {
        return Err(ApiError::invalid("the prompt list is empty; send at least one prompt", Some("prompt")));
    }
    Ok(prompts)
}

/// The engine's parameters, with the model's end-of-sequence ids.
fn engine_params(state: &ServerState, sampling: &Sampling, default_max: usize, logprobs: Option<i64>) -> Result<SamplingParams, ApiError> {
    let mut params = sampling.params(default_max, logprobs, state.driver.info().vocab)?;
    if let Some(t) = &state.tokenizer {
        t.set_stop_ids(&mut params);
    }
    Ok(params)
}

/// The text of token ids (empty without a tokenizer).
fn text_of(state: &ServerState, ids: &[u32]) -> String {
    state.tokenizer.as_ref().and_then(|t| t.decode(ids, SpecialTokens::Omitted).ok()).unwrap_or_default()
}

/// How one token is shown in log probabilities: its text, or
/// `token_id:N` without a tokenizer (as vLLM writes it).
fn token_text(state: &ServerState, id: u32) -> String {
    match &state.tokenizer {
        Some(t) => t.decode(&[id], SpecialTokens::Added).unwrap_or_else(|_| format!("token_id:{id}")),
        None => format!("token_id:{id}"),
    }
}

/// The two shapes of answer.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Flavor {
    Completion,
    Chat,
}

/// What every chunk or choice of one answer shares.
struct Answer {
    flavor: Flavor,
    id: String,
    /// Alternatives per token when log probabilities were asked for.
    top: Option<usize>,
    /// Per prompt, the text an echoing completion starts with.
    echo: Vec<String>,
}

/// Where a request's events go: a channel the handler reads. The driver's
/// thread sends without waiting; a dropped receiver (the client left)
/// cancels the request.
struct ClientSink(UnboundedSender<Event>);

impl Sink for ClientSink {
    fn send(&mut self, event: Event) -> bool {
        self.0.send(event).is_ok()
    }

    fn is_closed(&self) -> bool {
        self.0.is_closed()
    }
}

/// One engine request: choice `index` of the answer, for prompt `prompt`.
struct Job {
    index: usize,
    prompt: usize,
    rx: UnboundedReceiver<Event>,
    timing: Timing,
}

/// When a request's tokens came, for the latency metrics.
struct Timing {
    submitted: Instant,
    first: Option<Instant>,
    last: Option<Instant>,
    tokens: usize,
}

impl Timing {
    fn new() -> Timing {
        Timing { submitted: Instant::now(), first: None, last: None, tokens: 0 }
    }

    fn tokens(&mut self, n: usize) {
        if n > 0 {
            let now = Instant::now();
            self.first.get_or_insert(now);
            self.last = Some(now);
            self.tokens += n;
        }
    }

    fn report(&self, metrics: &crate::metrics::Metrics) {
        let first = self.first.map(|f| f - self.submitted);
        let after = match (self.first, self.last) {
            (Some(f), Some(l)) => l - f,
            _ => std::time::Duration::ZERO,
        };
        metrics.finished(first, after, self.tokens);
    }
}

/// Submits every (prompt, choice) and waits until the engine has taken
/// each: a refusal is the answer (a 400 naming why), and the requests
/// already taken are cancelled as their receivers drop.
async fn start(state: &ServerState, prompts: &[Vec<u32>], n: usize, params: &SamplingParams) -> Result<Vec<Job>, ApiError> {
    let mut jobs = Vec::with_capacity(prompts.len() * n);
    for (p, ids) in prompts.iter().enumerate() {
        for c in 0..n {
            let mut params = params.clone();
            // Choices of one seeded request differ from each other, and
            // the same request gives the same choices again.
            params.seed = params.seed.map(|s| s.wrapping_add(c as u64));
            let (tx, rx) = mpsc::unbounded_channel();
            state.driver.submit(ids.clone(), params, ClientSink(tx))?;
            jobs.push(Job { index: p * n + c, prompt: p, rx, timing: Timing::new() });
        }
    }
    for job in &mut jobs {
        match job.rx.recv().await {
            Some(Event::Admitted(_)) => state.metrics.prompt(prompts[job.prompt].len()),
            Some(Event::Rejected(e)) => return Err(ApiError::invalid(e.to_string(), None)),
            Some(Event::Output(_)) | None => return Err(ApiError::internal("the engine answered out of order or stopped; see the server's log")),
        }
    }
    Ok(jobs)
}

/// Runs the answer's requests and responds, collected or streamed.
async fn run(state: Arc<ServerState>, answer: Answer, prompts: Vec<Vec<u32>>, sampling: &Sampling, params: SamplingParams) -> Result<Response, ApiError> {
    let n = sampling.choices()?;
    let jobs = start(&state, &prompts, n, &params).await?;
    let usage_prompt: usize = prompts.iter().map(Vec::len).sum();
    if sampling.stream {
        let include_usage = sampling.stream_options.as_ref().is_some_and(|o| o.include_usage);
        return Ok(stream(state, answer, jobs, usage_prompt, include_usage).into_response());
    }
    let mut choices = Vec::with_capacity(jobs.len());
    let mut completion_tokens = 0;
    for mut job in jobs {
        let (mut tokens, mut text, mut finish) = (Vec::new(), String::new(), None);
        while let Some(event) = job.rx.recv().await {
            if let Event::Output(out) = event {
                job.timing.tokens(out.tokens.len());
                tokens.extend(out.tokens);
                text.push_str(&out.text);
                if out.finished.is_some() {
                    finish = out.finished;
                    break;
                }
            }
        }
        job.timing.report(&state.metrics);
        let reason = finish_reason(finish.as_ref())?;
        completion_tokens += tokens.len();
        let text = format!("{}{text}", answer.echo[job.prompt]);
        let mut offset = answer.echo[job.prompt].len();
        choices.push(answer.choice(&state, job.index, &text, &tokens, Some(reason), false, &mut offset));
    }
    Ok(Json(json!({
        "id": answer.id,
        "object": answer.flavor.object(false),
        "created": unix_now(),
        "model": state.model_name,
        "choices": choices,
        "usage": usage(usage_prompt, completion_tokens),
    }))
    .into_response())
}

/// The answer as server-sent events: a chunk per step's output per choice,
/// the usage if asked, then `[DONE]`. A client that goes away stops the
/// forwarding task, whose dropped receivers cancel the requests.
fn stream(state: Arc<ServerState>, answer: Answer, jobs: Vec<Job>, usage_prompt: usize, include_usage: bool) -> impl IntoResponse {
    let (tx, rx) = mpsc::channel::<SseEvent>(64);
    tokio::spawn(async move {
        let created = unix_now();
        let chunk = |choices: Vec<Value>| {
            let body = json!({"id": answer.id, "object": answer.flavor.object(true), "created": created, "model": state.model_name, "choices": choices});
            SseEvent::default().data(body.to_string())
        };
        let mut streams = StreamMap::new();
        let mut timings = std::collections::HashMap::new();
        // Where each choice's next token starts in its text, for `text_offset`.
        let mut offsets = std::collections::HashMap::new();
        for job in jobs {
            if answer.flavor == Flavor::Chat {
                let first = json!({"index": job.index, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null});
                if tx.send(chunk(vec![first])).await.is_err() {
                    return;
                }
            }
            let echo = &answer.echo[job.prompt];
            if !echo.is_empty() && tx.send(chunk(vec![answer.choice(&state, job.index, echo, &[], None, true, &mut 0)])).await.is_err() {
                return;
            }
            offsets.insert(job.index, echo.len());
            streams.insert(job.index, UnboundedReceiverStream::new(job.rx));
            timings.insert(job.index, job.timing);
        }
        let mut completion_tokens = 0;
        while let Some((index, event)) = streams.next().await {
            let Event::Output(out) = event else { continue };
            if out.tokens.is_empty() && out.text.is_empty() && out.finished.is_none() {
                continue;
            }
            completion_tokens += out.tokens.len();
            if let Some(t) = timings.get_mut(&index) {
                t.tokens(out.tokens.len());
                if out.finished.is_some() {
                    t.report(&state.metrics);
                }
            }
            let reason = match out.finished.as_ref().map(|f| finish_reason(Some(f))) {
                None => None,
                Some(Ok(r)) => Some(r),
                Some(Err(e)) => {
                    // The request failed mid-answer: say so in the stream.
                    if tx.send(SseEvent::default().data(e.body().to_string())).await.is_err() {
                        return;
                    }
                    continue;
                }
            };
            let offset = offsets.entry(index).or_default();
            if tx.send(chunk(vec![answer.choice(&state, index, &out.text, &out.tokens, reason, true, offset)])).await.is_err() {
                return;
            }
        }
        if include_usage {
            let body = json!({"id": answer.id, "object": answer.flavor.object(true), "created": created, "model": state.model_name, "choices": [], "usage": usage(usage_prompt, completion_tokens)});
            if tx.send(SseEvent::default().data(body.to_string())).await.is_err() {
                return;
            }
        }
        let _ = tx.send(SseEvent::default().data("[DONE]")).await;
    });
    Sse::new(ReceiverStream::new(rx).map(Ok::<_, Infallible>)).keep_alive(KeepAlive::default())
}

impl Flavor {
    fn object(self, chunk: bool) -> &'static str {
        match (self, chunk) {
            (Flavor::Completion, _) => "text_completion",
            (Flavor::Chat, false) => "chat.completion",
            (Flavor::Chat, true) => "chat.completion.chunk",
        }
    }
}

impl Answer {
    /// One choice (or, in a stream, one piece of it): its text, tokens'
    /// log probabilities if asked, and why it finished if it has. `offset`
    /// is where the first token's text starts in the choice's text, moved
    /// past these tokens.
    #[allow(clippy::too_many_arguments)]
    fn choice(&self, state: &ServerState, index: usize, text: &str, tokens: &[TokenOut], finish: Option<&str>, chunk: bool, offset: &mut usize) -> Value {
        let logprobs = self.top.map(|k| match self.flavor {
            Flavor::Completion => completion_logprobs(state, tokens, k, offset),
            Flavor::Chat => chat_logprobs(state, tokens),
        });
        match (self.flavor, chunk) {
            (Flavor::Completion, _) => json!({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}),
            (Flavor::Chat, false) => {
                json!({"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs, "finish_reason": finish})
            }
            (Flavor::Chat, true) => {
                let delta = if text.is_empty() && finish.is_some() { json!({}) } else { json!({"content": text}) };
                json!({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
            }
        }
    }
}

/// Completions' log probabilities: parallel lists, the alternatives as a
/// map per token (when `k` > 0), each token's text offset counted on from
/// `offset`.
fn completion_logprobs(state: &ServerState, tokens: &[TokenOut], k: usize, offset: &mut usize) -> Value {
    let texts: Vec<String> = tokens.iter().map(|t| token_text(state, t.id)).collect();
    let offsets: Vec<usize> = texts
        .iter()
        .map(|t| {
            let at = *offset;
            *offset += t.len();
            at
        })
        .collect();
    let top: Value = if k == 0 {
        Value::Null
    } else {
        tokens.iter().map(|t| t.top.iter().map(|&(id, lp)| (token_text(state, id), json!(lp))).collect::<serde_json::Map<_, _>>()).collect()
    };
    json!({
        "tokens": texts,
        "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
        "top_logprobs": top,
        "text_offset": offsets,
    })
}

/// Chat's log probabilities: an entry per token with its bytes and its
/// alternatives.
fn chat_logprobs(state: &ServerState, tokens: &[TokenOut]) -> Value {
    let entry = |id: u32, logprob: f32| {
        let text = token_text(state, id);
        json!({"token": text, "logprob": logprob, "bytes": text.as_bytes()})
    };
    let content: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let mut e = entry(t.id, t.logprob);
            e["top_logprobs"] = t.top.iter().map(|&(id, lp)| entry(id, lp)).collect();
            e
        })
        .collect();
    json!({"content": content})
}

/// OpenAI's `finish_reason`, or the error a request failed with.
fn finish_reason(finish: Option<&FinishReason>) -> Result<&'static str, ApiError> {
    match finish {
        Some(FinishReason::Stop(StopReason::MaxTokens)) | Some(FinishReason::Length) => Ok("length"),
        Some(FinishReason::Stop(_)) => Ok("stop"),
        Some(FinishReason::Aborted) => Ok("abort"),
        Some(FinishReason::Error(e)) => Err(ApiError::internal(format!("generation failed: {e}"))),
        None => Err(ApiError::internal("the engine stopped before the answer was complete; see the server's log")),
    }
}

fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}
