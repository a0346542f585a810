//! The object tier's records: each file's backfill state (`T`), objects to
//! delete (`G`), imported objects, and the chunk replica changes that
//! eviction and hydration make. Moving bytes is the daemon's job; this
//! module only records where they are, one transaction per step.

use crate::error::{MetaError, MetaResult};
use crate::kv::{Durability, KvRead, KvWrite};
use crate::namespace::{check_name, decode, encode, get_dentry, get_inode, put_dentry, put_inode, scan_all, Namespace};
use crate::ops::layout::chunk_at_version;
use crate::schema;
use crate::types::*;

pub(crate) fn get_tier(txn: &mut (impl KvRead + ?Sized), ino: Ino) -> MetaResult<Option<TierRecord>> {
    let key = schema::tier(ino);
    match txn.get(&key)? {
        Some(v) => Ok(Some(decode(&key, &v)?)),
        None => Ok(None),
    }
}

fn put_tier(txn: &mut (impl KvWrite + ?Sized), ino: Ino, rec: &TierRecord) {
    txn.put(&schema::tier(ino), &encode(rec));
}

/// The file changed (a seal): its object, if any, is stale from now on.
pub(crate) fn mark_dirty(txn: &mut (impl KvWrite + ?Sized), ino: Ino, node: &str) -> MetaResult<()> {
    let rec = match get_tier(txn, ino)? {
        Some(mut r) => {
            r.state = TierState::Dirty;
            r.generation += 1;
            r.node = node.to_string();
            r.sealed_at = Timespec::now();
            r
        }
        None => TierRecord {
            state: TierState::Dirty,
            generation: 1,
            node: node.to_string(),
            sealed_at: Timespec::now(),
            key: String::new(),
            etag: None,
            source: None,
        },
    };
    put_tier(txn, ino, &rec);
    Ok(())
}

/// The file that owns `key` of the mount's store: the one recorded in the
/// key's `Y` entry, while its tier record still points at the key (or it
/// is uploading or re-keying, perhaps to it). A claim left by a file that moved on, or
/// was purged, no longer counts.
fn key_owner(txn: &mut (impl KvRead + ?Sized), key: &str) -> MetaResult<Option<Ino>> {
    let Some(v) = txn.get(&schema::key_owner(key))? else { return Ok(None) };
    let ino = u64::from_be_bytes(v.as_slice().try_into().map_err(|_| MetaError::Corrupt {
        key: format!("owner of object key {key}"),
        msg: format!("{} bytes where 8 were expected", v.len()),
    })?);
    // Uploading or re-keying: on its way to a key, perhaps this one.
    let holds = get_tier(txn, ino)?.is_some_and(|r| {
        (r.key == key && r.source.is_none()) || matches!(r.state, TierState::Uploading | TierState::ReKeying)
    });
    Ok(holds.then_some(ino))
}

/// Make `ino` the owner of `key`, unless another file owns it.
fn claim_key(txn: &mut (impl KvWrite + ?Sized), key: &str, ino: Ino) -> MetaResult<Result<(), Ino>> {
    match key_owner(txn, key)? {
        Some(other) if other != ino => Ok(Err(other)),
        _ => {
            txn.put(&schema::key_owner(key), &ino.to_be_bytes());
            Ok(Ok(()))
        }
    }
}

/// `ino` lets go of `key`. Returns whether the object under it may be
/// deleted: it was this file's (or nobody's).
fn release_key(txn: &mut (impl KvWrite + ?Sized), key: &str, ino: Ino) -> MetaResult<bool> {
    let k = schema::key_owner(key);
    match txn.get(&k)? {
        Some(v) if v.as_slice() == ino.to_be_bytes() => {
            txn.delete(&k);
            Ok(true)
        }
        Some(_) => Ok(key_owner(txn, key)?.is_none()),
        None => Ok(true),
    }
}

