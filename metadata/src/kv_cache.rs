//! `CachedKv`: a node-local cache of inode, dentry, xattr and tier records in
//! front of a shared engine (etcd), kept honest by the engine's change feed;
//! and of the lease and layout-token records a seal checks, which only
//! read-write transactions take from it (their reads are compared at commit;
//! a read-only view, such as recovery's or the sweep's, always asks the
//! engine). [`crate::schema::node_cached`] says which records are which.
//!
//! Every entry carries the key's version (etcd's mod revision, 0 when absent)
//! and the revision it was known at. Read-only lookups and getattrs are served
//! from memory. A read-write transaction is served from memory too, but each
//! cached read becomes a compare of the commit ([`KvWrite::assume`]): the
//! commit succeeds only if every key still has the version the cache gave, so
//! a create whose records are cached costs the engine one round trip, its
//! commit. A commit that lost (the cache was behind) evicts what it assumed,
//! and the retry reads the engine. What a commit wrote enters the cache at the
//! commit's revision. A change made by another node reaches this cache through
//! [`KvEngine::watch_revisions`]: a key held takes the new value at the
//! change's revision (one not held stays out, and an engine that gives no
//! revision evicts it); a fill that raced with the change
//! is not kept, and a fill older than the entry it would replace is dropped.
//! The feed vouches for itself: after a second without news it asks etcd to
//! confirm it is current, and when it breaks, falls silent for
//! [`WATCH_SILENCE`](crate::kv_etcd::WATCH_SILENCE) or is created anew,
//! every subscriber hears "start over" and this cache drops everything. So
//! an entry lives until the feed evicts it, for [`CACHE_TTL`] at most (a
//! bound on memory, not on staleness).
//!
//! A commit whose answer was lost may land after a read of what it wrote:
//! those keys stay unsettled, and no read of them is kept, until the call
//! that made the commit knows what became of it ([`UnsettledScope`]).
//!
//! Locks: `Listings::dirs`, `dropped`, `Unsettled::state`,
//! `UnsettledScope::held` and a shard of the record map (held
//! only inside [`RecordCache`]'s calls; `compute` reads and bumps its key's
//! epoch under it, atomics) are leaves, each taken
//! alone and never across a call to the engine; the change feed calls its
//! subscribers with `subscribers` alone held.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use crate::kv::{ChangeFeed, Durability, KvEngine, KvError, KvRead, KvResult, KvWrite, RevisionFeed, Versioned};
use crate::record_cache::{Op, RecordCache};

/// Longest an entry lives without an eviction from the change feed: a
/// file made or read minutes ago is still stat-ed, looked up and unlinked
/// without a read from etcd.
pub const CACHE_TTL: Duration = Duration::from_secs(300);
/// Ranges remembered in `CachedKv::dropped` at most (one per unlinked
/// inode, for [`CACHE_TTL`]); past it the cache starts over instead.
const DROPPED_MAX: usize = 1 << 16;
/// Listings kept at most (directories, and inodes' xattrs); past it the
/// expired ones go, and when none has expired, all of them.
const LISTINGS_MAX: usize = 1 << 16;
const CAPACITY: usize = 1 << 20;

/// A cached record: its value (`None`: absent), its version and the engine
/// revision it was known at.
#[derive(Clone)]
struct Entry {
    value: Option<Arc<Vec<u8>>>,
    version: i64,
    at: i64,
}

/// Keyed by the engine's keys (see [`RecordCache`]).
type Cache = Arc<RecordCache<Entry>>;

pub struct CachedKv {
    inner: Arc<dyn KvEngine>,
    cache: Cache,
    /// Bumped by every eviction, by stripe of the key: a fill whose read or
    /// commit saw its key's stripe change is not kept (the eviction may have
    /// been of newer news than the fill). Striped so that other nodes'
    /// changes of other keys, constant on a busy cluster, do not stop every
    /// fill.
    epochs: Arc<Epochs>,
    subscribers: Arc<Mutex<Vec<ChangeFeed>>>,
    /// Ranges this node deleted (an unlinked inode's xattrs), or that
    /// another node changed out of the feed's sight (a recalled
    /// directory's, see [`KvEngine::forget_below`]), by start: end,
    /// the commit's revision, and when. A cached entry in one known at an
    /// older revision is stale. Kept for [`CACHE_TTL`], after which every
    /// such entry has expired anyway; at most [`DROPPED_MAX`] of them.
    dropped: Mutex<std::collections::BTreeMap<Vec<u8>, DroppedRange>>,
    listings: Arc<Listings>,
    unsettled: Arc<Unsettled>,
}

/// Eviction counters, one per stripe of keys.
struct Epochs([AtomicU64; EPOCH_STRIPES]);

const EPOCH_STRIPES: usize = 256;

impl Epochs {
    fn new() -> Self {
        Epochs(std::array::from_fn(|_| AtomicU64::new(0)))
    }

    fn index(key: &[u8]) -> usize {
        let hash = key.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3));
        (hash % EPOCH_STRIPES as u64) as usize
    }

    /// Where `key`'s stripe stands: what a fill of it is given, taken
    /// before the read.
    fn of(&self, key: &[u8]) -> u64 {
        self.0[Self::index(key)].load(Ordering::Acquire)
    }

    /// Every stripe, as a write transaction begins.
    fn all(&self) -> [u64; EPOCH_STRIPES] {
        std::array::from_fn(|i| self.0[i].load(Ordering::Acquire))
    }

    /// What [`Epochs::all`] said of `key`'s stripe.
    fn of_in(all: &[u64; EPOCH_STRIPES], key: &[u8]) -> u64 {
        all[Self::index(key)]
    }

    /// An eviction of `key` (of everything, for an empty key).
    fn bump(&self, key: &[u8]) {
        if key.is_empty() {
            for e in &self.0 {
                e.fetch_add(1, Ordering::AcqRel);
            }
        } else {
            self.0[Self::index(key)].fetch_add(1, Ordering::AcqRel);
        }
    }
}

/// Drop what the cache holds of `key` (of everything, for an empty key):
/// its epoch and its directory's stripe bumped, its listing and its entry
/// gone, in that order, so that a fill of an older read begun before does
/// not land after.
fn evict_in(listings: &Listings, epochs: &Epochs, cache: &Cache, key: &[u8]) {
    listings.evict(key, epochs);
    match key.is_empty() {
        true => cache.invalidate_all(),
        false => cache.invalidate(key),
    }
}

/// Longest a key stays unsettled when its commit was made outside any
/// call's scope (the `--nowsync` flusher's batches): by then the commit
/// has landed or never will, and a later landing reaches the cache through
/// the change feed like another node's change.
const UNSETTLED_MAX: Duration = Duration::from_secs(300);

/// Keys and ranges written by commits whose answer was lost (the
/// connection to etcd reset after the request went out): the commit may
/// land after a read of them, and what that read found (the inode a create
/// made, absent) must not stay cached past it, where nothing would say it
/// is older: the call that made the commit answers once it finds the change
/// made, and the node would then not see its own change. While a key is
/// unsettled, no read of it is kept (a fill, or a listing of a range
/// holding it), so each read of it goes to the engine. It settles when the
/// scope of the call that made the commit drops ([`UnsettledScope`]), or
/// after [`UNSETTLED_MAX`] for a commit made in none; settling evicts it,
/// so a read of it still under way is not kept either.
///
/// Lock: `state` is a leaf, taken alone, never inside the record map's or
/// the listings' locks.
struct Unsettled {
    state: Mutex<UnsettledState>,
    /// Keys and ranges held: read on every fill without the lock.
    held: AtomicU64,
    cache: Cache,
    epochs: Arc<Epochs>,
    listings: Arc<Listings>,
}

