//! `QuicTransport`: one QUIC endpoint per node, both serving its chunks to
//! peers and calling theirs. Each request runs on its own bidirectional
//! stream, so a slow read never blocks a write to the same peer. Every call
//! has a deadline; a malformed frame resets that stream only.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use parking_lot::Mutex;

use crate::tls::{NodeTls, TlsError};
use crate::wire::{parse_header, Request, Response, WireError, HEADER_LEN, MAX_PAYLOAD};
use crate::{ChunkRef, ChunkService, ServiceError};

#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("peer {peer}: cannot connect: {msg}")]
    Connect { peer: String, msg: String },
    #[error("peer {peer}: no answer within {timeout:?}")]
    Timeout { peer: String, timeout: Duration },
    #[error("peer {peer}: stream failed: {msg}")]
    Stream { peer: String, msg: String },
    #[error("peer {peer}: bad frame: {err}")]
    Protocol { peer: String, err: WireError },
    #[error("peer {peer}: {err}")]
    Remote { peer: String, err: ServiceError },
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error("endpoint: {0}")]
    Endpoint(std::io::Error),
}

impl TransportError {
    /// Whether another try (or another replica) may succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            TransportError::Connect { .. } | TransportError::Timeout { .. } | TransportError::Stream { .. } => true,
            TransportError::Protocol { .. }
            | TransportError::Remote { .. }
            | TransportError::Tls(_)
            | TransportError::Endpoint(_) => false,
        }
    }
}

/// A peer: where it listens and the node name its certificate carries.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Peer {
    pub addr: SocketAddr,
    pub node: String,
}

/// Connections kept to each peer.
const CONNECTIONS: usize = 2;

pub struct QuicTransport {
    endpoint: quinn::Endpoint,
    /// Connections per peer: [`CONNECTIONS`] of them, used in turn, so the
    /// packet work of parallel requests spreads over the runtime's threads
    /// (a leaf lock: nothing is awaited or locked while it is held).
    conns: Mutex<HashMap<(Peer, usize), Cached>>,
    next: std::sync::atomic::AtomicUsize,
    timeout: Duration,
}

/// A connection kept for reuse, and when it was made.
struct Cached {
    conn: quinn::Connection,
    made: Instant,
}

/// Whether the peer answered a packet on `conn` with a valid stateless
/// reset: it has lost the connection (it started again), and so every
/// connection to it made before this one.
fn lost_by_peer(conn: &quinn::Connection) -> bool {
    matches!(conn.close_reason(), Some(quinn::ConnectionError::Reset))
}

fn stream_err(peer: &Peer, e: impl std::fmt::Display) -> TransportError {
    TransportError::Stream { peer: peer.node.clone(), msg: e.to_string() }
}

impl QuicTransport {
    /// Listen on `addr` and serve `service` to peers holding a cluster
    /// certificate. Must run inside a tokio runtime.
    pub fn bind(
        addr: SocketAddr,
        tls: &NodeTls,
        service: Arc<dyn ChunkService>,
        timeout: Duration,
    ) -> Result<Self, TransportError> {
        let transport = Arc::new(transport_config());
        let mut server = tls.server_config()?;
        server.transport_config(transport.clone());
        let mut client = tls.client_config()?;
        client.transport_config(transport);
        // Connection IDs and stateless resets this node's next run will
        // still recognise and vouch for (see `NodeTls::restart_keys`).
        let (reset_key, cid_key) = tls.restart_keys();
        let mut config = quinn::EndpointConfig::new(Arc::new(reset_key));
        config.cid_generator(move || Box::new(quinn_proto::HashedConnectionIdGenerator::from_key(cid_key)));
        // Loopback and datacenter links carry jumbo datagrams; quinn's
        // default 1452-byte ceiling makes bulk chunk transfer CPU-bound.
        config.max_udp_payload_size(65527).map_err(|e| TransportError::Endpoint(std::io::Error::other(e)))?;
        let socket = std::net::UdpSocket::bind(addr).map_err(TransportError::Endpoint)?;
        socket_buffers(&socket);
        let runtime = quinn::default_runtime()
            .ok_or_else(|| TransportError::Endpoint(std::io::Error::other("no async runtime")))?;
        let mut endpoint =
            quinn::Endpoint::new(config, Some(server), socket, runtime).map_err(TransportError::Endpoint)?;
        endpoint.set_default_client_config(client);
        let accept = endpoint.clone();
        tokio::spawn(async move {
            while let Some(incoming) = accept.accept().await {
                tokio::spawn(serve_connection(incoming, service.clone()));
            }
        });
        Ok(Self { endpoint, conns: Mutex::default(), next: Default::default(), timeout })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.endpoint.local_addr().expect("bound endpoint has an address")
    }

