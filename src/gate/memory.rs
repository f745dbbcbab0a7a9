//! `MemoryGate`: the embedded, in-process gate.

use std::fmt;
use std::hash::BuildHasher;
use std::sync::PoisonError;
use std::time::Duration;

use foldhash::fast::RandomState;

use crate::clock::Clock;
use crate::decision::Decision;
use crate::error::{ConfigError, ConfigErrorKind};
use crate::gate::api::{Gate, GateFuture, HeldDecision};
use crate::gate::error::{GateError, check_key};
use crate::gate::limit::Limit;
use crate::gate::multi::{MAX_QUOTAS, Merged, ShardedBuckets};
use crate::gate::quotas::{QuotaRegistry, Registration};
use crate::limit::{FixedWindow, Keyed, KeyedError, SlidingLog, SlidingWindow, TokenBucket};
use crate::metrics::{Counter, Labels};
use crate::rate::Quota;
use crate::sync::{Arc, Mutex, Panics};

const SHARDS: usize = 16;

/// The most keys a gate holds unless told otherwise.
const DEFAULT_MAX_KEYS: usize = 100_000;

/// Names of the metrics every gate records (a [`RedisGate`](crate::gate::RedisGate) records
/// more).
pub(crate) mod names {
    pub(crate) const DECISIONS: &str = "flowgate_gate_decisions_total";
}

/// The keys of one shard, hashed by the gate's one hasher (so the gate hashes a key once,
/// for its shard and its slot).
enum Shard {
    TokenBucket(Keyed<String, TokenBucket, RandomState>),
    FixedWindow(Keyed<String, FixedWindow, RandomState>),
    SlidingLog(Keyed<String, SlidingLog, RandomState>),
    SlidingWindow(Keyed<String, SlidingWindow, RandomState>),
}

impl Shard {
    fn new(limit: Limit, max_keys: usize, hasher: &RandomState) -> Result<Shard, ConfigError> {
        let h = hasher.clone();
        Ok(match limit {
            Limit::TokenBucket(q) => {
                Shard::TokenBucket(Keyed::with_hasher(TokenBucket::new(q), max_keys, h)?)
            }
            Limit::FixedWindow(r) => {
                Shard::FixedWindow(Keyed::with_hasher(FixedWindow::new(r), max_keys, h)?)
            }
            Limit::SlidingLog(r) => {
                Shard::SlidingLog(Keyed::with_hasher(SlidingLog::new(r), max_keys, h)?)
            }
            Limit::SlidingWindow(r) => {
                Shard::SlidingWindow(Keyed::with_hasher(SlidingWindow::new(r), max_keys, h)?)
            }
        })
    }

    /// Decide for `key`, whose hash (by the hasher this shard was made with) is `hash`.
    #[inline]
    fn check(
        &mut self,
        hash: u64,
        key: &str,
        now: Duration,
        cost: u32,
    ) -> Result<Decision, KeyedError> {
        // The small error type all the way to the gate: converting here put the decision
        // through a store-forwarding stall on every call.
        match self {
            Shard::TokenBucket(k) => k.check_hashed(hash, key, now, cost),
            Shard::FixedWindow(k) => k.check_hashed(hash, key, now, cost),
            Shard::SlidingLog(k) => k.check_hashed(hash, key, now, cost),
            Shard::SlidingWindow(k) => k.check_hashed(hash, key, now, cost),
        }
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
    /// One fast, randomly seeded hasher (foldhash) for the shard and the slot of a key.
    hasher: RandomState,
    clock: Clock,
    max_keys: usize,
    /// The buckets of [`MemoryGate::check_all`].
    multi: ShardedBuckets,
    /// The quotas the layers built over the gate use ([`Gate::register_quotas`]).
    quotas: QuotaRegistry,
    name: Option<String>,
    allowed: Counter,
    rejected: Counter,
    /// Requests refused because the keyspace is full.
    keyspace_full: Counter,
}

impl Inner {
    /// The counter of a decision.
    #[inline]
    fn outcome(&self, allowed: bool) -> &Counter {
        if allowed {
            &self.allowed
        } else {
            &self.rejected
        }
    }

    /// Count a decision in the metrics.
    fn count(&self, allowed: bool) {
        self.outcome(allowed).increment(1);
    }

