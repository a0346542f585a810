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
//!
//!   Unsealed, Publishing, Sealing ──(lease lost)──▶ Fenced ──(last writer)──▶ Sealing ──▶ Sealed
//!                                                          (local copy made to match the layout)
//! ```
//!
//! The long work of each transitional state (`Leasing`, `Publishing`,
//! `Sealing`) runs with no lock held; whoever needs a settled state waits on
//! `OpenInode::changed`.
//!
//! While a session is `Unsealed`, the streamer worker copies the full chunks
//! its writer has moved past to their replicas (`begin_stream` /
//! `end_stream`, with no lock held in between); a publish or the seal waits
//! out a stream under way and uses each streamed chunk whose bytes did not
//! change since, so a large write's fsync sends only its tail. Every chunk
//! version a session hands out is above the last one it handed out (its
//! `floor`), so two sends of different bytes never share a version.
//!
//! A write lease carries an epoch ([`Unsealed::lease`]); every publish and
//! seal commits only while the file's lease is still this node's at that
//! epoch. A node paused or cut off for longer than its membership lease may
//! find its lease taken over: its session is then `Fenced`. What it wrote
//! since its last publish is never published; `fsync` and `close` fail
//! with `EIO`; and at its last close the local copy is brought back to what
//! the layout records (chunks re-read from their holders, or this node's
//! copy dropped from the record).

use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::sync::atomic::Ordering;
use std::time::Duration;

use converged_metadata::types::*;
use converged_metadata::{Durability, MetaError, Seal, SessionEnd};

use super::open::OpenInode;
use super::{chunk_range, Caller, Core};
use crate::cluster::DurabilityMode;
use crate::error::{FsError, FsResult};

/// How long an open for writing waits for another node's write lease.
const LEASE_WAIT: Duration = Duration::from_secs(2);

use super::backing::{stamp, Stamp};

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

/// Files up to this size have their copy here synced by the seal at their
/// last release (in a cluster, beside the peers' copies), instead of marked
/// for the flusher to sync within a second: the mark's put and delete, two
/// etcd writes a file, are saved. The release is not waited for by
/// close(2); under `--nowsync` it publishes every file made in a delegated
/// directory. Larger files keep the mark: a release does not wait for the
/// writeback of a checkpoint's local gigabytes.
pub(super) const SYNC_HERE_MAX: u64 = 4 << 20;

/// What a writer here has that the metadata does not.
#[derive(Default)]
pub(super) struct Unsealed {
    dirty: Dirty,
    /// What the last publish (close or fsync in a cluster) recorded.
    published: Option<Stamp>,
    /// Created by this open, with no session of the file ended since (its
    /// record is the create's): an empty file needs no seal...
    created_here: bool,
    /// ... unless an fsync recorded a size for it meanwhile.
    size_recorded: bool,
    /// A publish was begun (it may have committed even if it failed): the
    /// file may have chunk records. Until then a file created here has none.
    publish_begun: bool,
    /// The epoch of the write lease this node took: every seal of this
    /// session carries it, so that it fails once another node took over.
    lease: u64,
    /// The node's membership lapsed during a publish: the session is
    /// fenced when the publish ends.
    fence_after_publish: bool,
    /// Full chunks copied to peers while writes went on (see
    /// [`Core::stream_step`]), not recorded yet: the next publish uses
    /// each one whose bytes did not change since.
    streamed: std::collections::BTreeMap<u32, Streamed>,
    /// Chunks a stream looked at this session (streamed or not worth it):
    /// each is looked at once.
    stream_seen: std::collections::BTreeSet<u32>,
    /// A stream of this session's chunks is under way: a publish or the
    /// seal waits it out (and no second stream begins).
    streaming: bool,
    /// The highest chunk version this session handed out (streamed or
    /// published): every new one is above it, so no two sends of different
    /// bytes ever share a version.
    floor: u64,
    /// Mode, owner, group and times set on the file while it is written
    /// here, held back until the next publish or seal records them with the
    /// bytes (see [`WriteState::defer_attrs`]).
    attrs: Option<Box<SetAttr>>,
}

/// A full chunk a writer's node copied to peers before its publish.
#[derive(Debug, Clone)]
pub(super) struct Streamed {
    pub version: u64,
    pub len: u32,
    pub block_crcs: Vec<u32>,
    /// The peers that stored it.
    pub copies: Vec<String>,
}

