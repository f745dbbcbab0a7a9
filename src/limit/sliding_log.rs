//! `SlidingLog`: the exact sliding window.

use std::collections::VecDeque;
use std::time::Duration;

use crate::decision::Decision;
use crate::error::CostError;
use crate::limit::Algorithm;
use crate::limit::limiter::{from_nanos, join, split};
use crate::rate::Rate;

/// At most `count` units in *any* interval of length `window` (the rate's count and period):
/// the exact sliding window.
///
/// The log keeps one entry per admission time (a timestamp and the cost admitted then); an
/// entry admitted at `t` counts while `now < t + window`. Memory is bounded: the live
/// entries' costs sum to at most `count`, so there are at most `count` entries (fewer when
/// requests cost more than 1 or share a timestamp).
///
/// # Cost
///
/// A check reads the log from its oldest entry, as far as it must, whatever its length. An
/// admitted check reads the entries that have stopped counting, drops them, and reads one
/// more: each entry is read and dropped once, though the first check after a quiet spell
/// drops every entry of it (up to `count`). A rejected check drops nothing (its state stays
/// as it was) and reads at most `2 × cost` entries: those that have stopped counting
/// weigh less than `cost` (else it would be admitted), and those it reads to find the
/// `retry_after` weigh at most `cost`. With costs of 1, a rejected check reads two entries
/// however long the log is. A key keeps the room its log grew to: at most `count` entries
/// of 16 bytes, rounded up to a power of two, and at least 4 once it holds one.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use flowgate::limit::{Limiter, SlidingLog};
/// use flowgate::Rate;
///
/// let mut log = Limiter::new(SlidingLog::new(Rate::per_second(2)?));
/// let ms = Duration::from_millis;
/// assert!(log.check(ms(0), 1)?.allowed);
/// assert!(log.check(ms(600), 1)?.allowed);
/// let d = log.check(ms(900), 1)?;
/// assert!(!d.allowed);
/// assert_eq!(d.retry_after, ms(100)); // the entry from t = 0 expires at 1000 ms
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct SlidingLog {
    rate: Rate,
    limit: u32,
    window: u64,
}

/// The state of one [`SlidingLog`] key: the live entries, oldest first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SlidingLogState {
    /// Oldest first.
    log: VecDeque<Entry>,
    total: u32,
}

/// One admission time and the cost admitted then: the time in nanoseconds in two halves
/// (any `Duration` is below 2^94 ns), so that an entry costs 16 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    at_lo: u64,
    at_hi: u32,
    cost: u32,
}

impl Entry {
    fn new(at: u128, cost: u32) -> Entry {
        let (at_lo, at_hi) = split(at);
        Entry { at_lo, at_hi, cost }
    }

    #[inline]
    fn at(&self) -> u128 {
        join(self.at_lo, self.at_hi)
    }
}

impl SlidingLogState {
    /// The number of log entries held (at most the rate's count).
    pub fn entries(&self) -> usize {
        self.log.len()
    }
}

impl SlidingLog {
    /// A limiter admitting `rate.count()` units in any interval of `rate.period()`.
    pub fn new(rate: Rate) -> SlidingLog {
        SlidingLog {
            rate,
            limit: rate.count(),
            window: rate.period_nanos(),
        }
    }

    /// The count and window.
    pub fn rate(&self) -> Rate {
        self.rate
    }

    /// How many of the oldest entries have expired at `now`, and their total cost.
    fn expired(&self, state: &SlidingLogState, now: u128) -> (usize, u32) {
        let mut n = 0;
        let mut cost = 0;
        for e in &state.log {
            if self.end(e) > now {
                break;
            }
            n += 1;
            cost += e.cost;
        }
        (n, cost)
    }

    /// When `e` stops counting, in nanoseconds.
    #[inline]
    fn end(&self, e: &Entry) -> u128 {
        e.at() + u128::from(self.window)
    }

    fn reset_after(&self, state: &SlidingLogState, now: u128) -> Duration {
        state.log.back().map_or(Duration::ZERO, |e| {
            from_nanos(self.end(e).saturating_sub(now))
        })
    }
}

impl Algorithm for SlidingLog {
    type State = SlidingLogState;

    fn check(
        &self,
        state: &mut SlidingLogState,
        now: Duration,
        cost: u32,
    ) -> Result<Decision, CostError> {
        CostError::check(cost, self.capacity())?;
        // Time going backwards is treated as no time passing; waits count from `given`.
        let given = now.as_nanos();
        let now = given.max(state.log.back().map_or(0, Entry::at));
        // Expired entries are dropped only when admitting: a rejection leaves the state
        // unchanged, so a `now` that steps back after it still sees them (the log's clock
        // stays at its newest entry).
        let (expired, freed) = self.expired(state, now);
        let total = state.total - freed;
        let limit = u64::from(self.limit);
        // What is left: none when the log holds more than the limit (a state filled under a
        // higher one). Compared without adding (no overflow near u32::MAX).
        let left = self.limit.saturating_sub(total);
        if cost <= left {
            state.log.drain(..expired);
            state.total = total + cost;
            match state.log.back_mut() {
                Some(e) if e.at() == now => e.cost += cost,
                _ => state.log.push_back(Entry::new(now, cost)),
            }
            Ok(Decision::allow(
                limit,
                u64::from(left - cost),
                self.reset_after(state, given),
            ))
        } else {
            // Free the oldest entries until `cost` fits (at most `total`: `cost <= limit`);
            // the last one freed sets the wait.
            let mut need = u64::from(cost) + u64::from(total) - u64::from(self.limit);
            let mut retry = 0;
            for e in state.log.iter().skip(expired) {
                retry = self.end(e) - given;
                if u64::from(e.cost) >= need {
                    break;
                }
                need -= u64::from(e.cost);
            }
            Ok(Decision::reject(
                limit,
                u64::from(left),
                from_nanos(retry),
                self.reset_after(state, given),
            ))
        }
    }

    fn capacity(&self) -> u64 {
        u64::from(self.limit)
    }

    fn neutral_at(&self, state: &SlidingLogState) -> Duration {
        state
            .log
            .back()
            .map_or(Duration::ZERO, |e| from_nanos(self.end(e)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The room a key keeps, as documented: its limit in entries rounded up to a power of
    /// two, and at least 4 (a vector's least room) once it holds one, however long it runs.
    #[test]
    fn a_log_keeps_its_limit_rounded_up_to_a_power_of_two_and_at_least_four() {
        for limit in [1u32, 2, 3, 4, 5, 100] {
            let log = SlidingLog::new(Rate::per(limit, Duration::from_nanos(1_000)).unwrap());
            let mut state = SlidingLogState::default();
            for t in 0..10_000 {
                let _ = log.check(&mut state, Duration::from_nanos(t), 1);
                assert!(state.entries() <= limit as usize);
            }
            let room = (limit as usize).next_power_of_two().max(4);
            assert_eq!(state.log.capacity(), room, "limit {limit}");
        }
    }
}
