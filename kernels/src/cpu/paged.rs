//! Attention over a paged key/value cache: one call serves the decode tokens
//! and the prefill chunks of many sequences at once.
//!
//! The cache of one attention layer is two buffers, keys and values, each
//! `[slots, kv_heads, head_dim]`; a slot is one token's place, and slots come
//! in blocks of `block_size` (slot `b·block_size + i` is row `i` of block `b`).
//! Each sequence owns a list of blocks, its *block table*: the key of its
//! position `p` lives in slot `table[p / block_size]·block_size + p % block_size`.
//!
//! A step's tokens arrive flattened: token `t` belongs to sequence
//! `token_seq[t]` and sits at position `positions[t]` of it. Its key and
//! value are first written to its slot ([`kv_cache_write`]); then its query
//! attends every position `0..=positions[t]` of its sequence through the
//! block table ([`paged_attention`]), so a prefill chunk, a decode token, and
//! a chunk that follows an earlier chunk are one and the same computation.
//!
//! Every (token, head) output is computed alone, in an order fixed by its
//! position and the block size (keys block by block, an online softmax per
//! block): it does not depend on which other tokens share the call, how the
//! prompt was chunked, or the number of threads. That is what lets a served
//! request give the same bits alone or in a batch.

use super::exp::exp;
use super::mixed::Stored;
use crate::Real;
use rayon::prelude::*;

/// Sizes of one paged attention call.
///
/// Layouts (contiguous, row-major):
///   qkv: `[tokens, kv_heads, group + 2, head_dim]`, per token and kv head its
///        `group = q_heads / kv_heads` query heads, its key, its value (the
///        packed layout of a fused projection);
///   k_cache, v_cache: `[slots, kv_heads, head_dim]`;
///   block_tables: `[seqs, table_width]` block indices (unused entries are ignored);
///   out: `[tokens, q_heads, head_dim]`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PagedDims {
    /// Query tokens of the call, over all sequences.
    pub tokens: usize,
    /// Query heads.
    pub q_heads: usize,
    /// Key/value heads; divides `q_heads`.
    pub kv_heads: usize,
    /// Features per head.
    pub head_dim: usize,
    /// Token slots of a cache block.
    pub block_size: usize,
    /// Slots of each cache buffer (blocks × `block_size`).
    pub slots: usize,
    /// Sequences (rows of the block table).
    pub seqs: usize,
    /// Entries per row of the block table.
    pub table_width: usize,
    /// Multiplier of the raw scores `q·k` (usually `1/√head_dim`).
    pub scale: f64,
}

impl PagedDims {
    /// Elements of `qkv`.
    pub fn qkv_len(&self) -> usize {
        self.tokens * (self.q_heads + 2 * self.kv_heads) * self.head_dim
    }

    /// Elements of each cache buffer.
    pub fn cache_len(&self) -> usize {
        self.slots * self.kv_heads * self.head_dim
    }

    /// Elements of `out`.
    pub fn out_len(&self) -> usize {
        self.tokens * self.q_heads * self.head_dim
    }

    /// Query heads per kv head.
    pub fn group(&self) -> usize {
        self.q_heads / self.kv_heads
    }

    /// Elements of one token's packed row.
    fn packed_row(&self) -> usize {
        (self.q_heads + 2 * self.kv_heads) * self.head_dim
    }

    /// Offset in `qkv` of token `t`'s kv group `g` (its first query head).
    fn group_at(&self, t: usize, g: usize) -> usize {
        t * self.packed_row() + g * (self.group() + 2) * self.head_dim
    }

    /// Offset in a cache buffer of kv head `g` at `slot`.
    fn cache_at(&self, slot: usize, g: usize) -> usize {
        (slot * self.kv_heads + g) * self.head_dim
    }

    #[track_caller]
    fn check(&self) {
        assert!(self.kv_heads > 0 && self.head_dim > 0 && self.block_size > 0, "paged attention: empty heads or blocks");
        assert!(self.q_heads.is_multiple_of(self.kv_heads), "paged attention: q_heads {} is not a multiple of kv_heads {}", self.q_heads, self.kv_heads);
        assert!(self.scale.is_finite(), "paged attention: scale must be finite");
    }
}

