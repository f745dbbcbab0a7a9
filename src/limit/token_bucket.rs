//! `TokenBucket`: GCRA with exact integer arithmetic.

use std::time::Duration;

use strength_reduce::StrengthReducedU64;

use crate::decision::Decision;
use crate::error::CostError;
use crate::limit::Algorithm;
use crate::limit::limiter::{from_nanos, gcd, narrow};
use crate::rate::Quota;

/// A token bucket, implemented as GCRA (the generic cell rate algorithm) with exact integer
/// arithmetic.
///
/// The bucket holds up to `burst` tokens and refills at `rate`; a request of `cost` tokens
/// is admitted when that many are there. GCRA stores a single number per key, the
/// *theoretical arrival time* (TAT) at which the bucket would be full again, instead of a
/// token count and a timestamp.
///
/// # Exactness
///
/// Time is kept in units of `1 / scale` nanoseconds, where `count / period` is reduced to
/// lowest terms and `scale` is its count. One token is then a whole number of units, so
/// `Rate::per_second(3)` refills exactly one token per 333 333 333⅓ ns with no drift.
/// Guarantee: in any interval of length `w`, admitted cost ≤ `burst + rate·w`.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use flowgate::limit::{Limiter, TokenBucket};
/// use flowgate::Quota;
///
/// let mut bucket = Limiter::new(TokenBucket::new(Quota::per_second(10)?.burst(5)?));
/// let t0 = Duration::ZERO;
/// for _ in 0..5 {
///     assert!(bucket.check(t0, 1)?.allowed);
/// }
/// let d = bucket.check(t0, 1)?;
/// assert!(!d.allowed);
/// assert_eq!(d.retry_after, Duration::from_millis(100));
/// assert!(bucket.check(t0 + d.retry_after, 1)?.allowed);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct TokenBucket {
    quota: Quota,
    /// Units per nanosecond.
    scale: u64,
    /// Units per token.
    unit: u64,
    /// `unit` as a divisor prepared once (a multiply and a shift instead of a `div`, which
    /// was a tenth of a `MemoryGate` decision).
    unit_divisor: StrengthReducedU64,
    /// Units for a full bucket: `burst * unit`.
    tau: u128,
    /// `tau` when all arithmetic fits in `u64` nanoseconds (`scale == 1`).
    fast_tau: Option<u64>,
}

/// The state of one [`TokenBucket`] key: its theoretical arrival time, in units.
///
/// Stored as two `u64` halves so that a key costs 16 bytes with 8-byte alignment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TokenBucketState {
    lo: u64,
    hi: u64,
}

impl TokenBucketState {
    #[inline]
    fn get(self) -> u128 {
        (u128::from(self.hi) << 64) | u128::from(self.lo)
    }

    #[inline]
    fn set(&mut self, tat: u128) {
        self.lo = tat as u64;
        self.hi = (tat >> 64) as u64;
    }

    /// Whether this state's bucket is full again later than `other`'s (two states of one
    /// bucket), compared exactly: [`neutral_at`](Algorithm::neutral_at) rounds to the
    /// nanosecond and saturates at `Duration::MAX`.
    pub(crate) fn full_later_than(self, other: TokenBucketState) -> bool {
        self.get() > other.get()
    }
}

impl TokenBucket {
    /// A token bucket for `quota`.
    pub fn new(quota: Quota) -> TokenBucket {
        let rate = quota.rate();
        let g = gcd(u64::from(rate.count()), rate.period_nanos());
        let scale = u64::from(rate.count()) / g;
        let unit = rate.period_nanos() / g;
        let tau = u128::from(quota.burst_size()) * u128::from(unit);
        TokenBucket {
            quota,
            scale,
            unit,
            unit_divisor: StrengthReducedU64::new(unit),
            tau,
            fast_tau: u64::try_from(tau).ok().filter(|_| scale == 1),
        }
    }

