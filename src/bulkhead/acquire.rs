//! The acquisition futures and the permits they yield.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker, ready};
use std::time::Duration;

use pin_project::{pin_project, pinned_drop};
use tokio::time::{Instant, Sleep};

use crate::adaptive::Outcome;
use crate::bulkhead::adaptive::Grant;
use crate::bulkhead::core::{Core, Left, Polled, Ticket};
use crate::bulkhead::error::{AcquireError, Priority};
use crate::sync::{Arc, Key, Panics, WakerId};

/// The state of one acquisition: its place in the queue and its timeout.
#[pin_project]
#[derive(Debug)]
pub(crate) struct Waiter {
    priority: Priority,
    /// Subject to the waiting room's size and the wait timeout (false for stream adapters,
    /// which apply backpressure instead of being refused).
    bounded: bool,
    /// Past the first poll (the fast path was tried).
    started: bool,
    ticket: Ticket,
    /// When the wait in the queue began, for the wait-time histogram: every acquisition
    /// that queues, the stream adapters' too, so that the histogram's samples are the waits
    /// `BulkheadStats::waited` counts. (Read only once it queued: the fast path and an
    /// adapter parked behind its own work read no clock.)
    since: Option<Instant>,
    /// When the wait times out, from its first poll that queued (bounded waits with a
    /// timeout only): the timer is started for it.
    deadline: Option<Instant>,
    #[pin]
    timer: Option<Sleep>,
}

impl Waiter {
    pub(crate) fn new(priority: Priority) -> Waiter {
        Waiter {
            priority,
            bounded: true,
            started: false,
            ticket: Ticket::default(),
            since: None,
            deadline: None,
            timer: None,
        }
    }

    /// A wait that ignores the waiting room's size and the timeout.
    pub(crate) fn unbounded() -> Waiter {
        Waiter {
            priority: Priority::Normal,
            bounded: false,
            started: false,
            ticket: Ticket::default(),
            since: None,
            deadline: None,
            timer: None,
        }
    }

    pub(crate) fn poll_acquire(
        self: Pin<&mut Self>,
        core: &Core,
        cx: &mut Context<'_>,
    ) -> Poll<Result<(), AcquireError>> {
        let mut this = self.project();
        if !*this.started
            && let Some(done) = core.try_fast(*this.priority)
        {
            return Poll::Ready(done);
        }
        match core.poll_acquire(cx, *this.priority, *this.bounded, this.ticket) {
            Polled::Acquired => return Poll::Ready(Ok(())),
            Polled::Granted { reserve } => {
                core.counts().waited(reserve);
                record_wait(core, this.since);
                return Poll::Ready(Ok(()));
            }
            Polled::Refused(why) => return Poll::Ready(Err(why)),
            Polled::Pending => {}
        }
        if !*this.started {
            *this.started = true;
            let now = Instant::now();
            *this.since = Some(now);
            // A deadline, not `sleep(timeout)`: tokio caps a sleep at 30 years, which would
            // shed a longer timeout early. No deadline, no timer: the wait never times out.
            if *this.bounded {
                *this.deadline = core.wait_timeout().and_then(|t| deadline(now, t));
            }
        }
        // Started here rather than with the deadline: starting it panics outside a tokio
        // runtime, and a caller that catches the panic and polls again (in one) still has
        // its wait time out at the deadline of its first poll.
        if let Some(deadline) = *this.deadline
            && this.timer.is_none()
        {
            this.timer.set(Some(tokio::time::sleep_until(deadline)));
        }
        if let Some(timer) = this.timer.as_pin_mut() {
            ready!(timer.poll(cx));
            // Timed out, unless the queue decided first (a permit granted, a shed or a close
            // since the look above, from another thread or a waker dropped after the lock):
            // the one that took it out of the queue wins, and only it is counted.
            return Poll::Ready(match core.leave(this.ticket) {
                Left::Permit { reserve } => {
                    core.counts().waited(reserve);
                    record_wait(core, this.since);
                    Ok(())
                }
                Left::Shed(why) => Err(why),
                Left::Closed => Err(core.refuse(AcquireError::Closed)),
                Left::Removed | Left::Unqueued => Err(core.refuse(AcquireError::TimedOut)),
            });
        }
        Poll::Pending
    }

