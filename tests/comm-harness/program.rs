//! Generated programs of collectives: the same calls on every rank, drawn
//! from a seed, and each rank's inputs to them.

use tessera_core::{DType, Device, Init, RngKey, Tensor};

/// One call of a generated program, the same on every rank. An all-to-all
/// sends `rows[from][to]` rows of two `f32` from rank `from` to rank `to`; a
/// send-receive is a ring: every rank sends `len` `bf16` to the next and
/// receives from the previous.
#[derive(Clone, Debug)]
pub enum Call {
    AllReduce { dims: Vec<usize>, dtype: DType, asynchronous: bool },
    AllGather { dims: Vec<usize>, dim: usize, dtype: DType, asynchronous: bool },
    ReduceScatter { dims: Vec<usize>, dim: usize, dtype: DType, asynchronous: bool },
    Broadcast { dims: Vec<usize>, root: usize, dtype: DType },
    AllToAll { rows: Vec<Vec<usize>> },
    SendRecv { len: usize },
    Barrier,
}

impl Call {
    /// Whether the call adds the ranks' inputs, so that its result depends
    /// on the order of the additions.
    pub fn sums(&self) -> bool {
        matches!(self, Call::AllReduce { .. } | Call::ReduceScatter { .. })
    }
}

/// What the programs of a test are drawn from. The knobs are where the
/// communicators' tests differ; each draws from the random stream only when
/// it is on, so that a seed gives a test the same program whatever the other
/// tests draw.
#[derive(Clone, Copy, Debug)]
pub struct ProgramSpace {
    /// The dtypes of the collectives' tensors.
    pub dtypes: &'static [DType],
    /// Whether an all-gather may be asynchronous, as the other collectives may.
    pub async_all_gather: bool,
    /// Whether one call in eight is large enough to take several rounds of
    /// a shared-memory staging half (a megabyte), or, for messages, to
    /// overflow a ring into a file of its own.
    pub large_calls: bool,
}

impl ProgramSpace {
    /// The program of `calls` calls for `n` ranks that `seed` picks.
    pub fn generate(&self, seed: u64, n: usize, calls: usize) -> Vec<Call> {
        let mut g = Xorshift(seed);
        (0..calls)
            .map(|_| {
                let dtype = self.dtypes[g.below(self.dtypes.len())];
                let large = self.large_calls && g.below(8) == 0;
                let ndims = 1 + g.below(3);
                let mut dims: Vec<usize> = (0..ndims).map(|_| 1 + g.below(9)).collect();
                if large {
                    // 2 to 4 rounds of a 1 MiB half for every dtype (a few
                    // hundred thousand elements).
                    dims = vec![1 + g.below(3), 150_000 + g.below(150_000)];
                }
                match g.below(7) {
                    0 => Call::AllReduce { dims, dtype, asynchronous: g.below(2) == 0 },
                    1 => {
                        let dim = g.below(dims.len());
                        Call::AllGather { dims, dim, dtype, asynchronous: self.async_all_gather && g.below(2) == 0 }
                    }
                    2 => {
                        let dim = g.below(dims.len());
                        dims[dim] *= n;
                        Call::ReduceScatter { dims, dim, dtype, asynchronous: g.below(2) == 0 }
                    }
                    3 => Call::Broadcast { dims, root: g.below(n), dtype },
                    4 => {
                        let most = if large { 200_000 } else { 5 };
                        Call::AllToAll { rows: (0..n).map(|_| (0..n).map(|_| g.below(most)).collect()).collect() }
                    }
                    5 => Call::SendRecv { len: if large { 300_000 + g.below(100_000) } else { 1 + g.below(300) } },
                    _ => Call::Barrier,
                }
            })
            .collect()
    }
}

/// A deterministic generator of test cases (xorshift64).
struct Xorshift(u64);

impl Xorshift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Rank `rank`'s input of call `i`: uniform in `[-3, 3)` for floats, and a
/// pattern of `[-500, 500)` (`[0, 1000)` unsigned) for integers, whose sums
/// are exact and cannot overflow.
pub fn input(rank: usize, i: usize, dims: &[usize], dtype: DType, dev: &Device) -> Tensor {
    // In i64: a large tensor's element index times 7919 overflows i32.
    let pattern = |j: usize| (j as i64 * 7919 + rank as i64 * 31 + i as i64) % 1000;
    let len: usize = dims.iter().product();
    match dtype {
        DType::I32 => Tensor::from_vec((0..len).map(|j| (pattern(j) - 500) as i32).collect::<Vec<_>>(), dims, dev),
        DType::U32 => Tensor::from_vec((0..len).map(|j| pattern(j) as u32).collect::<Vec<_>>(), dims, dev),
        _ => Tensor::rand(Init::Uniform { lo: -3.0, hi: 3.0 }, RngKey::new(77 + rank as u64, i as u64), dims, dtype, dev),
    }
    .unwrap()
}