    /// The quota this bucket enforces.
    pub fn quota(&self) -> Quota {
        self.quota
    }

    /// Tokens available in `state` at `now`, without consuming any.
    pub fn available(&self, state: &TokenBucketState, now: Duration) -> u64 {
        let now = self.units(now.as_nanos());
        let used = state.get().saturating_sub(now).min(self.tau);
        ((self.tau - used) / u128::from(self.unit)) as u64
    }

    /// `burst − 1` emission intervals, in units: how long before the bucket is full again
    /// ([`neutral_at`](Algorithm::neutral_at)) one more token can be taken.
    fn lead_units(&self) -> i128 {
        // Below 2^96 (a `u32` burst of `u64` units): exact in an `i128`.
        (self.tau - u128::from(self.unit)) as i128
    }

    /// A state in which one more token can be taken at `at_ns` and none before, exact in
    /// units, for holding a schedule until an instant. (Through the lead in whole
    /// nanoseconds, rounded up, the token would be due a fraction of one later, and a 1 ms
    /// timer late by 1 ms.)
    pub(crate) fn state_next_at(&self, at_ns: i128) -> TokenBucketState {
        let tat = at_ns
            .saturating_mul(i128::from(self.scale))
            .saturating_add(self.lead_units());
        let mut state = TokenBucketState::default();
        // Before the origin: full at any time of the timeline.
        state.set(u128::try_from(tat).unwrap_or(0));
        state
    }

    /// A state of this bucket in which one more token can be taken when it could from
    /// `state` of `from` (the bucket of the quota before a change), and none before: the
    /// schedule carried over to a new quota. Exact where this bucket's units can tell that
    /// instant (always under the same rate); else the first instant after it they can,
    /// never one before (at 3/s, a unit due at 333 333 333⅓ ns is not due at 333 333 333).
    pub(crate) fn state_carried(
        &self,
        from: &TokenBucket,
        state: &TokenBucketState,
    ) -> TokenBucketState {
        // When one more token can be taken from `state`, in `from`'s units: negative before
        // the timeline's origin (a bucket holding more than one, early in a pacer's life).
        // A state fits an `i128`: a time below 2^94 ns, in units below 2^32 a nanosecond.
        let next = i128::try_from(state.get()).unwrap_or(i128::MAX) - from.lead_units();
        let (to, from_scale) = (i128::from(self.scale), i128::from(from.scale));
        let at = match next.checked_mul(to) {
            Some(units) => div_ceil(units, from_scale),
            // A time near the end of the timeline: through whole nanoseconds, rounded up.
            None => div_ceil(next, from_scale).saturating_mul(to),
        };
        let mut carried = TokenBucketState::default();
        // Before the origin: full at any time of the timeline.
        carried.set(u128::try_from(at.saturating_add(self.lead_units())).unwrap_or(0));
        carried
    }

    /// When `cost` tokens can be taken from `state` (a time in the same timeline as the
    /// `now` of [`check`](Algorithm::check)); at or before `now` if they can be now. The
    /// cost may be above the burst (the units of a line of waiters, taken one burst after
    /// another): then when the last of them can be.
    pub(crate) fn ready_at(&self, state: &TokenBucketState, cost: u64) -> Duration {
        let needed = u128::from(cost) * u128::from(self.unit);
        self.to_duration(state.get().saturating_add(needed).saturating_sub(self.tau))
    }

    /// A state whose bucket is full again at `at` (its [`neutral_at`](Algorithm::neutral_at)),
    /// for carrying a schedule over to a new quota.
    pub fn state_full_at(&self, at: Duration) -> TokenBucketState {
        let mut state = TokenBucketState::default();
        state.set(self.units(at.as_nanos()));
        state
    }

    /// `now_ns` in units: below 2^126 for any `Duration` (below 2^94 ns) at any scale (below
    /// 2^32), so no `now` overflows.
    fn units(&self, now_ns: u128) -> u128 {
        now_ns * u128::from(self.scale)
    }

