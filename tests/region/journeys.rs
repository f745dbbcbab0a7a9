//! Operator journeys of a region: its local Redis restarted empty (run without
//! persistence, as the module docs advise).

use std::time::{Duration, Instant};

use flowgate::Quota;
use flowgate::gate::FailurePolicy;
use flowgate::region::{QuotaAllocator, Region};
use redis::aio::ConnectionManager;

use crate::support::RedisServer;

/// An allocator `name` of 100/s (burst 10) for one region, "only", on short leases.
fn only_region(home: ConnectionManager, name: &str) -> QuotaAllocator<ConnectionManager> {
    QuotaAllocator::builder(home, Quota::per_second(100).unwrap().burst(10).unwrap())
        .name(name)
        .region(("only", 1))
        .lease(Duration::from_secs(2))
        .refresh_every(Duration::from_millis(300))
        .home_timeout(Duration::from_millis(200))
        .local_timeout(Duration::from_millis(300))
        .build()
        .unwrap()
}

/// Sends requests and refreshes until the region's share is `share` and a request is
/// admitted, for up to 10 s of real time (a generous wait, never an assertion on how long
/// it took).
async fn until_at_share(region: &Region<ConnectionManager>, share: u64) -> bool {
    let gate = region.gate_with(FailurePolicy::Closed);
    let until = Instant::now() + Duration::from_secs(10);
    while Instant::now() < until {
        let mut admitted = false;
        for _ in 0..20 {
            admitted |= gate.check("k", 1).await.is_ok_and(|d| d.allowed);
        }
        if admitted && region.status().share == share {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// The local Redis of a region restarts empty: the lease record, the refresher's lock, the
/// demand counters and the buckets are gone. The region admits at its safe share (nothing,
/// here) until its refresher writes a lease again, then at its share, with no restart of
/// its processes.
#[tokio::test]
async fn a_region_whose_local_redis_restarted_empty_is_back_at_its_share_by_itself() {
    let home = RedisServer::start();
    let local = RedisServer::start();
    let alloc = only_region(home.fast_failing_manager().await, "restarted");
    assert!(alloc.init_home().await.unwrap());
    let region = alloc
        .join("only", local.fast_failing_manager().await)
        .await
        .unwrap();
    assert!(
        until_at_share(&region, 100).await,
        "never at the whole quota: {}",
        region.status()
    );
    local.restart(); // empty
    assert!(
        until_at_share(&region, 100).await,
        "not back at its share after the local Redis restarted: {}",
        region.status()
    );
}

/// A process starts while the home Redis is down. Connected eagerly (as
/// `ConnectionManager::new` does, after retrying for some 9 s), the home cannot even be
/// handed to the builder, and a process that follows the README's example exits; connected
/// lazily (as the `QuotaAllocator` example does), the process joins its region, admits at
/// its safe share (nothing, here), and gets its share once the home is up, with no restart.
#[tokio::test]
async fn a_process_started_while_the_home_is_down_gets_its_share_once_the_home_is_up() {
    use redis::aio::ConnectionManagerConfig;

    let home = RedisServer::start();
    let local = RedisServer::start();
    home.kill();
    // Eagerly, it fails (`ConnectionManager::new` after some 9 s of retries; one here).
    let eager = ConnectionManagerConfig::new().set_number_of_retries(1);
    assert!(
        ConnectionManager::new_with_config(home.client(), eager)
            .await
            .is_err()
    );
    let lazy =
        ConnectionManager::new_lazy_with_config(home.client(), ConnectionManagerConfig::new())
            .unwrap();
    let alloc = only_region(lazy, "home-down");
    let region = alloc
        .join("only", local.fast_failing_manager().await)
        .await
        .unwrap();
    let status = region.status();
    assert!(!status.home_reachable && status.share == 0, "{status}");
    home.restart();
    // A first deployment: the home starts without its learning phase.
    let until = Instant::now() + Duration::from_secs(10);
    while alloc.init_home().await.is_err() && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        until_at_share(&region, 100).await,
        "not at its share once the home is up: {}",
        region.status()
    );
}

/// A process calls `refresh_now` right after a refresh (a health check, a deploy hook, or
/// one that waited for the background refresh to finish): the demand it reports is
/// measured over the few milliseconds since, not a refresh interval. A region under steady
/// load keeps (about) its demand and its share: one refresh's noise over a short window does
/// take the share away (measured over a millisecond or two, none read as nothing: the
/// demand fell to 0 and the share to 1 per second, every request rejected until the next
/// refresh).
#[tokio::test]
async fn refresh_now_right_after_a_refresh_keeps_the_regions_share() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    let home = RedisServer::start();
    let local = RedisServer::start();
    let alloc = only_region(home.fast_failing_manager().await, "short-window");
    assert!(alloc.init_home().await.unwrap());
    let region = alloc
        .join("only", local.fast_failing_manager().await)
        .await
        .unwrap();
    // Steady load of about 50 per second.
    let stop = Arc::new(AtomicBool::new(false));
    let load = {
        let gate = region.gate_with(FailurePolicy::Closed);
        let stop = stop.clone();
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let _ = gate.check("k", 1).await;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    // Until the demand is measured and the share follows it (a few refreshes).
    let until = Instant::now() + Duration::from_secs(10);
    let measured = |s: flowgate::region::RegionStatus| s.demand >= 30 && s.share >= 30;
    while !measured(region.status()) && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let before = region.status();
    assert!(before.demand >= 30 && before.share >= 30, "{before}");
    // The load pauses for the two refreshes: the second sees no request in its window.
    stop.store(true, Ordering::Relaxed);
    let _ = load.await;
    region.refresh_now().await;
    region.refresh_now().await;
    let after = region.status();
    // At least the 50 per second measured over whole intervals, not nothing.
    assert!(
        after.demand >= 20 && after.share >= 20,
        "before: {before}; after two refresh_now in a row: {after}"
    );
}
