//! setattr: chmod, chown, utimens and the metadata half of truncate.

use crate::error::{MetaError, MetaResult};
use crate::kv::Durability;
use crate::namespace::{get_inode, put_inode, Namespace};
use crate::ops::layout::drop_chunks_from;
use crate::types::{FileKind, Ino, Inode, SetAttr, TimeSet, Timespec};

impl Namespace {
    /// Apply `attr`. A size change drops the layout records of chunks wholly
    /// past the new end; the caller re-seals the chunk that now ends early.
    pub fn setattr(&self, ino: Ino, attr: &SetAttr) -> MetaResult<Inode> {
        self.write(Durability::Buffered, |txn| {
            let mut inode = get_inode(txn, ino)?;
            let now = Timespec::now();
            if let Some(mode) = attr.mode {
                inode.perm = (mode & 0o7777) as u16;
            }
            if let Some(uid) = attr.uid {
                inode.uid = uid;
            }
            if let Some(gid) = attr.gid {
                inode.gid = gid;
            }
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
            let resolve = |t: TimeSet| match t {
                TimeSet::Now => now,
                TimeSet::At(ts) => ts,
            };
            if let Some(t) = attr.atime {
                inode.atime = resolve(t);
            }
            if let Some(t) = attr.mtime {
                inode.mtime = resolve(t);
            }
            inode.ctime = attr.ctime.unwrap_or(now);
            put_inode(txn, &inode);
            Ok(inode)
        })
    }
}
