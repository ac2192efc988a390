//! A driver over the engines of a tensor-parallel group: clients get the
//! tokens one rank gives, cancellation frees the cache, and a rank that
//! fails, in its build or in a step, or that drifts out of step, stops the
//! group with its own failure as the reason, promptly, never a hang.

mod common;
use common::Flaky;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::mpsc::{self, Receiver};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tessera::dist::inproc::{mesh_groups, InProcess};
use tessera::dist::mesh::Mesh;
use tessera::module::{self, Cx};
use tessera::serve::driver::{Driver, DriverLimits, Event, SubmitError};
use tessera::serve::engine::{Engine, EngineConfig, FinishReason, KvMemory, RequestOutput};
use tessera::serve::sampling::{SamplingParams, StopReason};
use tessera::Device;
use tessera_models::gpt2::{Gpt2, Gpt2Config};

const VOCAB: usize = 64;
const CTX: usize = 128;

fn config() -> EngineConfig {
    EngineConfig { block_size: 4, kv_memory: KvMemory::Blocks(96), max_num_batched_tokens: 64, ..EngineConfig::new(CTX) }
}

fn model(cx: &Cx) -> tessera::Result<Gpt2> {
    // Four heads and 64 ids: tensor parallelism of 2 divides both.
    module::build(Gpt2::new(&Gpt2Config::tiny(VOCAB, 32, 4, 2, CTX)).expect("a valid config"), cx)
}

/// Rank `rank`'s context in a tensor-parallel group of two.
fn rank_cx(world: &InProcess, rank: usize) -> tessera::Result<Cx> {
    let dev = Device::cpu();
    let mesh = Mesh::parse("tp2", 2, 2)?;
    Ok(Cx::new(dev.clone()).with_groups(mesh_groups(world, &mesh, rank, &dev)?))
}

/// A driver over two ranks whose engines `make` builds from their contexts.
fn tp2<M, F>(make: F) -> tessera::Result<Driver>
where
    M: module::Module<In = module::Replicated, Out = module::SplitHidden> + 'static,
    F: Fn(usize, Cx) -> tessera::Result<Engine<M>> + Send + Sync + 'static,
{
    let world = Arc::new(InProcess::with_timeout(2, Duration::from_secs(30))?);
    let w = Arc::clone(&world);
    Driver::spawn_tensor_parallel(2, move |rank| make(rank, rank_cx(&w, rank)?), move |rank, why| world.abort(rank, why), DriverLimits::default())
}

fn plain(_: usize, cx: Cx) -> tessera::Result<Engine<Gpt2>> {
    Engine::new(model(&cx)?, cx, config())
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams { max_tokens, ignore_eos: true, ..SamplingParams::greedy() }
}

fn sampled(max_tokens: usize, seed: Option<u64>) -> SamplingParams {
    SamplingParams { max_tokens, ignore_eos: true, temperature: 0.9, top_p: 0.95, seed, ..SamplingParams::default() }
}

fn prompt(i: usize) -> Vec<u32> {
    (0..3 + i % 9).map(|t| ((i * 7 + t * 3) % VOCAB) as u32).collect()
}

/// Every event of one request until it finishes: (tokens, how it ended).
fn collect(rx: &Receiver<Event>) -> (Vec<u32>, Option<FinishReason>) {
    let mut tokens = Vec::new();
    loop {
        match rx.recv_timeout(Duration::from_secs(60)).expect("the driver went silent") {
            Event::Admitted(_) => {}
            Event::Rejected(e) => panic!("rejected: {e}"),
            Event::Output(RequestOutput { tokens: t, finished, .. }) => {
                tokens.extend(t.iter().map(|t| t.id));
                if finished.is_some() {
                    return (tokens, finished);
                }
            }
        }
    }
}

/// How a request that fails ends: its error message.
fn failure(rx: &Receiver<Event>) -> String {
    match collect(rx).1 {
        Some(FinishReason::Error(m)) => m,
        other => panic!("expected a failure, got {other:?}"),
    }
}

fn submit(driver: &Driver, prompt: Vec<u32>, params: SamplingParams) -> Receiver<Event> {
    let (tx, rx) = mpsc::channel();
    driver.submit(prompt, params, tx).unwrap();
    rx
}

#[test]
fn two_ranks_serve_the_greedy_tokens_of_one_and_agree_on_sampled_ones() {
    let n = 10;
    let one = Cx::new(Device::cpu());
    let want = Engine::new(model(&one).unwrap(), one, config()).unwrap().generate(&(0..n).map(prompt).collect::<Vec<_>>(), &greedy(12)).unwrap();
    let driver = Arc::new(tp2(plain).unwrap());
    // Greedy, seeded and unseeded requests from many threads at once: the
    // ranks compare every step's tokens, so a sampled request that finishes
    // is one both ranks drew alike.
    let clients: Vec<_> = (0..n + 4)
        .map(|i| {
            let driver = Arc::clone(&driver);
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis((i as u64 * 5) % 13));
                let params = match i {
                    i if i < n => greedy(12),
                    i if i % 2 == 0 => sampled(12, Some(i as u64)),
                    _ => sampled(12, None),
                };
                collect(&submit(&driver, prompt(i), params))
            })
        })
        .collect();
    for (i, client) in clients.into_iter().enumerate() {
        let (tokens, end) = client.join().unwrap();
        assert_eq!(end, Some(FinishReason::Stop(StopReason::MaxTokens)), "request {i}");
        match want.get(i) {
            Some(want) => assert_eq!(&tokens, want, "request {i}: two ranks decoded other tokens than one"),
            None => assert_eq!(tokens.len(), 12, "request {i}"),
        }
    }
    assert_eq!(driver.state().stopped, None);
}

