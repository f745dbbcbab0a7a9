//! Bulkheads: `max_in_flight` under stress and cancellation, the waiting room, timeouts, the
//! critical reserve, resizing, FIFO order, panics, and the stream adapters.

mod support;

#[path = "bulkhead/claims.rs"]
mod claims;
#[path = "bulkhead/journey.rs"]
mod journey;
#[path = "bulkhead/stats.rs"]
mod stats;

use std::panic::AssertUnwindSafe;
use std::pin::pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flowgate::bulkhead::{
    AcquireError, Bulkhead, BulkheadMap, BulkheadMapUnordered, BulkheadSpawnMap, Priority,
};
use flowgate::{ConfigErrorKind, Dropped, FlowStreamExt};
use futures::{FutureExt, Stream, StreamExt, poll};
use tokio::time::{Instant, advance, sleep};

/// Tracks how many holders are inside at once, and the most ever seen.
#[derive(Default, Clone)]
struct Gauge {
    now: Arc<AtomicUsize>,
    max: Arc<AtomicUsize>,
}

impl Gauge {
    fn enter(&self) {
        let n = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.max.fetch_max(n, Ordering::SeqCst);
    }
    fn exit(&self) {
        self.now.fetch_sub(1, Ordering::SeqCst);
    }
    /// Enter now, exit when the guard drops (also when cancelled).
    fn inside(&self) -> impl Drop + '_ {
        struct Exit<'a>(&'a Gauge);
        impl Drop for Exit<'_> {
            fn drop(&mut self) {
                self.0.exit();
            }
        }
        self.enter();
        Exit(self)
    }

    fn max(&self) -> usize {
        self.max.load(Ordering::SeqCst)
    }
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[test]
fn bad_configuration_is_a_config_error() {
    let e = Bulkhead::new(0).unwrap_err();
    assert_eq!(
        (e.field(), e.kind()),
        ("bulkhead.max_in_flight", ConfigErrorKind::Zero)
    );
    let e = Bulkhead::new(1 << 31).unwrap_err();
    assert_eq!(e.kind(), ConfigErrorKind::TooLarge);
    let e = Bulkhead::builder(4)
        .critical_reserve(4)
        .build()
        .unwrap_err();
    assert_eq!(
        (e.field(), e.kind()),
        ("bulkhead.critical_reserve", ConfigErrorKind::Inconsistent)
    );
    assert_eq!(
        e.to_string(),
        "invalid bulkhead.critical_reserve: a reserve of 4 out of 4 permits leaves none for normal work"
    );
    let e = Bulkhead::builder(4)
        .wait_timeout(Duration::ZERO)
        .build()
        .unwrap_err();
    assert_eq!(e.field(), "bulkhead.wait_timeout");
    let b = Bulkhead::builder(4).critical_reserve(2).build().unwrap();
    let e = b.set_max_in_flight(0).unwrap_err();
    assert_eq!(
        (e.field(), e.kind()),
        ("bulkhead.max_in_flight", ConfigErrorKind::Zero)
    );
    assert_eq!(
        b.set_max_in_flight(2).unwrap_err().kind(),
        ConfigErrorKind::Inconsistent
    );
    assert_eq!(b.max_in_flight(), 4);
}

/// `set_max_in_flight` at or below the critical reserve is refused in the caller's terms:
/// the value it was given (`bulkhead.max_in_flight`), against the reserve set at build time,
/// and what to give instead. It used to name `bulkhead.critical_reserve`, a setting the
/// caller did not touch, and say "a reserve of 2 out of 2 permits".
#[test]
fn set_max_in_flight_at_or_below_the_reserve_names_the_value_given() {
    let b = Bulkhead::builder(4).critical_reserve(2).build().unwrap();
    for asked in [1, 2] {
        let e = b.set_max_in_flight(asked).unwrap_err();
        assert_eq!(
            (e.field(), e.kind()),
            ("bulkhead.max_in_flight", ConfigErrorKind::Inconsistent)
        );
        assert_eq!(
            e.to_string(),
            format!(
                "invalid bulkhead.max_in_flight: {asked} is not above the critical reserve of 2, which would leave no permit for normal work; set it to 3 or more"
            )
        );
    }
    assert_eq!(b.max_in_flight(), 4);
    b.set_max_in_flight(3).unwrap();
}

