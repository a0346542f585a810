//! An in-process harness for the filesystem core: a [`Core`] over an
//! in-memory metadata engine ([`MemKv`]) and a temporary data dir, with no
//! kernel mount and no root. Background workers are not started: tests call
//! `core.flush()` where the flusher would.
//!
//! Paths are `/`-separated and relative to the root (`""` is the root). They
//! are resolved with `lookup`, one component at a time, as the kernel would.

#![allow(dead_code)]

pub mod cluster;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use converged_fs::core::{Attr, Core, CoreConfig};
use converged_fs::error::FsResult;
use converged_metadata::types::{FileKind, Ino, NewNode, RenameMode, SetAttr, XattrMode};
use converged_metadata::{KvEngine, MemKv, MetaError, MetaResult, Namespace, Unlinked, ROOT};

/// The node id of the core under test.
pub const NODE: &str = "n1";
/// The node id of the namespace that makes out-of-band changes.
pub const OTHER: &str = "other";
/// Bytes asked for by each read, as the kernel would (max_read).
const READ_PIECE: u32 = 128 << 10;

/// A core over a fresh in-memory volume and data dir.
pub struct TestCore {
    pub dir: tempfile::TempDir,
    pub kv: MemKv,
    pub engine: Arc<dyn KvEngine>,
    pub core: Arc<Core>,
}

impl Default for TestCore {
    fn default() -> Self {
        Self::new()
    }
}

impl TestCore {
    pub fn new() -> Self {
        let dir = tempfile::tempdir().expect("create a temporary data dir");
        let kv = MemKv::new();
        let engine: Arc<dyn KvEngine> = Arc::new(kv.clone());
        let core = Arc::new(start(&engine, dir.path()).expect("start the core"));
        TestCore { dir, kv, engine, core }
    }

    /// Unmount and mount again over the same engine and data dir: `shutdown`,
    /// then `Core::start` (which runs crash recovery). Handles still open on
    /// the old core are dropped with it, as a daemon exit would.
    pub fn remount(&mut self) -> FsResult<()> {
        self.core.shutdown();
        self.core = Arc::new(start(&self.engine, self.dir.path())?);
        Ok(())
    }

    /// A second namespace over the same engine, acting as another node.
    pub fn other_node(&self) -> OtherNode {
        OtherNode::new(&self.engine)
    }

    pub fn create_file(&self, path: &str, data: &[u8]) -> FsResult<Attr> {
        create_file(&self.core, path, data)
    }

    pub fn write_file(&self, path: &str, offset: u64, data: &[u8]) -> FsResult<()> {
        write_file(&self.core, path, offset, data)
    }

    pub fn read_file(&self, path: &str) -> FsResult<Vec<u8>> {
        read_file(&self.core, path)
    }

    pub fn mkdir(&self, path: &str) -> FsResult<Attr> {
        mkdir(&self.core, path)
    }

    pub fn tree(&self, root: &str) -> Result<Tree, String> {
        tree(&self.core, root)
    }
}

/// Start a core for node [`NODE`] with checksum-verified reads.
impl TestCore {
    /// A core whose files are backfilled to `store` (an in-memory object
    /// store in tests, possibly behind a fault-injecting wrapper), under
    /// the key prefix `mnt`. Backfill and eviction run only when a test
    /// steps their workers.
    pub fn with_object_store(store: Arc<dyn object_store::ObjectStore>, cfg: converged_fs::tier::TierConfig) -> Self {
        let dir = tempfile::tempdir().expect("create a temporary data dir");
        let kv = MemKv::new();
        let engine: Arc<dyn KvEngine> = Arc::new(kv.clone());
        let ns = Namespace::open(engine.clone(), 0, 0).expect("open the namespace").with_node(NODE).with_tier();
        let core = Core::start(ns, core_config(dir.path(), NODE)).expect("start the core");
        let core = Arc::new(core);
        let home = converged_fs::objects::Location { base: "memory://test".into(), prefix: "mnt".into() };
        let objects = converged_fs::objects::ObjectTier::with_store(home, store).expect("an object tier");
        core.attach_tier(Arc::new(converged_fs::tier::Tiering::new(objects, cfg)));
        TestCore { dir, kv, engine, core }
    }
}

