//! Callers that give up while their call to Redis is in flight: a `check` that called Redis
//! itself (batching off, or nothing else in flight), a lease call and a `check_all`. Redis
//! runs the script all the same; what it decided is counted, cached and kept as if the
//! caller had stayed.

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, Instant};

use flowgate::Quota;
use flowgate::gate::{FailurePolicy, Limit, RedisGate};
use redis::aio::MultiplexedConnection;
use tokio::runtime::Runtime;

use super::support::{RedisServer, TestRecorder, panicking_waker};

fn per_hour(n: u32) -> Limit {
    Limit::TokenBucket(Quota::per_hour(n).unwrap())
}

/// The counter `flowgate_gate_decisions_total{name=<name>,outcome=<outcome>}`.
fn decisions(recorder: &TestRecorder, name: &str, outcome: &str) -> u64 {
    recorder.counter(&format!(
        "flowgate_gate_decisions_total{{name={name},outcome={outcome}}}"
    ))
}

/// Waits up to 10 s (a loaded machine's Redis can be slow) for `done`.
async fn eventually(mut done: impl FnMut() -> bool) -> bool {
    let until = Instant::now() + Duration::from_secs(10);
    while !done() && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    done()
}

/// A gate named `name` over `server` (untimed connection, 60 s timeout) of `n` an hour,
/// leasing 10 tokens at a time for 10 minutes.
async fn leasing(server: &RedisServer, name: &str, n: u32) -> RedisGate<MultiplexedConnection> {
    RedisGate::builder(server.connect_untimed().await, per_hour(n))
        .name(name)
        .lease(10)
        .lease_ttl(Duration::from_secs(600))
        .timeout(Duration::from_secs(60))
        .build()
        .await
        .unwrap()
}

/// Runs `call` on a task, the next round trip of the gate named `name` panicking as
/// `recorder` records it: the panic reaches the caller.
async fn round_trip_panics<T: std::fmt::Debug + Send + 'static>(
    recorder: &TestRecorder,
    name: &str,
    call: impl Future<Output = T> + Send + 'static,
) {
    let round_trips = format!("flowgate_gate_redis_seconds{{name={name}}}");
    recorder.panic_once_on(&round_trips);
    assert!(tokio::spawn(call).await.unwrap_err().is_panic());
    assert!(recorder.panicked_once(&round_trips));
}

/// Sends `call` to the paused `server` and drops it there: polled once (its request goes to
/// the connection), then the connection's task is given time to write it out before the
/// caller gives up. The server is resumed afterwards. (The gate's connection must have no
/// client-side response timeout, `connect_untimed`: the pause may last past redis-rs's
/// 500 ms under load, and the call finished after the caller gave up would time out there.)
async fn give_up_mid_call<T>(server: &RedisServer, call: Pin<Box<dyn Future<Output = T> + '_>>) {
    server.pause();
    let mut call = call;
    assert!(
        futures::poll!(call.as_mut()).is_pending(),
        "waits for redis"
    );
    tokio::time::sleep(Duration::from_millis(50)).await;
    drop(call);
    server.resume();
}

/// The test's runtime (current-thread: it owns the connection, and the callers run on it),
/// another one, and a gate named `name` (60 s timeout) built on that other runtime, where
/// its batch driver runs.
fn driven_elsewhere(
    server: &RedisServer,
    limit: Limit,
    name: &str,
    policy: FailurePolicy,
) -> (Runtime, Runtime, RedisGate<MultiplexedConnection>) {
    let main = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let conn = main.block_on(server.connect());
    let other = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let gate = other
        .block_on(
            RedisGate::builder(conn, limit)
                .name(name)
                .failure_policy(policy)
                .timeout(Duration::from_secs(60))
                .build(),
        )
        .unwrap();
    (main, other, gate)
}

