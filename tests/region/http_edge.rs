//! A user's journey: one global quota of 60/s divided across three regions, each serving
//! HTTP on 127.0.0.1:0 over its region's gate, with its own local Redis and one home Redis;
//! the traffic skewed to one region; then the home paused, killed, and restarted empty.
//!
//! Leases follow the Redis clocks, which never pause: this runs on real time (2 s leases
//! refreshed every 300 ms), and asserts counts and bounds, never how long a step took.
//!
//! `RateLimitLayer` cannot carry a region's gate: `build` refuses a `RegionGate` (it has no
//! `check_all`, which the layer's all-or-nothing policies need). So each region's edge is
//! what a user writes instead: a handler that asks the gate and answers `429` with
//! `Retry-After` itself, without the layer's `RateLimit` fields, metrics or stats.

use std::sync::Arc;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use bytes::Bytes;
use flowgate::Quota;
use flowgate::gate::FailurePolicy;
use flowgate::http::{Policy, RateLimitLayer};
use flowgate::region::{
    Allocation, HomeError, QuotaAllocator, Region, RegionGate, RegionStatus, SafeShare,
};
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use redis::aio::ConnectionManager;

use crate::support::{RedisServer, TestRecorder};

const NAMES: [&str; 3] = ["us", "eu", "ap"];
const RATE: u64 = 60;
const BURST: u64 = 6;
const SAFE: u64 = 6;

/// One region: its local Redis, the process's membership, and its HTTP edge.
struct Edge {
    _local: RedisServer,
    region: Region<ConnectionManager>,
    url: String,
}

/// Every request's send time and region, admitted or not.
#[derive(Default)]
struct Seen {
    admitted: Vec<(Instant, usize)>,
    rejected: [u64; 3],
    failed: [u64; 3],
}

async fn handler(State(gate): State<RegionGate<ConnectionManager>>) -> Response {
    match gate.check("api", 1).await {
        Ok(d) if d.allowed => StatusCode::OK.into_response(),
        Ok(d) => (
            StatusCode::TOO_MANY_REQUESTS,
            [("retry-after", d.retry_after.as_secs().max(1).to_string())],
        )
            .into_response(),
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, e.to_string()).into_response(),
    }
}

fn allocator(home: ConnectionManager) -> QuotaAllocator<ConnectionManager> {
    let mut b = QuotaAllocator::builder(
        home,
        Quota::per_second(RATE as u32)
            .unwrap()
            .burst(BURST as u32)
            .unwrap(),
    )
    .name("edge")
    .policy(Allocation::FairShare)
    .safe_share(SafeShare::Units(SAFE))
    .lease(Duration::from_secs(2))
    .refresh_every(Duration::from_millis(300))
    .home_timeout(Duration::from_millis(250))
    .local_timeout(Duration::from_millis(300));
    for name in NAMES {
        b = b.region((name, 1));
    }
    b.build().unwrap()
}

/// The most admitted (by send time) in any window of `w`, from `from` on.
fn most_in(seen: &Seen, w: Duration, from: Instant) -> u64 {
    let mut times: Vec<Instant> = seen
        .admitted
        .iter()
        .map(|(t, _)| *t)
        .filter(|t| *t >= from)
        .collect();
    times.sort();
    let mut most = 0;
    let mut j = 0;
    for i in 0..times.len() {
        while times[i] - times[j] > w {
            j += 1;
        }
        most = most.max((i - j + 1) as u64);
    }
    most
}

fn leader(edges: &[Edge], r: usize) -> RegionStatus {
    edges[r].region.status()
}

fn shares(edges: &[Edge]) -> [u64; 3] {
    [0, 1, 2].map(|r| leader(edges, r).share)
}

