//! The bulkhead core: an atomic fast path and a locked wait queue.
//!
//! `state` packs the permits in flight, the current `max_in_flight` and two flags into one `u64`.
//! Acquiring and releasing without contention is one compare-and-swap. As soon as anyone
//! waits, the `WAITERS` flag sends every acquirer and releaser through the mutex, where
//! freed permits are *granted* to waiters in priority-then-FIFO order (the permit is counted
//! in flight in the waiter's name before it is woken), so a newcomer never takes a permit a
//! waiter is owed.
//!
//! A waiter learns what the queue decided for it (a permit, or a refusal for critical work)
//! from its [`Verdict`], written under the lock as its entry leaves the queue and read
//! without it: a woken waiter takes its permit without the lock. A contended acquisition
//! takes the lock twice, as tokio's semaphore does: to queue, and (the releaser) to grant.

use std::fmt;
use std::panic::AssertUnwindSafe;
use std::sync::PoisonError;
use std::task::Context;
use std::time::Duration;

use crate::adaptive::Outcome;
use crate::bulkhead::adaptive::{Adaptive, AdaptiveStats, Grant};
use crate::bulkhead::error::{AcquireError, Priority};
use crate::metrics::{Counter, Gauge, Histogram, Labels, Tally};
use crate::sync::{
    Arc, AtomicU64, AtomicUsize, Cancelled, Deferred, Key, Mutex, MutexGuard, Ordering, Status,
    WaiterList,
};

const COUNT_BITS: u32 = 31;
/// The largest `max_in_flight` a bulkhead accepts.
pub(crate) const MAX_PERMITS: u32 = (1 << COUNT_BITS) - 1;
const COUNT_MASK: u64 = MAX_PERMITS as u64;
const WAITERS: u64 = 1 << 62;
const CLOSED: u64 = 1 << 63;

fn in_flight_of(s: u64) -> u32 {
    (s & COUNT_MASK) as u32
}

fn max_of(s: u64) -> u32 {
    ((s >> COUNT_BITS) & COUNT_MASK) as u32
}

/// Names of the bulkhead metrics.
pub(crate) mod names {
    pub(crate) const IN_FLIGHT: &str = "flowgate_bulkhead_in_flight";
    pub(crate) const WAITING: &str = "flowgate_bulkhead_waiting";
    pub(crate) const REJECTED: &str = "flowgate_bulkhead_rejected_total";
    pub(crate) const WAIT_SECONDS: &str = "flowgate_bulkhead_wait_seconds";
    pub(crate) const DISCARDED: &str = "flowgate_bulkhead_discarded_total";
}

struct Metrics {
    /// Moved by each permit taken and returned; the core takes back what is left (permits
    /// forgotten) when it is dropped.
    in_flight: Tally,
    waiting: Gauge,
    rejected: [Counter; 4],
    wait: Histogram,
    /// Items the stream adapters let go of unprocessed (see `Feed`).
    discarded: Counter,
}

impl Metrics {
    fn new(name: Option<&str>) -> Metrics {
        let l = Labels::new(name);
        let rejected = |r: AcquireError| l.counter(names::REJECTED, &[("reason", r.as_str())]);
        Metrics {
            in_flight: l.tally(names::IN_FLIGHT, &[]),
            waiting: l.gauge(names::WAITING, &[]),
            rejected: [
                rejected(AcquireError::WaitingRoomFull),
                rejected(AcquireError::TimedOut),
                rejected(AcquireError::Closed),
                rejected(AcquireError::NoPermit),
            ],
            wait: l.histogram(names::WAIT_SECONDS, &[]),
            discarded: l.counter(names::DISCARDED, &[]),
        }
    }
}

