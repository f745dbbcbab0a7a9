//! `Gradient2`: the long-term against the short-term round-trip time.

use std::time::Duration;

use crate::adaptive::common::{
    Bounds, Epoch, Ewma, WindowMin, check_at_least, check_positive, from_secs, secs, whole,
};
use crate::adaptive::{AdaptiveLimit, Outcome, RttEstimates, Sample};
use crate::error::{ConfigError, ConfigErrorKind};

/// Netflix's `Gradient2Limit`, with its two shipped failures fixed: the limit follows the
/// gradient between a long-term average round-trip time and the latest one.
///
/// With `L` the limit, `short` the sample's round-trip time, `long` an exponentially
/// weighted average over about `long_window` samples (default 600):
///
/// ```text
/// gradient = clamp(tolerance × long / short, 0.5, 1)      (tolerance 1.5)
/// new      = L × gradient + sqrt(L)                        (the queue allowed)
/// L        ← (1 − smoothing) × L + smoothing × new         (smoothing 0.2)
/// ```
///
/// When `long` is more than twice `short` (the downstream got faster), `long` is cut by
/// 5 % per sample so it catches up. A caller using less than half its limit (app-limited)
/// does not change it. [`Outcome::Ignored`] changes nothing.
///
/// **Coming from Netflix.** The queue allowed is `sqrt(L)`, as in Netflix's `GradientLimit`
/// (or a `Gradient2Limit` given a square-root `queueSize` function); `Gradient2Limit`'s own
/// default is a fixed queue of 4, which flowgate does not offer. Above a limit of 16 this
/// grows faster than Netflix's defaults: at `L` = 100, `+2` per sample instead of `+0.8`
/// (after smoothing), at `L` = 400, `+4` instead of `+0.8`. Netflix's other defaults
/// differ too: its `minLimit` is 20 and its `maxConcurrency` 200 (here 1 and 1000, or the
/// bulkhead's bounds).
///
/// **The fixes.**
///
/// - *Creeping up under modest overload* (Netflix issue 134): the long-term average follows
///   the short one, so under a steady overload `long ≈ short`, the gradient is capped at 1,
///   and `sqrt(L)` is added on every sample: the limit grows without bound. Here `long` may
///   not exceed `tolerance` × the minimum round-trip time of the last one to two
///   `probe_window`s (default 60 s): a latency `short` that stays above `tolerance²` × that
///   minimum brings the gradient below 1, to `g = tolerance² × min / short`, and the limit
///   settles where `sqrt(L)` balances the cut, at `L = 1 / (1 − g)²`: bounded, and the
///   lower the further the latency is above that mark (about 120 at 1.1 ×, 4 at 2 ×; a
///   limit above it comes down, one below it climbs to it; just above the mark the bound
///   can exceed `max_limit`, which then holds). The minimum ages out after two windows,
///   so a downstream that got slower for good is learnt again without lowering the limit
///   to measure it (nothing is pinned).
/// - *Growing to the maximum when every call times out* (Netflix issue 137): a timed-out
///   call (a sample taking `timeout`, default 5 s, or longer) or
///   [`Outcome::BackPressure`] is never a latency sample (it would make the timeout look
///   normal); it cuts the limit with the gradient's floor, 0.5 (smoothed: × 0.9 by
///   default), once per congestion epoch.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use flowgate::adaptive::{AdaptiveLimit, Gradient2, Outcome, Sample};
///
/// let mut g = Gradient2::builder().initial(20).build()?;
/// let timeout = Sample { rtt: Duration::from_secs(5), in_flight: 20, outcome: Outcome::Ok, now: Duration::from_secs(5) };
/// assert_eq!(g.update(&timeout), 18); // × (1 − 0.2 × 0.5)
/// # Ok::<(), flowgate::ConfigError>(())
/// ```
#[derive(Debug, Clone)]
pub struct Gradient2 {
    bounds: Bounds,
    limit: f64,
    tolerance: f64,
    smoothing: f64,
    timeout: Duration,
    long: Ewma,
    min: WindowMin,
    epoch: Epoch,
}

impl Gradient2 {
    /// A builder with the defaults: `min_limit` 1, `max_limit` 1000, `initial` 20,
    /// `tolerance` 1.5, `smoothing` 0.2, `long_window` 600 samples, `probe_window` 60 s,
    /// `timeout` 5 s.
    pub fn builder() -> Gradient2Builder {
        Gradient2Builder {
            bounds: Bounds::new(1, 1000, 20),
            tolerance: 1.5,
            smoothing: 0.2,
            long_window: 600,
            probe_window: Duration::from_secs(60),
            timeout: Duration::from_secs(5),
        }
    }
}

