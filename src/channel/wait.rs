//! Wait queues, and the user code (wakers) collected under the channel lock to run after it.
//!
//! A `Waker` is user code twice over: `wake` and `drop` both run the waker's vtable, which
//! may do anything, including touching this channel again (a waker that owns a permit or a
//! sender releases or sends when it is dropped). So nothing here wakes or drops a waker: the
//! queues move every waker they give up (woken, replaced or removed) into a [`Deferred`],
//! which wakes and drops them when it is dropped, after the lock is released.
//!
//! Cloning a waker still happens under the lock (as in tokio's `Notify` and semaphore), and
//! only when the waker is not already stored (`will_wake`).

use std::collections::VecDeque;
use std::task::Waker;

/// Where a waiting future stands; the id is its place in a wait queue.
#[derive(Debug, Default)]
pub(crate) struct Waiting(pub(super) Option<u64>);

impl Waiting {
    #[inline]
    pub(crate) fn is_waiting(&self) -> bool {
        self.0.is_some()
    }
}

/// Wakers collected under the lock: woken or dropped when this is dropped.
///
/// Declare it *before* taking the lock (`let mut out = Deferred::default();` then
/// `let mut st = self.lock();`): locals are dropped in reverse order, so the guard is
/// released first on every path, early returns included.
#[derive(Default)]
pub(crate) struct Deferred {
    /// The first waker to wake: most operations wake at most one, without allocating.
    wake: Option<Waker>,
    /// Further wakers: to wake (`true`), or only to drop (`false`: replaced or removed from
    /// a queue). Rare, so one vector.
    more: Vec<(Waker, bool)>,
}

impl Deferred {
    #[inline]
    pub(crate) fn wake(&mut self, waker: Waker) {
        match self.wake {
            None => self.wake = Some(waker),
            Some(_) => self.more.push((waker, true)),
        }
    }

    #[inline]
    pub(crate) fn wake_opt(&mut self, waker: Option<Waker>) {
        if let Some(w) = waker {
            self.wake(w);
        }
    }

    #[inline]
    fn discard(&mut self, waker: Waker) {
        self.more.push((waker, false));
    }
}

impl Drop for Deferred {
    #[inline]
    fn drop(&mut self) {
        if let Some(w) = self.wake.take() {
            w.wake();
        }
        if !self.more.is_empty() {
            for (w, wake) in self.more.drain(..) {
                if wake {
                    w.wake();
                }
            }
        }
    }
}

/// Tasks waiting for something, FIFO, each known by the id its future holds.
#[derive(Default)]
pub(crate) struct WaitQueue {
    entries: VecDeque<(u64, Waker)>,
}

impl WaitQueue {
    /// Add `id`, or refresh its waker if it is already waiting (the old one goes to `out`).
    #[inline]
    pub(crate) fn register(&mut self, id: u64, waker: &Waker, out: &mut Deferred) {
        match self.entries.iter_mut().find(|(i, _)| *i == id) {
            Some((_, w)) if w.will_wake(waker) => {}
            Some((_, w)) => out.discard(std::mem::replace(w, waker.clone())),
            None => self.entries.push_back((id, waker.clone())),
        }
    }

    /// Remove `id` (its waker goes to `out`); false if it was not waiting (it was woken, or
    /// never registered).
    #[inline]
    pub(crate) fn remove(&mut self, id: u64, out: &mut Deferred) -> bool {
        match self.entries.iter().position(|(i, _)| *i == id) {
            Some(at) => {
                if let Some((_, w)) = self.entries.remove(at) {
                    out.discard(w);
                }
                true
            }
            None => false,
        }
    }

    #[inline]
    pub(crate) fn pop(&mut self) -> Option<(u64, Waker)> {
        self.entries.pop_front()
    }

    /// Wake the first waiter, if any.
    #[inline]
    pub(crate) fn wake_one(&mut self, out: &mut Deferred) {
        out.wake_opt(self.pop().map(|(_, w)| w));
    }

    /// Stop waiting, if `waiting` is registered.
    #[inline]
    pub(crate) fn leave(&mut self, waiting: &mut Waiting, out: &mut Deferred) {
        if let Some(id) = waiting.0.take() {
            self.remove(id, out);
        }
    }

    /// Wake every waiter.
    #[inline]
    pub(crate) fn wake_all(&mut self, out: &mut Deferred) {
        while let Some((_, w)) = self.entries.pop_front() {
            out.wake(w);
        }
    }

    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}
