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
//! then requests made wait for it, and a refused registration sends them
//! back to /dev/fuse for good. So the rings are made before INIT's reply
//! promises them ([`Rings::make`]): a process that cannot make them
//! (io_uring refused by `kernel.io_uring_disabled` or a seccomp filter, no
//! ring memory) does not ask for the transport, where a promise it could
//! not keep would leave every request of the mount waiting.
//!
//! Buffers: an entry's buffers are written by the kernel while the entry is
//! the kernel's (registered or committed, its command pending) and by this
//! process only between the command's completion and the next commit: the
//! thread that took the completion builds the request from them, and the
//! one reply (from whichever thread sends it) writes them and then commits.
//! So no two parties touch them at once.
//!
//! # A daemon that dies with requests in its entries
//!
//! The kernel keeps a request it put into an entry until a commit names
//! it, and `FUSE_NOTIFY_RESEND` does not reach it (it walks the /dev/fuse
//! queues only). But a commit is found by the request's unique id on the
//! entry's queue, not by the ring that registered the entry, and the
//! kernel reads the reply from the addresses the entry was registered
//! with. So the buffers live in shared memory ([`RingArea`]: a memfd the
//! caller keeps across daemons, `Config::io_uring_memory`), mapped at the
//! same address by every daemon of the connection, and each entry's slot
//! records how far this process got with the request in it
//! ([`SlotState`]). A daemon that resumes the connection maps the area
//! where the last one had it and, for each slot, serves again a request
//! the dead daemon held (marked as sent again, as a resend is), commits a
//! reply it had finished, or registers the slot anew. A commit the kernel
//! takes makes the entry this daemon's; one it no longer knows (the reply
//! got there before the death) comes back `ENOENT` and the slot is
//! registered anew.

use std::cell::UnsafeCell;
use std::io;
use std::os::fd::AsRawFd;
use std::os::fd::FromRawFd;
use std::os::fd::OwnedFd;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::sync::OnceLock;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::AtomicU32;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;
use std::thread::ThreadId;

use io_uring::IoUring;
use io_uring::cqueue;
use io_uring::opcode;
use io_uring::squeue;
use io_uring::types;
use log::debug;
use log::error;
use log::info;
use log::warn;
use parking_lot::Mutex;

use crate::Config;
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
const COMMIT_ID: usize = 256 + 8;
const PAYLOAD_SZ: usize = 256 + 16;
/// `struct fuse_in_header` and `struct fuse_out_header`.
const IN_HEADER: usize = 40;
const OUT_HEADER: usize = 16;
/// The bit the kernel sets in the unique id of a request it sends again
/// (`FUSE_UNIQUE_RESEND`); a request served again from a slot carries it too.
const RESENT: u64 = 1 << 63;

/// What a slot's entry holds, as far as this process got with it. Written
/// by the ring's owner when a completion hands it a request (`Held`) and by
/// the reply (`Replying`, `Replied`); read by the next daemon only.
///
/// ```text
///   Free ──request completes──▶ Held ──reply starts──▶ Replying ──reply written──▶ Replied
///    ▲                           ▲                                                   │
///    └──registered anew          └──────────────── next request completes ───────────┘
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
enum SlotState {
    /// Registered, no request seen by this process (the header's commit id
    /// is zeroed at registration: one found there came after).
    Free = 0,
    /// The request named by the slot's unique is being served; its bytes
    /// in the buffers are whole.
    Held = 1,
    /// The reply is being written over the request; the slot's undo area
    /// holds the request's header and the payload bytes the reply covers.
    Replying = 2,
    /// As `Replying`, but what the reply covers did not fit the undo area.
    ReplyingLost = 3,
    /// The reply is whole in the buffers; its commit may or may not have
    /// reached the kernel.
    Replied = 4,
}

impl SlotState {
    fn from_u32(v: u32) -> Option<SlotState> {
        [SlotState::Free, SlotState::Held, SlotState::Replying, SlotState::ReplyingLost, SlotState::Replied]
            .into_iter()
            .find(|s| *s as u32 == v)
    }
}

/// One slot's record in the area's control pages.
#[repr(C)]
struct SlotCtl {
    qid: AtomicU32,
    state: AtomicU32,
    unique: AtomicU64,
    undo_len: AtomicU64,
    _reserved: AtomicU64,
}

