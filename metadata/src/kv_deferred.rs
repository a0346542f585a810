//! `DeferredKv`: namespace changes a node acknowledges before they commit
//! (`--nowsync`), in the directories delegated to it.
//!
//! A directory made by a node mounted with `--nowsync` is delegated to that
//! node from birth (its `M` record, see `schema.rs`). Until the node gives
//! the delegation up, only it changes the directory's names, attributes and
//! xattrs, and the files made there: every other node reads the record
//! before it reads or changes any of them, and first has the holder commit
//! what it acknowledged and give the delegation up (a recall, over the peer
//! transport; see `Namespace::recall_dir`). A directory is delegated once,
//! at birth: given up, it stays a plain directory.
//!
//! A transaction whose every key is this node's alone ([`Own`]) is not
//! sent: its writes enter an overlay that every read on this node sees
//! first, and a queue that a flusher commits in order a few milliseconds
//! later, many changes to one etcd transaction. Each flushed transaction
//! compares the delegation records of the directories it relies on, so a
//! node that lost a delegation (it was cut off past its membership lease
//! and another node took the directory over) commits nothing more of what
//! it acknowledged there. Any other transaction is sent as before, after
//! the queued changes of the keys it touches: it reads no acknowledged,
//! uncommitted state. A durable commit (fsync) and [`KvEngine::sync`]
//! first flush everything acknowledged before they began (not what comes
//! in meanwhile: see [`DeferredKv::durable_change`]).
//!
//! A file made here is held back while its writer has it open and has not
//! published it (up to [`HOLD_MAX`]), and from its close to its publish
//! (without limit): its create commits with its first publish, so that
//! after a crash it is gone or whole, never a name without the bytes its
//! close acknowledged. A file whose create was committed before its close
//! (held open longer) is published by the close itself.
//!
//! What a crash loses: changes acknowledged and not yet flushed (at most
//! [`FLUSH_EVERY`] of them, or [`HOLD_MAX`] for a file held back), whole
//! transactions at a time; never part of one.
//!
//! Locks: `DeferredKv::state` is a leaf, held to read or change the overlay,
//! queue and delegations, never across a call to the engine. The engine's
//! change feed takes it too (`DeferredKv::observed`), under the node
//! cache's subscriber list, which is never taken while it is held. A flush is a
//! gate (`State::flushing`), not a lock: one runs at a time, and the others
//! wait for it on `changed`, holding nothing.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use crate::held_locks::Mutex;
use crate::kv::{ChangeFeed, Durability, KvEngine, KvError, KvRead, KvResult, KvWrite, PendingWrites, Versioned};
use crate::schema::{self, Subject};
use crate::types::Ino;

/// How long an acknowledged change waits for the flusher at most (unless
/// held back with its file).
pub const FLUSH_EVERY: Duration = Duration::from_millis(25);
/// How long a file made here is held back at most while it is written.
pub const HOLD_MAX: Duration = Duration::from_secs(1);
/// Most changes queued; a change past it waits for the flusher.
pub const QUEUE_MAX: usize = 8192;
/// Most directories delegated to one node; one made past it is a plain
/// directory. Every node lists the volume's delegations at once (see
/// `schema::listed_range`), so their number stays small.
pub const HELD_MAX: usize = 256;
/// A delegated directory without a change for this long is given up.
pub const IDLE: Duration = Duration::from_secs(30);
/// Keys one flushed transaction writes at most, under etcd's 128
/// operations with room for its compares.
const FLUSH_KEYS: usize = 100;

/// A directory delegated to this node: what it is doing with it. The only
/// transitions are in `DeferredKv::held_now` (born), `DeferredKv::release`
/// (given up) and `DeferredKv::fence` (taken over).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Delegation {
    /// Changes there are acknowledged before they commit.
    Holding,
    /// Being given up: nothing more is deferred there; what is queued is
    /// being committed, then the record goes.
    Releasing,
}

struct Held {
    state: Delegation,
    /// The `M` record's mod revision once committed (what each flush compares).
    version: Option<i64>,
    used: Instant,
}

/// An inode made here in a delegated directory: its records are this
/// node's alone until the directory is given up.
struct Born {
    dir: Ino,
    /// A regular file made open for writing and not published yet: its
    /// changes are held back (see [`HOLD_MAX`]).
    writing: bool,
    since: Instant,
    /// Closed by its writer before anything of it was committed: held back
    /// until published, however long that takes (its close acknowledged
    /// bytes that only its publish records).
    closed: bool,
    /// Its records the flusher committed, as committed: since no other
    /// node reaches the inode, the engine holds exactly these, and reads of
    /// its records are answered from here. A transaction sent past the
    /// overlay that writes them updates them too (see `DeferredKv::sent`).
    committed: BTreeMap<Vec<u8>, Arc<Vec<u8>>>,
    /// A sent transaction wrote its records and its outcome is not known
    /// (an error other than a conflict): `committed` may be wrong, and its
    /// records are read from the engine from then on.
    unsure: bool,
}

/// Records as a range held them (key, value).
type Records = Vec<(Vec<u8>, Vec<u8>)>;

/// A key and what a change leaves in it (`None`: deleted).
type Write = (Vec<u8>, Option<Arc<Vec<u8>>>);

/// A range a transaction scanned, with the overlay's keys (and their
/// sequence numbers) in it then.
type Scanned = (Vec<u8>, Vec<u8>, Vec<(Vec<u8>, u64)>);

/// An acknowledged change of the overlay: the value (`None`: deleted) and
/// the sequence number of the change that wrote it last.
struct Pending {
    value: Option<Arc<Vec<u8>>>,
    seq: u64,
}

/// One acknowledged transaction, queued for the flusher.
struct Op {
    seq: u64,
    writes: Vec<Write>,
    /// Delegated directories it relies on: each flush compares their records.
    dirs: Vec<Ino>,
    /// Files made here whose records it writes: held back with them.
    files: Vec<Ino>,
    /// Files it makes that are being written: a flush that carries it
    /// carries the change that settles them (see `settles`) in the same
    /// transaction, so a crash leaves them gone or whole.
    opens: Vec<Ino>,
    /// Files it publishes, stops writing, or makes durable.
    settles: Vec<Ino>,
    /// Cache hints for the commit that carries it.
    absent: Vec<Vec<u8>>,
    empty: Vec<Vec<u8>>,
}

#[derive(Default)]
struct State {
    seq: u64,
    overlay: BTreeMap<Vec<u8>, Pending>,
    queue: VecDeque<Arc<Op>>,
    held: HashMap<Ino, Held>,
    born: HashMap<Ino, Born>,
    /// Bumped by every sent transaction that writes records of this
    /// node's alone: a deferred transaction that read them before fails.
    epoch: u64,
    /// Keys sent transactions are writing right now.
    sending: HashMap<Vec<u8>, u32>,
    /// A flush is under way.
    flushing: bool,
    /// Changes dropped because a delegation was lost (for `status`).
    dropped: u64,
    /// The engine reports no changes (see `DeferredKv::observed`): nothing
    /// of another node's changes would reach `Born::committed`, so it
    /// answers no read.
    no_feed: bool,
}

/// Whose a key is, for this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Own {
    /// A record of a delegated directory held here.
    Dir(Ino),
    /// A record of an inode made here in one (`.1`: its directory).
    Born(Ino, Ino),
    /// This node's own (its ring of answered requests).
    Node,
    No,
}

impl State {
    fn holding(&self, dir: Ino) -> bool {
        self.held.get(&dir).is_some_and(|h| h.state == Delegation::Holding)
    }

    fn born_in_holding(&self, ino: Ino) -> Option<Ino> {
        self.born.get(&ino).map(|b| b.dir).filter(|d| self.holding(*d))
    }

