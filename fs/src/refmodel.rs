//! The reference model of the namespace for tests: names, files and their
//! bytes, directories, symlinks, hard links and xattrs, in plain maps. Every
//! operation answers what Linux answers on a local filesystem: the same
//! result, or the same errno (when several apply, the one Linux checks
//! first). The in-process property test (`fs/tests/inprocess.rs`) and the
//! kernel-mount sequences (`tests/tests/refmodel.rs`) run their operations
//! on the filesystem and on this model, and compare answers and trees.
//! Compiled only with the `test-util` feature: the daemon does not ship it.
//!
//! Paths are relative to the root, components joined by `/`. Nodes have
//! identities that are never reused, so that hard links, open handles and
//! renamed directories follow them.

use std::collections::{BTreeMap, HashMap};

use converged_metadata::types::{RenameMode, XattrMode};

/// A node of the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Node {
    Dir(usize),
    File(usize),
    /// Targets never exist, so following one always finds nothing.
    Symlink(usize),
}

impl Node {
    pub fn id(self) -> usize {
        match self {
            Node::Dir(id) | Node::File(id) | Node::Symlink(id) => id,
        }
    }
}

pub type Errno = i32;

#[derive(Default)]
pub struct Model {
    /// Path → node, below the root.
    tree: BTreeMap<String, Node>,
    /// File id → bytes. Kept after the last name goes (open handles read it).
    bytes: HashMap<usize, Vec<u8>>,
    /// Symlink id → target.
    targets: HashMap<usize, String>,
    /// Node id → extended attributes.
    xattrs: HashMap<usize, BTreeMap<Vec<u8>, Vec<u8>>>,
    next: usize,
    /// Calls go through the kernel, whose VFS answers some before the
    /// filesystem sees them (see [`Model::through_kernel`]).
    vfs: bool,
}

/// `path` split into its parent directory (empty: the root) and its name.
pub fn split(path: &str) -> (&str, &str) {
    match path.rsplit_once('/') {
        Some((parent, name)) => (parent, name),
        None => ("", path),
    }
}

/// Whether `path` is `ancestor` or below it.
pub fn within(path: &str, ancestor: &str) -> bool {
    path == ancestor || path.strip_prefix(ancestor).is_some_and(|rest| rest.starts_with('/'))
}

impl Model {
    /// The model of calls made on the filesystem itself (the core).
    pub fn new() -> Self {
        Self::default()
    }

    /// The model of calls made through a mount: the kernel's VFS answers a
    /// rename over an ancestor of the source (`ENOTEMPTY`), and a link to a
    /// name that exists (`EEXIST`, before a directory source's `EPERM`),
    /// before the filesystem sees them.
    pub fn through_kernel() -> Self {
        Model { vfs: true, ..Self::default() }
    }

    fn new_id(&mut self) -> usize {
        self.next += 1;
        self.next
    }

    /// The directory holding `path` must exist and be a directory (a
    /// symlink on the way leads nowhere).
    pub fn parent_ok(&self, path: &str) -> Result<(), Errno> {
        let (parent, _) = split(path);
        if parent.is_empty() {
            return Ok(());
        }
        match self.get(parent)? {
            Node::Dir(_) => Ok(()),
            Node::File(_) => Err(libc::ENOTDIR),
            Node::Symlink(_) => Err(libc::ENOENT),
        }
    }

    /// The node at `path`, not following a final symlink.
    pub fn get(&self, path: &str) -> Result<Node, Errno> {
        self.parent_ok(path)?;
        self.tree.get(path).copied().ok_or(libc::ENOENT)
    }

    /// The file at `path`, as an open for writing finds it.
    pub fn file(&self, path: &str) -> Result<usize, Errno> {
        match self.get(path)? {
            Node::File(id) => Ok(id),
            Node::Dir(_) => Err(libc::EISDIR),
            Node::Symlink(_) => Err(libc::ENOENT),
        }
    }

