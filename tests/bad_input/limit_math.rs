//! Rate, Quota and the limiter algorithms at the extremes of count, period, burst, cost
//! and time (backwards, and past the end of the u64-nanosecond timeline).

use super::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn rate_and_quota_refuse_only_zero_and_too_long(
        count in any_u32(),
        period in any_duration(),
        burst in any_u32(),
    ) {
        let fits = period.as_nanos() <= u128::from(u64::MAX);
        match Rate::per(count, period) {
            Ok(r) => {
                prop_assert!(count > 0 && !period.is_zero() && fits);
                prop_assert_eq!(r.count(), count);
                prop_assert_eq!(r.period(), period);
                prop_assert!(r.interval() <= period);
                let per_second = r.per_second_f64();
                prop_assert!(per_second.is_finite() && per_second > 0.0);
                let _ = (r.to_string(), format!("{r:?}"));
                match Quota::new(r, burst) {
                    Ok(q) => {
                        prop_assert!(burst > 0);
                        prop_assert_eq!(q.burst_size(), burst);
                        let _ = (q.to_string(), format!("{q:?}"));
                    }
                    Err(e) => {
                        prop_assert_eq!(burst, 0);
                        prop_assert_eq!(e.field(), "quota.burst");
                        sane_config_error(&e);
                    }
                }
            }
            Err(e) => {
                sane_config_error(&e);
                match e.field() {
                    "rate.count" => prop_assert_eq!(count, 0),
                    "rate.period" => prop_assert!(period.is_zero() || !fits),
                    other => panic!("undocumented field {other}"),
                }
            }
        }
        for make in [Rate::per_second, Rate::per_minute, Rate::per_hour] {
            prop_assert_eq!(make(count).is_ok(), count > 0);
        }
        for make in [Quota::per_second, Quota::per_minute, Quota::per_hour] {
            prop_assert_eq!(make(count).is_ok(), count > 0);
        }
        prop_assert_eq!(Quota::per(count, period).is_ok(), Rate::per(count, period).is_ok());
    }
}

/// One step of a trace: a time and a cost.
fn steps() -> impl Strategy<Value = Vec<(Duration, u32)>> {
    prop::collection::vec((any_duration(), any_u32()), 1..40)
}

