//! The channel core: one mutex around the buffer, the reservations and the waiters.
//!
//! Every operation takes the lock once, decides, and wakes tasks and runs the `on_drop` hook
//! only after releasing it, so no user code ever runs under the lock. Free slots are handed
//! to waiting senders directly (a *grant*: the slot is reserved in the waiter's name), which
//! makes waiting senders strictly FIFO and means a woken sender never finds its slot taken.

use std::collections::VecDeque;
use std::fmt;
use std::sync::PoisonError;
use std::task::{Context, Poll, Waker};

use crate::channel::error::{ReserveError, SendError, Sent, Stats, TryRecvError};
use crate::metrics::{Counter, Gauge, Labels};
use crate::overflow::Overflow;
use crate::sync::{Mutex, MutexGuard};

pub(crate) type OnDrop<T> = Box<dyn Fn(T) + Send + Sync>;

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

/// Tasks waiting for something, FIFO, each known by the id its future holds.
#[derive(Default)]
pub(crate) struct WaitQueue {
    entries: VecDeque<(u64, Waker)>,
}

impl WaitQueue {
    /// Add `id`, or refresh its waker if it is already waiting.
    fn register(&mut self, id: u64, waker: &Waker) {
        match self.entries.iter_mut().find(|(i, _)| *i == id) {
            Some((_, w)) => w.clone_from(waker),
            None => self.entries.push_back((id, waker.clone())),
        }
    }

    /// Remove `id`; false if it was not waiting (it was woken, or never registered).
    fn remove(&mut self, id: u64) -> bool {
        match self.entries.iter().position(|(i, _)| *i == id) {
            Some(at) => {
                self.entries.remove(at);
                true
            }
            None => false,
        }
    }

    fn pop(&mut self) -> Option<(u64, Waker)> {
        self.entries.pop_front()
    }

    /// Stop waiting, if `waiting` is registered.
    fn leave(&mut self, waiting: &mut Waiting) {
        if let Some(id) = waiting.0.take() {
            self.remove(id);
        }
    }

    fn drain_into(&mut self, wakers: &mut Vec<Waker>) {
        wakers.extend(self.entries.drain(..).map(|(_, w)| w));
    }
}

pub(crate) struct State<T> {
    queue: VecDeque<T>,
    /// Slots held by permits, sink reservations and grants not yet claimed.
    reserved: usize,
    /// Slots held by items that receivers took in a batch and have not yielded yet.
    held: usize,
    /// No new sends: `close()` was called, or every sender or every receiver is gone.
    closed: bool,
    senders: usize,
    receivers: usize,
    send_waiters: WaitQueue,
    /// Waiting senders that were handed a reserved slot and have not claimed it yet.
    granted: Vec<u64>,
    recv_waiters: WaitQueue,
    close_waiters: WaitQueue,
    next_id: u64,
    stats: Stats,
}

impl<T> State<T> {
    /// The id of `waiting`, allocating one if it has none.
    fn id_for(&mut self, waiting: &mut Waiting) -> u64 {
        *waiting.0.get_or_insert_with(|| {
            self.next_id += 1;
            self.next_id
        })
    }
}

/// Where a waiting future stands; the id is its place in a wait queue.
#[derive(Debug, Default)]
pub(crate) struct Waiting(Option<u64>);

impl Waiting {
    pub(crate) fn is_waiting(&self) -> bool {
        self.0.is_some()
    }
}

/// Wakers collected under the lock, woken after it is released.
type Wake = Option<Waker>;

