//! Waiting receivers: the queue of each kind (futures, streams), and waking them, with
//! the `RECV_WAIT` flag kept in step.

use std::task::Context;

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

    pub(super) fn wake_receivers(&self, st: &mut State<T>, out: &mut Deferred) {
        st.recv_waiters.wake_all(out);
        st.stream_waiters.wake_all(out);
        self.sync_recv_flag(st);
    }
}
