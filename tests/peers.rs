//! Migrating from flowgate's peers: the programs users write with governor, leaky-bucket,
//! tokio's mpsc and `Semaphore`, tower's limit layers and Netflix's concurrency-limits,
//! written with flowgate as its docs say, and checked against what the peer does (side by
//! side where the peer is a dev-dependency and can run on a fake or paused clock).

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use flowgate::bulkhead::{AcquireError, Bulkhead};
use flowgate::channel::{self, ReserveError, SendError, TryRecvError};
use flowgate::gate::{GateError, Limit, MemoryGate};
use flowgate::limit::{Limiter, TokenBucket};
use flowgate::pace::Pacer;
use flowgate::{CostError, FlowStreamExt, Quota, Rate};
use futures::StreamExt;
use governor::clock::{Clock, FakeRelativeClock};
use tokio::time::Instant;

fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).unwrap()
}

/// governor's direct limiter and flowgate's token bucket, on one trace of costs and
/// advances: the same admissions, and a rejection's wait is governor's `wait_time_from`.
#[test]
fn governor_direct_check_n_and_wait_times_match() {
    let cases = [
        (
            governor::Quota::per_second(nz(5)),
            Quota::per_second(5).unwrap(),
        ),
        (
            governor::Quota::with_period(Duration::from_millis(100))
                .unwrap()
                .allow_burst(nz(3)),
            Quota::per(1, Duration::from_millis(100))
                .unwrap()
                .burst(3)
                .unwrap(),
        ),
        (
            governor::Quota::per_minute(nz(60)).allow_burst(nz(10)),
            Quota::per_minute(60).unwrap().burst(10).unwrap(),
        ),
    ];
    for (gq, fq) in cases {
        let clock = FakeRelativeClock::default();
        let peer = governor::RateLimiter::direct_with_clock(gq, clock.clone());
        let mut ours = Limiter::new(TokenBucket::new(fq));
        let mut seed = 7u64;
        let mut now = Duration::ZERO;
        for step in 0..2_000 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let cost = 1 + ((seed >> 33) % u64::from(fq.burst_size() + 1)) as u32;
            let advance = Duration::from_millis((seed >> 45) % 150);
            clock.advance(advance);
            now += advance;
            let theirs = peer.check_n(nz(cost));
            let d = ours.check(now, cost);
            match theirs {
                Err(_insufficient) => {
                    assert_eq!(
                        d,
                        Err(CostError::ExceedsCapacity {
                            cost,
                            capacity: u64::from(fq.burst_size())
                        }),
                        "{fq:?} step {step}"
                    );
                }
                Ok(Ok(())) => {
                    let d = d.unwrap();
                    assert!(d.allowed, "{fq:?} step {step} cost {cost}: {d:?}");
                }
                Ok(Err(not_until)) => {
                    let d = d.unwrap();
                    assert!(!d.allowed, "{fq:?} step {step} cost {cost}");
                    let wait = not_until.wait_time_from(clock.now());
                    assert_eq!(d.retry_after, wait, "{fq:?} step {step} cost {cost}");
                }
            }
        }
    }
}

