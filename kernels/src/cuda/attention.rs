//! How to launch the fused attention kernels of `cuda/attention.cu`: the
//! argument struct, the grid, the block and the dynamic shared memory of each
//! kernel, derived from the CPU's [`AttnDims`] and a [`AttnLayout`].
//!
//! The CUDA source states the same rules (tile size, threads, shared memory
//! per head-dim width); the tests below tie the two together. Every kernel
//! traps if it is launched with a block or shared memory other than these.

use crate::cpu::attention::AttnDims;

/// Query rows and key rows per tile; one block owns one tile.
pub const TILE: usize = 64;
/// Threads of every attention block (the kernels check it).
pub const THREADS: u32 = 256;
/// The largest supported `head_dim`. A `head_dim` up to 64 runs the 64-wide
/// instantiation of each kernel, a larger one the 128-wide one.
pub const MAX_HEAD_DIM: usize = 128;
/// Dynamic shared memory a kernel gets without opting in
/// (`CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`).
pub const DEFAULT_SHARED_LIMIT: u32 = 48 * 1024;
/// The most dynamic shared memory one block may opt into on sm_90.
pub const SM90_SHARED_LIMIT: u32 = 227 * 1024;
/// Blocks of the grid-stride `delta` kernel at most (it has one warp per
/// query row; more blocks than this would only queue).
const DELTA_MAX_BLOCKS: usize = 4096;

/// Where the rows of one tensor live: row `t` of head `j` of kv group `g` in
/// batch `b` starts at `base + b·batch + g·group + j·head + t·row` elements,
/// and holds `head_dim` contiguous elements. Mirrors `struct AttnPlace` of
/// `attention.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnPlace {
    /// Offset of the tensor's first row.
    pub base: u64,
    /// Elements between batches.
    pub batch: u64,
    /// Elements between kv heads (groups of query heads).
    pub group: u64,
    /// Elements between the query heads of a group (0 for keys and values).
    pub head: u64,
    /// Elements between positions.
    pub row: u64,
}

impl AttnPlace {
    /// Element offset of position `t` of head `h` of batch `b`, where `h` is
    /// a query head read with `group_size` query heads per kv head (for keys
    /// and values: a kv head, with `group_size` 1).
    pub fn at(&self, group_size: u64, b: u64, h: u64, t: u64) -> u64 {
        self.base + b * self.batch + (h / group_size) * self.group + (h % group_size) * self.head + t * self.row
    }
}

/// The last argument of every attention kernel, passed by value. Mirrors
/// `struct AttnParams` of `attention.cu` field for field (216 bytes, 8-byte
/// aligned).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnParams {
    /// Queries and `dq`.
    pub q: AttnPlace,
    /// Keys and `dk`.
    pub k: AttnPlace,
    /// Values and `dv`.
    pub v: AttnPlace,
    /// The output and `dout`.
    pub o: AttnPlace,
    /// Independent sequences.
    pub batch: u64,
    /// Query heads.
    pub q_heads: u64,
    /// Key/value heads.
    pub kv_heads: u64,
    /// Query positions.
    pub seq_q: u64,
    /// Key/value positions.
    pub seq_kv: u64,
    /// Features per head, at most [`MAX_HEAD_DIM`].
    pub head_dim: u64,
    /// Multiplier of `q·k`.
    pub scale: f32,
    /// 1 for causal masking, 0 for none.
    pub causal: u32,
}

/// Which tensors the kernels read and write, as the CPU kernels accept them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnLayout {
    /// Separate contiguous tensors: `q`, `out` `[batch, q_heads, seq_q, hd]`,
    /// `k`, `v` `[batch, kv_heads, seq_kv, hd]`
    /// (as [`attention_forward`](crate::cpu::attention::attention_forward)).
    Heads,
    /// One `qkv` buffer `[batch, seq, kv_heads, group + 2, hd]` (per position
    /// and kv head: its query heads, its key, its value) and `out`
    /// `[batch, seq, q_heads, hd]`; self attention only (as
    /// [`attention_forward_packed`](crate::cpu::attention::attention_forward_packed)).
    Packed,
}

