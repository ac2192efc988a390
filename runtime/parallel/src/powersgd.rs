//! PowerSGD (Vogels, Karimireddy and Jaggi, 2019): data-parallel gradients
//! sent as rank-`r` factors, with error feedback.
//!
//! A weight's gradient, seen as an `n × m` matrix `M` (its first dimension
//! by the rest), is replaced on the wire by `P = M·Q` (`n × r`) and then
//! `Q' = Mᵀ·P̂` (`m × r`), where `Q` is the previous step's `Q'` (one power
//! iteration a step, warm-started) and `P̂` is the summed `P` with
//! orthonormal columns. Every rank then holds the same approximation
//! `P̂·Q'ᵀ` of the summed gradient: `(n + m)·r` values sent instead of
//! `n·m`. What the approximation missed of this rank's own gradient is
//! kept (error feedback) and added to the next step's, so nothing is lost,
//! only delayed; without it the method does not converge to the same loss.
//!
//! Vectors (biases, norms' gains) and matrices too small to gain
//! (`(n + m)·r ≥ n·m`) travel uncompressed, in the first of the two
//! all-reduces. All the factors of a group travel in one all-reduce per
//! phase. `Q` starts from the same random draw on every rank (counter-based,
//! keyed by the parameter's index), so no broadcast is needed.

use std::collections::HashMap;
use tessera_core::ops;
use tessera_core::tensor::{DType, Init, Tensor};
use tessera_core::{Error, Result, RngKey};
use tessera_dist::Communicator;
use tessera_nn::module::Param;

/// One compressed weight's state between steps.
struct Factors {
    /// What the approximations missed of this rank's gradient so far, `[n, m]`.
    error: Tensor,
    /// The right factor, `[m, r]`, the same on every rank.
    q: Tensor,
}

/// The state of PowerSGD for one engine's parameters: each compressed
/// parameter's error and right factor.
pub(crate) struct PowerSgd {
    rank: usize,
    /// Steps sent whole before the first compressed one.
    warmup: u64,
    /// Steps finished so far.
    steps: u64,
    factors: HashMap<usize, Factors>,
}

/// How one parameter's gradient travels this step.
enum Plan {
    /// Uncompressed, summed as is.
    Whole(Tensor),
    /// `M` (gradient plus error, `[n, m]` f32) and its `P = M·Q`.
    Factored { m: Tensor, p: Tensor },
}

impl PowerSgd {
    /// Rank-`rank` factors (1 to 4 is the usual range) after `warmup`
    /// steps sent whole; an error for rank 0.
    pub(crate) fn new(rank: usize, warmup: u64) -> Result<PowerSgd> {
        if rank == 0 {
            return Err(Error::config("powersgd rank", "must be at least 1 (1 to 4 is the usual range)"));
        }
        Ok(PowerSgd { rank, warmup, steps: 0, factors: HashMap::new() })
    }

    /// Whether this step is compressed (the warm-up is over).
    pub(crate) fn compressing(&self) -> bool {
        self.steps >= self.warmup
    }

    /// Counts a finished step.
    pub(crate) fn step(&mut self) {
        self.steps += 1;
    }

    /// `[n, m]` when a gradient of this local shape gains from factors.
    fn matrix(&self, dims: &[usize]) -> Option<(usize, usize)> {
        if dims.len() < 2 {
            return None;
        }
        let (n, m) = (dims[0], dims[1..].iter().product::<usize>());
        ((n + m) * self.rank < n * m).then_some((n, m))
    }

    /// Sums the gradients `grads` of `params` (indices `ids` into the
    /// engine's list, which key the state) over `group` and returns each
    /// one's sum as every rank will use it, times `scale`; with
    /// `shares` the number of summands (the group's size), whose share of
    /// the approximation each rank subtracts from its own gradient for the
    /// error. Adds the all-reduces it ran and the bytes it sent to `sent`.
    pub(crate) fn sum(
        &mut self,
        group: &dyn Communicator,
        ids: &[usize],
        params: &[Param],
        grads: Vec<Tensor>,
        scale: f64,
        sent: &mut Sent,
    ) -> Result<Vec<Tensor>> {
        let shares = group.size() as f64;
        let r = self.rank;
        // Everything computes and travels in f32, or in f64 when every
        // gradient is f64 (gradient checks).
        let dtype = if grads.iter().all(|g| g.dtype() == DType::F64) { DType::F64 } else { DType::F32 };
        // Phase 1: P = (G + E)·Q for the matrices, the rest as they are.
        let mut plans = Vec::with_capacity(grads.len());
        for ((&id, p), g) in ids.iter().zip(params).zip(grads) {
            let dims = p.local_shape().dims().to_vec();
            let Some((n, m)) = self.matrix(&dims) else {
                plans.push(Plan::Whole(g));
                continue;
            };
            let g = g.to_dtype(dtype)?.reshape([n, m])?;
            let state = match self.factors.entry(id) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(v) => {
                    let q = Tensor::rand(Init::Normal { mean: 0.0, std: 1.0 }, RngKey::new(0x9057_56d0, id as u64), [m, r], dtype, g.device())?;
                    v.insert(Factors { error: Tensor::zeros([n, m], dtype, g.device())?, q })
                }
            };
            let mat = ops::add(&g, &state.error)?;
            let p = ops::matmul(&mat, &state.q)?;
            plans.push(Plan::Factored { m: mat, p });
        }
        let first: Vec<Tensor> = plans
            .iter()
            .map(|pl| match pl {
                Plan::Whole(g) => g.to_dtype(dtype),
                Plan::Factored { p, .. } => Ok(p.clone()),
            })
            .collect::<Result<_>>()?;
        let summed = all_reduce_parts(group, &first, sent)?;
        // Phase 2: Q' = Mᵀ·P̂ with P̂ the summed P made orthonormal.
        let mut hats = Vec::new();
        let mut second = Vec::new();
        for (pl, s) in plans.iter().zip(&summed) {
            if let Plan::Factored { m, .. } = pl {
                let hat = orthonormal_columns(s)?;
                second.push(ops::matmul(&m.t()?, &hat)?);
                hats.push(hat);
            }
        }
        let qs = if second.is_empty() { Vec::new() } else { all_reduce_parts(group, &second, sent)? };
        // Every rank: the approximation P̂·Q'ᵀ of the sum; Q' warm-starts the next step.
        let mut out = Vec::with_capacity(plans.len());
        let mut factored = hats.into_iter().zip(qs);
        for ((pl, s), (&id, p)) in plans.into_iter().zip(summed).zip(ids.iter().zip(params)) {
            let shape = p.local_shape().clone();
            match pl {
                Plan::Whole(_) => out.push(ops::scale(&s, scale)?.reshape(shape)?),
                Plan::Factored { m, .. } => {
                    let (hat, q) = factored.next().expect("one per factored gradient");
                    let approx = ops::matmul(&hat, &q.t()?)?;
                    let state = self.factors.get_mut(&id).expect("created in phase 1");
                    state.error = ops::sub(&m, &ops::scale(&approx, 1.0 / shares)?)?;
                    state.q = q;
                    out.push(ops::scale(&approx, scale)?.reshape(shape)?);
                }
            }
        }
        Ok(out)
    }
}

