//! Point-to-point messages: a ring per ordered pair of members in the
//! group's segment, and a file of its own for a message the ring has no
//! room for, so that a send never waits for its receiver.
//!
//! A record in a ring is 8-byte aligned:
//!
//! ```text
//! u64  record length in bytes
//! u8   kind (0: the elements follow; 1: they are in a file of their own)
//! u8   dtype, u8 dimensions, 5 bytes of padding
//! u64  each dimension
//! u64  the file's number (kind 1)
//! ...  the elements (kind 0), padded to 8 bytes
//! ```
//!
//! The sender alone moves the ring's head and the receiver alone its tail;
//! the bytes between tail and head belong to the receiver, the rest to the
//! sender.

use super::group::{ring, Awaited, Group, RING_BELL, RING_CONTROL, RING_HEAD, RING_TAIL, RING_WAITERS};
use super::node::shm_error;
use super::segment::{align_up, Segment};
use crate::call::{dtype_code, dtype_of_code};
use crate::host::elements;
use std::sync::atomic::Ordering;
use tessera_core::backend::{CpuDevice, CpuStorage};
use tessera_core::tensor::{with_elem, Tensor};
use tessera_core::{Error, Result};

const INLINE: u8 = 0;
const FILE: u8 = 1;

impl Group {
    fn ring_data(&self, from: usize, to: usize) -> usize {
        self.lay.ring_at(from, to) + RING_CONTROL
    }

    /// Writes `src` into the ring from this member to `to` at byte counter
    /// `pos`, wrapping at its end.
    fn ring_write(&self, to: usize, pos: u64, src: &[u8]) {
        let size = self.lay.ring;
        let data = self.ring_data(self.me, to);
        let at = (pos % size as u64) as usize;
        let first = src.len().min(size - at);
        // SAFETY: these bytes lie between the ring's head and its tail plus
        // its size (the caller checked the room), which only this sender
        // touches until it moves the head past them.
        unsafe {
            self.seg.bytes_mut(data + at, first).copy_from_slice(&src[..first]);
            self.seg.bytes_mut(data, src.len() - first).copy_from_slice(&src[first..]);
        }
    }

    /// Reads `out.len()` bytes of the ring from `from` to this member at
    /// byte counter `pos`, wrapping at its end.
    fn ring_read(&self, from: usize, pos: u64, out: &mut [u8]) {
        let size = self.lay.ring;
        let data = self.ring_data(from, self.me);
        let at = (pos % size as u64) as usize;
        let first = out.len().min(size - at);
        let len = out.len();
        // SAFETY: these bytes lie between the ring's tail and its head (the
        // sender published them with its release of the head, acquired by
        // the caller), which only this receiver touches until it moves the
        // tail past them.
        unsafe {
            out[..first].copy_from_slice(self.seg.bytes(data + at, first));
            out[first..].copy_from_slice(self.seg.bytes(data, len - first));
        }
    }

    fn message_file(&self, from: usize, to: usize, number: u64) -> std::path::PathBuf {
        self.node.dir.join(format!("{}m{:016x}-{from}-{to}-{number}", self.node.prefix, self.id))
    }

    /// Sends the contiguous host tensor `t` to member `to`; `number` is this
    /// sender's next file number for that peer, used when the ring has no
    /// room for the elements.
    pub(super) fn send(&self, to: usize, t: &Tensor, number: u64) -> Result<()> {
        const OP: &str = "send";
        let ctrl = self.lay.ring_at(self.me, to);
        let (head, tail) = (self.seg.u64(ctrl + RING_HEAD), self.seg.u64(ctrl + RING_TAIL));
        let dims = t.dims();
        let bytes = t.elem_count() * t.dtype().size_in_bytes();
        let fixed = 16 + 8 * dims.len() + 8;
        let h = head.load(Ordering::Relaxed);
        let free = self.lay.ring as u64 - (h - tail.load(Ordering::Acquire));
        let inline = align_up(fixed + bytes, 8);
        let guard = t.read();
        let payload: &[u8] = with_elem!(t.dtype(), T => bytemuck::cast_slice(elements::<T>(t, &guard)));
        let (kind, len) = if inline as u64 <= free {
            (INLINE, inline)
        } else {
            // The elements go to a file of their own, which the receiver
            // removes once it has read it.
            let path = self.message_file(self.me, to, number);
            let file = Segment::build(&path, bytes.max(1)).map_err(|e| shm_error(&path, &format!("write a message of {bytes} bytes"), e))?;
            // SAFETY: a new file of this process's, which nobody else maps
            // until the record that names it is published below.
            unsafe { file.bytes_mut(0, bytes) }.copy_from_slice(payload);
            (FILE, align_up(fixed, 8))
        };
        if len > self.lay.ring {
            return Err(Error::invalid(OP, format!("a tensor of {} dimensions does not fit a message record", dims.len())));
        }
        // A full ring (many messages the receiver has not taken) makes the
        // sender wait for room.
        let room = || self.lay.ring as u64 - (h - tail.load(Ordering::Acquire)) >= len as u64;
        self.wait(OP, Awaited::Peer(to), self.seg.u32(ctrl + RING_BELL), self.seg.u32(ctrl + RING_WAITERS), room)?;
        let mut rec = Vec::with_capacity(fixed);
        rec.extend_from_slice(&(len as u64).to_le_bytes());
        rec.extend_from_slice(&[kind, dtype_code(t.dtype()), dims.len() as u8, 0, 0, 0, 0, 0]);
        for &d in dims {
            rec.extend_from_slice(&(d as u64).to_le_bytes());
        }
        rec.extend_from_slice(&number.to_le_bytes());
        self.ring_write(to, h, &rec);
        if kind == INLINE {
            self.ring_write(to, h + rec.len() as u64, payload);
        }
        head.store(h + len as u64, Ordering::Release);
        ring(self.seg.u32(ctrl + RING_BELL), self.seg.u32(ctrl + RING_WAITERS));
        Ok(())
    }

