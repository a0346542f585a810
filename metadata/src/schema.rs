//! The key schema: every key prefix the namespace writes, in one place.
//!
//! Keys are one prefix byte followed by big-endian integers, so a range scan
//! over a prefix returns entries in inode / chunk order.
//!
//! | key                        | value                | meaning                                      |
//! |----------------------------|----------------------|----------------------------------------------|
//! | `V`                        | [`VolumeRecord`]     | format version and volume-wide settings      |
//! | `F`                        | text                 | the volume's id, random, made with the volume; |
//! |                            |                      | a data dir's identity file names it          |
//! | `N`                        | u64 (BE)             | next unallocated inode number                |
//! | `I` ino                    | [`Inode`]            | attributes of one inode                      |
//! | `D` parent name            | [`Dentry`]           | a name in a directory                        |
//! | `X` ino name               | raw bytes            | one extended attribute                       |
//! | `C` ino chunk-index(u32)   | [`ChunkRecord`]      | one chunk of a file's layout                 |
//! | `P` ino chunk-index(u32)   | token, [`ChunkRecord`] | a record of a layout too large for one     |
//! |                            |                      | transaction, written ahead in batches; it is |
//! |                            |                      | current once `Q` holds its token             |
//! | `Q` ino                    | token (u64 BE)       | the batched layout that is current: its `P`  |
//! |                            |                      | records win over `C` until moved there       |
//! | `O` ino                    | node id              | orphan: unlinked while open on that node, or |
//! |                            |                      | an O_TMPFILE file not yet linked             |
//! | `U` ino                    | node id, NUL, epoch  | unsealed: open for writing on that node; its |
//! |                            | (u64 BE)             | checksums are stale; the file's write lease, |
//! |                            |                      | taken at that epoch                          |
//! | `E` ino                    | u64 (BE)             | the last lease epoch granted for the file:   |
//! |                            |                      | epochs only grow, so a fenced writer's stays |
//! |                            |                      | stale                                        |
//! | `s` ino                    | token(u64 BE) node   | sealed from bytes not yet known durable: the |
//! |                            |                      | node syncs the backing file, then drops it.  |
//! |                            |                      | Past the watched range: only the node that   |
//! |                            |                      | wrote it reads it, fresh (a put and a delete |
//! |                            |                      | a small file's close on a cluster, which     |
//! |                            |                      | every node's feed heard). Marks written      |
//! |                            |                      | before kept it under `S`, still read,        |
//! |                            |                      | cleared and purged                           |
//! | `T` ino                    | [`TierRecord`]       | backfill state and object key of a file      |
//! | `G` ino                    | [`GarbageObject`]    | object of a purged file, to delete           |
//! | `R` ino                    | [`RenamedDir`]       | renamed directory: objects below to re-key   |
//! | `Y` object key             | ino (u64 BE)         | the file that owns this key of the mount's   |
//! |                            |                      | object store: no other file's upload or      |
//! |                            |                      | re-key may write it while that file's tier   |
//! |                            |                      | record points at it                          |
//! | `K` node-id                | [`NodeInfo`]         | a node that registered once (never expires)  |
//! | `L` node-id                | [`NodeInfo`]         | a live node: written under its lease         |
//! | `A` node-id                | [`NodeAdmin`]        | an admin's word on a node: draining, drained |
//! | `B`                        | [`Rebalance`]        | a rebalance under way                        |
//! | `W`                        | u64 (BE)             | the last gc request (`converged gc`)         |
//! | `Z` node-id                | u64 (BE)             | the last gc request the node has swept for   |
//! | `H`                        | u64 (BE)             | the last request to queue files for upload   |
//! |                            |                      | again (`fsck --repair`)                      |
//! | `j` node-id NUL slot(u16)  | connection, unique,  | a kernel request of that node whose change   |
//! |                            | ino (3 × u64 BE)     | committed: a ring of slots, overwritten as   |
//! |                            |                      | requests go (see `ops/answered.rs`). Past    |
//! |                            |                      | the watched range: only the node itself      |
//! |                            |                      | reads its ring, and only when it makes a     |
//! |                            |                      | change again. Volumes made before kept it    |
//! |                            |                      | under `J`, still read, and removed with the  |
//! |                            |                      | node (`forget_node`)                         |
//! | `M` dir-ino                | node id              | the directory is delegated to that node      |
//! |                            |                      | (`--nowsync`, see `kv_deferred.rs`): its     |
//! |                            |                      | names, attributes and xattrs, and the files  |
//! |                            |                      | made in it, change only there, acknowledged  |
//! |                            |                      | before they commit; another node has it      |
//! |                            |                      | commit them and give the delegation up       |
//! |                            |                      | before it reads or changes any of them       |
//! | `h` node-id NUL ino chunk-index(u32) | empty | the holder index: a chunk record (`C` or |
//! |                            |                      | `P`) names that node among its holders.      |
//! |                            |                      | Written in the transaction that names the    |
//! |                            |                      | holder, so it is never missing an entry;     |
//! |                            |                      | an entry may outlive its record (a purge, a  |
//! |                            |                      | truncate, a new version held elsewhere) and  |
//! |                            |                      | is dropped when read and found stale. Repair,|
//! |                            |                      | drain, scrub and eviction find a node's      |
//! |                            |                      | chunks here instead of scanning every record |
//! |                            |                      | (`ops/holders.rs`). Lowercase, as `j`: it    |
//! |                            |                      | sorts after every other, past the range the  |
//! |                            |                      | change feed watches ([`WATCHED_END`]).       |
//!
//! A crash leaves `O`, `U` and `S` keys behind; the next mount of the same
//! node purges its orphans and re-seals its unsealed files, and those whose
//! seal may describe bytes the disk never got, from their backing files. A `U` key of a node whose `L` key is gone (its lease expired) may be
//! taken over by another writer.
//!
//! [`VolumeRecord`]: crate::types::VolumeRecord
//! [`Inode`]: crate::types::Inode
//! [`Dentry`]: crate::types::Dentry
//! [`ChunkRecord`]: crate::types::ChunkRecord
//! [`NodeInfo`]: crate::membership::NodeInfo
//! [`TierRecord`]: crate::types::TierRecord
//! [`GarbageObject`]: crate::types::GarbageObject
//! [`RenamedDir`]: crate::types::RenamedDir
//! [`NodeAdmin`]: crate::ops::nodes::NodeAdmin
//! [`Rebalance`]: crate::ops::nodes::Rebalance

