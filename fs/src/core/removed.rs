//! Inodes that lost their last name on this node while the kernel may still
//! hold them: a process's working directory removed by another process, a
//! file held by an `O_PATH` descriptor. The kernel keeps such an inode until
//! it sends FORGET, and meanwhile may ask for its attributes: `chdir("..")`
//! from a removed working directory checks search permission on it, and with
//! attributes gone stale (the removal changed them) that is a GETATTR. ext4
//! answers with the inode's last attributes and a link count of 0; so does
//! this table, with what the removal left, once the records are purged.
//!
//! One DashMap, a leaf lock (a shard is held only to insert, read or remove
//! one entry). Inode numbers are never reused, so an entry the kernel never
//! forgets (a lost FORGET) is stale memory, never a wrong answer; the table
//! stops taking entries at [`CAP`], and then such a GETATTR is ENOENT again.

use converged_metadata::types::{Ino, Inode};
use dashmap::DashMap;

/// Entries kept at most. The kernel forgets a removed inode as soon as
/// nothing holds it, so the table holds about as many entries as there are
/// removed working directories and descriptors at one time.
const CAP: usize = 1 << 16;

#[derive(Default)]
pub(super) struct Removed {
    last: DashMap<Ino, Inode>,
}

impl Removed {
    /// `inode` (link count 0) lost its last name here.
    pub fn insert(&self, inode: Inode) {
        if self.last.len() < CAP {
            self.last.insert(inode.ino, inode);
        }
    }

    /// The attributes `ino` had when it lost its last name here, if the
    /// kernel has not forgotten it since.
    pub fn get(&self, ino: Ino) -> Option<Inode> {
        self.last.get(&ino).map(|i| i.clone())
    }

    /// The kernel dropped `ino`: nothing will ask for it again.
    pub fn forget(&self, ino: Ino) {
        self.last.remove(&ino);
    }
}
