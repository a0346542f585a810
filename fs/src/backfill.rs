//! Backfill: every closed file that has been quiet for the backfill delay
//! is uploaded to the object store as one object at `<prefix>/<path>`.
//!
//! The state of each file lives in its tier record (`T` key) and moves
//! dirty → uploading → backed, with re-keying after a rename; this module
//! owns the in-memory work queue, the retry backoff while the store is
//! down, and the counters `converged status` and the metrics show. It never
//! holds file data beyond one part in flight.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use converged_metadata::types::{FileKind, Ino, TierRecord, TierState, Timespec, BLOCK_SIZE};
use converged_metadata::{ChunkRecord, MetaError, UploadEnd};
use parking_lot::{Condvar, Mutex};

use crate::core::Core;
use crate::error::{FsError, FsResult};
use crate::objects::{ObjectError, ObjectTier};

/// How the object tier behaves (mount options).
#[derive(Debug, Clone)]
pub struct TierConfig {
    /// A file must be quiet (no seal) this long before it is uploaded.
    pub backfill_delay: Duration,
    /// Keep the object when its file is deleted.
    pub keep_deleted: bool,
    /// Evict backed chunks when the data disk is fuller than this fraction...
    pub evict_high: f64,
    /// ... until it is below this one.
    pub evict_low: f64,
    /// Files uploaded at once.
    pub workers: usize,
}

/// The longest object key S3, GCS and Azure accept, in bytes.
const MAX_KEY_BYTES: usize = 1024;

/// Longest wait between retries while the object store is unreachable.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// Work for the backfill workers.
#[derive(Default)]
struct Queue {
    /// Files to look at, by when.
    due: BTreeSet<(Instant, Ino)>,
    when: HashMap<Ino, Instant>,
    /// A directory was renamed: walk the renamed directories recorded in
    /// the metadata and mark every backed file below them re-keying.
    walk_renamed: bool,
    /// Files a worker holds now.
    busy: HashSet<Ino>,
    /// While the store fails: no upload starts before this.
    backoff_until: Option<Instant>,
    backoff: Duration,
    last_error: Option<String>,
    stopped: bool,
}

impl Queue {
    fn push(&mut self, ino: Ino, at: Instant) {
        if let Some(old) = self.when.get(&ino) {
            if *old <= at {
                return;
            }
            self.due.remove(&(*old, ino));
        }
        self.when.insert(ino, at);
        self.due.insert((at, ino));
    }

    fn pop_due(&mut self, now: Instant) -> Option<Ino> {
        let found = self.due.iter().find(|(at, ino)| *at <= now && !self.busy.contains(ino)).copied();
        let (at, ino) = found?;
        self.due.remove(&(at, ino));
        self.when.remove(&ino);
        self.busy.insert(ino);
        Some(ino)
    }
}

/// When membership was last looked at for dead nodes, when their work was
/// last scanned for, and which dead nodes that scan covered.
#[derive(Default)]
struct Adoption {
    looked: Option<Instant>,
    scanned: Option<Instant>,
    handled: BTreeSet<String>,
    /// The last scan found dead nodes' work (taken here or not).
    pending: bool,
}

/// How often membership is read for newly dead nodes.
const ADOPT_LOOK: Duration = Duration::from_secs(5);
/// How often the tier records are scanned again while the last scan found
/// dead nodes' work (what rendezvous gave to other nodes, or what a scan
/// run while the live set was changing left).
const ADOPT_RESCAN: Duration = Duration::from_secs(60);

/// Counters for `converged status` and the metrics endpoint.
#[derive(Default)]
pub struct Stats {
    pub uploaded_files: AtomicU64,
    pub uploaded_bytes: AtomicU64,
    pub failures: AtomicU64,
    pub rekeyed: AtomicU64,
    pub deleted: AtomicU64,
    pub fetched_bytes: AtomicU64,
    pub evicted_bytes: AtomicU64,
}

/// The object tier as the core uses it: the store, the backfill queue and counters.
pub struct Tiering {
    pub objects: ObjectTier,
    pub cfg: TierConfig,
    queue: Mutex<Queue>,
    wake: Condvar,
    pub stats: Stats,
    /// One fetch of a chunk at a time.
    pub(crate) fetching: dashmap::DashMap<(Ino, u32), Arc<Mutex<()>>>,
    /// Last read of each chunk (seconds since the epoch), for eviction.
    pub(crate) access: dashmap::DashMap<(Ino, u32), i64>,
    /// When each imported file's object was last checked for a change.
    pub(crate) checked: dashmap::DashMap<Ino, i64>,
    /// Taking over dead nodes' backfill (see `adopt_if_nodes_died`).
    adopted: Mutex<Adoption>,
}

