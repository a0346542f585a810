//! `Namespace`: the filesystem's metadata over a [`KvEngine`].
//!
//! Each namespace operation (in `ops/`) is one transaction run through
//! [`Namespace::write`], which retries on conflict. This layer knows nothing
//! of FUSE or of file data: callers pass plain values and get [`Inode`]s back.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::{MetaError, MetaResult};
use crate::kv::{Durability, KvEngine, KvError, KvRead, KvWrite, Pairs};
use crate::schema;
use crate::types::*;

/// How many inode numbers one allocation reserves; fewer round trips to the
/// engine, and with etcd fewer conflicts on the counter between nodes.
/// Numbers lost in a crash are never reused, which u64 can afford.
const INO_BATCH: u64 = 1 << 16;
pub(crate) const MAX_ATTEMPTS: u32 = 64;
/// How long an operation on a shared store waits for it when it does not
/// answer, unless the mount says otherwise (`--meta-op-wait`).
pub const DEFAULT_UNANSWERED_WAIT: Duration = Duration::from_secs(300);
/// The longest pause between two tries of a store that did not answer (a
/// try that found it unreachable fails at once; one that waited out the
/// engine's deadline needs no pause).
const UNANSWERED_PAUSE_MAX: Duration = Duration::from_secs(1);
pub const LINK_MAX: u32 = 65_000;

pub struct Namespace {
    pub(crate) kv: Arc<dyn KvEngine>,
    next_ino: Mutex<(Ino, Ino)>,
    chunk_size: u32,
    /// Set by buffered commits, cleared by `sync`: lets a periodic flusher
    /// skip idle volumes.
    unsynced: AtomicBool,
    /// Called when the engine reports a full disk; returns true when it
    /// freed space (the data dir's reserve) so the transaction may retry.
    on_no_space: OnceLock<Box<dyn Fn() -> bool + Send + Sync>>,
    /// Namespace changes acknowledged before they commit (`--nowsync`): the
    /// engine's deferring layer, in front of the node cache.
    pub(crate) deferred: Option<Arc<crate::kv_deferred::DeferredKv>>,
    /// How this node has another give up a directory's delegation (a
    /// peer call, installed by the daemon; see [`Namespace::set_recall_handler`]).
    /// Unset (tools that only read, tests without peers), delegations are
    /// not asked about: what is committed is what is read.
    recall: OnceLock<Box<RecallHandler>>,
    /// This node's id: the value of the unsealed (write lease) and orphan
    /// marks it writes, so that in a cluster each node recovers only its own.
    pub(crate) node: String,
    /// Several nodes share the engine (it has membership): marks written by
    /// another node belong to it. On a single node every mark is ours, even
    /// when the node id changed between mounts.
    pub(crate) clustered: bool,
    /// Files are backfilled to an object store: seals mark them dirty.
    pub(crate) tiered: bool,
    /// The volume's id (key `F`), and whether this open created the volume.
    volume_id: String,
    created: bool,
    /// Tokens of sync-pending marks: a clear after a sync drops only the
    /// mark of the seal it synced for.
    pub(crate) sync_tokens: std::sync::atomic::AtomicU64,
    /// Whether this node may have sync-pending marks to look for: set at
    /// open (a crash leaves them) and by seals that write one.
    pub(crate) sync_marks: AtomicBool,
    /// Holder-index entries of purged files, dropped by the next flush
    /// (`ops/holders.rs`). A leaf lock: taken alone, never across a
    /// transaction.
    pub(crate) unindexed: Mutex<Vec<Vec<u8>>>,
    /// Milliseconds an operation on a shared store tries it again while it
    /// does not answer ([`Namespace::set_unanswered_wait`]; zero from the
    /// unmount on, [`Namespace::stop_waiting`]).
    unanswered_wait_ms: AtomicU64,
}

/// What one operation has met so far: conflicts (the engine answered that
/// another writer got there first) are counted against [`MAX_ATTEMPTS`];
/// a shared store that does not answer is tried again until the
/// namespace's wait has passed since the operation began.
struct Tries {
    began: Instant,
    conflicts: u32,
    unanswered: u32,
}

impl Tries {
    fn new() -> Self {
        Tries { began: Instant::now(), conflicts: 0, unanswered: 0 }
    }
}

/// Has node `holder` commit what it acknowledged in directory `dir` and
/// give the delegation up (or, found dead, takes it over): returns a
/// revision at or after which the engine holds the directory's changes.
pub type RecallHandler = dyn Fn(&Namespace, Ino, &str) -> MetaResult<i64> + Send + Sync;

pub(crate) fn encode<T: Serialize>(v: &T) -> Vec<u8> {
    postcard::to_allocvec(v).expect("metadata records always serialize")
}

pub(crate) fn decode<T: DeserializeOwned>(key: &[u8], bytes: &[u8]) -> MetaResult<T> {
    postcard::from_bytes(bytes)
        .map_err(|e| MetaError::Corrupt { key: String::from_utf8_lossy(key).into_owned(), msg: e.to_string() })
}

