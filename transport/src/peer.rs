//! The trait in front of the peer data plane: what a node asks of its peers.
//! It knows no backend; [`crate::QuicTransport`] is the real one; the
//! in-process and fault-injecting ones of the tests are in `testing.rs`
//! (feature `test-util`).
//! Errors say whether a retry (or another replica) can help
//! ([`TransportError::is_retryable`]).

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use bytes::Bytes;

use crate::{ChunkRef, Peer, TransportError};

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Requests to peers. Every call has a deadline (the backend's, or the one
/// given) and may be cancelled by dropping its future.
pub trait PeerTransport: Send + Sync + 'static {
    /// Up to `len` bytes of a chunk version on `peer`, from `at` bytes into the chunk.
    fn read<'a>(
        &'a self,
        peer: &'a Peer,
        chunk: &'a ChunkRef,
        at: u64,
        len: u32,
    ) -> BoxFuture<'a, Result<Vec<u8>, TransportError>>;
    /// Store `data`, the whole of a chunk version, on `peer`, on its stable
    /// storage when this returns.
    fn write<'a>(
        &'a self,
        peer: &'a Peer,
        chunk: &'a ChunkRef,
        data: &'a Bytes,
    ) -> BoxFuture<'a, Result<(), TransportError>>;
    /// Store `data` on `peer` without waiting for its stable storage; a
    /// [`PeerTransport::sync`] must follow. By default a durable write.
    fn write_unsynced<'a>(
        &'a self,
        peer: &'a Peer,
        chunk: &'a ChunkRef,
        data: &'a Bytes,
    ) -> BoxFuture<'a, Result<(), TransportError>> {
        self.write(peer, chunk, data)
    }
    /// Have `peer` put the versions of `ino` it received unsynced on stable
    /// storage. By default nothing (writes are durable).
    fn sync<'a>(
        &'a self,
        peer: &'a Peer,
        ino: u64,
        versions: &'a [(u32, u64)],
    ) -> BoxFuture<'a, Result<(), TransportError>> {
        let _ = (peer, ino, versions);
        Box::pin(async { Ok(()) })
    }
    /// Drop everything `peer` stores for `ino`.
    fn delete<'a>(&'a self, peer: &'a Peer, ino: u64) -> BoxFuture<'a, Result<(), TransportError>>;
    /// crc32c of each 64 KiB block of `[at, at + len)` of a chunk version on `peer`.
    fn checksums<'a>(
        &'a self,
        peer: &'a Peer,
        chunk: &'a ChunkRef,
        at: u64,
        len: u64,
    ) -> BoxFuture<'a, Result<Vec<u32>, TransportError>>;
    /// Have `peer` fetch chunk `chunk` of `ino` onto its SSD, within `timeout`.
    fn stage<'a>(
        &'a self,
        peer: &'a Peer,
        ino: u64,
        chunk: u32,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<(), TransportError>>;
    /// [`PeerTransport::write`] (`durable`) or `write_unsynced` of a chunk
    /// of a file this node made in directory `dir`, delegated to it, and
    /// not in the records yet: the peer checks the delegation instead. By
    /// default a plain write (the peer checks the records).
    fn write_made<'a>(
        &'a self,
        peer: &'a Peer,
        chunk: &'a ChunkRef,
        data: &'a Bytes,
        durable: bool,
        dir: u64,
    ) -> BoxFuture<'a, Result<(), TransportError>> {
        let _ = dir;
        match durable {
            true => self.write(peer, chunk, data),
            false => self.write_unsynced(peer, chunk, data),
        }
    }
    /// Have `peer` commit what it acknowledged in directory `dir` and give
    /// up its delegation, within `timeout`; returns the revision it answers.
    fn recall<'a>(&'a self, peer: &'a Peer, dir: u64, timeout: Duration) -> BoxFuture<'a, Result<i64, TransportError>>;
    /// Stop: close connections, refuse further calls.
    fn close(&self);
}

impl PeerTransport for crate::QuicTransport {
    fn read<'a>(
        &'a self,
        peer: &'a Peer,
        chunk: &'a ChunkRef,
        at: u64,
        len: u32,
    ) -> BoxFuture<'a, Result<Vec<u8>, TransportError>> {
        Box::pin(crate::QuicTransport::read(self, peer, chunk, at, len))
    }
    fn write<'a>(
        &'a self,
        peer: &'a Peer,
        chunk: &'a ChunkRef,
        data: &'a Bytes,
    ) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(crate::QuicTransport::write(self, peer, chunk, data))
    }
    fn write_unsynced<'a>(
        &'a self,
        peer: &'a Peer,
        chunk: &'a ChunkRef,
        data: &'a Bytes,
    ) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(crate::QuicTransport::write_unsynced(self, peer, chunk, data))
    }
    fn sync<'a>(
        &'a self,
        peer: &'a Peer,
        ino: u64,
        versions: &'a [(u32, u64)],
    ) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(crate::QuicTransport::sync(self, peer, ino, versions))
    }
    fn delete<'a>(&'a self, peer: &'a Peer, ino: u64) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(crate::QuicTransport::delete(self, peer, ino))
    }
    fn checksums<'a>(
        &'a self,
        peer: &'a Peer,
        chunk: &'a ChunkRef,
        at: u64,
        len: u64,
    ) -> BoxFuture<'a, Result<Vec<u32>, TransportError>> {
        Box::pin(crate::QuicTransport::checksums(self, peer, chunk, at, len))
    }
    fn stage<'a>(
        &'a self,
        peer: &'a Peer,
        ino: u64,
        chunk: u32,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(crate::QuicTransport::stage(self, peer, ino, chunk, timeout))
    }
    fn write_made<'a>(
        &'a self,
        peer: &'a Peer,
        chunk: &'a ChunkRef,
        data: &'a Bytes,
        durable: bool,
        dir: u64,
    ) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(crate::QuicTransport::write_made(self, peer, chunk, data, durable, dir))
    }
    fn recall<'a>(&'a self, peer: &'a Peer, dir: u64, timeout: Duration) -> BoxFuture<'a, Result<i64, TransportError>> {
        Box::pin(crate::QuicTransport::recall(self, peer, dir, timeout))
    }
    fn close(&self) {
        crate::QuicTransport::close(self)
    }
}
