//! The channel core: a lock-free fast path for sends, one mutex for everything else.
//!
//! # Design
//!
//! Items live in a lock-free ring ([`Ring`]): senders push without the lock, into positions
//! they take by ticket; receivers pop under the lock (the ring's one [`Popper`] lives in the
//! locked state). One atomic word, `state`, holds the number of
//! *occupied* slots (queued items, items of receivers' batches, reservations, grants, and
//! sends under way) shifted left by two, and two flags: `CLOSED`, and `SEND_WAIT` (some
//! sender is queued waiting for a slot). A second word, `rx`, holds `RECV_WAIT` (some
//! receiver is registered waiting for an item) and `RX_GONE` (every receiver is dropped).
//!
//! - **Send, fast path** (no lock): claim a slot by compare-and-swap on `state`, only when
//!   it is open, `SEND_WAIT` is clear and a slot is free; push the item into the ring; a
//!   `SeqCst` fence; read `rx`. Only if a flag is set does the sender take the lock, to wake
//!   receivers (or, with every receiver gone, to drop what is left through `on_drop`).
//! - **Send, slow path** (under the lock): the claim is retried; if the channel is full, or
//!   senders already wait, the sender sets `SEND_WAIT` (by compare-and-swap on the very
//!   `state` it found full) and queues. So a newcomer never overtakes a waiting sender:
//!   while `SEND_WAIT` is set, the fast path refuses every claim.
//! - **Freeing a slot** (a receive, a released permit, a used-up batch): decrement
//!   `state` by compare-and-swap unless `SEND_WAIT` is set; if it is, take the lock and
//!   *grant* the slot to the first waiting sender instead (the slot stays occupied, in the
//!   waiter's name), clearing `SEND_WAIT` when the last waiter is served. Under the lock,
//!   with `SEND_WAIT` set, the count changes only under the lock.
//! - **Receive** (under the lock, which receivers share with the slow paths; a receiver
//!   takes a batch per lock): pop from the items given back by dropped receivers first
//!   (`stash`, older than the ring's, each in its place in the queue), then from the ring;
//!   a batch is a run of consecutive places, so a receiver dropped with part of one gives
//!   it back to its place. A receiver that finds nothing sets `RECV_WAIT`, issues a
//!   `SeqCst` fence, and looks again before it registers.
//!
//! # Invariants
//!
//! - `occupied == ring + stash + held + reserved + granted + sends under way <= capacity`:
//!   a push never finds the ring full, and the bound is exact.
//! - `SEND_WAIT` is set iff a sender is queued (both change only under the lock), and then
//!   every slot is occupied.
//! - `RECV_WAIT` is set while a receiver is registered (it is cleared under the lock when
//!   none is); `CLOSED` and `RX_GONE` are set under the lock and never cleared.
//! - The channel is *finished* (receivers get `None`) when `CLOSED` is set and no slot is
//!   occupied: nothing is queued, held, reserved or on its way.
//!
//! # Why no wake is lost
//!
//! - *Item vs waiting receiver*: the sender pushes, fences, reads `RECV_WAIT`; the receiver
//!   sets `RECV_WAIT`, fences, looks at the ring. With a `SeqCst` fence on both sides (the
//!   store-buffering pattern) at least one sees the other: the receiver finds the item, or
//!   the sender sees the flag and wakes it under the lock (the receiver registers under the
//!   lock it held while looking, so it is registered by then).
//! - *Freed slot vs waiting sender*: both change `state` by read-modify-write, so they are
//!   totally ordered: a sender that set `SEND_WAIT` on a full count is served by every later
//!   free (which sees the flag), and a free before it left a slot the sender's claim finds.
//! - *Send vs close*: `CLOSED` is in `state`, so a claim either happened before the close
//!   (its item counts as occupied and receivers wait for it) or fails.
//! - *Last slot vs end of stream*: a free that leaves `CLOSED` with nothing occupied wakes
//!   every receiver under the lock; a receiver reads `state` and registers under the lock.
//! - *Send vs last receiver dropped*: the receiver sets `RX_GONE`, fences, drains the ring;
//!   the sender pushes, fences, reads `rx`. One of them drops the item through `on_drop`.
//!
//! As before, no user code runs under the lock: wakers and the `on_drop` hook run after it
//! is released (see [`Deferred`]), and so does the metrics recorder (see [`Moves`]).

