//! File layouts: chunk records, and the sealed / unsealed state of a file.
//!
//! A seal switches a file's layout atomically: a reader sees every chunk
//! record of one seal or of the next, with the size that goes with it. A
//! layout too large for one transaction of the engine (etcd's operation
//! limit) is written ahead in batches as *pending* records (`P`) under a
//! token, and made current by one small transaction that records the token
//! (`Q`); readers take a pending record with the current token over the
//! plain one (`C`), and the records are then moved to `C` in batches. A
//! writer that dies between batches leaves pending records no token makes
//! current: readers ignore them, and the next seal clears them.
//!
//! A file open for writing is *unsealed* (a `U` key holding the writing
//! node's id): its checksums may be stale. The `U` key is also the file's
//! write lease: while its node is live, no other node may open the file for
//! writing. Sealing records the size, mtime and fresh chunk records and drops
//! the `U` key.

use crate::error::{MetaError, MetaResult};
use crate::kv::{Durability, KvRead, KvWrite};
use crate::namespace::{
    decode, encode, for_each_page_by_ino, for_each_page_in_inos, get_inode, put_inode, scan_all, scan_paged, Namespace,
};
use crate::schema;
use crate::types::{ChunkRecord, Ino, Inode, NewCopies, SetAttr, Timespec};

/// What the sweep judges a node's copy of a file by, read together: its
/// inode and chunk records, the holder of its write lease, its tier record.
#[derive(Debug, Clone)]
pub struct SweepFacts {
    pub inode: Inode,
    pub chunks: Vec<(u32, ChunkRecord)>,
    /// The node holding the file's write lease (its `U` mark), if any.
    pub writer: Option<String>,
    pub tier: Option<crate::types::TierRecord>,
}

/// Files whose [`SweepFacts`] one etcd request reads (four keys each, in
/// a transaction of at most 128 reads; their chunk ranges in a second).
pub const SWEEP_FACTS_BATCH: usize = 32;

/// Chunk records a batched sweep read takes of one file (a file with more
/// is read on its own, in pages).
const SWEEP_CHUNKS: usize = 256;

/// A writing session of this node that ended with nothing left to record
/// but the end of its write lease (see [`Namespace::end_sessions`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionEnd {
    /// Created here and closed while still empty: its create recorded it
    /// whole.
    Empty(Ino),
    /// Unchanged since a publish (close or fsync in a cluster) recorded its
    /// layout under lease `lease`.
    Published { ino: Ino, lease: u64 },
}

impl SessionEnd {
    pub fn ino(&self) -> Ino {
        match *self {
            SessionEnd::Empty(ino) | SessionEnd::Published { ino, .. } => ino,
        }
    }
}

/// What [`Namespace::seal`] records.
#[derive(Debug, Clone)]
pub struct Seal {
    pub size: u64,
    pub mtime: Timespec,
    /// Chunks whose records change; others are kept.
    pub chunks: Vec<(u32, ChunkRecord)>,
    /// Whether the file stays unsealed (fsync while writers remain).
    pub keep_unsealed: bool,
    /// The epoch of the write lease this seal is made under: the seal
    /// commits only if the file's unsealed mark is still this node's at
    /// this epoch, so a node that lost the lease cannot publish over the new
    /// writer. `None` only for a single node's recovery of its own seals.
    pub lease: Option<u64>,
    /// Whether the bytes these checksums describe are on stable storage
    /// already. When they are not, the seal leaves a sync-pending mark
    /// (`S`), which the node drops once it has synced the backing file: a
    /// crash in between re-seals the file from what the disk holds, so a
    /// durable checksum never describes bytes the disk never got.
    pub data_durable: bool,
    /// Mode, owner, group and times set while the file was being written
    /// here, held back by the writer's node until this seal (their `ctime`
    /// given, an explicit `mtime` the backing file's at the seal).
    pub attrs: Option<SetAttr>,
}

/// The value of an unsealed mark (the write lease): the holder's node id,
/// a NUL, and the lease's epoch. Epochs of one file only grow (the last one
/// granted is kept in its `E` key), so a writer whose lease was taken over,
/// even if its own node took the lease back later, holds an epoch that no
/// longer matches: its seals compare it and fail.
pub(crate) fn lease_mark(node: &str, epoch: u64) -> Vec<u8> {
    [node.as_bytes(), b"\0", &epoch.to_be_bytes()[..]].concat()
}

/// (holder, epoch) of an unsealed mark. A mark with no epoch (written
/// before leases had them) has epoch 0.
pub(crate) fn parse_lease_mark(v: &[u8]) -> (&[u8], u64) {
    match v.len().checked_sub(9) {
        Some(at) if v[at] == 0 => (&v[..at], u64::from_be_bytes(v[at + 1..].try_into().expect("8 bytes"))),
        _ => (v, 0),
    }
}

/// The epoch of the lease a file's create takes: the create's own
/// transaction writes the mark, and every later take gets a higher one.
pub const CREATE_LEASE: u64 = 0;