/// The metric changes made under the waiters' lock, recorded after it: a metrics recorder
/// is user code (an exporter that reads the bulkhead's `waiting()` takes the lock again).
/// Declare it before the lock's guard, so it is dropped, and records, after the guard. The
/// `waiting` gauge moves by the change from the length last published (worked out under the
/// lock): changes commute, so it ends at the latest length whichever thread records last.
struct Moves<'a> {
    core: &'a Core,
    /// Permits taken (+) and returned (−).
    in_flight: i64,
    waiting: f64,
    rejected: [u64; 4],
    /// A permit taken for the caller, which nobody holds until this call returns: given back
    /// if the recorder panics.
    taken: bool,
}

impl<'a> Moves<'a> {
    fn new(core: &'a Core) -> Moves<'a> {
        Moves {
            core,
            in_flight: 0,
            waiting: 0.0,
            rejected: [0; 4],
            taken: false,
        }
    }

    /// Count a refusal (after the lock).
    fn refuse(&mut self, why: AcquireError) -> AcquireError {
        self.rejected[why as usize] += 1;
        why
    }

    fn record(&self) {
        let metrics = &self.core.metrics;
        if self.in_flight != 0 {
            metrics.in_flight.add(self.in_flight as f64);
        }
        if self.waiting != 0.0 {
            metrics.waiting.add(self.waiting);
        }
        for (counter, &n) in metrics.rejected.iter().zip(&self.rejected) {
            if n > 0 {
                counter.increment(n);
            }
        }
    }
}

impl Drop for Moves<'_> {
    fn drop(&mut self) {
        if self.taken {
            self.core.holding(|| self.record());
        } else {
            self.record();
        }
    }
}

/// A waiter's entry: what it is, and where its verdict goes.
struct Waiter {
    /// A waiting-room waiter (`true`), or a stream adapter's (outside the room, never shed).
    bounded: bool,
    verdict: Arc<Verdict>,
}

/// What the queue decided for a waiter, shared by its entry and its [`Ticket`]: written
/// under the lock as the entry leaves the queue, before the waiter is woken; read by the
/// waiter without the lock (a verdict, once written, never changes). An entry that left
/// the queue with its verdict still undecided was taken out by the close.
#[derive(Debug, Default)]
pub(crate) struct Verdict(AtomicUsize);

/// A verdict decided (undecided is 0 in a [`Verdict`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Decided {
    /// A permit, counted in flight in the waiter's name: the waiter owns it.
    Permit = 1,
    /// Shed for critical work: a refusal, counted when the waiter sees it.
    Shed = 2,
}

impl Verdict {
    fn set(&self, decided: Decided) {
        self.0.store(decided as usize, Ordering::Release);
    }

    fn get(&self) -> Option<Decided> {
        match self.0.load(Ordering::Acquire) {
            1 => Some(Decided::Permit),
            2 => Some(Decided::Shed),
            _ => None,
        }
    }
}

/// The queues, one [`WaiterList`] per priority. A permit freed goes to the front of the
/// critical queue, else of the normal one; it is counted in flight in the waiter's name and
/// the waiter is *granted*: taken out of the queue, its verdict set to a permit, woken. A
/// shed waiter is taken out the same way with a refusal. Every operation on one waiter is
/// O(1), by its key.
#[derive(Default)]
struct Waiters {
    critical: WaiterList<Waiter>,
    normal: WaiterList<Waiter>,
    /// Queued waiters of the stream adapters (normal priority): outside the waiting room.
    unbounded: usize,
    /// Stream adapters that wait for their own work to end (every permit in flight is
    /// theirs, or they keep as many outputs as the limit) or for their upstream (see
    /// [`Core::park`]): not waiters. Closing the bulkhead wakes them all (and empties the
    /// list); the limit growing wakes those whose entry says so (`true`: the former), which
    /// keep their places.
    parked: WaiterList<bool>,
    /// The length last added to the `waiting` gauge (see [`Moves`]).
    published: usize,
}

impl Waiters {
    fn len(&self) -> usize {
        self.critical.len() + self.normal.len()
    }

    /// Waiters in the waiting room (the adapters' waiters do not count).
    fn room(&self) -> usize {
        self.len() - self.unbounded
    }