pub fn start(engine: &Arc<dyn KvEngine>, data_dir: &Path) -> FsResult<Core> {
    let ns = Namespace::open(engine.clone(), 0, 0)?.with_node(NODE);
    Core::start(ns, core_config(data_dir, NODE))
}

/// The settings of a test core of node `node` over `data_dir`: reads
/// verified against their checksums, no atime (the reference models keep
/// none; the mount tests check it), no kernel handles to adopt.
pub fn core_config(data_dir: &Path, node: &str) -> CoreConfig {
    CoreConfig {
        data_dir: data_dir.to_path_buf(),
        node_id: node.into(),
        verify_reads: true,
        read_only: false,
        atime: converged_metadata::AtimeRule::Never,
        diratime: false,
        meta_file: None,
        kernel_open: Vec::new(),
        fh_base: 0,
        serves_peers: true,
    }
}

/// Another node's view of the volume: changes made through it bypass the
/// core under test entirely, as a rename or unlink on another node would.
pub struct OtherNode {
    pub ns: Namespace,
}

impl OtherNode {
    pub fn new(engine: &Arc<dyn KvEngine>) -> Self {
        OtherNode { ns: Namespace::open(engine.clone(), 0, 0).expect("open a second namespace").with_node(OTHER) }
    }

    pub fn resolve(&self, path: &str) -> MetaResult<converged_metadata::types::Inode> {
        let mut inode = self.ns.getattr(ROOT)?;
        for c in components(path) {
            inode = self.ns.lookup(inode.ino, c.as_bytes())?;
        }
        Ok(inode)
    }

    pub fn resolve_parent<'p>(&self, path: &'p str) -> MetaResult<(Ino, &'p str)> {
        let (parent, name) = split(path);
        let dir = self.resolve(parent)?;
        if dir.kind != FileKind::Directory {
            return Err(MetaError::NotDir);
        }
        Ok((dir.ino, name))
    }

    /// Unlink a name. When that was the last name, the records are purged
    /// too unless `open_here` says the core under test has the inode open
    /// (the other node, not having it open, would purge it at once).
    pub fn unlink(&self, path: &str, open_here: impl Fn(Ino) -> bool) -> MetaResult<Unlinked> {
        let (parent, name) = self.resolve_parent(path)?;
        let gone = self.ns.unlink(parent, name.as_bytes())?;
        if gone.orphaned && !open_here(gone.ino) {
            self.ns.purge(gone.ino)?;
        }
        Ok(gone)
    }

    /// Rename (replacing the target); a replaced file that lost its last
    /// name is purged unless the core under test has it open.
    pub fn rename(
        &self,
        from: &str,
        to: &str,
        mode: RenameMode,
        open_here: impl Fn(Ino) -> bool,
    ) -> MetaResult<Option<Unlinked>> {
        let (p, n) = self.resolve_parent(from)?;
        let (np, nn) = self.resolve_parent(to)?;
        let victim = self.ns.rename(p, n.as_bytes(), np, nn.as_bytes(), mode)?;
        if let Some(v) = &victim {
            if v.orphaned && !open_here(v.ino) {
                self.ns.purge(v.ino)?;
            }
        }
        Ok(victim)
    }
}

// ---- paths ----

pub fn components(path: &str) -> impl Iterator<Item = &str> {
    path.split('/').filter(|c| !c.is_empty())
}

/// (parent, name) of a path: `"a/b"` → `("a", "b")`, `"a"` → `("", "a")`.
pub fn split(path: &str) -> (&str, &str) {
    match path.rsplit_once('/') {
        Some((p, n)) => (p, n),
        None => ("", path),
    }
}

pub fn join(base: &str, path: &str) -> String {
    match (base.is_empty(), path.is_empty()) {
        (true, _) => path.to_string(),
        (_, true) => base.to_string(),
        _ => format!("{base}/{path}"),
    }
}

/// The attributes of the inode a path names, resolved one lookup at a time.
pub fn resolve(core: &Core, path: &str) -> FsResult<Attr> {
    let mut attr = core.getattr(ROOT)?;
    for c in components(path) {
        attr = core.lookup(attr.ino, c.as_bytes())?;
    }
    Ok(attr)
}