/// Writes each token's key and value (read from the packed `qkv`) into slot
/// `slots[t]` of `k_cache` and `v_cache`. Slots must be distinct and below
/// `d.slots` (the caller checks; a bad one panics here).
pub fn kv_cache_write<S: Copy + Send + Sync>(d: &PagedDims, qkv: &[S], slots: &[u32], k_cache: &mut [S], v_cache: &mut [S]) {
    d.check();
    assert_eq!(qkv.len(), d.qkv_len(), "kv_cache_write: qkv length");
    assert_eq!(slots.len(), d.tokens, "kv_cache_write: one slot per token");
    assert_eq!((k_cache.len(), v_cache.len()), (d.cache_len(), d.cache_len()), "kv_cache_write: cache lengths");
    let (hd, r) = (d.head_dim, d.group());
    for (t, &slot) in slots.iter().enumerate() {
        let slot = slot as usize;
        assert!(slot < d.slots, "kv_cache_write: slot {slot} of {}", d.slots);
        for g in 0..d.kv_heads {
            let src = d.group_at(t, g) + r * hd;
            let dst = d.cache_at(slot, g);
            k_cache[dst..dst + hd].copy_from_slice(&qkv[src..src + hd]);
            v_cache[dst..dst + hd].copy_from_slice(&qkv[src + hd..src + 2 * hd]);
        }
    }
}

/// Below this many multiply-adds of `q·k` the call runs on the calling thread.
const PARALLEL_MIN_WORK: usize = 1 << 13;

/// `out[t, h] = softmax_j(scale · q[t,h]·k[j]) · v[j]` over the positions
/// `j = 0..=positions[t]` of sequence `token_seq[t]`, keys and values read
/// from the caches through that sequence's row of `block_tables` (layouts in
/// [`PagedDims`]). Computed in `T`, stored in `S`; see the module docs for
/// why the result of a token does not depend on the rest of the call.
///
/// The caller checks every index (sequence, position within the table's
/// width, block within the cache); a bad one panics here.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention<T: Real, S: Stored<T>>(
    d: &PagedDims,
    qkv: &[S],
    k_cache: &[S],
    v_cache: &[S],
    positions: &[u32],
    token_seq: &[u32],
    block_tables: &[u32],
    out: &mut [S],
) {
    d.check();
    assert_eq!(qkv.len(), d.qkv_len(), "paged_attention: qkv length");
    assert_eq!((k_cache.len(), v_cache.len()), (d.cache_len(), d.cache_len()), "paged_attention: cache lengths");
    assert_eq!((positions.len(), token_seq.len()), (d.tokens, d.tokens), "paged_attention: one position and sequence per token");
    assert_eq!(block_tables.len(), d.seqs * d.table_width, "paged_attention: block table length");
    assert_eq!(out.len(), d.out_len(), "paged_attention: out length");
    let (hd, r) = (d.head_dim, d.group());
    // One task per (token, kv head): its `r` query heads share every key and value read.
    let task = |(t, g): (usize, usize), out: &mut [S]| {
        let s = token_seq[t] as usize;
        assert!(s < d.seqs, "paged_attention: sequence {s} of {}", d.seqs);
        let table = &block_tables[s * d.table_width..(s + 1) * d.table_width];
        let q = &qkv[d.group_at(t, g)..d.group_at(t, g) + r * hd];
        attend_group(d, g, q, k_cache, v_cache, positions[t] as usize, table, out);
    };
    let work: usize = positions.iter().map(|&p| (p as usize + 1) * d.q_heads * hd).sum();
    // Each (token, kv head) owns the `r·hd` outputs of its query heads: consecutive chunks.
    let chunks = out.chunks_mut(r * hd).enumerate().map(|(i, o)| ((i / d.kv_heads, i % d.kv_heads), o));
    if work < PARALLEL_MIN_WORK {
        chunks.for_each(|(tg, o)| task(tg, o));
    } else {
        chunks.collect::<Vec<_>>().into_par_iter().for_each(|(tg, o)| task(tg, o));
    }
}

