//! Block I/O on backing files: positional reads where a short file reads
//! as zeros, and the crc32c of each 64 KiB block (holes checksummed without
//! being read). Plain `std::io`: no daemon error types, so every module that
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
}
