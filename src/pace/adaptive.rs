//! `AdaptivePacer`: a [`Pacer`] whose rate follows the server's feedback.
//!
//! This file holds the public types, the controller's constants and the feedback calls;
//! `control` is the controller (its phase, the server's caps, probing, tracking), `meter`
//! counts responses, `rates` makes exact [`Rate`]s of the controller's rates, and
//! `builder` builds the pacer.

use std::collections::VecDeque;
use std::fmt;
use std::time::Duration;

use tokio::time::Instant;

use crate::metrics::{Counter, Gauge};
use crate::pace::{Pacer, UntilReady};
use crate::rate::Rate;
use crate::sync::{Arc, Mutex, Panics};
use crate::time::capped;

mod builder;
mod control;
mod meter;
mod rates;

pub use builder::AdaptivePacerBuilder;
use control::allowance_hold;
use meter::Meter;

/// Names of the adaptive pacing metrics.
pub(crate) mod names {
    pub(crate) const RATE: &str = "flowgate_pace_adaptive_rate";
    pub(crate) const PAUSES: &str = "flowgate_pace_adaptive_pauses_total";
    pub(crate) const CUTS: &str = "flowgate_pace_adaptive_cuts_total";
}

/// How long the server's fields steer the rate after the last one was seen.
const FIELDS_FRESH: Duration = Duration::from_secs(2);
/// The span over which the trend of the server's remaining is fitted.
const TREND_SPAN: Duration = Duration::from_millis(500);
/// The shortest span a trend is fitted over.
const TREND_MIN_SPAN: Duration = Duration::from_millis(150);
/// The most samples of the server's remaining kept for the trend.
const TREND_SAMPLES: usize = 64;
/// The responses in the last second from which what got through measures the rate: with
/// fewer, a success more or less is a quarter of the figure or more (or nothing was sent to
/// measure: a caller idle, or a pacer just built), and a cut is by `decrease` alone.
const MEASURED_FROM: u64 = 4;
/// The longest step the controller integrates at once (a long idle spell is not growth).
const MAX_STEP: Duration = Duration::from_secs(1);
/// Tracking: the gain of the rate's correction, per second, per unit of relative error.
const TRACK_GAIN: f64 = 2.0;
/// Tracking: the share of its quota the server's remaining is steered to.
const TRACK_LEVEL: f64 = 0.25;
/// Tracking: how fast the server's remaining is steered back to its level (seconds).
const TRACK_LEVEL_TIME: f64 = 2.0;
/// Tracking: the largest relative error acted on.
const MAX_ERROR: f64 = 0.5;
/// Probing: the climb accelerates by its base step every this many seconds without a cut.
const PROBE_ACCEL_SECS: f64 = 2.0;
/// Below this share of the last good rate, the climb doubles the rate every second.
const SLOW_START_BELOW: f64 = 0.5;
/// The share of its rate a caller must use for the rate to grow (not app-limited).
const USED_SHARE: f64 = 0.8;
/// A change of the rate smaller than this share is not passed to the pacer (unless the
/// pacer's rate is above the cap: see `apply`).
const APPLY_SHARE: f64 = 0.001;
/// The lowest cap the server's fields set, per second (one per 1 000 s): the rate stays
/// positive even when the server allows nothing until its reset, and a hostile field holds
/// no unit longer than 1 000 s. A configured ceiling below it still caps the rate.
const MIN_CAP: f64 = 1.0 / LONGEST_HOLD.as_secs() as f64;
/// The longest an allowance of nothing left holds the pacer: one unit at [`MIN_CAP`]
/// (a reset further away is a hostile or mistaken field, as a cap below `MIN_CAP` is).
const LONGEST_HOLD: Duration = Duration::from_secs(1_000);

/// What the [`AdaptivePacer`] is doing; part of its [`AdaptiveStatus`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Phase {
    /// No recent server fields: the rate climbs while the caller uses it, and is cut on
    /// back-pressure (additive increase, multiplicative decrease).
    Probing,
    /// The server's `RateLimit` fields are fresh: the rate is steered so that the server's
    /// remaining stays near a quarter of its quota.
    Tracking,
    /// Back-pressure with a `Retry-After`: nothing passes until it has elapsed.
    Paused,
}

