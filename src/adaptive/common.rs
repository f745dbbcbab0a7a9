//! What every algorithm shares: the limit's bounds and their validation, an exponentially
//! weighted moving average, a windowed minimum, and the congestion epoch.

use std::time::Duration;

use crate::error::{ConfigError, ConfigErrorKind};

/// The largest limit an algorithm accepts (a bulkhead's largest `max_in_flight`).
pub(crate) const MAX_LIMIT: u32 = (1 << 31) - 1;

/// The `min_limit`, `max_limit` and `initial` setters every algorithm's builder has (a
/// `bounds: Bounds` field); `$initial` is the documented default of `initial`.
macro_rules! bounds_setters {
    ($initial:literal) => {
        /// The lowest limit (default 1).
        pub fn min_limit(mut self, n: u32) -> Self {
            self.bounds.min = n;
            self
        }

        /// The highest limit (default 1000). Left at its default, it gives way to the
        /// bound an adaptive [`Bulkhead`](crate::bulkhead::Bulkhead) sets (its share of
        /// normal work; see [`AdaptiveLimit::bound`](crate::adaptive::AdaptiveLimit::bound)),
        /// and rises to a `min_limit` or `initial` set above it, up to the largest limit,
        /// 2³¹ − 1 (a `min_limit` or `initial` above that is refused on its own field).
        pub fn max_limit(mut self, n: u32) -> Self {
            self.bounds.max = n;
            self.bounds.max_given = true;
            self
        }

        #[doc = concat!(
            "The limit to start from (default ", $initial, ", or the bound nearest it when ",
            "`min_limit` or `max_limit` leave it outside; one given outside them is refused)."
        )]
        pub fn initial(mut self, n: u32) -> Self {
            self.bounds.initial = n;
            self.bounds.initial_given = true;
            self
        }
    };
}
pub(crate) use bounds_setters;

/// `min_limit`, `max_limit`, `initial`: every builder has them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Bounds {
    pub(crate) min: u32,
    pub(crate) max: u32,
    pub(crate) initial: u32,
    /// Whether `max` was set by the user (or by a [`narrow`](Bounds::narrow)), not left at
    /// the builder's default.
    pub(crate) max_given: bool,
    /// Whether `initial` was set by the user, not left at the builder's default.
    pub(crate) initial_given: bool,
    /// The algorithm's own `[min, max]` and whether that `max` was given, as built: every
    /// [`narrow`](Bounds::narrow) starts from them, so new bounds replace the last ones.
    own: (u32, u32, bool),
}

impl Bounds {
    /// The builder's defaults.
    pub(crate) const fn new(min: u32, max: u32, initial: u32) -> Bounds {
        Bounds {
            min,
            max,
            initial,
            max_given: false,
            initial_given: false,
            own: (min, max, false),
        }
    }

