//! `Region`: one process's membership in a region: the refresher that keeps the region's
//! lease, and the gates that admit at it.

use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::PoisonError;
// Real time: leases follow the Redis clocks, which never pause.
use std::time::{Duration, Instant};

use futures::FutureExt;
use redis::aio::ConnectionLike;
use tokio::task::JoinHandle;

use crate::error::{ConfigError, ConfigErrorKind};
use crate::gate::backend::{Backend, CallError};
use crate::gate::scripts;
use crate::gate::{FailurePolicy, GateError};
use crate::metrics::{Counter, Gauge, Labels};
use crate::region::config::{Plan, QuotaAllocator, micros};
use crate::region::gate::RegionGate;
use crate::region::model::Report;
use crate::region::status::{HomeError, RegionStatus};
use crate::sync::{Arc, Mutex, Panics};

/// Names of the region metrics (labels `name` = the allocator, `region`).
pub(crate) mod names {
    pub(crate) const SHARE: &str = "flowgate_region_share";
    pub(crate) const DEMAND: &str = "flowgate_region_demand";
    pub(crate) const UTILISATION: &str = "flowgate_region_utilisation";
    pub(crate) const LEASE_AGE: &str = "flowgate_region_lease_age_seconds";
    pub(crate) const REFRESHES: &str = "flowgate_region_refreshes_total";
}

struct Metrics {
    share: Gauge,
    demand: Gauge,
    utilisation: Gauge,
    lease_age: Gauge,
    granted: Counter,
    failed: Counter,
    follower: Counter,
}

/// The keys of a region in its local Redis (one hash tag).
pub(crate) struct LocalKeys {
    pub(crate) record: String,
    pub(crate) counters: String,
    pub(crate) lock: String,
    pub(crate) bucket_prefix: String,
}

/// What the refresher keeps between rounds.
struct Round {
    status: RegionStatus,
    /// When the last lease this process obtained was granted, as seen here.
    granted_at: Option<Instant>,
    /// When the lease in use was granted, as seen here: the one this process obtained, or
    /// the one another process of the region keeps (from the lease record).
    lease_granted: Option<Instant>,
    /// The end of the current lease, as seen here.
    lease_end: Option<Instant>,
    /// Calls to the home that failed in a row.
    home_failures: u32,
    /// Refreshes that failed in a row (any call: local or home), for the logs.
    failing: u32,
    /// Until then this process does not ask for the refresher lock (it gave it up).
    stand_down_until: Option<Instant>,
    /// When the refresher lock this process last took may lapse, as seen here (counted
    /// from before the call that took it): another process of the region may hold it then.
    lock_until: Option<Instant>,
    demand: f64,
}

/// A failed refresh, counted; what its metrics and log tell.
struct Failed {
    /// Refreshes that failed in a row, this one too.
    failures: u32,
    /// On the home (else on the local Redis).
    home: bool,
    /// The age of the lease in use.
    age: Option<Duration>,
    /// Whether the lease in use has ended (the region admits at its safe share).
    ran_out: bool,
    safe: u64,
}

pub(crate) struct Core<C> {
    pub(crate) allocator: QuotaAllocator<C>,
    pub(crate) index: usize,
    /// The bucket size of the region's safe share (computed once: every decision sends it).
    pub(crate) safe_tau: u64,
    /// The bucket size of the largest share the region can ever be granted: a cost above it
    /// can never pass.
    pub(crate) max_tau: u64,
    /// How long (ms) a bucket is kept once full at the share it was written at: a lease,
    /// and the time any bucket takes to fill from empty, so that one drained just before its
    /// share grew is kept until it would be full at the new size too (gone before, it would
    /// come back full at once). At least 1 s.
    pub(crate) keep_ms: u64,
    /// How long (ms) the lease record and the demand counters are kept after the refresher
    /// last wrote them (counters a decision makes again, after a restart that lost them, as
    /// long from that decision): a week, four lease lengths (as the home keeps its state), or twice
    /// `keep_ms` and a period, whichever is longest. A region no process refreshes leaves
    /// nothing behind for good, and its record outlives every bucket it converts: one
    /// written after it (within a lease) is kept at most `keep_ms` after it is full again,
    /// which is at most a fill or a period (a bucket of one token at a small share) away.
    pub(crate) record_keep_ms: u64,
    pub(crate) local: Arc<Backend<C>>,
    pub(crate) keys: LocalKeys,
    pub(crate) labels: Labels,
    token: String,
    refreshing: tokio::sync::Mutex<()>,
    round: Mutex<Round>,
    metrics: Metrics,
}

