//! The transactional key-value contract every metadata engine implements.
//!
//! This module knows no backend: engines live in their own modules (`MemKv`,
//! `RedbKv`, later `EtcdKv`) and are picked by [`crate::open_engine`] from a URI.

pub use crate::error::{KvError, KvResult};

/// Writes a transaction has buffered until commit (`None`: a delete). Every
/// engine keeps them this way and reads through them.
pub(crate) type PendingWrites = std::collections::BTreeMap<Vec<u8>, Option<Vec<u8>>>;

fn pending_in<'a>(
    pending: &'a PendingWrites,
    start: &[u8],
    end: &[u8],
) -> impl Iterator<Item = (&'a Vec<u8>, &'a Option<Vec<u8>>)> {
    use std::ops::Bound;
    pending.range::<[u8], _>((Bound::Included(start), Bound::Excluded(end)))
}

/// How many pending deletes fall in `[start, end)`: a scan must fetch that
/// many more rows from the engine to still return `limit` after merging.
pub(crate) fn pending_deletes(pending: &PendingWrites, start: &[u8], end: &[u8]) -> usize {
    pending_in(pending, start, end).filter(|(_, v)| v.is_none()).count()
}

/// The engine's rows of `[start, end)` with the pending writes laid over
/// them, in key order, at most `limit`.
pub(crate) fn merge_pending(
    base: impl IntoIterator<Item = (Vec<u8>, Vec<u8>)>,
    pending: &PendingWrites,
    start: &[u8],
    end: &[u8],
    limit: usize,
) -> Vec<(Vec<u8>, Vec<u8>)> {
    let mut merged: std::collections::BTreeMap<Vec<u8>, Vec<u8>> = base.into_iter().collect();
    for (k, v) in pending_in(pending, start, end) {
        match v {
            Some(v) => merged.insert(k.clone(), v.clone()),
            None => merged.remove(k),
        };
    }
    merged.into_iter().take(limit).collect()
}

/// How durable a commit must be before it returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// Atomic and ordered, but may be lost in a power failure until the next
    /// durable commit or [`KvEngine::sync`] (the page-cache contract of a local fs).
    Buffered,
    /// On stable storage when `commit` returns (what fsync needs).
    Durable,
}

/// A value with the version an engine that versions its keys gave it (etcd:
/// its mod revision, 0 when absent), and the engine revision it was read
/// at: a cache keeps what it learned last.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Versioned {
    pub value: Option<Vec<u8>>,
    pub version: i64,
    pub at: i64,
}

/// A consistent read view.
pub trait KvRead {
    fn get(&mut self, key: &[u8]) -> KvResult<Option<Vec<u8>>>;
    /// `get`, with the key's version where the engine versions its keys
    /// (`None` otherwise: then nothing may be cached by version).
    fn get_versioned(&mut self, key: &[u8]) -> KvResult<(Option<Vec<u8>>, Option<Versioned>)> {
        Ok((self.get(key)?, None))
    }
    /// Keys in `[start, end)`, in order, at most `limit` of them.
    fn scan(&mut self, start: &[u8], end: &[u8], limit: usize) -> KvResult<Vec<(Vec<u8>, Vec<u8>)>>;
    /// [`KvRead::get_versioned`] of each of `keys`, in order: in as few
    /// requests as the engine allows (etcd: one transaction of reads per
    /// 128 keys), where a remote engine would otherwise be asked once per key.
    fn get_many_versioned(&mut self, keys: &[Vec<u8>]) -> KvResult<Vec<Found>> {
        keys.iter().map(|k| self.get_versioned(k)).collect()
    }
    /// [`KvRead::scan`] of each of `ranges`, in order, at most `limit`
    /// keys each: in as few requests as the engine allows (etcd: one
    /// transaction of range reads per 128 ranges).
    fn scan_many(&mut self, ranges: &[(Vec<u8>, Vec<u8>)], limit: usize) -> KvResult<Vec<Pairs>> {
        ranges.iter().map(|(s, e)| self.scan(s, e, limit)).collect()
    }
    /// Have a node-local cache in front of the engine learn every key of
    /// each range the `prefixes` name (an inode's xattrs), all in as few
    /// requests as the engine allows: a later read of a key there is then
    /// answered from memory, present or absent. Where nothing caches, it
    /// does nothing.
    fn list_ranges(&mut self, _prefixes: &[Vec<u8>]) -> KvResult<()> {
        Ok(())
    }
}

