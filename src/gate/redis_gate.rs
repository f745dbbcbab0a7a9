//! `RedisGate`: one limit across a fleet, decided atomically in Redis.

use std::fmt;
// Real time, not tokio's (pausable) clock: the cache, leases and probes follow Redis, whose
// clock never pauses.
use std::time::{Duration, Instant, SystemTime};

use redis::aio::ConnectionLike;
use tokio::sync::oneshot;

use crate::decision::Decision;
use crate::error::{ConfigError, ConfigErrorKind};
use crate::gate::api::{Gate, GateFuture};
use crate::gate::backend::{Backend, CallError, key_failure};
use crate::gate::batch::{Batcher, Call, Driver, Outcomes, Request};
use crate::gate::error::{GateError, check_key};
use crate::gate::finish::Finish;
use crate::gate::lease::{Leases, Place};
use crate::gate::limit::Limit;
use crate::gate::memory::MemoryGate;
use crate::gate::quotas::Registration;
use crate::gate::reject_cache::RejectCache;
use crate::gate::scripts;
use crate::gate::scripts::{LimitScript, decision_from};
use crate::metrics::{Counter, Labels};
use crate::rate::Quota;
use crate::sync::Arc;

/// What a [`RedisGate`] does when Redis fails or does not answer within the timeout.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub enum FailurePolicy {
    /// Return the error ([`GateError::Backend`] or [`GateError::Timeout`]) to the caller.
    #[default]
    Error,
    /// Admit everything (availability over the limit).
    Open,
    /// Reject everything, with `retry_after` = the time until the next probe of Redis
    /// ([`Decision::fail_closed`]: `capacity` is `u64::MAX`, as no quota stands behind it).
    Closed,
    /// Decide locally with this in-memory gate (each instance then enforces the limit on its
    /// own: the fleet may admit up to instances × limit while Redis is away).
    Fallback(MemoryGate),
}

impl FailurePolicy {
    /// The answer for `key` and `cost` while Redis is failing (`error`: what it said, if this
    /// call asked it) and the next probe is `until_probe` away.
    pub(crate) fn decide(
        &self,
        key: &str,
        cost: u32,
        until_probe: Duration,
        error: Option<GateError>,
    ) -> Result<Decision, GateError> {
        match self {
            FailurePolicy::Error => Err(CallError::error(error, until_probe)),
            FailurePolicy::Open => Ok(Decision::fail_open()),
            FailurePolicy::Closed => Ok(Decision::fail_closed(until_probe)),
            FailurePolicy::Fallback(gate) => gate.check(key, cost),
        }
    }

    pub(crate) fn as_str(&self) -> &'static str {
        match self {
            FailurePolicy::Error => "error",
            FailurePolicy::Open => "open",
            FailurePolicy::Closed => "closed",
            FailurePolicy::Fallback(_) => "fallback",
        }
    }
}

/// Names of the gate metrics (the backend's are in `backend::names`).
pub(crate) mod names {
    pub(crate) use crate::gate::memory::names::DECISIONS;
    pub(crate) const BATCH_SIZE: &str = "flowgate_gate_batch_size";
    pub(crate) const DRIVER_RESTARTS: &str = "flowgate_gate_driver_restarts_total";
    pub(crate) const LEASE_UNSPENT: &str = "flowgate_gate_lease_unspent_total";
}

pub(super) struct Metrics {
    pub(super) cached: Counter,
    /// `allowed`, `rejected` and `abandoned`, and the rejection cache, shared with the batch
    /// driver (which counts and caches the decisions of callers that gave up).
    pub(super) outcomes: Arc<Outcomes>,
    pub(super) by_policy: Counter,
    /// Requests refused with [`GateError::UnreadableKey`].
    pub(super) unreadable: Counter,
}

impl Metrics {
    /// Count `result`'s refusal for an unreadable key, if it is one, and pass it on.
    pub(super) fn counted<T>(&self, result: Result<T, GateError>) -> Result<T, GateError> {
        if let Err(GateError::UnreadableKey(_)) = result {
            self.unreadable.increment(1);
        }
        result
    }
}

pub(super) struct Inner<C> {
    /// Every call to Redis goes through it.
    pub(super) backend: Arc<Backend<C>>,
    /// The batch driver's queue; `None` when batching is off.
    batcher: Option<Batcher<C>>,
    /// The limit and its script.
    pub(super) eval: LimitScript,
    pub(super) all_script: redis::Script,
    pub(super) cluster: bool,
    /// Shared with the backend's reset, which forgets them.
    leases: Option<Arc<Leases>>,
    lease_script: redis::Script,
    prefix: String,
    pub(super) policy: FailurePolicy,
    name: Option<String>,
    pub(super) metrics: Metrics,
}

