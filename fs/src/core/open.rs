//! Files open on this node: the handle table (fh → handle), the open-inode
//! table (ino → per-inode state, or a gate that holds a closed inode
//! closed), and the choice of the kernel's I/O mode for each handle.
//!
//! This module owns locks (1) and (2) of the order in `core/mod.rs`; it
//! never calls the namespace or the disk while holding them.

use std::fs::File;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use converged_metadata::held_locks::{Mutex, MutexGuard};
use converged_metadata::types::*;
use dashmap::DashMap;
use parking_lot::Condvar;

use super::read::Layout;
use super::write::WriteState;
use super::Core;
use crate::error::{FsError, FsResult};
use crate::remote::Readahead;

/// What an open hands back: the handle, and the backing file when reads and
/// writes may go straight to it (kernel passthrough).
pub struct Opened {
    pub fh: u64,
    pub backing: Option<Arc<File>>,
    /// The kernel's cached attributes of the inode must be dropped before
    /// the open returns: another node may have changed the file (in a
    /// cluster, close-to-open), and the kernel cuts reads at the size it
    /// holds.
    pub refresh_attrs: bool,
    /// How the kernel does the handle's I/O (`Direct`: served by the daemon
    /// outside the page cache, FOPEN_DIRECT_IO); what a later daemon adopts it as.
    pub io: Io,
}

/// How the kernel does a handle's I/O. It refuses a passthrough open while
/// a cached one of the same inode is open, and the reverse (the open fails
/// with EIO), but direct I/O opens mix with both; so a new open follows
/// the mode of the handles already open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Io {
    /// Kernel passthrough to the backing file.
    Passthrough,
    /// Through the daemon, with the kernel's page cache.
    Cached,
    /// Through the daemon, without the page cache: beside passthrough
    /// handles, and for the core's own handles (truncation).
    Direct,
}

pub(super) struct Handle {
    pub ino: Ino,
    pub writable: bool,
    pub io: Io,
}

/// A handle the kernel holds from an earlier daemon of the same mount (the
/// connection outlived it, see `supervise.rs`): what the new daemon must
/// know to serve it as the old one would have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelOpen {
    pub fh: u64,
    pub ino: Ino,
    pub writable: bool,
    pub io: Io,
}

/// Per-inode state while at least one handle is open on this node.
pub(super) struct OpenInode {
    pub ino: Ino,
    pub file: Arc<File>,
    /// Locked through [`OpenInode::state`], [`OpenInode::settled_state`]
    /// or [`OpenInode::quiet_state`] only: lock order 2 (see core/mod.rs).
    state: Mutex<OpenState>,
    /// Signalled whenever `state.write` leaves a transitional state.
    pub changed: Condvar,
    /// Windows fetched from peers for chunks this node does not hold.
    pub readahead: Mutex<Readahead>,
}

#[derive(Default)]
pub(super) struct OpenState {
    pub opens: u32,
    pub writers: u32,
    /// The file's write state (see `write.rs`, which owns its transitions).
    pub write: WriteState,
    /// Unlinked while open: never sealed again, purged at last close.
    pub orphaned: bool,
    /// Layout of a sealed file, loaded on the first read through the daemon.
    pub layout: Option<Arc<Layout>>,
    /// Counts [`OpenState::forget_layout`]: a layout loaded before a seal
    /// or a fetch that changed it is not kept.
    pub layout_epoch: u64,
    /// Handles open in each kernel I/O mode (see [`Io`]).
    pub passthrough_handles: u32,
    pub cached_handles: u32,
}

impl OpenState {
    /// The chunks or the size changed: the next read loads the layout again.
    pub fn forget_layout(&mut self) {
        self.layout = None;
        self.layout_epoch += 1;
    }
}

impl OpenInode {
    /// The state as it is now, a transition perhaps under way (see
    /// `write.rs`): for what does not depend on it (counts, the layout
    /// cache) or that checks it.
    pub fn state(&self) -> MutexGuard<'_, OpenState> {
        self.state.lock()
    }

    /// The state once no transition is under way: waits (holding nothing
    /// else) while the write state is `Leasing`, `Publishing` or `Sealing`.
    pub fn settled_state(&self) -> MutexGuard<'_, OpenState> {
        let mut st = self.state.lock();
        while st.write.in_transition() {
            st.wait(&self.changed);
        }
        st
    }

    /// The state once no transition and no stream of chunks to peers is
    /// under way (what a publish or the seal starts from).
    pub fn quiet_state(&self) -> MutexGuard<'_, OpenState> {
        let mut st = self.state.lock();
        while st.write.in_transition() || st.write.is_streaming() {
            st.wait(&self.changed);
        }
        st
    }
}

