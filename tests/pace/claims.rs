//! The promises of the pacing docs, checked at their edge values: no runtime needed when
//! nothing waits, the exact rate at 1/s, the longest period, `size_hint` and
//! `FusedStream` of the adapters, a queue of one item, a sink asking its inner sink for
//! room before the pacer, the feedback of an `AdaptivePacer` without a runtime, items of the
//! whole burst losing the timer's lateness.

use super::*;
use crate::support::drain_checking_hints;

use futures::Stream;
use futures::stream::FusedStream;

/// `Pacer::check` "never waits and needs no runtime"; `until_ready`, a `leaky` stream, a
/// `leaky_queue` and a `leaky_sink` need one only when they have to wait.
#[test]
fn nothing_needs_a_runtime_until_something_waits() {
    let pacer = Pacer::new(Rate::per_second(1).unwrap()); // burst 2
    assert!(pacer.check(1).unwrap().allowed);
    futures::executor::block_on(pacer.until_ready(1)).unwrap();
    let refused = pacer.check(1).unwrap();
    assert!(!refused.allowed);
    assert!(refused.retry_after <= Duration::from_secs(1));

    let fresh = Pacer::new(Rate::per_second(1).unwrap());
    let out: Vec<u32> =
        futures::executor::block_on(futures::stream::iter(0..2).leaky_with(fresh).collect());
    assert_eq!(out, [0, 1], "the burst passes at once");

    // The queue and the sink too (`FlowStreamExt` and `FlowSinkExt` say so).
    let fresh = Pacer::new(Rate::per_second(1).unwrap());
    let queue = futures::stream::iter(0..2).leaky_queue(fresh, nz(4), Overflow::Backpressure);
    let out: Vec<u32> = futures::executor::block_on(queue.collect());
    assert_eq!(out, [0, 1], "the burst leaves the queue at once");
    let (tx, rx) = flowgate::channel::bounded::<u32>(4).unwrap();
    let mut sink = tx.leaky_sink(Rate::per_second(1).unwrap());
    futures::executor::block_on(async {
        sink.send(0).await.unwrap();
        sink.send(1).await.unwrap();
    });
    assert_eq!(rx.len(), 2, "the burst is sent at once");
}

/// "the long-run rate is exact from 1/s": with the default burst (2) at 1/s, two leave
/// at once, then one each second, to the nanosecond.
#[tokio::test(start_paused = true)]
async fn one_per_second_is_exact_with_the_default_burst() {
    let pacer = Pacer::new(Rate::per_second(1).unwrap());
    assert_eq!(pacer.quota().burst_size(), 2);
    let rel = releases(pacer, vec![1; 62]).await;
    let at: Vec<u64> = rel.iter().map(|r| r.0).collect();
    assert_eq!(at[..4], [0, 0, 1_000_000_000, 2_000_000_000]);
    assert_eq!(at[61], 60_000_000_000);
}

/// The longest period a `Rate` takes (`u64::MAX` ns, about 584 years): the burst passes,
/// the next unit is refused for the whole period, and a wait for it waits (no overflow).
#[tokio::test(start_paused = true)]
async fn the_longest_period_waits_without_overflow() {
    let rate = Rate::per(1, Duration::from_nanos(u64::MAX)).unwrap();
    let pacer = Pacer::new(rate);
    assert_eq!(pacer.quota().burst_size(), 2);
    assert!(pacer.check(2).unwrap().allowed);
    let refused = pacer.check(1).unwrap();
    assert!(!refused.allowed);
    assert_eq!(refused.retry_after, Duration::from_nanos(u64::MAX));
    let mut wait = Box::pin(pacer.until_ready(1));
    assert!(poll!(wait.as_mut()).is_pending());
    assert_eq!(pacer.waiting(), 1);
    drop(wait);
    assert_eq!(pacer.waiting(), 0);
}