pub(crate) fn check_name(name: &[u8]) -> MetaResult<()> {
    if name.len() > NAME_MAX {
        return Err(MetaError::NameTooLong);
    }
    if name.is_empty() || name == b"." || name == b".." || name.contains(&b'/') || name.contains(&0) {
        return Err(MetaError::Invalid("not a valid file name"));
    }
    Ok(())
}

/// Reads shared by read-only and read-write transactions.
pub(crate) fn get_inode(txn: &mut (impl KvRead + ?Sized), ino: Ino) -> MetaResult<Inode> {
    let key = schema::inode(ino);
    match txn.get(&key)? {
        Some(v) => decode(&key, &v),
        None => Err(MetaError::NotFound),
    }
}

pub(crate) fn get_dentry(txn: &mut (impl KvRead + ?Sized), parent: Ino, name: &[u8]) -> MetaResult<Option<Dentry>> {
    let key = schema::dentry(parent, name);
    match txn.get(&key)? {
        Some(v) => Ok(Some(decode(&key, &v)?)),
        None => Ok(None),
    }
}

pub(crate) fn put_inode(txn: &mut (impl KvWrite + ?Sized), inode: &Inode) {
    txn.put(&schema::inode(inode.ino), &encode(inode));
}

pub(crate) fn put_dentry(txn: &mut (impl KvWrite + ?Sized), parent: Ino, name: &[u8], d: &Dentry) {
    txn.put(&schema::dentry(parent, name), &encode(d));
}

/// A directory inode, or ENOTDIR.
pub(crate) fn get_dir(txn: &mut (impl KvRead + ?Sized), ino: Ino) -> MetaResult<Inode> {
    let inode = get_inode(txn, ino)?;
    if !inode.is_dir() {
        return Err(MetaError::NotDir);
    }
    Ok(inode)
}

pub(crate) fn dir_is_empty(txn: &mut (impl KvRead + ?Sized), ino: Ino) -> MetaResult<bool> {
    let (s, e) = schema::prefix_range(&schema::dentries_of(ino));
    Ok(txn.scan(&s, &e, 1)?.is_empty())
}

/// Every key under `prefix`, fetched in pages so no single read is huge.
pub(crate) fn scan_all(txn: &mut (impl KvRead + ?Sized), prefix: &[u8]) -> MetaResult<Vec<(Vec<u8>, Vec<u8>)>> {
    scan_paged(txn, prefix, 1024)
}

/// [`scan_all`] with a page size for large records (chunk records carry a
/// checksum per block: a page must stay well under etcd's message limits).
/// A volume-wide prefix of records keyed by inode is read in windows of
/// inode numbers ([`for_each_page_by_ino`]).
pub(crate) fn scan_paged(
    txn: &mut (impl KvRead + ?Sized),
    prefix: &[u8],
    page_size: usize,
) -> MetaResult<Vec<(Vec<u8>, Vec<u8>)>> {
    let page_size = page_size.max(1);
    if schema::is_inode_keyed_prefix(prefix) {
        let mut out = Vec::new();
        let read = |start: &[u8], end: &[u8], limit| Ok(txn.scan(start, end, limit)?);
        for_each_page_by_ino(read, prefix, page_size, |page| {
            out.extend(page);
            Ok(())
        })?;
        return Ok(out);
    }
    let (mut start, end) = schema::prefix_range(prefix);
    let mut out = Vec::new();
    loop {
        let page = txn.scan(&start, &end, page_size)?;
        let full = page.len() == page_size;
        if let Some((last, _)) = page.last() {
            start = last.clone();
            start.push(0);
        }
        out.extend(page);
        if !full {
            return Ok(out);
        }
    }
}

/// Read every key under `prefix`, whose next 8 bytes are an inode number,
/// a page of at most `limit` keys per read, handing each page to `f`. etcd
/// counts every key of the range a request names, whatever its limit, so
/// pages of one open-ended range over a million records would cost a
/// million steps each. The first read asks for the whole prefix: a short
/// page ends it (the few marks of a flush, one request as before). After a
/// full one the reads ask for windows of inode numbers, up to the volume's
/// inode bound (read with the same `read`: the `N` key); a window that
/// filled a page is halved for the next read, one that did not is doubled,
/// so each read's range holds about a page.
pub(crate) fn for_each_page_by_ino(
    mut read: impl FnMut(&[u8], &[u8], usize) -> MetaResult<Pairs>,
    prefix: &[u8],
    limit: usize,
    mut f: impl FnMut(Pairs) -> MetaResult<()>,
) -> MetaResult<()> {
    let limit = limit.max(1);
    let (start, end) = schema::prefix_range(prefix);
    let page = read(&start, &end, limit)?;
    let full = page.len() == limit;
    let last = page.last().map(|(k, _)| k.clone());
    f(page)?;
    let Some(mut last) = last.filter(|_| full) else { return Ok(()) };
    let ino_of = |key: &[u8]| {
        key.get(prefix.len()..prefix.len() + 8).map(|b| Ino::from_be_bytes(b.try_into().expect("8 bytes")))
    };
    let Some(last_ino) = ino_of(&last) else { return Ok(()) };
    let bound_key = [schema::NEXT_INO, &[0][..]].concat();
    let bound = match read(schema::NEXT_INO, &bound_key, 1)?.first() {
        Some((_, v)) => decode_bound(v)?,
        None => u64::MAX,
    };
    // Keys past the bound (none a volume gives out): read to the end.
    let below = if last_ino < bound { bound } else { u64::MAX };
    last.push(0);
    windows_from(read, prefix, last, last_ino, below, limit, f)
}

