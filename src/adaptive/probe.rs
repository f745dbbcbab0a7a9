//! `Probe`: flowgate's default adaptive limit.

use std::time::Duration;

use crate::adaptive::common::{
    Bounds, Epoch, Ewma, WindowMin, check_at_least, check_below_one, check_fraction,
    check_positive, from_secs, secs, whole,
};
use crate::adaptive::{AdaptiveLimit, Outcome, RttEstimates, Sample};
use crate::error::ConfigError;

/// flowgate's default adaptive limit: it climbs to the downstream's knee (doubling while
/// nothing queues, the slow start), holds the level where throughput stops paying for the
/// latency it costs, tries one step above or below it now and then, and backs off at once
/// when the downstream pushes back or the round-trip time runs far above its minimum.
///
/// It decides once per **window**: a window gathers the calls that *started* after it
/// opened (so every call in it ran under the current limit) and closes once it lasted a
/// smoothed round trip and holds `max(4, L/4)` of them, or more when single round trips
/// are noisy: enough for its mean to tell a trial's outcome within about ±0.3 of
/// efficiency (below; at most `16 × L` calls); a window far above the minimum (severe,
/// below) closes as soon as it has `max(4, L/4)`. `R` is a window's mean round-trip time
/// and `min` the lowest round-trip time of the last one to two `probe_window`s. A call
/// that took zero time (answered from a cache, shorter than the clock's resolution, paused
/// time) counts in its window's mean but is never the minimum: against a zero minimum every
/// window would be far above it. Until a call takes longer than zero there is no minimum,
/// and the `max_rtt_ratio × min` guard (below) waits for one.
///
/// **Efficiency** compares two levels `lo < hi` with mean round trips `R_lo`, `R_hi`: the
/// share of their proportional throughput the calls between them bring (throughput being
/// calls in flight over round-trip time, Little's law):
///
/// ```text
/// efficiency = ((hi / R_hi) / (lo / R_lo) − 1) / ((hi − lo) / lo)
/// ```
///
/// 1 when the round-trip time did not grow at all, 0 when the extra calls brought no
/// throughput (they only queue), negative past the throughput peak. The limit keeps the
/// higher level while the efficiency is at least `min_gain` (default 0.5): it settles a
/// little below the throughput peak, where the latency is still that of the knee. (In
/// slow start the calls in flight are the calls' own counts, not the limit: right after a
/// doubling the first calls to end started while the count was still rising.)
///
/// ```text
/// severe     = R > max_rtt_ratio × min (2), a call taking timeout or longer, or back-pressure
/// slow start: efficiency of the doubling < min_gain, or severe → back to the level
///             before it (the knee is between);                      else L × 2
/// hold B:     severe → B × backoff_ratio (0.9), then try lower;
///             R > avg + max(deviation_scale × dev, tolerance × avg)  (1.5, 0.05)
///                    → try lower at once;
///             else after probe_interval windows (8) → try the other way than last time
/// trial B±s:  one window at B + s or B − s (s = max(1, ⌊B/32⌋)); the level that wins on
///             efficiency is held, and a won trial tries one more step the same way
/// ```
///
/// `avg` and `dev` are the exponentially weighted average and mean deviation (weight 0.25)
/// of `R` over the windows held at `B`; the deviation rule is Vector's adaptive request
/// concurrency, used here to notice a downstream that got slower under a steady limit. On
/// the [simulator](crate::adaptive::sim)'s shallow, steep and capacity-drop scenarios it
/// holds within a step or two of the knee; on the noisy one (single round trips ±40 %) the
/// noise takes it a few steps below now and then (from 20 s on, a mean limit of 37 to 40
/// for a knee of 40, with seeds 19, 1, 2 and 3). `cargo bench --bench adaptive` prints the
/// figures against the other algorithms.
///
/// What it adds to the anchors:
///
/// - **Slow start** (Vector issue 3255): from `initial` the limit doubles per window while
///   throughput grows with it, so a fresh bulkhead reaches a large capacity in a few round
///   trips instead of one step per round trip; the first doubling that does not pay (or
///   meets back-pressure) is undone, and the trials take it from there.
/// - **Timeouts are back-pressure** (Netflix issue 137): a call taking `timeout` or longer
///   (default 5 s) or an [`Outcome::BackPressure`] cuts the limit at once (by
///   `backoff_ratio`, or back to the last level before a doubling in slow start), once per
///   congestion epoch (the calls already in flight at a cut, whatever made it, do not cut
///   again), and is never a latency sample: a downstream that only times out cannot make
///   its timeout look like its normal latency.
/// - **No creep** (Netflix issue 134): a step up is kept only when it paid in throughput,
///   and the `max_rtt_ratio × min` guard cuts when the latency drifts far above the recent
///   minimum, so a limit cannot ride a rising latency upwards. The minimum ages out after
///   one to two `probe_window`s (default 30 s), so a downstream that got slower for good
///   is learnt again at the current limit: the limit is never pinned low to measure it
///   (Envoy's minRTT probing sheds load to do so). Sooner when the guard's cuts do not
///   help: two in a row, each followed by a window whose calls reached the lower limit and
///   whose mean round trip, still far above the minimum, is not lower by at least
///   `tolerance`, show no queue the limit builds (the downstream is slower at every load),
///   so the minimum is forgotten and learnt again from the next calls instead of cutting
///   on down to `min_limit`.
/// - **Capacity drops are followed down**: the cuts bring a much slower downstream under
///   the guard within a few windows, and the trials below walk the rest of the way to the
///   new knee; the trials above find the capacity again when it comes back.
/// - **App-limited callers do not grow it**: the limit grows (doubles, or tries a step up)
///   only after a window whose calls reached it, and keeps a step up only if the calls
///   reached that too (a caller sending 5 at a time learns nothing about 500).
/// - [`Outcome::Ignored`] (a cancelled call, a client error) changes nothing: its
///   near-zero round-trip time never pulls the limit up (Netflix issue 176).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use flowgate::adaptive::{AdaptiveLimit, Outcome, Probe, Sample};
///
/// let mut probe = Probe::builder().initial(4).build()?;
/// // Four calls started at 0 and took 10 ms each, with 4 in flight: one window, no queue.
/// for _ in 0..4 {
///     let s = Sample { rtt: Duration::from_millis(10), in_flight: 4, outcome: Outcome::Ok, now: Duration::from_millis(10) };
///     probe.update(&s);
/// }
/// assert_eq!(probe.limit(), 8); // slow start doubles
/// # Ok::<(), flowgate::ConfigError>(())
/// ```
#[derive(Debug, Clone)]
pub struct Probe {
    bounds: Bounds,
    /// The limit in force: `base`, or `base ± step` during a trial.
    limit: f64,
    /// The level held between trials.
    base: f64,
    /// The mean round-trip time at `base` (averaged over the windows held there).
    base_rtt: Option<f64>,
    phase: Phase,
    /// The direction of the next trial.
    up_next: bool,
    /// Slow start: the last window's `(limit, mean round-trip time, throughput)`.
    previous: Option<(f64, f64, f64)>,
    /// The mean round-trip time of the window whose latency (far above the minimum) made
    /// the last cut, until the next window tells whether the cut brought it down.
    severe_rtt: Option<f64>,
    /// How many such cuts in a row did not bring it down.
    stalls: u32,
    backoff_ratio: f64,
    deviation_scale: f64,
    tolerance: f64,
    max_rtt_ratio: f64,
    min_gain: f64,
    probe_interval: u32,
    timeout: Duration,
    srtt: Ewma,
    /// The squared coefficient of variation of single round-trip times within a window.
    spread: Ewma,
    dev: Ewma,
    min: WindowMin,
    epoch: Epoch,
    window: Window,
}

