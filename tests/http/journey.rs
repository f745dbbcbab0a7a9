//! "Protect my HTTP API": a `RateLimitLayer` (per client IP behind a trusted proxy, per API
//! key, a cost per route) around a `ShedLayer` (critical `/health`, sheddable `/report`) on
//! one axum `Router`, as a team puts them: shadow mode first, then enforcing; what the
//! clients read (`Retry-After`, the IETF fields) and what the team reads (`stats`,
//! `top_rejected`) must agree across the two layers.

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use axum::routing::get as route_get;
use flowgate::bulkhead::Bulkhead;
use flowgate::gate::{Gate, Limit, MemoryGate};
use flowgate::http::{
    Class, ClientIp, ForwardedHeader, Header, MissingKey, PeerIp, Policy, RateLimitLayer,
    RequestInfo, ShedLayer,
};
use flowgate::{Quota, Rate};
use http::StatusCode;

use crate::harness::{Answer, Server, client, field, get, outcomes};

/// `burst` at once, refilling `burst` per `period`.
fn quota(burst: u32, period: Duration) -> Quota {
    Quota::new(Rate::per(burst, period).unwrap(), burst).unwrap()
}

/// The rate-limit layer of the journey on `gate`: per client IP (behind the proxy at
/// 127.0.0.1, from `X-Forwarded-For`), 10 an hour; per API key, 100 an hour (requests
/// without one skip it); `/report` costs 5, the rest 1.
fn rate_limit<G: Gate + 'static>(
    gate: G,
    shadow: bool,
) -> RateLimitLayer<G, flowgate::http::InnerBody> {
    let client_ip = ClientIp::builder(ForwardedHeader::XForwardedFor)
        .trust("127.0.0.1")
        .peer(PeerIp::from_extension(|c: &ConnectInfo<SocketAddr>| c.0))
        .build()
        .unwrap();
    RateLimitLayer::builder(gate)
        .inner_body()
        .policy(Policy::new(
            "per-ip",
            quota(10, Duration::from_secs(3600)),
            client_ip,
        ))
        .policy(
            Policy::new(
                "per-key",
                quota(100, Duration::from_secs(3600)),
                Header::new("x-api-key").unwrap(),
            )
            .missing_key(MissingKey::Skip),
        )
        .cost(|req: &RequestInfo<'_>| match req.uri.path() {
            "/report" => 5,
            _ => 1,
        })
        .shadow(shadow)
        .name("journey")
        .build()
        .unwrap()
}

fn shed(bulkhead: &Bulkhead) -> ShedLayer {
    ShedLayer::builder(bulkhead.clone())
        .classify(|req: &RequestInfo<'_>| match req.uri.path() {
            "/health" => Class::Critical,
            "/report" => Class::Sheddable,
            _ => Class::Normal,
        })
        .retry_after(Duration::from_secs(2))
        .name("journey")
        .build()
        .unwrap()
}

/// The rate limit outside the shed on every route (`route_layer`: the later call wraps).
fn app<G: Gate + 'static>(
    rate_limit: RateLimitLayer<G, flowgate::http::InnerBody>,
    shed: ShedLayer,
) -> Router {
    Router::new()
        .route("/", route_get(|| async { "hello" }))
        .route("/report", route_get(|| async { "report" }))
        .route("/health", route_get(|| async { "ok" }))
        .route_layer(shed)
        .route_layer(rate_limit)
}

/// `r` of `policy` in the `RateLimit` field, and whether it carries a `t`.
fn remaining(a: &Answer, policy: &str) -> Option<(i64, bool)> {
    let text = field(&a.headers, "ratelimit")?;
    let list: sfv::List = sfv::Parser::new(&text).parse().unwrap();
    list.iter().find_map(|e| {
        let sfv::ListEntry::Item(it) = e else {
            return None;
        };
        (it.bare_item.as_string()?.as_str() == policy).then(|| {
            let r = it
                .params
                .iter()
                .find(|(k, _)| k.as_str() == "r")
                .and_then(|(_, v)| v.as_integer())
                .map(i64::from)
                .unwrap();
            (r, it.params.iter().any(|(k, _)| k.as_str() == "t"))
        })
    })
}

