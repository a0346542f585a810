//! FUSE over io_uring (Linux 6.14, `enable_uring` set in the fuse module).
//!
//! Instead of threads blocked in `read(2)` on /dev/fuse, each ring thread
//! owns an io_uring and registers ring entries (a header buffer and a
//! payload buffer each) on one of the connection's queues, one queue per
//! possible CPU. The kernel puts a request made on CPU `q` into a free
//! entry of queue `q` and completes that entry's command; the thread
//! answers by writing the reply into the same buffers and submitting
//! `COMMIT_AND_FETCH`, which hands the reply over and offers the entry for
//! the next request in one command. Forgets and interrupts still come
//! through /dev/fuse, so its readers stay.
//!
//! The kernel switches to the rings once every queue holds an entry; until
//! then (or if it refuses the registrations) requests keep coming through
//! /dev/fuse, so a refused ring costs nothing but its log line.
//!
//! Buffers: an entry's buffers are written by the kernel while the entry is
//! the kernel's (registered or committed, its command pending) and by this
//! process only between the command's completion and the next commit: the
//! thread that took the completion builds the request from them, and the
//! one reply (from whichever thread sends it) writes them and then commits.
//! So no two parties touch them at once.

use std::cell::UnsafeCell;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::OnceLock;
use std::thread::ThreadId;

use io_uring::IoUring;
use io_uring::cqueue;
use io_uring::opcode;
use io_uring::squeue;
use io_uring::types;
use log::debug;
use log::error;
use log::warn;
use parking_lot::Mutex;

use crate::dev_fuse::DevFuse;

/// `FUSE_IO_URING_CMD_REGISTER`: offer an entry to a queue.
const CMD_REGISTER: u32 = 1;
/// `FUSE_IO_URING_CMD_COMMIT_AND_FETCH`: answer the entry's request, and offer the entry again.
const CMD_COMMIT_AND_FETCH: u32 = 2;

/// `struct fuse_uring_req_header`: `in_out[128]`, `op_in[128]`, then
/// `struct fuse_uring_ent_in_out` (flags, commit_id, payload_sz, padding, reserved).
const HEADER_SIZE: usize = 128 + 128 + 32;
const OP_IN: usize = 128;
const OP_IN_SIZE: usize = 128;
const PAYLOAD_SZ: usize = 256 + 16;
/// `struct fuse_in_header` and `struct fuse_out_header`.
const IN_HEADER: usize = 40;
const OUT_HEADER: usize = 16;

/// An entry's two buffers, and the iovecs that name them to the kernel at registration.
struct Entry {
    header: UnsafeCell<Box<[u8; HEADER_SIZE]>>,
    payload: UnsafeCell<Box<[u8]>>,
    iov: UnsafeCell<[libc::iovec; 2]>,
}

// SAFETY: see the module comment: an entry's buffers have one user at a time,
// handed over through the ring's completion and the submission lock.
unsafe impl Sync for Entry {}
unsafe impl Send for Entry {}

/// One thread's io_uring with its entries on one queue.
pub(crate) struct Ring {
    uring: IoUring<squeue::Entry128, cqueue::Entry>,
    /// Held while pushing to the submission queue: the owner and the threads
    /// that answer a request later share it. A leaf: nothing else is taken
    /// under it, and it is never held across a system call.
    submit: Mutex<()>,
    dev: Arc<DevFuse>,
    qid: u16,
    entries: Box<[Entry]>,
    payload_len: usize,
    /// The thread that serves the ring (set once, when it starts).
    owner: OnceLock<ThreadId>,
}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring").field("qid", &self.qid).field("entries", &self.entries.len()).finish()
    }
}

/// The queues the kernel makes: one per possible CPU.
pub(crate) fn queue_count() -> io::Result<usize> {
    let text = std::fs::read_to_string("/sys/devices/system/cpu/possible")?;
    possible_cpus(&text).ok_or_else(|| {
        io::Error::new(io::ErrorKind::InvalidData, format!("cannot read possible CPUs from {text:?}"))
    })
}

/// The number of CPUs in a list such as `0-3,8-11` (ids from 0 up to the
/// highest, as the kernel counts `num_possible_cpus`' queues by id).
fn possible_cpus(text: &str) -> Option<usize> {
    let mut highest = None;
    for part in text.trim().split(',') {
        let last = part.rsplit('-').next()?;
        let n: usize = last.trim().parse().ok()?;
        highest = Some(highest.map_or(n, |h: usize| h.max(n)));
    }
    highest.map(|h| h + 1)
}

