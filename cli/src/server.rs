//! `tessera serve`: the model behind an OpenAI-compatible HTTP API.
//!
//! The model (a Hugging Face directory or a training run, see
//! [`crate::model`]) runs in a [`Driver`], split over `--tp` ranks (threads
//! of this process, each with its shard and its engine, in lockstep) when
//! asked; `tessera-server` answers HTTP on
//! `--host`:`--port`. SIGTERM or Ctrl-C stops taking connections and lets
//! the answers in flight finish, for at most `--shutdown-timeout` seconds;
//! what is still running then is cancelled (its blocks freed) and the
//! program exits.

use crate::model::{with_loader, Loader, UseLoader};
use anyhow::Context;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tessera::dist::inproc::{mesh_groups, InProcess};
use tessera::dist::mesh::Mesh;
use tessera::module::{Cx, Module, Replicated, SplitHidden};
use tessera::ops::QuantFormat;
use tessera::serve::driver::{Driver, DriverLimits};
use tessera::serve::engine::{DraftModel, Drafter, Engine, EngineConfig, KvMemory, PromptLookup};
use tessera::serve::kv::DEFAULT_BLOCK_SIZE;
use tessera::Device;
use tessera_server::{router, ServerState};

/// Arguments of `tessera serve`.
#[derive(clap::Args)]
pub struct Args {
    /// A Hugging Face model directory, or a training run's directory.
    #[arg(long, value_name = "DIR")]
    model: PathBuf,
    /// The name clients give as `model` (default: the directory's name).
    #[arg(long)]
    served_model_name: Option<String>,
    /// The address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// The port to listen on (0: any free one; the address is printed).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Split the model over this many tensor-parallel ranks (threads of this process); it must
    /// divide the model's attention heads and hidden sizes.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=256))]
    tp: u16,
    /// Require `Authorization: Bearer KEY` on /v1 requests.
    #[arg(long, value_name = "KEY")]
    api_key: Option<String>,
    /// Quantize the linear layers' weights when loading: int8, int4 (groups of 128), int4:N or w8a8.
    #[arg(long, value_name = "FORMAT")]
    quantize: Option<QuantFormat>,
    /// KV cache blocks (of 16 tokens).
    #[arg(long, default_value_t = 1024)]
    kv_blocks: usize,
    /// The most sequences in one engine step.
    #[arg(long, default_value_t = 64)]
    max_num_seqs: usize,
    /// The most tokens in one engine step (decode tokens plus prefill chunks).
    #[arg(long, default_value_t = 512)]
    max_num_batched_tokens: usize,
    /// Requests waiting or running at most; more get 429 with Retry-After.
    #[arg(long, default_value_t = 256)]
    max_pending: usize,
    /// Speculative decoding, proposing this many tokens per step (0: off): by prompt lookup, or
    /// by the --draft model (4 when --draft is given without it).
    #[arg(long, default_value_t = 0)]
    speculate: usize,
    /// A smaller model with the same tokenizer (a Hugging Face directory or a training run) that
    /// proposes the tokens the model verifies.
    #[arg(long, value_name = "DIR")]
    draft: Option<PathBuf>,
    /// Seconds a shutdown waits for the answers in flight before cancelling them.
    #[arg(long, default_value_t = 30)]
    shutdown_timeout: u64,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let (dir, quantize) = (args.model.clone(), args.quantize);
    with_loader(&dir, quantize, Serve(args))
}

/// Serving, as a use of the model's loader.
struct Serve(Args);

/// Builds a rank's drafter from that rank's context.
type LoadDrafter = Arc<dyn Fn(&Cx) -> anyhow::Result<Box<dyn Drafter>> + Send + Sync>;

impl UseLoader for Serve {
    type Output = ();

