//! The FUSE adapter: the only module that knows fuser. Each callback opens a
//! span, makes one call into [`Core`], and replies or reports the error once.

use crate::latency::{self, Area};
use std::collections::HashMap;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use converged_metadata::held_locks::Mutex;
use converged_metadata::types::{FileKind, Ino, Inode, NewNode, RenameMode, SetAttr, TimeSet, Timespec, XattrMode};
use fuser::{
    AccessFlags, BackingId, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo,
    InitFlags, KernelConfig, LockOwner, OpenAccMode, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData,
    ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyLseek, ReplyOpen, ReplyStatfs, ReplyWrite,
    ReplyXattr, Request, TimeOrNow, WriteFlags,
};
use tracing::debug_span;

use crate::core::{Caller, Core, Opened};
use crate::error::FsError;

pub struct FuseAdapter {
    core: Arc<Core>,
    ttl: Duration,
    want_passthrough: bool,
    backing: Mutex<BackingIds>,
    /// Notifications to the kernel from request handlers (set once the
    /// session exists).
    notifier: Arc<std::sync::OnceLock<fuser::Notifier>>,
}

/// Backing ids registered with the kernel: one per inode, shared by every
/// handle open on it, closed when the last handle is released.
#[derive(Default)]
struct BackingIds {
    by_fh: HashMap<u64, Arc<BackingId>>,
    by_ino: HashMap<Ino, Weak<BackingId>>,
}

/// Entries of a `readdirplus` read ahead together: three records each
/// (name, attributes, backfill record) in one etcd transaction of at most
/// 128 reads.
const READDIRPLUS_AHEAD: usize = 42;

impl FuseAdapter {
    pub fn new(core: Arc<Core>, ttl: Duration, want_passthrough: bool) -> Self {
        Self { core, ttl, want_passthrough, backing: Mutex::default(), notifier: Arc::default() }
    }

    /// How long the kernel may keep `i`'s attributes: not at all while a
    /// writer is open here. Writes through a shared mapping of a passthrough
    /// file change the backing file without the kernel's knowing, so mtime
    /// and size come from the daemon (which reads the backing file) until
    /// the file is sealed.
    fn attr_ttl(&self, i: &converged_metadata::types::Inode) -> Duration {
        if self.core.is_being_written(i.ino) {
            Duration::ZERO
        } else {
            self.ttl
        }
    }

    /// Drop the kernel's cached attributes of `ino` (not its pages: that
    /// would wait for requests in flight on the inode, this one included).
    fn refresh_attrs(&self, ino: u64) {
        if let Some(n) = self.notifier.get() {
            if let Err(e) = n.inval_inode(INodeNo(ino), -1, 0) {
                if e.raw_os_error() != Some(libc::ENOENT) {
                    tracing::debug!(ino, error = %e, "could not drop the kernel's attributes");
                }
            }
        }
    }
}

/// A change feed subscriber that drops what the kernel caches about records
/// another node changed: the attributes and pages of a changed inode or
/// layout, the entry of a changed name. Notifications go out from a thread
/// of their own, never from a request handler (the kernel may wait on a
/// request in flight before it applies one).
pub fn kernel_invalidator(session: &fuser::Session<FuseAdapter>) -> std::io::Result<converged_metadata::ChangeFeed> {
    let notifier = session.notifier();
    let (tx, rx) = std::sync::mpsc::channel::<Vec<u8>>();
    std::thread::Builder::new().name("invalidate".into()).spawn(move || {
        for key in rx {
            use converged_metadata::schema::{change_of, Change};
            // ENOENT: the kernel holds nothing for it. Anything else is worth a line.
            let r = match change_of(&key) {
                Change::Inode(ino) => notifier.inval_inode(INodeNo(ino), 0, 0),
                Change::Entry { parent, name } => notifier.inval_entry(INodeNo(parent), OsStr::from_bytes(name)),
                _ => Ok(()),
            };
            if let Err(e) = r {
                if e.raw_os_error() != Some(libc::ENOENT) {
                    tracing::debug!(error = %e, "kernel cache invalidation failed");
                }
            }
        }
    })?;
    Ok(std::sync::Arc::new(move |key: &[u8], _: Option<&[u8]>| {
        use converged_metadata::schema::{change_of, Change};
        if matches!(change_of(key), Change::Inode(_) | Change::Entry { .. }) {
            let _ = tx.send(key.to_vec());
        }
    }))
}

