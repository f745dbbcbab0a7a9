//! `RedisGate`: one limit across a fleet, decided atomically in Redis.

use std::fmt;
use std::sync::PoisonError;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
// Real time, not tokio's (pausable) clock: the cache, leases and probes follow Redis, whose
// clock never pauses.
use std::time::{Duration, Instant};

use redis::aio::ConnectionLike;
use tokio::sync::{mpsc, oneshot};

use crate::decision::Decision;
use crate::error::{ConfigError, ConfigErrorKind};
use crate::gate::api::{Gate, GateFuture};
use crate::gate::batch::{Batcher, Driver, Request};
use crate::gate::error::{BackendMessage, GateError, check_key};
use crate::gate::lease::Leases;
use crate::gate::limit::Limit;
use crate::gate::memory::MemoryGate;
use crate::gate::reject_cache::RejectCache;
use crate::gate::scripts;
use crate::gate::scripts::{LimitScript, decision_from};
use crate::gate::slot::slot;
use crate::metrics::{Counter, Gauge, Histogram, Labels};
use crate::rate::Quota;
use crate::sync::{Arc, Mutex};

/// What a [`RedisGate`] does when Redis fails or does not answer within the timeout.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub enum FailurePolicy {
    /// Return the error ([`GateError::Backend`] or [`GateError::Timeout`]) to the caller.
    #[default]
    Error,
    /// Admit everything (availability over the limit).
    Open,
    /// Reject everything, with `retry_after` = the time until the next probe of Redis.
    Closed,
    /// Decide locally with this in-memory gate (each instance then enforces the limit on its
    /// own: the fleet may admit up to instances × limit while Redis is away).
    Fallback(MemoryGate),
}

impl FailurePolicy {
    fn as_str(&self) -> &'static str {
        match self {
            FailurePolicy::Error => "error",
            FailurePolicy::Open => "open",
            FailurePolicy::Closed => "closed",
            FailurePolicy::Fallback(_) => "fallback",
        }
    }
}

/// Names of the gate metrics.
pub(crate) mod names {
    pub(crate) const DECISIONS: &str = "flowgate_gate_decisions_total";
    pub(crate) const LATENCY: &str = "flowgate_gate_redis_seconds";
    pub(crate) const FAILURES: &str = "flowgate_gate_failures_total";
    pub(crate) const DEGRADED: &str = "flowgate_gate_degraded";
    pub(crate) const TRANSITIONS: &str = "flowgate_gate_transitions_total";
    pub(crate) const BATCH_SIZE: &str = "flowgate_gate_batch_size";
}

struct Metrics {
    cached: Counter,
    allowed: Counter,
    rejected: Counter,
    by_policy: Counter,
    latency: Histogram,
    failures: Counter,
    degraded: Gauge,
    to_degraded: Counter,
    to_healthy: Counter,
}

#[derive(Debug, Clone, Copy)]
enum Health {
    Healthy,
    /// Redis failed; the next call to Redis is a probe, at or after this instant.
    Degraded {
        next_probe: Instant,
    },
}

struct Inner<C> {
    conn: C,
    /// The batch driver's queue; `None` when batching is off.
    batcher: Option<Batcher>,
    cache: RejectCache,
    /// The limit and its script.
    eval: LimitScript,
    all_script: redis::Script,
    cluster: bool,
    leases: Option<Leases>,
    lease_script: redis::Script,
    prefix: String,
    timeout: Duration,
    policy: FailurePolicy,
    probe_interval: Duration,
    health: Mutex<Health>,
    /// Whether `health` is `Degraded`: lets the healthy path skip the lock.
    degraded: AtomicBool,
    name: Option<String>,
    metrics: Metrics,
}