    fn queue(&mut self, priority: Priority) -> &mut WaiterList<Waiter> {
        match priority {
            Priority::Critical => &mut self.critical,
            Priority::Normal => &mut self.normal,
        }
    }

    /// The queued waiter with this entry left the queue (granted, removed or shed).
    fn left(&mut self, waiter: &Waiter) {
        if !waiter.bounded {
            self.unbounded -= 1;
        }
    }

    /// Sheds the newest normal waiter in the waiting room, for a critical one: it is granted
    /// a refusal (woken through `out`). Walks back over the adapters' waiters queued after
    /// it, never over the room's.
    fn shed_newest_normal(&mut self, out: &mut Deferred) -> bool {
        let mut at = self.normal.back();
        while let Some(key) = at {
            if self.normal.get(key).is_some_and(|w| w.bounded) {
                return match self.normal.wake(key, out) {
                    Some(waiter) => {
                        waiter.verdict.set(Decided::Shed);
                        true
                    }
                    None => false,
                };
            }
            at = self.normal.prev(key);
        }
        false
    }

    /// Grant the front of `priority`'s queue.
    fn grant_front(&mut self, priority: Priority, out: &mut Deferred) {
        let Some((_, waiter)) = self.queue(priority).wake_front(out) else {
            return;
        };
        waiter.verdict.set(Decided::Permit);
        self.left(&waiter);
    }
}

/// A waiting acquisition's place in the queue: its priority's list, its key there, and its
/// verdict. Kept until the acquisition has seen its verdict (or left the queue).
#[derive(Debug, Default)]
pub(crate) struct Ticket(Option<(Priority, Key, Arc<Verdict>)>);

impl Ticket {
    /// Whether it holds a place in the queue (waiting, or decided and not seen yet).
    pub(crate) fn is_queued(&self) -> bool {
        self.0.is_some()
    }

    /// The verdict, if the queue decided one (read without the lock); the ticket is then
    /// spent.
    fn decided(&mut self) -> Option<Decided> {
        let decided = self.0.as_ref()?.2.get()?;
        self.0 = None;
        Some(decided)
    }
}

pub(crate) struct Core {
    state: AtomicU64,
    reserve: u32,
    max_waiting: usize,
    wait_timeout: Option<Duration>,
    waiters: Mutex<Waiters>,
    /// Bumped (under the lock) each time the parked holders are taken out of their list (at
    /// the close): a holder that parked since sees that its place is still there without
    /// taking the lock.
    parked_epoch: AtomicU64,
    name: Option<String>,
    metrics: Metrics,
    /// Set when the bulkhead is adaptive: every permit then records its grant and feeds a
    /// sample when it ends. `None` costs one branch per permit.
    adaptive: Option<Adaptive>,
}

impl Drop for Core {
    /// Take back from the `in_flight` gauge the permits still counted: those forgotten
    /// (`mem::forget` of a permit), which no release will ever subtract.
    fn drop(&mut self) {
        let left = in_flight_of(self.state.load(Ordering::Relaxed));
        if left > 0 {
            self.metrics.in_flight.add(-f64::from(left));
        }
    }
}

impl fmt::Debug for Core {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.state.load(Ordering::Relaxed);
        f.debug_struct("Bulkhead")
            .field("name", &self.name)
            .field("in_flight", &in_flight_of(s))
            .field("max_in_flight", &max_of(s))
            .field("critical_reserve", &self.reserve)
            .field("max_waiting", &self.max_waiting)
            .field("wait_timeout", &self.wait_timeout)
            .field("closed", &(s & CLOSED != 0))
            .field("adaptive", &self.adaptive)
            .finish()
    }
}

/// What [`Core::leave`] found: how a waiting acquisition that gave up left the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Left {
    /// This leave took it out of the queue (or it had no place there): the caller's own
    /// reason (a timeout) is its outcome, and is not counted yet.
    Removed,
    /// A permit had been granted to it: the caller now owns that permit.
    Permit,
    /// It had been shed for critical work: the refusal, counted.
    Shed(AcquireError),
    /// Closing had taken it out of the queue: its refusal is `Closed`, not counted yet.
    Closed,
}

