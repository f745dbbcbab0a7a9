//! `Aimd`: additive increase, multiplicative decrease.

use std::time::Duration;

use crate::adaptive::common::{Bounds, Epoch, check_fraction, check_positive, whole};
use crate::adaptive::{AdaptiveLimit, Outcome, Sample};
use crate::error::ConfigError;

/// Additive increase, multiplicative decrease: +1 for every successful call while the limit
/// is used, ×`backoff_ratio` on back-pressure or a call taking `timeout` or longer.
///
/// The classic loss-based rule (as in Netflix's `AIMDLimit`): it reacts only to
/// back-pressure, never to latency, so it climbs until the downstream refuses or times out,
/// then backs off. Use it when the downstream says clearly when it is overloaded (429, 503)
/// and latency says little.
///
/// - **Increase**: +1 per [`Outcome::Ok`] sample whose call saw at least half the limit in
///   flight (a caller using less than half its limit is app-limited): the limit grows up to
///   one more than twice the calls in flight, not beyond (24 callers and no back-pressure:
///   a limit of 49). Against a downstream that refuses every call above its capacity at
///   once, the limit hovers one above the capacity: each success adds 1 and lets one more
///   call in, which is refused, and its refusal (a call started after the last cut) takes
///   a tenth back, so most calls are refused (on loopback, a server of capacity 4 refusing
///   at once and 24 callers: a limit of 4 to 5, 1.5 to 2 calls refused for each one
///   served). To keep them from being sent, use [`Probe`](crate::adaptive::Probe) or a
///   fixed limit at the capacity.
/// - **Decrease**: ×`backoff_ratio` (default 0.9, rounded down, at least `min_limit`) on
///   [`Outcome::BackPressure`] or an `Ok` sample taking `timeout` (default 5 s) or longer.
///   Once per congestion epoch: the calls that were already in flight when the limit was cut do not
///   cut it again (a call that started at the cut's very instant counts as in flight, so
///   calls refused at once, in zero time, cut once together).
/// - [`Outcome::Ignored`] changes nothing.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use flowgate::adaptive::{AdaptiveLimit, Aimd, Outcome, Sample};
///
/// let mut aimd = Aimd::builder().initial(10).max_limit(100).build()?;
/// let ok = Sample { rtt: Duration::from_millis(20), in_flight: 10, outcome: Outcome::Ok, now: Duration::from_secs(1) };
/// assert_eq!(aimd.update(&ok), 11);
/// let busy = Sample { outcome: Outcome::BackPressure, now: Duration::from_secs(2), ..ok };
/// assert_eq!(aimd.update(&busy), 9); // 11 × 0.9, rounded down
/// # Ok::<(), flowgate::ConfigError>(())
/// ```
#[derive(Debug, Clone)]
pub struct Aimd {
    bounds: Bounds,
    limit: f64,
    backoff_ratio: f64,
    timeout: Duration,
    epoch: Epoch,
}

impl Aimd {
    /// A builder with the defaults: `min_limit` 1, `max_limit` 1000, `initial` 20,
    /// `backoff_ratio` 0.9, `timeout` 5 s.
    pub fn builder() -> AimdBuilder {
        AimdBuilder {
            bounds: Bounds::new(1, 1000, 20),
            backoff_ratio: 0.9,
            timeout: Duration::from_secs(5),
        }
    }
}

impl AdaptiveLimit for Aimd {
    fn limit(&self) -> u32 {
        whole(self.limit)
    }

    fn update(&mut self, sample: &Sample) -> u32 {
        let congested = match sample.outcome {
            Outcome::Ok => sample.rtt >= self.timeout,
            Outcome::BackPressure => true,
            _ => return self.limit(),
        };
        if congested {
            if self.epoch.cut(sample.rtt, sample.now) {
                self.limit = self.bounds.clamp((self.limit * self.backoff_ratio).floor());
            }
        } else if f64::from(sample.in_flight) * 2.0 >= self.limit {
            self.limit = self.bounds.clamp(self.limit + 1.0);
        }
        self.limit()
    }

    fn bound(&mut self, min_limit: u32, max_limit: u32) {
        self.bounds.narrow(min_limit, max_limit, &mut self.limit);
    }

    fn name(&self) -> &'static str {
        "aimd"
    }
}

/// Builds an [`Aimd`]; from [`Aimd::builder`].
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until built"]
pub struct AimdBuilder {
    bounds: Bounds,
    backoff_ratio: f64,
    timeout: Duration,
}

impl AimdBuilder {
    crate::adaptive::common::bounds_setters!("20");

    /// The factor a decrease multiplies the limit by (default 0.9).
    pub fn backoff_ratio(mut self, ratio: f64) -> Self {
        self.backoff_ratio = ratio;
        self
    }

    /// A successful call slower than this counts as back-pressure (default 5 s).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Build it.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] on `aimd.min_limit` (zero, or above `max_limit`), `aimd.max_limit`
    /// (above 2³¹ − 1), `aimd.initial` (outside the bounds), `aimd.backoff_ratio` (not
    /// strictly between 0 and 1), `aimd.timeout` (zero).
    pub fn build(self) -> Result<Aimd, ConfigError> {
        let bounds = self
            .bounds
            .check(["aimd.min_limit", "aimd.max_limit", "aimd.initial"])?;
        Ok(Aimd {
            limit: f64::from(bounds.initial),
            bounds,
            backoff_ratio: check_fraction("aimd.backoff_ratio", self.backoff_ratio)?,
            timeout: check_positive("aimd.timeout", self.timeout)?,
            epoch: Epoch::default(),
        })
    }
}
