//! `KeyedError`: a request a [`Keyed`](crate::limit::Keyed) map cannot decide.

use std::fmt;

use crate::error::CostError;

/// A request a [`Keyed`](crate::limit::Keyed) map refuses to decide, as opposed to one it
/// rejects.
///
/// A rejection is a normal [`Decision`](crate::Decision) with `allowed == false` and a
/// `retry_after`. An error means the request was not decided: its cost could never pass
/// ([`KeyedError::Cost`], the only error of a single [`Limiter`](crate::limit::Limiter)), or
/// the map has no room for a new key yet ([`KeyedError::KeyspaceFull`]).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use flowgate::limit::{Keyed, KeyedError, TokenBucket};
/// use flowgate::{CostError, Quota};
///
/// let mut per_user = Keyed::new(TokenBucket::new(Quota::per_second(1)?), 1)?;
/// let t = Duration::ZERO;
/// assert_eq!(per_user.check("alice", t, 0), Err(KeyedError::Cost(CostError::Zero)));
/// assert!(per_user.check("alice", t, 1)?.allowed);
/// assert_eq!(per_user.check("bob", t, 1), Err(KeyedError::KeyspaceFull { max_keys: 1 }));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum KeyedError {
    /// The cost can never be admitted (zero, or above the capacity); see [`CostError`].
    Cost(CostError),
    /// The map is at its maximum number of keys, none of them can be evicted yet, and the
    /// request was for a new key. Transient: keys go idle and are evicted.
    KeyspaceFull {
        /// The configured maximum number of keys.
        max_keys: usize,
    },
}

impl From<CostError> for KeyedError {
    fn from(e: CostError) -> KeyedError {
        KeyedError::Cost(e)
    }
}

impl fmt::Display for KeyedError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyedError::Cost(e) => e.fmt(f),
            KeyedError::KeyspaceFull { max_keys } => write!(
                f,
                "all {max_keys} keys are in use and none is idle yet: new keys are refused"
            ),
        }
    }
}

impl std::error::Error for KeyedError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            KeyedError::Cost(e) => Some(e),
            KeyedError::KeyspaceFull { .. } => None,
        }
    }
}