    /// Count `result`'s refusal for a full keyspace, if it is one, and pass it on.
    fn counted<T>(&self, result: Result<T, GateError>) -> Result<T, GateError> {
        if let Err(GateError::KeyspaceFull { .. }) = result {
            self.keyspace_full.increment(1);
        }
        result
    }
}

/// The embedded gate: per-key limits in this process, in bounded memory.
///
/// Built on [`Keyed`], sharded 16 ways to keep contention low; keys
/// whose state is back to neutral are evicted when room is needed (see `Keyed` for the
/// full-map policy). It gives the same decisions as [`RedisGate`](crate::gate::RedisGate)
/// for one process — and only for one process: run several instances and each allows the
/// full limit. Clone it to share. One difference in phase: a fixed or sliding window
/// starts at a multiple of its length since the gate was built (its clock's start), where
/// Redis's start at multiples since the Unix epoch, so the two put their window boundaries
/// at different instants.
///
/// It decides without I/O: [`check`](MemoryGate::check) is synchronous, and as a [`Gate`]
/// it answers in [`Gate::check_local`], so the stream adapters pass items through it
/// without allocating.
///
/// # Metrics
///
/// Labelled by `name`: `flowgate_gate_decisions_total` by `outcome` (`allowed`,
/// `rejected`, and `keyspace_full`: requests refused with [`GateError::KeyspaceFull`]
/// because every key the gate can hold is busy, a flood of distinct keys, say).
///
/// A request refused for what it asks ([`GateError::Cost`], [`GateError::InvalidKey`], and
/// the malformed lists of [`check_all`](MemoryGate::check_all)) is not a decision and is not
/// counted here: nothing was charged, and its caller has the error (a
/// [`Gated`](crate::gate::Gated) stream counts its item in
/// `flowgate_gated_dropped_total{reason="gate_error"}`, the HTTP rate-limit layer counts the
/// request as `bad_request`). The three gates count alike.
///
/// A decision is counted once made, after the shard's lock: a metrics recorder that panics
/// there panics the call, and what it admitted stays charged. A [`Gated`](crate::gate::Gated)
/// stream over the gate acts on the decision first: an item so admitted passes on its next
/// poll, without being asked (and charged) again.
///
/// # Examples
///
/// ```
/// use flowgate::gate::{Limit, MemoryGate};
/// use flowgate::Quota;
///
/// let gate = MemoryGate::new(Limit::TokenBucket(Quota::per_second(2)?));
/// assert!(gate.check("user-1", 2)?.allowed);
/// assert!(!gate.check("user-1", 1)?.allowed);
/// assert!(gate.check("user-2", 1)?.allowed);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct MemoryGate {
    inner: Arc<Inner>,
}

/// Builds a [`MemoryGate`]; from [`MemoryGate::builder`].
///
/// # Examples
///
/// ```
/// use flowgate::gate::{Limit, MemoryGate};
/// use flowgate::Quota;
///
/// let gate = MemoryGate::builder(Limit::TokenBucket(Quota::per_second(100)?))
///     .max_keys(10_000)
///     .name("api")
///     .build()?;
/// assert_eq!(gate.name(), Some("api"));
/// assert_eq!(gate.max_keys(), 10_000);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until it is built"]
pub struct MemoryGateBuilder {
    limit: Limit,
    max_keys: usize,
    name: Option<String>,
    clock: Option<Clock>,
}

impl MemoryGateBuilder {
    /// Hold at most `max_keys` keys (default 100 000), rounded up to a multiple of 16
    /// ([`MemoryGate::max_keys`] reports the rounded figure). The keys are spread over 16
    /// shards by hash, each holding at most a 16th under its own lock, so the bound is exact
    /// however many threads insert at once; but a new key is refused with
    /// [`GateError::KeyspaceFull`] when its shard is full, before the whole gate is: as
    /// distinct busy keys arrive, the first is refused at about half the gate with a hundred
    /// keys (a third to three quarters, run to run: the hash is seeded at random), four
    /// fifths with a thousand (before two thirds about one time in a hundred), and nine
    /// tenths with ten thousand.
    /// So leave some headroom. The buckets of
    /// [`check_all`](MemoryGate::check_all) have as much room again, apart.
    ///
    /// A key's state is a few words for every limit but `Limit::SlidingLog`, which keeps
    /// the instant of each admission still in its window: up to the rate's `count` of them
    /// a key, 16 bytes each (in a vector that grows by doubling, so up to twice that, and
    /// never below 4 of them). Each key held also keeps a copy of itself (at most 512
    /// bytes: a longer key is refused with [`GateError::InvalidKey`]), so size `max_keys`
    /// by your keys too: 100 000 keys of 64 bytes are 6.4 MB of keys, and as much again
    /// in the buckets of `check_all` when they are full. [`sweep`](MemoryGate::sweep) frees
    /// the keys it evicts; each shard's table keeps the room it grew to (at most its share
    /// of `max_keys`).
    pub fn max_keys(mut self, max_keys: usize) -> Self {
        self.max_keys = max_keys;
        self
    }

