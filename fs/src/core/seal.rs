//! Sealing: what a file's chunks become in the layout (checksums, a
//! version, the nodes holding a copy), committed in one transaction at a
//! publish, the last writer's release or recovery; and the streamer, which
//! copies full chunks to their replicas while a writer goes on, so that a
//! publish sends only what changed since and the tail. No lock is held
//! here: the callers moved the file's write state to `Publishing` or
//! `Sealing` (or took a stream job) before, and settle it after.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use converged_metadata::types::*;
use converged_metadata::{ChunkRecord, Seal};
use converged_transport::ChunkRef;

use super::open::OpenInode;
use super::write::{Dirty, Looked, SealAs, StreamJob, Streamed, SYNC_HERE_MAX};
use super::{ts_from, Core};
use crate::chunkstore::block_crcs;
use crate::cluster::{Cluster, DurabilityMode, Push};
use crate::error::{FsError, FsResult};

/// Chunks whose replica writes may be in flight at once while sealing.
pub(super) const REPLICATION_WINDOW: usize = 3;

/// What a seal does with a file's chunks, decided once before them.
struct SealPlan<'c> {
    /// The chunks to look at.
    which: Vec<u32>,
    /// Their records before this seal (none read for a fresh file).
    old: HashMap<u32, ChunkRecord>,
    /// Copies each chunk should have.
    want: usize,
    /// A draining (or drained) node keeps no copy of what it seals.
    leaving: bool,
    /// Where copies are written before the record (durability
    /// `replicated`): the cluster to push through.
    replicate_now: Option<&'c Arc<Cluster>>,
    /// Copies to make on peers.
    to_peers: usize,
    /// A chunk version no peer took is kept here in a version file.
    keep_here: bool,
    /// The lease epoch new versions are handed out in.
    epoch: u64,
    /// The file's chunk size.
    cs: u64,
}

/// A chunk's copies in flight: its place in the pass's records, the
/// version, its bytes, and the push.
type Inflight = (usize, ChunkRef, bytes::Bytes, tokio::task::JoinHandle<Vec<String>>);

/// What the pass over the chunks found.
struct ChunkPass {
    chunks: Vec<(u32, ChunkRecord)>,
    /// Holders of streamed chunks this seal records: what each must sync.
    to_sync: BTreeMap<String, Vec<(u32, u64)>>,
    /// Some chunk has fewer copies than it should.
    short: bool,
}

/// The offset of the first data at or after `from` in `file` (SEEK_DATA),
/// None when only a hole follows. A filesystem that cannot tell answers
/// `from` (all data).
fn data_at_or_after(file: &File, from: u64) -> Option<u64> {
    // SAFETY: lseek on our own fd; the backing file's offset is never used for I/O.
    let r = unsafe { libc::lseek(file.as_raw_fd(), from as i64, libc::SEEK_DATA) };
    if r >= 0 {
        return Some(r as u64);
    }
    match std::io::Error::last_os_error().raw_os_error() {
        Some(libc::ENXIO) => None,
        _ => Some(from),
    }
}

impl Core {
    /// Compute checksums for the dirty chunks of `inode` from `file` and
    /// record them with the size and mtime the backing file has. This node
    /// is the primary of every chunk it seals (unless it is draining: see
    /// [`SealPlan::leaving`]); in a cluster the other replicas are written
    /// before the record (durability=replicated) or after it, in the
    /// background (durability=local). A chunk whose bytes did not change
    /// keeps its record, version and replicas.
    pub(super) fn seal_file(&self, inode: &Inode, file: &File, dirty: &Dirty, mut how: SealAs<'_>) -> FsResult<Inode> {
        let md = file.metadata().map_err(|e| FsError::io("stat backing file", e))?;
        let size = md.len();
        let plan = self.plan_seal(inode, size, dirty, &how)?;
        // A small file's copy here goes to stable storage while the peers
        // take theirs (the disk's sync beside the network's round trip).
        let syncing = match plan.replicate_now {
            Some(c)
                if how.sync_here
                    && size <= SYNC_HERE_MAX
                    && !how.data_durable
                    && !plan.leaving
                    && !plan.which.is_empty() =>
            {
                let f = file.try_clone().map_err(|e| FsError::io("open backing file to sync", e))?;
                Some((c, c.spawn_blocking(move || f.sync_data())))
            }
            _ => None,
        };
        let pass = self.seal_chunks(inode, file, size, &plan, &how);
        if let Some((c, task)) = syncing {
            c.block_on(task)
                .unwrap_or_else(|e| Err(std::io::Error::other(e)))
                .map_err(|e| FsError::io("sync backing file", e))?;
            how.data_durable = true;
        }
        let mut pass = pass?;
        if let Some(c) = self.cluster.get() {
            vouch_for_streamed(c, inode.ino, &mut pass);
        }
        pass.short |= pass.chunks.iter().any(|(_, r)| r.replicas.len() < plan.want);
        if pass.short && plan.replicate_now.is_some() && !how.data_durable {
            // Peers did not take every copy: the record rests on this
            // node's copy more than planned, so it is on stable storage
            // before it is recorded (a power cut here must not leave the
            // record naming only a torn copy).
            file.sync_data().map_err(|e| FsError::io("sync backing file", e))?;
            how.data_durable = true;
        }
        self.commit_seal(inode.ino, size, ts_from(md.mtime(), md.mtime_nsec()), pass, how)
    }

