//! The `tojson` filter as transformers defines it for chat templates:
//! Python's `json.dumps(value, ensure_ascii=False, indent=..., separators=...,
//! sort_keys=...)`.
//!
//! Jinja's own `tojson` (and minijinja's) escapes `<`, `>`, `&` and `'` for
//! HTML; transformers replaces it, because a tool schema written into a prompt
//! must read as plain JSON. Tool-calling templates (Llama 3.1, Qwen 2.5,
//! Hermes) print tool definitions and call arguments with it, so the bytes
//! of the prompt, and so the tokens the model sees, depend on matching
//! Python exactly: `", "` and `": "` between items, `NaN`, `1e+20`.

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Error, ErrorKind, Value};

/// Deeper than any real tool schema; bounds the recursion on a value that
/// contains itself (a namespace assigned into itself).
const MAX_DEPTH: usize = 128;

/// How `json.dumps` was asked to write.
#[derive(Clone, Debug)]
pub(crate) struct DumpOptions {
    /// `None`: everything on one line.
    pub indent: Option<String>,
    pub item_separator: String,
    pub key_separator: String,
    pub sort_keys: bool,
    pub ensure_ascii: bool,
}

impl Default for DumpOptions {
    fn default() -> Self {
        DumpOptions { indent: None, item_separator: ", ".into(), key_separator: ": ".into(), sort_keys: false, ensure_ascii: false }
    }
}

/// The `tojson` filter: `value | tojson(indent=4)`, with transformers'
/// keyword arguments (`ensure_ascii` may also come first by position).
pub(crate) fn tojson_filter(value: &Value, ensure_ascii: Option<bool>, kwargs: Kwargs) -> Result<Value, Error> {
    let mut options = DumpOptions { ensure_ascii: ensure_ascii.unwrap_or(false), ..DumpOptions::default() };
    if let Some(flag) = kwargs.get::<Option<bool>>("ensure_ascii")? {
        options.ensure_ascii = flag;
    }
    let indent: Option<Value> = kwargs.get("indent")?;
    if let Some(indent) = indent.filter(|v| !v.is_none()) {
        options.indent = Some(match (indent.as_str(), indent.as_i64()) {
            (Some(s), _) => s.to_string(),
            // Python: a negative indent is no indentation, but still newlines.
            (None, Some(n)) => " ".repeat(n.clamp(0, 64) as usize),
            _ => return Err(Error::new(ErrorKind::InvalidOperation, format!("tojson: `indent` must be an integer or a string, not {}", indent.kind()))),
        });
        // Python's default item separator drops its space when indenting.
        options.item_separator = ",".into();
    }
    let separators: Option<Value> = kwargs.get("separators")?;
    if let Some(seps) = separators.filter(|v| !v.is_none()) {
        let pair: Vec<Value> = seps.try_iter().map(|it| it.collect()).unwrap_or_default();
        match pair.as_slice() {
            [item, key] if item.as_str().is_some() && key.as_str().is_some() => {
                options.item_separator = item.as_str().unwrap_or_default().to_string();
                options.key_separator = key.as_str().unwrap_or_default().to_string();
            }
            _ => return Err(Error::new(ErrorKind::InvalidOperation, "tojson: `separators` must be a pair of strings, such as (',', ':')")),
        }
    }
    if let Some(flag) = kwargs.get::<Option<bool>>("sort_keys")? {
        options.sort_keys = flag;
    }
    kwargs.assert_all_used()?;
    let mut out = String::new();
    dump(&mut out, value, &options, 0)?;
    Ok(Value::from(out))
}

/// Writes `value` as `json.dumps` would.
pub(crate) fn dump(out: &mut String, value: &Value, options: &DumpOptions, depth: usize) -> Result<(), Error> {
    if depth > MAX_DEPTH {
        return Err(Error::new(ErrorKind::InvalidOperation, format!("tojson: the value is nested more than {MAX_DEPTH} levels deep (or contains itself)")));
    }
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&number(value)),
        ValueKind::String => string(out, value.as_str().unwrap_or_default(), options.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            container(out, '[', ']', &items, options, depth, |out, item| dump(out, item, options, depth + 1))?;
        }
        ValueKind::Map => {
            let mut entries = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                entries.push((key_string(&key)?, item));
            }
            if options.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            container(out, '{', '}', &entries, options, depth, |out, (key, item)| {
                string(out, key, options.ensure_ascii);
                out.push_str(&options.key_separator);
                dump(out, item, options, depth + 1)
            })?;
        }
        kind => {
            // Python raises `TypeError: Object of type Undefined is not JSON serializable`.
            return Err(Error::new(ErrorKind::InvalidOperation, format!("tojson: a value of kind {kind} is not JSON serializable")));
        }
    }
    Ok(())
}

/// A list or object: `open`, the items separated and indented, `close`.
fn container<T>(
    out: &mut String,
    open: char,
    close: char,
    items: &[T],
    options: &DumpOptions,
    depth: usize,
    mut write: impl FnMut(&mut String, &T) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if items.is_empty() {
        out.push(close);
        return Ok(());
    }
    let newline = |out: &mut String, level: usize| {
        if let Some(indent) = &options.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(indent);
            }
        }
    };
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push_str(&options.item_separator);
        }
        newline(out, depth + 1);
        write(out, item)?;
    }
    newline(out, depth);
    out.push(close);
    Ok(())
}