/// One limit across every instance of a service, decided by one atomic Lua script per
/// request in Redis.
///
/// - **Atomic and exact**: each decision is one script (`EVALSHA`, reloaded on `NOSCRIPT`
///   after a restart or failover) running the same integer math as [`limit`](crate::limit)
///   in microseconds; a rejected call consumes nothing.
/// - **Server clock**: time comes from Redis `TIME`, so application clocks may disagree.
/// - **TTLs**: every key expires once its state is neutral again; idle keys vanish. A token
///   bucket key lives up to 1 s longer than that: its TTL is set with that slack so that most
///   writes can keep it (`SET .. KEEPTTL` costs Redis about half as much as `SET .. PX`).
/// - **Redis version**: 6.0 or later (`SET .. KEEPTTL`).
/// - **Upgrading from flowgate 0.1**: token bucket keys are now stored packed (25 bytes)
///   instead of as text. This version reads both, but 0.1 cannot read the new form: upgrade
///   every instance that shares a key prefix at once, or give the new ones a new prefix.
/// - **Runtime limits**: the parameters travel with every call; change them by building a new
///   gate over the same prefix.
/// - **Batching**: concurrent decisions share one script call (up to `batch_size`, default
///   128): while one call is in flight the next batch fills, so there is no added latency at
///   low load. Each caller gets exactly the decision it would get alone, in arrival order. A
///   caller that gives up before its batch is sent is left out; one that gives up after may
///   still consume its cost (never over-admission).
/// - **Rejection cache**: after Redis rejects cost `c` for a key with `retry_after` T, further
///   requests of cost ≥ `c` for that key are rejected locally until T, with no round trip.
///   Exact: T is counted from when the request was sent, so it never rejects what Redis would
///   admit. Bounded (`reject_cache`, default 10 000 keys).
/// - **Failure policy**: every decision is bounded by `timeout` (default 50 ms). On an error
///   or timeout the [`FailurePolicy`] decides; after a failure Redis is probed at most every
///   `probe_interval` (default 1 s) instead of being hammered, and the gate returns to Redis
///   by itself when a probe succeeds. Transitions are logged (`tracing`) and counted.
///
/// Works over any redis-rs async connection that is `Clone`: `MultiplexedConnection`, or
/// `ConnectionManager` (which reconnects by itself: use it in production).
///
/// # Metrics
///
/// Labelled by `name`: `flowgate_gate_decisions_total` by `outcome` (`allowed`, `rejected`,
/// `cached`, `policy`), `flowgate_gate_redis_seconds` (latency), `flowgate_gate_batch_size`,
/// `flowgate_gate_failures_total`, `flowgate_gate_degraded` (1 while degraded),
/// `flowgate_gate_transitions_total` by `to`.
pub struct RedisGate<C> {
    inner: Arc<Inner<C>>,
}

impl<C> Clone for RedisGate<C> {
    fn clone(&self) -> Self {
        RedisGate {
            inner: self.inner.clone(),
        }
    }
}

impl<C> fmt::Debug for RedisGate<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisGate")
            .field("name", &self.inner.name)
            .field("limit", &self.inner.eval.limit)
            .field("prefix", &self.inner.prefix)
            .field("timeout", &self.inner.timeout)
            .field("policy", &self.inner.policy.as_str())
            .finish_non_exhaustive()
    }
}

/// Builds a [`RedisGate`]; from [`RedisGate::builder`].
#[derive(Debug)]
pub struct RedisGateBuilder<C> {
    conn: C,
    limit: Limit,
    batch_size: usize,
    reject_cache: usize,
    cluster: bool,
    lease: u32,
    lease_ttl: Duration,
    prefix: String,
    timeout: Duration,
    policy: FailurePolicy,
    probe_interval: Duration,
    name: Option<String>,
}

