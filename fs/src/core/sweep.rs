//! The sweep: a node of a cluster removes the copies it holds that no
//! record names any more. They are left by a purge whose delete request
//! did not reach this node (it was down or cut off), by repair or a drain
//! that moved a chunk elsewhere and dropped this node from its record, or
//! by a node that was rebuilt around while it was dead and came back.
//!
//! A file this node still holds some chunks of may hold bytes of others
//! that records no longer name here (truncated away, or moved by a
//! rebalance or a drain): those ranges of the backing file are punched out
//! under the same rules, chunk by chunk.
//!
//! A copy goes only when it was found unreferenced twice, at least `grace`
//! apart (a reader elsewhere that loaded the layout before the change keeps
//! reading it meanwhile, and a file created since the first look is seen
//! by the second), only while the file is not open here, and only if every
//! chunk of the file has a copy on a live node or the file is backed: a node
//! whose id changed finds records naming its old id, and must not delete
//! what may be the only copy.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use converged_metadata::types::*;
use converged_metadata::MetaError;

use super::Core;
use crate::error::{FsError, FsResult};

/// Why a local copy is not needed any more.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unneeded {
    /// The inode is gone.
    Purged,
    /// No chunk record names this node, and every chunk has a live copy.
    Moved,
}

/// What a sweep found unneeded, and when first: whole files' copies, and
/// chunks of files this node still holds some of.
#[derive(Default)]
pub struct Seen {
    files: HashMap<Ino, Instant>,
    chunks: HashMap<(Ino, u32), Instant>,
}

impl Seen {
    /// Whether nothing found is waiting for its grace period.
    pub fn is_empty(&self) -> bool {
        self.files.is_empty() && self.chunks.is_empty()
    }
}

impl Core {
    /// Whether this node's copy of `ino` is unneeded, and why.
    fn unneeded(&self, ino: Ino) -> FsResult<Option<Unneeded>> {
        let Some(cluster) = self.cluster.get() else { return Ok(None) };
        if self.open.get(ino).is_some() || self.spares.lock().contains_key(&ino) {
            return Ok(None);
        }
        if self.ns.upcoming_inos(u64::MAX).contains(&ino) {
            return Ok(None);
        }
        let inode = match self.ns.getattr(ino) {
            Ok(i) => i,
            Err(MetaError::NotFound) => return Ok(Some(Unneeded::Purged)),
            Err(e) => return Err(e.into()),
        };
        if inode.kind != FileKind::Regular || self.ns.writer(ino)?.is_some() {
            return Ok(None);
        }
        let chunks = self.ns.chunks(ino)?;
        if chunks.is_empty() || chunks.iter().any(|(_, r)| self.is_local(r)) {
            return Ok(None);
        }
        let backed = self.backed_object(ino)?.is_some();
        let live: Vec<String> = cluster.live_peers().into_iter().map(|n| n.id).collect();
        let all_live = chunks.iter().all(|(_, r)| r.replicas.iter().any(|h| live.contains(h)));
        Ok((backed || all_live).then_some(Unneeded::Moved))
    }

