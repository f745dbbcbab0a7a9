//! The local rejection cache: what Redis just rejected is rejected here until its
//! `retry_after`, without a round trip.

use std::collections::HashMap;
use std::sync::PoisonError;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime};

use crate::decision::Decision;
use crate::gate::limit::Limit;
use crate::sync::Mutex;

#[derive(Debug, Clone, Copy)]
struct Entry {
    /// The smallest cost Redis rejected for this key...
    cost: u32,
    /// ...until this instant (measured from when the request was sent, so never later than
    /// the server would admit it)...
    until: Instant,
    /// ...or this time of the wall clock, whichever comes first: `until` on the clock that
    /// runs on while the host sleeps (`Instant` stops; Redis's clock does not).
    wall_until: SystemTime,
    /// The rejection, for the fields of cached answers.
    decision: Decision,
}

/// The cached rejections, and when the first of them expires.
#[derive(Debug, Default)]
struct Entries {
    map: HashMap<String, Entry>,
    /// No entry expires before both of these, on `Instant` and on the wall clock (`None`:
    /// no entry): a full cache is not swept for room before one of them is reached.
    next_expiry: Option<(Instant, SystemTime)>,
}

/// The first ends among `next`'s and `entry`'s, each on its clock.
fn earliest(next: Option<(Instant, SystemTime)>, entry: &Entry) -> (Instant, SystemTime) {
    next.map_or((entry.until, entry.wall_until), |(at, wall_at)| {
        (at.min(entry.until), wall_at.min(entry.wall_until))
    })
}

/// Rejections Redis made, per key, with bounded memory.
///
/// Exact: after Redis rejects cost `c` for key `k` with `retry_after` T, any request of cost
/// ≥ `c` for `k` before T would be rejected by Redis too — time is the only thing that
/// makes room, and other callers only take it. T is counted from the moment the request was
/// sent, which is no later than the script ran, so the cache never rejects something Redis
/// would admit. A larger cost waits longer than `c`: a token bucket's by one emission
/// interval per unit more, a fixed window's not at all (every cost fits in the next
/// window); for the sliding algorithms only Redis knows, so a larger cost goes there. When
/// full, it stops caching (never wrong, only less useful) until an entry expires.
///
/// A cached answer is of the moment it is given, as if nothing had been admitted on the key
/// since (others only take): `retry_after` and `reset_after` count down, and a token
/// bucket's `remaining` counts the units refilled since the rejection.
///
/// Time runs on both clocks: `Instant` (`CLOCK_MONOTONIC`) stops while the host sleeps (a
/// laptop suspended, a VM paused) where Redis's clock does not, so an entry also expires
/// when the wall clock reaches its end (a wall clock stepped forward ends entries early:
/// those requests go to Redis; one stepped back changes nothing). What is left for the
/// wall clock is taken when the rejection is recorded: a host that slept while the request
/// was in flight may keep it up to that sleep longer (bounded by the `retry_after`).
#[derive(Debug)]
pub(crate) struct RejectCache {
    entries: Mutex<Entries>,
    /// `entries.len()`, readable without the lock: an empty cache costs one load.
    count: AtomicUsize,
    capacity: usize,
    /// The limit Redis decides by: how much longer a larger cost waits.
    limit: Limit,
    /// Passes over every entry made to find expired ones (tests).
    #[cfg(test)]
    sweeps: AtomicUsize,
}

impl RejectCache {
    pub(crate) fn new(capacity: usize, limit: Limit) -> RejectCache {
        RejectCache {
            entries: Mutex::new(Entries::default()),
            count: AtomicUsize::new(0),
            capacity,
            limit,
            #[cfg(test)]
            sweeps: AtomicUsize::new(0),
        }
    }

