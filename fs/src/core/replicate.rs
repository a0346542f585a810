//! Topping up under-replicated chunks: files whose chunks have fewer copies
//! than their policy asks (durability=local, peers that did not answer,
//! files re-sealed at mount). The replicator worker calls one step at a time.

use std::fs::File;
use std::time::Duration;

use converged_metadata::types::*;
use converged_metadata::MetaError;

use converged_metadata::held_locks::Mutex;

use super::Core;
use crate::chunkstore::read_exact_at;
use crate::error::{FsError, FsResult};
use crate::remote;

/// Copies the replicator made and records together, at most this many
/// chunks a transaction: a chunk record and a holder entry per copy (up to
/// nine keys with 8 replicas) keep it under etcd's 128 operations. One
/// commit a copy made the replicator's commits, beside a writer's create and
/// publish, the third of every small file written with `--durability local`.
const RECORD_BATCH: usize = 12;

/// Files whose chunks have fewer copies than their policy asks, for the
/// replicator. Its lock is a leaf: taken to add or take files, and by the
/// replicator to wait for some, never across a copy.
#[derive(Default)]
pub(super) struct ReplicationQueue {
    files: Mutex<std::collections::BTreeSet<Ino>>,
    queued: parking_lot::Condvar,
}

impl ReplicationQueue {
    /// Queue `files`; with `wake`, the replicator looks at once (else at
    /// its next look: the cluster is not attached yet).
    pub(super) fn add(&self, files: impl IntoIterator<Item = Ino>, wake: bool) {
        self.files.lock().extend(files);
        if wake {
            self.queued.notify_one();
        }
    }

    /// Have the replicator look now.
    pub(super) fn wake(&self) {
        self.queued.notify_one();
    }

    pub(super) fn len(&self) -> usize {
        self.files.lock().len()
    }

    /// Every file queued, once some are (waiting at most `period`) and
    /// `ready` says the replicator can act.
    fn take(&self, period: Duration, ready: impl Fn() -> bool) -> Option<std::collections::BTreeSet<Ino>> {
        let mut q = self.files.lock();
        if q.is_empty() || !ready() {
            q.wait_for(&self.queued, period);
        }
        if !ready() || q.is_empty() {
            return None;
        }
        Some(std::mem::take(&mut *q))
    }
}

/// What one replicator step did.
pub enum Replicated {
    /// Nothing queued (or no cluster yet).
    Idle,
    /// Every queued file has its copies.
    Done(usize),
    /// Too few live peers, or a failure: the file is queued again.
    Short(Ino),
}

impl Core {
    /// Wait (at most `period`) for files to replicate, then copy the chunks
    /// of each queued file this node is primary of to more peers.
    pub(crate) fn replicate_step(&self, period: Duration) -> Replicated {
        let Some(batch) = self.under_replicated.take(period, || self.cluster.get().is_some()) else {
            return Replicated::Idle;
        };
        let mut done = 0;
        // Files still being written here: tried again once their writers
        // are gone (a seal with nothing new to seal does not queue them
        // again, so they are kept, not dropped).
        let mut deferred = Vec::new();
        // Copies made and not recorded yet, and the files this step looked
        // at (queued again when a record fails: one whose copies are all
        // recorded costs the next step a look).
        let (mut copied, mut tried) = (Vec::new(), Vec::new());
        let mut batch = batch.into_iter();
        while let Some(ino) = batch.next() {
            if self.is_being_written(ino) {
                deferred.push(ino);
                continue;
            }
            tried.push(ino);
            let ok = self.replicate_file_to(ino, None, &mut copied).unwrap_or_else(|e| {
                tracing::warn!(ino, error = %e, "background replication failed; retrying later");
                false
            });
            if !ok {
                self.record_copies(&mut copied, &tried);
                self.under_replicated.add(std::iter::once(ino).chain(batch).chain(deferred), false);
                return Replicated::Short(ino);
            }
            done += 1;
        }
        if !self.record_copies(&mut copied, &tried) {
            self.under_replicated.add(deferred, false);
            return Replicated::Idle;
        }
        if !deferred.is_empty() {
            self.under_replicated.add(deferred, false);
            if done == 0 {
                // Only files being written: look again in a while.
                std::thread::sleep(period);
                return Replicated::Idle;
            }
        }
        Replicated::Done(done)
    }

    /// Record the copies in `copied` (one transaction) and empty it; a
    /// failure puts `files` back in the queue, to be copied again (what the
    /// peers hold meanwhile, named by no record, goes with their sweep).
    /// Returns whether they were recorded.
    fn record_copies(&self, copied: &mut Vec<NewCopies>, files: &[Ino]) -> bool {
        if copied.is_empty() {
            return true;
        }
        let recorded = self.ns.add_replicas_many(copied);
        if let Err(e) = &recorded {
            tracing::warn!(chunks = copied.len(), error = %e, "recording background copies failed; copying again later");
            self.under_replicated.add(files.iter().copied(), false);
        } else {
            tracing::debug!(chunks = copied.len(), "background copies recorded");
        }
        copied.clear();
        recorded.is_ok()
    }

    /// Copy the chunks of `ino` this node is primary of (or, with `copies`,
    /// every chunk it holds: staging with `--replicas`) to more peers, until
    /// each has as many copies as asked (the policy's, or `copies`). What
    /// was copied is added to `copied` and recorded [`RECORD_BATCH`] chunks
    /// at a time; the caller records the rest. Returns whether every chunk
    /// has its copies once recorded.
    pub(crate) fn replicate_file_to(
        &self,
        ino: Ino,
        copies: Option<usize>,
        copied: &mut Vec<NewCopies>,
    ) -> FsResult<bool> {
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
            // The version as sealed: its version file while the backing
            // file is rewritten, else the backing file.
            let (src, at) = match self.store.open_version(ino, index, rec.version) {
                Some(f) => (f, 0),
                None => (file.try_clone().map_err(|e| FsError::io("reopen backing file", e))?, start),
            };
            read_exact_at(&src, &mut data, at).map_err(|e| FsError::io("read chunk to replicate", e))?;
            if remote::verify(ino, &rec, start, start, &data).is_err() {
                // Changed since this record was sealed: a newer seal follows.
                continue;
            }
            let missing = want - rec.replicas.len();
            let ranked = cluster.plan(ino, index, &rec.replicas, missing);
            let chunk = remote::chunk_ref(ino, index as u64, cs, &rec);
            let copies = cluster.block_on(cluster.clone().push(chunk, bytes::Bytes::from(data), missing, ranked));
            short |= rec.replicas.len() + copies.len() < want;
            if !copies.is_empty() {
                tracing::debug!(ino, chunk = index, ?copies, "replicated in the background");
                copied.push(NewCopies { ino, index, version: rec.version, nodes: copies });
                if copied.len() >= RECORD_BATCH {
                    self.ns.add_replicas_many(copied)?;
                    copied.clear();
                }
            }
        }
        Ok(!short)
    }
}
