//! Where a rank's tokens sit in the global sequence under context
//! parallelism (see [`ContextSplit`]).

use tessera_core::tensor::Tensor;
use tessera_core::{Error, Result};

/// Tokens of a rank that are consecutive in the global sequence: `len`
/// tokens from local index `local`, at global positions from `global`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenRun {
    /// The first token's index in the rank's local sequence.
    pub local: usize,
    /// The first token's position in the global sequence.
    pub global: usize,
    /// Number of tokens.
    pub len: usize,
}

impl TokenRun {
    /// The run's global positions.
    pub fn positions(&self) -> impl Iterator<Item = u32> {
        (self.global..self.global + self.len).map(|p| p as u32)
    }
}

/// The load-balanced ("zigzag") split of every sequence over `size`
/// context-parallel ranks, seen from rank `rank`.
///
/// Causal attention gives a token work in proportion to its position, so
/// handing rank `r` the `r`-th contiguous slice would leave the last rank
/// `2·cp − 1` times the first's work. Instead the sequence is cut into
/// `2·cp` equal chunks and rank `r` holds chunks `r` and `2·cp − 1 − r`: an
/// early chunk and its mirror, which together cost every rank the same. It
/// is the split Megatron-LM's and Transformer Engine's context parallelism
/// use.
///
/// ```
/// use tessera::module::ContextSplit;
///
/// // 16 tokens over 2 ranks: chunks of 4; rank 0 holds 0..4 and 12..16.
/// let split = ContextSplit::new(0, 2)?;
/// assert_eq!(split.positions(8)?, [0, 1, 2, 3, 12, 13, 14, 15]);
/// assert_eq!(ContextSplit::new(1, 2)?.positions(8)?, [4, 5, 6, 7, 8, 9, 10, 11]);
/// # Ok::<(), tessera::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ContextSplit {
    rank: usize,
    size: usize,
}

impl ContextSplit {
    /// Rank `rank` of a context-parallel group of `size` ranks.
    pub fn new(rank: usize, size: usize) -> Result<ContextSplit> {
        if size == 0 || rank >= size {
            return Err(Error::invalid("ContextSplit::new", format!("rank {rank} of a context-parallel group of {size}; the rank must be below the size")));
        }
        Ok(ContextSplit { rank, size })
    }

    /// This rank's index in the ring.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks the sequence is split over.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Whether the sequence is split (more than one rank).
    pub fn is_split(&self) -> bool {
        self.size > 1
    }

    /// Tokens per chunk for a rank holding `local_len` tokens: half of them
    /// (each rank holds two chunks), or all of them without a split.
    pub fn chunk(&self, local_len: usize) -> Result<usize> {
        if !self.is_split() {
            return Ok(local_len);
        }
        if !local_len.is_multiple_of(2) {
            return Err(Error::indivisible(
                "context parallelism",
                format!(
                    "a rank holds {local_len} tokens of each sequence, which is not two equal chunks; use sequences whose length divides by 2 · cp = {}",
                    2 * self.size
                ),
            ));
        }
        Ok(local_len / 2)
    }

    /// The global chunk index of this rank's first and second chunk.
    pub fn chunks(&self) -> [usize; 2] {
        [self.rank, 2 * self.size - 1 - self.rank]
    }

    /// The runs of a rank's `local_len` tokens (its whole share): two
    /// chunks, or one run without a split.
    pub fn runs(&self, local_len: usize) -> Result<Vec<TokenRun>> {
        let c = self.chunk(local_len)?;
        if !self.is_split() {
            return Ok(vec![TokenRun { local: 0, global: 0, len: local_len }]);
        }
        Ok(self.chunks().iter().enumerate().map(|(i, &chunk)| TokenRun { local: i * c, global: chunk * c, len: c }).collect())
    }

    /// The runs of the `len` local tokens from local index `start` of a rank
    /// that holds `local_len` in all (a sequence-parallel slice of its share).
    pub fn window(&self, local_len: usize, start: usize, len: usize) -> Result<Vec<TokenRun>> {
        let end = start + len;
        if end > local_len {
            return Err(Error::shape("ContextSplit::window", format!("tokens {start}..{end} of a rank that holds {local_len}")));
        }
        let runs = self.runs(local_len)?;
        Ok(runs
            .into_iter()
            .filter_map(|r| {
                let (from, to) = (r.local.max(start), (r.local + r.len).min(end));
                (from < to).then(|| TokenRun { local: from - start, global: r.global + (from - r.local), len: to - from })
            })
            .collect())
    }

    /// The global position of each of a rank's `local_len` tokens.
    pub fn positions(&self, local_len: usize) -> Result<Vec<u32>> {
        Ok(self.runs(local_len)?.iter().flat_map(TokenRun::positions).collect())
    }

