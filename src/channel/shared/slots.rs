//! The slots: claiming one (without the lock, or queued behind the senders waiting),
//! freeing them (granted to waiting senders first), and closing the channel.

use std::task::{Context, Poll};

use super::*;

impl<T> Shared<T> {
    /// Change `state` by `f`; returns the word it replaced.
    #[inline]
    pub(super) fn update(&self, mut f: impl FnMut(usize) -> usize) -> usize {
        // `f` never refuses, so this is always `Ok`.
        self.hot
            .state
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |s| Some(f(s)))
            .unwrap_or_else(|prev| prev)
    }

    /// Claim a free slot without the lock: only while the channel is open, no sender is
    /// queued (no barging) and a slot is free. Returns how many slots were occupied before;
    /// on failure, the `state` word that refused.
    #[inline]
    pub(super) fn try_claim(&self) -> Result<usize, usize> {
        let mut s = self.hot.state.load(Ordering::Relaxed);
        loop {
            if s & (CLOSED | SEND_WAIT) != 0 || occupied(s) >= self.capacity {
                return Err(s);
            }
            match self.hot.state.compare_exchange_weak(
                s,
                s + ONE,
                Ordering::SeqCst,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Ok(occupied(s)),
                Err(now) => s = now,
            }
        }
    }

    /// Under the lock: claim a slot, or queue as a waiting sender (setting `SEND_WAIT`
    /// on the full count it found, so every later free sees it). A sender already queued
    /// takes its grant if it has one. `Ready(Err(()))`: closed.
    pub(super) fn poll_slot(
        &self,
        st: &mut State<T>,
        cx: &Context<'_>,
        waiting: &mut Waiting,
        out: &mut Deferred,
        moves: &mut Moves<'_, T>,
    ) -> Poll<Result<(), ()>> {
        if waiting.is_waiting() {
            if self.is_closed() {
                // A grant not yet claimed was void from the close on.
                st.send_waiters.leave(waiting, out);
                return Poll::Ready(Err(()));
            }
            if st.send_waiters.claim(waiting) {
                // The granted slot is the caller's.
                return Poll::Ready(Ok(()));
            }
            st.send_waiters.register(waiting, cx.waker(), out);
            return Poll::Pending;
        }
        let mut s = self.hot.state.load(Ordering::SeqCst);
        loop {
            let next = if s & CLOSED != 0 {
                return Poll::Ready(Err(()));
            } else if s & SEND_WAIT != 0 {
                // Behind the senders already waiting.
                break;
            } else if occupied(s) < self.capacity {
                s + ONE
            } else {
                s | SEND_WAIT
            };
            match self
                .hot
                .state
                .compare_exchange_weak(s, next, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) if next & SEND_WAIT == 0 => return Poll::Ready(Ok(())),
                Ok(_) => break,
                Err(now) => s = now,
            }
        }
        // Full: the gauge the fast path only samples is exact while senders wait.
        moves.depth();
        st.send_waiters.register(waiting, cx.waker(), out);
        Poll::Pending
    }

    /// `n` slots are free (items taken, a reservation or a batch given up): to queued
    /// senders first. Without the lock unless a sender is queued.
    pub(super) fn free(&self, n: usize) {
        let mut s = self.hot.state.load(Ordering::Relaxed);
        loop {
            if s & SEND_WAIT != 0 {
                let mut out = Deferred::default();
                let mut st = self.lock();
                self.free_locked(&mut st, n, &mut out);
                return;
            }
            match self.hot.state.compare_exchange_weak(
                s,
                s - n * ONE,
                Ordering::SeqCst,
                Ordering::Relaxed,
            ) {
                Ok(_) => break,
                Err(now) => s = now,
            }
        }
        if s & CLOSED != 0 && occupied(s) == n {
            // The end of the stream: receivers may be waiting for these slots only.
            let mut out = Deferred::default();
            let mut st = self.lock();
            self.wake_receivers(&mut st, &mut out);
        }
    }

    /// As [`free`](Shared::free), under the lock: grant the slots to queued senders (FIFO),
    /// clear `SEND_WAIT` when none is left, and free the rest.
    pub(super) fn free_locked(&self, st: &mut State<T>, n: usize, out: &mut Deferred) {
        let mut left = n;
        while left > 0 && st.send_waiters.grant_one(out) {
            left -= 1;
        }
        let clear = if st.send_waiters.is_empty() {
            SEND_WAIT
        } else {
            0
        };
        if left == 0 && self.hot.state.load(Ordering::Relaxed) & clear == 0 {
            return;
        }
        let prev = self.update(|s| (s & !clear) - left * ONE);
        if prev & CLOSED != 0 && occupied(prev) == left {
            self.wake_receivers(st, out);
        }
    }

    /// Close for new sends and collect every waiter to wake.
    pub(super) fn close_locked(&self, st: &mut State<T>, out: &mut Deferred) {
        if !self.is_closed() {
            // Grants not yet claimed are void: their senders will see `closed`. No sender
            // can queue any more, so `SEND_WAIT` goes too.
            let void = st.send_waiters.granted();
            self.update(|s| ((s | CLOSED) & !SEND_WAIT) - void * ONE);
        }
        st.send_waiters.wake_all(out);
        self.wake_receivers(st, out);
        st.close_waiters.wake_all(out);
    }

    pub(crate) fn close(&self) {
        let mut out = Deferred::default();
        self.close_locked(&mut self.lock(), &mut out);
    }
}
