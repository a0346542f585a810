//! unlink, rmdir and purge (dropping an inode whose last name and last open are gone).

use std::cell::Cell;

use crate::error::{MetaError, MetaResult};
use crate::kv::{Durability, KvWrite, Taken};
use crate::namespace::{check_name, dir_is_empty, get_dentry, get_inode, put_inode, scan_all, Namespace};
use crate::schema;
use crate::types::{Ino, Inode, RequestMark, Timespec};

/// What a purge of an orphan did.
#[derive(Clone, Copy)]
enum Purged {
    /// Nothing: the inode has a name again, or was gone at the first look.
    No,
    /// This commit removed its records (handed back on a shared engine).
    Here,
    /// Gone when a retry looked: perhaps purged by an attempt whose answer
    /// was lost, perhaps by another node.
    Unknown,
}

/// What an unlink left behind: the inode, and whether its last name is gone.
/// An inode with no names is an orphan until [`Namespace::purge`] drops it
/// (at once, or at last close when it is still open).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unlinked {
    pub ino: Ino,
    /// The inode as the removal left it (one name fewer, the new ctime): what
    /// a handle or a working directory on it still sees once it has no name.
    pub last: Inode,
    /// A directory (its orphan is kept only while a handle is open on it).
    pub dir: bool,
    pub orphaned: bool,
    /// The orphan was purged in the same transaction (it was not open).
    pub purged: bool,
    /// The nodes its purged chunk records named (on a shared engine, where
    /// other nodes hold chunks): whom to tell to remove their copies. Every
    /// node that ever registered when those records never came back (the
    /// purge's answer was lost); none when even that list could not be read
    /// (their sweeps remove the copies).
    pub holders: Vec<String>,
}

/// Drop one name of `inode` (already removed from its directory by the caller).
///
/// `node` marks a new orphan as this node's: the node that holds it open
/// purges it at last close, or at its next mount after a crash.
pub(crate) fn drop_link(txn: &mut (impl KvWrite + ?Sized), mut inode: Inode, now: Timespec, node: &str) -> Unlinked {
    let dir = inode.is_dir();
    // A directory has exactly one name: with it, it is an orphan (nlink 0),
    // kept as a file is while a handle is open on it (fstat on the handle
    // still answers), purged otherwise.
    inode.nlink = if dir { 0 } else { inode.nlink.saturating_sub(1) };
    inode.ctime = now;
    let orphaned = inode.nlink == 0;
    if orphaned {
        txn.put(&schema::orphan(inode.ino), node.as_bytes());
    }
    put_inode(txn, &inode);
    Unlinked { ino: inode.ino, dir, orphaned, purged: false, last: inode, holders: Vec::new() }
}

/// Delete every record of `ino` (its layout, xattrs, orphan and unsealed marks, the inode).
/// A backed object of the file is queued for deletion (`G` key).
/// With `layout`, the chunk records go into it as they are deleted (see
/// [`crate::ops::layout::holders_in`]).
fn purge_records(txn: &mut (impl KvWrite + ?Sized), ino: Ino, layout: Option<&[Taken; 2]>) -> MetaResult<()> {
    crate::ops::tier::discard(txn, ino)?;
    for (i, prefix) in [schema::chunks_of(ino), schema::pending_chunks_of(ino)].iter().enumerate() {
        let (start, end) = schema::prefix_range(prefix);
        match layout {
            Some(taken) => txn.delete_range_taking(&start, &end, &taken[i])?,
            None => txn.delete_range(&start, &end)?,
        }
    }
    let (start, end) = schema::prefix_range(&schema::xattrs_of(ino));
    txn.delete_range(&start, &end)?;
    txn.delete(&schema::inode(ino));
    txn.delete(&schema::orphan(ino));
    txn.delete(&schema::unsealed(ino));
    txn.delete(&schema::lease_epoch(ino));
    txn.delete(&schema::layout_commit(ino));
    txn.delete(&schema::sync_pending(ino));
    txn.delete(&schema::sync_pending_before(ino));
    Ok(())
}