/// Gives the refresher lock up in the background (made where the connection's bounds are
/// known, so that `Drop` can run it).
type Release = Box<dyn FnOnce() -> futures::future::BoxFuture<'static, ()> + Send + Sync>;

struct Handle<C> {
    core: Arc<Core<C>>,
    task: Option<JoinHandle<()>>,
    release: Option<Release>,
}

impl<C> Drop for Handle<C> {
    fn drop(&mut self) {
        let Some(task) = self.task.take() else {
            return;
        };
        task.abort();
        // Let another process of the region take over at once rather than when the lock
        // lapses (best effort: only inside a runtime). Once the refresher has stopped: a
        // refresh running on another thread may renew the lock after a release sent now.
        if let (Some(release), Ok(runtime)) =
            (self.release.take(), tokio::runtime::Handle::try_current())
        {
            runtime.spawn(async move {
                let _ = task.await;
                release().await;
            });
        }
    }
}

/// This process's membership in one region of a [`QuotaAllocator`]; from
/// [`QuotaAllocator::join`].
///
/// While any clone of it (or a [`RegionGate`] made from it) lives, a background task
/// refreshes the region's lease every refresh interval: it reports the region's demand to
/// the home, gets the region's share, and writes it to the local Redis, where every gate of
/// every process of the region reads it. One process of the region refreshes at a time (a
/// lock in the local Redis, held for two refresh intervals plus the home timeout, and no
/// later than a refresh interval plus the home timeout before the lease in force ends); if
/// it stops, another takes over at its first refresh after the lock lapses, before the
/// lease ends. A process gives the lock up when it [leaves](Region::leave) the region, or
/// in the background when its last handle drops (inside a runtime, which must then run on
/// for a moment: a runtime shut down at once cancels the release), and after two failed
/// calls to the home in a row (then it leaves the lock to the others
/// for a refresh interval, in which each of them comes to take it; if none does, it takes
/// it back as that interval ends), so a process of the region that can reach the home
/// takes over; and when a metrics recorder or a log subscriber panics inside a refresh's
/// call to Redis (the panic then goes on, to [`refresh_now`](Region::refresh_now)'s caller;
/// the background refresher goes on at its next tick). When the last handle drops, this
/// process stops refreshing; the region's lease then runs out unless another process
/// refreshes it.
pub struct Region<C> {
    handle: Arc<Handle<C>>,
}

impl<C> Clone for Region<C> {
    fn clone(&self) -> Self {
        Region {
            handle: self.handle.clone(),
        }
    }
}

impl<C> fmt::Debug for Region<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let core = &self.handle.core;
        f.debug_struct("Region")
            .field("allocator", &core.allocator.plan.name)
            .field("region", &core.allocator.plan.regions[core.index].0)
            .field("status", &self.status())
            .finish_non_exhaustive()
    }
}