/// Check `algorithm` on `steps` (times in any order): cost errors exactly as documented,
/// decisions within the capacity, a rejection unchanged state, and a rejected cost admitted
/// again at `now + retry_after` on the state it was rejected on.
fn check_algorithm<A: Algorithm>(algorithm: &A, steps: &[(Duration, u32)]) {
    let capacity = algorithm.capacity();
    let mut state = A::State::default();
    for &(now, cost) in steps {
        let before = state.clone();
        let decided = algorithm.check(&mut state, now, cost);
        // Same answer from the nanosecond entry point, on the state before (where `now`
        // fits its `u64` nanoseconds: the first 584 years).
        if let Ok(now_ns) = u64::try_from(now.as_nanos()) {
            let mut again = before.clone();
            assert_eq!(
                algorithm.check_nanos(&mut again, now_ns, cost),
                decided,
                "check_nanos differs at {now:?}, cost {cost}"
            );
        }
        let d = match decided {
            Err(CostError::Zero) => {
                assert_eq!(cost, 0);
                continue;
            }
            Err(CostError::ExceedsCapacity {
                cost: c,
                capacity: k,
            }) => {
                assert_eq!((c, k), (cost, capacity));
                assert!(u64::from(cost) > capacity);
                continue;
            }
            Err(e) => panic!("undocumented cost error {e:?}"),
            Ok(d) => d,
        };
        assert!(cost > 0 && u64::from(cost) <= capacity);
        assert_eq!(d.capacity, capacity);
        assert!(d.remaining <= capacity, "{d:?}");
        if d.allowed {
            assert!(d.retry_after.is_zero());
        } else {
            assert!(
                !d.retry_after.is_zero(),
                "rejected with no wait: {d:?} at {now:?}"
            );
            // Only if `now + retry_after` is a `Duration`, and the wait did not saturate
            // there (a token bucket's burst of `u32::MAX` at one per `u64::MAX` ns takes
            // longer).
            if let Some(at) = now.checked_add(d.retry_after)
                && d.retry_after < Duration::MAX
            {
                let mut retried = before.clone();
                let d2 = algorithm.check(&mut retried, at, cost).unwrap();
                assert!(
                    d2.allowed,
                    "rejected at {now:?} with retry_after {:?}, rejected again at {at:?}: {d2:?}",
                    d.retry_after
                );
            }
        }
        let _ = algorithm.neutral_at(&state);
        let _ = algorithm.is_neutral(&state, now);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn token_bucket_at_the_extremes(quota in any_quota(), steps in steps()) {
        let bucket = TokenBucket::new(quota);
        check_algorithm(&bucket, &steps);
        let full = bucket.state_full_at(Duration::MAX);
        let _ = bucket.available(&full, Duration::MAX);
        let _ = bucket.available(&full, Duration::ZERO);
        let _ = bucket.neutral_at(&full);
    }

    #[test]
    fn fixed_window_at_the_extremes(rate in any_rate(), steps in steps()) {
        check_algorithm(&FixedWindow::new(rate), &steps);
    }

    #[test]
    fn sliding_log_at_the_extremes(rate in any_rate(), steps in steps()) {
        check_algorithm(&SlidingLog::new(rate), &steps);
    }

    #[test]
    fn sliding_window_at_the_extremes(rate in any_rate(), steps in steps()) {
        check_algorithm(&SlidingWindow::new(rate), &steps);
    }

    #[test]
    fn keyed_takes_any_bound_and_any_key(
        quota in any_quota(),
        max_keys in any_usize(),
        calls in prop::collection::vec((any_key(), any_duration(), any_u32()), 1..30),
    ) {
        let keyed = Keyed::<String, _>::new(TokenBucket::new(quota), max_keys);
        let mut keyed = match keyed {
            Ok(k) => k,
            Err(e) => {
                prop_assert_eq!(max_keys, 0);
                prop_assert_eq!(e.field(), "keyed.max_keys");
                return Ok(());
            }
        };
        for (key, now, cost) in &calls {
            match keyed.check(key.as_str(), *now, *cost) {
                Ok(d) => prop_assert!(d.remaining <= d.capacity),
                Err(KeyedError::Cost(_)) => {
                    prop_assert!(*cost == 0 || u64::from(*cost) > u64::from(quota.burst_size()))
                }
                Err(KeyedError::KeyspaceFull { max_keys: m }) => {
                    prop_assert_eq!(m, max_keys);
                    prop_assert!(keyed.len() >= max_keys);
                }
                Err(e) => panic!("undocumented error {e:?}"),
            }
            prop_assert!(keyed.len() <= max_keys);
        }
        // At the end of time a sweep keeps only the keys that never turn neutral (busy
        // past `Duration::MAX`: forgotten, they would get a fresh burst at that time).
        keyed.sweep(Duration::MAX);
        let mut kept = 0;
        for key in calls.iter().map(|(k, _, _)| k.as_str()).collect::<std::collections::HashSet<_>>() {
            if let Some(state) = keyed.get(key) {
                kept += 1;
                prop_assert_eq!(keyed.algorithm().neutral_at(state), Duration::MAX);
            }
        }
        prop_assert_eq!(keyed.len(), kept, "a sweep at the end of time keeps only busy keys");
    }
}

/// Every algorithm on a grid of extremes: rates of 1, 2 and `u32::MAX` per 1 ns, 2 ns and
/// `u64::MAX` ns; bursts of 1, 2 and `u32::MAX`; every pair of times among 0, 1 ns, the
/// last nanoseconds of the timeline and past it; costs of 1, 2 and `u32::MAX`.
#[test]
fn every_algorithm_on_a_grid_of_extremes() {
    let times = [
        Duration::ZERO,
        Duration::from_nanos(1),
        Duration::from_nanos(u64::MAX - 1),
        Duration::from_nanos(u64::MAX),
        Duration::MAX,
    ];
    let costs = [1, 2, u32::MAX];
    let mut traces = Vec::new();
    for &t1 in &times {
        for &t2 in &times {
            for &c1 in &costs {
                for &c2 in &costs {
                    traces.push([(t1, c1), (t2, c2), (t2, c2)]);
                }
            }
        }
    }
    for count in [1, 2, u32::MAX] {
        for period in [1, 2, u64::MAX] {
            let rate = Rate::per(count, Duration::from_nanos(period)).unwrap();
            for trace in &traces {
                check_algorithm(&FixedWindow::new(rate), trace);
                check_algorithm(&SlidingLog::new(rate), trace);
                check_algorithm(&SlidingWindow::new(rate), trace);
                for burst in [1, 2, u32::MAX] {
                    let quota = Quota::new(rate, burst).unwrap();
                    check_algorithm(&TokenBucket::new(quota), trace);
                }
            }
        }
    }
}

/// A fixed window whose end is past the timeline (`now` saturates at `u64::MAX` ns) still
/// answers a rejection with a wait: a caller that sleeps `retry_after` and asks again does
/// not spin.
#[test]
fn a_fixed_window_at_the_end_of_the_timeline_rejects_with_a_wait() {
    let window = FixedWindow::new(Rate::per(1, Duration::from_nanos(10)).unwrap());
    let mut state = Default::default();
    let end = Duration::from_nanos(u64::MAX);
    assert!(window.check(&mut state, end, 1).unwrap().allowed);
    let d = window.check(&mut state, end, 1).unwrap();
    assert!(!d.allowed);
    // The window holding u64::MAX starts at u64::MAX - 5 (a multiple of 10) and ends
    // 5 ns past it.
    assert_eq!(d.retry_after, Duration::from_nanos(5));
    assert_eq!(d.reset_after, Duration::from_nanos(5));
}

/// Six centuries: past the end of the u64-nanosecond timeline (584 years), a `now` that a
/// `Duration` holds and tokio's paused clock reaches.
const SIX_CENTURIES: Duration = Duration::from_secs(600 * 365 * 24 * 60 * 60);

/// Every algorithm keeps deciding past 584 years: at 1/s it admits one, refuses the next
/// with a wait, and admits again once that wait has passed (three rounds), and a state that
/// holds units is not neutral yet.
#[test]
fn every_algorithm_keeps_deciding_past_584_years() {
    let rate = Rate::per_second(1).unwrap();
    keeps_deciding_past_584_years(&TokenBucket::new(Quota::from(rate)));
    keeps_deciding_past_584_years(&FixedWindow::new(rate));
    keeps_deciding_past_584_years(&SlidingLog::new(rate));
    keeps_deciding_past_584_years(&SlidingWindow::new(rate));
}

fn keeps_deciding_past_584_years<A: Algorithm + std::fmt::Debug>(algorithm: &A) {
    let mut state = A::State::default();
    let mut now = SIX_CENTURIES;
    for round in 0..3 {
        let d = algorithm.check(&mut state, now, 1).unwrap();
        assert!(
            d.allowed,
            "{algorithm:?}, round {round}: refused at {now:?}: {d:?}"
        );
        assert!(
            algorithm.neutral_at(&state) > now,
            "{algorithm:?}: neutral at {:?} while it holds a unit at {now:?}",
            algorithm.neutral_at(&state)
        );
        let d = algorithm.check(&mut state, now, 1).unwrap();
        assert!(
            !d.allowed && !d.retry_after.is_zero(),
            "{algorithm:?}: {d:?}"
        );
        now += d.retry_after;
    }
}

/// A key that holds units past 584 years is not swept: evicting it would reset its limit.
#[test]
fn keyed_keeps_a_busy_key_past_584_years() {
    let mut keyed =
        Keyed::<String, _>::new(TokenBucket::new(Quota::per_second(1).unwrap()), 1).unwrap();
    let now = SIX_CENTURIES;
    assert!(keyed.check("a", now, 1).unwrap().allowed);
    assert_eq!(keyed.sweep(now), 0, "a busy key was evicted");
    assert_eq!(
        keyed.check("b", now, 1),
        Err(KeyedError::KeyspaceFull { max_keys: 1 })
    );
    assert!(!keyed.check("a", now, 1).unwrap().allowed);
}
