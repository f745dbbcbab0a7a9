//! The promises of the bulkhead docs, checked at their edge values: a `wait_timeout` of
//! `Duration::MAX`, the largest `max_in_flight`, a waiting room of 0 for critical work,
//! `run` dropped at each of its waits, and the adapters' `size_hint` and `FusedStream`
//! over an upstream that ends while a permit is held. Then the review's checks: the
//! critical reserve against the adapters and against waking normal waiters, the room's
//! size under critical work, and random steps in which no waiter sleeps while a permit it
//! may take is free.

use std::task::Poll;

use futures::stream::FusedStream;

use super::*;
use crate::support::drain_checking_hints;

/// The longest `wait_timeout` (`Duration::MAX`) is a wait, not an overflow: the waiter
/// waits, and gets the permit when it comes back.
#[tokio::test(start_paused = true)]
async fn a_wait_timeout_of_duration_max_waits() {
    let b = Bulkhead::builder(1)
        .wait_timeout(Duration::MAX)
        .build()
        .unwrap();
    let held = b.acquire().await.unwrap();
    let mut waiting = Box::pin(b.acquire());
    assert!(poll!(waiting.as_mut()).is_pending());
    sleep(Duration::from_secs(3_600)).await;
    assert!(poll!(waiting.as_mut()).is_pending());
    drop(held);
    assert!(waiting.await.is_ok());
    assert_eq!((b.in_flight(), b.waiting()), (0, 0));
}

/// A `wait_timeout` beyond the 30 years tokio caps a `sleep` at is still the timeout: a
/// waiter is not shed after 30 years, earlier than the timeout it was given. One of 40
/// years sheds after 40 years; one of `Duration::MAX` (past any instant the clock can
/// tell) never does.
#[tokio::test(start_paused = true)]
async fn a_wait_timeout_beyond_thirty_years_is_not_cut_short() {
    const YEAR: Duration = Duration::from_secs(365 * 86_400);
    for timeout in [YEAR * 40, Duration::MAX] {
        let b = Bulkhead::builder(1).wait_timeout(timeout).build().unwrap();
        let held = b.acquire().await.unwrap();
        let mut waiting = Box::pin(b.acquire());
        assert!(poll!(waiting.as_mut()).is_pending());
        advance(YEAR * 31).await;
        assert!(
            poll!(waiting.as_mut()).is_pending(),
            "{timeout:?}: shed after 31 years"
        );
        if timeout == Duration::MAX {
            advance(YEAR * 100).await;
            assert!(poll!(waiting.as_mut()).is_pending(), "never shed");
            drop(held);
            assert!(waiting.await.is_ok());
        } else {
            advance(YEAR * 9).await;
            assert_eq!(waiting.await.unwrap_err(), AcquireError::TimedOut);
            drop(held);
        }
        assert_eq!((b.in_flight(), b.waiting()), (0, 0));
    }
}

/// The largest `max_in_flight` (2³¹ − 1) is accepted by `new` and `set_max_in_flight`;
/// one more is `TooLarge` for both, and leaves the limit as it was.
#[tokio::test]
async fn the_largest_max_in_flight_is_accepted_and_one_more_refused() {
    let max = (1usize << 31) - 1;
    let b = Bulkhead::new(max).unwrap();
    assert_eq!(b.max_in_flight(), max);
    let p = b.try_acquire().unwrap();
    let q = b.acquire_with(Priority::Critical).await.unwrap();
    assert_eq!(b.in_flight(), 2);
    let e = b.set_max_in_flight(max + 1).unwrap_err();
    assert_eq!(
        (e.field(), e.kind()),
        ("bulkhead.max_in_flight", ConfigErrorKind::TooLarge)
    );
    assert_eq!(b.max_in_flight(), max);
    b.set_max_in_flight(1).unwrap();
    assert_eq!(b.try_acquire().unwrap_err(), AcquireError::NoPermit);
    b.set_max_in_flight(max).unwrap();
    drop((p, q));
    assert_eq!(b.in_flight(), 0);
}