    /// The connection in `slot` to `peer`, made now if there is none
    /// open: the connection, when it was made, and whether it was kept
    /// from before.
    async fn connection(&self, peer: &Peer, slot: usize) -> Result<(quinn::Connection, Instant, bool), TransportError> {
        let key = (peer.clone(), slot);
        if let Some(c) = self.conns.lock().get(&key) {
            if c.conn.close_reason().is_none() {
                return Ok((c.conn.clone(), c.made, true));
            }
        }
        let connect_err =
            |e: &dyn std::fmt::Display| TransportError::Connect { peer: peer.node.clone(), msg: e.to_string() };
        let conn = self
            .endpoint
            .connect(peer.addr, &peer.node)
            .map_err(|e| connect_err(&e))?
            .await
            .map_err(|e| connect_err(&e))?;
        let made = Instant::now();
        let moved: Vec<Cached> = {
            let mut conns = self.conns.lock();
            conns.insert(key, Cached { conn: conn.clone(), made });
            // The node listens elsewhere now (it started again on another
            // port): its connections to the old address go.
            let gone: Vec<_> =
                conns.keys().filter(|(p, _)| p.node == peer.node && p.addr != peer.addr).cloned().collect();
            gone.iter().filter_map(|k| conns.remove(k)).collect()
        };
        for c in moved {
            c.conn.close(0u32.into(), b"peer moved");
        }
        Ok((conn, made, false))
    }

    /// `peer` lost a connection of ours made at `made` (a restart): that
    /// one and every one made before it go, closed here.
    fn forget_before(&self, peer: &Peer, made: Instant) {
        let lost: Vec<Cached> = {
            let mut conns = self.conns.lock();
            let keys: Vec<_> =
                conns.iter().filter(|((p, _), c)| p == peer && c.made <= made).map(|(k, _)| k.clone()).collect();
            keys.iter().filter_map(|k| conns.remove(k)).collect()
        };
        for c in lost {
            c.conn.close(0u32.into(), b"peer restarted");
        }
    }

    async fn call(&self, peer: &Peer, req: Request, payload: Bytes) -> Result<(Response, Vec<u8>), TransportError> {
        self.call_within(peer, req, payload, self.timeout).await
    }

    async fn call_within(
        &self,
        peer: &Peer,
        req: Request,
        payload: Bytes,
        timeout: Duration,
    ) -> Result<(Response, Vec<u8>), TransportError> {
        let slot = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % CONNECTIONS;
        let work = async {
            let (conn, made, kept) = self.connection(peer, slot).await?;
            match self.exchange(&conn, peer, &req, &payload).await {
                // The peer started again since this connection was made,
                // so nothing of the request was served: asked again on a
                // new connection, within the same deadline.
                Err(e) if kept && lost_by_peer(&conn) => {
                    tracing::info!(peer = %peer.node, error = %e, "peer lost our connections (it started again); connecting anew");
                    self.forget_before(peer, made);
                    let (conn, _, _) = self.connection(peer, slot).await?;
                    self.exchange(&conn, peer, &req, &payload).await
                }
                r => r,
            }
        };
        match tokio::time::timeout(timeout, work).await {
            Ok(r) => r,
            Err(_) => Err(TransportError::Timeout { peer: peer.node.clone(), timeout }),
        }
    }

