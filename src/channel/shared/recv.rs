//! Receiving (under the lock, a batch at a time) and the handles coming and going.

use std::collections::VecDeque;
use std::ops::Range;
use std::task::{Context, Poll};

use super::*;
use crate::sync::Panics;

impl<T> Shared<T> {
    /// Nothing more can come: closed, and no slot occupied (nothing queued, reserved, on
    /// its way, or held in a receiver's batch: a receiver dropped with one gives it back).
    pub(super) fn finished(&self) -> bool {
        let s = self.hot.state.load(Ordering::SeqCst);
        s & CLOSED != 0 && occupied(s) == 0
    }

    /// How many items are queued, for a receiver about to wait if there are none: then it
    /// sets `RECV_WAIT`, fences (pairing with the fence after a push) and looks again, so
    /// an item pushed meanwhile is either seen here or its sender sees the flag and wakes
    /// the receiver, which registers before it releases the lock.
    fn queued_or_flag(&self, st: &State<T>) -> usize {
        let n = self.queued(st);
        if n > 0 || self.finished() {
            return n;
        }
        self.hot.rx.fetch_or(RECV_WAIT, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        self.queued(st)
    }

    /// `n` items were received: count them and free their slots. The metrics are recorded
    /// by `moves`, after the lock, once the state is settled.
    fn took(&self, st: &mut State<T>, n: usize, out: &mut Deferred, moves: &mut Moves<'_, T>) {
        st.received += n as u64;
        self.free_locked(st, n, out);
        moves.received(n);
    }

    /// Receive one item without waiting, for a receiver whose batch is used up (`local`
    /// empty, `batch_len` its length): handed over as [`hand_over`](Shared::hand_over) does.
    pub(crate) fn try_recv(
        &self,
        local: &mut VecDeque<T>,
        batch_len: &BatchLen,
    ) -> Result<T, TryRecvError> {
        let mut out = Deferred::default();
        let mut moves = Moves::new(self);
        let mut st = self.lock();
        match self.pop_oldest(&mut st) {
            Some(item) => {
                self.took(&mut st, 1, &mut out, &mut moves);
                Self::hand_over(item, st, moves, out, local, batch_len).ok_or(TryRecvError::Empty)
            }
            None if self.finished() => Err(TryRecvError::Closed),
            None => Err(TryRecvError::Empty),
        }
    }

    /// Hands `item`, just received (counted, its slot freed under `st`), to the caller once
    /// the lock is released, the receive recorded (`moves`) and the wakes done (`out`):
    /// meanwhile it waits at the front of the receiver's `local`, counted in its
    /// `batch_len`, so a recorder or a waker that panics (user code) leaves it there, for
    /// the receiver's next receive (or, the receiver dropped first, for `on_drop`: see
    /// [`drop_receiver`](Shared::drop_receiver)), instead of taking it with the panic. It
    /// holds no slot there: `local` then has one item more than the batch has places.
    fn hand_over(
        item: T,
        st: MutexGuard<'_, State<T>>,
        moves: Moves<'_, T>,
        out: Deferred,
        local: &mut VecDeque<T>,
        batch_len: &BatchLen,
    ) -> Option<T> {
        local.push_front(item);
        let waiting = local.len();
        batch_len.set(waiting);
        drop(st);
        drop(moves);
        drop(out);
        batch_len.set(waiting - 1);
        local.pop_front()
    }

    /// Take up to [`batch`](Shared::batch) items under one lock: the first is returned, the
    /// rest go to `local` and keep their slots (held) until
    /// [`release_held`](Shared::release_held), so the channel's bound still counts them. A
    /// receiver takes at most its share of what is queued (`queued / receivers`, at least
    /// one; items in receivers' batches are not queued), so none sits on items another one
    /// is idle for. `st.received` counts a batch when it is taken (and uncounts what is
    /// given back); `Stats::received` counts items as they are handed out,
    /// the `received_total` metric a batch's items with their slots, when the last of them
    /// is handed out (or the rest given back).
    ///
    /// The batch is a run of consecutive places in the queue (it stops short of a place
    /// another receiver's batch still holds); `batch` is set to the places of the items in
    /// `local` (its length is the slots held), before anything is recorded, for
    /// [`release_held`](Shared::release_held) and [`give_back`](Shared::give_back).
    ///
    /// A `stream` receiver (no future whose drop could pass a wake on) waits among the
    /// stream waiters, which every new item wakes.
    pub(crate) fn poll_recv_batch(
        &self,
        cx: &mut Context<'_>,
        waiting: &mut Waiting,
        stream: bool,
        local: &mut VecDeque<T>,
        batch_len: &BatchLen,
        batch: &mut Range<u64>,
    ) -> Poll<Option<T>> {
        let mut out = Deferred::default();
        let mut moves = Moves::new(self);
        let mut st = self.lock();
        let queued = self.queued_or_flag(&st);
        // At most a fair share of what is queued, so other receivers find items too.
        let n = queued.min(self.batch().min((queued / st.batches.len().max(1)).max(1)));
        if let Some((place, first)) = (n > 0).then(|| self.pop_oldest_placed(&mut st)).flatten() {
            st.leave_receiver(waiting, &mut out);
            let mut next = place + 1;
            while local.len() + 1 < n && Self::oldest_place(&st) == next {
                let Some((_, item)) = self.pop_oldest_placed(&mut st) else {
                    break;
                };
                local.push_back(item);
                next += 1;
            }
            *batch = place + 1..next;
            let held = local.len();
            batch_len.set(held);
            self.depth_extra.fetch_add(held, Ordering::Relaxed);
            // Only the first item's slot is free now; the batch's are held.
            st.received += held as u64;
            self.sync_recv_flag(&st);
            self.took(&mut st, 1, &mut out, &mut moves);
            return Poll::Ready(Self::hand_over(first, st, moves, out, local, batch_len));
        }
        if self.finished() {
            st.leave_receiver(waiting, &mut out);
            self.sync_recv_flag(&st);
            return Poll::Ready(None);
        }
        st.register_receiver(waiting, stream, cx, &mut out);
        Poll::Pending
    }

    /// A receiver used up its `batch` (the places `poll_recv_batch` set): the slots it held
    /// are free. Recorded last, as in [`took`](Shared::took); each step even if one before
    /// it panics (freeing wakes the senders granted a slot, whose wakers are user code, as
    /// the recorder is), or the batch would go uncounted.
    pub(crate) fn release_held(&self, batch: Range<u64>) {
        let n = held(&batch);
        if n == 0 {
            return;
        }
        self.depth_extra.fetch_sub(n, Ordering::Relaxed);
        // Recorded as the guard drops: after `free`, or as a sender's waker's panic unwinds
        // from it. `free` itself runs outside any `catch_unwind` (this is the receive path).
        let _recorded = ReleaseRecorded { shared: self, n };
        self.free(n);
    }
}

/// What [`Shared::release_held`] records once its slots are free, each step even if the
/// recorder panics on the one before it.
struct ReleaseRecorded<'a, T> {
    shared: &'a Shared<T>,
    n: usize,
}

