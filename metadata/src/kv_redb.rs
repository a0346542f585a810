//! `RedbKv`: the embedded engine (one file, no server), the single-node default.
//!
//! One write transaction runs at a time (the engine's write slot), so
//! transactions never conflict. A durable commit (or `sync`) makes every
//! earlier commit durable too, which is how fsync is honoured cheaply.
//!
//! A buffered commit does not write the database: it is appended, as its
//! final puts and deletes, to a redo log beside the database (one
//! `write(2)`, never synced: it lives in the page cache, as long as the
//! process crash it covers) and kept in memory as a layer over the
//! database, which reads consult first. Every 32 buffered commits a
//! background thread writes the layers into the database in one redb
//! transaction (`Durability::None`), which stores the number of the last
//! record it holds; a durable commit writes the layers and its own writes
//! in one durable transaction. One redb commit per create cost more than
//! the rest of the create (its page copies, checksums and allocator work);
//! in a batch it is shared, and off the path of the request that made the
//! 32nd commit (a committer writes them itself only when 128 piled up).
//! Reads share one snapshot of the database per commit into it.
//!
//! Locks, in order: the write slot (`Engine::writer`), redb's own write
//! slot, `Engine::publishing`, then `Engine::snapshot` and `Engine::recent`
//! (never both at once); `Engine::wanted` is a leaf.
//!
//! A daemon that dies (kill -9, a crash) must not lose its buffered commits:
//! its kernel connection may outlive it, and the kernel then holds names and
//! handles those commits made. The next open applies the records the
//! database does not hold and empties the log; the log is emptied also when
//! everything in it is durable. After a power loss, the records that
//! reached the disk form a prefix of the commits (a record that is torn or
//! out of sequence ends the replay), which is what a durable commit just
//! before the loss would have kept.
//!
//! After an I/O error (a full disk) redb refuses all further work until the
//! database is reopened; `RedbKv` reopens it on the next transaction, which
//! rolls the database back to its last durable commit, and applies the redo
//! log again, so no buffered commit is lost to the error.

use std::collections::BTreeMap;
use std::ops::Bound;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};

use crate::kv::{
    merge_pending, pending_deletes, Durability, KvEngine, KvError, KvRead, KvResult, KvWrite, PendingWrites,
};

const TABLE: TableDefinition<&[u8], &[u8]> = TableDefinition::new("converged");

pub struct RedbKv {
    engine: Arc<Engine>,
    /// The thread that writes buffered commits into the database (see
    /// [`Engine::wanted`]); stopped and joined on drop, so that the
    /// database is closed when the engine is.
    background: Option<std::thread::JoinHandle<()>>,
}

/// The engine's state, shared with its background flush thread.
struct Engine {
    path: std::path::PathBuf,
    db: parking_lot::RwLock<Option<Arc<Database>>>,
    redo: RedoLog,
    /// The write slot: held by a write transaction from `write_txn` to its
    /// commit or drop, so each builds on the state the last one left. A
    /// durable commit holds it across its redb commit, as redb's own slot
    /// was held when every transaction was a redb transaction: a gate of
    /// the engine, not a lock of the core's order (taken before `recent`
    /// and redb's slot, never after them).
    writer: parking_lot::Mutex<()>,
    /// Buffered commits the database does not hold yet, oldest first.
    /// Replaced whole (readers keep the list they took); held only to
    /// take or replace it.
    recent: parking_lot::RwLock<Arc<Vec<Arc<Layer>>>>,
    /// An inline flush is under way: other committers go on without one.
    flushing: std::sync::atomic::AtomicBool,
    /// The database as the last commit into it left it, which every view
    /// shares until the next one (see [`Snapshot`]). Replaced whole after
    /// each commit, before the layers it holds leave `recent`; held only to
    /// take or replace it.
    snapshot: parking_lot::RwLock<Option<Arc<Snapshot>>>,
    /// Held from a commit into the database until its snapshot replaced
    /// the last one, so that snapshots are published in commit order. Taken
    /// inside redb's write slot (which already orders the commits), before
    /// `snapshot` and `recent`.
    publishing: parking_lot::Mutex<()>,
    /// Wakes the background flush: `Flush::Wanted` once `FLUSH_AT`
    /// commits piled up, `Flush::Stop` at drop. A leaf, held only to set or
    /// wait for the state.
    wanted: (parking_lot::Mutex<Flush>, parking_lot::Condvar),
}