/// A one-line view of the backlog.
#[derive(Debug, Clone)]
pub struct Backlog {
    pub files: usize,
    pub retry_in: Option<Duration>,
    pub last_error: Option<String>,
}

impl Tiering {
    pub fn new(objects: ObjectTier, cfg: TierConfig) -> Self {
        Tiering {
            objects,
            cfg,
            queue: Mutex::default(),
            wake: Condvar::new(),
            stats: Stats::default(),
            fetching: Default::default(),
            access: Default::default(),
            checked: Default::default(),
            adopted: Mutex::default(),
        }
    }

    /// Look at `ino` after the backfill delay (a seal, a rename).
    pub fn enqueue(&self, ino: Ino, after: Duration) {
        self.queue.lock().push(ino, Instant::now() + after);
        self.wake.notify_one();
    }

    /// A directory was renamed (its mark is in the metadata).
    pub fn walk_renamed_dirs(&self) {
        self.queue.lock().walk_renamed = true;
        self.wake.notify_one();
    }

    pub fn backlog(&self) -> Backlog {
        let q = self.queue.lock();
        let now = Instant::now();
        Backlog {
            files: q.due.len() + q.busy.len(),
            retry_in: q.backoff_until.filter(|t| *t > now).map(|t| t - now),
            last_error: q.last_error.clone(),
        }
    }

    pub fn stop(&self) {
        self.queue.lock().stopped = true;
        self.wake.notify_all();
    }

    pub fn touch(&self, ino: Ino, index: u32) {
        self.access.insert((ino, index), Timespec::now().sec);
    }

    fn failed(&self, e: &ObjectError) {
        self.stats.failures.fetch_add(1, Ordering::Relaxed);
        let mut q = self.queue.lock();
        q.backoff = (q.backoff * 2).clamp(Duration::from_secs(1), MAX_BACKOFF);
        q.backoff_until = Some(Instant::now() + q.backoff);
        q.last_error = Some(e.to_string());
        tracing::warn!(error = %e, retry_in = ?q.backoff, "object store call failed; backlog kept, retrying later");
    }

    fn succeeded(&self) {
        let mut q = self.queue.lock();
        if q.backoff_until.is_some() {
            tracing::info!("object store reachable again; draining the backlog");
        }
        q.backoff = Duration::ZERO;
        q.backoff_until = None;
        q.last_error = None;
    }
}

/// What one look at a file decided.
enum Step {
    /// Nothing (more) to do for now.
    Done,
    /// Look again after this long.
    Later(Duration),
}

/// The object key of `ino` under the mount's prefix (its path), if it has a
/// reachable name that is valid UTF-8.
pub(crate) fn key_of(core: &Core, ino: Ino) -> FsResult<Option<String>> {
    let Some(names) = core.namespace().path_of(ino)? else { return Ok(None) };
    let mut parts = Vec::with_capacity(names.len());
    for n in names {
        match String::from_utf8(n) {
            Ok(s) => parts.push(s),
            Err(_) => return Ok(None),
        }
    }
    Ok(Some(parts.join("/")))
}

/// A path too long for a cloud store's object key stays on the SSDs (and
/// dirty, or re-keying, in its status) rather than failing the whole
/// backlog over and over. A `file://` store takes any path the local
/// filesystem does.
fn too_long(t: &Tiering, ino: Ino, rel: &str) -> bool {
    let home = t.objects.home();
    let full = home.key(rel);
    let over = full.len() > MAX_KEY_BYTES && !home.base.starts_with("file:");
    if over {
        tracing::warn!(ino, bytes = full.len(), "path too long for an object key (1024 bytes at most); not backfilled");
    }
    over
}

