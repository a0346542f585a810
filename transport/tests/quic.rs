//! Two nodes on loopback talking QUIC with certificates from one cluster CA;
//! a node from another CA is refused; garbage on a stream is survived; a
//! dead peer fails within the deadline; a peer started again on its address
//! is reached at once.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use converged_transport::{
    ChunkRef, ChunkService, ClusterCa, NodeTls, Peer, QuicTransport, Request, Response, ServiceError, TransportError,
};
use parking_lot::Mutex;

/// Chunk versions kept in memory: the service side of the test.
/// The flag makes it refuse every write (what an unauthorized one gets).
#[derive(Default)]
struct MemChunks(Mutex<HashMap<ChunkRef, Vec<u8>>>, AtomicBool);

impl ChunkService for MemChunks {
    fn read(&self, chunk: &ChunkRef, at: u64, len: u32) -> Result<Vec<u8>, ServiceError> {
        let m = self.0.lock();
        let f = m.get(chunk).ok_or(ServiceError { errno: 2, msg: format!("no such chunk {chunk:?}") })?;
        let start = (at as usize).min(f.len());
        let end = (start + len as usize).min(f.len());
        Ok(f[start..end].to_vec())
    }
    fn write(&self, chunk: &ChunkRef, data: &[u8]) -> Result<(), ServiceError> {
        self.0.lock().insert(*chunk, data.to_vec());
        Ok(())
    }
    fn may_write(&self, _: &converged_transport::Caller, _: &ChunkRef) -> Result<(), ServiceError> {
        match self.1.load(Ordering::Relaxed) {
            true => Err(ServiceError { errno: 13, msg: "refused".into() }),
            false => Ok(()),
        }
    }
    fn delete(&self, ino: u64) -> Result<(), ServiceError> {
        self.0.lock().retain(|c, _| c.ino != ino);
        Ok(())
    }
    fn checksums(&self, chunk: &ChunkRef, at: u64, len: u64) -> Result<Vec<u32>, ServiceError> {
        let data = self.read(chunk, at, len as u32)?;
        Ok(data.chunks(64 << 10).map(|b| b.len() as u32).collect())
    }
}

/// Version 1 of chunk 0 of `ino`.
fn chunk(ino: u64) -> ChunkRef {
    ChunkRef { ino, index: 0, version: 1, start: 0 }
}

fn node(tls: &NodeTls, service: Arc<MemChunks>) -> QuicTransport {
    QuicTransport::bind("127.0.0.1:0".parse().unwrap(), tls, service, Duration::from_secs(3)).unwrap()
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 31 % 251) as u8).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_with_cluster_certificates_move_chunks() {
    let ca = ClusterCa::generate("converged test cluster").unwrap();
    let dir = tempfile::tempdir().unwrap();
    // Certificates survive a save and load, as `converged cluster` writes them.
    ca.save(dir.path()).unwrap();
    let ca = ClusterCa::load(dir.path()).unwrap();
    let n2_tls = ca.issue("n2").unwrap();
    n2_tls.save(&dir.path().join("n2")).unwrap();
    let n2_tls = NodeTls::load(&dir.path().join("n2")).unwrap();

    let n1 = node(&ca.issue("n1").unwrap(), Arc::default());
    let store2 = Arc::new(MemChunks::default());
    let n2 = node(&n2_tls, store2.clone());
    let peer2 = Peer { addr: n2.local_addr(), node: "n2".into() };

    let data = pattern(5 << 20);
    n1.write(&peer2, &chunk(7), &bytes::Bytes::from(data.clone())).await.unwrap();
    assert_eq!(store2.0.lock()[&chunk(7)], data, "bytes landed on n2");
    assert_eq!(n1.read(&peer2, &chunk(7), 0, 5 << 20).await.unwrap(), data);
    assert_eq!(n1.read(&peer2, &chunk(7), 1_000_000, 4096).await.unwrap(), data[1_000_000..1_004_096]);
    // Several reads at once share one connection, one stream each.
    let reads: Vec<_> = (0..8u64)
        .map(|i| {
            let (n1, p) = (&n1, &peer2);
            async move { n1.read(p, &chunk(7), i * 65536, 65536).await.unwrap() }
        })
        .collect();
    for (i, got) in futures_join(reads).await.into_iter().enumerate() {
        assert_eq!(got, data[i * 65536..(i + 1) * 65536]);
    }
    assert_eq!(n1.checksums(&peer2, &chunk(7), 0, 200_000).await.unwrap().len(), 4);
    let err = n1.read(&peer2, &chunk(99), 0, 10).await.unwrap_err();
    assert!(matches!(err, TransportError::Remote { ref err, .. } if err.errno == 2), "{err}");
    n1.delete(&peer2, 7).await.unwrap();
    assert!(store2.0.lock().is_empty());
}

