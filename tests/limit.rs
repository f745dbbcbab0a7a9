//! The limiter math against simple reference models, on random traces.
//!
//! Each model is written the obvious way (a token count, a full event log) so that it shares
//! no code or formulation with the limiter it checks; decisions must be identical, and the
//! documented guarantees are checked on every trace.

use std::time::Duration;

use flowgate::limit::{
    Algorithm, FixedWindow, Keyed, KeyedError, Limiter, SlidingLog, SlidingWindow, TokenBucket,
};
use flowgate::{CostError, Decision, Quota, Rate};
use proptest::prelude::*;

#[path = "limit/backwards.rs"]
mod backwards;
#[path = "limit/carried.rs"]
mod carried;
#[path = "limit/end_of_time.rs"]
mod end_of_time;

/// A trace: strictly non-decreasing times (ns) with costs.
fn trace(max_gap: u64, max_cost: u32) -> impl Strategy<Value = Vec<(u64, u32)>> {
    prop::collection::vec((0..=max_gap, 1..=max_cost), 1..300).prop_map(|steps| {
        let mut t = 0;
        steps
            .into_iter()
            .map(|(gap, cost)| {
                t += gap;
                (t, cost)
            })
            .collect()
    })
}

fn rate() -> impl Strategy<Value = Rate> {
    // Periods that do and do not divide evenly by the count.
    (
        1u32..=20,
        prop_oneof![Just(1_000u64), Just(1_000_000_000), 1..5_000_000u64],
    )
        .prop_map(|(n, p)| Rate::per(n, Duration::from_nanos(p)).unwrap())
}

fn ns(t: u64) -> Duration {
    Duration::from_nanos(t)
}

/// A continuous token bucket: the level is kept in units of `1 / period` token.
struct ModelBucket {
    count: u128,
    period: u128,
    cap: u128,
    level: u128,
    last: u128,
}

impl ModelBucket {
    fn new(q: Quota) -> Self {
        let period = u128::from(q.rate().period_nanos());
        let cap = u128::from(q.burst_size()) * period;
        ModelBucket {
            count: u128::from(q.rate().count()),
            period,
            cap,
            level: cap,
            last: 0,
        }
    }

    fn check(&mut self, now: u64, cost: u32) -> (bool, u64, Duration, Duration) {
        let now = u128::from(now);
        self.level = (self.level + (now - self.last) * self.count).min(self.cap);
        self.last = now;
        let need = u128::from(cost) * self.period;
        let ceil_ns = |units: u128| Duration::from_nanos(units.div_ceil(self.count) as u64);
        if self.level >= need {
            self.level -= need;
            let remaining = (self.level / self.period) as u64;
            (
                true,
                remaining,
                Duration::ZERO,
                ceil_ns(self.cap - self.level),
            )
        } else {
            let remaining = (self.level / self.period) as u64;
            (
                false,
                remaining,
                ceil_ns(need - self.level),
                ceil_ns(self.cap - self.level),
            )
        }
    }
}