/// What the background flush thread is asked to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flush {
    Idle,
    Wanted,
    Stop,
}

/// A read snapshot of the database, taken once per commit into it and
/// shared by every view until the next: opening a read transaction and its
/// table for each view was a tenth of a metadata operation's time.
struct Snapshot {
    db: Arc<Database>,
    table: redb::ReadOnlyTable<&'static [u8], &'static [u8]>,
    /// The last redo record the snapshot holds.
    held: u64,
}

/// One buffered commit: its redo record's number, its writes, and a
/// filter of their keys' prefixes.
struct Layer {
    seq: u64,
    writes: PendingWrites,
    keys: KeyFilter,
}

impl Layer {
    fn new(seq: u64, writes: PendingWrites) -> Layer {
        let mut keys = KeyFilter::default();
        for k in writes.keys() {
            keys.add(k);
        }
        Layer { seq, writes, keys }
    }
}

/// The first bytes of a key that [`KeyFilter`] hashes: a record kind and
/// the inode (or node) it belongs to, so that a scan of one inode's records
/// (its chunks, its xattrs) can ask the filter too.
const FILTER_PREFIX: usize = 9;

/// Which key prefixes a layer may hold (two bits of 256 per prefix; a
/// layer holds a dozen keys, so a prefix it lacks passes about once in 150
/// asks). A read checks every layer the database does not hold yet, up to
/// [`FLUSH_AT`] of them and more on a busy host: without the filter each
/// get and each scan searched each layer's map, a tenth of an unlink's time.
#[derive(Default)]
struct KeyFilter([u64; 4]);

impl KeyFilter {
    fn bits(prefix: &[u8]) -> [u8; 2] {
        // FNV-1a over at most FILTER_PREFIX bytes.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in prefix {
            h = (h ^ *b as u64).wrapping_mul(0x0000_0100_0000_01b3);
        }
        let h = h ^ (h >> 29);
        [h as u8, (h >> 8) as u8]
    }

    fn prefix(key: &[u8]) -> &[u8] {
        &key[..key.len().min(FILTER_PREFIX)]
    }

    fn add(&mut self, key: &[u8]) {
        for b in Self::bits(Self::prefix(key)) {
            self.0[(b >> 6) as usize] |= 1 << (b & 63);
        }
    }

    /// False only when no key with `key`'s prefix was added.
    fn may_hold(&self, key: &[u8]) -> bool {
        Self::bits(Self::prefix(key)).iter().all(|b| self.0[(b >> 6) as usize] & (1 << (b & 63)) != 0)
    }

    /// The prefix every key in `start..end` shares, when it is a whole
    /// filter prefix: a scan of it asks the filter with `start`. None when
    /// the range reaches past keys of one prefix.
    fn range_prefix<'a>(start: &'a [u8], end: &[u8]) -> Option<&'a [u8]> {
        let prefix = start.get(..FILTER_PREFIX)?;
        let (_, past) = crate::schema::prefix_range(prefix);
        (!past.is_empty() && end <= past.as_slice()).then_some(prefix)
    }
}

/// Buffered commits kept in memory before they go into the database in one
/// transaction, by the background flush thread: a read checks about this
/// many layers before the database.
const FLUSH_AT: usize = 32;
/// Buffered commits past which a committer writes them into the database
/// itself (the background thread is behind: a busy host), so that reads
/// never check more than about this many layers.
const FLUSH_INLINE_AT: usize = 4 * FLUSH_AT;