/// What a poll of a waiting acquisition found.
pub(crate) enum Polled {
    Acquired,
    Refused(AcquireError),
    Pending,
}

/// The `waiting` gauge's change since it was last published, to record after the lock.
fn publish_waiting(w: &mut Waiters, moves: &mut Moves<'_>) {
    let len = w.len();
    moves.waiting += len as f64 - w.published as f64;
    w.published = len;
}

impl Core {
    pub(crate) fn new(
        max_in_flight: u32,
        reserve: u32,
        max_waiting: usize,
        wait_timeout: Option<Duration>,
        name: Option<String>,
        adaptive: Option<Adaptive>,
    ) -> Core {
        let max_in_flight = adaptive.as_ref().map_or(max_in_flight, Adaptive::initial);
        Core {
            adaptive,
            state: AtomicU64::new(u64::from(max_in_flight) << COUNT_BITS),
            reserve,
            max_waiting,
            wait_timeout,
            waiters: Mutex::new(Waiters::default()),
            parked_epoch: AtomicU64::new(0),
            metrics: Metrics::new(name.as_deref()),
            name,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Waiters> {
        self.waiters.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn wait_timeout(&self) -> Option<Duration> {
        self.wait_timeout
    }

    pub(crate) fn in_flight(&self) -> u32 {
        in_flight_of(self.state.load(Ordering::Acquire))
    }

    pub(crate) fn max_in_flight(&self) -> u32 {
        max_of(self.state.load(Ordering::Acquire))
    }

    pub(crate) fn reserve(&self) -> u32 {
        self.reserve
    }

    pub(crate) fn max_waiting(&self) -> usize {
        self.max_waiting
    }

    pub(crate) fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.state.load(Ordering::Acquire) & CLOSED != 0
    }

    pub(crate) fn waiting(&self) -> usize {
        self.lock().len()
    }

    /// Permits `priority` may use out of `max`.
    fn cap(&self, max: u32, priority: Priority) -> u32 {
        match priority {
            Priority::Critical => max,
            Priority::Normal => max.saturating_sub(self.reserve),
        }
    }

    pub(crate) fn refuse(&self, why: AcquireError) -> AcquireError {
        self.metrics.rejected[why as usize].increment(1);
        why
    }

    /// A permit was taken. The gauge moves by one rather than being set to the count this
    /// thread saw: changes recorded by racing threads, in any order, add up to the count.
    #[inline]
    fn acquired(&self) {
        self.holding(|| self.metrics.in_flight.add(1.0));
    }

    /// Record metrics (user code) for a permit just taken that nobody holds yet: if the
    /// recorder panics, the permit is given back before the panic goes on, or it would be
    /// lost for good.
    #[inline]
    pub(crate) fn holding(&self, record: impl FnOnce()) {
        if let Err(panic) = std::panic::catch_unwind(AssertUnwindSafe(record)) {
            self.release();
            std::panic::resume_unwind(panic);
        }
    }

    /// Whether a holder (a stream adapter, normal priority) may pass its permit straight on
    /// to its own next unit of work: nobody waits, the bulkhead is open, and what is held is
    /// within the normal share (a lowered `max_in_flight`, or the critical reserve, takes it back).
    #[inline]
    pub(crate) fn may_keep(&self) -> bool {
        let s = self.state.load(Ordering::Acquire);
        s & (WAITERS | CLOSED) == 0 && in_flight_of(s) <= self.cap(max_of(s), Priority::Normal)
    }

    /// Whether no permit is free for normal work and every one in flight is among the `own`
    /// that a holder's work holds for certain (a lower bound: more would count permits of
    /// others as its own): then only that work can free the next permit.
    #[inline]
    pub(crate) fn only_own_in_flight(&self, own: usize) -> bool {
        let s = self.state.load(Ordering::Acquire);
        let n = in_flight_of(s);
        n as usize <= own && n >= self.cap(max_of(s), Priority::Normal)
    }

    /// Park a holder that is `blocked` (checked here, under the lock) until its own work
    /// ends or its upstream yields, which wake it: its waker is kept here (its place in
    /// `key`) for the bulkhead closing, and, with `growth`, for `max_in_flight` growing too.
    /// Both take this lock, so neither slips between the check and the parking. `None`
    /// (nothing parked) if it is not blocked, or the bulkhead is closed; else the
    /// [`parked_epoch`] it parked in.
    ///
    /// [`parked_epoch`]: Core::parked_epoch
    pub(crate) fn park(
        &self,
        cx: &mut Context<'_>,
        key: &mut Option<Key>,
        growth: bool,
        blocked: impl FnOnce(&Core) -> bool,
    ) -> Option<u64> {
        // Declared before the lock: a replaced waker is dropped after it is released.
        let mut out = Deferred::default();
        let mut w = self.lock();
        if self.is_closed() || !blocked(self) {
            return None;
        }
        w.parked.register(key, cx.waker(), || growth, &mut out);
        if let Some(wants) = key.and_then(|key| w.parked.get_mut(key)) {
            *wants = growth;
        }
        Some(self.parked_epoch())
    }

    /// How many times the parked holders were taken out of their list: a holder parked in
    /// the current epoch is parked still.
    pub(crate) fn parked_epoch(&self) -> u64 {
        self.parked_epoch.load(Ordering::Acquire)
    }

    /// Wake the parked holders that wait for the limit to grow (through `out`), under the
    /// lock; they keep their places.
    fn wake_parked_for_growth(&self, w: &Waiters, out: &mut Deferred) {
        for (key, growth) in w.parked.iter() {
            if *growth {
                w.parked.notify(key, out);
            }
        }
    }

    /// Leave the parked holders (a holder dropped).
    pub(crate) fn unpark(&self, key: &mut Option<Key>) {
        if let Some(key) = key.take() {
            let mut out = Deferred::default();
            self.lock().parked.cancel(key, &mut out);
        }
    }

    /// One CAS when nobody waits and a permit is free; `None` means take the slow path.
    #[inline]
    pub(crate) fn try_fast(&self, priority: Priority) -> Option<Result<(), AcquireError>> {
        let mut s = self.state.load(Ordering::Acquire);
        loop {
            if s & (WAITERS | CLOSED) != 0 {
                return None;
            }
            if in_flight_of(s) >= self.cap(max_of(s), priority) {
                return None;
            }
            match self
                .state
                .compare_exchange_weak(s, s + 1, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    self.acquired();
                    return Some(Ok(()));
                }
                Err(now) => s = now,
            }
        }
    }

    /// Take a permit if this priority may have one right now, respecting the queue.
    fn try_locked(
        &self,
        w: &Waiters,
        priority: Priority,
        moves: &mut Moves<'_>,
    ) -> Option<Result<(), AcquireError>> {
        let ahead = match priority {
            Priority::Critical => !w.critical.is_empty(),
            Priority::Normal => w.len() > 0,
        };
        let mut s = self.state.load(Ordering::Acquire);
        loop {
            if s & CLOSED != 0 {
                return Some(Err(moves.refuse(AcquireError::Closed)));
            }
            if ahead || in_flight_of(s) >= self.cap(max_of(s), priority) {
                return None;
            }
            match self
                .state
                .compare_exchange(s, s + 1, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    moves.in_flight += 1;
                    moves.taken = true;
                    return Some(Ok(()));
                }
                Err(now) => s = now,
            }
        }
    }

