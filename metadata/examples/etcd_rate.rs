//! Transactions per second against an etcd endpoint, from N threads:
//! the ceiling a mount's creates meet (the last shape is a create's). `cargo run --release -p
//! converged-metadata --example etcd_rate -- 127.0.0.1:2379 16 2000`
//!
//! `--watchers N` has N more clients, each on a connection of its own,
//! watch the prefix the threads write, as each node of an N-node cluster
//! watches its volume: etcd then sends every transaction to each of them,
//! which is part of what a cluster's commits cost it.
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use converged_metadata::kv::{Durability, KvEngine};
use converged_metadata::EtcdKv;

/// A transaction's shape: reads, compares of versions known without
/// reading them, puts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Shape {
    /// One put.
    Put,
    /// Three reads, then one put (a create with a cold cache).
    ReadsPut,
    /// Three compares and four puts, no read (a create with a warm cache).
    Create,
}

impl Shape {
    fn counts(self) -> (usize, usize, usize) {
        match self {
            Shape::Put => (0, 0, 1),
            Shape::ReadsPut => (3, 0, 1),
            Shape::Create => (0, 3, 4),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Mode {
    /// Each commit its own transaction: etcd's own rate.
    Alone,
    /// Commits that meet share a transaction, as a node commits.
    Grouped,
}

/// Transactions per second against one etcd, by shape, from N threads.
#[derive(Parser, Debug)]
#[command(name = "etcd_rate")]
struct Args {
    /// etcd client endpoint, HOST:PORT.
    #[arg(default_value = "127.0.0.1:2379")]
    endpoint: String,
    /// Threads committing at once.
    #[arg(default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=1024))]
    threads: u32,
    /// Transactions per shape, all threads together.
    #[arg(default_value_t = 2000, value_parser = clap::value_parser!(u32).range(1..))]
    total: u32,
    /// Shapes to measure, comma separated [default: all].
    #[arg(long, value_delimiter = ',')]
    shape: Vec<Shape>,
    /// Modes to measure, comma separated [default: both].
    #[arg(long, value_delimiter = ',')]
    mode: Vec<Mode>,
    /// Clients watching the prefix written, each on its own connection
    /// (a cluster's nodes).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=256))]
    watchers: u32,
    /// Microseconds each thread spends between its commits, asleep (a
    /// mount's FUSE work between creates). Each commit's own time is
    /// printed beside the rate.
    #[arg(long, default_value_t = 0)]
    think_us: u64,
}

fn main() {
    let args = Args::parse();
    let connect = || match EtcdKv::connect(std::slice::from_ref(&args.endpoint), "rate", Duration::from_secs(5)) {
        Ok(kv) => kv,
        Err(e) => {
            eprintln!("etcd_rate: cannot reach etcd at {}: {e}", args.endpoint);
            std::process::exit(1);
        }
    };
    let watchers: Vec<EtcdKv> = (0..args.watchers).map(|_| connect()).collect();
    for w in &watchers {
        if let Err(e) = w.watch(Arc::new(|_: &[u8], _: Option<&[u8]>| {})) {
            eprintln!("etcd_rate: cannot watch at {}: {e}", args.endpoint);
            std::process::exit(1);
        }
    }
    let shapes = if args.shape.is_empty() { vec![Shape::Put, Shape::ReadsPut, Shape::Create] } else { args.shape };
    let modes = if args.mode.is_empty() { vec![Mode::Alone, Mode::Grouped] } else { args.mode };
    let (threads, total) = (args.threads as usize, args.total as usize);
    let watched = match args.watchers {
        0 => String::new(),
        n => format!(", {n} watching"),
    };
    for mode in modes {
        let kv = connect();
        let kv = Arc::new(if mode == Mode::Alone { kv.alone() } else { kv });
        let label = if mode == Mode::Alone { "alone" } else { "grouped" };
        for shape in &shapes {
            let (reads, assumed, puts) = shape.counts();
            let t0 = Instant::now();
            let think = Duration::from_micros(args.think_us);
            let committing = Arc::new(std::sync::atomic::AtomicU64::new(0));
            let workers: Vec<_> = (0..threads)
                .map(|t| {
                    let kv = kv.clone();
                    let committing = committing.clone();
                    std::thread::spawn(move || -> Result<(), String> {
                        for i in 0..total / threads {
                            if !think.is_zero() {
                                std::thread::sleep(think);
                            }
                            let c0 = Instant::now();
                            let mut txn = kv.write_txn().map_err(|e| e.to_string())?;
                            for r in 0..reads {
                                txn.get(format!("r{t}-{r}").as_bytes()).map_err(|e| e.to_string())?;
                            }
                            for a in 0..assumed {
                                txn.assume(format!("a{t}-{a}").as_bytes(), 0);
                            }
                            for p in 0..puts {
                                txn.put(format!("k{reads}{puts}-{t}-{i}-{p}").as_bytes(), &[7u8; 64]);
                            }
                            txn.commit(Durability::Durable).map_err(|e| e.to_string())?;
                            let took = c0.elapsed().as_nanos() as u64;
                            committing.fetch_add(took, std::sync::atomic::Ordering::Relaxed);
                        }
                        Ok(())
                    })
                })
                .collect();
            for w in workers {
                if let Err(e) = w.join().unwrap_or_else(|_| Err("a thread panicked".into())) {
                    eprintln!("etcd_rate: {e}");
                    std::process::exit(1);
                }
            }
            let secs = t0.elapsed().as_secs_f64();
            let done = (total / threads * threads) as f64;
            let thinking = match args.think_us {
                0 => String::new(),
                us => format!(", {us} µs between commits"),
            };
            println!(
                "{threads} threads, {label}, {reads} reads + {assumed} compares + {puts} puts per txn{watched}{thinking}: \
                 {:.0} txn/s, {:.0} µs a commit",
                done / secs,
                committing.load(std::sync::atomic::Ordering::Relaxed) as f64 / done / 1000.0
            );
        }
    }
}