#[derive(Default)]
struct UnsettledState {
    keys: std::collections::HashMap<Vec<u8>, Hold>,
    ranges: Vec<(Vec<u8>, Vec<u8>, Hold)>,
    /// The earliest end of a hold made in no scope: when the held keys
    /// are next looked over for holds that ran out.
    next_expiry: Option<std::time::Instant>,
}

/// Why a key is unsettled: the scopes holding it, and until when a commit
/// made in no scope holds it.
#[derive(Default, Clone, Copy)]
struct Hold {
    scopes: u32,
    until: Option<std::time::Instant>,
}

impl Hold {
    fn add(&mut self, scoped: bool, now: std::time::Instant) {
        match scoped {
            true => self.scopes += 1,
            false => self.until = Some(now + UNSETTLED_MAX),
        }
    }

    fn holds(&self, now: std::time::Instant) -> bool {
        self.scopes > 0 || self.until.is_some_and(|u| u > now)
    }
}

impl UnsettledState {
    fn len(&self) -> u64 {
        (self.keys.len() + self.ranges.len()) as u64
    }
}

impl Unsettled {
    /// A commit's `keys` and `ranges` are unsettled, for its scope or,
    /// made in none, for [`UNSETTLED_MAX`].
    fn add(&self, keys: &[Vec<u8>], ranges: &[(Vec<u8>, Vec<u8>)], scoped: bool) {
        let now = std::time::Instant::now();
        let mut st = self.state.lock();
        if !scoped && st.next_expiry.is_none() {
            st.next_expiry = Some(now + UNSETTLED_MAX);
        }
        for k in keys {
            st.keys.entry(k.clone()).or_default().add(scoped, now);
        }
        for (start, end) in ranges {
            let mut hold = Hold::default();
            hold.add(scoped, now);
            st.ranges.push((start.clone(), end.clone(), hold));
        }
        self.held.store(st.len(), Ordering::Release);
    }

    /// A scope that held `keys` and `ranges` ended: what no other scope
    /// holds settles, and is evicted.
    fn settle(&self, keys: &[Vec<u8>], ranges: &[(Vec<u8>, Vec<u8>)]) {
        let now = std::time::Instant::now();
        {
            let mut st = self.state.lock();
            for k in keys {
                if let Some(h) = st.keys.get_mut(k) {
                    h.scopes = h.scopes.saturating_sub(1);
                    if !h.holds(now) {
                        st.keys.remove(k);
                    }
                }
            }
            for (start, end) in ranges {
                let found = st.ranges.iter().position(|(s, e, h)| s == start && e == end && h.scopes > 0);
                if let Some(i) = found {
                    st.ranges[i].2.scopes = st.ranges[i].2.scopes.saturating_sub(1);
                }
            }
            st.ranges.retain(|(_, _, h)| h.holds(now));
            self.held.store(st.len(), Ordering::Release);
        }
        // A range settled: everything goes, its keys with it.
        match ranges.is_empty() {
            true => keys.iter().for_each(|k| evict_in(&self.listings, &self.epochs, &self.cache, k)),
            false => evict_in(&self.listings, &self.epochs, &self.cache, b""),
        }
    }

    /// Whether `key` is unsettled.
    fn holds(&self, key: &[u8]) -> bool {
        self.any(|st, now| {
            st.keys.get(key).is_some_and(|h| h.holds(now))
                || st.ranges.iter().any(|(s, e, h)| s.as_slice() <= key && key < e.as_slice() && h.holds(now))
        })
    }

    /// Whether anything in `[start, end)` is unsettled.
    fn any_within(&self, start: &[u8], end: &[u8]) -> bool {
        self.any(|st, now| {
            st.keys.iter().any(|(k, h)| start <= k.as_slice() && k.as_slice() < end && h.holds(now))
                || st.ranges.iter().any(|(s, e, h)| s.as_slice() < end && start < e.as_slice() && h.holds(now))
        })
    }

    fn any(&self, found: impl Fn(&UnsettledState, std::time::Instant) -> bool) -> bool {
        if self.held.load(Ordering::Acquire) == 0 {
            return false;
        }
        let now = std::time::Instant::now();
        let mut st = self.state.lock();
        // Holds of commits made in no scope run out here, looked over
        // only once the earliest of them is due.
        if st.next_expiry.is_some_and(|t| t <= now) {
            st.keys.retain(|_, h| h.holds(now));
            st.ranges.retain(|(_, _, h)| h.holds(now));
            let next = st
                .keys
                .values()
                .chain(st.ranges.iter().map(|(_, _, h)| h))
                .filter_map(|h| h.until)
                .filter(|t| *t > now)
                .min();
            st.next_expiry = next;
            self.held.store(st.len(), Ordering::Release);
        }
        found(&st, now)
    }
}

/// The keys and ranges a call's lost commits left unsettled (see
/// [`KvEngine::unsettled_scope`]): they settle when it drops.
pub struct UnsettledScope {
    unsettled: Arc<Unsettled>,
    held: Mutex<Held>,
}

/// The keys and ranges a scope holds.
type Held = (Vec<Vec<u8>>, Vec<(Vec<u8>, Vec<u8>)>);

impl UnsettledScope {
    fn hold(&self, keys: Vec<Vec<u8>>, ranges: Vec<(Vec<u8>, Vec<u8>)>) {
        self.unsettled.add(&keys, &ranges, true);
        let mut held = self.held.lock();
        held.0.extend(keys);
        held.1.extend(ranges);
    }
}

impl Drop for UnsettledScope {
    fn drop(&mut self) {
        let (keys, ranges) = std::mem::take(&mut *self.held.lock());
        if !keys.is_empty() || !ranges.is_empty() {
            self.unsettled.settle(&keys, &ranges);
        }
    }
}

/// A range this node deleted: its end, the commit's revision, and when.
struct DroppedRange {
    end: Vec<u8>,
    rev: i64,
    when: std::time::Instant,
}

/// Directories (and inodes' xattrs) this node knows whole: every name each
/// holds, so that a lookup of a name a directory lacks (the kernel's, before
/// every create) or of an xattr a file lacks (`ls -l` asks for two) is
/// answered without a round trip, and a commit compares the absence. A listing starts empty with a mkdir this node commits, or
/// from a scan of the whole directory; this node's own commits keep it; any
/// other node's change of a name in it, a lost race, or a missed eviction
/// drops it. It holds for [`CACHE_TTL`], as a cached record does, and a
/// directory whose listing expired is listed again, [`LISTING_MAX`] names
/// a request, up to [`GROWN_MAX`] names. A directory this node fills (a
/// dataset unpacked into it) stays listed as it grows, to [`GROWN_MAX`]
/// names and while all listings together hold fewer than [`NAMES_MAX`].
#[derive(Default)]
struct Listings {
    dirs: Mutex<Dirs>,
    /// Changes of names, by stripe of their range: bumped (under `dirs`)
    /// by every eviction from the change feed and every change this node's
    /// commits note. A listing read while its stripe moved may have missed
    /// a change and is not kept; changes in other ranges (most of them, on
    /// a busy node) leave it alone.
    changes: [AtomicU64; STRIPES],
}

/// Stripes of [`Listings::changes`].
const STRIPES: usize = 32;

struct Listing {
    /// Dentry keys present.
    keys: std::collections::HashSet<Vec<u8>>,
    since: std::time::Instant,
    /// The range held more names than a listing may when listed on a miss
    /// (or than the budget left): not known whole, and not listed again
    /// until it expires (each key is read on its own meanwhile).
    partial: bool,
}

