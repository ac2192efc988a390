//! Descriptions of kernel work that every backend shares: the CPU kernels
//! and the CUDA launches read the same [`Gemm`] and [`AdamWStep`], so the
//! runtime states a product or an update once, whatever device runs it.

/// Shape and operand layout of a (batched) matrix product
/// `C[b] (+)= op(A[b]) · op(B[b])` for `b` in `0..batch`.
///
/// `op(A[b])` is `m×k` and `op(B[b])` is `k×n`; `C` is always `batch×m×n`
/// contiguous. The transposes only change how the operands are read, so the
/// backward products `dA = dC·Bᵀ` and `dB = Aᵀ·dC` need no copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gemm {
    /// Number of independent products.
    pub batch: usize,
    /// Rows of `op(A)` and of `C`.
    pub m: usize,
    /// Inner (contracted) dimension.
    pub k: usize,
    /// Columns of `op(B)` and of `C`.
    pub n: usize,
    /// `A[b]` is stored `k×m` row-major (so `op(A) = Aᵀ`) instead of `m×k`.
    pub trans_a: bool,
    /// `B[b]` is stored `n×k` row-major (so `op(B) = Bᵀ`) instead of `k×n`.
    pub trans_b: bool,
    /// Elements between `A[b]` and `A[b+1]`; 0 broadcasts one `A` to every batch.
    pub batch_stride_a: usize,
    /// Elements between `B[b]` and `B[b+1]`; 0 broadcasts one `B` to every batch.
    pub batch_stride_b: usize,
    /// `C += product` instead of `C = product`.
    pub accumulate: bool,
}

impl Gemm {
    /// Plain `C = A·B`: contiguous batches (strides `m*k` and `k*n`), no
    /// transposes, no accumulation.
    pub fn new(batch: usize, m: usize, k: usize, n: usize) -> Self {
        Gemm { batch, m, k, n, trans_a: false, trans_b: false, batch_stride_a: m * k, batch_stride_b: k * n, accumulate: false }
    }

    /// Floating-point operations of the whole product: `2·batch·m·n·k`.
    pub fn flops(&self) -> f64 {
        2.0 * self.batch as f64 * self.m as f64 * self.n as f64 * self.k as f64
    }

    /// Sets whether `A[b]` is stored transposed (`k×m`).
    pub fn trans_a(mut self, t: bool) -> Self {
        self.trans_a = t;
        self
    }

    /// Sets whether `B[b]` is stored transposed (`n×k`).
    pub fn trans_b(mut self, t: bool) -> Self {
        self.trans_b = t;
        self
    }

    /// Sets the element distance between consecutive `A[b]` (0 broadcasts).
    pub fn batch_stride_a(mut self, s: usize) -> Self {
        self.batch_stride_a = s;
        self
    }

    /// Sets the element distance between consecutive `B[b]` (0 broadcasts).
    pub fn batch_stride_b(mut self, s: usize) -> Self {
        self.batch_stride_b = s;
        self
    }

    /// Sets whether the product is added to `C` instead of overwriting it.
    pub fn accumulate(mut self, acc: bool) -> Self {
        self.accumulate = acc;
        self
    }

    /// Minimum length of the `A` buffer this product reads.
    pub fn len_a(&self) -> usize {
        operand_len(self.batch, self.batch_stride_a, self.m * self.k)
    }

    /// Minimum length of the `B` buffer this product reads.
    pub fn len_b(&self) -> usize {
        operand_len(self.batch, self.batch_stride_b, self.k * self.n)
    }

    /// Length of the `C` buffer: `batch·m·n`.
    pub fn len_c(&self) -> usize {
        self.batch * self.m * self.n
    }
}

fn operand_len(batch: usize, stride: usize, one: usize) -> usize {
    if batch == 0 || one == 0 {
        0
    } else {
        (batch - 1) * stride + one
    }
}

/// Hyper-parameters of one AdamW update.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWStep {
    /// Learning rate.
    pub lr: f64,
    /// Decay rate of the first moment (typically 0.9).
    pub beta1: f64,
    /// Decay rate of the second moment (typically 0.95–0.999).
    pub beta2: f64,
    /// Added to `√v̂` in the denominator.
    pub eps: f64,
    /// Decoupled weight-decay coefficient (multiplied by `lr`).
    pub weight_decay: f64,
    /// 1 for the first update: bias correction uses it.
    pub step: u64,
    /// Multiply grads by this first (un-scaling, clipping); 1.0 = none.
    pub grad_scale: f64,
}

/// How a linear layer's weight is quantized for inference (see
/// [`cpu::quant`](crate::cpu::quant) for the formats, their layouts and
/// their error bounds). The CPU kernels and the CUDA launches read the same
/// description.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantFormat {
    /// int8 weights, one f32 scale per output channel; activations stay
    /// in their float dtype.
    Int8,
    /// int4 weights, one f32 scale per `group_size` consecutive weights of
    /// an output channel (even, dividing the input features); activations
    /// stay in their float dtype.
    Int4 {
        /// Weights per scale along the input dimension ([`QuantFormat::INT4_GROUP`] by default).
        group_size: usize,
    },
    /// int8 weights as [`Int8`](Self::Int8), and activations quantized to
    /// int8 per row when the product runs; the products sum in i32.
    W8A8,
}

