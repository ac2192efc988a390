//! The store's wire protocol: length-prefixed binary frames.
//!
//! Every message, either way, is one frame: a little-endian `u32` body
//! length, then the body: a one-byte tag and the tag's fields. Integers are
//! little-endian; a byte string is a `u32` length and the bytes; a key is a
//! byte string of UTF-8 text. A connection starts with a `Hello` each way
//! (magic, protocol version; the server adds its id), then carries one
//! request and one response at a time.
//!
//! Parsing is total: every length is checked against the limits in
//! [`super`] and against the bytes actually present before anything is
//! allocated, trailing bytes are an error, and no input makes it panic (the
//! store's tests fuzz it). A frame that does not parse closes its
//! connection and nothing else.

use super::{MAX_KEYS_PER_REQUEST, MAX_KEY_BYTES, MAX_VALUE_BYTES};
use std::io::{self, Read, Write};

/// The first bytes of every `Hello`.
pub(crate) const MAGIC: [u8; 4] = *b"TSTR";

/// The protocol version this build speaks; both sides must speak the same.
pub(crate) const VERSION: u32 = 1;

/// The largest frame body either side accepts: a value at the limit, its
/// key, and headers.
pub(crate) const MAX_FRAME_BYTES: usize = MAX_VALUE_BYTES + MAX_KEY_BYTES + 64;

/// A client's request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Request {
    /// The first frame of a connection.
    Hello { version: u32 },
    /// Store `value` under `key`, replacing any value.
    Set { key: String, value: Vec<u8> },
    /// The value of `key`, waiting up to `wait_ms` for it to be set.
    Get { key: String, wait_ms: u64 },
    /// Add `delta` to the integer under `key` (0 when missing).
    Add { key: String, delta: i64 },
    /// Wait up to `wait_ms` for every key (`any == false`) or one of them.
    Wait { keys: Vec<String>, wait_ms: u64, any: bool },
    /// Which of `keys` are set.
    Check { keys: Vec<String> },
    /// Remove `key`.
    Delete { key: String },
}

/// Why the server refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The frame does not parse, or breaks the protocol.
    Protocol = 0,
    /// A well-formed request the data does not allow (adding to a value
    /// that is not an integer, an overflow).
    Invalid = 1,
    /// The server is shutting down.
    ShuttingDown = 2,
}

/// The server's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Response {
    /// The answer to `Hello`: the version and the serving store's id.
    Hello { version: u32, server_id: u64 },
    /// Done.
    Ok,
    /// The value asked for.
    Value(Vec<u8>),
    /// The key is not set (after any wait).
    NotFound,
    /// An integer: the new value after `Add`, 1 or 0 after `Delete`.
    Int(i64),
    /// A wait ended: the index of the key found (`any`), or 0 (all).
    Ready(u32),
    /// Which keys are set: the answer to `Check`, and to a `Wait` that
    /// timed out.
    Present(Vec<bool>),
    /// The request was refused.
    Refused(Refusal, String),
}

/// A frame body that does not parse, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Malformed(pub String);

type Parsed<T> = Result<T, Malformed>;

fn malformed<T>(why: impl Into<String>) -> Parsed<T> {
    Err(Malformed(why.into()))
}