const AREA_MAGIC: u64 = u64::from_le_bytes(*b"fuserrng");
const AREA_VERSION: u32 = 1;
/// The area's header: magic, version, slot count, the address it was
/// mapped at, the payload size, the slot stride; then a `SlotCtl` a slot.
const AREA_HEADER: usize = 64;
/// A slot: the entry's header buffer, then the undo area, then (page
/// aligned) the payload buffer.
const SLOT_UNDO: usize = 512;
const SLOT_PAYLOAD: usize = 8192;
const UNDO_SIZE: usize = SLOT_PAYLOAD - SLOT_UNDO;
/// Where the first daemon asks to map the area, away from where a process's
/// heap, libraries and stack go, so that the next daemon finds it free.
#[cfg(target_pointer_width = "64")]
const PREFERRED_BASE: usize = 0x3e00_0000_0000;
#[cfg(not(target_pointer_width = "64"))]
const PREFERRED_BASE: usize = 0;

fn page_size() -> usize {
    page_size::get()
}

fn round_up(n: usize, to: usize) -> usize {
    n.div_ceil(to) * to
}

/// The shared memory the entries' buffers live in (see the module comment).
pub(crate) struct RingArea {
    base: *mut u8,
    len: usize,
    slots: usize,
    payload: usize,
    stride: usize,
    ctl_len: usize,
}

// SAFETY: the mapping is plain memory; each slot has one user at a time
// (module comment), and the control words are atomics.
unsafe impl Send for RingArea {}
unsafe impl Sync for RingArea {}

