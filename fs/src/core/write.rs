//! The write path: a file's write state on this node, and every transition
//! of it (this module is the only one that changes `OpenState::write`).
//!
//! ```text
//!            first writer opens           last writer releases
//!   Sealed ──────────────────▶ Leasing ──▶ Unsealed ─────────────▶ Sealing ──▶ Sealed
//!     ▲    (lease, hydrate)      │ failed     │  ▲   (checksums, commit)  │ failed
//!     └──────────────────────────┘            ▼  │                        ▼
//!                                        Publishing                    Unsealed
//!                               (close/fsync in a cluster: checksums, replicas, layout)
//! ```
//!
//! The long work of each transitional state (`Leasing`, `Publishing`,
//! `Sealing`) runs with no lock held; whoever needs a settled state waits on
//! `OpenInode::changed`.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use converged_metadata::types::*;
use converged_metadata::{ChunkRecord, Durability, MetaError, Seal};

use super::open::OpenInode;
use super::{chunk_range, ts_from, Core};
use crate::chunkstore::{block_crcs, read_exact_at};
use crate::cluster::DurabilityMode;
use crate::error::{FsError, FsResult};

/// Chunks whose replica writes may be in flight at once while sealing.
const REPLICATION_WINDOW: usize = 3;

/// How long an open for writing waits for another node's write lease.
const LEASE_WAIT: Duration = Duration::from_secs(2);

/// Size and mtime of a backing file: what a publish saw, to skip the next
/// one (and the final seal) when nothing changed since.
pub(super) type Stamp = (u64, Timespec);

/// Which chunks of an unsealed file need new checksums.
#[derive(Default)]
pub(super) enum Dirty {
    #[default]
    None,
    Chunks(std::collections::BTreeSet<u32>),
    /// Writes went around the daemon (passthrough): every chunk.
    All,
}

impl Dirty {
    pub fn add(&mut self, chunks: std::ops::RangeInclusive<u32>) {
        match self {
            Dirty::All => {}
            Dirty::None => *self = Dirty::Chunks(chunks.collect()),
            Dirty::Chunks(set) => set.extend(chunks),
        }
    }
}

/// What a writer here has that the metadata does not.
#[derive(Default)]
pub(super) struct Unsealed {
    dirty: Dirty,
    /// What the last publish (close or fsync in a cluster) recorded.
    published: Option<Stamp>,
    /// Created by this open: an empty file needs no seal...
    created_here: bool,
    /// ... unless an fsync recorded a size for it meanwhile.
    size_recorded: bool,
}

/// A file's write state on this node.
#[derive(Default)]
pub(super) enum WriteState {
    /// No writer here: the metadata describes the file's bytes.
    #[default]
    Sealed,
    /// The first writer is taking the write lease and copying in chunks
    /// held elsewhere. Other openers wait.
    Leasing,
    /// Open for writing here: the write lease is held (the `U` mark), and
    /// the backing file is ahead of the metadata.
    Unsealed(Unsealed),
    /// A close or fsync is publishing what was written so far; writes go on
    /// and are tracked for the next seal. Other publishers wait.
    Publishing(Unsealed),
    /// The last writer released the file and its seal is being committed.
    /// Openers wait.
    Sealing,
}

impl WriteState {
    /// Work under way that others must wait out.
    pub fn in_transition(&self) -> bool {
        matches!(self, WriteState::Leasing | WriteState::Publishing(_) | WriteState::Sealing)
    }

    /// Whether the backing file, not the metadata's layout, holds the bytes.
    pub fn reads_backing_file(&self) -> bool {
        matches!(self, WriteState::Unsealed(_) | WriteState::Publishing(_) | WriteState::Sealing)
    }

    /// Chunks `range` changed.
    pub(super) fn mark_dirty(&mut self, range: std::ops::RangeInclusive<u32>) {
        if let WriteState::Unsealed(u) | WriteState::Publishing(u) = self {
            u.dirty.add(range);
        }
    }

    /// An fsync recorded the backing file's size in the metadata.
    fn size_recorded(&mut self) {
        if let WriteState::Unsealed(u) | WriteState::Publishing(u) = self {
            u.size_recorded = true;
        }
    }

    /// Writes may go around the daemon: every chunk is checksummed again.
    pub fn dirty_all(&mut self) {
        if let WriteState::Unsealed(u) | WriteState::Publishing(u) = self {
            u.dirty = Dirty::All;
        }
    }

