//! fsck: the namespace checked against itself at one point in time (one
//! read transaction, so a volume under load is checked as of one
//! revision), and its chunk records against the volume's nodes.
//!
//! What is checked: every name leads to an inode; every file's link count
//! is its number of names; every inode but the root has a name or an
//! orphan mark (open somewhere while unlinked); every chunk record belongs
//! to an inode and lies within its file; every holder a record names is a
//! registered node and is listed for it in the holder index; every chunk
//! has a copy on a live node or is backed.
//!
//! `repair` fixes what is safe to fix from the metadata alone: it removes
//! names of missing inodes, records of missing inodes and records past a
//! file's end, sets link counts to the names found, links unreachable files
//! under `/lost+found`, drops unknown holders from records that keep
//! another, and lists in the holder index the holders it lacks. Missing copies are repair's and scrub's work (`core/repair.rs`),
//! not fsck's.

use std::collections::{HashMap, HashSet};

use crate::error::{MetaError, MetaResult};
use crate::kv::Durability;
use crate::namespace::{decode, encode, get_dentry, get_inode, put_inode, scan_all, scan_paged, Namespace};
use crate::schema;
use crate::types::*;

/// One thing fsck found wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finding {
    /// A name whose inode does not exist.
    DanglingName { parent: Ino, name: Vec<u8>, ino: Ino },
    /// A file whose link count is not its number of names.
    LinkCount { ino: Ino, recorded: u32, names: u32 },
    /// An inode with no name and no orphan mark: nothing can reach it.
    Unreachable { ino: Ino, kind: FileKind },
    /// Chunk records of an inode that does not exist.
    ChunksOfMissingInode { ino: Ino, chunks: u32 },
    /// A chunk record past the end of its file.
    ChunkPastEnd { ino: Ino, index: u32, size: u64 },
    /// A holder that is not a registered node of the volume.
    UnknownHolder { ino: Ino, index: u32, node: String },
    /// A holder the holder index does not list for the chunk: repair and
    /// drains, which find a node's chunks there, would miss it.
    Unindexed { ino: Ino, index: u32, node: String },
    /// A chunk with no copy on a live node, in a file that is not backed.
    Lost { ino: Ino, index: u32 },
    /// A chunk with fewer copies on live nodes than its policy asks.
    UnderReplicated { ino: Ino, index: u32, live: u32, want: u32 },
}

impl Finding {
    /// The inode the finding is about.
    pub fn ino(&self) -> Ino {
        match self {
            Finding::DanglingName { parent, .. } => *parent,
            Finding::LinkCount { ino, .. }
            | Finding::Unreachable { ino, .. }
            | Finding::ChunksOfMissingInode { ino, .. }
            | Finding::ChunkPastEnd { ino, .. }
            | Finding::UnknownHolder { ino, .. }
            | Finding::Unindexed { ino, .. }
            | Finding::Lost { ino, .. }
            | Finding::UnderReplicated { ino, .. } => *ino,
        }
    }

    /// What is wrong, in words (the path is the caller's).
    pub fn describe(&self) -> String {
        match self {
            Finding::DanglingName { name, ino, .. } => {
                format!(
                    "name {:?} in this directory leads to inode {ino}, which does not exist",
                    String::from_utf8_lossy(name)
                )
            }
            Finding::LinkCount { recorded, names, .. } => format!("link count {recorded}, but {names} names"),
            Finding::Unreachable { kind, .. } => format!("{kind:?} with no name and not open anywhere"),
            Finding::ChunksOfMissingInode { chunks, .. } => format!("{chunks} chunk records of a missing inode"),
            Finding::ChunkPastEnd { index, size, .. } => {
                format!("chunk {index} lies past the end of the file ({size} bytes)")
            }
            Finding::UnknownHolder { index, node, .. } => {
                format!("chunk {index} names {node}, not a node of this volume")
            }
            Finding::Unindexed { index, node, .. } => {
                format!("chunk {index} names {node}, which the holder index does not list for it")
            }
            Finding::Lost { index, .. } => {
                format!("chunk {index} has no copy on a live node and the file is not backed")
            }
            Finding::UnderReplicated { index, live, want, .. } => {
                format!("chunk {index} has {live} copies on live nodes, {want} asked")
            }
        }
    }
}

/// What a check covered and found.
#[derive(Debug, Clone, Default)]
pub struct FsckReport {
    pub inodes: u64,
    pub names: u64,
    pub chunks: u64,
    pub findings: Vec<Finding>,
}

/// The volume's nodes, for the chunk checks (none on a single node).
pub struct NodesView<'a> {
    pub known: &'a HashSet<String>,
    pub live: &'a HashSet<String>,
    pub default_replicas: u32,
}