    /// Which chunks a seal looks at, their records, and where their copies go.
    fn plan_seal(&self, inode: &Inode, size: u64, dirty: &Dirty, how: &SealAs<'_>) -> FsResult<SealPlan<'_>> {
        let cs = inode.chunk_size.max(1) as u64;
        let nchunks = size.div_ceil(cs) as u32;
        let which: Vec<u32> = match dirty {
            Dirty::All => (0..nchunks).collect(),
            Dirty::Chunks(set) => set.iter().copied().filter(|c| *c < nchunks).collect(),
            Dirty::None => Vec::new(),
        };
        let old: HashMap<u32, ChunkRecord> = match which.is_empty() || how.fresh {
            true => Default::default(),
            false => self.ns.chunks(inode.ino)?.into_iter().collect(),
        };
        let cluster = self.cluster.get();
        let want = match cluster {
            Some(c) if !which.is_empty() => {
                self.ns.replicas_policy(inode.ino)?.unwrap_or(c.default_replicas()).max(1) as usize
            }
            _ => 1,
        };
        // A draining (or drained) node keeps no copy of what it seals: each
        // chunk goes to `want` other nodes, and the backing file here only
        // serves this node's writers (the sweep removes it once closed). A
        // chunk no peer took stays recorded here, as anywhere else.
        let leaving = cluster.is_some_and(|c| c.durability() == DurabilityMode::Replicated && !c.placeable(c.node()));
        if leaving {
            // This node's own change: the change feed does not report it here.
            self.sweep_hints.note(inode.ino);
        }
        let replicate_now = cluster.filter(|c| (want > 1 || leaving) && c.durability() == DurabilityMode::Replicated);
        // A publish while writers go on (close or fsync in a cluster): the
        // backing file keeps changing in place and holds no published
        // version. A chunk version no peer took a copy of is kept here in a
        // version file, so that it can be served and replicated as sealed.
        let keep_here = cluster.is_some() && how.keep_unsealed;
        Ok(SealPlan {
            which,
            old,
            want,
            leaving,
            replicate_now,
            to_peers: if leaving { want } else { want - 1 },
            keep_here,
            epoch: how.lease.unwrap_or(converged_metadata::CREATE_LEASE),
            cs,
        })
    }

    /// The record of each chunk the plan names: unchanged ones keep theirs,
    /// streamed ones unchanged since take the streamed version, the others
    /// get a new version, copied to peers (a window of them in flight at
    /// once) or kept here.
    fn seal_chunks(
        &self,
        inode: &Inode,
        file: &File,
        size: u64,
        plan: &SealPlan<'_>,
        how: &SealAs<'_>,
    ) -> FsResult<ChunkPass> {
        let SealPlan { ref which, ref old, want, leaving, replicate_now, to_peers, keep_here, epoch, cs } = *plan;
        let mut short = false;
        let mut chunks: Vec<(u32, ChunkRecord)> = Vec::with_capacity(which.len());
        // Replica writes in flight (position in `chunks`, the bytes, task):
        // the next chunk is read and checksummed while earlier ones cross
        // the network.
        let mut inflight = VecDeque::new();
        // Holders of streamed chunks this seal records: what each must sync.
        let mut to_sync: BTreeMap<String, Vec<(u32, u64)>> = Default::default();
        // The backing file's next data at or after an offset (None: only a
        // hole follows), asked once per run of holes.
        let mut next_data: Option<Option<u64>> = None;
        for &index in which {
            let start = index as u64 * cs;
            let len = (size - start).min(cs);
            if !old.contains_key(&index) {
                // A chunk that is a hole in the backing file and had no
                // record stays a hole: no record, nothing to checksum. (A
                // hole over a recorded chunk is recorded as zeros, so the
                // old bytes do not show through.) A file written at 16 TiB
                // would otherwise record 262,144 chunks of zeros.
                let nd = match next_data {
                    Some(Some(d)) if d >= start => Some(d),
                    Some(None) => None,
                    _ => data_at_or_after(file, start),
                };
                next_data = Some(nd);
                if nd.is_none_or(|d| d >= start + len) {
                    continue;
                }
            }
            // Bytes that leave the backing file are read once, and
            // checksummed as they are sent or kept. A chunk streamed to
            // peers is checksummed where it lies first: unchanged since, it
            // does not leave again.
            let read_chunk = || {
                crate::blocks::read_shared(file, start, len as usize)
                    .map_err(|e| FsError::io("read chunk to replicate", e))
            };
            let needs_bytes = replicate_now.is_some() || keep_here;
            let data = match needs_bytes && !how.streamed.contains_key(&index) {
                true => Some(read_chunk()?),
                false => None,
            };
            let block_crcs = match &data {
                Some(data) => data.chunks(BLOCK_SIZE as usize).map(crc32c::crc32c).collect(),
                None => block_crcs(file, start, len).map_err(|e| FsError::io("checksum backing file", e))?,
            };
            let previous = old.get(&index);
            if let Some(o) = previous {
                let kept = o.replicas.iter().any(|r| r == self.node_id()) || (leaving && !o.replicas.is_empty());
                if o.len as u64 == len && o.block_crcs == block_crcs && kept {
                    short |= o.replicas.len() < want;
                    continue;
                }
            }
            let mine = || if leaving { Vec::new() } else { vec![self.node_id().to_string()] };
            // Streamed to peers while the writer went on, and unchanged since.
            // Its copies were written unsynced: each holder syncs them all
            // at once before the commit.
            if let Some(s) = how.streamed.get(&index).filter(|s| s.len as u64 == len && s.block_crcs == block_crcs) {
                if !leaving && !s.copies.is_empty() {
                    let mut replicas = mine();
                    replicas.extend(s.copies.iter().cloned());
                    for holder in &s.copies {
                        to_sync.entry(holder.clone()).or_default().push((index, s.version));
                    }
                    chunks.push((index, ChunkRecord { version: s.version, len: len as u32, replicas, block_crcs }));
                    continue;
                }
            }
            let version = session_version(previous, epoch, how.floor.get());
            how.floor.set(version);
            let record = ChunkRecord { version, len: len as u32, replicas: mine(), block_crcs };
            let chunk = ChunkRef { ino: inode.ino, index, version: record.version, start };
            let data = match (data, needs_bytes) {
                (None, true) => Some(read_chunk()?),
                (data, _) => data,
            };
            match (replicate_now, data) {
                (Some(c), Some(data)) => {
                    let ranked = c.plan(inode.ino, index, &record.replicas, to_peers);
                    let how = Push { durable: true, made_in: self.ns.made_in(inode.ino) };
                    let push = c.clone().push_with(chunk, data.clone(), to_peers, ranked, how);
                    inflight.push_back((chunks.len(), chunk, data, c.spawn(push)));
                }
                (None, Some(data)) => self.keep_version(&chunk, &data),
                (_, None) => {}
            }
            chunks.push((index, record));
            while inflight.len() >= REPLICATION_WINDOW {
                self.land(plan, inode.ino, &mut chunks, inflight.pop_front().expect("not empty"));
            }
        }
        while let Some(f) = inflight.pop_front() {
            self.land(plan, inode.ino, &mut chunks, f);
        }
        Ok(ChunkPass { chunks, to_sync, short })
    }

    /// Wait for a chunk's copies in flight and record the peers that took
    /// one; a version no peer took is kept here when the plan says so.
    fn land(
        &self,
        plan: &SealPlan<'_>,
        ino: Ino,
        chunks: &mut [(u32, ChunkRecord)],
        (at, chunk, data, task): Inflight,
    ) {
        let c = plan.replicate_now.expect("only replicating chunks are in flight");
        let copies = c.block_on(task).unwrap_or_default();
        let (index, record) = &mut chunks[at];
        if plan.leaving && copies.is_empty() {
            record.replicas.push(self.node_id().to_string());
        }
        if copies.len() + record.replicas.len() < plan.want {
            tracing::warn!(
                ino,
                chunk = *index,
                copies = copies.len() + record.replicas.len(),
                want = plan.want,
                "chunk under-replicated: too few peers answered"
            );
        }
        if copies.is_empty() && plan.keep_here {
            self.keep_version(&chunk, &data);
        }
        record.replicas.extend(copies);
    }

    /// Keep a published chunk version here, beside the backing file a
    /// writer goes on changing.
    fn keep_version(&self, chunk: &ChunkRef, data: &[u8]) {
        if let Err(e) = self.store.write_version(chunk, data, crate::chunkstore::Arrival::Kept, true) {
            tracing::warn!(ino = chunk.ino, chunk = chunk.index, error = %e, "could not keep the published version of a chunk beside the one being written");
        }
    }

    /// Record the seal, then queue what follows it: the file's backfill,
    /// and its replication if it is short of copies.
    fn commit_seal(&self, ino: Ino, size: u64, mtime: Timespec, pass: ChunkPass, how: SealAs<'_>) -> FsResult<Inode> {
        let SealAs { keep_unsealed, durability, data_durable, lease, mut attrs, .. } = how;
        if let Some(a) = attrs.as_mut().filter(|a| a.mtime.is_some()) {
            // The times set were put on the backing file, and a write since
            // moved its mtime on: the backing file has the one to record.
            a.mtime = Some(TimeSet::At(mtime));
        }
        let seal = Seal { size, mtime, chunks: pass.chunks, keep_unsealed, lease, data_durable, attrs };
        let sealed = self.ns.seal(ino, &seal, durability)?;
        self.stats.seals.fetch_add(1, Ordering::Relaxed);
        if let Some(t) = self.tier.get() {
            t.enqueue(ino, t.cfg.backfill_delay);
        }
        if pass.short {
            self.under_replicated.add([ino], true);
        }
        Ok(sealed)
    }

    /// Copy to peers the chunks of one writer's file that are due (see
    /// [`Core::stream_step`]); no lock is held. Returns each chunk looked at
    /// (with what was streamed of it) and the highest version handed out.
    pub(super) fn stream_file(&self, c: &Arc<Cluster>, oi: &OpenInode, job: &StreamJob) -> FsResult<(Looked, u64)> {
        let ino = oi.ino;
        let size = oi.file.metadata().map_err(|e| FsError::io("stat backing file", e))?.len();
        let inode = self.ns.getattr(ino)?;
        let cs = inode.chunk_size.max(1) as u64;
        let due: Vec<u32> = (0..(size / cs) as u32)
            .filter(|i| !job.seen.contains(i) && !crate::blocks::has_hole(&oi.file, *i as u64 * cs, cs))
            .take(REPLICATION_WINDOW)
            .collect();
        let mut floor = job.floor;
        if due.is_empty() {
            return Ok((Vec::new(), floor));
        }
        let want = self.ns.replicas_policy(ino)?.unwrap_or(c.default_replicas()).max(1) as usize;
        let old: HashMap<u32, ChunkRecord> = match job.fresh || want < 2 {
            true => Default::default(),
            false => self.ns.chunks(ino)?.into_iter().collect(),
        };
        let mut looked = Vec::with_capacity(due.len());
        let mut inflight = Vec::with_capacity(due.len());
        for index in due {
            let previous = old.get(&index);
            if want < 2 || previous.is_some_and(|o| o.len as u64 == cs) {
                looked.push((index, None));
                continue;
            }
            let start = index as u64 * cs;
            let data = crate::blocks::read_shared(&oi.file, start, cs as usize)
                .map_err(|e| FsError::io("read chunk to stream", e))?;
            // The local copy heads for the disk while the copies cross the
            // network: the publish then waits for the tail on both.
            crate::blocks::start_writeback(&oi.file, start, cs);
            let block_crcs: Vec<u32> = data.chunks(BLOCK_SIZE as usize).map(crc32c::crc32c).collect();
            let version = session_version(previous, job.lease, floor);
            floor = version;
            let ranked = c.plan(ino, index, &[self.node_id().to_string()], want - 1);
            let chunk = ChunkRef { ino, index, version, start };
            // Unsynced: the publish that records it has the holder sync it.
            let how = Push { durable: false, made_in: self.ns.made_in(ino) };
            let task = c.spawn(c.clone().push_with(chunk, data, want - 1, ranked, how));
            inflight.push((index, version, block_crcs, task));
        }
        for (index, version, block_crcs, task) in inflight {
            let copies = c.block_on(task).unwrap_or_default();
            looked.push((index, Some(Streamed { version, len: cs as u32, block_crcs, copies })));
        }
        Ok((looked, floor))
    }
}

/// Have each holder of streamed chunks the pass recorded put them on stable
/// storage, all at once. A holder that cannot vouch for its streamed copies
/// (it failed, or restarted since) is not recorded: the file is then short
/// of copies, and the replicator sends them again.
fn vouch_for_streamed(c: &Arc<Cluster>, ino: Ino, pass: &mut ChunkPass) {
    if pass.to_sync.is_empty() {
        return;
    }
    let synced = c.sync(ino, pass.to_sync.clone());
    for (holder, list) in &pass.to_sync {
        if synced.contains(holder) {
            continue;
        }
        for (index, _) in list {
            if let Some((_, r)) = pass.chunks.iter_mut().find(|(i, _)| i == index) {
                r.replicas.retain(|h| h != holder);
            }
        }
    }
}

/// The version a writing session gives a new copy of a chunk recorded as
/// `previous`: past it, in the session's lease epoch, and above every
/// version the session handed out so far (`floor`).
fn session_version(previous: Option<&ChunkRecord>, epoch: u64, floor: u64) -> u64 {
    converged_metadata::next_version(previous.map(|o| o.version), epoch).max(floor + 1)
}