/// A cursor over a frame body.
struct Cursor<'a> {
    buf: &'a [u8],
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> Parsed<&'a [u8]> {
        if self.buf.len() < n {
            return malformed(format!("the frame ends inside {what}"));
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }

    fn u8(&mut self, what: &str) -> Parsed<u8> {
        Ok(self.take(1, what)?[0])
    }

    fn u32(&mut self, what: &str) -> Parsed<u32> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self, what: &str) -> Parsed<u64> {
        let b = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    /// A length-prefixed byte string of at most `max` bytes.
    fn bytes(&mut self, max: usize, what: &str) -> Parsed<&'a [u8]> {
        let n = self.u32(what)? as usize;
        if n > max {
            return malformed(format!("{what} is {n} bytes, more than the limit of {max}"));
        }
        self.take(n, what)
    }

    fn key(&mut self) -> Parsed<String> {
        let b = self.bytes(MAX_KEY_BYTES, "a key")?;
        match std::str::from_utf8(b) {
            Ok(s) => Ok(s.to_string()),
            Err(_) => malformed("a key is not UTF-8"),
        }
    }

    fn keys(&mut self) -> Parsed<Vec<String>> {
        let n = self.u32("a key count")? as usize;
        if n > MAX_KEYS_PER_REQUEST {
            return malformed(format!("{n} keys in one request, more than the limit of {MAX_KEYS_PER_REQUEST}"));
        }
        // Each key takes at least its 4-byte length: a count the frame
        // cannot hold is refused before anything is reserved for it.
        if n > self.buf.len() / 4 {
            return malformed(format!("a count of {n} keys in a frame too short to hold them"));
        }
        let mut keys = Vec::with_capacity(n);
        for _ in 0..n {
            keys.push(self.key()?);
        }
        Ok(keys)
    }

    fn end(&self) -> Parsed<()> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            malformed(format!("{} bytes after the end of the message", self.buf.len()))
        }
    }
}

fn put_u32(out: &mut Vec<u8>, x: u32) {
    out.extend_from_slice(&x.to_le_bytes());
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    put_u32(out, b.len() as u32);
    out.extend_from_slice(b);
}

fn put_keys(out: &mut Vec<u8>, keys: &[String]) {
    put_u32(out, keys.len() as u32);
    for k in keys {
        put_bytes(out, k.as_bytes());
    }
}

/// A frame: the body that `body` writes, with its length in front.
fn frame(body: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let mut out = vec![0u8; 4];
    body(&mut out);
    let len = (out.len() - 4) as u32;
    out[..4].copy_from_slice(&len.to_le_bytes());
    out
}

impl Request {
    /// This request as a frame. The caller keeps keys, values and key
    /// counts within the limits, so the frame is one the server accepts.
    pub(crate) fn encode(&self) -> Vec<u8> {
        frame(|out| match self {
            Request::Hello { version } => {
                out.push(0);
                out.extend_from_slice(&MAGIC);
                put_u32(out, *version);
            }
            Request::Set { key, value } => {
                out.push(1);
                put_bytes(out, key.as_bytes());
                put_bytes(out, value);
            }
            Request::Get { key, wait_ms } => {
                out.push(2);
                put_bytes(out, key.as_bytes());
                out.extend_from_slice(&wait_ms.to_le_bytes());
            }
            Request::Add { key, delta } => {
                out.push(3);
                put_bytes(out, key.as_bytes());
                out.extend_from_slice(&delta.to_le_bytes());
            }
            Request::Wait { keys, wait_ms, any } => {
                out.push(if *any { 5 } else { 4 });
                put_keys(out, keys);
                out.extend_from_slice(&wait_ms.to_le_bytes());
            }
            Request::Check { keys } => {
                out.push(6);
                put_keys(out, keys);
            }
            Request::Delete { key } => {
                out.push(7);
                put_bytes(out, key.as_bytes());
            }
        })
    }

    /// Parses a request body (the frame without its length).
    pub(crate) fn parse(body: &[u8]) -> Parsed<Request> {
        let mut c = Cursor { buf: body };
        let req = match c.u8("the request tag")? {
            0 => {
                if c.take(4, "the magic")? != MAGIC {
                    return malformed("the connection did not start with the store's greeting: the client is not a Tessera store client");
                }
                Request::Hello { version: c.u32("the version")? }
            }
            1 => {
                let key = c.key()?;
                let value = c.bytes(MAX_VALUE_BYTES, "a value")?.to_vec();
                Request::Set { key, value }
            }
            2 => Request::Get { key: c.key()?, wait_ms: c.u64("the wait")? },
            3 => Request::Add { key: c.key()?, delta: c.u64("the delta")? as i64 },
            t @ (4 | 5) => Request::Wait { keys: c.keys()?, wait_ms: c.u64("the wait")?, any: t == 5 },
            6 => Request::Check { keys: c.keys()? },
            7 => Request::Delete { key: c.key()? },
            t => return malformed(format!("unknown request tag {t}")),
        };
        c.end()?;
        Ok(req)
    }
}

