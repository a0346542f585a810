//! The node's view of its peers: who is live (from membership), where they
//! listen, and the chunk calls to them over the transport: replicate a chunk
//! to the nodes placement picks, fetch a range from a node holding it.
//!
//! It owns no namespace state: callers pass the chunk records they read and
//! record the replicas that were written. Every call has a deadline; a peer
//! that failed one is tried last for a while, so a dead node that still has
//! a lease costs one timeout, not one per request.
//!
//! A daemon's cluster talks QUIC ([`Cluster::start`]); tests run several
//! nodes in one process over an in-process network (`Cluster::in_process`,
//! feature `test-util`), with faults injected on purpose.

use crate::control::{ControlChanges, Since};
use crate::latency::{self, Area};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use converged_metadata::held_locks::Mutex;
use converged_metadata::membership::NodeInfo;
use converged_metadata::schema::Control;
use converged_metadata::{KvEngine, NodeAdmin};
use converged_transport::{ChunkRef, NodeTls, Peer, PeerTransport, QuicTransport, TransportError};
#[cfg(feature = "test-util")]
use converged_transport::{FaultyTransport, MemNetwork, MemTransport};

use crate::chunkstore::{ChunkStore, LocalHooks, PeerChunks};
use crate::error::{FsError, FsResult};
use crate::placement::{self, Candidate};

/// When `fsync` and `close` return.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DurabilityMode {
    /// After every replica is on stable storage (the default).
    Replicated,
    /// After the local copy; replicas are written in the background.
    Local,
}

/// What a node's cluster needs besides its transport (where it listens
/// and its certificate are [`Cluster::start`]'s).
pub struct ClusterConfig {
    pub node: String,
    /// Copies of each chunk when a directory sets no policy.
    pub default_replicas: u32,
    pub durability: DurabilityMode,
    /// The label that names a node's failure domain (`rack`).
    pub failure_domain: String,
    /// Deadline of one peer call.
    pub peer_timeout: Duration,
}

/// How a copy is written on a peer: on its stable storage before the
/// answer or not (`durable`), and, for a file this node made in a directory
/// delegated to it and has not committed yet (`--nowsync`), that directory:
/// the peer checks the delegation rather than the file's records.
#[derive(Debug, Clone, Copy)]
pub struct Push {
    pub durable: bool,
    pub made_in: Option<u64>,
}

/// How long a recall keeps asking a holder that is alive but does not
/// answer (longer than any membership lease, after which it is dead).
const RECALL_PATIENCE: Duration = Duration::from_secs(90);

pub struct Cluster {
    cfg: ClusterConfig,
    rt: tokio::runtime::Runtime,
    /// The peer data plane (QUIC in a daemon).
    transport: Arc<dyn PeerTransport>,
    local_addr: SocketAddr,
    engine: Arc<dyn KvEngine>,
    /// Live nodes, and admins' word on nodes, as last read, and when.
    members: Mutex<Members>,
    /// Peers that failed a call recently, and when.
    suspects: Mutex<HashMap<String, Instant>>,
    /// What the peer server asks of the core here.
    hooks: Arc<std::sync::OnceLock<LocalHooks>>,
    /// What else stopping undoes (an in-process node leaves its network).
    on_shutdown: Option<Box<dyn Fn() + Send + Sync>>,
    /// Bytes read from peers (remote reads, repair, staging), verified.
    pub read_bytes: AtomicU64,
    /// Which control-plane records changed: the member list is read again
    /// when members or admin states did (see `control.rs`).
    control: std::sync::OnceLock<Arc<ControlChanges>>,
    /// When this node first found each dead node's lease gone, on its own
    /// monotonic clock: how long a node has been dead is measured from
    /// there, never from the dead node's wall clock (a leaf lock).
    dead_since: Mutex<HashMap<String, Instant>>,
}

/// What the member list follows.
const MEMBER_RECORDS: &[Control] = &[Control::Members, Control::Admin];

#[derive(Default)]
struct Members {
    read_at: Option<Instant>,
    /// When a plan short of peers last had the list read again.
    short_read_at: Option<Instant>,
    since: Option<Since>,
    live: Vec<NodeInfo>,
    admin: BTreeMap<String, NodeAdmin>,
}

