//! Chunk versions held beside the backing file (version files, see
//! `chunkstore.rs`) and how they end: a version the layout records is
//! installed into the backing file once no reader here can see the change;
//! a version the layout moved past, or never recorded, is removed after a
//! grace period, so that a reader elsewhere that loaded the layout before a
//! publish can still read it for a while.
//!
//! The backing file of an inode is changed here only while the inode is
//! held closed on this node (opens wait), never while a writer of this node
//! has it. No lock is held across the copies.

use std::time::Duration;

use converged_metadata::types::*;
use converged_metadata::{ChunkRecord, MetaError};

use super::Core;
use crate::chunkstore::block_crcs;
use crate::error::{FsError, FsResult};

/// How long a version the layout moved past stays readable here. A reader
/// on another node that loaded the layout before the publish reads the old
/// version for at least this long; after that, its reads move to the
/// current layout (see `read.rs`).
pub const SUPERSEDED_GRACE: Duration = Duration::from_secs(30);

/// How long a version the layout never recorded is kept: its writer's
/// commit failed, or its writer was fenced or died before committing.
pub const UNCOMMITTED_GRACE: Duration = Duration::from_secs(3600);

/// What becomes of one version file.
#[derive(Debug, PartialEq, Eq)]
enum Fate {
    /// Recorded, with this node as a holder: copy it into the backing file.
    Install,
    /// Recorded, and the backing file already has these bytes.
    AlreadyInPlace,
    /// No longer needed once this old.
    RemoveAfter(Duration),
    /// Not yet: the backing file still holds an older version that readers
    /// elsewhere may be reading.
    Wait,
}

impl Core {
    /// Settle the version files of `ino` held closed here. `now`: install
    /// committed versions at once (a local open that wants the backing file
    /// whole) rather than after the grace period. Returns how many version
    /// files were installed or removed.
    pub(crate) fn settle_versions(&self, ino: Ino, now: bool) -> FsResult<usize> {
        let versions = self.store.versions_of(ino);
        if versions.is_empty() {
            return Ok(0);
        }
        let inode = match self.ns.getattr(ino) {
            Ok(i) => i,
            Err(MetaError::NotFound) => {
                // Purged: every version goes with it.
                self.store.remove(ino)?;
                return Ok(versions.len());
            }
            Err(e) => return Err(e.into()),
        };
        let records: std::collections::HashMap<u32, ChunkRecord> = self.ns.chunks(ino)?.into_iter().collect();
        let cs = inode.chunk_size.max(1) as u64;
        let main = self.store.open_backing(ino)?;
        let main_len = main.metadata().map_err(|e| FsError::io("stat backing file", e))?.len();
        let mut settled = 0;
        for (index, version) in versions {
            let start = index as u64 * cs;
            let age = self.store.version_age(ino, index, version).unwrap_or(Duration::ZERO);
            let fate = match records.get(&index) {
                Some(rec) if rec.version == version && self.is_local(rec) => {
                    let here = block_crcs(&main, start, rec.len as u64)
                        .map_err(|e| FsError::io("checksum backing file", e))?;
                    if here == rec.block_crcs {
                        Fate::AlreadyInPlace
                    } else if now || main_len <= start || age >= SUPERSEDED_GRACE {
                        Fate::Install
                    } else {
                        Fate::Wait
                    }
                }
                Some(rec) if rec.version >= version => Fate::RemoveAfter(SUPERSEDED_GRACE),
                None if (index as u64) * cs >= inode.size => Fate::RemoveAfter(SUPERSEDED_GRACE),
                _ => Fate::RemoveAfter(UNCOMMITTED_GRACE),
            };
            let io = |e| FsError::io("settle a chunk version", e);
            match fate {
                Fate::Install => {
                    self.store.install_version(&main, ino, index, version, start).map_err(io)?;
                    let end = start + records[&index].len as u64;
                    if end >= inode.size && main_len > inode.size {
                        main.set_len(inode.size).map_err(|e| FsError::io("size backing file", e))?;
                    }
                    tracing::debug!(ino, chunk = index, version, "installed a chunk version into the backing file");
                }
                Fate::AlreadyInPlace => self.store.remove_version(ino, index, version).map_err(io)?,
                Fate::RemoveAfter(grace) if age >= grace => {
                    self.store.remove_version(ino, index, version).map_err(io)?;
                    tracing::debug!(ino, chunk = index, version, "removed a chunk version nothing reads any more");
                }
                Fate::RemoveAfter(_) | Fate::Wait => continue,
            }
            settled += 1;
        }
        Ok(settled)
    }

    /// One pass of the settler worker: every inode with version files that
    /// is not open here. Returns how many version files it installed or
    /// removed.
    pub fn settle_step(&self) -> FsResult<usize> {
        let mut settled = 0;
        for ino in self.store.inodes_with_versions() {
            if let Some(r) = self.while_closed(ino, || self.settle_versions(ino, false)) {
                settled += r?;
            }
        }
        Ok(settled)
    }

    /// Before a writing session rewrites the backing file in place: keep,
    /// in version files, the chunks whose only live copy is this node's, so
    /// that readers elsewhere keep reading the last published version while
    /// the writer works. Chunks held by live peers too are read there.
    pub(super) fn keep_sole_copies(&self, ino: Ino, main: &std::fs::File) -> FsResult<()> {
        let Some(cluster) = self.cluster.get() else { return Ok(()) };
        let inode = self.ns.getattr(ino)?;
        let cs = inode.chunk_size.max(1) as u64;
        let mut kept = 0u64;
        for (index, rec) in self.ns.chunks(ino)? {
            if !self.is_local(&rec) || !cluster.read_order(&rec.replicas).is_empty() {
                continue;
            }
            if self.store.has_version(ino, index, rec.version) {
                continue;
            }
            let start = index as u64 * cs;
            self.store
                .keep_version(main, ino, index, rec.version, start, rec.len as u64)
                .map_err(|e| FsError::io("keep the published version of a chunk", e))?;
            kept += rec.len as u64;
        }
        if kept > 0 {
            tracing::debug!(ino, bytes = kept, "kept the published chunks this node alone holds before rewriting them");
        }
        Ok(())
    }
}
