//! `GateError`: a decision a gate could not make.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::error::CostError;
use crate::limit::KeyedError;

/// Why a gate returned no [`Decision`](crate::Decision).
///
/// A rejection is not an error: it is a `Decision` with `allowed == false` and a
/// `retry_after`. An error means the request is malformed, could never pass, or the backend
/// could not decide it (and the gate's failure policy is to report that).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum GateError {
    /// The cost could never pass: zero, or above the limit's capacity (see [`CostError`]).
    Cost(CostError),
    /// The key is empty or too long.
    InvalidKey(&'static str),
    /// Redis holds a value under this key that the gate cannot decide on: a value of another
    /// type (`WRONGTYPE`: the key is shared with a gate of another algorithm, or, on a gate
    /// whose own limit is not a token bucket, by its `check` and its `check_all`, which
    /// keeps token buckets), or one that is not a state the gate's script can read (written
    /// by something else, or corrupt). Only the requests on this key fail; the gate stays
    /// healthy.
    UnreadableKey(&'static str),
    /// [`check_all`](crate::gate::RedisGate::check_all) was given no limits.
    NoLimits,
    /// [`check_all`](crate::gate::RedisGate::check_all) was given more limits than it
    /// decides in one call.
    TooManyLimits {
        /// How many were given.
        given: usize,
        /// The most one call takes.
        max: usize,
    },
    /// [`check_all`](crate::gate::RedisGate::check_all) listed one key with two
    /// different quotas: one bucket cannot be measured in two units.
    ConflictingQuotas {
        /// The key listed twice.
        key: String,
    },
    /// A quota given with the request cannot be enforced by this gate (on Redis: a period
    /// that is not whole microseconds, or numbers too large to compute exactly).
    InvalidQuota(crate::ConfigError),
    /// On Redis Cluster, the keys of one all-or-nothing call do not share a hash slot; give
    /// them the same `{hash tag}`.
    CrossSlot,
    /// The in-memory gate has no room for a new key: the shard the key falls in (a 16th of
    /// `max_keys`) holds as many keys as it may, or, for `check_all`, buckets of 16
    /// distinct quotas already, and nothing in it is idle yet. The shard can be full
    /// before the whole gate is (see [`MemoryGateBuilder::max_keys`](crate::gate::MemoryGateBuilder::max_keys)).
    KeyspaceFull {
        /// The gate's maximum number of keys, every shard together.
        max_keys: usize,
    },
    /// The backend (Redis) failed: connection, protocol or script error.
    Backend(Arc<dyn std::error::Error + Send + Sync>),
    /// The backend did not answer within this long: the gate's timeout (a region's
    /// refresher gives its calls to the local Redis at least 500 ms).
    Timeout(Duration),
    /// The backend failed recently and was not asked: the gate answers from its failure
    /// policy alone until it probes the backend again, `next_probe_in` from now (a
    /// [`RedisGate`](crate::gate::RedisGate)'s probe interval after the failure). What the
    /// failure was, the call that met it was told ([`Backend`](GateError::Backend) or
    /// [`Timeout`](GateError::Timeout)); [`retry_after`](GateError::retry_after) reads the
    /// wait.
    Degraded {
        /// How long until the gate asks the backend again.
        next_probe_in: Duration,
    },
}

impl GateError {
    /// Whether retrying later can help — a backend failure or timeout, or a full in-memory
    /// keyspace (keys go idle and are evicted) — as opposed to a request that can never
    /// pass.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            GateError::Backend(_)
                | GateError::Timeout(_)
                | GateError::Degraded { .. }
                | GateError::KeyspaceFull { .. }
        )
    }

    /// How long the same call is sure to fail, when the error says: the time until a
    /// [`Degraded`](GateError::Degraded) gate asks its backend again (an HTTP layer's
    /// `Retry-After`). `None` for every other error.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            GateError::Degraded { next_probe_in } => Some(*next_probe_in),
            _ => None,
        }
    }

    #[cfg(feature = "redis")]
    pub(crate) fn backend(e: impl std::error::Error + Send + Sync + 'static) -> GateError {
        GateError::Backend(Arc::new(e))
    }
}

impl fmt::Display for GateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GateError::Cost(e) => e.fmt(f),
            GateError::InvalidKey(why) => write!(f, "invalid key: {why}"),
            GateError::UnreadableKey(why) => write!(f, "redis cannot decide this key: {why}"),
            GateError::NoLimits => f.write_str("no limits given: check_all needs at least one"),
            GateError::TooManyLimits { given, max } => {
                write!(f, "{given} limits given where one call takes at most {max}")
            }
            GateError::ConflictingQuotas { key } => write!(
                f,
                "key {key:?} is listed with two different quotas: one bucket has one quota"
            ),
            GateError::InvalidQuota(e) => write!(f, "the quota cannot be enforced: {e}"),
            GateError::CrossSlot => f.write_str(
                "on redis cluster the keys of one all-or-nothing call must share a hash slot: \
                 give them the same {hash tag}",
            ),
            GateError::KeyspaceFull { max_keys } => write!(
                f,
                "no room for a new key: its shard of the gate (a 16th of its {max_keys} keys; \
                 for check_all, at most 16 distinct quotas) is full, and nothing in it is idle \
                 yet"
            ),
            GateError::Backend(e) => write!(f, "rate limit backend failed: {e}"),
            GateError::Timeout(d) => write!(f, "rate limit backend did not answer within {d:?}"),
            GateError::Degraded { next_probe_in } => write!(
                f,
                "rate limit backend failed recently; the next probe is in {next_probe_in:?}"
            ),
        }
    }
}

impl std::error::Error for GateError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            GateError::Backend(e) => Some(&**e),
            GateError::InvalidQuota(e) => Some(e),
            GateError::Cost(e) => Some(e),
            _ => None,
        }
    }
}

impl From<CostError> for GateError {
    fn from(e: CostError) -> GateError {
        GateError::Cost(e)
    }
}

impl From<KeyedError> for GateError {
    fn from(e: KeyedError) -> GateError {
        match e {
            KeyedError::Cost(e) => GateError::Cost(e),
            KeyedError::KeyspaceFull { max_keys } => GateError::KeyspaceFull { max_keys },
        }
    }
}

/// The longest key a gate accepts, in bytes.
pub(crate) const MAX_KEY_LEN: usize = 512;

pub(crate) fn check_key(key: &str) -> Result<(), GateError> {
    if key.is_empty() {
        Err(GateError::InvalidKey("empty"))
    } else if key.len() > MAX_KEY_LEN {
        Err(GateError::InvalidKey("longer than 512 bytes"))
    } else {
        Ok(())
    }
}

/// A backend failure described in words (an unexpected reply, a pending probe).
#[cfg(feature = "redis")]
#[derive(Debug)]
pub(crate) struct BackendMessage(pub(crate) String);

#[cfg(feature = "redis")]
impl fmt::Display for BackendMessage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(feature = "redis")]
impl std::error::Error for BackendMessage {}