fn parts(d: &Decision) -> (bool, u64, Duration, Duration) {
    (d.allowed, d.remaining, d.retry_after, d.reset_after)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn token_bucket_matches_model_and_bound(
        r in rate(),
        burst in 1u32..=20,
        tr in trace(3_000_000, 20),
    ) {
        let q = Quota::new(r, burst).unwrap();
        let mut bucket = Limiter::new(TokenBucket::new(q));
        let mut model = ModelBucket::new(q);
        let mut admitted = Vec::new();
        for &(t, cost) in &tr {
            let got = bucket.check(ns(t), cost);
            if cost > burst {
                prop_assert_eq!(got, Err(CostError::ExceedsCapacity { cost, capacity: u64::from(burst) }));
                continue;
            }
            let got = got.unwrap();
            prop_assert_eq!(got.capacity, u64::from(burst));
            prop_assert_eq!(parts(&got), model.check(t, cost), "at t={} cost={}", t, cost);
            if got.allowed {
                admitted.push((t, cost));
            } else {
                // Retrying at retry_after is admitted (on a copy: nothing else in between).
                let mut probe = bucket.clone();
                prop_assert!(probe.check(ns(t) + got.retry_after, cost).unwrap().allowed);
                if got.retry_after > Duration::from_nanos(1) {
                    let mut early = bucket.clone();
                    prop_assert!(!early.check(ns(t) + got.retry_after - Duration::from_nanos(1), cost).unwrap().allowed);
                }
            }
        }
        // In any interval [t_i, t_j]: admitted cost <= burst + rate * (t_j - t_i).
        let (count, period) = (u128::from(r.count()), u128::from(r.period_nanos()));
        for i in 0..admitted.len() {
            let mut sum = 0u128;
            for j in i..admitted.len() {
                sum += u128::from(admitted[j].1);
                let w = u128::from(admitted[j].0 - admitted[i].0);
                prop_assert!(sum * period <= u128::from(burst) * period + count * w);
            }
        }
    }

    /// `check_nanos` (the token bucket's own, the default of the others) decides exactly as
    /// `check` with the same time as a `Duration`, on the fast path and the exact one (rates
    /// that do not divide a nanosecond) alike, and a cost above the burst is refused the same.
    #[test]
    fn check_nanos_decides_as_check(
        r in rate(),
        burst in 1u32..=20,
        tr in trace(3_000_000, 22),
    ) {
        let q = Quota::new(r, burst).unwrap();
        fn same<A: Algorithm + Clone>(a: A, tr: &[(u64, u32)]) -> Result<(), TestCaseError> {
            let (mut by_duration, mut by_nanos) = (Limiter::new(a.clone()), Limiter::new(a));
            for &(t, cost) in tr {
                prop_assert_eq!(
                    by_nanos.check_nanos(t, cost),
                    by_duration.check(ns(t), cost),
                    "at t={} cost={}", t, cost
                );
            }
            Ok(())
        }
        same(TokenBucket::new(q), &tr)?;
        same(FixedWindow::new(r), &tr)?;
        same(SlidingWindow::new(r), &tr)?;
        same(SlidingLog::new(r), &tr)?;
    }

    #[test]
    fn fixed_window_matches_model_and_bound(r in rate(), tr in trace(2_000_000, 20)) {
        let (limit, window) = (r.count(), r.period_nanos());
        let mut fw = Limiter::new(FixedWindow::new(r));
        let mut log: Vec<(u64, u32)> = Vec::new();
        for &(t, cost) in &tr {
            let got = fw.check(ns(t), cost);
            if cost > limit {
                prop_assert!(matches!(got, Err(CostError::ExceedsCapacity { .. })), "expected ExceedsCapacity");
                continue;
            }
            let got = got.unwrap();
            let start = t / window * window;
            let used: u32 = log.iter().filter(|e| e.0 >= start).map(|e| e.1).sum();
            let allowed = used + cost <= limit;
            let used_after = if allowed { used + cost } else { used };
            let reset = ns(start + window - t);
            let want = (allowed, u64::from(limit - used_after), if allowed { Duration::ZERO } else { reset }, reset);
            prop_assert_eq!(parts(&got), want);
            if allowed {
                log.push((t, cost));
            }
        }
        let mut per_window = std::collections::HashMap::new();
        for (t, c) in log {
            *per_window.entry(t / window).or_insert(0u32) += c;
        }
        prop_assert!(per_window.values().all(|&n| n <= limit));
    }

    #[test]
    fn sliding_log_matches_model_and_bound(r in rate(), tr in trace(2_000_000, 20)) {
        let (limit, window) = (r.count(), r.period_nanos());
        let mut sl = Limiter::new(SlidingLog::new(r));
        let mut log: Vec<(u64, u32)> = Vec::new();
        for &(t, cost) in &tr {
            let got = sl.check(ns(t), cost);
            if cost > limit {
                prop_assert!(matches!(got, Err(CostError::ExceedsCapacity { .. })), "expected ExceedsCapacity");
                continue;
            }
            let got = got.unwrap();
            let live: Vec<_> = log.iter().filter(|e| e.0 + window > t).copied().collect();
            let used: u32 = live.iter().map(|e| e.1).sum();
            let allowed = used + cost <= limit;
            let newest = if allowed { Some(t) } else { live.last().map(|e| e.0) };
            let reset = newest.map_or(Duration::ZERO, |n| ns(n + window - t));
            let retry = if allowed {
                Duration::ZERO
            } else {
                // The earliest expiry time after which used + cost fits.
                let mut freed = 0;
                let mut at = 0;
                for e in &live {
                    freed += e.1;
                    at = e.0 + window - t;
                    if used - freed + cost <= limit {
                        break;
                    }
                }
                ns(at)
            };
            let used_after = if allowed { used + cost } else { used };
            prop_assert_eq!(parts(&got), (allowed, u64::from(limit - used_after), retry, reset));
            prop_assert!(sl.state().entries() <= limit as usize);
            if allowed {
                log.push((t, cost));
            }
        }
        for &(t, _) in &log {
            let in_window: u32 = log.iter().filter(|e| e.0 <= t && e.0 + window > t).map(|e| e.1).sum();
            prop_assert!(in_window <= limit);
        }
    }

    #[test]
    fn sliding_window_matches_model_and_bound(r in rate(), tr in trace(2_000_000, 20)) {
        let (limit, window) = (u128::from(r.count()), u128::from(r.period_nanos()));
        let mut sw = Limiter::new(SlidingWindow::new(r));
        let mut log: Vec<(u64, u32)> = Vec::new();
        let in_window = |log: &[(u64, u32)], k: u128| -> u128 {
            log.iter().filter(|e| u128::from(e.0) / window == k).map(|e| u128::from(e.1)).sum()
        };
        for &(t, cost) in &tr {
            let got = sw.check(ns(t), cost);
            if u128::from(cost) > limit {
                prop_assert!(matches!(got, Err(CostError::ExceedsCapacity { .. })), "expected ExceedsCapacity");
                continue;
            }
            let got = got.unwrap();
            let k = u128::from(t) / window;
            let e = u128::from(t) % window;
            let prev = if k == 0 { 0 } else { in_window(&log, k - 1) };
            let cur = in_window(&log, k);
            let allowed = prev * (window - e) + (cur + u128::from(cost)) * window <= limit * window;
            prop_assert_eq!(got.allowed, allowed, "t={} cost={}", t, cost);
            if allowed {
                log.push((t, cost));
            } else {
                // Retrying at retry_after is admitted, one nanosecond earlier is not.
                let mut probe = sw.clone();
                prop_assert!(probe.check(ns(t) + got.retry_after, cost).unwrap().allowed);
                let mut early = sw.clone();
                prop_assert!(!early.check(ns(t) + got.retry_after - Duration::from_nanos(1), cost).unwrap().allowed);
            }
        }
        // Bounds: <= limit per aligned window; in any (t - window, t]: <= limit + prev * e / window.
        for &(t, _) in &log {
            let k = u128::from(t) / window;
            prop_assert!(in_window(&log, k) <= limit);
            let e = u128::from(t) % window;
            let prev = if k == 0 { 0 } else { in_window(&log, k - 1) };
            let n: u128 = log
                .iter()
                .filter(|x| x.0 <= t && u128::from(x.0) + window > u128::from(t))
                .map(|x| u128::from(x.1))
                .sum();
            prop_assert!(n * window <= limit * window + prev * e, "n={} at t={}", n, t);
        }
    }

    #[test]
    fn keyed_decides_like_one_limiter_per_key(
        tr in prop::collection::vec((0u64..2_000_000, 0u8..6, 1u32..=3), 1..300),
        max_keys in 1usize..=6,
    ) {
        let q = Quota::per(3, Duration::from_millis(1)).unwrap();
        let mut keyed = Keyed::new(TokenBucket::new(q), max_keys).unwrap();
        let mut reference: std::collections::HashMap<u8, Limiter<TokenBucket>> = Default::default();
        let mut t = 0;
        for (gap, key, cost) in tr {
            t += gap;
            let got = keyed.check(&key, ns(t), cost);
            prop_assert!(keyed.len() <= max_keys);
            match got {
                Err(KeyedError::KeyspaceFull { max_keys: m }) => {
                    prop_assert_eq!(m, max_keys);
                    // Refused only when every held key is busy.
                    prop_assert_eq!(keyed.len(), max_keys);
                    prop_assert!(keyed.get(&key).is_none());
                }
                got => {
                    let want = reference
                        .entry(key)
                        .or_insert_with(|| Limiter::new(TokenBucket::new(q)))
                        .check(ns(t), cost)
                        .map_err(KeyedError::Cost);
                    prop_assert_eq!(got, want);
                }
            }
        }
    }
}