use crate::types::Ino;

pub const VOLUME: &[u8] = b"V";
pub const NEXT_INO: &[u8] = b"N";
pub const VOLUME_ID: &[u8] = b"F";
const INODE: u8 = b'I';
const DENTRY: u8 = b'D';
const XATTR: u8 = b'X';
const CHUNK: u8 = b'C';
const ORPHAN: u8 = b'O';
const UNSEALED: u8 = b'U';
const SYNC_PENDING: u8 = b's';
/// Where sync-pending marks were written before they left the watched range.
const SYNC_PENDING_BEFORE: u8 = b'S';
const TIER: u8 = b'T';
const GARBAGE: u8 = b'G';
const RENAMED: u8 = b'R';
const LEASE_EPOCH: u8 = b'E';
const KEY_OWNER: u8 = b'Y';
const PENDING_CHUNK: u8 = b'P';
const LAYOUT_COMMIT: u8 = b'Q';
const ANSWERED: u8 = b'j';
/// Where volumes made before the ring left the watched range kept it.
const ANSWERED_BEFORE: u8 = b'J';
const DELEGATION: u8 = b'M';
const HOLDER_INDEX: u8 = b'h';

/// Where the keys the change feed watches end: the holder index (`h`) is
/// read only fresh, by background work, and watching it would add one
/// event per copy to every create that every node hears; a node's ring of
/// answered requests (`j`), written by every namespace change, is read
/// only by that node, fresh, when it makes a change again.
pub const WATCHED_END: &[u8] = b"h";

fn with_ino(prefix: u8, ino: Ino) -> Vec<u8> {
    let mut k = Vec::with_capacity(9);
    k.push(prefix);
    k.extend_from_slice(&ino.to_be_bytes());
    k
}

fn with_ino_name(prefix: u8, ino: Ino, name: &[u8]) -> Vec<u8> {
    let mut k = with_ino(prefix, ino);
    k.extend_from_slice(name);
    k
}

/// `[start, end)` covering every key that begins with `prefix`.
pub fn prefix_range(prefix: &[u8]) -> (Vec<u8>, Vec<u8>) {
    let start = prefix.to_vec();
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return (start, end);
        }
    }
    (start, vec![0xff; 16])
}

