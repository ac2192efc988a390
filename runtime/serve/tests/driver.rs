//! The driver against the engine run directly: the same tokens for clients
//! on many threads, cancellation that frees the cache, bounded admission,
//! refusals, and both kinds of shutdown.

mod common;
use common::Flaky;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tessera::module::{self, Cx};
use tessera::serve::driver::{Driver, DriverLimits, Event, Sink, SubmitError};
use tessera::serve::engine::{Engine, EngineConfig, FinishReason, KvMemory, RequestOutput};
use tessera::serve::sampling::SamplingParams;
use tessera::Device;
use tessera_models::gpt2::{Gpt2, Gpt2Config};

const VOCAB: usize = 64;
const CTX: usize = 128;

fn engine() -> tessera::Result<Engine<Gpt2>> {
    let cx = Cx::new(Device::cpu());
    let model = module::build(Gpt2::new(&Gpt2Config::tiny(VOCAB, 32, 4, 2, CTX)).expect("a valid config"), &cx)?;
    let config = EngineConfig { block_size: 4, kv_memory: KvMemory::Blocks(96), max_num_batched_tokens: 64, ..EngineConfig::new(CTX) };
    Engine::new(model, cx, config)
}

/// [`engine`] with a context of 2048 tokens and the KV memory for four
/// requests of it.
fn long_engine() -> tessera::Result<Engine<Gpt2>> {
    const LONG: usize = 2048;
    let cx = Cx::new(Device::cpu());
    let model = module::build(Gpt2::new(&Gpt2Config::tiny(VOCAB, 32, 4, 2, LONG)).expect("a valid config"), &cx)?;
    let config = EngineConfig { block_size: 16, kv_memory: KvMemory::Blocks(4 * LONG / 16), max_num_batched_tokens: 64, ..EngineConfig::new(LONG) };
    Engine::new(model, cx, config)
}

fn driver(max_pending: usize) -> Driver {
    Driver::spawn(engine, DriverLimits { max_pending }).unwrap()
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams { max_tokens, ignore_eos: true, ..SamplingParams::greedy() }
}

fn prompt(i: usize) -> Vec<u32> {
    (0..3 + i % 9).map(|t| ((i * 7 + t * 3) % VOCAB) as u32).collect()
}

/// Every event of one request until it finishes: (admitted?, tokens, how it ended).
fn collect(rx: &Receiver<Event>) -> (bool, Vec<u32>, Option<FinishReason>) {
    let (mut admitted, mut tokens) = (false, Vec::new());
    loop {
        match rx.recv_timeout(Duration::from_secs(60)).expect("the driver went silent") {
            Event::Admitted(_) => admitted = true,
            Event::Rejected(e) => panic!("rejected: {e}"),
            Event::Output(RequestOutput { tokens: t, finished, .. }) => {
                tokens.extend(t.iter().map(|t| t.id));
                if finished.is_some() {
                    return (admitted, tokens, finished);
                }
            }
        }
    }
}