/// The listings, and how many names they hold together (kept with them).
#[derive(Default)]
struct Dirs {
    map: std::collections::HashMap<Vec<u8>, Listing>,
    names: usize,
}

impl Dirs {
    fn get(&self, dir: &[u8]) -> Option<&Listing> {
        self.map.get(dir)
    }

    fn insert(&mut self, dir: Vec<u8>, l: Listing) {
        self.names += l.keys.len();
        if let Some(old) = self.map.insert(dir, l) {
            self.names -= old.keys.len();
        }
    }

    fn remove(&mut self, dir: &[u8]) {
        if let Some(old) = self.map.remove(dir) {
            self.names -= old.keys.len();
        }
    }

    fn clear(&mut self) {
        self.map.clear();
        self.names = 0;
    }

    /// Make room for one more listing of `more` names: under
    /// [`LISTINGS_MAX`] listings the expired go, and when that is not
    /// enough, all (a listing dropped is listed again on a miss); under
    /// [`NAMES_MAX`] names the expired go, and when that is not enough, the
    /// answer is no (the new one is not kept whole; the others stay).
    fn make_room(&mut self, more: usize) -> bool {
        let many = |d: &Self| d.map.len() >= LISTINGS_MAX;
        let big = |d: &Self| d.names + more > NAMES_MAX;
        if many(self) || big(self) {
            self.map.retain(|_, l| l.since.elapsed() < CACHE_TTL);
            self.names = self.map.values().map(|l| l.keys.len()).sum();
        }
        if many(self) {
            self.clear();
        }
        !big(self)
    }
}

/// Names one listing request reads: a directory whose listing expired is
/// listed again this many names at a time.
const LISTING_MAX: usize = 4096;
/// Names one listing holds at most (memory, and the requests that list it
/// again once it expired): a directory with more is read a name at a time.
const GROWN_MAX: usize = 1 << 18;
/// Names all listings hold together at most: about 85 bytes each, so
/// some 45 MB.
const NAMES_MAX: usize = 1 << 19;

/// What a listing says of a name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Known {
    Absent,
    /// Present (its record may still be cached, or not), or no listing.
    Unknown,
    /// The listing expired (the directory was small), or the range is
    /// one listed whole on a miss (an inode's xattrs): list it.
    Relist,
}

impl Listings {
    fn lookup(&self, key: &[u8]) -> Known {
        let Some((dir, list_on_miss)) = crate::schema::listed_range(key) else { return Known::Unknown };
        match self.dirs.lock().get(dir) {
            Some(l) if l.since.elapsed() >= CACHE_TTL => Known::Relist,
            Some(l) if l.partial => Known::Unknown,
            Some(l) if !l.keys.contains(key) => Known::Absent,
            Some(_) => Known::Unknown,
            None if list_on_miss => Known::Relist,
            None => Known::Unknown,
        }
    }

    fn stripe(&self, dir: &[u8]) -> &AtomicU64 {
        let hash = dir.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3));
        &self.changes[(hash % STRIPES as u64) as usize]
    }

    /// Where `dir`'s stripe of changes stands: what [`Listings::set`] is
    /// given, taken before the listing is read.
    fn changes(&self, dir: &[u8]) -> u64 {
        self.stripe(dir).load(Ordering::Acquire)
    }

    /// Keep `keys` as the listing of `dir`, unless a change of a name in
    /// its stripe was evicted or noted since `since` was taken (checked
    /// under the lock it is bumped under). A listing the budget of names
    /// has no room for is kept as partial.
    fn set(&self, dir: &[u8], keys: std::collections::HashSet<Vec<u8>>, since: u64) {
        let mut dirs = self.dirs.lock();
        if self.changes(dir) == since {
            dirs.remove(dir);
            let now = std::time::Instant::now();
            match dirs.make_room(keys.len()) {
                true => dirs.insert(dir.to_vec(), Listing { keys, since: now, partial: false }),
                false => dirs.insert(dir.to_vec(), Listing { keys: Default::default(), since: now, partial: true }),
            }
        }
    }

    /// Whether `dir`'s listing is held whole and fresh.
    fn whole(&self, dir: &[u8]) -> bool {
        self.dirs.lock().get(dir).is_some_and(|l| !l.partial && l.since.elapsed() < CACHE_TTL)
    }

    /// `dir` was found too large to keep whole: not listed again on a miss
    /// until [`CACHE_TTL`] passed.
    fn set_partial(&self, dir: &[u8]) {
        let since = std::time::Instant::now();
        let mut dirs = self.dirs.lock();
        dirs.remove(dir);
        dirs.make_room(0);
        dirs.insert(dir.to_vec(), Listing { keys: Default::default(), since, partial: true });
    }

    /// An eviction: bump `key`'s epoch, and drop `key`'s directory and
    /// bump its stripe (all of them for an empty key), together.
    fn evict(&self, key: &[u8], epochs: &Epochs) {
        let mut dirs = self.dirs.lock();
        epochs.bump(key);
        if key.is_empty() {
            dirs.clear();
            for c in &self.changes {
                c.fetch_add(1, Ordering::AcqRel);
            }
        } else if let Some(dir) = crate::schema::listed_range(key).map(|(p, _)| p) {
            dirs.remove(dir);
            self.stripe(dir).fetch_add(1, Ordering::AcqRel);
        }
    }

    /// This node's commit put (`present`) or deleted `key`.
    fn note(&self, key: &[u8], present: bool) {
        let Some(dir) = crate::schema::listed_range(key).map(|(p, _)| p) else { return };
        let mut dirs = self.dirs.lock();
        self.stripe(dir).fetch_add(1, Ordering::AcqRel);
        let Dirs { map, names } = &mut *dirs;
        let Some(l) = map.get_mut(dir) else { return };
        if l.partial {
            return;
        }
        match present {
            true if l.keys.insert(key.to_vec()) => *names += 1,
            false if l.keys.remove(key) => *names -= 1,
            _ => {}
        }
        if l.keys.len() > GROWN_MAX || *names > NAMES_MAX {
            // Grown past what a listing may hold: each name is read on its own.
            dirs.remove(dir);
        }
    }

    /// Drop the listing of the range `prefix` names (a range deleted).
    fn forget(&self, prefix: &[u8]) {
        let mut dirs = self.dirs.lock();
        dirs.remove(prefix);
        self.stripe(prefix).fetch_add(1, Ordering::AcqRel);
    }

    fn forget_dir_of(&self, key: &[u8]) {
        if let Some(dir) = crate::schema::listed_range(key).map(|(p, _)| p) {
            self.forget(dir);
        }
    }
}

/// Another node's change of `key`, committed at `rev` and reported by the
/// change feed (which bumped the key's epoch first, so a fill of an older
/// read begun before does not land after): an entry held from before takes
/// the new value, so a record this node reads or checks stays a hit after
/// another node changed it (a file it stats that another node writes, or
/// the inode record of a file another node purged, which the holder of a
/// copy checks before it deletes the copy). A key not held stays out: the
/// node caches what it uses, not all the cluster writes.
fn renew(cache: &Cache, key: &[u8], value: Option<&[u8]>, rev: i64) {
    cache.compute(key, |old| match old {
        Some(e) if e.at < rev => Op::Put(Entry {
            value: value.map(|v| Arc::new(v.to_vec())),
            version: if value.is_some() { rev } else { 0 },
            at: rev,
        }),
        _ => Op::Nop,
    });
}

/// Records any read may take from the cache (the schema decides).
fn cacheable(key: &[u8]) -> bool {
    crate::schema::node_cached(key)
}

/// Records kept too, but served only to read-write transactions.
fn cacheable_in_writes(key: &[u8]) -> bool {
    cacheable(key) || crate::schema::node_cached_in_writes(key)
}

