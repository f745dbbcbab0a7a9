//! `Bulkhead::stats`: every acquisition is counted once, in exactly one outcome, and the
//! counts agree with the metrics the bulkhead records.

use flowgate::bulkhead::BulkheadStats;

use super::*;

/// A bulkhead of 3 (1 of them the critical reserve), a waiting room of 2, and a 100 ms
/// wait timeout, named `stats`.
fn bulkhead() -> Bulkhead {
    Bulkhead::builder(3)
        .critical_reserve(1)
        .max_waiting(2)
        .wait_timeout(Duration::from_millis(100))
        .name("stats")
        .build()
        .unwrap()
}

/// Ends acquisitions every way there is, each a known number of times, and answers how
/// many acquisitions it made. Needs paused time.
async fn every_way(b: &Bulkhead) -> u64 {
    let mut made = 0;
    let mut count = || made += 1;
    // At once: two normal permits (the normal share), then the reserve for critical work.
    let n1 = b.acquire().await.unwrap();
    count();
    let n2 = b.try_acquire().unwrap();
    count();
    assert_eq!(b.try_acquire().unwrap_err(), AcquireError::NoPermit);
    count();
    let c1 = b.try_acquire_with(Priority::Critical).unwrap();
    count();
    assert_eq!((b.stats().in_flight, b.stats().reserve_in_flight), (3, 1));
    // The waiting room: two normal waiters fill it, a third is shed at once, a critical
    // one sheds the newest normal one.
    let mut w1 = Box::pin(b.acquire());
    assert!(poll!(w1.as_mut()).is_pending());
    count();
    let mut w2 = Box::pin(b.acquire());
    assert!(poll!(w2.as_mut()).is_pending());
    count();
    assert_eq!(
        b.acquire().await.unwrap_err(),
        AcquireError::WaitingRoomFull
    );
    count();
    let mut critical = Box::pin(b.acquire_with(Priority::Critical));
    assert!(poll!(critical.as_mut()).is_pending());
    count();
    assert_eq!(w2.await.unwrap_err(), AcquireError::WaitingRoomFull);
    assert_eq!(b.stats().waiting, 2);
    // A permit back: the critical waiter first, with the reserve (2 in flight, the normal
    // share), after waiting.
    drop(n1);
    let c2 = critical.await.unwrap();
    assert_eq!(b.stats().reserve_in_flight, 1);
    drop((c1, c2));
    // Two in flight now: n2, and w1's (granted as the critical ones came back).
    let p1 = w1.await.unwrap();
    assert_eq!((b.stats().in_flight, b.stats().reserve_in_flight), (2, 0));
    // A wait past the timeout.
    assert_eq!(b.acquire().await.unwrap_err(), AcquireError::TimedOut);
    count();
    // A wait given up; one given up with the permit granted to it (it goes back).
    let mut gives_up = Box::pin(b.acquire_owned());
    assert!(poll!(gives_up.as_mut()).is_pending());
    count();
    drop(gives_up);
    let mut granted = Box::pin(b.acquire());
    assert!(poll!(granted.as_mut()).is_pending());
    count();
    drop(p1);
    assert_eq!(b.stats().waiting, 0, "granted, not yet seen");
    drop(granted);
    assert_eq!(b.in_flight(), 1, "the granted permit went back");
    // Never polled: never asked.
    drop(b.acquire());
    // `run`, at once.
    assert_eq!(b.run(async { 7 }).await.unwrap(), 7);
    count();
    // Closing: a waiter that sees it, one dropped before it looks again, later ones.
    let p2 = b.try_acquire().unwrap();
    count();
    let mut seen = Box::pin(b.acquire());
    assert!(poll!(seen.as_mut()).is_pending());
    count();
    let mut unseen = Box::pin(b.acquire());
    assert!(poll!(unseen.as_mut()).is_pending());
    count();
    b.close();
    assert_eq!(seen.await.unwrap_err(), AcquireError::Closed);
    drop(unseen);
    assert_eq!(b.acquire().await.unwrap_err(), AcquireError::Closed);
    count();
    assert_eq!(b.try_acquire().unwrap_err(), AcquireError::Closed);
    count();
    drop((n2, p2));
    made
}

