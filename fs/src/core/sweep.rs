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
//!
//! What is looked at, and when (so that an idle node reads nothing from
//! the metadata for the copies it holds, however many):
//! - files whose records another node changed in a way that may free a
//!   copy here, as the change feed reports them ([`SweepHints`]), and those
//!   whose holders this node's repair or a draining seal changed; with them
//!   the copies found unneeded once, for their second look, and those busy
//!   (open, being written) when last looked at;
//! - every copy held, by a safety pass at mount and then every
//!   [`SAFETY_PASS_EVERY`] (jittered), paced at [`SAFETY_PASS_RATE`] files a
//!   second, and at once when the feed restarted (changes may have been
//!   missed) or an admin asks (`converged gc`, unpaced).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use converged_metadata::held_locks::Mutex;
use converged_metadata::schema::{change_of, Change};

use converged_metadata::types::*;
use converged_metadata::SweepFacts;

use super::Core;
use crate::error::{FsError, FsResult};

/// What this node's copy of a file is, from one look at its records.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Look {
    /// Needed.
    Keep,
    /// Not ours to judge now (open here, being written, a spare): looked
    /// at again next time.
    Busy,
    /// The inode is gone: every copy of it goes.
    Purged,
    /// No chunk record names this node, and every chunk has a live copy
    /// elsewhere (or the file is backed).
    Moved,
    /// This node holds some chunks of the file; these others, held in its
    /// backing file or in version files, are named here by no record and
    /// live elsewhere.
    Partly { chunk_size: u64, others: Vec<u32> },
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

    /// Files with a copy or chunk found unneeded once, waiting for their
    /// second look.
    pub fn waiting(&self) -> BTreeSet<Ino> {
        self.files.keys().copied().chain(self.chunks.keys().map(|(ino, _)| *ino)).collect()
    }

    fn forget(&mut self, ino: Ino) {
        self.files.remove(&ino);
        self.chunks.retain(|(i, _), _| *i != ino);
    }
}

/// How often every copy held is looked at even when no change was heard.
pub const SAFETY_PASS_EVERY: Duration = Duration::from_secs(15 * 60);
/// Files a second the safety pass looks at (their records read
/// [`converged_metadata::SWEEP_FACTS_BATCH`] files to a request).
pub const SAFETY_PASS_RATE: usize = 50;
/// Files noted beyond this many before the sweep takes them make it look
/// at everything instead (a node that hears another create a million
/// files keeps no million-entry set).
const HINTS_MAX: usize = 100_000;

/// Files the sweep should look at before its next safety pass: those
/// whose records changed, as the change feed and this node's repair note
/// them. Owned by the core; its lock is a leaf (also taken on the change
/// feed's thread, under the node cache's subscriber list).
#[derive(Default)]
pub struct SweepHints(Mutex<Hinted>);

#[derive(Default)]
struct Hinted {
    files: BTreeSet<Ino>,
    /// Changes may have been missed: look at every copy.
    everything: bool,
    /// Files whose inode record the feed reported deleted (their purge is
    /// committed, for good), the last [`PURGED_KEPT`] of them, oldest first.
    purged: HashSet<Ino>,
    purged_order: std::collections::VecDeque<Ino>,
}

/// Purges heard from the change feed that are remembered: a node told to
/// drop its copy of one of them, or whose sweep looks at one, needs no read
/// of its records to know the file is gone.
const PURGED_KEPT: usize = 65_536;

impl Hinted {
    fn note(&mut self, ino: Ino) {
        if self.everything {
            return;
        }
        self.files.insert(ino);
        if self.files.len() > HINTS_MAX {
            self.files.clear();
            self.everything = true;
        }
    }
}

impl SweepHints {
    pub fn note(&self, ino: Ino) {
        self.0.lock().note(ino);
    }

