//! How to launch the paged-attention kernels of `cuda/paged_attention.cu`:
//! the KV-cache write and the attention over block tables, with the
//! semantics and layouts of [`crate::cpu::paged`] ([`PagedDims`]).
//!
//! The CUDA source states the same rules (block size, head-dim limit,
//! argument order); the tests below tie the two together. The attention
//! kernel traps if it is launched with another block size or a larger
//! `head_dim`.

use super::attention::{blocks, Launch};
use crate::cpu::paged::PagedDims;

/// The kernel source (an entry of [`SOURCES`](super::SOURCES)).
pub const SOURCE: &str = "paged_attention";
/// Threads of an attention block: four warps that split the context.
pub const THREADS: u32 = 128;
/// Positions a warp takes at a time (one per lane), whatever the cache's block size.
pub const TILE: usize = 32;
/// The largest `head_dim` the attention kernel supports. Up to 64 runs its
/// 64-wide instantiation, up to 128 the 128-wide one, up to 256 the 256-wide one.
pub const MAX_HEAD_DIM: usize = 256;

/// Why a paged call cannot be launched for the given sizes.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PagedLaunchError {
    /// `head_dim` is zero or above [`MAX_HEAD_DIM`].
    #[error("paged attention: head_dim {head_dim} is not supported on CUDA; use 1..=256")]
    HeadDim {
        /// The requested head dim.
        head_dim: usize,
    },
    /// `kv_heads` is zero or does not divide `q_heads`.
    #[error("paged attention: {q_heads} query heads on {kv_heads} kv heads; kv_heads must be positive and divide q_heads")]
    Heads {
        /// Query heads.
        q_heads: usize,
        /// Key/value heads.
        kv_heads: usize,
    },
    /// The cache's block size is zero.
    #[error("paged attention: a cache block size of 0; give each block at least one slot")]
    BlockSize,
    /// `scale` is not finite in f32.
    #[error("paged attention: scale {scale} is not a finite f32")]
    Scale {
        /// The requested scale.
        scale: f64,
    },
    /// More (token, query head) pairs than a grid's x dimension holds (2³¹ − 1).
    #[error("paged attention: {blocks} (token, query head) blocks exceed the grid limit; split the step")]
    TooManyBlocks {
        /// Blocks the launch would need.
        blocks: usize,
    },
}

/// The arguments of `kv_cache_write_{f32,bf16,f16}`, in order: pointers,
/// then `u64` sizes.
pub const WRITE_ARGS: &[&str] = &["qkv", "slots", "k_cache", "v_cache", "tokens", "kv_heads", "group", "head_dim", "num_slots"];

/// The cache write: `kv_cache_write` over `tokens · kv_heads · head_dim`
/// items (a grid-stride loop, so any grid covers them; the caller sizes it
/// for occupancy). Returns the op and the item count.
pub fn write(d: &PagedDims) -> Result<(&'static str, usize), PagedLaunchError> {
    check_heads(d)?;
    Ok(("kv_cache_write", d.tokens * d.kv_heads * d.head_dim))
}

/// The attention: one block of [`THREADS`] threads per (token, query
/// head), no dynamic shared memory (its 6.5 KiB are static). The grid does
/// not depend on the tokens' positions, and a block's work depends only on
/// its own token, so a token's result is the same in any batch.
pub fn attention(d: &PagedDims) -> Result<Launch, PagedLaunchError> {
    check_heads(d)?;
    if d.head_dim == 0 || d.head_dim > MAX_HEAD_DIM {
        return Err(PagedLaunchError::HeadDim { head_dim: d.head_dim });
    }
    if d.block_size == 0 {
        return Err(PagedLaunchError::BlockSize);
    }
    if !(d.scale as f32).is_finite() {
        return Err(PagedLaunchError::Scale { scale: d.scale });
    }
    let n = d.tokens * d.q_heads;
    let grid = blocks(n).map_err(|_| PagedLaunchError::TooManyBlocks { blocks: n })?;
    Ok(Launch {
        source: SOURCE,
        op: "paged_attention",
        args: &[
            "qkv",
            "k_cache",
            "v_cache",
            "positions",
            "token_seq",
            "block_tables",
            "out",
            "tokens",
            "q_heads",
            "kv_heads",
            "head_dim",
            "block_size",
            "table_width",
            "scale",
        ],
        grid,
        block: THREADS,
        shared_bytes: 0,
    })
}

