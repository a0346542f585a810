//! The local chunk store: one sparse backing file per inode under
//! `<data-dir>/chunks/`, holding the chunks this node stores at their file
//! offsets (what kernel passthrough reads), and beside it *version files*:
//! `<ino>.<index>.<version>`, each one whole chunk version, written once.
//!
//! Published chunk versions are immutable: a replica write never lands on
//! the bytes of another version. A version a peer sent here stays in its
//! version file, which is where it is read from (by this node's daemon and
//! by peers): each copy of a chunk is written once on a node's disk. Only a
//! local open that can hand the kernel the backing file (passthrough: every
//! chunk here), or a writer here, has version files copied (installed) into
//! it (a reflink where the filesystem shares blocks). The core removes
//! version files the layout left behind.
//!
//! A small version that must be on stable storage when its write returns
//! (a replica of a small file's close) goes into a *slot* instead: an
//! empty file `slot.<n>` made ahead, whose name is already on stable
//! storage, filled, labelled with the version it holds (the extended
//! attribute `user.converged.version`, the version file's name) and synced
//! with one `fsync`. A new name costs its directory a second sync (the
//! create, then the directory's `fsync`); a slot's was paid ahead, a batch
//! of names at a time. A slot keeps its name: the index says which version
//! each holds, read back from the labels when the store opens (an
//! unlabelled slot was never filled, and goes).
//!
//! It owns bytes on the local SSD only; which chunks exist and their
//! checksums are recorded in the namespace by the filesystem core. Its two
//! locks (the version index, the ready slots) are leaves, never held
//! together: nothing is taken while one is held, and no I/O happens under
//! either.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use converged_metadata::types::Ino;
use converged_transport::{Caller, ChunkRef};

pub use crate::blocks::{block_crcs, read_exact_at, OnceWriter};
use crate::error::{FsError, FsResult};

pub struct ChunkStore {
    dir: PathBuf,
    index: converged_metadata::held_locks::Mutex<Index>,
    /// Slots made ahead, their names on stable storage (see the module's head).
    slots: converged_metadata::held_locks::Mutex<Slots>,
    /// Fewer than half of [`SLOTS`] are ready: the slot maker wakes.
    slots_low: parking_lot::Condvar,
    /// Bytes this store wrote, by why (see [`Written`]).
    pub written: Written,
}

/// Slots kept ready for durable writes of small versions.
const SLOTS: usize = 64;
/// Versions up to this size go into a slot when written durably; a larger
/// one's own create and directory sync are small beside its bytes, and it
/// is written with `O_DIRECT` where it can be.
pub const SLOT_MAX: u64 = 1 << 20;
/// The label naming the version a slot holds.
const SLOT_LABEL: &std::ffi::CStr = c"user.converged.version";

/// Empty files made ahead for durable writes of small versions.
#[derive(Default)]
struct Slots {
    ready: Vec<(u64, File)>,
    /// The number of the next slot made.
    next: u64,
    /// The data dir's filesystem refused the label: no slots.
    off: bool,
}

/// The version files on disk, and which inodes' ones the settler still has
/// to look at.
#[derive(Default)]
struct Index {
    /// By inode: (chunk index, version).
    versions: BTreeMap<Ino, BTreeSet<(u32, u64)>>,
    /// Inodes with a version file whose fate is not settled yet: just
    /// written, or found at start. A settled version file is the chunk's
    /// home and is not looked at again until another version of the inode
    /// arrives (the sweep removes the ones a layout change left behind).
    unsettled: BTreeSet<Ino>,
    /// Versions received without a sync since this store was opened: the
    /// only ones a later sync request may vouch for (a file left by a crash
    /// may hold anything).
    unsynced: BTreeSet<VersionKey>,
    /// Versions held in a slot (its number) rather than in a file of
    /// their own name.
    slotted: std::collections::HashMap<VersionKey, u64>,
}

/// Bytes the chunk store wrote to the data disk (besides a writer's own
/// writes into its backing file): what a replicated byte costs here.
#[derive(Default)]
pub struct Written {
    /// Chunk versions received from a peer (replication, repair, drains).
    pub received: AtomicU64,
    /// Published versions kept beside a backing file being rewritten here.
    pub kept: AtomicU64,
    /// Version files copied into a backing file (a second write of those
    /// bytes where the filesystem cannot reflink).
    pub installed: AtomicU64,
}

/// Why a chunk version is written into a version file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arrival {
    /// A peer sent it (it holds a copy here).
    Received,
    /// This node's writer keeps the version it published.
    Kept,
}

/// A chunk version held in a version file.
pub type VersionKey = (Ino, u32, u64);

/// Size of the metadata reserve for a data disk of `total` bytes: 2%, between 1 and 64 MiB.
pub fn reserve_size(total: u64) -> u64 {
    (total / 50).clamp(1 << 20, 64 << 20)
}

