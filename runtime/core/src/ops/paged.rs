//! Attention over a paged key/value cache, for serving: writing a step's keys
//! and values into their slots, and attending through block tables.
//!
//! The layouts and the arithmetic are those of
//! [`tessera_kernels::cpu::paged`]: each layer's cache is a key and a value
//! tensor `[slots, kv_heads, head_dim]`, slots grouped in blocks of
//! `block_size`, and a step's tokens come flattened with their sequence and
//! position (a [`PagedBatch`]).
//!
//! On a CUDA device both run the kernels of `kernels/cuda/paged_attention.cu`
//! (geometry in [`tessera_kernels::cuda::paged`]): the host checks every
//! index first, then uploads the step's positions, sequences, slots and
//! block tables for the call (a few kilobytes: one `u32` per token, and the
//! tables), so a bad index is an error here, never a fault in a kernel.

use super::QkvHeads;
use crate::backend::cuda::args::{Arg, Grid};
use crate::backend::cuda::{self, CudaDevice, CudaStorage};
use crate::backend::kernel::Out;
use crate::backend::{Device, Storage};
use crate::error::{Error, Result};
use crate::tensor::{check_device, check_float, DType, Shape, Tensor};
use half::{bf16, f16};
use std::ops::Range;
use tessera_kernels::cpu::paged::{kv_cache_write as write_kernel, paged_attention as attend_kernel, PagedDims};
use tessera_kernels::cuda::paged as gpu;

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
    // The caches are written (or read) under their own locks while the input is read.
    for (name, c) in [("k_cache", k_cache), ("v_cache", v_cache)] {
        if qkv.shares_storage(c) {
            return Err(Error::Aliased { op, a: "qkv", b: name });
        }
    }
    batch.check(op, slots)?;
    Ok(slots)
}

/// A size the CUDA kernels do not support (a `head_dim` above 256): an
/// error naming the limit; the CPU runs it.
fn unsupported(op: &'static str, e: gpu::PagedLaunchError) -> Error {
    let e = e.to_string();
    Error::unsupported(op, format!("{}; the CPU backend runs any size", e.trim_start_matches("paged attention: ")))
}

/// The CUDA storage of a tensor on a CUDA device (its guard holds it).
fn on_cuda<'a>(op: &'static str, s: &'a Storage, device: &Device) -> Result<&'a CudaStorage> {
    match s {
        Storage::Cuda(s) => Ok(s),
        Storage::Cpu(_) => Err(Error::DeviceMismatch { op, lhs: device.to_string(), rhs: "cpu".into() }),
    }
}