impl<C> QuotaAllocator<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// Join region `region` from this process, with `local`, a connection to the region's
    /// own Redis. Refreshes the lease once before returning (a home that does not answer
    /// within the home timeout is not an error: the region admits at its safe share until a
    /// refresh succeeds), then keeps refreshing in a task spawned on the current runtime.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] on `region.name` when `region` is not one of the allocator's regions.
    ///
    /// # Panics
    ///
    /// Outside a tokio runtime (it spawns the refresher).
    ///
    /// # Cancel safety
    ///
    /// Dropped before it returns, it leaves no task and no handle behind, and its refresh
    /// stops where it stands, as that of a process that dies: a refresher lock it took
    /// lapses by itself (within two refresh intervals and the home timeout), a lease the
    /// home granted it but that was not yet written to the local Redis is never used (the
    /// home may count it until it ends: under-admission, never over the global bound), and
    /// demand read from the local counters (which restarts them) but not yet sent to the
    /// home is lost to it for that round.
    pub async fn join(&self, region: &str, local: C) -> Result<Region<C>, ConfigError> {
        let plan = &self.plan;
        let index = plan.index(region).ok_or_else(|| {
            ConfigError::new(
                "region.name",
                ConfigErrorKind::Inconsistent,
                format!(
                    "\"{region}\" is not a region of the allocator \"{}\" ({})",
                    plan.name,
                    plan.regions
                        .iter()
                        .map(|r| r.0.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            )
        })?;
        let labels = Labels::new(Some(&plan.name)).with("region", region);
        let local = Arc::new(Backend::new(
            local,
            plan.local_timeout,
            plan.refresh,
            Some(format!("{}/{region}", plan.name)),
            "region",
            &labels,
        ));
        let prefix = plan.local_prefix(region);
        let keep_ms = micros(plan.ttl)
            .saturating_add(plan.fill_us())
            .div_ceil(1000)
            .max(1000);
        let refreshes = |outcome| labels.counter(names::REFRESHES, &[("outcome", outcome)]);
        let core = Arc::new(Core {
            allocator: self.clone(),
            index,
            safe_tau: plan.tau(plan.regions[index].2),
            max_tau: plan.tau(plan.max_share(index)),
            keep_ms,
            record_keep_ms: (7 * 24 * 3600 * 1000_u64)
                .max(micros(plan.ttl).saturating_mul(4) / 1000)
                .max(
                    keep_ms
                        .saturating_mul(2)
                        .saturating_add(plan.period_us.div_ceil(1000)),
                ),
            local,
            keys: LocalKeys {
                record: format!("{prefix}:lease"),
                counters: format!("{prefix}:demand"),
                lock: format!("{prefix}:lock"),
                bucket_prefix: format!("{prefix}:bucket:"),
            },
            token: format!("{:016x}", fastrand::u64(..)),
            refreshing: tokio::sync::Mutex::new(()),
            round: Mutex::new(Round {
                status: RegionStatus {
                    region: region.to_string(),
                    safe: plan.regions[index].2,
                    ..RegionStatus::default()
                },
                granted_at: None,
                lease_granted: None,
                lease_end: None,
                home_failures: 0,
                failing: 0,
                stand_down_until: None,
                lock_until: None,
                demand: 0.0,
            }),
            metrics: Metrics {
                share: labels.gauge(names::SHARE, &[]),
                demand: labels.gauge(names::DEMAND, &[]),
                utilisation: labels.gauge(names::UTILISATION, &[]),
                lease_age: labels.gauge(names::LEASE_AGE, &[]),
                granted: refreshes("granted"),
                failed: refreshes("failed"),
                follower: refreshes("follower"),
            },
            labels,
        });
        core.refresh().await;
        let task = tokio::spawn(run(core.clone()));
        let releasing = core.clone();
        let release: Release = Box::new(move || Box::pin(async move { releasing.release().await }));
        Ok(Region {
            handle: Arc::new(Handle {
                core,
                task: Some(task),
                release: Some(release),
            }),
        })
    }
}

/// Refresh every interval until aborted.
async fn run<C>(core: Arc<Core<C>>)
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    let every = core.allocator.plan.refresh;
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        // A panic in a refresh (from a metrics recorder or a log subscriber: user code) ends
        // that refresh, not the refresher: the next tick refreshes again.
        let _ = AssertUnwindSafe(core.refresh()).catch_unwind().await;
    }
}

impl<C> Core<C> {
    fn plan(&self) -> &Plan {
        &self.allocator.plan
    }

    /// The region's name.
    fn region(&self) -> &str {
        &self.plan().regions[self.index].0
    }

    /// The region's safe share.
    pub(crate) fn safe(&self) -> u64 {
        self.plan().regions[self.index].2
    }

    fn round(&self) -> std::sync::MutexGuard<'_, Round> {
        self.round.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A measurement of demand over less than this part of a refresh interval is a short one.
const SHORT: f64 = 0.5;

/// The demand after a new measurement over `covered` of a refresh interval (at most 1): an
/// exponentially weighted moving average with weight `weight` for the new value, except
/// that a measurement more than a quarter away from the average replaces it (demand that
/// really moved is followed at once; noise is smoothed). A short measurement (below
/// [`SHORT`]: a `refresh_now` right after a refresh) only raises the demand: a window of a
/// millisecond or two without a request says nothing of a demand of 50 per second (it read
/// as none, and the region gave its share away for an interval), where requests it did see
/// are demand.
fn smooth(average: f64, measured: f64, weight: f64, covered: f64) -> f64 {
    let measured = if covered < SHORT {
        measured.max(average)
    } else {
        measured
    };
    if (measured - average).abs() > average / 4.0 {
        measured
    } else {
        weight * measured + (1.0 - weight) * average
    }
}

/// What a failed call to the home tells of it: no answer, or the home's error reply.
fn home_error(e: &GateError) -> HomeError {
    match e {
        GateError::Timeout(d) => HomeError::Timeout(*d),
        GateError::Degraded { .. } => HomeError::NotAsked,
        GateError::Backend(b) => match b.downcast_ref::<redis::RedisError>() {
            // The client's own: no connection, or one lost under the call.
            Some(r)
                if r.code().is_none()
                    && !matches!(
                        r.kind(),
                        redis::ErrorKind::Parse | redis::ErrorKind::UnexpectedReturnType
                    ) =>
            {
                HomeError::Unreachable(r.to_string())
            }
            // Redis's error reply, or an answer that is not the script's.
            _ => HomeError::Refused(b.to_string()),
        },
        // `WRONGTYPE` on the home's key.
        other => HomeError::Refused(other.to_string()),
    }
}

/// The largest demand reported (units per period): see `config::MAX_CAPACITY`.
const MAX_DEMAND: u64 = 1 << 27;

impl<C> Core<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// One call of the share script in the local Redis.
    async fn local_call(
        &self,
        args: impl FnOnce(&mut scripts::ScriptCall),
        len: usize,
    ) -> Result<Vec<i64>, GateError> {
        let mut cmd = scripts::region_share().call(3);
        cmd.arg(&self.keys.record)
            .arg(&self.keys.counters)
            .arg(&self.keys.lock);
        args(&mut cmd);
        match self
            .local
            .eval(
                &cmd,
                len,
                self.plan().local_timeout.max(Duration::from_millis(500)),
            )
            .await
        {
            Ok(v) => Ok(v),
            Err(CallError::Request(e)) => Err(e),
            Err(CallError::Backend { error, until_probe }) => {
                Err(CallError::error(error, until_probe))
            }
        }
    }

