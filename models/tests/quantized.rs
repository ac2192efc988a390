//! A small GPT-2 and a small Llama quantized for inference with
//! `quantize_linears`: their logits stay within a stated fraction of the
//! f32 model's, and the greedy next token is the same at most positions.
//!
//! The per-layer bounds are proven by the kernels' tests; through a whole
//! network the errors of the layers compound, so the bounds here are the
//! measured ones with a margin (docs/serving.md lists the measurements).

use tessera::module::{self, Act, Cx, Module, Replicated, SplitHidden};
use tessera::nn::quantize_linears;
use tessera::ops::QuantFormat;
use tessera::{Device, Tensor};
use tessera_models::gpt2::{Gpt2, Gpt2Config};
use tessera_models::llama::{Llama, LlamaConfig};

const VOCAB: usize = 96;
const SEQ: usize = 24;

/// Token ids, the same in every test: `[2, SEQ]` (48 rows of activations
/// per product: the prefill path, which multiplies a dequantized tile),
/// `[1, 5]` (5 rows: products from the codes, a few rows at a time) and
/// `[1, 1]` (one row: the decode loop proper).
fn inputs(dev: &Device) -> [Tensor; 3] {
    let ids = |batch: usize, len: usize| {
        let v: Vec<u32> = (0..(batch * len) as u32).map(|i| (i * 37 + 11) % VOCAB as u32).collect();
        Tensor::from_vec(v, [batch, len], dev).unwrap()
    };
    [ids(2, SEQ), ids(1, 5), ids(1, 1)]
}

/// What quantizing changed: the largest logit difference as a fraction of
/// the largest f32 logit, and the share of positions whose greedy token
/// (argmax) is unchanged.
struct Drift {
    max_rel: f64,
    same_argmax: f64,
}

fn drift<M: Module<In = Replicated, Out = SplitHidden>>(make: impl Fn() -> M, format: QuantFormat) -> (Drift, tessera::nn::QuantizeReport) {
    let cx = &mut Cx::new(Device::cpu()).with_seed(11);
    cx.set_training(false);
    let model = module::build(make(), cx).unwrap();
    let logits = |cx: &mut Cx| -> Vec<f32> {
        inputs(cx.device()).into_iter().flat_map(|ids| model.forward(cx, Act::new(ids)).unwrap().0.into_tensor().to_vec::<f32>().unwrap()).collect()
    };
    let before = logits(cx);
    let report = quantize_linears(&model, cx, format).unwrap();
    let after = logits(cx);
    let scale = before.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
    let max_diff = before.iter().zip(&after).fold(0f64, |m, (a, b)| m.max((a - b).abs() as f64));
    let argmax = |row: &[f32]| row.iter().enumerate().fold(0, |best, (i, v)| if *v > row[best] { i } else { best });
    let rows = before.len() / VOCAB;
    let same = before.chunks(VOCAB).zip(after.chunks(VOCAB)).filter(|(a, b)| argmax(a) == argmax(b)).count();
    (Drift { max_rel: max_diff / scale, same_argmax: same as f64 / rows as f64 }, report)
}

fn gpt2() -> Gpt2 {
    Gpt2::new(&Gpt2Config::tiny(VOCAB, 64, 4, 2, SEQ)).unwrap()
}

fn llama() -> Llama {
    Llama::new(&LlamaConfig::tiny(VOCAB, 64, 4, 2, 128, 2, SEQ)).unwrap()
}

/// (format, largest logit drift allowed as a fraction of the largest
/// logit, share of positions whose greedy token must not change).
const BOUNDS: [(QuantFormat, f64, f64); 3] =
    [(QuantFormat::Int8, 0.02, 0.9), (QuantFormat::W8A8, 0.04, 0.9), (QuantFormat::Int4 { group_size: 32 }, 0.25, 0.6)];

#[test]
fn a_quantized_gpt2_stays_near_the_f32_model() {
    for (format, max_rel, agree) in BOUNDS {
        let (d, report) = drift(gpt2, format);
        eprintln!("gpt2 {format}: max logit drift {:.4} of the largest logit, greedy token unchanged at {:.3} of positions", d.max_rel, d.same_argmax);
        // Two blocks of four linear layers each; the head is tied to the
        // token embedding, so it is skipped and stays f32.
        assert_eq!(report.quantized.len(), 8, "{report:?}");
        assert!(report.skipped.iter().any(|(name, why)| name.contains("wte") && why.contains("lm_head")), "{report:?}");
        assert!(d.max_rel <= max_rel, "gpt2 {format}: logits drift by {} of the largest, more than {max_rel}", d.max_rel);
        assert!(d.same_argmax >= agree, "gpt2 {format}: the greedy token changed at {} of positions", 1.0 - d.same_argmax);
    }
}

#[test]
fn a_quantized_llama_stays_near_the_f32_model() {
    for (format, max_rel, agree) in BOUNDS {
        let (d, report) = drift(llama, format);
        eprintln!("llama {format}: max logit drift {:.4} of the largest logit, greedy token unchanged at {:.3} of positions", d.max_rel, d.same_argmax);
        // Two blocks of five linear layers (packed qkv, o, gate, up, down) and the untied head.
        assert_eq!(report.quantized.len(), 11, "{report:?}");
        assert!(report.quantized.iter().any(|n| n == "lm_head.weight"), "{report:?}");
        assert!(report.bytes_after * 3 < report.bytes_before, "{report:?}");
        assert!(d.max_rel <= max_rel, "llama {format}: logits drift by {} of the largest, more than {max_rel}", d.max_rel);
        assert!(d.same_argmax >= agree, "llama {format}: the greedy token changed at {} of positions", 1.0 - d.same_argmax);
    }
}
