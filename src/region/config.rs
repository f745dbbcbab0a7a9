//! `QuotaAllocator`: the global quota, its regions and the lease settings, validated once.

use std::fmt;
use std::time::Duration;

use redis::aio::ConnectionLike;

use crate::error::{ConfigError, ConfigErrorKind};
use crate::gate::backend::Backend;
use crate::gate::scripts;
use crate::metrics::Labels;
use crate::rate::Quota;
use crate::region::model;
use crate::region::policy::Allocation;
use crate::region::status::{AllocatorStatus, HomeRegion};
use crate::sync::Arc;

/// What a region admits at when its lease has expired (the home is unreachable, or the
/// region is cut off from it).
///
/// The home keeps every region's safe share reserved at all times: a region falls to it
/// without asking, so no other region may be granted it. A safe share above zero therefore
/// trades utilisation for availability: that much of the global quota never moves to the
/// regions with demand.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum SafeShare {
    /// Admit nothing until a lease is granted again (the default): the whole quota can move
    /// to where the demand is.
    #[default]
    Closed,
    /// Admit at this many units per period of the global quota.
    Units(u64),
    /// Admit at the region's static weight of the global quota.
    StaticWeight,
}

/// One region of a [`QuotaAllocator`]: a name, a weight (for [`Allocation::Static`] and
/// [`SafeShare::StaticWeight`]) and a safe share.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegionSpec {
    name: String,
    weight: u64,
    safe: Option<SafeShare>,
}

impl RegionSpec {
    /// A region called `name` with `weight` (any scale: 50 / 30 / 20 or 5 / 3 / 2).
    pub fn new(name: impl Into<String>, weight: u64) -> RegionSpec {
        RegionSpec {
            name: name.into(),
            weight,
            safe: None,
        }
    }

    /// This region's safe share (default: the allocator's, see
    /// [`QuotaAllocatorBuilder::safe_share`]).
    pub fn safe_share(mut self, safe: SafeShare) -> RegionSpec {
        self.safe = Some(safe);
        self
    }

    /// The region's name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl<S: Into<String>> From<(S, u64)> for RegionSpec {
    fn from((name, weight): (S, u64)) -> RegionSpec {
        RegionSpec::new(name, weight)
    }
}

/// The largest capacity (units per period) the home divides exactly: its products of a
/// capacity and a want (at most twice the capacity) stay below 2^53 in Lua's doubles.
const MAX_CAPACITY: u64 = 1 << 25;
/// The largest weight (capacity × weight stays below 2^53).
const MAX_WEIGHT: u64 = 1 << 20;

/// The validated settings every region and the home share.
#[derive(Debug)]
pub(crate) struct Plan {
    pub(crate) name: String,
    pub(crate) quota: Quota,
    /// The global rate in units per period, and the period in µs.
    pub(crate) capacity: u64,
    pub(crate) period_us: u64,
    pub(crate) burst: u64,
    pub(crate) policy: Allocation,
    pub(crate) ttl: Duration,
    pub(crate) refresh: Duration,
    pub(crate) margin: Duration,
    pub(crate) home_timeout: Duration,
    pub(crate) local_timeout: Duration,
    pub(crate) smoothing: f64,
    /// (name, weight, safe share in units)
    pub(crate) regions: Vec<(String, u64, u64)>,
}

impl Plan {
    /// The home's hash.
    pub(crate) fn home_key(&self) -> String {
        format!("{{flowgate:region:{}}}:home", self.name)
    }

    /// A region's local keys share one hash tag (one Cluster slot): the lease record, the
    /// demand counters, the refresher lock, and the buckets under `bucket_prefix`.
    pub(crate) fn local_prefix(&self, region: &str) -> String {
        format!("{{flowgate:region:{}:{}}}", self.name, region)
    }

    pub(crate) fn index(&self, region: &str) -> Option<usize> {
        self.regions.iter().position(|(n, _, _)| n == region)
    }

    /// The bucket size of `share` units per period, in units of 1/share µs: the region's
    /// part of the global burst (rounded down), at least one token. 0 for a share of 0.
    pub(crate) fn tau(&self, share: u64) -> u64 {
        if share == 0 {
            return 0;
        }
        let part = u128::from(self.burst) * u128::from(self.period_us) * u128::from(share)
            / u128::from(self.capacity);
        u64::try_from(part).unwrap_or(u64::MAX).max(self.period_us)
    }

