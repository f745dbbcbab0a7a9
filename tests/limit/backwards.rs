//! The limiters on traces whose time steps back, stands still and jumps, with costs of 0
//! and above the capacity: the exact models of the two that decide an earlier `now` as if
//! no time had passed (the fixed window, the log), the promise the other two keep instead
//! (never more lenient than at the latest `now`), and every `Decision` field checked
//! against what a probe of the limiter finds.

use super::*;

/// A trace whose time moves on by up to `max_gap` ns a step, and now and then is read up
/// to `max_back` ns behind that (a thread that read the clock before another's check), or
/// several times the same; costs from 0 to `max_cost`.
pub(super) fn wobbly(
    max_gap: u64,
    max_back: u64,
    max_cost: u32,
) -> impl Strategy<Value = Vec<(u64, u32)>> {
    let step = (
        prop_oneof![2 => Just(0u64), 5 => 0..=max_gap],
        prop_oneof![3 => Just(0u64), 1 => 0..=max_back],
        0..=max_cost,
    );
    prop::collection::vec(step, 1..200).prop_map(|steps| {
        let mut t = 0u64;
        steps
            .into_iter()
            .map(|(gap, back, cost)| {
                t += gap;
                (t.saturating_sub(back), cost)
            })
            .collect()
    })
}

/// The cost errors of every algorithm: zero, and above the capacity.
fn cost_error(cost: u32, capacity: u64) -> Option<CostError> {
    if cost == 0 {
        Some(CostError::Zero)
    } else if u64::from(cost) > capacity {
        Some(CostError::ExceedsCapacity { cost, capacity })
    } else {
        None
    }
}

/// A fixed window, the obvious way, for a clock that steps back: the admissions, each with
/// the window it was counted in. A `now` before the latest window counted is counted in
/// that window (no time has passed), its wait to that window's end.
struct ModelWindow {
    limit: u64,
    window: u64,
    counted: Vec<(u64, u32)>,
}

impl ModelWindow {
    fn check(&mut self, now: u64, cost: u32) -> Result<(bool, u64, Duration, Duration), CostError> {
        if let Some(e) = cost_error(cost, self.limit) {
            return Err(e);
        }
        let latest = self.counted.iter().map(|c| c.0).max();
        let k = (now / self.window).max(latest.unwrap_or(0));
        let used: u64 = self
            .counted
            .iter()
            .filter(|c| c.0 == k)
            .map(|c| u64::from(c.1))
            .sum();
        let end = ns((k + 1) * self.window - now);
        if used + u64::from(cost) <= self.limit {
            self.counted.push((k, cost));
            Ok((
                true,
                self.limit - used - u64::from(cost),
                Duration::ZERO,
                end,
            ))
        } else {
            Ok((false, self.limit - used, end, end))
        }
    }
}

/// An exact sliding window, the obvious way, for a clock that steps back: every admission
/// with the time it was counted at. A `now` before the latest admission is taken as that
/// time (no time has passed); waits count from the `now` given.
struct ModelLog {
    limit: u64,
    window: u64,
    admitted: Vec<(u64, u32)>,
}

impl ModelLog {
    fn check(&mut self, now: u64, cost: u32) -> Result<(bool, u64, Duration, Duration), CostError> {
        if let Some(e) = cost_error(cost, self.limit) {
            return Err(e);
        }
        let at = self.admitted.iter().map(|a| a.0).fold(now, u64::max);
        let live: Vec<(u64, u32)> = self
            .admitted
            .iter()
            .copied()
            .filter(|a| a.0 + self.window > at)
            .collect();
        let used: u64 = live.iter().map(|a| u64::from(a.1)).sum();
        if used + u64::from(cost) <= self.limit {
            self.admitted.push((at, cost));
            let reset = ns(at + self.window - now);
            return Ok((
                true,
                self.limit - used - u64::from(cost),
                Duration::ZERO,
                reset,
            ));
        }
        // The first instant at which enough of the live ones have expired.
        let mut freed = 0;
        let mut retry = 0;
        for a in &live {
            freed += u64::from(a.1);
            retry = a.0 + self.window - now;
            if used - freed + u64::from(cost) <= self.limit {
                break;
            }
        }
        let newest = live
            .iter()
            .map(|a| a.0)
            .max()
            .expect("rejected: some are live");
        Ok((
            false,
            self.limit - used,
            ns(retry),
            ns(newest + self.window - now),
        ))
    }
}

