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
//! As before, no user code runs under the lock but a waker's `clone` (see
//! [`WaitQueue`]): wakers and the `on_drop` hook run after it is released (see
//! [`Deferred`]), and so does the metrics recorder (see [`Moves`]). A `clone` that panics
//! there leaves at most a `SEND_WAIT` or `RECV_WAIT` with nobody queued behind it (the
//! count was full, or the queue empty, anyway), cleared by the next free or push under the
//! lock.
//!
//! # Files
//!
//! This file holds the state and what reads it; `slots` claims and frees slots (and
//! closes), `items` pushes and pops items, `wake` wakes waiting receivers, `metrics`
//! records the metrics, and `send` and `recv` are the two sides' operations.

use std::collections::VecDeque;
use std::fmt;
use std::sync::PoisonError;
use std::task::Waker;

use crate::channel::error::{ReserveError, SendError, Sent, Stats, TryRecvError};
use crate::channel::ring::{Popper, Ring};
use crate::channel::wait::{WaitQueue, Waiting};
use crate::dropped::{Dropped, OnDrop};
use crate::metrics::{Counter, Gauge, Labels};
use crate::overflow::Overflow;
use crate::sync::{Arc, AtomicUsize, Deferred, Mutex, MutexGuard, Ordering, fence};

mod items;
mod metrics;
mod recv;
mod send;
mod slots;
mod wake;

use metrics::Moves;

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
/// How many items of one receiver's batch it has not handed out yet, for `len()`; and the
/// waker of an adapter over the receiver that watches for the channel's end (see
/// [`Shared::watch_end`]).
///
/// The length is written only by its receiver (a plain store: under the lock when a batch
/// is taken or given back, without it as items are handed out), read by `len()`. On its own
/// cache line, so the receiver's stores touch nothing the senders use. The end watcher is
/// touched only under the channel's lock, when an adapter that may not take an item reads
/// the receiver's `size_hint` and when the channel closes or ends: never per item.
#[derive(Debug)]
#[repr(align(128))]
pub(crate) struct BatchLen {
    len: AtomicUsize,
    end: Mutex<Option<Waker>>,
}

impl Default for BatchLen {
    fn default() -> Self {
        BatchLen {
            len: AtomicUsize::new(0),
            end: Mutex::new(None),
        }
    }
}

impl BatchLen {
    /// The receiver now has `n` items of its batch left.
    #[inline]
    pub(crate) fn set(&self, n: usize) {
        self.len.store(n, Ordering::Relaxed);
    }

    fn get(&self) -> usize {
        self.len.load(Ordering::Relaxed)
    }

    /// Put `waker` in as the end watcher; the one it replaces, if any.
    fn watch_end(&self, waker: Waker) -> Option<Waker> {
        self.end
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .replace(waker)
    }

    /// Whether `waker` (its task) is the end watcher already.
    fn watching(&self, waker: &Waker) -> bool {
        self.end
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .is_some_and(|w| w.will_wake(waker))
    }

    /// Take the end watcher out, to wake it.
    fn take_end(&self) -> Option<Waker> {
        self.end
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
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

// Unwind-safe for every `T`, as tokio declares its channel state: no user code but a
// waker's `clone` runs under the lock (hooks and wakers run after it is released, see
// `Deferred`; a panicking `clone` leaves at most a flag the next free or push clears), so a
// panic leaves the state consistent, and a poisoned lock is used as it is (`lock`). The channel only
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

    /// Whether an item is queued: in the ring, or given back (read without the lock; for a
    /// receiver's spin).
    pub(crate) fn has_queued_item(&self) -> bool {
        self.stashed.load(Ordering::Relaxed) > 0 || self.ring.len() > 0
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.hot.state.load(Ordering::SeqCst) & CLOSED != 0
    }

    /// Whether every receiver is gone (set under the lock as the last one drops, after the
    /// close; a send racing that drop may not see it yet, and its item is then discarded).
    pub(crate) fn receivers_gone(&self) -> bool {
        self.hot.rx.load(Ordering::SeqCst) & RX_GONE != 0
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

    /// How many items a receiver takes under one lock: under `Backpressure` up to 32, the
    /// whole of a smaller channel. The batch's slots stay occupied until it is handed out,
    /// so senders wait for it; at capacity 16 one lock per 16 items still beat one per 2
    /// (an eighth of the capacity, as before) by 1.2 to 1.6 times in the steady-state
    /// benches, where senders mostly wait anyway. Under the other policies, 1: they refuse
    /// or drop an item when the channel is full, and the slots a batch holds for items
    /// already handed out would make it full while it holds fewer items than its capacity
    /// (a slow consumer's batch of 8 in a channel of 8, 6 of them handed out: every send
    /// dropped or refused with 2 items buffered). Under `DropOldest` a drop must also take
    /// the oldest item not yet handed out, and a batch is out of its reach.
    fn batch(&self) -> usize {
        if self.overflow == Overflow::Backpressure {
            self.capacity.clamp(1, 32)
        } else {
            1
        }
    }
}