/// Log once, at the error's own level, and turn it into an errno.
fn errno(op: &'static str, e: FsError) -> Errno {
    if e.is_fault() {
        tracing::warn!(op, error = %e, "request failed");
    } else {
        tracing::debug!(op, error = %e, "request failed");
    }
    Errno::from_i32(e.errno())
}

fn to_system_time(t: Timespec) -> SystemTime {
    if t.sec >= 0 {
        UNIX_EPOCH + Duration::new(t.sec as u64, t.nsec)
    } else {
        UNIX_EPOCH - Duration::new(t.sec.unsigned_abs(), 0) + Duration::new(0, t.nsec)
    }
}

fn from_time(t: TimeOrNow) -> TimeSet {
    match t {
        TimeOrNow::Now => TimeSet::Now,
        TimeOrNow::SpecificTime(st) => TimeSet::At(from_system_time(st)),
    }
}

fn from_system_time(st: SystemTime) -> Timespec {
    match st.duration_since(UNIX_EPOCH) {
        Ok(d) => Timespec { sec: d.as_secs() as i64, nsec: d.subsec_nanos() },
        Err(e) => {
            let d = e.duration();
            let mut sec = -(d.as_secs() as i64);
            let mut nsec = d.subsec_nanos();
            if nsec > 0 {
                sec -= 1;
                nsec = 1_000_000_000 - nsec;
            }
            Timespec { sec, nsec }
        }
    }
}

fn file_type(kind: FileKind) -> FileType {
    match kind {
        FileKind::Regular => FileType::RegularFile,
        FileKind::Directory => FileType::Directory,
        FileKind::Symlink => FileType::Symlink,
        FileKind::Fifo => FileType::NamedPipe,
        FileKind::Socket => FileType::Socket,
        FileKind::CharDevice => FileType::CharDevice,
        FileKind::BlockDevice => FileType::BlockDevice,
    }
}

fn attr(i: &Inode) -> FileAttr {
    FileAttr {
        ino: INodeNo(i.ino),
        size: i.size,
        blocks: i.size.div_ceil(512),
        atime: to_system_time(i.atime),
        mtime: to_system_time(i.mtime),
        ctime: to_system_time(i.ctime),
        crtime: to_system_time(i.ctime),
        kind: file_type(i.kind),
        perm: i.perm,
        nlink: i.nlink,
        uid: i.uid,
        gid: i.gid,
        rdev: i.rdev,
        blksize: 1 << 20,
        flags: 0,
    }
}

/// A node owned by the caller, with the permission bits of `mode`.
fn node_for(req: &Request, kind: FileKind, mode: u32, umask: u32) -> NewNode<'static> {
    NewNode {
        kind,
        perm: (mode & 0o7777) as u16,
        uid: req.uid(),
        gid: req.gid(),
        rdev: 0,
        target: None,
        unsealed: false,
        umask: (umask & 0o777) as u16,
    }
}

/// Open flags for a handle the daemon serves.
fn fopen_flags(opened: &Opened) -> FopenFlags {
    if opened.direct_io {
        FopenFlags::FOPEN_DIRECT_IO
    } else {
        FopenFlags::empty()
    }
}

fn is_writable(flags: OpenFlags) -> bool {
    flags.acc_mode() != OpenAccMode::O_RDONLY
}

impl FuseAdapter {
    /// Register the backing file with the kernel for passthrough, sharing one
    /// backing id per inode. `None` means serve this handle through the daemon.
    fn backing_id(
        &self,
        ino: Ino,
        opened: &Opened,
        open_backing: impl Fn(&std::fs::File) -> std::io::Result<BackingId>,
    ) -> Option<Arc<BackingId>> {
        let file = opened.backing.as_ref()?;
        let mut ids = self.backing.lock();
        let id = match ids.by_ino.get(&ino).and_then(Weak::upgrade) {
            Some(id) => id,
            None => match open_backing(file) {
                Ok(id) => {
                    let id = Arc::new(id);
                    ids.by_ino.insert(ino, Arc::downgrade(&id));
                    id
                }
                Err(e) => {
                    tracing::warn!(ino, error = %e, "passthrough refused by the kernel; falling back to daemon I/O");
                    self.core.passthrough_refused();
                    return None;
                }
            },
        };
        ids.by_fh.insert(opened.fh, id.clone());
        Some(id)
    }

