//! Round trips to a remote metadata engine (etcd), counted so that a figure
//! can say why an operation took the time it did.
//!
//! Each request is counted twice: in a per-process total by kind, and on
//! the calling thread, so the daemon can charge the round trips a FUSE
//! request caused to that request (the engine's calls block the thread that
//! makes them). Embedded engines make no round trips and count nothing.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

/// What a request to the engine was for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RoundTrip {
    /// A read (get or range) outside a commit.
    Read,
    /// A transaction commit (compares and writes).
    Commit,
    /// A lease grant, keep-alive or revoke, and the membership records with it.
    Lease,
}

impl RoundTrip {
    pub const ALL: [RoundTrip; 3] = [RoundTrip::Read, RoundTrip::Commit, RoundTrip::Lease];

    pub fn name(self) -> &'static str {
        match self {
            RoundTrip::Read => "read",
            RoundTrip::Commit => "commit",
            RoundTrip::Lease => "lease",
        }
    }

    fn slot(self) -> usize {
        match self {
            RoundTrip::Read => 0,
            RoundTrip::Commit => 1,
            RoundTrip::Lease => 2,
        }
    }
}

static TOTALS: [AtomicU64; 3] = [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)];

thread_local! {
    static ON_THREAD: Cell<u64> = const { Cell::new(0) };
}

/// Count one request of `kind`, made by the calling thread.
pub(crate) fn count(kind: RoundTrip) {
    TOTALS[kind.slot()].fetch_add(1, Ordering::Relaxed);
    ON_THREAD.with(|c| c.set(c.get() + 1));
}

/// Requests the calling thread has made so far (of every kind): the
/// difference across a call is what that call cost.
pub fn on_this_thread() -> u64 {
    ON_THREAD.with(Cell::get)
}

/// Requests of `kind` this process has made so far.
pub fn total(kind: RoundTrip) -> u64 {
    TOTALS[kind.slot()].load(Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_sees_its_own_requests_only() {
        let before = on_this_thread();
        let total_before = total(RoundTrip::Commit);
        count(RoundTrip::Commit);
        count(RoundTrip::Commit);
        std::thread::spawn(|| count(RoundTrip::Commit)).join().unwrap();
        assert_eq!(on_this_thread() - before, 2);
        assert!(total(RoundTrip::Commit) - total_before >= 3);
    }
}
