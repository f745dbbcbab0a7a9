//! `LimitError`: a request a limiter cannot decide.

use std::fmt;

/// A request a limiter refuses to decide, as opposed to one it rejects.
///
/// A rejection is a normal [`Decision`](crate::Decision) with `allowed == false` and a
/// `retry_after`. An error means waiting would not help: the request is malformed or could
/// never pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LimitError {
    /// The cost is larger than the limiter's capacity: it could never be admitted, so no
    /// `retry_after` is given (waiting for it would never end).
    InsufficientCapacity {
        /// The requested cost.
        cost: u32,
        /// The most the limiter can ever admit at once (burst or window limit).
        capacity: u64,
    },
    /// A cost of zero was asked for. Costs are at least 1.
    ZeroCost,
    /// A [`Keyed`](crate::limit::Keyed) map is at its maximum number of keys, none of them
    /// can be evicted yet, and the request was for a new key.
    KeyspaceFull {
        /// The configured maximum number of keys.
        max_keys: usize,
    },
}

impl fmt::Display for LimitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LimitError::InsufficientCapacity { cost, capacity } => write!(
                f,
                "cost {cost} exceeds the capacity {capacity}: it could never be admitted"
            ),
            LimitError::ZeroCost => f.write_str("cost must be at least 1"),
            LimitError::KeyspaceFull { max_keys } => write!(
                f,
                "all {max_keys} keys are in use and none is idle yet: new keys are refused"
            ),
        }
    }
}

impl std::error::Error for LimitError {}
