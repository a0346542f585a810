//! The rule that no in-memory lock is held across a KV transaction, a peer
//! call or an object-store call (the lock order in `fs/src/core/mod.rs`),
//! checked the way lockdep checks the kernel's: a [`Mutex`] of this module
//! counts itself held per thread while its guard lives, and
//! [`assert_none_held`], called where a transaction, a peer call or an
//! object-store call starts, panics naming the call when the count is not
//! zero. Debug and test builds only: a release build counts nothing.
//!
//! Locks that are gates (held on purpose across such a call, a promise
//! rather than a lock) stay plain `parking_lot` locks and say so where
//! they are declared.

use std::cell::Cell;
use std::ops::{Deref, DerefMut};
use std::time::{Duration, Instant};

thread_local! {
    static HELD: Cell<u32> = const { Cell::new(0) };
}

fn count(taken: bool) {
    if cfg!(debug_assertions) {
        HELD.with(|h| h.set(if taken { h.get() + 1 } else { h.get().saturating_sub(1) }));
    }
}

/// Counted locks this thread holds now (always 0 in a release build).
pub fn held() -> u32 {
    HELD.with(Cell::get)
}

/// Panic (debug and test builds) if this thread holds a counted lock:
/// `what` is about to wait for a KV engine, a peer or an object store.
#[track_caller]
pub fn assert_none_held(what: &str) {
    if cfg!(debug_assertions) {
        let n = held();
        assert!(n == 0, "{what} started while this thread holds {n} in-memory lock(s): the lock order forbids it");
    }
}

/// A `parking_lot` mutex that counts itself held (see the module).
#[derive(Default)]
pub struct Mutex<T>(parking_lot::Mutex<T>);

/// The guard of a [`Mutex`]; the count goes down when it is dropped.
pub struct MutexGuard<'a, T>(parking_lot::MutexGuard<'a, T>);

impl<T> Mutex<T> {
    pub const fn new(value: T) -> Self {
        Mutex(parking_lot::const_mutex(value))
    }

    pub fn lock(&self) -> MutexGuard<'_, T> {
        let guard = self.0.lock();
        count(true);
        MutexGuard(guard)
    }

    pub fn get_mut(&mut self) -> &mut T {
        self.0.get_mut()
    }

    pub fn into_inner(self) -> T {
        self.0.into_inner()
    }
}

impl<T> MutexGuard<'_, T> {
    /// Wait on `cv`, the lock released meanwhile (the thread blocks: it
    /// calls nothing while it waits).
    pub fn wait(&mut self, cv: &parking_lot::Condvar) {
        cv.wait(&mut self.0);
    }

    /// [`MutexGuard::wait`], at most `timeout`. True when it timed out.
    pub fn wait_for(&mut self, cv: &parking_lot::Condvar, timeout: Duration) -> bool {
        cv.wait_for(&mut self.0, timeout).timed_out()
    }

    /// [`MutexGuard::wait`], at most until `deadline`. True when it timed out.
    pub fn wait_until(&mut self, cv: &parking_lot::Condvar, deadline: Instant) -> bool {
        cv.wait_until(&mut self.0, deadline).timed_out()
    }
}

impl<T> Drop for MutexGuard<'_, T> {
    fn drop(&mut self) {
        count(false);
    }
}

impl<T> Deref for MutexGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T> DerefMut for MutexGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guards_count_themselves_while_they_live() {
        let a = Mutex::new(1);
        let b = Mutex::new(2);
        assert_none_held("nothing");
        {
            let _ga = a.lock();
            let _gb = b.lock();
            if cfg!(debug_assertions) {
                assert_eq!(held(), 2);
            }
        }
        assert_eq!(held(), 0);
        assert_none_held("after the guards dropped");
    }

    #[test]
    #[cfg_attr(debug_assertions, should_panic(expected = "a KV transaction started while this thread holds 1"))]
    fn a_call_with_a_lock_held_panics() {
        let a = Mutex::new(());
        let _g = a.lock();
        assert_none_held("a KV transaction");
    }
}
