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
//! `cargo run --release -p converged-metadata --example control_sim -- 127.0.0.1:2379 200 20 10`
//! (agents, seconds at rest, seconds creating; bench/control-plane.sh runs
//! it against an etcd of its own for N = 50, 100 and 200).
//!
//! Not simulated yet: a node's death and the repair pass it starts, and a
//! drain (both need the index of chunks per holder that repair lacks).

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use converged_metadata::membership::NodeInfo;
use converged_metadata::round_trips::{self, RoundTrip};
use converged_metadata::types::{FileKind, NewNode, Timespec, ROOT_INO};
use converged_metadata::{CachedKv, EtcdKv, KvEngine, Namespace};

const TTL: Duration = Duration::from_secs(10);

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: control_sim HOST:PORT AGENTS REST_SECONDS CREATE_SECONDS";
    let endpoint = args.first().cloned().unwrap_or_else(|| "127.0.0.1:2379".into());
    let n: usize = args.get(1).map(|a| a.parse().expect(usage)).unwrap_or(50);
    let rest: u64 = args.get(2).map(|a| a.parse().expect(usage)).unwrap_or(20);
    let busy: u64 = args.get(3).map(|a| a.parse().expect(usage)).unwrap_or(10);
    let volume = format!("sim-{}", std::process::id());
    let stop = Arc::new(AtomicBool::new(false));

    let t0 = Instant::now();
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
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
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
    println!("the agents' own count of etcd requests (all phases): {}", asked.join(", "));
    stop.store(true, Ordering::Relaxed);
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