    /// One request and its answer on `conn`.
    async fn exchange(
        &self,
        conn: &quinn::Connection,
        peer: &Peer,
        req: &Request,
        payload: &Bytes,
    ) -> Result<(Response, Vec<u8>), TransportError> {
        let (mut send, mut recv) = conn.open_bi().await.map_err(|e| stream_err(peer, e))?;
        send.write_all(&req.encode()).await.map_err(|e| stream_err(peer, e))?;
        // Handed to quinn as it is: no copy into its send buffer.
        if !payload.is_empty() {
            send.write_chunk(payload.clone()).await.map_err(|e| stream_err(peer, e))?;
        }
        send.finish().map_err(|e| stream_err(peer, e))?;
        let mut header = [0u8; HEADER_LEN];
        recv.read_exact(&mut header).await.map_err(|e| stream_err(peer, e))?;
        let protocol = |err| TransportError::Protocol { peer: peer.node.clone(), err };
        let len = parse_header(&header).map_err(protocol)? as usize;
        let mut frame = header.to_vec();
        frame.resize(HEADER_LEN + len, 0);
        recv.read_exact(&mut frame[HEADER_LEN..]).await.map_err(|e| stream_err(peer, e))?;
        let resp = Response::decode(&frame).map_err(protocol)?;
        let data = match resp {
            Response::Data { len } => read_payload(&mut recv, len as usize).await.map_err(|e| stream_err(peer, e))?,
            Response::Error { errno, ref msg } => {
                return Err(TransportError::Remote {
                    peer: peer.node.clone(),
                    err: ServiceError { errno, msg: msg.clone() },
                })
            }
            _ => Vec::new(),
        };
        Ok((resp, data))
    }

    /// `len` bytes of version `chunk.version` of a chunk on `peer`, from `at` bytes into it.
    pub async fn read(&self, peer: &Peer, chunk: &ChunkRef, at: u64, len: u32) -> Result<Vec<u8>, TransportError> {
        Ok(self.call(peer, Request::Read { chunk: *chunk, at, len }, Bytes::new()).await?.1)
    }

    /// Store `data`, the whole of a chunk version, on `peer`, on its stable
    /// storage when this returns.
    pub async fn write(&self, peer: &Peer, chunk: &ChunkRef, data: &Bytes) -> Result<(), TransportError> {
        let len = u32::try_from(data.len()).ok().filter(|l| *l <= MAX_PAYLOAD).ok_or_else(|| {
            TransportError::Protocol { peer: peer.node.clone(), err: WireError::PayloadTooLarge(u32::MAX) }
        })?;
        self.call(peer, Request::Write { chunk: *chunk, len }, data.clone()).await.map(|_| ())
    }

    /// Store `data` on `peer` without waiting for its stable storage (a
    /// [`QuicTransport::sync`] of it must follow).
    pub async fn write_unsynced(&self, peer: &Peer, chunk: &ChunkRef, data: &Bytes) -> Result<(), TransportError> {
        let len = u32::try_from(data.len()).ok().filter(|l| *l <= MAX_PAYLOAD).ok_or_else(|| {
            TransportError::Protocol { peer: peer.node.clone(), err: WireError::PayloadTooLarge(u32::MAX) }
        })?;
        self.call(peer, Request::WriteUnsynced { chunk: *chunk, len }, data.clone()).await.map(|_| ())
    }