    /// `try_acquire`: a permit now or `NoPermit`; never waits.
    #[inline]
    pub(crate) fn try_acquire(&self, priority: Priority) -> Result<(), AcquireError> {
        match self.try_fast(priority) {
            Some(r) => r,
            None => self.try_acquire_slow(priority),
        }
    }

    #[cold]
    fn try_acquire_slow(&self, priority: Priority) -> Result<(), AcquireError> {
        let mut moves = Moves::new(self);
        let w = self.lock();
        self.try_locked(&w, priority, &mut moves)
            .unwrap_or_else(|| Err(moves.refuse(AcquireError::NoPermit)))
    }

    fn set_flag(&self, flag: u64, on: bool) {
        if on {
            self.state.fetch_or(flag, Ordering::AcqRel);
        } else {
            self.state.fetch_and(!flag, Ordering::AcqRel);
        }
    }

    /// Poll an acquisition that found no fast permit: take one, queue, or refuse. Unbounded
    /// acquisitions (the stream adapters' backpressure) skip the waiting room's size.
    pub(crate) fn poll_acquire(
        &self,
        cx: &mut Context<'_>,
        priority: Priority,
        bounded: bool,
        ticket: &mut Ticket,
    ) -> Polled {
        // Decided since it last looked: no lock to take.
        if let Some(verdict) = ticket.decided() {
            return self.polled(verdict);
        }
        // Declared before the lock: the wakers go after it is released.
        let mut out = Deferred::default();
        let mut moves = Moves::new(self);
        let mut w = self.lock();
        if let Some((priority, key, _)) = ticket.0 {
            return self.poll_queued(&mut w, cx, (priority, key), ticket, &mut out, &mut moves);
        }
        // Flag first, so releasers that race us come through the lock and see the queue.
        self.set_flag(WAITERS, true);
        if let Some(r) = self.try_locked(&w, priority, &mut moves) {
            if w.len() == 0 {
                self.set_flag(WAITERS, false);
            }
            return match r {
                Ok(()) => Polled::Acquired,
                Err(why) => Polled::Refused(why),
            };
        }
        // A full room sheds its newest normal waiter for critical work, never the
        // reverse (and never an adapter's waiter: adapters wait, they are not refused).
        if bounded
            && w.room() >= self.max_waiting
            && !(priority == Priority::Critical && w.shed_newest_normal(&mut out))
        {
            if w.len() == 0 {
                self.set_flag(WAITERS, false);
            }
            return Polled::Refused(moves.refuse(AcquireError::WaitingRoomFull));
        }
        let verdict = Arc::new(Verdict::default());
        let key = w.queue(priority).push_back(
            cx.waker(),
            Waiter {
                bounded,
                verdict: verdict.clone(),
            },
        );
        if !bounded {
            w.unbounded += 1;
        }
        ticket.0 = Some((priority, key, verdict));
        publish_waiting(&mut w, &mut moves);
        Polled::Pending
    }

