//! `RedisGate`: one limit across a fleet, decided atomically in Redis.
//!
//! Here the gate and its core path to Redis; its builder is in `builder`, its failure policy
//! in `policy`, and what it answers without Redis (leased tokens, cached rejections), with
//! the lease path, in `local`.

mod builder;
mod local;
mod policy;

use std::fmt;
// Real time, not tokio's (pausable) clock: the cache, leases and probes follow Redis, whose
// clock never pauses.
use std::time::{Duration, Instant};

use redis::aio::ConnectionLike;
use tokio::sync::oneshot;

use crate::decision::Decision;
use crate::gate::api::{Gate, GateFuture, HeldDecision};
use crate::gate::backend::{Backend, CallError, Probe};
use crate::gate::batch::{Batcher, Call, Outcomes, Request};
use crate::gate::error::GateError;
use crate::gate::finish::Finish;
use crate::gate::lease::Leases;
use crate::gate::limit::Limit;
use crate::gate::quotas::Registration;
use crate::gate::scripts::{LimitScript, Script};
use crate::gate::slot::fixed_slot;
use crate::metrics::Counter;
use crate::rate::Quota;
use crate::sync::{Arc, Panics};

pub use builder::RedisGateBuilder;
use local::Local;
pub use policy::FailurePolicy;

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
    pub(super) all_script: &'static Script,
    pub(super) cluster: bool,
    /// Shared with the backend's reset, which forgets them.
    leases: Option<Arc<Leases>>,
    lease_script: &'static Script,
    prefix: String,
    pub(super) policy: FailurePolicy,
    name: Option<String>,
    pub(super) metrics: Metrics,
}

/// One limit across every instance of a service, decided by one atomic Lua script per
/// request in Redis.
///
/// - **Atomic and exact**: each decision is one script (`EVALSHA`, sent again with its
///   source on `NOSCRIPT`: after a restart or failover, or on a Cluster node new to it)
///   running the same integer math as [`limit`](crate::limit) in microseconds; a rejected
///   call consumes nothing.
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
///   carry over, each gate counting them for its own window (a gate that writes a key or
///   rejects on it makes it last as long as it counts it). But a gate of the shorter window
///   drops what lies beyond its window whenever it admits (it rolls the sliding window's
///   counts on, trims the log) and sets the key's TTL by that window: on a key both use, a
///   gate of the longer window may admit up to its limit again after each admission of the
///   shorter one. The algorithm cannot change over a prefix: each gate refuses the keys the
///   other wrote with [`GateError::UnreadableKey`] (under every failure policy) until they
///   expire, and a key the old gates keep using stays. Give a new algorithm a new prefix;
///   until the old gates are gone the fleet then enforces the two limits apart, and may
///   admit up to both together, as it does when only the prefix changes.
/// - **Redis restarted empty** (no persistence), or flushed: every key's state is gone, so
///   each key admits a whole burst again, on top of what it admitted before. After a
///   restart the gate loads its scripts again by itself (on `NOSCRIPT`), and forgets the
///   rejections it cached and the tokens it leased on the old server's word (below).
///   `FLUSHALL` and `FLUSHDB` leave the script cache in place, so the gate cannot tell:
///   its cached rejections stand until their `retry_after` (refusing what Redis would
///   admit), and its leased tokens are spent until they expire or lapse, on top of the
///   emptied buckets (what an instance holds: up to `n − 1` per key and lease call, for at
///   most a `lease_ttl`). Run `SCRIPT FLUSH` with them: each gate then forgets both at its
///   next call to Redis (within a `probe_interval`), as after a restart.
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
///   gate is back on Redis after a failure, and when Redis no longer has the gate's scripts
///   (once for the calls that find that together: what a call took from the server since it
///   forgot is kept); a rejection whose request was sent before the gate forgot, and
///   answered only then, is not cached either.
///   A gate sees neither without calling Redis: one that has had no answer from Redis for a
///   `probe_interval` (all its traffic answered from the cache, a hot key over an hourly
///   limit, say) sends the next request on a cached key to Redis, and keeps the rejection
///   if Redis cannot answer. Bounded (`reject_cache`, default 10 000 keys).
/// - **Failure policy**: every decision is bounded by `timeout` (default 50 ms). On an error
///   or timeout the [`FailurePolicy`] decides (a request that timed out was sent: a Redis
///   that was only slow or paused still runs its script when it resumes and charges it,
///   whatever the policy answered); after a failure Redis is probed at most every
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
/// Redis whose answer nothing was left to read, which Redis may have charged (a lease
/// call: its whole lease, see [`lease`](RedisGateBuilder::lease)): a batch in
/// flight when the batch driver's runtime shut down (its callers still waiting are then
/// counted under `policy` too), a call given up outside any runtime or
/// left to finish on a runtime that shut down),
/// `flowgate_gate_redis_seconds` (latency), `flowgate_gate_batch_size`,
/// `flowgate_gate_failures_total` (failed calls to Redis, not callers: one per failed
/// script call, which is one per batch, or on a Cluster one per key the batch spans,
/// and one per batch whose requests ran out of time in the queue before it was sent; and
/// one more per batched caller whose own deadline passed before its batch's answer
/// reached it, as when the batch timed out at that same deadline, or before its request
/// found room in a full queue: see [`batch_size`](RedisGateBuilder::batch_size)),
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

