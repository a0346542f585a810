//! link: a second name for an existing inode.

use crate::error::{MetaError, MetaResult};
use crate::kv::Durability;
use crate::namespace::{check_name, get_dentry, get_dir, get_inode, put_dentry, put_inode, Namespace, LINK_MAX};
use crate::types::{Dentry, Ino, Inode, Timespec};

impl Namespace {
    pub fn link(&self, ino: Ino, newparent: Ino, newname: &[u8]) -> MetaResult<Inode> {
        check_name(newname)?;
        self.write(Durability::Buffered, |txn| {
            let mut inode = get_inode(txn, ino)?;
            if inode.is_dir() {
                return Err(MetaError::NotPermitted("hard link to a directory"));
            }
            if inode.nlink == 0 {
                return Err(MetaError::NotFound);
            }
            if inode.nlink >= LINK_MAX {
                return Err(MetaError::TooManyLinks);
            }
            let mut dir = get_dir(txn, newparent)?;
            if get_dentry(txn, newparent, newname)?.is_some() {
                return Err(MetaError::Exists);
            }
            let now = Timespec::now();
            inode.nlink += 1;
            inode.ctime = now;
            dir.mtime = now;
            dir.ctime = now;
            put_dentry(txn, newparent, newname, &Dentry { ino, kind: inode.kind });
            put_inode(txn, &inode);
            put_inode(txn, &dir);
            Ok(inode)
        })
    }
}
