//! A vocabulary the tensor-parallel degree does not divide (GPT-2's 50 257)
//! is padded to 50 304 when the model is built for the rank: the padded
//! logits are −∞, training at tp=2 and tp=4 follows the unpadded single-rank
//! run, and a Hugging Face checkpoint loads into the padded model and
//! exports back without the padding.

mod common;
use common::*;
use std::collections::BTreeMap;
use tessera::module::{self, Act, Cx, Module};
use tessera::prelude::*;
use tessera::train::{Batches, ModelFacts, Replica, TrainConfig, Trainer};
use tessera_models::gpt2::{Gpt2, Gpt2Config};
use tessera_models::hf::{self, HfModel};
use tessera_models::vocab::padded_vocab;

const VOCAB: usize = 50257;
const SEQ: usize = 8;

fn config() -> Gpt2Config {
    Gpt2Config::tiny(VOCAB, 16, 4, 1, SEQ)
}

#[test]
fn padded_logits_are_minus_infinity_and_the_real_ones_unchanged() {
    let cx = &mut Cx::new(Device::cpu());
    let plain = module::build(Gpt2::new(&config()).unwrap(), cx).unwrap();
    let padded = module::build(Gpt2::new(&config()).unwrap().with_vocab_padded_to(50304).unwrap(), cx).unwrap();
    assert_eq!(padded.padded_vocab(), 50304);
    let ids = Tensor::from_vec(vec![1u32, 50256, 7, 0], [1, 4], cx.device()).unwrap();
    let a = plain.forward(cx, Act::new(ids.clone())).unwrap().0.into_tensor().to_vec::<f32>().unwrap();
    let b = padded.forward(cx, Act::new(ids)).unwrap().0.into_tensor().to_vec::<f32>().unwrap();
    for (row_a, row_b) in a.chunks(VOCAB).zip(b.chunks(50304)) {
        // The same values: a parameter's initial values depend on their global position only.
        assert_eq!(row_a, &row_b[..VOCAB]);
        assert!(row_b[VOCAB..].iter().all(|&x| x == f32::NEG_INFINITY), "padded logits must never win");
    }
}

/// Random token pairs below 1000, the same for every layout.
struct Tokens {
    replica: Replica,
    drawn: u64,
}

impl Batches for Tokens {
    fn next_batch(&mut self, device: &Device) -> tessera::Result<(Tensor, Tensor)> {
        let row = (self.drawn * self.replica.count as u64 + self.replica.index as u64) * 2;
        let mut ids = Vec::new();
        for r in row..row + 2 {
            ids.extend((0..=SEQ as u64).map(|i| ((r * 7919 + i * 104_729) % 1000) as u32 * 50 % VOCAB as u32));
        }
        self.drawn += 1;
        let rows: Vec<&[u32]> = ids.chunks(SEQ + 1).collect();
        let x: Vec<u32> = rows.iter().flat_map(|r| r[..SEQ].to_vec()).collect();
        let y: Vec<u32> = rows.iter().flat_map(|r| r[1..].to_vec()).collect();
        Ok((Tensor::from_vec(x, [2, SEQ], device)?, Tensor::from_vec(y, [2, SEQ], device)?))
    }
    fn cursor(&self) -> serde_json::Value {
        serde_json::json!(self.drawn)
    }
    fn restore(&mut self, cursor: &serde_json::Value) -> tessera::Result<()> {
        self.drawn = cursor.as_u64().unwrap_or(0);
        Ok(())
    }
}

/// The losses of 4 steps at tensor-parallel degree `tp`.
fn losses(tp: usize) -> Vec<f64> {
    let out = TempDir::new(&format!("vocab-tp{tp}"));
    let text = format!("[mesh]\ntp = {tp}\n[batch]\nmicro_batch = 2\ngrad_accum = 1\nseq_len = {SEQ}\n[checkpoint]\nevery = 0\n");
    let run_out = format!("run.out={:?}", out.path().join("run").display().to_string());
    let cfg = TrainConfig::parse(&text, &[&run_out, "run.steps=4", "run.progress=false", "run.trace_steps=0", "optim.lr=1e-2", "optim.warmup=1"]).unwrap();
    let facts = ModelFacts { vocab: padded_vocab(VOCAB, tp), flops_per_token: 1e5 };
    let summary = Trainer::new(
        cfg,
        facts,
        |cx: &Cx, _, _| Gpt2::from_config(&config(), cx).map_err(|e| tessera::Error::invalid("model", e.to_string())),
        |replica| Ok(Box::new(Tokens { replica, drawn: 0 }) as Box<dyn Batches>),
    )
    .unwrap()
    .run()
    .unwrap();
    summary.losses.iter().map(|&(_, l)| l).collect()
}

#[test]
fn gpt2s_vocabulary_trains_at_tp2_and_tp4_as_on_one_rank() {
    let one = losses(1);
    assert!(one[3] < one[0], "the run learns: {one:?}");
    for tp in [2, 4] {
        let split = losses(tp);
        for (step, (a, b)) in one.iter().zip(&split).enumerate() {
            // Reduction order differs by ~1e-7; padding logits that took any
            // probability would move the loss by ~1e-4.
            assert!((a - b).abs() <= 1e-6 * a.abs(), "tp{tp}, step {}: {b} where one rank gives {a}", step + 1);
        }
    }
}

#[test]
fn a_checkpoint_loads_into_a_padded_model_and_exports_without_the_padding() {
    // A Hugging Face checkpoint of GPT-2's vocabulary, written from one rank.
    let src = TempDir::new("vocab-src");
    let cx = &mut Cx::new(Device::cpu());
    let model = module::build(Gpt2::new(&config()).unwrap(), cx).unwrap();
    hf::save_pretrained(&model, &config(), src.path()).unwrap();
    let original = read_tensors(&src.path().join("model.safetensors"));

    // Loaded into a model padded as a tp=2 rank's is (whole here, to export it).
    let padded = module::build(Gpt2::new(&config()).unwrap().with_vocab_padded_to(padded_vocab(VOCAB, 2)).unwrap(), cx).unwrap();
    hf::load_weights(&padded, &config(), src.path()).unwrap();
    let params = module::distinct_params(&padded).unwrap();
    let table = params.iter().find(|p| p.name() == "wte.weight").unwrap().param.value().unwrap();
    assert_eq!(table.dims(), &[50304, 16]);
    assert!(table.narrow(0, VOCAB, 50304 - VOCAB).unwrap().to_vec::<f32>().unwrap().iter().all(|&x| x == 0.0), "padding rows are zero");

    let out = TempDir::new("vocab-out");
    hf::save_pretrained(&padded, &config(), out.path()).unwrap();
    let exported = read_tensors(&out.path().join("model.safetensors"));
    let names = |t: &BTreeMap<String, _>| t.keys().cloned().collect::<Vec<_>>();
    assert_eq!(names(&exported), names(&original));
    assert!(exported == original, "the export equals the checkpoint it was loaded from");
}
