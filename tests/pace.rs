//! Pacing under paused time: the documented guarantees, checked exactly from release
//! timestamps, plus fairness, cancel safety, runtime rate changes and the adapters.

mod support;

#[path = "pace/adapters.rs"]
mod adapters;
#[path = "pace/claims.rs"]
mod claims;
#[path = "pace/journey.rs"]
mod journey;

use std::num::NonZeroUsize;
use std::pin::pin;
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::Duration;

use flowgate::pace::{Leaky, LeakyQueue, Pacer};
use flowgate::{ConfigErrorKind, CostError, Dropped, FlowSinkExt, FlowStreamExt, Overflow};
use flowgate::{Quota, Rate};
use futures::{SinkExt, StreamExt, poll};
use proptest::prelude::*;
use tokio::time::Instant;

/// A pacer at `per_second` with `burst`.
fn pacer(per_second: u32, burst: u32) -> Pacer {
    Pacer::builder(Rate::per_second(per_second).unwrap())
        .burst(burst)
        .build()
        .unwrap()
}

fn nz(n: usize) -> NonZeroUsize {
    NonZeroUsize::new(n).unwrap()
}

/// What a recording drop hook saw: each item with its reason.
type Seen<T> = Arc<Mutex<Vec<(T, &'static str)>>>;

/// A drop hook that records each item with its reason.
fn recorder<T: Send + 'static>() -> (Seen<T>, impl Fn(T, &Dropped) + Send + Sync + 'static) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let hook = seen.clone();
    let record = move |item: T, why: &Dropped| hook.lock().unwrap().push((item, why.as_str()));
    (seen, record)
}

/// Release `costs` through `pacer` from a saturated source; returns `(ns since start, cost)`.
async fn releases(pacer: Pacer, costs: Vec<u32>) -> Vec<(u64, u32)> {
    let start = Instant::now();
    futures::stream::iter(costs)
        .leaky_cost(pacer, |c| *c)
        .map(|c| (start.elapsed().as_nanos() as u64, c))
        .collect()
        .await
}

/// (a) every interval [t_i, t_j]: released cost <= burst + rate * (t_j - t_i), exactly.
fn check_bound(rate: Rate, burst: u32, rel: &[(u64, u32)]) -> Result<(), String> {
    let (n, p) = (u128::from(rate.count()), u128::from(rate.period_nanos()));
    for i in 0..rel.len() {
        let mut sum = 0u128;
        for j in i..rel.len() {
            sum += u128::from(rel[j].1);
            let w = u128::from(rel[j].0 - rel[i].0);
            if sum * p > u128::from(burst) * p + n * w {
                return Err(format!("{sum} units in {w} ns (items {i}..={j})"));
            }
        }
    }
    Ok(())
}

