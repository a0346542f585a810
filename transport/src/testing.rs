//! Transports for tests, compiled only with the `test-util` feature (and
//! in this crate's own tests), so the daemon does not ship them:
//! [`MemTransport`] connects in-process services by node name, and
//! [`FaultyTransport`] wraps any transport to make peers fail on purpose.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;

use crate::peer::{BoxFuture, PeerTransport};
use crate::{ChunkRef, ChunkService, Peer, ServiceError, TransportError};

/// In-process nodes, by node name: what a [`MemTransport`] reaches.
#[derive(Default)]
pub struct MemNetwork {
    nodes: Mutex<HashMap<String, Arc<dyn ChunkService>>>,
}

impl MemNetwork {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Serve `service` as node `node`.
    pub fn join(&self, node: &str, service: Arc<dyn ChunkService>) {
        self.nodes.lock().insert(node.to_string(), service);
    }

    /// Node `node` leaves: calls to it fail to connect.
    pub fn leave(&self, node: &str) {
        self.nodes.lock().remove(node);
    }
}

/// Calls the services of a [`MemNetwork`] directly: no sockets, no TLS.
pub struct MemTransport {
    net: Arc<MemNetwork>,
}

impl MemTransport {
    pub fn new(net: Arc<MemNetwork>) -> Self {
        MemTransport { net }
    }

    fn call<T>(
        &self,
        peer: &Peer,
        f: impl FnOnce(&dyn ChunkService) -> Result<T, ServiceError>,
    ) -> Result<T, TransportError> {
        let service = self.net.nodes.lock().get(&peer.node).cloned();
        let service =
            service.ok_or_else(|| TransportError::Connect { peer: peer.node.clone(), msg: "no such node".into() })?;
        f(service.as_ref()).map_err(|err| TransportError::Remote { peer: peer.node.clone(), err })
    }

    /// A call whose service blocks on work of its own (a stage reads
    /// from other peers), off the async workers, as the QUIC server runs it.
    async fn call_blocking<T: Send + 'static>(
        &self,
        peer: &Peer,
        f: impl FnOnce(&dyn ChunkService) -> Result<T, ServiceError> + Send + 'static,
    ) -> Result<T, TransportError> {
        let service = self.net.nodes.lock().get(&peer.node).cloned();
        let service =
            service.ok_or_else(|| TransportError::Connect { peer: peer.node.clone(), msg: "no such node".into() })?;
        let answer = tokio::task::spawn_blocking(move || f(service.as_ref()))
            .await
            .map_err(|e| TransportError::Stream { peer: peer.node.clone(), msg: e.to_string() })?;
        answer.map_err(|err| TransportError::Remote { peer: peer.node.clone(), err })
    }
}

impl PeerTransport for MemTransport {
    fn read<'a>(
        &'a self,
        peer: &'a Peer,
        chunk: &'a ChunkRef,
        at: u64,
        len: u32,
    ) -> BoxFuture<'a, Result<Vec<u8>, TransportError>> {
        Box::pin(async move { self.call(peer, |s| s.read(chunk, at, len)) })
    }
    fn write<'a>(
        &'a self,
        peer: &'a Peer,
        chunk: &'a ChunkRef,
        data: &'a Bytes,
    ) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move {
            self.call(peer, |s| {
                s.may_write(&crate::Caller::InProcess, chunk)?;
                s.write(chunk, data)
            })
        })
    }
    fn delete<'a>(&'a self, peer: &'a Peer, ino: u64) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move {
            self.call(peer, |s| {
                s.may_delete(&crate::Caller::InProcess, ino)?;
                s.delete(ino)
            })
        })
    }
    fn checksums<'a>(
        &'a self,
        peer: &'a Peer,
        chunk: &'a ChunkRef,
        at: u64,
        len: u64,
    ) -> BoxFuture<'a, Result<Vec<u32>, TransportError>> {
        Box::pin(async move { self.call(peer, |s| s.checksums(chunk, at, len)) })
    }
    fn stage<'a>(
        &'a self,
        peer: &'a Peer,
        ino: u64,
        chunk: u32,
        _timeout: Duration,
    ) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move { self.call_blocking(peer, move |s| s.stage(ino, chunk)).await })
    }
    fn recall<'a>(
        &'a self,
        peer: &'a Peer,
        dir: u64,
        _timeout: Duration,
    ) -> BoxFuture<'a, Result<i64, TransportError>> {
        Box::pin(async move { self.call(peer, |s| s.recall(dir)) })
    }
    fn close(&self) {}
}