pub fn inode(ino: Ino) -> Vec<u8> {
    with_ino(INODE, ino)
}

pub fn dentry(parent: Ino, name: &[u8]) -> Vec<u8> {
    with_ino_name(DENTRY, parent, name)
}

/// Slot `slot` of node `node`'s ring of committed kernel requests.
pub fn answered(node: &str, slot: u16) -> Vec<u8> {
    [answered_of(node).as_slice(), &slot.to_be_bytes()].concat()
}

/// Every slot of node `node`'s ring.
pub fn answered_of(node: &str) -> Vec<u8> {
    of_node(ANSWERED, node)
}

/// Slot `slot` of node `node`'s ring as volumes made before kept it.
pub fn answered_before(node: &str, slot: u16) -> Vec<u8> {
    [answered_before_of(node).as_slice(), &slot.to_be_bytes()].concat()
}

/// Every slot of node `node`'s ring as volumes made before kept it.
pub fn answered_before_of(node: &str) -> Vec<u8> {
    of_node(ANSWERED_BEFORE, node)
}

/// The start of node `node`'s keys under `prefix`: prefix, node id, NUL.
fn of_node(prefix: u8, node: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(node.len() + 12);
    k.push(prefix);
    k.extend_from_slice(node.as_bytes());
    k.push(0);
    k
}

/// Every inode record (the prefix of all `I` keys).
pub fn all_inodes() -> Vec<u8> {
    vec![INODE]
}

/// Every name (the prefix of all `D` keys).
pub fn all_dentries() -> Vec<u8> {
    vec![DENTRY]
}

pub fn dentries_of(parent: Ino) -> Vec<u8> {
    with_ino(DENTRY, parent)
}

/// The name part of a dentry key.
pub fn dentry_name(key: &[u8]) -> &[u8] {
    &key[9..]
}

/// The range a node cache may keep whole listings of, for `key`: a
/// directory's names ([`dentries_of`]) for a dentry key, an inode's
/// extended attributes ([`xattrs_of`]) for an xattr key. With it, whether
/// a read that misses should list the whole range at once: an inode has
/// few xattrs, so listing them costs what reading one does, and `ls -l`
/// asks for two of every file; a directory may be large.
///
/// The delegations (`M`) are one range, listed on a miss: a node asks
/// whether a directory is delegated before every read or change of its
/// names, and nearly none are.
pub fn listed_range(key: &[u8]) -> Option<(&[u8], bool)> {
    match key.first() {
        Some(&DENTRY) if key.len() > 9 => Some((&key[..9], false)),
        Some(&XATTR) if key.len() > 9 => Some((&key[..9], true)),
        Some(&DELEGATION) if key.len() == 9 => Some((&key[..1], true)),
        _ => None,
    }
}

/// Records a node's cache in front of a shared engine may answer any read
/// with: inodes, dentries, xattrs and tier records (what lookup, getattr,
/// getxattr, a create's replica policy and an import's freshness check read).
pub fn node_cached(key: &[u8]) -> bool {
    matches!(key.first(), Some(&(INODE | DENTRY | XATTR | TIER | DELEGATION)))
}

/// Records the cache answers only inside read-write transactions, where
/// each cached read is compared at commit: the write lease mark, the lease
/// epoch and the batched-layout token, which every seal checks. A read-only
/// view never gets them from the cache (recovery and sweep decide on them).
pub fn node_cached_in_writes(key: &[u8]) -> bool {
    matches!(key.first(), Some(&(UNSEALED | LEASE_EPOCH | LAYOUT_COMMIT)))
}

/// What a changed key from the change feed ([`crate::ChangeFeed`]) is
/// about, for those that act on other nodes' changes without knowing the
/// schema: the kernel's caches and the sweep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change<'a> {
    /// The feed restarted: anything may have changed meanwhile.
    Everything,
    /// A file's attributes or chunk layout (`I`, `C`): what a kernel
    /// caches of the inode.
    Inode(Ino),
    /// Another record of one file: its batched layout, write lease, lease
    /// epoch, sync mark, orphan mark or tier record.
    FileState(Ino),
    /// A name in a directory.
    Entry { parent: Ino, name: &'a [u8] },
    /// A record of the cluster's control plane that nodes act on.
    Control(Control),
    /// Anything else (volume-wide keys, xattrs, garbage and key owners).
    Other,
}

