//! Directory handles open on this node, and the listing each holds (a
//! snapshot of the entries, so that offsets stay stable while the
//! directory changes underneath a reader). A directory removed (rmdir, or
//! a rename over it) while a handle is open stays an orphan, as a file
//! does, and answers fstat until its last handle is released; then it is
//! purged.
//!
//! The slot of a directory is `Open` while handles are open, or `Held` by
//! the one caller deciding to purge it (a removal, or the last release of an
//! orphan): an opendir meanwhile waits on the slot's gate, so no handle is
//! opened on a directory whose records are being dropped. No lock is held
//! across a metadata transaction: `Held` is a state, and the DashMap shard
//! lock is taken only to change it.

use std::sync::Arc;

use converged_metadata::types::Ino;
use dashmap::DashMap;

use super::open::Gate;

enum Slot {
    Open { handles: u32, orphaned: bool },
    Held(Arc<Gate>),
}

#[derive(Default)]
pub(super) struct OpenDirs {
    slots: DashMap<Ino, Slot>,
    handles: DashMap<u64, Ino>,
    /// The listing each handle took at its last read from offset 0.
    listings: DashMap<u64, super::Listing>,
}

/// A directory no handle is open on, held so: opendirs of it wait until
/// this is dropped.
pub(super) struct HeldDir<'a> {
    dirs: &'a OpenDirs,
    pub ino: Ino,
    gate: Arc<Gate>,
}

impl Drop for HeldDir<'_> {
    fn drop(&mut self) {
        self.dirs.slots.remove_if(&self.ino, |_, s| matches!(s, Slot::Held(g) if Arc::ptr_eq(g, &self.gate)));
        self.gate.release();
    }
}

impl OpenDirs {
    /// Count handle `fh` open on `ino` (waiting while it is held).
    pub fn open(&self, ino: Ino, fh: u64) {
        loop {
            let gate = match self.slots.entry(ino) {
                dashmap::Entry::Vacant(v) => {
                    v.insert(Slot::Open { handles: 1, orphaned: false });
                    break;
                }
                dashmap::Entry::Occupied(mut o) => match o.get_mut() {
                    Slot::Open { handles, .. } => {
                        *handles += 1;
                        break;
                    }
                    Slot::Held(g) => g.clone(),
                },
            };
            gate.wait();
        }
        self.handles.insert(fh, ino);
    }

    /// The listing handle `fh` holds, if it took one.
    pub fn listing(&self, fh: u64) -> Option<super::Listing> {
        self.listings.get(&fh).map(|l| l.clone())
    }

    /// Handle `fh` holds `listing` from now on.
    pub fn keep_listing(&self, fh: u64, listing: super::Listing) {
        self.listings.insert(fh, listing);
    }

    /// Every directory handle open here now.
    pub fn handle_ids(&self) -> Vec<u64> {
        self.handles.iter().map(|h| *h.key()).collect()
    }

    /// Release handle `fh` and its listing. The last handle of an orphan
    /// hands back the directory held, for the caller to purge.
    pub fn close(&self, fh: u64) -> Option<HeldDir<'_>> {
        self.listings.remove(&fh);
        let (_, ino) = self.handles.remove(&fh)?;
        let dashmap::Entry::Occupied(mut o) = self.slots.entry(ino) else { return None };
        let Slot::Open { handles, orphaned } = o.get_mut() else { return None };
        *handles -= 1;
        match (*handles, *orphaned) {
            (0, true) => {
                let gate = Arc::new(Gate::default());
                o.insert(Slot::Held(gate.clone()));
                Some(HeldDir { dirs: self, ino, gate })
            }
            (0, false) => {
                o.remove();
                None
            }
            _ => None,
        }
    }

    /// Hold `ino` if no handle is open on it (waiting while another holds
    /// it); `None` while handles are open. With `orphaned`, open handles
    /// are told the directory is gone, so the last of them hands it back.
    fn claim(&self, ino: Ino, orphaned: bool) -> Option<HeldDir<'_>> {
        loop {
            let gate = match self.slots.entry(ino) {
                dashmap::Entry::Vacant(v) => {
                    let gate = Arc::new(Gate::default());
                    v.insert(Slot::Held(gate.clone()));
                    return Some(HeldDir { dirs: self, ino, gate });
                }
                dashmap::Entry::Occupied(mut o) => match o.get_mut() {
                    Slot::Open { orphaned: o, .. } => {
                        *o |= orphaned;
                        return None;
                    }
                    Slot::Held(g) => g.clone(),
                },
            };
            gate.wait();
        }
    }

    /// Before a removal: hold `ino` when nothing has it open, so the
    /// removal may purge it in its own transaction.
    pub fn claim_closed(&self, ino: Ino) -> Option<HeldDir<'_>> {
        self.claim(ino, false)
    }

    /// After a removal left `ino` an orphan: held back for the caller to
    /// purge when no handle is open, else marked for the last release.
    pub fn orphaned(&self, ino: Ino) -> Option<HeldDir<'_>> {
        self.claim(ino, true)
    }
}
