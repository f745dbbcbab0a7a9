//! Smoke test of the Redis test harness in `tests/support/`.
#![cfg(feature = "redis")]

mod support;

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use support::{MISSING_REDIS, MISSING_REDIS_CLI, RedisCluster, RedisServer};
use tokio::time::timeout;

async fn ping(con: &mut MultiplexedConnection) -> redis::RedisResult<String> {
    redis::cmd("PING").query_async(con).await
}

/// Whether a process with this pid exists (`kill -0`).
fn pid_exists(pid: u32) -> bool {
    Command::new("kill")
        .args(["-0", &pid.to_string()])
        .stderr(std::process::Stdio::null())
        .status()
        .expect("run kill -0")
        .success()
}

#[tokio::test]
async fn server_answers_ping() {
    let server = RedisServer::start();
    assert_eq!(
        server.url(),
        format!("redis://127.0.0.1:{}/", server.port())
    );
    assert!(server.is_running());
    let mut con = server.connect().await;
    assert_eq!(ping(&mut con).await.unwrap(), "PONG");
    // The URL works as well as `client()`.
    let client = redis::Client::open(server.url()).unwrap();
    let mut con = client.get_multiplexed_async_connection().await.unwrap();
    assert_eq!(ping(&mut con).await.unwrap(), "PONG");
}

#[tokio::test]
async fn paused_server_times_out_then_answers_after_resume() {
    let server = RedisServer::start();
    let mut con = server.connect().await;
    assert_eq!(ping(&mut con).await.unwrap(), "PONG");

    server.pause();
    assert!(server.is_paused());
    let stalled = timeout(Duration::from_millis(200), ping(&mut con)).await;
    assert!(stalled.is_err(), "a paused server answered: {stalled:?}");

    server.resume();
    assert!(!server.is_paused());
    let pong = timeout(Duration::from_secs(2), ping(&mut con))
        .await
        .expect("the same connection answers after resume");
    assert_eq!(pong.unwrap(), "PONG");
    let mut fresh = server.connect().await;
    assert_eq!(ping(&mut fresh).await.unwrap(), "PONG");
}

#[tokio::test]
async fn killed_server_fails_and_restart_comes_back_empty() {
    let server = RedisServer::start();
    let (port, pid) = (server.port(), server.pid());
    let mut con = server.connect().await;
    let _: () = redis::cmd("SET")
        .arg("harness:key")
        .arg("v")
        .query_async(&mut con)
        .await
        .unwrap();

    server.kill();
    assert!(!server.is_running());
    assert!(!pid_exists(pid), "pid {pid} still exists after kill");
    let old = timeout(Duration::from_secs(2), ping(&mut con))
        .await
        .expect("a command on a killed server fails fast");
    assert!(old.is_err(), "a killed server answered: {old:?}");
    let new = timeout(Duration::from_secs(2), server.try_connect())
        .await
        .expect("connecting to a killed server fails fast");
    assert!(new.is_err(), "connected to a killed server");

    server.restart();
    assert!(server.is_running());
    assert_eq!(server.port(), port, "restart keeps the port");
    assert_ne!(server.pid(), pid, "restart starts a new process");
    let mut con = server.connect().await;
    assert_eq!(ping(&mut con).await.unwrap(), "PONG");
    let value: Option<String> = redis::cmd("GET")
        .arg("harness:key")
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(value, None, "restart must start with empty data");
}

#[tokio::test]
async fn unix_socket_server_answers_ping() {
    let server = RedisServer::start_unix();
    let path = server.socket_path().expect("unix server has a socket path");
    assert!(path.exists());
    assert_eq!(server.url(), format!("redis+unix://{}", path.display()));

    let mut con = server.connect().await;
    assert_eq!(ping(&mut con).await.unwrap(), "PONG");
    // Both unix URL schemes redis 1.x accepts.
    for url in [server.url(), format!("unix://{}", path.display())] {
        let client = redis::Client::open(url.as_str()).unwrap();
        let mut con = client.get_multiplexed_async_connection().await.unwrap();
        assert_eq!(ping(&mut con).await.unwrap(), "PONG", "{url}");
    }

    server.restart();
    let mut con = server.connect().await;
    assert_eq!(ping(&mut con).await.unwrap(), "PONG");
}

