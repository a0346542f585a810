//! Group commit: commits from this node's threads that meet while one is in
//! flight share the next transaction.
//!
//! A commit that finds none in flight goes out at once, alone: a single
//! thread pays nothing for this. Commits that arrive meanwhile queue; when
//! the one in flight is answered, the first of them leads the next
//! transaction, taking along every queued commit that cannot interfere with
//! it (no key one writes is read or written by another, ranges included),
//! up to the engine's limits on compares, operations and request bytes.
//! One transaction is one raft entry and one WAL sync in etcd instead of one
//! per commit, which is where 16 processes creating files on one node spend
//! their time.
//!
//! A shared transaction compares everything each of its commits read, so it
//! commits only when each of them alone would have. When one compare fails
//! the whole transaction fails and nobody knows whose it was: each commit
//! then goes again alone, and gets its own answer (a conflict, or done).
//!
//! Each commit gets the whole transaction's answer and where its own
//! operations start in it, so a commit that asked for what a range delete
//! removed (an unlink's purge) finds its records there and may share a
//! transaction too.
//!
//! Locks: the queue (`Group::queue`), then a commit's `Slot::state`, in that
//! order, each held only to change a few fields; neither is held while a
//! transaction is sent, and no transaction is sent while a caller holds an
//! in-memory lock of its own (commits happen after the transaction's
//! closure returned, see `Namespace::write`).

use std::collections::VecDeque;
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};

use crate::error::KvError;
use crate::kv::KvResult;

/// Keys a commit read or writes: one key (`end` none) or the range
/// `[start, end)`.
#[derive(Debug, Clone)]
pub(crate) struct Span {
    pub start: Vec<u8>,
    pub end: Option<Vec<u8>>,
}

impl Span {
    pub fn key(k: &[u8]) -> Self {
        Span { start: k.to_vec(), end: None }
    }

    pub fn range(start: &[u8], end: &[u8]) -> Self {
        Span { start: start.to_vec(), end: Some(end.to_vec()) }
    }

    fn overlaps(&self, other: &Span) -> bool {
        match (&self.end, &other.end) {
            (None, None) => self.start == other.start,
            (None, Some(e)) => other.start <= self.start && self.start < *e,
            (Some(e), None) => self.start <= other.start && other.start < *e,
            (Some(a), Some(b)) => self.start < *b && other.start < *a,
        }
    }
}

/// One commit: what its transaction compares and applies, and the keys it
/// read and writes, which decide whom it may share a transaction with.
pub(crate) struct Member<C, O> {
    pub compares: Vec<C>,
    pub ops: Vec<O>,
    /// Request bytes, about: keys and values.
    pub bytes: usize,
    pub reads: Vec<Span>,
    pub writes: Vec<Span>,
}

impl<C, O> Member<C, O> {
    /// No key `self` writes is read or written by `other`, and the other way
    /// round: the two commit together exactly as they would one after the other.
    fn independent_of(&self, other: &Member<C, O>) -> bool {
        let touches = |writes: &[Span], m: &Member<C, O>| {
            writes.iter().any(|w| m.reads.iter().chain(&m.writes).any(|s| w.overlaps(s)))
        };
        !touches(&self.writes, other) && !touches(&other.writes, self)
    }
}

/// What one transaction may hold: etcd's `--max-txn-ops` (which bounds the
/// compares and the operations each) and a request size under its 1.5 MiB
/// default.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub ops: usize,
    pub bytes: usize,
    /// Commits sharing one transaction at most.
    pub members: usize,
}

/// The answer a sent transaction got: whether its compares held, the
/// revision it committed at, and the engine's response (`R`).
pub(crate) type Sent<R> = KvResult<(bool, Option<i64>, R)>;

/// A commit's outcome: the revision, the response of the transaction it
/// went out in, and the index of its own first operation in that response.
pub(crate) struct Committed<R> {
    pub revision: Option<i64>,
    pub answer: Arc<R>,
    pub first_op: usize,
}

enum State<R> {
    Queued,
    /// This commit's thread leads the next transaction.
    Lead,
    Done(Outcome<R>),
}

enum Outcome<R> {
    Committed(Committed<R>),
    /// Alone, its compares failed.
    Conflict,
    /// Shared, some compare failed: go again alone.
    Alone,
    Failed(KvError),
}

struct Slot<C, O, R> {
    member: Mutex<Option<Member<C, O>>>,
    state: Mutex<State<R>>,
    changed: Condvar,
}

