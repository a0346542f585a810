//! The filesystem core: one method per FUSE operation, with no FUSE types in
//! sight. The adapter (`fuse.rs`) calls one method here per request; tests
//! drive it directly. It owns the per-inode state of files open on this node
//! and the order in which that state, the metadata and the disk change.
//!
//! Where things are:
//! - `mod.rs` (this file): the facade; namespace, xattr and directory operations.
//! - `open.rs`: the handle table, the open-inode table with its gates, and the
//!   choice of the kernel's I/O mode for a handle.
//! - `write.rs`: the write path; a file's write state is one enum
//!   ([`write::WriteState`]) whose transitions all live there.
//! - `seal.rs`: what a seal records (plan, a pass over the chunks, the
//!   streamed copies vouched for, the commit), and the streamer's copying of
//!   full chunks to peers while a writer goes on.
//! - `read.rs`: the read path; one `locate` step says where each range of a
//!   file comes from (hole, local copy, peer, object store).
//! - `attr.rs`: attributes, and truncation through the write path.
//! - `backing.rs`: the backing file's stamp and times, lseek, copy_file_range.
//! - `durability.rs`: crash recovery at mount, and the flush that makes
//!   buffered metadata durable only after the bytes it describes.
//! - `replicate.rs`: topping up under-replicated chunks (its queue).
//! - `spares.rs`: backing files made ahead of creates.
//! - `peer_policy.rs`: what a peer may have this node do (store a copy,
//!   drop a file's copies, give up a directory delegation).
//! - `versions.rs`: chunk versions held beside the backing file, and when
//!   they are installed into it or removed.
//! - `reconcile.rs`: a fenced writer's local copy brought back to the layout.
//! - `repair.rs`: copies of dead and draining holders rebuilt elsewhere.
//! - `sweep.rs`: local copies that no chunk record names, removed.
//! - `scrub.rs`: local copies read back against their checksums, bad blocks rewritten.
//! - `backfill.rs`, `evict.rs`, `import.rs`, `stage.rs`: the object tier's
//!   work on files (uploads and re-keys, eviction under disk pressure,
//!   objects shown as files, staging onto the SSDs); `tier.rs` (outside
//!   the core) holds the tier's queue and settings.
//!
//! # Lock order
//!
//! Every lock in the core, in the order it may be taken. A lock may be
//! taken while holding only locks above it in this list.
//!
//! 1. `open` (a shard of the open-inode table, [`open::OpenTable`]): held
//!    only to look up, insert or remove a slot. Inside it, only (2) may be
//!    taken, for a constant-time update.
//! 2. `OpenInode::state` (one file's [`open::OpenState`], a private field
//!    taken through `state()`, `settled_state()` or `quiet_state()`): never held across
//!    I/O, a KV transaction or a network call. Long work (checksums, replica
//!    writes, commits, hydration) runs with the state in a transitional
//!    [`write::WriteState`] (`Leasing`, `Publishing`, `Sealing`) and no lock
//!    held; others wait on `OpenInode::changed`, holding nothing.
//! 3. Leaf locks, taken alone: `handles` shards and those of `open_dirs`
//!    (its slots, handles and listings), `OpenInode::readahead`, `doomed`,
//!    `session_ends`, `owed`, `spares` (`Spares::files`), `under_replicated`
//!    (`ReplicationQueue::files`), `flush_now`, the chunk store's ready
//!    slots (never with its version index),
//!    `last_repair`, `removed`, the tier's tables, the cluster's member list
//!    (read from etcd with no lock held), and three that the change feed
//!    also takes, under the node cache's subscriber list, which takes
//!    nothing else: `sweep_hints`, the `peer_leases` shards and the chunk
//!    store's version index.
//!
//! The metadata crate's own locks (the node cache's, the `--nowsync`
//! layer's state and its flush gate, the etcd engine's lease slot, on
//! whose condition variable a `leave` waits, the slot released, for a
//! heartbeat to put the lease back) are leaves of the metadata layer,
//! taken inside its calls and never held when they return (the `--nowsync`
//! state also under the node cache's subscriber list, by the change feed).
//!
//! And across the boundaries:
//! - **No in-memory lock is taken inside a KV transaction closure**: what a
//!   transaction needs is read before it starts (for example the gate an
//!   unlink holds on the inode it may purge), and acted on after it commits.
//! - **No lock is held across a KV transaction, a disk sync or a network
//!   call.** A gate ([`open::Held`], and a chunk's fetch slot in the tier)
//!   may be: it is not a lock but a promise that the inode stays closed
//!   here (that one fetch of the chunk runs), and its holder waits for
//!   nothing that a waiter on it could hold.
//!
//! The locks of this crate are `converged_metadata::held_locks::Mutex`: in
//! debug and test builds each counts itself held per thread, and every KV
//! transaction (`Namespace::read`/`write`), peer call (`Cluster::block_on`)
//! and object-store call (`ObjectTier::block_on`) asserts that the count is
//! zero, so a test that reaches a violation fails there, naming the call.
//!
//! With these rules the KV engine's write slot is never waited for by a
//! thread holding an in-memory lock, and no thread holding the write slot
//! waits for one, so no cycle can form through it.

