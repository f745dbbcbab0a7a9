//! The configuration error shared by every constructor.

use std::borrow::Cow;
use std::fmt;

/// What is wrong with a configuration value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ConfigErrorKind {
    /// The value is zero where at least one is needed.
    Zero,
    /// The value is larger than the component can represent or handle.
    TooLarge,
    /// The value contradicts another setting.
    Inconsistent,
}

/// A configuration value was rejected: zero, too large, or inconsistent with another.
///
/// Every fallible constructor in flowgate returns this error instead of panicking (the
/// Redis Streams source's builder within its `BuildError`, beside the Redis error that
/// kept it from creating its group). It names
/// the offending field and says why it was rejected, so the message can be shown to an
/// operator as is.
///
/// # Examples
///
/// ```
/// use flowgate::{ConfigErrorKind, Rate};
///
/// let err = Rate::per_second(0).unwrap_err();
/// assert_eq!(err.field(), "rate.count");
/// assert_eq!(err.kind(), ConfigErrorKind::Zero);
/// assert_eq!(err.to_string(), "invalid rate.count: must be at least 1");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    field: &'static str,
    kind: ConfigErrorKind,
    reason: Cow<'static, str>,
}

impl ConfigError {
    pub(crate) fn new(
        field: &'static str,
        kind: ConfigErrorKind,
        reason: impl Into<Cow<'static, str>>,
    ) -> Self {
        Self {
            field,
            kind,
            reason: reason.into(),
        }
    }

    /// A count that is zero: "must be at least 1".
    pub(crate) fn zero(field: &'static str) -> Self {
        Self::new(field, ConfigErrorKind::Zero, "must be at least 1")
    }

    /// A duration that is zero: "must be longer than zero" (a count's "at least 1" says
    /// no unit).
    pub(crate) fn zero_duration(field: &'static str) -> Self {
        Self::new(field, ConfigErrorKind::Zero, "must be longer than zero")
    }

    /// The configuration field that was rejected, e.g. `"quota.burst"`.
    pub fn field(&self) -> &'static str {
        self.field
    }

    /// The class of problem.
    pub fn kind(&self) -> ConfigErrorKind {
        self.kind
    }

    /// Why the value was rejected, in words.
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid {}: {}", self.field, self.reason)
    }
}

impl std::error::Error for ConfigError {}

/// A cost that no limiter, gate or pacer can ever grant, so it is refused at once instead of
/// waiting forever.
///
/// Every component that takes a `cost` checks it the same way and answers with this error:
/// the [`limit`](crate::limit) algorithms, the [`gate`](crate::gate)s and the
/// [`Pacer`](crate::pace::Pacer). The `capacity` is the most units admitted at once: a
/// quota's burst, a window's count (the same number as [`Decision::capacity`](crate::Decision::capacity)).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use flowgate::limit::{Limiter, TokenBucket};
/// use flowgate::{CostError, Quota};
///
/// let mut bucket = Limiter::new(TokenBucket::new(Quota::per_second(5)?));
/// assert_eq!(bucket.check(Duration::ZERO, 0), Err(CostError::Zero));
/// assert_eq!(
///     bucket.check(Duration::ZERO, 6),
///     Err(CostError::ExceedsCapacity { cost: 6, capacity: 5 })
/// );
/// # Ok::<(), flowgate::ConfigError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CostError {
    /// A cost of zero: costs are at least 1.
    Zero,
    /// The cost is larger than the capacity: it could never be admitted, so no
    /// `retry_after` is given (waiting for it would never end).
    ExceedsCapacity {
        /// The requested cost.
        cost: u32,
        /// The most units ever admitted at once (a burst, or a window's count).
        capacity: u64,
    },
}

impl CostError {
    /// Check `cost` against `capacity`: at least 1, at most `capacity`.
    pub(crate) fn check(cost: u32, capacity: u64) -> Result<(), CostError> {
        if cost == 0 {
            Err(CostError::Zero)
        } else if u64::from(cost) > capacity {
            Err(CostError::ExceedsCapacity { cost, capacity })
        } else {
            Ok(())
        }
    }
}

impl fmt::Display for CostError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CostError::Zero => f.write_str("cost must be at least 1"),
            CostError::ExceedsCapacity { cost, capacity } => write!(
                f,
                "cost {cost} exceeds the capacity {capacity}: it could never be admitted"
            ),
        }
    }
}

impl std::error::Error for CostError {}
