//! The channel's wait queues: the shared [`WaiterList`] (O(1) leave, by key), seen through
//! the few operations the channel needs; and the user code (wakers) collected under the
//! channel lock to run after it.
//!
//! A `Waker` is user code twice over: `wake` and `drop` both run the waker's vtable, which
//! may do anything, including touching this channel again (a waker that owns a permit or a
//! sender releases or sends when it is dropped). So nothing here wakes or drops a waker: the
//! queues move every waker they give up (woken, replaced or removed) into a [`Deferred`],
//! which wakes and drops them when it is dropped, after the lock is released.
//!
//! Cloning a waker still happens under the lock (as in tokio's `Notify` and semaphore), and
//! only when the waker is not already stored (see `WaiterList::refresh`).

use std::task::Waker;

/// The collector moved to `crate::sync`, shared with the bulkhead and the pacer.
use crate::sync::Deferred;
use crate::sync::{Cancelled, Key, WaiterList};

/// Where a waiting future stands: `key` is its entry in a wait queue; for a receiver,
/// `stream` says which of the two receiver queues that entry is in.
#[derive(Debug, Default)]
pub(crate) struct Waiting {
    key: Option<Key>,
    /// A receiver's queue: the stream waiters (`true`) or the future waiters. Meaningful
    /// only while `key` is set; senders and close waiters leave it `false`.
    pub(super) stream: bool,
}

impl Waiting {
    #[inline]
    pub(crate) fn is_waiting(&self) -> bool {
        self.key.is_some()
    }
}

/// Tasks waiting for something, FIFO. A sender's queue also holds *grants*: entries taken
/// out of the line and woken with a slot reserved in their name, until they claim it.
#[derive(Default)]
pub(crate) struct WaitQueue {
    list: WaiterList<()>,
}

impl WaitQueue {
    /// Join the back of the queue, or refresh the waker if already waiting (the old one goes
    /// to `out`). A granted entry stays granted.
    #[inline]
    pub(crate) fn register(&mut self, waiting: &mut Waiting, waker: &Waker, out: &mut Deferred) {
        self.list.register(&mut waiting.key, waker, || (), out);
    }

    /// Leave the queue whatever the entry's state; true if it was still waiting (not woken).
    /// A sender's grant not yet claimed is given up: see [`leave_granted`](Self::leave_granted).
    #[inline]
    pub(crate) fn leave(&mut self, waiting: &mut Waiting, out: &mut Deferred) -> bool {
        self.leave_granted(waiting, out) == Some(false)
    }

    /// Leave the queue: `Some(true)` if the entry had been granted and not claimed (what it
    /// was granted is the caller's to pass on), `Some(false)` if it was waiting, `None` if
    /// it was not in the queue (woken, or never registered).
    #[inline]
    pub(crate) fn leave_granted(
        &mut self,
        waiting: &mut Waiting,
        out: &mut Deferred,
    ) -> Option<bool> {
        match self.list.cancel(waiting.key.take()?, out) {
            Cancelled::Waiting(()) => Some(false),
            Cancelled::Granted(()) => Some(true),
            Cancelled::Gone => None,
        }
    }

    /// Whether no task is waiting (granted entries do not count).
    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// Grant the first waiter: out of the line, woken, holding its grant until it claims it.
    /// False if nobody waits.
    #[inline]
    pub(crate) fn grant_one(&mut self, out: &mut Deferred) -> bool {
        self.list.grant_front(out).is_some()
    }

    /// Claim a grant made to `waiting`: true (and it stops waiting) if it had one.
    #[inline]
    pub(crate) fn claim(&mut self, waiting: &mut Waiting) -> bool {
        let claimed = waiting.key.is_some_and(|k| self.list.claim(k).is_some());
        if claimed {
            waiting.key = None;
        }
        claimed
    }

    /// Grants made and not yet claimed (or given up).
    #[inline]
    pub(crate) fn granted(&self) -> usize {
        self.list.granted()
    }

    /// Wake the first waiter, if any.
    #[inline]
    pub(crate) fn wake_one(&mut self, out: &mut Deferred) {
        self.list.wake_front(out);
    }

    /// Wake every waiter (grants stay granted).
    #[inline]
    pub(crate) fn wake_all(&mut self, out: &mut Deferred) {
        self.list.wake_all(out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 20: a waiting send, reserve or receive that is dropped leaves its queue in
    /// O(1). 40,000 waiters leave newest first (a front-to-back scan's worst case): the
    /// list's work per leave stays a small constant.
    #[test]
    fn forty_thousand_waiters_leave_in_linear_total_work() {
        const N: usize = 40_000;
        let waker = futures::task::noop_waker();
        let mut queue = WaitQueue::default();
        let mut out = Deferred::default();
        let mut waiting: Vec<Waiting> = (0..N).map(|_| Waiting::default()).collect();
        for w in &mut waiting {
            queue.register(w, &waker, &mut out);
        }
        let before = queue.list.steps();
        for w in waiting.iter_mut().rev() {
            assert!(queue.leave(w, &mut out), "it was waiting");
        }
        let per_leave = (queue.list.steps() - before) as f64 / N as f64;
        assert!(queue.is_empty());
        assert!(per_leave <= 8.0, "{per_leave} slots visited per leave");
    }
}