mod attr;
pub(crate) mod backfill;
mod backing;
mod dirs;
mod durability;
mod evict;
pub(crate) mod import;
mod open;
mod peer_leases;
mod peer_policy;
mod read;
mod reconcile;
mod removed;
mod repair;
mod replicate;
mod scrub;
mod seal;
mod spares;
mod stage;
mod sweep;
mod versions;
mod write;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use converged_metadata::held_locks::Mutex;
use converged_metadata::types::*;
use converged_metadata::{acl, MetaError, Namespace, Unlinked};

use crate::chunkstore::ChunkStore;
use crate::cluster::Cluster;
use crate::error::{FsError, FsResult};
use crate::tier::Tiering;

use open::{Claim, OpenTable};
pub use open::{Io, KernelOpen, Opened};
pub use peer_leases::PeerLeases;
pub use repair::{repair_trigger, Pacer, RepairConfig, RepairPass, RepairScope, RepairTrigger};
pub use replicate::Replicated;
pub use scrub::Scrubbed;
pub use sweep::{Seen, SweepHints, SAFETY_PASS_EVERY, SAFETY_PASS_RATE};

/// Who asks, for the few rules the daemon applies itself (permission
/// checks are the kernel's).
#[derive(Debug, Clone, Copy)]
pub struct Caller {
    pub uid: u32,
    pub gid: u32,
    /// The calling process, whose supplementary groups count too (0: none known).
    pub pid: u32,
}

impl Caller {
    pub const ROOT: Caller = Caller { uid: 0, gid: 0, pid: 0 };

    /// Whether `gid` is the caller's group or one of its supplementary
    /// groups (read from /proc; a process gone by now has none).
    pub fn in_group(&self, gid: u32) -> bool {
        if self.gid == gid {
            return true;
        }
        if self.pid == 0 {
            return false;
        }
        std::fs::read_to_string(format!("/proc/{}/status", self.pid)).is_ok_and(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Groups:"))
                .is_some_and(|g| g.split_whitespace().any(|x| x.parse() == Ok(gid)))
        })
    }
}

pub struct CoreConfig {
    pub data_dir: PathBuf,
    /// This node's id, recorded as the replica of every chunk it seals.
    pub node_id: String,
    /// Serve every read through the daemon so every byte is checksum-verified.
    pub verify_reads: bool,
    /// A read-only mount: no recovery and no reserve at start (both write);
    /// the kernel refuses every change before it reaches the core.
    pub read_only: bool,
    /// When reads update atime (`--atime`; `Never` on a read-only mount), for
    /// files and, with `diratime`, directories.
    pub atime: converged_metadata::AtimeRule,
    pub diratime: bool,
    /// The embedded metadata file when it lives on the data disk; kept
    /// preallocated so a disk full of chunks cannot starve it.
    pub meta_file: Option<PathBuf>,
    /// Handles the kernel holds from an earlier daemon of this mount, whose
    /// connection outlived it: recovery leaves their inodes as they are
    /// (an open orphan is not purged, an open writer's file not sealed) and
    /// the core serves them from the start.
    pub kernel_open: Vec<KernelOpen>,
    /// The first file handle this daemon gives out (above every one an
    /// earlier daemon of the same connection gave).
    pub fh_base: u64,
    /// Whether this node serves chunks to peers (`--listen`). Its closes
    /// publish, so recovery brings a file left open for writing back to
    /// what was published. A node on a shared store that serves none
    /// seals at release as a single node does, and its recovery seals
    /// such a file again from what its backing file holds.
    pub serves_peers: bool,
}

/// When this daemon started, and how many served its kernel connection
/// before it (for `status` and the metrics).
#[derive(Debug, Clone)]
pub struct DaemonLife {
    pub started: std::time::SystemTime,
    pub restarts: u64,
    /// How the last one ended.
    pub last_exit: Option<String>,
}

impl DaemonLife {
    /// The line `converged status` shows.
    pub fn describe(&self) -> String {
        let started = jiff::Timestamp::try_from(self.started).map(|t| t.to_string()).unwrap_or_default();
        match self.restarts {
            0 => format!("daemon: started {started}, first on this mount\n"),
            n => format!(
                "daemon: started {started}, {n} before it on this mount (the last {})\n",
                self.last_exit.as_deref().unwrap_or("ended")
            ),
        }
    }
}

/// Attributes as the caller sees them: the namespace record, with size and
/// mtime taken from the backing file while the file is being written here.
pub type Attr = Inode;

/// A directory snapshot held by an open directory handle: (name, entry) pairs.
pub type Listing = Arc<Vec<(Vec<u8>, Dentry)>>;

/// Counters of the daemon's own I/O, for the metrics endpoint. Bytes the
/// kernel moves by passthrough never reach the daemon and are not counted.
#[derive(Default)]
pub struct CoreStats {
    pub opens_passthrough: AtomicU64,
    pub opens_cached: AtomicU64,
    pub opens_direct: AtomicU64,
    pub read_bytes: AtomicU64,
    pub written_bytes: AtomicU64,
    pub seals: AtomicU64,
    pub corrupt_blocks: AtomicU64,
    /// Copies this node made for repair and drains, and holders it dropped.
    pub repair_copies: AtomicU64,
    pub repair_dropped: AtomicU64,
    /// What scrubs read and found.
    pub scrub_bytes: AtomicU64,
    pub scrub_bad_blocks: AtomicU64,
    pub scrub_repaired_blocks: AtomicU64,
}