/// The cluster-wide records nodes act on, by what reading them again
/// serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Control {
    /// Nodes that registered, and the live ones (`K`, `L`).
    Members,
    /// An admin's word on a node (`A`).
    Admin,
    /// A rebalance under way (`B`).
    Rebalance,
    /// Gc requests and answers (`W`, `Z`).
    Gc,
    /// Requests to queue files for upload again (`H`).
    Rescan,
    /// Objects of purged files waiting for deletion (`G`). Moved by a
    /// node's own purges only, never by the feed: each node deletes the
    /// objects of the files it purged, and those of a node that died first
    /// are found by any node's safety read.
    Garbage,
}

impl Control {
    pub const ALL: [Control; 6] =
        [Control::Members, Control::Admin, Control::Rebalance, Control::Gc, Control::Rescan, Control::Garbage];
}

/// Whether `key` is a node's registration or liveness record (`K`, `L`).
pub fn is_node_record(key: &[u8]) -> bool {
    matches!(key.first(), Some(b'K' | b'L'))
}

/// Classify a changed key (empty: the feed restarted).
pub fn change_of(key: &[u8]) -> Change<'_> {
    let ino = || key.get(1..9).map(|b| Ino::from_be_bytes(b.try_into().expect("8 bytes")));
    match (key.first(), ino()) {
        (None, _) => Change::Everything,
        (Some(&(INODE | CHUNK)), Some(ino)) => Change::Inode(ino),
        (
            Some(
                &(PENDING_CHUNK | LAYOUT_COMMIT | UNSEALED | LEASE_EPOCH | SYNC_PENDING | SYNC_PENDING_BEFORE | ORPHAN
                | TIER),
            ),
            Some(ino),
        ) => Change::FileState(ino),
        (Some(&DENTRY), Some(parent)) => Change::Entry { parent, name: &key[9..] },
        (Some(b'K' | b'L'), _) => Change::Control(Control::Members),
        (Some(b'A'), _) => Change::Control(Control::Admin),
        (Some(b'B'), _) => Change::Control(Control::Rebalance),
        (Some(b'W' | b'Z'), _) => Change::Control(Control::Gc),
        (Some(b'H'), _) => Change::Control(Control::Rescan),
        _ => Change::Other,
    }
}

/// Whether `prefix` is one of the ranges [`listed_range`] names.
pub fn is_listed_prefix(prefix: &[u8]) -> bool {
    (prefix.len() == 9 && matches!(prefix[0], DENTRY | XATTR)) || prefix == [DELEGATION]
}

/// The delegation record of directory `dir`.
pub fn delegation(dir: Ino) -> Vec<u8> {
    with_ino(DELEGATION, dir)
}

/// Every delegation (the prefix of all `M` keys).
pub fn delegations() -> Vec<u8> {
    vec![DELEGATION]
}

/// Whose records a key holds, for a node that acknowledges changes before
/// they commit (`kv_deferred.rs`): what it may change alone while it holds
/// a directory's delegation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Subject<'a> {
    /// A name in directory `0` (`D`).
    Names(Ino),
    /// An inode's attributes, xattrs or delegation (`I`, `X`, `M`).
    Inode(Ino),
    /// A file's layout, lease, marks and tier record (`C`, `P`, `Q`, `U`,
    /// `E`, `S`, `O`, `T`).
    File(Ino),
    /// A slot of node `0`'s ring of answered kernel requests (`j`, or `J`
    /// where volumes made before kept it).
    Answered(&'a [u8]),
    /// Volume-wide and control-plane records, and anything unparsable.
    Other,
}

impl Subject<'_> {
    /// The inode whose records these are (names, attributes or layout).
    pub fn ino(&self) -> Option<Ino> {
        match *self {
            Subject::Names(ino) | Subject::Inode(ino) | Subject::File(ino) => Some(ino),
            Subject::Answered(_) | Subject::Other => None,
        }
    }
}

