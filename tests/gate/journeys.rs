//! Operator journeys over a fleet of gates sharing one Redis: a rolling deploy that changes
//! the limit, an outage of Redis seen by every instance. Each gate built here stands for a
//! process of its own (its own connection, batch driver, cache and health): they share
//! nothing but the Redis server, as separate processes do.

use std::time::{Duration, Instant};

use flowgate::Rate;
use flowgate::gate::{Limit, RedisGate};

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