/// A slot of the open-inode table.
enum Slot {
    Open(Arc<OpenInode>),
    /// Closed here and held so by an unlink's purge, an eviction or a batch
    /// of unsealed marks being cleared: opens wait until it is released.
    Held(Arc<Gate>),
}

/// What waits on an inode held closed: released once, by the holder.
#[derive(Default)]
pub(super) struct Gate {
    released: Mutex<bool>,
    cv: Condvar,
}

impl Gate {
    pub(super) fn release(&self) {
        *self.released.lock() = true;
        self.cv.notify_all();
    }

    pub(super) fn wait(&self) {
        let mut released = self.released.lock();
        while !*released {
            released.wait(&self.cv);
        }
    }
}

/// A closed inode held closed; opens of it wait until this is dropped.
pub(crate) struct Held<'a> {
    table: &'a OpenTable,
    ino: Ino,
    gate: Arc<Gate>,
}

impl Held<'_> {
    pub fn ino(&self) -> Ino {
        self.ino
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.table.inodes.remove_if(&self.ino, |_, slot| matches!(slot, Slot::Held(g) if Arc::ptr_eq(g, &self.gate)));
        self.gate.release();
    }
}

/// Whether an inode is open here, or held closed by the caller.
pub(crate) enum Claim<'a> {
    Open(Arc<OpenInode>),
    Closed(Held<'a>),
}

/// The handle table and the open-inode table.
#[derive(Default)]
pub(super) struct OpenTable {
    inodes: DashMap<Ino, Slot>,
    handles: DashMap<u64, Handle>,
    next_fh: AtomicU64,
}

impl OpenTable {
    /// A table whose handles start above `base`.
    pub fn starting_at(base: u64) -> Self {
        OpenTable { next_fh: AtomicU64::new(base), ..OpenTable::default() }
    }

    pub fn new_fh(&self) -> u64 {
        self.next_fh.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Inodes open here.
    pub fn len(&self) -> usize {
        self.inodes.iter().filter(|s| matches!(s.value(), Slot::Open(_))).count()
    }

    /// The state of `ino` if it is open here.
    pub fn get(&self, ino: Ino) -> Option<Arc<OpenInode>> {
        match self.inodes.get(&ino).as_deref() {
            Some(Slot::Open(oi)) => Some(oi.clone()),
            _ => None,
        }
    }

    /// Every inode open here now.
    pub fn all(&self) -> Vec<Arc<OpenInode>> {
        self.inodes
            .iter()
            .filter_map(|s| match s.value() {
                Slot::Open(oi) => Some(oi.clone()),
                Slot::Held(_) => None,
            })
            .collect()
    }

    /// Hold `ino` closed, or return its state if it is open. Waits while
    /// another holder has it.
    pub fn claim_closed(&self, ino: Ino) -> Claim<'_> {
        loop {
            let gate = match self.inodes.entry(ino) {
                dashmap::Entry::Vacant(v) => {
                    let gate = Arc::new(Gate::default());
                    v.insert(Slot::Held(gate.clone()));
                    return Claim::Closed(Held { table: self, ino, gate });
                }
                dashmap::Entry::Occupied(o) => match o.get() {
                    Slot::Open(oi) => return Claim::Open(oi.clone()),
                    Slot::Held(g) => g.clone(),
                },
            };
            gate.wait();
        }
    }

