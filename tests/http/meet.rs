//! The two sides meet: one team protects an API with `RateLimitLayer` (two policies per
//! client IP behind a trusted proxy, the IETF, draft-03 and `X-RateLimit-*` fields at once,
//! shadow mode first, then enforcing) around a `ShedLayer`; another calls it with
//! flowgate's polite client (`RetryLayer`, a `RetryBudget`, an `AdaptivePacer` per client).
//! What the client does must agree with what the server wrote and counted.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use flowgate::bulkhead::Bulkhead;
use flowgate::gate::{Limit, MemoryGate};
use flowgate::http::{
    Class, ClientIp, ForwardedHeader, HeaderStyles, PeerIp, Policy, RateLimitLayer, RequestInfo,
    ShedLayer,
};
use flowgate::pace::AdaptivePacer;
use flowgate::retry::{Backoff, RetryBudget, RetryLayer, RetryPolicy, ServerHint};
use flowgate::{Quota, Rate};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty};
use tokio::time::Instant;
use tower::{Layer, Service, ServiceExt, service_fn};

/// One attempt as the client's transport saw it.
#[derive(Debug, Clone)]
struct Seen {
    /// Which client (its `X-Forwarded-For`).
    client: usize,
    sent: Instant,
    answered: Instant,
    status: StatusCode,
    /// The `Retry-After` as the client reads it.
    retry_after: Option<Duration>,
}

type Log = Arc<Mutex<Vec<Seen>>>;

/// Log the answer `res` to what `client` sent at `sent`, as the client reads it.
fn record<B>(log: &Log, client: usize, sent: Instant, res: &Response<B>) {
    let hint = ServerHint::from_headers(res.headers(), SystemTime::now());
    log.lock().unwrap().push(Seen {
        client,
        sent,
        answered: Instant::now(),
        status: res.status(),
        retry_after: hint.retry_after,
    });
}

/// `quota` units at once, refilled at `rate`.
fn quota(rate: Rate, burst: u32) -> Quota {
    Quota::new(rate, burst).unwrap()
}

/// The client IP behind the trusted proxy at 127.0.0.1, with the peer from `peer`.
fn client_ip<T: Send + Sync + 'static>(peer: fn(&T) -> SocketAddr) -> ClientIp {
    ClientIp::builder(ForwardedHeader::XForwardedFor)
        .trust("127.0.0.1")
        .peer(PeerIp::from_extension(peer))
        .build()
        .unwrap()
}

/// The polite client of the journey around `transport`: backoff honouring `Retry-After`,
/// a retry budget, an adaptive pacer starting at 1 000/s.
fn polite<S>(transport: S) -> flowgate::retry::Retry<S, flowgate::retry::HttpClassify> {
    let pacer = AdaptivePacer::builder(Rate::per_second(1000).unwrap())
        .build()
        .unwrap();
    let backoff = Backoff::builder().max_attempts(10).seed(3).build().unwrap();
    let policy = RetryPolicy::builder(backoff)
        .budget(RetryBudget::new(10, 0.1).unwrap())
        .pacer(pacer)
        .build()
        .unwrap();
    RetryLayer::new(policy).layer(transport)
}

/// What the client saw must agree with what the server did: its `429`s are the layer's
/// rejections, its `503`s the shed layer's, no client sent a request before the
/// `Retry-After` of a `429` it had read had passed, and, once a client had read a `429`,
/// no request it sent after that was refused again (the fields keep it within the quota).
fn check(log: &[Seen], rejected: u64, shed: u64, what: &str) {
    let count = |status| log.iter().filter(|s| s.status == status).count() as u64;
    assert_eq!(
        count(StatusCode::TOO_MANY_REQUESTS),
        rejected,
        "{what}: 429s"
    );
    assert_eq!(count(StatusCode::SERVICE_UNAVAILABLE), shed, "{what}: 503s");
    for r in log
        .iter()
        .filter(|s| s.status == StatusCode::TOO_MANY_REQUESTS)
    {
        let until = r.answered + r.retry_after.expect("a 429 says when to come back");
        let early: Vec<&Seen> = log
            .iter()
            .filter(|n| n.client == r.client && n.sent > r.answered && n.sent < until)
            .collect();
        assert!(
            early.is_empty(),
            "{what}: sent before Retry-After of {r:?}: {early:?}"
        );
    }
    for c in 0..=log.iter().map(|s| s.client).max().unwrap_or(0) {
        let first = log
            .iter()
            .filter(|s| s.client == c && s.status == StatusCode::TOO_MANY_REQUESTS)
            .map(|s| s.answered)
            .min();
        if let Some(first) = first {
            let again: Vec<&Seen> = log
                .iter()
                .filter(|s| {
                    s.client == c && s.status == StatusCode::TOO_MANY_REQUESTS && s.sent > first
                })
                .collect();
            assert!(
                again.is_empty(),
                "{what}: client {c} refused again: {again:?}"
            );
        }
    }
}