impl CachedKv {
    /// Wrap `inner`; returns `inner` unchanged (no cache) when it has no
    /// change feed, since a cache without one could serve stale records.
    pub fn wrap(inner: Arc<dyn KvEngine>) -> KvResult<Arc<dyn KvEngine>> {
        let epochs = Arc::new(Epochs::new());
        // An entry the cache drops to make room leaves no trace of the
        // state it knew: a read of an older state still under way must not
        // land in its place, as after an eviction (see `fill`).
        let dropped_for_room = {
            let epochs = epochs.clone();
            move |key: &[u8]| epochs.bump(key)
        };
        let cache: Cache = Arc::new(RecordCache::new(CAPACITY, CACHE_TTL, dropped_for_room));
        let subscribers: Arc<Mutex<Vec<ChangeFeed>>> = Arc::default();
        let listings = Arc::new(Listings::default());
        let feed: RevisionFeed = {
            let (cache, epochs, subscribers) = (cache.clone(), epochs.clone(), subscribers.clone());
            let listings = listings.clone();
            Arc::new(move |key: &[u8], value: Option<&[u8]>, rev: i64| {
                if key.is_empty() {
                    evict_in(&listings, &epochs, &cache, key);
                } else if cacheable_in_writes(key) {
                    listings.evict(key, &epochs);
                    match rev {
                        0 => cache.invalidate(key),
                        _ => renew(&cache, key, value, rev),
                    }
                }
                for s in subscribers.lock().iter() {
                    s(key, value);
                }
            })
        };
        if !inner.watch_revisions(feed)? {
            return Ok(inner);
        }
        let unsettled = Arc::new(Unsettled {
            state: Mutex::default(),
            held: AtomicU64::new(0),
            cache: cache.clone(),
            epochs: epochs.clone(),
            listings: listings.clone(),
        });
        Ok(Arc::new(CachedKv { inner, cache, epochs, subscribers, dropped: Mutex::default(), listings, unsettled }))
    }

    /// Keep what a read or a commit learned, unless an eviction happened
    /// since `epoch` was taken, or the cache already knows a later state.
    fn fill(&self, key: &[u8], value: Option<Vec<u8>>, version: i64, at: i64, epoch: u64) {
        // Checked after the read: a key made unsettled before it was bumped
        // (see `CachedWrite::commit_at`), so a fill that began before
        // fails the epoch check below, and one that began after sees it here.
        if self.unsettled.holds(key) {
            return;
        }
        let fresh = Entry { value: value.map(Arc::new), version, at };
        // The epoch is checked under the entry's lock: an eviction bumps it
        // before it removes the entry, so it either stops this fill or
        // removes what it put. A fill stopped so removes the entry too, and
        // bumps the epoch as an eviction does: a read of an older state
        // still under way (a kernel's revalidating lookup, which runs beside
        // a create in the same directory) must not land in the place this
        // fill leaves empty, where nothing would say it is older. A later
        // state already there stays.
        let mut raced = false;
        self.cache.compute(key, |old| {
            if self.epochs.of(key) != epoch {
                if old.is_some_and(|e| e.at >= at) {
                    return Op::Nop;
                }
                raced = true;
                self.epochs.bump(key);
                return Op::Remove;
            }
            match old {
                Some(e) if e.at >= at => Op::Nop,
                _ => Op::Put(fresh),
            }
        });
        if raced {
            self.listings.forget_dir_of(key);
        }
    }

    /// The cached entry of `key`, unless a range this node deleted since
    /// covers it.
    fn cached(&self, key: &[u8]) -> Option<Entry> {
        let e = self.cache.get(key)?;
        use std::ops::Bound;
        // The ranges dropped are disjoint (an inode's xattrs, or one kind of
        // a recalled directory's records, or the delegations): the last one
        // starting at or before the key is the only candidate.
        let dropped = self.dropped.lock();
        if let Some((_, d)) = dropped.range::<[u8], _>((Bound::Unbounded, Bound::Included(key))).next_back() {
            if key < d.end.as_slice() && e.at < d.rev {
                return None;
            }
        }
        Some(e)
    }

    fn drop_ranges(&self, ranges: Vec<(Vec<u8>, Vec<u8>)>, rev: i64) {
        let now = std::time::Instant::now();
        {
            let mut dropped = self.dropped.lock();
            if dropped.len() + ranges.len() > DROPPED_MAX {
                dropped.retain(|_, d| now.duration_since(d.when) < CACHE_TTL);
            }
            if dropped.len() + ranges.len() <= DROPPED_MAX {
                for (start, end) in ranges {
                    dropped.insert(start, DroppedRange { end, rev, when: now });
                }
                return;
            }
        }
        // Too many to keep apart: everything cached goes first (the epochs
        // bump, so no fill of a read begun before lands after), then the
        // ranges, which no entry left can be stale in.
        self.evict(b"");
        self.dropped.lock().clear();
    }

    /// [`evict_in`] this cache.
    fn evict(&self, key: &[u8]) {
        evict_in(&self.listings, &self.epochs, &self.cache, key);
    }

    /// Read `key` from the engine in `txn` and keep what it says, unless
    /// it was evicted since `epoch` (where its stripe stood before `txn`
    /// read anything: an engine transaction reads at the revision of its
    /// first read, so a change evicted after that is not in what it reads).
    fn read_through(&self, txn: &mut dyn KvRead, key: &[u8], epoch: u64) -> KvResult<Option<Vec<u8>>> {
        let (v, versioned) = txn.get_versioned(key)?;
        if let Some(Versioned { value, version, at }) = versioned {
            self.fill(key, value, version, at, epoch);
        }
        Ok(v)
    }

    /// Whether `key` (a dentry or an xattr) is known absent, listing its
    /// range when its listing expired or its range is listed on a miss. The
    /// listing is read in a transaction of its own at etcd's latest
    /// revision, begun after the epoch and generation were taken: every
    /// change before it is in the listing, and one after it either evicts
    /// the listing (another node's, through the feed) or is noted in it or
    /// stops it from being kept (this node's).
    fn absent(&self, key: &[u8]) -> KvResult<bool> {
        match self.listings.lookup(key) {
            Known::Absent => Ok(true),
            Known::Unknown => Ok(false),
            Known::Relist => {
                let dir = crate::schema::listed_range(key).map(|(p, _)| p).expect("a listed key has a listed range");
                let since = self.listings.changes(dir);
                let (found, whole) = self.list(dir)?;
                self.keep_listing(dir, found, whole, since);
                Ok(self.listings.lookup(key) == Known::Absent)
            }
        }
    }

    /// The names of `dir`, [`LISTING_MAX`] a request, in one read
    /// transaction (etcd: each request at the first one's revision), and
    /// whether they are all of them (no more than [`GROWN_MAX`]).
    fn list(&self, dir: &[u8]) -> KvResult<(crate::kv::Pairs, bool)> {
        let (mut from, end) = crate::schema::prefix_range(dir);
        let mut txn = self.inner.read_txn()?;
        let mut found = Vec::new();
        loop {
            let page = txn.scan(&from, &end, LISTING_MAX)?;
            let more = page.len() == LISTING_MAX;
            if let Some((last, _)) = page.last() {
                from = [last.as_slice(), &[0]].concat();
            }
            found.extend(page);
            if !more || found.len() > GROWN_MAX {
                let whole = found.len() <= GROWN_MAX;
                return Ok((found, whole));
            }
        }
    }