    /// [`OpenTable::claim_closed`] without waiting: `None` while another
    /// holder has the inode.
    pub fn try_claim_closed(&self, ino: Ino) -> Option<Claim<'_>> {
        match self.inodes.entry(ino) {
            dashmap::Entry::Vacant(v) => {
                let gate = Arc::new(Gate::default());
                v.insert(Slot::Held(gate.clone()));
                Some(Claim::Closed(Held { table: self, ino, gate }))
            }
            dashmap::Entry::Occupied(o) => match o.get() {
                Slot::Open(oi) => Some(Claim::Open(oi.clone())),
                Slot::Held(_) => None,
            },
        }
    }

    /// Count one more open of `ino`, creating its state with `file` (the
    /// backing file, opened by the caller outside any lock) when it is not
    /// open yet. Waits while the inode is held closed.
    pub fn open_inode(&self, ino: Ino, file: impl Fn() -> FsResult<File>) -> FsResult<Arc<OpenInode>> {
        loop {
            if let Some(oi) = self.count_open(ino) {
                return Ok(oi);
            }
            let fresh = Arc::new(OpenInode {
                ino,
                file: Arc::new(file()?),
                state: Mutex::default(),
                changed: Condvar::new(),
                readahead: Mutex::default(),
            });
            let gate = match self.inodes.entry(ino) {
                dashmap::Entry::Vacant(v) => {
                    fresh.state().opens = 1;
                    v.insert(Slot::Open(fresh.clone()));
                    return Ok(fresh);
                }
                dashmap::Entry::Occupied(o) => match o.get() {
                    // Opened meanwhile by another thread: count on its state.
                    Slot::Open(_) => None,
                    Slot::Held(g) => Some(g.clone()),
                },
            };
            if let Some(g) = gate {
                g.wait();
            }
        }
    }

    fn count_open(&self, ino: Ino) -> Option<Arc<OpenInode>> {
        let slot = self.inodes.get(&ino)?;
        match &*slot {
            Slot::Open(oi) => {
                oi.state().opens += 1;
                Some(oi.clone())
            }
            Slot::Held(_) => None,
        }
    }

    /// Count one open less; drops the state at the last. Returns whether the
    /// inode was orphaned and is now closed (to be purged).
    pub fn close_inode(&self, ino: Ino, io: Io) -> bool {
        let mut purge = false;
        self.inodes.remove_if(&ino, |_, slot| {
            let Slot::Open(oi) = slot else { return false };
            let mut st = oi.state();
            st.opens -= 1;
            match io {
                Io::Passthrough => st.passthrough_handles -= 1,
                Io::Cached => st.cached_handles -= 1,
                Io::Direct => {}
            }
            purge = st.opens == 0 && st.orphaned;
            st.opens == 0
        });
        purge
    }

    pub fn insert_handle(&self, fh: u64, h: Handle) {
        self.handles.insert(fh, h);
    }

    pub fn set_writable(&self, fh: u64) {
        if let Some(mut h) = self.handles.get_mut(&fh) {
            h.writable = true;
        }
    }

    pub fn set_io(&self, fh: u64, io: Io) {
        if let Some(mut h) = self.handles.get_mut(&fh) {
            h.io = io;
        }
    }

    /// Every handle open here now.
    pub fn handle_ids(&self) -> Vec<u64> {
        self.handles.iter().map(|h| *h.key()).collect()
    }

    pub fn remove_handle(&self, fh: u64) -> Option<Handle> {
        self.handles.remove(&fh).map(|(_, h)| h)
    }

    /// (inode, writable, state) of an open handle.
    pub fn handle(&self, fh: u64) -> FsResult<(Ino, bool, Arc<OpenInode>)> {
        let (ino, writable) = {
            let h = self.handles.get(&fh).ok_or(FsError::BadHandle(fh))?;
            (h.ino, h.writable)
        };
        let oi = self.get(ino).ok_or(FsError::BadHandle(fh))?;
        Ok((ino, writable, oi))
    }
}

impl Core {
    /// Create a regular file and open it (open with O_CREAT). A file created
    /// for writing starts unsealed in the creating transaction.
    pub fn create(&self, parent: Ino, name: &[u8], node: &NewNode<'_>) -> FsResult<(super::Attr, Opened)> {
        self.create_open(node, || self.ns.mknod(parent, name, node))
    }

    /// Create an unnamed regular file in `parent` and open it (`O_TMPFILE`):
    /// an orphan from its creation, purged at its last close unless a
    /// `link` names it first ([`Core::link`]).
    pub fn tmpfile(&self, parent: Ino, node: &NewNode<'_>) -> FsResult<(super::Attr, Opened)> {
        self.create_open(node, || self.ns.tmpfile(parent, node))
    }