impl Core {
    /// Queue every file this node owes the object store (after a restart):
    /// dirty or half-uploaded files, re-keys a crash interrupted.
    pub fn resume_backfill(&self) -> FsResult<()> {
        let Some(t) = self.tiering() else { return Ok(()) };
        let mut n = 0;
        for (ino, rec) in self.namespace().tier_records(true)? {
            if rec.state != TierState::Backed {
                t.enqueue(ino, self.quiet_left(&rec));
                n += 1;
            }
        }
        if n > 0 {
            tracing::info!(files = n, "resuming backfill");
        }
        // Directories renamed before a crash, not walked yet.
        t.walk_renamed_dirs();
        Ok(())
    }

    fn quiet_left(&self, rec: &TierRecord) -> Duration {
        let t = self.tiering().expect("only with a tier");
        let since = Timespec::now().sec.saturating_sub(rec.sealed_at.sec).max(0) as u64;
        t.cfg.backfill_delay.saturating_sub(Duration::from_secs(since))
    }

    /// One step of a backfill worker: take the next due file off the queue
    /// (waiting for one at most a second) and move it one state forward;
    /// every 2 s, delete objects of removed files and adopt dead nodes'
    /// work. Returns `None` once the tier has stopped.
    pub(crate) fn backfill_step(&self, last_garbage: &mut Instant) -> Option<String> {
        let t = self.tiering().cloned()?;
        let work = {
            let mut q = t.queue.lock();
            if q.stopped {
                return None;
            }
            let now = Instant::now();
            let held = q.backoff_until.is_some_and(|u| u > now);
            let job = if held {
                None
            } else if std::mem::take(&mut q.walk_renamed) {
                Some(Err(()))
            } else {
                q.pop_due(now).map(Ok)
            };
            if job.is_none() {
                let next = q.due.iter().next().map(|(at, _)| *at);
                let until = [next, q.backoff_until].into_iter().flatten().min();
                let wait = until.map_or(Duration::from_secs(1), |u| u.saturating_duration_since(now));
                t.wake.wait_for(&mut q, wait.clamp(Duration::from_millis(10), Duration::from_secs(1)));
            }
            job
        };
        let mut did = String::new();
        match work {
            Some(Ok(ino)) => {
                let step = self.backfill_file(&t, ino);
                let mut q = t.queue.lock();
                q.busy.remove(&ino);
                match step {
                    Ok(Step::Done) => did = format!("inode {ino} done"),
                    Ok(Step::Later(after)) => q.push(ino, Instant::now() + after),
                    Err(e) => {
                        tracing::warn!(ino, error = %e, "backfill step failed; retrying later");
                        did = format!("inode {ino} failed: {e}");
                        q.push(ino, Instant::now() + Duration::from_secs(5));
                    }
                }
            }
            Some(Err(())) => {
                did = "walked renamed directories".into();
                if let Err(e) = self.walk_renamed(&t) {
                    tracing::warn!(error = %e, "could not walk renamed directories for re-keying; retrying later");
                    std::thread::sleep(Duration::from_secs(1));
                    t.walk_renamed_dirs();
                }
            }
            None => {}
        }
        if last_garbage.elapsed() >= Duration::from_secs(2) && t.backlog().retry_in.is_none() {
            *last_garbage = Instant::now();
            if let Err(e) = self.collect_garbage(&t) {
                tracing::warn!(error = %e, "deleting objects of removed files failed; retrying later");
            }
            self.adopt_if_nodes_died(&t);
        }
        Some(did)
    }