pub struct Core {
    /// Counters for the metrics endpoint.
    pub stats: CoreStats,
    /// Set once by the daemon after start.
    life: OnceLock<DaemonLife>,
    ns: Namespace,
    store: Arc<ChunkStore>,
    cfg: CoreConfig,
    /// Files open on this node, and the handles on them.
    open: OpenTable,
    /// Directory handles open here and their listings: a removed directory
    /// stays until its last handle is released.
    open_dirs: dirs::OpenDirs,
    /// Inodes that lost their last name here, for the kernel's questions
    /// until it forgets them.
    removed: removed::Removed,
    passthrough: AtomicBool,
    /// What waits for the next flush: purged backing files, files closed
    /// empty, and the wake-up of the flusher.
    pending: durability::Pending,
    /// Backing files made ahead of time for the next inode numbers (see `spares.rs`).
    spares: spares::Spares,
    /// The last repair pass's findings (leaf lock).
    last_repair: Mutex<Option<RepairPass>>,
    /// Peers, when this node is part of a cluster.
    cluster: OnceLock<Arc<Cluster>>,
    /// Files whose chunks have fewer copies than their policy asks, for the
    /// replicator (durability=local, or peers that did not answer).
    under_replicated: replicate::ReplicationQueue,
    /// Files whose records changed, for the sweep (see `sweep.rs`).
    sweep_hints: Arc<sweep::SweepHints>,
    /// Write leases other nodes hold, as the change feed told (see `peer_leases.rs`).
    peer_leases: Arc<PeerLeases>,
    /// Which control-plane records changed, for the workers that act on them.
    control: Arc<crate::control::ControlChanges>,
    /// The object store tier, when the mount has one.
    tier: OnceLock<Arc<Tiering>>,
    /// This core, for work it hands to background threads (object readahead).
    me: OnceLock<std::sync::Weak<Core>>,
    /// Seals that ended a local writer's session; see `attr::settled`.
    seals: attr::SealCounters,
    /// Reports the state of the daemon's background workers, for `status`
    /// (the core knows nothing of who runs them).
    workers: OnceLock<Box<dyn Fn() -> String + Send + Sync>>,
    /// Files made here under --nowsync whose close did not publish them
    /// (leaf lock): their last release does, or a recall, an fsyncdir or
    /// an unmount before it (see `write.rs`, `Core::close`).
    owed: Mutex<std::collections::BTreeSet<Ino>>,
    /// Set by [`Core::shutdown`]: whether the metadata store answered it.
    stopped: OnceLock<bool>,
}

fn chunk_range(offset: u64, len: u64, chunk_size: u32) -> std::ops::RangeInclusive<u32> {
    let cs = chunk_size.max(1) as u64;
    let first = (offset / cs) as u32;
    let last = ((offset + len.max(1) - 1) / cs) as u32;
    first..=last
}

fn ts_from(sec: i64, nsec: i64) -> Timespec {
    Timespec { sec, nsec: nsec as u32 }
}

impl Core {
    /// Open the core and bring metadata and chunks back into agreement:
    /// purge orphans, re-seal files that were open for writing or whose
    /// bytes were not known durable, drop backing files whose inode is gone.
    pub fn start(ns: Namespace, cfg: CoreConfig) -> FsResult<Self> {
        let store = Arc::new(ChunkStore::open(&cfg.data_dir)?);
        // The reserve keeps room on this disk for the embedded store; a
        // full etcd (its quota) is not this disk's and gets nothing from it.
        if !ns.is_clustered() {
            let s = store.clone();
            ns.set_no_space_handler(move || s.release_reserve());
        }
        let fh_base = cfg.fh_base;
        let core = Core {
            ns,
            store,
            cfg,
            open: OpenTable::starting_at(fh_base),
            open_dirs: dirs::OpenDirs::default(),
            removed: removed::Removed::default(),
            passthrough: AtomicBool::new(false),
            pending: durability::Pending::default(),
            spares: spares::Spares::default(),
            last_repair: Mutex::default(),
            cluster: OnceLock::new(),
            under_replicated: Default::default(),
            sweep_hints: Default::default(),
            peer_leases: Default::default(),
            control: Default::default(),
            tier: OnceLock::new(),
            me: OnceLock::new(),
            seals: attr::SealCounters::default(),
            workers: OnceLock::new(),
            owed: Mutex::default(),
            stopped: OnceLock::new(),
            stats: CoreStats::default(),
            life: OnceLock::new(),
        };
        if core.cfg.read_only {
            tracing::info!("read-only: recovery of files left open by a crash waits for a read-write mount");
        } else {
            core.recover()?;
            core.keep_reserve();
        }
        core.adopt_kernel_handles()?;
        Ok(core)
    }

    pub fn set_daemon_life(&self, life: DaemonLife) {
        let _ = self.life.set(life);
    }

    pub fn daemon_life(&self) -> Option<&DaemonLife> {
        self.life.get()
    }

    /// Serve the handles an earlier daemon of this mount left open in the
    /// kernel. A handle that cannot be (its file is gone) answers `EBADF`
    /// from then on, as a handle the daemon never gave out.
    fn adopt_kernel_handles(&self) -> FsResult<()> {
        if self.cfg.kernel_open.is_empty() {
            return Ok(());
        }
        let leases: std::collections::HashMap<Ino, u64> = match self.cfg.kernel_open.iter().any(|k| k.writable) {
            true => self.ns.unsealed()?.into_iter().collect(),
            false => Default::default(),
        };
        let mut writers = 0;
        for k in &self.cfg.kernel_open {
            match self.adopt(k, leases.get(&k.ino).copied()) {
                Ok(()) => writers += usize::from(k.writable),
                Err(e) => {
                    tracing::warn!(fh = k.fh, ino = k.ino, error = %e, "a handle of the earlier daemon cannot be served")
                }
            }
        }
        tracing::info!(handles = self.cfg.kernel_open.len(), writers, "took over the handles the kernel holds");
        Ok(())
    }

