//! The daemon's error type and its one mapping to errno.

use std::io;

use converged_metadata::MetaError;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum FsError {
    #[error(transparent)]
    Meta(#[from] MetaError),
    #[error("checksum mismatch: inode {ino} block at offset {offset}")]
    Corrupt { ino: u64, offset: u64 },
    #[error("{what}: {source}")]
    Io { what: String, source: io::Error },
    #[error("unknown file handle {0}")]
    BadHandle(u64),
    #[error("not supported: {0}")]
    NotSupported(&'static str),
    #[error("invalid argument: {0}")]
    Invalid(&'static str),
    /// The object store failed, or an object changed behind converged's back.
    #[error(transparent)]
    Object(#[from] crate::objects::ObjectError),
    /// No peer holding the data answered in time (or at all).
    #[error("peer: {0}")]
    Peer(String),
}

impl FsError {
    pub fn io(what: impl Into<String>, source: io::Error) -> Self {
        FsError::Io { what: what.into(), source }
    }

    /// The errno the caller sees. Exhaustive on purpose.
    pub fn errno(&self) -> i32 {
        match self {
            FsError::Meta(e) => e.errno(),
            FsError::Corrupt { .. } => libc::EIO,
            FsError::Io { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
            FsError::BadHandle(_) => libc::EBADF,
            FsError::NotSupported(_) => libc::EOPNOTSUPP,
            FsError::Invalid(_) => libc::EINVAL,
            FsError::Peer(_) => libc::EIO,
            FsError::Object(_) => libc::EIO,
        }
    }

    /// The same failure for a second waiter (errors are not `Clone`: I/O
    /// errors keep their errno and message).
    pub fn duplicate(&self) -> FsError {
        match self {
            FsError::Meta(e) => FsError::Peer(e.to_string()),
            FsError::Corrupt { ino, offset } => FsError::Corrupt { ino: *ino, offset: *offset },
            FsError::Io { what, source } => FsError::Io {
                what: what.clone(),
                source: source
                    .raw_os_error()
                    .map_or_else(|| io::Error::other(source.to_string()), io::Error::from_raw_os_error),
            },
            FsError::BadHandle(fh) => FsError::BadHandle(*fh),
            FsError::NotSupported(s) => FsError::NotSupported(s),
            FsError::Invalid(s) => FsError::Invalid(s),
            FsError::Peer(s) => FsError::Peer(s.clone()),
            FsError::Object(e) => FsError::Peer(e.to_string()),
        }
    }

    /// Faults are logged at warn/error; expected answers (ENOENT, EEXIST) at debug.
    pub fn is_fault(&self) -> bool {
        match self {
            FsError::Meta(e) => e.is_fault(),
            FsError::Corrupt { .. } => true,
            FsError::Io { source, .. } => source.raw_os_error() != Some(libc::ENOSPC),
            FsError::BadHandle(_) | FsError::Peer(_) | FsError::Object(_) => true,
            FsError::NotSupported(_) | FsError::Invalid(_) => false,
        }
    }
}

pub type FsResult<T> = Result<T, FsError>;