impl Namespace {
    /// An inode got a new name. A backed object must move to the new key.
    /// An imported one stays where it is, and its file keeps reading from
    /// it until a copy of it is the file's object in the mount's own store
    /// (re-keying, by the renaming node). A directory is recorded (`R`) for
    /// a walk that marks every file below it.
    pub(crate) fn note_rename(&self, txn: &mut (impl KvWrite + ?Sized), inode: &Inode) -> MetaResult<()> {
        if inode.kind == FileKind::Directory && self.tiered {
            let mark = RenamedDir { node: self.node.clone(), at: Timespec::now() };
            txn.put(&schema::renamed_dir(inode.ino), &encode(&mark));
            return Ok(());
        }
        if inode.kind != FileKind::Regular {
            return Ok(());
        }
        let Some(mut rec) = get_tier(txn, inode.ino)? else { return Ok(()) };
        match rec.state {
            TierState::Backed | TierState::ReKeying => {
                rec.state = TierState::ReKeying;
                rec.node = self.node.clone();
            }
            // Not uploaded yet: the upload uses the name it finds.
            TierState::Dirty | TierState::Uploading => return Ok(()),
        }
        put_tier(txn, inode.ino, &rec);
        Ok(())
    }

    /// Renamed directories still to walk: this node's (`mine`), or every node's.
    pub fn renamed_dirs(&self, mine: bool) -> MetaResult<Vec<(Ino, RenamedDir)>> {
        self.records_by_node(&schema::renamed_dirs(), mine, |m: &RenamedDir| &m.node)
    }

    /// The records under `prefix` (keyed by inode), decoded; with `mine`,
    /// only those whose `node` is this one.
    fn records_by_node<T: serde::de::DeserializeOwned>(
        &self,
        prefix: &[u8],
        mine: bool,
        node: impl Fn(&T) -> &String,
    ) -> MetaResult<Vec<(Ino, T)>> {
        let all = self.read(|txn| scan_all(txn, prefix))?;
        let mut out = Vec::new();
        for (k, v) in all {
            let rec: T = decode(&k, &v)?;
            if !mine || self.is_mine(node(&rec).as_bytes()) {
                out.push((schema::key_ino(&k), rec));
            }
        }
        Ok(out)
    }

    /// Take over the backfill of `ino` from `dead`, a node whose
    /// membership lease is gone: its dirty, half-uploaded or re-keying file
    /// becomes this node's (which reads the bytes from the replicas). False
    /// when the record moved on or that node is alive again.
    pub fn adopt_backfill(&self, ino: Ino, dead: &str) -> MetaResult<bool> {
        self.write(Durability::Buffered, |txn| {
            let Some(mut rec) = get_tier(txn, ino)? else { return Ok(false) };
            if rec.node != dead || rec.state == TierState::Backed || txn.get(&schema::live_node(dead))?.is_some() {
                return Ok(false);
            }
            tracing::info!(
                ino,
                from = dead,
                state = rec.state.name(),
                "taking over the backfill of a dead node's file"
            );
            rec.node = self.node.clone();
            put_tier(txn, ino, &rec);
            Ok(true)
        })
    }

    /// Take over the walk of a directory that `mark.node`, now dead, renamed.
    pub fn adopt_renamed_dir(&self, ino: Ino, mark: &RenamedDir) -> MetaResult<bool> {
        self.write(Durability::Buffered, |txn| {
            let key = schema::renamed_dir(ino);
            let Some(v) = txn.get(&key)? else { return Ok(false) };
            if decode::<RenamedDir>(&key, &v)? != *mark || txn.get(&schema::live_node(&mark.node))?.is_some() {
                return Ok(false);
            }
            txn.put(&key, &encode(&RenamedDir { node: self.node.clone(), at: mark.at }));
            Ok(true)
        })
    }

