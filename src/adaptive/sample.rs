//! What an adaptive limit learns from: one sample per finished call.

use std::fmt;
use std::time::Duration;

/// How a call ended, as an adaptive limit sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Outcome {
    /// The call completed and the downstream served it: its round-trip time is a
    /// measurement of the downstream's latency at this concurrency. A call answered without
    /// the downstream (a cache hit, a short-circuit) is no such measurement: report it as
    /// [`Ignored`](Outcome::Ignored). The latency-based limits take the lowest round trip
    /// of the last minute or two as the downstream's no-load time, and one such call of a
    /// microsecond among 10 ms ones would make every later call look queued (measured: a
    /// limit of 16 cut to 1–5 until that minimum ages out, or, for `Vegas`, is measured
    /// again at its next probe).
    Ok,
    /// The downstream pushed back (`429`, `503`, a timeout, a connection refused for
    /// overload): a signal to lower the limit, whatever the round-trip time says.
    BackPressure,
    /// Says nothing about the downstream's capacity (the call was cancelled or dropped, a
    /// client error such as a `400`): the sample is ignored. Its round-trip time, often
    /// near zero, must not pull the limit up.
    Ignored,
}

/// One finished call: how long the call itself took (never its wait for a permit), how many
/// calls were in flight when it started (itself included), and how it ended.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    /// The call's own round-trip time, from the permit's grant to the call's end (as the
    /// code that awaits the call sees it: for the in-poll bulkhead stream adapters, the
    /// poll that finds it finished; see the [module docs](crate::adaptive)).
    pub rtt: Duration,
    /// Calls in flight when this one started, itself included.
    pub in_flight: u32,
    /// How it ended.
    pub outcome: Outcome,
    /// When it ended, as time since the limit was created (the algorithms take `now`
    /// explicitly, as the [`limit`](crate::limit) math does, so they are deterministic).
    /// Feed samples in the order of their `now` (read the clock where the samples are
    /// serialized, as a bulkhead does under its algorithm's lock): a `now` earlier than an
    /// earlier sample's is taken as a clock that stepped back, the clock's new time, and
    /// flowgate's algorithms carry on from it rather than wait for the old one.
    pub now: Duration,
}

impl fmt::Debug for Sample {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sample")
            .field("rtt", &self.rtt)
            .field("in_flight", &self.in_flight)
            .field("outcome", &self.outcome)
            .field("now", &self.now)
            .finish()
    }
}

/// An algorithm that sets a concurrency limit from samples of finished calls.
///
/// A pure state machine: `update` takes one sample and answers the new limit, always
/// within `[min_limit, max_limit]` of the algorithm's configuration. It never reads a clock
/// (the sample carries `now`), never waits, and is driven under a lock by the
/// [`Bulkhead`](crate::bulkhead::Bulkhead) it is given to, so it must be cheap.
pub trait AdaptiveLimit: Send + fmt::Debug + 'static {
    /// The current limit.
    fn limit(&self) -> u32;

    /// Learn from one finished call; return the new limit.
    fn update(&mut self, sample: &Sample) -> u32;

    /// Keep the limit within `[min_limit, max_limit]` from now on, as well as within the
    /// algorithm's own bounds (where the two do not meet, at the end of `[min_limit,
    /// max_limit]` nearest them); the bounds of an earlier call no longer hold. flowgate's algorithms take `max_limit` as their own
    /// highest limit when theirs was left at its default (1000): a bulkhead of 10 000 lets
    /// one grow past 1000 unless it was given a `max_limit` of its own. An adaptive [`Bulkhead`](crate::bulkhead::Bulkhead)
    /// calls it once when it is built, with `[1, max_in_flight − critical_reserve]` (the
    /// share of normal work), so the limit never runs past a level the bulkhead can use and
    /// a cut shows in its `max_in_flight` at once. The default does nothing: the bulkhead
    /// then only clamps the answers of `update`. flowgate's algorithms take a `min_limit` of
    /// 0 as 1 and a `max_limit` below `min_limit` as `min_limit`: bad bounds never panic.
    fn bound(&mut self, min_limit: u32, max_limit: u32) {
        let _ = (min_limit, max_limit);
    }

    /// A short name for reports (`"aimd"`, `"gradient2"`, ...): a bulkhead shows it as
    /// [`AdaptiveStats::algorithm`](crate::bulkhead::AdaptiveStats::algorithm) and in its
    /// `Debug` output. It is not a metrics label: the bulkhead's metrics carry its `name` only.
    fn name(&self) -> &'static str;

    /// The algorithm's round-trip-time estimates, for metrics and reports (the
    /// bulkhead publishes them as `flowgate_bulkhead_rtt_seconds{kind}`). The default
    /// knows none.
    fn rtt_estimates(&self) -> RttEstimates {
        RttEstimates::default()
    }
}

/// What an [`AdaptiveLimit`] currently believes about the downstream's round-trip time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct RttEstimates {
    /// The no-load round-trip time the algorithm compares against (a windowed minimum),
    /// once it has one.
    pub min: Option<Duration>,
    /// The smoothed (averaged) round-trip time, once it has one.
    pub smoothed: Option<Duration>,
}

impl RttEstimates {
    /// Estimates from their parts (for algorithms written outside flowgate).
    pub fn new(min: Option<Duration>, smoothed: Option<Duration>) -> RttEstimates {
        RttEstimates { min, smoothed }
    }
}