    /// A write of a chunk of a file this node made in directory `dir`
    /// (delegated to it) and has not committed yet: see [`Request::WriteMade`].
    pub async fn write_made(
        &self,
        peer: &Peer,
        chunk: &ChunkRef,
        data: &Bytes,
        durable: bool,
        dir: u64,
    ) -> Result<(), TransportError> {
        let len = u32::try_from(data.len()).ok().filter(|l| *l <= MAX_PAYLOAD).ok_or_else(|| {
            TransportError::Protocol { peer: peer.node.clone(), err: WireError::PayloadTooLarge(u32::MAX) }
        })?;
        self.call(peer, Request::WriteMade { chunk: *chunk, len, durable, dir }, data.clone()).await.map(|_| ())
    }

    /// Have `peer` put versions of `ino` it received unsynced on stable storage.
    pub async fn sync(&self, peer: &Peer, ino: u64, versions: &[(u32, u64)]) -> Result<(), TransportError> {
        self.call(peer, Request::Sync { ino, versions: versions.to_vec() }, Bytes::new()).await.map(|_| ())
    }

    pub async fn delete(&self, peer: &Peer, ino: u64) -> Result<(), TransportError> {
        self.call(peer, Request::Delete { ino }, Bytes::new()).await.map(|_| ())
    }

    pub async fn checksums(
        &self,
        peer: &Peer,
        chunk: &ChunkRef,
        at: u64,
        len: u64,
    ) -> Result<Vec<u32>, TransportError> {
        match self.call(peer, Request::Checksums { chunk: *chunk, at, len }, Bytes::new()).await?.0 {
            Response::Checksums { crcs } => Ok(crcs),
            other => Err(stream_err(peer, format!("unexpected answer {other:?}"))),
        }
    }

    /// Have `peer` fetch chunk `chunk` of `ino` onto its SSD; answers once
    /// the copy is recorded. Fetching 64 MiB from an object store takes
    /// longer than a chunk read, hence its own deadline.
    pub async fn stage(&self, peer: &Peer, ino: u64, chunk: u32, timeout: Duration) -> Result<(), TransportError> {
        self.call_within(peer, Request::Stage { ino, chunk }, Bytes::new(), timeout).await.map(|_| ())
    }

    pub async fn recall(&self, peer: &Peer, dir: u64, timeout: Duration) -> Result<i64, TransportError> {
        match self.call_within(peer, Request::Recall { dir }, Bytes::new(), timeout).await?.0 {
            Response::Released { revision } => Ok(revision),
            other => Err(stream_err(peer, format!("unexpected answer {other:?}"))),
        }
    }

    /// Close every connection and stop accepting.
    pub fn close(&self) {
        self.endpoint.close(0u32.into(), b"shutdown");
    }
}

/// Socket buffers for bursts of 64 KiB datagrams: the kernel's default
/// (about 200 KiB) holds three of them, and every datagram dropped there
/// is a loss that halves the congestion window. Root may exceed
/// net.core.rmem_max (the FORCE options); otherwise the kernel caps it.
fn socket_buffers(socket: &std::net::UdpSocket) {
    use std::os::fd::AsRawFd;
    const BYTES: libc::c_int = 16 << 20;
    for (force, plain) in [(libc::SO_RCVBUFFORCE, libc::SO_RCVBUF), (libc::SO_SNDBUFFORCE, libc::SO_SNDBUF)] {
        let set = |opt| {
            // SAFETY: setsockopt on our own socket with a c_int value.
            unsafe {
                libc::setsockopt(
                    socket.as_raw_fd(),
                    libc::SOL_SOCKET,
                    opt,
                    (&BYTES as *const libc::c_int).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                ) == 0
            }
        };
        if !set(force) {
            set(plain);
        }
    }
}

/// Windows sized for 64 MiB chunks in flight, path MTU discovery allowed up
/// to jumbo datagrams (the initial MTU stays at the default: large initial
/// values were seen to stall handshakes), and no GSO, which loses to large
/// datagrams on loopback.
fn transport_config() -> quinn::TransportConfig {
    let mut t = quinn::TransportConfig::default();
    t.stream_receive_window(quinn::VarInt::from_u32(16 << 20));
    t.receive_window(quinn::VarInt::from_u32(128 << 20));
    t.send_window(128 << 20);
    let mut mtu = quinn::MtuDiscoveryConfig::default();
    mtu.upper_bound(65000);
    t.mtu_discovery_config(Some(mtu));
    t.enable_segmentation_offload(false);
    t.keep_alive_interval(Some(Duration::from_secs(5)));
    t
}