async fn exists(con: &mut MultiplexedConnection, key: &str) -> bool {
    redis::cmd("EXISTS")
        .arg(key)
        .query_async(con)
        .await
        .unwrap()
}

/// Batching off, and batching on with nothing in flight: the caller calls Redis itself.
/// Given up mid-call, its decision is counted all the same (admitted and rejected), and a
/// rejection is cached, as for a caller that stayed.
#[tokio::test]
async fn a_caller_that_called_redis_alone_and_gave_up_is_still_counted() {
    let recorder = TestRecorder::default();
    // Current-thread runtime: the gates register their metrics with this thread's recorder.
    let _local = metrics::set_default_local_recorder(&recorder);
    let server = RedisServer::start();
    let mut con = server.connect().await;
    for (name, batch) in [("alone", 1), ("idle", 128)] {
        let gate = RedisGate::builder(server.connect_untimed().await, per_hour(1))
            .name(name)
            .prefix(format!("{name}:"))
            .batch_size(batch)
            .timeout(Duration::from_secs(60))
            .build()
            .await
            .unwrap();
        let count = |outcome| decisions(&recorder, name, outcome);
        assert!(gate.check("full", 1).await.unwrap().allowed);
        assert_eq!(count("allowed"), 1);
        give_up_mid_call(&server, Box::pin(gate.check("fresh", 1))).await;
        assert!(
            exists(&mut con, &gate.redis_key("fresh")).await,
            "{name}: redis charged the caller that gave up"
        );
        assert!(
            eventually(|| count("allowed") == 2).await,
            "{name}: the admitted caller that gave up is counted: allowed = {}",
            count("allowed")
        );
        give_up_mid_call(&server, Box::pin(gate.check("full", 1))).await;
        assert!(
            eventually(|| count("rejected") == 1).await,
            "{name}: the rejected caller that gave up is counted: rejected = {}",
            count("rejected")
        );
        assert_eq!(
            gate.cached_rejections(),
            1,
            "{name}: and its rejection cached"
        );
        assert!(!gate.check("full", 1).await.unwrap().allowed);
        assert_eq!(count("cached"), 1, "{name}: the next one rejected locally");
    }
}

/// Batching on, with a call in flight: the caller joins a batch, which goes to Redis; the
/// caller gives up. Its rejection is counted when the batch's answer comes, and cached, as
/// for a caller that stayed: the next request on the key is refused without Redis.
#[tokio::test]
async fn a_batched_caller_that_gave_up_leaves_its_rejection_cached() {
    let recorder = TestRecorder::default();
    let _local = metrics::set_default_local_recorder(&recorder);
    let server = RedisServer::start();
    let gate = RedisGate::builder(server.connect_untimed().await, per_hour(1))
        .name("batched")
        .timeout(Duration::from_secs(60))
        .build()
        .await
        .unwrap();
    let count = |outcome| decisions(&recorder, "batched", outcome);
    let batches = || {
        recorder
            .samples("flowgate_gate_batch_size{name=batched}")
            .len()
    };
    assert!(gate.check("full", 1).await.unwrap().allowed);
    server.pause();
    // Nothing in flight: `first` calls Redis itself; `second` then joins a batch.
    let mut first = Box::pin(gate.check("first", 1));
    assert!(futures::poll!(first.as_mut()).is_pending());
    let mut second = Box::pin(gate.check("full", 1));
    assert!(futures::poll!(second.as_mut()).is_pending());
    assert!(eventually(|| batches() == 1).await, "the batch is sent");
    drop(second);
    server.resume();
    assert!(first.await.unwrap().allowed);
    assert!(
        eventually(|| count("rejected") == 1).await,
        "the rejected caller that gave up is counted: rejected = {}",
        count("rejected")
    );
    assert_eq!(gate.cached_rejections(), 1, "and its rejection cached");
    assert!(!gate.check("full", 1).await.unwrap().allowed);
    assert_eq!(count("cached"), 1, "the next one rejected locally");
}