    /// A node that dies leaves its dirty files un-uploaded (it sealed them)
    /// and its renamed directories un-walked. When a node is newly seen
    /// dead (and once a minute while the last scan found any such work),
    /// each live node takes over the work that rendezvous hashing gives
    /// it; the uploads read the bytes from the replicas. A node that stays
    /// dead with nothing left costs no further scans.
    fn adopt_if_nodes_died(&self, t: &Tiering) {
        let Some(cluster) = self.cluster() else { return };
        let dead = {
            let mut a = t.adopted.lock();
            if a.looked.is_some_and(|at| at.elapsed() < ADOPT_LOOK) {
                return;
            }
            a.looked = Some(Instant::now());
            let dead = match cluster.dead_nodes() {
                Ok(d) => d,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read cluster membership to take over dead nodes' backfill");
                    return;
                }
            };
            if dead.is_empty() {
                a.handled.clear();
                return;
            }
            let again = a.pending && a.scanned.is_none_or(|at| at.elapsed() >= ADOPT_RESCAN);
            let due = !dead.is_subset(&a.handled) || again;
            if !due {
                return;
            }
            dead
        };
        match self.adopt_work_of(t, cluster, &dead) {
            Ok((taken, seen)) => {
                if taken > 0 {
                    tracing::info!(files = taken, dead = ?dead, "took over the backfill of dead nodes");
                }
                let mut a = t.adopted.lock();
                a.handled = dead;
                a.scanned = Some(Instant::now());
                a.pending = seen > 0;
            }
            Err(e) => tracing::warn!(error = %e, "taking over dead nodes' backfill failed; retrying later"),
        }
    }

    /// Take the dirty or re-keying files and the renamed directories of
    /// `dead` nodes that fall to this node. Returns how many were taken
    /// here, and how many were found.
    fn adopt_work_of(
        &self,
        t: &Tiering,
        cluster: &crate::cluster::Cluster,
        dead: &BTreeSet<String>,
    ) -> FsResult<(usize, usize)> {
        let ns = self.namespace();
        let (mut taken, mut seen) = (0, 0);
        for (ino, rec) in ns.tier_records(false)? {
            if rec.state == TierState::Backed || !dead.contains(&rec.node) {
                continue;
            }
            seen += 1;
            if cluster.takes_over(ino) && ns.adopt_backfill(ino, &rec.node)? {
                t.enqueue(ino, self.quiet_left(&rec));
                taken += 1;
            }
        }
        for (dir, mark) in ns.renamed_dirs(false)? {
            if !dead.contains(&mark.node) {
                continue;
            }
            seen += 1;
            if cluster.takes_over(dir) && ns.adopt_renamed_dir(dir, &mark)? {
                t.walk_renamed_dirs();
                taken += 1;
            }
        }
        Ok((taken, seen))
    }

    /// Every backed file below a renamed directory is marked re-keying (its
    /// object key changed) and queued; then the directory's mark goes. A
    /// crash before that walks it again at the next mount, and files
    /// already marked resume as re-keying.
    fn walk_renamed(&self, t: &Tiering) -> FsResult<()> {
        let ns = self.namespace();
        for (dir, mark) in ns.renamed_dirs(true)? {
            let mut stack = vec![dir];
            let mut files = 0u64;
            while let Some(d) = stack.pop() {
                let entries = match ns.readdir(d) {
                    Ok(e) => e,
                    // Removed since: nothing below it has a key any more.
                    Err(MetaError::NotFound | MetaError::NotDir) => continue,
                    Err(e) => return Err(e.into()),
                };
                for (_, entry) in entries {
                    match entry.kind {
                        FileKind::Directory => stack.push(entry.ino),
                        FileKind::Regular if ns.begin_rekey(entry.ino)?.is_some() => {
                            t.enqueue(entry.ino, Duration::ZERO);
                            files += 1;
                        }
                        _ => {}
                    }
                }
            }
            ns.renamed_dir_walked(dir, &mark)?;
            tracing::debug!(dir, files, "renamed directory walked; its backed files re-key");
        }
        Ok(())
    }

    /// Move one file forward in its state machine.
    fn backfill_file(&self, t: &Tiering, ino: Ino) -> FsResult<Step> {
        let Some(rec) = self.namespace().tier(ino)? else { return Ok(Step::Done) };
        match rec.state {
            TierState::Dirty | TierState::Uploading => {
                if !self.namespace().is_mine_node(&rec.node) {
                    // Another node holds the bytes and uploads them.
                    return Ok(Step::Done);
                }
                let left = self.quiet_left(&rec);
                if !left.is_zero() {
                    return Ok(Step::Later(left));
                }
                if self.is_being_written(ino) {
                    // Its last close seals it and queues it again.
                    return Ok(Step::Done);
                }
                self.upload_file(t, ino)
            }
            TierState::ReKeying | TierState::Backed => self.rekey_file(t, ino, &rec),
        }
    }

    fn upload_file(&self, t: &Tiering, ino: Ino) -> FsResult<Step> {
        let ns = self.namespace();
        let Some(key) = key_of(self, ino)? else {
            tracing::debug!(ino, "no path to name the object after (unlinked or not UTF-8); not backfilled");
            return Ok(Step::Done);
        };
        if too_long(t, ino, &key) {
            return Ok(Step::Done);
        }
        let Some(rec) = ns.begin_upload(ino)? else { return Ok(Step::Done) };
        let inode = match ns.getattr(ino) {
            Ok(i) => i,
            Err(MetaError::NotFound) => return Ok(Step::Done),
            Err(e) => return Err(e.into()),
        };
        // Every chunk must be here: one evicted or held by a peer comes back first.
        let file = self.chunk_store().open_backing(ino)?;
        if let Err(e) = self.fetch_missing(ino, &file) {
            ns.abort_upload(ino, rec.generation)?;
            return Err(e);
        }
        let chunks: HashMap<u32, ChunkRecord> = ns.chunks(ino)?.into_iter().collect();
        let cs = inode.chunk_size.max(1) as u64;
        let check = |off: u64, buf: &[u8]| sealed_bytes(&chunks, cs, off, buf);
        let full = t.objects.home().key(&key);
        let started = Instant::now();
        match t.objects.upload(&full, &file, inode.size, &check) {
            Ok(etag) => {
                t.succeeded();
                match ns.end_upload(ino, rec.generation, &key, etag)? {
                    UploadEnd::Backed { stale } => {
                        t.stats.uploaded_files.fetch_add(1, Ordering::Relaxed);
                        t.stats.uploaded_bytes.fetch_add(inode.size, Ordering::Relaxed);
                        tracing::debug!(ino, key = %full, bytes = inode.size, took = ?started.elapsed(), "backed");
                        if let Some(old) = stale {
                            self.delete_object(t, &old);
                        }
                        // Renamed while uploading: the new name needs the object.
                        if key_of(self, ino)?.as_deref() != Some(key.as_str()) {
                            return Ok(Step::Later(Duration::ZERO));
                        }
                        Ok(Step::Done)
                    }
                    UploadEnd::Superseded => Ok(Step::Later(t.cfg.backfill_delay)),
                }
            }
            Err(e) => {
                ns.abort_upload(ino, rec.generation)?;
                match e {
                    // The file changed under the upload: its next seal queues it again.
                    ObjectError::Changed { .. } | ObjectError::Local(_) => {
                        tracing::debug!(ino, error = %e, "upload abandoned");
                        Ok(Step::Later(t.cfg.backfill_delay))
                    }
                    // The store refused or is down (a missing bucket may be
                    // created yet): the whole backlog backs off and retries.
                    _ => {
                        t.failed(&e);
                        Ok(Step::Later(Duration::ZERO))
                    }
                }
            }
        }
    }

    /// Copy a backed object to its file's current key and delete the old one.
    fn rekey_file(&self, t: &Tiering, ino: Ino, rec: &TierRecord) -> FsResult<Step> {
        if rec.source.is_some() {
            return Ok(Step::Done);
        }
        let Some(key) = key_of(self, ino)? else { return Ok(Step::Done) };
        if too_long(t, ino, &key) {
            return Ok(Step::Done);
        }
        if key == rec.key {
            if rec.state == TierState::ReKeying {
                self.namespace().end_rekey(ino, &rec.key, &key, rec.etag.clone())?;
            }
            return Ok(Step::Done);
        }
        let Some(rec) = self.namespace().begin_rekey(ino)? else { return Ok(Step::Done) };
        let home = t.objects.home();
        let (from, to) = (home.key(&rec.key), home.key(&key));
        match t.objects.copy(&from, &to) {
            Ok(etag) => {
                t.succeeded();
                if self.namespace().end_rekey(ino, &rec.key, &key, etag)? {
                    t.stats.rekeyed.fetch_add(1, Ordering::Relaxed);
                    self.delete_object(t, &rec.key);
                    tracing::debug!(ino, from = %from, to = %to, "re-keyed");
                }
                Ok(Step::Done)
            }
            Err(e) if e.is_retryable() => {
                t.failed(&e);
                Ok(Step::Later(Duration::ZERO))
            }
            Err(e) => {
                // The old object is gone (deleted behind our back): upload again.
                tracing::warn!(ino, error = %e, "re-key failed; the file will be uploaded again");
                Err(FsError::Peer(e.to_string()))
            }
        }
    }

    /// Whether a file of the namespace is now at the path `rel` names: its
    /// object is (or will be) that file's, and must not be deleted as stale.
    fn path_taken(&self, rel: &str) -> bool {
        let mut ino = converged_metadata::types::ROOT_INO;
        for part in rel.split('/') {
            match self.namespace().lookup(ino, part.as_bytes()) {
                Ok(i) => ino = i.ino,
                Err(_) => return false,
            }
        }
        true
    }

    fn delete_object(&self, t: &Tiering, rel: &str) {
        // A rename over a backed file, or a new file at an old name, owns the key now.
        if t.cfg.keep_deleted || self.path_taken(rel) {
            return;
        }
        match t.objects.delete(&t.objects.home().key(rel)) {
            Ok(()) => {
                t.stats.deleted.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => tracing::warn!(key = rel, error = %e, "could not delete a stale object"),
        }
    }

    /// Delete the objects of purged files (unless the mount keeps them).
    fn collect_garbage(&self, t: &Tiering) -> FsResult<()> {
        for (ino, g) in self.namespace().garbage()? {
            if !t.cfg.keep_deleted && g.source.is_none() && !self.path_taken(&g.key) {
                if let Err(e) = t.objects.delete(&t.objects.home().key(&g.key)) {
                    if e.is_retryable() {
                        t.failed(&e);
                        return Ok(());
                    }
                    tracing::warn!(key = %g.key, error = %e, "could not delete the object of a removed file");
                }
                t.stats.deleted.fetch_add(1, Ordering::Relaxed);
            }
            self.namespace().drop_garbage(ino)?;
        }
        Ok(())
    }
}

