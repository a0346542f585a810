//! rename, with RENAME_NOREPLACE, RENAME_EXCHANGE and RENAME_WHITEOUT, as one transaction.

use crate::error::{MetaError, MetaResult};
use crate::kv::{Durability, KvRead, KvWrite};
use crate::namespace::{check_name, dir_is_empty, get_dentry, get_inode, put_dentry, put_inode, Namespace};
use crate::ops::remove::{drop_link, Unlinked};
use crate::schema;
use crate::types::{Dentry, FileKind, Ino, Inode, RenameMode, RequestMark, Timespec, ROOT_INO};

/// True when `dir` is `ancestor` or lies below it.
fn is_within(txn: &mut (impl KvRead + ?Sized), mut dir: Ino, ancestor: Ino) -> MetaResult<bool> {
    // Bounded so a corrupt parent chain cannot loop forever.
    for _ in 0..4096 {
        if dir == ancestor {
            return Ok(true);
        }
        if dir == ROOT_INO {
            return Ok(false);
        }
        dir = get_inode(txn, dir)?.parent;
    }
    Err(MetaError::Corrupt { key: format!("I{dir}"), msg: "directory parent chain too deep".into() })
}

impl Namespace {
    /// Returns the inode that lost its last name by being replaced, if any.
    pub fn rename(
        &self,
        parent: Ino,
        name: &[u8],
        newparent: Ino,
        newname: &[u8],
        mode: RenameMode,
    ) -> MetaResult<Option<Unlinked>> {
        self.rename_answering(parent, name, newparent, newname, mode, None)
    }

    /// [`Namespace::rename`] for a kernel request, recorded with the
    /// change (see `ops/answered.rs`).
    pub fn rename_answering(
        &self,
        parent: Ino,
        name: &[u8],
        newparent: Ino,
        newname: &[u8],
        mode: RenameMode,
        request: Option<RequestMark>,
    ) -> MetaResult<Option<Unlinked>> {
        check_name(name)?;
        check_name(newname)?;
        self.write_answering(Durability::Buffered, request, |txn| {
            let victim = self.rename_in(txn, parent, name, newparent, newname, mode)?;
            self.answering(txn, request, 0);
            Ok(victim)
        })
    }

    /// RENAME_WHITEOUT (overlayfs's): the rename, and in the same
    /// transaction a whiteout (a character device 0:0, owned by `owner`)
    /// at the old name.
    #[allow(clippy::too_many_arguments)]
    pub fn rename_with_whiteout(
        &self,
        parent: Ino,
        name: &[u8],
        newparent: Ino,
        newname: &[u8],
        noreplace: bool,
        owner: (u32, u32),
        request: Option<RequestMark>,
    ) -> MetaResult<Option<Unlinked>> {
        check_name(name)?;
        check_name(newname)?;
        let ino = self.alloc_ino()?;
        let mode = if noreplace { RenameMode::NoReplace } else { RenameMode::Replace };
        self.write_answering(Durability::Buffered, request, |txn| {
            let victim = self.rename_in(txn, parent, name, newparent, newname, mode)?;
            self.answering(txn, request, 0);
            if get_dentry(txn, parent, name)?.is_some() {
                // Two names of one inode: nothing moved, nothing to white out.
                return Ok(victim);
            }
            let now = Timespec::now();
            let whiteout = Inode {
                ino,
                kind: FileKind::CharDevice,
                perm: 0,
                uid: owner.0,
                gid: owner.1,
                nlink: 1,
                size: 0,
                atime: now,
                mtime: now,
                ctime: now,
                rdev: 0,
                parent,
                name: name.to_vec(),
                chunk_size: 0,
                target: None,
            };
            put_inode(txn, &whiteout);
            put_dentry(txn, parent, name, &Dentry { ino, kind: FileKind::CharDevice });
            Ok(victim)
        })
    }