    /// The bytes of file `id`.
    pub fn bytes(&self, id: usize) -> &[u8] {
        &self.bytes[&id]
    }

    pub fn is_empty_dir(&self, path: &str) -> bool {
        !self.tree.keys().any(|k| within(k, path) && k != path)
    }

    /// Write `data` at `offset` of file `id` (through a handle).
    pub fn write_id(&mut self, id: usize, offset: u64, data: &[u8]) {
        if data.is_empty() {
            return;
        }
        let b = self.bytes.get_mut(&id).expect("file has bytes");
        let end = offset as usize + data.len();
        if b.len() < end {
            b.resize(end, 0);
        }
        b[offset as usize..end].copy_from_slice(data);
    }

    /// Set the size of file `id` (through a handle).
    pub fn truncate_id(&mut self, id: usize, len: u64) {
        self.bytes.get_mut(&id).expect("file has bytes").resize(len as usize, 0);
    }

    /// open for writing, then pwrite.
    pub fn write(&mut self, path: &str, offset: u64, data: &[u8]) -> Result<(), Errno> {
        let id = self.file(path)?;
        self.write_id(id, offset, data);
        Ok(())
    }

    /// open for writing, then ftruncate.
    pub fn truncate(&mut self, path: &str, len: u64) -> Result<(), Errno> {
        let id = self.file(path)?;
        self.truncate_id(id, len);
        Ok(())
    }

    fn take_subtree(&mut self, from: &str) -> Vec<(String, Node)> {
        let keys: Vec<String> = self.tree.keys().filter(|k| within(k, from)).cloned().collect();
        keys.into_iter().map(|k| (k[from.len()..].to_string(), self.tree.remove(&k).expect("listed"))).collect()
    }

    fn put_subtree(&mut self, to: &str, nodes: Vec<(String, Node)>) {
        for (rest, node) in nodes {
            self.tree.insert(format!("{to}{rest}"), node);
        }
    }

    fn vacant(&self, path: &str) -> Result<(), Errno> {
        self.parent_ok(path)?;
        match self.tree.contains_key(path) {
            true => Err(libc::EEXIST),
            false => Ok(()),
        }
    }

    /// open(O_CREAT | O_EXCL) with `data` written: the new file's id.
    pub fn create(&mut self, path: &str, data: &[u8]) -> Result<usize, Errno> {
        self.vacant(path)?;
        let id = self.new_id();
        self.tree.insert(path.to_string(), Node::File(id));
        self.bytes.insert(id, data.to_vec());
        Ok(id)
    }

    /// open(O_CREAT | O_TRUNC) with `data` written.
    pub fn put(&mut self, path: &str, data: &[u8]) -> Result<usize, Errno> {
        match self.get(path) {
            Err(libc::ENOENT) => self.create(path, data),
            Err(e) => Err(e),
            Ok(Node::Dir(_)) => Err(libc::EISDIR),
            Ok(Node::Symlink(_)) => Err(libc::ENOENT),
            Ok(Node::File(id)) => {
                self.bytes.insert(id, data.to_vec());
                Ok(id)
            }
        }
    }

    pub fn mkdir(&mut self, path: &str) -> Result<(), Errno> {
        self.vacant(path)?;
        let id = self.new_id();
        self.tree.insert(path.to_string(), Node::Dir(id));
        Ok(())
    }

    pub fn symlink(&mut self, target: &str, path: &str) -> Result<(), Errno> {
        self.vacant(path)?;
        let id = self.new_id();
        self.tree.insert(path.to_string(), Node::Symlink(id));
        self.targets.insert(id, target.to_string());
        Ok(())
    }

    pub fn unlink(&mut self, path: &str) -> Result<(), Errno> {
        match self.get(path)? {
            Node::Dir(_) => Err(libc::EISDIR),
            _ => {
                self.tree.remove(path);
                Ok(())
            }
        }
    }

