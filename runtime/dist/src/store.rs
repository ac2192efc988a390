//! The rendezvous store: a small TCP key-value store served by rank 0,
//! through which the processes of a job find each other.
//!
//! [`StoreServer`] serves the store; [`Store`] is a client of it, usable
//! from any number of threads; [`Rendezvous`] is the start of every
//! multi-process job: rank 0 serves the store, every rank connects, and all
//! wait until the whole world has arrived.
//!
//! ```
//! use std::time::Duration;
//! use tessera::dist::store::{Store, StoreServer};
//!
//! let server = StoreServer::bind("127.0.0.1", 0)?; // port 0: any free port
//! let port = server.local_addr().port();
//! let store = Store::connect("127.0.0.1", port, Duration::from_secs(5))?;
//!
//! let reader = {
//!     let store = store.clone();
//!     std::thread::spawn(move || store.get("addr/1", Duration::from_secs(5)))
//! };
//! store.set("addr/1", b"10.0.0.2:40001")?;
//! assert_eq!(reader.join().unwrap()?, b"10.0.0.2:40001");
//! assert_eq!(store.add("count", 2)?, 2);
//! assert_eq!(store.try_get("missing")?, None);
//! # Ok::<(), tessera::Error>(())
//! ```
//!
//! # Operations
//!
//! Values are bytes. [`Store::add`] keeps its counter as decimal text, so a
//! counter reads back with [`Store::get`] as `b"3"`, and a value set as
//! decimal text can be added to. Every operation that waits takes a timeout
//! and returns [`Error::Timeout`](tessera_core::Error::Timeout) when it expires; a store that cannot be
//! reached, or that went away (rank 0 exited), is an [`Error::Rendezvous`](tessera_core::Error::Rendezvous)
//! naming its address, never a hang.
//!
//! # Limits
//!
//! A key is at most [`MAX_KEY_BYTES`] bytes of UTF-8, a value at most
//! [`MAX_VALUE_BYTES`] (the store carries addresses and small metadata;
//! tensors go through a communicator), and one request names at most
//! [`MAX_KEYS_PER_REQUEST`] keys ([`Store::wait`] and [`Store::check`]
//! split longer lists). A client is refused anything larger before it is
//! sent; a server closes a connection whose frame breaks a limit, before
//! allocating for it.
//!
//! # Protocol
//!
//! Length-prefixed binary frames over TCP with `TCP_NODELAY`: a
//! little-endian `u32` length, then a tag byte and the tag's fields. Each
//! connection starts with a greeting that carries a magic number and the
//! protocol version, so a client that reaches some other program, or a
//! store of another Tessera version, says so instead of misreading it. One
//! request is in flight per connection; a [`Store`] keeps a small pool of
//! connections, so that threads sharing it do not queue behind one another's
//! waits (a thread waiting in `get` does not hold up another's `set`). The
//! server gives each connection a thread, and keeps the map behind one
//! mutex whose condition variable wakes waiting requests when a key
//! changes. A frame that does not parse closes its connection and nothing
//! else; the tests fuzz the server with random and mutated frames.

mod client;
mod proto;
mod rendezvous;
mod server;

pub use client::Store;
pub use rendezvous::Rendezvous;
pub use server::StoreServer;

/// The longest key, in bytes of UTF-8.
pub const MAX_KEY_BYTES: usize = 4096;

/// The largest value, in bytes: 64 MiB.
pub const MAX_VALUE_BYTES: usize = 64 << 20;

/// The most keys one request may name.
pub const MAX_KEYS_PER_REQUEST: usize = 4096;

/// `host:port`, with an IPv6 address in brackets.
pub(crate) fn addr_text(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

#[cfg(test)]
mod tests;