    /// How much longer than a rejected cost a cost `more` units above it waits under
    /// [`limit`](RejectCache::limit), if that is known without Redis (rounded up).
    fn longer_wait(&self, more: u32) -> Option<Duration> {
        match self.limit {
            // One emission interval per unit.
            Limit::TokenBucket(q) => Some(q.rate().time_for(more)),
            // Every cost fits once the window ends.
            Limit::FixedWindow(_) => Some(Duration::ZERO),
            // It depends on the log or the counts, which only Redis has.
            Limit::SlidingLog(_) | Limit::SlidingWindow(_) => None,
        }
    }

    /// A cached rejection for `cost` on `key` at `now`, if one applies. `wall` reads the
    /// wall clock, only for a key with an entry (`SystemTime::now`; tests pass their own).
    pub(crate) fn check(
        &self,
        key: &str,
        cost: u32,
        now: Instant,
        wall: impl FnOnce() -> SystemTime,
    ) -> Option<Decision> {
        // A rejection being recorded concurrently may be missed: the request then goes to
        // Redis, which is never wrong.
        if self.count.load(Ordering::Acquire) == 0 {
            return None;
        }
        let mut entries = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
        let entry = *entries.map.get(key)?;
        // What is left on each clock; nothing on either: expired.
        let left = entry
            .until
            .checked_duration_since(now)
            .filter(|left| !left.is_zero())
            .and_then(|left| match entry.wall_until.duration_since(wall()) {
                Ok(wall_left) if !wall_left.is_zero() => Some(left.min(wall_left)),
                _ => None,
            });
        let Some(left) = left else {
            entries.map.remove(key);
            self.count.store(entries.map.len(), Ordering::Release);
            return None;
        };
        if cost < entry.cost {
            return None;
        }
        let longer = match cost - entry.cost {
            0 => Duration::ZERO,
            more => self.longer_wait(more)?,
        };
        let mut d = entry.decision;
        d.retry_after = left.saturating_add(longer);
        d.reset_after = d
            .reset_after
            .saturating_sub(entry.decision.retry_after.saturating_sub(left));
        d.remaining = self.remaining(&entry, d.reset_after);
        Some(d)
    }

    /// The units `entry`'s key holds when it is `reset_after` from its neutral state, as far
    /// as the cache can tell: a token bucket's refill since the rejection (fewer than the
    /// cost rejected: it is still rejected); otherwise what Redis said then (a fixed window
    /// refills only when its window, and with it the entry, ends; the sliding algorithms'
    /// refill only Redis knows).
    fn remaining(&self, entry: &Entry, reset_after: Duration) -> u64 {
        let then = entry.decision.remaining;
        let Limit::TokenBucket(q) = self.limit else {
            return then;
        };
        // Each unit missing from a full bucket is one emission interval of `reset_after`,
        // a part of one a whole unit.
        let rate = q.rate();
        let missing = (reset_after.as_nanos() * u128::from(rate.count()))
            .div_ceil(u128::from(rate.period_nanos()));
        let now = u64::from(q.burst_size())
            .saturating_sub(u64::try_from(missing).unwrap_or(u64::MAX))
            .min(u64::from(entry.cost).saturating_sub(1));
        now.max(then)
    }

    /// Remember that Redis rejected `cost` on `key` for a request sent at `sent`; `read`:
    /// both clocks now (`(Instant::now(), SystemTime::now())`; tests pass their own).
    /// Only if `fresh` (asked under the lock [`clear`](RejectCache::clear) takes) says that
    /// the cache was not cleared since the request was sent: Redis may have lost the state
    /// it rejected on. A clear racing this call then either comes after it and removes the
    /// rejection, or comes before it and keeps it out.
    pub(crate) fn rejected(
        &self,
        key: &str,
        cost: u32,
        sent: Instant,
        decision: &Decision,
        read: (Instant, SystemTime),
        fresh: impl FnOnce() -> bool,
    ) {
        if self.capacity == 0 || decision.retry_after == Duration::ZERO {
            return;
        }
        let until = sent + decision.retry_after;
        let (now, wall) = read;
        // (Beyond what `SystemTime` holds: not cached, never wrong.)
        let Some(wall_until) = wall.checked_add(until.saturating_duration_since(now)) else {
            return;
        };
        let mut entries = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
        if !fresh() {
            return;
        }
        if entries.map.len() >= self.capacity && !entries.map.contains_key(key) {
            // None has expired yet: no pass over them all (under the lock every check
            // takes) to find that out again for each new key.
            if entries
                .next_expiry
                .is_some_and(|(at, wall_at)| now < at && wall < wall_at)
            {
                return;
            }
            #[cfg(test)]
            self.sweeps.fetch_add(1, Ordering::Relaxed);
            let mut next = None;
            entries.map.retain(|_, e| {
                let live = e.until > now && e.wall_until > wall;
                if live {
                    next = Some(earliest(next, e));
                }
                live
            });
            entries.next_expiry = next;
            self.count.store(entries.map.len(), Ordering::Release);
            if entries.map.len() >= self.capacity {
                return;
            }
        }
        let entry = Entry {
            cost,
            until,
            wall_until,
            decision: *decision,
        };
        entries.next_expiry = Some(earliest(entries.next_expiry, &entry));
        entries.map.insert(key.to_owned(), entry);
        self.count.store(entries.map.len(), Ordering::Release);
    }

