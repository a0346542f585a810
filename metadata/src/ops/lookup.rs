//! Read-only operations: lookup, getattr, readlink, readdir.

use crate::error::{MetaError, MetaResult};
use crate::namespace::{check_name, decode, get_dentry, get_inode, scan_all, Namespace};
use crate::schema;
use crate::types::{Dentry, Ino, Inode, NAME_MAX};

impl Namespace {
    pub fn lookup(&self, parent: Ino, name: &[u8]) -> MetaResult<Inode> {
        if name.len() > NAME_MAX {
            return Err(MetaError::NameTooLong);
        }
        self.read_in_dirs(|txn| {
            let dir = self.dir_in(txn, parent)?;
            if name == b"." {
                return Ok(dir);
            }
            if name == b".." {
                return get_inode(txn, dir.parent);
            }
            check_name(name)?;
            match get_dentry(txn, parent, name)? {
                Some(d) => get_inode(txn, d.ino),
                None => Err(MetaError::NotFound),
            }
        })
    }

    pub fn getattr(&self, ino: Ino) -> MetaResult<Inode> {
        self.read(|txn| get_inode(txn, ino))
    }

    /// Whether each of `inos` has an inode record, in one read past any
    /// node-local cache: on etcd one request per 128 inodes, where a
    /// `getattr` each asked once per inode (a mount's look over the backing
    /// files it holds: a read per file held, at every start).
    pub fn inodes_exist(&self, inos: &[Ino]) -> MetaResult<Vec<bool>> {
        let keys: Vec<Vec<u8>> = inos.iter().map(|ino| schema::inode(*ino)).collect();
        let found = self.kv.fresh_read_txn()?.get_many_versioned(&keys)?;
        Ok(found.into_iter().map(|(value, _)| value.is_some()).collect())
    }

    pub fn readlink(&self, ino: Ino) -> MetaResult<Vec<u8>> {
        let inode = self.getattr(ino)?;
        inode.target.ok_or(MetaError::Invalid("not a symlink"))
    }

    /// Every entry of a directory, ordered by name (without `.` and `..`).
    /// Read what a listing with attributes asks next of the `entries` of
    /// directory `parent` (names and their inodes) into the node's cache,
    /// in one request per 42 entries on a shared engine (a local one
    /// answers each at once anyway): each name, its inode's attributes,
    /// and its backfill record (an unlink reads it); and, in one more
    /// request, which xattrs each has. `readdirplus` then answers from
    /// memory, and so do `ls -l`'s stats and xattr reads (two a file) and
    /// `rm -r`'s unlinks, which would otherwise each go to etcd on a cold
    /// node.
    pub fn prefetch_entries(&self, parent: Ino, entries: &[(&[u8], Ino)]) -> MetaResult<()> {
        if !self.clustered || entries.is_empty() {
            return Ok(());
        }
        let keys: Vec<Vec<u8>> = entries
            .iter()
            .flat_map(|(name, ino)| [schema::dentry(parent, name), schema::inode(*ino), schema::tier(*ino)])
            .collect();
        let xattrs: Vec<Vec<u8>> = entries.iter().map(|(_, ino)| schema::xattrs_of(*ino)).collect();
        self.read(|txn| {
            txn.get_many_versioned(&keys)?;
            Ok(txn.list_ranges(&xattrs)?)
        })
    }

    pub fn readdir(&self, ino: Ino) -> MetaResult<Vec<(Vec<u8>, Dentry)>> {
        self.read_in_dirs(|txn| {
            self.dir_in(txn, ino)?;
            scan_all(txn, &schema::dentries_of(ino))?
                .into_iter()
                .map(|(k, v)| Ok((schema::dentry_name(&k).to_vec(), decode(&k, &v)?)))
                .collect()
        })
    }
}
