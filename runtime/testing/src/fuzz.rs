//! Bounded mutation fuzzing of loaders of outside input, on stable Rust.
//!
//! The project's own loaders (configuration, checkpoints, tokenizers, token
//! shards, Hugging Face files) are fuzzed with it in its test suite; a user
//! can fuzz theirs the same way. Each target starts from valid files (its seeds) and feeds its loader
//! thousands of deterministic mutations of them: bit and byte flips, runs of
//! bytes overwritten, cut or inserted, chunks spliced from another seed,
//! interesting numbers (0, 1, -1, 2^31, 2^64 - 1 as text and little-endian
//! bytes) written in. A loader may refuse any input with an error; it must
//! not panic, abort or hang. (libFuzzer needs a nightly compiler; these runs
//! use the pinned stable one, so they run in CI.) `TESSERA_FUZZ_CASES`
//! raises the number of mutations per target; a failing case is printed as
//! its seed and mutation number, to become a regression test.
//!
//! ```
//! use std::time::Duration;
//! use tessera::testing::fuzz::fuzz;
//!
//! // A loader that refuses bad input with an error, never a panic.
//! let parse = |b: &[u8]| std::str::from_utf8(b).ok().and_then(|s| s.trim().parse::<u32>().ok());
//! fuzz("u32", &[b"42".to_vec(), b"7\n".to_vec()], 500, Duration::from_secs(1), |b| parse(b).is_some());
//! ```

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

/// A SplitMix64 generator: small, fast, and the same on every machine.
pub struct Rng(u64);

impl Rng {
    /// A generator started from `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// The next 64 random bits.
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
}

const INTERESTING: [&[u8]; 10] = [b"0", b"1", b"-1", b"2147483648", b"18446744073709551615", b"1e308", b"NaN", b"null", b"\"\"", b"[]"];

/// One to four random mutations of `input` (with `seeds` to splice from).
pub fn mutate(rng: &mut Rng, input: &[u8], seeds: &[Vec<u8>]) -> Vec<u8> {
    let mut v = input.to_vec();
    for _ in 0..1 + rng.below(4) {
        let at = rng.below(v.len() + 1);
        match rng.below(9) {
            0 if !v.is_empty() => {
                let i = rng.below(v.len());
                v[i] ^= 1 << rng.below(8);
            }
            1 if !v.is_empty() => {
                let i = rng.below(v.len());
                v[i] = rng.next() as u8;
            }
            2 => v.truncate(at),
            3 => {
                let n = 1 + rng.below(16);
                let end = (at + n).min(v.len());
                v.drain(at..end);
            }
            4 => {
                let n = 1 + rng.below(16);
                let bytes: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
                v.splice(at..at, bytes);
            }
            5 => {
                let s = INTERESTING[rng.below(INTERESTING.len())];
                let end = (at + s.len()).min(v.len());
                v.splice(at..end, s.iter().copied());
            }
            6 => {
                let x: u64 = [0, 1, u64::MAX, 1 << 31, 1 << 32, 1 << 62][rng.below(6)];
                let end = (at + 8).min(v.len());
                v.splice(at..end, x.to_le_bytes());
            }
            7 if !seeds.is_empty() => {
                let other = &seeds[rng.below(seeds.len())];
                if !other.is_empty() {
                    let from = rng.below(other.len());
                    let len = 1 + rng.below((other.len() - from).min(64));
                    let end = (at + len).min(v.len());
                    v.splice(at..end, other[from..from + len].iter().copied());
                }
            }
            _ => {
                // Duplicate a run (repeated keys, nested structures).
                if !v.is_empty() {
                    let from = rng.below(v.len());
                    let len = 1 + rng.below((v.len() - from).min(32));
                    let run = v[from..from + len].to_vec();
                    v.splice(at..at, run);
                }
            }
        }
    }
    v
}

/// How many mutations each target runs: `TESSERA_FUZZ_CASES` if set, else
/// `default`.
pub fn cases(default: usize) -> usize {
    std::env::var("TESSERA_FUZZ_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}

/// Runs `load` on `cases` mutations of the `seeds`; fails on the first
/// panic or on a case that takes longer than `limit`, naming it. `load`
/// says whether it accepted its input: a target whose mutations are all
/// accepted, or all refused, is not reaching past its first check, and
/// fails too.
pub fn fuzz(name: &str, seeds: &[Vec<u8>], cases: usize, limit: Duration, mut load: impl FnMut(&[u8]) -> bool) {
    assert!(!seeds.is_empty(), "{name}: no seeds");
    let mut rng = Rng::new(0x5EED ^ name.bytes().fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(b as u64)));
    // The seeds themselves first: they are valid inputs.
    for (i, s) in seeds.iter().enumerate() {
        match catch_unwind(AssertUnwindSafe(|| load(s))) {
            Ok(true) => {}
            Ok(false) => panic!("{name}: the valid seed {i} was refused"),
            Err(_) => panic!("{name}: the valid seed {i} panicked"),
        }
    }
    let mut failure = None;
    let mut accepted = 0;
    for case in 0..cases {
        let seed = rng.below(seeds.len());
        let input = mutate(&mut rng, &seeds[seed], seeds);
        let started = Instant::now();
        let outcome = catch_unwind(AssertUnwindSafe(|| load(&input)));
        let took = started.elapsed();
        accepted += matches!(outcome, Ok(true)) as usize;
        if outcome.is_err() || took > limit {
            let what = if outcome.is_err() { "panicked".to_string() } else { format!("took {took:?}") };
            failure = Some(format!(
                "{name}: mutation {case} of seed {seed} {what}; input ({} bytes): {:?}",
                input.len(),
                String::from_utf8_lossy(&input[..input.len().min(600)])
            ));
            break;
        }
    }
    if let Some(f) = failure {
        panic!("{f}");
    }
    eprintln!("{name}: {cases} mutations, {accepted} accepted");
    assert!(
        cases < 100 || (accepted > 0 && accepted < cases),
        "{name}: {accepted} of {cases} mutations accepted; the mutations do not reach the loader's checks"
    );
}
