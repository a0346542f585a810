//! The holder index (`h` keys, see `schema.rs`): for each node, the chunks
//! whose records name it among their holders, so that the work a node's
//! death, drain or scrub makes is found by reading that node's entries, not
//! every chunk record of the volume.
//!
//! The rule it keeps: **a record never names a holder the index lacks.**
//! Every transaction that writes a chunk record (`C`, or a batched layout's
//! `P`) puts the entries of its holders in the same commit, unconditionally
//! (a put of an entry that exists changes nothing a reader sees). Entries
//! are removed exactly where the commit that removes the holder knows it
//! (a holder dropped, a copy evicted), and otherwise later: a purge's after
//! its commit, from the records etcd hands back with it, in one batched
//! commit a second; a truncate's, or those of an old version held on other
//! nodes, when a reader of the index finds them stale and drops them in a
//! transaction that checks the records still do not name the node. An entry
//! may outlive its record; no record outlives its entry.
//!
//! Only a volume several nodes share keeps the index: a single node holds
//! every chunk of its volume, and scans them.

use std::collections::BTreeMap;

use crate::error::MetaResult;
use crate::kv::{Durability, KvWrite, Taken};
use crate::namespace::{decode, encode, for_each_page_by_ino, Namespace};
use crate::schema;
use crate::types::{ChunkRecord, Ino, VolumeRecord};

/// Index entries read per page.
const ENTRIES_PER_PAGE: usize = 256;
/// Stale entries checked and dropped per transaction (two reads compared
/// and one delete each, under etcd's 128 operations).
const DROPS_PER_TXN: usize = 40;

/// What one walk of a node's index entries read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HeldWalk {
    /// Index entries read.
    pub entries: u64,
    /// Of those, entries whose record names the node (handed to the caller).
    pub held: u64,
    /// Stale entries dropped on the way.
    pub dropped: u64,
}

impl Namespace {
    /// Put the index entries of `record`'s holders (chunk `index` of
    /// `ino`), in the transaction that writes the record.
    pub(crate) fn index_holders(&self, txn: &mut (impl KvWrite + ?Sized), ino: Ino, index: u32, record: &ChunkRecord) {
        if self.clustered {
            for holder in &record.replicas {
                txn.put(&schema::held_chunk(holder, ino, index), &[]);
            }
        }
    }

    /// Drop `holder`'s index entry of chunk `index` of `ino`, in the
    /// transaction that writes a record no longer naming it.
    pub(crate) fn unindex_holder(&self, txn: &mut (impl KvWrite + ?Sized), holder: &str, ino: Ino, index: u32) {
        if self.clustered {
            txn.delete(&schema::held_chunk(holder, ino, index));
        }
    }

    /// The index operations a record adds to its transaction (etcd counts
    /// them against its limit).
    pub(crate) fn index_ops(&self, record: &ChunkRecord) -> usize {
        if self.clustered {
            record.replicas.len()
        } else {
            0
        }
    }

    /// After a purge's commit: queue the index entries of the chunk
    /// records it removed (`taken`) for [`Namespace::flush_unindexed`].
    /// Blind deletes are safe: the purged inode's number is never given
    /// out again, so no record can name it any more.
    pub(crate) fn queue_unindex_purged(&self, ino: Ino, taken: &[&Taken]) -> MetaResult<()> {
        if !self.clustered {
            return Ok(());
        }
        let mut keys = Vec::new();
        for records in taken {
            for (k, v) in records.lock().iter() {
                let record = crate::ops::layout::decode_any_chunk(k, v)?;
                let index = schema::chunk_index(k);
                keys.extend(record.replicas.iter().map(|h| schema::held_chunk(h, ino, index)));
            }
        }
        if !keys.is_empty() {
            self.unindexed.lock().extend(keys);
        }
        Ok(())
    }

    /// Drop the index entries purges queued, in as few commits as the
    /// engine allows. Returns how many. A crash before leaves them to the
    /// index's readers.
    pub fn flush_unindexed(&self) -> MetaResult<usize> {
        let keys = std::mem::take(&mut *self.unindexed.lock());
        let batch = self.kv.txn_limit().unwrap_or(usize::MAX).max(1);
        for (i, part) in keys.chunks(batch).enumerate() {
            let r = self.write(Durability::Buffered, |txn| {
                for k in part {
                    txn.delete(k);
                }
                Ok(())
            });
            if let Err(e) = r {
                // Tried again at the next flush.
                self.unindexed.lock().extend(keys[i * batch..].iter().cloned());
                return Err(e);
            }
        }
        Ok(keys.len())
    }

    /// Call `f` with each chunk whose current record names `node` among
    /// its holders, found through the holder index, in inode order: a page
    /// of entries, then their records, in two reads a page. Entries found
    /// stale are dropped on the way.
    pub fn for_each_chunk_held_by(&self, node: &str, f: impl FnMut(Ino, u32, &ChunkRecord)) -> MetaResult<HeldWalk> {
        self.for_each_chunk_held_by_where(node, |_, _| true, f)
    }

