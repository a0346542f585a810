//! `FaultyKv`: wraps any engine and fails chosen commits on purpose, so the
//! retry and error paths of the namespace are tested deliberately.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use crate::kv::{Durability, KvEngine, KvError, KvRead, KvResult, KvWrite};

/// Which failure the next commits report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    Conflict,
    NoSpace,
    /// The engine does not answer (a node cut off from etcd, or killed
    /// between its last write and its commit): not retryable.
    Unavailable,
    /// The engine cannot be reached (etcd stopped: its address refuses the
    /// connection at once): a retryable error, and nothing lands.
    Refused,
    /// The commit lands but its answer is lost (the connection to etcd
    /// reset after the request went out): a retryable error, though the
    /// change is made, and nothing the answer carries (the records a range
    /// delete took) comes back.
    Unanswered,
    /// The commit is still on its way when its error comes back (retryable),
    /// and lands during the next write transaction, after that one's first
    /// read: the rest of what it reads shows the landed change, as a node
    /// cache the change feed updated would, and its commit (or its end)
    /// finds the change made.
    LandsLate,
    /// The disk is full when a transaction begins (read or write): redb
    /// reopening its database after a disk-full error writes before it
    /// can read. Counted per transaction, not per commit.
    FullAtBegin,
}

/// A write of a transaction, kept to land it later ([`Fault::LandsLate`]).
#[derive(Clone)]
enum Op {
    Put(Vec<u8>, Vec<u8>),
    Delete(Vec<u8>),
    DeleteRange(Vec<u8>, Vec<u8>),
}

impl Op {
    /// What the last of `ops` that touches `key` made of it.
    fn last_of(ops: &[Op], key: &[u8]) -> Option<Option<Vec<u8>>> {
        ops.iter().rev().find_map(|op| op.of(key))
    }

    /// What this write makes of `key`, if it touches it.
    fn of(&self, key: &[u8]) -> Option<Option<Vec<u8>>> {
        match self {
            Op::Put(k, v) if k == key => Some(Some(v.clone())),
            Op::Delete(k) if k == key => Some(None),
            Op::DeleteRange(s, e) if s.as_slice() <= key && key < e.as_slice() => Some(None),
            _ => None,
        }
    }
}

pub struct FaultyKv {
    inner: Arc<dyn KvEngine>,
    fault: parking_lot::Mutex<Option<Fault>>,
    /// Commits to let through before failing.
    skip: AtomicU32,
    /// Commits still to fail.
    remaining: AtomicU32,
    /// Commits that were failed so far.
    pub injected: AtomicU32,
    /// The writes of a commit that lands late, until the next write
    /// transaction takes them.
    late: parking_lot::Mutex<Option<Vec<Op>>>,
}

impl FaultyKv {
    pub fn new(inner: Arc<dyn KvEngine>) -> Self {
        Self {
            inner,
            fault: Default::default(),
            skip: AtomicU32::new(0),
            remaining: AtomicU32::new(0),
            injected: AtomicU32::new(0),
            late: Default::default(),
        }
    }

    /// Commit `ops` in a transaction of their own.
    fn land(&self, ops: &[Op]) {
        let landed = self.inner.write_txn().and_then(|mut txn| {
            for op in ops {
                match op {
                    Op::Put(k, v) => txn.put(k, v),
                    Op::Delete(k) => txn.delete(k),
                    Op::DeleteRange(s, e) => txn.delete_range(s, e)?,
                }
            }
            txn.commit(Durability::Durable)
        });
        if let Err(e) = landed {
            tracing::warn!(error = %e, "injected: the late commit did not land");
        }
    }

    /// Fail the next `count` commits with `fault`.
    pub fn fail_next(&self, fault: Fault, count: u32) {
        self.fail_after(0, fault, count);
    }

    /// Let `skip` commits through, then fail `count` with `fault` (a crash
    /// in the middle of an operation made of several transactions).
    pub fn fail_after(&self, skip: u32, fault: Fault, count: u32) {
        *self.fault.lock() = Some(fault);
        self.skip.store(skip, Ordering::SeqCst);
        self.remaining.store(count, Ordering::SeqCst);
    }

