//! `RegionGate`: a token bucket in the region's local Redis at the region's current share.

use std::fmt;
// Real time: the backend's probes follow Redis, whose clock never pauses.
use std::time::Instant;

use redis::aio::ConnectionLike;

use crate::decision::Decision;
use crate::error::CostError;
use crate::gate::backend::{CallError, key_failure};
use crate::gate::finish::Finish;
use crate::gate::scripts::{self, decision_from};
use crate::gate::{FailurePolicy, Gate, GateError, GateFuture, Limit};
use crate::metrics::Counter;
use crate::region::config::micros;
use crate::region::member::Region;

/// A [`Gate`] that admits at its region's current share of a global quota, deciding in one
/// script call against the region's **local** Redis (local latency; the home is never on
/// the decision path); from [`Region::gate`].
///
/// Each key has its own bucket at the region's share (a global limit is usually one key,
/// such as the API's name): the rate is the share, the burst the region's part of the
/// global burst (at least one request). The region's demand, which moves its share, counts
/// what the requests of all its keys cost together: with a key per tenant, the share
/// follows their sum, and each tenant may admit at all of it (the global bound holds key by
/// key). The share is read from the lease record in the same script, on the local Redis
/// clock, so every process of the region switches at the same instant, and a lease that
/// expired gives way to the safe share at once. When the share changes, a bucket keeps the
/// tokens it has in hand (at most its new size; none at a share of 0, so a region whose
/// share grows from 0 starts empty): no region gains tokens by a change, so the regions
/// never hold more than the global burst (plus one request each) between them.
///
/// A rejection while the region's share is 0, or for a cost above the region's bucket at
/// its current share, says `retry_after` = one refresh interval. Under the demand-driven
/// policies every rejection says at most that: the share may grow at the next refresh, and a
/// caller that waits its `retry_after` (a shaping [`gated`](crate::FlowStreamExt::gated)
/// stream, an HTTP client honouring `Retry-After`) must come back within a refresh to be
/// counted in the region's demand. (Its `reset_after` is not shortened.)
///
/// # Errors
///
/// As [`RedisGate::check`](crate::gate::RedisGate::check): [`GateError::Cost`] (zero, above
/// the global burst, or above the largest bucket the region can ever hold: its part of the
/// burst at its static share under [`Allocation::Static`](crate::region::Allocation::Static),
/// else at the quota less the other regions' safe shares), [`GateError::InvalidKey`];
/// [`GateError::UnreadableKey`] for a key whose bucket in the local Redis the gate cannot
/// read (another type, or a value that is not a bucket: that request only, the gate stays
/// healthy; every request of the region, if the region's demand counters hold another
/// type); a failing or slow local Redis as the gate's [`FailurePolicy`] says, and a full
/// one too (`maxmemory` reached: Redis refuses the writes of a new key and a known one
/// alike; see the [module docs](crate::region)), and an unreadable lease record too
/// (written by something else: every request, until the key named in the error is
/// deleted). [`Gate::check_all`] is not supported (it answers [`GateError::InvalidQuota`]).
///
/// # Cancel safety
///
/// Dropping the future after the call was sent may still charge the cost (never over
/// admission): the call then goes on as a task on the current runtime (bounded by the local
/// timeout), and its decision is counted when the local Redis answers.
///
/// # Metrics
///
/// `flowgate_gate_decisions_total` by `outcome` (`allowed`, `rejected`, `policy`, and
/// `unreadable_key`: requests refused with [`GateError::UnreadableKey`]), labelled with the
/// allocator's `name` and the `region`; the local Redis's latency and failures as
/// a [`RedisGate`](crate::gate::RedisGate)'s.
///
/// A request refused for what it asks ([`GateError::Cost`], [`GateError::InvalidKey`])
/// is not a decision and is not counted here: nothing was charged, and its caller has the
/// error (a [`Gated`](crate::gate::Gated) stream counts its item in
/// `flowgate_gated_dropped_total{reason="gate_error"}`, the HTTP rate-limit layer counts
/// the request as `bad_request`). The three gates count alike.
pub struct RegionGate<C> {
    region: Region<C>,
    policy: FailurePolicy,
    allowed: Counter,
    rejected: Counter,
    by_policy: Counter,
    unreadable: Counter,
}

impl<C> Clone for RegionGate<C> {
    fn clone(&self) -> Self {
        RegionGate {
            region: self.region.clone(),
            policy: self.policy.clone(),
            allowed: self.allowed.clone(),
            rejected: self.rejected.clone(),
            by_policy: self.by_policy.clone(),
            unreadable: self.unreadable.clone(),
        }
    }
}

impl<C> fmt::Debug for RegionGate<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegionGate")
            .field("region", &self.region)
            .field("policy", &self.policy.as_str())
            .finish_non_exhaustive()
    }
}