/// The [`Subject`] of `key`.
pub fn subject(key: &[u8]) -> Subject<'_> {
    let ino = || key.get(1..9).map(|b| Ino::from_be_bytes(b.try_into().expect("8 bytes")));
    match (key.first(), ino()) {
        (Some(&DENTRY), Some(ino)) => Subject::Names(ino),
        (Some(&(INODE | DELEGATION)), Some(ino)) if key.len() == 9 => Subject::Inode(ino),
        (Some(&XATTR), Some(ino)) => Subject::Inode(ino),
        (
            Some(
                &(CHUNK | PENDING_CHUNK | LAYOUT_COMMIT | UNSEALED | LEASE_EPOCH | SYNC_PENDING | SYNC_PENDING_BEFORE
                | ORPHAN | TIER),
            ),
            Some(ino),
        ) => Subject::File(ino),
        // A holder-index entry belongs with the file's layout.
        (Some(&HOLDER_INDEX), _) => match key.iter().position(|b| *b == 0).and_then(|nul| key.get(nul + 1..nul + 9)) {
            Some(ino) => Subject::File(Ino::from_be_bytes(ino.try_into().expect("8 bytes"))),
            None => Subject::Other,
        },
        (Some(&(ANSWERED | ANSWERED_BEFORE)), _) => match key[1..].iter().position(|b| *b == 0) {
            Some(end) => Subject::Answered(&key[1..1 + end]),
            None => Subject::Other,
        },
        _ => Subject::Other,
    }
}

/// The [`Subject`] of every key in `[start, end)`, when they share one:
/// the range is within the keys of one prefix and inode.
pub fn range_subject<'a>(start: &'a [u8], end: &[u8]) -> Subject<'a> {
    if start.len() < 9 {
        return Subject::Other;
    }
    let (_, own_end) = prefix_range(&start[..9]);
    match end <= own_end.as_slice() {
        true => subject(start),
        false => Subject::Other,
    }
}

pub fn xattr(ino: Ino, name: &[u8]) -> Vec<u8> {
    with_ino_name(XATTR, ino, name)
}

pub fn xattrs_of(ino: Ino) -> Vec<u8> {
    with_ino(XATTR, ino)
}

pub fn xattr_name(key: &[u8]) -> &[u8] {
    &key[9..]
}

pub fn chunk(ino: Ino, index: u32) -> Vec<u8> {
    let mut k = with_ino(CHUNK, ino);
    k.extend_from_slice(&index.to_be_bytes());
    k
}

pub fn chunks_of(ino: Ino) -> Vec<u8> {
    with_ino(CHUNK, ino)
}

pub fn pending_chunk(ino: Ino, index: u32) -> Vec<u8> {
    let mut k = with_ino(PENDING_CHUNK, ino);
    k.extend_from_slice(&index.to_be_bytes());
    k
}

pub fn pending_chunks_of(ino: Ino) -> Vec<u8> {
    with_ino(PENDING_CHUNK, ino)
}

/// Whether `prefix` is a whole prefix of records keyed by inode number
/// first (every `I`, `C`, `T`, … key): what a volume-wide scan reads in
/// windows of inode numbers. Not the delegations (`M`): few, and listed
/// whole by the node cache.
pub fn is_inode_keyed_prefix(prefix: &[u8]) -> bool {
    matches!(
        prefix,
        [INODE
            | DENTRY
            | XATTR
            | CHUNK
            | PENDING_CHUNK
            | LAYOUT_COMMIT
            | ORPHAN
            | UNSEALED
            | LEASE_EPOCH
            | SYNC_PENDING
            | SYNC_PENDING_BEFORE
            | TIER
            | GARBAGE
            | RENAMED]
    )
}

/// Every holder-index entry of node `node`.
pub fn held_by(node: &str) -> Vec<u8> {
    of_node(HOLDER_INDEX, node)
}

/// The holder-index entry saying that node `node` holds a copy of chunk
/// `index` of `ino`.
pub fn held_chunk(node: &str, ino: Ino, index: u32) -> Vec<u8> {
    let mut k = held_by(node);
    k.extend_from_slice(&ino.to_be_bytes());
    k.extend_from_slice(&index.to_be_bytes());
    k
}

/// (inode, chunk index) of a holder-index key of `node`; `None` for
/// any other key.
pub fn parse_held_chunk(node: &str, key: &[u8]) -> Option<(Ino, u32)> {
    let rest = key.strip_prefix(held_by(node).as_slice())?;
    let ino = Ino::from_be_bytes(rest.get(..8)?.try_into().ok()?);
    let index = u32::from_be_bytes(rest.get(8..)?.try_into().ok()?);
    Some((ino, index))
}

/// Whether `key` is an `I` record (an inode's attributes). Its deletion is
/// the inode's purge, for good: inode numbers are never handed out again.
pub fn is_inode(key: &[u8]) -> bool {
    key.first() == Some(&INODE) && key.len() == 9
}

