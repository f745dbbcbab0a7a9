//! The controller: its phase, the server's caps, probing and tracking, and handing the
//! rate to the pacer.

use std::collections::VecDeque;
use std::sync::PoisonError;
use std::time::Duration;

use tokio::time::Instant;

use crate::pace::Pacer;
use crate::sync::{MutexGuard, Panics};

use super::*;

impl Shared {
    pub(super) fn lock(&self) -> MutexGuard<'_, Control> {
        self.control.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn phase(&self, c: &Control, now: Instant) -> Phase {
        if c.paused_until.is_some_and(|p| p > now) {
            Phase::Paused
        } else if self.tracking(c, now) {
            Phase::Tracking
        } else {
            Phase::Probing
        }
    }

    fn tracking(&self, c: &Control, now: Instant) -> bool {
        c.policy(now).is_some()
            && c.remaining
                .back()
                .is_some_and(|&(at, _)| now.saturating_duration_since(at) <= FIELDS_FRESH)
    }

    /// The highest rate allowed now. The floor bounds the cuts, never the server: a policy
    /// or an allowance below the floor caps the rate below it.
    pub(super) fn cap(&self, c: &Control, now: Instant) -> f64 {
        let mut server = f64::INFINITY;
        if let Some((sustained, _, _)) = c.policy(now) {
            server = server.min(sustained);
        }
        if let Some((allowed, until)) = c.allowance
            && now < until
        {
            server = server.min(allowed);
        }
        self.config.ceiling.min(server.max(MIN_CAP))
    }

    /// Keep the rate at or above the floor, then at or below the cap.
    pub(super) fn bound(&self, c: &mut Control, now: Instant) {
        c.rate = c.rate.max(self.config.floor).min(self.cap(c, now));
    }

    /// Whether the caller uses the rate (so that growing it means something). A waiter
    /// stepped over does not: its task is not polling it.
    fn in_use(&self, c: &mut Control, now: Instant) -> bool {
        self.pacer.inner().has_present_waiter()
            || c.responses.per_second(now) >= USED_SHARE * c.rate
    }

    /// Advance the controller to `now`.
    pub(super) fn step(&self, c: &mut Control, now: Instant) {
        let dt = now.saturating_duration_since(c.last_update).min(MAX_STEP);
        c.last_update = now;
        let paused = c.paused_until.is_some_and(|p| p > now);
        if !paused {
            c.paused_until = None;
        }
        let dt = dt.as_secs_f64();
        if !paused && dt > 0.0 {
            if self.tracking(c, now) {
                self.track(c, now, dt);
            } else if self.in_use(c, now) {
                self.probe(c, now, dt);
            }
        }
        self.bound(c, now);
    }

    /// Probing: climb (additive, accelerating; doubling while far below the last good rate).
    fn probe(&self, c: &mut Control, now: Instant, dt: f64) {
        if c.rate < SLOW_START_BELOW * c.last_good {
            c.rate = (c.rate * dt.exp2()).min(SLOW_START_BELOW * c.last_good);
        } else {
            let quiet = now.saturating_duration_since(c.last_cut).as_secs_f64();
            let step = self.config.increase * c.last_good * (1.0 + quiet / PROBE_ACCEL_SECS);
            c.rate += step * dt;
        }
    }

    /// Tracking: correct the rate by the aggregate's relative error (see the type's docs).
    fn track(&self, c: &mut Control, now: Instant, dt: f64) {
        // The remaining's own policy, when known: steered by another's quota, a second's
        // remaining reads as a day's bucket almost empty.
        let Some((sustained, quota)) = c.remaining_of.or_else(|| {
            c.policy(now)
                .map(|(sustained, quota, _)| (sustained, quota))
        }) else {
            return;
        };
        let Some(&(_, r)) = c.remaining.back() else {
            return;
        };
        let q = quota as f64;
        let r = (r as f64).min(q);
        let target = sustained + (r - TRACK_LEVEL * q) / TRACK_LEVEL_TIME;
        // The bucket's trend is the aggregate's shortfall (it cannot show one when full or
        // empty: then only the level speaks).
        let full = r >= q - (q / 50.0).max(1.0);
        let trend = if full || r < 1.0 {
            0.0
        } else {
            trend(&c.remaining, now).unwrap_or(0.0)
        };
        let aggregate = sustained - trend;
        let error = if full {
            // Below the sustained rate by an unknown amount: climb at the fastest pace.
            MAX_ERROR
        } else {
            ((target - aggregate) / sustained).clamp(-MAX_ERROR, MAX_ERROR)
        };
        if error > 0.0 && !self.in_use(c, now) {
            return;
        }
        c.rate *= (TRACK_GAIN * error * dt).exp();
    }