/// The redo log of buffered commits (see the module comment). Its fields
/// change only under redb's write slot.
struct RedoLog {
    file: std::fs::File,
    /// The last record appended (records are numbered from 1, across opens).
    appended: std::sync::atomic::AtomicU64,
    /// The last record a durable commit covers.
    durable: std::sync::atomic::AtomicU64,
    /// The log's length: where the next record starts.
    len: std::sync::atomic::AtomicU64,
    /// A record the disk cut short could not be cut off: the log is not
    /// appended to again before the database holds all of it, durably, and
    /// it starts over.
    torn: std::sync::atomic::AtomicBool,
}

/// The last redo record whose writes the database holds, stored by every
/// transaction that writes records into it (durable or not). Outside every
/// key range of the schema (which starts at printable prefixes).
const REDO_KEY: &[u8] = b"\x00redo-seq";

impl RedoLog {
    fn path(db: &Path) -> std::path::PathBuf {
        db.with_extension("redo")
    }

    /// Record in a transaction that the database holds the log up to `seq`.
    fn cover(table: &mut redb::Table<&'static [u8], &'static [u8]>, seq: u64) -> Result<(), redb::StorageError> {
        table.insert(REDO_KEY, seq.to_le_bytes().as_slice()).map(drop)
    }

    /// One record: seq, count, then each key and value (len -1: a delete), with a crc of all.
    fn encode(seq: u64, pending: &PendingWrites) -> Vec<u8> {
        let mut body = Vec::with_capacity(64);
        body.extend_from_slice(&seq.to_le_bytes());
        body.extend_from_slice(&(pending.len() as u32).to_le_bytes());
        for (k, v) in pending {
            body.extend_from_slice(&(k.len() as u32).to_le_bytes());
            body.extend_from_slice(k);
            match v {
                Some(v) => {
                    body.extend_from_slice(&(v.len() as i32).to_le_bytes());
                    body.extend_from_slice(v);
                }
                None => body.extend_from_slice(&(-1i32).to_le_bytes()),
            }
        }
        let mut rec = Vec::with_capacity(body.len() + 8);
        rec.extend_from_slice(&(body.len() as u32).to_le_bytes());
        rec.extend_from_slice(&crc32c::crc32c(&body).to_le_bytes());
        rec.extend_from_slice(&body);
        rec
    }

    /// The whole records of `bytes`, in order, up to the first torn one.
    fn decode(bytes: &[u8]) -> Vec<(u64, PendingWrites)> {
        fn take<'a>(b: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
            let (h, t) = (b.get(..n)?, b.get(n..)?);
            *b = t;
            Some(h)
        }
        fn u32_of(b: &mut &[u8]) -> Option<u32> {
            Some(u32::from_le_bytes(take(b, 4)?.try_into().ok()?))
        }
        let mut rest = bytes;
        let mut out = Vec::new();
        while let (Some(len), Some(crc)) = (u32_of(&mut rest), u32_of(&mut rest)) {
            let Some(mut body) = take(&mut rest, len as usize) else { break };
            if crc32c::crc32c(body) != crc {
                break;
            }
            let parsed = (|| {
                let seq = u64::from_le_bytes(take(&mut body, 8)?.try_into().ok()?);
                let n = u32_of(&mut body)?;
                let mut writes = PendingWrites::new();
                for _ in 0..n {
                    let klen = u32_of(&mut body)? as usize;
                    let key = take(&mut body, klen)?.to_vec();
                    let vlen = u32_of(&mut body)? as i32;
                    let value = match vlen {
                        -1 => None,
                        n => Some(take(&mut body, usize::try_from(n).ok()?)?.to_vec()),
                    };
                    writes.insert(key, value);
                }
                Some((seq, writes))
            })();
            match parsed {
                Some(r) => out.push(r),
                None => break,
            }
        }
        out
    }
}

/// redb's "previous I/O error" state, seen through any of its error types.
fn poisoned(e: &dyn std::fmt::Display) -> bool {
    e.to_string().contains("Previous I/O error")
}