#[tokio::test(start_paused = true)]
async fn never_more_than_max_in_flight_under_random_durations_and_cancellations() {
    let b = Bulkhead::builder(5)
        .wait_timeout(Duration::from_millis(40))
        .build()
        .unwrap();
    let gauge = Gauge::default();
    let mut tasks = Vec::new();
    for t in 0..60u64 {
        let (b, gauge) = (b.clone(), gauge.clone());
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng(t * 31 + 7);
            for _ in 0..20 {
                let work = Duration::from_millis(rng.next() % 20);
                let patience = Duration::from_millis(rng.next() % 30);
                // Cancel the whole acquire-and-work at a random point.
                let _ = tokio::time::timeout(patience, async {
                    if let Ok(_permit) = b.acquire().await {
                        let _inside = gauge.inside();
                        sleep(work).await;
                    }
                })
                .await;
                sleep(Duration::from_millis(rng.next() % 5)).await;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(gauge.max(), 5, "the limit is reached and never exceeded");
    assert_eq!(b.in_flight(), 0, "every permit came back");
    assert_eq!(b.waiting(), 0, "every waiting-room place came back");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn never_more_than_max_in_flight_on_two_threads() {
    let b = Bulkhead::new(3).unwrap();
    let gauge = Gauge::default();
    let inside = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for t in 0..16u64 {
        let (b, gauge, inside) = (b.clone(), gauge.clone(), inside.clone());
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng(t + 1);
            for _ in 0..300 {
                let acquire = b.acquire();
                let permit = if rng.next().is_multiple_of(4) {
                    // Poll once, then cancel if it has to wait.
                    let mut acquire = pin!(acquire);
                    match poll!(acquire.as_mut()) {
                        std::task::Poll::Ready(p) => p.unwrap(),
                        std::task::Poll::Pending => continue,
                    }
                } else {
                    acquire.await.unwrap()
                };
                let n = inside.fetch_add(1, Ordering::SeqCst) + 1;
                gauge.max.fetch_max(n, Ordering::SeqCst);
                tokio::task::yield_now().await;
                inside.fetch_sub(1, Ordering::SeqCst);
                drop(permit);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert!(gauge.max() <= 3, "max in flight {}", gauge.max());
    assert_eq!(b.in_flight(), 0);
    assert_eq!(b.waiting(), 0);
}

#[tokio::test]
async fn a_full_waiting_room_sheds_at_once() {
    let b = Bulkhead::builder(1).max_waiting(2).build().unwrap();
    let held = b.acquire().await.unwrap();
    let mut w1 = Box::pin(b.acquire());
    let mut w2 = Box::pin(b.acquire());
    assert!(poll!(w1.as_mut()).is_pending());
    assert!(poll!(w2.as_mut()).is_pending());
    assert_eq!(b.waiting(), 2);
    assert_eq!(
        b.acquire().await.unwrap_err(),
        AcquireError::WaitingRoomFull
    );
    assert_eq!(b.try_acquire().unwrap_err(), AcquireError::NoPermit);
    drop(held);
    drop(w1.await.unwrap());
    drop(w2.await.unwrap());
    assert_eq!((b.in_flight(), b.waiting()), (0, 0));
}

#[tokio::test(start_paused = true)]
async fn a_wait_times_out() {
    let b = Bulkhead::builder(1)
        .wait_timeout(Duration::from_millis(100))
        .build()
        .unwrap();
    let _held = b.acquire().await.unwrap();
    let start = Instant::now();
    assert_eq!(b.acquire().await.unwrap_err(), AcquireError::TimedOut);
    assert_eq!(start.elapsed(), Duration::from_millis(100));
    assert_eq!(b.waiting(), 0);
}

/// An acquisition with a `wait_timeout` panics when it has to wait outside a tokio runtime
/// (its timer needs one), as documented; a caller that catches the panic holds a future
/// still waiting in the queue. Polled again outside a runtime it panics again, and inside one
/// it times out at the deadline its first wait set. (Its first poll had marked it started
/// before the timer's start panicked, so every later poll took it for a wait without a
/// timer: `Pending` outside a runtime, and in one it waited for ever.)
#[test]
fn an_acquisition_polled_again_after_its_timer_panicked_still_times_out() {
    use std::panic::catch_unwind;

    let b = Bulkhead::builder(1)
        .wait_timeout(Duration::from_millis(100))
        .build()
        .unwrap();
    let _held = b.try_acquire().unwrap();
    let mut waiting = Box::pin(b.acquire());
    let mut poll_outside = || catch_unwind(AssertUnwindSafe(|| waiting.as_mut().now_or_never()));
    assert!(poll_outside().is_err(), "no runtime for the timer");
    assert!(poll_outside().is_err(), "no runtime for the timer, again");
    assert_eq!(b.waiting(), 1, "still in the queue");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    let waited =
        rt.block_on(async { tokio::time::timeout(Duration::from_secs(3600), waiting).await });
    assert_eq!(
        waited.map(|r| r.map(drop)),
        Ok(Err(AcquireError::TimedOut)),
        "timed out, not waiting for an hour"
    );
    assert_eq!(b.waiting(), 0);
    assert_eq!(b.stats().timed_out, 1);
}

#[tokio::test(start_paused = true)]
async fn a_permit_granted_at_the_deadline_wins_over_the_timeout() {
    let b = Bulkhead::builder(1)
        .wait_timeout(Duration::from_millis(100))
        .build()
        .unwrap();
    let held = b.acquire().await.unwrap();
    let mut waiting = pin!(b.acquire());
    assert!(poll!(waiting.as_mut()).is_pending());
    advance(Duration::from_millis(100)).await;
    drop(held); // granted to the waiter before it sees its timer
    assert!(waiting.await.is_ok());
    assert_eq!(b.in_flight(), 0);
}

#[tokio::test]
async fn the_critical_reserve_is_for_critical_work_only() {
    let b = Bulkhead::builder(3).critical_reserve(1).build().unwrap();
    let n1 = b.acquire().await.unwrap();
    let _n2 = b.acquire().await.unwrap();
    assert_eq!(b.try_acquire().unwrap_err(), AcquireError::NoPermit);
    let mut normal = Box::pin(b.acquire());
    assert!(poll!(normal.as_mut()).is_pending());
    let c1 = b.acquire_with(Priority::Critical).await.unwrap();
    assert_eq!(b.in_flight(), 3);
    // Critical waiters are served before normal ones.
    let mut critical = Box::pin(b.acquire_with(Priority::Critical));
    assert!(poll!(critical.as_mut()).is_pending());
    drop(c1);
    assert!(poll!(normal.as_mut()).is_pending());
    let c2 = critical.await.unwrap();
    drop(c2);
    // The freed permit is reserve: normal work still waits until in_flight < 2.
    assert!(poll!(normal.as_mut()).is_pending());
    drop(n1);
    assert!(normal.await.is_ok());
}

#[tokio::test]
async fn critical_work_sheds_the_newest_normal_waiter_from_a_full_room() {
    let b = Bulkhead::builder(1).max_waiting(2).build().unwrap();
    let held = b.acquire().await.unwrap();
    let mut old = Box::pin(b.acquire());
    let mut new = Box::pin(b.acquire());
    assert!(poll!(old.as_mut()).is_pending());
    assert!(poll!(new.as_mut()).is_pending());
    let mut critical = Box::pin(b.acquire_with(Priority::Critical));
    assert!(poll!(critical.as_mut()).is_pending());
    assert_eq!(new.await.unwrap_err(), AcquireError::WaitingRoomFull);
    drop(held);
    drop(critical.await.unwrap());
    assert!(old.await.is_ok());
}

#[tokio::test]
async fn growing_max_in_flight_wakes_waiters_and_shrinking_waits_for_permits() {
    let b = Bulkhead::new(1).unwrap();
    let p1 = b.acquire().await.unwrap();
    let mut w = Box::pin(b.acquire());
    assert!(poll!(w.as_mut()).is_pending());
    b.set_max_in_flight(2).unwrap();
    let p2 = w.await.unwrap();
    assert_eq!(b.in_flight(), 2);

    b.set_max_in_flight(1).unwrap(); // in-flight work is not revoked
    assert_eq!((b.in_flight(), b.max_in_flight()), (2, 1));
    let mut w = Box::pin(b.acquire());
    assert!(poll!(w.as_mut()).is_pending());
    drop(p1); // 1 in flight: still at the limit
    assert!(poll!(w.as_mut()).is_pending());
    drop(p2);
    assert!(w.await.is_ok());
}

#[tokio::test]
async fn a_cancelled_acquire_leaks_no_permit_and_no_place() {
    let b = Bulkhead::builder(1).max_waiting(1).build().unwrap();
    let held = b.acquire().await.unwrap();
    {
        let mut a = pin!(b.acquire());
        assert!(poll!(a.as_mut()).is_pending());
        assert_eq!(b.waiting(), 1);
    }
    assert_eq!(b.waiting(), 0, "the place came back");
    let mut next = Box::pin(b.acquire());
    assert!(
        poll!(next.as_mut()).is_pending(),
        "admitted to the room, not shed"
    );
    drop(held);
    drop(next.await.unwrap());
    assert_eq!(b.in_flight(), 0);
}

#[tokio::test]
async fn a_permit_granted_to_a_waiter_that_is_then_dropped_passes_on() {
    let b = Bulkhead::new(1).unwrap();
    let held = b.acquire().await.unwrap();
    let mut first = Box::pin(b.acquire());
    let mut second = Box::pin(b.acquire());
    assert!(poll!(first.as_mut()).is_pending());
    assert!(poll!(second.as_mut()).is_pending());
    drop(held); // granted to `first`, which never claims it
    assert_eq!(b.in_flight(), 1);
    drop(first);
    let p = second.await.unwrap();
    assert_eq!(b.in_flight(), 1);
    drop(p);
    assert_eq!((b.in_flight(), b.waiting()), (0, 0));
}

#[tokio::test]
async fn waiters_are_served_fifo() {
    let b = Bulkhead::new(1).unwrap();
    let held = b.acquire().await.unwrap();
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..5 {
        let (b, order) = (b.clone(), order.clone());
        tasks.push(tokio::spawn(async move {
            let _p = b.acquire().await.unwrap();
            order.lock().unwrap().push(i);
        }));
        // Let each task queue before the next one starts.
        tokio::task::yield_now().await;
    }
    assert_eq!(b.waiting(), 5);
    drop(held);
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(*order.lock().unwrap(), [0, 1, 2, 3, 4]);
}

#[tokio::test]
async fn close_fails_waiters_and_new_acquisitions_but_not_work_in_flight() {
    let b = Bulkhead::new(1).unwrap();
    let held = b.acquire_owned().await.unwrap();
    let mut w = Box::pin(b.acquire());
    assert!(poll!(w.as_mut()).is_pending());
    b.close();
    assert!(b.is_closed());
    assert_eq!(w.await.unwrap_err(), AcquireError::Closed);
    assert_eq!(b.acquire().await.unwrap_err(), AcquireError::Closed);
    assert_eq!(b.run(async {}).await.unwrap_err(), AcquireError::Closed);
    assert_eq!(b.in_flight(), 1);
    drop(held);
    assert_eq!(b.in_flight(), 0);
}

/// As `close`'s docs say: a permit given back before the close went to the next waiter at
/// once, and that waiter takes it after the close; the waiters behind it fail.
#[tokio::test]
async fn close_leaves_a_permit_already_granted_to_a_waiter() {
    let b = Bulkhead::new(1).unwrap();
    let held = b.try_acquire().unwrap();
    let mut granted = Box::pin(b.acquire());
    let mut behind = Box::pin(b.acquire());
    assert!(poll!(granted.as_mut()).is_pending());
    assert!(poll!(behind.as_mut()).is_pending());
    drop(held);
    b.close();
    let permit = granted.await.expect("granted before the close");
    assert_eq!(behind.await.unwrap_err(), AcquireError::Closed);
    assert_eq!(b.in_flight(), 1);
    drop(permit);
    assert_eq!(b.in_flight(), 0);
}

#[tokio::test(start_paused = true)]
async fn the_ordered_adapter_holds_back_outputs_that_overtake_the_oldest() {
    // Every fourth future is slow; the ones after it finish first and must wait their turn.
    let b = Bulkhead::new(4).unwrap();
    let out: Vec<u64> = futures::stream::iter(0..20u64)
        .bulkhead_map(b.clone(), |x| async move {
            if x % 4 == 0 {
                sleep(Duration::from_millis(50)).await;
            } else {
                tokio::task::yield_now().await;
            }
            x
        })
        .collect()
        .await;
    assert_eq!(out, (0..20).collect::<Vec<_>>());
    assert_eq!(b.in_flight(), 0);
}

#[tokio::test(start_paused = true)]
async fn the_ordered_adapter_yields_in_input_order() {
    let b = Bulkhead::new(4).unwrap();
    let gauge = Gauge::default();
    let g = gauge.clone();
    let out: Vec<u64> = futures::stream::iter(0..40u64)
        .bulkhead_map(b.clone(), move |x| {
            let g = g.clone();
            async move {
                g.enter();
                sleep(Duration::from_millis((x * 37) % 11)).await;
                g.exit();
                x
            }
        })
        .collect()
        .await;
    assert_eq!(out, (0..40).collect::<Vec<_>>());
    assert!(gauge.max() <= 4);
    assert_eq!(b.in_flight(), 0);
}

#[tokio::test(start_paused = true)]
async fn adapters_share_one_bulkhead_across_streams() {
    let b = Bulkhead::new(3).unwrap();
    let gauge = Gauge::default();
    let run = |from: u64| {
        let g = gauge.clone();
        futures::stream::iter(from..from + 30)
            .bulkhead_map_unordered(b.clone(), move |x| {
                let g = g.clone();
                async move {
                    g.enter();
                    sleep(Duration::from_millis(x % 7 + 1)).await;
                    g.exit();
                    x
                }
            })
            .collect::<Vec<_>>()
    };
    let (a, c) = tokio::join!(run(0), run(100));
    assert_eq!((a.len(), c.len()), (30, 30));
    assert_eq!(
        gauge.max(),
        3,
        "the two streams together use exactly the limit"
    );
    assert_eq!(b.in_flight(), 0);
}

#[tokio::test(start_paused = true)]
async fn the_unordered_adapter_mixes_ready_and_waiting_futures() {
    // Even items complete at once (they run in the adapter's own slot), odd ones sleep (they
    // queue behind it): every item comes out once, ready ones first, within the limit.
    let b = Bulkhead::new(4).unwrap();
    let gauge = Gauge::default();
    let g = gauge.clone();
    let out: Vec<u64> = futures::stream::iter(0..40u64)
        .bulkhead_map_unordered(b.clone(), move |x| {
            let g = g.clone();
            async move {
                g.enter();
                if x % 2 == 1 {
                    sleep(Duration::from_millis(10 + x)).await;
                }
                g.exit();
                x
            }
        })
        .collect()
        .await;
    let mut sorted = out.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, (0..40).collect::<Vec<_>>());
    assert!(
        gauge.max() <= 4,
        "at most the limit in flight: {}",
        gauge.max()
    );
    assert_eq!(out[0], 0, "a ready future is yielded at once");
    assert_eq!(b.in_flight(), 0);
}

#[test]
fn a_mapped_future_that_panicked_is_not_polled_again() {
    // The panicking future sits in the adapter's slot; after the panic is caught the adapter
    // goes on with the other items instead of polling the dead future again.
    let b = Bulkhead::new(2).unwrap();
    let mut stream = Box::pin(futures::stream::iter(0..3u32).bulkhead_map_unordered(
        b.clone(),
        |x| async move {
            assert_ne!(x, 0, "boom");
            x
        },
    ));
    let first = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        futures::executor::block_on(stream.next())
    }));
    assert!(first.is_err());
    let rest: Vec<u32> = futures::executor::block_on(stream.collect());
    assert_eq!(rest, [1, 2]);
    assert_eq!(b.in_flight(), 0);
}

#[tokio::test]
async fn an_adapter_is_never_shed_and_does_not_fill_the_waiting_room() {
    let b = Bulkhead::builder(1).max_waiting(1).build().unwrap();
    let held = b.acquire().await.unwrap();
    let mut out = Box::pin(
        futures::stream::iter(0..5u32).bulkhead_map_unordered(b.clone(), |x| async move { x }),
    );
    assert!(
        poll!(out.next()).is_pending(),
        "the adapter waits for a permit"
    );
    // The adapter's wait is outside the room: a normal acquire still finds a place.
    let mut normal = Box::pin(b.acquire());
    assert!(poll!(normal.as_mut()).is_pending());
    // The room (1) is full: a critical acquire sheds the normal waiter, not the adapter.
    let mut critical = Box::pin(b.acquire_with(Priority::Critical));
    assert!(poll!(critical.as_mut()).is_pending());
    assert_eq!(normal.await.unwrap_err(), AcquireError::WaitingRoomFull);
    drop(held);
    drop(critical.await.unwrap());
    let mut all: Vec<u32> = out.collect().await;
    all.sort_unstable();
    assert_eq!(all, [0, 1, 2, 3, 4], "no input lost");
    assert_eq!((b.in_flight(), b.is_closed()), (0, false));
}

#[tokio::test]
async fn a_caught_panic_in_the_unordered_adapter_returns_its_permit_at_once() {
    let b = Bulkhead::new(1).unwrap();
    let mut stream = Box::pin(futures::stream::iter(0..3u32).bulkhead_map_unordered(
        b.clone(),
        |x| async move {
            assert_ne!(x, 0, "boom");
            x
        },
    ));
    assert!(
        AssertUnwindSafe(stream.next())
            .catch_unwind()
            .await
            .is_err()
    );
    // Limit 1: with the dead future's permit still counted the stream would wait forever.
    let rest = tokio::time::timeout(Duration::from_secs(5), stream.by_ref().collect::<Vec<_>>());
    assert_eq!(rest.await.expect("not stuck"), [1, 2]);
    assert_eq!(b.in_flight(), 0);
}

#[tokio::test]
async fn a_caught_panic_in_the_ordered_adapters_closure_returns_its_permit() {
    let b = Bulkhead::new(1).unwrap();
    // The closure itself panics (not the future it returns), after the permit was taken.
    let mut stream = Box::pin(futures::stream::iter(0..3u32).bulkhead_map(b.clone(), |x| {
        assert_ne!(x, 0, "boom");
        async move { x }
    }));
    assert!(
        AssertUnwindSafe(stream.next())
            .catch_unwind()
            .await
            .is_err()
    );
    assert_eq!(
        b.in_flight(),
        0,
        "no future holds the permit taken for item 0"
    );
    // Limit 1: with that permit still counted the stream would wait forever.
    let rest = tokio::time::timeout(Duration::from_secs(5), stream.by_ref().collect::<Vec<_>>());
    assert_eq!(rest.await.expect("not stuck"), [1, 2]);
    assert_eq!(b.in_flight(), 0);
}

/// A caught panic in a mapped future of the ordered adapter that is not the oldest (it runs
/// behind the adapter's slot, with later futures queued behind it): the outputs after it
/// still come, in input order, and its permit is returned. (The ordered queue waited
/// forever for the output of the future that panicked, holding back every later one.)
#[tokio::test(start_paused = true)]
async fn a_caught_panic_behind_the_oldest_future_of_the_ordered_adapter_loses_no_output() {
    let b = Bulkhead::new(3).unwrap();
    let mut stream = Box::pin(futures::stream::iter(0..6u32).bulkhead_map(
        b.clone(),
        |x| async move {
            if x == 0 {
                sleep(Duration::from_millis(10)).await; // the oldest runs longest
            }
            assert_ne!(x, 1, "boom");
            x
        },
    ));
    let (mut outputs, mut panics) = (Vec::new(), 0);
    loop {
        let next = tokio::time::timeout(Duration::from_secs(5), stream.next());
        match AssertUnwindSafe(next).catch_unwind().await {
            Ok(Ok(Some(x))) => outputs.push(x),
            Ok(Ok(None)) => break,
            Ok(Err(_)) => panic!("stuck after {outputs:?} and {panics} panics"),
            Err(_) => panics += 1,
        }
    }
    assert_eq!((outputs, panics), (vec![0, 2, 3, 4, 5], 1));
    assert_eq!(b.in_flight(), 0);
}

/// A caught panic in the unordered adapter's closure, called for the next item as the
/// permit of a finished future passes straight to it: the finished future's output still
/// comes. (It was dropped by the unwinding poll that was about to yield it: lost for good.)
#[tokio::test(start_paused = true)]
async fn a_caught_panic_in_the_unordered_adapters_closure_loses_no_finished_output() {
    let b = Bulkhead::new(1).unwrap();
    let mut stream = Box::pin(futures::stream::iter(0..3u32).bulkhead_map_unordered(
        b.clone(),
        |x| {
            assert_ne!(x, 1, "boom");
            async move {
                sleep(Duration::from_millis(10)).await;
                x
            }
        },
    ));
    let (mut outputs, mut panics) = (Vec::new(), 0);
    loop {
        let next = tokio::time::timeout(Duration::from_secs(5), stream.next());
        match AssertUnwindSafe(next).catch_unwind().await {
            Ok(Ok(Some(x))) => outputs.push(x),
            Ok(Ok(None)) => break,
            Ok(Err(_)) => panic!("stuck after {outputs:?} and {panics} panics"),
            Err(_) => panics += 1,
        }
    }
    assert_eq!((outputs, panics), (vec![0, 2], 1));
    assert_eq!(b.in_flight(), 0);
}

/// A caught panic in the unordered adapter, of a mapped future or of its closure, returns
/// the permit of the work that is gone before the panic leaves the poll, as the ordered
/// adapter does: a caller of the same bulkhead gets it while the stream is not polled. (It
/// was returned only by the stream's next poll: with a limit of 1, a caller that handles
/// the panic by a call of its own through the bulkhead waited for ever.) The same when the
/// closure panics as a finished future's permit passes to the next item.
#[tokio::test(start_paused = true)]
async fn a_caught_panic_in_the_unordered_adapter_frees_its_permit_before_the_next_poll() {
    for panics_in in ["future", "closure", "closure after an output"] {
        let b = Bulkhead::new(1).unwrap();
        let boom = if panics_in == "closure after an output" {
            1
        } else {
            0
        };
        let mut stream = Box::pin(futures::stream::iter(0..3u32).bulkhead_map_unordered(
            b.clone(),
            move |x| {
                assert!(x != boom || panics_in == "future", "boom");
                async move {
                    assert!(x != boom || panics_in != "future", "boom");
                    sleep(Duration::from_millis(10)).await;
                    x
                }
            },
        ));
        if boom == 1 {
            // 0's output comes; its permit passes to 1, whose closure panics then.
            assert_eq!(stream.next().await, Some(0));
        } else {
            assert!(
                AssertUnwindSafe(stream.next())
                    .catch_unwind()
                    .await
                    .is_err()
            );
        }
        assert_eq!(b.in_flight(), 0, "panic in the {panics_in}");
        assert!(b.try_acquire().is_ok(), "panic in the {panics_in}");
    }
}

/// Dropping a bulkhead adapter drops its futures in flight before it returns their
/// permits, so a future's own drop (its cleanup: a connection closed, a transaction rolled
/// back) still runs under its permit, as it does for the ordered and the spawning adapters.
/// (The unordered adapter returned the permits first: another caller could take one, and
/// on another thread start its call, while that cleanup was still running.)
#[tokio::test]
async fn every_adapter_returns_a_permit_only_after_its_future_is_dropped() {
    /// Notes, when dropped, whether a permit of its bulkhead was free then.
    struct Cleanup(Bulkhead, Arc<Mutex<Vec<bool>>>);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            let free = self.0.try_acquire().is_ok();
            self.1.lock().unwrap().push(free);
        }
    }
    for adapter in ["ordered", "unordered", "spawning"] {
        let b = Bulkhead::new(1).unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (b2, seen2) = (b.clone(), seen.clone());
        let f = move |x: u32| {
            let cleanup = Cleanup(b2.clone(), seen2.clone());
            async move {
                let _cleanup = cleanup;
                std::future::pending::<()>().await;
                x
            }
        };
        let items = futures::stream::iter(0..3u32);
        let mut stream: std::pin::Pin<Box<dyn Stream<Item = u32> + Send>> = match adapter {
            "ordered" => Box::pin(items.bulkhead_map(b.clone(), f)),
            "unordered" => Box::pin(items.bulkhead_map_unordered(b.clone(), f)),
            _ => Box::pin(items.bulkhead_spawn_map(b.clone(), f)),
        };
        assert!(poll!(stream.next()).is_pending());
        tokio::task::yield_now().await; // the spawned task starts
        assert_eq!(b.in_flight(), 1, "{adapter}");
        drop(stream);
        for _ in 0..10 {
            tokio::task::yield_now().await; // the aborted task stops
        }
        assert_eq!(*seen.lock().unwrap(), [false], "{adapter}");
        assert_eq!(b.in_flight(), 0, "{adapter}");
    }
}

