//! Lifecycle: a service shutting down with work in flight, and a test harness that builds
//! and drops many instances in one process. For each component with background work or
//! shared state: dropping every handle ends its tasks, what it holds (leased tokens,
//! permits, buffered items) is given back or counted once, a call after `close` gets a
//! typed error, repeated build/drop cycles grow nothing, and a paused Redis bounds the way
//! out by the timeouts.

mod support;

#[cfg(any(feature = "redis", feature = "metrics"))]
use std::time::Duration;

use flowgate::bulkhead::{AcquireError, Bulkhead};
use flowgate::channel::{self, SendError, TryRecvError};
use tokio::runtime::Runtime;

#[cfg(feature = "redis")]
use flowgate::Quota;
#[cfg(feature = "redis")]
use flowgate::gate::{FailurePolicy, Limit, RedisGate};
#[cfg(feature = "redis")]
use support::{RedisServer, alive_until};

/// A current-thread runtime, as `#[tokio::test]` builds: every task the test leaves
/// behind is counted on it.
fn current_thread() -> Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

#[cfg(feature = "redis")]
fn alive() -> usize {
    tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks()
}

/// A burst of `n`, refilled one an hour: what is spent stays spent for the test.
#[cfg(feature = "redis")]
fn per_hour(n: u32) -> Limit {
    Limit::TokenBucket(
        Quota::per(1, Duration::from_secs(3600))
            .unwrap()
            .burst(n)
            .unwrap(),
    )
}

#[cfg(all(feature = "redis", feature = "metrics"))]
async fn eventually(mut done: impl FnMut() -> bool) -> bool {
    let until = tokio::time::Instant::now() + Duration::from_secs(10);
    while !done() && tokio::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    done()
}

/// The number of clients connected to `server`.
#[cfg(feature = "redis")]
fn clients(server: &RedisServer) -> usize {
    let list: String = server
        .query_blocking(redis::cmd("CLIENT").arg("LIST"))
        .unwrap();
    list.lines().count()
}

/// Waits until the runtime is back to `before` tasks, asserts it took less than `most`
/// since `started` with `server` still paused, then resumes it.
#[cfg(feature = "redis")]
async fn out_within(
    before: usize,
    started: std::time::Instant,
    most: Duration,
    server: &RedisServer,
    what: &str,
) {
    let alive = alive_until(before).await;
    let took = started.elapsed();
    assert!(
        alive <= before,
        "{what}: {alive} tasks alive, {before} before"
    );
    assert!(
        took < most,
        "{what}: the way out took {took:?} with Redis paused"
    );
    assert!(server.is_paused(), "{what}");
    server.resume();
}

/// A test harness building a gate per test over one connection, a thousand times, on a
/// current-thread runtime: each with its batch driver, half of them leasing, each deciding
/// a few keys at once. Nothing is left behind: no task, no connection.
#[cfg(feature = "redis")]
#[test]
fn a_redis_gate_built_and_dropped_a_thousand_times_leaves_no_task_and_no_connection() {
    let server = RedisServer::start();
    current_thread().block_on(async {
        let conn = server.connect().await;
        let before = alive();
        let connected = clients(&server);
        for round in 0..1_000u32 {
            let gate = RedisGate::builder(conn.clone(), per_hour(1_000_000))
                .prefix(format!("life{}:", round % 7))
                .lease(if round % 2 == 0 { 5 } else { 0 })
                .build()
                .await
                .unwrap();
            let checks = (0..4).map(|i| {
                let gate = gate.clone();
                async move { gate.check(&format!("k{i}"), 1).await }
            });
            for d in futures::future::join_all(checks).await {
                assert!(d.unwrap().allowed, "round {round}");
            }
            drop(gate);
        }
        assert_eq!(alive_until(before).await, before, "tasks left behind");
        assert_eq!(clients(&server), connected, "connections left behind");
    });
}