/// A lease call given up mid-call: the tokens Redis debited for it are kept in the lease
/// and spent by the next callers, not lost.
#[tokio::test]
async fn a_lease_taken_by_a_caller_that_gave_up_is_kept() {
    let recorder = TestRecorder::default();
    let _local = metrics::set_default_local_recorder(&recorder);
    let server = RedisServer::start();
    let gate = leasing(&server, "lease", 100).await;
    let count = |outcome| decisions(&recorder, "lease", outcome);
    let calls = || {
        recorder
            .samples("flowgate_gate_redis_seconds{name=lease}")
            .len()
    };
    // The lease script loaded; a lease of 10 on `warm`.
    assert!(gate.check("warm", 1).await.unwrap().allowed);
    assert_eq!((count("allowed"), calls(), gate.leased_keys()), (1, 1, 1));
    give_up_mid_call(&server, Box::pin(gate.check("k", 1))).await;
    assert!(
        eventually(|| gate.leased_keys() == 2).await,
        "the lease taken for the caller that gave up is kept"
    );
    assert_eq!((count("allowed"), calls()), (2, 2));
    // Its 9 other tokens are spent here, without Redis.
    for _ in 0..9 {
        assert!(gate.check("k", 1).await.unwrap().allowed);
    }
    assert_eq!((count("allowed"), calls()), (11, 2));
}

/// `check_all` given up mid-call: every bucket is charged in Redis, and the decision counted.
#[tokio::test]
async fn a_check_all_given_up_mid_call_is_still_counted() {
    let recorder = TestRecorder::default();
    let _local = metrics::set_default_local_recorder(&recorder);
    let server = RedisServer::start();
    let mut con = server.connect().await;
    let gate = RedisGate::builder(server.connect_untimed().await, per_hour(100))
        .name("all")
        .timeout(Duration::from_secs(60))
        .build()
        .await
        .unwrap();
    let count = |outcome| decisions(&recorder, "all", outcome);
    let q = Quota::per_hour(5).unwrap();
    // The check_all script loaded.
    let warm = gate.check_all(&[("w1", q), ("w2", q)], 1).await.unwrap();
    assert!(warm[0].allowed);
    assert_eq!(count("allowed"), 1);
    let limits = [("a", q), ("b", q)];
    give_up_mid_call(&server, Box::pin(gate.check_all(&limits, 1))).await;
    for key in ["a", "b"] {
        assert!(
            exists(&mut con, &gate.redis_key(key)).await,
            "{key} charged"
        );
    }
    assert!(
        eventually(|| count("allowed") == 2).await,
        "the check_all given up is counted: allowed = {}",
        count("allowed")
    );
}