#[tokio::test]
async fn an_adapter_gives_back_the_critical_reserve_after_max_in_flight_shrinks() {
    let b = Bulkhead::builder(4).critical_reserve(1).build().unwrap();
    // Normal share 3: the adapter runs three at a time, recycling its permits.
    let mut out = Box::pin(futures::stream::iter(0..1_000u32).bulkhead_map_unordered(
        b.clone(),
        |x| async move {
            tokio::task::yield_now().await;
            x
        },
    ));
    for _ in 0..10 {
        out.next().await.unwrap();
    }
    assert_eq!(b.in_flight(), 3);
    b.set_max_in_flight(3).unwrap(); // normal share 2: one permit must go back to the reserve
    for _ in 0..10 {
        out.next().await.unwrap();
    }
    assert!(b.in_flight() <= 2, "{} in flight", b.in_flight());
    let critical = b.try_acquire_with(Priority::Critical);
    assert!(critical.is_ok(), "the reserve is free: {critical:?}");
}

#[tokio::test]
async fn permits_are_released_when_a_mapped_future_panics() {
    let b = Bulkhead::new(2).unwrap();
    let stream = futures::stream::iter(0..10).bulkhead_map_unordered(b.clone(), |x| async move {
        if x == 3 {
            panic!("mapped future failed");
        }
        tokio::task::yield_now().await;
        x
    });
    let result = AssertUnwindSafe(stream.collect::<Vec<_>>())
        .catch_unwind()
        .await;
    assert!(result.is_err());
    assert_eq!(b.in_flight(), 0);

    let ordered = futures::stream::iter(0..10).bulkhead_map(b.clone(), |x| async move {
        assert_ne!(x, 5, "mapped future failed");
        x
    });
    assert!(
        AssertUnwindSafe(ordered.collect::<Vec<_>>())
            .catch_unwind()
            .await
            .is_err()
    );
    assert_eq!(b.in_flight(), 0);
}