/// `Leaky`: the bounds count the item held for the pacer; the stream ends while an item
/// waits (the item still comes); `FusedStream` once the inner one ended and nothing is held.
#[tokio::test(start_paused = true)]
async fn leaky_bounds_count_the_held_item_and_it_fuses() {
    let mut s = futures::stream::iter(0..3u32)
        .fuse()
        .leaky_with(pacer(10, 1));
    assert_eq!(s.size_hint(), (3, Some(3)));
    assert_eq!(s.next().await, Some(0));
    assert!(poll!(s.next()).is_pending(), "1 waits for the pacer");
    assert_eq!(s.size_hint(), (2, Some(2)), "the held item and one more");
    assert!(!s.is_terminated());
    let rest = drain_checking_hints(&mut s).await;
    assert_eq!(rest, [1, 2]);
    assert!(s.is_terminated());
    assert_eq!(s.size_hint(), (0, Some(0)));
}

/// `LeakyQueue`: under every policy and at a capacity of 1, what comes lies within the
/// bounds at every poll, and the queue fuses at the end.
#[tokio::test(start_paused = true)]
async fn leaky_queue_bounds_hold_under_every_policy() {
    for policy in [
        Overflow::Backpressure,
        Overflow::DropNewest,
        Overflow::DropOldest,
        Overflow::Reject,
    ] {
        for capacity in [1, 3] {
            let upstream = futures::stream::iter(0..8u32);
            let mut queue = upstream.leaky_queue(pacer(100, 1), nz(capacity), policy);
            let out = drain_checking_hints(&mut queue).await;
            let dropped = usize::try_from(queue.dropped()).unwrap();
            assert_eq!(
                out.len() + dropped,
                8,
                "{policy} at {capacity}: nothing lost"
            );
            assert!(queue.is_terminated(), "{policy} at {capacity}");
        }
    }
}

/// A queue of one item under `DropOldest` keeps the newest: a burst of ten leaves only its
/// last item, nine are dropped (and counted).
#[tokio::test(start_paused = true)]
async fn a_queue_of_one_under_drop_oldest_keeps_the_newest() {
    let (tx, rx) = futures::channel::mpsc::unbounded();
    for i in 0..10u32 {
        tx.unbounded_send(i).unwrap();
    }
    drop(tx);
    let mut queue = rx.leaky_queue(pacer(10, 1), nz(1), Overflow::DropOldest);
    assert_eq!(queue.next().await, Some(9));
    assert_eq!(queue.next().await, None);
    assert_eq!(queue.dropped(), 9);
}

/// `LeakySink`: `poll_ready` asks the inner sink for room first, so a full inner sink takes
/// no unit from the pacer (nor a place in its line); an admission taken by `poll_ready` and
/// not used before the sink is dropped is spent, not given back.
#[tokio::test(start_paused = true)]
async fn a_sink_asks_for_room_first_and_an_unused_admission_is_spent() {
    let pacer = pacer(10, 1);
    let (tx, mut rx) = flowgate::channel::bounded::<u32>(1).unwrap();
    tx.try_send(0).unwrap(); // the inner sink is full
    let mut sink = tx.clone().leaky_sink_with(pacer.clone());
    assert!(
        poll!(std::future::poll_fn(|cx| sink.poll_ready_unpin(cx))).is_pending(),
        "the inner sink has no room"
    );
    assert_eq!(pacer.waiting(), 0, "not in the pacer's line");
    assert_eq!(rx.recv().await, Some(0), "no item is lost");
    // Room now, and the unit the full sink did not take (a burst of 1: had it taken one,
    // this one would wait 100 ms).
    assert!(matches!(
        poll!(std::future::poll_fn(|cx| sink.poll_ready_unpin(cx))),
        Poll::Ready(Ok(()))
    ));
    drop(sink);
    let refused = pacer.check(1).unwrap();
    assert!(!refused.allowed, "an admission is not given back");
    assert_eq!(refused.retry_after, Duration::from_millis(100));
}

