//! Crash recovery at mount, and the order in which things reach stable
//! storage: a file's bytes before the checksums that describe them, a
//! rename's new bytes before the old file's backing file goes, a purge
//! before the bytes it frees.
//!
//! A seal at close is committed buffered, with a sync-pending mark (`S`).
//! Any durable commit may carry it to disk before the bytes it describes,
//! and the mark goes with it: after a crash the file is re-sealed from what
//! the disk holds instead of failing its checksums. The flusher syncs the
//! backing files of marked seals, then drops their marks in its durable
//! commit; only then are purged backing files removed.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use converged_metadata::held_locks::Mutex;
use converged_metadata::types::*;
use converged_metadata::{Durability, MetaError, SessionEnd};
use parking_lot::Condvar;

use super::open::Claim;
use super::write::{Dirty, SealAs};
use super::Core;
use crate::chunkstore::ChunkStore;
use crate::error::{FsError, FsResult};

/// Purged data waiting for a flush that wakes the flusher early.
const WAKE_FLUSHER_BYTES: u64 = 1 << 30;
const WAKE_FLUSHER_FILES: usize = 50_000;

/// Backing files a mount's recovery asks the metadata about in one read
/// (etcd: 8 transactions of 128 reads, at one revision).
const STRAYS_ASKED_AT_ONCE: usize = 1024;

/// Above this many files to sync, one `syncfs` of the data disk is cheaper
/// than an `fdatasync` each.
const SYNCFS_ABOVE: usize = 32;

/// What waits for the next flush. Leaf locks: nothing is taken under them.
#[derive(Default)]
pub(super) struct Pending {
    /// Backing files of purged inodes, removed only once the purge is
    /// durable: a crash before that brings the inode back with its data;
    /// with the peers that held copies, told to remove theirs then.
    doomed: Mutex<Vec<(Ino, Vec<String>)>>,
    doomed_bytes: AtomicU64,
    /// Writing sessions that ended with nothing to record but the end of
    /// their lease (files closed empty, files unchanged since the close
    /// that published them): the next flush gives up their leases in
    /// batches (see [`Core::end_sessions`]) instead of a commit per close,
    /// what makes creating and unpacking many files cheap.
    session_ends: Mutex<Vec<SessionEnd>>,
    /// Wakes the flusher early (a purge wants its space back).
    flush_now: (Mutex<bool>, Condvar),
}

