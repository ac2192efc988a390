//! Hugging Face `config.json` reading and writing, over generated configs:
//! what is written reads back equal, null reads as absent, the defaults
//! that depend on other fields apply, fields the model does not use survive,
//! and a field of the wrong type is named in the error.

mod common;
use common::*;
use serde_json::{json, Map, Value};
use std::fmt::Debug;
use tessera::testing::fuzz::Rng;
use tessera_models::gpt2::Gpt2Config;
use tessera_models::hf::HfConfig;
use tessera_models::llama::LlamaConfig;
use tessera_models::mixtral::MixtralConfig;
use tessera_models::{Error, Result};

/// Generated configs per family and test.
const CASES: usize = 300;

/// A uniform pick from `items`.
fn pick<T: Clone>(r: &mut Rng, items: &[T]) -> T {
    items[r.below(items.len())].clone()
}

/// A positive number of varied size and form (integral or not).
fn real(r: &mut Rng) -> f64 {
    pick(r, &[1e-6, 1e-5, 3.25e-7, 0.5, 2.0, 10_000.0, 500_000.0, 1e6])
}

/// Fields a model does not use, as Hugging Face writes them: nulls, nested
/// objects, arrays; the class fields sometimes absent (a config built in code
/// has them, a hand-written file may not).
fn extra(r: &mut Rng, model_type: &str, architecture: &str) -> Map<String, Value> {
    let mut m = Map::new();
    if r.below(4) != 0 {
        m.insert("model_type".into(), json!(model_type));
        m.insert("architectures".into(), json!([architecture]));
    }
    let unused = [
        ("pad_token_id", json!(null)),
        ("bos_token_id", json!(0)),
        ("eos_token_id", json!([1, 2])),
        ("dtype", json!("bfloat16")),
        ("initializer_range", json!(0.02)),
        ("use_cache", json!(true)),
        ("quantization_config", json!({"bits": 4, "group": null})),
        ("transformers_version", json!("5.24.0")),
    ];
    for (k, v) in unused {
        if r.below(2) == 0 {
            m.insert(k.into(), v);
        }
    }
    m
}

/// `key` set to one of `values` in `m` half of the time (a switch a model
/// checks, at a value it accepts).
fn maybe(r: &mut Rng, m: &mut Map<String, Value>, key: &str, values: &[Value]) {
    if r.below(2) == 0 {
        m.insert(key.into(), pick(r, values));
    }
}

fn gpt2(r: &mut Rng) -> Gpt2Config {
    let heads = 1 + r.below(8);
    let mut extra = extra(r, "gpt2", "GPT2LMHeadModel");
    maybe(r, &mut extra, "scale_attn_weights", &[json!(true), json!(null)]);
    maybe(r, &mut extra, "scale_attn_by_inverse_layer_idx", &[json!(false), json!(null)]);
    maybe(r, &mut extra, "add_cross_attention", &[json!(false)]);
    Gpt2Config {
        vocab_size: 1 + r.below(60_000),
        n_positions: 1 + r.below(8192),
        n_embd: heads * (1 + r.below(128)),
        n_layer: 1 + r.below(48),
        n_head: heads,
        n_inner: if r.below(2) == 0 { None } else { Some(1 + r.below(16_384)) },
        activation_function: pick(r, &["gelu_new", "gelu_pytorch_tanh", "gelu_fast"]).into(),
        layer_norm_epsilon: real(r),
        tie_word_embeddings: r.below(2) == 0,
        extra,
    }
}

/// The attention and RoPE fields Llama and Mixtral share: `(hidden_size,
/// heads, kv_heads, head_dim, rope_theta)`, and the switches they accept
/// added to `extra`. Where a file nests the RoPE base in `rope_parameters`,
/// it is the config's own (as every config read from a file has it).
fn attention(r: &mut Rng, extra: &mut Map<String, Value>) -> (usize, usize, usize, usize, f64) {
    let kv_heads = 1 + r.below(4);
    let heads = kv_heads * (1 + r.below(4));
    let head_dim = 2 * (1 + r.below(64));
    let hidden = if r.below(2) == 0 { heads * head_dim } else { 8 * (1 + r.below(512)) };
    let rope_theta = pick(r, &[10_000.0, 500_000.0, 1e6, 12_345.5]);
    if r.below(2) == 0 {
        extra.insert("rope_parameters".into(), json!({"rope_theta": rope_theta, "rope_type": pick(r, &[json!("default"), json!(null)])}));
    }
    maybe(r, extra, "rope_scaling", &[json!(null), json!({"rope_type": "default"}), json!({"type": "default"})]);
    maybe(r, extra, "attention_dropout", &[json!(0.0), json!(0), json!(null)]);
    (hidden, heads, kv_heads, head_dim, rope_theta)
}