/// (inode, chunk index, version) of a chunk record (`C`) as the change
/// feed hands it out, when the record names `node` among its holders;
/// `None` for any other record, or a value that does not decode.
pub fn chunk_held_by(key: &[u8], value: &[u8], node: &str) -> Option<(Ino, u32, u64)> {
    if !crate::schema::is_chunk(key) || key.len() != 13 {
        return None;
    }
    let record = crate::namespace::decode::<ChunkRecord>(key, value).ok()?;
    record
        .replicas
        .iter()
        .any(|h| h == node)
        .then(|| (crate::schema::key_ino(key), crate::schema::chunk_index(key), record.version))
}

/// The holder a change feed's `U` record names (the node that holds the
/// file's write lease); `None` for any other record.
pub fn lease_holder_of<'v>(key: &[u8], value: &'v [u8]) -> Option<&'v [u8]> {
    crate::schema::is_unsealed(key).then(|| parse_lease_mark(value).0)
}

/// The version of a chunk written under lease `epoch`, after `previous`.
/// Versions of one chunk only grow, and two writers under different epochs
/// never pick the same one (the epoch is in the high 32 bits), so a copy
/// named by its version is never overwritten by another writer's bytes.
pub fn next_version(previous: Option<u64>, epoch: u64) -> u64 {
    previous.map_or(1, |v| v + 1).max((epoch << 32) | 1)
}

/// The value of a sync-pending mark: the seal's token, then the node id.
fn sync_mark(token: u64, node: &str) -> Vec<u8> {
    [&token.to_be_bytes()[..], node.as_bytes()].concat()
}

/// (token, node) of a sync-pending mark; `None` for a malformed value.
fn parse_sync_mark(v: &[u8]) -> Option<(u64, &[u8])> {
    let token = u64::from_be_bytes(v.get(..8)?.try_into().ok()?);
    Some((token, &v[8..]))
}

/// Delete the layout records of chunks `first` and beyond, plain and
/// pending (one range delete each).
pub(crate) fn drop_chunks_from(txn: &mut (impl KvWrite + ?Sized), ino: Ino, first: u64) -> MetaResult<()> {
    let Ok(first) = u32::try_from(first) else { return Ok(()) };
    let (_, end) = schema::prefix_range(&schema::chunks_of(ino));
    txn.delete_range(&schema::chunk(ino, first), &end)?;
    let (_, end) = schema::prefix_range(&schema::pending_chunks_of(ino));
    Ok(txn.delete_range(&schema::pending_chunk(ino, first), &end)?)
}

/// A chunk record written ahead of the transaction that makes it current.
#[derive(serde::Serialize, serde::Deserialize)]
struct PendingChunk {
    token: u64,
    record: ChunkRecord,
}

/// A chunk record as a `C` or `P` key holds it (a pending record's own
/// record, whatever its token).
pub(crate) fn decode_any_chunk(key: &[u8], value: &[u8]) -> MetaResult<ChunkRecord> {
    match schema::is_pending_chunk(key) {
        true => Ok(decode::<PendingChunk>(key, value)?.record),
        false => decode(key, value),
    }
}

/// `chunks` cut into runs that each fit one transaction of at most `ops`
/// operations, a record costing itself and its holder-index entries
/// (`per_record` of it).
fn runs_by_ops(
    chunks: &[(u32, ChunkRecord)],
    ops: usize,
    per_record: impl Fn(&ChunkRecord) -> usize,
) -> Vec<&[(u32, ChunkRecord)]> {
    let mut runs = Vec::new();
    let (mut start, mut used) = (0, 0);
    for (i, (_, record)) in chunks.iter().enumerate() {
        let cost = per_record(record);
        if i > start && used + cost > ops {
            runs.push(&chunks[start..i]);
            (start, used) = (i, 0);
        }
        used += cost;
    }
    if start < chunks.len() {
        runs.push(&chunks[start..]);
    }
    runs
}

/// Every node the chunk records in `taken` name (records of a file's `C`
/// and `P` ranges, as a purge removed them).
pub(crate) fn holders_in(taken: &[&crate::kv::Taken]) -> MetaResult<Vec<String>> {
    let mut holders = std::collections::BTreeSet::new();
    for records in taken {
        for (k, v) in records.lock().iter() {
            holders.extend(decode_any_chunk(k, v)?.replicas);
        }
    }
    Ok(holders.into_iter().collect())
}

/// The token of the batched layout of `ino` that is current, if one is.
fn current_token(txn: &mut (impl KvRead + ?Sized), ino: Ino) -> MetaResult<Option<u64>> {
    txn.get(&schema::layout_commit(ino))?.map(|v| parse_token(ino, &v)).transpose()
}

/// The token a `Q` record holds.
fn parse_token(ino: Ino, v: &[u8]) -> MetaResult<u64> {
    Ok(u64::from_be_bytes(v.try_into().map_err(|_| MetaError::Corrupt {
        key: format!("layout commit of inode {ino}"),
        msg: format!("{} bytes where 8 were expected", v.len()),
    })?))
}

/// The current chunk records of `ino`, in index order: plain records, with
/// the pending records of the current batched layout over them.
pub(crate) fn read_layout(txn: &mut (impl KvRead + ?Sized), ino: Ino) -> MetaResult<Vec<(u32, ChunkRecord)>> {
    let mut chunks: std::collections::BTreeMap<u32, ChunkRecord> =
        scan_paged(txn, &schema::chunks_of(ino), CHUNKS_PER_BATCH)?
            .into_iter()
            .map(|(k, v)| Ok((schema::chunk_index(&k), decode(&k, &v)?)))
            .collect::<MetaResult<_>>()?;
    if let Some(token) = current_token(txn, ino)? {
        for (k, v) in scan_paged(txn, &schema::pending_chunks_of(ino), CHUNKS_PER_BATCH)? {
            let p: PendingChunk = decode(&k, &v)?;
            if p.token == token {
                chunks.insert(schema::chunk_index(&k), p.record);
            }
        }
    }
    Ok(chunks.into_iter().collect())
}