impl ChunkStore {
    pub fn open(data_dir: &Path) -> FsResult<Self> {
        let dir = data_dir.join("chunks");
        std::fs::create_dir_all(&dir).map_err(|e| FsError::io(format!("create {}", dir.display()), e))?;
        let store = Self {
            dir,
            index: Default::default(),
            slots: Default::default(),
            slots_low: Default::default(),
            written: Default::default(),
        };
        let rd = std::fs::read_dir(&store.dir).map_err(|e| FsError::io(format!("list {}", store.dir.display()), e))?;
        let mut found = Vec::new();
        let mut slots = Vec::new();
        for entry in rd.flatten() {
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            if let Some(key) = parse_version_name(name) {
                found.push((key, None));
            } else if let Some(n) = parse_slot_name(name) {
                slots.push(n);
            }
        }
        // Slots: a labelled one holds the version its label names (a
        // second copy of a version already found goes: a version's bytes
        // are the same wherever they were written); an unlabelled one was
        // never filled.
        let mut next = 0;
        for n in slots {
            next = next.max(n + 1);
            let path = store.slot_path(n);
            match read_label(&path) {
                Some(key) if !found.iter().any(|(k, _)| *k == key) => found.push((key, Some(n))),
                _ => {
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        store.slots.lock().next = next;
        let mut index = store.index.lock();
        for ((ino, chunk, version), slot) in found {
            index.versions.entry(ino).or_default().insert((chunk, version));
            index.unsettled.insert(ino);
            if let Some(n) = slot {
                index.slotted.insert((ino, chunk, version), n);
            }
        }
        drop(index);
        Ok(store)
    }

    /// Where a version's file is: its slot, or a file of its own name.
    fn version_path(&self, ino: Ino, index: u32, version: u64) -> PathBuf {
        match self.index.lock().slotted.get(&(ino, index, version)) {
            Some(n) => self.slot_path(*n),
            None => self.own_path(ino, index, version),
        }
    }

    fn own_path(&self, ino: Ino, index: u32, version: u64) -> PathBuf {
        self.dir.join(version_name(ino, index, version))
    }

    fn slot_path(&self, n: u64) -> PathBuf {
        self.dir.join(format!("slot.{n:016x}"))
    }

    /// Make slots until [`SLOTS`] are ready, their names on stable storage
    /// (one directory sync for the batch), once fewer than half are ready
    /// or `period` passed. Returns how many it made (none when the data
    /// dir's filesystem takes no labels: then after waiting `period`).
    pub fn make_slots(&self, period: std::time::Duration) -> io::Result<usize> {
        let (from, want) = {
            let mut slots = self.slots.lock();
            if slots.ready.len() >= SLOTS / 2 || slots.off {
                slots.wait_for(&self.slots_low, period);
            }
            if slots.off || slots.ready.len() >= SLOTS {
                return Ok(0);
            }
            let want = SLOTS - slots.ready.len();
            slots.next += want as u64;
            (slots.next - want as u64, want)
        };
        let mut made = Vec::with_capacity(want);
        let mut failed = None;
        for n in from..from + want as u64 {
            let f = OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .mode(0o600)
                .custom_flags(libc::O_CLOEXEC)
                .open(self.slot_path(n));
            match f {
                Ok(f) => made.push((n, f)),
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        if let Err(e) = File::open(&self.dir).and_then(|d| d.sync_all()) {
            for (n, _) in made {
                let _ = std::fs::remove_file(self.slot_path(n));
            }
            return Err(e);
        }
        let n = made.len();
        self.slots.lock().ready.extend(made);
        match failed {
            Some(e) if n == 0 => Err(e),
            _ => Ok(n),
        }
    }

    /// How many slots are ready now.
    pub fn slots_ready(&self) -> usize {
        self.slots.lock().ready.len()
    }

    /// A ready slot, if any; the maker is woken when they run low.
    fn take_slot(&self) -> Option<(u64, File)> {
        let mut slots = self.slots.lock();
        let slot = slots.ready.pop();
        if slots.ready.len() < SLOTS / 2 {
            self.slots_low.notify_one();
        }
        slot
    }

    /// Fill slot `n` (`f`) with version `c`'s `len` bytes from `next`,
    /// label it and sync it: the version is then on stable storage, under
    /// the slot's name (on stable storage since the slot was made). A
    /// failure leaves no slot (and, where the filesystem refuses the
    /// label, no more slots are made).
    fn fill_slot<B: AsRef<[u8]>>(
        &self,
        (n, f): (u64, File),
        c: &ChunkRef,
        len: u64,
        next: &mut dyn FnMut() -> Option<B>,
    ) -> io::Result<()> {
        let filled = (|| {
            receive(len, next, |piece, at| f.write_all_at(piece, at))?;
            set_label(&f, &version_name(c.ino, c.index, c.version)).inspect_err(|e| {
                if matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP)) {
                    tracing::info!(
                        "the data dir's filesystem takes no user xattrs: small chunk versions get files of their own"
                    );
                    self.slots.lock().off = true;
                }
            })?;
            f.sync_all()
        })();
        if filled.is_err() {
            let _ = std::fs::remove_file(self.slot_path(n));
            return filled;
        }
        // An earlier file of this version (a send made again) goes: the
        // slot holds it now.
        let earlier = {
            let mut idx = self.index.lock();
            let held = idx.versions.get(&c.ino).is_some_and(|v| v.contains(&(c.index, c.version)));
            let slot = idx.slotted.insert((c.ino, c.index, c.version), n);
            held.then(|| slot.map_or_else(|| self.own_path(c.ino, c.index, c.version), |m| self.slot_path(m)))
        };
        if let Some(earlier) = earlier {
            let _ = std::fs::remove_file(earlier);
        }
        Ok(())
    }

    /// Index a version file just written; `synced`: on stable storage.
    fn add_version(&self, ino: Ino, index: u32, version: u64, synced: bool) {
        let mut idx = self.index.lock();
        idx.versions.entry(ino).or_default().insert((index, version));
        idx.unsettled.insert(ino);
        match synced {
            true => idx.unsynced.remove(&(ino, index, version)),
            false => idx.unsynced.insert((ino, index, version)),
        };
    }

    /// Store a whole chunk version in its own file, on stable storage
    /// (bytes and name) when this returns unless `durable` is false (then
    /// [`ChunkStore::sync_versions`] does that later). Another version of the
    /// chunk, in the backing file or a version file, is left as it is.
    pub fn write_version(&self, c: &ChunkRef, data: &[u8], why: Arrival, durable: bool) -> io::Result<()> {
        let mut data = Some(data);
        self.write_version_from(c, data.map_or(0, |d| d.len() as u64), why, durable, &mut || data.take())
    }

    /// [`ChunkStore::write_version`], the version's `len` bytes taken from
    /// `next` as they come (a peer's write, written as it arrives). A short
    /// stream (`next` gives `None` early) or a failed write leaves no file.
    pub fn write_version_from<B: AsRef<[u8]>>(
        &self,
        c: &ChunkRef,
        len: u64,
        why: Arrival,
        durable: bool,
        next: &mut dyn FnMut() -> Option<B>,
    ) -> io::Result<()> {
        if durable && len <= SLOT_MAX {
            if let Some(slot) = self.take_slot() {
                self.fill_slot(slot, c, len, next)?;
                self.note_written(c, len, why, true);
                return Ok(());
            }
        }
        let path = self.version_path(c.ino, c.index, c.version);
        let written = (|| {
            let mut w = OnceWriter::create(&path, len)?;
            receive(len, next, |piece, _| w.push(piece))?;
            w.finish()
        })();
        let f = match written {
            Ok(f) => f,
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                return Err(e);
            }
        };
        if durable {
            f.sync_data()?;
            File::open(&self.dir)?.sync_all()?;
        }
        self.note_written(c, len, why, durable);
        Ok(())
    }

    /// Index a version just written and count its bytes.
    fn note_written(&self, c: &ChunkRef, len: u64, why: Arrival, durable: bool) {
        self.add_version(c.ino, c.index, c.version, durable);
        let counter = match why {
            Arrival::Received => &self.written.received,
            Arrival::Kept => &self.written.kept,
        };
        counter.fetch_add(len, Ordering::Relaxed);
    }

    /// Put versions of `ino` written without a sync on stable storage (their
    /// bytes, then the directory's names). Fails, naming it, for a version
    /// not received unsynced since this store was opened.
    pub fn sync_versions(&self, ino: Ino, versions: &[(u32, u64)]) -> io::Result<()> {
        {
            let idx = self.index.lock();
            if let Some((index, version)) = versions.iter().find(|(i, v)| !idx.unsynced.contains(&(ino, *i, *v))) {
                return Err(io::Error::new(
                    io::ErrorKind::NotFound,
                    format!("chunk {index} v{version} of inode {ino} was not received unsynced here"),
                ));
            }
        }
        for (index, version) in versions {
            File::open(self.version_path(ino, *index, *version))?.sync_data()?;
        }
        File::open(&self.dir)?.sync_all()?;
        let mut idx = self.index.lock();
        for (index, version) in versions {
            idx.unsynced.remove(&(ino, *index, *version));
        }
        Ok(())
    }

    /// Copy `len` bytes at `from` of the backing file `main` of `ino` into a
    /// version file of chunk `index` at `version` (kept while the backing
    /// file is rewritten in place). A reflink where the filesystem shares
    /// blocks, a copy in the kernel elsewhere.
    pub fn keep_version(&self, main: &File, ino: Ino, index: u32, version: u64, from: u64, len: u64) -> io::Result<()> {
        let path = self.version_path(ino, index, version);
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC)
            .open(&path)?;
        copy_range(main, from, &f, 0, len)?;
        f.sync_data()?;
        File::open(&self.dir)?.sync_all()?;
        self.add_version(ino, index, version, true);
        self.written.kept.fetch_add(len, Ordering::Relaxed);
        Ok(())
    }

    /// The version file of a chunk version, if this node holds one.
    pub fn open_version(&self, ino: Ino, index: u32, version: u64) -> Option<File> {
        let path = {
            let idx = self.index.lock();
            if !idx.versions.get(&ino).is_some_and(|v| v.contains(&(index, version))) {
                return None;
            }
            idx.slotted.get(&(ino, index, version)).map(|n| self.slot_path(*n))
        };
        File::open(path.unwrap_or_else(|| self.own_path(ino, index, version))).ok()
    }

    /// Whether this node holds a version file of this chunk version.
    pub fn has_version(&self, ino: Ino, index: u32, version: u64) -> bool {
        self.index.lock().versions.get(&ino).is_some_and(|v| v.contains(&(index, version)))
    }

    /// Write good bytes over a damaged range of a version file (`at` bytes
    /// into the chunk), on stable storage when this returns.
    pub fn patch_version(&self, ino: Ino, index: u32, version: u64, at: u64, data: &[u8]) -> io::Result<()> {
        let f = OpenOptions::new().write(true).open(self.version_path(ino, index, version))?;
        f.write_all_at(data, at)?;
        f.sync_data()
    }

    /// Whether any version file of `ino` is here.
    pub fn has_versions(&self, ino: Ino) -> bool {
        self.index.lock().versions.get(&ino).is_some_and(|v| !v.is_empty())
    }

    /// The version files of `ino`: (chunk index, version).
    pub fn versions_of(&self, ino: Ino) -> Vec<(u32, u64)> {
        self.index.lock().versions.get(&ino).map(|v| v.iter().copied().collect()).unwrap_or_default()
    }

    /// Inodes with version files here.
    pub fn inodes_with_versions(&self) -> Vec<Ino> {
        self.index.lock().versions.iter().filter(|(_, v)| !v.is_empty()).map(|(ino, _)| *ino).collect()
    }

    /// Inodes with version files whose fate is not settled yet.
    pub fn inodes_to_settle(&self) -> Vec<Ino> {
        self.index.lock().unsettled.iter().copied().collect()
    }

    /// Every version file of `ino` was looked at and is where it belongs:
    /// the settler leaves the inode alone until another version arrives.
    pub fn settled(&self, ino: Ino) {
        self.index.lock().unsettled.remove(&ino);
    }

    /// The layout records version `version` of chunk `index` of `ino` with
    /// this node as a holder (the change feed said so). When that is the
    /// only version file of the inode here and no backing file holds any of
    /// the inode, the version file is the chunk's home, which is what the
    /// settler would find after reading the inode's records: the inode is
    /// settled without that read. (A replica received from the writer is
    /// this case: one read of the metadata fewer per chunk copied here.)
    ///
    /// Called for every chunk record naming this node that the feed hands
    /// out, so the backing file is looked for (a stat, with no lock held)
    /// only for an inode that waits to be settled.
    pub fn recorded_here(&self, ino: Ino, index: u32, version: u64) {
        let only = |idx: &Index| {
            idx.unsettled.contains(&ino)
                && idx.versions.get(&ino).is_some_and(|v| v.len() == 1 && v.contains(&(index, version)))
        };
        if !only(&self.index.lock()) || self.path(ino).exists() {
            return;
        }
        let mut idx = self.index.lock();
        if only(&idx) {
            idx.unsettled.remove(&ino);
        }
    }

    /// How long ago a version file was written.
    pub fn version_age(&self, ino: Ino, index: u32, version: u64) -> Option<std::time::Duration> {
        let md = std::fs::metadata(self.version_path(ino, index, version)).ok()?;
        md.modified().ok()?.elapsed().ok()
    }

    /// Move a version file into the backing file `main` at `start` (the
    /// chunk's offset), on stable storage before the version file goes: a
    /// crash in between leaves the version file, and the copy is made again.
    pub fn install_version(&self, main: &File, ino: Ino, index: u32, version: u64, start: u64) -> io::Result<()> {
        let src = File::open(self.version_path(ino, index, version))?;
        let len = src.metadata()?.len();
        copy_range(&src, 0, main, start, len)?;
        main.sync_data()?;
        self.written.installed.fetch_add(len, Ordering::Relaxed);
        self.remove_version(ino, index, version)
    }

    /// Delete a version file.
    pub fn remove_version(&self, ino: Ino, index: u32, version: u64) -> io::Result<()> {
        let r = std::fs::remove_file(self.version_path(ino, index, version));
        let mut idx = self.index.lock();
        idx.unsynced.remove(&(ino, index, version));
        idx.slotted.remove(&(ino, index, version));
        if let Some(v) = idx.versions.get_mut(&ino) {
            v.remove(&(index, version));
            if v.is_empty() {
                idx.versions.remove(&ino);
                idx.unsettled.remove(&ino);
            }
        }
        match r {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    /// Put every dirty byte of the data disk on stable storage (one
    /// `syncfs`: cheaper than an fdatasync per file when many are dirty).
    pub fn sync_filesystem(&self) -> io::Result<()> {
        let dir = File::open(&self.dir)?;
        // SAFETY: syncfs on a directory fd we own.
        if unsafe { libc::syncfs(dir.as_raw_fd()) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    pub fn path(&self, ino: Ino) -> PathBuf {
        self.dir.join(format!("{ino:016x}"))
    }

    /// Open (creating if needed) the backing file of `ino` for reading and writing.
    pub fn open_backing(&self, ino: Ino) -> FsResult<File> {
        let path = self.path(ino);
        OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC)
            .open(&path)
            .map_err(|e| FsError::io(format!("open backing file {}", path.display()), e))
    }

    fn reserve_path(&self) -> PathBuf {
        self.dir.with_file_name("converged.reserve")
    }

    /// Keep `bytes` of the data disk allocated in a reserve file, so that
    /// when chunk data fills the disk the metadata store can still commit
    /// (an unlink must work on a full disk). Returns whether it is in place.
    pub fn ensure_reserve(&self, bytes: u64) -> bool {
        let path = self.reserve_path();
        if std::fs::metadata(&path).is_ok_and(|m| m.len() >= bytes) {
            return true;
        }
        let Ok(f) = OpenOptions::new().create(true).write(true).truncate(false).mode(0o600).open(&path) else {
            return false;
        };
        // SAFETY: fallocate on our own fd.
        if unsafe { libc::fallocate(f.as_raw_fd(), 0, 0, bytes as i64) } != 0 {
            let _ = std::fs::remove_file(&path);
            return false;
        }
        true
    }

    /// Allocate real blocks under the embedded metadata file and `bytes`
    /// beyond its end (without changing its size), so its commits overwrite
    /// allocated space and do not fail, and poison redb, when chunk data has
    /// filled the disk. Refreshed every flush, as redb may shrink the file.
    pub fn preallocate(path: &Path, bytes: u64) {
        let Ok(f) = OpenOptions::new().write(true).open(path) else { return };
        let len = f.metadata().map(|m| m.len()).unwrap_or(0);
        // SAFETY: fallocate on our own fd; KEEP_SIZE leaves the file's length alone.
        unsafe { libc::fallocate(f.as_raw_fd(), libc::FALLOC_FL_KEEP_SIZE, 0, (len + bytes) as i64) };
    }

    /// Give the reserve back to the disk. Returns whether there was one.
    pub fn release_reserve(&self) -> bool {
        let released = std::fs::remove_file(self.reserve_path()).is_ok();
        if released {
            tracing::warn!("data disk full: released the metadata reserve so the namespace stays writable");
        }
        released
    }

    /// Create the (empty) backing file of an inode number not yet handed
    /// out. `None` when it already exists or cannot be made.
    pub fn create_spare(&self, ino: Ino) -> Option<File> {
        OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC)
            .open(self.path(ino))
            .ok()
    }

    /// Make the backing file of `from` (whose inode is gone or was never a
    /// regular file) the empty backing file of `to`, a number not
    /// handed out yet: cut to nothing and renamed, never over an existing
    /// file. A rename in the data dir instead of an unlink now and a create
    /// later: the local filesystem allocates and frees no inode. `from`'s
    /// version files go. On error nothing was renamed and the caller removes
    /// `from` as before.
    pub fn recycle(&self, from: Ino, to: Ino) -> FsResult<()> {
        for (index, version) in self.versions_of(from) {
            self.remove_version(from, index, version)
                .map_err(|e| FsError::io(format!("remove a chunk version of inode {from}"), e))?;
        }
        let (old, new) = (self.path(from), self.path(to));
        let file = OpenOptions::new().write(true).custom_flags(libc::O_CLOEXEC).open(&old);
        file.and_then(|f| f.set_len(0)).map_err(|e| FsError::io(format!("empty backing file of inode {from}"), e))?;
        let c = |p: &Path| CString::new(p.as_os_str().as_bytes()).expect("data dir paths have no NUL");
        let (old_c, new_c) = (c(&old), c(&new));
        // SAFETY: two NUL-terminated paths that live across the call.
        let r = unsafe {
            libc::renameat2(libc::AT_FDCWD, old_c.as_ptr(), libc::AT_FDCWD, new_c.as_ptr(), libc::RENAME_NOREPLACE)
        };
        if r != 0 {
            return Err(FsError::io(
                format!("rename {} to {}", old.display(), new.display()),
                io::Error::last_os_error(),
            ));
        }
        Ok(())
    }

    /// Remove the backing file of `ino` and every version file of it.
    pub fn remove(&self, ino: Ino) -> FsResult<()> {
        for (index, version) in self.versions_of(ino) {
            self.remove_version(ino, index, version)
                .map_err(|e| FsError::io(format!("remove a chunk version of inode {ino}"), e))?;
        }
        match std::fs::remove_file(self.path(ino)) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(FsError::io(format!("remove backing file of inode {ino}"), e)),
        }
    }

    /// Whether every copy of `ino` held here (its backing file, its version
    /// files) changed at or after `t` (its inode change time): written,
    /// received or made since then. False when none is held.
    pub fn changed_since(&self, ino: Ino, t: std::time::SystemTime) -> bool {
        use std::os::unix::fs::MetadataExt;
        let since = |p: PathBuf| match std::fs::metadata(p) {
            Ok(m) => Some(
                std::time::UNIX_EPOCH + std::time::Duration::new(m.ctime().max(0) as u64, m.ctime_nsec() as u32) >= t,
            ),
            Err(_) => None,
        };
        let copies: Vec<Option<bool>> = std::iter::once(since(self.path(ino)))
            .chain(self.versions_of(ino).into_iter().map(|(i, v)| since(self.version_path(ino, i, v))))
            .collect();
        copies.iter().any(Option::is_some) && copies.iter().flatten().all(|c| *c)
    }

    /// Inode numbers that have a backing file or a version file (for the
    /// mount-time consistency check).
    pub fn list(&self) -> FsResult<Vec<Ino>> {
        let rd = std::fs::read_dir(&self.dir).map_err(|e| FsError::io(format!("list {}", self.dir.display()), e))?;
        let mut out = BTreeSet::new();
        for entry in rd.flatten() {
            if let Some(ino) = entry.file_name().to_str().and_then(|n| u64::from_str_radix(n, 16).ok()) {
                out.insert(ino);
            }
        }
        out.extend(self.inodes_with_versions());
        Ok(out.into_iter().collect())
    }
}

/// Take `len` bytes from `next` as they come, each piece handed to `put`
/// with its offset; a stream that ends early is `UnexpectedEof`.
fn receive<B: AsRef<[u8]>>(
    len: u64,
    next: &mut dyn FnMut() -> Option<B>,
    mut put: impl FnMut(&[u8], u64) -> io::Result<()>,
) -> io::Result<()> {
    let mut got = 0u64;
    while got < len {
        let Some(piece) = next() else {
            let e = converged_transport::ServiceError::short_write(got, len);
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, e.msg));
        };
        let piece = piece.as_ref();
        put(piece, got)?;
        got += piece.len() as u64;
    }
    Ok(())
}