impl AdaptiveLimit for Gradient2 {
    fn limit(&self) -> u32 {
        whole(self.limit)
    }

    fn update(&mut self, sample: &Sample) -> u32 {
        let l = self.limit;
        let timed_out = sample.rtt >= self.timeout;
        let gradient = match sample.outcome {
            Outcome::BackPressure => 0.5,
            Outcome::Ok if timed_out => 0.5,
            Outcome::Ok if !sample.rtt.is_zero() => {
                let short = secs(sample.rtt);
                self.min.update(sample.rtt, sample.now);
                let mut long = self.long.update(short);
                if long > 2.0 * short {
                    long *= 0.95;
                }
                if let Some(min) = self.min.get() {
                    long = long.min(self.tolerance * secs(min));
                }
                self.long.set(long);
                if f64::from(sample.in_flight) * 2.0 < l {
                    return self.limit();
                }
                let gradient = (self.tolerance * long / short).clamp(0.5, 1.0);
                let new = l * gradient + l.sqrt();
                self.limit = self
                    .bounds
                    .clamp((1.0 - self.smoothing) * l + self.smoothing * new);
                return self.limit();
            }
            _ => return self.limit(),
        };
        if self.epoch.cut(sample.rtt, sample.now) {
            let new = l * gradient;
            self.limit = self
                .bounds
                .clamp(((1.0 - self.smoothing) * l + self.smoothing * new).floor());
        }
        self.limit()
    }

    fn bound(&mut self, min_limit: u32, max_limit: u32) {
        self.bounds.narrow(min_limit, max_limit, &mut self.limit);
    }

    fn name(&self) -> &'static str {
        "gradient2"
    }

    fn rtt_estimates(&self) -> RttEstimates {
        RttEstimates::new(self.min.get(), self.long.get().map(from_secs))
    }
}

/// Builds a [`Gradient2`]; from [`Gradient2::builder`].
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until built"]
pub struct Gradient2Builder {
    bounds: Bounds,
    tolerance: f64,
    smoothing: f64,
    long_window: u32,
    probe_window: Duration,
    timeout: Duration,
}

impl Gradient2Builder {
    crate::adaptive::common::bounds_setters!("20");

    /// How much slower than the long-term average a call may be before the limit shrinks,
    /// at least 1 (default 1.5).
    pub fn tolerance(mut self, tolerance: f64) -> Self {
        self.tolerance = tolerance;
        self
    }

    /// How much of each change is applied, in `(0, 1]` (default 0.2).
    pub fn smoothing(mut self, smoothing: f64) -> Self {
        self.smoothing = smoothing;
        self
    }

    /// The long-term average's span, in samples (default 600).
    pub fn long_window(mut self, samples: u32) -> Self {
        self.long_window = samples;
        self
    }

    /// The window of the minimum round-trip time that caps the long-term average (default
    /// 60 s; see the fixes in [`Gradient2`]).
    pub fn probe_window(mut self, window: Duration) -> Self {
        self.probe_window = window;
        self
    }

    /// A call slower than this is a timeout: back-pressure, not a latency sample (default
    /// 5 s).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Build it.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] on `gradient2.min_limit`, `gradient2.max_limit`, `gradient2.initial`
    /// (as for [`Aimd`](crate::adaptive::Aimd)), `gradient2.tolerance` (below 1 or not finite),
    /// `gradient2.smoothing` (outside `(0, 1]`), `gradient2.long_window` (zero),
    /// `gradient2.probe_window` or `gradient2.timeout` (zero).
    pub fn build(self) -> Result<Gradient2, ConfigError> {
        let bounds = self.bounds.check([
            "gradient2.min_limit",
            "gradient2.max_limit",
            "gradient2.initial",
        ])?;
        let tolerance = check_at_least("gradient2.tolerance", self.tolerance, 1.0)?;
        if !(self.smoothing > 0.0 && self.smoothing <= 1.0) {
            return Err(ConfigError::new(
                "gradient2.smoothing",
                ConfigErrorKind::Inconsistent,
                format!("{} is not in (0, 1]", self.smoothing),
            ));
        }
        if self.long_window == 0 {
            return Err(ConfigError::zero("gradient2.long_window"));
        }
        Ok(Gradient2 {
            limit: f64::from(bounds.initial),
            bounds,
            tolerance,
            smoothing: self.smoothing,
            timeout: check_positive("gradient2.timeout", self.timeout)?,
            long: Ewma::new(2.0 / (f64::from(self.long_window) + 1.0)),
            min: WindowMin::new(check_positive("gradient2.probe_window", self.probe_window)?),
            epoch: Epoch::default(),
        })
    }
}