/// The chunks a stream looked at, with what it copied of each.
pub(super) type Looked = Vec<(u32, Option<Streamed>)>;

/// What a stream of a writing session's chunks starts from.
pub(super) struct StreamJob {
    pub lease: u64,
    pub floor: u64,
    /// Chunks looked at already this session.
    pub seen: std::collections::BTreeSet<u32>,
    /// The file has no chunk records yet.
    pub fresh: bool,
}

/// What a publish seals: the chunks to checksum, under which lease, and
/// whether the file can have no chunk records yet.
struct Publish {
    dirty: Dirty,
    lease: u64,
    fresh: bool,
    streamed: std::collections::BTreeMap<u32, Streamed>,
    floor: u64,
    attrs: Option<SetAttr>,
}

/// How a seal is committed.
pub(super) struct SealAs<'a> {
    /// The file stays unsealed (a publish while writers remain).
    pub keep_unsealed: bool,
    pub durability: Durability,
    /// The backing file was synced before the checksums were computed.
    pub data_durable: bool,
    /// Sync the backing file while the peers take their copies, when any
    /// do and it is small (a last seal; see [`SYNC_HERE_MAX`]): the seal then
    /// records every copy on stable storage, and no sync-pending mark is
    /// left for the flusher to sync and clear (two etcd writes a file).
    pub sync_here: bool,
    /// The write lease the seal is made under (`None`: recovery).
    pub lease: Option<u64>,
    /// The file has no chunk records yet (created by this writing session,
    /// never published): none to read before sealing.
    pub fresh: bool,
    /// Chunks streamed to peers before this seal (used where unchanged).
    pub streamed: std::collections::BTreeMap<u32, Streamed>,
    /// Every chunk version this seal hands out is above this, which is
    /// raised to each one handed out (even by a seal that then fails).
    pub floor: &'a std::cell::Cell<u64>,
    /// Attributes held back until this seal.
    pub attrs: Option<SetAttr>,
}

/// What the last writer's release does.
pub(super) enum SealJob {
    /// Commit the session's seal.
    Seal(Unsealed),
    /// The session was fenced: make the local copy match the layout.
    Reconcile { lease: u64 },
}

/// How the last writer's release ends.
enum SealEnd {
    /// The file is sealed, or a fenced session's local copy reconciled.
    Sealed,
    /// The seal failed, the lease (this epoch) is still held: the file
    /// stays unsealed, to be sealed at the next close or mount.
    Retry(u64),
}

/// Why a publish or seal failed, for the state it leaves.
pub(super) enum Lost {
    /// The write lease is gone: the session is fenced.
    Lease,
    /// Anything else: nothing is lost, the next publish tries again.
    Nothing,
}

impl Lost {
    fn of(e: &FsError) -> Self {
        match e {
            FsError::Meta(MetaError::LeaseLost { .. }) => Lost::Lease,
            _ => Lost::Nothing,
        }
    }
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
    /// The last writer released the file and its seal is being committed
    /// (or, after a fenced session, its local copy made to match the
    /// layout). Openers wait.
    Sealing,
    /// The write lease was lost (taken over by another node while this one
    /// was cut off, at the epoch recorded here): nothing more of this
    /// session is published. Writers still open here get `EIO` from
    /// `fsync` and `close`; readers read the published layout.
    Fenced { lease: u64 },
}

impl WriteState {
    /// Work under way that others must wait out.
    pub fn in_transition(&self) -> bool {
        matches!(self, WriteState::Leasing | WriteState::Publishing(_) | WriteState::Sealing)
    }

    /// Hold back `attr` (mode, owner, group, times; never a size) until
    /// the next publish or seal, which records it with the bytes; `now`
    /// stands for `TimeSet::Now` and is the change's ctime. Only for a file
    /// created by this session and not published yet (others see it empty
    /// until then anyway), or one whose held-back changes a failed publish
    /// left: a later change must not commit before an earlier one held
    /// here. Returns whether it was held back.
    pub(super) fn defer_attrs(&mut self, attr: &SetAttr, now: Timespec) -> bool {
        let WriteState::Unsealed(u) = self else { return false };
        if attr.size.is_some() || !(u.attrs.is_some() || (u.created_here && !u.publish_begun)) {
            return false;
        }
        let resolve = |t: Option<TimeSet>| {
            t.map(|t| {
                TimeSet::At(match t {
                    TimeSet::Now => now,
                    TimeSet::At(ts) => ts,
                })
            })
        };
        let change = SetAttr {
            atime: resolve(attr.atime),
            mtime: resolve(attr.mtime),
            ctime: Some(attr.ctime.unwrap_or(now)),
            ..attr.clone()
        };
        u.attrs.get_or_insert_with(Box::default).merge(&change);
        true
    }

