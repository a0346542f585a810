//! The control plane of N nodes against one etcd, without their FUSE and
//! data planes: each agent is what a node's daemon keeps of it, with the
//! real code: its own etcd client, its membership registration and
//! heartbeat (a keepalive every third of the lease TTL, the record written
//! again when it changes), and the node cache's watch on the whole volume.
//! It reports what etcd itself counts (`/metrics` on its client port):
//! requests and bytes a second while every agent is at rest, then while a
//! tenth of them create files (each in a directory of its own, through the
//! namespace over its cache, as a node's creates go).
//!
//! Then, with CHUNKS synthetic chunk records loaded (two holders each,
//! spread over the agents, with their holder-index entries), the repair
//! wave after one agent dies (its keepalives stop, etcd expires its lease)
//! and a drain of another: every live agent walks the leaving node's
//! holder-index entries, and for each chunk it is the repairer of
//! (rendezvous hashing over the live agents, as repair spreads its work)
//! does what repair does to the metadata: reads the record, records the new
//! copy (no bytes move here), reads it again, drops the leaving holder.
//! The wave's etcd requests are set beside the leaving node's chunks and a
//! scan of every record by one agent (what each agent's pass cost before
//! the index).
//!
//! `cargo run --release -p converged-metadata --example control_sim -- 127.0.0.1:2379 200 20 10 1000000`
//! (agents, seconds at rest, seconds creating, chunk records; bench/control-plane.sh
//! runs it against an etcd of its own for N = 50, 100 and 200).

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use converged_metadata::kv::Durability;
use converged_metadata::membership::NodeInfo;
use converged_metadata::round_trips::{self, RoundTrip};
use converged_metadata::types::{ChunkRecord, FileKind, NewNode, Timespec, ROOT_INO};
use converged_metadata::{schema, CachedKv, EtcdKv, KvEngine, Namespace, NodeAdmin};

/// The daemon's default `--lease-ttl`.
const TTL: Duration = Duration::from_secs(15);

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: control_sim HOST:PORT AGENTS REST_SECONDS CREATE_SECONDS [CHUNK_RECORDS]";
    let endpoint = args.first().cloned().unwrap_or_else(|| "127.0.0.1:2379".into());
    let n: usize = args.get(1).map(|a| a.parse().expect(usage)).unwrap_or(50);
    let rest: u64 = args.get(2).map(|a| a.parse().expect(usage)).unwrap_or(20);
    let busy: u64 = args.get(3).map(|a| a.parse().expect(usage)).unwrap_or(10);
    let records: u64 = args.get(4).map(|a| a.parse().expect(usage)).unwrap_or(0);
    let volume = format!("sim-{}", std::process::id());
    let stop = Arc::new(AtomicBool::new(false));

    let t0 = Instant::now();
    let alive: Vec<Arc<AtomicBool>> = (0..n).map(|_| Arc::new(AtomicBool::new(true))).collect();
    let ids: Vec<String> = (0..n).map(|i| format!("node-{i:04}")).collect();
    let agents: Vec<Arc<Namespace>> = (0..n)
        .map(|i| {
            let id = format!("node-{i:04}");
            let etcd = Arc::new(
                EtcdKv::connect(std::slice::from_ref(&endpoint), &volume, Duration::from_secs(10)).expect("connect"),
            );
            let engine: Arc<dyn KvEngine> = CachedKv::wrap(etcd.clone()).expect("watch the volume");
            let ns = Arc::new(Namespace::open(engine, 0, 0).expect("open the volume").with_node(&id));
            let mut info = NodeInfo {
                id,
                addr: format!("10.0.{}.{}:7000", i / 250, i % 250),
                capacity: 30 << 40,
                free: 20 << 40,
                labels: BTreeMap::from([("rack".to_string(), format!("r{}", i % 32))]),
                started: Timespec::now(),
                heartbeat: Timespec::now(),
            };
            let m = etcd.membership().expect("etcd has membership");
            m.register(&info, TTL).expect("register");
            let stop = stop.clone();
            let alive = alive[i].clone();
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) && alive.load(Ordering::Relaxed) {
                    std::thread::sleep(TTL / 3);
                    info.heartbeat = Timespec::now();
                    if let Some(m) = etcd.membership() {
                        let _ = m.heartbeat(&info);
                    }
                }
            });
            ns
        })
        .collect();
    println!("{n} agents registered and watching in {:.1} s", t0.elapsed().as_secs_f64());
    std::thread::sleep(Duration::from_secs(2));

    let before = etcd_metrics(&endpoint);
    std::thread::sleep(Duration::from_secs(rest));
    let after = etcd_metrics(&endpoint);
    report("at rest", n, rest, &before, &after, 0);

    let creators = (n / 10).max(1);
    let made = Arc::new(AtomicU64::new(0));
    let creating = Arc::new(AtomicBool::new(true));
    let before = etcd_metrics(&endpoint);
    std::thread::scope(|s| {
        for (i, ns) in agents.iter().take(creators).enumerate() {
            let (made, creating) = (made.clone(), creating.clone());
            s.spawn(move || {
                let dir = ns.mknod(ROOT_INO, format!("d{i}").as_bytes(), &NewNode::plain(FileKind::Directory, 0o755));
                let dir = dir.expect("mkdir").ino;
                let mut k = 0u64;
                while creating.load(Ordering::Relaxed) {
                    let node = NewNode::plain(FileKind::Regular, 0o644);
                    ns.mknod(dir, format!("f{k}").as_bytes(), &node).expect("create");
                    made.fetch_add(1, Ordering::Relaxed);
                    k += 1;
                }
            });
        }
        std::thread::sleep(Duration::from_secs(busy));
        creating.store(false, Ordering::Relaxed);
    });
    let after = etcd_metrics(&endpoint);
    report(&format!("{creators} creating"), n, busy, &before, &after, made.load(Ordering::Relaxed));
    let asked: Vec<String> =
        RoundTrip::ALL.iter().map(|k| format!("{} {}", round_trips::total(*k), k.name())).collect();
    println!("the agents' own count of etcd requests (so far): {}", asked.join(", "));
    if records > 0 {
        repair_and_drain(&endpoint, &volume, &agents, &ids, &alive, records);
    }
    stop.store(true, Ordering::Relaxed);
}