impl Core {
    /// Bring metadata and chunks back into agreement after a stop.
    pub(super) fn recover(&self) -> FsResult<()> {
        // Inodes the kernel holds open from an earlier daemon of this mount
        // (see `CoreConfig::kernel_open`): an orphan among them is purged at
        // its last close, a writer's file sealed then.
        let held: std::collections::BTreeSet<Ino> = self.cfg.kernel_open.iter().map(|k| k.ino).collect();
        let writing: std::collections::BTreeSet<Ino> =
            self.cfg.kernel_open.iter().filter(|k| k.writable).map(|k| k.ino).collect();
        // Delegations a crashed daemon of this node held: what it had not
        // committed died with it; the directories become plain ones.
        self.ns.release_delegations()?;
        let orphans: Vec<Ino> = self.ns.orphans()?.into_iter().filter(|ino| !held.contains(ino)).collect();
        for ino in &orphans {
            self.ns.purge(*ino)?;
            self.store.remove(*ino)?;
        }
        // Files open for writing when the daemon stopped (with the epoch of
        // their lease), and files whose seal may describe bytes the disk
        // never got: on one node (or one on a shared store that serves no
        // peers, whose closes publish nothing) sealed again from what the
        // backing file holds now; in a cluster brought back to what was
        // published.
        let mut reseal: std::collections::BTreeMap<Ino, Option<u64>> = Default::default();
        for (ino, _) in self.ns.sync_pending()? {
            reseal.insert(ino, None);
        }
        for (ino, epoch) in self.ns.unsealed()? {
            reseal.insert(ino, Some(epoch));
        }
        reseal.retain(|ino, _| !writing.contains(ino));
        let resealed = reseal.len();
        for (ino, epoch) in reseal {
            let inode = match self.ns.getattr(ino) {
                Ok(inode) => inode,
                Err(MetaError::NotFound) => {
                    self.ns.purge(ino)?;
                    continue;
                }
                Err(e) => return Err(e.into()),
            };
            let file = self.store.open_backing(ino)?;
            if self.ns.is_clustered() && self.cfg.serves_peers {
                // In a cluster every close and fsync publishes: what a writer
                // was told is safe is what the layout records, on peers'
                // stable storage. This node's copy may be torn (a power cut
                // takes its page cache), so it is never sealed again as it
                // stands: it is kept where it matches the layout, else
                // dropped from it (repair copies it back from the replicas).
                // Bytes written after the last publish were never
                // acknowledged, and go. Another node may also have written
                // the file since a sync-pending seal.
                let dropped = self.reconcile(ino, &file)?;
                match epoch {
                    None => self.ns.clear_sync_pending_of(ino)?,
                    Some(epoch) => drop(self.ns.release_lease(ino, epoch)?),
                }
                if dropped > 0 {
                    tracing::warn!(ino, chunks = dropped, "local copy did not survive the crash whole");
                }
                continue;
            }
            let how = SealAs {
                keep_unsealed: false,
                durability: Durability::Buffered,
                data_durable: false,
                sync_here: false,
                lease: epoch,
                fresh: false,
                streamed: Default::default(),
                floor: &std::cell::Cell::new(0),
                attrs: None,
            };
            match self.seal_file(&inode, &file, &Dirty::All, how) {
                // Sealed before the cluster is attached: replicas follow in the background.
                Ok(_) => {
                    self.under_replicated.add([ino], false);
                }
                // Another node took the write lease over while this one was
                // down: what was written here and not published is dropped.
                Err(FsError::Meta(MetaError::LeaseLost { .. })) => {
                    tracing::warn!(
                        ino,
                        "write lease taken over while this node was down; its unpublished writes are dropped"
                    );
                    self.reconcile(ino, &file)?;
                }
                Err(e) => return Err(e),
            }
        }
        // Backing files whose inode is gone, asked of the metadata in
        // batches: on etcd a request per 128 files, where asking file by
        // file made a node's start one request per file it holds. A batch
        // the store does not answer is kept, as a file it could not ask
        // about was before.
        let mut gone = Vec::new();
        for batch in self.store.list()?.chunks(STRAYS_ASKED_AT_ONCE) {
            match self.ns.inodes_exist(batch) {
                Ok(exist) => gone.extend(batch.iter().zip(exist).filter(|(_, e)| !e).map(|(ino, _)| *ino)),
                Err(e) => {
                    tracing::warn!(error = %e, files = batch.len(), "could not tell whether backing files still have inodes; they stay until the next mount")
                }
            }
        }
        let strays = gone.len();
        // Spares of the last mount, and files purged before a crash: the
        // spares of this one's first creates, or gone.
        for ino in self.respare(gone) {
            self.store.remove(ino)?;
        }
        self.flush()?;
        if !orphans.is_empty() || resealed > 0 || strays > 0 {
            tracing::info!(
                orphans = orphans.len(),
                resealed,
                stray_backing_files = strays,
                "recovered after an unclean stop"
            );
        }
        Ok(())
    }

    /// Queue the backing file of a purged inode for removal after the next
    /// durable flush. Deleting many small files shares one flush a second;
    /// a lot of space waiting to be freed wakes the flusher at once.
    /// `holders`: the nodes whose copies go too (read before the purge).
    /// `size`: the file's size as its last record had it, when the caller
    /// read that record (an unlink's transaction did); else the backing
    /// file is asked (a stat by path in the chunk directory, which an
    /// unlink of a closed file does not need).
    pub(super) fn doom(&self, ino: Ino, holders: Vec<String>, size: Option<u64>) {
        // Its object, if it had one, waits for this node's backfill to
        // delete it: the change feed does not report this node's own purge.
        self.control().moved(converged_metadata::schema::Control::Garbage);
        let bytes = size.unwrap_or_else(|| std::fs::metadata(self.store.path(ino)).map_or(0, |m| m.len()));
        let files = {
            let mut doomed = self.pending.doomed.lock();
            doomed.push((ino, holders));
            doomed.len()
        };
        let pending = self.pending.doomed_bytes.fetch_add(bytes, Ordering::Relaxed) + bytes;
        if pending >= WAKE_FLUSHER_BYTES || files >= WAKE_FLUSHER_FILES {
            *self.pending.flush_now.0.lock() = true;
            self.pending.flush_now.1.notify_one();
        }
    }

