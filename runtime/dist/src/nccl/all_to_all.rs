//! All-to-all through NCCL: parts of any shape and dtype, one per rank.
//!
//! NCCL has no all-to-all of uneven parts, and a receiver must know how much
//! it receives before it posts the receive. So the ranks first all-gather a
//! small table that describes every part (dtype and dims), read it on the
//! host (the one host wait of this collective), allocate what they receive,
//! and then exchange the parts with one send and one receive per peer inside
//! an NCCL group, which NCCL runs as a single all-to-all.

use super::raw::nccl_type;
use super::{address, NcclCommunicator};
use crate::Communicator;
use cudarc::nccl::result;
use tessera_core::tensor::{DType, Shape, Tensor};
use tessera_core::{Error, Result};

/// Most dimensions a part may have (the table has a fixed row per part).
const MAX_DIMS: usize = 8;
/// One row of the table: dtype, number of dims, the dims.
const ROW: usize = 2 + MAX_DIMS;
/// Every dtype, by its code in the table.
const DTYPES: [DType; 6] = [DType::F32, DType::F64, DType::BF16, DType::F16, DType::I32, DType::U32];

/// This rank's row describing `part`.
fn describe(op: &'static str, peer: usize, part: &Tensor) -> Result<[u32; ROW]> {
    let mut row = [0u32; ROW];
    row[0] = DTYPES.iter().position(|&d| d == part.dtype()).expect("every dtype has a code") as u32;
    if part.rank() > MAX_DIMS {
        return Err(Error::unsupported(
            op,
            format!("the part for rank {peer} has {} dims; at most {MAX_DIMS} travel through NCCL, reshape it first", part.rank()),
        ));
    }
    row[1] = part.rank() as u32;
    for (slot, &d) in row[2..].iter_mut().zip(part.dims()) {
        *slot = u32::try_from(d).map_err(|_| {
            Error::unsupported(op, format!("the part for rank {peer} has a dimension of {d} elements; at most {} travel through NCCL, split it", u32::MAX))
        })?;
    }
    Ok(row)
}

/// The dtype and shape a row describes.
fn read_row(row: &[u32]) -> (DType, Shape) {
    let dims: Vec<usize> = row[2..2 + row[1] as usize].iter().map(|&d| d as usize).collect();
    (DTYPES[row[0] as usize], Shape::new(dims))
}

impl NcclCommunicator {
    pub(super) fn all_to_all_parts(&self, parts: Vec<Tensor>) -> Result<Vec<Tensor>> {
        let op = "all_to_all";
        let (size, me) = (self.size(), self.rank());
        if parts.len() != size {
            return Err(Error::invalid(op, format!("{} parts given, a group of {size} ranks takes exactly {size} (one per rank)", parts.len())));
        }
        let sent: Vec<Tensor> = parts.iter().map(|p| self.input(op, p)).collect::<Result<_>>()?;
        let mut table = Vec::with_capacity(size * ROW);
        for (peer, p) in sent.iter().enumerate() {
            table.extend_from_slice(&describe(op, peer, p)?);
        }
        // Row `me` of every sender's table: what this rank receives.
        let table = Tensor::from_vec(table, [size * ROW], &self.device())?;
        let tables = self.all_gather(&table, 0)?.to_vec::<u32>()?;
        let incoming: Vec<(DType, Shape)> = (0..size).map(|s| read_row(&tables[(s * size + me) * ROW..][..ROW])).collect();

        let mut received: Vec<Option<Tensor>> = Vec::with_capacity(size);
        for (s, (dtype, shape)) in incoming.iter().enumerate() {
            received.push(if s == me { None } else { Some(self.output_of(*dtype, shape.clone())?) });
        }
        // (peer, send address, count, type) and (peer, receive address, count, type).
        let mut sends = Vec::new();
        let mut recvs = Vec::new();
        for peer in (0..size).filter(|&p| p != me) {
            let (part, got) = (&sent[peer], received[peer].as_ref().expect("allocated for every peer"));
            if part.elem_count() > 0 {
                sends.push((peer as i32, address(op, part)?, part.elem_count(), nccl_type(part.dtype())));
            }
            if got.elem_count() > 0 {
                recvs.push((peer as i32, address(op, got)?, got.elem_count(), nccl_type(got.dtype())));
            }
        }
        self.launch(op, |comm, stream| {
            result::group_start()?;
            let mut status = Ok(result::NcclStatus::Success);
            for &(peer, ptr, n, ty) in &sends {
                // SAFETY: `ptr` holds `n` elements of `ty` on this rank's
                // device, alive until the call has run (the parts outlive it
                // and the compute stream waits for the communication stream).
                status = status.and_then(|_| unsafe { result::send(ptr, n, ty, peer, comm, stream) });
            }
            for &(peer, ptr, n, ty) in &recvs {
                // SAFETY: as for the sends; the buffer has room for `n` elements.
                status = status.and_then(|_| unsafe { result::recv(ptr, n, ty, peer, comm, stream) });
            }
            // The group is closed whatever happened inside it.
            let end = result::group_end();
            status.and(end)
        })?;
        // The part addressed to this rank is returned as is.
        Ok(received.into_iter().zip(parts).map(|(got, own)| got.unwrap_or(own)).collect())
    }
}
