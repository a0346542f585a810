//! What an admin says of a node, and the chunk-record changes that move
//! copies between nodes (repair, drain).
//!
//! A node's admin state lives in an `A` key that outlives its membership
//! lease; no key means the node takes new chunks as usual. The states:
//!
//! ```text
//!   (active) ──drain──▶ Draining ──(no chunk record names it)──▶ Drained
//!      ▲                   │                                        │
//!      └──────undrain──────┴────────────────undrain─────────────────┘
//!   dead and drained, or dead and named by no record: forget removes it
//! ```
//!
//! A draining or drained node is given no new copy by placement; its
//! copies count for nothing in a chunk's replica count, so repair gives
//! each of its chunks a new copy elsewhere and then drops it from the
//! record. It keeps serving reads until then.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::{MetaError, MetaResult};
use crate::kv::{Durability, KvEngine};
use crate::namespace::{decode, encode, Namespace};
use crate::ops::layout::chunk_at_version;
use crate::schema;
use crate::types::{ChunkRecord, Ino};

/// An admin's word on a node (see the module's head).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum NodeAdmin {
    /// Its chunks are being copied elsewhere; it takes no new ones.
    Draining,
    /// No chunk record names it: it can be taken down.
    Drained,
}

impl NodeAdmin {
    pub fn as_str(self) -> &'static str {
        match self {
            NodeAdmin::Draining => "draining",
            NodeAdmin::Drained => "drained",
        }
    }
}

/// A rebalance under way: the repair workers also move copies toward
/// placement's ideal holders while this record exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rebalance {
    /// Bytes per second each node copies for it (0: the node's own limit).
    pub bandwidth: u64,
    /// When it was asked for (seconds since the epoch).
    pub started: i64,
}

/// The rebalance under way, if any.
pub fn rebalance(kv: &dyn KvEngine) -> MetaResult<Option<Rebalance>> {
    let mut txn = kv.read_txn()?;
    match txn.get(schema::REBALANCE)? {
        Some(v) => Ok(Some(decode(schema::REBALANCE, &v)?)),
        None => Ok(None),
    }
}

/// The last gc request (0: none yet), and what each node has answered.
pub fn gc_state(kv: &dyn KvEngine) -> MetaResult<(u64, BTreeMap<String, u64>)> {
    let mut txn = kv.read_txn()?;
    let asked = counter(&mut *txn, schema::GC_REQUEST)?;
    let (start, end) = schema::prefix_range(schema::GC_DONE);
    let mut done = BTreeMap::new();
    for (k, v) in txn.scan(&start, &end, 100_000)? {
        done.insert(String::from_utf8_lossy(&k[1..]).into_owned(), be_u64(&k, &v)?);
    }
    Ok((asked, done))
}

fn be_u64(key: &[u8], v: &[u8]) -> MetaResult<u64> {
    Ok(u64::from_be_bytes(v.try_into().map_err(|_| MetaError::Corrupt {
        key: String::from_utf8_lossy(key).into_owned(),
        msg: format!("{} bytes where 8 were expected", v.len()),
    })?))
}

/// The last backfill rescan request's number (0: none yet).
pub fn backfill_rescan_requested(kv: &dyn KvEngine) -> MetaResult<u64> {
    counter(&mut *kv.read_txn()?, schema::BACKFILL_RESCAN)
}

/// A request counter (`W`, `H`): 0 before the first request.
fn counter(txn: &mut (impl crate::kv::KvRead + ?Sized), key: &[u8]) -> MetaResult<u64> {
    match txn.get(key)? {
        Some(v) => be_u64(key, &v),
        None => Ok(0),
    }
}

/// Every node's admin state (nodes without one are absent).
pub fn admin_states(kv: &dyn KvEngine) -> MetaResult<BTreeMap<String, NodeAdmin>> {
    let mut txn = kv.read_txn()?;
    let (start, end) = schema::prefix_range(schema::NODE_ADMIN);
    let mut out = BTreeMap::new();
    for (k, v) in txn.scan(&start, &end, 100_000)? {
        let id = String::from_utf8_lossy(&k[1..]).into_owned();
        out.insert(id, decode::<NodeAdmin>(&k, &v)?);
    }
    Ok(out)
}

impl Namespace {
    /// Every node's admin state.
    pub fn node_admin_states(&self) -> MetaResult<BTreeMap<String, NodeAdmin>> {
        admin_states(self.kv.as_ref())
    }

    /// Set (or, with `None`, clear) the admin state of node `id`. A drained
    /// mark is refused while a chunk record still names the node.
    pub fn set_node_admin(&self, id: &str, state: Option<NodeAdmin>) -> MetaResult<()> {
        if state == Some(NodeAdmin::Drained) && self.chunks_naming(id)? > 0 {
            return Err(MetaError::Invalid("chunk records still name this node"));
        }
        self.write(Durability::Durable, |txn| {
            let key = schema::node_admin(id);
            match state {
                Some(s) => txn.put(&key, &encode(&s)),
                None => txn.delete(&key),
            }
            Ok(())
        })
    }