impl Response {
    /// This response as a frame.
    pub(crate) fn encode(&self) -> Vec<u8> {
        frame(|out| match self {
            Response::Hello { version, server_id } => {
                out.push(0);
                out.extend_from_slice(&MAGIC);
                put_u32(out, *version);
                out.extend_from_slice(&server_id.to_le_bytes());
            }
            Response::Ok => out.push(1),
            Response::Value(v) => {
                out.push(2);
                put_bytes(out, v);
            }
            Response::NotFound => out.push(3),
            Response::Int(x) => {
                out.push(4);
                out.extend_from_slice(&x.to_le_bytes());
            }
            Response::Ready(i) => {
                out.push(5);
                put_u32(out, *i);
            }
            Response::Present(p) => {
                out.push(6);
                put_u32(out, p.len() as u32);
                out.extend(p.iter().map(|&b| b as u8));
            }
            Response::Refused(why, msg) => {
                out.push(7);
                out.push(*why as u8);
                // Messages are short; a long one is cut on a char boundary.
                let mut end = msg.len().min(4096);
                while !msg.is_char_boundary(end) {
                    end -= 1;
                }
                put_bytes(out, &msg.as_bytes()[..end]);
            }
        })
    }

    /// Parses a response body.
    pub(crate) fn parse(body: &[u8]) -> Parsed<Response> {
        let mut c = Cursor { buf: body };
        let resp = match c.u8("the response tag")? {
            0 => {
                if c.take(4, "the magic")? != MAGIC {
                    return malformed("the answer to the greeting is not a Tessera store's");
                }
                Response::Hello { version: c.u32("the version")?, server_id: c.u64("the server id")? }
            }
            1 => Response::Ok,
            2 => Response::Value(c.bytes(MAX_VALUE_BYTES, "a value")?.to_vec()),
            3 => Response::NotFound,
            4 => Response::Int(c.u64("an integer")? as i64),
            5 => Response::Ready(c.u32("an index")?),
            6 => {
                let n = c.u32("a key count")? as usize;
                let flags = c.take(n, "the key flags")?;
                Response::Present(flags.iter().map(|&b| b != 0).collect())
            }
            7 => {
                let why = match c.u8("a refusal")? {
                    0 => Refusal::Protocol,
                    1 => Refusal::Invalid,
                    2 => Refusal::ShuttingDown,
                    r => return malformed(format!("unknown refusal {r}")),
                };
                let msg = String::from_utf8_lossy(c.bytes(4096, "a message")?).into_owned();
                Response::Refused(why, msg)
            }
            t => return malformed(format!("unknown response tag {t}")),
        };
        c.end()?;
        Ok(resp)
    }
}

/// Reads one frame body of at most `max` bytes; `Ok(None)` at a clean end
/// of stream between frames. The body grows as its bytes arrive, so a
/// length prefix that promises more than is sent allocates only what was
/// sent.
pub(crate) fn read_frame(r: &mut impl Read, max: usize) -> io::Result<Option<Vec<u8>>> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match r.read(&mut len[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the stream ended inside a frame's length")),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let len = u32::from_le_bytes(len) as usize;
    if len == 0 || len > max {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("a frame of {len} bytes (the limit is {max})")));
    }
    let mut body = Vec::with_capacity(len.min(64 * 1024));
    r.take(len as u64).read_to_end(&mut body)?;
    if body.len() < len {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, format!("the stream ended {} bytes into a frame of {len}", body.len())));
    }
    Ok(Some(body))
}

/// Writes a whole encoded frame.
pub(crate) fn write_frame(w: &mut impl Write, frame: &[u8]) -> io::Result<()> {
    w.write_all(frame)?;
    w.flush()
}
