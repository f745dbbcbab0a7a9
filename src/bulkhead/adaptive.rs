//! The adaptive side of a bulkhead: its algorithm, the samples its permits feed it, and
//! their metrics.

use std::fmt;
use std::sync::PoisonError;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use tokio::time::Instant;

use crate::adaptive::{AdaptiveLimit, Outcome, RttEstimates, Sample};
use crate::metrics::{Counter, Gauge, Labels, changes};
use crate::sync::{Mutex, MutexGuard, Panics};

/// Names of the adaptive bulkhead metrics.
pub(crate) mod names {
    pub(crate) const MAX_IN_FLIGHT: &str = "flowgate_bulkhead_max_in_flight";
    pub(crate) const RTT_SECONDS: &str = "flowgate_bulkhead_rtt_seconds";
    pub(crate) const SAMPLES: &str = "flowgate_bulkhead_samples_total";
}

/// When a permit of an adaptive bulkhead was granted, and how many were in flight then
/// (itself included).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Grant {
    at: Instant,
    in_flight: u32,
}

impl Grant {
    pub(crate) fn now(in_flight: u32) -> Grant {
        Grant {
            at: Instant::now(),
            in_flight,
        }
    }
}

struct Metrics {
    max_in_flight: Gauge,
    rtt_min: Gauge,
    rtt_smoothed: Gauge,
    samples: [Counter; 3],
}

/// What an adaptive bulkhead learnt so far; from
/// [`Bulkhead::adaptive_stats`](crate::bulkhead::Bulkhead::adaptive_stats).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct AdaptiveStats {
    /// The algorithm's [`name`](AdaptiveLimit::name).
    pub algorithm: &'static str,
    /// The `max_in_flight` the algorithm set last: its limit plus the critical reserve.
    pub max_in_flight: usize,
    /// The algorithm's round-trip-time estimates.
    pub rtt: RttEstimates,
    /// Samples of calls that ended [`Outcome::Ok`].
    pub ok: u64,
    /// Samples of calls that ended [`Outcome::BackPressure`].
    pub back_pressure: u64,
    /// Samples of calls that ended [`Outcome::Ignored`]: dropped permits, cancelled calls.
    pub ignored: u64,
}

/// The algorithm, and what its gauges were last moved to.
struct Learner {
    algorithm: Box<dyn AdaptiveLimit>,
    /// `max_in_flight`, the RTT minimum and the smoothed RTT, as last published: the sums
    /// of the changes sent, rounded as a recorder adds them, so each change is worked out
    /// from what the gauge shows and rounding errors do not add up. A metrics recorder is
    /// user code: each change to a gauge is worked out here, under the lock, and added to
    /// the gauge after it. Added changes commute, so the gauges end at the latest values
    /// whichever thread adds its change last.
    published: [f64; 3],
}

impl Learner {
    /// Publish `values` (`None`: unknown, left as it is): the changes each gauge must move
    /// by ([`changes`]).
    fn publish(&mut self, values: [Option<f64>; 3]) -> [[f64; 2]; 3] {
        let mut moves = [[0.0; 2]; 3];
        for ((published, moves), value) in self.published.iter_mut().zip(&mut moves).zip(values) {
            if let Some(value) = value {
                let (first, second) = changes(*published, value);
                *moves = [first, second];
                *published = *published + first + second;
            }
        }
        moves
    }
}

pub(crate) struct Adaptive {
    learner: Mutex<Learner>,
    name: &'static str,
    /// `Sample::now` counts from here.
    epoch: Instant,
    /// The critical reserve, kept on top of the algorithm's limit (the share of normal
    /// work), and the builder's `max_in_flight`.
    reserve: u32,
    ceiling: u32,
    /// The latest `max_in_flight` the algorithm asked for.
    target: AtomicU32,
    counts: [AtomicU64; 3],
    metrics: Metrics,
}

impl fmt::Debug for Adaptive {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Adaptive")
            .field("algorithm", &self.name)
            .field("target", &self.target.load(Ordering::Relaxed))
            .field("reserve", &self.reserve)
            .field("ceiling", &self.ceiling)
            .finish_non_exhaustive()
    }
}

/// A sample's metrics, from [`Adaptive::record`]: its count and the gauges' changes, for
/// [`publish`](Published::publish) to record once the bulkhead applied the sample's answer.
/// Recorded when dropped, if not before: a panic as the answer is applied (a waker woken
/// for a permit the answer frees) must not lose the change, which the gauges' next one is
/// worked out from.
#[must_use = "the sample's metrics are recorded by publish"]
pub(crate) struct Published<'a> {
    adaptive: &'a Adaptive,
    outcome: usize,
    changes: [[f64; 2]; 3],
}

impl Published<'_> {
    /// Count the sample and move the gauges: user code, so with no lock held, and last.
    pub(crate) fn publish(self) {
        drop(self);
    }
}

impl Drop for Published<'_> {
    /// Each is recorded whatever the ones before did: a change a recorder's panic skipped
    /// would be lost for good (the next one is worked out from the value published), so a
    /// panic is caught and resumed once all are recorded (dropped if the thread already
    /// unwinds, where a second panic would abort).
    fn drop(&mut self) {
        let metrics = &self.adaptive.metrics;
        let gauges = [
            &metrics.max_in_flight,
            &metrics.rtt_min,
            &metrics.rtt_smoothed,
        ];
        let mut panics = Panics::new();
        panics.run(|| metrics.samples[self.outcome].increment(1));
        for (gauge, pair) in gauges.into_iter().zip(self.changes) {
            for change in pair {
                panics.run(|| gauge.add(change));
            }
        }
        panics.resume();
    }
}

