//! What files and chunk records cost etcd's database: FILES files of BYTES
//! each made and published through the namespace (a chunk record per
//! 64 MiB, of two holders, with a crc per 64 KiB block), in directories of
//! 1,000, from 16 threads, on a fresh volume; then etcd's history is
//! compacted and its database defragmented (what `--auto-compaction` and a
//! maintenance defrag reach) and its size read. Prints bytes and keys per
//! file, and the files one etcd holds at its default 2 GiB
//! quota and at the 8 GiB it documents as the suggested maximum.
//!
//! `cargo run --release -p converged-metadata --example etcd_size -- 127.0.0.1:2379 20000 110000`
//! (bench/control-plane.sh runs it against an etcd of its own).

use std::sync::Arc;
use std::time::{Duration, Instant};

use converged_metadata::types::{ChunkRecord, FileKind, NewNode, Timespec, BLOCK_SIZE, DEFAULT_CHUNK_SIZE, ROOT_INO};
use converged_metadata::{Durability, EtcdKv, KvEngine, Namespace, Seal};

const THREADS: usize = 16;
const PER_DIR: usize = 1000;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: etcd_size HOST:PORT FILES BYTES_PER_FILE";
    let endpoint = args.first().cloned().unwrap_or_else(|| "127.0.0.1:2379".into());
    let files: usize = args.get(1).map(|a| a.parse().expect(usage)).unwrap_or(20_000);
    let size: u64 = args.get(2).map(|a| a.parse().expect(usage)).unwrap_or(110_000);
    let chunk_size = DEFAULT_CHUNK_SIZE as u64;
    let chunks = size.div_ceil(chunk_size) as u32;
    let volume = format!("size-{}", std::process::id());

    let before = status(&endpoint);
    let kv: Arc<dyn KvEngine> =
        Arc::new(EtcdKv::connect(std::slice::from_ref(&endpoint), &volume, Duration::from_secs(10)).expect("connect"));
    let ns = Arc::new(Namespace::open(kv, 0, 0).expect("open the volume").with_node("n1"));
    let dirs: Vec<u64> = (0..files.div_ceil(PER_DIR))
        .map(|d| {
            let node = NewNode::plain(FileKind::Directory, 0o755);
            ns.mknod(ROOT_INO, format!("d{d}").as_bytes(), &node).expect("mkdir").ino
        })
        .collect();
    // Chunk `c` of a file: its length, a crc per 64 KiB block of it.
    let record = |c: u32| {
        let len = (size - c as u64 * chunk_size).min(chunk_size) as u32;
        ChunkRecord {
            version: 1,
            len,
            replicas: vec!["node-0001".into(), "node-0002".into()],
            block_crcs: (0..len.div_ceil(BLOCK_SIZE)).map(|b| b.wrapping_mul(2_654_435_761)).collect(),
        }
    };
    let records: Vec<(u32, ChunkRecord)> = (0..chunks).map(|c| (c, record(c))).collect();
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (ns, dirs, records) = (ns.clone(), &dirs, &records);
            s.spawn(move || {
                for i in (t..files).step_by(THREADS) {
                    let node = NewNode { unsealed: true, ..NewNode::plain(FileKind::Regular, 0o644) };
                    let name = format!("shard-{i:08}.tar");
                    let f = ns.mknod(dirs[i / PER_DIR], name.as_bytes(), &node).expect("create");
                    let seal = Seal {
                        size,
                        mtime: Timespec::now(),
                        chunks: records.clone(),
                        keep_unsealed: false,
                        lease: None,
                        data_durable: true,
                        attrs: None,
                    };
                    ns.seal(f.ino, &seal, Durability::Buffered).expect("publish");
                }
            });
        }
    });
    let secs = t0.elapsed().as_secs_f64();
    let after = status(&endpoint);
    let bytes = after.0.saturating_sub(before.0) as f64;
    let keys = after.1.saturating_sub(before.1) as f64;
    let (per_file, keys_per_file) = (bytes / files as f64, keys / files as f64);
    println!(
        "{files} files of {size} bytes ({chunks} chunk record(s), 2 holders each) in {secs:.1} s ({:.0} files/s, 16 threads)",
        files as f64 / secs
    );
    println!(
        "etcd database after compaction and defrag: +{:.1} MiB, +{keys} keys: {per_file:.0} bytes and {keys_per_file:.1} keys per file",
        bytes / (1 << 20) as f64
    );
    println!(
        "per million files: {:.2} GiB; files one etcd holds at its 2 GiB default quota: {:.2} M, at 8 GiB: {:.2} M",
        per_file * 1e6 / (1u64 << 30) as f64,
        (2u64 << 30) as f64 / per_file / 1e6,
        (8u64 << 30) as f64 / per_file / 1e6
    );
}

/// etcd's database size after compacting its history to now and
/// defragmenting, and how many keys it holds.
fn status(endpoint: &str) -> (u64, u64) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(async {
        let mut c = etcd_client::Client::connect([endpoint], None).await.expect("connect to etcd");
        let all = c
            .get(vec![0u8], Some(etcd_client::GetOptions::new().with_from_key().with_count_only()))
            .await
            .expect("count keys");
        let revision = all.header().expect("a header").revision();
        // Fails only when nothing was written since the last compaction.
        let _ = c.compact(revision, Some(etcd_client::CompactionOptions::new().with_physical())).await;
        c.defragment().await.expect("defragment");
        let keys = all.count();
        let size = c.status().await.expect("status").db_size();
        (size as u64, keys as u64)
    })
}