/// Whether `key` is a `C` record (a chunk of a file's layout).
pub fn is_chunk(key: &[u8]) -> bool {
    key.first() == Some(&CHUNK)
}

/// Whether `key` is a `U` record (a file's write lease mark).
pub fn is_unsealed(key: &[u8]) -> bool {
    key.first() == Some(&UNSEALED) && key.len() == 9
}

/// Whether `key` is a record of a file's layout (`C`, `P`, `Q`).
pub fn is_layout(key: &[u8]) -> bool {
    matches!(key.first(), Some(&(CHUNK | PENDING_CHUNK | LAYOUT_COMMIT)))
}

/// Whether `key` is a record of a layout written in batches (`P`, `Q`).
pub fn is_batched_layout(key: &[u8]) -> bool {
    matches!(key.first(), Some(&(PENDING_CHUNK | LAYOUT_COMMIT)))
}

/// Whether `key` is a `P` record (a chunk of a layout written in batches).
pub fn is_pending_chunk(key: &[u8]) -> bool {
    key.first() == Some(&PENDING_CHUNK)
}

pub fn layout_commit(ino: Ino) -> Vec<u8> {
    with_ino(LAYOUT_COMMIT, ino)
}

/// Every pending chunk record of the volume.
pub fn all_pending_chunks() -> Vec<u8> {
    vec![PENDING_CHUNK]
}

/// Every chunk record of the volume.
pub fn all_chunks() -> Vec<u8> {
    vec![CHUNK]
}

pub fn chunk_index(key: &[u8]) -> u32 {
    u32::from_be_bytes(key[9..13].try_into().expect("chunk key is 13 bytes"))
}

pub fn orphan(ino: Ino) -> Vec<u8> {
    with_ino(ORPHAN, ino)
}

pub fn orphans() -> Vec<u8> {
    vec![ORPHAN]
}

pub fn unsealed(ino: Ino) -> Vec<u8> {
    with_ino(UNSEALED, ino)
}

pub fn unsealed_all() -> Vec<u8> {
    vec![UNSEALED]
}

pub fn lease_epoch(ino: Ino) -> Vec<u8> {
    with_ino(LEASE_EPOCH, ino)
}

pub fn sync_pending(ino: Ino) -> Vec<u8> {
    with_ino(SYNC_PENDING, ino)
}

/// `ino`'s sync-pending mark as it was written before `s` (see the table).
pub fn sync_pending_before(ino: Ino) -> Vec<u8> {
    with_ino(SYNC_PENDING_BEFORE, ino)
}

/// The prefixes of every sync-pending mark: `s`, and `S` where marks
/// written before it remain.
pub fn sync_pending_all() -> [Vec<u8>; 2] {
    [vec![SYNC_PENDING], vec![SYNC_PENDING_BEFORE]]
}

pub fn tier(ino: Ino) -> Vec<u8> {
    with_ino(TIER, ino)
}

/// Every object key owner (the prefix of all `Y` keys).
pub fn key_owners_all() -> Vec<u8> {
    vec![KEY_OWNER]
}

pub fn tier_all() -> Vec<u8> {
    vec![TIER]
}

pub fn garbage(ino: Ino) -> Vec<u8> {
    with_ino(GARBAGE, ino)
}

pub fn garbage_all() -> Vec<u8> {
    vec![GARBAGE]
}

pub fn renamed_dir(ino: Ino) -> Vec<u8> {
    with_ino(RENAMED, ino)
}

pub fn renamed_dirs() -> Vec<u8> {
    vec![RENAMED]
}

pub fn key_owner(object_key: &str) -> Vec<u8> {
    [&[KEY_OWNER][..], object_key.as_bytes()].concat()
}

pub fn known_node(id: &str) -> Vec<u8> {
    [b"K", id.as_bytes()].concat()
}

pub fn live_node(id: &str) -> Vec<u8> {
    [b"L", id.as_bytes()].concat()
}

pub fn node_admin(id: &str) -> Vec<u8> {
    [NODE_ADMIN, id.as_bytes()].concat()
}

pub const NODE_ADMIN: &[u8] = b"A";
pub const REBALANCE: &[u8] = b"B";
pub const GC_REQUEST: &[u8] = b"W";
pub const GC_DONE: &[u8] = b"Z";
pub const BACKFILL_RESCAN: &[u8] = b"H";