/// Where the limit is in its cycle.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Phase {
    /// Doubling per window.
    SlowStart,
    /// Holding `base`; `windows` since the last trial.
    Hold { windows: u32 },
    /// Trying `base + step` (a negative step tries lower) for one window.
    Trial { step: f64 },
}

/// The calls of the current window.
#[derive(Debug, Clone, Copy, Default)]
struct Window {
    opened: Duration,
    /// Calls counted: up to 16 × the limit (above `u32::MAX` for a limit above 2^28).
    count: u64,
    sum: f64,
    sum_squares: f64,
    /// The sum of the calls' in-flight counts.
    in_flight: f64,
    most_in_flight: u32,
}

impl Probe {
    /// A builder with the defaults: `min_limit` 1, `max_limit` 1000, `initial` 10,
    /// `backoff_ratio` 0.9, `deviation_scale` 1.5, `tolerance` 0.05, `max_rtt_ratio` 2,
    /// `probe_interval` 8, `probe_window` 30 s, `timeout` 5 s, `min_gain` 0.5.
    pub fn builder() -> ProbeBuilder {
        ProbeBuilder {
            bounds: Bounds::new(1, 1000, 10),
            backoff_ratio: 0.9,
            deviation_scale: 1.5,
            tolerance: 0.05,
            max_rtt_ratio: 2.0,
            min_gain: 0.5,
            probe_interval: 8,
            probe_window: Duration::from_secs(30),
            timeout: Duration::from_secs(5),
        }
    }

