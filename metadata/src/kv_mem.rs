//! `MemKv`: an in-memory engine for unit tests and reference models.
//! Writers run one at a time under a mutex; nothing survives the process.

use std::collections::BTreeMap;
use std::ops::Bound;
use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard};

use crate::kv::{merge_pending, Durability, KvEngine, KvRead, KvResult, KvWrite, PendingWrites};

type Map = BTreeMap<Vec<u8>, Vec<u8>>;

#[derive(Default, Clone)]
pub struct MemKv {
    map: Arc<Mutex<Map>>,
    // Serializes write transactions; reads take `map` briefly.
    writer: Arc<Mutex<()>>,
}

impl MemKv {
    pub fn new() -> Self {
        Self::default()
    }
}

fn scan_map(map: &Map, start: &[u8], end: &[u8], limit: usize) -> Vec<(Vec<u8>, Vec<u8>)> {
    map.range::<[u8], _>((Bound::Included(start), Bound::Excluded(end)))
        .take(limit)
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

struct MemRead<'a> {
    map: &'a Mutex<Map>,
}

impl KvRead for MemRead<'_> {
    fn get(&mut self, key: &[u8]) -> KvResult<Option<Vec<u8>>> {
        Ok(self.map.lock().get(key).cloned())
    }
    fn scan(&mut self, start: &[u8], end: &[u8], limit: usize) -> KvResult<Vec<(Vec<u8>, Vec<u8>)>> {
        Ok(scan_map(&self.map.lock(), start, end, limit))
    }
}

struct MemWrite<'a> {
    map: &'a Mutex<Map>,
    _writer: MutexGuard<'a, ()>,
    pending: PendingWrites,
}

impl KvRead for MemWrite<'_> {
    fn get(&mut self, key: &[u8]) -> KvResult<Option<Vec<u8>>> {
        if let Some(v) = self.pending.get(key) {
            return Ok(v.clone());
        }
        Ok(self.map.lock().get(key).cloned())
    }
    fn scan(&mut self, start: &[u8], end: &[u8], limit: usize) -> KvResult<Vec<(Vec<u8>, Vec<u8>)>> {
        let base = scan_map(&self.map.lock(), start, end, usize::MAX);
        Ok(merge_pending(base, &self.pending, start, end, limit))
    }
}

impl KvWrite for MemWrite<'_> {
    fn put(&mut self, key: &[u8], value: &[u8]) {
        self.pending.insert(key.to_vec(), Some(value.to_vec()));
    }
    fn delete(&mut self, key: &[u8]) {
        self.pending.insert(key.to_vec(), None);
    }
    fn commit(self: Box<Self>, _durability: Durability) -> KvResult<()> {
        let mut map = self.map.lock();
        for (k, v) in self.pending {
            match v {
                Some(v) => map.insert(k, v),
                None => map.remove(&k),
            };
        }
        Ok(())
    }
}

impl KvEngine for MemKv {
    fn name(&self) -> &'static str {
        "memory"
    }
    fn read_txn(&self) -> KvResult<Box<dyn KvRead + '_>> {
        Ok(Box::new(MemRead { map: &self.map }))
    }
    fn write_txn(&self) -> KvResult<Box<dyn KvWrite + '_>> {
        Ok(Box::new(MemWrite { map: &self.map, _writer: self.writer.lock(), pending: BTreeMap::new() }))
    }
    fn sync(&self) -> KvResult<()> {
        Ok(())
    }
}