async fn serve_connection(incoming: quinn::Incoming, service: Arc<dyn ChunkService>) {
    let remote = incoming.remote_address();
    let conn = match incoming.await {
        Ok(c) => c,
        Err(e) => {
            // A peer without a certificate from the cluster CA ends here.
            tracing::warn!(%remote, error = %e, "refused peer connection");
            return;
        }
    };
    // The handshake verified the chain against the cluster CA; the leaf names the node.
    let caller = conn
        .peer_identity()
        .and_then(|id| id.downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>().ok())
        .and_then(|chain| chain.first().cloned());
    let Some(leaf) = caller else {
        tracing::warn!(%remote, "refused a peer connection without a certificate");
        return;
    };
    let caller = crate::Caller::Certified(leaf);
    while let Ok((send, recv)) = conn.accept_bi().await {
        tokio::spawn(serve_stream(send, recv, service.clone(), remote, caller.clone()));
    }
}

async fn serve_stream(
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
    service: Arc<dyn ChunkService>,
    remote: SocketAddr,
    caller: crate::Caller,
) {
    let req = match read_request(&mut recv).await {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(%remote, error = %e, "dropping a stream with a bad request frame");
            let _ = send.reset(1u32.into());
            let _ = recv.stop(1u32.into());
            return;
        }
    };
    let (resp, payload) = match answer(req, &mut recv, service, &caller).await {
        Ok(r) => r,
        Err(e) => {
            if e.errno == EACCES {
                tracing::warn!(%remote, error = %e.msg, "refused a peer's request");
            }
            (Response::Error { errno: e.errno, msg: e.msg }, Vec::new())
        }
    };
    // The payload is handed to quinn as it is: no copy into its send buffer.
    if send.write_all(&resp.encode()).await.is_ok() && send.write_chunk(bytes::Bytes::from(payload)).await.is_ok() {
        let _ = send.finish();
    }
}

/// `len` bytes from the stream, taking quinn's received chunks as they are
/// (one copy, into a buffer not zeroed first) rather than through its read
/// buffer.
async fn read_payload(recv: &mut quinn::RecvStream, len: usize) -> Result<Vec<u8>, String> {
    let mut buf = Vec::with_capacity(len);
    while buf.len() < len {
        match recv.read_chunk(len - buf.len(), true).await.map_err(|e| e.to_string())? {
            Some(chunk) => buf.extend_from_slice(&chunk.bytes),
            None => return Err(format!("stream ended after {} of {len} bytes", buf.len())),
        }
    }
    Ok(buf)
}

async fn read_request(recv: &mut quinn::RecvStream) -> Result<Request, String> {
    let mut header = [0u8; HEADER_LEN];
    recv.read_exact(&mut header).await.map_err(|e| e.to_string())?;
    let len = parse_header(&header).map_err(|e| e.to_string())? as usize;
    let mut frame = header.to_vec();
    frame.resize(HEADER_LEN + len, 0);
    recv.read_exact(&mut frame[HEADER_LEN..]).await.map_err(|e| e.to_string())?;
    Request::decode(&frame).map_err(|e| e.to_string())
}

fn io_error(msg: impl std::fmt::Display) -> ServiceError {
    ServiceError { errno: libc_eio(), msg: msg.to_string() }
}

const fn libc_eio() -> i32 {
    5
}

/// Permission denied: what a refused write or delete answers.
const EACCES: i32 = 13;

/// Pieces of a peer's chunk write (a datagram's worth each) received ahead
/// of the store's writes.
const RECEIVE_AHEAD: usize = 256;

