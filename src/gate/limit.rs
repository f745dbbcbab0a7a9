//! `Limit`: which algorithm a gate runs, with its parameters.

use std::fmt;

#[cfg(feature = "redis")]
use crate::error::CostError;
#[cfg(feature = "redis")]
use crate::error::{ConfigError, ConfigErrorKind};
use crate::rate::{Quota, Rate};

/// The limit a gate enforces per key: an algorithm of [`limit`](crate::limit) and its
/// parameters. The in-memory and Redis gates run the same math and give the same decisions,
/// but for two things: Redis counts in whole microseconds (its waits are rounded up to
/// them), and its windows start at multiples of their length since the Unix epoch, where a
/// [`MemoryGate`](crate::gate::MemoryGate)'s start at multiples since its clock's start.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Limit {
    /// [`TokenBucket`](crate::limit::TokenBucket) (GCRA): `rate`, bursts of `burst`.
    TokenBucket(Quota),
    /// [`FixedWindow`](crate::limit::FixedWindow): `count` per aligned `period`.
    FixedWindow(Rate),
    /// [`SlidingLog`](crate::limit::SlidingLog): `count` in any interval of `period`.
    ///
    /// On Redis, a script call reads the whole live log of each key it decides (up to
    /// `count` entries; once per key, however many requests of the batch are on it), in
    /// Redis's single thread: about 0.5 µs an entry, so 14 ms at 30 000 entries, during
    /// which Redis serves no one else. Past the gate's `timeout` (50 ms by default) a
    /// healthy Redis reads as failing and the gate decides by its failure policy. For
    /// counts of tens of thousands per window, use [`SlidingWindow`](Limit::SlidingWindow)
    /// (a constant cost per decision).
    SlidingLog(Rate),
    /// [`SlidingWindow`](crate::limit::SlidingWindow): the weighted two-window counter.
    SlidingWindow(Rate),
}

/// The largest magnitude the Lua scripts compute with (exact integers in doubles).
#[cfg(feature = "redis")]
const LUA_EXACT: u128 = 1 << 52;

impl Limit {
    /// The most a single request can cost.
    pub fn capacity(&self) -> u64 {
        match self {
            Limit::TokenBucket(q) => u64::from(q.burst_size()),
            Limit::FixedWindow(r) | Limit::SlidingLog(r) | Limit::SlidingWindow(r) => {
                u64::from(r.count())
            }
        }
    }

    /// A stable lowercase name for metrics and key prefixes.
    pub fn name(&self) -> &'static str {
        match self {
            Limit::TokenBucket(_) => "token_bucket",
            Limit::FixedWindow(_) => "fixed_window",
            Limit::SlidingLog(_) => "sliding_log",
            Limit::SlidingWindow(_) => "sliding_window",
        }
    }

    /// The rate: the refill rate of a token bucket, or the count per window.
    pub fn rate(&self) -> Rate {
        match self {
            Limit::TokenBucket(q) => q.rate(),
            Limit::FixedWindow(r) | Limit::SlidingLog(r) | Limit::SlidingWindow(r) => *r,
        }
    }

    #[cfg(feature = "redis")]
    pub(crate) fn check_cost(&self, cost: u32) -> Result<(), CostError> {
        CostError::check(cost, self.capacity())
    }

    /// The period in whole microseconds, and a check that the Lua arithmetic stays exact.
    #[cfg(feature = "redis")]
    ///
    /// # Errors
    ///
    /// [`ConfigError`] on `gate.limit` if the period is not a whole number of microseconds,
    /// or the numbers are too large to compute exactly in Redis.
    pub(crate) fn redis_params(&self) -> Result<(u64, u64), ConfigError> {
        let rate = self.rate();
        let period_ns = rate.period_nanos();
        if !period_ns.is_multiple_of(1_000) {
            return Err(ConfigError::new(
                "gate.limit",
                ConfigErrorKind::Inconsistent,
                format!(
                    "the Redis gate works in microseconds; {:?} is not a whole number of them",
                    rate.period()
                ),
            ));
        }
        let period_us = period_ns / 1_000;
        let count = u64::from(rate.count());
        let span = match self {
            Limit::TokenBucket(q) => u128::from(q.burst_size()) * u128::from(period_us),
            _ => u128::from(count) * u128::from(period_us),
        };
        if span >= LUA_EXACT || u128::from(count) * 1_000 >= LUA_EXACT {
            return Err(ConfigError::new(
                "gate.limit",
                ConfigErrorKind::TooLarge,
                "burst (or count) × period in microseconds must stay below 2^52 for exact arithmetic in Redis",
            ));
        }
        Ok((count, period_us))
    }
}

impl fmt::Debug for Limit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Limit::TokenBucket(q) => write!(f, "TokenBucket({q})"),
            Limit::FixedWindow(r) => write!(f, "FixedWindow({r})"),
            Limit::SlidingLog(r) => write!(f, "SlidingLog({r})"),
            Limit::SlidingWindow(r) => write!(f, "SlidingWindow({r})"),
        }
    }
}