impl RedbKv {
    /// Open (or create) the database file. Another daemon holding it is
    /// waited for up to `wait`, so a remount right after an unmount works.
    pub fn open(path: &Path, wait: Duration) -> KvResult<Self> {
        let engine = Arc::new(Engine::open(path, wait)?);
        let bg = engine.clone();
        let background = std::thread::Builder::new()
            .name("meta-flush".into())
            .spawn(move || bg.flush_in_background())
            .map_err(|e| KvError::backend(format!("start the metadata flush thread: {e}")))?;
        Ok(RedbKv { engine, background: Some(background) })
    }
}

impl Drop for RedbKv {
    fn drop(&mut self) {
        *self.engine.wanted.0.lock() = Flush::Stop;
        self.engine.wanted.1.notify_one();
        if let Some(t) = self.background.take() {
            let _ = t.join();
        }
    }
}

impl Engine {
    fn open(path: &Path, wait: Duration) -> KvResult<Self> {
        let db = Self::open_db(path, wait)?;
        let redo = Self::replay(&db, path)?;
        let db = Arc::new(db);
        let snapshot = Snapshot::of(&db).map_err(KvError::backend)?;
        Ok(Self {
            path: path.to_path_buf(),
            db: parking_lot::RwLock::new(Some(db)),
            redo,
            writer: parking_lot::Mutex::new(()),
            recent: parking_lot::RwLock::new(Arc::new(Vec::new())),
            flushing: std::sync::atomic::AtomicBool::new(false),
            snapshot: parking_lot::RwLock::new(Some(Arc::new(snapshot))),
            publishing: parking_lot::Mutex::new(()),
            wanted: (parking_lot::Mutex::new(Flush::Idle), parking_lot::Condvar::new()),
        })
    }

    /// Apply the buffered commits of the last daemon that the database does
    /// not hold, durably, and start an empty log.
    fn replay(db: &Database, path: &Path) -> KvResult<RedoLog> {
        use std::sync::atomic::AtomicU64;
        let log_path = RedoLog::path(path);
        let last = Self::apply_log(db, &log_path)?;
        std::fs::write(&log_path, b"").map_err(|e| KvError::backend(format!("{}: {e}", log_path.display())))?;
        // Appending: each record goes at the end, also after the log is emptied.
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(&log_path)
            .map_err(|e| KvError::backend(format!("{}: {e}", log_path.display())))?;
        Ok(RedoLog {
            file,
            appended: AtomicU64::new(last),
            durable: AtomicU64::new(last),
            len: AtomicU64::new(0),
            torn: Default::default(),
        })
    }

    /// Write into `db`, durably, the records of the log at `log_path` it does
    /// not hold, in order up to the first torn or missing one. Returns the
    /// last record the database then holds.
    fn apply_log(db: &Database, log_path: &Path) -> KvResult<u64> {
        let bytes = match std::fs::read(log_path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(KvError::backend(format!("{}: {e}", log_path.display()))),
        };
        let txn = db.begin_write().map_err(KvError::backend)?;
        let mut applied = 0usize;
        let last = {
            let mut table = txn.open_table(TABLE).map_err(KvError::backend)?;
            let covered = held_seq(&table).map_err(KvError::backend)?;
            let mut last = covered;
            for (seq, writes) in RedoLog::decode(&bytes) {
                if seq <= covered {
                    continue;
                }
                if seq != last + 1 {
                    // A gap: what follows never had what it builds on.
                    break;
                }
                apply(&mut table, &writes).map_err(KvError::backend)?;
                last = seq;
                applied += 1;
            }
            RedoLog::cover(&mut table, last).map_err(KvError::backend)?;
            last
        };
        txn.commit().map_err(KvError::backend)?;
        if applied > 0 {
            tracing::info!(commits = applied, "applied buffered metadata commits the database did not hold");
        }
        Ok(last)
    }

    fn open_db(path: &Path, wait: Duration) -> KvResult<Database> {
        let deadline = Instant::now() + wait;
        let db = loop {
            match Database::create(path) {
                Ok(db) => break db,
                Err(redb::DatabaseError::DatabaseAlreadyOpen) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(redb::DatabaseError::DatabaseAlreadyOpen) => {
                    return Err(KvError::backend(format!("{} is in use by another converged daemon", path.display())))
                }
                Err(e) => return Err(KvError::backend(format!("{}: {e}", path.display()))),
            }
        };
        let txn = db.begin_write().map_err(KvError::backend)?;
        txn.open_table(TABLE).map_err(KvError::backend)?;
        txn.commit().map_err(KvError::backend)?;
        Ok(db)
    }

