//! converged transport: the peer data plane. Chunk reads (ranges), writes
//! (replication), deletes and checksums travel over QUIC, each request on its
//! own stream, between nodes that prove membership with a certificate signed
//! by the cluster CA (mutual TLS). It knows nothing of the namespace: a node
//! serves whatever its [`ChunkService`] answers.

pub mod peer;
pub mod quic;
#[cfg(feature = "rdma")]
pub mod rdma;
pub mod tls;
pub mod wire;

pub use peer::{FaultyTransport, MemNetwork, MemTransport, PeerFault, PeerTransport};
pub use quic::{Peer, QuicTransport, TransportError};
pub use tls::{ClusterCa, NodeTls, TlsError};
pub use wire::{Request, Response, WireError};

/// One version of one chunk of a file: what a read, a replica write or a
/// checksum request is about. Published versions are immutable, so a copy
/// is named by its version and a new version never lands on an old one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct ChunkRef {
    pub ino: u64,
    pub index: u32,
    pub version: u64,
    /// The file offset of the chunk's first byte.
    pub start: u64,
}

/// What a node serves to its peers: the chunks of its local store.
pub trait ChunkService: Send + Sync + 'static {
    /// Up to `len` bytes of version `chunk.version` of the chunk, from `at`
    /// bytes into it (fewer at the end of the data). A node that does not
    /// hold that version (it is being rewritten there) says so with an error.
    fn read(&self, chunk: &ChunkRef, at: u64, len: u32) -> Result<Vec<u8>, ServiceError>;
    /// Store `data`, the whole of version `chunk.version` of the chunk, on
    /// stable storage when it returns, beside any older version it holds.
    fn write(&self, chunk: &ChunkRef, data: &[u8]) -> Result<(), ServiceError>;
    /// Drop everything stored for `ino`, every version.
    fn delete(&self, ino: u64) -> Result<(), ServiceError>;
    /// crc32c of each 64 KiB block of `[at, at + len)` of the chunk version.
    fn checksums(&self, chunk: &ChunkRef, at: u64, len: u64) -> Result<Vec<u32>, ServiceError>;
    /// Fetch chunk `chunk` of `ino` onto this node and record the copy
    /// (a distributed stage). A node that cannot stage says so.
    fn stage(&self, ino: u64, chunk: u32) -> Result<(), ServiceError> {
        let _ = (ino, chunk);
        Err(ServiceError { errno: libc::EOPNOTSUPP, msg: "this node does not stage".into() })
    }
}

/// A service failure, carried back to the caller as an errno and a message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{msg} (errno {errno})")]
pub struct ServiceError {
    pub errno: i32,
    pub msg: String,
}