/// The current record of chunk `index` of `ino`.
/// The token, the pending record and the plain record are read together
/// (one request to a remote engine).
pub(crate) fn read_chunk(txn: &mut (impl KvRead + ?Sized), ino: Ino, index: u32) -> MetaResult<Option<ChunkRecord>> {
    Ok(read_chunks(txn, &[(ino, index)])?.pop().flatten())
}

/// [`read_chunk`] of each of `which`, in order, in one batched read (one
/// request per 42 chunks on etcd).
pub(crate) fn read_chunks(
    txn: &mut (impl KvRead + ?Sized),
    which: &[(Ino, u32)],
) -> MetaResult<Vec<Option<ChunkRecord>>> {
    let keys: Vec<Vec<u8>> = which
        .iter()
        .flat_map(|&(ino, index)| {
            [schema::layout_commit(ino), schema::pending_chunk(ino, index), schema::chunk(ino, index)]
        })
        .collect();
    let found = txn.get_many_versioned(&keys)?;
    let mut out = Vec::with_capacity(which.len());
    for ((&(ino, _), found), keys) in which.iter().zip(found.chunks(3)).zip(keys.chunks(3)) {
        out.push(chunk_of(ino, found, keys)?);
    }
    Ok(out)
}

/// The current record among a chunk's token, pending and plain records.
fn chunk_of(ino: Ino, found: &[crate::kv::Found], keys: &[Vec<u8>]) -> MetaResult<Option<ChunkRecord>> {
    if let Some(token) = &found[0].0 {
        let token = parse_token(ino, token)?;
        if let Some(v) = &found[1].0 {
            let p: PendingChunk = decode(&keys[1], v)?;
            if p.token == token {
                return Ok(Some(p.record));
            }
        }
    }
    found[2].0.as_deref().map(|v| decode(&keys[2], v)).transpose()
}

/// The record of chunk `index` of `ino` if it is still at `version` (a newer
/// seal makes whatever was done for the old one stale).
pub(crate) fn chunk_at_version(
    txn: &mut (impl KvRead + ?Sized),
    ino: Ino,
    index: u32,
    version: u64,
) -> MetaResult<Option<ChunkRecord>> {
    // A batched layout not yet moved to plain records: the caller's update
    // waits for the move (the seal that made it current finishes it). Both
    // read together.
    let keys = [schema::layout_commit(ino), schema::chunk(ino, index)];
    let found = txn.get_many_versioned(&keys)?;
    if found[0].0.is_some() {
        return Ok(None);
    }
    let Some(v) = &found[1].0 else { return Ok(None) };
    let record: ChunkRecord = decode(&keys[1], v)?;
    Ok((record.version == version).then_some(record))
}

/// Whether a batched layout of `ino` is current and not yet moved to
/// plain records: record updates (a replica added, a copy evicted) wait.
pub(crate) fn layout_moving(txn: &mut (impl KvRead + ?Sized), ino: Ino) -> MetaResult<bool> {
    Ok(current_token(txn, ino)?.is_some())
}

/// Pending records moved to plain ones per transaction: a put and a
/// delete each, under etcd's limit with room for the compares.
const FOLD_BATCH: usize = 32;

/// A token for a batched seal: distinct, with overwhelming odds, from any
/// left by an earlier seal that died (its own node's, or another's).
fn seal_token(node: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    node.hash(&mut h);
    std::time::SystemTime::now().hash(&mut h);
    std::thread::current().id().hash(&mut h);
    h.finish() | 1
}

/// Chunk records per etcd page or transaction: a record carries one
/// checksum per 64 KiB block (about 5 KiB for a 64 MiB chunk), and etcd
/// refuses requests over 1.5 MiB and transactions over 128 operations.
const CHUNKS_PER_BATCH: usize = 64;

/// Operations a seal gives its chunk records and their holder-index
/// entries in one transaction, under etcd's 128 with room for the seal's
/// own (the inode, its marks, the range deletes of a truncate).
const SEAL_RECORD_OPS: usize = 96;

impl Namespace {
    pub fn chunks(&self, ino: Ino) -> MetaResult<Vec<(u32, ChunkRecord)>> {
        self.read(|txn| read_layout(txn, ino))
    }

    /// A file's attributes and chunk records as one read at one point in
    /// time, past any node-local cache: what an open reads, so that it sees
    /// the size and the chunks of the last seal together (close-to-open).
    pub fn layout(&self, ino: Ino) -> MetaResult<(Inode, Vec<(u32, ChunkRecord)>)> {
        let mut txn = self.kv.fresh_read_txn()?;
        let inode = get_inode(txn.as_mut(), ino)?;
        let chunks = read_layout(txn.as_mut(), ino)?;
        Ok((inode, chunks))
    }

