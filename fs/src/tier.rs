//! The object tier as the core uses it: the store, the backfill work queue
//! with its retry backoff, the fetch table, read times for eviction, and
//! the counters `converged status` and the metrics show. The state machine
//! that moves each file is `backfill.rs`'s; this module holds no file data.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use converged_metadata::held_locks::Mutex;
use converged_metadata::types::{Ino, Timespec};
use parking_lot::Condvar;

use crate::objects::{ObjectError, ObjectTier};

/// How the object tier behaves (mount options).
#[derive(Debug, Clone)]
pub struct TierConfig {
    /// A file must be quiet (no seal) this long before it is uploaded.
    pub backfill_delay: Duration,
    /// Keep the object when its file is deleted.
    pub keep_deleted: bool,
    /// Evict backed chunks when the data disk is fuller than this fraction...
    pub evict_high: f64,
    /// ... until it is below this one.
    pub evict_low: f64,
    /// Files uploaded at once.
    pub workers: usize,
    /// The largest object a re-key copies inside the store (S3's CopyObject
    /// stops at 5 GiB); a larger one is uploaded again, in parts, from the
    /// file's chunks.
    pub copy_limit: u64,
}

/// S3's limit on a single CopyObject.
pub const COPY_LIMIT: u64 = 5 << 30;

/// The longest object key S3, GCS and Azure accept, in bytes.
pub(crate) const MAX_KEY_BYTES: usize = 1024;

/// Longest wait between retries while the object store is unreachable.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// Work for the backfill workers.
#[derive(Default)]
pub(crate) struct Queue {
    /// Files to look at, by when.
    pub(crate) due: BTreeSet<(Instant, Ino)>,
    pub(crate) when: HashMap<Ino, Instant>,
    /// A directory was renamed: walk the renamed directories recorded in
    /// the metadata and mark every backed file below them re-keying.
    pub(crate) walk_renamed: bool,
    /// Files a worker holds now.
    pub(crate) busy: HashSet<Ino>,
    /// While the store fails: no upload starts before this.
    pub(crate) backoff_until: Option<Instant>,
    pub(crate) backoff: Duration,
    pub(crate) last_error: Option<String>,
    pub(crate) stopped: bool,
}

impl Queue {
    pub(crate) fn push(&mut self, ino: Ino, at: Instant) {
        if let Some(old) = self.when.get(&ino) {
            if *old <= at {
                return;
            }
            self.due.remove(&(*old, ino));
        }
        self.when.insert(ino, at);
        self.due.insert((at, ino));
    }

    pub(crate) fn pop_due(&mut self, now: Instant) -> Option<Ino> {
        let found = self.due.iter().find(|(at, ino)| *at <= now && !self.busy.contains(ino)).copied();
        let (at, ino) = found?;
        self.due.remove(&(at, ino));
        self.when.remove(&ino);
        self.busy.insert(ino);
        Some(ino)
    }
}

/// When membership was last looked at for dead nodes, when their work was
/// last scanned for, and which dead nodes that scan covered.
#[derive(Default)]
pub(crate) struct Adoption {
    pub(crate) looked: Option<Instant>,
    pub(crate) scanned: Option<Instant>,
    pub(crate) handled: BTreeSet<String>,
    /// The last scan found dead nodes' work (taken here or not).
    pub(crate) pending: bool,
}

/// How often membership is read for newly dead nodes.
pub(crate) const ADOPT_LOOK: Duration = Duration::from_secs(5);
/// How often the tier records are scanned again while the last scan found
/// dead nodes' work (what rendezvous gave to other nodes, or what a scan
/// run while the live set was changing left).
pub(crate) const ADOPT_RESCAN: Duration = Duration::from_secs(60);

/// Counters for `converged status` and the metrics endpoint.
#[derive(Default)]
pub struct Stats {
    pub uploaded_files: AtomicU64,
    pub uploaded_bytes: AtomicU64,
    pub failures: AtomicU64,
    pub rekeyed: AtomicU64,
    pub deleted: AtomicU64,
    pub fetched_bytes: AtomicU64,
    pub evicted_bytes: AtomicU64,
}

