//! Records stored under the keys of [`crate::schema`].

use serde::{Deserialize, Serialize};

pub type Ino = u64;
pub const ROOT_INO: Ino = 1;
/// Longest name in a directory, as on ext4.
pub const NAME_MAX: usize = 255;
/// Longest symlink target.
pub const SYMLINK_MAX: usize = 4095;
/// Default chunk size; a file is split into chunks of this many bytes.
pub const DEFAULT_CHUNK_SIZE: u32 = 64 << 20;
/// Checksum granularity inside a chunk.
pub const BLOCK_SIZE: u32 = 64 << 10;
pub const FORMAT_VERSION: u32 = 2;
/// The format before the holder index (`h` keys): opened, the volume gets
/// its index built and its format raised.
pub const FORMAT_BEFORE_HOLDER_INDEX: u32 = 1;
/// Directory policy: how many copies of each chunk its new files keep
/// (inherited by new children). Absent: the node's default.
pub const REPLICAS_XATTR: &[u8] = b"user.converged.replicas";
/// Read-only view of a file's object tier state (`converged status` reads it).
pub const TIER_XATTR: &[u8] = b"user.converged.tier";
/// Set on a directory to import the objects under a URL into it; present
/// until the directory has been listed.
pub const IMPORT_XATTR: &[u8] = b"user.converged.import";
/// Set on a file to stage it: fetch its chunks onto the SSDs (value: replica count).
pub const STAGE_XATTR: &[u8] = b"user.converged.stage";
/// Read-only: where a file's chunks are (node ids per chunk, or `object`).
pub const LAYOUT_XATTR: &[u8] = b"user.converged.layout";
/// Read-only, on any directory: this node's backfill backlog.
pub const BACKFILL_XATTR: &[u8] = b"user.converged.backfill";
/// Read-only, on a file: reading it checks this node's copies of the file's
/// chunks against their checksums now, repairs bad blocks, and says what it found.
pub const SCRUB_XATTR: &[u8] = b"user.converged.scrub";
/// Read-only, on any inode: the state of this node's background workers.
pub const WORKERS_XATTR: &[u8] = b"user.converged.workers";
/// The daemon's latency histograms and I/O counters, for `converged stats`.
pub const STATS_XATTR: &[u8] = b"user.converged.stats";
/// Most replicas a policy may ask for.
pub const MAX_REPLICAS: u32 = 8;