    /// How long a bucket takes to fill from empty at its share, in µs: the global burst over
    /// the rate, as each region's bucket is its share's part of the burst. (A share whose
    /// part is below one token has a bucket of one token, which takes longer: by at most
    /// that one token, a region's `+ 1` in the bound.)
    pub(crate) fn fill_us(&self) -> u64 {
        let fill = u128::from(self.burst) * u128::from(self.period_us) / u128::from(self.capacity);
        u64::try_from(fill).unwrap_or(u64::MAX)
    }

    /// The largest share region `i` can ever be granted: its static share under
    /// [`Allocation::Static`], else the quota less the other regions' safe shares (the home
    /// never grants a region what the others hold, and it always holds their safe shares).
    pub(crate) fn max_share(&self, i: usize) -> u64 {
        let safe_total: u64 = self.regions.iter().map(|r| r.2).sum();
        let free = self.capacity.saturating_sub(safe_total);
        let part = match self.policy {
            Allocation::Static => {
                let weights: Vec<u64> = self.regions.iter().map(|r| r.1).collect();
                let wants = vec![0; weights.len()];
                self.policy.divide(free, &weights, &wants)[i]
            }
            Allocation::FairShare | Allocation::ProportionalShare => free,
        };
        part + self.regions[i].2
    }

    /// The reference model's view of this plan.
    pub(crate) fn model(&self) -> model::Config {
        model::Config {
            rate: self.capacity,
            policy: self.policy,
            ttl_us: micros(self.ttl),
            stale_us: micros(self.ttl),
            regions: self
                .regions
                .iter()
                .map(|&(_, weight, safe)| model::Spec { weight, safe })
                .collect(),
        }
    }

    /// A call of the home script: mode, region `i` (0-based) and its report, then the
    /// configuration.
    pub(crate) fn home_cmd(
        &self,
        mode: &str,
        i: usize,
        report: &model::Report,
    ) -> scripts::ScriptCall {
        let mut cmd = scripts::region_home().call(1);
        let cfg = self.model();
        cmd.arg(self.home_key())
            .arg(mode)
            .arg("")
            .arg(i + 1)
            .arg(report.seq)
            .arg(report.share)
            .arg(report.demand)
            .arg(cfg.rate)
            .arg(cfg.policy.code())
            .arg(cfg.ttl_us)
            .arg(cfg.stale_us)
            .arg(self.regions.len());
        for (name, weight, safe) in &self.regions {
            cmd.arg(name).arg(weight).arg(safe);
        }
        // Checked by the home: its shares are units of one period.
        cmd.arg(self.period_us);
        cmd
    }
}

pub(crate) fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// A global quota shared by named regions (or instance groups), each deciding against its
/// own local Redis at local latency, with the shares held as leases in one **home** Redis.
///
/// Build it with the global quota and the regions (the same settings in every process of
/// every region), then in each process [`join`](QuotaAllocator::join) the process's region
/// with a connection to the region's local Redis: the [`Region`](crate::region::Region) it
/// returns keeps the lease fresh in the background and hands out the
/// [`RegionGate`](crate::region::RegionGate) that admits at the region's current share. See
/// the [module docs](crate::region) for the protocol and its guarantees.
///
/// # Examples
///
/// ```no_run
/// use flowgate::region::{Allocation, QuotaAllocator};
/// use flowgate::Quota;
/// use redis::aio::{ConnectionManager, ConnectionManagerConfig};
///
/// #[tokio::main]
/// async fn main() -> Result<(), Box<dyn std::error::Error>> {
///     // Lazily: a home that is down as the process starts is no reason to stop it (the
///     // region admits at its safe share until the home answers); `get_connection_manager`
///     // would return an error then.
///     let home = ConnectionManager::new_lazy_with_config(
///         redis::Client::open("redis://home.internal:6379/")?,
///         ConnectionManagerConfig::new(),
///     )?;
///     let local = redis::Client::open("redis://127.0.0.1:6379/")?
///         .get_connection_manager()
///         .await?;
///     let allocator = QuotaAllocator::builder(home, Quota::per_second(3000)?.burst(300)?)
///         .name("partner-api")
///         .region(("us", 50))
///         .region(("eu", 30))
///         .region(("ap", 20))
///         .policy(Allocation::FairShare)
///         .build()?;
///     let region = allocator.join("eu", local).await?;
///     let decision = region.gate().check("partner-api", 1).await?;
///     println!("{decision:?}");
///     Ok(())
/// }
/// ```
pub struct QuotaAllocator<C> {
    pub(crate) plan: Arc<Plan>,
    pub(crate) home: Arc<Backend<C>>,
}