use std::collections::VecDeque;
use std::fmt;
use std::sync::PoisonError;
use std::task::{Context, Poll};

use crate::channel::error::{ReserveError, SendError, Sent, Stats, TryRecvError};
use crate::channel::ring::{Popper, Ring};
use crate::channel::wait::{WaitQueue, Waiting};
use crate::dropped::{Dropped, OnDrop};
use crate::metrics::{Counter, Gauge, Labels};
use crate::overflow::Overflow;
use crate::sync::{Arc, AtomicUsize, Deferred, Mutex, MutexGuard, Ordering, fence};

mod recv;
mod send;

/// `state`: closed for new sends.
const CLOSED: usize = 1;
/// `state`: a sender is queued for a slot; freed slots go to it, claims without the lock fail.
const SEND_WAIT: usize = 2;
/// `state`: one occupied slot.
const ONE: usize = 4;
/// `rx`: a receiver is registered waiting for an item.
const RECV_WAIT: usize = 1;
/// `rx`: every receiver is gone.
const RX_GONE: usize = 2;

/// How many slots a `state` word says are occupied.
#[inline]
fn occupied(state: usize) -> usize {
    state / ONE
}

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

/// The metric changes made under the channel's lock, recorded after it: a metrics recorder
/// is user code, and one that reads the channel (an exporter taking `len()` or `stats()`)
/// takes the lock again. Declare it after the [`Deferred`] and before the lock's guard
/// (`let mut out = ..; let mut moves = Moves::new(self); let mut st = self.lock();`): it is
/// dropped, and records, once the guard is released and the state settled, and before the
/// wakers run, which a recorder that panics does not keep from running (`Deferred` wakes
/// them as the panic unwinds). Counters add up in any order; the depth gauge is read when
/// it is set, after the lock (see [`publish_depth`](Shared::publish_depth)).
struct Moves<'a, T> {
    shared: &'a Shared<T>,
    sent: u64,
    received: u64,
    /// Set the depth gauge.
    depth: bool,
}

impl<'a, T> Moves<'a, T> {
    fn new(shared: &'a Shared<T>) -> Moves<'a, T> {
        Moves {
            shared,
            sent: 0,
            received: 0,
            depth: false,
        }
    }

    /// An item was pushed: count it, and set the depth gauge.
    fn pushed(&mut self) {
        self.sent += 1;
        self.depth = true;
    }

    /// `n` items were received (their slots freed): count them, and set the depth gauge.
    fn received(&mut self, n: usize) {
        self.received += n as u64;
        self.depth = true;
    }

    /// Set the depth gauge.
    fn depth(&mut self) {
        self.depth = true;
    }
}

impl<T> Drop for Moves<'_, T> {
    fn drop(&mut self) {
        let metrics = &self.shared.metrics;
        if self.sent > 0 {
            metrics.sent.increment(self.sent);
        }
        if self.depth {
            self.shared.set_depth();
        }
        if self.received > 0 {
            metrics.received.increment(self.received);
        }
    }
}

/// A value on cache lines of its own (128 bytes: adjacent-line prefetch pairs lines).
#[derive(Debug)]
#[repr(align(128))]
pub(crate) struct Line<V>(pub(crate) V);

impl<V> std::ops::Deref for Line<V> {
    type Target = V;

    fn deref(&self) -> &V {
        &self.0
    }
}

/// The words every sender touches.
#[derive(Debug)]
struct Hot {
    /// Occupied slots times [`ONE`], plus [`CLOSED`] and [`SEND_WAIT`]: written by every
    /// claim and free.
    state: Line<AtomicUsize>,
    /// [`RECV_WAIT`] and [`RX_GONE`]: read after every push, rarely written, so on a line
    /// apart from `state` (it stays in every sender's cache).
    rx: Line<AtomicUsize>,
}

