//! The frames ranks exchange over a byte stream: a length-prefixed header,
//! then the payload tensor's elements as they lie in memory.
//!
//! ```text
//! u32  header length (little-endian), at most MAX_HEADER bytes
//! ...  header: magic, frame kind, group, channel, call, step, meta, payload shape, text
//! ...  payload: the elements of the payload shape, little-endian
//! ```
//!
//! Elements are written straight from the sender's tensors and read straight
//! into the receiver's new buffer: no intermediate copy on either side. Both
//! ends must be little-endian (every platform Tessera builds for is); the
//! handshake's magic number catches a peer that is not.

use crate::call::{dtype_code, dtype_of_code, Call, Meta, Op, MAX_DIMS};
use std::io::{self, Read, Write};

/// Marks the start of every header; a stream that does not start with it is
/// not a Tessera peer.
pub(super) const MAGIC: u32 = 0x5445_5353; // "TESS"

/// The largest header accepted: a header is a few hundred bytes at most.
const MAX_HEADER: usize = 1 << 16;

/// The largest payload accepted in one frame: larger is a corrupt stream.
pub(super) const MAX_PAYLOAD: u64 = 1 << 40;

/// What a frame is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum FrameKind {
    /// A message on one group's channel.
    Message = 0,
    /// The sender declares a rank failed (itself or one it gave up on).
    Abort = 1,
    /// The sender leaves the job normally: what follows its end of stream
    /// is not a failure.
    Bye = 2,
}

/// Collectives and point-to-point messages are ordered independently.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Channel {
    /// The group's collectives, in program order.
    Collective = 0,
    /// Point-to-point messages, per (sender, receiver) pair.
    PointToPoint = 1,
}

/// Everything of a frame but its payload's elements.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Header {
    pub kind: FrameKind,
    /// The group the message belongs to (see `group_id`).
    pub group: u64,
    pub channel: Channel,
    pub call: Call,
    /// Which exchange of the collective: 0 for the first, 1 for the second.
    pub phase: u8,
    /// The sender's collective number in the group: the receiver checks
    /// that both are at the same one.
    pub step: u64,
    /// The payload's dtype and shape; `None` for a frame without elements.
    pub payload: Option<Meta>,
    /// The sender's arguments were invalid (why), an abort's reason, or empty.
    pub text: String,
    /// For an abort, the rank declared failed.
    pub failed: u64,
}

impl Header {
    /// A message header of exchange `phase` of `call` on `group`'s `channel`.
    pub(super) fn message(group: u64, channel: Channel, call: Call, phase: u8, step: u64) -> Header {
        Header { kind: FrameKind::Message, group, channel, call, phase, step, payload: None, text: String::new(), failed: 0 }
    }

    /// A frame that declares world rank `failed` failed for `reason`.
    pub(super) fn abort(failed: usize, reason: &str) -> Header {
        Header { text: reason.to_string(), failed: failed as u64, kind: FrameKind::Abort, ..Header::control() }
    }

    /// The frame a rank sends before it closes its connections normally.
    pub(super) fn bye() -> Header {
        Header { kind: FrameKind::Bye, ..Header::control() }
    }

    fn control() -> Header {
        Header::message(0, Channel::Collective, Call::bare(Op::Barrier), 0, 0)
    }

    /// Bytes of payload that follow the header.
    pub(super) fn payload_bytes(&self) -> io::Result<u64> {
        let Some((dtype, dims)) = &self.payload else { return Ok(0) };
        dims.iter()
            .try_fold(dtype.size_in_bytes() as u64, |acc, &d| acc.checked_mul(d as u64))
            .filter(|&b| b <= MAX_PAYLOAD)
            .ok_or_else(|| bad("payload too large"))
    }

    /// Writes the length prefix and the header.
    pub(super) fn write_to(&self, w: &mut impl Write) -> io::Result<()> {
        let mut b = Vec::with_capacity(128);
        put_u32(&mut b, MAGIC);
        b.push(self.kind as u8);
        put_u64(&mut b, self.group);
        b.push(self.channel as u8);
        let (code, arg) = self.call.op.code();
        b.push(code);
        put_u64(&mut b, arg);
        b.push(self.phase);
        put_meta(&mut b, self.call.meta.as_ref());
        put_u64(&mut b, self.step);
        put_meta(&mut b, self.payload.as_ref());
        put_u32(&mut b, self.text.len() as u32);
        b.extend_from_slice(self.text.as_bytes());
        put_u64(&mut b, self.failed);
        let mut framed = Vec::with_capacity(4 + b.len());
        put_u32(&mut framed, b.len() as u32);
        framed.extend_from_slice(&b);
        w.write_all(&framed)
    }