    fn rename_in(
        &self,
        txn: &mut dyn KvWrite,
        parent: Ino,
        name: &[u8],
        newparent: Ino,
        newname: &[u8],
        mode: RenameMode,
    ) -> MetaResult<Option<Unlinked>> {
        {
            self.dir_in(txn, parent)?;
            self.dir_in(txn, newparent)?;
            let src = get_dentry(txn, parent, name)?.ok_or(MetaError::NotFound)?;
            let dst = get_dentry(txn, newparent, newname)?;
            if parent == newparent && name == newname {
                return match (mode, dst) {
                    (RenameMode::NoReplace, _) => Err(MetaError::Exists),
                    _ => Ok(None),
                };
            }
            let now = Timespec::now();
            let mut src_inode = get_inode(txn, src.ino)?;
            if src_inode.is_dir() && newparent != parent && is_within(txn, newparent, src.ino)? {
                return Err(MetaError::Invalid("cannot move a directory below itself"));
            }

            if mode == RenameMode::Exchange {
                let dst = dst.ok_or(MetaError::NotFound)?;
                let mut dst_inode = get_inode(txn, dst.ino)?;
                if dst_inode.is_dir() && newparent != parent && is_within(txn, parent, dst.ino)? {
                    return Err(MetaError::Invalid("cannot move a directory below itself"));
                }
                put_dentry(txn, parent, name, &dst);
                put_dentry(txn, newparent, newname, &src);
                if parent != newparent && src_inode.is_dir() != dst_inode.is_dir() {
                    // One directory changes parent: move one link count across.
                    let (from, to) = if src_inode.is_dir() { (parent, newparent) } else { (newparent, parent) };
                    let mut f = get_inode(txn, from)?;
                    f.nlink -= 1;
                    put_inode(txn, &f);
                    let mut t = get_inode(txn, to)?;
                    t.nlink += 1;
                    put_inode(txn, &t);
                }
                (src_inode.parent, src_inode.name) = (newparent, newname.to_vec());
                (dst_inode.parent, dst_inode.name) = (parent, name.to_vec());
                self.note_rename(txn, &src_inode)?;
                self.note_rename(txn, &dst_inode)?;
                src_inode.ctime = now;
                dst_inode.ctime = now;
                put_inode(txn, &src_inode);
                put_inode(txn, &dst_inode);
                touch_parents(txn, parent, newparent, now)?;
                return Ok(None);
            }

            let mut victim = None;
            if let Some(dst) = dst {
                if mode == RenameMode::NoReplace {
                    return Err(MetaError::Exists);
                }
                if dst.ino == src.ino {
                    // Two names of one inode: POSIX says do nothing.
                    return Ok(None);
                }
                let dst_inode = get_inode(txn, dst.ino)?;
                match (src_inode.is_dir(), dst_inode.is_dir()) {
                    (true, false) => return Err(MetaError::NotDir),
                    (false, true) => return Err(MetaError::IsDir),
                    (true, true) => {
                        self.dir_in(txn, dst.ino)?;
                        if !dir_is_empty(txn, dst.ino)? {
                            return Err(MetaError::NotEmpty);
                        }
                        if self.clustered {
                            txn.delete(&schema::delegation(dst.ino));
                        }
                        let mut np = get_inode(txn, newparent)?;
                        np.nlink -= 1;
                        put_inode(txn, &np);
                    }
                    (false, false) => {}
                }
                txn.delete(&schema::dentry(newparent, newname));
                victim = Some(drop_link(txn, dst_inode, now, &self.node));
            }

            txn.delete(&schema::dentry(parent, name));
            put_dentry(txn, newparent, newname, &Dentry { ino: src.ino, kind: src.kind });
            if src_inode.is_dir() && parent != newparent {
                let mut op = get_inode(txn, parent)?;
                op.nlink -= 1;
                put_inode(txn, &op);
                let mut np = get_inode(txn, newparent)?;
                np.nlink += 1;
                put_inode(txn, &np);
            }
            (src_inode.parent, src_inode.name) = (newparent, newname.to_vec());
            self.note_rename(txn, &src_inode)?;
            src_inode.ctime = now;
            put_inode(txn, &src_inode);
            touch_parents(txn, parent, newparent, now)?;
            Ok(victim.filter(|v: &Unlinked| v.orphaned))
        }
    }
}

fn touch_parents(
    txn: &mut (impl crate::kv::KvWrite + ?Sized),
    parent: Ino,
    newparent: Ino,
    now: Timespec,
) -> MetaResult<()> {
    for p in [parent, newparent] {
        let mut d = get_inode(txn, p)?;
        d.mtime = now;
        d.ctime = now;
        put_inode(txn, &d);
        if parent == newparent {
            break;
        }
    }
    Ok(())
}
