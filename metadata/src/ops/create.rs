//! mknod, mkdir, create and symlink: a new inode and its dentry, one transaction;
//! and tmpfile (`O_TMPFILE`): a new inode with no dentry, an orphan from the start.

use crate::acl;
use crate::error::{MetaError, MetaResult};
use crate::kv::Durability;
use crate::namespace::{check_name, get_dentry, put_dentry, put_inode, Namespace};
use crate::schema;
use crate::types::{Dentry, FileKind, Ino, Inode, NewNode, Timespec, REPLICAS_XATTR, SYMLINK_MAX};

impl Namespace {
    pub fn mknod(&self, parent: Ino, name: &[u8], node: &NewNode<'_>) -> MetaResult<Inode> {
        check_name(name)?;
        self.new_node(parent, Some(name), node)
    }

    /// A regular file in `parent` with no name (`open(2)` with `O_TMPFILE`):
    /// link count 0 and this node's orphan mark, so that it goes at its last
    /// close here, or at this node's next mount after a crash, unless a
    /// `link` names it first. It takes `parent`'s default ACL, set-group-ID
    /// group and replica policy as a file created there would; `parent`
    /// itself is not changed.
    pub fn tmpfile(&self, parent: Ino, node: &NewNode<'_>) -> MetaResult<Inode> {
        if node.kind != FileKind::Regular {
            return Err(MetaError::Invalid("O_TMPFILE makes regular files only"));
        }
        self.new_node(parent, None, node)
    }

    /// A new inode in `parent`, under `name`, or unnamed (a tmpfile).
    fn new_node(&self, parent: Ino, name: Option<&[u8]>, node: &NewNode<'_>) -> MetaResult<Inode> {
        if let Some(t) = node.target {
            if t.is_empty() {
                return Err(MetaError::NotFound);
            }
            if t.len() > SYMLINK_MAX {
                return Err(MetaError::NameTooLong);
            }
        }
        let ino = self.alloc_ino()?;
        let chunk_size = self.chunk_size();
        // The directory's replica policy, inherited by the new node. Read
        // outside the transaction (from the node's cache on a cluster): a
        // policy changed at this very moment applies from the next create.
        let policy = match node.kind {
            FileKind::Regular | FileKind::Directory => {
                self.read(|txn| Ok(txn.get(&schema::xattr(parent, REPLICAS_XATTR))?))?
            }
            _ => None,
        };
        self.write_answering(Durability::Buffered, node.request, |txn| {
            let mut dir = self.dir_in(txn, parent)?;
            if dir.nlink == 0 {
                // The directory was removed while a caller still held it.
                return Err(MetaError::NotFound);
            }
            if let Some(name) = name {
                if get_dentry(txn, parent, name)?.is_some() {
                    return Err(MetaError::Exists);
                }
            }
            let now = Timespec::now();
            let is_dir = node.kind == FileKind::Directory;
            let mut perm = node.perm & 0o7777;
            // The directory's default ACL, or the umask (symlinks take neither).
            let default_acl = match node.kind {
                FileKind::Symlink => None,
                _ => txn.get(&schema::xattr(parent, acl::DEFAULT))?,
            };
            let mut access_acl = None;
            match (&default_acl, node.kind) {
                (_, FileKind::Symlink) => {}
                (Some(d), _) => {
                    let (a, p) = acl::Acl::parse(d)?.inherit(perm);
                    (access_acl, perm) = (a, p);
                }
                (None, _) => perm &= !(node.umask & 0o777),
            }
            let mut gid = node.gid;
            // BSD group semantics under a setgid directory, as ext4 does.
            if dir.perm & libc::S_ISGID as u16 != 0 {
                gid = dir.gid;
                if is_dir {
                    perm |= libc::S_ISGID as u16;
                }
            }
            let inode = Inode {
                ino,
                kind: node.kind,
                perm,
                uid: node.uid,
                gid,
                nlink: match (name, is_dir) {
                    (None, _) => 0,
                    (Some(_), true) => 2,
                    (Some(_), false) => 1,
                },
                size: node.target.map_or(0, |t| t.len() as u64),
                atime: now,
                mtime: now,
                ctime: now,
                rdev: node.rdev,
                parent,
                // A tmpfile's empty name says it was never linked: the one
                // orphan a `link` may name (see ops/link.rs).
                name: name.map(<[u8]>::to_vec).unwrap_or_default(),
                chunk_size: if node.kind == FileKind::Regular { chunk_size } else { 0 },
                target: node.target.map(|t| t.to_vec()),
            };
            put_inode(txn, &inode);
            txn.new_inode(ino);
            self.answering(txn, node.request, ino);
            if is_dir && self.clustered {
                // A directory made under --nowsync is delegated to this
                // node from birth (see kv_deferred.rs); any other is not.
                match self.deferred.as_ref().is_some_and(|d| d.may_delegate()) {
                    true => txn.put(&schema::delegation(ino), self.node.as_bytes()),
                    false => txn.known_absent(&schema::delegation(ino)),
                }
            }
            // The new number's records that this create does not write are
            // absent: a node cache may answer for them (an unlink reads the
            // tier record, the kernel asks for ACLs) without a round trip.
            txn.known_absent(&schema::tier(ino));
            if is_dir {
                txn.known_empty(&schema::dentries_of(ino));
            }
            // Its xattrs are the ones written below (ACLs, replica policy):
            // the kernel's questions for others (security.capability before
            // a first write, `ls -l`'s) need no round trip.
            txn.known_empty(&schema::xattrs_of(ino));
            // A seal checks these: no lease was granted past the create's
            // and no batched layout is current.
            txn.known_absent(&schema::lease_epoch(ino));
            txn.known_absent(&schema::layout_commit(ino));
            if !node.unsealed {
                txn.known_absent(&schema::unsealed(ino));
            }
            if node.unsealed && node.kind == FileKind::Regular {
                txn.put(&schema::unsealed(ino), &crate::ops::layout::lease_mark(&self.node, crate::CREATE_LEASE));
            }
            if let Some(v) = &policy {
                txn.put(&schema::xattr(ino, REPLICAS_XATTR), v);
            }
            if let Some(a) = &access_acl {
                txn.put(&schema::xattr(ino, acl::ACCESS), &a.to_bytes());
            }
            if let (Some(d), true) = (&default_acl, is_dir) {
                txn.put(&schema::xattr(ino, acl::DEFAULT), d);
            }
            let Some(name) = name else {
                txn.put(&schema::orphan(ino), self.node.as_bytes());
                return Ok(inode);
            };
            put_dentry(txn, parent, name, &Dentry { ino, kind: node.kind });
            if is_dir {
                dir.nlink += 1;
            }
            dir.mtime = now;
            dir.ctime = now;
            put_inode(txn, &dir);
            Ok(inode)
        })
    }
}