    /// The fault a commit (`at_begin` false) or a transaction's start
    /// (`at_begin`: [`Fault::FullAtBegin`] only) meets next.
    fn take_fault(&self, at_begin: bool) -> Option<Fault> {
        let fault = (*self.fault.lock())?;
        if (fault == Fault::FullAtBegin) != at_begin {
            return None;
        }
        if self.skip.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok() {
            return None;
        }
        self.remaining.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).ok().map(|_| {
            self.injected.fetch_add(1, Ordering::SeqCst);
            fault
        })
    }
}

struct FaultyWrite<'a> {
    kv: &'a FaultyKv,
    /// Taken out only when the transaction ends (to land a late commit
    /// after it, see `Drop`).
    inner: Option<Box<dyn KvWrite + 'a>>,
    /// What range deletes took, for each caller's buffer: handed on with the
    /// commit's answer, so a lost answer loses them, as it does on etcd.
    taken: Vec<(crate::kv::Taken, crate::kv::Taken)>,
    /// This transaction's writes, for a commit that lands late.
    ops: Vec<Op>,
    /// Reads so far.
    reads: usize,
    /// A late commit landing during this transaction (after its first read).
    landing: Option<Vec<Op>>,
}

impl<'a> FaultyWrite<'a> {
    fn inner(&mut self) -> &mut (dyn KvWrite + 'a) {
        self.inner.as_mut().expect("open until the transaction ends").as_mut()
    }

    /// Count a read (a batch counts once): the late commit's writes, once
    /// they have landed for it (every read after the first).
    fn read_landed(&mut self) -> Option<&[Op]> {
        self.reads += 1;
        self.landing.as_deref().filter(|_| self.reads > 1)
    }

    /// What the late commit made of `key`, once it has landed for this read.
    fn landed(&mut self, key: &[u8]) -> Option<Option<Vec<u8>>> {
        Op::last_of(self.read_landed()?, key)
    }

    fn hand_on_taken(taken: Vec<(crate::kv::Taken, crate::kv::Taken)>) {
        for (mine, theirs) in taken {
            *theirs.lock() = std::mem::take(&mut *mine.lock());
        }
    }
}

impl Drop for FaultyWrite<'_> {
    fn drop(&mut self) {
        // The late commit lands once this transaction let go of the engine
        // (a write transaction of redb or of memory excludes others).
        drop(self.inner.take());
        if let Some(ops) = self.landing.take() {
            self.kv.land(&ops);
        }
    }
}

impl KvRead for FaultyWrite<'_> {
    fn get(&mut self, key: &[u8]) -> KvResult<Option<Vec<u8>>> {
        match self.landed(key) {
            Some(v) => Ok(v),
            None => self.inner().get(key),
        }
    }
    fn get_versioned(&mut self, key: &[u8]) -> KvResult<(Option<Vec<u8>>, Option<crate::kv::Versioned>)> {
        match self.landed(key) {
            Some(v) => Ok((v, None)),
            None => self.inner().get_versioned(key),
        }
    }
    fn get_many_versioned(&mut self, keys: &[Vec<u8>]) -> KvResult<Vec<crate::kv::Found>> {
        let mut found = self.inner().get_many_versioned(keys)?;
        if let Some(ops) = self.read_landed() {
            for (key, f) in keys.iter().zip(found.iter_mut()) {
                if let Some(v) = Op::last_of(ops, key) {
                    *f = (v, None);
                }
            }
        }
        Ok(found)
    }
    /// Scans show the state before a late commit lands (the namespace
    /// operations the fault is aimed at read their names and inodes with
    /// `get`).
    fn scan(&mut self, start: &[u8], end: &[u8], limit: usize) -> KvResult<Vec<(Vec<u8>, Vec<u8>)>> {
        self.reads += 1;
        self.inner().scan(start, end, limit)
    }
}

