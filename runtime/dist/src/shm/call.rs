//! The record of a collective call a member writes for its peers at the
//! first step: the call (which collective, its arguments, the caller's
//! tensor), and whether the caller found its own arguments invalid.

use super::group::{CALL_FIXED, CALL_PART, CALL_TEXT};
use crate::call::{dtype_code, dtype_of_code, Call, Meta, Op, MAX_DIMS};

/// A member's call as its peers read it: the call, why the caller found
/// its own arguments invalid (if it did), and an all-to-all's parts by
/// destination.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Record {
    pub call: Call,
    pub invalid: Option<String>,
    pub parts: Vec<Meta>,
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
        Some(Record { call: Call { op, meta }, invalid, parts })
    }
}