    /// Tell the live ones of `holders` to remove their copies of the purged
    /// `ino`, in the background: nothing waits for the answers. A holder
    /// that is down, or misses the request, removes its copy itself (its
    /// sweep, or its recovery at the next mount).
    fn delete_on_peers(&self, ino: Ino, holders: &[String]) {
        let Some(cluster) = self.cluster.get() else { return };
        if holders.is_empty() {
            return;
        }
        for node in cluster.live_peers().into_iter().filter(|n| holders.contains(&n.id)) {
            let id = node.id.clone();
            let call = cluster.clone().delete_on(node, ino);
            cluster.spawn(async move {
                if let Err(e) = call.await {
                    tracing::debug!(ino, peer = %id, error = %e, "peer delete failed; its sweep removes the copy");
                }
            });
        }
    }

    /// A writing session ended with nothing to record but the end of its
    /// lease: the next flush ends it with others. Until then the lease is
    /// still this node's: another node's open for writing waits for it
    /// (up to the flusher's period; see `LEASE_WAIT`), and after a crash
    /// recovery gives it up (a cluster node's file back at its published
    /// layout).
    pub(super) fn end_session_later(&self, end: SessionEnd) {
        self.pending.session_ends.lock().push(end);
    }

    /// Wait until `period` passed or a flush is wanted now.
    pub(crate) fn wait_for_flush(&self, period: Duration) {
        let mut wanted = self.pending.flush_now.0.lock();
        if !*wanted {
            wanted.wait_for(&self.pending.flush_now.1, period);
        }
        *wanted = false;
    }

    /// Make buffered namespace changes durable, after the bytes of the
    /// seals among them; then remove the backing files of inodes purged
    /// before. Called every second by the flusher and at unmount.
    pub fn flush(&self) -> FsResult<()> {
        self.end_sessions()?;
        if let Err(e) = self.ns.flush_unindexed() {
            tracing::warn!(error = %e, "could not drop the holder-index entries of purged files yet");
        }
        let doomed = std::mem::take(&mut *self.pending.doomed.lock());
        self.pending.doomed_bytes.store(0, Ordering::Relaxed);
        if let Err(e) = self.make_durable() {
            // Not durable: the purges may come back after a crash, so their
            // data must stay.
            self.pending.doomed.lock().extend(doomed);
            return Err(e);
        }
        let mut gone = Vec::with_capacity(doomed.len());
        let mut doomed = doomed.into_iter();
        while let Some((ino, holders)) = doomed.next() {
            // A metadata reopen after a disk-full error rolls back to the last
            // durable commit and may bring the inode back: then keep its data.
            match self.ns.getattr(ino) {
                Err(MetaError::NotFound) => {
                    self.delete_on_peers(ino, &holders);
                    gone.push(ino);
                }
                Ok(_) => {}
                Err(e) => {
                    // The store does not answer (etcd unreachable): each
                    // next question would wait out the same timeout, one
                    // file after another (an unmount during an outage sat
                    // here for minutes). This file and the rest keep their
                    // data and are asked about again at the next flush.
                    let rest: Vec<_> = std::iter::once((ino, holders)).chain(doomed).collect();
                    tracing::warn!(error = %e, files = rest.len(), "cannot tell whether purged files are gone; their data stays until the metadata store answers");
                    self.pending.doomed.lock().extend(rest);
                    break;
                }
            }
        }
        // Backing files become the spares of the next creates, or go.
        for ino in self.respare(gone) {
            self.store.remove(ino)?;
        }
        self.keep_reserve();
        Ok(())
    }