/// "A room with no normal waiter in it (every waiter critical, or a room of size zero)
/// refuses critical work too": at once, and `try_acquire_with` finds no permit.
#[tokio::test]
async fn a_waiting_room_of_zero_refuses_critical_work_at_once() {
    let b = Bulkhead::builder(1).max_waiting(0).build().unwrap();
    let _held = b.acquire().await.unwrap();
    assert_eq!(
        b.acquire_with(Priority::Critical).await.unwrap_err(),
        AcquireError::WaitingRoomFull
    );
    assert_eq!(
        b.try_acquire_with(Priority::Critical).unwrap_err(),
        AcquireError::NoPermit
    );
    assert_eq!(b.waiting(), 0);
}

/// `run`'s cancel safety: dropped while waiting, it leaves the room and `work` never
/// starts; dropped while `work` runs, the permit comes back.
#[tokio::test]
async fn run_dropped_at_each_wait_holds_nothing() {
    let b = Bulkhead::new(1).unwrap();
    let started = Arc::new(AtomicUsize::new(0));
    let held = b.acquire().await.unwrap();
    {
        let s = started.clone();
        let mut run = Box::pin(b.run(async move {
            s.fetch_add(1, Ordering::SeqCst);
        }));
        assert!(poll!(run.as_mut()).is_pending());
        assert_eq!(b.waiting(), 1);
    }
    assert_eq!(b.waiting(), 0);
    drop(held);
    assert_eq!(started.load(Ordering::SeqCst), 0, "work not started");
    {
        let mut run = Box::pin(b.run(std::future::pending::<()>()));
        assert!(poll!(run.as_mut()).is_pending());
        assert_eq!(b.in_flight(), 1);
    }
    assert_eq!((b.in_flight(), b.waiting()), (0, 0));
}

/// Every adapter, over an upstream that ends while the last item's future holds the only
/// permit: what comes lies within the bounds at every poll, every item comes, the adapter
/// fuses, and the permits are all back.
#[tokio::test(start_paused = true)]
async fn adapters_bounds_hold_and_they_fuse_when_the_upstream_ends_under_a_permit() {
    let work = |x: u32| async move {
        sleep(Duration::from_millis(10)).await;
        x
    };
    let b = Bulkhead::new(1).unwrap();
    let mut s = Box::pin(futures::stream::iter(0..5u32).bulkhead_map(b.clone(), work));
    assert_eq!(drain_checking_hints(&mut s).await, [0, 1, 2, 3, 4]);
    assert!(s.is_terminated(), "bulkhead_map");
    assert_eq!(b.in_flight(), 0);

    let mut s = Box::pin(futures::stream::iter(0..5u32).bulkhead_map_unordered(b.clone(), work));
    assert_eq!(drain_checking_hints(&mut s).await, [0, 1, 2, 3, 4]);
    assert!(s.is_terminated(), "bulkhead_map_unordered");
    assert_eq!(b.in_flight(), 0);

    let mut s = Box::pin(futures::stream::iter(0..5u32).bulkhead_spawn_map(b.clone(), work));
    assert_eq!(drain_checking_hints(&mut s).await, [0, 1, 2, 3, 4]);
    assert!(s.is_terminated(), "bulkhead_spawn_map");
    sleep(Duration::from_millis(1)).await;
    assert_eq!(b.in_flight(), 0);
}

/// A `critical_reserve` beyond `u32` is refused on `bulkhead.critical_reserve`, and the
/// message names the reserve asked for (it named `u32::MAX`, a number never given).
#[test]
fn a_reserve_beyond_u32_is_refused_with_the_number_asked_for() {
    let asked = (1usize << 40) + 7;
    let e = Bulkhead::builder(4)
        .critical_reserve(asked)
        .build()
        .unwrap_err();
    assert_eq!(
        (e.field(), e.kind()),
        ("bulkhead.critical_reserve", ConfigErrorKind::Inconsistent)
    );
    assert_eq!(
        e.to_string(),
        format!(
            "invalid bulkhead.critical_reserve: a reserve of {asked} out of 4 permits leaves none for normal work"
        )
    );
}