/// Decides `trace` (time, key, cost, whether a sweep runs first) on a `Keyed` of
/// `max_keys` and on one limiter per key that is never forgotten: the same decisions,
/// except `KeyspaceFull`, which comes only when every held key is busy.
fn keyed_as_one_limiter_per_key<A: Algorithm + Clone>(
    algorithm: A,
    trace: &[(u64, u8, u32, bool)],
    max_keys: usize,
) -> Result<(), TestCaseError> {
    let mut keyed = Keyed::new(algorithm.clone(), max_keys).unwrap();
    let mut reference: std::collections::HashMap<u8, Limiter<A>> = Default::default();
    for &(t, key, cost, sweep) in trace {
        if sweep {
            keyed.sweep(ns(t));
            // A sweep leaves no key neutral.
            for (k, limiter) in &reference {
                prop_assert!(
                    keyed.get(k).is_none() || !limiter.is_neutral(ns(t)),
                    "key {} neutral at {} but kept by a sweep",
                    k,
                    t
                );
            }
        }
        let got = keyed.check(&key, ns(t), cost);
        prop_assert!(keyed.len() <= max_keys);
        if let Err(KeyedError::KeyspaceFull { .. }) = got {
            prop_assert_eq!(keyed.len(), max_keys);
            for (k, limiter) in &reference {
                let held = keyed.get(k).is_some();
                prop_assert!(
                    !held || !limiter.is_neutral(ns(t)),
                    "key {} idle but held",
                    k
                );
            }
            continue;
        }
        let want = reference
            .entry(key)
            .or_insert_with(|| Limiter::new(algorithm.clone()))
            .check(ns(t), cost)
            .map_err(KeyedError::Cost);
        prop_assert_eq!(got, want, "key {} at {}", key, t);
    }
    Ok(())
}

