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

/// What a node serves to its peers: the chunks of its local store.
pub trait ChunkService: Send + Sync + 'static {
    /// Up to `len` bytes of `ino` from `offset` (fewer at the end of the data).
    fn read(&self, ino: u64, offset: u64, len: u32) -> Result<Vec<u8>, ServiceError>;
    /// Store `data` at `offset` of `ino`, on stable storage when it returns.
    /// With `end_of_file`, the file ends there: anything beyond is dropped.
    fn write(&self, ino: u64, offset: u64, data: &[u8], end_of_file: bool) -> Result<(), ServiceError>;
    /// Drop everything stored for `ino`.
    fn delete(&self, ino: u64) -> Result<(), ServiceError>;
    /// crc32c of each 64 KiB block of `[offset, offset + len)`.
    fn checksums(&self, ino: u64, offset: u64, len: u64) -> Result<Vec<u32>, ServiceError>;
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
