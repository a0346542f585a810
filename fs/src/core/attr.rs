//! Attributes: the namespace record, overlaid with what the backing file
//! knows while a writer here is ahead of the metadata; and truncation, which
//! goes through the write path like any other change of a file's bytes.

use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicU64, Ordering};

use converged_metadata::types::*;
use converged_metadata::MetaError;

use super::backing::set_file_times;
use super::{chunk_range, ts_from, Attr, Core};
use crate::error::{FsError, FsResult};

/// Stripes of inode numbers with a seal counter each.
const SEAL_STRIPES: usize = 64;

/// Counts seals that ended a local writer's session, in all and per stripe
/// of inode numbers; see [`Core::settled`].
pub(super) struct SealCounters {
    all: AtomicU64,
    stripes: [AtomicU64; SEAL_STRIPES],
}

impl Default for SealCounters {
    fn default() -> Self {
        SealCounters { all: AtomicU64::new(0), stripes: std::array::from_fn(|_| AtomicU64::new(0)) }
    }
}

/// The stripe counters at one moment (see [`SealCounters::snapshot`]).
pub(super) struct SealSnapshot([u64; SEAL_STRIPES]);

impl SealCounters {
    /// A writing session ended here (sealed, failed, or fenced).
    pub fn bump(&self, ino: Ino) {
        self.all.fetch_add(1, Ordering::SeqCst);
        self.stripes[ino as usize % SEAL_STRIPES].fetch_add(1, Ordering::SeqCst);
    }

    /// The counters now, for [`SealCounters::none_ended_since`] once the
    /// inode number is known.
    pub fn snapshot(&self) -> SealSnapshot {
        SealSnapshot(std::array::from_fn(|i| self.stripes[i].load(Ordering::SeqCst)))
    }

    /// Whether no writing session of `ino`'s stripe ended since `snap`.
    pub fn none_ended_since(&self, snap: &SealSnapshot, ino: Ino) -> bool {
        let i = ino as usize % SEAL_STRIPES;
        self.stripes[i].load(Ordering::SeqCst) == snap.0[i]
    }
}

impl Core {
    /// Overlay what the backing file knows while writes may bypass the daemon.
    fn overlay(&self, mut inode: Inode) -> FsResult<Attr> {
        if inode.kind != FileKind::Regular {
            return Ok(inode);
        }
        if let Some(oi) = self.open.get(inode.ino) {
            let (reads_backing, held) = {
                let st = oi.state();
                (st.write.reads_backing_file(), st.write.held_attrs().cloned())
            };
            if reads_backing {
                let md = oi.file.metadata().map_err(|e| FsError::io("stat backing file", e))?;
                inode.size = md.len();
                let mtime = ts_from(md.mtime(), md.mtime_nsec());
                if let Some(a) = &held {
                    // Changes not recorded yet; the times are on the backing file.
                    a.apply_to(&mut inode, Timespec::now());
                }
                inode.mtime = mtime;
                inode.ctime = inode.ctime.max(mtime);
            }
        }
        Ok(inode)
    }

    /// Attributes that no local seal raced. Release commits a file's sealed
    /// size and only then stops taking the size from the backing file, so a
    /// record read before that commit and overlaid after it would carry the
    /// size the file had when it was opened, and the kernel would cut reads
    /// short at it. Read again when a seal ended in between: any seal
    /// for the first read (its inode is not known before it), then only
    /// seals of inodes in the same stripe, so that a node sealing
    /// thousands of files a second does not keep a stat going round.
    fn settled(&self, read: impl Fn() -> FsResult<Attr>) -> FsResult<Attr> {
        let epoch = self.seals.all.load(Ordering::SeqCst);
        let mut attr = read()?;
        if self.seals.all.load(Ordering::SeqCst) == epoch {
            return Ok(attr);
        }
        loop {
            let stripe = &self.seals.stripes[attr.ino as usize % SEAL_STRIPES];
            let before = stripe.load(Ordering::SeqCst);
            let again = read()?;
            if again.ino == attr.ino && stripe.load(Ordering::SeqCst) == before {
                return Ok(again);
            }
            attr = again;
        }
    }

    /// A name in a directory. The kernel asks for `.` and `..` only to turn
    /// a file handle (open_by_handle_at, NFS export) back into an inode it
    /// no longer holds: `.` is the inode numbered `parent` itself, whatever
    /// its kind (ENOENT once it is gone: the handle is stale), and `..` a
    /// directory's parent. Inode numbers are never reused, so a handle
    /// cannot name a later file.
    pub fn lookup(&self, parent: Ino, name: &[u8]) -> FsResult<Attr> {
        match name {
            b"." => self.getattr(parent),
            b".." => {
                let dir = self.ns.getattr(parent)?;
                if dir.kind != FileKind::Directory {
                    return Err(MetaError::NotDir.into());
                }
                self.getattr(dir.parent)
            }
            _ => self.settled(|| self.lookup_once(parent, name)),
        }
    }