/// A snapshot of an [`AdaptivePacer`], from [`AdaptivePacer::status`].
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct AdaptiveStatus {
    /// What the pacer is doing.
    pub phase: Phase,
    /// The current rate, per second.
    pub rate_per_second: f64,
    /// The highest rate allowed now: the configured ceiling, lowered by the server's policy
    /// and allowance.
    pub ceiling_per_second: f64,
    /// The rate that last got through before a cut (what the climb aims back at).
    pub last_good_per_second: f64,
    /// Until when nothing passes, while paused.
    pub paused_until: Option<Instant>,
    /// The server's last remaining (`r`), if it sends one.
    pub server_remaining: Option<u64>,
    /// The server's last policy (`q` within `w`), if it sends one (`None` once it was not
    /// sent again for longer than its window).
    pub server_policy: Option<(u64, Duration)>,
    /// How many times back-pressure cut the rate.
    pub cuts: u64,
    /// How many times back-pressure paused the pacer.
    pub pauses: u64,
}

/// A [`Pacer`] whose rate follows the server's feedback: it pauses on `Retry-After`, cuts
/// its rate on back-pressure, climbs back while it is used, and never sends faster than the
/// server's `RateLimit` fields allow, down to one unit per 1 000 s (a server's cap below
/// that, `q=1;w=3600` say, still lets one unit through every 1 000 s, so that a hostile or
/// mistaken field cannot hold a client for years; a configured ceiling below it holds).
///
/// Outbound calls go through [`pacer`](AdaptivePacer::pacer) (so `stream.leaky_with`,
/// `sink.leaky_sink_with` and [`Pacer::until_ready`] all follow the adaptive rate), or
/// through [`until_ready`](AdaptivePacer::until_ready). Each response is reported with
/// the feedback calls, which are cheap (one short lock), never wait, and need no runtime:
///
/// | response | call |
/// |---|---|
/// | success | [`on_success`](AdaptivePacer::on_success) |
/// | 429, 503, timeout (back-pressure) | [`on_back_pressure`](AdaptivePacer::on_back_pressure)`(retry_after)` |
/// | `RateLimit: "p";r=R;t=T` (any response) | [`on_allowance`](AdaptivePacer::on_allowance)`(R, T s)` |
/// | `RateLimit-Policy: "p";q=Q;w=W` | [`on_policy`](AdaptivePacer::on_policy)`(Q, W s)` |
///
/// Report the fields before the outcome. Clones share the state: every task sending to
/// one server reports to one `AdaptivePacer`.
///
/// # State machine
///
/// ```text
///                  back-pressure: cut the rate ×β (once per epoch),
///                  pause until Retry-After
///   ┌──────────┐ ─────────────────────────────────────▶ ┌──────────┐
///   │ Probing  │                                        │  Paused  │
///   │  climb   │ ◀───────── Retry-After elapsed ─────── │ (no unit │
///   └──────────┘        (to Tracking if fields fresh)   │  passes) │
///     │     ▲                                           └──────────┘
///     │     │ no fields for 2 s                              ▲
///     ▼     │                                                │ back-pressure
///   ┌──────────┐ ────────────────────────────────────────────┘
///   │ Tracking │  steer the server's remaining toward q/4
///   └──────────┘
/// ```
///
/// - **Back-pressure** ([`on_back_pressure`](AdaptivePacer::on_back_pressure)): with a
///   `Retry-After`, every waiter is held until it has elapsed ([`Pacer::pause_until`]; a
///   later hint extends the pause, the schedule then resumes without a burst). The rate is
///   cut to `β ×` itself, or to what actually got through in the last second if that is
///   lower (when 4 responses or more came back in that second: with fewer, one success more
///   or less is a large part of that figure, or nothing was sent to measure), never below
///   the floor. One congestion epoch gets one cut: the responses to
///   requests sent before the cut (the others in flight) only extend the pause. The epoch
///   ends when the pause does, but never before the
///   [`cooldown`](AdaptivePacerBuilder::cooldown) has passed since the cut (so after a
///   `Retry-After` shorter than it, or none, it ends with the cooldown).
/// - **Probing** (no fields): the rate climbs by `increase ×` the last good rate per
///   second, a step that grows the longer no cut came (so a server that raised its limit
///   is found in seconds), and doubles every second while below half the last good rate
///   (after a deep cut). Growth is per second of time, not per response, so it does not
///   depend on the rate. After an outage in which nothing got through, the cuts take the
///   last good rate down with the rate, to the floor: the climb back starts from there,
///   with no memory of the rate before the outage, and takes tens of seconds, not seconds,
///   to get back to a rate a hundred times the floor.
/// - **Tracking** (the server sends `RateLimit` and `RateLimit-Policy`): the server's
///   remaining `r` is a shared bucket that every client of that server drains; its trend is
///   the aggregate's surplus over the sustained rate `q / w`. The rate is corrected by the
///   same factor the aggregate is off, steering `r` toward `q / 4` (headroom for bursts of the
///   other clients, without leaving most of the quota unused): the rate drops before
///   any 429 when the bucket drains, and climbs when it fills. `r` is taken to be of the
///   policy given to [`on_policy`](AdaptivePacer::on_policy) (`RetryLayer`, which gives
///   it the slowest of several, steers the remaining of the one closest to refusing by
///   that policy's own `q` and `w`).
/// - **Never faster than the server allows**: the rate stays at or below `q / w` of the
///   last policy, and, until the reset `t` of an allowance, at or below `r / t` (or `q / w`
///   when that is higher: a token bucket refills during `t`); the burst never sends more
///   than the `r` the server has (plus what `q / w` refills before `t`).
/// - **Never growing unused**: the rate grows only while the caller uses at least 80 % of
///   it (someone waits for the pacer, not counting a waiter [stepped over](Pacer#guarantees)
///   while its task does not poll it, nor a first one that has left its turn unclaimed for
///   as long, with nobody behind it; or that many responses came back in the last second).
///
/// Everything runs on `tokio::time`, so under paused time it is deterministic.
///
/// # Metrics
///
/// Labelled by the `name`: `flowgate_pace_adaptive_rate` (gauge, per second),
/// `flowgate_pace_adaptive_pauses_total`, `flowgate_pace_adaptive_cuts_total`; the inner
/// pacer reports the [pacing metrics](crate::pace) under the same name.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use flowgate::pace::AdaptivePacer;
/// use flowgate::Rate;
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let adaptive = AdaptivePacer::builder(Rate::per_second(100)?).name("payments").build()?;
/// let start = tokio::time::Instant::now();
/// adaptive.until_ready(1).await?;
/// // The server answered 429 with `Retry-After: 2`.
/// adaptive.on_back_pressure(Some(Duration::from_secs(2)));
/// assert!(adaptive.rate().per_second_f64() < 100.0);
/// adaptive.until_ready(1).await?;
/// assert_eq!(start.elapsed(), Duration::from_secs(2));
/// assert_eq!(adaptive.status().cuts, 1);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct AdaptivePacer {
    inner: Arc<Shared>,
}

