//! An axum service behind flowgate's HTTP layers: per-IP and per-API-key limits on `GET /`
//! (`429` with `Retry-After`, the IETF `RateLimit-Policy` / `RateLimit` fields on every
//! response), and a bulkhead that sheds the heavy `/report` route (`503` with `Retry-After`)
//! while `/health` keeps a reserved share.
//!
//! ```text
//! cargo run --example http_server --features http                    # on 127.0.0.1:3000
//! PORT=8080 cargo run --example http_server --features http
//! REDIS_URL=redis://127.0.0.1:6379/ cargo run --example http_server --features http
//! ```
//!
//! It prints the `curl` lines to try and runs until stopped (Ctrl-C, or `SIGTERM`): it then
//! stops accepting and finishes the requests in flight.
//!
//! - `GET /`: two policies, decided together (all-or-nothing): `per-ip`, 100 per minute
//!   with bursts of 100, keyed by the peer address; `per-key`, 20 per 10 s with bursts of 20,
//!   keyed by the `x-api-key` header's SHA-256 (requests without one skip it; the key itself
//!   never reaches the gate, the logs or `/stats`). A few hundred quick
//!   requests from one client meet `429`s.
//! - `GET /report`: slow (1 s) and sheddable: refused at once with `503` when no permit of
//!   the bulkhead (8 in flight, 2 of them reserved for critical work) is free.
//! - `GET /health`: critical: takes the reserve, so it answers while reports are shed.
//! - `GET /stats`: what both layers counted, and the keys rejected most.
//!
//! Decisions are made by a `MemoryGate` in this process; with `REDIS_URL`, by a `RedisGate`
//! shared by every instance (one limit across a fleet; Redis must answer at startup, and if
//! it fails or is slower than 50 ms later, each instance falls back to its own in-memory
//! gate until Redis answers again).

#[path = "support/cli.rs"]
mod cli;
#[cfg(feature = "redis")]
#[path = "support/redis_url.rs"]
mod redis_url;

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use axum::routing::get;
use flowgate::Quota;
use flowgate::bulkhead::Bulkhead;
use flowgate::gate::{Gate, Limit, MemoryGate};
use flowgate::http::{
    Class, InnerBody, MissingKey, PeerIp, Policy, RateLimitLayer, RequestInfo, ShedLayer,
};
use sha2::{Digest, Sha256};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    cli::no_arguments(
        "usage: http_server (no arguments; PORT: its port, 3000 unless set; REDIS_URL: its Redis)",
    );
    // flowgate's own log lines on stderr: the rejection summary (at most once a minute, with
    // the keys rejected most) and, with `REDIS_URL`, the fall back to memory and the return.
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(tracing_subscriber::filter::LevelFilter::INFO)
        .init();
    // A bad `PORT` or a port already taken: say which and what to do, then stop.
    let port: u16 = match std::env::var("PORT") {
        Ok(port) => port.trim().parse().unwrap_or_else(|_| {
            eprintln!(
                "PORT={port:?} is not a port number: give one from 0 to 65535 (0: any free port)"
            );
            std::process::exit(2);
        }),
        Err(_) => 3000,
    };

    let per_ip = Quota::per_minute(100)?;
    let per_key = Quota::per(20, Duration::from_secs(10))?;
    let (gate, backend) = gate(Limit::TokenBucket(per_ip)).await?;

    // 429s: both policies on every request to `/`, all-or-nothing. `inner_body`: the
    // responses keep axum's `Body` (axum would box any other body type again).
    let rate_limit = RateLimitLayer::builder(gate)
        .inner_body()
        .policy(Policy::new(
            "per-ip",
            per_ip,
            PeerIp::from_extension(|c: &ConnectInfo<SocketAddr>| c.0),
        ))
        .policy(Policy::new("per-key", per_key, api_key_digest).missing_key(MissingKey::Skip))
        .top_rejected(16)
        .name("example")
        .build()?;

    // 503s: 8 requests in flight, 2 of them only for critical work; normal requests wait up
    // to 2 s in a waiting room of 32, sheddable ones never wait.
    let bulkhead = Bulkhead::builder(8)
        .critical_reserve(2)
        .max_waiting(32)
        .wait_timeout(Duration::from_secs(2))
        .name("example")
        .build()?;
    let shed = ShedLayer::builder(bulkhead)
        .classify(|req: &RequestInfo<'_>| match req.uri.path() {
            "/health" => Class::Critical,
            "/report" => Class::Sheddable,
            _ => Class::Normal,
        })
        .wait(true)
        .retry_after(Duration::from_secs(2))
        .name("example")
        .build()?;

    // `route_layer` wraps the routes added before it; the later call wraps the earlier, so on
    // `/` the rate limit comes first: a client over its quota is answered before it takes a
    // permit of the bulkhead.
    let limited = Router::new()
        .route("/", get(hello))
        .route_layer(shed.clone())
        .route_layer(rate_limit.clone());
    let stats = {
        let (rate_limit, shed) = (rate_limit.clone(), shed.clone());
        move || async move { stats(&rate_limit, &shed) }
    };
    let app = Router::new()
        .route("/health", get(health))
        .route("/report", get(report))
        .route_layer(shed)
        .merge(limited)
        .route("/stats", get(stats));

    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .unwrap_or_else(|e| {
            eprintln!("cannot listen on {addr}: {e}");
            eprintln!("set PORT to another port (PORT=0: any free port)");
            std::process::exit(1);
        });
    let base = format!("http://{}", listener.local_addr()?);
    println!("flowgate http_server on {base} (decisions by {backend}); Ctrl-C stops it\n");
    println!("try:");
    println!("  curl -i {base}/");
    println!("  curl -i -H 'x-api-key: alice' {base}/");
    println!(
        "  for i in $(seq 300); do curl -s -o /dev/null -w '%{{http_code}}\\n' {base}/; done | sort | uniq -c"
    );
    println!(
        "  for i in $(seq 20); do curl -s -o /dev/null -w '%{{http_code}}\\n' {base}/report & done | sort | uniq -c & sleep 0.2; curl -i -w '\\n' {base}/report; curl -i {base}/health; wait"
    );
    println!("  curl {base}/stats");

    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(stopped())
    .await?;
    Ok(())
}

