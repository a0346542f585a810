//! Transactions per second against an etcd endpoint, from N threads:
//! the ceiling a mount's creates meet (the last line is a create's shape). `cargo run --release -p
//! converged-metadata --example etcd_rate -- 127.0.0.1:2379 16 2000`
//!
//! With `WATCH=1` the client also holds a watch on the prefix it writes, as
//! every node of a cluster does on its volume (etcd then sends each put
//! to a watcher too).
use std::sync::Arc;
use std::time::{Duration, Instant};

use converged_metadata::kv::{Durability, KvEngine};
use converged_metadata::EtcdKv;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let endpoint = args.first().cloned().unwrap_or_else(|| "127.0.0.1:2379".into());
    let threads: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(16);
    let total: usize = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(2000);
    // etcd itself (each commit its own transaction), then as a node commits
    // (commits that meet share a transaction: group commit).
    for (label, alone) in [("alone", true), ("grouped", false)] {
        let kv = EtcdKv::connect(std::slice::from_ref(&endpoint), "rate", Duration::from_secs(5)).unwrap();
        let kv = Arc::new(if alone { kv.alone() } else { kv });
        if std::env::var_os("WATCH").is_some() {
            kv.watch(Arc::new(|_: &[u8], _: Option<&[u8]>| {})).unwrap();
        }
        // (reads, puts, compares of versions known without reading them): a
        // put alone; three reads and a put; and a create as a node with a warm
        // cache commits it (three compares, four puts, no read).
        for (reads, puts, assumed) in [(0, 1, 0), (3, 1, 0), (0, 4, 3)] {
            let t0 = Instant::now();
            let workers: Vec<_> = (0..threads)
                .map(|t| {
                    let kv = kv.clone();
                    std::thread::spawn(move || {
                        for i in 0..total / threads {
                            let mut txn = kv.write_txn().unwrap();
                            for r in 0..reads {
                                txn.get(format!("r{t}-{r}").as_bytes()).unwrap();
                            }
                            for a in 0..assumed {
                                txn.assume(format!("a{t}-{a}").as_bytes(), 0);
                            }
                            for p in 0..puts {
                                txn.put(format!("k{reads}{puts}-{t}-{i}-{p}").as_bytes(), &[7u8; 64]);
                            }
                            txn.commit(Durability::Durable).unwrap();
                        }
                    })
                })
                .collect();
            for w in workers {
                w.join().unwrap();
            }
            let secs = t0.elapsed().as_secs_f64();
            println!(
                "{threads} threads, {label}, {reads} reads + {assumed} compares + {puts} puts per txn: {:.0} txn/s",
                total as f64 / secs
            );
        }
    }
}
