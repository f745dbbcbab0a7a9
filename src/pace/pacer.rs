//! `Pacer`: a shared leaky bucket with a FIFO queue of waiters.

use std::fmt;
use std::sync::PoisonError;
use std::task::{Context, Waker};
use std::time::Duration;

use tokio::time::Instant;

use crate::decision::Decision;
use crate::error::{ConfigError, ConfigErrorKind, CostError};
use crate::limit::{Algorithm, TokenBucket, TokenBucketState};
use crate::metrics::{Counter, Histogram, Labels};
use crate::pace::until_ready::UntilReady;
use crate::rate::{Quota, Rate};
use crate::sync::{Arc, Deferred, Key, Mutex, MutexGuard, Panics, WaiterList};
use crate::time::capped;

/// The timer lateness the default burst absorbs.
const DEFAULT_TOLERANCE: Duration = Duration::from_millis(5);

/// How long the first waiter may leave its turn unclaimed (its task not polling it) before
/// the one behind it steps over it.
const STALL_GRACE: Duration = Duration::from_millis(10);

/// Names of the pacing metrics.
pub(crate) mod names {
    pub(crate) const RELEASED: &str = "flowgate_pace_released_total";
    pub(crate) const LATENESS: &str = "flowgate_pace_lateness_seconds";
    pub(crate) const QUEUE_DEPTH: &str = "flowgate_pace_queue_depth";
    pub(crate) const DROPPED: &str = "flowgate_pace_dropped_total";
    /// The `policy` label of `DROPPED` for items let go of when their holder goes away (a
    /// `leaky_queue`'s queue, a `leaky`'s held item), as a channel's.
    pub(crate) const CLOSED: &str = "closed";
}

/// A waiting acquisition (its waker is kept by the list).
struct Waiter {
    cost: u32,
    /// Stepped over: it was first in line and left its turn unclaimed for `STALL_GRACE`.
    /// It takes its place back when it is polled again.
    absent: bool,
}

struct State {
    bucket: TokenBucket,
    gcra: TokenBucketState,
    /// Waiting acquisitions, FIFO; only the head (the first one not absent) may pass.
    /// Leaving the line is O(1) by key, wherever the waiter stands.
    waiters: WaiterList<Waiter>,
    /// The head, and since when it is the head.
    head: Option<(Key, Instant)>,
    /// The waiter right behind the head, which watches it (with a timer) in case it stalls.
    watcher: Option<Key>,
}

impl State {
    /// The waiters not stepped over, front to back. (Those stepped over are few: only a
    /// head that stalls is, and it takes its place back when polled.)
    fn present(&self) -> impl Iterator<Item = Key> {
        self.waiters
            .iter()
            .filter(|(_, w)| !w.absent)
            .map(|(key, _)| key)
    }

    fn push(&mut self, cost: u32, waker: &Waker) -> Key {
        self.waiters.push_back(
            waker,
            Waiter {
                cost,
                absent: false,
            },
        )
    }

    /// After the queue changed: note a new head (and since when) or a new watcher, and wake
    /// those that changed (through `out`), so each takes up its role (the head its turn, the
    /// watcher its timer).
    fn refresh(&mut self, now: Instant, out: &mut Deferred) {
        let (head, watcher) = {
            let mut present = self.present();
            (present.next(), present.next())
        };
        if head != self.head.map(|(key, _)| key) {
            if let Some(key) = head {
                self.waiters.notify(key, out);
            }
            self.head = head.map(|key| (key, now));
        }
        if watcher != self.watcher
            && let Some(key) = watcher
        {
            self.waiters.notify(key, out);
        }
        self.watcher = watcher;
    }

    /// Wake the head and its watcher (through `out`): they recompute their times.
    fn wake_head_and_watcher(&self, out: &mut Deferred) {
        for key in self.present().take(2) {
            self.waiters.notify(key, out);
        }
    }
}

pub(crate) struct Inner {
    state: Mutex<State>,
    epoch: Instant,
    name: Option<String>,
    released: Counter,
    lateness: Histogram,
}

