//! A mounted node serves its chunks to peers over QUIC with mutual TLS: a
//! peer holding a cluster certificate reads the bytes of a file written on
//! the mount, found through the volume's membership; a stranger is refused.

mod common;

use std::os::unix::fs::MetadataExt;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use converged_transport::{ChunkRef, ChunkService, ClusterCa, NodeTls, Peer, QuicTransport, ServiceError};

struct Nothing;
impl ChunkService for Nothing {
    fn read(&self, _: &ChunkRef, _: u64, _: u32) -> Result<Vec<u8>, ServiceError> {
        Err(ServiceError { errno: 2, msg: "none".into() })
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

/// The version of chunk 0 of a file, from its `user.converged.layout`
/// attribute (`index vN len holders` per chunk).
fn first_chunk_version(path: &std::path::Path) -> u64 {
    let out = std::process::Command::new("getfattr")
        .args(["--only-values", "-n", "user.converged.layout"])
        .arg(path)
        .output()
        .unwrap();
    let layout = String::from_utf8_lossy(&out.stdout).into_owned();
    let line = layout.lines().next().unwrap_or_else(|| panic!("no layout: {layout:?}"));
    line.split_whitespace().nth(1).and_then(|v| v.strip_prefix('v')).and_then(|v| v.parse().ok()).unwrap()
}

/// One mounted node n1 of a volume on a real etcd, serving over QUIC, with
/// the cluster CA to issue other certificates from and n1's address as a
/// peer finds it (in the volume's membership, through `converged status`).
struct OneNode {
    _etcd: common::etcd_cluster::EtcdCluster,
    _t: tempfile::TempDir,
    m: Mount,
    ca: ClusterCa,
    peer: Peer,
}

fn one_node(volume: &str) -> Option<OneNode> {
    let etcd = common::etcd_cluster::EtcdCluster::start()?;
    let t = tempfile::tempdir().unwrap();
    let ca_dir = t.path().join("ca");
    let out = converged().args(["cluster", "init", "--node", "n1", "--out"]).arg(&ca_dir).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let uri = etcd.uri(volume);
    let tls_dir = ca_dir.join("n1");
    let m = Mount::with_args(&["--meta", &uri, "--listen", "127.0.0.1:0", "--tls-dir", tls_dir.to_str().unwrap()]);
    let out = converged().args(["status", "--meta", &uri]).output().unwrap();
    let status = String::from_utf8_lossy(&out.stdout).into_owned();
    let line = status.lines().find(|l| l.starts_with("n1 ")).unwrap_or_else(|| panic!("n1 not in status:\n{status}"));
    let addr: std::net::SocketAddr = line.split_whitespace().nth(2).unwrap().parse().unwrap();
    let ca = ClusterCa::load(&ca_dir).unwrap();
    Some(OneNode { _etcd: etcd, _t: t, m, ca, peer: Peer { addr, node: "n1".into() } })
}

#[test]
fn a_mounted_node_serves_its_chunks_to_cluster_peers_only() {
    let Some(OneNode { _etcd, _t, m, ca, peer }) = one_node("peers") else { return };
    let data = pattern((3 << 20) + 777, 42);
    std::fs::write(m.path("shard-0000.tar"), &data).unwrap();
    let ino = std::fs::metadata(m.path("shard-0000.tar")).unwrap().ino();
    // One 64 MiB chunk: the whole file.
    let chunk = ChunkRef { ino, index: 0, version: first_chunk_version(&m.path("shard-0000.tar")), start: 0 };

    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let n2 = QuicTransport::bind(
            "127.0.0.1:0".parse().unwrap(),
            &ca.issue("n2").unwrap(),
            Arc::new(Nothing),
            Duration::from_secs(5),
        )
        .unwrap();
        let got = n2.read(&peer, &chunk, 0, data.len() as u32).await.unwrap();
        assert!(got == data, "peer read returns the file's bytes");
        let part = n2.read(&peer, &chunk, 1 << 20, 65536).await.unwrap();
        assert_eq!(part, data[1 << 20..(1 << 20) + 65536]);
        let crcs = n2.checksums(&peer, &chunk, 0, data.len() as u64).await.unwrap();
        let want: Vec<u32> = data.chunks(64 << 10).map(crc32c_of).collect();
        assert_eq!(crcs, want, "block checksums match the bytes");

        // A node of another cluster, even one that trusts our CA, gets nothing.
        let rogue_ca = ClusterCa::generate("someone else").unwrap();
        let mut rogue: NodeTls = rogue_ca.issue("n3").unwrap();
        rogue.ca_pem = ca.cert_pem.clone();
        let rogue =
            QuicTransport::bind("127.0.0.1:0".parse().unwrap(), &rogue, Arc::new(Nothing), Duration::from_secs(5))
                .unwrap();
        assert!(rogue.read(&peer, &chunk, 0, 10).await.is_err());
    });
}