    /// [`SweepFacts`] of each of `inos`, at one point in time past any
    /// node-local cache: `None` for a file with no inode record. On etcd
    /// one request per [`SWEEP_FACTS_BATCH`] files, where reading them
    /// file by file took three. A file with a batched layout current, or
    /// more chunk records than one read returns, is read on its own.
    pub fn sweep_facts(&self, inos: &[Ino]) -> MetaResult<Vec<Option<SweepFacts>>> {
        const KEYS: usize = 4;
        let mut keys = Vec::with_capacity(inos.len() * KEYS);
        let mut ranges = Vec::with_capacity(inos.len());
        for &ino in inos {
            keys.extend([schema::inode(ino), schema::unsealed(ino), schema::tier(ino), schema::layout_commit(ino)]);
            ranges.push(schema::prefix_range(&schema::chunks_of(ino)));
        }
        let mut txn = self.kv.fresh_read_txn()?;
        let found = txn.get_many_versioned(&keys)?;
        let scanned = txn.scan_many(&ranges, SWEEP_CHUNKS)?;
        let mut out = Vec::with_capacity(inos.len());
        for ((&ino, found), pairs) in inos.iter().zip(found.chunks(KEYS)).zip(scanned) {
            let [inode, unsealed, tier, token] = [0, 1, 2, 3].map(|i| found[i].0.as_deref());
            let Some(inode) = inode else {
                out.push(None);
                continue;
            };
            if token.is_some() || pairs.len() >= SWEEP_CHUNKS {
                out.push(self.sweep_facts_of(ino)?);
                continue;
            }
            let chunks = pairs
                .iter()
                .map(|(k, v)| Ok((schema::chunk_index(k), decode(k, v)?)))
                .collect::<MetaResult<Vec<(u32, ChunkRecord)>>>()?;
            out.push(Some(SweepFacts {
                inode: decode(&schema::inode(ino), inode)?,
                chunks,
                writer: unsealed.map(|v| String::from_utf8_lossy(parse_lease_mark(v).0).into_owned()),
                tier: tier.map(|v| decode(&schema::tier(ino), v)).transpose()?,
            }));
        }
        Ok(out)
    }

    /// [`SweepFacts`] of one file, in one read view past any cache.
    fn sweep_facts_of(&self, ino: Ino) -> MetaResult<Option<SweepFacts>> {
        let mut txn = self.kv.fresh_read_txn()?;
        let inode = match get_inode(txn.as_mut(), ino) {
            Ok(inode) => inode,
            Err(MetaError::NotFound) => return Ok(None),
            Err(e) => return Err(e),
        };
        let chunks = read_layout(txn.as_mut(), ino)?;
        let writer =
            txn.get(&schema::unsealed(ino))?.map(|v| String::from_utf8_lossy(parse_lease_mark(&v).0).into_owned());
        let tier = crate::ops::tier::get_tier(txn.as_mut(), ino)?;
        Ok(Some(SweepFacts { inode, chunks, writer, tier }))
    }

    /// What decides whether a peer may store a version of chunk `index` of
    /// `ino` here, in one read past any node-local cache: the holder of the
    /// file's write lease, the chunk's record, and whether the inode has a
    /// record at all.
    pub fn write_facts(&self, ino: Ino, index: u32) -> MetaResult<(Option<String>, Option<ChunkRecord>, bool)> {
        let keys = [schema::unsealed(ino), schema::chunk(ino, index), schema::inode(ino)];
        let found = self.kv.fresh_read_txn()?.get_many_versioned(&keys)?;
        let holder = found[0].0.as_deref().map(|v| String::from_utf8_lossy(parse_lease_mark(v).0).into_owned());
        let chunk = match &found[1].0 {
            Some(v) => Some(decode::<ChunkRecord>(&keys[1], v)?),
            None => None,
        };
        Ok((holder, chunk, found[2].0.is_some()))
    }

    /// One chunk record, if the file has one for `index`.
    pub fn chunk(&self, ino: Ino, index: u32) -> MetaResult<Option<ChunkRecord>> {
        self.read(|txn| read_chunk(txn, ino, index))
    }

    /// [`Namespace::chunk`] of each of `which`, in one batched read, with
    /// the inode records of their files (kept by the node cache, so that
    /// a `getattr` of one of them next costs no read).
    pub fn chunks_at(&self, which: &[(Ino, u32)]) -> MetaResult<Vec<Option<ChunkRecord>>> {
        self.read(|txn| {
            let inodes: Vec<Vec<u8>> = which.iter().map(|(ino, _)| schema::inode(*ino)).collect();
            txn.get_many_versioned(&inodes)?;
            read_chunks(txn, which)
        })
    }

    /// Visit every plain and pending chunk record of the volume, whatever
    /// its token (what the holder index must cover), one page per read.
    pub(crate) fn for_each_record_of_any_layout(&self, mut f: impl FnMut(Ino, u32, &ChunkRecord)) -> MetaResult<()> {
        for prefix in [schema::all_chunks(), schema::all_pending_chunks()] {
            let read = |start: &[u8], end: &[u8], limit| self.read(|txn| Ok(txn.scan(start, end, limit)?));
            for_each_page_by_ino(read, &prefix, CHUNKS_PER_BATCH, |page| {
                for (k, v) in &page {
                    f(schema::key_ino(k), schema::chunk_index(k), &decode_any_chunk(k, v)?);
                }
                Ok(())
            })?;
        }
        Ok(())
    }