    fn own(&self, node: &str, key: &[u8], new: &[(Ino, Ino)]) -> Own {
        let born =
            |ino: Ino| self.born_in_holding(ino).or_else(|| new.iter().find(|(i, _)| *i == ino).map(|(_, d)| *d));
        match schema::subject(key) {
            Subject::Names(dir) if self.holding(dir) => Own::Dir(dir),
            Subject::Names(dir) => born(dir).map_or(Own::No, |d| Own::Born(dir, d)),
            Subject::Inode(ino) if self.holding(ino) => Own::Dir(ino),
            Subject::Inode(ino) | Subject::File(ino) => born(ino).map_or(Own::No, |d| Own::Born(ino, d)),
            Subject::Answered(n) if n == node.as_bytes() => Own::Node,
            _ => Own::No,
        }
    }

    /// What this node knows the engine holds of `ino`'s records, when it
    /// knows it all: an inode made here, still this node's alone.
    fn known(&self, ino: Ino) -> Option<&BTreeMap<Vec<u8>, Arc<Vec<u8>>>> {
        self.born_in_holding(ino)?;
        self.born.get(&ino).filter(|b| !b.unsure && !self.no_feed).map(|b| &b.committed)
    }

    /// The engine's records of `[start, end)` when they are known here.
    fn known_range(&self, start: &[u8], end: &[u8]) -> Option<Records> {
        let known = self.known(schema::range_subject(start, end).ino()?)?;
        Some(
            known
                .range::<[u8], _>((std::ops::Bound::Included(start), std::ops::Bound::Excluded(end)))
                .map(|(k, v)| (k.clone(), v.as_ref().clone()))
                .collect(),
        )
    }

    fn in_overlay(&self, start: &[u8], end: &[u8]) -> Vec<(Vec<u8>, u64)> {
        self.overlay
            .range::<[u8], _>((std::ops::Bound::Included(start), std::ops::Bound::Excluded(end)))
            .map(|(k, p)| (k.clone(), p.seq))
            .collect()
    }

    /// A range as this node sees it before the engine is asked: the
    /// overlay's changes in it (with their sequence numbers) and, for an
    /// inode made here, what the engine holds of it. Taken in one hold of
    /// the lock: a flush that commits between two reads of them moves a
    /// change from the overlay into what the engine holds, and a reader
    /// holding the older one of each would see neither (a name it removed
    /// still listed, or one it made missing).
    fn range_view(&self, start: &[u8], end: &[u8], plain: bool) -> RangeView {
        let mut seen = Vec::new();
        let mut overlay = PendingWrites::new();
        for (k, p) in self.overlay.range::<[u8], _>((std::ops::Bound::Included(start), std::ops::Bound::Excluded(end)))
        {
            seen.push((k.clone(), p.seq));
            overlay.insert(k.clone(), p.value.as_ref().map(|v| v.as_ref().clone()));
        }
        RangeView { seen, overlay, known: if plain { None } else { self.known_range(start, end) } }
    }

    /// Whether an op is held back with a file still being written.
    fn held_back(&self, op: &Op) -> bool {
        op.files
            .iter()
            .any(|f| self.born.get(f).is_some_and(|b| b.writing && (b.closed || b.since.elapsed() < HOLD_MAX)))
    }
}

pub struct DeferredKv {
    inner: Arc<dyn KvEngine>,
    node: String,
    state: Mutex<State>,
    changed: parking_lot::Condvar,
    stop: AtomicBool,
}

/// What a flush commits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flush {
    /// What is not held back.
    Due,
    /// What is not held back, up to this sequence number (a durable
    /// commit's own change and those before it).
    Through(u64),
    /// Everything queued, held back or not (a recall, an fsync of a
    /// directory, an unmount, a transaction that reads queued changes).
    All,
}

impl DeferredKv {
    /// Wrap `inner` (a node's cached view of a shared engine) for node
    /// `node`, and start the flusher.
    pub fn wrap(inner: Arc<dyn KvEngine>, node: &str) -> Arc<DeferredKv> {
        let kv = Self::wrap_manual(inner, node);
        let weak = Arc::downgrade(&kv);
        std::thread::Builder::new()
            .name("nowsync-flush".into())
            .spawn(move || flusher(weak))
            .expect("spawn the nowsync flusher");
        kv
    }

    /// [`DeferredKv::wrap`] without the flusher: changes commit only when
    /// something asks (a flush, a durable commit, a recall). For tests
    /// that look at what is acknowledged and not committed.
    pub fn wrap_manual(inner: Arc<dyn KvEngine>, node: &str) -> Arc<DeferredKv> {
        let kv = Arc::new(DeferredKv {
            inner,
            node: node.to_string(),
            state: Mutex::new(State::default()),
            changed: parking_lot::Condvar::new(),
            stop: AtomicBool::new(false),
        });
        let weak = Arc::downgrade(&kv);
        let feed: ChangeFeed = Arc::new(move |key: &[u8], value: Option<&[u8]>| {
            if let Some(kv) = weak.upgrade() {
                kv.observed(key, value);
            }
        });
        let fed = kv.inner.watch(feed).unwrap_or_else(|e| {
            tracing::warn!(error = %e, "no change feed for --nowsync: records of inodes made here are read from the engine");
            false
        });
        kv.state.lock().no_feed = !fed;
        kv
    }

    /// A change of `key` the engine's watch reported. A record of an inode
    /// made here that another node changed (repair, drain or rebalance
    /// work on its chunks goes by inode number, past the directory's
    /// delegation) is no longer known here: its records are read from the
    /// engine from then on. This node's own changes (in the overlay, or as
    /// known) are not; one that arrives too early or too late to tell
    /// counts as another node's, which costs reads, never a stale answer.
    /// The feed starting over (an empty key: it broke, fell silent or was
    /// compacted past, and changes may have been missed) leaves no inode
    /// made here known.
    fn observed(&self, key: &[u8], value: Option<&[u8]>) {
        if key.is_empty() {
            for born in self.state.lock().born.values_mut() {
                born.unsure = true;
            }
            return;
        }
        let Some(ino) = schema::subject(key).ino() else { return };
        let mut st = self.state.lock();
        if !st.born.contains_key(&ino) {
            return;
        }
        if st.overlay.get(key).is_some_and(|p| p.value.as_deref().map(Vec::as_slice) == value) {
            return;
        }
        if let Some(born) = st.born.get_mut(&ino) {
            if born.committed.get(key).map(|v| v.as_slice()) != value {
                born.unsure = true;
            }
        }
    }

    /// Commit what is due now (what the flusher does every [`FLUSH_EVERY`]).
    pub fn flush_due(&self) -> KvResult<()> {
        self.flush(Flush::Due)
    }

    /// Commit what was acknowledged up to now and is not held back; what
    /// is acknowledged meanwhile is left to the flusher (a flush of all
    /// that is due would not end beside a steady stream of changes).
    pub fn flush_acknowledged(&self) -> KvResult<()> {
        self.flush(Flush::Through(self.acknowledged()))
    }

    /// The sequence number of the last change acknowledged.
    fn acknowledged(&self) -> u64 {
        self.state.lock().seq
    }

    /// A durable change begins (fsync): what was acknowledged before now
    /// is what its transactions on this thread flush before they commit,
    /// however many times they start over, while the guard lives (after
    /// one such flush the next attempt finds nothing of it due). Changes
    /// acknowledged after now are not part of its promise: beside a
    /// steady stream of them (an untar next to the fsync) a bound that
    /// moved with each attempt had every attempt flush and start over.
    pub fn durable_change(&self) -> DurableChange {
        let seq = self.acknowledged();
        DurableChange(DURABLE_SINCE.with(|d| d.replace(Some(seq))))
    }