    /// The open database, reopening it after redb poisoned itself: the
    /// reopened database is at its last durable commit, and takes the
    /// buffered commits after it from the redo log again.
    fn db(&self) -> KvResult<Arc<Database>> {
        if let Some(db) = self.db.read().as_ref() {
            return Ok(db.clone());
        }
        let mut slot = self.db.write();
        if let Some(db) = slot.as_ref() {
            return Ok(db.clone());
        }
        tracing::warn!(path = %self.path.display(), "reopening the metadata database after an I/O error");
        let db = Self::open_db(&self.path, Duration::from_secs(5))?;
        let last = Self::apply_log(&db, &RedoLog::path(&self.path))?;
        self.redo.durable.fetch_max(last, Ordering::SeqCst);
        let db = Arc::new(db);
        // The views of the old database make their own snapshot until this
        // one is published (they check which database theirs is of).
        let snapshot = Snapshot::of(&db).map_err(KvError::backend)?;
        *self.snapshot.write() = Some(Arc::new(snapshot));
        *slot = Some(db.clone());
        Ok(db)
    }

    /// Map a redb error; on poison, drop our handle so the next transaction reopens.
    fn check<E: std::fmt::Display>(&self, e: E) -> KvError {
        if poisoned(&e) {
            self.db.write().take();
            // Its snapshot holds the database open: a reopen would wait for it.
            self.snapshot.write().take();
            return KvError::Backend { msg: e.to_string(), retryable: true };
        }
        KvError::backend(e)
    }

    /// What a transaction reads: the buffered commits the database does not
    /// hold, over a snapshot of the database. The layers are taken first:
    /// a flush that removes some commits from them has committed them to the
    /// database before, so the snapshot taken after has them (the
    /// snapshot's record number says which layers it already holds).
    fn view(&self) -> KvResult<View> {
        let layers = self.recent.read().clone();
        let db = self.db()?;
        let shared = self.snapshot.read().clone().filter(|s| Arc::ptr_eq(&s.db, &db));
        let snap = match shared {
            Some(s) => s,
            // Reopened and not published yet: a snapshot of its own.
            None => Arc::new(Snapshot::of(&db).map_err(|e| self.check(e))?),
        };
        let from = layers.partition_point(|l| l.seq <= snap.held);
        Ok(View { snap, layers, from })
    }

    /// Write the buffered commits into the database in one transaction, then
    /// `extra` (a durable commit's own writes, which have no record), and
    /// drop the layers it then holds. `durable`: the transaction is durable,
    /// and so is every commit before it.
    fn flush(&self, durable: bool, extra: Option<&PendingWrites>) -> KvResult<()> {
        let db = self.db()?;
        let mut txn = db.begin_write().map_err(|e| self.check(e))?;
        let level = if durable { redb::Durability::Immediate } else { redb::Durability::None };
        txn.set_durability(level).map_err(|e| self.check(e))?;
        // Taken under redb's slot: no other flush removes layers meanwhile.
        let layers = self.recent.read().clone();
        let held = {
            let mut table = txn.open_table(TABLE).map_err(|e| self.check(e))?;
            let before = held_seq(&table).map_err(|e| self.check(e))?;
            let mut held = before;
            for l in layers.iter().filter(|l| l.seq > before) {
                apply(&mut table, &l.writes).map_err(|e| self.check(e))?;
                held = l.seq;
            }
            if let Some(w) = extra {
                apply(&mut table, w).map_err(|e| self.check(e))?;
            }
            RedoLog::cover(&mut table, held).map_err(|e| self.check(e))?;
            held
        };
        {
            let _order = self.publishing.lock();
            txn.commit().map_err(|e| self.check(e))?;
            // Published before the layers it holds leave `recent`: a view
            // that finds them gone finds this snapshot (or a later one).
            match Snapshot::of(&db) {
                Ok(snap) => *self.snapshot.write() = Some(Arc::new(snap)),
                Err(e) => {
                    // Committed all the same: the views make their own
                    // snapshots (of this commit or later) until the next
                    // commit publishes one.
                    self.snapshot.write().take();
                    let e = self.check(e);
                    tracing::warn!(error = %e, "could not take a read snapshot of the metadata database after a commit");
                }
            }
        }
        if durable {
            self.redo.durable.fetch_max(held, Ordering::SeqCst);
        }
        let mut recent = self.recent.write();
        if recent.first().is_some_and(|l| l.seq <= held) {
            *recent = Arc::new(recent.iter().filter(|l| l.seq > held).cloned().collect());
        }
        Ok(())
    }

