//! Remote sequential read over loopback: converged's QUIC transport against
//! a plain TCP copy of the same bytes, in the same run.
//!
//!     cargo run --release -p converged-transport --example loopback_bench -- [MiB] [request KiB] [parallel]
//!
//! Prints GB/s for each and the ratio QUIC / TCP.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use converged_transport::{ChunkRef, ChunkService, ClusterCa, Peer, QuicTransport, ServiceError};

/// Serves the same buffer for every read: measures the transport, not a disk.
struct Zeros(Vec<u8>);

impl ChunkService for Zeros {
    fn read(&self, _: &ChunkRef, _at: u64, len: u32) -> Result<Vec<u8>, ServiceError> {
        Ok(self.0[..len as usize].to_vec())
    }
    fn write(&self, _: &ChunkRef, _: &[u8]) -> Result<(), ServiceError> {
        Ok(())
    }
    fn delete(&self, _: u64) -> Result<(), ServiceError> {
        Ok(())
    }
    fn checksums(&self, _: &ChunkRef, _: u64, _: u64) -> Result<Vec<u32>, ServiceError> {
        Ok(Vec::new())
    }
}

/// The one chunk every request of the benchmark reads.
const CHUNK: ChunkRef = ChunkRef { ino: 1, index: 0, version: 1, start: 0 };

fn tcp_copy(total: usize, req: usize) -> f64 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let buf = vec![7u8; req];
        let mut sent = 0;
        while sent < total {
            s.write_all(&buf).unwrap();
            sent += req;
        }
    });
    let mut c = TcpStream::connect(addr).unwrap();
    let mut buf = vec![0u8; req];
    let start = Instant::now();
    let mut got = 0;
    while got < total {
        c.read_exact(&mut buf).unwrap();
        got += req;
    }
    let secs = start.elapsed().as_secs_f64();
    server.join().unwrap();
    total as f64 / secs / 1e9
}

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).map(|a| a.parse().expect("numbers")).collect();
    let total = args.first().copied().unwrap_or(2048) << 20;
    let req = args.get(1).copied().unwrap_or(4096) << 10;
    let parallel = args.get(2).copied().unwrap_or(4);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let quic = rt.block_on(async {
        let ca = ClusterCa::generate("bench").unwrap();
        let server = QuicTransport::bind(
            "127.0.0.1:0".parse().unwrap(),
            &ca.issue("n2").unwrap(),
            Arc::new(Zeros(vec![7u8; req])),
            Duration::from_secs(30),
        )
        .unwrap();
        let client = Arc::new(
            QuicTransport::bind(
                "127.0.0.1:0".parse().unwrap(),
                &ca.issue("n1").unwrap(),
                Arc::new(Zeros(Vec::new())),
                Duration::from_secs(30),
            )
            .unwrap(),
        );
        let peer = Peer { addr: server.local_addr(), node: "n2".into() };
        // Connect, and let path MTU discovery settle, outside the timing.
        for _ in 0..(256 << 20) / req {
            client.read(&peer, &CHUNK, 0, req as u32).await.unwrap();
        }
        let start = Instant::now();
        let per_task = total / req / parallel;
        let tasks: Vec<_> = (0..parallel)
            .map(|_| {
                let (client, peer) = (client.clone(), peer.clone());
                tokio::spawn(async move {
                    for _ in 0..per_task {
                        let d = client.read(&peer, &CHUNK, 0, req as u32).await.unwrap();
                        assert_eq!(d.len(), req);
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        (per_task * parallel * req) as f64 / start.elapsed().as_secs_f64() / 1e9
    });
    let tcp = tcp_copy(total, req);
    println!("remote sequential read, {} MiB in {} KiB requests, {parallel} in flight", total >> 20, req >> 10);
    println!("  tcp copy (loopback)   {tcp:.2} GB/s");
    println!("  converged QUIC        {quic:.2} GB/s");
    println!("  ratio                 {:.2}x  (target >= 0.5x)", quic / tcp);
}
