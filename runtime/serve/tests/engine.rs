//! The engine against references: the model's own full forward (no cache),
//! the same requests alone, and without preemption or chunking.

use std::collections::HashMap;
use tessera::module::{self, Act, Cx, Module, Replicated, SplitHidden};
use tessera::nn::quantize_linears;
use tessera::ops::QuantFormat;
use tessera::serve::engine::{Engine, EngineConfig, FinishReason, KvMemory, RequestId};
use tessera::serve::sampling::SamplingParams;
use tessera::{Device, Tensor};
use tessera_models::gpt2::{Gpt2, Gpt2Config};
use tessera_models::llama::{Llama, LlamaConfig};
use tessera_models::mixtral::{Mixtral, MixtralConfig};

const VOCAB: usize = 96;
const CTX: usize = 96;

// Each model is built (materialised with seed 0) on the context that runs
// it; two builds hold the same values, which `assert_same_params` checks.
fn gpt2(cx: &Cx) -> Gpt2 {
    module::build(Gpt2::new(&Gpt2Config::tiny(VOCAB, 32, 4, 2, CTX)).unwrap(), cx).unwrap()
}

fn llama(cx: &Cx) -> Llama {
    // Grouped-query attention (4 query heads over 2 kv heads) with RoPE.
    module::build(Llama::new(&LlamaConfig::tiny(VOCAB, 32, 4, 2, 48, 2, CTX)).unwrap(), cx).unwrap()
}

fn mixtral(cx: &Cx) -> Mixtral {
    module::build(Mixtral::new(&MixtralConfig::tiny(VOCAB, 32, 4, 2, 32, 4, 2, 2, CTX)).unwrap(), cx).unwrap()
}

/// An engine over the model `build` makes, on a fresh CPU device.
fn engine<M: Module<In = Replicated, Out = SplitHidden>>(build: fn(&Cx) -> M, cfg: EngineConfig) -> Engine<M> {
    let cx = Cx::new(Device::cpu());
    let model = build(&cx);
    Engine::new(model, cx, cfg).unwrap()
}

/// The reference copy of a model, with its own context.
fn reference<M>(build: fn(&Cx) -> M) -> (M, Cx) {
    let mut cx = Cx::new(Device::cpu());
    cx.set_training(false);
    (build(&cx), cx)
}

/// Random prompts of lengths in `lens`, from a seeded stream.
fn prompts(n: usize, lens: std::ops::Range<usize>, seed: u64) -> Vec<Vec<u32>> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    (0..n)
        .map(|_| {
            let len = lens.start + (next() as usize) % (lens.end - lens.start);
            (0..len).map(|_| (next() % VOCAB as u64) as u32).collect()
        })
        .collect()
}

fn config(blocks: usize, block_size: usize, batched: usize) -> EngineConfig {
    EngineConfig { block_size, kv_memory: KvMemory::Blocks(blocks), max_num_batched_tokens: batched, ..EngineConfig::new(CTX) }
}

/// Runs `prompts` as a batch; returns each request's tokens and logprobs.
fn run<M: Module<In = Replicated, Out = SplitHidden>>(engine: &mut Engine<M>, prompts: &[Vec<u32>], params: &[SamplingParams]) -> Vec<(Vec<u32>, Vec<f32>)> {
    let ids: Vec<RequestId> = prompts.iter().zip(params).map(|(p, sp)| engine.add_request(p.clone(), sp.clone()).unwrap()).collect();
    let mut out: HashMap<RequestId, (Vec<u32>, Vec<f32>)> = HashMap::new();
    while engine.has_unfinished() {
        for o in engine.step().unwrap() {
            let e = out.entry(o.id).or_default();
            e.0.extend(o.tokens.iter().map(|t| t.id));
            e.1.extend(o.tokens.iter().map(|t| t.logprob));
            if let Some(FinishReason::Error(m)) = &o.finished {
                panic!("request {} failed: {m}", o.id);
            }
        }
    }
    ids.iter().map(|i| out.remove(i).unwrap_or_default()).collect()
}

/// Every token the engine chose greedily is the argmax of the full forward
/// (no cache) over the prompt and the tokens before it, up to rounding.
fn check_against_full_forward<M: Module<In = Replicated, Out = SplitHidden>>((model, cx): &mut (M, Cx), prompt: &[u32], generated: &[u32]) {
    let all: Vec<u32> = prompt.iter().chain(generated).copied().collect();
    let ids = Tensor::from_vec(all.clone(), [1, all.len()], cx.device()).unwrap();
    let (logits, _) = model.forward(cx, Act::new(ids)).unwrap();
    let v = logits.tensor().dims()[2];
    let logits = logits.tensor().to_f32_vec().unwrap();
    for (i, &tok) in generated.iter().enumerate() {
        let row = &logits[(prompt.len() - 1 + i) * v..(prompt.len() + i) * v];
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let spread = max - row.iter().copied().fold(f32::INFINITY, f32::min);
        assert!(
            max - row[tok as usize] <= 1e-4 * spread.max(1e-3),
            "token {i} ({tok}) is not the argmax of the full forward: {} below the max",
            max - row[tok as usize]
        );
    }
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams { max_tokens, ..SamplingParams::greedy() }
}