/// A call that reached Redis and that nothing can finish: a batch in flight when the
/// runtime of the batch driver shuts down, a call given up outside any runtime, a call left
/// to finish on a runtime that then shuts down. Redis may charge each (here it does); none
/// is lost from the counts: each is counted `abandoned`.
#[test]
fn a_call_nothing_can_finish_is_counted_abandoned() {
    let recorder = TestRecorder::default();
    let _local = metrics::set_default_local_recorder(&recorder);
    let server = RedisServer::start();
    let count = |outcome| decisions(&recorder, "lost", outcome);
    let charged = |key: &str| {
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            let found: bool = server
                .query_blocking(redis::cmd("EXISTS").arg(format!("flowgate:{key}")))
                .unwrap();
            if found || Instant::now() > until {
                return found;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    let (main, other, gate) =
        driven_elsewhere(&server, per_hour(100), "lost", FailurePolicy::Error);
    let batches = || {
        recorder
            .samples("flowgate_gate_batch_size{name=lost}")
            .len()
    };
    let mut alone = Box::pin(gate.check("alone", 1));
    main.block_on(async {
        assert!(gate.check("warm", 1).await.unwrap().allowed);
        server.pause();
        // Nothing in flight: `alone` calls Redis itself; `batched` then joins a batch.
        assert!(futures::poll!(alone.as_mut()).is_pending());
        let mut batched = Box::pin(gate.check("batched", 1));
        assert!(futures::poll!(batched.as_mut()).is_pending());
        assert!(eventually(|| batches() == 1).await, "the batch is sent");
        tokio::time::sleep(Duration::from_millis(50)).await;
    });
    // The driver's runtime shuts down with the batch in flight (its caller gone already).
    drop(other);
    // Given up outside any runtime: nothing can finish it.
    drop(alone);
    server.resume();
    assert!(charged("batched") && charged("alone"), "redis charged both");
    assert_eq!((count("allowed"), count("abandoned")), (1, 2));
    // Left to finish on a runtime that shuts down before Redis answers.
    main.block_on(async {
        server.pause();
        let mut late = Box::pin(gate.check("late", 1));
        assert!(futures::poll!(late.as_mut()).is_pending());
        tokio::time::sleep(Duration::from_millis(50)).await;
    });
    server.resume();
    drop(main);
    assert!(charged("late"), "redis charged it");
    assert_eq!((count("allowed"), count("abandoned")), (1, 3));
}

/// A batched caller still waiting when the runtime of the batch driver shuts down with its
/// batch in flight: Redis may have charged it (here it does), so it is answered by the
/// failure policy (here `Open`), not asked again, which would charge it twice.
#[test]
fn a_batched_caller_whose_driver_stopped_mid_call_is_not_charged_twice() {
    let recorder = TestRecorder::default();
    let _local = metrics::set_default_local_recorder(&recorder);
    let server = RedisServer::start();
    let count = |outcome| decisions(&recorder, "twice", outcome);
    let (main, other, gate) = driven_elsewhere(&server, per_hour(2), "twice", FailurePolicy::Open);
    let batches = || {
        recorder
            .samples("flowgate_gate_batch_size{name=twice}")
            .len()
    };
    let mut alone = Box::pin(gate.check("alone", 1));
    let mut batched = Box::pin(gate.check("batched", 1));
    main.block_on(async {
        assert!(gate.check("warm", 1).await.unwrap().allowed);
        server.pause();
        // Nothing in flight: `alone` calls Redis itself; `batched` then joins a batch.
        assert!(futures::poll!(alone.as_mut()).is_pending());
        assert!(futures::poll!(batched.as_mut()).is_pending());
        assert!(eventually(|| batches() == 1).await, "the batch is sent");
        tokio::time::sleep(Duration::from_millis(50)).await;
    });
    // The driver's runtime shuts down with the batch in flight; its caller still waits.
    drop(other);
    server.resume();
    main.block_on(async {
        assert!(alone.await.unwrap().allowed);
        let answered = batched.await.unwrap();
        assert!(answered.is_fail_open(), "by the policy: {answered:?}");
        // Charged once: one of the key's two tokens is left.
        let next = gate.check("batched", 1).await.unwrap();
        assert!(next.allowed, "charged twice: {next:?}");
    });
    assert_eq!(
        (count("abandoned"), count("policy"), count("rejected")),
        (1, 1, 0)
    );
}

/// A batched caller polled on a runtime that is shutting down (here: shut down already, its
/// handle entered), after the batch driver's own runtime shut down: the driver it starts
/// again there stops at once, like the first one. Its request never went to Redis, so the
/// failure policy (here `Open`) answers it, as for every other failure of the driver.
#[test]
fn a_batched_caller_whose_restarted_driver_stops_too_is_answered_by_the_policy() {
    let recorder = TestRecorder::default();
    let _local = metrics::set_default_local_recorder(&recorder);
    let server = RedisServer::start();
    let count = |outcome| decisions(&recorder, "again", outcome);
    let (main, other, gate) = driven_elsewhere(&server, per_hour(2), "again", FailurePolicy::Open);
    // The driver's runtime shuts down.
    drop(other);
    // A call in flight (to a paused server): the next caller goes to the batch driver.
    let mut alone = Box::pin(gate.check("alone", 1));
    main.block_on(async {
        assert!(gate.check("warm", 1).await.unwrap().allowed);
        server.pause();
        assert!(futures::poll!(alone.as_mut()).is_pending());
    });
    // The caller, on a runtime shut down under it.
    let dead = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let handle = dead.handle().clone();
    drop(dead);
    let answered = {
        let _in = handle.enter();
        futures::executor::block_on(gate.check("late", 1))
    };
    server.resume();
    let answered = answered.expect("the failure policy answers");
    assert!(answered.is_fail_open(), "by the policy: {answered:?}");
    assert_eq!(count("policy"), 1);
    main.block_on(async {
        assert!(alone.await.unwrap().allowed);
    });
}

/// A metrics recorder that panics as the batch driver counts the decision of a caller that
/// gave up (its answer, dropped unread, counts it): the callers after it in the same batch
/// still get the decision Redis made for them. They were not answered: asked again alone,
/// each was charged twice, and one Redis had admitted was refused (its token spent for
/// nothing).
#[tokio::test]
async fn a_recorder_panic_on_a_gone_callers_decision_charges_no_batched_caller_twice() {
    after_one_misbehaving_in_a_batch("answered", Misbehaving::GoneAndCountPanics).await;
}

/// A batched caller whose waker panics (user code) as the batch driver sends it its answer:
/// the callers after it in the same batch still get the decision Redis made for them. The
/// panic dropped them unanswered: each asked Redis again alone, was charged twice, and one
/// Redis had admitted was refused (its token spent for nothing).
#[tokio::test]
async fn a_panicking_waker_of_a_batched_caller_charges_no_other_caller_twice() {
    after_one_misbehaving_in_a_batch("woken", Misbehaving::WakerPanics).await;
}

/// How a batched caller misbehaves as the batch driver answers it.
#[derive(Clone, Copy, PartialEq)]
enum Misbehaving {
    /// It gives up after its batch is sent, and the metrics recorder panics as the driver
    /// counts its decision.
    GoneAndCountPanics,
    /// Its waker panics as the driver sends it its answer.
    WakerPanics,
}

/// On a gate named `name` (1 an hour per key): `first` calls Redis itself (nothing in
/// flight), then `middle` (on a key spent already) and `stays` (on a fresh key) join one
/// batch, in that order, and `middle` misbehaves. `stays` must get what Redis decided for
/// it in the batch (admitted), without a call of its own.
async fn after_one_misbehaving_in_a_batch(name: &str, misbehaving: Misbehaving) {
    let recorder = TestRecorder::default();
    let _local = metrics::set_default_local_recorder(&recorder);
    let server = RedisServer::start();
    let gate = RedisGate::builder(server.connect_untimed().await, per_hour(1))
        .name(name)
        .timeout(Duration::from_secs(60))
        .build()
        .await
        .unwrap();
    let batches = || {
        recorder
            .samples(&format!("flowgate_gate_batch_size{{name={name}}}"))
            .len()
    };
    let calls = || {
        recorder
            .samples(&format!("flowgate_gate_redis_seconds{{name={name}}}"))
            .len()
    };
    assert!(gate.check("full", 1).await.unwrap().allowed);
    assert_eq!(calls(), 1);
    server.pause();
    let mut first = Box::pin(gate.check("first", 1));
    assert!(futures::poll!(first.as_mut()).is_pending());
    let mut middle = Box::pin(gate.check("full", 1));
    let waker = match misbehaving {
        Misbehaving::WakerPanics => panicking_waker(),
        Misbehaving::GoneAndCountPanics => futures::task::noop_waker(),
    };
    let polled = middle
        .as_mut()
        .poll(&mut std::task::Context::from_waker(&waker));
    assert!(polled.is_pending(), "its batch waits");
    let mut stays = Box::pin(gate.check("fresh", 1));
    assert!(futures::poll!(stays.as_mut()).is_pending());
    assert!(eventually(|| batches() == 1).await, "the batch is sent");
    // Gone, its rejection is counted by the driver, which answers the batch: that panics.
    let rejected = format!("flowgate_gate_decisions_total{{name={name},outcome=rejected}}");
    if misbehaving == Misbehaving::GoneAndCountPanics {
        drop(middle);
        recorder.panic_on(&rejected, true);
    }
    server.resume();
    // The batch's answer is in (its round trip recorded): the driver has answered it.
    assert!(eventually(|| calls() == 2).await, "the batch is answered");
    recorder.panic_on(&rejected, false);
    assert!(first.await.unwrap().allowed);
    let answered = stays.await.unwrap();
    assert!(
        answered.allowed,
        "the decision Redis made for it (allowed), not a second charge: {answered:?}"
    );
    assert_eq!(calls(), 3, "no call of its own for `stays`");
}

/// A call that panics in its caller's poll (here a metrics recorder that panics as the
/// caller counts its decision) has ended: the caller unwinds, and nothing of the call is
/// left to finish. It was handed to the runtime as a call given up mid-way, and its spent
/// future, polled there, panicked a second time (`async fn` resumed after panicking).
#[tokio::test]
async fn a_call_that_panicked_in_its_callers_poll_is_not_finished_on_the_runtime() {
    let panics = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = panics.clone();
    let quiet = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        quiet(info);
    }));
    let recorder = TestRecorder::default();
    let _local = metrics::set_default_local_recorder(&recorder);
    let server = RedisServer::start();
    let gate = RedisGate::builder(server.connect().await, per_hour(10))
        .name("spent")
        .batch_size(1)
        .timeout(Duration::from_secs(60))
        .build()
        .await
        .unwrap();
    assert!(gate.check("warm", 1).await.unwrap().allowed);
    let allowed = "flowgate_gate_decisions_total{name=spent,outcome=allowed}";
    recorder.panic_on(allowed, true);
    let unwound =
        futures::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(gate.check("k", 1))).await;
    recorder.panic_on(allowed, false);
    assert!(unwound.is_err(), "the recorder's panic reached the caller");
    // Time for a task spawned with what is left of the call to run.
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(
        panics.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "one panic: the recorder's"
    );
    assert!(
        gate.check("k", 1).await.unwrap().allowed,
        "the gate is usable"
    );
}