/// One limit across every instance of a service, decided by one atomic Lua script per
/// request in Redis.
///
/// - **Atomic and exact**: each decision is one script (`EVALSHA`, reloaded on `NOSCRIPT`
///   after a restart or failover) running the same integer math as [`limit`](crate::limit)
///   in microseconds; a rejected call consumes nothing.
/// - **Server clock**: time comes from Redis `TIME`, so application clocks may disagree.
///   If that clock steps back (a failover to a replica whose clock is behind), each
///   algorithm decides as its model in [`limit`](crate::limit) does (a token bucket owes the
///   step). A token bucket whose state lies further ahead of the clock than exact
///   arithmetic reaches (`2^52 / count` µs, for a rate of `count` per period: 4.5 s at 10^9
///   a second) rejects, with its waits counted as if the clock had stepped back only that
///   far (never later than it has room).
/// - **TTLs**: every key expires once its state is neutral again; idle keys vanish. A token
///   bucket key lives up to 1 s longer than that: its TTL is set with that slack so that most
///   writes can keep it (`SET .. KEEPTTL` costs Redis about half as much as `SET .. PX`).
/// - **Redis version**: 6.0 or later (`SET .. KEEPTTL`).
/// - **Memory**: keep the server's `maxmemory-policy` at `noeviction` (or give the gate a
///   Redis of its own). An evicting policy takes a bucket away instead of refusing the
///   write, and a bucket evicted comes back full: its key admits a whole burst again, with
///   no error, no log and no metric. Every gate key has a TTL, so the `volatile-*` policies
///   evict the gate's keys before any key without one. Under `noeviction` a full Redis
///   refuses writes (`OOM`): a Redis failure, decided by the failure policy (below).
/// - **State format**: a token bucket key holds 25 packed bytes; the text form
///   `"<tat_us> <frac>"` of earlier development builds is still read (and rewritten packed),
///   but those builds cannot read the packed form: do not share a prefix with them.
/// - **Runtime limits**: the parameters travel with every call; change them by building a new
///   gate over the same prefix. While old and new gates both run (a rolling deploy), each
///   decides by its own parameters on the same state: a token bucket's state is when its
///   debt is paid off, and each admits against it by its own rate and burst; a fixed
///   window's count holds until its key expires (when the window that counted it ends,
///   whatever the period of the gate that reads it); the sliding algorithms' counts and logs
///   carry over. The algorithm cannot change over a prefix: each gate refuses the keys the
///   other wrote with [`GateError::UnreadableKey`] (under every failure policy) until they
///   expire, and a key the old gates keep using stays. Give a new algorithm a new prefix;
///   until the old gates are gone the fleet then enforces the two limits apart, and may
///   admit up to both together, as it does when only the prefix changes.
/// - **Redis restarted empty** (no persistence, or flushed): every key's state is gone, so
///   each key admits a whole burst again, on top of what it admitted before. The gate
///   loads its scripts again by itself (on `NOSCRIPT`), and forgets the rejections it
///   cached and the tokens it leased on the old server's word (below).
/// - **Batching**: concurrent decisions share one script call (up to `batch_size`, default
///   128): while one call is in flight the next batch fills, so there is no added latency at
///   low load. Each caller gets exactly the decision it would get alone, in arrival order. A
///   caller that gives up before its batch is sent is left out; one that gives up after may
///   still consume its cost (never over-admission).
/// - **Rejection cache**: after Redis rejects cost `c` for a key with `retry_after` T, further
///   requests of cost ≥ `c` for that key are rejected locally until T, with no round trip
///   (a larger cost with the longer `retry_after` it needs: a token bucket's one emission
///   interval per unit more, a fixed window's the same; under the sliding algorithms only
///   cost `c` itself, larger ones go to Redis). Exact: T is counted from when the request
///   was sent, so it never rejects what Redis would admit; it runs on the monotonic clock
///   and the wall clock both, whichever ends it first, so a host that slept (a laptop
///   suspended, a VM paused: `Instant` stops, Redis's clock does not) does not keep
///   refusing on waking. A cached answer is of the time
///   it is given: `retry_after` and `reset_after` count down, and a token bucket's
///   `remaining` counts the units refilled since (as if no other instance took any
///   meanwhile, as `retry_after` does). Forgotten when Redis may have
///   lost its keys (restarted empty, failed over to a replica that missed writes): when the
///   gate is back on Redis after a failure, and when Redis no longer has the gate's scripts.
///   A gate sees neither without calling Redis: one that has had no answer from Redis for a
///   `probe_interval` (all its traffic answered from the cache, a hot key over an hourly
///   limit, say) sends the next request on a cached key to Redis, and keeps the rejection
///   if Redis cannot answer. Bounded (`reject_cache`, default 10 000 keys).
/// - **Failure policy**: every decision is bounded by `timeout` (default 50 ms). On an error
///   or timeout the [`FailurePolicy`] decides; after a failure Redis is probed at most every
///   `probe_interval` (default 1 s) instead of being hammered, and the gate returns to Redis
///   by itself when a probe succeeds. Transitions are logged (`tracing`) and counted. Every
///   path (`check`, batches, leases, [`check_all`](RedisGate::check_all)) calls Redis
///   through one backend, so a failure means the same everywhere:
///
///   | what Redis answers | what the caller gets |
///   |---|---|
///   | no answer within `timeout`; a transport error | Redis failure: the policy decides, the gate degrades and probes |
///   | the connection closed under a call made while healthy (an idle `timeout` of the server or of a load balancer, `CLIENT KILL`) | Redis failure for that call; the next call is the probe, at once, over the connection a `ConnectionManager` makes again (if Redis is down, that probe fails and the gate probes every `probe_interval`) |
///   | `OOM`, `READONLY`, `NOREPLICAS`, `BUSY`, `LOADING`, `MASTERDOWN`, `TRYAGAIN`, `CLUSTERDOWN`, `MISCONF` (it refuses writes or is not serving) | Redis failure, as above |
///   | any other error (a script error, `CROSSSLOT`, a reply of the wrong shape) | Redis failure, as above |
///   | `WRONGTYPE` on one key, or a value that is not a state the script can read (short, not numbers, NaN, infinite, out of range) | [`GateError::UnreadableKey`] for the requests on that key only; the gate stays healthy |
///
///   A gate is back on Redis when a probe over its connection succeeds, so a connection
///   that keeps reaching a server that refuses keeps it degraded. After a failover, a
///   primary demoted to replica keeps its clients and answers them `READONLY`, and a
///   `ConnectionManager` does not reconnect on `READONLY`: behind a name that moves to the
///   new primary (a DNS endpoint), the gate decides by its policy until that connection
///   closes. Sentinel closes the clients of the instance it demotes; elsewhere close them
///   (`CLIENT KILL TYPE normal` on the old primary), or connect through Sentinel or Cluster.
/// - **Runtime**: batches are sent by a task spawned on the runtime that built the gate. If
///   that runtime shuts down while the gate lives on, the next caller starts the task again
///   on its own runtime (logged, counted in `flowgate_gate_driver_restarts_total`); the
///   connection must still be usable there (a `ConnectionManager` reconnects, a
///   `MultiplexedConnection` made on the dead runtime fails like a dead Redis). A caller
///   whose batch was on its way to Redis when that runtime shut down is answered by the
///   failure policy, as if Redis had failed (the gate does not degrade): Redis may have
///   charged it, and asking again would charge it twice. So is a batched caller whose own
///   runtime is shutting down, where the task it starts again stops at once (its request
///   never went to Redis).
///
/// Works over any redis-rs async connection that is `Clone`: `MultiplexedConnection`, or
/// `ConnectionManager` (which reconnects by itself: use it in production).
///
/// # Metrics
///
/// Labelled by `name`: `flowgate_gate_decisions_total` by `outcome` (`allowed`, `rejected`,
/// `cached`, `policy`, `abandoned`, and `unreadable_key`: requests refused with
/// [`GateError::UnreadableKey`], counted as their caller gets the error; a caller that gave
/// up after its request went to Redis is counted by what Redis decided for it when the answer comes, batched or not (a call it
/// made alone is finished on the runtime without it), and a batched one whose own timeout
/// ended first is then counted under `policy` too; `abandoned` counts the requests sent to
/// Redis whose answer nothing was left to read, which Redis may have charged: a batch in
/// flight when the batch driver's runtime shut down (its callers still waiting are then
/// counted under `policy` too), a call given up outside any runtime or
/// left to finish on a runtime that shut down),
/// `flowgate_gate_redis_seconds` (latency), `flowgate_gate_batch_size`,
/// `flowgate_gate_failures_total` (failed calls to Redis, not callers: one per failed
/// script call, which is one per batch, or on a Cluster one per hash slot the batch spans;
/// and one more per batched caller whose own deadline passed before its batch's answer
/// reached it, as when the batch timed out at that same deadline),
/// `flowgate_gate_degraded` (1 while degraded), `flowgate_gate_transitions_total` by `to`
/// (`degraded`: Redis failed and the failure policy decides; `healthy`: a probe answered),
/// `flowgate_gate_driver_restarts_total`, and with [leases](RedisGateBuilder::lease)
/// `flowgate_gate_lease_unspent_total` (leased tokens, debited in Redis, never spent here:
/// their lease expired or they lapsed, the gate forgot its leases because Redis may have
/// lost its keys, or the gate was dropped holding them).
///
/// A request refused for what it asks ([`GateError::Cost`], [`GateError::InvalidKey`], and
/// the malformed lists of [`check_all`](RedisGate::check_all)) is not a decision and is not
/// counted here: Redis was not asked, nothing was charged, and its caller has the error (a
/// [`Gated`](crate::gate::Gated) stream counts its item in
/// `flowgate_gated_dropped_total{reason="gate_error"}`, the HTTP rate-limit layer counts the
/// request as `bad_request`). The three gates count alike.
pub struct RedisGate<C> {
    pub(super) inner: Arc<Inner<C>>,
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
            .field("timeout", &self.inner.backend.timeout())
            .field("policy", &self.inner.policy.as_str())
            .field("degraded", &self.inner.backend.is_degraded())
            .finish_non_exhaustive()
    }
}