/// What a [`FaultyTransport`] does to calls to one peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerFault {
    /// Unreachable: every call fails to connect (retryable).
    Down,
    /// Answers nothing: every call times out after this long (retryable).
    Silent(Duration),
    /// Answers, but every byte it reads back is flipped (a corrupt copy:
    /// the caller's checksums must catch it).
    CorruptReads,
    /// Refuses writes with this errno (a full or read-only disk).
    RefuseWrites(i32),
}

/// Wraps a transport and injects faults per peer, to test the callers'
/// fall-back paths on purpose.
pub struct FaultyTransport<T> {
    inner: T,
    faults: Mutex<HashMap<String, PeerFault>>,
}

impl<T: PeerTransport> FaultyTransport<T> {
    pub fn new(inner: T) -> Self {
        FaultyTransport { inner, faults: Mutex::default() }
    }

    /// Calls to `node` fail as `fault` says (`None`: healthy again).
    pub fn set(&self, node: &str, fault: Option<PeerFault>) {
        let mut faults = self.faults.lock();
        match fault {
            Some(f) => faults.insert(node.to_string(), f),
            None => faults.remove(node),
        };
    }

    fn fault(&self, peer: &Peer) -> Option<PeerFault> {
        self.faults.lock().get(&peer.node).cloned()
    }

    /// The failure a faulty peer answers any call with, if it does.
    async fn fail(&self, peer: &Peer) -> Result<(), TransportError> {
        match self.fault(peer) {
            Some(PeerFault::Down) => {
                Err(TransportError::Connect { peer: peer.node.clone(), msg: "injected: down".into() })
            }
            Some(PeerFault::Silent(timeout)) => {
                tokio::time::sleep(timeout).await;
                Err(TransportError::Timeout { peer: peer.node.clone(), timeout })
            }
            _ => Ok(()),
        }
    }
}