/// The `r` query heads `q` (`[r, hd]`) of kv head `g` attending positions
/// `0..=last` through `table`; writes `out` (`[r, hd]`).
#[allow(clippy::too_many_arguments)]
fn attend_group<T: Real, S: Stored<T>>(d: &PagedDims, g: usize, q: &[S], k_cache: &[S], v_cache: &[S], last: usize, table: &[u32], out: &mut [S]) {
    let (hd, r, bs) = (d.head_dim, d.group(), d.block_size);
    let blocks = last / bs + 1;
    assert!(blocks <= table.len(), "paged_attention: position {last} past a block table of {} blocks of {bs}", table.len());
    let scale = T::lit(d.scale);
    let q: Vec<T> = q.iter().map(|&x| x.load()).collect();
    let mut acc = vec![T::zero(); r * hd];
    let (mut max, mut sum) = (vec![T::neg_infinity(); r], vec![T::zero(); r]);
    let mut scores = vec![T::zero(); r * bs];
    let mut key = vec![T::zero(); hd];
    for (b, &block) in table[..blocks].iter().enumerate() {
        let block = block as usize;
        let n = (last + 1 - b * bs).min(bs);
        assert!((block + 1) * bs <= d.slots, "paged_attention: block {block} past a cache of {} slots", d.slots);
        for j in 0..n {
            let at = d.cache_at(block * bs + j, g);
            let k = row(&k_cache[at..at + hd], &mut key);
            for h in 0..r {
                scores[h * bs + j] = dot(&q[h * hd..(h + 1) * hd], k) * scale;
            }
        }
        // Online softmax, one rescale per block.
        for h in 0..r {
            let row = &mut scores[h * bs..h * bs + n];
            let block_max = row.iter().copied().fold(T::neg_infinity(), T::max);
            let new_max = max[h].max(block_max);
            let keep = if max[h] == T::neg_infinity() { T::zero() } else { exp(max[h] - new_max) };
            sum[h] *= keep;
            acc[h * hd..(h + 1) * hd].iter_mut().for_each(|a| *a *= keep);
            for p in row.iter_mut() {
                *p = exp(*p - new_max);
                sum[h] += *p;
            }
            max[h] = new_max;
        }
        for j in 0..n {
            let at = d.cache_at(block * bs + j, g);
            let v_row = row(&v_cache[at..at + hd], &mut key);
            for h in 0..r {
                let p = scores[h * bs + j];
                for (a, &v) in acc[h * hd..(h + 1) * hd].iter_mut().zip(v_row) {
                    *a += p * v;
                }
            }
        }
    }
    for h in 0..r {
        let inv = T::one() / sum[h];
        for (o, &a) in out[h * hd..(h + 1) * hd].iter_mut().zip(&acc[h * hd..(h + 1) * hd]) {
            *o = S::store(a * inv);
        }
    }
}

/// A cache row in the compute type: the row itself when stored so, else widened into `buf`.
fn row<'a, T: Real, S: Stored<T>>(src: &'a [S], buf: &'a mut [T]) -> &'a [T] {
    match S::as_compute(src) {
        Some(x) => x,
        None => {
            buf.iter_mut().zip(src).for_each(|(d, &s)| *d = s.load());
            buf
        }
    }
}