    pub fn rmdir(&mut self, path: &str) -> Result<(), Errno> {
        match self.get(path)? {
            Node::File(_) | Node::Symlink(_) => Err(libc::ENOTDIR),
            Node::Dir(_) if !self.is_empty_dir(path) => Err(libc::ENOTEMPTY),
            Node::Dir(_) => {
                self.tree.remove(path);
                Ok(())
            }
        }
    }

    /// link(2) (a symlink is linked itself, as linkat without AT_SYMLINK_FOLLOW).
    pub fn link(&mut self, from: &str, to: &str) -> Result<(), Errno> {
        let src = self.get(from)?;
        self.parent_ok(to)?;
        // The VFS looks the new name up before it asks the filesystem.
        if self.vfs && self.tree.contains_key(to) {
            return Err(libc::EEXIST);
        }
        if matches!(src, Node::Dir(_)) {
            return Err(libc::EPERM);
        }
        if self.tree.contains_key(to) {
            return Err(libc::EEXIST);
        }
        self.tree.insert(to.to_string(), src);
        Ok(())
    }

    /// rename(2) and renameat2's NOREPLACE and EXCHANGE, in Linux's order of checks.
    pub fn rename(&mut self, from: &str, to: &str, mode: RenameMode) -> Result<(), Errno> {
        self.parent_ok(from)?;
        self.parent_ok(to)?;
        let src = *self.tree.get(from).ok_or(libc::ENOENT)?;
        if from == to {
            return match mode {
                RenameMode::NoReplace => Err(libc::EEXIST),
                _ => Ok(()),
            };
        }
        let (from_parent, to_parent) = (split(from).0, split(to).0);
        // A directory cannot move below itself.
        if matches!(src, Node::Dir(_)) && from_parent != to_parent && within(to_parent, from) {
            return Err(libc::EINVAL);
        }
        let dst = self.tree.get(to).copied();
        if mode == RenameMode::Exchange {
            let dst = dst.ok_or(libc::ENOENT)?;
            if matches!(dst, Node::Dir(_)) && from_parent != to_parent && within(from_parent, to) {
                return Err(libc::EINVAL);
            }
            let a = self.take_subtree(from);
            let b = self.take_subtree(to);
            self.put_subtree(to, a);
            self.put_subtree(from, b);
            return Ok(());
        }
        if let Some(dst) = dst {
            if mode == RenameMode::NoReplace {
                return Err(libc::EEXIST);
            }
            if self.vfs && within(from, to) {
                return Err(libc::ENOTEMPTY);
            }
            if dst == src {
                // Two names of one file: nothing happens.
                return Ok(());
            }
            match (src, dst) {
                (Node::Dir(_), Node::File(_) | Node::Symlink(_)) => return Err(libc::ENOTDIR),
                (Node::File(_) | Node::Symlink(_), Node::Dir(_)) => return Err(libc::EISDIR),
                (Node::Dir(_), Node::Dir(_)) if !self.is_empty_dir(to) => return Err(libc::ENOTEMPTY),
                _ => {}
            }
            self.tree.remove(to);
        }
        let moved = self.take_subtree(from);
        self.put_subtree(to, moved);
        Ok(())
    }

    pub fn setxattr(&mut self, path: &str, name: &[u8], value: &[u8], mode: XattrMode) -> Result<(), Errno> {
        let id = self.get(path)?.id();
        let attrs = self.xattrs.entry(id).or_default();
        match (mode, attrs.contains_key(name)) {
            (XattrMode::Create, true) => return Err(libc::EEXIST),
            (XattrMode::Replace, false) => return Err(libc::ENODATA),
            _ => {}
        }
        attrs.insert(name.to_vec(), value.to_vec());
        Ok(())
    }

    pub fn getxattr(&self, path: &str, name: &[u8]) -> Result<Vec<u8>, Errno> {
        let id = self.get(path)?.id();
        self.xattrs.get(&id).and_then(|a| a.get(name)).cloned().ok_or(libc::ENODATA)
    }

