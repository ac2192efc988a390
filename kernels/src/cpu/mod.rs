//! CPU kernels: `gemm` for matrix products, `rayon` for everything row-parallel.

pub mod activation;
pub mod adamw;
pub mod attention;
pub mod cast;
pub mod copy;
pub mod cross_entropy;
pub mod dropout;
pub mod elementwise;
pub mod embedding;
pub(crate) mod exp;
pub mod fp8;
pub mod matmul;
pub mod mixed;
pub mod norm;
pub mod paged;
pub mod quant;
pub mod reduce;
pub mod rope;
pub mod softmax;
pub mod topk;
pub(crate) mod wide;