impl<C> RedisGate<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// A builder for a gate enforcing `limit` per key through `conn`.
    pub fn builder(conn: C, limit: Limit) -> RedisGateBuilder<C> {
        RedisGateBuilder::new(conn, limit)
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
    /// [`GateError::Backend`] and [`GateError::Timeout`] from a call that asked Redis, and
    /// [`GateError::Degraded`] from one made while the gate waits for its next probe; under
    /// [`FailurePolicy::Fallback`],
    /// the errors of its `MemoryGate` while it decides ([`GateError::KeyspaceFull`], or
    /// [`GateError::Cost`] for a cost above its own capacity).
    ///
    /// # Panics
    ///
    /// When it calls Redis polled outside a tokio runtime with timers (`enable_time`; a
    /// `futures::executor::block_on` on a thread of its own has none), unless the timeout is
    /// `Duration::MAX`: the timeout runs on tokio's timers (as redis-rs's own response
    /// timeout does). What it answers without Redis (a malformed request, a leased token, a
    /// cached rejection) needs no runtime.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before its request is on its way to Redis (never polled, or
    /// queued for a batch not sent yet) charges nothing, and the probe of a degraded gate
    /// it was to make is left to the next call (a queued one once the batch driver takes it
    /// from its queue: as soon as the driver runs, or, with 4 batches in flight, when one
    /// of them ends, within the timeout; the calls meanwhile are decided by the policy as
    /// when the probe is in flight). After, Redis decides the request
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
            Local::Held(held) => return Ok(self.answer_held(held)),
            Local::Ask { silent } => silent,
        };
        let inner = &*self.inner;
        let reply = match inner.backend.admit_probe(now) {
            Err(e) => Err(e),
            Ok(probe) if inner.leases.is_some() => {
                self.decide_lease(key, cost, now, probe, silent).await
            }
            Ok(probe) => self.decide(key, cost, now, probe).await,
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

    /// One decision in a script call of its own, bounded by what is left of the timeout, and
    /// [`decided`](RedisGate::decided) when Redis answers, even if the caller has given up by
    /// then (the call is then finished on the runtime). `claim`: the batcher's count of calls
    /// in flight, held until the call ends; `probe`: the probe this call is, sent once the
    /// call is polled.
    fn call_one(
        &self,
        key: &str,
        cost: u32,
        started: Instant,
        claim: Option<Call>,
        probe: Option<Probe>,
    ) -> Finish<impl Future<Output = Result<Decision, CallError>> + Send + use<C>> {
        let gate = self.clone();
        let redis_key = self.redis_key(key);
        Finish::new(async move {
            let _claim = claim;
            if let Some(probe) = probe {
                probe.sent();
            }
            let inner = &*gate.inner;
            let requests = std::iter::once((redis_key.as_str(), cost));
            let within = inner.backend.timeout().saturating_sub(started.elapsed());
            let unread = inner.metrics.outcomes.unread(1);
            let decided = inner.eval.decide(&inner.backend, requests, within).await;
            unread.read();
            // The latency is recorded last, once the decision is counted.
            let (mut decided, seen, _latency) = decided?;
            let decision = decided
                .pop()
                .expect("one decision per request")
                .map_err(CallError::Request)?;
            let key = &redis_key[inner.prefix.len()..];
            gate.decided(key, cost, (started, seen), &decision);
            Ok(decision)
        })
    }

    /// One decision from Redis, batched or alone, bounded by the timeout from `started`.
    /// `probe`: the probe of a degraded gate this call is, given back if the caller gives up
    /// before its request is sent.
    async fn decide(
        &self,
        key: &str,
        cost: u32,
        started: Instant,
        probe: Option<Probe>,
    ) -> Result<Decision, CallError> {
        let inner = &*self.inner;
        let batcher = match inner.batcher.as_ref() {
            // Nothing in flight: call Redis from here, without the hop through the driver
            // (no added latency at low load); callers arriving meanwhile batch behind it.
            Some(batcher) => match batcher.idle_call() {
                Some(claim) => return self.call_one(key, cost, started, Some(claim), probe).await,
                None => batcher,
            },
            None => return self.call_one(key, cost, started, None, probe).await,
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
            probe,
        };
        batcher.submit(request).await?;
        // The driver answers by the deadline (its call's timeout ends there); the timer here
        // is the backstop for a driver whose runtime is not being driven.
        let (reply, seen) = match inner.backend.until(started + timeout, answer).await {
            Some(Ok(answer)) => answer.read(),
            // The driver went away with the request before sending it (its runtime shut
            // down): decide it here. (One it had sent is answered with a failure instead.)
            Some(Err(_)) => return self.call_one(key, cost, started, None, None).await,
            None => return Err(inner.backend.fail(GateError::Timeout(timeout))),
        };
        // Read here: a caller that gives up before this point leaves its answer to count it.
        if let Ok(decision) = &reply {
            self.decided(key, cost, (started, seen), decision);
        }
        reply
    }

    /// Keys held by the local rejection cache: a rejection whose `retry_after` has passed
    /// counts until the gate next looks at its key (a request on it, or room made in a full
    /// cache).
    pub fn cached_rejections(&self) -> usize {
        self.inner.metrics.outcomes.cache.len()
    }

    /// Keys holding a lease: a lease that has run out (expired, or its tokens lapsed) counts
    /// until the gate next looks at its key (a request on it, or room made in a full map).
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
            Local::Held(held) => Some(Ok(self.answer_held(held))),
            Local::Ask { .. } => None,
        }
    }

    /// [`check_local`](Gate::check_local), with the panic of a metrics recorder that panics
    /// as it counts a leased token spent (or a cached rejection) held beside the decision.
    fn check_local_held(&self, key: &str, cost: u32) -> Option<HeldDecision> {
        match self.check_local_at(key, cost, Instant::now()) {
            Local::Answer(answer) => Some((answer, Panics::new())),
            Local::Held(held) => {
                let mut panics = Panics::new();
                let decision =
                    self.answer_held_with(held, |counter| panics.run(|| counter.increment(1)));
                Some((Ok(decision), panics))
            }
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

    /// On a Cluster, keys beginning with `heads` (after the gate's prefix) share a slot
    /// whatever follows only if each start holds a whole hash tag, all of one slot: what
    /// [`check_all`](RedisGate::check_all) needs, or it refuses the call (`CrossSlot`).
    fn validate_key_heads(&self, heads: &[&str]) -> Result<(), crate::ConfigError> {
        if !self.inner.cluster || heads.len() < 2 {
            return Ok(());
        }
        let slot_of = |head: &str| fixed_slot(self.redis_key(head).as_bytes());
        let first = slot_of(heads[0]);
        if first.is_some() && heads[1..].iter().all(|h| slot_of(h) == first) {
            return Ok(());
        }
        Err(crate::ConfigError::new(
            "gate.cluster",
            crate::ConfigErrorKind::Inconsistent,
            format!(
                "on Redis Cluster the keys of one check_all must share a hash slot, and keys \
                 beginning with {heads:?} (after the gate's prefix {:?}) do not all carry a \
                 hash tag of one slot",
                self.inner.prefix
            ),
        ))
    }

    fn limit(&self) -> Limit {
        self.inner.eval.limit
    }
}