    /// Whether a directory made now may be delegated here (under [`HELD_MAX`]).
    pub fn may_delegate(&self) -> bool {
        self.state.lock().held.len() < HELD_MAX
    }

    /// The directory delegated here that `ino` was made in, while the
    /// inode is still this node's alone.
    pub fn made_in(&self, ino: Ino) -> Option<Ino> {
        self.state.lock().born_in_holding(ino)
    }

    /// The writer of `ino`, a file made here, closed it. When nothing of
    /// the file is committed yet, it stays held back until its publish
    /// (whenever that comes) and this returns true: the close need not
    /// wait. Otherwise (its create already committed, or it is not a file
    /// made here) false: the close must publish before it returns, or a
    /// crash would leave its name without the bytes it acknowledged.
    pub fn close_unpublished(&self, ino: Ino) -> bool {
        let mut st = self.state.lock();
        if st.born_in_holding(ino).is_none() {
            return false;
        }
        match st.born.get_mut(&ino) {
            Some(b) if b.writing && b.committed.is_empty() && !b.unsure => {
                b.closed = true;
                true
            }
            _ => false,
        }
    }

    /// Changes acknowledged and not committed yet, and directories delegated here.
    pub fn backlog(&self) -> (usize, usize, u64) {
        let st = self.state.lock();
        (st.queue.len(), st.held.len(), st.dropped)
    }

    /// Commit every change acknowledged so far, files held back included.
    pub fn flush_all(&self) -> KvResult<()> {
        self.flush(Flush::All)
    }

    /// Give up the delegation of `dir`: commit what is queued, then drop
    /// its record (if it is this node's). Returns a revision at or after
    /// which the engine holds every change this node made there.
    pub fn release(&self, dir: Ino) -> KvResult<i64> {
        if let Some(h) = self.state.lock().held.get_mut(&dir) {
            h.state = Delegation::Releasing;
        }
        self.notify();
        let r = self.release_record(dir);
        if r.is_ok() {
            let mut st = self.state.lock();
            st.held.remove(&dir);
            st.born.retain(|_, b| b.dir != dir);
        }
        r
    }

    fn release_record(&self, dir: Ino) -> KvResult<i64> {
        let key = schema::delegation(dir);
        let mut attempt = 0u32;
        loop {
            self.flush_all()?;
            let mut txn = self.inner.write_txn()?;
            let mine = txn.get(&key)?.is_some_and(|v| v == self.node.as_bytes());
            if !mine {
                drop(txn);
                let (_, versioned) = self.inner.fresh_read_txn()?.get_versioned(&key)?;
                return Ok(versioned.map_or(0, |v| v.at));
            }
            txn.delete(&key);
            match txn.commit_at(Durability::Buffered) {
                Ok(rev) => return Ok(rev.unwrap_or(0)),
                Err(KvError::Conflict) if attempt < 16 => attempt += 1,
                Err(e) => return Err(e),
            }
        }
    }

    /// Give up every delegation held here (unmount).
    pub fn release_all(&self) -> KvResult<()> {
        let dirs: Vec<Ino> = self.state.lock().held.keys().copied().collect();
        for dir in dirs {
            self.release(dir)?;
        }
        self.flush_all()
    }