/// Builds a [`RedisGate`]; from [`RedisGate::builder`].
pub struct RedisGateBuilder<C> {
    conn: C,
    limit: Limit,
    batch_size: usize,
    reject_cache: usize,
    cluster: bool,
    lease: u32,
    lease_ttl: Duration,
    lease_keys: usize,
    prefix: String,
    timeout: Duration,
    policy: FailurePolicy,
    probe_interval: Duration,
    name: Option<String>,
}

/// Leaves the connection out, as [`RedisGate`]'s `Debug` does: a connection may print
/// where Redis is and who logs in.
impl<C> fmt::Debug for RedisGateBuilder<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisGateBuilder")
            .field("name", &self.name)
            .field("limit", &self.limit)
            .field("prefix", &self.prefix)
            .field("batch_size", &self.batch_size)
            .field("reject_cache", &self.reject_cache)
            .field("cluster", &self.cluster)
            .field("lease", &self.lease)
            .field("lease_ttl", &self.lease_ttl)
            .field("lease_keys", &self.lease_keys)
            .field("timeout", &self.timeout)
            .field("policy", &self.policy)
            .field("probe_interval", &self.probe_interval)
            .finish_non_exhaustive()
    }
}

impl<C> RedisGateBuilder<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// The prefix of every key (default `"flowgate:"`), for [`check`](RedisGate::check) and
    /// [`check_all`](RedisGate::check_all) alike.
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

    /// How often to try Redis again after a failure (default 1 s); also how long a gate
    /// answers from its leases and rejection cache alone before it asks Redis again (it may
    /// have lost its keys unseen).
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
    /// added latency at low load. `1` turns batching off (one call per decision). The queue
    /// in front of the batches holds 4 batches; a caller that finds it full waits for room
    /// within its timeout.
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n;
        self
    }

    /// The connection is a Redis Cluster connection: batches are split per hash slot, one
    /// script call per slot, and `check_all` checks that its keys share a slot. Set by
    /// itself for a `redis::cluster_async::ClusterConnection` (`false` does not turn it off
    /// there: one script call over keys of several slots is refused with `CROSSSLOT`); set it
    /// for a connection of your own type that talks to a Cluster.
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
    /// can use, and tokens unused after `lease_ttl` are lost — or earlier: the `k`-th last
    /// token of a lease lapses `k` emission intervals before the bucket is full again (as
    /// Redis said when it granted them), since spent later it would pass on top of tokens
    /// Redis has refilled meanwhile and the fleet could exceed `burst + rate·span`. That
    /// schedule is timed by the monotonic clock moved on by any time the host slept (the
    /// wall clock running ahead of it: a laptop suspended, a VM paused), so tokens kept
    /// across a sleep lapse as they would have, instead of passing on top of the bucket
    /// Redis refilled meanwhile.
    /// Decisions served from a lease
    /// report the lease's remaining tokens and when the bucket in Redis is full again.
    /// Leases are dropped (their tokens lost) when Redis may have lost its keys, as the
    /// rejection cache is forgotten: spent then, they would pass on top of a bucket the
    /// new server holds full. Every leased token is spent here or counted in
    /// `flowgate_gate_lease_unspent_total` when the gate lets go of it (expired, lapsed,
    /// dropped for a Redis that may have lost its keys, or held when the gate is dropped):
    /// the under-admission the leases cost. A gate sees that only when it calls Redis: one that has had
    /// no answer from Redis for a `probe_interval` (all its traffic spent from leases) asks
    /// it before it spends another leased token, and spends it only if Redis cannot answer.
    /// `0` or `1` turns leases off.
    pub fn lease(mut self, n: u32) -> Self {
        self.lease = n;
        self
    }

    /// How long leased tokens may be spent locally (default 1 s; must not be zero).
    pub fn lease_ttl(mut self, ttl: Duration) -> Self {
        self.lease_ttl = crate::time::capped(ttl);
        self
    }

    /// How many keys may hold a lease at once, lease calls in flight included (default
    /// 10 000). A call that finds the map full takes no lease: it is decided by Redis for
    /// its own cost alone, so no token already debited in Redis is ever thrown away.
    pub fn lease_keys(mut self, keys: usize) -> Self {
        self.lease_keys = keys;
        self
    }

    /// How many keys the local rejection cache holds (default 10 000; `0` turns it off).
    pub fn reject_cache(mut self, keys: usize) -> Self {
        self.reject_cache = keys;
        self
    }

    /// Build the gate, start its batch driver on the current runtime, and try to load its
    /// scripts (a failure to load is not an error: a script is sent again with the first
    /// call that needs it).
    ///
    /// # Errors
    ///
    /// [`ConfigError`] on `gate.limit` when the limit cannot be computed exactly in Redis
    /// (a period that is not whole microseconds, or numbers too large); on `gate.timeout`,
    /// `gate.probe_interval`, `gate.batch_size`, `gate.lease_ttl` or `gate.lease_keys` when
    /// zero (the last two only with leases on); on `gate.lease` when leases are asked of a
    /// limit that is not a token bucket.
    ///
    /// # Panics
    ///
    /// Outside a tokio runtime (it spawns the batch driver).
    pub async fn build(self) -> Result<RedisGate<C>, ConfigError> {
        let eval = LimitScript::new(self.limit)?;
        // A batch over a cluster connection mixes slots unless split: refused as a whole.
        let cluster = self.cluster || is_cluster_connection::<C>();
        if self.timeout.is_zero() {
            return Err(ConfigError::zero_duration("gate.timeout"));
        }
        if self.probe_interval.is_zero() {
            return Err(ConfigError::zero_duration("gate.probe_interval"));
        }
        if self.batch_size == 0 {
            return Err(ConfigError::zero("gate.batch_size"));
        }
        let labels = Labels::new(self.name.as_deref());
        let leases = match (self.lease > 1, &self.limit) {
            (false, _) => None,
            (true, Limit::TokenBucket(quota)) => {
                if self.lease_ttl.is_zero() {
                    return Err(ConfigError::zero_duration("gate.lease_ttl"));
                }
                if self.lease_keys == 0 {
                    return Err(ConfigError::zero("gate.lease_keys"));
                }
                Some(Arc::new(Leases::new(
                    self.lease,
                    self.lease_ttl,
                    quota.rate(),
                    self.lease_keys,
                    labels.counter(names::LEASE_UNSPENT, &[]),
                )))
            }
            (true, _) => {
                return Err(ConfigError::new(
                    "gate.lease",
                    ConfigErrorKind::Inconsistent,
                    "token leases need a token bucket limit",
                ));
            }
        };
        let all_script = redis::Script::new(scripts::TOKEN_BUCKET_ALL);
        let lease_script = redis::Script::new(scripts::TOKEN_BUCKET_LEASE);
        // Every script the gate may call: a first call that met NOSCRIPT would read as Redis
        // having lost its state, and forget the rejections cached and the leases taken.
        let mut conn = self.conn.clone();
        let load = async {
            let lease = leases.as_ref().map(|_| &lease_script);
            for script in [Some(&eval.script), Some(&all_script), lease]
                .into_iter()
                .flatten()
            {
                if script.load_async(&mut conn).await.is_err() {
                    break;
                }
            }
        };
        let _ = tokio::time::timeout(self.timeout.max(Duration::from_millis(500)), load).await;
        let decisions = |outcome| labels.counter(names::DECISIONS, &[("outcome", outcome)]);
        let outcomes = Arc::new(Outcomes {
            allowed: decisions("allowed"),
            rejected: decisions("rejected"),
            abandoned: decisions("abandoned"),
            cache: RejectCache::new(self.reject_cache, self.limit),
            prefix: self.prefix.len(),
        });
        // Redis may have lost its keys (restarted empty, failed over: back after a failure,
        // or without its scripts): the rejections cached before would refuse what it admits,
        // and tokens leased before would pass on top of the buckets it holds full again.
        let forget = Arc::clone(&outcomes);
        let forget_leases = leases.clone();
        let backend = Arc::new(
            Backend::new(
                self.conn,
                self.timeout,
                self.probe_interval,
                self.name.clone(),
                self.policy.as_str(),
                &labels,
            )
            .on_reset(move || {
                forget.cache.clear();
                if let Some(leases) = &forget_leases {
                    leases.clear();
                }
            }),
        );
        let batcher = (self.batch_size > 1).then(|| {
            let driver = Driver {
                calls: Default::default(),
                backend: backend.clone(),
                eval: eval.clone(),
                max_batch: self.batch_size,
                batch_size: labels.histogram(names::BATCH_SIZE, &[]),
                outcomes: Arc::clone(&outcomes),
                cluster,
            };
            Batcher::start(driver, labels.counter(names::DRIVER_RESTARTS, &[]))
        });
        Ok(RedisGate {
            inner: Arc::new(Inner {
                backend,
                batcher,
                eval,
                all_script,
                cluster,
                leases,
                lease_script,
                prefix: self.prefix,
                policy: self.policy,
                metrics: Metrics {
                    cached: decisions("cached"),
                    outcomes,
                    by_policy: decisions("policy"),
                    unreadable: decisions("unreadable_key"),
                },
                name: self.name,
            }),
        })
    }
}

