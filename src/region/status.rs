//! Snapshots: one region as its process sees it, and every region as the home holds them.

use std::fmt;
use std::time::Duration;

/// One region as this process sees it; from [`Region::status`](crate::region::Region::status).
///
/// Shares and demand are in units per period of the global quota.
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct RegionStatus {
    /// The region's name.
    pub region: String,
    /// Whether this process refreshes the region's lease (one process per region does; the
    /// others only decide). False from when it gives the refresher lock up after two failed
    /// calls to the home, or from when the lock it took may have lapsed (its refreshes
    /// failed on the local Redis since, so it could not renew it), until it takes the lock
    /// again.
    pub leader: bool,
    /// The share of the region's current lease (what its gates admit at until the lease
    /// ends), as of this process's last refresh (a process that does not refresh reads the
    /// lease another one keeps).
    pub share: u64,
    /// What the region admits at once the lease has expired.
    pub safe: u64,
    /// How long the lease has left, as of now (zero: expired; the region admits at its safe
    /// share).
    pub lease_left: Duration,
    /// Time since the last lease this process obtained was granted (`None`: none yet).
    pub lease_age: Option<Duration>,
    /// The region's smoothed demand (admitted plus rejected) as this process last reported
    /// it; 0 in a process that does not refresh (the refreshing process measures it).
    pub demand: u64,
    /// Admitted units per period over the last refresh interval ÷ the share it had (0 with
    /// a share of 0; measured by the refreshing process: 0 in the others). A refresh that
    /// comes less than an interval after the one before (a
    /// [`refresh_now`](crate::region::Region::refresh_now)) counts what was admitted since
    /// as part of that interval, the rest of it at the utilisation measured before.
    pub utilisation: f64,
    /// Whether the home was in its learning phase at this process's last refresh; false in
    /// a process that does not refresh (it makes no calls to the home).
    pub learning: bool,
    /// Whether the home answered this process's last call to it, with a lease or with an
    /// error ([`home_error`](RegionStatus::home_error) says which); false when that call got
    /// no answer or was not sent (a call not sent after one the home refused keeps that
    /// refusal: true, with its error), and before this process's first call to the home (its
    /// refreshes failed on the local Redis before they reached it). In a process that does
    /// not refresh (it makes no calls to the home): whether the lease in use is fresh (at
    /// most a refresh interval and the home timeout old), which it is while the refreshing
    /// process gets leases; false when it is older, whatever the cause (the home away or
    /// refusing the refreshing process, or that process stalled or gone).
    pub home_reachable: bool,
    /// Why this process's last call to the home failed: no answer, or the home's error
    /// reply (`None` when it got a lease, before this process's first call to the home, and
    /// in a process that does not refresh).
    pub home_error: Option<HomeError>,
    /// Refreshes that got a lease, and refreshes that failed (home or local Redis), by this
    /// process.
    pub refreshes: u64,
    /// See `refreshes`.
    pub failures: u64,
}

impl fmt::Display for RegionStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: share {} (safe {}), lease {:.1}s left, demand {}, utilisation {:.0}%{}",
            self.region,
            self.share,
            self.safe,
            self.lease_left.as_secs_f64(),
            self.demand,
            self.utilisation * 100.0,
            if self.learning { ", home learning" } else { "" },
        )?;
        match &self.home_error {
            Some(e) => write!(f, ", {e}"),
            None if self.home_reachable => Ok(()),
            // No call of this process's failed: it made none yet, or it does not refresh
            // and the lease in use is not fresh.
            None => f.write_str(", no fresh lease"),
        }
    }
}

/// Why a region's last call to the home failed; see
/// [`RegionStatus::home_error`](crate::region::RegionStatus::home_error).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum HomeError {
    /// The home did not answer within the home timeout (this long).
    Timeout(Duration),
    /// The call did not reach the home: the connection failed, was refused or dropped
    /// (the client's message).
    Unreachable(String),
    /// The call was not sent: a call to the home from this process (this region's, another
    /// region's, or a [`QuotaAllocator::status`](crate::region::QuotaAllocator::status))
    /// failed less than a refresh interval before, and the connection waits for its next
    /// probe.
    NotAsked,
    /// The home answered with an error (Redis's reply, its code first): `OOM` when the home
    /// is full (`maxmemory`), `READONLY` from a replica, `WRONGTYPE` or `ERR region home
    /// state is unreadable` when something else wrote its key, `ERR region home holds
    /// shares per …` for a quota of another period (see the [module docs](crate::region)
    /// on changing the global quota).
    Refused(String),
}

impl fmt::Display for HomeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HomeError::Timeout(d) => write!(f, "home unreachable: no answer within {d:?}"),
            HomeError::Unreachable(why) => write!(f, "home unreachable: {why}"),
            HomeError::NotAsked => {
                f.write_str("home not asked: a call to it failed within the probe interval")
            }
            HomeError::Refused(why) => write!(f, "home refused the refresh: {why}"),
        }
    }
}

/// One region as the home holds it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct HomeRegion {
    /// The region's name.
    pub region: String,
    /// The most the region may admit at as far as the home knows (its safe share, or a
    /// live lease it may still use, whichever is larger): what the home keeps from the
    /// others.
    pub held: u64,
    /// Its last lease's share (0: no live lease).
    pub share: u64,
    /// Its safe share.
    pub safe: u64,
    /// How long its last lease has left (zero: none live).
    pub lease_left: Duration,
    /// The demand of its last refresh.
    pub demand: u64,
    /// Time since its last refresh (`None`: never, since the home's state began).
    pub since_refresh: Option<Duration>,
}

/// Every region as the home holds them; from
/// [`QuotaAllocator::status`](crate::region::QuotaAllocator::status).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct AllocatorStatus {
    /// The global rate in units per `period`.
    pub rate: u64,
    /// The period of the global quota.
    pub period: Duration,
    /// Whether the home is in its learning phase (it restarted without state). A home
    /// without state yet (a first start, or a restart that lost it) is: its first refresh
    /// starts the phase, unless [`QuotaAllocator::init_home`](crate::region::QuotaAllocator::init_home)
    /// starts the home without it.
    pub learning: bool,
    /// The regions of this process's configuration, in its order. (In a deploy that adds or
    /// removes a region, the home also counts the live leases of regions this process does
    /// not list; they are not shown.)
    pub regions: Vec<HomeRegion>,
}

impl AllocatorStatus {
    /// The sum of what the regions hold: at most `rate` while every process runs this
    /// configuration (the allocation invariant). In a rolling deploy that lowers the global
    /// quota it may be up to the old one, until the leases granted under that have ended
    /// (see the [module docs](crate::region) on changing the global quota).
    pub fn held(&self) -> u64 {
        self.regions.iter().map(|r| r.held).sum()
    }
}

impl fmt::Display for AllocatorStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} of {} per {:?} held{}",
            self.held(),
            self.rate,
            self.period,
            if self.learning { " (learning)" } else { "" }
        )?;
        for r in &self.regions {
            write!(f, "; {} {} (demand {})", r.region, r.held, r.demand)?;
        }
        Ok(())
    }
}