    /// Write leases other nodes hold, kept from the change feed: the daemon
    /// subscribes [`PeerLeases::feed`] to it.
    pub fn peer_leases(&self) -> &Arc<PeerLeases> {
        &self.peer_leases
    }

    /// Which control-plane records changed (members, admin states,
    /// rebalance, gc and rescan requests).
    pub fn control(&self) -> &Arc<crate::control::ControlChanges> {
        &self.control
    }

    /// Join the cluster: from now on chunks are replicated to peers and read
    /// from them when this node does not hold them.
    pub fn attach_cluster(self: &Arc<Self>, cluster: Arc<Cluster>) {
        cluster.set_control(self.control.clone());
        let (weak, weak2, weak3, weak4, weak5, weak6) = (
            Arc::downgrade(self),
            Arc::downgrade(self),
            Arc::downgrade(self),
            Arc::downgrade(self),
            Arc::downgrade(self),
            Arc::downgrade(self),
        );
        cluster.set_hooks(crate::chunkstore::LocalHooks {
            stage: Box::new(move |ino, chunk| {
                let core = weak.upgrade().ok_or_else(stopping)?;
                core.stage_chunk(ino, chunk)
                    .map_err(|e| converged_transport::ServiceError { errno: e.errno(), msg: e.to_string() })
            }),
            being_written: Box::new(move |ino| weak2.upgrade().is_some_and(|core| core.rewrites_backing_file(ino))),
            may_write: Box::new(move |caller, chunk| match weak3.upgrade() {
                Some(core) => core.peer_may_write(caller, chunk),
                None => Err(stopping()),
            }),
            may_write_made: Box::new(move |caller, chunk, dir| match weak6.upgrade() {
                Some(core) => core.peer_may_write_made(caller, chunk, dir),
                None => Err(stopping()),
            }),
            may_delete: Box::new(move |ino| match weak4.upgrade() {
                Some(core) => core.peer_may_delete(ino),
                None => Err(stopping()),
            }),
            recall: Box::new(move |dir| {
                let core = weak5.upgrade().ok_or_else(stopping)?;
                core.recall_dir(dir)
                    .map_err(|e| converged_transport::ServiceError { errno: e.errno(), msg: e.to_string() })
            }),
        });
        let c = cluster.clone();
        self.ns.set_recall_handler(move |ns, dir, holder| c.recall(ns, dir, holder));
        let _ = self.cluster.set(cluster);
        self.under_replicated.wake();
    }

    pub fn cluster(&self) -> Option<&Arc<Cluster>> {
        self.cluster.get()
    }

    /// Back files with the object store: backfill, import, eviction.
    pub fn attach_tier(self: &Arc<Self>, tier: Arc<Tiering>) {
        let _ = self.tier.set(tier);
        let _ = self.me.set(Arc::downgrade(self));
    }

    /// What `status` prints for the background workers.
    pub fn report_workers_with(&self, report: impl Fn() -> String + Send + Sync + 'static) {
        let _ = self.workers.set(Box::new(report));
    }

    pub fn tiering(&self) -> Option<&Arc<Tiering>> {
        self.tier.get()
    }

    /// Run `f` while no handle is open on `ino` and none can open (opens
    /// wait); `None` when the file is open here.
    pub(crate) fn while_closed<T>(&self, ino: Ino, f: impl FnOnce() -> T) -> Option<T> {
        match self.open.claim_closed(ino) {
            Claim::Closed(_held) => Some(f()),
            Claim::Open(_) => None,
        }
    }

    /// Whether a writer of `ino` is open on this node: the file's bytes are
    /// ahead of its metadata, and its attributes are the backing file's,
    /// which writes may change behind the kernel.
    pub(crate) fn is_being_written(&self, ino: Ino) -> bool {
        self.open.get(ino).is_some_and(|oi| oi.state().write.reads_backing_file())
    }

    /// Whether the backing file of `ino` here may hold bytes of no
    /// published version: a writer changes it in place, or a writer whose
    /// lease was lost left it so. Peers are then sent elsewhere.
    pub(crate) fn rewrites_backing_file(&self, ino: Ino) -> bool {
        self.open.get(ino).is_some_and(|oi| {
            let st = oi.state();
            st.write.reads_backing_file() || st.write.is_fenced()
        })
    }

    pub(crate) fn data_dir(&self) -> &std::path::Path {
        &self.cfg.data_dir
    }

    /// This node's id in the cluster.
    pub fn node_id(&self) -> &str {
        &self.cfg.node_id
    }

    /// Whether this node holds a current copy of the chunk. Without a
    /// cluster every chunk with a replica is local, whatever node id sealed it.
    /// A chunk with no replica at all was evicted (or never fetched, when
    /// imported): its bytes are in the object store only.
    /// Call `f` with every chunk this node holds a copy of, by its record:
    /// in a cluster found through the holder index (this node's entries
    /// only), on a single node from every record.
    pub(crate) fn for_each_local_chunk(
        &self,
        mut f: impl FnMut(Ino, u32, &converged_metadata::ChunkRecord),
    ) -> FsResult<()> {
        match self.cluster.get() {
            Some(_) => {
                self.ns.for_each_chunk_held_by(self.node_id(), f)?;
            }
            None => self.ns.for_each_chunk(|ino, index, rec| {
                if self.is_local(rec) {
                    f(ino, index, rec)
                }
            })?,
        }
        Ok(())
    }