impl<C> RedisGateBuilder<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// The prefix of every key (default `"flowgate:"`).
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The longest a decision may take before the failure policy applies (default 50 ms).
    /// `Duration::MAX` means no limit (as for every duration setting, anything above a
    /// century is taken as a century).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = crate::time::capped(timeout);
        self
    }

    /// What to do when Redis fails or times out (default [`FailurePolicy::Error`]).
    pub fn failure_policy(mut self, policy: FailurePolicy) -> Self {
        self.policy = policy;
        self
    }

    /// How often to try Redis again after a failure (default 1 s).
    pub fn probe_interval(mut self, every: Duration) -> Self {
        self.probe_interval = crate::time::capped(every);
        self
    }

    /// The `name` label of this gate's metrics.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// The most decisions sent in one script call (default 128). Concurrent decisions are
    /// batched naturally: while one call is in flight the next batch fills, so there is no
    /// added latency at low load. `1` turns batching off (one call per decision).
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n;
        self
    }

    /// The connection is a Redis Cluster connection
    /// (`redis::cluster_async::ClusterConnection`): batches are split per hash slot, one
    /// script call per slot, and `acquire_all` checks that its keys share a slot.
    ///
    /// Name keys so that what must be decided together shares a slot, with a hash tag:
    /// `{tenant-42}:user:7`. Keys without a tag spread over the whole cluster.
    pub fn cluster(mut self, cluster: bool) -> Self {
        self.cluster = cluster;
        self
    }

    /// Token leases (token bucket only; off by default): when a key has no local tokens, take
    /// up to `n` from Redis in one call — debited there before any is used, so the fleet can
    /// never over-admit — and serve the next requests for that key locally.
    ///
    /// Worst-case under-admission: each instance may hold up to `n − 1` tokens per key (per
    /// lease call in flight for it: concurrent calls' leases add up) that no other instance
    /// can use, and tokens unused after `lease_ttl` are lost. Decisions
    /// served from a lease report the lease's remaining tokens. `0` or `1` turns leases off.
    pub fn lease(mut self, n: u32) -> Self {
        self.lease = n;
        self
    }

    /// How long leased tokens may be spent locally (default 1 s).
    pub fn lease_ttl(mut self, ttl: Duration) -> Self {
        self.lease_ttl = crate::time::capped(ttl);
        self
    }

    /// How many keys the local rejection cache holds (default 10 000; `0` turns it off).
    pub fn reject_cache(mut self, keys: usize) -> Self {
        self.reject_cache = keys;
        self
    }

    /// Build the gate and try to load its script (a failure to load is not an error: the
    /// script is sent again with the first decision).
    ///
    /// # Errors
    ///
    /// [`ConfigError`] on `gate.limit` when the limit cannot be computed exactly in Redis
    /// (a period that is not whole microseconds, or numbers too large), on `gate.timeout` or
    /// `gate.probe_interval` when zero.
    pub async fn build(self) -> Result<RedisGate<C>, ConfigError> {
        let eval = LimitScript::new(self.limit)?;
        if self.timeout.is_zero() {
            return Err(ConfigError::zero("gate.timeout"));
        }
        if self.probe_interval.is_zero() {
            return Err(ConfigError::zero("gate.probe_interval"));
        }
        if self.batch_size == 0 {
            return Err(ConfigError::zero("gate.batch_size"));
        }
        let leases = match (self.lease > 1, &self.limit) {
            (false, _) => None,
            (true, Limit::TokenBucket(_)) => Some(Leases::new(
                self.lease,
                self.lease_ttl,
                self.reject_cache.max(1_000),
            )),
            (true, _) => {
                return Err(ConfigError::new(
                    "gate.lease",
                    ConfigErrorKind::Inconsistent,
                    "token leases need a token bucket limit",
                ));
            }
        };
        let mut conn = self.conn.clone();
        let _ = tokio::time::timeout(
            self.timeout.max(Duration::from_millis(500)),
            eval.script.prepare_invoke().load_async(&mut conn),
        )
        .await;
        let labels = Labels::new(self.name.as_deref());
        let decisions = |outcome| labels.counter(names::DECISIONS, &[("outcome", outcome)]);
        let transitions = |to| labels.counter(names::TRANSITIONS, &[("to", to)]);
        let batcher = (self.batch_size > 1).then(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            let calls = Arc::new(AtomicUsize::new(0));
            let driver = Driver {
                calls: calls.clone(),
                conn: self.conn.clone(),
                eval: eval.clone(),
                timeout: self.timeout,
                max_batch: self.batch_size,
                batch_size: labels.histogram(names::BATCH_SIZE, &[]),
                cluster: self.cluster,
            };
            tokio::spawn(driver.run(rx));
            Batcher { queue: tx, calls }
        });
        Ok(RedisGate {
            inner: Arc::new(Inner {
                conn: self.conn,
                batcher,
                cache: RejectCache::new(self.reject_cache),
                eval,
                all_script: redis::Script::new(scripts::TOKEN_BUCKET_ALL),
                cluster: self.cluster,
                leases,
                lease_script: redis::Script::new(scripts::TOKEN_BUCKET_LEASE),
                prefix: self.prefix,
                timeout: self.timeout,
                policy: self.policy,
                probe_interval: self.probe_interval,
                health: Mutex::new(Health::Healthy),
                degraded: AtomicBool::new(false),
                metrics: Metrics {
                    cached: decisions("cached"),
                    allowed: decisions("allowed"),
                    rejected: decisions("rejected"),
                    by_policy: decisions("policy"),
                    latency: labels.histogram(names::LATENCY, &[]),
                    failures: labels.counter(names::FAILURES, &[]),
                    degraded: labels.gauge(names::DEGRADED, &[]),
                    to_degraded: transitions("degraded"),
                    to_healthy: transitions("healthy"),
                },
                name: self.name,
            }),
        })
    }
}

