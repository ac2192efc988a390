//! Turning one step's logits into a token: penalties, temperature, filters,
//! then argmax or a seeded draw.

use rayon::prelude::*;
use tessera_core::{Error, Result, RngKey};

use super::filter::{rank, truncate};
use super::{History, SamplingParams};

const OP: &str = "Sampler::sample";

/// Logits per task of the log-sum-exp (a 32k vocabulary is eight tasks).
const LSE_CHUNK: usize = 4096;

/// The random stream of token draws, so a request's seed used elsewhere (say
/// for a draft model) gives independent values.
const SAMPLING_STREAM: u64 = 0x5a4d_706c_6500;
/// The stream of speculative decoding's acceptance tests and residual draws.
const SPECULATIVE_STREAM: u64 = 0x5a4d_706c_6501;

/// The token at which the cumulative distribution of `dist` passes `u`.
fn invert(dist: &[(u32, f64)], u: f64) -> u32 {
    let mut cumulative = 0.0;
    for &(token, p) in dist {
        cumulative += p;
        if u < cumulative {
            return token;
        }
    }
    // Rounding left the sum a hair under u: the last token that can be drawn.
    dist.iter().rev().find(|&&(_, p)| p > 0.0).map_or(dist[0].0, |&(t, _)| t)
}

/// One sampled token.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    /// The token.
    pub token: u32,
    /// Its log probability under the distribution the sampler drew from
    /// before truncation: the log-softmax of the penalised logits divided by
    /// the temperature (by 1 when greedy). This is vLLM's "processed" logprob
    /// without the top-k/top-p/min-p cut, not its default of the raw model
    /// distribution.
    pub logprob: f32,
    /// The `logprobs` most likely tokens under the same distribution, most
    /// likely first, ties to the lowest id; masked (-inf) tokens are never
    /// listed. Empty unless the request asked for logprobs.
    pub top: Vec<(u32, f32)>,
}

/// The sampler of one request: it holds the request's parameters and random
/// key, and scratch space reused from step to step.
///
/// Draws use a counter-based generator keyed by the request's seed, with the
/// number of tokens generated so far as the counter: the same seed and history
/// give the same token whatever else runs in the batch and in whatever order,
/// and a request recomputed after preemption repeats itself.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    vocab: usize,
    key: RngKey,
    /// The seed the key was made from.
    seed: u64,
    /// The penalised logits, then divided by the temperature.
    scaled: Vec<f64>,
    ranked: Vec<u32>,
    kept: Vec<(u32, f64)>,
}

impl Sampler {
    /// A sampler for a vocabulary of `vocab` tokens, after checking `params`.
    /// `default_seed` seeds the draws when the request gives no seed; the
    /// engine derives it from its own seed and the request id, so that
    /// unseeded requests differ from one another but a rerun repeats.
    pub fn new(params: SamplingParams, vocab: usize, default_seed: u64) -> Result<Self> {
        params.validate(vocab)?;
        let seed = params.seed.unwrap_or(default_seed);
        let key = RngKey::new(seed, SAMPLING_STREAM);
        Ok(Self { params, vocab, key, seed, scaled: Vec::with_capacity(vocab), ranked: Vec::new(), kept: Vec::new() })
    }