impl QuantFormat {
    /// The int4 group size used when none is chosen.
    pub const INT4_GROUP: usize = crate::cpu::quant::int4::DEFAULT_GROUP;

    /// int4 with groups of [`INT4_GROUP`](Self::INT4_GROUP) weights.
    pub const fn int4() -> QuantFormat {
        QuantFormat::Int4 { group_size: Self::INT4_GROUP }
    }

    /// Bits per stored weight code.
    pub fn bits(self) -> usize {
        match self {
            QuantFormat::Int4 { .. } => 4,
            QuantFormat::Int8 | QuantFormat::W8A8 => 8,
        }
    }

    /// The format's short name: `int8`, `int4` or `w8a8`.
    pub fn name(self) -> &'static str {
        match self {
            QuantFormat::Int8 => "int8",
            QuantFormat::Int4 { .. } => "int4",
            QuantFormat::W8A8 => "w8a8",
        }
    }

    /// Bytes of codes a weight of `n` rows and `k` columns holds.
    pub fn code_bytes(self, n: usize, k: usize) -> usize {
        match self {
            QuantFormat::Int4 { .. } => n * k / 2,
            QuantFormat::Int8 | QuantFormat::W8A8 => n * k,
        }
    }

    /// Scales a weight of `n` rows and `k` columns holds: one per row, or
    /// one per group for int4.
    pub fn scale_count(self, n: usize, k: usize) -> usize {
        match self {
            QuantFormat::Int4 { group_size } => n * (k / group_size.max(1)),
            QuantFormat::Int8 | QuantFormat::W8A8 => n,
        }
    }
}

/// Parses `int8`, `w8a8`, `int4` (groups of [`QuantFormat::INT4_GROUP`])
/// or `int4:N` (groups of `N`), case-insensitively: the spelling command
/// lines and configuration files use. Whether a group suits a layer is
/// checked when a weight is quantized.
impl std::str::FromStr for QuantFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<QuantFormat, String> {
        let bad = || format!("unknown quantization format `{s}`; the formats are int8, int4 (groups of {}), int4:N (groups of N) and w8a8", Self::INT4_GROUP);
        let lower = s.trim().to_ascii_lowercase();
        match lower.as_str() {
            "int8" => Ok(QuantFormat::Int8),
            "w8a8" => Ok(QuantFormat::W8A8),
            "int4" => Ok(QuantFormat::int4()),
            other => {
                let group = other.strip_prefix("int4:").ok_or_else(bad)?;
                let group_size: usize = group.parse().map_err(|_| bad())?;
                if group_size < 2 || !group_size.is_multiple_of(2) {
                    return Err(format!("int4 groups of {group_size} weights: a group must be an even number of at least 2 (e.g. int4:64)"));
                }
                Ok(QuantFormat::Int4 { group_size })
            }
        }
    }
}

impl std::fmt::Display for QuantFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            QuantFormat::Int4 { group_size } => write!(f, "int4 (groups of {group_size})"),
            other => f.write_str(other.name()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::QuantFormat;

    #[test]
    fn quant_formats_parse_from_their_names_and_refuse_the_rest() {
        for (s, want) in
            [("int8", QuantFormat::Int8), ("W8A8", QuantFormat::W8A8), (" int4 ", QuantFormat::int4()), ("int4:64", QuantFormat::Int4 { group_size: 64 })]
        {
            assert_eq!(s.parse::<QuantFormat>(), Ok(want), "{s}");
        }
        for f in [QuantFormat::Int8, QuantFormat::W8A8, QuantFormat::Int4 { group_size: 32 }] {
            let spelled = match f {
                QuantFormat::Int4 { group_size } => format!("int4:{group_size}"),
                _ => f.name().to_string(),
            };
            assert_eq!(spelled.parse::<QuantFormat>(), Ok(f));
        }
        for s in ["", "int", "int16", "int4:", "int4:x", "int4:7", "int4:0", "int4:-2", "int4:99999999999999999999999", "fp8"] {
            let e = s.parse::<QuantFormat>().unwrap_err();
            assert!(e.contains("int4") && (e.contains(s.trim()) || e.contains("even")), "{s:?}: {e}");
        }
        // Arbitrary bytes never panic.
        let mut state = 7u64;
        for _ in 0..2000 {
            let len = (state >> 60) as usize;
            let s: String = (0..len)
                .map(|_| {
                    state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    b"int4:w8a0123456789 -"[(state >> 33) as usize % 20] as char
                })
                .collect();
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
            let _ = s.parse::<QuantFormat>();
        }
    }
}