async fn futures_join<F: std::future::Future>(futs: Vec<F>) -> Vec<F::Output> {
    let mut out = Vec::new();
    // Start them all before awaiting any.
    let handles: Vec<_> = futs.into_iter().map(Box::pin).collect();
    for h in handles {
        out.push(h.await);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_from_another_ca_is_refused() {
    let ca = ClusterCa::generate("cluster A").unwrap();
    let rogue_ca = ClusterCa::generate("cluster A").unwrap();
    let store = Arc::new(MemChunks::default());
    store.write(&chunk(1), b"secret").unwrap();
    let server = node(&ca.issue("n2").unwrap(), store);
    let peer = Peer { addr: server.local_addr(), node: "n2".into() };

    // A rogue node that trusts our CA (so it accepts our server) but holds a
    // certificate from another CA: our server must refuse it.
    let mut rogue_tls = rogue_ca.issue("n1").unwrap();
    rogue_tls.ca_pem = ca.cert_pem.clone();
    let rogue = node(&rogue_tls, Arc::default());
    let err = rogue.read(&peer, &chunk(1), 0, 6).await.unwrap_err();
    assert!(
        matches!(err, TransportError::Connect { .. } | TransportError::Stream { .. }),
        "rogue peer must not get data: {err}"
    );
    // And a node of the other cluster does not accept our server either.
    let stranger = node(&rogue_ca.issue("n3").unwrap(), Arc::default());
    assert!(matches!(stranger.read(&peer, &chunk(1), 0, 6).await, Err(TransportError::Connect { .. })));

    // The legitimate member still gets through afterwards.
    let member = node(&ca.issue("n1").unwrap(), Arc::default());
    assert_eq!(member.read(&peer, &chunk(1), 0, 6).await.unwrap(), b"secret");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_on_a_stream_resets_only_that_stream() {
    let ca = ClusterCa::generate("cluster").unwrap();
    let store = Arc::new(MemChunks::default());
    store.write(&chunk(3), b"intact").unwrap();
    let server = node(&ca.issue("n2").unwrap(), store);
    let peer = Peer { addr: server.local_addr(), node: "n2".into() };

    // A member that sends junk instead of a frame.
    let tls = ca.issue("n1").unwrap();
    let mut ep = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    ep.set_default_client_config(tls.client_config().unwrap());
    let conn = ep.connect(peer.addr, "n2").unwrap().await.unwrap();
    for junk in
        [&b"GET / HTTP/1.1\r\n\r\n"[..], &[0xff; 64][..], b"CVG\x02\xff\xff\xff\xff", b"CVG\x01\x00\x00\x00\x00"]
    {
        let (mut send, mut recv) = conn.open_bi().await.unwrap();
        send.write_all(junk).await.unwrap();
        let _ = send.finish();
        let mut buf = [0u8; 16];
        let r = recv.read_exact(&mut buf).await;
        assert!(r.is_err(), "a bad frame gets no answer");
    }
    // The server still answers proper requests, on a new and the same connection.
    let client = node(&tls, Arc::default());
    assert_eq!(client.read(&peer, &chunk(3), 0, 6).await.unwrap(), b"intact");
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    send.write_all(&converged_transport::Request::Read { chunk: chunk(3), at: 0, len: 6 }.encode()).await.unwrap();
    send.finish().unwrap();
    let reply = recv.read_to_end(1024).await.unwrap();
    assert!(reply.ends_with(b"intact"));
}

/// A peer's write is stored as its bytes arrive: one whose stream ends
/// short stores nothing and is answered with an error; one the store
/// refuses is answered with the refusal (its bytes read and dropped), not
/// a reset stream that would read as a failed peer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_cut_short_stores_nothing_and_a_refusal_is_answered() {
    let ca = ClusterCa::generate("cluster").unwrap();
    let store = Arc::new(MemChunks::default());
    let server = node(&ca.issue("n2").unwrap(), store.clone());
    let peer = Peer { addr: server.local_addr(), node: "n2".into() };
    let tls = ca.issue("n1").unwrap();

    let mut ep = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    ep.set_default_client_config(tls.client_config().unwrap());
    let conn = ep.connect(peer.addr, "n2").unwrap().await.unwrap();
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    send.write_all(&Request::WriteUnsynced { chunk: chunk(5), len: 1 << 20 }.encode()).await.unwrap();
    send.write_all(&pattern(300_000)).await.unwrap();
    send.finish().unwrap();
    let reply = recv.read_to_end(1 << 16).await.unwrap();
    match Response::decode(&reply).unwrap() {
        Response::Error { errno, msg } => assert_eq!(errno, 5, "{msg}"),
        other => panic!("a write cut short was answered {other:?}"),
    }
    assert!(!store.0.lock().contains_key(&chunk(5)), "nothing stored from a short write");

    store.1.store(true, Ordering::Relaxed);
    let client = node(&tls, Arc::default());
    let e = client.write(&peer, &chunk(6), &bytes::Bytes::from(pattern(8 << 20))).await.unwrap_err();
    assert!(matches!(e, TransportError::Remote { err: ServiceError { errno: 13, .. }, .. }), "{e}");
    assert!(!store.0.lock().contains_key(&chunk(6)));
    store.1.store(false, Ordering::Relaxed);
    client.write(&peer, &chunk(6), &bytes::Bytes::from(pattern(8 << 20))).await.unwrap();
    assert_eq!(store.0.lock()[&chunk(6)], pattern(8 << 20));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_peer_fails_within_the_deadline() {
    let ca = ClusterCa::generate("cluster").unwrap();
    let client = QuicTransport::bind(
        "127.0.0.1:0".parse().unwrap(),
        &ca.issue("n1").unwrap(),
        Arc::new(MemChunks::default()),
        Duration::from_millis(500),
    )
    .unwrap();
    // A UDP socket that never answers.
    let silent = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let addr: SocketAddr = silent.local_addr().unwrap();
    let started = Instant::now();
    let err = client.read(&Peer { addr, node: "n9".into() }, &chunk(1), 0, 10).await.unwrap_err();
    assert!(matches!(err, TransportError::Timeout { .. }), "{err}");
    assert!(err.is_retryable());
    assert!(started.elapsed() < Duration::from_secs(5), "deadline, not a hang");
}

/// A peer that dies holding our connections (it says nothing as it dies)
/// and starts again on the same address with the same certificate answers
/// every call, the first ones too: its stateless reset, which only its
/// own key makes, ends each dead connection at the first packet, where
/// without it a call on one would wait out its deadline and fail, and so
/// would the calls after it until quinn's idle timeout (30 s).
#[test]
fn a_peer_started_again_on_its_address_is_answered_at_the_first_call() {
    let ca = ClusterCa::generate("cluster").unwrap();
    let n2_tls = ca.issue("n2").unwrap();
    // Chunks on n2's disk: they outlive its process.
    let disk = Arc::new(MemChunks::default());
    for ino in 1..=8 {
        disk.0.lock().insert(chunk(ino), pattern(1000 + ino as usize));
    }
    let runtime = || tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let rt1 = runtime();
    let n1 = {
        let _in = rt1.enter();
        node(&ca.issue("n1").unwrap(), Arc::default())
    };
    // n2 in a runtime of its own: shutting it down stops every task of
    // n2 at once, its endpoint's driver first among them, so no packet
    // (no CONNECTION_CLOSE) leaves it, as with kill -9.
    let rt2 = runtime();
    let n2 = {
        let _in = rt2.enter();
        node(&n2_tls, disk.clone())
    };
    let addr = n2.local_addr();
    let peer = Peer { addr, node: "n2".into() };
    rt1.block_on(async {
        // Each connection n1 keeps to n2 carries a call.
        for ino in 1..=4 {
            assert_eq!(n1.read(&peer, &chunk(ino), 0, 4096).await.unwrap(), pattern(1000 + ino as usize));
        }
    });
    rt2.shutdown_background();
    drop(n2);

    let rt3 = runtime();
    let _n2_again = {
        let _in = rt3.enter();
        let started = Instant::now();
        loop {
            match QuicTransport::bind(addr, &n2_tls, disk.clone(), Duration::from_secs(3)) {
                Ok(t) => break t,
                // The dead runtime's socket may take a moment to close.
                Err(e) if started.elapsed() < Duration::from_secs(10) => {
                    eprintln!("binding {addr} again: {e}");
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => panic!("n2 cannot bind its address again: {e}"),
            }
        }
    };
    rt1.block_on(async {
        for ino in 1..=8 {
            let got = n1.read(&peer, &chunk(ino), 0, 4096).await;
            let got = got.unwrap_or_else(|e| panic!("read {ino} from n2 started again: {e}"));
            assert_eq!(got, pattern(1000 + ino as usize), "chunk {ino}");
        }
    });
}