/// The directory holding a path's last component, and that component.
/// ENOTDIR when the parent is not a directory, as the kernel's path walk answers.
pub fn resolve_parent<'p>(core: &Core, path: &'p str) -> FsResult<(Ino, &'p str)> {
    let (parent, name) = split(path);
    let dir = resolve(core, parent)?;
    if dir.kind != FileKind::Directory {
        return Err(MetaError::NotDir.into());
    }
    Ok((dir.ino, name))
}

// ---- nodes ----

/// What the kernel asks for on open(O_CREAT) for writing.
pub fn file_node() -> NewNode<'static> {
    NewNode { unsealed: true, ..NewNode::plain(FileKind::Regular, 0o644) }
}

/// What the kernel asks for on mkdir.
pub fn dir_node() -> NewNode<'static> {
    NewNode::plain(FileKind::Directory, 0o755)
}

// ---- whole-file operations, as a process would do them ----

/// open(2) of an inode the path walk found: EISDIR for a directory, as the
/// kernel answers without asking the daemon (it opens directories with
/// opendir, and refuses them for writing).
pub fn open(core: &Core, attr: &Attr, writable: bool) -> FsResult<u64> {
    if attr.kind == FileKind::Directory {
        return Err(MetaError::IsDir.into());
    }
    Ok(core.open(attr.ino, writable)?.fh)
}

/// open(O_CREAT|O_EXCL|O_WRONLY), write, close, release.
pub fn create_file(core: &Core, path: &str, data: &[u8]) -> FsResult<Attr> {
    let (parent, name) = resolve_parent(core, path)?;
    let (attr, opened) = core.create(parent, name.as_bytes(), &file_node())?;
    let written = write_all(core, opened.fh, 0, data).and_then(|()| core.close(opened.fh).map(|_| ()));
    let released = core.release(opened.fh);
    written.and(released)?;
    Ok(attr)
}

/// open(O_CREAT|O_TRUNC|O_WRONLY), write, close, release: a new file when
/// the name is free, else the existing one cut to 0 first (the kernel sends
/// setattr(size 0), then open).
pub fn put_file(core: &Core, path: &str, data: &[u8]) -> FsResult<()> {
    let attr = match resolve(core, path) {
        Err(e) if e.errno() == libc::ENOENT => return create_file(core, path, data).map(|_| ()),
        r => r?,
    };
    if attr.kind == FileKind::Directory {
        return Err(MetaError::IsDir.into());
    }
    core.setattr(attr.ino, &SetAttr { size: Some(0), ..SetAttr::default() })?;
    let fh = open(core, &attr, true)?;
    let written = write_all(core, fh, 0, data).and_then(|()| core.close(fh).map(|_| ()));
    let released = core.release(fh);
    written.and(released)
}

/// open(O_WRONLY), pwrite at `offset`, close, release.
pub fn write_file(core: &Core, path: &str, offset: u64, data: &[u8]) -> FsResult<()> {
    let fh = open(core, &resolve(core, path)?, true)?;
    let written = write_all(core, fh, offset, data).and_then(|()| core.close(fh).map(|_| ()));
    let released = core.release(fh);
    written.and(released)
}

/// open(O_WRONLY|O_APPEND), write at the end, close, release.
pub fn append_file(core: &Core, path: &str, data: &[u8]) -> FsResult<()> {
    let attr = resolve(core, path)?;
    let ino = attr.ino;
    let fh = open(core, &attr, true)?;
    let written =
        core.getattr(ino).and_then(|a| write_all(core, fh, a.size, data)).and_then(|()| core.close(fh).map(|_| ()));
    let released = core.release(fh);
    written.and(released)
}

/// Write `data` at `offset` through a handle, in one call per MiB (max_write).
pub fn write_all(core: &Core, fh: u64, offset: u64, data: &[u8]) -> FsResult<()> {
    if data.is_empty() {
        core.write(fh, offset, data)?;
        return Ok(());
    }
    let mut done = 0;
    for piece in data.chunks(1 << 20) {
        let n = core.write(fh, offset + done, piece)? as u64;
        assert_eq!(n, piece.len() as u64, "short write through the core");
        done += n;
    }
    Ok(())
}

/// open(O_RDONLY), read to the end, release.
pub fn read_file(core: &Core, path: &str) -> FsResult<Vec<u8>> {
    let attr = resolve(core, path)?;
    if attr.kind == FileKind::Directory {
        return Err(MetaError::IsDir.into());
    }
    read_ino(core, attr.ino)
}

