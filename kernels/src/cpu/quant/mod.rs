//! Quantized matrix products for inference: `y[m, n] = Σ_k x[m, k] ·
//! dequant(W)[n, k] (+ bias[n])` with the weight `W` in a linear layer's
//! layout `[n, k]` (output features, input features) and the activations `x`
//! in f32, the f32 weight never materialised.
//!
//! Three formats, all symmetric (no zero point):
//!
//! - **int8** ([`int8`]): one f32 scale per output channel (row of `W`),
//!   `s = max|row| / 127`, `q = round(w / s)` in `-127..=127`; one byte per
//!   weight.
//! - **int4** ([`int4`]): one f32 scale per group of `group` consecutive
//!   weights of a row (along the input dimension, 128 by default),
//!   `s = max|group| / 7`, `q = round(w / s)` in `-7..=7` (−8 is never
//!   produced, so the grid is symmetric and `-w` quantizes to `-q`); two
//!   weights per byte, stored as `q + 8` (see [`int4`] for the order).
//! - **W8A8** ([`w8a8`]): the int8 weights, and each row of `x` quantized
//!   when the product runs, `sx = max|x_row| / 127`, `xq = round(x / sx)`;
//!   the `i8·i8` products are summed exactly in `i32` and the sum scaled by
//!   `sx · s`.
//!
//! `round` is [`f32::round`] (ties away from zero), as CUDA's `roundf`.
//! A zero row (or group) gets scale 0 and codes 0, so it dequantizes to
//! exact zeros. The quantization error of one weight is at most `s / 2`, so
//! a weight-only product is within `Σ_k |x_k| · s_n / 2` of the f32 product
//! (int4: each `k` with its group's scale); W8A8 adds the activations'
//! rounding, `Σ_k (sx / 2) · |dequant(W)[n, k]|`.
//!
//! How the products run: decode reads each weight once per generated token
//! for one or a few rows of `x`, so it is bound by memory bandwidth, and a
//! quantized weight moves 4× (int8) or about 7.5× (int4) fewer bytes than
//! f32. Tasks of the rayon pool take blocks of output channels and compute
//! those channels for every row of `x` while the block's bytes are in
//! cache; the inner loops run on AVX2 and FMA where the CPU has them
//! (checked at run time) and on portable code elsewhere. With
//! [`TILE_MIN_ROWS`] rows of `x` or more (prefill), a task dequantizes its
//! block into an f32 tile in cache and multiplies the tile with the
//! matrix-product kernel instead, so the dequantization is paid once per
//! weight rather than once per row.
//!
//! Results do not depend on the number of threads: each output is summed
//! by one task in a fixed order. Below [`TILE_MIN_ROWS`] rows, and at any
//! row count through `matmul_rows` ([`int8::matmul_rows`],
//! [`int4::matmul_rows`]; W8A8 always), they do not depend on the other
//! rows of `x` either: a row gets the bits it gets alone. They may differ in the last bits between a
//! CPU with AVX2 and one without (fused multiply-adds, another order).

mod driver;
pub mod int4;
pub mod int8;
mod portable;
pub mod w8a8;
#[cfg(target_arch = "x86_64")]
mod x86;

/// Which inner loops a product runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    /// Plain Rust, for any CPU.
    Portable,
    /// AVX2 and FMA intrinsics (x86-64, checked at run time).
    #[cfg(target_arch = "x86_64")]
    Avx2,
}

impl Isa {
    /// The best loops this CPU runs.
    pub(crate) fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        if x86::available() {
            return Isa::Avx2;
        }
        Isa::Portable
    }

    /// Every kind of loop this CPU runs (the tests compare them).
    #[cfg(test)]
    pub(crate) fn all() -> Vec<Isa> {
        let mut v = vec![Isa::Portable];
        #[cfg(target_arch = "x86_64")]
        if x86::available() {
            v.push(Isa::Avx2);
        }
        v
    }
}

/// Whether the products run on SIMD loops on this CPU (AVX2 with FMA), or
/// on the portable ones.
pub fn simd_available() -> bool {
    Isa::detect() != Isa::Portable
}

/// From this many rows of `x` on, a task dequantizes its block of weights
/// into an f32 tile and runs the matrix-product kernel on it; below, it
/// multiplies straight from the quantized bytes, widening each code once
/// for up to four rows of `x`. Measured with one thread on an AVX2 machine
/// (a 4096×4096 int8 weight): from the codes 16.9 ms at 16 rows against
/// 15.7 ms for the tile, 32.8 ms against 27.1 ms at 32 rows, 72.7 ms
/// against 50.5 ms at 64.
pub const TILE_MIN_ROWS: usize = 16;

/// What a product promises about its rows of `x`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Rows {
    /// The fastest loops for the number of rows: from [`TILE_MIN_ROWS`]
    /// on, the dequantized tile and the matrix-product kernel.
    Fastest,
    /// Every row's outputs are the bits it gets when multiplied alone,
    /// whatever the other rows are (serving: a request's tokens do not
    /// depend on what it is batched with). Never the tile: the decode
    /// loops, whose sums run one fixed order per (row, channel).
    Invariant,
}

impl Rows {
    /// Whether a product of `m` rows runs on the tile.
    fn tile(self, m: usize) -> bool {
        self == Rows::Fastest && m >= TILE_MIN_ROWS
    }
}

/// Output channels per prefill task: the rows of its GEMM (64-row tiles ran
/// 1.3× faster than the 8 rows of a decode task at 16 and 32 rows of `x`,
/// 4× at 64).
const TILE_ROWS: usize = 64;

/// The `[m, k]` rows of `x`, `m·k` f32 values, checked against the weight's depth.
fn check_x(op: &str, x: &[f32], m: usize, k: usize) {
    assert_eq!(x.len(), m * k, "{op}: x must hold m*k = {m}*{k} values");
}

/// Checks the output and bias lengths of a product with `n` output channels.
fn check_out(op: &str, m: usize, n: usize, bias: Option<&[f32]>, y: &[f32]) {
    assert_eq!(y.len(), m * n, "{op}: y must hold m*n = {m}*{n} values");
    if let Some(b) = bias {
        assert_eq!(b.len(), n, "{op}: the bias must have n = {n} values");
    }
}

/// `round(v / s)` clamped to `-limit..=limit`, or 0 for a zero scale.
#[inline]
fn code(v: f32, s: f32, limit: f32) -> f32 {
    if s > 0.0 {
        (v / s).round().clamp(-limit, limit)
    } else {
        0.0
    }
}

/// The largest `|v|` of `values` (0 for none; NaN if any is NaN, so a
/// non-finite input is not hidden behind finite codes).
#[inline]
fn max_abs(values: &[f32]) -> f32 {
    values.iter().fold(0f32, |m, &v| if v.abs() > m || v.is_nan() { v.abs() } else { m })
}

#[cfg(test)]
mod tests;