fn wake(w: Wake) {
    if let Some(w) = w {
        w.wake();
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

impl<T> fmt::Debug for Shared<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.lock();
        f.debug_struct("Channel")
            .field("name", &self.name)
            .field("capacity", &self.capacity)
            .field("overflow", &self.overflow)
            .field("len", &st.queue.len())
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
                reserved: 0,
                held: 0,
                closed: false,
                senders: 1,
                receivers: 1,
                send_waiters: WaitQueue::default(),
                granted: Vec::new(),
                recv_waiters: WaitQueue::default(),
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

    pub(crate) fn len(&self) -> usize {
        self.lock().queue.len()
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
    /// the capacity (so senders never lose much room to a batch).
    pub(crate) fn batch(&self) -> usize {
        (self.capacity / 8).clamp(1, 32)
    }

    /// Hand a freed slot to the first waiting sender, if any.
    fn grant(st: &mut State<T>) -> Wake {
        let (id, waker) = st.send_waiters.pop()?;
        st.reserved += 1;
        st.granted.push(id);
        Some(waker)
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
    fn release_reserved(st: &mut State<T>) -> Wake {
        st.reserved -= 1;
        Self::grant(st)
    }

    fn push(&self, st: &mut State<T>, item: T) -> Wake {
        st.queue.push_back(item);
        st.stats.sent += 1;
        self.metrics.sent.increment(1);
        self.metrics.depth.set(st.queue.len() as f64);
        st.recv_waiters.pop().map(|(_, w)| w)
    }

    fn dropped(&self, item: T, counter: &Counter) {
        counter.increment(1);
        if let Some(hook) = &self.on_drop {
            hook(item);
        }
    }

    /// Close for new sends and collect every waiter to wake.
    fn close_locked(st: &mut State<T>, wakers: &mut Vec<Waker>) {
        if !st.closed {
            st.closed = true;
            // Grants not yet claimed are void: their senders will see `closed`.
            st.reserved -= st.granted.len();
            st.granted.clear();
        }
        st.send_waiters.drain_into(wakers);
        st.recv_waiters.drain_into(wakers);
        st.close_waiters.drain_into(wakers);
    }

    pub(crate) fn close(&self) {
        let mut wakers = Vec::new();
        Self::close_locked(&mut self.lock(), &mut wakers);
        wakers.into_iter().for_each(Waker::wake);
    }

    // ----- sending -----

    /// Send without waiting. Under `Backpressure` a full buffer is `Full(item)`.
    pub(crate) fn try_send(&self, item: T) -> Result<Sent, SendError<T>> {
        let mut st = self.lock();
        if st.closed {
            return Err(SendError::Closed(item));
        }
        if self.has_room(&st) {
            let w = self.push(&mut st, item);
            drop(st);
            wake(w);
            return Ok(Sent::Queued);
        }
        match self.overflow {
            Overflow::Backpressure | Overflow::Reject => Err(SendError::Full(item)),
            Overflow::DropOldest if !st.queue.is_empty() => {
                let oldest = st.queue.pop_front().expect("queue is not empty");
                st.stats.dropped += 1;
                let w = self.push(&mut st, item);
                drop(st);
                wake(w);
                self.dropped(oldest, &self.metrics.dropped_oldest);
                Ok(Sent::EvictedOldest)
            }
            Overflow::DropNewest | Overflow::DropOldest => {
                st.stats.sent += 1;
                st.stats.dropped += 1;
                drop(st);
                self.metrics.sent.increment(1);
                self.dropped(item, &self.metrics.dropped_newest);
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
        let mut st = self.lock();
        match waiting.0 {
            None => {
                if st.closed {
                    return Poll::Ready(Err(SendError::Closed(item)));
                }
                if self.has_room(&st) {
                    let w = self.push(&mut st, item);
                    drop(st);
                    wake(w);
                    return Poll::Ready(Ok(Sent::Queued));
                }
                let id = st.id_for(waiting);
                st.send_waiters.register(id, cx.waker());
            }
            Some(id) => {
                if Self::take_grant(&mut st, id) {
                    waiting.0 = None;
                    st.reserved -= 1;
                    let w = self.push(&mut st, item);
                    drop(st);
                    wake(w);
                    return Poll::Ready(Ok(Sent::Queued));
                }
                if st.closed {
                    st.send_waiters.remove(id);
                    waiting.0 = None;
                    return Poll::Ready(Err(SendError::Closed(item)));
                }
                st.send_waiters.register(id, cx.waker());
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
        let mut st = self.lock();
        match waiting.0 {
            None => {
                if st.closed {
                    return Poll::Ready(Err(ReserveError::Closed));
                }
                if self.has_room(&st) {
                    st.reserved += 1;
                    return Poll::Ready(Ok(()));
                }
                let id = st.id_for(waiting);
                st.send_waiters.register(id, cx.waker());
            }
            Some(id) => {
                if Self::take_grant(&mut st, id) {
                    // The grant's reservation becomes the caller's.
                    waiting.0 = None;
                    return Poll::Ready(Ok(()));
                }
                if st.closed {
                    st.send_waiters.remove(id);
                    waiting.0 = None;
                    return Poll::Ready(Err(ReserveError::Closed));
                }
                st.send_waiters.register(id, cx.waker());
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
        let Some(id) = waiting.0.take() else { return };
        let mut st = self.lock();
        if st.send_waiters.remove(id) {
            return;
        }
        let w = if Self::take_grant(&mut st, id) {
            Self::release_reserved(&mut st)
        } else {
            None
        };
        drop(st);
        wake(w);
    }

    /// Send into a slot reserved earlier. Cannot fail; with every receiver gone the item is
    /// dropped through `on_drop` and counted.
    pub(crate) fn send_reserved(&self, item: T) {
        let mut st = self.lock();
        st.reserved -= 1;
        if st.receivers == 0 {
            st.stats.sent += 1;
            st.stats.dropped += 1;
            drop(st);
            self.metrics.sent.increment(1);
            self.dropped(item, &self.metrics.dropped_closed);
            return;
        }
        let w = self.push(&mut st, item);
        // Closed and this was the last reservation: every receiver must see the end.
        let mut wakers = Vec::new();
        if st.closed && st.reserved == 0 {
            st.recv_waiters.drain_into(&mut wakers);
        }
        drop(st);
        wake(w);
        wakers.into_iter().for_each(Waker::wake);
    }

    /// A reserved slot was not used.
    pub(crate) fn release(&self) {
        let mut st = self.lock();
        let w = Self::release_reserved(&mut st);
        // With the channel closed, receivers may be waiting only for this reservation.
        let mut wakers = Vec::new();
        if st.closed && st.reserved == 0 && st.queue.is_empty() {
            st.recv_waiters.drain_into(&mut wakers);
        }
        drop(st);
        wake(w);
        wakers.into_iter().for_each(Waker::wake);
    }

    pub(crate) fn poll_closed(&self, cx: &mut Context<'_>, waiting: &mut Waiting) -> Poll<()> {
        let mut st = self.lock();
        if st.closed {
            st.close_waiters.leave(waiting);
            return Poll::Ready(());
        }
        let id = st.id_for(waiting);
        st.close_waiters.register(id, cx.waker());
        Poll::Pending
    }

    pub(crate) fn cancel_closed_wait(&self, waiting: &mut Waiting) {
        if waiting.is_waiting() {
            self.lock().close_waiters.leave(waiting);
        }
    }

    // ----- receiving -----

    /// Nothing more can come: closed, no reservation left, nothing queued, and no batch
    /// held by a receiver (a receiver dropped with one gives it back to the queue).
    fn finished(st: &State<T>) -> bool {
        st.closed && st.reserved == 0 && st.queue.is_empty() && st.held == 0
    }

    fn pop(&self, st: &mut State<T>) -> Option<(T, Wake)> {
        let item = st.queue.pop_front()?;
        st.stats.received += 1;
        self.metrics.received.increment(1);
        self.metrics.depth.set(st.queue.len() as f64);
        Some((item, Self::grant(st)))
    }

    pub(crate) fn try_recv(&self) -> Result<T, TryRecvError> {
        let mut st = self.lock();
        match self.pop(&mut st) {
            Some((item, w)) => {
                drop(st);
                wake(w);
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
    pub(crate) fn poll_recv_batch(
        &self,
        cx: &mut Context<'_>,
        waiting: &mut Waiting,
        local: &mut VecDeque<T>,
        max: usize,
    ) -> Poll<Option<T>> {
        let mut st = self.lock();
        // At most a fair share of what is queued, so other receivers find items too.
        let max = max.min((st.queue.len() / st.receivers.max(1)).max(1));
        let n = st.queue.len().min(max);
        if n > 0 {
            st.recv_waiters.leave(waiting);
            let first = st.queue.pop_front().expect("n > 0");
            local.extend(st.queue.drain(..n - 1));
            st.held += n - 1;
            st.stats.received += n as u64;
            self.metrics.received.increment(1);
            self.metrics.depth.set(st.queue.len() as f64);
            // The first item's slot is free now.
            let w = Self::grant(&mut st);
            drop(st);
            wake(w);
            return Poll::Ready(Some(first));
        }
        if Self::finished(&st) {
            st.recv_waiters.leave(waiting);
            return Poll::Ready(None);
        }
        let id = st.id_for(waiting);
        st.recv_waiters.register(id, cx.waker());
        Poll::Pending
    }

    /// A receiver handed out the `n` items of its batch: their slots are free.
    pub(crate) fn release_held(&self, n: usize) {
        if n == 0 {
            return;
        }
        let mut st = self.lock();
        st.held -= n;
        self.metrics.received.increment(n as u64);
        let mut wakers: Vec<Waker> = (0..n).map_while(|_| Self::grant(&mut st)).collect();
        // Other receivers may be waiting only for this batch to end the stream.
        if Self::finished(&st) {
            st.recv_waiters.drain_into(&mut wakers);
        }
        drop(st);
        wakers.into_iter().for_each(Waker::wake);
    }

    /// A receiver is dropped with `items` of a batch not yet yielded (and `held` slots in
    /// all): the items go back to the front of the queue, in order, for other receivers.
    pub(crate) fn give_back(&self, items: VecDeque<T>, held: usize) {
        let mut st = self.lock();
        st.held -= held;
        // Those handed out are received; the rest go back.
        let freed = held - items.len();
        st.stats.received -= items.len() as u64;
        self.metrics.received.increment(freed as u64);
        for item in items.into_iter().rev() {
            st.queue.push_front(item);
        }
        let mut wakers: Vec<Waker> = (0..freed).map_while(|_| Self::grant(&mut st)).collect();
        st.recv_waiters.drain_into(&mut wakers);
        self.metrics.depth.set(st.queue.len() as f64);
        drop(st);
        wakers.into_iter().for_each(Waker::wake);
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
        let mut st = self.lock();
        let n = st.queue.len().min(limit);
        if n > 0 {
            buf.extend(st.queue.drain(..n));
            st.stats.received += n as u64;
            self.metrics.received.increment(n as u64);
            self.metrics.depth.set(st.queue.len() as f64);
            st.recv_waiters.leave(waiting);
            let wakers: Vec<Waker> = (0..n).map_while(|_| Self::grant(&mut st)).collect();
            drop(st);
            wakers.into_iter().for_each(Waker::wake);
            return Poll::Ready(n);
        }
        if Self::finished(&st) {
            st.recv_waiters.leave(waiting);
            return Poll::Ready(0);
        }
        let id = st.id_for(waiting);
        st.recv_waiters.register(id, cx.waker());
        Poll::Pending
    }

    /// A waiting receive was dropped. If it had already been woken for an item it will not
    /// take, pass the wake-up on so the item is not stranded.
    pub(crate) fn cancel_recv_wait(&self, waiting: &mut Waiting) {
        let Some(id) = waiting.0.take() else { return };
        let mut st = self.lock();
        if st.recv_waiters.remove(id) {
            return;
        }
        let w = if st.queue.is_empty() {
            None
        } else {
            st.recv_waiters.pop().map(|(_, w)| w)
        };
        drop(st);
        wake(w);
    }

    // ----- handles -----

    pub(crate) fn add_sender(&self) {
        self.lock().senders += 1;
    }

    pub(crate) fn add_receiver(&self) {
        self.lock().receivers += 1;
    }

    pub(crate) fn drop_sender(&self) {
        let mut st = self.lock();
        st.senders -= 1;
        if st.senders > 0 {
            return;
        }
        let mut wakers = Vec::new();
        Self::close_locked(&mut st, &mut wakers);
        drop(st);
        wakers.into_iter().for_each(Waker::wake);
    }

    /// The last receiver going away drops what is buffered, through `on_drop`, counted.
    pub(crate) fn drop_receiver(&self) {
        let mut st = self.lock();
        st.receivers -= 1;
        if st.receivers > 0 {
            return;
        }
        let mut wakers = Vec::new();
        Self::close_locked(&mut st, &mut wakers);
        let left: Vec<T> = st.queue.drain(..).collect();
        st.stats.dropped += left.len() as u64;
        self.metrics.depth.set(0.0);
        drop(st);
        wakers.into_iter().for_each(Waker::wake);
        for item in left {
            self.dropped(item, &self.metrics.dropped_closed);
        }
    }
}