    pub(crate) fn len(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }

    /// Forget every rejection: they were made by a Redis that may have lost its state since
    /// (restarted without its data, failed over), and would reject what it now admits.
    pub(crate) fn clear(&self) {
        let mut entries = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
        entries.map.clear();
        entries.next_expiry = None;
        self.count.store(0, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant, SystemTime};

    use proptest::prelude::*;

    use std::sync::atomic::Ordering;

    use super::RejectCache;
    use crate::gate::Limit;
    use crate::limit::{Algorithm, FixedWindow, Limiter, SlidingLog, SlidingWindow, TokenBucket};
    use crate::{Quota, Rate};

    /// Play Redis with a model on explicit time; feed the cache its rejections; whenever the
    /// cache rejects, the model (on a copy, consuming nothing) must reject too, with a
    /// `retry_after` no longer than the cache's.
    fn never_rejects_what_the_model_admits<A: Algorithm + Clone>(
        limit: Limit,
        algorithm: A,
        trace: &[(u64, u8, u32, bool)],
    ) -> Result<(), TestCaseError> {
        let origin = Instant::now();
        let wall0 = SystemTime::now();
        let cache = RejectCache::new(4, limit);
        let mut models: Vec<Limiter<A>> = (0..6).map(|_| Limiter::new(algorithm.clone())).collect();
        // Whether the model admitted on a key since its last rejection was cached: then the
        // cached retry_after may be short (it holds if nothing else is admitted meanwhile).
        let mut admitted_since = [false; 6];
        let mut t = 0u64;
        for &(gap, key, cost, ask_cache_only) in trace {
            t += gap;
            let now = Duration::from_micros(t);
            let at = origin + now;
            let name = format!("k{key}");
            let model = &mut models[usize::from(key)];
            if cost as u64 > model.capacity() {
                continue;
            }
            let wall = wall0 + now;
            if let Some(cached) = cache.check(&name, cost, at, || wall) {
                prop_assert!(!cached.allowed);
                let mut probe = model.clone();
                let truth = probe.check(now, cost).unwrap();
                prop_assert!(
                    !truth.allowed,
                    "cache rejected cost {} on {} at {} but the model admits",
                    cost,
                    name,
                    t
                );
                // Nor does it tell the caller to come back before the model would admit.
                prop_assert!(
                    admitted_since[usize::from(key)] || cached.retry_after >= truth.retry_after,
                    "cache told cost {} on {} at {} to retry after {:?}, the model after {:?}",
                    cost,
                    name,
                    t,
                    cached.retry_after,
                    truth.retry_after
                );
                // Its `remaining` is of now too: what the model has, to the unit the rounded
                // `reset_after` it has to go by allows, where time alone refills (a token
                // bucket; a fixed window, whose entry ends with its window); never more.
                let refill_known = matches!(limit, Limit::TokenBucket(_) | Limit::FixedWindow(_));
                prop_assert!(
                    admitted_since[usize::from(key)]
                        || (cached.remaining <= truth.remaining
                            && (!refill_known || cached.remaining + 1 >= truth.remaining)),
                    "cache said {} remain on {} at {}, the model {}",
                    cached.remaining,
                    name,
                    t,
                    truth.remaining
                );
                continue;
            }
            if ask_cache_only {
                continue;
            }
            let d = model.check(now, cost).unwrap();
            if d.allowed {
                admitted_since[usize::from(key)] = true;
            } else {
                cache.rejected(&name, cost, at, &d, (at, wall), || true);
                admitted_since[usize::from(key)] = false;
            }
        }
        Ok(())
    }

    fn trace() -> impl Strategy<Value = Vec<(u64, u8, u32, bool)>> {
        prop::collection::vec((0u64..40_000, 0u8..6, 1u32..4, any::<bool>()), 1..300)
    }

    proptest! {
        // No regression file: the crate's top level holds only what DESIGN.md lists.
        #![proptest_config(ProptestConfig {
            cases: 200,
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        #[test]
        fn token_bucket(tr in trace(), n in 1u32..6, burst in 1u32..6) {
            let q = Quota::new(Rate::per(n, Duration::from_millis(100)).unwrap(), burst).unwrap();
            never_rejects_what_the_model_admits(Limit::TokenBucket(q), TokenBucket::new(q), &tr)?;
        }

        #[test]
        fn windows(tr in trace(), n in 3u32..8) {
            let r = Rate::per(n, Duration::from_millis(100)).unwrap();
            never_rejects_what_the_model_admits(Limit::FixedWindow(r), FixedWindow::new(r), &tr)?;
            never_rejects_what_the_model_admits(Limit::SlidingLog(r), SlidingLog::new(r), &tr)?;
            never_rejects_what_the_model_admits(Limit::SlidingWindow(r), SlidingWindow::new(r), &tr)?;
        }
    }

    /// A full cache whose entries are all live is not swept for each new key it is given
    /// (a pass over every entry, under the lock every check takes): only once one of them
    /// can have expired. A flood of new keys rejected at capacity (a limit per client, many
    /// clients over it) made each of those calls a pass over the 10 000 entries.
    #[test]
    fn a_full_cache_of_live_entries_is_not_swept_for_each_new_key() {
        let limit = Limit::TokenBucket(Quota::per_second(1).unwrap());
        let cache = RejectCache::new(100, limit);
        let mut b = Limiter::new(TokenBucket::new(Quota::per_hour(1).unwrap()));
        b.check(Duration::ZERO, 1).unwrap();
        let hour = b.check(Duration::ZERO, 1).unwrap();
        let now = Instant::now();
        let read = (now, SystemTime::now());
        for i in 0..100 {
            cache.rejected(&format!("live{i}"), 1, now, &hour, read, || true);
        }
        for i in 0..1_000 {
            cache.rejected(&format!("new{i}"), 1, now, &hour, read, || true);
        }
        assert_eq!(cache.len(), 100);
        let sweeps = cache.sweeps.load(Ordering::Relaxed);
        assert!(sweeps <= 1, "swept {sweeps} times with nothing to evict");
        // An entry that has expired is still found and makes room.
        let cache = RejectCache::new(2, limit);
        let second_ago = now.checked_sub(Duration::from_secs(1)).unwrap();
        let mut short = hour;
        short.retry_after = Duration::from_millis(1);
        cache.rejected("expired", 1, second_ago, &short, read, || true);
        cache.rejected("live", 1, now, &hour, read, || true);
        cache.rejected("new", 1, now, &hour, read, || true);
        assert!(
            cache.check("new", 1, now, || read.1).is_some(),
            "the expired entry made room"
        );
    }

    #[test]
    fn a_full_cache_stops_caching_instead_of_guessing() {
        let cache = RejectCache::new(1, Limit::TokenBucket(Quota::per_second(1).unwrap()));
        let (now, wall) = (Instant::now(), SystemTime::now());
        let mut b = Limiter::new(TokenBucket::new(Quota::per_second(1).unwrap()));
        b.check(Duration::ZERO, 1).unwrap();
        let d = b.check(Duration::ZERO, 1).unwrap();
        cache.rejected("a", 1, now, &d, (now, wall), || true);
        cache.rejected("b", 1, now, &d, (now, wall), || true);
        assert_eq!(cache.len(), 1);
        assert!(cache.check("b", 1, now, || wall).is_none());
        assert!(cache.check("a", 1, now, || wall).is_some());
        let second = Duration::from_secs(1);
        assert!(
            cache
                .check("a", 1, now + second, || wall + second)
                .is_none(),
            "expired"
        );
    }

    /// `Instant` stops while the host sleeps; Redis's clock, and the wall clock, do not. A
    /// rejection cached for an hour before the host slept for that hour refused, after it
    /// woke, what Redis admitted, for the hour more `Instant` had to run.
    #[test]
    fn a_rejection_ends_by_the_wall_clock_too() {
        let limit = Limit::TokenBucket(Quota::per_hour(1).unwrap());
        let cache = RejectCache::new(4, limit);
        let mut b = Limiter::new(TokenBucket::new(Quota::per_hour(1).unwrap()));
        b.check(Duration::ZERO, 1).unwrap();
        let hour = b.check(Duration::ZERO, 1).unwrap();
        assert_eq!(hour.retry_after, Duration::from_secs(3600));
        let (now, wall) = (Instant::now(), SystemTime::now());
        let ms = Duration::from_millis(1);
        // Sent 1 ms before it was recorded: an hour from the sending, on both clocks.
        cache.rejected("k", 1, now, &hour, (now + ms, wall + ms), || true);
        let left = |mono: Duration, wall_ran: Duration| {
            cache
                .check("k", 1, now + mono, || wall + wall_ran)
                .map(|d| d.retry_after)
        };
        let quarter = Duration::from_secs(900);
        // Awake: both clocks agree.
        assert_eq!(left(quarter, quarter), Some(3 * quarter));
        // The host slept half an hour (the wall clock ran on, `Instant` did not): half an
        // hour less to wait, as Redis counts.
        assert_eq!(left(quarter, 3 * quarter), Some(quarter));
        // A wall clock stepped back changes nothing.
        assert_eq!(left(quarter, Duration::ZERO), Some(3 * quarter));
        // Slept the rest of the hour: gone, the request goes to Redis.
        assert_eq!(left(quarter, 4 * quarter), None);
        assert_eq!(cache.len(), 0);
    }

    /// A full cache whose entries the wall clock ended while the host slept (`Instant`
    /// stood still) makes room for a new rejection: the sweep finds them expired. (Before,
    /// the sweep was skipped until `Instant` reached the first entry's end, so after a sleep
    /// no new key's rejection was cached, each went to Redis, for up to the longest
    /// `retry_after`: an hour on a quota per hour.)
    #[test]
    fn a_full_cache_makes_room_from_entries_the_wall_clock_ended() {
        let quota = Quota::per_hour(1).unwrap();
        let cache = RejectCache::new(2, Limit::TokenBucket(quota));
        let mut b = Limiter::new(TokenBucket::new(quota));
        b.check(Duration::ZERO, 1).unwrap();
        let hour = b.check(Duration::ZERO, 1).unwrap();
        let (now, wall) = (Instant::now(), SystemTime::now());
        cache.rejected("a", 1, now, &hour, (now, wall), || true);
        cache.rejected("b", 1, now, &hour, (now, wall), || true);
        assert_eq!(cache.len(), 2);
        // The host slept two hours: the wall clock ran on, `Instant` did not.
        let later = now + Duration::from_millis(1);
        let woke = wall + Duration::from_secs(7200);
        cache.rejected("c", 1, later, &hour, (later, woke), || true);
        assert!(
            cache.check("c", 1, later, || woke).is_some(),
            "the new rejection is cached"
        );
        assert_eq!(cache.len(), 1, "the entries the wall clock ended are gone");
    }
}
