//! `MemoryGate`: the embedded, in-process gate.

use std::collections::hash_map::RandomState;
use std::fmt;
use std::hash::BuildHasher;
use std::sync::PoisonError;
use std::time::Duration;

use tokio::time::Instant;

use crate::decision::Decision;
use crate::error::ConfigError;
use crate::gate::api::{Gate, GateFuture};
use crate::gate::error::{GateError, check_key};
use crate::gate::limit::Limit;
use crate::gate::multi::{MAX_QUOTAS, MemoryBuckets, Merged};
use crate::limit::{FixedWindow, Keyed, SlidingLog, SlidingWindow, TokenBucket};
use crate::rate::Quota;
use crate::sync::{Arc, Mutex};

const SHARDS: usize = 16;

enum Shard {
    TokenBucket(Keyed<String, TokenBucket>),
    FixedWindow(Keyed<String, FixedWindow>),
    SlidingLog(Keyed<String, SlidingLog>),
    SlidingWindow(Keyed<String, SlidingWindow>),
}

impl Shard {
    fn new(limit: Limit, max_keys: usize) -> Result<Shard, ConfigError> {
        Ok(match limit {
            Limit::TokenBucket(q) => Shard::TokenBucket(Keyed::new(TokenBucket::new(q), max_keys)?),
            Limit::FixedWindow(r) => Shard::FixedWindow(Keyed::new(FixedWindow::new(r), max_keys)?),
            Limit::SlidingLog(r) => Shard::SlidingLog(Keyed::new(SlidingLog::new(r), max_keys)?),
            Limit::SlidingWindow(r) => {
                Shard::SlidingWindow(Keyed::new(SlidingWindow::new(r), max_keys)?)
            }
        })
    }

    fn check(&mut self, key: &str, now: Duration, cost: u32) -> Result<Decision, GateError> {
        Ok(match self {
            Shard::TokenBucket(k) => k.check(key, now, cost)?,
            Shard::FixedWindow(k) => k.check(key, now, cost)?,
            Shard::SlidingLog(k) => k.check(key, now, cost)?,
            Shard::SlidingWindow(k) => k.check(key, now, cost)?,
        })
    }

    fn len(&self) -> usize {
        match self {
            Shard::TokenBucket(k) => k.len(),
            Shard::FixedWindow(k) => k.len(),
            Shard::SlidingLog(k) => k.len(),
            Shard::SlidingWindow(k) => k.len(),
        }
    }

    fn sweep(&mut self, now: Duration) -> usize {
        match self {
            Shard::TokenBucket(k) => k.sweep(now),
            Shard::FixedWindow(k) => k.sweep(now),
            Shard::SlidingLog(k) => k.sweep(now),
            Shard::SlidingWindow(k) => k.sweep(now),
        }
    }
}

struct Inner {
    limit: Limit,
    shards: Box<[Mutex<Shard>]>,
    hasher: RandomState,
    epoch: Instant,
    max_keys: usize,
    /// The buckets of [`MemoryGate::acquire_all`].
    multi: Mutex<MemoryBuckets>,
}

/// The embedded gate: per-key limits in this process, in bounded memory.
///
/// Built on [`Keyed`](crate::limit::Keyed), sharded 16 ways to keep contention low; keys
/// whose state is back to neutral are evicted when room is needed (see `Keyed` for the
/// full-map policy). It gives the same decisions as [`RedisGate`](crate::gate::RedisGate)
/// for one process — and only for one process: run several instances and each allows the
/// full limit. Clone it to share.
///
/// # Examples
///
/// ```
/// use flowgate::gate::{Limit, MemoryGate};
/// use flowgate::Quota;
///
/// let gate = MemoryGate::new(Limit::TokenBucket(Quota::per_second(2)?))?;
/// assert!(gate.check("user-1", 2)?.allowed);
/// assert!(!gate.check("user-1", 1)?.allowed);
/// assert!(gate.check("user-2", 1)?.allowed);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct MemoryGate {
    inner: Arc<Inner>,
}

impl MemoryGate {
    /// A gate enforcing `limit` per key, holding at most 100 000 keys.
    ///
    /// # Errors
    ///
    /// Never in practice; returns `Result` like [`MemoryGate::with_max_keys`].
    pub fn new(limit: Limit) -> Result<MemoryGate, ConfigError> {
        MemoryGate::with_max_keys(limit, 100_000)
    }

    /// A gate enforcing `limit` per key, holding at most about `max_keys` keys (rounded up to
    /// a multiple of 16). The keys are spread over 16 shards by hash, each holding a 16th:
    /// new keys may be refused with [`GateError::KeyspaceFull`] while one shard is full
    /// before the whole gate is (with a thousand keys, at about three quarters), so leave
    /// some headroom.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] on `keyed.max_keys` if it is zero.
    pub fn with_max_keys(limit: Limit, max_keys: usize) -> Result<MemoryGate, ConfigError> {
        if max_keys == 0 {
            return Err(ConfigError::zero("keyed.max_keys"));
        }
        let per_shard = max_keys.div_ceil(SHARDS);
        let shards = (0..SHARDS)
            .map(|_| Shard::new(limit, per_shard).map(Mutex::new))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(MemoryGate {
            inner: Arc::new(Inner {
                limit,
                shards: shards.into_boxed_slice(),
                hasher: RandomState::new(),
                epoch: Instant::now(),
                max_keys: per_shard * SHARDS,
                multi: Mutex::new(MemoryBuckets::default()),
            }),
        })
    }