/// Open a regular file by inode, read it to the end, release.
pub fn read_ino(core: &Core, ino: Ino) -> FsResult<Vec<u8>> {
    let fh = core.open(ino, false)?.fh;
    let data = read_all(core, fh);
    let released = core.release(fh);
    let data = data?;
    released?;
    Ok(data)
}

/// Read through a handle from offset 0 until a read returns nothing.
pub fn read_all(core: &Core, fh: u64) -> FsResult<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let piece = core.read(fh, out.len() as u64, READ_PIECE)?;
        if piece.is_empty() {
            return Ok(out);
        }
        out.extend_from_slice(&piece);
    }
}

/// open(O_WRONLY), fsync, close, release.
pub fn fsync_file(core: &Core, path: &str) -> FsResult<()> {
    let fh = open(core, &resolve(core, path)?, true)?;
    let synced = core.fsync(fh, false).and_then(|()| core.close(fh).map(|_| ()));
    let released = core.release(fh);
    synced.and(released)
}

pub fn truncate(core: &Core, path: &str, size: u64) -> FsResult<Attr> {
    let ino = resolve(core, path)?.ino;
    core.setattr(ino, &SetAttr { size: Some(size), ..SetAttr::default() })
}

pub fn mkdir(core: &Core, path: &str) -> FsResult<Attr> {
    let (parent, name) = resolve_parent(core, path)?;
    core.mknod(parent, name.as_bytes(), &dir_node())
}

pub fn unlink(core: &Core, path: &str) -> FsResult<()> {
    let (parent, name) = resolve_parent(core, path)?;
    core.unlink(parent, name.as_bytes())
}

pub fn rmdir(core: &Core, path: &str) -> FsResult<()> {
    let (parent, name) = resolve_parent(core, path)?;
    core.rmdir(parent, name.as_bytes())
}

pub fn rename(core: &Core, from: &str, to: &str, mode: RenameMode) -> FsResult<()> {
    let (p, n) = resolve_parent(core, from)?;
    let (np, nn) = resolve_parent(core, to)?;
    core.rename(p, n.as_bytes(), np, nn.as_bytes(), mode)
}

/// link(from, to).
pub fn link(core: &Core, from: &str, to: &str) -> FsResult<Attr> {
    let ino = resolve(core, from)?.ino;
    let (np, nn) = resolve_parent(core, to)?;
    core.link(ino, np, nn.as_bytes())
}

pub fn setxattr(core: &Core, path: &str, name: &[u8], value: &[u8], mode: XattrMode) -> FsResult<()> {
    let ino = resolve(core, path)?.ino;
    core.setxattr(ino, name, value, mode, &converged_fs::core::Caller::ROOT)
}

pub fn getxattr(core: &Core, path: &str, name: &[u8]) -> FsResult<Vec<u8>> {
    let ino = resolve(core, path)?.ino;
    core.getxattr(ino, name)
}

pub fn removexattr(core: &Core, path: &str, name: &[u8]) -> FsResult<()> {
    let ino = resolve(core, path)?.ino;
    core.removexattr(ino, name)
}

/// opendir, readdir from offset 0, releasedir: the entries without `.` and `..`.
pub fn list(core: &Core, ino: Ino) -> FsResult<Vec<(Vec<u8>, converged_metadata::types::Dentry)>> {
    let (fh, _) = core.opendir(ino)?;
    let listing = core.readdir(ino, fh, 0);
    core.releasedir(fh);
    Ok(listing?.iter().filter(|(n, _)| n != b"." && n != b"..").cloned().collect())
}

// ---- whole-tree snapshots ----

/// One entry of a tree snapshot.
#[derive(Clone, PartialEq, Eq)]
pub struct Entry {
    pub ino: Ino,
    pub kind: FileKind,
    pub nlink: u32,
    pub size: u64,
    /// A regular file's bytes, read through the core (checksum-verified).
    pub data: Option<Vec<u8>>,
    /// Every extended attribute, by name.
    pub xattrs: BTreeMap<Vec<u8>, Vec<u8>>,
}

impl std::fmt::Debug for Entry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?} ino {} nlink {} size {}", self.kind, self.ino, self.nlink, self.size)?;
        if let Some(d) = &self.data {
            write!(f, " crc32c {:08x}", crc32c::crc32c(d))?;
        }
        if !self.xattrs.is_empty() {
            write!(f, " xattrs {:?}", self.xattrs)?;
        }
        Ok(())
    }
}