/// A dict key as Python writes it: strings as they are, numbers, booleans
/// and `None` as their JSON spelling.
fn key_string(key: &Value) -> Result<String, Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_string()),
        ValueKind::Number => Ok(number(key)),
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.to_string()),
        ValueKind::None => Ok("null".to_string()),
        kind => Err(Error::new(ErrorKind::InvalidOperation, format!("tojson: keys must be strings, numbers, booleans or none, not {kind}"))),
    }
}

/// A number as Python's `json.dumps` writes it: integers in full, floats as
/// `repr` does (shortest round trip, exponent past 1e16 or below 1e-4), and
/// `NaN` / `Infinity`, which Python allows by default.
fn number(value: &Value) -> String {
    if value.is_integer() {
        return value.to_string();
    }
    match f64::try_from(value.clone()) {
        Ok(f) => float_repr(f),
        Err(_) => value.to_string(),
    }
}

/// Python's `repr(float)`.
pub(crate) fn float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    // Rust's `{:e}` is the shortest representation that round-trips, as
    // Python's repr: the same digits, only laid out differently.
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    // The position of the decimal point relative to the digits.
    let point = exp + 1;
    if !(-3..=16).contains(&point) {
        let mut s = format!("{sign}{}", &digits[..1]);
        if digits.len() > 1 {
            s.push('.');
            s.push_str(&digits[1..]);
        }
        let e = point - 1;
        s.push_str(&format!("e{}{:02}", if e < 0 { '-' } else { '+' }, e.abs()));
        return s;
    }
    if point <= 0 {
        return format!("{sign}0.{}{digits}", "0".repeat((-point) as usize));
    }
    let point = point as usize;
    if digits.len() <= point {
        format!("{sign}{digits}{}.0", "0".repeat(point - digits.len()))
    } else {
        format!("{sign}{}.{}", &digits[..point], &digits[point..])
    }
}

/// A JSON string as Python writes it: `"`, `\` and the control characters
/// escaped (with `\n`-style short forms where JSON has them); anything else
/// as it is, or as `\uXXXX` (surrogate pairs past the BMP) with `ensure_ascii`.
fn string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c if ensure_ascii && !c.is_ascii() => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_read_as_python_repr() {
        // Each pair is (value, Python's repr(value)).
        let cases = [
            (1.0, "1.0"),
            (-0.0, "-0.0"),
            (0.5, "0.5"),
            (1.5e-7, "1.5e-07"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (123456789012345.0, "123456789012345.0"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.2345e20, "1.2345e+20"),
            (std::f64::consts::PI, "3.141592653589793"),
            (0.1 + 0.2, "0.30000000000000004"),
            (1e300, "1e+300"),
            (-2.5e-300, "-2.5e-300"),
            (f64::NAN, "NaN"),
            (f64::NEG_INFINITY, "-Infinity"),
        ];
        for (f, want) in cases {
            assert_eq!(float_repr(f), want, "{f:e}");
        }
    }

    /// `expr | tojson(args)` rendered by a bare environment with the filter.
    fn tojson(expr: &str, args: &str) -> String {
        let mut env = minijinja::Environment::new();
        env.add_filter("tojson", tojson_filter);
        env.render_str(&format!("{{{{ {expr} | tojson({args}) }}}}"), ()).unwrap()
    }

    #[test]
    fn values_read_as_json_dumps() {
        // A dict literal keeps its order, as Python's does; the expected
        // strings are Python's json.dumps(v, ensure_ascii=False, ...) of the same dict.
        let v = r#"{"name": "get_weather", "n": [1, 2.5, none, true, -7], "s": "é \"q\" \\ \n\u0001<&>", "empty": {}, "none": [], 3: 1.0}"#;
        assert_eq!(
            tojson(v, ""),
            r#"{"name": "get_weather", "n": [1, 2.5, null, true, -7], "s": "é \"q\" \\ \n\u0001<&>", "empty": {}, "none": [], "3": 1.0}"#
        );
        assert_eq!(
            tojson(v, "indent=2"),
            "{\n  \"name\": \"get_weather\",\n  \"n\": [\n    1,\n    2.5,\n    null,\n    true,\n    -7\n  ],\n  \"s\": \"é \\\"q\\\" \\\\ \\n\\u0001<&>\",\n  \"empty\": {},\n  \"none\": [],\n  \"3\": 1.0\n}"
        );
        assert_eq!(tojson(r#"{"b": "é😀", "a": 1}"#, "ensure_ascii=true, sort_keys=true, separators=(',', ':')"), r#"{"a":1,"b":"\u00e9\ud83d\ude00"}"#);
        assert_eq!(tojson("[1, [2, {}]]", "indent='\t'"), "[\n\t1,\n\t[\n\t\t2,\n\t\t{}\n\t]\n]");
    }

    #[test]
    fn what_python_cannot_dump_is_an_error() {
        let mut env = minijinja::Environment::new();
        env.add_filter("tojson", tojson_filter);
        for bad in [
            "undefined_name | tojson",
            "1 | tojson(indent=[1])",
            "1 | tojson(separators=(1, 2))",
            "1 | tojson(colour=1)",
            "{'a': {}} | tojson(indent=none, separators=none, sort_keys=none)",
        ] {
            let r = env.render_str(&format!("{{{{ {bad} }}}}"), ());
            if bad.contains("sort_keys=none") {
                assert_eq!(r.unwrap(), r#"{"a": {}}"#);
            } else {
                assert!(r.is_err(), "{bad}: {r:?}");
            }
        }
    }
}