    /// Whether it has a place in the queue (waiting, or decided and not seen yet).
    pub(crate) fn is_queued(&self) -> bool {
        self.ticket.is_queued()
    }

    /// Give up the wait; a permit already granted to it is returned, a refusal by the close
    /// counted. A wait given up (with a permit granted to it or not) counts as cancelled.
    pub(crate) fn cancel(self: Pin<&mut Self>, core: &Core) {
        match core.leave(self.project().ticket) {
            Left::Permit { .. } => {
                core.counts().cancelled();
                core.release();
            }
            Left::Removed => core.counts().cancelled(),
            // Refused by the close before it looked again: counted as if it had seen it (a
            // shed waiter was counted when it was shed).
            Left::Closed => {
                core.refuse(AcquireError::Closed);
            }
            Left::Shed(_) | Left::Unqueued => {}
        }
    }
}

/// When a wait begun at `since` times out after `timeout`; `None` past any instant the
/// clock can tell (tokio rounds a deadline up to its millisecond: one it could not round is
/// never reached either), so such a wait never times out.
fn deadline(since: Instant, timeout: Duration) -> Option<Instant> {
    since
        .checked_add(timeout)
        .filter(|d| d.checked_add(Duration::from_millis(1)).is_some())
}

/// A wait that ended with a permit: its length goes to the wait-time histogram (as it is
/// counted in `waited`, before this). Nobody holds the permit yet: a recorder that panics
/// gives it back.
fn record_wait(core: &Core, since: &mut Option<Instant>) {
    if let Some(since) = since.take() {
        core.holding(|| core.record_wait(since.elapsed()));
    }
}

/// Future of [`Bulkhead::acquire`](crate::bulkhead::Bulkhead::acquire).
///
/// # Cancel safety
///
/// Cancel-safe: dropping it leaves the waiting room, and a permit already granted to it is
/// passed to the next waiter. Nothing is held once it is dropped.
#[pin_project(PinnedDrop)]
#[must_use = "futures do nothing unless polled"]
pub struct Acquire<'a> {
    core: &'a Core,
    #[pin]
    waiter: Waiter,
}

impl<'a> Acquire<'a> {
    pub(crate) fn new(core: &'a Core, priority: Priority) -> Acquire<'a> {
        Acquire {
            core,
            waiter: Waiter::new(priority),
        }
    }
}

impl<'a> Future for Acquire<'a> {
    type Output = Result<BulkheadPermit<'a>, AcquireError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let core = *this.core;
        this.waiter
            .poll_acquire(core, cx)
            .map_ok(|()| BulkheadPermit::new(core))
    }
}

#[pinned_drop]
impl PinnedDrop for Acquire<'_> {
    fn drop(self: Pin<&mut Self>) {
        let this = self.project();
        this.waiter.cancel(this.core);
    }
}

impl fmt::Debug for Acquire<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Acquire")
            .field("waiter", &self.waiter)
            .finish_non_exhaustive()
    }
}

/// Future of [`Bulkhead::acquire_owned`](crate::bulkhead::Bulkhead::acquire_owned).
///
/// # Cancel safety
///
/// As [`Acquire`].
#[pin_project(PinnedDrop)]
#[must_use = "futures do nothing unless polled"]
pub struct AcquireOwned {
    core: Arc<Core>,
    #[pin]
    waiter: Waiter,
}

impl AcquireOwned {
    pub(crate) fn new(core: Arc<Core>, priority: Priority) -> AcquireOwned {
        AcquireOwned {
            core,
            waiter: Waiter::new(priority),
        }
    }
}

impl Future for AcquireOwned {
    type Output = Result<OwnedBulkheadPermit, AcquireError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let core = this.core;
        this.waiter
            .poll_acquire(core, cx)
            .map_ok(|()| OwnedBulkheadPermit::new(core.clone()))
    }
}