/// A waiting acquisition: its place in the queue and the time it is due.
#[derive(Debug, Default)]
pub(crate) struct Ticket {
    id: Option<Key>,
    due: Option<Instant>,
    /// Passed, and a metrics recorder panicked as the release was recorded (the panic went
    /// on before the caller saw `Admit::Now`): the units are taken, and the next poll is
    /// through without taking them again.
    passed: bool,
}

impl Ticket {
    pub(crate) fn is_waiting(&self) -> bool {
        self.id.is_some()
    }

    /// Whether the last attempt passed and a recorder's panic kept that from its caller
    /// (see `passed`); clears it.
    pub(crate) fn take_passed(&mut self) -> bool {
        std::mem::take(&mut self.passed)
    }
}

/// What one attempt to pass found.
#[derive(Debug)]
pub(crate) enum Admit {
    /// Passed; the cost is consumed.
    Now,
    /// This acquisition is first in line and is due at this instant: sleep until then.
    At(Instant),
    /// Others are ahead; the task is woken when it is first in line. The waiter right
    /// behind the first one also gets the instant at which to look again: the first one has
    /// left its turn unclaimed by then, and is stepped over.
    Queued(Option<Instant>),
}

/// A shared leaky bucket: releases units at a constant rate, in FIFO order across every task
/// and stream that uses it.
///
/// The schedule is GCRA in exact integer time (see [`TokenBucket`]): unit `i` is due at
/// `T0 + i / rate`, and a release may run at most `burst − 1` units ahead of that schedule.
/// Waiting never accumulates timer error: a late wake-up releases every unit that is due,
/// up to the burst, and the schedule stays anchored.
///
/// # Guarantees
///
/// (a) In any interval of length `w`, released cost ≤ `burst + rate·w`.
/// (b) No unit is released before its due time minus the burst tolerance
///     (`(burst − 1) / rate`).
/// (c) Waiters are served in FIFO order across tasks, as long as their tasks poll them: a
///     first waiter that leaves its turn unclaimed for 10 ms (a `leaky_with` stream kept in
///     a `select!` loop whose other branch runs long) is stepped over by the one behind it,
///     which watches it with a timer, so it cannot hold up everyone; it takes its place back
///     when it is polled again. (If the one behind it is not polled either, the line moves
///     on when either of them is polled or dropped, or when anyone else polls the pacer.)
///     An item above the burst (`leaky_cost`) waits in line for one chunk of at most the
///     burst at a time, so its turn, and the 10 ms after it, are those of its next chunk,
///     never of its whole cost; a cost that can never pass is refused before it queues.
///     [`check`](Pacer::check) never jumps the line either: it refuses while others wait.
/// (d) Every wait is cancel-safe: a dropped waiter holds no reservation.
///
/// # Burst and precision
///
/// The default burst is `1 + ceil(rate × 5 ms)` (so at least 2: at low rates two units may
/// leave together after an idle spell), enough tolerance to absorb the lateness of a 1 ms
/// timer, so the long-run rate is exact from 1/s to 1M/s as
/// long as the task is never kept from running for more than 5 ms (the tolerance cannot be
/// caught up after a longer stall without breaking guarantee (a); on a heavily loaded host
/// give a larger burst). Above 1 000/s units leave in small on-time batches, one batch per
/// timer tick. With a backlog, units run up to `(burst − 1) / rate` ahead of the `T0 + i/rate`
/// schedule (guarantee (b)). With `burst(1)` spacing is strict but each wait loses its
/// timer's lateness (a tokio timer ends on its next 1 ms tick, so up to 1 ms), so the
/// long-run rate falls short by about `lateness × rate`: ≈0.1% at 1/s, up to 10% at
/// 100/s, and at most one unit per tick above that: 800/s runs at about 500/s, 1M/s at
/// about 1000/s. Strict spacing is for slow rates; above ~10/s keep a burst of at least 2.
/// The same holds for waits of the whole burst at any burst (`until_ready(burst)` in a
/// loop): each needs a full bucket, and what the timer's lateness would have added is lost.
/// Ask for less than the burst at a time (an item above the burst under
/// [`leaky_cost`](crate::FlowStreamExt::leaky_cost) pays in chunks of half of it).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use flowgate::pace::Pacer;
/// use flowgate::Rate;
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let pacer = Pacer::builder(Rate::per_second(10)?).burst(1).build()?;
/// let start = tokio::time::Instant::now();
/// for _ in 0..5 {
///     pacer.until_ready(1).await?;
/// }
/// assert_eq!(start.elapsed(), Duration::from_millis(400)); // 0, 100, 200, 300, 400 ms
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Pacer {
    inner: Arc<Inner>,
}

