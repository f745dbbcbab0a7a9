//! `AdaptivePacer`: a [`Pacer`] whose rate follows the server's feedback.

use std::collections::VecDeque;
use std::fmt;
use std::sync::PoisonError;
use std::time::Duration;

use tokio::time::Instant;

use crate::error::{ConfigError, ConfigErrorKind};
use crate::metrics::{Counter, Gauge, Labels};
use crate::pace::{Pacer, UntilReady};
use crate::rate::{Rate, cmp_rate};
use crate::sync::{Arc, Mutex, MutexGuard};
use crate::time::capped;

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
/// One bucket of the response meter; the meter spans `METER_BUCKETS` of them.
const METER_BUCKET: Duration = Duration::from_millis(250);
const METER_BUCKETS: usize = 4;
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
const MIN_CAP: f64 = 0.001;
/// The longest period of the rates handed to the pacer, in nanoseconds (within `u64`).
const LONGEST_PERIOD_NS: u64 = 10_000_000_000_000_000_000;

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
    /// The server's last policy (`q` within `w`), if it sends one.
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
///   depend on the rate.
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
///   while its task does not poll it, or that many responses came back in the last second).
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
    /// The server's sustained rate (`q / w`, per second), its quota `q` and window `w`.
    policy: Option<(f64, u64, Duration)>,
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

/// Counts events over the last second, in four buckets of 250 ms.
#[derive(Debug)]
struct Meter {
    origin: Instant,
    /// The index (since `origin`) of the newest bucket.
    newest: u64,
    buckets: [u64; METER_BUCKETS],
}

impl Meter {
    fn new(origin: Instant) -> Meter {
        Meter {
            origin,
            newest: 0,
            buckets: [0; METER_BUCKETS],
        }
    }

    fn index(&self, now: Instant) -> u64 {
        let since = now.saturating_duration_since(self.origin).as_nanos();
        u64::try_from(since / METER_BUCKET.as_nanos()).unwrap_or(u64::MAX)
    }

    fn roll(&mut self, now: Instant) {
        let index = self.index(now);
        let stale = index.saturating_sub(self.newest);
        for k in 1..=stale.min(METER_BUCKETS as u64) {
            let slot = (self.newest.wrapping_add(k) % METER_BUCKETS as u64) as usize;
            self.buckets[slot] = 0;
        }
        self.newest = self.newest.max(index);
    }

    fn record(&mut self, now: Instant) {
        self.roll(now);
        let slot = (self.newest % METER_BUCKETS as u64) as usize;
        self.buckets[slot] = self.buckets[slot].saturating_add(1);
    }

    /// Events over the buckets kept (at most the last second, plus the current bucket's
    /// part).
    fn count(&mut self, now: Instant) -> u64 {
        self.roll(now);
        self.buckets.iter().sum()
    }

    /// Events per second over the buckets kept (at most the last second, plus the
    /// current bucket's part), or since the origin when that is shorter.
    fn per_second(&mut self, now: Instant) -> f64 {
        let total = self.count(now);
        let since = now.saturating_duration_since(self.origin).as_nanos();
        let bucket = METER_BUCKET.as_nanos();
        let into_newest = since.saturating_sub(bucket * u128::from(self.newest));
        let span = (bucket * (METER_BUCKETS as u128 - 1) + into_newest).min(since);
        if span == 0 {
            return 0.0;
        }
        total as f64 * 1e9 / span as f64
    }
}

