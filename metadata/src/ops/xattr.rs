//! Extended attributes: set, get, list, remove.

use crate::error::{MetaError, MetaResult};
use crate::kv::Durability;
use crate::namespace::{get_inode, put_inode, scan_all, Namespace};
use crate::schema;
use crate::types::{parse_replicas, Ino, Timespec, XattrMode, REPLICAS_XATTR};

/// Limits as on Linux: XATTR_NAME_MAX and XATTR_SIZE_MAX.
pub const XATTR_NAME_MAX: usize = 255;
pub const XATTR_SIZE_MAX: usize = 65536;

impl Namespace {
    pub fn setxattr(&self, ino: Ino, name: &[u8], value: &[u8], mode: XattrMode) -> MetaResult<()> {
        if name.is_empty() || name.len() > XATTR_NAME_MAX {
            return Err(if name.is_empty() { MetaError::Invalid("empty xattr name") } else { MetaError::XattrTooBig });
        }
        if value.len() > XATTR_SIZE_MAX {
            return Err(MetaError::XattrTooBig);
        }
        if name == REPLICAS_XATTR && parse_replicas(value).is_none() {
            return Err(MetaError::Invalid("user.converged.replicas must be a count from 1 to 8"));
        }
        self.write(Durability::Buffered, |txn| {
            let mut inode = get_inode(txn, ino)?;
            let key = schema::xattr(ino, name);
            let exists = txn.get(&key)?.is_some();
            match (mode, exists) {
                (XattrMode::Create, true) => return Err(MetaError::Exists),
                (XattrMode::Replace, false) => return Err(MetaError::NoAttr),
                _ => {}
            }
            txn.put(&key, value);
            inode.ctime = Timespec::now();
            put_inode(txn, &inode);
            Ok(())
        })
    }

    pub fn getxattr(&self, ino: Ino, name: &[u8]) -> MetaResult<Vec<u8>> {
        self.read(|txn| {
            get_inode(txn, ino)?;
            txn.get(&schema::xattr(ino, name))?.ok_or(MetaError::NoAttr)
        })
    }

    /// Names, each followed by a NUL, as listxattr(2) returns them.
    pub fn listxattr(&self, ino: Ino) -> MetaResult<Vec<u8>> {
        self.read(|txn| {
            get_inode(txn, ino)?;
            let mut out = Vec::new();
            for (k, _) in scan_all(txn, &schema::xattrs_of(ino))? {
                out.extend_from_slice(schema::xattr_name(&k));
                out.push(0);
            }
            Ok(out)
        })
    }

    /// The replica count asked for `ino` by its `user.converged.replicas`
    /// policy, if it has one.
    pub fn replicas_policy(&self, ino: Ino) -> MetaResult<Option<u32>> {
        self.read(|txn| Ok(txn.get(&schema::xattr(ino, REPLICAS_XATTR))?.and_then(|v| parse_replicas(&v))))
    }

    pub fn removexattr(&self, ino: Ino, name: &[u8]) -> MetaResult<()> {
        self.write(Durability::Buffered, |txn| {
            let mut inode = get_inode(txn, ino)?;
            let key = schema::xattr(ino, name);
            if txn.get(&key)?.is_none() {
                return Err(MetaError::NoAttr);
            }
            txn.delete(&key);
            inode.ctime = Timespec::now();
            put_inode(txn, &inode);
            Ok(())
        })
    }
}
