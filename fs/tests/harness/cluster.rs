//! Several filesystem cores in one process, peers of each other, with no
//! kernel mount, no sockets, no TLS, no etcd and no root. The nodes share
//! one in-memory metadata store ([`MemKv::cluster`], a handle and a
//! registration per node) and reach each other's chunks over a
//! [`MemNetwork`]; each node's way to its peers is a [`FaultyTransport`]
//! the tests use to make a peer unreachable or corrupt on purpose.
//!
//! The volume's chunk size is cut to [`CHUNK`] (the remote read window) so
//! a file of several chunks stays small. Background workers are not
//! started: nothing tops up under-replicated chunks behind a test's back,
//! and a test calls `core.flush()` where the flusher would.

use std::sync::Arc;
use std::time::Duration;

use converged_fs::cluster::{Cluster, ClusterConfig, DurabilityMode};
use converged_fs::core::Core;
use converged_fs::tier::TierConfig;
use converged_metadata::kv_fault::FaultyKv;
use converged_metadata::membership::NodeInfo;
use converged_metadata::types::{Timespec, DEFAULT_CHUNK_SIZE, FORMAT_VERSION};
use converged_metadata::{Durability, KvEngine, MemKv, Namespace};
use converged_transport::{FaultyTransport, MemNetwork, MemTransport};
use object_store::ObjectStore;

/// The volume's chunk size here: the size of one remote read window.
pub const CHUNK: usize = 4 << 20;

/// One node: its core, its client of the shared metadata, its transport.
pub struct Node {
    pub id: String,
    /// This node's handle on the shared metadata (its membership lease).
    pub kv: MemKv,
    /// The same handle, failing commits on purpose when told to.
    pub meta: Arc<FaultyKv>,
    // Declared before `_dir`: the core goes before its data dir.
    pub core: Arc<Core>,
    pub faults: Arc<FaultyTransport<MemTransport>>,
    _dir: tempfile::TempDir,
}

pub struct TestCluster {
    pub nodes: Vec<Node>,
    store: MemKv,
    net: Arc<MemNetwork>,
    replicas: u32,
    objects: Option<(Arc<dyn ObjectStore>, TierConfig)>,
}

impl TestCluster {
    /// Nodes `ids`, each with its own data dir, registered in membership
    /// with replicated durability and `replicas` copies of each chunk.
    pub fn start(ids: &[&str], replicas: u32) -> Self {
        Self::start_with(ids, replicas, None)
    }

    /// Nodes whose files are backfilled to `objects` too.
    pub fn start_with(ids: &[&str], replicas: u32, objects: Option<Arc<dyn ObjectStore>>) -> Self {
        Self::start_tiered(ids, replicas, CHUNK, objects.map(|store| (store, tier_config(0.99))))
    }

    /// Nodes with `chunk`-byte chunks, backfilling to a store with its
    /// tier settings when one is given.
    pub fn start_tiered(
        ids: &[&str],
        replicas: u32,
        chunk: usize,
        objects: Option<(Arc<dyn ObjectStore>, TierConfig)>,
    ) -> Self {
        let store = MemKv::cluster();
        set_chunk_size(&store, chunk as u32);
        let net = MemNetwork::new();
        let nodes = ids.iter().map(|id| start_node(&store, &net, id, replicas, objects.clone())).collect();
        TestCluster { nodes, store, net, replicas, objects }
    }

    /// Start node `id` and add it to the cluster, as a node mounted later does.
    pub fn join(&mut self, id: &str) {
        let node = start_node(&self.store, &self.net, id, self.replicas, self.objects.clone());
        self.nodes.push(node);
    }

    /// Stop node `i` as an unmount does (its core shut down, its handles
    /// dropped, the network left) and start it again over the same data dir
    /// and metadata handle: what a daemon's restart recovers.
    pub fn restart(&mut self, i: usize) {
        let n = &mut self.nodes[i];
        n.core.shutdown();
        if let Some(cluster) = n.core.cluster() {
            cluster.shutdown();
        }
        let (core, faults) = boot(&n.meta, &self.net, &n.id, n._dir.path(), self.replicas, self.objects.clone());
        n.core = core;
        n.faults = faults;
    }

    pub fn node(&self, id: &str) -> &Node {
        self.nodes.iter().find(|n| n.id == id).expect("a node of this cluster")
    }
}

fn start_node(
    store: &MemKv,
    net: &Arc<MemNetwork>,
    id: &str,
    replicas: u32,
    objects: Option<(Arc<dyn ObjectStore>, TierConfig)>,
) -> Node {
    let dir = tempfile::tempdir().expect("create a data dir");
    let kv = store.node_handle();
    let meta = Arc::new(FaultyKv::new(Arc::new(kv.clone())));
    let (core, faults) = boot(&meta, net, id, dir.path(), replicas, objects);
    Node { id: id.into(), kv, meta, core, faults, _dir: dir }
}