    /// The next message from member `from`, waiting for it; its elements
    /// are allocated on `dev`.
    pub(super) fn recv(&self, from: usize, dev: &CpuDevice) -> Result<Tensor> {
        const OP: &str = "recv";
        let ctrl = self.lay.ring_at(from, self.me);
        let (head, tail) = (self.seg.u64(ctrl + RING_HEAD), self.seg.u64(ctrl + RING_TAIL));
        let t = tail.load(Ordering::Relaxed);
        self.wait(OP, Awaited::Peer(from), self.seg.u32(ctrl + RING_BELL), self.seg.u32(ctrl + RING_WAITERS), || head.load(Ordering::Acquire) > t)?;
        let corrupt = |what: &str| Error::CollectiveMismatch { op: OP, detail: format!("rank {} sent a damaged message record ({what})", self.ranks[from]) };
        let mut fixed = [0u8; 16];
        self.ring_read(from, t, &mut fixed);
        let len = u64::from_le_bytes(fixed[..8].try_into().expect("8 bytes"));
        let (kind, dtype, rank) = (fixed[8], dtype_of_code(fixed[9]).ok_or_else(|| corrupt("dtype"))?, fixed[10] as usize);
        let mut dims_bytes = vec![0u8; 8 * rank + 8];
        self.ring_read(from, t + 16, &mut dims_bytes);
        let word = |i: usize| u64::from_le_bytes(dims_bytes[8 * i..8 * i + 8].try_into().expect("8 bytes"));
        let dims: Vec<usize> = (0..rank).map(|i| word(i) as usize).collect();
        let number = word(rank);
        let count: usize = dims.iter().product();
        let bytes = count * dtype.size_in_bytes();
        let start = t + 16 + dims_bytes.len() as u64;
        let storage = with_elem!(dtype, T => {
            let mut buf = dev.buffer_for_overwrite::<T>(count);
            let out: &mut [u8] = bytemuck::cast_slice_mut(&mut buf[..]);
            match kind {
                INLINE => self.ring_read(from, start, out),
                FILE => {
                    let path = self.message_file(from, self.me, number);
                    let file = Segment::open(&path, bytes.max(1)).map_err(|e| shm_error(&path, "read a message", e))?;
                    // SAFETY: the sender wrote the file before publishing
                    // this record and never touches it again.
                    out.copy_from_slice(unsafe { file.bytes(0, bytes) });
                    file.unlink();
                }
                _ => return Err(corrupt("kind")),
            }
            CpuStorage::from_buffer(buf)
        });
        tail.store(t + len, Ordering::Release);
        ring(self.seg.u32(ctrl + RING_BELL), self.seg.u32(ctrl + RING_WAITERS));
        Ok(Tensor::from_cpu(storage, dims, dev))
    }

    /// Drops the messages addressed to this member that it never received,
    /// removing their files: called when it leaves the group.
    pub(super) fn drain(&self) {
        for from in (0..self.n()).filter(|&m| m != self.me) {
            let ctrl = self.lay.ring_at(from, self.me);
            let (head, tail) = (self.seg.u64(ctrl + RING_HEAD), self.seg.u64(ctrl + RING_TAIL));
            let mut t = tail.load(Ordering::Relaxed);
            let h = head.load(Ordering::Acquire);
            while t < h {
                let mut fixed = [0u8; 16];
                self.ring_read(from, t, &mut fixed);
                let len = u64::from_le_bytes(fixed[..8].try_into().expect("8 bytes"));
                let rank = fixed[10] as usize;
                if fixed[8] == FILE {
                    let mut number = [0u8; 8];
                    self.ring_read(from, t + 16 + 8 * rank as u64, &mut number);
                    let _ = std::fs::remove_file(self.message_file(from, self.me, u64::from_le_bytes(number)));
                }
                if len == 0 {
                    break;
                }
                t += len;
            }
            tail.store(h, Ordering::Release);
        }
    }
}