    /// Make an inode with `make` and open it, for writing when `node` says
    /// it starts unsealed.
    fn create_open(
        &self,
        node: &NewNode<'_>,
        make: impl FnOnce() -> converged_metadata::MetaResult<super::Attr>,
    ) -> FsResult<(super::Attr, Opened)> {
        // Which writing sessions ended before the create: its write lease
        // is the creator's only while none of this inode ended since.
        let before = self.seals.snapshot();
        let inode = make()?;
        let created = node.unsealed.then_some(before);
        let opened = self.open_inner(inode.ino, node.unsealed, created.as_ref(), true)?;
        Ok((inode, opened))
    }

    /// Open `ino`; `writable` for O_WRONLY / O_RDWR.
    pub fn open(&self, ino: Ino, writable: bool) -> FsResult<Opened> {
        self.open_inner(ino, writable, None, true)
    }

    /// A writable handle for the core's own use (truncation), which the
    /// kernel never sees: through the daemon, counted in no I/O mode.
    pub(super) fn open_for_core(&self, ino: Ino) -> FsResult<u64> {
        Ok(self.open_inner(ino, true, None, false)?.fh)
    }

    /// Register the open first, then read the inode: an unlink that purges
    /// holds the inode closed until its purge is committed, so an open that
    /// got past it finds the inode (ENOENT otherwise), never a half-purged one.
    /// `created`: the file was created unsealed by this open, when the
    /// seal counters stood at this snapshot.
    fn open_inner(
        &self,
        ino: Ino,
        writable: bool,
        created: Option<&super::attr::SealSnapshot>,
        kernel: bool,
    ) -> FsResult<Opened> {
        // Chunk versions held here in version files go into the backing
        // file before a reader's open that can then be passed through (every
        // chunk here). A writer's lease copies them in (`hydrate`).
        if kernel && !writable && self.passthrough() && self.store.has_versions(ino) {
            if let Some(Err(e)) = self.while_closed(ino, || self.settle_versions(ino, true)) {
                tracing::warn!(ino, error = %e, "could not settle chunk versions; reads go through the daemon");
            }
        }
        let oi = self.open.open_inode(ino, || self.backing_file(ino))?;
        let fh = self.open.new_fh();
        // Direct (counted nowhere) until the mode is settled below, and not
        // writable until it counts as a writer: a failed open releases it.
        self.open.insert_handle(fh, Handle { ino, writable: false, io: Io::Direct });
        match self.open_checked(fh, ino, &oi, writable, created, kernel) {
            Ok(opened) => Ok(opened),
            Err(e) => {
                let _ = self.release(fh);
                Err(e)
            }
        }
    }

    fn open_checked(
        &self,
        fh: u64,
        ino: Ino,
        oi: &OpenInode,
        writable: bool,
        created: Option<&super::attr::SealSnapshot>,
        kernel: bool,
    ) -> FsResult<Opened> {
        let inode = self.ns.getattr(ino)?;
        match inode.kind {
            FileKind::Regular => {}
            FileKind::Directory => return Err(converged_metadata::MetaError::IsDir.into()),
            _ => return Err(FsError::Invalid("open of a special file through the daemon")),
        }
        if inode.nlink == 0 {
            // An orphan the kernel still holds: purged at its last close here.
            oi.state().orphaned = true;
        }
        if writable {
            self.begin_writer(ino, oi, created)?;
            self.open.set_writable(fh);
        }
        if !kernel {
            return Ok(Opened { fh, backing: None, refresh_attrs: false, io: Io::Direct });
        }
        let touched = !writable && self.note_access(&inode);
        let mut passthrough = self.passthrough();
        if passthrough && writable {
            if let Some(t) = self.tier.get() {
                passthrough = self.room_for_passthrough_writes(t);
            }
        }
        let sealed = !oi.state().write.reads_backing_file();
        if !writable && self.tier.get().is_some() && sealed && self.check_import(ino)? {
            oi.state().forget_layout();
        }
        let clustered = self.cluster.get().is_some();
        if clustered && sealed {
            // Close-to-open: read the layout as it is now (size and chunks
            // together, past the node's cache, which it refreshes), and
            // have the kernel drop the attributes it holds.
            oi.state().forget_layout();
            self.layout(ino, oi)?;
        }
        let partial = clustered || self.tier.get().is_some();
        if passthrough && !writable && partial && sealed {
            // The kernel may read the backing file directly only if every chunk is here...
            if !clustered {
                oi.state().forget_layout();
            }
            let layout = self.layout(ino, oi)?;
            // ... and the backing file has the file's size: passthrough reads
            // to the backing file's end.
            let same_size = oi.file.metadata().is_ok_and(|m| m.len() == layout.size);
            passthrough =
                same_size && layout.chunks.iter().flatten().all(|r| self.is_local(r)) && !self.store.has_versions(ino);
        }
        let io = self.choose_io(oi, passthrough, writable);
        self.open.set_io(fh, io);
        Ok(Opened {
            fh,
            backing: (io == Io::Passthrough).then(|| oi.file.clone()),
            // A writer's attributes are not cached (see FuseAdapter::attr_ttl),
            // and those the kernel holds from before are dropped.
            refresh_attrs: clustered || touched || writable,
            io,
        })
    }