    /// A buffered commit: its record appended to the redo log and its
    /// writes laid over the database. Called holding the write slot.
    fn commit_buffered(&self, writes: PendingWrites) -> KvResult<usize> {
        let redo = &self.redo;
        if redo.torn.load(Ordering::SeqCst) {
            // Behind the torn record a record would be lost at the next
            // start: first make every commit logged so far durable.
            self.flush(true, None)?;
        }
        let seq = redo.appended.load(Ordering::SeqCst);
        if redo.durable.load(Ordering::SeqCst) == seq {
            // Everything logged is durable: start the log again.
            redo.file.set_len(0).map_err(|e| KvError::backend(format!("redo log: {e}")))?;
            redo.len.store(0, Ordering::SeqCst);
            redo.torn.store(false, Ordering::SeqCst);
        }
        let rec = RedoLog::encode(seq + 1, &writes);
        let start = redo.len.load(Ordering::SeqCst);
        if let Err(e) = std::io::Write::write_all(&mut &redo.file, &rec) {
            // A full disk can take part of the record: cut it off, or the
            // records appended after it would sit behind a torn one, which
            // ends the replay (acknowledged commits lost at the next start).
            if let Err(cut) = redo.file.set_len(start) {
                tracing::error!(error = %cut, "could not cut a torn record off the redo log; the next commit makes the log durable first");
                redo.torn.store(true, Ordering::SeqCst);
            }
            return Err(KvError::backend(format!("redo log: {e}")));
        }
        redo.len.store(start + rec.len() as u64, Ordering::SeqCst);
        redo.appended.store(seq + 1, Ordering::SeqCst);
        let mut recent = self.recent.write();
        let mut layers = Vec::with_capacity(recent.len() + 1);
        layers.extend(recent.iter().cloned());
        layers.push(Arc::new(Layer::new(seq + 1, writes)));
        let n = layers.len();
        *recent = Arc::new(layers);
        Ok(n)
    }

    /// The background flush thread: writes the buffered commits into the
    /// database whenever `FLUSH_AT` of them piled up, off the path of the
    /// request that committed the last one, until the engine is dropped.
    fn flush_in_background(&self) {
        loop {
            {
                let mut wanted = self.wanted.0.lock();
                while *wanted == Flush::Idle {
                    self.wanted.1.wait(&mut wanted);
                }
                if *wanted == Flush::Stop {
                    return;
                }
                *wanted = Flush::Idle;
            }
            self.flush_inline();
        }
    }

    /// Ask the background thread for a flush.
    fn want_flush(&self) {
        let mut wanted = self.wanted.0.lock();
        if *wanted == Flush::Idle {
            *wanted = Flush::Wanted;
            self.wanted.1.notify_one();
        }
    }

    /// The flush a committer or the background thread does once enough
    /// layers piled up, unless one is under way. Its failure fails no commit (each is in the redo log
    /// and in memory): the next flush tries again.
    fn flush_inline(&self) {
        if self.flushing.swap(true, Ordering::AcqRel) {
            return;
        }
        if let Err(e) = self.flush(false, None) {
            tracing::warn!(error = %e, "could not write buffered metadata commits into the database; kept in memory and in the redo log");
        }
        self.flushing.store(false, Ordering::Release);
    }
}