/// A metrics recorder that panics in the batch driver (here as it records the size of a
/// new batch) costs that batch alone, never sent (its callers ask Redis alone): the batches
/// already in flight are still answered with what Redis decided, and the driver goes on.
/// The panic ended the driver's task: the batch in flight was answered by the failure
/// policy (here an error) though Redis decided it, and the driver was started again.
#[tokio::test]
async fn a_recorder_panic_in_the_batch_driver_fails_no_batch_in_flight() {
    let recorder = TestRecorder::default();
    let _local = metrics::set_default_local_recorder(&recorder);
    let server = RedisServer::start();
    // No client-side response timeout (redis-rs's is 500 ms): the calls sent while the
    // server is paused wait on it for as long as the test takes under load, bounded by the
    // gate's own timeout. (With it, `first` timed out when the pause lasted past 500 ms.)
    let gate = RedisGate::builder(server.connect_untimed().await, per_hour(10))
        .name("driver")
        .failure_policy(FailurePolicy::Error)
        .timeout(Duration::from_secs(60))
        .build()
        .await
        .unwrap();
    let sizes = "flowgate_gate_batch_size{name=driver}";
    let batches = || recorder.samples(sizes).len();
    assert!(gate.check("warm", 1).await.unwrap().allowed);
    server.pause();
    // Nothing in flight: `first` calls Redis itself; `a` then joins a batch, sent.
    let mut first = Box::pin(gate.check("first", 1));
    assert!(futures::poll!(first.as_mut()).is_pending());
    let mut a = Box::pin(gate.check("a", 1));
    assert!(futures::poll!(a.as_mut()).is_pending());
    assert!(eventually(|| batches() == 1).await, "a's batch is sent");
    // The next batch's size panics as it is recorded.
    recorder.panic_on(sizes, true);
    let mut b = Box::pin(gate.check("b", 1));
    assert!(futures::poll!(b.as_mut()).is_pending());
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    recorder.panic_on(sizes, false);
    server.resume();
    assert!(first.await.unwrap().allowed);
    let answered = a.await;
    assert!(
        answered.as_ref().is_ok_and(|d| d.allowed),
        "a's batch in flight is answered by Redis: {answered:?}"
    );
    assert!(b.await.unwrap().allowed, "b, never sent, asks again");
    assert_eq!(
        recorder.counter("flowgate_gate_driver_restarts_total{name=driver}"),
        0,
        "the driver goes on"
    );
}