    /// Visit the chunk records of the inodes in `inos`, in inode order, one
    /// page per read (a slice of repair's safety pass).
    pub fn for_each_chunk_in(
        &self,
        inos: std::ops::Range<Ino>,
        mut f: impl FnMut(Ino, u32, &ChunkRecord),
    ) -> MetaResult<()> {
        let read = |start: &[u8], end: &[u8], limit| self.read(|txn| Ok(txn.scan(start, end, limit)?));
        for_each_page_in_inos(read, &schema::all_chunks(), inos, CHUNKS_PER_BATCH, |page| {
            for (k, v) in &page {
                f(schema::key_ino(k), schema::chunk_index(k), &decode(k, v)?);
            }
            Ok(())
        })
    }

    /// Visit every chunk record of the volume, in inode order, one page per
    /// read (for `status` and background scans).
    pub fn for_each_chunk(&self, mut f: impl FnMut(Ino, u32, &ChunkRecord)) -> MetaResult<()> {
        let read = |start: &[u8], end: &[u8], limit| self.read(|txn| Ok(txn.scan(start, end, limit)?));
        for_each_page_by_ino(read, &schema::all_chunks(), CHUNKS_PER_BATCH, |page| {
            for (k, v) in &page {
                f(schema::key_ino(k), schema::chunk_index(k), &decode(k, v)?);
            }
            Ok(())
        })
    }

    /// Mark a file as being written on this node and take its write lease.
    /// Must be durable before the first byte of a sealed file changes, or a
    /// crash could leave old checksums over new bytes. Fails with
    /// [`MetaError::WriteLeased`] while another live node writes the file; a
    /// lease left by a dead node (its membership lease expired) is taken over.
    ///
    /// Returns the lease's epoch, which this node's seals of the file then
    /// carry ([`Seal::lease`]). A lease this node holds already keeps its
    /// epoch (this node runs one writing session per file at a time);
    /// every other take gets an epoch higher than any before it for this
    /// file, so the session of a node that lost the lease stays fenced.
    pub fn mark_unsealed(&self, ino: Ino) -> MetaResult<u64> {
        self.write(Durability::Durable, |txn| {
            get_inode(txn, ino)?;
            let key = schema::unsealed(ino);
            if let Some(mark) = txn.get(&key)? {
                let (holder, epoch) = parse_lease_mark(&mark);
                if self.is_mine(holder) {
                    return Ok(epoch);
                }
                let holder = String::from_utf8_lossy(holder).into_owned();
                if txn.get(&schema::live_node(&holder))?.is_some() {
                    return Err(MetaError::WriteLeased { holder });
                }
                tracing::warn!(ino, %holder, "taking over the write lease of a dead node");
            }
            let epoch_key = schema::lease_epoch(ino);
            let last = match txn.get(&epoch_key)? {
                Some(v) => u64::from_be_bytes(v.as_slice().try_into().map_err(|_| MetaError::Corrupt {
                    key: format!("lease epoch of inode {ino}"),
                    msg: format!("{} bytes where 8 were expected", v.len()),
                })?),
                None => CREATE_LEASE,
            };
            let epoch = last + 1;
            txn.put(&epoch_key, &epoch.to_be_bytes());
            txn.put(&key, &lease_mark(&self.node, epoch));
            Ok(epoch)
        })
    }

    /// Fail with [`MetaError::LeaseLost`] unless `ino`'s write lease is
    /// this node's at `epoch`.
    fn check_lease(&self, txn: &mut (impl KvRead + ?Sized), ino: Ino, epoch: u64) -> MetaResult<()> {
        let mark = txn.get(&schema::unsealed(ino))?;
        let holder = match mark.as_deref().map(parse_lease_mark) {
            Some((holder, e)) if self.is_mine(holder) && e == epoch => return Ok(()),
            Some((holder, _)) => String::from_utf8_lossy(holder).into_owned(),
            None => String::new(),
        };
        Err(MetaError::LeaseLost { holder })
    }

    /// Give up the write lease of `ino` taken at `epoch`, without a seal (a
    /// writer that lost its lease, or found its node cut off). A lease taken
    /// since, by this node or another, is left alone. Returns whether it
    /// was still held.
    pub fn release_lease(&self, ino: Ino, epoch: u64) -> MetaResult<bool> {
        self.write(Durability::Durable, |txn| match self.check_lease(txn, ino, epoch) {
            Ok(()) => {
                txn.delete(&schema::unsealed(ino));
                Ok(true)
            }
            Err(MetaError::LeaseLost { .. }) => Ok(false),
            Err(e) => Err(e),
        })
    }

    /// Add `nodes` to the replicas of chunk `index` of `ino`, if the chunk is
    /// still at `version` (a newer seal makes the copies stale). Returns
    /// whether the record changed.
    pub fn add_replicas(&self, ino: Ino, index: u32, version: u64, nodes: &[String]) -> MetaResult<bool> {
        Ok(self.add_replicas_many(&[NewCopies { ino, index, version, nodes: nodes.to_vec() }])? == 1)
    }

