//! The `Limiter` trait and the integer time helpers the algorithms share.

use std::time::Duration;

use crate::decision::Decision;
use crate::limit::LimitError;

/// A pure, synchronous rate-limiting state machine with an explicit clock.
///
/// `now` is the time since an origin of the caller's choice (the same origin for every call
/// on one limiter), with nanosecond resolution. Time must not go backwards; if it does, the
/// limiter treats the earlier `now` as "no time has passed" and stays conservative.
///
/// Every implementation follows the same contract:
/// - a rejected check consumes nothing;
/// - `cost == 0` is [`LimitError::ZeroCost`], `cost > capacity()` is
///   [`LimitError::InsufficientCapacity`], and neither changes the state;
/// - when rejected, checking the same cost again at `now + retry_after` is admitted (if
///   nothing else was admitted in between).
pub trait Limiter {
    /// Decide one request of `cost` units at time `now`; consume the cost if it is admitted.
    ///
    /// # Errors
    ///
    /// [`LimitError::ZeroCost`] and [`LimitError::InsufficientCapacity`], as above.
    fn check(&mut self, now: Duration, cost: u32) -> Result<Decision, LimitError>;

    /// The most units that can ever be admitted at once.
    fn capacity(&self) -> u64;

    /// The earliest time at which the state equals that of a fresh limiter (everything
    /// consumed has been restored). A fresh limiter returns `Duration::ZERO`.
    fn neutral_at(&self) -> Duration;

    /// Whether the state at `now` is that of a fresh limiter, so it can be forgotten.
    fn is_neutral(&self, now: Duration) -> bool {
        self.neutral_at() <= now
    }
}

/// Validates the cost against the capacity, as every limiter must.
pub(crate) fn check_cost(cost: u32, capacity: u64) -> Result<(), LimitError> {
    if cost == 0 {
        Err(LimitError::ZeroCost)
    } else if u64::from(cost) > capacity {
        Err(LimitError::InsufficientCapacity { cost, capacity })
    } else {
        Ok(())
    }
}

/// `now` in whole nanoseconds, saturating after ~584 years.
pub(crate) fn nanos(now: Duration) -> u64 {
    u64::try_from(now.as_nanos()).unwrap_or(u64::MAX)
}

/// `a / b`, rounded up.
pub(crate) fn ceil_div(a: u128, b: u128) -> u128 {
    a.div_ceil(b)
}

/// A nanosecond count as a `Duration`, saturating.
pub(crate) fn from_nanos(ns: u128) -> Duration {
    Duration::from_nanos(u64::try_from(ns).unwrap_or(u64::MAX))
}

pub(crate) fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}