#[pinned_drop]
impl PinnedDrop for AcquireOwned {
    fn drop(self: Pin<&mut Self>) {
        let this = self.project();
        this.waiter.cancel(this.core);
    }
}

impl fmt::Debug for AcquireOwned {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AcquireOwned")
            .field("waiter", &self.waiter)
            .finish_non_exhaustive()
    }
}

/// A permit to run one unit of work through a bulkhead; returned when dropped.
///
/// Dropping it wakes the next waiter (critical first, then FIFO).
///
/// # Adaptive bulkheads
///
/// On a bulkhead built with [`adaptive`](crate::bulkhead::BulkheadBuilder::adaptive), the
/// permit remembers when it was granted and how many permits were in flight then. End the
/// call with [`record`](BulkheadPermit::record) to feed its round-trip time (grant to
/// `record`, never the wait for the permit) and outcome to the algorithm. A permit dropped
/// without `record` is an [`Outcome::Ignored`] sample: a cancelled call says nothing about
/// the downstream. On a fixed bulkhead `record` just drops the permit.
#[must_use = "the permit is released as soon as it is dropped"]
pub struct BulkheadPermit<'a> {
    core: &'a Core,
    grant: Option<Grant>,
}

impl<'a> BulkheadPermit<'a> {
    #[inline]
    pub(crate) fn new(core: &'a Core) -> BulkheadPermit<'a> {
        BulkheadPermit {
            core,
            grant: core.start(),
        }
    }

    /// End the call with `outcome` and return the permit. On an adaptive bulkhead the call's
    /// round-trip time and outcome become a sample for its algorithm (see the type's docs).
    pub fn record(mut self, outcome: Outcome) {
        if let Some(grant) = self.grant.take() {
            self.core.record(grant, outcome);
        }
    }
}

impl Drop for BulkheadPermit<'_> {
    #[inline]
    fn drop(&mut self) {
        match self.grant.take() {
            None => self.core.release(),
            Some(grant) => self.core.release_ignored(grant),
        }
    }
}

impl fmt::Debug for BulkheadPermit<'_> {
    /// Its bulkhead, and (adaptive bulkheads) the grant its sample is owed for.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BulkheadPermit")
            .field("bulkhead", self.core)
            .field("grant", &self.grant)
            .finish()
    }
}

/// A permit that owns a reference to its bulkhead (`'static`); returned when dropped.
///
/// On an adaptive bulkhead, end the call with [`record`](OwnedBulkheadPermit::record), as
/// for [`BulkheadPermit`]; dropped without it, the call is an [`Outcome::Ignored`] sample.
#[must_use = "the permit is released as soon as it is dropped"]
pub struct OwnedBulkheadPermit {
    core: Arc<Core>,
    grant: Option<Grant>,
}

impl OwnedBulkheadPermit {
    #[inline]
    pub(crate) fn new(core: Arc<Core>) -> OwnedBulkheadPermit {
        let grant = core.start();
        OwnedBulkheadPermit { core, grant }
    }

    /// End the call with `outcome` and return the permit; see [`BulkheadPermit::record`].
    pub fn record(mut self, outcome: Outcome) {
        self.note_with(|| outcome);
    }

    /// Feed the call's sample now (if the bulkhead is adaptive: `outcome` is asked only
    /// then) and keep the permit: the HTTP layer learns from the response head while the
    /// body still holds the permit.
    #[cfg_attr(not(feature = "http"), allow(dead_code))]
    pub(crate) fn note_with(&mut self, outcome: impl FnOnce() -> Outcome) {
        if let Some(grant) = self.grant.take() {
            self.core.record(grant, outcome());
        }
    }
}

impl Drop for OwnedBulkheadPermit {
    #[inline]
    fn drop(&mut self) {
        match self.grant.take() {
            None => self.core.release(),
            Some(grant) => self.core.release_ignored(grant),
        }
    }
}