/// Path (relative to the snapshot's root) → entry.
pub type Tree = BTreeMap<String, Entry>;

/// Walk the tree under `root` through the core: readdir every directory,
/// lookup every name, read every regular file to its end through a fresh
/// handle. Fails (with a description) on any error, on a file whose bytes
/// are not as long as its size, on a dentry whose kind or inode disagrees
/// with its inode, and on link counts that disagree with the names seen
/// (files) or the subdirectories (directories). Meant for a quiescent core.
pub fn tree(core: &Core, root: &str) -> Result<Tree, String> {
    let top = resolve(core, root).map_err(|e| format!("resolve {root:?}: {e}"))?;
    let mut out = Tree::new();
    let mut names: BTreeMap<Ino, u32> = BTreeMap::new();
    walk(core, top.ino, "", &mut out, &mut names)?;
    for (path, e) in &out {
        match e.kind {
            FileKind::Directory => {
                let subdirs =
                    out.iter().filter(|(p, c)| c.kind == FileKind::Directory && split(p).0 == path.as_str()).count()
                        as u32;
                if e.nlink != 2 + subdirs {
                    return Err(format!("directory {path:?}: nlink {} but {subdirs} subdirectories", e.nlink));
                }
            }
            _ => {
                let seen = names[&e.ino];
                if e.nlink != seen {
                    return Err(format!("{path:?} (ino {}): nlink {} but {seen} names in the tree", e.ino, e.nlink));
                }
            }
        }
    }
    Ok(out)
}

fn walk(core: &Core, dir: Ino, prefix: &str, out: &mut Tree, names: &mut BTreeMap<Ino, u32>) -> Result<(), String> {
    let entries = list(core, dir).map_err(|e| format!("readdir {prefix:?}: {e}"))?;
    for (name, dentry) in entries {
        let name = String::from_utf8(name).map_err(|e| format!("non-UTF-8 name in {prefix:?}: {e}"))?;
        let path = join(prefix, &name);
        let attr = core.lookup(dir, name.as_bytes()).map_err(|e| format!("lookup {path:?}: {e}"))?;
        if attr.ino != dentry.ino || attr.kind != dentry.kind {
            return Err(format!("{path:?}: dentry says {dentry:?}, lookup says ino {} {:?}", attr.ino, attr.kind));
        }
        let xattrs = xattrs_of(core, attr.ino).map_err(|e| format!("xattrs of {path:?}: {e}"))?;
        *names.entry(attr.ino).or_default() += 1;
        let data = match attr.kind {
            FileKind::Regular => {
                let data = read_ino(core, attr.ino)
                    .map_err(|e| format!("read {path:?}: {e}\n    {}", describe_file(core, attr.ino)))?;
                let after = core.getattr(attr.ino).map_err(|e| format!("getattr {path:?}: {e}"))?;
                if data.len() as u64 != attr.size || after.size != attr.size {
                    return Err(format!(
                        "{path:?}: read {} bytes, size {} at lookup and {} after the read\n    {}",
                        data.len(),
                        attr.size,
                        after.size,
                        describe_file(core, attr.ino)
                    ));
                }

                Some(data)
            }
            _ => None,
        };
        out.insert(
            path.clone(),
            Entry { ino: attr.ino, kind: attr.kind, nlink: attr.nlink, size: attr.size, data, xattrs },
        );
        if attr.kind == FileKind::Directory {
            walk(core, attr.ino, &path, out, names)?;
        }
    }
    Ok(())
}

/// What must hold once every handle is released and `flush` returned: no
/// inode open, no file left marked unsealed or sync-pending.
pub fn check_quiescent(core: &Core) -> Result<(), String> {
    if core.open_files() != 0 {
        return Err(format!("{} inodes still open after every handle was released", core.open_files()));
    }
    let ns = core.namespace();
    let unsealed = ns.unsealed().map_err(|e| format!("list unsealed: {e}"))?;
    let pending = ns.sync_pending().map_err(|e| format!("list sync-pending: {e}"))?;
    if !unsealed.is_empty() || !pending.is_empty() {
        return Err(format!("after a flush with nothing open: unsealed {unsealed:?}, sync-pending {pending:?}"));
    }
    Ok(())
}