    fn poll_queued(
        &self,
        w: &mut Waiters,
        cx: &mut Context<'_>,
        (priority, key): (Priority, Key),
        ticket: &mut Ticket,
        out: &mut Deferred,
        moves: &mut Moves<'_>,
    ) -> Polled {
        let q = w.queue(priority);
        match q.status(key) {
            Status::Waiting if !self.is_closed() => {
                q.refresh(key, cx.waker(), out);
                return Polled::Pending;
            }
            Status::Waiting => {
                // Closed, and not taken out yet: out now, refused below.
                if let Cancelled::Waiting(waiter) = q.cancel(key, out) {
                    w.left(&waiter);
                    self.settle(w, moves);
                }
            }
            // Out of the queue: decided between the look before the lock and the lock
            // (read again below), or taken out by the close.
            Status::Granted | Status::Gone => {}
        }
        match ticket.decided() {
            Some(verdict) => self.polled(verdict),
            None => {
                // Closing removes every queued waiter; its next poll is refused.
                ticket.0 = None;
                Polled::Refused(moves.refuse(AcquireError::Closed))
            }
        }
    }

    /// What a waiter's verdict means to its poll (a refusal counted now).
    fn polled(&self, decided: Decided) -> Polled {
        match decided {
            Decided::Permit => Polled::Acquired,
            Decided::Shed => Polled::Refused(self.refuse(AcquireError::WaitingRoomFull)),
        }
    }