    /// [`Namespace::for_each_chunk_held_by`] for the chunks `keep` picks
    /// by (inode, chunk index) alone: the others' records are not read
    /// (a repairer reads only the records of the chunks that are its share).
    pub fn for_each_chunk_held_by_where(
        &self,
        node: &str,
        mut keep: impl FnMut(Ino, u32) -> bool,
        mut f: impl FnMut(Ino, u32, &ChunkRecord),
    ) -> MetaResult<HeldWalk> {
        let mut walk = HeldWalk::default();
        let read = |start: &[u8], end: &[u8], limit| Ok(self.kv.fresh_read_txn()?.scan(start, end, limit)?);
        for_each_page_by_ino(read, &schema::held_by(node), ENTRIES_PER_PAGE, |page| {
            walk.entries += page.len() as u64;
            let chunks: Vec<(Ino, u32)> = page
                .iter()
                .filter_map(|(k, _)| schema::parse_held_chunk(node, k))
                .filter(|&(ino, index)| keep(ino, index))
                .collect();
            let records = self.current_records(&chunks)?;
            let mut stale = Vec::new();
            for ((ino, index), record) in chunks.iter().zip(&records) {
                match record {
                    Some(r) if r.replicas.iter().any(|h| h == node) => {
                        walk.held += 1;
                        f(*ino, *index, r);
                    }
                    _ => stale.push((*ino, *index)),
                }
            }
            walk.dropped += self.drop_stale_entries(node, &stale)?;
            Ok(())
        })?;
        Ok(walk)
    }

    /// The current record of each of `chunks`, in one read: the plain
    /// records and the files' batched-layout tokens together, and a second
    /// look at the few whose file has a batched layout current.
    fn current_records(&self, chunks: &[(Ino, u32)]) -> MetaResult<Vec<Option<ChunkRecord>>> {
        if chunks.is_empty() {
            return Ok(Vec::new());
        }
        let mut keys: Vec<Vec<u8>> = chunks.iter().map(|&(ino, index)| schema::chunk(ino, index)).collect();
        let mut files: Vec<Ino> = chunks.iter().map(|c| c.0).collect();
        files.dedup();
        keys.extend(files.iter().map(|&ino| schema::layout_commit(ino)));
        let found = self.kv.fresh_read_txn()?.get_many_versioned(&keys)?;
        let moving: BTreeMap<Ino, bool> =
            files.iter().zip(&found[chunks.len()..]).map(|(i, f)| (*i, f.0.is_some())).collect();
        let mut out = Vec::with_capacity(chunks.len());
        for (i, &(ino, index)) in chunks.iter().enumerate() {
            out.push(match (moving.get(&ino), &found[i].0) {
                (Some(true), _) => self.chunk(ino, index)?,
                (_, Some(v)) => Some(decode::<ChunkRecord>(&keys[i], v)?),
                (_, None) => None,
            });
        }
        Ok(out)
    }

    /// Drop `node`'s index entries of `stale` chunks, each in a
    /// transaction that reads the chunk's plain and pending records and
    /// finds neither naming the node (a seal may have named it again since
    /// the look). Returns how many went.
    fn drop_stale_entries(&self, node: &str, stale: &[(Ino, u32)]) -> MetaResult<u64> {
        let mut dropped = 0;
        for part in stale.chunks(DROPS_PER_TXN) {
            dropped += self.write(Durability::Buffered, |txn| {
                let mut keys = Vec::with_capacity(part.len() * 2);
                for &(ino, index) in part {
                    keys.push(schema::chunk(ino, index));
                    keys.push(schema::pending_chunk(ino, index));
                }
                let found = txn.get_many_versioned(&keys)?;
                let mut n = 0;
                for (i, &(ino, index)) in part.iter().enumerate() {
                    let names = |at: usize| -> MetaResult<bool> {
                        Ok(match &found[at].0 {
                            Some(v) => {
                                crate::ops::layout::decode_any_chunk(&keys[at], v)?.replicas.iter().any(|h| h == node)
                            }
                            None => false,
                        })
                    };
                    if !names(2 * i)? && !names(2 * i + 1)? {
                        txn.delete(&schema::held_chunk(node, ino, index));
                        n += 1;
                    }
                }
                Ok(n)
            })?;
        }
        Ok(dropped)
    }

    /// Write the index of a volume made before it (format 1), from every
    /// chunk record, then record the volume's format as current. Run by
    /// the first node that opens such a volume; others doing it at the
    /// same time write the same entries. Returns the entries written.
    pub(crate) fn build_holder_index(&self, volume: &VolumeRecord) -> MetaResult<u64> {
        let mut written = 0u64;
        if self.clustered {
            let mut batch: Vec<(Ino, u32, ChunkRecord)> = Vec::new();
            let flush = |batch: &mut Vec<(Ino, u32, ChunkRecord)>, written: &mut u64| -> MetaResult<()> {
                self.write(Durability::Buffered, |txn| {
                    for (ino, index, record) in batch.iter() {
                        self.index_holders(txn, *ino, *index, record);
                    }
                    Ok(())
                })?;
                *written += batch.iter().map(|(_, _, r)| r.replicas.len() as u64).sum::<u64>();
                batch.clear();
                Ok(())
            };
            let mut err = None;
            let mut ops = 0;
            self.for_each_record_of_any_layout(|ino, index, record| {
                if err.is_some() {
                    return;
                }
                ops += record.replicas.len();
                batch.push((ino, index, record.clone()));
                if ops >= 96 {
                    ops = 0;
                    if let Err(e) = flush(&mut batch, &mut written) {
                        err = Some(e);
                    }
                }
            })?;
            if let Some(e) = err {
                return Err(e);
            }
            flush(&mut batch, &mut written)?;
        }
        let current = VolumeRecord { format_version: crate::types::FORMAT_VERSION, ..volume.clone() };
        self.write(Durability::Durable, |txn| {
            txn.put(schema::VOLUME, &encode(&current));
            Ok(())
        })?;
        tracing::info!(entries = written, "built the holder index of a volume made before it");
        Ok(written)
    }
}
