//! The channel core: one mutex around the buffer, the reservations and the waiters.
//!
//! Every operation takes the lock once, decides, and wakes tasks, drops wakers and runs the
//! `on_drop` hook only after releasing it (see [`Deferred`]), so no user code ever runs under
//! the lock. Free slots are handed
//! to waiting senders directly (a *grant*: the slot is reserved in the waiter's name), which
//! makes waiting senders strictly FIFO and means a woken sender never finds its slot taken.

use std::collections::VecDeque;
use std::fmt;
use std::sync::PoisonError;
use std::task::{Context, Poll};

use crate::channel::error::{ReserveError, SendError, Sent, Stats, TryRecvError};
use crate::channel::wait::{Deferred, WaitQueue, Waiting};
use crate::dropped::{Dropped, OnDrop};
use crate::metrics::{Counter, Gauge, Labels};
use crate::overflow::Overflow;
use crate::sync::{Arc, AtomicUsize, Mutex, MutexGuard, Ordering};

/// Names of the channel metrics.
pub(crate) mod names {
    pub(crate) const DEPTH: &str = "flowgate_channel_depth";
    pub(crate) const SENT: &str = "flowgate_channel_sent_total";
    pub(crate) const RECEIVED: &str = "flowgate_channel_received_total";
    pub(crate) const DROPPED: &str = "flowgate_channel_dropped_total";
}

struct Metrics {
    depth: Gauge,
    sent: Counter,
    received: Counter,
    dropped_newest: Counter,
    dropped_oldest: Counter,
    dropped_closed: Counter,
}

impl Metrics {
    fn new(name: Option<&str>) -> Metrics {
        let labels = Labels::new(name);
        let dropped = |reason| labels.counter(names::DROPPED, &[("policy", reason)]);
        Metrics {
            depth: labels.gauge(names::DEPTH, &[]),
            sent: labels.counter(names::SENT, &[]),
            received: labels.counter(names::RECEIVED, &[]),
            dropped_newest: dropped(Overflow::DropNewest.as_str()),
            dropped_oldest: dropped(Overflow::DropOldest.as_str()),
            dropped_closed: dropped("closed"),
        }
    }
}
/// How many items of one receiver's batch it has not handed out yet, for `len()`.
///
/// Written only by its receiver (a plain store: under the lock when a batch is taken or
/// given back, without it as items are handed out), read by `len()`. On its own cache line,
/// so the receiver's stores touch nothing the senders use.
#[derive(Debug, Default)]
#[repr(align(128))]
pub(crate) struct BatchLen(AtomicUsize);

impl BatchLen {
    /// The receiver now has `n` items of its batch left.
    #[inline]
    pub(crate) fn set(&self, n: usize) {
        self.0.store(n, Ordering::Relaxed);
    }

    fn get(&self) -> usize {
        self.0.load(Ordering::Relaxed)
    }
}

pub(crate) struct State<T> {
    queue: VecDeque<T>,
    /// Every receiver's batch length, one per receiver: its length is the receiver count.
    batches: Vec<Arc<BatchLen>>,
    /// Slots held by permits, sink reservations and grants not yet claimed.
    reserved: usize,
    /// Slots held by receivers' batches: freed when a batch is used up (or given back).
    held: usize,
    /// No new sends: `close()` was called, or every sender or every receiver is gone.
    closed: bool,
    senders: usize,
    send_waiters: WaitQueue,
    /// Waiting senders that were handed a reserved slot and have not claimed it yet.
    granted: Vec<u64>,
    /// Receivers waiting in a `Recv` / `RecvMany` future: one is woken per new item, and a
    /// future dropped after its wake passes it on.
    recv_waiters: WaitQueue,
    /// Receivers polled directly (`poll_recv`, `Stream`): each new item wakes all of them,
    /// because a stream that stops being polled cannot pass a wake on.
    stream_waiters: WaitQueue,
    close_waiters: WaitQueue,
    next_id: u64,
    stats: Stats,
}