impl<C> Clone for QuotaAllocator<C> {
    fn clone(&self) -> Self {
        QuotaAllocator {
            plan: self.plan.clone(),
            home: self.home.clone(),
        }
    }
}

impl<C> fmt::Debug for QuotaAllocator<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QuotaAllocator")
            .field("name", &self.plan.name)
            .field("quota", &self.plan.quota)
            .field("policy", &self.plan.policy)
            .field("regions", &self.plan.regions)
            .field("lease", &self.plan.ttl)
            .field("refresh", &self.plan.refresh)
            .finish_non_exhaustive()
    }
}

/// Builds a [`QuotaAllocator`]; from [`QuotaAllocator::builder`].
pub struct QuotaAllocatorBuilder<C> {
    home: C,
    quota: Quota,
    name: String,
    regions: Vec<RegionSpec>,
    policy: Allocation,
    safe: SafeShare,
    ttl: Duration,
    refresh: Option<Duration>,
    home_timeout: Option<Duration>,
    local_timeout: Duration,
    smoothing: f64,
}

/// Leaves the home connection out, as [`QuotaAllocator`]'s `Debug` does: a connection may
/// print where Redis is and who logs in.
impl<C> fmt::Debug for QuotaAllocatorBuilder<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QuotaAllocatorBuilder")
            .field("name", &self.name)
            .field("quota", &self.quota)
            .field("regions", &self.regions)
            .field("policy", &self.policy)
            .field("safe", &self.safe)
            .field("ttl", &self.ttl)
            .field("refresh", &self.refresh)
            .field("home_timeout", &self.home_timeout)
            .field("local_timeout", &self.local_timeout)
            .field("smoothing", &self.smoothing)
            .finish_non_exhaustive()
    }
}