/// Writes the keys and values of a step's tokens (from the packed input of
/// an attention layer, laid out as [`QkvHeads`] describes) into their slots
/// `batch.slots` of the caches, in place.
pub fn kv_cache_write(qkv: &Tensor, h: QkvHeads, k_cache: &Tensor, v_cache: &Tensor, batch: &PagedBatch) -> Result<()> {
    const OP: &str = "kv_cache_write";
    check_float(OP, qkv)?;
    let slots = check(OP, qkv, h, k_cache, v_cache, batch)?;
    let d = batch.dims(h, slots);
    let qkv = qkv.contiguous()?;
    let range = qkv.layout().contiguous_range().expect("contiguous");
    let (kr, vr) = (k_cache.layout().contiguous_range().expect("checked"), v_cache.layout().contiguous_range().expect("checked"));
    let g = qkv.read();
    let (mut kg, mut vg) = (k_cache.write(), v_cache.write());
    if let Device::Cuda(dev) = qkv.device() {
        let (x, k, v) = (on_cuda(OP, &g, qkv.device())?, on_cuda(OP, &kg, qkv.device())?, on_cuda(OP, &vg, qkv.device())?);
        return write_cuda(dev, qkv.dtype(), &d, batch, (x, range), (k, kr), (v, vr));
    }
    let (Storage::Cpu(x), Storage::Cpu(k), Storage::Cpu(v)) = (&*g, &mut *kg, &mut *vg) else { unreachable!("host devices checked") };
    // The write moves values without reading them, so it runs on bytes:
    // every offset is a multiple of `head_dim`, which in bytes is the
    // element size times as many.
    let size = qkv.dtype().size_in_bytes();
    let bytes = |r: Range<usize>| r.start * size..r.end * size;
    let d = PagedDims { head_dim: d.head_dim * size, ..d };
    write_kernel(&d, &x.as_bytes()[bytes(range)], &batch.slots, &mut k.as_bytes_mut()[bytes(kr)], &mut v.as_bytes_mut()[bytes(vr)]);
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
/// f32, f64, bf16 and f16 (the last two computed in f32) on the CPU; f32,
/// bf16 and f16 with `head_dim` up to 256 on a GPU (the same semantics,
/// sums in another order).
pub fn paged_attention(qkv: &Tensor, h: QkvHeads, k_cache: &Tensor, v_cache: &Tensor, batch: &PagedBatch) -> Result<Tensor> {
    const OP: &str = "paged_attention";
    let slots = check(OP, qkv, h, k_cache, v_cache, batch)?;
    let d = batch.dims(h, slots);
    let mut dims = qkv.dims().to_vec();
    *dims.last_mut().expect("checked rank") = h.q_heads * h.head_dim;
    let qkv = qkv.contiguous()?;
    let range = qkv.layout().contiguous_range().expect("contiguous");
    let (kr, vr) = (k_cache.layout().contiguous_range().expect("checked"), v_cache.layout().contiguous_range().expect("checked"));
    let (g, kg, vg) = (qkv.read(), k_cache.read(), v_cache.read());
    if let Device::Cuda(dev) = qkv.device() {
        let (x, k, v) = (on_cuda(OP, &g, qkv.device())?, on_cuda(OP, &kg, qkv.device())?, on_cuda(OP, &vg, qkv.device())?);
        return attend_cuda(dev, qkv.dtype(), &d, batch, (x, range), (k, kr), (v, vr), (Shape::new(dims), qkv.device()));
    }
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
        DType::F16 => {
            // The CPU kernels have no f16 storage form (`Stored<f32>` is f32
            // and bf16): widen the operands, which is exact, and round the
            // f32 result once, as the bf16 form would. It copies the whole
            // caches per call, so serve f32 or bf16 on a CPU; a GPU runs f16
            // natively.
            let widen = |x: &[f16]| x.iter().map(|v| v.to_f32()).collect::<Vec<f32>>();
            let (x, k, v) = (x.as_slice::<f16>().expect("dtype"), k.as_slice::<f16>().expect("dtype"), v.as_slice::<f16>().expect("dtype"));
            let mut out = vec![0f32; d.out_len()];
            attend_kernel::<f32, f32>(&d, &widen(&x[range]), &widen(&k[kr]), &widen(&v[vr]), &batch.positions, &batch.token_seq, &batch.block_tables, &mut out);
            Tensor::from_vec(out.into_iter().map(f16::from_f32).collect(), dims, qkv.device())
        }
        other => Err(Error::DType { op: OP, expected: "f32, f64, bf16 or f16".into(), got: other, hint: "; serve in f32 or bf16" }),
    }
}

