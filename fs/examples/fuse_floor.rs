//! The FUSE floor: a filesystem that keeps its names and attributes in
//! memory and does nothing else, mounted the way `converged mount` mounts
//! (same options, init flags, threads and timeouts, without passthrough).
//! What the metadata benchmark (`bench/metadata.sh`) measures on it is what
//! the kernel's FUSE transport and fuser cost on this host: no daemon can
//! create, stat or unlink faster through them. Not a filesystem to keep
//! data in: files are empty, and everything is gone at unmount.
//!
//!   fuse_floor MOUNTPOINT [THREADS]    serves until unmounted (umount MOUNTPOINT)

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, InitFlags, KernelConfig,
    LockOwner, OpenFlags, ReplyAttr, ReplyCreate, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyXattr, Request,
};
use parking_lot::Mutex;

/// What `converged mount` gives the kernel by default (`--attr-timeout`).
const TTL: Duration = Duration::from_secs(10);

#[derive(Default)]
struct Tree {
    names: HashMap<(u64, OsString), u64>,
    attrs: HashMap<u64, FileAttr>,
}

struct Floor {
    tree: Mutex<Tree>,
    next: AtomicU64,
}

fn attr(ino: u64, kind: FileType, perm: u16, uid: u32, gid: u32) -> FileAttr {
    let now = SystemTime::now();
    FileAttr {
        ino: INodeNo(ino),
        size: 0,
        blocks: 0,
        atime: now,
        mtime: now,
        ctime: now,
        crtime: now,
        kind,
        perm,
        nlink: if kind == FileType::Directory { 2 } else { 1 },
        uid,
        gid,
        rdev: 0,
        blksize: 1 << 20,
        flags: 0,
    }
}

impl Floor {
    fn make(&self, req: &Request, parent: INodeNo, name: &OsStr, kind: FileType, perm: u16) -> Result<FileAttr, Errno> {
        let mut t = self.tree.lock();
        if !t.attrs.contains_key(&parent.0) {
            return Err(Errno::ENOENT);
        }
        let key = (parent.0, name.to_os_string());
        if t.names.contains_key(&key) {
            return Err(Errno::EEXIST);
        }
        let ino = self.next.fetch_add(1, Ordering::Relaxed);
        let a = attr(ino, kind, perm, req.uid(), req.gid());
        t.names.insert(key, ino);
        t.attrs.insert(ino, a);
        Ok(a)
    }

    fn remove(&self, parent: INodeNo, name: &OsStr, dir: bool) -> Result<(), Errno> {
        let mut t = self.tree.lock();
        let key = (parent.0, name.to_os_string());
        let ino = *t.names.get(&key).ok_or(Errno::ENOENT)?;
        let is_dir = t.attrs.get(&ino).is_some_and(|a| a.kind == FileType::Directory);
        match (dir, is_dir) {
            (true, false) => return Err(Errno::ENOTDIR),
            (false, true) => return Err(Errno::EISDIR),
            (true, true) if t.names.keys().any(|(p, _)| *p == ino) => return Err(Errno::ENOTEMPTY),
            _ => {}
        }
        t.names.remove(&key);
        t.attrs.remove(&ino);
        Ok(())
    }
}

impl Filesystem for Floor {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // The flags converged asks for that shape the requests a create,
        // stat or unlink makes (see fs/src/fuse.rs).
        let _ = config.add_capabilities(InitFlags::FUSE_PARALLEL_DIROPS);
        let _ = config.add_capabilities(InitFlags::FUSE_POSIX_ACL | InitFlags::FUSE_DONT_MASK);
        let _ = config.add_capabilities(InitFlags::FUSE_DO_READDIRPLUS | InitFlags::FUSE_READDIRPLUS_AUTO);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let t = self.tree.lock();
        match t.names.get(&(parent.0, name.to_os_string())).and_then(|i| t.attrs.get(i)) {
            Some(a) => reply.entry(&TTL, a, Generation(0)),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.tree.lock().attrs.get(&ino.0) {
            Some(a) => reply.attr(&TTL, a),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn mkdir(&self, req: &Request, parent: INodeNo, name: &OsStr, mode: u32, umask: u32, reply: ReplyEntry) {
        match self.make(req, parent, name, FileType::Directory, (mode & !umask & 0o7777) as u16) {
            Ok(a) => reply.entry(&TTL, &a, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        match self.remove(parent, name, false) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        match self.remove(parent, name, true) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn open(&self, _req: &Request, _ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        reply.opened(FileHandle(0), FopenFlags::empty());
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        match self.make(req, parent, name, FileType::RegularFile, (mode & !umask & 0o7777) as u16) {
            Ok(a) => reply.created(&TTL, &a, Generation(0), FileHandle(0), FopenFlags::empty()),
            Err(e) => reply.error(e),
        }
    }

    fn flush(&self, _req: &Request, _ino: INodeNo, _fh: FileHandle, _lock_owner: LockOwner, reply: ReplyEmpty) {
        // As converged on one node: nothing to do at close, and the kernel
        // stops asking.
        reply.error(Errno::ENOSYS);
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn getxattr(&self, _req: &Request, _ino: INodeNo, _name: &OsStr, _size: u32, reply: ReplyXattr) {
        reply.error(Errno::ENODATA);
    }
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(mountpoint) = args.first().map(PathBuf::from) else {
        anyhow::bail!("usage: fuse_floor MOUNTPOINT [THREADS]");
    };
    let threads = match args.get(1) {
        Some(t) => t.parse().map_err(|_| anyhow::anyhow!("THREADS: expected a number, got {t:?}"))?,
        None => 8, // converged mount's --threads default
    };
    let root = 1;
    let mut tree = Tree::default();
    // SAFETY: getuid/getgid cannot fail.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    tree.attrs.insert(root, attr(root, FileType::Directory, 0o777, uid, gid));
    let fs = Floor { tree: Mutex::new(tree), next: AtomicU64::new(root + 1) };
    let mut config = fuser::Config::default();
    config.mount_options = vec![
        fuser::MountOption::FSName("fuse-floor".into()),
        fuser::MountOption::DefaultPermissions,
        fuser::MountOption::RW,
        fuser::MountOption::NoDev,
        fuser::MountOption::NoSuid,
    ];
    config.acl = fuser::SessionACL::All;
    config.n_threads = Some(threads);
    let session = fuser::Session::new(fs, &mountpoint, &config)
        .map_err(|e| anyhow::anyhow!("mount {}: {e}", mountpoint.display()))?;
    session.run().map_err(|e| anyhow::anyhow!("FUSE session: {e}"))?;
    Ok(())
}