    /// Keep what a listing of `dir` found: whole when it is all the names,
    /// partial when there are more.
    fn keep_listing(&self, dir: &[u8], found: crate::kv::Pairs, whole: bool, since: u64) {
        let (start, end) = crate::schema::prefix_range(dir);
        if self.unsettled.any_within(&start, &end) {
            return;
        }
        match whole {
            true => self.listings.set(dir, found.into_iter().map(|(k, _)| k).collect(), since),
            false => self.listings.set_partial(dir),
        }
    }

    /// [`KvRead::list_ranges`]: the listings of `prefixes` not held
    /// already, read together as [`CachedKv::absent`] reads one.
    fn list_ranges(&self, prefixes: &[Vec<u8>]) -> KvResult<()> {
        let wanted: Vec<(&Vec<u8>, u64)> =
            prefixes.iter().filter(|p| !self.listings.whole(p)).map(|p| (p, self.listings.changes(p))).collect();
        if wanted.is_empty() {
            return Ok(());
        }
        let ranges: Vec<(Vec<u8>, Vec<u8>)> = wanted.iter().map(|(p, _)| crate::schema::prefix_range(p)).collect();
        let found = self.inner.read_txn()?.scan_many(&ranges, LISTING_MAX)?;
        for ((dir, since), found) in wanted.into_iter().zip(found) {
            let whole = found.len() < LISTING_MAX;
            self.keep_listing(dir, found, whole, since);
        }
        Ok(())
    }
}

struct CachedRead<'a> {
    kv: &'a CachedKv,
    inner: Box<dyn KvRead + 'a>,
    /// Read past the cache (and refill it): a close-to-open read.
    fresh: bool,
    /// The eviction epochs before the first read from the engine, whose
    /// revision the later ones read at: what a fill is checked against.
    pinned: Option<Box<[u64; EPOCH_STRIPES]>>,
}

impl CachedRead<'_> {
    /// Where `key`'s stripe of epochs stood before this transaction's
    /// first read from the engine (taken now when that read is next).
    fn epoch(&mut self, key: &[u8]) -> u64 {
        Epochs::of_in(self.pinned.get_or_insert_with(|| Box::new(self.kv.epochs.all())), key)
    }
}

impl KvRead for CachedRead<'_> {
    fn get(&mut self, key: &[u8]) -> KvResult<Option<Vec<u8>>> {
        if !cacheable(key) {
            return self.inner.get(key);
        }
        if !self.fresh {
            if let Some(e) = self.kv.cached(key) {
                return Ok(e.value.map(|v| v.as_ref().clone()));
            }
            if self.kv.absent(key)? {
                return Ok(None);
            }
        }
        let epoch = self.epoch(key);
        self.kv.read_through(self.inner.as_mut(), key, epoch)
    }
    /// [`KvRead::get`] with the version: a cached record's own, none for
    /// a record a listing says is absent, the engine's where it is read
    /// (and kept).
    fn get_versioned(&mut self, key: &[u8]) -> KvResult<(Option<Vec<u8>>, Option<Versioned>)> {
        if cacheable(key) && !self.fresh {
            if let Some(e) = self.kv.cached(key) {
                let value = e.value.map(|v| v.as_ref().clone());
                return Ok((value.clone(), Some(Versioned { value, version: e.version, at: e.at })));
            }
            if self.kv.absent(key)? {
                return Ok((None, None));
            }
        }
        let epoch = self.epoch(key);
        let (v, versioned) = self.inner.get_versioned(key)?;
        if let (true, Some(Versioned { value, version, at })) = (cacheable(key), &versioned) {
            self.kv.fill(key, value.clone(), *version, *at, epoch);
        }
        Ok((v, versioned))
    }
    fn scan(&mut self, start: &[u8], end: &[u8], limit: usize) -> KvResult<Vec<(Vec<u8>, Vec<u8>)>> {
        // Not kept as a listing: this transaction's revision may predate
        // changes the cache already knows of.
        self.inner.scan(start, end, limit)
    }
    fn scan_many(&mut self, ranges: &[(Vec<u8>, Vec<u8>)], limit: usize) -> KvResult<Vec<crate::kv::Pairs>> {
        // As `scan`: past the cache, in the engine's batched read.
        self.inner.scan_many(ranges, limit)
    }
    /// Cached keys from memory, the rest in one batched read, kept.
    fn get_many_versioned(&mut self, keys: &[Vec<u8>]) -> KvResult<Vec<crate::kv::Found>> {
        let mut out: Vec<Option<crate::kv::Found>> = vec![None; keys.len()];
        let mut missing = Vec::new();
        for (i, k) in keys.iter().enumerate() {
            let hit = if self.fresh || !cacheable(k) { None } else { self.kv.cached(k) };
            match hit {
                Some(e) => out[i] = Some((e.value.map(|v| v.as_ref().clone()), None)),
                None => missing.push(i),
            }
        }
        let epochs: Vec<u64> = missing.iter().map(|i| self.epoch(&keys[*i])).collect();
        let asked: Vec<Vec<u8>> = missing.iter().map(|i| keys[*i].clone()).collect();
        let found = self.inner.get_many_versioned(&asked)?;
        for ((i, (value, versioned)), epoch) in missing.into_iter().zip(found).zip(epochs) {
            if let (true, Some(v)) = (cacheable(&keys[i]), &versioned) {
                self.kv.fill(&keys[i], v.value.clone(), v.version, v.at, epoch);
            }
            out[i] = Some((value, versioned));
        }
        Ok(out.into_iter().map(|o| o.expect("every key answered")).collect())
    }
    fn list_ranges(&mut self, prefixes: &[Vec<u8>]) -> KvResult<()> {
        if self.fresh {
            return Ok(());
        }
        self.kv.list_ranges(prefixes)
    }
}

struct CachedWrite<'a> {
    kv: &'a CachedKv,
    inner: Box<dyn KvWrite + 'a>,
    /// Cached keys written, with what they now hold (`None`: deleted).
    written: Vec<(Vec<u8>, Option<Vec<u8>>)>,
    /// Keys whose cached versions the commit compares.
    assumed: Vec<Vec<u8>>,
    /// Keys the transaction knows are absent (records of a new inode).
    absent: Vec<Vec<u8>>,
    /// Directories it makes (their listings start empty).
    empty_dirs: Vec<(Vec<u8>, u64)>,
    /// Cacheable ranges deleted: later reads of this transaction go to
    /// the engine, which lays the ranges over what it holds.
    ranges: Vec<(Vec<u8>, Vec<u8>)>,
    /// The eviction epochs when the transaction began.
    epochs: [u64; EPOCH_STRIPES],
    /// Where a lost commit leaves what it wrote unsettled.
    scope: Option<Arc<UnsettledScope>>,
}

impl KvRead for CachedWrite<'_> {
    fn get(&mut self, key: &[u8]) -> KvResult<Option<Vec<u8>>> {
        if !cacheable_in_writes(key) || !self.ranges.is_empty() {
            return self.inner.get(key);
        }
        let own_write = self.written.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v.clone());
        if let Some(v) = own_write {
            return Ok(v);
        }
        if let Some(e) = self.kv.cached(key) {
            if self.inner.assume(key, e.version) {
                self.assumed.push(key.to_vec());
                return Ok(e.value.map(|v| v.as_ref().clone()));
            }
        } else if self.kv.listings.lookup(key) == Known::Absent && self.inner.assume(key, 0) {
            self.assumed.push(key.to_vec());
            return Ok(None);
        }
        self.kv.read_through(self.inner.as_mut(), key, Epochs::of_in(&self.epochs, key))
    }
    fn get_many_versioned(&mut self, keys: &[Vec<u8>]) -> KvResult<Vec<crate::kv::Found>> {
        // Records this cache never holds (sync marks, ...) go to the engine
        // together; a batch with any it may hold, key by key through `get`.
        if self.ranges.is_empty() && keys.iter().any(|k| cacheable_in_writes(k)) {
            return keys.iter().map(|k| Ok((self.get(k)?, None))).collect();
        }
        self.inner.get_many_versioned(keys)
    }
    fn scan(&mut self, start: &[u8], end: &[u8], limit: usize) -> KvResult<Vec<(Vec<u8>, Vec<u8>)>> {
        self.inner.scan(start, end, limit)
    }
}