#[tokio::test]
async fn the_spawning_adapter_resumes_panics_and_returns_permits() {
    let b = Bulkhead::new(2).unwrap();
    let stream = futures::stream::iter(0..10).bulkhead_spawn_map(b.clone(), |x| async move {
        assert_ne!(x, 4, "mapped future failed");
        x
    });
    assert!(
        AssertUnwindSafe(stream.collect::<Vec<_>>())
            .catch_unwind()
            .await
            .is_err()
    );
    tokio::task::yield_now().await;
    // Aborted tasks return their permits as they stop.
    for _ in 0..10 {
        if b.in_flight() == 0 {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(b.in_flight(), 0);
}

#[tokio::test(start_paused = true)]
async fn the_spawning_adapter_makes_progress_while_the_consumer_is_busy() {
    let b = Bulkhead::new(4).unwrap();
    let done = Arc::new(AtomicUsize::new(0));
    let d = done.clone();
    let mut stream = pin!(
        futures::stream::iter(0..8).bulkhead_spawn_map(b.clone(), move |x| {
            let d = d.clone();
            async move {
                sleep(Duration::from_millis(10)).await;
                d.fetch_add(1, Ordering::SeqCst);
                x
            }
        })
    );
    assert!(stream.next().await.is_some());
    // The consumer is busy for a while; the tasks in flight finish and free their permits.
    sleep(Duration::from_millis(50)).await;
    assert!(done.load(Ordering::SeqCst) >= 4);
    assert_eq!(
        b.in_flight(),
        0,
        "no permit sits idle while the consumer is busy"
    );
    let rest: Vec<_> = stream.collect().await;
    assert_eq!(rest.len(), 7);

    // The in-poll adapter, by contrast, keeps its permits while the consumer is away.
    let mut stream = pin!(futures::stream::iter(0..8).bulkhead_map_unordered(
        b.clone(),
        |x| async move {
            sleep(Duration::from_millis(10)).await;
            x
        }
    ));
    assert!(stream.next().await.is_some());
    sleep(Duration::from_millis(50)).await;
    // Three finished futures were never polled again, so their permits are still out.
    assert!(b.in_flight() >= 3, "the futures in flight were not polled");
}

/// An output that counts its live instances: made when a mapped future finishes, gone
/// when the consumer drops it.
struct Counted(Gauge);

impl Counted {
    fn new(live: Gauge) -> Counted {
        live.enter();
        Counted(live)
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.exit();
    }
}

/// `bulkhead_spawn_map` over `n` items whose futures finish at once with a [`Counted`].
fn counted_outputs(
    n: u32,
    b: &Bulkhead,
    live: &Gauge,
) -> impl futures::Stream<Item = Counted> + use<> {
    let live = live.clone();
    futures::stream::iter(0..n).bulkhead_spawn_map(b.clone(), move |_| {
        let live = live.clone();
        async move { Counted::new(live) }
    })
}

#[tokio::test(start_paused = true)]
async fn the_spawning_adapter_bounds_finished_outputs_under_a_slow_consumer() {
    let b = Bulkhead::new(16).unwrap();
    let live = Gauge::default();
    let mut stream = pin!(counted_outputs(10_000, &b, &live));
    let mut consumed = 0;
    while let Some(out) = stream.next().await {
        drop(out);
        consumed += 1;
        // A slow consumer: the tasks finish while it sleeps.
        if consumed % 2 == 0 {
            sleep(Duration::from_millis(1)).await;
        } else {
            tokio::task::yield_now().await;
        }
    }
    assert_eq!(consumed, 10_000);
    assert_eq!(live.now.load(Ordering::SeqCst), 0);
    assert!(
        live.max() <= 16,
        "{} finished outputs waited for the consumer; the bound is the limit, 16",
        live.max()
    );
    assert_eq!(b.in_flight(), 0);
}

#[tokio::test(start_paused = true)]
async fn the_spawning_adapter_follows_a_lowered_max_in_flight() {
    let b = Bulkhead::new(8).unwrap();
    let live = Gauge::default();
    let mut stream = pin!(counted_outputs(200, &b, &live));
    drop(stream.next().await);
    b.set_max_in_flight(2).unwrap();
    // Let the outstanding tasks finish, then drain them; from then on at most 2 wait.
    sleep(Duration::from_millis(1)).await;
    for _ in 0..8 {
        drop(stream.next().await);
    }
    live.max
        .store(live.now.load(Ordering::SeqCst), Ordering::SeqCst);
    let mut rest = 0;
    while let Some(out) = stream.next().await {
        drop(out);
        rest += 1;
        sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(rest, 191);
    assert!(
        live.max() <= 2,
        "{} outputs waited under limit 2",
        live.max()
    );
}

#[tokio::test]
async fn closing_the_bulkhead_ends_an_adapter_after_work_in_flight() {
    let b = Bulkhead::new(1).unwrap();
    let (tx, rx) = futures::channel::mpsc::unbounded::<u32>();
    let mut stream = pin!(rx.bulkhead_map_unordered(b.clone(), |x| async move { x }));
    tx.unbounded_send(1).unwrap();
    assert_eq!(stream.next().await, Some(1));
    b.close();
    tx.unbounded_send(2).unwrap();
    assert_eq!(stream.next().await, None);
}

/// Once the bulkhead is closed an adapter pulls nothing more from upstream: an item that
/// arrives after the close (here: the bulkhead closed before the first poll, and closed while
/// the adapter waited on an empty upstream) stays there, neither pulled nor discarded.
#[tokio::test]
async fn an_adapter_pulls_nothing_after_its_bulkhead_closed() {
    async fn check<S: Stream<Item = u32>>(
        adapter: S,
        tx: &futures::channel::mpsc::UnboundedSender<u32>,
        b: &Bulkhead,
        seen: &Seen,
        close_first: bool,
        name: &str,
    ) {
        let mut adapter = Box::pin(adapter);
        if close_first {
            b.close();
        } else {
            tx.unbounded_send(1).unwrap();
            assert_eq!(adapter.next().await, Some(1), "{name}");
            assert!(poll!(adapter.next()).is_pending(), "{name}: upstream empty");
            b.close();
        }
        tx.unbounded_send(2).unwrap();
        assert_eq!(adapter.next().await, None, "{name}: ends");
        assert!(
            seen.lock().unwrap().is_empty(),
            "{name}, close_first={close_first}: pulled and discarded {:?}",
            seen.lock().unwrap()
        );
    }
    for close_first in [true, false] {
        let f = |x: u32| async move { x };
        let (tx, rx) = futures::channel::mpsc::unbounded::<u32>();
        let b = Bulkhead::new(1).unwrap();
        let (seen, hook) = recorder();
        let adapter = BulkheadMap::builder(rx, b.clone(), f)
            .on_drop(hook)
            .build()
            .unwrap();
        check(adapter, &tx, &b, &seen, close_first, "bulkhead_map").await;

        let (tx, rx) = futures::channel::mpsc::unbounded::<u32>();
        let b = Bulkhead::new(1).unwrap();
        let (seen, hook) = recorder();
        let adapter = BulkheadMapUnordered::builder(rx, b.clone(), f)
            .on_drop(hook)
            .build()
            .unwrap();
        check(
            adapter,
            &tx,
            &b,
            &seen,
            close_first,
            "bulkhead_map_unordered",
        )
        .await;

        let (tx, rx) = futures::channel::mpsc::unbounded::<u32>();
        let b = Bulkhead::new(1).unwrap();
        let (seen, hook) = recorder();
        let adapter = BulkheadSpawnMap::builder(rx, b.clone(), f)
            .on_drop(hook)
            .build()
            .unwrap();
        check(adapter, &tx, &b, &seen, close_first, "bulkhead_spawn_map").await;
    }
}

/// What a recording drop hook saw: each item with its reason.
type Seen = Arc<Mutex<Vec<(u32, &'static str)>>>;

/// A drop hook that records each item with its reason.
fn recorder() -> (Seen, impl Fn(u32, &Dropped) + Send + Sync + 'static) {
    let seen = Seen::default();
    let hook = seen.clone();
    let record = move |item: u32, why: &Dropped| hook.lock().unwrap().push((item, why.as_str()));
    (seen, record)
}

/// Each bulkhead adapter, holding item 0 while it waits for the one permit (held
/// elsewhere), hands that item to `on_drop` as `Discarded` when it is dropped or its
/// bulkhead closes; it was dropped unseen. (`into_inner` takes the adapter by value, and an
/// adapter is `!Unpin` once polled, so it cannot be holding an item then.)
#[tokio::test]
async fn an_adapter_hands_the_item_waiting_for_a_permit_to_on_drop() {
    async fn check<S>(adapter: S, b: &Bulkhead, seen: &Seen, close: bool, name: &str)
    where
        S: Stream<Item = u32>,
    {
        let mut adapter = Box::pin(adapter);
        assert!(
            poll!(adapter.next()).is_pending(),
            "{name}: waits for a permit"
        );
        assert!(seen.lock().unwrap().is_empty(), "{name}");
        if close {
            b.close();
            assert_eq!(adapter.next().await, None, "{name}: ends");
        } else {
            drop(adapter);
        }
        assert_eq!(
            *seen.lock().unwrap(),
            [(0, "discarded")],
            "{name}, close={close}: the held item goes to on_drop"
        );
    }
    for close in [false, true] {
        let items = || futures::stream::iter(0..3u32);
        let f = |x: u32| async move { x };

        let b = Bulkhead::new(1).unwrap();
        let _busy = b.acquire().await.unwrap();
        let (seen, hook) = recorder();
        let adapter = BulkheadMap::builder(items(), b.clone(), f)
            .on_drop(hook)
            .build()
            .unwrap();
        check(adapter, &b, &seen, close, "bulkhead_map").await;

        let b = Bulkhead::new(1).unwrap();
        let _busy = b.acquire().await.unwrap();
        let (seen, hook) = recorder();
        let adapter = BulkheadMapUnordered::builder(items(), b.clone(), f)
            .on_drop(hook)
            .build()
            .unwrap();
        check(adapter, &b, &seen, close, "bulkhead_map_unordered").await;

        let b = Bulkhead::new(1).unwrap();
        let _busy = b.acquire().await.unwrap();
        let (seen, hook) = recorder();
        let adapter = BulkheadSpawnMap::builder(items(), b.clone(), f)
            .on_drop(hook)
            .build()
            .unwrap();
        check(adapter, &b, &seen, close, "bulkhead_spawn_map").await;
    }
}

/// An adapter that hands every item to its future, or holds none, hands nothing to
/// `on_drop`.
#[tokio::test]
async fn an_adapter_with_nothing_in_hand_drops_nothing() {
    let b = Bulkhead::new(2).unwrap();
    let (seen, hook) = recorder();
    let out: Vec<u32> =
        BulkheadMap::builder(futures::stream::iter(0..5u32), b, |x| async move { x })
            .on_drop(hook)
            .build()
            .unwrap()
            .collect()
            .await;
    assert_eq!(out, [0, 1, 2, 3, 4]);
    assert!(seen.lock().unwrap().is_empty());
}

/// Once the bulkhead is closed an adapter starts nothing more: its lower bound is the work
/// in flight, not the inner stream's length.
#[tokio::test]
async fn an_adapters_size_hint_counts_no_input_once_the_bulkhead_is_closed() {
    let b = Bulkhead::new(1).unwrap();
    b.close();
    let unordered =
        futures::stream::iter(0..10u32).bulkhead_map_unordered(b.clone(), |x| async move { x });
    let ordered = futures::stream::iter(0..10u32).bulkhead_map(b.clone(), |x| async move { x });
    let spawned =
        futures::stream::iter(0..10u32).bulkhead_spawn_map(b.clone(), |x| async move { x });
    assert_eq!(unordered.size_hint(), (0, Some(0)));
    assert_eq!(ordered.size_hint(), (0, Some(0)));
    assert_eq!(spawned.size_hint(), (0, Some(0)));
    assert_eq!(unordered.count().await, 0);
    assert_eq!(ordered.count().await, 0);
    assert_eq!(spawned.count().await, 0);
}

/// What a user debugging a stall needs to see: a permit and an adapter show their
/// bulkhead (name, permits in flight, the limit, the waiters, closed), and an adapter the
/// item it holds waiting for a permit. (The permits showed `{ .. }`, the adapters neither
/// their bulkhead nor their held item; the bulkhead not its waiters.)
#[test]
fn debug_shows_the_bulkhead_of_a_permit_and_of_an_adapter() {
    use std::task::{Context, Waker};

    let b = Bulkhead::builder(3).name("db").build().unwrap();
    let permit = b.try_acquire().unwrap();
    let owned = b.try_acquire_owned().unwrap();
    let _third = b.try_acquire().unwrap();
    let mut adapter =
        pin!(futures::stream::iter(0..2).bulkhead_map(b.clone(), |i| async move { i }));
    let mut cx = Context::from_waker(Waker::noop());
    assert!(
        adapter.as_mut().poll_next(&mut cx).is_pending(),
        "no permit"
    );
    let parts = [
        "name: Some(\"db\")",
        "in_flight: 3",
        "max_in_flight: 3",
        "waiting: 1",
        "closed: false",
    ];
    let adapter_shown = format!("{adapter:?}");
    for shown in [
        format!("{permit:?}"),
        format!("{owned:?}"),
        format!("{b:?}"),
        adapter_shown.clone(),
    ] {
        for part in parts {
            assert!(shown.contains(part), "{part} in {shown}");
        }
    }
    assert!(adapter_shown.contains("holding: true"), "{adapter_shown}");
}

#[test]
fn public_types_are_send_and_sync() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Bulkhead>();
    send_sync::<flowgate::bulkhead::BulkheadPermit<'static>>();
    send_sync::<flowgate::bulkhead::OwnedBulkheadPermit>();
    send_sync::<flowgate::bulkhead::Acquire<'static>>();
    send_sync::<flowgate::bulkhead::AcquireOwned>();
    send_sync::<AcquireError>();
}

/// A waiter the close refused counts one `closed` refusal whether or not it looks again:
/// one dropped unpolled after the close is counted as one that saw the refusal is (as a
/// shed waiter is), and neither twice.
#[cfg(feature = "metrics")]
#[tokio::test]
async fn a_waiter_closed_out_counts_its_refusal_even_if_dropped_unpolled() {
    let recorder = support::TestRecorder::default();
    let b = metrics::with_local_recorder(&recorder, || {
        Bulkhead::builder(1).name("closing").build().unwrap()
    });
    let closed =
        || recorder.counter("flowgate_bulkhead_rejected_total{name=closing,reason=closed}");
    let _held = b.acquire().await.unwrap();
    let mut seen = Box::pin(b.acquire());
    let mut unseen = Box::pin(b.acquire_owned());
    assert!(poll!(seen.as_mut()).is_pending());
    assert!(poll!(unseen.as_mut()).is_pending());
    b.close();
    assert_eq!(seen.await.unwrap_err(), AcquireError::Closed);
    drop(unseen);
    assert_eq!(closed(), 2, "each refused waiter counted once");
}

/// A metrics recorder is user code: here one that reads the bulkhead's `waiting()` whenever
/// a gauge moves (an exporter snapshotting it), which takes the waiters' lock. The
/// `waiting` and `in_flight` gauges were moved under that lock, so the first acquisition
/// that had to queue deadlocked (and so did a release to a waiter, a resize, a close).
#[cfg(feature = "metrics")]
#[test]
fn the_gauges_are_moved_outside_the_waiters_lock() {
    use std::sync::mpsc::RecvTimeoutError;

    let recorder = support::TestRecorder::default();
    let b = metrics::with_local_recorder(&recorder, || {
        Bulkhead::builder(1).name("snapshots").build().unwrap()
    });
    let exporter = b.clone();
    recorder.on_gauge(move || {
        let _ = exporter.waiting();
    });
    // On a thread of its own, so a deadlock fails the test instead of hanging it.
    let (done, finished) = std::sync::mpsc::channel();
    let bulkhead = b.clone();
    let thread = std::thread::spawn(move || {
        let b = bulkhead;
        let held = b.try_acquire().unwrap();
        let mut waiter = Box::pin(b.acquire());
        let _ = done.send("queued");
        assert!(futures::executor::block_on(async { poll!(waiter.as_mut()) }).is_pending());
        let _ = done.send("released");
        drop(held);
        let permit = futures::executor::block_on(waiter).unwrap();
        let _ = done.send("resized");
        b.set_max_in_flight(2).unwrap();
        drop(permit);
        let mut waiters = vec![Box::pin(b.acquire_owned()), Box::pin(b.acquire_owned())];
        let _held = (
            b.try_acquire_owned().unwrap(),
            b.try_acquire_owned().unwrap(),
        );
        for w in &mut waiters {
            assert!(futures::executor::block_on(async { poll!(w.as_mut()) }).is_pending());
        }
        let _ = done.send("closed");
        b.close();
        let _ = done.send("done");
    });
    let mut reached = "started";
    loop {
        match finished.recv_timeout(Duration::from_secs(10)) {
            Ok("done") => break,
            Ok(step) => reached = step,
            Err(RecvTimeoutError::Timeout) => {
                panic!("deadlocked once {reached}: a gauge moved under the waiters' lock")
            }
            Err(RecvTimeoutError::Disconnected) => panic!("the thread panicked once {reached}"),
        }
    }
    thread.join().unwrap();
    let gauge = |id: &str| recorder.gauge(&format!("flowgate_bulkhead_{id}{{name=snapshots}}"));
    assert_eq!(
        (gauge("waiting"), gauge("in_flight")),
        (Some(0.0), Some(0.0))
    );
    assert_eq!((b.waiting(), b.in_flight()), (0, 0));
}

/// A metrics recorder that panics while an acquisition records its permit in
/// `flowgate_bulkhead_in_flight` unwinds the acquisition after the permit was taken and
/// before anyone held it: the permit was lost for good, the bulkhead one permit short
/// (here the one normal permit: every later acquisition refused), both when the permit was
/// free at once and when it was taken under the lock (a critical one, with a normal
/// waiter queued).
#[cfg(feature = "metrics")]
#[test]
fn a_panicking_recorder_does_not_leak_the_permit_it_records() {
    use std::panic::catch_unwind;

    let recorder = support::TestRecorder::default();
    let b = metrics::with_local_recorder(&recorder, || {
        Bulkhead::builder(2)
            .critical_reserve(1)
            .name("leaky")
            .build()
            .unwrap()
    });
    let in_flight = "flowgate_bulkhead_in_flight{name=leaky}";
    recorder.panic_on(in_flight, true);
    let taken = catch_unwind(AssertUnwindSafe(|| drop(b.try_acquire())));
    assert!(taken.is_err(), "the recorder panicked");
    recorder.panic_on(in_flight, false);
    assert_eq!(b.in_flight(), 0, "free at once: not leaked");
    let held = b.try_acquire().unwrap();
    let mut waiter = Box::pin(b.acquire());
    let polled = futures::executor::block_on(async { poll!(waiter.as_mut()) });
    assert!(polled.is_pending());
    recorder.panic_on(in_flight, true);
    let taken = catch_unwind(AssertUnwindSafe(|| {
        drop(b.try_acquire_with(Priority::Critical))
    }));
    assert!(taken.is_err(), "the recorder panicked");
    recorder.panic_on(in_flight, false);
    assert_eq!(b.in_flight(), 1, "taken under the lock: not leaked");
    drop(held);
    drop(futures::executor::block_on(waiter).unwrap());
    assert_eq!(b.in_flight(), 0);
}

/// A recorder that panics on one of the bulkhead's metrics as the changes worked out under
/// the lock are recorded (here `flowgate_bulkhead_in_flight`, as a grown limit grants two
/// waiters) kept the others from being recorded: `flowgate_bulkhead_waiting` stayed at the
/// two waiters gone for good (its next changes move it from the length it was told), and a
/// refusal could go missing from `flowgate_bulkhead_rejected_total` the same way. Now each
/// change is recorded even if one before it panics; the panic still reaches the caller.
#[cfg(feature = "metrics")]
#[test]
fn a_recorder_panicking_on_one_metric_does_not_lose_the_others() {
    use std::panic::catch_unwind;

    let recorder = support::TestRecorder::default();
    let b = metrics::with_local_recorder(&recorder, || {
        Bulkhead::builder(1).name("moves").build().unwrap()
    });
    let in_flight = "flowgate_bulkhead_in_flight{name=moves}";
    let waiting = "flowgate_bulkhead_waiting{name=moves}";
    let held = b.try_acquire().unwrap();
    let mut first = Box::pin(b.acquire());
    let mut second = Box::pin(b.acquire());
    futures::executor::block_on(async {
        assert!(poll!(first.as_mut()).is_pending());
        assert!(poll!(second.as_mut()).is_pending());
    });
    assert_eq!(recorder.gauge(waiting), Some(2.0));
    recorder.panic_on(in_flight, true);
    let grown = catch_unwind(AssertUnwindSafe(|| b.set_max_in_flight(3).unwrap()));
    assert!(grown.is_err(), "the recorder's panic reached the caller");
    recorder.panic_on(in_flight, false);
    assert_eq!(b.waiting(), 0, "both granted");
    assert_eq!(
        recorder.gauge(waiting),
        Some(0.0),
        "the waiting gauge follows"
    );
    drop(held);
    let (first, second) = futures::executor::block_on(async { (first.await, second.await) });
    drop((first.unwrap(), second.unwrap()));
    assert_eq!(b.in_flight(), 0);
}

/// An acquisition whose permit a panicking recorder gave back (as above) still ended: it is
/// counted once, as admitted (the panic then unwound it, as a panic of the work right after
/// would), so `acquisitions()` is every acquisition made. It was counted nowhere: free at
/// once (the `in_flight` gauge panicked), taken under the lock, or granted after a wait
/// (the wait histogram panicked).
#[cfg(feature = "metrics")]
#[test]
fn an_acquisition_a_panicking_recorder_unwound_is_counted_once() {
    use std::panic::catch_unwind;

    let recorder = support::TestRecorder::default();
    let builder = Bulkhead::builder(2).critical_reserve(1).name("unwound");
    let b = metrics::with_local_recorder(&recorder, || builder.build()).unwrap();
    let in_flight = "flowgate_bulkhead_in_flight{name=unwound}";
    let wait = "flowgate_bulkhead_wait_seconds{name=unwound}";
    let poll_once = |waiter: &mut std::pin::Pin<Box<flowgate::bulkhead::Acquire<'_>>>| {
        futures::executor::block_on(async { poll!(waiter.as_mut()).is_pending() })
    };
    // Free at once.
    recorder.panic_on(in_flight, true);
    assert!(catch_unwind(AssertUnwindSafe(|| drop(b.try_acquire()))).is_err());
    recorder.panic_on(in_flight, false);
    // Taken under the lock: a critical one, with a normal waiter queued.
    let held = b.try_acquire().unwrap();
    let mut waiter = Box::pin(b.acquire());
    assert!(poll_once(&mut waiter));
    recorder.panic_on(in_flight, true);
    let taken = catch_unwind(AssertUnwindSafe(|| {
        drop(b.try_acquire_with(Priority::Critical))
    }));
    assert!(taken.is_err());
    recorder.panic_on(in_flight, false);
    // Granted after a wait: its wait is recorded as it takes the permit.
    recorder.panic_on(wait, true);
    drop(held);
    assert!(catch_unwind(AssertUnwindSafe(|| poll_once(&mut waiter))).is_err());
    drop(waiter);
    recorder.panic_on(wait, false);
    let stats = b.stats();
    assert_eq!((stats.in_flight, stats.waiting), (0, 0), "nothing leaked");
    assert_eq!(
        (stats.acquisitions(), stats.admitted, stats.waited),
        (4, 4, 1),
        "{stats:?}"
    );
}

#[cfg(feature = "metrics")]
#[tokio::test(start_paused = true)]
async fn metrics_by_name_and_reason() {
    let recorder = support::TestRecorder::default();
    let b = metrics::with_local_recorder(&recorder, || {
        Bulkhead::builder(1)
            .max_waiting(1)
            .wait_timeout(Duration::from_millis(50))
            .name("payments")
            .build()
            .unwrap()
    });
    let held = b.acquire().await.unwrap();
    assert_eq!(
        recorder.gauge("flowgate_bulkhead_in_flight{name=payments}"),
        Some(1.0)
    );
    let mut waiter = Box::pin(b.acquire());
    assert!(poll!(waiter.as_mut()).is_pending());
    assert_eq!(
        recorder.gauge("flowgate_bulkhead_waiting{name=payments}"),
        Some(1.0)
    );
    assert_eq!(
        b.acquire().await.unwrap_err(),
        AcquireError::WaitingRoomFull
    );
    advance(Duration::from_millis(20)).await;
    drop(held);
    drop(waiter.await.unwrap());
    assert_eq!(
        recorder.samples("flowgate_bulkhead_wait_seconds{name=payments}"),
        [0.02]
    );
    let _held = b.acquire().await.unwrap();
    assert_eq!(b.acquire().await.unwrap_err(), AcquireError::TimedOut);
    let rejected = |r: &str| {
        recorder.counter(&format!(
            "flowgate_bulkhead_rejected_total{{name=payments,reason={r}}}"
        ))
    };
    assert_eq!(
        (rejected("waiting_room_full"), rejected("timed_out")),
        (1, 1)
    );
    drop(_held);
    // A waiter shed for critical work and dropped before it looks again is still counted.
    let held = b.acquire().await.unwrap();
    let mut shed = Box::pin(b.acquire());
    assert!(poll!(shed.as_mut()).is_pending());
    let mut critical = Box::pin(b.acquire_with(Priority::Critical));
    assert!(poll!(critical.as_mut()).is_pending());
    drop(shed);
    assert_eq!(rejected("waiting_room_full"), 2);
    drop((held, critical));
    assert_eq!(
        recorder.gauge("flowgate_bulkhead_waiting{name=payments}"),
        Some(0.0)
    );
}

/// A permit forgotten (`mem::forget`) is never returned: the bulkhead takes it back from
/// `flowgate_bulkhead_in_flight` when it is dropped, so the gauge that unnamed bulkheads
/// share does not keep it for good.
#[cfg(feature = "metrics")]
#[test]
fn a_dropped_bulkhead_takes_its_forgotten_permits_back_from_the_in_flight_gauge() {
    let recorder = support::TestRecorder::default();
    let (a, b) = metrics::with_local_recorder(&recorder, || {
        (
            Bulkhead::builder(4).build().unwrap(),
            Bulkhead::builder(4).build().unwrap(),
        )
    });
    let gauge = "flowgate_bulkhead_in_flight{name=default}";
    std::mem::forget(a.try_acquire().unwrap());
    std::mem::forget(a.try_acquire().unwrap());
    let held = b.try_acquire().unwrap();
    assert_eq!(recorder.gauge(gauge), Some(3.0));
    drop(a);
    assert_eq!(recorder.gauge(gauge), Some(1.0), "b's permit is left");
    drop(held);
    drop(b);
    assert_eq!(recorder.gauge(gauge), Some(0.0));
}

/// Two threads take and return permits at the same moments: once both are done, the
/// `flowgate_bulkhead_in_flight` gauge reads the permits in flight (none), whatever the order
/// in which the threads recorded their changes. (Each set the count it had read at its own
/// compare-and-swap, so a thread that read 1 could record it after the other recorded 0.)
#[cfg(feature = "metrics")]
#[test]
fn the_in_flight_gauge_ends_at_the_permits_in_flight_after_racing_threads() {
    const ROUNDS: usize = 200_000;
    let recorder = support::TestRecorder::default();
    let b = metrics::with_local_recorder(&recorder, || {
        Bulkhead::builder(2).name("race").build().unwrap()
    });
    let gauge = "flowgate_bulkhead_in_flight{name=race}";
    let mut wrong = Vec::new();
    let theirs = b.clone();
    support::lockstep(
        ROUNDS,
        move |start| {
            start();
            drop(theirs.try_acquire().unwrap());
        },
        |start| {
            start();
            drop(b.try_acquire().unwrap());
        },
        |round| {
            let (in_flight, shown) = (b.in_flight(), recorder.gauge(gauge));
            if shown != Some(in_flight as f64) {
                wrong.push((round, in_flight, shown));
            }
        },
    );
    assert!(
        wrong.is_empty(),
        "{} of {ROUNDS} rounds ended with the gauge off the permits in flight; the first \
         (round, in flight, gauge): {:?}",
        wrong.len(),
        &wrong[..wrong.len().min(3)]
    );
}

/// Two threads end calls on an adaptive bulkhead at the same moments, each sample moving
/// the algorithm's limit: once both are done, the bulkhead's `max_in_flight` and its
/// `flowgate_bulkhead_max_in_flight` gauge show the algorithm's latest answer. (Each thread
/// applied the target it had read after releasing the algorithm's lock, so one that read the
/// older target could apply it, and set the gauge to it, after the other applied the newer.)
#[cfg(feature = "metrics")]
#[test]
fn an_adaptive_bulkhead_ends_at_the_latest_limit_after_racing_samples() {
    use flowgate::adaptive::{AdaptiveLimit, Outcome, Sample};

    /// Every sample moves the limit: 4, 5, 4, 5, ...
    #[derive(Debug, Clone)]
    struct Flip(u32);
    impl AdaptiveLimit for Flip {
        fn limit(&self) -> u32 {
            4 + self.0 % 2
        }
        fn update(&mut self, _: &Sample) -> u32 {
            self.0 += 1;
            self.limit()
        }
        fn name(&self) -> &'static str {
            "flip"
        }
    }

    const ROUNDS: usize = 200_000;
    let recorder = support::TestRecorder::default();
    let b = metrics::with_local_recorder(&recorder, || {
        Bulkhead::builder(10)
            .adaptive(Flip(0))
            .name("race")
            .build()
            .unwrap()
    });
    // Each thread takes its permit before the round starts, so the two samples race.
    let gauge = "flowgate_bulkhead_max_in_flight{name=race}";
    let (mut stale_max, mut stale_gauge) = (Vec::new(), Vec::new());
    let theirs = b.clone();
    support::lockstep(
        ROUNDS,
        move |start| {
            let permit = theirs.try_acquire().unwrap();
            start();
            permit.record(Outcome::Ok);
        },
        |start| {
            let permit = b.try_acquire().unwrap();
            start();
            permit.record(Outcome::Ok);
        },
        |round| {
            let latest = b.adaptive_stats().unwrap().max_in_flight;
            if b.max_in_flight() != latest {
                stale_max.push((round, latest, b.max_in_flight()));
            }
            if recorder.gauge(gauge) != Some(latest as f64) {
                stale_gauge.push((round, latest, recorder.gauge(gauge)));
            }
        },
    );
    assert!(
        stale_max.is_empty() && stale_gauge.is_empty(),
        "of {ROUNDS} rounds, {} ended with max_in_flight off the latest limit, {} with the \
         gauge off it; the first (round, latest, shown): {:?} {:?}",
        stale_max.len(),
        stale_gauge.len(),
        &stale_max[..stale_max.len().min(3)],
        &stale_gauge[..stale_gauge.len().min(3)],
    );
}

/// As above, and every raise of the limit wakes a parked adapter whose waker panics: the
/// thread whose raise panics must still look at the target again, or the older limit it
/// applied stays. (The panic skipped the look: when the other thread's newer sample had
/// found the limit already at its answer, before the raise landed, nobody applied it.) The
/// window is a few instructions wide, between two threads: no hook runs in it, so no test
/// can place the other sample there for certain; many rounds find it.
#[test]
fn an_adaptive_bulkhead_ends_at_the_latest_limit_when_a_raise_panics() {
    use std::panic::catch_unwind;
    use std::task::Context;

    use flowgate::adaptive::{AdaptiveLimit, Outcome, Sample};

    /// Back-pressure samples flip the limit: 4, 5, 4, 5, ...; the others leave it.
    #[derive(Debug, Clone)]
    struct Flip(u32);
    impl AdaptiveLimit for Flip {
        fn limit(&self) -> u32 {
            4 + self.0 % 2
        }
        fn update(&mut self, sample: &Sample) -> u32 {
            if sample.outcome == Outcome::BackPressure {
                self.0 += 1;
            }
            self.limit()
        }
        fn name(&self) -> &'static str {
            "flip"
        }
    }

    // About one round in 10,000 finds the window (two cores): 50,000 rounds miss it with
    // a chance well under 1 %.
    const ROUNDS: usize = 50_000;
    let b = Bulkhead::builder(10).adaptive(Flip(0)).build().unwrap();
    // An ordered adapter with as many outputs as the limit (the oldest pending, holding
    // one permit; three finished behind it), parked for the limit to grow: every raise
    // wakes it, and it keeps its place.
    let mut adapter = Box::pin(futures::stream::iter(0..5).bulkhead_map(
        b.clone(),
        |i| async move {
            if i == 0 {
                std::future::pending::<()>().await;
            }
            i
        },
    ));
    let waker = support::panicking_waker();
    assert!(
        adapter
            .as_mut()
            .poll_next(&mut Context::from_waker(&waker))
            .is_pending()
    );
    assert_eq!((b.in_flight(), b.max_in_flight()), (1, 4));
    // A panic a round, caught: not printed.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let mut stale = Vec::new();
    let theirs = b.clone();
    support::lockstep(
        ROUNDS,
        move |start| {
            let permit = theirs.try_acquire().unwrap();
            start();
            let _ = catch_unwind(AssertUnwindSafe(|| permit.record(Outcome::BackPressure)));
        },
        |start| {
            let permit = b.try_acquire().unwrap();
            start();
            let _ = catch_unwind(AssertUnwindSafe(|| permit.record(Outcome::BackPressure)));
        },
        |round| {
            let latest = b.adaptive_stats().unwrap().max_in_flight;
            if b.max_in_flight() != latest {
                stale.push((round, latest, b.max_in_flight()));
            }
        },
    );
    std::panic::set_hook(hook);
    assert!(
        stale.is_empty(),
        "of {ROUNDS} rounds, {} ended with max_in_flight off the latest limit; the first \
         (round, latest, applied): {:?}",
        stale.len(),
        &stale[..stale.len().min(3)],
    );
    assert_eq!(b.in_flight(), 1, "only the adapter's permit is out");
    drop(adapter);
}