/// (b) the item completing cumulative cost C leaves no earlier than (C - burst) / rate.
fn check_not_early(rate: Rate, burst: u32, rel: &[(u64, u32)]) -> Result<(), String> {
    let (n, p) = (u128::from(rate.count()), u128::from(rate.period_nanos()));
    let mut cumulative = 0u128;
    for (i, &(t, c)) in rel.iter().enumerate() {
        cumulative += u128::from(c);
        let ahead = cumulative.saturating_sub(u128::from(burst));
        if u128::from(t) * n < ahead * p {
            return Err(format!("item {i} at {t} ns is early"));
        }
    }
    Ok(())
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn bound_and_due_times_hold_on_random_schedules(
        count in 1u32..=2_000,
        period_ms in prop_oneof![Just(1u64), Just(1_000), 1..3_000u64],
        burst in 1u32..=8,
        costs in prop::collection::vec(1u32..=8, 1..120),
    ) {
        let rate = Rate::per(count, Duration::from_millis(period_ms)).unwrap();
        let costs: Vec<u32> = costs.into_iter().map(|c| c.min(burst)).collect();
        let total: u64 = costs.iter().map(|&c| u64::from(c)).sum();
        let rel = runtime().block_on(async {
            let pacer = Pacer::builder(rate).burst(burst).build().unwrap();
            releases(pacer, costs).await
        });
        prop_assert_eq!(rel.iter().map(|r| u64::from(r.1)).sum::<u64>(), total);
        check_bound(rate, burst, &rel).map_err(TestCaseError::fail)?;
        check_not_early(rate, burst, &rel).map_err(TestCaseError::fail)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// `set_quota` with the quota a pacer already has changes nothing, at any rate, units of
    /// a fraction of a nanosecond included: the pacer answers every later `check` as its
    /// twin that was not given it does. A round trip through another quota may delay the
    /// next unit by less than a nanosecond (where the other quota's units cannot tell its
    /// due time), never bring it forward: checked with a burst of 1, where the next unit's
    /// due time is the whole schedule. (With a larger burst, a pacer this young may have its
    /// next unit due before its creation, which the other quota's bucket cannot hold: the
    /// round trip may then leave it later by more, with fewer units, never more; see
    /// `a_round_trip_through_a_smaller_burst_gives_no_unit_back`.)
    #[test]
    fn set_quota_of_the_same_quota_changes_nothing(
        count in prop_oneof![1u32..=10, Just(1_000_000), Just(3_000_000_000), Just(u32::MAX)],
        period_ns in prop_oneof![Just(1u64), Just(7), Just(1_000_000_000), 1..10_000_000_000u64],
        burst in 1u32..=5,
        taken in 1u32..=5,
        other in 1u32..=1_000,
        steps in prop::collection::vec(0u64..2_000_000_000, 1..6),
    ) {
        let rate = Rate::per(count, Duration::from_nanos(period_ns)).unwrap();
        let quota = Quota::new(rate, burst).unwrap();
        let other = Quota::new(Rate::per_second(other).unwrap(), burst).unwrap();
        runtime().block_on(async {
            let pacers: Vec<Pacer> = (0..3)
                .map(|_| Pacer::builder(rate).burst(burst).build().unwrap())
                .collect();
            for p in &pacers {
                assert!(p.check(taken.min(burst)).unwrap().allowed);
            }
            pacers[1].set_quota(quota);
            pacers[2].set_quota(other);
            pacers[2].set_quota(quota);
            // Whether the round trip's pacer still has the twins' schedule to compare with
            // (until it refuses a unit they take, its due time a fraction of a ns later).
            let mut together = burst == 1;
            for step in steps {
                tokio::time::advance(Duration::from_nanos(step)).await;
                let d: Vec<_> = pacers.iter().map(|p| p.check(1).unwrap()).collect();
                assert_eq!(d[1], d[0], "after a set_quota of the same quota");
                if !together {
                    continue;
                }
                if d[0].allowed {
                    together = d[2].allowed;
                    continue;
                }
                assert!(!d[2].allowed, "a unit early after a round trip: {:?}", d[2]);
                let late = d[2].retry_after.checked_sub(d[0].retry_after);
                assert!(late.is_some_and(|l| l <= Duration::from_nanos(1)), "{d:?}");
            }
        });
    }
}

/// `num / den` ns, rounded up to the nanosecond and then to the timer's 1 ms tick.
fn on_the_tick(num: u128, den: u128) -> u64 {
    let ns = num.div_ceil(den);
    u64::try_from(ns.div_ceil(1_000_000) * 1_000_000).unwrap()
}

/// A stream of unit-cost items pulled as fast as it yields, in a task of its own; returns
/// when each item left (ns since `start`).
fn saturated(pacer: Pacer, n: usize, start: Instant) -> tokio::task::JoinHandle<Vec<u64>> {
    tokio::spawn(async move {
        futures::stream::iter(0..n)
            .leaky_with(pacer)
            .map(|_| start.elapsed().as_nanos() as u64)
            .collect()
            .await
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Never fewer than the model admits, nor sooner: with a burst that absorbs the 1 ms
    /// timer's lateness (the default, or more), saturated streams sharing one pacer, at
    /// rates from 1 per 5 s to 2M/s that do and do not divide a nanosecond, release unit
    /// `k` (counted over all of them) exactly on the first tick at or after its GCRA due
    /// time `(k + 1 − burst) / rate`: no unit late, none lost to rounding, none early.
    #[test]
    fn every_unit_leaves_on_the_first_tick_after_its_due_time(
        count in prop_oneof![1u32..=20, 1u32..=2_000_000, Just(1_000_000), Just(999_983)],
        period_ms in prop_oneof![Just(1_000u64), Just(1), 1..5_000u64],
        streams in 1usize..=4,
        per_stream in 1usize..100,
        extra in 0u32..4,
    ) {
        let rate = Rate::per(count, Duration::from_millis(period_ms)).unwrap();
        let burst = Pacer::default_quota(rate).burst_size() + extra;
        let mut released = runtime().block_on(async {
            let pacer = Pacer::builder(rate).burst(burst).build().unwrap();
            let start = Instant::now();
            let tasks: Vec<_> = (0..streams)
                .map(|_| saturated(pacer.clone(), per_stream, start))
                .collect();
            let mut all = Vec::new();
            for t in tasks {
                all.extend(t.await.unwrap());
            }
            all
        });
        released.sort_unstable();
        prop_assert_eq!(released.len(), streams * per_stream);
        let (n, p) = (u128::from(count), u128::from(period_ms) * 1_000_000);
        for (k, &at) in released.iter().enumerate() {
            let ahead = (k as u128 + 1).saturating_sub(u128::from(burst));
            prop_assert_eq!(at, on_the_tick(ahead * p, n), "unit {} of {:?}, burst {}", k, rate, burst);
        }
    }
}

#[tokio::test(start_paused = true)]
async fn the_rate_is_exact_and_does_not_drift() {
    // 3 per second does not divide a second, and the timer rounds every wait up to a whole
    // millisecond; the schedule still does not drift: item i (after a burst of 2) is due at
    // exactly (i - 1) / 3 s, and item 3 001 leaves at 1 000 s.
    let pacer = pacer(3, 2);
    let rel = releases(pacer, vec![1; 3_002]).await;
    let last = Duration::from_nanos(rel.last().unwrap().0);
    assert_eq!(last, Duration::from_secs(1_000));
    let rel_ms: Vec<u64> = rel.iter().map(|r| r.0 / 1_000_000).collect();
    assert_eq!(&rel_ms[..5], [0, 0, 334, 667, 1_000]);
}

#[tokio::test(start_paused = true)]
async fn high_rates_leave_in_on_time_batches() {
    // 1M/s with the default burst (1 + 5 000): 200 000 items in 0.195 s of virtual time.
    let rate = Rate::per_second(1_000_000).unwrap();
    let pacer = Pacer::new(rate);
    assert_eq!(pacer.quota().burst_size(), 5_001);
    let rel = releases(pacer, vec![1; 200_000]).await;
    let last = rel.last().unwrap().0;
    assert!(
        (194_999_000..=195_000_000).contains(&last),
        "last at {last} ns"
    );
    // Every release is on time: never early, and within the bound.
    check_not_early(rate, 5_001, &rel).unwrap();
    let per_ms = rel.iter().filter(|r| r.0 == 100_000_000).count();
    assert_eq!(per_ms, 1_000, "one batch per 1 ms tick");
}

#[tokio::test(start_paused = true)]
async fn waiters_are_served_fifo_across_tasks() {
    let pacer = pacer(100, 1);
    pacer.until_ready(1).await.unwrap(); // from here on, everyone waits
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for t in 0..3 {
        let (pacer, order) = (pacer.clone(), order.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..10 {
                pacer.until_ready(1).await.unwrap();
                order.lock().unwrap().push(t);
            }
        }));
        tokio::task::yield_now().await;
    }
    for t in tasks {
        t.await.unwrap();
    }
    let order = order.lock().unwrap();
    assert_eq!(order.len(), 30);
    // Round robin: in every prefix, no task is more than one grant ahead of another.
    let mut counts = [0i32; 3];
    for &t in order.iter() {
        counts[t] += 1;
        let (max, min) = (counts.iter().max().unwrap(), counts.iter().min().unwrap());
        assert!(max - min <= 1, "unfair prefix: {counts:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn a_dropped_waiter_gives_its_place_back() {
    let pacer = pacer(10, 1);
    pacer.until_ready(1).await.unwrap(); // t = 0; next due at 100 ms
    let start = Instant::now();
    {
        let mut first = pin!(pacer.until_ready(1));
        assert!(poll!(first.as_mut()).is_pending());
        assert_eq!(pacer.waiting(), 1);
    }
    assert_eq!(pacer.waiting(), 0);
    // The next waiter gets the slot the dropped one held: due at 100 ms, not 200 ms.
    pacer.until_ready(1).await.unwrap();
    assert_eq!(start.elapsed(), Duration::from_millis(100));

    // A dropped head lets the one behind it move up at once.
    let mut head = Box::pin(pacer.until_ready(1));
    let mut behind = Box::pin(pacer.until_ready(1));
    assert!(poll!(head.as_mut()).is_pending());
    assert!(poll!(behind.as_mut()).is_pending());
    drop(head);
    behind.await.unwrap();
    assert_eq!(start.elapsed(), Duration::from_millis(200));
}

#[tokio::test(start_paused = true)]
async fn an_item_above_the_burst_pays_in_chunks_and_cost_zero_is_free() {
    let pacer = pacer(10, 2);
    // Cost 5 with a burst of 2 at 10/s from a full bucket: 2 at 0 ms, 2 at 200 ms, 1 at 300 ms.
    let rel = releases(pacer, vec![5, 0, 1]).await;
    let ms: Vec<u64> = rel.iter().map(|r| r.0 / 1_000_000).collect();
    assert_eq!(ms, [300, 300, 400]);
}

#[tokio::test(start_paused = true)]
async fn check_and_bad_costs() {
    let pacer = pacer(10, 2);
    assert!(pacer.check(2).unwrap().allowed);
    let refused = pacer.check(1).unwrap();
    assert_eq!(
        (refused.allowed, refused.retry_after),
        (false, Duration::from_millis(100))
    );
    let too_much = CostError::ExceedsCapacity {
        cost: 3,
        capacity: 2,
    };
    assert_eq!(pacer.check(3), Err(too_much));
    assert_eq!(pacer.check(0), Err(CostError::Zero));
    assert_eq!(pacer.until_ready(3).await, Err(too_much));
    assert_eq!(pacer.until_ready(0).await, Err(CostError::Zero));
    assert_eq!(
        too_much.to_string(),
        "cost 3 exceeds the capacity 2: it could never be admitted"
    );
    let err = Pacer::builder(Rate::per_second(1).unwrap())
        .burst(0)
        .build()
        .unwrap_err();
    assert_eq!(
        (err.field(), err.kind()),
        ("pace.burst", ConfigErrorKind::Zero)
    );
}

#[tokio::test(start_paused = true)]
async fn check_answers_a_decision_and_never_jumps_the_line() {
    // 10/s, burst 4: a unit every 100 ms, the bucket full again 400 ms after it empties.
    let pacer = pacer(10, 4);
    let d = pacer.check(3).unwrap();
    assert!(d.allowed);
    assert_eq!((d.capacity, d.remaining), (4, 1));
    assert_eq!(
        (d.retry_after, d.reset_after),
        (Duration::ZERO, Duration::from_millis(300))
    );
    let d = pacer.check(2).unwrap();
    assert!(!d.allowed, "one unit left, two asked for");
    assert_eq!((d.capacity, d.remaining), (4, 1));
    assert_eq!(
        (d.retry_after, d.reset_after),
        (Duration::from_millis(100), Duration::from_millis(300))
    );
    // A refusal takes nothing: the last unit is still there.
    assert!(pacer.check(1).unwrap().allowed);

    // FIFO: while someone waits, `check` refuses even a cost the bucket could take now.
    let start = Instant::now();
    let mut waiter = Box::pin(pacer.until_ready(3));
    assert!(poll!(waiter.as_mut()).is_pending()); // due at 300 ms
    tokio::time::advance(Duration::from_millis(100)).await;
    let d = pacer.check(1).unwrap();
    assert!(!d.allowed, "the waiter ahead comes first");
    assert_eq!((d.capacity, d.remaining), (4, 0));
    assert_eq!(
        (d.retry_after, d.reset_after),
        (Duration::from_millis(300), Duration::from_millis(300)),
        "after the waiter's three units (at 300 ms), its own at 400 ms; full again in 300 ms"
    );
    waiter.await.unwrap();
    assert_eq!(start.elapsed(), Duration::from_millis(300));
    // Nobody waits any more: the next unit is due 100 ms later.
    let d = pacer.check(1).unwrap();
    assert_eq!(
        (d.allowed, d.retry_after),
        (false, Duration::from_millis(100))
    );
    tokio::time::advance(d.retry_after).await;
    assert!(pacer.check(1).unwrap().allowed);
}

#[tokio::test(start_paused = true)]
async fn check_counts_every_unit_waiting_ahead_past_u32_max() {
    // A byte pacer at u32::MAX a second with a burst of as much: two waiters ahead ask for a
    // whole burst each, more than a `u32` between them.
    let pacer = Pacer::builder(Rate::per_second(u32::MAX).unwrap())
        .burst(u32::MAX)
        .build()
        .unwrap();
    assert!(pacer.check(u32::MAX).unwrap().allowed); // empty; full again in 1 s
    let mut first = pin!(pacer.until_ready(u32::MAX)); // due at 1 s
    let mut second = pin!(pacer.until_ready(u32::MAX)); // due at 2 s
    assert!(poll!(first.as_mut()).is_pending());
    assert!(poll!(second.as_mut()).is_pending());
    let d = pacer.check(1).unwrap();
    assert!(!d.allowed);
    // After both waiters' units, one more: (2 × (2^32 − 1) + 1) / (2^32 − 1) s, rounded up
    // to the nanosecond. Never earlier than that.
    assert_eq!(d.retry_after, Duration::from_nanos(2_000_000_001));
}

#[tokio::test(start_paused = true)]
async fn set_quota_applies_to_waiters_at_once() {
    let pacer = pacer(1, 1);
    pacer.until_ready(1).await.unwrap();
    let start = Instant::now();
    let mut next = Box::pin(pacer.until_ready(1));
    assert!(poll!(next.as_mut()).is_pending()); // due in 1 s at the old rate
    pacer.set_quota(Quota::new(Rate::per_second(1).unwrap(), 1).unwrap());
    tokio::time::advance(Duration::from_millis(10)).await;
    // Raising the rate keeps the schedule already taken (full at 1 s), then runs faster.
    let faster = Quota::new(Rate::per_second(100).unwrap(), 1).unwrap();
    pacer.set_quota(faster);
    next.await.unwrap();
    assert_eq!(start.elapsed(), Duration::from_secs(1));
    pacer.until_ready(1).await.unwrap();
    assert_eq!(start.elapsed(), Duration::from_millis(1_010));
    assert_eq!(pacer.quota(), faster);
}

#[test]
fn the_default_quota_is_the_pacers_default_burst() {
    for (per_second, burst) in [(1, 2), (200, 2), (201, 3), (1_000, 6), (1_000_000, 5_001)] {
        let rate = Rate::per_second(per_second).unwrap();
        let quota = Pacer::default_quota(rate);
        assert_eq!((quota.rate(), quota.burst_size()), (rate, burst));
        assert_eq!(Pacer::new(rate).quota(), quota);
        let built = Pacer::builder(rate).build().unwrap();
        assert_eq!(built.quota(), quota);
    }
    // The burst saturates instead of overflowing.
    let huge = Rate::per(u32::MAX, Duration::from_nanos(1)).unwrap();
    assert_eq!(Pacer::default_quota(huge).burst_size(), u32::MAX);
}

#[tokio::test(start_paused = true)]
async fn a_faster_rate_never_delays_the_next_unit_past_its_old_due_time() {
    // Default burst 2 at 1/s: two units at once, the next due in 1 s.
    let pacer = Pacer::new(Rate::per_second(1).unwrap());
    pacer.until_ready(1).await.unwrap();
    pacer.until_ready(1).await.unwrap();
    let refused = pacer.check(1).unwrap();
    assert!(!refused.allowed);
    let old = refused.retry_after;
    assert_eq!(old, Duration::from_secs(1));
    pacer.set_quota(Pacer::default_quota(Rate::per_second(1_000).unwrap()));
    let start = Instant::now();
    pacer.until_ready(1).await.unwrap();
    assert_eq!(start.elapsed(), old, "due when it was due, not later");
    // From there the new rate: 1 ms apart (after the new burst).
    for _ in 0..10 {
        pacer.until_ready(1).await.unwrap();
    }
    assert!(start.elapsed() <= old + Duration::from_millis(10));
}

/// `set_quota` keeps what the bucket still holds: the next unit stays due when it was. In a
/// pacer's first `(burst − 1) / rate` that due time was worked out by a subtraction that
/// stopped at the pacer's creation, so the same change of quota emptied the bucket there
/// (here 6 units left before, 0 after) that kept it an hour later.
#[tokio::test(start_paused = true)]
async fn set_quota_keeps_the_units_left_in_a_new_pacer() {
    let quota = Quota::new(Rate::per_second(10).unwrap(), 10).unwrap();
    for idle in [Duration::ZERO, Duration::from_secs(3_600)] {
        let pacer = pacer(10, 10);
        tokio::time::advance(idle).await;
        for _ in 0..3 {
            assert!(pacer.check(1).unwrap().allowed);
        }
        pacer.set_quota(quota);
        let d = pacer.check(1).unwrap();
        assert_eq!((d.allowed, d.remaining), (true, 6), "after {idle:?} idle");
    }
}

/// `set_quota` never brings the next unit forward, not even by a fraction of a nanosecond:
/// it carried the schedule over in whole nanoseconds rounded down, so at a rate whose unit
/// is not a whole number of them the next unit came early. At 3/s with strict spacing the
/// unit due at 333 333 333⅓ ns passed at 333 333 333 ns; above 10^9/s (several units a
/// nanosecond) a `set_quota` of the same quota handed out again a unit the burst had just
/// taken: 3 units at 0 ns with a burst of 2.
#[tokio::test(start_paused = true)]
async fn set_quota_never_brings_the_next_unit_forward() {
    // 3 units a nanosecond, burst 2: empty at 0 ns, the next unit due at ⅓ ns.
    let quota = Quota::new(Rate::per(3, Duration::from_nanos(1)).unwrap(), 2).unwrap();
    let p = Pacer::builder(quota.rate()).burst(2).build().unwrap();
    assert!(p.check(2).unwrap().allowed);
    assert!(!p.check(1).unwrap().allowed);
    p.set_quota(quota);
    assert!(!p.check(1).unwrap().allowed, "a third unit at 0 ns");
    // 3/s, strict spacing: the second unit is due at 333 333 333⅓ ns.
    let quota = Quota::new(Rate::per_second(3).unwrap(), 1).unwrap();
    let p = Pacer::builder(quota.rate()).burst(1).build().unwrap();
    assert!(p.check(1).unwrap().allowed);
    tokio::time::advance(Duration::from_nanos(333_333_333)).await;
    assert!(!p.check(1).unwrap().allowed);
    p.set_quota(quota);
    assert!(!p.check(1).unwrap().allowed, "the second unit ⅓ ns early");
    tokio::time::advance(Duration::from_nanos(1)).await;
    assert!(p.check(1).unwrap().allowed);
    // Through a quota of another scale (7/s) and back, it is due no earlier either.
    p.set_quota(Quota::new(Rate::per_second(7).unwrap(), 1).unwrap());
    p.set_quota(quota);
    let d = p.check(1).unwrap();
    assert!(!d.allowed);
    assert_eq!(d.retry_after, Duration::from_nanos(333_333_334));
}

/// `set_quota` gives no units back: a round trip through a quota of a smaller bucket leaves
/// the schedule as it was. Carried over to the smaller bucket, a bucket that held more
/// than it can was taken as full, and a bucket full at the change stayed full under the
/// larger one: each round trip refilled it, so a check and two changes of quota in a loop
/// let any number of units through at one instant (guarantee (a): at most the burst).
#[tokio::test(start_paused = true)]
async fn a_round_trip_through_a_smaller_burst_gives_no_unit_back() {
    let big = Quota::new(Rate::per_second(1).unwrap(), 4).unwrap();
    let small = Quota::new(Rate::per_second(1).unwrap(), 1).unwrap();
    let pacer = pacer(1, 4);
    // Idle for long: full, its schedule far from the pacer's creation.
    tokio::time::advance(Duration::from_secs(3_600)).await;
    let mut passed = 0;
    for _ in 0..100 {
        if pacer.check(1).unwrap().allowed {
            passed += 1;
        }
        pacer.set_quota(small);
        pacer.set_quota(big);
    }
    assert_eq!(passed, 4, "units at one instant");
}

/// `check` never jumps the line, so while others wait it cannot pass before they have:
/// its `retry_after` counts their units too. It was the bucket's alone, 0 here (the bucket
/// holds a unit the waiter is about to take), which told the caller to come back at once
/// to the same refusal.
#[tokio::test(start_paused = true)]
async fn check_behind_waiters_is_told_to_wait_for_them_too() {
    let pacer = pacer(10, 1);
    assert!(pacer.check(1).unwrap().allowed);
    let mut waiter = pin!(pacer.until_ready(1));
    assert!(poll!(waiter.as_mut()).is_pending());
    // The bucket holds one unit again; the waiter's timer has not run yet.
    tokio::time::advance(Duration::from_millis(100)).await;
    let d = pacer.check(1).unwrap();
    assert!(!d.allowed);
    assert_eq!(
        d.retry_after,
        Duration::from_millis(100),
        "after the waiter's unit"
    );
    waiter.await.unwrap();
    let start = Instant::now();
    pacer.until_ready(1).await.unwrap();
    assert_eq!(
        start.elapsed(),
        Duration::from_millis(100),
        "as it was told"
    );
}

#[tokio::test(start_paused = true)]
async fn a_first_waiter_left_unpolled_is_stepped_over_and_takes_its_place_back() {
    let pacer = pacer(10, 1);
    let mut a = Box::pin(futures::stream::iter(0..10u32).leaky_with(pacer.clone()));
    let start = Instant::now();
    assert_eq!(a.next().await, Some(0));
    // `a` is first in line (due at 100 ms), then left alone, as in a busy `select!` loop.
    assert!(poll!(a.next()).is_pending());
    pacer.until_ready(1).await.unwrap();
    assert_eq!(
        start.elapsed(),
        Duration::from_millis(110),
        "stepped over 10 ms after a's turn"
    );
    let mut c = Box::pin(pacer.until_ready(1));
    assert!(poll!(c.as_mut()).is_pending());
    // Polled again, `a` is first again, ahead of `c`, and the schedule holds.
    assert_eq!(a.next().await, Some(1));
    assert_eq!(start.elapsed(), Duration::from_millis(210));
    c.await.unwrap();
    assert_eq!(start.elapsed(), Duration::from_millis(310));
}

#[tokio::test(start_paused = true)]
async fn a_stalled_item_above_the_burst_is_stepped_over_after_the_grace() {
    // 10/s, burst 2: an item of cost 20 pays in chunks of 1 (half the burst).
    let pacer = pacer(10, 2);
    let start = Instant::now();
    pacer.until_ready(2).await.unwrap(); // the bucket is empty: the next unit is due at 100 ms
    let mut head = Box::pin(pacer.until_ready(1));
    assert!(poll!(head.as_mut()).is_pending());
    // A heavy item queues behind `head`, then its task stops polling it (a busy `select!`).
    let mut heavy = Box::pin(futures::stream::iter([20u32]).leaky_cost(pacer.clone(), |c| *c));
    assert!(poll!(heavy.next()).is_pending());
    head.await.unwrap();
    assert_eq!(start.elapsed(), Duration::from_millis(100));
    // `heavy` is first in line now; its first chunk of 1 is due at 200 ms. Unclaimed, it is
    // stepped over 10 ms later, not after the (20 - 2) / 10 s its whole cost would take.
    pacer.until_ready(1).await.unwrap();
    assert_eq!(
        start.elapsed(),
        Duration::from_millis(210),
        "the other user of the pacer waited for the stalled heavy item"
    );
    // Polled again, `heavy` takes its place back and pays its 20 units at the rate: twenty
    // chunks of 1, 100 ms apart on the schedule, the first due at 300 ms (the burst's
    // second unit), the last at 2 200 ms.
    assert_eq!(heavy.next().await, Some(20));
    assert_eq!(start.elapsed(), Duration::from_millis(2_200));
}

#[tokio::test(start_paused = true)]
async fn a_wait_for_more_than_the_burst_fails_at_once_behind_others() {
    let pacer = pacer(10, 2);
    pacer.until_ready(2).await.unwrap();
    let start = Instant::now();
    let mut head = Box::pin(pacer.until_ready(1));
    assert!(poll!(head.as_mut()).is_pending());
    // Behind a waiter, a cost that can never pass is refused at once, without queueing.
    let mut big = Box::pin(pacer.until_ready(3));
    assert!(matches!(
        poll!(big.as_mut()),
        Poll::Ready(Err(CostError::ExceedsCapacity {
            cost: 3,
            capacity: 2
        }))
    ));
    assert_eq!(pacer.waiting(), 1);
    drop(big);
    assert_eq!(start.elapsed(), Duration::ZERO);
    head.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn the_next_waiter_takes_over_the_watch_when_the_watcher_leaves() {
    let pacer = pacer(10, 1);
    pacer.until_ready(1).await.unwrap();
    let start = Instant::now();
    let mut a = Box::pin(pacer.until_ready(1));
    assert!(poll!(a.as_mut()).is_pending()); // first in line, then never polled again
    let mut b = Box::pin(pacer.until_ready(1));
    assert!(poll!(b.as_mut()).is_pending()); // right behind a: it watches a
    let p = pacer.clone();
    let c = tokio::spawn(async move { p.until_ready(1).await });
    tokio::task::yield_now().await; // c queues third
    drop(b); // the watcher gives up: c watches now
    c.await.unwrap().unwrap();
    assert_eq!(start.elapsed(), Duration::from_millis(110));
    drop(a);
}

#[tokio::test(start_paused = true)]
async fn leaky_queue_yields_with_an_upstream_that_is_always_ready() {
    let pacer = pacer(10, 1);
    let mut queue = futures::stream::repeat(7u32).leaky_queue(pacer, nz(4), Overflow::DropNewest);
    let first = tokio::time::timeout(Duration::from_secs(5), queue.next()).await;
    assert_eq!(first.expect("poll_next returns"), Some(7));
    assert!(queue.dropped() > 0, "the full queue refused the rest");
}

#[tokio::test(start_paused = true)]
async fn leaky_queue_reports_what_is_still_queued_when_dropped() {
    let pacer = pacer(10, 1);
    let (seen, hook) = recorder();
    let mut queue = LeakyQueue::builder(futures::stream::iter(0..5u32), pacer, 8)
        .overflow(Overflow::DropNewest)
        .on_drop(hook)
        .build()
        .unwrap();
    assert_eq!(queue.next().await, Some(0));
    assert_eq!(queue.queued(), 4);
    drop(queue);
    assert_eq!(
        *seen.lock().unwrap(),
        [1, 2, 3, 4].map(|x| (x, "discarded")),
        "queued items go to on_drop, discarded"
    );
}

#[tokio::test(start_paused = true)]
async fn leaky_queue_drops_by_policy_and_counts() {
    for (policy, expect_first, reason) in [
        (Overflow::DropOldest, 6u32, "oldest"),
        (Overflow::DropNewest, 0, "newest"),
        (Overflow::Reject, 0, "newest"),
    ] {
        let (dropped, hook) = recorder();
        let pacer = pacer(10, 1);
        let (tx, rx) = futures::channel::mpsc::unbounded();
        for i in 0..10u32 {
            tx.unbounded_send(i).unwrap();
        }
        drop(tx);
        let queue = LeakyQueue::builder(rx, pacer, 4)
            .overflow(policy)
            .on_drop(hook)
            .build()
            .unwrap();
        let mut queue = pin!(queue);
        let first = queue.next().await.unwrap();
        assert_eq!(first, expect_first, "{policy}");
        let rest: Vec<u32> = queue.as_mut().collect().await;
        let dropped = dropped.lock().unwrap().clone();
        assert_eq!(dropped.len(), 6, "{policy}: 10 offered into 4 places");
        assert_eq!(1 + rest.len() + dropped.len(), 10, "{policy}: nothing lost");
        assert!(
            dropped.iter().all(|&(_, why)| why == reason),
            "{policy}: dropped as {reason}: {dropped:?}"
        );
        assert_eq!(queue.dropped(), 6);
    }
    let pacer = Pacer::new(Rate::per_second(1).unwrap());
    let err = LeakyQueue::builder(futures::stream::iter([1]), pacer, 0)
        .build()
        .unwrap_err();
    assert_eq!(
        (err.field(), err.kind()),
        ("pace.queue_capacity", ConfigErrorKind::Zero)
    );
}

#[tokio::test(start_paused = true)]
async fn leaky_queue_with_backpressure_loses_nothing() {
    let pacer = pacer(100, 1);
    let out: Vec<u32> = futures::stream::iter(0..50)
        .leaky_queue(pacer, nz(4), Overflow::Backpressure)
        .collect()
        .await;
    assert_eq!(out, (0..50).collect::<Vec<_>>());
}

#[tokio::test(start_paused = true)]
async fn a_sink_is_paced() {
    let (tx, rx) = flowgate::channel::bounded::<u32>(100).unwrap();
    let start = Instant::now();
    let mut sink = tx.leaky_sink_with(pacer(20, 1));
    for i in 0..5 {
        sink.send(i).await.unwrap();
    }
    assert_eq!(start.elapsed(), Duration::from_millis(200));
    drop(sink);
    assert_eq!(rx.collect::<Vec<_>>().await, [0, 1, 2, 3, 4]);
}

#[tokio::test(start_paused = true)]
async fn streams_sharing_a_pacer_split_the_rate() {
    let pacer = pacer(100, 1);
    let start = Instant::now();
    let a = futures::stream::iter(0..50)
        .leaky_with(pacer.clone())
        .count();
    let b = futures::stream::iter(0..50)
        .leaky_with(pacer.clone())
        .count();
    let (a, b) = tokio::join!(a, b);
    assert_eq!((a, b), (50, 50));
    // 100 items at 100/s, the first at t = 0.
    assert_eq!(start.elapsed(), Duration::from_millis(990));
}

#[tokio::test(start_paused = true)]
async fn dropping_an_adapter_frees_the_shared_pacer() {
    let pacer = pacer(10, 1);
    pacer.until_ready(1).await.unwrap();
    {
        let mut s = pin!(futures::stream::iter(0..5).leaky_with(pacer.clone()));
        assert!(poll!(s.next()).is_pending());
        assert_eq!(pacer.waiting(), 1);
    }
    assert_eq!(pacer.waiting(), 0);
    pacer.until_ready(1).await.unwrap();
}

/// The item a `leaky` stream holds while it waits for the pacer is handed to `on_drop`, as
/// `Discarded`, when the stream is dropped or taken apart; it was dropped unseen.
#[tokio::test(start_paused = true)]
async fn leaky_hands_the_item_it_holds_to_on_drop() {
    for take_apart in [false, true] {
        let (seen, hook) = recorder();
        let mut s = Leaky::builder(futures::stream::iter(0..5u32), pacer(10, 1))
            .cost(|x: &u32| u32::from(*x > 0))
            .on_drop(hook)
            .build()
            .unwrap();
        assert_eq!(s.next().await, Some(0), "cost 0: at once");
        assert_eq!(s.next().await, Some(1), "the first unit of the burst");
        assert!(poll!(s.next()).is_pending(), "2 waits for the pacer");
        assert!(seen.lock().unwrap().is_empty());
        if take_apart {
            let rest: Vec<u32> = s.into_inner().collect().await;
            assert_eq!(rest, [3, 4], "the inner stream goes on after the held item");
        } else {
            drop(s);
        }
        assert_eq!(
            *seen.lock().unwrap(),
            [(2, "discarded")],
            "take_apart={take_apart}: the held item goes to on_drop"
        );
    }
}

/// A `leaky` stream with nothing in hand hands nothing to `on_drop`.
#[tokio::test(start_paused = true)]
async fn leaky_with_nothing_in_hand_drops_nothing() {
    let (seen, hook) = recorder();
    let s = Leaky::builder(futures::stream::iter(0..3u32), pacer(10, 1))
        .on_drop(hook)
        .build()
        .unwrap();
    assert_eq!(s.collect::<Vec<_>>().await, [0, 1, 2]);
    assert!(seen.lock().unwrap().is_empty());
}

/// The item a dropped `leaky` stream held is counted under its pacer's name, as the items
/// left in a `leaky_queue` are: `flowgate_pace_dropped_total{policy="closed"}`.
#[cfg(feature = "metrics")]
#[tokio::test(start_paused = true)]
async fn the_item_a_dropped_leaky_stream_held_is_counted_as_closed() {
    let recorder = support::TestRecorder::default();
    let mut s = metrics::with_local_recorder(&recorder, || {
        let pacer = Pacer::builder(Rate::per_second(10).unwrap())
            .burst(1)
            .name("gateway")
            .build()
            .unwrap();
        futures::stream::iter(0..5u32).leaky_with(pacer)
    });
    assert_eq!(s.next().await, Some(0));
    assert!(poll!(s.next()).is_pending());
    drop(s);
    assert_eq!(
        recorder.counter("flowgate_pace_dropped_total{name=gateway,policy=closed}"),
        1
    );
}

#[cfg(feature = "metrics")]
#[tokio::test(start_paused = true)]
async fn metrics_count_releases_and_lateness() {
    let recorder = support::TestRecorder::default();
    let pacer = metrics::with_local_recorder(&recorder, || {
        Pacer::builder(Rate::per_second(10).unwrap())
            .burst(1)
            .name("gateway")
            .build()
            .unwrap()
    });
    let n = futures::stream::iter(0..3).leaky_with(pacer).count().await;
    assert_eq!(n, 3);
    assert_eq!(
        recorder.counter("flowgate_pace_released_total{name=gateway}"),
        3
    );
    // Two items waited; under paused time they were released exactly on time.
    assert_eq!(
        recorder.samples("flowgate_pace_lateness_seconds{name=gateway}"),
        [0.0, 0.0]
    );
}

/// A metrics recorder is user code: here one that reads the pacer whenever a release is
/// counted or a lateness recorded (an exporter taking a snapshot, say), which takes the
/// pacer's lock. Both were recorded under it, so the first release deadlocked.
#[cfg(feature = "metrics")]
#[test]
fn the_pacers_metrics_are_recorded_outside_its_lock() {
    use std::sync::OnceLock;
    use std::sync::mpsc::RecvTimeoutError;

    use metrics::{
        Counter, CounterFn, Gauge, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder,
        SharedString, Unit,
    };

    /// Reads the pacer on every change, once it is set.
    struct Snapshot(Arc<OnceLock<Pacer>>);
    impl Snapshot {
        fn read(&self) {
            if let Some(pacer) = self.0.get() {
                let _ = pacer.waiting();
            }
        }
    }
    impl CounterFn for Snapshot {
        fn increment(&self, _: u64) {
            self.read();
        }
        fn absolute(&self, _: u64) {
            self.read();
        }
    }
    impl HistogramFn for Snapshot {
        fn record(&self, _: f64) {
            self.read();
        }
    }
    struct Snapshots(Arc<OnceLock<Pacer>>);
    impl Recorder for Snapshots {
        fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn register_counter(&self, _: &Key, _: &Metadata<'_>) -> Counter {
            Counter::from_arc(Arc::new(Snapshot(self.0.clone())))
        }
        fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
            Gauge::noop()
        }
        fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
            Histogram::from_arc(Arc::new(Snapshot(self.0.clone())))
        }
    }

    let watched = Arc::new(OnceLock::new());
    let recorder = Snapshots(watched.clone());
    let pacer = metrics::with_local_recorder(&recorder, || pacer(10, 1));
    assert!(watched.set(pacer.clone()).is_ok());
    // On a thread of its own, so a deadlock fails the test instead of hanging it.
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        assert!(pacer.check(1).unwrap().allowed); // counted
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap();
        rt.block_on(pacer.until_ready(1)).unwrap(); // waited: its lateness recorded
        let _ = done.send(pacer.waiting());
    });
    match finished.recv_timeout(Duration::from_secs(10)) {
        Ok(waiting) => assert_eq!(waiting, 0),
        Err(RecvTimeoutError::Timeout) => {
            panic!("deadlocked: a pacer metric recorded under the pacer's lock")
        }
        Err(RecvTimeoutError::Disconnected) => panic!("the releases' thread panicked"),
    }
}

