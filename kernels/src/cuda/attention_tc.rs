//! How to launch the tensor-core attention kernels of `cuda/attention_tc.cu`
//! (bf16 and f16 only): the grid, the block and the dynamic shared memory of
//! each kernel. The argument struct, the layouts, the argument order and the
//! errors are those of [`attention`], whose f32 kernels
//! keep the CUDA cores and whose `delta` kernel the backward shares.
//!
//! The CUDA source states the same rules (tile size, threads, shared memory
//! per head-dim width); the tests below tie the two together. Every kernel
//! traps if it is launched with a block or shared memory other than these.

use super::attention::{self, AttnLaunchError, AttnLayout, AttnParams, BackwardLaunches, Launch};
use crate::cpu::attention::AttnDims;

/// Query rows and key rows per tile; one block owns one tile (as the CUDA-core kernels).
pub const TILE: usize = 64;
/// Threads of every tensor-core attention block: four warps of 16 tile rows.
pub const THREADS: u32 = 128;
/// The largest `head_dim` the tensor-core kernels serve: up to 64 runs the
/// 64-wide instantiation, above it the 128-wide one.
pub const MAX_HEAD_DIM: usize = 128;
/// The element types with tensor-core kernels (f32 keeps the CUDA cores).
pub const DTYPES: [&str; 2] = ["bf16", "f16"];
/// The oldest GPU the kernels compile for, as `10 · major + minor`:
/// `mma.sync.m16n8k16` on bf16 and `cvt.rn.bf16x2.f32` need sm_80 (Ampere).
pub const MIN_SM: u32 = 80;
/// 16-bit elements of padding after each staged row (keeps fragment loads
/// free of bank conflicts).
const PAD: usize = 8;

/// `(16-bit tiles, per-row f32 vectors)` of each kernel's shared memory;
/// `attention_tc.cu` passes the same pairs to `atc_smem_bytes`.
const FWD_SHARED: (usize, usize) = (3, 0);
const DKV_SHARED: (usize, usize) = (4, 2);
const DQ_SHARED: (usize, usize) = (4, 0);

/// Whether the tensor-core kernels serve `dtype` (a kernel suffix: `f32`,
/// `bf16`, `f16`) at `head_dim` on a GPU of compute capability `sm`
/// (`10 · major + minor`). Where they do not, the CUDA-core kernels of
/// [`attention`] run (and report unsupported sizes).
pub fn serves(dtype: &str, head_dim: usize, sm: u32) -> bool {
    DTYPES.contains(&dtype) && (1..=MAX_HEAD_DIM).contains(&head_dim) && sm >= MIN_SM
}

/// Head-dim width of the instantiation that serves `head_dim`.
fn width(head_dim: usize) -> usize {
    if head_dim <= 64 {
        64
    } else {
        128
    }
}

/// Bytes of `tiles` padded `[64][width + 8]` 16-bit tiles and `vectors` f32
/// vectors of 64.
fn shared_bytes(width: usize, (tiles, vectors): (usize, usize)) -> u32 {
    (2 * tiles * TILE * (width + PAD) + 4 * vectors * TILE) as u32
}

/// The forward: `out` and an f32 `lse` `[batch, q_heads, seq_q]`, one block
/// per (batch, query head, query tile).
pub fn forward(d: &AttnDims, layout: AttnLayout) -> Result<(AttnParams, Launch), AttnLaunchError> {
    let p = attention::params(d, layout)?;
    Ok((p, attention::fwd_launch(d, "attention_tc", "attention_tc_fwd", THREADS, shared_bytes(width(d.head_dim), FWD_SHARED))?))
}

