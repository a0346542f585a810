//! `RedbKv`: the embedded engine (one file, no server), the single-node default.
//!
//! redb runs one write transaction at a time, so transactions never conflict.
//! Buffered commits use `Durability::None`; a durable commit (or `sync`) makes
//! every earlier commit durable too, which is how fsync is honoured cheaply.
//!
//! A daemon that dies (kill -9, a crash) must not lose its buffered commits:
//! its kernel connection may outlive it, and the kernel then holds names and
//! handles those commits made. So each buffered commit is also appended, as
//! its final puts and deletes, to a redo log beside the database (one
//! `write(2)`, never synced: it lives in the page cache, as long as the
//! process crash it covers) while the commit holds redb's write slot, so the
//! log's order is the commit order. The next open applies the records the
//! last durable commit does not include (each durable commit stores the
//! sequence number of the last record it covers) and empties the log. After
//! a power loss, the records that reached the disk form a prefix of the
//! commits (a record that is torn or out of sequence ends the replay), which
//! is what a durable commit just before the loss would have kept.
//!
//! After an I/O error (a full disk) redb refuses all further work until the
//! database is reopened; `RedbKv` reopens it on the next transaction, which
//! rolls back to the last durable commit.

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
    path: std::path::PathBuf,
    db: parking_lot::RwLock<Option<Arc<Database>>>,
    redo: RedoLog,
}

/// The redo log of buffered commits (see the module comment). Its fields
/// change only under redb's write slot.
struct RedoLog {
    file: std::fs::File,
    /// The last record appended (records are numbered from 1, across opens).
    appended: std::sync::atomic::AtomicU64,
    /// The last record a durable commit covers.
    durable: std::sync::atomic::AtomicU64,
}

/// Where a durable commit stores the last redo record it covers. Outside
/// every key range of the schema (which starts at printable prefixes).
const REDO_KEY: &[u8] = b"\x00redo-seq";

impl RedoLog {
    fn path(db: &Path) -> std::path::PathBuf {
        db.with_extension("redo")
    }

    /// Record in a durable commit that it covers the log up to `seq`.
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
        let db = Self::open_db(path, wait)?;
        let redo = Self::replay(&db, path)?;
        Ok(Self { path: path.to_path_buf(), db: parking_lot::RwLock::new(Some(Arc::new(db))), redo })
    }

    /// Apply the buffered commits of the last daemon that its last durable
    /// commit does not include, durably, and start an empty log.
    fn replay(db: &Database, path: &Path) -> KvResult<RedoLog> {
        use std::sync::atomic::AtomicU64;
        let log_path = RedoLog::path(path);
        let bytes = match std::fs::read(&log_path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(KvError::backend(format!("{}: {e}", log_path.display()))),
        };
        let txn = db.begin_write().map_err(KvError::backend)?;
        let covered = {
            let table = txn.open_table(TABLE).map_err(KvError::backend)?;
            let v = table.get(REDO_KEY).map_err(KvError::backend)?;
            v.and_then(|v| v.value().try_into().ok()).map_or(0, u64::from_le_bytes)
        };
        let mut last = covered;
        let mut applied = 0usize;
        {
            let mut table = txn.open_table(TABLE).map_err(KvError::backend)?;
            for (seq, writes) in RedoLog::decode(&bytes) {
                if seq <= covered {
                    continue;
                }
                if seq != last + 1 {
                    // A gap: what follows never had what it builds on.
                    break;
                }
                for (k, v) in &writes {
                    match v {
                        Some(v) => table.insert(k.as_slice(), v.as_slice()).map(drop),
                        None => table.remove(k.as_slice()).map(drop),
                    }
                    .map_err(KvError::backend)?;
                }
                last = seq;
                applied += 1;
            }
            RedoLog::cover(&mut table, last).map_err(KvError::backend)?;
        }
        txn.commit().map_err(KvError::backend)?;
        if applied > 0 {
            tracing::info!(commits = applied, "replayed buffered metadata commits a stopped daemon had not synced");
        }
        std::fs::write(&log_path, b"").map_err(|e| KvError::backend(format!("{}: {e}", log_path.display())))?;
        // Appending: each record goes at the end, also after the log is emptied.
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(&log_path)
            .map_err(|e| KvError::backend(format!("{}: {e}", log_path.display())))?;
        Ok(RedoLog { file, appended: AtomicU64::new(last), durable: AtomicU64::new(last) })
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

    /// The open database, reopening it after redb poisoned itself.
    fn db(&self) -> KvResult<Arc<Database>> {
        if let Some(db) = self.db.read().as_ref() {
            return Ok(db.clone());
        }
        let mut slot = self.db.write();
        if let Some(db) = slot.as_ref() {
            return Ok(db.clone());
        }
        tracing::warn!(path = %self.path.display(), "reopening the metadata database after an I/O error");
        let db = Arc::new(Self::open_db(&self.path, Duration::from_secs(5))?);
        *slot = Some(db.clone());
        Ok(db)
    }

    /// Map a redb error; on poison, drop our handle so the next transaction reopens.
    fn check<E: std::fmt::Display>(&self, e: E) -> KvError {
        if poisoned(&e) {
            self.db.write().take();
            return KvError::Backend { msg: e.to_string(), retryable: true };
        }
        KvError::backend(e)
    }
}