    /// `ino`'s inode record was deleted (by another node: the feed does not
    /// report this node's own changes): the file is purged.
    fn note_purged(&self, ino: Ino) {
        let mut h = self.0.lock();
        h.note(ino);
        if h.purged.insert(ino) {
            h.purged_order.push_back(ino);
            if h.purged_order.len() > PURGED_KEPT {
                if let Some(old) = h.purged_order.pop_front() {
                    h.purged.remove(&old);
                }
            }
        }
    }

    /// Whether the change feed reported `ino`'s purge.
    pub fn purged(&self, ino: Ino) -> bool {
        self.0.lock().purged.contains(&ino)
    }

    pub fn note_everything(&self) {
        let mut h = self.0.lock();
        h.files.clear();
        h.everything = true;
    }

    /// What was noted since the last call, and whether everything was.
    pub fn take(&self) -> (BTreeSet<Ino>, bool) {
        let mut h = self.0.lock();
        (std::mem::take(&mut h.files), std::mem::take(&mut h.everything))
    }

    /// A change feed subscriber that notes the files whose records another
    /// node changed in a way that may leave a copy on `node` unneeded: an
    /// inode or chunk record deleted (an inode record deleted is also kept
    /// as the file's purge, see [`SweepHints::purged`]), a chunk record
    /// that no longer names `node`, a batched layout. A new file's records naming `node`, and
    /// attribute, lease and tier changes, are no work for the sweep (a file
    /// busy with a writer is looked at again anyway; the safety pass covers
    /// the rest).
    pub fn feed(self: &Arc<Self>, node: String) -> converged_metadata::ChangeFeed {
        use converged_metadata::schema::{is_batched_layout, is_chunk, is_inode};
        let hints = self.clone();
        Arc::new(move |key: &[u8], value: Option<&[u8]>| match change_of(key) {
            Change::Everything => hints.note_everything(),
            Change::Inode(ino) => match value {
                None if is_inode(key) => hints.note_purged(ino),
                None => hints.note(ino),
                Some(v) if is_chunk(key) && converged_metadata::chunk_held_by(key, v, &node).is_none() => {
                    hints.note(ino)
                }
                Some(_) => {}
            },
            Change::FileState(ino) if is_batched_layout(key) => hints.note(ino),
            Change::FileState(_) | Change::Entry { .. } | Change::Control(_) | Change::Other => {}
        })
    }
}

impl Core {
    /// One look at this node's copy of `ino`, its records read on their
    /// own: the second look before a copy goes, under the file's hold.
    fn look(&self, ino: Ino, live: &HashSet<String>) -> FsResult<Look> {
        if let Some(look) = self.look_here(ino) {
            return Ok(look);
        }
        let facts = self.ns.sweep_facts(&[ino])?.pop().flatten();
        self.judge(ino, facts, live)
    }

    /// What this node alone tells of its copy of `ino`: busy (open here, a
    /// spare, a number this node is about to hand out), or purged as the
    /// change feed reported; `None` when the records must say.
    fn look_here(&self, ino: Ino) -> Option<Look> {
        if self.open.get(ino).is_some() || self.spares.holds(ino) || self.ns.upcoming_inos(u64::MAX).contains(&ino) {
            return Some(Look::Busy);
        }
        self.sweep_hints.purged(ino).then_some(Look::Purged)
    }

