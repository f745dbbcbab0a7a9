//! Shutdown and restart of applications that use a `RedisGate`: the tasks it spawns end
//! with its last handle, it drops cleanly outside any runtime, and a gate built again over
//! the same keys goes on from what Redis holds.

use std::time::Duration;

use flowgate::Quota;
use flowgate::gate::{Limit, RedisGate};
use redis::aio::MultiplexedConnection;
use tokio::runtime::Runtime;

use super::support::{RedisServer, alive_until};

/// A burst of `n`, refilled one an hour: what is spent stays spent for the test.
fn per_hour(n: u32) -> Limit {
    Limit::TokenBucket(
        Quota::per(1, Duration::from_secs(3600))
            .unwrap()
            .burst(n)
            .unwrap(),
    )
}

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

async fn gate(conn: MultiplexedConnection, leases: u32) -> RedisGate<MultiplexedConnection> {
    RedisGate::builder(conn, per_hour(1_000))
        .prefix("shutdown:")
        .lease(leases)
        .timeout(Duration::from_secs(10))
        .build()
        .await
        .unwrap()
}

/// The batch driver and the calls left to finish by callers that gave up end with the last
/// handle: no task, and no clone of the connection, is left behind.
#[test]
fn the_last_gate_handle_dropped_leaves_no_task_behind() {
    let server = RedisServer::start();
    let rt = runtime();
    rt.block_on(async {
        // The connection's own task runs for as long as the test holds it.
        let conn = server.connect().await;
        let before = tokio::runtime::Handle::current()
            .metrics()
            .num_alive_tasks();
        for leases in [0, 10] {
            let gate = gate(conn.clone(), leases).await;
            // Callers batched behind one another, half of them given up mid-call.
            let callers: Vec<_> = (0..64)
                .map(|i| {
                    let gate = gate.clone();
                    tokio::spawn(async move { gate.check(&format!("k{}", i % 8), 1).await })
                })
                .collect();
            for (i, caller) in callers.into_iter().enumerate() {
                if i % 2 == 0 {
                    caller.abort();
                } else {
                    assert!(caller.await.unwrap().unwrap().allowed);
                }
            }
            drop(gate);
            assert_eq!(alive_until(before).await, before, "leases {leases}");
        }
    });
}

/// A gate outlives the runtime that built it and is dropped where there is no runtime at
/// all (a `static`, a struct torn down after `main`'s runtime): nothing panics.
#[test]
fn a_gate_dropped_outside_any_runtime_after_its_runtime_is_gone_does_not_panic() {
    let server = RedisServer::start();
    let rt = runtime();
    let gate = rt.block_on(async {
        let gate = gate(server.connect().await, 10).await;
        assert!(gate.check("k", 1).await.unwrap().allowed);
        gate
    });
    drop(rt);
    drop(gate);
}

/// An application that stops and starts again (a new runtime, a new connection, a gate
/// built again over the same prefix) goes on from what Redis holds: what the first run
/// spent stays spent.
#[test]
fn a_gate_built_again_over_the_same_keys_goes_on_from_what_redis_holds() {
    let server = RedisServer::start();
    for run in 0..3 {
        let rt = runtime();
        rt.block_on(async {
            let gate = RedisGate::builder(server.connect().await, per_hour(2))
                .prefix("again:")
                .timeout(Duration::from_secs(10))
                .build()
                .await
                .unwrap();
            let d = gate.check("k", 1).await.unwrap();
            assert_eq!(d.allowed, run < 2, "run {run}: {d:?}");
        });
        drop(rt);
    }
}