/// The volume's inode bound as `txn` reads it (see [`Namespace::inode_bound`]).
fn inode_bound_in(txn: &mut (impl KvRead + ?Sized)) -> MetaResult<Ino> {
    match txn.get(schema::NEXT_INO)? {
        Some(v) => decode_bound(&v),
        None => Ok(ROOT_INO + 1),
    }
}

/// The value of the `N` key: the next unallocated inode number.
fn decode_bound(v: &[u8]) -> MetaResult<Ino> {
    let bytes =
        v.try_into().map_err(|_| MetaError::Corrupt { key: "N".into(), msg: "next inode is not 8 bytes".into() })?;
    Ok(u64::from_be_bytes(bytes))
}

/// The keys under `prefix` of the inodes in `inos` (`u64::MAX` as the end:
/// to the end of the prefix), a window of inode numbers a read (see
/// [`for_each_page_by_ino`]).
pub(crate) fn for_each_page_in_inos(
    read: impl FnMut(&[u8], &[u8], usize) -> MetaResult<Pairs>,
    prefix: &[u8],
    inos: std::ops::Range<Ino>,
    limit: usize,
    f: impl FnMut(Pairs) -> MetaResult<()>,
) -> MetaResult<()> {
    let start = [prefix, &inos.start.to_be_bytes()[..]].concat();
    windows_from(read, prefix, start, inos.start, inos.end, limit, f)
}

/// Pages from key `start` (of inode `window_ino`) up to inode `below`
/// (`u64::MAX`: the end of the prefix), in windows of inode numbers.
fn windows_from(
    mut read: impl FnMut(&[u8], &[u8], usize) -> MetaResult<Pairs>,
    prefix: &[u8],
    mut start: Vec<u8>,
    mut window_ino: Ino,
    below: Ino,
    limit: usize,
    mut f: impl FnMut(Pairs) -> MetaResult<()>,
) -> MetaResult<()> {
    let key_at = |ino: Ino| [prefix, &ino.to_be_bytes()[..]].concat();
    let (_, prefix_end) = schema::prefix_range(prefix);
    let limit = limit.max(1);
    let mut span = 1024u64;
    loop {
        let (end, last_window) = match window_ino.checked_add(span) {
            Some(ino) if ino < below => (key_at(ino), false),
            _ if below == u64::MAX => (prefix_end.clone(), true),
            _ => (key_at(below), true),
        };
        let page = read(&start, &end, limit)?;
        let full = page.len() == limit;
        let last = page.last().map(|(k, _)| k.clone());
        f(page)?;
        match last {
            Some(mut last) if full => {
                // More in this window: go on from the last key, in a
                // window half as wide from its inode on.
                if let Some(ino) = last.get(prefix.len()..prefix.len() + 8) {
                    window_ino = Ino::from_be_bytes(ino.try_into().expect("8 bytes"));
                }
                span = (span / 2).max(1);
                last.push(0);
                start = last;
            }
            _ if last_window => return Ok(()),
            _ => {
                start = end;
                window_ino += span;
                span = span.saturating_mul(2);
            }
        }
    }
}

/// Whether the engine holds a volume yet (read without creating one).
pub fn volume_exists(kv: &dyn KvEngine) -> MetaResult<bool> {
    Ok(kv.read_txn()?.get(schema::VOLUME)?.is_some())
}