impl Pacer {
    /// A pacer at `rate` with the default burst (see the type's docs), that is, with the
    /// quota [`default_quota`](Pacer::default_quota)`(rate)`.
    pub fn new(rate: Rate) -> Pacer {
        Pacer::with_quota(Pacer::default_quota(rate), None)
    }

    /// The quota of a pacer at `rate` with the default burst, `1 + ceil(rate × 5 ms)` (see
    /// the type's docs): what [`Pacer::new`] and a builder without a
    /// [`burst`](PacerBuilder::burst) use, and what to give [`set_quota`](Pacer::set_quota)
    /// to change the rate and keep the default burst.
    ///
    /// # Examples
    ///
    /// ```
    /// use flowgate::pace::Pacer;
    /// use flowgate::Rate;
    ///
    /// let quota = Pacer::default_quota(Rate::per_second(1_000)?);
    /// assert_eq!(quota.burst_size(), 6); // 1 + 1 000/s × 5 ms
    /// assert_eq!(Pacer::default_quota(Rate::per_second(1)?).burst_size(), 2);
    /// # Ok::<(), flowgate::ConfigError>(())
    /// ```
    pub fn default_quota(rate: Rate) -> Quota {
        // The default burst is at least 1, so `Quota::new` cannot refuse it.
        Quota::new(rate, default_burst(rate)).unwrap_or_else(|_| Quota::from(rate))
    }

    /// A builder for a pacer at `rate`.
    pub fn builder(rate: Rate) -> PacerBuilder {
        PacerBuilder {
            rate,
            burst: None,
            name: None,
        }
    }

    fn with_quota(quota: Quota, name: Option<String>) -> Pacer {
        let labels = Labels::new(name.as_deref());
        Pacer {
            inner: Arc::new(Inner {
                state: Mutex::new(State {
                    bucket: TokenBucket::new(quota),
                    gcra: TokenBucketState::default(),
                    waiters: WaiterList::new(),
                    head: None,
                    watcher: None,
                }),
                epoch: Instant::now(),
                released: labels.counter(names::RELEASED, &[]),
                lateness: labels.histogram(names::LATENESS, &[]),
                name,
            }),
        }
    }

    pub(crate) fn inner(&self) -> &Inner {
        &self.inner
    }

    /// Wait until `cost` units may pass, then take them.
    ///
    /// # Errors
    ///
    /// [`CostError::Zero`], and [`CostError::ExceedsCapacity`] when `cost` is above the
    /// burst (it could never pass; this never waits forever). Both are returned by the first
    /// poll, before the future queues; the second also if [`set_quota`](Pacer::set_quota)
    /// lowers the burst below `cost` while it waits (the future then leaves the line).
    ///
    /// # Panics
    ///
    /// The future sleeps on a tokio timer when it has to wait: polling it outside a tokio
    /// runtime with timers enabled panics unless it passes at once. A metrics recorder
    /// (user code) that panics as the release is recorded panics the poll that passed: the
    /// units are taken, and the future polled again is ready at once.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: a dropped waiter leaves the queue and holds no reservation; the next
    /// waiter moves up.
    pub fn until_ready(&self, cost: u32) -> UntilReady {
        UntilReady::new(self.clone(), cost)
    }