    /// Attribute changes held back for the next publish or seal.
    pub(super) fn held_attrs(&self) -> Option<&SetAttr> {
        match self {
            WriteState::Unsealed(u) | WriteState::Publishing(u) => u.attrs.as_deref(),
            _ => None,
        }
    }

    /// Whether the backing file, not the metadata's layout, holds the bytes.
    pub fn reads_backing_file(&self) -> bool {
        matches!(self, WriteState::Unsealed(_) | WriteState::Publishing(_) | WriteState::Sealing)
    }

    /// Whether a stream of this session's chunks is under way.
    pub fn is_streaming(&self) -> bool {
        matches!(self, WriteState::Unsealed(u) if u.streaming)
    }

    /// Whether the session here lost its write lease.
    pub fn is_fenced(&self) -> bool {
        matches!(self, WriteState::Fenced { .. })
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

    /// Sealed → Unsealed under `lease` for a writer taken over from an
    /// earlier daemon of this mount: what it wrote since its last publish is
    /// in the backing file, with no record of which chunks, so every chunk
    /// is checksummed again, and the file may have chunk records.
    fn adopt(&mut self, lease: u64) {
        if matches!(self, WriteState::Sealed) {
            *self =
                WriteState::Unsealed(Unsealed { lease, dirty: Dirty::All, publish_begun: true, ..Unsealed::default() });
        }
    }

    /// Leasing → Unsealed under lease `token`, or back to Sealed when the
    /// lease was not had.
    fn end_lease(&mut self, leased: Option<u64>, created_here: bool) {
        debug_assert!(matches!(self, WriteState::Leasing));
        *self = match leased {
            Some(lease) => WriteState::Unsealed(Unsealed { created_here, lease, ..Unsealed::default() }),
            None => WriteState::Sealed,
        };
    }

    /// The lease of the writing session here, if there is one.
    fn lease(&self) -> Option<u64> {
        match self {
            WriteState::Unsealed(u) | WriteState::Publishing(u) => Some(u.lease),
            _ => None,
        }
    }

    /// The lease is gone (taken over, or this node's membership lapsed):
    /// Unsealed → Fenced now, Publishing → Fenced when the publish ends.
    /// Returns the epoch to release when the session is fenced now.
    pub(super) fn fence(&mut self) -> Option<u64> {
        match self {
            WriteState::Unsealed(u) => {
                let lease = u.lease;
                *self = WriteState::Fenced { lease };
                Some(lease)
            }
            WriteState::Publishing(u) => {
                u.fence_after_publish = true;
                None
            }
            _ => None,
        }
    }

    /// Unsealed, not streaming → streaming: what the stream starts from.
    fn begin_stream(&mut self) -> Option<StreamJob> {
        let WriteState::Unsealed(u) = self else { return None };
        if u.streaming {
            return None;
        }
        u.streaming = true;
        Some(StreamJob {
            lease: u.lease,
            floor: u.floor,
            seen: u.stream_seen.clone(),
            fresh: u.created_here && !u.publish_begun,
        })
    }

    /// The stream ended: the chunks it copied, and the highest version it
    /// handed out. A session fenced meanwhile keeps nothing of it.
    fn end_stream(&mut self, looked: Looked, floor: u64) {
        if let WriteState::Unsealed(u) = self {
            u.streaming = false;
            u.floor = u.floor.max(floor);
            for (index, streamed) in looked {
                u.stream_seen.insert(index);
                if let Some(s) = streamed {
                    u.streamed.insert(index, s);
                }
            }
        }
    }

    /// Unsealed → Publishing when the backing file changed since the last
    /// publish; returns the chunks to checksum. `next` is what tracking
    /// starts again from (everything, when writes bypass the daemon).
    fn begin_publish(&mut self, now: Stamp, next: Dirty) -> Option<Publish> {
        let WriteState::Unsealed(u) = self else { return None };
        if (u.published == Some(now) || (u.created_here && now.0 == 0)) && u.attrs.is_none() {
            return None;
        }
        debug_assert!(!u.streaming, "a publish waits out the stream");
        let dirty = std::mem::replace(&mut u.dirty, next);
        let WriteState::Unsealed(mut u) = std::mem::take(self) else { unreachable!("matched above") };
        let publish = Publish {
            dirty,
            lease: u.lease,
            fresh: u.created_here && !u.publish_begun,
            streamed: std::mem::take(&mut u.streamed),
            floor: u.floor,
            attrs: u.attrs.as_deref().cloned(),
        };
        u.publish_begun = true;
        *self = WriteState::Publishing(u);
        Some(publish)
    }

    /// Publishing → Unsealed with what was published, or back to Unsealed
    /// with every chunk to checksum again when the publish failed, or to
    /// Fenced when it found the lease lost.
    fn end_publish(&mut self, published: Result<Stamp, Lost>, floor: u64) {
        let WriteState::Publishing(mut u) = std::mem::take(self) else {
            unreachable!("only a publisher ends a publish")
        };
        u.floor = u.floor.max(floor);
        *self = match published {
            Err(Lost::Lease) => WriteState::Fenced { lease: u.lease },
            _ if u.fence_after_publish => WriteState::Fenced { lease: u.lease },
            Ok(stamp) => {
                u.published = Some(stamp);
                u.size_recorded = true;
                // Recorded with the bytes (no setattr joins a publish under way).
                u.attrs = None;
                WriteState::Unsealed(u)
            }
            Err(Lost::Nothing) => {
                u.dirty = Dirty::All;
                WriteState::Unsealed(u)
            }
        };
    }

    /// Unsealed or Fenced → Sealing for the last writer: the seal to
    /// commit, or the fenced lease whose local copy is to be reconciled.
    /// The copy of an orphan (purged at its last close) is not reconciled.
    /// An orphan is never sealed: it stays Unsealed and goes with its purge.
    fn begin_seal(&mut self, orphaned: bool) -> Option<SealJob> {
        match (std::mem::take(self), orphaned) {
            (WriteState::Unsealed(u), false) => {
                *self = WriteState::Sealing;
                Some(SealJob::Seal(u))
            }
            (WriteState::Fenced { lease }, false) => {
                *self = WriteState::Sealing;
                Some(SealJob::Reconcile { lease })
            }
            (WriteState::Fenced { .. }, true) => {
                *self = WriteState::Sealed;
                None
            }
            (other, _) => {
                *self = other;
                None
            }
        }
    }

    /// Sealing → Sealed; or, when the seal failed for another reason than
    /// a lost lease, back to Unsealed under the same lease (the metadata
    /// still says so: the next mount re-seals it).
    fn end_seal(&mut self, end: SealEnd) {
        debug_assert!(matches!(self, WriteState::Sealing));
        *self = match end {
            SealEnd::Sealed => WriteState::Sealed,
            SealEnd::Retry(lease) => WriteState::Unsealed(Unsealed { dirty: Dirty::All, lease, ..Unsealed::default() }),
        };
    }
}

impl Core {
    /// A writer opens `ino`. The first takes the write lease (the creator
    /// of a file created unsealed has it from the create, unless a writing
    /// session of the file ended here since) and copies in chunks held
    /// elsewhere, with the state `Leasing` and no lock held. On failure the
    /// caller is not counted as a writer. A session that lost its lease
    /// admits no new writer until its last one is gone.
    pub(super) fn begin_writer(
        &self,
        ino: Ino,
        oi: &OpenInode,
        created: Option<&super::attr::SealSnapshot>,
    ) -> FsResult<()> {
        let lease = {
            let mut st = oi.settled_state();
            if st.write.is_fenced() {
                return Err(lease_lost());
            }
            st.writers += 1;
            st.write.begin_lease()
        };
        if !lease {
            return Ok(());
        }
        // Created by this open, and no session of the file ended since (one
        // that opened the new name first may have sealed bytes into it).
        let created_here = created.is_some_and(|snap| self.seals.none_ended_since(snap, ino));
        let r = match created_here {
            true => Ok(converged_metadata::CREATE_LEASE),
            // Written here from now on: chunks held elsewhere come here first.
            false => self.take_write_lease(ino).map_err(FsError::from).and_then(|lease| {
                self.hydrate(ino, &oi.file)?;
                self.keep_sole_copies(ino, &oi.file)?;
                Ok(lease)
            }),
        };
        let mut st = oi.state();
        st.write.end_lease(r.as_ref().ok().copied(), created_here);
        st.forget_layout();
        if r.is_err() {
            st.writers -= 1;
        }
        drop(st);
        oi.changed.notify_all();
        r.map(|_| ())
    }