/// The whole journey on a `MemoryGate`: a shed `/report` is charged its cost by the rate
/// limit in front (documented: the outer layer decided it) and its `503` carries the
/// fields without `t`; `/health` keeps the reserve; the counts of the two layers add up.
#[tokio::test]
async fn both_layers_on_one_router_answer_and_count_consistently() {
    let gate = MemoryGate::new(Limit::TokenBucket(Quota::per_second(1).unwrap()));
    let bulkhead = Bulkhead::builder(2).critical_reserve(1).build().unwrap();
    let (rl, shed) = (rate_limit(gate, false), shed(&bulkhead));
    let server = Server::start(app(rl.clone(), shed.clone())).await;
    let client = client();
    let alice = [("x-forwarded-for", "203.0.113.7"), ("x-api-key", "alice")];

    let a = get(&client, &server.url("/"), &alice).await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(remaining(&a, "per-ip"), Some((9, true)));
    assert_eq!(remaining(&a, "per-key"), Some((99, true)));

    // Saturate the bulkhead for normal work: the sheddable report is shed.
    let held = bulkhead.try_acquire_owned().unwrap();
    let r = get(&client, &server.url("/report"), &alice).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{r:?}");
    assert_eq!(field(&r.headers, "retry-after").as_deref(), Some("2"));
    assert_eq!(remaining(&r, "per-ip"), Some((4, false)), "{r:?}");
    // Health keeps the reserve.
    let h = get(&client, &server.url("/health"), &alice).await;
    assert_eq!(h.status, StatusCode::OK);
    drop(held);

    // Over the per-ip quota: 3 left, a report costs 5.
    let r = get(&client, &server.url("/report"), &alice).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{r:?}");
    let retry: u64 = field(&r.headers, "retry-after").unwrap().parse().unwrap();
    assert!(
        (720..=721).contains(&retry),
        "two tokens at one each 360 s: {retry}"
    );

    let (s, sh) = (rl.stats(), shed.stats());
    assert_eq!((s.admitted, s.rejected, outcomes(&s)), (3, 1, 4), "{s:?}");
    assert_eq!(
        sh.admitted() + sh.shed() + sh.cancelled(),
        s.admitted,
        "{sh:?}"
    );
    assert_eq!(sh.sheddable.shed, 1);
    let top = rl.top_rejected(5);
    assert_eq!(top.len(), 1);
    assert_eq!(top[0].key, "per-ip:203.0.113.7");
}

/// Shadow first, then enforcing on the same gate (a new layer built while the shadow one
/// still serves): the enforcing layer starts from the buckets the shadow one charged, and
/// its 429s say what the shadow layer's fields said.
#[tokio::test]
async fn shadow_then_enforce_on_one_gate_continue_the_same_buckets() {
    let gate = MemoryGate::new(Limit::TokenBucket(Quota::per_second(1).unwrap()));
    let bulkhead = Bulkhead::builder(8).critical_reserve(1).build().unwrap();
    let shadow = rate_limit(gate.clone(), true);
    let old = Server::start(app(shadow.clone(), shed(&bulkhead))).await;
    let client = client();
    let bob = [("x-forwarded-for", "198.51.100.9")];
    for i in 0..12 {
        let a = get(&client, &old.url("/"), &bob).await;
        assert_eq!(a.status, StatusCode::OK, "{i}");
        assert!(a.headers.get("retry-after").is_none());
    }
    let s = shadow.stats();
    assert_eq!((s.admitted, s.shadow_rejected), (10, 2), "{s:?}");

    let enforcing = rate_limit(gate, false);
    let new = Server::start(app(enforcing.clone(), shed(&bulkhead))).await;
    let a = get(&client, &new.url("/"), &bob).await;
    assert_eq!(a.status, StatusCode::TOO_MANY_REQUESTS, "{a:?}");
    assert_eq!(remaining(&a, "per-ip"), Some((0, true)));
    drop(old);
    let s = enforcing.stats();
    assert_eq!((s.admitted, s.rejected), (0, 1), "{s:?}");
}