    /// The walk of a renamed directory is done: drop its mark, unless the
    /// directory was renamed again meanwhile (that rename's walk is owed).
    pub fn renamed_dir_walked(&self, ino: Ino, walked: &RenamedDir) -> MetaResult<()> {
        self.write(Durability::Buffered, |txn| {
            let key = schema::renamed_dir(ino);
            if let Some(v) = txn.get(&key)? {
                if decode::<RenamedDir>(&key, &v)? == *walked {
                    txn.delete(&key);
                }
            }
            Ok(())
        })
    }
}

/// The file is being purged: its object (in the mount's own store) is queued for deletion.
pub(crate) fn discard(txn: &mut (impl KvWrite + ?Sized), ino: Ino) -> MetaResult<()> {
    if let Some(rec) = get_tier(txn, ino)? {
        if !rec.key.is_empty() && rec.source.is_none() {
            txn.put(&schema::garbage(ino), &encode(&GarbageObject { key: rec.key, source: None }));
        }
        txn.delete(&schema::tier(ino));
    }
    Ok(())
}

/// Whether an upload may start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UploadStart {
    /// Uploading now, from this record.
    Go(TierRecord),
    /// Another file still owns the key (its object has not moved away yet):
    /// try again later.
    KeyBusy { owner: Ino },
    /// Nothing to upload here (not dirty, another node's, being written).
    Skip,
}

/// How an upload ended in the metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UploadEnd {
    /// Recorded as backed; `stale` is an older object of the file (under
    /// another key) that should now be deleted.
    Backed { stale: Option<String> },
    /// The file was sealed again (or removed) while the upload ran: it stays dirty.
    Superseded,
}

/// One object found by an import listing.
#[derive(Debug, Clone)]
pub enum ImportEntry {
    File {
        name: Vec<u8>,
        size: u64,
        mtime: Timespec,
        key: String,
        etag: Option<String>,
        source: Option<String>,
    },
    /// A common prefix: a directory listed when first read.
    Dir {
        name: Vec<u8>,
        url: String,
    },
}

impl Namespace {
    pub fn tier(&self, ino: Ino) -> MetaResult<Option<TierRecord>> {
        self.read(|txn| get_tier(txn, ino))
    }

    /// Every file's tier record; with `mine`, only those this node must act on.
    pub fn tier_records(&self, mine: bool) -> MetaResult<Vec<(Ino, TierRecord)>> {
        self.records_by_node(&schema::tier_all(), mine, |r: &TierRecord| &r.node)
    }

    /// Dirty → Uploading to `key`, if the file is dirty and this node
    /// holds its bytes, and no other file owns the key (a file renamed away
    /// from it whose object has not moved yet). Claims the key.
    pub fn begin_upload(&self, ino: Ino, key: &str) -> MetaResult<UploadStart> {
        self.write(Durability::Buffered, |txn| {
            let Some(mut rec) = get_tier(txn, ino)? else { return Ok(UploadStart::Skip) };
            // Uploading here: a crash or failure during an earlier attempt.
            if !matches!(rec.state, TierState::Dirty | TierState::Uploading) || !self.is_mine(rec.node.as_bytes()) {
                return Ok(UploadStart::Skip);
            }
            if let Some(writer) = txn.get(&schema::unsealed(ino))? {
                // Being written: sealed again later. A writer whose node is
                // dead left what it last published, which is what goes up.
                let writer = String::from_utf8_lossy(crate::ops::layout::parse_lease_mark(&writer).0).into_owned();
                if self.is_mine(writer.as_bytes()) || txn.get(&schema::live_node(&writer))?.is_some() {
                    return Ok(UploadStart::Skip);
                }
            }
            if let Err(owner) = claim_key(txn, key, ino)? {
                return Ok(UploadStart::KeyBusy { owner });
            }
            rec.state = TierState::Uploading;
            put_tier(txn, ino, &rec);
            Ok(UploadStart::Go(rec))
        })
    }