/// Copies rows `from·rows..(from+1)·rows` of `cache` onto rows
/// `to·rows..(to+1)·rows`, for each `(from, to)` in `pairs`, in place: a
/// paged cache's copy-on-write, block by block (`rows` = the block size).
pub fn copy_blocks(cache: &Tensor, rows: usize, pairs: &[(usize, usize)]) -> Result<()> {
    const OP: &str = "copy_blocks";
    if matches!(cache.device(), Device::Cuda(_)) {
        // Copy-on-write happens only after a fork or a cut-back speculative
        // sequence; the device-to-device copy is not written yet.
        return Err(Error::NotImplementedOnCuda { op: OP });
    }
    check_float(OP, cache)?;
    let total = cache.dims().first().copied().unwrap_or(0);
    if rows == 0 || !total.is_multiple_of(rows) || !cache.is_contiguous() {
        return Err(Error::invalid(OP, format!("a cache {} in blocks of {rows} rows; it must be contiguous and whole blocks", cache.shape())));
    }
    let blocks = total / rows;
    if let Some((a, b)) = pairs.iter().find(|(a, b)| *a >= blocks || *b >= blocks || a == b) {
        return Err(Error::invalid(OP, format!("block copy {a} → {b} in a cache of {blocks} blocks; copy between two distinct blocks of the cache")));
    }
    // Bytes, whatever the dtype: a copy moves values without reading them.
    let size = cache.dtype().size_in_bytes();
    let row = cache.elem_count() / total.max(1) * rows * size;
    let range = cache.layout().contiguous_range().expect("checked");
    let mut g = cache.write();
    let Storage::Cpu(s) = &mut *g else { unreachable!("host device checked") };
    let data = &mut s.as_bytes_mut()[range.start * size..range.end * size];
    for &(a, b) in pairs {
        data.copy_within(a * row..(a + 1) * row, b * row);
    }
    Ok(())
}

/// The cache write on a GPU: `kv_cache_write_{dtype}` over every element of
/// the step's keys, with the slots uploaded for the call. The caches come as
/// the call's operands only for their device pointers: the caller holds
/// their write guards, so nothing else touches them while the copy is
/// queued, and the compute stream orders it before any later use.
fn write_cuda(
    dev: &CudaDevice,
    dtype: DType,
    d: &PagedDims,
    batch: &PagedBatch,
    x: (&CudaStorage, Range<usize>),
    k: (&CudaStorage, Range<usize>),
    v: (&CudaStorage, Range<usize>),
) -> Result<()> {
    const OP: &str = "kv_cache_write";
    let (op, items) = gpu::write(d).map_err(|e| unsupported(OP, e))?;
    cuda::run_op(OP, dev, dtype, &[x, k, v], &[], true, |c| {
        let slots = Arg::Scratch(c.upload_u32(&batch.slots)?);
        c.at_least(Arg::Input(0), d.qkv_len())?;
        c.at_least(Arg::Input(1), d.cache_len())?;
        c.at_least(Arg::Input(2), d.cache_len())?;
        c.at_least(slots, d.tokens)?;
        let (tokens, group) = (Arg::U64(d.tokens), Arg::U64(d.group()));
        let args = [Arg::Input(0), slots, Arg::Input(1), Arg::Input(2), tokens, Arg::U64(d.kv_heads), group, Arg::U64(d.head_dim), Arg::U64(d.slots)];
        // SAFETY: the kernel reads `tokens · (q_heads + 2·kv_heads) · head_dim` elements of
        // qkv (its length, checked) and `tokens` slots (uploaded), and writes rows `slot` of
        // the `[slots, kv_heads, head_dim]` caches (their lengths, checked), where every slot
        // is below `slots` (`PagedBatch::check`; the kernel also skips one that is not).
        unsafe { c.launch(gpu::SOURCE, op, Grid::Items(items), &args) }
    })?;
    Ok(())
}