impl Drop for RingArea {
    fn drop(&mut self) {
        // SAFETY: the mapping was made by `map` with this length and is
        // dropped once, after every ring using it.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

impl std::fmt::Debug for RingArea {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingArea").field("base", &self.base).field("slots", &self.slots).finish()
    }
}

fn map(fd: RawFd, len: usize, at: Option<usize>) -> io::Result<*mut u8> {
    let (addr, flags) = match at {
        Some(a) if a != 0 => (a as *mut libc::c_void, libc::MAP_SHARED | libc::MAP_FIXED_NOREPLACE),
        _ => (std::ptr::null_mut(), libc::MAP_SHARED),
    };
    // SAFETY: a new shared mapping of `fd`; MAP_FIXED_NOREPLACE never
    // replaces an existing mapping.
    let p = unsafe { libc::mmap(addr, len, libc::PROT_READ | libc::PROT_WRITE, flags, fd, 0) };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    if at.is_some_and(|a| a != 0 && a != p as usize) {
        // A kernel older than MAP_FIXED_NOREPLACE takes the address as a hint.
        // SAFETY: the mapping just made, not used.
        unsafe { libc::munmap(p, len) };
        return Err(io::Error::from_raw_os_error(libc::EEXIST));
    }
    Ok(p.cast())
}

impl RingArea {
    /// A fresh area of one slot per entry of `qids` (each slot's queue), with
    /// payload buffers of `payload` bytes, in `memory` (emptied first) or,
    /// without it, in a memfd of this process's own.
    pub(crate) fn create(memory: Option<RawFd>, qids: &[u16], payload: usize) -> io::Result<Arc<RingArea>> {
        let page = page_size();
        let slots = qids.len();
        let ctl_len = round_up(AREA_HEADER + slots * std::mem::size_of::<SlotCtl>(), page);
        let stride = SLOT_PAYLOAD + round_up(payload, page);
        let len = ctl_len + slots * stride;
        let own;
        let fd = match memory {
            Some(fd) => fd,
            None => {
                // SAFETY: memfd_create with a NUL-terminated name.
                let fd = unsafe { libc::memfd_create(c"fuser-rings".as_ptr(), libc::MFD_CLOEXEC) };
                if fd < 0 {
                    return Err(io::Error::last_os_error());
                }
                // SAFETY: just made, owned here; closed once mapped.
                own = unsafe { OwnedFd::from_raw_fd(fd) };
                own.as_raw_fd()
            }
        };
        // SAFETY: plain ftruncate calls on a descriptor the caller lent.
        if unsafe { libc::ftruncate(fd, 0) } != 0 || unsafe { libc::ftruncate(fd, len as libc::off_t) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let base = match map(fd, len, Some(PREFERRED_BASE)) {
            Ok(p) => p,
            Err(e) => {
                debug!("ring memory not mapped at {PREFERRED_BASE:#x} ({e}); anywhere instead");
                map(fd, len, None)?
            }
        };
        let area = RingArea { base, len, slots, payload, stride, ctl_len };
        for (i, qid) in qids.iter().enumerate() {
            area.ctl(i).qid.store(u32::from(*qid), Ordering::Relaxed);
        }
        let mut h = [0u8; 48];
        h[0..8].copy_from_slice(&AREA_MAGIC.to_ne_bytes());
        h[8..12].copy_from_slice(&AREA_VERSION.to_ne_bytes());
        h[12..16].copy_from_slice(&(slots as u32).to_ne_bytes());
        h[16..24].copy_from_slice(&(base as u64).to_ne_bytes());
        h[24..32].copy_from_slice(&(payload as u64).to_ne_bytes());
        h[32..40].copy_from_slice(&(stride as u64).to_ne_bytes());
        h[40..48].copy_from_slice(&(ctl_len as u64).to_ne_bytes());
        // SAFETY: the header lies inside the mapping; nothing else uses it yet.
        unsafe { std::ptr::copy_nonoverlapping(h.as_ptr(), base, h.len()) };
        Ok(Arc::new(area))
    }

    /// The area an earlier daemon of this connection left in `memory`,
    /// mapped where it had it; `None` if it left none.
    pub(crate) fn reopen(memory: RawFd) -> io::Result<Option<Arc<RingArea>>> {
        let mut h = [0u8; 48];
        // SAFETY: pread into a local buffer of its length.
        let n = unsafe { libc::pread(memory, h.as_mut_ptr().cast(), h.len(), 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let u64_at = |i: usize| u64::from_ne_bytes(h[i..i + 8].try_into().unwrap_or_default());
        if (n as usize) < h.len() || u64_at(0) != AREA_MAGIC {
            return Ok(None);
        }
        let version = u32::from_ne_bytes(h[8..12].try_into().unwrap_or_default());
        if version != AREA_VERSION {
            return Err(io::Error::new(io::ErrorKind::InvalidData, format!("ring memory of version {version}")));
        }
        let slots = u32::from_ne_bytes(h[12..16].try_into().unwrap_or_default()) as usize;
        let (base, payload, stride, ctl_len) = (u64_at(16) as usize, u64_at(24) as usize, u64_at(32) as usize, u64_at(40) as usize);
        let len = ctl_len + slots * stride;
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fstat into a local.
        if unsafe { libc::fstat(memory, &mut st) } != 0 {
            return Err(io::Error::last_os_error());
        }
        if (st.st_size as usize) < len || stride < SLOT_PAYLOAD + payload || ctl_len < AREA_HEADER + slots * std::mem::size_of::<SlotCtl>() {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "ring memory shorter than its header says"));
        }
        let base = map(memory, len, Some(base)).map_err(|e| {
            io::Error::new(e.kind(), format!("cannot map the ring memory at {base:#x}, where the earlier daemon had it: {e}"))
        })?;
        Ok(Some(Arc::new(RingArea { base, len, slots, payload, stride, ctl_len })))
    }

    pub(crate) fn slots(&self) -> usize {
        self.slots
    }

    pub(crate) fn payload(&self) -> usize {
        self.payload
    }

    pub(crate) fn qid(&self, slot: usize) -> u16 {
        u16::try_from(self.ctl(slot).qid.load(Ordering::Relaxed)).unwrap_or(0)
    }

    fn ctl(&self, slot: usize) -> &SlotCtl {
        assert!(slot < self.slots);
        // SAFETY: inside the control pages (`ctl_len` covers every slot's
        // record), aligned (64 + 32 * slot), atomics only.
        unsafe { &*self.base.add(AREA_HEADER + slot * std::mem::size_of::<SlotCtl>()).cast::<SlotCtl>() }
    }

    fn slot_base(&self, slot: usize) -> *mut u8 {
        assert!(slot < self.slots);
        // SAFETY: inside the mapping (`len` covers every slot).
        unsafe { self.base.add(self.ctl_len + slot * self.stride) }
    }
}

/// One entry: its slot in the area, and the iovecs that name its buffers to
/// the kernel at registration.
struct Entry {
    slot: usize,
    iov: UnsafeCell<[libc::iovec; 2]>,
    /// The last command was a commit made for an earlier daemon's request:
    /// an error completing it means the kernel no longer holds that request.
    recovering: AtomicBool,
    /// Its registrations are to be refused (the fault
    /// `Config::io_uring_refused`).
    refuse: AtomicBool,
}

// SAFETY: see the module comment: an entry's buffers have one user at a time,
// handed over through the ring's completion and the submission lock.
unsafe impl Sync for Entry {}
unsafe impl Send for Entry {}

/// What a resumed daemon does with a slot an earlier one left.
#[derive(Debug, PartialEq, Eq)]
enum Recovery {
    /// Nothing held: register the slot anew.
    Register,
    /// Serve the request in the buffers (`resent`: the earlier daemon may
    /// have carried it out).
    Serve { resent: bool },
    /// Commit the reply the earlier daemon finished for this request.
    Recommit(u64),
    /// The request was overwritten by an unfinished reply: answer it EIO.
    Fail(u64),
}

/// The decision for a slot from its recorded state, the unique it names
/// and the commit id the kernel last wrote into its header.
fn recovery(state: Option<SlotState>, unique: u64, commit_id: u64) -> Recovery {
    match state {
        Some(SlotState::Free) | None if commit_id != 0 => Recovery::Serve { resent: false },
        Some(SlotState::Free) | None => Recovery::Register,
        Some(SlotState::Held) | Some(SlotState::Replying) if commit_id == unique => Recovery::Serve { resent: true },
        Some(SlotState::ReplyingLost) if commit_id == unique => Recovery::Fail(unique),
        Some(SlotState::Replied) if commit_id == unique => Recovery::Recommit(unique),
        // The kernel put a request in after the reply: never seen here.
        Some(SlotState::Replied) if commit_id != 0 => Recovery::Serve { resent: false },
        Some(_) => Recovery::Register,
    }
}

/// The completion tags of a ring's entry command and of its sentinel poll
/// (see `sentinel`).
const ENTRY: u64 = 0;
const SENTINEL_POLL: u64 = u64::MAX;

/// A quiet io_uring instance that nothing uses, whose descriptor every
/// ring thread polls for input (which never comes). A request on an
/// io_uring file is one the kernel tracks, and a thread that holds a
/// tracked request cancels its rings' cancelable commands, its entries
/// waiting for a request, as the first thing it does when it exits (the
/// kernel's `io_uring_files_cancel`), before it is marked exiting. Without
/// it those entries stay available until the process's last thread closes
/// the rings, and a request the kernel hands to one meanwhile is ended
/// with `ECANCELED` (the copy into a dying thread's buffers is refused):
/// a caller's error each time a daemon is killed under load.
fn sentinel() -> Option<RawFd> {
    static SENTINEL: OnceLock<Option<IoUring>> = OnceLock::new();
    SENTINEL
        .get_or_init(|| match IoUring::new(2) {
            Ok(ring) => Some(ring),
            Err(e) => {
                warn!("no sentinel io_uring ({e}): a daemon killed under load may fail a few requests");
                None
            }
        })
        .as_ref()
        .map(|r| r.as_raw_fd())
}

/// One thread's io_uring with its one entry on one queue.
pub(crate) struct Ring {
    uring: IoUring<squeue::Entry128, cqueue::Entry>,
    /// Held while pushing to the submission queue: the owner and the threads
    /// that answer a request later share it. A leaf: nothing else is taken
    /// under it, and it is never held across a system call.
    submit: Mutex<()>,
    dev: Arc<DevFuse>,
    qid: u16,
    area: Arc<RingArea>,
    entry: Entry,
    /// The thread that serves the ring (set once, when it starts).
    owner: OnceLock<ThreadId>,
}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring").field("qid", &self.qid).field("slot", &self.entry.slot).finish()
    }
}

