//! Attention over a paged key/value cache, for serving: writing a step's keys
//! and values into their slots, and attending through block tables.
//!
//! The layouts and the arithmetic are those of
//! [`tessera_kernels::cpu::paged`]: each layer's cache is a key and a value
//! tensor `[slots, kv_heads, head_dim]`, slots grouped in blocks of
//! `block_size`, and a step's tokens come flattened with their sequence and
//! position (a [`PagedBatch`]).

use super::QkvHeads;
use crate::backend::{Device, Storage};
use crate::error::{Error, Result};
use crate::tensor::{check_device, DType, Tensor};
use half::bf16;
use tessera_kernels::cpu::paged::{kv_cache_write as write_kernel, paged_attention as attend_kernel, PagedDims};

/// Where a step's tokens sit: the host-side indices every paged attention
/// layer of one forward reads (built once per step by the scheduler).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PagedBatch {
    /// Token slots of a cache block.
    pub block_size: usize,
    /// Position of each token in its sequence.
    pub positions: Vec<u32>,
    /// Sequence (row of `block_tables`) of each token.
    pub token_seq: Vec<u32>,
    /// The cache slot each token's key and value are written to:
    /// `table[position / block_size]·block_size + position % block_size`.
    pub slots: Vec<u32>,
    /// `[seqs, table_width]` block indices, row-major.
    pub block_tables: Vec<u32>,
    /// Entries per row of `block_tables`.
    pub table_width: usize,
}

impl PagedBatch {
    /// Tokens of the step.
    pub fn tokens(&self) -> usize {
        self.positions.len()
    }

    /// Sequences (rows of the block table).
    pub fn seqs(&self) -> usize {
        self.block_tables.len().checked_div(self.table_width).unwrap_or(0)
    }

    /// Checks the indices against a cache of `slots` slots: one sequence,
    /// position and slot per token, every position inside its table, every
    /// block inside the cache, each token's slot where its table puts it.
    pub fn check(&self, op: &'static str, slots: usize) -> Result<()> {
        let n = self.tokens();
        let bad = |msg: String| Err(Error::invalid(op, msg));
        if self.block_size == 0 || self.table_width == 0 || !self.block_tables.len().is_multiple_of(self.table_width) {
            return bad(format!(
                "block size {} and table width {} for {} table entries; both must be positive and divide the table",
                self.block_size,
                self.table_width,
                self.block_tables.len()
            ));
        }
        if self.token_seq.len() != n || self.slots.len() != n {
            return bad(format!("{n} positions, {} sequence indices and {} slots; give one of each per token", self.token_seq.len(), self.slots.len()));
        }
        if !slots.is_multiple_of(self.block_size) {
            return bad(format!("a cache of {slots} slots is not whole blocks of {}", self.block_size));
        }
        let blocks = slots / self.block_size;
        if let Some(b) = self.block_tables.iter().find(|&&b| b as usize >= blocks) {
            return bad(format!("block {b} in a block table, past a cache of {blocks} blocks"));
        }
        let seqs = self.seqs();
        for t in 0..n {
            let (s, p) = (self.token_seq[t] as usize, self.positions[t] as usize);
            if s >= seqs {
                return bad(format!("token {t} belongs to sequence {s} of {seqs}"));
            }
            if p / self.block_size >= self.table_width {
                return bad(format!("token {t} at position {p} is past a block table of {} blocks of {}", self.table_width, self.block_size));
            }
            let want = self.block_tables[s * self.table_width + p / self.block_size] as usize * self.block_size + p % self.block_size;
            if self.slots[t] as usize != want {
                return bad(format!("token {t} (sequence {s}, position {p}) writes slot {} but its block table puts it at {want}", self.slots[t]));
            }
        }
        let mut seen = self.slots.clone();
        seen.sort_unstable();
        if let Some(w) = seen.windows(2).find(|w| w[0] == w[1]) {
            return bad(format!("two tokens of one step write slot {}", w[0]));
        }
        Ok(())
    }

    fn dims(&self, h: QkvHeads, slots: usize) -> PagedDims {
        PagedDims {
            tokens: self.tokens(),
            q_heads: h.q_heads,
            kv_heads: h.kv_heads,
            head_dim: h.head_dim,
            block_size: self.block_size,
            slots,
            seqs: self.seqs(),
            table_width: self.table_width,
            scale: 1.0 / (h.head_dim as f64).sqrt(),
        }
    }
}