/// A version file's name: `<ino>.<index>.<version>`, in hex.
fn version_name(ino: Ino, index: u32, version: u64) -> String {
    format!("{ino:016x}.{index:08x}.{version:016x}")
}

fn parse_slot_name(name: &str) -> Option<u64> {
    let hex = name.strip_prefix("slot.")?;
    (hex.len() == 16).then(|| u64::from_str_radix(hex, 16).ok()).flatten()
}

/// Label a slot with the version it holds.
fn set_label(f: &File, name: &str) -> io::Result<()> {
    // SAFETY: fsetxattr on our own fd, with a NUL-terminated name and a
    // value buffer of the length given.
    let r = unsafe { libc::fsetxattr(f.as_raw_fd(), SLOT_LABEL.as_ptr(), name.as_ptr().cast(), name.len(), 0) };
    match r {
        0 => Ok(()),
        _ => Err(io::Error::last_os_error()),
    }
}

/// The version a slot's label names, if it has one.
fn read_label(path: &Path) -> Option<VersionKey> {
    let c_path = CString::new(path.as_os_str().as_bytes()).ok()?;
    let mut buf = [0u8; 64];
    // SAFETY: getxattr into a buffer of the length given, with
    // NUL-terminated path and name.
    let n = unsafe { libc::getxattr(c_path.as_ptr(), SLOT_LABEL.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    let n = usize::try_from(n).ok()?;
    std::str::from_utf8(&buf[..n]).ok().and_then(parse_version_name)
}

/// (inode, chunk index, version) of a version file's name.
fn parse_version_name(name: &str) -> Option<VersionKey> {
    let mut parts = name.split('.');
    let ino = u64::from_str_radix(parts.next()?, 16).ok()?;
    let index = u32::from_str_radix(parts.next()?, 16).ok()?;
    let version = u64::from_str_radix(parts.next()?, 16).ok()?;
    parts.next().is_none().then_some((ino, index, version))
}

/// Copy `len` bytes from `src` at `from` to `dst` at `to`: a reflink of
/// the range where the filesystem can share blocks (XFS, btrfs), else a copy
/// in the kernel (`copy_file_range`), else through a buffer. Bytes past the
/// source's end are not copied.
fn copy_range(src: &File, from: u64, dst: &File, to: u64, len: u64) -> io::Result<()> {
    let len = len.min(src.metadata()?.len().saturating_sub(from));
    if len == 0 {
        return Ok(());
    }
    // FICLONERANGE wants block-aligned offsets, and a length that is aligned
    // or reaches the source's end; the kernel refuses anything else.
    let clone =
        libc::file_clone_range { src_fd: src.as_raw_fd() as i64, src_offset: from, src_length: len, dest_offset: to };
    // SAFETY: an ioctl on two fds we own, with a properly filled struct.
    if unsafe { libc::ioctl(dst.as_raw_fd(), libc::FICLONERANGE, &clone) } == 0 {
        return Ok(());
    }
    let (mut off_in, mut off_out) = (from as i64, to as i64);
    let mut left = len as usize;
    while left > 0 {
        // SAFETY: copy_file_range on fds we own, with offsets we own.
        let n = unsafe { libc::copy_file_range(src.as_raw_fd(), &mut off_in, dst.as_raw_fd(), &mut off_out, left, 0) };
        match n {
            n if n > 0 => left -= n as usize,
            0 => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "source ended during a copy")),
            _ => {
                let e = io::Error::last_os_error();
                match e.raw_os_error() {
                    // Not supported between these files: copy through a buffer.
                    Some(libc::EXDEV | libc::EINVAL | libc::EOPNOTSUPP | libc::ENOSYS) => {
                        let mut buf = vec![0u8; left.min(8 << 20)];
                        while left > 0 {
                            let n = left.min(buf.len());
                            read_exact_at(src, &mut buf[..n], off_in as u64)?;
                            dst.write_all_at(&buf[..n], off_out as u64)?;
                            (off_in, off_out, left) = (off_in + n as i64, off_out + n as i64, left - n);
                        }
                    }
                    _ => return Err(e),
                }
            }
        }
    }
    Ok(())
}