/// What was sent: all-reduces and bytes.
#[derive(Default)]
pub(crate) struct Sent {
    pub(crate) collectives: usize,
    pub(crate) bytes: usize,
}

/// `parts` summed over `group` in one all-reduce, split back.
fn all_reduce_parts(group: &dyn Communicator, parts: &[Tensor], sent: &mut Sent) -> Result<Vec<Tensor>> {
    let flat = Tensor::concat_flat(&parts.iter().collect::<Vec<_>>())?;
    sent.collectives += 1;
    sent.bytes += flat.elem_count() * flat.dtype().size_in_bytes();
    let summed = group.all_reduce_sum(&flat)?;
    let mut offset = 0;
    parts
        .iter()
        .map(|p| {
            let n = p.elem_count();
            let t = summed.narrow(0, offset, n)?.reshape(p.shape().clone())?;
            offset += n;
            Ok(t)
        })
        .collect()
}

/// `p` (`[n, r]`) with orthonormal columns spanning the same space, by
/// Gram-Schmidt in f64 (twice, for the rounding of nearly parallel
/// columns). A column that vanishes (a zero gradient) is left zero.
fn orthonormal_columns(p: &Tensor) -> Result<Tensor> {
    let (n, r) = (p.dims()[0], p.dims()[1]);
    let v = p.to_f64_vec()?;
    let mut cols: Vec<Vec<f64>> = (0..r).map(|j| (0..n).map(|i| v[i * r + j]).collect()).collect();
    for j in 0..r {
        for _ in 0..2 {
            for k in 0..j {
                let dot: f64 = cols[j].iter().zip(&cols[k]).map(|(a, b)| a * b).sum();
                let (done, rest) = cols.split_at_mut(j);
                rest[0].iter_mut().zip(&done[k]).for_each(|(a, b)| *a -= dot * b);
            }
        }
        let norm = cols[j].iter().map(|a| a * a).sum::<f64>().sqrt();
        if norm > 1e-30 {
            cols[j].iter_mut().for_each(|a| *a /= norm);
        } else {
            cols[j].iter_mut().for_each(|a| *a = 0.0);
        }
    }
    let out: Vec<f64> = (0..n * r).map(|x| cols[x % r][x / r]).collect();
    Tensor::from_vec(out, [n, r], p.device())?.to_dtype(p.dtype())
}

#[cfg(test)]
mod tests {
    use super::orthonormal_columns;
    use tessera_core::tensor::{DType, Init, Tensor};
    use tessera_core::{Device, RngKey};

    #[test]
    fn columns_come_out_orthonormal_and_span_the_input() {
        let dev = Device::cpu();
        for (n, r, seed) in [(7, 1, 1), (16, 3, 2), (40, 4, 3)] {
            let p = Tensor::rand(Init::Normal { mean: 0.0, std: 1.0 }, RngKey::new(seed, 0), [n, r], DType::F32, &dev).unwrap();
            let q = orthonormal_columns(&p).unwrap().to_f64_vec().unwrap();
            let pv = p.to_f64_vec().unwrap();
            for a in 0..r {
                for b in 0..r {
                    let dot: f64 = (0..n).map(|i| q[i * r + a] * q[i * r + b]).sum();
                    assert!((dot - f64::from(u8::from(a == b))).abs() < 1e-5, "{n}x{r}: <q{a}, q{b}> = {dot}");
                }
                // Each input column is in the span: its projection on q is itself.
                let coef: Vec<f64> = (0..r).map(|b| (0..n).map(|i| pv[i * r + a] * q[i * r + b]).sum()).collect();
                for i in 0..n {
                    let back: f64 = (0..r).map(|b| coef[b] * q[i * r + b]).sum();
                    assert!((back - pv[i * r + a]).abs() < 1e-4, "{n}x{r}: column {a} row {i}");
                }
            }
        }
    }
}