/// Waits (up to 15 s of real time, a generous wait, not an assertion on how long) until
/// `holds` does.
async fn until(what: &str, edges: &[Edge], holds: impl Fn(&[RegionStatus]) -> bool) {
    let end = Instant::now() + Duration::from_secs(15);
    loop {
        let statuses: Vec<_> = (0..3).map(|r| leader(edges, r)).collect();
        if holds(&statuses) {
            return;
        }
        assert!(
            Instant::now() < end,
            "{what}: {}",
            statuses
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(" | ")
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_global_quota_divided_across_three_http_edges_survives_its_home() {
    let recorder = TestRecorder::default();
    let home = RedisServer::start();
    let mut edges = Vec::new();
    let mut allocators = Vec::new();
    for (r, name) in NAMES.iter().enumerate() {
        // Each region's processes have their own allocator and connection to the home.
        let alloc = allocator(home.fast_failing_manager().await);
        if r == 0 {
            assert!(alloc.init_home().await.unwrap());
        }
        let local = RedisServer::start();
        let region = {
            let _guard = metrics::set_default_local_recorder(&recorder);
            alloc
                .join(name, local.fast_failing_manager().await)
                .await
                .unwrap()
        };
        let gate = {
            let _guard = metrics::set_default_local_recorder(&recorder);
            region.gate_with(FailurePolicy::Closed)
        };
        if r == 0 {
            // The finding: the rate-limit layer does not take a region's gate.
            let refused = RateLimitLayer::builder(gate.clone())
                .policy(Policy::new(
                    "api",
                    Quota::per_second(RATE as u32).unwrap(),
                    flowgate::http::Constant::new("all"),
                ))
                .build();
            println!("RateLimitLayer over a RegionGate: {:?}", refused.err());
        }
        let app = Router::new().route("/", get(handler)).with_state(gate);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        edges.push(Edge {
            _local: local,
            region,
            url,
        });
        allocators.push(alloc);
    }
    let edges = Arc::new(edges);
    let seen = Arc::new(Mutex::new(Seen::default()));
    // Skewed: us is offered 120/s, eu and ap 8/s each.
    let offered = [120u64, 8, 8];
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut load = Vec::new();
    for r in 0..3 {
        let (url, seen, stop) = (edges[r].url.clone(), seen.clone(), stop.clone());
        load.push(tokio::spawn(async move {
            let client: Client<_, Empty<Bytes>> =
                Client::builder(TokioExecutor::new()).build_http();
            let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / offered[r]));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                tick.tick().await;
                let sent = Instant::now();
                let req = http::Request::get(&url).body(Empty::new()).unwrap();
                let status = match client.request(req).await {
                    Ok(resp) => {
                        let status = resp.status();
                        let _ = resp.into_body().collect().await;
                        Some(status)
                    }
                    Err(_) => None,
                };
                let mut seen = seen.lock().unwrap();
                match status {
                    Some(StatusCode::OK) => seen.admitted.push((sent, r)),
                    Some(StatusCode::TOO_MANY_REQUESTS) => seen.rejected[r] += 1,
                    _ => seen.failed[r] += 1,
                }
            }
        }));
    }
    let start = Instant::now();
    let gauge = |what: &str, r: usize| {
        recorder.gauge(&format!(
            "flowgate_region_{what}{{name=edge,region={}}}",
            NAMES[r]
        ))
    };

    // 1. The shares move toward demand: us well past its third, the others near their want.
    until("us's share never grew with its demand", &edges, |s| {
        s[0].share >= 35 && s[1].share <= 15 && s[2].share <= 15
    })
    .await;
    let status = allocators[0].status().await.unwrap();
    println!("skewed: {status}; shares {:?}", shares(&edges));
    assert!(status.held() <= RATE, "{status}");
    for r in 0..3 {
        let st = leader(&edges, r);
        assert!(
            st.leader && st.home_reachable && st.home_error.is_none(),
            "{st}"
        );
        // The share gauge is the status's share (a refresh may land between the two reads:
        // read again until both are of one refresh).
        let mut agreed = false;
        for _ in 0..20 {
            let before = gauge("share", r);
            let st = leader(&edges, r);
            if before == Some(st.share as f64) && gauge("share", r) == before {
                agreed = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(
            agreed,
            "{:?} against {}",
            gauge("share", r),
            leader(&edges, r)
        );
    }

    // 2. The home pauses: refreshes time out, the leases hold until they end, then the
    // regions admit at their safe shares.
    home.pause();
    until("a paused home was not shown unreachable", &edges, |s| {
        s.iter().all(|s| {
            !s.home_reachable
                && matches!(
                    s.home_error,
                    Some(HomeError::Timeout(_) | HomeError::Unreachable(_))
                )
        })
    })
    .await;
    println!("paused: {}", leader(&edges, 0));
    until("the leases never ended with the home paused", &edges, |s| {
        s.iter().all(|s| s.lease_left.is_zero())
    })
    .await;
    // Once the share gauges say so (the refresh after the lease ended sets them).
    until(
        "the share gauges never fell to the safe share",
        &edges,
        |_| (0..3).all(|r| gauge("share", r) == Some(SAFE as f64)),
    )
    .await;
    let on_safe = Instant::now();
    tokio::time::sleep(Duration::from_secs(2)).await;
    {
        let seen = seen.lock().unwrap();
        let n = seen.admitted.iter().filter(|(t, _)| *t >= on_safe).count() as u64;
        let secs = on_safe.elapsed().as_secs_f64();
        // Three safe shares of 6/s, each bucket its part of the burst (at least one), a
        // request in flight per region at the end.
        let bound = (3 * SAFE) as f64 * secs + 3.0 + 3.0;
        println!("on the safe shares: {n} admitted in {secs:.1} s (bound {bound:.0})");
        assert!(
            n as f64 <= bound,
            "{n} admitted on safe shares in {secs:.1} s"
        );
    }
    for (r, name) in NAMES.iter().enumerate() {
        let age = gauge("lease_age_seconds", r).unwrap();
        assert!(age >= 2.0, "{name}: lease age {age}");
    }
    home.resume();
    until(
        "shares never grew back after the home resumed",
        &edges,
        |s| s[0].share >= 35 && s.iter().all(|s| s.home_reachable && s.home_error.is_none()),
    )
    .await;

    // 3. The home dies, and restarts empty: the regions fall to their safe shares, then the
    // home learns for a lease (nothing grows), then shares follow demand again.
    home.kill();
    until("a dead home was not shown unreachable", &edges, |s| {
        s.iter().all(|s| {
            matches!(
                s.home_error,
                Some(HomeError::Unreachable(_) | HomeError::Timeout(_))
            ) && s.to_string().contains("home unreachable")
        })
    })
    .await;
    until("the leases never ended with the home dead", &edges, |s| {
        s.iter().all(|s| s.lease_left.is_zero())
    })
    .await;
    home.restart();
    until("the restarted home never said it learns", &edges, |s| {
        s.iter().any(|s| s.learning)
    })
    .await;
    let learning = allocators[1].status().await.unwrap();
    println!("restarted: {learning}");
    assert!(learning.held() <= RATE, "{learning}");
    if learning.learning {
        for st in &learning.regions {
            // Each reports admitting at its safe share: learning grants no more.
            assert!(st.held <= SAFE, "{learning}");
        }
    }
    until("shares never followed demand after learning", &edges, |s| {
        s[0].share >= 35 && !s.iter().any(|s| s.learning)
    })
    .await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for l in load {
        l.await.unwrap();
    }

    // Throughout: never more than the global quota plus the burst and a request per region.
    let seen = seen.lock().unwrap();
    for w in [Duration::from_secs(1), Duration::from_secs(3)] {
        let n = most_in(&seen, w, start);
        let bound = RATE as f64 * w.as_secs_f64() + (BURST + 3) as f64 + 3.0;
        println!("most admitted in {w:?}: {n} (bound {bound})");
        assert!(n as f64 <= bound, "{n} admitted in {w:?}, bound {bound}");
    }
    println!(
        "admitted {} in {:.1?}; rejected {:?}; failed {:?}",
        seen.admitted.len(),
        start.elapsed(),
        seen.rejected,
        seen.failed
    );
}