/// Reads up to this many bytes are served without a blocking thread.
const INLINE_READ: u32 = 64 << 10;

/// A response and the payload that follows it.
type Answer = Result<(Response, Vec<u8>), ServiceError>;

async fn answer(
    req: Request,
    recv: &mut quinn::RecvStream,
    service: Arc<dyn ChunkService>,
    caller: &crate::Caller,
) -> Answer {
    let caller = caller.clone();
    // Chunk I/O is blocking file I/O: keep it off the async workers.
    let blocking =
        |f: Box<dyn FnOnce() -> Answer + Send>| async move { tokio::task::spawn_blocking(f).await.map_err(io_error)? };
    match req {
        // A few blocks (a random reader's request) are read on the worker
        // itself: one pread costs less than the hand-off to a blocking
        // thread and back, which a 4 KiB remote read would otherwise pay.
        Request::Read { chunk, at, len } if len <= INLINE_READ => {
            let data = service.read(&chunk, at, len)?;
            Ok((Response::Data { len: data.len() as u32 }, data))
        }
        Request::Read { chunk, at, len } => {
            blocking(Box::new(move || {
                let data = service.read(&chunk, at, len)?;
                Ok((Response::Data { len: data.len() as u32 }, data))
            }))
            .await
        }
        Request::Write { chunk, len }
        | Request::WriteUnsynced { chunk, len }
        | Request::WriteMade { chunk, len, .. } => {
            let (durable, made_in) = match req {
                Request::Write { .. } => (true, None),
                Request::WriteMade { durable, dir, .. } => (durable, Some(dir)),
                _ => (false, None),
            };
            // The store writes the pieces as they arrive, on a blocking
            // thread, a bounded queue behind the network.
            let (tx, mut rx) = tokio::sync::mpsc::channel::<bytes::Bytes>(RECEIVE_AHEAD);
            let store = tokio::task::spawn_blocking(move || {
                match made_in {
                    Some(dir) => service.may_write_made(&caller, &chunk, dir)?,
                    None => service.may_write(&caller, &chunk)?,
                }
                service.write_from(&chunk, len as u64, durable, &mut || rx.blocking_recv())?;
                Ok((Response::Done, Vec::new()))
            });
            let mut tx = Some(tx);
            let mut left = len as usize;
            while left > 0 {
                match recv.read_chunk(left, true).await {
                    Ok(Some(piece)) => {
                        left -= piece.bytes.len();
                        // A store that refused (or failed) stopped taking
                        // pieces: the rest is read and dropped, so that the
                        // sender hears its answer rather than a reset stream.
                        if let Some(t) = &tx {
                            if t.send(piece.bytes).await.is_err() {
                                tx = None;
                            }
                        }
                    }
                    // Short: the store hears the end and stores nothing.
                    Ok(None) => break,
                    Err(e) => {
                        drop(tx);
                        let _ = store.await;
                        return Err(io_error(e));
                    }
                }
            }
            drop(tx);
            store.await.map_err(io_error)?
        }
        Request::Sync { ino, versions } => {
            blocking(Box::new(move || service.sync(ino, &versions).map(|()| (Response::Done, Vec::new())))).await
        }
        Request::Delete { ino } => {
            blocking(Box::new(move || {
                service.may_delete(&caller, ino)?;
                service.delete(ino).map(|()| (Response::Done, Vec::new()))
            }))
            .await
        }
        Request::Checksums { chunk, at, len } => {
            blocking(Box::new(move || {
                service.checksums(&chunk, at, len).map(|crcs| (Response::Checksums { crcs }, Vec::new()))
            }))
            .await
        }
        Request::Stage { ino, chunk } => {
            blocking(Box::new(move || service.stage(ino, chunk).map(|()| (Response::Done, Vec::new())))).await
        }
        Request::Recall { dir } => {
            blocking(Box::new(move || {
                service.recall(dir).map(|revision| (Response::Released { revision }, Vec::new()))
            }))
            .await
        }
    }
}