    /// The `name` label of this gate's metrics.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Where the gate reads the time: by default [`Clock::new`], made when the gate is built
    /// (tokio's clock inside a current-thread runtime, so paused time works in
    /// `#[tokio::test]`; the CPU's time-stamp counter everywhere else, which costs less than
    /// half of the OS clock). Set [`Clock::tokio`] for a gate built outside the paused
    /// runtime its tests run in.
    pub fn clock(mut self, clock: Clock) -> Self {
        self.clock = Some(clock);
        self
    }

    /// Build the gate.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] on `keyed.max_keys` if it is zero, or too large to round up to a
    /// multiple of 16 (within 15 of `usize::MAX`).
    pub fn build(self) -> Result<MemoryGate, ConfigError> {
        if self.max_keys == 0 {
            return Err(ConfigError::zero("keyed.max_keys"));
        }
        let per_shard = self.max_keys.div_ceil(SHARDS);
        let Some(max_keys) = per_shard.checked_mul(SHARDS) else {
            return Err(ConfigError::new(
                "keyed.max_keys",
                ConfigErrorKind::TooLarge,
                format!("{} cannot be rounded up to {SHARDS} shards", self.max_keys),
            ));
        };
        let hasher = RandomState::default();
        let shards = (0..SHARDS)
            .map(|_| Shard::new(self.limit, per_shard, &hasher).map(Mutex::new))
            .collect::<Result<Vec<_>, _>>()?;
        let labels = Labels::new(self.name.as_deref());
        let decisions = |outcome| labels.counter(names::DECISIONS, &[("outcome", outcome)]);
        Ok(MemoryGate {
            inner: Arc::new(Inner {
                limit: self.limit,
                shards: shards.into_boxed_slice(),
                multi: ShardedBuckets::new(SHARDS, per_shard, hasher.clone()),
                quotas: QuotaRegistry::default(),
                hasher,
                clock: self.clock.unwrap_or_default(),
                max_keys,
                allowed: decisions("allowed"),
                rejected: decisions("rejected"),
                keyspace_full: decisions("keyspace_full"),
                name: self.name,
            }),
        })
    }
}

impl MemoryGate {
    /// A gate enforcing `limit` per key, holding at most 100 000 keys, unnamed. To set the
    /// number of keys or a name, use [`MemoryGate::builder`].
    pub fn new(limit: Limit) -> MemoryGate {
        MemoryGate::builder(limit)
            .build()
            .expect("the default configuration is valid")
    }

    /// A builder for a gate enforcing `limit` per key.
    pub fn builder(limit: Limit) -> MemoryGateBuilder {
        MemoryGateBuilder {
            limit,
            max_keys: DEFAULT_MAX_KEYS,
            name: None,
            clock: None,
        }
    }

    fn now(&self) -> Duration {
        self.inner.clock.now()
    }

    /// Decide one request now, synchronously: admitted (and consumed) or rejected with a
    /// `retry_after`.
    ///
    /// # Errors
    ///
    /// [`GateError::Cost`] (a cost of zero or above the capacity), [`GateError::InvalidKey`],
    /// [`GateError::KeyspaceFull`].
    pub fn check(&self, key: &str, cost: u32) -> Result<Decision, GateError> {
        self.decide(key, cost, |counter| counter.increment(1)).0
    }

    /// [`check`](MemoryGate::check), with the panic of a metrics recorder that panics as the
    /// decision is counted caught and handed back beside it ([`Gate::check_local_held`]).
    fn check_held(&self, key: &str, cost: u32) -> HeldDecision {
        self.decide(key, cost, |counter| {
            let mut panics = Panics::new();
            panics.run(|| counter.increment(1));
            panics
        })
    }

    /// Decide one request now, and `count` it in its counter once decided (after the
    /// shard's lock); `count`'s answer beside the decision (its default when nothing was
    /// decided).
    #[inline(always)]
    fn decide<R: Default>(
        &self,
        key: &str,
        cost: u32,
        count: impl FnOnce(&Counter) -> R,
    ) -> (Result<Decision, GateError>, R) {
        if let Err(e) = check_key(key) {
            return (Err(e), R::default());
        }
        let hash = self.inner.hasher.hash_one(key);
        let now = self.now();
        let decided = self.inner.shards[shard_of(hash)]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .check(hash, key, now, cost);
        match decided {
            Ok(d) => (Ok(d), count(self.inner.outcome(d.allowed))),
            // A shard reports its own share of the keyspace: report the gate's.
            Err(KeyedError::KeyspaceFull { .. }) => {
                let counted = count(&self.inner.keyspace_full);
                let full = GateError::KeyspaceFull {
                    max_keys: self.inner.max_keys,
                };
                (Err(full), counted)
            }
            Err(KeyedError::Cost(e)) => (Err(GateError::Cost(e)), R::default()),
        }
    }