    /// Decide now whether `cost` units may pass, and take them if they may; never waits and
    /// needs no runtime.
    ///
    /// The answer is a [`Decision`], as every limiter's: `capacity` is the burst, `remaining`
    /// the units that could still pass at once after this decision, `reset_after` how long
    /// until the bucket is full again, and when refused, `retry_after` how long until the
    /// bucket holds `cost` units. The line is FIFO: while others wait for the pacer
    /// ([`until_ready`](Pacer::until_ready), the adapters), `check` refuses (it never jumps
    /// the line), with `remaining` 0 and a `retry_after` that counts the units of the
    /// waiters ahead too (the earliest this cost could pass, if they all pass before it;
    /// sooner only if some leave the line).
    ///
    /// # Errors
    ///
    /// [`CostError::Zero`], and [`CostError::ExceedsCapacity`] when `cost` is above the burst
    /// (it could never pass).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use flowgate::pace::Pacer;
    /// use flowgate::{CostError, Rate};
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let pacer = Pacer::builder(Rate::per_second(10)?).burst(2).build()?;
    /// let d = pacer.check(2)?;
    /// assert!(d.allowed);
    /// assert_eq!((d.capacity, d.remaining), (2, 0));
    /// let d = pacer.check(1)?;
    /// assert!(!d.allowed);
    /// assert_eq!(d.retry_after, Duration::from_millis(100));
    /// assert_eq!(pacer.check(3), Err(CostError::ExceedsCapacity { cost: 3, capacity: 2 }));
    /// # Ok(())
    /// # }
    /// ```
    pub fn check(&self, cost: u32) -> Result<Decision, CostError> {
        self.inner.check(cost)
    }

    /// Change the quota (rate and burst) at runtime. Units already released keep their place
    /// in the schedule: the next unit is due when it was under the old quota, and the new one
    /// applies from there; waiters recompute their due time at once. To keep the default
    /// burst for the new rate, pass [`Pacer::default_quota`]`(rate)`.
    ///
    /// A change gives no units back: from that due time the bucket holds what the new rate
    /// refills, up to the new burst (so a bucket full for less time than the new burst
    /// takes to refill is not full at once under it), and a round trip through another
    /// quota leaves the schedule as it was, or later.
    ///
    /// # Examples
    ///
    /// ```
    /// use flowgate::pace::Pacer;
    /// use flowgate::{Quota, Rate};
    ///
    /// let pacer = Pacer::new(Rate::per_second(10)?);
    /// pacer.set_quota(Quota::per_second(100)?.burst(5)?);
    /// assert_eq!(pacer.quota(), Quota::per_second(100)?.burst(5)?);
    /// pacer.set_quota(Pacer::default_quota(Rate::per_second(1_000)?));
    /// assert_eq!(pacer.quota().burst_size(), 6);
    /// # Ok::<(), flowgate::ConfigError>(())
    /// ```
    pub fn set_quota(&self, quota: Quota) {
        self.inner.set_quota(quota);
    }

    /// Let nothing pass before `at`; from `at` on, the schedule resumes at the current rate
    /// with no burst: one unit may pass at `at`, the next one `1 / rate` later, and so on,
    /// however long the pacer was idle before. Waiters recompute their due time at once.
    ///
    /// A pause that ends before the next unit is due anyway changes nothing (it never
    /// brings the schedule forward), so overlapping pauses keep the latest end. A later
    /// [`set_quota`](Pacer::set_quota) keeps the pause: the next unit stays due at `at`.
    /// This is what a client does with a server's `Retry-After`
    /// ([`AdaptivePacer`](crate::pace::AdaptivePacer) calls it on back-pressure).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use flowgate::pace::Pacer;
    /// use flowgate::Rate;
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let pacer = Pacer::new(Rate::per_second(10)?);
    /// let start = tokio::time::Instant::now();
    /// pacer.pause_until(start + Duration::from_secs(1));
    /// assert!(!pacer.check(1)?.allowed);
    /// pacer.until_ready(1).await?;
    /// pacer.until_ready(1).await?;
    /// assert_eq!(start.elapsed(), Duration::from_millis(1_100)); // 1 s, then 1/rate: no burst
    /// # Ok(())
    /// # }
    /// ```
    pub fn pause_until(&self, at: Instant) {
        self.inner.pause_until(at);
    }