/// A service stopping while Redis is paused (SIGSTOP: the connection stays open, nothing
/// answers): its callers, batched and direct, are answered by the failure policy within
/// the gate's timeout, and once the gate is dropped its tasks end within that timeout too,
/// Redis still paused. Nothing waits for Redis to come back.
#[cfg(feature = "redis")]
#[test]
fn a_gate_dropped_with_calls_in_flight_on_a_paused_redis_ends_its_tasks_within_its_timeout() {
    let server = RedisServer::start();
    current_thread().block_on(async {
        // No client-side timeout: only the gate's bounds the calls.
        let conn = server.connect_untimed().await;
        let before = alive();
        for leases in [0, 10] {
            let gate = RedisGate::builder(conn.clone(), per_hour(1_000))
                .prefix("paused:")
                .lease(leases)
                .timeout(Duration::from_millis(300))
                .failure_policy(FailurePolicy::Error)
                .build()
                .await
                .unwrap();
            assert!(gate.check("warm", 1).await.unwrap().allowed);
            server.pause();
            let callers: Vec<_> = (0..32)
                .map(|i| {
                    let gate = gate.clone();
                    tokio::spawn(async move { gate.check(&format!("k{}", i % 4), 1).await })
                })
                .collect();
            tokio::time::sleep(Duration::from_millis(50)).await;
            let started = std::time::Instant::now();
            let mut answered = 0;
            for (i, caller) in callers.into_iter().enumerate() {
                if i % 2 == 0 {
                    caller.abort();
                } else {
                    let r = caller.await.unwrap();
                    assert!(r.is_err(), "leases {leases}: {r:?}");
                    answered += 1;
                }
            }
            assert_eq!(answered, 16);
            drop(gate);
            let what = format!("leases {leases}");
            out_within(before, started, Duration::from_secs(2), &server, &what).await;
        }
    });
}

