//! What changed in the cluster's control-plane records (members, admin
//! states, rebalance, gc and rescan requests), as the change feed reports
//! it, so that a node reads those records again when they moved instead of
//! on a timer: an idle node asks etcd nothing but its lease keepalives and
//! a slow safety read.
//!
//! Each kind of record ([`Control`]) has a generation the feed moves. A
//! reader keeps a [`Since`] per set of kinds it acts on and asks
//! [`ControlChanges::due`] whether to read again: when a generation moved
//! (and once more a second later, since the read may reach an etcd member
//! a little behind the one that sent the event), when the safety interval
//! passed, and always while no feed is attached (an engine without a
//! watch, or in-process tests): then readers poll as they did.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use converged_metadata::schema::{change_of, Change, Control};

/// How often a reader reads again with no change heard, before jitter.
pub const SAFETY_READ: Duration = Duration::from_secs(120);
/// How soon after a change it reads once more.
const SETTLE: Duration = Duration::from_secs(1);

/// `every`, give or take a tenth at random: nodes mounted together spread
/// their periodic work out.
pub fn jittered(every: Duration) -> Duration {
    use std::hash::{BuildHasher, Hasher};
    let random = std::collections::hash_map::RandomState::new().build_hasher().finish();
    every.mul_f64(0.9 + 0.2 * (random % 1000) as f64 / 1000.0)
}

/// Generations of the control-plane records, moved by the change feed.
#[derive(Default)]
pub struct ControlChanges {
    generations: [AtomicU64; Control::ALL.len()],
    watched: AtomicBool,
}

/// A reader's view of some kinds of records: what it last read at.
pub struct Since {
    what: &'static [Control],
    generation: u64,
    read: Option<Instant>,
    again: Option<Instant>,
    every: Duration,
}

impl Since {
    /// A reader of `what`, due at once.
    pub fn new(what: &'static [Control]) -> Self {
        Since { what, generation: 0, read: None, again: None, every: jittered(SAFETY_READ) }
    }

    /// The read failed: due again at the next question.
    pub fn retry(&mut self) {
        self.read = None;
    }
}

impl ControlChanges {
    /// A change feed subscriber that moves the generations.
    pub fn feed(self: &Arc<Self>) -> converged_metadata::ChangeFeed {
        let this = self.clone();
        Arc::new(move |key: &[u8], _: Option<&[u8]>| match change_of(key) {
            Change::Control(c) => this.moved(c),
            Change::Everything => Control::ALL.iter().for_each(|c| this.moved(*c)),
            _ => {}
        })
    }

    /// The feed is attached: readers may rely on it.
    pub fn watching(&self) {
        self.watched.store(true, Ordering::Release);
    }

    /// Whether the feed is attached.
    pub fn is_watched(&self) -> bool {
        self.watched.load(Ordering::Acquire)
    }

    /// Records of kind `c` changed (also for this node's own writes, which
    /// the feed does not report).
    pub fn moved(&self, c: Control) {
        self.generations[c as usize].fetch_add(1, Ordering::AcqRel);
    }

    fn generation(&self, what: &[Control]) -> u64 {
        what.iter().map(|c| self.generations[*c as usize].load(Ordering::Acquire)).sum()
    }

    /// Whether the reader should read its records now; if so, the read is
    /// counted as done now (a change heard during it makes it due again).
    pub fn due(&self, since: &mut Since) -> bool {
        let now = Instant::now();
        let generation = self.generation(since.what);
        let moved = generation != since.generation;
        let due = !self.watched.load(Ordering::Acquire)
            || moved
            || since.read.is_none_or(|t| now.duration_since(t) >= since.every)
            || since.again.is_some_and(|t| now >= t);
        if due {
            since.generation = generation;
            since.read = Some(now);
            since.again = moved.then_some(now + SETTLE);
        }
        due
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MEMBERS: &[Control] = &[Control::Members, Control::Admin];

    #[test]
    fn without_a_feed_every_read_is_due() {
        let c = ControlChanges::default();
        let mut s = Since::new(MEMBERS);
        assert!(c.due(&mut s));
        assert!(c.due(&mut s));
    }

    #[test]
    fn with_a_feed_reads_follow_changes_of_their_kinds() {
        let c = Arc::new(ControlChanges::default());
        c.watching();
        let feed = c.feed();
        let mut s = Since::new(MEMBERS);
        assert!(c.due(&mut s), "the first read is due");
        assert!(!c.due(&mut s), "nothing changed");
        feed(&converged_metadata::schema::gc_done("n2"), None);
        feed(&converged_metadata::schema::inode(7), None);
        assert!(!c.due(&mut s), "changes of other kinds");
        feed(&converged_metadata::schema::live_node("n2"), None);
        assert!(c.due(&mut s), "a member changed");
        assert!(!c.due(&mut s), "read since");
        s.again = Some(Instant::now());
        assert!(c.due(&mut s), "read once more after a change");
        assert!(!c.due(&mut s));
        feed(b"", None);
        assert!(c.due(&mut s), "the feed restarted");
        s.again = None;
        s.read = Some(Instant::now() - SAFETY_READ * 2);
        assert!(c.due(&mut s), "the safety read");
    }
}