/// Whether `buf` (file bytes at `off`) is what the layout sealed: every
/// whole block matches its checksum. A block with no record is a hole.
fn sealed_bytes(chunks: &HashMap<u32, ChunkRecord>, cs: u64, off: u64, buf: &[u8]) -> bool {
    let bs = BLOCK_SIZE as u64;
    let mut pos = off;
    let end = off + buf.len() as u64;
    while pos < end {
        let index = (pos / cs) as u32;
        let in_chunk = pos - index as u64 * cs;
        let block = (in_chunk / bs) as usize;
        let block_end = (index as u64 * cs + (block as u64 + 1) * bs).min(end);
        let Some(rec) = chunks.get(&index) else {
            pos = block_end;
            continue;
        };
        let block_len = (rec.len as u64).saturating_sub(block as u64 * bs).min(bs);
        let data = &buf[(pos - off) as usize..(block_end - off) as usize];
        // Parts are block-aligned, so a block is never split between two parts.
        if in_chunk.is_multiple_of(bs) && data.len() as u64 == block_len {
            match rec.block_crcs.get(block) {
                Some(crc) if *crc == crc32c::crc32c(data) => {}
                _ => return false,
            }
        }
        pos = block_end;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sealed_bytes_checks_each_block() {
        let cs = 4 * BLOCK_SIZE as u64;
        let data: Vec<u8> = (0..cs as usize + 1000).map(|i| (i * 7 % 251) as u8).collect();
        let rec = |range: std::ops::Range<usize>| ChunkRecord {
            version: 1,
            len: range.len() as u32,
            replicas: vec![],
            block_crcs: data[range].chunks(BLOCK_SIZE as usize).map(crc32c::crc32c).collect(),
        };
        let chunks: HashMap<u32, ChunkRecord> =
            [(0, rec(0..cs as usize)), (1, rec(cs as usize..data.len()))].into_iter().collect();
        assert!(sealed_bytes(&chunks, cs, 0, &data));
        let half = 2 * BLOCK_SIZE as usize;
        assert!(sealed_bytes(&chunks, cs, half as u64, &data[half..]));
        let mut bad = data.clone();
        bad[cs as usize + 10] ^= 1;
        assert!(!sealed_bytes(&chunks, cs, 0, &bad));
        // A hole (no record) is not checked.
        let only_first: HashMap<u32, ChunkRecord> = [(0, rec(0..cs as usize))].into_iter().collect();
        assert!(sealed_bytes(&only_first, cs, 0, &bad));
    }

    #[test]
    fn queue_orders_by_due_time_and_skips_busy() {
        let mut q = Queue::default();
        let now = Instant::now();
        q.push(1, now + Duration::from_secs(10));
        q.push(2, now);
        q.push(1, now); // earlier wins
        assert_eq!(q.pop_due(now), Some(1));
        assert_eq!(q.pop_due(now), Some(2));
        assert_eq!(q.pop_due(now), None);
    }
}
