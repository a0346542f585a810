//! `RedbKv`: the embedded engine (one file, no server), the single-node default.
//!
//! redb runs one write transaction at a time, so transactions never conflict.
//! Buffered commits use `Durability::None`; a durable commit (or `sync`) makes
//! every earlier commit durable too, which is how fsync is honoured cheaply.
//!
//! After an I/O error (a full disk) redb refuses all further work until the
//! database is reopened; `RedbKv` reopens it on the next transaction, which
//! rolls back to the last durable commit.

use std::collections::BTreeMap;
use std::ops::Bound;
use std::path::Path;
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
        Ok(Self { path: path.to_path_buf(), db: parking_lot::RwLock::new(Some(Arc::new(db))) })
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
        {
            let mut table = txn.open_table(TABLE).map_err(|e| kv.check(e))?;
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
        txn.commit().map_err(|e| kv.check(e))
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
        txn.commit().map_err(|e| self.check(e))
    }
}