#[cfg(feature = "metrics")]
#[tokio::test(start_paused = true)]
async fn leaky_queues_sharing_a_pacer_report_their_own_depth() {
    let recorder = support::TestRecorder::default();
    let (mut ingest, mut replay) = metrics::with_local_recorder(&recorder, || {
        let pacer = Pacer::builder(Rate::per_second(10).unwrap())
            .burst(1)
            .name("gateway")
            .build()
            .unwrap();
        let ingest = LeakyQueue::builder(futures::stream::iter(0..5u32), pacer.clone(), 8)
            .name("ingest")
            .build()
            .unwrap();
        let replay = LeakyQueue::builder(futures::stream::iter(0..3u32), pacer, 8)
            .name("replay")
            .build()
            .unwrap();
        (ingest, replay)
    });
    assert_eq!(
        (ingest.name(), replay.name()),
        (Some("ingest"), Some("replay"))
    );
    assert_eq!(ingest.next().await, Some(0));
    assert!(poll!(replay.next()).is_pending()); // drained, waiting behind `ingest`
    let depth = |name: &str| recorder.gauge(&format!("flowgate_pace_queue_depth{{name={name}}}"));
    assert_eq!((depth("ingest"), depth("replay")), (Some(4.0), Some(3.0)));
    assert_eq!(
        depth("gateway").unwrap_or(0.0),
        0.0,
        "the queues do not report under the pacer's name"
    );
    drop((ingest, replay));
}

