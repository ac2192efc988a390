//! Tessera's OpenAI-compatible HTTP server over the inference engine.
//!
//! [`router`] answers OpenAI's API over a [`Driver`] (an engine on its own
//! thread) and the model's tokenizer:
//!
//! | method and path | what it does |
//! |---|---|
//! | `POST /v1/completions` | text (or token ids) in, completions out; `stream: true` sends server-sent events ending in `data: [DONE]` |
//! | `POST /v1/chat/completions` | messages rendered by the model's chat template, the assistant's reply out; streams the same way |
//! | `GET /v1/models` | the one model served |
//! | `GET /health` | 200 while the engine runs, 503 once it has stopped |
//! | `GET /metrics` | Prometheus text: requests, tokens, latencies, queue, KV cache (see [`metrics`]) |
//!
//! Errors are OpenAI's error objects (see [`ApiError`]): 400 for a
//! malformed body, a field of the wrong type or value, or a prompt the
//! engine refuses (too long for the context, ...); 404 for another model's
//! name; 401 without the API key when one is set; 429 with `Retry-After`
//! when the engine's queue is full. A client that disconnects mid-answer
//! cancels its requests, which frees their KV blocks.

mod api;
mod error;
pub mod metrics;
mod routes;

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use axum::routing::{get, post};
use axum::Router;
use tessera_serve::driver::Driver;
use tessera_serve::prompt::ModelTokenizer;

pub use error::ApiError;

/// What the server serves: an engine, its tokenizer, and how it is named.
pub struct ServerState {
    /// The engine, on its own thread.
    pub driver: Driver,
    /// The model's tokenizer: text prompts, chat templates, token texts.
    /// Without one, prompts must be token ids and texts are empty.
    pub tokenizer: Option<ModelTokenizer>,
    /// The name clients give as `model`.
    pub model_name: String,
    /// When set, `/v1/*` requests need `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
    /// When the server started (Unix seconds), for `/v1/models`.
    pub created: u64,
    /// The server's counts for `/metrics`.
    pub metrics: metrics::Metrics,
    next_id: AtomicU64,
}

impl ServerState {
    /// A server's state; the time is now.
    pub fn new(driver: Driver, tokenizer: Option<ModelTokenizer>, model_name: impl Into<String>, api_key: Option<String>) -> ServerState {
        ServerState {
            driver,
            tokenizer,
            model_name: model_name.into(),
            api_key,
            created: unix_now(),
            metrics: metrics::Metrics::default(),
            next_id: AtomicU64::new(0),
        }
    }
}

/// The routes of the API over `state`.
pub fn router(state: Arc<ServerState>) -> Router {
    Router::new()
        .route("/v1/completions", post(routes::completions))
        .route("/v1/chat/completions", post(routes::chat))
        .route("/v1/models", get(routes::models))
        .route("/health", get(routes::health))
        .route("/metrics", get(routes::metrics))
        .with_state(state)
}

/// Seconds since the Unix epoch.
fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}
