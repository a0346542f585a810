//! setattr: chmod, chown, utimens and the metadata half of truncate.

use crate::acl;
use crate::error::{MetaError, MetaResult};
use crate::kv::{Durability, KvWrite};
use crate::namespace::{get_inode, put_inode, Namespace};
use crate::ops::layout::drop_chunks_from;
use crate::schema;
use crate::types::{FileKind, Ino, Inode, SetAttr, Timespec};

impl Namespace {
    /// Apply `attr`. A size change drops the layout records of chunks wholly
    /// past the new end; the caller re-seals the chunk that now ends early.
    pub fn setattr(&self, ino: Ino, attr: &SetAttr) -> MetaResult<Inode> {
        self.write(Durability::Buffered, |txn| {
            let mut inode = get_inode(txn, ino)?;
            let now = Timespec::now();
            if let Some(size) = attr.size {
                match inode.kind {
                    FileKind::Regular => {}
                    FileKind::Directory => return Err(MetaError::IsDir),
                    _ => return Err(MetaError::Invalid("truncate of a special file")),
                }
                if size < inode.size {
                    let keep = size.div_ceil(inode.chunk_size.max(1) as u64);
                    drop_chunks_from(txn, ino, keep)?;
                }
                inode.size = size;
                inode.mtime = now;
            }
            apply_attrs(txn, &mut inode, attr, now)?;
            put_inode(txn, &inode);
            Ok(inode)
        })
    }
}

/// Mode (and the access ACL that follows it), owner, group, times and
/// ctime of `attr` applied to `inode` (its size is the caller's): what a
/// setattr does, and what a seal does with the changes a writer's node held
/// back until its publish.
pub(crate) fn apply_attrs(
    txn: &mut (impl KvWrite + ?Sized),
    inode: &mut Inode,
    attr: &SetAttr,
    now: Timespec,
) -> MetaResult<()> {
    if attr.mode.is_some() {
        // An access ACL follows the mode (the kernel's posix_acl_chmod).
        let key = schema::xattr(inode.ino, acl::ACCESS);
        attr.apply_to(inode, now);
        if let Some(v) = txn.get(&key)? {
            let mut a = acl::Acl::parse(&v)?;
            a.chmod(inode.perm);
            txn.put(&key, &a.to_bytes());
        }
    } else {
        attr.apply_to(inode, now);
    }
    Ok(())
}

impl Namespace {
    /// A change of a file's bytes by someone without CAP_FSETID: set-user-ID
    /// goes, and set-group-ID when the file is group-executable or the
    /// caller is outside its group (the kernel's should_remove_suid; its
    /// FUSE side applies the group rule only to group-executable files).
    /// `member_of`: a group the caller was found to be in. One transaction;
    /// returns whether the mode changed.
    pub fn clear_setid(&self, ino: Ino, member_of: Option<u32>) -> MetaResult<bool> {
        self.write(Durability::Buffered, |txn| {
            let mut inode = get_inode(txn, ino)?;
            let (suid, sgid, xgrp) = (libc::S_ISUID as u16, libc::S_ISGID as u16, libc::S_IXGRP as u16);
            let mut perm = inode.perm & !suid;
            if perm & sgid != 0 && (perm & xgrp != 0 || member_of != Some(inode.gid)) {
                perm &= !sgid;
            }
            if perm == inode.perm {
                return Ok(false);
            }
            inode.perm = perm;
            inode.ctime = Timespec::now();
            put_inode(txn, &inode);
            Ok(true)
        })
    }
}

/// When a read updates atime (the mount's atime option).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AtimeRule {
    /// Never.
    Never,
    /// When atime is not after mtime or ctime, or is a day old (Linux's default).
    #[default]
    Relative,
    /// Every time.
    Always,
}

impl AtimeRule {
    /// Whether a read of `inode` at `now` updates its atime.
    pub fn due(self, inode: &Inode, now: Timespec) -> bool {
        match self {
            AtimeRule::Never => false,
            AtimeRule::Always => true,
            AtimeRule::Relative => {
                inode.atime <= inode.mtime || inode.atime <= inode.ctime || now.sec - inode.atime.sec >= 24 * 3600
            }
        }
    }
}

impl Namespace {
    /// A read of `ino`: set its atime to now if `rule` says so (ctime stays).
    /// Returns the inode when it changed. Buffered, as a local filesystem
    /// writes atime back lazily; the rule is checked again inside the
    /// transaction, so racing readers write it once.
    pub fn touch_atime(&self, ino: Ino, rule: AtimeRule) -> MetaResult<Option<Inode>> {
        let now = Timespec::now();
        self.write(Durability::Buffered, |txn| {
            let mut inode = get_inode(txn, ino)?;
            if !rule.due(&inode, now) {
                return Ok(None);
            }
            inode.atime = now;
            put_inode(txn, &inode);
            Ok(Some(inode))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relatime_updates_once_after_each_change_and_daily() {
        let t = |sec| Timespec { sec, nsec: 0 };
        let mut inode = Inode {
            ino: 2,
            kind: FileKind::Regular,
            perm: 0o644,
            uid: 0,
            gid: 0,
            nlink: 1,
            size: 0,
            atime: t(100),
            mtime: t(100),
            ctime: t(100),
            rdev: 0,
            parent: 1,
            name: b"f".to_vec(),
            chunk_size: 1 << 26,
            target: None,
        };
        assert!(AtimeRule::Relative.due(&inode, t(101)), "atime not after mtime");
        inode.atime = t(101);
        assert!(!AtimeRule::Relative.due(&inode, t(102)), "read again: no update");
        assert!(AtimeRule::Relative.due(&inode, t(101 + 24 * 3600)), "a day later");
        inode.mtime = t(105);
        assert!(AtimeRule::Relative.due(&inode, t(106)), "after a write");
        assert!(!AtimeRule::Never.due(&inode, t(106)));
        assert!(AtimeRule::Always.due(&Inode { atime: t(200), ..inode }, t(201)));
    }
}
