//! `CachedKv`: a node-local read cache of inode, dentry and xattr records in front
//! of a shared engine (etcd), kept honest by the engine's change feed.
//!
//! Read-only lookups and getattrs are served from memory; read-write
//! transactions always go to the engine (their conflict checks need it) and
//! drop what they wrote from the cache when they commit. A change made by
//! another node reaches this cache through [`KvEngine::watch`] and evicts the
//! key; a fill that raced with an eviction is not kept. Entries also expire
//! after [`CACHE_TTL`], a bound on staleness should the feed break.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use crate::kv::{ChangeFeed, Durability, KvEngine, KvRead, KvResult, KvWrite};

/// Longest an entry lives without an eviction from the change feed.
pub const CACHE_TTL: Duration = Duration::from_secs(10);
const CAPACITY: u64 = 1 << 20;

type Cache = moka::sync::Cache<Vec<u8>, Option<Arc<Vec<u8>>>>;

pub struct CachedKv {
    inner: Arc<dyn KvEngine>,
    cache: Cache,
    /// Bumped by every eviction: a read that saw it change does not fill.
    epoch: Arc<AtomicU64>,
    subscribers: Arc<Mutex<Vec<ChangeFeed>>>,
}

/// Only inode (`I`), dentry (`D`), xattr (`X`) and tier (`T`) records are
/// cached: they are what lookup, getattr, getxattr, a create's replica
/// policy and an import's freshness check read.
fn cacheable(key: &[u8]) -> bool {
    matches!(key.first(), Some(b'I' | b'D' | b'X' | b'T'))
}

impl CachedKv {
    /// Wrap `inner`; returns `inner` unchanged (no cache) when it has no
    /// change feed, since a cache without one could serve stale records.
    pub fn wrap(inner: Arc<dyn KvEngine>) -> KvResult<Arc<dyn KvEngine>> {
        let cache: Cache = moka::sync::Cache::builder().max_capacity(CAPACITY).time_to_live(CACHE_TTL).build();
        let epoch = Arc::new(AtomicU64::new(0));
        let subscribers: Arc<Mutex<Vec<ChangeFeed>>> = Arc::default();
        let feed: ChangeFeed = {
            let (cache, epoch, subscribers) = (cache.clone(), epoch.clone(), subscribers.clone());
            Arc::new(move |key: &[u8]| {
                epoch.fetch_add(1, Ordering::AcqRel);
                if key.is_empty() {
                    cache.invalidate_all();
                } else if cacheable(key) {
                    cache.invalidate(key);
                }
                for s in subscribers.lock().iter() {
                    s(key);
                }
            })
        };
        if !inner.watch(feed)? {
            return Ok(inner);
        }
        Ok(Arc::new(CachedKv { inner, cache, epoch, subscribers }))
    }
}

struct CachedRead<'a> {
    kv: &'a CachedKv,
    inner: Box<dyn KvRead + 'a>,
    /// Read past the cache (and refill it): a close-to-open read.
    fresh: bool,
}

impl KvRead for CachedRead<'_> {
    fn get(&mut self, key: &[u8]) -> KvResult<Option<Vec<u8>>> {
        if !cacheable(key) {
            return self.inner.get(key);
        }
        if !self.fresh {
            if let Some(v) = self.kv.cache.get(key) {
                return Ok(v.map(|v| v.as_ref().clone()));
            }
        }
        let before = self.kv.epoch.load(Ordering::Acquire);
        let v = self.inner.get(key)?;
        if self.kv.epoch.load(Ordering::Acquire) == before {
            self.kv.cache.insert(key.to_vec(), v.clone().map(Arc::new));
        }
        Ok(v)
    }
    fn scan(&mut self, start: &[u8], end: &[u8], limit: usize) -> KvResult<Vec<(Vec<u8>, Vec<u8>)>> {
        self.inner.scan(start, end, limit)
    }
}

struct CachedWrite<'a> {
    kv: &'a CachedKv,
    inner: Box<dyn KvWrite + 'a>,
    written: Vec<Vec<u8>>,
    ranges: bool,
}

impl KvRead for CachedWrite<'_> {
    fn get(&mut self, key: &[u8]) -> KvResult<Option<Vec<u8>>> {
        self.inner.get(key)
    }
    fn scan(&mut self, start: &[u8], end: &[u8], limit: usize) -> KvResult<Vec<(Vec<u8>, Vec<u8>)>> {
        self.inner.scan(start, end, limit)
    }
}

impl KvWrite for CachedWrite<'_> {
    fn put(&mut self, key: &[u8], value: &[u8]) {
        if cacheable(key) {
            self.written.push(key.to_vec());
        }
        self.inner.put(key, value);
    }
    fn delete(&mut self, key: &[u8]) {
        if cacheable(key) {
            self.written.push(key.to_vec());
        }
        self.inner.delete(key);
    }
    fn delete_range(&mut self, start: &[u8], end: &[u8]) -> KvResult<()> {
        // Ranges only cover layouts and xattrs today; a cached prefix in one
        // would need every key evicted.
        self.ranges |= cacheable(start) || cacheable(end);
        self.inner.delete_range(start, end)
    }
    fn commit(self: Box<Self>, durability: Durability) -> KvResult<()> {
        let this = *self;
        let (kv, written, ranges) = (this.kv, this.written, this.ranges);
        // Evict before and after: a read between commit and eviction must not fill stale.
        kv.epoch.fetch_add(1, Ordering::AcqRel);
        let r = this.inner.commit(durability);
        kv.epoch.fetch_add(1, Ordering::AcqRel);
        if ranges {
            kv.cache.invalidate_all();
        }
        for k in &written {
            kv.cache.invalidate(k);
        }
        r
    }
}

impl KvEngine for CachedKv {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn read_txn(&self) -> KvResult<Box<dyn KvRead + '_>> {
        Ok(Box::new(CachedRead { kv: self, inner: self.inner.read_txn()?, fresh: false }))
    }
    fn txn_limit(&self) -> Option<usize> {
        self.inner.txn_limit()
    }
    fn fresh_read_txn(&self) -> KvResult<Box<dyn KvRead + '_>> {
        Ok(Box::new(CachedRead { kv: self, inner: self.inner.read_txn()?, fresh: true }))
    }
    fn write_txn(&self) -> KvResult<Box<dyn KvWrite + '_>> {
        Ok(Box::new(CachedWrite { kv: self, inner: self.inner.write_txn()?, written: Vec::new(), ranges: false }))
    }
    fn sync(&self) -> KvResult<()> {
        self.inner.sync()
    }
    fn membership(&self) -> Option<&dyn crate::membership::Membership> {
        self.inner.membership()
    }
    fn watch(&self, on_change: ChangeFeed) -> KvResult<bool> {
        self.subscribers.lock().push(on_change);
        Ok(true)
    }
}