    /// Stop the flusher (what is queued stays; call [`DeferredKv::release_all`] first).
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        self.notify();
    }

    fn notify(&self) {
        self.changed.notify_all();
    }

    /// Commit queued changes: those `what` asks for, in order, many to a
    /// transaction. Returns once they are committed (or dropped, for a
    /// delegation lost).
    fn flush(&self, what: Flush) -> KvResult<()> {
        loop {
            let batch = {
                let mut st = self.state.lock();
                while st.flushing {
                    st.wait(&self.changed);
                }
                let batch = pick(&st, what, &self.limit());
                if batch.ops.is_empty() {
                    return Ok(());
                }
                st.flushing = true;
                batch
            };
            let sent = self.send(&batch);
            let mut st = self.state.lock();
            st.flushing = false;
            let r = match sent {
                Ok(Sent::Committed(rev)) => {
                    committed(&mut st, &batch, rev);
                    Ok(())
                }
                Ok(Sent::Lost(dirs)) => {
                    fence(&mut st, &dirs, &self.node);
                    Ok(())
                }
                Err(KvError::Conflict) => Ok(()),
                Err(e) => Err(e),
            };
            drop(st);
            self.notify();
            r?;
        }
    }

    fn limit(&self) -> usize {
        self.inner.txn_limit().map_or(usize::MAX, |l| l.saturating_sub(28).clamp(8, FLUSH_KEYS))
    }

    /// Send one batch: compare the delegations it relies on, write its keys.
    fn send(&self, batch: &Batch) -> KvResult<Sent> {
        let mut txn = self.inner.write_txn()?;
        let mut lost = Vec::new();
        for dir in &batch.compare {
            match txn.get(&schema::delegation(*dir))? {
                Some(v) if v == self.node.as_bytes() => {}
                _ => lost.push(*dir),
            }
        }
        if !lost.is_empty() {
            return Ok(Sent::Lost(lost));
        }
        for (k, v) in &batch.writes {
            match v {
                Some(v) => txn.put(k, v),
                None => txn.delete(k),
            }
        }
        for k in &batch.absent {
            txn.known_absent(k);
        }
        for p in &batch.empty {
            txn.known_empty(p);
        }
        Ok(Sent::Committed(txn.commit_at(Durability::Buffered)?.unwrap_or(0)))
    }

    /// Whether some change queued up to sequence number `seq` is due (not
    /// held back).
    fn has_due_through(&self, seq: u64) -> bool {
        let st = self.state.lock();
        st.queue.iter().any(|op| op.seq <= seq && !st.held_back(op))
    }

    /// Whether `key` holds an acknowledged change, or belongs to an inode
    /// whose records this node knows (unless `plain`: the engine's answer
    /// is wanted, for a transaction that will be sent).
    fn look(&self, key: &[u8], plain: bool) -> Look {
        let st = self.state.lock();
        if let Some(p) = st.overlay.get(key) {
            return Look::Pending(p.value.clone(), p.seq);
        }
        if !plain {
            if let Some(ino) = schema::subject(key).ino() {
                if let Some(known) = st.known(ino) {
                    return Look::Known(known.get(key).map(|v| v.as_ref().clone()));
                }
            }
        }
        Look::Engine
    }

    /// Decide what becomes of a finished transaction (see [`Fate`]).
    fn fate(&self, t: &DeferredTxn<'_>, durability: Durability) -> Fate {
        let mut st = self.state.lock();
        // What changed under it since it read.
        let stale = st.epoch != t.epoch
            || t.reads.iter().any(|(k, seq)| st.overlay.get(k).map_or(0, |p| p.seq) != *seq)
            || t.scans.iter().any(|(s, e, seen)| st.in_overlay(s, e) != *seen)
            || t.touched().any(|k| st.sending.contains_key(k));
        if stale {
            return Fate::Conflict;
        }
        // Inodes it makes, with the delegated directory they are named in.
        let named_in: Vec<Ino> = t
            .writes
            .iter()
            .filter(|(_, v)| v.is_some())
            .filter_map(|(k, _)| match schema::subject(k) {
                Subject::Names(dir) if st.holding(dir) => Some(dir),
                _ => None,
            })
            .collect();
        let new: Vec<(Ino, Ino)> = match named_in.first() {
            Some(dir) => t.new_inodes.iter().map(|i| (*i, *dir)).collect(),
            None => Vec::new(),
        };
        let owners: Vec<Own> = t
            .touched()
            .map(|k| st.own(&self.node, k, &new))
            .chain(t.scans.iter().map(|(s, e, _)| match schema::range_subject(s, e) {
                Subject::Other => Own::No,
                _ => st.own(&self.node, s, &new),
            }))
            .collect();
        let ranges_owned = t.ranges.iter().all(|d| {
            d.records.is_some()
                && schema::range_subject(&d.start, &d.end) != Subject::Other
                && st.own(&self.node, &d.start, &new) != Own::No
        });
        let deferrable = ranges_owned
            && !owners.contains(&Own::No)
            && owners.iter().any(|o| matches!(o, Own::Dir(_) | Own::Born(..)))
            && t.writes.len() + t.ranges.iter().map(|d| d.records.as_ref().map_or(0, Vec::len)).sum::<usize>()
                <= self.limit();
        if !deferrable {
            let queued = t.pending_read
                || t.touched().any(|k| st.overlay.contains_key(k))
                || t.scans
                    .iter()
                    .map(|(s, e, _)| (s, e))
                    .chain(t.ranges.iter().map(|d| (&d.start, &d.end)))
                    .any(|(s, e)| !st.in_overlay(s, e).is_empty());
            if queued {
                return Fate::FlushFirst;
            }
            if t.memory_read {
                return Fate::Plain;
            }
            let mine: Vec<Vec<u8>> =
                t.writes.keys().filter(|k| st.own(&self.node, k, &[]) != Own::No).cloned().collect();
            if !mine.is_empty() {
                st.epoch += 1;
                for k in &mine {
                    *st.sending.entry(k.clone()).or_default() += 1;
                }
            }
            return Fate::Send(mine);
        }
        if st.queue.len() >= QUEUE_MAX {
            return Fate::Full;
        }
        st.seq += 1;
        let seq = st.seq;
        let mut dirs: Vec<Ino> = Vec::new();
        let mut files: Vec<Ino> = Vec::new();
        for o in &owners {
            match *o {
                Own::Dir(d) => dirs.push(d),
                Own::Born(ino, d) => {
                    dirs.push(d);
                    files.push(ino);
                }
                _ => {}
            }
        }
        dirs.sort_unstable();
        dirs.dedup();
        files.sort_unstable();
        files.dedup();
        let now = Instant::now();
        for d in &dirs {
            if let Some(h) = st.held.get_mut(d) {
                h.used = now;
            }
        }
        // A range delete is acknowledged as deletes of the records it held.
        let mut all = t.writes.clone();
        for d in &t.ranges {
            let records = d.records.as_deref().unwrap_or_default();
            if let Some(into) = &d.into {
                *into.lock() = records.to_vec();
            }
            for (k, _) in records {
                all.entry(k.clone()).or_insert(None);
            }
        }
        let writes: Vec<Write> = all.into_iter().map(|(k, v)| (k, v.map(Arc::new))).collect();
        for (k, v) in &writes {
            st.overlay.insert(k.clone(), Pending { value: v.clone(), seq });
        }
        let mut opens = Vec::new();
        for (ino, dir) in &new {
            let writing = writes.iter().any(|(k, v)| v.is_some() && *k == schema::unsealed(*ino));
            if writing {
                opens.push(*ino);
            }
            st.born.insert(
                *ino,
                Born { dir: *dir, writing, since: now, closed: false, committed: BTreeMap::new(), unsure: false },
            );
        }
        for (k, v) in &writes {
            held_now(&mut st, &self.node, k, v.as_deref().map(Vec::as_slice), None);
        }
        // A file whose lease mark goes stops being written, and one whose
        // layout is recorded is published: neither is held back any more,
        // from this change on (queued with it, never before it).
        let mut settles = Vec::new();
        for f in &files {
            // An fsync of the file wants it durable now, whatever it holds.
            let settled = durability == Durability::Durable
                || writes.iter().any(|(k, v)| {
                    (v.is_none() && *k == schema::unsealed(*f))
                        || (schema::subject(k) == Subject::File(*f) && schema::is_layout(k))
                });
            if settled {
                if let Some(b) = st.born.get_mut(f) {
                    b.writing = false;
                }
                settles.push(*f);
            }
        }
        opens.retain(|f| !settles.contains(f));
        st.queue.push_back(Arc::new(Op {
            seq,
            writes,
            dirs,
            files,
            opens,
            settles,
            absent: t.absent.clone(),
            empty: t.empty.clone(),
        }));
        Fate::Queued(seq)
    }

    /// After a sent transaction that wrote keys of this node's alone: what
    /// this node knows the engine holds of inodes made here follows what
    /// it committed (`rev`), point writes and range deletes alike; after
    /// an error other than a conflict, nothing of them is known any more.
    fn sent(&self, mine: &[Vec<u8>], writes: &PendingWrites, ranges: &[(Vec<u8>, Vec<u8>)], outcome: Outcome) {
        let delegations = writes.keys().any(|k| k.len() == 9 && k.starts_with(&schema::delegations()));
        if mine.is_empty() && !delegations && ranges.is_empty() {
            return;
        }
        let mut st = self.state.lock();
        for k in mine {
            if let Some(n) = st.sending.get_mut(k) {
                *n -= 1;
                if *n == 0 {
                    st.sending.remove(k);
                }
            }
        }
        if !mine.is_empty() {
            st.epoch += 1;
        }
        match outcome {
            Outcome::Committed(rev) => {
                for (s, e) in ranges {
                    let Some(born) = schema::range_subject(s, e).ino().and_then(|i| st.born.get_mut(&i)) else {
                        continue;
                    };
                    let gone: Vec<Vec<u8>> = born
                        .committed
                        .range::<[u8], _>((
                            std::ops::Bound::Included(s.as_slice()),
                            std::ops::Bound::Excluded(e.as_slice()),
                        ))
                        .map(|(k, _)| k.clone())
                        .collect();
                    for k in gone {
                        born.committed.remove(&k);
                    }
                }
                for (k, v) in writes {
                    held_now(&mut st, &self.node, k, v.as_deref(), Some(rev));
                    let subject = schema::subject(k);
                    let Some(ino) = subject.ino() else { continue };
                    // Written past the overlay: another path may reach it now
                    // (a link elsewhere): no longer this node's alone.
                    if matches!(subject, Subject::Inode(_) | Subject::File(_)) && !st.holding(ino) {
                        st.born.remove(&ino);
                    } else if let Some(born) = st.born.get_mut(&ino) {
                        match v {
                            Some(v) => born.committed.insert(k.clone(), Arc::new(v.clone())),
                            None => born.committed.remove(k),
                        };
                    }
                }
            }
            Outcome::Unchanged => {}
            Outcome::Unknown => {
                let touched = writes
                    .keys()
                    .filter_map(|k| schema::subject(k).ino())
                    .chain(ranges.iter().filter_map(|(s, e)| schema::range_subject(s, e).ino()));
                for ino in touched.collect::<Vec<_>>() {
                    if let Some(born) = st.born.get_mut(&ino) {
                        born.unsure = true;
                    }
                }
            }
        }
        drop(st);
        self.notify();
    }
}

/// What became of a transaction sent past the overlay.
#[derive(Debug, Clone, Copy)]
enum Outcome {
    Committed(i64),
    /// Refused (a conflict): nothing of it was written.
    Unchanged,
    /// Failed otherwise: it may or may not have committed.
    Unknown,
}

