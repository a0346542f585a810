//! Backfill: every closed file that has been quiet for the backfill delay
//! is uploaded to the object store as one object at `<prefix>/<path>`.
//!
//! The state of each file lives in its tier record (`T` key) and moves
//! dirty → uploading → backed, with re-keying after a rename; this module
//! moves files through those states, taking them off the work queue that
//! `tier.rs` holds (with its retry backoff and counters). It never holds
//! file data beyond one part in flight.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use converged_metadata::types::{FileKind, Ino, TierRecord, TierState, Timespec, BLOCK_SIZE};
use converged_metadata::{ChunkRecord, MetaError, UploadEnd, UploadStart};

use crate::core::Core;
use crate::error::{FsError, FsResult};
use crate::objects::ObjectError;
use crate::tier::{Tiering, ADOPT_LOOK, ADOPT_RESCAN, MAX_KEY_BYTES};

/// How long an upload or re-key waits for another file to move its object
/// off the key it needs.
const KEY_BUSY_WAIT: Duration = Duration::from_secs(1);

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
    /// every 2 s at most, delete objects of removed files (after this
    /// node's purges, and at the safety read) and adopt dead nodes' work
    /// (after membership changes). Returns `None` once the tier has stopped.
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
                q.wait_for(&t.wake, wait.clamp(Duration::from_millis(10), Duration::from_secs(1)));
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
            if self.control().due(&mut t.garbage_since.lock()) {
                if let Err(e) = self.collect_garbage(&t) {
                    tracing::warn!(error = %e, "deleting objects of removed files failed; retrying later");
                    t.garbage_since.lock().retry();
                }
            }
            self.adopt_if_nodes_died(&t);
            self.rescan_if_asked(&t);
        }
        Some(did)
    }

    /// Queue this node's files to upload again when asked (`fsck --repair`
    /// marked files whose object is gone or wrong).
    fn rescan_if_asked(&self, t: &Tiering) {
        use std::sync::atomic::Ordering;
        if !self.control().due(&mut t.rescan_since.lock()) {
            return;
        }
        let asked = match converged_metadata::ops::nodes::backfill_rescan_requested(self.namespace().engine()) {
            Ok(n) => n,
            Err(e) => {
                tracing::debug!(error = %e, "cannot read backfill rescan requests");
                t.rescan_since.lock().retry();
                return;
            }
        };
        if asked > t.rescanned.load(Ordering::Relaxed) {
            t.rescanned.store(asked, Ordering::Relaxed);
            if let Err(e) = self.resume_backfill() {
                tracing::warn!(error = %e, "backfill rescan failed");
            }
        }
    }

    /// A node that dies leaves its dirty files un-uploaded (it sealed them)
    /// and its renamed directories un-walked. When a node is newly seen
    /// dead (and once a minute while the last scan found any such work),
    /// each live node takes over the work that rendezvous hashing gives
    /// it; the uploads read the bytes from the replicas. A node that stays
    /// dead with nothing left costs no further scans.
    fn adopt_if_nodes_died(&self, t: &Tiering) {
        let Some(cluster) = self.cluster() else { return };
        {
            let mut a = t.adopted.lock();
            if a.looked.is_some_and(|at| at.elapsed() < ADOPT_LOOK) {
                return;
            }
            // With no dead node's work outstanding, the member list is read
            // again only when it changed (or at the safety read).
            if !a.pending && !self.control().due(&mut t.members_since.lock()) {
                return;
            }
            a.looked = Some(Instant::now());
        }
        // Read with no lock held.
        let dead = match cluster.dead_nodes() {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read cluster membership to take over dead nodes' backfill");
                t.members_since.lock().retry();
                return;
            }
        };
        {
            let mut a = t.adopted.lock();
            if dead.is_empty() {
                a.handled.clear();
                return;
            }
            let again = a.pending && a.scanned.is_none_or(|at| at.elapsed() >= ADOPT_RESCAN);
            if dead.is_subset(&a.handled) && !again {
                return;
            }
        }
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
        let rec = match ns.begin_upload(ino, &key)? {
            UploadStart::Go(rec) => rec,
            UploadStart::Skip => return Ok(Step::Done),
            // A file renamed away from this key still has its object here:
            // its re-key moves it first.
            UploadStart::KeyBusy { owner } => {
                tracing::debug!(ino, owner, %key, "object key still owned by the file renamed from it; waiting");
                return Ok(Step::Later(KEY_BUSY_WAIT));
            }
        };
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

    /// Move a file's object to its current key (after a rename): claim the
    /// key, copy the object inside the store (up to the copy limit), or
    /// else upload the file again from its chunks (a larger object, or an
    /// imported one, which moves from its source bucket into the mount's
    /// store); then record the new key and delete the old object if no
    /// other file owns its key.
    fn rekey_file(&self, t: &Tiering, ino: Ino, rec: &TierRecord) -> FsResult<Step> {
        let ns = self.namespace();
        let Some(key) = key_of(self, ino)? else { return Ok(Step::Done) };
        if too_long(t, ino, &key) {
            return Ok(Step::Done);
        }
        if key == rec.key && rec.source.is_none() {
            if rec.state == TierState::ReKeying {
                ns.end_rekey(ino, &rec.key, None, &key, rec.etag.clone())?;
            }
            return Ok(Step::Done);
        }
        if rec.source.is_some() && rec.state == TierState::Backed {
            // An imported object at its source: nothing to move until renamed.
            return Ok(Step::Done);
        }
        let Some(rec) = ns.begin_rekey(ino)? else { return Ok(Step::Done) };
        if let Err(owner) = ns.claim_rekey(ino, &key)? {
            tracing::debug!(ino, owner, %key, "object key still owned by another file; waiting");
            return Ok(Step::Later(KEY_BUSY_WAIT));
        }
        let home = t.objects.home();
        let size = ns.getattr(ino)?.size;
        let (from, to) = (home.key(&rec.key), home.key(&key));
        let copied = match rec.source.is_none() && size <= t.cfg.copy_limit {
            true => t.objects.copy(&from, &to).map_err(FsError::from),
            false => self.upload_from_chunks(t, ino, &to, size),
        };
        match copied {
            Ok(etag) => {
                t.succeeded();
                let (recorded, free) = ns.end_rekey(ino, &rec.key, rec.source.as_deref(), &key, etag)?;
                if recorded {
                    t.stats.rekeyed.fetch_add(1, Ordering::Relaxed);
                    if free {
                        self.delete_object(t, &rec.key);
                    }
                    tracing::debug!(ino, from = %from, to = %to, imported = rec.source.is_some(), "re-keyed");
                }
                Ok(Step::Done)
            }
            Err(FsError::Object(e)) if e.is_retryable() => {
                t.failed(&e);
                Ok(Step::Later(Duration::ZERO))
            }
            Err(e) => {
                // The old object is gone (deleted behind our back): upload again.
                tracing::warn!(ino, error = %e, "re-key failed; the file will be uploaded again");
                Err(e)
            }
        }
    }

    /// Upload a file as the object `full_key` from its chunks, every one
    /// brought here first (from peers or its current object) and every part
    /// checked against the recorded checksums.
    fn upload_from_chunks(&self, t: &Tiering, ino: Ino, full_key: &str, size: u64) -> FsResult<Option<String>> {
        let ns = self.namespace();
        let file = self.chunk_store().open_backing(ino)?;
        self.fetch_missing(ino, &file)?;
        let cs = ns.getattr(ino)?.chunk_size.max(1) as u64;
        let chunks: HashMap<u32, ChunkRecord> = ns.chunks(ino)?.into_iter().collect();
        let check = |off: u64, buf: &[u8]| sealed_bytes(&chunks, cs, off, buf);
        Ok(t.objects.upload(full_key, &file, size, &check)?)
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

    /// Delete the objects of purged files (unless the mount keeps them, or
    /// another file owns the key now).
    fn collect_garbage(&self, t: &Tiering) -> FsResult<()> {
        for (ino, g) in self.namespace().garbage()? {
            let free = g.source.is_none() && self.namespace().release_garbage_key(ino, &g.key)?;
            if free && !t.cfg.keep_deleted && !self.path_taken(&g.key) {
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
}