    pub(crate) fn is_local(&self, rec: &converged_metadata::ChunkRecord) -> bool {
        match self.cluster.get() {
            None => !rec.replicas.is_empty(),
            Some(_) => rec.replicas.iter().any(|r| r == self.node_id()),
        }
    }

    pub fn chunk_store(&self) -> Arc<ChunkStore> {
        self.store.clone()
    }

    pub fn namespace(&self) -> &Namespace {
        &self.ns
    }

    /// Called by the adapter once the kernel has agreed to passthrough.
    pub fn set_passthrough(&self, on: bool) {
        self.passthrough.store(on && !self.cfg.verify_reads, Ordering::Relaxed);
    }

    pub fn passthrough(&self) -> bool {
        self.passthrough.load(Ordering::Relaxed)
    }

    /// The adapter could not set up passthrough for a handle: from now on
    /// I/O comes through the daemon.
    pub fn passthrough_refused(&self) {
        if self.passthrough.swap(false, Ordering::Relaxed) {
            tracing::warn!("kernel refused a passthrough backing file; serving all I/O through the daemon");
        }
    }

    /// Inodes open on this node now.
    pub fn open_files(&self) -> usize {
        self.open.len()
    }

    /// Files waiting for the replicator.
    /// What the last repair pass of this node found (none before the first).
    pub fn repair_report(&self) -> Option<RepairPass> {
        self.last_repair.lock().clone()
    }

    pub(crate) fn note_scrubbed(&self, s: &Scrubbed) {
        self.stats.scrub_bytes.fetch_add(s.bytes, Ordering::Relaxed);
        self.stats.scrub_bad_blocks.fetch_add(s.bad_blocks, Ordering::Relaxed);
        self.stats.scrub_repaired_blocks.fetch_add(s.repaired_blocks, Ordering::Relaxed);
    }

    pub(crate) fn set_repair_report(&self, pass: &RepairPass) {
        self.stats.repair_copies.fetch_add(pass.copied, Ordering::Relaxed);
        self.stats.repair_dropped.fetch_add(pass.dropped, Ordering::Relaxed);
        *self.last_repair.lock() = Some(pass.clone());
    }

    pub fn under_replicated_files(&self) -> usize {
        self.under_replicated.len()
    }

    // ---- namespace ----

    pub fn mknod(&self, parent: Ino, name: &[u8], node: &NewNode<'_>) -> FsResult<Attr> {
        Ok(self.ns.mknod(parent, name, node)?)
    }

    /// Whether the change a kernel request asked for committed, and the
    /// inode it made or named (see `RequestMark`).
    pub fn answered(&self, request: RequestMark) -> FsResult<Option<Ino>> {
        Ok(self.ns.answered(request)?)
    }

    /// A new name for `ino`; for a tmpfile open here, its first: from then
    /// on its last close seals it instead of purging it. (A last close
    /// racing the link finds the name in the purge's transaction and keeps
    /// the file: `Namespace::purge` drops only inodes still without one.)
    pub fn link(&self, ino: Ino, newparent: Ino, newname: &[u8]) -> FsResult<Attr> {
        self.link_answering(ino, newparent, newname, None)
    }

    /// [`Core::link`] for a kernel request (see
    /// `converged_metadata::types::RequestMark`).
    pub fn link_answering(
        &self,
        ino: Ino,
        newparent: Ino,
        newname: &[u8],
        request: Option<RequestMark>,
    ) -> FsResult<Attr> {
        let inode = self.ns.link_answering(ino, newparent, newname, request)?;
        if inode.nlink == 1 {
            if let Some(oi) = self.open.get(ino) {
                oi.state().orphaned = false;
            }
        }
        self.getattr(ino)
    }

    pub fn readlink(&self, ino: Ino) -> FsResult<Vec<u8>> {
        Ok(self.ns.readlink(ino)?)
    }

    /// Unlink a name. When it was the inode's last name and the inode is not
    /// open here, its records go in the same transaction: the inode is held
    /// closed (opens wait) from before the transaction to after it, and the
    /// transaction is told which inode it may purge instead of asking the
    /// open table from inside.
    pub fn unlink(&self, parent: Ino, name: &[u8]) -> FsResult<()> {
        self.unlink_answering(parent, name, None)
    }

    /// [`Core::unlink`] for a kernel request.
    pub fn unlink_answering(&self, parent: Ino, name: &[u8], request: Option<RequestMark>) -> FsResult<()> {
        let target = self.ns.lookup(parent, name)?;
        let held = match target.kind {
            FileKind::Directory => return Err(MetaError::IsDir.into()),
            FileKind::Regular => match self.open.claim_closed(target.ino) {
                Claim::Closed(held) => Some(held),
                Claim::Open(_) => None,
            },
            // Not opened through the daemon: nothing here can hold it.
            _ => None,
        };
        let may_purge = match target.kind {
            FileKind::Regular => held.as_ref().map(|h| h.ino()),
            _ => Some(target.ino),
        };
        // The purge hands back the chunk records it removed: the peers they
        // name remove their copies. Copies no record names are the sweep's.
        let mut gone = self.ns.unlink_purging(parent, name, &|ino| Some(ino) == may_purge, request)?;
        if gone.orphaned {
            self.removed.insert(gone.last.clone());
        }
        if gone.purged {
            let mut holders = std::mem::take(&mut gone.holders);
            holders.retain(|h| h != self.node_id());
            self.doom(gone.ino, holders, Some(gone.last.size));
            return Ok(());
        }
        drop(held);
        self.forget_orphan(gone)
    }