impl<C> RegionGate<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    pub(crate) fn new(region: Region<C>, policy: FailurePolicy) -> RegionGate<C> {
        let labels = &region.core().labels;
        let decisions = |outcome| labels.counter(crate::gate::DECISIONS, &[("outcome", outcome)]);
        RegionGate {
            allowed: decisions("allowed"),
            rejected: decisions("rejected"),
            by_policy: decisions("policy"),
            unreadable: decisions("unreadable_key"),
            region,
            policy,
        }
    }

    /// The region this gate admits for.
    pub fn region(&self) -> &Region<C> {
        &self.region
    }

    /// Decide one request now at the region's current share.
    ///
    /// # Errors
    ///
    /// See the [type docs](RegionGate#errors).
    pub async fn check(&self, key: &str, cost: u32) -> Result<Decision, GateError> {
        crate::gate::check_key(key)?;
        let core = self.region.core();
        let plan = &core.allocator.plan;
        let limit = Limit::TokenBucket(plan.quota);
        limit.check_cost(cost).map_err(GateError::from)?;
        if u128::from(cost) * u128::from(plan.period_us) > u128::from(core.max_tau) {
            // No share the home can grant this region holds it: waiting would never end.
            return Err(GateError::Cost(CostError::ExceedsCapacity {
                cost,
                capacity: core.max_tau / plan.period_us,
            }));
        }
        let now = Instant::now();
        let reply = match core.local.admit(now) {
            Err(e) => Err(e),
            Ok(()) => {
                let mut cmd = scripts::region_bucket().call(3);
                let mut bucket = String::with_capacity(core.keys.bucket_prefix.len() + key.len());
                bucket.push_str(&core.keys.bucket_prefix);
                bucket.push_str(key);
                cmd.arg(&core.keys.record)
                    .arg(&core.keys.counters)
                    .arg(bucket)
                    .arg("")
                    .arg(cost)
                    .arg(plan.period_us)
                    .arg(core.safe())
                    .arg(core.safe_tau)
                    .arg(micros(plan.refresh))
                    .arg(core.keep_ms)
                    .arg(core.record_keep_ms);
                let within = plan.local_timeout.saturating_sub(now.elapsed());
                // Finished (and its decision counted) even if the caller gives up once it is
                // sent: the local Redis charges it all the same.
                let gate = self.clone();
                Finish::new(async move {
                    let local = &gate.region.core().local;
                    let decided = match local.eval(&cmd, 5, within).await {
                        Ok(v) => match key_failure(v[0]) {
                            Some(e) => Err(CallError::Request(e)),
                            None => Ok(gate.wait_for_refresh(decision_from(&v))),
                        },
                        Err(e) => Err(e),
                    };
                    match &decided {
                        Ok(d) if d.allowed => gate.allowed.increment(1),
                        Ok(_) => gate.rejected.increment(1),
                        // A key refusing every request (its value unreadable, `WRONGTYPE`).
                        Err(CallError::Request(GateError::UnreadableKey(_))) => {
                            gate.unreadable.increment(1);
                        }
                        Err(_) => {}
                    }
                    decided
                })
                .await
            }
        };
        match reply {
            Ok(d) => Ok(d),
            Err(CallError::Request(e)) => Err(e),
            Err(CallError::Backend { error, until_probe }) => {
                self.by_policy.increment(1);
                self.policy.decide(key, cost, until_probe, error)
            }
        }
    }
}

impl<C> RegionGate<C> {
    /// A rejection by demand ([`Allocation::FairShare`](crate::region::Allocation::FairShare),
    /// [`Allocation::ProportionalShare`](crate::region::Allocation::ProportionalShare)) waits
    /// at most one refresh interval: the share may grow then. A caller told to wait longer
    /// (the next token at a small share: a second at 1 per second, an hour at 1 per hour)
    /// would be missing from the refreshes meanwhile, which then measure no demand, and the
    /// share would fall back before it returns.
    fn wait_for_refresh(&self, mut decision: Decision) -> Decision {
        let plan = &self.region.core().allocator.plan;
        if !decision.allowed && plan.policy != crate::region::Allocation::Static {
            decision.retry_after = decision.retry_after.min(plan.refresh);
        }
        decision
    }
}

impl<C> Gate for RegionGate<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// [`RegionGate::check`].
    fn check<'a>(&'a self, key: &'a str, cost: u32) -> GateFuture<'a> {
        Box::pin(RegionGate::check(self, key, cost))
    }

    /// The global quota as a token bucket (each region admits at its share of it).
    fn limit(&self) -> Limit {
        Limit::TokenBucket(self.region.core().allocator.plan.quota)
    }
}
