//! `TokenBucket`: GCRA with exact integer arithmetic.

use std::time::Duration;

use crate::decision::Decision;
use crate::limit::limiter::{ceil_div, check_cost, from_nanos, gcd, nanos};
use crate::limit::{LimitError, Limiter};
use crate::rate::Quota;

/// A token bucket, implemented as GCRA (the generic cell rate algorithm) with exact integer
/// arithmetic.
///
/// The bucket holds up to `burst` tokens and refills at `rate`; a request of `cost` tokens
/// is admitted when that many are there. GCRA stores a single number, the *theoretical
/// arrival time* (TAT) at which the bucket would be full again, instead of a token count
/// and a timestamp.
///
/// # Exactness
///
/// Time is kept in units of `1 / scale` nanoseconds, where `count / period` is reduced to
/// lowest terms and `scale` is its count. One token is then a whole number of units, so
/// `Rate::per_second(3)` refills exactly one token per 333 333 333⅓ ns with no drift.
/// Guarantee: in any interval of length `w`, admitted cost ≤ `burst + rate·w`.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use flowgate::limit::{Limiter, TokenBucket};
/// use flowgate::Quota;
///
/// let mut bucket = TokenBucket::new(Quota::per_second(10)?.burst(5)?);
/// let t0 = Duration::ZERO;
/// for _ in 0..5 {
///     assert!(bucket.check(t0, 1)?.allowed);
/// }
/// let d = bucket.check(t0, 1)?;
/// assert!(!d.allowed);
/// assert_eq!(d.retry_after, Duration::from_millis(100));
/// assert!(bucket.check(t0 + d.retry_after, 1)?.allowed);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct TokenBucket {
    quota: Quota,
    /// Units per nanosecond.
    scale: u64,
    /// Units per token.
    unit: u64,
    /// Units for a full bucket: `burst * unit`.
    tau: u128,
    /// Theoretical arrival time, in units.
    tat: u128,
}

impl TokenBucket {
    /// A full bucket for `quota`.
    pub fn new(quota: Quota) -> TokenBucket {
        let rate = quota.rate();
        let g = gcd(u64::from(rate.count()), rate.period_nanos());
        let scale = u64::from(rate.count()) / g;
        let unit = rate.period_nanos() / g;
        TokenBucket {
            quota,
            scale,
            unit,
            tau: u128::from(quota.burst_size()) * u128::from(unit),
            tat: 0,
        }
    }

    /// The quota this bucket enforces.
    pub fn quota(&self) -> Quota {
        self.quota
    }

    /// Tokens available at `now`, without consuming any.
    pub fn available(&self, now: Duration) -> u64 {
        let now = self.units(now);
        let used = self.tat.saturating_sub(now).min(self.tau);
        ((self.tau - used) / u128::from(self.unit)) as u64
    }

    fn units(&self, now: Duration) -> u128 {
        u128::from(nanos(now)) * u128::from(self.scale)
    }

    fn to_duration(&self, units: u128) -> Duration {
        if self.scale == 1 {
            from_nanos(units)
        } else {
            from_nanos(ceil_div(units, u128::from(self.scale)))
        }
    }

    fn tokens(&self, free_units: u128) -> u64 {
        // `free_units <= tau = burst * unit`, so the quotient fits in a u32.
        (free_units / u128::from(self.unit)) as u64
    }
}

impl Limiter for TokenBucket {
    fn check(&mut self, now: Duration, cost: u32) -> Result<Decision, LimitError> {
        check_cost(cost, self.capacity())?;
        let now = self.units(now);
        let limit = self.capacity();
        let tat = self.tat.max(now);
        let new_tat = tat + u128::from(cost) * u128::from(self.unit);
        // Admit when the bucket after this request is at most full: new_tat - now <= tau.
        let used_after = new_tat - now;
        if used_after <= self.tau {
            self.tat = new_tat;
            Ok(Decision::allow(
                limit,
                self.tokens(self.tau - used_after),
                self.to_duration(used_after),
            ))
        } else {
            // `tat - now` can exceed tau only if time went backwards.
            let used = (tat - now).min(self.tau);
            Ok(Decision::reject(
                limit,
                self.tokens(self.tau - used),
                self.to_duration(used_after - self.tau),
                self.to_duration(tat - now),
            ))
        }
    }

    fn capacity(&self) -> u64 {
        u64::from(self.quota.burst_size())
    }

    fn neutral_at(&self) -> Duration {
        self.to_duration(self.tat)
    }
}