pub(crate) struct State<T> {
    /// The right to pop from the ring: pops happen under the lock.
    popper: Popper,
    /// Items given back by dropped receivers, each with its place in the queue (its
    /// [`ring_taken`](State::ring_taken) when it left the ring), in that order: older than
    /// every item in the ring.
    stash: VecDeque<(u64, T)>,
    /// Items taken out of the ring so far: the place in the queue of the ring's oldest item.
    /// A receiver's batch is a run of consecutive places, so what it gives back when it is
    /// dropped goes back to its place among what others gave back.
    ring_taken: u64,
    /// Every receiver's batch length, one per receiver: its length is the receiver count.
    batches: Vec<Arc<BatchLen>>,
    senders: usize,
    /// Senders waiting for a slot, and those granted one (a slot reserved in their name,
    /// counted as occupied) that have not claimed it yet.
    send_waiters: WaitQueue,
    /// Receivers waiting in a `Recv` / `RecvMany` future: one is woken per new item, and a
    /// future dropped after its wake passes it on.
    recv_waiters: WaitQueue,
    /// Receivers polled directly (`poll_recv`, `Stream`): each new item wakes all of them,
    /// because a stream that stops being polled cannot pass a wake on.
    stream_waiters: WaitQueue,
    close_waiters: WaitQueue,
    received: u64,
    dropped: u64,
}

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
    fn register_receiver(
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
    fn leave_receiver(&mut self, waiting: &mut Waiting, out: &mut Deferred) -> bool {
        let stream = waiting.stream;
        self.receiver_queue(stream).leave(waiting, out)
    }
}

pub(crate) struct Shared<T> {
    hot: Hot,
    ring: Ring<T>,
    /// Items in `stash` plus slots held by receivers' batches: the depth gauge's part
    /// besides the ring (changed by receivers only). On a line of its own, as is the locked
    /// state: both are written by receivers and the slow paths, and the fields below them
    /// (`capacity`, `depth_mask`, ...) are read by every send.
    depth_extra: Line<AtomicUsize>,
    state: Line<Mutex<State<T>>>,
    capacity: usize,
    /// How many items `stash` holds, for a receiver about to spin: read without the lock,
    /// written under it, and rarely (only items given back by dropped receivers go there).
    stashed: AtomicUsize,
    /// Fast-path sends set the depth gauge when the occupied count is not zero and has these
    /// bits clear: every sixteenth of the capacity rounded down to a power of two (so no
    /// division), but not more often than every 16 items.
    depth_mask: usize,
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
        let state = self.hot.state.load(Ordering::SeqCst);
        f.debug_struct("Channel")
            .field("name", &self.name)
            .field("capacity", &self.capacity)
            .field("overflow", &self.overflow)
            .field("len", &self.len_locked(&st))
            .field("occupied", &occupied(state))
            .field("closed", &(state & CLOSED != 0))
            .field("stats", &self.stats_locked(&st))
            .finish()
    }
}

/// The most times one update sets the depth gauge (see `Shared::publish_depth`).
const DEPTH_SETS: usize = 4;

