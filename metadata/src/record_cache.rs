//! `RecordCache`: the bounded map under the node cache ([`crate::kv_cache`]).
//!
//! Keys are spread over [`SHARDS`] shards, each a hash map behind its own
//! mutex. Every operation on a key takes its shard's lock once: a read
//! clones the value out, and [`RecordCache::compute`] decides what becomes
//! of an entry (keep, replace, remove) from the entry it finds, under that
//! lock, so a fill and the change feed's eviction of the same key are
//! ordered by it (what `CachedKv::fill` relies on).
//!
//! Entries live for a fixed time at most (expired ones read as absent and
//! go when next met). A shard holds `capacity / SHARDS` entries at most: one
//! more makes room by sampling the first [`SAMPLE`] entries the shard's
//! table holds (positions set by the keys' hashes, so a sample of keys
//! unrelated to their use) and dropping the expired among them, or else the
//! oldest; each dropped for room is reported to the cache's `on_drop` while
//! the lock is held.
//!
//! Locks: a shard's mutex is a leaf. Nothing is called under it but the
//! closure given to `compute` and `on_drop`, which take no lock.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// Shards of the map: enough that FUSE threads and the change feed seldom
/// meet on one.
const SHARDS: usize = 64;
/// Entries looked at to make room in a full shard.
const SAMPLE: usize = 16;

/// What [`RecordCache::compute`] makes of an entry.
pub(crate) enum Op<V> {
    Put(V),
    Remove,
    Nop,
}

struct Slot<V> {
    value: V,
    born: Instant,
}

type Shard<V> = HashMap<Vec<u8>, Slot<V>, foldhash::fast::RandomState>;

/// Told of each key dropped to make room.
type OnDrop = Box<dyn Fn(&[u8]) + Send + Sync>;

pub(crate) struct RecordCache<V> {
    shards: Box<[Mutex<Shard<V>>]>,
    /// Chooses a key's shard (seeded per process, as the shards' own).
    hasher: foldhash::fast::RandomState,
    per_shard: usize,
    ttl: Duration,
    on_drop: OnDrop,
}

impl<V: Clone> RecordCache<V> {
    /// A map of `capacity` entries at most, each kept `ttl` at most;
    /// `on_drop` hears of each key dropped to make room.
    pub fn new(capacity: usize, ttl: Duration, on_drop: impl Fn(&[u8]) + Send + Sync + 'static) -> Self {
        RecordCache {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            hasher: foldhash::fast::RandomState::default(),
            per_shard: capacity.div_ceil(SHARDS).max(1),
            ttl,
            on_drop: Box::new(on_drop),
        }
    }

    fn shard(&self, key: &[u8]) -> &Mutex<Shard<V>> {
        // The high bits: the shard's own table indexes by the low ones.
        let h = self.hasher.hash_one(key);
        &self.shards[(h >> 32) as usize % SHARDS]
    }

    /// The value of `key`, unless absent or expired.
    pub fn get(&self, key: &[u8]) -> Option<V> {
        let mut shard = self.shard(key).lock();
        match shard.get(key) {
            Some(s) if s.born.elapsed() < self.ttl => Some(s.value.clone()),
            Some(_) => {
                shard.remove(key);
                None
            }
            None => None,
        }
    }

    /// Decide, from the entry `key` has now (none when absent or expired),
    /// what it becomes; under the shard's lock.
    pub fn compute(&self, key: &[u8], f: impl FnOnce(Option<&V>) -> Op<V>) {
        let now = Instant::now();
        let mut shard = self.shard(key).lock();
        // One lookup: the slot found is the one replaced.
        let slot = shard.get_mut(key);
        match f(slot.as_deref().filter(|s| now.duration_since(s.born) < self.ttl).map(|s| &s.value)) {
            Op::Nop => {}
            Op::Remove => {
                shard.remove(key);
            }
            Op::Put(value) => {
                let fresh = Slot { value, born: now };
                match slot {
                    Some(s) => *s = fresh,
                    None => {
                        if shard.len() >= self.per_shard {
                            self.make_room(&mut shard);
                        }
                        shard.insert(key.to_vec(), fresh);
                    }
                }
            }
        }
    }

    /// Drop the sample's expired entries, or else its oldest one.
    fn make_room(&self, shard: &mut Shard<V>) {
        let mut expired = Vec::new();
        let mut oldest: Option<(&Vec<u8>, Instant)> = None;
        for (k, s) in shard.iter().take(SAMPLE) {
            if s.born.elapsed() >= self.ttl {
                expired.push(k.clone());
            } else if oldest.is_none_or(|(_, born)| s.born < born) {
                oldest = Some((k, s.born));
            }
        }
        if expired.is_empty() {
            expired.extend(oldest.map(|(k, _)| k.clone()));
        }
        for k in expired {
            (self.on_drop)(&k);
            shard.remove(&k);
        }
    }

    pub fn invalidate(&self, key: &[u8]) {
        self.shard(key).lock().remove(key);
    }

    /// Drop everything, shard after shard.
    pub fn invalidate_all(&self) {
        for s in self.shards.iter() {
            s.lock().clear();
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn put(c: &RecordCache<u64>, k: &[u8], v: u64) {
        c.compute(k, |_| Op::Put(v));
    }

    #[test]
    fn computes_under_the_entry_it_finds() {
        let c = RecordCache::new(1024, Duration::from_secs(60), |_: &[u8]| {});
        assert_eq!(c.get(b"a"), None);
        put(&c, b"a", 1);
        assert_eq!(c.get(b"a"), Some(1));
        // Only a newer value replaces the one held.
        c.compute(b"a", |old| match old {
            Some(v) if *v >= 1 => Op::Nop,
            _ => Op::Put(0),
        });
        assert_eq!(c.get(b"a"), Some(1));
        c.compute(b"a", |_| Op::Remove);
        assert_eq!(c.get(b"a"), None);
        put(&c, b"b", 2);
        c.invalidate(b"b");
        assert_eq!(c.get(b"b"), None);
        put(&c, b"c", 3);
        put(&c, b"d", 4);
        c.invalidate_all();
        assert_eq!((c.get(b"c"), c.get(b"d")), (None, None));
    }

    #[test]
    fn expired_entries_read_as_absent() {
        let c = RecordCache::new(1024, Duration::from_millis(30), |_: &[u8]| {});
        put(&c, b"a", 1);
        std::thread::sleep(Duration::from_millis(40));
        assert_eq!(c.get(b"a"), None);
        let mut seen = Some(0);
        c.compute(b"a", |old| {
            seen = old.copied();
            Op::Nop
        });
        assert_eq!(seen, None, "compute is shown an expired entry as absent");
    }

    #[test]
    fn stays_within_its_capacity_and_reports_what_it_drops() {
        let dropped = Arc::new(Mutex::new(Vec::<Vec<u8>>::new()));
        let d = dropped.clone();
        let cap = 4 * SHARDS;
        let c = RecordCache::new(cap, Duration::from_secs(60), move |k: &[u8]| d.lock().push(k.to_vec()));
        let n = 20 * cap;
        for i in 0..n {
            put(&c, format!("k{i}").as_bytes(), i as u64);
        }
        assert!(c.len() <= cap, "{} entries held, capacity {cap}", c.len());
        let dropped = dropped.lock();
        assert_eq!(dropped.len() + c.len(), n, "each key is either held or was reported dropped");
        for k in dropped.iter() {
            assert_eq!(c.get(k), None);
        }
        // The newest key is never the one dropped to make its own room.
        assert_eq!(c.get(format!("k{}", n - 1).as_bytes()), Some(n as u64 - 1));
    }
}
