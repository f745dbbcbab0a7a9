//! `Rate` and `Quota`: validated value types for "how many per how long".
//!
//! Both hold integers only (a count and a period in nanoseconds); no floating point ever
//! enters limiter state, so every algorithm built on them is exact. Constructors validate
//! their input and return [`ConfigError`] naming the field at fault; nothing panics.

use std::fmt;
use std::time::Duration;

use crate::error::{ConfigError, ConfigErrorKind};

pub(crate) const NANOS_PER_SEC: u64 = 1_000_000_000;

/// A count per period: "100 per second", "5 per 90 seconds".
///
/// The count is at least 1 and the period is between 1 ns and `u64::MAX` ns (about 584
/// years). The rate is kept as the exact pair, never as a float, so `Rate::per_second(3)`
/// really means three per second, with no rounding of the 333.3… ms interval.
///
/// For window algorithms ([`FixedWindow`](crate::limit::FixedWindow),
/// [`SlidingLog`](crate::limit::SlidingLog), [`SlidingWindow`](crate::limit::SlidingWindow))
/// the rate *is* the limit: `count` per window of length `period`.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use flowgate::Rate;
///
/// let r = Rate::per(5, Duration::from_secs(90))?;
/// assert_eq!(r.count(), 5);
/// assert_eq!(r.period(), Duration::from_secs(90));
/// assert_eq!(r.interval(), Duration::from_secs(18));
/// assert!(Rate::per(5, Duration::ZERO).is_err());
/// # Ok::<(), flowgate::ConfigError>(())
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Rate {
    count: u32,
    period_ns: u64,
}

impl Rate {
    /// `count` per second.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] on `rate.count` if `count` is zero.
    pub fn per_second(count: u32) -> Result<Rate, ConfigError> {
        Rate::from_nanos(count, NANOS_PER_SEC)
    }

    /// `count` per minute.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] on `rate.count` if `count` is zero.
    pub fn per_minute(count: u32) -> Result<Rate, ConfigError> {
        Rate::from_nanos(count, 60 * NANOS_PER_SEC)
    }

    /// `count` per hour.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] on `rate.count` if `count` is zero.
    pub fn per_hour(count: u32) -> Result<Rate, ConfigError> {
        Rate::from_nanos(count, 3_600 * NANOS_PER_SEC)
    }

    /// `count` per `period`.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] on `rate.count` if `count` is zero, on `rate.period` if `period` is
    /// zero or longer than `u64::MAX` nanoseconds.
    pub fn per(count: u32, period: Duration) -> Result<Rate, ConfigError> {
        let period_ns = u64::try_from(period.as_nanos()).map_err(|_| {
            ConfigError::new(
                "rate.period",
                ConfigErrorKind::TooLarge,
                format!("{period:?} is longer than the longest supported period (u64::MAX ns, about 584 years)"),
            )
        })?;
        Rate::from_nanos(count, period_ns)
    }

    fn from_nanos(count: u32, period_ns: u64) -> Result<Rate, ConfigError> {
        if count == 0 {
            return Err(ConfigError::zero("rate.count"));
        }
        if period_ns == 0 {
            return Err(ConfigError::new(
                "rate.period",
                ConfigErrorKind::Zero,
                "must be at least 1 ns",
            ));
        }
        Ok(Rate { count, period_ns })
    }

    /// How many per period.
    pub const fn count(&self) -> u32 {
        self.count
    }

    /// The period.
    pub const fn period(&self) -> Duration {
        Duration::from_nanos(self.period_ns)
    }

    /// The period in nanoseconds.
    pub const fn period_nanos(&self) -> u64 {
        self.period_ns
    }

    /// The average time between two units, rounded down to whole nanoseconds.
    ///
    /// Only for display and timers: the limiters use the exact pair and never this rounded
    /// value.
    pub const fn interval(&self) -> Duration {
        Duration::from_nanos(self.period_ns / self.count as u64)
    }

    /// How long `units` take at this rate, rounded up to whole nanoseconds (saturating): never
    /// earlier than the exact time.
    #[cfg(feature = "redis")]
    pub(crate) fn time_for(&self, units: u32) -> Duration {
        let ns = (u128::from(units) * u128::from(self.period_ns)).div_ceil(u128::from(self.count));
        Duration::from_nanos(u64::try_from(ns).unwrap_or(u64::MAX))
    }