/// The queues the kernel makes: one per possible CPU.
pub(crate) fn queue_count() -> io::Result<usize> {
    let text = std::fs::read_to_string("/sys/devices/system/cpu/possible")?;
    possible_cpus(&text).ok_or_else(|| {
        io::Error::new(io::ErrorKind::InvalidData, format!("cannot read possible CPUs from {text:?}"))
    })
}

/// The payload buffer each entry gets: the largest request or reply any
/// connection can settle on. The kernel caps a connection's pages at
/// `fs.fuse.max_pages_limit`; INIT's reply keeps `max_write` within this
/// (see `Session::handshake`). At least 1 MiB.
pub(crate) fn max_payload() -> usize {
    let limit = std::fs::read_to_string("/proc/sys/fs/fuse/max_pages_limit")
        .ok()
        .and_then(|t| t.trim().parse::<usize>().ok())
        .unwrap_or(256);
    (limit * page_size()).max(1 << 20)
}

/// A connection's rings, one a slot of their area, made before they are
/// started (see the module comment).
pub(crate) struct Rings {
    pub(crate) area: Arc<RingArea>,
    pub(crate) rings: Vec<Arc<Ring>>,
}

impl Rings {
    /// Rings for a fresh connection: the config's `n_threads` entries spread
    /// evenly over the queues, at least one a queue, in its
    /// `io_uring_memory` (see [`RingArea::create`]). Fails if any ring
    /// cannot be made: the kernel uses the rings only once every queue has
    /// one.
    pub(crate) fn make(dev: &Arc<DevFuse>, config: &Config) -> io::Result<Rings> {
        let (n_threads, memory) = (config.n_threads.unwrap_or(1), config.io_uring_memory);
        let queues = queue_count()?;
        let count = n_threads.max(queues).div_ceil(queues) * queues;
        let qids: Vec<u16> = (0..count).filter_map(|i| u16::try_from(i % queues).ok()).collect();
        let area = RingArea::create(memory, &qids, max_payload())
            .map_err(|e| io::Error::new(e.kind(), format!("ring memory: {e}")))?;
        let rings = Self::on(dev, &area).map_err(|e| io::Error::new(e.kind(), format!("io_uring setup: {e}")))?;
        Ok(Rings { area, rings })
    }