impl<T> Drop for ReleaseRecorded<'_, T> {
    fn drop(&mut self) {
        let mut panics = Panics::new();
        panics.run(|| self.shared.metrics.received.increment(self.n as u64));
        panics.run(|| self.shared.set_depth());
        panics.resume();
    }
}

impl<T> Shared<T> {
    /// A receiver is dropped with `items` not yet yielded, the last of its `batch` (the
    /// places `poll_recv_batch` set, each holding a slot): the items go back to their
    /// places, ahead of every item in the ring, for other receivers.
    fn give_back(
        &self,
        st: &mut State<T>,
        items: VecDeque<T>,
        batch: Range<u64>,
        batch_len: &BatchLen,
        out: &mut Deferred,
        moves: &mut Moves<'_, T>,
    ) {
        batch_len.set(0);
        // Those handed out are received; the rest go back.
        let freed = held(&batch) - items.len();
        st.received -= items.len() as u64;
        self.depth_extra.fetch_sub(freed, Ordering::Relaxed);
        // Their places are consecutive, and no other given-back item has one between them
        // (those are this batch's), so they go in as one run.
        let first = batch.end - items.len() as u64;
        self.stashed.fetch_add(items.len(), Ordering::Relaxed);
        let at = st.stash.partition_point(|(place, _)| *place < first);
        let newer = st.stash.split_off(at);
        st.stash.extend((first..).zip(items));
        st.stash.extend(newer);
        self.free_locked(st, freed, out);
        self.wake_receivers(st, out);
        moves.received(freed);
    }