    /// The backing file of `ino` for its first open here: its spare, or the file.
    fn backing_file(&self, ino: Ino) -> FsResult<File> {
        match self.take_spare(ino) {
            Some(f) => Ok(f),
            None => self.store.open_backing(ino),
        }
    }

    /// The kernel I/O mode of a new handle, given the handles already open.
    fn choose_io(&self, oi: &OpenInode, passthrough: bool, writable: bool) -> Io {
        let mut st = oi.state();
        let io = match (passthrough, st.cached_handles > 0, st.passthrough_handles > 0) {
            (true, false, _) => Io::Passthrough,
            (true, true, _) => Io::Cached,
            (false, _, true) => Io::Direct,
            (false, _, false) => Io::Cached,
        };
        self.count_io(&mut st, io, writable);
        io
    }

    /// Count a handle in its I/O mode.
    fn count_io(&self, st: &mut OpenState, io: Io, writable: bool) {
        let counter = match io {
            Io::Passthrough => {
                st.passthrough_handles += 1;
                &self.stats.opens_passthrough
            }
            Io::Cached => {
                st.cached_handles += 1;
                &self.stats.opens_cached
            }
            Io::Direct => &self.stats.opens_direct,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        if io == Io::Passthrough && writable {
            // Writes go around the daemon: every chunk is checksummed again.
            st.write.dirty_all();
        }
    }

    /// Serve a handle the kernel holds from an earlier daemon of this mount
    /// as that daemon did: the inode open in the same I/O mode, and, for a
    /// writer, the writing session taken over where the crash left it
    /// (`lease`: the epoch of this node's unsealed mark on the file, if it
    /// has one; without, the lease is taken as by a new writer). Called
    /// after recovery, which left these inodes as they were.
    pub(super) fn adopt(&self, k: &KernelOpen, lease: Option<u64>) -> FsResult<()> {
        let oi = self.open.open_inode(k.ino, || self.backing_file(k.ino))?;
        self.open.insert_handle(k.fh, Handle { ino: k.ino, writable: false, io: Io::Direct });
        let adopted = (|| {
            let inode = self.ns.getattr(k.ino)?;
            if inode.nlink == 0 {
                oi.state().orphaned = true;
            }
            if k.writable {
                match lease {
                    Some(lease) => self.adopt_writer(&oi, lease),
                    None => self.begin_writer(k.ino, &oi, None)?,
                }
                self.open.set_writable(k.fh);
            }
            self.count_io(&mut oi.state(), k.io, k.writable);
            self.open.set_io(k.fh, k.io);
            Ok(())
        })();
        if adopted.is_err() {
            let _ = self.release(k.fh);
        }
        adopted
    }

    /// release(2) of a handle: the last writer seals the file; the last
    /// handle of an orphan purges it.
    pub fn release(&self, fh: u64) -> FsResult<()> {
        let h = self.open.remove_handle(fh).ok_or(FsError::BadHandle(fh))?;
        let Some(oi) = self.open.get(h.ino) else { return Ok(()) };
        let result = if h.writable { self.end_writer(h.ino, &oi) } else { Ok(()) };
        if self.open.close_inode(h.ino, h.io) {
            if let super::Claim::Closed(_held) = self.open.claim_closed(h.ino) {
                self.purge(h.ino)?;
            }
        }
        result
    }
}
