//! `RedisGateBuilder`: a `RedisGate`'s settings, and `build`.

use std::fmt;
use std::time::Duration;

use redis::aio::ConnectionLike;

use crate::error::{ConfigError, ConfigErrorKind};
use crate::gate::backend::{Backend, within_timeout};
use crate::gate::batch::{Batcher, Driver, Outcomes};
use crate::gate::lease::Leases;
use crate::gate::limit::Limit;
use crate::gate::reject_cache::RejectCache;
use crate::gate::scripts;
use crate::gate::scripts::LimitScript;
use crate::metrics::Labels;
use crate::sync::Arc;

use super::{FailurePolicy, Inner, Metrics, RedisGate, names};

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
    /// A builder with the defaults, for a gate enforcing `limit` per key through `conn`
    /// (from [`RedisGate::builder`]).
    pub(super) fn new(conn: C, limit: Limit) -> Self {
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

    /// The prefix of every key (default `"flowgate:"`), for [`check`](RedisGate::check) and
    /// [`check_all`](RedisGate::check_all) alike.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The longest a decision may take before the failure policy applies (default 50 ms).
    /// `Duration::MAX` means no limit (as for every duration setting, anything above a
    /// century is taken as a century): no timer is armed for a call, and a call to a Redis
    /// that stops answering without closing the connection (a paused server, a partition
    /// that drops packets) waits as long as it does, and so does every call behind it, until
    /// Redis answers or the connection fails (only then does the failure policy apply).
    ///
    /// The timeout runs on tokio's timers. Under tokio's paused time
    /// (`#[tokio::test(start_paused = true)]`, `tokio::time::pause()`) a timer fires as soon
    /// as the runtime has nothing else to do, however far away it is, without waiting for
    /// Redis's answer: with any other timeout, every call that goes to Redis is then decided
    /// by the failure policy. A gate tested under paused time takes `Duration::MAX`, over a
    /// connection without client-side timeouts (redis-rs's fire alike).
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
    /// within its timeout. One that finds none by then is answered as a call Redis did not
    /// answer in time (Redis is too slow for the load): by the failure policy, counted in
    /// `flowgate_gate_failures_total`, and the gate degrades.
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n;
        self
    }

    /// The connection is a Redis Cluster connection: batches are split per key, one script
    /// call per key (a script over several keys of one slot is refused while the slot moves
    /// between nodes, `TRYAGAIN`, where one on a single key follows it), and `check_all`
    /// checks that its keys share a slot. Set by itself for a
    /// `redis::cluster_async::ClusterConnection` (`false` does not turn it off there: one
    /// script call over keys of several slots is refused with `CROSSSLOT`); set it for a
    /// connection of your own type that talks to a Cluster.
    ///
    /// Name keys so that what must be decided together shares a slot, with a hash tag:
    /// `{tenant-42}:user:7`. Keys without a tag spread over the whole cluster.
    ///
    /// The gate has one health for the whole cluster, as for one server: a shard that fails
    /// (its primary down until a replica takes over) degrades the gate, and the keys of
    /// every shard are decided by the failure policy until a probe answers. The probe goes
    /// to the shard of its own key: one that a shard still up answers brings the gate back,
    /// and the next call to the shard still down degrades it again (each transition logged
    /// and counted, and the rejection cache and leases forgotten when it comes back). A
    /// batch's script calls, one per key, are answered each on its own: one that fails (or
    /// whose metrics recorder panics) fails only its own callers.
    ///
    /// A primary that stops answering without closing its connections (its process paused
    /// or stuck, its host cut off by a partition) keeps the gate degraded after its replica
    /// has taken over, for as long as it stays so: redis-rs's cluster client learns the new
    /// layout from a `MOVED` or a connection that fails, never from a timeout, so it sends
    /// that slot's calls to the old primary, each one timing out, until it answers (`MOVED`)
    /// or its connections close. A primary that dies (its connections refused) is left for
    /// the new one within a few probes of the failover.
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
    /// rejection cache is forgotten (and a lease whose call was sent before that is not
    /// kept): spent then, they would pass on top of a bucket the new server holds full. Every leased token is spent here or counted in
    /// `flowgate_gate_lease_unspent_total` when the gate lets go of it (expired, lapsed,
    /// dropped for a Redis that may have lost its keys, or held when the gate is dropped):
    /// the under-admission the leases cost. A gate sees that only when it calls Redis: one
    /// that has had no answer from Redis for a `probe_interval` (all its traffic spent from
    /// leases) asks it (taking nothing) before it spends another leased token, and spends it
    /// if Redis still holds the gate's state, or cannot answer.
    /// A lease call that timed out (Redis slow, or paused) is run by Redis when it resumes:
    /// up to `n` tokens debited for nobody, counted only as the failed call in
    /// `flowgate_gate_failures_total`. So the probe of a degraded gate takes no lease: it is
    /// decided for its own cost, once a probe interval while Redis is away. A lease call
    /// whose answer nothing is left to read (the runtime it ran on shut down while Redis
    /// had it: a service stopping while Redis is slow or paused) debits up to `n` tokens
    /// for nobody too, counted only as its request, `abandoned` in
    /// `flowgate_gate_decisions_total`.
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
    /// call that needs it). The loading is given the timeout, and at least 500 ms: on a
    /// Redis that does not answer (paused, or a partition that drops packets) `build`
    /// returns the gate after that long, 500 ms with the default timeout of 50 ms.
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
    /// Outside a tokio runtime with timers (`enable_time`): it spawns the batch driver, and
    /// bounds the loading of its scripts with a tokio timer.
    ///
    /// # Cancel safety
    ///
    /// Dropped before it returns (while it loads its scripts), it builds nothing and starts
    /// no task; the scripts it loaded stay in Redis's script cache, as after any load.
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
        let all_script = scripts::token_bucket_all();
        let lease_script = scripts::token_bucket_lease();
        // Every script the gate may call, now and whenever Redis lacks one (`NOSCRIPT`): a
        // first call that met NOSCRIPT would read as Redis having lost its state, and forget
        // the rejections cached and the leases taken.
        let lease = leases.as_ref().map(|_| lease_script);
        let scripts: Vec<&scripts::Script> = [Some(eval.script), Some(all_script), lease]
            .into_iter()
            .flatten()
            .collect();
        let mut conn = self.conn.clone();
        let load = async {
            for script in &scripts {
                if script.load(&mut conn).await.is_err() {
                    break;
                }
            }
        };
        let _ = within_timeout(
            self.timeout,
            self.timeout.max(Duration::from_millis(500)),
            load,
        )
        .await;
        let backend = Backend::new(
            self.conn,
            self.timeout,
            self.probe_interval,
            self.name.clone(),
            self.policy.as_str(),
            &labels,
        );
        let decisions = |outcome| labels.counter(names::DECISIONS, &[("outcome", outcome)]);
        let outcomes = Arc::new(Outcomes {
            allowed: decisions("allowed"),
            rejected: decisions("rejected"),
            abandoned: decisions("abandoned"),
            cache: RejectCache::new(self.reject_cache, self.limit),
            prefix: self.prefix.len(),
            resets: backend.resets().clone(),
        });
        // Redis may have lost its keys (restarted empty, failed over: back after a failure,
        // or without its scripts): the rejections cached before would refuse what it admits,
        // and tokens leased before would pass on top of the buckets it holds full again.
        let forget = Arc::clone(&outcomes);
        let forget_leases = leases.clone();
        let backend = Arc::new(
            backend
                .on_reset(move || {
                    forget.cache.clear();
                    if let Some(leases) = &forget_leases {
                        leases.clear();
                    }
                })
                .with_scripts(scripts),
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

/// Whether `C` is redis-rs's async Cluster connection, whose calls must each stay within one
/// hash slot.
fn is_cluster_connection<C: 'static>() -> bool {
    std::any::TypeId::of::<C>() == std::any::TypeId::of::<redis::cluster_async::ClusterConnection>()
}