#[cfg(feature = "metrics")]
#[tokio::test(start_paused = true)]
async fn items_left_in_a_dropped_leaky_queue_are_counted_as_closed() {
    let recorder = support::TestRecorder::default();
    for policy in [Overflow::Backpressure, Overflow::DropNewest] {
        let (seen, hook) = self::recorder();
        let mut queue = metrics::with_local_recorder(&recorder, || {
            let pacer = pacer(10, 1);
            LeakyQueue::builder(futures::stream::iter(0..5u32), pacer, 8)
                .overflow(policy)
                .name(policy.as_str())
                .on_drop(hook)
                .build()
                .unwrap()
        });
        assert_eq!(queue.next().await, Some(0));
        drop(queue);
        assert_eq!(
            *seen.lock().unwrap(),
            [1, 2, 3, 4].map(|x| (x, "discarded")),
            "{policy}: to on_drop"
        );
        let dropped = |p: &str| {
            recorder.counter(&format!(
                "flowgate_pace_dropped_total{{name={policy},policy={p}}}"
            ))
        };
        assert_eq!(dropped("closed"), 4, "{policy}: left items are discarded");
        assert_eq!(dropped("drop_newest"), 0, "{policy}: not an overflow drop");
        assert_eq!(
            recorder.gauge(&format!("flowgate_pace_queue_depth{{name={policy}}}")),
            Some(0.0)
        );
    }
}