    /// A waiting acquisition gave up (dropped or timed out): what the queue had decided for
    /// it, if anything, since it last looked. Under the lock, so exactly one outcome wins:
    /// this leave, or the grant, shed or close that took it out of the queue first.
    pub(crate) fn leave(&self, ticket: &mut Ticket) -> Left {
        let Some((priority, key, verdict)) = ticket.0.take() else {
            return Left::Removed;
        };
        let left = |decided| match decided {
            Decided::Permit => Left::Permit,
            // Shed, and gone before it polled again: still a refusal.
            Decided::Shed => Left::Shed(self.refuse(AcquireError::WaitingRoomFull)),
        };
        // Decided already: no lock to take.
        if let Some(decided) = verdict.get() {
            return left(decided);
        }
        let mut out = Deferred::default();
        let mut moves = Moves::new(self);
        let mut w = self.lock();
        if let Cancelled::Waiting(waiter) = w.queue(priority).cancel(key, &mut out) {
            w.left(&waiter);
            self.settle(&mut w, &mut moves);
            return Left::Removed;
        }
        // Out of the queue before this lock: decided since the look above, or closed.
        verdict.get().map_or(Left::Closed, left)
    }

    /// The grant of a permit taken now: `Some` only when the bulkhead is adaptive.
    #[inline]
    pub(crate) fn start(&self) -> Option<Grant> {
        self.adaptive
            .as_ref()
            .map(|_| Grant::now(self.in_flight().max(1)))
    }

    /// Feed the adaptive algorithm the call granted at `grant`, ended now with `outcome`,
    /// and apply the `max_in_flight` it answers. Called with no lock held; the algorithm
    /// runs under its own lock, never under the waiters' lock.
    pub(crate) fn record(&self, grant: Grant, outcome: Outcome) {
        let Some(adaptive) = &self.adaptive else {
            return;
        };
        let mut target = adaptive.record(grant, outcome);
        // Another thread's sample may move the target between this thread's read and its
        // set, and that thread may apply its newer target first: after each set, look again,
        // so that whoever sets last leaves the latest target applied.
        while target != self.max_in_flight() {
            self.set_max_in_flight(target);
            target = adaptive.target();
        }
    }

    pub(crate) fn adaptive_stats(&self) -> Option<AdaptiveStats> {
        self.adaptive.as_ref().map(Adaptive::stats)
    }

    /// The counter of items the stream adapters let go of unprocessed, for an adapter to
    /// count its own (`flowgate_bulkhead_discarded_total`).
    pub(crate) fn discarded_counter(&self) -> Counter {
        self.metrics.discarded.clone()
    }

    pub(crate) fn record_wait(&self, waited: Duration) {
        self.metrics.wait.record(waited.as_secs_f64());
    }