impl KvWrite for FaultyWrite<'_> {
    fn settle_in(&mut self, scope: &Arc<crate::kv_cache::UnsettledScope>) {
        self.inner().settle_in(scope)
    }
    fn put(&mut self, key: &[u8], value: &[u8]) {
        self.ops.push(Op::Put(key.to_vec(), value.to_vec()));
        self.inner().put(key, value)
    }
    fn delete(&mut self, key: &[u8]) {
        self.ops.push(Op::Delete(key.to_vec()));
        self.inner().delete(key)
    }
    fn delete_range(&mut self, start: &[u8], end: &[u8]) -> KvResult<()> {
        self.ops.push(Op::DeleteRange(start.to_vec(), end.to_vec()));
        self.inner().delete_range(start, end)
    }
    fn delete_range_taking(&mut self, start: &[u8], end: &[u8], into: &crate::kv::Taken) -> KvResult<()> {
        self.ops.push(Op::DeleteRange(start.to_vec(), end.to_vec()));
        let mine = crate::kv::Taken::default();
        self.inner().delete_range_taking(start, end, &mine)?;
        self.taken.push((mine, into.clone()));
        Ok(())
    }
    fn assume(&mut self, key: &[u8], version: i64) -> bool {
        self.inner().assume(key, version)
    }
    fn known_absent(&mut self, key: &[u8]) {
        self.inner().known_absent(key)
    }
    fn known_empty(&mut self, prefix: &[u8]) {
        self.inner().known_empty(prefix)
    }
    fn commit(self: Box<Self>, durability: Durability) -> KvResult<()> {
        self.commit_at(durability).map(|_| ())
    }
    fn commit_at(mut self: Box<Self>, durability: Durability) -> KvResult<Option<i64>> {
        let kv = self.kv;
        let inner = self.inner.take().expect("open until the transaction ends");
        let (taken, ops) = (std::mem::take(&mut self.taken), std::mem::take(&mut self.ops));
        if self.landing.is_some() {
            // The late commit landed before this one: what this one read
            // before it (the first read) is compared, and changed.
            drop(inner);
            drop(self);
            return Err(KvError::Conflict);
        }
        match kv.take_fault(false) {
            Some(Fault::Conflict) => Err(KvError::Conflict),
            Some(Fault::NoSpace) => Err(KvError::NoSpace),
            Some(Fault::Unavailable) => {
                Err(KvError::Backend { msg: "injected: metadata engine unavailable".into(), retryable: false })
            }
            Some(Fault::Refused) => {
                Err(KvError::Backend { msg: "injected: connection refused".into(), retryable: true })
            }
            Some(Fault::Unanswered) => {
                inner.commit_at(durability)?;
                Err(KvError::Backend { msg: "injected: the commit's answer was lost".into(), retryable: true })
            }
            Some(Fault::LandsLate) => {
                drop(inner);
                *kv.late.lock() = Some(ops);
                Err(KvError::Backend { msg: "injected: the commit is still on its way".into(), retryable: true })
            }
            // (`FullAtBegin` is met when a transaction begins, not here.)
            Some(Fault::FullAtBegin) | None => {
                let rev = inner.commit_at(durability)?;
                FaultyWrite::hand_on_taken(taken);
                Ok(rev)
            }
        }
    }
}

impl KvEngine for FaultyKv {
    fn name(&self) -> &'static str {
        "faulty"
    }
    fn unsettled_scope(&self) -> Option<Arc<crate::kv_cache::UnsettledScope>> {
        self.inner.unsettled_scope()
    }
    fn read_txn(&self) -> KvResult<Box<dyn KvRead + '_>> {
        if self.take_fault(true).is_some() {
            return Err(KvError::NoSpace);
        }
        self.inner.read_txn()
    }
    fn txn_limit(&self) -> Option<usize> {
        self.inner.txn_limit()
    }
    fn fresh_read_txn(&self) -> KvResult<Box<dyn KvRead + '_>> {
        self.inner.fresh_read_txn()
    }
    fn write_txn(&self) -> KvResult<Box<dyn KvWrite + '_>> {
        if self.take_fault(true).is_some() {
            return Err(KvError::NoSpace);
        }
        let inner = self.inner.write_txn()?;
        let landing = self.late.lock().take();
        Ok(Box::new(FaultyWrite {
            kv: self,
            inner: Some(inner),
            taken: Vec::new(),
            ops: Vec::new(),
            reads: 0,
            landing,
        }))
    }
    fn sync(&self) -> KvResult<()> {
        self.inner.sync()
    }
    fn membership(&self) -> Option<&dyn crate::membership::Membership> {
        self.inner.membership()
    }
    fn watch(&self, on_change: crate::kv::ChangeFeed) -> KvResult<bool> {
        self.inner.watch(on_change)
    }
    fn watch_revisions(&self, on_change: crate::kv::RevisionFeed) -> KvResult<bool> {
        self.inner.watch_revisions(on_change)
    }
}