#[test]
fn public_types_are_send_and_sync() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Pacer>();
    send_sync::<flowgate::pace::UntilReady>();
    fn is_static<T: 'static>() {}
    is_static::<flowgate::pace::UntilReady>();
    send_sync::<CostError>();
    fn send<T: Send>() {}
    type Items = futures::stream::Iter<std::vec::IntoIter<u8>>;
    send::<flowgate::pace::Leaky<Items, fn(&u8) -> u32>>();
    send::<flowgate::pace::LeakyBuilder<Items, fn(&u8) -> u32>>();
    send::<LeakyQueue<Items>>();
    send::<flowgate::pace::LeakyQueueBuilder<Items>>();
    is_static::<LeakyQueue<Items>>();
}

/// Issue 20: 40,000 waiters dropped newest first (the worst order for a line scanned from
/// the front) each leave in O(1); the line empties and the pacer serves on, on schedule.
#[tokio::test(start_paused = true)]
async fn forty_thousand_waiters_dropped_newest_first() {
    const N: usize = 40_000;
    let p = pacer(10, 1);
    p.until_ready(1).await.unwrap();
    let mut waiting = support::queue_waiters(N, || p.until_ready(1));
    assert_eq!(p.waiting(), N);
    while waiting.pop().is_some() {}
    assert_eq!(p.waiting(), 0);
    let start = Instant::now();
    p.until_ready(1).await.unwrap();
    assert_eq!(start.elapsed(), Duration::from_millis(100));
}