    pub fn rmdir(&self, parent: Ino, name: &[u8]) -> FsResult<()> {
        self.rmdir_answering(parent, name, None)
    }

    /// [`Core::rmdir`] for a kernel request.
    pub fn rmdir_answering(&self, parent: Ino, name: &[u8], request: Option<RequestMark>) -> FsResult<()> {
        // Held when no handle is open on it: purged in the removal's own
        // transaction, and no opendir slips in between.
        // (A name that does not resolve gets its errno from the removal.)
        let held = self.ns.lookup(parent, name).ok().and_then(|t| self.open_dirs.claim_closed(t.ino));
        let may_purge = held.as_ref().map(|h| h.ino);
        let gone = self.ns.rmdir_purging(parent, name, &|ino| Some(ino) == may_purge, request)?;
        drop(held);
        self.removed.insert(gone.last.clone());
        if !gone.purged {
            self.forget_orphan(gone)?;
        }
        Ok(())
    }

    /// Rename, atomically in one transaction. A rename that replaces a
    /// regular file first puts the new file's bytes on stable storage (as
    /// ext4 does for `rename` over a file), so that after a power cut the
    /// name holds one whole version: the old one, whose backing file goes
    /// only after the rename is durable, or the new one.
    pub fn rename(&self, parent: Ino, name: &[u8], newparent: Ino, newname: &[u8], mode: RenameMode) -> FsResult<()> {
        self.rename_leaving(parent, name, newparent, newname, mode, None, None)
    }

    /// rename; with `whiteout` (its owner's uid and gid), RENAME_WHITEOUT:
    /// a whiteout is left at the old name in the same transaction.
    /// `request`: the kernel request it is made for, if any.
    #[allow(clippy::too_many_arguments)]
    pub fn rename_leaving(
        &self,
        parent: Ino,
        name: &[u8],
        newparent: Ino,
        newname: &[u8],
        mode: RenameMode,
        whiteout: Option<(u32, u32)>,
        request: Option<RequestMark>,
    ) -> FsResult<()> {
        if mode != RenameMode::Exchange {
            if let (Ok(src), Ok(dst)) = (self.ns.lookup(parent, name), self.ns.lookup(newparent, newname)) {
                if src.kind == FileKind::Regular && dst.kind == FileKind::Regular && src.ino != dst.ino {
                    self.sync_backing_file(src.ino)?;
                }
            }
        }
        let victim = match whiteout {
            None => self.ns.rename_answering(parent, name, newparent, newname, mode, request)?,
            Some(owner) => {
                let noreplace = match mode {
                    RenameMode::Replace => false,
                    RenameMode::NoReplace => true,
                    RenameMode::Exchange => return Err(FsError::Invalid("RENAME_WHITEOUT with RENAME_EXCHANGE")),
                };
                self.ns.rename_with_whiteout(parent, name, newparent, newname, noreplace, owner, request)?
            }
        };
        if let Some(victim) = victim {
            self.removed.insert(victim.last.clone());
            self.forget_orphan(victim)?;
        }
        if let Some(t) = self.tier.get() {
            // Backed objects move to the new key in the background.
            // The rename is done; a name already gone again has nothing to re-key.
            let mut moved = vec![self.ns.lookup(newparent, newname)];
            if mode == RenameMode::Exchange {
                moved.push(self.ns.lookup(parent, name));
            }
            for inode in moved.into_iter().flatten() {
                match inode.kind {
                    FileKind::Directory => t.walk_renamed_dirs(),
                    FileKind::Regular => t.enqueue(inode.ino, std::time::Duration::ZERO),
                    _ => {}
                }
            }
        }
        Ok(())
    }

    /// An inode lost its last name: drop it now, or at last close if open here.
    fn forget_orphan(&self, gone: Unlinked) -> FsResult<()> {
        if !gone.orphaned {
            return Ok(());
        }
        if gone.dir {
            // Purged now if no handle is open, else by the last releasedir.
            if let Some(held) = self.open_dirs.orphaned(gone.ino) {
                self.purge(held.ino)?;
            }
            return Ok(());
        }
        match self.open.claim_closed(gone.ino) {
            Claim::Open(oi) => {
                oi.state().orphaned = true;
                Ok(())
            }
            Claim::Closed(_held) => self.purge(gone.ino),
        }
    }

    /// Drop the records of an orphan; its backing file goes after the next
    /// durable flush. The caller holds it closed.
    fn purge(&self, ino: Ino) -> FsResult<()> {
        if let Some(mut holders) = self.ns.purge_orphan(ino)? {
            holders.retain(|h| h != self.node_id());
            self.doom(ino, holders, None);
        }
        Ok(())
    }

    // ---- xattrs ----