    /// Whether the limit is still in slow start (doubling per window).
    pub fn in_slow_start(&self) -> bool {
        self.phase == Phase::SlowStart
    }

    /// Hold `level` from now on, with `rtt` its mean round-trip time if known, and try
    /// lower first.
    fn hold(&mut self, level: f64, rtt: Option<f64>, windows: u32) {
        self.limit = self.bounds.clamp(level);
        self.base = self.limit;
        self.base_rtt = rtt;
        self.phase = Phase::Hold { windows };
        self.up_next = false;
    }

    /// Whether it holds as built, at its max, with nothing learnt yet: no window decided
    /// (a round-trip time), no cut (which holds `probe_interval` windows in).
    fn unstarted(&self) -> bool {
        self.phase == (Phase::Hold { windows: 0 })
            && self.srtt.get().is_none()
            && self.base_rtt.is_none()
            && self.previous.is_none()
    }

    /// Congestion at `now`: back to the last level that showed none in slow start, else
    /// `limit × backoff_ratio`; the next trial (after one window) goes lower. The calls in
    /// flight now do not cut again.
    fn cut(&mut self, now: Duration) {
        let level = match (self.phase, self.previous) {
            (Phase::SlowStart, Some((level, _, _))) => level,
            _ => (self.limit * self.backoff_ratio).floor(),
        };
        self.hold(level, None, self.probe_interval);
        self.epoch.mark(now);
    }

    /// A cut for a window of mean round trip `r`, far above the minimum: the next window
    /// tells whether it brought the latency down.
    fn cut_severe(&mut self, now: Duration, r: f64) {
        self.cut(now);
        self.severe_rtt = Some(r);
    }

    /// The trial step at `base`: 1, or a 32nd of it when larger.
    fn step(&self) -> f64 {
        (self.base / 32.0).floor().max(1.0)
    }

    /// Try one step up (when `up`) or down from `base`, if the bounds allow.
    fn trial(&mut self, up: bool) {
        let step = if up { self.step() } else { -self.step() };
        let level = self.base + step;
        if self.bounds.clamp(level) == level {
            self.limit = level;
            self.phase = Phase::Trial { step };
        } else {
            self.limit = self.base;
            self.phase = Phase::Hold { windows: 0 };
            self.up_next = !up;
        }
    }

    fn open(&mut self, now: Duration) {
        self.window = Window {
            opened: now,
            ..Window::default()
        };
    }