/// The record number a database snapshot holds the redo log up to.
fn held_seq<T: ReadableTable<&'static [u8], &'static [u8]>>(table: &T) -> Result<u64, redb::StorageError> {
    let v = table.get(REDO_KEY)?;
    Ok(v.and_then(|v| v.value().try_into().ok()).map_or(0, u64::from_le_bytes))
}

/// Write `writes` into `table`.
fn apply(
    table: &mut redb::Table<&'static [u8], &'static [u8]>,
    writes: &PendingWrites,
) -> Result<(), redb::StorageError> {
    for (k, v) in writes {
        match v {
            Some(v) => table.insert(k.as_slice(), v.as_slice()).map(drop)?,
            None => table.remove(k.as_slice()).map(drop)?,
        }
    }
    Ok(())
}

/// A consistent view: `layers[from..]` (buffered commits, oldest first)
/// over a database snapshot that holds the ones before `from`.
struct View {
    snap: Arc<Snapshot>,
    layers: Arc<Vec<Arc<Layer>>>,
    from: usize,
}

impl Snapshot {
    fn of(db: &Arc<Database>) -> Result<Snapshot, redb::Error> {
        let table = db.begin_read()?.open_table(TABLE)?;
        let held = held_seq(&table)?;
        Ok(Snapshot { db: db.clone(), table, held })
    }
}

fn collect_range<T: ReadableTable<&'static [u8], &'static [u8]>>(
    table: &T,
    start: &[u8],
    end: &[u8],
    limit: usize,
) -> KvResult<Vec<(Vec<u8>, Vec<u8>)>> {
    let mut out = Vec::new();
    let range = table.range::<&[u8]>((Bound::Included(start), Bound::Excluded(end))).map_err(KvError::backend)?;
    for item in range.take(limit) {
        let (k, v) = item.map_err(KvError::backend)?;
        out.push((k.value().to_vec(), v.value().to_vec()));
    }
    Ok(out)
}

impl KvRead for View {
    fn get(&mut self, key: &[u8]) -> KvResult<Option<Vec<u8>>> {
        for l in self.layers[self.from..].iter().rev() {
            if !l.keys.may_hold(key) {
                continue;
            }
            if let Some(v) = l.writes.get(key) {
                return Ok(v.clone());
            }
        }
        Ok(self.snap.table.get(key).map_err(KvError::backend)?.map(|v| v.value().to_vec()))
    }
    fn scan(&mut self, start: &[u8], end: &[u8], limit: usize) -> KvResult<Vec<(Vec<u8>, Vec<u8>)>> {
        let layers = &self.layers[self.from..];
        if layers.is_empty() {
            return collect_range(&self.snap.table, start, end, limit);
        }
        let prefix = KeyFilter::range_prefix(start, end);
        let mut over = PendingWrites::new();
        for l in layers.iter().filter(|l| prefix.is_none_or(|p| l.keys.may_hold(p))) {
            for (k, v) in l.writes.range::<[u8], _>((Bound::Included(start), Bound::Excluded(end))) {
                over.insert(k.clone(), v.clone());
            }
        }
        if over.is_empty() {
            return collect_range(&self.snap.table, start, end, limit);
        }
        let extra = pending_deletes(&over, start, end);
        let base = collect_range(&self.snap.table, start, end, limit.saturating_add(extra))?;
        Ok(merge_pending(base, &over, start, end, limit))
    }
}

/// A write transaction: the write slot, a view of the state the last
/// commit left, and the writes, applied at commit.
struct RedbWrite<'a> {
    kv: &'a Engine,
    slot: parking_lot::MutexGuard<'a, ()>,
    view: View,
    pending: PendingWrites,
}

impl KvRead for RedbWrite<'_> {
    fn get(&mut self, key: &[u8]) -> KvResult<Option<Vec<u8>>> {
        if let Some(v) = self.pending.get(key) {
            return Ok(v.clone());
        }
        self.view.get(key)
    }
    fn scan(&mut self, start: &[u8], end: &[u8], limit: usize) -> KvResult<Vec<(Vec<u8>, Vec<u8>)>> {
        let extra = pending_deletes(&self.pending, start, end);
        let base = self.view.scan(start, end, limit.saturating_add(extra))?;
        Ok(merge_pending(base, &self.pending, start, end, limit))
    }
}