impl Namespace {
    /// Open the namespace, creating the volume and its root directory on first use.
    pub fn open(kv: Arc<dyn KvEngine>, root_uid: u32, root_gid: u32) -> MetaResult<Self> {
        let clustered = kv.membership().is_some();
        let mut ns = Namespace {
            kv,
            next_ino: Mutex::new((0, 0)),
            chunk_size: DEFAULT_CHUNK_SIZE,
            unsynced: AtomicBool::new(false),
            // Distinct across mounts too: marks left by a crashed daemon never match.
            sync_tokens: std::sync::atomic::AtomicU64::new(Timespec::now().sec as u64 * 1_000_000_000),
            sync_marks: AtomicBool::new(true),
            on_no_space: OnceLock::new(),
            deferred: None,
            recall: OnceLock::new(),
            node: String::new(),
            clustered,
            unindexed: Mutex::new(Vec::new()),
            unanswered_wait_ms: AtomicU64::new(DEFAULT_UNANSWERED_WAIT.as_millis() as u64),
            tiered: false,
            volume_id: String::new(),
            created: false,
        };
        let fresh_id = random_id();
        let (volume, volume_id, created) = ns.write(Durability::Durable, |txn| {
            // Volumes made before ids existed get one at their next open.
            let id = match txn.get(schema::VOLUME_ID)? {
                Some(id) => String::from_utf8_lossy(&id).into_owned(),
                None => {
                    txn.put(schema::VOLUME_ID, fresh_id.as_bytes());
                    fresh_id.clone()
                }
            };
            if let Some(v) = txn.get(schema::VOLUME)? {
                return Ok((decode::<VolumeRecord>(schema::VOLUME, &v)?, id, false));
            }
            let now = Timespec::now();
            let volume = VolumeRecord { format_version: FORMAT_VERSION, chunk_size: DEFAULT_CHUNK_SIZE, created: now };
            txn.put(schema::VOLUME, &encode(&volume));
            txn.put(schema::NEXT_INO, &(ROOT_INO + 1).to_be_bytes());
            let root = Inode {
                ino: ROOT_INO,
                kind: FileKind::Directory,
                perm: 0o755,
                uid: root_uid,
                gid: root_gid,
                nlink: 2,
                size: 0,
                atime: now,
                mtime: now,
                ctime: now,
                rdev: 0,
                parent: ROOT_INO,
                name: Vec::new(),
                chunk_size: 0,
                target: None,
            };
            put_inode(txn, &root);
            Ok((volume, id, true))
        })?;
        if volume.format_version == FORMAT_BEFORE_HOLDER_INDEX {
            ns.build_holder_index(&volume)?;
        } else if volume.format_version != FORMAT_VERSION {
            return Err(MetaError::Corrupt {
                key: "V".into(),
                msg: format!("volume format {} is not supported (want {FORMAT_VERSION})", volume.format_version),
            });
        }
        ns.chunk_size = volume.chunk_size;
        ns.volume_id = volume_id;
        ns.created = created;
        Ok(ns)
    }

    /// The volume's id: random, made with the volume, never changed.
    pub fn volume_id(&self) -> &str {
        &self.volume_id
    }

    /// Whether this open created the volume (the metadata held none).
    pub fn created_volume(&self) -> bool {
        self.created
    }

    /// Whether the volume has known node `id`: it registered once, or a
    /// chunk record names it as a holder.
    pub fn knows_node(&self, id: &str) -> MetaResult<bool> {
        let registered = self.read(|txn| Ok(txn.get(&schema::known_node(id))?.is_some()))?;
        Ok(registered || self.chunks_naming(id)? > 0)
    }

    /// Name the node this namespace acts for (see [`Namespace::node`]).
    pub fn with_node(mut self, node: &str) -> Self {
        self.node = node.to_string();
        self
    }

    /// Acknowledge changes in the directories this node makes before they
    /// commit (`--nowsync`): `deferred` is the engine this namespace runs
    /// on, seen as its deferring layer.
    pub fn with_nowsync(mut self, deferred: Arc<crate::kv_deferred::DeferredKv>) -> Self {
        self.deferred = Some(deferred);
        self
    }

    /// Whether this node acknowledges changes before they commit.
    pub fn nowsync(&self) -> bool {
        self.deferred.is_some()
    }

    /// Install how this node recalls another node's directory delegation (once).
    pub fn set_recall_handler(&self, f: impl Fn(&Namespace, Ino, &str) -> MetaResult<i64> + Send + Sync + 'static) {
        let _ = self.recall.set(Box::new(f));
    }

    /// Directory `ino`, or ENOTDIR; and when another node holds its
    /// delegation, [`MetaError::Delegated`] (the callers' retry loops
    /// recall it and run again).
    pub(crate) fn dir_in(&self, txn: &mut (impl KvRead + ?Sized), ino: Ino) -> MetaResult<Inode> {
        let dir = get_dir(txn, ino)?;
        if self.clustered && self.recall.get().is_some() {
            if let Some(holder) = txn.get(&schema::delegation(ino))? {
                if holder != self.node.as_bytes() {
                    return Err(MetaError::Delegated { dir: ino, holder: String::from_utf8_lossy(&holder).into() });
                }
            }
        }
        Ok(dir)
    }

    /// Have the holder of `dir`'s delegation give it up, and stop trusting
    /// what this node cached of the directory from before.
    fn recall_dir(&self, dir: Ino, holder: &str) -> MetaResult<()> {
        let Some(recall) = self.recall.get() else {
            return Err(MetaError::Delegated { dir, holder: holder.into() });
        };
        tracing::debug!(dir, holder, "recalling a directory delegation");
        let rev = recall(self, dir, holder)?;
        self.kv.forget_below(
            &[schema::delegations(), schema::dentries_of(dir), schema::inode(dir), schema::xattrs_of(dir)],
            rev.max(1),
        );
        Ok(())
    }