/// A waiter shed for critical work in the same poll in which it sees its timer expire (after
/// it looked at its place in the queue, before it left it) ends one way only: the shed took
/// it out of the queue first, so it is refused `WaitingRoomFull`, counted once, and not also
/// `TimedOut`. The shed runs in that window through the waiter's old waker, which the poll
/// replaces and drops once the queue's lock is released (as another thread could shed it
/// there).
#[cfg(feature = "metrics")]
#[tokio::test(start_paused = true)]
async fn a_waiter_shed_as_its_timer_fires_is_refused_and_counted_once() {
    use std::pin::Pin;
    use std::sync::Mutex;
    use std::task::{Context, Poll, Wake, Waker};

    /// A waker that, when dropped, polls a critical acquisition once (which sheds the
    /// newest normal waiter of the full room) and keeps it.
    struct ShedOnDrop {
        bulkhead: Bulkhead,
        critical: Arc<Mutex<Option<Pin<Box<flowgate::bulkhead::AcquireOwned>>>>>,
    }
    impl Wake for ShedOnDrop {
        fn wake(self: Arc<Self>) {}
    }
    impl Drop for ShedOnDrop {
        fn drop(&mut self) {
            let mut critical = Box::pin(self.bulkhead.acquire_owned_with(Priority::Critical));
            let polled = critical.poll_unpin(&mut Context::from_waker(Waker::noop()));
            assert!(polled.is_pending());
            *self.critical.lock().unwrap() = Some(critical);
        }
    }

    let recorder = support::TestRecorder::default();
    let b = metrics::with_local_recorder(&recorder, || {
        Bulkhead::builder(1)
            .max_waiting(1)
            .wait_timeout(Duration::from_millis(100))
            .name("race")
            .build()
            .unwrap()
    });
    let rejected = |r: &str| {
        recorder.counter(&format!(
            "flowgate_bulkhead_rejected_total{{name=race,reason={r}}}"
        ))
    };
    let held = b.acquire().await.unwrap();
    let critical = Arc::new(Mutex::new(None));
    let shed_on_drop = Waker::from(Arc::new(ShedOnDrop {
        bulkhead: b.clone(),
        critical: critical.clone(),
    }));
    let mut waiter = Box::pin(b.acquire());
    assert!(
        waiter
            .poll_unpin(&mut Context::from_waker(&shed_on_drop))
            .is_pending()
    );
    drop(shed_on_drop); // the queue holds the only clone
    assert!(critical.lock().unwrap().is_none());
    advance(Duration::from_millis(100)).await; // the deadline, exactly
    let Poll::Ready(outcome) = waiter.poll_unpin(&mut Context::from_waker(Waker::noop())) else {
        panic!("the waiter was shed and its timer fired: it is done");
    };
    assert!(
        critical.lock().unwrap().is_some(),
        "the shed ran in the window"
    );
    assert_eq!(
        (rejected("waiting_room_full"), rejected("timed_out")),
        (1, 0)
    );
    assert_eq!(outcome.unwrap_err(), AcquireError::WaitingRoomFull);
    drop(waiter);
    // The critical acquisition got the room's place; it takes the permit released.
    drop(held);
    let critical = critical.lock().unwrap().take().unwrap();
    drop(critical.await.unwrap());
    assert_eq!((b.in_flight(), b.waiting()), (0, 0));
    assert_eq!(
        (rejected("waiting_room_full"), rejected("timed_out")),
        (1, 0)
    );
}