struct Shared {
    pacer: Pacer,
    config: Config,
    control: Mutex<Control>,
    rate_gauge: Gauge,
    pauses: Counter,
    cuts: Counter,
}

#[derive(Debug, Clone, Copy)]
struct Config {
    ceiling: f64,
    floor: f64,
    /// The ceiling and the floor as given (exact), handed to the pacer at those bounds.
    ceiling_rate: Rate,
    floor_rate: Rate,
    /// The pacer's largest burst: its default burst at the ceiling (the burst moves with
    /// the rate, which never passes the ceiling).
    ceiling_burst: u32,
    decrease: f64,
    increase: f64,
    cooldown: Duration,
}

/// The controller's state, behind the lock.
#[derive(Debug)]
struct Control {
    rate: f64,
    /// The rate last given to the pacer.
    applied: f64,
    last_good: f64,
    last_update: Instant,
    last_cut: Instant,
    /// No cut before this instant (the current congestion epoch).
    epoch_end: Option<Instant>,
    paused_until: Option<Instant>,
    /// The server's sustained rate (`q / w`, per second), its quota `q` and window `w`,
    /// and when it was last given (it lapses a window later: see [`Control::policy`]).
    policy: Option<(f64, u64, Duration, Instant)>,
    /// A cap from the server's allowance, per second, and until when it holds.
    allowance: Option<(f64, Instant)>,
    /// The server's remaining, as reported (time, r).
    remaining: VecDeque<(Instant, u64)>,
    /// The sustained rate (per second) and quota of the policy `remaining` belongs to,
    /// when it was reported with it; else it is taken as `policy`'s.
    remaining_of: Option<(f64, u64)>,
    successes: Meter,
    responses: Meter,
    cuts: u64,
    pauses: u64,
}