fn decided(d: Result<Decision, CostError>) -> Result<(bool, u64, Duration, Duration), CostError> {
    d.map(|d| parts(&d))
}

/// What every decision says, checked on copies of the limiter it was made by: `remaining`
/// more are admitted at the same `now` and one more is not, the same request is admitted
/// at `now + retry_after` and not a nanosecond before, and the limiter is neutral at
/// `now + reset_after` and not a nanosecond before.
fn probes_agree<A: Algorithm + Clone>(
    limiter: &Limiter<A>,
    now: u64,
    cost: u32,
    d: &Decision,
) -> Result<(), TestCaseError> {
    let at = ns(now);
    let cap = limiter.capacity();
    let probe = |t: Duration, c: u64| {
        let c = u32::try_from(c).unwrap();
        limiter.clone().check(t, c).unwrap().allowed
    };
    if d.remaining > 0 {
        prop_assert!(
            probe(at, d.remaining),
            "{} more not admitted: {:?}",
            d.remaining,
            d
        );
    }
    if d.remaining < cap {
        prop_assert!(
            !probe(at, d.remaining + 1),
            "{} more admitted: {:?}",
            d.remaining + 1,
            d
        );
    }
    if !d.allowed {
        prop_assert!(
            probe(at + d.retry_after, u64::from(cost)),
            "not admitted after {:?}",
            d
        );
        prop_assert!(
            !probe(at + d.retry_after - ns(1), u64::from(cost)),
            "admitted before retry_after: {:?}",
            d
        );
    }
    prop_assert_eq!(
        limiter.neutral_at(),
        at + d.reset_after,
        "reset_after of {:?}",
        d
    );
    Ok(())
}