/// The name `/lost+found` gets in the root.
pub const LOST_FOUND: &[u8] = b"lost+found";

impl Namespace {
    /// Check the namespace and its chunk records (see the module's head).
    /// `progress` is told how many records were checked so far.
    pub fn fsck(&self, nodes: Option<&NodesView<'_>>, progress: &dyn Fn(u64)) -> MetaResult<FsckReport> {
        self.read(|txn| {
            let mut r = FsckReport::default();
            let mut inodes: HashMap<Ino, Inode> = HashMap::new();
            for (k, v) in scan_all(txn, &schema::all_inodes())? {
                let inode: Inode = decode(&k, &v)?;
                inodes.insert(inode.ino, inode);
            }
            r.inodes = inodes.len() as u64;
            progress(r.inodes);
            let mut names: HashMap<Ino, u32> = HashMap::new();
            for (k, v) in scan_all(txn, &schema::all_dentries())? {
                let d: Dentry = decode(&k, &v)?;
                r.names += 1;
                if inodes.contains_key(&d.ino) {
                    *names.entry(d.ino).or_default() += 1;
                } else {
                    let parent = schema::key_ino(&k);
                    r.findings.push(Finding::DanglingName {
                        parent,
                        name: schema::dentry_name(&k).to_vec(),
                        ino: d.ino,
                    });
                }
            }
            progress(r.inodes + r.names);
            let orphans: HashSet<Ino> =
                scan_all(txn, &schema::orphans())?.iter().map(|(k, _)| schema::key_ino(k)).collect();
            let mut ids: Vec<&Inode> = inodes.values().collect();
            ids.sort_by_key(|i| i.ino);
            for inode in ids {
                let n = names.get(&inode.ino).copied().unwrap_or(0);
                if inode.ino == ROOT_INO {
                    continue;
                }
                if n == 0 {
                    if !orphans.contains(&inode.ino) {
                        r.findings.push(Finding::Unreachable { ino: inode.ino, kind: inode.kind });
                    }
                } else if inode.kind != FileKind::Directory && inode.nlink != n {
                    r.findings.push(Finding::LinkCount { ino: inode.ino, recorded: inode.nlink, names: n });
                }
            }
            let mut missing: HashMap<Ino, u32> = HashMap::new();
            let mut policy: HashMap<Ino, u32> = HashMap::new();
            // Each known node's entries, in windows of inode numbers.
            let mut indexed: HashSet<Vec<u8>> = HashSet::new();
            if let (true, Some(nodes)) = (self.clustered, nodes) {
                for node in nodes.known {
                    let read = |start: &[u8], end: &[u8], limit| Ok(txn.scan(start, end, limit)?);
                    crate::namespace::for_each_page_by_ino(read, &schema::held_by(node), 1024, |page| {
                        indexed.extend(page.into_iter().map(|(k, _)| k));
                        Ok(())
                    })?;
                }
            }
            for (k, v) in scan_paged(txn, &schema::all_chunks(), 64)? {
                let (ino, index) = (schema::key_ino(&k), schema::chunk_index(&k));
                let rec: ChunkRecord = decode(&k, &v)?;
                r.chunks += 1;
                if r.chunks % 256 == 0 {
                    progress(r.inodes + r.names + r.chunks);
                }
                let Some(inode) = inodes.get(&ino) else {
                    *missing.entry(ino).or_default() += 1;
                    continue;
                };
                if index as u64 * inode.chunk_size.max(1) as u64 >= inode.size.max(1) {
                    r.findings.push(Finding::ChunkPastEnd { ino, index, size: inode.size });
                    continue;
                }
                let Some(nodes) = nodes else { continue };
                for h in &rec.replicas {
                    if !nodes.known.contains(h) {
                        r.findings.push(Finding::UnknownHolder { ino, index, node: h.clone() });
                    }
                    if self.clustered
                        && nodes.known.contains(h)
                        && !indexed.contains(&schema::held_chunk(h, ino, index))
                    {
                        r.findings.push(Finding::Unindexed { ino, index, node: h.clone() });
                    }
                }
                let live = rec.replicas.iter().filter(|h| nodes.live.contains(*h)).count() as u32;
                let want = match policy.get(&ino) {
                    Some(w) => *w,
                    None => {
                        let w = txn
                            .get(&schema::xattr(ino, REPLICAS_XATTR))?
                            .and_then(|v| parse_replicas(&v))
                            .unwrap_or(nodes.default_replicas);
                        policy.insert(ino, w);
                        w
                    }
                };
                if live == 0 {
                    let backed = crate::ops::tier::get_tier(txn, ino)?
                        .is_some_and(|t| matches!(t.state, TierState::Backed | TierState::ReKeying));
                    if !backed {
                        r.findings.push(Finding::Lost { ino, index });
                    }
                } else if live < want {
                    r.findings.push(Finding::UnderReplicated { ino, index, live, want });
                }
            }
            let mut missing: Vec<_> = missing.into_iter().collect();
            missing.sort();
            for (ino, chunks) in missing {
                r.findings.push(Finding::ChunksOfMissingInode { ino, chunks });
            }
            progress(r.inodes + r.names + r.chunks);
            Ok(r)
        })
    }