    /// Validate; `fields` names `[min_limit, max_limit, initial]` for the error.
    pub(crate) fn check(mut self, fields: [&'static str; 3]) -> Result<Bounds, ConfigError> {
        let [min_f, max_f, initial_f] = fields;
        if !self.max_given {
            // A default max gives way to the bounds given (as to a bulkhead's bound).
            self.max = self.max.max(self.min).max(self.initial).min(MAX_LIMIT);
        }
        if self.min == 0 {
            return Err(ConfigError::zero(min_f));
        }
        if self.max > MAX_LIMIT {
            return Err(ConfigError::new(
                max_f,
                ConfigErrorKind::TooLarge,
                format!("{} is above the maximum {MAX_LIMIT}", self.max),
            ));
        }
        if self.min > self.max {
            return Err(ConfigError::new(
                min_f,
                ConfigErrorKind::Inconsistent,
                format!("{} is above max_limit {}", self.min, self.max),
            ));
        }
        if !self.initial_given {
            // A default start gives way to the bounds given.
            self.initial = self.initial.clamp(self.min, self.max);
        }
        if self.initial < self.min || self.initial > self.max {
            return Err(ConfigError::new(
                initial_f,
                ConfigErrorKind::Inconsistent,
                format!(
                    "{} is outside [min_limit, max_limit] = [{}, {}]",
                    self.initial, self.min, self.max
                ),
            ));
        }
        self.own = (self.min, self.max, self.max_given);
        Ok(self)
    }

    /// Narrow the algorithm's own bounds (as built, whatever an earlier call narrowed them
    /// to) to `[min, max]`: their meet, or the end of `[min, max]` nearest them where they
    /// do not meet; a `max` left at the builder's default is replaced by `max` (up to the
    /// largest limit). A `min` of 0 is taken as 1, a `max` below `min` as `min`; `limit` is
    /// brought within the narrowed bounds: what every algorithm's
    /// [`bound`](crate::adaptive::AdaptiveLimit::bound) does.
    pub(crate) fn narrow(&mut self, min: u32, max: u32, limit: &mut f64) {
        let min = min.max(1);
        let max = max.max(min);
        let (own_min, own_max, max_given) = self.own;
        let own_max = if max_given {
            own_max
        } else {
            max.min(MAX_LIMIT)
        };
        self.min = own_min.clamp(min, max);
        self.max = own_max.clamp(min, max);
        self.initial = self.initial.clamp(min, max);
        self.max_given = true;
        *limit = self.clamp(*limit);
    }

    /// `limit` clamped into the bounds.
    pub(crate) fn clamp(&self, limit: f64) -> f64 {
        if limit.is_nan() {
            return f64::from(self.min);
        }
        limit.clamp(f64::from(self.min), f64::from(self.max))
    }
}

/// `limit` as the whole number reported (rounded down, within `u32`).
pub(crate) fn whole(limit: f64) -> u32 {
    // `as` saturates and maps NaN to 0; the callers clamp first.
    limit as u32
}

/// A finite ratio in `(0, 1)` (exclusive), or an error on `field`.
pub(crate) fn check_fraction(field: &'static str, x: f64) -> Result<f64, ConfigError> {
    if x.is_finite() && x > 0.0 && x < 1.0 {
        Ok(x)
    } else {
        Err(ConfigError::new(
            field,
            ConfigErrorKind::Inconsistent,
            format!("{x} is not strictly between 0 and 1"),
        ))
    }
}

/// A finite value in `[0, 1)`, or an error on `field`.
pub(crate) fn check_below_one(field: &'static str, x: f64) -> Result<f64, ConfigError> {
    if x.is_finite() && (0.0..1.0).contains(&x) {
        Ok(x)
    } else {
        Err(ConfigError::new(
            field,
            ConfigErrorKind::Inconsistent,
            format!("{x} is not in [0, 1)"),
        ))
    }
}

/// A finite value at least `min`, or an error on `field`.
pub(crate) fn check_at_least(field: &'static str, x: f64, min: f64) -> Result<f64, ConfigError> {
    if x.is_finite() && x >= min {
        Ok(x)
    } else {
        Err(ConfigError::new(
            field,
            ConfigErrorKind::Inconsistent,
            format!("{x} is not a finite number of at least {min}"),
        ))
    }
}

/// A positive duration, or an error on `field`.
pub(crate) fn check_positive(field: &'static str, d: Duration) -> Result<Duration, ConfigError> {
    if d.is_zero() {
        Err(ConfigError::zero_duration(field))
    } else {
        Ok(crate::time::capped(d))
    }
}

/// An exponentially weighted moving average (of seconds).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ewma {
    alpha: f64,
    value: Option<f64>,
}

impl Ewma {
    pub(crate) const fn new(alpha: f64) -> Ewma {
        Ewma { alpha, value: None }
    }

    pub(crate) fn update(&mut self, x: f64) -> f64 {
        let v = match self.value {
            Some(v) => v + self.alpha * (x - v),
            None => x,
        };
        self.value = Some(v);
        v
    }

    pub(crate) fn get(&self) -> Option<f64> {
        self.value
    }

    pub(crate) fn set(&mut self, x: f64) {
        self.value = Some(x);
    }
}

/// The minimum round-trip time over a sliding window of time: the minimum of the current
/// and the previous interval of `window`. A minimum older than two windows ages out, so
/// a downstream that got slower for good is learnt again without lowering the limit to
/// measure it (nothing is pinned). A zero round trip (a cached answer, a call shorter than
/// the clock's resolution, paused time) measures nothing and is not taken: a zero minimum
/// would make every positive round trip look infinitely far above it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WindowMin {
    window: Duration,
    started: Option<Duration>,
    current: Option<Duration>,
    previous: Option<Duration>,
}

impl WindowMin {
    pub(crate) const fn new(window: Duration) -> WindowMin {
        WindowMin {
            window,
            started: None,
            current: None,
            previous: None,
        }
    }