    /// All-or-nothing across several token buckets, in this process: admitted only if every
    /// `(key, quota)` bucket has room for `cost`, and then charged on all of them; otherwise
    /// nothing is charged anywhere (layered throttling: IP + user + tenant). The same
    /// semantics as [`RedisGate::check_all`](crate::gate::RedisGate::check_all), which
    /// falls back to this under [`FailurePolicy::Fallback`](crate::gate::FailurePolicy).
    ///
    /// Returns one decision per limit, in order; `allowed` is the same in all of them, and
    /// the limits that blocked have a non-zero `retry_after` (those that had room have none:
    /// the request's wait is the longest of them all). A key listed `n` times is one
    /// bucket charged `n × cost`. A bucket is a key with its quota: the same key given
    /// later with another quota (a limit changed at runtime) is another bucket, which
    /// starts full (a fresh burst), while the old one keeps what was charged on it until
    /// it is full again and evicted (a `RedisGate` keeps one bucket per key, and decides
    /// what it holds under the new quota). These buckets are apart from the gate's own limit (a key
    /// here and in [`check`](MemoryGate::check) are two buckets); they hold at most
    /// [`max_keys`](MemoryGate::max_keys) keys over every quota together (one quota may use
    /// them all), spread over 16 shards by hash as the gate's own keys are, with at most 16
    /// distinct quotas per shard; idle ones are evicted when room is needed. A request
    /// locks only the shards of its keys.
    ///
    /// The [`RateLimitLayer`](crate::http::RateLimitLayer)s built over this gate (and its
    /// clones) register their quotas on it while they live, and one that would take them
    /// past 16 distinct quotas together is refused when built. When the last layer using a
    /// quota is dropped, that quota's buckets are evicted, busy or not, at the next sweep of
    /// each shard (when it needs room for a quota, or for a key and none of the keys its
    /// last sweep noted going neutral soonest is idle yet), so they keep no key of the
    /// layers built after it out; a layer built with the quota before then keeps them (a layer
    /// rebuilt with the same quotas gives no client a fresh burst). A call here registers
    /// nothing: quotas of your own beside the layers' must keep within those 16 too, or a
    /// request whose new quota finds no room in its shard (none of the quotas held there
    /// is back to full or released) is refused with [`GateError::KeyspaceFull`], the
    /// layers' requests as well as yours; a quota of your own equal to a released layer's
    /// shares its buckets, and is evicted with them.
    ///
    /// # Errors
    ///
    /// [`GateError::NoLimits`], [`GateError::TooManyLimits`] (more than 32),
    /// [`GateError::Cost`] (a cost of zero, or a key's total cost above its burst),
    /// [`GateError::InvalidKey`], [`GateError::ConflictingQuotas`] (one key with two
    /// quotas), [`GateError::KeyspaceFull`]; nothing is charged on an error.
    ///
    /// # Examples
    ///
    /// ```
    /// use flowgate::gate::{Limit, MemoryGate};
    /// use flowgate::Quota;
    ///
    /// let gate = MemoryGate::new(Limit::TokenBucket(Quota::per_second(10)?));
    /// let ip = Quota::per_second(2)?;
    /// let user = Quota::per_second(1)?;
    /// let limits = [("ip:10.0.0.1", ip), ("user:7", user)];
    /// assert!(gate.check_all(&limits, 1)?[0].allowed);
    /// // The user's bucket is empty: nothing is charged, not even the IP's.
    /// let d = gate.check_all(&limits, 1)?;
    /// assert!(!d[0].allowed && !d[1].allowed);
    /// assert_eq!(d[0].remaining, 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn check_all(
        &self,
        limits: &[(&str, Quota)],
        cost: u32,
    ) -> Result<Vec<Decision>, GateError> {
        let mut decided = Vec::with_capacity(limits.len());
        self.check_all_into(limits, cost, &mut decided)?;
        Ok(decided)
    }

    /// [`check_all`](MemoryGate::check_all) into `decisions` (cleared first): no allocation
    /// once `decisions` has room for the limits, on at most 4 limits (more, even on fewer
    /// distinct keys, are merged on the heap), but for a key new to the buckets, copied into
    /// its map.
    fn check_all_into(
        &self,
        limits: &[(&str, Quota)],
        cost: u32,
        decisions: &mut Vec<Decision>,
    ) -> Result<(), GateError> {
        decisions.clear();
        if let [(key, quota)] = *limits {
            // One limit: nothing to merge (validated as `Merged::new` would). Building the
            // merged request and expanding its decision cost ~25 ns of a ~60 ns decision.
            let bucket = Merged::one(key, quota, cost)?;
            let now = self.now();
            let decided = self.inner.counted(self.inner.multi.check_one(
                bucket,
                shard_of,
                now,
                self.inner.max_keys,
            ))?;
            self.inner.count(decided.allowed);
            decisions.push(decided);
            return Ok(());
        }
        let request = Merged::new(limits, cost)?;
        self.decide_into(&request, decisions)
    }

    #[cfg(feature = "redis")]
    pub(crate) fn check_merged(&self, request: &Merged<'_>) -> Result<Vec<Decision>, GateError> {
        let mut decided = Vec::with_capacity(request.buckets.len());
        self.decide_into(request, &mut decided)?;
        Ok(decided)
    }

    /// `request` decided on the all-or-nothing buckets at the gate's time, into
    /// `decisions`; counted.
    fn decide_into(
        &self,
        request: &Merged<'_>,
        decisions: &mut Vec<Decision>,
    ) -> Result<(), GateError> {
        let now = self.now();
        let decided =
            self.inner
                .multi
                .check_all_into(request, shard_of, now, self.inner.max_keys, decisions);
        if let Err(e) = self.inner.counted(decided) {
            decisions.clear();
            return Err(e);
        }
        self.inner.count(decisions[0].allowed);
        Ok(())
    }

    /// End a registration of `quotas` (distinct, registered): the buckets of those no
    /// registration holds any more are evicted at the next sweep of each shard.
    pub(crate) fn release_quotas(&self, quotas: &[Quota]) {
        let multi = &self.inner.multi;
        self.inner
            .quotas
            .release(quotas, |q| multi.set_released(q, true));
    }

    /// Keys held now for the gate's own limit ([`check`](MemoryGate::check)); the buckets
    /// of [`check_all`](MemoryGate::check_all) are not counted.
    pub fn len(&self) -> usize {
        self.inner
            .shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(PoisonError::into_inner).len())
            .sum()
    }

    /// Whether no key is held for the gate's own limit (as [`len`](MemoryGate::len) counts:
    /// the buckets of [`check_all`](MemoryGate::check_all) are not counted).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Evict every key of the gate's own limit whose state is back to neutral; returns how
    /// many. The buckets of [`check_all`](MemoryGate::check_all) are swept by their shard
    /// when it needs room.
    pub fn sweep(&self) -> usize {
        let now = self.now();
        self.inner
            .shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(PoisonError::into_inner).sweep(now))
            .sum()
    }

    /// The most keys held: the figure given to the builder, rounded up to a multiple of 16
    /// (16 shards of equal size). The buckets of [`check_all`](MemoryGate::check_all) have
    /// as many again, apart.
    pub fn max_keys(&self) -> usize {
        self.inner.max_keys
    }

    /// The limit enforced per key.
    pub fn limit(&self) -> Limit {
        self.inner.limit
    }

    /// The `name` label of this gate's metrics, if it was given one.
    pub fn name(&self) -> Option<&str> {
        self.inner.name.as_deref()
    }
}

