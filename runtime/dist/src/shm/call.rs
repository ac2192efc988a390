//! The record of a collective call a member writes for its peers at the
//! first step: the call (which collective, its arguments, the caller's
//! tensor), and whether the caller found its own arguments invalid.

use super::group::{CALL_FIXED, CALL_PART, CALL_TEXT};
use crate::call::{dtype_code, dtype_of_code, Call, Meta, Op, MAX_DIMS};

/// A member's call as its peers read it: the call, why the caller found
/// its own arguments invalid (if it did), an all-to-all's parts by
/// destination, and where the caller's tensors lie in its arena when it
/// offers to work in place.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Record {
    pub call: Call,
    pub invalid: Option<String>,
    pub parts: Vec<Meta>,
    pub place: Option<Place>,
}

/// Where a member's input and result lie in its arena (byte offsets), for
/// its peers to read and write in place (see `arena`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Place {
    pub input: u64,
    pub result: u64,
}

/// Why a shape cannot be described in a call record, if it cannot.
pub(super) fn describable(dims: &[usize]) -> Result<(), String> {
    if dims.len() > MAX_DIMS {
        return Err(format!("a tensor of {} dimensions; shared-memory collectives take at most {MAX_DIMS}", dims.len()));
    }
    Ok(())
}

fn put_meta(b: &mut [u8], meta: Option<&Meta>) {
    b[..8 + 8 * MAX_DIMS].fill(0);
    if let Some((dtype, dims)) = meta {
        b[0] = 1;
        b[1] = dtype_code(*dtype);
        b[2] = dims.len().min(MAX_DIMS) as u8;
        for (i, &d) in dims.iter().take(MAX_DIMS).enumerate() {
            b[8 + 8 * i..16 + 8 * i].copy_from_slice(&(d as u64).to_le_bytes());
        }
    }
}

fn get_meta(b: &[u8]) -> Option<Option<Meta>> {
    if b[0] == 0 {
        return Some(None);
    }
    let dtype = dtype_of_code(b[1])?;
    let rank = b[2] as usize;
    if rank > MAX_DIMS {
        return None;
    }
    let dims = (0..rank).map(|i| u64::from_le_bytes(b[8 + 8 * i..16 + 8 * i].try_into().expect("8 bytes")) as usize).collect();
    Some(Some((dtype, dims)))
}

impl Record {
    /// Writes the record into `b` (a call area of a group of `n` members).
    pub(super) fn write(&self, b: &mut [u8]) {
        let (code, arg) = self.call.op.code();
        b[0] = code;
        b[8..16].copy_from_slice(&arg.to_le_bytes());
        put_meta(&mut b[64..CALL_FIXED], self.call.meta.as_ref());
        let text = self.invalid.as_deref().map_or(&[][..], |t| &t.as_bytes()[..t.len().min(CALL_TEXT - 8)]);
        let at = CALL_FIXED;
        b[at..at + 8].copy_from_slice(&(if self.invalid.is_some() { text.len() as u64 + 1 } else { 0 }).to_le_bytes());
        b[at + 8..at + 8 + text.len()].copy_from_slice(text);
        b[16..24].copy_from_slice(&(self.parts.len() as u64).to_le_bytes());
        b[24..48].fill(0);
        if let Some(p) = self.place {
            b[24] = 1;
            b[32..40].copy_from_slice(&p.input.to_le_bytes());
            b[40..48].copy_from_slice(&p.result.to_le_bytes());
        }
        for (i, p) in self.parts.iter().enumerate() {
            let at = CALL_FIXED + CALL_TEXT + i * CALL_PART;
            put_meta(&mut b[at..at + CALL_PART], Some(p));
        }
    }

    /// Reads a record a peer wrote; `None` if it does not parse (the peer is
    /// not a rank of this job's version).
    pub(super) fn read(b: &[u8], n: usize) -> Option<Record> {
        let op = Op::from_code(b[0], u64::from_le_bytes(b[8..16].try_into().ok()?))?;
        let meta = get_meta(&b[64..CALL_FIXED])?;
        let at = CALL_FIXED;
        let len = u64::from_le_bytes(b[at..at + 8].try_into().ok()?) as usize;
        let invalid = match len {
            0 => None,
            l if l - 1 <= CALL_TEXT - 8 => Some(String::from_utf8_lossy(&b[at + 8..at + 8 + l - 1]).into_owned()),
            _ => return None,
        };
        let count = u64::from_le_bytes(b[16..24].try_into().ok()?) as usize;
        if count > n {
            return None;
        }
        let parts = (0..count)
            .map(|i| {
                let at = CALL_FIXED + CALL_TEXT + i * CALL_PART;
                get_meta(&b[at..at + CALL_PART]).flatten()
            })
            .collect::<Option<Vec<_>>>()?;
        let word = |at: usize| b[at..at + 8].try_into().ok().map(u64::from_le_bytes);
        let place = match b[24] {
            0 => None,
            1 => Some(Place { input: word(32)?, result: word(40)? }),
            _ => return None,
        };
        Some(Record { call: Call { op, meta }, invalid, parts, place })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shm::group::Layout;
    use tessera_core::DType;

    fn records(n: usize) -> Vec<Record> {
        let meta = Some((DType::BF16, vec![3, 5]));
        vec![
            Record {
                call: Call { op: Op::AllReduce, meta: meta.clone() },
                invalid: None,
                parts: Vec::new(),
                place: Some(Place { input: 4096, result: u64::MAX - 7 }),
            },
            Record { call: Call { op: Op::ReduceScatter { dim: 1 }, meta }, invalid: Some("bad dim".into()), parts: Vec::new(), place: None },
            Record { call: Call::bare(Op::AllToAll), invalid: None, parts: (0..n).map(|i| (DType::F32, vec![i, 2])).collect(), place: None },
        ]
    }

    #[test]
    fn records_round_trip_with_their_places() {
        let n = 4;
        let mut b = vec![0xAB; Layout::new(n).call];
        for r in records(n) {
            r.write(&mut b);
            assert_eq!(Record::read(&b, n), Some(r));
        }
    }

    /// A damaged record (a rank of another version, a stray write) reads
    /// as `None` or as some record, never a panic; a place flag other than
    /// 0 or 1 is refused.
    #[test]
    fn damaged_records_never_panic() {
        let n = 3;
        let mut b = vec![0; Layout::new(n).call];
        records(n)[0].write(&mut b);
        let mut bad = b.clone();
        bad[24] = 2;
        assert_eq!(Record::read(&bad, n), None);
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..20_000 {
            let mut d = b.clone();
            for _ in 0..1 + (x % 8) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let at = (x as usize / 7) % d.len();
                d[at] = (x >> 56) as u8;
            }
            let _ = Record::read(&d, n);
        }
    }
}