/// "Tokens are never lost": tokens leased from Redis (debited there: the fleet goes without
/// them) and never spent here are counted in `flowgate_gate_lease_unspent_total` when the
/// gate lets go of them: a lease that expired (or whose tokens lapsed), the leases the
/// gate forgets because Redis may have lost its keys (here its scripts were flushed), and
/// those held when the gate goes away. Every token leased is spent or counted. They went
/// uncounted: a lease size that throws most of its tokens away could not be told apart from
/// one that spends them all.
#[tokio::test]
async fn leased_tokens_never_spent_are_counted() {
    let recorder = TestRecorder::default();
    let _local = metrics::set_default_local_recorder(&recorder);
    let server = RedisServer::start();
    let mut con = server.connect().await;
    let gate = RedisGate::builder(server.connect().await, per_hour(1_000))
        .name("unspent")
        .lease(10)
        .lease_ttl(Duration::from_millis(50))
        .build()
        .await
        .unwrap();
    let unspent = || recorder.counter("flowgate_gate_lease_unspent_total{name=unspent}");
    // A lease of 10 on `k`: one token spent, then three more here; six kept.
    for _ in 0..4 {
        assert!(gate.check("k", 1).await.unwrap().allowed);
    }
    assert_eq!((gate.leased_keys(), unspent()), (1, 0));
    // The lease expires with six left: the next call finds it so, and takes another.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(gate.check("k", 1).await.unwrap().allowed);
    assert_eq!(unspent(), 6, "the expired lease's tokens");
    // Redis loses the gate's scripts: the call that finds it so (a lease call on `j`) makes
    // the gate forget the leases it holds, `k`'s nine.
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut con)
        .await
        .unwrap();
    assert!(gate.check("j", 1).await.unwrap().allowed);
    assert_eq!(unspent(), 15, "the forgotten lease's tokens");
    assert_eq!(gate.leased_keys(), 1, "`j`'s lease, taken after");
    // The gate goes away holding `j`'s nine.
    drop(gate);
    assert!(
        eventually(|| unspent() == 24).await,
        "the tokens held by the gate dropped: unspent = {}",
        unspent()
    );
}

