//! The home's lease protocol as pure math with explicit time: the reference model of
//! `lua/region_home.lua`, which runs the same steps atomically in the home Redis.
//!
//! `tests/region/model.rs` drives this model through random interleavings of refreshes,
//! delayed and lost replies, region crashes, lease expiries and home restarts, and checks
//! the invariant at every instant: the shares the regions may admit at add up to at most the
//! global rate. It also runs the same traces through the Lua script and compares every grant.
//!
//! Times are microseconds of the home's clock; shares are whole units of the global quota's
//! period. See the [module docs](super) for the protocol in prose. Any numbers are taken:
//! a lease or learning phase that would end past the end of the clock ends at its end
//! (`u64::MAX`), and sums of shares past `u64::MAX` saturate (the Lua script computes in
//! doubles, which do not wrap either).
//!
//! The model knows the regions of one configuration. The script also counts the live
//! grants of regions in its state that the calling process does not list (a deploy that
//! adds or removes a region), and forgets those once their grants have ended and their
//! demand is stale; `tests/region/model.rs` checks that against Redis.

use crate::region::policy::{Allocation, want};

/// A lease the home granted a region: it may admit at `share` units per period until
/// `until_us` (home clock), and its local record takes it only if `seq` is not older than
/// what it holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Grant {
    /// Orders the grants of one region: later grants have larger numbers, also across home
    /// restarts (it is the home's clock in µs at the grant, or one more than the last).
    pub seq: u64,
    /// The rate granted, in units per period of the global quota.
    pub share: u64,
    /// The end of the lease, in µs of the home's clock.
    pub until_us: u64,
    /// Granted in the learning phase: the region takes at most the share it admits at when
    /// the grant reaches it (its report may be older than a shrink it has made since).
    pub learning: bool,
}

/// What a region tells the home with each refresh.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// The `seq` of the lease its local record holds (0: none yet).
    pub seq: u64,
    /// The rate it admits at now: its lease's share, or its safe share after the lease
    /// expired.
    pub share: u64,
    /// Its measured demand in units per period.
    pub demand: u64,
}

/// One region as the allocator is configured with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Spec {
    /// Its weight for [`Allocation::Static`].
    pub weight: u64,
    /// Its safe share in units per period: reserved for it at all times, because it falls
    /// to it whenever its lease expires, without asking.
    pub safe: u64,
}

/// The configuration every refresh carries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// The global rate, in units per period.
    pub rate: u64,
    /// How the rate is divided.
    pub policy: Allocation,
    /// The length of a lease, in µs.
    pub ttl_us: u64,
    /// How long a region's reported demand counts after its last refresh, in µs.
    pub stale_us: u64,
    /// The regions, in a fixed order.
    pub regions: Vec<Spec>,
}

/// What the home keeps of one region.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Held {
    /// The grant before the last, while the region may still admit at it (it has not
    /// reported holding the last one, and it has not expired).
    pub prev: Option<Grant>,
    /// The last grant, until it expires.
    pub last: Option<Grant>,
    /// The demand of its last refresh.
    pub demand: u64,
    /// When it last refreshed (home clock, µs).
    pub seen_us: u64,
}

/// The home: every region's grants, and the learning phase after a start without state.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Home {
    /// Whether the home has state (false: it never ran, or it restarted empty).
    pub started: bool,
    /// Until then (home clock, µs) the home only re-grants what regions report holding.
    pub learn_until_us: u64,
    /// The last `seq` granted.
    pub last_seq: u64,
    /// One per configured region.
    pub regions: Vec<Held>,
}

impl Home {
    /// A home that lost its state (never ran, or restarted without persistence).
    pub fn empty() -> Home {
        Home::default()
    }

    /// Start without a learning phase: only when no region can hold a lease (a first
    /// deployment). [`QuotaAllocator::init_home`](crate::region::QuotaAllocator::init_home).
    pub fn init(&mut self, cfg: &Config, now_us: u64) -> bool {
        if self.started {
            return false;
        }
        self.start(cfg, now_us, false);
        true
    }

    fn start(&mut self, cfg: &Config, now_us: u64, learn: bool) {
        self.started = true;
        self.learn_until_us = if learn {
            now_us.saturating_add(cfg.ttl_us)
        } else {
            0
        };
        self.last_seq = 0;
        self.regions = vec![Held::default(); cfg.regions.len()];
    }

    /// Whether the home is in its learning phase at `now_us`. A home without state is: its
    /// first refresh starts the phase (only [`init`](Home::init) starts one without).
    pub fn learning(&self, now_us: u64) -> bool {
        !self.started || now_us < self.learn_until_us
    }

    /// Forget grants that expired by `now_us`.
    fn expire(&mut self, now_us: u64) {
        for r in &mut self.regions {
            if r.prev.is_some_and(|g| g.until_us <= now_us) {
                r.prev = None;
            }
            if r.last.is_some_and(|g| g.until_us <= now_us) {
                r.last = None;
            }
        }
    }