    /// Rings on an area an earlier daemon of the connection left.
    pub(crate) fn reopened(dev: &Arc<DevFuse>, area: Arc<RingArea>) -> io::Result<Rings> {
        let rings = Self::on(dev, &area)?;
        Ok(Rings { area, rings })
    }

    fn on(dev: &Arc<DevFuse>, area: &Arc<RingArea>) -> io::Result<Vec<Arc<Ring>>> {
        (0..area.slots()).map(|slot| Ring::new(dev.clone(), area.clone(), slot)).collect()
    }

    /// Rings made and not asked for: unmapped, and `memory` emptied so that
    /// no later daemon finds an area in it.
    pub(crate) fn discard(self, memory: Option<RawFd>) {
        drop(self);
        if let Some(fd) = memory {
            // SAFETY: ftruncate on a descriptor the caller lent.
            unsafe { libc::ftruncate(fd, 0) };
        }
    }
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
    /// A ring for the entry in `slot` of `area`, on the slot's queue.
    pub(crate) fn new(dev: Arc<DevFuse>, area: Arc<RingArea>, slot: usize) -> io::Result<Arc<Ring>> {
        let qid = area.qid(slot);
        // The entry's command and the sentinel poll, with room to spare.
        let uring = IoUring::<squeue::Entry128, cqueue::Entry>::builder().build(4)?;
        let entry = Entry {
            slot,
            iov: UnsafeCell::new([libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; 2]),
            recovering: AtomicBool::new(false),
            refuse: AtomicBool::new(false),
        };
        Ok(Arc::new(Ring { uring, submit: Mutex::new(()), dev, qid, area, entry, owner: OnceLock::new() }))
    }

    /// The entry's header, undo area and payload buffer.
    fn buffers(&self) -> (*mut u8, *mut u8, *mut u8) {
        let base = self.area.slot_base(self.entry.slot);
        // SAFETY: offsets inside the slot (`stride` covers header, undo and payload).
        unsafe { (base, base.add(SLOT_UNDO), base.add(SLOT_PAYLOAD)) }
    }

    fn ctl(&self) -> &SlotCtl {
        self.area.ctl(self.entry.slot)
    }

    /// The one place a slot's state changes (see `SlotState`). Release: what
    /// was written to the buffers before is there for whoever reads the state.
    fn set_state(&self, state: SlotState, unique: u64) {
        let ctl = self.ctl();
        ctl.unique.store(unique, Ordering::Relaxed);
        ctl.state.store(state as u32, Ordering::Release);
    }

