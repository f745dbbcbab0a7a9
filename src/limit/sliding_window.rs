//! `SlidingWindow`: the weighted two-window counter.

use std::time::Duration;

use crate::decision::Decision;
use crate::error::CostError;
use crate::limit::Algorithm;
use crate::limit::limiter::{from_nanos, join, split, window_start};
use crate::rate::Rate;

/// The sliding window counter: two counters, weighted, in constant memory.
///
/// With `count` and `window` the rate's count and period, it estimates the units admitted
/// over the last `window` as `previous · (window − elapsed) / window + current`, where
/// `current` counts the aligned window containing `now`, `previous` the one before, and
/// `elapsed` is the time since the current window began; a request is admitted when
/// `estimate + cost ≤ count`. The arithmetic is exact integers (the estimate is compared
/// multiplied by `window`).
///
/// # Approximation bound
///
/// The estimate assumes the previous window's requests were spread evenly. Guarantees:
/// - at most `count` units are admitted per aligned window;
/// - in any interval of length `window` ending at offset `e` into an aligned window whose
///   predecessor admitted `p` units, at most `count + p·e / window` units are admitted —
///   always less than `2·count`, and exactly `count` when traffic is even.
///
/// Use [`SlidingLog`](crate::limit::SlidingLog) when the bound must be `count`.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use flowgate::limit::{Limiter, SlidingWindow};
/// use flowgate::Rate;
///
/// let mut w = Limiter::new(SlidingWindow::new(Rate::per_second(10)?));
/// let ms = Duration::from_millis;
/// assert!(w.check(ms(500), 10)?.allowed); // 10 in window [0 s, 1 s)
/// // At 1.5 s the estimate is 10 · 0.5 + 0 = 5, so 5 more fit.
/// assert!(w.check(ms(1500), 5)?.allowed);
/// assert!(!w.check(ms(1500), 1)?.allowed);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct SlidingWindow {
    rate: Rate,
    limit: u32,
    window: u64,
}

/// The state of one [`SlidingWindow`] key: the current window and the two counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SlidingWindowState {
    /// The current window's start in nanoseconds, in two halves (any `Duration` is below
    /// 2^94 ns): 24 bytes a key.
    start_lo: u64,
    start_hi: u32,
    current: u32,
    previous: u32,
}

impl SlidingWindowState {
    #[inline]
    fn start(&self) -> u128 {
        join(self.start_lo, self.start_hi)
    }

    #[inline]
    fn set_start(&mut self, start: u128) {
        (self.start_lo, self.start_hi) = split(start);
    }
}

impl SlidingWindow {
    /// A limiter admitting about `rate.count()` units per sliding `rate.period()`.
    pub fn new(rate: Rate) -> SlidingWindow {
        SlidingWindow {
            rate,
            limit: rate.count(),
            window: rate.period_nanos(),
        }
    }

    /// The count and window.
    pub fn rate(&self) -> Rate {
        self.rate
    }

    fn roll(&self, state: &mut SlidingWindowState, now: u128) {
        let start = window_start(now, self.window);
        if start <= state.start() {
            return;
        }
        state.previous = if start - state.start() == u128::from(self.window) {
            state.current
        } else {
            0
        };
        state.current = 0;
        state.set_start(start);
    }

    /// `estimate · window` at `elapsed` into the current window.
    fn weighted(&self, state: &SlidingWindowState, elapsed: u64) -> u128 {
        u128::from(state.previous) * u128::from(self.window - elapsed)
            + u128::from(state.current) * u128::from(self.window)
    }

    /// Time from `elapsed` until the state is neutral (both counters decayed to zero), from
    /// a `now` that is `behind` the window's start (time went backwards) or not (0).
    fn reset_after(&self, state: &SlidingWindowState, elapsed: u64, behind: u128) -> Duration {
        let to_end = u128::from(self.window - elapsed) + behind;
        from_nanos(if state.current > 0 {
            to_end + u128::from(self.window)
        } else if state.previous > 0 {
            to_end
        } else {
            0
        })
    }

    /// Earliest offset into a window with `prev` in the previous window and `cur` in this one
    /// at which `cost` more fits, if any: `prev·(window − e) ≤ (limit − cur − cost)·window`.
    fn fits_from(&self, prev: u32, cur: u32, cost: u32) -> Option<u64> {
        let spare = self.limit.checked_sub(cur)?.checked_sub(cost)?;
        if prev == 0 {
            return Some(0);
        }
        let slack = u128::from(spare) * u128::from(self.window) / u128::from(prev);
        Some(self.window - slack.min(u128::from(self.window)) as u64)
    }
}

impl Algorithm for SlidingWindow {
    type State = SlidingWindowState;

    fn check(
        &self,
        state: &mut SlidingWindowState,
        now: Duration,
        cost: u32,
    ) -> Result<Decision, CostError> {
        CostError::check(cost, self.capacity())?;
        let now = now.as_nanos();
        // Rolled on a copy, kept only if admitted: a rejection leaves the state unchanged
        // (a clock that steps back after it is decided in the window counted, as in Redis).
        let mut rolled = *state;
        self.roll(&mut rolled, now);
        // Below the window: `now` is in the window rolled to, or before it.
        let elapsed = (now.max(rolled.start()) - rolled.start()) as u64;
        // Time going back before the window is taken as its start; waits count from `now`.
        let behind = rolled.start().saturating_sub(now);
        let limit = u64::from(self.limit);
        let w = u128::from(self.window);
        let weighted = self.weighted(&rolled, elapsed);
        if weighted + u128::from(cost) * w <= u128::from(self.limit) * w {
            rolled.current += cost;
            *state = rolled;
            let after = self.weighted(state, elapsed);
            let remaining = (u128::from(self.limit) * w - after) / w;
            Ok(Decision::allow(
                limit,
                remaining as u64,
                self.reset_after(state, elapsed, behind),
            ))
        } else {
            let state = &rolled;
            let remaining = (u128::from(self.limit) * w).saturating_sub(weighted) / w;
            // Later in this window, or else at an offset into the next one (where this
            // window's count becomes the previous one and nothing is current yet).
            let retry = match self.fits_from(state.previous, state.current, cost) {
                Some(e) if e < self.window => u128::from(e - elapsed),
                _ => {
                    let e = self
                        .fits_from(state.current, 0, cost)
                        .unwrap_or(self.window);
                    // In 128 bits: past u64::MAX ns with the longest windows.
                    u128::from(self.window - elapsed) + u128::from(e)
                }
            };
            Ok(Decision::reject(
                limit,
                remaining as u64,
                from_nanos(retry + behind),
                self.reset_after(state, elapsed, behind),
            ))
        }
    }

    fn capacity(&self) -> u64 {
        u64::from(self.limit)
    }

    fn neutral_at(&self, state: &SlidingWindowState) -> Duration {
        let end = state.start() + u128::from(self.window);
        from_nanos(if state.current > 0 {
            end + u128::from(self.window)
        } else if state.previous > 0 {
            end
        } else {
            0
        })
    }
}