impl<T> State<T> {
    /// The id of `waiting`, allocating one if it has none.
    fn id_for(&mut self, waiting: &mut Waiting) -> u64 {
        *waiting.id.get_or_insert_with(|| {
            self.next_id += 1;
            self.next_id
        })
    }

    /// A new item is queued: wake one waiting future and every waiting stream.
    #[inline]
    fn wake_for_item(&mut self, out: &mut Deferred) {
        self.recv_waiters.wake_one(out);
        self.stream_waiters.wake_all(out);
    }

    fn wake_receivers(&mut self, out: &mut Deferred) {
        self.recv_waiters.wake_all(out);
        self.stream_waiters.wake_all(out);
    }

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
    fn register_receiver(
        &mut self,
        waiting: &mut Waiting,
        stream: bool,
        cx: &Context<'_>,
        out: &mut Deferred,
    ) {
        if waiting.stream != stream {
            if let Some(id) = waiting.id {
                self.receiver_queue(waiting.stream).remove(id, out);
            }
            waiting.stream = stream;
        }
        let id = self.id_for(waiting);
        self.receiver_queue(stream).register(id, cx.waker(), out);
    }

    /// Stop waiting as a receiver; true if it was still registered (not woken).
    fn leave_receiver(&mut self, waiting: &mut Waiting, out: &mut Deferred) -> bool {
        match waiting.id.take() {
            Some(id) => self.receiver_queue(waiting.stream).remove(id, out),
            None => false,
        }
    }
}

pub(crate) struct Shared<T> {
    state: Mutex<State<T>>,
    capacity: usize,
    overflow: Overflow,
    on_drop: Option<OnDrop<T>>,
    name: Option<String>,
    metrics: Metrics,
}

// Unwind-safe for every `T`, as tokio declares its channel state: no user code runs under
// the lock (hooks and wakers run after it is released, see `Deferred`), so a panic leaves
// the state consistent, and a poisoned lock is used as it is (`lock`). The channel only
// moves items in and out; it never hands out a reference to one. (The metrics handles, trait
// objects, are the only fields that are not unwind-safe by themselves.)
impl<T> std::panic::RefUnwindSafe for Shared<T> {}
impl<T> std::panic::UnwindSafe for Shared<T> {}

impl<T> fmt::Debug for Shared<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.lock();
        f.debug_struct("Channel")
            .field("name", &self.name)
            .field("capacity", &self.capacity)
            .field("overflow", &self.overflow)
            .field("len", &self.len_locked(&st))
            .field("reserved", &st.reserved)
            .field("closed", &st.closed)
            .field("stats", &st.stats)
            .finish()
    }
}

