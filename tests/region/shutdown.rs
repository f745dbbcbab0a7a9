//! Shutdown and restart of a region member: the refresher ends with the last handle, the
//! refresher lock is given up on the way out, a region joined again works, and what a
//! region leaves in its local Redis expires.

use std::time::Duration;

use flowgate::Quota;
use flowgate::region::QuotaAllocator;
use redis::aio::MultiplexedConnection;
use tokio::runtime::Runtime;

use crate::support::{RedisServer, alive_until};

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// An allocator named `name` with one region, `eu`, whose home and local Redis are both
/// `server`: a 10 s lease refreshed every 2 s.
async fn allocator(server: &RedisServer, name: &str) -> QuotaAllocator<MultiplexedConnection> {
    let alloc = QuotaAllocator::builder(server.connect().await, Quota::per_second(100).unwrap())
        .name(name)
        .region(("eu", 1))
        .lease(Duration::from_secs(10))
        .refresh_every(Duration::from_secs(2))
        .build()
        .unwrap();
    alloc.init_home().await.unwrap();
    alloc
}

/// Whether the refresher lock of region `eu` of allocator `name` is held.
fn lock_held(server: &RedisServer, name: &str) -> bool {
    server
        .query_blocking(redis::cmd("EXISTS").arg(format!("{{flowgate:region:{name}:eu}}:lock")))
        .unwrap()
}

/// A process that stops (a redeploy: the application drops its region, `main` returns, the
/// runtime shuts down) gives the refresher lock up before it exits, so that another process
/// of the region refreshes at its next tick instead of after the lock lapses. Dropping the
/// last handle sends the release on a task the runtime's shutdown cancels before it runs;
/// `leave` sends it and waits for it.
#[test]
fn a_process_that_leaves_its_region_then_exits_gives_the_lock_up() {
    let server = RedisServer::start();
    let rt = runtime();
    rt.block_on(async {
        let alloc = allocator(&server, "exit").await;
        let region = alloc.join("eu", server.connect().await).await.unwrap();
        assert!(region.status().leader);
        let gate = region.gate();
        assert!(!region.clone().leave().await, "a clone and a gate are left");
        drop(gate);
        assert!(region.leave().await, "the last handle");
    });
    drop(rt); // the process exits
    assert!(
        !lock_held(&server, "exit"),
        "the process exited holding the refresher lock"
    );
}

/// The refresher, and the task that gives the lock up after it, end with the last handle;
/// the region joined again in the same process refreshes again.
#[test]
fn the_last_region_handle_dropped_leaves_no_task_and_the_region_can_be_joined_again() {
    let server = RedisServer::start();
    let rt = runtime();
    rt.block_on(async {
        let alloc = allocator(&server, "again").await;
        let local = server.connect().await;
        let before = tokio::runtime::Handle::current()
            .metrics()
            .num_alive_tasks();
        for round in 0..3 {
            let region = alloc.join("eu", local.clone()).await.unwrap();
            assert!(region.status().leader, "round {round}: {}", region.status());
            let gate = region.gate();
            let d = gate.check(&format!("k{round}"), 1).await.unwrap();
            assert!(d.allowed, "round {round}: {d:?} {}", region.status());
            drop((region, gate));
            assert_eq!(alive_until(before).await, before, "round {round}");
            assert!(!lock_held(&server, "again"), "round {round}");
        }
    });
}

/// A region outlives the runtime that joined it and is dropped where there is no runtime:
/// nothing panics (the lock then lapses by itself).
#[test]
fn a_region_dropped_outside_any_runtime_after_its_runtime_is_gone_does_not_panic() {
    let server = RedisServer::start();
    let rt = runtime();
    let region = rt.block_on(async {
        let alloc = allocator(&server, "orphan").await;
        alloc.join("eu", server.connect().await).await.unwrap()
    });
    drop(rt);
    drop(region);
    assert!(lock_held(&server, "orphan"), "nothing could give it up");
}

