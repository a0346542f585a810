//! The namespace's error type and its one mapping to errno.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum MetaError {
    #[error("no such file or directory")]
    NotFound,
    #[error("file exists")]
    Exists,
    #[error("not a directory")]
    NotDir,
    #[error("is a directory")]
    IsDir,
    #[error("directory not empty")]
    NotEmpty,
    #[error("name longer than 255 bytes")]
    NameTooLong,
    #[error("invalid argument: {0}")]
    Invalid(&'static str),
    #[error("operation not permitted: {0}")]
    NotPermitted(&'static str),
    #[error("permission denied: {0}")]
    Denied(&'static str),
    #[error("no such extended attribute")]
    NoAttr,
    #[error("extended attribute name or value too large")]
    XattrTooBig,
    #[error("too many links")]
    TooManyLinks,
    /// Another live node holds the file's write lease (it has the file open for writing).
    #[error("file is open for writing on node {holder}")]
    WriteLeased { holder: String },
    /// This node's write lease on the file was taken over (its membership
    /// lease expired while it was paused or cut off): what it wrote since
    /// its last publish is not published.
    #[error("write lease lost to {holder:?}; unpublished writes are dropped")]
    LeaseLost { holder: String },
    /// Directory `dir` is delegated to node `holder` (`--nowsync`), which
    /// may have acknowledged changes there that are not committed yet: it
    /// must commit them and give the delegation up before this node reads
    /// or changes the directory's names. `Namespace` does that and retries;
    /// a caller sees it only when the holder could not be reached.
    #[error("directory {dir} is delegated to node {holder}, which could not be asked to give it up")]
    Delegated { dir: u64, holder: String },
    /// The change a kernel request asks for was already made, by an
    /// earlier attempt of the same transaction whose commit landed though
    /// its answer was lost (a connection reset), or by a daemon that died
    /// before answering a request the kernel sent again. Its record (see
    /// `ops/answered.rs`) names `ino`, the inode the change made or named:
    /// the request is answered as done, not made twice.
    #[error("the request's change was already made (inode {ino})")]
    AlreadyMade { ino: u64 },
    #[error("corrupt metadata record {key}: {msg}")]
    Corrupt { key: String, msg: String },
    #[error(transparent)]
    Kv(#[from] KvError),
}

impl MetaError {
    /// An answer a transaction gave from the records it read (the name
    /// exists, is missing, is a directory...), which a later state of those
    /// records could change; not a failure of the engine, a limit or a
    /// corrupt record. Exhaustive on purpose.
    pub fn read_from_state(&self) -> bool {
        match self {
            MetaError::NotFound
            | MetaError::Exists
            | MetaError::NotDir
            | MetaError::IsDir
            | MetaError::NotEmpty
            | MetaError::Invalid(_)
            | MetaError::NotPermitted(_)
            | MetaError::Denied(_)
            | MetaError::NoAttr
            | MetaError::TooManyLinks
            | MetaError::WriteLeased { .. }
            | MetaError::LeaseLost { .. } => true,
            MetaError::NameTooLong
            | MetaError::XattrTooBig
            | MetaError::Delegated { .. }
            | MetaError::AlreadyMade { .. }
            | MetaError::Corrupt { .. }
            | MetaError::Kv(_) => false,
        }
    }

    /// The errno a POSIX caller sees. Exhaustive on purpose: a new variant
    /// must decide its errno here.
    pub fn errno(&self) -> i32 {
        match self {
            MetaError::NotFound => libc::ENOENT,
            MetaError::Exists => libc::EEXIST,
            MetaError::NotDir => libc::ENOTDIR,
            MetaError::IsDir => libc::EISDIR,
            MetaError::NotEmpty => libc::ENOTEMPTY,
            MetaError::NameTooLong => libc::ENAMETOOLONG,
            MetaError::Invalid(_) => libc::EINVAL,
            MetaError::NotPermitted(_) => libc::EPERM,
            MetaError::Denied(_) => libc::EACCES,
            MetaError::NoAttr => libc::ENODATA,
            MetaError::XattrTooBig => libc::E2BIG,
            MetaError::TooManyLinks => libc::EMLINK,
            // As for writing to a running executable: the file is in a use that excludes writers.
            MetaError::WriteLeased { .. } => libc::ETXTBSY,
            MetaError::LeaseLost { .. } => libc::EIO,
            MetaError::Delegated { .. } => libc::EIO,
            MetaError::Corrupt { .. } => libc::EIO,
            // Answered as done by whoever made the request (FuseAdapter::once);
            // seen by a caller only if one passed a mark and dropped it.
            MetaError::AlreadyMade { .. } => libc::EIO,
            MetaError::Kv(KvError::Conflict) => libc::EAGAIN,
            MetaError::Kv(KvError::NoSpace) => libc::ENOSPC,
            MetaError::Kv(KvError::Backend { .. }) => libc::EIO,
        }
    }

    /// The metadata store did not answer (see [`KvError::is_unanswered`]).
    pub fn is_unanswered(&self) -> bool {
        matches!(self, MetaError::Kv(e) if e.is_unanswered())
    }

    /// Whether this is an expected answer (ENOENT on lookup) rather than a fault
    /// worth logging loudly.
    pub fn is_fault(&self) -> bool {
        matches!(
            self,
            MetaError::Corrupt { .. } | MetaError::LeaseLost { .. } | MetaError::Delegated { .. } | MetaError::Kv(_)
        )
    }
}

pub type MetaResult<T> = Result<T, MetaError>;

/// Errors an engine reports. `retryable` tells the namespace layer whether
/// running the same transaction again can help.
#[derive(Debug, Error)]
pub enum KvError {
    /// Another transaction changed what this one read; run it again.
    #[error("transaction conflict")]
    Conflict,
    /// The engine's storage is full.
    #[error("metadata store is out of space")]
    NoSpace,
    /// Anything else the backend reports.
    #[error("metadata engine error: {msg}")]
    Backend { msg: String, retryable: bool },
}

impl KvError {
    pub fn backend(e: impl std::fmt::Display) -> Self {
        let msg = e.to_string();
        // redb and the OS report a full disk through io::Error; keep it recognisable.
        if msg.contains("No space left") || msg.contains("os error 28") {
            return KvError::NoSpace;
        }
        KvError::Backend { msg, retryable: false }
    }

    pub fn is_retryable(&self) -> bool {
        match self {
            KvError::Conflict => true,
            KvError::NoSpace => false,
            KvError::Backend { retryable, .. } => *retryable,
        }
    }

    /// The engine did not answer (unreachable, or no answer by its
    /// deadline), as opposed to answering with a conflict or a refusal.
    pub fn is_unanswered(&self) -> bool {
        matches!(self, KvError::Backend { retryable: true, .. })
    }
}

pub type KvResult<T> = Result<T, KvError>;