    /// This rank's share of `x` along dimension `dim`, which holds whole
    /// sequences (`global_len` tokens, divisible by `2·size`): its two
    /// chunks, concatenated. The trainer cuts each batch's tokens and
    /// targets with it.
    pub fn local_of(&self, x: &Tensor, dim: usize) -> Result<Tensor> {
        let global_len = x.shape().dim("ContextSplit::local_of", dim)?;
        if !self.is_split() {
            return Ok(x.clone());
        }
        if !global_len.is_multiple_of(2 * self.size) {
            return Err(Error::indivisible(
                "context parallelism",
                format!(
                    "sequences of {global_len} tokens cannot be cut into 2 · cp = {} equal chunks; use a sequence length that divides by {}",
                    2 * self.size,
                    2 * self.size
                ),
            ));
        }
        let c = global_len / (2 * self.size);
        let parts: Vec<Tensor> = self.chunks().iter().map(|&k| x.narrow(dim, k * c, c)).collect::<Result<_>>()?;
        Tensor::concat(&parts.iter().collect::<Vec<_>>(), dim)
    }

    /// The inverse of [`local_of`](Self::local_of) over a whole group: the
    /// global tensor from every rank's share, in rank order.
    pub fn global_of(shares: &[Tensor], dim: usize) -> Result<Tensor> {
        let size = shares.len();
        let Some(first) = shares.first() else {
            return Err(Error::invalid("ContextSplit::global_of", "no shares given; pass one per rank of the group"));
        };
        if size == 1 {
            return Ok(first.clone());
        }
        let c = ContextSplit::new(0, size)?.chunk(first.shape().dim("ContextSplit::global_of", dim)?)?;
        let mut chunks: Vec<Option<Tensor>> = vec![None; 2 * size];
        for (rank, share) in shares.iter().enumerate() {
            for (i, &k) in ContextSplit::new(rank, size)?.chunks().iter().enumerate() {
                chunks[k] = Some(share.narrow(dim, i * c, c)?);
            }
        }
        let parts: Vec<Tensor> = chunks.into_iter().flatten().collect();
        Tensor::concat(&parts.iter().collect::<Vec<_>>(), dim)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_core::Device;

    #[test]
    fn every_position_is_held_once_and_every_rank_holds_equal_causal_work() {
        for size in 1..=5 {
            for c in 1..=3 {
                let local = if size > 1 { 2 * c } else { c };
                let mut seen = vec![0; local * size];
                let mut work = Vec::new();
                for rank in 0..size {
                    let positions = ContextSplit::new(rank, size).unwrap().positions(local).unwrap();
                    for &p in &positions {
                        seen[p as usize] += 1;
                    }
                    // A causal query at position p attends p + 1 keys.
                    work.push(positions.iter().map(|&p| p as usize + 1).sum::<usize>());
                }
                assert!(seen.iter().all(|&n| n == 1), "size {size}, chunk {c}: {seen:?}");
                assert!(work.iter().all(|&w| w == work[0]), "size {size}, chunk {c}: {work:?}");
            }
        }
    }

    #[test]
    fn windows_are_the_runs_cut_to_a_slice() {
        let split = ContextSplit::new(1, 3).unwrap(); // chunks 1 and 4 of 6
        assert_eq!(split.runs(4).unwrap(), [TokenRun { local: 0, global: 2, len: 2 }, TokenRun { local: 2, global: 8, len: 2 }]);
        assert_eq!(split.window(4, 1, 2).unwrap(), [TokenRun { local: 0, global: 3, len: 1 }, TokenRun { local: 1, global: 8, len: 1 }]);
        assert_eq!(split.window(4, 2, 2).unwrap(), [TokenRun { local: 0, global: 8, len: 2 }]);
        assert!(split.window(4, 3, 2).is_err());
        assert!(split.runs(5).unwrap_err().to_string().contains("2 · cp = 6"));
    }

    #[test]
    fn shares_put_back_together_are_the_global_tensor() {
        let dev = Device::cpu();
        let x = Tensor::from_vec((0..2 * 24).map(|v| v as f32).collect(), [2, 24], &dev).unwrap();
        for size in [1, 2, 3, 4, 6] {
            let shares: Vec<Tensor> = (0..size).map(|r| ContextSplit::new(r, size).unwrap().local_of(&x, 1).unwrap()).collect();
            assert_eq!(ContextSplit::global_of(&shares, 1).unwrap().to_f32_vec().unwrap(), x.to_f32_vec().unwrap(), "size {size}");
        }
        let err = ContextSplit::new(0, 5).unwrap().local_of(&x, 1).unwrap_err().to_string();
        assert!(err.contains("divides by 10"), "{err}");
    }
}