    /// The entry's command: a `struct fuse_uring_cmd_req` in the SQE's command area.
    fn command(&self, op: u32, commit_id: u64, addr: Option<u64>) -> squeue::Entry128 {
        let mut cmd = [0u8; 80];
        cmd[8..16].copy_from_slice(&commit_id.to_ne_bytes());
        cmd[16..18].copy_from_slice(&self.qid.to_ne_bytes());
        opcode::UringCmd80::new(types::Fd(self.dev.as_raw_fd()), op)
            .cmd(cmd)
            .addr(addr)
            .build()
            .user_data(ENTRY)
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

    /// Have the kernel refuse the entry's registrations (a fault for
    /// tests: `Config::io_uring_refused`).
    pub(crate) fn refuse_registration(&self) {
        self.entry.refuse.store(true, Ordering::Relaxed);
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

    /// Offers the entry to the queue (not yet submitted). The kernel
    /// answers a refused registration with a completion at once; an
    /// accepted one completes only when a request comes.
    fn push_register(&self) -> io::Result<()> {
        let (header, _, payload) = self.buffers();
        // SAFETY: the entry is not the kernel's: nothing else touches it.
        unsafe { header.add(COMMIT_ID).cast::<u64>().write_unaligned(0) };
        self.set_state(SlotState::Free, 0);
        // SAFETY: as above; the iovecs live as long as the ring.
        let iov = unsafe { &mut *self.entry.iov.get() };
        iov[0] = libc::iovec { iov_base: header.cast(), iov_len: HEADER_SIZE };
        iov[1] = libc::iovec { iov_base: payload.cast(), iov_len: self.area.payload };
        if self.entry.refuse.load(Ordering::Relaxed) {
            // Less than any connection's payload (at least 1 MiB): refused.
            iov[1].iov_len = 4096;
        }
        let mut sqe = self.command(CMD_REGISTER, 0, Some(iov.as_ptr() as u64));
        // The registration's iovec count goes in the SQE's `len` (offset 24
        // of `struct io_uring_sqe`), which `UringCmd80` does not set.
        // SAFETY: `Entry128` is `#[repr(C)]` over `struct io_uring_sqe` and 64 more bytes.
        unsafe { (&raw mut sqe).cast::<u8>().add(24).cast::<u32>().write_unaligned(2) };
        self.push(&sqe)
    }

    /// Sends the reply `data` (a `struct fuse_out_header` and what follows it)
    /// for the request in the entry, and offers the entry again.
    pub(crate) fn commit(&self, data: &[io::IoSlice<'_>]) -> io::Result<()> {
        let (header_p, undo_p, payload_p) = self.buffers();
        // SAFETY: the entry holds a request this reply answers: it is ours
        // until the commit. The three regions do not overlap.
        let header = unsafe { std::slice::from_raw_parts_mut(header_p, HEADER_SIZE) };
        let undo = unsafe { std::slice::from_raw_parts_mut(undo_p, UNDO_SIZE) };
        let payload = unsafe { std::slice::from_raw_parts_mut(payload_p, self.area.payload) };
        let total: usize = data.iter().map(|s| s.len()).sum();
        let mut out_header = [0u8; OUT_HEADER];
        let mut at = 0;
        for slice in data {
            let n = slice.len().min(OUT_HEADER - at);
            out_header[at..at + n].copy_from_slice(&slice[..n]);
            at += n;
            if at == OUT_HEADER {
                break;
            }
        }
        if at < OUT_HEADER {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "reply shorter than its header"));
        }
        // A request served again carries the resend bit; the kernel knows it without.
        let unique = u64::from_ne_bytes(out_header[8..16].try_into().unwrap_or_default()) & !RESENT;
        out_header[8..16].copy_from_slice(&unique.to_ne_bytes());
        let mut len = total - OUT_HEADER;
        if len > payload.len() {
            error!("reply of {total} bytes does not fit the ring's payload buffer; answering EIO");
            out_header[4..8].copy_from_slice(&(-libc::EIO).to_ne_bytes());
            len = 0;
        }
        // Keep what the reply writes over, so that a daemon taking over after
        // a death in the middle can serve the request again.
        let request_payload = u32::from_ne_bytes(header[PAYLOAD_SZ..PAYLOAD_SZ + 4].try_into().unwrap_or_default()) as usize;
        let covered = len.min(request_payload).min(payload.len());
        if HEADER_SIZE + covered <= UNDO_SIZE {
            undo[..HEADER_SIZE].copy_from_slice(header);
            undo[HEADER_SIZE..HEADER_SIZE + covered].copy_from_slice(&payload[..covered]);
            self.ctl().undo_len.store(covered as u64, Ordering::Relaxed);
            self.set_state(SlotState::Replying, unique);
        } else {
            self.set_state(SlotState::ReplyingLost, unique);
        }
        let mut skip = OUT_HEADER;
        let mut written = 0;
        for slice in data {
            let s: &[u8] = slice;
            let n = skip.min(s.len());
            skip -= n;
            let s = &s[n..];
            if s.is_empty() || written >= len {
                continue;
            }
            let take = s.len().min(len - written);
            payload[written..written + take].copy_from_slice(&s[..take]);
            written += take;
        }
        header[..OUT_HEADER].copy_from_slice(&out_header);
        header[PAYLOAD_SZ..PAYLOAD_SZ + 4].copy_from_slice(&(len as u32).to_ne_bytes());
        self.set_state(SlotState::Replied, unique);
        self.push(&self.command(CMD_COMMIT_AND_FETCH, unique, None))?;
        // The owner submits what it pushed when it next waits; any other
        // thread submits now, as the owner may be asleep in that wait.
        if self.owner.get() != Some(&std::thread::current().id()) {
            self.uring.submit()?;
        }
        Ok(())
    }

    /// The entry's request, as /dev/fuse would have delivered it, into
    /// `buf`; its length. `resent` marks its unique id as a resend's.
    fn request(&self, buf: &mut [u8], resent: bool) -> io::Result<usize> {
        let (header_p, _, payload_p) = self.buffers();
        // SAFETY: the entry holds a request: this thread's until the commit.
        let header = unsafe { std::slice::from_raw_parts(header_p, HEADER_SIZE) };
        let payload = unsafe { std::slice::from_raw_parts(payload_p, self.area.payload) };
        let len = u32::from_ne_bytes(header[0..4].try_into().unwrap_or_default()) as usize;
        let payload_sz = u32::from_ne_bytes(header[PAYLOAD_SZ..PAYLOAD_SZ + 4].try_into().unwrap_or_default()) as usize;
        // The request's first argument went to `op_in`, the rest to the payload.
        let op_len = len.checked_sub(IN_HEADER + payload_sz);
        let Some(op_len) = op_len.filter(|&n| n <= OP_IN_SIZE && payload_sz <= payload.len() && len <= buf.len()) else {
            error!("ring of queue {}: request of {len} bytes with {payload_sz} of payload does not add up", self.qid);
            return Err(io::Error::new(io::ErrorKind::InvalidData, "malformed ring request"));
        };
        buf[..IN_HEADER].copy_from_slice(&header[..IN_HEADER]);
        buf[IN_HEADER..IN_HEADER + op_len].copy_from_slice(&header[OP_IN..OP_IN + op_len]);
        buf[IN_HEADER + op_len..len].copy_from_slice(&payload[..payload_sz]);
        if resent {
            let unique = u64::from_ne_bytes(buf[8..16].try_into().unwrap_or_default()) | RESENT;
            buf[8..16].copy_from_slice(&unique.to_ne_bytes());
        }
        Ok(len)
    }

    /// Takes the request in the entry (held from now on, in the slot's
    /// record) and hands it to `dispatch`; false when the session ends.
    fn take(&self, buf: &mut [u8], resent: bool, dispatch: &mut impl FnMut(&[u8]) -> bool) -> io::Result<bool> {
        let len = self.request(buf, resent)?;
        let unique = u64::from_ne_bytes(buf[8..16].try_into().unwrap_or_default()) & !RESENT;
        self.set_state(SlotState::Held, unique);
        Ok(dispatch(&buf[..len]))
    }

    /// What to do with the entry's slot when this daemon resumes a
    /// connection an earlier one served; a request to serve is left in the
    /// buffers as it came.
    fn recover(&self) -> Recovery {
        let (header_p, undo_p, payload_p) = self.buffers();
        let ctl = self.ctl();
        let state = SlotState::from_u32(ctl.state.load(Ordering::Acquire));
        let unique = ctl.unique.load(Ordering::Relaxed);
        // SAFETY: no command of this daemon names the slot yet; the earlier
        // daemon is gone and the kernel writes an entry only while it is its.
        let header = unsafe { std::slice::from_raw_parts_mut(header_p, HEADER_SIZE) };
        let commit_id = u64::from_ne_bytes(header[COMMIT_ID..COMMIT_ID + 8].try_into().unwrap_or_default());
        let decision = recovery(state, unique, commit_id);
        if state == Some(SlotState::Replying) && decision == (Recovery::Serve { resent: true }) {
            let covered = ctl.undo_len.load(Ordering::Relaxed) as usize;
            // SAFETY: as above.
            let undo = unsafe { std::slice::from_raw_parts(undo_p, UNDO_SIZE) };
            let payload = unsafe { std::slice::from_raw_parts_mut(payload_p, self.area.payload) };
            if HEADER_SIZE + covered > UNDO_SIZE || covered > payload.len() {
                return Recovery::Fail(unique);
            }
            header.copy_from_slice(&undo[..HEADER_SIZE]);
            payload[..covered].copy_from_slice(&undo[HEADER_SIZE..HEADER_SIZE + covered]);
        }
        if let Recovery::Serve { .. } = decision {
            // The request's own header must name the id the kernel wrote.
            let in_unique = u64::from_ne_bytes(header[8..16].try_into().unwrap_or_default());
            if in_unique != commit_id {
                warn!("ring of queue {}: slot {} names request {commit_id} but holds {in_unique}; registered anew", self.qid, self.entry.slot);
                return Recovery::Register;
            }
        }
        decision
    }

    /// Waits for requests and hands each to `dispatch` as /dev/fuse would
    /// have delivered it. With `resume`, first serves or answers what an
    /// earlier daemon left in the entry's slot; otherwise registers it.
    /// Returns when the connection ends.
    pub(crate) fn serve(&self, resume: bool, mut dispatch: impl FnMut(&[u8]) -> bool) -> io::Result<()> {
        let _ = self.owner.set(std::thread::current().id());
        let mut buf = vec![0u8; IN_HEADER + OP_IN_SIZE + self.area.payload];
        let decision = if resume { self.recover() } else { Recovery::Register };
        if decision != Recovery::Register {
            info!("ring of queue {}, slot {}: {decision:?} after the earlier daemon", self.qid, self.entry.slot);
            self.entry.recovering.store(true, Ordering::Relaxed);
        }
        match decision {
            Recovery::Register => self.push_register()?,
            Recovery::Recommit(unique) => {
                self.push(&self.command(CMD_COMMIT_AND_FETCH, unique, None))?;
            }
            Recovery::Fail(unique) => {
                let mut reply = [0u8; OUT_HEADER];
                reply[0..4].copy_from_slice(&(OUT_HEADER as u32).to_ne_bytes());
                reply[4..8].copy_from_slice(&(-libc::EIO).to_ne_bytes());
                reply[8..16].copy_from_slice(&unique.to_ne_bytes());
                self.commit(&[io::IoSlice::new(&reply)])?;
            }
            Recovery::Serve { resent } => {
                if !self.take(&mut buf, resent, &mut dispatch)? {
                    return Ok(());
                }
            }
        }
        if let Some(fd) = sentinel() {
            let poll = opcode::PollAdd::new(types::Fd(fd), libc::POLLIN as u32).build().user_data(SENTINEL_POLL);
            self.push(&poll.into())?;
        }
        self.uring.submit()?;
        let mut done = Vec::with_capacity(2);
        loop {
            match self.uring.submitter().submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) => return Err(e),
            }
            {
                // SAFETY: only the owner (this thread) reads the completion queue.
                let cq = unsafe { self.uring.completion_shared() };
                done.extend(cq.map(|c| (c.user_data(), c.result())));
            }
            for (data, res) in done.drain(..) {
                if data == SENTINEL_POLL {
                    debug!("ring of queue {}: the sentinel poll ended ({res})", self.qid);
                    continue;
                }
                if data != ENTRY {
                    error!("ring of queue {}: completion of unknown tag {data}", self.qid);
                    continue;
                }
                let recovering = self.entry.recovering.swap(false, Ordering::Relaxed);
                if res < 0 {
                    let err = io::Error::from_raw_os_error(-res);
                    if recovering && matches!(-res, libc::ENOENT | libc::EIO) {
                        // The earlier daemon's reply got there before it died.
                        debug!("ring of queue {}: the kernel no longer holds the request ({err}); entry registered anew", self.qid);
                        self.push_register()?;
                        continue;
                    }
                    return match -res {
                        // The connection ended (unmount, abort) or the ring is going away.
                        libc::ENOTCONN | libc::ECANCELED | libc::ENODEV | libc::ECONNABORTED => {
                            debug!("ring of queue {}: {err}", self.qid);
                            Ok(())
                        }
                        _ => {
                            warn!("FUSE over io_uring, queue {}: the kernel refused an entry: {err}", self.qid);
                            Err(err)
                        }
                    };
                }
                // The completion hands the entry to this thread until its commit.
                if !self.take(&mut buf, false, &mut dispatch)? {
                    return Ok(());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Recovery, SlotState, possible_cpus, recovery};

    #[test]
    fn possible_cpu_lists() {
        assert_eq!(possible_cpus("0-1\n"), Some(2));
        assert_eq!(possible_cpus("0"), Some(1));
        assert_eq!(possible_cpus("0-3,8-11"), Some(12));
        assert_eq!(possible_cpus("x"), None);
    }

    #[test]
    fn what_a_resumed_daemon_does_with_each_slot() {
        use SlotState::*;
        // Registered and never used; used and answered, nothing since.
        assert_eq!(recovery(Some(Free), 0, 0), Recovery::Register);
        // A request the earlier daemon never saw.
        assert_eq!(recovery(Some(Free), 0, 8), Recovery::Serve { resent: false });
        assert_eq!(recovery(Some(Replied), 6, 8), Recovery::Serve { resent: false });
        // Held, or its reply begun and undone: served again as a resend.
        assert_eq!(recovery(Some(Held), 8, 8), Recovery::Serve { resent: true });
        assert_eq!(recovery(Some(Replying), 8, 8), Recovery::Serve { resent: true });
        assert_eq!(recovery(Some(ReplyingLost), 8, 8), Recovery::Fail(8));
        // A finished reply: committed (the kernel says ENOENT if it had it).
        assert_eq!(recovery(Some(Replied), 8, 8), Recovery::Recommit(8));
        // Inconsistent records are left alone.
        assert_eq!(recovery(Some(Held), 8, 10), Recovery::Register);
        assert_eq!(recovery(None, 3, 0), Recovery::Register);
    }
}
