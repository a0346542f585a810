//! Kernel requests answered once, though the kernel may send them twice.
//!
//! A daemon that dies after a namespace change commits and before the
//! kernel has its answer leaves the request in the kernel, which sends it
//! again to the next daemon on the same connection (`FUSE_NOTIFY_RESEND`).
//! Done again, a committed mkdir would fail with EEXIST and a committed
//! rename or unlink with ENOENT: errors for changes that were made. So the
//! transaction of each change made for a kernel request also records the
//! request (its [`RequestMark`]) and the inode it made or named, and the
//! next daemon asks for that record before doing a resent request again.
//!
//! A node's records are a ring of [`ANSWERED_SLOTS`] keys (`J`), the slot
//! chosen by the request's id, so they need no cleaning: a record is
//! overwritten `ANSWERED_SLOTS` requests later, long after its request was
//! answered (a change is answered as soon as it commits). The ring is the
//! node's: a connection belongs to one node.

use crate::error::MetaResult;
use crate::kv::KvWrite;
use crate::namespace::Namespace;
use crate::schema;
use crate::types::{Ino, RequestMark};

/// Slots in a node's ring of committed requests.
pub const ANSWERED_SLOTS: u64 = 4096;

const RECORD: usize = 24;

impl RequestMark {
    fn slot(&self) -> u16 {
        // The kernel numbers requests in steps of two.
        ((self.unique >> 1) % ANSWERED_SLOTS) as u16
    }

    fn record(&self, ino: Ino) -> [u8; RECORD] {
        let mut b = [0u8; RECORD];
        b[0..8].copy_from_slice(&self.connection.to_be_bytes());
        b[8..16].copy_from_slice(&self.unique.to_be_bytes());
        b[16..24].copy_from_slice(&ino.to_be_bytes());
        b
    }
}

impl Namespace {
    /// Record in `txn` that the change it makes answers `request` (when
    /// it is made for one), naming `ino`.
    pub(crate) fn answering(&self, txn: &mut (impl KvWrite + ?Sized), request: Option<RequestMark>, ino: Ino) {
        if let Some(r) = request {
            txn.put(&schema::answered(&self.node, r.slot()), &r.record(ino));
        }
    }

    /// Whether the change `request` asked for committed, and the inode it
    /// made or named.
    pub fn answered(&self, request: RequestMark) -> MetaResult<Option<Ino>> {
        let key = schema::answered(&self.node, request.slot());
        let found = self.read(|txn| Ok(txn.get(&key)?))?;
        let ours = request.record(0);
        Ok(found
            .filter(|v| v.len() == RECORD && v[..16] == ours[..16])
            .map(|v| Ino::from_be_bytes(v[16..24].try_into().expect("8 bytes"))))
    }
}
