//! Extended attributes: set, get, list, remove.

use crate::acl;
use crate::error::{MetaError, MetaResult};
use crate::kv::Durability;
use crate::namespace::{get_inode, put_inode, scan_all, Namespace};
use crate::schema;
use crate::types::{parse_replicas, FileKind, Ino, Timespec, XattrMode, REPLICAS_XATTR};

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

    /// Set a POSIX ACL (`system.posix_acl_access` or `_default`), refusing
    /// one the kernel would not accept. An access ACL sets the mode's rwx
    /// bits (the group class from its mask) and is kept only if the mode
    /// cannot say it all; `kill_sgid` (the caller is not in the file's
    /// group, nor privileged) clears set-group-ID, as the kernel asks.
    pub fn set_acl(&self, ino: Ino, name: &[u8], value: &[u8], kill_sgid: bool) -> MetaResult<()> {
        let a = acl::Acl::parse(value)?;
        self.write(Durability::Buffered, |txn| {
            let mut inode = get_inode(txn, ino)?;
            let key = schema::xattr(ino, name);
            if name == acl::ACCESS {
                inode.perm = (inode.perm & !0o777) | a.mode_bits();
                if kill_sgid {
                    inode.perm &= !(libc::S_ISGID as u16);
                }
                if a.is_mode() {
                    txn.delete(&key);
                } else {
                    txn.put(&key, value);
                }
            } else if name == acl::DEFAULT {
                if inode.kind != FileKind::Directory {
                    return Err(MetaError::Denied("a default ACL on a file that is not a directory"));
                }
                txn.put(&key, value);
            } else {
                return Err(MetaError::Invalid("not a POSIX ACL name"));
            }
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

/// The copy counts files ask for, read once per file during a scan of
/// chunk records (`status`, repair, rebalance). A policy that cannot be
/// read counts as `default`, and the first such error is kept for the
/// caller to report after the scan.
pub struct Policies<'a> {
    ns: &'a Namespace,
    default: u32,
    known: std::collections::HashMap<Ino, usize>,
    pub error: Option<MetaError>,
}

impl<'a> Policies<'a> {
    pub fn new(ns: &'a Namespace, default: u32) -> Self {
        Policies { ns, default, known: Default::default(), error: None }
    }

    /// Copies asked for the chunks of `ino` (at least 1).
    pub fn want(&mut self, ino: Ino) -> usize {
        if let Some(w) = self.known.get(&ino) {
            return *w;
        }
        let w = match self.ns.replicas_policy(ino) {
            Ok(p) => p.unwrap_or(self.default),
            Err(e) => {
                self.error.get_or_insert(e);
                self.default
            }
        }
        .max(1) as usize;
        self.known.insert(ino, w);
        w
    }

    /// The first error met, if any.
    pub fn finish(self) -> MetaResult<()> {
        self.error.map_or(Ok(()), Err)
    }
}