/// The attention on a GPU: one block per (token, query head) of
/// `paged_attention_{dtype}`, with the positions, sequences and block tables
/// uploaded for the call. Returns `out` (`tokens · q_heads · head_dim`
/// elements) as a tensor of `shape` on `device`.
#[allow(clippy::too_many_arguments)]
fn attend_cuda(
    dev: &CudaDevice,
    dtype: DType,
    d: &PagedDims,
    batch: &PagedBatch,
    x: (&CudaStorage, Range<usize>),
    k: (&CudaStorage, Range<usize>),
    v: (&CudaStorage, Range<usize>),
    (shape, device): (Shape, &Device),
) -> Result<Tensor> {
    const OP: &str = "paged_attention";
    let l = gpu::attention(d).map_err(|e| unsupported(OP, e))?;
    let out = cuda::run_op(OP, dev, dtype, &[x, k, v], &[(d.out_len(), Out::Primary)], true, |c| {
        let positions = Arg::Scratch(c.upload_u32(&batch.positions)?);
        let token_seq = Arg::Scratch(c.upload_u32(&batch.token_seq)?);
        let tables = Arg::Scratch(c.upload_u32(&batch.block_tables)?);
        c.at_least(Arg::Input(0), d.qkv_len())?;
        c.at_least(Arg::Input(1), d.cache_len())?;
        c.at_least(Arg::Input(2), d.cache_len())?;
        c.at_least(Arg::Output(0), d.out_len())?;
        c.at_least(positions, d.tokens)?;
        c.at_least(token_seq, d.tokens)?;
        c.at_least(tables, d.seqs * d.table_width)?;
        let sizes = [d.tokens, d.q_heads, d.kv_heads, d.head_dim, d.block_size, d.table_width].map(Arg::U64);
        let mut args = vec![Arg::Input(0), Arg::Input(1), Arg::Input(2), positions, token_seq, tables, Arg::Output(0)];
        args.extend(sizes);
        args.push(Arg::F32(d.scale as f32));
        // SAFETY: a block reads the packed row of its token (qkv holds `tokens` rows, checked)
        // and the cache rows of positions `0..=positions[t]` of sequence `token_seq[t]`
        // through its row of the block tables (`seqs · table_width` entries, checked), and
        // `PagedBatch::check` proved every sequence below `seqs`, every position inside its
        // table and every block inside the cache (whose lengths are checked); it writes its
        // `head_dim` elements of `out` (`tokens · q_heads · head_dim`, checked).
        unsafe { c.launch(gpu::SOURCE, l.op, Grid::Fixed { blocks: l.grid, threads: l.block, shared_bytes: l.shared_bytes }, &args) }
    })?;
    // Mapped rather than popped: without the CUDA backend the storage type is
    // uninhabited, and a value of it would make what follows unreachable.
    Ok(out.into_iter().map(|s| Tensor::from_storage(Storage::Cuda(s), shape.clone(), device.clone())).next().expect("one output"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RngKey;
    use std::collections::HashSet;
    use std::panic::{catch_unwind, AssertUnwindSafe};

    /// Seeded random values from the kernels' counter-based generator.
    struct Draws {
        key: RngKey,
        next: u64,
    }

    impl Draws {
        fn new(seed: u64) -> Draws {
            Draws { key: RngKey::new(seed, 0x7061_6765_6400), next: 0 }
        }

        fn bits(&mut self) -> u64 {
            self.next += 2;
            u64::from(self.key.bits_at(self.next - 2)) << 32 | u64::from(self.key.bits_at(self.next - 1))
        }

        /// A value in `0..n`, `n > 0`.
        fn below(&mut self, n: usize) -> usize {
            (self.bits() % n as u64) as usize
        }

        fn chance(&mut self, percent: usize) -> bool {
            self.below(100) < percent
        }

        fn pick<T: Copy>(&mut self, from: &[T]) -> T {
            from[self.below(from.len())]
        }
    }

    /// Whether a cache of `slots` slots can run `b`, straight from the
    /// definition (in wide integers, so no sum or product can wrap): blocks of
    /// at least one slot, whole rows of at least one entry, one sequence,
    /// position and slot per token, whole blocks of cache, every table entry
    /// a block of the cache, every token in a row of the table and inside it,
    /// writing the slot its table puts it at, and no slot written twice.
    fn valid(b: &PagedBatch, slots: usize) -> bool {
        let (bs, width, tokens) = (b.block_size as u128, b.table_width as u128, b.positions.len());
        if bs == 0 || width == 0 || !(b.block_tables.len() as u128).is_multiple_of(width) {
            return false;
        }
        if b.token_seq.len() != tokens || b.slots.len() != tokens || !(slots as u128).is_multiple_of(bs) {
            return false;
        }
        if b.block_tables.iter().any(|&block| (u128::from(block) + 1) * bs > slots as u128) {
            return false;
        }
        let rows = b.block_tables.len() as u128 / width;
        let mut written = HashSet::new();
        (0..tokens).all(|t| {
            let (s, p) = (u128::from(b.token_seq[t]), u128::from(b.positions[t]));
            s < rows
                && p < width * bs
                && u128::from(b.slots[t]) == u128::from(b.block_tables[(s * width + p / bs) as usize]) * bs + p % bs
                && written.insert(b.slots[t])
        })
    }

    /// A random step and its cache size, usually one the cache can run: a
    /// few sequences whose block tables are drawn from the cache (sometimes
    /// sharing blocks, as forks and cached prefixes do), each with a run of
    /// positions or a random set of them, the tokens in a shuffled order.
    fn random_step(d: &mut Draws) -> (PagedBatch, usize) {
        let (bs, width, seqs) = (1 + d.below(4), 1 + d.below(4), d.below(4));
        let blocks = seqs * width + d.below(3);
        let mut order: Vec<u32> = (0..blocks as u32).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, d.below(i + 1));
        }
        let block_tables: Vec<u32> = if d.chance(20) { (0..seqs * width).map(|_| d.below(blocks) as u32).collect() } else { order[..seqs * width].to_vec() };
        let mut tokens = Vec::new();
        for s in 0..seqs {
            let room = width * bs;
            if d.chance(50) {
                let start = d.below(room + 1);
                tokens.extend((start..start + d.below(room - start + 1)).map(|p| (s, p)));
            } else {
                tokens.extend((0..room).filter(|_| d.chance(40)).map(|p| (s, p)));
            }
        }
        for i in (1..tokens.len()).rev() {
            tokens.swap(i, d.below(i + 1));
        }
        let slot = |s: usize, p: usize| (block_tables[s * width + p / bs] as usize * bs + p % bs) as u32;
        let batch = PagedBatch {
            block_size: bs,
            positions: tokens.iter().map(|&(_, p)| p as u32).collect(),
            token_seq: tokens.iter().map(|&(s, _)| s as u32).collect(),
            slots: tokens.iter().map(|&(s, p)| slot(s, p)).collect(),
            block_tables,
            table_width: width,
        };
        (batch, blocks * bs)
    }

    /// One random change, mostly one that breaks the step: a wrong length,
    /// a slot, position, sequence or block past what exists, a bad block
    /// size, width or cache size, huge values, two tokens on one slot.
    fn mutate(d: &mut Draws, b: &mut PagedBatch, slots: &mut usize) {
        const HUGE: [u32; 3] = [u32::MAX, u32::MAX - 1, 1 << 31];
        // Tokens every per-token vector has (an earlier change may have cut one).
        let n = b.positions.len().min(b.token_seq.len()).min(b.slots.len());
        let t = if n > 0 { d.below(n) } else { 0 };
        let (room, rows, blocks) = (b.table_width.saturating_mul(b.block_size), b.seqs(), *slots / b.block_size.max(1));
        let (huge, small) = (d.pick(&HUGE), d.below(3));
        match d.below(14) {
            0 => b.block_size = d.pick(&[0, b.block_size.saturating_add(1), b.block_size.saturating_sub(1), 1 << 40, usize::MAX]),
            1 => b.table_width = d.pick(&[0, b.table_width.saturating_add(1), b.table_width.saturating_sub(1), 1 << 40, usize::MAX]),
            2 => {
                let v = match d.below(3) {
                    0 => &mut b.positions,
                    1 => &mut b.token_seq,
                    _ => &mut b.slots,
                };
                if d.chance(50) || v.is_empty() {
                    v.push(d.below(8) as u32);
                } else {
                    v.pop();
                }
            }
            3 => {
                if d.chance(50) || b.block_tables.is_empty() {
                    b.block_tables.push(d.below(blocks.saturating_add(1)) as u32);
                } else {
                    b.block_tables.pop();
                }
            }
            4 if n > 0 => {
                let any = (d.bits() % slots.saturating_add(2) as u64) as u32;
                b.slots[t] = d.pick(&[b.slots[t].wrapping_add(1), b.slots[t].wrapping_sub(1), any, huge]);
            }
            5 if n > 0 => b.positions[t] = d.pick(&[room.min(u32::MAX as usize) as u32, room.saturating_add(small).min(u32::MAX as usize) as u32, huge]),
            6 if n > 0 => b.token_seq[t] = d.pick(&[rows as u32, (rows as u32).wrapping_add(1), huge]),
            7 if !b.block_tables.is_empty() => {
                let (i, any) = (d.below(b.block_tables.len()), d.below(blocks.max(1)) as u32);
                b.block_tables[i] = d.pick(&[blocks as u32, (blocks as u32).wrapping_add(1), any, huge]);
            }
            8 => {
                *slots =
                    d.pick(&[slots.saturating_add(1), slots.saturating_sub(1), 0, slots.saturating_mul(2), *slots / 2, usize::MAX, b.block_size.max(1) << 33])
            }
            9 if n > 0 => {
                // The same token twice: the same slot written twice.
                let (p, s, slot) = (b.positions[t], b.token_seq[t], b.slots[t]);
                b.positions.push(p);
                b.token_seq.push(s);
                b.slots.push(slot);
            }
            10 if n > 1 => {
                let u = (t + 1 + d.below(n - 1)) % n;
                b.slots.swap(t, u);
            }
            11 if n > 0 && room > 0 && b.block_size > 0 => {
                // Another position in the table, with the slot the table gives it.
                let p = d.below(room.min(1 << 20));
                let row = b.token_seq[t] as usize;
                if let Some(&block) = b.block_tables.get(row.saturating_mul(b.table_width).saturating_add(p / b.block_size)) {
                    b.positions[t] = p as u32;
                    b.slots[t] = (block as usize).wrapping_mul(b.block_size).wrapping_add(p % b.block_size) as u32;
                }
            }
            12 => {
                // A step with no tokens at all.
                b.positions.clear();
                b.token_seq.clear();
                b.slots.clear();
            }
            _ => {
                // One more token, anywhere.
                b.positions.push(d.below(2 * room.clamp(1, 1 << 20)) as u32);
                b.token_seq.push(d.below(rows + 2) as u32);
                b.slots.push((d.bits() % slots.saturating_add(2) as u64) as u32);
            }
        }
    }

    /// `PagedBatch::check` is the only thing between a step's indices and the
    /// kernels that index with them: over many random steps, mostly broken,
    /// it never panics, refuses exactly the steps the definition calls
    /// invalid, and the ops run every step it accepts without a panic.
    #[test]
    fn check_refuses_exactly_the_invalid_steps_and_the_ops_run_the_rest() {
        let dev = Device::cpu();
        let mut d = Draws::new(20);
        let (mut accepted, mut refused, mut ran) = (0, 0, 0);
        for case in 0..20_000 {
            let (mut b, mut slots) = random_step(&mut d);
            for _ in 0..[0, 1, 2, 2, 3][d.below(5)] {
                mutate(&mut d, &mut b, &mut slots);
            }
            let got = catch_unwind(AssertUnwindSafe(|| b.check("fuzz", slots)));
            let got = got.unwrap_or_else(|_| panic!("case {case}: check panicked on {b:?} with a cache of {slots} slots"));
            let want = valid(&b, slots);
            assert_eq!(got.is_ok(), want, "case {case}: check gave {got:?} on {b:?} with a cache of {slots} slots");
            if let Err(e) = got {
                assert!(matches!(e, Error::InvalidArgument { op: "fuzz", .. }), "case {case}: {e:?}");
                refused += 1;
                continue;
            }
            accepted += 1;
            if slots > 4096 {
                continue;
            }
            let kv_heads = 1 + d.below(2);
            let h = QkvHeads { q_heads: kv_heads * (1 + d.below(2)), kv_heads, head_dim: 1 + d.below(4) };
            let values = (0..b.tokens() * h.width()).map(|i| (i % 7) as f32 - 3.0).collect();
            let qkv = Tensor::from_vec::<f32>(values, [b.tokens(), h.width()], &dev).unwrap();
            let k = Tensor::zeros([slots, h.kv_heads, h.head_dim], DType::F32, &dev).unwrap();
            let v = Tensor::zeros([slots, h.kv_heads, h.head_dim], DType::F32, &dev).unwrap();
            let out = catch_unwind(AssertUnwindSafe(|| {
                kv_cache_write(&qkv, h, &k, &v, &b)?;
                paged_attention(&qkv, h, &k, &v, &b)
            }));
            let out = out.unwrap_or_else(|_| panic!("case {case}: the ops panicked on {b:?} ({h:?}) with a cache of {slots} slots"));
            let out = out.unwrap_or_else(|e| panic!("case {case}: the ops refused {b:?} ({h:?}) that check accepted: {e}"));
            assert_eq!(out.dims(), [b.tokens(), h.q_heads * h.head_dim], "case {case}");
            assert!(out.to_f32_vec().unwrap().iter().all(|x| x.is_finite()), "case {case}: {b:?}");
            ran += usize::from(b.tokens() > 0);
        }
        // Both answers must be common, and the ops must run real steps, or the test checks little.
        assert!(accepted > 4000 && refused > 12_000 && ran > 2000, "{accepted} steps accepted ({ran} with tokens run), {refused} refused");
    }

    /// The cache write and the block copy move bytes, whatever the dtype:
    /// in f32, f64, bf16 and f16 they leave exactly what the typed write (on
    /// the values widened to f64, which is exact) and a copy of the rows
    /// leave, and they refuse integer tensors.
    #[test]
    fn writes_and_block_copies_move_every_float_dtype_exactly() {
        let dev = Device::cpu();
        let h = QkvHeads { q_heads: 4, kv_heads: 2, head_dim: 3 };
        let (block, slots) = (2, 8);
        // Two sequences of 3 and 2 tokens in blocks [1, 3] and [0, 2].
        let b = PagedBatch {
            block_size: block,
            positions: vec![0, 1, 2, 0, 1],
            token_seq: vec![0, 0, 0, 1, 1],
            slots: vec![2, 3, 6, 0, 1],
            block_tables: vec![1, 3, 0, 2],
            table_width: 2,
        };
        let width = h.width();
        let qkv64 = Tensor::rand(crate::Init::Uniform { lo: -2.0, hi: 2.0 }, RngKey::new(5, 0), [b.tokens(), width], DType::F64, &dev).unwrap();
        for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
            let qkv = qkv64.to_dtype(dtype).unwrap();
            let zeros = || Tensor::zeros([slots, h.kv_heads, h.head_dim], dtype, &dev).unwrap();
            let (k, v) = (zeros(), zeros());
            kv_cache_write(&qkv, h, &k, &v, &b).unwrap();
            let exact = qkv.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap();
            let (mut wk, mut wv) = (vec![0f64; slots * h.kv_heads * h.head_dim], vec![0f64; slots * h.kv_heads * h.head_dim]);
            write_kernel(&b.dims(h, slots), &exact, &b.slots, &mut wk, &mut wv);
            let got = |t: &Tensor| t.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap();
            assert_eq!((got(&k), got(&v)), (wk.clone(), wv), "{dtype}: the cache write");
            let pairs = [(1, 2), (3, 0)];
            copy_blocks(&k, block, &pairs).unwrap();
            let row = block * h.kv_heads * h.head_dim;
            for (a, c) in pairs {
                wk.copy_within(a * row..(a + 1) * row, c * row);
            }
            assert_eq!(got(&k), wk, "{dtype}: the block copy");
        }
        let ints = Tensor::zeros([slots, h.kv_heads, h.head_dim], DType::I32, &dev).unwrap();
        assert!(matches!(copy_blocks(&ints, block, &[(0, 1)]), Err(Error::DType { .. })));
        let qkv = Tensor::zeros([b.tokens(), width], DType::I32, &dev).unwrap();
        assert!(matches!(kv_cache_write(&qkv, h, &ints, &ints, &b), Err(Error::DType { .. })));
    }
}