/// The feedback calls of an `AdaptivePacer` "never wait, and need no runtime", at their
/// edge values: a `Retry-After` of `Duration::MAX` (taken as a century), an allowance of
/// nothing until `Duration::MAX`, a policy of `u64::MAX` per nanosecond and one of 1 per
/// `u64::MAX` seconds.
#[test]
fn adaptive_feedback_needs_no_runtime_at_edge_values() {
    use flowgate::pace::AdaptivePacer;

    let adaptive = AdaptivePacer::builder(Rate::per_second(100).unwrap())
        .build()
        .unwrap();
    adaptive.on_success();
    adaptive.on_policy(u64::MAX, Duration::from_nanos(1));
    adaptive.on_policy(1, Duration::from_secs(u64::MAX));
    adaptive.on_allowance(u64::MAX, Duration::from_nanos(1));
    adaptive.on_allowance(0, Duration::MAX);
    adaptive.on_back_pressure(Some(Duration::MAX));
    adaptive.on_back_pressure(None);
    let status = adaptive.status();
    let century = Duration::from_secs(100 * 365 * 24 * 3_600);
    let paused = status.paused_until.expect("paused");
    let left = paused.saturating_duration_since(Instant::now());
    assert!(
        left <= century + Duration::from_secs(30 * 24 * 3_600),
        "{left:?}"
    );
    assert!(
        left >= century - Duration::from_secs(30 * 24 * 3_600),
        "{left:?}"
    );
    assert!(!adaptive.pacer().check(1).unwrap().allowed, "paused");
}

/// "An item whose cost is above the pacer's burst pays it in successive chunks ... so the
/// rate holds in cost units": with the default burst (1 + ceil(rate × 5 ms)), an item of
/// many bursts leaves when its last unit is due, not before (guarantee (b)) and within one
/// timer tick after, at rates whose burst is not a whole number of milliseconds (3 000/s:
/// 16 units, 5.33 ms; `u32::MAX`/s: 21 474 838 units). Chunks of the whole burst waited
/// each for a full bucket and lost the timer's lateness every time: the item left about
/// 12 % (3 000/s) and 20 % (`u32::MAX`/s) late.
#[tokio::test(start_paused = true)]
async fn an_item_of_many_bursts_leaves_on_time() {
    for (per_second, cost, burst) in [(3_000, 3_000, 16), (u32::MAX, u32::MAX, 21_474_838)] {
        let pacer = Pacer::new(Rate::per_second(per_second).unwrap());
        assert_eq!(pacer.quota().burst_size(), burst);
        let rel = releases(pacer.clone(), vec![cost]).await;
        let at = u128::from(rel[0].0);
        // Due at (cost − burst) / rate seconds.
        let due = u128::from(cost - burst) * 1_000_000_000 / u128::from(per_second);
        assert!(
            at >= due,
            "{per_second}/s: left at {at} ns, due at {due} ns"
        );
        assert!(
            at <= due + 1_000_000,
            "{per_second}/s: left at {at} ns, due at {due} ns"
        );
        assert_eq!(pacer.waiting(), 0);
    }
}

/// "An item of the whole burst ... pays at once ... items of 16 at 3 000/s, the default
/// burst there, leave about 12 % slow. Give such items a burst of at least their largest
/// cost plus `rate × 1 ms` (19 there)": 300 items of 16, each waiting for a full bucket,
/// leave every 6 ms instead of every 5.33 ms; with a burst of 19 the last leaves on time.
#[tokio::test(start_paused = true)]
async fn items_of_the_whole_burst_lose_the_timers_lateness() {
    let rate = Rate::per_second(3_000).unwrap();
    assert_eq!(Pacer::default_quota(rate).burst_size(), 16);
    for (burst, slow) in [(16, true), (19, false)] {
        let pacer = Pacer::builder(rate).burst(burst).build().unwrap();
        let rel = releases(pacer, vec![16; 300]).await;
        // The last item is due when its last unit is: (4 800 − burst) / rate.
        let due = (4_800 - u64::from(burst)) * 1_000_000_000 / 3_000;
        let at = rel.last().unwrap().0;
        assert!(at >= due, "burst {burst}: last at {at} ns, due at {due} ns");
        if slow {
            assert_eq!(at, 299 * 6_000_000, "burst {burst}: one item every 6 ms");
            assert!(at * 100 >= due * 112, "burst {burst}: about 12 % slow");
        } else {
            assert!(
                at <= due + 1_000_000,
                "burst {burst}: last at {at} ns, due at {due} ns"
            );
        }
    }
}