    /// Uploading → Backed, when no seal came in since `generation` began.
    /// An upload that lost to a newer seal but wrote the key the file's
    /// object is recorded under may have replaced that object with older
    /// bytes: the file is marked dirty again so its owner uploads it anew.
    pub fn end_upload(&self, ino: Ino, generation: u64, key: &str, etag: Option<String>) -> MetaResult<UploadEnd> {
        self.write(Durability::Buffered, |txn| {
            let Some(mut rec) = get_tier(txn, ino)? else { return Ok(UploadEnd::Superseded) };
            if rec.generation != generation || rec.state != TierState::Uploading {
                if rec.key == key && rec.state == TierState::Backed && rec.etag != etag {
                    rec.state = TierState::Dirty;
                    rec.generation += 1;
                    put_tier(txn, ino, &rec);
                }
                return Ok(UploadEnd::Superseded);
            }
            let old = std::mem::replace(&mut rec.key, key.to_string());
            let stale = match !old.is_empty() && old != key && rec.source.is_none() {
                true => release_key(txn, &old, ino)?.then_some(old),
                false => None,
            };
            rec.state = TierState::Backed;
            rec.etag = etag.clone();
            rec.source = None;
            put_tier(txn, ino, &rec);
            Ok(UploadEnd::Backed { stale })
        })
    }

    /// Uploading → Dirty after a failed attempt (retried later).
    pub fn abort_upload(&self, ino: Ino, generation: u64) -> MetaResult<()> {
        self.write(Durability::Buffered, |txn| {
            if let Some(mut rec) = get_tier(txn, ino)? {
                if rec.generation == generation && rec.state == TierState::Uploading {
                    rec.state = TierState::Dirty;
                    put_tier(txn, ino, &rec);
                }
            }
            Ok(())
        })
    }

    /// Mark a backed file whose object sits under an old key (it or a
    /// directory above it was renamed; an imported file's object is in its
    /// source bucket) as re-keying. Returns the record if it was.
    pub fn begin_rekey(&self, ino: Ino) -> MetaResult<Option<TierRecord>> {
        self.write(Durability::Buffered, |txn| {
            let Some(mut rec) = get_tier(txn, ino)? else { return Ok(None) };
            if !matches!(rec.state, TierState::Backed | TierState::ReKeying) {
                return Ok(None);
            }
            if rec.state == TierState::Backed {
                rec.state = TierState::ReKeying;
                rec.node = self.node.clone();
                put_tier(txn, ino, &rec);
            }
            Ok(Some(rec))
        })
    }

    /// The store no longer holds the object of `ino` that the record names
    /// (its ETag is not `etag`): the file is dirty again, to be uploaded by
    /// this node, which holds its bytes. Imported files are left alone: an
    /// import follows its source (see `refresh_import`).
    pub fn object_changed(&self, ino: Ino, etag: Option<&str>) -> MetaResult<()> {
        self.write(Durability::Buffered, |txn| {
            let Some(mut rec) = get_tier(txn, ino)? else { return Ok(()) };
            if rec.state != TierState::Backed || rec.etag.as_deref() != etag || rec.source.is_some() {
                return Ok(());
            }
            rec.state = TierState::Dirty;
            rec.generation += 1;
            rec.node = self.node.clone();
            rec.sealed_at = Timespec::now();
            put_tier(txn, ino, &rec);
            Ok(())
        })
    }

    /// Claim `new`, the key a re-key copies the object of `ino` to. Err
    /// with the owner when another file still owns it.
    pub fn claim_rekey(&self, ino: Ino, new: &str) -> MetaResult<Result<(), Ino>> {
        self.write(Durability::Buffered, |txn| claim_key(txn, new, ino))
    }