    pub fn removexattr(&mut self, path: &str, name: &[u8]) -> Result<(), Errno> {
        let id = self.get(path)?.id();
        self.xattrs.get_mut(&id).and_then(|a| a.remove(name)).map(|_| ()).ok_or(libc::ENODATA)
    }

    /// Names of each file and symlink id in the tree.
    pub fn nlinks(&self) -> HashMap<usize, u32> {
        let mut n = HashMap::new();
        for node in self.tree.values() {
            if let Node::File(id) | Node::Symlink(id) = node {
                *n.entry(*id).or_default() += 1;
            }
        }
        n
    }

    /// Every path and its node, in order.
    pub fn paths(&self) -> impl Iterator<Item = (&String, &Node)> {
        self.tree.iter()
    }

    /// The node named `path`, if any (no checks on the way).
    pub fn node(&self, path: &str) -> Option<Node> {
        self.tree.get(path).copied()
    }

    /// The extended attributes of node `id`.
    pub fn xattrs_of(&self, id: usize) -> BTreeMap<Vec<u8>, Vec<u8>> {
        self.xattrs.get(&id).cloned().unwrap_or_default()
    }

    /// Path → one line describing it (kind; a file's size, checksum and
    /// links; a symlink's target): what [`describe`] gives for the same
    /// entry read from a real tree, so a mismatch prints readably.
    pub fn tree(&self) -> BTreeMap<String, String> {
        let links = self.nlinks();
        self.tree
            .iter()
            .map(|(path, node)| {
                let line = match node {
                    Node::Dir(_) => Entry::Dir,
                    Node::File(id) => Entry::File { bytes: &self.bytes[id], links: links[id] as u64 },
                    Node::Symlink(id) => Entry::Symlink(&self.targets[id]),
                };
                (path.clone(), describe(line))
            })
            .collect()
    }
}

/// One entry of a tree, as [`describe`] takes it.
pub enum Entry<'a> {
    Dir,
    File { bytes: &'a [u8], links: u64 },
    Symlink(&'a str),
}

/// One line per entry.
pub fn describe(e: Entry<'_>) -> String {
    match e {
        Entry::Dir => "dir".into(),
        Entry::File { bytes, links } => {
            format!("file {} bytes crc32c {:08x} links {links}", bytes.len(), crc32c::crc32c(bytes))
        }
        Entry::Symlink(t) => format!("symlink -> {t}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_model_answers_as_linux_does() {
        let mut m = Model::new();
        m.mkdir("a").unwrap();
        m.create("a/f", b"abc").unwrap();
        assert_eq!(m.create("a/f", b""), Err(libc::EEXIST));
        assert_eq!(m.mkdir("a/f/g"), Err(libc::ENOTDIR));
        assert_eq!(m.rmdir("a"), Err(libc::ENOTEMPTY));
        m.link("a/f", "g").unwrap();
        assert_eq!(m.nlinks()[&m.file("g").unwrap()], 2);
        assert_eq!(m.rename("a", "a/b", RenameMode::Replace), Err(libc::EINVAL));
        m.symlink("nowhere", "s").unwrap();
        assert_eq!(m.write("s", 0, b"x"), Err(libc::ENOENT));
        m.rename("a", "b", RenameMode::Replace).unwrap();
        m.write("b/f", 5, b"!").unwrap();
        assert_eq!(m.bytes(m.file("g").unwrap()), b"abc\0\0!");
        assert_eq!(m.tree().len(), 4);
        let mut k = Model::through_kernel();
        k.mkdir("d").unwrap();
        k.create("d/f", b"").unwrap();
        assert_eq!(k.rename("d/f", "d", RenameMode::Replace), Err(libc::ENOTEMPTY), "the VFS's answer");
        assert_eq!(m.rename("b/f", "b", RenameMode::Replace), Err(libc::EISDIR), "the filesystem's");
    }
}