/// What must hold right after a mount, given the whole tree: no orphan
/// left, and a backing file for exactly the regular files in the tree.
pub fn check_mounted(core: &Core, whole: &Tree) -> Result<(), String> {
    let orphans = core.namespace().orphans().map_err(|e| format!("list orphans: {e}"))?;
    if !orphans.is_empty() {
        return Err(format!("orphans left after a mount: {orphans:?}"));
    }
    let backing: std::collections::BTreeSet<Ino> =
        core.chunk_store().list().map_err(|e| format!("list backing files: {e}"))?.into_iter().collect();
    let files: std::collections::BTreeSet<Ino> =
        whole.values().filter(|e| e.kind == FileKind::Regular).map(|e| e.ino).collect();
    if backing != files {
        let extra: Vec<&Ino> = backing.difference(&files).collect();
        let missing: Vec<&Ino> = files.difference(&backing).collect();
        return Err(format!("backing files of inodes not in the tree: {extra:?}; files without one: {missing:?}"));
    }
    Ok(())
}

/// With nothing open, the backing file of every regular file in `tree` is
/// as long as the file's size (passthrough reads it to its end, and the next
/// writer takes its size from it).
pub fn check_backing(core: &Core, tree: &Tree) -> Result<(), String> {
    for (path, e) in tree.iter().filter(|(_, e)| e.kind == FileKind::Regular) {
        let backing = std::fs::metadata(core.chunk_store().path(e.ino)).map(|m| m.len());
        if backing.as_ref().ok() != Some(&e.size) {
            return Err(format!(
                "{path:?}: size {} but the backing file {backing:?}\n    {}",
                e.size,
                describe_file(core, e.ino)
            ));
        }
    }
    Ok(())
}

/// The metadata and the backing file of a regular file, for failure messages:
/// size, chunk records (length, block checksums) and what the backing file
/// holds (length, checksums of the same blocks).
pub fn describe_file(core: &Core, ino: Ino) -> String {
    let ns = core.namespace();
    let inode = ns.getattr(ino).map(|i| (i.size, i.nlink));
    let chunks: Vec<String> = match ns.chunks(ino) {
        Ok(c) => c
            .iter()
            .map(|(i, r)| format!("chunk {i}: v{} len {} crcs {:08x?}", r.version, r.len, r.block_crcs))
            .collect(),
        Err(e) => vec![format!("chunks: {e}")],
    };
    let backing = match std::fs::read(core.chunk_store().path(ino)) {
        Ok(b) => {
            let crcs: Vec<u32> = b.chunks(converged_metadata::types::BLOCK_SIZE as usize).map(crc32c::crc32c).collect();
            format!("backing file: len {} crcs {crcs:08x?}", b.len())
        }
        Err(e) => format!("backing file: {e}"),
    };
    format!(
        "ino {ino}: metadata (size, nlink) {inode:?}, {}; {backing}; unsealed mark {:?}",
        chunks.join(", "),
        ns.writer(ino).ok().flatten()
    )
}

pub fn xattrs_of(core: &Core, ino: Ino) -> FsResult<BTreeMap<Vec<u8>, Vec<u8>>> {
    let mut out = BTreeMap::new();
    for name in core.listxattr(ino)?.split(|b| *b == 0).filter(|n| !n.is_empty()) {
        out.insert(name.to_vec(), core.getxattr(ino, name)?);
    }
    Ok(out)
}

/// Where two snapshots differ, one line per path (empty when equal).
pub fn diff(left: &Tree, right: &Tree, left_name: &str, right_name: &str) -> String {
    let mut out = String::new();
    let paths: std::collections::BTreeSet<&String> = left.keys().chain(right.keys()).collect();
    for p in paths {
        match (left.get(p), right.get(p)) {
            (Some(a), Some(b)) if a == b => {}
            (a, b) => {
                out.push_str(&format!("  {p:?}: {left_name} {a:?}, {right_name} {b:?}"));
                if let (Some(Some(x)), Some(Some(y))) = (a.map(|a| &a.data), b.map(|b| &b.data)) {
                    if let Some(at) = x.iter().zip(y.iter()).position(|(x, y)| x != y) {
                        out.push_str(&format!(" (bytes first differ at offset {at})"));
                    }
                }
                out.push('\n');
            }
        }
    }
    out
}
