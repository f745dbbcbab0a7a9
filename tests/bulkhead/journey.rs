//! A team's walk: a bulkhead with a critical reserve, a waiting room and a timeout in front
//! of a fragile dependency, its limit adaptive, shared by requests of both priorities and
//! by the three stream adapters (slow, failing and dropped mapped futures), while the limit
//! is cut below the permits out and grows back, then closed with work waiting.

use std::task::Poll;

use flowgate::adaptive::{Aimd, Outcome};

use super::*;

/// The dependency: answers after `ms`, fails (back-pressure) on items divisible by 7, and
/// counts the calls inside it at once.
async fn call(inside: &Gauge, ms: u64, item: u32) -> Result<u32, u32> {
    let _in = inside.inside();
    sleep(Duration::from_millis(ms)).await;
    if item.is_multiple_of(7) {
        Err(item)
    } else {
        Ok(item)
    }
}

/// Normal permits a fresh `try_acquire` gets, then critical ones on top: what is free.
fn free(b: &Bulkhead) -> (usize, usize) {
    let normal: Vec<_> = std::iter::from_fn(|| b.try_acquire().ok()).collect();
    let critical: Vec<_> =
        std::iter::from_fn(|| b.try_acquire_with(Priority::Critical).ok()).collect();
    (normal.len(), critical.len())
}