    /// The most region `j` may admit at from now on, as far as the home knows: its safe
    /// share, or a live grant it may still be using, whichever is larger.
    ///
    /// # Panics
    ///
    /// If `j` is not the index of a region of `cfg`.
    pub fn held(&self, cfg: &Config, j: usize) -> u64 {
        let share = |g: Option<Grant>| g.map_or(0, |g| g.share);
        let safe = cfg.regions[j].safe;
        match self.regions.get(j) {
            Some(r) => safe.max(share(r.prev)).max(share(r.last)),
            // A home without state knows only the safe shares.
            None => safe,
        }
    }

    /// Take region `i`'s report: a report holding the last grant (or a newer one) proves
    /// the grant before it can no longer be used (the local record only takes newer grants).
    fn take_report(&mut self, now_us: u64, i: usize, report: &Report) {
        let r = &mut self.regions[i];
        if r.last.is_some_and(|last| report.seq >= last.seq) {
            r.prev = None;
        }
        r.demand = report.demand;
        r.seen_us = now_us;
    }

    /// Region `i` says it now holds the lease `seq` (after applying a smaller share), so
    /// the rate it gave up is free for the others at once.
    ///
    /// # Panics
    ///
    /// If `i` is not the index of a region of `cfg`, or of the home (a home started with
    /// a `cfg` of fewer regions).
    pub fn ack(&mut self, cfg: &Config, now_us: u64, i: usize, report: &Report) {
        if !self.started {
            self.start(cfg, now_us, true);
        }
        self.expire(now_us);
        self.take_report(now_us, i, report);
    }

    /// The share each region should have now: `policy` over the rate left after the
    /// safe shares, on top of each region's safe share.
    pub fn targets(&self, cfg: &Config, now_us: u64) -> Vec<u64> {
        let safe = cfg
            .regions
            .iter()
            .fold(0u64, |sum, s| sum.saturating_add(s.safe));
        let free = cfg.rate.saturating_sub(safe);
        let weights: Vec<u64> = cfg.regions.iter().map(|s| s.weight).collect();
        let wants: Vec<u64> = self
            .regions
            .iter()
            .zip(&cfg.regions)
            .map(|(r, s)| {
                let fresh = r.seen_us > 0 && now_us < r.seen_us.saturating_add(cfg.stale_us);
                if fresh {
                    want(r.demand).saturating_sub(s.safe)
                } else {
                    0
                }
            })
            .collect();
        cfg.policy
            .divide(free, &weights, &wants)
            .into_iter()
            .zip(&cfg.regions)
            .map(|(part, s)| part.saturating_add(s.safe))
            .collect()
    }

    /// Region `i` refreshes at `now_us` with `report`: the lease it gets.
    ///
    /// 1. A home without state starts, in its learning phase for one lease length.
    /// 2. Expired grants are forgotten; the report may prove the grant before the last one
    ///    unused.
    /// 3. If the region may still use two grants (it has not reported holding the last),
    ///    it gets the last one again (marked learning or not as the home is now): at most
    ///    two grants per region are ever live.
    /// 4. Otherwise it gets its target, but at most what the other regions do not hold
    ///    (their safe shares and live grants, at their largest), and while learning at most
    ///    what it reports admitting at. A grant made while learning is marked so: the region
    ///    takes at most what it admits at when the grant arrives (a report can be older than
    ///    a shrink the region made and the home before the restart gave away).
    ///
    /// # Panics
    ///
    /// If `i` is not the index of a region of `cfg`, or of the home (a home started with
    /// a `cfg` of fewer regions).
    pub fn refresh(&mut self, cfg: &Config, now_us: u64, i: usize, report: &Report) -> Grant {
        if !self.started {
            self.start(cfg, now_us, true);
        }
        self.expire(now_us);
        self.take_report(now_us, i, report);
        if let (Some(_), Some(last)) = (self.regions[i].prev, self.regions[i].last) {
            return Grant {
                learning: self.learning(now_us),
                ..last
            };
        }
        let others = (0..cfg.regions.len())
            .filter(|&j| j != i)
            .fold(0u64, |sum, j| sum.saturating_add(self.held(cfg, j)));
        let mut share = self.targets(cfg, now_us)[i].min(cfg.rate.saturating_sub(others));
        let learning = self.learning(now_us);
        if learning {
            share = share.min(report.share);
        }
        // Later than every grant this home made, and than the lease the region holds (a
        // home restarted on a clock behind the old one would otherwise grant leases the
        // region's record refuses as older).
        let seq = now_us
            .max(self.last_seq.saturating_add(1))
            .max(report.seq.saturating_add(1));
        self.last_seq = seq;
        let grant = Grant {
            seq,
            share,
            until_us: now_us.saturating_add(cfg.ttl_us),
            learning,
        };
        let r = &mut self.regions[i];
        // The last grant becomes the one before; if it expired already, the one before (if
        // still live: leases of another length) stays counted.
        if r.last.is_some() {
            r.prev = r.last;
        }
        r.last = Some(grant);
        grant
    }
}