    /// Reads a length prefix and a header; `Ok(None)` at a clean end of
    /// stream (before the first byte of a frame).
    pub(super) fn read_from(r: &mut impl Read) -> io::Result<Option<Header>> {
        let mut len = [0u8; 4];
        let mut got = 0;
        while got < 4 {
            match r.read(&mut len[got..]) {
                Ok(0) if got == 0 => return Ok(None),
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        let len = u32::from_le_bytes(len) as usize;
        if len > MAX_HEADER {
            return Err(bad("header too long"));
        }
        let mut b = vec![0u8; len];
        r.read_exact(&mut b)?;
        Header::parse(&b).map(Some)
    }

    /// The header encoded in `b` (without its length prefix).
    pub(super) fn parse(b: &[u8]) -> io::Result<Header> {
        let mut c = Cursor { b, at: 0 };
        if c.u32()? != MAGIC {
            return Err(bad("not a Tessera frame (wrong magic number)"));
        }
        let kind = match c.u8()? {
            0 => FrameKind::Message,
            1 => FrameKind::Abort,
            2 => FrameKind::Bye,
            _ => return Err(bad("unknown frame kind")),
        };
        let group = c.u64()?;
        let channel = match c.u8()? {
            0 => Channel::Collective,
            1 => Channel::PointToPoint,
            _ => return Err(bad("unknown channel")),
        };
        let (code, arg) = (c.u8()?, c.u64()?);
        let op = Op::from_code(code, arg).ok_or_else(|| bad("unknown operation"))?;
        let phase = c.u8()?;
        let meta = c.meta()?;
        let step = c.u64()?;
        let payload = c.meta()?;
        let text_len = c.u32()? as usize;
        let text = String::from_utf8(c.take(text_len)?.to_vec()).map_err(|_| bad("text is not UTF-8"))?;
        let failed = c.u64()?;
        if c.at != b.len() {
            return Err(bad("trailing bytes after the header"));
        }
        let h = Header { kind, group, channel, call: Call { op, meta }, phase, step, payload, text, failed };
        h.payload_bytes()?;
        Ok(h)
    }
}

fn bad(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_string())
}

fn put_u32(b: &mut Vec<u8>, v: u32) {
    b.extend_from_slice(&v.to_le_bytes());
}

fn put_u64(b: &mut Vec<u8>, v: u64) {
    b.extend_from_slice(&v.to_le_bytes());
}

fn put_meta(b: &mut Vec<u8>, meta: Option<&Meta>) {
    match meta {
        None => b.push(0),
        Some((dtype, dims)) => {
            b.push(dtype_code(*dtype));
            b.push(dims.len() as u8);
            for &d in dims {
                put_u64(b, d as u64);
            }
        }
    }
}

struct Cursor<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> io::Result<&'a [u8]> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len()).ok_or_else(|| bad("header ends early"))?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u8(&mut self) -> io::Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> io::Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }
    fn u64(&mut self) -> io::Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }
    fn meta(&mut self) -> io::Result<Option<Meta>> {
        let dtype = match self.u8()? {
            0 => return Ok(None),
            code => dtype_of_code(code).ok_or_else(|| bad("unknown dtype"))?,
        };
        let n = self.u8()? as usize;
        if n > MAX_DIMS {
            return Err(bad("too many dimensions"));
        }
        let dims = (0..n).map(|_| self.u64().and_then(|d| usize::try_from(d).map_err(|_| bad("dimension out of range")))).collect::<io::Result<Vec<_>>>()?;
        Ok(Some((dtype, dims)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_core::tensor::DType;

    fn sample(i: u64) -> Header {
        let ops = [Op::AllReduce, Op::AllGather { dim: 2 }, Op::ReduceScatter { dim: 1 }, Op::Broadcast { root: 3 }, Op::AllToAll, Op::Barrier, Op::Send];
        let op = ops[i as usize % ops.len()];
        let meta = (!i.is_multiple_of(3)).then(|| (DType::BF16, vec![i as usize, 3, 7]));
        let mut h = Header::message(i.wrapping_mul(0x9E37_79B9_7F4A_7C15), Channel::Collective, Call { op, meta: meta.clone() }, (i % 2) as u8, i);
        h.payload = meta;
        h.text = "x".repeat(i as usize % 5);
        h
    }

    #[test]
    fn headers_round_trip() {
        for i in 0..50 {
            let h = sample(i);
            let mut b = Vec::new();
            h.write_to(&mut b).unwrap();
            let back = Header::read_from(&mut b.as_slice()).unwrap().unwrap();
            assert_eq!(back, h);
        }
        let abort = Header::abort(5, "it hung");
        let mut b = Vec::new();
        abort.write_to(&mut b).unwrap();
        assert_eq!(Header::read_from(&mut b.as_slice()).unwrap().unwrap(), abort);
        assert!(Header::read_from(&mut [].as_slice()).unwrap().is_none(), "a clean end of stream");
    }

    /// Every truncation and every single-byte corruption of valid headers
    /// is either parsed or refused: never a panic, never a huge allocation.
    #[test]
    fn damaged_headers_are_refused_not_trusted() {
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for i in 0..40 {
            let mut b = Vec::new();
            sample(i).write_to(&mut b).unwrap();
            for cut in 0..b.len() {
                assert!(Header::read_from(&mut &b[..cut]).map(|h| h.is_none()).unwrap_or(true) || cut == 0);
            }
            for _ in 0..200 {
                let mut d = b.clone();
                let at = (next() as usize) % d.len();
                d[at] = next() as u8;
                if let Ok(Some(h)) = Header::read_from(&mut d.as_slice()) {
                    assert!(h.payload_bytes().unwrap() <= MAX_PAYLOAD);
                }
            }
            let noise: Vec<u8> = (0..(next() % 300)).map(|_| next() as u8).collect();
            let _ = Header::read_from(&mut noise.as_slice());
        }
        let mut huge = Vec::new();
        put_u32(&mut huge, u32::MAX);
        assert!(Header::read_from(&mut huge.as_slice()).is_err(), "a length beyond the limit is refused before allocating");
    }
}
