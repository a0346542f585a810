//! Spares: backing files made ahead of time for the inode numbers this
//! node hands out next, so that a create does not wait for the local
//! filesystem to allocate one; and the backing files of purged inodes kept
//! as the spares of later numbers (emptied and renamed) instead of removed.
//! Owned by the core; the spare maker worker makes them, creates take them.
//!
//! Lock: `Spares::files` is a leaf, taken to look up, take or add a spare,
//! never across the creation, recycling or removal of a file (the maker
//! waits on `Spares::low` under it, holding nothing else).

use std::collections::HashMap;
use std::fs::File;
use std::sync::atomic::{AtomicBool, Ordering};

use converged_metadata::held_locks::Mutex;
use converged_metadata::types::*;

use super::Core;

/// Backing files kept ready ahead of creates, made new.
const SPARES: usize = 256;
/// Spares at most, counting the backing files of purged inodes kept for
/// the next numbers instead of removed: an unlink storm followed by a
/// create storm (a rewritten dataset, rotated checkpoints) allocates no
/// inode in the local filesystem. They are closed files, holding no
/// descriptor.
const RECYCLED_SPARES: usize = 16_384;

/// The spares of the next inode numbers: held open when made here, closed
/// when recycled from a purged inode.
#[derive(Default)]
pub(super) struct Spares {
    files: Mutex<HashMap<Ino, Option<File>>>,
    /// Creates took half of them (or found none): the maker wakes.
    low: parking_lot::Condvar,
    /// Set at shutdown so no spare is made after.
    stopped: AtomicBool,
}

impl Spares {
    /// No spare is made from now on; the ones made so far, for the caller
    /// to remove those no regular file took. The flag is set under the
    /// lock: a maker that made one after checks it there and removes it.
    /// Whether `ino` has a spare (a number not handed out yet).
    pub(super) fn holds(&self, ino: Ino) -> bool {
        self.files.lock().contains_key(&ino)
    }

    pub(super) fn stop(&self) -> HashMap<Ino, Option<File>> {
        let mut files = self.files.lock();
        self.stopped.store(true, Ordering::SeqCst);
        std::mem::take(&mut *files)
    }
}

impl Core {
    /// The spare of `ino` when it is held open; a closed one is opened by
    /// path, as a missing one is created.
    pub(super) fn take_spare(&self, ino: Ino) -> Option<File> {
        let mut files = self.spares.files.lock();
        let spare = files.remove(&ino);
        // Running low, or behind: wake the maker.
        if spare.is_none() || files.len() < SPARES / 2 {
            self.spares.low.notify_one();
        }
        spare.flatten()
    }

    /// Wait until creates have used half the spares, or `period` passed.
    /// Returns false once the core is shutting down.
    pub(crate) fn wait_for_spares_low(&self, period: std::time::Duration) -> bool {
        let mut files = self.spares.files.lock();
        files.wait_for(&self.spares.low, period);
        !self.spares.stopped.load(Ordering::SeqCst)
    }

    /// Keep the chunk store's slots ready (see `chunkstore.rs`): wait at
    /// most `period` for them to run low, then make a batch.
    pub(crate) fn make_slots(&self, period: std::time::Duration) -> std::io::Result<usize> {
        self.store.make_slots(period)
    }

    /// Make backing files for the next inode numbers. Spares for numbers
    /// already handed out are closed; one is deleted only when its inode
    /// turned out not to be a regular file, since a regular file may be
    /// opening its backing file by path at this moment. Returns how many
    /// it made.
    pub(crate) fn make_spares(&self) -> usize {
        let upcoming = self.ns.upcoming_inos(SPARES as u64);
        let stale: Vec<Ino> = self.spares.files.lock().keys().copied().filter(|i| *i < upcoming.start).collect();
        let mut unused = Vec::new();
        for ino in stale {
            if self.spares.files.lock().remove(&ino).is_some()
                && matches!(self.ns.getattr(ino), Ok(i) if i.kind != FileKind::Regular)
            {
                unused.push(ino);
            }
        }
        for ino in self.respare(unused) {
            let _ = self.store.remove(ino);
        }
        let mut made = 0;
        for ino in upcoming {
            if self.spares.stopped.load(Ordering::SeqCst) {
                break;
            }
            if self.spares.files.lock().contains_key(&ino) || self.open.get(ino).is_some() {
                continue;
            }
            if let Some(f) = self.store.create_spare(ino) {
                // Shutdown sets the flag under this lock before it removes
                // the spares: one made after that is removed here.
                let mut spares = self.spares.files.lock();
                if self.spares.stopped.load(Ordering::SeqCst) {
                    drop(spares);
                    drop(f);
                    let _ = self.store.remove(ino);
                    break;
                }
                made += 1;
                spares.insert(ino, Some(f));
            }
        }
        made
    }

    /// Keep the backing files of `from` (inodes purged, or numbers that
    /// did not go to a regular file) as the spares of the next numbers that
    /// have none: each emptied and renamed ([`ChunkStore::recycle`]), so
    /// that an unlink and a create cost the local filesystem a rename
    /// instead of an inode freed and another allocated. Returns those it
    /// did not keep (the spares are full, no number is free, a rename
    /// failed): the caller removes them.
    pub(super) fn respare(&self, from: Vec<Ino>) -> Vec<Ino> {
        if from.is_empty() {
            return from;
        }
        let upcoming = self.ns.upcoming_inos(RECYCLED_SPARES as u64);
        let free: Vec<Ino> = {
            let spares = self.spares.files.lock();
            if self.spares.stopped.load(Ordering::SeqCst) {
                return from;
            }
            let room = RECYCLED_SPARES.saturating_sub(spares.len()).min(from.len());
            upcoming.filter(|i| !spares.contains_key(i)).take(room).collect()
        };
        let mut kept = Vec::with_capacity(free.len());
        let mut left = Vec::new();
        let mut to = free.into_iter();
        for ino in from {
            // A number handed out meanwhile may be opening its backing file
            // by path: the rename never replaces a file, and an empty file
            // is what that open would have made.
            let Some(target) = to.by_ref().find(|t| self.open.get(*t).is_none()) else {
                left.push(ino);
                continue;
            };
            match self.store.recycle(ino, target) {
                Ok(()) => kept.push(target),
                Err(e) => {
                    tracing::debug!(ino, target, error = %e, "could not recycle a backing file; removing it");
                    left.push(ino);
                }
            }
        }
        let mut spares = self.spares.files.lock();
        if self.spares.stopped.load(Ordering::SeqCst) {
            // Shutdown already removed the spares it saw: these go too.
            drop(spares);
            for ino in kept {
                let _ = self.store.remove(ino);
            }
            return left;
        }
        spares.extend(kept.into_iter().map(|i| (i, None)));
        left
    }
}