/// Keys and values, in key order.
pub type Pairs = Vec<(Vec<u8>, Vec<u8>)>;

/// A record as [`KvRead::get_versioned`] finds it: its value, and its
/// version where the engine has versions.
pub type Found = (Option<Vec<u8>>, Option<Versioned>);

/// The records a range delete removed ([`KvWrite::delete_range_taking`]).
pub type Taken = std::sync::Arc<parking_lot::Mutex<Vec<(Vec<u8>, Vec<u8>)>>>;

/// A read-write transaction. Writes are invisible to others until `commit`;
/// dropping it without commit aborts.
pub trait KvWrite: KvRead {
    fn put(&mut self, key: &[u8], value: &[u8]);
    fn delete(&mut self, key: &[u8]);
    /// Delete every key in `[start, end)`. One operation for engines that
    /// limit operations per transaction (etcd); the default deletes key by key.
    fn delete_range(&mut self, start: &[u8], end: &[u8]) -> KvResult<()> {
        for (k, _) in self.scan(start, end, usize::MAX)? {
            self.delete(&k);
        }
        Ok(())
    }
    /// Delete every key in `[start, end)`, as [`KvWrite::delete_range`]
    /// does, and leave in `into` the records the range held, once the
    /// commit succeeds: what a removal needs to know of what it removed
    /// (the holders of a purged file's chunks). The default reads the range
    /// in this transaction first; etcd hands the records back with the
    /// delete itself, so the commit stays one round trip.
    fn delete_range_taking(&mut self, start: &[u8], end: &[u8], into: &Taken) -> KvResult<()> {
        *into.lock() = self.scan(start, end, usize::MAX >> 1)?;
        self.delete_range(start, end)
    }
    fn commit(self: Box<Self>, durability: Durability) -> KvResult<()>;
    /// Take `version` of `key` as read by this transaction without asking
    /// the engine (a node's cache knows it): the commit then succeeds only
    /// if the key still has that version, exactly as if it had been read.
    /// Returns false when the engine has no versions (then read instead).
    fn assume(&mut self, key: &[u8], version: i64) -> bool {
        let _ = (key, version);
        false
    }
    /// `key` is absent and this transaction knows it without reading it
    /// (a record of the inode it creates, whose number is new): a cache in
    /// front of the engine may remember that once the commit lands.
    fn known_absent(&mut self, key: &[u8]) {
        let _ = key;
    }
    /// The range under `prefix` is empty and this transaction knows it
    /// (the entries of a directory it makes, the xattrs of an inode it
    /// makes, but for what it writes there): a cache may remember that.
    fn known_empty(&mut self, prefix: &[u8]) {
        let _ = prefix;
    }
    /// `ino` is a new inode's number and this transaction makes it: no
    /// other node can know it yet, so its records are this node's alone
    /// until the commit that makes it reachable (see `kv_deferred.rs`).
    fn new_inode(&mut self, ino: u64) {
        let _ = ino;
    }
    /// Leave what this transaction's commit writes unsettled in `scope`
    /// when its answer is lost (see [`KvEngine::unsettled_scope`]).
    fn settle_in(&mut self, scope: &std::sync::Arc<crate::kv_cache::UnsettledScope>) {
        let _ = scope;
    }
    /// `commit`, returning the engine revision the writes took, where the
    /// engine has revisions (what a cache in front of it records them at).
    fn commit_at(self: Box<Self>, durability: Durability) -> KvResult<Option<i64>> {
        self.commit(durability).map(|()| None)
    }
}