impl<C, O, R> Slot<C, O, R> {
    fn set(&self, s: State<R>) {
        *self.state.lock() = s;
        self.changed.notify_one();
    }
}

struct Queue<C, O, R> {
    /// A transaction is being formed or is in flight.
    busy: bool,
    waiting: VecDeque<Arc<Slot<C, O, R>>>,
}

pub(crate) struct Group<C, O, R> {
    queue: Mutex<Queue<C, O, R>>,
    limits: Limits,
}

fn copy_of(e: &KvError) -> KvError {
    match e {
        KvError::Conflict => KvError::Conflict,
        KvError::NoSpace => KvError::NoSpace,
        KvError::Backend { msg, retryable } => KvError::Backend { msg: msg.clone(), retryable: *retryable },
    }
}

impl<C: Clone, O: Clone, R> Group<C, O, R> {
    pub fn new(limits: Limits) -> Self {
        Group { queue: Mutex::new(Queue { busy: false, waiting: VecDeque::new() }), limits }
    }

    /// Commit `m`, in a transaction of its own or shared; `send` sends one
    /// transaction. `Err(Conflict)` when what `m` read changed.
    pub fn commit(&self, m: Member<C, O>, send: &dyn Fn(Vec<C>, Vec<O>) -> Sent<R>) -> KvResult<Committed<R>> {
        let alone = (m.compares.clone(), m.ops.clone());
        let slot =
            Arc::new(Slot { member: Mutex::new(Some(m)), state: Mutex::new(State::Queued), changed: Condvar::new() });
        {
            let mut q = self.queue.lock();
            if q.busy {
                q.waiting.push_back(slot.clone());
            } else {
                q.busy = true;
                *slot.state.lock() = State::Lead;
            }
        }
        loop {
            let lead = {
                let mut st = slot.state.lock();
                while matches!(*st, State::Queued) {
                    slot.changed.wait(&mut st);
                }
                match std::mem::replace(&mut *st, State::Queued) {
                    State::Lead => true,
                    State::Done(o) => {
                        return match o {
                            Outcome::Committed(c) => Ok(c),
                            Outcome::Conflict => Err(KvError::Conflict),
                            Outcome::Failed(e) => Err(e),
                            Outcome::Alone => match send(alone.0, alone.1)? {
                                (true, revision, answer) => {
                                    Ok(Committed { revision, answer: Arc::new(answer), first_op: 0 })
                                }
                                (false, ..) => Err(KvError::Conflict),
                            },
                        };
                    }
                    State::Queued => unreachable!("waited while queued"),
                }
            };
            if lead {
                self.lead(&slot, send);
            }
        }
    }

