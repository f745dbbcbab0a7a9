//! Exact [`Rate`]s for the controller's rates per second: what the pacer is given, and
//! the default floor.

use std::time::Duration;

use crate::rate::{Rate, cmp_rate};

use super::*;

/// The longest period of the rates handed to the pacer, in nanoseconds (within `u64`).
const LONGEST_PERIOD_NS: u64 = 10_000_000_000_000_000_000;

impl Config {
    /// The [`Rate`] the pacer is given for the controller's `per_second`: the ceiling
    /// exactly at or above it, the floor exactly when `per_second` is at or above the floor
    /// but would round below it, and otherwise the fastest rate at or below `per_second`
    /// ([`rate_at_most`]), so the pacer never runs faster than the controller's rate (which
    /// the ceiling and the server's caps bound), nor slower than the floor the controller
    /// keeps.
    pub(super) fn pacer_rate(&self, per_second: f64) -> Rate {
        if per_second >= self.ceiling {
            return self.ceiling_rate;
        }
        let rate = rate_at_most(per_second);
        if per_second >= self.floor && faster(self.floor_rate, rate) {
            self.floor_rate
        } else if faster(rate, self.ceiling_rate) {
            // Only float noise (or a ceiling slower than one per 317 years) gets here.
            self.ceiling_rate
        } else {
            rate
        }
    }
}

/// Whether `a` is faster than `b`, compared exactly.
pub(super) fn faster(a: Rate, b: Rate) -> bool {
    let (qa, wa) = (u64::from(a.count()), u128::from(a.period_nanos()));
    let (qb, wb) = (u64::from(b.count()), u128::from(b.period_nanos()));
    cmp_rate(qa, wa, qb, wb).is_gt()
}

/// The fastest rate at or below `per_second` of the form `count` per `10^k` ns, with the
/// longest such period (at most [`LONGEST_PERIOD_NS`]) whose count fits in a `u32`: nine
/// significant digits or more from one per 10 s up to `u32::MAX` per ns, seven or more
/// down to one per 1 000 s. At least one per `LONGEST_PERIOD_NS` (about 317 years).
fn rate_at_most(per_second: f64) -> Rate {
    let mut period_ns = LONGEST_PERIOD_NS;
    loop {
        let count = (per_second * period_ns as f64 / 1e9).floor();
        if count <= f64::from(u32::MAX) || period_ns == 1 {
            let count = count.clamp(1.0, f64::from(u32::MAX)) as u32;
            return Rate::per(count, Duration::from_nanos(period_ns))
                .unwrap_or_else(|_| unreachable!("a count of at least 1 per at least 1 ns"));
        }
        period_ns /= 10;
    }
}

/// `rate / 100`, exactly when a count and a period can say it (else the fastest rate
/// below it, see [`rate_at_most`]); never faster than `rate` itself: below one per 317
/// years `rate_at_most` rounds up to that, and then the slowest rate a [`Rate`] holds (one
/// per `u64::MAX` ns) is taken instead.
pub(super) fn hundredth(rate: Rate) -> Rate {
    let (count, period_ns) = if rate.count().is_multiple_of(100) {
        (rate.count() / 100, Some(rate.period_nanos()))
    } else {
        (rate.count(), rate.period_nanos().checked_mul(100))
    };
    let hundredth = period_ns
        .and_then(|ns| Rate::per(count, Duration::from_nanos(ns)).ok())
        .unwrap_or_else(|| rate_at_most(rate.per_second_f64() / 100.0));
    if faster(hundredth, rate) {
        Rate::per(1, Duration::from_nanos(u64::MAX))
            .unwrap_or_else(|_| unreachable!("a count of 1 per u64::MAX ns"))
    } else {
        hundredth
    }
}