/// Checks a layer's packed input `[.., tokens, (q_heads + 2·kv_heads)·head_dim]`
/// and caches `[slots, kv_heads, head_dim]`; returns the slots.
fn check(op: &'static str, qkv: &Tensor, h: QkvHeads, k_cache: &Tensor, v_cache: &Tensor, batch: &PagedBatch) -> Result<usize> {
    check_device(op, qkv, k_cache)?;
    check_device(op, qkv, v_cache)?;
    let width = (h.q_heads + 2 * h.kv_heads) * h.head_dim;
    if h.kv_heads == 0 || h.head_dim == 0 || !h.q_heads.is_multiple_of(h.kv_heads) || h.q_heads == 0 {
        return Err(Error::invalid(op, format!("{h:?}: heads must be positive, q_heads a multiple of kv_heads")));
    }
    if qkv.dims().last() != Some(&width) || qkv.elem_count() != batch.tokens() * width {
        return Err(Error::shape(op, format!("packed input {} for {} tokens of {width} values ({h:?})", qkv.shape(), batch.tokens())));
    }
    let slots = k_cache.dims().first().copied().unwrap_or(0);
    for (name, c) in [("key", k_cache), ("value", v_cache)] {
        if c.dims() != [slots, h.kv_heads, h.head_dim] {
            return Err(Error::shape(
                op,
                format!("{name} cache {} for {} kv heads of {}; it must be [slots, {}, {}]", c.shape(), h.kv_heads, h.head_dim, h.kv_heads, h.head_dim),
            ));
        }
        if c.dtype() != qkv.dtype() {
            return Err(Error::DType {
                op,
                expected: format!("a {name} cache of the input's dtype {}", qkv.dtype()),
                got: c.dtype(),
                hint: "; allocate the cache in the compute dtype",
            });
        }
        if !c.is_contiguous() {
            return Err(Error::placement(op, format!("the {name} cache must be contiguous (it is written in place)")));
        }
    }
    if k_cache.shares_storage(v_cache) {
        return Err(Error::Aliased { op, a: "k_cache", b: "v_cache" });
    }
    batch.check(op, slots)?;
    Ok(slots)
}

fn host_only(op: &'static str, device: &Device) -> Result<()> {
    match device {
        Device::Cpu(_) => Ok(()),
        Device::Cuda(_) => Err(Error::NotImplementedOnCuda { op }),
    }
}

/// Writes the keys and values of a step's tokens (from the packed input of
/// an attention layer, laid out as [`QkvHeads`] describes) into their slots
/// `batch.slots` of the caches, in place.
pub fn kv_cache_write(qkv: &Tensor, h: QkvHeads, k_cache: &Tensor, v_cache: &Tensor, batch: &PagedBatch) -> Result<()> {
    const OP: &str = "kv_cache_write";
    let slots = check(OP, qkv, h, k_cache, v_cache, batch)?;
    host_only(OP, qkv.device())?;
    let d = batch.dims(h, slots);
    let qkv = qkv.contiguous()?;
    let range = qkv.layout().contiguous_range().expect("contiguous");
    let (kr, vr) = (k_cache.layout().contiguous_range().expect("checked"), v_cache.layout().contiguous_range().expect("checked"));
    let g = qkv.read();
    let (mut kg, mut vg) = (k_cache.write(), v_cache.write());
    let (Storage::Cpu(x), Storage::Cpu(k), Storage::Cpu(v)) = (&*g, &mut *kg, &mut *vg) else { unreachable!("host devices checked") };
    macro_rules! go {
        ($t:ty) => {
            write_kernel(
                &d,
                &x.as_slice::<$t>().expect("dtype")[range],
                &batch.slots,
                &mut k.as_mut_slice::<$t>().expect("dtype")[kr],
                &mut v.as_mut_slice::<$t>().expect("dtype")[vr],
            )
        };
    }
    match qkv.dtype() {
        DType::F32 => go!(f32),
        DType::F64 => go!(f64),
        DType::BF16 => go!(bf16),
        DType::F16 => go!(half::f16),
        other => return Err(Error::DType { op: OP, expected: "a float dtype".into(), got: other, hint: "" }),
    }
    Ok(())
}