    /// Close the window: decide.
    fn decide(&mut self, now: Duration) {
        let w = self.window;
        self.open(now);
        let n = w.count as f64;
        let r = w.sum / n;
        self.srtt.update(r);
        let mut severe = self
            .min
            .get()
            .is_some_and(|m| r > self.max_rtt_ratio * secs(m));
        // The window's calls reached the limit: the limit, not the caller, bounded them.
        let reached = f64::from(w.most_in_flight) >= self.limit;
        if severe {
            // A cut that bound the calls (they reached the lower limit) and did not bring
            // the latency down.
            let stalled = reached
                && self
                    .severe_rtt
                    .is_some_and(|cut_at| r >= cut_at * (1.0 - self.tolerance));
            self.stalls = if stalled { self.stalls + 1 } else { 0 };
            // Two such cuts in a row (the first window after a cut may still hold calls that
            // started before it, or before a change): this is no queue the limit builds, the
            // downstream got slower for good. Its old minimum is forgotten (learnt again
            // from the next calls) instead of cutting on down to `min_limit` until it ages
            // out. (A cut the caller's own calls stay below cannot move the latency: it is
            // no evidence either way.)
            if self.stalls >= 2 {
                self.min.forget();
                severe = false;
            }
        }
        if !severe {
            self.stalls = 0;
        }
        self.severe_rtt = None;
        match self.phase {
            Phase::SlowStart => {
                // Throughput from the calls' own in-flight counts (Little's law): right
                // after a doubling the first calls to end are those started while the
                // count was still rising, and the limit would flatter them.
                let throughput = w.in_flight / n / r;
                let paid = self.previous.is_none_or(|(level, _, before)| {
                    efficiency(throughput / before - 1.0, self.limit / level - 1.0) >= self.min_gain
                });
                if severe {
                    self.cut_severe(now, r);
                } else if !paid {
                    let rtt = self.previous.map(|(_, rtt, _)| rtt);
                    self.cut(now);
                    self.base_rtt = rtt;
                } else if reached {
                    self.previous = Some((self.limit, r, throughput));
                    self.limit = self.bounds.clamp(self.limit * 2.0);
                    self.base = self.limit;
                    if self.limit >= f64::from(self.bounds.max) {
                        self.hold(self.limit, None, 0);
                    }
                }
            }
            Phase::Hold { windows } => {
                if severe {
                    self.cut_severe(now, r);
                    return;
                }
                if self.base_rtt.is_some() && w.count > 1 && r > 0.0 {
                    // The spread of single round trips, measured at a steady limit only
                    // (a window after a change mixes calls of two limits).
                    let variance = (w.sum_squares - w.sum * r).max(0.0) / (n - 1.0);
                    self.spread.update(variance / (r * r));
                }
                let queueing = self.base_rtt.is_some_and(|b| {
                    let dev = self.dev.get().unwrap_or(0.0);
                    r > b + (self.deviation_scale * dev).max(self.tolerance * b)
                });
                self.base_rtt = Some(match self.base_rtt {
                    Some(b) => {
                        self.dev.update((r - b).abs());
                        b + 0.25 * (r - b)
                    }
                    None => r,
                });
                let windows = windows.saturating_add(1);
                if queueing {
                    self.trial(false);
                } else if windows >= self.probe_interval {
                    if self.up_next && !reached {
                        // App-limited: nothing to learn above.
                        self.phase = Phase::Hold { windows: 0 };
                    } else {
                        self.trial(self.up_next);
                    }
                } else {
                    self.phase = Phase::Hold { windows };
                }
            }
            Phase::Trial { step } => {
                let Some(b) = self.base_rtt else {
                    self.hold(self.base, Some(r), 0);
                    return;
                };
                let up = step > 0.0;
                let higher = if up {
                    reached
                        && !severe
                        && self.efficiency(self.base, b, self.limit, r) >= self.min_gain
                } else {
                    !severe && self.efficiency(self.limit, r, self.base, b) >= self.min_gain
                };
                if severe && !up {
                    self.cut_severe(now, r);
                } else if higher != up {
                    // The trial lost: back to `base`, and the next trial goes the other way.
                    self.limit = self.base;
                    self.phase = Phase::Hold { windows: 0 };
                    self.up_next = !up;
                } else {
                    // The trial won: hold it and try one more step the same way.
                    self.base = self.limit;
                    self.base_rtt = Some(r);
                    self.trial(up);
                }
            }
        }
    }

    /// The efficiency of the calls between `low` (round trip `low_rtt`) and `high` (round
    /// trip `high_rtt`).
    fn efficiency(&self, low: f64, low_rtt: f64, high: f64, high_rtt: f64) -> f64 {
        efficiency((high * low_rtt) / (low * high_rtt) - 1.0, high / low - 1.0)
    }

    /// How many calls a window needs: a quarter of the limit, at least 4, and enough for its
    /// mean to measure a trial's efficiency within about ±0.3 given the spread of single
    /// round trips (at most 16 × the limit).
    fn needed(&self) -> f64 {
        let spread = self.spread.get().unwrap_or(0.0);
        let steps = self.base / self.step();
        let noise = spread * (steps / 0.3).powi(2);
        (self.limit / 4.0)
            .max(4.0)
            .max(noise.min(16.0 * self.limit))
    }
}