pub fn gc_done(node: &str) -> Vec<u8> {
    [GC_DONE, node.as_bytes()].concat()
}
pub const KNOWN_NODES: &[u8] = b"K";
pub const LIVE_NODES: &[u8] = b"L";

/// The inode number in an `I`, `O`, `U`, `E`, `s`, `S`, `T`, `G` or `R` key.
pub fn key_ino(key: &[u8]) -> Ino {
    u64::from_be_bytes(key[1..9].try_into().expect("inode key is 9 bytes"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_range_covers_prefix_only() {
        let (s, e) = prefix_range(&dentries_of(7));
        assert!(dentry(7, b"a").as_slice() >= s.as_slice());
        assert!(dentry(7, &[0xff; 300]).as_slice() < e.as_slice());
        assert!(dentry(8, b"").as_slice() >= e.as_slice());
    }

    #[test]
    fn holder_index_keys_sort_past_the_watched_range_and_parse_back() {
        let key = held_chunk("n1", 9, 3);
        assert_eq!(parse_held_chunk("n1", &key), Some((9, 3)));
        assert_eq!(parse_held_chunk("n", &key), None, "another node's prefix");
        assert_eq!(parse_held_chunk("n1", &held_chunk("n1", 9, 3)[..12]), None);
        // Every other record sorts before the index: the feed's range ends there.
        for other in [inode(u64::MAX), chunk(u64::MAX, u32::MAX), live_node("zz"), delegation(u64::MAX)] {
            assert!(other.as_slice() < WATCHED_END && WATCHED_END <= key.as_slice(), "{other:?}");
        }
        // So does the ring of answered requests, and the holder index's
        // prefix range does not reach it.
        assert!(WATCHED_END <= answered("n1", 0).as_slice());
        assert!(answered_before("zz", u16::MAX).as_slice() < WATCHED_END);
        // And the sync-pending marks, past both.
        assert!(answered("zz", u16::MAX).as_slice() < sync_pending(0).as_slice());
        assert!(sync_pending_before(u64::MAX).as_slice() < WATCHED_END);
        // Both places are the node's own, to the --nowsync overlay.
        assert_eq!(subject(&answered("n1", 7)), Subject::Answered(b"n1"));
        assert_eq!(subject(&answered_before("n1", 7)), Subject::Answered(b"n1"));
        let (start, end) = prefix_range(&held_by("n1"));
        assert!(start <= key && key < end);
        assert!(held_chunk("n10", 1, 1) >= end || held_chunk("n10", 1, 1) < start);
    }

    #[test]
    fn changes_are_classified_by_what_they_are_about() {
        assert_eq!(change_of(b""), Change::Everything);
        assert_eq!(change_of(&inode(9)), Change::Inode(9));
        assert_eq!(change_of(&chunk(9, 3)), Change::Inode(9));
        for key in [
            tier(9),
            unsealed(9),
            lease_epoch(9),
            layout_commit(9),
            pending_chunk(9, 1),
            orphan(9),
            sync_pending(9),
            sync_pending_before(9),
        ] {
            assert_eq!(change_of(&key), Change::FileState(9), "{key:?}");
        }
        assert_eq!(change_of(&dentry(4, b"name")), Change::Entry { parent: 4, name: b"name" });
        assert_eq!(change_of(&xattr(9, b"user.a")), Change::Other);
        assert_eq!(change_of(&live_node("n1")), Change::Control(Control::Members));
        assert_eq!(change_of(&known_node("n1")), Change::Control(Control::Members));
        assert_eq!(change_of(&node_admin("n1")), Change::Control(Control::Admin));
        assert_eq!(change_of(REBALANCE), Change::Control(Control::Rebalance));
        assert_eq!(change_of(GC_REQUEST), Change::Control(Control::Gc));
        assert_eq!(change_of(&gc_done("n1")), Change::Control(Control::Gc));
        assert_eq!(change_of(BACKFILL_RESCAN), Change::Control(Control::Rescan));
        assert_eq!(change_of(&garbage(9)), Change::Other);
        assert_eq!(change_of(&held_chunk("n1", 9, 3)), Change::Other);
        // A key too short for its inode number is nothing in particular.
        assert_eq!(change_of(b"I\x00\x01"), Change::Other);
    }
}