    /// This node's copy of `ino` judged by its records (`None`: it has no
    /// inode record), read in one view with its write lease and tier
    /// record. `live`: the live nodes other than this one.
    fn judge(&self, ino: Ino, facts: Option<SweepFacts>, live: &HashSet<String>) -> FsResult<Look> {
        let Some(SweepFacts { inode, chunks, writer, tier }) = facts else {
            return Ok(Look::Purged);
        };
        if writer.is_some() {
            return Ok(Look::Busy);
        }
        if inode.kind != FileKind::Regular || chunks.is_empty() {
            return Ok(Look::Keep);
        }
        let backed = self.tier.get().is_some()
            && tier.is_some_and(|r| matches!(r.state, TierState::Backed | TierState::ReKeying));
        // A chunk whose record names no live node but this one's old id (an
        // id that changed) is kept: this copy may be the only one.
        let elsewhere = |r: &converged_metadata::ChunkRecord| backed || r.replicas.iter().any(|h| live.contains(h));
        if !chunks.iter().any(|(_, r)| self.is_local(r)) {
            return Ok(match chunks.iter().all(|(_, r)| elsewhere(r)) {
                true => Look::Moved,
                false => Look::Keep,
            });
        }
        let chunk_size = inode.chunk_size.max(1) as u64;
        let len = std::fs::metadata(self.store.path(ino)).map_or(0, |m| m.len());
        let records: HashMap<u32, &converged_metadata::ChunkRecord> = chunks.iter().map(|(i, r)| (*i, r)).collect();
        let mut held: Vec<u32> = (0..len.div_ceil(chunk_size) as u32).collect();
        held.extend(self.store.versions_of(ino).into_iter().map(|(index, _)| index));
        held.sort_unstable();
        held.dedup();
        let others =
            held.into_iter().filter(|i| records.get(i).is_none_or(|r| !self.is_local(r) && elsewhere(r))).collect();
        Ok(Look::Partly { chunk_size, others })
    }

    /// Every file this node holds a copy of (a backing file or a version
    /// file), in inode order.
    pub(crate) fn held_files(&self) -> FsResult<Vec<Ino>> {
        self.store.list()
    }

    /// Whether every copy of `ino` held here was written or received at
    /// `t` or later (see [`crate::workers::Sweeper`]'s pass at mount).
    pub(crate) fn copies_changed_since(&self, ino: Ino, t: std::time::SystemTime) -> bool {
        self.store.changed_since(ino, t)
    }

    fn holds(&self, ino: Ino) -> bool {
        self.store.has_versions(ino) || self.store.path(ino).exists()
    }

    /// The files the sweep should look at besides its safety pass.
    pub(crate) fn sweep_hints(&self) -> &Arc<SweepHints> {
        &self.sweep_hints
    }

    /// Look at every copy held here: `seen` keeps only what is still held.
    pub(crate) fn sweep_all(&self, seen: &mut Seen, grace: Duration) -> FsResult<usize> {
        let held = self.held_files()?;
        seen.files.retain(|ino, _| held.binary_search(ino).is_ok());
        seen.chunks.retain(|(ino, _), _| held.binary_search(ino).is_ok());
        self.sweep(seen, grace, held)
    }

    /// Look at this node's copies of `files` (those it no longer holds
    /// are skipped). `seen`: when each unneeded copy was first found so
    /// (kept between sweeps). Returns how many files' copies and chunk
    /// ranges were removed.
    pub(crate) fn sweep(
        &self,
        seen: &mut Seen,
        grace: Duration,
        files: impl IntoIterator<Item = Ino>,
    ) -> FsResult<usize> {
        let Some(cluster) = self.cluster.get() else { return Ok(0) };
        let live: HashSet<String> = cluster.live_peers().into_iter().map(|n| n.id).collect();
        let mut removed = 0;
        let files: Vec<Ino> = files.into_iter().collect();
        for batch in files.chunks(converged_metadata::SWEEP_FACTS_BATCH) {
            removed += self.sweep_batch(seen, grace, batch, &live)?;
        }
        Ok(removed)
    }