fn check_heads(d: &PagedDims) -> Result<(), PagedLaunchError> {
    if d.kv_heads == 0 || !d.q_heads.is_multiple_of(d.kv_heads) {
        return Err(PagedLaunchError::Heads { q_heads: d.q_heads, kv_heads: d.kv_heads });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::source;

    fn dims(tokens: usize, q_heads: usize, kv_heads: usize, head_dim: usize) -> PagedDims {
        PagedDims { tokens, q_heads, kv_heads, head_dim, block_size: 16, slots: 64, seqs: 2, table_width: 2, scale: 1.0 / (head_dim as f64).sqrt() }
    }

    #[test]
    fn one_block_per_token_and_query_head() {
        let l = attention(&dims(5, 8, 2, 128)).unwrap();
        assert_eq!((l.grid, l.block, l.shared_bytes), (40, THREADS, 0));
        assert!(!l.needs_opt_in());
        assert_eq!(l.symbol("bf16"), "paged_attention_bf16");
        // Nothing to attend: an empty grid, which the caller skips.
        assert_eq!(attention(&dims(0, 8, 2, 128)).unwrap().grid, 0);
        assert_eq!(write(&dims(5, 8, 2, 128)).unwrap(), ("kv_cache_write", 5 * 2 * 128));
    }

    #[test]
    fn bad_sizes_are_errors_that_name_the_limit() {
        for hd in [1, 8, 64, 65, 128, 200, 256] {
            assert!(attention(&dims(1, 4, 2, hd)).is_ok(), "head_dim {hd}");
        }
        for hd in [0, 257, 512] {
            let e = attention(&dims(1, 4, 2, hd)).unwrap_err();
            assert_eq!(e, PagedLaunchError::HeadDim { head_dim: hd });
            assert!(e.to_string().contains("1..=256"), "{e}");
        }
        // The write copies rows of any length.
        assert!(write(&dims(1, 4, 2, 512)).is_ok());
        assert_eq!(attention(&dims(1, 6, 4, 64)).unwrap_err(), PagedLaunchError::Heads { q_heads: 6, kv_heads: 4 });
        assert_eq!(write(&dims(1, 4, 0, 64)).unwrap_err(), PagedLaunchError::Heads { q_heads: 4, kv_heads: 0 });
        assert_eq!(attention(&PagedDims { block_size: 0, ..dims(1, 4, 2, 64) }).unwrap_err(), PagedLaunchError::BlockSize);
        assert!(matches!(attention(&PagedDims { scale: 1e300, ..dims(1, 4, 2, 64) }), Err(PagedLaunchError::Scale { .. })));
        assert!(matches!(attention(&dims(1 << 28, 64, 8, 64)), Err(PagedLaunchError::TooManyBlocks { .. })));
    }

    /// The argument names of a kernel `{op}_##S(...)` in the source, in order.
    fn parameters<'a>(src: &'a str, op: &str) -> Vec<&'a str> {
        let signature = src.split(&format!("void {op}_##S(")).nth(1).unwrap_or_else(|| panic!("{op} is defined")).split(')').next().unwrap();
        signature.split(',').map(|a| a.trim().rsplit([' ', '*']).next().unwrap()).collect()
    }

    #[test]
    fn the_cuda_source_agrees_with_this_description() {
        let src = source(SOURCE).expect("paged_attention is in SOURCES").source;
        assert!(src.contains(&format!("#define PAGED_THREADS {THREADS} ")));
        assert!(src.contains(&format!("#define PAGED_TILE {TILE} ")));
        assert!(src.contains(&format!("#define PAGED_MAX_HEAD_DIM {MAX_HEAD_DIM}\n")));
        let l = attention(&dims(1, 2, 1, 64)).unwrap();
        assert_eq!(parameters(src, l.op), l.args);
        assert_eq!(parameters(src, write(&dims(1, 2, 1, 64)).unwrap().0), WRITE_ARGS);
        for ty in ["f32", "bf16", "f16"] {
            for k in [l.symbol(ty), format!("kv_cache_write_{ty}")] {
                assert!(source(SOURCE).unwrap().hot_kernels.contains(&k.as_str()), "{k} is a hot kernel of the gate");
            }
        }
    }
}
