//! The sweep: a node of a cluster removes the copies it holds that no
//! record names any more. They are left by a purge whose delete request
//! did not reach this node (it was down or cut off), by repair or a drain
//! that moved a chunk elsewhere and dropped this node from its record, or
//! by a node that was rebuilt around while it was dead and came back.
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
use crate::error::FsResult;

/// Why a local copy is not needed any more.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unneeded {
    /// The inode is gone.
    Purged,
    /// No chunk record names this node, and every chunk has a live copy.
    Moved,
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

    /// One sweep over the copies held here. `seen`: when each unneeded copy
    /// was first found so (kept between sweeps). Returns how many inodes'
    /// copies were removed.
    pub(crate) fn sweep(&self, seen: &mut HashMap<Ino, Instant>, grace: Duration) -> FsResult<usize> {
        if self.cluster.get().is_none() {
            return Ok(0);
        }
        let mut held = self.store.list()?;
        held.extend(self.store.inodes_with_versions());
        held.sort_unstable();
        held.dedup();
        seen.retain(|ino, _| held.binary_search(ino).is_ok());
        let mut removed = 0;
        for ino in held {
            let why = match self.unneeded(ino)? {
                Some(why) => why,
                None => {
                    seen.remove(&ino);
                    continue;
                }
            };
            let first = *seen.entry(ino).or_insert_with(Instant::now);
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
            seen.remove(&ino);
        }
        Ok(removed)
    }
}