    /// Fix one finding where the metadata alone can (see the module's
    /// head). Returns whether it changed anything.
    pub fn fsck_repair(&self, f: &Finding) -> MetaResult<bool> {
        match f {
            Finding::DanglingName { parent, name, ino } => self.write(Durability::Durable, |txn| {
                let key = schema::dentry(*parent, name);
                match txn.get(&key)? {
                    Some(v) if decode::<Dentry>(&key, &v)?.ino == *ino && get_inode(txn, *ino).is_err() => {
                        txn.delete(&key);
                        Ok(true)
                    }
                    _ => Ok(false),
                }
            }),
            Finding::LinkCount { ino, names, .. } => self.write(Durability::Durable, |txn| {
                let mut inode = get_inode(txn, *ino)?;
                if inode.nlink == *names {
                    return Ok(false);
                }
                inode.nlink = *names;
                put_inode(txn, &inode);
                Ok(true)
            }),
            Finding::Unreachable { ino, kind } if *kind != FileKind::Directory => {
                let lf = self.lost_and_found()?;
                let name = format!("#{ino}").into_bytes();
                let linked = self.write(Durability::Durable, |txn| {
                    let mut inode = get_inode(txn, *ino)?;
                    if inode.nlink == 0 || get_dentry(txn, lf, &name)?.is_some() {
                        return Ok(false);
                    }
                    txn.put(&schema::dentry(lf, &name), &encode(&Dentry { ino: *ino, kind: *kind }));
                    inode.nlink = 1;
                    inode.parent = lf;
                    inode.name = name.clone();
                    put_inode(txn, &inode);
                    Ok(true)
                })?;
                // Unlinked and left behind (no orphan mark): its data is gone for good.
                Ok(linked || self.purge(*ino)?)
            }
            Finding::ChunksOfMissingInode { ino, .. } => self.write(Durability::Durable, |txn| {
                if get_inode(txn, *ino).is_ok() {
                    return Ok(false);
                }
                let (start, end) = schema::prefix_range(&schema::chunks_of(*ino));
                txn.delete_range(&start, &end)?;
                Ok(true)
            }),
            Finding::ChunkPastEnd { ino, index, .. } => self.write(Durability::Durable, |txn| {
                let inode = get_inode(txn, *ino)?;
                if (*index as u64) * (inode.chunk_size.max(1) as u64) < inode.size.max(1) {
                    return Ok(false);
                }
                txn.delete(&schema::chunk(*ino, *index));
                Ok(true)
            }),
            Finding::UnknownHolder { ino, index, node } => self.write(Durability::Durable, |txn| {
                let key = schema::chunk(*ino, *index);
                let Some(v) = txn.get(&key)? else { return Ok(false) };
                let mut rec: ChunkRecord = decode(&key, &v)?;
                if !rec.replicas.contains(node) || rec.replicas.len() < 2 {
                    return Ok(false);
                }
                rec.replicas.retain(|h| h != node);
                txn.put(&key, &encode(&rec));
                self.unindex_holder(txn, node, *ino, *index);
                Ok(true)
            }),
            Finding::Unindexed { ino, index, node } => self.write(Durability::Durable, |txn| {
                let Some(rec) = crate::ops::layout::read_chunk(txn, *ino, *index)? else { return Ok(false) };
                if !rec.replicas.contains(node) {
                    return Ok(false);
                }
                txn.put(&schema::held_chunk(node, *ino, *index), &[]);
                Ok(true)
            }),
            _ => Ok(false),
        }
    }

    /// `/lost+found`, made if missing.
    fn lost_and_found(&self) -> MetaResult<Ino> {
        match self.lookup(ROOT_INO, LOST_FOUND) {
            Ok(i) => Ok(i.ino),
            Err(MetaError::NotFound) => {
                let node = NewNode::plain(FileKind::Directory, 0o700);
                match self.mknod(ROOT_INO, LOST_FOUND, &node) {
                    Ok(i) => Ok(i.ino),
                    Err(MetaError::Exists) => Ok(self.lookup(ROOT_INO, LOST_FOUND)?.ino),
                    Err(e) => Err(e),
                }
            }
            Err(e) => Err(e),
        }
    }
}