/// [`keyed_as_one_limiter_per_key`] under each algorithm at rate `r` (a token bucket of
/// `burst`), over `steps` of (time since the last, key, cost, whether a sweep runs first).
fn keyed_under_every_algorithm(
    r: Rate,
    burst: u32,
    steps: Vec<(u64, u8, u32, bool)>,
    max_keys: usize,
) -> Result<(), TestCaseError> {
    let mut t = 0;
    let trace: Vec<_> = steps
        .into_iter()
        .map(|(gap, key, cost, sweep)| {
            t += gap;
            (t, key, cost, sweep)
        })
        .collect();
    keyed_as_one_limiter_per_key(
        TokenBucket::new(Quota::new(r, burst).unwrap()),
        &trace,
        max_keys,
    )?;
    keyed_as_one_limiter_per_key(FixedWindow::new(r), &trace, max_keys)?;
    keyed_as_one_limiter_per_key(SlidingWindow::new(r), &trace, max_keys)?;
    keyed_as_one_limiter_per_key(SlidingLog::new(r), &trace, max_keys)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Every algorithm under `Keyed`, with sweeps now and then: evicting only neutral keys
    /// changes no decision (a busy key is never given a fresh limit).
    #[test]
    fn keyed_decides_like_one_limiter_per_key_under_every_algorithm(
        r in rate(),
        burst in 1u32..=20,
        steps in prop::collection::vec((0u64..3_000_000, 0u8..6, 1u32..=4, any::<bool>()), 1..300),
        max_keys in 1usize..=6,
    ) {
        keyed_under_every_algorithm(r, burst, steps, max_keys)?;
    }

    /// The same over maps of up to 40 keys: a sweep that scans notes the eighth of the keys
    /// going neutral soonest, and new keys at a full map evict those one at a time.
    #[test]
    fn keyed_decides_like_one_limiter_per_key_over_larger_maps(
        r in rate(),
        burst in 1u32..=20,
        steps in prop::collection::vec(
            (0u64..400_000, 0u8..48, 1u32..=4, prop::bool::weighted(0.1)),
            1..400,
        ),
        max_keys in 8usize..=40,
    ) {
        keyed_under_every_algorithm(r, burst, steps, max_keys)?;
    }
}

fn rejects_bad_costs<A: Algorithm>(algorithm: A) {
    let mut l = Limiter::new(algorithm);
    {
        let cap = l.capacity();
        assert_eq!(l.check(Duration::ZERO, 0), Err(CostError::Zero));
        let too_much = cap as u32 + 1;
        let err = l.check(Duration::ZERO, too_much).unwrap_err();
        assert_eq!(
            err,
            CostError::ExceedsCapacity {
                cost: too_much,
                capacity: cap
            }
        );
        assert_eq!(
            err.to_string(),
            format!("cost {too_much} exceeds the capacity {cap}: it could never be admitted")
        );
        // Errors consume nothing: the full capacity is still there.
        assert!(l.check(Duration::ZERO, cap as u32).unwrap().allowed);
        assert!(l.is_neutral(Duration::from_secs(3)));
    }
}