    /// A writer's handle taken over from an earlier daemon of this mount,
    /// whose session is unsealed under `lease` (see [`Core::adopt`]).
    pub(super) fn adopt_writer(&self, oi: &OpenInode, lease: u64) {
        let mut st = oi.state();
        st.writers += 1;
        st.write.adopt(lease);
        st.forget_layout();
    }

    /// A writer's handle is released; the last one seals the file, or, when
    /// its session was fenced, brings the local copy back to the layout
    /// and reports the lost writes (`EIO`).
    pub(super) fn end_writer(&self, ino: Ino, oi: &OpenInode) -> FsResult<()> {
        // A failed look is no reason to keep the writer counted: the seal
        // below meets the same metadata and reports what it finds.
        if self.cluster.get().is_some() {
            if let Err(e) = self.orphaned_elsewhere(ino, oi) {
                tracing::debug!(ino, error = %e, "could not look whether another node removed a file written here");
            }
        }
        let job = {
            let mut st = oi.quiet_state();
            st.writers -= 1;
            match st.writers == 0 {
                true => {
                    let orphaned = st.orphaned;
                    st.write.begin_seal(orphaned)
                }
                false => None,
            }
        };
        let Some(job) = job else { return Ok(()) };
        let (end, result) = match job {
            SealJob::Seal(u) => {
                let lease = u.lease;
                match self.final_seal(ino, oi, u) {
                    Ok(()) => (SealEnd::Sealed, Ok(())),
                    Err(e) => match Lost::of(&e) {
                        Lost::Lease => {
                            self.reconcile_fenced(ino, oi, lease);
                            (SealEnd::Sealed, Err(e))
                        }
                        Lost::Nothing => (SealEnd::Retry(lease), Err(e)),
                    },
                }
            }
            SealJob::Reconcile { lease } => {
                self.reconcile_fenced(ino, oi, lease);
                (SealEnd::Sealed, Err(lease_lost()))
            }
        };
        if result.is_ok() {
            self.owed.lock().remove(&ino);
        }
        let mut st = oi.state();
        st.write.end_seal(end);
        st.forget_layout();
        // Under the state lock: an attribute read that finds the file
        // sealed also finds the counter moved, and a create racing this
        // session's end takes its lease anew.
        self.seals.bump(ino);
        drop(st);
        oi.changed.notify_all();
        result
    }