impl<T> Shared<T> {
    pub(crate) fn new(
        capacity: usize,
        overflow: Overflow,
        on_drop: Option<OnDrop<T>>,
        name: Option<String>,
    ) -> Shared<T> {
        let metrics = Metrics::new(name.as_deref());
        let (ring, popper) = Ring::new(capacity);
        Shared {
            hot: Hot {
                state: Line(AtomicUsize::new(0)),
                rx: Line(AtomicUsize::new(0)),
            },
            ring,
            depth_extra: Line(AtomicUsize::new(0)),
            state: Line(Mutex::new(State {
                popper,
                stash: VecDeque::new(),
                ring_taken: 0,
                // `Receiver::new` adds the first receiver's.
                batches: Vec::new(),
                senders: 1,
                send_waiters: WaitQueue::default(),
                recv_waiters: WaitQueue::default(),
                stream_waiters: WaitQueue::default(),
                close_waiters: WaitQueue::default(),
                received: 0,
                dropped: 0,
            })),
            capacity,
            stashed: AtomicUsize::new(0),
            depth_mask: (1usize << (capacity / 16).max(16).ilog2()) - 1,
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

    /// Items queued: given back, or in the ring (pushes under way included).
    fn queued(&self, st: &State<T>) -> usize {
        st.stash.len() + self.ring.len()
    }

    /// Items taken by receivers in their batches and not yet handed out.
    fn batched(st: &State<T>) -> usize {
        st.batches.iter().map(|b| b.get()).sum()
    }

    /// Items not yet handed to a consumer: queued, or in a receiver's batch.
    fn len_locked(&self, st: &State<T>) -> usize {
        self.queued(st) + Self::batched(st)
    }

    pub(crate) fn len(&self) -> usize {
        self.len_locked(&self.lock())
    }

    /// What a receiver's `size_hint` may count on besides its own batch: the queue, if it is
    /// the only receiver (no other can take from it, and dropping the oldest replaces an item).
    pub(crate) fn queued_for_sole_receiver(&self) -> usize {
        let st = self.lock();
        if st.batches.len() == 1 {
            self.queued(&st)
        } else {
            0
        }
    }

    /// What a receiver's `size_hint` may take as its upper bound: once the channel is closed
    /// for sends, every item still to come holds a slot (queued, in a batch, reserved,
    /// granted or on its way), so the occupied slots; `None` while it is open.
    pub(crate) fn most_to_come(&self) -> Option<usize> {
        let s = self.hot.state.load(Ordering::SeqCst);
        (s & CLOSED != 0).then(|| occupied(s))
    }

    /// The depth gauge: queued items and the slots receivers' batches hold.
    #[inline]
    fn set_depth(&self) {
        // Without the feature the gauge is empty: skip reading the ring.
        if cfg!(feature = "metrics") {
            self.publish_depth(self.depth());
        }
    }

    /// What the depth gauge shows: queued items and the slots receivers' batches hold.
    #[inline]
    fn depth(&self) -> usize {
        self.ring.len() + self.depth_extra.load(Ordering::Relaxed)
    }

    /// Set the depth gauge to `depth`, read by [`depth`](Shared::depth) before, and look
    /// again: another update may have read and set a later depth between the read and the
    /// set (a sender preempted there, while a receive emptied the channel), and this one's
    /// value, set last, would stay until the next update — for good in a channel gone idle.
    /// So the update sets again until the depth it looks at after setting is the one it
    /// set. Whichever update sets last then sets the depth as it was after every change an
    /// update was made for (the gauge's swap orders the sets, and each set sees the changes
    /// before the sets ahead of it). Usually one more read of what the first one read. At
    /// most [`DEPTH_SETS`] sets: a depth still moving then is a channel in use, whose next
    /// receive or sampled send sets it again (a busy channel must not hold a sender here).
    #[inline]
    fn publish_depth(&self, mut depth: usize) {
        for _ in 0..DEPTH_SETS {
            self.metrics.depth.set(depth as f64);
            let now = self.depth();
            if now == depth {
                return;
            }
            depth = now;
        }
    }

    /// Whether an item is queued: in the ring, or given back (read without the lock; for a
    /// receiver's spin).
    pub(crate) fn has_queued_item(&self) -> bool {
        self.stashed.load(Ordering::Relaxed) > 0 || self.ring.len() > 0
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.hot.state.load(Ordering::SeqCst) & CLOSED != 0
    }

    fn stats_locked(&self, st: &State<T>) -> Stats {
        // Every accepted item is received, dropped, or still queued (`st.received` counts a
        // batch when it is taken): no counter on the senders' path. The items of a batch not
        // yet handed out are in `len()`, not yet received, so `sent == received + dropped +
        // len()`.
        Stats {
            sent: st.received + st.dropped + self.queued(st) as u64,
            received: st.received.saturating_sub(Self::batched(st) as u64),
            dropped: st.dropped,
        }
    }

    pub(crate) fn stats(&self) -> Stats {
        self.stats_locked(&self.lock())
    }

    /// How many items a receiver takes under one lock: up to 32, the whole of a smaller
    /// channel. The batch's slots stay occupied until it is handed out, so senders wait for
    /// it; at capacity 16 one lock per 16 items still beat one per 2 (an eighth of the
    /// capacity, as before) by 1.2 to 1.6 times in the steady-state benches, where senders
    /// mostly wait anyway. Under `DropOldest`, 1: a drop must take the oldest item not yet
    /// handed out, and a batch is out of its reach.
    fn batch(&self) -> usize {
        if self.overflow == Overflow::DropOldest {
            1
        } else {
            self.capacity.clamp(1, 32)
        }
    }

    /// Change `state` by `f`; returns the word it replaced.
    #[inline]
    fn update(&self, mut f: impl FnMut(usize) -> usize) -> usize {
        // `f` never refuses, so this is always `Ok`.
        self.hot
            .state
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |s| Some(f(s)))
            .unwrap_or_else(|prev| prev)
    }

    // ----- slots -----

    /// Claim a free slot without the lock: only while the channel is open, no sender is
    /// queued (no barging) and a slot is free. Returns how many slots were occupied before;
    /// on failure, the `state` word that refused.
    #[inline]
    fn try_claim(&self) -> Result<usize, usize> {
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
    fn poll_slot(
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
    fn free(&self, n: usize) {
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
    fn free_locked(&self, st: &mut State<T>, n: usize, out: &mut Deferred) {
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

    // ----- waking receivers -----

    /// Clear `RECV_WAIT` if no receiver is registered any more (under the lock).
    fn sync_recv_flag(&self, st: &State<T>) {
        if st.recv_waiters.is_empty()
            && st.stream_waiters.is_empty()
            && self.hot.rx.load(Ordering::Relaxed) & RECV_WAIT != 0
        {
            self.hot.rx.fetch_and(!RECV_WAIT, Ordering::SeqCst);
        }
    }

    /// A new item is queued: wake one waiting future and every waiting stream.
    fn wake_for_item(&self, st: &mut State<T>, out: &mut Deferred) {
        st.recv_waiters.wake_one(out);
        st.stream_waiters.wake_all(out);
        self.sync_recv_flag(st);
    }

    fn wake_receivers(&self, st: &mut State<T>, out: &mut Deferred) {
        st.recv_waiters.wake_all(out);
        st.stream_waiters.wake_all(out);
        self.sync_recv_flag(st);
    }

    // ----- items -----

    /// Push an item into a slot claimed for it. Returns the `rx` flags seen after the push
    /// (the fence pairs with the one in [`queued_or_flag`](Shared::queued_or_flag) and in
    /// [`drop_receiver`](Shared::drop_receiver)).
    #[inline]
    fn push_claimed(&self, item: T) -> usize {
        self.ring.push(item);
        fence(Ordering::SeqCst);
        self.hot.rx.load(Ordering::Relaxed)
    }

    /// Record a push in the metrics; `depth`: update the depth gauge too. Only once the
    /// item is settled (the receivers it concerns woken, or it discarded): a recorder is
    /// user code, and one that panics must cost neither a wake nor the discard.
    #[inline]
    fn record_push(&self, depth: bool) {
        self.metrics.sent.increment(1);
        if depth {
            self.set_depth();
        }
    }

    /// Whether a send that claimed the slot after `occupied` others updates the depth
    /// gauge. The fast path samples it at every sixteenth of the capacity, and not more
    /// often than every 16 items (`depth_mask`): a gauge update reads the ring's two ends
    /// and swaps the gauge's word, cache lines every sender and receiver would contend on.
    /// Not when the channel was empty: the receiver that emptied it set the gauge. Receives
    /// and sends that find the channel full set it exactly, so the gauge lags the truth by
    /// less than one sampling step.
    #[inline]
    fn samples_depth(&self, occupied: usize) -> bool {
        occupied != 0 && occupied & self.depth_mask == 0
    }

    /// Push an item into a slot claimed for it, without the lock. `depth`: update the depth
    /// gauge.
    #[inline]
    fn enqueue(&self, item: T, depth: bool) {
        let rx = self.push_claimed(item);
        if rx != 0 {
            self.after_push(rx, depth);
        } else {
            self.record_push(depth);
        }
    }

    /// A push found a receiver waiting, or every receiver gone: wake it, or drop what is
    /// left (the push recorded with the discards, before the hook runs); then record it.
    #[cold]
    fn after_push(&self, rx: usize, depth: bool) {
        let mut out = Deferred::default();
        let mut st = self.lock();
        if rx & RX_GONE != 0 {
            self.discard_rest(st, 1);
        } else {
            self.wake_for_item(&mut st, &mut out);
            drop(st);
            // `out` wakes the receivers even if the recorder panics.
            self.record_push(depth);
        }
    }

    /// Push an item into a slot claimed for it, under the lock (the channel is open, so
    /// receivers are not gone).
    fn enqueue_locked(
        &self,
        st: &mut State<T>,
        item: T,
        out: &mut Deferred,
        moves: &mut Moves<'_, T>,
    ) {
        if self.push_claimed(item) & RECV_WAIT != 0 {
            self.wake_for_item(st, out);
        }
        moves.pushed();
    }

    /// The oldest queued item (under the lock).
    fn pop_oldest(&self, st: &mut State<T>) -> Option<T> {
        self.pop_oldest_placed(st).map(|(_, item)| item)
    }

    /// The oldest queued item with its place in the queue (under the lock).
    fn pop_oldest_placed(&self, st: &mut State<T>) -> Option<(u64, T)> {
        match st.stash.pop_front() {
            Some(placed) => {
                self.depth_extra.fetch_sub(1, Ordering::Relaxed);
                self.stashed.fetch_sub(1, Ordering::Relaxed);
                Some(placed)
            }
            None => {
                let item = self.ring.pop(&mut st.popper)?;
                let place = st.ring_taken;
                st.ring_taken += 1;
                Some((place, item))
            }
        }
    }

    /// The place in the queue of the oldest queued item (if any: else of the next one).
    fn oldest_place(st: &State<T>) -> u64 {
        st.stash.front().map_or(st.ring_taken, |(place, _)| *place)
    }

    /// Count a dropped item and pass it to the hook with `why`. Called without the lock.
    fn dropped(&self, item: T, why: Dropped, counter: &Counter) {
        counter.increment(1);
        if let Some(hook) = &self.on_drop {
            hook.call(item, &why);
        }
    }

    /// Every receiver is gone: drop what is queued through `on_drop` (`Discarded`), after
    /// releasing the lock. Every item is counted (in `stats` and the metric) before the
    /// hook sees the first: a hook that panics leaves none uncounted (the items after it
    /// are dropped as the panic unwinds, without the hook). `pushed`: items the caller
    /// pushed, recorded in `sent_total` with them.
    fn discard_rest(&self, mut st: MutexGuard<'_, State<T>>, pushed: u64) {
        let mut left: Vec<T> = st.stash.drain(..).map(|(_, item)| item).collect();
        while let Some(item) = self.ring.pop(&mut st.popper) {
            left.push(item);
        }
        st.dropped += left.len() as u64;
        self.depth_extra.store(0, Ordering::Relaxed);
        self.stashed.store(0, Ordering::Relaxed);
        drop(st);
        self.metrics.dropped_closed.increment(left.len() as u64);
        self.metrics.sent.increment(pushed);
        self.set_depth();
        if let Some(hook) = &self.on_drop {
            for item in left {
                hook.call(item, &Dropped::Discarded);
            }
        }
    }

    /// Close for new sends and collect every waiter to wake.
    fn close_locked(&self, st: &mut State<T>, out: &mut Deferred) {
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

#[cfg(all(test, feature = "metrics"))]
mod tests {
    use super::*;

    /// A gauge update reads the depth, then sets it, without the lock (a sampled send,
    /// a batch used up) or beside setters that hold it (receives): one preempted between
    /// the two steps sets what it read after a receive has set the depth since. Here it
    /// read 40 before the receives took every item, and set it after them: the gauge must
    /// not keep showing 40 items in an empty, idle channel (nothing sets it again until
    /// the next receive or sampled send).
    #[test]
    fn a_depth_read_before_a_receive_and_set_after_it_does_not_stay_on_the_gauge() {
        let shared = Shared::<u32>::new(64, Overflow::Backpressure, None, Some("depth".into()));
        for i in 0..40 {
            shared.try_send(i).unwrap();
        }
        let stale = shared.depth();
        assert_eq!(stale, 40);
        for i in 0..40 {
            assert_eq!(shared.try_recv(), Ok(i));
        }
        assert_eq!(shared.metrics.depth.value(), 0.0, "the receives set it");
        shared.publish_depth(stale);
        assert_eq!(shared.metrics.depth.value(), 0.0, "an empty channel");
    }
}