/// A drop hook that panics (on the first item the full queue refuses) panics the poll, with
/// the queue consistent: the item is counted, the depth gauge shows the items queued before
/// the hook ran (set on every way out of a fill, not only at the end of a poll, which the
/// panic skips), and the stream goes on when polled again.
#[cfg(feature = "metrics")]
#[tokio::test(start_paused = true)]
async fn a_panicking_drop_hook_leaves_the_leaky_queue_counted_and_usable() {
    use futures::FutureExt;
    let recorder = support::TestRecorder::default();
    let calls = Arc::new(Mutex::new(0u32));
    let seen = calls.clone();
    let mut queue = metrics::with_local_recorder(&recorder, || {
        LeakyQueue::builder(futures::stream::iter(0..5u32), pacer(10, 1), 2)
            .overflow(Overflow::DropNewest)
            .name("panicky")
            .on_drop(move |x: u32, _: &Dropped| {
                let mut calls = seen.lock().unwrap();
                *calls += 1;
                if *calls == 1 {
                    drop(calls);
                    panic!("hook panics on {x}");
                }
            })
            .build()
            .unwrap()
    });
    let unwound =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| queue.next().now_or_never()));
    assert!(unwound.is_err(), "the hook's panic reached the poll");
    let depth = || recorder.gauge("flowgate_pace_queue_depth{name=panicky}");
    let dropped =
        || recorder.counter("flowgate_pace_dropped_total{name=panicky,policy=drop_newest}");
    assert_eq!((queue.queued(), queue.dropped(), dropped()), (2, 1, 1));
    assert_eq!(
        depth(),
        Some(2.0),
        "the depth gauge shows the 2 queued items"
    );
    assert_eq!(queue.next().await, Some(0));
    assert_eq!((queue.dropped(), dropped()), (3, 3), "3 and 4 dropped too");
    assert_eq!(queue.collect::<Vec<_>>().await, [1]);
    assert_eq!(*calls.lock().unwrap(), 3);
    assert_eq!(depth(), Some(0.0));
}

/// A metrics recorder panicking as the leaky queue counts an item its overflow policy drops
/// keeps that item from neither the hook nor the count: the panic goes on once the hook has
/// it.
#[cfg(feature = "metrics")]
#[tokio::test(start_paused = true)]
async fn a_recorder_panicking_as_the_leaky_queue_counts_a_drop_keeps_the_item_from_the_hook() {
    use futures::FutureExt;
    let recorder = support::TestRecorder::default();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let sink = seen.clone();
    let mut queue = metrics::with_local_recorder(&recorder, || {
        LeakyQueue::builder(futures::stream::iter(0..3u32), pacer(10, 1), 2)
            .overflow(Overflow::DropNewest)
            .name("panicky")
            .on_drop(move |x: u32, _: &Dropped| sink.lock().unwrap().push(x))
            .build()
            .unwrap()
    });
    recorder.panic_on(
        "flowgate_pace_dropped_total{name=panicky,policy=drop_newest}",
        true,
    );
    let unwound =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| queue.next().now_or_never()));
    assert!(unwound.is_err(), "the recorder's panic reached the poll");
    assert_eq!(
        *seen.lock().unwrap(),
        [2],
        "the dropped item reaches the hook"
    );
    assert_eq!(queue.dropped(), 1);
    // The queue dropped with 0 and 1 in it, the recorder panicking on their count.
    recorder.panic_on(
        "flowgate_pace_dropped_total{name=panicky,policy=closed}",
        true,
    );
    let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(queue)));
    assert!(unwound.is_err(), "the recorder's panic goes on");
    assert_eq!(
        *seen.lock().unwrap(),
        [2, 0, 1],
        "the queued items reach the hook"
    );
}

/// An upstream that panics partway through a fill panics the poll, with the depth gauge
/// showing the items queued before it panicked, as `queued()` does (not only set at the end
/// of a poll, which the panic skips); the stream goes on when polled again.
#[cfg(feature = "metrics")]
#[tokio::test(start_paused = true)]
async fn an_upstream_panicking_mid_fill_leaves_the_leaky_queue_depth_right() {
    use futures::FutureExt;
    let recorder = support::TestRecorder::default();
    let upstream = futures::stream::iter(0..5u32).map(|x| {
        assert!(x != 3, "upstream panics on {x}");
        x
    });
    let mut queue = metrics::with_local_recorder(&recorder, || {
        LeakyQueue::builder(upstream, pacer(10, 1), 8)
            .name("upstream")
            .build()
            .unwrap()
    });
    let unwound =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| queue.next().now_or_never()));
    assert!(unwound.is_err(), "the upstream's panic reached the poll");
    let depth = || recorder.gauge("flowgate_pace_queue_depth{name=upstream}");
    assert_eq!(queue.queued(), 3);
    assert_eq!(
        depth(),
        Some(3.0),
        "the depth gauge shows the 3 queued items"
    );
    assert_eq!(queue.collect::<Vec<_>>().await, [0, 1, 2, 4]);
    assert_eq!(depth(), Some(0.0));
}