impl<T: PeerTransport> PeerTransport for FaultyTransport<T> {
    fn read<'a>(
        &'a self,
        peer: &'a Peer,
        chunk: &'a ChunkRef,
        at: u64,
        len: u32,
    ) -> BoxFuture<'a, Result<Vec<u8>, TransportError>> {
        Box::pin(async move {
            self.fail(peer).await?;
            let mut data = self.inner.read(peer, chunk, at, len).await?;
            if self.fault(peer) == Some(PeerFault::CorruptReads) {
                data.iter_mut().for_each(|b| *b = !*b);
            }
            Ok(data)
        })
    }
    fn write<'a>(
        &'a self,
        peer: &'a Peer,
        chunk: &'a ChunkRef,
        data: &'a Bytes,
    ) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move {
            self.fail(peer).await?;
            if let Some(PeerFault::RefuseWrites(errno)) = self.fault(peer) {
                let err = ServiceError { errno, msg: "injected: write refused".into() };
                return Err(TransportError::Remote { peer: peer.node.clone(), err });
            }
            self.inner.write(peer, chunk, data).await
        })
    }
    fn delete<'a>(&'a self, peer: &'a Peer, ino: u64) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move {
            self.fail(peer).await?;
            self.inner.delete(peer, ino).await
        })
    }
    fn checksums<'a>(
        &'a self,
        peer: &'a Peer,
        chunk: &'a ChunkRef,
        at: u64,
        len: u64,
    ) -> BoxFuture<'a, Result<Vec<u32>, TransportError>> {
        Box::pin(async move {
            self.fail(peer).await?;
            self.inner.checksums(peer, chunk, at, len).await
        })
    }
    fn stage<'a>(
        &'a self,
        peer: &'a Peer,
        ino: u64,
        chunk: u32,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move {
            self.fail(peer).await?;
            self.inner.stage(peer, ino, chunk, timeout).await
        })
    }
    fn recall<'a>(&'a self, peer: &'a Peer, dir: u64, timeout: Duration) -> BoxFuture<'a, Result<i64, TransportError>> {
        Box::pin(async move {
            self.fail(peer).await?;
            self.inner.recall(peer, dir, timeout).await
        })
    }
    fn close(&self) {
        self.inner.close()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A node that stores chunk versions in memory.
    #[derive(Default)]
    struct MemChunks(Mutex<HashMap<ChunkRef, Vec<u8>>>);

    impl ChunkService for MemChunks {
        fn read(&self, chunk: &ChunkRef, at: u64, len: u32) -> Result<Vec<u8>, ServiceError> {
            let chunks = self.0.lock();
            let data = chunks.get(chunk).ok_or(ServiceError { errno: libc::ENOENT, msg: "no such chunk".into() })?;
            let start = (at as usize).min(data.len());
            let end = (start + len as usize).min(data.len());
            Ok(data[start..end].to_vec())
        }
        fn write(&self, chunk: &ChunkRef, data: &[u8]) -> Result<(), ServiceError> {
            self.0.lock().insert(*chunk, data.to_vec());
            Ok(())
        }
        fn delete(&self, ino: u64) -> Result<(), ServiceError> {
            self.0.lock().retain(|c, _| c.ino != ino);
            Ok(())
        }
        fn checksums(&self, _: &ChunkRef, _: u64, _: u64) -> Result<Vec<u32>, ServiceError> {
            Ok(Vec::new())
        }
    }

    fn chunk(ino: u64) -> ChunkRef {
        ChunkRef { ino, index: 0, version: 1, start: 0 }
    }

    fn peer(node: &str) -> Peer {
        Peer { addr: "127.0.0.1:1".parse().unwrap(), node: node.into() }
    }

    #[tokio::test]
    async fn mem_transport_reaches_in_process_nodes() {
        let net = MemNetwork::new();
        net.join("b", Arc::new(MemChunks::default()));
        let t = MemTransport::new(net.clone());
        t.write(&peer("b"), &chunk(7), &Bytes::from_static(b"hello")).await.unwrap();
        assert_eq!(t.read(&peer("b"), &chunk(7), 1, 10).await.unwrap(), b"ello");
        let e = t.read(&peer("c"), &chunk(7), 0, 1).await.unwrap_err();
        assert!(e.is_retryable(), "an unknown node is a connect failure: {e}");
        let e = t.read(&peer("b"), &chunk(8), 0, 1).await.unwrap_err();
        assert!(!e.is_retryable(), "a service error is final: {e}");
        net.leave("b");
        assert!(t.read(&peer("b"), &chunk(7), 0, 1).await.is_err());
    }

    #[tokio::test]
    async fn faulty_transport_fails_peers_on_purpose() {
        let net = MemNetwork::new();
        net.join("b", Arc::new(MemChunks::default()));
        let t = FaultyTransport::new(MemTransport::new(net));
        t.write(&peer("b"), &chunk(1), &Bytes::from_static(&[1, 2, 3])).await.unwrap();
        t.set("b", Some(PeerFault::Down));
        assert!(matches!(t.read(&peer("b"), &chunk(1), 0, 3).await, Err(TransportError::Connect { .. })));
        t.set("b", Some(PeerFault::Silent(Duration::from_millis(20))));
        assert!(matches!(t.read(&peer("b"), &chunk(1), 0, 3).await, Err(TransportError::Timeout { .. })));
        t.set("b", Some(PeerFault::CorruptReads));
        assert_eq!(t.read(&peer("b"), &chunk(1), 0, 3).await.unwrap(), vec![!1u8, !2, !3]);
        t.set("b", Some(PeerFault::RefuseWrites(libc::ENOSPC)));
        let e = t.write(&peer("b"), &chunk(1), &Bytes::from_static(&[9])).await.unwrap_err();
        assert!(matches!(e, TransportError::Remote { err: ServiceError { errno: libc::ENOSPC, .. }, .. }));
        t.set("b", None);
        assert_eq!(t.read(&peer("b"), &chunk(1), 0, 3).await.unwrap(), vec![1, 2, 3]);
    }
}