    /// `caller` is the uid asking: only root may import (the daemon's
    /// credentials read the bucket, whoever set the attribute).
    pub fn setxattr(&self, ino: Ino, name: &[u8], value: &[u8], mode: XattrMode, caller: &Caller) -> FsResult<()> {
        match name {
            acl::ACCESS | acl::DEFAULT => {
                // Setting an access ACL clears set-group-ID unless the caller
                // is in the file's group or privileged (the kernel's rule).
                let kill_sgid = name == acl::ACCESS && caller.uid != 0 && !caller.in_group(self.ns.getattr(ino)?.gid);
                Ok(self.ns.set_acl(ino, name, value, kill_sgid)?)
            }
            STAGE_XATTR => {
                let n = parse_replicas(value).ok_or(FsError::Invalid("stage: replica count must be 1..=8"))?;
                self.stage_file(ino, n)
            }
            IMPORT_XATTR if caller.uid != 0 => Err(MetaError::NotPermitted("only root may import a bucket").into()),
            IMPORT_XATTR => self.start_import(ino, value, mode),
            name if Self::is_generated_xattr(name) => Err(FsError::Invalid("read-only attribute")),
            _ => Ok(self.ns.setxattr(ino, name, value, mode)?),
        }
    }

    /// Whether `name` is one of the daemon's own attributes whose value is
    /// made at each read (statistics, worker states, layouts), so that it
    /// may grow between a caller's size query and its read.
    pub fn is_generated_xattr(name: &[u8]) -> bool {
        matches!(name, TIER_XATTR | LAYOUT_XATTR | BACKFILL_XATTR | WORKERS_XATTR | SCRUB_XATTR | STATS_XATTR)
    }

    pub fn getxattr(&self, ino: Ino, name: &[u8]) -> FsResult<Vec<u8>> {
        match name {
            TIER_XATTR => self.describe_tier(ino),
            LAYOUT_XATTR => self.describe_layout(ino),
            SCRUB_XATTR => {
                let found = self.scrub_file(ino)?;
                self.note_scrubbed(&found);
                Ok(found.describe().into_bytes())
            }
            BACKFILL_XATTR => self.describe_backfill(),
            STATS_XATTR => Ok(crate::latency::snapshot(
                self.stats.read_bytes.load(std::sync::atomic::Ordering::Relaxed),
                self.stats.written_bytes.load(std::sync::atomic::Ordering::Relaxed),
            )
            .into_bytes()),
            WORKERS_XATTR => match self.workers.get() {
                Some(report) => {
                    let mut text = self.life.get().map(DaemonLife::describe).unwrap_or_default();
                    text.push_str(&report());
                    Ok(text.into_bytes())
                }
                None => Err(MetaError::NoAttr.into()),
            },
            _ => Ok(self.ns.getxattr(ino, name)?),
        }
    }

    pub fn listxattr(&self, ino: Ino) -> FsResult<Vec<u8>> {
        Ok(self.ns.listxattr(ino)?)
    }

    pub fn removexattr(&self, ino: Ino, name: &[u8]) -> FsResult<()> {
        Ok(self.ns.removexattr(ino, name)?)
    }

    // ---- directories ----

    /// Open a directory to list: the handle, and whether its atime changed.
    /// The handle holds a snapshot of the entries (see `dirs.rs`).
    pub fn opendir(&self, ino: Ino) -> FsResult<(u64, bool)> {
        // Counted before the look, so a removal that did not see this
        // handle has purged before the look, which then fails.
        let fh = self.open.new_fh();
        self.open_dirs.open(ino, fh);
        let dir = match self.ns.getattr(ino) {
            Ok(dir) => dir,
            Err(e) => {
                self.releasedir(fh);
                return Err(e.into());
            }
        };
        let touched = self.cfg.diratime && self.note_access(&dir);
        Ok((fh, touched))
    }

    /// A read-open of `inode` (a file, or a directory to list): its atime as
    /// the mount's rule says. The update is made at open, not at each read:
    /// passthrough reads never reach the daemon. Returns whether atime
    /// changed (the kernel's cached attributes are then stale). A failed
    /// update is logged and the open goes on.
    pub(crate) fn note_access(&self, inode: &Attr) -> bool {
        if !self.cfg.atime.due(inode, converged_metadata::types::Timespec::now()) {
            return false;
        }
        match self.ns.touch_atime(inode.ino, self.cfg.atime) {
            Ok(changed) => changed.is_some(),
            Err(e) => {
                tracing::warn!(ino = inode.ino, error = %e, "could not update atime");
                false
            }
        }
    }

    /// Entries from `offset` on; offset 0 (re)takes the snapshot. Returns
    /// (entry offset, name, dentry); `.` and `..` are offsets 1 and 2.
    pub fn readdir(&self, ino: Ino, fh: u64, offset: u64) -> FsResult<Listing> {
        if let Some(listing) = self.open_dirs.listing(fh).filter(|_| offset > 0) {
            return Ok(listing);
        }
        if self.tier.get().is_some() {
            self.materialize(ino)?;
        }
        let dir = self.ns.getattr(ino)?;
        let mut entries = vec![
            (b".".to_vec(), Dentry { ino, kind: FileKind::Directory }),
            (b"..".to_vec(), Dentry { ino: dir.parent, kind: FileKind::Directory }),
        ];
        entries.extend(self.ns.readdir(ino)?);
        let listing = Arc::new(entries);
        self.open_dirs.keep_listing(fh, listing.clone());
        Ok(listing)
    }

