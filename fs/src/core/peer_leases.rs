//! Write leases other nodes hold, as the change feed last told this node:
//! what lets a peer's replica write be accepted without asking the
//! metadata store (see `Core::peer_may_write`).
//!
//! A writer pushes each chunk it seals to its peers, and a peer takes it
//! only from the holder of the file's write lease. Asked of etcd, that is
//! one read per chunk written, on the path of every close and fsync in the
//! cluster. The lease mark (`U` record) of a file reaches every node through
//! the change feed when it is taken, and its deletion when it is given up,
//! so most of those reads can be answered from memory.
//!
//! The map may lag the store, never lead it: a holder it does not know yet
//! (a lease taken a moment ago, before its feed event arrived) is asked of
//! the store, as before. A holder it still names after the lease moved on
//! lets that node write a version file here that no chunk record will name:
//! versions carry the writer's lease epoch, so such a file never replaces
//! the bytes of a version the layout records, and it is removed after its
//! grace period (`versions.rs`). The map holds one entry per file being
//! written anywhere in the cluster; a feed that restarted (changes may
//! have been missed) empties it.

use dashmap::DashMap;

use converged_metadata::schema::{change_of, Change};
use converged_metadata::types::Ino;

/// Owned by the core. Its shard locks are leaves, taken on the change
/// feed's thread (under the node cache's subscriber list) and by a peer's
/// write request, never across a call.
#[derive(Default)]
pub struct PeerLeases(DashMap<Ino, Box<str>>);

impl PeerLeases {
    /// Whether the feed last said that `node` holds the write lease of `ino`.
    pub fn holder_is(&self, ino: Ino, is: impl Fn(&str) -> bool) -> bool {
        self.0.get(&ino).is_some_and(|holder| is(holder.value()))
    }

    /// A change feed subscriber that keeps the map.
    pub fn feed(self: &std::sync::Arc<Self>) -> converged_metadata::ChangeFeed {
        let leases = self.clone();
        std::sync::Arc::new(move |key: &[u8], value: Option<&[u8]>| match change_of(key) {
            Change::Everything => leases.0.clear(),
            Change::FileState(ino) if converged_metadata::schema::is_unsealed(key) => {
                match value.and_then(|v| converged_metadata::lease_holder_of(key, v)) {
                    Some(holder) => {
                        leases.0.insert(ino, String::from_utf8_lossy(holder).into());
                    }
                    None => {
                        leases.0.remove(&ino);
                    }
                }
            }
            _ => {}
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use converged_metadata::schema;

    fn mark(node: &str, epoch: u64) -> Vec<u8> {
        [node.as_bytes(), b"\0", &epoch.to_be_bytes()[..]].concat()
    }

    #[test]
    fn the_feed_names_a_holder_until_the_lease_is_given_up_or_the_feed_restarts() {
        let leases = std::sync::Arc::new(PeerLeases::default());
        let feed = leases.feed();
        let is = |node: &'static str| move |h: &str| h == node;
        assert!(!leases.holder_is(7, is("n1")), "nothing heard yet");
        feed(&schema::unsealed(7), Some(&mark("n1", 3)));
        assert!(leases.holder_is(7, is("n1")));
        assert!(!leases.holder_is(7, is("n2")));
        assert!(!leases.holder_is(8, is("n1")));
        // Another node takes the lease over.
        feed(&schema::unsealed(7), Some(&mark("n2", 4)));
        assert!(!leases.holder_is(7, is("n1")));
        assert!(leases.holder_is(7, is("n2")));
        // Given up: nobody.
        feed(&schema::unsealed(7), None);
        assert!(!leases.holder_is(7, is("n2")));
        // Records of other kinds change nothing.
        feed(&schema::unsealed(9), Some(&mark("n1", 1)));
        feed(&schema::orphan(9), None);
        feed(&schema::inode(9), None);
        assert!(leases.holder_is(9, is("n1")));
        // A restarted feed may have missed the lease's end.
        feed(&[], None);
        assert!(!leases.holder_is(9, is("n1")));
    }
}