/// Decides `trace` on a limiter, and at every step where the time is behind the latest
/// `now` seen, the same request on a copy at that latest `now`: the earlier `now` is never
/// decided more leniently (admitted where the latest is not, or with more remaining).
fn no_more_lenient_than_the_latest<A: Algorithm + Clone>(
    algorithm: A,
    trace: &[(u64, u32)],
) -> Result<(), TestCaseError> {
    let mut limiter = Limiter::new(algorithm);
    let mut latest = 0;
    for &(now, cost) in trace {
        latest = latest.max(now);
        let at_latest = limiter.clone().check(ns(latest), cost);
        let got = limiter.check(ns(now), cost);
        let Ok(d) = got else {
            prop_assert_eq!(got.map(drop), at_latest.map(drop));
            continue;
        };
        let later = at_latest.unwrap();
        prop_assert!(
            !d.allowed || later.allowed,
            "admitted at {} only: {:?}",
            now,
            d
        );
        if d.allowed == later.allowed {
            prop_assert!(
                d.remaining <= later.remaining,
                "{:?} at {}, {:?} later",
                d,
                now,
                later
            );
        }
        // After the decision: a rejection left the state it was rejected on.
        probes_agree(&limiter, now, cost, &d)?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// The fixed window and the log decide an earlier `now` exactly as the models above,
    /// every field of the decision.
    #[test]
    fn window_and_log_match_their_models_when_time_steps_back(
        r in rate(),
        tr in wobbly(2_000_000, 3_000_000, 22),
    ) {
        let (limit, window) = (u64::from(r.count()), r.period_nanos());
        let mut fw = Limiter::new(FixedWindow::new(r));
        let mut fw_model = ModelWindow { limit, window, counted: Vec::new() };
        let mut log = Limiter::new(SlidingLog::new(r));
        let mut log_model = ModelLog { limit, window, admitted: Vec::new() };
        for &(t, cost) in &tr {
            prop_assert_eq!(decided(fw.check(ns(t), cost)), fw_model.check(t, cost), "window at {} cost {}", t, cost);
            prop_assert_eq!(decided(log.check(ns(t), cost)), log_model.check(t, cost), "log at {} cost {}", t, cost);
        }
    }

    /// Every algorithm: an earlier `now` decided no more leniently than the latest one, and
    /// each decision's fields what probes of the limiter find.
    #[test]
    fn an_earlier_now_is_never_decided_more_leniently(
        r in rate(),
        burst in 1u32..=20,
        tr in wobbly(2_000_000, 3_000_000, 22),
    ) {
        no_more_lenient_than_the_latest(TokenBucket::new(Quota::new(r, burst).unwrap()), &tr)?;
        no_more_lenient_than_the_latest(FixedWindow::new(r), &tr)?;
        no_more_lenient_than_the_latest(SlidingWindow::new(r), &tr)?;
        no_more_lenient_than_the_latest(SlidingLog::new(r), &tr)?;
    }
}

/// The cases the docs name: the fixed window and the log decide a `now` before their
/// latest admission as at that admission; the token bucket and the sliding window, more
/// strictly.
#[test]
fn an_earlier_now_is_decided_as_documented() {
    let at = Duration::from_millis;
    let r = Rate::per_second(3).unwrap();
    let strictly = |name: &str, earlier: Decision, latest: Decision| {
        assert!(
            !earlier.allowed && latest.allowed,
            "{name}: {earlier:?} before, {latest:?} at the latest now"
        );
    };
    // A bucket of 3 (3/s) that took 1 at 10 s: 2 more fit at 10 s; at 9.8 s, 1.4.
    let mut bucket = Limiter::new(TokenBucket::new(Quota::from(r)));
    assert!(bucket.check(at(10_000), 1).unwrap().allowed);
    let earlier = bucket.clone().check(at(9_800), 2).unwrap();
    assert_eq!(earlier.remaining, 1);
    strictly(
        "token bucket",
        earlier,
        bucket.clone().check(at(10_000), 2).unwrap(),
    );
    // 3 in the window before, 1 in this one: at 0.8 s into it the previous weighs 0.2 × 3;
    // at 0.2 s, 0.8 × 3.
    let mut sliding = Limiter::new(SlidingWindow::new(r));
    assert!(sliding.check(at(9_500), 3).unwrap().allowed);
    assert!(sliding.check(at(10_800), 1).unwrap().allowed);
    let earlier = sliding.clone().check(at(10_200), 1).unwrap();
    strictly(
        "sliding window",
        earlier,
        sliding.clone().check(at(10_800), 1).unwrap(),
    );
    // As at the latest admission, whatever the earlier `now`.
    let mut fixed = Limiter::new(FixedWindow::new(r));
    assert!(fixed.check(at(10_500), 2).unwrap().allowed);
    let d = fixed.clone().check(at(9_500), 1).unwrap();
    assert!(
        d.allowed && d.remaining == 0 && d.reset_after == at(1_500),
        "{d:?}"
    );
    let mut log = Limiter::new(SlidingLog::new(r));
    assert!(log.check(at(10_500), 2).unwrap().allowed);
    let d = log.clone().check(at(9_500), 1).unwrap();
    assert!(
        d.allowed && d.remaining == 0 && d.reset_after == at(2_000),
        "{d:?}"
    );
}

/// What `Keyed` documents for a `now` from before a sweep that evicted: the key, not held,
/// is decided as a new key at the sweep's time, where the bucket kept would have decided
/// that earlier `now` more strictly (its refill up to the sweep not come yet).
#[test]
fn a_key_evicted_by_a_sweep_meets_an_earlier_now_as_at_the_sweep() {
    let q = Quota::per_second(1).unwrap().burst(2).unwrap();
    let at = Duration::from_secs;
    let mut kept = Limiter::new(TokenBucket::new(q));
    let mut keyed = Keyed::new(TokenBucket::new(q), 4).unwrap();
    assert!(kept.check(at(0), 2).unwrap().allowed);
    assert!(keyed.check("a", at(0), 2).unwrap().allowed);
    assert!(kept.is_neutral(at(2)));
    assert_eq!(keyed.sweep(at(2)), 1);
    // At 1 s the bucket kept holds one token back, not two.
    let d = kept.check(at(1), 2).unwrap();
    assert!(!d.allowed && d.remaining == 1, "{d:?}");
    // The evicted key, at the sweep's 2 s: full; full again 2 s after the 1 s given.
    let d = keyed.check("a", at(1), 2).unwrap();
    assert!(
        d.allowed && d.remaining == 0 && d.reset_after == at(3),
        "{d:?}"
    );
}
