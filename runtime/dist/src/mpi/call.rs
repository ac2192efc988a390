//! What the ranks tell each other before the data moves: the call each made
//! (for the mismatch check) and the shapes of the tensors they send (for
//! all-to-all and point-to-point messages), as fixed-size records of `u64`s
//! that MPI moves in one small collective or message.

use crate::call::{dtype_code, dtype_of_code};
pub(super) use crate::call::{Call, Meta, Op, MAX_DIMS};
use tessera_core::{Error, Result};

/// Words of a shape record: dtype, rank, dimensions.
pub(super) const SHAPE_WORDS: usize = 2 + MAX_DIMS;

/// Words of a call record: a tag, the operation and its argument, the
/// caller's collective number, whether its arguments were valid, and the
/// shape of its tensor.
pub(super) const CALL_WORDS: usize = 5 + SHAPE_WORDS;

/// Tells a call record from anything else (a record of another version).
const CALL_TAG: u64 = 0x7E55_E8A0_C411_0001;

/// One rank's record of its call: the call, its number in the group, and
/// whether its own arguments were valid.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Record {
    pub call: Call,
    pub step: u64,
    pub valid: bool,
}

impl Record {
    pub(super) fn encode(&self) -> [u64; CALL_WORDS] {
        let mut w = [0u64; CALL_WORDS];
        let (code, arg) = self.call.op.code();
        w[0] = CALL_TAG;
        w[1] = u64::from(code);
        w[2] = arg;
        w[3] = self.step;
        w[4] = u64::from(self.valid);
        w[5..].copy_from_slice(&encode_shape(self.call.meta.as_ref()));
        w
    }

    /// The record in `w`, or `None` when it is not one (a peer that sent
    /// something else: a different build, or memory corrupted in transit).
    pub(super) fn decode(w: &[u64]) -> Option<Record> {
        if w.len() != CALL_WORDS || w[0] != CALL_TAG {
            return None;
        }
        let op = Op::from_code(u8::try_from(w[1]).ok()?, w[2])?;
        let meta = decode_shape(&w[5..]).ok()?;
        Some(Record { call: Call { op, meta }, step: w[3], valid: w[4] == 1 })
    }
}

/// A shape record; `None` is a record of dtype code 0.
pub(super) fn encode_shape(meta: Option<&Meta>) -> [u64; SHAPE_WORDS] {
    let mut w = [0u64; SHAPE_WORDS];
    if let Some((dtype, dims)) = meta {
        w[0] = u64::from(dtype_code(*dtype));
        // Callers check the rank first ([`check_dims`]); a longer shape
        // would be cut here.
        let n = dims.len().min(MAX_DIMS);
        w[1] = n as u64;
        for (slot, &d) in w[2..2 + n].iter_mut().zip(dims) {
            *slot = d as u64;
        }
    }
    w
}

/// The shape in a record, refusing what no rank could have sent.
pub(super) fn decode_shape(w: &[u64]) -> Result<Option<Meta>> {
    let bad = |what: &str| Error::CollectiveMismatch { op: "shape record", detail: format!("a peer sent a shape record that does not parse ({what})") };
    let dtype = match w[0] {
        0 => return Ok(None),
        code => u8::try_from(code).ok().and_then(dtype_of_code).ok_or_else(|| bad("unknown dtype"))?,
    };
    let n = usize::try_from(w[1]).ok().filter(|&n| n <= MAX_DIMS).ok_or_else(|| bad("too many dimensions"))?;
    let dims = w[2..2 + n].iter().map(|&d| usize::try_from(d).map_err(|_| bad("dimension out of range"))).collect::<Result<Vec<_>>>()?;
    dims.iter().try_fold(dtype.size_in_bytes(), |acc, &d| acc.checked_mul(d)).ok_or_else(|| bad("more bytes than memory holds"))?;
    Ok(Some((dtype, dims)))
}

/// Refuses shapes a record cannot carry.
pub(super) fn check_dims(op: &'static str, dims: &[usize]) -> Result<()> {
    if dims.len() > MAX_DIMS {
        return Err(Error::unsupported(
            op,
            format!("a tensor of {} dimensions: the MPI communicator carries shapes of at most {MAX_DIMS}; reshape it", dims.len()),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_core::tensor::DType;

    #[test]
    fn records_round_trip_and_refuse_garbage() {
        let ops = [Op::AllReduce, Op::AllGather { dim: 2 }, Op::ReduceScatter { dim: 1 }, Op::Broadcast { root: 3 }, Op::AllToAll, Op::Barrier];
        for (i, op) in ops.into_iter().enumerate() {
            let meta = (i % 2 == 0).then(|| (DType::BF16, vec![i, 3, 7]));
            let r = Record { call: Call { op, meta }, step: 40 + i as u64, valid: i != 3 };
            assert_eq!(Record::decode(&r.encode()), Some(r));
        }
        let mut w = Record { call: Call { op: Op::AllReduce, meta: None }, step: 0, valid: true }.encode();
        w[0] ^= 1;
        assert_eq!(Record::decode(&w), None);
        let mut s = encode_shape(Some(&(DType::F32, vec![2, 3])));
        s[1] = 99;
        assert!(decode_shape(&s).is_err());
        s[1] = 2;
        s[2] = u64::MAX;
        assert!(decode_shape(&s).is_err());
        assert!(check_dims("x", &[1; 17]).is_err());
    }
}