/// Why attention cannot be launched for the given sizes.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AttnLaunchError {
    /// `kv_heads` is zero.
    #[error("attention: kv_heads is 0; give at least one key/value head")]
    NoKvHeads,
    /// `q_heads` is not a multiple of `kv_heads`.
    #[error("attention: q_heads {q_heads} is not a multiple of kv_heads {kv_heads}; make each kv head serve the same number of query heads")]
    UnevenGroups {
        /// Query heads.
        q_heads: usize,
        /// Key/value heads.
        kv_heads: usize,
    },
    /// `head_dim` is zero or above [`MAX_HEAD_DIM`].
    #[error("attention: head_dim {head_dim} is not supported on CUDA; use 1..=128 (64 and 128 run without padding)")]
    HeadDim {
        /// The requested head dim.
        head_dim: usize,
    },
    /// The fused layout needs as many queries as keys.
    #[error("attention: the fused qkv layout needs seq_q == seq_kv, got {seq_q} and {seq_kv}; use separate q, k, v tensors")]
    PackedNeedsSelfAttention {
        /// Query positions.
        seq_q: usize,
        /// Key positions.
        seq_kv: usize,
    },
    /// `scale` is not finite in f32.
    #[error("attention: scale {scale} is not a finite f32")]
    Scale {
        /// The requested scale.
        scale: f64,
    },
    /// More blocks than a grid's x dimension holds (2³¹ − 1).
    #[error("attention: {blocks} blocks exceed the grid limit; split the batch")]
    TooManyBlocks {
        /// Blocks the launch would need.
        blocks: usize,
    },
}

/// One kernel launch: the kernel, a one-dimensional grid and block, and its
/// dynamic shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launch {
    /// The kernel source (an entry of [`SOURCES`](crate::cuda::SOURCES))
    /// that defines the kernel.
    pub source: &'static str,
    /// The op; the symbol is `{op}_{f32,bf16,f16}` after the element type.
    pub op: &'static str,
    /// The kernel's arguments in order; `params` is the [`AttnParams`] by value,
    /// `lse` and `delta` are f32 `[batch, q_heads, seq_q]` whatever the
    /// element type, every other argument a pointer to elements.
    pub args: &'static [&'static str],
    /// Blocks; 0 means there is nothing to compute and no launch to make.
    pub grid: u32,
    /// Threads per block.
    pub block: u32,
    /// Dynamic shared memory per block, in bytes.
    pub shared_bytes: u32,
}

impl Launch {
    /// Whether the kernel must be allowed more than 48 KiB of dynamic shared
    /// memory (`cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)`) first.
    pub fn needs_opt_in(&self) -> bool {
        self.shared_bytes > DEFAULT_SHARED_LIMIT
    }

    /// The kernel's symbol for an element type suffix (`f32`, `bf16`, `f16`).
    pub fn symbol(&self, dtype: &str) -> String {
        format!("{}_{dtype}", self.op)
    }
}

/// The three launches of the backward, in the order they must run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackwardLaunches {
    /// `delta = rowsum(dout ∘ out)` into an f32 `[batch, q_heads, seq_q]` buffer.
    pub delta: Launch,
    /// `dk` and `dv`: one block per (batch, kv head, kv tile).
    pub dkv: Launch,
    /// `dq`: one block per (batch, query head, query tile).
    pub dq: Launch,
}

/// `(head-dim-wide tiles, per-row f32 vectors)` of each kernel's shared
/// memory, beside its one 64 × 65 score tile; `attention.cu` passes the same
/// pairs to `attn_smem_bytes`.
const FWD_SHARED: (usize, usize) = (2, 0);
const DKV_SHARED: (usize, usize) = (4, 2);
const DQ_SHARED: (usize, usize) = (4, 0);

/// Head-dim width of the instantiation that serves `head_dim`.
fn width(head_dim: usize) -> usize {
    if head_dim <= 64 {
        64
    } else {
        128
    }
}