    /// The rate to hand to the pacer, when it changed enough, or when the rate the pacer
    /// has is above the cap now (a server's cap a hair below it: never faster than the
    /// server allows): give it to [`hand_over`](Self::hand_over) once the control lock is
    /// released (the pacer wakes its waiters when its quota changes).
    pub(super) fn apply(&self, c: &mut Control, now: Instant) -> Option<f64> {
        if (c.rate - c.applied).abs() <= APPLY_SHARE * c.applied && c.applied <= self.cap(c, now) {
            return None;
        }
        c.applied = c.rate;
        Some(c.rate)
    }

    /// Hand a rate from [`apply`](Self::apply) to the pacer and the gauge; call without the
    /// control lock. Two callers may hand over in the opposite order to the one they applied
    /// in: each checks afterwards that the pacer has the latest applied rate, and hands that
    /// over if not, so the last word is always the latest rate. User code that panics as
    /// the rate is handed over (a metrics recorder as the gauge is set, a waiter's waker as
    /// the pacer wakes its waiters) does not skip that check, nor the gauge: its panic is
    /// caught, and resumed once the pacer and the gauge have the latest rate.
    pub(super) fn hand_over(&self, mut rate: Option<f64>) {
        let mut panics = Panics::new();
        while let Some(r) = rate {
            panics.run(|| {
                self.pacer
                    .set_quota(Pacer::default_quota(self.config.pacer_rate(r)));
            });
            panics.run(|| self.rate_gauge.set(r));
            let latest = self.lock().applied;
            rate = (latest != r).then_some(latest);
        }
        panics.resume();
    }
}

/// The earliest the pacer's next unit may be due once the server reported `remaining`
/// units within `reset`, refilled before it by `refill` (`q` per `w`; none: nothing comes
/// back before the reset), so that no more pass than the server has, whatever the
/// bucket held. Until the reset the pacer runs at most at the allowance's cap, one unit
/// per `p = min(reset / max(r, 1), w / q)`; the next unit is due no earlier than
/// `now − x·p`, with `x = min(r, max(1, ⌈reset · q / w⌉)) − 1`: at most `r` units at once,
/// and before the reset no more than `r` plus the units refilled by then (at a cap of
/// `r / reset`, above the refill, only the refilled units may run ahead). With nothing
/// remaining, `x = −1`: `now + p`, when the server has one unit again. `None` when that
/// instant is before any this clock can tell (the bucket cannot hold that many units).
pub(super) fn allowance_hold(
    now: Instant,
    remaining: u64,
    reset: Duration,
    refill: Option<(u64, Duration)>,
) -> Option<Instant> {
    let (r, t) = (u128::from(remaining), reset.as_nanos());
    // In `u128`: `reset` is at most a century (`capped`), under 2^62 ns.
    let refilled = refill.map_or(0, |(q, w)| (t * u128::from(q)).div_ceil(w.as_nanos()));
    let Some(x) = r.min(refilled.max(1)).checked_sub(1) else {
        // Nothing remaining: one period, rounded up (never sooner than the server).
        let p = refill.map_or(t, |(q, w)| t.min(w.as_nanos().div_ceil(u128::from(q))));
        return Some(now + Duration::from_nanos(u64::try_from(p).unwrap_or(u64::MAX)));
    };
    // `x` periods, rounded down (never more units than the server has); `x·w < t·q`.
    let lead = refill.map_or(x * t / r, |(q, w)| {
        (x * t / r).min(x * w.as_nanos() / u128::from(q))
    });
    now.checked_sub(Duration::from_nanos(u64::try_from(lead).ok()?))
}

/// The least-squares slope of the server's remaining over the last `TREND_SPAN`, in units
/// per second; `None` with too few samples or too short a span.
fn trend(samples: &VecDeque<(Instant, u64)>, now: Instant) -> Option<f64> {
    let first = samples.front()?.0;
    // Read in place (it runs on every response): two passes over the recent samples.
    let points = || {
        samples
            .iter()
            .filter(move |&&(at, _)| now.saturating_duration_since(at) <= TREND_SPAN)
            .map(move |&(at, r)| (at.saturating_duration_since(first).as_secs_f64(), r as f64))
    };
    let (mut count, mut sum_t, mut sum_r) = (0usize, 0.0, 0.0);
    let (mut first_t, mut last_t) = (None, 0.0);
    for (t, r) in points() {
        count += 1;
        sum_t += t;
        sum_r += r;
        first_t.get_or_insert(t);
        last_t = t;
    }
    if count < 3 {
        return None;
    }
    let span = last_t - first_t.unwrap_or(last_t);
    if span < TREND_MIN_SPAN.as_secs_f64() {
        return None;
    }
    let n = count as f64;
    let (mean_t, mean_r) = (sum_t / n, sum_r / n);
    let (mut num, mut den) = (0.0, 0.0);
    for (t, r) in points() {
        num += (t - mean_t) * (r - mean_r);
        den += (t - mean_t) * (t - mean_t);
    }
    (den > 0.0).then(|| num / den)
}