/// crc32c (Castagnoli), bitwise: independent of the daemon's implementation.
fn crc32c_of(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for b in data {
        crc ^= *b as u32;
        for _ in 0..8 {
            crc = if crc & 1 != 0 { (crc >> 1) ^ 0x82F6_3B78 } else { crc >> 1 };
        }
    }
    !crc
}

#[test]
fn a_cluster_certificate_alone_does_not_let_a_peer_write_or_delete_another_nodes_file() {
    let Some(OneNode { _etcd, _t, mut m, ca, peer }) = one_node("authz") else { return };
    let data = pattern(2 << 20, 5);
    std::fs::write(m.path("ckpt.pt"), &data).unwrap();
    let ino = std::fs::metadata(m.path("ckpt.pt")).unwrap().ino();
    let version = first_chunk_version(&m.path("ckpt.pt"));
    let chunk = ChunkRef { ino, index: 0, version, start: 0 };

    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let bind = |name: &str| {
        QuicTransport::bind(
            "127.0.0.1:0".parse().unwrap(),
            &ca.issue(name).unwrap(),
            Arc::new(Nothing),
            Duration::from_secs(5),
        )
        .unwrap()
    };
    let refused = |r: Result<(), converged_transport::TransportError>, errno: i32, what: &str| match r {
        Err(converged_transport::TransportError::Remote { err, .. }) => {
            assert_eq!(err.errno, errno, "{what}: {}", err.msg);
        }
        other => panic!("{what}: expected a refusal, got {other:?}"),
    };
    rt.block_on(async {
        let n2 = bind("n2");
        // n2 holds no lease of the file and no copy: a new version from it is refused...
        let forged = ChunkRef { version: version + 1, ..chunk };
        refused(
            n2.write(&peer, &forged, &bytes::Bytes::from(vec![0u8; data.len()])).await,
            libc::EACCES,
            "write of a new version by n2",
        );
        // ...as is the version n1 holds, and a delete of a file whose records name n1.
        refused(
            n2.write(&peer, &chunk, &bytes::Bytes::from(vec![0u8; data.len()])).await,
            libc::EACCES,
            "write over n1's version by n2",
        );
        refused(n2.delete(&peer, ino).await, libc::EACCES, "delete of n1's file by n2");
        // Saying the file was made in a directory delegated to n2 (the
        // root, which is delegated to nobody) changes nothing.
        let zeros = bytes::Bytes::from(vec![0u8; data.len()]);
        let made = n2.write_made(&peer, &forged, &zeros, true, 1).await;
        refused(made, libc::EACCES, "write of a new version by n2, as made under a delegation");
        // The node the record names may copy its own version (background replication does).
        let n1_again = bind("n1");
        n1_again
            .write(&peer, &chunk, &bytes::Bytes::from(data.clone()))
            .await
            .expect("a recorded holder may write its version");
    });
    drop_caches();
    same(&std::fs::read(m.path("ckpt.pt")).unwrap(), &data, "the file after the refused writes and delete");
    assert!(m.log().contains("refused a peer's request"), "refusals are logged");

    // Mounted read-only on the same address, the node refuses even the write
    // it allowed above, and a delete: its disk changes for no peer.
    m.umount();
    let listen = m.extra.iter().position(|a| a == "--listen").unwrap() + 1;
    m.extra[listen] = peer.addr.to_string();
    m.extra.push("--read-only".into());
    m.mount();
    rt.block_on(async {
        let n1_again = bind("n1");
        refused(
            n1_again.write(&peer, &chunk, &bytes::Bytes::from(data.clone())).await,
            libc::EROFS,
            "a write to a read-only node",
        );
        refused(n1_again.delete(&peer, ino).await, libc::EROFS, "a delete on a read-only node");
    });
    same(&std::fs::read(m.path("ckpt.pt")).unwrap(), &data, "the file on the read-only node");
}

fn same(got: &[u8], want: &[u8], what: &str) {
    assert!(got == want, "{what}: {} bytes read, {} expected", got.len(), want.len());
}