    /// Give up this node's delegation of `dir` on another node's request:
    /// commit what was acknowledged there, drop the record. Returns a
    /// revision at or after which the engine holds it all.
    pub fn release_dir(&self, dir: Ino) -> MetaResult<i64> {
        if let Some(d) = &self.deferred {
            return Ok(d.release(dir)?);
        }
        // Not deferring (a daemon mounted since without --nowsync, or a
        // record left by a crash): nothing is queued here; drop the record.
        self.drop_delegation(dir, &self.node.clone())
    }

    /// Drop `dir`'s delegation record if node `holder` holds it (this node's
    /// own, or a dead node's found so by the caller): its unflushed changes
    /// died with it. Returns the commit's revision (or a read's, when the
    /// record was gone already).
    pub fn drop_delegation(&self, dir: Ino, holder: &str) -> MetaResult<i64> {
        let key = schema::delegation(dir);
        self.write(Durability::Buffered, |txn| {
            match txn.get(&key)? {
                Some(v) if v != holder.as_bytes() => {}
                // Deleted also when the read found none: a cache that had
                // not heard of the record yet fails the commit's compare,
                // and the retry reads the engine.
                _ => txn.delete(&key),
            }
            Ok(())
        })?;
        // A revision at or after the delete, from a read past the cache.
        let (_, versioned) = self.kv.fresh_read_txn()?.get_versioned(&key)?;
        Ok(versioned.map_or(0, |v| v.at))
    }

    /// Give up every delegation this node holds (unmount), committing what
    /// it acknowledged; and delegation records a crashed daemon of this node
    /// left (mount).
    pub fn release_delegations(&self) -> MetaResult<()> {
        if let Some(d) = &self.deferred {
            d.release_all()?;
        }
        if !self.clustered {
            return Ok(());
        }
        let mine: Vec<Ino> = self.read(|txn| {
            Ok(scan_all(txn, &schema::delegations())?
                .into_iter()
                .filter(|(_, v)| v == self.node.as_bytes())
                .map(|(k, _)| schema::key_ino(&k))
                .collect())
        })?;
        for dir in mine {
            self.release_dir(dir)?;
        }
        Ok(())
    }

    /// Commit every change this node acknowledged and has not committed.
    pub fn flush_deferred(&self) -> MetaResult<()> {
        match &self.deferred {
            Some(d) => Ok(d.flush_all()?),
            None => Ok(()),
        }
    }

    /// Whether `ino` is a file made here whose records only this node may
    /// change yet (made under `--nowsync` in a directory delegated here).
    pub fn is_deferred(&self, ino: Ino) -> bool {
        self.made_in(ino).is_some()
    }

    /// The writer of `ino` closed it: whether its publish may wait for the
    /// last release (see `DeferredKv::close_unpublished`); false when the
    /// close must publish before it returns.
    pub fn close_unpublished(&self, ino: Ino) -> bool {
        self.deferred.as_ref().is_some_and(|d| d.close_unpublished(ino))
    }

    /// The directory delegated here that `ino` was made in, while its
    /// records are this node's alone (see [`Namespace::is_deferred`]).
    pub fn made_in(&self, ino: Ino) -> Option<Ino> {
        self.deferred.as_ref().and_then(|d| d.made_in(ino))
    }

    /// The node holding `dir`'s delegation, as this node's cache knows it.
    pub fn delegate_of(&self, dir: Ino) -> MetaResult<Option<String>> {
        let v = self.read(|txn| Ok(txn.get(&schema::delegation(dir))?))?;
        Ok(v.map(|v| String::from_utf8_lossy(&v).into_owned()))
    }

    /// Changes acknowledged and not committed, directories delegated here,
    /// and changes dropped for a delegation lost (`status`).
    pub fn deferred_backlog(&self) -> Option<(usize, usize, u64)> {
        self.deferred.as_ref().map(|d| d.backlog())
    }

    /// Track every file's backfill state (the mount has an object store).
    pub fn with_tier(mut self) -> Self {
        self.tiered = true;
        self
    }

    pub fn node(&self) -> &str {
        &self.node
    }

    /// Whether a mark (unsealed or orphan) with this value was written by this node.
    pub(crate) fn is_mine(&self, mark: &[u8]) -> bool {
        !self.clustered || mark.is_empty() || mark == self.node.as_bytes()
    }

    /// Whether several nodes share the volume.
    pub fn is_clustered(&self) -> bool {
        self.clustered
    }

    /// Whether a node id recorded in the metadata is this node (always, on a single node).
    pub fn is_mine_node(&self, node: &str) -> bool {
        self.is_mine(node.as_bytes())
    }

    pub fn engine(&self) -> &dyn KvEngine {
        self.kv.as_ref()
    }

    pub fn chunk_size(&self) -> u32 {
        self.chunk_size
    }

    /// Run `f` as one read-write transaction, retrying on conflict.
    pub(crate) fn write<T>(
        &self,
        durability: Durability,
        f: impl FnMut(&mut dyn KvWrite) -> MetaResult<T>,
    ) -> MetaResult<T> {
        self.write_owning(durability, true, None, f)
    }