impl Control {
    /// The server's policy (sustained rate, `q`, `w`), unless it lapsed: not given again for
    /// longer than its window (a server that stopped sending it, or a proxy's page that
    /// carried it once, caps nothing after that).
    fn policy(&self, now: Instant) -> Option<(f64, u64, Duration)> {
        self.policy
            .filter(|&(_, _, window, seen)| now.saturating_duration_since(seen) <= window)
            .map(|(sustained, quota, window, _)| (sustained, quota, window))
    }
}

impl AdaptivePacer {
    /// A builder for an adaptive pacer that never sends faster than `ceiling`.
    pub fn builder(ceiling: Rate) -> AdaptivePacerBuilder {
        AdaptivePacerBuilder::new(ceiling)
    }

    /// The pacer whose rate this one steers: give it to `stream.leaky_with`,
    /// `sink.leaky_sink_with`, or wait on it with [`Pacer::until_ready`].
    pub fn pacer(&self) -> &Pacer {
        &self.inner.pacer
    }

    /// Wait until `cost` units may pass at the current rate, then take them: the inner
    /// pacer's [`until_ready`](Pacer::until_ready).
    ///
    /// # Errors
    ///
    /// As [`Pacer::until_ready`]: [`CostError`](crate::CostError) for a zero cost or one
    /// above the burst. The burst is the pacer's default for the current rate
    /// ([`Pacer::default_quota`]: `1 + ceil(rate × 5 ms)`), so it moves with the rate: a
    /// cost that passed before a cut may be refused after it (and a wait already queued for
    /// it ends with that error). Split large costs into units of 1, or pace them with
    /// [`leaky_cost`](crate::FlowStreamExt::leaky_cost), which waits for one chunk of at
    /// most the burst at a time.
    ///
    /// # Panics
    ///
    /// As [`Pacer::until_ready`]: a wait needs a tokio runtime with timers.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe, as [`Pacer::until_ready`].
    pub fn until_ready(&self, cost: u32) -> UntilReady {
        self.inner.pacer.until_ready(cost)
    }

    /// How long one unit would wait for the pacer if it joined the line now (see
    /// `Inner::wait_estimate`); takes nothing.
    pub(crate) fn wait_estimate(&self) -> Duration {
        self.inner.pacer.inner().wait_estimate(1)
    }

    /// A request succeeded: the rate may climb (see the type's docs).
    pub fn on_success(&self) {
        let now = Instant::now();
        let mut c = self.inner.lock();
        c.successes.record(now);
        c.responses.record(now);
        self.inner.step(&mut c, now);
        let rate = self.inner.apply(&mut c, now);
        drop(c);
        self.inner.hand_over(rate);
    }