    fn new_node(&self, parent: INodeNo, name: &OsStr, node: NewNode<'_>, reply: ReplyEntry) {
        match self.core.mknod(parent.0, name.as_bytes(), &node) {
            Ok(i) => reply.entry(&self.attr_ttl(&i), &attr(&i), Generation(0)),
            Err(e) => reply.error(errno("mknod", e)),
        }
    }

    /// The reply to create and tmpfile: the new inode, open, by passthrough
    /// when the kernel takes the backing file. Its attributes are kept for
    /// the full timeout although a writer has it open: the file is empty,
    /// so nothing can change it behind the kernel (a shared mapping of an
    /// empty file has no page to store to), and everything that can
    /// (write(2), which makes the kernel drop size and mtime; truncate, whose
    /// reply carries no timeout while written) makes the kernel ask again.
    /// So a file created and closed unwritten is stat-ed from the kernel.
    fn reply_created(&self, inode: &converged_metadata::types::Inode, opened: &Opened, reply: ReplyCreate) {
        let a = attr(inode);
        let ttl = if inode.size == 0 { self.ttl } else { self.attr_ttl(inode) };
        match self.backing_id(inode.ino, opened, |f| reply.open_backing(f)) {
            Some(id) => {
                reply.created_passthrough(&ttl, &a, Generation(0), FileHandle(opened.fh), FopenFlags::empty(), &id)
            }
            None => reply.created(&ttl, &a, Generation(0), FileHandle(opened.fh), fopen_flags(opened)),
        }
    }
}