/// On a Cluster a batch goes to Redis as one script call per key. A metrics recorder
/// panicking in one of them (here as its round trip is recorded, which comes once its
/// callers have Redis's answers) fails no caller of any slot: each gets what Redis decided
/// for it. The panic ended the batch's every call: the other slots' callers, whose calls
/// Redis had answered, were answered by the failure policy (here an error) and counted
/// `abandoned`; then, before the round trip was recorded last, the panicking call's own.
#[tokio::test]
async fn a_recorder_panic_in_one_slots_call_fails_no_other_slot() {
    let recorder = TestRecorder::default();
    let _local = metrics::set_default_local_recorder(&recorder);
    let server = RedisServer::start();
    // A standalone server answers every slot: the batches are split all the same.
    let gate = RedisGate::builder(server.connect_untimed().await, per_hour(10))
        .name("slots")
        .cluster(true)
        .timeout(Duration::from_secs(60))
        .build()
        .await
        .unwrap();
    let batches = || recorder.samples("flowgate_gate_batch_size{name=slots}");
    assert!(gate.check("warm", 1).await.unwrap().allowed);
    server.pause();
    // Nothing in flight: `first` calls Redis itself; `a` and `b` (hash tags of two slots)
    // then join one batch, sent as two calls.
    let mut first = Box::pin(gate.check("first", 1));
    assert!(futures::poll!(first.as_mut()).is_pending());
    let mut a = Box::pin(gate.check("{1}k", 1));
    assert!(futures::poll!(a.as_mut()).is_pending());
    let mut b = Box::pin(gate.check("{2}k", 1));
    assert!(futures::poll!(b.as_mut()).is_pending());
    assert!(eventually(|| batches() == [2.0]).await, "one batch of two");
    // The first of the two calls to be answered panics as its round trip is recorded.
    let round_trips = "flowgate_gate_redis_seconds{name=slots}";
    recorder.panic_once_on(round_trips);
    server.resume();
    let (a, b) = (a.await, b.await);
    assert!(recorder.panicked_once(round_trips), "a call panicked");
    let by_redis = [&a, &b]
        .iter()
        .filter(|r| r.as_ref().is_ok_and(|d| d.allowed))
        .count();
    assert_eq!(
        by_redis, 2,
        "both slots are answered by Redis: {a:?}, {b:?}"
    );
    assert_eq!(decisions(&recorder, "slots", "abandoned"), 0);
    assert!(first.await.unwrap().allowed);
}