/// Every acquisition ends in exactly one of the counts, once: with paused time, a known
/// number of each (a critical one from the reserve at once and after waiting, shed at once
/// and pushed out, timed out, cancelled with and without a permit granted, closed out), and
/// the counts add up to the acquisitions made, the cancelled ones included.
#[tokio::test(start_paused = true)]
async fn every_acquisition_is_counted_once_in_one_outcome() {
    let b = bulkhead();
    assert_eq!(b.stats(), BulkheadStats::default());
    let made = every_way(&b).await;
    let stats = b.stats();
    assert_eq!(stats.acquisitions(), made, "{stats:?}");
    assert_eq!(
        (stats.in_flight, stats.waiting, stats.reserve_in_flight),
        (0, 0, 0)
    );
    // n1, n2, c1, run, p2 at once; the critical waiter and w1 after waiting.
    assert_eq!(
        (stats.admitted, stats.waited, stats.admitted_from_reserve),
        (7, 2, 2)
    );
    assert_eq!(
        (stats.waiting_room_full, stats.timed_out, stats.no_permit),
        (2, 1, 1)
    );
    assert_eq!((stats.shed(), stats.closed, stats.cancelled), (4, 4, 2));
    for reason in [
        AcquireError::WaitingRoomFull,
        AcquireError::TimedOut,
        AcquireError::NoPermit,
        AcquireError::Closed,
    ] {
        let field = match reason {
            AcquireError::WaitingRoomFull => stats.waiting_room_full,
            AcquireError::TimedOut => stats.timed_out,
            AcquireError::NoPermit => stats.no_permit,
            _ => stats.closed,
        };
        assert_eq!(stats.refused(reason), field, "{reason:?}");
    }
}

/// The stats and the metrics count the same things: each refusal reason as
/// `flowgate_bulkhead_rejected_total{reason}`, the waits that ended with a permit as the
/// samples of `flowgate_bulkhead_wait_seconds`, and `in_flight` / `waiting` as their
/// gauges, at every step.
#[cfg(feature = "metrics")]
#[tokio::test(start_paused = true)]
async fn the_stats_agree_with_the_metrics() {
    let recorder = support::TestRecorder::default();
    let b = metrics::with_local_recorder(&recorder, bulkhead);
    let agree = |b: &Bulkhead| {
        let name = b.name().unwrap();
        let stats = b.stats();
        for reason in [
            AcquireError::WaitingRoomFull,
            AcquireError::TimedOut,
            AcquireError::NoPermit,
            AcquireError::Closed,
        ] {
            let metric = recorder.counter(&format!(
                "flowgate_bulkhead_rejected_total{{name={name},reason={}}}",
                reason.as_str()
            ));
            assert_eq!(stats.refused(reason), metric, "{reason:?}");
        }
        let gauge = |id: &str| recorder.gauge(&format!("flowgate_bulkhead_{id}{{name={name}}}"));
        assert_eq!(gauge("in_flight"), Some(stats.in_flight as f64));
        assert_eq!(gauge("waiting").unwrap_or(0.0), stats.waiting as f64);
        let waits = recorder.samples(&format!("flowgate_bulkhead_wait_seconds{{name={name}}}"));
        assert_eq!(waits.len() as u64, stats.waited);
    };
    let made = every_way(&b).await;
    agree(&b);
    assert_eq!(b.stats().acquisitions(), made);
    // And while an acquisition waits.
    let b = metrics::with_local_recorder(&recorder, || {
        Bulkhead::builder(1).name("waits").build().unwrap()
    });
    let held = b.acquire().await.unwrap();
    let mut waiting = Box::pin(b.acquire());
    assert!(poll!(waiting.as_mut()).is_pending());
    agree(&b);
    drop(held);
    drop(waiting.await.unwrap());
    agree(&b);
}

/// `waited` and `flowgate_bulkhead_wait_seconds` count the same waits: a stream adapter's
/// wait in the queue (for a permit another caller holds) too, with its length; the permits
/// it takes at once, or passes from a finished item to the next, are in neither.
#[cfg(feature = "metrics")]
#[tokio::test(start_paused = true)]
async fn an_adapters_waits_are_in_the_wait_histogram_too() {
    let recorder = support::TestRecorder::default();
    let b = metrics::with_local_recorder(&recorder, || {
        Bulkhead::builder(1).name("adapter").build().unwrap()
    });
    let held = b.try_acquire().unwrap();
    let mut adapter = futures::stream::iter([1u32, 2, 3])
        .bulkhead_map(b.clone(), |i| async move { i })
        .boxed();
    assert!(poll!(adapter.next()).is_pending());
    advance(Duration::from_millis(250)).await;
    drop(held);
    assert_eq!(adapter.collect::<Vec<_>>().await, [1, 2, 3]);
    let stats = b.stats();
    let waits = recorder.samples("flowgate_bulkhead_wait_seconds{name=adapter}");
    assert_eq!(waits.len() as u64, stats.waited, "{stats:?}, {waits:?}");
    assert_eq!(waits, [0.25]);
}