#[test]
fn greedy_decoding_follows_the_full_forward_for_gpt2_llama_and_mixtral() {
    let ps = prompts(6, 1..40, 1);
    let params = vec![greedy(12); ps.len()];
    fn check<M: Module<In = Replicated, Out = SplitHidden>>(build: fn(&Cx) -> M, cfg: EngineConfig, ps: &[Vec<u32>], params: &[SamplingParams]) {
        let mut e = engine(build, cfg);
        let mut r = reference(build);
        assert_same_params(e.model(), &r.0);
        for (p, (toks, _)) in ps.iter().zip(run(&mut e, ps, params)) {
            assert_eq!(toks.len(), 12);
            check_against_full_forward(&mut r, p, &toks);
        }
    }
    check(gpt2, config(64, 16, 64), &ps, &params);
    check(llama, config(64, 4, 48), &ps, &params);
    check(mixtral, config(64, 16, 64), &ps, &params);
}

/// Two builds of one architecture hold the same values.
fn assert_same_params<M: Module>(a: &M, b: &M) {
    let named = |m: &M| {
        let mut v = Vec::new();
        module::visit_params(m, |e| {
            v.push((e.name.to_string(), e.param.value()?.to_f32_vec()?));
            Ok(())
        })
        .unwrap();
        v
    };
    assert!(named(a) == named(b), "two builds of the model differ");
}

#[test]
fn a_request_gets_the_same_tokens_alone_or_among_32_others_with_chunking_and_preemption() {
    let ps = prompts(33, 1..60, 2);
    let mut params: Vec<SamplingParams> = (0..33).map(|i| greedy(4 + i % 13)).collect();
    // Seeded sampling is batch-independent too.
    for (i, p) in params.iter_mut().enumerate().skip(20) {
        *p = SamplingParams { temperature: 0.8, top_p: 0.9, seed: Some(i as u64), max_tokens: 9, ..SamplingParams::default() };
    }
    // Alone: one request at a time, a roomy cache, whole prompts per step.
    let mut alone = Vec::new();
    let mut e = engine(llama, config(256, 8, 512));
    for (p, sp) in ps.iter().zip(&params) {
        alone.push(run(&mut e, std::slice::from_ref(p), std::slice::from_ref(sp)).remove(0));
    }
    // Together: all 33 at once, a cache too small for them (preemption) and a
    // 24-token step budget (chunked prefill).
    let mut e = engine(llama, config(14, 8, 24));
    let together = run(&mut e, &ps, &params);
    assert!(e.stats().preemptions > 0, "the small cache should have forced preemptions: {:?}", e.stats());
    for (i, (a, b)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(a.0, b.0, "request {i}: tokens differ alone and batched");
        assert_eq!(a.1.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), b.1.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), "request {i}: logprobs differ");
    }
    // Every block came back: nothing leaked.
    assert_eq!(e.blocks().free_blocks() + e.blocks().evictable_blocks(), e.blocks().num_blocks());
}

/// A quantized model keeps both properties: its greedy tokens are the
/// argmax of its own full forward, and a request gets the same tokens and
/// logprobs alone (whole prompts in one step, the row counts where the
/// prefill product would take its faster tile) as among 16 others with
/// chunked prefill and preemption. int4 in groups of 32 runs the SIMD loop
/// where the CPU has one, groups of 16 the portable loop.
#[test]
fn a_quantized_model_decodes_its_own_forward_and_the_same_tokens_alone_or_batched() {
    fn wide_llama(cx: &Cx) -> Llama {
        module::build(Llama::new(&LlamaConfig::tiny(VOCAB, 64, 4, 2, 128, 2, CTX)).unwrap(), cx).unwrap()
    }
    let formats = [QuantFormat::Int8, QuantFormat::Int4 { group_size: 32 }, QuantFormat::Int4 { group_size: 16 }, QuantFormat::W8A8];
    let ps = prompts(17, 1..60, 7);
    let params: Vec<SamplingParams> = (0..17).map(|i| greedy(3 + i % 7)).collect();
    for format in formats {
        let quantized = |cfg: EngineConfig| {
            let cx = Cx::new(Device::cpu());
            let model = wide_llama(&cx);
            let report = quantize_linears(&model, &cx, format).unwrap();
            assert!(report.skipped.is_empty() && !report.quantized.is_empty(), "{format}: {report:?}");
            Engine::new(model, cx, cfg).unwrap()
        };
        let mut e = quantized(config(256, 8, 512));
        let alone: Vec<_> = ps.iter().zip(&params).map(|(p, sp)| run(&mut e, std::slice::from_ref(p), std::slice::from_ref(sp)).remove(0)).collect();
        let mut e = quantized(config(12, 8, 24));
        let together = run(&mut e, &ps, &params);
        assert!(e.stats().preemptions > 0, "{format}: the small cache should have forced preemptions");
        for (i, (a, b)) in alone.iter().zip(&together).enumerate() {
            assert_eq!(a.0, b.0, "{format}, request {i}: tokens differ alone and batched");
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&a.1), bits(&b.1), "{format}, request {i}: logprobs differ alone and batched");
        }
        let mut r = reference(wide_llama);
        quantize_linears(&r.0, &r.1, format).unwrap();
        for (p, (toks, _)) in ps.iter().zip(&alone).take(6) {
            check_against_full_forward(&mut r, p, toks);
        }
    }
}