/// A delegation record written (`value` this node: born; `None`: gone),
/// at `rev` when committed.
fn held_now(st: &mut State, node: &str, key: &[u8], value: Option<&[u8]>, rev: Option<i64>) {
    if !key.starts_with(&schema::delegations()) || key.len() != 9 {
        return;
    }
    let dir = schema::key_ino(key);
    match value {
        Some(v) if v == node.as_bytes() => {
            let h =
                st.held.entry(dir).or_insert(Held { state: Delegation::Holding, version: None, used: Instant::now() });
            if rev.is_some() {
                h.version = rev;
            }
        }
        _ => {
            if rev.is_some() {
                st.held.remove(&dir);
                st.born.retain(|_, b| b.dir != dir);
            }
        }
    }
}

/// A batch of queued changes, as one transaction will carry them.
struct Batch {
    ops: Vec<u64>,
    /// Each key's value from the batch's last change of it, with that change's sequence number.
    writes: Vec<Write>,
    seqs: Vec<u64>,
    compare: Vec<Ino>,
    absent: Vec<Vec<u8>>,
    empty: Vec<Vec<u8>>,
}

enum Sent {
    Committed(i64),
    /// These delegations are no longer this node's.
    Lost(Vec<Ino>),
}

/// What [`DeferredKv::look`] found of a key.
enum Look {
    Pending(Option<Arc<Vec<u8>>>, u64),
    /// A record of an inode made here, as committed (or none).
    Known(Option<Vec<u8>>),
    Engine,
}

/// What becomes of a finished transaction.
enum Fate {
    /// Acknowledged, queued with this sequence number.
    Queued(u64),
    /// Something it read changed meanwhile: run it again.
    Conflict,
    /// It touches keys with queued changes: flush them, then run it again.
    FlushFirst,
    /// It must be sent, and read records answered from memory: run it
    /// again reading them from the engine, so the commit compares them.
    Plain,
    /// The queue is full: wait for the flusher, then run it again.
    Full,
    /// Send it as usual; these keys of this node's alone it writes.
    Send(Vec<Vec<u8>>),
}

/// The next batch: queued changes in order, skipping those held back (for
/// [`Flush::Due`]), while the keys fit one transaction. A change that makes
/// a file being written goes only with the change that settles it (its
/// publish, the removal of its lease mark, its fsync) when that is queued:
/// taken together or not at all, so that no commit leaves the file's name
/// without the bytes its close acknowledged.
fn pick(st: &State, what: Flush, limit: &usize) -> Batch {
    let queue = &st.queue;
    // Where each file being written is settled, if that is queued yet.
    let mut settled = SettledAt::default();
    let takeable = |op: &Op| match what {
        Flush::All => true,
        Flush::Through(_) | Flush::Due => !st.held_back(op),
    };
    let mut chosen: BTreeSet<usize> = BTreeSet::new();
    let mut keys: HashSet<&[u8]> = HashSet::new();
    for (i, op) in queue.iter().enumerate() {
        if let Flush::Through(seq) = what {
            if op.seq > seq {
                break;
            }
        }
        if chosen.contains(&i) || !takeable(op) {
            continue;
        }
        // The change and those settling the files it makes, and theirs.
        let mut group = vec![i];
        let mut k = 0;
        while k < group.len() {
            for f in &queue[group[k]].opens {
                if let Some(j) = settled.find(queue, *f) {
                    if !group.contains(&j) && !chosen.contains(&j) {
                        group.push(j);
                    }
                }
            }
            k += 1;
        }
        if group.iter().any(|&j| !takeable(&queue[j])) {
            continue;
        }
        let new_keys: HashSet<&[u8]> = group
            .iter()
            .flat_map(|&j| queue[j].writes.iter().map(|(k, _)| k.as_slice()))
            .filter(|k| !keys.contains(k))
            .collect();
        if !chosen.is_empty() && keys.len() + new_keys.len() > *limit {
            break;
        }
        keys.extend(new_keys);
        chosen.extend(group);
    }
    let mut b = Batch {
        ops: Vec::new(),
        writes: Vec::new(),
        seqs: Vec::new(),
        compare: Vec::new(),
        absent: Vec::new(),
        empty: Vec::new(),
    };
    let mut at: HashMap<Vec<u8>, usize> = HashMap::new();
    let mut compare: HashSet<Ino> = HashSet::new();
    // Directories born in this batch: no record to compare yet.
    let mut born_here: HashSet<Ino> = HashSet::new();
    for op in chosen.into_iter().map(|i| &queue[i]) {
        for (k, v) in &op.writes {
            // A later change of the key already committed: it stays.
            if st.overlay.get(k).is_none_or(|p| p.seq < op.seq) {
                continue;
            }
            match at.get(k) {
                Some(&i) => {
                    b.writes[i].1 = v.clone();
                    b.seqs[i] = op.seq;
                }
                None => {
                    at.insert(k.clone(), b.writes.len());
                    b.writes.push((k.clone(), v.clone()));
                    b.seqs.push(op.seq);
                }
            }
        }
        for (k, v) in &op.writes {
            if v.is_some() && k.len() == 9 && k.starts_with(&schema::delegations()) {
                born_here.insert(schema::key_ino(k));
            }
        }
        for d in &op.dirs {
            if !born_here.contains(d) && st.held.get(d).is_some_and(|h| h.version.is_some()) {
                compare.insert(*d);
            }
        }
        b.absent.extend(op.absent.iter().cloned());
        b.empty.extend(op.empty.iter().cloned());
        b.ops.push(op.seq);
    }
    b.compare = compare.into_iter().collect();
    b
}

/// Where in the queue the first change settling a file is, found by
/// walking the queue from the front only as far as a question needs (a
/// publish follows the create it settles closely in an untar), not over
/// the whole queue for each batch: this runs under the state lock that
/// every namespace operation takes, beside queues of thousands.
#[derive(Default)]
struct SettledAt {
    at: HashMap<Ino, usize>,
    walked: usize,
}

impl SettledAt {
    fn find(&mut self, queue: &VecDeque<Arc<Op>>, file: Ino) -> Option<usize> {
        if let Some(&i) = self.at.get(&file) {
            return Some(i);
        }
        while self.walked < queue.len() {
            let i = self.walked;
            self.walked += 1;
            for f in &queue[i].settles {
                self.at.entry(*f).or_insert(i);
            }
            if let Some(&j) = self.at.get(&file) {
                return Some(j);
            }
        }
        None
    }
}

/// A batch committed at `rev`: its changes leave the queue, and the
/// overlay keeps only keys a later change still has queued.
fn committed(st: &mut State, b: &Batch, rev: i64) {
    // The queue is in sequence order (numbered and pushed under the state
    // lock) and so is the batch (`pick` takes it in queue order): one walk
    // beside it drops the batch's changes, a comparison a change.
    debug_assert!(b.ops.windows(2).all(|w| w[0] < w[1]), "a batch is in sequence order");
    let mut sent = b.ops.iter().copied().peekable();
    st.queue.retain(|op| {
        while sent.next_if(|&s| s < op.seq).is_some() {}
        sent.next_if_eq(&op.seq).is_none()
    });
    for ((k, v), seq) in b.writes.iter().zip(&b.seqs) {
        if st.overlay.get(k).is_some_and(|p| p.seq == *seq) {
            st.overlay.remove(k);
        }
        if let Some(ino) = schema::subject(k).ino() {
            if let Some(born) = st.born.get_mut(&ino) {
                match v {
                    Some(v) => born.committed.insert(k.clone(), v.clone()),
                    None => born.committed.remove(k),
                };
            }
        }
        if k.starts_with(&schema::delegations()) && k.len() == 9 {
            let dir = schema::key_ino(k);
            match v {
                Some(_) => {
                    if let Some(h) = st.held.get_mut(&dir) {
                        h.version = Some(rev);
                    }
                }
                None => {
                    st.held.remove(&dir);
                    st.born.retain(|_, b| b.dir != dir);
                }
            }
        }
    }
}