impl<C> RedisGate<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// A builder for a gate enforcing `limit` per key through `conn`.
    pub fn builder(conn: C, limit: Limit) -> RedisGateBuilder<C> {
        RedisGateBuilder {
            conn,
            limit,
            batch_size: 128,
            reject_cache: 10_000,
            cluster: false,
            lease: 0,
            lease_ttl: Duration::from_secs(1),
            prefix: "flowgate:".into(),
            timeout: Duration::from_millis(50),
            policy: FailurePolicy::Error,
            probe_interval: Duration::from_secs(1),
            name: None,
        }
    }

    /// Whether the gate is currently deciding by its failure policy.
    pub fn is_degraded(&self) -> bool {
        matches!(
            *self
                .inner
                .health
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
            Health::Degraded { .. }
        )
    }

    /// The Redis key a gate key is stored under.
    pub fn redis_key(&self, key: &str) -> String {
        let prefix = &self.inner.prefix;
        let mut k = String::with_capacity(prefix.len() + key.len());
        k.push_str(prefix);
        k.push_str(key);
        k
    }

    /// Decide one request.
    ///
    /// # Errors
    ///
    /// [`GateError::InsufficientCapacity`], [`GateError::ZeroCost`],
    /// [`GateError::InvalidKey`] for bad requests (Redis is not called) and for a key that
    /// holds a value of another type in Redis (only that request fails, the gate does not
    /// degrade); under
    /// [`FailurePolicy::Error`], [`GateError::Backend`] and [`GateError::Timeout`].
    pub async fn check(&self, key: &str, cost: u32) -> Result<Decision, GateError> {
        check_key(key)?;
        self.inner.eval.limit.check_cost(cost)?;
        let inner = &*self.inner;
        let now = Instant::now();
        // Tokens leased here are already paid for: spend them before any cached rejection
        // (taken by a concurrent call) can refuse the request.
        if let Some(decision) = inner.leases.as_ref().and_then(|l| l.spend(key, cost, now)) {
            inner.metrics.allowed.increment(1);
            return Ok(decision);
        }
        if let Some(decision) = inner.cache.check(key, cost, now) {
            inner.metrics.cached.increment(1);
            return Ok(decision);
        }
        if let Err(until_probe) = self.may_call(now) {
            return self.by_policy(key, cost, until_probe, None);
        }
        let reply = match &inner.leases {
            Some(leases) => self.decide_lease(leases, key, cost, now).await,
            None => self.decide(key, cost, now).await,
        };
        let error = match reply {
            Ok(decision) => {
                self.healthy();
                if decision.allowed {
                    inner.metrics.allowed.increment(1);
                } else {
                    inner.metrics.rejected.increment(1);
                    inner.cache.rejected(key, cost, now, &decision);
                }
                return Ok(decision);
            }
            Err(e) => e,
        };
        let (until_probe, error) = self.failed(error)?;
        self.by_policy(key, cost, until_probe, Some(error))
    }

    /// Whether this call may go to Redis: always while healthy; while degraded, one call per
    /// probe interval (the probe) — the others get `Err(time until the next probe)` and use
    /// the failure policy meanwhile.
    fn may_call(&self, now: Instant) -> Result<(), Duration> {
        let inner = &*self.inner;
        if !inner.degraded.load(Ordering::Acquire) {
            return Ok(());
        }
        let mut health = inner.health.lock().unwrap_or_else(PoisonError::into_inner);
        if let Health::Degraded { next_probe } = *health {
            if now < next_probe {
                return Err(next_probe - now);
            }
            // This call is the probe; others keep using the policy meanwhile.
            *health = Health::Degraded {
                next_probe: now + inner.probe_interval,
            };
        }
        Ok(())
    }

    /// One decision in a script call of its own, bounded by the timeout.
    async fn call_one(&self, key: &str, cost: u32) -> Result<Decision, GateError> {
        let inner = &*self.inner;
        let mut conn = inner.conn.clone();
        let key = self.redis_key(key);
        let requests = std::iter::once((key.as_str(), cost));
        let mut decided = inner
            .eval
            .decide(&mut conn, requests, inner.timeout, inner.timeout)
            .await?;
        decided.pop().expect("one decision per request")
    }

    /// One decision from Redis, batched or alone, bounded by the timeout from `started`.
    async fn decide(&self, key: &str, cost: u32, started: Instant) -> Result<Decision, GateError> {
        let inner = &*self.inner;
        let result = match inner.batcher.as_ref().map(|b| (b, b.idle_call())) {
            // Calls in flight: join the next batch.
            Some((batcher, None)) => {
                let (reply, answer) = oneshot::channel();
                let deadline = started + inner.timeout;
                let request = Request {
                    key: self.redis_key(key),
                    cost,
                    deadline,
                    reply,
                };
                if batcher.queue.send(request).is_err() {
                    return Err(GateError::backend(BackendMessage(
                        "the batch driver stopped (its runtime shut down)".into(),
                    )));
                }
                // The driver answers by the deadline (its call's timeout ends there); the
                // timer here is the backstop for a driver whose runtime is not being driven.
                match tokio::time::timeout(inner.timeout, answer).await {
                    Ok(Ok(result)) => result,
                    Ok(Err(_)) => Err(GateError::backend(BackendMessage(
                        "the batch driver dropped the request".into(),
                    ))),
                    Err(_) => Err(GateError::Timeout(inner.timeout)),
                }
            }
            // Nothing in flight: call Redis from here, without the hop through the driver
            // (no added latency at low load); callers arriving meanwhile batch behind it.
            Some((_, Some(_call))) => self.call_one(key, cost).await,
            None => self.call_one(key, cost).await,
        };
        inner
            .metrics
            .latency
            .record(started.elapsed().as_secs_f64());
        result
    }

    /// All-or-nothing across several limits in one atomic script: admitted only if every
    /// `(key, quota)` token bucket has room for `cost`, and then charged on all of them;
    /// otherwise nothing is charged anywhere (layered throttling: IP + user + tenant).
    /// Returns one decision per limit, in order; `allowed` is the same in all of them, and
    /// the limits that blocked have a non-zero `retry_after`.
    ///
    /// Not batched, not cached; the gate's own limit and prefix are not used (keys are taken
    /// as given). On Redis Cluster the keys must share a hash slot: use a hash tag, e.g.
    /// `{tenant-42}:ip:10.0.0.1` and `{tenant-42}:user:7`.
    ///
    /// # Errors
    ///
    /// [`GateError::InvalidKey`], [`GateError::ZeroCost`], [`GateError::InsufficientCapacity`]
    /// (cost above some burst) before Redis is called; [`GateError::Backend`] /
    /// [`GateError::Timeout`] (the failure policy applies: `Open` admits, `Closed` rejects,
    /// `Error` and `Fallback` return the error); a CROSSSLOT error from a cluster is a
    /// `Backend` error.
    pub async fn acquire_all(
        &self,
        limits: &[(&str, Quota)],
        cost: u32,
    ) -> Result<Vec<Decision>, GateError> {
        if limits.is_empty() {
            return Err(GateError::InvalidKey("no limits given"));
        }
        if cost == 0 {
            return Err(GateError::ZeroCost);
        }
        if self.inner.cluster {
            let first = slot(limits[0].0.as_bytes());
            if limits.iter().any(|(k, _)| slot(k.as_bytes()) != first) {
                return Err(GateError::InvalidKey(
                    "on Redis Cluster the keys of acquire_all must share a hash slot: \
                     give them the same {hash tag}",
                ));
            }
        }
        // KEYS: the buckets; ARGV: now (empty: Redis TIME), cost, then each bucket's
        // parameters.
        let mut params = Vec::with_capacity(limits.len());
        for (key, quota) in limits {
            check_key(key)?;
            let capacity = u64::from(quota.burst_size());
            if u64::from(cost) > capacity {
                return Err(GateError::InsufficientCapacity { cost, capacity });
            }
            let (count, period_us) = Limit::TokenBucket(*quota).redis_params().map_err(|_| {
                GateError::InvalidKey("a quota cannot be computed exactly in Redis")
            })?;
            params.push((count, period_us, quota.burst_size()));
        }
        let script = &self.inner.all_script;
        let mut cmd = scripts::evalsha(script, limits.len());
        for (key, _) in limits {
            cmd.arg(*key);
        }
        cmd.arg("").arg(cost);
        for (count, period_us, burst) in params {
            cmd.arg(count).arg(period_us).arg(burst);
        }
        // While degraded, like `check`: only the probe goes to Redis.
        let (until_probe, error) = match self.may_call(Instant::now()) {
            Err(until_probe) => (until_probe, failing(until_probe)),
            Ok(()) => {
                let mut conn = self.inner.conn.clone();
                let timeout = self.inner.timeout;
                let reply = scripts::eval_ints(
                    &mut conn,
                    script,
                    &cmd,
                    5 * limits.len(),
                    timeout,
                    timeout,
                    "multi-limit script",
                )
                .await;
                match reply {
                    Ok(v) => {
                        self.healthy();
                        return Ok(v.chunks_exact(5).map(decision_from).collect());
                    }
                    Err(e) => self.failed(e)?,
                }
            }
        };
        self.inner.metrics.by_policy.increment(1);
        let one = |allowed: bool, q: &Quota| {
            if allowed {
                Decision::admitted_without_limit()
            } else {
                Decision::reject(u64::from(q.burst_size()), 0, until_probe, until_probe)
            }
        };
        match self.inner.policy {
            FailurePolicy::Open => Ok(limits.iter().map(|(_, q)| one(true, q)).collect()),
            FailurePolicy::Closed => Ok(limits.iter().map(|(_, q)| one(false, q)).collect()),
            _ => Err(error),
        }
    }

    /// Take a lease of up to `lease` tokens (at least `cost`); spend `cost`, keep the rest.
    async fn decide_lease(
        &self,
        leases: &Leases,
        key: &str,
        cost: u32,
        started: Instant,
    ) -> Result<Decision, GateError> {
        let inner = &*self.inner;
        let Limit::TokenBucket(quota) = inner.eval.limit else {
            // Leases are only built for token buckets.
            return self.decide(key, cost, started).await;
        };
        let mut conn = inner.conn.clone();
        let mut cmd = scripts::evalsha(&inner.lease_script, 1);
        cmd.arg(self.redis_key(key));
        inner.eval.add_args(&mut cmd, [cost]);
        cmd.arg(leases.size.max(cost));
        let reply = scripts::eval_ints(
            &mut conn,
            &inner.lease_script,
            &cmd,
            5,
            inner.timeout,
            inner.timeout,
            "lease script",
        )
        .await;
        inner
            .metrics
            .latency
            .record(started.elapsed().as_secs_f64());
        let r = reply?;
        let granted = u32::try_from(r[0]).unwrap_or(0);
        if granted >= cost {
            let limit = u64::from(quota.burst_size());
            leases.keep(key, granted - cost, limit, started);
            Ok(decision_from(&[
                1,
                r[1],
                r[2] + i64::from(granted - cost),
                0,
                r[4],
            ]))
        } else {
            Ok(decision_from(&[0, r[1], r[2], r[3], r[4]]))
        }
    }

    /// Keys held by the local rejection cache.
    pub fn cached_rejections(&self) -> usize {
        self.inner.cache.len()
    }

    fn healthy(&self) {
        if !self.inner.degraded.load(Ordering::Acquire) {
            return;
        }
        let mut health = self
            .inner
            .health
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Health::Degraded { .. } = *health {
            *health = Health::Healthy;
            self.inner.degraded.store(false, Ordering::Release);
            drop(health);
            self.inner.metrics.degraded.set(0.0);
            self.inner.metrics.to_healthy.increment(1);
            tracing::info!(gate = ?self.inner.name, "redis answers again: the gate is back on redis");
        }
    }

    /// A call to Redis failed with `error`. An error of the key itself (it holds a value of
    /// another type: `InvalidKey`) is that caller's alone and comes back as `Err`: Redis is
    /// fine, the gate does not degrade. Any other error is a Redis failure: counted, the gate
    /// degrades, and the time until the next probe comes back with the error.
    fn failed(&self, error: GateError) -> Result<(Duration, GateError), GateError> {
        if matches!(error, GateError::InvalidKey(_)) {
            return Err(error);
        }
        self.inner.metrics.failures.increment(1);
        Ok((self.degraded(&error), error))
    }

    /// Record a failure; returns the time until the next probe.
    fn degraded(&self, error: &GateError) -> Duration {
        let mut health = self
            .inner
            .health
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let next_probe = Instant::now() + self.inner.probe_interval;
        let was_healthy = matches!(*health, Health::Healthy);
        *health = Health::Degraded { next_probe };
        self.inner.degraded.store(true, Ordering::Release);
        drop(health);
        if was_healthy {
            self.inner.metrics.degraded.set(1.0);
            self.inner.metrics.to_degraded.increment(1);
            tracing::warn!(
                gate = ?self.inner.name,
                policy = self.inner.policy.as_str(),
                %error,
                "redis failed: deciding by the failure policy, probing every {:?}",
                self.inner.probe_interval
            );
        }
        self.inner.probe_interval
    }

    fn by_policy(
        &self,
        key: &str,
        cost: u32,
        until_probe: Duration,
        error: Option<GateError>,
    ) -> Result<Decision, GateError> {
        let inner = &*self.inner;
        inner.metrics.by_policy.increment(1);
        match &inner.policy {
            FailurePolicy::Error => Err(error.unwrap_or_else(|| failing(until_probe))),
            FailurePolicy::Open => Ok(Decision::admitted_without_limit()),
            FailurePolicy::Closed => Ok(Decision::reject(
                inner.eval.limit.capacity(),
                0,
                until_probe,
                until_probe,
            )),
            FailurePolicy::Fallback(gate) => gate.check(key, cost),
        }
    }
}

/// The error of a call the failure policy decided while Redis is failing.
fn failing(until_probe: Duration) -> GateError {
    GateError::backend(BackendMessage(format!(
        "redis is failing; the next probe is in {until_probe:?}"
    )))
}

impl<C> Gate for RedisGate<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    fn acquire<'a>(&'a self, key: &'a str, cost: u32) -> GateFuture<'a> {
        Box::pin(self.check(key, cost))
    }

    fn limit(&self) -> Limit {
        self.inner.eval.limit
    }
}
