//! Moving token rows between the ranks of the expert-parallel group: the
//! dispatch of routed tokens to the ranks holding their experts, and the
//! combine that brings the experts' outputs back.

use crate::module::{Act, Dispatched};
use tessera_core::tensor::Tensor;
use tessera_core::Device;
use tessera_core::{Error, Result};
use tessera_dist::Communicator;

/// Who sends how many rows to whom in one forward. Both sides know it after
/// one exchange of counts; the backward reuses it (its gradients travel the
/// same routes in the opposite directions).
///
/// Rows sent to a rank are grouped by that rank's local experts, in expert
/// order; the rows a rank receives are in source-rank order, each source's
/// rows grouped by expert.
#[derive(Debug)]
pub(super) struct Plan {
    /// `send[q][j]`: rows this rank sends to rank `q` for its local expert `j`.
    send: Vec<Vec<usize>>,
    /// `recv[s][j]`: rows this rank receives from rank `s` for its local expert `j`.
    recv: Vec<Vec<usize>>,
}

impl Plan {
    /// Exchanges the counts `send[q][j]` (one `u32` per local expert of each
    /// destination) so every rank learns what it will receive. No
    /// communication in a group of one rank.
    pub fn exchange(comm: &dyn Communicator, send: Vec<Vec<usize>>, device: &Device) -> Result<Plan> {
        if comm.size() == 1 {
            return Ok(Plan { recv: send.clone(), send });
        }
        let local = send.first().map_or(0, Vec::len);
        let parts = send.iter().map(|c| Tensor::from_vec(c.iter().map(|&v| v as u32).collect::<Vec<u32>>(), [c.len()], device)).collect::<Result<Vec<_>>>()?;
        let got = comm.all_to_all(parts)?;
        let recv = got
            .iter()
            .enumerate()
            .map(|(s, t)| {
                if t.elem_count() != local {
                    return Err(Error::CollectiveMismatch {
                        op: "Moe",
                        detail: format!(
                            "rank {s} of the expert-parallel group sent counts for {} local experts, this rank holds {local}; build the layer with the same number of experts and the same ep degree on every rank",
                            t.elem_count()
                        ),
                    });
                }
                Ok(t.to_vec::<u32>()?.into_iter().map(|v| v as usize).collect())
            })
            .collect::<Result<Vec<Vec<usize>>>>()?;
        Ok(Plan { send, recv })
    }

    /// Rows each local expert receives, from all ranks.
    pub fn received_per_expert(&self) -> Vec<usize> {
        let local = self.recv.first().map_or(0, Vec::len);
        (0..local).map(|j| self.recv.iter().map(|r| r[j]).sum()).collect()
    }

    /// The received rows regrouped by local expert (expert by expert, each
    /// expert's rows in source-rank order): their indices in the received order.
    pub fn expert_order(&self) -> Vec<u32> {
        let local = self.recv.first().map_or(0, Vec::len);
        let mut starts = Vec::with_capacity(self.recv.len());
        let mut at = 0;
        for r in &self.recv {
            starts.push(at);
            at += r.iter().sum::<usize>();
        }
        let mut order = Vec::with_capacity(at);
        for j in 0..local {
            for (r, &start) in self.recv.iter().zip(&starts) {
                let from = start + r[..j].iter().sum::<usize>();
                order.extend((from..from + r[j]).map(|i| i as u32));
            }
        }
        order
    }

    /// Sends `rows` (`[sent, d]`, in send order) to the ranks of their
    /// experts; returns the rows this rank received (`[received, d]`).
    pub fn dispatch(&self, comm: &dyn Communicator, rows: &Tensor) -> Result<Act<Dispatched>> {
        Ok(Act::new(exchange(comm, rows, &totals(&self.send), &totals(&self.recv))?))
    }

    /// Returns one row per received row (`[received, d]`) to the rank it
    /// came from; the result is in this rank's send order (`[sent, d]`).
    pub fn combine(&self, comm: &dyn Communicator, rows: Act<Dispatched>) -> Result<Tensor> {
        exchange(comm, rows.tensor(), &totals(&self.recv), &totals(&self.send))
    }
}

fn totals(counts: &[Vec<usize>]) -> Vec<usize> {
    counts.iter().map(|c| c.iter().sum()).collect()
}

/// Sends consecutive blocks of `out[q]` rows of `rows` to each rank `q` and
/// joins the blocks received, `inn[s]` rows from each rank `s`, in rank order.
fn exchange(comm: &dyn Communicator, rows: &Tensor, out: &[usize], inn: &[usize]) -> Result<Tensor> {
    if comm.size() == 1 {
        return Ok(rows.clone());
    }
    let d = rows.dims()[1];
    let (dtype, device) = (rows.dtype(), rows.device());
    let mut parts = Vec::with_capacity(out.len());
    let mut at = 0;
    for &m in out {
        parts.push(if m == 0 { Tensor::zeros([0, d], dtype, device)? } else { rows.narrow(0, at, m)?.contiguous()? });
        at += m;
    }
    let got = comm.all_to_all(parts)?;
    for (s, (t, &m)) in got.iter().zip(inn).enumerate() {
        if t.dims() != [m, d] {
            return Err(Error::CollectiveMismatch {
                op: "Moe",
                detail: format!("rank {s} of the expert-parallel group sent rows of shape {}, where [{m}, {d}] was agreed", t.shape()),
            });
        }
    }
    let total: usize = inn.iter().sum();
    let filled: Vec<&Tensor> = got.iter().filter(|t| t.elem_count() > 0).collect();
    match filled.as_slice() {
        [] => Tensor::zeros([0, d], dtype, device),
        [one] => Ok((*one).clone()),
        many => Tensor::concat_flat(many)?.reshape([total, d]),
    }
}