    /// [`Namespace::add_replicas`] for several chunks in one transaction
    /// (the replicator records what it copied in batches), each applied as
    /// it would be alone: a chunk no longer at its version, or that names
    /// every node already, is left as it is. Returns how many records
    /// changed.
    pub fn add_replicas_many(&self, copies: &[NewCopies]) -> MetaResult<usize> {
        self.write(Durability::Buffered, |txn| {
            let mut changed = 0;
            for c in copies {
                let Some(mut record) = chunk_at_version(txn, c.ino, c.index, c.version)? else { continue };
                let before = record.replicas.len();
                for n in &c.nodes {
                    if !record.replicas.contains(n) {
                        record.replicas.push(n.clone());
                    }
                }
                if record.replicas.len() == before {
                    continue;
                }
                txn.put(&schema::chunk(c.ino, c.index), &encode(&record));
                self.index_holders(txn, c.ino, c.index, &record);
                changed += 1;
            }
            Ok(changed)
        })
    }

    /// Drop this node from the holders of chunk `index` of `ino`, if the
    /// chunk is still at `version`: its copy here is not that version
    /// (overwritten by a writer that lost its lease, or found corrupt and
    /// not repairable). Returns whether the record changed.
    pub fn drop_holder(&self, ino: Ino, index: u32, version: u64) -> MetaResult<bool> {
        self.write(Durability::Durable, |txn| {
            let Some(mut record) = chunk_at_version(txn, ino, index, version)? else { return Ok(false) };
            let before = record.replicas.len();
            record.replicas.retain(|r| !self.is_mine(r.as_bytes()));
            if record.replicas.len() == before {
                return Ok(false);
            }
            txn.put(&schema::chunk(ino, index), &encode(&record));
            self.unindex_holder(txn, &self.node, ino, index);
            Ok(true)
        })
    }

    /// Record size, mtime and chunk records; drop chunks past the end. The
    /// layout switches in one step for readers, however large (see the
    /// module's head).
    pub fn seal(&self, ino: Ino, seal: &Seal, durability: Durability) -> MetaResult<Inode> {
        let r = self.seal_records(ino, seal, durability);
        if !seal.keep_unsealed && !seal.data_durable {
            // After the commit (also a failed one: it may have applied), so
            // that the flusher's next look finds the mark.
            self.sync_marks.store(true, std::sync::atomic::Ordering::Release);
        }
        r
    }

    fn seal_records(&self, ino: Ino, seal: &Seal, durability: Durability) -> MetaResult<Inode> {
        let token = self.sync_tokens.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let per_record = |r: &ChunkRecord| 1 + self.index_ops(r);
        let record_ops: usize = seal.chunks.iter().map(|(_, r)| per_record(r)).sum();
        let batched =
            self.kv.txn_limit().is_some() && (seal.chunks.len() > CHUNKS_PER_BATCH || record_ops > SEAL_RECORD_OPS);
        // A batched layout of an earlier seal that was made current but not
        // moved yet would win over the records written here: move it first.
        // A plain seal checks for one in its own transaction instead (a
        // read its commit compares, from the node cache when warm), and
        // moves it only when there is one.
        if batched {
            self.finish_layout_move(ino)?;
        }
        let layout_token = batched.then(|| seal_token(&self.node));
        if let Some(layout) = layout_token {
            for batch in runs_by_ops(&seal.chunks, SEAL_RECORD_OPS, per_record)
                .into_iter()
                .flat_map(|run| run.chunks(CHUNKS_PER_BATCH))
            {
                self.write(Durability::Buffered, |txn| {
                    get_inode(txn, ino)?;
                    if let Some(epoch) = seal.lease {
                        self.check_lease(txn, ino, epoch)?;
                    }
                    for (index, record) in batch {
                        let pending = PendingChunk { token: layout, record: record.clone() };
                        txn.put(&schema::pending_chunk(ino, *index), &encode(&pending));
                        self.index_holders(txn, ino, *index, record);
                    }
                    Ok(())
                })?;
            }
        }
        let sealed = loop {
            let done = self.write(durability, |txn| self.seal_txn(txn, ino, seal, layout_token, token))?;
            match done {
                Some(inode) => break inode,
                None => self.finish_layout_move(ino)?,
            }
        };
        if layout_token.is_some() {
            // Readers see the new layout already; the move is housekeeping,
            // done again by the next seal should this one stop half-way.
            if let Err(e) = self.finish_layout_move(ino) {
                tracing::warn!(ino, error = %e, "could not move a batched layout to its plain records yet");
            }
        }
        Ok(sealed)
    }