/// What a request gets without Redis.
enum Local {
    /// Its answer: a malformed request, a leased token, a cached rejection.
    Answer(Result<Decision, GateError>),
    /// Only Redis can decide it. `silent`: the gate has heard nothing from Redis for a
    /// probe interval (it may have lost its keys unseen), so Redis is asked before any
    /// leased token or cached rejection is used; they answer if Redis cannot.
    Ask { silent: bool },
}

/// What a request finds held here.
enum Held {
    /// A leased token, spent.
    Leased(Decision),
    /// A cached rejection.
    Cached(Decision),
}

/// Whether `C` is redis-rs's async Cluster connection, whose calls must each stay within one
/// hash slot.
fn is_cluster_connection<C: 'static>() -> bool {
    std::any::TypeId::of::<C>() == std::any::TypeId::of::<redis::cluster_async::ClusterConnection>()
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
            lease_keys: 10_000,
            prefix: "flowgate:".into(),
            timeout: Duration::from_millis(50),
            policy: FailurePolicy::Error,
            probe_interval: Duration::from_secs(1),
            name: None,
        }
    }

    /// The `name` label of this gate's metrics, if it was given one.
    pub fn name(&self) -> Option<&str> {
        self.inner.name.as_deref()
    }

    /// Whether the gate is currently deciding by its failure policy.
    pub fn is_degraded(&self) -> bool {
        self.inner.backend.is_degraded()
    }

    /// The Redis key a gate key is stored under.
    pub fn redis_key(&self, key: &str) -> String {
        let prefix = &self.inner.prefix;
        let mut k = String::with_capacity(prefix.len() + key.len());
        k.push_str(prefix);
        k.push_str(key);
        k
    }

    /// Decide one request now: admitted (and consumed) or rejected with a `retry_after`.
    /// Async because deciding may ask Redis; it never waits for capacity.
    ///
    /// # Errors
    ///
    /// [`GateError::Cost`] (a cost of zero or above the capacity) and
    /// [`GateError::InvalidKey`] for bad requests (Redis is not called);
    /// [`GateError::UnreadableKey`] for a key whose value in Redis the gate cannot read (only
    /// that request fails, the gate does not degrade); under [`FailurePolicy::Error`],
    /// [`GateError::Backend`] and [`GateError::Timeout`]; under [`FailurePolicy::Fallback`],
    /// the errors of its `MemoryGate` while it decides ([`GateError::KeyspaceFull`], or
    /// [`GateError::Cost`] for a cost above its own capacity).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before its request is on its way to Redis (never polled, or
    /// queued for a batch not sent yet) charges nothing. After, Redis decides the request
    /// all the same (it may be charged; never over-admission), and what follows from the
    /// answer happens without the caller: the decision is counted, a rejection cached, a
    /// lease kept for the next callers. A call made alone (batching off, nothing else in
    /// flight, a lease call) goes on as a task on the current runtime, bounded by the
    /// timeout; a batched one is answered by the batch driver. A failure is not decided by
    /// the failure policy for a caller that is gone.
    pub async fn check(&self, key: &str, cost: u32) -> Result<Decision, GateError> {
        let now = Instant::now();
        let silent = match self.check_local_at(key, cost, now) {
            Local::Answer(answer) => return answer,
            Local::Ask { silent } => silent,
        };
        let inner = &*self.inner;
        let reply = match inner.backend.admit(now) {
            Err(e) => Err(e),
            Ok(()) if inner.leases.is_some() => self.decide_lease(key, cost, now).await,
            Ok(()) => self.decide(key, cost, now).await,
        };
        match reply {
            // Counted, and a rejection cached, where Redis's answer was read (see `decided`).
            Ok(decision) => Ok(decision),
            Err(CallError::Request(e)) => inner.metrics.counted(Err(e)),
            Err(CallError::Backend { error, until_probe }) => {
                // Sent to see whether what is held here still holds, and Redis could not say:
                // it stands (unless Redis was found to have lost its keys meanwhile).
                if silent && let Some(held) = self.held(key, cost, Instant::now()) {
                    return Ok(self.answer_held(held));
                }
                self.by_policy(key, cost, until_probe, error)
            }
        }
    }

    /// A leased token (spent) or else a cached rejection for `cost` on `key` at `now`, not
    /// counted yet (see [`answer_held`](Self::answer_held)).
    fn held(&self, key: &str, cost: u32, now: Instant) -> Option<Held> {
        let inner = &*self.inner;
        // Tokens leased here are already paid for: spend them before any cached rejection
        // (taken by a concurrent call) can refuse the request.
        if let Some(decision) = inner.leases.as_ref().and_then(|l| l.spend(key, cost, now)) {
            return Some(Held::Leased(decision));
        }
        let decision = inner
            .metrics
            .outcomes
            .cache
            .check(key, cost, now, SystemTime::now)?;
        Some(Held::Cached(decision))
    }

    /// What `held` found, counted: the request's decision.
    fn answer_held(&self, held: Held) -> Decision {
        let metrics = &self.inner.metrics;
        match held {
            Held::Leased(decision) => {
                metrics.outcomes.allowed.increment(1);
                decision
            }
            Held::Cached(decision) => {
                metrics.cached.increment(1);
                decision
            }
        }
    }

    /// What [`check`](RedisGate::check) decides without Redis: a malformed request, a
    /// leased token, a cached rejection. [`Local::Ask`]: only Redis can decide.
    fn check_local_at(&self, key: &str, cost: u32, now: Instant) -> Local {
        if let Err(e) = check_key(key) {
            return Local::Answer(Err(e));
        }
        if let Err(e) = self.inner.eval.limit.check_cost(cost) {
            return Local::Answer(Err(e.into()));
        }
        let backend = &self.inner.backend;
        // Redis may have lost its keys (restarted empty) with no call of this gate to see
        // it, when all its traffic is answered here (leased tokens, cached rejections):
        // once it has heard nothing from Redis for a probe interval (or a probe is due),
        // the request goes there first. (A cached rejection is looked up first: most
        // requests have none, and need not read the gate's health.)
        if self.inner.leases.is_some() && backend.silent(now) {
            return Local::Ask { silent: true };
        }
        match self.held(key, cost, now) {
            None => Local::Ask { silent: false },
            Some(Held::Cached(_)) if backend.silent(now) => Local::Ask { silent: true },
            Some(held) => Local::Answer(Ok(self.answer_held(held))),
        }
    }

    /// [`Outcomes::decided`]: counted, a rejection cached.
    fn decided(&self, key: &str, cost: u32, sent: Instant, decision: &Decision) {
        self.inner
            .metrics
            .outcomes
            .decided(key, cost, sent, decision);
    }

    /// One decision in a script call of its own, bounded by what is left of the timeout, and
    /// [`decided`](RedisGate::decided) when Redis answers, even if the caller has given up by
    /// then (the call is then finished on the runtime). `claim`: the batcher's count of calls
    /// in flight, held until the call ends.
    fn call_one(
        &self,
        key: &str,
        cost: u32,
        started: Instant,
        claim: Option<Call>,
    ) -> Finish<impl Future<Output = Result<Decision, CallError>> + Send + use<C>> {
        let gate = self.clone();
        let redis_key = self.redis_key(key);
        Finish::new(async move {
            let _claim = claim;
            let inner = &*gate.inner;
            let requests = std::iter::once((redis_key.as_str(), cost));
            let within = inner.backend.timeout().saturating_sub(started.elapsed());
            let unread = inner.metrics.outcomes.unread(1);
            let decided = inner.eval.decide(&inner.backend, requests, within).await;
            unread.read();
            let decision = decided?
                .pop()
                .expect("one decision per request")
                .map_err(CallError::Request)?;
            gate.decided(&redis_key[inner.prefix.len()..], cost, started, &decision);
            Ok(decision)
        })
    }

    /// One decision from Redis, batched or alone, bounded by the timeout from `started`.
    async fn decide(&self, key: &str, cost: u32, started: Instant) -> Result<Decision, CallError> {
        let inner = &*self.inner;
        let batcher = match inner.batcher.as_ref() {
            // Nothing in flight: call Redis from here, without the hop through the driver
            // (no added latency at low load); callers arriving meanwhile batch behind it.
            Some(batcher) => match batcher.idle_call() {
                Some(claim) => return self.call_one(key, cost, started, Some(claim)).await,
                None => batcher,
            },
            None => return self.call_one(key, cost, started, None).await,
        };
        // Calls in flight: join the next batch.
        let timeout = inner.backend.timeout();
        let (reply, answer) = oneshot::channel();
        let request = Request {
            key: self.redis_key(key),
            cost,
            started,
            deadline: started + timeout,
            reply,
        };
        batcher.submit(request).await?;
        // The driver answers by the deadline (its call's timeout ends there); the timer here
        // is the backstop for a driver whose runtime is not being driven.
        let reply = match tokio::time::timeout_at((started + timeout).into(), answer).await {
            Ok(Ok(answer)) => answer.read(),
            // The driver went away with the request before sending it (its runtime shut
            // down): decide it here. (One it had sent is answered with a failure instead.)
            Ok(Err(_)) => return self.call_one(key, cost, started, None).await,
            Err(_) => Err(inner.backend.fail(GateError::Timeout(timeout))),
        };
        // Read here: a caller that gives up before this point leaves its answer to count it.
        if let Ok(decision) = &reply {
            self.decided(key, cost, started, decision);
        }
        reply
    }

    /// Take a lease of up to `lease` tokens (at least `cost`); spend `cost`, keep the rest.
    /// With the lease map full, decide `cost` alone instead.
    async fn decide_lease(
        &self,
        key: &str,
        cost: u32,
        started: Instant,
    ) -> Result<Decision, CallError> {
        match self.call_lease(key, cost, started).await {
            Some(reply) => reply,
            None => self.decide(key, cost, started).await,
        }
    }

    /// The lease call of [`decide_lease`](RedisGate::decide_lease), in a script call of its
    /// own, finished (the lease kept, the decision counted) even if the caller gives up
    /// meanwhile. `None`, before anything is sent, when it takes no lease: the map is full.
    fn call_lease(
        &self,
        key: &str,
        cost: u32,
        started: Instant,
    ) -> Finish<impl Future<Output = Option<Result<Decision, CallError>>> + Send + use<C>> {
        let gate = self.clone();
        let redis_key = self.redis_key(key);
        Finish::new(async move {
            let inner = &*gate.inner;
            let leases = inner.leases.as_ref()?;
            // Leases are only built for token buckets.
            let (Limit::TokenBucket(quota), Some(place)) =
                (inner.eval.limit, leases.place(started))
            else {
                return None;
            };
            let unread = inner.metrics.outcomes.unread(1);
            let reply = gate
                .lease(leases, place, quota, &redis_key, cost, started)
                .await;
            unread.read();
            if let Ok(decision) = &reply {
                gate.decided(&redis_key[inner.prefix.len()..], cost, started, decision);
            }
            Some(reply)
        })
    }

    /// Ask Redis for a lease on `redis_key` (the gate's bucket of `quota`), kept in `place`.
    async fn lease(
        &self,
        leases: &Leases,
        place: Place<'_>,
        quota: Quota,
        redis_key: &str,
        cost: u32,
        started: Instant,
    ) -> Result<Decision, CallError> {
        let inner = &*self.inner;
        let mut cmd = scripts::evalsha(&inner.lease_script, 1);
        cmd.arg(redis_key);
        inner.eval.add_args(&mut cmd, [cost]);
        cmd.arg(leases.size.max(cost));
        let within = inner.backend.timeout().saturating_sub(started.elapsed());
        let r = inner
            .backend
            .eval(&inner.lease_script, &cmd, 5, within)
            .await?;
        if let Some(e) = key_failure(r[0]) {
            return Err(CallError::Request(e));
        }
        let granted = u32::try_from(r[0]).unwrap_or(0);
        if granted < cost {
            return Ok(decision_from(&[0, r[1], r[2], r[3], r[4]]));
        }
        let limit = u64::from(quota.burst_size());
        let reset_after = Duration::from_micros(u64::try_from(r[4]).unwrap_or(0));
        let key = &redis_key[inner.prefix.len()..];
        leases.keep(place, key, granted - cost, limit, reset_after);
        Ok(decision_from(&[
            1,
            r[1],
            r[2] + i64::from(granted - cost),
            0,
            r[4],
        ]))
    }

    /// Keys held by the local rejection cache.
    pub fn cached_rejections(&self) -> usize {
        self.inner.metrics.outcomes.cache.len()
    }

    /// Keys holding a lease now.
    pub fn leased_keys(&self) -> usize {
        self.inner.leases.as_ref().map_or(0, |l| l.len())
    }

    pub(super) fn by_policy(
        &self,
        key: &str,
        cost: u32,
        until_probe: Duration,
        error: Option<GateError>,
    ) -> Result<Decision, GateError> {
        let inner = &*self.inner;
        inner.metrics.by_policy.increment(1);
        inner.policy.decide(key, cost, until_probe, error)
    }
}

