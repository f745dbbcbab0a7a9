//! The `Algorithm` trait, the single `Limiter`, and the integer helpers the algorithms share.

use std::fmt::Debug;
use std::time::Duration;

use crate::decision::Decision;
use crate::error::CostError;

/// A rate-limiting algorithm: immutable configuration whose per-key state is kept apart.
///
/// Splitting the algorithm (shared, `Send + Sync`) from its state (a few integers) is what
/// lets [`Keyed`](crate::limit::Keyed) hold one small state per key under a single
/// configuration, and what the Redis scripts mirror: the script is the algorithm, the key's
/// value is the state. Use [`Limiter`] for one limiter with its state inside.
///
/// `now` is the time since an origin of the caller's choice (the same for every call on one
/// state), with nanosecond resolution. Time must not go backwards; if it does, the earlier
/// `now` is decided no more leniently than any later one the state has seen, which is
/// conservative: [`FixedWindow`](crate::limit::FixedWindow) and
/// [`SlidingLog`](crate::limit::SlidingLog) decide a `now` before their latest admission as
/// at that admission (no time has passed), [`TokenBucket`](crate::limit::TokenBucket) more strictly (the refill
/// between the earlier `now` and the later ones has not come yet), and
/// [`SlidingWindow`](crate::limit::SlidingWindow) too (the previous window weighs as it did
/// at the earlier `now`, or wholly before the current window began). The decision's
/// `retry_after` and `reset_after` are counted from that earlier `now` (so the contract
/// below holds for it too).
///
/// A state belongs to the configuration that made it. Checked under another (a limit
/// lowered on a reload that keeps the states), the windows and the log count what it holds
/// against the new limit and admit nothing past it; a [`TokenBucket`](crate::limit::TokenBucket)
/// state counts time in units of its rate, so under another rate it means another time:
/// carry it over with
/// [`new.state_full_at(old.neutral_at(&state))`](crate::limit::TokenBucket::state_full_at).
///
/// Every implementation follows the same contract:
/// - a rejected check leaves the state unchanged;
/// - `cost == 0` is [`CostError::Zero`], `cost > capacity()` is
///   [`CostError::ExceedsCapacity`], and neither changes the state;
/// - when rejected, checking the same cost again at `now + retry_after` is admitted (if
///   nothing else was admitted in between).
pub trait Algorithm {
    /// The per-key state; `Default` is the state of a fresh key.
    type State: Default + Clone + Debug + Send + Sync;

    /// Decide one request of `cost` units at `now`; consume the cost if it is admitted.
    ///
    /// # Errors
    ///
    /// [`CostError::Zero`] and [`CostError::ExceedsCapacity`], as above.
    fn check(
        &self,
        state: &mut Self::State,
        now: Duration,
        cost: u32,
    ) -> Result<Decision, CostError>;

    /// [`check`](Algorithm::check) with `now` in whole nanoseconds, as
    /// [`Clock::now_nanos`](crate::clock::Clock::now_nanos) reads it. The default converts
    /// to a `Duration`; an algorithm that computes in nanoseconds overrides it to skip the
    /// conversion ([`TokenBucket`](crate::limit::TokenBucket) does). Same decision as
    /// `check(state, Duration::from_nanos(now_ns), cost)`.
    ///
    /// # Errors
    ///
    /// As [`check`](Algorithm::check).
    fn check_nanos(
        &self,
        state: &mut Self::State,
        now_ns: u64,
        cost: u32,
    ) -> Result<Decision, CostError> {
        self.check(state, Duration::from_nanos(now_ns), cost)
    }

    /// The most units that can ever be admitted at once.
    fn capacity(&self) -> u64;

    /// The earliest time at which `state` equals a fresh state again (everything consumed has
    /// been restored). A fresh state returns `Duration::ZERO`. A time past the last one a
    /// `Duration` holds saturates at `Duration::MAX`, which [`is_neutral`](Algorithm::is_neutral)
    /// and [`Keyed`](crate::limit::Keyed) take as never.
    fn neutral_at(&self, state: &Self::State) -> Duration;

    /// Whether `state` at `now` is that of a fresh key, so it can be forgotten: its
    /// [`neutral_at`](Algorithm::neutral_at) is at or before `now`, and is not
    /// `Duration::MAX` (a saturated time: a state busy at `now == Duration::MAX` would read
    /// as neutral, and be given a fresh burst at that same time).
    fn is_neutral(&self, state: &Self::State, now: Duration) -> bool {
        neutral_by(self.neutral_at(state), now)
    }
}

/// Whether a state neutral at `at` (a [`neutral_at`](Algorithm::neutral_at)) is neutral at
/// `now`; `Duration::MAX` is a saturated time, never reached.
#[inline]
pub(crate) fn neutral_by(at: Duration, now: Duration) -> bool {
    at <= now && at < Duration::MAX
}

/// One limiter: an [`Algorithm`] together with its state.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use flowgate::limit::{Limiter, TokenBucket};
/// use flowgate::Quota;
///
/// let mut limiter = Limiter::new(TokenBucket::new(Quota::per_second(1)?));
/// assert!(limiter.check(Duration::ZERO, 1)?.allowed);
/// assert!(!limiter.check(Duration::ZERO, 1)?.allowed);
/// assert!(limiter.is_neutral(Duration::from_secs(1)));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct Limiter<A: Algorithm> {
    algorithm: A,
    state: A::State,
}

