//! What a run of the driver measured.

use std::time::Duration;

use super::{Reply, Status};

/// One finished call, as the driver recorded it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallRecord {
    /// When the call ended, since the run started.
    pub end: Duration,
    /// The reply.
    pub reply: Reply,
}

/// What a run measured: every finished call and the limit over time.
#[derive(Debug, Clone, Default)]
pub struct Report {
    calls: Vec<CallRecord>,
    limits: Vec<(Duration, u32)>,
    duration: Duration,
}

impl Report {
    pub(super) fn new(
        calls: Vec<CallRecord>,
        limits: Vec<(Duration, u32)>,
        duration: Duration,
    ) -> Report {
        Report {
            calls,
            limits,
            duration,
        }
    }

    /// Every finished call, in the order they ended.
    pub fn calls(&self) -> &[CallRecord] {
        &self.calls
    }

    /// The bulkhead's `max_in_flight`, sampled every tick from the start.
    pub fn limits(&self) -> &[(Duration, u32)] {
        &self.limits
    }

    /// The run's duration.
    pub fn duration(&self) -> Duration {
        self.duration
    }

    fn window(&self, from: Duration, to: Duration) -> impl Iterator<Item = &CallRecord> {
        self.calls
            .iter()
            .filter(move |c| c.end >= from && c.end < to)
    }

    /// Calls that ended in `[from, to)` with `status`.
    pub fn count(&self, from: Duration, to: Duration, status: Status) -> usize {
        self.window(from, to)
            .filter(|c| c.reply.status == status)
            .count()
    }

    /// Served calls per second over `[from, to)` (the goodput).
    pub fn throughput(&self, from: Duration, to: Duration) -> f64 {
        let secs = to.saturating_sub(from).as_secs_f64();
        if secs == 0.0 {
            return 0.0;
        }
        self.count(from, to, Status::Ok) as f64 / secs
    }

    /// The share of calls ending in `[from, to)` that were not served (overloaded or timed
    /// out).
    pub fn error_ratio(&self, from: Duration, to: Duration) -> f64 {
        let (mut all, mut failed) = (0usize, 0usize);
        for c in self.window(from, to) {
            all += 1;
            failed += usize::from(c.reply.status != Status::Ok);
        }
        if all == 0 {
            0.0
        } else {
            failed as f64 / all as f64
        }
    }

    /// The `q`-quantile (`0.99` for p99) of the RTT of the served calls that ended in
    /// `[from, to)` (the nearest rank; zero when there are none).
    pub fn latency(&self, from: Duration, to: Duration, q: f64) -> Duration {
        let mut rtts: Vec<Duration> = self
            .window(from, to)
            .filter(|c| c.reply.status == Status::Ok)
            .map(|c| c.reply.rtt)
            .collect();
        quantile(&mut rtts, q).unwrap_or_default()
    }

    /// How long after `from` the limit entered `target × (1 ± tolerance)` and stayed there
    /// until `to`; `None` if it was outside at the last sample before `to`.
    pub fn settle_time(
        &self,
        from: Duration,
        to: Duration,
        target: u32,
        tolerance: f64,
    ) -> Option<Duration> {
        let low = f64::from(target) * (1.0 - tolerance);
        let high = f64::from(target) * (1.0 + tolerance);
        let inside = |l: u32| (low..=high).contains(&f64::from(l));
        let samples: Vec<_> = self
            .limits
            .iter()
            .filter(|(t, _)| *t >= from && *t < to)
            .collect();
        let last = samples.last()?;
        if !inside(last.1) {
            return None;
        }
        let mut settled = last.0;
        for (t, l) in samples.iter().rev() {
            if !inside(*l) {
                break;
            }
            settled = *t;
        }
        Some(settled - from)
    }

    /// The oscillation of the limit over `[from, to)`: half the distance between its 95th
    /// and 5th percentiles, in permits (zero without samples).
    pub fn oscillation(&self, from: Duration, to: Duration) -> f64 {
        let mut ls: Vec<u32> = self
            .limits
            .iter()
            .filter(|(t, _)| *t >= from && *t < to)
            .map(|&(_, l)| l)
            .collect();
        let high = quantile(&mut ls, 0.95);
        let low = quantile(&mut ls, 0.05);
        match (high, low) {
            (Some(h), Some(l)) => f64::from(h - l) / 2.0,
            _ => 0.0,
        }
    }

    /// The mean of the limit over `[from, to)` (zero without samples).
    pub fn mean_limit(&self, from: Duration, to: Duration) -> f64 {
        let (n, sum) = self
            .limits
            .iter()
            .filter(|(t, _)| *t >= from && *t < to)
            .fold((0u64, 0u64), |(n, s), &(_, l)| (n + 1, s + u64::from(l)));
        if n == 0 { 0.0 } else { sum as f64 / n as f64 }
    }
}

/// The nearest-rank `q`-quantile; sorts `values`.
fn quantile<T: Ord + Copy>(values: &mut [T], q: f64) -> Option<T> {
    if values.is_empty() {
        return None;
    }
    values.sort_unstable();
    let rank = (q.clamp(0.0, 1.0) * values.len() as f64).ceil() as usize;
    Some(values[rank.clamp(1, values.len()) - 1])
}