#[test]
fn every_limiter_rejects_zero_cost_and_cost_above_capacity() {
    let r = Rate::per_second(5).unwrap();
    rejects_bad_costs(TokenBucket::new(Quota::new(r, 3).unwrap()));
    rejects_bad_costs(FixedWindow::new(r));
    rejects_bad_costs(SlidingLog::new(r));
    rejects_bad_costs(SlidingWindow::new(r));
}

#[test]
fn keyed_rejects_zero_keys_and_reports_a_full_keyspace() {
    let bucket = TokenBucket::new(Quota::per_second(1).unwrap());
    let err = Keyed::<u32, _>::new(bucket.clone(), 0).unwrap_err();
    assert_eq!(err.field(), "keyed.max_keys");
    let mut keyed = Keyed::new(bucket, 1).unwrap();
    keyed.check(&1u32, Duration::ZERO, 1).unwrap();
    let full = keyed.check(&2u32, Duration::ZERO, 1).unwrap_err();
    assert_eq!(full, KeyedError::KeyspaceFull { max_keys: 1 });
    assert_eq!(
        full.to_string(),
        "all 1 keys are in use and none is idle yet: new keys are refused"
    );
    // Bad cost for a new key is reported as such and inserts nothing.
    assert_eq!(
        keyed.check(&3u32, Duration::from_secs(5), 0),
        Err(KeyedError::Cost(CostError::Zero))
    );
    // So is one for a key held: the cost error, wrapped, with the same words.
    let too_much = keyed.check(&1u32, Duration::ZERO, 2).unwrap_err();
    assert_eq!(
        too_much,
        KeyedError::Cost(CostError::ExceedsCapacity {
            cost: 2,
            capacity: 1
        })
    );
    assert_eq!(
        too_much.to_string(),
        "cost 2 exceeds the capacity 1: it could never be admitted"
    );
    assert!(std::error::Error::source(&too_much).is_some());
    assert_eq!(keyed.len(), 1);
    assert_eq!(keyed.sweep(Duration::from_secs(5)), 1);
    assert!(keyed.is_empty());
}

/// A key evicted by a sweep at `t` was back to neutral then, not before: a request on it
/// that comes with an earlier `now` (a thread that read the clock before another one swept,
/// as `MemoryGate`'s threads do before taking the shard's lock) is decided as of the sweep,
/// as the key's own state would have decided it (time going backwards is no time passing),
/// not on a fresh state at the earlier time, which would hand out its burst again.
#[test]
fn a_key_evicted_by_a_sweep_is_not_decided_before_the_sweep() {
    // Burst 2, one token a second: by t = 2 s at most 2 + 2 = 4 tokens may pass.
    let q = Quota::per_second(1).unwrap().burst(2).unwrap();
    let mut keyed = Keyed::new(TokenBucket::new(q), 4).unwrap();
    let at = Duration::from_secs;
    assert!(keyed.check("a", at(0), 2).unwrap().allowed);
    assert_eq!(keyed.sweep(at(2)), 1, "full again at 2 s: evicted");
    // A thread that read 1 s before the sweep: decided as of the sweep, its reset counted
    // from its own time (full again at 4 s).
    let d = keyed.check("a", at(1), 2).unwrap();
    assert!(d.allowed);
    assert_eq!(d.reset_after, at(3));
    let d = keyed.check("a", at(2), 1).unwrap();
    assert!(
        !d.allowed,
        "a fifth token by 2 s: the evicted key was decided afresh at 1 s, with its burst"
    );
}