#[tokio::test(start_paused = true)]
async fn an_adaptive_bulkhead_shared_by_requests_and_adapters_through_cuts_growth_and_close() {
    let b = Bulkhead::builder(8)
        .critical_reserve(2)
        .max_waiting(3)
        .wait_timeout(Duration::from_millis(40))
        .adaptive(
            Aimd::builder()
                .initial(6)
                .timeout(Duration::from_secs(1))
                .build()
                .unwrap(),
        )
        .name("journey")
        .build()
        .unwrap();
    // The algorithm's limit is the normal share; the reserve comes on top.
    assert_eq!(b.max_in_flight(), 8);
    let inside = Gauge::default();

    // Requests: hold the whole normal share, then the reserve.
    let mut held: Vec<_> = (0..6).map(|_| b.try_acquire().unwrap()).collect();
    assert_eq!(b.try_acquire().unwrap_err(), AcquireError::NoPermit);
    let c1 = b.try_acquire_with(Priority::Critical).unwrap();
    let c2 = b.try_acquire_with(Priority::Critical).unwrap();
    assert_eq!(b.stats().reserve_in_flight, 2);

    // Three normal waiters fill the room; a fourth is shed at once; a critical one pushes
    // the newest normal one out.
    let mut w: Vec<_> = (0..3).map(|_| Box::pin(b.acquire())).collect();
    for a in &mut w {
        assert!(poll!(a.as_mut()).is_pending());
    }
    assert_eq!(
        b.acquire().await.unwrap_err(),
        AcquireError::WaitingRoomFull
    );
    let mut crit = Box::pin(b.acquire_with(Priority::Critical));
    assert!(poll!(crit.as_mut()).is_pending());
    assert_eq!(
        poll!(w[2].as_mut()).map(|r| r.map(drop)),
        Poll::Ready(Err(AcquireError::WaitingRoomFull))
    );
    // Back-pressure on two normal calls: the limit is cut below the permits out (8 in
    // flight, 6 × 0.9 = 5 for normal work plus the reserve: 7), once per congestion epoch.
    held.pop().unwrap().record(Outcome::BackPressure);
    assert_eq!(b.max_in_flight(), 7);
    held.pop().unwrap().record(Outcome::BackPressure);
    assert_eq!(b.max_in_flight(), 7, "one cut per epoch");
    // The second permit back left 6 of 7: granted to the critical waiter (critical work
    // first), the normal ones wait for their share.
    assert_eq!(b.in_flight(), 7);
    let Poll::Ready(Ok(crit)) = poll!(crit.as_mut()) else {
        panic!("the critical waiter was granted")
    };
    assert!(poll!(w[0].as_mut()).is_pending());
    // A critical permit back: 6 of 7, but normal work (4 + critical ones out) is at its
    // share only when in flight is below 5.
    drop(c1);
    assert!(poll!(w[0].as_mut()).is_pending());
    drop(c2);
    assert!(poll!(w[0].as_mut()).is_pending(), "5 in flight, share 5");
    drop(held.pop());
    let p0 = poll!(w[0].as_mut());
    assert!(matches!(p0, Poll::Ready(Ok(_))), "served first");
    // The second waiter times out; the first request's permit is dropped unrecorded.
    sleep(Duration::from_millis(41)).await;
    assert_eq!(
        poll!(w[1].as_mut()).map(|r| r.map(drop)),
        Poll::Ready(Err(AcquireError::TimedOut))
    );
    drop((p0, w, crit));
    drop(held);
    assert_eq!((b.in_flight(), b.waiting()), (0, 0));
    assert_eq!(
        free(&b),
        (5, 2),
        "in_flight + available == max_in_flight at rest"
    );

    // The adapters share it with slow, failing and dropped futures.
    let (seen, hook) = recorder();
    let ordered = BulkheadMap::builder(futures::stream::iter(0..40u32), b.clone(), {
        let inside = inside.clone();
        move |i| {
            let inside = inside.clone();
            // A slow head of line every ten items.
            async move { call(&inside, if i % 10 == 0 { 30 } else { 3 }, i).await }
        }
    })
    .on_drop(hook)
    .build()
    .unwrap();
    let (seen_u, hook_u) = recorder();
    let unordered = BulkheadMapUnordered::builder(futures::stream::iter(100..140u32), b.clone(), {
        let inside = inside.clone();
        move |i| {
            let inside = inside.clone();
            async move { call(&inside, u64::from(i % 5) + 1, i).await }
        }
    })
    .on_drop(hook_u)
    .build()
    .unwrap();
    let (seen_s, hook_s) = recorder();
    let spawned = BulkheadSpawnMap::builder(futures::stream::iter(200..240u32), b.clone(), {
        let inside = inside.clone();
        move |i| {
            let inside = inside.clone();
            async move { call(&inside, u64::from(i % 3) * 4 + 1, i).await }
        }
    })
    .on_drop(hook_s)
    .build()
    .unwrap();
    let consume = |s: std::pin::Pin<Box<dyn Stream<Item = Result<u32, u32>> + Send>>| {
        tokio::spawn(async move {
            let mut s = s;
            let mut out = Vec::new();
            while let Some(x) = s.next().await {
                out.push(x);
                // A consumer with a little work of its own.
                sleep(Duration::from_millis(1)).await;
            }
            out
        })
    };
    let ordered = consume(Box::pin(ordered));
    let unordered = consume(Box::pin(unordered));
    let spawned = consume(Box::pin(spawned));
    // Requests meanwhile: critical ones in the reserve, normal ones given up at random.
    let requests = {
        let b = b.clone();
        let inside = inside.clone();
        tokio::spawn(async move {
            let mut rng = Rng(5);
            for i in 0..60u32 {
                let priority = if i % 4 == 0 {
                    Priority::Critical
                } else {
                    Priority::Normal
                };
                let patience = Duration::from_millis(rng.next() % 30);
                let _ = tokio::time::timeout(patience, async {
                    if let Ok(p) = b.acquire_with(priority).await {
                        let r = call(&inside, rng.next() % 10, i).await;
                        p.record(if r.is_ok() {
                            Outcome::Ok
                        } else {
                            Outcome::BackPressure
                        });
                    }
                })
                .await;
                sleep(Duration::from_millis(2)).await;
            }
        })
    };
    // The limit moves while the adapters hold permits: cut hard, then opened wide.
    sleep(Duration::from_millis(20)).await;
    b.set_max_in_flight(3).unwrap();
    sleep(Duration::from_millis(20)).await;
    b.set_max_in_flight(8).unwrap();
    requests.await.unwrap();
    let ordered = ordered.await.unwrap();
    let unordered = unordered.await.unwrap();
    let spawned = spawned.await.unwrap();
    assert_eq!(
        ordered,
        (0..40u32)
            .map(|i| if i % 7 == 0 { Err(i) } else { Ok(i) })
            .collect::<Vec<_>>()
    );
    let mut unordered: Vec<_> = unordered
        .into_iter()
        .map(|r| r.unwrap_or_else(|e| e))
        .collect();
    unordered.sort_unstable();
    assert_eq!(unordered, (100..140).collect::<Vec<_>>());
    let mut spawned: Vec<_> = spawned
        .into_iter()
        .map(|r| r.unwrap_or_else(|e| e))
        .collect();
    spawned.sort_unstable();
    assert_eq!(spawned, (200..240).collect::<Vec<_>>());
    assert!(seen.lock().unwrap().is_empty() && seen_u.lock().unwrap().is_empty());
    assert!(seen_s.lock().unwrap().is_empty());
    assert!(inside.max() <= 8, "{} calls inside at once", inside.max());
    assert_eq!((b.in_flight(), b.waiting()), (0, 0));
    let max = b.max_in_flight();
    assert_eq!(free(&b), (max - 2, 2), "at rest, max {max}");

    // Closed with work waiting: a waiter, an adapter holding an item behind a held permit.
    let held: Vec<_> = (0..max - 2).map(|_| b.try_acquire().unwrap()).collect();
    let mut waiter = Box::pin(b.acquire());
    assert!(poll!(waiter.as_mut()).is_pending());
    let (seen, hook) = recorder();
    let mut late = Box::pin(
        BulkheadMapUnordered::builder(
            futures::stream::iter(0..3u32),
            b.clone(),
            |i| async move { i },
        )
        .on_drop(hook)
        .build()
        .unwrap(),
    );
    assert!(poll!(late.next()).is_pending());
    let before = b.stats();
    b.close();
    assert_eq!(waiter.await.unwrap_err(), AcquireError::Closed);
    assert_eq!(late.next().await, None);
    assert_eq!(*seen.lock().unwrap(), [(0, "discarded")]);
    let after = b.stats();
    assert_eq!(after.closed - before.closed, 2, "{after:?}");
    drop(held);
    assert_eq!((b.in_flight(), b.waiting()), (0, 0));
    let stats = b.stats();
    assert_eq!(
        stats.acquisitions(),
        stats.admitted + stats.shed() + stats.closed + stats.cancelled
    );
    let adaptive = b.adaptive_stats().unwrap();
    assert!(
        adaptive.back_pressure > 0 && adaptive.ok > 0,
        "{adaptive:?}"
    );
}