/// Parse a `user.converged.replicas` value: a decimal count in `1..=MAX_REPLICAS`.
pub fn parse_replicas(value: &[u8]) -> Option<u32> {
    let n: u32 = std::str::from_utf8(value).ok()?.trim().parse().ok()?;
    (1..=MAX_REPLICAS).contains(&n).then_some(n)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FileKind {
    Regular,
    Directory,
    Symlink,
    Fifo,
    Socket,
    CharDevice,
    BlockDevice,
}

impl FileKind {
    /// From the `S_IFMT` bits of a mode.
    pub fn from_mode(mode: u32) -> Option<Self> {
        Some(match mode & libc::S_IFMT {
            libc::S_IFREG | 0 => FileKind::Regular,
            libc::S_IFDIR => FileKind::Directory,
            libc::S_IFLNK => FileKind::Symlink,
            libc::S_IFIFO => FileKind::Fifo,
            libc::S_IFSOCK => FileKind::Socket,
            libc::S_IFCHR => FileKind::CharDevice,
            libc::S_IFBLK => FileKind::BlockDevice,
            _ => return None,
        })
    }
}

/// Seconds and nanoseconds since the epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default, Serialize, Deserialize)]
pub struct Timespec {
    pub sec: i64,
    pub nsec: u32,
}

impl Timespec {
    pub fn now() -> Self {
        let d = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        Timespec { sec: d.as_secs() as i64, nsec: d.subsec_nanos() }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Inode {
    pub ino: Ino,
    pub kind: FileKind,
    /// Permission bits, including setuid, setgid and sticky (07777).
    pub perm: u16,
    pub uid: u32,
    pub gid: u32,
    pub nlink: u32,
    pub size: u64,
    pub atime: Timespec,
    pub mtime: Timespec,
    pub ctime: Timespec,
    pub rdev: u32,
    /// The directory holding the inode's name: for directories, so rename
    /// can refuse to move one under itself; for files, with `name`, so the
    /// object tier can find the file's path (its object key).
    pub parent: Ino,
    /// The name the inode was created or last renamed under. A hard link's
    /// other names do not change it.
    pub name: Vec<u8>,
    /// For regular files: chunk size of this file's layout.
    pub chunk_size: u32,
    /// For symlinks: the target.
    pub target: Option<Vec<u8>>,
}

impl Inode {
    pub fn is_dir(&self) -> bool {
        self.kind == FileKind::Directory
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dentry {
    pub ino: Ino,
    pub kind: FileKind,
}

/// Where one chunk of a file lives and how to check it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkRecord {
    /// Bumped every time the chunk is re-sealed after a change.
    pub version: u64,
    /// Bytes of file data in this chunk (the last chunk may be short).
    pub len: u32,
    /// Node ids holding a copy, primary first.
    pub replicas: Vec<String>,
    /// crc32c of each [`BLOCK_SIZE`] block of the chunk (the last one short).
    pub block_crcs: Vec<u32>,
}

/// Copies of one chunk version that nodes now hold, to add to its record
/// ([`Namespace::add_replicas_many`](crate::Namespace::add_replicas_many)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewCopies {
    pub ino: Ino,
    pub index: u32,
    pub version: u64,
    pub nodes: Vec<String>,
}

/// Where a file stands against the object store: the backfill state machine.
///
/// ```text
///   seal ──▶ Dirty ──(quiet for the delay)──▶ Uploading ──(completed, no seal since)──▶ Backed
///              ▲                                  │                                      │ rename
///              └────(sealed again / failed)───────┘                                      ▼
///              ▲                                                                      ReKeying
///              └──────────────────────────── seal ───────────────────────────────────────┘ (copied: Backed)
/// ```
/// A `Backed` file's chunks may be evicted from the SSDs: the object holds
/// every byte of the current version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum TierState {
    /// Changed since the object was written (or never uploaded).
    Dirty,
    /// An upload of `generation` is in flight on `node`.
    Uploading,
    /// The object at `key` holds the current bytes.
    Backed,
    /// The object holds the current bytes under an old key; a rename moved the file.
    ReKeying,
}

impl TierState {
    pub fn name(self) -> &'static str {
        match self {
            TierState::Dirty => "dirty",
            TierState::Uploading => "uploading",
            TierState::Backed => "backed",
            TierState::ReKeying => "re-keying",
        }
    }
}

/// A file's object tier record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierRecord {
    pub state: TierState,
    /// Bumped by every seal that changes the file: an upload only counts if
    /// no seal came in while it ran.
    pub generation: u64,
    /// The node holding the bytes to upload (the last to seal the file).
    pub node: String,
    /// When the file was last sealed: the backfill waits for it to be quiet.
    pub sealed_at: Timespec,
    /// Key of the object holding the file (empty until first backed). For
    /// the mount's own store, relative to its prefix; for an import, the
    /// key in the source bucket.
    pub key: String,
    /// The object's ETag when converged wrote or listed it.
    pub etag: Option<String>,
    /// For files imported from another location: its URL (`s3://bucket`).
    /// Converged never moves or deletes objects there; a changed or
    /// renamed imported file is backfilled to the mount's own store.
    pub source: Option<String>,
}

/// An object whose file is gone, waiting for deletion.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GarbageObject {
    pub key: String,
    pub source: Option<String>,
}

/// A directory renamed on a tiered volume: every backed object below it
/// sits under its old key until the renaming node has walked the directory
/// and marked each file re-keying. Kept until that walk is done, so a crash
/// in between resumes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RenamedDir {
    pub node: String,
    /// When it was renamed; a later rename of the same directory replaces it.
    pub at: Timespec,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeRecord {
    pub format_version: u32,
    pub chunk_size: u32,
    pub created: Timespec,
}