/// How long the live-node list is reused before asking membership again,
/// when no change feed says when it changed.
const MEMBERS_TTL: Duration = Duration::from_secs(1);
/// How long a peer that failed a call is tried after the others.
const SUSPECT_FOR: Duration = Duration::from_secs(30);

fn peer_err(e: TransportError) -> FsError {
    FsError::Peer(e.to_string())
}

impl Cluster {
    fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).thread_name("transport").enable_all().build()
    }

    fn new(
        cfg: ClusterConfig,
        rt: tokio::runtime::Runtime,
        transport: Arc<dyn PeerTransport>,
        local_addr: SocketAddr,
        engine: Arc<dyn KvEngine>,
        hooks: Arc<std::sync::OnceLock<LocalHooks>>,
        on_shutdown: Option<Box<dyn Fn() + Send + Sync>>,
    ) -> Arc<Self> {
        Arc::new(Cluster {
            cfg,
            rt,
            transport,
            local_addr,
            engine,
            members: Mutex::default(),
            suspects: Mutex::default(),
            control: Default::default(),
            dead_since: Mutex::default(),
            hooks,
            on_shutdown,
            read_bytes: AtomicU64::new(0),
        })
    }

    /// Start serving `store` to peers over QUIC on `listen`, with mutual
    /// TLS from `tls`, and return the handle the core uses to reach them.
    pub fn start(
        cfg: ClusterConfig,
        listen: SocketAddr,
        tls: &NodeTls,
        engine: Arc<dyn KvEngine>,
        store: Arc<ChunkStore>,
    ) -> anyhow::Result<Arc<Self>> {
        let rt = Self::runtime()?;
        let hooks = Arc::new(std::sync::OnceLock::new());
        let transport = {
            let _enter = rt.enter();
            let service = Arc::new(PeerChunks { store, hooks: hooks.clone() });
            QuicTransport::bind(listen, tls, service, cfg.peer_timeout)?
        };
        let local_addr = transport.local_addr();
        Ok(Self::new(cfg, rt, Arc::new(transport), local_addr, engine, hooks, None))
    }

    /// A node of an in-process cluster: serves `store` on `net` as node
    /// `cfg.node` and reaches its peers there, with no socket and no TLS.
    /// Peers are found by node id, so [`Cluster::local_addr`] is a made-up
    /// `127.0.0.1` address, unique in the process: the address to register
    /// in membership (peers without one are skipped). The returned
    /// transport is this node's way to its peers: make them fail on
    /// purpose with [`FaultyTransport::set`] (healthy until then).
    #[cfg(feature = "test-util")]
    pub fn in_process(
        cfg: ClusterConfig,
        engine: Arc<dyn KvEngine>,
        net: Arc<MemNetwork>,
        store: Arc<ChunkStore>,
    ) -> anyhow::Result<(Arc<Self>, Arc<FaultyTransport<MemTransport>>)> {
        let rt = Self::runtime()?;
        let hooks = Arc::new(std::sync::OnceLock::new());
        // Made-up ports of in-process nodes, so that each has an address of its own.
        static NEXT_PORT: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(1);
        let port = NEXT_PORT.fetch_add(1, Ordering::Relaxed);
        anyhow::ensure!(port != 0, "too many in-process nodes");
        net.join(&cfg.node, Arc::new(PeerChunks { store, hooks: hooks.clone() }));
        let local_addr = SocketAddr::from(([127, 0, 0, 1], port));
        let faulty = Arc::new(FaultyTransport::new(MemTransport::new(net.clone())));
        let node = cfg.node.clone();
        let leave = Box::new(move || net.leave(&node));
        let cluster = Self::new(cfg, rt, faulty.clone(), local_addr, engine, hooks, Some(leave));
        Ok((cluster, faulty))
    }

    pub fn node(&self) -> &str {
        &self.cfg.node
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    pub fn default_replicas(&self) -> u32 {
        self.cfg.default_replicas
    }

    pub fn durability(&self) -> DurabilityMode {
        self.cfg.durability
    }

    /// How long a reader waits for a range before giving up: every replica
    /// tried once, each with its own deadline.
    pub fn call_deadline(&self) -> Duration {
        self.cfg.peer_timeout * 3 + Duration::from_secs(1)
    }

    /// Live nodes other than this one that serve chunks.
    pub fn live_peers(&self) -> Vec<NodeInfo> {
        let m = self.refreshed_members();
        m.live.iter().filter(|n| n.id != self.cfg.node && !n.addr.is_empty()).cloned().collect()
    }

    /// Changes of the control-plane records, from the change feed.
    pub fn set_control(&self, control: Arc<ControlChanges>) {
        let _ = self.control.set(control);
    }

    /// The member list, read again when members or admin states changed,
    /// or, with no change feed, when older than [`MEMBERS_TTL`] (the
    /// read happens with no lock held).
    fn refreshed_members(&self) -> converged_metadata::held_locks::MutexGuard<'_, Members> {
        let fresh = {
            let mut m = self.members.lock();
            match self.control.get().filter(|c| c.is_watched()) {
                Some(c) => {
                    // Asked each time, so that a read made because the
                    // list was never read (or was marked stale) counts.
                    let due = c.due(m.since.get_or_insert_with(|| Since::new(MEMBER_RECORDS)));
                    m.read_at.is_some() && !due
                }
                None => m.read_at.is_some_and(|t| t.elapsed() <= MEMBERS_TTL),
            }
        };
        if fresh {
            return self.members.lock();
        }
        let live = match self.members_now() {
            Ok(all) => Some(all.into_iter().filter(|x| x.alive).map(|x| x.info).collect()),
            Err(e) => {
                tracing::warn!(error = %e, "cannot read cluster membership; using the last list");
                None
            }
        };
        let admin = converged_metadata::ops::nodes::admin_states(self.engine.as_ref())
            .inspect_err(|e| tracing::warn!(error = %e, "cannot read node admin states; using the last ones"))
            .ok();
        let mut m = self.members.lock();
        match live {
            Some(live) => {
                m.live = live;
                m.read_at = Some(Instant::now());
            }
            // Read again next time.
            None => m.since = None,
        }
        if let Some(admin) = admin {
            m.admin = admin;
        }
        m
    }

    /// What an admin said of node `id` (draining, drained), if anything.
    pub fn admin_state(&self, id: &str) -> Option<NodeAdmin> {
        self.refreshed_members().admin.get(id).copied()
    }

    /// Whether node `id` may be given new copies: not draining or drained.
    pub fn placeable(&self, id: &str) -> bool {
        self.admin_state(id).is_none()
    }

    fn domain_of(&self, n: &NodeInfo) -> String {
        n.labels.get(&self.cfg.failure_domain).cloned().unwrap_or_else(|| format!("node:{}", n.id))
    }

    /// This node's failure domain, as placement counts it.
    fn own_domain(&self) -> String {
        let me = self.members.lock().live.iter().find(|n| n.id == self.cfg.node).cloned();
        match me {
            Some(n) => self.domain_of(&n),
            None => format!("node:{}", self.cfg.node),
        }
    }

    fn suspect(&self, node: &str) -> bool {
        self.suspects.lock().get(node).is_some_and(|t| t.elapsed() < SUSPECT_FOR)
    }

    /// Note how a call to `node` went. A peer that failed one may have
    /// started again at another address (a restart on a port of its own
    /// choosing) before the change feed brought its new record here, or
    /// with the feed lagging behind a loaded etcd: the member list is read
    /// again, from etcd, at its next use. The two locks are taken one
    /// after the other, never one inside the other.
    fn mark(&self, node: &str, ok: bool) {
        if ok {
            self.suspects.lock().remove(node);
            return;
        }
        self.suspects.lock().insert(node.to_string(), Instant::now());
        let watched = self.control.get().is_some_and(|c| c.is_watched());
        let mut m = self.members.lock();
        match watched {
            true => m.since = None,
            false => m.read_at = None,
        }
    }

    fn peer(n: &NodeInfo) -> Option<Peer> {
        Some(Peer { addr: n.addr.parse().ok()?, node: n.id.clone() })
    }

    /// The live peers that may take a copy of chunk `index` of `ino`, best
    /// first: placement's ranking without the nodes in `holders` (which
    /// have it already) and without draining ones, peers that failed lately
    /// last. Asks membership, so it must be called outside the transport
    /// runtime.
    ///
    /// Fewer than `want` of them: the member list is read again from the
    /// store (see [`Cluster::read_members_again`]) before the plan is settled,
    /// since a node that joined or came back may be registered there before
    /// the change feed brings it here (a feed behind a loaded etcd, or
    /// starting over). A copy not placed on it would leave the file
    /// acknowledged with fewer copies than wanted until the replicator's
    /// next pass.
    pub fn plan(&self, ino: u64, index: u32, holders: &[String], want: usize) -> Vec<NodeInfo> {
        let ranked = self.rank(ino, index, holders);
        if ranked.len() >= want || !self.read_members_again() {
            return ranked;
        }
        self.rank(ino, index, holders)
    }

    /// Have the next use of the member list read it from the store, unless
    /// a plan short of peers did so within [`MEMBERS_TTL`] (a cluster that
    /// stays short of nodes costs the store one read a second). Returns
    /// whether it will.
    fn read_members_again(&self) -> bool {
        let mut m = self.members.lock();
        if m.short_read_at.is_some_and(|t| t.elapsed() < MEMBERS_TTL) {
            return false;
        }
        m.short_read_at = Some(Instant::now());
        m.read_at = None;
        true
    }

    /// [`Cluster::plan`]'s ranking over the member list as it stands.
    fn rank(&self, ino: u64, index: u32, holders: &[String]) -> Vec<NodeInfo> {
        let peers: Vec<NodeInfo> =
            self.live_peers().into_iter().filter(|p| !holders.contains(&p.id) && self.placeable(&p.id)).collect();
        let candidates: Vec<Candidate> = peers
            .iter()
            .map(|n| Candidate { id: n.id.clone(), weight: n.free as f64, domain: self.domain_of(n) })
            .collect();
        let mut ranked: Vec<NodeInfo> = placement::rank(ino, index, &self.own_domain(), &candidates)
            .into_iter()
            .filter_map(|c| peers.iter().find(|p| p.id == c.id).cloned())
            .collect();
        ranked.sort_by_key(|n| self.suspect(&n.id));
        ranked
    }

    /// What the peer server asks of the core (set once).
    pub fn set_hooks(&self, hooks: LocalHooks) {
        let _ = self.hooks.set(hooks);
    }

    /// The `n` nodes (this one included) that should hold chunk `index` of
    /// `ino` when staged: placement's ranking over every live node, so that
    /// a stage spreads a file's chunks over the cluster. Asks membership,
    /// so it must be called outside the transport runtime.
    pub fn stage_targets(&self, ino: u64, index: u32, n: usize) -> Vec<NodeInfo> {
        let mut nodes = self.live_peers();
        if let Some(me) = self.members.lock().live.iter().find(|m| m.id == self.cfg.node).cloned() {
            nodes.push(me);
        }
        nodes.retain(|m| self.placeable(&m.id));
        let candidates: Vec<Candidate> = nodes
            .iter()
            .map(|m| Candidate { id: m.id.clone(), weight: m.free.max(1) as f64, domain: self.domain_of(m) })
            .collect();
        placement::rank(ino, index, "", &candidates)
            .into_iter()
            .filter_map(|c| nodes.iter().find(|m| m.id == c.id).cloned())
            .take(n)
            .collect()
    }

    /// Nodes that registered once and whose membership lease is gone.
    pub fn dead_nodes(&self) -> FsResult<BTreeSet<String>> {
        Ok(self.members_now()?.into_iter().filter(|m| !m.alive).map(|m| m.info.id).collect())
    }

    /// Note which registered nodes are dead in a member list just read: a
    /// node newly found so is dead from now on, one alive again no more.
    fn note_deaths(&self, members: &[converged_metadata::membership::Member]) {
        let now = Instant::now();
        let mut since = self.dead_since.lock();
        since.retain(|id, _| members.iter().any(|m| !m.alive && m.info.id == *id));
        for m in members.iter().filter(|m| !m.alive) {
            since.entry(m.info.id.clone()).or_insert(now);
        }
    }

    /// How long node `id` has been dead, as this node saw its lease go:
    /// from the first member list read here without it (a node dead before
    /// this one started counts from then; a node's clock plays no part).
    pub fn dead_for(&self, id: &str) -> Option<Duration> {
        self.dead_since.lock().get(id).map(Instant::elapsed)
    }

    /// Whether this node is the live node that takes over `ino`'s work
    /// from a dead one: the first by rendezvous hashing with equal weights,
    /// so every node that sees the same live set picks the same one.
    pub fn takes_over(&self, ino: u64) -> bool {
        let mut ids: Vec<String> = self.live_peers().into_iter().map(|n| n.id).collect();
        ids.push(self.cfg.node.clone());
        self.is_first(ino, 0, &ids)
    }

    /// Whether this node comes first among `ids` for chunk `index` of
    /// `ino`, by rendezvous hashing with equal weights.
    pub fn is_first(&self, ino: u64, index: u32, ids: &[String]) -> bool {
        let candidates: Vec<Candidate> =
            ids.iter().map(|id| Candidate { id: id.clone(), weight: 1.0, domain: format!("node:{id}") }).collect();
        placement::rank(ino, index, "", &candidates).first().is_some_and(|c| c.id == self.cfg.node)
    }

    /// The label that names a node's failure domain.
    pub fn failure_domain(&self) -> &str {
        &self.cfg.failure_domain
    }

    /// The nodes among which each chunk's repair falls to one ([`Cluster::is_first`]):
    /// the live nodes that take new copies, this one included; none when
    /// this node takes none (it drains), so that it repairs nothing.
    pub fn repairers(&self) -> Vec<String> {
        if !self.placeable(&self.cfg.node) {
            return Vec::new();
        }
        let mut ids: Vec<String> =
            self.live_peers().into_iter().filter(|n| self.placeable(&n.id)).map(|n| n.id).collect();
        ids.push(self.cfg.node.clone());
        ids
    }

    /// Every node that registered on the volume, live or dead, read now.
    pub fn members_now(&self) -> FsResult<Vec<converged_metadata::membership::Member>> {
        let Some(ms) = self.engine.membership() else { return Ok(Vec::new()) };
        let members = ms.members().map_err(|e| FsError::Peer(format!("cluster membership: {e}")))?;
        self.note_deaths(&members);
        Ok(members)
    }

    /// Ask `node` to drop every copy it holds of `ino` (a purged file).
    pub async fn delete_on(self: Arc<Self>, node: NodeInfo, ino: u64) -> FsResult<()> {
        let peer = Self::peer(&node).ok_or_else(|| FsError::Peer(format!("node {} has no address", node.id)))?;
        let _t = latency::timer(Area::Peer, "delete");
        self.transport.delete(&peer, ino).await.map_err(peer_err)
    }

    /// Have `node` fetch chunk `index` of `ino` onto its SSD (its share of a stage).
    pub async fn stage_on(self: Arc<Self>, node: NodeInfo, ino: u64, index: u32) -> FsResult<()> {
        let peer = Self::peer(&node).ok_or_else(|| FsError::Peer(format!("node {} has no address", node.id)))?;
        // A chunk from an object store: minutes at worst, not a peer read's seconds.
        let r =
            latency::time_async(Area::Peer, "stage", self.transport.stage(&peer, ino, index, Duration::from_secs(600)))
                .await;
        self.mark(&node.id, r.is_ok());
        r.map_err(peer_err)
    }

    /// Copy chunk version `chunk` (all of it: `data`) to `want` nodes of
    /// `ranked` (from [`Cluster::plan`]), each on stable storage before this
    /// returns, falling back along the ranking when a peer fails. Returns the
    /// nodes that took the copy (fewer than `want` when too few answered).
    pub async fn push(
        self: Arc<Self>,
        chunk: ChunkRef,
        data: Bytes,
        want: usize,
        ranked: Vec<NodeInfo>,
    ) -> Vec<String> {
        self.push_with(chunk, data, want, ranked, Push { durable: true, made_in: None }).await
    }

    /// [`Cluster::push`], with the copies on stable storage when this
    /// returns only if `durable`; otherwise [`Cluster::sync`] must vouch
    /// for each copy before anything counts on it.
    pub async fn push_with(
        self: Arc<Self>,
        chunk: ChunkRef,
        data: Bytes,
        want: usize,
        ranked: Vec<NodeInfo>,
        how: Push,
    ) -> Vec<String> {
        let (ino, index) = (chunk.ino, chunk.index);
        let mut done = Vec::new();
        let mut next = 0;
        while done.len() < want && next < ranked.len() {
            // One round: as many peers in parallel as copies are still missing.
            let round: Vec<NodeInfo> = ranked[next..].iter().take(want - done.len()).cloned().collect();
            next += round.len();
            let tasks: Vec<_> = round
                .into_iter()
                .map(|n| {
                    let t = self.transport.clone();
                    let data = data.clone();
                    tokio::spawn(async move {
                        let r = match (Self::peer(&n), how) {
                            (Some(p), Push { durable, made_in: Some(dir) }) => {
                                let w = t.write_made(&p, &chunk, &data, durable, dir);
                                latency::time_async(Area::Peer, "write", w).await
                            }
                            (Some(p), Push { durable: true, .. }) => {
                                latency::time_async(Area::Peer, "write", t.write(&p, &chunk, &data)).await
                            }
                            (Some(p), _) => {
                                latency::time_async(Area::Peer, "write", t.write_unsynced(&p, &chunk, &data)).await
                            }
                            (None, _) => Err(TransportError::Connect { peer: n.id.clone(), msg: "bad address".into() }),
                        };
                        (n.id, r)
                    })
                })
                .collect();
            for task in tasks {
                match task.await {
                    Ok((id, Ok(()))) => {
                        self.mark(&id, true);
                        done.push(id);
                    }
                    Ok((id, Err(e))) => {
                        tracing::warn!(ino, chunk = index, peer = %id, error = %e, "replica write failed; trying another node");
                        // A peer that answered with a refusal is healthy: only
                        // a failure to reach it says anything about its reads.
                        let refused = matches!(&e, TransportError::Remote { err, .. } if err.errno == libc::EACCES || err.errno == libc::EAGAIN);
                        if !refused {
                            self.mark(&id, false);
                        }
                    }
                    Err(e) => tracing::error!(error = %e, "replication task failed"),
                }
            }
        }
        done
    }

    /// Have each node of `holders` put the versions of `ino` it received
    /// unsynced (`versions[node]`) on stable storage, all at once. Returns
    /// the nodes that did; one that failed or is not live holds no copy
    /// anyone may count on.
    /// Blocks: call it outside the transport's runtime (it reads membership).
    pub fn sync(self: &Arc<Self>, ino: u64, versions: BTreeMap<String, Vec<(u32, u64)>>) -> BTreeSet<String> {
        let peers = self.live_peers();
        self.block_on(self.clone().sync_peers(ino, versions, peers))
    }

    async fn sync_peers(
        self: Arc<Self>,
        ino: u64,
        versions: BTreeMap<String, Vec<(u32, u64)>>,
        peers: Vec<NodeInfo>,
    ) -> BTreeSet<String> {
        let tasks: Vec<_> = versions
            .into_iter()
            .map(|(id, list)| {
                let t = self.transport.clone();
                let peer = peers.iter().find(|p| p.id == id).and_then(Self::peer);
                tokio::spawn(async move {
                    let r = match peer {
                        Some(p) => latency::time_async(Area::Peer, "sync", t.sync(&p, ino, &list)).await,
                        None => Err(TransportError::Connect { peer: id.clone(), msg: "not live".into() }),
                    };
                    (id, r)
                })
            })
            .collect();
        let mut synced = BTreeSet::new();
        for task in tasks {
            match task.await {
                Ok((id, Ok(()))) => {
                    synced.insert(id);
                }
                Ok((id, Err(e))) => {
                    tracing::warn!(ino, peer = %id, error = %e, "a replica could not sync the chunks streamed to it; they are sent again")
                }
                Err(e) => tracing::error!(error = %e, "sync task failed"),
            }
        }
        synced
    }

    /// The peers to read a range from, given the chunk's replica list: live
    /// ones only, lately healthy ones first. Asks membership, so it must be
    /// called outside the transport runtime.
    pub fn read_order(&self, holders: &[String]) -> Vec<Peer> {
        let peers = self.live_peers();
        let mut order: Vec<&NodeInfo> =
            holders.iter().filter(|h| **h != self.cfg.node).filter_map(|h| peers.iter().find(|p| p.id == *h)).collect();
        order.sort_by_key(|n| self.suspect(&n.id));
        order.into_iter().filter_map(Self::peer).collect()
    }

    /// Read `len` bytes of chunk version `chunk`, `at` bytes into it, from
    /// the first of `order` that answers with bytes `check` accepts (their
    /// checksums). Bytes past the end of the peer's data read as zeros. A
    /// peer that fails or sends bad bytes is passed over, and tried last for
    /// a while; one that says it holds no such version is only passed over.
    pub async fn fetch(
        self: Arc<Self>,
        chunk: ChunkRef,
        at: u64,
        len: u32,
        order: Vec<Peer>,
        check: impl Fn(&[u8]) -> FsResult<()> + Send,
    ) -> FsResult<Vec<u8>> {
        let (ino, offset) = (chunk.ino, chunk.start + at);
        if order.is_empty() {
            return Err(FsError::Peer("no live node holds this range".into()));
        }
        let mut last = None;
        for peer in order {
            let answer = latency::time_async(Area::Peer, "read", self.transport.read(&peer, &chunk, at, len)).await;
            if let Err(TransportError::Remote { err, .. }) = &answer {
                if err.errno == libc::ESTALE {
                    // Being rewritten there: a healthy peer, not this version's holder now.
                    tracing::debug!(ino, offset, peer = %peer.node, "peer is rewriting the file; trying the next replica");
                    last = Some(FsError::Peer(err.msg.clone()));
                    continue;
                }
            }
            let answer = answer.map_err(peer_err);
            let checked = answer.and_then(|mut data| {
                data.resize(len as usize, 0);
                check(&data).map(|()| data)
            });
            match checked {
                Ok(data) => {
                    self.mark(&peer.node, true);
                    self.read_bytes.fetch_add(len as u64, Ordering::Relaxed);
                    return Ok(data);
                }
                Err(e) => {
                    match &e {
                        FsError::Corrupt { .. } => {
                            tracing::error!(ino, offset, peer = %peer.node, "checksum mismatch on data from a peer; trying the next replica")
                        }
                        e => {
                            tracing::warn!(ino, offset, peer = %peer.node, error = %e, "peer read failed; trying the next replica")
                        }
                    }
                    self.mark(&peer.node, false);
                    last = Some(e);
                }
            }
        }
        Err(last.unwrap_or_else(|| FsError::Peer("no reachable replica".into())))
    }

    /// Have node `holder` commit what it acknowledged in directory `dir`
    /// and give its delegation up (`--nowsync`), before this node reads or
    /// changes the directory's names. A holder found dead (its membership
    /// lease gone) loses the delegation here: its unflushed changes died
    /// with it. One alive but unreachable (cut off) is asked again until
    /// it answers or its lease runs out. Returns a revision at or after
    /// which the metadata holds the directory's changes.
    pub fn recall(
        &self,
        ns: &converged_metadata::Namespace,
        dir: u64,
        holder: &str,
    ) -> converged_metadata::MetaResult<i64> {
        let deadline = Instant::now() + RECALL_PATIENCE;
        loop {
            let members = self.members_now().map_err(|e| converged_metadata::MetaError::Delegated {
                dir,
                holder: format!("{holder} (membership unreadable: {e})"),
            })?;
            let alive = members.iter().find(|m| m.alive && m.info.id == holder);
            let Some(peer) = alive.and_then(|m| Self::peer(&m.info)) else {
                tracing::warn!(dir, holder, "taking over the delegation of a directory from a dead node");
                return ns.drop_delegation(dir, holder);
            };
            let _t = latency::timer(Area::Peer, "recall");
            match self.block_on(self.transport.recall(&peer, dir, self.call_deadline())) {
                Ok(rev) => return Ok(rev),
                Err(e) if Instant::now() < deadline => {
                    tracing::debug!(dir, holder, error = %e, "recall not answered yet; asking again");
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(e) => {
                    tracing::warn!(dir, holder, error = %e, "a directory's delegation could not be recalled");
                    return Err(converged_metadata::MetaError::Delegated { dir, holder: holder.into() });
                }
            }
        }
    }

    /// Run `fut` on the transport runtime and wait for it.
    pub fn block_on<T>(&self, fut: impl std::future::Future<Output = T>) -> T {
        converged_metadata::held_locks::assert_none_held("a peer call");
        self.rt.block_on(fut)
    }

    /// Run blocking `f` (a disk sync) on the transport runtime's blocking
    /// threads, beside the peer calls in flight; wait with `block_on`.
    pub fn spawn_blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> tokio::task::JoinHandle<T> {
        self.rt.spawn_blocking(f)
    }

    pub fn spawn<T: Send + 'static>(
        &self,
        fut: impl std::future::Future<Output = T> + Send + 'static,
    ) -> tokio::task::JoinHandle<T> {
        self.rt.spawn(fut)
    }

    /// Stop serving peers and refuse further calls to them.
    pub fn shutdown(&self) {
        self.transport.close();
        if let Some(undo) = &self.on_shutdown {
            undo();
        }
    }
}