    /// One durable metadata commit, preceded by a sync of the bytes of every
    /// seal still marked sync-pending, whose marks it drops.
    pub(super) fn make_durable(&self) -> FsResult<()> {
        let pending = self.ns.sync_pending_since()?;
        if pending.is_empty() {
            self.ns.sync_if_dirty()?;
            return Ok(());
        }
        if pending.len() > SYNCFS_ABOVE {
            self.store.sync_filesystem().map_err(|e| FsError::io("syncfs data disk", e))?;
        } else {
            for (ino, _) in &pending {
                self.sync_backing_file(*ino)?;
            }
        }
        self.ns.clear_sync_pending(&pending)?;
        Ok(())
    }

    /// Put the bytes of `ino`'s backing file on stable storage.
    pub(super) fn sync_backing_file(&self, ino: Ino) -> FsResult<()> {
        match std::fs::File::open(self.store.path(ino)) {
            Ok(f) => f.sync_data().map_err(|e| FsError::io("sync backing file", e)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(FsError::io("open backing file to sync", e)),
        }
    }

    /// Give up the leases of the sessions that ended with nothing to
    /// record, holding each file closed while its batch commits (an opener
    /// waits, then takes the lease anew). A file open again keeps its
    /// lease: a later flush ends it, once the file is closed, unless a newer
    /// session's end (queued after it) or seal settles the lease first.
    fn end_sessions(&self) -> FsResult<()> {
        let mut ends = std::mem::take(&mut *self.pending.session_ends.lock());
        if ends.is_empty() {
            return Ok(());
        }
        // A file whose sessions ended twice is held once, for the last end.
        ends.reverse();
        let mut seen = std::collections::HashSet::with_capacity(ends.len());
        ends.retain(|e| seen.insert(e.ino()));
        // A batch of files is held at once here (one transaction's worth,
        // so an unlink or an open waits for one small commit at most), and
        // none is waited for: one that another holder has (an unlink, an
        // eviction) comes back in the next flush.
        let batches: Vec<&[SessionEnd]> = ends.chunks(self.ns.unsealed_batch().min(ends.len())).collect();
        for (i, batch) in batches.iter().enumerate() {
            let mut held = Vec::with_capacity(batch.len());
            let mut now = Vec::with_capacity(batch.len());
            let mut later = Vec::new();
            for &end in *batch {
                match self.open.try_claim_closed(end.ino()) {
                    Some(Claim::Closed(h)) => {
                        held.push(h);
                        now.push(end);
                    }
                    // Open again, or still being released by the close that
                    // queued this end (its state leaves `Sealing` after the
                    // end is queued): kept for a later flush. An end queued
                    // since, by a newer session, is taken over it then.
                    Some(Claim::Open(_)) | None => later.push(end),
                }
            }
            if !later.is_empty() {
                self.requeue_ends(later);
            }
            let r = self.ns.end_sessions(&now);
            drop(held);
            if let Err(e) = r {
                let mut again = now;
                again.extend(batches[i + 1..].iter().flat_map(|b| b.iter().copied()));
                self.requeue_ends(again);
                return Err(e.into());
            }
            if let Some(t) = self.tier.get() {
                for end in now {
                    t.enqueue(end.ino(), t.cfg.backfill_delay);
                }
            }
        }
        Ok(())
    }

    /// Queue `ends` for the next flush ahead of the ends queued meanwhile:
    /// the newest end of a file is the one a flush keeps.
    fn requeue_ends(&self, ends: Vec<SessionEnd>) {
        let mut queued = self.pending.session_ends.lock();
        let newer = std::mem::replace(&mut *queued, ends);
        queued.extend(newer);
    }

    /// Re-create the metadata reserve once the disk has room again.
    pub(super) fn keep_reserve(&self) {
        if self.cfg.read_only {
            return;
        }
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
}
