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
//! A node's records are a ring of [`ANSWERED_SLOTS`] keys (`j`), the slot
//! chosen by the request's id, so they need no cleaning: a record is
//! overwritten `ANSWERED_SLOTS` requests later, long after its request was
//! answered (a change is answered as soon as it commits). The ring is the
//! node's: a connection belongs to one node. Its keys sort past the range
//! the change feed watches: every change writes one, and no other node
//! reads it, so watching it would cost etcd and every node an event per
//! change for nothing.
//!
//! A change's commit can also land without its answer reaching the daemon
//! (its connection to etcd reset after the request went out): the
//! namespace layer then makes the transaction again. Made again, a create
//! would fail with EEXIST, an unlink with ENOENT, and a RENAME_EXCHANGE
//! would swap the two names back. So a transaction made again for a
//! request first reads the request's record, in the same transaction
//! (compared at its commit like any read; under `--nowsync` a change only
//! queued here reads the node's own queue, which no other node writes),
//! and ends with [`MetaError::AlreadyMade`] when the change is there
//! ([`Namespace::write_answering`]); for a request the kernel sent once,
//! whose change only this daemon's attempts can make, `Namespace::write`
//! then answers with what the attempt that landed returned. The first
//! attempt of such a request does not read the record: the request is new.

use crate::error::{MetaError, MetaResult};
use crate::kv::{Durability, KvError, KvRead, KvWrite};
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
    /// made or named. Asked once: after a change that etcd stopped
    /// answering, it does not add a second wait to the one that change
    /// waited out (`--meta-op-wait`); unanswered, the change's error stands.
    pub fn answered(&self, request: RequestMark) -> MetaResult<Option<Ino>> {
        self.read_once(|txn| self.record_in(txn, request))
    }

    /// The request's record, in its slot of the ring, or of the ring as a
    /// daemon of a volume made before kept it (`J`: a request that daemon
    /// committed and the kernel sends to this one). Both slots are read
    /// in one batch; only a change made again reads them.
    fn record_in(&self, txn: &mut (impl KvRead + ?Sized), request: RequestMark) -> MetaResult<Option<Ino>> {
        let keys = [schema::answered(&self.node, request.slot()), schema::answered_before(&self.node, request.slot())];
        let found = txn.get_many_versioned(&keys)?;
        let ours = request.record(0);
        Ok(found
            .into_iter()
            .filter_map(|(v, _)| v)
            .find(|v| v.len() == RECORD && v[..16] == ours[..16])
            .map(|v| Ino::from_be_bytes(v[16..24].try_into().expect("8 bytes"))))
    }

    /// [`Namespace::write`] for a change made for `request` (which `f`
    /// records with [`Namespace::answering`]): an attempt after the first,
    /// or the first of a request the kernel sent again, reads the request's
    /// record before `f` and fails with [`MetaError::AlreadyMade`] when the
    /// change committed already.
    pub(crate) fn write_answering<T>(
        &self,
        durability: Durability,
        request: Option<RequestMark>,
        f: impl FnMut(&mut dyn KvWrite) -> MetaResult<T>,
    ) -> MetaResult<T> {
        self.write_answering_noting(durability, request, None, f)
    }

    /// [`Namespace::write_answering`], setting `unanswered` when the value
    /// returned is that of an attempt whose commit landed and whose answer
    /// was lost (see [`Namespace::write_owning`]).
    pub(crate) fn write_answering_noting<T>(
        &self,
        durability: Durability,
        request: Option<RequestMark>,
        unanswered: Option<&std::cell::Cell<bool>>,
        mut f: impl FnMut(&mut dyn KvWrite) -> MetaResult<T>,
    ) -> MetaResult<T> {
        let Some(request) = request else { return self.write_owning(durability, true, unanswered, f) };
        let (mut look, mut looked_again, mut attempts) = (request.resent, false, 0);
        self.write_owning(durability, !request.resent, unanswered, |txn| {
            attempts += 1;
            let looked = look;
            if look {
                if let Some(ino) = self.record_in(txn, request)? {
                    return Err(MetaError::AlreadyMade { ino });
                }
            }
            look = true;
            let made = f(txn);
            match made {
                // An answer `f` gave from what it read (EEXIST for a
                // create, ENOENT for an unlink) after the record was read
                // without the change: the change may have landed in
                // between (its commit was still on its way when this
                // attempt began), and the node's cache, which the change
                // feed keeps, shows it to `f` while the record's read, at
                // the transaction's first revision, did not. An error
                // commits nothing, so no compare catches the stale read of
                // the record: once per call, such an answer becomes a
                // conflict, and the next attempt reads the record again at
                // a fresh revision. (Not on the last attempt: the answer
                // stands there.)
                Err(ref e)
                    if looked && !looked_again && attempts < crate::namespace::MAX_ATTEMPTS && e.read_from_state() =>
                {
                    looked_again = true;
                    Err(MetaError::Kv(KvError::Conflict))
                }
                made => made,
            }
        })
    }
}