fn llama(r: &mut Rng) -> LlamaConfig {
    let mut extra = extra(r, "llama", "LlamaForCausalLM");
    maybe(r, &mut extra, "attention_bias", &[json!(false), json!(null)]);
    maybe(r, &mut extra, "mlp_bias", &[json!(false)]);
    let (hidden, heads, kv_heads, head_dim, rope_theta) = attention(r, &mut extra);
    LlamaConfig {
        vocab_size: 1 + r.below(130_000),
        hidden_size: hidden,
        intermediate_size: 1 + r.below(30_000),
        num_hidden_layers: 1 + r.below(80),
        num_attention_heads: heads,
        num_key_value_heads: kv_heads,
        head_dim,
        hidden_act: "silu".into(),
        max_position_embeddings: 1 + r.below(131_072),
        rms_norm_eps: real(r),
        rope_theta,
        tie_word_embeddings: r.below(2) == 0,
        extra,
    }
}

fn mixtral(r: &mut Rng) -> MixtralConfig {
    let mut extra = extra(r, "mixtral", "MixtralForCausalLM");
    maybe(r, &mut extra, "router_jitter_noise", &[json!(0.0), json!(null)]);
    maybe(r, &mut extra, "router_aux_loss_coef", &[json!(0.001)]);
    let (hidden, heads, kv_heads, head_dim, rope_theta) = attention(r, &mut extra);
    let max_pos = 1 + r.below(131_072);
    maybe(r, &mut extra, "sliding_window", &[json!(null), json!(max_pos), json!(max_pos + 1)]);
    let experts = 1 + r.below(16);
    MixtralConfig {
        vocab_size: 1 + r.below(130_000),
        hidden_size: hidden,
        intermediate_size: 1 + r.below(30_000),
        num_hidden_layers: 1 + r.below(80),
        num_attention_heads: heads,
        num_key_value_heads: kv_heads,
        head_dim,
        hidden_act: "silu".into(),
        max_position_embeddings: max_pos,
        rms_norm_eps: real(r),
        rope_theta,
        tie_word_embeddings: r.below(2) == 0,
        num_local_experts: experts,
        num_experts_per_tok: 1 + r.below(experts),
        extra,
    }
}

/// Every generated config is valid, and writing then reading it (through
/// `to_json`/`from_json` and through serde) gives it back.
fn writes_and_reads_back<C: HfConfig + PartialEq + Debug + serde::Serialize + serde::de::DeserializeOwned>(seed: u64, generate: fn(&mut Rng) -> C) {
    let mut r = Rng::new(seed);
    for _ in 0..CASES {
        let config = generate(&mut r);
        config.validate().unwrap_or_else(|e| panic!("generated an invalid config ({e}): {config:?}"));
        let json = config.to_json();
        assert_eq!(C::from_json(&json).unwrap(), config, "{json}");
        let text = serde_json::to_string_pretty(&config).unwrap();
        assert_eq!(serde_json::from_str::<C>(&text).unwrap(), config, "{text}");
    }
}

#[test]
fn generated_configs_round_trip() {
    writes_and_reads_back(1, gpt2);
    writes_and_reads_back(2, llama);
    writes_and_reads_back(3, mixtral);
}

/// A written config with some of its fields set to null or left out (as
/// Hugging Face writes and as hand-written files have them): null reads as
/// absent, and whatever reads writes back to a file that reads the same.
fn nulls_read_as_absent<C: HfConfig + PartialEq + Debug>(seed: u64, generate: fn(&mut Rng) -> C) {
    let mut r = Rng::new(seed);
    for _ in 0..CASES {
        let Value::Object(mut file) = generate(&mut r).to_json() else { panic!("a config is written as an object") };
        for field in C::FIELDS {
            match r.below(4) {
                0 => {
                    file.insert(field.to_string(), Value::Null);
                }
                1 => {
                    file.remove(*field);
                }
                _ => {}
            }
        }
        let field = pick(&mut r, C::FIELDS);
        let mut null = file.clone();
        null.insert(field.into(), Value::Null);
        let mut absent = file;
        absent.remove(field);
        let (null, absent) = (Value::Object(null), Value::Object(absent));
        match (C::from_json(&null), C::from_json(&absent)) {
            (Ok(a), Ok(b)) => {
                assert_eq!(a, b, "`{field}`: null and absent read differently from {null}");
                let again = C::from_json(&a.to_json()).unwrap();
                assert_eq!(again, a, "{null}");
                assert_eq!(again.to_json(), a.to_json());
            }
            (Err(a), Err(b)) => assert_eq!(field_of(&a), field_of(&b), "`{field}`: null and absent fail differently from {null}: {a} / {b}"),
            (a, b) => panic!("`{field}`: null and absent read differently from {null}: {a:?} / {b:?}"),
        }
    }
}