    /// One refresh: report, get a lease from the home, write it locally (and tell the home
    /// at once when the share shrank, so the others can have it). One at a time per
    /// process (the background task and [`Region::refresh_now`] may meet).
    pub(crate) async fn refresh(&self) {
        // Held to the end, over the metrics and the logs too (user code): the gauges of two
        // refreshes go out in their order. Each path brings the round up to date first, so
        // a recorder or a subscriber that panics loses nothing (nor poisons this lock: the
        // guard drops as the panic unwinds).
        let _one_at_a_time = self.refreshing.lock().await;
        let plan = self.plan();
        let safe = self.safe();
        // Long enough for a whole refresh (two local calls, a home call) between renewals;
        // short enough that another process takes over well before the lease ends
        // (`build` checks that three refreshes, two home timeouts and a margin fit in the
        // lease). Renewed at a refresh that then gets no lease, it would be counted from a
        // refresh after the lease's: the script ends it a refresh interval and a home timeout
        // before the lease in force ends, in time for another process to renew that.
        let lock_ms = micros(plan.refresh * 2 + plan.home_timeout).div_ceil(1000);
        // A process that gave the lock up for failing to reach the home leaves it to the
        // others for a refresh interval (each of them ticks within it), then comes for it
        // as that interval ends: skipping the tick that falls just before the end would
        // leave a process alone in its region a whole refresh later, past the lease.
        let stand_down_until = self.round().stand_down_until;
        if let Some(wait) =
            stand_down_until.and_then(|until| until.checked_duration_since(Instant::now()))
        {
            tokio::time::sleep(wait).await;
        }
        let started = Instant::now();
        let report = self.local_call(
            |c| {
                c.arg("report")
                    .arg("")
                    .arg(&self.token)
                    .arg(lock_ms)
                    .arg(micros(plan.refresh + plan.home_timeout))
                    .arg(micros(plan.home_timeout))
                    .arg(self.record_keep_ms);
            },
            9,
        );
        let r = match self.or_give_up(report).await {
            Ok(r) => r,
            Err(e) => {
                let failed = self.fail(false);
                self.tell_failed(&failed, Some(&e));
                return;
            }
        };
        let [
            leader,
            local_now,
            seq,
            share,
            left,
            admitted,
            rejected,
            since,
            lock_ms,
        ] = r[..]
        else {
            unreachable!("the report has 9 values")
        };
        let units = |x: i64| u64::try_from(x).unwrap_or(0);
        // The age of the lease in use, whoever obtained it (a lease is written to last its
        // length less the margin; none before the first).
        let age = (seq > 0).then(|| {
            let length = micros(plan.ttl.saturating_sub(plan.margin));
            Duration::from_micros(units(
                i64::try_from(length)
                    .unwrap_or(i64::MAX)
                    .saturating_sub(left),
            ))
        });
        // When the lease in use was granted, as seen here.
        let granted = age.and_then(|age| started.checked_sub(age));
        if leader == 0 {
            // Another process refreshes: show the lease it keeps, and its age.
            // It makes no call to the home: whether the refreshing process's last one got a
            // lease (one refresh apart, each within the home timeout).
            let fresh = age.is_some_and(|age| age <= plan.refresh + plan.home_timeout);
            let mut round = self.round();
            round.home_failures = 0;
            // The region's refreshes work again only once the refreshing process gets a
            // lease: a process that gave the lock up in an outage and finds another holding
            // it keeps its count of failures in a row (it would log a recovery with the
            // home away, and each turn at the lock its first failures once more).
            let recovered = if fresh {
                std::mem::take(&mut round.failing)
            } else {
                0
            };
            round.status.leader = false;
            round.lock_until = None;
            round.status.home_reachable = fresh;
            round.status.home_error = None;
            round.status.share = units(share);
            // As the metrics: not what this process measured when it last refreshed.
            round.status.demand = 0;
            round.status.utilisation = 0.0;
            // Nor the home's phase at that refresh: it makes no call to the home.
            round.status.learning = false;
            round.lease_granted = granted;
            round.lease_end = Some(started + Duration::from_micros(units(left)));
            drop(round);
            // User code, once the round is up to date; each step runs whatever the one
            // before did (a recorder or a subscriber may panic), and the first panic goes
            // on after them.
            let mut panics = Panics::new();
            panics.run(|| self.metrics.follower.increment(1));
            let effective = if left > 0 { units(share) } else { safe };
            panics.run(|| self.metrics.share.set(effective as f64));
            // Measured by the refreshing process, not this one.
            panics.run(|| self.metrics.demand.set(0.0));
            panics.run(|| self.metrics.utilisation.set(0.0));
            if let Some(age) = age {
                panics.run(|| self.metrics.lease_age.set(age.as_secs_f64()));
            }
            panics.run(|| self.recovered(recovered));
            panics.resume();
            return;
        }
        let enforced = if left > 0 { units(share) } else { safe };
        let report = {
            let mut round = self.round();
            round.status.leader = true;
            // The script set the lock after `started`: it lapses no sooner than this.
            round.lock_until = Some(started + Duration::from_millis(units(lock_ms)));
            round.lease_granted = granted;
            // The counters cover the time since they were last reset, by whichever process
            // (on the local Redis clock); unknown the first time.
            let elapsed = if since >= 0 {
                Duration::from_micros(units(since))
            } else {
                plan.refresh
            };
            // The part of a refresh interval they cover: a `refresh_now` right after a
            // refresh measures a few milliseconds.
            let covered = (elapsed.as_secs_f64() / plan.refresh.as_secs_f64()).min(1.0);
            let per_period = |n: i64| {
                units(n) as f64 * plan.period_us as f64 / elapsed.as_micros().max(1) as f64
            };
            let measured = per_period(admitted) + per_period(rejected);
            round.demand = smooth(round.demand, measured, plan.smoothing, covered);
            // Admitted ÷ share over the last interval: what the counters saw over the part
            // they cover, and the rest of the interval at the utilisation measured before.
            // (Their own rate, over a `refresh_now`'s few milliseconds, reads a burst the
            // bucket let through as hundreds of times the share.)
            round.status.utilisation = if enforced == 0 {
                0.0
            } else {
                let used = per_period(admitted) / enforced as f64;
                covered * used + (1.0 - covered) * round.status.utilisation
            };
            // Capped so the home's arithmetic stays exact (capacity ≤ 2^25 times a want
            // ≤ 2^27 + 2^24 stays below 2^53).
            let demand = (round.demand.ceil() as u64).min(MAX_DEMAND);
            round.status.demand = demand;
            Report {
                seq: units(seq),
                share: enforced,
                demand,
            }
        };
        let cmd = plan.home_cmd("refresh", self.index, &report);
        let grant = match self.or_give_up(self.allocator.call_home(&cmd, 5)).await {
            Ok(g) => {
                let mut round = self.round();
                round.home_failures = 0;
                // Whatever becomes of the lease here (the local Redis may not take it).
                round.status.home_reachable = true;
                round.status.home_error = None;
                g
            }
            Err(e) => {
                let failed = self.fail(true);
                let failures = {
                    let mut round = self.round();
                    // Not sent (the connection waits for its next probe): the last call
                    // that was is the one to tell of, if it failed.
                    if !matches!(e, GateError::Degraded { .. }) || round.status.home_error.is_none()
                    {
                        let why = home_error(&e);
                        round.status.home_reachable = matches!(why, HomeError::Refused(_));
                        round.status.home_error = Some(why);
                    }
                    round.home_failures += 1;
                    round.home_failures
                };
                // After two: the lease counts from the last good refresh; two refresh
                // intervals and a home timeout later, another process's tick (within a
                // refresh) and its home call still fit in the lease, as `build` checks (3 ×
                // refresh + 2 × home timeout + margin). After a third they may not.
                let mut released = Ok(());
                if failures >= 2 {
                    // This process cannot reach the home: let another one of the region try.
                    // Every other process ticks within a refresh interval of the release:
                    // after that, a lock still free has no one else to take it (this process
                    // is alone, or they stand down too), and this one tries again, as
                    // another would: two failed calls before it stands down again (after
                    // one, a process alone whose home calls time out would put its next try
                    // off by another home timeout each time, past the lease).
                    {
                        let mut round = self.round();
                        round.home_failures = 0;
                        // Another process of the region may take the lock now: this one no
                        // longer refreshes (until it takes the lock again).
                        round.status.leader = false;
                        round.lock_until = None;
                    }
                    // The release is a call to Redis, whose recorder (user code) may panic
                    // once the script has run: the stand-down and the count below hold all
                    // the same, and the panic goes on after them.
                    released = AssertUnwindSafe(self.release()).catch_unwind().await;
                    self.round().stand_down_until = Some(Instant::now() + plan.refresh);
                }
                // Counted, and the lock given up, before any user code runs: a recorder
                // that panics here must not keep the lock from a process that reaches the
                // home.
                self.tell_failed(&failed, Some(&e));
                if let Err(panic) = released {
                    std::panic::resume_unwind(panic);
                }
                return;
            }
        };
        let [g_seq, g_share, g_left, learning, _] = grant[..] else {
            unreachable!("a grant has 5 values")
        };
        // The lease counts from the local clock's reading before the home was asked, so it
        // ends here before it ends at the home, however long the reply took.
        let expires = local_now + g_left - i64::try_from(micros(plan.margin)).unwrap_or(0);
        let tau = plan.tau(units(g_share));
        let written = self
            .or_give_up(self.local_call(
                |c| {
                    c.arg("apply")
                        .arg("")
                        .arg(g_seq)
                        .arg(g_share)
                        .arg(tau)
                        .arg(expires)
                        .arg(learning)
                        .arg(safe)
                        .arg(self.safe_tau)
                        .arg(seq)
                        .arg(self.record_keep_ms);
                },
                2,
            ))
            .await;
        let written = match written {
            Ok(written) => written,
            Err(e) => {
                let failed = self.fail(false);
                self.tell_failed(&failed, Some(&e));
                return;
            }
        };
        if written[0] != 1 {
            if written[1] == -1 {
                let failed = self.fail(false);
                // The warning (a subscriber may panic) does not keep the failure uncounted.
                let mut panics = Panics::new();
                panics.run(|| {
                    tracing::warn!(
                        allocator = %plan.name,
                        region = %self.region(),
                        "region: the local lease record went back since this refresh read it (the local Redis lost writes?); the lease was not written",
                    );
                });
                panics.run(|| self.tell_failed(&failed, None));
                panics.resume();
            } else {
                // A newer lease is there (another process refreshed meanwhile): this
                // refresh changed nothing.
                self.metrics.follower.increment(1);
            }
            return;
        }
        // What the record holds now (a learning grant may have been capped).
        let g_share_u = units(written[1]);
        let lease = Duration::from_micros(units(g_left)).saturating_sub(plan.margin);
        let (utilisation, recovered) = {
            let mut round = self.round();
            round.granted_at = Some(started);
            round.lease_granted = Some(started);
            round.lease_end = Some(started + lease);
            round.status.share = g_share_u;
            round.status.learning = learning == 1;
            round.status.refreshes += 1;
            (round.status.utilisation, std::mem::take(&mut round.failing))
        };
        let acked = if g_share_u < enforced {
            let ack = Report {
                seq: units(g_seq),
                share: g_share_u,
                demand: report.demand,
            };
            let cmd = plan.home_cmd("ack", self.index, &ack);
            // The call runs user code (the backend's recorder, once the script has run):
            // its panic must not keep the lease written from being counted below.
            AssertUnwindSafe(self.allocator.call_home(&cmd, 2))
                .catch_unwind()
                .await
                .map(|acked| acked.map(drop))
        } else {
            Ok(Ok(()))
        };
        // User code, after the round's lock is released (a recorder may read the status)
        // and once the round is up to date. Each step runs whatever the one before did (a
        // recorder or a subscriber may panic, the ack's call too): the first panic goes on
        // once the grant is counted and shown.
        let mut panics = Panics::new();
        match acked {
            Ok(Ok(())) => {}
            Ok(Err(e)) => panics.run(|| {
                tracing::debug!(error = %e, "region: the home did not take the ack (the next refresh carries it)");
            }),
            Err(panic) => panics.run(|| std::panic::resume_unwind(panic)),
        }
        panics.run(|| self.metrics.granted.increment(1));
        panics.run(|| self.metrics.share.set(g_share_u as f64));
        panics.run(|| self.metrics.demand.set(report.demand as f64));
        panics.run(|| self.metrics.utilisation.set(utilisation));
        panics.run(|| self.metrics.lease_age.set(0.0));
        panics.run(|| self.recovered(recovered));
        panics.resume();
    }