    /// [`Namespace::write`]; `own`: only this call's own attempts can make
    /// the change `f` records (false for a request the kernel sent again,
    /// which a dead daemon's commit may still make: then a change found
    /// made is not answered with this call's values). `unanswered`, when
    /// given, is set when the value returned is that of an attempt whose
    /// commit landed and whose answer was lost: nothing the answer carried
    /// (the records a range delete took) came back.
    pub(crate) fn write_owning<T>(
        &self,
        durability: Durability,
        own: bool,
        unanswered: Option<&std::cell::Cell<bool>>,
        f: impl FnMut(&mut dyn KvWrite) -> MetaResult<T>,
    ) -> MetaResult<T> {
        let kind = if durability == Durability::Durable { "write_durable" } else { "write" };
        crate::timed(kind, || self.write_untimed(durability, own, unanswered, f))
    }

    fn write_untimed<T>(
        &self,
        durability: Durability,
        own: bool,
        unanswered: Option<&std::cell::Cell<bool>>,
        mut f: impl FnMut(&mut dyn KvWrite) -> MetaResult<T>,
    ) -> MetaResult<T> {
        crate::held_locks::assert_none_held("a KV transaction");
        let (mut recalls, mut tries) = (0, Tries::new());
        let mut freed = false;
        // A durable change makes durable what was acknowledged before it
        // began (--nowsync), not what is acknowledged while it retries.
        let _durable = match (durability, &self.deferred) {
            (Durability::Durable, Some(deferred)) => Some(deferred.durable_change()),
            _ => None,
        };
        // What the last attempt whose commit may have landed (its answer
        // lost: a retryable engine error, not a conflict) returned. When
        // the next attempt finds that change made (`AlreadyMade`, see
        // `ops/answered.rs`), it is this attempt's result: the caller goes
        // on as after any commit (an orphan marked, a victim's chunks
        // dropped). Two such attempts in a row cannot both have landed (the
        // second compared what the first changed); the later one's value
        // stands for whichever did. Only when no one else can make the
        // change (`own`).
        let mut unsure: Option<T> = None;
        // What an attempt whose answer was lost wrote stays out of the
        // node's cache until this call returns (see `KvEngine::unsettled_scope`).
        let scope = self.kv.unsettled_scope();
        loop {
            // A transaction that cannot begin is answered as a failed commit
            // is: redb reopening its database after a disk-full error writes
            // before it reads, and a full disk then frees the reserve. Not
            // an attempt: `f` counts its own calls against MAX_ATTEMPTS.
            let mut txn = match self.kv.write_txn() {
                Ok(txn) => txn,
                Err(KvError::NoSpace) if !freed && self.free_space() => {
                    freed = true;
                    continue;
                }
                Err(e) if self.try_again(&e, &mut tries) => continue,
                Err(e) => return Err(e.into()),
            };
            if let Some(scope) = &scope {
                txn.settle_in(scope);
            }
            let result = match f(txn.as_mut()) {
                Ok(v) => {
                    if durability == Durability::Buffered {
                        self.unsynced.store(true, Ordering::Release);
                    }
                    match txn.commit(durability) {
                        Ok(()) => Ok(v),
                        Err(e) => {
                            if own && matches!(e, KvError::Backend { retryable: true, .. }) {
                                unsure = Some(v);
                            }
                            Err(MetaError::from(e))
                        }
                    }
                }
                Err(e) => Err(e),
            };
            match result {
                Err(MetaError::AlreadyMade { ino }) => {
                    let v = unsure.take().ok_or(MetaError::AlreadyMade { ino })?;
                    if let Some(u) = unanswered {
                        u.set(true);
                    }
                    return Ok(v);
                }
                Err(MetaError::Kv(KvError::NoSpace)) if !freed && self.free_space() => {
                    freed = true;
                }
                Err(MetaError::Delegated { dir, holder }) if recalls < MAX_ATTEMPTS => {
                    recalls += 1;
                    self.recall_dir(dir, &holder)?;
                }
                Err(MetaError::Kv(e)) if self.try_again(&e, &mut tries) => {}
                other => return other,
            }
        }
    }