/// The stream adapters' acquisitions are counted too: each item's permit is admitted (at
/// once or after waiting), a wait the adapter gives up when dropped is cancelled, and one
/// the close ends is `closed`.
#[tokio::test(start_paused = true)]
async fn an_adapters_acquisitions_are_counted() {
    let b = Bulkhead::new(2).unwrap();
    let out: Vec<u32> = futures::stream::iter(0..6u32)
        .bulkhead_map_unordered(b.clone(), |i| async move {
            sleep(Duration::from_millis(10)).await;
            i
        })
        .collect()
        .await;
    assert_eq!(out.len(), 6);
    let stats = b.stats();
    // A finished item's permit may pass straight to the next item: not a new acquisition.
    assert!((2..=6).contains(&stats.admitted), "{stats:?}");
    assert_eq!(stats.acquisitions(), stats.admitted);
    assert_eq!(stats.in_flight, 0);
    // Waiting for a permit another caller holds: dropped, then closed out.
    let held = (b.try_acquire().unwrap(), b.try_acquire().unwrap());
    for end in ["dropped", "closed"] {
        let mut adapter = futures::stream::iter([1u32])
            .bulkhead_map(b.clone(), |i| async move { i })
            .boxed();
        assert!(poll!(adapter.next()).is_pending());
        assert_eq!(b.waiting(), 1);
        if end == "dropped" {
            drop(adapter);
        } else {
            b.close();
            assert_eq!(adapter.next().await, None);
        }
    }
    drop(held);
    let after = b.stats();
    assert_eq!((after.cancelled, after.closed), (1, 1), "{after:?}");
    // The two held, the wait dropped, the wait closed out.
    assert_eq!(after.acquisitions(), stats.admitted + 2 + 1 + 1);
}

/// Polls `fut`, counting it in `made` on its first poll (an acquisition is made when its
/// future is first polled).
async fn counted<F: std::future::Future>(made: &AtomicUsize, fut: F) -> F::Output {
    let mut fut = pin!(fut);
    let mut first = true;
    futures::future::poll_fn(|cx| {
        if std::mem::take(&mut first) {
            made.fetch_add(1, Ordering::SeqCst);
        }
        fut.as_mut().poll(cx)
    })
    .await
}

/// One task's random acquisitions: normal or critical, waited for, given up at a random
/// moment, tried without waiting, or run; each counted in `made` as it is made.
async fn random_acquisitions(b: Bulkhead, seed: u64, rounds: usize, made: Arc<AtomicUsize>) {
    let mut rng = Rng(seed);
    for _ in 0..rounds {
        let priority = if rng.next().is_multiple_of(5) {
            Priority::Critical
        } else {
            Priority::Normal
        };
        let work = Duration::from_millis(rng.next() % 60);
        match rng.next() % 4 {
            0 => {
                made.fetch_add(1, Ordering::SeqCst);
                if let Ok(_permit) = b.try_acquire_with(priority) {
                    sleep(work).await;
                }
            }
            1 => {
                let _ = counted(&made, b.run_with(priority, sleep(work))).await;
            }
            _ => {
                // Given up at a random moment: while waiting, or holding the permit.
                let patience = Duration::from_millis(rng.next() % 80);
                let _ = tokio::time::timeout(patience, async {
                    if let Ok(_permit) = counted(&made, b.acquire_with(priority)).await {
                        sleep(work).await;
                    }
                })
                .await;
            }
        }
        sleep(Duration::from_millis(rng.next() % 5)).await;
    }
}

/// Twenty-four tasks acquire at random (paused time): once they are done, the counts add up to
/// the acquisitions they made, nothing is in flight or waiting, and every outcome occurred.
#[tokio::test(start_paused = true)]
async fn random_acquisitions_add_up() {
    let b = Bulkhead::builder(5)
        .critical_reserve(1)
        .max_waiting(8)
        .wait_timeout(Duration::from_millis(30))
        .build()
        .unwrap();
    let made = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..24u64)
        .map(|t| tokio::spawn(random_acquisitions(b.clone(), t * 31 + 7, 40, made.clone())))
        .collect();
    let stats = add_up(&b, tasks, &made).await;
    for (what, n) in [
        ("waited", stats.waited),
        ("from the reserve", stats.admitted_from_reserve),
        ("room full", stats.waiting_room_full),
        ("timed out", stats.timed_out),
        ("no permit", stats.no_permit),
        ("cancelled", stats.cancelled),
    ] {
        assert!(n > 0, "no acquisition {what}: {stats:?}");
    }
    assert!(stats.waited <= stats.admitted && stats.admitted_from_reserve <= stats.admitted);
}