    /// The transaction that makes a seal current; `None`, having written
    /// nothing, when an earlier batched layout is current and must be moved
    /// to plain records first.
    fn seal_txn(
        &self,
        txn: &mut dyn KvWrite,
        ino: Ino,
        seal: &Seal,
        layout_token: Option<u64>,
        token: u64,
    ) -> MetaResult<Option<Inode>> {
        {
            let mut inode = get_inode(txn, ino)?;
            if let Some(epoch) = seal.lease {
                self.check_lease(txn, ino, epoch)?;
            }
            if layout_token.is_none() && current_token(txn, ino)?.is_some() {
                return Ok(None);
            }
            let chunk_size = inode.chunk_size.max(1) as u64;
            let keep = seal.size.div_ceil(chunk_size);
            drop_chunks_from(txn, ino, keep)?;
            match layout_token {
                // The batches written above become the current records.
                Some(layout) => txn.put(&schema::layout_commit(ino), &layout.to_be_bytes()),
                None => {
                    for (index, record) in &seal.chunks {
                        if (*index as u64) < keep {
                            txn.put(&schema::chunk(ino, *index), &encode(record));
                            self.index_holders(txn, ino, *index, record);
                        }
                    }
                }
            }
            if self.tiered {
                let changed = !seal.chunks.is_empty() || inode.size != seal.size;
                if changed || crate::ops::tier::get_tier(txn, ino)?.is_none() {
                    crate::ops::tier::mark_dirty(txn, ino, &self.node)?;
                }
            }
            let mut changed = false;
            if inode.size != seal.size || inode.mtime != seal.mtime {
                inode.size = seal.size;
                if seal.mtime > inode.mtime {
                    inode.mtime = seal.mtime;
                    inode.ctime = inode.ctime.max(seal.mtime);
                }
                changed = true;
            }
            if let Some(attrs) = &seal.attrs {
                // The writer's node held these back until this seal: the
                // file shows them together with the bytes.
                crate::ops::setattr::apply_attrs(txn, &mut inode, attrs, Timespec::now())?;
                changed = true;
            }
            if changed {
                put_inode(txn, &inode);
            }
            if !seal.keep_unsealed {
                txn.delete(&schema::unsealed(ino));
                // While unsealed, the `U` mark already has the file re-sealed after a crash.
                match seal.data_durable {
                    true => txn.delete(&schema::sync_pending(ino)),
                    false => txn.put(&schema::sync_pending(ino), &sync_mark(token, &self.node)),
                }
            }
            Ok(Some(inode))
        }
    }

    /// Move the current batched layout of `ino` (if one is) to plain
    /// records, in batches, then drop its token and any pending records no
    /// token made current (a seal that died between batches).
    pub fn finish_layout_move(&self, ino: Ino) -> MetaResult<()> {
        loop {
            let (token, page) = self.read(|txn| {
                let token = current_token(txn, ino)?;
                let (start, end) = schema::prefix_range(&schema::pending_chunks_of(ino));
                Ok((token, txn.scan(&start, &end, FOLD_BATCH)?))
            })?;
            if page.is_empty() {
                if token.is_some() {
                    self.write(Durability::Buffered, |txn| {
                        if current_token(txn, ino)? == token {
                            txn.delete(&schema::layout_commit(ino));
                        }
                        Ok(())
                    })?;
                }
                return Ok(());
            }
            self.write(Durability::Buffered, |txn| {
                if current_token(txn, ino)? != token {
                    return Ok(());
                }
                for (k, v) in &page {
                    if txn.get(k)?.as_deref() != Some(v.as_slice()) {
                        continue;
                    }
                    let p: PendingChunk = decode(k, v)?;
                    if Some(p.token) == token {
                        txn.put(&schema::chunk(ino, schema::chunk_index(k)), &encode(&p.record));
                    }
                    txn.delete(k);
                }
                Ok(())
            })?;
        }
    }

    /// Give up the write leases of writing sessions that ended with nothing
    /// left to record, many in one transaction: files closed while still
    /// empty, and files unchanged since a publish recorded their layout.
    pub fn end_sessions(&self, ends: &[SessionEnd]) -> MetaResult<()> {
        // Up to three operations per file (the mark, and a tier record and
        // object key, or a sync-pending mark), under the engine's limit.
        for batch in ends.chunks(self.unsealed_batch().min(ends.len().max(1))) {
            let r = self.end_sessions_batch(batch);
            if batch.iter().any(|e| matches!(e, SessionEnd::Published { .. })) {
                // After the commit (also a failed one: it may have applied),
                // so that the flusher's next look finds the marks.
                self.sync_marks.store(true, std::sync::atomic::Ordering::Release);
            }
            r?;
        }
        Ok(())
    }

    /// The most sessions [`Namespace::end_sessions`] ends in one transaction.
    pub fn unsealed_batch(&self) -> usize {
        self.kv.txn_limit().map_or(usize::MAX, |limit| (limit / 4).max(1))
    }

    fn end_sessions_batch(&self, ends: &[SessionEnd]) -> MetaResult<()> {
        if ends.is_empty() {
            return Ok(());
        }
        let token = self.sync_tokens.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.write(Durability::Buffered, |txn| {
            for end in ends {
                match *end {
                    SessionEnd::Empty(ino) => {
                        let key = schema::unsealed(ino);
                        // Another node's lease (taken since) is not ours to drop.
                        match txn.get(&key)? {
                            Some(mark) if self.is_mine(parse_lease_mark(&mark).0) => txn.delete(&key),
                            _ => continue,
                        }
                        // Empty files are backfilled too (an empty object).
                        if self.tiered
                            && crate::ops::tier::get_tier(txn, ino)?.is_none()
                            && txn.get(&schema::inode(ino))?.is_some()
                        {
                            crate::ops::tier::mark_dirty(txn, ino, &self.node)?;
                        }
                    }
                    SessionEnd::Published { ino, lease } => {
                        // A lease lost meanwhile is the new holder's now.
                        match self.check_lease(txn, ino, lease) {
                            Ok(()) => {}
                            Err(MetaError::LeaseLost { .. }) => continue,
                            Err(e) => return Err(e),
                        }
                        txn.delete(&schema::unsealed(ino));
                        // The layout is the publish's; the local copy may
                        // still be in the page cache: the flusher syncs it.
                        txn.put(&schema::sync_pending(ino), &sync_mark(token, &self.node));
                    }
                }
            }
            Ok(())
        })
    }