#[test]
fn a_shared_system_prompt_is_computed_once() {
    let system: Vec<u32> = prompts(1, 48..49, 3).remove(0);
    let mut e = engine(gpt2, config(64, 16, 512));
    let first: Vec<u32> = system.iter().chain(&[1, 2, 3]).copied().collect();
    let second: Vec<u32> = system.iter().chain(&[4, 5]).copied().collect();
    let a = run(&mut e, &[first], &[greedy(3)]);
    let computed = e.stats().tokens_computed;
    let b = run(&mut e, std::slice::from_ref(&second), &[greedy(3)]);
    // 48 tokens = 3 full blocks of 16 came from the cache.
    assert_eq!(e.stats().prefix_cached_tokens, 48);
    assert_eq!(e.stats().tokens_computed - computed, (second.len() - 48 + 2) as u64);
    assert_eq!((a[0].0.len(), b[0].0.len()), (3, 3));
    // And the cached prefix gives what computing it gives.
    let mut fresh = engine(gpt2, config(64, 16, 512));
    assert_eq!(run(&mut fresh, &[second], &[greedy(3)])[0], b[0]);
}

#[test]
fn abort_and_bad_requests_leave_the_others_running() {
    let mut e = engine(gpt2, config(64, 16, 64));
    let ps = prompts(3, 5..20, 4);
    let ids: Vec<RequestId> = ps.iter().map(|p| e.add_request(p.clone(), greedy(20)).unwrap()).collect();
    // Bad requests: each an error naming the problem, nothing queued.
    let too_long = e.add_request(vec![1; CTX], greedy(2)).unwrap_err().to_string();
    assert!(too_long.contains("context"), "{too_long}");
    let oov = e.add_request(vec![VOCAB as u32 + 5], greedy(2)).unwrap_err().to_string();
    assert!(oov.contains("vocabulary"), "{oov}");
    let bad = e.add_request(vec![1], SamplingParams { top_p: 0.0, ..greedy(2) }).unwrap_err().to_string();
    assert!(bad.contains("top_p"), "{bad}");
    assert!(e.add_request(vec![], greedy(2)).is_err());
    let huge = engine(gpt2, config(2, 4, 64)).add_request(vec![1; 40], greedy(2)).unwrap_err().to_string();
    assert!(huge.contains("KV cache"), "{huge}");

    let mut counts: HashMap<RequestId, usize> = HashMap::new();
    let mut finish: HashMap<RequestId, FinishReason> = HashMap::new();
    let mut steps = 0;
    while e.has_unfinished() {
        steps += 1;
        if steps == 4 {
            assert!(e.abort(ids[1]));
            assert!(!e.abort(ids[1]), "an aborted request is gone");
        }
        for o in e.step().unwrap() {
            *counts.entry(o.id).or_default() += o.tokens.len();
            if let Some(f) = o.finished {
                assert!(finish.insert(o.id, f).is_none(), "one finish per request");
            }
        }
    }
    assert_eq!(finish[&ids[1]], FinishReason::Aborted);
    assert!(counts[&ids[1]] < 20);
    for i in [0, 2] {
        assert_eq!(counts[&ids[i]], 20);
        assert!(matches!(finish[&ids[i]], FinishReason::Stop(_)));
    }
    assert_eq!(e.blocks().free_blocks() + e.blocks().evictable_blocks(), e.blocks().num_blocks());
}

#[test]
fn a_request_stops_at_the_context_length() {
    let mut e = engine(gpt2, config(64, 16, 512));
    let out = run(&mut e, &[vec![3; CTX - 4]], &[greedy(50)]);
    assert_eq!(out[0].0.len(), 4);
}

