//! The CUDA C kernel sources, compiled at run time by NVRTC (the runtime's
//! `backend::cuda::nvrtc`), so building needs no CUDA toolkit.
//!
//! Each source is `cuda/common.cuh` (element types, conversions, the block
//! reduction) followed by one `.cu` file of `kernels/cuda/`; the two fused
//! attention sources also share `cuda/attention_common.cuh` (the argument
//! structs, row offsets and masking), placed between the two. An op `foo`
//! on element type `T` is the symbol `foo_{f32,bf16,f16}`.

pub mod attention;
pub mod attention_tc;
pub mod paged;
pub mod signature;

/// One compilation unit: its name, its full source, and the kernels whose
/// speed matters most (the kernel gate fails if ptxas reports that any of
/// them spills registers).
#[derive(Clone, Copy, Debug)]
pub struct Source {
    /// Names the unit in errors and cache files (`elementwise`).
    pub name: &'static str,
    /// The CUDA C text, prelude included.
    pub source: &'static str,
    /// Entry points that must not spill registers.
    pub hot_kernels: &'static [&'static str],
}

macro_rules! source {
    ($name:literal, [$($hot:literal),* $(,)?]) => {
        Source {
            name: $name,
            source: concat!(include_str!("../cuda/common.cuh"), "\n", include_str!(concat!("../cuda/", $name, ".cu"))),
            hot_kernels: &[$($hot),*],
        }
    };
    // A source that also shares a header with others (after the prelude).
    ($name:literal, with $shared:literal, [$($hot:literal),* $(,)?]) => {
        Source {
            name: $name,
            source: concat!(
                include_str!("../cuda/common.cuh"),
                "\n",
                include_str!(concat!("../cuda/", $shared, ".cuh")),
                "\n",
                include_str!(concat!("../cuda/", $name, ".cu"))
            ),
            hot_kernels: &[$($hot),*],
        }
    };
}

/// Every kernel source of the CUDA backend.
pub const SOURCES: &[Source] = &[
    source!(
        "elementwise",
        [
            "add_f32",
            "add_bf16",
            "mul_f32",
            "gelu_f32",
            "gelu_bf16",
            "gelu_backward_f32",
            "gelu_backward_bf16",
            "silu_f32",
            "silu_backward_f32",
            "swiglu_f32",
            "swiglu_bf16",
            "swiglu_backward_f32",
            "swiglu_backward_bf16"
        ]
    ),
    source!("fp8", ["fp8_values_e4m3_f32", "fp8_values_e4m3_bf16", "fp8_values_e5m2_f32", "fp8_values_e5m2_bf16"]),
    source!("reduce", ["row_sum_f32", "row_sum_bf16", "row_sum_squares_f32", "col_sum_f32", "max_abs_f32", "max_abs_bf16"]),
    source!("norm", ["layernorm_f32", "layernorm_bf16", "rmsnorm_f32", "rmsnorm_bf16", "norm_backward_f32", "norm_backward_bf16"]),
    source!("adamw", ["adamw_f32", "adamw_bf16"]),
    source!("attention", with "attention_common", [
        "attention_fwd_f32", "attention_fwd_bf16", "attention_fwd_f16",
        "attention_bwd_dkv_f32", "attention_bwd_dkv_bf16", "attention_bwd_dkv_f16",
        "attention_bwd_dq_f32", "attention_bwd_dq_bf16", "attention_bwd_dq_f16",
    ]),
    source!("attention_merge", ["attention_merge_f32", "attention_merge_bf16"]),
    source!("attention_tc", with "attention_common", [
        "attention_tc_fwd_bf16", "attention_tc_fwd_f16",
        "attention_tc_bwd_dkv_bf16", "attention_tc_bwd_dkv_f16",
        "attention_tc_bwd_dq_bf16", "attention_tc_bwd_dq_f16",
    ]),
    source!("convert", ["cast_f32_to_bf16", "cast_bf16_to_f32"]),
    source!(
        "loss",
        [
            "softmax_f32",
            "softmax_bf16",
            "log_softmax_f32",
            "cross_entropy_rows_f32",
            "cross_entropy_rows_bf16",
            "cross_entropy_backward_f32",
            "cross_entropy_backward_bf16"
        ]
    ),
    source!("rope", ["rope_f32", "rope_bf16"]),
    source!("dropout", ["dropout_f32", "dropout_bf16"]),
    source!("embedding", ["embedding_f32", "embedding_bf16", "embedding_backward_f32", "embedding_backward_bf16"]),
    source!("topk", ["topk_f32", "topk_bf16", "topk_backward_f32", "topk_backward_bf16"]),
    source!(
        "paged_attention",
        ["paged_attention_f32", "paged_attention_bf16", "paged_attention_f16", "kv_cache_write_f32", "kv_cache_write_bf16", "kv_cache_write_f16",]
    ),
    source!(
        "quant",
        [
            "quant_matmul_int8_f32",
            "quant_matmul_int8_bf16",
            "quant_matmul_int4_f32",
            "quant_matmul_int4_bf16",
            "quant_matmul_w8a8_f32",
            "quant_matmul_w8a8_bf16",
            "quantize_rows_f32",
            "quantize_rows_bf16"
        ]
    ),
];

/// The source named `name`, if there is one.
pub fn source(name: &str) -> Option<&'static Source> {
    SOURCES.iter().find(|s| s.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every hot kernel is defined in its source, by its exact symbol, so the
    /// gate cannot silently check nothing.
    #[test]
    fn every_hot_kernel_is_instantiated_in_its_source() {
        for s in SOURCES {
            assert!(!s.hot_kernels.is_empty(), "{} names no hot kernel", s.name);
            for k in s.hot_kernels {
                let (op, ty) = k.rsplit_once('_').expect("op_dtype");
                assert!(["f32", "bf16", "f16"].contains(&ty), "{k}: the symbol ends in its dtype");
                let defined = s.source.contains(&format!("void {k}(")) || s.source.contains(&format!("void {op}_##S("));
                assert!(defined, "{}: no kernel {k}", s.name);
            }
        }
        assert!(source("norm").is_some() && source("nope").is_none());
    }
}