    /// Start (or, with `None`, end) a rebalance.
    pub fn set_rebalance(&self, job: Option<Rebalance>) -> MetaResult<()> {
        self.write(Durability::Durable, |txn| {
            match job {
                Some(j) => txn.put(schema::REBALANCE, &encode(&j)),
                None => txn.delete(schema::REBALANCE),
            }
            Ok(())
        })
    }

    /// Ask every node to sweep its copies now (`converged gc`). Returns the
    /// request's number; each node answers with [`Namespace::gc_done`].
    pub fn request_gc(&self) -> MetaResult<u64> {
        self.bump(schema::GC_REQUEST)
    }

    /// Ask every node to queue its files that are not backed for upload
    /// again (after `fsck --repair` marked some).
    pub fn request_backfill_rescan(&self) -> MetaResult<u64> {
        self.bump(schema::BACKFILL_RESCAN)
    }

    /// Add one to a request counter; returns the new request's number.
    fn bump(&self, key: &[u8]) -> MetaResult<u64> {
        self.write(Durability::Durable, |txn| {
            let next = counter(txn, key)? + 1;
            txn.put(key, &next.to_be_bytes());
            Ok(next)
        })
    }

    /// This node swept every copy no record names, up to gc request `id`.
    pub fn gc_done(&self, id: u64) -> MetaResult<()> {
        self.write(Durability::Durable, |txn| {
            txn.put(&schema::gc_done(&self.node), &id.to_be_bytes());
            Ok(())
        })
    }

    /// How many chunk records name node `id` as a holder.
    pub fn chunks_naming(&self, id: &str) -> MetaResult<u64> {
        if self.clustered {
            return Ok(self.for_each_chunk_held_by(id, |_, _, _| {})?.held);
        }
        let mut n = 0;
        self.for_each_chunk(|_, _, rec| n += rec.replicas.iter().any(|r| r == id) as u64)?;
        Ok(n)
    }

    /// Drop node `id` from the holders of every chunk that has another
    /// holder: the node lost its copies (its disk was replaced). Returns
    /// the records changed and those left naming it alone (their bytes were
    /// only on that disk; a backed file's come back from the object store).
    pub fn forget_copies_of(&self, id: &str) -> MetaResult<(u64, u64)> {
        let mut named = Vec::new();
        let note = |ino, index, rec: &ChunkRecord| {
            if rec.replicas.iter().any(|r| r == id) {
                named.push((ino, index, rec.version));
            }
        };
        match self.clustered {
            true => drop(self.for_each_chunk_held_by(id, note)?),
            false => self.for_each_chunk(note)?,
        }
        let gone = [id.to_string()];
        let mut dropped = 0;
        for &(ino, index, version) in &named {
            dropped += self.drop_holders(ino, index, version, &gone, 1)? as u64;
        }
        Ok((dropped, named.len() as u64 - dropped))
    }

    /// Drop node `id` from the volume: its membership record, its admin
    /// state and its record of answered requests. Refused while it is live or while a chunk record names it
    /// (repair or a drain moves those first).
    pub fn forget_node(&self, id: &str) -> MetaResult<()> {
        if self.chunks_naming(id)? > 0 {
            return Err(MetaError::Invalid("chunk records still name this node; wait for repair or drain it first"));
        }
        self.write(Durability::Durable, |txn| {
            if txn.get(&schema::live_node(id))?.is_some() {
                return Err(MetaError::Invalid("the node is live; stop it first"));
            }
            if txn.get(&schema::known_node(id))?.is_none() {
                return Err(MetaError::NotFound);
            }
            txn.delete(&schema::known_node(id));
            txn.delete(&schema::node_admin(id));
            for ring in [schema::answered_of(id), schema::answered_before_of(id)] {
                let (start, end) = schema::prefix_range(&ring);
                txn.delete_range(&start, &end)?;
            }
            Ok(())
        })
    }

    /// Drop `gone` from the holders of chunk `index` of `ino`, if the chunk
    /// is still at `version` and at least `keep` holders not in `gone`
    /// remain (a copy is dropped only once its replacements are recorded).
    /// Returns whether the record changed.
    pub fn drop_holders(&self, ino: Ino, index: u32, version: u64, gone: &[String], keep: usize) -> MetaResult<bool> {
        self.write(Durability::Durable, |txn| {
            let Some(mut record) = chunk_at_version(txn, ino, index, version)? else { return Ok(false) };
            let before = record.replicas.len();
            let removed: Vec<String> = record.replicas.iter().filter(|r| gone.contains(r)).cloned().collect();
            record.replicas.retain(|r| !gone.contains(r));
            if record.replicas.len() == before || record.replicas.len() < keep.max(1) {
                return Ok(false);
            }
            txn.put(&schema::chunk(ino, index), &encode(&record));
            for holder in &removed {
                self.unindex_holder(txn, holder, ino, index);
            }
            Ok(true)
        })
    }
}