/// `Pacer::until_ready`'s `# Errors`: `ExceedsCapacity` "also if `set_quota` lowers the
/// burst below `cost` while it waits (the future then leaves the line)".
#[tokio::test(start_paused = true)]
async fn a_waiter_whose_cost_the_burst_no_longer_fits_fails_and_leaves_the_line() {
    let pacer = pacer(10, 4);
    pacer.until_ready(4).await.unwrap();
    let mut big = pin!(pacer.until_ready(3));
    assert!(poll!(big.as_mut()).is_pending());
    let mut behind = pin!(pacer.until_ready(1));
    assert!(poll!(behind.as_mut()).is_pending());
    assert_eq!(pacer.waiting(), 2);
    pacer.set_quota(Quota::new(Rate::per_second(10).unwrap(), 2).unwrap());
    assert_eq!(
        big.await,
        Err(CostError::ExceedsCapacity {
            cost: 3,
            capacity: 2
        })
    );
    assert_eq!(pacer.waiting(), 1, "it left the line");
    behind.await.unwrap();
    assert_eq!(pacer.waiting(), 0);
}

/// The pace module's metrics: `flowgate_pace_released_total` counts units of cost ("the
/// costs summed under `leaky_cost`"), an item above the burst included (paid in chunks).
#[cfg(feature = "metrics")]
#[tokio::test(start_paused = true)]
async fn released_total_counts_units_of_cost_for_items_paid_in_chunks() {
    let recorder = support::TestRecorder::default();
    let pacer = metrics::with_local_recorder(&recorder, || {
        Pacer::builder(Rate::per_second(10).unwrap())
            .burst(2)
            .name("chunks")
            .build()
            .unwrap()
    });
    let n = futures::stream::iter([5u32, 0, 1])
        .leaky_cost(pacer, |c| *c)
        .count()
        .await;
    assert_eq!(n, 3);
    assert_eq!(
        recorder.counter("flowgate_pace_released_total{name=chunks}"),
        6
    );
}

/// A `leaky_cost` stream dropped partway through paying for an item above the burst: the
/// chunks it paid stay counted as released ("a unit counts when the pacer lets it through,
/// taking it from the bucket"), they are not given back (the pacer's next user waits
/// behind them), and the item itself is counted as dropped, `policy="closed"`.
#[cfg(feature = "metrics")]
#[tokio::test(start_paused = true)]
async fn an_item_dropped_partway_through_its_chunks_keeps_them_released() {
    let recorder = support::TestRecorder::default();
    // Cost 5 over a burst of 2: chunks of 1. The full bucket pays two at once, the third
    // is due 100 ms later.
    let (pacer, mut s) = metrics::with_local_recorder(&recorder, || {
        let pacer = Pacer::builder(Rate::per_second(10).unwrap())
            .burst(2)
            .name("partial")
            .build()
            .unwrap();
        let s = futures::stream::iter([5u32]).leaky_cost(pacer.clone(), |c| *c);
        (pacer, s)
    });
    assert!(poll!(s.next()).is_pending());
    drop(s);
    assert_eq!(
        recorder.counter("flowgate_pace_released_total{name=partial}"),
        2
    );
    assert_eq!(
        recorder.counter("flowgate_pace_dropped_total{name=partial,policy=closed}"),
        1
    );
    // The two units were spent: the next one is due when the schedule says, not at once.
    let d = pacer.check(1).unwrap();
    assert!(!d.allowed);
    assert_eq!(d.retry_after, Duration::from_millis(100));
}

/// The slowest rate a pacer takes, one unit per `u64::MAX` ns (about 584 years): the waits
/// it computes are taken as a century before they are added to an `Instant`, so a waiter
/// (and the one watching it from behind) waits without panicking on any platform.
#[tokio::test(start_paused = true)]
async fn a_wait_of_584_years_waits_without_overflow() {
    let rate = Rate::per(1, Duration::from_nanos(u64::MAX)).unwrap();
    let pacer = Pacer::builder(rate).burst(1).build().unwrap();
    pacer.until_ready(1).await.unwrap();
    let mut head = pin!(pacer.until_ready(1));
    let mut behind = pin!(pacer.until_ready(1));
    assert!(poll!(head.as_mut()).is_pending());
    assert!(poll!(behind.as_mut()).is_pending());
    tokio::time::advance(Duration::from_secs(365 * 24 * 60 * 60)).await;
    assert!(poll!(head.as_mut()).is_pending());
    assert!(poll!(behind.as_mut()).is_pending());
    assert_eq!(pacer.waiting(), 2);
}

/// `pause_until` compared when the bucket is full again before and after the pause, and
/// those times saturate at `Duration::MAX` (about 585 billion years): with a burst whose
/// refill takes longer than that (one unit per `u64::MAX` ns, a burst of 2^32 − 1), both
/// read `Duration::MAX`, the pause looked no later than the schedule, and was dropped: the
/// next unit stayed due at 584 years, not at the 1 000 the pause asked for.
#[tokio::test(start_paused = true)]
async fn a_pause_past_the_next_unit_holds_with_the_longest_burst() {
    let rate = Rate::per(1, Duration::from_nanos(u64::MAX)).unwrap();
    let pacer = Pacer::builder(rate).burst(u32::MAX).build().unwrap();
    assert!(pacer.check(u32::MAX).unwrap().allowed);
    let d = pacer.check(1).unwrap();
    assert_eq!(
        d.retry_after,
        Duration::from_nanos(u64::MAX),
        "the next unit"
    );
    let thousand_years = Duration::from_secs(1_000 * 365 * 24 * 60 * 60);
    pacer.pause_until(Instant::now() + thousand_years);
    let d = pacer.check(1).unwrap();
    assert!(!d.allowed);
    assert_eq!(
        d.retry_after, thousand_years,
        "nothing passes before the pause ends"
    );
}

/// `pause_until` an instant before the pacer was built holds it as the docs say of any
/// instant: one unit at that instant, then one per `1 / rate`; a pause that ended before
/// the next unit was due changes nothing. The instant was taken as the pacer's creation
/// (time counted from there stopped at zero), so a full bucket of 5 at 10/s was left
/// with 1 unit, not 5, by a pause that had ended 1 s before, and with 1, not 3, by one
/// that had ended 200 ms before. (`AdaptivePacer` pauses until such instants: a server's
/// allowance of `r` units is a pause that ended `r − 1` units ago.)
#[tokio::test(start_paused = true)]
async fn a_pause_that_ended_before_the_pacer_was_built_counts_from_its_end() {
    let ms = Duration::from_millis;
    tokio::time::advance(Duration::from_secs(10)).await;
    for (ended, units) in [(ms(1_000), 5), (ms(200), 3)] {
        let p = pacer(10, 5);
        p.pause_until(Instant::now() - ended);
        let d = p.check(units).unwrap();
        assert!(d.allowed, "{units} units {ended:?} after the pause: {d:?}");
        assert!(!p.check(1).unwrap().allowed);
    }
}

/// `Pacer::waiting`: "every one in line, those stepped over included".
#[tokio::test(start_paused = true)]
async fn waiting_counts_a_waiter_that_was_stepped_over() {
    let pacer = pacer(10, 1);
    pacer.until_ready(1).await.unwrap();
    let mut stalled = pin!(pacer.until_ready(1));
    assert!(poll!(stalled.as_mut()).is_pending());
    let behind = tokio::spawn({
        let pacer = pacer.clone();
        async move { pacer.until_ready(1).await }
    });
    tokio::task::yield_now().await;
    assert_eq!(pacer.waiting(), 2);
    // The first waiter's turn comes at 100 ms; unclaimed for 10 ms, it is stepped over.
    behind.await.unwrap().unwrap();
    assert_eq!(pacer.waiting(), 1, "the stalled waiter keeps its place");
    stalled.await.unwrap();
    assert_eq!(pacer.waiting(), 0);
}

