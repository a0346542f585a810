//! The FUSE adapter: the only module that knows fuser. Each callback opens a
//! span, makes one call into [`Core`], and replies or reports the error once.

use crate::latency::{self, Area};
use std::collections::HashMap;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use converged_metadata::held_locks::Mutex;
use converged_metadata::types::{
    FileKind, Ino, Inode, NewNode, RenameMode, RequestMark, SetAttr, TimeSet, Timespec, XattrMode,
};
use converged_metadata::MetaError;
use fuser::{
    AccessFlags, BackingId, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo,
    InitFlags, KernelConfig, LockOwner, OpenAccMode, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData,
    ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyLseek, ReplyOpen, ReplyStatfs, ReplyWrite,
    ReplyXattr, Request, TimeOrNow, WriteFlags,
};
use tracing::debug_span;

use crate::core::{Caller, Core, KernelOpen, Opened};
use crate::error::{FsError, FsResult};
use crate::kernel_handles::{HandleJournal, Recorded, Settled, RESENT};

pub struct FuseAdapter {
    core: Arc<Core>,
    ttl: Duration,
    want_passthrough: bool,
    backing: Arc<Mutex<BackingIds>>,
    /// The handles the kernel holds, kept for a daemon that takes this
    /// connection over (see `kernel_handles.rs`).
    journal: Arc<HandleJournal>,
    /// Requests being answered, held back while the daemon hands the
    /// connection over.
    gate: Arc<EntryGate>,
    /// Notifications to the kernel from request handlers (set once the
    /// session exists).
    notifier: Arc<std::sync::OnceLock<fuser::Notifier>>,
    /// Fault switch (tests): the namespace operation after whose commit
    /// this daemon dies, before it answers.
    die_after_commit: Option<String>,
    /// Ask the kernel for FUSE over io_uring at INIT (`--fuse-uring`).
    want_uring: Uring,
}

/// The door requests come in by (see [`FuseAdapter::enter`]).
#[derive(Default)]
struct EntryGate {
    in_flight: AtomicUsize,
    draining: AtomicBool,
}

