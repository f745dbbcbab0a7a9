//! Operator journeys over a fleet of gates sharing one Redis: a rolling deploy that changes
//! the limit, an outage of Redis seen by every instance. Each gate built here stands for a
//! process of its own (its own connection, batch driver, cache and health): they share
//! nothing but the Redis server, as separate processes do.

use std::time::{Duration, Instant};

use flowgate::gate::{FailurePolicy, GateError, Limit, RedisGate};
use flowgate::{Quota, Rate};
use redis::aio::MultiplexedConnection;

use super::support::RedisServer;

/// Calls `check` until it answers `true`, for up to 10 s of real time (a generous wait on
/// a loaded machine, never an assertion on how long it took).
async fn eventually<F: Future<Output = bool>>(mut check: impl FnMut() -> F) -> bool {
    let until = Instant::now() + Duration::from_secs(10);
    while Instant::now() < until {
        if check().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

/// A rolling deploy makes a fixed window longer (5 a second to 5 a minute) over the same
/// prefix, as the docs say to change a limit. The new instances meet keys the old ones
/// counted in their 1-second windows: that count lasts until its key expires, within the
/// second, and the new instance may never say to wait longer than that (nor than one of
/// its own windows), nor refuse the key once the count is gone.
#[tokio::test]
async fn a_fixed_window_made_longer_in_a_rolling_deploy_waits_only_for_the_old_windows_count() {
    let server = RedisServer::start();
    let old = RedisGate::builder(
        server.connect().await,
        Limit::FixedWindow(Rate::per_second(5).unwrap()),
    )
    .prefix("roll:")
    .timeout(Duration::from_secs(2))
    .build()
    .await
    .unwrap();
    let new = RedisGate::builder(
        server.connect().await,
        Limit::FixedWindow(Rate::per_minute(5).unwrap()),
    )
    .prefix("roll:")
    .timeout(Duration::from_secs(2))
    .build()
    .await
    .unwrap();
    // An old instance spends its window on the key; a new one comes right after.
    let mut spent = false;
    for _ in 0..20 {
        if !old.check("k", 1).await.unwrap().allowed {
            spent = true;
            break;
        }
    }
    assert!(spent, "the old instance's window holds 5");
    let d = new.check("k", 1).await.unwrap();
    let window = Duration::from_secs(60);
    assert!(
        d.retry_after <= window && d.reset_after <= window,
        "the new instance answered {d:?}: a wait longer than its own window, for a count \
         that Redis drops within the second"
    );
    // Once the old window's key is gone, the new instance admits the key.
    assert!(
        eventually(|| async { new.check("k", 1).await.unwrap().allowed }).await,
        "the new instance still refuses the key 10 s after the old window's count expired \
         (cached rejections: {})",
        new.cached_rejections()
    );
}

/// Redis restarts empty under an instance whose only traffic is one key it holds a
/// rejection for (a global limit, an hourly one here), so that it never calls Redis: no
/// failure and no missing script tell it that the new server holds nothing for the key.
/// It must still find out by itself, within about a probe interval (not an hour), and
/// admit what Redis admits.
#[tokio::test]
async fn an_instance_answering_a_key_from_its_cache_finds_out_that_redis_restarted_empty() {
    let server = RedisServer::start();
    let gate = RedisGate::builder(
        server.fast_failing_manager().await,
        Limit::TokenBucket(flowgate::Quota::per_hour(1).unwrap()),
    )
    .timeout(Duration::from_secs(2))
    .probe_interval(Duration::from_millis(200))
    .build()
    .await
    .unwrap();
    assert!(gate.check("k", 1).await.unwrap().allowed);
    let d = gate.check("k", 1).await.unwrap();
    assert!(
        !d.allowed && d.retry_after > Duration::from_secs(3_000),
        "{d:?}"
    );
    assert_eq!(gate.cached_rejections(), 1);
    server.restart(); // empty: no scripts, no keys
    assert!(
        eventually(|| async { gate.check("k", 1).await.is_ok_and(|d| d.allowed) }).await,
        "the instance still refuses the key from its cache 10 s after Redis restarted empty \
         (cached rejections: {})",
        gate.cached_rejections()
    );
}

/// The same for leased tokens: Redis restarts empty under an instance whose only traffic is
/// a key it holds leased tokens for (4 of a burst of 5, to spend within 10 minutes), so
/// that it does not call Redis. Those tokens were debited in a bucket that is gone: spent on
/// top of the new server's full bucket, the key passes 9 within the hour. The instance
/// must find out by itself, within about a probe interval, and admit what the new server
/// admits (5, and at most one leased token spent while Redis could not answer).
#[tokio::test]
async fn an_instance_spending_a_lease_finds_out_that_redis_restarted_empty() {
    let server = RedisServer::start();
    let gate = RedisGate::builder(
        server.fast_failing_manager().await,
        Limit::TokenBucket(flowgate::Quota::per_hour(5).unwrap()),
    )
    .failure_policy(FailurePolicy::Closed)
    .timeout(Duration::from_secs(2))
    .probe_interval(Duration::from_millis(200))
    .lease(10)
    .lease_ttl(Duration::from_secs(600))
    .build()
    .await
    .unwrap();
    // A lease of the whole bucket: one token spent, four kept here.
    assert!(gate.check("k", 1).await.unwrap().allowed);
    assert_eq!(gate.leased_keys(), 1);
    server.restart(); // empty: no scripts, no keys
    // Quiet for more than a probe interval.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let mut admitted = 0;
    for _ in 0..12 {
        admitted += u32::from(gate.check("k", 1).await.unwrap().allowed);
    }
    assert!(
        admitted <= 6,
        "admitted {admitted} after the restart: the new server's burst of 5, with the leased \
         tokens of the old one on top"
    );
}

/// A rolling deploy moves a limit from a token bucket to a sliding window over the same
/// prefix. The two keep different states under one key: while both run, each refuses with
/// [`GateError::UnreadableKey`] the keys the other wrote (whatever its failure policy), and
/// neither degrades; once the old instances are gone, the new ones decide every key again
/// when the old state expires, with no restart.
#[tokio::test]
async fn an_algorithm_changed_over_the_same_prefix_refuses_the_other_ones_keys_until_they_expire() {
    let server = RedisServer::start();
    let old = RedisGate::builder(
        server.connect().await,
        Limit::TokenBucket(flowgate::Quota::per_second(10).unwrap()),
    )
    .prefix("roll:")
    .failure_policy(FailurePolicy::Open)
    .timeout(Duration::from_secs(2))
    .build()
    .await
    .unwrap();
    let new = RedisGate::builder(
        server.connect().await,
        Limit::SlidingWindow(Rate::per_second(10).unwrap()),
    )
    .prefix("roll:")
    .failure_policy(FailurePolicy::Open)
    .timeout(Duration::from_secs(2))
    .build()
    .await
    .unwrap();
    assert!(old.check("a", 1).await.unwrap().allowed);
    assert!(new.check("b", 1).await.unwrap().allowed);
    assert!(
        matches!(new.check("a", 1).await, Err(GateError::UnreadableKey(_))),
        "the new instance cannot read the old one's bucket"
    );
    assert!(
        matches!(old.check("b", 1).await, Err(GateError::UnreadableKey(_))),
        "nor the old one the new one's window"
    );
    assert!(!old.is_degraded() && !new.is_degraded());
    // The old instances are gone: the bucket they left expires (full again, plus a second).
    assert!(
        eventually(|| async { new.check("a", 1).await.is_ok_and(|d| d.allowed) }).await,
        "the new instance still cannot decide the old key"
    );
}

/// Redis stops answering (SIGSTOP) for several probe intervals under three instances that
/// keep calling it, then answers again. Each instance logs the outage once when it starts
/// and once when it ends, whatever the number of requests meanwhile; counts one transition
/// each way; counts failed calls to Redis (its probes), not the requests the policy
/// decided; and is back on Redis by itself.
#[cfg(feature = "metrics")]
#[tokio::test]
async fn an_outage_is_logged_and_counted_once_per_instance_and_each_recovers() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    // Every thread's events (the callers run here, but a test binary run by `cargo test`
    // shares threads between tests), filtered by the gates' names below.
    let logs = super::support::Logs::global();
    let recorder = super::support::TestRecorder::default();
    // Current-thread runtime: the gates register their metrics with this thread's recorder.
    let _local = metrics::set_default_local_recorder(&recorder);
    let server = RedisServer::start();
    const PROBE: Duration = Duration::from_millis(200);
    let mut gates = Vec::new();
    for name in ["journey-a", "journey-b", "journey-c"] {
        let gate = RedisGate::builder(
            server.fast_failing_manager().await,
            Limit::TokenBucket(flowgate::Quota::per_second(100_000).unwrap()),
        )
        .name(name)
        .failure_policy(FailurePolicy::Closed)
        .timeout(Duration::from_millis(100))
        .probe_interval(PROBE)
        .build()
        .await
        .unwrap();
        assert!(gate.check("k", 1).await.unwrap().allowed);
        gates.push(gate);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let mut callers = Vec::new();
    for gate in &gates {
        for _ in 0..4 {
            let (gate, stop) = (gate.clone(), stop.clone());
            callers.push(tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let _ = gate.check("k", 1).await.unwrap();
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            }));
        }
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    server.pause();
    // Several probe intervals without an answer.
    tokio::time::sleep(PROBE * 6).await;
    assert!(
        gates.iter().all(|g| g.is_degraded()),
        "every instance saw it"
    );
    server.resume();
    for gate in &gates {
        assert!(
            eventually(|| async {
                gate.check("k", 1).await.unwrap().allowed && !gate.is_degraded()
            })
            .await,
            "{:?} is not back on Redis",
            gate.name()
        );
    }
    tokio::time::sleep(PROBE * 2).await;
    stop.store(true, Ordering::Relaxed);
    for c in callers {
        c.await.unwrap();
    }
    let events = logs.events();
    for name in ["journey-a", "journey-b", "journey-c"] {
        let of = |level, part: &str| {
            events
                .iter()
                .filter(|e| {
                    e.level == level
                        && e.target == "flowgate::gate::backend"
                        && e.field("gate") == Some(name)
                        && e.message.contains(part)
                })
                .count()
        };
        assert_eq!(
            of(tracing::Level::WARN, "redis failed"),
            1,
            "{name}: {events:?}"
        );
        assert_eq!(
            of(tracing::Level::INFO, "back on redis"),
            1,
            "{name}: {events:?}"
        );
        let counter = |id: &str| recorder.counter(&format!("{id}{{name={name}}}"));
        let transitions = |to: &str| {
            recorder.counter(&format!(
                "flowgate_gate_transitions_total{{name={name},to={to}}}"
            ))
        };
        assert_eq!(
            (transitions("degraded"), transitions("healthy")),
            (1, 1),
            "{name}"
        );
        assert_eq!(
            recorder.gauge(&format!("flowgate_gate_degraded{{name={name}}}")),
            Some(0.0),
            "{name}"
        );
        let failures = counter("flowgate_gate_failures_total");
        let by_policy = recorder.counter(&format!(
            "flowgate_gate_decisions_total{{name={name},outcome=policy}}"
        ));
        // The calls in flight when Redis stopped (4 callers), then one probe an interval.
        assert!(
            failures <= 4 + 2 * 8,
            "{name}: {failures} failed calls counted for {by_policy} requests decided by the policy"
        );
        assert!(
            by_policy > failures,
            "{name}: {by_policy} decided by the policy"
        );
    }
}

/// A gate of `limit` over `prefix`, on a connection of its own (a process of its own).
async fn gate_over(
    server: &RedisServer,
    limit: Limit,
    prefix: &str,
) -> RedisGate<MultiplexedConnection> {
    RedisGate::builder(server.connect().await, limit)
        .prefix(prefix)
        .timeout(Duration::from_secs(2))
        .build()
        .await
        .unwrap()
}

/// How long `gate`'s `key` lives yet, at the least: its `PTTL` read a moment after the
/// call that set it (a little less than the key got), plus a second.
fn lives<C>(server: &RedisServer, gate: &RedisGate<C>, key: &str) -> Duration
where
    C: redis::aio::ConnectionLike + Clone + Send + Sync + 'static,
{
    let pttl: i64 = server
        .query_blocking(redis::cmd("PTTL").arg(gate.redis_key(key)))
        .unwrap();
    Duration::from_millis(u64::try_from(pttl).unwrap_or(0) + 1_000)
}

/// A rolling deploy makes a sliding window longer (10 a second to 10 a minute) over the same
/// prefix. A new instance carries on the count an old one kept in its 1-second window (the
/// docs: the sliding algorithms' counts carry over), for its own window; the key must live
/// as long as the new instance says that count holds. It kept the TTL the old instance had
/// set, a second or two: when the new instance admitted (`SET KEEPTTL`, a write in a window
/// that already has a count) or rejected (a rejection writes nothing), so the count
/// vanished with the key long before the new window's end and the key admitted its whole
/// limit again.
#[tokio::test]
async fn a_sliding_window_made_longer_in_a_rolling_deploy_keeps_its_count_as_long_as_it_counts() {
    let server = RedisServer::start();
    let window = |rate| Limit::SlidingWindow(rate);
    let old = gate_over(&server, window(Rate::per_second(10).unwrap()), "roll-sw:").await;
    let new = gate_over(&server, window(Rate::per_minute(10).unwrap()), "roll-sw:").await;
    // Admitted on a count of the old window.
    assert!(old.check("a", 1).await.unwrap().allowed);
    let d = new.check("a", 1).await.unwrap();
    assert!(d.allowed, "{d:?}");
    assert_eq!(d.remaining, 8, "the old instance's count carried over");
    let left = lives(&server, &new, "a");
    assert!(
        left >= d.reset_after,
        "admitted: the key expires in {left:?}, its count holds {:?}",
        d.reset_after
    );
    // Rejected on a full count of the old window (filled until the old one rejects: a
    // second may begin meanwhile).
    let mut filled = false;
    for _ in 0..30 {
        if !old.check("b", 1).await.unwrap().allowed {
            filled = true;
            break;
        }
    }
    assert!(filled, "the old window never filled");
    let d = new.check("b", 1).await.unwrap();
    assert!(!d.allowed, "{d:?}");
    let left = lives(&server, &new, "b");
    assert!(
        left >= d.reset_after,
        "rejected: the key expires in {left:?}, its count holds {:?}",
        d.reset_after
    );
}

/// A rolling deploy makes a sliding log's window longer (10 a second to 10 a minute) over
/// the same prefix. The log carries over: a new instance counts the entries an old one
/// wrote for its own minute, and rejects on a log they fill. But the key kept the TTL the
/// old instance set (its newest entry plus a second), and a rejection writes nothing: the
/// log vanished a second later and the new instance admitted its whole limit again within
/// its minute.
#[tokio::test]
async fn a_sliding_log_made_longer_in_a_rolling_deploy_lasts_while_it_rejects() {
    let server = RedisServer::start();
    let log = |rate| Limit::SlidingLog(rate);
    let old = gate_over(&server, log(Rate::per_second(10).unwrap()), "roll-sl:").await;
    let new = gate_over(&server, log(Rate::per_minute(10).unwrap()), "roll-sl:").await;
    for _ in 0..10 {
        assert!(old.check("k", 1).await.unwrap().allowed);
    }
    let d = new.check("k", 1).await.unwrap();
    assert!(!d.allowed, "{d:?}");
    let left = lives(&server, &new, "k");
    assert!(
        left >= d.reset_after,
        "the key expires in {left:?}, its log counts for {:?}",
        d.reset_after
    );
}

/// A rolling deploy lowers a token bucket's rate over the same prefix (a billion units a
/// second to one a millisecond). The old instance kept the part of its TAT below a
/// microsecond in units of its own rate (a billionth of a microsecond each); the new one
/// read them as its own (a microsecond each): a bucket 2 s in debt owed it 1 001 s, so the
/// new instance refused the key for a quarter of an hour (and cached that refusal) where
/// the bucket had room after 2 s.
#[tokio::test]
async fn a_token_bucket_rate_lowered_in_a_rolling_deploy_reads_the_old_rates_state() {
    let server = RedisServer::start();
    let billion = Rate::per_second(1_000_000_000).unwrap();
    let old_quota = Quota::new(billion, 4_000_000_000).unwrap();
    let new_quota = Quota::new(Rate::per(1, Duration::from_millis(1)).unwrap(), 10).unwrap();
    let old = gate_over(&server, Limit::TokenBucket(old_quota), "rate:").await;
    let new = gate_over(&server, Limit::TokenBucket(new_quota), "rate:").await;
    for key in ["check", "all"] {
        // 2 000 999 999 units at 10^9 a second: the TAT 2 000 999.999 µs after the write.
        assert!(old.check(key, 2_000_999_999).await.unwrap().allowed);
        let d = match key {
            "check" => new.check(key, 1).await.unwrap(),
            _ => new.check_all(&[(key, new_quota)], 1).await.unwrap()[0],
        };
        // Room for one unit (1 ms) once the TAT is 9 ms away: at most 1 992 ms on.
        assert!(
            !d.allowed && d.retry_after <= Duration::from_micros(1_992_000),
            "{key}: {d:?}"
        );
    }
}

/// Three instances share an hourly quota of 30 with leases of 10 (to spend within 10
/// minutes). One of them sees a request now and then, a little more than a probe interval
/// apart: each such request finds the instance silent (no answer from Redis for a probe
/// interval) and asks Redis before it spends a leased token. Asking took a new lease each
/// time, beside the tokens already held: the instance held 9, then 18, then 27 of the 30
/// tokens, never spent them (each request asked Redis again), and from the fourth request
/// on was refused by a bucket it had emptied itself, while holding 27 tokens paid for. The
/// other instances were refused too: the fleet admitted 3 of its 30 for as long as the
/// leases lasted. The docs bound what an instance holds per key at `lease − 1` (per lease
/// call in flight).
#[tokio::test]
async fn an_instance_with_sparse_traffic_spends_its_lease_instead_of_hoarding_new_ones() {
    let server = RedisServer::start();
    const PROBE: Duration = Duration::from_millis(100);
    let mut gates = Vec::new();
    for _ in 0..3 {
        gates.push(leasing(&server, Quota::per_hour(30).unwrap(), PROBE).await);
    }
    let mut admitted = 0;
    for _ in 0..12 {
        // Longer than a probe interval since the instance last heard from Redis.
        tokio::time::sleep(PROBE + PROBE / 2).await;
        admitted += u32::from(gates[0].check("k", 1).await.unwrap().allowed);
    }
    assert_eq!(
        admitted, 12,
        "the instance refused requests while it held leased tokens for the key"
    );
    // The rest of the bucket is there for the other instances: the first holds at most
    // what is left of one lease.
    let mut others = 0;
    for gate in &gates[1..] {
        for _ in 0..30 {
            others += u32::from(gate.check("k", 1).await.unwrap().allowed);
        }
    }
    assert!(
        others >= 30 - 12 - 9,
        "the other instances got {others}: the first hoards the quota"
    );
}

/// Redis stops answering (SIGSTOP) under an instance that leases 10 tokens at a time from
/// an hourly quota of 100, while its requests keep coming: its probes, one a probe
/// interval, time out and are decided by the policy (`Closed`: refused). Redis runs them
/// when it resumes, as the docs say a request that timed out is charged. But each probe
/// was a lease call: each took 10 tokens that nobody holds, ten probes took the whole
/// hour's quota, and once Redis answered again the fleet was refused for the hour, with
/// none of it counted in `flowgate_gate_lease_unspent_total`. A probe is charged for its
/// own cost, as on a gate without leases.
#[tokio::test]
async fn the_probes_of_a_paused_redis_are_charged_their_cost_not_a_lease_each() {
    let server = RedisServer::start();
    const PROBE: Duration = Duration::from_millis(50);
    let leasing = RedisGate::builder(
        server.fast_failing_manager().await,
        Limit::TokenBucket(Quota::per_hour(100).unwrap()),
    )
    .prefix("paused:")
    .failure_policy(FailurePolicy::Closed)
    .timeout(Duration::from_millis(100))
    .probe_interval(PROBE)
    .lease(10)
    .build()
    .await
    .unwrap();
    let other = gate_over(
        &server,
        Limit::TokenBucket(Quota::per_hour(100).unwrap()),
        "paused:",
    )
    .await;
    server.pause();
    let mut probes = 0;
    let until = Instant::now() + PROBE * 12;
    while Instant::now() < until {
        let d = leasing.check("k", 1).await.unwrap();
        assert!(d.is_fail_closed(), "{d:?}");
        probes += 1;
        tokio::time::sleep(PROBE / 4).await;
    }
    server.resume();
    assert!(
        eventually(|| async { leasing.check("k2", 1).await.is_ok_and(|d| d.allowed) }).await,
        "back on Redis"
    );
    let mut admitted = 0;
    for _ in 0..100 {
        admitted += u32::from(other.check("k", 1).await.unwrap().allowed);
    }
    // Each probe (one a probe interval, about 12 of them, fewer than the requests) charged
    // for its cost: the rest of the quota is there.
    assert!(
        admitted >= 100 - 20,
        "{admitted} of 100 left after {probes} requests refused while Redis was paused"
    );
}

/// The call a silent instance makes before it spends a leased token takes nothing, but
/// still finds out that Redis lost its state: after `FLUSHALL` with `SCRIPT FLUSH` (as the
/// docs ask), it meets `NOSCRIPT`, the instance lets go of the 4 tokens it held, and the
/// key admits the new bucket's burst of 5 and no more.
#[tokio::test]
async fn a_silent_lease_holder_lets_go_of_its_tokens_when_redis_was_flushed() {
    let server = RedisServer::start();
    const PROBE: Duration = Duration::from_millis(100);
    let gate = leasing(&server, Quota::per_hour(5).unwrap(), PROBE).await;
    assert!(gate.check("k", 1).await.unwrap().allowed);
    assert_eq!(gate.leased_keys(), 1, "4 tokens held");
    server
        .query_blocking::<()>(&redis::cmd("FLUSHALL"))
        .unwrap();
    server
        .query_blocking::<()>(redis::cmd("SCRIPT").arg("FLUSH"))
        .unwrap();
    tokio::time::sleep(PROBE * 2).await;
    let mut admitted = 0;
    while gate.check("k", 1).await.unwrap().allowed {
        admitted += 1;
        assert!(admitted <= 5, "a leased token of the old bucket passed");
    }
    assert_eq!(admitted, 5, "the new bucket's burst");
}

/// A gate of `quota` over its own connection to `server` (an instance of its own), leasing
/// 10 tokens at a time, to spend within 10 minutes; probing every `probe`.
async fn leasing(
    server: &RedisServer,
    quota: Quota,
    probe: Duration,
) -> RedisGate<MultiplexedConnection> {
    RedisGate::builder(server.connect().await, Limit::TokenBucket(quota))
        .prefix("leasing:")
        .timeout(Duration::from_secs(2))
        .probe_interval(probe)
        .lease(10)
        .lease_ttl(Duration::from_secs(600))
        .build()
        .await
        .unwrap()
}