    /// Move up to `limit` items into `buf` in one lock; 0 only when finished (or limit 0).
    pub(crate) fn poll_recv_many(
        &self,
        cx: &mut Context<'_>,
        waiting: &mut Waiting,
        buf: &mut Vec<T>,
        limit: usize,
    ) -> Poll<usize> {
        if limit == 0 {
            return Poll::Ready(0);
        }
        let mut out = Deferred::default();
        let mut moves = Moves::new(self);
        let mut st = self.lock();
        let n = self.queued_or_flag(&st).min(limit);
        let before = buf.len();
        buf.extend(std::iter::from_fn(|| self.pop_oldest(&mut st)).take(n));
        let n = buf.len() - before;
        if n > 0 {
            st.leave_receiver(waiting, &mut out);
            self.took(&mut st, n, &mut out, &mut moves);
            self.sync_recv_flag(&st);
            return Poll::Ready(n);
        }
        if self.finished() {
            st.leave_receiver(waiting, &mut out);
            self.sync_recv_flag(&st);
            return Poll::Ready(0);
        }
        st.register_receiver(waiting, false, cx, &mut out);
        Poll::Pending
    }

    /// A waiting receive was dropped. If it had already been woken for an item it will not
    /// take, pass the wake-up on so the item is not stranded. (Stream waiters were all woken
    /// with the item; one waiting future is.) A wait among the stream waiters is not the
    /// future's: it was registered by a poll as a `Stream` (the future, dropped before its
    /// first poll, registered nothing), and that task is still owed its wake.
    pub(crate) fn cancel_recv_wait(&self, waiting: &mut Waiting) {
        if !waiting.is_waiting() || waiting.stream {
            return;
        }
        let mut out = Deferred::default();
        self.cancel_recv_wait_locked(&mut self.lock(), waiting, &mut out);
    }

    fn cancel_recv_wait_locked(
        &self,
        st: &mut State<T>,
        waiting: &mut Waiting,
        out: &mut Deferred,
    ) {
        if !st.leave_receiver(waiting, out) && self.queued(st) > 0 {
            st.recv_waiters.wake_one(out);
        }
        self.sync_recv_flag(st);
    }

    // ----- handles -----

    pub(crate) fn add_sender(&self) {
        self.lock().senders += 1;
    }

    /// A new receiver: counted, and its batch length known to `len()`.
    pub(crate) fn add_receiver(&self) -> Arc<BatchLen> {
        let batch_len = Arc::new(BatchLen::default());
        self.lock().batches.push(batch_len.clone());
        batch_len
    }

    pub(crate) fn drop_sender(&self) {
        let mut out = Deferred::default();
        let mut st = self.lock();
        st.senders -= 1;
        if st.senders == 0 {
            self.close_locked(&mut st, &mut out);
        }
    }

    /// A receiver is dropped, all under one lock: it stops waiting (passing on a wake it
    /// had, as [`cancel_recv_wait`](Shared::cancel_recv_wait)), gives back what is left of
    /// its batch (`items`, of the places `batch` that `poll_recv_batch` set) to its place at
    /// the front of the queue, and is no longer counted. The last receiver
    /// going away drops what is buffered, through `on_drop` (`Discarded`), counted; so does
    /// a send that pushes after it (it sees `RX_GONE`).
    ///
    /// An item a receive took but did not hand out, its recording or a wake having panicked
    /// (see [`hand_over`](Shared::hand_over)), holds no slot, so it cannot go back to the
    /// queue: it is dropped through `on_drop` (`Discarded`), counted as dropped instead of
    /// received.
    pub(crate) fn drop_receiver(
        &self,
        waiting: &mut Waiting,
        mut items: VecDeque<T>,
        batch: Range<u64>,
        batch_len: &Arc<BatchLen>,
    ) {
        let loose = (items.len() > held(&batch))
            .then(|| items.pop_front())
            .flatten();
        {
            let mut out = Deferred::default();
            let mut moves = Moves::new(self);
            let mut st = self.lock();
            if loose.is_some() {
                st.received -= 1;
                st.dropped += 1;
            }
            if waiting.is_waiting() {
                self.cancel_recv_wait_locked(&mut st, waiting, &mut out);
            }
            if !batch.is_empty() || !items.is_empty() {
                self.give_back(&mut st, items, batch, batch_len, &mut out, &mut moves);
            }
            st.batches.retain(|b| !Arc::ptr_eq(b, batch_len));
            if st.batches.is_empty() {
                self.close_locked(&mut st, &mut out);
                // Pairs with the fence after a push: a push this drain misses sees `RX_GONE`.
                self.hot.rx.fetch_or(RX_GONE, Ordering::SeqCst);
                fence(Ordering::SeqCst);
                self.discard_rest(st, 0);
            }
        }
        if let Some(item) = loose {
            self.dropped(item, Dropped::Discarded, || {
                self.metrics.dropped_closed.increment(1);
            });
        }
    }
}

/// How many slots a receiver's batch of the places `batch` holds: one per place.
fn held(batch: &Range<u64>) -> usize {
    (batch.end - batch.start) as usize
}