/// What the peer server asks of the filesystem core (set once it is up).
/// A hook's yes (Ok) or no (the error the peer gets).
pub type Answer = Result<(), converged_transport::ServiceError>;
/// Whether a caller may store a chunk version here.
pub type WriteCheck = Box<dyn Fn(&Caller, &ChunkRef) -> Answer + Send + Sync>;
/// [`WriteCheck`] of a file the caller says it made in a delegated directory.
pub type MadeCheck = Box<dyn Fn(&Caller, &ChunkRef, u64) -> Answer + Send + Sync>;

pub struct LocalHooks {
    /// Fetch chunk `index` of `ino` onto this node and record the copy (a
    /// peer's share of a distributed stage).
    pub stage: Box<dyn Fn(u64, u32) -> Result<(), converged_transport::ServiceError> + Send + Sync>,
    /// Whether a writer here changes the inode's backing file in place: its
    /// bytes are then no published version, and peers are told so.
    pub being_written: Box<dyn Fn(u64) -> bool + Send + Sync>,
    /// Whether a peer may store a chunk version here / drop a file here,
    /// by the metadata (see `Core::peer_may_write`).
    pub may_write: WriteCheck,
    /// Whether a peer may store a chunk version here of a file it made in
    /// a directory it says is delegated to it (see `Core::peer_may_write_made`).
    pub may_write_made: MadeCheck,
    pub may_delete: Box<dyn Fn(u64) -> Answer + Send + Sync>,
    /// Commit what this node acknowledged in a directory and give its
    /// delegation up (a peer is about to read it): the revision.
    pub recall: Box<dyn Fn(u64) -> Result<i64, converged_transport::ServiceError> + Send + Sync>,
}