#[test]
fn two_tensor_parallel_ranks_decode_the_tokens_of_one() {
    use tessera::dist::inproc::{mesh_groups, InProcess};
    use tessera::dist::mesh::Mesh;
    let ps = prompts(5, 1..30, 6);
    let params = vec![greedy(10); ps.len()];
    let mut one = engine(llama, config(64, 8, 32));
    let want = run(&mut one, &ps, &params);
    let mesh = Mesh::parse("tp2", 2, 2).unwrap();
    let world = InProcess::new(2).unwrap();
    let got: Vec<Vec<(Vec<u32>, Vec<f32>)>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|rank| {
                let (world, mesh, ps, params) = (&world, &mesh, &ps, &params);
                s.spawn(move || {
                    let dev = Device::cpu();
                    let cx = Cx::new(dev.clone()).with_groups(mesh_groups(world, mesh, rank, &dev).unwrap());
                    let model = llama(&cx);
                    let mut e = Engine::new(model, cx, config(64, 8, 32)).unwrap();
                    run(&mut e, ps, params)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, outs) in got.iter().enumerate() {
        for (i, ((t, lp), (wt, wlp))) in outs.iter().zip(&want).enumerate() {
            assert_eq!(t, wt, "rank {rank}, request {i}: tokens differ from one rank's");
            for (a, b) in lp.iter().zip(wlp) {
                assert!((a - b).abs() < 1e-4, "rank {rank}, request {i}: logprob {a} vs {b}");
            }
        }
    }
}

#[test]
fn speculative_greedy_decoding_gives_the_plain_tokens_with_any_drafter() {
    use tessera::serve::engine::{DraftModel, PromptLookup};
    // Prompts that repeat themselves, so prompt lookup finds matches.
    let ps: Vec<Vec<u32>> = prompts(6, 4..12, 7).into_iter().map(|p| p.iter().chain(&p).chain(&p).copied().collect()).collect();
    let mut params = vec![greedy(24); ps.len()];
    // Seeded sampling too: its tokens differ from plain decoding's (another
    // stream decides), but it must run and stay within the vocabulary.
    params[5] = SamplingParams { temperature: 0.7, seed: Some(3), max_tokens: 24, ..SamplingParams::default() };
    let mut plain = engine(llama, config(128, 8, 64));
    let want = run(&mut plain, &ps, &params);

    let mut lookup = engine(llama, config(128, 8, 64)).with_speculation(4, Box::new(PromptLookup::default())).unwrap();
    let got = run(&mut lookup, &ps, &params);
    let s = lookup.stats().clone();
    assert!(s.draft_proposed > 0, "{s:?}");
    for i in 0..5 {
        assert_eq!(got[i], want[i], "request {i}: prompt lookup changed greedy output");
    }
    assert_eq!(got[5].0.len(), 24);

    // The target itself as the draft: everything is accepted, k + 1 tokens per forward.
    let draft_cx = Cx::new(Device::cpu());
    let draft = DraftModel::new(llama(&draft_cx), draft_cx, 128, 8).unwrap();
    let mut same = engine(llama, config(128, 8, 64)).with_speculation(3, Box::new(draft)).unwrap();
    let got = run(&mut same, &ps[..5], &params[..5]);
    assert_eq!(got, want[..5].to_vec(), "a perfect draft changed greedy output");
    let s = same.stats().clone();
    assert_eq!(s.draft_accepted, s.draft_proposed, "{s:?}");
    assert!(s.tokens_per_step() > 2.0, "{s:?}");

    // A draft that disagrees (another model): output unchanged, fewer accepted.
    let other_cx = Cx::new(Device::cpu()).with_seed(99);
    let other = DraftModel::new(gpt2(&other_cx), other_cx, 128, 8).unwrap();
    let mut wrong = engine(llama, config(128, 8, 64)).with_speculation(3, Box::new(other)).unwrap();
    assert_eq!(run(&mut wrong, &ps[..5], &params[..5]), want[..5].to_vec(), "a poor draft changed greedy output");
    assert!(wrong.stats().acceptance_rate() < 0.9, "{:?}", wrong.stats());
    assert_eq!(wrong.blocks().free_blocks() + wrong.blocks().evictable_blocks(), wrong.blocks().num_blocks());

    // A draft of another vocabulary is refused by name.
    let bad_cx = Cx::new(Device::cpu());
    let bad = DraftModel::new(module::build(Gpt2::new(&Gpt2Config::tiny(VOCAB + 4, 32, 4, 1, CTX)).unwrap(), &bad_cx).unwrap(), bad_cx, 16, 8).unwrap();
    let err = engine(llama, config(128, 8, 64)).with_speculation(3, Box::new(bad)).err().unwrap().to_string();
    assert!(err.contains("vocabulary"), "{err}");
}