/// As above with a close in the window: closing took the waiter out of the queue before its
/// timer did, so it is refused `Closed` (as it is when the close comes before the poll),
/// counted once, and not `TimedOut`.
#[cfg(feature = "metrics")]
#[tokio::test(start_paused = true)]
async fn a_waiter_closed_out_as_its_timer_fires_is_refused_closed_once() {
    use std::task::{Context, Poll, Wake, Waker};

    /// A waker that closes the bulkhead when dropped.
    struct CloseOnDrop(Bulkhead);
    impl Wake for CloseOnDrop {
        fn wake(self: Arc<Self>) {}
    }
    impl Drop for CloseOnDrop {
        fn drop(&mut self) {
            self.0.close();
        }
    }

    let recorder = support::TestRecorder::default();
    let b = metrics::with_local_recorder(&recorder, || {
        Bulkhead::builder(1)
            .wait_timeout(Duration::from_millis(100))
            .name("race")
            .build()
            .unwrap()
    });
    let rejected = |r: &str| {
        recorder.counter(&format!(
            "flowgate_bulkhead_rejected_total{{name=race,reason={r}}}"
        ))
    };
    let held = b.acquire().await.unwrap();
    let close_on_drop = Waker::from(Arc::new(CloseOnDrop(b.clone())));
    let mut waiter = Box::pin(b.acquire());
    assert!(
        waiter
            .poll_unpin(&mut Context::from_waker(&close_on_drop))
            .is_pending()
    );
    drop(close_on_drop); // the queue holds the only clone
    assert!(!b.is_closed());
    advance(Duration::from_millis(100)).await; // the deadline, exactly
    let Poll::Ready(outcome) = waiter.poll_unpin(&mut Context::from_waker(Waker::noop())) else {
        panic!("the waiter was closed out and its timer fired: it is done");
    };
    assert!(b.is_closed(), "the close ran in the window");
    assert_eq!((rejected("closed"), rejected("timed_out")), (1, 0));
    assert_eq!(outcome.unwrap_err(), AcquireError::Closed);
    drop((waiter, held));
    assert_eq!((b.in_flight(), b.waiting()), (0, 0));
}

/// As above with a permit released in the window: the grant took the waiter out of the
/// queue before its timer did, so it gets the permit, and its wait is in
/// `flowgate_bulkhead_wait_seconds` like any wait that ended with a permit.
#[cfg(feature = "metrics")]
#[tokio::test(start_paused = true)]
async fn a_permit_granted_as_the_timer_fires_wins_and_its_wait_is_recorded() {
    use std::task::{Context, Poll, Wake, Waker};

    /// A waker that holds a permit: dropping it releases the permit.
    struct ReleaseOnDrop {
        _permit: flowgate::bulkhead::OwnedBulkheadPermit,
    }
    impl Wake for ReleaseOnDrop {
        fn wake(self: Arc<Self>) {}
    }

    let recorder = support::TestRecorder::default();
    let b = metrics::with_local_recorder(&recorder, || {
        Bulkhead::builder(1)
            .wait_timeout(Duration::from_millis(100))
            .name("race")
            .build()
            .unwrap()
    });
    let held = b.try_acquire_owned().unwrap();
    let release_on_drop = Waker::from(Arc::new(ReleaseOnDrop { _permit: held }));
    let mut waiter = Box::pin(b.acquire());
    assert!(
        waiter
            .poll_unpin(&mut Context::from_waker(&release_on_drop))
            .is_pending()
    );
    drop(release_on_drop); // the queue holds the only clone
    assert_eq!(b.in_flight(), 1);
    advance(Duration::from_millis(100)).await; // the deadline, exactly
    let Poll::Ready(outcome) = waiter.poll_unpin(&mut Context::from_waker(Waker::noop())) else {
        panic!("the waiter was granted a permit and its timer fired: it is done");
    };
    let permit = outcome.unwrap();
    assert_eq!(
        recorder.counter("flowgate_bulkhead_rejected_total{name=race,reason=timed_out}"),
        0
    );
    assert_eq!(
        recorder.samples("flowgate_bulkhead_wait_seconds{name=race}"),
        [0.1]
    );
    drop(permit);
    drop(waiter);
    assert_eq!((b.in_flight(), b.waiting()), (0, 0));
}