/// At `now == Duration::MAX` (the end of the time any `Duration` says, which the docs
/// take) a busy state's `neutral_at` is past it and saturates to `Duration::MAX`, which
/// read as "neutral now": `Keyed` forgot every new key right after admitting it, and a
/// sweep there evicted every busy key, so each request at that time got a fresh burst,
/// where one limiter per key refuses the second.
#[test]
fn keyed_keeps_busy_keys_at_the_end_of_time() {
    fn keeps<A: Algorithm + Clone + std::fmt::Debug>(algorithm: A) {
        let end = Duration::MAX;
        let cap = algorithm.capacity() as u32;
        let mut one = Limiter::new(algorithm.clone());
        assert!(one.check(end, cap).unwrap().allowed);
        assert!(!one.check(end, 1).unwrap().allowed, "one limiter refuses");
        assert!(!one.is_neutral(end), "{algorithm:?}: busy, not neutral");
        let mut keyed = Keyed::new(algorithm.clone(), 2).unwrap();
        assert!(keyed.check("a", end, cap).unwrap().allowed);
        assert!(
            keyed.get("a").is_some(),
            "{algorithm:?}: the busy key is kept"
        );
        assert_eq!(
            keyed.sweep(end),
            0,
            "{algorithm:?}: nothing neutral to evict"
        );
        let d = keyed.check("a", end, 1).unwrap();
        assert!(
            !d.allowed,
            "{algorithm:?}: a second burst at the same time: {d:?}"
        );
    }
    let rate = Rate::per_second(3).unwrap();
    keeps(TokenBucket::new(Quota::from(rate)));
    keeps(FixedWindow::new(rate));
    keeps(SlidingWindow::new(rate));
    keeps(SlidingLog::new(rate));
}

#[test]
fn time_going_backwards_is_conservative() {
    let q = Quota::per_second(1).unwrap();
    let mut b = Limiter::new(TokenBucket::new(q));
    assert!(b.check(Duration::from_secs(10), 1).unwrap().allowed);
    let d = b.check(Duration::from_secs(5), 1).unwrap();
    assert!(!d.allowed);
    assert_eq!(d.remaining, 0);
    let mut log = Limiter::new(SlidingLog::new(Rate::per_second(1).unwrap()));
    assert!(log.check(Duration::from_secs(10), 1).unwrap().allowed);
    assert!(!log.check(Duration::from_secs(5), 1).unwrap().allowed);
}