impl Namespace {
    pub fn unlink(&self, parent: Ino, name: &[u8]) -> MetaResult<Unlinked> {
        self.unlink_purging(parent, name, &|_| false, None)
    }

    /// Unlink, and when that removes the last name of an inode for which
    /// `can_purge` says yes (it is not open), purge it in the same
    /// transaction: one commit per unlink instead of two. On a shared
    /// engine the purged chunk records come back with the commit (etcd
    /// returns what a range delete removed), so the nodes holding copies
    /// are known without a read before it. `request`: the kernel request
    /// it is made for, recorded with it (see `ops/answered.rs`).
    pub fn unlink_purging(
        &self,
        parent: Ino,
        name: &[u8],
        can_purge: &dyn Fn(Ino) -> bool,
        request: Option<RequestMark>,
    ) -> MetaResult<Unlinked> {
        check_name(name)?;
        let shared = self.clustered;
        let taken: [Taken; 2] = Default::default();
        let unanswered = Cell::new(false);
        let mut gone = self.write_answering_noting(Durability::Buffered, request, Some(&unanswered), |txn| {
            let mut dir = self.dir_in(txn, parent)?;
            let d = get_dentry(txn, parent, name)?.ok_or(MetaError::NotFound)?;
            let inode = get_inode(txn, d.ino)?;
            if inode.is_dir() {
                return Err(MetaError::IsDir);
            }
            let now = Timespec::now();
            txn.delete(&schema::dentry(parent, name));
            dir.mtime = now;
            dir.ctime = now;
            put_inode(txn, &dir);
            let mut gone = drop_link(txn, inode, now, &self.node);
            if gone.orphaned && can_purge(gone.ino) {
                purge_records(txn, gone.ino, shared.then_some(&taken))?;
                gone.purged = true;
            }
            self.answering(txn, request, gone.ino);
            Ok(gone)
        })?;
        if gone.purged && shared {
            if !unanswered.get() {
                gone.holders = crate::ops::layout::holders_in(&[&taken[0], &taken[1]])?;
                self.queue_unindex_purged(gone.ino, &[&taken[0], &taken[1]])?;
            } else {
                // An earlier attempt landed and lost its answer, and with
                // it the records its range deletes removed: every node
                // that could hold a copy is told. (The holder index
                // entries are left to its readers, which drop stale ones.)
                gone.holders = self.every_known_node_or_none(gone.ino);
            }
        }
        Ok(gone)
    }

    pub fn rmdir(&self, parent: Ino, name: &[u8]) -> MetaResult<()> {
        self.rmdir_purging(parent, name, &|_| true, None).map(|_| ())
    }

    /// Remove an empty directory; when `can_purge` says so (no handle is
    /// open on it), its records go in the same transaction, else it is left
    /// an orphan for the last `releasedir` to purge. `request`: as for
    /// [`Namespace::unlink_purging`].
    pub fn rmdir_purging(
        &self,
        parent: Ino,
        name: &[u8],
        can_purge: &dyn Fn(Ino) -> bool,
        request: Option<RequestMark>,
    ) -> MetaResult<Unlinked> {
        if name == b"." {
            return Err(MetaError::Invalid("rmdir of ."));
        }
        if name == b".." {
            return Err(MetaError::NotEmpty);
        }
        check_name(name)?;
        self.write_answering(Durability::Buffered, request, |txn| {
            let mut dir = self.dir_in(txn, parent)?;
            let d = get_dentry(txn, parent, name)?.ok_or(MetaError::NotFound)?;
            let inode = get_inode(txn, d.ino)?;
            if !inode.is_dir() {
                return Err(MetaError::NotDir);
            }
            // Names another node may hold uncommitted count too.
            self.dir_in(txn, inode.ino)?;
            if !dir_is_empty(txn, inode.ino)? {
                return Err(MetaError::NotEmpty);
            }
            let now = Timespec::now();
            txn.delete(&schema::dentry(parent, name));
            if self.clustered {
                txn.delete(&schema::delegation(inode.ino));
            }
            let (start, end) = schema::prefix_range(&schema::xattrs_of(inode.ino));
            txn.delete_range(&start, &end)?;
            // Empty: no object below it is left to re-key.
            txn.delete(&schema::renamed_dir(inode.ino));
            let mut gone = drop_link(txn, inode, now, &self.node);
            if can_purge(gone.ino) {
                purge_records(txn, gone.ino, None)?;
                gone.purged = true;
            }
            dir.nlink -= 1;
            dir.mtime = now;
            dir.ctime = now;
            put_inode(txn, &dir);
            self.answering(txn, request, gone.ino);
            Ok(gone)
        })
    }