#[tokio::test]
async fn three_master_cluster_is_ok_on_every_node() {
    let cluster = RedisCluster::start(3, 0);
    assert_eq!(cluster.nodes().len(), 3);
    assert_eq!(cluster.seed_urls().len(), 3);
    assert_eq!(cluster.masters().len(), 3);
    for node in cluster.nodes() {
        let mut con = node.connect().await;
        let info: String = redis::cmd("CLUSTER")
            .arg("INFO")
            .query_async(&mut con)
            .await
            .unwrap();
        assert!(
            info.contains("cluster_state:ok"),
            "{}: {info}",
            node.host_port()
        );
    }
    // node_for_key finds the slot owner: it accepts the key without MOVED.
    for key in ["a", "b", "c", "{user:1}:tokens"] {
        let mut con = cluster.node_for_key(key).connect().await;
        let _: () = redis::cmd("SET")
            .arg(key)
            .arg(1)
            .query_async(&mut con)
            .await
            .unwrap();
    }
}

#[tokio::test]
async fn cluster_with_replicas_links_them() {
    let cluster = RedisCluster::start(3, 1);
    assert_eq!(cluster.nodes().len(), 6);
    assert_eq!(cluster.masters().len(), 3);
    assert_eq!(cluster.replicas().len(), 3);
    let pids: Vec<u32> = cluster.nodes().iter().map(RedisServer::pid).collect();
    let dirs: Vec<PathBuf> = cluster
        .nodes()
        .iter()
        .map(|n| n.dir().to_path_buf())
        .collect();
    cluster.node(0).pause();
    drop(cluster);
    for pid in pids {
        assert!(!pid_exists(pid), "cluster node {pid} survived the drop");
    }
    for dir in dirs {
        assert!(!dir.exists(), "{} survived the drop", dir.display());
    }
}

#[test]
fn dropping_a_server_stops_it() {
    let server = RedisServer::start();
    let (pid, dir) = (server.pid(), server.dir().to_path_buf());
    assert!(pid_exists(pid));
    drop(server);
    assert!(!pid_exists(pid), "pid {pid} survived the drop");
    assert!(!dir.exists(), "{} survived the drop", dir.display());

    // A paused server is stopped too.
    let server = RedisServer::start();
    let pid = server.pid();
    server.pause();
    drop(server);
    assert!(!pid_exists(pid), "paused pid {pid} survived the drop");
}

#[test]
fn a_panicking_test_still_stops_its_server() {
    let (tx, rx) = std::sync::mpsc::channel();
    let outcome = std::thread::spawn(move || {
        let server = RedisServer::start();
        server.pause();
        tx.send(server.pid()).unwrap();
        panic!("test failure while a server is paused");
    })
    .join();
    assert!(outcome.is_err());
    let pid = rx.recv().unwrap();
    assert!(!pid_exists(pid), "pid {pid} survived the panic");
}

/// Started by `missing_binaries_fail_with_one_clear_line` in a child process with a PATH
/// that lacks `redis-server`.
#[test]
#[ignore = "run as a child process by missing_binaries_fail_with_one_clear_line"]
fn child_start_server() {
    let _server = RedisServer::start();
}

/// Started in a child process with a PATH that has `redis-server` but no `redis-cli`.
#[test]
#[ignore = "run as a child process by missing_binaries_fail_with_one_clear_line"]
fn child_start_cluster() {
    let _cluster = RedisCluster::start(3, 0);
}

/// Runs one ignored test of this binary in a child process with `path` as PATH and
/// returns its combined output; asserts it failed.
fn run_child(test: &str, path: &std::ffi::OsStr) -> String {
    let exe = std::env::current_exe().unwrap();
    let output = Command::new(exe)
        .args([
            test,
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("PATH", path)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        !output.status.success(),
        "{test} passed without binaries:\n{text}"
    );
    text
}

#[test]
fn missing_binaries_fail_with_one_clear_line() {
    let empty = support::TempDir::new("flowgate-path");
    let text = run_child("child_start_server", empty.path().as_os_str());
    assert!(
        text.lines().any(|l| l == MISSING_REDIS),
        "no `{MISSING_REDIS}` line in:\n{text}"
    );

    // A PATH with redis-server but without redis-cli.
    let server = std::env::split_paths(&std::env::var_os("PATH").unwrap())
        .map(|dir| dir.join("redis-server"))
        .find(|p| p.is_file())
        .expect("redis-server on PATH");
    std::os::unix::fs::symlink(server, empty.path().join("redis-server")).unwrap();
    let text = run_child("child_start_cluster", empty.path().as_os_str());
    assert!(
        text.lines().any(|l| l == MISSING_REDIS_CLI),
        "no `{MISSING_REDIS_CLI}` line in:\n{text}"
    );
}
