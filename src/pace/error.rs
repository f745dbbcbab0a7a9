//! Errors of the pacer.

use std::fmt;
use std::time::Duration;

/// A request a [`Pacer`](crate::pace::Pacer) can never grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PaceError {
    /// The cost is larger than the burst: it could never pass, so it is refused instead of
    /// waiting forever.
    InsufficientCapacity {
        /// The requested cost.
        cost: u32,
        /// The pacer's burst.
        burst: u32,
    },
    /// A cost of zero was asked for.
    ZeroCost,
}

impl fmt::Display for PaceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PaceError::InsufficientCapacity { cost, burst } => write!(
                f,
                "cost {cost} exceeds the pacer's burst {burst}: it could never pass"
            ),
            PaceError::ZeroCost => f.write_str("cost must be at least 1"),
        }
    }
}

impl std::error::Error for PaceError {}

/// Why [`Pacer::try_acquire`](crate::pace::Pacer::try_acquire) did not grant at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TryAcquireError {
    /// Not yet: the same cost can pass after this long (if nothing else takes it first).
    RetryAfter(Duration),
    /// Never: the request is invalid.
    Invalid(PaceError),
}

impl TryAcquireError {
    /// How long to wait before retrying, if waiting can help.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            TryAcquireError::RetryAfter(d) => Some(*d),
            TryAcquireError::Invalid(_) => None,
        }
    }
}

impl fmt::Display for TryAcquireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TryAcquireError::RetryAfter(d) => write!(f, "pacer busy: retry after {d:?}"),
            TryAcquireError::Invalid(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for TryAcquireError {}