    /// A refresh succeeded after `failed` in a row failed: say so once, where their warnings
    /// were read.
    fn recovered(&self, failed: u32) {
        if failed > 0 {
            tracing::info!(
                allocator = %self.plan().name,
                region = %self.region(),
                failed,
                "region: lease refresh works again",
            );
        }
    }

    /// `call`, a call to Redis of a refresh; if it panics (a metrics recorder or a log
    /// subscriber the backend calls: user code), the refresher lock is given up before the
    /// panic goes on. The call's script may have run, taking or renewing the lock: a process
    /// whose refreshes panic there every time would keep it for good, with no lease
    /// written, while another process of the region could refresh. (It comes for the lock
    /// again at its next tick.)
    async fn or_give_up<T>(&self, call: impl Future<Output = T>) -> T {
        match AssertUnwindSafe(call).catch_unwind().await {
            Ok(v) => v,
            Err(panic) => {
                {
                    let mut round = self.round();
                    round.status.leader = false;
                    round.lock_until = None;
                }
                // Its own call may panic as well, once the script has run.
                let _ = AssertUnwindSafe(self.release()).catch_unwind().await;
                std::panic::resume_unwind(panic)
            }
        }
    }

    /// Give the refresher lock up if this process holds it.
    async fn release(&self) {
        let _ = self
            .local_call(
                |c| {
                    c.arg("release").arg("").arg(&self.token);
                },
                1,
            )
            .await;
    }