    /// The current quota: the rate, and the burst (how many units may pass at once).
    pub fn quota(&self) -> Quota {
        self.inner.lock().bucket.quota()
    }

    /// How many acquisitions are waiting: every one in line, those stepped over included
    /// (a first waiter whose task left its turn unclaimed; see guarantee (c)), as each
    /// keeps its place until it passes or is dropped.
    pub fn waiting(&self) -> usize {
        self.inner.lock().waiters.len()
    }

    /// The pacer's name, if it was given one.
    pub fn name(&self) -> Option<&str> {
        self.inner.name.as_deref()
    }
}

impl fmt::Debug for Pacer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.inner.lock();
        f.debug_struct("Pacer")
            .field("name", &self.inner.name)
            .field("quota", &st.bucket.quota())
            .field("waiting", &st.waiters.len())
            .finish()
    }
}

/// `1 + ceil(rate × 5 ms)`, saturating.
fn default_burst(rate: Rate) -> u32 {
    let per_tolerance = (u128::from(rate.count()) * DEFAULT_TOLERANCE.as_nanos())
        .div_ceil(u128::from(rate.period_nanos()));
    u32::try_from(per_tolerance + 1).unwrap_or(u32::MAX)
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn elapsed(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.epoch)
    }

    /// Whether someone waits in line and claims its turn: a waiter not stepped over (the
    /// head is the first of them), unless that head has left its turn unclaimed for the
    /// grace already (with nobody behind it to step over it). Those stepped over, and such
    /// a head, are not polled by their tasks.
    pub(crate) fn has_present_waiter(&self) -> bool {
        let now = Instant::now();
        let st = self.lock();
        st.head.is_some() && self.stalled_at(&st).is_none_or(|at| now < at)
    }

    fn check(&self, cost: u32) -> Result<Decision, CostError> {
        let now = Instant::now();
        let mut out = Deferred::default();
        let mut guard = self.lock();
        self.step_over_stalled(&mut guard, now, None, &mut out);
        let decision = self.check_locked(&mut guard, now, cost);
        drop(guard);
        // A metrics recorder is user code: it runs after the lock.
        if decision.as_ref().is_ok_and(|d| d.allowed) {
            self.released.increment(u64::from(cost));
        }
        decision
    }

    /// How long `cost` units would wait if they joined the line now, if everyone ahead
    /// passes before them (sooner only if some leave the line); takes nothing, and a cost
    /// that can never pass waits for ever (`Duration::MAX`).
    pub(crate) fn wait_estimate(&self, cost: u32) -> Duration {
        let now = Instant::now();
        let mut out = Deferred::default();
        let mut guard = self.lock();
        self.step_over_stalled(&mut guard, now, None, &mut out);
        let st = &*guard;
        if Self::validate(st, cost).is_err() {
            return Duration::MAX;
        }
        st.bucket
            .ready_at(&st.gcra, Self::with_those_ahead(st, cost))
            .saturating_sub(self.elapsed(now))
    }

    /// `cost` plus the units of those waiting in line (each counted at most at the burst,
    /// as their turn is): what must fit the bucket before `cost` passes. Summed in a `u64`:
    /// the units of a few whole-burst waiters pass `u32::MAX`.
    fn with_those_ahead(st: &State, cost: u32) -> u64 {
        let burst = st.bucket.quota().burst_size();
        st.present()
            .filter_map(|key| st.waiters.get(key))
            .fold(u64::from(cost), |sum, w| {
                sum.saturating_add(u64::from(w.cost.min(burst)))
            })
    }

    fn check_locked(&self, st: &mut State, now: Instant, cost: u32) -> Result<Decision, CostError> {
        // The one place that refuses a cost that can never pass (as `admit` does).
        Self::validate(st, cost)?;
        let elapsed = self.elapsed(now);
        if st.head.is_some() {
            // Someone is ahead: never jump the line. Refuse, and report when the bucket
            // would fit this cost after the units of those waiting (each counted at most at
            // the burst, as their turn is): no earlier can this cost pass.
            let retry_after = st
                .bucket
                .ready_at(&st.gcra, Self::with_those_ahead(st, cost))
                .saturating_sub(elapsed);
            let reset_after = st.bucket.neutral_at(&st.gcra).saturating_sub(elapsed);
            return Ok(Decision::reject(
                st.bucket.capacity(),
                0,
                retry_after,
                reset_after,
            ));
        }
        st.bucket.check(&mut st.gcra, elapsed, cost)
    }

    /// When the head may claim its turn: once it is the head and its cost fits the bucket.
    /// A cost above the burst (the burst was lowered since it queued) counts as the burst: it
    /// can never pass, and its turn must not move the stall-skip (guarantee (c)) further out.
    /// None when there is no head, or its turn is past the last instant tokio holds (it
    /// never comes: nobody steps over it).
    fn turn_of_head(&self, st: &State) -> Option<Instant> {
        let (key, since) = st.head?;
        let burst = st.bucket.quota().burst_size();
        let cost = st.waiters.get(key)?.cost.min(burst);
        // Not capped: `ready_at` counts from the epoch, so a pacer older than the cap
        // would see every head's turn as come.
        let ready_at = self
            .epoch
            .checked_add(st.bucket.ready_at(&st.gcra, u64::from(cost)))?;
        Some(since.max(ready_at))
    }

    /// When the one behind the head may step over it, if the head leaves its turn
    /// unclaimed; None if never (see [`turn_of_head`](Inner::turn_of_head)).
    fn stalled_at(&self, st: &State) -> Option<Instant> {
        self.turn_of_head(st)?.checked_add(STALL_GRACE)
    }

    /// Steps over a head (other than `caller`) that has left its turn unclaimed for
    /// `STALL_GRACE`: its task is not polling it, and must not hold up everyone behind it.
    /// Wakes the new head and its watcher (through `out`).
    fn step_over_stalled(
        &self,
        st: &mut State,
        now: Instant,
        caller: Option<Key>,
        out: &mut Deferred,
    ) {
        while let Some((head, _)) = st.head
            && Some(head) != caller
            && self.stalled_at(st).is_some_and(|at| now >= at)
        {
            if let Some(w) = st.waiters.get_mut(head) {
                w.absent = true;
            }
            st.refresh(now, out);
        }
    }

    /// Refuses a cost that could never pass: zero, or above the burst.
    fn validate(st: &State, cost: u32) -> Result<(), CostError> {
        CostError::check(cost, st.bucket.capacity())
    }

    /// One attempt to pass `cost`, keeping FIFO order: a newcomer passes only when nobody
    /// waits; a waiter passes only when it is the head.
    pub(crate) fn admit(
        &self,
        cx: &mut Context<'_>,
        cost: u32,
        ticket: &mut Ticket,
    ) -> Result<Admit, CostError> {
        let now = Instant::now();
        // Declared before the lock: the wakers go after it is released.
        let mut out = Deferred::default();
        let mut guard = self.lock();
        let st = &mut *guard;
        // A cost that can never pass is refused before it touches the line: it is never
        // queued, and a waiter keeps the cost it last passed here (guarantee (c) times a
        // stalled head by it).
        Self::validate(st, cost)?;
        // Polled again: a waiter that was stepped over takes its place back, with the cost
        // it asks for now (`Paced` retries an item above the burst in chunks). (Every other
        // change to the line refreshes the head and watcher where it happens.)
        let returned = ticket.id.is_some_and(|key| {
            st.waiters.refresh(key, cx.waker(), &mut out);
            st.waiters.get_mut(key).is_some_and(|w| {
                w.cost = cost;
                std::mem::replace(&mut w.absent, false)
            })
        });
        if returned {
            st.refresh(now, &mut out);
        }
        self.step_over_stalled(st, now, ticket.id, &mut out);
        let first = match ticket.id {
            None => st.head.is_none(),
            Some(id) => st.head.is_some_and(|(head, _)| head == id),
        };
        let admit = if first {
            self.admit_head(st, now, cost, ticket, cx, &mut out)
        } else {
            if ticket.id.is_none() {
                ticket.id = Some(st.push(cost, cx.waker()));
                // It may be the watcher now (being polled, its own wake is spurious).
                st.refresh(now, &mut out);
            }
            let watching = st.watcher.is_some() && st.watcher == ticket.id;
            let look_again = watching.then(|| self.stalled_at(st)).flatten();
            Ok(Admit::Queued(look_again))
        };
        drop(guard);
        // A metrics recorder is user code: it runs after the lock. The ticket says it
        // passed until the records have run: their panic goes on to the caller, which must
        // not pay the units again when it polls again.
        if let Ok(Admit::Now) = admit {
            ticket.passed = true;
            match ticket.due.take() {
                // Each record runs whatever the other did.
                Some(due) => {
                    let mut panics = Panics::new();
                    panics.run(|| {
                        self.lateness
                            .record(now.saturating_duration_since(due).as_secs_f64());
                    });
                    panics.run(|| self.released.increment(u64::from(cost)));
                    panics.resume();
                }
                None => self.released.increment(u64::from(cost)),
            }
            ticket.passed = false;
        }
        admit
    }

    /// The head (or a newcomer with nobody waiting) tries the bucket.
    fn admit_head(
        &self,
        st: &mut State,
        now: Instant,
        cost: u32,
        ticket: &mut Ticket,
        cx: &mut Context<'_>,
        out: &mut Deferred,
    ) -> Result<Admit, CostError> {
        // A waiter's turn, before the check takes the cost: its due time if it passes now
        // without having slept for it (it came to the head with its turn already past).
        // Only a waiter that holds no due time yet needs it.
        let turn = ticket
            .id
            .filter(|_| ticket.due.is_none())
            .and_then(|_| self.turn_of_head(st));
        let decision = st.bucket.check(&mut st.gcra, self.elapsed(now), cost)?;
        if decision.allowed {
            if turn.is_some() {
                ticket.due = turn;
            }
            if let Some(key) = ticket.id.take() {
                // The head is at the front, or behind a few waiters that were stepped over:
                // out of the line in O(1) either way.
                st.waiters.cancel(key, out);
                st.refresh(now, out);
            }
            // Its lateness (`ticket.due`) and release are recorded after the lock.
            return Ok(Admit::Now);
        }
        if ticket.id.is_none() {
            // Nobody was present in line: it is the head now, with no watcher behind it
            // (being polled, it needs no wake).
            let key = st.push(cost, cx.waker());
            ticket.id = Some(key);
            st.head = Some((key, now));
            st.watcher = None;
        }
        let due = now + capped(decision.retry_after);
        ticket.due = Some(due);
        Ok(Admit::At(due))
    }

    /// A waiter gave up: leave the queue, and let the next one move up.
    pub(crate) fn leave(&self, ticket: &mut Ticket) {
        let Some(key) = ticket.id.take() else { return };
        ticket.due = None;
        let now = Instant::now();
        let mut out = Deferred::default();
        let mut st = self.lock();
        st.waiters.cancel(key, &mut out);
        st.refresh(now, &mut out);
    }

    fn pause_until(&self, at: Instant) {
        let mut out = Deferred::default();
        let mut st = self.lock();
        // Full again at `at + lead`: exactly one unit fits at `at` (see `set_quota`). An
        // instant before the epoch counts back from it: the schedule is not cut there.
        // (Any `Duration` is below 2^94 ns: both fit an `i128`.)
        let at = match at.checked_duration_since(self.epoch) {
            Some(after) => after.as_nanos() as i128,
            None => -(self.epoch.duration_since(at).as_nanos() as i128),
        };
        let paused = st.bucket.state_next_at(at);
        if !paused.full_later_than(st.gcra) {
            return;
        }
        st.gcra = paused;
        st.wake_head_and_watcher(&mut out);
    }

    fn set_quota(&self, quota: Quota) {
        let mut out = Deferred::default();
        let mut st = self.lock();
        // The next unit stays due when it was under the old quota, a full bucket's too:
        // never later (the burst the old quota let through early is not debt under the new
        // one), and never earlier, so a change adds no unit. (A full bucket kept full
        // instead: one the carry to a smaller burst took as full was full again under the
        // larger one on the change back, and every round trip gave the units spent from it
        // back.) From there the new rate and burst apply exactly (where the new quota's
        // units cannot tell that instant, the first one after it that they can). The next
        // unit may be due before the pacer's epoch, a bucket still holding units early in
        // its life: the schedule is not cut at the epoch.
        let old = std::mem::replace(&mut st.bucket, TokenBucket::new(quota));
        st.gcra = st.bucket.state_carried(&old, &st.gcra);
        st.wake_head_and_watcher(&mut out);
    }
}