/// governor's keyed limiter and `MemoryGate` give the same answers per key, and the gate
/// keeps its memory bounded where governor's grows until `retain_recent`.
#[tokio::test(start_paused = true)]
async fn governor_keyed_matches_memory_gate() {
    let clock = FakeRelativeClock::default();
    let peer = governor::RateLimiter::hashmap_with_clock(
        governor::Quota::per_second(nz(2)).allow_burst(nz(4)),
        clock.clone(),
    );
    let gate = MemoryGate::new(Limit::TokenBucket(
        Quota::per_second(2).unwrap().burst(4).unwrap(),
    ));
    for round in 0..200u64 {
        let advance = Duration::from_millis(round * 37 % 400);
        clock.advance(advance);
        tokio::time::advance(advance).await;
        for key in ["a", "b", "c"] {
            let cost = 1 + (round % 3) as u32;
            let theirs = peer.check_key_n(&key.to_string(), nz(cost)).unwrap();
            let d = gate.check(key, cost).unwrap();
            assert_eq!(d.allowed, theirs.is_ok(), "round {round} key {key}");
            if let Err(not_until) = theirs {
                assert_eq!(d.retry_after, not_until.wait_time_from(clock.now()));
            }
        }
    }
    // governor's check_key_n above the burst: InsufficientCapacity; flowgate: a typed error.
    assert!(peer.check_key_n(&"a".to_string(), nz(5)).is_err());
    assert!(matches!(
        gate.check("a", 5),
        Err(GateError::Cost(CostError::ExceedsCapacity { cost: 5, .. }))
    ));
    // Idle keys: governor keeps them until `retain_recent`; the gate's `sweep` evicts them.
    tokio::time::advance(Duration::from_secs(10)).await;
    assert_eq!(gate.sweep(), 3);
    assert!(gate.is_empty());
}

/// governor's `until_ready` on a direct limiter of 10/s with its default burst of 10: the
/// first ten pass at once, then one every 100 ms. A pacer built with that burst does the
/// same.
#[tokio::test(start_paused = true)]
async fn governor_until_ready_is_a_pacer_with_the_quotas_burst() {
    let pacer = Pacer::builder(Rate::per_second(10).unwrap())
        .burst(10)
        .build()
        .unwrap();
    let start = Instant::now();
    let mut at = Vec::new();
    for _ in 0..15 {
        pacer.until_ready(1).await.unwrap();
        at.push(start.elapsed());
    }
    let want: Vec<Duration> = (0..15u64)
        .map(|i| Duration::from_millis(i.saturating_sub(9) * 100))
        .collect();
    assert_eq!(at, want);
    // until_n_ready(n > burst): governor answers InsufficientCapacity; the pacer too.
    assert_eq!(
        pacer.until_ready(11).await,
        Err(CostError::ExceedsCapacity {
            cost: 11,
            capacity: 10
        })
    );
}

/// leaky-bucket's `builder().max(10).initial(10).refill(1).interval(100 ms)` and its
/// `acquire(n)`: a pacer of 1 per 100 ms with a burst of 10 releases the same costs no
/// later, and by the end of a long run no more than leaky-bucket does.
#[tokio::test(start_paused = true)]
async fn leaky_bucket_acquire_n_is_until_ready_n() {
    let peer = leaky_bucket::RateLimiter::builder()
        .max(10)
        .initial(10)
        .refill(1)
        .interval(Duration::from_millis(100))
        .build();
    let pacer = Pacer::builder(Rate::per(1, Duration::from_millis(100)).unwrap())
        .burst(10)
        .build()
        .unwrap();
    let costs = [3u32, 4, 3, 1, 5, 2, 2, 7, 1, 1, 10, 4];
    let start = Instant::now();
    let mut theirs = Vec::new();
    for &c in &costs {
        peer.acquire(c as usize).await;
        theirs.push(start.elapsed());
    }
    let start = Instant::now();
    let mut ours = Vec::new();
    for &c in &costs {
        pacer.until_ready(c).await.unwrap();
        ours.push(start.elapsed());
    }
    for (i, (o, t)) in ours.iter().zip(&theirs).enumerate() {
        assert!(
            o <= t,
            "acquisition {i}: {o:?} after leaky-bucket's {t:?}\n{ours:?}\n{theirs:?}"
        );
    }
}

