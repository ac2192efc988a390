//! The parameter lists of the compiled kernels, read from the PTX that NVRTC
//! produces, so a launch can be checked against what the `.cu` source
//! declares (after its macros are expanded) before the driver reads its
//! arguments as raw bytes.
//!
//! A PTX entry declares each parameter by its type and size: pointers and
//! 64-bit integers as `.u64`, `float` as `.f32`, `unsigned` as `.u32`, and a
//! struct passed by value as an aligned byte array (`.align 8 .b8 p[216]`).

use std::collections::HashMap;
use std::fmt;

/// One kernel parameter as PTX declares it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Param {
    /// `.u64`/`.s64`/`.b64`: a device pointer or a 64-bit integer.
    B64,
    /// `.u32`/`.s32`/`.b32`: a 32-bit integer.
    B32,
    /// `.f32`: a `float`.
    F32,
    /// `.f64`: a `double`.
    F64,
    /// A struct passed by value: its size in bytes.
    Bytes(usize),
}

impl fmt::Display for Param {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Param::B64 => write!(f, "a 64-bit value (pointer or integer)"),
            Param::B32 => write!(f, "a 32-bit integer"),
            Param::F32 => write!(f, "an f32"),
            Param::F64 => write!(f, "an f64"),
            Param::Bytes(n) => write!(f, "a {n}-byte struct"),
        }
    }
}

/// Why a PTX text could not be read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParseError(pub String);

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "unreadable PTX: {}", self.0)
    }
}

impl std::error::Error for ParseError {}

/// Every `.entry` of a PTX module with its parameters, in order.
pub fn entries(ptx: &str) -> Result<HashMap<String, Vec<Param>>, ParseError> {
    let mut out = HashMap::new();
    let mut rest = ptx;
    while let Some(at) = rest.find(".entry") {
        rest = &rest[at + ".entry".len()..];
        // `.entry` as a word, not a prefix of another directive.
        if !rest.starts_with(|c: char| c.is_whitespace()) {
            continue;
        }
        let open = rest.find('(').ok_or_else(|| ParseError("an `.entry` without a parameter list".into()))?;
        let name = rest[..open].trim();
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '$') {
            return Err(ParseError(format!("an `.entry` named `{name}`")));
        }
        let close = rest[open..].find(')').ok_or_else(|| ParseError(format!("the parameter list of `{name}` does not end")))? + open;
        let params = rest[open + 1..close]
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(|p| param(p).ok_or_else(|| ParseError(format!("parameter `{p}` of `{name}`"))))
            .collect::<Result<Vec<_>, _>>()?;
        out.insert(name.to_string(), params);
        rest = &rest[close..];
    }
    Ok(out)
}

/// One `.param` declaration: `.param .u64 name`, `.param .align 8 .b8 name[216]`.
fn param(decl: &str) -> Option<Param> {
    let words: Vec<&str> = decl.split_whitespace().collect();
    if words.first() != Some(&".param") {
        return None;
    }
    // Skip `.align N` and `.ptr...` qualifiers; the type is the first other directive.
    let mut i = 1;
    let ty = loop {
        match words.get(i)? {
            &".align" => i += 2,
            w if w.starts_with(".ptr") => i += 1,
            w => break *w,
        }
    };
    let name = words.get(i + 1)?;
    match ty {
        ".u64" | ".s64" | ".b64" if !name.contains('[') => Some(Param::B64),
        ".u32" | ".s32" | ".b32" if !name.contains('[') => Some(Param::B32),
        ".f32" if !name.contains('[') => Some(Param::F32),
        ".f64" if !name.contains('[') => Some(Param::F64),
        ".b8" => {
            let (_, count) = name.split_once('[')?;
            count.strip_suffix(']')?.parse().ok().map(Param::Bytes)
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PTX: &str = "
.version 8.7
.target sm_90
.address_size 64

.visible .entry add_f32(
\t.param .u64 add_f32_param_0,
\t.param .u64 add_f32_param_1,
\t.param .u64 add_f32_param_2,
\t.param .u64 add_f32_param_3
)
{
\tret;
}

.visible .entry scale_bf16(
\t.param .u64 .ptr .global .align 2 scale_bf16_param_0,
\t.param .f32 scale_bf16_param_1,
\t.param .u32 scale_bf16_param_2
)
.maxntid 256, 1, 1
{
}
.visible .entry attention_fwd_f32(
\t.param .u64 attention_fwd_f32_param_0,
\t.param .align 8 .b8 attention_fwd_f32_param_1[216]
)
{
}
.visible .entry nothing()
{
}
";

    #[test]
    fn entries_are_read_with_their_parameters_in_order() {
        let e = entries(PTX).unwrap();
        assert_eq!(e.len(), 4);
        assert_eq!(e["add_f32"], vec![Param::B64; 4]);
        assert_eq!(e["scale_bf16"], vec![Param::B64, Param::F32, Param::B32]);
        assert_eq!(e["attention_fwd_f32"], vec![Param::B64, Param::Bytes(216)]);
        assert!(e["nothing"].is_empty());
    }

    #[test]
    fn unreadable_declarations_are_errors_not_guesses() {
        for bad in [".entry f(\n.param .u16 x\n)", ".entry f(\n.param .b8 x\n)", ".entry f(\n.param .u64 x", ".entry (\n)", ".entry f .param"] {
            assert!(entries(bad).is_err(), "{bad:?} was accepted");
        }
        // A directive that merely begins with `.entry` is not one.
        assert!(entries(".entryish f(\n)").unwrap().is_empty());
    }
}