    /// The object was copied from `old` to `new` (a key of the mount's
    /// store; `old` is one of the mount's store too, or of the import
    /// source `from`): record the new key. Returns whether it was recorded
    /// (false when the record moved on: the file is gone, or another
    /// re-key won) and whether the object under `old` may be deleted now.
    pub fn end_rekey(
        &self,
        ino: Ino,
        old: &str,
        from: Option<&str>,
        new: &str,
        etag: Option<String>,
    ) -> MetaResult<(bool, bool)> {
        self.write(Durability::Buffered, |txn| {
            let Some(mut rec) = get_tier(txn, ino)? else { return Ok((false, false)) };
            if rec.key != old || rec.source.as_deref() != from {
                return Ok((false, false));
            }
            rec.key = new.to_string();
            rec.etag = etag.clone();
            rec.source = None;
            if rec.state == TierState::ReKeying {
                rec.state = TierState::Backed;
            }
            put_tier(txn, ino, &rec);
            // An import source's objects are never converged's to delete.
            let free = from.is_none() && old != new && release_key(txn, old, ino)?;
            Ok((true, free))
        })
    }

    /// A stale object key of `ino` (left by an upload under an older name):
    /// let go of it; true when its object may be deleted.
    pub fn release_key(&self, ino: Ino, key: &str) -> MetaResult<bool> {
        self.write(Durability::Buffered, |txn| release_key(txn, key, ino))
    }

    /// Objects of purged files, waiting for deletion.
    pub fn garbage(&self) -> MetaResult<Vec<(Ino, GarbageObject)>> {
        let all = self.read(|txn| scan_all(txn, &schema::garbage_all()))?;
        all.into_iter().map(|(k, v)| Ok((schema::key_ino(&k), decode(&k, &v)?))).collect()
    }

    /// The object of a purged file: may it be deleted (no other file owns
    /// its key now)? The key is let go of either way.
    pub fn release_garbage_key(&self, ino: Ino, key: &str) -> MetaResult<bool> {
        self.release_key(ino, key)
    }

    pub fn drop_garbage(&self, ino: Ino) -> MetaResult<()> {
        self.write(Durability::Buffered, |txn| {
            txn.delete(&schema::garbage(ino));
            Ok(())
        })
    }

    /// Every file the object store is said to hold: backed or being
    /// re-keyed, with its tier record.
    pub fn backed_files(&self) -> MetaResult<Vec<(Ino, TierRecord)>> {
        self.read(|txn| {
            let mut out = Vec::new();
            for (k, v) in crate::namespace::scan_all(txn, &schema::tier_all())? {
                let t: TierRecord = decode(&k, &v)?;
                if matches!(t.state, TierState::Backed | TierState::ReKeying) {
                    out.push((schema::key_ino(&k), t));
                }
            }
            Ok(out)
        })
    }

    /// A backed file of the mount's own store whose object is gone or
    /// wrong: uploaded again from its chunks by `node` (fsck's repair).
    /// Returns whether it was marked.
    pub fn reupload(&self, ino: Ino, node: &str) -> MetaResult<bool> {
        self.write(Durability::Durable, |txn| match get_tier(txn, ino)? {
            Some(t) if t.source.is_none() && matches!(t.state, TierState::Backed | TierState::ReKeying) => {
                mark_dirty(txn, ino, node)?;
                Ok(true)
            }
            _ => Ok(false),
        })
    }

    /// Every object key a file refers to: keys of the mount's own store
    /// owned in the key registry or named by a tier record (relative to the
    /// store's prefix), and, apart, the keys imported files read from their
    /// sources (full keys). An object under the store's prefix that matches
    /// neither belongs to no file (`converged gc`).
    pub fn referenced_object_keys(
        &self,
    ) -> MetaResult<(std::collections::HashSet<String>, std::collections::HashSet<String>)> {
        self.read(|txn| {
            let (mut own, mut imported) = (std::collections::HashSet::new(), std::collections::HashSet::new());
            for (k, _) in crate::namespace::scan_all(txn, &schema::key_owners_all())? {
                own.insert(String::from_utf8_lossy(&k[1..]).into_owned());
            }
            for (k, v) in crate::namespace::scan_all(txn, &schema::tier_all())? {
                let t: TierRecord = decode(&k, &v)?;
                match (&t.source, t.key.is_empty()) {
                    (_, true) => {}
                    (None, false) => {
                        own.insert(t.key);
                    }
                    (Some(_), false) => {
                        imported.insert(t.key);
                    }
                }
            }
            Ok((own, imported))
        })
    }