    // The transitions. Each takes the state as it must be and says what the
    // caller does next with no lock held.

    /// Sealed → Leasing for the first writer; false when a writer is here already.
    fn begin_lease(&mut self) -> bool {
        if matches!(self, WriteState::Sealed) {
            *self = WriteState::Leasing;
            return true;
        }
        false
    }

    /// Leasing → Unsealed, or back to Sealed when the lease was not had.
    fn end_lease(&mut self, leased: bool, created_here: bool) {
        debug_assert!(matches!(self, WriteState::Leasing));
        *self = match leased {
            true => WriteState::Unsealed(Unsealed { created_here, ..Unsealed::default() }),
            false => WriteState::Sealed,
        };
    }

    /// Unsealed → Publishing when the backing file changed since the last
    /// publish; returns the chunks to checksum. `next` is what tracking
    /// starts again from (everything, when writes bypass the daemon).
    fn begin_publish(&mut self, now: Stamp, next: Dirty) -> Option<Dirty> {
        let WriteState::Unsealed(u) = self else { return None };
        if u.published == Some(now) || (u.created_here && now.0 == 0) {
            return None;
        }
        let dirty = std::mem::replace(&mut u.dirty, next);
        let WriteState::Unsealed(u) = std::mem::take(self) else { unreachable!("matched above") };
        *self = WriteState::Publishing(u);
        Some(dirty)
    }

    /// Publishing → Unsealed; what was published (`None` on failure, when
    /// every chunk is checksummed again next time).
    fn end_publish(&mut self, published: Option<Stamp>) {
        let WriteState::Publishing(mut u) = std::mem::take(self) else {
            unreachable!("only a publisher ends a publish")
        };
        match published {
            Some(stamp) => {
                u.published = Some(stamp);
                u.size_recorded = true;
            }
            None => u.dirty = Dirty::All,
        }
        *self = WriteState::Unsealed(u);
    }

    /// Unsealed → Sealing for the last writer.
    fn begin_seal(&mut self) -> Option<Unsealed> {
        match std::mem::take(self) {
            WriteState::Unsealed(u) => {
                *self = WriteState::Sealing;
                Some(u)
            }
            other => {
                *self = other;
                None
            }
        }
    }

    /// Sealing → Sealed, or back to Unsealed (the metadata still says so:
    /// the next mount re-seals it) when the seal failed.
    fn end_seal(&mut self, sealed: bool) {
        debug_assert!(matches!(self, WriteState::Sealing));
        *self = match sealed {
            true => WriteState::Sealed,
            false => WriteState::Unsealed(Unsealed { dirty: Dirty::All, ..Unsealed::default() }),
        };
    }
}

impl Core {
    /// A writer opens `ino`. The first takes the write lease (unless the
    /// file was created unsealed by this open) and copies in chunks held
    /// elsewhere, with the state `Leasing` and no lock held. On failure the
    /// caller is not counted as a writer.
    pub(super) fn begin_writer(&self, ino: Ino, oi: &OpenInode, created_unsealed: bool) -> FsResult<()> {
        let lease = {
            let mut st = oi.settled_state();
            st.writers += 1;
            st.write.begin_lease()
        };
        if !lease {
            return Ok(());
        }
        let r = match created_unsealed {
            true => Ok(()),
            // Written here from now on: chunks held elsewhere come here first.
            false => self.take_write_lease(ino).map_err(FsError::from).and_then(|()| self.hydrate(ino, &oi.file)),
        };
        let mut st = oi.state.lock();
        st.write.end_lease(r.is_ok(), created_unsealed);
        st.forget_layout();
        if r.is_err() {
            st.writers -= 1;
        }
        drop(st);
        oi.changed.notify_all();
        r
    }

    /// A writer's handle is released; the last one seals the file.
    pub(super) fn end_writer(&self, ino: Ino, oi: &OpenInode) -> FsResult<()> {
        let job = {
            let mut st = oi.settled_state();
            st.writers -= 1;
            match st.writers == 0 && !st.orphaned {
                true => st.write.begin_seal(),
                false => None,
            }
        };
        let Some(unsealed) = job else { return Ok(()) };
        let r = self.final_seal(ino, oi, unsealed);
        let mut st = oi.state.lock();
        st.write.end_seal(r.is_ok());
        if r.is_ok() {
            st.forget_layout();
            // Under the state lock: an attribute read that finds the file
            // sealed also finds the counter moved.
            self.seals.bump(ino);
        }
        drop(st);
        oi.changed.notify_all();
        r
    }