#[test]
fn null_reads_as_absent() {
    nulls_read_as_absent(4, gpt2);
    nulls_read_as_absent(5, llama);
    nulls_read_as_absent(6, mixtral);
}

/// The config field an error names.
fn field_of(e: &Error) -> &str {
    match e {
        Error::Config { field, .. } => field,
        other => panic!("expected a config error, got {other:?}"),
    }
}

/// Every field absent (or every field null) reads as Hugging Face's
/// defaults, with those that depend on other fields resolved.
#[test]
fn absent_fields_take_hugging_faces_defaults() {
    fn all_null<C: HfConfig>() -> Value {
        Value::Object(C::FIELDS.iter().map(|f| (f.to_string(), Value::Null)).collect())
    }
    fn both<C: HfConfig>() -> [Result<C>; 2] {
        [C::from_json(&json!({})), C::from_json(&all_null::<C>())]
    }
    for read in both::<Gpt2Config>() {
        assert_eq!(read.unwrap(), Gpt2Config { extra: Map::new(), ..Gpt2Config::default() });
    }
    for read in both::<LlamaConfig>() {
        assert_eq!(read.unwrap(), LlamaConfig { extra: Map::new(), ..LlamaConfig::default() });
    }
    for read in both::<MixtralConfig>() {
        assert_eq!(read.unwrap(), MixtralConfig { extra: Map::new(), ..MixtralConfig::default() });
    }
}

/// Llama's key/value heads default to one per query head, Mixtral's to 8;
/// `head_dim` defaults to the width split over the heads, and without it
/// the heads must divide the width.
#[test]
fn dependent_defaults() {
    let file = json!({"hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": null, "head_dim": null});
    let llama = LlamaConfig::from_json(&file).unwrap();
    assert_eq!((llama.num_key_value_heads, llama.head_dim), (6, 8));
    assert!(llama.extra.is_empty(), "{:?}", llama.extra);
    let file = json!({"hidden_size": 64, "num_attention_heads": 16});
    let mixtral = MixtralConfig::from_json(&file).unwrap();
    assert_eq!((mixtral.num_key_value_heads, mixtral.head_dim), (8, 4));

    let given = LlamaConfig::from_json(&json!({"hidden_size": 50, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16})).unwrap();
    assert_eq!((given.num_key_value_heads, given.head_dim), (2, 16));
    let e = LlamaConfig::from_json(&json!({"hidden_size": 50, "num_attention_heads": 4})).unwrap_err();
    assert_eq!(field_of(&e), "num_attention_heads");
    assert!(e.to_string().contains("give `head_dim`"), "{e}");
}

/// Newer files nest the RoPE base in `rope_parameters`: it wins over a
/// `rope_theta` beside it (which is not read, whatever it holds), and is
/// written back where it was.
#[test]
fn the_rope_base_is_read_and_written_where_the_file_has_it() {
    let nested = json!({"rope_parameters": {"rope_theta": 2e5, "rope_type": "default"}, "rope_theta": "not read"});
    let llama = LlamaConfig::from_json(&nested).unwrap();
    assert_eq!(llama.rope_theta, 2e5);
    let json = LlamaConfig { rope_theta: 3e5, ..llama }.to_json();
    assert_eq!(json["rope_parameters"], json!({"rope_theta": 3e5, "rope_type": "default"}));
    assert!(json.get("rope_theta").is_none(), "{json}");

    let flat = MixtralConfig::from_json(&json!({"rope_theta": 2e5, "rope_parameters": {"rope_theta": null}})).unwrap();
    assert_eq!(flat.rope_theta, 2e5);
    let mixtral = MixtralConfig::from_json(&json!({"rope_theta": 2e5, "rope_parameters": null})).unwrap();
    assert_eq!(mixtral.to_json()["rope_theta"], 2e5);
}