    /// The names from the root down to `ino`, following each inode's
    /// recorded parent and name; `None` when a step no longer holds (the
    /// name was unlinked while another hard link remains).
    pub fn path_of(&self, ino: Ino) -> MetaResult<Option<Vec<Vec<u8>>>> {
        self.read(|txn| {
            let mut names = Vec::new();
            let mut cur = get_inode(txn, ino)?;
            // Bounded so a corrupt parent chain cannot loop forever.
            for _ in 0..4096 {
                if cur.ino == ROOT_INO {
                    names.reverse();
                    return Ok(Some(names));
                }
                match get_dentry(txn, cur.parent, &cur.name)? {
                    Some(d) if d.ino == cur.ino => {}
                    _ => return Ok(None),
                }
                names.push(cur.name.clone());
                cur = get_inode(txn, cur.parent)?;
            }
            Ok(None)
        })
    }

    /// Evict: drop this node's copy of chunk `index` from its record, if the
    /// chunk is still at `version` and the file is backed (the object holds
    /// its bytes). Returns whether the copy may now be deleted.
    pub fn drop_replica(&self, ino: Ino, index: u32, version: u64) -> MetaResult<bool> {
        self.write(Durability::Durable, |txn| {
            // Only a file whose object is where its record says: not one
            // re-keying (a new key is being written) or being uploaded.
            let backed = get_tier(txn, ino)?.is_some_and(|r| r.state == TierState::Backed);
            if !backed || txn.get(&schema::unsealed(ino))?.is_some() {
                return Ok(false);
            }
            let Some(mut record) = chunk_at_version(txn, ino, index, version)? else { return Ok(false) };
            let before = record.replicas.len();
            if self.clustered {
                record.replicas.retain(|r| r != &self.node);
            } else {
                record.replicas.clear();
            }
            if record.replicas.len() == before {
                return Ok(false);
            }
            txn.put(&schema::chunk(ino, index), &encode(&record));
            self.unindex_holder(txn, &self.node, ino, index);
            Ok(true)
        })
    }

    /// A chunk was fetched from the object store into this node's SSD:
    /// record the copy. `version` is the record it was fetched for; `None`
    /// when the file had no record for it (an imported object, or a backed
    /// file's chunk never written here), which is then created with the
    /// checksums computed as it arrived. Returns false when the layout
    /// changed meanwhile.
    pub fn record_fetched(
        &self,
        ino: Ino,
        index: u32,
        version: Option<u64>,
        len: u32,
        block_crcs: &[u32],
    ) -> MetaResult<bool> {
        self.write(Durability::Buffered, |txn| {
            if crate::ops::layout::layout_moving(txn, ino)? {
                return Ok(false);
            }
            let key = schema::chunk(ino, index);
            let mut record = match (txn.get(&key)?, version) {
                (Some(v), Some(version)) => {
                    let r: ChunkRecord = decode(&key, &v)?;
                    if r.version != version {
                        return Ok(false);
                    }
                    r
                }
                (None, None) => {
                    let backed =
                        get_tier(txn, ino)?.is_some_and(|r| matches!(r.state, TierState::Backed | TierState::ReKeying));
                    if !backed || txn.get(&schema::unsealed(ino))?.is_some() {
                        return Ok(false);
                    }
                    ChunkRecord { version: 1, len, replicas: Vec::new(), block_crcs: block_crcs.to_vec() }
                }
                _ => return Ok(false),
            };
            if !record.replicas.contains(&self.node) {
                record.replicas.push(self.node.clone());
            }
            txn.put(&key, &encode(&record));
            self.index_holders(txn, ino, index, &record);
            Ok(true)
        })
    }