/// Issue 20: 40,000 waiting acquisitions dropped newest first (the worst order for a queue
/// scanned from the front): each leaves in O(1) (the waiter list's unit test counts the
/// work), the waiting count returns to 0, and the bulkhead works on.
#[test]
fn forty_thousand_waiters_dropped_newest_first() {
    const N: usize = 40_000;
    let bulkhead = Bulkhead::new(1).unwrap();
    let held = bulkhead.try_acquire().unwrap();
    let mut waiting = support::queue_waiters(N, || bulkhead.acquire());
    assert_eq!(bulkhead.waiting(), N);
    while waiting.pop().is_some() {}
    assert_eq!(bulkhead.waiting(), 0);
    drop(held);
    assert_eq!(bulkhead.in_flight(), 0);
    let _again = bulkhead.try_acquire().unwrap();
}

/// The item a bulkhead adapter lets go of, its stream dropped or its bulkhead closed, is
/// counted in `flowgate_bulkhead_discarded_total` (with or without a hook): every dropped
/// item is counted.
#[cfg(feature = "metrics")]
#[tokio::test]
async fn an_adapter_counts_the_item_it_discards() {
    async fn check<S: Stream<Item = u32>>(adapter: S, b: &Bulkhead, close: bool) {
        let mut adapter = Box::pin(adapter);
        assert!(poll!(adapter.next()).is_pending());
        if close {
            b.close();
            assert_eq!(adapter.next().await, None);
        } else {
            drop(adapter);
        }
    }
    let rec = support::TestRecorder::default();
    let named = |name: &str| {
        metrics::with_local_recorder(&rec, || Bulkhead::builder(1).name(name).build().unwrap())
    };
    let discarded =
        |name: &str| rec.counter(&format!("flowgate_bulkhead_discarded_total{{name={name}}}"));
    let items = || futures::stream::iter(0..3u32);
    let f = |x: u32| async move { x };
    for close in [false, true] {
        let b = named(&format!("map-{close}"));
        let _busy = b.acquire().await.unwrap();
        check(items().bulkhead_map(b.clone(), f), &b, close).await;
        assert_eq!(
            discarded(&format!("map-{close}")),
            1,
            "bulkhead_map, close={close}"
        );

        let b = named(&format!("unordered-{close}"));
        let _busy = b.acquire().await.unwrap();
        check(items().bulkhead_map_unordered(b.clone(), f), &b, close).await;
        assert_eq!(
            discarded(&format!("unordered-{close}")),
            1,
            "unordered, close={close}"
        );

        let b = named(&format!("spawn-{close}"));
        let _busy = b.acquire().await.unwrap();
        let (seen, hook) = recorder();
        let adapter = BulkheadSpawnMap::builder(items(), b.clone(), f)
            .on_drop(hook)
            .build()
            .unwrap();
        check(adapter, &b, close).await;
        assert_eq!(
            discarded(&format!("spawn-{close}")),
            1,
            "spawn_map, close={close}"
        );
        assert_eq!(seen.lock().unwrap().len(), 1, "and the hook saw it");
    }
}

/// The item a bulkhead adapter lets go of is counted in `flowgate_bulkhead_discarded_total`,
/// then handed to the hook. A metrics recorder that panics as it is counted must not keep
/// it from the hook: it was dropped unseen (and the count never recorded), its stream
/// dropped or its bulkhead closed. The panic goes on once the hook has it.
#[cfg(feature = "metrics")]
#[test]
fn a_recorder_panicking_on_a_discard_still_hands_the_item_to_the_hook() {
    let rec = support::TestRecorder::default();
    for close in [false, true] {
        let name = format!("discard-{close}");
        let b = metrics::with_local_recorder(&rec, || {
            Bulkhead::builder(1).name(&name).build().unwrap()
        });
        let _busy = b.try_acquire().unwrap();
        let (seen, hook) = recorder();
        let items = futures::stream::iter(0..3u32);
        let mut s = Box::pin(
            BulkheadMapUnordered::builder(items, b.clone(), |x| async move { x })
                .on_drop(hook)
                .build()
                .unwrap(),
        );
        let polled = futures::executor::block_on(async { poll!(s.next()) });
        assert!(polled.is_pending(), "0 waits for the permit");
        let id = format!("flowgate_bulkhead_discarded_total{{name={name}}}");
        rec.panic_on(&id, true);
        let unwound = std::panic::catch_unwind(AssertUnwindSafe(|| {
            if close {
                b.close();
                let _ = futures::executor::block_on(async { poll!(s.next()) });
            }
            drop(s);
        }));
        rec.panic_on(&id, false);
        assert!(unwound.is_err(), "close={close}: the recorder panicked");
        assert_eq!(
            *seen.lock().unwrap(),
            [(0, "discarded")],
            "close={close}: the hook has it"
        );
    }
}

/// The three adapters, by name.
const ADAPTERS: [&str; 3] = [
    "bulkhead_map",
    "bulkhead_map_unordered",
    "bulkhead_spawn_map",
];

/// When each item started, in seconds since [`two_calls`] was called.
type Started = Arc<Mutex<Vec<(u64, u64)>>>;

/// Two items through `adapter` over `b`, consumed by a task: item 0 is a call of a minute,
/// item 1 one that ends at once. Returns the task (it counts the outputs) and the start
/// times, each as `(seconds of the call, seconds since now)`.
fn two_calls(adapter: &str, b: &Bulkhead) -> (tokio::task::JoinHandle<usize>, Started) {
    let t0 = Instant::now();
    let started = Started::default();
    let s = started.clone();
    let f = move |secs: u64| {
        s.lock().unwrap().push((secs, t0.elapsed().as_secs()));
        async move {
            sleep(Duration::from_secs(secs)).await;
            secs
        }
    };
    let items = futures::stream::iter([60u64, 0]);
    let out = match adapter {
        "bulkhead_map" => items.bulkhead_map(b.clone(), f).boxed(),
        "bulkhead_map_unordered" => items.bulkhead_map_unordered(b.clone(), f).boxed(),
        _ => items.bulkhead_spawn_map(b.clone(), f).boxed(),
    };
    (tokio::spawn(out.count()), started)
}

/// A permit freed by other work wakes an adapter that holds an item waiting for one while
/// work of its own is in flight. The adapter took only a permit free at the moment it
/// looked and relied on its own work to wake it: with one long call of its own out, a
/// permit freed elsewhere sat idle until that call ended, and so did the item.
#[tokio::test(start_paused = true)]
async fn a_permit_freed_elsewhere_starts_the_item_an_adapter_holds() {
    for adapter in ADAPTERS {
        let b = Bulkhead::new(2).unwrap();
        let elsewhere = b.acquire_owned().await.unwrap();
        let (consumer, started) = two_calls(adapter, &b);
        sleep(Duration::from_secs(1)).await;
        assert_eq!(*started.lock().unwrap(), [(60, 0)], "{adapter}");
        drop(elsewhere);
        assert_eq!(consumer.await.unwrap(), 2);
        assert_eq!(
            *started.lock().unwrap(),
            [(60, 0), (0, 1)],
            "{adapter}: the item starts when the permit frees, not when the call ends"
        );
        assert_eq!(b.in_flight(), 0);
    }
}

/// An adapter queued for a permit for the item it holds does not also hand that item the
/// permit of a future of its own that just finished: the permit granted to its place in the
/// queue would then be held for no item at all, idle while others wait.
#[tokio::test(start_paused = true)]
async fn a_queued_adapter_starts_its_item_on_one_permit_only() {
    let b = Bulkhead::new(2).unwrap();
    let elsewhere = b.acquire_owned().await.unwrap();
    let (tx, rx) = futures::channel::mpsc::unbounded::<u64>();
    let (finish, finished) = futures::channel::oneshot::channel::<()>();
    let mut finished = Some(finished);
    let mut out = pin!(rx.bulkhead_map_unordered(b.clone(), move |x| {
        let first = finished.take();
        async move {
            match first {
                Some(finished) => finished.await.unwrap(),
                None => sleep(Duration::from_secs(60)).await,
            }
            x
        }
    }));
    tx.unbounded_send(0).unwrap();
    tx.unbounded_send(1).unwrap();
    // 0 runs on the last free permit; 1 waits in the queue behind `elsewhere`.
    assert!(poll!(out.next()).is_pending());
    assert_eq!((b.in_flight(), b.waiting()), (2, 1));
    // The freed permit is granted to the adapter's place; then 0 finishes too.
    drop(elsewhere);
    finish.send(()).unwrap();
    assert_eq!(out.next().await, Some(0));
    assert!(poll!(out.next()).is_pending());
    assert_eq!(b.in_flight(), 1, "1 runs on one permit; the other is free");
    assert!(b.try_acquire().is_ok());
}

/// Growing `max_in_flight` starts the item an adapter holds at once, also when its own work
/// holds every permit (here one, the other one the critical reserve) or it keeps as many
/// outputs as the limit (`bulkhead_map`, `bulkhead_spawn_map`: here one): it waited for its
/// own calls to end, so the grown limit reached it only then (a minute later here).
#[tokio::test(start_paused = true)]
async fn a_grown_limit_starts_the_item_an_adapter_holds() {
    for adapter in ADAPTERS {
        for reserve in [1, 0] {
            let b = Bulkhead::builder(1 + reserve)
                .critical_reserve(reserve)
                .build()
                .unwrap();
            let (consumer, started) = two_calls(adapter, &b);
            sleep(Duration::from_secs(1)).await;
            assert_eq!(*started.lock().unwrap(), [(60, 0)], "{adapter}");
            b.set_max_in_flight(2 + reserve).unwrap();
            assert_eq!(consumer.await.unwrap(), 2);
            assert_eq!(
                *started.lock().unwrap(),
                [(60, 0), (0, 1)],
                "{adapter}, reserve {reserve}: the item starts when the limit grows, not when \
                 the call ends"
            );
            assert_eq!(b.in_flight(), 0);
        }
    }
}

/// Closing the bulkhead ends an adapter that waits on an empty upstream: it pulls nothing
/// after the close, so it has nothing more to wait for there. It was woken only by the
/// upstream, so it ended only when an item came (and stayed there) or the upstream ended.
#[tokio::test(start_paused = true)]
async fn closing_the_bulkhead_ends_an_adapter_waiting_on_its_upstream() {
    for adapter in ADAPTERS {
        let b = Bulkhead::new(1).unwrap();
        let (tx, rx) = futures::channel::mpsc::unbounded::<u64>();
        let f = |x: u64| async move { x };
        let mut out = match adapter {
            "bulkhead_map" => rx.bulkhead_map(b.clone(), f).boxed(),
            "bulkhead_map_unordered" => rx.bulkhead_map_unordered(b.clone(), f).boxed(),
            _ => rx.bulkhead_spawn_map(b.clone(), f).boxed(),
        };
        tx.unbounded_send(1).unwrap();
        assert_eq!(out.next().await, Some(1), "{adapter}");
        let ended = tokio::spawn(async move { out.next().await });
        sleep(Duration::from_secs(1)).await;
        b.close();
        let ended = tokio::time::timeout(Duration::from_secs(60), ended).await;
        assert_eq!(
            ended.map(Result::unwrap),
            Ok(None),
            "{adapter}: ends at the close, the upstream still open"
        );
        drop(tx);
    }
}

