//! Generated inputs for the crate's tests: a small seeded generator, so a
//! failing case can be replayed from its seed.

use tessera_core::RngKey;

/// A deterministic source of test values.
pub(crate) struct Gen {
    key: RngKey,
    next: u64,
}

impl Gen {
    pub(crate) fn new(seed: u64) -> Self {
        // A stream of its own, so test data never shares draws with the sampler's.
        Self { key: RngKey::new(seed, 0x7e57), next: 0 }
    }

    fn bits(&mut self) -> u32 {
        self.next += 1;
        self.key.bits_at(self.next)
    }

    /// Uniform in [0, 1).
    pub(crate) fn uniform(&mut self) -> f64 {
        f64::from(self.bits()) / 4294967296.0
    }

    /// Uniform in [0, n).
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.uniform() * n as f64) as usize
    }

    /// Standard normal.
    pub(crate) fn normal(&mut self) -> f64 {
        self.next += 1;
        self.key.normal_at(self.next)
    }

    /// `vocab` logits of a random spread; a few are masked (-inf) and a few
    /// tie, the cases filters get wrong.
    pub(crate) fn logits(&mut self, vocab: usize) -> Vec<f32> {
        let spread = 0.5 + 4.0 * self.uniform();
        let mut logits: Vec<f32> = (0..vocab).map(|_| (self.normal() * spread) as f32).collect();
        for _ in 0..vocab / 8 {
            let (a, b) = (self.below(vocab), self.below(vocab));
            logits[a] = logits[b];
        }
        for _ in 0..vocab / 10 {
            let i = self.below(vocab);
            logits[i] = f32::NEG_INFINITY;
        }
        if logits.iter().all(|l| *l == f32::NEG_INFINITY) {
            logits[0] = 0.0;
        }
        logits
    }

    /// Fewer than `max_len` token ids below `vocab`, drawn from a few so that
    /// tokens repeat.
    pub(crate) fn tokens(&mut self, max_len: usize, vocab: usize) -> Vec<u32> {
        let len = self.below(max_len);
        let distinct = 1 + self.below(vocab);
        (0..len).map(|_| self.below(distinct) as u32).collect()
    }
}
