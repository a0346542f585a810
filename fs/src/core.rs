//! The filesystem core: namespace operations plus file data, with no FUSE
//! types in sight. The FUSE adapter (`fuse.rs`) calls one method here per
//! request; tests can drive it directly.
//!
//! Data lives in the local [`ChunkStore`]. Reads served by the daemon are
//! checked against per-block crc32c; a file open for writing is *unsealed*
//! and gets fresh checksums when its last writer closes (or, after a crash,
//! at the next mount).

use std::collections::BTreeSet;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use converged_metadata::types::*;
use converged_metadata::{ChunkRecord, Durability, MetaError, Namespace, Seal, Unlinked};
use dashmap::DashMap;
use parking_lot::Mutex;

use crate::backfill::Tiering;
use crate::chunkstore::{block_crcs, read_exact_at, ChunkStore};
use crate::cluster::{Cluster, DurabilityMode};
use crate::error::{FsError, FsResult};
use crate::remote::{self, Readahead, WINDOW};

pub struct CoreConfig {
    pub data_dir: PathBuf,
    /// This node's id, recorded as the replica of every chunk it seals.
    pub node_id: String,
    /// Serve every read through the daemon so every byte is checksum-verified.
    pub verify_reads: bool,
    /// The embedded metadata file when it lives on the data disk; kept
    /// preallocated so a disk full of chunks cannot starve it.
    pub meta_file: Option<PathBuf>,
}

/// Attributes as the caller sees them: the namespace record, with size and
/// mtime taken from the backing file while the file is being written here.
pub type Attr = Inode;

/// What an open hands back: the handle, and the backing file when reads and
/// writes may go straight to it (kernel passthrough).
pub struct Opened {
    pub fh: u64,
    pub backing: Option<Arc<File>>,
    /// Served by the daemon outside the kernel's page cache (FOPEN_DIRECT_IO).
    pub direct_io: bool,
}

/// How the kernel does a handle's I/O. It refuses a passthrough open while
/// a cached one of the same inode is open, and the reverse (the open fails
/// with EIO), but direct I/O opens mix with both; so a new open follows
/// the mode of the handles already open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Io {
    /// Kernel passthrough to the backing file.
    Passthrough,
    /// Through the daemon, with the kernel's page cache.
    Cached,
    /// Through the daemon, without the page cache: beside passthrough handles.
    Direct,
}

/// A directory snapshot held by an open directory handle: (name, entry) pairs.
pub type Listing = Arc<Vec<(Vec<u8>, Dentry)>>;

struct Handle {
    ino: Ino,
    writable: bool,
    io: Io,
}

/// Which chunks of an unsealed file need new checksums.
#[derive(Default)]
enum Dirty {
    #[default]
    None,
    Chunks(BTreeSet<u32>),
    /// Writes went around the daemon (passthrough): every chunk.
    All,
}

impl Dirty {
    fn add(&mut self, chunks: std::ops::RangeInclusive<u32>) {
        match self {
            Dirty::All => {}
            Dirty::None => *self = Dirty::Chunks(chunks.collect()),
            Dirty::Chunks(set) => set.extend(chunks),
        }
    }
}

/// Per-inode state while at least one handle is open on this node.
struct OpenInode {
    file: Arc<File>,
    state: Mutex<OpenState>,
    /// Windows fetched from peers for chunks this node does not hold.
    readahead: Mutex<Readahead>,
}

/// A sealed file as an open handle reads it: size and chunk records, loaded
/// at open (close-to-open: a later open sees a later seal).
struct Layout {
    size: u64,
    chunk_size: u64,
    chunks: Vec<Option<Arc<ChunkRecord>>>,
    /// The object holding the file's current bytes, when it is backed:
    /// chunks with no copy (and chunks with no record) are read from it.
    object: Option<Arc<TierRecord>>,
}

/// A chunk's slot in the tier's fetch table, removed when its fetch ends.
struct FetchSlot<'a>(&'a Tiering, (Ino, u32));

impl Drop for FetchSlot<'_> {
    fn drop(&mut self) {
        self.0.fetching.remove(&self.1);
    }
}

/// Bytes `[from, to)` of a file, inside the chunk that starts at `chunk_start`.
struct Part<'a> {
    rec: &'a ChunkRecord,
    chunk_start: u64,
    from: u64,
    to: u64,
}

impl Part<'_> {
    /// The block-aligned range to read and verify, clipped to the chunk's data.
    fn blocks(&self) -> (u64, u64) {
        let bs = BLOCK_SIZE as u64;
        let stop = (self.to.div_ceil(bs) * bs).min(self.chunk_start + self.rec.len as u64).max(self.to);
        (self.from / bs * bs, stop)
    }
}

/// Size and mtime of a backing file: what a publish saw, to skip the next
/// one (and the final seal) when nothing changed since.
type Stamp = (u64, Timespec);

#[derive(Default)]
struct OpenState {
    opens: u32,
    writers: u32,
    unsealed: bool,
    dirty: Dirty,
    orphaned: bool,
    /// Layout of a sealed file, loaded on the first read through the daemon.
    layout: Option<Arc<Layout>>,
    /// What the last publish (close or fsync in a cluster) recorded.
    published: Option<Stamp>,
    /// Created by this open: an empty file needs no publish.
    created_here: bool,
    /// Handles open in each kernel I/O mode (see [`Io`]).
    passthrough_handles: u32,
    cached_handles: u32,
}

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
}

pub struct Core {
    /// Counters for the metrics endpoint.
    pub stats: CoreStats,
    ns: Namespace,
    store: Arc<ChunkStore>,
    cfg: CoreConfig,
    open: DashMap<Ino, Arc<OpenInode>>,
    handles: DashMap<u64, Handle>,
    dirs: DashMap<u64, Listing>,
    next_fh: AtomicU64,
    passthrough: AtomicBool,
    /// Backing files of purged inodes, removed only once the purge is
    /// durable: a crash before that brings the inode back with its data.
    doomed: Mutex<Vec<Ino>>,
    doomed_bytes: AtomicU64,
    /// Files closed while still empty: nothing to checksum, so their
    /// unsealed mark is cleared in one batch by the next flush instead of a
    /// commit per close (what makes creating many empty files cheap).
    unseal_later: Mutex<Vec<Ino>>,
    /// Orders that batch against a new writer marking the file unsealed.
    seal_lock: Mutex<()>,
    /// Backing files made ahead of time for the next inode numbers, so a
    /// create does not wait for the local filesystem to create one.
    spares: Mutex<std::collections::HashMap<Ino, File>>,
    spares_low: parking_lot::Condvar,
    /// Held while a spare is made; set to true at shutdown so none is made after.
    spares_stopped: Mutex<bool>,
    /// Wakes the flusher early (a purge wants its space back).
    flush_now: (Mutex<bool>, parking_lot::Condvar),
    /// Peers, when this node is part of a cluster.
    cluster: OnceLock<Arc<Cluster>>,
    /// Files whose chunks have fewer copies than their policy asks, for the
    /// replicator (durability=local, or peers that did not answer).
    under_replicated: (Mutex<BTreeSet<Ino>>, parking_lot::Condvar),
    /// The object store tier, when the mount has one.
    tier: OnceLock<Arc<Tiering>>,
    /// This core, for work it hands to background threads (object readahead).
    me: OnceLock<std::sync::Weak<Core>>,
    /// Counts seals that ended a local writer's session; see `settled`.
    seal_epoch: AtomicU64,
    /// The same, per stripe of inode numbers (see `settled`).
    seal_stripes: [AtomicU64; SEAL_STRIPES],
}

/// Stripes of inode numbers with a seal counter each.
const SEAL_STRIPES: usize = 64;

/// Chunks whose replica writes may be in flight at once while sealing.
const REPLICATION_WINDOW: usize = 3;

/// How long an open for writing waits for another node's write lease.
const LEASE_WAIT: Duration = Duration::from_secs(2);

/// Backing files kept ready ahead of creates.
const SPARES: usize = 256;

