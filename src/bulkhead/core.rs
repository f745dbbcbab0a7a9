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
//! from its [`Verdict`](queue::Verdict), written under the lock as its entry leaves the
//! queue and read without it: a woken waiter takes its permit without the lock. A contended
//! acquisition takes the lock twice, as tokio's semaphore does: to queue, and (the
//! releaser) to grant.
//!
//! The parts: `queue` (the lists, each waiter's entry and verdict, its ticket), `wait` (the
//! waiting path: queue, poll the verdict, leave), `park` (the stream adapters' holders),
//! `moves` (the metrics, and their changes recorded after the lock); here, the state word,
//! the fast paths, releasing, granting, resizing and closing.

mod moves;
mod park;
mod queue;
mod wait;

use std::fmt;
use std::panic::AssertUnwindSafe;
use std::sync::PoisonError;
use std::time::Duration;

use crate::adaptive::Outcome;
use crate::bulkhead::adaptive::{Adaptive, AdaptiveStats, Grant};
use crate::bulkhead::error::{AcquireError, Priority};
use crate::bulkhead::stats::{BulkheadStats, Counts};
use crate::metrics::Counter;
use crate::sync::{AtomicU64, Deferred, Mutex, MutexGuard, Ordering, Panics};

use moves::{Metrics, Moves, publish_waiting};
pub(crate) use queue::Ticket;
use queue::Waiters;

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

/// `repr(C)` and aligned to a cache line: `state` and the first seven of `counts` (the
/// count of acquisitions admitted at once among them) share one, so that the fast path's
/// count adds to the line its compare-and-swap has just taken.
#[repr(C, align(64))]
pub(crate) struct Core {
    state: AtomicU64,
    /// How the acquisitions ended ([`BulkheadStats`]).
    counts: Counts,
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
            .field("waiting", &self.waiting())
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
    /// This leave took it out of the queue: the caller's own reason (a timeout, a drop) is
    /// its outcome, and is not counted yet.
    Removed,
    /// It had no place in the queue: never queued, or its outcome seen already (and
    /// counted).
    Unqueued,
    /// A permit had been granted to it (`reserve`: one of the critical reserve): the caller
    /// now owns that permit; its outcome is not counted yet.
    Permit { reserve: bool },
    /// It had been shed for critical work: the refusal, counted.
    Shed(AcquireError),
    /// Closing had taken it out of the queue: its refusal is `Closed`, not counted yet.
    Closed,
}

/// What a poll of a waiting acquisition found.
pub(crate) enum Polled {
    /// A permit free at once (counted).
    Acquired,
    /// The permit it waited for (`reserve`: one of the critical reserve); the waiter counts
    /// it once it recorded its wait.
    Granted {
        reserve: bool,
    },
    /// Refused (counted).
    Refused(AcquireError),
    Pending,
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
            counts: Counts::default(),
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

    /// Count a refusal (in the stats and the metric).
    pub(crate) fn refuse(&self, why: AcquireError) -> AcquireError {
        self.counts.refused(why);
        self.metrics.rejected[why as usize].increment(1);
        why
    }

    /// Whether a permit `priority` takes in state `s` (before it is taken) is one of the
    /// critical reserve: one normal work could not have taken.
    #[inline]
    fn of_reserve(&self, s: u64, priority: Priority) -> bool {
        priority == Priority::Critical && in_flight_of(s) >= self.cap(max_of(s), Priority::Normal)
    }

    /// The counters of the stats: how the acquisitions ended.
    pub(crate) fn counts(&self) -> &Counts {
        &self.counts
    }

    /// The counts so far, with what the bulkhead holds now (its waiters are counted under
    /// the lock).
    pub(crate) fn stats(&self) -> BulkheadStats {
        let waiting = self.waiting();
        let s = self.state.load(Ordering::Acquire);
        let in_flight = in_flight_of(s);
        let reserve = in_flight
            .saturating_sub(self.cap(max_of(s), Priority::Normal))
            .min(self.reserve);
        self.counts
            .stats(in_flight as usize, waiting, reserve as usize)
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
                    // Counted first: a recorder that panics in `acquired` gives the
                    // permit back, and the acquisition has ended all the same.
                    self.counts.at_once(self.of_reserve(s, priority));
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
                    moves.taken = Some(self.of_reserve(s, priority));
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
        let (mut target, published) = adaptive.record(grant, outcome);
        // Another thread's sample may move the target between this thread's read and its
        // set, and that thread may apply its newer target first: after each set, look again,
        // so that whoever sets last leaves the latest target applied. A set that panics (a
        // waker woken by the raised limit, a metrics recorder) has applied its target all
        // the same, and the look again must still come: the newer target may be nobody
        // else's to apply (its thread found the limit at it before this set landed).
        let mut panics = Panics::new();
        while target != self.max_in_flight() {
            panics.run(|| self.set_max_in_flight(target));
            target = adaptive.target();
        }
        // The metrics last: a recorder that panics cannot keep the target from the bulkhead.
        panics.run(|| published.publish());
        panics.resume();
    }

    /// Return a permit of an adaptive bulkhead dropped without a sample, and feed its
    /// [`Outcome::Ignored`] sample: each even if the other panics (returning it runs a
    /// waker and a metrics recorder), or the sample would be lost from the counts.
    pub(crate) fn release_ignored(&self, grant: Grant) {
        let mut panics = Panics::new();
        panics.run(|| self.release());
        panics.run(|| self.record(grant, Outcome::Ignored));
        panics.resume();
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
                w.grant_front(priority, self.of_reserve(s, priority), out);
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