/// leaky-bucket's `fair(true)`: tasks waiting at once are served in the order they came.
#[tokio::test(start_paused = true)]
async fn leaky_bucket_fair_order_across_tasks() {
    let pacer = Pacer::builder(Rate::per(1, Duration::from_millis(100)).unwrap())
        .burst(1)
        .build()
        .unwrap();
    pacer.until_ready(1).await.unwrap();
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..8u32 {
        let pacer = pacer.clone();
        let order = order.clone();
        tasks.push(tokio::spawn(async move {
            pacer.until_ready(1).await.unwrap();
            order.lock().unwrap().push(i);
        }));
        tokio::task::yield_now().await;
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(*order.lock().unwrap(), (0..8).collect::<Vec<_>>());
}

/// tokio mpsc: `rx.close()` stops new sends, a permit reserved before still sends, every
/// buffered item is received, then `None`; a sender waiting for room gets its item back.
#[tokio::test]
async fn mpsc_close_drains_everything() {
    let (tx, mut rx) = channel::bounded::<u32>(2).unwrap();
    tx.try_send(1).unwrap();
    let permit = tx.try_reserve().unwrap();
    assert!(matches!(tx.try_reserve(), Err(ReserveError::Full)));
    let waiting = {
        let tx = tx.clone();
        tokio::spawn(async move { tx.send(3).await })
    };
    tokio::task::yield_now().await;
    rx.close();
    permit.send(2);
    assert_eq!(waiting.await.unwrap(), Err(SendError::Closed(3)));
    assert_eq!(tx.try_send(4), Err(SendError::Closed(4)));
    assert!(matches!(tx.try_reserve(), Err(ReserveError::Closed)));
    assert_eq!(rx.recv().await, Some(1));
    assert_eq!(rx.recv().await, Some(2));
    assert_eq!(rx.recv().await, None);
    assert_eq!(rx.try_recv(), Err(TryRecvError::Closed));
    // recv_many with a limit of 0 returns 0 at once, as tokio's.
    let mut buf = Vec::new();
    assert_eq!(rx.recv_many(&mut buf, 0).await, 0);
}

/// tokio mpsc: every sender dropped ends the stream after the buffered items; every
/// receiver dropped resolves `closed()` and hands items back.
#[tokio::test]
async fn mpsc_sender_and_receiver_drop() {
    let (tx, rx) = channel::bounded::<u32>(4).unwrap();
    for i in 0..3 {
        tx.send(i).await.unwrap();
    }
    drop(tx);
    assert_eq!(rx.collect::<Vec<_>>().await, vec![0, 1, 2]);

    let (tx, rx) = channel::bounded::<u32>(4).unwrap();
    drop(rx);
    tx.closed().await;
    assert_eq!(tx.send(9).await, Err(SendError::Closed(9)));
}

/// tokio's `Semaphore`: `close()` fails waiters and later acquisitions, permits held stay
/// valid and come back; `add_permits` is `set_max_in_flight`.
#[tokio::test]
async fn semaphore_close_and_add_permits() {
    let sem = Bulkhead::new(1).unwrap();
    let held = sem.acquire_owned().await.unwrap();
    let waiter = {
        let sem = sem.clone();
        tokio::spawn(async move { sem.acquire_owned().await.map(drop) })
    };
    tokio::task::yield_now().await;
    assert_eq!(sem.waiting(), 1);
    sem.close();
    assert_eq!(waiter.await.unwrap(), Err(AcquireError::Closed));
    assert_eq!(sem.in_flight(), 1);
    drop(held);
    assert_eq!(sem.in_flight(), 0);
    assert!(matches!(sem.try_acquire(), Err(AcquireError::Closed)));

    let sem = Bulkhead::new(1).unwrap();
    let _a = sem.acquire().await.unwrap();
    let waiter = {
        let sem = sem.clone();
        tokio::spawn(async move { sem.acquire_owned().await.map(drop) })
    };
    tokio::task::yield_now().await;
    sem.set_max_in_flight(2).unwrap();
    assert_eq!(waiter.await.unwrap(), Ok(()));
}

/// governor's `until_key_ready` over a stream: `gated` on a `MemoryGate` lets items of a
/// key through at its rate, waiting exactly the gate's `retry_after`.
#[tokio::test(start_paused = true)]
async fn governor_until_key_ready_is_gated() {
    let gate = MemoryGate::new(Limit::TokenBucket(
        Quota::per(1, Duration::from_millis(100))
            .unwrap()
            .burst(2)
            .unwrap(),
    ));
    let start = Instant::now();
    let at: Vec<Duration> = futures::stream::iter(0..6)
        .gated(gate, |_: &i32| "tenant")
        .map(|_| start.elapsed())
        .collect()
        .await;
    let ms = |m| Duration::from_millis(m);
    assert_eq!(at, vec![ms(0), ms(0), ms(100), ms(200), ms(300), ms(400)]);
}

/// leaky-bucket's `acquire(25)` on `max(10)`: waits across refills. flowgate's docs send
/// a cost above the burst to `leaky_cost`, which pays it in chunks: the item leaves once
/// its 25 units have been released at the rate (10 at once, 15 more at 1 per 100 ms).
#[tokio::test(start_paused = true)]
async fn leaky_bucket_acquire_above_max_is_leaky_cost_in_chunks() {
    let peer = leaky_bucket::RateLimiter::builder()
        .max(10)
        .initial(10)
        .refill(1)
        .interval(Duration::from_millis(100))
        .build();
    let start = Instant::now();
    peer.acquire(25).await;
    let theirs = start.elapsed();
    let pacer = Pacer::builder(Rate::per(1, Duration::from_millis(100)).unwrap())
        .burst(10)
        .build()
        .unwrap();
    let start = Instant::now();
    let at: Vec<Duration> = futures::stream::iter([25u32, 1])
        .leaky_cost(pacer, |c| *c)
        .map(|_| start.elapsed())
        .collect()
        .await;
    assert_eq!(
        at[0],
        Duration::from_millis(1_500),
        "leaky-bucket: {theirs:?}"
    );
    assert_eq!(at[1], Duration::from_millis(1_600));
}

/// A server's `Retry-After` fed to the adaptive pacer: no waiter passes before it.
#[tokio::test(start_paused = true)]
async fn adaptive_pacer_never_passes_before_retry_after() {
    let pacer = flowgate::pace::AdaptivePacer::builder(Rate::per_second(100).unwrap())
        .build()
        .unwrap();
    let start = Instant::now();
    pacer.until_ready(1).await.unwrap();
    pacer.on_back_pressure(Some(Duration::from_millis(2_500)));
    let waiting: Vec<_> = (0..3)
        .map(|_| {
            let p = pacer.pacer().clone();
            tokio::spawn(async move {
                p.until_ready(1).await.unwrap();
                Instant::now()
            })
        })
        .collect();
    for w in waiting {
        let at = w.await.unwrap();
        assert!(
            at - start >= Duration::from_millis(2_500),
            "{:?}",
            at - start
        );
    }
}

/// Every gate limit keeps the contract a governor user relies on with `NotUntil`: a
/// rejection's `retry_after` is when the same request passes, never earlier, never later.
#[tokio::test(start_paused = true)]
async fn memory_gate_retry_after_is_exact_for_every_limit() {
    let period = Duration::from_millis(1_000);
    let limits = [
        Limit::TokenBucket(Quota::per(4, period).unwrap().burst(4).unwrap()),
        Limit::FixedWindow(Rate::per(4, period).unwrap()),
        Limit::SlidingLog(Rate::per(4, period).unwrap()),
        Limit::SlidingWindow(Rate::per(4, period).unwrap()),
    ];
    for limit in limits {
        let gate = MemoryGate::new(limit);
        let mut seed = 3u64;
        for step in 0..300 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let cost = 1 + ((seed >> 33) % 4) as u32;
            tokio::time::advance(Duration::from_millis((seed >> 45) % 300)).await;
            let d = gate.check("k", cost).unwrap();
            if d.allowed {
                continue;
            }
            let wait = d.retry_after;
            assert!(!wait.is_zero(), "{limit:?} step {step}");
            // Just before: still rejected (a probe consumes nothing when rejected).
            tokio::time::advance(wait - Duration::from_nanos(1)).await;
            let early = gate.check("k", cost).unwrap();
            assert!(
                !early.allowed,
                "{limit:?} step {step}: admitted 1 ns before {wait:?}"
            );
            tokio::time::advance(Duration::from_nanos(1)).await;
            let d = gate.check("k", cost).unwrap();
            assert!(
                d.allowed,
                "{limit:?} step {step}: rejected at retry_after {wait:?}: {d:?}"
            );
        }
    }
}