/// Bytes of `tiles` padded `[64][width + 1]` f32 tiles, one `[64][65]` score
/// tile and `vectors` f32 vectors of 64.
fn shared_bytes(width: usize, (tiles, vectors): (usize, usize)) -> u32 {
    (4 * (tiles * TILE * (width + 1) + TILE * (TILE + 1) + vectors * TILE)) as u32
}

pub(crate) fn blocks(n: usize) -> Result<u32, AttnLaunchError> {
    u32::try_from(n).ok().filter(|&b| b <= i32::MAX as u32).ok_or(AttnLaunchError::TooManyBlocks { blocks: n })
}

/// Checks `d` against what the kernels support and returns their argument
/// struct for `layout`.
pub fn params(d: &AttnDims, layout: AttnLayout) -> Result<AttnParams, AttnLaunchError> {
    if d.kv_heads == 0 {
        return Err(AttnLaunchError::NoKvHeads);
    }
    if !d.q_heads.is_multiple_of(d.kv_heads) {
        return Err(AttnLaunchError::UnevenGroups { q_heads: d.q_heads, kv_heads: d.kv_heads });
    }
    if d.head_dim == 0 || d.head_dim > MAX_HEAD_DIM {
        return Err(AttnLaunchError::HeadDim { head_dim: d.head_dim });
    }
    if !(d.scale as f32).is_finite() {
        return Err(AttnLaunchError::Scale { scale: d.scale });
    }
    let (hd, r) = (d.head_dim as u64, (d.q_heads / d.kv_heads) as u64);
    let (tq, tk, qh, kh) = (d.seq_q as u64, d.seq_kv as u64, d.q_heads as u64, d.kv_heads as u64);
    let (q, k, v, o) = match layout {
        AttnLayout::Heads => {
            let q = AttnPlace { base: 0, batch: qh * tq * hd, group: r * tq * hd, head: tq * hd, row: hd };
            let kv = AttnPlace { base: 0, batch: kh * tk * hd, group: tk * hd, head: 0, row: hd };
            (q, kv, kv, q)
        }
        AttnLayout::Packed => {
            if d.seq_q != d.seq_kv {
                return Err(AttnLaunchError::PackedNeedsSelfAttention { seq_q: d.seq_q, seq_kv: d.seq_kv });
            }
            let slots = kh * (r + 2) * hd;
            let q = AttnPlace { base: 0, batch: tq * slots, group: (r + 2) * hd, head: hd, row: slots };
            let k = AttnPlace { base: r * hd, head: 0, ..q };
            let v = AttnPlace { base: (r + 1) * hd, head: 0, ..q };
            let o = AttnPlace { base: 0, batch: tq * qh * hd, group: r * hd, head: hd, row: qh * hd };
            (q, k, v, o)
        }
    };
    Ok(AttnParams {
        q,
        k,
        v,
        o,
        batch: d.batch as u64,
        q_heads: qh,
        kv_heads: kh,
        seq_q: tq,
        seq_kv: tk,
        head_dim: hd,
        scale: d.scale as f32,
        causal: d.causal as u32,
    })
}

/// The forward: `out` and an f32 `lse` `[batch, q_heads, seq_q]`, one block
/// per (batch, query head, query tile).
pub fn forward(d: &AttnDims, layout: AttnLayout) -> Result<(AttnParams, Launch), AttnLaunchError> {
    let p = params(d, layout)?;
    Ok((p, fwd_launch(d, "attention", "attention_fwd", THREADS, shared_bytes(width(d.head_dim), FWD_SHARED))?))
}

/// The launch of a forward kernel `op` in `source`: one block of `block`
/// threads per query tile of every query head. Both kernel families share
/// the tiling and the arguments.
pub(crate) fn fwd_launch(d: &AttnDims, source: &'static str, op: &'static str, block: u32, shared_bytes: u32) -> Result<Launch, AttnLaunchError> {
    Ok(Launch { source, op, args: &["q", "k", "v", "out", "lse", "params"], grid: blocks(d.batch * d.q_heads * d.seq_q.div_ceil(TILE))?, block, shared_bytes })
}