    /// Form the next transaction around `me`, send it, give every commit in
    /// it its outcome, and hand the lead to the first commit still queued.
    fn lead(&self, me: &Arc<Slot<C, O, R>>, send: &dyn Fn(Vec<C>, Vec<O>) -> Sent<R>) {
        let mut batch = vec![me.clone()];
        let mut members = vec![me.member.lock().take().expect("a commit leads once")];
        {
            let mut q = self.queue.lock();
            q.waiting.retain(|s| !Arc::ptr_eq(s, me));
            let (mut compares, mut ops, mut bytes) =
                (members[0].compares.len(), members[0].ops.len(), members[0].bytes);
            let mut i = 0;
            while i < q.waiting.len() && members.len() < self.limits.members {
                let take = {
                    let guard = q.waiting[i].member.lock();
                    let m = guard.as_ref().expect("a queued commit has its member");
                    let fits = compares + m.compares.len() <= self.limits.ops
                        && ops + m.ops.len() <= self.limits.ops
                        && bytes + m.bytes <= self.limits.bytes;
                    if fits && members.iter().all(|b| b.independent_of(m)) {
                        (compares, ops, bytes) = (compares + m.compares.len(), ops + m.ops.len(), bytes + m.bytes);
                        true
                    } else {
                        false
                    }
                };
                if take {
                    let s = q.waiting.remove(i).expect("index checked");
                    members.push(s.member.lock().take().expect("a queued commit has its member"));
                    batch.push(s);
                } else {
                    i += 1;
                }
            }
        }
        let shared = batch.len() > 1;
        let (mut compares, mut ops, mut first_ops) = (Vec::new(), Vec::new(), Vec::with_capacity(members.len()));
        for m in members {
            first_ops.push(ops.len());
            compares.extend(m.compares);
            ops.extend(m.ops);
        }
        let answer = send(compares, ops).map(|(held, revision, r)| (held, revision, Arc::new(r)));
        for (s, first_op) in batch.iter().zip(first_ops) {
            s.set(State::Done(match &answer {
                Ok((true, revision, answer)) => {
                    Outcome::Committed(Committed { revision: *revision, answer: answer.clone(), first_op })
                }
                Ok((false, ..)) if shared => Outcome::Alone,
                Ok((false, ..)) => Outcome::Conflict,
                Err(e) => Outcome::Failed(copy_of(e)),
            }));
        }
        let mut q = self.queue.lock();
        match q.waiting.front() {
            Some(next) => next.set(State::Lead),
            None => q.busy = false,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// A store of counters: a compare is (key, expected value), an op
    /// (key, new value). Sending applies the ops when every compare holds,
    /// and answers each op with the value it replaced.
    type Store = Mutex<HashMap<String, u64>>;

    fn send(
        store: &Store,
        sends: &AtomicUsize,
        compares: Vec<(String, u64)>,
        ops: Vec<(String, u64)>,
    ) -> Sent<Vec<u64>> {
        sends.fetch_add(1, Ordering::SeqCst);
        std::thread::sleep(std::time::Duration::from_millis(2));
        let mut s = store.lock();
        if compares.iter().any(|(k, v)| s.get(k).copied().unwrap_or(0) != *v) {
            return Ok((false, None, Vec::new()));
        }
        let replaced = ops.into_iter().map(|(k, v)| s.insert(k, v).unwrap_or(0)).collect();
        Ok((true, Some(1), replaced))
    }

    fn increment(group: &Group<(String, u64), (String, u64), Vec<u64>>, store: &Store, sends: &AtomicUsize, key: &str) {
        loop {
            let seen = store.lock().get(key).copied().unwrap_or(0);
            let m = Member {
                compares: vec![(key.to_string(), seen)],
                ops: vec![(key.to_string(), seen + 1)],
                bytes: 16,
                reads: vec![Span::key(key.as_bytes())],
                writes: vec![Span::key(key.as_bytes())],
            };
            match group.commit(m, &|c, o| send(store, sends, c, o)) {
                Ok(done) => {
                    // Its own op's answer, wherever the commit sat in the
                    // transaction: the value it replaced is the one it read.
                    assert_eq!(done.answer[done.first_op], seen, "{key}: another commit's answer");
                    return;
                }
                Err(KvError::Conflict) => continue,
                Err(e) => panic!("{e}"),
            }
        }
    }

    /// `threads` threads each incrementing the key `key(thread)` `times`
    /// times through one group; returns the store and how many
    /// transactions went out.
    fn increments(threads: usize, times: usize, key: impl Fn(usize) -> String + Sync) -> (Store, usize) {
        let group = Group::new(Limits { ops: 128, bytes: 1 << 20, members: 64 });
        let (store, sends) = (Store::default(), AtomicUsize::new(0));
        std::thread::scope(|s| {
            for t in 0..threads {
                let (group, store, sends, key) = (&group, &store, &sends, &key);
                s.spawn(move || {
                    for _ in 0..times {
                        increment(group, store, sends, &key(t));
                    }
                });
            }
        });
        (store, sends.into_inner())
    }

    #[test]
    fn commits_that_meet_share_transactions_and_none_is_lost() {
        // Each thread its own key: independent, so shared.
        let (store, sent) = increments(16, 50, |t| format!("k{t}"));
        let s = store.lock();
        assert!((0..16).all(|t| s[&format!("k{t}")] == 50), "every increment landed once: {s:?}");
        assert!(sent < 800, "800 commits went out in {sent} transactions: none shared");
    }

    #[test]
    fn commits_on_one_key_never_share_and_never_lose_an_update() {
        let (store, _) = increments(8, 25, |_| "one".to_string());
        assert_eq!(store.lock()["one"], 200);
    }

    #[test]
    fn spans_overlap_as_keys_and_ranges_do() {
        let k = |s: &str| Span::key(s.as_bytes());
        let r = |a: &str, b: &str| Span::range(a.as_bytes(), b.as_bytes());
        assert!(k("a").overlaps(&k("a")));
        assert!(!k("a").overlaps(&k("b")));
        assert!(k("b").overlaps(&r("a", "c")) && r("a", "c").overlaps(&k("b")));
        assert!(!k("c").overlaps(&r("a", "c")));
        assert!(r("a", "c").overlaps(&r("b", "d")));
        assert!(!r("a", "b").overlaps(&r("b", "c")));
    }
}