struct RedbRead {
    _db: Arc<Database>,
    table: redb::ReadOnlyTable<&'static [u8], &'static [u8]>,
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

impl KvRead for RedbRead {
    fn get(&mut self, key: &[u8]) -> KvResult<Option<Vec<u8>>> {
        Ok(self.table.get(key).map_err(KvError::backend)?.map(|v| v.value().to_vec()))
    }
    fn scan(&mut self, start: &[u8], end: &[u8], limit: usize) -> KvResult<Vec<(Vec<u8>, Vec<u8>)>> {
        collect_range(&self.table, start, end, limit)
    }
}

/// Writes are buffered and applied at commit, because a redb `Table` borrows
/// its transaction and cannot live beside it in one struct. Reads go to a
/// read snapshot taken right after the write lock: redb runs one writer at a
/// time, so that snapshot is exactly the state this transaction builds on,
/// and reading it avoids reopening the table on every get.
struct RedbWrite<'a> {
    kv: &'a RedbKv,
    _db: Arc<Database>,
    txn: redb::WriteTransaction,
    base: redb::ReadOnlyTable<&'static [u8], &'static [u8]>,
    pending: PendingWrites,
}

impl KvRead for RedbWrite<'_> {
    fn get(&mut self, key: &[u8]) -> KvResult<Option<Vec<u8>>> {
        if let Some(v) = self.pending.get(key) {
            return Ok(v.clone());
        }
        let v = self.base.get(key).map_err(KvError::backend)?.map(|v| v.value().to_vec());
        Ok(v)
    }
    fn scan(&mut self, start: &[u8], end: &[u8], limit: usize) -> KvResult<Vec<(Vec<u8>, Vec<u8>)>> {
        let extra = pending_deletes(&self.pending, start, end);
        let base = collect_range(&self.base, start, end, limit.saturating_add(extra))?;
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
        let RedbWrite { kv, _db, mut txn, base, pending } = *self;
        drop(base);
        let level = match durability {
            Durability::Buffered => redb::Durability::None,
            Durability::Durable => redb::Durability::Immediate,
        };
        txn.set_durability(level).map_err(|e| kv.check(e))?;
        let redo = &kv.redo;
        let seq = redo.appended.load(Ordering::SeqCst);
        {
            let mut table = txn.open_table(TABLE).map_err(|e| kv.check(e))?;
            if durability == Durability::Durable {
                RedoLog::cover(&mut table, seq).map_err(|e| kv.check(e))?;
            }
            for (k, v) in &pending {
                match v {
                    Some(v) => {
                        table.insert(k.as_slice(), v.as_slice()).map_err(|e| kv.check(e))?;
                    }
                    None => {
                        table.remove(k.as_slice()).map_err(|e| kv.check(e))?;
                    }
                }
            }
        }
        if durability == Durability::Buffered && !pending.is_empty() {
            // Still holding redb's write slot: no other commit appends meanwhile.
            if redo.durable.load(Ordering::SeqCst) == seq {
                // Everything logged is durable: start the log again.
                redo.file.set_len(0).map_err(|e| KvError::backend(format!("redo log: {e}")))?;
            }
            let rec = RedoLog::encode(seq + 1, &pending);
            std::io::Write::write_all(&mut &redo.file, &rec).map_err(|e| KvError::backend(format!("redo log: {e}")))?;
            redo.appended.store(seq + 1, Ordering::SeqCst);
        }
        txn.commit().map_err(|e| kv.check(e))?;
        if durability == Durability::Durable {
            redo.durable.store(seq, Ordering::SeqCst);
        }
        Ok(())
    }
}

impl KvEngine for RedbKv {
    fn name(&self) -> &'static str {
        "redb"
    }
    fn read_txn(&self) -> KvResult<Box<dyn KvRead + '_>> {
        let db = self.db()?;
        let txn = db.begin_read().map_err(|e| self.check(e))?;
        let table = txn.open_table(TABLE).map_err(|e| self.check(e))?;
        Ok(Box::new(RedbRead { _db: db, table }))
    }
    fn write_txn(&self) -> KvResult<Box<dyn KvWrite + '_>> {
        let db = self.db()?;
        let txn = db.begin_write().map_err(|e| self.check(e))?;
        let base = db.begin_read().map_err(|e| self.check(e))?.open_table(TABLE).map_err(|e| self.check(e))?;
        Ok(Box::new(RedbWrite { kv: self, _db: db, txn, base, pending: BTreeMap::new() }))
    }
    fn sync(&self) -> KvResult<()> {
        let db = self.db()?;
        let mut txn = db.begin_write().map_err(|e| self.check(e))?;
        txn.set_durability(redb::Durability::Immediate).map_err(|e| self.check(e))?;
        let seq = self.redo.appended.load(Ordering::SeqCst);
        {
            let mut table = txn.open_table(TABLE).map_err(|e| self.check(e))?;
            RedoLog::cover(&mut table, seq).map_err(|e| self.check(e))?;
        }
        txn.commit().map_err(|e| self.check(e))?;
        self.redo.durable.store(seq, Ordering::SeqCst);
        Ok(())
    }
}