impl Ring {
    /// A ring of `entries` entries for queue `qid`, each with a payload buffer of `payload` bytes.
    pub(crate) fn new(dev: Arc<DevFuse>, qid: u16, entries: usize, payload: usize) -> io::Result<Arc<Ring>> {
        let uring = IoUring::<squeue::Entry128, cqueue::Entry>::builder().build((entries * 2).next_power_of_two() as u32)?;
        let entries = (0..entries)
            .map(|_| Entry {
                header: UnsafeCell::new(Box::new([0; HEADER_SIZE])),
                payload: UnsafeCell::new(vec![0; payload].into_boxed_slice()),
                iov: UnsafeCell::new([libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; 2]),
            })
            .collect();
        Ok(Arc::new(Ring { uring, submit: Mutex::new(()), dev, qid, entries, payload_len: payload, owner: OnceLock::new() }))
    }

    /// The command for entry `index`: a `struct fuse_uring_cmd_req` in the SQE's command area.
    fn command(&self, op: u32, index: usize, commit_id: u64, addr: Option<u64>) -> squeue::Entry128 {
        let mut cmd = [0u8; 80];
        cmd[8..16].copy_from_slice(&commit_id.to_ne_bytes());
        cmd[16..18].copy_from_slice(&self.qid.to_ne_bytes());
        opcode::UringCmd80::new(types::Fd(self.dev.as_raw_fd()), op)
            .cmd(cmd)
            .addr(addr)
            .build()
            .user_data(index as u64)
    }

    fn push(&self, sqe: &squeue::Entry128) -> io::Result<()> {
        let _g = self.submit.lock();
        // SAFETY: every push to this ring's submission queue holds `submit`.
        let mut sq = unsafe { self.uring.submission_shared() };
        // SAFETY: the SQE names buffers that live as long as the ring.
        unsafe { sq.push(sqe) }.map_err(|_| io::Error::other("io_uring submission queue full"))?;
        sq.sync();
        Ok(())
    }

    /// The /dev/fuse descriptor the ring's commands name.
    pub(crate) fn dev(&self) -> &Arc<DevFuse> {
        &self.dev
    }