/// A waker that counts its wakes.
fn counting_waker() -> (std::task::Waker, Arc<AtomicUsize>) {
    struct W(Arc<AtomicUsize>);
    impl std::task::Wake for W {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
        fn wake_by_ref(self: &Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    let n = Arc::new(AtomicUsize::new(0));
    (Arc::new(W(n.clone())).into(), n)
}

/// "Normal work cannot take the last `critical_reserve` permits", so a reserve permit coming
/// back must not wake a normal waiter (it would only look and wait again): the waiter is
/// woken once, by the permit it may take.
#[test]
fn a_normal_waiter_is_not_woken_by_a_reserve_permit_coming_back() {
    use std::future::Future;
    let b = Bulkhead::builder(2).critical_reserve(1).build().unwrap();
    let normal = b.try_acquire().unwrap();
    let critical = b.try_acquire_with(Priority::Critical).unwrap();
    let (waker, wakes) = counting_waker();
    let mut cx = std::task::Context::from_waker(&waker);
    let mut w = Box::pin(b.acquire());
    assert!(w.as_mut().poll(&mut cx).is_pending());
    drop(critical);
    assert_eq!(
        wakes.load(Ordering::SeqCst),
        0,
        "woken for a permit it may not take"
    );
    let mut c2 = Box::pin(b.acquire_with(Priority::Critical));
    assert!(c2.as_mut().poll(&mut cx).is_ready());
    drop(normal);
    assert_eq!(wakes.load(Ordering::SeqCst), 1);
    assert!(w.as_mut().poll(&mut cx).is_ready());
}

/// Critical work pushing normal waiters out of a full room keeps it at its size: two
/// critical acquisitions take the places of the two normal waiters, the third is refused,
/// and the room never holds more than `max_waiting`.
#[tokio::test]
async fn critical_work_pushing_waiters_out_keeps_the_room_at_its_size() {
    let b = Bulkhead::builder(1).max_waiting(2).build().unwrap();
    let _held = b.try_acquire().unwrap();
    let mut n: Vec<_> = (0..2).map(|_| Box::pin(b.acquire())).collect();
    for w in &mut n {
        assert!(poll!(w.as_mut()).is_pending());
    }
    let mut c: Vec<_> = (0..3)
        .map(|_| Box::pin(b.acquire_with(Priority::Critical)))
        .collect();
    let mut refused = 0;
    for w in &mut c {
        if let std::task::Poll::Ready(r) = poll!(w.as_mut()) {
            assert_eq!(r.unwrap_err(), AcquireError::WaitingRoomFull);
            refused += 1;
        }
        assert!(b.waiting() <= 2, "{}", b.waiting());
    }
    assert_eq!(refused, 1);
}

/// The stream adapters are normal work: however they pass permits from a finished item to
/// the next, they never hold the critical reserve (at most 2 of 3 mapped futures at once).
#[tokio::test(start_paused = true)]
async fn the_adapters_never_take_the_critical_reserve() {
    for adapter in ["map", "unordered", "spawn"] {
        let b = Bulkhead::builder(3).critical_reserve(1).build().unwrap();
        let gauge = Gauge::default();
        let g = gauge.clone();
        let f = move |i: u32| {
            let g = g.clone();
            async move {
                let _in = g.inside();
                sleep(Duration::from_millis(u64::from(i % 3) + 1)).await;
                i
            }
        };
        let items = futures::stream::iter(0..50u32);
        let n = match adapter {
            "map" => items.bulkhead_map(b.clone(), f).count().await,
            "unordered" => items.bulkhead_map_unordered(b.clone(), f).count().await,
            _ => items.bulkhead_spawn_map(b.clone(), f).count().await,
        };
        assert_eq!(n, 50);
        assert!(gauge.max() <= 2, "{adapter}: {}", gauge.max());
        assert_eq!(b.in_flight(), 0);
    }
}

/// Random acquisitions, releases, give-ups and resizes, one step at a time, each waiter
/// polled only when its own waker was woken: after every step, the permits in flight are
/// those held, the waiters those pending, the room within its size, and no waiter sleeps
/// while a permit it may take is free (a lost wakeup would leave one asleep with the
/// permit free; a permit lost on a give-up would show in `in_flight`).
#[test]
fn no_waiter_sleeps_while_a_permit_it_may_take_is_free() {
    use std::future::Future;
    use std::task::Poll;

    // Waits that ended with a permit, and with a refusal (pushed out by critical work).
    let (mut granted, mut shed) = (0, 0);
    for seed in 1..=40u64 {
        let b = Bulkhead::builder(3)
            .critical_reserve(1)
            .max_waiting(4)
            .build()
            .unwrap();
        let mut rng = Rng(seed);
        let mut held = Vec::new();
        // (the acquisition, its priority, its waker's wakes, the wakes it has seen)
        let mut waiters = Vec::new();
        for step in 0..400 {
            let priority = if rng.next().is_multiple_of(3) {
                Priority::Critical
            } else {
                Priority::Normal
            };
            match rng.next() % 6 {
                0 => held.extend(b.try_acquire_with(priority).ok()),
                1 | 2 => {
                    let (waker, wakes) = counting_waker();
                    let mut acquire = Box::pin(b.acquire_with(priority));
                    match acquire
                        .as_mut()
                        .poll(&mut std::task::Context::from_waker(&waker))
                    {
                        Poll::Ready(Ok(p)) => held.push(p),
                        Poll::Ready(Err(_)) => {}
                        Poll::Pending => waiters.push((acquire, priority, wakes, 0, waker)),
                    }
                }
                3 if !held.is_empty() => {
                    let i = rng.next() as usize % held.len();
                    drop(held.swap_remove(i));
                }
                4 if !waiters.is_empty() => {
                    let i = rng.next() as usize % waiters.len();
                    drop(waiters.swap_remove(i));
                }
                5 => b.set_max_in_flight(2 + rng.next() as usize % 3).unwrap(),
                _ => {}
            }
            // Poll the woken ones until nothing more happens.
            loop {
                let mut changed = false;
                let mut i = 0;
                while i < waiters.len() {
                    let (acquire, _, wakes, seen, waker) = &mut waiters[i];
                    let now = wakes.load(Ordering::SeqCst);
                    if now == *seen {
                        i += 1;
                        continue;
                    }
                    *seen = now;
                    changed = true;
                    match acquire
                        .as_mut()
                        .poll(&mut std::task::Context::from_waker(waker))
                    {
                        Poll::Ready(Ok(p)) => {
                            held.push(p);
                            drop(waiters.swap_remove(i));
                            granted += 1;
                        }
                        Poll::Ready(Err(why)) => {
                            assert_eq!(why, AcquireError::WaitingRoomFull, "seed {seed}");
                            drop(waiters.swap_remove(i));
                            shed += 1;
                        }
                        Poll::Pending => i += 1,
                    }
                }
                if !changed {
                    break;
                }
            }
            let at = format!("seed {seed}, step {step}");
            assert_eq!(b.in_flight(), held.len(), "{at}");
            assert_eq!(b.waiting(), waiters.len(), "{at}");
            assert!(waiters.len() <= 4, "{at}");
            let max = b.max_in_flight();
            for (_, priority, ..) in &waiters {
                let cap = if *priority == Priority::Critical {
                    max
                } else {
                    max - 1
                };
                assert!(
                    held.len() >= cap,
                    "{at}: a {priority:?} waiter sleeps, {} of {max} held",
                    held.len()
                );
            }
        }
    }
    assert!(
        granted > 1000 && shed > 100,
        "{granted} granted, {shed} shed"
    );
}

/// `wait_timeout` "counts from the acquisition's first poll that found no permit, and it
/// ends on the timer's 1 ms tick: ... less than 2 ms after it in paused time": timeouts
/// below, at and between whole milliseconds, begun between ticks, shed no sooner than the
/// timeout and less than 2 ms after it.
#[tokio::test(start_paused = true)]
async fn a_wait_timeout_sheds_less_than_two_milliseconds_after_it() {
    let timed = |timeout| Bulkhead::builder(1).wait_timeout(timeout).build().unwrap();
    // The docs' example first (paused time starts on a tick): 0.5 ms, begun 0.9 ms past it.
    let b = timed(Duration::from_micros(500));
    let held = b.try_acquire().unwrap();
    advance(Duration::from_micros(900)).await;
    let started = Instant::now();
    assert_eq!(b.acquire().await.unwrap_err(), AcquireError::TimedOut);
    assert_eq!(started.elapsed(), Duration::from_millis(2));
    drop(held);
    let mut rng = Rng(17);
    for us in [1, 500, 999, 1_000, 1_001, 1_500, 2_000, 250_000, 250_001] {
        for _ in 0..4 {
            let timeout = Duration::from_micros(us);
            let b = timed(timeout);
            let _held = b.try_acquire().unwrap();
            advance(Duration::from_micros(rng.next() % 1_000)).await;
            let mut waiting = Box::pin(b.acquire());
            assert!(poll!(waiting.as_mut()).is_pending());
            let started = Instant::now();
            assert_eq!(waiting.await.unwrap_err(), AcquireError::TimedOut);
            let waited = started.elapsed();
            assert!(
                waited >= timeout && waited < timeout + Duration::from_millis(2),
                "a timeout of {timeout:?} shed after {waited:?}"
            );
        }
    }
}

/// Resizing with permits out and waiters queued: lowered below the permits out, no waiter
/// is granted until enough come back, and then critical work first, within the new
/// `max_in_flight`, and normal work only within its new share (never the reserve); raised,
/// the waiters left are granted at once. Every acquisition ends counted once.
#[tokio::test]
async fn resizing_with_permits_out_and_waiters_queued_keeps_the_order_and_the_reserve() {
    let b = Bulkhead::builder(4).critical_reserve(1).build().unwrap();
    let mut normal: Vec<_> = (0..3).map(|_| b.try_acquire_owned().unwrap()).collect();
    let reserve = b.try_acquire_owned_with(Priority::Critical).unwrap();
    let mut n1 = Box::pin(b.acquire_owned());
    let mut n2 = Box::pin(b.acquire_owned());
    let mut c1 = Box::pin(b.acquire_owned_with(Priority::Critical));
    for w in [&mut n1, &mut n2] {
        assert!(poll!(w.as_mut()).is_pending());
    }
    assert!(poll!(c1.as_mut()).is_pending());
    b.set_max_in_flight(2).unwrap(); // normal share: 1
    normal.pop();
    normal.pop();
    assert_eq!(
        (b.in_flight(), b.waiting()),
        (2, 3),
        "2 out, at the new max"
    );
    assert!(poll!(c1.as_mut()).is_pending());
    normal.pop();
    let Poll::Ready(c1) = poll!(c1.as_mut()) else {
        panic!("a permit under the new max goes to critical work first");
    };
    let c1 = c1.unwrap();
    assert!(poll!(n1.as_mut()).is_pending());
    drop(reserve);
    assert!(
        poll!(n1.as_mut()).is_pending(),
        "1 out of 2: the last is the reserve"
    );
    assert_eq!(
        b.stats().reserve_in_flight,
        0,
        "counted: 1 out, within the share"
    );
    drop(c1);
    let Poll::Ready(n1) = poll!(n1.as_mut()) else {
        panic!("FIFO within normal work");
    };
    assert!(poll!(n2.as_mut()).is_pending());
    b.set_max_in_flight(5).unwrap();
    let Poll::Ready(n2) = poll!(n2.as_mut()) else {
        panic!("a raised max grants at once");
    };
    drop((n1.unwrap(), n2.unwrap()));
    let s = b.stats();
    assert_eq!((s.in_flight, s.waiting, s.reserve_in_flight), (0, 0, 0));
    assert_eq!((s.admitted, s.waited, s.admitted_from_reserve), (7, 3, 2));
    assert_eq!(s.acquisitions(), 7);
}
