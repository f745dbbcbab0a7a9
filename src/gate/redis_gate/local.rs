//! What a `RedisGate` answers without Redis (leased tokens, cached rejections), and the
//! lease path that fills its leases.

// Real time, not tokio's (pausable) clock: the cache, leases and probes follow Redis, whose
// clock never pauses.
use std::time::{Duration, Instant, SystemTime};

use redis::aio::ConnectionLike;

use crate::decision::Decision;
use crate::gate::backend::{CallError, Latency, Probe, key_failure};
use crate::gate::error::{GateError, check_key};
use crate::gate::finish::Finish;
use crate::gate::lease::{Leases, Place};
use crate::gate::limit::Limit;
use crate::gate::scripts::{ScriptCall, decision_from};
use crate::metrics::Counter;
use crate::rate::Quota;

use super::RedisGate;

/// What a request gets without Redis.
pub(super) enum Local {
    /// Its answer: a malformed request.
    Answer(Result<Decision, GateError>),
    /// Its decision, held here: a leased token (spent) or a cached rejection, not counted
    /// yet ([`answer_held`](RedisGate::answer_held)).
    Held(Held),
    /// Only Redis can decide it. `silent`: the gate has heard nothing from Redis for a
    /// probe interval (it may have lost its keys unseen), so Redis is asked before any
    /// leased token or cached rejection is used; they answer if Redis cannot (and leased
    /// tokens, if Redis still holds the gate's state: see
    /// [`decide_lease`](RedisGate::decide_lease)).
    Ask { silent: bool },
}

/// What a request finds held here.
pub(super) enum Held {
    /// A leased token, spent.
    Leased(Decision),
    /// A cached rejection.
    Cached(Decision),
}

