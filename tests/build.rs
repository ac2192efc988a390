//! Writes the differential fuzzer's programs (see `fuzz/gen.rs`) as Rust for
//! `tests/dsl_fuzz.rs` to compile. `TESSERA_FUZZ_SEED` and
//! `TESSERA_FUZZ_PROGRAMS` choose another stream of programs or more of them.

#[path = "fuzz/gen.rs"]
mod gen;

use std::fmt::Write;

/// The programs CI compiles and checks.
const SEED: u64 = 0x7E55_E7A0;
const PROGRAMS: usize = 240;

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=fuzz/gen.rs");
    println!("cargo::rerun-if-env-changed=TESSERA_FUZZ_SEED");
    println!("cargo::rerun-if-env-changed=TESSERA_FUZZ_PROGRAMS");
    let seed = std::env::var("TESSERA_FUZZ_SEED").ok().and_then(|s| parse(&s)).unwrap_or(SEED);
    let count = std::env::var("TESSERA_FUZZ_PROGRAMS").ok().and_then(|s| s.parse().ok()).unwrap_or(PROGRAMS);
    let mut out = format!("/// The seed the programs below were drawn with.\npub const SEED: u64 = {seed:#x};\n/// The vocabulary of their language models.\npub const VOCAB: usize = {};\n\n", gen::VOCAB);
    let mut cases = String::new();
    for i in 0..count {
        let p = gen::program(seed, i);
        let source = p.source();
        out.push_str(&source);
        let lm = p.lm_name();
        writeln!(out, "fn run_{i}() -> Result<Report> {{\n    check_program(|_: &Rank| {lm}::new(), {})\n}}\n", p.half).unwrap();
        writeln!(cases, "    Case {{ index: {i}, half: {}, features: &{:?}, source: r####\"{source}\"####, run: run_{i} }},", p.half, p.features).unwrap();
    }
    writeln!(out, "/// Every program, in order.\npub const CASES: &[Case] = &[\n{cases}];").unwrap();
    let path = std::path::Path::new(&std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("dsl_fuzz.rs");
    std::fs::write(path, out).expect("OUT_DIR is writable");
}

/// A decimal or `0x` hexadecimal seed.
fn parse(s: &str) -> Option<u64> {
    match s.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => s.parse().ok(),
    }
}