impl EntryGate {
    /// Let no request in, and wait (up to `limit`) until those inside are answered.
    fn drain(&self, limit: Duration) -> bool {
        self.draining.store(true, Ordering::SeqCst);
        let deadline = std::time::Instant::now() + limit;
        while self.in_flight.load(Ordering::SeqCst) > 0 {
            if std::time::Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }
}

/// A request inside the gate.
struct Entered<'a> {
    _timer: latency::Timer,
    gate: &'a EntryGate,
}

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        self.gate.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
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
    pub fn new(core: Arc<Core>, ttl: Duration, want_passthrough: bool, journal: Arc<HandleJournal>) -> Self {
        Self {
            core,
            ttl,
            want_passthrough,
            backing: Arc::default(),
            journal,
            gate: Arc::default(),
            notifier: Arc::default(),
            die_after_commit: None,
            want_uring: Uring::Off,
        }
    }

    /// Make the namespace change `req` asks for once, though the kernel
    /// may ask twice. `change` makes it, recording the request with it
    /// (see `RequestMark`); `done` answers it from the inode the change
    /// made or named when it was made already. That is known two ways. A
    /// request the kernel sends again, because the daemon it was sent to
    /// died before answering, looks for its record before it is made
    /// again, and `change`'s transaction reads the record too (the dead
    /// daemon's commit may land while this one looks). And a transaction
    /// made again after a commit whose answer was lost (a reset connection
    /// to etcd) reads it before the change (`Namespace::write_answering`):
    /// the first ends in `MetaError::AlreadyMade`, the second in what the
    /// attempt that landed returned. A resent request whose change failed
    /// (perhaps before its transaction), or a first one whose change
    /// failed with an error a retry could have helped, reads the record
    /// once more.
    fn once<T>(
        &self,
        req: &Request,
        op: &'static str,
        change: impl FnOnce(RequestMark) -> FsResult<T>,
        done: impl Fn(Ino) -> FsResult<T>,
    ) -> FsResult<T> {
        let unique = req.unique().0;
        let resent = unique & RESENT != 0;
        let mark = RequestMark { connection: self.journal.connection(), unique: unique & !RESENT, resent };
        if resent {
            if let Some(ino) = self.core.answered(mark)? {
                tracing::info!(
                    op,
                    unique = mark.unique,
                    "a resent request's change had committed: answered from its record"
                );
                return done(ino);
            }
        }
        let made = change(mark);
        if made.is_ok() && self.die_after_commit.as_deref() == Some(op) {
            tracing::error!(op, "fault switch: the daemon dies after the commit, before the answer");
            // SAFETY: kill(2) of this process.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        }
        match made {
            Err(FsError::Meta(MetaError::AlreadyMade { ino })) => {
                tracing::info!(op, unique = mark.unique, "the change had committed already: answered from its record");
                done(ino)
            }
            // A resent request: what the change read before its
            // transaction (a name to unlink, say) may already show the dead
            // daemon's commit. A first one: its last attempt may have
            // landed without an answer (no attempt left to find it).
            Err(e) if resent || matches!(&e, FsError::Meta(MetaError::Kv(k)) if k.is_retryable()) => {
                match self.core.answered(mark) {
                    Ok(Some(ino)) => done(ino),
                    _ => Err(e),
                }
            }
            made => made,
        }
    }

    /// Enter a request: timed, and counted while it is answered. Once the
    /// daemon hands its connection over, a request that enters is left
    /// unanswered (its thread parks until the process exits) for the next
    /// daemon, to which the kernel sends it again.
    fn enter(&self, op: &'static str) -> Entered<'_> {
        self.gate.in_flight.fetch_add(1, Ordering::SeqCst);
        if self.gate.draining.load(Ordering::SeqCst) {
            self.gate.in_flight.fetch_sub(1, Ordering::SeqCst);
            loop {
                std::thread::park();
            }
        }
        Entered { _timer: latency::timer(Area::Fuse, op), gate: &self.gate }
    }

    /// Record a handle about to be given to the kernel, with the backing id
    /// it is opened with. A handle that cannot be recorded is not given:
    /// a daemon taking the connection over could not serve it.
    fn record(
        &self,
        req: &Request,
        ino: Ino,
        opened: &Opened,
        writable: bool,
        id: Option<&BackingId>,
    ) -> Result<(), Errno> {
        let r = Recorded {
            handle: KernelOpen { fh: opened.fh, ino, writable, io: opened.io },
            backing_id: id.map_or(0, |id| id.raw()),
            unique: req.unique().0,
        };
        self.journal.record(&r).map_err(|e| {
            tracing::warn!(ino, error = %e, "could not record a handle in the journal");
            let _ = self.forget_handle(ino, opened.fh);
            Errno::EIO
        })
    }

    /// A handle the kernel will not use again: its backing id share, its
    /// journal slot, and the core's handle.
    fn forget_handle(&self, ino: Ino, fh: u64) -> FsResult<()> {
        {
            let mut ids = self.backing.lock();
            if ids.by_fh.remove(&fh).is_some() && ids.by_ino.get(&ino).is_some_and(|w| w.strong_count() == 0) {
                ids.by_ino.remove(&ino);
            }
        }
        self.journal.forget(fh);
        self.core.release(fh)
    }

    /// The handle an earlier daemon of this mount made for an open the
    /// kernel sends again (it died before answering): the core serves it
    /// already, so the answer is that handle.
    fn resent_open(&self, req: &Request) -> Option<(Recorded, Option<Arc<BackingId>>)> {
        let r = self.journal.resent_open(req.unique().0)?;
        let id = self.backing.lock().by_fh.get(&r.handle.fh).cloned();
        Some((r, id))
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
/// layout, the entry of a changed name. When the feed says changes were
/// missed for good (its watch started from the present: etcd compacted its
/// history past where the last watch stopped), every name the kernel
/// cached is looked up again before it is used (`FUSE_NOTIFY_INC_EPOCH`),
/// as the node's own cache is dropped: else a name another node removed
/// meanwhile would still be answered until `--attr-timeout` ran out.
/// Notifications go out from a thread of their own, never from a request
/// handler (the kernel may wait on a request in flight before it applies one).
pub fn kernel_invalidator(session: &fuser::Session<FuseAdapter>) -> std::io::Result<converged_metadata::ChangeFeed> {
    use converged_metadata::schema::{change_of, Change};
    let notifier = session.notifier();
    let (tx, rx) = std::sync::mpsc::channel::<Vec<u8>>();
    std::thread::Builder::new().name("invalidate".into()).spawn(move || {
        let mut epochs = true;
        for key in rx {
            // ENOENT: the kernel holds nothing for it. Anything else is worth a line.
            let r = match change_of(&key) {
                Change::Inode(ino) => notifier.inval_inode(INodeNo(ino), 0, 0),
                Change::Entry { parent, name } => notifier.inval_entry(INodeNo(parent), OsStr::from_bytes(name)),
                Change::Everything if epochs => match notifier.inc_epoch() {
                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                        epochs = false;
                        tracing::info!(
                            "this kernel cannot be told to look up every cached name again (Linux 6.16 can): \
                             after the change feed starts over, names it cached stay until --attr-timeout"
                        );
                        Ok(())
                    }
                    r => r,
                },
                _ => Ok(()),
            };
            if let Err(e) = r {
                if e.raw_os_error() != Some(libc::ENOENT) {
                    tracing::debug!(error = %e, "kernel cache invalidation failed");
                }
            }
        }
    })?;
    Ok(std::sync::Arc::new(move |key: &[u8], value: Option<&[u8]>| {
        match change_of(key) {
            Change::Inode(_) | Change::Entry { .. } => {
                let _ = tx.send(key.to_vec());
            }
            // A feed that resumes where it stopped delivers what it missed,
            // and the kernel's entries are dropped as those arrive; only
            // changes missed for good cost every cached name a lookup.
            Change::Everything if value.is_some() => {
                let _ = tx.send(key.to_vec());
            }
            _ => {}
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
        request: None,
    }
}

/// Answer an open with handle `fh`: passed through to backing id `id`, or
/// served by the daemon in kernel I/O mode `io`.
fn reply_open(reply: ReplyOpen, fh: u64, io: crate::core::Io, id: Option<&BackingId>) {
    match id {
        Some(id) => reply.opened_passthrough(FileHandle(fh), FopenFlags::empty(), id),
        None => reply.opened(FileHandle(fh), fopen_flags(io)),
    }
}

/// Answer a create with the new file's attributes `a` and handle `fh`, as
/// [`reply_open`] answers an open.
fn reply_create(
    reply: ReplyCreate,
    ttl: &Duration,
    a: &FileAttr,
    fh: u64,
    io: crate::core::Io,
    id: Option<&BackingId>,
) {
    match id {
        Some(id) => reply.created_passthrough(ttl, a, Generation(0), FileHandle(fh), FopenFlags::empty(), id),
        None => reply.created(ttl, a, Generation(0), FileHandle(fh), fopen_flags(io)),
    }
}

/// The open flags of a handle served by the daemon in kernel I/O mode `io`.
fn fopen_flags(io: crate::core::Io) -> FopenFlags {
    match io {
        crate::core::Io::Direct => FopenFlags::FOPEN_DIRECT_IO,
        _ => FopenFlags::empty(),
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

    fn new_node(
        &self,
        req: &Request,
        op: &'static str,
        parent: INodeNo,
        name: &OsStr,
        node: NewNode<'_>,
        reply: ReplyEntry,
    ) {
        let made = self.once(
            req,
            op,
            |r| self.core.mknod(parent.0, name.as_bytes(), &NewNode { request: Some(r), ..node.clone() }),
            |ino| self.core.getattr(ino),
        );
        match made {
            Ok(i) => reply.entry(&self.attr_ttl(&i), &attr(&i), Generation(0)),
            Err(e) => reply.error(errno(op, e)),
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
    fn reply_created(
        &self,
        req: &Request,
        inode: &converged_metadata::types::Inode,
        opened: &Opened,
        writable: bool,
        reply: ReplyCreate,
    ) {
        let a = attr(inode);
        let ttl = if inode.size == 0 { self.ttl } else { self.attr_ttl(inode) };
        let id = self.backing_id(inode.ino, opened, |f| reply.open_backing(f));
        if let Err(e) = self.record(req, inode.ino, opened, writable, id.as_deref()) {
            return reply.error(e);
        }
        reply_create(reply, &ttl, &a, opened.fh, opened.io, id.as_deref());
    }

    /// A create the kernel sends again: answered with the handle the
    /// earlier daemon made, or made again when it died before recording one.
    fn resent_create(&self, req: &Request, reply: ReplyCreate) -> Option<ReplyCreate> {
        let Some((r, id)) = self.resent_open(req) else { return Some(reply) };
        match self.core.getattr(r.handle.ino) {
            Ok(i) => reply_create(reply, &self.ttl, &attr(&i), r.handle.fh, r.handle.io, id.as_deref()),
            Err(e) => reply.error(errno("create", e)),
        }
        None
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
        let io_uring = self.want_uring != Uring::Off && config.add_capabilities(InitFlags::FUSE_OVER_IO_URING).is_ok();
        const NOT_OFFERED: &str = "FUSE over io_uring is not available (it needs Linux 6.14, \
             /sys/module/fuse/parameters/enable_uring set to Y and io_uring allowed to this process); \
             requests go through /dev/fuse";
        match self.want_uring {
            Uring::Asked if !io_uring => tracing::warn!("{NOT_OFFERED}"),
            Uring::Default if !io_uring => tracing::info!("{NOT_OFFERED}"),
            _ => {}
        }
        self.core.set_passthrough(passthrough);
        self.journal.write_header(Settled { passthrough, io_uring })?;
        tracing::info!(passthrough = self.core.passthrough(), "FUSE session initialised");
        Ok(())
    }

    fn destroy(&mut self) {
        self.core.shutdown_unmounted();
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let _s = debug_span!("lookup", parent = parent.0, name = ?name).entered();
        let _t = self.enter("lookup");
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
        let _t = self.enter("getattr");
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
        let _t = self.enter("setattr");
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
        let _t = self.enter("readlink");
        match self.core.readlink(ino.0) {
            Ok(t) => reply.data(&t),
            Err(e) => reply.error(errno("readlink", e)),
        }
    }

    fn mknod(&self, req: &Request, parent: INodeNo, name: &OsStr, mode: u32, umask: u32, rdev: u32, reply: ReplyEntry) {
        let _s = debug_span!("mknod", parent = parent.0, name = ?name, mode).entered();
        let _t = self.enter("mknod");
        let Some(kind) = FileKind::from_mode(mode) else {
            return reply.error(Errno::EINVAL);
        };
        let node = NewNode { rdev, ..node_for(req, kind, mode, umask) };
        self.new_node(req, "mknod", parent, name, node, reply);
    }

    fn mkdir(&self, req: &Request, parent: INodeNo, name: &OsStr, mode: u32, umask: u32, reply: ReplyEntry) {
        let _s = debug_span!("mkdir", parent = parent.0, name = ?name, mode).entered();
        let _t = self.enter("mkdir");
        let node = node_for(req, FileKind::Directory, mode, umask);
        self.new_node(req, "mkdir", parent, name, node, reply);
    }

    fn symlink(&self, req: &Request, parent: INodeNo, link_name: &OsStr, target: &Path, reply: ReplyEntry) {
        let _s = debug_span!("symlink", parent = parent.0, name = ?link_name).entered();
        let _t = self.enter("symlink");
        let node =
            NewNode { target: Some(target.as_os_str().as_bytes()), ..node_for(req, FileKind::Symlink, 0o777, 0) };
        self.new_node(req, "symlink", parent, link_name, node, reply);
    }

    fn unlink(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let _s = debug_span!("unlink", parent = parent.0, name = ?name).entered();
        let _t = self.enter("unlink");
        let name = name.as_bytes();
        match self.once(req, "unlink", |r| self.core.unlink_answering(parent.0, name, Some(r)), |_| Ok(())) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno("unlink", e)),
        }
    }

    fn rmdir(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let _s = debug_span!("rmdir", parent = parent.0, name = ?name).entered();
        let _t = self.enter("rmdir");
        let name = name.as_bytes();
        match self.once(req, "rmdir", |r| self.core.rmdir_answering(parent.0, name, Some(r)), |_| Ok(())) {
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
        let _t = self.enter("rename");
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
        let (name, newname) = (name.as_bytes(), newname.as_bytes());
        let renamed = self.once(
            req,
            "rename",
            |r| self.core.rename_leaving(parent.0, name, newparent.0, newname, mode, owner, Some(r)),
            |_| Ok(()),
        );
        match renamed {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno("rename", e)),
        }
    }

    fn link(&self, req: &Request, ino: INodeNo, newparent: INodeNo, newname: &OsStr, reply: ReplyEntry) {
        let _s = debug_span!("link", ino = ino.0, newparent = newparent.0, newname = ?newname).entered();
        let _t = self.enter("link");
        let newname = newname.as_bytes();
        let linked = self.once(
            req,
            "link",
            |r| self.core.link_answering(ino.0, newparent.0, newname, Some(r)),
            |ino| self.core.getattr(ino),
        );
        match linked {
            Ok(i) => reply.entry(&self.attr_ttl(&i), &attr(&i), Generation(0)),
            Err(e) => reply.error(errno("link", e)),
        }
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let _s = debug_span!("open", ino = ino.0, flags = flags.0).entered();
        let _t = self.enter("open");
        if let Some((r, id)) = self.resent_open(req) {
            return reply_open(reply, r.handle.fh, r.handle.io, id.as_deref());
        }
        let writable = is_writable(flags);
        match self.core.open(ino.0, writable) {
            Ok(opened) => {
                if opened.refresh_attrs {
                    self.refresh_attrs(ino.0);
                }
                let id = self.backing_id(ino.0, &opened, |f| reply.open_backing(f));
                if let Err(e) = self.record(req, ino.0, &opened, writable, id.as_deref()) {
                    return reply.error(e);
                }
                reply_open(reply, opened.fh, opened.io, id.as_deref());
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
        let _t = self.enter("create");
        let Some(reply) = self.resent_create(req, reply) else { return };
        let writable = is_writable(OpenFlags(flags));
        let node = NewNode { unsealed: writable, ..node_for(req, FileKind::Regular, mode, umask) };
        let created = self.once(
            req,
            "create",
            |r| self.core.create(parent.0, name.as_bytes(), &NewNode { request: Some(r), ..node.clone() }),
            // Made, and not opened (or its open not recorded): opened now.
            |ino| Ok((self.core.getattr(ino)?, self.core.open(ino, writable)?)),
        );
        match created {
            Ok((inode, opened)) => self.reply_created(req, &inode, &opened, writable, reply),
            Err(e) => reply.error(errno("create", e)),
        }
    }

    fn tmpfile(&self, req: &Request, parent: INodeNo, mode: u32, umask: u32, flags: i32, reply: ReplyCreate) {
        let _s = debug_span!("tmpfile", parent = parent.0, mode, flags).entered();
        let _t = self.enter("tmpfile");
        let Some(reply) = self.resent_create(req, reply) else { return };
        let writable = is_writable(OpenFlags(flags));
        let node = NewNode { unsealed: writable, ..node_for(req, FileKind::Regular, mode, umask) };
        match self.core.tmpfile(parent.0, &node) {
            Ok((inode, opened)) => self.reply_created(req, &inode, &opened, writable, reply),
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
        let _t = self.enter("read");
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
        let _t = self.enter("write");
        match self.core.write(fh.0, offset, data) {
            Ok(n) => reply.written(n),
            Err(e) => reply.error(errno("write", e)),
        }
    }

    fn flush(&self, _req: &Request, ino: INodeNo, fh: FileHandle, _lock_owner: LockOwner, reply: ReplyEmpty) {
        let _s = debug_span!("flush", ino = ino.0, fh = fh.0).entered();
        let _t = self.enter("flush");
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
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let _s = debug_span!("release", ino = ino.0, fh = fh.0).entered();
        let _t = self.enter("release");
        match self.forget_handle(ino.0, fh.0) {
            Ok(()) => reply.ok(),
            // A release the kernel sends again after the daemon that did it died.
            Err(FsError::BadHandle(_)) if req.unique().0 & RESENT != 0 => reply.ok(),
            Err(e) => reply.error(errno("release", e)),
        }
    }

    fn fsync(&self, _req: &Request, ino: INodeNo, fh: FileHandle, datasync: bool, reply: ReplyEmpty) {
        let _s = debug_span!("fsync", ino = ino.0, datasync).entered();
        let _t = self.enter("fsync");
        match self.core.fsync(fh.0, datasync) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno("fsync", e)),
        }
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let _t = self.enter("opendir");
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
        let _t = self.enter("readdir");
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
        let _t = self.enter("readdirplus");
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
        let _t = self.enter("releasedir");
        self.core.releasedir(fh.0);
        reply.ok();
    }

    fn fsyncdir(&self, _req: &Request, _ino: INodeNo, _fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        let _t = self.enter("fsyncdir");
        match self.core.fsyncdir() {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno("fsyncdir", e)),
        }
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let _t = self.enter("statfs");
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
        let _t = self.enter("setxattr");
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
        let _t = self.enter("getxattr");
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
        let _t = self.enter("listxattr");
        match self.core.listxattr(ino.0) {
            Ok(v) => reply_sized(reply, &v, size),
            Err(e) => reply.error(errno("listxattr", e)),
        }
    }

    fn removexattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let _s = debug_span!("removexattr", ino = ino.0, name = ?name).entered();
        let _t = self.enter("removexattr");
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
        let _t = self.enter("fallocate");
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
        let _t = self.enter("copy_file_range");
        match self.core.copy_range(fh_in.0, offset_in, fh_out.0, offset_out, len) {
            Ok(n) => reply.written(n),
            Err(e) => reply.error(errno("copy_file_range", e)),
        }
    }

    fn lseek(&self, _req: &Request, ino: INodeNo, fh: FileHandle, offset: i64, whence: i32, reply: ReplyLseek) {
        let _s = debug_span!("lseek", ino = ino.0, offset, whence).entered();
        let _t = self.enter("lseek");
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
    /// Serve requests through FUSE over io_uring where the kernel offers it.
    pub fuse_uring: Uring,
    /// The supervisor's memory for the ring entries' buffers (a memfd kept
    /// across daemons), and whether the connection taken over settled
    /// FUSE over io_uring at its INIT (then the rings start again from it).
    pub ring_memory: Option<i32>,
    pub resumed_uring: bool,
    pub threads: usize,
    /// `ro`: the kernel refuses every change with EROFS.
    pub read_only: bool,
    /// Honour setuid/setgid bits and device files (`suid`, `dev`); off by default.
    pub suid: bool,
    pub dev: bool,
    pub noexec: bool,
    /// Shown as `noatime` in the mount table (the daemon keeps atime itself).
    pub noatime: bool,
    /// Fault switch (tests): die after committing this namespace operation
    /// (`mkdir`, `rename`, ...), before answering it.
    pub die_after_commit: Option<String>,
}

/// Whether a mount asks the kernel for FUSE over io_uring at INIT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Uring {
    /// `--no-fuse-uring`: /dev/fuse only.
    Off,
    /// The default: the rings where the kernel offers them, quietly not where it does not.
    Default,
    /// `--fuse-uring`: as the default, with a warning where the kernel does not offer them.
    Asked,
}

/// The /dev/fuse connection a daemon serves.
pub enum Connection {
    /// Mount, and serve the new connection alone: it ends with this process.
    Mount,
    /// Mount on the supervisor's descriptor (it opened /dev/fuse and keeps
    /// it across daemons), and answer the kernel's INIT.
    Fresh(std::os::fd::OwnedFd),
    /// Take over the supervisor's descriptor of a live connection an
    /// earlier daemon served: no mount and no INIT; the handles the kernel
    /// holds come from the journal, and the requests the dead daemon read
    /// and did not answer are asked for again.
    Resume(std::os::fd::OwnedFd),
}

/// Mount `core` and serve FUSE requests until the filesystem is unmounted
/// (umount(8), or SIGTERM / SIGINT / SIGHUP to the daemon). `on_mounted`
/// runs once the kernel mount exists, with the change feed that drops what
/// this kernel caches of other nodes' changes.
pub fn serve(
    core: Arc<Core>,
    spec: MountSpec<'_>,
    conn: Connection,
    journal: Arc<HandleJournal>,
    adopted: &[Recorded],
    on_mounted: impl FnOnce(converged_metadata::ChangeFeed) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    use anyhow::Context;
    let mut adapter = FuseAdapter::new(core.clone(), spec.attr_timeout, spec.want_passthrough, journal);
    adapter.die_after_commit = spec.die_after_commit.clone();
    adapter.want_uring = spec.fuse_uring;
    let notifier = adapter.notifier.clone();
    let gate = adapter.gate.clone();
    let backing = adapter.backing.clone();
    let mut config = fuser::Config::default();
    config.mount_options = vec![
        fuser::MountOption::FSName(spec.source.clone()),
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
    let resumed = matches!(conn, Connection::Resume(_));
    // A connection taken over keeps what its INIT settled, whatever this
    // daemon was asked for.
    config.io_uring = if resumed { spec.resumed_uring } else { spec.fuse_uring != Uring::Off };
    config.io_uring_memory = spec.ring_memory;
    config.io_uring_refused = std::env::var_os(crate::daemon::FAULT_RING_REFUSED).is_some();
    // A mount fuser made is undone by fuser; one on the supervisor's descriptor here.
    let fuser_mounted = matches!(conn, Connection::Mount);
    let mut session = match conn {
        Connection::Mount => {
            config.clone_fd = true;
            fuser::Session::new(adapter, spec.mountpoint, &config)
                .with_context(|| format!("mount {}", spec.mountpoint.display()))?
        }
        // One descriptor for every thread: a clone would be a device of its
        // own, whose requests in flight the kernel fails when the daemon
        // dies, where those of the supervisor's descriptor wait for the next.
        Connection::Fresh(fd) => {
            mount_on(&fd, &spec).with_context(|| format!("mount {}", spec.mountpoint.display()))?;
            fuser::Session::from_fd(adapter, fd, config.acl, config.clone())
                .with_context(|| format!("FUSE handshake on {}", spec.mountpoint.display()))?
        }
        Connection::Resume(fd) => fuser::Session::resume_fd(adapter, fd, config.acl, config.clone())?,
    };
    if resumed {
        let mut ids = backing.lock();
        for r in adopted.iter().filter(|r| r.backing_id != 0) {
            let id = match ids.by_ino.get(&r.handle.ino).and_then(Weak::upgrade) {
                Some(id) => id,
                None => {
                    // SAFETY: the id was registered on this connection by the
                    // daemon that recorded it, which is gone; nothing else owns it.
                    let id = Arc::new(unsafe { session.adopt_backing_id(r.backing_id) });
                    ids.by_ino.insert(r.handle.ino, Arc::downgrade(&id));
                    id
                }
            };
            ids.by_fh.insert(r.handle.fh, id);
        }
    }
    let _ = notifier.set(session.notifier());
    let mut unmounter = session.unmount_callable();
    let mut signals = signal_hook::iterator::Signals::new([libc::SIGTERM, libc::SIGINT, libc::SIGHUP, libc::SIGUSR2])?;
    let mp = spec.mountpoint.to_path_buf();
    std::thread::Builder::new().name("signals".into()).spawn(move || {
        if let Some(sig) = signals.forever().next() {
            if sig == libc::SIGUSR2 && !fuser_mounted {
                hand_over(&gate, &core);
            }
            tracing::info!(signal = sig, mountpoint = %mp.display(), "unmounting on signal");
            let r = match fuser_mounted {
                true => unmounter.unmount(),
                false => crate::blocks::unmount(&mp, true),
            };
            if let Err(e) = r {
                tracing::error!(error = %e, "unmount on signal failed");
            }
        }
    })?;
    on_mounted(kernel_invalidator(&session)?)?;
    if resumed {
        // Requests the dead daemon read and did not answer: sent again, with
        // their unique ids marked (see FuseAdapter::resent_open).
        session.notifier().resend().context("ask the kernel to resend the requests in flight")?;
        tracing::info!(handles = adopted.len(), "took over the live FUSE connection");
        if config.io_uring {
            kick_ring_queues(spec.mountpoint);
        }
    }
    match session.run() {
        // The kernel ended the connection while requests were under way
        // (an unmount right after many closes, or an abort through
        // /sys/fs/fuse/connections): reads then fail with ECONNABORTED,
        // not ENODEV. The mount is over and `destroy` has run; ending with
        // an error would have the supervisor start a daemon on a dead
        // connection, which recovers the data dir while the unmount's
        // caller takes it back.
        Err(e) if e.raw_os_error() == Some(libc::ECONNABORTED) => {
            tracing::info!("the kernel ended the connection with requests under way");
            Ok(())
        }
        r => r.context("FUSE session"),
    }
}

/// After a takeover under FUSE over io_uring: requests made while no
/// daemon had an entry free wait on their CPU's queue, and the kernel hands
/// a queued request to an entry only when a commit on that queue fetches
/// the next (a registration does not). So, once the new daemon's entries
/// are registered, one `statfs` of the mount from each CPU, 20 ms, 200 ms
/// and 2 s after the session starts (the rings register as they start):
/// its answer's commit fetches what waited there, and each commit after it
/// the next.
/// Each `statfs` is made by a child process, not a thread of the daemon: a
/// request of the daemon's own that its death left unanswered would keep
/// the dying daemon from ending (a caller whose request was sent waits
/// for its answer even when killed), and the supervisor starts the next
/// daemon only once it has.
fn kick_ring_queues(mountpoint: &Path) {
    let Ok(path) = std::ffi::CString::new(mountpoint.as_os_str().as_bytes()) else { return };
    // One request on each queue: a queue a possible CPU.
    let queues =
        fuser::io_uring_queues().unwrap_or_else(|_| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let spawned = std::thread::Builder::new().name("ring-kick".into()).spawn(move || {
        // A statfs made before this daemon's entries were registered waits
        // on its queue itself, until the next round's answer fetches it.
        let mut children = Vec::new();
        for delay in [Duration::from_millis(20), Duration::from_millis(200), Duration::from_secs(2)] {
            std::thread::sleep(delay);
            for cpu in 0..queues.min(8 * std::mem::size_of::<libc::cpu_set_t>()) {
                // SAFETY: the child makes system calls only (no allocation,
                // no lock) and ends with _exit: what is safe after fork in a
                // threaded process. The set is a zeroed cpu_set_t with one CPU
                // below CPU_SETSIZE; statfs writes into a local.
                let pid = unsafe { libc::fork() };
                match pid {
                    0 => unsafe {
                        // Nothing of the daemon's: a child still waiting
                        // must not keep the connection or the rings open.
                        libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32);
                        let mut set: libc::cpu_set_t = std::mem::zeroed();
                        libc::CPU_SET(cpu, &mut set);
                        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0 {
                            let mut st: libc::statfs = std::mem::zeroed();
                            libc::statfs(path.as_ptr(), &mut st);
                        }
                        libc::_exit(0);
                    },
                    -1 => tracing::warn!(error = %std::io::Error::last_os_error(), "fork for the ring queues' kick"),
                    pid => children.push(pid),
                }
            }
        }
        for pid in children {
            // SAFETY: waitpid(2) on a child of ours.
            unsafe { libc::waitpid(pid, std::ptr::null_mut(), 0) };
        }
    });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "could not start the ring queues' kick; requests made during the takeover wait for the next on their CPU");
    }
}

/// A planned upgrade (`converged upgrade`, through the supervisor): let no
/// request in, wait for those being answered, sync, and end with the
/// mount in place for the next daemon, which the kernel sends the requests
/// left unanswered.
fn hand_over(gate: &EntryGate, core: &Core) -> ! {
    tracing::info!("handing the connection over to the next daemon");
    if !gate.drain(Duration::from_secs(30)) {
        tracing::warn!("requests still under way after 30 s; the next daemon answers them again");
    }
    core.shutdown();
    tracing::info!("connection handed over");
    std::process::exit(crate::supervise::EXIT_HANDOVER)
}

/// Mount the filesystem at the spec's mount point on the /dev/fuse
/// descriptor `fd` (mount(2) as root, with the options fuser gives it).
fn mount_on(fd: &std::os::fd::OwnedFd, spec: &MountSpec<'_>) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::PermissionsExt;
    let root_mode = std::fs::metadata(spec.mountpoint)?.permissions().mode();
    // SAFETY: getuid/getgid cannot fail.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    let mut data = format!(
        "fd={},rootmode={:o},user_id={uid},group_id={gid},default_permissions,allow_other",
        fd.as_raw_fd(),
        root_mode
    );
    let mut flags: libc::c_ulong = 0;
    for (on, flag) in [
        (spec.read_only, libc::MS_RDONLY),
        (!spec.dev, libc::MS_NODEV),
        (!spec.suid, libc::MS_NOSUID),
        (spec.noexec, libc::MS_NOEXEC),
        (spec.noatime, libc::MS_NOATIME),
    ] {
        if on {
            flags |= flag;
        }
    }
    if spec.read_only {
        data.push_str(",ro");
    }
    let source = std::ffi::CString::new(spec.source.as_bytes())?;
    let target = std::ffi::CString::new(spec.mountpoint.as_os_str().as_bytes())?;
    let fstype = c"fuse.converged";
    let data = std::ffi::CString::new(data)?;
    // SAFETY: mount(2) with valid strings.
    let r = unsafe { libc::mount(source.as_ptr(), target.as_ptr(), fstype.as_ptr(), flags, data.as_ptr().cast()) };
    match r {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}