/// Delegations lost to another node: what was acknowledged there and not
/// committed is dropped (the crash semantics of a node cut off).
fn fence(st: &mut State, dirs: &[Ino], node: &str) {
    let doomed: Vec<Arc<Op>> = st.queue.iter().filter(|op| op.dirs.iter().any(|d| dirs.contains(d))).cloned().collect();
    for op in &doomed {
        for (k, _) in &op.writes {
            if st.overlay.get(k).is_some_and(|p| p.seq == op.seq) {
                st.overlay.remove(k);
            }
        }
    }
    st.queue.retain(|op| !op.dirs.iter().any(|d| dirs.contains(d)));
    for d in dirs {
        st.held.remove(d);
    }
    st.born.retain(|_, b| !dirs.contains(&b.dir));
    st.dropped += doomed.len() as u64;
    tracing::error!(
        node,
        dirs = ?dirs,
        changes = doomed.len(),
        "another node took over directories delegated here (this node was cut off past its membership \
         lease): changes acknowledged there and not yet committed are dropped"
    );
}

/// The flusher: commits what is due every [`FLUSH_EVERY`], and gives up
/// delegations idle for [`IDLE`].
fn flusher(kv: Weak<DeferredKv>) {
    let mut backoff = FLUSH_EVERY;
    loop {
        let Some(kv) = kv.upgrade() else { return };
        if kv.stop.load(Ordering::Acquire) {
            return;
        }
        {
            let mut st = kv.state.lock();
            if st.queue.is_empty() {
                st.wait_for(&kv.changed, Duration::from_secs(1));
            }
        }
        std::thread::sleep(backoff);
        match kv.flush(Flush::Due) {
            Ok(()) => backoff = FLUSH_EVERY,
            Err(e) => {
                backoff = (backoff * 2).min(Duration::from_secs(1));
                tracing::warn!(error = %e, "could not commit acknowledged namespace changes yet; retrying");
            }
        }
        let idle: Vec<Ino> = {
            let st = kv.state.lock();
            st.held
                .iter()
                .filter(|(d, h)| {
                    h.state == Delegation::Holding
                        && h.used.elapsed() >= IDLE
                        && !st.queue.iter().any(|op| op.dirs.contains(d))
                })
                .map(|(d, _)| *d)
                .collect()
        };
        for dir in idle {
            if let Err(e) = kv.release(dir) {
                tracing::warn!(dir, error = %e, "could not give up an idle directory delegation");
            }
        }
    }
}

thread_local! {
    /// The next write transaction of this thread reads the engine, not
    /// memory: it runs again after [`Fate::FlushFirst`] or [`Fate::Plain`],
    /// and will be sent.
    static PLAIN: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Set while a durable change runs on this thread (see
    /// [`DeferredKv::durable_change`]): what its commit makes durable first.
    static DURABLE_SINCE: std::cell::Cell<Option<u64>> = const { std::cell::Cell::new(None) };
}

/// While it lives, the durable change begun on this thread bounds what its
/// transactions flush first (see [`DeferredKv::durable_change`]); dropped,
/// it puts back the bound it replaced.
pub struct DurableChange(Option<u64>);

impl Drop for DurableChange {
    fn drop(&mut self) {
        DURABLE_SINCE.with(|d| d.set(self.0));
    }
}

/// A read view: the overlay over the engine's.
struct DeferredRead<'a> {
    kv: &'a DeferredKv,
    inner: Box<dyn KvRead + 'a>,
}

impl KvRead for DeferredRead<'_> {
    fn get(&mut self, key: &[u8]) -> KvResult<Option<Vec<u8>>> {
        match self.kv.look(key, false) {
            Look::Pending(v, _) => Ok(v.map(|v| v.as_ref().clone())),
            Look::Known(v) => Ok(v),
            Look::Engine => self.inner.get(key),
        }
    }
    fn get_versioned(&mut self, key: &[u8]) -> KvResult<(Option<Vec<u8>>, Option<Versioned>)> {
        match self.kv.look(key, false) {
            Look::Pending(v, _) => Ok((v.map(|v| v.as_ref().clone()), None)),
            Look::Known(v) => Ok((v, None)),
            Look::Engine => self.inner.get_versioned(key),
        }
    }
    fn scan(&mut self, start: &[u8], end: &[u8], limit: usize) -> KvResult<Vec<(Vec<u8>, Vec<u8>)>> {
        let RangeView { overlay: over, known, .. } = self.kv.state.lock().range_view(start, end, false);
        let base = match known {
            Some(records) => records,
            None => {
                let extra = over.values().filter(|v| v.is_none()).count();
                self.inner.scan(start, end, limit.saturating_add(extra))?
            }
        };
        Ok(crate::kv::merge_pending(base, &over, start, end, limit))
    }
    /// [`KvRead::scan`] of each range, the overlay over each; the ranges
    /// the overlay does not know whole go to the engine in one batched read.
    fn scan_many(&mut self, ranges: &[(Vec<u8>, Vec<u8>)], limit: usize) -> KvResult<Vec<crate::kv::Pairs>> {
        let views: Vec<RangeView> = ranges.iter().map(|(s, e)| self.kv.state.lock().range_view(s, e, false)).collect();
        let ask: Vec<usize> = (0..ranges.len()).filter(|i| views[*i].known.is_none()).collect();
        // Room for the engine's keys the overlay deletes, as `scan` leaves.
        let extra = ask.iter().map(|i| views[*i].overlay.values().filter(|v| v.is_none()).count()).max().unwrap_or(0);
        let asked: Vec<(Vec<u8>, Vec<u8>)> = ask.iter().map(|i| ranges[*i].clone()).collect();
        let mut fetched = self.inner.scan_many(&asked, limit.saturating_add(extra))?.into_iter();
        let mut out = Vec::with_capacity(ranges.len());
        for ((start, end), view) in ranges.iter().zip(views) {
            let base = match view.known {
                Some(records) => records,
                None => fetched.next().unwrap_or_default(),
            };
            out.push(crate::kv::merge_pending(base, &view.overlay, start, end, limit));
        }
        Ok(out)
    }
    fn get_many_versioned(&mut self, keys: &[Vec<u8>]) -> KvResult<Vec<crate::kv::Found>> {
        let mut out: Vec<Option<crate::kv::Found>> = vec![None; keys.len()];
        let mut ask = Vec::new();
        for (i, k) in keys.iter().enumerate() {
            match self.kv.look(k, false) {
                Look::Pending(v, _) => out[i] = Some((v.map(|v| v.as_ref().clone()), None)),
                Look::Known(v) => out[i] = Some((v, None)),
                Look::Engine => ask.push(i),
            }
        }
        let asked: Vec<Vec<u8>> = ask.iter().map(|i| keys[*i].clone()).collect();
        for (i, found) in ask.into_iter().zip(self.inner.get_many_versioned(&asked)?) {
            out[i] = Some(found);
        }
        Ok(out.into_iter().map(|o| o.expect("every key answered")).collect())
    }
    fn list_ranges(&mut self, prefixes: &[Vec<u8>]) -> KvResult<()> {
        // The overlay answers its own keys first; the engine's cache the rest.
        self.inner.list_ranges(prefixes)
    }
}

/// Hooks for tests, run at points where a race with another thread can
/// land (`test-util` builds only).
#[cfg(feature = "test-util")]
pub mod test_hooks {
    use std::cell::RefCell;

    thread_local! {
        static AFTER_RANGE_VIEW: RefCell<Option<Box<dyn FnOnce()>>> = const { RefCell::new(None) };
    }