impl KvWrite for RedbWrite<'_> {
    fn put(&mut self, key: &[u8], value: &[u8]) {
        self.pending.insert(key.to_vec(), Some(value.to_vec()));
    }
    fn delete(&mut self, key: &[u8]) {
        self.pending.insert(key.to_vec(), None);
    }
    fn commit(self: Box<Self>, durability: Durability) -> KvResult<()> {
        let RedbWrite { kv, slot, view, pending } = *self;
        drop(view);
        match durability {
            Durability::Durable => {
                // Under the slot: the commits before it, then its own writes.
                let done = kv.flush(true, Some(&pending));
                drop(slot);
                done
            }
            Durability::Buffered if pending.is_empty() => Ok(()),
            Durability::Buffered => {
                let layers = kv.commit_buffered(pending)?;
                drop(slot);
                if layers >= FLUSH_INLINE_AT {
                    kv.flush_inline();
                } else if layers >= FLUSH_AT {
                    kv.want_flush();
                }
                Ok(())
            }
        }
    }
}

impl KvEngine for RedbKv {
    fn name(&self) -> &'static str {
        "redb"
    }
    fn read_txn(&self) -> KvResult<Box<dyn KvRead + '_>> {
        Ok(Box::new(self.engine.view()?))
    }
    fn write_txn(&self) -> KvResult<Box<dyn KvWrite + '_>> {
        let kv = &*self.engine;
        let slot = kv.writer.lock();
        let view = kv.view()?;
        Ok(Box::new(RedbWrite { kv, slot, view, pending: BTreeMap::new() }))
    }
    fn sync(&self) -> KvResult<()> {
        self.engine.flush(true, None)
    }
}

#[cfg(test)]
mod tests {
    use super::KeyFilter;
    use proptest::prelude::*;

    fn key() -> impl Strategy<Value = Vec<u8>> {
        // Few distinct bytes: keys share prefixes, as records of one inode do.
        proptest::collection::vec(prop_oneof![Just(0u8), Just(1), Just(0xfe), Just(0xff), any::<u8>()], 0..14)
    }

    proptest! {
        /// A layer's filter never says no for a key it holds, asked with
        /// the key or with any range around it that names one prefix.
        #[test]
        fn the_filter_never_hides_a_key_a_layer_holds(
            keys in proptest::collection::vec(key(), 1..24),
            start in key(),
            end in key(),
        ) {
            let mut f = KeyFilter::default();
            for k in &keys {
                f.add(k);
            }
            for k in &keys {
                prop_assert!(f.may_hold(k));
            }
            if let Some(p) = KeyFilter::range_prefix(&start, &end) {
                for k in keys.iter().filter(|k| k.as_slice() >= start.as_slice() && k.as_slice() < end.as_slice()) {
                    prop_assert!(f.may_hold(p), "{k:?} in {start:?}..{end:?} hidden");
                }
            }
        }
    }

    #[test]
    fn a_prefix_scan_of_one_inode_asks_the_filter_and_a_wider_one_does_not() {
        let (start, end) = crate::schema::prefix_range(&crate::schema::chunks_of(7));
        assert_eq!(KeyFilter::range_prefix(&start, &end), Some(&start[..]));
        let (start, end) = crate::schema::prefix_range(b"C");
        assert_eq!(KeyFilter::range_prefix(&start, &end), None);
        // From one inode's records into the next inodes': no one prefix.
        let (start, end) = (crate::schema::chunks_of(7), crate::schema::chunks_of(9));
        assert_eq!(KeyFilter::range_prefix(&start, &end), None);
        let mut f = KeyFilter::default();
        f.add(&crate::schema::chunk(7, 3));
        assert!(f.may_hold(&crate::schema::chunks_of(7)));
    }
}