/// A metadata engine. Implementations must give serializable transactions:
/// either by running writers one at a time (redb) or by failing a commit
/// whose reads went stale with [`KvError::Conflict`] (etcd).
pub trait KvEngine: Send + Sync + 'static {
    /// The engine's name, for logs and `status`.
    fn name(&self) -> &'static str;
    fn read_txn(&self) -> KvResult<Box<dyn KvRead + '_>>;
    /// The most operations one write transaction may carry, when the
    /// engine has a limit (etcd's `--max-txn-ops`, 128 by default). Larger
    /// changes (a layout of hundreds of chunks) are written in batches and
    /// made current by one small transaction at the end.
    fn txn_limit(&self) -> Option<usize> {
        None
    }
    /// A read transaction on the engine itself, past any node-local cache
    /// in front of it: what another node committed before it started is
    /// seen. A cache refreshes itself from what it reads.
    fn fresh_read_txn(&self) -> KvResult<Box<dyn KvRead + '_>> {
        self.read_txn()
    }
    fn write_txn(&self) -> KvResult<Box<dyn KvWrite + '_>>;
    /// Make every commit so far durable.
    fn sync(&self) -> KvResult<()>;
    /// Leases and membership, where the engine has them (etcd); an
    /// embedded engine serves a single node and has none.
    fn membership(&self) -> Option<&dyn crate::membership::Membership> {
        None
    }
    /// A scope for the commits of one call (a namespace operation and the
    /// attempts it makes again), given to each of its transactions
    /// ([`KvWrite::settle_in`]). What a commit whose answer was lost writes
    /// stays unsettled until the scope drops: the commit may land after a
    /// read of those keys, so a node cache neither keeps what such a read
    /// says nor answers them from memory until the call knows what became
    /// of its change (found it made, made it again, or failed). `None`: the
    /// engine keeps no node cache.
    fn unsettled_scope(&self) -> Option<std::sync::Arc<crate::kv_cache::UnsettledScope>> {
        None
    }
    /// Whatever this node keeps of the records under each of `prefixes`
    /// (a cache in front of the engine) is stale where it was learned at a
    /// revision before `rev`: another node committed there through a path
    /// the change feed may not have reported yet (a delegation it gave up
    /// on this node's request, see `kv_deferred.rs`).
    fn forget_below(&self, prefixes: &[Vec<u8>], rev: i64) {
        let _ = (prefixes, rev);
    }
    /// Call `on_change` with the key of every change other clients commit,
    /// and the value it now holds (`None`: deleted), soon after they commit
    /// it; an empty key means changes may have been missed (the feed
    /// reconnected) and every cached key is suspect. The empty key's value
    /// is `Some` when they were missed for good (the feed started from the
    /// present), `None` when the feed resumes where it stopped and will
    /// deliver them late.
    /// Returns false when the engine has no such feed: an embedded engine
    /// has no other clients.
    fn watch(&self, on_change: ChangeFeed) -> KvResult<bool> {
        let _ = on_change;
        Ok(false)
    }
    /// [`KvEngine::watch`], each change with the revision it committed at
    /// (what a node cache needs to keep a record it holds current instead
    /// of dropping it). An engine that does not know it says 0.
    fn watch_revisions(&self, on_change: RevisionFeed) -> KvResult<bool> {
        self.watch(std::sync::Arc::new(move |key: &[u8], value: Option<&[u8]>| on_change(key, value, 0)))
    }
}

/// A subscriber to [`KvEngine::watch`].
pub type ChangeFeed = std::sync::Arc<dyn Fn(&[u8], Option<&[u8]>) + Send + Sync>;

/// A subscriber to [`KvEngine::watch_revisions`]: a change's key, the value
/// it now holds (`None`: deleted) and its revision (0: not known).
pub type RevisionFeed = std::sync::Arc<dyn Fn(&[u8], Option<&[u8]>, i64) + Send + Sync>;
