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
        }
    }

    /// Faults are logged at warn/error; expected answers (ENOENT, EEXIST) at debug.
    pub fn is_fault(&self) -> bool {
        match self {
            FsError::Meta(e) => e.is_fault(),
            FsError::Corrupt { .. } => true,
            FsError::Io { source, .. } => source.raw_os_error() != Some(libc::ENOSPC),
            FsError::BadHandle(_) => true,
            FsError::NotSupported(_) | FsError::Invalid(_) => false,
        }
    }
}

pub type FsResult<T> = Result<T, FsError>;