/// Serves this node's chunks to peers over the transport. It answers for
/// bytes; whether a peer may write or delete here is asked of the
/// namespace through the hooks (none yet: the node is starting, refused).
pub struct PeerChunks {
    pub store: Arc<ChunkStore>,
    pub hooks: Arc<std::sync::OnceLock<LocalHooks>>,
}

fn starting() -> converged_transport::ServiceError {
    converged_transport::ServiceError { errno: libc::EAGAIN, msg: "node is starting".into() }
}

fn service_err(e: std::io::Error) -> converged_transport::ServiceError {
    converged_transport::ServiceError { errno: e.raw_os_error().unwrap_or(libc::EIO), msg: e.to_string() }
}

impl PeerChunks {
    /// Where a chunk version is read from here: its version file, or the
    /// backing file at the chunk's offset. A backing file being rewritten
    /// here holds no published version: the reader is told to go elsewhere.
    fn source(&self, c: &ChunkRef) -> Result<(File, u64), converged_transport::ServiceError> {
        if let Some(f) = self.store.open_version(c.ino, c.index, c.version) {
            return Ok((f, 0));
        }
        if self.hooks.get().is_some_and(|h| (h.being_written)(c.ino)) {
            return Err(converged_transport::ServiceError {
                errno: libc::ESTALE,
                msg: format!("inode {} is being rewritten on this node; read another replica", c.ino),
            });
        }
        Ok((File::open(self.store.path(c.ino)).map_err(service_err)?, c.start))
    }
}