/// Changes asked of `setattr`; `None` leaves a field alone.
#[derive(Debug, Clone, Default)]
pub struct SetAttr {
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub size: Option<u64>,
    pub atime: Option<TimeSet>,
    pub mtime: Option<TimeSet>,
    pub ctime: Option<Timespec>,
}

impl SetAttr {
    /// Mode, owner, group, times and ctime applied to `inode` (not its
    /// size, not an ACL): `now` stands for `TimeSet::Now` and for a ctime
    /// not given.
    pub fn apply_to(&self, inode: &mut Inode, now: Timespec) {
        if let Some(mode) = self.mode {
            inode.perm = (mode & 0o7777) as u16;
        }
        if let Some(uid) = self.uid {
            inode.uid = uid;
        }
        if let Some(gid) = self.gid {
            inode.gid = gid;
        }
        let resolve = |t: TimeSet| match t {
            TimeSet::Now => now,
            TimeSet::At(ts) => ts,
        };
        if let Some(t) = self.atime {
            inode.atime = resolve(t);
        }
        if let Some(t) = self.mtime {
            inode.mtime = resolve(t);
        }
        inode.ctime = self.ctime.unwrap_or(now);
    }

    /// `later` applied after `self`, as one change: what it sets wins.
    pub fn merge(&mut self, later: &SetAttr) {
        self.mode = later.mode.or(self.mode);
        self.uid = later.uid.or(self.uid);
        self.gid = later.gid.or(self.gid);
        self.size = later.size.or(self.size);
        self.atime = later.atime.or(self.atime);
        self.mtime = later.mtime.or(self.mtime);
        self.ctime = later.ctime.or(self.ctime);
    }
}

#[derive(Debug, Clone, Copy)]
pub enum TimeSet {
    Now,
    At(Timespec),
}

/// What kind of node `mknod` and friends create.
#[derive(Debug, Clone)]
pub struct NewNode<'a> {
    pub kind: FileKind,
    pub perm: u16,
    pub uid: u32,
    pub gid: u32,
    pub rdev: u32,
    pub target: Option<&'a [u8]>,
    /// Created to be written at once (open(O_CREAT) for writing): the file
    /// starts unsealed in the same transaction that creates it.
    pub unsealed: bool,
    /// The creating process's umask: applied unless the directory has a
    /// default ACL, which takes its place (the kernel leaves both to us).
    pub umask: u16,
    /// The kernel request the node is made for, recorded with it (see
    /// [`RequestMark`]).
    pub request: Option<RequestMark>,
}

/// A kernel request that changes the namespace, recorded in the
/// transaction of its change (key `j`, see `ops/answered.rs`): when the
/// daemon dies after the commit and before its answer, the kernel sends
/// the request again, and the next daemon learns from the record that it
/// is done instead of doing it again (a committed mkdir would fail with
/// EEXIST, a committed rename with ENOENT).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestMark {
    /// Random, made with the kernel connection: request ids restart with
    /// each mount.
    pub connection: u64,
    /// The kernel's id of the request, without the resend bit.
    pub unique: u64,
    /// The kernel sent it again (a daemon died before answering it): its
    /// change may have committed already, so the record is read in the
    /// transaction from its first attempt (see `Namespace::write_answering`).
    pub resent: bool,
}

impl NewNode<'static> {
    /// A node owned by root with `perm`, no umask, created closed.
    pub fn plain(kind: FileKind, perm: u16) -> Self {
        NewNode { kind, perm, uid: 0, gid: 0, rdev: 0, target: None, unsealed: false, umask: 0, request: None }
    }
}

/// Flags of `setxattr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XattrMode {
    Any,
    Create,
    Replace,
}

/// Flags of `rename`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RenameMode {
    Replace,
    NoReplace,
    Exchange,
}
