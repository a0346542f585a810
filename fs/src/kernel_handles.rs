//! The kernel's file handles, kept where a crash of the daemon does not
//! take them: one slot per open handle in `<data dir>/kernel-handles`,
//! written before the open is answered and cleared when the handle is
//! released. When the daemon dies under a live connection (see
//! `supervise.rs`), the next one reads the slots to serve the handles the
//! kernel still holds: which inode, whether writable, the kernel I/O mode,
//! the passthrough backing id.
//!
//! The slots are written with `pwrite` and never synced: they live as long
//! as the page cache, which is as long as the connection they describe (a
//! power loss ends both; a cold mount starts the file empty). A slot is
//! written by one syscall, so a killed daemon leaves each whole or
//! unwritten.
//!
//! Slot 0 is the header: what the connection's INIT settled that a later
//! daemon must know (whether the kernel took passthrough), and the
//! connection's random id, which names its requests in the metadata (a
//! request id alone repeats from one mount to the next; see
//! `converged_metadata::types::RequestMark`).

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

use converged_metadata::held_locks::Mutex;

use crate::core::{Io, KernelOpen};

const FILE: &str = "kernel-handles";
const SLOT: usize = 40;
const MAGIC: u64 = u64::from_le_bytes(*b"cvgdkh01");

/// The bit the kernel sets in the unique id of a request it sends again
/// (`FUSE_UNIQUE_RESEND`).
pub const RESENT: u64 = 1 << 63;

const LIVE: u32 = 1;
const WRITABLE: u32 = 2;
const IO_SHIFT: u32 = 4;

/// One handle as the kernel holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recorded {
    pub handle: KernelOpen,
    /// The passthrough backing id the handle was opened with (0: none).
    pub backing_id: u32,
    /// The unique id of the request that opened it: a request the dead
    /// daemon recorded but did not answer comes again with this id.
    pub unique: u64,
}

impl Recorded {
    fn encode(&self) -> [u8; SLOT] {
        let io = match self.handle.io {
            Io::Passthrough => 0,
            Io::Cached => 1,
            Io::Direct => 2,
        };
        let flags = LIVE | if self.handle.writable { WRITABLE } else { 0 } | (io << IO_SHIFT);
        let mut b = [0u8; SLOT];
        b[0..8].copy_from_slice(&self.handle.fh.to_le_bytes());
        b[8..16].copy_from_slice(&self.handle.ino.to_le_bytes());
        b[16..24].copy_from_slice(&self.unique.to_le_bytes());
        b[24..28].copy_from_slice(&self.backing_id.to_le_bytes());
        b[28..32].copy_from_slice(&flags.to_le_bytes());
        b
    }

    fn decode(b: &[u8]) -> Option<Self> {
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let flags = u32_at(28);
        if flags & LIVE == 0 {
            return None;
        }
        let io = match (flags >> IO_SHIFT) & 3 {
            0 => Io::Passthrough,
            1 => Io::Cached,
            _ => Io::Direct,
        };
        Some(Recorded {
            handle: KernelOpen { fh: u64_at(0), ino: u64_at(8), writable: flags & WRITABLE != 0, io },
            unique: u64_at(16),
            backing_id: u32_at(24),
        })
    }
}

/// What the connection's INIT settled, for a daemon that did not see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Settled {
    pub passthrough: bool,
    /// FUSE over io_uring: the kernel sends requests to ring entries, which
    /// the next daemon must register again (with them, it waits).
    pub io_uring: bool,
}

#[derive(Default)]
struct Slots {
    by_fh: HashMap<u64, u64>,
    free: Vec<u64>,
    /// Slots used so far (the header is slot 0).
    end: u64,
}

/// The handle journal of one mount. Its lock is a leaf (nothing is taken
/// under it, and the slot is written after it is let go).
pub struct HandleJournal {
    file: File,
    connection: u64,
    slots: Mutex<Slots>,
    /// Handles of the earlier daemon by the unique id of their open: a
    /// resent open is answered with the handle it made.
    resent: HashMap<u64, Recorded>,
}

impl HandleJournal {
    fn open_file(data_dir: &Path) -> io::Result<File> {
        OpenOptions::new().read(true).write(true).create(true).truncate(false).open(data_dir.join(FILE))
    }

    /// A new connection: no handle is open yet.
    pub fn create(data_dir: &Path, settled: Settled) -> io::Result<Self> {
        let file = Self::open_file(data_dir)?;
        file.set_len(0)?;
        let j = HandleJournal {
            file,
            connection: random_u64(),
            slots: Mutex::new(Slots { end: 1, ..Slots::default() }),
            resent: HashMap::new(),
        };
        j.write_header(settled)?;
        Ok(j)
    }

    /// Set what INIT settled (once the kernel answered it).
    pub fn write_header(&self, settled: Settled) -> io::Result<()> {
        let mut b = [0u8; SLOT];
        b[0..8].copy_from_slice(&MAGIC.to_le_bytes());
        b[8] = u8::from(settled.passthrough);
        b[9] = u8::from(settled.io_uring);
        b[16..24].copy_from_slice(&self.connection.to_le_bytes());
        self.file.write_all_at(&b, 0)
    }

    /// The connection's random id (made with its journal).
    pub fn connection(&self) -> u64 {
        self.connection
    }