    /// Whether an operation whose try failed with `e` tries again, after
    /// the pause this waits out. A conflict (the engine answered: another
    /// writer got there first): up to [`MAX_ATTEMPTS`] times. A shared
    /// store that did not answer: until the mount's wait
    /// ([`Namespace::set_unanswered_wait`]) has passed since the operation
    /// began, each try waiting out the engine's deadline or, refused at
    /// once, after a pause that grows from a millisecond to a second; never
    /// once the unmount began ([`Namespace::stop_waiting`]).
    /// The embedded engine's rare retryable error (a database reopened
    /// after a full disk) is tried again like a conflict.
    fn try_again(&self, e: &KvError, tries: &mut Tries) -> bool {
        let conflict = matches!(e, KvError::Conflict) || !self.clustered;
        if !e.is_retryable() {
            return false;
        }
        if conflict {
            if tries.conflicts >= MAX_ATTEMPTS {
                return false;
            }
            tries.conflicts += 1;
            tracing::debug!(attempt = tries.conflicts, "metadata transaction conflict, retrying");
            std::thread::sleep(Duration::from_micros(100 << tries.conflicts.min(10)));
            return true;
        }
        let wait = Duration::from_millis(self.unanswered_wait_ms.load(Ordering::Relaxed));
        let waited = tries.began.elapsed();
        if waited >= wait {
            tracing::warn!(
                waited_s = waited.as_secs_f64(),
                tries = tries.unanswered + 1,
                error = %e,
                "the metadata service did not answer within the operation's wait (--meta-op-wait; none at unmount); it fails"
            );
            return false;
        }
        if tries.unanswered == 0 {
            tracing::debug!(error = %e, wait_s = wait.as_secs_f64(), "the metadata service did not answer; trying again");
        }
        let pause =
            Duration::from_millis(1 << (2 * tries.unanswered.min(5))).min(UNANSWERED_PAUSE_MAX).min(wait - waited);
        tries.unanswered += 1;
        std::thread::sleep(pause);
        true
    }

    /// How long an operation tries a shared store again while it does not
    /// answer before it fails (`--meta-op-wait`; [`DEFAULT_UNANSWERED_WAIT`]).
    /// Zero: one try.
    pub fn set_unanswered_wait(&self, wait: Duration) {
        self.unanswered_wait_ms.store(wait.as_millis().min(u64::MAX as u128) as u64, Ordering::Relaxed);
    }

    /// The node is stopping: from now on an operation the shared store
    /// does not answer fails at its first try (a wait of zero). What an
    /// unmount still has to record is asked for once; what the store
    /// cannot take is recovered at the next mount.
    pub fn stop_waiting(&self) {
        self.set_unanswered_wait(Duration::ZERO);
    }

    /// Install what to do when the engine's disk is full (once).
    pub fn set_no_space_handler(&self, f: impl Fn() -> bool + Send + Sync + 'static) {
        let _ = self.on_no_space.set(Box::new(f));
    }

    fn free_space(&self) -> bool {
        self.on_no_space.get().is_some_and(|f| f())
    }

    /// Run `f` against a consistent read view; on a shared store that does
    /// not answer, again on a fresh one while the mount's wait lasts (see
    /// [`Namespace::try_again`]).
    pub(crate) fn read<T>(&self, mut f: impl FnMut(&mut dyn KvRead) -> MetaResult<T>) -> MetaResult<T> {
        let mut tries = Tries::new();
        loop {
            match self.read_once(&mut f) {
                Err(MetaError::Kv(e)) if self.clustered && e.is_unanswered() && self.try_again(&e, &mut tries) => {}
                other => return other,
            }
        }
    }

    /// [`Namespace::read`], tried once: an engine that does not answer is
    /// an error at its deadline.
    pub(crate) fn read_once<T>(&self, f: impl FnOnce(&mut dyn KvRead) -> MetaResult<T>) -> MetaResult<T> {
        crate::held_locks::assert_none_held("a KV read");
        crate::timed("read", || {
            // See `write_untimed`: a read view can need the disk too.
            let mut txn = match self.kv.read_txn() {
                Err(KvError::NoSpace) if self.free_space() => self.kv.read_txn()?,
                txn => txn?,
            };
            f(txn.as_mut())
        })
    }

    /// [`Namespace::read`], run again after recalling a directory
    /// delegation it met (see [`Namespace::dir_in`]).
    pub(crate) fn read_in_dirs<T>(&self, mut f: impl FnMut(&mut dyn KvRead) -> MetaResult<T>) -> MetaResult<T> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            match self.read(&mut f) {
                Err(MetaError::Delegated { dir, holder }) if attempt < MAX_ATTEMPTS => {
                    self.recall_dir(dir, &holder)?;
                }
                other => return other,
            }
        }
    }

    /// A fresh inode number. Numbers are never reused, so generation stays 0.
    pub(crate) fn alloc_ino(&self) -> MetaResult<Ino> {
        let mut range = self.next_ino.lock();
        if range.0 == range.1 {
            let start = self.write(Durability::Durable, |txn| {
                let cur = inode_bound_in(txn)?;
                txn.put(schema::NEXT_INO, &(cur + INO_BATCH).to_be_bytes());
                Ok(cur)
            })?;
            *range = (start, start + INO_BATCH);
        }
        let ino = range.0;
        range.0 += 1;
        Ok(ino)
    }

    /// Every inode number given out so far is below this (the volume's
    /// next unallocated range).
    pub fn inode_bound(&self) -> MetaResult<Ino> {
        inode_bound_in(self.kv.fresh_read_txn()?.as_mut())
    }

    /// Up to `n` inode numbers this namespace will hand out next, from the
    /// range it already holds: lets the daemon create their backing files
    /// ahead of time, off the create path.
    pub fn upcoming_inos(&self, n: u64) -> std::ops::Range<Ino> {
        let range = self.next_ino.lock();
        range.0..range.0.saturating_add(n).min(range.1)
    }

    /// Make every namespace change so far durable (fsync, fsyncdir, unmount).
    pub fn sync(&self) -> MetaResult<()> {
        self.unsynced.store(false, Ordering::Release);
        let mut r = crate::timed("sync", || self.kv.sync());
        if matches!(r, Err(KvError::NoSpace)) && self.free_space() {
            r = crate::timed("sync", || self.kv.sync());
        }
        if let Err(e) = r {
            self.unsynced.store(true, Ordering::Release);
            return Err(e.into());
        }
        Ok(())
    }

    /// `sync`, but only when a buffered commit happened since the last one.
    /// Returns whether it synced.
    pub fn sync_if_dirty(&self) -> MetaResult<bool> {
        if !self.unsynced.load(Ordering::Acquire) {
            return Ok(false);
        }
        self.sync().map(|()| true)
    }
}