impl<C> QuotaAllocatorBuilder<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// The allocator's name: it names the keys in every Redis (`{flowgate:region:<name>}…`)
    /// and is the `name` label of the metrics (default `"default"`).
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Add a region: `("us", 50)` or a [`RegionSpec`]. Every process must list the same
    /// regions in the same order (to add or remove one, see the
    /// [module docs](crate::region)).
    pub fn region(mut self, region: impl Into<RegionSpec>) -> Self {
        self.regions.push(region.into());
        self
    }

    /// How the capacity is divided (default [`Allocation::FairShare`]).
    pub fn policy(mut self, policy: Allocation) -> Self {
        self.policy = policy;
        self
    }

    /// What a region admits at once its lease has expired, for regions that do not set their
    /// own (default [`SafeShare::Closed`]).
    pub fn safe_share(mut self, safe: SafeShare) -> Self {
        self.safe = safe;
        self
    }

    /// The length of a lease (default 10 s): how long a region keeps its share without
    /// reaching the home, and how long a dead region's share stays unusable by the others.
    pub fn lease(mut self, ttl: Duration) -> Self {
        self.ttl = crate::time::capped(ttl);
        self
    }

    /// How often a region refreshes its lease and reports its demand (default a fifth of the
    /// lease; three refreshes, two home timeouts and a margin of 1 % of the lease (at least
    /// 5 ms) must fit in a lease, so that another process can take over before it ends).
    /// Shares follow demand within about two refreshes.
    pub fn refresh_every(mut self, every: Duration) -> Self {
        self.refresh = Some(crate::time::capped(every));
        self
    }

    /// The longest a call to the home Redis may take (default 1 s or three quarters of the
    /// refresh interval, whichever is shorter; a cross-region round trip is 100–200 ms).
    pub fn home_timeout(mut self, timeout: Duration) -> Self {
        self.home_timeout = Some(crate::time::capped(timeout));
        self
    }

    /// The longest a decision against the local Redis may take before the gate's failure
    /// policy applies (default 50 ms).
    pub fn local_timeout(mut self, timeout: Duration) -> Self {
        self.local_timeout = crate::time::capped(timeout);
        self
    }

    /// The weight of the newest measurement in a region's demand (an exponentially weighted
    /// moving average over refreshes; default 0.5, in (0, 1]). A measurement more than a
    /// quarter away from the average replaces it: demand that really moved is followed at
    /// once, noise is smoothed. One over less than half a refresh interval (a
    /// [`refresh_now`](crate::region::Region::refresh_now) right after a refresh) only
    /// raises it: a few milliseconds without a request say nothing of the demand.
    pub fn smoothing(mut self, weight: f64) -> Self {
        self.smoothing = weight;
        self
    }

    /// Validate the settings.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] on `region.name` (the allocator's name empty or with `{`, `}` or
    /// `:`), `region.regions` (none, a repeated name, a name empty or with `{`, `}` or `:`,
    /// a weight above 2^20, or every weight 0 with a policy or safe share that uses
    /// weights), `region.safe_share` (the safe shares add up to more than the capacity),
    /// `region.quota` (a period that is not whole microseconds, more than 2^25 units per
    /// period, or numbers too large for exact arithmetic in Redis), `region.lease`,
    /// `region.refresh` (under a microsecond, the protocol's unit, or 3 × refresh + 2 ×
    /// home timeout + a margin of 1 % of the lease, at least 5 ms, not shorter than the
    /// lease), `region.home_timeout` (under a microsecond, or not shorter than the refresh
    /// interval), `region.local_timeout` (zero), `region.smoothing` (outside (0, 1]).
    pub fn build(self) -> Result<QuotaAllocator<C>, ConfigError> {
        let field = |f| move |kind, why: &str| ConfigError::new(f, kind, why.to_string());
        let regions_err = field("region.regions");
        if self.regions.is_empty() {
            return Err(regions_err(ConfigErrorKind::Zero, "no regions"));
        }
        // Names become parts of Redis keys: no hash-tag braces, no separator.
        let bad_name = |n: &str| n.is_empty() || n.contains(['{', '}', ':']);
        if bad_name(&self.name) {
            return Err(ConfigError::new(
                "region.name",
                ConfigErrorKind::Inconsistent,
                format!(
                    "the allocator's name {:?} is empty or has '{{', '}}' or ':'",
                    self.name
                ),
            ));
        }
        for (i, r) in self.regions.iter().enumerate() {
            if bad_name(&r.name) {
                return Err(regions_err(
                    ConfigErrorKind::Inconsistent,
                    &format!(
                        "the region name {:?} is empty or has '{{', '}}' or ':'",
                        r.name
                    ),
                ));
            }
            if r.weight > MAX_WEIGHT {
                return Err(regions_err(
                    ConfigErrorKind::TooLarge,
                    &format!("the weight of \"{}\" is above {MAX_WEIGHT}", r.name),
                ));
            }
            if self.regions[..i].iter().any(|o| o.name == r.name) {
                return Err(regions_err(
                    ConfigErrorKind::Inconsistent,
                    &format!("the region \"{}\" is listed twice", r.name),
                ));
            }
        }
        let limit = crate::gate::Limit::TokenBucket(self.quota);
        let (capacity, period_us) = limit
            .redis_params()
            .map_err(|e| ConfigError::new("region.quota", e.kind(), e.reason().to_string()))?;
        if capacity > MAX_CAPACITY {
            return Err(ConfigError::new(
                "region.quota",
                ConfigErrorKind::TooLarge,
                format!(
                    "{capacity} per period is above {MAX_CAPACITY}, what the home divides \
                     exactly (express the quota per a shorter period)"
                ),
            ));
        }
        let total_weight: u128 = self.regions.iter().map(|r| u128::from(r.weight)).sum();
        let uses_weights = self.policy == Allocation::Static
            || self.safe == SafeShare::StaticWeight
            || self
                .regions
                .iter()
                .any(|r| r.safe == Some(SafeShare::StaticWeight));
        if uses_weights && total_weight == 0 {
            return Err(regions_err(
                ConfigErrorKind::Zero,
                "every weight is 0, but the policy or a safe share divides by weight",
            ));
        }
        let regions: Vec<(String, u64, u64)> = self
            .regions
            .iter()
            .map(|r| {
                let safe = match r.safe.unwrap_or(self.safe) {
                    SafeShare::Closed => 0,
                    SafeShare::Units(n) => n,
                    SafeShare::StaticWeight => {
                        u64::try_from(u128::from(capacity) * u128::from(r.weight) / total_weight)
                            .unwrap_or(u64::MAX)
                    }
                };
                (r.name.clone(), r.weight, safe)
            })
            .collect();
        let safe_total: u128 = regions.iter().map(|r| u128::from(r.2)).sum();
        if safe_total > u128::from(capacity) {
            return Err(ConfigError::new(
                "region.safe_share",
                ConfigErrorKind::TooLarge,
                format!(
                    "the safe shares add up to {safe_total}, more than the capacity {capacity}"
                ),
            ));
        }
        if self.ttl.is_zero() {
            return Err(ConfigError::zero_duration("region.lease"));
        }
        // The protocol counts in whole microseconds: below one, a duration is zero to it (a
        // refresh is the retry_after of a region without a share).
        let under_a_micro = |d: Duration| d < Duration::from_micros(1);
        let refresh = self.refresh.unwrap_or(self.ttl / 5);
        let micro_err = |field| {
            ConfigError::new(
                field,
                ConfigErrorKind::Zero,
                "must be at least 1 µs (the protocol counts whole microseconds)",
            )
        };
        if under_a_micro(refresh) {
            return Err(micro_err("region.refresh"));
        }

        let home_timeout = self
            .home_timeout
            .unwrap_or_else(|| Duration::from_secs(1).min(refresh * 3 / 4));
        if under_a_micro(home_timeout) {
            return Err(micro_err("region.home_timeout"));
        }
        let margin = (self.ttl / 100).max(Duration::from_millis(5));
        // The lock (2 refreshes + the home timeout), then the next process's tick (one
        // refresh) and its refresh (a home timeout) must fit in a lease.
        if refresh * 3 + home_timeout * 2 + margin >= self.ttl {
            return Err(ConfigError::new(
                "region.refresh",
                ConfigErrorKind::Inconsistent,
                format!(
                    "3 × the refresh ({refresh:?}) + 2 × the home timeout ({home_timeout:?}) \
                     + a margin ({margin:?}) must be shorter than the lease ({:?}): a lease \
                     must outlive a process taking another's place",
                    self.ttl
                ),
            ));
        }
        if home_timeout >= refresh {
            return Err(ConfigError::new(
                "region.home_timeout",
                ConfigErrorKind::Inconsistent,
                format!(
                    "the home timeout ({home_timeout:?}) must be shorter than the refresh \
                     interval ({refresh:?})"
                ),
            ));
        }
        if self.local_timeout.is_zero() {
            return Err(ConfigError::zero_duration("region.local_timeout"));
        }
        if !(self.smoothing > 0.0 && self.smoothing <= 1.0) {
            return Err(ConfigError::new(
                "region.smoothing",
                ConfigErrorKind::Inconsistent,
                format!("{} is not in (0, 1]", self.smoothing),
            ));
        }
        let plan = Plan {
            name: self.name,
            quota: self.quota,
            capacity,
            period_us,
            burst: u64::from(self.quota.burst_size()),
            policy: self.policy,
            ttl: self.ttl,
            refresh,
            // Clocks of two Redis servers drift apart by parts per million; 1 % of the
            // lease (at least 5 ms) covers that many times over.
            margin,
            home_timeout,
            local_timeout: self.local_timeout,
            smoothing: self.smoothing,
            regions,
        };
        let labels = Labels::new(Some(&plan.name));
        let home = Arc::new(Backend::new(
            self.home,
            plan.home_timeout,
            plan.refresh,
            Some(format!("{}/home", plan.name)),
            "lease",
            &labels,
        ));
        Ok(QuotaAllocator {
            plan: Arc::new(plan),
            home,
        })
    }
}