    /// A live connection an earlier daemon served: its settlement and the
    /// handles the kernel holds, which keep their slots.
    pub fn take_over(data_dir: &Path) -> io::Result<(Self, Settled, Vec<Recorded>)> {
        let file = Self::open_file(data_dir)?;
        let bytes = std::fs::read(data_dir.join(FILE))?;
        if bytes.len() < SLOT || bytes[0..8] != MAGIC.to_le_bytes() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{} holds no handle journal of a live connection", data_dir.join(FILE).display()),
            ));
        }
        let settled = Settled { passthrough: bytes[8] != 0, io_uring: bytes[9] != 0 };
        let connection = u64::from_le_bytes(bytes[16..24].try_into().expect("8 bytes"));
        let mut slots = Slots { end: (bytes.len() / SLOT) as u64, ..Slots::default() };
        let mut found = Vec::new();
        for (i, b) in bytes.chunks_exact(SLOT).enumerate().skip(1) {
            match Recorded::decode(b) {
                Some(r) => {
                    slots.by_fh.insert(r.handle.fh, i as u64);
                    found.push(r);
                }
                None => slots.free.push(i as u64),
            }
        }
        let resent = found.iter().map(|r| (r.unique, *r)).collect();
        Ok((HandleJournal { file, connection, slots: Mutex::new(slots), resent }, settled, found))
    }

    /// Record an open handle (before the open is answered).
    pub fn record(&self, r: &Recorded) -> io::Result<()> {
        let slot = {
            let mut s = self.slots.lock();
            let slot = match s.free.pop() {
                Some(slot) => slot,
                None => {
                    s.end += 1;
                    s.end - 1
                }
            };
            s.by_fh.insert(r.handle.fh, slot);
            slot
        };
        self.file.write_all_at(&r.encode(), slot * SLOT as u64)
    }

    /// The handle was released. Its slot is cleared before it is reused.
    pub fn forget(&self, fh: u64) {
        let Some(slot) = self.slots.lock().by_fh.remove(&fh) else { return };
        if let Err(e) = self.file.write_all_at(&[0u8; SLOT], slot * SLOT as u64) {
            // Left live, the slot would make a later daemon serve a handle
            // the kernel no longer holds: keep it out of use instead.
            tracing::warn!(fh, error = %e, "could not clear a handle's slot");
            return;
        }
        self.slots.lock().free.push(slot);
    }

    /// The handle an earlier daemon made for the open with this unique id,
    /// when the kernel sends that open again (bit 63 of its unique set).
    pub fn resent_open(&self, unique: u64) -> Option<Recorded> {
        if unique & RESENT == 0 {
            return None;
        }
        self.resent.get(&(unique & !RESENT)).copied()
    }
}

/// 64 random bits from the kernel's generator (time and pid where it has none).
fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: getrandom(2) into a buffer of its length.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n == b.len() as isize {
        return u64::from_le_bytes(b);
    }
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    t.as_nanos() as u64 ^ u64::from(std::process::id()) << 32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(fh: u64, ino: u64, writable: bool, io: Io, backing_id: u32) -> Recorded {
        Recorded { handle: KernelOpen { fh, ino, writable, io }, backing_id, unique: fh * 10 }
    }

    #[test]
    fn a_later_daemon_finds_the_handles_still_open_and_reuses_the_slots_of_released_ones() {
        let dir = tempfile::tempdir().unwrap();
        let j = HandleJournal::create(dir.path(), Settled { passthrough: true, io_uring: false }).unwrap();
        let (a, b, c) =
            (rec(1, 10, true, Io::Passthrough, 7), rec(2, 11, false, Io::Cached, 0), rec(3, 10, false, Io::Direct, 0));
        for r in [&a, &b, &c] {
            j.record(r).unwrap();
        }
        j.forget(2);
        let connection = j.connection();
        j.write_header(Settled { passthrough: true, io_uring: true }).unwrap();
        drop(j);
        let (j, settled, found) = HandleJournal::take_over(dir.path()).unwrap();
        assert_eq!(settled, Settled { passthrough: true, io_uring: true }, "what INIT settled");
        assert_eq!(j.connection(), connection, "the connection keeps its id");
        let other = HandleJournal::create(tempfile::tempdir().unwrap().path(), Settled::default()).unwrap();
        assert_ne!(other.connection(), connection, "another connection's id differs");
        assert_eq!(found, vec![a, c]);
        assert_eq!(j.resent_open(10 | 1 << 63), Some(a));
        assert_eq!(j.resent_open(10), None, "a first open is not a resent one");
        // The freed slot is used again: the file does not grow.
        let len = std::fs::metadata(dir.path().join(FILE)).unwrap().len();
        j.record(&rec(4, 12, false, Io::Cached, 0)).unwrap();
        assert_eq!(std::fs::metadata(dir.path().join(FILE)).unwrap().len(), len);
        j.forget(1);
        j.forget(3);
        j.forget(4);
        let (_, _, found) = HandleJournal::take_over(dir.path()).unwrap();
        assert!(found.is_empty());
    }

    #[test]
    fn a_file_that_is_no_journal_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(FILE), b"not a journal at all, just some bytes here").unwrap();
        assert!(HandleJournal::take_over(dir.path()).is_err());
    }
}