/// The share of their proportional throughput added calls bring: the relative gain in
/// throughput over the relative gain in calls in flight. 1 when the round-trip time did not
/// grow, 0 when throughput did not grow, negative when it fell; zero round trips show no
/// queue (1).
fn efficiency(throughput_gain: f64, calls_gain: f64) -> f64 {
    let e = throughput_gain / calls_gain;
    if e.is_finite() { e } else { 1.0 }
}

impl AdaptiveLimit for Probe {
    fn limit(&self) -> u32 {
        whole(self.limit)
    }

    fn update(&mut self, sample: &Sample) -> u32 {
        let congested = match sample.outcome {
            Outcome::BackPressure => true,
            Outcome::Ok => sample.rtt >= self.timeout,
            _ => return self.limit(),
        };
        if congested {
            if self.epoch.cut(sample.rtt, sample.now) {
                self.cut(sample.now);
                self.open(sample.now);
            }
            return self.limit();
        }
        self.min.update(sample.rtt, sample.now);
        if sample.now < self.window.opened {
            // The clock stepped back behind the window's opening: it opens again now, or
            // every call would count as started before it until the clock caught up.
            self.open(sample.now);
            return self.limit();
        }
        let started = sample.now.saturating_sub(sample.rtt);
        if started < self.window.opened {
            // Started under an older limit: says nothing about this one.
            return self.limit();
        }
        let w = &mut self.window;
        w.count += 1;
        w.sum += secs(sample.rtt);
        w.sum_squares += secs(sample.rtt).powi(2);
        w.in_flight += f64::from(sample.in_flight);
        w.most_in_flight = w.most_in_flight.max(sample.in_flight);
        let count = w.count as f64;
        let mean = w.sum / count;
        let lasted = sample.now.saturating_sub(w.opened);
        let round_trip = self.srtt.get().map_or(Duration::ZERO, from_secs);
        // A window far above the minimum closes early: no need to measure a queue precisely.
        let severe = count >= (self.limit / 4.0).max(4.0)
            && self
                .min
                .get()
                .is_some_and(|m| mean > self.max_rtt_ratio * secs(m));
        if (count >= self.needed() || severe) && lasted >= round_trip {
            self.decide(sample.now);
        }
        self.limit()
    }

    fn bound(&mut self, min_limit: u32, max_limit: u32) {
        self.bounds.narrow(min_limit, max_limit, &mut self.limit);
        self.base = self.bounds.clamp(self.base);
        let at_max = self.limit >= f64::from(self.bounds.max);
        if self.phase == Phase::SlowStart && at_max {
            self.hold(self.limit, self.base_rtt, 0);
        } else if !at_max && self.unstarted() {
            // Held from the start only because it began at its max (a default one, which
            // these bounds raised), and nothing learnt since: as built with these bounds,
            // it slow-starts.
            self.phase = Phase::SlowStart;
        }
    }

    fn name(&self) -> &'static str {
        "probe"
    }

    fn rtt_estimates(&self) -> RttEstimates {
        RttEstimates::new(self.min.get(), self.srtt.get().map(from_secs))
    }
}

impl Default for Probe {
    /// [`Probe::builder`]'s defaults.
    fn default() -> Probe {
        Probe::builder().build().expect("the defaults are valid")
    }
}

/// Builds a [`Probe`]; from [`Probe::builder`].
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until built"]
pub struct ProbeBuilder {
    bounds: Bounds,
    backoff_ratio: f64,
    deviation_scale: f64,
    tolerance: f64,
    max_rtt_ratio: f64,
    min_gain: f64,
    probe_interval: u32,
    probe_window: Duration,
    timeout: Duration,
}

impl ProbeBuilder {
    crate::adaptive::common::bounds_setters!("10");

    /// The factor a cut multiplies the limit by (default 0.9).
    pub fn backoff_ratio(mut self, ratio: f64) -> Self {
        self.backoff_ratio = ratio;
        self
    }

    /// How many mean deviations above the average a window's round-trip time may be before
    /// it counts as queueing (default 1.5).
    pub fn deviation_scale(mut self, scale: f64) -> Self {
        self.deviation_scale = scale;
        self
    }

    /// The least rise above the average, as a fraction of it, that counts as queueing
    /// (default 0.05: 5 %), so a downstream without noise is not cut for every tiny rise;
    /// and the least fall the cuts for a latency far above the minimum must bring, or the
    /// minimum is learnt again (see **No creep** in [`Probe`]).
    pub fn tolerance(mut self, tolerance: f64) -> Self {
        self.tolerance = tolerance;
        self
    }