    /// The seal at last close: checksums of what changed since the last
    /// publish, recorded with the sync-pending mark (the bytes are still in
    /// the page cache; the flusher syncs them before it drops the mark),
    /// or, for a small file in a cluster, with its copy here synced beside
    /// the peers' (see [`SYNC_HERE_MAX`]). A file with nothing to record
    /// (unchanged since its publish, or closed empty) only gives up its
    /// lease, in a batch with others.
    fn final_seal(&self, ino: Ino, oi: &OpenInode, u: Unsealed) -> FsResult<()> {
        let unchanged = u.published.is_some() && stamp(&oi.file).ok() == u.published;
        if unchanged && u.attrs.is_none() {
            // The last publish (this close's, in a cluster) recorded the
            // layout: only the lease is left to give up, with others.
            self.end_session_later(SessionEnd::Published { ino, lease: u.lease });
            return Ok(());
        }
        let dirty = if unchanged { Dirty::None } else { u.dirty };
        let backing_empty = oi.file.metadata().is_ok_and(|m| m.len() == 0);
        if u.created_here && !u.size_recorded && backing_empty && u.attrs.is_none() {
            // Created here and never written: recorded with size 0 at
            // create, nothing to read back or checksum.
            self.end_session_later(SessionEnd::Empty(ino));
            return Ok(());
        }
        let inode = self.ns.getattr(ino)?;
        if inode.size == 0 && backing_empty && u.attrs.is_none() {
            self.end_session_later(SessionEnd::Empty(ino));
            return Ok(());
        }
        let how = SealAs {
            keep_unsealed: false,
            durability: Durability::Buffered,
            data_durable: false,
            sync_here: true,
            lease: Some(u.lease),
            fresh: u.created_here && !u.publish_begun,
            streamed: u.streamed,
            floor: &std::cell::Cell::new(u.floor),
            attrs: u.attrs.map(|a| *a),
        };
        self.seal_file(&inode, &oi.file, &dirty, how).map(|_| ())
    }

