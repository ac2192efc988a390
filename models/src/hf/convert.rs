//! Layout conversions between a Tessera parameter and the Hugging Face
//! tensors that store it.

use tessera::{Result, Tensor};

/// How a Tessera parameter (its global tensor) is laid out in the Hugging
/// Face tensors that store it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Conversion {
    /// A vocabulary table (token embedding, output head) whose first
    /// `stored` rows are the checkpoint's; the rows past them are padding
    /// (see [`vocab`](crate::vocab)): zero on import, left out on export.
    Vocab {
        /// The vocabulary size the checkpoint stores.
        stored: usize,
    },
    /// One tensor of the same shape and element order.
    Identity,
    /// One 2-D tensor stored transposed: GPT-2's `Conv1D` weights are
    /// `[in, out]`, a Tessera [`Linear`](tessera::nn::Linear) weight is `[out, in]`.
    Transpose,
    /// An attention projection's query/key/value outputs (a weight
    /// `[rows, in]` or a bias `[rows]`). Tessera packs its rows per key/value
    /// group, as [`CausalAttention`](tessera::nn::CausalAttention) reads them:
    /// for each group `g`, its `q / kv` query heads, then key head `g`, then
    /// value head `g`, each `dim` rows. Hugging Face keeps all query heads,
    /// then all key heads, then all value heads, in `storage`.
    Qkv {
        /// The head counts and width.
        heads: QkvHeads,
        /// How Hugging Face stores the three parts.
        storage: QkvStorage,
    },
}

/// Query and key/value head counts and the values per head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QkvHeads {
    /// Query heads.
    pub q: usize,
    /// Key/value heads (a divisor of `q`).
    pub kv: usize,
    /// Values per head.
    pub dim: usize,
}

/// How Hugging Face stores an attention projection's query, key and value parts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QkvStorage {
    /// Three tensors, query `[q·dim, ..]`, key and value `[kv·dim, ..]`
    /// (Llama's `q_proj`, `k_proj`, `v_proj`).
    Separate,
    /// One tensor `[(q + 2·kv)·dim, ..]`: query, key, value one after the
    /// other; stored transposed when `transposed` (GPT-2's `c_attn` weight,
    /// `[in, 3·d]`; its bias is not transposed).
    Fused {
        /// Whether the stored 2-D tensor is the transpose.
        transposed: bool,
    },
}

impl QkvHeads {
    /// Rows of the query part, and of the key part (= the value part).
    fn rows(self) -> (usize, usize) {
        (self.q * self.dim, self.kv * self.dim)
    }
}

/// `dims` with the first entry replaced by `rows`.
fn with_rows(dims: &[usize], rows: usize) -> Vec<usize> {
    let mut d = dims.to_vec();
    d[0] = rows;
    d
}

fn transposed(t: &Tensor) -> Result<Tensor> {
    t.t()?.contiguous()
}

impl Conversion {
    /// The shapes of the Hugging Face tensors that store a parameter of
    /// global shape `global`, in order.
    pub fn hf_shapes(&self, global: &[usize]) -> Vec<Vec<usize>> {
        match *self {
            Conversion::Identity => vec![global.to_vec()],
            Conversion::Vocab { stored } => vec![with_rows(global, stored)],
            Conversion::Transpose => vec![global.iter().rev().copied().collect()],
            Conversion::Qkv { heads, storage } => {
                let (q, kv) = heads.rows();
                match storage {
                    QkvStorage::Separate => vec![with_rows(global, q), with_rows(global, kv), with_rows(global, kv)],
                    QkvStorage::Fused { transposed: true } if global.len() == 2 => vec![vec![global[1], global[0]]],
                    QkvStorage::Fused { .. } => vec![global.to_vec()],
                }
            }
        }
    }

    /// The parameter's global tensor from its Hugging Face tensors (of the
    /// shapes [`hf_shapes`](Self::hf_shapes) gives, in order); a padded
    /// vocabulary table without its padding rows, which loading adds.
    pub fn import(&self, hf: &[Tensor]) -> Result<Tensor> {
        match *self {
            Conversion::Identity | Conversion::Vocab { .. } => Ok(hf[0].clone()),
            Conversion::Transpose => transposed(&hf[0]),
            Conversion::Qkv { heads, storage } => {
                let (qr, kvr) = heads.rows();
                let (q, k, v) = match storage {
                    QkvStorage::Separate => (hf[0].clone(), hf[1].clone(), hf[2].clone()),
                    QkvStorage::Fused { transposed: t } => {
                        let all = if t && hf[0].rank() == 2 { transposed(&hf[0])? } else { hf[0].clone() };
                        (all.narrow(0, 0, qr)?, all.narrow(0, qr, kvr)?, all.narrow(0, qr + kvr, kvr)?)
                    }
                };
                // Group g: its query heads, its key head, its value head.
                let per_group = qr / heads.kv;
                let mut parts = Vec::with_capacity(3 * heads.kv);
                for g in 0..heads.kv {
                    parts.push(q.narrow(0, g * per_group, per_group)?);
                    parts.push(k.narrow(0, g * heads.dim, heads.dim)?);
                    parts.push(v.narrow(0, g * heads.dim, heads.dim)?);
                }
                let refs: Vec<&Tensor> = parts.iter().collect();
                Tensor::concat_flat(&refs)?.reshape(with_rows(q.dims(), qr + 2 * kvr))
            }
        }
    }

    /// The Hugging Face tensors storing a parameter whose global tensor is
    /// `t` (the inverse of [`import`](Self::import)).
    pub fn export(&self, t: &Tensor) -> Result<Vec<Tensor>> {
        match *self {
            Conversion::Identity => Ok(vec![t.contiguous()?]),
            Conversion::Vocab { stored } => Ok(vec![t.narrow(0, 0, stored)?.contiguous()?]),
            Conversion::Transpose => Ok(vec![transposed(t)?]),
            Conversion::Qkv { heads, storage } => {
                let (qr, kvr) = heads.rows();
                let per_group = qr / heads.kv;
                let width = t.elem_count() / t.dims()[0];
                let groups = t.reshape([heads.kv, per_group + 2 * heads.dim, width])?;
                let part = |start: usize, rows: usize, total: usize| -> Result<Tensor> {
                    groups.narrow(1, start, rows)?.contiguous()?.reshape(with_rows(t.dims(), total))
                };
                let (q, k, v) = (part(0, per_group, qr)?, part(per_group, heads.dim, kvr)?, part(per_group + heads.dim, heads.dim, kvr)?);
                match storage {
                    QkvStorage::Separate => Ok(vec![q, k, v]),
                    QkvStorage::Fused { transposed: tr } => {
                        let all = Tensor::concat_flat(&[&q, &k, &v])?.reshape(t.dims().to_vec())?;
                        Ok(vec![if tr && all.rank() == 2 { transposed(&all)? } else { all }])
                    }
                }
            }
        }
    }
}