    /// Punch out the ranges of `ino`'s backing file that hold chunks no
    /// record names here (see the module's head). Returns how many.
    fn trim(&self, ino: Ino, seen: &mut HashMap<(Ino, u32), Instant>, grace: Duration) -> FsResult<usize> {
        if self.open.get(ino).is_some() || self.spares.lock().contains_key(&ino) {
            return Ok(0);
        }
        let inode = match self.ns.getattr(ino) {
            Ok(i) if i.kind == FileKind::Regular => i,
            Ok(_) | Err(MetaError::NotFound) => return Ok(0),
            Err(e) => return Err(e.into()),
        };
        if self.ns.writer(ino)?.is_some() {
            return Ok(0);
        }
        let Ok(file) = std::fs::File::open(self.store.path(ino)) else { return Ok(0) };
        let len = file.metadata().map_err(|e| FsError::io("stat backing file", e))?.len();
        let cs = inode.chunk_size.max(1) as u64;
        let records: HashMap<u32, converged_metadata::ChunkRecord> = self.ns.chunks(ino)?.into_iter().collect();
        let Some(cluster) = self.cluster.get() else { return Ok(0) };
        let live: Vec<String> = cluster.live_peers().into_iter().map(|n| n.id).collect();
        let backed = self.backed_object(ino)?.is_some();
        // A chunk whose record names no live node but this one's old id (an
        // id that changed) is kept: this copy may be the only one.
        let elsewhere = |r: &converged_metadata::ChunkRecord| backed || r.replicas.iter().any(|h| live.contains(h));
        let mut punched = 0;
        for index in 0..len.div_ceil(cs) as u32 {
            let (start, end) = (index as u64 * cs, ((index as u64 + 1) * cs).min(len));
            let keep = records.get(&index).is_some_and(|r| self.is_local(r) || !elsewhere(r));
            if keep || crate::blocks::is_hole(&file, start, end - start) {
                seen.remove(&(ino, index));
                continue;
            }
            let first = *seen.entry((ino, index)).or_insert_with(Instant::now);
            if first.elapsed() < grace {
                continue;
            }
            seen.remove(&(ino, index));
            let done = self.while_closed(ino, || -> FsResult<bool> {
                let still = self.ns.chunk(ino, index)?.is_none_or(|r| !self.is_local(&r) && elsewhere(&r));
                if !still || self.ns.writer(ino)?.is_some() {
                    return Ok(false);
                }
                let f = std::fs::OpenOptions::new()
                    .write(true)
                    .open(self.store.path(ino))
                    .map_err(|e| FsError::io("open backing file to trim", e))?;
                // SAFETY: fallocate on a descriptor we own, within the file.
                let rc = unsafe {
                    libc::fallocate(
                        std::os::fd::AsRawFd::as_raw_fd(&f),
                        libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                        start as i64,
                        (end - start) as i64,
                    )
                };
                if rc != 0 {
                    return Err(FsError::io("punch out an unneeded chunk", std::io::Error::last_os_error()));
                }
                Ok(true)
            });
            if let Some(Ok(true)) = done {
                tracing::info!(ino, chunk = index, "removed a chunk copy no record names here");
                punched += 1;
            }
        }
        Ok(punched)
    }

    /// One sweep over the copies held here. `seen`: when each unneeded copy
    /// was first found so (kept between sweeps). Returns how many files'
    /// copies and chunk ranges were removed.
    pub(crate) fn sweep(&self, seen: &mut Seen, grace: Duration) -> FsResult<usize> {
        if self.cluster.get().is_none() {
            return Ok(0);
        }
        let mut held = self.store.list()?;
        held.extend(self.store.inodes_with_versions());
        held.sort_unstable();
        held.dedup();
        seen.files.retain(|ino, _| held.binary_search(ino).is_ok());
        seen.chunks.retain(|(ino, _), _| held.binary_search(ino).is_ok());
        let mut removed = 0;
        for ino in held {
            let why = match self.unneeded(ino)? {
                Some(why) => why,
                None => {
                    seen.files.remove(&ino);
                    removed += self.trim(ino, &mut seen.chunks, grace)?;
                    continue;
                }
            };
            let first = *seen.files.entry(ino).or_insert_with(Instant::now);
            if first.elapsed() < grace {
                continue;
            }
            // Held closed (opens wait) while the copy goes, and looked at
            // again under that hold.
            let gone = self.while_closed(ino, || -> FsResult<bool> {
                if self.unneeded(ino)? != Some(why) {
                    return Ok(false);
                }
                self.store.remove(ino)?;
                Ok(true)
            });
            if let Some(Ok(true)) = gone {
                tracing::info!(ino, reason = ?why, "removed a copy no record names");
                removed += 1;
            }
            seen.files.remove(&ino);
        }
        Ok(removed)
    }
}