    /// The server pushed back (429, 503, a timeout), with its `Retry-After` if it sent one:
    /// pause every waiter until then, and cut the rate once per congestion epoch.
    ///
    /// The pause extends an earlier one that ends sooner; a pause never brings the schedule
    /// forward. A `retry_after` longer than a century is taken as a century.
    pub fn on_back_pressure(&self, retry_after: Option<Duration>) {
        let now = Instant::now();
        let mut c = self.inner.lock();
        c.responses.record(now);
        self.inner.step(&mut c, now);
        let pause_end = retry_after.map(|d| now + capped(d));
        if let Some(end) = pause_end {
            if c.paused_until.is_none_or(|p| p < end) {
                c.paused_until = Some(end);
            }
            c.pauses += 1;
        }
        let new_epoch = c.epoch_end.is_none_or(|e| now >= e);
        if new_epoch {
            let seen = c.successes.per_second(now);
            let measured = if c.responses.count(now) >= MEASURED_FROM {
                seen
            } else {
                c.rate
            };
            // What got through is bounded by the rate, unless a cap of the server's holds
            // the rate below it: an allowance reported with this response (`r=0` until a
            // reset, say) ends by itself and is no measure of the downstream, so the climb
            // after it aims at what got through, not at the cap.
            let capped = self.inner.cap(&c, now) < self.inner.config.ceiling;
            let sent = if capped { c.rate.max(measured) } else { c.rate };
            let good = sent.min(measured.max(self.inner.config.floor));
            let cut = (c.rate * self.inner.config.decrease).min(measured);
            c.last_good = good;
            c.rate = cut;
            self.inner.bound(&mut c, now);
            c.last_cut = now;
            c.cuts += 1;
            let epoch = pause_end
                .unwrap_or(now)
                .max(now + self.inner.config.cooldown);
            c.epoch_end = Some(epoch);
        } else if let (Some(end), Some(epoch)) = (pause_end, c.epoch_end) {
            // Still the same congestion: the epoch lasts as long as its pause.
            c.epoch_end = Some(epoch.max(end));
        }
        let rate = self.inner.apply(&mut c, now);
        drop(c);
        // The pause first: the cut wakes the pacer's waiters, and none may pass before the
        // `Retry-After` (a quota change keeps a pause). Each step runs whatever the one
        // before did (user code runs in them: a waiter's waker, a metrics recorder): a cut
        // the pause's panic kept from the pacer was lost for good (the next rate within
        // 0.1 % of it is not handed over). The first panic goes on once all have run.
        let mut panics = Panics::new();
        if let Some(end) = pause_end {
            panics.run(|| self.inner.pacer.pause_until(end));
        }
        panics.run(|| self.inner.hand_over(rate));
        // Counted once the pause and the cut are the pacer's: a metrics recorder is user
        // code, run after the lock and unable to cost them by panicking.
        if pause_end.is_some() {
            panics.run(|| self.inner.pauses.increment(1));
        }
        if new_epoch {
            panics.run(|| self.inner.cuts.increment(1));
        }
        panics.resume();
    }

    /// The server's allowance, seen on any response: `remaining` units within `reset` (the
    /// `r` and `t` of the IETF `RateLimit` field, or `X-RateLimit-Remaining` / `-Reset`).
    ///
    /// Until `reset` has elapsed the rate stays at or below `remaining / reset` (or the
    /// policy's `q / w` when that is higher; a `remaining` of 0 counts as 1, so the pacer
    /// is not held past the reset). Whatever the pacer's burst held, no more units pass
    /// than the server has: at most `remaining` at once, and before the reset at most
    /// `remaining` plus the units the policy's `q / w` refills by then (a token bucket
    /// refills during `t`; none without a policy). With nothing remaining, no unit passes
    /// before the reset, or before one unit of the policy's `q / w` when that is sooner:
    /// that one unit is the one the server has again (or 1 000 s, when that is sooner:
    /// a hostile or mistaken field holds no unit longer, as no cap is below one unit per
    /// 1 000 s). The burst's timer tolerance is kept
    /// from then on (a late wake-up still catches up, up to what the server allows), and
    /// an allowance the pacer cannot use up before its reset (its burst at the ceiling and
    /// its fastest rate until then, the ceiling or the cap above if lower, pass no more
    /// than `remaining` by then) holds no unit at all: reported with every response, it
    /// costs the pacer nothing of its rate.
    /// With a policy known, the remaining steers the rate (see
    /// [Tracking](AdaptivePacer#state-machine)): report the remaining of the policy given
    /// to [`on_policy`](AdaptivePacer::on_policy).
    pub fn on_allowance(&self, remaining: u64, reset: Duration) {
        self.on_allowance_of(remaining, reset, None);
    }