/// The shard of a key with hash `hash`: bits 40..44, which the shard's table uses neither
/// for a slot (the low bits) nor for its tag (the top 7), so sharding costs the table none
/// of its spread.
#[inline]
fn shard_of(hash: u64) -> usize {
    (hash >> 40) as usize % SHARDS
}

impl Gate for MemoryGate {
    /// [`MemoryGate::check`], as a future that is ready at once: decided (and the cost
    /// consumed if admitted) when this is called, not when the future is first polled, so a
    /// future dropped unpolled has still decided (as the trait allows).
    fn check<'a>(&'a self, key: &'a str, cost: u32) -> GateFuture<'a> {
        Box::pin(std::future::ready(MemoryGate::check(self, key, cost)))
    }

    /// Always `Some`: [`MemoryGate::check`].
    fn check_local(&self, key: &str, cost: u32) -> Option<Result<Decision, GateError>> {
        Some(MemoryGate::check(self, key, cost))
    }

    /// Always `Some`: [`MemoryGate::check`], with the panic of a metrics recorder that
    /// panics as it counts the decision held beside it.
    fn check_local_held(&self, key: &str, cost: u32) -> Option<HeldDecision> {
        Some(self.check_held(key, cost))
    }

    /// [`MemoryGate::check_all`], as a future that is ready at once, decided when this is
    /// called (as [`check`](Gate::check)).
    fn check_all<'a>(
        &'a self,
        limits: &'a [(&'a str, Quota)],
        cost: u32,
    ) -> GateFuture<'a, Vec<Decision>> {
        Box::pin(std::future::ready(MemoryGate::check_all(
            self, limits, cost,
        )))
    }

    /// Always `Some`: [`MemoryGate::check_all`], into `decisions` (no allocation on at most
    /// 4 limits, but for a key new to the buckets).
    fn check_all_local(
        &self,
        limits: &[(&str, Quota)],
        cost: u32,
        decisions: &mut Vec<Decision>,
    ) -> Option<Result<(), GateError>> {
        Some(self.check_all_into(limits, cost, decisions))
    }

    /// At most 16 distinct quotas: what one shard holds ([`check_all`](MemoryGate::check_all)
    /// refuses a request that needs more with [`GateError::KeyspaceFull`]).
    fn validate_quotas(&self, quotas: &[Quota]) -> Result<(), ConfigError> {
        let distinct = quotas
            .iter()
            .enumerate()
            .filter(|&(i, q)| !quotas[..i].contains(q))
            .count();
        if distinct > MAX_QUOTAS {
            return Err(ConfigError::new(
                "gate.quotas",
                ConfigErrorKind::TooLarge,
                format!(
                    "{distinct} distinct quotas: a MemoryGate decides at most {MAX_QUOTAS} together"
                ),
            ));
        }
        Ok(())
    }

    /// [`validate_quotas`](Gate::validate_quotas), and at most 16 distinct quotas
    /// registered together by every registration alive on this gate (and its clones).
    /// A quota no registration held before keeps the buckets it may still hold from an
    /// earlier one (they were not evicted yet).
    fn register_quotas(&self, quotas: &[Quota]) -> Result<Registration, ConfigError> {
        self.validate_quotas(quotas)?;
        let multi = &self.inner.multi;
        let distinct = self
            .inner
            .quotas
            .register(quotas, |q| multi.set_released(q, false))?;
        Ok(Registration::on(self.clone(), distinct))
    }

    fn limit(&self) -> Limit {
        self.inner.limit
    }
}