/// tower_governor answers a rejection with a 429 whose wait is the limiter's; flowgate's
/// `Retry-After` is never shorter than the gate's `retry_after` (rounded up), whatever the
/// request's cost.
#[cfg(feature = "http")]
#[tokio::test(start_paused = true)]
async fn rate_limit_layer_retry_after_covers_the_gates_wait() {
    use bytes::Bytes;
    use flowgate::http::{Constant, Policy, RateLimitLayer};
    use http::{Request, Response, StatusCode};
    use http_body_util::Full;
    use tower::{Layer, ServiceExt, service_fn};

    let quota = Quota::per(1, Duration::from_millis(700))
        .unwrap()
        .burst(5)
        .unwrap();
    let gate = MemoryGate::new(Limit::TokenBucket(quota));
    let layer = RateLimitLayer::builder(gate.clone())
        .policy(Policy::new("all", quota, Constant::new("x")))
        .cost(|req| {
            req.headers
                .get("cost")
                .and_then(|v| v.to_str().ok()?.parse().ok())
                .unwrap_or(1)
        })
        .build()
        .unwrap();
    let svc = layer.layer(service_fn(|_req: Request<Full<Bytes>>| async {
        Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
    }));
    let call = |cost: u32| {
        let svc = svc.clone();
        async move {
            let req = Request::get("/")
                .header("cost", cost.to_string())
                .body(Full::default())
                .unwrap();
            svc.oneshot(req).await.unwrap()
        }
    };
    assert_eq!(call(5).await.status(), StatusCode::OK);
    for cost in [1u32, 3, 5] {
        let res = call(cost).await;
        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
        let secs: u64 = res.headers()["retry-after"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        // Wait what the client was told, then the same request passes.
        tokio::time::advance(Duration::from_secs(secs)).await;
        let res = call(cost).await;
        assert_eq!(
            res.status(),
            StatusCode::OK,
            "cost {cost}: Retry-After {secs} too short"
        );
        // Drain the bucket again.
        tokio::time::advance(Duration::from_secs(10)).await;
        assert_eq!(call(5).await.status(), StatusCode::OK);
    }
}

/// tokio's `Semaphore` is fair: a permit given back while tasks wait goes to the first of
/// them, never to a `try_acquire` that comes after. The bulkhead serves waiters FIFO too.
#[tokio::test]
async fn semaphore_fairness_a_newcomer_never_takes_a_waiters_permit() {
    let sem = Bulkhead::new(1).unwrap();
    let held = sem.try_acquire_owned().unwrap();
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..3 {
        let sem = sem.clone();
        let order = order.clone();
        tasks.push(tokio::spawn(async move {
            let p = sem.acquire_owned().await.unwrap();
            order.lock().unwrap().push(i);
            tokio::task::yield_now().await;
            drop(p);
        }));
        tokio::task::yield_now().await;
    }
    assert_eq!(sem.waiting(), 3);
    drop(held);
    assert!(
        sem.try_acquire().is_err(),
        "a newcomer took the permit of a waiter"
    );
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(*order.lock().unwrap(), vec![0, 1, 2]);
}

/// tokio's mpsc gives a freed slot to the first waiting sender: a `try_send` that comes
/// after finds the channel full, and the waiting senders' items arrive in order.
#[tokio::test]
async fn mpsc_fairness_a_freed_slot_goes_to_the_waiting_sender() {
    let (tx, mut rx) = channel::bounded::<u32>(1).unwrap();
    tx.try_send(0).unwrap();
    let mut tasks = Vec::new();
    for i in 1..4 {
        let tx = tx.clone();
        tasks.push(tokio::spawn(async move { tx.send(i).await.unwrap() }));
        tokio::task::yield_now().await;
    }
    assert_eq!(rx.recv().await, Some(0));
    assert!(matches!(tx.try_send(9), Err(SendError::Full(9))));
    let mut got = Vec::new();
    for _ in 1..4 {
        got.push(rx.recv().await.unwrap());
    }
    assert_eq!(got, vec![1, 2, 3]);
    for t in tasks {
        t.await.unwrap();
    }
}

/// A receiver that took a batch and is dropped after `close` gives its items back: the
/// other receivers still get every item (MPMC, as async-channel / flume).
#[tokio::test]
async fn mpmc_close_then_drop_a_receiver_loses_nothing() {
    let (tx, mut rx1) = channel::bounded::<u32>(64).unwrap();
    let mut rx2 = rx1.clone();
    for i in 0..40 {
        tx.try_send(i).unwrap();
    }
    assert_eq!(rx1.recv().await, Some(0));
    tx.close();
    drop(rx1);
    let mut rest = Vec::new();
    while let Some(i) = rx2.recv().await {
        rest.push(i);
    }
    assert_eq!(rest, (1..40).collect::<Vec<_>>());
}

/// leaky-bucket in front of a queue: when the upstream ends, a `leaky_queue` releases
/// everything it holds at the rate before it ends.
#[tokio::test(start_paused = true)]
async fn leaky_queue_drains_when_the_upstream_ends() {
    let pacer = Pacer::builder(Rate::per_second(10).unwrap())
        .burst(1)
        .build()
        .unwrap();
    let out: Vec<u32> = futures::stream::iter(0..8)
        .leaky_queue(
            pacer,
            std::num::NonZeroUsize::new(8).unwrap(),
            flowgate::Overflow::DropNewest,
        )
        .collect()
        .await;
    assert_eq!(out, (0..8).collect::<Vec<_>>());
}

/// Pacer::check after a waiter gave up: the line moves on, and `check`'s `retry_after` is
/// when `until_ready` would pass.
#[tokio::test(start_paused = true)]
async fn pacer_check_retry_after_matches_until_ready() {
    let pacer = Pacer::builder(Rate::per(1, Duration::from_millis(100)).unwrap())
        .burst(3)
        .build()
        .unwrap();
    for _ in 0..3 {
        assert!(pacer.check(1).unwrap().allowed);
    }
    let d = pacer.check(2).unwrap();
    assert!(!d.allowed);
    let start = Instant::now();
    pacer.until_ready(2).await.unwrap();
    assert_eq!(start.elapsed(), d.retry_after);
}

/// A semaphore resized at runtime (tokio: `add_permits`, `forget_permits`): shrinking takes
/// effect as permits come back, growing wakes as many waiters as there is new room.
#[tokio::test]
async fn bulkhead_resize_matches_a_semaphore_resized() {
    let sem = Bulkhead::new(3).unwrap();
    let held: Vec<_> = (0..3).map(|_| sem.try_acquire_owned().unwrap()).collect();
    let waiters: Vec<_> = (0..4)
        .map(|_| {
            let sem = sem.clone();
            tokio::spawn(async move { sem.acquire_owned().await.unwrap() })
        })
        .collect();
    tokio::task::yield_now().await;
    assert_eq!(sem.waiting(), 4);
    sem.set_max_in_flight(1).unwrap();
    let mut held = held.into_iter();
    drop(held.next());
    drop(held.next());
    tokio::task::yield_now().await;
    assert_eq!((sem.in_flight(), sem.waiting()), (1, 4));
    drop(held.next());
    tokio::task::yield_now().await;
    assert_eq!((sem.in_flight(), sem.waiting()), (1, 3));
    sem.set_max_in_flight(4).unwrap();
    tokio::task::yield_now().await;
    assert_eq!((sem.in_flight(), sem.waiting()), (4, 0));
    for w in waiters {
        drop(w.await.unwrap());
    }
    assert_eq!(sem.in_flight(), 0);
}

/// tower's `ConcurrencyLimit` holds requests past the limit until one finishes, in order;
/// a `ShedLayer` with `wait(true)` over a bulkhead does it with a bounded wait.
#[cfg(feature = "http")]
#[tokio::test(start_paused = true)]
async fn shed_layer_waiting_is_a_concurrency_limit() {
    use bytes::Bytes;
    use flowgate::http::ShedLayer;
    use http::{Request, Response, StatusCode};
    use http_body_util::Full;
    use tower::{Layer, ServiceExt, service_fn};

    let bulkhead = Bulkhead::builder(2)
        .wait_timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let layer = ShedLayer::builder(bulkhead.clone())
        .wait(true)
        .build()
        .unwrap();
    let svc = layer.layer(service_fn(|_req: Request<Full<Bytes>>| async {
        tokio::time::sleep(Duration::from_secs(1)).await;
        Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
    }));
    let start = Instant::now();
    let calls: Vec<_> = (0..5)
        .map(|_| {
            let svc = svc.clone();
            tokio::spawn(async move {
                let res = svc
                    .oneshot(Request::get("/").body(Full::default()).unwrap())
                    .await
                    .unwrap();
                use http_body_util::BodyExt;
                let status = res.status();
                let _ = res.into_body().collect().await;
                (status, Instant::now() - start)
            })
        })
        .collect();
    let mut done = Vec::new();
    for c in calls {
        done.push(c.await.unwrap());
    }
    assert!(done.iter().all(|(s, _)| *s == StatusCode::OK), "{done:?}");
    let mut at: Vec<u64> = done.iter().map(|(_, d)| d.as_secs()).collect();
    at.sort();
    assert_eq!(at, vec![1, 1, 2, 2, 3]);
    assert_eq!(bulkhead.in_flight(), 0);
}

/// governor's `StateInformationMiddleware`: after an admitted `check`, the snapshot's
/// `remaining_burst_capacity` is what flowgate's decision calls `remaining`.
#[test]
fn governor_remaining_burst_capacity_is_remaining() {
    use governor::middleware::StateInformationMiddleware;
    let clock = FakeRelativeClock::default();
    let peer = governor::RateLimiter::direct_with_clock(
        governor::Quota::per_second(nz(4)).allow_burst(nz(6)),
        clock.clone(),
    )
    .with_middleware::<StateInformationMiddleware>();
    let mut ours = Limiter::new(TokenBucket::new(
        Quota::per_second(4).unwrap().burst(6).unwrap(),
    ));
    let mut now = Duration::ZERO;
    for step in 0..400u64 {
        let advance = Duration::from_millis(step * 97 % 330);
        clock.advance(advance);
        now += advance;
        let theirs = peer.check();
        let d = ours.check(now, 1).unwrap();
        assert_eq!(d.allowed, theirs.is_ok(), "step {step}");
        if let Ok(snapshot) = theirs {
            assert_eq!(
                d.remaining,
                u64::from(snapshot.remaining_burst_capacity()),
                "step {step} at {now:?}"
            );
        }
    }
}

/// tokio drops what is buffered with the last receiver; flowgate hands it to `on_drop` and
/// counts it, the items of the receiver's own batch included, and a permit used after that
/// is counted too.
#[tokio::test]
async fn mpsc_last_receiver_dropped_with_a_batch_counts_every_item() {
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let hook = seen.clone();
    let (tx, mut rx) = channel::builder::<u32>(64)
        .on_drop(move |item, _| hook.lock().unwrap().push(item))
        .build()
        .unwrap();
    for i in 0..40 {
        tx.try_send(i).unwrap();
    }
    let permit = tx.try_reserve().unwrap();
    assert_eq!(rx.recv().await, Some(0));
    drop(rx);
    permit.send(40);
    let mut seen = seen.lock().unwrap().clone();
    seen.sort();
    assert_eq!(seen, (1..41).collect::<Vec<_>>());
    let stats = tx.stats();
    assert_eq!((stats.sent, stats.received, stats.dropped), (41, 1, 40));
}

/// A user coming from tower's `RateLimit` (n per window) gives the gate a window: the
/// layer decides by its policies' token buckets only, as its docs say, not by the gate's
/// own limit.
#[cfg(feature = "http")]
#[tokio::test(start_paused = true)]
async fn rate_limit_layer_decides_by_its_policies_not_the_gates_limit() {
    use bytes::Bytes;
    use flowgate::http::{Constant, Policy, RateLimitLayer};
    use http::{Request, Response, StatusCode};
    use http_body_util::Full;
    use tower::{Layer, ServiceExt, service_fn};

    let gate = MemoryGate::new(Limit::FixedWindow(Rate::per_second(1).unwrap()));
    let layer = RateLimitLayer::builder(gate)
        .policy(Policy::new(
            "all",
            Quota::per_second(3).unwrap(),
            Constant::new("x"),
        ))
        .build()
        .unwrap();
    let svc = layer.layer(service_fn(|_req: Request<Full<Bytes>>| async {
        Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::new())))
    }));
    let mut statuses = Vec::new();
    for _ in 0..4 {
        let req = Request::get("/").body(Full::default()).unwrap();
        statuses.push(svc.clone().oneshot(req).await.unwrap().status());
    }
    assert_eq!(
        statuses,
        [
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS
        ]
    );
}