    /// The rate per second as a float, for display and metrics only.
    pub fn per_second_f64(&self) -> f64 {
        self.count as f64 * NANOS_PER_SEC as f64 / self.period_ns as f64
    }
}

impl fmt::Debug for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Rate({}/{:?})", self.count, self.period())
    }
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} per {:?}", self.count, self.period())
    }
}

/// A sustained [`Rate`] plus a burst: the capacity of a token bucket.
///
/// `burst` is how many units may pass at once after a quiet spell; afterwards units pass at
/// `rate`. The default burst is the rate's count, so `Quota::per_second(100)` lets 100 pass
/// at once and then 100 per second. A burst of 1 means strict spacing.
///
/// # Examples
///
/// ```
/// use flowgate::Quota;
///
/// let q = Quota::per_second(100)?.burst(200)?;
/// assert_eq!(q.rate().count(), 100);
/// assert_eq!(q.burst_size(), 200);
///
/// let err = Quota::per_second(100)?.burst(0).unwrap_err();
/// assert_eq!(err.to_string(), "invalid quota.burst: must be at least 1");
/// # Ok::<(), flowgate::ConfigError>(())
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Quota {
    rate: Rate,
    burst: u32,
}

impl Quota {
    /// A quota from a rate and a burst.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] on `quota.burst` if `burst` is zero.
    pub fn new(rate: Rate, burst: u32) -> Result<Quota, ConfigError> {
        if burst == 0 {
            return Err(ConfigError::zero("quota.burst"));
        }
        Ok(Quota { rate, burst })
    }

    /// `count` per second, with a burst of `count`.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] on `rate.count` if `count` is zero.
    pub fn per_second(count: u32) -> Result<Quota, ConfigError> {
        Rate::per_second(count).map(Quota::from)
    }

    /// `count` per minute, with a burst of `count`.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] on `rate.count` if `count` is zero.
    pub fn per_minute(count: u32) -> Result<Quota, ConfigError> {
        Rate::per_minute(count).map(Quota::from)
    }

    /// `count` per hour, with a burst of `count`.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] on `rate.count` if `count` is zero.
    pub fn per_hour(count: u32) -> Result<Quota, ConfigError> {
        Rate::per_hour(count).map(Quota::from)
    }

    /// `count` per `period`, with a burst of `count`.
    ///
    /// # Errors
    ///
    /// As [`Rate::per`].
    pub fn per(count: u32, period: Duration) -> Result<Quota, ConfigError> {
        Rate::per(count, period).map(Quota::from)
    }

    /// The same rate with another burst.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] on `quota.burst` if `burst` is zero.
    pub fn burst(self, burst: u32) -> Result<Quota, ConfigError> {
        Quota::new(self.rate, burst)
    }

    /// The sustained rate.
    pub const fn rate(&self) -> Rate {
        self.rate
    }

    /// How many units may pass at once.
    pub const fn burst_size(&self) -> u32 {
        self.burst
    }
}

impl From<Rate> for Quota {
    /// A quota whose burst is the rate's count.
    fn from(rate: Rate) -> Quota {
        Quota {
            rate,
            burst: rate.count,
        }
    }
}

impl fmt::Debug for Quota {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Quota({:?}, burst {})", self.rate, self.burst)
    }
}

impl fmt::Display for Quota {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}, burst {}", self.rate, self.burst)
    }
}

/// Compare `qa / wa` with `qb / wb` exactly (`w` in nanoseconds, non-zero).
pub(crate) fn cmp_rate(qa: u64, wa: u128, qb: u64, wb: u128) -> std::cmp::Ordering {
    // Cross-multiplied: a 64-bit quota times a window of up to 2^94 ns does not fit in
    // 128 bits, so each product is computed as (high, low) 64-bit halves of `w`:
    // x × w = (x × hi + carry) × 2^64 + low 64 bits of x × lo.
    let mul = |x: u64, w: u128| -> (u128, u128) {
        let (hi, lo) = (w >> 64, w & u128::from(u64::MAX));
        let lo_prod = u128::from(x) * lo;
        let hi_prod = u128::from(x) * hi + (lo_prod >> 64);
        (hi_prod, lo_prod & u128::from(u64::MAX))
    };
    mul(qa, wb).cmp(&mul(qb, wa))
}