/// The backward's three launches. The caller provides an f32 `delta` buffer
/// of `lse`'s size; `dq`, `dk`, `dv` are overwritten (in the fused layout
/// they are one buffer shaped like `qkv`).
pub fn backward(d: &AttnDims, layout: AttnLayout) -> Result<(AttnParams, BackwardLaunches), AttnLaunchError> {
    let p = params(d, layout)?;
    let w = width(d.head_dim);
    let rows = d.batch * d.q_heads * d.seq_q;
    let warps_per_block = THREADS as usize / 32;
    let launches = BackwardLaunches {
        delta: Launch {
            source: "attention",
            op: "attention_bwd_delta",
            args: &["out", "dout", "delta", "params"],
            grid: blocks(rows.div_ceil(warps_per_block).min(DELTA_MAX_BLOCKS))?,
            block: THREADS,
            shared_bytes: 0,
        },
        dkv: dkv_launch(d, "attention", "attention_bwd_dkv", THREADS, shared_bytes(w, DKV_SHARED))?,
        dq: dq_launch(d, "attention", "attention_bwd_dq", THREADS, shared_bytes(w, DQ_SHARED))?,
    };
    Ok((p, launches))
}

/// The launch of a backward's `dk` and `dv` kernel `op` in `source`: one
/// block of `block` threads per key tile of every kv head.
pub(crate) fn dkv_launch(d: &AttnDims, source: &'static str, op: &'static str, block: u32, shared_bytes: u32) -> Result<Launch, AttnLaunchError> {
    Ok(Launch {
        source,
        op,
        args: &["q", "k", "v", "dout", "lse", "delta", "dk", "dv", "params"],
        grid: blocks(d.batch * d.kv_heads * d.seq_kv.div_ceil(TILE))?,
        block,
        shared_bytes,
    })
}