    /// [`Core::sweep`] of a few files: the records of those held here and
    /// not busy are read together, the second look before a removal on
    /// its own.
    fn sweep_batch(&self, seen: &mut Seen, grace: Duration, batch: &[Ino], live: &HashSet<String>) -> FsResult<usize> {
        let mut looks: HashMap<Ino, Look> = HashMap::with_capacity(batch.len());
        let mut ask = Vec::with_capacity(batch.len());
        for &ino in batch {
            if !self.holds(ino) {
                seen.forget(ino);
                continue;
            }
            match self.look_here(ino) {
                Some(look) => {
                    looks.insert(ino, look);
                }
                None => ask.push(ino),
            }
        }
        if !ask.is_empty() {
            for (&ino, facts) in ask.iter().zip(self.ns.sweep_facts(&ask)?) {
                looks.insert(ino, self.judge(ino, facts, live)?);
            }
        }
        let mut removed = 0;
        for &ino in batch {
            let Some(look) = looks.remove(&ino) else { continue };
            if !matches!(look, Look::Purged | Look::Moved) {
                seen.files.remove(&ino);
            }
            match look {
                Look::Keep => seen.chunks.retain(|(i, _), _| *i != ino),
                Look::Busy => {
                    seen.chunks.retain(|(i, _), _| *i != ino);
                    self.sweep_hints.note(ino);
                }
                Look::Purged | Look::Moved => {
                    let first = *seen.files.entry(ino).or_insert_with(Instant::now);
                    if first.elapsed() < grace {
                        continue;
                    }
                    seen.files.remove(&ino);
                    // Held closed (opens wait) while the copy goes, and
                    // looked at again under that hold.
                    let gone = self.while_closed(ino, || -> FsResult<bool> {
                        if self.look(ino, live)? != look {
                            return Ok(false);
                        }
                        self.store.remove(ino)?;
                        Ok(true)
                    });
                    if let Some(Ok(true)) = gone {
                        tracing::info!(ino, reason = ?look, "removed a copy no record names");
                        removed += 1;
                    }
                }
                Look::Partly { chunk_size, others } => {
                    removed += self.trim(ino, chunk_size, &others, live, &mut seen.chunks, grace)?;
                }
            }
        }
        Ok(removed)
    }

    /// Remove `others` (chunks of `ino` no record names here, from
    /// [`Core::look`]): punched out of the backing file, and their version
    /// files deleted, each once it was found so twice `grace` apart.
    /// Returns how many.
    fn trim(
        &self,
        ino: Ino,
        chunk_size: u64,
        others: &[u32],
        live: &HashSet<String>,
        seen: &mut HashMap<(Ino, u32), Instant>,
        grace: Duration,
    ) -> FsResult<usize> {
        let file = std::fs::OpenOptions::new().read(true).write(true).open(self.store.path(ino)).ok();
        let len = match &file {
            Some(f) => f.metadata().map_err(|e| FsError::io("stat backing file", e))?.len(),
            None => 0,
        };
        let versions = self.store.versions_of(ino);
        seen.retain(|(i, index), _| *i != ino || others.contains(index));
        let mut punched = 0;
        for &index in others {
            let (start, end) = (index as u64 * chunk_size, ((index as u64 + 1) * chunk_size).min(len));
            let in_backing =
                start < end && file.as_ref().is_some_and(|f| !crate::blocks::is_hole(f, start, end - start));
            let in_versions: Vec<u64> = versions.iter().filter(|(i, _)| *i == index).map(|(_, v)| *v).collect();
            if !in_backing && in_versions.is_empty() {
                seen.remove(&(ino, index));
                continue;
            }
            let first = *seen.entry((ino, index)).or_insert_with(Instant::now);
            if first.elapsed() < grace {
                continue;
            }
            seen.remove(&(ino, index));
            let done = self.while_closed(ino, || -> FsResult<bool> {
                match self.look(ino, live)? {
                    Look::Partly { others, .. } if others.contains(&index) => {}
                    _ => return Ok(false),
                }
                if let (true, Some(f)) = (in_backing, &file) {
                    crate::blocks::punch_hole(f, start, end - start)
                        .map_err(|e| FsError::io("punch out an unneeded chunk", e))?;
                }
                for &version in &in_versions {
                    self.store
                        .remove_version(ino, index, version)
                        .map_err(|e| FsError::io("remove an unneeded chunk version", e))?;
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
}