/// Each adapter dropped with a future in flight and an item waiting for a permit: the
/// order in which the module docs say it lets go of them, and when the permits come back
/// (at once for the in-poll adapters; as the runtime stops the aborted tasks for
/// `bulkhead_spawn_map`).
#[tokio::test]
async fn a_dropped_adapter_lets_go_of_its_item_futures_and_permits_in_the_documented_order() {
    type Log = Arc<Mutex<Vec<&'static str>>>;
    struct Noted(Log);
    impl Drop for Noted {
        fn drop(&mut self) {
            self.0.lock().unwrap().push("future");
        }
    }
    let pending = |log: &Log| {
        let noted = Noted(log.clone());
        async move {
            let _noted = noted;
            std::future::pending::<u32>().await
        }
    };
    for (adapter, first) in [
        ("ordered", "item"),
        ("unordered", "future"),
        ("spawned", "item"),
    ] {
        let b = Bulkhead::new(2).unwrap();
        let busy = b.try_acquire().unwrap();
        let log = Log::default();
        let (on_drop, f) = {
            let (hook_log, f_log) = (log.clone(), log.clone());
            (
                move |_: u32, _: &Dropped| hook_log.lock().unwrap().push("item"),
                move |_: u32| pending(&f_log),
            )
        };
        let items = futures::stream::iter(0..2u32);
        let mut s: std::pin::Pin<Box<dyn Stream<Item = u32> + Send>> = match adapter {
            "ordered" => Box::pin(
                BulkheadMap::builder(items, b.clone(), f)
                    .on_drop(on_drop)
                    .build()
                    .unwrap(),
            ),
            "unordered" => Box::pin(
                BulkheadMapUnordered::builder(items, b.clone(), f)
                    .on_drop(on_drop)
                    .build()
                    .unwrap(),
            ),
            _ => Box::pin(
                BulkheadSpawnMap::builder(items, b.clone(), f)
                    .on_drop(on_drop)
                    .build()
                    .unwrap(),
            ),
        };
        assert!(poll!(s.next()).is_pending());
        tokio::task::yield_now().await;
        assert_eq!(b.in_flight(), 2, "{adapter}");
        drop(s);
        if adapter == "spawned" {
            assert_eq!(*log.lock().unwrap(), ["item"], "the task not stopped yet");
            assert_eq!(b.in_flight(), 2, "its permit goes as the task stops");
            for _ in 0..10 {
                if b.in_flight() == 2 {
                    tokio::task::yield_now().await;
                }
            }
        }
        let log = log.lock().unwrap().clone();
        assert_eq!(log[0], first, "{adapter}: {log:?}");
        assert_eq!(log.len(), 2, "{adapter}: {log:?}");
        assert_eq!(b.in_flight(), 1, "{adapter}");
        drop(busy);
    }
}