/// `a·b` in eight interleaved partial sums (so it vectorises), summed in a
/// fixed tree: the same bits for the same operands, always.
#[inline]
fn dot<T: Real>(a: &[T], b: &[T]) -> T {
    let mut lanes = [T::zero(); 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let (at, bt) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for l in 0..8 {
            lanes[l] += x[l] * y[l];
        }
    }
    for (l, (&x, &y)) in at.iter().zip(bt).enumerate() {
        lanes[l] += x * y;
    }
    ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]))
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::testing::rand_vec;

    /// `n` deterministic values in [-1, 1).
    fn values(n: usize, seed: u64) -> Vec<f64> {
        rand_vec(seed, n)
    }

    /// A random call: `lens[s]` tokens already cached per sequence, `new[s]`
    /// tokens in this call; blocks handed out in a shuffled order.
    struct Case {
        d: PagedDims,
        qkv: Vec<f64>,
        k: Vec<f64>,
        v: Vec<f64>,
        positions: Vec<u32>,
        token_seq: Vec<u32>,
        tables: Vec<u32>,
        slots: Vec<u32>,
    }

    fn case(lens: &[usize], new: &[usize], (q_heads, kv_heads, head_dim, block_size): (usize, usize, usize, usize), seed: u64) -> Case {
        let seqs = lens.len();
        let total: Vec<usize> = lens.iter().zip(new).map(|(a, b)| a + b).collect();
        let table_width = total.iter().map(|&n| n.div_ceil(block_size)).max().unwrap_or(0).max(1);
        let blocks = seqs * table_width + 3;
        // A permutation of the blocks, so tables are not in slot order.
        let mut order: Vec<u32> = (0..blocks as u32).collect();
        let noise = values(blocks, seed ^ 7);
        order.sort_by(|a, b| noise[*a as usize].total_cmp(&noise[*b as usize]));
        let tables: Vec<u32> = (0..seqs * table_width).map(|i| order[i]).collect();
        let mut positions = Vec::new();
        let mut token_seq = Vec::new();
        for s in 0..seqs {
            for p in lens[s]..total[s] {
                positions.push(p as u32);
                token_seq.push(s as u32);
            }
        }
        let tokens = positions.len();
        let d =
            PagedDims { tokens, q_heads, kv_heads, head_dim, block_size, slots: blocks * block_size, seqs, table_width, scale: 1.0 / (head_dim as f64).sqrt() };
        let slot = |s: usize, p: usize| tables[s * table_width + p / block_size] * block_size as u32 + (p % block_size) as u32;
        let slots = positions.iter().zip(&token_seq).map(|(&p, &s)| slot(s as usize, p as usize)).collect();
        let mut k = values(d.cache_len(), seed ^ 1);
        let mut v = values(d.cache_len(), seed ^ 2);
        // Slots no sequence owns hold NaN: reading one would show.
        let owned: std::collections::HashSet<u32> = (0..seqs).flat_map(|s| (0..total[s]).map(move |p| (s, p))).map(|(s, p)| slot(s, p)).collect();
        for sl in 0..d.slots as u32 {
            if !owned.contains(&sl) {
                let at = d.cache_at(sl as usize, 0);
                k[at..at + kv_heads * head_dim].fill(f64::NAN);
                v[at..at + kv_heads * head_dim].fill(f64::NAN);
            }
        }
        Case { qkv: values(d.qkv_len(), seed ^ 3), d, k, v, positions, token_seq, tables, slots }
    }

    /// The reference: for each token and head, the full score row, then softmax and the weighted sum.
    fn reference(c: &Case) -> Vec<f64> {
        let d = &c.d;
        let (hd, r, bs) = (d.head_dim, d.group(), d.block_size);
        let mut out = vec![0.0; d.out_len()];
        for t in 0..d.tokens {
            let s = c.token_seq[t] as usize;
            for h in 0..d.q_heads {
                let g = h / r;
                let q = &c.qkv[d.group_at(t, g) + (h % r) * hd..][..hd];
                let slots: Vec<usize> = (0..=c.positions[t] as usize).map(|p| c.tables[s * d.table_width + p / bs] as usize * bs + p % bs).collect();
                let scores: Vec<f64> =
                    slots.iter().map(|&sl| q.iter().zip(&c.k[d.cache_at(sl, g)..][..hd]).map(|(a, b)| a * b).sum::<f64>() * d.scale).collect();
                let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for (p, &sl) in e.iter().zip(&slots) {
                    for i in 0..hd {
                        out[(t * d.q_heads + h) * hd + i] += p / z * c.v[d.cache_at(sl, g) + i];
                    }
                }
            }
        }
        out
    }

    fn run_f32(c: &Case) -> Vec<f32> {
        let f = |x: &[f64]| x.iter().map(|&v| v as f32).collect::<Vec<f32>>();
        let (qkv, mut k, mut v) = (f(&c.qkv), f(&c.k), f(&c.v));
        kv_cache_write(&c.d, &qkv, &c.slots, &mut k, &mut v);
        let mut out = vec![0f32; c.d.out_len()];
        paged_attention::<f32, f32>(&c.d, &qkv, &k, &v, &c.positions, &c.token_seq, &c.tables, &mut out);
        out
    }

    #[test]
    fn matches_the_reference_on_random_batches_of_prefill_and_decode() {
        for seed in 0..24u64 {
            let pick = |n: usize, salt: u64| (values(1, seed * 31 + salt)[0].abs() * n as f64) as usize;
            let seqs = 1 + pick(5, 1);
            let lens: Vec<usize> = (0..seqs).map(|s| pick(40, 10 + s as u64)).collect();
            let new: Vec<usize> = (0..seqs).map(|s| 1 + pick(if s % 2 == 0 { 2 } else { 20 }, 20 + s as u64)).collect();
            let kv = [1, 2, 3][pick(3, 2)];
            let shape = (kv * [1, 2, 4][pick(3, 3)], kv, [1, 7, 8, 16, 33][pick(5, 4)], [1, 4, 16][pick(3, 5)]);
            let mut c = case(&lens, &new, shape, seed);
            // The written keys and values are what the reference must read.
            for (t, &sl) in c.slots.clone().iter().enumerate() {
                for g in 0..kv {
                    let (src, dst, hd) = (c.d.group_at(t, g) + c.d.group() * shape.2, c.d.cache_at(sl as usize, g), shape.2);
                    c.k.splice(dst..dst + hd, c.qkv[src..src + hd].to_vec());
                    c.v.splice(dst..dst + hd, c.qkv[src + hd..src + 2 * hd].to_vec());
                }
            }
            let want = reference(&c);
            let got = run_f32(&c);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!((*g as f64 - w).abs() < 2e-5 * (1.0 + w.abs()), "seed {seed} {shape:?} element {i}: {g} vs {w}");
            }
            let mut out64 = vec![0f64; c.d.out_len()];
            paged_attention::<f64, f64>(&c.d, &c.qkv, &c.k, &c.v, &c.positions, &c.token_seq, &c.tables, &mut out64);
            for (g, w) in out64.iter().zip(&want) {
                assert!((g - w).abs() < 1e-12 * (1.0 + w.abs()), "f64: {g} vs {w}");
            }
        }
    }

    #[test]
    fn a_token_gets_the_same_bits_alone_or_with_others() {
        let shape = (4, 2, 16, 4);
        let all = case(&[5, 0, 13], &[1, 9, 1], shape, 3);
        let batched = run_f32(&all);
        // Token 10 is the decode token of sequence 2 (after 1 + 9 tokens of the others).
        let t = 10;
        assert_eq!(all.token_seq[t], 2);
        let mut alone = Case {
            qkv: all.qkv.clone(),
            k: all.k.clone(),
            v: all.v.clone(),
            positions: all.positions.clone(),
            token_seq: all.token_seq.clone(),
            tables: all.tables.clone(),
            slots: all.slots.clone(),
            d: all.d,
        };
        let row = all.d.packed_row();
        alone.qkv = all.qkv[t * row..(t + 1) * row].to_vec();
        alone.positions = vec![all.positions[t]];
        alone.token_seq = vec![2];
        alone.slots = vec![all.slots[t]];
        alone.d.tokens = 1;
        // The other sequences' new keys are not written in the solo call; sequence 2 never reads them.
        let solo = run_f32(&alone);
        let w = all.d.q_heads * all.d.head_dim;
        assert_eq!(solo.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), batched[t * w..(t + 1) * w].iter().map(|x| x.to_bits()).collect::<Vec<_>>());
    }

    #[test]
    fn bf16_storage_matches_f32_on_the_rounded_values() {
        use half::bf16;
        let c = case(&[3, 17], &[6, 1], (6, 3, 8, 4), 11);
        let round = |x: &[f64]| x.iter().map(|&v| bf16::from_f64(v)).collect::<Vec<bf16>>();
        let (qkv, mut k, mut v) = (round(&c.qkv), round(&c.k), round(&c.v));
        kv_cache_write(&c.d, &qkv, &c.slots, &mut k, &mut v);
        let mut out = vec![bf16::ZERO; c.d.out_len()];
        paged_attention::<f32, bf16>(&c.d, &qkv, &k, &v, &c.positions, &c.token_seq, &c.tables, &mut out);
        let widen = |x: &[bf16]| x.iter().map(|v| v.to_f32()).collect::<Vec<f32>>();
        let (qkv32, k32, v32) = (widen(&qkv), widen(&k), widen(&v));
        let mut want = vec![0f32; c.d.out_len()];
        paged_attention::<f32, f32>(&c.d, &qkv32, &k32, &v32, &c.positions, &c.token_seq, &c.tables, &mut want);
        for (g, w) in out.iter().zip(&want) {
            assert_eq!(g.to_bits(), bf16::from_f32(*w).to_bits());
        }
    }
}