#[test]
fn a_cancelled_request_frees_its_blocks_on_the_group() {
    let driver = tp2(plain).unwrap();
    let all = driver.state().kv_blocks;
    let rx = submit(&driver, prompt(3), greedy(100));
    let mut outputs = 0;
    while outputs < 3 {
        if let Event::Output(_) = rx.recv_timeout(Duration::from_secs(60)).unwrap() {
            outputs += 1;
        }
    }
    drop(rx);
    let start = Instant::now();
    while !(driver.pending() == 0 && driver.state().kv_blocks_available == all) {
        assert!(start.elapsed() < Duration::from_secs(60), "the cancelled request kept its blocks: {:?}", driver.state());
        std::thread::sleep(Duration::from_millis(2));
    }
    // The ranks dropped it alike: the next request runs in step.
    assert_eq!(collect(&submit(&driver, prompt(4), greedy(6))).0.len(), 6);
    driver.shutdown(true).unwrap();
}

#[test]
fn a_rank_that_cannot_build_is_the_reason_and_the_others_do_not_wait_for_it() {
    // Rank 0 waits for rank 1 in a collective, which only the abort ends
    // before the world's 30 s timeout.
    let start = Instant::now();
    let e = tp2(|rank, cx| {
        if rank == 1 {
            return Err(tessera::Error::invalid("load", "no shard here"));
        }
        cx.groups().tp.barrier()?;
        plain(rank, cx)
    })
    .err()
    .expect("a failed build is an error");
    let e = e.to_string();
    assert!(e.contains("rank 1") && e.contains("no shard here"), "{e}");
    assert!(start.elapsed() < Duration::from_secs(10), "the build took {:?}", start.elapsed());
    let e = tp2(|rank, cx| if rank == 1 { panic!("bad weights") } else { plain(rank, cx) }).err().unwrap().to_string();
    assert!(e.contains("rank 1") && e.contains("bad weights"), "{e}");
    let e = Driver::spawn_tensor_parallel(0, |_| plain(0, Cx::new(Device::cpu())), |_, _| {}, DriverLimits::default()).err().unwrap().to_string();
    assert!(e.contains("0 ranks"), "{e}");
}

#[test]
fn a_step_that_fails_on_one_rank_stops_the_group_with_that_ranks_reason() {
    for (mode, says) in [(1, "an injected failure"), (2, "an injected panic")] {
        let on_rank_1 = Arc::new(AtomicU8::new(0));
        let m = Arc::clone(&on_rank_1);
        let driver = tp2(move |rank, cx| {
            let mode = if rank == 1 { Arc::clone(&m) } else { Arc::new(AtomicU8::new(0)) };
            Engine::new(Flaky { inner: model(&cx)?, mode }, cx, config())
        })
        .unwrap();
        let rx = submit(&driver, prompt(1), greedy(60));
        while !matches!(rx.recv_timeout(Duration::from_secs(60)).unwrap(), Event::Output(_)) {}
        let start = Instant::now();
        on_rank_1.store(mode, Ordering::Release);
        let m = failure(&rx);
        assert!(m.contains("rank 1") && m.contains(says), "{m}");
        assert!(start.elapsed() < Duration::from_secs(10), "the failure took {:?} to reach the client", start.elapsed());
        let (tx, _rx) = mpsc::channel();
        match driver.submit(prompt(2), greedy(5), tx) {
            Err(SubmitError::Stopped { reason }) => assert!(reason.contains(says), "{reason}"),
            other => panic!("expected a refusal, got {other:?}"),
        }
        let e = driver.shutdown(true).unwrap_err().to_string();
        assert!(e.contains(says), "{e}");
    }
}

#[test]
fn ranks_that_draw_differently_are_caught_in_the_first_step_that_differs() {
    // Rank 1 seeds unseeded requests otherwise: its tokens differ from rank
    // 0's, and the group stops rather than answer with either.
    let driver = tp2(|rank, cx| Engine::new(model(&cx)?, cx, EngineConfig { seed: rank as u64 * 1000, ..config() })).unwrap();
    let rx = submit(&driver, prompt(5), SamplingParams { temperature: 2.0, ..sampled(40, None) });
    let m = failure(&rx);
    assert!(m.contains("rank 1 produced other tokens than rank 0") && m.contains("no longer in step"), "{m}");
}