/// A lease call whose caller gave up, on a gate dropped before Redis answered: Redis
/// debits the whole lease when it resumes; the caller's token is counted as decided, and
/// the nine leased for the next callers, whom the gate is gone for, as unspent.
#[cfg(all(feature = "redis", feature = "metrics"))]
#[test]
fn a_lease_left_to_finish_by_a_gate_dropped_is_counted_unspent() {
    let recorder = support::TestRecorder::default();
    let _local = metrics::set_default_local_recorder(&recorder);
    let server = RedisServer::start();
    current_thread().block_on(async {
        let conn = server.connect_untimed().await;
        let before = alive();
        let gate = RedisGate::builder(conn.clone(), per_hour(100))
            .name("gone")
            .prefix("gone:")
            .lease(10)
            .lease_ttl(Duration::from_secs(600))
            .timeout(Duration::from_secs(10))
            .build()
            .await
            .unwrap();
        server.pause();
        let caller = {
            let gate = gate.clone();
            tokio::spawn(async move { gate.check("k", 1).await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        caller.abort();
        let _ = caller.await;
        drop(gate);
        server.resume();
        let unspent = || recorder.counter("flowgate_gate_lease_unspent_total{name=gone}");
        let allowed =
            || recorder.counter("flowgate_gate_decisions_total{name=gone,outcome=allowed}");
        assert!(
            eventually(|| unspent() == 9 && allowed() == 1).await,
            "unspent {}, allowed {}",
            unspent(),
            allowed()
        );
        assert_eq!(alive_until(before).await, before);
        // Redis debited the ten.
        let mut con = server.connect().await;
        let fresh = RedisGate::builder(server.connect().await, per_hour(100))
            .prefix("gone:")
            .build()
            .await
            .unwrap();
        let d = fresh.check("k", 1).await.unwrap();
        assert_eq!(d.remaining, 89, "{d:?}");
        let _: () = redis::cmd("PING").query_async(&mut con).await.unwrap();
    });
}

/// A channel closed twice, sent to after the close, dropped with items still buffered:
/// the second close changes nothing, every send after it hands its item back, and the
/// items left are counted dropped once, whatever order the handles go in.
#[test]
fn a_channel_closed_twice_then_dropped_counts_each_item_once() {
    for closer in 0..2 {
        let (tx, mut rx) = channel::bounded::<u32>(8).unwrap();
        for i in 0..5 {
            tx.try_send(i).unwrap();
        }
        if closer == 0 {
            tx.close();
            rx.close();
        } else {
            rx.close();
            tx.close();
        }
        assert!(tx.is_closed() && rx.is_closed());
        assert_eq!(tx.try_send(9), Err(SendError::Closed(9)));
        assert_eq!(rx.try_recv(), Ok(0));
        assert_eq!(rx.try_recv(), Ok(1));
        let stats = rx.stats();
        assert_eq!((stats.sent, stats.received, stats.dropped), (5, 2, 0));
        let tx2 = tx.clone();
        drop(rx);
        let stats = tx2.stats();
        assert_eq!(
            (stats.sent, stats.received, stats.dropped),
            (5, 2, 3),
            "closer {closer}"
        );
        assert_eq!(tx2.try_send(10), Err(SendError::Closed(10)));
        drop((tx, tx2));
    }
    let (tx, mut rx) = channel::bounded::<u32>(2).unwrap();
    drop(tx);
    rx.close();
    assert_eq!(rx.try_recv(), Err(TryRecvError::Closed));
}

/// Named channels built and dropped a thousand times, each left with items: the depth gauge
/// reads 0 once they are gone, and the dropped count is exactly the items left.
#[cfg(feature = "metrics")]
#[test]
fn channels_built_and_dropped_a_thousand_times_leave_their_gauge_at_zero() {
    let recorder = support::TestRecorder::default();
    let _local = metrics::set_default_local_recorder(&recorder);
    for round in 0..1_000u64 {
        let (tx, mut rx) = channel::builder::<u64>(64).name("cycled").build().unwrap();
        for i in 0..(round % 40) {
            tx.try_send(i).unwrap();
        }
        if round % 3 == 0 {
            let _ = rx.try_recv();
        }
        if round % 2 == 0 {
            tx.close();
        }
        drop((tx, rx));
    }
    assert_eq!(
        recorder.gauge("flowgate_channel_depth{name=cycled}"),
        Some(0.0)
    );
}

/// A bulkhead closed with permits in flight and waiters queued, closed again, acquired
/// from after: every later acquisition is refused `Closed` (counted each), the second close
/// counts nothing more, and the permits in flight come back to an `in_flight` of 0.
#[test]
fn a_bulkhead_closed_twice_refuses_every_later_acquisition_and_gets_its_permits_back() {
    current_thread().block_on(async {
        let b = Bulkhead::builder(2).max_waiting(4).build().unwrap();
        let p1 = b.acquire_owned().await.unwrap();
        let p2 = b.try_acquire_owned().unwrap();
        let waiters: Vec<_> = (0..3)
            .map(|_| {
                let b = b.clone();
                tokio::spawn(async move { b.acquire_owned().await.map(drop) })
            })
            .collect();
        tokio::task::yield_now().await;
        assert_eq!(b.waiting(), 3);
        b.close();
        b.close();
        for w in waiters {
            assert_eq!(w.await.unwrap(), Err(AcquireError::Closed));
        }
        assert_eq!(b.try_acquire().err(), Some(AcquireError::Closed));
        assert_eq!(b.acquire().await.err(), Some(AcquireError::Closed));
        let s = b.stats();
        assert_eq!((s.in_flight, s.closed, s.admitted), (2, 5, 2), "{s:?}");
        drop((p1, p2));
        let s = b.stats();
        assert_eq!((s.in_flight, s.waiting), (0, 0), "{s:?}");
        assert!(b.is_closed());
    });
}

/// An allocator named `name` with one region, `eu`, whose home is `home`: a 10 s lease
/// refreshed every 2 s, 100 ms local timeout.
#[cfg(feature = "redis")]
async fn allocator(
    home: &RedisServer,
    name: &str,
) -> flowgate::region::QuotaAllocator<redis::aio::MultiplexedConnection> {
    let alloc = flowgate::region::QuotaAllocator::builder(
        home.connect().await,
        Quota::per_second(100).unwrap(),
    )
    .name(name)
    .region(("eu", 1))
    .lease(Duration::from_secs(10))
    .refresh_every(Duration::from_secs(2))
    .local_timeout(Duration::from_millis(100))
    .build()
    .unwrap();
    alloc.init_home().await.unwrap();
    alloc
}

/// A process leaving its region, and one dropping its last handle, while the region's
/// local Redis is paused: `leave` returns within the bound it documents (the release is
/// one call of at least 500 ms), and the background release ends as soon, Redis still
/// paused; joined and left again a hundred times, nothing is left behind.
#[cfg(feature = "redis")]
#[test]
fn a_region_left_or_dropped_on_a_paused_local_redis_ends_within_its_bound() {
    let home = RedisServer::start();
    let local = RedisServer::start();
    current_thread().block_on(async {
        let alloc = allocator(&home, "life").await;
        let conn = local.connect_untimed().await;
        let before = alive();
        for round in 0..100 {
            let region = alloc.join("eu", conn.clone()).await.unwrap();
            let gate = region.gate();
            let d = gate.check(&format!("k{round}"), 1).await.unwrap();
            assert!(d.allowed, "round {round}: {d:?}");
            drop(gate);
            if round % 2 == 0 {
                assert!(region.leave().await, "round {round}");
            } else {
                drop(region);
            }
        }
        assert_eq!(alive_until(before).await, before, "after the rounds");
        for leave in [true, false] {
            let region = alloc.join("eu", conn.clone()).await.unwrap();
            local.pause();
            let started = std::time::Instant::now();
            if leave {
                assert!(region.leave().await);
                let took = started.elapsed();
                assert!(took < Duration::from_millis(1_500), "leave took {took:?}");
            } else {
                drop(region);
            }
            let what = format!("leave: {leave}");
            out_within(before, started, Duration::from_secs(2), &local, &what).await;
        }
    });
}

/// A consumer that stops while Redis is paused: its source is dropped with acks queued,
/// over a connection with the library's response timeout. The background task gives the
/// acks up once their `XACK` times out (no handle left to wait for), instead of waiting for
/// Redis; the acks are counted unsent, and their entries stay pending.
#[cfg(all(feature = "redis", feature = "metrics"))]
#[test]
fn a_source_dropped_with_acks_queued_on_a_paused_redis_ends_its_task_and_counts_them() {
    use flowgate::demand::{Levels, RedisStreamSource, prefetch};
    use futures::StreamExt;

    let recorder = support::TestRecorder::default();
    let _local = metrics::set_default_local_recorder(&recorder);
    let server = RedisServer::start();
    current_thread().block_on(async {
        let mut con = server.connect().await;
        let source = |consumer: &'static str| {
            let server = &server;
            async move {
                RedisStreamSource::builder(server.connect().await, "jobs", "workers", consumer)
                    .name("stop")
                    .block(Duration::from_millis(50))
                    .ack_interval(Duration::from_millis(100))
                    .build()
                    .await
                    .unwrap()
            }
        };
        drop(source("setup").await);
        for i in 0..5 {
            let _: String = redis::cmd("XADD")
                .arg("jobs")
                .arg("*")
                .arg("n")
                .arg(i)
                .query_async(&mut con)
                .await
                .unwrap();
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        let before = alive();
        let mut stream = Box::pin(prefetch(source("a").await, Levels::new(5, 0).unwrap()));
        let mut held = Vec::new();
        for _ in 0..5 {
            held.push(stream.next().await.unwrap().unwrap());
        }
        server.pause();
        drop(stream);
        for e in held {
            e.ack.ack();
        }
        let started = std::time::Instant::now();
        out_within(before, started, Duration::from_secs(3), &server, "source").await;
        let unsent = recorder.counter("flowgate_demand_unsent_acks_total{name=stop}");
        let acked = recorder.counter("flowgate_demand_acked_total{name=stop}");
        assert_eq!((unsent, acked), (5, 0));
    });
}

/// The ids pending in group `workers` of stream `jobs`.
#[cfg(feature = "redis")]
async fn pending_ids(con: &mut redis::aio::MultiplexedConnection) -> Vec<String> {
    let rows: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
        .arg("jobs")
        .arg("workers")
        .arg("-")
        .arg("+")
        .arg(10_000)
        .query_async(con)
        .await
        .unwrap();
    rows.into_iter().map(|r| r.0).collect()
}

/// The shutdown the demand module documents for a Redis Streams consumer loop whose work
/// runs in `bulkhead_map_unordered`: on SIGTERM, close the bulkhead, poll the stream until
/// it ends (the work in flight finishes and acknowledges), then `flush_acks`. No entry whose
/// work was done stays pending (none is delivered again at the next start); what was
/// fetched and not worked on is, and the next start under the same name recovers exactly
/// that.
#[cfg(feature = "redis")]
#[test]
fn a_consumer_loop_stopped_as_documented_delivers_again_only_what_it_did_not_do() {
    use std::collections::HashSet;

    use flowgate::FlowStreamExt;
    use flowgate::demand::{Levels, Origin, RedisStreamSource, prefetch};
    use futures::StreamExt;

    let server = RedisServer::start();
    current_thread().block_on(async {
        let mut con = server.connect().await;
        let source = || async {
            RedisStreamSource::builder(server.connect().await, "jobs", "workers", "w")
                .block(Duration::from_millis(50))
                .ack_interval(Duration::from_secs(5))
                .build()
                .await
                .unwrap()
        };
        drop(source().await);
        for i in 0..60 {
            let _: String = redis::cmd("XADD")
                .arg("jobs")
                .arg("*")
                .arg("n")
                .arg(i)
                .query_async(&mut con)
                .await
                .unwrap();
        }
        let db = Bulkhead::new(3).unwrap();
        let mut stream = Box::pin(
            prefetch(source().await, Levels::new(10, 2).unwrap()).bulkhead_map_unordered(
                db.clone(),
                |entry| async move {
                    let entry = entry.unwrap();
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    let id = entry.id.clone();
                    entry.ack.ack();
                    id
                },
            ),
        );
        let mut done = HashSet::new();
        for _ in 0..20 {
            done.insert(stream.next().await.unwrap());
        }
        // SIGTERM.
        db.close();
        while let Some(id) = stream.next().await {
            done.insert(id);
        }
        let acked = stream
            .as_mut()
            .get_pin_mut()
            .get_mut()
            .get_mut()
            .flush_acks()
            .await
            .unwrap();
        drop(stream);
        let pending: HashSet<String> = pending_ids(&mut con).await.into_iter().collect();
        let again: Vec<_> = pending.intersection(&done).collect();
        assert!(
            again.is_empty(),
            "{} of the {} done stay pending (flush acked {acked}): {again:?}",
            again.len(),
            done.len()
        );
        // The next start recovers exactly what was fetched and not done.
        let mut next = Box::pin(prefetch(source().await, Levels::new(100, 0).unwrap()));
        let mut recovered = HashSet::new();
        for _ in 0..pending.len() {
            let e = next.next().await.unwrap().unwrap();
            assert_eq!(e.origin, Origin::OwnPending, "{}", e.id);
            recovered.insert(e.id.clone());
            e.ack.ack();
        }
        assert_eq!(recovered, pending);
    });
}

/// What `close` promises to keep: a permit granted to a waiter before the close is taken
/// by it when it runs after the close, and an item sent through a channel permit reserved
/// before the close is received.
#[test]
fn what_was_granted_before_a_close_is_kept_after_it() {
    current_thread().block_on(async {
        let b = Bulkhead::new(1).unwrap();
        let held = b.try_acquire_owned().unwrap();
        let waiter = {
            let b = b.clone();
            tokio::spawn(async move { b.acquire_owned().await })
        };
        tokio::task::yield_now().await;
        assert_eq!(b.waiting(), 1);
        drop(held); // granted to the waiter, which has not run since
        b.close();
        let permit = waiter.await.unwrap().expect("granted before the close");
        assert_eq!(b.in_flight(), 1);
        drop(permit);
        let s = b.stats();
        assert_eq!((s.in_flight, s.admitted, s.closed), (0, 2, 0), "{s:?}");

        let (tx, mut rx) = channel::bounded::<u32>(2).unwrap();
        let permit = tx.reserve().await.unwrap();
        tx.close();
        assert!(tx.reserve().await.is_err());
        permit.send(7);
        assert_eq!(rx.recv().await, Some(7));
        assert_eq!(rx.recv().await, None);
        let s = rx.stats();
        assert_eq!((s.sent, s.received, s.dropped), (1, 1, 0), "{s:?}");
    });
}

/// Adaptive bulkheads of one name, built and dropped a thousand times, each closed with
/// permits in flight that end after the close (feeding their samples): the permits all
/// come back, and once every bulkhead is gone their gauges read 0.
#[cfg(feature = "metrics")]
#[test]
fn adaptive_bulkheads_built_and_dropped_a_thousand_times_leave_their_gauges_at_zero() {
    use flowgate::adaptive::{Aimd, Gradient2, Outcome, Vegas};

    let recorder = support::TestRecorder::default();
    let _local = metrics::set_default_local_recorder(&recorder);
    current_thread().block_on(async {
        tokio::time::pause();
        for round in 0..1_000u32 {
            let builder = Bulkhead::builder(50).name("cycled").critical_reserve(2);
            let b = match round % 3 {
                0 => builder.adaptive(Aimd::builder().build().unwrap()),
                1 => builder.adaptive(Vegas::builder().build().unwrap()),
                _ => builder.adaptive(Gradient2::builder().build().unwrap()),
            }
            .build()
            .unwrap();
            let permits: Vec<_> = (0..5).map(|_| b.try_acquire_owned().unwrap()).collect();
            tokio::time::advance(Duration::from_millis(u64::from(round % 17) + 1)).await;
            if round % 2 == 0 {
                b.close();
            }
            for (i, p) in permits.into_iter().enumerate() {
                match i % 3 {
                    0 => p.record(Outcome::Ok),
                    1 => p.record(Outcome::BackPressure),
                    _ => drop(p),
                }
            }
            assert_eq!(b.in_flight(), 0, "round {round}");
            drop(b);
        }
    });
    for id in [
        "flowgate_bulkhead_in_flight{name=cycled}",
        "flowgate_bulkhead_waiting{name=cycled}",
        "flowgate_bulkhead_max_in_flight{name=cycled}",
        "flowgate_bulkhead_rtt_seconds{kind=min,name=cycled}",
        "flowgate_bulkhead_rtt_seconds{kind=smoothed,name=cycled}",
    ] {
        assert_eq!(recorder.gauge(id).unwrap_or(0.0), 0.0, "{id}");
    }
}

/// A service whose runtime shuts down (SIGTERM, `main` returns) while Redis is paused and
/// callers wait on the gate, batched and alone: the shutdown does not wait for Redis, and
/// once Redis resumes and runs what was sent, every request it charged is counted, as
/// allowed or abandoned (with the tokens a lease call left held, as unspent).
#[cfg(all(feature = "redis", feature = "metrics"))]
#[test]
fn a_runtime_shut_down_under_a_paused_redis_leaves_every_charged_request_counted() {
    let recorder = support::TestRecorder::default();
    let _local = metrics::set_default_local_recorder(&recorder);
    let server = RedisServer::start();
    for leases in [0u32, 10] {
        let name = format!("stop{leases}");
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let gate = rt.block_on(async {
            let gate = RedisGate::builder(server.connect_untimed().await, per_hour(1_000))
                .name(name.clone())
                .prefix(format!("{name}:"))
                .lease(leases)
                .timeout(Duration::from_secs(10))
                .build()
                .await
                .unwrap();
            assert!(gate.check("k", 1).await.unwrap().allowed);
            gate
        });
        server.pause();
        rt.block_on(async {
            for i in 0..64 {
                let gate = gate.clone();
                tokio::spawn(async move { gate.check(&format!("k{}", i % 3), 1).await });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        });
        drop(gate);
        let started = std::time::Instant::now();
        drop(rt);
        let took = started.elapsed();
        assert!(took < Duration::from_secs(2), "the shutdown took {took:?}");
        server.resume();
        let rt = current_thread();
        let charged = rt.block_on(async {
            let gate = RedisGate::builder(server.connect().await, per_hour(1_000))
                .prefix(format!("{name}:"))
                .build()
                .await
                .unwrap();
            let mut charged = 0;
            for key in ["k", "k0", "k1", "k2"] {
                let d = gate.check(key, 1).await.unwrap();
                charged += 1_000 - d.remaining - 1;
            }
            charged
        });
        let counted = |outcome: &str| {
            recorder.counter(&format!(
                "flowgate_gate_decisions_total{{name={name},outcome={outcome}}}"
            ))
        };
        let (allowed, rejected, abandoned) = (
            counted("allowed"),
            counted("rejected"),
            counted("abandoned"),
        );
        let unspent =
            recorder.counter(&format!("flowgate_gate_lease_unspent_total{{name={name}}}"));
        assert_eq!((rejected, counted("policy")), (0, 0), "leases {leases}");
        // An abandoned request is one sent, whose answer nobody read: a lease call's
        // charges its whole lease (up to `leases` tokens), as a lease call that timed out
        // does (`RedisGateBuilder::lease`).
        let most = allowed + unspent + abandoned * u64::from(leases.max(1));
        assert!(
            charged <= most,
            "leases {leases}: Redis charged {charged}, counted {allowed} allowed, \
             {abandoned} abandoned, {unspent} unspent"
        );
    }
}
