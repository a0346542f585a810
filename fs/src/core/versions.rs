//! Chunk versions held in version files (see `chunkstore.rs`) and how they
//! end. A version the layout records, with this node as a holder, is the
//! chunk's home here: it is read from its version file and never copied
//! again, unless a local open hands the kernel the backing file (every
//! chunk here, passthrough), which then gets it installed. A backing file
//! range that holds an older version of a chunk whose current version is a
//! version file here is punched out once readers elsewhere moved on. A
//! version the layout moved past, or never recorded, is removed after a
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
    /// Recorded, with this node as a holder, and the backing file holds
    /// nothing of the chunk: the version file is where it lives.
    Home,
    /// Recorded, and a local open wants the backing file whole: copy it in.
    Install,
    /// Recorded, and the backing file already has these bytes.
    AlreadyInPlace,
    /// Recorded, and the backing file holds an older version of the chunk
    /// that nothing reads any more: punch it out (the version file stays).
    Vacate,
    /// No longer needed once this old.
    RemoveAfter(Duration),
    /// Not yet: the backing file still holds an older version that readers
    /// elsewhere may be reading.
    Wait,
}

/// What one look at an inode's version files did.
pub(crate) struct Settled {
    /// Version files installed, removed, or backing ranges vacated.
    pub changed: usize,
    /// Whether some version file waits for a grace period or a commit.
    pub pending: bool,
}

impl Core {
    /// Settle the version files of `ino` held closed here. `for_open`: a
    /// local open is about to use the backing file; when every chunk of the
    /// file is here (the kernel can then read the backing file directly),
    /// committed versions are installed into it at once.
    pub(crate) fn settle_versions(&self, ino: Ino, for_open: bool) -> FsResult<Settled> {
        let versions = self.store.versions_of(ino);
        if versions.is_empty() {
            return Ok(Settled { changed: 0, pending: false });
        }
        // The size and the records from one read past the cache: a size
        // cached from before the publish that recorded these versions would
        // cut an installed chunk short.
        let (inode, records) = match self.ns.layout(ino) {
            Ok(l) => l,
            Err(MetaError::NotFound) => {
                // Purged (its purge's delete request did not reach this
                // node), or made under a directory delegation on its
                // writer's node and not committed yet (--nowsync): kept as
                // a version never recorded is.
                let old = |(index, version): &(u32, u64)| {
                    self.store.version_age(ino, *index, *version).is_none_or(|age| age >= UNCOMMITTED_GRACE)
                };
                if versions.iter().all(old) {
                    self.store.remove(ino)?;
                    return Ok(Settled { changed: versions.len(), pending: false });
                }
                return Ok(Settled { changed: 0, pending: true });
            }
            Err(e) => return Err(e.into()),
        };
        let records: std::collections::HashMap<u32, ChunkRecord> = records.into_iter().collect();
        let cs = inode.chunk_size.max(1) as u64;
        // Passthrough reads the backing file only when every chunk is here.
        let install = for_open && self.passthrough() && records.values().all(|r| self.is_local(r));
        let main = match install {
            true => Some(self.store.open_backing(ino)?),
            false => std::fs::OpenOptions::new().read(true).write(true).open(self.store.path(ino)).ok(),
        };
        let main_len = match &main {
            Some(f) => f.metadata().map_err(|e| FsError::io("stat backing file", e))?.len(),
            None => 0,
        };
        let mut done = Settled { changed: 0, pending: false };
        for (index, version) in versions {
            let start = index as u64 * cs;
            let age = self.store.version_age(ino, index, version).unwrap_or(Duration::ZERO);
            let fate = match (records.get(&index), &main) {
                (Some(rec), main) if rec.version == version && self.is_local(rec) => {
                    let len = rec.len as u64;
                    match main {
                        Some(f) if main_len > start && !crate::blocks::is_hole(f, start, len) => {
                            let here =
                                block_crcs(f, start, len).map_err(|e| FsError::io("checksum backing file", e))?;
                            if here == rec.block_crcs {
                                Fate::AlreadyInPlace
                            } else if install {
                                Fate::Install
                            } else if age >= SUPERSEDED_GRACE {
                                Fate::Vacate
                            } else {
                                Fate::Wait
                            }
                        }
                        Some(_) if install => Fate::Install,
                        _ => Fate::Home,
                    }
                }
                (Some(rec), _) if rec.version >= version => Fate::RemoveAfter(SUPERSEDED_GRACE),
                (None, _) if (index as u64) * cs >= inode.size => Fate::RemoveAfter(SUPERSEDED_GRACE),
                _ => Fate::RemoveAfter(UNCOMMITTED_GRACE),
            };
            let io = |e| FsError::io("settle a chunk version", e);
            match fate {
                Fate::Install => {
                    let main = main.as_ref().expect("opened to install");
                    self.store.install_version(main, ino, index, version, start).map_err(io)?;
                    let end = start + records[&index].len as u64;
                    if end >= inode.size && main.metadata().map_err(io)?.len() > inode.size {
                        main.set_len(inode.size).map_err(|e| FsError::io("size backing file", e))?;
                    }
                    tracing::debug!(ino, chunk = index, version, "installed a chunk version into the backing file");
                }
                Fate::AlreadyInPlace => self.store.remove_version(ino, index, version).map_err(io)?,
                Fate::Vacate => {
                    let main = main.as_ref().expect("the backing file holds the chunk");
                    crate::blocks::punch_hole(main, start, records[&index].len as u64).map_err(io)?;
                    tracing::debug!(ino, chunk = index, version, "punched an old version out of the backing file");
                }
                Fate::RemoveAfter(grace) if age >= grace => {
                    self.store.remove_version(ino, index, version).map_err(io)?;
                    tracing::debug!(ino, chunk = index, version, "removed a chunk version nothing reads any more");
                }
                Fate::Home => continue,
                Fate::RemoveAfter(_) | Fate::Wait => {
                    done.pending = true;
                    continue;
                }
            }
            done.changed += 1;
        }
        Ok(done)
    }