impl fmt::Debug for MemoryGate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryGate")
            .field("name", &self.inner.name)
            .field("limit", &self.inner.limit)
            .field("max_keys", &self.inner.max_keys)
            .field("clock", &self.inner.clock)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rate::Rate;

    /// A burst of `n` an hour: no bucket is full again while a test runs.
    fn hourly(n: u32) -> Quota {
        Quota::new(Rate::per(n, Duration::from_secs(3_600)).unwrap(), n).unwrap()
    }

    /// The keys of a dropped layer's quota (its registration released) give their room to
    /// the quotas registered after it: they held it until they were back to full, so the
    /// new quota's keys were refused (`KeyspaceFull`) in every shard they filled.
    #[test]
    fn a_released_quotas_keys_give_their_room_to_a_registered_quota() {
        // 16 shards of 4 keys.
        let gate = MemoryGate::builder(Limit::TokenBucket(hourly(1)))
            .max_keys(64)
            .build()
            .unwrap();
        let keys: Vec<String> = (0..400).map(|i| format!("k{i}")).collect();
        let old = gate.register_quotas(&[hourly(1)]).unwrap();
        for key in &keys {
            let _ = gate.check_all(&[(key.as_str(), hourly(1))], 1);
        }
        assert_eq!(gate.inner.multi.len(), 64, "every shard full");
        drop(old);
        let _new = gate.register_quotas(&[hourly(2)]).unwrap();
        // Every shard takes 4 keys of the new quota (400 keys: about 25 a shard).
        let admitted = keys
            .iter()
            .filter(|key| gate.check_all(&[(key.as_str(), hourly(2))], 1).is_ok())
            .count();
        assert_eq!(admitted, 64, "new keys of the registered quota admitted");
        assert_eq!(gate.inner.multi.len(), 64);
    }

    /// A request refused because the shard of its key holds buckets of 16 quotas already,
    /// with 16 keys held of 1 600, is not told that all 1 600 keys are in use: the message
    /// sent users looking for a larger `max_keys`, which does not help.
    #[test]
    fn keyspace_full_says_what_is_full() {
        let gate = MemoryGate::builder(Limit::TokenBucket(hourly(1)))
            .max_keys(1_600)
            .build()
            .unwrap();
        for n in 1..=16 {
            assert!(gate.check_all(&[("k", hourly(n))], 1).unwrap()[0].allowed);
        }
        let e = gate.check_all(&[("k", hourly(17))], 1).unwrap_err();
        assert!(matches!(e, GateError::KeyspaceFull { max_keys: 1_600 }));
        assert_eq!(gate.inner.multi.len(), 16);
        assert_eq!(
            e.to_string(),
            "no room for a new key: its shard of the gate (a 16th of its 1600 keys; for \
             check_all, at most 16 distinct quotas) is full, and nothing in it is idle yet"
        );
    }

    /// `max_keys` is exact, rounded up to a multiple of 16: each shard holds at most a 16th
    /// under its own lock, so inserts racing on different shards never take the gate past
    /// it, for its own keys and for `check_all`'s buckets alike; and with every shard full
    /// the gate holds exactly that many.
    #[test]
    fn max_keys_holds_exactly_under_concurrent_inserts() {
        let gate = MemoryGate::builder(Limit::TokenBucket(hourly(1)))
            .max_keys(1_000)
            .build()
            .unwrap();
        assert_eq!(gate.max_keys(), 1_008);
        let (own, all) = std::thread::scope(|s| {
            let threads: Vec<_> = (0..4)
                .map(|t| {
                    let gate = &gate;
                    s.spawn(move || {
                        let (mut own, mut all) = (0, 0);
                        for i in 0..5_000 {
                            let key = format!("t{t}-k{i}");
                            match gate.check(&key, 1) {
                                Ok(_) => own += 1,
                                Err(e) => {
                                    assert!(matches!(
                                        e,
                                        GateError::KeyspaceFull { max_keys: 1_008 }
                                    ))
                                }
                            }
                            match gate.check_all(&[(key.as_str(), hourly(1))], 1) {
                                Ok(_) => all += 1,
                                Err(e) => {
                                    assert!(matches!(
                                        e,
                                        GateError::KeyspaceFull { max_keys: 1_008 }
                                    ))
                                }
                            }
                        }
                        (own, all)
                    })
                })
                .collect();
            threads
                .into_iter()
                .map(|t| t.join().unwrap())
                .fold((0, 0), |(a, b), (c, d)| (a + c, b + d))
        });
        // 20 000 keys: about 1 250 a shard, so every shard fills to its 63.
        assert_eq!((own, gate.len()), (1_008, 1_008));
        assert_eq!((all, gate.inner.multi.len()), (1_008, 1_008));
    }

    /// A released quota's buckets are kept until a shard needs the room: registered again
    /// before (a layer dropped and built again with the same quotas), they hold what they
    /// had spent and their room, so rebuilding a layer gives no client a fresh burst.
    #[test]
    fn a_quota_registered_again_before_the_room_is_needed_keeps_its_buckets() {
        // 16 shards of one key.
        let gate = MemoryGate::builder(Limit::TokenBucket(hourly(1)))
            .max_keys(16)
            .build()
            .unwrap();
        let first = gate.register_quotas(&[hourly(3)]).unwrap();
        assert!(gate.check_all(&[("k", hourly(3))], 3).unwrap()[0].allowed);
        drop(first);
        let _again = gate.register_quotas(&[hourly(3)]).unwrap();
        // The same key under another quota: a new key in the same (full) shard, whose
        // sweep keeps the bucket held again.
        assert!(matches!(
            gate.check_all(&[("k", hourly(4))], 1),
            Err(GateError::KeyspaceFull { max_keys: 16 })
        ));
        let d = gate.check_all(&[("k", hourly(3))], 1).unwrap();
        assert!(!d[0].allowed, "the bucket started afresh: {d:?}");
    }

    /// Releasing a layer's quota evicts its buckets and no other: the buckets of quotas
    /// given to `check_all` without a registration (the caller's own) are evicted only when
    /// full again, as before.
    #[test]
    fn a_release_evicts_only_the_released_quotas_buckets() {
        // 16 shards of 4 keys.
        let gate = MemoryGate::builder(Limit::TokenBucket(hourly(1)))
            .max_keys(64)
            .build()
            .unwrap();
        let (layers, own, other) = (hourly(1), hourly(2), hourly(3));
        let layer = gate.register_quotas(&[layers]).unwrap();
        for i in 0..32 {
            let _ = gate.check_all(&[(format!("a{i}").as_str(), layers)], 1);
        }
        let of_the_layer = gate.inner.multi.len();
        let own_keys: Vec<String> = (0..400)
            .map(|i| format!("b{i}"))
            .filter(|key| gate.check_all(&[(key.as_str(), own)], 1).is_ok())
            .collect();
        assert_eq!(gate.inner.multi.len(), 64, "every shard full");
        drop(layer);
        let admitted = (0..400)
            .filter(|i| {
                gate.check_all(&[(format!("c{i}").as_str(), other)], 1)
                    .is_ok()
            })
            .count();
        assert_eq!(
            admitted, of_the_layer,
            "the released quota's room, and no more"
        );
        for key in &own_keys {
            let d = gate.check_all(&[(key.as_str(), own)], 1).unwrap();
            assert!(d[0].allowed && d[0].remaining == 0, "{key} started afresh");
        }
    }

    /// Layers built and dropped a thousand times over one gate, each with 16 quotas of its
    /// own and busy buckets on every shard, have every request decided, and what the gate
    /// holds stays within its bounds: at most 16 quotas a shard, `max_keys` keys, and
    /// nothing registered once every layer is gone.
    #[test]
    fn a_thousand_layers_built_and_dropped_hold_nothing_past_the_bounds() {
        let gate = MemoryGate::builder(Limit::TokenBucket(hourly(1)))
            .max_keys(1_024)
            .build()
            .unwrap();
        for cycle in 0..1_000u64 {
            let quotas: Vec<Quota> = (0..16)
                .map(|i| {
                    let rate = Rate::per(i + 1, Duration::from_secs(3_600 + cycle)).unwrap();
                    Quota::new(rate, i + 1).unwrap()
                })
                .collect();
            let layer = gate.register_quotas(&quotas).unwrap();
            // 8 clients, each with a key per quota (as a layer names them): 128 new busy
            // buckets a cycle, on every shard.
            for client in 0..8 {
                let keys: Vec<String> = (0..16).map(|i| format!("p{i}:c{client}")).collect();
                let limits: Vec<(&str, Quota)> = keys
                    .iter()
                    .map(String::as_str)
                    .zip(quotas.iter().copied())
                    .collect();
                let d = gate
                    .check_all(&limits, 1)
                    .unwrap_or_else(|e| panic!("cycle {cycle}, client {client}: {e}"));
                assert!(
                    d.iter().all(|d| d.allowed),
                    "cycle {cycle}, client {client}"
                );
            }
            drop(layer);
            assert!(gate.inner.multi.len() <= 1_024);
            assert!(gate.inner.multi.most_quotas_in_a_shard() <= MAX_QUOTAS);
        }
        assert_eq!(gate.inner.quotas.len(), 0);
    }
}