impl<C> RedisGate<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// A leased token (spent) or else a cached rejection for `cost` on `key` at `now`, not
    /// counted yet (see [`answer_held`](Self::answer_held)).
    pub(super) fn held(&self, key: &str, cost: u32, now: Instant) -> Option<Held> {
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
    pub(super) fn answer_held(&self, held: Held) -> Decision {
        self.answer_held_with(held, |counter| counter.increment(1))
    }

    /// What `held` found, with `count` called with its counter: the request's decision.
    pub(super) fn answer_held_with(&self, held: Held, count: impl FnOnce(&Counter)) -> Decision {
        let metrics = &self.inner.metrics;
        let (counter, decision) = match held {
            Held::Leased(decision) => (&metrics.outcomes.allowed, decision),
            Held::Cached(decision) => (&metrics.cached, decision),
        };
        count(counter);
        decision
    }

    /// What [`check`](RedisGate::check) decides without Redis: a malformed request, a
    /// leased token, a cached rejection (held, not counted yet). [`Local::Ask`]: only
    /// Redis can decide.
    pub(super) fn check_local_at(&self, key: &str, cost: u32, now: Instant) -> Local {
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
            Some(held) => Local::Held(held),
        }
    }

    /// [`Outcomes::decided`](crate::gate::batch::Outcomes::decided): counted, a rejection
    /// cached (`sent`: when the request was sent, and the backend's count of resets then).
    pub(super) fn decided(&self, key: &str, cost: u32, sent: (Instant, u64), decision: &Decision) {
        self.inner
            .metrics
            .outcomes
            .decided(key, cost, sent, decision);
    }

    /// Take a lease of up to `lease` tokens (at least `cost`); spend `cost`, keep the rest.
    /// With the lease map full, or for the probe of a degraded gate (`probe`, see
    /// [`decide`](RedisGate::decide)), decide `cost` alone instead. `silent`: the gate
    /// has heard nothing from Redis for a probe interval; if `key` holds `cost` leased
    /// tokens, Redis is asked (taking nothing) whether it still holds the gate's state, and
    /// they are spent if it does. (A new lease beside them left them unspent: an instance
    /// whose requests came more than a probe interval apart took a lease for each, held
    /// the whole quota, and was refused by the bucket it had emptied itself.)
    pub(super) async fn decide_lease(
        &self,
        key: &str,
        cost: u32,
        started: Instant,
        probe: Option<Probe>,
        silent: bool,
    ) -> Result<Decision, CallError> {
        let mut probe = probe;
        if let Some(leases) = &self.inner.leases
            && silent
            && leases.holds(key, cost, started)
        {
            self.touch(key, started, probe.take()).await?;
            // Still there unless Redis was found to have lost its state meanwhile (a reset
            // lets go of every lease): then a lease is taken from the server as it is now.
            if let Some(decision) = leases.spend(key, cost, Instant::now()) {
                return Ok(self.answer_held(Held::Leased(decision)));
            }
        }
        // The probe of a degraded gate takes no lease: a Redis that is paused (or slow)
        // runs it when it resumes, after the probe timed out, and a lease would be debited
        // there for nobody, once per probe interval of the outage. Decided for its cost,
        // as on a gate without leases.
        if probe.is_some() {
            return self.decide(key, cost, started, probe).await;
        }
        match self.call_lease(key, cost, started).await {
            Some(reply) => reply,
            None => self.decide(key, cost, started, None).await,
        }
    }

    /// The lease call of [`decide_lease`](RedisGate::decide_lease), in a script call of its
    /// own, finished (the lease kept, the decision counted) even if the caller gives up
    /// meanwhile. `None`, before anything is sent, when it takes no lease (the map is full).
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
            // Leases are only built for token buckets.
            let (Some(leases), Limit::TokenBucket(quota)) = (&inner.leases, inner.eval.limit)
            else {
                return None;
            };
            let place = leases.place(started)?;
            let unread = inner.metrics.outcomes.unread(1);
            let reply = gate
                .lease(leases, place, quota, &redis_key, cost, started)
                .await;
            unread.read();
            let key = &redis_key[inner.prefix.len()..];
            Some(reply.map(|(decision, seen, latency)| {
                gate.decided(key, cost, (started, seen), &decision);
                // Last: a recorder that panics as it records the round trip takes neither
                // the lease nor the count.
                drop(latency);
                decision
            }))
        })
    }

    /// Ask Redis, taking nothing, whether it still holds the gate's state (a call that
    /// meets `NOSCRIPT`, or brings a degraded gate back, lets go of every lease), bounded by
    /// what is left of the timeout from `started`; finished (the gate's health settled by
    /// the answer) even if the caller gives up meanwhile. `probe`: the probe this call is.
    fn touch(
        &self,
        key: &str,
        started: Instant,
        probe: Option<Probe>,
    ) -> Finish<impl Future<Output = Result<(), CallError>> + Send + use<C>> {
        let gate = self.clone();
        let redis_key = self.redis_key(key);
        Finish::new(async move {
            if let Some(probe) = probe {
                probe.sent();
            }
            let inner = &*gate.inner;
            // Lease nothing (min 0, max 0): the script takes and writes nothing.
            let cmd = gate.lease_cmd(&redis_key, 0, 0);
            let within = inner.backend.timeout().saturating_sub(started.elapsed());
            let backend = &inner.backend;
            let r = backend.eval(&cmd, 5, within).await?;
            match key_failure(r[0]) {
                Some(e) => Err(CallError::Request(e)),
                None => Ok(()),
            }
        })
    }

    /// The lease script's call on `redis_key`: take `min` tokens or none, and up to `max`
    /// when the bucket holds them (`0, 0`: take and write nothing).
    fn lease_cmd(&self, redis_key: &str, min: u32, max: u32) -> ScriptCall {
        let inner = &*self.inner;
        let mut cmd = inner.lease_script.call(1);
        cmd.arg(redis_key);
        inner.eval.add_args(&mut cmd, [min]);
        cmd.arg(max);
        cmd
    }

    /// Ask Redis for a lease on `redis_key` (the gate's bucket of `quota`), kept in `place`
    /// unless the gate let go of its leases since the call was sent; the decision, with the
    /// backend's count of resets then and the call's latency (recorded when dropped).
    async fn lease(
        &self,
        leases: &Leases,
        place: Place<'_>,
        quota: Quota,
        redis_key: &str,
        cost: u32,
        started: Instant,
    ) -> Result<(Decision, u64, Latency<'_>), CallError> {
        let inner = &*self.inner;
        let cmd = self.lease_cmd(redis_key, cost, leases.size.max(cost));
        let within = inner.backend.timeout().saturating_sub(started.elapsed());
        let backend = &inner.backend;
        let (r, seen, latency) = backend.eval_seen(&cmd, 5, within).await?;
        if let Some(e) = key_failure(r[0]) {
            return Err(CallError::Request(e));
        }
        let granted = u32::try_from(r[0]).unwrap_or(0);
        if granted < cost {
            return Ok((decision_from(&[0, r[1], r[2], r[3], r[4]]), seen, latency));
        }
        let limit = u64::from(quota.burst_size());
        let reset_after = Duration::from_micros(u64::try_from(r[4]).unwrap_or(0));
        let key = &redis_key[inner.prefix.len()..];
        let fresh = || backend.resets().none_since(seen);
        leases.keep(place, key, granted - cost, limit, reset_after, fresh);
        let decision = decision_from(&[1, r[1], r[2] + i64::from(granted - cost), 0, r[4]]);
        Ok((decision, seen, latency))
    }
}