    /// One pass of the settler worker: every inode with version files not
    /// settled yet that is not open here. Returns how many version files it
    /// installed or removed (and backing ranges it vacated).
    ///
    /// The records of the inodes are read [`SWEEP_FACTS_BATCH`] to a request
    /// first: one whose every version file they show to be its chunk's home
    /// here (a replica received, the usual case after a restart) is settled
    /// without more; the others are settled one by one, under their hold,
    /// from a read of their own.
    ///
    /// [`SWEEP_FACTS_BATCH`]: converged_metadata::SWEEP_FACTS_BATCH
    pub fn settle_step(&self) -> FsResult<usize> {
        let mut changed = 0;
        for batch in self.store.inodes_to_settle().chunks(converged_metadata::SWEEP_FACTS_BATCH) {
            let facts = self.ns.sweep_facts(batch)?;
            for (&ino, facts) in batch.iter().zip(facts) {
                if self.open.get(ino).is_none() && facts.is_some_and(|f| self.all_home(ino, &f)) {
                    self.store.settled(ino);
                    continue;
                }
                if let Some(r) = self.while_closed(ino, || self.settle_versions(ino, false)) {
                    let r = r?;
                    changed += r.changed;
                    if !r.pending {
                        self.store.settled(ino);
                    }
                }
            }
        }
        Ok(changed)
    }

    /// Whether every version file of `ino` is its chunk's home by `facts`:
    /// a version the layout records with this node as a holder, and no
    /// backing file here (which [`Core::settle_versions`] would find
    /// [`Fate::Home`] and leave alone).
    fn all_home(&self, ino: Ino, facts: &converged_metadata::SweepFacts) -> bool {
        let versions = self.store.versions_of(ino);
        let recorded = |(index, version): &(u32, u64)| {
            facts.chunks.iter().any(|(i, r)| i == index && r.version == *version && self.is_local(r))
        };
        !versions.is_empty() && versions.iter().all(recorded) && !self.store.path(ino).exists()
    }

    /// A change feed subscriber that tells the chunk store which chunk
    /// versions the layout records with this node as a holder, so that a
    /// copy a writer pushed here settles without the settler's read of the
    /// file's records (see [`ChunkStore::recorded_here`](crate::chunkstore::ChunkStore::recorded_here)).
    pub fn recorded_copies_feed(&self) -> converged_metadata::ChangeFeed {
        let (store, node) = (self.store.clone(), self.node_id().to_string());
        std::sync::Arc::new(move |key: &[u8], value: Option<&[u8]>| {
            if let Some((ino, index, version)) = value.and_then(|v| converged_metadata::chunk_held_by(key, v, &node)) {
                store.recorded_here(ino, index, version);
            }
        })
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