impl fmt::Debug for OwnedBulkheadPermit {
    /// As [`BulkheadPermit`]'s.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OwnedBulkheadPermit")
            .field("bulkhead", &*self.core)
            .field("grant", &self.grant)
            .finish()
    }
}

/// The permits a stream adapter holds, and its wait for the next one.
///
/// Dropping it abandons the wait and returns every permit still held, so an adapter that is
/// dropped (or unwinds from a panicking future) leaks nothing.
#[pin_project(PinnedDrop)]
#[derive(Debug)]
pub(crate) struct Permits {
    core: Arc<Core>,
    #[pin]
    waiter: Waiter,
    held: usize,
    closed: bool,
    /// Its place among the parked holders (see [`Core::park`]), and the waker (a clone, and
    /// the [`WakerId`] of the one it was cloned from, see [`WakerId::store`]), epoch and
    /// `growth` it parked with.
    parked: Option<Key>,
    parked_as: Option<(Waker, WakerId, u64, bool)>,
}

impl Permits {
    pub(crate) fn new(core: Arc<Core>) -> Permits {
        Permits {
            core,
            waiter: Waiter::unbounded(),
            held: 0,
            closed: false,
            parked: None,
            parked_as: None,
        }
    }

    /// Wait for one more permit. `Ready(false)` once the bulkhead is closed.
    #[inline]
    pub(crate) fn poll_acquire(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<bool> {
        let mut this = self.project();
        if *this.closed {
            return Poll::Ready(false);
        }
        match ready!(this.waiter.as_mut().poll_acquire(this.core, cx)) {
            Ok(()) => {
                *this.held += 1;
                this.waiter.set(Waiter::unbounded());
                Poll::Ready(true)
            }
            Err(why) => {
                // Adapters wait outside the waiting room, untimed: only closing refuses them.
                debug_assert_eq!(why, AcquireError::Closed);
                *this.closed = true;
                Poll::Ready(false)
            }
        }
    }

    /// A permit for the adapter's next item. `own`: how many permits the adapter's own work
    /// in flight holds for certain (a lower bound; 0: none known). When no permit is free
    /// and every one in flight is among those, the adapter returns `Pending` without
    /// queueing: its own work frees the next permit and wakes it as it finishes (a waiter of
    /// its own would only send those releases through the lock), and it is parked to be
    /// woken if the limit grows or the bulkhead closes. Otherwise it waits in the queue like
    /// any acquisition, so that a permit freed by other work (another stream, a caller of
    /// the bulkhead) wakes it. `Ready(false)` once the bulkhead is closed.
    #[inline]
    pub(crate) fn poll_for_item(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        own: usize,
    ) -> Poll<bool> {
        if own > 0 && !self.closed && !self.waiter.is_queued() {
            let this = self.as_mut().project();
            if this.core.try_fast(Priority::Normal) == Some(Ok(())) {
                *this.held += 1;
                return Poll::Ready(true);
            }
            if this.core.only_own_in_flight(own)
                && self
                    .as_mut()
                    .park(cx, true, |core| core.only_own_in_flight(own))
            {
                return Poll::Pending;
            }
        }
        self.poll_acquire(cx)
    }

    /// Park while `blocked` (see [`Core::park`]; `growth`: woken by the limit growing too);
    /// false if it is not blocked (or the bulkhead is closed). Parked already, the same way,
    /// by the same task, and its place still there: nothing to do (no lock; the caller saw
    /// it blocked).
    #[inline]
    pub(crate) fn park(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        growth: bool,
        blocked: impl FnOnce(&Core) -> bool,
    ) -> bool {
        if let Some((waker, id, epoch, wants)) = &self.parked_as
            && *wants == growth
            && *epoch == self.core.parked_epoch()
            && (*id == WakerId::of(cx.waker()) || waker.will_wake(cx.waker()))
        {
            return true;
        }
        self.park_locked(cx, growth, blocked)
    }

    /// [`park`](Permits::park) under the lock: not parked yet, or parked otherwise.
    #[inline(never)]
    fn park_locked(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        growth: bool,
        blocked: impl FnOnce(&Core) -> bool,
    ) -> bool {
        let this = self.project();
        match this.core.park(cx, this.parked, growth, blocked) {
            Some(epoch) => {
                let (waker, id) = WakerId::store(cx.waker());
                *this.parked_as = Some((waker, id, epoch, growth));
                true
            }
            None => false,
        }
    }

    /// Whether a held permit may go straight to the holder's next item (no waiter is owed
    /// it, the holder's own included): saves returning it and taking it again.
    #[inline]
    pub(crate) fn may_keep(&self) -> bool {
        !self.closed && !self.waiter.is_queued() && self.core.may_keep()
    }

    /// Return one held permit.
    #[inline]
    pub(crate) fn release(self: Pin<&mut Self>) {
        let this = self.project();
        debug_assert!(*this.held > 0);
        *this.held -= 1;
        this.core.release();
    }

    /// Hand one held permit over to an owned permit.
    #[inline]
    pub(crate) fn into_owned(self: Pin<&mut Self>) -> OwnedBulkheadPermit {
        let this = self.project();
        *this.held -= 1;
        OwnedBulkheadPermit::new(this.core.clone())
    }

    #[inline]
    pub(crate) fn is_closed(&self) -> bool {
        self.closed
    }

    /// Whether the bulkhead is closed, seen before or now: once it is, the adapter is
    /// closed too (it pulls nothing more from upstream and ends after its work in flight).
    #[inline]
    pub(crate) fn see_closed(self: Pin<&mut Self>) -> bool {
        let this = self.project();
        if !*this.closed && this.core.is_closed() {
            *this.closed = true;
        }
        *this.closed
    }

    /// Whether the bulkhead itself is closed (this adapter may not have seen it yet).
    pub(crate) fn bulkhead_closed(&self) -> bool {
        self.core.is_closed()
    }

    /// Return the permits of work that vanished without finishing (a future that panicked,
    /// the panic caught by the caller): the adapter holds one per unit of work in flight.
    #[inline]
    pub(crate) fn settle(self: Pin<&mut Self>, in_flight: usize) {
        let this = self.project();
        while *this.held > in_flight {
            *this.held -= 1;
            this.core.release();
        }
    }

    pub(crate) fn max_in_flight(&self) -> usize {
        self.core.max_in_flight() as usize
    }

    /// The permits held, and the bulkhead, for an adapter's `Debug`.
    pub(crate) fn debug_fields(&self, d: &mut fmt::DebugStruct<'_, '_>) {
        d.field("permits", &self.held)
            .field("bulkhead", &*self.core);
    }

    /// The grant of a unit of work starting now, with the bulkhead owed its sample (adaptive
    /// bulkheads only).
    #[inline]
    pub(crate) fn sample(&self) -> Option<(Grant, Arc<Core>)> {
        self.core.start().map(|grant| (grant, self.core.clone()))
    }

    /// Feed the sample of a unit of work that ended now (the permit is handled apart).
    pub(crate) fn record(&self, grant: Grant, outcome: Outcome) {
        self.core.record(grant, outcome);
    }
}

#[pinned_drop]
impl PinnedDrop for Permits {
    /// Leave the queue and the parked holders, and return every permit held, one release
    /// each. Each step runs even if one before it panics (user code runs in them: a metrics
    /// recorder, a waker woken or dropped), or the permits after it would be lost for good;
    /// the first panic is resumed once all have run (dropped if the thread already unwinds,
    /// where a second panic would abort).
    fn drop(self: Pin<&mut Self>) {
        let this = self.project();
        let core = &**this.core;
        let mut panics = Panics::new();
        let waiter = this.waiter;
        panics.run(|| waiter.cancel(core));
        panics.run(|| core.unpark(this.parked));
        for _ in 0..std::mem::take(this.held) {
            panics.run(|| core.release());
        }
        panics.resume();
    }
}