/// Builds a [`Pacer`]; from [`Pacer::builder`].
#[derive(Debug, Clone)]
pub struct PacerBuilder {
    rate: Rate,
    burst: Option<u32>,
    name: Option<String>,
}

impl PacerBuilder {
    /// How many units may leave at once after an idle spell; 1 is strict spacing, which
    /// holds the rate only where the timer's 1 ms lateness is small against the spacing
    /// (at 800/s it runs at about 500/s: see [`Pacer`]'s "Burst and precision"). Default:
    /// `1 + ceil(rate × 5 ms)`.
    pub fn burst(mut self, burst: u32) -> Self {
        self.burst = Some(burst);
        self
    }

    /// The `name` label of this pacer's metrics.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Build the pacer.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] on `pace.burst` if the burst is zero.
    pub fn build(self) -> Result<Pacer, ConfigError> {
        let quota = match self.burst {
            None => Pacer::default_quota(self.rate),
            Some(burst) => Quota::new(self.rate, burst).map_err(|_| {
                ConfigError::new("pace.burst", ConfigErrorKind::Zero, "must be at least 1")
            })?,
        };
        Ok(Pacer::with_quota(quota, self.name))
    }
}

#[cfg(test)]
mod tests {
    use std::task::{Context, Waker};

    use super::*;

    /// Issue 20: 40,000 waiters leave the line newest first, the worst order for a line
    /// scanned from the front; the slots the waiter list visits, counted, stay a small
    /// constant per leave (a scan would visit 20,000 on average).
    #[test]
    fn forty_thousand_leaves_are_linear() {
        const N: usize = 40_000;
        let pacer = Pacer::builder(Rate::per_second(1).unwrap())
            .burst(1)
            .build()
            .unwrap();
        let inner = pacer.inner();
        let mut cx = Context::from_waker(Waker::noop());
        assert!(matches!(
            inner.admit(&mut cx, 1, &mut Ticket::default()),
            Ok(Admit::Now)
        ));
        let mut tickets: Vec<Ticket> = (0..N).map(|_| Ticket::default()).collect();
        for t in &mut tickets {
            assert!(!matches!(inner.admit(&mut cx, 1, t), Ok(Admit::Now)));
        }
        let before = inner.lock().waiters.steps();
        for t in tickets.iter_mut().rev() {
            inner.leave(t);
        }
        let per_leave = (inner.lock().waiters.steps() - before) as f64 / N as f64;
        assert!(per_leave <= 16.0, "{per_leave} slots visited per leave");
        assert_eq!(pacer.waiting(), 0);
    }
}