/// `flowgate_pace_lateness_seconds` is "how late waiting items were released". A waiter that
/// comes to the head of the line with its turn already past (its task polled it late) is
/// released at once, without sleeping on a timer first: it was not recorded at all, so
/// the histogram missed the lateness of a busy executor, the very thing it is there for.
#[cfg(feature = "metrics")]
#[tokio::test(start_paused = true)]
async fn a_waiter_polled_after_its_turn_records_its_lateness() {
    let recorder = support::TestRecorder::default();
    let pacer = metrics::with_local_recorder(&recorder, || {
        Pacer::builder(Rate::per_second(10).unwrap())
            .burst(1)
            .name("late")
            .build()
            .unwrap()
    });
    pacer.until_ready(1).await.unwrap(); // t = 0, at once: no wait, no sample
    let mut first = pin!(pacer.until_ready(1)); // due at 100 ms
    let mut second = pin!(pacer.until_ready(1)); // behind it: due at 200 ms
    assert!(poll!(first.as_mut()).is_pending());
    assert!(poll!(second.as_mut()).is_pending());
    first.await.unwrap(); // released at 100 ms, on time
    // The second one's task is busy until 250 ms: released then, 50 ms late.
    tokio::time::advance(Duration::from_millis(150)).await;
    assert_eq!(poll!(second.as_mut()), Poll::Ready(Ok(())));
    assert_eq!(
        recorder.samples("flowgate_pace_lateness_seconds{name=late}"),
        [0.0, 0.05]
    );
}

/// One waiter of [`line_holds_under_random_use`]: its order of arrival, its wait and
/// cost, and whether its task polls it (else it is left alone once queued, as in a busy
/// `select!` loop).
struct Waiter {
    arrived: usize,
    wait: std::pin::Pin<Box<flowgate::pace::UntilReady>>,
    cost: u32,
    polled: bool,
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// Random use of one pacer: waiters that are polled and waiters left alone once
    /// queued, waiters dropped from anywhere in the line, `check`s, time passing. Over
    /// every unit taken (by `until_ready` or `check`), guarantee (a) holds, and no polled
    /// waiter passes while one that arrived before it and is polled still waits (FIFO;
    /// only the ones left alone are stepped over).
    #[test]
    fn line_holds_under_random_use(
        ops in prop::collection::vec((0u8..6, 1u32..=4, 0u64..40), 1..120),
        burst in 4u32..=6,
        count in 1u32..=50,
    ) {
        let rate = Rate::per(count, Duration::from_millis(100)).unwrap();
        let outcome: Result<(), String> = runtime().block_on(async move {
            let pacer = Pacer::builder(rate).burst(burst).build().unwrap();
            let start = Instant::now();
            let at = || start.elapsed().as_nanos() as u64;
            let mut line: Vec<Waiter> = Vec::new();
            let mut taken: Vec<(u64, u32)> = Vec::new();
            for (arrived, (op, cost, ms)) in ops.into_iter().enumerate() {
                match op {
                    0 | 1 => {
                        let mut wait = Box::pin(pacer.until_ready(cost));
                        match poll!(wait.as_mut()) {
                            Poll::Ready(r) => {
                                r.unwrap();
                                taken.push((at(), cost));
                            }
                            Poll::Pending => line.push(Waiter { arrived, wait, cost, polled: op == 0 }),
                        }
                    }
                    2 => {
                        if pacer.check(cost).unwrap().allowed {
                            taken.push((at(), cost));
                        }
                    }
                    3 if !line.is_empty() => {
                        line.remove(ms as usize % line.len());
                    }
                    _ => tokio::time::advance(Duration::from_millis(ms)).await,
                }
                // The polled waiters' tasks run, until none of them passes any more.
                let mut k = 0;
                while k < line.len() {
                    if line[k].polled && let Poll::Ready(r) = poll!(line[k].wait.as_mut()) {
                        r.unwrap();
                        let w = line.remove(k);
                        taken.push((at(), w.cost));
                        if let Some(ahead) = line.iter().find(|o| o.polled && o.arrived < w.arrived) {
                            return Err(format!("{} passed before {}, which came first", w.arrived, ahead.arrived));
                        }
                        k = 0;
                        continue;
                    }
                    k += 1;
                }
            }
            check_bound(rate, burst, &taken)
        });
        outcome.map_err(TestCaseError::fail)?;
    }
}

/// A first waiter whose task stopped polling it, with nobody behind it to step over it
/// and nobody else using the pacer, leaves its turn unclaimed as one stepped over does: it
/// must not count as use of an adaptive rate ("never growing unused") while responses to
/// what was sent before come back. It counted, and the rate climbed from 100/s to the
/// 1 000/s ceiling in 30 s of one response a second.
#[tokio::test(start_paused = true)]
async fn a_lone_stalled_waiter_does_not_make_an_adaptive_rate_grow() {
    let adaptive = flowgate::pace::AdaptivePacer::builder(Rate::per_second(1_000).unwrap())
        .initial(Rate::per_second(100).unwrap())
        .build()
        .unwrap();
    let pacer = adaptive.pacer().clone();
    let mut stalled = Box::pin(futures::stream::iter(0..u32::MAX).leaky_with(pacer));
    while poll!(stalled.next()).is_ready() {}
    assert_eq!(
        adaptive.pacer().waiting(),
        1,
        "first in line, then left alone"
    );
    for _ in 0..30 {
        adaptive.on_success();
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let status = adaptive.status();
    assert!(status.rate_per_second <= 100.0 + 1e-9, "{status:?}");
    // Polled again, it is served.
    assert!(stalled.next().await.is_some());
}

/// A pacer named `name` at 10/s with `burst`, whose metrics `recorder` records.
#[cfg(feature = "metrics")]
fn recorded_pacer(recorder: &support::TestRecorder, name: &str, burst: u32) -> Pacer {
    metrics::with_local_recorder(recorder, || {
        Pacer::builder(Rate::per_second(10).unwrap())
            .burst(burst)
            .name(name)
            .build()
            .unwrap()
    })
}

/// A metrics recorder is user code: one that panics as a pacer records a release (its
/// count, or the lateness of a waiter that slept) panics the poll that passed. The units
/// were taken: polled again, the wait is through at once, and the release is counted even
/// when the lateness panicked; an item above the burst (`leaky_cost`) pays only the chunks
/// it has not paid. (The wait took its units again, a unit period later, the item paid its
/// whole cost again from the start, and a lateness that panicked skipped the count.)
#[cfg(feature = "metrics")]
#[tokio::test(start_paused = true)]
async fn a_recorder_panicking_on_a_release_neither_charges_again_nor_skips_its_count() {
    use futures::FutureExt;
    use std::panic::AssertUnwindSafe;

    let recorder = support::TestRecorder::default();
    let pacer = recorded_pacer(&recorder, "released", 1);
    let released = "flowgate_pace_released_total{name=released}";
    let lateness = "flowgate_pace_lateness_seconds{name=released}";
    let start = Instant::now();
    recorder.panic_once_on(released);
    let mut first = pacer.until_ready(1);
    let unwound = std::panic::catch_unwind(AssertUnwindSafe(|| (&mut first).now_or_never()));
    assert!(unwound.is_err() && recorder.panicked_once(released));
    assert_eq!(
        (&mut first).now_or_never(),
        Some(Ok(())),
        "the unit it took is its own"
    );
    // A waiter that slept: its lateness is recorded before its release is counted.
    recorder.panic_once_on(lateness);
    let mut second = pacer.until_ready(1);
    let unwound = AssertUnwindSafe(&mut second).catch_unwind().await;
    assert!(unwound.is_err() && recorder.panicked_once(lateness));
    assert_eq!(start.elapsed(), Duration::from_millis(100));
    assert_eq!(recorder.counter(released), 1, "the second release counted");
    assert_eq!((&mut second).now_or_never(), Some(Ok(())));
    // Each took one unit: the next is due at 200 ms.
    pacer.until_ready(1).await.unwrap();
    assert_eq!(start.elapsed(), Duration::from_millis(200));
    assert_eq!(recorder.counter(released), 2);

    // 4 units in chunks of 1 (half the burst): at 0 and 0 (the full bucket), 100, 200 ms.
    let chunks = "flowgate_pace_released_total{name=chunks}";
    let mut items =
        futures::stream::iter([4u32, 1]).leaky_cost(recorded_pacer(&recorder, "chunks", 2), |c| *c);
    let start = Instant::now();
    recorder.panic_once_on(chunks);
    let unwound = AssertUnwindSafe(items.next()).catch_unwind().await;
    assert!(unwound.is_err() && recorder.panicked_once(chunks));
    assert_eq!(items.next().await, Some(4));
    assert_eq!(start.elapsed(), Duration::from_millis(200));
    assert_eq!(items.next().await, Some(1));
    assert_eq!(start.elapsed(), Duration::from_millis(300));
    assert_eq!(
        recorder.counter(chunks),
        4,
        "every unit counted once, but the one whose count panicked"
    );
}