#[test]
fn token_bucket_is_exact_for_rates_that_do_not_divide_a_second() {
    // 3 per second, burst 3, polled every millisecond for 1 000 s: the burst plus
    // floor(3 * 999.999) = 2 999 refills, with no drift from the 333.3… ms interval.
    let mut b = Limiter::new(TokenBucket::new(Quota::per_second(3).unwrap()));
    let mut admitted = 0;
    for ms in 0..1_000_000u64 {
        if b.check(Duration::from_millis(ms), 1).unwrap().allowed {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 3 + 2_999);
}

/// A daily byte budget of 3e9, checked with costs in bytes: 2e9 + 2.5e9 passes `u32::MAX`.
fn over_two_to_the_31<A: Algorithm>(algorithm: A) {
    let mut limiter = Limiter::new(algorithm);
    let t = Duration::from_secs(1);
    assert!(limiter.check(t, 2_000_000_000).unwrap().allowed);
    let d = limiter.check(t, 2_500_000_000).unwrap();
    assert!(!d.allowed, "admitted over the limit: {d:?}");
    assert_eq!(d.remaining, 1_000_000_000);
    assert!(
        limiter.check(t, 1_000_000_000).unwrap().allowed,
        "exactly the rest fits"
    );
}

#[test]
fn limits_above_two_to_the_31_never_overflow_into_an_admission() {
    let rate = Rate::per(3_000_000_000, Duration::from_secs(86_400)).unwrap();
    over_two_to_the_31(FixedWindow::new(rate));
    over_two_to_the_31(SlidingLog::new(rate));
    over_two_to_the_31(SlidingWindow::new(rate));
    over_two_to_the_31(TokenBucket::new(Quota::from(rate)));
}

#[test]
fn a_fail_open_decision_writes_a_valid_ratelimit_member() {
    // u64::MAX is not an sf-Integer: the member carries the largest one instead.
    let d = flowgate::Decision::fail_open();
    assert_eq!(d.ratelimit_header("p"), "\"p\";r=999999999999999;t=0");
}

#[test]
fn sliding_window_retry_after_is_exact_for_the_longest_window() {
    // A window of u64::MAX ns (the longest `Rate::per` accepts): the wait that ends at an
    // offset into the next window is longer than u64::MAX ns; it is counted in 128 bits
    // (it saturated there, a wait too short), and the cost passes once it is over.
    let rate = Rate::per(2, Duration::from_nanos(u64::MAX)).unwrap();
    let mut w = Limiter::new(SlidingWindow::new(rate));
    assert!(w.check(Duration::ZERO, 2).unwrap().allowed);
    let d = w.check(Duration::from_nanos(1), 1).unwrap();
    assert!(!d.allowed);
    // To the end of the window, then half of the next one (the two counted decay to one).
    let window = u128::from(u64::MAX);
    assert_eq!(d.retry_after.as_nanos(), window - 1 + window.div_ceil(2));
    let at = Duration::from_nanos(1) + d.retry_after;
    assert!(!w.check(at - Duration::from_nanos(1), 1).unwrap().allowed);
    assert!(w.check(at, 1).unwrap().allowed);
}

/// A rejected check leaves the state unchanged (the `Algorithm` contract). The sliding
/// window rolled its counters into the next window before deciding, also when it then
/// rejected: a clock that stepped back was then decided in the new window instead of the
/// one counted (where the Redis script, which writes nothing on a rejection, decides it).
#[test]
fn a_rejected_sliding_window_check_leaves_the_state_unchanged() {
    let mut w = Limiter::new(SlidingWindow::new(Rate::per_second(2).unwrap()));
    let ms = Duration::from_millis;
    assert!(w.check(ms(500), 1).unwrap().allowed);
    let before = *w.state();
    // The start of the next window: the estimate is still 1, so 2 more do not fit.
    assert!(!w.check(ms(1_000), 2).unwrap().allowed);
    assert_eq!(w.state(), &before);
    // The clock steps back into the counted window, which ends 1 ms later.
    let d = w.check(ms(999), 1).unwrap();
    assert!(d.allowed);
    assert_eq!(d.reset_after, ms(1_001));
}

/// After the clock steps back, a window limiter decides at the time it had reached (no time
/// has passed), but its waits are counted from the `now` it was given: checking again at
/// `now + retry_after` is admitted, and the state is neutral at `now + reset_after`. The
/// windows counted them from the later time, so a caller came back too early (by the
/// step), to another rejection. The token bucket already counted from `now`.
#[test]
fn waits_after_the_clock_steps_back_count_from_the_earlier_now() {
    fn waits<A: Algorithm + Clone>(algorithm: A) {
        let ms = Duration::from_millis;
        let mut limiter = Limiter::new(algorithm);
        assert!(limiter.check(ms(10_500), 2).unwrap().allowed);
        let back = ms(9_500);
        let d = limiter.check(back, 1).unwrap();
        assert!(!d.allowed);
        let name = std::any::type_name::<A>();
        assert!(
            limiter
                .clone()
                .check(back + d.retry_after, 1)
                .unwrap()
                .allowed,
            "{name}: rejected again after retry_after {:?}",
            d.retry_after
        );
        assert!(
            limiter.is_neutral(back + d.reset_after),
            "{name}: not neutral after reset_after {:?}",
            d.reset_after
        );
    }
    let r = Rate::per_second(2).unwrap();
    waits(TokenBucket::new(Quota::from(r)));
    waits(FixedWindow::new(r));
    waits(SlidingLog::new(r));
    waits(SlidingWindow::new(r));
}

/// A rejected sliding log check leaves the state unchanged (the `Algorithm` contract): it
/// removed the entries expired at its `now` while the log's clock stayed at its newest
/// entry, so after a clock that stepped back, a request was decided without entries that
/// were still live then, and a third request passed a limit of two within one window.
#[test]
fn a_rejected_sliding_log_check_leaves_the_state_unchanged() {
    let mut log = Limiter::new(SlidingLog::new(Rate::per_second(2).unwrap()));
    let ms = Duration::from_millis;
    assert!(log.check(ms(0), 1).unwrap().allowed);
    assert!(log.check(ms(500), 1).unwrap().allowed);
    let before = log.state().clone();
    // At 1.2 s the entry from 0 has expired: one is live, two more do not fit.
    assert!(!log.check(ms(1_200), 2).unwrap().allowed);
    assert_eq!(log.state(), &before);
    // The clock steps back: decided at the newest entry's time (500 ms), where both count.
    let d = log.check(ms(100), 1).unwrap();
    assert!(!d.allowed, "a third admitted within one window: {d:?}");
    // Its wait counts from the `now` given: the entry from 0 expires at 1 s.
    assert_eq!(d.retry_after, ms(900));
    assert!(log.clone().check(ms(1_000), 1).unwrap().allowed);
}

/// Rates, bursts, costs and times at the edges of their types: 1 per 10 years to
/// `u32::MAX` per ns, bursts and costs up to `u32::MAX`, times up to 2^60 ns that now and
/// then step back.
fn extreme() -> impl Strategy<Value = (Rate, u32, Vec<(u64, u32)>)> {
    const TEN_YEARS_NS: u64 = 315_360_000_000_000_000;
    let count = prop_oneof![1u32..=20, Just(1_000_000), Just(u32::MAX), 1..=u32::MAX];
    let period = prop_oneof![
        Just(1u64),
        Just(1_000),
        Just(1_000_000_000),
        Just(TEN_YEARS_NS),
        1..=TEN_YEARS_NS
    ];
    let burst = prop_oneof![1u32..=20, Just(u32::MAX), 1..=u32::MAX];
    let start = prop_oneof![Just(0u64), Just(1 << 60), 0..=1u64 << 60];
    let gap = prop_oneof![0..=3_000_000u64, 0..=1u64 << 50];
    let back = prop_oneof![4 => Just(0u64), 1 => 0..=1u64 << 40];
    let cost = prop_oneof![1..=20u32, 1..=u32::MAX, Just(u32::MAX)];
    let steps = prop::collection::vec((gap, back, cost), 1..100);
    (count, period, burst, start, steps).prop_map(|(count, period, burst, start, steps)| {
        let rate = Rate::per(count, Duration::from_nanos(period)).unwrap();
        let mut t = start;
        let trace = steps
            .into_iter()
            .map(|(gap, back, cost)| {
                t = t.saturating_add(gap);
                (t.saturating_sub(back), cost)
            })
            .collect();
        (rate, burst, trace)
    })
}

/// The `Algorithm` contract and `Decision`'s waits at the edges, where the token bucket
/// leaves its 64-bit fast path for 128-bit units: a rejection leaves the state unchanged,
/// the same request at `now + retry_after` is admitted, and the state is neutral exactly
/// at `now + reset_after` (both checked where they fit in `u64` nanoseconds, beyond which
/// the waits saturate).
fn keeps_the_contract<A: Algorithm + Clone>(
    algorithm: A,
    trace: &[(u64, u32)],
) -> Result<(), TestCaseError>
where
    A::State: PartialEq,
{
    let mut limiter = Limiter::new(algorithm);
    let fits = |t: u64, d: Duration| u128::from(t) + d.as_nanos() < u128::from(u64::MAX);
    for &(t, cost) in trace {
        let before = limiter.state().clone();
        let Ok(d) = limiter.check(ns(t), cost) else {
            prop_assert!(u64::from(cost) > limiter.capacity());
            prop_assert!(*limiter.state() == before);
            continue;
        };
        if !d.allowed {
            prop_assert!(
                *limiter.state() == before,
                "a rejection at {} changed the state",
                t
            );
            if fits(t, d.retry_after) {
                let mut probe = limiter.clone();
                prop_assert!(
                    probe.check(ns(t) + d.retry_after, cost).unwrap().allowed,
                    "rejected again at {} + {:?}",
                    t,
                    d.retry_after
                );
            }
        }
        if fits(t, d.reset_after) {
            prop_assert_eq!(
                limiter.neutral_at(),
                ns(t) + d.reset_after,
                "at {} cost {}: {:?}",
                t,
                cost,
                d
            );
        }
    }
    Ok(())
}

proptest! {
    #[test]
    fn every_algorithm_keeps_its_contract_at_extreme_rates((r, burst, tr) in extreme()) {
        keeps_the_contract(TokenBucket::new(Quota::new(r, burst).unwrap()), &tr)?;
        keeps_the_contract(FixedWindow::new(r), &tr)?;
        keeps_the_contract(SlidingWindow::new(r), &tr)?;
        keeps_the_contract(SlidingLog::new(r), &tr)?;
    }
}

/// The states hold any `Duration` (up to 2^94 ns) and stay small: a key of a fixed window
/// or a token bucket costs 16 bytes, of a sliding window 24.
#[test]
fn states_hold_any_time_and_stay_small() {
    use flowgate::limit::{FixedWindowState, SlidingWindowState, TokenBucketState};
    use std::mem::size_of;
    assert_eq!(size_of::<TokenBucketState>(), 16);
    assert_eq!(size_of::<FixedWindowState>(), 16);
    assert_eq!(size_of::<SlidingWindowState>(), 24);
}
