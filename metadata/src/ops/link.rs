//! link: a second name for an existing inode, or the first for a tmpfile.

use crate::error::{MetaError, MetaResult};
use crate::kv::Durability;
use crate::namespace::{check_name, get_dentry, get_inode, put_dentry, put_inode, Namespace, LINK_MAX};
use crate::schema;
use crate::types::{Dentry, Ino, Inode, RequestMark, Timespec};

impl Namespace {
    pub fn link(&self, ino: Ino, newparent: Ino, newname: &[u8]) -> MetaResult<Inode> {
        self.link_answering(ino, newparent, newname, None)
    }

    /// [`Namespace::link`] for a kernel request, recorded with the change
    /// (see `ops/answered.rs`).
    pub fn link_answering(
        &self,
        ino: Ino,
        newparent: Ino,
        newname: &[u8],
        request: Option<RequestMark>,
    ) -> MetaResult<Inode> {
        check_name(newname)?;
        self.write_answering(Durability::Buffered, request, |txn| {
            let mut inode = get_inode(txn, ino)?;
            if inode.is_dir() {
                return Err(MetaError::NotPermitted("hard link to a directory"));
            }
            // An orphan gets no name back (the kernel allows `linkat` of an
            // open file only for O_TMPFILE ones), except a tmpfile never
            // linked (its name empty): it becomes a file like any other,
            // its orphan mark gone in the same transaction.
            let tmpfile = inode.nlink == 0 && inode.name.is_empty();
            if inode.nlink == 0 && !tmpfile {
                return Err(MetaError::NotFound);
            }
            if inode.nlink >= LINK_MAX {
                return Err(MetaError::TooManyLinks);
            }
            let mut dir = self.dir_in(txn, newparent)?;
            if get_dentry(txn, newparent, newname)?.is_some() {
                return Err(MetaError::Exists);
            }
            let now = Timespec::now();
            inode.nlink += 1;
            inode.ctime = now;
            if tmpfile {
                // Its path from now on (the object key of its backfill).
                inode.parent = newparent;
                inode.name = newname.to_vec();
                txn.delete(&schema::orphan(ino));
            }
            dir.mtime = now;
            dir.ctime = now;
            put_dentry(txn, newparent, newname, &Dentry { ino, kind: inode.kind });
            put_inode(txn, &inode);
            put_inode(txn, &dir);
            self.answering(txn, request, ino);
            Ok(inode)
        })
    }
}