    /// A refresh failed, on the home (`home`) or the local Redis: count it. What to tell
    /// of it ([`tell_failed`](Core::tell_failed)) is told once the refresh is done with its
    /// own state: a recorder and a subscriber are user code, and may panic.
    fn fail(&self, home: bool) -> Failed {
        let mut round = self.round();
        round.status.failures += 1;
        round.failing = round.failing.saturating_add(1);
        Failed {
            failures: round.failing,
            home,
            age: round.lease_granted.map(|at| at.elapsed()),
            // The lease ran out: the region admits at its safe share.
            ran_out: round.lease_end.is_none_or(|end| end <= Instant::now()),
            safe: round.status.safe,
        }
    }

    /// The metrics and the log of a failed refresh, with `error` (none: the local lease
    /// record went back, logged already); outside the round's lock. Each step runs whatever
    /// the one before did (a recorder or a subscriber may panic); the first panic goes on
    /// after them.
    fn tell_failed(&self, failed: &Failed, error: Option<&GateError>) {
        let mut panics = Panics::new();
        panics.run(|| self.metrics.failed.increment(1));
        if let Some(age) = failed.age {
            panics.run(|| self.metrics.lease_age.set(age.as_secs_f64()));
        }
        if failed.ran_out {
            panics.run(|| self.metrics.share.set(failed.safe as f64));
        }
        if failed.failures.is_power_of_two() {
            panics.run(|| {
                tracing::warn!(
                    allocator = %self.plan().name,
                    region = %self.region(),
                    failures = failed.failures,
                    redis = if failed.home { "home" } else { "local" },
                    error = ?error.map(ToString::to_string),
                    "region: lease refresh failed; the region keeps its lease until it ends, then admits at its safe share",
                );
            });
        }
        panics.resume();
    }
}

