//! `RedisGate::check_all`: all-or-nothing across several token buckets in one script.

use std::time::Instant;

use redis::aio::ConnectionLike;

use crate::decision::Decision;
use crate::gate::backend::{CallError, key_failure};
use crate::gate::error::GateError;
use crate::gate::finish::Finish;
use crate::gate::limit::Limit;
use crate::gate::multi::Merged;
use crate::gate::redis_gate::{FailurePolicy, RedisGate};
use crate::gate::scripts::{ScriptCall, decision_from};
use crate::gate::slot::slot;
use crate::rate::Quota;

impl<C> RedisGate<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// All-or-nothing across several token buckets in one atomic script: admitted only if
    /// every `(key, quota)` bucket has room for `cost`, and then charged on all of them;
    /// otherwise nothing is charged anywhere (layered throttling: IP + user + tenant).
    /// Returns one decision per limit, in order; `allowed` is the same in all of them, and
    /// the limits that blocked have a non-zero `retry_after` (those that had room have none:
    /// the request's wait is the longest of them all).
    ///
    /// - **Keys** get the gate's prefix, as in [`check`](RedisGate::check): give the keys of
    ///   each layer a name of its own (`ip:10.0.0.1`, `user:7`), since one key is one bucket
    ///   and the gate's own limit may differ from the quotas given here. (A key given to
    ///   both `check` and `check_all` is one Redis key here, where a
    ///   [`MemoryGate`](crate::gate::MemoryGate) keeps two buckets; on a gate whose own limit
    ///   is not a token bucket, the second of them to use it is refused with
    ///   [`GateError::UnreadableKey`].) A key listed `n` times is one bucket charged
    ///   `n × cost`.
    /// - **Failure policy**: as for `check` (same timeout, probing and classification):
    ///   `Open` admits every limit, `Closed` rejects every limit until the next probe,
    ///   `Fallback` decides all-or-nothing in its [`MemoryGate`](crate::gate::MemoryGate)
    ///   ([`MemoryGate::check_all`](crate::gate::MemoryGate::check_all)), `Error`
    ///   returns the error.
    /// - **Bypassed, with reasons**: batching (each call is one script over its own keys);
    ///   the rejection cache (a cached answer could not tell what the limits that did not
    ///   block have left); leases (leased tokens belong to the gate's own quota, not to the
    ///   quotas given here).
    /// - **Redis Cluster**: the keys must share a hash slot: use a hash tag, e.g.
    ///   `{tenant-42}:ip:10.0.0.1` and `{tenant-42}:user:7`. While that slot moves between
    ///   nodes (resharding), a call whose keys lie on both is refused by either
    ///   (`TRYAGAIN`), which redis-rs sends again until the gate's timeout: a Redis failure,
    ///   decided by the failure policy (and the gate degrades) until the move ends.
    ///
    /// # Errors
    ///
    /// Before Redis is called, nothing charged: [`GateError::NoLimits`],
    /// [`GateError::TooManyLimits`] (more than 32), [`GateError::Cost`] (a cost of zero, or
    /// a key's total cost above its burst), [`GateError::InvalidKey`],
    /// [`GateError::ConflictingQuotas`] (one key with two quotas),
    /// [`GateError::InvalidQuota`] (a quota Redis cannot compute exactly),
    /// [`GateError::CrossSlot`] (cluster keys in different slots). From Redis:
    /// [`GateError::UnreadableKey`] when a key's value cannot be read (nothing is charged;
    /// the gate stays healthy); under [`FailurePolicy::Error`], [`GateError::Backend`],
    /// [`GateError::Timeout`] or (waiting for the next probe) [`GateError::Degraded`]; under
    /// `Fallback`, the in-memory gate's errors.
    ///
    /// # Panics
    ///
    /// As [`check`](RedisGate::check): when it calls Redis outside a tokio runtime with
    /// timers, unless the timeout is `Duration::MAX`.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it is first polled charges nothing; after, the script call
    /// goes on as a task on the current runtime (bounded by the timeout): every bucket may be
    /// charged (never over-admission), and the decision is counted when Redis answers.
    pub async fn check_all(
        &self,
        limits: &[(&str, Quota)],
        cost: u32,
    ) -> Result<Vec<Decision>, GateError> {
        let request = Merged::new(limits, cost)?;
        let inner = &*self.inner;
        let keys: Vec<String> = request
            .buckets
            .iter()
            .map(|(key, _, _)| self.redis_key(key))
            .collect();
        if inner.cluster {
            let first = slot(keys[0].as_bytes());
            if keys.iter().any(|k| slot(k.as_bytes()) != first) {
                return Err(GateError::CrossSlot);
            }
        }
        // KEYS: the buckets; ARGV: now (empty: Redis TIME), then each bucket's parameters
        // and cost.
        let mut cmd = inner.all_script.call(keys.len());
        for key in &keys {
            cmd.arg(key);
        }
        cmd.arg("");
        for &(_, quota, total) in &request.buckets {
            let (count, period_us) = Limit::TokenBucket(quota)
                .redis_params()
                .map_err(GateError::InvalidQuota)?;
            cmd.arg(count)
                .arg(period_us)
                .arg(quota.burst_size())
                .arg(total);
        }
        let reply = match inner.backend.admit(Instant::now()) {
            Err(e) => Err(e),
            Ok(()) => self.call_all(cmd, keys.len()).await,
        };
        match reply {
            Ok(Ok(decided)) => Ok(request.expand(&decided)),
            Ok(Err(e)) | Err(CallError::Request(e)) => inner.metrics.counted(Err(e)),
            Err(CallError::Backend { error, until_probe }) => {
                inner.metrics.by_policy.increment(1);
                let each = |d: &dyn Fn(Quota) -> Decision| -> Vec<Decision> {
                    limits.iter().map(|&(_, q)| d(q)).collect()
                };
                match &inner.policy {
                    FailurePolicy::Open => Ok(each(&|_| Decision::fail_open())),
                    FailurePolicy::Closed => Ok(each(&|_| Decision::fail_closed(until_probe))),
                    FailurePolicy::Fallback(gate) => gate.check_merged(&request),
                    _ => Err(CallError::error(error, until_probe)),
                }
            }
        }
    }

    /// The script call of [`check_all`](RedisGate::check_all) (`cmd`, on `buckets` keys):
    /// one decision per bucket, or a key's own error. The decision is counted when Redis
    /// answers, even if the caller has given up by then (the call is then finished on the
    /// runtime).
    fn call_all(
        &self,
        cmd: ScriptCall,
        buckets: usize,
    ) -> Finish<
        impl Future<Output = Result<Result<Vec<Decision>, GateError>, CallError>> + Send + use<C>,
    > {
        let gate = self.clone();
        Finish::new(async move {
            let inner = &*gate.inner;
            let within = inner.backend.timeout();
            let unread = inner.metrics.outcomes.unread(1);
            let reply = inner.backend.eval_seen(&cmd, 5 * buckets, within).await;
            unread.read();
            // The latency is recorded last, once the decision is counted.
            let (v, _, _latency) = reply?;
            if let Some(e) = v.chunks_exact(5).find_map(|r| key_failure(r[0])) {
                return Ok(Err(e));
            }
            let decided: Vec<Decision> = v.chunks_exact(5).map(decision_from).collect();
            inner.metrics.outcomes.count(&decided[0]);
            Ok(Ok(decided))
        })
    }
}