impl<T> Shared<T> {
    pub(crate) fn new(
        capacity: usize,
        overflow: Overflow,
        on_drop: Option<OnDrop<T>>,
        name: Option<String>,
    ) -> Shared<T> {
        let metrics = Metrics::new(name.as_deref());
        Shared {
            state: Mutex::new(State {
                queue: VecDeque::with_capacity(capacity.min(4096)),
                // `Receiver::new` adds the first receiver's.
                batches: Vec::new(),
                reserved: 0,
                held: 0,
                closed: false,
                senders: 1,
                send_waiters: WaitQueue::default(),
                granted: Vec::new(),
                recv_waiters: WaitQueue::default(),
                stream_waiters: WaitQueue::default(),
                close_waiters: WaitQueue::default(),
                next_id: 0,
                stats: Stats::default(),
            }),
            capacity,
            overflow,
            on_drop,
            name,
            metrics,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State<T>> {
        // No user code runs under the lock, so a poisoned lock still holds a consistent state.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    pub(crate) fn overflow(&self) -> Overflow {
        self.overflow
    }

    pub(crate) fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// Items not yet handed to a consumer: queued, or in a receiver's batch.
    fn len_locked(&self, st: &State<T>) -> usize {
        st.queue.len() + st.batches.iter().map(|b| b.get()).sum::<usize>()
    }

    pub(crate) fn len(&self) -> usize {
        self.len_locked(&self.lock())
    }

    /// What a receiver's `size_hint` may count on besides its own batch: the queue, if it is
    /// the only receiver (no other can take from it, and dropping the oldest replaces an item).
    pub(crate) fn queued_for_sole_receiver(&self) -> usize {
        let st = self.lock();
        if st.batches.len() == 1 {
            st.queue.len()
        } else {
            0
        }
    }

    /// The depth gauge: queued items and the slots receivers' batches hold (exact when a
    /// batch is taken or used up; it reads nothing the receivers write without the lock).
    fn set_depth(&self, st: &State<T>) {
        self.metrics.depth.set((st.queue.len() + st.held) as f64);
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.lock().closed
    }

    pub(crate) fn stats(&self) -> Stats {
        self.lock().stats
    }

    fn has_room(&self, st: &State<T>) -> bool {
        st.queue.len() + st.reserved + st.held < self.capacity
    }

    /// How many items a receiver takes under one lock: up to 32, and at most an eighth of
    /// the capacity (so senders never lose much room to a batch). Under `DropOldest`, 1: a
    /// drop must take the oldest item not yet handed out, and a batch is out of its reach.
    pub(crate) fn batch(&self) -> usize {
        if self.overflow == Overflow::DropOldest {
            1
        } else {
            (self.capacity / 8).clamp(1, 32)
        }
    }

    /// Hand a freed slot to the first waiting sender, if any.
    fn grant(st: &mut State<T>, out: &mut Deferred) -> bool {
        let Some((id, waker)) = st.send_waiters.pop() else {
            return false;
        };
        st.reserved += 1;
        st.granted.push(id);
        out.wake(waker);
        true
    }

    /// Hand up to `n` freed slots to waiting senders.
    fn grant_many(st: &mut State<T>, n: usize, out: &mut Deferred) {
        for _ in 0..n {
            if !Self::grant(st, out) {
                break;
            }
        }
    }

    fn take_grant(st: &mut State<T>, id: u64) -> bool {
        match st.granted.iter().position(|&g| g == id) {
            Some(at) => {
                st.granted.swap_remove(at);
                true
            }
            None => false,
        }
    }

    /// Give back one reserved slot: to the next waiting sender, or to the pool.
    fn release_reserved(st: &mut State<T>, out: &mut Deferred) {
        st.reserved -= 1;
        Self::grant(st, out);
    }

    fn push(&self, st: &mut State<T>, item: T, out: &mut Deferred) {
        st.queue.push_back(item);
        st.stats.sent += 1;
        self.metrics.sent.increment(1);
        self.set_depth(st);
        st.wake_for_item(out);
    }

    /// Count a dropped item and pass it to the hook with `why`. Called without the lock.
    fn dropped(&self, item: T, why: Dropped, counter: &Counter) {
        counter.increment(1);
        if let Some(hook) = &self.on_drop {
            hook.call(item, &why);
        }
    }

    /// Close for new sends and collect every waiter to wake.
    fn close_locked(st: &mut State<T>, out: &mut Deferred) {
        if !st.closed {
            st.closed = true;
            // Grants not yet claimed are void: their senders will see `closed`.
            st.reserved -= st.granted.len();
            st.granted.clear();
        }
        st.send_waiters.wake_all(out);
        st.wake_receivers(out);
        st.close_waiters.wake_all(out);
    }

    pub(crate) fn close(&self) {
        let mut out = Deferred::default();
        Self::close_locked(&mut self.lock(), &mut out);
    }

    // ----- sending -----

    /// Send without waiting. Under `Backpressure` a full buffer is `Full(item)`.
    pub(crate) fn try_send(&self, item: T) -> Result<Sent, SendError<T>> {
        let mut out = Deferred::default();
        let mut st = self.lock();
        if st.closed {
            return Err(SendError::Closed(item));
        }
        if self.has_room(&st) {
            self.push(&mut st, item, &mut out);
            return Ok(Sent::Queued);
        }
        match self.overflow {
            Overflow::Backpressure | Overflow::Reject => Err(SendError::Full(item)),
            // No receiver batches under `DropOldest`: the queue's front is the oldest item
            // not yet handed out.
            Overflow::DropOldest if !st.queue.is_empty() => {
                let oldest = st.queue.pop_front().expect("queue is not empty");
                st.stats.dropped += 1;
                self.push(&mut st, item, &mut out);
                drop(st);
                self.dropped(oldest, Dropped::Oldest, &self.metrics.dropped_oldest);
                Ok(Sent::DroppedOldest)
            }
            Overflow::DropNewest | Overflow::DropOldest => {
                st.stats.sent += 1;
                st.stats.dropped += 1;
                drop(st);
                self.metrics.sent.increment(1);
                self.dropped(item, Dropped::Newest, &self.metrics.dropped_newest);
                Ok(Sent::DroppedNewest)
            }
        }
    }

    /// Wait for a slot (FIFO) under `Backpressure`; other policies never wait.
    ///
    /// On `Pending` the item is kept by the caller in `slot`.
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
        let mut out = Deferred::default();
        let mut st = self.lock();
        match waiting.id {
            None => {
                if st.closed {
                    return Poll::Ready(Err(SendError::Closed(item)));
                }
                if self.has_room(&st) {
                    self.push(&mut st, item, &mut out);
                    return Poll::Ready(Ok(Sent::Queued));
                }
                let id = st.id_for(waiting);
                st.send_waiters.register(id, cx.waker(), &mut out);
            }
            Some(id) => {
                if Self::take_grant(&mut st, id) {
                    waiting.id = None;
                    st.reserved -= 1;
                    self.push(&mut st, item, &mut out);
                    return Poll::Ready(Ok(Sent::Queued));
                }
                if st.closed {
                    st.send_waiters.remove(id, &mut out);
                    waiting.id = None;
                    return Poll::Ready(Err(SendError::Closed(item)));
                }
                st.send_waiters.register(id, cx.waker(), &mut out);
            }
        }
        *slot = Some(item);
        Poll::Pending
    }

    /// Wait for a slot and keep it reserved (for a permit or a sink).
    pub(crate) fn poll_reserve(
        &self,
        cx: &mut Context<'_>,
        waiting: &mut Waiting,
    ) -> Poll<Result<(), ReserveError>> {
        let mut out = Deferred::default();
        let mut st = self.lock();
        match waiting.id {
            None => {
                if st.closed {
                    return Poll::Ready(Err(ReserveError::Closed));
                }
                if self.has_room(&st) {
                    st.reserved += 1;
                    return Poll::Ready(Ok(()));
                }
                let id = st.id_for(waiting);
                st.send_waiters.register(id, cx.waker(), &mut out);
            }
            Some(id) => {
                if Self::take_grant(&mut st, id) {
                    // The grant's reservation becomes the caller's.
                    waiting.id = None;
                    return Poll::Ready(Ok(()));
                }
                if st.closed {
                    st.send_waiters.remove(id, &mut out);
                    waiting.id = None;
                    return Poll::Ready(Err(ReserveError::Closed));
                }
                st.send_waiters.register(id, cx.waker(), &mut out);
            }
        }
        Poll::Pending
    }

    pub(crate) fn try_reserve(&self) -> Result<(), ReserveError> {
        let mut st = self.lock();
        if st.closed {
            Err(ReserveError::Closed)
        } else if self.has_room(&st) {
            st.reserved += 1;
            Ok(())
        } else {
            Err(ReserveError::Full)
        }
    }

    /// A waiting send or reserve was dropped: leave the queue, or pass a grant on.
    pub(crate) fn cancel_send_wait(&self, waiting: &mut Waiting) {
        let Some(id) = waiting.id.take() else { return };
        let mut out = Deferred::default();
        let mut st = self.lock();
        if !st.send_waiters.remove(id, &mut out) && Self::take_grant(&mut st, id) {
            Self::release_reserved(&mut st, &mut out);
        }
    }

    /// Send into a slot reserved earlier. Cannot fail; with every receiver gone the item is
    /// dropped through `on_drop` (`Discarded`) and counted.
    pub(crate) fn send_reserved(&self, item: T) {
        let mut out = Deferred::default();
        let mut st = self.lock();
        st.reserved -= 1;
        if st.batches.is_empty() {
            st.stats.sent += 1;
            st.stats.dropped += 1;
            drop(st);
            self.metrics.sent.increment(1);
            self.dropped(item, Dropped::Discarded, &self.metrics.dropped_closed);
            return;
        }
        self.push(&mut st, item, &mut out);
        // Closed and this was the last reservation: every receiver must see the end.
        if st.closed && st.reserved == 0 {
            st.wake_receivers(&mut out);
        }
    }

    /// A reserved slot was not used.
    pub(crate) fn release(&self) {
        let mut out = Deferred::default();
        let mut st = self.lock();
        Self::release_reserved(&mut st, &mut out);
        // With the channel closed, receivers may be waiting only for this reservation.
        if Self::finished(&st) {
            st.wake_receivers(&mut out);
        }
    }

    pub(crate) fn poll_closed(&self, cx: &mut Context<'_>, waiting: &mut Waiting) -> Poll<()> {
        let mut out = Deferred::default();
        let mut st = self.lock();
        if st.closed {
            st.close_waiters.leave(waiting, &mut out);
            return Poll::Ready(());
        }
        let id = st.id_for(waiting);
        st.close_waiters.register(id, cx.waker(), &mut out);
        Poll::Pending
    }

    pub(crate) fn cancel_closed_wait(&self, waiting: &mut Waiting) {
        if waiting.is_waiting() {
            let mut out = Deferred::default();
            self.lock().close_waiters.leave(waiting, &mut out);
        }
    }

    // ----- receiving -----

    /// Nothing more can come: closed, no reservation left, nothing queued, and no batch
    /// held by a receiver (a receiver dropped with one gives it back to the queue).
    fn finished(st: &State<T>) -> bool {
        st.closed && st.reserved == 0 && st.queue.is_empty() && st.held == 0
    }

    pub(crate) fn try_recv(&self) -> Result<T, TryRecvError> {
        let mut out = Deferred::default();
        let mut st = self.lock();
        match st.queue.pop_front() {
            Some(item) => {
                st.stats.received += 1;
                self.metrics.received.increment(1);
                self.set_depth(&st);
                Self::grant(&mut st, &mut out);
                Ok(item)
            }
            None if Self::finished(&st) => Err(TryRecvError::Closed),
            None => Err(TryRecvError::Empty),
        }
    }

    /// Take up to `max` items under one lock: the first is returned, the rest go to `local`
    /// and keep their slots (`held`) until [`release_held`](Shared::release_held), so the
    /// channel's bound still counts them. A receiver takes at most its share of what is
    /// queued (`len / receivers`), so none sits on items another one is idle for. `Stats` count a
    /// batch as received when it is taken (and uncount what is given back); the
    /// `received_total` metric, which cannot go back, counts items as they are handed out.
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
        max: usize,
    ) -> Poll<Option<T>> {
        let mut out = Deferred::default();
        let mut st = self.lock();
        // At most a fair share of what is queued, so other receivers find items too.
        let max = max.min((st.queue.len() / st.batches.len().max(1)).max(1));
        let n = st.queue.len().min(max);
        if n > 0 {
            st.leave_receiver(waiting, &mut out);
            let first = st.queue.pop_front().expect("n > 0");
            local.extend(st.queue.drain(..n - 1));
            st.held += n - 1;
            batch_len.set(n - 1);
            st.stats.received += n as u64;
            self.metrics.received.increment(1);
            self.set_depth(&st);
            // The first item's slot is free now.
            Self::grant(&mut st, &mut out);
            return Poll::Ready(Some(first));
        }
        if Self::finished(&st) {
            st.leave_receiver(waiting, &mut out);
            return Poll::Ready(None);
        }
        st.register_receiver(waiting, stream, cx, &mut out);
        Poll::Pending
    }