impl AdaptivePacer {
    /// A builder for an adaptive pacer that never sends faster than `ceiling`.
    pub fn builder(ceiling: Rate) -> AdaptivePacerBuilder {
        AdaptivePacerBuilder {
            ceiling,
            floor: None,
            initial: None,
            decrease: 0.7,
            increase: 0.05,
            cooldown: Duration::from_millis(200),
            name: None,
        }
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
        // `Retry-After` (a quota change keeps a pause).
        if let Some(end) = pause_end {
            self.inner.pacer.pause_until(end);
        }
        self.inner.hand_over(rate);
        // Counted once the pause and the cut are the pacer's: a metrics recorder is user
        // code, run after the lock and unable to cost them by panicking.
        if pause_end.is_some() {
            self.inner.pauses.increment(1);
        }
        if new_epoch {
            self.inner.cuts.increment(1);
        }
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
    /// that one unit is the one the server has again. The burst's timer tolerance is kept
    /// from then on (a late wake-up still catches up, up to what the server allows).
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
            let refill = own.unwrap_or_else(|| c.policy.map(|(_, q, w)| (q, w)));
            let sustained = refill.map_or(0.0, |(q, w)| q as f64 / w.as_secs_f64());
            // At least one unit within `reset`: a cap below that would hold the pacer's
            // schedule (one unit per 1 / cap) far past the reset.
            let cap = (remaining.max(1) as f64 / reset.as_secs_f64()).max(sustained);
            let reset = capped(reset);
            c.allowance = Some((cap, now + reset));
            hold = allowance_hold(now, remaining, reset, refill);
        }
        self.inner.step(&mut c, now);
        let rate = self.inner.apply(&mut c, now);
        drop(c);
        // The hold first: a new rate wakes the pacer's waiters (a quota change keeps it).
        if let Some(at) = hold {
            self.inner.pacer.pause_until(at);
        }
        self.inner.hand_over(rate);
    }

    /// The server's policy: `quota` units per `window` (the `q` and `w` of the IETF
    /// `RateLimit-Policy` field): the rate stays at or below `quota / window`. A zero quota
    /// or window is ignored.
    pub fn on_policy(&self, quota: u64, window: Duration) {
        if quota == 0 || window.is_zero() {
            return;
        }
        let now = Instant::now();
        let mut c = self.inner.lock();
        let sustained = quota as f64 / window.as_secs_f64();
        c.policy = Some((sustained, quota, window));
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
            server_policy: c.policy.map(|(_, q, w)| (q, w)),
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

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Control> {
        self.control.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn phase(&self, c: &Control, now: Instant) -> Phase {
        if c.paused_until.is_some_and(|p| p > now) {
            Phase::Paused
        } else if self.tracking(c, now) {
            Phase::Tracking
        } else {
            Phase::Probing
        }
    }

    fn tracking(&self, c: &Control, now: Instant) -> bool {
        c.policy.is_some()
            && c.remaining
                .back()
                .is_some_and(|&(at, _)| now.saturating_duration_since(at) <= FIELDS_FRESH)
    }

    /// The highest rate allowed now. The floor bounds the cuts, never the server: a policy
    /// or an allowance below the floor caps the rate below it.
    fn cap(&self, c: &Control, now: Instant) -> f64 {
        let mut server = f64::INFINITY;
        if let Some((sustained, _, _)) = c.policy {
            server = server.min(sustained);
        }
        if let Some((allowed, until)) = c.allowance
            && now < until
        {
            server = server.min(allowed);
        }
        self.config.ceiling.min(server.max(MIN_CAP))
    }

    /// Keep the rate at or above the floor, then at or below the cap.
    fn bound(&self, c: &mut Control, now: Instant) {
        c.rate = c.rate.max(self.config.floor).min(self.cap(c, now));
    }

    /// Whether the caller uses the rate (so that growing it means something). A waiter
    /// stepped over does not: its task is not polling it.
    fn in_use(&self, c: &mut Control, now: Instant) -> bool {
        self.pacer.inner().has_present_waiter()
            || c.responses.per_second(now) >= USED_SHARE * c.rate
    }

    /// Advance the controller to `now`.
    fn step(&self, c: &mut Control, now: Instant) {
        let dt = now.saturating_duration_since(c.last_update).min(MAX_STEP);
        c.last_update = now;
        let paused = c.paused_until.is_some_and(|p| p > now);
        if !paused {
            c.paused_until = None;
        }
        let dt = dt.as_secs_f64();
        if !paused && dt > 0.0 {
            if self.tracking(c, now) {
                self.track(c, now, dt);
            } else if self.in_use(c, now) {
                self.probe(c, now, dt);
            }
        }
        self.bound(c, now);
    }

    /// Probing: climb (additive, accelerating; doubling while far below the last good rate).
    fn probe(&self, c: &mut Control, now: Instant, dt: f64) {
        if c.rate < SLOW_START_BELOW * c.last_good {
            c.rate = (c.rate * dt.exp2()).min(SLOW_START_BELOW * c.last_good);
        } else {
            let quiet = now.saturating_duration_since(c.last_cut).as_secs_f64();
            let step = self.config.increase * c.last_good * (1.0 + quiet / PROBE_ACCEL_SECS);
            c.rate += step * dt;
        }
    }

    /// Tracking: correct the rate by the aggregate's relative error (see the type's docs).
    fn track(&self, c: &mut Control, now: Instant, dt: f64) {
        // The remaining's own policy, when known: steered by another's quota, a second's
        // remaining reads as a day's bucket almost empty.
        let Some((sustained, quota)) = c
            .remaining_of
            .or_else(|| c.policy.map(|(sustained, quota, _)| (sustained, quota)))
        else {
            return;
        };
        let Some(&(_, r)) = c.remaining.back() else {
            return;
        };
        let q = quota as f64;
        let r = (r as f64).min(q);
        let target = sustained + (r - TRACK_LEVEL * q) / TRACK_LEVEL_TIME;
        // The bucket's trend is the aggregate's shortfall (it cannot show one when full or
        // empty: then only the level speaks).
        let full = r >= q - (q / 50.0).max(1.0);
        let trend = if full || r < 1.0 {
            0.0
        } else {
            trend(&c.remaining, now).unwrap_or(0.0)
        };
        let aggregate = sustained - trend;
        let error = if full {
            // Below the sustained rate by an unknown amount: climb at the fastest pace.
            MAX_ERROR
        } else {
            ((target - aggregate) / sustained).clamp(-MAX_ERROR, MAX_ERROR)
        };
        if error > 0.0 && !self.in_use(c, now) {
            return;
        }
        c.rate *= (TRACK_GAIN * error * dt).exp();
    }

    /// The rate to hand to the pacer, when it changed enough, or when the rate the pacer
    /// has is above the cap now (a server's cap a hair below it: never faster than the
    /// server allows): give it to [`hand_over`](Inner::hand_over) once the control lock is
    /// released (the pacer wakes its waiters when its quota changes).
    fn apply(&self, c: &mut Control, now: Instant) -> Option<f64> {
        if (c.rate - c.applied).abs() <= APPLY_SHARE * c.applied && c.applied <= self.cap(c, now) {
            return None;
        }
        c.applied = c.rate;
        Some(c.rate)
    }

    /// Hand a rate from [`apply`](Inner::apply) to the pacer and the gauge; call without the
    /// control lock. Two callers may hand over in the opposite order to the one they applied
    /// in: each checks afterwards that the pacer has the latest applied rate, and hands that
    /// over if not, so the last word is always the latest rate.
    fn hand_over(&self, mut rate: Option<f64>) {
        while let Some(r) = rate {
            self.pacer
                .set_quota(Pacer::default_quota(self.config.pacer_rate(r)));
            self.rate_gauge.set(r);
            let latest = self.lock().applied;
            rate = (latest != r).then_some(latest);
        }
    }
}

/// The earliest the pacer's next unit may be due once the server reported `remaining`
/// units within `reset`, refilled before it by `refill` (`q` per `w`; none: nothing comes
/// back before the reset), so that no more pass than the server has, whatever the
/// bucket held. Until the reset the pacer runs at most at the allowance's cap, one unit
/// per `p = min(reset / max(r, 1), w / q)`; the next unit is due no earlier than
/// `now − x·p`, with `x = min(r, max(1, ⌈reset · q / w⌉)) − 1`: at most `r` units at once,
/// and before the reset no more than `r` plus the units refilled by then (at a cap of
/// `r / reset`, above the refill, only the refilled units may run ahead). With nothing
/// remaining, `x = −1`: `now + p`, when the server has one unit again. `None` when that
/// instant is before any this clock can tell (the bucket cannot hold that many units).
fn allowance_hold(
    now: Instant,
    remaining: u64,
    reset: Duration,
    refill: Option<(u64, Duration)>,
) -> Option<Instant> {
    let (r, t) = (u128::from(remaining), reset.as_nanos());
    // In `u128`: `reset` is at most a century (`capped`), under 2^62 ns.
    let refilled = refill.map_or(0, |(q, w)| (t * u128::from(q)).div_ceil(w.as_nanos()));
    let Some(x) = r.min(refilled.max(1)).checked_sub(1) else {
        // Nothing remaining: one period, rounded up (never sooner than the server).
        let p = refill.map_or(t, |(q, w)| t.min(w.as_nanos().div_ceil(u128::from(q))));
        return Some(now + Duration::from_nanos(u64::try_from(p).unwrap_or(u64::MAX)));
    };
    // `x` periods, rounded down (never more units than the server has); `x·w < t·q`.
    let lead = refill.map_or(x * t / r, |(q, w)| {
        (x * t / r).min(x * w.as_nanos() / u128::from(q))
    });
    now.checked_sub(Duration::from_nanos(u64::try_from(lead).ok()?))
}

/// The least-squares slope of the server's remaining over the last `TREND_SPAN`, in units
/// per second; `None` with too few samples or too short a span.
fn trend(samples: &VecDeque<(Instant, u64)>, now: Instant) -> Option<f64> {
    let first = samples.front()?.0;
    // Read in place (it runs on every response): two passes over the recent samples.
    let points = || {
        samples
            .iter()
            .filter(move |&&(at, _)| now.saturating_duration_since(at) <= TREND_SPAN)
            .map(move |&(at, r)| (at.saturating_duration_since(first).as_secs_f64(), r as f64))
    };
    let (mut count, mut sum_t, mut sum_r) = (0usize, 0.0, 0.0);
    let (mut first_t, mut last_t) = (None, 0.0);
    for (t, r) in points() {
        count += 1;
        sum_t += t;
        sum_r += r;
        first_t.get_or_insert(t);
        last_t = t;
    }
    if count < 3 {
        return None;
    }
    let span = last_t - first_t.unwrap_or(last_t);
    if span < TREND_MIN_SPAN.as_secs_f64() {
        return None;
    }
    let n = count as f64;
    let (mean_t, mean_r) = (sum_t / n, sum_r / n);
    let (mut num, mut den) = (0.0, 0.0);
    for (t, r) in points() {
        num += (t - mean_t) * (r - mean_r);
        den += (t - mean_t) * (t - mean_t);
    }
    (den > 0.0).then(|| num / den)
}

impl Config {
    /// The [`Rate`] the pacer is given for the controller's `per_second`: the ceiling
    /// exactly at or above it, the floor exactly when `per_second` is at or above the floor
    /// but would round below it, and otherwise the fastest rate at or below `per_second`
    /// ([`rate_at_most`]), so the pacer never runs faster than the controller's rate (which
    /// the ceiling and the server's caps bound), nor slower than the floor the controller
    /// keeps.
    fn pacer_rate(&self, per_second: f64) -> Rate {
        if per_second >= self.ceiling {
            return self.ceiling_rate;
        }
        let rate = rate_at_most(per_second);
        if per_second >= self.floor && faster(self.floor_rate, rate) {
            self.floor_rate
        } else if faster(rate, self.ceiling_rate) {
            // Only float noise (or a ceiling slower than one per 317 years) gets here.
            self.ceiling_rate
        } else {
            rate
        }
    }
}

/// Whether `a` is faster than `b`, compared exactly.
fn faster(a: Rate, b: Rate) -> bool {
    let (qa, wa) = (u64::from(a.count()), u128::from(a.period_nanos()));
    let (qb, wb) = (u64::from(b.count()), u128::from(b.period_nanos()));
    cmp_rate(qa, wa, qb, wb).is_gt()
}

/// The fastest rate at or below `per_second` of the form `count` per `10^k` ns, with the
/// longest such period (at most [`LONGEST_PERIOD_NS`]) whose count fits in a `u32`: nine
/// significant digits or more from one per 10 s up to `u32::MAX` per ns, seven or more
/// down to one per 1 000 s. At least one per `LONGEST_PERIOD_NS` (about 317 years).
fn rate_at_most(per_second: f64) -> Rate {
    let mut period_ns = LONGEST_PERIOD_NS;
    loop {
        let count = (per_second * period_ns as f64 / 1e9).floor();
        if count <= f64::from(u32::MAX) || period_ns == 1 {
            let count = count.clamp(1.0, f64::from(u32::MAX)) as u32;
            return Rate::per(count, Duration::from_nanos(period_ns))
                .unwrap_or_else(|_| unreachable!("a count of at least 1 per at least 1 ns"));
        }
        period_ns /= 10;
    }
}

/// `rate / 100`, exactly when a count and a period can say it (else the fastest rate
/// below it, see [`rate_at_most`]); never faster than `rate` itself: below one per 317
/// years `rate_at_most` rounds up to that, and then the slowest rate a [`Rate`] holds (one
/// per `u64::MAX` ns) is taken instead.
fn hundredth(rate: Rate) -> Rate {
    let (count, period_ns) = if rate.count().is_multiple_of(100) {
        (rate.count() / 100, Some(rate.period_nanos()))
    } else {
        (rate.count(), rate.period_nanos().checked_mul(100))
    };
    let hundredth = period_ns
        .and_then(|ns| Rate::per(count, Duration::from_nanos(ns)).ok())
        .unwrap_or_else(|| rate_at_most(rate.per_second_f64() / 100.0));
    if faster(hundredth, rate) {
        Rate::per(1, Duration::from_nanos(u64::MAX))
            .unwrap_or_else(|_| unreachable!("a count of 1 per u64::MAX ns"))
    } else {
        hundredth
    }
}

/// Builds an [`AdaptivePacer`]; from [`AdaptivePacer::builder`].
#[derive(Debug, Clone)]
pub struct AdaptivePacerBuilder {
    ceiling: Rate,
    floor: Option<Rate>,
    initial: Option<Rate>,
    decrease: f64,
    increase: f64,
    cooldown: Duration,
    name: Option<String>,
}

impl AdaptivePacerBuilder {
    /// The lowest rate a cut goes to. Default: 1 % of the ceiling (for a ceiling slower
    /// than one per 317 years: one per `u64::MAX` ns, the slowest [`Rate`]). A server's policy or
    /// allowance below it still caps the rate (the server is never sent more than it allows).
    pub fn floor(mut self, floor: Rate) -> Self {
        self.floor = Some(floor);
        self
    }

    /// The rate to start at. Default: the ceiling.
    pub fn initial(mut self, initial: Rate) -> Self {
        self.initial = Some(initial);
        self
    }

    /// The factor `β` a cut multiplies the rate by, in `(0, 1)`. Default: 0.7.
    pub fn decrease(mut self, beta: f64) -> Self {
        self.decrease = beta;
        self
    }

    /// How fast the rate climbs while probing: this share of the last good rate per
    /// second, a step that grows by itself every 2 s without a cut. In `(0, 10]`.
    /// Default: 0.05.
    pub fn increase(mut self, share_per_second: f64) -> Self {
        self.increase = share_per_second;
        self
    }

    /// How long a congestion epoch lasts at least: after back-pressure without a
    /// `Retry-After` (a 503 or a timeout), or with one shorter than it, more back-pressure
    /// within it does not cut again (a longer `Retry-After` makes the epoch last as long).
    /// Set it near the round-trip time. Default: 200 ms.
    pub fn cooldown(mut self, cooldown: Duration) -> Self {
        self.cooldown = capped(cooldown);
        self
    }

    /// The `name` label of the metrics (of the adaptive pacer and of its pacer).
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Build the adaptive pacer.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] on `adaptive.floor` if the floor is above the ceiling, on
    /// `adaptive.initial` if the initial rate is outside `[floor, ceiling]`, on
    /// `adaptive.decrease` if `β` is not in `(0, 1)`, on `adaptive.increase` if it is not
    /// in `(0, 10]`.
    pub fn build(self) -> Result<AdaptivePacer, ConfigError> {
        let ceiling = self.ceiling.per_second_f64();
        let floor_rate = self.floor.unwrap_or_else(|| hundredth(self.ceiling));
        let floor = floor_rate.per_second_f64();
        if faster(floor_rate, self.ceiling) {
            return Err(ConfigError::new(
                "adaptive.floor",
                ConfigErrorKind::Inconsistent,
                "must be at most the ceiling",
            ));
        }
        let initial_rate = self.initial.unwrap_or(self.ceiling);
        if faster(initial_rate, self.ceiling) || faster(floor_rate, initial_rate) {
            return Err(ConfigError::new(
                "adaptive.initial",
                ConfigErrorKind::Inconsistent,
                "must be between the floor and the ceiling",
            ));
        }
        if !(self.decrease > 0.0 && self.decrease < 1.0) {
            return Err(ConfigError::new(
                "adaptive.decrease",
                ConfigErrorKind::Inconsistent,
                "must be above 0 and below 1",
            ));
        }
        if !(self.increase > 0.0 && self.increase <= 10.0) {
            return Err(ConfigError::new(
                "adaptive.increase",
                ConfigErrorKind::Inconsistent,
                "must be above 0 and at most 10",
            ));
        }
        let config = Config {
            ceiling,
            floor,
            ceiling_rate: self.ceiling,
            floor_rate,
            decrease: self.decrease,
            increase: self.increase,
            cooldown: self.cooldown,
        };
        let initial = initial_rate.per_second_f64();
        let mut builder = Pacer::builder(initial_rate);
        if let Some(name) = &self.name {
            builder = builder.name(name.clone());
        }
        let pacer = builder.build()?;
        let labels = Labels::new(self.name.as_deref());
        let now = Instant::now();
        let shared = Shared {
            pacer,
            config,
            control: Mutex::new(Control {
                rate: initial,
                applied: initial,
                last_good: initial,
                last_update: now,
                last_cut: now,
                epoch_end: None,
                paused_until: None,
                policy: None,
                allowance: None,
                remaining: VecDeque::new(),
                remaining_of: None,
                successes: Meter::new(now),
                responses: Meter::new(now),
                cuts: 0,
                pauses: 0,
            }),
            rate_gauge: labels.gauge(names::RATE, &[]),
            pauses: labels.counter(names::PAUSES, &[]),
            cuts: labels.counter(names::CUTS, &[]),
        };
        shared.rate_gauge.set(initial);
        Ok(AdaptivePacer {
            inner: Arc::new(shared),
        })
    }
}