/// 128 random bits as hex, from the kernel's generator.
fn random_id() -> String {
    let mut b = [0u8; 16];
    // SAFETY: getrandom(2) into a buffer of its length.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n != b.len() as isize {
        // Not expected on Linux ≥ 3.17; time and pid still tell volumes apart.
        let t = Timespec::now();
        b[..8].copy_from_slice(&(t.sec as u64).to_be_bytes());
        b[8..12].copy_from_slice(&t.nsec.to_be_bytes());
        b[12..].copy_from_slice(&std::process::id().to_be_bytes());
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pages read in windows of inode numbers hand back every key once, in
    /// order, however sparse the inode numbers (node-local ranges are far
    /// apart) and however many keys one inode has; and no read's range
    /// holds many more keys than a page, which is what etcd counts.
    #[test]
    fn pages_by_inode_window_read_every_key_once_and_ranges_stay_small() {
        let mut keys = std::collections::BTreeMap::new();
        let mut inos = vec![1u64, 2, 3, 500, 70_000, 1 << 40, (1 << 40) + 1, u64::MAX - 1, u64::MAX];
        inos.extend((1..2000u64).map(|i| i << 39));
        for &ino in &inos {
            let per = if ino == 70_000 { 100 } else { 2 };
            for i in 0u32..per {
                keys.insert([&b"C"[..], &ino.to_be_bytes(), &i.to_be_bytes()].concat(), Vec::new());
            }
        }
        keys.insert(b"D".to_vec(), Vec::new()); // past the prefix

        // Fewer keys than a page: one read.
        let mut reads = 0;
        let few = |_: &[u8], _: &[u8], _: usize| -> MetaResult<Pairs> {
            reads += 1;
            Ok(vec![(b"S1".to_vec(), Vec::new())])
        };
        for_each_page_by_ino(few, b"S", 16, |_| Ok(())).unwrap();
        assert_eq!(reads, 1, "a short first page ends the scan");
        for limit in [1, 7, 64] {
            let mut seen = Vec::new();
            let mut widest = 0;
            let read = |start: &[u8], end: &[u8], limit: usize| -> MetaResult<Pairs> {
                let in_range =
                    keys.range::<[u8], _>((std::ops::Bound::Included(start), std::ops::Bound::Excluded(end)));
                widest = widest.max(in_range.clone().count());
                Ok(in_range.take(limit).map(|(k, v)| (k.clone(), v.clone())).collect())
            };
            for_each_page_in_inos(read, b"C", 0..u64::MAX, limit, |page| {
                seen.extend(page.into_iter().map(|(k, _)| k));
                Ok(())
            })
            .unwrap();
            let want: Vec<Vec<u8>> = keys.keys().filter(|k| k[0] == b'C').cloned().collect();
            assert_eq!(seen, want, "limit {limit}");
            // From the prefix's start: one open read first, then windows.
            let (mut again, mut reads, mut widest_after) = (Vec::new(), 0, 0);
            let read = |start: &[u8], end: &[u8], limit: usize| -> MetaResult<Pairs> {
                let in_range =
                    keys.range::<[u8], _>((std::ops::Bound::Included(start), std::ops::Bound::Excluded(end)));
                if reads > 0 {
                    widest_after = widest_after.max(in_range.clone().count());
                }
                reads += 1;
                Ok(in_range.take(limit).map(|(k, v)| (k.clone(), v.clone())).collect())
            };
            for_each_page_by_ino(read, b"C", limit, |page| {
                again.extend(page.into_iter().map(|(k, _)| k));
                Ok(())
            })
            .unwrap();
            assert_eq!(again, want, "limit {limit}: from the start");
            assert!(widest_after <= 100 + limit * 8, "limit {limit}: a read's range held {widest_after} keys");
            // Of 4,100 keys: the one inode of 100 is one window at the least.
            assert!(widest <= 100 + limit * 8, "limit {limit}: a read's range held {widest} keys");
        }
    }
}