/// Waits (bounded) until `done` holds of the driver's state.
fn wait_for(driver: &Driver, what: &str, done: impl Fn(&tessera::serve::driver::DriverState) -> bool) {
    let start = Instant::now();
    while !done(&driver.state()) {
        assert!(start.elapsed() < Duration::from_secs(60), "timed out waiting for {what}: {:?}", driver.state());
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn clients_on_many_threads_get_the_tokens_of_the_engine_run_directly() {
    let n = 12;
    let want = engine().unwrap().generate(&(0..n).map(prompt).collect::<Vec<_>>(), &greedy(10)).unwrap();
    let driver = Arc::new(driver(64));
    let got: Vec<_> = (0..n)
        .map(|i| {
            let driver = Arc::clone(&driver);
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis((i as u64 * 3) % 11));
                let (tx, rx) = mpsc::channel();
                driver.submit(prompt(i), greedy(10), tx).unwrap();
                collect(&rx)
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| t.join().unwrap())
        .collect();
    for (i, ((admitted, tokens, end), want)) in got.into_iter().zip(want).enumerate() {
        assert!(admitted, "request {i} never heard it was admitted");
        assert_eq!(end, Some(FinishReason::Stop(tessera::serve::sampling::StopReason::MaxTokens)), "request {i}");
        assert_eq!(tokens, want, "request {i}");
    }
    assert_eq!(driver.pending(), 0);
}

/// A sink whose client can leave without a word (the flag), as a closed
/// connection does.
struct Leaving {
    tx: mpsc::Sender<Event>,
    gone: Arc<AtomicBool>,
}

impl Sink for Leaving {
    fn send(&mut self, event: Event) -> bool {
        !self.gone.load(Ordering::Acquire) && self.tx.send(event).is_ok()
    }

    fn is_closed(&self) -> bool {
        self.gone.load(Ordering::Acquire)
    }
}

#[test]
fn a_client_that_leaves_frees_its_sequence_and_its_blocks() {
    let driver = driver(8);
    let all = driver.state().kv_blocks;
    assert!(all > 0 && driver.state().kv_blocks_available == all);
    // Dropping the receiver: found out at the next output.
    let (tx, rx) = mpsc::channel();
    driver.submit(prompt(3), greedy(100), tx).unwrap();
    let mut outputs = 0;
    while outputs < 3 {
        if let Event::Output(_) = rx.recv_timeout(Duration::from_secs(60)).unwrap() {
            outputs += 1;
        }
    }
    wait_for(&driver, "the request to hold blocks", |s| s.kv_blocks_available < all);
    drop(rx);
    wait_for(&driver, "the blocks to come back", |s| driver.pending() == 0 && s.running == 0 && s.waiting == 0 && s.kv_blocks_available == all);
    assert!(driver.state().stats.tokens_generated < 50, "{:?}", driver.state().stats);

    // A sink that says it is closed: cancelled before any output.
    let gone = Arc::new(AtomicBool::new(false));
    let (tx, rx) = mpsc::channel();
    driver.submit(prompt(5), greedy(100), Leaving { tx, gone: Arc::clone(&gone) }).unwrap();
    assert!(matches!(rx.recv_timeout(Duration::from_secs(60)).unwrap(), Event::Admitted(_)));
    gone.store(true, Ordering::Release);
    // (The state lags the engine by a step; `pending` does not.)
    wait_for(&driver, "the second request to leave", |s| driver.pending() == 0 && s.running == 0 && s.waiting == 0 && s.kv_blocks_available == all);
    let generated = driver.state().stats.tokens_generated;
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(driver.state().stats.tokens_generated, generated, "the engine kept decoding for nobody");
}

#[test]
fn a_full_queue_refuses_at_once_and_takes_requests_again_when_it_drains() {
    let driver = driver(2);
    let (tx1, rx1) = mpsc::channel();
    let (tx2, rx2) = mpsc::channel();
    driver.submit(prompt(1), greedy(40), tx1).unwrap();
    driver.submit(prompt(2), greedy(40), tx2).unwrap();
    let (tx3, _rx3) = mpsc::channel();
    assert_eq!(driver.submit(prompt(3), greedy(4), tx3), Err(SubmitError::QueueFull { limit: 2 }));
    assert_eq!(collect(&rx1).1.len(), 40);
    assert_eq!(collect(&rx2).1.len(), 40);
    wait_for(&driver, "the queue to drain", |_| driver.pending() == 0);
    let (tx4, rx4) = mpsc::channel();
    driver.submit(prompt(4), greedy(4), tx4).unwrap();
    assert_eq!(collect(&rx4).1.len(), 4);
    let e = SubmitError::QueueFull { limit: 2 }.to_string();
    assert!(e.contains("2 requests") && e.contains("retry"), "{e}");
}

#[test]
fn a_bad_request_is_rejected_with_its_reason_and_the_others_run_on() {
    let driver = driver(8);
    let (good_tx, good) = mpsc::channel();
    driver.submit(prompt(1), greedy(20), good_tx).unwrap();
    for (bad, says) in [(vec![1; CTX], "shorten the prompt"), (vec![], "the prompt is empty"), (vec![VOCAB as u32], "outside the model's vocabulary")] {
        let (tx, rx) = mpsc::channel();
        driver.submit(bad, greedy(4), tx).unwrap();
        match rx.recv_timeout(Duration::from_secs(60)).unwrap() {
            Event::Rejected(e) => assert!(e.to_string().contains(says), "{e}"),
            other => panic!("expected a rejection, got {other:?}"),
        }
        assert!(rx.recv_timeout(Duration::from_millis(20)).is_err(), "nothing follows a rejection");
    }
    let (tx, rx) = mpsc::channel();
    driver.submit(prompt(2), SamplingParams { temperature: -1.0, ..greedy(4) }, tx).unwrap();
    assert!(matches!(rx.recv_timeout(Duration::from_secs(60)).unwrap(), Event::Rejected(_)));
    assert_eq!(collect(&good).1.len(), 20);
    wait_for(&driver, "every request to be settled", |_| driver.pending() == 0);
}

#[test]
fn shutdown_drains_or_cancels_and_a_failed_build_is_the_error() {
    // Draining: every request runs to its end.
    let d = driver(8);
    let rxs: Vec<_> = (0..4)
        .map(|i| {
            let (tx, rx) = mpsc::channel();
            d.submit(prompt(i), greedy(30), tx).unwrap();
            rx
        })
        .collect();
    d.shutdown(true).unwrap();
    for rx in &rxs {
        let (_, tokens, end) = collect(rx);
        assert_eq!((tokens.len(), end), (30, Some(FinishReason::Stop(tessera::serve::sampling::StopReason::MaxTokens))));
    }
    // Cancelling: every request ends, aborted, long before its 2000 tokens.
    // The context is long enough that none can reach its end first: the
    // shutdown comes as soon as each has produced a token (an optimised
    // build runs a request of this tiny model to a short context's end in
    // a few milliseconds).
    let d = Driver::spawn(long_engine, DriverLimits { max_pending: 8 }).unwrap();
    let rxs: Vec<_> = (0..4)
        .map(|i| {
            let (tx, rx) = mpsc::channel();
            d.submit(prompt(i), SamplingParams { max_tokens: 2000, ignore_eos: true, ..SamplingParams::greedy() }, tx).unwrap();
            rx
        })
        .collect();
    let mut lasts = Vec::new();
    for rx in &rxs {
        let first = loop {
            match rx.recv_timeout(Duration::from_secs(60)).expect("the driver went silent") {
                Event::Output(o) => break o.finished,
                Event::Rejected(e) => panic!("rejected: {e}"),
                Event::Admitted(_) => {}
            }
        };
        lasts.push(first);
    }
    d.shutdown(false).unwrap();
    for (rx, mut last) in rxs.iter().zip(lasts) {
        for event in rx.iter() {
            if let Event::Output(o) = event {
                last = o.finished;
            }
        }
        assert_eq!(last, Some(FinishReason::Aborted));
    }
    // Dropping the handle cancels too, and returns.
    let d = Driver::spawn(long_engine, DriverLimits { max_pending: 8 }).unwrap();
    let (tx, rx) = mpsc::channel();
    d.submit(prompt(1), greedy(2000), tx).unwrap();
    drop(d);
    assert!(rx.iter().any(|e| matches!(e, Event::Output(RequestOutput { finished: Some(FinishReason::Aborted), .. }))));

    let e =
        Driver::spawn(|| -> tessera::Result<Engine<Gpt2>> { Err(tessera::Error::invalid("load", "no model here")) }, DriverLimits::default()).err().unwrap();
    assert!(e.to_string().contains("no model here"), "{e}");
    let e = Driver::spawn(|| -> tessera::Result<Engine<Gpt2>> { panic!("bad weights") }, DriverLimits::default()).err().unwrap();
    assert!(e.to_string().contains("building the engine panicked: bad weights"), "{e}");
    let e = Driver::spawn(engine, DriverLimits { max_pending: 0 }).err().unwrap();
    assert!(e.to_string().contains("max_pending is 0"), "{e}");
}

#[test]
fn a_failed_step_fails_its_requests_and_a_panic_stops_the_driver_with_its_message() {
    let mode = Arc::new(std::sync::atomic::AtomicU8::new(0));
    let m = Arc::clone(&mode);
    let driver = Driver::spawn(
        move || {
            let cx = Cx::new(Device::cpu());
            let inner = module::build(Gpt2::new(&Gpt2Config::tiny(VOCAB, 32, 4, 2, CTX)).expect("a valid config"), &cx)?;
            let config = EngineConfig { block_size: 4, kv_memory: KvMemory::Blocks(96), ..EngineConfig::new(CTX) };
            Engine::new(Flaky { inner, mode: m }, cx, config)
        },
        DriverLimits::default(),
    )
    .unwrap();
    let all = driver.state().kv_blocks;
    // A failing step: the request it held ends with the failure, its blocks
    // come back, and the next request runs.
    let (tx, rx) = mpsc::channel();
    driver.submit(prompt(1), greedy(60), tx).unwrap();
    while !matches!(rx.recv_timeout(Duration::from_secs(60)).unwrap(), Event::Output(_)) {}
    mode.store(1, Ordering::Release);
    let end = rx.iter().find_map(|e| match e {
        Event::Output(RequestOutput { finished: Some(f), .. }) => Some(f),
        _ => None,
    });
    match end {
        Some(FinishReason::Error(m)) => assert!(m.contains("the step failed") && m.contains("an injected failure"), "{m}"),
        other => panic!("expected the step's failure, got {other:?}"),
    }
    wait_for(&driver, "the failed request's blocks", |s| driver.pending() == 0 && s.running == 0 && s.kv_blocks_available == all);
    let (tx, rx) = mpsc::channel();
    driver.submit(prompt(2), greedy(5), tx).unwrap();
    assert_eq!(collect(&rx).1.len(), 5);

    // A panicking step: its request is told the panic, the driver stops,
    // and every later submit and the shutdown say why.
    let (tx, rx) = mpsc::channel();
    mode.store(2, Ordering::Release);
    driver.submit(prompt(3), greedy(5), tx).unwrap();
    let end = rx.iter().find_map(|e| match e {
        Event::Output(RequestOutput { finished: Some(f), .. }) => Some(f),
        _ => None,
    });
    match end {
        Some(FinishReason::Error(m)) => assert!(m.contains("the engine panicked: an injected panic"), "{m}"),
        other => panic!("expected the panic, got {other:?}"),
    }
    wait_for(&driver, "the driver to stop", |s| s.stopped.is_some());
    let (tx, _rx) = mpsc::channel();
    match driver.submit(prompt(4), greedy(5), tx) {
        Err(SubmitError::Stopped { reason }) => assert!(reason.contains("an injected panic"), "{reason}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    let e = driver.shutdown(true).unwrap_err().to_string();
    assert!(e.contains("an injected panic"), "{e}");
}