    /// Remove an orphan's records (inode, layout, xattrs). Returns false and
    /// does nothing when the inode got a name back or was gone at the first
    /// look (gone at a retry, it counts as purged: see
    /// [`Namespace::purge_orphan`]).
    pub fn purge(&self, ino: Ino) -> MetaResult<bool> {
        Ok(self.purge_orphan(ino)?.is_some())
    }

    /// [`Namespace::purge`], returning, when it purged, the nodes the
    /// removed chunk records named (on a shared engine; see
    /// [`Namespace::unlink_purging`]).
    pub fn purge_orphan(&self, ino: Ino) -> MetaResult<Option<Vec<String>>> {
        let shared = self.clustered;
        let taken: [Taken; 2] = Default::default();
        let attempts = Cell::new(0u32);
        let purged = self.write(Durability::Buffered, |txn| {
            attempts.set(attempts.get() + 1);
            let inode = match get_inode(txn, ino) {
                Ok(i) => i,
                Err(MetaError::NotFound) => {
                    txn.delete(&schema::orphan(ino));
                    txn.delete(&schema::unsealed(ino));
                    // Gone at a retry: the attempt before may have purged
                    // it and lost its answer (or another node purged it
                    // meanwhile): purged, by whom and of what is unknown.
                    return Ok(if attempts.get() > 1 { Purged::Unknown } else { Purged::No });
                }
                Err(e) => return Err(e),
            };
            if inode.nlink > 0 {
                txn.delete(&schema::orphan(ino));
                return Ok(Purged::No);
            }
            purge_records(txn, ino, shared.then_some(&taken))?;
            Ok(Purged::Here)
        })?;
        match (purged, shared) {
            (Purged::No, _) => Ok(None),
            (_, false) => Ok(Some(Vec::new())),
            (Purged::Here, true) => {
                self.queue_unindex_purged(ino, &[&taken[0], &taken[1]])?;
                Ok(Some(crate::ops::layout::holders_in(&[&taken[0], &taken[1]])?))
            }
            // Every node that could hold a copy is told (see `unlink_purging`).
            (Purged::Unknown, true) => Ok(Some(self.every_known_node_or_none(ino))),
        }
    }

    /// Every node that registered in the volume once: whom to tell to remove
    /// the copies of a purged inode when the records naming its holders
    /// never came back (the purge's commit landed, its answer lost).
    /// The purge is made: a failure to read the list (likely just after a
    /// lost answer) leaves the copies to the holders' sweeps, and the
    /// removal still succeeds.
    fn every_known_node_or_none(&self, ino: Ino) -> Vec<String> {
        let known = self.read(|txn| {
            Ok(scan_all(txn, schema::KNOWN_NODES)?
                .into_iter()
                .filter_map(|(k, _)| String::from_utf8(k[schema::KNOWN_NODES.len()..].to_vec()).ok())
                .collect())
        });
        known.unwrap_or_else(|e| {
            tracing::warn!(ino, error = %e, "purged, but the nodes to tell could not be read; their sweeps remove the copies");
            Vec::new()
        })
    }

    /// Inodes left with no name while open on this node (a crash before last close).
    pub fn orphans(&self) -> MetaResult<Vec<Ino>> {
        self.read(|txn| {
            Ok(scan_all(txn, &schema::orphans())?
                .iter()
                .filter(|(_, v)| self.is_mine(v))
                .map(|(k, _)| schema::key_ino(k))
                .collect())
        })
    }
}