/// The launch of a backward's `dq` kernel `op` in `source`: one block per
/// query tile of every query head.
pub(crate) fn dq_launch(d: &AttnDims, source: &'static str, op: &'static str, block: u32, shared_bytes: u32) -> Result<Launch, AttnLaunchError> {
    Ok(Launch {
        source,
        op,
        args: &["q", "k", "v", "dout", "lse", "delta", "dq", "params"],
        grid: blocks(d.batch * d.q_heads * d.seq_q.div_ceil(TILE))?,
        block,
        shared_bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::source;

    fn dims(batch: usize, q_heads: usize, kv_heads: usize, seq: usize, head_dim: usize) -> AttnDims {
        AttnDims { batch, q_heads, kv_heads, seq_q: seq, seq_kv: seq, head_dim, causal: true, scale: 0.125 }
    }

    #[test]
    fn grids_count_tiles_per_head() {
        // gpt-tiny-like: 2 sequences of 200 positions, 8 query heads on 2 kv heads.
        let d = dims(2, 8, 2, 200, 64);
        let (_, f) = forward(&d, AttnLayout::Heads).unwrap();
        assert_eq!((f.grid, f.block), (2 * 8 * 4, 256));
        let (_, b) = backward(&d, AttnLayout::Heads).unwrap();
        assert_eq!(b.dkv.grid, 2 * 2 * 4);
        assert_eq!(b.dq.grid, 2 * 8 * 4);
        assert_eq!(b.delta.grid, (2 * 8 * 200usize).div_ceil(8) as u32);
        // A KV cache: 1 query over 300 keys.
        let d = AttnDims { seq_q: 1, seq_kv: 300, ..d };
        let (_, b) = backward(&d, AttnLayout::Heads).unwrap();
        assert_eq!((b.dq.grid, b.dkv.grid), (2 * 8, 2 * 2 * 5));
        // Nothing to compute: an empty grid, which the caller skips.
        let d = AttnDims { seq_q: 0, seq_kv: 0, ..d };
        assert_eq!(forward(&d, AttnLayout::Heads).unwrap().1.grid, 0);
    }

    #[test]
    fn shared_memory_fits_sm90_and_says_when_it_needs_opt_in() {
        let bytes = |hd| {
            let d = dims(1, 4, 4, 128, hd);
            let (_, f) = forward(&d, AttnLayout::Heads).unwrap();
            let (_, b) = backward(&d, AttnLayout::Heads).unwrap();
            [f, b.delta, b.dkv, b.dq]
        };
        let [f, delta, dkv, dq] = bytes(64);
        assert_eq!((f.shared_bytes, dkv.shared_bytes, dq.shared_bytes), (49_920, 83_712, 83_200));
        assert!(!delta.needs_opt_in() && delta.shared_bytes == 0);
        let [f, _, dkv, dq] = bytes(128);
        assert_eq!((f.shared_bytes, dkv.shared_bytes, dq.shared_bytes), (82_688, 149_248, 148_736));
        for hd in [1, 32, 64, 65, 96, 128] {
            for l in bytes(hd) {
                assert!(l.shared_bytes <= SM90_SHARED_LIMIT, "{} at head_dim {hd}: {} bytes", l.op, l.shared_bytes);
                assert_eq!(l.needs_opt_in(), l.shared_bytes > 48 * 1024);
                assert_eq!(l.block, THREADS);
            }
        }
        // A head_dim of 32 runs the 64-wide instantiation.
        assert_eq!(bytes(32)[0].shared_bytes, 49_920);
    }

    #[test]
    fn bad_sizes_are_errors_that_name_the_fix() {
        let d = dims(1, 6, 4, 16, 64);
        let e = forward(&d, AttnLayout::Heads).unwrap_err();
        assert_eq!(e, AttnLaunchError::UnevenGroups { q_heads: 6, kv_heads: 4 });
        assert!(e.to_string().contains("multiple of kv_heads"));
        assert_eq!(forward(&dims(1, 4, 0, 16, 64), AttnLayout::Heads).unwrap_err(), AttnLaunchError::NoKvHeads);
        for hd in [0, 129, 256] {
            assert_eq!(backward(&dims(1, 4, 4, 16, hd), AttnLayout::Heads).unwrap_err(), AttnLaunchError::HeadDim { head_dim: hd });
        }
        let d = AttnDims { seq_kv: 32, ..dims(1, 4, 4, 16, 64) };
        assert!(forward(&d, AttnLayout::Heads).is_ok());
        assert_eq!(forward(&d, AttnLayout::Packed).unwrap_err(), AttnLaunchError::PackedNeedsSelfAttention { seq_q: 16, seq_kv: 32 });
        let d = AttnDims { scale: 1e300, ..dims(1, 4, 4, 16, 64) };
        assert!(matches!(forward(&d, AttnLayout::Heads), Err(AttnLaunchError::Scale { .. })));
        let d = dims(1 << 20, 64, 64, 4096, 64);
        assert!(matches!(forward(&d, AttnLayout::Heads), Err(AttnLaunchError::TooManyBlocks { .. })));
    }

    /// Every (tensor, batch, head, position, feature) of a layout, as the
    /// element offset its place gives.
    fn offsets(d: &AttnDims, p: &AttnParams) -> Vec<u64> {
        let (r, hd) = ((d.q_heads / d.kv_heads) as u64, d.head_dim as u64);
        let mut all = Vec::new();
        for b in 0..d.batch as u64 {
            for h in 0..d.q_heads as u64 {
                for t in 0..d.seq_q as u64 {
                    all.extend((0..hd).map(|e| p.q.at(r, b, h, t) + e));
                }
            }
            for g in 0..d.kv_heads as u64 {
                for t in 0..d.seq_kv as u64 {
                    all.extend((0..hd).map(|e| p.k.at(1, b, g, t) + e));
                    all.extend((0..hd).map(|e| p.v.at(1, b, g, t) + e));
                }
            }
        }
        all
    }

    #[test]
    fn separate_heads_are_contiguous_row_major() {
        let d = AttnDims { seq_kv: 7, ..dims(2, 6, 2, 5, 3) };
        let p = params(&d, AttnLayout::Heads).unwrap();
        // q[1, 4, 2, :] of [batch, q_heads, seq_q, hd]; k[1, 1, 6, :] of [batch, kv_heads, seq_kv, hd].
        assert_eq!(p.q.at(3, 1, 4, 2), ((6 + 4) * 5 + 2) * 3);
        assert_eq!(p.k.at(1, 1, 1, 6), ((2 + 1) * 7 + 6) * 3);
        assert_eq!(p.o, p.q);
        let mut q: Vec<u64> = (0..2).flat_map(|b| (0..6).flat_map(move |h| (0..5).map(move |t| p.q.at(3, b, h, t)))).collect();
        q.sort_unstable();
        assert_eq!(q, (0..d.q_len() as u64).step_by(3).collect::<Vec<_>>());
    }

    #[test]
    fn packed_places_tile_the_qkv_buffer_exactly_once() {
        let d = dims(2, 6, 2, 5, 4);
        let p = params(&d, AttnLayout::Packed).unwrap();
        let mut all = offsets(&d, &p);
        all.sort_unstable();
        assert_eq!(all, (0..d.packed_len() as u64).collect::<Vec<_>>());
        // The key of kv head 1 at position 3 of batch 1 (row 5 + 3 of the
        // [batch·seq, kv_heads, 3 + 2, hd] buffer) follows that head's 3 queries.
        assert_eq!(p.k.at(1, 1, 1, 3), ((5 + 3) * 2 + 1) * 5 * 4 + 3 * 4);
        // out is [batch, seq, q_heads, hd]: row 5 + 2, head 4.
        assert_eq!(p.o.at(3, 1, 4, 2), ((5 + 2) * 6 + 4) * 4);
    }

    #[test]
    fn the_cuda_source_agrees_with_this_description() {
        let src = source("attention").expect("attention is in SOURCES").source;
        assert!(src.contains("#define ATTN_TILE 64") && TILE == 64);
        assert!(src.contains("#define ATTN_THREADS 256") && THREADS == 256);
        assert!(src.contains("u64 base, batch, group, head, row;"));
        assert!(src.contains("AttnPlace q, k, v, o;\n    u64 batch, q_heads, kv_heads, seq_q, seq_kv, head_dim;\n    float scale;\n    unsigned int causal;"));
        assert_eq!(std::mem::size_of::<AttnParams>(), 4 * 40 + 6 * 8 + 8);
        for (kernel, (tiles, vectors)) in [("attn_forward", FWD_SHARED), ("attn_backward_dkv", DKV_SHARED), ("attn_backward_dq", DQ_SHARED)] {
            let body = src.split(&format!("__device__ void {kernel}(")).nth(1).expect(kernel);
            assert!(body.contains(&format!("attn_check_launch(attn_smem_bytes(D, {tiles}, {vectors}))")), "{kernel}");
        }
        let d = dims(1, 2, 1, 64, 64);
        let (_, f) = forward(&d, AttnLayout::Heads).unwrap();
        let (_, b) = backward(&d, AttnLayout::Heads).unwrap();
        for l in [f, b.delta, b.dkv, b.dq] {
            for ty in ["f32", "bf16", "f16"] {
                assert!(src.contains(&format!("void {}_##S(", l.op)), "{}", l.symbol(ty));
            }
            let signature = src.split(&format!("void {}_##S(", l.op)).nth(1).unwrap().split(')').next().unwrap();
            let names: Vec<&str> = signature.split(',').map(|a| a.trim().rsplit([' ', '*']).next().unwrap()).collect();
            assert_eq!(names, l.args.iter().map(|a| if *a == "params" { "p" } else { a }).collect::<Vec<_>>(), "{}", l.op);
        }
    }
}