    fn now(&self) -> Duration {
        self.inner.epoch.elapsed()
    }

    fn shard(&self, key: &str) -> &Mutex<Shard> {
        let h = self.inner.hasher.hash_one(key) as usize;
        &self.inner.shards[h % SHARDS]
    }

    /// Decide one request now, synchronously.
    ///
    /// # Errors
    ///
    /// [`GateError::InsufficientCapacity`], [`GateError::ZeroCost`],
    /// [`GateError::InvalidKey`], [`GateError::KeyspaceFull`].
    pub fn check(&self, key: &str, cost: u32) -> Result<Decision, GateError> {
        check_key(key)?;
        let now = self.now();
        let decided = self
            .shard(key)
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .check(key, now, cost);
        // A shard reports its own share of the keyspace: report the gate's.
        decided.map_err(|e| match e {
            GateError::KeyspaceFull { .. } => GateError::KeyspaceFull {
                max_keys: self.inner.max_keys,
            },
            e => e,
        })
    }

    /// All-or-nothing across several token buckets, in this process: admitted only if every
    /// `(key, quota)` bucket has room for `cost`, and then charged on all of them; otherwise
    /// nothing is charged anywhere (layered throttling: IP + user + tenant). The same
    /// semantics as [`RedisGate::acquire_all`](crate::gate::RedisGate::acquire_all), which
    /// falls back to this under [`FailurePolicy::Fallback`](crate::gate::FailurePolicy).
    ///
    /// Returns one decision per limit, in order; `allowed` is the same in all of them, and
    /// the limits that blocked have a non-zero `retry_after`. A key listed `n` times is one
    /// bucket charged `n × cost`. These buckets are apart from the gate's own limit (a key
    /// here and in [`check`](MemoryGate::check) are two buckets); they hold at most
    /// [`max_keys`](MemoryGate::max_keys) keys over at most 16 distinct quotas, idle ones
    /// evicted when room is needed.
    ///
    /// # Errors
    ///
    /// [`GateError::NoLimits`], [`GateError::TooManyLimits`] (more than 32),
    /// [`GateError::ZeroCost`], [`GateError::InvalidKey`], [`GateError::ConflictingQuotas`]
    /// (one key with two quotas), [`GateError::InsufficientCapacity`] (a key's total cost
    /// above its burst), [`GateError::KeyspaceFull`]; nothing is charged on an error.
    ///
    /// # Examples
    ///
    /// ```
    /// use flowgate::gate::{Limit, MemoryGate};
    /// use flowgate::Quota;
    ///
    /// let gate = MemoryGate::new(Limit::TokenBucket(Quota::per_second(10)?))?;
    /// let ip = Quota::per_second(2)?;
    /// let user = Quota::per_second(1)?;
    /// let limits = [("ip:10.0.0.1", ip), ("user:7", user)];
    /// assert!(gate.acquire_all(&limits, 1)?[0].allowed);
    /// // The user's bucket is empty: nothing is charged, not even the IP's.
    /// let d = gate.acquire_all(&limits, 1)?;
    /// assert!(!d[0].allowed && !d[1].allowed);
    /// assert_eq!(d[0].remaining, 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn acquire_all(
        &self,
        limits: &[(&str, Quota)],
        cost: u32,
    ) -> Result<Vec<Decision>, GateError> {
        let request = Merged::new(limits, cost)?;
        self.acquire_merged(&request)
    }

    pub(crate) fn acquire_merged(&self, request: &Merged<'_>) -> Result<Vec<Decision>, GateError> {
        let now = self.now();
        self.inner
            .multi
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .acquire_all(request, now, self.inner.max_keys.div_ceil(MAX_QUOTAS))
    }

    /// Keys held now.
    pub fn len(&self) -> usize {
        self.inner
            .shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(PoisonError::into_inner).len())
            .sum()
    }

    /// Whether no key is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Evict every key whose state is back to neutral; returns how many.
    pub fn sweep(&self) -> usize {
        let now = self.now();
        self.inner
            .shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(PoisonError::into_inner).sweep(now))
            .sum()
    }

    /// The most keys held.
    pub fn max_keys(&self) -> usize {
        self.inner.max_keys
    }

    /// The limit enforced per key.
    pub fn limit(&self) -> Limit {
        self.inner.limit
    }
}

impl Gate for MemoryGate {
    fn acquire<'a>(&'a self, key: &'a str, cost: u32) -> GateFuture<'a> {
        Box::pin(std::future::ready(self.check(key, cost)))
    }

    fn limit(&self) -> Limit {
        self.inner.limit
    }
}

impl fmt::Debug for MemoryGate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryGate")
            .field("limit", &self.inner.limit)
            .field("max_keys", &self.inner.max_keys)
            .finish_non_exhaustive()
    }
}