impl<C> Region<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// A gate that admits at the region's current share, deciding against the local Redis;
    /// when the local Redis fails, [`FailurePolicy::Error`] (see
    /// [`gate_with`](Region::gate_with)).
    pub fn gate(&self) -> RegionGate<C> {
        self.gate_with(FailurePolicy::Error)
    }

    /// A gate with this failure policy for when the local Redis fails or times out.
    /// [`FailurePolicy::Error`] and [`FailurePolicy::Closed`] keep the global bound;
    /// `Open` and `Fallback` admit outside it while the local Redis is away.
    pub fn gate_with(&self, policy: FailurePolicy) -> RegionGate<C> {
        RegionGate::new(self.clone(), policy)
    }

    /// Refresh now instead of waiting for the next interval (what the background task does
    /// every interval). It first waits for a refresh already running in this process, and
    /// for the end of a stand-down: a process that gave the refresher lock up after two
    /// failed calls to the home leaves it to the others for a refresh interval, and a
    /// `refresh_now` meanwhile refreshes as that interval ends. The demand it reports is
    /// measured since the region's last refresh: over less than half an interval, it only
    /// raises the region's demand (see
    /// [`smoothing`](crate::region::QuotaAllocatorBuilder::smoothing)).
    ///
    /// # Panics
    ///
    /// When a metrics recorder or a log subscriber (user code) panics in the refresh: the
    /// panic goes on once the refresh has kept its state (and given the refresher lock up,
    /// if it came inside a call to Redis).
    ///
    /// # Cancel safety
    ///
    /// Dropped, the refresh stops where it stands, as [`join`](QuotaAllocator::join)'s
    /// does (a lease granted and not yet written unused, demand read and not yet sent lost
    /// for that round); a refresher lock this process holds stays its own, renewed by the
    /// background refresher at its next tick.
    pub async fn refresh_now(&self) {
        self.handle.core.refresh().await;
    }

    /// Leave the region, if this is this process's last handle on it (no clone of it and no
    /// [`RegionGate`] made from it left, nor a gate's call still finishing): stop the
    /// refresher, give the refresher lock up (one call to the local Redis, bounded by the
    /// local timeout, at least 500 ms), and return `true` once both are done, so that
    /// another process of the region refreshes at its next tick. Otherwise only this handle is dropped, and
    /// `false` returned.
    ///
    /// Dropping the last handle does the same in the background, on a task of the current
    /// runtime: a runtime that shuts down right after (an application returning from
    /// `main`) cancels that task before it gives the lock up, and the region's other
    /// processes wait for the lock to lapse (up to two refresh intervals and the home
    /// timeout) before one of them refreshes. Call `leave` on the way out instead.
    ///
    /// # Cancel safety
    ///
    /// Dropped before the refresher has stopped, the refresher is stopped all the same, and
    /// the lock given up in the background (inside a runtime), as when the last handle
    /// drops. Dropped while it gives the lock up, the lock may stay until it lapses.
    pub async fn leave(self) -> bool {
        let Ok(mut handle) = Arc::try_unwrap(self.handle) else {
            return false;
        };
        let Some(task) = handle.task.as_mut() else {
            return false;
        };
        task.abort();
        // Dropped meanwhile, `handle` still holds the task: it gives the lock up in the
        // background once the refresher has stopped, as when the last handle drops.
        let _ = task.await;
        handle.task = None;
        if let Some(release) = handle.release.take() {
            release().await;
        }
        true
    }
}

