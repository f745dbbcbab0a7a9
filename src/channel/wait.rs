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

/// The collector moved to `crate::sync`, shared with the bulkhead and the pacer.
pub(crate) use crate::sync::Deferred;

/// Where a waiting future stands: `id` is its place in a wait queue; for a receiver,
/// `stream` says which of the two receiver queues that place is in.
#[derive(Debug, Default)]
pub(crate) struct Waiting {
    pub(super) id: Option<u64>,
    /// A receiver's queue: the stream waiters (`true`) or the future waiters. Meaningful
    /// only while `id` is set; senders and close waiters leave it `false`.
    pub(super) stream: bool,
}

impl Waiting {
    #[inline]
    pub(crate) fn is_waiting(&self) -> bool {
        self.id.is_some()
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

    /// Whether no task is waiting.
    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.entries.is_empty()
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
        if let Some(id) = waiting.id.take() {
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
}
