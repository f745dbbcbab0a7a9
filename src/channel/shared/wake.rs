//! Waiting receivers: the queue of each kind (futures, streams), and waking them, with
//! the `RECV_WAIT` flag kept in step.

use std::task::{Context, Waker};

use super::*;

impl<T> State<T> {
    /// The receiver queue of one kind: stream waiters or future waiters.
    fn receiver_queue(&mut self, stream: bool) -> &mut WaitQueue {
        if stream {
            &mut self.stream_waiters
        } else {
            &mut self.recv_waiters
        }
    }

    /// Register a receiver in the queue of its kind. A receiver waits in one queue at a
    /// time, the one `waiting.stream` names: if it waited in the other, it leaves it.
    pub(super) fn register_receiver(
        &mut self,
        waiting: &mut Waiting,
        stream: bool,
        cx: &Context<'_>,
        out: &mut Deferred,
    ) {
        if waiting.stream != stream {
            self.leave_receiver(waiting, out);
            waiting.stream = stream;
        }
        self.receiver_queue(stream)
            .register(waiting, cx.waker(), out);
    }

    /// Stop waiting as a receiver; true if it was still registered (not woken).
    pub(super) fn leave_receiver(&mut self, waiting: &mut Waiting, out: &mut Deferred) -> bool {
        let stream = waiting.stream;
        self.receiver_queue(stream).leave(waiting, out)
    }
}

impl<T> Shared<T> {
    /// Clear `RECV_WAIT` if no receiver is registered any more (under the lock).
    pub(super) fn sync_recv_flag(&self, st: &State<T>) {
        if st.recv_waiters.is_empty()
            && st.stream_waiters.is_empty()
            && self.hot.rx.load(Ordering::Relaxed) & RECV_WAIT != 0
        {
            self.hot.rx.fetch_and(!RECV_WAIT, Ordering::SeqCst);
        }
    }

    /// A new item is queued: wake one waiting future and every waiting stream.
    pub(super) fn wake_for_item(&self, st: &mut State<T>, out: &mut Deferred) {
        st.recv_waiters.wake_one(out);
        st.stream_waiters.wake_all(out);
        self.sync_recv_flag(st);
    }

    /// The channel is closed or has ended: wake every waiting receiver, and every end
    /// watcher (see [`watch_end`](Shared::watch_end)).
    pub(super) fn wake_receivers(&self, st: &mut State<T>, out: &mut Deferred) {
        st.recv_waiters.wake_all(out);
        st.stream_waiters.wake_all(out);
        self.sync_recv_flag(st);
        for batch in &st.batches {
            if let Some(waker) = batch.take_end() {
                out.wake(waker);
            }
        }
    }

    /// An adapter over a receiver that may not take an item (`watermarks` at `high`,
    /// `with_demand` without credit) read its `size_hint` watching for the end (see
    /// [`crate::sync::size_hint_watching_end`]): wake `waker` once the channel is finished,
    /// now if it is. One watcher per receiver, the latest; it is woken by the close too
    /// (spuriously if items are left to come: the adapter then reads the hint again, and
    /// watches again), by a receiver giving its batch back, and by the free that ends the
    /// channel. Only under the lock, which the
    /// close holds and the end's free takes before it wakes receivers: a watcher put in
    /// after them sees `finished` here.
    ///
    /// A watcher already in for the same task returns at once, without the channel's lock
    /// (`with_demand` granted one item at a time reads the hint after each): a watcher in is
    /// one the next close or end takes out and wakes.
    ///
    /// Returns the wakers to wake or drop, for the caller to let go of once it holds
    /// nothing (the watcher is lent from a thread-local).
    #[must_use = "the wakers are woken as the returned `Deferred` drops"]
    pub(crate) fn watch_end(&self, batch: &BatchLen, waker: &Waker) -> Deferred {
        let mut out = Deferred::default();
        if batch.watching(waker) {
            return out;
        }
        let _st = self.lock();
        if self.finished() {
            out.wake(waker.clone());
        } else if let Some(old) = batch.watch_end(waker.clone()) {
            out.discard(old);
        }
        out
    }
}