    /// Run `f` once, on this thread, right after the next range read of a
    /// read-write transaction took its view of the overlay and of what
    /// this node knows the engine holds (a flush landing there).
    pub fn once_after_range_view(f: impl FnOnce() + 'static) {
        AFTER_RANGE_VIEW.with(|h| *h.borrow_mut() = Some(Box::new(f)));
    }

    pub(super) fn after_range_view() {
        if let Some(f) = AFTER_RANGE_VIEW.with(|h| h.borrow_mut().take()) {
            f();
        }
    }
}

/// A range as [`State::range_view`] found it, in one hold of the lock.
struct RangeView {
    /// The overlay's keys in it, with their sequence numbers.
    seen: Vec<(Vec<u8>, u64)>,
    /// The overlay's changes in it.
    overlay: PendingWrites,
    /// What the engine holds of it, when this node knows it all.
    known: Option<Records>,
}

/// A read-write transaction: reads see the overlay; the commit queues it
/// when every key is this node's alone, or sends it.
struct DeferredTxn<'a> {
    kv: &'a DeferredKv,
    inner: Box<dyn KvWrite + 'a>,
    epoch: u64,
    /// The last change acknowledged when it began: what a durable commit
    /// of it makes durable first.
    since: u64,
    /// Keys read, with the overlay's sequence number of each (0: none).
    reads: Vec<(Vec<u8>, u64)>,
    /// Ranges scanned, with the overlay's keys in each.
    scans: Vec<Scanned>,
    writes: PendingWrites,
    ranges: Vec<Deleted>,
    new_inodes: Vec<Ino>,
    absent: Vec<Vec<u8>>,
    empty: Vec<Vec<u8>>,
    /// Some read was answered by an acknowledged change: sent, this
    /// transaction would rest on what the engine does not hold yet.
    pending_read: bool,
    /// Some read was answered by what this node knows the engine holds (an
    /// inode made here): sent, the engine would not compare it.
    memory_read: bool,
    /// Ask the engine, not memory (see [`Fate::Plain`]).
    plain: bool,
}

impl DeferredTxn<'_> {
    /// Every key it read or writes.
    fn touched(&self) -> impl Iterator<Item = &Vec<u8>> {
        self.reads.iter().map(|(k, _)| k).chain(self.writes.keys())
    }

    fn range_deleted(&self, key: &[u8]) -> bool {
        self.ranges.iter().any(|d| key >= d.start.as_slice() && key < d.end.as_slice())
    }

    /// The records a range delete of `[start, end)` removes, when the range
    /// is this node's alone (a file's layout made here): the delete can then
    /// be acknowledged as deletes of those keys. None for any other range.
    fn expand(&mut self, start: &[u8], end: &[u8]) -> KvResult<Option<Records>> {
        let (owned, RangeView { seen, overlay: mut layered, known }) = {
            let st = self.kv.state.lock();
            let owned =
                schema::range_subject(start, end) != Subject::Other && st.own(&self.kv.node, start, &[]) != Own::No;
            (owned, st.range_view(start, end, self.plain))
        };
        if !owned {
            return Ok(None);
        }
        self.memory_read |= known.is_some();
        self.pending_read |= !seen.is_empty();
        let base = match known {
            Some(records) => records,
            None => self.inner.scan(start, end, usize::MAX >> 1)?,
        };
        for (k, v) in self.writes.range::<[u8], _>((std::ops::Bound::Included(start), std::ops::Bound::Excluded(end))) {
            layered.insert(k.clone(), v.clone());
        }
        self.scans.push((start.to_vec(), end.to_vec(), seen));
        Ok(Some(crate::kv::merge_pending(base, &layered, start, end, usize::MAX)))
    }
}

/// A range a transaction deletes; with the records it holds when the
/// range is this node's alone (see [`DeferredTxn::expand`]), and where a
/// caller takes them.
struct Deleted {
    start: Vec<u8>,
    end: Vec<u8>,
    records: Option<Records>,
    into: Option<crate::kv::Taken>,
}

impl KvRead for DeferredTxn<'_> {
    fn get(&mut self, key: &[u8]) -> KvResult<Option<Vec<u8>>> {
        if let Some(v) = self.writes.get(key) {
            return Ok(v.clone());
        }
        if self.range_deleted(key) {
            return self.inner.get(key);
        }
        match self.kv.look(key, self.plain) {
            Look::Pending(v, seq) => {
                self.reads.push((key.to_vec(), seq));
                self.pending_read = true;
                Ok(v.map(|v| v.as_ref().clone()))
            }
            Look::Known(v) => {
                self.reads.push((key.to_vec(), 0));
                self.memory_read = true;
                Ok(v)
            }
            Look::Engine => {
                self.reads.push((key.to_vec(), 0));
                self.inner.get(key)
            }
        }
    }
    fn get_many_versioned(&mut self, keys: &[Vec<u8>]) -> KvResult<Vec<crate::kv::Found>> {
        // What the transaction or the overlay holds answers itself (through
        // `get`); the engine's keys are asked together.
        let mut out: Vec<Option<crate::kv::Found>> = vec![None; keys.len()];
        let mut ask = Vec::new();
        for (i, key) in keys.iter().enumerate() {
            let own = self.writes.contains_key(key) || self.range_deleted(key);
            match own || !matches!(self.kv.look(key, self.plain), Look::Engine) {
                true => out[i] = Some((self.get(key)?, None)),
                false => {
                    self.reads.push((key.clone(), 0));
                    ask.push(i);
                }
            }
        }
        let asked: Vec<Vec<u8>> = ask.iter().map(|i| keys[*i].clone()).collect();
        if !asked.is_empty() {
            for (i, found) in ask.into_iter().zip(self.inner.get_many_versioned(&asked)?) {
                out[i] = Some(found);
            }
        }
        Ok(out.into_iter().map(|o| o.expect("every key answered")).collect())
    }
    fn scan(&mut self, start: &[u8], end: &[u8], limit: usize) -> KvResult<Vec<(Vec<u8>, Vec<u8>)>> {
        let RangeView { seen, overlay: mut layered, known } = self.kv.state.lock().range_view(start, end, self.plain);
        #[cfg(feature = "test-util")]
        test_hooks::after_range_view();
        for (k, v) in self.writes.range::<[u8], _>((std::ops::Bound::Included(start), std::ops::Bound::Excluded(end))) {
            layered.insert(k.clone(), v.clone());
        }
        self.pending_read |= !seen.is_empty();
        self.memory_read |= known.is_some();
        self.scans.push((start.to_vec(), end.to_vec(), seen));
        let base = match known {
            Some(records) => records,
            None => {
                let extra = layered.values().filter(|v| v.is_none()).count();
                self.inner.scan(start, end, limit.saturating_add(extra))?
            }
        };
        Ok(crate::kv::merge_pending(base, &layered, start, end, limit))
    }
}