/// Under paused time, in one process (the services called directly): two clients behind
/// the proxy, eight tasks each, for a minute: shadow mode for the first `shadow`, then
/// enforcing on the same gate; a bulkhead of four permits inside sheds what overlaps.
async fn journey(styles: HeaderStyles, shadow_for: Duration) {
    const CLIENTS: usize = 2;
    const TASKS: usize = 8;
    const RUN: Duration = Duration::from_secs(60);
    let start = Instant::now();
    let per_second = quota(Rate::per_second(2).unwrap(), 2);
    let per_minute = quota(Rate::per_minute(60).unwrap(), 20);
    let gate = MemoryGate::new(Limit::TokenBucket(per_second));
    let layer = |shadow: bool| {
        RateLimitLayer::builder(gate.clone())
            .policy(Policy::new(
                "per-second",
                per_second,
                client_ip(|a: &SocketAddr| *a),
            ))
            .policy(Policy::new(
                "per-minute",
                per_minute,
                client_ip(|a: &SocketAddr| *a),
            ))
            .header_styles(styles)
            .shadow(shadow)
            .build()
            .unwrap()
    };
    let (shadow, enforcing) = (layer(true), layer(false));
    let shed = ShedLayer::builder(Bulkhead::builder(4).build().unwrap())
        .classify(|_: &RequestInfo<'_>| Class::Normal)
        .retry_after(Duration::from_secs(2))
        .build()
        .unwrap();
    let api = shed.layer(service_fn(|_req: Request<Empty<Bytes>>| async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        Ok::<_, Infallible>(Response::new(Empty::<Bytes>::new()))
    }));
    let (shadow_api, enforcing_api) = (shadow.layer(api.clone()), enforcing.layer(api));
    let log: Log = Arc::default();
    let mut tasks = Vec::new();
    for client in 0..CLIENTS {
        let transport = {
            let (log, shadow_api, enforcing_api) =
                (log.clone(), shadow_api.clone(), enforcing_api.clone());
            let xff = format!("203.0.113.{client}");
            service_fn(move |mut req: Request<Empty<Bytes>>| {
                // As the proxy at 127.0.0.1 forwards it.
                req.extensions_mut()
                    .insert(SocketAddr::from(([127, 0, 0, 1], 40_000)));
                req.headers_mut()
                    .insert("x-forwarded-for", xff.parse().unwrap());
                let sent = Instant::now();
                let answer = match start.elapsed() < shadow_for {
                    true => shadow_api.clone().oneshot(req),
                    false => enforcing_api.clone().oneshot(req),
                };
                let log = log.clone();
                async move {
                    let res = answer.await?;
                    record(&log, client, sent, &res);
                    Ok::<_, Infallible>(res)
                }
            })
        };
        let polite = polite(transport);
        for _ in 0..TASKS {
            let mut polite = polite.clone();
            tasks.push(tokio::spawn(async move {
                while start.elapsed() < RUN {
                    let req = Request::get("/").body(Empty::new()).unwrap();
                    let res = polite.ready().await.unwrap().call(req).await.unwrap();
                    let _ = res.into_body().collect().await;
                }
            }));
        }
    }
    for t in tasks {
        t.await.unwrap();
    }
    let log = log.lock().unwrap();
    let (s, sh) = (enforcing.stats(), shadow.stats());
    let what = format!("{styles:?}, shadow for {shadow_for:?}");
    // In shadow mode nothing is refused: the clients saw only what the shed layer refused.
    assert_eq!(sh.rejected, 0, "{what}");
    check(&log, s.rejected, shed.stats().normal.shed, &what);
    assert!(s.admitted > 60, "{what}: {s:?}");
    if shadow_for.is_zero() {
        // The first burst met the quota: the refusals were there to be seen.
        assert!(s.rejected > 0, "{what}: {s:?}");
    } else {
        // The shadow layer's fields (`r=0` with a reset on a would-be refusal) slowed the
        // clients before anything was refused: enforcing refused none of them.
        assert!(sh.shadow_rejected > 0, "{what}: {sh:?}");
        assert_eq!(s.rejected, 0, "{what}: {s:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn the_polite_client_keeps_to_what_the_protected_api_writes() {
    let all = HeaderStyles::IETF | HeaderStyles::DRAFT_03 | HeaderStyles::X_RATELIMIT;
    for shadow in [Duration::ZERO, Duration::from_secs(10)] {
        journey(HeaderStyles::IETF, shadow).await;
        journey(all, shadow).await;
        journey(HeaderStyles::DRAFT_03, shadow).await;
        journey(HeaderStyles::X_RATELIMIT, shadow).await;
        journey(HeaderStyles::X_RATELIMIT_EPOCH, shadow).await;
    }
}

/// Over a real loopback server (axum) and hyper's client, HTTP/1 and HTTP/2 (h2c): two
/// clients behind the trusted proxy, four tasks each, two policies and every style of
/// field at once. Each 429 the clients saw is one the layer counted, and no client came
/// back before a `Retry-After` it had read.
async fn over_loopback(h2: bool) {
    use axum::Router;
    use axum::extract::ConnectInfo;
    use axum::routing::get as route_get;
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;

    use crate::harness::Server;

    const CLIENTS: usize = 2;
    const TASKS: usize = 4;
    const RUN: Duration = Duration::from_secs(3);
    let per_second = quota(Rate::per_second(2).unwrap(), 2);
    let per_3s = quota(Rate::per(6, Duration::from_secs(3)).unwrap(), 6);
    let peer = |c: &ConnectInfo<SocketAddr>| c.0;
    let limit = RateLimitLayer::builder(MemoryGate::new(Limit::TokenBucket(per_second)))
        .inner_body()
        .policy(Policy::new("per-second", per_second, client_ip(peer)))
        .policy(Policy::new("per-3s", per_3s, client_ip(peer)))
        .header_styles(HeaderStyles::IETF | HeaderStyles::DRAFT_03 | HeaderStyles::X_RATELIMIT)
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", route_get(|| async { "ok" }))
        .layer(limit.clone());
    let server = Server::start(app).await;
    let url = server.url("/");
    let log: Log = Arc::default();
    let start = Instant::now();
    let mut tasks = Vec::new();
    // Every task sends its first request together, before any answer can teach its client
    // the quota (under load, tasks started one by one could be paced by the first answers
    // and never meet a `429`).
    let together = Arc::new(tokio::sync::Barrier::new(CLIENTS * TASKS));
    for client in 0..CLIENTS {
        let hyper = Client::builder(TokioExecutor::new())
            .http2_only(h2)
            .build_http::<Empty<Bytes>>();
        let (log, xff) = (log.clone(), format!("198.51.100.{client}"));
        let polite = polite(service_fn(move |mut req: Request<Empty<Bytes>>| {
            let (hyper, log) = (hyper.clone(), log.clone());
            req.headers_mut()
                .insert("x-forwarded-for", xff.parse().unwrap());
            async move {
                let sent = Instant::now();
                let res = hyper.request(req).await?;
                record(&log, client, sent, &res);
                Ok::<_, hyper_util::client::legacy::Error>(res)
            }
        }));
        for _ in 0..TASKS {
            let (mut polite, url, together) = (polite.clone(), url.clone(), together.clone());
            tasks.push(tokio::spawn(async move {
                together.wait().await;
                while start.elapsed() < RUN {
                    let req = Request::get(url.as_str()).body(Empty::new()).unwrap();
                    let res = polite.ready().await.unwrap().call(req).await.unwrap();
                    let _ = res.into_body().collect().await;
                }
            }));
        }
    }
    for t in tasks {
        t.await.unwrap();
    }
    let log = log.lock().unwrap();
    let s = limit.stats();
    let what = if h2 { "HTTP/2" } else { "HTTP/1" };
    // The first burst (8 at once, 2 + 2 allowed) met the quota.
    assert!(s.rejected > 0, "{what}: {s:?}");
    assert_eq!(s.admitted + s.rejected, log.len() as u64, "{what}: {s:?}");
    let count = |status| log.iter().filter(|s| s.status == status).count() as u64;
    assert_eq!(count(StatusCode::TOO_MANY_REQUESTS), s.rejected, "{what}");
    for r in log
        .iter()
        .filter(|s| s.status == StatusCode::TOO_MANY_REQUESTS)
    {
        let until = r.answered + r.retry_after.unwrap();
        let early = log
            .iter()
            .filter(|n| n.client == r.client && n.sent > r.answered && n.sent < until)
            .count();
        assert_eq!(early, 0, "{what}: sent before the Retry-After of {r:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_polite_client_and_the_protected_api_agree_over_http1_and_h2() {
    over_loopback(false).await;
    over_loopback(true).await;
}

/// The fields count the server's quota units; the polite client paces requests, one unit
/// each. Where a request costs the server several units (`RateLimitLayerBuilder::cost`),
/// the client reads a remaining of 4 as 4 more requests, and meets `429`s again and again
/// after the first: `RetryLayer`'s docs say so (and what to do about it).
#[tokio::test(start_paused = true)]
async fn a_request_costing_several_units_is_paced_as_one_by_the_polite_client() {
    let start = Instant::now();
    let per_minute = quota(Rate::per_minute(60).unwrap(), 20);
    let limit = RateLimitLayer::builder(MemoryGate::new(Limit::TokenBucket(per_minute)))
        .policy(Policy::new(
            "per-minute",
            per_minute,
            flowgate::http::Constant::new("all"),
        ))
        .cost(|_: &RequestInfo<'_>| 5)
        .build()
        .unwrap();
    let api = limit.layer(service_fn(|_req: Request<Empty<Bytes>>| async {
        Ok::<_, Infallible>(Response::new(Empty::<Bytes>::new()))
    }));
    let refused = |mut polite: flowgate::retry::Retry<_, _>, from: Duration| async move {
        let mut refused_at = Vec::new();
        while start.elapsed() < from + Duration::from_secs(60) {
            let req = Request::get("/").body(Empty::new()).unwrap();
            let res = polite.ready().await.unwrap().call(req).await.unwrap();
            let info = res
                .extensions()
                .get::<flowgate::retry::RetryInfo>()
                .unwrap();
            if info.attempts > 1 {
                refused_at.push(start.elapsed() - from);
            }
        }
        refused_at
    };
    // A refusal every five seconds for half a minute (at 6 s, 11 s, .. 26 s in this run):
    // the fields alone do not keep it within the quota.
    let refused_at = refused(polite(api.clone()), Duration::ZERO).await;
    assert!(refused_at.len() >= 5, "{refused_at:?}");
    // The docs' advice: a ceiling of the server's rate over the cost, 12 a minute.
    tokio::time::sleep(Duration::from_secs(60)).await;
    let pacer = AdaptivePacer::builder(Rate::per_minute(12).unwrap())
        .build()
        .unwrap();
    let policy = RetryPolicy::builder(Backoff::builder().seed(3).build().unwrap())
        .pacer(pacer)
        .build()
        .unwrap();
    let refused_at = refused(RetryLayer::new(policy).layer(api), start.elapsed()).await;
    assert_eq!(refused_at, []);
}
