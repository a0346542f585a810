//! The backing file of an open inode, as the core uses it besides reading
//! and writing: its size and mtime (what a publish saw), times set on it,
//! SEEK_DATA / SEEK_HOLE, and copy_file_range between two handles.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;

use converged_metadata::types::*;

use super::{ts_from, Core};
use crate::error::{FsError, FsResult};

/// The most bytes one copy_file_range request copies.
pub const COPY_PER_CALL: u64 = 64 << 20;

/// Size and mtime of a backing file: what a publish saw, to skip the next
/// one (and the final seal) when nothing changed since.
pub(super) type Stamp = (u64, Timespec);

pub(super) fn stamp(file: &File) -> FsResult<Stamp> {
    let md = file.metadata().map_err(|e| FsError::io("stat backing file", e))?;
    Ok((md.len(), ts_from(md.mtime(), md.mtime_nsec())))
}

pub(super) fn set_file_times(file: &File, inode: &Inode) -> FsResult<()> {
    let times = [
        libc::timespec { tv_sec: inode.atime.sec, tv_nsec: inode.atime.nsec as i64 },
        libc::timespec { tv_sec: inode.mtime.sec, tv_nsec: inode.mtime.nsec as i64 },
    ];
    // SAFETY: futimens on our own fd with a two-element array.
    if unsafe { libc::futimens(file.as_raw_fd(), times.as_ptr()) } != 0 {
        return Err(FsError::io("set backing file times", std::io::Error::last_os_error()));
    }
    Ok(())
}

impl Core {
    /// copy_file_range: `len` bytes of one handle's file from `off_in`,
    /// written at `off_out` of another's (or the same file's), through the
    /// daemon's read and write paths: chunks held elsewhere are fetched, and
    /// the copy is a write like any other (leased, checksummed at its seal,
    /// replicated). At most [`COPY_PER_CALL`] bytes per call, so that one
    /// request does not hold a FUSE thread for long; the kernel returns the
    /// count and the caller asks again for the rest. Stops at the source's
    /// end. An error after some bytes were copied returns the count.
    pub fn copy_range(&self, fh_in: u64, off_in: u64, fh_out: u64, off_out: u64, len: u64) -> FsResult<u32> {
        const PIECE: u64 = 1 << 20;
        let len = len.min(COPY_PER_CALL);
        let mut done = 0u64;
        while done < len {
            let want = PIECE.min(len - done) as u32;
            let step = self
                .read(fh_in, off_in + done, want)
                .and_then(|data| Ok((data.len(), self.write(fh_out, off_out + done, &data)?)));
            match step {
                Ok((read, written)) => {
                    done += written as u64;
                    if read < want as usize || (written as usize) < read {
                        break;
                    }
                }
                Err(e) if done == 0 => return Err(e),
                Err(e) => {
                    tracing::debug!(fh_in, fh_out, done, error = %e, "copy_file_range cut short");
                    break;
                }
            }
        }
        Ok(done as u32)
    }

    /// SEEK_DATA / SEEK_HOLE (the kernel does the other whences itself).
    /// The backing file's holes are the file's only on a single node
    /// without an object tier: in a cluster chunks held by other nodes,
    /// and with a tier evicted chunks, are holes in the backing file here
    /// but data in the file, and a copy tool trusting them (cp, tar
    /// --sparse) would write zeros. There the file is answered as having
    /// no holes: data at every offset before its end.
    pub fn lseek(&self, fh: u64, offset: i64, whence: i32) -> FsResult<i64> {
        let (ino, _, oi) = self.open.handle(fh)?;
        if self.cluster.get().is_some() || self.tier.get().is_some() {
            let size = self.getattr(ino)?.size as i64;
            let einval = || FsError::io("lseek", std::io::Error::from_raw_os_error(libc::EINVAL));
            return match whence {
                libc::SEEK_DATA | libc::SEEK_HOLE if offset < 0 => Err(einval()),
                libc::SEEK_DATA | libc::SEEK_HOLE if offset >= size => {
                    Err(FsError::io("lseek", std::io::Error::from_raw_os_error(libc::ENXIO)))
                }
                libc::SEEK_DATA => Ok(offset),
                libc::SEEK_HOLE => Ok(size),
                _ => Err(einval()),
            };
        }
        // SAFETY: lseek on our own fd; the backing file's offset is never used for I/O.
        let rc = unsafe { libc::lseek(oi.file.as_raw_fd(), offset, whence) };
        if rc < 0 {
            return Err(FsError::io("lseek backing file", std::io::Error::last_os_error()));
        }
        Ok(rc)
    }
}