impl<A: Algorithm> Limiter<A> {
    /// A fresh limiter running `algorithm`.
    pub fn new(algorithm: A) -> Limiter<A> {
        Limiter {
            algorithm,
            state: A::State::default(),
        }
    }

    /// Decide one request of `cost` units at `now`; see [`Algorithm::check`].
    ///
    /// # Errors
    ///
    /// [`CostError::Zero`], [`CostError::ExceedsCapacity`].
    #[inline]
    pub fn check(&mut self, now: Duration, cost: u32) -> Result<Decision, CostError> {
        self.algorithm.check(&mut self.state, now, cost)
    }

    /// [`check`](Limiter::check) with `now` in whole nanoseconds: the cheap way with a
    /// [`Clock`](crate::clock::Clock), whose [`now_nanos`](crate::clock::Clock::now_nanos)
    /// reads it without building a `Duration` (see [`Algorithm::check_nanos`]).
    ///
    /// # Errors
    ///
    /// [`CostError::Zero`], [`CostError::ExceedsCapacity`].
    ///
    /// # Examples
    ///
    /// ```
    /// use flowgate::clock::Clock;
    /// use flowgate::limit::{Limiter, TokenBucket};
    /// use flowgate::Quota;
    ///
    /// let clock = Clock::counter();
    /// let mut limiter = Limiter::new(TokenBucket::new(Quota::per_second(10)?.burst(2)?));
    /// assert!(limiter.check_nanos(clock.now_nanos(), 2)?.allowed);
    /// assert!(!limiter.check_nanos(clock.now_nanos(), 1)?.allowed);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[inline]
    pub fn check_nanos(&mut self, now_ns: u64, cost: u32) -> Result<Decision, CostError> {
        self.algorithm.check_nanos(&mut self.state, now_ns, cost)
    }

    /// The most units that can ever be admitted at once.
    pub fn capacity(&self) -> u64 {
        self.algorithm.capacity()
    }

    /// When the state is fresh again; see [`Algorithm::neutral_at`].
    pub fn neutral_at(&self) -> Duration {
        self.algorithm.neutral_at(&self.state)
    }

    /// Whether the state at `now` is that of a fresh limiter.
    pub fn is_neutral(&self, now: Duration) -> bool {
        self.algorithm.is_neutral(&self.state, now)
    }

    /// The algorithm.
    pub fn algorithm(&self) -> &A {
        &self.algorithm
    }

    /// The current state.
    pub fn state(&self) -> &A::State {
        &self.state
    }

    /// Forget everything consumed.
    pub fn reset(&mut self) {
        self.state = A::State::default();
    }
}

/// `now` in whole nanoseconds, saturating after ~584 years (`check_nanos` and
/// `Clock::now_nanos` take and give a `u64`).
#[inline]
pub(crate) fn nanos(now: Duration) -> u64 {
    narrow(now).unwrap_or(u64::MAX)
}

/// `now` in whole nanoseconds if they fit a `u64` (the first ~584 years): the algorithms'
/// common path. Past that they compute in 128 bits (any `Duration` is below 2^94 ns),
/// a branch that is not taken before.
#[inline]
pub(crate) fn narrow(now: Duration) -> Option<u64> {
    now.as_secs()
        .checked_mul(1_000_000_000)
        .and_then(|s| s.checked_add(u64::from(now.subsec_nanos())))
}

/// The start of the aligned window of `window` ns that holds `now_ns`: in 64 bits for the
/// first ~584 years, in 128 (a division not taken before) past them.
#[inline]
pub(crate) fn window_start(now_ns: u128, window: u64) -> u128 {
    match u64::try_from(now_ns) {
        Ok(now) => u128::from(now - now % window),
        Err(_) => now_ns - now_ns % u128::from(window),
    }
}

/// A time in nanoseconds from its low 64 and high 32 bits (any `Duration` is below 2^94
/// ns): states keep it so, in 12 bytes instead of a `u128`'s 16 (aligned to 16).
#[inline]
pub(crate) fn join(lo: u64, hi: u32) -> u128 {
    (u128::from(hi) << 64) | u128::from(lo)
}

/// `ns` (below 2^94) as its low 64 and high 32 bits, for [`join`].
#[inline]
pub(crate) fn split(ns: u128) -> (u64, u32) {
    (ns as u64, (ns >> 64) as u32)
}

/// A nanosecond count as a `Duration`, saturating at `Duration::MAX` (past ~584 years
/// through a 128-bit division, a branch that is not taken before).
#[inline]
pub(crate) fn from_nanos(ns: u128) -> Duration {
    match u64::try_from(ns) {
        Ok(ns) => Duration::from_nanos(ns),
        Err(_) => from_wide_nanos(ns),
    }
}

#[cold]
fn from_wide_nanos(ns: u128) -> Duration {
    const NANOS_PER_SEC: u128 = 1_000_000_000;
    match u64::try_from(ns / NANOS_PER_SEC) {
        // The remainder is below 10^9: it fits.
        Ok(secs) => Duration::new(secs, (ns % NANOS_PER_SEC) as u32),
        Err(_) => Duration::MAX,
    }
}

pub(crate) fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}