    /// A window's mean round-trip time above this many times the recent minimum is
    /// queueing, whatever the average says (default 2).
    pub fn max_rtt_ratio(mut self, ratio: f64) -> Self {
        self.max_rtt_ratio = ratio;
        self
    }

    /// The least efficiency (see [`Probe`]) a step up must show for the limit to keep it,
    /// in `[0, 1)` (default 0.5): the calls it adds must bring at least this share of their
    /// proportional throughput. 0 settles at the throughput peak; higher values a little
    /// below it, where the latency is lower.
    pub fn min_gain(mut self, gain: f64) -> Self {
        self.min_gain = gain;
        self
    }

    /// How many windows the limit holds between two trials (default 8).
    pub fn probe_interval(mut self, windows: u32) -> Self {
        self.probe_interval = windows;
        self
    }

    /// The window of the minimum round-trip time (default 30 s): a minimum is forgotten
    /// after one to two of them.
    pub fn probe_window(mut self, window: Duration) -> Self {
        self.probe_window = window;
        self
    }

    /// A call slower than this is a timeout: back-pressure, never a latency sample
    /// (default 5 s).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Build it.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] on `probe.min_limit`, `probe.max_limit`, `probe.initial` (as for
    /// [`Aimd`](crate::adaptive::Aimd)), `probe.backoff_ratio` (not strictly between 0 and 1),
    /// `probe.deviation_scale` (negative or not finite), `probe.tolerance` (negative or not
    /// finite), `probe.max_rtt_ratio` (below 1 or not finite), `probe.min_gain` (outside
    /// `[0, 1)`),
    /// `probe.probe_interval`, `probe.probe_window` or `probe.timeout` (zero).
    pub fn build(self) -> Result<Probe, ConfigError> {
        let bounds = self
            .bounds
            .check(["probe.min_limit", "probe.max_limit", "probe.initial"])?;
        let initial = f64::from(bounds.initial);
        if self.probe_interval == 0 {
            return Err(ConfigError::zero("probe.probe_interval"));
        }
        Ok(Probe {
            limit: initial,
            base: initial,
            base_rtt: None,
            phase: if bounds.initial < bounds.max {
                Phase::SlowStart
            } else {
                Phase::Hold { windows: 0 }
            },
            up_next: false,
            previous: None,
            severe_rtt: None,
            stalls: 0,
            probe_interval: self.probe_interval,
            min_gain: check_below_one("probe.min_gain", self.min_gain)?,
            spread: Ewma::new(0.25),
            bounds,
            backoff_ratio: check_fraction("probe.backoff_ratio", self.backoff_ratio)?,
            deviation_scale: check_at_least("probe.deviation_scale", self.deviation_scale, 0.0)?,
            tolerance: check_at_least("probe.tolerance", self.tolerance, 0.0)?,
            max_rtt_ratio: check_at_least("probe.max_rtt_ratio", self.max_rtt_ratio, 1.0)?,
            timeout: check_positive("probe.timeout", self.timeout)?,
            srtt: Ewma::new(0.25),
            dev: Ewma::new(0.25),
            min: WindowMin::new(check_positive("probe.probe_window", self.probe_window)?),
            epoch: Epoch::default(),
            window: Window::default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A window that has counted `u32::MAX` calls (one of a limit above 2^28 needs up to
    /// 16 × the limit) counts the next one too: no overflow (a panic in a debug build, a
    /// window that restarts its count in release).
    #[test]
    fn a_window_counts_past_u32_max_calls() {
        let mut p = Probe::builder().build().unwrap();
        let at = Duration::from_secs(1);
        p.update(&Sample {
            rtt: Duration::from_millis(1),
            in_flight: 1,
            outcome: Outcome::Ok,
            now: at,
        });
        p.window.opened = Duration::ZERO;
        p.window.count = u32::MAX.into();
        let before = p.window.count;
        p.limit = 1e9;
        p.update(&Sample {
            rtt: Duration::from_millis(1),
            in_flight: 1,
            outcome: Outcome::Ok,
            now: at + Duration::from_millis(10),
        });
        assert!(
            p.window.count > before || p.window.count == 0,
            "counted, or the window closed and a new one opened"
        );
    }
}