/// The same on two threads, ended by a close while they still acquire: the counts add up
/// to the acquisitions made, exactly, whatever raced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquisitions_racing_on_two_threads_and_a_close_add_up() {
    let b = Bulkhead::builder(3)
        .critical_reserve(1)
        .max_waiting(4)
        .build()
        .unwrap();
    let made = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..16u64)
        .map(|t| {
            let (b, made) = (b.clone(), made.clone());
            tokio::spawn(async move {
                let mut rng = Rng(t + 1);
                for round in 0..400 {
                    if t == 0 && round == 300 {
                        b.close();
                    }
                    let priority = if rng.next().is_multiple_of(4) {
                        Priority::Critical
                    } else {
                        Priority::Normal
                    };
                    let mut acquire = pin!(b.acquire_with(priority));
                    made.fetch_add(1, Ordering::SeqCst);
                    let permit = if rng.next().is_multiple_of(3) {
                        // Polled once, dropped if it has to wait.
                        match poll!(acquire.as_mut()) {
                            std::task::Poll::Ready(p) => p,
                            std::task::Poll::Pending => continue,
                        }
                    } else {
                        acquire.await
                    };
                    tokio::task::yield_now().await;
                    drop(permit);
                }
            })
        })
        .collect();
    let stats = add_up(&b, tasks, &made).await;
    assert!(stats.closed > 0, "{stats:?}");
}

/// Awaits `tasks`, then checks that the counts add up to the acquisitions they `made`, with
/// nothing left in flight or waiting; the stats, for more checks.
async fn add_up(
    b: &Bulkhead,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    made: &AtomicUsize,
) -> BulkheadStats {
    for t in tasks {
        t.await.unwrap();
    }
    let stats = b.stats();
    assert_eq!(
        stats.acquisitions(),
        made.load(Ordering::SeqCst) as u64,
        "{stats:?}"
    );
    assert_eq!((stats.in_flight, stats.waiting), (0, 0));
    stats
}

/// Acquisitions of both priorities racing on two threads while a third task resizes the
/// bulkhead up and down, some given up at once, some after a short wait, the rest waiting
/// for their permit: each ends (none hangs), every acquisition is counted once, and
/// nothing is left in flight or waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquisitions_racing_with_resizes_add_up_and_none_is_stranded() {
    let b = Bulkhead::builder(8)
        .critical_reserve(1)
        .max_waiting(6)
        .build()
        .unwrap();
    let made = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicUsize::new(0));
    let resizer = {
        let (b, stop) = (b.clone(), stop.clone());
        tokio::spawn(async move {
            let mut rng = Rng(99);
            while stop.load(Ordering::SeqCst) == 0 {
                b.set_max_in_flight(2 + (rng.next() % 7) as usize).unwrap();
                tokio::task::yield_now().await;
            }
            b.set_max_in_flight(1_000).unwrap();
        })
    };
    let tasks: Vec<_> = (0..12u64)
        .map(|t| {
            let (b, made) = (b.clone(), made.clone());
            tokio::spawn(async move {
                let mut rng = Rng(t + 7);
                for _ in 0..300 {
                    let priority = if rng.next().is_multiple_of(3) {
                        Priority::Critical
                    } else {
                        Priority::Normal
                    };
                    made.fetch_add(1, Ordering::SeqCst);
                    let mut acquire = pin!(b.acquire_with(priority));
                    let permit = match rng.next() % 4 {
                        0 => match poll!(acquire.as_mut()) {
                            std::task::Poll::Ready(p) => p,
                            std::task::Poll::Pending => continue,
                        },
                        1 => {
                            match tokio::time::timeout(Duration::from_micros(200), acquire).await {
                                Ok(p) => p,
                                Err(_) => continue,
                            }
                        }
                        _ => tokio::time::timeout(Duration::from_secs(20), acquire)
                            .await
                            .expect("no permit within 20 s"),
                    };
                    if let Ok(permit) = permit {
                        tokio::task::yield_now().await;
                        drop(permit);
                    }
                }
            })
        })
        .collect();
    let stats = add_up(&b, tasks, &made).await;
    stop.store(1, Ordering::SeqCst);
    resizer.await.unwrap();
    assert!(stats.waited > 0, "{stats:?}");
}