/// The object tier as the core uses it: the store, the backfill queue and counters.
pub struct Tiering {
    pub objects: ObjectTier,
    pub cfg: TierConfig,
    pub(crate) queue: Mutex<Queue>,
    pub(crate) wake: Condvar,
    pub stats: Stats,
    /// One fetch of a chunk at a time. A gate, not a counted lock: its
    /// holder fetches the chunk (an object-store GET), syncs it and records
    /// it (a KV transaction) holding it, and waits for nothing a waiter on
    /// it could hold (see the lock order in `core/mod.rs`).
    pub(crate) fetching: dashmap::DashMap<(Ino, u32), Arc<parking_lot::Mutex<()>>>,
    /// Last read of each chunk (seconds since the epoch), for eviction.
    pub(crate) access: dashmap::DashMap<(Ino, u32), i64>,
    /// When each imported file's object was last checked for a change.
    pub(crate) checked: dashmap::DashMap<Ino, i64>,
    /// Taking over dead nodes' backfill (see `adopt_if_nodes_died`).
    pub(crate) adopted: Mutex<Adoption>,
    /// The last backfill rescan request this node acted on (`fsck --repair`
    /// marks files to upload again and asks for one).
    pub(crate) rescanned: std::sync::atomic::AtomicU64,
    /// What reading rescan requests follows (a leaf lock).
    pub(crate) rescan_since: Mutex<crate::control::Since>,
    /// What looking for objects to delete follows: this node's purges
    /// (a leaf lock).
    pub(crate) garbage_since: Mutex<crate::control::Since>,
    /// What looking for dead nodes' backfill follows: membership changes.
    /// Taken under `adopted`, or alone; nothing is taken under it.
    pub(crate) members_since: Mutex<crate::control::Since>,
}

/// A one-line view of the backlog.
#[derive(Debug, Clone)]
pub struct Backlog {
    pub files: usize,
    pub retry_in: Option<Duration>,
    pub last_error: Option<String>,
}

impl Tiering {
    pub fn new(objects: ObjectTier, cfg: TierConfig) -> Self {
        Tiering {
            objects,
            cfg,
            queue: Mutex::default(),
            wake: Condvar::new(),
            stats: Stats::default(),
            fetching: Default::default(),
            access: Default::default(),
            checked: Default::default(),
            adopted: Mutex::default(),
            rescanned: Default::default(),
            rescan_since: Mutex::new(crate::control::Since::new(&[converged_metadata::schema::Control::Rescan])),
            garbage_since: Mutex::new(crate::control::Since::new(&[converged_metadata::schema::Control::Garbage])),
            members_since: Mutex::new(crate::control::Since::new(&[converged_metadata::schema::Control::Members])),
        }
    }

    /// Look at `ino` after the backfill delay (a seal, a rename).
    pub fn enqueue(&self, ino: Ino, after: Duration) {
        self.queue.lock().push(ino, Instant::now() + after);
        self.wake.notify_one();
    }

    /// A directory was renamed (its mark is in the metadata).
    pub fn walk_renamed_dirs(&self) {
        self.queue.lock().walk_renamed = true;
        self.wake.notify_one();
    }

    pub fn backlog(&self) -> Backlog {
        let q = self.queue.lock();
        let now = Instant::now();
        Backlog {
            files: q.due.len() + q.busy.len(),
            retry_in: q.backoff_until.filter(|t| *t > now).map(|t| t - now),
            last_error: q.last_error.clone(),
        }
    }

    pub fn stop(&self) {
        self.queue.lock().stopped = true;
        self.wake.notify_all();
    }

    pub fn touch(&self, ino: Ino, index: u32) {
        self.access.insert((ino, index), Timespec::now().sec);
    }

    pub(crate) fn failed(&self, e: &ObjectError) {
        self.stats.failures.fetch_add(1, Ordering::Relaxed);
        let mut q = self.queue.lock();
        q.backoff = (q.backoff * 2).clamp(Duration::from_secs(1), MAX_BACKOFF);
        q.backoff_until = Some(Instant::now() + q.backoff);
        q.last_error = Some(e.to_string());
        tracing::warn!(error = %e, retry_in = ?q.backoff, "object store call failed; backlog kept, retrying later");
    }

    pub(crate) fn succeeded(&self) {
        let mut q = self.queue.lock();
        if q.backoff_until.is_some() {
            tracing::info!("object store reachable again; draining the backlog");
        }
        q.backoff = Duration::ZERO;
        q.backoff_until = None;
        q.last_error = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queue_orders_by_due_time_and_skips_busy() {
        let mut q = Queue::default();
        let now = Instant::now();
        q.push(1, now + Duration::from_secs(10));
        q.push(2, now);
        q.push(1, now); // earlier wins
        assert_eq!(q.pop_due(now), Some(1));
        assert_eq!(q.pop_due(now), Some(2));
        assert_eq!(q.pop_due(now), None);
    }
}
