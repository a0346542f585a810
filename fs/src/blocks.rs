//! Block I/O on backing files: positional reads where a short file reads
//! as zeros, and the crc32c of each 64 KiB block (holes checksummed without
//! being read); files written once past the page cache, pooled chunk
//! buffers, and the space of the filesystem under them. Plain `std::io`: no daemon error types, so every module that
//! moves bytes (the chunk store, the object tier) can use it.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

use converged_metadata::types::BLOCK_SIZE;

/// crc32c of each [`BLOCK_SIZE`] block of `len` bytes of `file` starting at
/// `start` (block aligned). The last block may be short.
pub fn block_crcs(file: &File, start: u64, len: u64) -> io::Result<Vec<u32>> {
    let mut crcs = Vec::with_capacity(len.div_ceil(BLOCK_SIZE as u64) as usize);
    // Read a few blocks per syscall; checksums stay per block.
    const READ: usize = 16 * BLOCK_SIZE as usize;
    let mut buf = vec![0u8; READ];
    let zero_crc = crc32c::crc32c(&[0u8; BLOCK_SIZE as usize]);
    let mut off = 0u64;
    while off < len {
        let want = (len - off).min(READ as u64) as usize;
        if is_hole(file, start + off, want as u64) {
            // Sparse files (checkpoint preallocations, >4 GiB test files) are
            // mostly holes: checksum them without reading.
            let full = want / BLOCK_SIZE as usize;
            crcs.extend(std::iter::repeat_n(zero_crc, full));
            let tail = want % BLOCK_SIZE as usize;
            if tail > 0 {
                crcs.push(crc32c::crc32c(&vec![0u8; tail]));
            }
            off += want as u64;
            continue;
        }
        read_exact_at(file, &mut buf[..want], start + off)?;
        for block in buf[..want].chunks(BLOCK_SIZE as usize) {
            crcs.push(crc32c::crc32c(block));
        }
        off += want as u64;
    }
    Ok(crcs)
}

/// True when `[offset, offset + len)` of `file` holds no data (a hole or past the end).
pub fn is_hole(file: &File, offset: u64, len: u64) -> bool {
    // SAFETY: lseek on our fd; SEEK_DATA does not move any offset we use (all I/O is positional).
    let next = unsafe { libc::lseek(file.as_raw_fd(), offset as i64, libc::SEEK_DATA) };
    if next < 0 {
        return std::io::Error::last_os_error().raw_os_error() == Some(libc::ENXIO);
    }
    next as u64 >= offset + len
}

/// True when `[offset, offset + len)` of `file` has a hole somewhere in it
/// (SEEK_HOLE; the end of the file counts as one).
pub fn has_hole(file: &File, offset: u64, len: u64) -> bool {
    // SAFETY: lseek on our fd; SEEK_HOLE does not move any offset we use (all I/O is positional).
    let next = unsafe { libc::lseek(file.as_raw_fd(), offset as i64, libc::SEEK_HOLE) };
    next < 0 || (next as u64) < offset + len
}

/// Free `len` bytes of `file` at `offset`, keeping its size (they read as zeros).
pub fn punch_hole(file: &File, offset: u64, len: u64) -> io::Result<()> {
    // SAFETY: fallocate on a descriptor we own.
    let rc = unsafe {
        libc::fallocate(
            file.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            offset as i64,
            len as i64,
        )
    };
    match rc {
        0 => Ok(()),
        _ => Err(io::Error::last_os_error()),
    }
}

/// Start writing `[offset, offset + len)` of `file` back to its disk
/// without waiting for it (`sync_file_range(SYNC_FILE_RANGE_WRITE)`): bytes
/// that a later fsync must put on disk are on their way while the writer
/// goes on, instead of all at once at the fsync. Advice only: a failure is
/// ignored, the fsync still syncs everything.
pub fn start_writeback(file: &File, offset: u64, len: u64) {
    // SAFETY: sync_file_range on a descriptor we own; it writes nothing we read.
    unsafe {
        libc::sync_file_range(file.as_raw_fd(), offset as i64, len as i64, libc::SYNC_FILE_RANGE_WRITE);
    }
}

