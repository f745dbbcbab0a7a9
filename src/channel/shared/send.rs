//! Sending: the lock-free claim and push, and the slow paths under the lock (a full
//! channel, the overflow policies, queued senders, reservations, close waiters).

use std::task::{Context, Poll};

use super::*;
use crate::sync::Panics;

impl<T> Shared<T> {
    /// Send without waiting. Under `Backpressure` a full buffer is `Full(item)`.
    #[inline]
    pub(crate) fn try_send(&self, item: T) -> Result<Sent, SendError<T>> {
        match self.try_claim() {
            Ok(before) => {
                self.enqueue(item, self.samples_depth(before));
                Ok(Sent::Queued)
            }
            Err(s) if s & CLOSED != 0 => Err(SendError::Closed(item)),
            Err(_) => self.try_send_full(item),
        }
    }

    /// `try_send` on a full channel (or one with senders queued), under the lock.
    #[cold]
    fn try_send_full(&self, item: T) -> Result<Sent, SendError<T>> {
        let mut out = Deferred::default();
        let mut moves = Moves::new(self);
        let mut st = self.lock();
        moves.depth();
        // A slot may have been freed since.
        match self.try_claim() {
            Ok(_) => {
                self.enqueue_locked(&mut st, item, &mut out, &mut moves);
                return Ok(Sent::Queued);
            }
            Err(s) if s & CLOSED != 0 => return Err(SendError::Closed(item)),
            Err(_) => {}
        }
        match self.overflow {
            Overflow::Backpressure | Overflow::Reject => Err(SendError::Full(item)),
            // No receiver batches under `DropOldest`: the oldest queued item is the oldest
            // not yet handed out. Its slot passes to the new item.
            Overflow::DropOldest => match self.pop_oldest(&mut st) {
                Some(oldest) => {
                    st.dropped += 1;
                    self.enqueue_locked(&mut st, item, &mut out, &mut moves);
                    drop(st);
                    // Recorded before the hook sees the dropped item, as `drop_newest` does.
                    self.dropped(oldest, Dropped::Oldest, || {
                        let mut panics = Panics::new();
                        panics.run(|| drop(moves));
                        panics.run(|| self.metrics.dropped_oldest.increment(1));
                        panics.resume();
                    });
                    Ok(Sent::DroppedOldest)
                }
                None => Ok(self.drop_newest(st, item)),
            },
            Overflow::DropNewest => Ok(self.drop_newest(st, item)),
        }
    }

    /// Accept `item` and drop it at once (`DropNewest`, or `DropOldest` with every slot
    /// reserved): counted under the lock `st` holds, dropped through the hook after it.
    fn drop_newest(&self, mut st: MutexGuard<'_, State<T>>, item: T) -> Sent {
        st.dropped += 1;
        drop(st);
        self.dropped(item, Dropped::Newest, || {
            let mut panics = Panics::new();
            panics.run(|| self.metrics.sent.increment(1));
            panics.run(|| self.metrics.dropped_newest.increment(1));
            panics.resume();
        });
        Sent::DroppedNewest
    }

    /// Wait for a slot (FIFO) under `Backpressure`; other policies never wait.
    ///
    /// On `Pending` the item is kept by the caller in `slot`.
    #[inline]
    pub(crate) fn poll_send(
        &self,
        cx: &mut Context<'_>,
        waiting: &mut Waiting,
        slot: &mut Option<T>,
    ) -> Poll<Result<Sent, SendError<T>>> {
        let item = slot.take().expect("polled after completion");
        if !self.overflow.waits() {
            return Poll::Ready(self.try_send(item));
        }
        if !waiting.is_waiting() {
            match self.try_claim() {
                Ok(before) => {
                    self.enqueue(item, self.samples_depth(before));
                    return Poll::Ready(Ok(Sent::Queued));
                }
                Err(s) if s & CLOSED != 0 => return Poll::Ready(Err(SendError::Closed(item))),
                Err(_) => {}
            }
        }
        let mut out = Deferred::default();
        let mut moves = Moves::new(self);
        let mut st = self.lock();
        match self.poll_slot(&mut st, cx, waiting, &mut out, &mut moves) {
            Poll::Ready(Ok(())) => {
                self.enqueue_locked(&mut st, item, &mut out, &mut moves);
                Poll::Ready(Ok(Sent::Queued))
            }
            Poll::Ready(Err(())) => Poll::Ready(Err(SendError::Closed(item))),
            Poll::Pending => {
                *slot = Some(item);
                Poll::Pending
            }
        }
    }

    /// Wait for a slot and keep it reserved (for a permit or a sink).
    pub(crate) fn poll_reserve(
        &self,
        cx: &mut Context<'_>,
        waiting: &mut Waiting,
    ) -> Poll<Result<(), ReserveError>> {
        if !waiting.is_waiting() {
            match self.try_reserve() {
                Err(ReserveError::Full) => {}
                done => return Poll::Ready(done),
            }
        }
        let mut out = Deferred::default();
        let mut moves = Moves::new(self);
        let mut st = self.lock();
        self.poll_slot(&mut st, cx, waiting, &mut out, &mut moves)
            .map_err(|()| ReserveError::Closed)
    }

    pub(crate) fn try_reserve(&self) -> Result<(), ReserveError> {
        match self.try_claim() {
            Ok(_) => Ok(()),
            Err(s) if s & CLOSED != 0 => Err(ReserveError::Closed),
            Err(_) => Err(ReserveError::Full),
        }
    }

    /// A waiting send or reserve was dropped: leave the queue, or pass a grant on.
    pub(crate) fn cancel_send_wait(&self, waiting: &mut Waiting) {
        if !waiting.is_waiting() {
            return;
        }
        let mut out = Deferred::default();
        let mut st = self.lock();
        match st.send_waiters.leave_granted(waiting, &mut out) {
            Some(false) if st.send_waiters.is_empty() => {
                self.update(|s| s & !SEND_WAIT);
            }
            // A grant given up passes on (void once closed: the close freed its slot).
            Some(true) if !self.is_closed() => self.free_locked(&mut st, 1, &mut out),
            _ => {}
        }
    }

    /// Send into a slot reserved earlier. Cannot fail; with every receiver gone the item is
    /// dropped through `on_drop` (`Discarded`) and counted.
    pub(crate) fn send_reserved(&self, item: T) {
        let depth = self.samples_depth(occupied(self.hot.state.load(Ordering::Relaxed)));
        self.enqueue(item, depth);
    }

    /// A reserved slot was not used.
    pub(crate) fn release(&self) {
        self.free(1);
    }

    pub(crate) fn poll_closed(&self, cx: &mut Context<'_>, waiting: &mut Waiting) -> Poll<()> {
        let mut out = Deferred::default();
        let mut st = self.lock();
        if self.is_closed() {
            st.close_waiters.leave(waiting, &mut out);
            return Poll::Ready(());
        }
        st.close_waiters.register(waiting, cx.waker(), &mut out);
        Poll::Pending
    }

    pub(crate) fn cancel_closed_wait(&self, waiting: &mut Waiting) {
        if waiting.is_waiting() {
            let mut out = Deferred::default();
            self.lock().close_waiters.leave(waiting, &mut out);
        }
    }
}