    fn run<M: Module<In = Replicated, Out = SplitHidden> + 'static>(self, loader: Loader<M>) -> anyhow::Result<()> {
        let args = self.0;
        let tp = usize::from(args.tp);
        let config = EngineConfig {
            kv_memory: KvMemory::Blocks(args.kv_blocks),
            max_num_seqs: args.max_num_seqs,
            max_num_batched_tokens: args.max_num_batched_tokens,
            ..EngineConfig::new(loader.context)
        };
        let tokenizer = loader.tokenizer.clone();
        // The draft model (not quantized: it is small) is split like the
        // model, over the same ranks.
        let drafter: Option<LoadDrafter> = match &args.draft {
            Some(dir) => Some(with_loader(dir, None, LoadDraft { blocks: args.kv_blocks }).with_context(|| format!("the draft model in `{}`", dir.display()))?),
            None => None,
        };
        let speculate = match (args.speculate, &drafter) {
            (0, Some(_)) => DEFAULT_DRAFT_TOKENS,
            (k, _) => k,
        };
        // Each rank's engine is built on its own thread from its context.
        let text = tokenizer.clone();
        let engine = move |cx: Cx| -> anyhow::Result<Engine<M>> {
            let model = loader.load(&cx)?;
            let drafter = match &drafter {
                Some(load) => Some(load(&cx).context("loading the draft model")?),
                None => None,
            };
            let mut engine = Engine::new(model, cx, config.clone())?;
            if speculate > 0 {
                engine = engine.with_speculation(speculate, drafter.unwrap_or_else(|| Box::new(PromptLookup::default())))?;
            }
            Ok(match &text {
                Some(t) => engine.with_tokenizer(t),
                None => engine,
            })
        };
        let limits = DriverLimits { max_pending: args.max_pending };
        let driver = if tp == 1 {
            Driver::spawn(move || engine(Cx::new(Device::cpu())).map_err(engine_error), limits)
        } else {
            let mesh = Mesh::parse(&format!("tp{tp}"), tp, tp)?;
            let world = Arc::new(InProcess::new(tp)?);
            let w = Arc::clone(&world);
            let rank_engine = move |rank: usize| {
                let dev = Device::cpu();
                let cx = Cx::new(dev.clone()).with_groups(mesh_groups(&w, &mesh, rank, &dev)?);
                engine(cx).map_err(engine_error)
            };
            Driver::spawn_tensor_parallel(tp, rank_engine, move |rank, why| world.abort(rank, why), limits)
        }
        .with_context(|| if tp > 1 { format!("starting the model on {tp} tensor-parallel ranks") } else { "starting the model".into() })?;
        let name = args.served_model_name.clone().unwrap_or_else(|| {
            let canonical = args.model.canonicalize().unwrap_or_else(|_| args.model.clone());
            canonical.file_name().map_or_else(|| "model".into(), |n| n.to_string_lossy().into_owned())
        });
        let state = Arc::new(ServerState::new(driver, tokenizer, name, args.api_key.clone()));
        let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting the HTTP runtime")?;
        runtime.block_on(listen(&args, Arc::clone(&state)))?;
        drop(runtime);
        // Every connection has ended: the state is ours again.
        let state = Arc::try_unwrap(state).map_err(|_| anyhow::anyhow!("the server still holds the engine after shutting down"))?;
        state.driver.shutdown(false).context("the engine stopped with an error")?;
        eprintln!("tessera serve: stopped");
        Ok(())
    }
}

/// A rank's failure to build its engine, as the driver takes it: a failure
/// that is only another rank's stays one (so the driver reports that rank's
/// own), the rest keeps its whole chain of context.
fn engine_error(e: anyhow::Error) -> tessera::Error {
    let consequence = e.chain().find_map(|cause| {
        let e = cause.downcast_ref::<tessera::Error>().or_else(|| match cause.downcast_ref::<tessera_models::Error>() {
            Some(tessera_models::Error::Tessera(e)) => Some(e),
            _ => None,
        })?;
        match e {
            tessera::Error::PeerFailed { rank, reason } => Some(tessera::Error::PeerFailed { rank: *rank, reason: reason.clone() }),
            _ => None,
        }
    });
    consequence.unwrap_or_else(|| tessera::Error::invalid("tessera serve", format!("{e:#}")))
}

/// Tokens a draft model proposes per step unless `--speculate` says.
const DEFAULT_DRAFT_TOKENS: usize = 4;

/// A draft model, as a use of its loader: what builds it on each rank.
struct LoadDraft {
    blocks: usize,
}

impl UseLoader for LoadDraft {
    type Output = LoadDrafter;

    fn run<M: Module<In = Replicated, Out = SplitHidden> + 'static>(self, loader: Loader<M>) -> anyhow::Result<LoadDrafter> {
        let blocks = self.blocks;
        Ok(Arc::new(move |cx: &Cx| {
            // The draft's own context, on the rank's communicators: its
            // collectives come in the same order on every rank, between
            // the target's.
            let cx = Cx::new(cx.device().clone()).with_groups(cx.groups().clone());
            let model = loader.load(&cx)?;
            Ok(Box::new(DraftModel::new(model, cx, blocks, DEFAULT_BLOCK_SIZE)?) as Box<dyn Drafter>)
        }))
    }
}

async fn listen(args: &Args, state: Arc<ServerState>) -> anyhow::Result<()> {
    let addr = format!("{}:{}", args.host, args.port);
    let listener = tokio::net::TcpListener::bind(&addr).await.with_context(|| format!("cannot listen on {addr}; choose another --host or --port"))?;
    let local = listener.local_addr()?;
    eprintln!("tessera serve: `{}` on http://{local} (OpenAI API under /v1; GET /health)", state.model_name);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let app = router(state);
    let mut stopped = stop_rx.clone();
    let server = axum::serve(listener, app).with_graceful_shutdown(async move {
        let _ = stopped.wait_for(|s| *s).await;
    });
    let server = tokio::spawn(async move { server.await });
    shutdown_signal().await;
    eprintln!("tessera serve: shutting down; waiting up to {} s for the answers in flight", args.shutdown_timeout);
    let _ = stop_tx.send(true);
    drop(stop_rx);
    match tokio::time::timeout(Duration::from_secs(args.shutdown_timeout), server).await {
        Ok(joined) => joined.context("the HTTP server failed")?.context("the HTTP server failed")?,
        Err(_) => eprintln!("tessera serve: answers still running after {} s are cancelled", args.shutdown_timeout),
    }
    Ok(())
}

/// Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}