impl<C> QuotaAllocator<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// A builder for `quota` (the global rate and burst) with the home Redis `home`.
    pub fn builder(home: C, quota: Quota) -> QuotaAllocatorBuilder<C> {
        QuotaAllocatorBuilder {
            home,
            quota,
            name: crate::metrics::DEFAULT_NAME.to_string(),
            regions: Vec::new(),
            policy: Allocation::FairShare,
            safe: SafeShare::Closed,
            ttl: Duration::from_secs(10),
            refresh: None,
            home_timeout: None,
            local_timeout: Duration::from_millis(50),
            smoothing: 0.5,
        }
    }

    /// The allocator's name.
    pub fn name(&self) -> &str {
        &self.plan.name
    }

    /// The global quota.
    pub fn quota(&self) -> Quota {
        self.plan.quota
    }

    /// Each region's safe share, in units per period of the global quota, in the order the
    /// regions were given.
    pub fn safe_shares(&self) -> Vec<(&str, u64)> {
        self.plan
            .regions
            .iter()
            .map(|(n, _, s)| (n.as_str(), *s))
            .collect()
    }

    /// Start the home without its learning phase: `true` if it had no state and starts now,
    /// `false` if it already had state (then nothing changes).
    ///
    /// A home without state cannot tell a first start from a restart that lost its state,
    /// so by itself it spends one lease length re-granting only what regions report holding
    /// (see the [module docs](crate::region)): on a first start that means one lease length
    /// at the safe shares. Call this once, on a first deployment, when you know that no
    /// region holds a lease; calling it after a home restart would let the home grant
    /// shares that regions still hold, and break the global bound for up to one lease.
    ///
    /// # Errors
    ///
    /// [`GateError`](crate::gate::GateError) when the home fails or does not answer within
    /// the home timeout.
    ///
    /// # Cancel safety
    ///
    /// Dropped after its call went to the home, the home may have started all the same
    /// (as after a timeout); a second call then answers `false`.
    pub async fn init_home(&self) -> Result<bool, crate::gate::GateError> {
        let cmd = self.plan.home_cmd("init", 0, &model::Report::default());
        let v = self.call_home(&cmd, 1).await?;
        Ok(v[0] == 1)
    }

    /// What the home holds now: each region's share, demand and lease age, read from the
    /// home Redis (one call, changes nothing).
    ///
    /// # Errors
    ///
    /// [`GateError`](crate::gate::GateError) when the home fails or does not answer within
    /// the home timeout, or holds its shares in units of another period than this quota's
    /// (see the [module docs](crate::region) on changing the global quota).
    pub async fn status(&self) -> Result<AllocatorStatus, crate::gate::GateError> {
        let cmd = self.plan.home_cmd("status", 0, &model::Report::default());
        let k = self.plan.regions.len();
        let v = self.call_home(&cmd, 2 + 6 * k).await?;
        let us = |x: i64| Duration::from_micros(u64::try_from(x).unwrap_or(0));
        let units = |x: i64| u64::try_from(x).unwrap_or(0);
        let regions = self
            .plan
            .regions
            .iter()
            .zip(v[2..].chunks_exact(6))
            .map(|((name, _, safe), r)| HomeRegion {
                region: name.clone(),
                held: units(r[0]),
                share: units(r[2]),
                safe: *safe,
                lease_left: us(r[3]),
                demand: units(r[4]),
                since_refresh: (r[5] >= 0).then(|| us(r[5])),
            })
            .collect();
        Ok(AllocatorStatus {
            rate: self.plan.capacity,
            period: self.plan.quota.rate().period(),
            learning: v[0] == 1,
            regions,
        })
    }

    /// One call of the home script, `len` integers back.
    pub(crate) async fn call_home(
        &self,
        cmd: &scripts::ScriptCall,
        len: usize,
    ) -> Result<Vec<i64>, crate::gate::GateError> {
        use crate::gate::backend::CallError;
        match self.home.eval(cmd, len, self.plan.home_timeout).await {
            Ok(v) => Ok(v),
            Err(CallError::Request(e)) => Err(e),
            Err(CallError::Backend { error, until_probe }) => {
                Err(CallError::error(error, until_probe))
            }
        }
    }
}