impl converged_transport::ChunkService for PeerChunks {
    fn read(&self, c: &ChunkRef, at: u64, len: u32) -> Result<Vec<u8>, converged_transport::ServiceError> {
        let (f, base) = self.source(c)?;
        let size = f.metadata().map_err(service_err)?.len();
        let offset = base + at;
        let len = (len as u64).min(size.saturating_sub(offset)) as usize;
        crate::blocks::read_vec_at(&f, len, offset).map_err(service_err)
    }
    fn write(&self, c: &ChunkRef, data: &[u8]) -> Result<(), converged_transport::ServiceError> {
        self.store.write_version(c, data, Arrival::Received, true).map_err(service_err)
    }
    fn write_unsynced(&self, c: &ChunkRef, data: &[u8]) -> Result<(), converged_transport::ServiceError> {
        self.store.write_version(c, data, Arrival::Received, false).map_err(service_err)
    }
    fn write_from(
        &self,
        c: &ChunkRef,
        len: u64,
        durable: bool,
        next: &mut dyn FnMut() -> Option<bytes::Bytes>,
    ) -> Result<(), converged_transport::ServiceError> {
        self.store.write_version_from(c, len, Arrival::Received, durable, next).map_err(service_err)
    }
    fn sync(&self, ino: u64, versions: &[(u32, u64)]) -> Result<(), converged_transport::ServiceError> {
        self.store.sync_versions(ino, versions).map_err(service_err)
    }
    fn may_write(&self, caller: &Caller, c: &ChunkRef) -> Result<(), converged_transport::ServiceError> {
        match self.hooks.get() {
            Some(h) => (h.may_write)(caller, c),
            None => Err(starting()),
        }
    }
    fn may_write_made(&self, caller: &Caller, c: &ChunkRef, dir: u64) -> Result<(), converged_transport::ServiceError> {
        match self.hooks.get() {
            Some(h) => (h.may_write_made)(caller, c, dir),
            None => Err(starting()),
        }
    }
    fn may_delete(&self, _caller: &Caller, ino: u64) -> Result<(), converged_transport::ServiceError> {
        match self.hooks.get() {
            Some(h) => (h.may_delete)(ino),
            None => Err(starting()),
        }
    }
    fn delete(&self, ino: u64) -> Result<(), converged_transport::ServiceError> {
        self.store.remove(ino).map_err(|e| service_err(std::io::Error::other(e.to_string())))
    }
    fn checksums(&self, c: &ChunkRef, at: u64, len: u64) -> Result<Vec<u32>, converged_transport::ServiceError> {
        let (f, base) = self.source(c)?;
        block_crcs(&f, base + at, len).map_err(service_err)
    }
    fn stage(&self, ino: u64, chunk: u32) -> Result<(), converged_transport::ServiceError> {
        match self.hooks.get() {
            Some(h) => (h.stage)(ino, chunk),
            None => Err(starting()),
        }
    }
    fn recall(&self, dir: u64) -> Result<i64, converged_transport::ServiceError> {
        match self.hooks.get() {
            Some(h) => (h.recall)(dir),
            None => Err(starting()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(version: u64) -> ChunkRef {
        ChunkRef { ino: 7, index: 0, version, start: 0 }
    }

    /// A sync vouches only for versions this store received unsynced since
    /// it was opened: after a restart, a version file left on disk (whole
    /// or not) is refused, so the sender sends it again durably.
    #[test]
    fn a_sync_vouches_only_for_versions_received_unsynced_since_open() {
        let dir = tempfile::tempdir().unwrap();
        let store = ChunkStore::open(dir.path()).unwrap();
        store.write_version(&chunk(1), b"streamed", Arrival::Received, false).unwrap();
        store.write_version(&chunk(2), b"durable", Arrival::Received, true).unwrap();
        assert_eq!(store.written.received.load(Ordering::Relaxed), 15);
        let e = store.sync_versions(7, &[(0, 2)]).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound, "a durable write needs no sync and is not vouched for twice");
        store.sync_versions(7, &[(0, 1)]).unwrap();
        assert_eq!(std::fs::read(store.version_path(7, 0, 1)).unwrap(), b"streamed");
        assert!(store.sync_versions(7, &[(0, 1)]).is_err(), "a version is synced once");

        // A peer's write that stops short leaves no file and nothing to vouch for.
        let mut pieces = vec![&b"half"[..]].into_iter();
        let e = store.write_version_from(&chunk(4), 8, Arrival::Received, false, &mut || pieces.next()).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
        assert!(!store.version_path(7, 0, 4).exists());
        assert!(!store.has_version(7, 0, 4));
        assert!(store.sync_versions(7, &[(0, 4)]).is_err());

        store.write_version(&chunk(3), b"left by a crash", Arrival::Received, false).unwrap();
        drop(store);
        let reopened = ChunkStore::open(dir.path()).unwrap();
        assert!(reopened.has_version(7, 0, 3));
        let e = reopened.sync_versions(7, &[(0, 3)]).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound, "{e}");
    }

    /// A durable write of a small version fills a slot made ahead: no file
    /// of the version's own name, the bytes under the slot's name, found
    /// again from its label when the store opens; an earlier file of that
    /// version goes, a slot never filled goes at the next open, and a
    /// removed version takes its slot with it.
    #[test]
    fn a_small_durable_version_fills_a_slot_found_again_from_its_label() {
        let dir = tempfile::tempdir().unwrap();
        let store = ChunkStore::open(dir.path()).unwrap();
        store.write_version(&chunk(1), b"before the slots", Arrival::Received, true).unwrap();
        assert!(store.own_path(7, 0, 1).exists(), "no slot ready: a file of its own");
        assert_eq!(store.make_slots(std::time::Duration::ZERO).unwrap(), SLOTS);
        assert!(!store.slots.lock().off, "this test needs a data dir that takes user xattrs");
        store.write_version(&chunk(1), b"sent again", Arrival::Received, true).unwrap();
        store.write_version(&chunk(2), b"a small file's copy", Arrival::Received, true).unwrap();
        for (v, bytes) in [(1, &b"sent again"[..]), (2, b"a small file's copy")] {
            assert!(!store.own_path(7, 0, v).exists(), "v{v}: in a slot, not under its own name");
            let path = store.version_path(7, 0, v);
            assert!(path.file_name().unwrap().to_str().unwrap().starts_with("slot."), "{path:?}");
            assert_eq!(std::fs::read(&path).unwrap(), bytes);
        }
        let big = vec![7u8; SLOT_MAX as usize + 1];
        store.write_version(&chunk(3), &big, Arrival::Received, true).unwrap();
        assert!(store.own_path(7, 0, 3).exists(), "a version over SLOT_MAX has a file of its own");
        assert_eq!(store.slots.lock().ready.len(), SLOTS - 2);
        drop(store);

        let reopened = ChunkStore::open(dir.path()).unwrap();
        assert_eq!(reopened.versions_of(7), vec![(0, 1), (0, 2), (0, 3)]);
        assert!(reopened.open_version(7, 0, 2).is_some(), "served from its slot");
        assert_eq!(std::fs::read(reopened.version_path(7, 0, 2)).unwrap(), b"a small file's copy");
        let slots = || {
            std::fs::read_dir(dir.path().join("chunks"))
                .unwrap()
                .filter(|e| e.as_ref().unwrap().file_name().to_str().unwrap().starts_with("slot."))
                .count()
        };
        assert_eq!(slots(), 2, "the slots never filled went");
        reopened.remove_version(7, 0, 2).unwrap();
        assert_eq!(slots(), 1, "a removed version's slot goes with it");
        assert!(!reopened.has_version(7, 0, 2));
        assert_eq!(std::fs::read(reopened.version_path(7, 0, 1)).unwrap(), b"sent again");
    }

    /// A file counts as changed since a moment only when every copy of it
    /// held here is: one older copy (a version file kept from before, a
    /// backing file not touched since) makes it a file held then.
    #[test]
    fn a_file_is_changed_since_a_moment_when_all_its_copies_are() {
        let dir = tempfile::tempdir().unwrap();
        let store = ChunkStore::open(dir.path()).unwrap();
        store.write_version(&chunk(1), b"kept from before", Arrival::Received, true).unwrap();
        std::fs::write(store.path(9), b"a backing file from before").unwrap();
        // ctime has the kernel's clock tick as grain: step past it.
        std::thread::sleep(std::time::Duration::from_millis(20));
        let t = std::time::SystemTime::now();
        assert!(!store.changed_since(7, t), "a version file older than the moment");
        assert!(!store.changed_since(9, t), "a backing file older than the moment");
        assert!(!store.changed_since(11, t), "nothing held");
        std::thread::sleep(std::time::Duration::from_millis(20));
        store.write_version(&chunk(2), b"received since", Arrival::Received, true).unwrap();
        assert!(!store.changed_since(7, t), "one copy of the file is older than the moment");
        std::fs::write(store.path(9), b"written since").unwrap();
        assert!(store.changed_since(9, t), "its one copy was written since");
        std::fs::write(store.path(11), b"made since").unwrap();
        assert!(store.changed_since(11, t), "made since");
        store.remove_version(7, 0, 1).unwrap();
        assert!(store.changed_since(7, t), "the older version is gone: every copy left is newer");
    }
}