    /// Pins the calling thread to the queue's CPU, where the processes whose
    /// requests it serves sleep while they wait (without it, unlinks from one
    /// process ran at 0.6-0.75x those through /dev/fuse here; with it,
    /// 1.3x: bench/HISTORY.md). A CPU outside the daemon's allowed set
    /// (a cpuset) leaves the thread unpinned.
    pub(crate) fn pin(&self) {
        let cpu = usize::from(self.qid);
        // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET stays inside it
        // for ids below CPU_SETSIZE, which the check keeps to.
        let rc = unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            if cpu >= 8 * std::mem::size_of::<libc::cpu_set_t>() {
                return;
            }
            libc::CPU_SET(cpu, &mut set);
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
        };
        if rc != 0 {
            debug!("ring of queue {}: not pinned to CPU {cpu}: {}", self.qid, io::Error::last_os_error());
        }
    }

    /// Offers every entry to the queue. The kernel answers a refused
    /// registration with a completion at once; an accepted one completes
    /// only when a request comes.
    pub(crate) fn register(&self) -> io::Result<()> {
        for (index, entry) in self.entries.iter().enumerate() {
            // SAFETY: not yet registered: nothing else touches the entry.
            let iov = unsafe { &mut *entry.iov.get() };
            let header = unsafe { &mut *entry.header.get() };
            let payload = unsafe { &mut *entry.payload.get() };
            iov[0] = libc::iovec { iov_base: header.as_mut_ptr().cast(), iov_len: HEADER_SIZE };
            iov[1] = libc::iovec { iov_base: payload.as_mut_ptr().cast(), iov_len: payload.len() };
            let mut sqe = self.command(CMD_REGISTER, index, 0, Some(iov.as_ptr() as u64));
            // The registration's iovec count goes in the SQE's `len` (offset 24
            // of `struct io_uring_sqe`), which `UringCmd80` does not set.
            // SAFETY: `Entry128` is `#[repr(C)]` over `struct io_uring_sqe` and 64 more bytes.
            unsafe { (&raw mut sqe).cast::<u8>().add(24).cast::<u32>().write_unaligned(2) };
            self.push(&sqe)?;
        }
        self.uring.submit()?;
        Ok(())
    }

    /// Sends the reply `data` (a `struct fuse_out_header` and what follows it)
    /// for the request in entry `index`, and offers the entry again.
    pub(crate) fn commit(&self, index: usize, data: &[io::IoSlice<'_>]) -> io::Result<()> {
        let entry = &self.entries[index];
        // SAFETY: the entry holds a request this reply answers: it is ours until the commit.
        let header = unsafe { &mut *entry.header.get() };
        let payload = unsafe { &mut *entry.payload.get() };
        let total: usize = data.iter().map(|s| s.len()).sum();
        let mut out_header = [0u8; OUT_HEADER];
        let mut at = 0;
        let mut len = 0;
        let mut overflow = false;
        for slice in data {
            let mut s: &[u8] = slice;
            if at < OUT_HEADER {
                let n = s.len().min(OUT_HEADER - at);
                out_header[at..at + n].copy_from_slice(&s[..n]);
                at += n;
                s = &s[n..];
            }
            if s.is_empty() {
                continue;
            }
            if len + s.len() > payload.len() {
                overflow = true;
                break;
            }
            payload[len..len + s.len()].copy_from_slice(s);
            len += s.len();
        }
        if at < OUT_HEADER {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "reply shorter than its header"));
        }
        let unique = u64::from_ne_bytes(out_header[8..16].try_into().unwrap_or_default());
        if overflow {
            error!("reply of {total} bytes does not fit the ring's payload buffer; answering EIO");
            out_header[4..8].copy_from_slice(&(-libc::EIO).to_ne_bytes());
            len = 0;
        }
        header[..OUT_HEADER].copy_from_slice(&out_header);
        header[PAYLOAD_SZ..PAYLOAD_SZ + 4].copy_from_slice(&(len as u32).to_ne_bytes());
        self.push(&self.command(CMD_COMMIT_AND_FETCH, index, unique, None))?;
        // The owner submits what it pushed when it next waits; any other
        // thread submits now, as the owner may be asleep in that wait.
        if self.owner.get() != Some(&std::thread::current().id()) {
            self.uring.submit()?;
        }
        Ok(())
    }

    /// Waits for requests and hands each to `dispatch` as /dev/fuse would
    /// have delivered it, with the entry it came in. Returns when the
    /// connection ends.
    pub(crate) fn serve(&self, mut dispatch: impl FnMut(usize, &[u8]) -> bool) -> io::Result<()> {
        let _ = self.owner.set(std::thread::current().id());
        let mut buf = vec![0u8; IN_HEADER + OP_IN_SIZE + self.payload_len];
        let mut done = Vec::with_capacity(self.entries.len());
        loop {
            match self.uring.submitter().submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) => return Err(e),
            }
            {
                // SAFETY: only the owner (this thread) reads the completion queue.
                let cq = unsafe { self.uring.completion_shared() };
                done.extend(cq.map(|c| (c.user_data() as usize, c.result())));
            }
            for (index, res) in done.drain(..) {
                if res < 0 {
                    let err = io::Error::from_raw_os_error(-res);
                    return match -res {
                        // The connection ended (unmount, abort) or the ring is going away.
                        libc::ENOTCONN | libc::ECANCELED | libc::ENODEV => {
                            debug!("ring of queue {}: {err}", self.qid);
                            Ok(())
                        }
                        _ => {
                            warn!("FUSE over io_uring, queue {}: the kernel refused an entry: {err}", self.qid);
                            Err(err)
                        }
                    };
                }
                let Some(entry) = self.entries.get(index) else {
                    error!("ring of queue {}: completion for unknown entry {index}", self.qid);
                    continue;
                };
                // SAFETY: the completion hands the entry to this thread until its commit.
                let header = unsafe { &*entry.header.get() };
                let payload = unsafe { &*entry.payload.get() };
                let len = u32::from_ne_bytes(header[0..4].try_into().unwrap_or_default()) as usize;
                let payload_sz = u32::from_ne_bytes(header[PAYLOAD_SZ..PAYLOAD_SZ + 4].try_into().unwrap_or_default()) as usize;
                // The request's first argument went to `op_in`, the rest to the payload.
                let op_len = len.checked_sub(IN_HEADER + payload_sz);
                let Some(op_len) = op_len.filter(|&n| n <= OP_IN_SIZE && payload_sz <= payload.len()) else {
                    error!("ring of queue {}: request of {len} bytes with {payload_sz} of payload does not add up", self.qid);
                    return Err(io::Error::new(io::ErrorKind::InvalidData, "malformed ring request"));
                };
                buf[..IN_HEADER].copy_from_slice(&header[..IN_HEADER]);
                buf[IN_HEADER..IN_HEADER + op_len].copy_from_slice(&header[OP_IN..OP_IN + op_len]);
                buf[IN_HEADER + op_len..len].copy_from_slice(&payload[..payload_sz]);
                if !dispatch(index, &buf[..len]) {
                    return Ok(());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::possible_cpus;

    #[test]
    fn possible_cpu_lists() {
        assert_eq!(possible_cpus("0-1\n"), Some(2));
        assert_eq!(possible_cpus("0"), Some(1));
        assert_eq!(possible_cpus("0-3,8-11"), Some(12));
        assert_eq!(possible_cpus("x"), None);
    }
}