/// An adapter waiting on its upstream is parked for the close only: the limit growing, as an
/// adaptive bulkhead's may with each call, does not wake it (nor each of the adapters that
/// share the bulkhead and wait on theirs).
#[test]
fn an_adapter_waiting_on_its_upstream_is_not_woken_by_a_growing_limit() {
    use std::task::{Context, Wake, Waker};

    struct Woken(AtomicUsize);
    impl Wake for Woken {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    let b = Bulkhead::new(1).unwrap();
    let (_tx, rx) = futures::channel::mpsc::unbounded::<u64>();
    let mut out = pin!(rx.bulkhead_map_unordered(b.clone(), |x| async move { x }));
    let woken = Arc::new(Woken(AtomicUsize::new(0)));
    let waker = Waker::from(woken.clone());
    assert!(
        out.poll_next_unpin(&mut Context::from_waker(&waker))
            .is_pending()
    );
    for max in 2..10 {
        b.set_max_in_flight(max).unwrap();
    }
    assert_eq!(woken.0.load(Ordering::SeqCst), 0, "not woken by the limit");
    b.close();
    assert_eq!(woken.0.load(Ordering::SeqCst), 1, "woken by the close");
}

/// A metrics recorder that panics on every call, while a panic unwinds through the holder
/// of a permit: dropping the permit records its release in `flowgate_bulkhead_in_flight`,
/// the recorder panics inside that drop, and a panic in a drop during unwinding aborted the
/// whole process. The recorder's panic is dropped instead (the first one goes on), and the
/// permit is back.
#[cfg(feature = "metrics")]
#[test]
fn a_panicking_recorder_does_not_abort_a_permit_dropped_by_unwinding() {
    use std::panic::catch_unwind;

    let recorder = support::TestRecorder::default();
    let b = metrics::with_local_recorder(&recorder, || {
        Bulkhead::builder(1).name("unwinding").build().unwrap()
    });
    let held = b.try_acquire().unwrap();
    let in_flight = "flowgate_bulkhead_in_flight{name=unwinding}";
    recorder.panic_on(in_flight, true);
    let unwound = catch_unwind(AssertUnwindSafe(|| {
        let _held = held;
        panic!("the work failed");
    }));
    recorder.panic_on(in_flight, false);
    let first = unwound.expect_err("the work panicked");
    assert_eq!(first.downcast_ref::<&str>(), Some(&"the work failed"));
    assert_eq!(b.in_flight(), 0, "the permit is back");
}

/// `bulkhead_map` catches a panic raised as the permit of a mapped future comes back (user
/// code runs there), so that its queue of futures drops every one of them, and resumes it
/// after. The future in its slot is dropped the same way, on its own: dropped while a
/// panic unwinds through the stream's holder, it resumed a caught panic during that
/// unwinding, and the process aborted. Here the permit is the last owner of its bulkhead,
/// and the adaptive algorithm's `Drop` panics as the bulkhead goes. The first panic goes on,
/// the second is dropped, as a metrics recorder's is there.
#[test]
fn a_panic_returning_a_permit_does_not_abort_an_ordered_adapter_dropped_by_unwinding() {
    use flowgate::adaptive::{AdaptiveLimit, Sample};
    use std::sync::atomic::AtomicBool;

    /// An algorithm whose drop panics once `armed`.
    #[derive(Debug, Clone)]
    struct Bomb(Arc<AtomicBool>);
    impl AdaptiveLimit for Bomb {
        fn limit(&self) -> u32 {
            2
        }
        fn update(&mut self, _: &Sample) -> u32 {
            2
        }
        fn name(&self) -> &'static str {
            "bomb"
        }
    }
    impl Drop for Bomb {
        fn drop(&mut self) {
            if self.0.load(Ordering::SeqCst) {
                panic!("the algorithm's drop panics");
            }
        }
    }

    let armed = Arc::new(AtomicBool::new(false));
    let b = Bulkhead::builder(2)
        .adaptive(Bomb(armed.clone()))
        .build()
        .unwrap();
    let items = futures::stream::iter(0..1u32);
    let mut s = Box::pin(items.bulkhead_map(b.clone(), |_| futures::future::pending::<u32>()));
    drop(b);
    assert!(futures::executor::block_on(async { poll!(s.next()) }).is_pending());
    armed.store(true, Ordering::SeqCst);
    let unwound = std::panic::catch_unwind(AssertUnwindSafe(move || {
        let _s = s;
        panic!("the work failed");
    }));
    let first = unwound.expect_err("the work panicked");
    assert_eq!(first.downcast_ref::<&str>(), Some(&"the work failed"));
}

/// Drop `value` while the recorder panics on every change to `id`; the panic came.
#[cfg(feature = "metrics")]
fn drop_as_the_recorder_panics<T>(recorder: &support::TestRecorder, id: &str, value: T) {
    recorder.panic_on(id, true);
    let dropped = std::panic::catch_unwind(AssertUnwindSafe(|| drop(value)));
    recorder.panic_on(id, false);
    assert!(dropped.is_err(), "the recorder panicked");
}

/// An adapter dropped with several futures in flight returns their permits one after the
/// other. A metrics recorder that panics as the first one comes back (it records the
/// release in `flowgate_bulkhead_in_flight`) unwound the adapter's drop there: the releases
/// after it never ran, and those permits were lost for good (here two of three: the
/// bulkhead left with one permit for ever). Each release now runs, and the panic goes on.
#[cfg(feature = "metrics")]
#[test]
fn a_panicking_recorder_does_not_lose_the_permits_of_a_dropped_adapter() {
    let recorder = support::TestRecorder::default();
    let b = metrics::with_local_recorder(&recorder, || {
        Bulkhead::builder(3).name("dropped").build().unwrap()
    });
    let items = futures::stream::iter(0..3u32);
    let mut s =
        Box::pin(items.bulkhead_map_unordered(b.clone(), |_| futures::future::pending::<u32>()));
    assert!(futures::executor::block_on(async { poll!(s.next()) }).is_pending());
    assert_eq!(b.in_flight(), 3, "three futures in flight");
    drop_as_the_recorder_panics(&recorder, "flowgate_bulkhead_in_flight{name=dropped}", s);
    assert_eq!(b.in_flight(), 0, "every permit is back");
    let all: Vec<_> = (0..3).map(|_| b.try_acquire().unwrap()).collect();
    drop(all);
}

/// As above for `bulkhead_map`, whose futures in flight hold their permits: dropped with
/// two futures queued behind the oldest (finished and yielded), it drops them one after the
/// other from its `FuturesOrdered`. A recorder that panics as the first one's permit comes
/// back unwinds out of that queue's drop, which then leaks the futures left in it (as
/// `FuturesUnordered` does on a panic in a future's drop), their permits with them. The
/// panic is now held back until the queue is dropped, then goes on.
#[cfg(feature = "metrics")]
#[test]
fn a_panicking_recorder_does_not_lose_the_permits_of_a_dropped_ordered_adapter() {
    use std::sync::atomic::AtomicBool;

    let recorder = support::TestRecorder::default();
    let b = metrics::with_local_recorder(&recorder, || {
        Bulkhead::builder(3)
            .name("dropped_ordered")
            .build()
            .unwrap()
    });
    let open = Arc::new(AtomicBool::new(false));
    let gate = open.clone();
    let items = futures::stream::iter(0..3u32);
    let mut s = Box::pin(items.bulkhead_map(b.clone(), move |i| {
        let gate = gate.clone();
        futures::future::poll_fn(move |_| {
            if i == 0 && gate.load(Ordering::SeqCst) {
                std::task::Poll::Ready(i)
            } else {
                std::task::Poll::Pending
            }
        })
    }));
    let mut poll_once = || futures::executor::block_on(async { poll!(s.next()) });
    assert!(poll_once().is_pending(), "0, 1 and 2 run");
    assert_eq!(b.in_flight(), 3);
    open.store(true, Ordering::SeqCst);
    assert_eq!(poll_once(), std::task::Poll::Ready(Some(0)));
    assert_eq!(b.in_flight(), 2, "1 and 2 run");
    let in_flight = "flowgate_bulkhead_in_flight{name=dropped_ordered}";
    drop_as_the_recorder_panics(&recorder, in_flight, s);
    assert_eq!(b.in_flight(), 0, "every permit is back");
}

/// As above for `bulkhead_map_unordered` over an adaptive bulkhead: a future dropped in
/// flight is an `Ignored` sample, recorded as its drop begins (in
/// `flowgate_bulkhead_samples_total`). A recorder that panics there, as the adapter drops
/// the futures queued behind its slot, unwound out of that queue's drop, which then leaked
/// the futures left in it (`FuturesUnordered` does, on a panic in a future's drop): never
/// dropped, with all they own (here a guard each; a permit, a channel's slot, a sender a
/// task waits on). Every future is now dropped, and the panic goes on.
#[cfg(feature = "metrics")]
#[test]
fn a_panicking_recorder_does_not_leak_the_futures_of_a_dropped_unordered_adapter() {
    use flowgate::adaptive::Aimd;
    use std::sync::atomic::AtomicBool;

    let recorder = support::TestRecorder::default();
    let b = metrics::with_local_recorder(&recorder, || {
        Bulkhead::builder(3)
            .adaptive(Aimd::builder().build().unwrap())
            .name("leak")
            .build()
            .unwrap()
    });
    let open = Arc::new(AtomicBool::new(false));
    let dropped = Arc::new(AtomicUsize::new(0));
    /// Counts its drop.
    struct Guard(Arc<AtomicUsize>);
    impl Drop for Guard {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    let (gate, count) = (open.clone(), dropped.clone());
    let items = futures::stream::iter(0..3u32);
    let mut s = Box::pin(items.bulkhead_map_unordered(b.clone(), move |i| {
        let (gate, guard) = (gate.clone(), Guard(count.clone()));
        futures::future::poll_fn(move |_| {
            let _owned = &guard;
            if i == 0 && gate.load(Ordering::SeqCst) {
                std::task::Poll::Ready(i)
            } else {
                std::task::Poll::Pending
            }
        })
    }));
    let mut poll_once = || futures::executor::block_on(async { poll!(s.next()) });
    assert!(
        poll_once().is_pending(),
        "0 in the slot, 1 and 2 queued behind it"
    );
    open.store(true, Ordering::SeqCst);
    assert_eq!(poll_once(), std::task::Poll::Ready(Some(0)));
    assert_eq!((b.in_flight(), dropped.load(Ordering::SeqCst)), (2, 1));
    let ignored = "flowgate_bulkhead_samples_total{name=leak,outcome=ignored}";
    drop_as_the_recorder_panics(&recorder, ignored, s);
    assert_eq!(dropped.load(Ordering::SeqCst), 3, "every future is dropped");
    assert_eq!(b.in_flight(), 0, "every permit is back");
}

/// The bulkhead module's "Shutdown": when the bulkhead is closed, an adapter "yields what is
/// in flight, then ends; the item it held is discarded (the bulkhead counts the refused
/// wait as a `closed` refusal in `flowgate_bulkhead_rejected_total`)". Here every permit
/// in flight is the adapter's own, so an adapter that holds its next item holds it parked,
/// without queueing for a permit: its refusal is counted all the same.
#[cfg(feature = "metrics")]
#[tokio::test]
async fn an_adapter_whose_own_work_holds_every_permit_counts_its_closed_refusal() {
    let rec = support::TestRecorder::default();
    for adapter in ADAPTERS {
        let b = metrics::with_local_recorder(&rec, || {
            Bulkhead::builder(2).name(adapter).build().unwrap()
        });
        let gates: Vec<_> = (0..2)
            .map(|_| tokio::sync::oneshot::channel::<()>())
            .collect();
        let (txs, rxs): (Vec<_>, Vec<_>) = gates.into_iter().unzip();
        let rxs = Arc::new(Mutex::new(rxs));
        let f = move |x: u32| {
            let rx = rxs.lock().unwrap().pop();
            async move {
                if let Some(rx) = rx {
                    let _ = rx.await;
                }
                x
            }
        };
        let items = futures::stream::iter(0..4u32);
        let mut s: std::pin::Pin<Box<dyn Stream<Item = u32> + Send>> = match adapter {
            "bulkhead_map" => Box::pin(items.bulkhead_map(b.clone(), f)),
            "bulkhead_map_unordered" => Box::pin(items.bulkhead_map_unordered(b.clone(), f)),
            _ => Box::pin(items.bulkhead_spawn_map(b.clone(), f)),
        };
        assert!(poll!(s.next()).is_pending(), "{adapter}: 0 and 1 run");
        tokio::task::yield_now().await;
        assert!(poll!(s.next()).is_pending(), "{adapter}: 0 and 1 run");
        assert_eq!(b.in_flight(), 2, "{adapter}");
        b.close();
        for tx in txs {
            tx.send(()).unwrap();
        }
        let mut out: Vec<u32> = s.collect().await;
        out.sort_unstable();
        assert_eq!(out, [0, 1], "{adapter}: what was in flight, then the end");
        let closed = rec.counter(&format!(
            "flowgate_bulkhead_rejected_total{{name={adapter},reason=closed}}"
        ));
        let discarded = rec.counter(&format!(
            "flowgate_bulkhead_discarded_total{{name={adapter}}}"
        ));
        // The in-poll ordered adapter and the spawning one keep at most `max_in_flight`
        // outputs: with both permits their own, they hold no item. The unordered one holds
        // item 2, discarded as the bulkhead closes, its refused wait counted.
        let held = u64::from(adapter == "bulkhead_map_unordered");
        assert_eq!((closed, discarded), (held, held), "{adapter}");
    }
}