#[cfg(test)]
mod races {
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::*;
    use crate::rate::Rate;

    /// Requests on pairs of three shared buckets ([a, b], [b, c], [c, a]), raced from four
    /// threads until every bucket is empty: each bucket is charged exactly once per admitted
    /// request naming it, never by one refused, and never past its burst.
    #[test]
    fn racing_check_alls_charge_exactly_the_admitted_requests() {
        let burst = 1_000u32;
        let quota =
            Quota::new(Rate::per(burst, Duration::from_secs(3_600)).unwrap(), burst).unwrap();
        for round in 0..20 {
            let gate = MemoryGate::new(Limit::TokenBucket(quota));
            let keys = [
                format!("a{round}"),
                format!("b{round}"),
                format!("c{round}"),
            ];
            let pairs = [(0, 1), (1, 2), (2, 0)];
            let admitted: [AtomicU64; 3] = Default::default();
            std::thread::scope(|s| {
                for t in 0..4 {
                    let (gate, keys, admitted) = (&gate, &keys, &admitted);
                    s.spawn(move || {
                        for i in 0..2_000usize {
                            let p = (i + t) % 3;
                            let (x, y) = pairs[p];
                            let limits = [(keys[x].as_str(), quota), (keys[y].as_str(), quota)];
                            let d = gate.check_all(&limits, 1).unwrap();
                            assert_eq!(d[0].allowed, d[1].allowed);
                            if d[0].allowed {
                                admitted[p].fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    });
                }
            });
            let n: Vec<u64> = admitted.iter().map(|a| a.load(Ordering::Relaxed)).collect();
            for (k, key) in keys.iter().enumerate() {
                // Requests naming bucket k: pair k ([k, k+1]) and pair k-1 ([k-1, k]).
                let charged = n[k] + n[(k + 2) % 3];
                assert!(charged <= u64::from(burst), "{key}: {charged} charged");
                let left = gate.check_all(&[(key.as_str(), quota)], 1).unwrap()[0];
                let expected = u64::from(burst) - charged;
                if expected == 0 {
                    assert!(!left.allowed, "{key}: {left:?}");
                } else {
                    assert!(left.allowed, "{key}: {left:?}");
                    assert_eq!(left.remaining, expected - 1, "{key}: {n:?}");
                }
            }
        }
    }
}