    /// [`on_allowance`](AdaptivePacer::on_allowance) of the policy of `quota` units per
    /// `window`, which may not be the one given to [`on_policy`](AdaptivePacer::on_policy)
    /// (the slowest, where the remaining is of the one closest to refusing): tracking
    /// steers the remaining by its own policy's quota and rate, and only that policy
    /// refills it before the reset (a zero quota, whatever the window: nothing does).
    /// `None` (or a zero window): the policy given to `on_policy`.
    pub(crate) fn on_allowance_of(
        &self,
        remaining: u64,
        reset: Duration,
        policy: Option<(u64, Duration)>,
    ) {
        let now = Instant::now();
        // `Some(None)`: a policy of zero quota, which refills nothing.
        let own = match policy {
            Some((0, _)) => Some(None),
            Some((q, w)) if !w.is_zero() => Some(Some((q, w))),
            _ => None,
        };
        let of = own.flatten().map(|(q, w)| (q as f64 / w.as_secs_f64(), q));
        let mut c = self.inner.lock();
        if c.remaining_of != of {
            // Another policy's remaining: the samples before are no trend of it.
            c.remaining.clear();
            c.remaining_of = of;
        }
        while c.remaining.len() >= TREND_SAMPLES
            || c.remaining
                .front()
                .is_some_and(|&(at, _)| now.saturating_duration_since(at) > TREND_SPAN)
        {
            c.remaining.pop_front();
        }
        c.remaining.push_back((now, remaining));
        let mut hold = None;
        if !reset.is_zero() {
            // What refills the remaining before the reset: its own policy, else the
            // slowest (which refills no faster).
            let refill = own.unwrap_or_else(|| c.policy(now).map(|(_, q, w)| (q, w)));
            let sustained = refill.map_or(0.0, |(q, w)| q as f64 / w.as_secs_f64());
            // At least one unit within `reset`: a cap below that would hold the pacer's
            // schedule (one unit per 1 / cap) far past the reset.
            let cap = (remaining.max(1) as f64 / reset.as_secs_f64()).max(sustained);
            let reset = capped(reset);
            c.allowance = Some((cap, now + reset));
            // An allowance the pacer cannot use up before its reset holds nothing: its
            // largest burst and its fastest rate until then (the ceiling, or this cap) pass
            // at most `remaining` by the reset. Held, each report (one per response) set the
            // schedule to one unit at that instant, and the units a late timer tick was to
            // catch up were lost whenever a response came between ticks (a pacer at 3 000/s
            // ran 10 % slow with a million left within a minute).
            let fastest = self.inner.config.ceiling.min(cap.max(MIN_CAP));
            // One unit more for the rounding of the product; compared exactly below 2^53.
            let passes = f64::from(self.inner.config.ceiling_burst)
                + (fastest * reset.as_secs_f64()).ceil()
                + 1.0;
            if passes >= 9_007_199_254_740_992.0 || remaining < passes as u64 {
                hold = allowance_hold(now, remaining, reset, refill)
                    .map(|at| at.min(now + LONGEST_HOLD));
            }
        }
        self.inner.step(&mut c, now);
        let rate = self.inner.apply(&mut c, now);
        drop(c);
        // The hold first: a new rate wakes the pacer's waiters (a quota change keeps it).
        // A waker's panic as the hold wakes them does not keep the rate from the pacer.
        let mut panics = Panics::new();
        if let Some(at) = hold {
            panics.run(|| self.inner.pacer.pause_until(at));
        }
        panics.run(|| self.inner.hand_over(rate));
        panics.resume();
    }

    /// The server's policy: `quota` units per `window` (the `q` and `w` of the IETF
    /// `RateLimit-Policy` field): the rate stays at or below `quota / window`. A zero quota
    /// or window is ignored. A policy not given again for longer than its window lapses
    /// (the server stopped sending it): it caps nothing after that.
    pub fn on_policy(&self, quota: u64, window: Duration) {
        if quota == 0 || window.is_zero() {
            return;
        }
        let now = Instant::now();
        let mut c = self.inner.lock();
        let sustained = quota as f64 / window.as_secs_f64();
        c.policy = Some((sustained, quota, window, now));
        self.inner.step(&mut c, now);
        let rate = self.inner.apply(&mut c, now);
        drop(c);
        self.inner.hand_over(rate);
    }

    /// The current rate.
    pub fn rate(&self) -> Rate {
        self.inner.pacer.quota().rate()
    }

    /// A snapshot of the controller.
    pub fn status(&self) -> AdaptiveStatus {
        let now = Instant::now();
        let c = self.inner.lock();
        let phase = self.inner.phase(&c, now);
        AdaptiveStatus {
            phase,
            rate_per_second: c.rate,
            ceiling_per_second: self.inner.cap(&c, now),
            last_good_per_second: c.last_good,
            paused_until: c.paused_until.filter(|&p| p > now),
            server_remaining: c.remaining.back().map(|&(_, r)| r),
            server_policy: c.policy(now).map(|(_, q, w)| (q, w)),
            cuts: c.cuts,
            pauses: c.pauses,
        }
    }

    /// The name, if it was given one.
    pub fn name(&self) -> Option<&str> {
        self.inner.pacer.name()
    }
}

impl fmt::Debug for AdaptivePacer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdaptivePacer")
            .field("name", &self.name())
            .field("status", &self.status())
            .finish()
    }
}