    pub(crate) fn update(&mut self, rtt: Duration, now: Duration) {
        if rtt.is_zero() {
            return;
        }
        // A clock that stepped back behind the interval's start starts it again at `now`:
        // else the interval would last until the clock caught up, pinning its minimum.
        let started = match self.started {
            Some(started) if started <= now => started,
            _ => *self.started.insert(now),
        };
        let elapsed = now - started;
        if elapsed >= self.window {
            // Two windows or more since: the previous interval is empty.
            self.previous = if elapsed >= self.window.saturating_mul(2) {
                None
            } else {
                self.current
            };
            self.current = None;
            // The next interval starts on a window boundary, not at this sample: a minimum
            // is read for one to two windows, never longer.
            let into = elapsed
                .as_nanos()
                .checked_rem(self.window.as_nanos())
                .unwrap_or(0);
            let into = Duration::from_nanos(u64::try_from(into).unwrap_or(u64::MAX));
            self.started = Some(now.saturating_sub(into));
        }
        self.current = Some(self.current.map_or(rtt, |m| m.min(rtt)));
    }

    /// Forget every minimum seen: the next sample starts a new interval.
    pub(crate) fn forget(&mut self) {
        *self = WindowMin::new(self.window);
    }

    pub(crate) fn get(&self) -> Option<Duration> {
        match (self.current, self.previous) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

/// The congestion epoch: a cut answers every back-pressure sample of calls that started
/// before it, so the calls in flight at an overload cut the limit once, not once each.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Epoch {
    last_cut: Option<Duration>,
}

impl Epoch {
    /// Whether a call that took `rtt` and ended at `now` started after the last cut (and so
    /// may cut again); if so, the cut is recorded at `now`. A call that started at the
    /// cut's very instant was in flight then (calls refused at once, with a zero round
    /// trip, all end at the instant they started): it does not cut again. A call that ended
    /// before the last cut was made shows a clock that stepped back since: it starts a new
    /// epoch (else no call would cut until the clock caught up with the old one).
    pub(crate) fn cut(&mut self, rtt: Duration, now: Duration) -> bool {
        let started = now.saturating_sub(rtt);
        match self.last_cut {
            Some(at) if started <= at && now >= at => false,
            _ => {
                self.last_cut = Some(now);
                true
            }
        }
    }
}

impl Epoch {
    /// Record a cut at `now` made for another reason (a window's verdict): the calls in
    /// flight now do not cut again.
    pub(crate) fn mark(&mut self, now: Duration) {
        self.last_cut = Some(now);
    }
}

/// Seconds of `d`.
pub(crate) fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// A duration of `s` seconds (non-negative, finite, capped).
pub(crate) fn from_secs(s: f64) -> Duration {
    if s.is_finite() && s > 0.0 {
        Duration::try_from_secs_f64(s).map_or(crate::time::FOREVER, crate::time::capped)
    } else {
        Duration::ZERO
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::WindowMin;

    const W: Duration = Duration::from_secs(10);

    /// A minimum is kept for one to two windows, never longer, however the samples fall:
    /// here one lands just before the second window ends, and the intervals used to restart
    /// at it, so the first window's minimum was still read near the end of the third.
    #[test]
    fn a_minimum_is_forgotten_after_two_windows_at_most() {
        let at = |ms: u64| Duration::from_millis(ms);
        let mut m = WindowMin::new(W);
        m.update(at(1), Duration::ZERO);
        m.update(at(50), at(19_900));
        assert_eq!(m.get(), Some(at(1)), "within two windows");
        m.update(at(50), at(20_100));
        assert_eq!(m.get(), Some(at(50)), "two windows after it was seen");
        m.update(at(50), at(29_000));
        assert_eq!(m.get(), Some(at(50)));
    }

    /// A clock that stepped back (a sample stamped an hour ahead, then time as before) does
    /// not pin a minimum: the interval it started an hour ahead ends at that instant, so the
    /// minimum seen then was read until the clock caught up.
    #[test]
    fn a_minimum_is_forgotten_after_the_clock_stepped_back() {
        let at = |ms: u64| Duration::from_millis(ms);
        let mut m = WindowMin::new(W);
        m.update(at(1), at(3_600_000));
        m.update(at(50), at(1_000));
        m.update(at(50), at(21_000));
        assert_eq!(
            m.get(),
            Some(at(50)),
            "two windows after the clock came back"
        );
    }
}
