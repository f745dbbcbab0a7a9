//! The latency-injecting `DelayProxy` test helper, against a real `redis-server`.

mod support;

use std::error::Error;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use redis::aio::MultiplexedConnection;
use support::{DelayProxy, RedisServer};

type TestResult = Result<(), Box<dyn Error>>;

const ONE_WAY: Duration = Duration::from_millis(50);

fn target(server: &RedisServer) -> SocketAddr {
    server
        .host_port()
        .parse()
        .expect("host_port is a socket address")
}

async fn connect(proxy: &DelayProxy) -> redis::RedisResult<MultiplexedConnection> {
    redis::Client::open(proxy.url())?
        .get_multiplexed_async_connection()
        .await
}

async fn ping(con: &mut MultiplexedConnection) -> redis::RedisResult<String> {
    redis::cmd("PING").query_async(con).await
}

/// Polls `cond` every 10 ms for up to 2 s.
async fn eventually(mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(2);
    while Instant::now() < deadline {
        if cond() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    cond()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trip_pays_the_delay_both_ways() -> TestResult {
    let server = RedisServer::start();
    let proxy = DelayProxy::start(target(&server), ONE_WAY).await?;
    assert_eq!(proxy.delay(), ONE_WAY);
    assert_eq!(
        proxy.url(),
        format!("redis://127.0.0.1:{}/", proxy.addr().port())
    );
    let mut con = connect(&proxy).await?;
    assert_eq!(proxy.connections(), 1);

    let started = Instant::now();
    assert_eq!(ping(&mut con).await?, "PONG");
    let elapsed = started.elapsed();
    assert!(elapsed >= 2 * ONE_WAY, "round trip took only {elapsed:?}");
    assert!(
        elapsed < Duration::from_secs(1),
        "round trip took {elapsed:?}"
    );

    // A new delay applies to the next bytes read.
    proxy.set_delay(Duration::ZERO);
    assert_eq!(proxy.delay(), Duration::ZERO);
    let started = Instant::now();
    assert_eq!(ping(&mut con).await?, "PONG");
    let elapsed = started.elapsed();
    assert!(
        elapsed < 2 * ONE_WAY,
        "undelayed round trip took {elapsed:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_requests_share_one_delay() -> TestResult {
    let server = RedisServer::start();
    let proxy = DelayProxy::start(target(&server), ONE_WAY).await?;
    let con = connect(&proxy).await?;

    let started = Instant::now();
    let pings = (0..20).map(|_| {
        let mut con = con.clone();
        async move { ping(&mut con).await }
    });
    for reply in futures::future::join_all(pings).await {
        assert_eq!(reply?, "PONG");
    }
    let elapsed = started.elapsed();
    assert!(elapsed >= 2 * ONE_WAY, "20 pings took only {elapsed:?}");
    // Serialized, 20 round trips would take 2 s.
    assert!(
        elapsed < Duration::from_millis(300),
        "20 pipelined pings took {elapsed:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_resets_connections_until_healed() -> TestResult {
    let server = RedisServer::start();
    let proxy = DelayProxy::start(target(&server), ONE_WAY).await?;
    let mut con = connect(&proxy).await?;
    assert_eq!(ping(&mut con).await?, "PONG");

    proxy.cut();
    let outcome = tokio::time::timeout(Duration::from_secs(2), ping(&mut con)).await;
    assert!(
        !matches!(outcome, Ok(Ok(_))),
        "a command went through a cut proxy"
    );
    assert!(
        eventually(|| proxy.connections() == 0).await,
        "{} connections survived the cut",
        proxy.connections()
    );

    // New connections are closed at once while cut.
    let outcome = tokio::time::timeout(Duration::from_secs(2), async {
        let mut con = connect(&proxy).await?;
        ping(&mut con).await
    })
    .await;
    assert!(
        !matches!(outcome, Ok(Ok(_))),
        "a new connection worked through a cut proxy"
    );

    proxy.heal();
    let mut con = connect(&proxy).await?;
    assert_eq!(ping(&mut con).await?, "PONG");
    assert_eq!(proxy.connections(), 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blackhole_holds_connections_open_until_healed() -> TestResult {
    let server = RedisServer::start();
    let proxy = DelayProxy::start(target(&server), Duration::ZERO).await?;
    let mut con = connect(&proxy).await?;
    assert_eq!(ping(&mut con).await?, "PONG");

    proxy.blackhole();
    // Nothing comes back: the client's own response timeout (or ours) fires.
    let outcome = tokio::time::timeout(Duration::from_secs(1), ping(&mut con)).await;
    assert!(
        !matches!(outcome, Ok(Ok(_))),
        "a command went through a blackhole"
    );
    assert_eq!(
        proxy.connections(),
        1,
        "the blackhole closed the connection"
    );

    proxy.heal();
    assert!(
        eventually(|| proxy.connections() == 0).await,
        "heal kept {} blackholed connections",
        proxy.connections()
    );
    let mut con = connect(&proxy).await?;
    assert_eq!(ping(&mut con).await?, "PONG");
    Ok(())
}