impl KvWrite for DeferredTxn<'_> {
    fn settle_in(&mut self, scope: &Arc<crate::kv_cache::UnsettledScope>) {
        self.inner.settle_in(scope);
    }
    fn put(&mut self, key: &[u8], value: &[u8]) {
        self.writes.insert(key.to_vec(), Some(value.to_vec()));
        self.inner.put(key, value);
    }
    fn delete(&mut self, key: &[u8]) {
        self.writes.insert(key.to_vec(), None);
        self.inner.delete(key);
    }
    fn delete_range(&mut self, start: &[u8], end: &[u8]) -> KvResult<()> {
        let records = self.expand(start, end)?;
        self.writes.retain(|k, _| !(k.as_slice() >= start && k.as_slice() < end));
        self.ranges.push(Deleted { start: start.to_vec(), end: end.to_vec(), records, into: None });
        self.inner.delete_range(start, end)
    }
    fn delete_range_taking(&mut self, start: &[u8], end: &[u8], into: &crate::kv::Taken) -> KvResult<()> {
        let records = self.expand(start, end)?;
        self.writes.retain(|k, _| !(k.as_slice() >= start && k.as_slice() < end));
        self.ranges.push(Deleted { start: start.to_vec(), end: end.to_vec(), records, into: Some(into.clone()) });
        self.inner.delete_range_taking(start, end, into)
    }
    fn assume(&mut self, key: &[u8], version: i64) -> bool {
        self.inner.assume(key, version)
    }
    fn known_absent(&mut self, key: &[u8]) {
        self.absent.push(key.to_vec());
        self.inner.known_absent(key);
    }
    fn known_empty(&mut self, prefix: &[u8]) {
        self.empty.push(prefix.to_vec());
        self.inner.known_empty(prefix);
    }
    fn new_inode(&mut self, ino: u64) {
        self.new_inodes.push(ino);
        self.inner.new_inode(ino);
    }
    fn commit(self: Box<Self>, durability: Durability) -> KvResult<()> {
        self.commit_at(durability).map(|_| ())
    }
    fn commit_at(self: Box<Self>, durability: Durability) -> KvResult<Option<i64>> {
        let kv = self.kv;
        if self.writes.is_empty() && self.ranges.is_empty() {
            return self.inner.commit_at(durability);
        }
        if durability == Durability::Durable && kv.has_due_through(self.since) {
            // fsync's promise: what was acknowledged before is durable too
            // (but files still held back: a name without its bytes is not
            // what any close acknowledged). What this transaction read of
            // the overlay is stale after it. Changes acknowledged after it
            // began are not part of the promise: waiting for none to be
            // due would never end beside a steady stream of them (an untar).
            let since = self.since;
            drop(self);
            kv.flush(Flush::Through(since))?;
            return Err(KvError::Conflict);
        }
        match kv.fate(&self, durability) {
            Fate::Queued(seq) => {
                drop(self);
                kv.notify();
                if durability == Durability::Durable {
                    kv.flush(Flush::Through(seq))?;
                }
                Ok(None)
            }
            Fate::Conflict => Err(KvError::Conflict),
            Fate::FlushFirst => {
                drop(self);
                kv.flush_all()?;
                PLAIN.with(|p| p.set(true));
                Err(KvError::Conflict)
            }
            Fate::Plain => {
                PLAIN.with(|p| p.set(true));
                Err(KvError::Conflict)
            }
            Fate::Full => {
                drop(self);
                kv.notify();
                let mut st = kv.state.lock();
                while st.queue.len() >= QUEUE_MAX {
                    st.wait_for(&kv.changed, FLUSH_EVERY);
                }
                Err(KvError::Conflict)
            }
            Fate::Send(mine) => {
                let this = *self;
                let writes = this.writes;
                let ranges: Vec<(Vec<u8>, Vec<u8>)> = this.ranges.into_iter().map(|d| (d.start, d.end)).collect();
                let r = this.inner.commit_at(durability);
                let outcome = match &r {
                    Ok(rev) => Outcome::Committed(rev.unwrap_or(0)),
                    Err(KvError::Conflict) => Outcome::Unchanged,
                    Err(_) => Outcome::Unknown,
                };
                kv.sent(&mine, &writes, &ranges, outcome);
                r
            }
        }
    }
}

impl KvEngine for DeferredKv {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn unsettled_scope(&self) -> Option<Arc<crate::kv_cache::UnsettledScope>> {
        self.inner.unsettled_scope()
    }
    fn read_txn(&self) -> KvResult<Box<dyn KvRead + '_>> {
        Ok(Box::new(DeferredRead { kv: self, inner: self.inner.read_txn()? }))
    }
    fn fresh_read_txn(&self) -> KvResult<Box<dyn KvRead + '_>> {
        Ok(Box::new(DeferredRead { kv: self, inner: self.inner.fresh_read_txn()? }))
    }
    fn txn_limit(&self) -> Option<usize> {
        self.inner.txn_limit()
    }
    fn write_txn(&self) -> KvResult<Box<dyn KvWrite + '_>> {
        let durable = DURABLE_SINCE.with(|d| d.get());
        let (epoch, since) = {
            let st = self.state.lock();
            (st.epoch, durable.unwrap_or(st.seq))
        };
        Ok(Box::new(DeferredTxn {
            kv: self,
            inner: self.inner.write_txn()?,
            epoch,
            since,
            reads: Vec::new(),
            scans: Vec::new(),
            writes: PendingWrites::new(),
            ranges: Vec::new(),
            new_inodes: Vec::new(),
            absent: Vec::new(),
            empty: Vec::new(),
            pending_read: false,
            memory_read: false,
            plain: PLAIN.with(|p| p.replace(false)),
        }))
    }
    /// Commits what was acknowledged before it and is due (files still
    /// held back stay queued: see [`DeferredKv::flush_all`] for all of
    /// it), then syncs the engine.
    fn sync(&self) -> KvResult<()> {
        self.flush_acknowledged()?;
        self.inner.sync()
    }
    fn membership(&self) -> Option<&dyn crate::membership::Membership> {
        self.inner.membership()
    }
    fn watch(&self, on_change: ChangeFeed) -> KvResult<bool> {
        self.inner.watch(on_change)
    }
    fn forget_below(&self, prefixes: &[Vec<u8>], rev: i64) {
        self.inner.forget_below(prefixes, rev)
    }
}

impl Drop for DeferredKv {
    fn drop(&mut self) {
        let queued = self.state.get_mut().queue.len();
        if queued > 0 {
            tracing::warn!(
                queued,
                "namespace changes acknowledged and never committed (the mount ended without a flush)"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(seq: u64, key: &str, opens: &[Ino], settles: &[Ino]) -> Arc<Op> {
        Arc::new(Op {
            seq,
            writes: vec![(key.as_bytes().to_vec(), Some(Arc::new(vec![1])))],
            dirs: Vec::new(),
            files: Vec::new(),
            opens: opens.to_vec(),
            settles: settles.to_vec(),
            absent: Vec::new(),
            empty: Vec::new(),
        })
    }

    #[test]
    fn the_first_change_settling_a_file_is_found_wherever_the_walk_stopped() {
        let queue: VecDeque<Arc<Op>> =
            [op(1, "a", &[5], &[]), op(2, "b", &[], &[7]), op(3, "c", &[], &[5]), op(4, "d", &[], &[5])].into();
        let mut at = SettledAt::default();
        assert_eq!(at.find(&queue, 5), Some(2), "the first of two settling changes");
        assert_eq!(at.find(&queue, 7), Some(1), "one walked past on the way");
        assert_eq!(at.find(&queue, 9), None, "settled nowhere");
        assert_eq!(at.find(&queue, 5), Some(2), "asked again after the walk reached the end");
    }

    #[test]
    fn a_batch_takes_a_new_file_with_the_change_that_settles_it_or_neither() {
        let st = State {
            queue: [op(1, "a", &[5], &[]), op(2, "b", &[], &[]), op(3, "c", &[], &[5])].into(),
            ..State::default()
        };
        // Room for two keys: the create and its settle, the unrelated change next time.
        assert_eq!(pick(&st, Flush::All, &2).ops, vec![1, 3]);
        // Room for one: the first group goes whole all the same (every flush
        // moves the queue on), and nothing after it.
        assert_eq!(pick(&st, Flush::All, &1).ops, vec![1, 3]);
        assert_eq!(pick(&st, Flush::All, &100).ops, vec![1, 2, 3]);
    }
}
