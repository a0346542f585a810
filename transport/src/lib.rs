//! converged transport: the peer data plane. Chunk reads (ranges), writes
//! (replication), deletes and checksums travel over QUIC, each request on its
//! own stream, between nodes that prove membership with a certificate signed
//! by the cluster CA (mutual TLS). It knows nothing of the namespace: a node
//! serves whatever its [`ChunkService`] answers.

pub mod peer;
pub mod quic;
#[cfg(feature = "rdma")]
pub mod rdma;
#[cfg(any(test, feature = "test-util"))]
pub mod testing;
pub mod tls;
pub mod wire;

pub use peer::PeerTransport;
pub use quic::{Peer, QuicTransport, TransportError};
#[cfg(any(test, feature = "test-util"))]
pub use testing::{FaultyTransport, MemNetwork, MemTransport, PeerFault};
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

/// Who sent a request. Over QUIC, the peer's certificate, verified against
/// the cluster CA at the handshake: it names the node. Calls inside one
/// process (the in-memory transport of unit tests) are trusted.
#[derive(Debug, Clone)]
pub enum Caller {
    Certified(rustls::pki_types::CertificateDer<'static>),
    InProcess,
}

impl Caller {
    /// Whether the caller is node `node`: its certificate is valid for that name.
    pub fn is(&self, node: &str) -> bool {
        match self {
            Caller::InProcess => true,
            Caller::Certified(der) => {
                let Ok(cert) = webpki::EndEntityCert::try_from(der) else { return false };
                let Ok(name) = rustls::pki_types::ServerName::try_from(node) else { return false };
                cert.verify_is_valid_for_subject_name(&name).is_ok()
            }
        }
    }
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
    /// Store `data` like [`ChunkService::write`], without waiting for stable
    /// storage; [`ChunkService::sync`] does that later. By default a
    /// durable write (and `sync` then has nothing left to do).
    fn write_unsynced(&self, chunk: &ChunkRef, data: &[u8]) -> Result<(), ServiceError> {
        self.write(chunk, data)
    }
    /// Store version `chunk` like [`ChunkService::write`] (or, when not
    /// `durable`, [`ChunkService::write_unsynced`]), its `len` bytes taken
    /// from `next` piece by piece as they arrive from the peer (`None`: the
    /// sender stopped short, and nothing is stored). By default the pieces
    /// are gathered first; a store that can write them as they come need
    /// not hold a whole chunk in memory.
    fn write_from(
        &self,
        chunk: &ChunkRef,
        len: u64,
        durable: bool,
        next: &mut dyn FnMut() -> Option<bytes::Bytes>,
    ) -> Result<(), ServiceError> {
        let mut data = Vec::with_capacity(len as usize);
        while (data.len() as u64) < len {
            match next() {
                Some(piece) => data.extend_from_slice(&piece),
                None => return Err(ServiceError::short_write(data.len() as u64, len)),
            }
        }
        match durable {
            true => self.write(chunk, &data),
            false => self.write_unsynced(chunk, &data),
        }
    }
    /// Put the chunk versions of `ino` stored by
    /// [`ChunkService::write_unsynced`] on stable storage. Fails for a
    /// version this service cannot vouch for (one it did not receive since
    /// it started: what a crash may have left half written).
    fn sync(&self, ino: u64, versions: &[(u32, u64)]) -> Result<(), ServiceError> {
        let _ = (ino, versions);
        Ok(())
    }
    /// Drop everything stored for `ino`, every version.
    fn delete(&self, ino: u64) -> Result<(), ServiceError>;
    /// Whether `caller` may store chunk version `chunk` here (asked before
    /// [`ChunkService::write`]): a certificate of the cluster is not enough to
    /// write any chunk of any file. Answers anyone by default.
    fn may_write(&self, caller: &Caller, chunk: &ChunkRef) -> Result<(), ServiceError> {
        let _ = (caller, chunk);
        Ok(())
    }
    /// Whether `caller` may have this node drop `ino` (asked before
    /// [`ChunkService::delete`]). Answers anyone by default.
    fn may_delete(&self, caller: &Caller, ino: u64) -> Result<(), ServiceError> {
        let _ = (caller, ino);
        Ok(())
    }
    /// crc32c of each 64 KiB block of `[at, at + len)` of the chunk version.
    fn checksums(&self, chunk: &ChunkRef, at: u64, len: u64) -> Result<Vec<u32>, ServiceError>;
    /// Fetch chunk `chunk` of `ino` onto this node and record the copy
    /// (a distributed stage). A node that cannot stage says so.
    fn stage(&self, ino: u64, chunk: u32) -> Result<(), ServiceError> {
        let _ = (ino, chunk);
        Err(ServiceError { errno: libc::EOPNOTSUPP, msg: "this node does not stage".into() })
    }
    /// Whether a caller may store `chunk` here for a file it says it made
    /// in directory `dir`, delegated to it (a [`wire::Request::WriteMade`]).
    /// The default holds the write to the usual check.
    fn may_write_made(&self, caller: &Caller, chunk: &ChunkRef, dir: u64) -> Result<(), ServiceError> {
        let _ = dir;
        self.may_write(caller, chunk)
    }
    /// Commit what this node acknowledged in directory `dir` and give up
    /// its delegation; returns a revision at or after which the metadata
    /// holds it all. A node that defers nothing still drops its record.
    fn recall(&self, dir: u64) -> Result<i64, ServiceError> {
        let _ = dir;
        Err(ServiceError { errno: libc::EOPNOTSUPP, msg: "this node holds no delegations".into() })
    }
}

/// A service failure, carried back to the caller as an errno and a message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{msg} (errno {errno})")]
pub struct ServiceError {
    pub errno: i32,
    pub msg: String,
}

impl ServiceError {
    /// A peer's write whose stream ended after `got` of its `len` bytes.
    pub fn short_write(got: u64, len: u64) -> Self {
        ServiceError { errno: 5, msg: format!("the sender stopped after {got} of {len} bytes") }
    }
}
