//! The local chunk store: one sparse backing file per inode under
//! `<data-dir>/chunks/`, holding the chunks this node stores at their file
//! offsets, and the per-block checksums that guard them.
//!
//! It owns bytes on the local SSD only; which chunks exist and their
//! checksums are recorded in the namespace by the filesystem core.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use converged_metadata::types::{Ino, BLOCK_SIZE};

use crate::error::{FsError, FsResult};

pub struct ChunkStore {
    dir: PathBuf,
}

impl ChunkStore {
    pub fn open(data_dir: &Path) -> FsResult<Self> {
        let dir = data_dir.join("chunks");
        std::fs::create_dir_all(&dir).map_err(|e| FsError::io(format!("create {}", dir.display()), e))?;
        Ok(Self { dir })
    }

    pub fn path(&self, ino: Ino) -> PathBuf {
        self.dir.join(format!("{ino:016x}"))
    }

    /// Open (creating if needed) the backing file of `ino` for reading and writing.
    pub fn open_backing(&self, ino: Ino) -> FsResult<File> {
        let path = self.path(ino);
        OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC)
            .open(&path)
            .map_err(|e| FsError::io(format!("open backing file {}", path.display()), e))
    }

    pub fn remove(&self, ino: Ino) -> FsResult<()> {
        match std::fs::remove_file(self.path(ino)) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(FsError::io(format!("remove backing file of inode {ino}"), e)),
        }
    }

    /// Inode numbers that have a backing file (for the mount-time consistency check).
    pub fn list(&self) -> FsResult<Vec<Ino>> {
        let rd = std::fs::read_dir(&self.dir).map_err(|e| FsError::io(format!("list {}", self.dir.display()), e))?;
        let mut out = Vec::new();
        for entry in rd.flatten() {
            if let Some(ino) = entry.file_name().to_str().and_then(|n| u64::from_str_radix(n, 16).ok()) {
                out.push(ino);
            }
        }
        Ok(out)
    }
}

/// crc32c of each [`BLOCK_SIZE`] block of `len` bytes of `file` starting at
/// `start` (block aligned). The last block may be short.
pub fn block_crcs(file: &File, start: u64, len: u64) -> io::Result<Vec<u32>> {
    let mut crcs = Vec::with_capacity(len.div_ceil(BLOCK_SIZE as u64) as usize);
    // Read a few blocks per syscall; checksums stay per block.
    const READ: usize = 16 * BLOCK_SIZE as usize;
    let mut buf = vec![0u8; READ];
    let mut off = 0u64;
    while off < len {
        let want = (len - off).min(READ as u64) as usize;
        read_exact_at(file, &mut buf[..want], start + off)?;
        for block in buf[..want].chunks(BLOCK_SIZE as usize) {
            crcs.push(crc32c::crc32c(block));
        }
        off += want as u64;
    }
    Ok(crcs)
}

/// `read_exact_at`, but bytes past the end of the file read as zeros (a
/// backing file may be shorter than the chunk when its tail is a hole).
pub fn read_exact_at(file: &File, buf: &mut [u8], offset: u64) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => {
                buf[done..].fill(0);
                return Ok(());
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