/// Attention of a step's tokens over their sequences' cached keys and values:
/// token `t`'s query heads attend positions `0..=batch.positions[t]` of
/// sequence `batch.token_seq[t]`, read through its block table. Write the
/// step's keys and values first ([`kv_cache_write`]). Returns
/// `[.., tokens, q_heads·head_dim]` (the input's leading dimensions).
///
/// Every output row depends on its token and its sequence's cache alone
/// (not on the rest of the batch, the chunking of a prompt, or the threads).
/// f32, f64 and bf16 (computed in f32) on the CPU.
pub fn paged_attention(qkv: &Tensor, h: QkvHeads, k_cache: &Tensor, v_cache: &Tensor, batch: &PagedBatch) -> Result<Tensor> {
    const OP: &str = "paged_attention";
    let slots = check(OP, qkv, h, k_cache, v_cache, batch)?;
    host_only(OP, qkv.device())?;
    let d = batch.dims(h, slots);
    let mut dims = qkv.dims().to_vec();
    *dims.last_mut().expect("checked rank") = h.q_heads * h.head_dim;
    let qkv = qkv.contiguous()?;
    let range = qkv.layout().contiguous_range().expect("contiguous");
    let (kr, vr) = (k_cache.layout().contiguous_range().expect("checked"), v_cache.layout().contiguous_range().expect("checked"));
    let (g, kg, vg) = (qkv.read(), k_cache.read(), v_cache.read());
    let (Storage::Cpu(x), Storage::Cpu(k), Storage::Cpu(v)) = (&*g, &*kg, &*vg) else { unreachable!("host devices checked") };
    macro_rules! go {
        ($c:ty, $s:ty) => {{
            let mut out = vec![<$s>::default(); d.out_len()];
            attend_kernel::<$c, $s>(
                &d,
                &x.as_slice::<$s>().expect("dtype")[range],
                &k.as_slice::<$s>().expect("dtype")[kr],
                &v.as_slice::<$s>().expect("dtype")[vr],
                &batch.positions,
                &batch.token_seq,
                &batch.block_tables,
                &mut out,
            );
            Tensor::from_vec(out, dims, qkv.device())
        }};
    }
    match qkv.dtype() {
        DType::F32 => go!(f32, f32),
        DType::F64 => go!(f64, f64),
        DType::BF16 => go!(f32, bf16),
        other => Err(Error::DType { op: OP, expected: "f32, f64 or bf16".into(), got: other, hint: "; serve in f32 or bf16" }),
    }
}

/// Copies rows `from·rows..(from+1)·rows` of `cache` onto rows
/// `to·rows..(to+1)·rows`, for each `(from, to)` in `pairs`, in place: a
/// paged cache's copy-on-write, block by block (`rows` = the block size).
pub fn copy_blocks(cache: &Tensor, rows: usize, pairs: &[(usize, usize)]) -> Result<()> {
    const OP: &str = "copy_blocks";
    host_only(OP, cache.device())?;
    let total = cache.dims().first().copied().unwrap_or(0);
    if rows == 0 || !total.is_multiple_of(rows) || !cache.is_contiguous() {
        return Err(Error::invalid(OP, format!("a cache {} in blocks of {rows} rows; it must be contiguous and whole blocks", cache.shape())));
    }
    let blocks = total / rows;
    if let Some((a, b)) = pairs.iter().find(|(a, b)| *a >= blocks || *b >= blocks || a == b) {
        return Err(Error::invalid(OP, format!("block copy {a} → {b} in a cache of {blocks} blocks; copy between two distinct blocks of the cache")));
    }
    let row = cache.elem_count() / total.max(1) * rows;
    let range = cache.layout().contiguous_range().expect("checked");
    let mut g = cache.write();
    let Storage::Cpu(s) = &mut *g else { unreachable!("host device checked") };
    macro_rules! go {
        ($t:ty) => {{
            let data = &mut s.as_mut_slice::<$t>().expect("dtype")[range];
            for &(a, b) in pairs {
                data.copy_within(a * row..(a + 1) * row, b * row);
            }
        }};
    }
    match cache.dtype() {
        DType::F32 => go!(f32),
        DType::F64 => go!(f64),
        DType::BF16 => go!(bf16),
        DType::F16 => go!(half::f16),
        other => return Err(Error::DType { op: OP, expected: "a float cache".into(), got: other, hint: "" }),
    }
    Ok(())
}
