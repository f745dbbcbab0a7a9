//! The stream adapters' side of the core: passing a held permit on, and parking a holder
//! whose own work holds every permit (or that waits on its upstream).

use std::task::Context;

use crate::bulkhead::error::Priority;
use crate::sync::{Deferred, Key, Ordering};

use super::queue::Waiters;
use super::{CLOSED, Core, WAITERS, in_flight_of, max_of};

impl Core {
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
    pub(super) fn wake_parked_for_growth(&self, w: &Waiters, out: &mut Deferred) {
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
}