impl Filesystem for FuseAdapter {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let _ = config.set_max_write(1 << 20);
        let _ = config.set_max_readahead(1 << 20);
        let _ = config.set_max_background(64);
        let _ = config.add_capabilities(InitFlags::FUSE_PARALLEL_DIROPS);
        // File handles (name_to_handle_at, NFS export): the kernel looks a
        // handle's inode up as `.` in it (see Core::lookup).
        let _ = config.add_capabilities(InitFlags::FUSE_EXPORT_SUPPORT);
        // POSIX ACLs: the kernel checks them (from system.posix_acl_* xattrs)
        // and leaves the umask to the daemon, which applies it, or a
        // directory's default ACL instead (converged_metadata::acl).
        if config.add_capabilities(InitFlags::FUSE_POSIX_ACL | InitFlags::FUSE_DONT_MASK).is_err() {
            tracing::warn!("the kernel offers no POSIX ACLs; ACL xattrs are stored but not enforced");
        }
        // Listings with attributes: `ls -l` and `find` get every entry's
        // attributes with the names (read ahead in one request on a
        // cluster) instead of a lookup per name; the kernel's heuristic
        // asks for them only where they are being used.
        let _ = config.add_capabilities(InitFlags::FUSE_DO_READDIRPLUS | InitFlags::FUSE_READDIRPLUS_AUTO);
        // mmap of a direct-I/O handle (one opened beside passthrough handles).
        let _ = config.add_capabilities(InitFlags::FUSE_DIRECT_IO_ALLOW_MMAP);
        let mut passthrough = false;
        if self.want_passthrough {
            match config.add_capabilities(InitFlags::FUSE_PASSTHROUGH) {
                Ok(()) => match config.set_max_stack_depth(1) {
                    Ok(_) => passthrough = true,
                    Err(e) => tracing::warn!(max = e, "kernel refused passthrough stack depth; daemon I/O only"),
                },
                Err(_) => {
                    tracing::warn!("kernel does not offer FUSE passthrough; reads and writes go through the daemon")
                }
            }
        }
        self.core.set_passthrough(passthrough);
        tracing::info!(passthrough = self.core.passthrough(), "FUSE session initialised");
        Ok(())
    }

    fn destroy(&mut self) {
        self.core.shutdown();
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let _s = debug_span!("lookup", parent = parent.0, name = ?name).entered();
        let _t = latency::timer(Area::Fuse, "lookup");
        match self.core.lookup(parent.0, name.as_bytes()) {
            Ok(i) => reply.entry(&self.attr_ttl(&i), &attr(&i), Generation(0)),
            Err(e) => reply.error(errno("lookup", e)),
        }
    }

    fn forget(&self, _req: &Request, ino: INodeNo, _nlookup: u64) {
        // Sent once, when the kernel drops the inode (with every lookup it
        // counted): nothing will ask for it again.
        self.core.forget(ino.0);
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        let _s = debug_span!("getattr", ino = ino.0).entered();
        let _t = latency::timer(Area::Fuse, "getattr");
        match self.core.getattr(ino.0) {
            Ok(i) => reply.attr(&self.attr_ttl(&i), &attr(&i)),
            Err(e) => reply.error(errno("getattr", e)),
        }
    }

    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let _s = debug_span!("setattr", ino = ino.0, ?mode, ?uid, ?gid, ?size).entered();
        let _t = latency::timer(Area::Fuse, "setattr");
        let set = SetAttr {
            mode,
            uid,
            gid,
            size,
            atime: atime.map(from_time),
            mtime: mtime.map(from_time),
            ctime: ctime.map(from_system_time),
        };
        let caller = Caller { uid: req.uid(), gid: req.gid(), pid: req.pid() };
        let result = self.core.setattr(ino.0, &set).and_then(|i| match size.is_some() {
            // A truncate changes the bytes: set-ID bits as after a write.
            true if self.core.drop_setid(ino.0, &caller)? => self.core.getattr(ino.0),
            _ => Ok(i),
        });
        match result {
            Ok(i) => reply.attr(&self.attr_ttl(&i), &attr(&i)),
            Err(e) => reply.error(errno("setattr", e)),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        let _s = debug_span!("readlink", ino = ino.0).entered();
        let _t = latency::timer(Area::Fuse, "readlink");
        match self.core.readlink(ino.0) {
            Ok(t) => reply.data(&t),
            Err(e) => reply.error(errno("readlink", e)),
        }
    }

    fn mknod(&self, req: &Request, parent: INodeNo, name: &OsStr, mode: u32, umask: u32, rdev: u32, reply: ReplyEntry) {
        let _s = debug_span!("mknod", parent = parent.0, name = ?name, mode).entered();
        let _t = latency::timer(Area::Fuse, "mknod");
        let Some(kind) = FileKind::from_mode(mode) else {
            return reply.error(Errno::EINVAL);
        };
        let node = NewNode { rdev, ..node_for(req, kind, mode, umask) };
        self.new_node(parent, name, node, reply);
    }

    fn mkdir(&self, req: &Request, parent: INodeNo, name: &OsStr, mode: u32, umask: u32, reply: ReplyEntry) {
        let _s = debug_span!("mkdir", parent = parent.0, name = ?name, mode).entered();
        let _t = latency::timer(Area::Fuse, "mkdir");
        let node = node_for(req, FileKind::Directory, mode, umask);
        self.new_node(parent, name, node, reply);
    }

    fn symlink(&self, req: &Request, parent: INodeNo, link_name: &OsStr, target: &Path, reply: ReplyEntry) {
        let _s = debug_span!("symlink", parent = parent.0, name = ?link_name).entered();
        let _t = latency::timer(Area::Fuse, "symlink");
        let node =
            NewNode { target: Some(target.as_os_str().as_bytes()), ..node_for(req, FileKind::Symlink, 0o777, 0) };
        self.new_node(parent, link_name, node, reply);
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let _s = debug_span!("unlink", parent = parent.0, name = ?name).entered();
        let _t = latency::timer(Area::Fuse, "unlink");
        match self.core.unlink(parent.0, name.as_bytes()) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno("unlink", e)),
        }
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let _s = debug_span!("rmdir", parent = parent.0, name = ?name).entered();
        let _t = latency::timer(Area::Fuse, "rmdir");
        match self.core.rmdir(parent.0, name.as_bytes()) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno("rmdir", e)),
        }
    }

    fn rename(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let _s = debug_span!("rename", parent = parent.0, name = ?name, newparent = newparent.0, newname = ?newname)
            .entered();
        let _t = latency::timer(Area::Fuse, "rename");
        let whiteout = flags.contains(RenameFlags::RENAME_WHITEOUT);
        let flags = flags - RenameFlags::RENAME_WHITEOUT;
        let mode = if flags.contains(RenameFlags::RENAME_EXCHANGE) {
            RenameMode::Exchange
        } else if flags.contains(RenameFlags::RENAME_NOREPLACE) {
            RenameMode::NoReplace
        } else if flags.is_empty() {
            RenameMode::Replace
        } else {
            return reply.error(Errno::EINVAL);
        };
        let owner = whiteout.then(|| (req.uid(), req.gid()));
        match self.core.rename_leaving(parent.0, name.as_bytes(), newparent.0, newname.as_bytes(), mode, owner) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno("rename", e)),
        }
    }

    fn link(&self, _req: &Request, ino: INodeNo, newparent: INodeNo, newname: &OsStr, reply: ReplyEntry) {
        let _s = debug_span!("link", ino = ino.0, newparent = newparent.0, newname = ?newname).entered();
        let _t = latency::timer(Area::Fuse, "link");
        match self.core.link(ino.0, newparent.0, newname.as_bytes()) {
            Ok(i) => reply.entry(&self.attr_ttl(&i), &attr(&i), Generation(0)),
            Err(e) => reply.error(errno("link", e)),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let _s = debug_span!("open", ino = ino.0, flags = flags.0).entered();
        let _t = latency::timer(Area::Fuse, "open");
        match self.core.open(ino.0, is_writable(flags)) {
            Ok(opened) => {
                if opened.refresh_attrs {
                    self.refresh_attrs(ino.0);
                }
                match self.backing_id(ino.0, &opened, |f| reply.open_backing(f)) {
                    Some(id) => reply.opened_passthrough(FileHandle(opened.fh), FopenFlags::empty(), &id),
                    None => reply.opened(FileHandle(opened.fh), fopen_flags(&opened)),
                }
            }
            Err(e) => reply.error(errno("open", e)),
        }
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let _s = debug_span!("create", parent = parent.0, name = ?name, mode, flags).entered();
        let _t = latency::timer(Area::Fuse, "create");
        let node = NewNode { unsealed: is_writable(OpenFlags(flags)), ..node_for(req, FileKind::Regular, mode, umask) };
        match self.core.create(parent.0, name.as_bytes(), &node) {
            Ok((inode, opened)) => self.reply_created(&inode, &opened, reply),
            Err(e) => reply.error(errno("create", e)),
        }
    }

    fn tmpfile(&self, req: &Request, parent: INodeNo, mode: u32, umask: u32, flags: i32, reply: ReplyCreate) {
        let _s = debug_span!("tmpfile", parent = parent.0, mode, flags).entered();
        let _t = latency::timer(Area::Fuse, "tmpfile");
        let node = NewNode { unsealed: is_writable(OpenFlags(flags)), ..node_for(req, FileKind::Regular, mode, umask) };
        match self.core.tmpfile(parent.0, &node) {
            Ok((inode, opened)) => self.reply_created(&inode, &opened, reply),
            Err(e) => reply.error(errno("tmpfile", e)),
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let _s = debug_span!("read", ino = ino.0, offset, size).entered();
        let _t = latency::timer(Area::Fuse, "read");
        match self.core.read(fh.0, offset, size) {
            Ok(data) => reply.data(&data),
            Err(e) => reply.error(errno("read", e)),
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let _s = debug_span!("write", ino = ino.0, offset, len = data.len()).entered();
        let _t = latency::timer(Area::Fuse, "write");
        match self.core.write(fh.0, offset, data) {
            Ok(n) => reply.written(n),
            Err(e) => reply.error(errno("write", e)),
        }
    }

    fn flush(&self, _req: &Request, ino: INodeNo, fh: FileHandle, _lock_owner: LockOwner, reply: ReplyEmpty) {
        let _s = debug_span!("flush", ino = ino.0, fh = fh.0).entered();
        let _t = latency::timer(Area::Fuse, "flush");
        match self.core.close(fh.0) {
            Ok(true) => reply.ok(),
            // On a single node writes are write-through and report their own
            // errors, so close(2) has nothing to flush: ENOSYS tells the
            // kernel to stop sending FLUSH, saving a round trip per close.
            Ok(false) => reply.error(Errno::ENOSYS),
            Err(e) => reply.error(errno("flush", e)),
        }
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let _s = debug_span!("release", ino = ino.0, fh = fh.0).entered();
        let _t = latency::timer(Area::Fuse, "release");
        {
            let mut ids = self.backing.lock();
            if ids.by_fh.remove(&fh.0).is_some() && ids.by_ino.get(&ino.0).is_some_and(|w| w.strong_count() == 0) {
                ids.by_ino.remove(&ino.0);
            }
        }
        match self.core.release(fh.0) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno("release", e)),
        }
    }

    fn fsync(&self, _req: &Request, ino: INodeNo, fh: FileHandle, datasync: bool, reply: ReplyEmpty) {
        let _s = debug_span!("fsync", ino = ino.0, datasync).entered();
        let _t = latency::timer(Area::Fuse, "fsync");
        match self.core.fsync(fh.0, datasync) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno("fsync", e)),
        }
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let _t = latency::timer(Area::Fuse, "opendir");
        match self.core.opendir(ino.0) {
            Ok((fh, atime_changed)) => {
                if atime_changed {
                    self.refresh_attrs(ino.0);
                }
                reply.opened(FileHandle(fh), FopenFlags::empty())
            }
            Err(e) => reply.error(errno("opendir", e)),
        }
    }

    fn readdir(&self, _req: &Request, ino: INodeNo, fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        let _s = debug_span!("readdir", ino = ino.0, offset).entered();
        let _t = latency::timer(Area::Fuse, "readdir");
        match self.core.readdir(ino.0, fh.0, offset) {
            Ok(entries) => {
                for (i, (name, d)) in entries.iter().enumerate().skip(offset as usize) {
                    if reply.add(INodeNo(d.ino), (i + 1) as u64, file_type(d.kind), OsStr::from_bytes(name)) {
                        break;
                    }
                }
                reply.ok()
            }
            Err(e) => reply.error(errno("readdir", e)),
        }
    }

    fn readdirplus(&self, _req: &Request, ino: INodeNo, fh: FileHandle, offset: u64, mut reply: ReplyDirectoryPlus) {
        let _s = debug_span!("readdirplus", ino = ino.0, offset).entered();
        let _t = latency::timer(Area::Fuse, "readdirplus");
        match self.core.readdir(ino.0, fh.0, offset) {
            Ok(entries) => {
                for (i, (name, d)) in entries.iter().enumerate().skip(offset as usize) {
                    // Entries are read ahead a window at a time, as the
                    // reply reaches them: in one request each, instead of
                    // one per name (how many fit a reply is the kernel's).
                    if (i - offset as usize).is_multiple_of(READDIRPLUS_AHEAD) {
                        let ahead: Vec<(&[u8], u64)> = entries[i..]
                            .iter()
                            .take(READDIRPLUS_AHEAD)
                            .filter(|(name, _)| name != b"." && name != b"..")
                            .map(|(name, d)| (name.as_slice(), d.ino))
                            .collect();
                        self.core.prefetch_entries(ino.0, &ahead);
                    }
                    let Ok(inode) = self.core.getattr(d.ino) else { continue };
                    if reply.add(
                        INodeNo(d.ino),
                        (i + 1) as u64,
                        OsStr::from_bytes(name),
                        &self.attr_ttl(&inode),
                        &attr(&inode),
                        Generation(0),
                    ) {
                        break;
                    }
                }
                reply.ok()
            }
            Err(e) => reply.error(errno("readdirplus", e)),
        }
    }

    fn releasedir(&self, _req: &Request, _ino: INodeNo, fh: FileHandle, _flags: OpenFlags, reply: ReplyEmpty) {
        let _t = latency::timer(Area::Fuse, "releasedir");
        self.core.releasedir(fh.0);
        reply.ok();
    }

    fn fsyncdir(&self, _req: &Request, _ino: INodeNo, _fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        match self.core.fsyncdir() {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno("fsyncdir", e)),
        }
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let _t = latency::timer(Area::Fuse, "statfs");
        match self.core.statfs() {
            Ok(st) => reply.statfs(
                st.f_blocks,
                st.f_bfree,
                st.f_bavail,
                st.f_files,
                st.f_ffree,
                st.f_bsize as u32,
                converged_metadata::types::NAME_MAX as u32,
                st.f_frsize as u32,
            ),
            Err(e) => reply.error(errno("statfs", e)),
        }
    }

    fn setxattr(
        &self,
        req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        let _s = debug_span!("setxattr", ino = ino.0, name = ?name).entered();
        let _t = latency::timer(Area::Fuse, "setxattr");
        let mode = match flags {
            0 => XattrMode::Any,
            libc::XATTR_CREATE => XattrMode::Create,
            libc::XATTR_REPLACE => XattrMode::Replace,
            _ => return reply.error(Errno::EINVAL),
        };
        let caller = Caller { uid: req.uid(), gid: req.gid(), pid: req.pid() };
        match self.core.setxattr(ino.0, name.as_bytes(), value, mode, &caller) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno("setxattr", e)),
        }
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        let _s = debug_span!("getxattr", ino = ino.0, name = ?name).entered();
        let _t = latency::timer(Area::Fuse, "getxattr");
        match self.core.getxattr(ino.0, name.as_bytes()) {
            // A generated value may grow before the caller reads what it
            // sized (a counter gains a digit): its size query is answered
            // with room to spare, and the read returns what it is then.
            Ok(v) if size == 0 && Core::is_generated_xattr(name.as_bytes()) => {
                reply.size((v.len() + GENERATED_SLACK).min(XATTR_SIZE_MAX) as u32)
            }
            Ok(v) => reply_sized(reply, &v, size),
            Err(e) => reply.error(errno("getxattr", e)),
        }
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        let _s = debug_span!("listxattr", ino = ino.0).entered();
        let _t = latency::timer(Area::Fuse, "listxattr");
        match self.core.listxattr(ino.0) {
            Ok(v) => reply_sized(reply, &v, size),
            Err(e) => reply.error(errno("listxattr", e)),
        }
    }

    fn removexattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let _s = debug_span!("removexattr", ino = ino.0, name = ?name).entered();
        let _t = latency::timer(Area::Fuse, "removexattr");
        match self.core.removexattr(ino.0, name.as_bytes()) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno("removexattr", e)),
        }
    }

    fn access(&self, _req: &Request, _ino: INodeNo, _mask: AccessFlags, reply: ReplyEmpty) {
        // Permission checks are the kernel's (mounted with default_permissions).
        reply.ok();
    }

    fn ioctl(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _flags: fuser::IoctlFlags,
        _cmd: u32,
        _in_data: &[u8],
        _out_size: u32,
        reply: fuser::ReplyIoctl,
    ) {
        // No ioctls (isatty() probes land here): the answer a plain file gives.
        reply.error(Errno::ENOTTY);
    }

    fn fallocate(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let _s = debug_span!("fallocate", ino = ino.0, offset, length, mode).entered();
        let _t = latency::timer(Area::Fuse, "fallocate");
        let caller = Caller { uid: req.uid(), gid: req.gid(), pid: req.pid() };
        match self.core.fallocate(fh.0, offset, length, mode, &caller) {
            Ok(mode_changed) => {
                if mode_changed {
                    self.refresh_attrs(ino.0);
                }
                reply.ok()
            }
            Err(e) => reply.error(errno("fallocate", e)),
        }
    }

    fn copy_file_range(
        &self,
        _req: &Request,
        ino_in: INodeNo,
        fh_in: FileHandle,
        offset_in: u64,
        ino_out: INodeNo,
        fh_out: FileHandle,
        offset_out: u64,
        len: u64,
        _flags: fuser::CopyFileRangeFlags,
        reply: ReplyWrite,
    ) {
        let _s = debug_span!("copy_file_range", ino_in = ino_in.0, offset_in, ino_out = ino_out.0, offset_out, len)
            .entered();
        let _t = latency::timer(Area::Fuse, "copy_file_range");
        match self.core.copy_range(fh_in.0, offset_in, fh_out.0, offset_out, len) {
            Ok(n) => reply.written(n),
            Err(e) => reply.error(errno("copy_file_range", e)),
        }
    }

    fn lseek(&self, _req: &Request, ino: INodeNo, fh: FileHandle, offset: i64, whence: i32, reply: ReplyLseek) {
        let _s = debug_span!("lseek", ino = ino.0, offset, whence).entered();
        let _t = latency::timer(Area::Fuse, "lseek");
        match self.core.lseek(fh.0, offset, whence) {
            Ok(o) => reply.offset(o),
            Err(e) => reply.error(errno("lseek", e)),
        }
    }
}