    /// The node holding the write lease of `ino` (its unsealed mark), if any.
    pub fn lease_holder(&self, ino: Ino) -> MetaResult<Option<String>> {
        self.read(|txn| {
            Ok(txn.get(&schema::unsealed(ino))?.map(|v| String::from_utf8_lossy(parse_lease_mark(&v).0).into_owned()))
        })
    }

    /// Files that were open for writing on this node when its daemon
    /// stopped, with the epoch of the lease each was written under.
    pub fn unsealed(&self) -> MetaResult<Vec<(Ino, u64)>> {
        self.read(|txn| {
            Ok(scan_all(txn, &schema::unsealed_all())?
                .iter()
                .map(|(k, v)| (k, parse_lease_mark(v)))
                .filter(|(_, (holder, _))| self.is_mine(holder))
                .map(|(k, (_, epoch))| (schema::key_ino(k), epoch))
                .collect())
        })
    }

    /// This node's files sealed from bytes not yet known to be on stable
    /// storage, with the token of that seal. A file may have two, one under
    /// each of the marks' prefixes (see `schema.rs`).
    pub fn sync_pending(&self) -> MetaResult<Vec<(Ino, u64)>> {
        self.read(|txn| {
            let mut marks = Vec::new();
            for prefix in schema::sync_pending_all() {
                marks.extend(scan_all(txn, &prefix)?.iter().filter_map(|(k, v)| {
                    let (token, node) = parse_sync_mark(v)?;
                    self.is_mine(node).then(|| (schema::key_ino(k), token))
                }));
            }
            Ok(marks)
        })
    }

    /// [`Namespace::sync_pending`] for the flusher: read only when this node
    /// may have written a mark since the last look that found none (or
    /// since it opened the volume: a crash leaves them), so that an idle
    /// node asks the engine nothing.
    pub fn sync_pending_since(&self) -> MetaResult<Vec<(Ino, u64)>> {
        use std::sync::atomic::Ordering;
        if !self.sync_marks.swap(false, Ordering::AcqRel) {
            return Ok(Vec::new());
        }
        let marks = self.sync_pending().inspect_err(|_| self.sync_marks.store(true, Ordering::Release))?;
        if !marks.is_empty() {
            // Looked at again until a look finds them cleared.
            self.sync_marks.store(true, Ordering::Release);
        }
        Ok(marks)
    }

    /// Drop the sync-pending marks of files whose backing files were synced
    /// after these seals, in durable commits: one, or on an engine with a
    /// limit per transaction (etcd's 128 operations; each mark is read under
    /// both its prefixes, two compares, and deleted) one per batch under
    /// it, since a second's seals can be more. A mark written by a later
    /// seal (another token) stays: its bytes may be newer than the sync. A
    /// batch's marks are read together (etcd: one request, where a read of
    /// each was one request a file).
    pub fn clear_sync_pending(&self, synced: &[(Ino, u64)]) -> MetaResult<()> {
        let batch = self.kv.txn_limit().map_or(usize::MAX, |limit| (limit / 3).max(1));
        let mut batches: Vec<&[(Ino, u64)]> = synced.chunks(batch).collect();
        if batches.is_empty() {
            // Still one durable commit: it makes the commits before it durable.
            batches.push(&[]);
        }
        for part in batches {
            let keys: Vec<Vec<u8>> = part
                .iter()
                .flat_map(|(ino, _)| [schema::sync_pending(*ino), schema::sync_pending_before(*ino)])
                .collect();
            let tokens = part.iter().flat_map(|mark| [mark, mark]);
            self.write(Durability::Durable, |txn| {
                for ((key, (_, token)), (current, _)) in
                    keys.iter().zip(tokens.clone()).zip(txn.get_many_versioned(&keys)?)
                {
                    if current.as_deref().and_then(parse_sync_mark).is_some_and(|(t, _)| t == *token) {
                        txn.delete(key);
                    }
                }
                Ok(())
            })?;
        }
        Ok(())
    }

    /// Drop this node's sync-pending mark of `ino`, whatever its token (its
    /// copy was checked against the layout instead of sealed again).
    pub fn clear_sync_pending_of(&self, ino: Ino) -> MetaResult<()> {
        self.write(Durability::Durable, |txn| {
            for key in [schema::sync_pending(ino), schema::sync_pending_before(ino)] {
                if txn.get(&key)?.as_deref().and_then(parse_sync_mark).is_some_and(|(_, node)| self.is_mine(node)) {
                    txn.delete(&key);
                }
            }
            Ok(())
        })
    }

    /// The node holding the write lease of `ino`, if any.
    pub fn writer(&self, ino: Ino) -> MetaResult<Option<String>> {
        self.read(|txn| {
            let mark = txn.get(&schema::unsealed(ino))?;
            Ok(mark.map(|v| String::from_utf8_lossy(parse_lease_mark(&v).0).into_owned()))
        })
    }
}