    fn to_duration(&self, units: u128) -> Duration {
        from_nanos(units.div_ceil(u128::from(self.scale)))
    }

    /// Any rate and any `now` (past the ~584 years of `u64` nanoseconds too), in 128-bit
    /// units: exact for every `Quota`.
    #[inline(never)]
    fn check_exact(&self, state: &mut TokenBucketState, now_ns: u128, cost: u32) -> Decision {
        let now = self.units(now_ns);
        let limit = self.capacity();
        let tat = state.get().max(now);
        let new_tat = tat + u128::from(cost) * u128::from(self.unit);
        let tokens = |free: u128| (free / u128::from(self.unit)) as u64;
        // Admit when the bucket after this request is at most full: new_tat - now <= tau.
        let used_after = new_tat - now;
        if used_after <= self.tau {
            state.set(new_tat);
            Decision::allow(
                limit,
                tokens(self.tau - used_after),
                self.to_duration(used_after),
            )
        } else {
            // `tat - now` can exceed tau only if time went backwards.
            let used = (tat - now).min(self.tau);
            Decision::reject(
                limit,
                tokens(self.tau - used),
                self.to_duration(used_after - self.tau),
                self.to_duration(tat - now),
            )
        }
    }

    /// The common case in 64-bit integers: whole-nanosecond units and nothing near overflow.
    #[inline(always)]
    fn check_fast(
        &self,
        state: &mut TokenBucketState,
        now: u64,
        cost: u32,
        tau: u64,
    ) -> Option<Decision> {
        if state.hi != 0 {
            return None;
        }
        let tat = state.lo.max(now);
        let new_tat = tat.checked_add(u64::from(cost).checked_mul(self.unit)?)?;
        let used_after = new_tat - now;
        let limit = u64::from(self.quota.burst_size());
        if used_after <= tau {
            state.lo = new_tat;
            let remaining = (tau - used_after) / self.unit_divisor;
            Some(Decision::allow(
                limit,
                remaining,
                Duration::from_nanos(used_after),
            ))
        } else {
            let free = tau - (tat - now).min(tau);
            Some(Decision::reject(
                limit,
                // Rejected, the bucket is mostly empty: skip the division then.
                if free < self.unit {
                    0
                } else {
                    free / self.unit_divisor
                },
                Duration::from_nanos(used_after - tau),
                Duration::from_nanos(tat - now),
            ))
        }
    }
}

/// `n / d` rounded up, for a positive `d`.
fn div_ceil(n: i128, d: i128) -> i128 {
    n.div_euclid(d) + i128::from(n.rem_euclid(d) != 0)
}

impl Algorithm for TokenBucket {
    type State = TokenBucketState;

    #[inline(always)]
    fn check(
        &self,
        state: &mut TokenBucketState,
        now: Duration,
        cost: u32,
    ) -> Result<Decision, CostError> {
        match narrow(now) {
            Some(now_ns) => self.check_nanos(state, now_ns, cost),
            // Past ~584 years: only 128 bits hold `now`.
            None => {
                CostError::check(cost, self.capacity())?;
                Ok(self.check_exact(state, now.as_nanos(), cost))
            }
        }
    }

    #[inline(always)]
    fn check_nanos(
        &self,
        state: &mut TokenBucketState,
        now_ns: u64,
        cost: u32,
    ) -> Result<Decision, CostError> {
        CostError::check(cost, self.capacity())?;
        if let Some(tau) = self.fast_tau
            && let Some(decision) = self.check_fast(state, now_ns, cost, tau)
        {
            return Ok(decision);
        }
        Ok(self.check_exact(state, u128::from(now_ns), cost))
    }

    fn capacity(&self) -> u64 {
        u64::from(self.quota.burst_size())
    }

    fn neutral_at(&self, state: &TokenBucketState) -> Duration {
        self.to_duration(state.get())
    }
}
