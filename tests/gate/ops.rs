//! The gate under what operators do to a running Redis: connections the server closes
//! (an idle `timeout`, `CLIENT KILL`), `SCRIPT FLUSH`, ACLs that deny, a busy script.

use std::time::Duration;

use flowgate::Quota;
use flowgate::gate::{FailurePolicy, Limit, RedisGate};
use redis::aio::ConnectionManager;

use super::support::RedisServer;

fn run(server: &RedisServer, args: &[&str]) {
    let mut cmd = redis::cmd(args[0]);
    for a in &args[1..] {
        cmd.arg(*a);
    }
    let _: redis::Value = server
        .query_blocking(&cmd)
        .unwrap_or_else(|e| panic!("{args:?}: {e}"));
}

/// A gate failing closed, over a `ConnectionManager` with the library's defaults, that
/// would stay degraded for a minute after a failure.
async fn closed_gate(server: &RedisServer) -> RedisGate<ConnectionManager> {
    let conn = ConnectionManager::new(server.client()).await.unwrap();
    RedisGate::builder(conn, Limit::TokenBucket(Quota::per_hour(100).unwrap()))
        .failure_policy(FailurePolicy::Closed)
        .probe_interval(Duration::from_secs(60))
        .build()
        .await
        .unwrap()
}

/// Once the server has closed the gate's connection, the call that finds it closed is
/// decided by the policy, but the next ones go to Redis over the new connection the
/// `ConnectionManager` makes at once: they are not refused for a probe interval (a minute
/// here, 1 s by default) while Redis answers.
async fn assert_back_at_once(gate: &RedisGate<ConnectionManager>, what: &str) {
    let _ = gate.check("k", 1).await.unwrap();
    let mut decided = Vec::new();
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let d = gate.check("k", 1).await.unwrap();
        decided.push((d.allowed, gate.is_degraded()));
        if d.allowed && !gate.is_degraded() {
            return;
        }
    }
    panic!("{what}: still refused after the connection was replaced: {decided:?}");
}

#[tokio::test]
async fn a_connection_closed_by_an_idle_timeout_does_not_degrade_the_gate_for_a_probe_interval() {
    let server = RedisServer::start();
    let gate = closed_gate(&server).await;
    assert!(gate.check("k", 1).await.unwrap().allowed);
    run(&server, &["CONFIG", "SET", "timeout", "1"]);
    // Redis closes idle connections once a second, after at least `timeout` of idleness.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    run(&server, &["CONFIG", "SET", "timeout", "0"]);
    assert_back_at_once(&gate, "idle timeout").await;
}

#[tokio::test]
async fn a_killed_client_connection_does_not_degrade_the_gate_for_a_probe_interval() {
    let server = RedisServer::start();
    let gate = closed_gate(&server).await;
    assert!(gate.check("k", 1).await.unwrap().allowed);
    run(&server, &["CLIENT", "KILL", "TYPE", "normal"]);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_back_at_once(&gate, "CLIENT KILL").await;
}