    /// The seed of the request's draws (its own, or the engine's default).
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The request's parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token from the model's `logits` (one per vocabulary
    /// entry) for a request whose tokens so far are `history`.
    ///
    /// -inf logits mark tokens that may not be chosen; NaN or +inf logits,
    /// every token masked, or logits of the wrong length are errors.
    pub fn sample(&mut self, logits: &[f32], history: &History) -> Result<Sampled> {
        let log_normaliser = self.prepare(logits, history)?;
        let token = if self.params.is_greedy() { self.argmax() } else { self.draw(history.generated().len() as u64, log_normaliser) };
        Ok(self.report(token, log_normaliser))
    }

    /// The distribution a draw would come from after `history`: the tokens
    /// that survive the filters with their renormalised probabilities, most
    /// likely first (for greedy, the argmax with probability 1). A draft
    /// model's sampler gives it with each proposal, for [`verify`](Self::verify).
    pub fn distribution(&mut self, logits: &[f32], history: &History) -> Result<Vec<(u32, f64)>> {
        let lse = self.prepare(logits, history)?;
        if self.params.is_greedy() {
            return Ok(vec![(self.argmax(), 1.0)]);
        }
        Ok(self.kept(lse).to_vec())
    }

    /// Draws from a distribution `(token, probability)` with this request's
    /// stream at `step` (a draft model's proposal).
    pub fn draw_from(&self, dist: &[(u32, f64)], step: u64) -> u32 {
        invert(dist, self.uniform(step))
    }

    /// Speculative decoding's check of a proposed token, with the rule of
    /// Leviathan et al. (2023) and Chen et al. (2023), so that what comes
    /// out is distributed exactly as [`sample`](Self::sample) would draw.
    ///
    /// `draft` was proposed with probability `q[draft]` under the proposer's
    /// distribution `q` (`None`: a deterministic proposal, as prompt
    /// lookup's, `q = δ_draft`). Greedy: accepted when it is the argmax,
    /// and the result is the argmax either way. Sampling: accepted with
    /// probability `min(1, p(draft) / q(draft))`, `p` this sampler's
    /// distribution after `history`; when rejected the result is drawn from
    /// `max(0, p − q)` renormalised. Returns the token and whether it is the
    /// draft. The uniforms come from a stream apart from [`sample`](Self::sample)'s,
    /// indexed by the tokens generated so far.
    pub fn verify(&mut self, logits: &[f32], history: &History, draft: u32, q: Option<&[(u32, f64)]>) -> Result<(Sampled, bool)> {
        let lse = self.prepare(logits, history)?;
        let step = history.generated().len() as u64;
        let token = if self.params.is_greedy() {
            self.argmax()
        } else {
            let q_of = |t: u32| q.map_or(if t == draft { 1.0 } else { 0.0 }, |q| q.iter().find(|e| e.0 == t).map_or(0.0, |e| e.1));
            let kept = self.kept(lse).to_vec();
            let p_draft = kept.iter().find(|e| e.0 == draft).map_or(0.0, |e| e.1);
            let q_draft = q_of(draft);
            if q_draft > 0.0 && self.spec_uniform(2 * step) * q_draft < p_draft {
                draft
            } else {
                let residual: Vec<(u32, f64)> = kept.iter().map(|&(t, p)| (t, (p - q_of(t)).max(0.0))).filter(|e| e.1 > 0.0).collect();
                let mass: f64 = residual.iter().map(|e| e.1).sum();
                let u = self.spec_uniform(2 * step + 1);
                if mass > 0.0 {
                    invert(&residual.iter().map(|&(t, r)| (t, r / mass)).collect::<Vec<_>>(), u)
                } else {
                    // p equals q to rounding: p itself is the residual's limit.
                    invert(&kept, u)
                }
            }
        };
        Ok((self.report(token, lse), token == draft))
    }

    /// What is reported of the chosen `token`: its logprob under the scaled
    /// logits of log-sum-exp `lse` (see [`Sampled::logprob`]), and the
    /// request's top logprobs if it asked for them.
    fn report(&mut self, token: u32, lse: f64) -> Sampled {
        let logprob = (self.scaled[token as usize] - lse) as f32;
        let mut top = Vec::new();
        if let Some(n) = self.params.logprobs.filter(|&n| n > 0) {
            rank(&self.scaled, n, &mut self.ranked);
            top.extend(self.ranked.iter().map(|&t| (t, (self.scaled[t as usize] - lse) as f32)));
        }
        Sampled { token, logprob, top }
    }

    /// A uniform of the speculative stream (see [`uniform`](Self::uniform)).
    fn spec_uniform(&self, i: u64) -> f64 {
        let key = RngKey::new(self.seed, SPECULATIVE_STREAM);
        let hi = u64::from(key.bits_at(2 * i));
        let lo = u64::from(key.bits_at(2 * i + 1));
        ((hi << 21) | (lo >> 11)) as f64 / (1u64 << 53) as f64
    }

    /// Checks the logits, fills `scaled` with the penalised logits over the
    /// temperature, and returns their log-sum-exp.
    fn prepare(&mut self, logits: &[f32], history: &History) -> Result<f64> {
        if logits.len() != self.vocab {
            return Err(Error::shape(OP, format!("{} logits for a vocabulary of {}; pass one logit per token", logits.len(), self.vocab)));
        }
        if let Some(i) = logits.iter().position(|l| l.is_nan() || *l == f32::INFINITY) {
            return Err(Error::non_finite(OP, format!("the logit of token {i} is {}; the model's output is broken (mask tokens with -inf)", logits[i])));
        }
        self.scaled.clear();
        self.scaled.extend(logits.iter().map(|&l| f64::from(l)));
        history.apply_penalties(&self.params, &mut self.scaled)?;
        let max = self.scaled.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        if max == f64::NEG_INFINITY {
            return Err(Error::invalid(OP, "every token is masked (all logits are -inf); there is nothing to sample"));
        }
        // Greedy decoding reports logprobs at temperature 1, where they mean something.
        let temperature = if self.params.is_greedy() { 1.0 } else { f64::from(self.params.temperature) };
        let top = max / temperature;
        // The exponentials are most of a step's sampling (one per token of
        // the vocabulary), done while the rest of the machine would wait:
        // chunks run on the thread pool, their sums added in chunk order so
        // the result does not depend on the threads.
        let sums: Vec<f64> = self
            .scaled
            .par_chunks_mut(LSE_CHUNK)
            .map(|chunk| {
                chunk
                    .iter_mut()
                    .map(|z| {
                        *z /= temperature;
                        (*z - top).exp()
                    })
                    .sum::<f64>()
            })
            .collect();
        Ok(top + sums.iter().sum::<f64>().ln())
    }

    /// The most likely token, ties to the lowest id; no randomness.
    fn argmax(&self) -> u32 {
        let mut best = 0;
        for (i, &z) in self.scaled.iter().enumerate() {
            if z > self.scaled[best] {
                best = i;
            }
        }
        best as u32
    }

    /// The tokens that survive top-k, top-p and min-p with their renormalised
    /// probabilities, most likely first.
    pub(crate) fn kept(&mut self, log_normaliser: f64) -> &[(u32, f64)] {
        let top_k = if self.params.top_k == 0 { usize::MAX } else { self.params.top_k };
        rank(&self.scaled, top_k, &mut self.ranked);
        self.kept.clear();
        self.kept.extend(self.ranked.iter().map(|&t| (t, (self.scaled[t as usize] - log_normaliser).exp())));
        truncate(&mut self.kept, self.params.top_p, self.params.min_p);
        &self.kept
    }

    /// Draws from the kept tokens by inverting their cumulative distribution
    /// at one uniform value of the request's stream.
    fn draw(&mut self, step: u64, log_normaliser: f64) -> u32 {
        let u = self.uniform(step);
        invert(self.kept(log_normaliser), u)
    }

    /// A uniform value in [0, 1) with 53 random bits: the generator's own
    /// 24-bit uniforms would never draw a token of probability below 2^-24.
    fn uniform(&self, step: u64) -> f64 {
        let hi = u64::from(self.key.bits_at(2 * step));
        let lo = u64::from(self.key.bits_at(2 * step + 1));
        ((hi << 21) | (lo >> 11)) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_data::Gen;

    /// The distribution the filters should leave, computed the slow, obvious
    /// way in f64: for each token, count and sum over all the others.
    /// `None` if a top-p boundary is too close to call in floating point.
    fn reference(logits: &[f32], params: &SamplingParams) -> Option<Vec<f64>> {
        let t = f64::from(params.temperature);
        let z: Vec<f64> = logits.iter().map(|&l| f64::from(l) / t).collect();
        let max = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let p: Vec<f64> = z.iter().map(|&z| (z - max).exp()).collect();
        let vocab = p.len();
        let ahead = |a: usize, b: usize| p[a] > p[b] || (p[a] == p[b] && a < b);
        let in_top_k: Vec<bool> =
            (0..vocab).map(|i| p[i] > 0.0 && (params.top_k == 0 || (0..vocab).filter(|&j| p[j] > 0.0 && ahead(j, i)).count() < params.top_k)).collect();
        let top_k_mass: f64 = (0..vocab).filter(|&i| in_top_k[i]).map(|i| p[i]).sum();
        let p_max = p.iter().copied().fold(0.0, f64::max);
        let mut kept = vec![0.0; vocab];
        for i in (0..vocab).filter(|&i| in_top_k[i]) {
            let before: f64 = (0..vocab).filter(|&j| in_top_k[j] && ahead(j, i)).map(|j| p[j]).sum::<f64>() / top_k_mass;
            if params.top_p < 1.0 && (before - f64::from(params.top_p)).abs() < 1e-9 {
                return None;
            }
            if (params.top_p == 1.0 || before < f64::from(params.top_p)) && p[i] >= f64::from(params.min_p) * p_max {
                kept[i] = p[i];
            }
        }
        let mass: f64 = kept.iter().sum();
        Some(kept.iter().map(|k| k / mass).collect())
    }

    fn random_params(g: &mut Gen, vocab: usize) -> SamplingParams {
        SamplingParams {
            temperature: (0.2 + 2.0 * g.uniform()) as f32,
            top_k: [0, 1 + g.below(vocab + 2)][g.below(2)],
            top_p: [1.0, (0.05 + 0.95 * g.uniform()) as f32][g.below(2)],
            min_p: [0.0, g.uniform() as f32 * 0.5][g.below(2)],
            ..SamplingParams::default()
        }
    }

    #[test]
    fn greedy_is_the_argmax_with_ties_to_the_lowest_id_whatever_the_seed() {
        let mut g = Gen::new(4);
        for _ in 0..500 {
            let vocab = 1 + g.below(64);
            let logits = g.logits(vocab);
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let want = logits.iter().position(|&l| l == max).unwrap() as u32;
            let history = History::new(&[]);
            for seed in 0..3 {
                let params = SamplingParams { seed: Some(g.below(1 << 20) as u64), ..SamplingParams::greedy() };
                let got = Sampler::new(params, vocab, seed).unwrap().sample(&logits, &history).unwrap();
                assert_eq!(got.token, want, "{logits:?}");
            }
        }
    }

    #[test]
    fn the_filters_keep_the_reference_set_with_the_reference_probabilities() {
        let mut g = Gen::new(5);
        let mut checked = 0;
        for case in 0..400 {
            let vocab = 1 + g.below(40);
            let logits = g.logits(vocab);
            let params = random_params(&mut g, vocab);
            let Some(want) = reference(&logits, &params) else { continue };
            let mut sampler = Sampler::new(params.clone(), vocab, 0).unwrap();
            let lse = sampler.prepare(&logits, &History::new(&[])).unwrap();
            let mut got = vec![0.0; vocab];
            for &(t, p) in sampler.kept(lse) {
                got[t as usize] = p;
            }
            let kept = |d: &[f64]| (0..vocab).filter(|&i| d[i] > 0.0).collect::<Vec<_>>();
            assert_eq!(kept(&got), kept(&want), "case {case}: kept tokens differ for {params:?}, logits {logits:?}");
            for i in 0..vocab {
                assert!((got[i] - want[i]).abs() < 1e-9, "case {case}, token {i}: p {} != {}", got[i], want[i]);
            }
            checked += 1;
        }
        assert!(checked > 350, "too many cases skipped as too close to call: {checked} checked");
    }

    #[test]
    fn seeded_draws_follow_the_reference_distribution() {
        let mut g = Gen::new(6);
        const DRAWS: usize = 20_000;
        let mut checked = 0;
        for case in 0..8 {
            let vocab = 2 + g.below(24);
            let logits = g.logits(vocab);
            let params = random_params(&mut g, vocab);
            let Some(want) = reference(&logits, &params) else { continue };
            let history = History::new(&[]);
            let mut counts = vec![0usize; vocab];
            for seed in 0..DRAWS as u64 {
                let params = SamplingParams { seed: Some(seed), ..params.clone() };
                counts[Sampler::new(params, vocab, 0).unwrap().sample(&logits, &history).unwrap().token as usize] += 1;
            }
            // Pearson's chi-square over the tokens that can be drawn; the bound is
            // the mean plus six standard deviations, so a correct sampler passes and
            // a wrong filter or draw (off by a few percent on any token) does not.
            let mut chi2 = 0.0;
            for i in 0..vocab {
                let expected = want[i] * DRAWS as f64;
                if want[i] == 0.0 {
                    assert_eq!(counts[i], 0, "case {case}: token {i} was drawn but should be filtered out ({params:?})");
                } else {
                    chi2 += (counts[i] as f64 - expected).powi(2) / expected;
                }
            }
            let dof = (want.iter().filter(|&&p| p > 0.0).count() as f64 - 1.0).max(1.0);
            assert!(chi2 < dof + 6.0 * (2.0 * dof).sqrt(), "case {case}: chi-square {chi2} over {dof} degrees of freedom ({params:?})");
            checked += 1;
        }
        assert!(checked >= 6, "too many cases skipped as too close to call: {checked} checked");
    }

    #[test]
    fn speculative_verification_keeps_the_target_distribution() {
        let mut g = Gen::new(8);
        const DRAWS: usize = 20_000;
        let mut checked = 0;
        for case in 0..8 {
            let vocab = 2 + g.below(12);
            let logits = g.logits(vocab);
            let params = random_params(&mut g, vocab);
            let Some(want) = reference(&logits, &params) else { continue };
            // A draft distribution unlike the target's (half the cases a
            // deterministic proposal of a fixed token, as prompt lookup makes).
            let deterministic = case % 2 == 0;
            let q: Vec<(u32, f64)> = {
                let w: Vec<f64> = (0..vocab).map(|_| g.uniform() + 0.05).collect();
                let sum: f64 = w.iter().sum();
                w.iter().enumerate().map(|(t, x)| (t as u32, x / sum)).collect()
            };
            let history = History::new(&[]);
            let mut counts = vec![0usize; vocab];
            let mut accepted = 0;
            for seed in 0..DRAWS as u64 {
                let mut sampler = Sampler::new(SamplingParams { seed: Some(seed), ..params.clone() }, vocab, 0).unwrap();
                let (draft, dist) = if deterministic { ((case % vocab) as u32, None) } else { (invert(&q, g.uniform()), Some(&q[..])) };
                let (s, ok) = sampler.verify(&logits, &history, draft, dist).unwrap();
                counts[s.token as usize] += 1;
                accepted += ok as usize;
            }
            let mut chi2 = 0.0;
            for i in 0..vocab {
                let expected = want[i] * DRAWS as f64;
                if want[i] == 0.0 {
                    assert_eq!(counts[i], 0, "case {case}: token {i} came out but the target gives it no probability");
                } else {
                    chi2 += (counts[i] as f64 - expected).powi(2) / expected;
                }
            }
            let dof = (want.iter().filter(|&&p| p > 0.0).count() as f64 - 1.0).max(1.0);
            assert!(chi2 < dof + 6.0 * (2.0 * dof).sqrt(), "case {case}: chi-square {chi2} over {dof} degrees of freedom");
            // The acceptance rate is Σ min(p, q) (one for a deterministic draft: p of it).
            let rate: f64 = if deterministic { want[case % vocab] } else { (0..vocab).map(|i| want[i].min(q[i].1)).sum() };
            let got = accepted as f64 / DRAWS as f64;
            assert!((got - rate).abs() < 6.0 * (rate * (1.0 - rate) / DRAWS as f64).sqrt() + 1e-9, "case {case}: accepted {got}, expected {rate}");
            checked += 1;
        }
        assert!(checked >= 6, "{checked} cases checked");
    }

    #[test]
    fn greedy_verification_accepts_exactly_the_argmax() {
        let mut g = Gen::new(9);
        for _ in 0..200 {
            let vocab = 2 + g.below(30);
            let logits = g.logits(vocab);
            let mut s = Sampler::new(SamplingParams::greedy(), vocab, 0).unwrap();
            let best = s.sample(&logits, &History::new(&[])).unwrap().token;
            let draft = g.below(vocab) as u32;
            let (out, ok) = s.verify(&logits, &History::new(&[]), draft, None).unwrap();
            assert_eq!((out.token, ok), (best, draft == best));
        }
    }

    #[test]
    fn the_same_seed_repeats_and_another_seed_differs() {
        let mut g = Gen::new(7);
        let vocab = 50;
        let steps: Vec<Vec<f32>> = (0..32).map(|_| g.logits(vocab)).collect();
        let run = |seed: u64, default_seed: u64| {
            let params = SamplingParams { seed: Some(seed), temperature: 1.5, ..SamplingParams::default() };
            let mut sampler = Sampler::new(params, vocab, default_seed).unwrap();
            let mut history = History::new(&[1, 2, 3]);
            for logits in &steps {
                let token = sampler.sample(logits, &history).unwrap().token;
                history.push(token);
            }
            history.generated().to_vec()
        };
        assert_eq!(run(11, 0), run(11, 99), "a request's seed wins over the default seed");
        assert_ne!(run(11, 0), run(12, 0));
        // Interleaving with another request's sampling does not change a request's draws.
        let params = SamplingParams { seed: Some(11), temperature: 1.5, ..SamplingParams::default() };
        let (mut a, mut b) = (Sampler::new(params.clone(), vocab, 0).unwrap(), Sampler::new(params, vocab, 0).unwrap());
        let mut other = Sampler::new(SamplingParams { seed: Some(5), ..SamplingParams::default() }, vocab, 0).unwrap();
        let history = History::new(&[]);
        for logits in &steps {
            other.sample(logits, &history).unwrap();
            assert_eq!(a.sample(logits, &history).unwrap(), b.sample(logits, &history).unwrap());
        }
        // Unseeded requests take the default seed.
        let unseeded = |default_seed| {
            let mut s = Sampler::new(SamplingParams::default(), vocab, default_seed).unwrap();
            (0..8).map(|i| s.sample(&steps[i], &history).unwrap().token).collect::<Vec<_>>()
        };
        assert_eq!(unseeded(3), unseeded(3));
    }

    #[test]
    fn logprobs_are_the_tempered_log_softmax_and_the_top_list_is_ranked() {
        let mut g = Gen::new(8);
        for _ in 0..200 {
            let vocab = 1 + g.below(40);
            let logits = g.logits(vocab);
            let n = g.below(crate::sampling::MAX_LOGPROBS + 1);
            let greedy = g.below(2) == 0;
            let params = SamplingParams { temperature: if greedy { 0.0 } else { 0.7 }, logprobs: Some(n), seed: Some(1), ..SamplingParams::default() };
            let t = if greedy { 1.0 } else { 0.7f32 as f64 };
            let lse = logits.iter().map(|&l| (f64::from(l) / t).exp()).sum::<f64>().ln();
            let lp = |i: usize| (f64::from(logits[i]) / t - lse) as f32;
            let got = Sampler::new(params, vocab, 0).unwrap().sample(&logits, &History::new(&[])).unwrap();
            assert!((got.logprob - lp(got.token as usize)).abs() < 1e-4);
            let finite = logits.iter().filter(|l| l.is_finite()).count();
            assert_eq!(got.top.len(), n.min(finite));
            for w in got.top.windows(2) {
                assert!(w[0].1 > w[1].1 || (w[0].1 == w[1].1 && w[0].0 < w[1].0), "{:?}", got.top);
            }
            for &(t, l) in &got.top {
                assert!((l - lp(t as usize)).abs() < 1e-4);
            }
            // Nothing left out of the list is more likely than the least in it.
            if let Some(&(_, last)) = got.top.last() {
                assert!((0..vocab).filter(|&i| !got.top.iter().any(|&(t, _)| t as usize == i)).all(|i| lp(i) <= last + 1e-6));
            }
        }
    }

    #[test]
    fn bad_logits_are_errors_that_say_what_is_wrong() {
        let mut sampler = Sampler::new(SamplingParams::default(), 4, 0).unwrap();
        let history = History::new(&[]);
        for (logits, says) in [
            (vec![0.0, f32::NAN, 1.0, 2.0], "NaN"),
            (vec![0.0, f32::INFINITY, 1.0, 2.0], "inf"),
            (vec![f32::NEG_INFINITY; 4], "masked"),
            (vec![0.0; 3], "vocabulary of 4"),
        ] {
            let err = sampler.sample(&logits, &history).expect_err("should fail").to_string();
            assert!(err.contains(says), "`{err}` should mention `{says}`");
        }
        // Masked tokens are never chosen.
        for seed in 0..200 {
            let mut s = Sampler::new(SamplingParams { seed: Some(seed), ..SamplingParams::default() }, 4, 0).unwrap();
            let token = s.sample(&[f32::NEG_INFINITY, 0.0, f32::NEG_INFINITY, 0.0], &history).unwrap().token;
            assert!(token == 1 || token == 3);
        }
    }

    #[test]
    fn penalties_come_before_temperature_and_greedy() {
        // Token 0 leads by a little, but was generated: the frequency penalty hands
        // the argmax to token 1, and a repetition penalty on a negative logit pushes
        // token 2 further down.
        let logits = [2.0, 1.9, -0.5];
        let mut history = History::new(&[2]);
        history.push(0);
        let params = SamplingParams { frequency_penalty: 0.5, repetition_penalty: 2.0, logprobs: Some(3), ..SamplingParams::greedy() };
        let got = Sampler::new(params, 3, 0).unwrap().sample(&logits, &history).unwrap();
        assert_eq!(got.token, 1);
        let penalised = [2.0f64 / 2.0 - 0.5, 1.9f32 as f64, -0.5 * 2.0];
        let lse = penalised.iter().map(|z| z.exp()).sum::<f64>().ln();
        assert!((got.logprob as f64 - (penalised[1] - lse)).abs() < 1e-6);
        assert_eq!(got.top.iter().map(|&(t, _)| t).collect::<Vec<_>>(), [1, 0, 2]);
    }
}
