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
    /// The commit lands but its answer is lost (the connection to etcd
    /// reset after the request went out): a retryable error, though the
    /// change is made, and nothing the answer carries (the records a range
    /// delete took) comes back.
    Unanswered,
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
}

impl FaultyKv {
    pub fn new(inner: Arc<dyn KvEngine>) -> Self {
        Self {
            inner,
            fault: Default::default(),
            skip: AtomicU32::new(0),
            remaining: AtomicU32::new(0),
            injected: AtomicU32::new(0),
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

    fn take_fault(&self) -> Option<Fault> {
        let fault = (*self.fault.lock())?;
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
    inner: Box<dyn KvWrite + 'a>,
    /// What range deletes took, for each caller's buffer: handed on with the
    /// commit's answer, so a lost answer loses them, as it does on etcd.
    taken: Vec<(crate::kv::Taken, crate::kv::Taken)>,
}

impl FaultyWrite<'_> {
    fn hand_on_taken(taken: Vec<(crate::kv::Taken, crate::kv::Taken)>) {
        for (mine, theirs) in taken {
            *theirs.lock() = std::mem::take(&mut *mine.lock());
        }
    }
}

impl KvRead for FaultyWrite<'_> {
    fn get(&mut self, key: &[u8]) -> KvResult<Option<Vec<u8>>> {
        self.inner.get(key)
    }
    fn get_versioned(&mut self, key: &[u8]) -> KvResult<(Option<Vec<u8>>, Option<crate::kv::Versioned>)> {
        self.inner.get_versioned(key)
    }
    fn get_many_versioned(&mut self, keys: &[Vec<u8>]) -> KvResult<Vec<crate::kv::Found>> {
        self.inner.get_many_versioned(keys)
    }
    fn scan(&mut self, start: &[u8], end: &[u8], limit: usize) -> KvResult<Vec<(Vec<u8>, Vec<u8>)>> {
        self.inner.scan(start, end, limit)
    }
}

impl KvWrite for FaultyWrite<'_> {
    fn put(&mut self, key: &[u8], value: &[u8]) {
        self.inner.put(key, value)
    }
    fn delete(&mut self, key: &[u8]) {
        self.inner.delete(key)
    }
    fn delete_range(&mut self, start: &[u8], end: &[u8]) -> KvResult<()> {
        self.inner.delete_range(start, end)
    }
    fn delete_range_taking(&mut self, start: &[u8], end: &[u8], into: &crate::kv::Taken) -> KvResult<()> {
        let mine = crate::kv::Taken::default();
        self.inner.delete_range_taking(start, end, &mine)?;
        self.taken.push((mine, into.clone()));
        Ok(())
    }
    fn assume(&mut self, key: &[u8], version: i64) -> bool {
        self.inner.assume(key, version)
    }
    fn known_absent(&mut self, key: &[u8]) {
        self.inner.known_absent(key)
    }
    fn known_empty(&mut self, prefix: &[u8]) {
        self.inner.known_empty(prefix)
    }
    fn commit(self: Box<Self>, durability: Durability) -> KvResult<()> {
        self.commit_at(durability).map(|_| ())
    }
    fn commit_at(self: Box<Self>, durability: Durability) -> KvResult<Option<i64>> {
        let FaultyWrite { kv, inner, taken } = *self;
        match kv.take_fault() {
            Some(Fault::Conflict) => Err(KvError::Conflict),
            Some(Fault::NoSpace) => Err(KvError::NoSpace),
            Some(Fault::Unavailable) => {
                Err(KvError::Backend { msg: "injected: metadata engine unavailable".into(), retryable: false })
            }
            Some(Fault::Unanswered) => {
                inner.commit_at(durability)?;
                Err(KvError::Backend { msg: "injected: the commit's answer was lost".into(), retryable: true })
            }
            None => {
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
    fn read_txn(&self) -> KvResult<Box<dyn KvRead + '_>> {
        self.inner.read_txn()
    }
    fn txn_limit(&self) -> Option<usize> {
        self.inner.txn_limit()
    }
    fn fresh_read_txn(&self) -> KvResult<Box<dyn KvRead + '_>> {
        self.inner.fresh_read_txn()
    }
    fn write_txn(&self) -> KvResult<Box<dyn KvWrite + '_>> {
        Ok(Box::new(FaultyWrite { kv: self, inner: self.inner.write_txn()?, taken: Vec::new() }))
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
