//! `FixedWindow`: a counter per aligned window.

use std::time::Duration;

use crate::decision::Decision;
use crate::error::CostError;
use crate::limit::Algorithm;
use crate::limit::limiter::{from_nanos, join, split, window_start};
use crate::rate::Rate;

/// At most `count` units per aligned window of length `window` (the rate's count and
/// period).
///
/// Windows are aligned to the clock's origin: window `k` is `[k·window, (k+1)·window)`.
/// The cheapest algorithm, and the coarsest: up to `2·count` can pass in an interval of
/// length `window` that straddles a boundary. Rejected requests get `retry_after` = the
/// time to the next window.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use flowgate::limit::{FixedWindow, Limiter};
/// use flowgate::Rate;
///
/// let mut w = Limiter::new(FixedWindow::new(Rate::per_second(2)?));
/// let t = Duration::from_millis(250);
/// assert!(w.check(t, 2)?.allowed);
/// let d = w.check(t, 1)?;
/// assert!(!d.allowed);
/// assert_eq!(d.retry_after, Duration::from_millis(750));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct FixedWindow {
    rate: Rate,
    limit: u32,
    window: u64,
}

/// The state of one [`FixedWindow`] key: the current window and its count.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FixedWindowState {
    /// The window's start in nanoseconds, in two halves (any `Duration` is below 2^94 ns),
    /// so that a key costs 16 bytes.
    start_lo: u64,
    start_hi: u32,
    count: u32,
}

impl FixedWindowState {
    #[inline]
    fn start(&self) -> u128 {
        join(self.start_lo, self.start_hi)
    }

    #[inline]
    fn set_start(&mut self, start: u128) {
        (self.start_lo, self.start_hi) = split(start);
    }
}

impl FixedWindow {
    /// A limiter admitting `rate.count()` units per window of `rate.period()`.
    pub fn new(rate: Rate) -> FixedWindow {
        FixedWindow {
            rate,
            limit: rate.count(),
            window: rate.period_nanos(),
        }
    }

    /// The count and window.
    pub fn rate(&self) -> Rate {
        self.rate
    }
}

impl Algorithm for FixedWindow {
    type State = FixedWindowState;

    fn check(
        &self,
        state: &mut FixedWindowState,
        now: Duration,
        cost: u32,
    ) -> Result<Decision, CostError> {
        CostError::check(cost, self.capacity())?;
        let now = now.as_nanos();
        let start = window_start(now, self.window);
        if start > state.start() {
            state.set_start(start);
            state.count = 0;
        }
        // `now` may be earlier than the window start if time went backwards: stay in the
        // window, and count the wait for its end from `now`. In 128 bits, as the window's
        // start: past the ~584 years of `u64` nanoseconds the windows go on.
        let reset = from_nanos(state.start() + u128::from(self.window) - now);
        let limit = u64::from(self.limit);
        // What is left: none when the count is past the limit (a state counted under a
        // higher one). Compared without adding (no overflow near u32::MAX).
        let left = self.limit.saturating_sub(state.count);
        if cost <= left {
            state.count += cost;
            Ok(Decision::allow(limit, u64::from(left - cost), reset))
        } else {
            Ok(Decision::reject(limit, u64::from(left), reset, reset))
        }
    }

    fn capacity(&self) -> u64 {
        u64::from(self.limit)
    }

    fn neutral_at(&self, state: &FixedWindowState) -> Duration {
        if state.count == 0 {
            Duration::ZERO
        } else {
            from_nanos(state.start() + u128::from(self.window))
        }
    }
}