impl CachedWrite<'_> {
    /// A range this transaction deletes: later reads of it go to the
    /// engine, and the cache drops it at commit.
    fn note_range(&mut self, start: &[u8], end: &[u8]) {
        if cacheable_in_writes(start) || cacheable_in_writes(end) {
            self.ranges.push((start.to_vec(), end.to_vec()));
        }
    }
}

impl KvWrite for CachedWrite<'_> {
    fn settle_in(&mut self, scope: &Arc<UnsettledScope>) {
        self.scope = Some(scope.clone());
    }
    fn put(&mut self, key: &[u8], value: &[u8]) {
        if cacheable_in_writes(key) {
            self.written.push((key.to_vec(), Some(value.to_vec())));
        }
        self.inner.put(key, value);
    }
    fn delete(&mut self, key: &[u8]) {
        if cacheable_in_writes(key) {
            self.written.push((key.to_vec(), None));
        }
        self.inner.delete(key);
    }
    fn known_absent(&mut self, key: &[u8]) {
        if cacheable_in_writes(key) && !self.written.iter().any(|(k, _)| k == key) {
            self.absent.push(key.to_vec());
        }
    }
    fn new_inode(&mut self, ino: u64) {
        self.inner.new_inode(ino);
    }
    fn known_empty(&mut self, prefix: &[u8]) {
        if crate::schema::is_listed_prefix(prefix) {
            // Its stripe now, before the commit makes the range known to
            // anyone: a change in it from then on keeps it from being set.
            self.empty_dirs.push((prefix.to_vec(), self.kv.listings.changes(prefix)));
        }
    }
    fn delete_range(&mut self, start: &[u8], end: &[u8]) -> KvResult<()> {
        self.note_range(start, end);
        self.inner.delete_range(start, end)
    }
    fn delete_range_taking(&mut self, start: &[u8], end: &[u8], into: &crate::kv::Taken) -> KvResult<()> {
        self.note_range(start, end);
        self.inner.delete_range_taking(start, end, into)
    }
    fn commit(self: Box<Self>, durability: Durability) -> KvResult<()> {
        self.commit_at(durability).map(|_| ())
    }
    fn commit_at(self: Box<Self>, durability: Durability) -> KvResult<Option<i64>> {
        let this = *self;
        let (kv, written, assumed, absent, empty_dirs, ranges, epochs) =
            (this.kv, this.written, this.assumed, this.absent, this.empty_dirs, this.ranges, this.epochs);
        let r = this.inner.commit_at(durability);
        if matches!(&r, Err(e) if !matches!(e, KvError::Conflict)) {
            // It may land later: unsettled before the evictions below.
            let keys: Vec<Vec<u8>> = written.iter().map(|(k, _)| k.clone()).collect();
            match &this.scope {
                Some(scope) => scope.hold(keys, ranges.clone()),
                None => kv.unsettled.add(&keys, &ranges, false),
            }
        }
        let ranged = !ranges.is_empty();
        match (&r, ranged) {
            (Ok(Some(rev)), true) => {
                for (start, _) in &ranges {
                    kv.listings.forget(start);
                }
                kv.drop_ranges(ranges, *rev)
            }
            (_, true) => {
                kv.evict(b"");
            }
            _ => {}
        }
        match &r {
            Ok(Some(rev)) => {
                // Later puts of a key win: the last one is what it holds.
                let mut last: std::collections::BTreeMap<&[u8], &Option<Vec<u8>>> = Default::default();
                for (k, v) in &written {
                    last.insert(k, v);
                }
                for (dir, since) in &empty_dirs {
                    // A new number's range: nothing but this commit's own
                    // writes (noted below) can be in it yet.
                    kv.listings.set(dir, Default::default(), *since);
                }
                for (k, v) in last {
                    let version = if v.is_some() { *rev } else { 0 };
                    kv.listings.note(k, v.is_some());
                    kv.fill(k, v.clone(), version, *rev, Epochs::of_in(&epochs, k));
                }
                for k in &absent {
                    if !written.iter().any(|(w, _)| w == k) {
                        kv.fill(k, None, 0, *rev, Epochs::of_in(&epochs, k));
                    }
                }
            }
            Ok(None) => {
                for (k, _) in &written {
                    kv.evict(k);
                }
            }
            Err(e) => {
                // A lost race: what the cache gave was stale. Any other
                // failure may or may not have applied the writes.
                if matches!(e, KvError::Conflict) {
                    for k in &assumed {
                        kv.evict(k);
                    }
                } else {
                    for k in assumed.iter().chain(written.iter().map(|(k, _)| k)) {
                        kv.evict(k);
                    }
                }
            }
        }
        r
    }
}

impl KvEngine for CachedKv {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn read_txn(&self) -> KvResult<Box<dyn KvRead + '_>> {
        Ok(Box::new(CachedRead { kv: self, inner: self.inner.read_txn()?, fresh: false, pinned: None }))
    }
    fn txn_limit(&self) -> Option<usize> {
        self.inner.txn_limit()
    }
    fn fresh_read_txn(&self) -> KvResult<Box<dyn KvRead + '_>> {
        Ok(Box::new(CachedRead { kv: self, inner: self.inner.read_txn()?, fresh: true, pinned: None }))
    }
    fn write_txn(&self) -> KvResult<Box<dyn KvWrite + '_>> {
        let epochs = self.epochs.all();
        Ok(Box::new(CachedWrite {
            kv: self,
            inner: self.inner.write_txn()?,
            written: Vec::new(),
            assumed: Vec::new(),
            absent: Vec::new(),
            empty_dirs: Vec::new(),
            ranges: Vec::new(),
            epochs,
            scope: None,
        }))
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
    fn unsettled_scope(&self) -> Option<Arc<UnsettledScope>> {
        Some(Arc::new(UnsettledScope { unsettled: self.unsettled.clone(), held: Mutex::default() }))
    }
    fn forget_below(&self, prefixes: &[Vec<u8>], rev: i64) {
        let mut ranges = Vec::with_capacity(prefixes.len());
        for p in prefixes {
            if crate::schema::is_listed_prefix(p) {
                self.listings.forget(p);
            }
            ranges.push(crate::schema::prefix_range(p));
        }
        self.drop_ranges(ranges, rev);
    }
}

#[cfg(test)]
mod tests {
    //! The cache against an engine whose reads can be held between the
    //! engine's answer and the fill, to order a race exactly.
    use std::collections::BTreeMap;
    use std::sync::atomic::AtomicI64;
    use std::sync::mpsc;

    use super::*;
    use crate::kv::PendingWrites;

    /// A read held after the engine answered: `reached` says so, `go` lets it on.
    struct Hold {
        reached: mpsc::Sender<()>,
        go: mpsc::Receiver<()>,
    }

    /// Each key's value and mod revision.
    type Records = BTreeMap<Vec<u8>, (Vec<u8>, i64)>;

    /// An engine with revisions and a change feed the test drives.
    #[derive(Default)]
    struct RevKv {
        data: Mutex<Records>,
        rev: AtomicI64,
        feed: Mutex<Option<RevisionFeed>>,
        hold: Mutex<Option<Hold>>,
        /// Reads asked of the engine (gets and scans).
        reads: std::sync::atomic::AtomicUsize,
        /// The next commit's answer is lost: its writes wait in `limbo`
        /// until [`RevKv::land`].
        lose_answer: std::sync::atomic::AtomicBool,
        limbo: Mutex<Option<PendingWrites>>,
    }