/// getxattr/listxattr: size 0 asks for the length; too small a buffer is ERANGE.
/// Room a size query of a generated attribute leaves for growth, and the
/// largest value the kernel takes.
const GENERATED_SLACK: usize = 4096;
const XATTR_SIZE_MAX: usize = 65536;

fn reply_sized(reply: ReplyXattr, value: &[u8], size: u32) {
    if size == 0 {
        reply.size(value.len() as u32);
    } else if value.len() > size as usize {
        reply.error(Errno::ERANGE);
    } else {
        reply.data(value);
    }
}

/// How the kernel mount is made.
pub struct MountSpec<'a> {
    pub mountpoint: &'a Path,
    /// The source mount(8) and df show.
    pub source: String,
    /// Seconds the kernel caches names and attributes.
    pub attr_timeout: Duration,
    /// Ask the kernel for passthrough (off with --verify-reads).
    pub want_passthrough: bool,
    pub threads: usize,
    /// `ro`: the kernel refuses every change with EROFS.
    pub read_only: bool,
    /// Honour setuid/setgid bits and device files (`suid`, `dev`); off by default.
    pub suid: bool,
    pub dev: bool,
    pub noexec: bool,
    /// Shown as `noatime` in the mount table (the daemon keeps atime itself).
    pub noatime: bool,
}