/// A metrics recorder panicking as a lease call's round trip is recorded (Redis has granted
/// the lease by then) keeps no leased token from the gate: the tokens Redis debited beyond
/// the caller's are kept for the next callers, and the decision is counted; the panic goes
/// on to the caller. They were neither kept nor counted unspent: debited in Redis, and
/// gone without a trace.
#[tokio::test]
async fn a_recorder_panic_on_a_lease_calls_round_trip_loses_no_leased_token() {
    let recorder = TestRecorder::default();
    let _local = metrics::set_default_local_recorder(&recorder);
    let server = RedisServer::start();
    let gate = leasing(&server, "leased", 10).await;
    let first = gate.clone();
    round_trip_panics(
        &recorder,
        "leased",
        async move { first.check("k", 1).await },
    )
    .await;
    assert_eq!(decisions(&recorder, "leased", "allowed"), 1, "counted");
    // Redis debited the whole bucket: the caller's token, and nine leased.
    let mut admitted = 0;
    for _ in 0..10 {
        admitted += u64::from(gate.check("k", 1).await.unwrap().allowed);
    }
    let unspent = recorder.counter("flowgate_gate_lease_unspent_total{name=leased}");
    assert_eq!(admitted + unspent, 9, "{admitted} spent, {unspent} unspent");
}

/// A metrics recorder panicking as a `check_all` call's round trip is recorded (Redis has
/// decided, and charged every bucket) keeps no count from the decision: it is counted, and
/// the panic goes on to the caller. It was not counted at all.
#[tokio::test]
async fn a_recorder_panic_on_a_check_all_calls_round_trip_loses_no_count() {
    let recorder = TestRecorder::default();
    let _local = metrics::set_default_local_recorder(&recorder);
    let server = RedisServer::start();
    let gate = leasing(&server, "all", 10).await;
    let q = Quota::per_hour(5).unwrap();
    let all = async move { gate.check_all(&[("a", q), ("b", q)], 1).await };
    round_trip_panics(&recorder, "all", all).await;
    assert_eq!(decisions(&recorder, "all", "allowed"), 1, "counted");
}
