//! The local chunk store: one sparse backing file per inode under
//! `<data-dir>/chunks/`, holding the chunks this node stores at their file
//! offsets, and the per-block checksums that guard them.
//!
//! It owns bytes on the local SSD only; which chunks exist and their
//! checksums are recorded in the namespace by the filesystem core.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use converged_metadata::types::Ino;

pub use crate::blocks::{block_crcs, read_exact_at};
use crate::error::{FsError, FsResult};

pub struct ChunkStore {
    dir: PathBuf,
}

/// Size of the metadata reserve for a data disk of `total` bytes: 2%, between 1 and 64 MiB.
pub fn reserve_size(total: u64) -> u64 {
    (total / 50).clamp(1 << 20, 64 << 20)
}

impl ChunkStore {
    pub fn open(data_dir: &Path) -> FsResult<Self> {
        let dir = data_dir.join("chunks");
        std::fs::create_dir_all(&dir).map_err(|e| FsError::io(format!("create {}", dir.display()), e))?;
        Ok(Self { dir })
    }

    /// Put every dirty byte of the data disk on stable storage (one
    /// `syncfs`: cheaper than an fdatasync per file when many are dirty).
    pub fn sync_filesystem(&self) -> io::Result<()> {
        let dir = File::open(&self.dir)?;
        // SAFETY: syncfs on a directory fd we own.
        if unsafe { libc::syncfs(dir.as_raw_fd()) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
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

    fn reserve_path(&self) -> PathBuf {
        self.dir.with_file_name("converged.reserve")
    }

    /// Keep `bytes` of the data disk allocated in a reserve file, so that
    /// when chunk data fills the disk the metadata store can still commit
    /// (an unlink must work on a full disk). Returns whether it is in place.
    pub fn ensure_reserve(&self, bytes: u64) -> bool {
        let path = self.reserve_path();
        if std::fs::metadata(&path).is_ok_and(|m| m.len() >= bytes) {
            return true;
        }
        let Ok(f) = OpenOptions::new().create(true).write(true).truncate(false).mode(0o600).open(&path) else {
            return false;
        };
        // SAFETY: fallocate on our own fd.
        if unsafe { libc::fallocate(f.as_raw_fd(), 0, 0, bytes as i64) } != 0 {
            let _ = std::fs::remove_file(&path);
            return false;
        }
        true
    }

    /// Allocate real blocks under the embedded metadata file and `bytes`
    /// beyond its end (without changing its size), so its commits overwrite
    /// allocated space and do not fail, and poison redb, when chunk data has
    /// filled the disk. Refreshed every flush, as redb may shrink the file.
    pub fn preallocate(path: &Path, bytes: u64) {
        let Ok(f) = OpenOptions::new().write(true).open(path) else { return };
        let len = f.metadata().map(|m| m.len()).unwrap_or(0);
        // SAFETY: fallocate on our own fd; KEEP_SIZE leaves the file's length alone.
        unsafe { libc::fallocate(f.as_raw_fd(), libc::FALLOC_FL_KEEP_SIZE, 0, (len + bytes) as i64) };
    }

    /// Give the reserve back to the disk. Returns whether there was one.
    pub fn release_reserve(&self) -> bool {
        let released = std::fs::remove_file(self.reserve_path()).is_ok();
        if released {
            tracing::warn!("data disk full: released the metadata reserve so the namespace stays writable");
        }
        released
    }

    /// Create the (empty) backing file of an inode number not yet handed
    /// out. `None` when it already exists or cannot be made.
    pub fn create_spare(&self, ino: Ino) -> Option<File> {
        OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC)
            .open(self.path(ino))
            .ok()
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

/// Serves this node's chunks to peers over the transport. It answers for
/// bytes only; which chunks a peer may ask for is the namespace's business.
pub struct PeerChunks(pub Arc<ChunkStore>, pub Arc<std::sync::OnceLock<Stager>>);

/// What a peer's stage request runs on this node (set once the core is up).
pub type Stager = Box<dyn Fn(u64, u32) -> Result<(), converged_transport::ServiceError> + Send + Sync>;

fn service_err(e: std::io::Error) -> converged_transport::ServiceError {
    converged_transport::ServiceError { errno: e.raw_os_error().unwrap_or(libc::EIO), msg: e.to_string() }
}

impl converged_transport::ChunkService for PeerChunks {
    fn read(&self, ino: u64, offset: u64, len: u32) -> Result<Vec<u8>, converged_transport::ServiceError> {
        let f = File::open(self.0.path(ino)).map_err(service_err)?;
        let size = f.metadata().map_err(service_err)?.len();
        let len = (len as u64).min(size.saturating_sub(offset)) as usize;
        let mut buf = vec![0u8; len];
        read_exact_at(&f, &mut buf, offset).map_err(service_err)?;
        Ok(buf)
    }
    fn write(
        &self,
        ino: u64,
        offset: u64,
        data: &[u8],
        end_of_file: bool,
    ) -> Result<(), converged_transport::ServiceError> {
        let f = self.0.open_backing(ino).map_err(|e| service_err(std::io::Error::other(e.to_string())))?;
        f.write_all_at(data, offset).map_err(service_err)?;
        if end_of_file {
            // A shorter new version must not leave the old tail readable
            // (kernel passthrough reads to the backing file's end).
            f.set_len(offset + data.len() as u64).map_err(service_err)?;
        }
        f.sync_data().map_err(service_err)
    }
    fn delete(&self, ino: u64) -> Result<(), converged_transport::ServiceError> {
        self.0.remove(ino).map_err(|e| service_err(std::io::Error::other(e.to_string())))
    }
    fn checksums(&self, ino: u64, offset: u64, len: u64) -> Result<Vec<u32>, converged_transport::ServiceError> {
        let f = File::open(self.0.path(ino)).map_err(service_err)?;
        block_crcs(&f, offset, len).map_err(service_err)
    }
    fn stage(&self, ino: u64, chunk: u32) -> Result<(), converged_transport::ServiceError> {
        match self.1.get() {
            Some(stage) => stage(ino, chunk),
            None => Err(converged_transport::ServiceError { errno: libc::EAGAIN, msg: "node is starting".into() }),
        }
    }
}