impl<C> Region<C> {
    pub(crate) fn core(&self) -> &Arc<Core<C>> {
        &self.handle.core
    }

    /// This process's view of the region: share, demand, utilisation, lease age.
    pub fn status(&self) -> RegionStatus {
        let round = self.handle.core.round();
        let now = Instant::now();
        let mut status = round.status.clone();
        // A process whose refreshes failed since it took the lock (on the local Redis: its
        // lock is not renewed) no longer refreshes once the lock may have lapsed; another
        // process of the region may hold it.
        status.leader &= round.lock_until.is_some_and(|until| now < until);
        status.lease_left = round
            .lease_end
            .map_or(Duration::ZERO, |end| end.saturating_duration_since(now));
        status.lease_age = round.granted_at.map(|at| now.saturating_duration_since(at));
        status
    }
}

impl<C> fmt::Debug for Core<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Core")
            .field("index", &self.index)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::smooth;

    #[test]
    fn demand_smooths_noise_and_follows_a_move_at_once() {
        assert_eq!(smooth(100.0, 110.0, 0.5, 1.0), 105.0);
        assert_eq!(smooth(100.0, 10.0, 0.5, 1.0), 10.0);
        assert_eq!(smooth(0.0, 40.0, 0.5, 1.0), 40.0);
        assert_eq!(smooth(40.0, 0.0, 0.5, 0.5), 0.0);
    }

    #[test]
    fn a_short_measurement_only_raises_the_demand() {
        assert_eq!(smooth(50.0, 0.0, 0.5, 0.01), 50.0);
        assert_eq!(smooth(50.0, 0.0, 0.5, 0.0), 50.0);
        assert_eq!(smooth(0.0, 2000.0, 0.5, 0.02), 2000.0);
    }
}