/// Until Ctrl-C, or on Unix `SIGTERM` (`kill`, a container's stop): the server then stops
/// accepting and finishes the requests in flight.
async fn stopped() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

async fn hello(ConnectInfo(peer): ConnectInfo<SocketAddr>) -> String {
    format!("hello, {}\n", peer.ip())
}

async fn health() -> &'static str {
    "ok\n"
}

async fn report() -> &'static str {
    tokio::time::sleep(Duration::from_secs(1)).await;
    "report: done\n"
}

/// The `x-api-key` header's SHA-256 in hex, as the `per-key` policy's key: an API key is a
/// secret, and the gate's key shows in the rejection log, in `/stats` and, on Redis, in key
/// names (`Header`'s docs say why a cryptographic digest, the same on every instance).
fn api_key_digest(req: &RequestInfo<'_>, key: &mut String) -> bool {
    match req.headers.get("x-api-key") {
        Some(api_key) if !api_key.is_empty() => {
            for byte in Sha256::digest(api_key.as_bytes()) {
                let _ = write!(key, "{byte:02x}");
            }
            true
        }
        _ => false,
    }
}

fn stats(rate_limit: &RateLimitLayer<Arc<dyn Gate>, InnerBody>, shed: &ShedLayer) -> String {
    let mut out = format!("rate limit: {:?}\n", rate_limit.stats());
    out.push_str("most rejected (policy:key, count, error):\n");
    for top in rate_limit.top_rejected(5) {
        out.push_str(&format!("  {} {} {}\n", top.key, top.count, top.error));
    }
    out.push_str(&format!(
        "shed: {:?}\nbulkhead in flight: {}\n",
        shed.stats(),
        shed.bulkhead().in_flight()
    ));
    out
}

/// The gate deciding the policies: `RedisGate` when `REDIS_URL` is set, else `MemoryGate`.
/// (The policies carry their own quotas; `limit` is the gate's own, for its `check`.)
async fn gate(limit: Limit) -> Result<(Arc<dyn Gate>, String), Box<dyn std::error::Error>> {
    let memory = MemoryGate::new(limit);
    let Ok(url) = std::env::var("REDIS_URL") else {
        return Ok((Arc::new(memory), "a MemoryGate".into()));
    };
    redis_gate(&url, limit, memory).await
}

#[cfg(feature = "redis")]
async fn redis_gate(
    url: &str,
    limit: Limit,
    fallback: MemoryGate,
) -> Result<(Arc<dyn Gate>, String), Box<dyn std::error::Error>> {
    use flowgate::gate::{FailurePolicy, RedisGate};

    // Once running, the gate falls back by itself; at startup, say what to do instead, in a
    // second or so (the manager's default retries take some 10 s to give up).
    let client = redis_url::client(url);
    let config = redis::aio::ConnectionManagerConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(1)))
        .set_number_of_retries(2);
    let conn = redis::aio::ConnectionManager::new_with_config(client, config) // reconnects by itself
        .await
        .unwrap_or_else(|e| no_redis(url, &e));
    let gate = RedisGate::builder(conn, limit)
        .prefix("flowgate-example:")
        .name("example")
        .timeout(Duration::from_millis(50))
        .failure_policy(FailurePolicy::Fallback(fallback))
        .build()
        .await?;
    Ok((Arc::new(gate), format!("a RedisGate at {url}")))
}

/// Redis cannot be reached at startup: say so, and what to do, and stop.
#[cfg(feature = "redis")]
fn no_redis(url: &str, e: &redis::RedisError) -> ! {
    eprintln!("cannot connect to Redis at {url}: {e}");
    eprintln!(
        "start one: `redis-server --save \"\" --appendonly no &`, or unset REDIS_URL to run on \
         the in-memory gate"
    );
    std::process::exit(1);
}

#[cfg(not(feature = "redis"))]
async fn redis_gate(
    url: &str,
    _: Limit,
    fallback: MemoryGate,
) -> Result<(Arc<dyn Gate>, String), Box<dyn std::error::Error>> {
    println!("REDIS_URL={url} is ignored: built without the `redis` feature");
    Ok((Arc::new(fallback), "a MemoryGate".into()))
}