/// The `max_in_flight` of the algorithm's `limit` in a bulkhead of at most `ceiling` with
/// `reserve` permits for critical work: the limit is the share of normal work (which cannot
/// take the reserve: so it can reach the limit it learns), the reserve comes on top.
fn max_in_flight(limit: u32, reserve: u32, ceiling: u32) -> u32 {
    limit.clamp(1, ceiling - reserve) + reserve
}

fn index(outcome: Outcome) -> usize {
    match outcome {
        Outcome::Ok => 0,
        Outcome::BackPressure => 1,
        _ => 2,
    }
}

impl Adaptive {
    /// The adaptive side of a bulkhead of at most `ceiling` permits, `reserve` of them for
    /// critical work (`reserve < ceiling`).
    pub(crate) fn new(
        mut algorithm: Box<dyn AdaptiveLimit>,
        reserve: u32,
        ceiling: u32,
        name: Option<&str>,
    ) -> Adaptive {
        let l = Labels::new(name);
        let samples = |o: &'static str| l.counter(names::SAMPLES, &[("outcome", o)]);
        algorithm.bound(1, ceiling - reserve);
        let target = max_in_flight(algorithm.limit(), reserve, ceiling);
        let adaptive = Adaptive {
            name: algorithm.name(),
            learner: Mutex::new(Learner {
                algorithm,
                published: [f64::from(target), 0.0, 0.0],
            }),
            epoch: Instant::now(),
            reserve,
            ceiling,
            target: AtomicU32::new(target),
            counts: Default::default(),
            metrics: Metrics {
                max_in_flight: l.gauge(names::MAX_IN_FLIGHT, &[]),
                rtt_min: l.gauge(names::RTT_SECONDS, &[("kind", "min")]),
                rtt_smoothed: l.gauge(names::RTT_SECONDS, &[("kind", "smoothed")]),
                samples: [samples("ok"), samples("back_pressure"), samples("ignored")],
            },
        };
        adaptive.metrics.max_in_flight.set(f64::from(target));
        adaptive
    }

    /// The `max_in_flight` to start with.
    pub(crate) fn initial(&self) -> u32 {
        self.target.load(Ordering::Relaxed)
    }

    /// The `max_in_flight` the algorithm asked for last, whichever sample it came from.
    pub(crate) fn target(&self) -> u32 {
        self.target.load(Ordering::Acquire)
    }

    /// Feed the sample of a call granted at `grant` that ended now with `outcome`; answers
    /// the `max_in_flight` to apply (the latest target, whoever set it), and the sample's
    /// metrics, to [`publish`](Published::publish) once the bulkhead applied it: a metrics
    /// recorder is user code, and a panic of its own must not keep the sample from the
    /// algorithm, nor its answer from the bulkhead.
    pub(crate) fn record(&self, grant: Grant, outcome: Outcome) -> (u32, Published<'_>) {
        let outcome_index = index(outcome);
        self.counts[outcome_index].fetch_add(1, Ordering::Relaxed);
        let mut published = Published {
            adaptive: self,
            outcome: outcome_index,
            changes: [[0.0; 2]; 3],
        };
        if outcome_index == 2 {
            // Ignored: nothing to learn, and no lock to take.
            return (self.target(), published);
        }
        // `published` is made before the lock is taken, so it is dropped after it: an
        // algorithm (user code) that panics on the sample leaves it counted in the metrics,
        // as in the stats, with no user code run under the lock.
        let mut learner = self.lock();
        // The clock is read under the lock, so the algorithm sees `now` in order: a
        // `now` earlier than the last one is a clock that stepped back (see
        // `Sample::now`), never a sample that lost a race for the lock.
        let now = Instant::now();
        let sample = Sample {
            rtt: now.saturating_duration_since(grant.at),
            in_flight: grant.in_flight,
            outcome,
            now: now.saturating_duration_since(self.epoch),
        };
        let limit = max_in_flight(
            learner.algorithm.update(&sample),
            self.reserve,
            self.ceiling,
        );
        // Stored, and the gauges' changes worked out, under the lock: the last writer wrote
        // the latest answer (stored after the lock, an older answer could land last).
        self.target.store(limit, Ordering::Release);
        let rtt = learner.algorithm.rtt_estimates();
        published.changes = learner.publish([
            Some(f64::from(limit)),
            rtt.min.map(|d| d.as_secs_f64()),
            rtt.smoothed.map(|d| d.as_secs_f64()),
        ]);
        drop(learner);
        (self.target(), published)
    }

    fn lock(&self) -> MutexGuard<'_, Learner> {
        self.learner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn stats(&self) -> AdaptiveStats {
        let rtt = self.lock().algorithm.rtt_estimates();
        let count = |i: usize| self.counts[i].load(Ordering::Relaxed);
        AdaptiveStats {
            algorithm: self.name,
            max_in_flight: self.target.load(Ordering::Acquire) as usize,
            rtt,
            ok: count(0),
            back_pressure: count(1),
            ignored: count(2),
        }
    }
}