/// Mount `core` and serve FUSE requests until the filesystem is unmounted
/// (umount(8), or SIGTERM / SIGINT / SIGHUP to the daemon). `on_mounted`
/// runs once the kernel mount exists, with the change feed that drops what
/// this kernel caches of other nodes' changes.
pub fn serve(
    core: Arc<Core>,
    spec: MountSpec<'_>,
    on_mounted: impl FnOnce(converged_metadata::ChangeFeed) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    use anyhow::Context;
    let adapter = FuseAdapter::new(core, spec.attr_timeout, spec.want_passthrough);
    let notifier = adapter.notifier.clone();
    let mut config = fuser::Config::default();
    config.mount_options = vec![
        fuser::MountOption::FSName(spec.source),
        // Passed to the kernel so mounts show as type fuse.converged.
        fuser::MountOption::CUSTOM("subtype=converged".into()),
        fuser::MountOption::DefaultPermissions,
        if spec.read_only { fuser::MountOption::RO } else { fuser::MountOption::RW },
        if spec.dev { fuser::MountOption::Dev } else { fuser::MountOption::NoDev },
        if spec.suid { fuser::MountOption::Suid } else { fuser::MountOption::NoSuid },
        if spec.noexec { fuser::MountOption::NoExec } else { fuser::MountOption::Exec },
        if spec.noatime { fuser::MountOption::NoAtime } else { fuser::MountOption::Atime },
    ];
    config.acl = fuser::SessionACL::All;
    config.n_threads = Some(spec.threads);
    config.clone_fd = true;
    let mut session = fuser::Session::new(adapter, spec.mountpoint, &config)
        .with_context(|| format!("mount {}", spec.mountpoint.display()))?;
    let _ = notifier.set(session.notifier());
    let mut unmounter = session.unmount_callable();
    let mut signals = signal_hook::iterator::Signals::new([libc::SIGTERM, libc::SIGINT, libc::SIGHUP])?;
    let mp = spec.mountpoint.to_path_buf();
    std::thread::Builder::new().name("signals".into()).spawn(move || {
        if let Some(sig) = signals.forever().next() {
            tracing::info!(signal = sig, mountpoint = %mp.display(), "unmounting on signal");
            if let Err(e) = unmounter.unmount() {
                tracing::error!(error = %e, "unmount on signal failed");
            }
        }
    })?;
    on_mounted(kernel_invalidator(&session)?)?;
    session.run().context("FUSE session")?;
    Ok(())
}