    /// Make imported objects into files (and prefixes into directories to
    /// be listed later) under `parent`, in one transaction. Names already
    /// present are left alone (a listing resumed after a crash).
    pub fn import_entries(&self, parent: Ino, entries: &[ImportEntry], uid: u32, gid: u32) -> MetaResult<usize> {
        for e in entries {
            let name = match e {
                ImportEntry::File { name, .. } | ImportEntry::Dir { name, .. } => name,
            };
            check_name(name)?;
        }
        let mut inos = Vec::with_capacity(entries.len());
        for _ in entries {
            inos.push(self.alloc_ino()?);
        }
        let chunk_size = self.chunk_size();
        self.write(Durability::Buffered, |txn| {
            let mut dir = self.dir_in(txn, parent)?;
            let now = Timespec::now();
            let mut made = 0;
            for (e, ino) in entries.iter().zip(&inos) {
                let (name, kind) = match e {
                    ImportEntry::File { name, .. } => (name, FileKind::Regular),
                    ImportEntry::Dir { name, .. } => (name, FileKind::Directory),
                };
                if get_dentry(txn, parent, name)?.is_some() {
                    continue;
                }
                let mut inode = Inode {
                    ino: *ino,
                    kind,
                    perm: if kind == FileKind::Directory { 0o755 } else { 0o644 },
                    uid,
                    gid,
                    nlink: if kind == FileKind::Directory { 2 } else { 1 },
                    size: 0,
                    atime: now,
                    mtime: now,
                    ctime: now,
                    rdev: 0,
                    parent,
                    name: name.clone(),
                    chunk_size: if kind == FileKind::Regular { chunk_size } else { 0 },
                    target: None,
                };
                match e {
                    ImportEntry::File { size, mtime, key, etag, source, .. } => {
                        inode.size = *size;
                        inode.mtime = *mtime;
                        inode.ctime = *mtime;
                        let rec = TierRecord {
                            state: TierState::Backed,
                            generation: 1,
                            node: self.node.clone(),
                            sealed_at: now,
                            key: key.clone(),
                            etag: etag.clone(),
                            source: source.clone(),
                        };
                        put_tier(txn, *ino, &rec);
                        if source.is_none() {
                            // An object of the mount's own store: this file's.
                            txn.put(&schema::key_owner(key), &ino.to_be_bytes());
                        }
                    }
                    ImportEntry::Dir { url, .. } => {
                        txn.put(&schema::xattr(*ino, IMPORT_XATTR), url.as_bytes());
                        dir.nlink += 1;
                    }
                }
                put_inode(txn, &inode);
                put_dentry(txn, parent, name, &Dentry { ino: *ino, kind });
                made += 1;
            }
            if made > 0 {
                dir.mtime = now;
                dir.ctime = now;
                put_inode(txn, &dir);
            }
            Ok(made)
        })
    }

    /// An imported object changed behind converged's back: take its new
    /// size, mtime and ETag, and forget every chunk fetched from the old one.
    /// Refused (`Busy`) while the file is being written.
    pub fn refresh_import(&self, ino: Ino, size: u64, mtime: Timespec, etag: Option<String>) -> MetaResult<()> {
        self.write(Durability::Durable, |txn| {
            if txn.get(&schema::unsealed(ino))?.is_some() {
                return Err(MetaError::Invalid("an imported file changed in its bucket while being written here"));
            }
            let mut inode = get_inode(txn, ino)?;
            let Some(mut rec) = get_tier(txn, ino)? else { return Ok(()) };
            crate::ops::layout::drop_chunks_from(txn, ino, 0)?;
            txn.delete(&schema::layout_commit(ino));
            inode.size = size;
            inode.mtime = mtime;
            inode.ctime = Timespec::now();
            put_inode(txn, &inode);
            rec.etag = etag.clone();
            rec.state = TierState::Backed;
            put_tier(txn, ino, &rec);
            Ok(())
        })
    }
}