    /// A receiver used up its batch, which held `n` slots: they are free.
    pub(crate) fn release_held(&self, n: usize) {
        if n == 0 {
            return;
        }
        let mut out = Deferred::default();
        let mut st = self.lock();
        st.held -= n;
        self.metrics.received.increment(n as u64);
        self.set_depth(&st);
        Self::grant_many(&mut st, n, &mut out);
        // Other receivers may be waiting only for this batch to end the stream.
        if Self::finished(&st) {
            st.wake_receivers(&mut out);
        }
    }

    /// A receiver is dropped with `items` of a batch not yet yielded (and `held` slots in
    /// all): the items go back to the front of the queue, in order, for other receivers.
    fn give_back(
        &self,
        st: &mut State<T>,
        items: VecDeque<T>,
        held: usize,
        batch_len: &BatchLen,
        out: &mut Deferred,
    ) {
        st.held -= held;
        batch_len.set(0);
        // Those handed out are received; the rest go back.
        let freed = held - items.len();
        st.stats.received -= items.len() as u64;
        self.metrics.received.increment(freed as u64);
        for item in items.into_iter().rev() {
            st.queue.push_front(item);
        }
        Self::grant_many(st, freed, out);
        st.wake_receivers(out);
        self.set_depth(st);
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
        let mut st = self.lock();
        let n = st.queue.len().min(limit);
        if n > 0 {
            buf.extend(st.queue.drain(..n));
            st.stats.received += n as u64;
            self.metrics.received.increment(n as u64);
            self.set_depth(&st);
            st.leave_receiver(waiting, &mut out);
            Self::grant_many(&mut st, n, &mut out);
            return Poll::Ready(n);
        }
        if Self::finished(&st) {
            st.leave_receiver(waiting, &mut out);
            return Poll::Ready(0);
        }
        st.register_receiver(waiting, false, cx, &mut out);
        Poll::Pending
    }