impl<C> Gate for RedisGate<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// [`RedisGate::check`].
    fn check<'a>(&'a self, key: &'a str, cost: u32) -> GateFuture<'a> {
        Box::pin(RedisGate::check(self, key, cost))
    }

    /// What [`RedisGate::check`] decides without Redis: a malformed request, a leased
    /// token, a cached rejection.
    fn check_local(&self, key: &str, cost: u32) -> Option<Result<Decision, GateError>> {
        match self.check_local_at(key, cost, Instant::now()) {
            Local::Answer(answer) => Some(answer),
            Local::Ask { .. } => None,
        }
    }

    /// [`RedisGate::check_all`].
    fn check_all<'a>(
        &'a self,
        limits: &'a [(&'a str, Quota)],
        cost: u32,
    ) -> GateFuture<'a, Vec<Decision>> {
        Box::pin(RedisGate::check_all(self, limits, cost))
    }

    /// Each quota's period a whole number of microseconds, and small enough for exact
    /// arithmetic in Redis (what [`check_all`](RedisGate::check_all) refuses per call
    /// with [`GateError::InvalidQuota`]); under [`FailurePolicy::Fallback`], also what its
    /// `MemoryGate` can decide, since it decides them while Redis fails.
    fn validate_quotas(&self, quotas: &[Quota]) -> Result<(), crate::ConfigError> {
        quotas
            .iter()
            .try_for_each(|&q| Limit::TokenBucket(q).redis_params().map(drop))?;
        match &self.inner.policy {
            FailurePolicy::Fallback(gate) => gate.validate_quotas(quotas),
            _ => Ok(()),
        }
    }

    /// [`validate_quotas`](Gate::validate_quotas); under [`FailurePolicy::Fallback`], the
    /// quotas are registered on its `MemoryGate` (which refuses them past its 16 distinct
    /// quotas together with those registered on it, by layers over this gate or over it);
    /// otherwise nothing is registered (Redis holds any number of quotas).
    fn register_quotas(&self, quotas: &[Quota]) -> Result<Registration, crate::ConfigError> {
        self.validate_quotas(quotas)?;
        match &self.inner.policy {
            FailurePolicy::Fallback(gate) => gate.register_quotas(quotas),
            _ => Ok(Registration::none()),
        }
    }

    /// One Redis key is one bucket whatever the quota: the gate's state, shared by its
    /// clones, names its keys.
    fn key_space(&self) -> Option<usize> {
        Some(Arc::as_ptr(&self.inner).addr())
    }

    fn limit(&self) -> Limit {
        self.inner.eval.limit
    }
}