    /// Read ahead, in one request where the metadata is remote, what a
    /// listing with attributes of `parent` asks next of `entries` (see
    /// `Namespace::prefetch_entries`). A failure only leaves them to be
    /// read one by one.
    pub fn prefetch_entries(&self, parent: Ino, entries: &[(&[u8], Ino)]) {
        if let Err(e) = self.ns.prefetch_entries(parent, entries) {
            tracing::debug!(parent, error = %e, "could not read a listing's entries ahead");
        }
    }

    pub fn releasedir(&self, fh: u64) {
        // The last handle of a removed directory: its records go now.
        if let Some(held) = self.open_dirs.close(fh) {
            if let Err(e) = self.purge(held.ino) {
                tracing::warn!(ino = held.ino, error = %e, "purging a removed directory failed; the next mount purges it");
            }
        }
    }

    pub fn fsyncdir(&self) -> FsResult<()> {
        // Names made durable carry the bytes their closes acknowledged;
        // every change acknowledged before commits (--nowsync).
        self.publish_owed();
        self.ns.flush_deferred()?;
        self.make_durable()
    }

    pub fn statfs(&self) -> FsResult<libc::statvfs> {
        crate::blocks::statvfs(&self.cfg.data_dir).map_err(|e| FsError::io("statvfs data dir", e))
    }

    /// Flush the namespace to stable storage (unmount). When the metadata
    /// store does not answer (an etcd that is down or cut off), it is asked
    /// once, and what only it can record is left for later: session ends
    /// and purged files' data for this node's next mount, its membership
    /// for its lease to run out (see [`Core::store_answered_at_stop`]).
    pub fn shutdown(&self) {
        let answered = self.stop();
        let _ = self.stopped.set(answered);
    }

    /// [`Core::shutdown`] once the kernel's connection has ended (an
    /// unmount, not a hand-over). The kernel sends RELEASE in the
    /// background after close(2) returned, and the connection's end drops
    /// those not read yet: an unmount gives a FUSE mount that is not a
    /// block device's no DESTROY to wait for them. The handles left are
    /// released first, as those requests would have been (on one node a
    /// writer's release is its file's only seal; a removed directory's last
    /// release purges it); a shared store is asked once, as for the rest
    /// of the unmount.
    pub fn shutdown_unmounted(&self) {
        if self.ns.is_clustered() {
            self.ns.stop_waiting();
        }
        let (files, dirs) = (self.open.handle_ids(), self.open_dirs.handle_ids());
        if !files.is_empty() || !dirs.is_empty() {
            tracing::info!(
                files = files.len(),
                directories = dirs.len(),
                "connection ended with handles open; releasing them"
            );
        }
        for fh in files {
            if let Err(e) = self.release(fh) {
                tracing::error!(fh, error = %e, "could not release a handle left at the connection's end");
            }
        }
        for fh in dirs {
            self.releasedir(fh);
        }
        self.shutdown();
    }

    /// Whether the metadata store answered the unmount's [`Core::shutdown`]
    /// (true before it ran): when it did not, the daemon does not wait on
    /// it again to leave the cluster.
    pub fn store_answered_at_stop(&self) -> bool {
        self.stopped.get().copied().unwrap_or(true)
    }

    fn stop(&self) -> bool {
        // A store shared over the network (etcd): each transaction from
        // here is tried once if it does not answer: 64 tries of each, every
        // one waiting out the deadline, kept an unmount during an etcd
        // outage going for minutes. (The embedded engine's rare retryable
        // error, a database reopened after a full disk, is retried as ever.)
        let shared = self.ns.is_clustered();
        if shared {
            self.ns.stop_waiting();
        }
        let unanswered = |e: &MetaError| shared && e.is_unanswered();
        let mut answered = true;
        // What was acknowledged before it committed (--nowsync) commits now,
        // and the directories delegated here become plain ones.
        if let Err(e) = self.ns.release_delegations() {
            answered &= !unanswered(&e);
            tracing::error!(error = %e, "could not commit acknowledged namespace changes at unmount");
        }
        // Spares not used by a regular file would be strays at the next mount.
        let spares = self.spares.stop();
        // Numbers from here on were never handed out: no need to ask.
        let next = self.ns.upcoming_inos(1).start;
        for (ino, _) in spares {
            let unused = ino >= next
                || (answered
                    && match self.ns.getattr(ino) {
                        Err(MetaError::NotFound) => true,
                        Ok(inode) => inode.kind != FileKind::Regular,
                        Err(e) => {
                            answered &= !unanswered(&e);
                            false
                        }
                    });
            if unused {
                let _ = self.store.remove(ino);
            }
        }
        if answered {
            match self.flush() {
                Ok(()) => return true,
                Err(e) => {
                    answered = !matches!(&e, FsError::Meta(m) if unanswered(m));
                    tracing::error!(error = %e, "final metadata sync failed");
                }
            }
        }
        if !answered {
            // The bytes closed here are on this disk at least: a mark the
            // store keeps for them is checked at the next mount.
            if let Err(e) = self.store.sync_filesystem() {
                tracing::error!(error = %e, "could not sync the data disk at unmount");
            }
            tracing::warn!("the metadata store did not answer at unmount; what it has not recorded (ended write sessions, files to delete) is taken up again at the next mount");
        }
        answered
    }
}

fn stopping() -> converged_transport::ServiceError {
    converged_transport::ServiceError { errno: libc::ESHUTDOWN, msg: "node is stopping".into() }
}