/// The backward's three launches: `delta` from `attention.cu` (its
/// CUDA-core kernel reads each row once; tensor cores would not help it),
/// then `dk` and `dv`, then `dq` on the tensor cores. Same buffers as
/// [`attention::backward`].
pub fn backward(d: &AttnDims, layout: AttnLayout) -> Result<(AttnParams, BackwardLaunches), AttnLaunchError> {
    let (p, cuda_cores) = attention::backward(d, layout)?;
    let w = width(d.head_dim);
    let launches = BackwardLaunches {
        delta: cuda_cores.delta,
        dkv: attention::dkv_launch(d, "attention_tc", "attention_tc_bwd_dkv", THREADS, shared_bytes(w, DKV_SHARED))?,
        dq: attention::dq_launch(d, "attention_tc", "attention_tc_bwd_dq", THREADS, shared_bytes(w, DQ_SHARED))?,
    };
    Ok((p, launches))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::attention::SM90_SHARED_LIMIT;
    use crate::cuda::source;

    fn dims(batch: usize, q_heads: usize, kv_heads: usize, seq: usize, head_dim: usize) -> AttnDims {
        AttnDims { batch, q_heads, kv_heads, seq_q: seq, seq_kv: seq, head_dim, causal: true, scale: 0.125 }
    }

    #[test]
    fn only_16_bit_types_up_to_head_dim_128_on_ampere_or_newer_run_on_tensor_cores() {
        for hd in [1, 8, 32, 64, 96, 128] {
            assert!(serves("bf16", hd, 90) && serves("f16", hd, 80), "{hd}");
            assert!(!serves("f32", hd, 90), "{hd}");
        }
        assert!(!serves("bf16", 0, 90) && !serves("bf16", 129, 90) && !serves("f16", 256, 90));
        // Volta and Turing lack the m16n8k16 bf16 instruction: CUDA cores.
        assert!(!serves("bf16", 64, 75) && !serves("f16", 64, 70));
    }

    #[test]
    fn grids_match_the_cuda_core_kernels_with_smaller_blocks() {
        // gpt-tiny-like: 2 sequences of 200 positions, 8 query heads on 2 kv heads.
        let d = dims(2, 8, 2, 200, 64);
        let (p, f) = forward(&d, AttnLayout::Heads).unwrap();
        let (p0, f0) = attention::forward(&d, AttnLayout::Heads).unwrap();
        assert_eq!(p, p0);
        assert_eq!((f.grid, f.block, f.source, f.args), (f0.grid, 128, "attention_tc", f0.args));
        let (_, b) = backward(&d, AttnLayout::Heads).unwrap();
        let (_, b0) = attention::backward(&d, AttnLayout::Heads).unwrap();
        assert_eq!(b.delta, b0.delta);
        assert_eq!((b.dkv.grid, b.dq.grid), (b0.dkv.grid, b0.dq.grid));
        assert_eq!((b.dkv.args, b.dq.args), (b0.dkv.args, b0.dq.args));
        assert_eq!((b.dkv.symbol("bf16"), b.dq.symbol("f16")), ("attention_tc_bwd_dkv_bf16".into(), "attention_tc_bwd_dq_f16".into()));
        // Unsupported sizes are the same typed errors.
        assert_eq!(forward(&dims(1, 4, 4, 16, 129), AttnLayout::Heads).unwrap_err(), AttnLaunchError::HeadDim { head_dim: 129 });
        assert_eq!(backward(&dims(1, 6, 4, 16, 64), AttnLayout::Heads).unwrap_err(), AttnLaunchError::UnevenGroups { q_heads: 6, kv_heads: 4 });
    }

    #[test]
    fn shared_memory_is_16_bit_tiles_padded_by_8() {
        let bytes = |hd| {
            let d = dims(1, 4, 4, 128, hd);
            let (_, f) = forward(&d, AttnLayout::Heads).unwrap();
            let (_, b) = backward(&d, AttnLayout::Heads).unwrap();
            [f, b.dkv, b.dq]
        };
        let [f, dkv, dq] = bytes(64);
        assert_eq!((f.shared_bytes, dkv.shared_bytes, dq.shared_bytes), (27_648, 37_376, 36_864));
        assert!(!f.needs_opt_in() && !dkv.needs_opt_in() && !dq.needs_opt_in());
        let [f, dkv, dq] = bytes(128);
        assert_eq!((f.shared_bytes, dkv.shared_bytes, dq.shared_bytes), (52_224, 70_144, 69_632));
        assert!(f.needs_opt_in() && dkv.needs_opt_in());
        for hd in [1, 30, 64, 65, 96, 128] {
            for l in bytes(hd) {
                assert!(l.shared_bytes <= SM90_SHARED_LIMIT, "{} at head_dim {hd}", l.op);
                assert_eq!(l.block, THREADS);
            }
        }
    }

    #[test]
    fn the_cuda_source_agrees_with_this_description() {
        let src = source("attention_tc").expect("attention_tc is in SOURCES").source;
        assert!(src.contains("#define ATTN_TILE 64") && src.contains("#define ATC_TILE ATTN_TILE") && TILE == 64);
        assert!(src.contains("#define ATC_THREADS 128") && THREADS == 128);
        assert!(src.contains(&format!("#define ATC_PAD {PAD} ")));
        // The argument struct is attention.cu's: both sources include it
        // from attention_common.cuh.
        let shared = include_str!("../../cuda/attention_common.cuh");
        assert!(shared.contains("struct AttnParams {") && src.contains(shared) && source("attention").unwrap().source.contains(shared));
        for (kernel, (tiles, vectors)) in [("atc_forward", FWD_SHARED), ("atc_backward_dkv", DKV_SHARED), ("atc_backward_dq", DQ_SHARED)] {
            let body = src.split(&format!("__device__ void {kernel}(")).nth(1).expect(kernel);
            assert!(body.contains(&format!("atc_check_launch(atc_smem_bytes(D, {tiles}, {vectors}))")), "{kernel}");
        }
        for ty in DTYPES {
            assert!(src.contains(&format!("ATTENTION_TC({ty}, {ty})")), "{ty}");
        }
        assert!(!src.contains("ATTENTION_TC(float"));
        let d = dims(1, 2, 1, 64, 64);
        let (_, f) = forward(&d, AttnLayout::Heads).unwrap();
        let (_, b) = backward(&d, AttnLayout::Heads).unwrap();
        for l in [f, b.dkv, b.dq] {
            let signature = src.split(&format!("void {}_##S(", l.op)).nth(1).expect(l.op).split(')').next().unwrap();
            let names: Vec<&str> = signature.split(',').map(|a| a.trim().rsplit([' ', '*']).next().unwrap()).collect();
            assert_eq!(names, l.args.iter().map(|a| if *a == "params" { "p" } else { a }).collect::<Vec<_>>(), "{}", l.op);
        }
        assert_eq!(b.delta.source, "attention");
    }
}