/// Purged data waiting for a flush that wakes the flusher early.
const WAKE_FLUSHER_BYTES: u64 = 1 << 30;
const WAKE_FLUSHER_FILES: usize = 50_000;

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
    /// purge orphans, re-seal files that were open for writing, drop backing
    /// files whose inode is gone.
    pub fn start(ns: Namespace, cfg: CoreConfig) -> FsResult<Self> {
        let store = Arc::new(ChunkStore::open(&cfg.data_dir)?);
        let s = store.clone();
        ns.set_no_space_handler(move || s.release_reserve());
        let core = Core {
            ns,
            store,
            cfg,
            open: DashMap::new(),
            handles: DashMap::new(),
            dirs: DashMap::new(),
            next_fh: AtomicU64::new(1),
            passthrough: AtomicBool::new(false),
            doomed: Mutex::default(),
            doomed_bytes: AtomicU64::new(0),
            unseal_later: Mutex::default(),
            seal_lock: Mutex::default(),
            spares: Mutex::default(),
            spares_low: parking_lot::Condvar::new(),
            spares_stopped: Mutex::new(false),
            flush_now: Default::default(),
            cluster: OnceLock::new(),
            under_replicated: Default::default(),
            tier: OnceLock::new(),
            me: OnceLock::new(),
            seal_epoch: AtomicU64::new(0),
            seal_stripes: std::array::from_fn(|_| AtomicU64::new(0)),
            stats: CoreStats::default(),
        };
        core.recover()?;
        core.keep_reserve();
        Ok(core)
    }

    fn recover(&self) -> FsResult<()> {
        let orphans = self.ns.orphans()?;
        for ino in &orphans {
            self.ns.purge(*ino)?;
            self.store.remove(*ino)?;
        }
        let unsealed = self.ns.unsealed()?;
        for ino in &unsealed {
            match self.ns.getattr(*ino) {
                Ok(inode) => {
                    let file = self.store.open_backing(*ino)?;
                    self.seal_file(&inode, &file, &Dirty::All, false, Durability::Buffered)?;
                    // Sealed before the cluster is attached: replicas follow in the background.
                    self.under_replicated.0.lock().insert(*ino);
                }
                Err(MetaError::NotFound) => {
                    self.ns.purge(*ino)?;
                }
                Err(e) => return Err(e.into()),
            }
        }
        let mut strays = 0;
        for ino in self.store.list()? {
            if matches!(self.ns.getattr(ino), Err(MetaError::NotFound)) {
                self.store.remove(ino)?;
                strays += 1;
            }
        }
        self.ns.sync()?;
        if !orphans.is_empty() || !unsealed.is_empty() || strays > 0 {
            tracing::info!(
                orphans = orphans.len(),
                resealed = unsealed.len(),
                stray_backing_files = strays,
                "recovered after an unclean stop"
            );
        }
        Ok(())
    }

    /// Join the cluster: from now on chunks are replicated to peers and read
    /// from them when this node does not hold them.
    pub fn attach_cluster(self: &Arc<Self>, cluster: Arc<Cluster>) {
        let weak = Arc::downgrade(self);
        cluster.set_stager(Box::new(move |ino, chunk| {
            let core = weak.upgrade().ok_or_else(|| converged_transport::ServiceError {
                errno: libc::ESHUTDOWN,
                msg: "node is stopping".into(),
            })?;
            core.stage_chunk(ino, chunk)
                .map_err(|e| converged_transport::ServiceError { errno: e.errno(), msg: e.to_string() })
        }));
        let _ = self.cluster.set(cluster);
        self.under_replicated.1.notify_one();
    }

    pub fn cluster(&self) -> Option<&Arc<Cluster>> {
        self.cluster.get()
    }

    /// Back files with the object store: backfill, import, eviction.
    pub fn attach_tier(self: &Arc<Self>, tier: Arc<Tiering>) {
        let _ = self.tier.set(tier);
        let _ = self.me.set(Arc::downgrade(self));
    }

    pub fn tiering(&self) -> Option<&Arc<Tiering>> {
        self.tier.get()
    }

    /// Run `f` while no handle is open on `ino` and none can open; `None`
    /// when the file is open.
    pub(crate) fn while_closed<T>(&self, ino: Ino, f: impl FnOnce() -> T) -> Option<T> {
        match self.open.entry(ino) {
            dashmap::Entry::Vacant(_guard) => Some(f()),
            dashmap::Entry::Occupied(_) => None,
        }
    }

    pub(crate) fn is_being_written(&self, ino: Ino) -> bool {
        self.open.get(&ino).is_some_and(|oi| oi.state.lock().unsealed)
    }

    pub(crate) fn data_dir(&self) -> &std::path::Path {
        &self.cfg.data_dir
    }

    fn node_id(&self) -> &str {
        &self.cfg.node_id
    }

    /// Whether this node holds a current copy of the chunk. Without a
    /// cluster every chunk with a replica is local, whatever node id sealed it.
    /// A chunk with no replica at all was evicted (or never fetched, when
    /// imported): its bytes are in the object store only.
    pub(crate) fn is_local(&self, rec: &ChunkRecord) -> bool {
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

    fn new_fh(&self) -> u64 {
        self.next_fh.fetch_add(1, Ordering::Relaxed)
    }

    // ---- attributes ----

    /// Overlay what the backing file knows while writes may bypass the daemon.
    fn overlay(&self, mut inode: Inode) -> FsResult<Attr> {
        if inode.kind != FileKind::Regular {
            return Ok(inode);
        }
        if let Some(oi) = self.open.get(&inode.ino).map(|e| e.clone()) {
            if oi.state.lock().unsealed {
                let md = oi.file.metadata().map_err(|e| FsError::io("stat backing file", e))?;
                inode.size = md.len();
                let mtime = ts_from(md.mtime(), md.mtime_nsec());
                inode.mtime = mtime;
                inode.ctime = inode.ctime.max(mtime);
            }
        }
        Ok(inode)
    }

    /// Attributes that no local seal raced. Release commits a file's sealed
    /// size and only then stops taking the size from the backing file, so a
    /// record read before that commit and overlaid after it would carry the
    /// size the file had when it was opened, and the kernel would cut reads
    /// short at it. Read again when a seal ended in between: any seal
    /// for the first read (its inode is not known before it), then only
    /// seals of inodes in the same stripe, so that a node sealing
    /// thousands of files a second does not keep a stat going round.
    fn settled(&self, read: impl Fn() -> FsResult<Attr>) -> FsResult<Attr> {
        let epoch = self.seal_epoch.load(Ordering::SeqCst);
        let mut attr = read()?;
        if self.seal_epoch.load(Ordering::SeqCst) == epoch {
            return Ok(attr);
        }
        loop {
            let stripe = &self.seal_stripes[attr.ino as usize % SEAL_STRIPES];
            let before = stripe.load(Ordering::SeqCst);
            let again = read()?;
            if again.ino == attr.ino && stripe.load(Ordering::SeqCst) == before {
                return Ok(again);
            }
            attr = again;
        }
    }

    pub fn lookup(&self, parent: Ino, name: &[u8]) -> FsResult<Attr> {
        self.settled(|| self.lookup_once(parent, name))
    }

    fn lookup_once(&self, parent: Ino, name: &[u8]) -> FsResult<Attr> {
        match self.ns.lookup(parent, name) {
            // An imported directory not listed yet: list it, then look again.
            Err(MetaError::NotFound) if self.tier.get().is_some() && self.materialize(parent)? => {
                self.overlay(self.ns.lookup(parent, name)?)
            }
            Ok(inode) if inode.kind == FileKind::Regular && self.tier.get().is_some() => {
                // An imported object replaced in its bucket shows its new size at once.
                match self.check_import(inode.ino) {
                    Ok(true) => self.overlay(self.ns.getattr(inode.ino)?),
                    Ok(false) => self.overlay(inode),
                    Err(e) => {
                        tracing::warn!(ino = inode.ino, error = %e, "could not check an imported object");
                        self.overlay(inode)
                    }
                }
            }
            r => self.overlay(r?),
        }
    }

    pub fn getattr(&self, ino: Ino) -> FsResult<Attr> {
        self.settled(|| self.overlay(self.ns.getattr(ino)?))
    }

    pub fn setattr(&self, ino: Ino, attr: &SetAttr) -> FsResult<Attr> {
        let oi = self.open.get(&ino).map(|e| e.clone());
        let before = self.getattr(ino)?;
        if let Some(size) = attr.size {
            if before.kind == FileKind::Directory {
                return Err(MetaError::IsDir.into());
            }
            let writing = oi.as_ref().is_some_and(|oi| oi.state.lock().unsealed);
            if !writing {
                // Old checksums must not outlive a crash that lands between
                // the truncate below and the re-seal.
                self.take_write_lease(ino)?;
            }
            let file = match &oi {
                Some(oi) => oi.file.clone(),
                None => Arc::new(self.store.open_backing(ino)?),
            };
            if !writing && size > 0 {
                // The kept part must be here before it is re-sealed from here.
                self.hydrate(ino, &file)?;
            }
            file.set_len(size).map_err(|e| FsError::io("truncate backing file", e))?;
        }
        let mut inode = self.ns.setattr(ino, attr)?;
        if let Some(oi) = &oi {
            if attr.atime.is_some() || attr.mtime.is_some() {
                // Keep the backing file's times in step: they are the source of
                // mtime while the file is unsealed.
                set_file_times(&oi.file, &inode)?;
            }
        }
        if let Some(size) = attr.size {
            let boundary = chunk_range(before.size.min(size), 0, inode.chunk_size);
            let writing = oi.as_ref().is_some_and(|oi| {
                let mut st = oi.state.lock();
                st.layout = None;
                if st.unsealed {
                    st.dirty.add(boundary.clone());
                }
                st.unsealed
            });
            if !writing {
                let file = match &oi {
                    Some(oi) => oi.file.clone(),
                    None => Arc::new(self.store.open_backing(ino)?),
                };
                inode =
                    self.seal_file(&inode, &file, &Dirty::Chunks(boundary.collect()), false, Durability::Buffered)?;
            }
        }
        self.overlay(inode)
    }

    // ---- namespace ----

    pub fn mknod(&self, parent: Ino, name: &[u8], node: &NewNode<'_>) -> FsResult<Attr> {
        Ok(self.ns.mknod(parent, name, node)?)
    }

    pub fn link(&self, ino: Ino, newparent: Ino, newname: &[u8]) -> FsResult<Attr> {
        self.ns.link(ino, newparent, newname)?;
        self.getattr(ino)
    }

    pub fn readlink(&self, ino: Ino) -> FsResult<Vec<u8>> {
        Ok(self.ns.readlink(ino)?)
    }

    pub fn unlink(&self, parent: Ino, name: &[u8]) -> FsResult<()> {
        let gone = self.ns.unlink_purging(parent, name, &|ino| !self.open.contains_key(&ino))?;
        if gone.purged {
            self.doom(gone.ino);
            return Ok(());
        }
        self.forget_orphan(gone)
    }

    pub fn rmdir(&self, parent: Ino, name: &[u8]) -> FsResult<()> {
        Ok(self.ns.rmdir(parent, name)?)
    }

    pub fn rename(&self, parent: Ino, name: &[u8], newparent: Ino, newname: &[u8], mode: RenameMode) -> FsResult<()> {
        if let Some(victim) = self.ns.rename(parent, name, newparent, newname, mode)? {
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
                    FileKind::Regular => t.enqueue(inode.ino, Duration::ZERO),
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
        if let Some(oi) = self.open.get(&gone.ino) {
            oi.state.lock().orphaned = true;
            return Ok(());
        }
        self.purge(gone.ino)
    }

    fn purge(&self, ino: Ino) -> FsResult<()> {
        if self.ns.purge(ino)? {
            self.doom(ino);
        }
        Ok(())
    }

    /// Queue the backing file of a purged inode for removal after the next
    /// durable flush. Deleting many small files shares one flush a second;
    /// a lot of space waiting to be freed wakes the flusher at once.
    fn doom(&self, ino: Ino) {
        let bytes = std::fs::metadata(self.store.path(ino)).map_or(0, |m| m.len());
        let mut doomed = self.doomed.lock();
        doomed.push(ino);
        let pending = self.doomed_bytes.fetch_add(bytes, Ordering::Relaxed) + bytes;
        if pending >= WAKE_FLUSHER_BYTES || doomed.len() >= WAKE_FLUSHER_FILES {
            *self.flush_now.0.lock() = true;
            self.flush_now.1.notify_one();
        }
    }

    fn take_spare(&self, ino: Ino) -> Option<File> {
        let mut spares = self.spares.lock();
        let f = spares.remove(&ino);
        if spares.len() < SPARES / 2 {
            self.spares_low.notify_one();
        }
        f
    }

    /// Keep backing files ready for the next inode numbers. Spares for
    /// numbers already handed out are closed; one is deleted only when its
    /// inode turned out not to be a regular file, since a regular file may
    /// be opening its backing file by path at this moment.
    pub fn run_spares(core: std::sync::Weak<Core>) {
        loop {
            let Some(c) = core.upgrade() else { return };
            {
                // Woken when a create finds the pool half empty.
                let mut spares = c.spares.lock();
                c.spares_low.wait_for(&mut spares, std::time::Duration::from_millis(100));
            }
            let upcoming = c.ns.upcoming_inos(SPARES as u64);
            let stale: Vec<Ino> = c.spares.lock().keys().copied().filter(|i| *i < upcoming.start).collect();
            for ino in stale {
                c.spares.lock().remove(&ino);
                if matches!(c.ns.getattr(ino), Ok(i) if i.kind != FileKind::Regular) {
                    let _ = c.store.remove(ino);
                }
            }
            for ino in upcoming {
                let stopped = c.spares_stopped.lock();
                if *stopped {
                    return;
                }
                if c.spares.lock().contains_key(&ino) || c.open.contains_key(&ino) {
                    continue;
                }
                if let Some(f) = c.store.create_spare(ino) {
                    c.spares.lock().insert(ino, f);
                }
            }
        }
    }

    /// The flusher loop: every `period`, or sooner when a purge is waiting,
    /// run [`Core::flush`]. Many purges in a burst share one metadata sync.
    pub fn run_flusher(core: std::sync::Weak<Core>, period: std::time::Duration) {
        loop {
            let Some(c) = core.upgrade() else { return };
            {
                let mut wanted = c.flush_now.0.lock();
                if !*wanted {
                    c.flush_now.1.wait_for(&mut wanted, period);
                }
                *wanted = false;
            }
            if let Err(e) = c.flush() {
                tracing::error!(error = %e, "metadata flush failed");
            }
        }
    }

    /// Make buffered namespace changes durable, then remove the backing files
    /// of inodes purged before the sync. Called every second by the daemon
    /// and at unmount.
    pub fn flush(&self) -> FsResult<()> {
        self.clear_unsealed_batch()?;
        let doomed = std::mem::take(&mut *self.doomed.lock());
        self.doomed_bytes.store(0, Ordering::Relaxed);
        if let Err(e) = self.ns.sync_if_dirty() {
            // Not durable: the purges may come back after a crash, so their
            // data must stay.
            self.doomed.lock().extend(doomed);
            return Err(e.into());
        }
        for ino in doomed {
            // A metadata reopen after a disk-full error rolls back to the last
            // durable commit and may bring the inode back: then keep its data.
            if matches!(self.ns.getattr(ino), Err(MetaError::NotFound)) {
                self.store.remove(ino)?;
            }
        }
        self.keep_reserve();
        Ok(())
    }

    fn clear_unsealed_batch(&self) -> FsResult<()> {
        let _order = self.seal_lock.lock();
        let mut inos = std::mem::take(&mut *self.unseal_later.lock());
        // A file opened for writing again since it closed empty keeps its mark.
        inos.retain(|ino| self.open.get(ino).is_none_or(|oi| !oi.state.lock().unsealed));
        self.ns.clear_unsealed(&inos)?;
        if let Some(t) = self.tier.get() {
            for ino in inos {
                t.enqueue(ino, t.cfg.backfill_delay);
            }
        }
        Ok(())
    }

    /// Re-create the metadata reserve once the disk has room again.
    fn keep_reserve(&self) {
        if let Ok(st) = self.statfs() {
            let frsize = st.f_frsize.max(1);
            let reserve = crate::chunkstore::reserve_size(st.f_blocks * frsize);
            // An existing reserve is left as it is; a missing one is made
            // only once the disk has room to spare.
            if st.f_bavail * frsize > 4 * reserve {
                self.store.ensure_reserve(reserve);
            }
            if let Some(meta) = &self.cfg.meta_file {
                ChunkStore::preallocate(meta, reserve);
            }
        }
    }

    // ---- xattrs ----

    /// `caller` is the uid asking: only root may import (the daemon's
    /// credentials read the bucket, whoever set the attribute).
    pub fn setxattr(&self, ino: Ino, name: &[u8], value: &[u8], mode: XattrMode, caller: u32) -> FsResult<()> {
        match name {
            STAGE_XATTR => {
                let n = parse_replicas(value).ok_or(FsError::Invalid("stage: replica count must be 1..=8"))?;
                self.stage_file(ino, n)
            }
            IMPORT_XATTR if caller != 0 => Err(MetaError::NotPermitted("only root may import a bucket").into()),
            IMPORT_XATTR => self.start_import(ino, value, mode),
            TIER_XATTR | LAYOUT_XATTR | BACKFILL_XATTR => Err(FsError::Invalid("read-only attribute")),
            _ => Ok(self.ns.setxattr(ino, name, value, mode)?),
        }
    }
    pub fn getxattr(&self, ino: Ino, name: &[u8]) -> FsResult<Vec<u8>> {
        match name {
            TIER_XATTR => self.describe_tier(ino),
            LAYOUT_XATTR => self.describe_layout(ino),
            BACKFILL_XATTR => self.describe_backfill(),
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

    /// Directory handles hold a snapshot of the entries, so offsets stay
    /// stable while the directory changes underneath a reader.
    pub fn opendir(&self, ino: Ino) -> FsResult<u64> {
        self.ns.getattr(ino)?;
        let fh = self.new_fh();
        Ok(fh)
    }

    /// Entries from `offset` on; offset 0 (re)takes the snapshot. Returns
    /// (entry offset, name, dentry); `.` and `..` are offsets 1 and 2.
    pub fn readdir(&self, ino: Ino, fh: u64, offset: u64) -> FsResult<Listing> {
        if offset == 0 || !self.dirs.contains_key(&fh) {
            if self.tier.get().is_some() {
                self.materialize(ino)?;
            }
            let dir = self.ns.getattr(ino)?;
            let mut entries = vec![
                (b".".to_vec(), Dentry { ino, kind: FileKind::Directory }),
                (b"..".to_vec(), Dentry { ino: dir.parent, kind: FileKind::Directory }),
            ];
            entries.extend(self.ns.readdir(ino)?);
            self.dirs.insert(fh, Arc::new(entries));
        }
        Ok(self.dirs.get(&fh).map(|e| e.clone()).unwrap_or_default())
    }

    pub fn releasedir(&self, fh: u64) {
        self.dirs.remove(&fh);
    }

    pub fn fsyncdir(&self) -> FsResult<()> {
        Ok(self.ns.sync()?)
    }

    // ---- files ----

    /// Create a regular file and open it (open with O_CREAT). A file created
    /// for writing starts unsealed in the creating transaction.
    pub fn create(&self, parent: Ino, name: &[u8], node: &NewNode<'_>) -> FsResult<(Attr, Opened)> {
        let inode = self.ns.mknod(parent, name, node)?;
        let opened = self.open_inner(&inode, node.unsealed, node.unsealed)?;
        Ok((inode, opened))
    }

    /// Open `ino`; `writable` for O_WRONLY / O_RDWR.
    pub fn open(&self, ino: Ino, writable: bool) -> FsResult<Opened> {
        self.open_inner(&self.ns.getattr(ino)?, writable, false)
    }

    fn open_inner(&self, inode: &Inode, writable: bool, created_unsealed: bool) -> FsResult<Opened> {
        let ino = inode.ino;
        match inode.kind {
            FileKind::Regular => {}
            FileKind::Directory => return Err(MetaError::IsDir.into()),
            _ => return Err(FsError::Invalid("open of a special file through the daemon")),
        }
        let oi = {
            let entry = self.open.entry(ino).or_try_insert_with(|| {
                let file = match self.take_spare(ino) {
                    Some(f) => f,
                    None => self.store.open_backing(ino)?,
                };
                FsResult::Ok(Arc::new(OpenInode {
                    file: Arc::new(file),
                    state: Mutex::default(),
                    readahead: Mutex::default(),
                }))
            })?;
            let oi = entry.clone();
            oi.state.lock().opens += 1;
            oi
        };
        let fh = self.new_fh();
        // Direct (counted nowhere) until the mode is settled below.
        self.handles.insert(fh, Handle { ino, writable, io: Io::Direct });
        if writable {
            let first_writer = {
                let mut st = oi.state.lock();
                st.writers += 1;
                !st.unsealed
            };
            if first_writer {
                let marked = if created_unsealed { Ok(()) } else { self.take_write_lease(ino) };
                // Written here from now on: chunks held elsewhere come here first.
                let hydrated = marked.map_err(FsError::from).and_then(|()| {
                    if created_unsealed {
                        Ok(())
                    } else {
                        self.hydrate(ino, &oi.file)
                    }
                });
                if let Err(e) = hydrated {
                    let _ = self.release(fh);
                    return Err(e);
                }
                let mut st = oi.state.lock();
                st.unsealed = true;
                st.layout = None;
                st.created_here = created_unsealed;
            }
        }
        let mut passthrough = self.passthrough();
        if passthrough && writable {
            if let Some(t) = self.tier.get() {
                passthrough = self.room_for_passthrough_writes(t);
            }
        }
        if !writable && self.tier.get().is_some() && !oi.state.lock().unsealed {
            match self.check_import(ino) {
                Ok(true) => oi.state.lock().layout = None,
                Ok(false) => {}
                Err(e) => {
                    let _ = self.release(fh);
                    return Err(e);
                }
            }
        }
        let partial = self.cluster.get().is_some() || self.tier.get().is_some();
        if passthrough && !writable && partial && !oi.state.lock().unsealed {
            // Close-to-open: read the layout as it is now; the kernel may
            // read the backing file directly only if every chunk is here.
            oi.state.lock().layout = None;
            let layout = match self.layout(ino, &oi) {
                Ok(l) => l,
                Err(e) => {
                    let _ = self.release(fh);
                    return Err(e);
                }
            };
            // ... and the backing file has the file's size: passthrough reads
            // to the backing file's end.
            let same_size = oi.file.metadata().is_ok_and(|m| m.len() == layout.size);
            passthrough = same_size && layout.chunks.iter().flatten().all(|r| self.is_local(r));
        }
        let io = {
            let mut st = oi.state.lock();
            let io = match (passthrough, st.cached_handles > 0, st.passthrough_handles > 0) {
                (true, false, _) => Io::Passthrough,
                (true, true, _) => Io::Cached,
                (false, _, true) => Io::Direct,
                (false, _, false) => Io::Cached,
            };
            match io {
                Io::Passthrough => st.passthrough_handles += 1,
                Io::Cached => st.cached_handles += 1,
                Io::Direct => {}
            }
            let counter = match io {
                Io::Passthrough => &self.stats.opens_passthrough,
                Io::Cached => &self.stats.opens_cached,
                Io::Direct => &self.stats.opens_direct,
            };
            counter.fetch_add(1, Ordering::Relaxed);
            if io == Io::Passthrough && writable {
                // Writes go around the daemon: every chunk is checksummed again.
                st.dirty = Dirty::All;
            }
            io
        };
        if let Some(mut h) = self.handles.get_mut(&fh) {
            h.io = io;
        }
        Ok(Opened { fh, backing: (io == Io::Passthrough).then(|| oi.file.clone()), direct_io: io == Io::Direct })
    }

    /// Mark `ino` unsealed, taking its write lease. The kernel releases a
    /// file asynchronously after close(2) returns, so a writer on another
    /// node that has just closed may still hold the lease for a moment: wait
    /// for it a little before answering ETXTBSY.
    fn take_write_lease(&self, ino: Ino) -> converged_metadata::MetaResult<()> {
        let deadline = std::time::Instant::now() + LEASE_WAIT;
        loop {
            let r = {
                let _order = self.seal_lock.lock();
                self.ns.mark_unsealed(ino)
            };
            match r {
                Err(MetaError::WriteLeased { .. }) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50));
                }
                other => return other,
            }
        }
    }

    /// Copy into `file` every chunk of `ino` this node does not hold, from
    /// the peers that do (verified), and clear ranges that have no chunk, so
    /// that the backing file holds the whole current file before it is
    /// written or truncated here.
    fn hydrate(&self, ino: Ino, file: &File) -> FsResult<()> {
        if self.cluster.get().is_none() && self.tier.get().is_none() {
            return Ok(());
        }
        self.fetch_missing(ino, file)
    }

    /// Copy into `file` every chunk of `ino` this node lacks: from the peers
    /// that hold it, or else from the object store (verified either way),
    /// and clear ranges that have no chunk.
    pub(crate) fn fetch_missing(&self, ino: Ino, file: &File) -> FsResult<()> {
        let inode = self.ns.getattr(ino)?;
        let cs = inode.chunk_size.max(1) as u64;
        let records: std::collections::HashMap<u32, ChunkRecord> = self.ns.chunks(ino)?.into_iter().collect();
        let object = self.backed_object(ino)?;
        let mut wanted = Vec::new();
        let mut from_object = 0u64;
        for index in 0..inode.size.div_ceil(cs) as u32 {
            let chunk_start = index as u64 * cs;
            match records.get(&index) {
                Some(rec) if self.is_local(rec) => {}
                Some(rec) if !rec.replicas.is_empty() && self.cluster.get().is_some() => {
                    let rec = Arc::new(rec.clone());
                    let end = chunk_start + rec.len as u64;
                    let mut off = chunk_start;
                    while off < end {
                        wanted.push((rec.clone(), chunk_start, off, WINDOW.min(end - off) as u32));
                        off += WINDOW;
                    }
                }
                Some(_) | None if object.is_some() => {
                    let obj = object.as_ref().expect("checked");
                    let rec = self.fetch_object_chunk(ino, file, inode.size, cs, index, obj, false)?;
                    from_object += rec.len as u64;
                }
                Some(_) => {
                    return Err(FsError::Peer(format!("chunk {index} of inode {ino} has no copy anywhere")));
                }
                None => {
                    // A hole in the file: stale bytes from an older copy must not show through.
                    // SAFETY: fallocate on our own fd.
                    unsafe {
                        libc::fallocate(
                            file.as_raw_fd(),
                            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                            chunk_start as i64,
                            cs as i64,
                        )
                    };
                }
            }
        }
        if from_object > 0 {
            tracing::info!(ino, bytes = from_object, "fetched chunks from the object store before writing here");
        }
        let Some(cluster) = self.cluster.get() else {
            file.set_len(inode.size).map_err(|e| FsError::io("size hydrated backing file", e))?;
            return Ok(());
        };
        for batch in wanted.chunks(16) {
            let tasks: Vec<_> = batch
                .iter()
                .map(|(rec, chunk_start, off, len)| {
                    (*off, remote::fetch(cluster, ino, rec.clone(), *chunk_start, *off, *len))
                })
                .collect();
            for (off, task) in tasks {
                let data = remote::wait(cluster, task)?;
                file.write_all_at(&data, off).map_err(|e| FsError::io("write hydrated chunk", e))?;
            }
        }
        file.set_len(inode.size).map_err(|e| FsError::io("size hydrated backing file", e))?;
        if !wanted.is_empty() {
            tracing::info!(
                ino,
                bytes = wanted.iter().map(|w| w.3 as u64).sum::<u64>(),
                "fetched chunks held by peers before writing here"
            );
        }
        Ok(())
    }

    /// The adapter could not set up passthrough for this handle: from now on
    /// its writes come through the daemon, so normal dirty tracking applies.
    /// Inodes open on this node now.
    pub fn open_files(&self) -> usize {
        self.open.len()
    }

    /// Files waiting for the replicator.
    pub fn under_replicated_files(&self) -> usize {
        self.under_replicated.0.lock().len()
    }

    pub fn passthrough_refused(&self) {
        if self.passthrough.swap(false, Ordering::Relaxed) {
            tracing::warn!("kernel refused a passthrough backing file; serving all I/O through the daemon");
        }
    }

    fn handle(&self, fh: u64) -> FsResult<(Ino, bool, Arc<OpenInode>)> {
        let h = self.handles.get(&fh).ok_or(FsError::BadHandle(fh))?;
        let oi = self.open.get(&h.ino).map(|e| e.clone()).ok_or(FsError::BadHandle(fh))?;
        Ok((h.ino, h.writable, oi))
    }

    /// Read through the daemon. A file being written here reads straight
    /// from its backing file; a sealed file is read chunk by chunk, from the
    /// local copy or from a peer, every block checked against its crc32c.
    pub fn read(&self, fh: u64, offset: u64, size: u32) -> FsResult<Vec<u8>> {
        let out = self.read_handle(fh, offset, size)?;
        self.stats.read_bytes.fetch_add(out.len() as u64, Ordering::Relaxed);
        Ok(out)
    }

    fn read_handle(&self, fh: u64, offset: u64, size: u32) -> FsResult<Vec<u8>> {
        let (ino, _, oi) = self.handle(fh)?;
        if oi.state.lock().unsealed {
            // Unsealed: being written here, checksums not yet computed.
            let file_size = oi.file.metadata().map_err(|e| FsError::io("stat backing file", e))?.len();
            if offset >= file_size || size == 0 {
                return Ok(Vec::new());
            }
            let mut buf = vec![0u8; ((offset + size as u64).min(file_size) - offset) as usize];
            read_exact_at(&oi.file, &mut buf, offset).map_err(|e| FsError::io("read backing file", e))?;
            return Ok(buf);
        }
        let layout = self.layout(ino, &oi)?;
        if offset >= layout.size || size == 0 {
            return Ok(Vec::new());
        }
        let end = (offset + size as u64).min(layout.size);
        let cs = layout.chunk_size;
        let mut out = Vec::with_capacity((end - offset) as usize);
        let mut windows = None;
        let mut pos = offset;
        while pos < end {
            let index = pos / cs;
            let chunk_start = index * cs;
            let to = end.min(chunk_start + cs);
            if let Some(t) = self.tier.get() {
                t.touch(ino, index as u32);
            }
            let rec = layout.chunks.get(index as usize).and_then(|c| c.as_ref());
            let in_object_only = match rec {
                None => layout.object.is_some(),
                Some(rec) => rec.replicas.is_empty() && layout.object.is_some(),
            };
            match rec {
                _ if in_object_only => {
                    let obj = layout.object.as_ref().expect("checked");
                    self.fetch_ahead(ino, &oi, &layout, index as u32 + 1);
                    let rec = self.fetch_object_chunk(ino, &oi.file, layout.size, cs, index as u32, obj, false)?;
                    // Local from now on: the next read of this open uses the new layout.
                    oi.state.lock().layout = None;
                    self.read_local(ino, &oi, &Part { rec: &rec, chunk_start, from: pos, to }, &mut out)?;
                }
                // No record: a hole, which reads as zeros.
                None => out.resize(out.len() + (to - pos) as usize, 0),
                Some(rec) if self.is_local(rec) => {
                    let before = out.len();
                    let part = Part { rec, chunk_start, from: pos, to };
                    match self.read_local(ino, &oi, &part, &mut out) {
                        Ok(()) => {}
                        // A bad local copy: read another replica and repair ours.
                        Err(FsError::Corrupt { .. }) if rec.replicas.len() > 1 && self.cluster.get().is_some() => {
                            out.truncate(before);
                            self.repair_from_peer(ino, &oi, &part, &mut out)?;
                        }
                        // ... or fetch it again from the object store.
                        Err(FsError::Corrupt { .. }) if layout.object.is_some() => {
                            out.truncate(before);
                            let obj = layout.object.as_ref().expect("checked");
                            let rec =
                                self.fetch_object_chunk(ino, &oi.file, layout.size, cs, index as u32, obj, true)?;
                            self.read_local(ino, &oi, &Part { rec: &rec, chunk_start, from: pos, to }, &mut out)?;
                        }
                        Err(e) => return Err(e),
                    }
                }
                Some(_) => {
                    let windows = windows.get_or_insert_with(|| self.remote_windows(ino, &oi, &layout, offset, end));
                    let cluster = self.cluster.get().expect("a chunk held elsewhere implies a cluster");
                    for (start, w) in windows.iter() {
                        if *start >= to || start + WINDOW <= pos {
                            continue;
                        }
                        let data = w.wait(cluster.call_deadline())?;
                        let from = pos.max(*start);
                        let upto = to.min(start + WINDOW);
                        let have = data.len() as u64;
                        let a = (from - start).min(have) as usize;
                        let b = (upto - start).min(have) as usize;
                        out.extend_from_slice(&data[a..b]);
                        // Past the chunk's recorded length: zeros.
                        out.resize(out.len() + ((upto - from) as usize - (b - a)), 0);
                    }
                }
            }
            pos = to;
        }
        Ok(out)
    }

    /// Start fetching chunk `index` from the object store in the background
    /// when it is there only: a sequential reader finds it local (or being
    /// fetched, and waits for that) instead of starting the fetch itself.
    fn fetch_ahead(&self, ino: Ino, oi: &OpenInode, layout: &Arc<Layout>, index: u32) {
        let Some(obj) = layout.object.clone() else { return };
        let cs = layout.chunk_size;
        if index as u64 * cs >= layout.size {
            return;
        }
        let only_there =
            layout.chunks.get(index as usize).and_then(|c| c.as_ref()).is_none_or(|r| r.replicas.is_empty());
        let Some(t) = self.tier.get() else { return };
        if !only_there || t.fetching.contains_key(&(ino, index)) {
            return;
        }
        let (Some(me), file, size) = (self.me.get().cloned(), oi.file.clone(), layout.size) else { return };
        let spawned = std::thread::Builder::new().name("fetch-ahead".into()).spawn(move || {
            let Some(core) = me.upgrade() else { return };
            if let Err(e) = core.fetch_object_chunk(ino, &file, size, cs, index, &obj, false) {
                tracing::debug!(ino, chunk = index, error = %e, "readahead fetch failed; the read will retry");
            }
        });
        if let Err(e) = spawned {
            tracing::debug!(error = %e, "no thread for readahead");
        }
    }

    /// The tier record of `ino` when its object holds the current bytes.
    pub(crate) fn backed_object(&self, ino: Ino) -> FsResult<Option<TierRecord>> {
        if self.tier.get().is_none() {
            return Ok(None);
        }
        Ok(self.ns.tier(ino)?.filter(|r| matches!(r.state, TierState::Backed | TierState::ReKeying)))
    }

    /// Fetch chunk `index` of `ino` from its object into `file` (this
    /// node's backing file), verified against the chunk's checksums when it
    /// has them (computed here when it does not: an imported object), and
    /// record the copy. The object must still carry the ETag it had when
    /// listed or uploaded: a changed object is refused, never mixed in.
    /// With `force`, a local copy recorded as present is fetched again.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn fetch_object_chunk(
        &self,
        ino: Ino,
        file: &File,
        size: u64,
        cs: u64,
        index: u32,
        obj: &TierRecord,
        force: bool,
    ) -> FsResult<ChunkRecord> {
        let t = self.tier.get().ok_or(FsError::Invalid("no object store"))?;
        // One fetch of a chunk at a time; the slot goes when this one ends
        // (declared first, so dropped after the lock is released).
        let _slot = FetchSlot(t, (ino, index));
        let lock = t.fetching.entry((ino, index)).or_default().clone();
        let _one = lock.lock();
        let current = self.ns.chunk(ino, index)?;
        if let Some(r) = &current {
            if self.is_local(r) && !force {
                return Ok(r.clone());
            }
        }
        let start = index as u64 * cs;
        let len = current.as_ref().map_or_else(|| size.saturating_sub(start).min(cs), |r| r.len as u64);
        let key = match &obj.source {
            Some(_) => obj.key.clone(),
            None => t.objects.home().key(&obj.key),
        };
        let data = t.objects.get_range(obj.source.as_deref(), &key, obj.etag.as_deref(), start, start + len)?;
        if data.len() as u64 != len {
            return Err(FsError::Object(crate::objects::ObjectError::Changed {
                key,
                etag: format!("{} bytes where {len} were expected", data.len()),
            }));
        }
        let crcs: Vec<u32> = data.chunks(BLOCK_SIZE as usize).map(crc32c::crc32c).collect();
        if let Some(r) = &current {
            if !r.block_crcs.is_empty() && r.block_crcs != crcs {
                tracing::error!(ino, chunk = index, %key, "object bytes do not match the sealed checksums; refused");
                return Err(FsError::Corrupt { ino, offset: start });
            }
        }
        if let Err(e) = file.write_all_at(&data, start) {
            // A disk full of other backed chunks makes room for this one.
            if e.raw_os_error() != Some(libc::ENOSPC) || self.evict_until(t, t.cfg.evict_low)? == 0 {
                return Err(FsError::io("write fetched chunk", e));
            }
            file.write_all_at(&data, start).map_err(|e| FsError::io("write fetched chunk", e))?;
        }
        if file.metadata().map_err(|e| FsError::io("stat backing file", e))?.len() < size {
            file.set_len(size).map_err(|e| FsError::io("size backing file", e))?;
        }
        // Recorded as here only once it is on stable storage.
        file.sync_data().map_err(|e| FsError::io("sync fetched chunk", e))?;
        let version = current.as_ref().map(|r| r.version);
        self.ns.record_fetched(ino, index, version, len as u32, &crcs)?;
        t.stats.fetched_bytes.fetch_add(len, Ordering::Relaxed);
        tracing::debug!(ino, chunk = index, bytes = len, "fetched from the object store");
        Ok(ChunkRecord {
            version: version.unwrap_or(1),
            len: len as u32,
            replicas: vec![self.node_id().to_string()],
            block_crcs: crcs,
        })
    }

    /// Bytes `[from, to)` of a chunk this node holds, read block-aligned and verified.
    fn read_local(&self, ino: Ino, oi: &OpenInode, part: &Part<'_>, out: &mut Vec<u8>) -> FsResult<()> {
        let (start, stop) = part.blocks();
        let mut buf = vec![0u8; (stop - start) as usize];
        read_exact_at(&oi.file, &mut buf, start).map_err(|e| FsError::io("read backing file", e))?;
        if let Err(e) = remote::verify(ino, part.rec, part.chunk_start, start, &buf) {
            if let FsError::Corrupt { offset, .. } = &e {
                self.stats.corrupt_blocks.fetch_add(1, Ordering::Relaxed);
                tracing::error!(ino, offset, "checksum mismatch reading local chunk; returning EIO");
            }
            return Err(e);
        }
        out.extend_from_slice(&buf[(part.from - start) as usize..(part.to - start) as usize]);
        Ok(())
    }

    /// Bytes `[from, to)` of a chunk whose local copy failed its checksum,
    /// from another replica (verified); the good blocks are written over the
    /// bad local ones.
    fn repair_from_peer(&self, ino: Ino, oi: &OpenInode, part: &Part<'_>, out: &mut Vec<u8>) -> FsResult<()> {
        let cluster = self.cluster.get().expect("checked by the caller");
        let (start, stop) = part.blocks();
        let (rec, chunk_start, from, to) = (part.rec, part.chunk_start, part.from, part.to);
        let task = remote::fetch(cluster, ino, Arc::new(rec.clone()), chunk_start, start, (stop - start) as u32);
        let data = remote::wait(cluster, task)?;
        match oi.file.write_all_at(&data, start) {
            Ok(()) => {
                tracing::warn!(ino, offset = start, len = data.len(), "repaired a corrupt local range from a replica")
            }
            Err(e) => tracing::warn!(ino, error = %e, "could not repair a corrupt local range"),
        }
        out.extend_from_slice(&data[(from - start) as usize..(to - start) as usize]);
        Ok(())
    }

    /// The peer windows covering `[offset, end)` (and readahead beyond).
    fn remote_windows(
        &self,
        ino: Ino,
        oi: &OpenInode,
        layout: &Layout,
        offset: u64,
        end: u64,
    ) -> Vec<(u64, Arc<remote::Window>)> {
        let cluster = self.cluster.get().expect("a chunk held elsewhere implies a cluster");
        let cs = layout.chunk_size;
        let locate = |start: u64| {
            let index = start / cs;
            let rec = layout.chunks.get(index as usize)?.clone()?;
            (!self.is_local(&rec) && !rec.replicas.is_empty()).then_some((rec, index * cs))
        };
        oi.readahead.lock().windows(cluster, ino, offset, end, layout.size, &locate)
    }

    /// The layout of a sealed file open here, loaded once per open.
    fn layout(&self, ino: Ino, oi: &OpenInode) -> FsResult<Arc<Layout>> {
        if let Some(l) = oi.state.lock().layout.clone() {
            return Ok(l);
        }
        let inode = self.ns.getattr(ino)?;
        let mut chunks: Vec<Option<Arc<ChunkRecord>>> = Vec::new();
        for (index, record) in self.ns.chunks(ino)? {
            let index = index as usize;
            if chunks.len() <= index {
                chunks.resize(index + 1, None);
            }
            chunks[index] = Some(Arc::new(record));
        }
        let object = self.backed_object(ino)?.map(Arc::new);
        let layout = Arc::new(Layout { size: inode.size, chunk_size: inode.chunk_size.max(1) as u64, chunks, object });
        let mut st = oi.state.lock();
        st.layout = Some(layout.clone());
        *oi.readahead.lock() = Readahead::default();
        Ok(layout)
    }

    pub fn write(&self, fh: u64, offset: u64, data: &[u8]) -> FsResult<u32> {
        let (_, writable, oi) = self.handle(fh)?;
        if !writable {
            return Err(FsError::io("write", std::io::Error::from_raw_os_error(libc::EBADF)));
        }
        if let Err(e) = oi.file.write_all_at(data, offset) {
            // A disk full of backed data makes room instead of failing.
            let t = self.tier.get().filter(|_| e.raw_os_error() == Some(libc::ENOSPC));
            let freed = match t {
                Some(t) => self.evict_until(t, t.cfg.evict_low)?,
                None => 0,
            };
            if freed == 0 {
                return Err(FsError::io("write backing file", e));
            }
            oi.file.write_all_at(data, offset).map_err(|e| FsError::io("write backing file", e))?;
        }
        let chunk_size = self.ns.chunk_size();
        oi.state.lock().dirty.add(chunk_range(offset, data.len() as u64, chunk_size));
        self.stats.written_bytes.fetch_add(data.len() as u64, Ordering::Relaxed);
        Ok(data.len() as u32)
    }

    pub fn fallocate(&self, fh: u64, offset: u64, length: u64, mode: i32) -> FsResult<()> {
        let (_, writable, oi) = self.handle(fh)?;
        if !writable {
            return Err(FsError::io("fallocate", std::io::Error::from_raw_os_error(libc::EBADF)));
        }
        let allowed = libc::FALLOC_FL_KEEP_SIZE | libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_ZERO_RANGE;
        if mode & !allowed != 0 {
            return Err(FsError::NotSupported("fallocate mode"));
        }
        // SAFETY: plain syscall on an fd we own.
        let rc = unsafe { libc::fallocate(oi.file.as_raw_fd(), mode, offset as i64, length as i64) };
        if rc != 0 {
            return Err(FsError::io("fallocate backing file", std::io::Error::last_os_error()));
        }
        oi.state.lock().dirty.add(chunk_range(offset, length, self.ns.chunk_size()));
        Ok(())
    }

    pub fn lseek(&self, fh: u64, offset: i64, whence: i32) -> FsResult<i64> {
        let (_, _, oi) = self.handle(fh)?;
        // SAFETY: lseek on our own fd; the backing file's offset is never used for I/O.
        let rc = unsafe { libc::lseek(oi.file.as_raw_fd(), offset, whence) };
        if rc < 0 {
            return Err(FsError::io("lseek backing file", std::io::Error::last_os_error()));
        }
        Ok(rc)
    }

    /// fsync / fdatasync: data on stable storage, then size and mtime (and
    /// every earlier namespace change) in a durable metadata commit. In a
    /// cluster the file is published too: checksummed, replicated and its
    /// layout recorded, so it survives the loss of this node.
    pub fn fsync(&self, fh: u64, datasync: bool) -> FsResult<()> {
        let (ino, _, oi) = self.handle(fh)?;
        let r = if datasync { oi.file.sync_data() } else { oi.file.sync_all() };
        r.map_err(|e| FsError::io("fsync backing file", e))?;
        if self.cluster.get().is_some() {
            // A durable seal carries every earlier namespace change; only
            // when there was nothing to publish is a separate sync needed.
            if !self.publish(ino, &oi, Durability::Durable)? {
                self.ns.sync()?;
            }
            return Ok(());
        }
        let unsealed = oi.state.lock().unsealed;
        if unsealed {
            let (size, mtime) = stamp(&oi.file)?;
            let seal = Seal { size, mtime, chunks: Vec::new(), keep_unsealed: true };
            self.ns.seal(ino, &seal, Durability::Durable)?;
        } else {
            self.ns.sync()?;
        }
        Ok(())
    }

    /// close(2) of a handle (FUSE flush). In a cluster a writer's close publishes the
    /// file before close returns (close-to-open across nodes); returns
    /// false when there is nothing to do here, so the kernel may stop asking.
    pub fn close(&self, fh: u64) -> FsResult<bool> {
        if self.cluster.get().is_none() {
            return Ok(false);
        }
        let (ino, writable, oi) = self.handle(fh)?;
        if writable {
            self.publish(ino, &oi, Durability::Buffered)?;
        }
        Ok(true)
    }

    /// Seal what a writer has written so far without giving up the write
    /// lease: checksums, replicas (per the durability mode) and layout. A
    /// file unchanged since the last publish costs one stat. Returns whether
    /// it committed a seal.
    fn publish(&self, ino: Ino, oi: &OpenInode, d: Durability) -> FsResult<bool> {
        let mut st = oi.state.lock();
        if !st.unsealed || st.orphaned {
            return Ok(false);
        }
        let now = stamp(&oi.file)?;
        if st.published == Some(now) || (st.created_here && now.0 == 0) {
            return Ok(false);
        }
        let inode = self.ns.getattr(ino)?;
        let dirty = std::mem::replace(&mut st.dirty, if self.passthrough() { Dirty::All } else { Dirty::None });
        match self.seal_file(&inode, &oi.file, &dirty, true, d) {
            Ok(_) => {
                st.published = Some(now);
                Ok(true)
            }
            Err(e) => {
                st.dirty = Dirty::All;
                Err(e)
            }
        }
    }

    pub fn release(&self, fh: u64) -> FsResult<()> {
        let Some((_, h)) = self.handles.remove(&fh) else {
            return Err(FsError::BadHandle(fh));
        };
        let Some(oi) = self.open.get(&h.ino).map(|e| e.clone()) else {
            return Ok(());
        };
        let mut result = Ok(());
        if h.writable {
            // The state lock is held across the seal: a writer opening now
            // waits, then finds the file sealed and marks it unsealed again,
            // so the unsealed mark is never dropped under a live writer.
            let mut st = oi.state.lock();
            st.writers -= 1;
            if st.writers == 0 && st.unsealed && !st.orphaned {
                // Published at close and unchanged since: only the mark goes.
                let unchanged = st.published.is_some() && stamp(&oi.file).ok() == st.published;
                let dirty = if unchanged { Dirty::None } else { std::mem::take(&mut st.dirty) };
                let backing_empty = oi.file.metadata().is_ok_and(|m| m.len() == 0);
                result = if st.created_here && backing_empty {
                    // Created here and never written: recorded with size 0
                    // at create, nothing to read back or checksum.
                    self.unseal_later.lock().push(h.ino);
                    Ok(())
                } else {
                    self.ns.getattr(h.ino).map_err(FsError::from).and_then(|inode| {
                        if inode.size == 0 && backing_empty {
                            self.unseal_later.lock().push(h.ino);
                            return Ok(());
                        }
                        self.seal_file(&inode, &oi.file, &dirty, false, Durability::Buffered).map(|_| ())
                    })
                };
                if result.is_ok() {
                    st.unsealed = false;
                    st.layout = None;
                    st.published = None;
                    st.created_here = false;
                    // Under the state lock: an attribute read that finds the
                    // file sealed also finds the epoch moved.
                    self.seal_epoch.fetch_add(1, Ordering::SeqCst);
                    self.seal_stripes[h.ino as usize % SEAL_STRIPES].fetch_add(1, Ordering::SeqCst);
                } else {
                    // Still unsealed in the metadata: the next mount re-seals it.
                    st.dirty = Dirty::All;
                }
            }
        }
        let mut purge = false;
        self.open.remove_if(&h.ino, |_, oi| {
            let mut st = oi.state.lock();
            st.opens -= 1;
            match h.io {
                Io::Passthrough => st.passthrough_handles -= 1,
                Io::Cached => st.cached_handles -= 1,
                Io::Direct => {}
            }
            purge = st.opens == 0 && st.orphaned;
            st.opens == 0
        });
        if purge {
            self.purge(h.ino)?;
        }
        result
    }

    /// Compute checksums for the dirty chunks of `inode` from `file` and
    /// record them with the size and mtime the backing file has. This node
    /// is the primary of every chunk it seals; in a cluster the other
    /// replicas are written before the record (durability=replicated) or
    /// after it, in the background (durability=local). A chunk whose bytes
    /// did not change keeps its record, version and replicas.
    fn seal_file(
        &self,
        inode: &Inode,
        file: &File,
        dirty: &Dirty,
        keep_unsealed: bool,
        d: Durability,
    ) -> FsResult<Inode> {
        let md = file.metadata().map_err(|e| FsError::io("stat backing file", e))?;
        let size = md.len();
        let cs = inode.chunk_size.max(1) as u64;
        let nchunks = size.div_ceil(cs) as u32;
        let which: Vec<u32> = match dirty {
            Dirty::All => (0..nchunks).collect(),
            Dirty::Chunks(set) => set.iter().copied().filter(|c| *c < nchunks).collect(),
            Dirty::None => Vec::new(),
        };
        let old: std::collections::HashMap<u32, ChunkRecord> =
            if which.is_empty() { Default::default() } else { self.ns.chunks(inode.ino)?.into_iter().collect() };
        let cluster = self.cluster.get();
        let want = match cluster {
            Some(c) if !which.is_empty() => {
                self.ns.replicas_policy(inode.ino)?.unwrap_or(c.default_replicas()).max(1) as usize
            }
            _ => 1,
        };
        let replicate_now = cluster.filter(|c| want > 1 && c.durability() == DurabilityMode::Replicated);
        let mut short = false;
        let mut chunks: Vec<(u32, ChunkRecord)> = Vec::with_capacity(which.len());
        // Replica writes in flight (position in `chunks`, task): the next
        // chunk is read and checksummed while earlier ones cross the network.
        let mut inflight = std::collections::VecDeque::new();
        let land = |chunks: &mut Vec<(u32, ChunkRecord)>, (at, task): (usize, tokio::task::JoinHandle<Vec<String>>)| {
            let c = replicate_now.expect("only replicating chunks are in flight");
            let copies = c.block_on(task).unwrap_or_default();
            let (index, record) = &mut chunks[at];
            if copies.len() + 1 < want {
                tracing::warn!(
                    ino = inode.ino,
                    chunk = *index,
                    copies = copies.len() + 1,
                    want,
                    "chunk under-replicated: too few peers answered"
                );
            }
            record.replicas.extend(copies);
        };
        for index in which {
            let start = index as u64 * cs;
            let len = (size - start).min(cs);
            // Bytes that go to peers are read once, and checksummed as sent.
            let data = match replicate_now {
                Some(_) => {
                    let mut data = vec![0u8; len as usize];
                    read_exact_at(file, &mut data, start).map_err(|e| FsError::io("read chunk to replicate", e))?;
                    Some(data)
                }
                None => None,
            };
            let block_crcs = match &data {
                Some(data) => data.chunks(BLOCK_SIZE as usize).map(crc32c::crc32c).collect(),
                None => block_crcs(file, start, len).map_err(|e| FsError::io("checksum backing file", e))?,
            };
            let previous = old.get(&index);
            if let Some(o) = previous {
                if o.len as u64 == len && o.block_crcs == block_crcs && o.replicas.iter().any(|r| r == self.node_id()) {
                    short |= o.replicas.len() < want;
                    continue;
                }
            }
            let record = ChunkRecord {
                version: previous.map_or(1, |o| o.version + 1),
                len: len as u32,
                replicas: vec![self.node_id().to_string()],
                block_crcs,
            };
            if let (Some(c), Some(data)) = (replicate_now, data) {
                let ranked = c.plan(inode.ino, index, &record.replicas);
                let last = start + len == size;
                let push = c.clone().push(inode.ino, index, start, Arc::new(data), last, want - 1, ranked);
                inflight.push_back((chunks.len(), c.spawn(push)));
            }
            chunks.push((index, record));
            while inflight.len() >= REPLICATION_WINDOW {
                land(&mut chunks, inflight.pop_front().expect("not empty"));
            }
        }
        while let Some(f) = inflight.pop_front() {
            land(&mut chunks, f);
        }
        short |= chunks.iter().any(|(_, r)| r.replicas.len() < want);
        let seal = Seal { size, mtime: ts_from(md.mtime(), md.mtime_nsec()), chunks, keep_unsealed };
        let sealed = self.ns.seal(inode.ino, &seal, d)?;
        self.stats.seals.fetch_add(1, Ordering::Relaxed);
        if let Some(t) = self.tier.get() {
            t.enqueue(inode.ino, t.cfg.backfill_delay);
        }
        if short {
            self.under_replicated.0.lock().insert(inode.ino);
            self.under_replicated.1.notify_one();
        }
        Ok(sealed)
    }

    /// The replicator loop: give under-replicated files the copies their
    /// policy asks for (durability=local writes, peers that did not answer,
    /// files re-sealed at mount).
    pub fn run_replicator(core: std::sync::Weak<Core>) {
        loop {
            let Some(c) = core.upgrade() else { return };
            let batch = {
                let mut q = c.under_replicated.0.lock();
                if q.is_empty() || c.cluster.get().is_none() {
                    c.under_replicated.1.wait_for(&mut q, Duration::from_secs(1));
                }
                if c.cluster.get().is_none() {
                    continue;
                }
                std::mem::take(&mut *q)
            };
            for ino in batch {
                // A file still being written here is done at its next seal.
                if c.open.get(&ino).is_some_and(|oi| oi.state.lock().unsealed) {
                    continue;
                }
                let done = c.replicate_file(ino).unwrap_or_else(|e| {
                    tracing::warn!(ino, error = %e, "background replication failed; retrying later");
                    false
                });
                if !done {
                    // Too few live peers, or a failure: try again later.
                    c.under_replicated.0.lock().insert(ino);
                    drop(c);
                    std::thread::sleep(Duration::from_secs(5));
                    break;
                }
            }
        }
    }

    /// Copy the chunks of `ino` that this node is primary of to more peers,
    /// until each has as many copies as its policy asks. Returns whether
    /// every chunk has them.
    fn replicate_file(&self, ino: Ino) -> FsResult<bool> {
        self.replicate_file_to(ino, None)
    }

    /// [`Core::replicate_file`] to `copies` copies instead of the policy's,
    /// pushing every chunk this node holds (not only those it is primary of):
    /// staging with `--replicas`.
    pub(crate) fn replicate_file_to(&self, ino: Ino, copies: Option<usize>) -> FsResult<bool> {
        let Some(cluster) = self.cluster.get() else { return Ok(true) };
        let inode = match self.ns.getattr(ino) {
            Ok(i) => i,
            Err(MetaError::NotFound) => return Ok(true),
            Err(e) => return Err(e.into()),
        };
        let want = match copies {
            Some(n) => n.max(1),
            None => self.ns.replicas_policy(ino)?.unwrap_or(cluster.default_replicas()).max(1) as usize,
        };
        let cs = inode.chunk_size.max(1) as u64;
        let file = match File::open(self.store.path(ino)) {
            Ok(f) => f,
            Err(_) => return Ok(true),
        };
        let mut short = false;
        for (index, rec) in self.ns.chunks(ino)? {
            let ours = match copies {
                Some(_) => self.is_local(&rec),
                None => rec.replicas.first().map(String::as_str) == Some(self.node_id()),
            };
            if rec.replicas.len() >= want || !ours {
                continue;
            }
            let start = index as u64 * cs;
            let mut data = vec![0u8; rec.len as usize];
            read_exact_at(&file, &mut data, start).map_err(|e| FsError::io("read chunk to replicate", e))?;
            if remote::verify(ino, &rec, start, start, &data).is_err() {
                // Changed since this record was sealed: a newer seal follows.
                continue;
            }
            let last = start + rec.len as u64 >= inode.size;
            let missing = want - rec.replicas.len();
            let ranked = cluster.plan(ino, index, &rec.replicas);
            let copies =
                cluster.block_on(cluster.clone().push(ino, index, start, Arc::new(data), last, missing, ranked));
            short |= rec.replicas.len() + copies.len() < want;
            if !copies.is_empty() {
                self.ns.add_replicas(ino, index, rec.version, &copies)?;
                tracing::debug!(ino, chunk = index, ?copies, "replicated in the background");
            }
        }
        Ok(!short)
    }

    pub fn statfs(&self) -> FsResult<libc::statvfs> {
        let path = std::ffi::CString::new(self.cfg.data_dir.as_os_str().as_encoded_bytes())
            .map_err(|_| FsError::Invalid("data dir path has a NUL byte"))?;
        // SAFETY: statvfs fills the struct we pass.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        if unsafe { libc::statvfs(path.as_ptr(), &mut st) } != 0 {
            return Err(FsError::io("statvfs data dir", std::io::Error::last_os_error()));
        }
        Ok(st)
    }

    /// Flush the namespace to stable storage (unmount).
    pub fn shutdown(&self) {
        // Spares not used by a regular file would be strays at the next mount.
        *self.spares_stopped.lock() = true;
        for (ino, _) in std::mem::take(&mut *self.spares.lock()) {
            let unused = match self.ns.getattr(ino) {
                Err(MetaError::NotFound) => true,
                Ok(inode) => inode.kind != FileKind::Regular,
                Err(_) => false,
            };
            if unused {
                let _ = self.store.remove(ino);
            }
        }
        if let Err(e) = self.ns.sync().map_err(FsError::from).and_then(|()| self.flush()) {
            tracing::error!(error = %e, "final metadata sync failed");
        }
    }
}

fn stamp(file: &File) -> FsResult<Stamp> {
    let md = file.metadata().map_err(|e| FsError::io("stat backing file", e))?;
    Ok((md.len(), ts_from(md.mtime(), md.mtime_nsec())))
}

fn set_file_times(file: &File, inode: &Inode) -> FsResult<()> {
    let times = [
        libc::timespec { tv_sec: inode.atime.sec, tv_nsec: inode.atime.nsec as i64 },
        libc::timespec { tv_sec: inode.mtime.sec, tv_nsec: inode.mtime.nsec as i64 },
    ];
    // SAFETY: futimens on our own fd with a two-element array.
    if unsafe { libc::futimens(file.as_raw_fd(), times.as_ptr()) } != 0 {
        return Err(FsError::io("set backing file times", std::io::Error::last_os_error()));
    }
    Ok(())
}