/// A region's keys in its local Redis expire once no process of it refreshes, as the home's
/// state does (a week, and at least four lease lengths, after the last refresh): an
/// allocator no longer in use (renamed, or one of many named per partner) or a region taken
/// off the lists leaves nothing behind for ever. The lease record outlives its lease, and
/// every bucket (which it converts along the shares the region held: gone first, a bucket
/// would be refilled as if the region had held its share while it held none). The lease
/// record and the demand counters had no TTL: every allocator and region ever used kept two
/// keys in each local Redis for good.
#[tokio::test]
async fn a_regions_local_keys_expire_once_no_process_refreshes_it() {
    let server = RedisServer::start();
    let day: i64 = 24 * 3600 * 1000;
    let per_second = Quota::per_second(100).unwrap();
    // One per hour, bursts of 200: a bucket takes 200 hours (8.3 days) to fill.
    let slow = Quota::per(1, Duration::from_secs(3600))
        .unwrap()
        .burst(200)
        .unwrap();
    // (name, quota, lease, the least and the most the record and counters are kept, ms)
    for (name, quota, lease, least, most) in [
        (
            "gone",
            per_second,
            Duration::from_secs(10),
            7 * day - 60_000,
            7 * day,
        ),
        // A lease longer than a week: kept four lease lengths, as the home's state.
        (
            "long",
            per_second,
            Duration::from_secs(30 * 24 * 3600),
            4 * 30 * day - 60_000,
            4 * 30 * day,
        ),
        // Buckets kept longer than a week: the record outlives them (checked below).
        ("slow", slow, Duration::from_secs(10), 7 * day, 30 * day),
    ] {
        let alloc = QuotaAllocator::builder(server.connect().await, quota)
            .name(name)
            .region(("eu", 1))
            .lease(lease)
            .build()
            .unwrap();
        alloc.init_home().await.unwrap();
        let region = alloc.join("eu", server.connect().await).await.unwrap();
        assert!(region.gate().check("k", 1).await.unwrap().allowed);
        // The report restarts the counters; the lease is written again.
        region.refresh_now().await;
        assert_eq!(region.status().refreshes, 2, "{}", region.status());
        assert!(region.leave().await);
        let pttl = |key: &str| -> i64 {
            server
                .query_blocking(
                    redis::cmd("PTTL").arg(format!("{{flowgate:region:{name}:eu}}:{key}")),
                )
                .unwrap()
        };
        let bucket = pttl("bucket:k");
        assert!(bucket > 0, "{name}: the bucket is kept {bucket} ms");
        for key in ["lease", "demand"] {
            let kept = pttl(key);
            assert!(
                (least..=most).contains(&kept),
                "{name}: {key} is kept {kept} ms after the last refresh, not {least}..={most} ms"
            );
        }
        let record = pttl("lease");
        assert!(
            record >= bucket,
            "{name}: the lease record is kept {record} ms, its bucket {bucket} ms"
        );
    }
}

/// The demand counters a decision makes again (its local Redis restarted empty: the
/// refresher had not started them yet) expire as the refresher's do, a week or more after:
/// a region whose refresher never reports again (its processes stopped meanwhile) leaves
/// nothing behind for good. They never expired: the decision's `HINCRBY` made them without
/// a TTL, and only the refresher's next report gave them one.
#[tokio::test]
async fn demand_counters_a_decision_makes_again_expire() {
    let home = RedisServer::start();
    let local = RedisServer::start();
    // No background refresh within the test.
    let alloc = QuotaAllocator::builder(
        home.fast_failing_manager().await,
        Quota::per_second(100).unwrap(),
    )
    .name("recounted")
    .region(("eu", 1))
    .lease(Duration::from_secs(60))
    .refresh_every(Duration::from_secs(10))
    .build()
    .unwrap();
    alloc.init_home().await.unwrap();
    let region = alloc
        .join("eu", local.fast_failing_manager().await)
        .await
        .unwrap();
    let gate = region.gate();
    assert!(gate.check("k", 1).await.unwrap().allowed);
    local.restart(); // empty
    // Decided once the connection is back (rejected: the lease record is gone too).
    let mut decided = false;
    for _ in 0..50 {
        if gate.check("k", 1).await.is_ok() {
            decided = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(decided, "no decision after the restart");
    let key = "{flowgate:region:recounted:eu}:demand";
    let counted: Vec<Option<i64>> = local
        .query_blocking(redis::cmd("HMGET").arg(key).arg("a").arg("r"))
        .unwrap();
    assert_ne!(counted, [None, None], "the decision is counted");
    let kept: i64 = local.query_blocking(redis::cmd("PTTL").arg(key)).unwrap();
    let day = 24 * 3600 * 1000;
    assert!(
        (7 * day - 60_000..=7 * day).contains(&kept),
        "the counters are kept {kept} ms (-1: for ever), not a week"
    );
}