    /// A waiting receive was dropped. If it had already been woken for an item it will not
    /// take, pass the wake-up on so the item is not stranded. (Stream waiters were all woken
    /// with the item; one waiting future is.)
    pub(crate) fn cancel_recv_wait(&self, waiting: &mut Waiting) {
        if !waiting.is_waiting() {
            return;
        }
        let mut out = Deferred::default();
        Self::cancel_recv_wait_locked(&mut self.lock(), waiting, &mut out);
    }

    fn cancel_recv_wait_locked(st: &mut State<T>, waiting: &mut Waiting, out: &mut Deferred) {
        if !st.leave_receiver(waiting, out) && !st.queue.is_empty() {
            st.recv_waiters.wake_one(out);
        }
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
            Self::close_locked(&mut st, &mut out);
        }
    }

    /// A receiver is dropped, all under one lock: it stops waiting (passing on a wake it
    /// had, as [`cancel_recv_wait`](Shared::cancel_recv_wait)), gives back what is left of
    /// its batch (`items`, and `held` slots in all) to the front of the queue, and is no
    /// longer counted. The last receiver going away drops what is buffered, through
    /// `on_drop` (`Discarded`), counted.
    pub(crate) fn drop_receiver(
        &self,
        waiting: &mut Waiting,
        items: VecDeque<T>,
        held: usize,
        batch_len: &Arc<BatchLen>,
    ) {
        let mut out = Deferred::default();
        let mut st = self.lock();
        if waiting.is_waiting() {
            Self::cancel_recv_wait_locked(&mut st, waiting, &mut out);
        }
        if held > 0 || !items.is_empty() {
            self.give_back(&mut st, items, held, batch_len, &mut out);
        }
        st.batches.retain(|b| !Arc::ptr_eq(b, batch_len));
        if !st.batches.is_empty() {
            return;
        }
        Self::close_locked(&mut st, &mut out);
        let left: Vec<T> = st.queue.drain(..).collect();
        st.stats.dropped += left.len() as u64;
        self.set_depth(&st);
        drop(st);
        for item in left {
            self.dropped(item, Dropped::Discarded, &self.metrics.dropped_closed);
        }
    }
}
