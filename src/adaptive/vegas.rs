//! `Vegas`: TCP Vegas' queue estimate.

use std::time::Duration;

use crate::adaptive::common::{Bounds, Epoch, check_at_least, secs, whole};
use crate::adaptive::{AdaptiveLimit, Outcome, RttEstimates, Sample};
use crate::error::{ConfigError, ConfigErrorKind};

/// TCP Vegas' rule (as in Netflix's `VegasLimit`): estimate the queue the limit builds at
/// the downstream from the no-load round-trip time, and keep it between `alpha` and `beta`.
///
/// With `L` the limit, `min` the lowest round-trip time seen (the no-load time) and `rtt`
/// the sample's:
///
/// ```text
/// queue = ceil(L × (1 − min / rtt))          f(L) = max(1, log10 L)
/// queue ≤ f(L)            → L + beta·f(L)    (far from any queue: grow fast)
/// queue < alpha·f(L)      → L + f(L)
/// queue > beta·f(L)       → L − f(L)
/// otherwise               → L
/// ```
///
/// then `L ← (1 − smoothing)·L + smoothing·new`. Defaults: `alpha` 3, `beta` 6,
/// `smoothing` 1. [`Outcome::BackPressure`] makes `new = L − f(L)`, smoothed the same way
/// (it lowers the limit by `smoothing × f(L)`), once per congestion epoch. An `Ok` sample of a call that saw less than half the limit in flight (an
/// app-limited caller) changes the limit neither way: only its round-trip time counts,
/// towards the no-load time. So does the first `Ok` sample, and the first after each probe
/// (below): with no no-load time yet, its own round-trip time becomes it, and its queue
/// estimate against itself would be 0 whatever the queue. An `Ok` sample of zero
/// round-trip time (a cached answer, a coarse or paused clock) measures nothing and is
/// ignored.
///
/// **Probing.** Every `probe_multiplier × L` samples (default 30 × L) the no-load time is
/// forgotten and measured again from the next sample, so a downstream that became slower for
/// good is learnt; the limit is neither lowered to measure it nor moved by the sample that
/// measures it (as in Netflix's `VegasLimit`), so a probe leaves the limit where it is. The
/// next samples are compared with that one's round-trip time: a probe that lands on a call
/// slowed by a queue takes its time for the no-load time, and the limit grows until a
/// faster call brings the no-load time down again. Between probes a slower downstream
/// looks like a queue and the limit shrinks: Vegas is the most cautious of the algorithms,
/// and it settles below the knee when latency grows steadily with load (a shallow knee).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use flowgate::adaptive::{AdaptiveLimit, Outcome, Sample, Vegas};
///
/// let mut vegas = Vegas::builder().initial(10).build()?;
/// let at = |ms, now| Sample { rtt: Duration::from_millis(ms), in_flight: 10, outcome: Outcome::Ok, now: Duration::from_secs(now) };
/// assert_eq!(vegas.update(&at(10, 1)), 10); // the no-load time: 10 ms
/// assert_eq!(vegas.update(&at(10, 2)), 16); // no queue: + 6 × log10(10)
/// assert!(vegas.update(&at(40, 3)) < 16); // queue = 16 × 3/4 = 12 > 6 × log10(16)
/// # Ok::<(), flowgate::ConfigError>(())
/// ```
#[derive(Debug, Clone)]
pub struct Vegas {
    bounds: Bounds,
    limit: f64,
    alpha: f64,
    beta: f64,
    smoothing: f64,
    probe_multiplier: u32,
    samples: u64,
    no_load: Option<Duration>,
    epoch: Epoch,
}

impl Vegas {
    /// A builder with the defaults: `min_limit` 1, `max_limit` 1000, `initial` 20, `alpha` 3,
    /// `beta` 6, `smoothing` 1, `probe_multiplier` 30.
    pub fn builder() -> VegasBuilder {
        VegasBuilder {
            bounds: Bounds::new(1, 1000, 20),
            alpha: 3.0,
            beta: 6.0,
            smoothing: 1.0,
            probe_multiplier: 30,
        }
    }

    fn f(limit: f64) -> f64 {
        limit.log10().max(1.0)
    }
}

impl AdaptiveLimit for Vegas {
    fn limit(&self) -> u32 {
        whole(self.limit)
    }

