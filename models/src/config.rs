//! What the Hugging Face `config.json` readers and writers share. Each
//! config's fields are read and written by a serde derive (on a private
//! struct that mirrors the config, see `gpt2/config.rs`); this module adds
//! what the derive does not do: null read as absent, the field of the wrong
//! type named in the error, and fields the model does not use written back
//! without overriding the config's own.

use crate::error::{Error, Result};
use crate::hf::HfConfig;
use serde::de::DeserializeOwned;
use serde::Serializer;
use serde_json::{Map, Value};
use serde_path_to_error::Segment;

/// The deserialiser a config's derive reads from: the file's object, with
/// the path to the value being read tracked so that an error can name it.
pub(crate) type Tracked<'t> = serde_path_to_error::Deserializer<'t, 't, &'t Value>;

/// Reads a config from its `config.json` object with `derived` (the
/// derive's `deserialize`), whose fields are `known`. Fields absent or null
/// take the derive's defaults; every other key is kept by the derive (in `extra`).
pub(crate) fn read<T>(value: &Value, known: &[&str], derived: impl FnOnce(Tracked<'_>) -> serde_json::Result<T>) -> Result<T> {
    let Value::Object(map) = value else {
        return Err(Error::config("(top level)", format!("a config is a JSON object of fields, got {}", kind(value))));
    };
    // Hugging Face writes null for a field left at its default (`n_inner`,
    // `head_dim`, ...); a derive would refuse null for a number. Nulls of
    // fields the model does not use are kept, to be written back.
    let given: Map<String, Value> = map.iter().filter(|(k, v)| !(v.is_null() && known.contains(&k.as_str()))).map(|(k, v)| (k.clone(), v.clone())).collect();
    tracked(Value::Object(given), derived)
}

/// Reads the fields of `extra` that a config checks, a struct whose fields
/// are all `Option`s (absent and null both read as `None`).
pub(crate) fn read_extra<T: DeserializeOwned>(extra: &Map<String, Value>) -> Result<T> {
    tracked(Value::Object(extra.clone()), |d| T::deserialize(d))
}

/// Runs `derived` on `value`; an error names the field it failed on and
/// says what that field held.
fn tracked<T>(value: Value, derived: impl FnOnce(Tracked<'_>) -> serde_json::Result<T>) -> Result<T> {
    let mut track = serde_path_to_error::Track::new();
    derived(serde_path_to_error::Deserializer::new(&value, &mut track)).map_err(|e| {
        let path = track.path();
        let field = if path.iter().len() == 0 { "(top level)".to_string() } else { path.to_string() };
        match at(&value, &path) {
            Some(v) => Error::config(field, format!("cannot read {}: {e}", kind(v))),
            None => Error::config(field, e.to_string()),
        }
    })
}

/// The value at `path` in `value`, for the error message.
fn at<'v>(value: &'v Value, path: &serde_path_to_error::Path) -> Option<&'v Value> {
    path.iter().try_fold(value, |v, segment| match segment {
        Segment::Map { key } => v.get(key),
        Segment::Seq { index } => v.get(index),
        _ => None,
    })
}

/// What a JSON value is, for messages.
fn kind(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => format!("the boolean {b}"),
        Value::Number(n) => format!("the number {n}"),
        Value::String(s) => format!("the string {s:?}"),
        Value::Array(_) => "an array".into(),
        Value::Object(_) => "an object".into(),
    }
}

/// Writes the kept fields of a config of type `C` (its derive's
/// `serialize_with` for `extra`), less any that `C` writes itself: a config
/// built in code may repeat one in `extra`, and the field is what the model uses.
pub(crate) fn write_extra<C: HfConfig, S: Serializer>(extra: &Map<String, Value>, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.collect_map(extra.iter().filter(|(k, _)| !C::FIELDS.contains(&k.as_str())))
}

/// Whether `config.json` gives field `name` (present and not null), for
/// defaults that depend on other fields.
pub(crate) fn given(value: &Value, name: &str) -> bool {
    value.get(name).is_some_and(|v| !v.is_null())
}

/// The fields every Hugging Face config carries that name its class, for a
/// config built in code rather than read from a file.
pub(crate) fn identity(model_type: &str, architecture: &str) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("model_type".into(), Value::from(model_type));
    m.insert("architectures".into(), Value::from(vec![architecture]));
    m
}

/// Checks that `rest` does not name another model type.
pub(crate) fn check_model_type(rest: &Map<String, Value>, expected: &str) -> Result<()> {
    match rest.get("model_type") {
        None | Some(Value::Null) => Ok(()),
        Some(Value::String(s)) if s == expected => Ok(()),
        Some(other) => Err(Error::config("model_type", format!("this is a config of model type {other}, not `{expected}`; load it with the matching model"))),
    }
}

/// Checks that `value` of `field` is positive.
pub(crate) fn positive(field: &str, value: usize) -> Result<()> {
    if value == 0 {
        return Err(Error::config(field, "must be positive, got 0"));
    }
    Ok(())
}

/// Checks that `value` of `field` is a positive finite number.
pub(crate) fn positive_real(field: &str, value: f64) -> Result<()> {
    if !(value.is_finite() && value > 0.0) {
        return Err(Error::config(field, format!("must be a positive finite number, got {value}")));
    }
    Ok(())
}

/// Checks the experts of a mixture: `experts` per block
/// (`num_local_experts`), of which each token is routed to `top_k`
/// (`num_experts_per_tok`).
pub(crate) fn check_experts(experts: usize, top_k: usize) -> Result<()> {
    positive("num_local_experts", experts)?;
    if !(1..=experts).contains(&top_k) {
        return Err(Error::config("num_experts_per_tok", format!("{top_k} experts per token from {experts} experts; choose 1 to num_local_experts")));
    }
    Ok(())
}

/// Implements serde's traits for a config through its `from_json` and
/// `to_json`, so every deserialisation reads nulls as absent, fills the
/// dependent defaults, validates and reports bad fields by name.
macro_rules! serde_via_json {
    ($t:ty) => {
        impl serde::Serialize for $t {
            fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
                self.to_json().serialize(s)
            }
        }

        impl<'de> serde::Deserialize<'de> for $t {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
                let v = serde_json::Value::deserialize(d)?;
                <$t>::from_json(&v).map_err(serde::de::Error::custom)
            }
        }
    };
}
pub(crate) use serde_via_json;
