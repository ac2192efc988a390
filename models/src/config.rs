//! Reading and writing Hugging Face `config.json` files field by field, so
//! that a field of the wrong type is reported by name, fields absent from the
//! file take Hugging Face's defaults, and fields the model does not use are
//! kept and written back unchanged.

use crate::error::{Error, Result};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::{Map, Value};

/// The fields of one `config.json` object.
pub(crate) struct Fields<'a> {
    map: &'a Map<String, Value>,
}

impl<'a> Fields<'a> {
    /// The fields of `value`, which must be a JSON object.
    pub fn of(value: &'a Value) -> Result<Fields<'a>> {
        match value {
            Value::Object(map) => Ok(Fields { map }),
            other => Err(Error::config("(top level)", format!("a config is a JSON object of fields, got {}", kind(other)))),
        }
    }

    /// The fields of `map`.
    pub fn new(map: &'a Map<String, Value>) -> Fields<'a> {
        Fields { map }
    }

    /// Field `name`, or `default` when it is absent or null.
    pub fn get<T: DeserializeOwned>(&self, name: &str, default: T) -> Result<T> {
        Ok(self.opt(name)?.unwrap_or(default))
    }

    /// Field `name`, `None` when it is absent or null.
    pub fn opt<T: DeserializeOwned>(&self, name: &str) -> Result<Option<T>> {
        match self.map.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => serde_json::from_value(v.clone()).map(Some).map_err(|e| Error::config(name, format!("cannot read {}: {e}", kind(v)))),
        }
    }

    /// Every field not in `known`, to be written back as it was read.
    pub fn rest(&self, known: &[&str]) -> Map<String, Value> {
        self.map.iter().filter(|(k, _)| !known.contains(&k.as_str())).map(|(k, v)| (k.clone(), v.clone())).collect()
    }
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

/// Builds a `config.json` object: the model's fields, then the kept ones.
pub(crate) struct Writer {
    map: Map<String, Value>,
}

impl Writer {
    pub fn new() -> Writer {
        Writer { map: Map::new() }
    }

    /// Sets field `name`.
    pub fn set(mut self, name: &str, value: impl Serialize) -> Writer {
        let v = serde_json::to_value(value).expect("config values are plain data");
        self.map.insert(name.to_string(), v);
        self
    }

    /// Adds the fields of `rest` that are not set already.
    pub fn keep(mut self, rest: &Map<String, Value>) -> Value {
        for (k, v) in rest {
            self.map.entry(k.clone()).or_insert_with(|| v.clone());
        }
        Value::Object(self.map)
    }
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

/// Implements serde's traits for a config through its `from_json` and
/// `to_json`, so every deserialisation reports bad fields by name.
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
