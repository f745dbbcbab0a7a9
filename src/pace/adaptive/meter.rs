//! `Meter`: counts events (successes, responses) over the last second.

use std::time::Duration;

use tokio::time::Instant;

/// One bucket of the response meter; the meter spans `METER_BUCKETS` of them.
const METER_BUCKET: Duration = Duration::from_millis(250);
const METER_BUCKETS: usize = 4;

/// Counts events over the last second, in four buckets of 250 ms.
#[derive(Debug)]
pub(super) struct Meter {
    origin: Instant,
    /// The index (since `origin`) of the newest bucket.
    newest: u64,
    buckets: [u64; METER_BUCKETS],
}

impl Meter {
    pub(super) fn new(origin: Instant) -> Meter {
        Meter {
            origin,
            newest: 0,
            buckets: [0; METER_BUCKETS],
        }
    }

    fn index(&self, now: Instant) -> u64 {
        let since = now.saturating_duration_since(self.origin).as_nanos();
        u64::try_from(since / METER_BUCKET.as_nanos()).unwrap_or(u64::MAX)
    }

    fn roll(&mut self, now: Instant) {
        let index = self.index(now);
        let stale = index.saturating_sub(self.newest);
        for k in 1..=stale.min(METER_BUCKETS as u64) {
            let slot = (self.newest.wrapping_add(k) % METER_BUCKETS as u64) as usize;
            self.buckets[slot] = 0;
        }
        self.newest = self.newest.max(index);
    }

    pub(super) fn record(&mut self, now: Instant) {
        self.roll(now);
        let slot = (self.newest % METER_BUCKETS as u64) as usize;
        self.buckets[slot] = self.buckets[slot].saturating_add(1);
    }

    /// Events over the buckets kept (at most the last second, plus the current bucket's
    /// part).
    pub(super) fn count(&mut self, now: Instant) -> u64 {
        self.roll(now);
        self.buckets.iter().sum()
    }

    /// Events per second over the buckets kept (at most the last second, plus the
    /// current bucket's part), or since the origin when that is shorter.
    pub(super) fn per_second(&mut self, now: Instant) -> f64 {
        let total = self.count(now);
        let since = now.saturating_duration_since(self.origin).as_nanos();
        let bucket = METER_BUCKET.as_nanos();
        let into_newest = since.saturating_sub(bucket * u128::from(self.newest));
        let span = (bucket * (METER_BUCKETS as u128 - 1) + into_newest).min(since);
        if span == 0 {
            return 0.0;
        }
        total as f64 * 1e9 / span as f64
    }
}