    fn lookup_once(&self, parent: Ino, name: &[u8]) -> FsResult<Attr> {
        match self.ns.lookup(parent, name) {
            // An imported directory not listed yet: list it, then look again.
            Err(MetaError::NotFound) if self.tier.get().is_some() && self.materialize(parent)? => {
                self.overlay(self.ns.lookup(parent, name)?)
            }
            Ok(inode) if inode.kind == FileKind::Regular && self.tier.get().is_some() => {
                // An imported object replaced in its bucket shows its new size at once.
                match self.check_import(inode.ino) {
                    Ok(true) => self.overlay(self.ns.getattr(inode.ino)?),
                    Ok(false) => self.overlay(inode),
                    Err(e) => {
                        tracing::warn!(ino = inode.ino, error = %e, "could not check an imported object");
                        self.overlay(inode)
                    }
                }
            }
            r => self.overlay(r?),
        }
    }

    pub fn getattr(&self, ino: Ino) -> FsResult<Attr> {
        match self.settled(|| self.overlay(self.ns.getattr(ino)?)) {
            // Removed here and purged, and still held by the kernel (a
            // working directory, an O_PATH descriptor): its last attributes.
            Err(FsError::Meta(MetaError::NotFound)) if let Some(last) = self.removed.get(ino) => Ok(last),
            r => r,
        }
    }

    /// In a cluster, a change of mode, owner, group or times of a file that
    /// this node is writing and has not published yet is held back and
    /// recorded with the bytes by the publish at close (or fsync): other
    /// nodes see the file appear whole, attributes included, at close, as
    /// close-to-open promises, and unpacking a file costs one commit for
    /// its `fchmod`, `fchown` and `futimens` fewer each. A mode change of a
    /// file with an access ACL commits at once (the ACL follows the mode).
    /// Returns the attributes as this node now shows them, or `None` when
    /// the change is not held back.
    fn held_back(&self, ino: Ino, attr: &SetAttr) -> FsResult<Option<Attr>> {
        if self.cluster.get().is_none() {
            return Ok(None);
        }
        let Some(oi) = self.open.get(ino) else { return Ok(None) };
        if attr.mode.is_some() {
            match self.ns.getxattr(ino, converged_metadata::acl::ACCESS) {
                Err(MetaError::NoAttr) => {}
                Ok(_) => return Ok(None),
                Err(e) => return Err(e.into()),
            }
        }
        let now = Timespec::now();
        let held = oi.quiet_state().write.defer_attrs(attr, now);
        if !held {
            return Ok(None);
        }
        if attr.atime.is_some() || attr.mtime.is_some() {
            // The backing file keeps the file's times while it is written
            // (its mtime is what a seal records, moved on by later writes).
            let mut times = self.getattr(ino)?;
            let only_times =
                SetAttr { atime: attr.atime, mtime: attr.mtime, ctime: Some(times.ctime), ..SetAttr::default() };
            only_times.apply_to(&mut times, now);
            set_file_times(&oi.file, &times)?;
        }
        Ok(Some(self.getattr(ino)?))
    }

    /// The kernel forgot `ino` (FUSE FORGET): it will not ask for a removed
    /// inode's attributes again.
    pub fn forget(&self, ino: Ino) {
        self.removed.forget(ino);
    }

    /// setattr. A size change is a write: the file is opened for writing
    /// here for its length (taking the write lease and the chunks held
    /// elsewhere when no writer has them), cut, and released, which seals
    /// it when no other writer remains.
    pub fn setattr(&self, ino: Ino, attr: &SetAttr) -> FsResult<Attr> {
        if let Some(size) = attr.size {
            let before = self.getattr(ino)?;
            if before.kind == FileKind::Directory {
                return Err(MetaError::IsDir.into());
            }
            self.truncate(ino, before.size, size)?;
        }
        // The size is the seal's to record (from the backing file, in the
        // same order as every other change of the bytes): a size set here
        // afterwards could undo a truncate or write that sealed in between.
        let attr = SetAttr { size: None, ..attr.clone() };
        if let Some(inode) = self.held_back(ino, &attr)? {
            return Ok(inode);
        }
        let inode = self.ns.setattr(ino, &attr)?;
        if attr.atime.is_some() || attr.mtime.is_some() {
            if let Some(oi) = self.open.get(ino) {
                // Keep the backing file's times in step: they are the source
                // of mtime while the file is unsealed.
                set_file_times(&oi.file, &inode)?;
            }
        }
        self.getattr(ino)
    }

    fn truncate(&self, ino: Ino, old_size: u64, size: u64) -> FsResult<()> {
        let fh = self.open_for_core(ino)?;
        let cut = self.open.handle(fh).and_then(|(_, _, oi)| {
            let range = chunk_range(old_size.min(size), 0, self.ns.chunk_size());
            super::write::changing_bytes(&oi, range, || {
                oi.file.set_len(size).map_err(|e| FsError::io("truncate backing file", e))
            })?;
            oi.state().forget_layout();
            Ok(())
        });
        let released = self.release(fh);
        cut.and(released)
    }
}