    /// The seal at last close: checksums of what changed since the last
    /// publish, recorded with the sync-pending mark (the bytes are still in
    /// the page cache; the flusher syncs them before it drops the mark).
    fn final_seal(&self, ino: Ino, oi: &OpenInode, u: Unsealed) -> FsResult<()> {
        let unchanged = u.published.is_some() && stamp(&oi.file).ok() == u.published;
        let dirty = if unchanged { Dirty::None } else { u.dirty };
        let backing_empty = oi.file.metadata().is_ok_and(|m| m.len() == 0);
        if u.created_here && !u.size_recorded && backing_empty {
            // Created here and never written: recorded with size 0 at
            // create, nothing to read back or checksum.
            self.unseal_later(ino);
            return Ok(());
        }
        let inode = self.ns.getattr(ino)?;
        if inode.size == 0 && backing_empty {
            self.unseal_later(ino);
            return Ok(());
        }
        self.seal_file(&inode, &oi.file, &dirty, false, Durability::Buffered, false).map(|_| ())
    }

    /// Mark `ino` unsealed, taking its write lease. The kernel releases a
    /// file asynchronously after close(2) returns, so a writer on another
    /// node that has just closed may still hold the lease for a moment: wait
    /// for it a little before answering ETXTBSY.
    fn take_write_lease(&self, ino: Ino) -> converged_metadata::MetaResult<()> {
        let deadline = std::time::Instant::now() + LEASE_WAIT;
        loop {
            match self.ns.mark_unsealed(ino) {
                Err(MetaError::WriteLeased { .. }) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50));
                }
                other => return other,
            }
        }
    }

    pub fn write(&self, fh: u64, offset: u64, data: &[u8]) -> FsResult<u32> {
        let (_, writable, oi) = self.open.handle(fh)?;
        if !writable {
            return Err(FsError::io("write", std::io::Error::from_raw_os_error(libc::EBADF)));
        }
        if let Err(e) = oi.file.write_all_at(data, offset) {
            // A disk full of backed data makes room instead of failing.
            let t = self.tier.get().filter(|_| e.raw_os_error() == Some(libc::ENOSPC));
            let freed = match t {
                Some(t) => self.evict_until(t, t.cfg.evict_low)?,
                None => 0,
            };
            if freed == 0 {
                return Err(FsError::io("write backing file", e));
            }
            oi.file.write_all_at(data, offset).map_err(|e| FsError::io("write backing file", e))?;
        }
        let range = chunk_range(offset, data.len() as u64, self.ns.chunk_size());
        oi.state.lock().write.mark_dirty(range);
        self.stats.written_bytes.fetch_add(data.len() as u64, Ordering::Relaxed);
        Ok(data.len() as u32)
    }

    pub fn fallocate(&self, fh: u64, offset: u64, length: u64, mode: i32) -> FsResult<()> {
        let (_, writable, oi) = self.open.handle(fh)?;
        if !writable {
            return Err(FsError::io("fallocate", std::io::Error::from_raw_os_error(libc::EBADF)));
        }
        let allowed = libc::FALLOC_FL_KEEP_SIZE | libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_ZERO_RANGE;
        if mode & !allowed != 0 {
            return Err(FsError::NotSupported("fallocate mode"));
        }
        // SAFETY: plain syscall on an fd we own.
        let rc = unsafe { libc::fallocate(oi.file.as_raw_fd(), mode, offset as i64, length as i64) };
        if rc != 0 {
            return Err(FsError::io("fallocate backing file", std::io::Error::last_os_error()));
        }
        oi.state.lock().write.mark_dirty(chunk_range(offset, length, self.ns.chunk_size()));
        Ok(())
    }

    pub fn lseek(&self, fh: u64, offset: i64, whence: i32) -> FsResult<i64> {
        let (_, _, oi) = self.open.handle(fh)?;
        // SAFETY: lseek on our own fd; the backing file's offset is never used for I/O.
        let rc = unsafe { libc::lseek(oi.file.as_raw_fd(), offset, whence) };
        if rc < 0 {
            return Err(FsError::io("lseek backing file", std::io::Error::last_os_error()));
        }
        Ok(rc)
    }

    /// fsync / fdatasync: data on stable storage, then size and mtime (and
    /// every earlier namespace change) in a durable metadata commit. In a
    /// cluster the file is published too: checksummed, replicated and its
    /// layout recorded, so it survives the loss of this node.
    pub fn fsync(&self, fh: u64, datasync: bool) -> FsResult<()> {
        let (ino, _, oi) = self.open.handle(fh)?;
        let r = if datasync { oi.file.sync_data() } else { oi.file.sync_all() };
        r.map_err(|e| FsError::io("fsync backing file", e))?;
        if self.cluster.get().is_some() {
            // A durable seal carries every earlier namespace change; only
            // when there was nothing to publish is a separate sync needed.
            if !self.publish(ino, &oi, Durability::Durable)? {
                self.make_durable()?;
            }
            return Ok(());
        }
        if oi.state.lock().write.reads_backing_file() {
            // Still unsealed: the `U` mark has it re-sealed after a crash,
            // so only size and mtime are recorded here.
            let (size, mtime) = stamp(&oi.file)?;
            let seal = Seal { size, mtime, chunks: Vec::new(), keep_unsealed: true, data_durable: true };
            self.ns.seal(ino, &seal, Durability::Durable)?;
            oi.state.lock().write.size_recorded();
        } else {
            self.make_durable()?;
        }
        Ok(())
    }

    /// close(2) of a handle (FUSE flush). In a cluster a writer's close publishes the
    /// file before close returns (close-to-open across nodes); returns
    /// false when there is nothing to do here, so the kernel may stop asking.
    pub fn close(&self, fh: u64) -> FsResult<bool> {
        if self.cluster.get().is_none() {
            return Ok(false);
        }
        let (ino, writable, oi) = self.open.handle(fh)?;
        if writable {
            self.publish(ino, &oi, Durability::Buffered)?;
        }
        Ok(true)
    }

    /// Seal what a writer has written so far without giving up the write
    /// lease: checksums, replicas (per the durability mode) and layout. A
    /// file unchanged since the last publish costs one stat. Returns whether
    /// it committed a seal.
    fn publish(&self, ino: Ino, oi: &OpenInode, d: Durability) -> FsResult<bool> {
        let now = stamp(&oi.file)?;
        let next = if self.passthrough() { Dirty::All } else { Dirty::None };
        let dirty = {
            let mut st = oi.settled_state();
            if st.orphaned {
                return Ok(false);
            }
            st.write.begin_publish(now, next)
        };
        let Some(dirty) = dirty else { return Ok(false) };
        let r = self
            .ns
            .getattr(ino)
            .map_err(FsError::from)
            .and_then(|inode| self.seal_file(&inode, &oi.file, &dirty, true, d, d == Durability::Durable));
        oi.state.lock().write.end_publish(r.is_ok().then_some(now));
        oi.changed.notify_all();
        r.map(|_| true)
    }

    /// Compute checksums for the dirty chunks of `inode` from `file` and
    /// record them with the size and mtime the backing file has. This node
    /// is the primary of every chunk it seals; in a cluster the other
    /// replicas are written before the record (durability=replicated) or
    /// after it, in the background (durability=local). A chunk whose bytes
    /// did not change keeps its record, version and replicas.
    /// `data_durable`: the caller synced `file` before computing the seal.
    pub(super) fn seal_file(
        &self,
        inode: &Inode,
        file: &File,
        dirty: &Dirty,
        keep_unsealed: bool,
        d: Durability,
        data_durable: bool,
    ) -> FsResult<Inode> {
        let md = file.metadata().map_err(|e| FsError::io("stat backing file", e))?;
        let size = md.len();
        let cs = inode.chunk_size.max(1) as u64;
        let nchunks = size.div_ceil(cs) as u32;
        let which: Vec<u32> = match dirty {
            Dirty::All => (0..nchunks).collect(),
            Dirty::Chunks(set) => set.iter().copied().filter(|c| *c < nchunks).collect(),
            Dirty::None => Vec::new(),
        };
        let old: std::collections::HashMap<u32, ChunkRecord> =
            if which.is_empty() { Default::default() } else { self.ns.chunks(inode.ino)?.into_iter().collect() };
        let cluster = self.cluster.get();
        let want = match cluster {
            Some(c) if !which.is_empty() => {
                self.ns.replicas_policy(inode.ino)?.unwrap_or(c.default_replicas()).max(1) as usize
            }
            _ => 1,
        };
        let replicate_now = cluster.filter(|c| want > 1 && c.durability() == DurabilityMode::Replicated);
        let mut short = false;
        let mut chunks: Vec<(u32, ChunkRecord)> = Vec::with_capacity(which.len());
        // Replica writes in flight (position in `chunks`, task): the next
        // chunk is read and checksummed while earlier ones cross the network.
        let mut inflight = std::collections::VecDeque::new();
        let land = |chunks: &mut Vec<(u32, ChunkRecord)>, (at, task): (usize, tokio::task::JoinHandle<Vec<String>>)| {
            let c = replicate_now.expect("only replicating chunks are in flight");
            let copies = c.block_on(task).unwrap_or_default();
            let (index, record) = &mut chunks[at];
            if copies.len() + 1 < want {
                tracing::warn!(
                    ino = inode.ino,
                    chunk = *index,
                    copies = copies.len() + 1,
                    want,
                    "chunk under-replicated: too few peers answered"
                );
            }
            record.replicas.extend(copies);
        };
        for index in which {
            let start = index as u64 * cs;
            let len = (size - start).min(cs);
            // Bytes that go to peers are read once, and checksummed as sent.
            let data = match replicate_now {
                Some(_) => {
                    let mut data = vec![0u8; len as usize];
                    read_exact_at(file, &mut data, start).map_err(|e| FsError::io("read chunk to replicate", e))?;
                    Some(data)
                }
                None => None,
            };
            let block_crcs = match &data {
                Some(data) => data.chunks(BLOCK_SIZE as usize).map(crc32c::crc32c).collect(),
                None => block_crcs(file, start, len).map_err(|e| FsError::io("checksum backing file", e))?,
            };
            let previous = old.get(&index);
            if let Some(o) = previous {
                if o.len as u64 == len && o.block_crcs == block_crcs && o.replicas.iter().any(|r| r == self.node_id()) {
                    short |= o.replicas.len() < want;
                    continue;
                }
            }
            let record = ChunkRecord {
                version: previous.map_or(1, |o| o.version + 1),
                len: len as u32,
                replicas: vec![self.node_id().to_string()],
                block_crcs,
            };
            if let (Some(c), Some(data)) = (replicate_now, data) {
                let ranked = c.plan(inode.ino, index, &record.replicas);
                let last = start + len == size;
                let push = c.clone().push(inode.ino, index, start, Arc::new(data), last, want - 1, ranked);
                inflight.push_back((chunks.len(), c.spawn(push)));
            }
            chunks.push((index, record));
            while inflight.len() >= REPLICATION_WINDOW {
                land(&mut chunks, inflight.pop_front().expect("not empty"));
            }
        }
        while let Some(f) = inflight.pop_front() {
            land(&mut chunks, f);
        }
        short |= chunks.iter().any(|(_, r)| r.replicas.len() < want);
        let mtime = ts_from(md.mtime(), md.mtime_nsec());
        let seal = Seal { size, mtime, chunks, keep_unsealed, data_durable };
        let sealed = self.ns.seal(inode.ino, &seal, d)?;
        self.stats.seals.fetch_add(1, Ordering::Relaxed);
        if let Some(t) = self.tier.get() {
            t.enqueue(inode.ino, t.cfg.backfill_delay);
        }
        if short {
            self.under_replicated.0.lock().insert(inode.ino);
            self.under_replicated.1.notify_one();
        }
        Ok(sealed)
    }
}

pub(super) fn stamp(file: &File) -> FsResult<Stamp> {
    let md = file.metadata().map_err(|e| FsError::io("stat backing file", e))?;
    Ok((md.len(), ts_from(md.mtime(), md.mtime_nsec())))
}

pub(super) fn set_file_times(file: &File, inode: &Inode) -> FsResult<()> {
    let times = [
        libc::timespec { tv_sec: inode.atime.sec, tv_nsec: inode.atime.nsec as i64 },
        libc::timespec { tv_sec: inode.mtime.sec, tv_nsec: inode.mtime.nsec as i64 },
    ];
    // SAFETY: futimens on our own fd with a two-element array.
    if unsafe { libc::futimens(file.as_raw_fd(), times.as_ptr()) } != 0 {
        return Err(FsError::io("set backing file times", std::io::Error::last_os_error()));
    }
    Ok(())
}