/// Synthetic files of this many chunks each.
const CHUNKS_PER_FILE: u64 = 4;
/// Their inode numbers start here, far from the creates'.
const FIRST_SYNTHETIC_INO: u64 = 1 << 40;

/// The two holders of synthetic chunk `i`, by rendezvous over `ids`.
fn synthetic_holders(i: u64, ids: &[String]) -> [usize; 2] {
    let a = (hash(&(i, 0xa5u8)) % ids.len() as u64) as usize;
    let b = (a + 1 + (hash(&(i, 0x5au8)) % (ids.len() as u64 - 1)) as usize) % ids.len();
    [a, b]
}

fn hash<T: std::hash::Hash>(v: &T) -> u64 {
    use std::hash::{DefaultHasher, Hasher};
    let mut h = DefaultHasher::new();
    v.hash(&mut h);
    h.finish()
}

/// Load `records` chunk records (two holders each) with their holder-index
/// entries, 16 writers at once; returns how many chunks each agent holds.
fn load_chunks(endpoint: &str, volume: &str, ids: &[String], records: u64) -> Vec<u64> {
    let t = Instant::now();
    let next = AtomicU64::new(0);
    // A record and its two entries are three operations: 40 records a commit.
    const PER_TXN: u64 = 40;
    std::thread::scope(|s| {
        for _ in 0..16 {
            let next = &next;
            s.spawn(move || {
                let kv = EtcdKv::connect(&[endpoint.to_string()], volume, Duration::from_secs(30)).expect("connect");
                loop {
                    let first = next.fetch_add(PER_TXN, Ordering::Relaxed);
                    if first >= records {
                        return;
                    }
                    let mut txn = kv.write_txn().expect("txn");
                    for i in first..(first + PER_TXN).min(records) {
                        let (ino, index) = (FIRST_SYNTHETIC_INO + i / CHUNKS_PER_FILE, (i % CHUNKS_PER_FILE) as u32);
                        let holders = synthetic_holders(i, ids).map(|h| ids[h].clone());
                        let record = ChunkRecord {
                            version: 1,
                            len: 1 << 20,
                            replicas: holders.to_vec(),
                            block_crcs: vec![0; 16],
                        };
                        txn.put(&schema::chunk(ino, index), &postcard::to_allocvec(&record).expect("encode"));
                        for h in &holders {
                            txn.put(&schema::held_chunk(h, ino, index), &[]);
                        }
                    }
                    txn.commit(Durability::Buffered).expect("load");
                }
            });
        }
    });
    // Inode numbers past the volume's bound are never read: move it past them.
    let kv = EtcdKv::connect(&[endpoint.to_string()], volume, Duration::from_secs(30)).expect("connect");
    let mut txn = kv.write_txn().expect("txn");
    let bound = FIRST_SYNTHETIC_INO + records.div_ceil(CHUNKS_PER_FILE);
    txn.put(schema::NEXT_INO, &bound.to_be_bytes());
    txn.commit(Durability::Durable).expect("raise the inode bound");
    let mut held = vec![0u64; ids.len()];
    for i in 0..records {
        for h in synthetic_holders(i, ids) {
            held[h] += 1;
        }
    }
    println!(
        "\nloaded {records} chunk records (1 MiB, 16 block checksums, 2 holders each) with their holder-index entries in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    held
}

/// What one agent's pass over a leaving node's chunks did.
#[derive(Default)]
struct Pass {
    entries: u64,
    repaired: u64,
}

/// One agent's pass over `leaving`'s chunks, as repair makes it: the
/// index entries, and the records of the chunks this agent repairs (the
/// first live agent by rendezvous over (inode, chunk), as repair spreads
/// its work); then for each, the record read, the new copy recorded (on
/// the first live agent by rendezvous that holds none), the record read
/// again, the leaving holder dropped.
fn wave_pass(ns: &Namespace, me: &str, leaving: &str, live: &[String]) -> Pass {
    let mut mine = Vec::new();
    let repairer = |ino: u64, index: u32| live.iter().max_by_key(|n| hash(&(n, ino, index))).is_some_and(|n| n == me);
    let walk = ns
        .for_each_chunk_held_by_where(leaving, repairer, |ino, index, rec| mine.push((ino, index, rec.version)))
        .expect("walk the index");
    let mut pass = Pass { entries: walk.entries, repaired: 0 };
    let gone = [leaving.to_string()];
    for (ino, index, version) in mine {
        let Some(rec) = ns.chunk(ino, index).expect("read the record") else { continue };
        if rec.version != version {
            continue;
        }
        let target = live.iter().filter(|n| !rec.replicas.contains(n)).max_by_key(|n| hash(&(n, ino, index, 1u8)));
        let Some(target) = target else { continue };
        ns.add_replicas(ino, index, version, std::slice::from_ref(target)).expect("record the copy");
        ns.chunk(ino, index).expect("read it again");
        if ns.drop_holders(ino, index, version, &gone, 2).expect("drop the leaving holder") {
            pass.repaired += 1;
        }
    }
    pass
}

/// Every live agent's pass over `leaving`'s chunks at once; returns the
/// wall time, the entries read and the chunks repaired.
fn wave(agents: &[Arc<Namespace>], ids: &[String], live: &[String], leaving: &str) -> (Duration, u64, u64) {
    let t = Instant::now();
    let passes: Vec<Pass> = std::thread::scope(|s| {
        let handles: Vec<_> = agents
            .iter()
            .zip(ids)
            .filter(|(_, id)| live.contains(id))
            .map(|(ns, id)| s.spawn(move || wave_pass(ns, id, leaving, live)))
            .collect();
        handles.into_iter().map(|h| h.join().expect("agent pass")).collect()
    });
    (t.elapsed(), passes.iter().map(|p| p.entries).sum(), passes.iter().map(|p| p.repaired).sum())
}

fn repair_and_drain(
    endpoint: &str,
    volume: &str,
    agents: &[Arc<Namespace>],
    ids: &[String],
    alive: &[Arc<AtomicBool>],
    records: u64,
) {
    let n = agents.len();
    let db_before = etcd_metrics(endpoint)["db bytes"];
    let held = load_chunks(endpoint, volume, ids, records);
    let db_after = etcd_metrics(endpoint)["db bytes"];
    println!(
        "etcd's database grew by {:.1} MiB: {:.0} bytes per chunk record with its two index entries \
         (before any compaction; `bench/etcd-size.sh` measures real files' records, compacted)",
        (db_after - db_before) / 1048576.0,
        (db_after - db_before) / records as f64
    );
    let requests = || {
        let m = etcd_metrics(endpoint);
        m["requests"] + m["stream messages"]
    };

    // What each agent's pass read before the index: every record.
    let (before, t) = (requests(), Instant::now());
    let mut scanned = 0u64;
    agents[0].for_each_chunk(|_, _, _| scanned += 1).expect("scan");
    let scan = requests() - before;
    println!(
        "a scan of every chunk record by one agent (what each agent's pass read before the holder index): \
         {scanned} records, {scan:.0} etcd requests, {:.1} s",
        t.elapsed().as_secs_f64(),
    );

    // One agent dies: its keepalives stop and etcd expires its lease.
    let victim = n - 1;
    alive[victim].store(false, Ordering::Relaxed);
    let killed = Instant::now();
    let watcher = &agents[0];
    loop {
        let members = watcher.engine().membership().expect("etcd").members().expect("members");
        if members.iter().any(|m| m.info.id == ids[victim] && !m.alive) {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let expired = killed.elapsed();
    let live: Vec<String> = ids.iter().take(victim).cloned().collect();
    let before = etcd_metrics(endpoint);
    let (took, entries, repaired) = wave(agents, ids, &live, &ids[victim]);
    let after = etcd_metrics(endpoint);
    let left = agents[0].for_each_chunk_held_by(&ids[victim], |_, _, _| {}).expect("walk").held;
    let asked = |k: &str| after[k] - before[k];
    let wave_requests = asked("requests") + asked("stream messages");
    println!(
        "repair wave: {} of {records} chunk records named the dead agent; its lease expired {:.1} s after its last keepalive; \
         {repaired} repaired by {} agents in {:.1} s, {left} records left naming it; {wave_requests:.0} etcd requests \
         ({:.1} per dead chunk), {entries} index entries read, {:.1} MiB out of etcd; \
         with every agent scanning every record instead: {:.0} requests more",
        held[victim],
        expired.as_secs_f64(),
        live.len(),
        took.as_secs_f64(),
        wave_requests / held[victim].max(1) as f64,
        asked("bytes out") / 1048576.0,
        scan * live.len() as f64,
    );

    // A drain of another: its admin state, then the same wave.
    let drained = 0;
    agents[0].set_node_admin(&ids[drained], Some(NodeAdmin::Draining)).expect("drain");
    let live: Vec<String> = live.into_iter().filter(|id| *id != ids[drained]).collect();
    let before = etcd_metrics(endpoint);
    let (took, entries, moved) = wave(agents, ids, &live, &ids[drained]);
    let after = etcd_metrics(endpoint);
    let left = agents[1].for_each_chunk_held_by(&ids[drained], |_, _, _| {}).expect("walk").held;
    let asked = |k: &str| after[k] - before[k];
    println!(
        "drain: {} chunks named the draining agent (some gained in the repair); {moved} moved in {:.1} s, {left} left; \
         {:.0} etcd requests ({:.1} per chunk), {entries} index entries read",
        moved + left,
        took.as_secs_f64(),
        asked("requests") + asked("stream messages"),
        (asked("requests") + asked("stream messages")) / (moved + left).max(1) as f64,
    );
}

/// etcd's counters from its `/metrics`: gRPC requests handled, bytes in
/// and out, and watch events sent.
fn etcd_metrics(endpoint: &str) -> BTreeMap<&'static str, f64> {
    let mut s = std::net::TcpStream::connect(endpoint).expect("etcd's client port");
    write!(s, "GET /metrics HTTP/1.0\r\nHost: {endpoint}\r\n\r\n").expect("ask for metrics");
    let mut text = String::new();
    s.read_to_string(&mut text).expect("read metrics");
    let sum = |prefix: &str, filter: &dyn Fn(&str) -> bool| -> f64 {
        text.lines()
            .filter(|l| l.starts_with(prefix) && filter(l))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    let unary = |l: &str| l.contains("grpc_type=\"unary\"");
    let streamed = |l: &str| !l.contains("grpc_type=\"unary\"");
    BTreeMap::from([
        ("requests", sum("grpc_server_handled_total", &unary)),
        ("stream messages", sum("grpc_server_msg_received_total", &streamed)),
        ("bytes in", sum("etcd_network_client_grpc_received_bytes_total", &|_| true)),
        ("bytes out", sum("etcd_network_client_grpc_sent_bytes_total", &|_| true)),
        ("watch events", sum("etcd_debugging_mvcc_events_total", &|_| true)),
        ("db bytes", sum("etcd_mvcc_db_total_size_in_bytes", &|_| true)),
    ])
}

fn report(what: &str, n: usize, secs: u64, a: &BTreeMap<&str, f64>, b: &BTreeMap<&str, f64>, made: u64) {
    let rate = |k: &str| (b[k] - a[k]) / secs as f64;
    let requests = rate("requests") + rate("stream messages");
    print!(
        "{what:<14} {n:>4} agents: {requests:>9.1} requests/s ({:.3} per agent: {:.1} unary, {:.1} stream messages), \
         {:.1} KiB/s in, {:.1} KiB/s out, {:.0} watch events/s",
        requests / n as f64,
        rate("requests"),
        rate("stream messages"),
        rate("bytes in") / 1024.0,
        rate("bytes out") / 1024.0,
        rate("watch events"),
    );
    if made > 0 {
        print!(", {:.0} creates/s", made as f64 / secs as f64);
    }
    println!();
}