    impl RevKv {
        /// The commit whose answer was lost lands now; its revision.
        fn land(&self) -> i64 {
            let writes = self.limbo.lock().take().expect("a commit in limbo");
            let mut data = self.data.lock();
            let rev = self.rev.fetch_add(1, Ordering::SeqCst) + 1;
            for (k, v) in writes {
                match v {
                    Some(v) => data.insert(k, (v, rev)),
                    None => data.remove(&k),
                };
            }
            rev
        }
    }

    /// Reads at the revision of its first read, as etcd's transactions do:
    /// the records and revision then, kept.
    struct RevRead<'a>(&'a RevKv, Option<(Records, i64)>);

    impl KvRead for RevRead<'_> {
        fn get(&mut self, key: &[u8]) -> KvResult<Option<Vec<u8>>> {
            Ok(self.get_versioned(key)?.0)
        }
        fn get_versioned(&mut self, key: &[u8]) -> KvResult<(Option<Vec<u8>>, Option<Versioned>)> {
            self.0.reads.fetch_add(1, Ordering::SeqCst);
            let (value, version, at) = {
                let engine = self.0;
                let (data, rev) =
                    self.1.get_or_insert_with(|| (engine.data.lock().clone(), engine.rev.load(Ordering::SeqCst)));
                let found = data.get(key).cloned();
                (found.as_ref().map(|(v, _)| v.clone()), found.map_or(0, |(_, r)| r), *rev)
            };
            if let Some(h) = self.0.hold.lock().take() {
                h.reached.send(()).unwrap();
                h.go.recv().unwrap();
            }
            Ok((value.clone(), Some(Versioned { value, version, at })))
        }
        fn scan(&mut self, start: &[u8], end: &[u8], limit: usize) -> KvResult<Vec<(Vec<u8>, Vec<u8>)>> {
            self.0.reads.fetch_add(1, Ordering::SeqCst);
            let data = self.0.data.lock();
            Ok(data.range(start.to_vec()..end.to_vec()).take(limit).map(|(k, (v, _))| (k.clone(), v.clone())).collect())
        }
    }

    /// Writes, and the versions the transaction took as read (compared at commit).
    struct RevWrite<'a>(&'a RevKv, PendingWrites, Vec<(Vec<u8>, i64)>);

    impl KvRead for RevWrite<'_> {
        fn get(&mut self, key: &[u8]) -> KvResult<Option<Vec<u8>>> {
            match self.1.get(key) {
                Some(v) => Ok(v.clone()),
                None => RevRead(self.0, None).get(key),
            }
        }
        fn scan(&mut self, start: &[u8], end: &[u8], limit: usize) -> KvResult<Vec<(Vec<u8>, Vec<u8>)>> {
            let base = RevRead(self.0, None).scan(start, end, usize::MAX)?;
            Ok(crate::kv::merge_pending(base, &self.1, start, end, limit))
        }
    }

    impl KvWrite for RevWrite<'_> {
        fn put(&mut self, key: &[u8], value: &[u8]) {
            self.1.insert(key.to_vec(), Some(value.to_vec()));
        }
        fn delete(&mut self, key: &[u8]) {
            self.1.insert(key.to_vec(), None);
        }
        fn commit(self: Box<Self>, durability: Durability) -> KvResult<()> {
            self.commit_at(durability).map(drop)
        }
        fn assume(&mut self, key: &[u8], version: i64) -> bool {
            self.2.push((key.to_vec(), version));
            true
        }
        fn commit_at(self: Box<Self>, _: Durability) -> KvResult<Option<i64>> {
            let mut data = self.0.data.lock();
            if self.2.iter().any(|(k, v)| data.get(k).map_or(0, |(_, r)| *r) != *v) {
                return Err(KvError::Conflict);
            }
            if self.0.lose_answer.swap(false, Ordering::SeqCst) {
                *self.0.limbo.lock() = Some(self.1);
                return Err(KvError::Backend { msg: "connection reset".into(), retryable: true });
            }
            let rev = self.0.rev.fetch_add(1, Ordering::SeqCst) + 1;
            for (k, v) in self.1 {
                match v {
                    Some(v) => data.insert(k, (v, rev)),
                    None => data.remove(&k),
                };
            }
            Ok(Some(rev))
        }
    }

    impl KvEngine for RevKv {
        fn name(&self) -> &'static str {
            "rev"
        }
        fn read_txn(&self) -> KvResult<Box<dyn KvRead + '_>> {
            Ok(Box::new(RevRead(self, None)))
        }
        fn write_txn(&self) -> KvResult<Box<dyn KvWrite + '_>> {
            Ok(Box::new(RevWrite(self, PendingWrites::new(), Vec::new())))
        }
        fn sync(&self) -> KvResult<()> {
            Ok(())
        }
        fn watch_revisions(&self, on_change: RevisionFeed) -> KvResult<bool> {
            *self.feed.lock() = Some(on_change);
            Ok(true)
        }
    }

    /// A lookup that read a name before this node's commit changed it,
    /// and fills after that commit's own fill was stopped by another
    /// node's change in the same epoch stripe, must not leave its older
    /// answer cached: the name made is found, the name removed is not.
    #[test]
    fn a_read_of_an_older_state_does_not_land_after_a_commit_it_raced() {
        for removing in [false, true] {
            let engine = Arc::new(RevKv::default());
            let kv = CachedKv::wrap(engine.clone()).unwrap();
            let x = crate::schema::dentry(7, b"x");
            if removing {
                // Made before, and not cached here (it expired, or was never read).
                let rev = engine.rev.fetch_add(1, Ordering::SeqCst) + 1;
                engine.data.lock().insert(x.clone(), (b"file".to_vec(), rev));
            }
            // Another node's record, in the same stripe of epochs as x.
            let y = (0u32..)
                .map(|i| crate::schema::dentry(9, format!("y{i}").as_bytes()))
                .find(|y| Epochs::index(y) == Epochs::index(&x))
                .unwrap();
            // This node's change of x begins...
            let mut w = kv.write_txn().unwrap();
            match removing {
                false => w.put(&x, b"file"),
                true => w.delete(&x),
            }
            // ...another node changes y (the feed bumps the stripe)...
            let feed = engine.feed.lock().clone().unwrap();
            feed(&y, Some(b"other"), engine.rev.fetch_add(1, Ordering::SeqCst) + 1);
            // ...a lookup of x reads it as it was (and is held there)...
            let (reached, held) = mpsc::channel();
            let (go, wait) = mpsc::channel();
            *engine.hold.lock() = Some(Hold { reached, go: wait });
            let lookup = {
                let kv = kv.clone();
                let x = x.clone();
                std::thread::spawn(move || kv.read_txn().unwrap().get(&x).unwrap())
            };
            held.recv().unwrap();
            // ...the change commits (its own fill stopped by the bump)...
            w.commit(Durability::Buffered).unwrap();
            // ...and the lookup fills what it read, afterwards.
            go.send(()).unwrap();
            let seen = lookup.join().unwrap();
            assert_eq!(seen.is_some(), removing, "the lookup read x as it was before the commit");
            let now = kv.read_txn().unwrap().get(&x).unwrap();
            assert_eq!(now.is_some(), !removing, "removing: {removing}: x as committed, not as the older read saw it");
        }
    }

    /// A create whose commit lost its answer (the connection to etcd reset
    /// after the request went out) lands after a read of its records (the
    /// spare maker's look at the number handed out, a sweep's): the call
    /// that made it then finds it made and answers, and this node's next
    /// read of its own new inode must find it, not the absence the earlier
    /// read cached (a create that failed with ENOENT at its open). Within
    /// the call, nothing read of those records is kept; after it, they are
    /// cached again.
    #[test]
    fn a_read_while_a_commit_is_unanswered_is_not_kept_past_its_landing() {
        let engine = Arc::new(RevKv::default());
        let kv = CachedKv::wrap(engine.clone()).unwrap();
        let (inode, name) = (crate::schema::inode(5), crate::schema::dentry(7, b"f42"));
        let scope = kv.unsettled_scope().expect("a node cache has scopes");
        let mut w = kv.write_txn().unwrap();
        w.settle_in(&scope);
        w.put(&name, b"5");
        w.put(&inode, b"file");
        engine.lose_answer.store(true, Ordering::SeqCst);
        assert!(w.commit(Durability::Buffered).is_err(), "the answer is lost");
        // Read before it lands: absent.
        assert_eq!(kv.read_txn().unwrap().get(&inode).unwrap(), None);
        assert_eq!(kv.read_txn().unwrap().get(&name).unwrap(), None);
        let rev = engine.land();
        // The feed has not delivered the landing yet (it reconnects).
        assert_eq!(kv.read_txn().unwrap().get(&inode).unwrap(), Some(b"file".to_vec()), "within the call");
        drop(scope);
        assert_eq!(kv.read_txn().unwrap().get(&inode).unwrap(), Some(b"file".to_vec()), "the new inode, at once");
        assert_eq!(kv.read_txn().unwrap().get(&name).unwrap(), Some(b"5".to_vec()), "its name");
        let feed = engine.feed.lock().clone().unwrap();
        feed(&inode, Some(b"file"), rev);
        let before = reads(&engine);
        assert_eq!(kv.read_txn().unwrap().get(&inode).unwrap(), Some(b"file".to_vec()));
        assert_eq!(reads(&engine), before, "settled, it is answered from memory again");
    }

    /// A commit made outside any namespace call (the `--nowsync` flusher's
    /// batches) has no scope to settle in: its keys stay unsettled for
    /// [`UNSETTLED_MAX`] once its answer is lost, so a read before it lands
    /// is not kept over the landing either.
    #[test]
    fn a_read_while_a_scopeless_commit_is_unanswered_is_not_kept_past_its_landing() {
        let engine = Arc::new(RevKv::default());
        let kv = CachedKv::wrap(engine.clone()).unwrap();
        let inode = crate::schema::inode(9);
        let mut w = kv.write_txn().unwrap();
        w.put(&inode, b"file");
        engine.lose_answer.store(true, Ordering::SeqCst);
        assert!(w.commit(Durability::Buffered).is_err(), "the answer is lost");
        assert_eq!(kv.read_txn().unwrap().get(&inode).unwrap(), None, "before it lands");
        engine.land();
        // The feed has not delivered the landing yet (it reconnects).
        assert_eq!(kv.read_txn().unwrap().get(&inode).unwrap(), Some(b"file".to_vec()), "after it landed");
    }

    /// A read transaction reads the engine at the revision of its first
    /// read (etcd pins it there). A later read in it of a record another
    /// node changed meanwhile (the change feed evicted it, or renewed it)
    /// gets the older value: it must not be kept, or the node answers that
    /// value after the feed already told it of the newer one.
    #[test]
    fn a_later_read_of_a_pinned_transaction_is_not_kept_over_a_newer_change() {
        let engine = Arc::new(RevKv::default());
        let kv = CachedKv::wrap(engine.clone()).unwrap();
        let (a, b) = (crate::schema::inode(1), crate::schema::inode(2));
        {
            let mut data = engine.data.lock();
            data.insert(a.clone(), (b"a".to_vec(), 1));
            data.insert(b.clone(), (b"old".to_vec(), 1));
        }
        engine.rev.store(1, Ordering::SeqCst);
        let mut r = kv.read_txn().unwrap();
        assert_eq!(r.get(&a).unwrap(), Some(b"a".to_vec()), "the first read pins the transaction");
        // Another node changes b; the feed reports it.
        engine.data.lock().insert(b.clone(), (b"new".to_vec(), 2));
        engine.rev.store(2, Ordering::SeqCst);
        engine.feed.lock().clone().unwrap()(&b, Some(b"new"), 2);
        assert_eq!(r.get(&b).unwrap(), Some(b"old".to_vec()), "the pinned transaction's view");
        drop(r);
        assert_eq!(kv.read_txn().unwrap().get(&b).unwrap(), Some(b"new".to_vec()), "b after the change");
    }

    fn reads(engine: &RevKv) -> usize {
        engine.reads.load(Ordering::SeqCst)
    }

    /// A directory this node makes and fills (a dataset unpacked into it)
    /// stays known whole past one listing request's worth of names: each
    /// create's lookup of its new name is answered from memory and its
    /// commit compares the absence, without a read.
    #[test]
    fn a_directory_this_node_fills_stays_listed_as_it_grows() {
        let engine = Arc::new(RevKv::default());
        let kv = CachedKv::wrap(engine.clone()).unwrap();
        let dir = crate::schema::dentries_of(7);
        let mut w = kv.write_txn().unwrap();
        w.known_empty(&dir);
        w.put(&crate::schema::inode(7), b"dir");
        w.commit(Durability::Buffered).unwrap();
        let before = reads(&engine);
        for i in 0..LISTING_MAX + 100 {
            let name = crate::schema::dentry(7, format!("f{i}").as_bytes());
            assert_eq!(kv.read_txn().unwrap().get(&name).unwrap(), None, "lookup of new name {i}");
            let mut w = kv.write_txn().unwrap();
            assert_eq!(w.get(&name).unwrap(), None, "the create's read of name {i}");
            w.put(&name, b"file");
            w.commit(Durability::Buffered).unwrap();
        }
        assert_eq!(reads(&engine) - before, 0, "a lookup or a create's read went to the engine");
        let missing = crate::schema::dentry(7, b"not-there");
        assert_eq!(kv.read_txn().unwrap().get(&missing).unwrap(), None);
        assert_eq!(reads(&engine) - before, 0, "a name the directory lacks was read from the engine");
    }

    /// A range listed on a miss that holds more names than one request
    /// reads is listed a request's worth at a time, and then known whole:
    /// names it lacks are answered without another read.
    #[test]
    fn a_range_past_one_request_is_listed_in_pages_and_known_whole() {
        let engine = Arc::new(RevKv::default());
        let kv = CachedKv::wrap(engine.clone()).unwrap();
        let n = 2 * LISTING_MAX + 10;
        {
            let mut data = engine.data.lock();
            for i in 0..n {
                data.insert(crate::schema::xattr(9, format!("user.a{i:05}").as_bytes()), (b"v".to_vec(), 1));
            }
        }
        engine.rev.store(1, Ordering::SeqCst);
        let missing = |i: usize| crate::schema::xattr(9, format!("user.missing{i}").as_bytes());
        assert_eq!(kv.read_txn().unwrap().get(&missing(0)).unwrap(), None);
        assert_eq!(reads(&engine), 3, "three requests list {n} names, {LISTING_MAX} a request");
        for i in 1..10 {
            assert_eq!(kv.read_txn().unwrap().get(&missing(i)).unwrap(), None);
        }
        assert_eq!(reads(&engine), 3, "a name the listed range lacks was read from the engine");
        let present = crate::schema::xattr(9, format!("user.a{:05}", n - 1).as_bytes());
        assert_eq!(kv.read_txn().unwrap().get(&present).unwrap(), Some(b"v".to_vec()), "the last page's name");
    }
}