/// Start node `id`'s core over `dir`, join it to `net` and register it.
fn boot(
    meta: &Arc<FaultyKv>,
    net: &Arc<MemNetwork>,
    id: &str,
    dir: &std::path::Path,
    replicas: u32,
    objects: Option<(Arc<dyn ObjectStore>, TierConfig)>,
) -> (Arc<Core>, Arc<FaultyTransport<MemTransport>>) {
    let engine: Arc<dyn KvEngine> = meta.clone();
    let mut ns = Namespace::open(engine.clone(), 0, 0).expect("open the namespace").with_node(id);
    if objects.is_some() {
        ns = ns.with_tier();
    }
    let core = Arc::new(Core::start(ns, super::core_config(dir, id)).expect("start the core"));
    let cfg = ClusterConfig {
        node: id.into(),
        default_replicas: replicas,
        durability: DurabilityMode::Replicated,
        failure_domain: "rack".into(),
        peer_timeout: Duration::from_secs(1),
    };
    let (cluster, faults) =
        Cluster::in_process(cfg, engine.clone(), net.clone(), core.chunk_store()).expect("join the network");
    let now = Timespec::now();
    let info = NodeInfo {
        id: id.into(),
        addr: cluster.local_addr().to_string(),
        capacity: 1 << 40,
        free: 1 << 40,
        labels: Default::default(),
        started: now,
        heartbeat: now,
    };
    engine.membership().expect("a shared store has membership").register(&info, Duration::from_secs(600)).unwrap();
    core.attach_cluster(cluster);
    if let Some((store, cfg)) = objects {
        let home = converged_fs::objects::Location { base: "memory://test".into(), prefix: "vol".into() };
        let objects = converged_fs::objects::ObjectTier::with_store(home, store).expect("an object tier");
        core.attach_tier(Arc::new(converged_fs::tier::Tiering::new(objects, cfg)));
    }
    (core, faults)
}

/// Tier settings that backfill at once and evict backed chunks once the
/// data disk is fuller than `evict_high` (a fraction; a tiny one evicts
/// everything backed).
pub fn tier_config(evict_high: f64) -> TierConfig {
    TierConfig {
        backfill_delay: Duration::ZERO,
        keep_deleted: false,
        evict_high,
        evict_low: evict_high * 0.99,
        workers: 1,
        copy_limit: converged_fs::tier::COPY_LIMIT,
    }
}

impl Node {
    /// This node's membership lease runs out, as when it is paused or cut
    /// off for longer than its TTL: the others see it dead.
    pub fn lapse(&self) {
        self.kv.expire_lease(&self.id);
    }

    /// Its next heartbeat: renewed, or registered anew after a lapse, in
    /// which case its writers are fenced (as the daemon's heartbeat does).
    pub fn heartbeat(&self) -> converged_metadata::membership::Heartbeat {
        let now = Timespec::now();
        let info = NodeInfo {
            id: self.id.clone(),
            addr: self.core.cluster().expect("a cluster node").local_addr().to_string(),
            capacity: 1 << 40,
            free: 1 << 40,
            labels: Default::default(),
            started: now,
            heartbeat: now,
        };
        let beat = self.kv.membership().expect("membership").heartbeat(&info).expect("heartbeat");
        if beat == converged_metadata::membership::Heartbeat::Rejoined {
            self.core.fence_all_writers();
        }
        beat
    }
}

/// Make the volume's chunks `size` bytes. Files take the chunk size the
/// namespace read from the volume record at open, so this comes after the
/// volume is created and before any node opens it. The record is patched
/// in its postcard encoding (varints: format version, chunk size, then the
/// creation time), which this crate has no encoder for.
pub fn set_chunk_size(store: &MemKv, size: u32) {
    Namespace::open(Arc::new(store.clone()), 0, 0).expect("create the volume");
    let key = converged_metadata::schema::VOLUME;
    let mut txn = store.write_txn().unwrap();
    let old = txn.get(key).unwrap().expect("the volume record");
    let (version, rest) = varint(&old);
    let (chunk, created) = varint(rest);
    assert_eq!((version, chunk), (FORMAT_VERSION as u64, DEFAULT_CHUNK_SIZE as u64), "volume record layout changed");
    let mut new = encode_varint(version);
    new.extend(encode_varint(size as u64));
    new.extend_from_slice(created);
    txn.put(key, &new);
    txn.commit(Durability::Durable).unwrap();
}

fn varint(bytes: &[u8]) -> (u64, &[u8]) {
    let mut v = 0u64;
    for (i, b) in bytes.iter().enumerate() {
        v |= ((b & 0x7f) as u64) << (7 * i);
        if b & 0x80 == 0 {
            return (v, &bytes[i + 1..]);
        }
    }
    panic!("truncated varint");
}

fn encode_varint(mut v: u64) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let b = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(b);
            return out;
        }
        out.push(b | 0x80);
    }
}

/// `len` bytes that differ from block to block and from file to file.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}