    fn update(&mut self, sample: &Sample) -> u32 {
        let l = self.limit;
        let f = Vegas::f(l);
        let new = match sample.outcome {
            Outcome::BackPressure => {
                if !self.epoch.cut(sample.rtt, sample.now) {
                    return self.limit();
                }
                l - f
            }
            Outcome::Ok if !sample.rtt.is_zero() => {
                self.samples += 1;
                if self.samples >= u64::from(self.probe_multiplier) * (l as u64).max(1) {
                    self.samples = 0;
                    self.no_load = None;
                }
                let Some(no_load) = self.no_load else {
                    // The first call of a no-load time only measures it: its queue
                    // estimate, against itself, would be 0 whatever the queue.
                    self.no_load = Some(sample.rtt);
                    return self.limit();
                };
                let min = *self.no_load.insert(no_load.min(sample.rtt));
                if f64::from(sample.in_flight) * 2.0 < l {
                    return self.limit();
                }
                let queue = (l * (1.0 - secs(min) / secs(sample.rtt))).ceil();
                if queue <= f {
                    l + self.beta * f
                } else if queue < self.alpha * f {
                    l + f
                } else if queue > self.beta * f {
                    l - f
                } else {
                    return self.limit();
                }
            }
            _ => return self.limit(),
        };
        self.limit = self
            .bounds
            .clamp((1.0 - self.smoothing) * l + self.smoothing * new);
        self.limit()
    }

    fn bound(&mut self, min_limit: u32, max_limit: u32) {
        self.bounds.narrow(min_limit, max_limit, &mut self.limit);
    }

    fn name(&self) -> &'static str {
        "vegas"
    }

    fn rtt_estimates(&self) -> RttEstimates {
        RttEstimates::new(self.no_load, None)
    }
}

/// Builds a [`Vegas`]; from [`Vegas::builder`].
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until built"]
pub struct VegasBuilder {
    bounds: Bounds,
    alpha: f64,
    beta: f64,
    smoothing: f64,
    probe_multiplier: u32,
}

impl VegasBuilder {
    crate::adaptive::common::bounds_setters!("20");

    /// Below `alpha × log10(L)` queued calls the limit grows (default 3).
    pub fn alpha(mut self, alpha: f64) -> Self {
        self.alpha = alpha;
        self
    }

    /// Above `beta × log10(L)` queued calls the limit shrinks (default 6).
    pub fn beta(mut self, beta: f64) -> Self {
        self.beta = beta;
        self
    }

    /// How much of each change is applied, in `(0, 1]` (default 1: all of it).
    pub fn smoothing(mut self, smoothing: f64) -> Self {
        self.smoothing = smoothing;
        self
    }

    /// The no-load time is measured again every `n × L` samples (default 30).
    pub fn probe_multiplier(mut self, n: u32) -> Self {
        self.probe_multiplier = n;
        self
    }

    /// Build it.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] on `vegas.min_limit`, `vegas.max_limit`, `vegas.initial` (as for
    /// [`Aimd`](crate::adaptive::Aimd)), `vegas.alpha` (below 1 or not finite), `vegas.beta`
    /// (below `alpha` or not finite), `vegas.smoothing` (outside `(0, 1]`),
    /// `vegas.probe_multiplier` (zero).
    pub fn build(self) -> Result<Vegas, ConfigError> {
        let bounds = self
            .bounds
            .check(["vegas.min_limit", "vegas.max_limit", "vegas.initial"])?;
        let alpha = check_at_least("vegas.alpha", self.alpha, 1.0)?;
        let beta = check_at_least("vegas.beta", self.beta, alpha)?;
        if !(self.smoothing > 0.0 && self.smoothing <= 1.0) {
            return Err(ConfigError::new(
                "vegas.smoothing",
                ConfigErrorKind::Inconsistent,
                format!("{} is not in (0, 1]", self.smoothing),
            ));
        }
        if self.probe_multiplier == 0 {
            return Err(ConfigError::zero("vegas.probe_multiplier"));
        }
        Ok(Vegas {
            limit: f64::from(bounds.initial),
            bounds,
            alpha,
            beta,
            smoothing: self.smoothing,
            probe_multiplier: self.probe_multiplier,
            samples: 0,
            no_load: None,
            epoch: Epoch::default(),
        })
    }
}
