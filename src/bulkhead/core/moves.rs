//! The bulkhead's metrics, and the changes to them worked out under the waiters' lock and
//! recorded after it.

use crate::bulkhead::error::AcquireError;
use crate::metrics::{Counter, Gauge, Histogram, Labels, Tally};
use crate::sync::Panics;

use super::Core;
use super::queue::Waiters;

/// Names of the bulkhead metrics.
pub(crate) mod names {
    pub(crate) const IN_FLIGHT: &str = "flowgate_bulkhead_in_flight";
    pub(crate) const WAITING: &str = "flowgate_bulkhead_waiting";
    pub(crate) const REJECTED: &str = "flowgate_bulkhead_rejected_total";
    pub(crate) const WAIT_SECONDS: &str = "flowgate_bulkhead_wait_seconds";
    pub(crate) const DISCARDED: &str = "flowgate_bulkhead_discarded_total";
}

pub(super) struct Metrics {
    /// Moved by each permit taken and returned; the core takes back what is left (permits
    /// forgotten) when it is dropped.
    pub(super) in_flight: Tally,
    pub(super) waiting: Gauge,
    pub(super) rejected: [Counter; 4],
    pub(super) wait: Histogram,
    /// Items the stream adapters let go of unprocessed (see `Feed`).
    pub(super) discarded: Counter,
}

impl Metrics {
    pub(super) fn new(name: Option<&str>) -> Metrics {
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
pub(super) struct Moves<'a> {
    core: &'a Core,
    /// Permits taken (+) and returned (−).
    pub(super) in_flight: i64,
    pub(super) waiting: f64,
    pub(super) rejected: [u64; 4],
    /// A permit taken for the caller at once, which nobody holds until this call returns:
    /// counted admitted, then given back if the recorder panics (`Some(true)`: a permit of
    /// the critical reserve).
    pub(super) taken: Option<bool>,
}

impl<'a> Moves<'a> {
    pub(super) fn new(core: &'a Core) -> Moves<'a> {
        Moves {
            core,
            in_flight: 0,
            waiting: 0.0,
            rejected: [0; 4],
            taken: None,
        }
    }

    /// Count a refusal (in the stats now; in the metric after the lock).
    pub(super) fn refuse(&mut self, why: AcquireError) -> AcquireError {
        self.core.counts().refused(why);
        self.rejected[why as usize] += 1;
        why
    }

    /// Record every change, each even if one before it panics (the `waiting` gauge's
    /// change is published already: lost, it would stay off for good); the first panic is
    /// resumed once all have run (dropped if the thread already unwinds).
    fn record(&self) {
        let metrics = &self.core.metrics;
        let mut panics = Panics::new();
        if self.in_flight != 0 {
            panics.run(|| metrics.in_flight.add(self.in_flight as f64));
        }
        if self.waiting != 0.0 {
            panics.run(|| metrics.waiting.add(self.waiting));
        }
        for (counter, &n) in metrics.rejected.iter().zip(&self.rejected) {
            if n > 0 {
                panics.run(|| counter.increment(n));
            }
        }
        panics.resume();
    }
}

impl Drop for Moves<'_> {
    fn drop(&mut self) {
        if let Some(reserve) = self.taken {
            // Counted before the recorder runs: if it panics, the permit goes back, and
            // the acquisition was still admitted.
            self.core.counts().at_once(reserve);
            self.core.holding(|| self.record());
        } else {
            self.record();
        }
    }
}

/// The `waiting` gauge's change since it was last published, to record after the lock.
pub(super) fn publish_waiting(w: &mut Waiters, moves: &mut Moves<'_>) {
    let len = w.len();
    moves.waiting += len as f64 - w.published as f64;
    w.published = len;
}