/// A Hugging Face file reads and writes back as it was, but for the nulls
/// of the model's fields, written as the values they stand for.
#[test]
fn fixture_configs_write_back_as_read() {
    fn check<C: HfConfig>(name: &str, resolved: Value) {
        let mut file: Value = serde_json::from_slice(&std::fs::read(fixture(name).join("config.json")).unwrap()).unwrap();
        for (k, v) in resolved.as_object().unwrap() {
            file[k] = v.clone();
        }
        let written = C::from_json(&file).unwrap().to_json();
        assert_eq!(written, file, "{name}");
    }
    check::<Gpt2Config>("gpt2", json!({}));
    check::<LlamaConfig>("llama", json!({}));
    check::<MixtralConfig>("mixtral", json!({"head_dim": 8}));
}

/// A field of `extra` that repeats one of the config's own (a config built
/// in code) does not override it on writing: the field is what the model uses.
#[test]
fn the_configs_own_fields_win_over_extra() {
    let mut config = Gpt2Config::tiny(64, 32, 4, 2, 16);
    config.extra.insert("n_embd".into(), json!(999));
    config.extra.insert("summary_type".into(), json!("cls_index"));
    let json = config.to_json();
    assert_eq!((json["n_embd"].clone(), json["summary_type"].clone()), (json!(32), json!("cls_index")));
}

/// The fields a `[model]` table may set are exactly those a config writes
/// (besides the ones it keeps as read), so that they cannot drift apart.
#[test]
fn fields_are_what_a_config_writes() {
    fn written<C: HfConfig>(config: C) {
        let json = config.to_json();
        let mut keys: Vec<&str> = json.as_object().unwrap().keys().map(String::as_str).collect();
        let mut fields = C::FIELDS.to_vec();
        keys.sort();
        fields.sort();
        assert_eq!(keys, fields);
    }
    written(Gpt2Config { extra: Map::new(), ..Gpt2Config::default() });
    written(LlamaConfig { extra: Map::new(), ..LlamaConfig::default() });
    written(MixtralConfig { extra: Map::new(), ..MixtralConfig::default() });
}

/// A value of the wrong type for `field`, whatever type it has in `file`.
fn wrong_type(file: &Value, field: &str) -> Value {
    match &file[field] {
        Value::String(_) => json!(7),
        Value::Null | Value::Number(_) | Value::Bool(_) => json!("seven"),
        Value::Array(_) | Value::Object(_) => json!(true),
    }
}

/// The field named when `field` of `file` holds `value`.
fn named<C: HfConfig + Debug>(file: &Value, field: &str, value: Value) -> String {
    let mut file = file.clone();
    file[field] = value;
    match C::from_json(&file) {
        Ok(c) => panic!("`{field}` of the wrong type read as {c:?}"),
        Err(e) => {
            assert!(e.to_string().contains("cannot read"), "{e}");
            field_of(&e).to_string()
        }
    }
}

/// Each of the model's fields, and each field of `extra` it checks, given a
/// value of the wrong type: the error names that field (dotted when nested).
#[test]
fn a_field_of_the_wrong_type_is_named() {
    fn each_field<C: HfConfig + Debug>(config: C, checked: &[&str]) {
        let file = config.to_json();
        for field in C::FIELDS.iter().chain(checked) {
            assert_eq!(named::<C>(&file, field, wrong_type(&file, field)), *field);
        }
    }
    each_field(Gpt2Config::tiny(64, 32, 4, 2, 16), &["scale_attn_weights", "scale_attn_by_inverse_layer_idx", "add_cross_attention"]);
    let attention = ["rope_parameters", "rope_scaling", "attention_dropout"];
    each_field(LlamaConfig::tiny(64, 32, 4, 2, 48, 2, 16), &[&attention[..], &["attention_bias", "mlp_bias"][..]].concat());
    each_field(MixtralConfig::tiny(64, 32, 4, 2, 48, 4, 2, 1, 16), &[&attention[..], &["router_jitter_noise", "sliding_window"][..]].concat());

    // Nested fields are named by their path.
    let file = LlamaConfig::tiny(64, 32, 4, 2, 48, 2, 16).to_json();
    assert_eq!(named::<LlamaConfig>(&file, "rope_parameters", json!({"rope_theta": "big"})), "rope_parameters.rope_theta");
    assert_eq!(named::<LlamaConfig>(&file, "rope_parameters", json!({"rope_type": 3})), "rope_parameters.rope_type");
    assert_eq!(named::<LlamaConfig>(&file, "rope_scaling", json!({"type": ["linear"]})), "rope_scaling.type");
    let e = LlamaConfig::from_json(&json!({"vocab_size": -1})).unwrap_err();
    assert!(e.to_string().contains("config field `vocab_size`: cannot read the number -1"), "{e}");
}