    /// Mark `ino` unsealed, taking its write lease. A writer on another
    /// node that has just closed may still hold the lease for a moment (the
    /// kernel releases a file after close(2) returns, and a file unchanged
    /// since the close published it gives its lease up at that node's next
    /// flush, within a second): wait for it a little before answering
    /// ETXTBSY.
    fn take_write_lease(&self, ino: Ino) -> converged_metadata::MetaResult<u64> {
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

    /// This node's membership lapsed (it was paused or cut off for longer
    /// than its lease, and has registered again): every writing session
    /// here is fenced, and the write leases it held are given up. Another
    /// node may have taken them over and written meanwhile.
    pub fn fence_all_writers(&self) {
        for oi in self.open.all() {
            let lease = oi.state().write.fence();
            let Some(lease) = lease else { continue };
            let ino = oi.ino;
            tracing::warn!(ino, "membership lapsed: this node's writes to the file since its last publish are dropped");
            if let Err(e) = self.ns.release_lease(ino, lease) {
                tracing::warn!(ino, error = %e, "could not release the write lease; it is fenced all the same");
            }
        }
    }

    pub fn write(&self, fh: u64, offset: u64, data: &[u8]) -> FsResult<u32> {
        let (_, writable, oi) = self.open.handle(fh)?;
        if !writable {
            return Err(FsError::io("write", std::io::Error::from_raw_os_error(libc::EBADF)));
        }
        let range = chunk_range(offset, data.len() as u64, self.ns.chunk_size());
        changing_bytes(&oi, range, || {
            let Err(e) = oi.file.write_all_at(data, offset) else { return Ok(()) };
            // A disk full of backed data makes room instead of failing.
            let t = self.tier.get().filter(|_| e.raw_os_error() == Some(libc::ENOSPC));
            let freed = match t {
                Some(t) => self.evict_until(t, t.cfg.evict_low)?,
                None => 0,
            };
            if freed == 0 {
                return Err(FsError::io("write backing file", e));
            }
            oi.file.write_all_at(data, offset).map_err(|e| FsError::io("write backing file", e))
        })?;
        self.stats.written_bytes.fetch_add(data.len() as u64, Ordering::Relaxed);
        Ok(data.len() as u32)
    }

    /// fallocate by `caller`. Returns whether the file's mode changed (a
    /// set-ID bit cleared: see [`Core::drop_setid`]), so the kernel's
    /// attributes are stale.
    pub fn fallocate(&self, fh: u64, offset: u64, length: u64, mode: i32, caller: &Caller) -> FsResult<bool> {
        let (ino, writable, oi) = self.open.handle(fh)?;
        if !writable {
            return Err(FsError::io("fallocate", std::io::Error::from_raw_os_error(libc::EBADF)));
        }
        let allowed = libc::FALLOC_FL_KEEP_SIZE | libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_ZERO_RANGE;
        if mode & !allowed != 0 {
            return Err(FsError::NotSupported("fallocate mode"));
        }
        changing_bytes(&oi, chunk_range(offset, length, self.ns.chunk_size()), || {
            // SAFETY: plain syscall on an fd we own.
            let rc = unsafe { libc::fallocate(oi.file.as_raw_fd(), mode, offset as i64, length as i64) };
            match rc {
                0 => Ok(()),
                _ => Err(FsError::io("fallocate backing file", std::io::Error::last_os_error())),
            }
        })?;
        self.drop_setid(ino, caller)
    }

    /// After `caller` changed a file's bytes: its set-ID bits as the kernel
    /// would leave them (root keeps them). Returns whether they changed.
    pub fn drop_setid(&self, ino: Ino, caller: &Caller) -> FsResult<bool> {
        if caller.uid == 0 {
            return Ok(false);
        }
        let inode = self.ns.getattr(ino)?;
        if inode.perm & (libc::S_ISUID | libc::S_ISGID) as u16 == 0 {
            return Ok(false);
        }
        let member_of = caller.in_group(inode.gid).then_some(inode.gid);
        Ok(self.ns.clear_setid(ino, member_of)?)
    }

    /// fsync / fdatasync: data on stable storage, then size and mtime (and
    /// every earlier namespace change) in a durable metadata commit. In a
    /// cluster the file is published too: checksummed, replicated and its
    /// layout recorded, so it survives the loss of this node.
    pub fn fsync(&self, fh: u64, datasync: bool) -> FsResult<()> {
        let (ino, writable, oi) = self.open.handle(fh)?;
        let r = if datasync { oi.file.sync_data() } else { oi.file.sync_all() };
        r.map_err(|e| FsError::io("fsync backing file", e))?;
        if writable && oi.state().write.is_fenced() {
            return Err(lease_lost());
        }
        if self.cluster.get().is_some() {
            // A durable seal carries every earlier namespace change; only
            // when there was nothing to publish is a separate sync needed.
            if !self.publish(ino, &oi, Durability::Durable)? {
                self.make_durable()?;
            }
            return Ok(());
        }
        let (writing, lease) = {
            let st = oi.state();
            (st.write.reads_backing_file(), st.write.lease())
        };
        if writing {
            // Still unsealed: the `U` mark has it re-sealed after a crash,
            // so only size and mtime are recorded here.
            let (size, mtime) = stamp(&oi.file)?;
            let seal =
                Seal { size, mtime, chunks: Vec::new(), keep_unsealed: true, lease, data_durable: true, attrs: None };
            self.ns.seal(ino, &seal, Durability::Durable)?;
            oi.state().write.size_recorded();
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
        if writable && self.ns.close_unpublished(ino) {
            // --nowsync: a file made here in a directory delegated here, of
            // which nothing is committed yet, is seen by no other node
            // before the directory is recalled, which publishes it first
            // (as do fsync, fsyncdir and unmount); its last release
            // publishes it otherwise. close(2) need not wait.
            self.owed.lock().insert(ino);
            return Ok(true);
        }
        if writable {
            self.publish(ino, &oi, Durability::Buffered)?;
        }
        Ok(true)
    }

    /// Publish every file whose close was not waited for (--nowsync): a
    /// node is about to read their directory, or its names become durable.
    pub(super) fn publish_owed(&self) {
        let owed = std::mem::take(&mut *self.owed.lock());
        for ino in owed {
            let Some(oi) = self.open.get(ino) else { continue };
            if let Err(e) = self.publish(ino, &oi, Durability::Buffered) {
                tracing::warn!(ino, error = %e, "could not publish a file closed under --nowsync");
            }
        }
    }

    /// Seal what a writer has written so far without giving up the write
    /// lease: checksums, replicas (per the durability mode) and layout. A
    /// file unchanged since the last publish costs one stat. Returns whether
    /// it committed a seal.
    /// Fails with `EIO` once the session lost its write lease.
    fn publish(&self, ino: Ino, oi: &OpenInode, d: Durability) -> FsResult<bool> {
        if self.orphaned_elsewhere(ino, oi)? {
            return Ok(false);
        }
        let now = stamp(&oi.file)?;
        let next = if self.passthrough() { Dirty::All } else { Dirty::None };
        let dirty = {
            let mut st = oi.quiet_state();
            if st.write.is_fenced() {
                return Err(lease_lost());
            }
            if st.orphaned {
                return Ok(false);
            }
            st.write.begin_publish(now, next)
        };
        let Some(Publish { dirty, lease, fresh, streamed, floor, attrs }) = dirty else { return Ok(false) };
        let floor = std::cell::Cell::new(floor);
        let how = SealAs {
            keep_unsealed: true,
            durability: d,
            data_durable: d == Durability::Durable,
            // close(2) waits for this publish: the copy here is left to the
            // flusher, which syncs a second's worth at once under their
            // marks (on one shared disk a sync per close made an untar on 2
            // nodes 10% slower; see `SYNC_HERE_MAX`).
            sync_here: false,
            lease: Some(lease),
            fresh,
            streamed,
            floor: &floor,
            attrs,
        };
        let r =
            self.ns.getattr(ino).map_err(FsError::from).and_then(|inode| self.seal_file(&inode, &oi.file, &dirty, how));
        let fenced = {
            let mut st = oi.state();
            st.write.end_publish(r.as_ref().map(|_| now).map_err(Lost::of), floor.get());
            st.write.is_fenced()
        };
        oi.changed.notify_all();
        if fenced {
            tracing::warn!(ino, "write lease lost: what was written here since the last publish is dropped");
            if let Err(e) = self.ns.release_lease(ino, lease) {
                tracing::debug!(ino, error = %e, "could not release a fenced lease");
            }
            return Err(lease_lost());
        }
        r.map(|_| true)
    }
}

impl Core {
    /// Whether `ino`, open for writing here, lost its last name to another
    /// node (which does not know it is open here and purged it, or left it
    /// an orphan). It is then this node's orphan: nothing more of it is
    /// sealed, its close succeeds and its last release here purges what is
    /// left, as for a file unlinked here while open. (Its bytes go with it,
    /// as POSIX has them go at the last close of an unlinked file; until
    /// then reads on other nodes' open handles fail, as NFS's do.)
    fn orphaned_elsewhere(&self, ino: Ino, oi: &OpenInode) -> FsResult<bool> {
        let gone = match self.ns.getattr(ino) {
            Ok(inode) => inode.nlink == 0,
            Err(MetaError::NotFound) => true,
            Err(e) => return Err(e.into()),
        };
        if gone {
            oi.state().orphaned = true;
        }
        Ok(gone)
    }

    /// One pass of the streamer: the full chunks that writers here have
    /// moved past are copied to peers while the writes go on (in a cluster
    /// whose durability is `replicated`), at most [`REPLICATION_WINDOW`](super::seal::REPLICATION_WINDOW) of
    /// a file at once, so that a publish (close, fsync) sends only what
    /// changed since and the tail. A chunk is looked at once per writing
    /// session: the first time the file reaches past its end with no hole in
    /// it. Chunks the layout already records whole are left to the publish.
    /// Returns how many chunks it copied.
    pub fn stream_step(&self) -> usize {
        let Some(c) = self.cluster.get() else { return 0 };
        // Asked only when a writer is here (it reads membership).
        let mut streams = None;
        let mut copied = 0;
        for oi in self.open.all() {
            let job = {
                let mut st = oi.state();
                match st.orphaned {
                    true => None,
                    false => st.write.begin_stream(),
                }
            };
            let Some(job) = job else { continue };
            let streams =
                *streams.get_or_insert_with(|| c.durability() == DurabilityMode::Replicated && c.placeable(c.node()));
            let (looked, floor) = match streams {
                true => self.stream_file(c, &oi, &job).unwrap_or_else(|e| {
                    tracing::debug!(ino = oi.ino, error = %e, "streaming chunks to peers failed; the publish sends them");
                    (Vec::new(), job.floor)
                }),
                false => (Vec::new(), job.floor),
            };
            copied += looked.iter().filter(|(_, s)| s.as_ref().is_some_and(|s| !s.copies.is_empty())).count();
            oi.state().write.end_stream(looked, floor);
            oi.changed.notify_all();
        }
        copied
    }
}

/// The error a fenced session's fsync and close return (`EIO`).
fn lease_lost() -> FsError {
    FsError::Meta(MetaError::LeaseLost { holder: String::new() })
}

/// Change chunks `range` of a writer's backing file with `change`, marking
/// them dirty before and after. A publish stats the file, then takes the
/// dirty set to checksum, and counts on the stat to tell whether anything
/// changed after it: a change that lands before its stat is marked in the
/// set it takes (the mark before), and one whose set was taken before the
/// change is marked in the next (the mark after). Marked only after, a
/// change between the stat and the mark would be in neither, and a last
/// close finding the file as that publish saw it would seal stale checksums.
pub(super) fn changing_bytes<T>(
    oi: &OpenInode,
    range: std::ops::RangeInclusive<u32>,
    change: impl FnOnce() -> FsResult<T>,
) -> FsResult<T> {
    oi.state().write.mark_dirty(range.clone());
    let changed = change();
    oi.state().write.mark_dirty(range);
    changed
}