/// `umount2(2)` of the mount at `path`; `detach`: lazily (`MNT_DETACH`),
/// the mount going once nothing uses it.
pub fn unmount(path: &std::path::Path, detach: bool) -> io::Result<()> {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path has a NUL byte"))?;
    let flags = if detach { libc::MNT_DETACH } else { 0 };
    // SAFETY: umount2 with a valid path.
    match unsafe { libc::umount2(c.as_ptr(), flags) } {
        0 => Ok(()),
        _ => Err(io::Error::last_os_error()),
    }
}

/// `statvfs(3)` of the filesystem holding `path`.
pub fn statvfs(path: &std::path::Path) -> io::Result<libc::statvfs> {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path has a NUL byte"))?;
    // SAFETY: statvfs fills the struct we pass.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    match unsafe { libc::statvfs(c.as_ptr(), &mut st) } {
        0 => Ok(st),
        _ => Err(io::Error::last_os_error()),
    }
}

/// (available, total) bytes of the filesystem holding `path`.
pub fn disk_space(path: &std::path::Path) -> io::Result<(u64, u64)> {
    let st = statvfs(path)?;
    Ok((st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize))
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

/// `len` bytes of `file` from `offset` (zeros past its end) in a new
/// buffer that the read fills without its being zeroed first: a peer's
/// read of a 4 MiB window would otherwise write every byte twice.
pub fn read_vec_at(file: &File, len: usize, offset: u64) -> io::Result<Vec<u8>> {
    let mut buf: Vec<u8> = Vec::with_capacity(len);
    while buf.len() < len {
        let done = buf.len();
        let spare = &mut buf.spare_capacity_mut()[..len - done];
        // SAFETY: pread(2) writes at most `spare.len()` bytes into memory
        // this buffer owns; only the bytes it reports written are counted.
        let n = unsafe {
            libc::pread(file.as_raw_fd(), spare.as_mut_ptr().cast(), spare.len(), (offset + done as u64) as libc::off_t)
        };
        match n {
            0 => buf.resize(len, 0),
            // SAFETY: pread wrote the `n` bytes after `done`.
            n if n > 0 => unsafe { buf.set_len(done + n as usize) },
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(buf)
}

/// `len` bytes of `file` from `offset` (zeros past its end), in a buffer
/// that goes back to a small pool once every holder dropped it: a chunk on
/// its way to peers is 64 MiB, and fresh memory costs a page fault at each
/// first touch of each page, at every chunk.
pub fn read_shared(file: &File, offset: u64, len: usize) -> io::Result<bytes::Bytes> {
    let mut buf = {
        let mut pool = CHUNK_SPARES.lock();
        pool.used = Some(std::time::Instant::now());
        pool.spare.pop().unwrap_or_default()
    };
    // A reused buffer is overwritten, not cleared; only growth is zeroed.
    buf.resize(len, 0);
    read_exact_at(file, &mut buf, offset)?;
    Ok(bytes::Bytes::from_owner(ChunkSpare(buf)))
}

/// Drop the pooled chunk buffers when none was asked for in `idle`: a
/// node that stopped writing large files gives their memory back.
pub fn trim_chunk_spares(idle: std::time::Duration) {
    let mut pool = CHUNK_SPARES.lock();
    if pool.used.is_some_and(|t| t.elapsed() >= idle) {
        pool.spare.clear();
        pool.used = None;
    }
}

struct ChunkPool {
    spare: Vec<Vec<u8>>,
    /// When a buffer was last taken.
    used: Option<std::time::Instant>,
}

/// Whole-chunk buffers for [`read_shared`]. A leaf lock, held only to push
/// or pop.
static CHUNK_SPARES: converged_metadata::held_locks::Mutex<ChunkPool> =
    converged_metadata::held_locks::Mutex::new(ChunkPool { spare: Vec::new(), used: None });
/// Chunk buffers kept: a replication window's worth, and one being read.
const CHUNK_SPARES_KEPT: usize = 4;

struct ChunkSpare(Vec<u8>);

impl AsRef<[u8]> for ChunkSpare {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl Drop for ChunkSpare {
    fn drop(&mut self) {
        let buf = std::mem::take(&mut self.0);
        let mut pool = CHUNK_SPARES.lock();
        if pool.used.is_some() && pool.spare.len() < CHUNK_SPARES_KEPT {
            pool.spare.push(buf);
        }
    }
}

/// Writes a new file once, front to back, past the page cache where the
/// filesystem allows it (`O_DIRECT`): a replica's copy of a chunk is read
/// rarely (a failed primary, a peer's remote read), so it need not take
/// page cache from the writer here, and its later sync has only the file's
/// size left to put on disk. Bytes go through one aligned buffer; the tail
/// is written padded to a block and the file cut back to its length. Where
/// `O_DIRECT` is refused (some FUSE and network filesystems, tmpfs before
/// Linux 6.6) the writes are plain buffered ones, as they are for files
/// under [`DIRECT_FROM`].
pub struct OnceWriter {
    file: File,
    direct: bool,
    buf: SpareBuffer,
    /// Where the aligned region of `buf` starts.
    at: usize,
    filled: usize,
    written: u64,
}

/// Buffers of finished writers, kept for the next ones: a fresh buffer
/// costs page faults on every first touch, at every chunk a peer sends.
/// A leaf lock, held only to push or pop.
static SPARE_BUFFERS: converged_metadata::held_locks::Mutex<Vec<Vec<u8>>> =
    converged_metadata::held_locks::Mutex::new(Vec::new());
/// Spare buffers kept (more than the writers that run at once here: a
/// replication window's worth from each of a few peers).
const SPARE_KEPT: usize = 8;

/// A buffer that goes back to the spares when dropped.
struct SpareBuffer(Vec<u8>);

impl SpareBuffer {
    fn take() -> Self {
        SpareBuffer(SPARE_BUFFERS.lock().pop().unwrap_or_else(|| vec![0u8; DIRECT_WRITE + DIRECT_ALIGN]))
    }
}

impl Drop for SpareBuffer {
    fn drop(&mut self) {
        let buf = std::mem::take(&mut self.0);
        let mut spare = SPARE_BUFFERS.lock();
        if !buf.is_empty() && spare.len() < SPARE_KEPT {
            spare.push(buf);
        }
    }
}

/// Alignment of `O_DIRECT` buffers, offsets and lengths (the page size;
/// every logical block size divides it).
const DIRECT_ALIGN: usize = 4096;
/// Bytes per `O_DIRECT` write.
const DIRECT_WRITE: usize = 1 << 20;
/// Files from this size on are written past the page cache.
pub const DIRECT_FROM: u64 = DIRECT_WRITE as u64;

impl OnceWriter {
    /// Create (or truncate) `path` for writing about `len` bytes: below
    /// [`DIRECT_FROM`] plainly (a small file's padded direct write and
    /// size fix-up cost more than they save, and it is likely read soon).
    pub fn create(path: &std::path::Path, len: u64) -> io::Result<Self> {
        use std::os::unix::fs::OpenOptionsExt;
        let open = |flags| {
            std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .custom_flags(libc::O_CLOEXEC | flags)
                .open(path)
        };
        let (file, direct) = match open(if len >= DIRECT_FROM { libc::O_DIRECT } else { 0 }) {
            Ok(f) => (f, len >= DIRECT_FROM),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => (open(0)?, false),
            Err(e) => return Err(e),
        };
        let buf = match direct {
            true => SpareBuffer::take(),
            false => SpareBuffer(Vec::new()),
        };
        let at = buf.0.as_ptr().align_offset(DIRECT_ALIGN);
        Ok(Self { file, direct, buf, at, filled: 0, written: 0 })
    }

    /// Append `data`.
    pub fn push(&mut self, mut data: &[u8]) -> io::Result<()> {
        if !self.direct {
            self.file.write_all_at(data, self.written)?;
            self.written += data.len() as u64;
            return Ok(());
        }
        while !data.is_empty() {
            let take = data.len().min(DIRECT_WRITE - self.filled);
            let start = self.at + self.filled;
            self.buf.0[start..start + take].copy_from_slice(&data[..take]);
            self.filled += take;
            data = &data[take..];
            if self.filled == DIRECT_WRITE {
                self.flush(DIRECT_WRITE)?;
            }
        }
        Ok(())
    }

    fn flush(&mut self, len: usize) -> io::Result<()> {
        self.file.write_all_at(&self.buf.0[self.at..self.at + len], self.written)?;
        self.written += len as u64;
        self.filled = 0;
        Ok(())
    }

    /// Write what is left and hand back the file, `len` bytes long
    /// (not synced).
    pub fn finish(mut self) -> io::Result<File> {
        if self.direct && self.filled > 0 {
            let len = self.written + self.filled as u64;
            let padded = self.filled.next_multiple_of(DIRECT_ALIGN);
            self.buf.0[self.at + self.filled..self.at + padded].fill(0);
            self.flush(padded)?;
            self.file.set_len(len)?;
        }
        Ok(self.file)
    }
}

#[cfg(test)]
mod tests {
    use std::fs::OpenOptions;

    use super::*;

    #[test]
    fn hole_checksums_match_reading_the_zeros() {
        let dir = tempfile::tempdir().unwrap();
        let f =
            OpenOptions::new().create(true).truncate(true).read(true).write(true).open(dir.path().join("f")).unwrap();
        let len = 5 * 1024 * 1024 + 1000;
        f.write_all_at(b"data in the middle", 3 * 1024 * 1024 + 5).unwrap();
        f.set_len(len).unwrap();
        let mut all = vec![0u8; len as usize];
        read_exact_at(&f, &mut all, 0).unwrap();
        let want: Vec<u32> = all.chunks(BLOCK_SIZE as usize).map(crc32c::crc32c).collect();
        assert_eq!(block_crcs(&f, 0, len).unwrap(), want);
        // A range past the end reads as zeros too.
        assert_eq!(block_crcs(&f, 0, len + 70_000).unwrap().len(), want.len() + 1);
    }

    /// A pooled buffer handed out again holds the new read only: bytes past
    /// the end of a shorter file read as zeros, not as the last chunk's.
    #[test]
    fn a_reused_chunk_buffer_carries_nothing_over() {
        let dir = tempfile::tempdir().unwrap();
        let long = dir.path().join("long");
        let short = dir.path().join("short");
        std::fs::write(&long, vec![0xabu8; 3 << 20]).unwrap();
        std::fs::write(&short, b"tail").unwrap();
        let first = read_shared(&File::open(&long).unwrap(), 0, 3 << 20).unwrap();
        assert!(first.iter().all(|b| *b == 0xab));
        drop(first);
        let again = read_shared(&File::open(&short).unwrap(), 0, 2 << 20).unwrap();
        assert_eq!(again.len(), 2 << 20);
        assert_eq!(&again[..4], b"tail");
        assert!(again[4..].iter().all(|b| *b == 0), "stale bytes of the last read showed through");
    }

    /// What a once-writer wrote reads back byte for byte, whatever the
    /// pieces it was handed and however the length falls against blocks.
    #[test]
    fn a_once_written_file_reads_back_whole() {
        once_written_files_read_back_whole(tempfile::tempdir().unwrap());
    }

    fn once_written_files_read_back_whole(dir: tempfile::TempDir) {
        for len in [0usize, 1, 4095, 4096, DIRECT_WRITE - 1, DIRECT_WRITE, 3 * DIRECT_WRITE + 12_345] {
            let data: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4096) as u8).collect();
            let path = dir.path().join(format!("v{len}"));
            let mut w = OnceWriter::create(&path, len as u64).unwrap();
            for piece in data.chunks(70_001) {
                w.push(piece).unwrap();
            }
            w.finish().unwrap();
            assert_eq!(std::fs::read(&path).unwrap(), data, "{len} bytes");
        }
    }
}