    /// Return one permit: one CAS when nobody waits, else hand it on under the lock.
    #[inline]
    pub(crate) fn release(&self) {
        let mut s = self.state.load(Ordering::Acquire);
        while s & WAITERS == 0 {
            match self
                .state
                .compare_exchange_weak(s, s - 1, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    self.metrics.in_flight.add(-1.0);
                    return;
                }
                Err(now) => s = now,
            }
        }
        self.release_slow();
    }

    #[cold]
    fn release_slow(&self) {
        let mut out = Deferred::default();
        let mut moves = Moves::new(self);
        let mut w = self.lock();
        self.state.fetch_sub(1, Ordering::AcqRel);
        moves.in_flight -= 1;
        // One permit came back: at most one waiter can be served.
        self.grant_next(&mut w, &mut out, &mut moves);
        self.settle(&mut w, &mut moves);
    }

    /// Hand one free permit to the next waiter (critical first, then normal, FIFO within
    /// each), if there is a free permit and a waiter; false if not.
    fn grant_next(&self, w: &mut Waiters, out: &mut Deferred, moves: &mut Moves<'_>) -> bool {
        loop {
            let s = self.state.load(Ordering::Acquire);
            let (n, max) = (in_flight_of(s), max_of(s));
            let priority = if !w.critical.is_empty() && n < max {
                Priority::Critical
            } else if !w.normal.is_empty() && n < self.cap(max, Priority::Normal) {
                Priority::Normal
            } else {
                return false;
            };
            if self
                .state
                .compare_exchange(s, s + 1, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                moves.in_flight += 1;
                w.grant_front(priority, out);
                return true;
            }
        }
    }

    /// After the queue changed: clear the flag if nobody waits, update the gauge.
    fn settle(&self, w: &mut Waiters, moves: &mut Moves<'_>) {
        if w.len() == 0 {
            self.set_flag(WAITERS, false);
        }
        publish_waiting(w, moves);
    }

    /// Change `max_in_flight`; a larger one wakes waiters at once, and the holders parked
    /// for it.
    pub(crate) fn set_max_in_flight(&self, max: u32) {
        let mut out = Deferred::default();
        let mut moves = Moves::new(self);
        let mut w = self.lock();
        let mut s = self.state.load(Ordering::Acquire);
        loop {
            let next = (s & !(COUNT_MASK << COUNT_BITS)) | (u64::from(max) << COUNT_BITS);
            match self
                .state
                .compare_exchange(s, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => break,
                Err(now) => s = now,
            }
        }
        // Hand every free permit to waiters.
        while self.grant_next(&mut w, &mut out, &mut moves) {}
        if max > max_of(s) {
            self.wake_parked_for_growth(&w, &mut out);
        }
        self.settle(&mut w, &mut moves);
    }

    /// Refuse new acquisitions and wake every waiter (they fail with `Closed`). Permits in
    /// flight stay valid.
    pub(crate) fn close(&self) {
        let mut out = Deferred::default();
        let mut moves = Moves::new(self);
        let mut w = self.lock();
        self.set_flag(CLOSED, true);
        // Queued waiters are removed and woken; their next poll sees `closed`. Grants not
        // yet claimed stay valid: their waiters take the permits.
        w.critical.wake_all(&mut out);
        w.normal.wake_all(&mut out);
        // The parked holders too, out of their list (their places go stale: a new epoch).
        if !w.parked.is_empty() {
            w.parked.wake_all(&mut out);
            self.parked_epoch.fetch_add(1, Ordering::AcqRel);
        }
        w.unbounded = 0;
        self.set_flag(WAITERS, false);
        publish_waiting(&mut w, &mut moves);
    }
}

#[cfg(test)]
mod tests {
    use std::task::{Context, Waker};

    use super::*;

    /// Issue 20: 40,000 waiting acquisitions leave newest first, the worst order for a
    /// queue scanned from the front; the slots the waiter list visits, counted, stay a
    /// small constant per leave (a scan would visit 20,000 on average).
    #[test]
    fn forty_thousand_leaves_are_linear() {
        const N: usize = 40_000;
        let core = Core::new(1, 0, usize::MAX, None, None, None);
        core.try_acquire(Priority::Normal).unwrap();
        let mut cx = Context::from_waker(Waker::noop());
        let mut tickets: Vec<Ticket> = (0..N).map(|_| Ticket::default()).collect();
        for t in &mut tickets {
            let polled = core.poll_acquire(&mut cx, Priority::Normal, true, t);
            assert!(matches!(polled, Polled::Pending));
        }
        let before = core.lock().normal.steps();
        for t in tickets.iter_mut().rev() {
            assert_eq!(core.leave(t), Left::Removed, "nobody was granted a permit");
        }
        let per_leave = (core.lock().normal.steps() - before) as f64 / N as f64;
        assert!(per_leave <= 8.0, "{per_leave} slots visited per leave");
        assert_eq!(core.waiting(), 0);
    }
}
