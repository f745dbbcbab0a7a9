//! Shutdown and restart of a region member: the refresher ends with the last handle, the
//! refresher lock is given up on the way out, and a region joined again works.

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