/// leaky-bucket releases what a dropped acquisition reserved: the task behind it passes
/// when the dropped one would have, not a turn later.
#[tokio::test(start_paused = true)]
async fn leaky_bucket_dropped_waiter_gives_its_turn_to_the_next() {
    let pacer = Pacer::builder(Rate::per_second(1).unwrap())
        .burst(1)
        .build()
        .unwrap();
    let start = Instant::now();
    pacer.until_ready(1).await.unwrap();
    let b = {
        let p = pacer.clone();
        tokio::spawn(async move { p.until_ready(1).await })
    };
    tokio::task::yield_now().await;
    let c = {
        let p = pacer.clone();
        tokio::spawn(async move {
            p.until_ready(1).await.unwrap();
            Instant::now()
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    b.abort();
    let at = c.await.unwrap();
    assert_eq!(at - start, Duration::from_secs(1));
}

/// `tokio::time::timeout(d, semaphore.acquire())`: a bulkhead's `wait_timeout` sheds the
/// wait at `d`, and the waiter behind it still gets the next permit.
#[tokio::test(start_paused = true)]
async fn bulkhead_wait_timeout_is_a_timed_semaphore_acquire() {
    let sem = Bulkhead::builder(1)
        .wait_timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let held = sem.try_acquire_owned().unwrap();
    let start = Instant::now();
    let first = {
        let sem = sem.clone();
        tokio::spawn(async move { (sem.acquire_owned().await.map(drop), Instant::now()) })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let second = {
        let sem = sem.clone();
        tokio::spawn(async move { (sem.acquire_owned().await.map(drop), Instant::now()) })
    };
    let (r, at) = first.await.unwrap();
    assert_eq!(r, Err(AcquireError::TimedOut));
    assert_eq!(at - start, Duration::from_millis(300));
    drop(held);
    let (r, at) = second.await.unwrap();
    assert_eq!(r, Ok(()));
    assert_eq!(at - start, Duration::from_millis(300));
    assert_eq!(sem.in_flight(), 0);
}
