//! `RateLimitLayer` against a real server and a real client: exact counts, `Retry-After`,
//! the fields as `sfv` parses them in every style, several policies, shadow mode, trusted
//! proxies, gate errors, Redis killed mid-run, clone-after-ready and keep-alive.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use axum::routing::get as route_get;
use bytes::Bytes;
use flowgate::gate::{Gate, GateError, GateFuture, Limit, MemoryGate};
use flowgate::http::{
    ClientIp, Constant, ForwardedHeader, Header, HeaderStyles, KeyExtractor, MissingKey, PeerIp,
    Policy, RateLimitLayer, RequestInfo,
};
use flowgate::{Quota, Rate};
use http::{HeaderMap, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Empty};
use tower::{Layer, Service, ServiceExt};

use crate::harness::{Server, client, field, get, outcomes};

fn gate() -> MemoryGate {
    MemoryGate::new(Limit::TokenBucket(Quota::per_second(1).unwrap()))
}

/// The `x-client` header as the key (none: no key).
fn by_client(req: &RequestInfo<'_>, key: &mut String) -> bool {
    match req.headers.get("x-client").and_then(|v| v.to_str().ok()) {
        Some(c) => {
            key.push_str(c);
            true
        }
        None => false,
    }
}

/// The `x-user` header as the key.
fn by_user(req: &RequestInfo<'_>, key: &mut String) -> bool {
    match req.headers.get("x-user").and_then(|v| v.to_str().ok()) {
        Some(c) => {
            key.push_str(c);
            true
        }
        None => false,
    }
}

/// `burst` at once, refilling `burst` per `period`.
pub(crate) fn quota(burst: u32, period: Duration) -> Quota {
    Quota::new(Rate::per(burst, period).unwrap(), burst).unwrap()
}

/// The `per-client` policy: `quota`, keyed by the `x-client` header.
pub(crate) fn per_client(quota: Quota) -> Policy {
    Policy::new("per-client", quota, by_client)
}

/// A bare inner service answering `200 ok` in a `Full` body.
async fn ok_full(_req: Request<()>) -> Result<Response<http_body_util::Full<Bytes>>, Infallible> {
    Ok(Response::new(http_body_util::Full::new(
        Bytes::from_static(b"ok"),
    )))
}

fn app(layer: RateLimitLayer<MemoryGate>) -> Router {
    Router::new()
        .route("/", route_get(|| async { "ok" }))
        .layer(layer)
}

/// One list member of an IETF field: its name and integer parameters.
#[derive(Debug)]
struct Member {
    name: String,
    params: HashMap<String, i64>,
}

/// Parse an IETF list field with the Structured Fields parser.
fn list(headers: &HeaderMap, name: &str) -> Vec<Member> {
    let Some(text) = field(headers, name) else {
        return Vec::new();
    };
    let parsed: sfv::List = sfv::Parser::new(&text)
        .parse()
        .unwrap_or_else(|e| panic!("{name}: {text:?}: {e}"));
    parsed
        .iter()
        .map(|e| {
            let sfv::ListEntry::Item(it) = e else {
                panic!("{name}: inner list in {text:?}")
            };
            let name = it
                .bare_item
                .as_string()
                .map(|s| s.as_str().to_owned())
                .or_else(|| it.bare_item.as_token().map(|t| t.as_str().to_owned()))
                .expect("a String or Token names the policy");
            let params = it
                .params
                .iter()
                .map(|(k, v)| {
                    let v = v.as_integer().map(i64::from).expect("integer parameters");
                    (k.as_str().to_owned(), v)
                })
                .collect();
            Member { name, params }
        })
        .collect()
}

/// Parse a single-integer field with the Structured Fields parser.
fn integer(headers: &HeaderMap, name: &str) -> i64 {
    let text = field(headers, name).unwrap_or_else(|| panic!("no {name}"));
    let item: sfv::Item = sfv::Parser::new(&text).parse().unwrap();
    item.bare_item.as_integer().map(i64::from).unwrap()
}

fn retry_after(headers: &HeaderMap) -> u64 {
    headers["retry-after"].to_str().unwrap().parse().unwrap()
}

fn violated(body: &Bytes) -> Vec<String> {
    let doc: serde_json::Value = serde_json::from_slice(body).unwrap();
    doc["violated-policies"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test]
async fn exactly_the_burst_passes_and_every_429_says_when_to_retry() {
    let layer = RateLimitLayer::builder(gate())
        // Nothing refills during the test: 10 per 30 s.
        .policy(per_client(quota(10, Duration::from_secs(30))))
        .build()
        .unwrap();
    let server = Server::start(app(layer.clone())).await;
    let client = client();
    let url = server.url("/");
    let tasks: Vec<_> = (0..25)
        .map(|_| {
            let (client, url) = (client.clone(), url.clone());
            tokio::spawn(async move { get(&client, &url, &[("x-client", "a")]).await })
        })
        .collect();
    let mut answers = Vec::new();
    for t in tasks {
        answers.push(t.await.unwrap());
    }
    let ok = answers
        .iter()
        .filter(|a| a.status == StatusCode::OK)
        .count();
    let limited: Vec<_> = answers
        .iter()
        .filter(|a| a.status == StatusCode::TOO_MANY_REQUESTS)
        .collect();
    assert_eq!((ok, limited.len()), (10, 15));
    for a in &answers {
        // Fields on every response.
        let policy = list(&a.headers, "ratelimit-policy");
        assert_eq!(policy.len(), 1);
        assert_eq!(policy[0].name, "per-client");
        assert_eq!(policy[0].params["q"], 10);
        assert_eq!(policy[0].params["w"], 30);
        let rl = list(&a.headers, "ratelimit");
        assert_eq!(rl.len(), 1);
        assert!(rl[0].params["r"] <= 9);
    }
    for a in &limited {
        let t = list(&a.headers, "ratelimit")[0].params["t"];
        let secs = retry_after(&a.headers);
        assert!(secs >= 1 && secs as i64 >= t, "Retry-After {secs} < t {t}");
        assert_eq!(secs, 3, "one token per 3 s");
        assert_eq!(a.headers["content-type"], "application/problem+json");
        let doc: serde_json::Value = serde_json::from_slice(&a.body).unwrap();
        assert_eq!(
            doc["type"],
            "https://iana.org/assignments/http-problem-types#quota-exceeded"
        );
        assert_eq!(doc["status"], 429);
        assert_eq!(violated(&a.body), ["per-client"]);
    }
    let stats = layer.stats();
    assert_eq!((stats.admitted, stats.rejected), (10, 15));
    let top = layer.top_rejected(1);
    assert_eq!(top[0].key, "per-client:a");
    assert_eq!(top[0].count, 15);
}

/// `inner_body()`: the responses keep axum's `Body` (no second boxing), and the layer's own
/// 429 is the same problem document with the same fields.
#[tokio::test]
async fn inner_body_keeps_the_inner_body_type_and_answers_the_same() {
    fn same_body<S, B>(_: &S)
    where
        S: Service<Request<B>, Response = Response<axum::body::Body>>,
    {
    }
    let layer = RateLimitLayer::builder(gate())
        .inner_body()
        .policy(per_client(quota(2, Duration::from_secs(30))))
        .build()
        .unwrap();
    let inner = tower::service_fn(|_req: Request<axum::body::Body>| async {
        Ok::<_, Infallible>(Response::new(axum::body::Body::from("ok")))
    });
    same_body::<_, axum::body::Body>(&layer.layer(inner));
    let app = Router::new()
        .route("/", route_get(|| async { "ok" }))
        .layer(layer.clone());
    let server = Server::start(app).await;
    let client = client();
    let url = server.url("/");
    let mut statuses = Vec::new();
    for _ in 0..4 {
        let a = get(&client, &url, &[("x-client", "c")]).await;
        let rl = list(&a.headers, "ratelimit");
        assert_eq!(rl[0].name, "per-client");
        if a.status == StatusCode::OK {
            assert_eq!(&a.body[..], b"ok");
        } else {
            assert_eq!(a.headers["content-type"], "application/problem+json");
            assert_eq!(violated(&a.body), ["per-client"]);
            assert_eq!(retry_after(&a.headers), 15);
        }
        statuses.push(a.status);
    }
    use StatusCode as S;
    assert_eq!(
        statuses,
        [S::OK, S::OK, S::TOO_MANY_REQUESTS, S::TOO_MANY_REQUESTS]
    );
    assert_eq!(layer.stats().rejected, 2);
}

/// `inner_body()` over a bare tower service with `Full<Bytes>` bodies: the layer's own 400s
/// (a cost no policy can ever admit, a refused keyless request) are `Full` bodies too.
#[tokio::test]
async fn inner_body_answers_400_in_the_inner_body_type() {
    use http_body_util::Full;
    let layer = RateLimitLayer::builder(gate())
        .inner_body()
        .policy(per_client(quota(2, Duration::from_secs(30))).missing_key(MissingKey::Refuse))
        .cost(|req: &RequestInfo<'_>| if req.uri.path() == "/big" { 3 } else { 1 })
        .build()
        .unwrap();
    let mut svc = layer.layer(tower::service_fn(ok_full));
    let mut call = async |path: &str, client: Option<&str>| -> Response<Full<Bytes>> {
        let mut req = Request::builder().uri(path);
        if let Some(c) = client {
            req = req.header("x-client", c);
        }
        let req = req.body(()).unwrap();
        svc.ready().await.unwrap().call(req).await.unwrap()
    };
    for (path, client) in [("/big", Some("b")), ("/", None)] {
        let res = call(path, client).await;
        assert_eq!(res.status(), StatusCode::BAD_REQUEST, "{path} {client:?}");
        assert_eq!(
            res.headers()[header::CONTENT_TYPE],
            "application/problem+json"
        );
        let body = res.into_body().collect().await.unwrap().to_bytes();
        let doc: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(doc["status"], 400);
    }
    let ok = call("/", Some("b")).await;
    assert_eq!(ok.status(), StatusCode::OK);
    assert_eq!(ok.into_body().collect().await.unwrap().to_bytes(), "ok");
    let stats = layer.stats();
    assert_eq!(
        (stats.bad_request, stats.missing_key, stats.admitted),
        (1, 1, 1)
    );
}

/// The first rejection is logged at once; the next ones within the minute are counted for
/// the next log, not logged.
#[tokio::test]
async fn rejections_are_logged_at_most_once_a_minute_with_their_count() {
    let (logs, _guard) = crate::support::Logs::capture();
    let layer = RateLimitLayer::builder(gate())
        .policy(per_client(quota(1, Duration::from_secs(30))))
        .build()
        .unwrap();
    let mut svc = layer.layer(tower::service_fn(|_req: Request<()>| async {
        Ok::<_, Infallible>(Response::new(Empty::<Bytes>::new()))
    }));
    let mut statuses = Vec::new();
    for _ in 0..5 {
        let req = Request::builder().header("x-client", "z").body(()).unwrap();
        let res = svc.ready().await.unwrap().call(req).await.unwrap();
        statuses.push(res.status());
    }
    assert_eq!(statuses.iter().filter(|s| **s == StatusCode::OK).count(), 1);
    assert_eq!(layer.stats().rejected, 4);
    // The warnings with the count of rejections each carries.
    let counted: Vec<_> = logs
        .events()
        .into_iter()
        .filter(|e| e.level == tracing::Level::WARN)
        .filter_map(|e| e.field("rejected").map(str::to_owned))
        .collect();
    assert_eq!(counted, ["1"], "one log, for the first rejection");
}

#[tokio::test]
async fn a_client_that_waits_retry_after_then_succeeds() {
    let layer = RateLimitLayer::builder(gate())
        .policy(per_client(quota(1, Duration::from_millis(700))))
        .build()
        .unwrap();
    let server = Server::start(app(layer)).await;
    let client = client();
    let url = server.url("/");
    let h = [("x-client", "b")];
    assert_eq!(get(&client, &url, &h).await.status, StatusCode::OK);
    let no = get(&client, &url, &h).await;
    assert_eq!(no.status, StatusCode::TOO_MANY_REQUESTS);
    let wait = retry_after(&no.headers);
    assert_eq!(wait, 1, "700 ms rounded up");
    tokio::time::sleep(Duration::from_secs(wait)).await;
    assert_eq!(get(&client, &url, &h).await.status, StatusCode::OK);
}

/// `Retry-After` is exact to the second, over random layers of one to three policies
/// (periods not whole milliseconds, bursts of 1 to 10, costs up to the smallest burst,
/// paused time): after each `429`, the same request is refused a second before it and
/// admitted once it has passed, and the largest `t` of the violated policies is it.
/// (Coverage; passes.)
#[tokio::test(start_paused = true)]
async fn retry_after_is_never_early_nor_a_second_late_for_random_policies() {
    /// xorshift: the same layers on every run.
    fn next(x: &mut u64) -> u64 {
        *x ^= *x << 13;
        *x ^= *x >> 7;
        *x ^= *x << 17;
        *x
    }
    let mut x = 0x1234_5678_9abc_def1_u64;
    let mut rejections = 0;
    for scenario in 0..300 {
        let mut builder = RateLimitLayer::builder(gate());
        let mut smallest_burst = u32::MAX;
        for i in 0..1 + next(&mut x) % 3 {
            let count = 1 + (next(&mut x) % 20) as u32;
            let period = Duration::from_millis(1 + next(&mut x) % 20_000)
                + Duration::from_nanos(next(&mut x) % 1_000);
            let burst = 1 + (next(&mut x) % 10) as u32;
            smallest_burst = smallest_burst.min(burst);
            let quota = Quota::new(Rate::per(count, period).unwrap(), burst).unwrap();
            builder = builder.policy(Policy::new(format!("p{i}"), quota, Constant::new("k")));
        }
        let cost = 1 + (next(&mut x) % u64::from(smallest_burst)) as u32;
        let layer = builder
            .cost(move |_: &RequestInfo<'_>| cost)
            .build()
            .unwrap();
        let mut svc = layer.layer(tower::service_fn(|_req: Request<()>| async {
            Ok::<_, Infallible>(Response::new(Empty::<Bytes>::new()))
        }));
        let mut status = async || {
            let res = svc
                .ready()
                .await
                .unwrap()
                .call(Request::new(()))
                .await
                .unwrap();
            (res.status(), res.headers().clone())
        };
        let mut refused = None;
        for _ in 0..50 {
            tokio::time::advance(Duration::from_millis(next(&mut x) % 300)).await;
            let (s, headers) = status().await;
            if s == StatusCode::TOO_MANY_REQUESTS {
                refused = Some(headers);
                break;
            }
        }
        let Some(headers) = refused else { continue };
        rejections += 1;
        let wait = retry_after(&headers);
        let at = format!("scenario {scenario}: {headers:?}");
        let t = list(&headers, "ratelimit")
            .iter()
            .filter_map(|m| m.params.get("t").copied())
            .max();
        assert_eq!(t, Some(i64::try_from(wait).unwrap()), "{at}");
        if wait >= 2 {
            tokio::time::advance(Duration::from_secs(wait - 1)).await;
            assert_eq!(status().await.0, StatusCode::TOO_MANY_REQUESTS, "{at}");
            tokio::time::advance(Duration::from_secs(1)).await;
        } else {
            tokio::time::advance(Duration::from_secs(wait)).await;
        }
        assert_eq!(status().await.0, StatusCode::OK, "{at}");
    }
    assert!(rejections > 200, "{rejections} rejections");
}

#[tokio::test]
async fn every_header_style_parses_as_structured_fields() {
    let layer = RateLimitLayer::builder(gate())
        .policy(per_client(quota(5, Duration::from_secs(60))))
        .policy(Policy::new(
            "per-user",
            quota(2, Duration::from_secs(10)),
            by_user,
        ))
        .header_styles(HeaderStyles::IETF | HeaderStyles::DRAFT_03 | HeaderStyles::X_RATELIMIT)
        .build()
        .unwrap();
    let server = Server::start(app(layer)).await;
    let client = client();
    let url = server.url("/");
    let h = [("x-client", "c"), ("x-user", "u")];
    let a = get(&client, &url, &h).await;
    assert_eq!(a.status, StatusCode::OK);
    let policy = list(&a.headers, "ratelimit-policy");
    let names: Vec<&str> = policy.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(names, ["per-client", "per-user"]);
    assert_eq!((policy[1].params["q"], policy[1].params["w"]), (2, 10));
    let rl = list(&a.headers, "ratelimit");
    assert_eq!((rl[0].params["r"], rl[1].params["r"]), (4, 1));
    // Token buckets: time to full after one token.
    assert_eq!((rl[0].params["t"], rl[1].params["t"]), (12, 5));
    // The single-policy styles show the lowest remaining: per-user.
    for prefix in ["ratelimit-", "x-ratelimit-"] {
        assert_eq!(integer(&a.headers, &format!("{prefix}limit")), 2);
        assert_eq!(integer(&a.headers, &format!("{prefix}remaining")), 1);
        assert_eq!(integer(&a.headers, &format!("{prefix}reset")), 5);
    }

    let epoch = RateLimitLayer::builder(gate())
        .policy(per_client(quota(5, Duration::from_secs(60))))
        .header_styles(HeaderStyles::X_RATELIMIT_EPOCH)
        .build()
        .unwrap();
    let server = Server::start(app(epoch)).await;
    let a = get(&client, &server.url("/"), &h).await;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let reset = integer(&a.headers, "x-ratelimit-reset");
    assert!((now + 11..=now + 13).contains(&reset), "{reset} vs {now}");
    assert!(a.headers.get("ratelimit").is_none());
}

/// On a 429 the single-integer styles must not send a client back before `Retry-After`:
/// with two policies blocking, the one with the lowest remaining can reset long before the
/// other has room.
#[tokio::test]
async fn a_429s_single_integer_reset_is_never_before_retry_after() {
    let layer = RateLimitLayer::builder(gate())
        // 3 at once, full again within a second.
        .policy(per_client(quota(3, Duration::from_secs(1))))
        // 4 at once, one more a minute.
        .policy(Policy::new(
            "per-user",
            quota(4, Duration::from_secs(240)),
            by_user,
        ))
        .cost(|_: &RequestInfo<'_>| 3)
        .header_styles(HeaderStyles::DRAFT_03 | HeaderStyles::X_RATELIMIT)
        .build()
        .unwrap();
    let server = Server::start(app(layer)).await;
    let client = client();
    let url = server.url("/");
    let h = [("x-client", "c"), ("x-user", "u")];
    assert_eq!(get(&client, &url, &h).await.status, StatusCode::OK);
    // per-client: 0 left (back in a second); per-user: 1 left, 2 more needed (two minutes).
    let no = get(&client, &url, &h).await;
    assert_eq!(no.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(violated(&no.body), ["per-client", "per-user"]);
    let retry = retry_after(&no.headers) as i64;
    assert!((119..=120).contains(&retry), "{retry}");
    for prefix in ["ratelimit-", "x-ratelimit-"] {
        let reset = integer(&no.headers, &format!("{prefix}reset"));
        assert!(
            reset >= retry,
            "{prefix}reset {reset} before Retry-After {retry}"
        );
        // One policy's integers: the one that resets last.
        assert_eq!(integer(&no.headers, &format!("{prefix}limit")), 4);
        assert_eq!(integer(&no.headers, &format!("{prefix}remaining")), 1);
    }
}

/// `X_RATELIMIT_EPOCH` writes the reset as a Unix time in whole seconds: never before the
/// moment the relative fields name (`t`, and on a 429 `Retry-After`), which the current
/// second rounded down plus `t` is, by the part of the second already gone. A client that
/// sleeps until that time comes back early and meets another 429.
#[tokio::test]
async fn the_epoch_reset_is_never_before_t_or_retry_after() {
    let layer = RateLimitLayer::builder(gate())
        // One at once, one more every 30 s: nothing refills during the test.
        .policy(per_client(quota(1, Duration::from_secs(30))))
        .header_styles(HeaderStyles::IETF | HeaderStyles::X_RATELIMIT_EPOCH)
        .build()
        .unwrap();
    let server = Server::start(app(layer)).await;
    let client = client();
    let url = server.url("/");
    let since_epoch = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
    };
    for c in ["a", "b", "c"] {
        let h = [("x-client", c)];
        for status in [StatusCode::OK, StatusCode::TOO_MANY_REQUESTS] {
            // Before the request: the server decides later than this.
            let sent = since_epoch();
            let a = get(&client, &url, &h).await;
            assert_eq!(a.status, status);
            let t = list(&a.headers, "ratelimit")[0].params["t"];
            assert_eq!(t, 30);
            if status == StatusCode::TOO_MANY_REQUESTS {
                assert_eq!(retry_after(&a.headers), 30);
            }
            let reset = integer(&a.headers, "x-ratelimit-reset");
            let due = sent + Duration::from_secs(30);
            assert!(
                Duration::from_secs(reset as u64) >= due,
                "{status}: X-RateLimit-Reset {reset} is before {due:?} (sent at {sent:?} + 30 s)"
            );
        }
    }
}

/// A layer of one policy `name` keyed by `x-client`: `burst` at once, `burst` per `period`
/// seconds, writing `styles`.
fn one_policy(
    name: &str,
    burst: u32,
    period: u64,
    styles: HeaderStyles,
) -> RateLimitLayer<MemoryGate> {
    RateLimitLayer::builder(gate())
        .policy(Policy::new(
            name,
            quota(burst, Duration::from_secs(period)),
            by_client,
        ))
        .header_styles(styles)
        .build()
        .unwrap()
}

/// `inner` on the route and `outer` around it (one a minute on the route): a request passed
/// by both, then one refused by `inner`, and that 429's `Retry-After`.
async fn stacked(
    inner: RateLimitLayer<MemoryGate>,
    outer: RateLimitLayer<MemoryGate>,
) -> (crate::harness::Answer, crate::harness::Answer, i64) {
    let app = Router::new()
        .route("/", route_get(|| async { "ok" }))
        .layer(inner)
        .layer(outer);
    let server = Server::start(app).await;
    let client = client();
    let url = server.url("/");
    let h = [("x-client", "c")];
    let ok = get(&client, &url, &h).await;
    assert_eq!(ok.status, StatusCode::OK);
    let no = get(&client, &url, &h).await;
    assert_eq!(no.status, StatusCode::TOO_MANY_REQUESTS);
    let retry = retry_after(&no.headers) as i64;
    assert!((59..=60).contains(&retry), "{retry}");
    (ok, no, retry)
}

/// Two layers stacked (a site-wide one around a stricter one on the route), both with the
/// single-integer styles: the fields carry one policy, the same one they would if both
/// policies were one layer's: the lower remaining on a pass, and on the inner layer's 429
/// the policy that blocked, whose reset is never before `Retry-After`.
#[tokio::test]
async fn stacked_layers_single_integers_keep_the_lowest_and_the_429s_reset() {
    let styles = HeaderStyles::DRAFT_03 | HeaderStyles::X_RATELIMIT;
    let (ok, no, retry) = stacked(
        one_policy("route", 1, 60, styles),
        one_policy("site", 100, 60, styles),
    )
    .await;
    for prefix in ["ratelimit-", "x-ratelimit-"] {
        // The route's policy has 0 left, the site's 99.
        let values = ["limit", "remaining"].map(|f| integer(&ok.headers, &format!("{prefix}{f}")));
        assert_eq!(values, [1, 0], "{prefix}: the lower remaining");
        let reset = integer(&no.headers, &format!("{prefix}reset"));
        assert!(
            reset >= retry,
            "{prefix}reset {reset} before Retry-After {retry}"
        );
        let values = ["limit", "remaining"].map(|f| integer(&no.headers, &format!("{prefix}{f}")));
        assert_eq!(values, [1, 0], "{prefix}: the policy that blocked");
    }
}

/// An outer layer with a single-integer style around an inner one with the IETF fields only:
/// on the inner layer's 429 the outer layer's integers (a policy that did not block it) do
/// not say to come back before `Retry-After`.
#[tokio::test]
async fn an_outer_layers_single_integers_on_an_inner_429_are_not_reset_before_retry_after() {
    let (_, no, retry) = stacked(
        one_policy("route", 1, 60, HeaderStyles::IETF),
        one_policy("site", 100, 60, HeaderStyles::X_RATELIMIT),
    )
    .await;
    if no.headers.contains_key("x-ratelimit-reset") {
        let reset = integer(&no.headers, "x-ratelimit-reset");
        assert!(
            reset >= retry,
            "x-ratelimit-reset {reset} before Retry-After {retry}"
        );
    }
}

/// Two layers stacked with the IETF fields: on the inner layer's 429 the outer layer's
/// member (which passed the request) carries no `t`, as a layer's own 429 lists its
/// policies that did not block: their time to full can be later than `Retry-After`.
#[tokio::test]
async fn stacked_layers_ietf_members_on_an_inner_429_are_not_reset_after_retry_after() {
    // 100 an hour (one each 36 s) on the site.
    let (_, no, retry) = stacked(
        one_policy("route", 1, 60, HeaderStyles::IETF),
        one_policy("site", 100, 3600, HeaderStyles::IETF),
    )
    .await;
    let members = list(&no.headers, "ratelimit");
    let names: Vec<&str> = members.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(names, ["route", "site"]);
    assert_eq!(
        members[1].params["r"], 98,
        "the site's member is still listed"
    );
    for m in &members {
        if let Some(&t) = m.params.get("t") {
            assert!(t <= retry, "{}: t={t} after Retry-After {retry}", m.name);
        }
    }
}

/// A layer around a `ShedLayer` (a site-wide limit in front of a shed service): on the
/// shed's `503` the layer's policy passed the request and did not refuse it, so its fields
/// say what a layer's own refusal says of a policy that did not block: no IETF `t` after
/// `Retry-After`, no single-integer reset before it.
#[tokio::test]
async fn an_outer_layers_fields_on_an_inner_503_agree_with_its_retry_after() {
    use flowgate::bulkhead::Bulkhead;
    use flowgate::http::ShedLayer;

    // 100 an hour (time to full after one: 36 s, after Retry-After), 100 a minute (one
    // back in 0.6 s: a reset of 1 s, before Retry-After).
    for period in [3600, 60] {
        let bulkhead = Bulkhead::new(1).unwrap();
        let shed = ShedLayer::builder(bulkhead.clone())
            .retry_after(Duration::from_secs(5))
            .build()
            .unwrap();
        let outer = one_policy(
            "site",
            100,
            period,
            HeaderStyles::IETF | HeaderStyles::X_RATELIMIT,
        );
        let svc = outer.layer(shed.layer(tower::service_fn(ok_full)));
        let _held = bulkhead.try_acquire().unwrap();
        let req = Request::get("/").header("x-client", "c").body(()).unwrap();
        let res = svc.oneshot(req).await.unwrap();
        assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
        let retry = retry_after(res.headers()) as i64;
        assert_eq!(retry, 5);
        for m in list(res.headers(), "ratelimit") {
            if let Some(&t) = m.params.get("t") {
                assert!(
                    t <= retry,
                    "{period}: {}: t={t} after Retry-After {retry}",
                    m.name
                );
            }
        }
        if res.headers().contains_key("x-ratelimit-reset") {
            let reset = integer(res.headers(), "x-ratelimit-reset");
            assert!(
                reset >= retry,
                "{period}: x-ratelimit-reset {reset} before Retry-After {retry}"
            );
        }
    }
}

/// `HeaderStyles::NONE`: no rate-limit field on any response, one policy or several; a 429
/// still says when to retry and names the violated policy, and the counts are the same.
#[tokio::test]
async fn no_header_style_writes_no_field_but_a_429_still_says_when_to_retry() {
    let one = RateLimitLayer::builder(gate())
        .policy(per_client(quota(2, Duration::from_secs(30))))
        .header_styles(HeaderStyles::NONE)
        .build()
        .unwrap();
    let two = RateLimitLayer::builder(gate())
        .policy(per_client(quota(2, Duration::from_secs(30))))
        .policy(Policy::new(
            "per-user",
            quota(5, Duration::from_secs(30)),
            by_user,
        ))
        .header_styles(HeaderStyles::NONE)
        .build()
        .unwrap();
    let client = client();
    for layer in [one, two] {
        let server = Server::start(app(layer.clone())).await;
        let url = server.url("/");
        let mut statuses = Vec::new();
        for _ in 0..3 {
            let a = get(&client, &url, &[("x-client", "a"), ("x-user", "u")]).await;
            // No field of any style: they all have `ratelimit` in their names.
            for name in a.headers.keys() {
                assert!(
                    !name.as_str().contains("ratelimit"),
                    "{name} on a {}",
                    a.status
                );
            }
            if a.status == StatusCode::TOO_MANY_REQUESTS {
                assert_eq!(retry_after(&a.headers), 15, "one token per 15 s");
                assert_eq!(violated(&a.body), ["per-client"]);
            }
            statuses.push(a.status.as_u16());
        }
        assert_eq!(statuses, [200, 200, 429]);
        let stats = layer.stats();
        assert_eq!((stats.admitted, stats.rejected), (2, 1));
    }
}

#[tokio::test]
async fn the_violated_policy_is_named_and_only_it_carries_t() {
    let layer = RateLimitLayer::builder(gate())
        .policy(per_client(quota(100, Duration::from_secs(3600))))
        .policy(Policy::new(
            "per-user",
            quota(1, Duration::from_secs(5)),
            by_user,
        ))
        .build()
        .unwrap();
    let server = Server::start(app(layer)).await;
    let client = client();
    let url = server.url("/");
    let h = [("x-client", "d"), ("x-user", "v")];
    assert_eq!(get(&client, &url, &h).await.status, StatusCode::OK);
    let no = get(&client, &url, &h).await;
    assert_eq!(no.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(violated(&no.body), ["per-user"]);
    let rl = list(&no.headers, "ratelimit");
    assert_eq!(rl[0].name, "per-client");
    assert_eq!(rl[0].params["r"], 99, "nothing charged on a 429");
    assert!(!rl[0].params.contains_key("t"), "{rl:?}");
    assert_eq!(rl[1].name, "per-user");
    assert_eq!(rl[1].params["r"], 0);
    let t = rl[1].params["t"];
    assert!((4..=5).contains(&t));
    assert!(retry_after(&no.headers) as i64 >= t);
    // Another user of the same client still passes: the client's bucket was not charged.
    let other = get(&client, &url, &[("x-client", "d"), ("x-user", "w")]).await;
    assert_eq!(other.status, StatusCode::OK);
    assert_eq!(list(&other.headers, "ratelimit")[0].params["r"], 98);
}

#[tokio::test]
async fn shadow_mode_admits_all_and_counts_the_would_be_rejections() {
    let layer = RateLimitLayer::builder(gate())
        .policy(per_client(quota(3, Duration::from_secs(60))))
        .shadow(true)
        .build()
        .unwrap();
    assert!(layer.is_shadow());
    let server = Server::start(app(layer.clone())).await;
    let client = client();
    let url = server.url("/");
    for i in 0..10 {
        let a = get(&client, &url, &[("x-client", "e")]).await;
        assert_eq!(a.status, StatusCode::OK);
        let rl = list(&a.headers, "ratelimit");
        assert_eq!(
            rl[0].params["r"],
            (2 - i).max(0),
            "the fields tell the truth"
        );
        assert!(a.headers.get("retry-after").is_none());
    }
    let stats = layer.stats();
    assert_eq!(
        (stats.admitted, stats.shadow_rejected, stats.rejected),
        (3, 7, 0)
    );
    assert_eq!(layer.top_rejected(1)[0].count, 7);
}

/// Shadow mode over random traffic (one to three policies of random quotas, some skipping
/// a request without their key, costs of 1 to 3, some above a burst, paused time between
/// requests), beside the same layer in the real mode, each on a gate of its own: every
/// request the real layer answers `429` passes in the shadow one with the same
/// `RateLimit-Policy`, `RateLimit` and draft-03 fields, and the counts and top rejected
/// keys agree (`shadow_rejected` is exactly `rejected`). (Coverage; passes.)
#[tokio::test(start_paused = true)]
async fn shadow_mode_decides_random_traffic_as_the_real_mode_does() {
    /// xorshift: the same traffic on every run.
    fn next(x: &mut u64) -> u64 {
        *x ^= *x << 13;
        *x ^= *x >> 7;
        *x ^= *x << 17;
        *x
    }
    fn header_key(name: &'static str) -> impl KeyExtractor {
        move |req: &RequestInfo<'_>, key: &mut String| match req.headers.get(name) {
            Some(v) => {
                key.push_str(v.to_str().unwrap());
                true
            }
            None => false,
        }
    }
    let cost =
        |req: &RequestInfo<'_>| -> u32 { req.headers["x-cost"].to_str().unwrap().parse().unwrap() };
    let inner = || {
        tower::service_fn(|_req: Request<()>| async {
            Ok::<_, Infallible>(Response::new(Empty::<Bytes>::new()))
        })
    };
    let names = ["x-k0", "x-k1", "x-k2"];
    let mut x = 0x5555_aaaa_1234_9876_u64;
    for scenario in 0..60 {
        let n = 1 + (next(&mut x) % 3) as usize;
        let policies: Vec<Policy> = (0..n)
            .map(|i| {
                let count = 1 + (next(&mut x) % 5) as u32;
                let period = Duration::from_millis(300 * (1 + next(&mut x) % 20));
                let burst = 1 + (next(&mut x) % 6) as u32;
                let quota = Quota::new(Rate::per(count, period).unwrap(), burst).unwrap();
                let policy = Policy::new(format!("p{i}"), quota, header_key(names[i]));
                match next(&mut x) % 3 {
                    0 => policy.missing_key(MissingKey::Skip),
                    _ => policy,
                }
            })
            .collect();
        let layer = |shadow: bool| {
            let mut b = RateLimitLayer::builder(gate())
                .header_styles(HeaderStyles::IETF | HeaderStyles::DRAFT_03)
                .shadow(shadow)
                .cost(cost);
            for p in &policies {
                b = b.policy(p.clone());
            }
            b.build().unwrap()
        };
        let (real, shadow) = (layer(false), layer(true));
        let (mut a, mut b) = (real.layer(inner()), shadow.layer(inner()));
        for step in 0..30 {
            let mut req = Request::builder().header("x-cost", 1 + next(&mut x) % 3);
            for name in &names[..n] {
                if !next(&mut x).is_multiple_of(5) {
                    req = req.header(*name, next(&mut x) % 2);
                }
            }
            let req = req.body(()).unwrap();
            let copy = || {
                let mut r = Request::new(());
                *r.headers_mut() = req.headers().clone();
                r
            };
            let real_res = a.ready().await.unwrap().call(copy()).await.unwrap();
            let shadow_res = b.ready().await.unwrap().call(copy()).await.unwrap();
            let at = format!("scenario {scenario} step {step}: {:?}", req.headers());
            match real_res.status() {
                StatusCode::OK | StatusCode::TOO_MANY_REQUESTS => {
                    assert_eq!(shadow_res.status(), StatusCode::OK, "{at}");
                    for name in [
                        "ratelimit-policy",
                        "ratelimit",
                        "ratelimit-limit",
                        "ratelimit-remaining",
                        "ratelimit-reset",
                    ] {
                        assert_eq!(
                            field(real_res.headers(), name),
                            field(shadow_res.headers(), name),
                            "{name} at {at}"
                        );
                    }
                }
                status => {
                    assert_eq!(status, StatusCode::BAD_REQUEST, "{at}");
                    assert_eq!(shadow_res.status(), StatusCode::OK, "{at}");
                }
            }
            tokio::time::advance(Duration::from_millis(next(&mut x) % 2000)).await;
        }
        let (r, s) = (real.stats(), shadow.stats());
        assert_eq!(
            (r.admitted, r.rejected, r.bad_request),
            (s.admitted, s.shadow_rejected, s.bad_request),
            "scenario {scenario}"
        );
        assert_eq!(real.top_rejected(64), shadow.top_rejected(64));
    }
}

#[tokio::test]
async fn shadow_mode_with_a_refused_key_still_decides_the_other_policies() {
    // The first policy would refuse every request (no x-client); in shadow mode that is
    // counted and the second policy is still decided, counted and written.
    let layer = RateLimitLayer::builder(gate())
        .policy(per_client(quota(3, Duration::from_secs(60))).missing_key(MissingKey::Refuse))
        .policy(Policy::new(
            "per-user",
            quota(2, Duration::from_secs(60)),
            by_user,
        ))
        .shadow(true)
        .build()
        .unwrap();
    let server = Server::start(app(layer.clone())).await;
    let client = client();
    for _ in 0..5 {
        let a = get(&client, &server.url("/"), &[("x-user", "u")]).await;
        assert_eq!(a.status, StatusCode::OK);
        let rl = list(&a.headers, "ratelimit");
        assert_eq!(rl.len(), 1, "{rl:?}");
        assert_eq!(rl[0].name, "per-user");
    }
    let stats = layer.stats();
    assert_eq!(
        (stats.missing_key, stats.admitted, stats.shadow_rejected),
        (5, 2, 3)
    );
}

/// A request with no key for two refusing policies is refused once (one `400`, one
/// `missing_key`); shadow mode counts it as the real mode would refuse it: once, not once per
/// policy. (It was counted once per refusing policy: two `missing_key` for one request.)
#[tokio::test]
async fn shadow_mode_counts_a_request_missing_several_refused_keys_once() {
    let build = |shadow: bool| {
        RateLimitLayer::builder(gate())
            .policy(per_client(quota(3, Duration::from_secs(60))).missing_key(MissingKey::Refuse))
            .policy(
                Policy::new("per-user", quota(3, Duration::from_secs(60)), by_user)
                    .missing_key(MissingKey::Refuse),
            )
            .shadow(shadow)
            .build()
            .unwrap()
    };
    let (real, shadow) = (build(false), build(true));
    let real_server = Server::start(app(real.clone())).await;
    let shadow_server = Server::start(app(shadow.clone())).await;
    let client = client();
    for _ in 0..4 {
        let a = get(&client, &real_server.url("/"), &[]).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST);
        let b = get(&client, &shadow_server.url("/"), &[]).await;
        assert_eq!(b.status, StatusCode::OK);
    }
    assert_eq!(real.stats().missing_key, 4);
    assert_eq!(
        shadow.stats().missing_key,
        real.stats().missing_key,
        "{:?}",
        shadow.stats()
    );
}

/// An extractor that replaces the whole string it is given (`*key = ..`).
fn replacing(req: &RequestInfo<'_>, key: &mut String) -> bool {
    *key = req.uri.path().to_owned();
    true
}

#[tokio::test]
async fn an_extractor_that_replaces_its_string_cannot_break_the_other_keys() {
    // With a shared key buffer, `*key = ..` in the second policy's extractor erased the
    // first policy's key and panicked on a slice; each extractor now writes on its own.
    let layer = RateLimitLayer::builder(gate())
        .policy(per_client(quota(1, Duration::from_secs(60))))
        .policy(Policy::new(
            "per-path",
            quota(10, Duration::from_secs(60)),
            replacing,
        ))
        .build()
        .unwrap();
    let server = Server::start(app(layer.clone())).await;
    let client = client();
    let a = get(&client, &server.url("/"), &[("x-client", "a")]).await;
    assert_eq!(a.status, StatusCode::OK);
    // Client a is out of its quota of 1; client b has its own.
    let a = get(&client, &server.url("/"), &[("x-client", "a")]).await;
    assert_eq!(a.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(violated(&a.body), ["per-client"]);
    let b = get(&client, &server.url("/"), &[("x-client", "b")]).await;
    assert_eq!(b.status, StatusCode::OK);
    let rl = list(&b.headers, "ratelimit");
    assert_eq!((rl[0].params["r"], rl[1].params["r"]), (0, 8));
}

#[tokio::test]
async fn keyless_requests_share_skip_or_are_refused_as_configured() {
    let layer = |missing: MissingKey| {
        RateLimitLayer::builder(gate())
            .policy(per_client(quota(1, Duration::from_secs(60))).missing_key(missing))
            .build()
            .unwrap()
    };
    let client = client();
    // Shared: keyless requests are one bucket.
    let shared = layer(MissingKey::default());
    let server = Server::start(app(shared)).await;
    assert_eq!(
        get(&client, &server.url("/"), &[]).await.status,
        StatusCode::OK
    );
    let second = get(&client, &server.url("/"), &[]).await;
    assert_eq!(second.status, StatusCode::TOO_MANY_REQUESTS);
    // Skip: not limited, and no fields.
    let skip = layer(MissingKey::Skip);
    let server = Server::start(app(skip.clone())).await;
    for _ in 0..3 {
        let a = get(&client, &server.url("/"), &[]).await;
        assert_eq!(a.status, StatusCode::OK);
        assert!(a.headers.get("ratelimit").is_none());
    }
    // Refuse: 400.
    let refuse = layer(MissingKey::Refuse);
    let server = Server::start(app(refuse.clone())).await;
    let a = get(&client, &server.url("/"), &[]).await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    let doc: serde_json::Value = serde_json::from_slice(&a.body).unwrap();
    assert_eq!(doc["status"], 400);
    assert!(
        doc["detail"].as_str().unwrap().contains("per-client"),
        "{doc}"
    );
    assert_eq!(refuse.stats().missing_key, 1);
}

/// A `Header` policy under `MissingKey::Refuse`: a client whose key is longer than
/// `max_len` (a bearer token where an API key was expected) sent a key, so a `400` saying
/// only "no key for the policy" misleads it; the detail says what was wrong with the header
/// (too long, empty, bytes a key cannot hold, missing), and never echoes the value.
#[tokio::test]
async fn a_refused_header_key_says_why_it_is_no_key_without_echoing_it() {
    let layer = RateLimitLayer::builder(gate())
        .policy(
            Policy::new(
                "per-key",
                quota(5, Duration::from_secs(60)),
                Header::new("x-api-key").unwrap(),
            )
            .missing_key(MissingKey::Refuse),
        )
        .build()
        .unwrap();
    let server = Server::start(app(layer.clone())).await;
    let client = client();
    let detail = |a: &crate::harness::Answer| {
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{a:?}");
        let doc: serde_json::Value = serde_json::from_slice(&a.body).unwrap();
        doc["detail"].as_str().unwrap().to_owned()
    };
    let secret = format!("Bearer {}", "s".repeat(300));
    let long = detail(&get(&client, &server.url("/"), &[("x-api-key", &secret)]).await);
    assert!(
        long.contains("per-key") && long.contains("x-api-key") && long.contains("longer than 256"),
        "{long}"
    );
    assert!(!long.contains("Bearer") && !long.contains("sss"), "{long}");
    let missing = detail(&get(&client, &server.url("/"), &[]).await);
    assert!(missing.contains("no x-api-key"), "{missing}");
    let empty = detail(&get(&client, &server.url("/"), &[("x-api-key", "")]).await);
    assert!(empty.contains("empty"), "{empty}");
    let bytes = detail(&get(&client, &server.url("/"), &[("x-api-key", "café")]).await);
    assert!(
        bytes.contains("visible ASCII") && !bytes.contains("caf"),
        "{bytes}"
    );
    assert_eq!(layer.stats().missing_key, 4);
    let ok = get(&client, &server.url("/"), &[("x-api-key", "k-1")]).await;
    assert_eq!(ok.status, StatusCode::OK);
}

/// A per-key policy that skips keyless requests (the docs' API-key pattern): a client that
/// sends its key on two field lines is counted under the key the app reads (the first
/// line, as `HeaderMap::get` and the typed-header extractors read it), not let through
/// unlimited as keyless.
#[tokio::test]
async fn a_key_sent_on_two_field_lines_is_still_limited() {
    let layer = RateLimitLayer::builder(gate())
        .policy(
            Policy::new(
                "per-key",
                quota(2, Duration::from_secs(60)),
                Header::new("x-api-key").unwrap(),
            )
            .missing_key(MissingKey::Skip),
        )
        .build()
        .unwrap();
    // The app authenticates by the key it reads: the first line.
    let app = Router::new()
        .route(
            "/",
            route_get(|headers: HeaderMap| async move {
                headers["x-api-key"].to_str().unwrap().to_owned()
            }),
        )
        .layer(layer.clone());
    let server = Server::start(app).await;
    let client = client();
    let twice = [("x-api-key", "alice"), ("x-api-key", "alice")];
    let mut statuses = Vec::new();
    for _ in 0..4 {
        statuses.push(get(&client, &server.url("/"), &twice).await.status);
    }
    assert_eq!(
        statuses,
        [
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS,
            StatusCode::TOO_MANY_REQUESTS
        ],
        "a key sent twice must be limited like the key sent once"
    );
    // A second line with another value does not open a fresh bucket either.
    let other = [("x-api-key", "alice"), ("x-api-key", "mallory")];
    let answer = get(&client, &server.url("/"), &other).await;
    assert_eq!(answer.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(layer.stats().rejected, 3);
}

/// Two policies, one skipped for keyless requests: the fields list only the policies
/// applied to each request.
#[tokio::test]
async fn the_fields_list_only_the_policies_applied() {
    let layer = RateLimitLayer::builder(gate())
        .policy(per_client(quota(5, Duration::from_secs(60))))
        .policy(
            Policy::new("per-user", quota(3, Duration::from_secs(30)), by_user)
                .missing_key(MissingKey::Skip),
        )
        .build()
        .unwrap();
    let server = Server::start(app(layer)).await;
    let client = client();
    let names = |a: &crate::harness::Answer, field: &str| -> Vec<String> {
        list(&a.headers, field)
            .into_iter()
            .map(|m| m.name)
            .collect()
    };
    let anonymous = get(&client, &server.url("/"), &[("x-client", "k")]).await;
    assert_eq!(anonymous.status, StatusCode::OK);
    assert_eq!(names(&anonymous, "ratelimit-policy"), ["per-client"]);
    assert_eq!(names(&anonymous, "ratelimit"), ["per-client"]);
    let user = get(
        &client,
        &server.url("/"),
        &[("x-client", "k"), ("x-user", "u")],
    )
    .await;
    assert_eq!(user.status, StatusCode::OK);
    assert_eq!(names(&user, "ratelimit-policy"), ["per-client", "per-user"]);
    assert_eq!(names(&user, "ratelimit"), ["per-client", "per-user"]);
    let policy = list(&user.headers, "ratelimit-policy");
    assert_eq!((policy[1].params["q"], policy[1].params["w"]), (3, 30));
}

#[tokio::test]
async fn a_request_that_can_never_pass_is_a_400_and_a_free_one_passes_undecided() {
    let layer = RateLimitLayer::builder(gate())
        .policy(per_client(quota(5, Duration::from_secs(60))))
        .cost(|req: &RequestInfo<'_>| match req.uri.path() {
            "/" => 6,
            "/free" => 0,
            _ => 1,
        })
        .build()
        .unwrap();
    let routes = Router::new()
        .route("/", route_get(|| async { "ok" }))
        .route("/free", route_get(|| async { "ok" }))
        .route("/other", route_get(|| async { "ok" }))
        .layer(layer.clone());
    let server = Server::start(routes).await;
    let client = client();
    let a = get(&client, &server.url("/"), &[("x-client", "f")]).await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    assert!(a.headers.get(header::RETRY_AFTER).is_none());
    assert_eq!(a.headers[header::CONTENT_TYPE], "application/problem+json");
    let doc: serde_json::Value = serde_json::from_slice(&a.body).unwrap();
    assert_eq!(doc["status"], 400);
    assert!(doc["detail"].as_str().unwrap().contains("6"), "{doc}");
    // A key the gate refuses (over 512 bytes) is the client's error too.
    let long = "k".repeat(600);
    let b = get(&client, &server.url("/other"), &[("x-client", &long)]).await;
    assert_eq!(b.status, StatusCode::BAD_REQUEST);
    // Cost 0: free, as often as asked, without fields.
    for _ in 0..10 {
        let c = get(&client, &server.url("/free"), &[("x-client", "f")]).await;
        assert_eq!(c.status, StatusCode::OK);
        assert!(c.headers.get("ratelimit").is_none());
    }
    let stats = layer.stats();
    assert_eq!((stats.bad_request, stats.gate_error), (2, 0));
    assert_eq!(stats.admitted, 10);
}

/// A cost above one of several policies' bursts: the `400` names that policy and its
/// burst. Before, its detail was the gate's error alone ("cost 6 exceeds the capacity 5"),
/// which named no policy: a client under two could not tell which to ask less of.
#[tokio::test]
async fn a_cost_above_a_burst_names_the_policy_it_is_above() {
    let layer = RateLimitLayer::builder(gate())
        .policy(per_client(quota(5, Duration::from_secs(60))))
        .policy(Policy::new(
            "per-user",
            quota(20, Duration::from_secs(60)),
            by_user,
        ))
        .cost(|req: &RequestInfo<'_>| if req.uri.path() == "/" { 6 } else { 30 })
        .build()
        .unwrap();
    let routes = Router::new()
        .route("/", route_get(|| async { "ok" }))
        .route("/huge", route_get(|| async { "ok" }))
        .layer(layer.clone());
    let server = Server::start(routes).await;
    let client = client();
    let both = [("x-client", "c"), ("x-user", "u")];
    let detail = |body: &[u8]| {
        let doc: serde_json::Value = serde_json::from_slice(body).unwrap();
        doc["detail"].as_str().unwrap().to_owned()
    };
    let one = get(&client, &server.url("/"), &both).await;
    assert_eq!(one.status, StatusCode::BAD_REQUEST);
    let d = detail(&one.body);
    assert!(d.contains("\"per-client\" (burst 5)"), "{d}");
    assert!(!d.contains("per-user"), "{d}");
    let two = get(&client, &server.url("/huge"), &both).await;
    assert_eq!(two.status, StatusCode::BAD_REQUEST);
    let d = detail(&two.body);
    assert!(d.contains("\"per-client\" (burst 5)"), "{d}");
    assert!(d.contains("\"per-user\" (burst 20)"), "{d}");
    assert!(d.contains("cost 30"), "{d}");
    assert_eq!(layer.stats().bad_request, 2);
}

#[tokio::test]
async fn bad_configurations_are_config_errors() {
    let p = |name: &str| Policy::new(name, quota(1, Duration::from_secs(1)), by_client);
    let build = |ps: Vec<Policy>| {
        ps.into_iter()
            .fold(RateLimitLayer::builder(gate()), |b, p| b.policy(p))
            .build()
    };
    assert!(build(vec![]).is_err());
    assert!(build(vec![p("a"), p("a")]).is_err());
    assert!(build(vec![p("é")]).is_err());
    assert!(build(vec![p("a:b")]).is_err());
    assert!(build(vec![p("")]).is_err());
    assert!(build((0..33).map(|i| p(&format!("p{i}"))).collect()).is_err());
    assert!(build(vec![p("a b-\"c\"")]).is_ok());
    let styles = RateLimitLayer::builder(gate())
        .policy(p("a"))
        .header_styles(HeaderStyles::X_RATELIMIT | HeaderStyles::X_RATELIMIT_EPOCH)
        .build();
    assert!(styles.is_err());
    let top = RateLimitLayer::builder(gate())
        .policy(p("a"))
        .top_rejected(0)
        .build();
    assert!(top.is_err());
    // A MemoryGate decides at most 16 distinct quotas together: 17 would be refused on
    // every request (a 503) once its shards held them all; refused when built instead.
    let distinct = |n: u32| {
        (1..=n)
            .map(|i| Policy::new(format!("p{i}"), quota(i, Duration::from_secs(1)), by_client))
            .collect::<Vec<_>>()
    };
    assert!(build(distinct(16)).is_ok());
    let e = build(distinct(17)).unwrap_err();
    assert_eq!(e.field(), "rate_limit.policies");
    assert!(e.reason().contains("17 distinct quotas"), "{e}");
}

/// A gate key is `<key prefix><policy name>:<key>`, at most 512 bytes (longer, the gate
/// refuses it). A prefix and name that leave no room for even a 1-byte key are refused when
/// built, naming the bound, instead of a layer that answers every request `400` as the
/// client's fault; one byte of room left is accepted, and a 1-byte key admitted.
#[tokio::test]
async fn a_key_prefix_and_policy_name_that_leave_no_room_for_a_key_are_config_errors() {
    let build = |prefix: usize, name: &str| {
        RateLimitLayer::builder(gate())
            .key_prefix("x".repeat(prefix))
            .policy(Policy::new(
                name,
                quota(1, Duration::from_secs(1)),
                by_client,
            ))
            .inner_body()
            .build()
    };
    let e = build(510, "a").unwrap_err();
    assert_eq!(
        (e.field(), e.kind()),
        ("rate_limit.key_prefix", flowgate::ConfigErrorKind::TooLarge)
    );
    assert_eq!(
        e.to_string(),
        "invalid rate_limit.key_prefix: 510 bytes leave no room for a policy name and a key \
         in a gate key (<prefix><policy name>:<key>, at most 512 bytes)"
    );
    let e = build(509, "ab").unwrap_err();
    assert_eq!(
        (e.field(), e.kind()),
        ("rate_limit.policies", flowgate::ConfigErrorKind::TooLarge)
    );
    assert_eq!(
        e.to_string(),
        "invalid rate_limit.policies: policy name \"ab\" (2 bytes) after the key prefix \
         (509 bytes) leaves no room for a key in a gate key (<prefix><policy name>:<key>, at \
         most 512 bytes)"
    );
    let e = build(0, &"n".repeat(511)).unwrap_err();
    assert_eq!(e.field(), "rate_limit.policies");
    // 509 + 1 + ':' + a 1-byte key is 512 bytes: admitted.
    let layer = build(509, "a").unwrap();
    let mut svc = layer.layer(tower::service_fn(ok_full));
    let req = Request::builder().header("x-client", "c").body(()).unwrap();
    let res = svc.ready().await.unwrap().call(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
}

/// The shared key of keyless requests ([`MissingKey::Shared`]) makes a gate key too:
/// `<key prefix><policy name>:<shared key>`. One past 512 bytes is refused when built,
/// instead of a layer that answers every request without a key `400`; at 512 bytes a
/// keyless request is admitted.
#[tokio::test]
async fn a_shared_missing_key_too_long_for_a_gate_key_is_a_config_error() {
    let build = |shared: usize| {
        RateLimitLayer::builder(gate())
            .key_prefix("pre/")
            .policy(
                Policy::new("a", quota(1, Duration::from_secs(1)), by_client)
                    .missing_key(MissingKey::Shared("k".repeat(shared))),
            )
            .inner_body()
            .build()
    };
    let e = build(507).unwrap_err();
    assert_eq!(
        (e.field(), e.kind()),
        ("rate_limit.policies", flowgate::ConfigErrorKind::TooLarge)
    );
    assert_eq!(
        e.to_string(),
        "invalid rate_limit.policies: the shared key of policy \"a\" for requests without \
         one (507 bytes) makes a gate key of 513 bytes (<prefix><policy name>:<key>, at most \
         512 bytes)"
    );
    let layer = build(506).unwrap();
    let mut svc = layer.layer(tower::service_fn(ok_full));
    let req = Request::builder().body(()).unwrap();
    let res = svc.ready().await.unwrap().call(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
}

/// `n` policies `p<i>` for `i` in `range`, each with a quota of its own (burst `i + 1` a
/// minute, so nothing refills during the test), all keyed by `x-client`.
fn distinct_policies(range: std::ops::Range<u32>) -> Vec<Policy> {
    range
        .map(|i| {
            Policy::new(
                format!("p{i}"),
                quota(i + 1, Duration::from_secs(60)),
                by_client,
            )
        })
        .collect()
}

/// A layer over `gate` with `policies`.
fn layer_over(
    gate: &MemoryGate,
    policies: Vec<Policy>,
) -> Result<RateLimitLayer<MemoryGate>, flowgate::ConfigError> {
    policies
        .into_iter()
        .fold(RateLimitLayer::builder(gate.clone()), |b, p| b.policy(p))
        .build()
}

/// `clients` requests through each server, one per client (`x-client: c<n>`); the statuses.
async fn one_each(servers: &[&Server], clients: usize) -> Vec<StatusCode> {
    let client = client();
    let mut statuses = Vec::new();
    for n in 0..clients {
        let c = format!("c{n}");
        for server in servers {
            statuses.push(
                get(&client, &server.url("/"), &[("x-client", &c)])
                    .await
                    .status,
            );
        }
    }
    statuses
}

/// Layers sharing one `MemoryGate` share its 16 distinct quotas: a layer whose quotas would
/// take the layers' together past 16 is refused when built, naming the count. Before, each
/// build checked its own quotas alone, so two layers of 9 were both built and then many of
/// their requests got a 503 (`KeyspaceFull`) once the gate's shards held 18 quotas.
/// Quotas stay registered while a clone of the layer or a service made from it lives, and
/// are released when the last one is dropped.
#[tokio::test]
async fn layers_sharing_a_memory_gate_are_refused_past_its_16_quotas_together() {
    let gate = gate();
    let first = layer_over(&gate, distinct_policies(0..9)).unwrap();
    match layer_over(&gate, distinct_policies(9..18)) {
        Ok(second) => {
            let a = Server::start(app(first.clone())).await;
            let b = Server::start(app(second.clone())).await;
            let statuses = one_each(&[&a, &b], 100).await;
            let unavailable = statuses
                .iter()
                .filter(|&&s| s == StatusCode::SERVICE_UNAVAILABLE)
                .count();
            panic!(
                "a second layer of 9 quotas was built over the gate holding 9: \
                 {unavailable} of {} requests got 503 (first {:?}, second {:?})",
                statuses.len(),
                first.stats(),
                second.stats(),
            );
        }
        Err(e) => {
            assert_eq!(e.field(), "rate_limit.policies");
            assert!(e.reason().contains("18 distinct quotas"), "{e}");
        }
    }
    // 7 more make 16 together: built, and every request through both is decided (one
    // request per client: all admitted, none a 503).
    let second = layer_over(&gate, distinct_policies(9..16)).unwrap();
    // A quota both layers use counts once.
    let shared = layer_over(&gate, distinct_policies(0..2)).unwrap();
    {
        let a = Server::start(app(first.clone())).await;
        let b = Server::start(app(second.clone())).await;
        let statuses = one_each(&[&a, &b], 100).await;
        assert!(
            statuses.iter().all(|&s| s == StatusCode::OK),
            "{statuses:?}"
        );
        assert_eq!((first.stats().admitted, first.stats().gate_error), (100, 0));
        assert_eq!(
            (second.stats().admitted, second.stats().gate_error),
            (100, 0)
        );
    }
    // The servers' tasks hold clones of these layers until they are aborted; what follows
    // is on a gate of its own. A layer's quotas stay registered while a clone of it or a
    // service made from it lives: a new quota is refused while any of them does, and
    // while another layer uses some of the same quotas.
    drop(shared);
    let gate = MemoryGate::new(Limit::TokenBucket(Quota::per_second(1).unwrap()));
    let first = layer_over(&gate, distinct_policies(0..9)).unwrap();
    let second = layer_over(&gate, distinct_policies(9..16)).unwrap();
    let shared = layer_over(&gate, distinct_policies(0..2)).unwrap();
    let clone = first.clone();
    drop(first);
    let service = clone.layer(tower::service_fn(ok_full));
    drop(clone);
    let e = layer_over(&gate, distinct_policies(16..17)).unwrap_err();
    assert!(e.reason().contains("17 distinct quotas"), "{e}");
    drop(service);
    // `shared` still uses quotas 0 and 1: 7 of `first`'s are released, and 7 others fit.
    assert!(layer_over(&gate, distinct_policies(16..24)).is_err());
    let third = layer_over(&gate, distinct_policies(16..23)).unwrap();
    drop((shared, third));
    // Only `second` (7 quotas) is left: 9 others fit, again and again.
    assert!(layer_over(&gate, distinct_policies(16..25)).is_ok());
    assert!(layer_over(&gate, distinct_policies(30..39)).is_ok());
    drop(second);
    // Rebuilding over and over does not exhaust the gate.
    for _ in 0..20 {
        assert!(layer_over(&gate, distinct_policies(100..116)).is_ok());
    }
}

/// A dropped layer's quotas give their room on a shared `MemoryGate` to the layers built
/// after it. Dropping a layer released its registration, but its quotas' buckets kept
/// their places in the gate's shards (16 quotas each, and the shard's keys) until they
/// were back to full: the registry let a new layer of 16 quotas be built, and then its
/// requests were refused (a 503, `KeyspaceFull`) for as long as the dropped layer's
/// buckets stayed busy (here an hour). Layers built and dropped a thousand times, each
/// with quotas of its own, have every request decided.
#[tokio::test]
async fn a_dropped_layers_quotas_make_room_for_the_layers_built_after_it() {
    // 16 shards of 64 keys.
    let gate = MemoryGate::builder(Limit::TokenBucket(Quota::per_second(1).unwrap()))
        .max_keys(1_024)
        .build()
        .unwrap();
    let mut refused = Vec::new();
    for cycle in 0..1_000u64 {
        // 16 quotas no other cycle uses, a burst an hour: no bucket is full again while
        // the test runs.
        let policies = (0..16u32).map(|i| {
            let period = Duration::from_secs(3_600 + cycle);
            let quota = Quota::new(Rate::per(i + 1, period).unwrap(), i + 1).unwrap();
            Policy::new(format!("p{i}"), quota, by_client)
        });
        let layer = layer_over(&gate, policies.collect()).unwrap();
        let mut svc = layer.layer(tower::service_fn(ok_full));
        for client in 0..4 {
            let req = Request::get("/")
                .header("x-client", format!("c{client}"))
                .body(())
                .unwrap();
            let res = ServiceExt::<Request<()>>::ready(&mut svc)
                .await
                .unwrap()
                .call(req)
                .await
                .unwrap();
            if res.status() != StatusCode::OK {
                refused.push((cycle, client, res.status()));
            }
        }
    }
    assert!(
        refused.is_empty(),
        "{} of 4 000 requests refused; the first: {:?}",
        refused.len(),
        &refused[..refused.len().min(4)]
    );
}

#[tokio::test]
async fn a_spoofed_left_most_forwarded_for_does_not_change_the_key() {
    let peer = || PeerIp::from_extension(|c: &ConnectInfo<SocketAddr>| c.0);
    // The test client connects from 127.0.0.1: here a trusted proxy.
    let behind_proxy = ClientIp::builder(ForwardedHeader::XForwardedFor)
        .trust("127.0.0.0/8")
        .peer(peer())
        .build()
        .unwrap();
    let layer = RateLimitLayer::builder(gate())
        .policy(Policy::new(
            "per-ip",
            quota(2, Duration::from_secs(60)),
            behind_proxy,
        ))
        .build()
        .unwrap();
    let server = Server::start(app(layer.clone())).await;
    let client = client();
    let url = server.url("/");
    let mut statuses = Vec::new();
    for spoof in ["6.6.6.6", "1.2.3.4", "9.9.9.9"] {
        let xff = format!("{spoof}, 203.0.113.7");
        statuses.push(
            get(&client, &url, &[("x-forwarded-for", &xff)])
                .await
                .status,
        );
    }
    assert_eq!(
        statuses,
        [
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS
        ]
    );
    assert_eq!(layer.top_rejected(1)[0].key, "per-ip:203.0.113.7");

    // An untrusted peer's header is ignored: the key is the peer.
    let untrusting = ClientIp::builder(ForwardedHeader::XForwardedFor)
        .trust("10.0.0.0/8")
        .peer(peer())
        .build()
        .unwrap();
    let layer = RateLimitLayer::builder(gate())
        .policy(Policy::new(
            "per-ip",
            quota(1, Duration::from_secs(60)),
            untrusting,
        ))
        .build()
        .unwrap();
    let server = Server::start(app(layer.clone())).await;
    let url = server.url("/");
    let a = get(&client, &url, &[("x-forwarded-for", "203.0.113.8")]).await;
    assert_eq!(a.status, StatusCode::OK);
    let b = get(&client, &url, &[("x-forwarded-for", "203.0.113.9")]).await;
    assert_eq!(b.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(layer.top_rejected(1)[0].key, "per-ip:127.0.0.1");
}

/// An inner service whose `poll_ready` reserves a slot that `call` needs; a clone has none.
#[derive(Default)]
struct Reserving {
    reserved: bool,
}

impl Clone for Reserving {
    fn clone(&self) -> Self {
        Reserving { reserved: false }
    }
}

impl<B> Service<Request<B>> for Reserving {
    type Response = Response<String>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<String>, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.reserved = true;
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Request<B>) -> Self::Future {
        let reserved = std::mem::replace(&mut self.reserved, false);
        Box::pin(async move {
            let mut res = Response::new(String::new());
            if !reserved {
                *res.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
            }
            Ok(res)
        })
    }
}

#[tokio::test]
async fn the_inner_service_that_was_ready_is_the_one_called() {
    let layer = RateLimitLayer::builder(gate())
        .policy(per_client(quota(3, Duration::from_secs(60))))
        .build()
        .unwrap();
    let mut svc = layer.layer(Reserving::default());
    // Readiness alone takes nothing from the quota.
    for _ in 0..100 {
        ServiceExt::<Request<()>>::ready(&mut svc).await.unwrap();
    }
    let mut statuses = Vec::new();
    for _ in 0..4 {
        let req = Request::get("/").header("x-client", "g").body(()).unwrap();
        let res = ServiceExt::<Request<()>>::ready(&mut svc)
            .await
            .unwrap()
            .call(req)
            .await
            .unwrap();
        statuses.push(res.status());
        let _ = res.into_body().collect().await;
    }
    assert_eq!(
        statuses,
        [
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS
        ]
    );
    // Clones share the state.
    let mut clone = svc.clone();
    let req = Request::get("/").header("x-client", "g").body(()).unwrap();
    let res = ServiceExt::<Request<()>>::ready(&mut clone)
        .await
        .unwrap()
        .call(req)
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(svc.stats().rejected, 2);
}

#[test]
fn the_layer_its_service_and_future_are_send_sync_and_clone() {
    fn send_sync_clone<T: Send + Sync + Clone + 'static>() {}
    fn send<T: Send + 'static>() {}
    type Svc = flowgate::http::RateLimit<axum::routing::Route, MemoryGate>;
    send_sync_clone::<RateLimitLayer<MemoryGate>>();
    send_sync_clone::<Svc>();
    send::<flowgate::http::RateLimitFuture<axum::routing::Route, MemoryGate, axum::body::Body>>();
    send_sync_clone::<Policy>();
}

/// A bare hyper server (no axum) with the peer address as a `SocketAddr` extension.
async fn hyper_server(layer: RateLimitLayer<MemoryGate>) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (stream, peer) = listener.accept().await.unwrap();
            let inner = tower::service_fn(|_req: Request<hyper::body::Incoming>| async {
                Ok::<_, Infallible>(Response::new(http_body_util::Full::new(Bytes::from("ok"))))
            });
            let svc = tower::ServiceBuilder::new()
                .map_request(move |mut r: Request<hyper::body::Incoming>| {
                    r.extensions_mut().insert(peer);
                    r
                })
                .service(layer.layer(inner));
            let svc = hyper_util::service::TowerToHyperService::new(svc);
            tokio::spawn(
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), svc),
            );
        }
    });
    addr
}

#[tokio::test]
async fn many_requests_over_few_keep_alive_connections_on_a_bare_hyper_server() {
    let layer = RateLimitLayer::builder(gate())
        .policy(Policy::new(
            "per-peer",
            quota(30, Duration::from_secs(60)),
            PeerIp::new(),
        ))
        .build()
        .unwrap();
    let addr = hyper_server(layer.clone()).await;
    let mut conns = Vec::new();
    for _ in 0..2 {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (send, conn) = hyper::client::conn::http1::handshake::<_, Empty<Bytes>>(
            hyper_util::rt::TokioIo::new(tcp),
        )
        .await
        .unwrap();
        tokio::spawn(conn);
        conns.push(send);
    }
    let mut ok = 0;
    let mut limited = 0;
    for round in 0..20 {
        for send in &mut conns {
            send.ready().await.unwrap();
            let req = Request::get(format!("http://{addr}/"))
                .body(Empty::new())
                .unwrap();
            let res = send.send_request(req).await.unwrap();
            match res.status() {
                StatusCode::OK => ok += 1,
                StatusCode::TOO_MANY_REQUESTS => limited += 1,
                s => panic!("round {round}: {s}"),
            }
            assert!(res.headers().contains_key("ratelimit"));
            let _ = res.into_body().collect().await.unwrap();
        }
    }
    // Both connections are the same peer (127.0.0.1): one bucket, and a 429 keeps the
    // connection open.
    assert_eq!((ok, limited), (30, 10));
    assert_eq!(layer.stats().admitted, 30);
}

#[tokio::test]
async fn route_layer_works_too() {
    let layer = RateLimitLayer::builder(gate())
        .policy(per_client(quota(1, Duration::from_secs(60))))
        .build()
        .unwrap();
    let app = Router::new()
        .route("/limited", route_get(|| async { "ok" }))
        .route_layer(layer)
        .route("/free", route_get(|| async { "ok" }));
    let server = Server::start(app).await;
    let client = client();
    let h = [("x-client", "h")];
    for _ in 0..3 {
        assert_eq!(
            get(&client, &server.url("/free"), &h).await.status,
            StatusCode::OK
        );
    }
    assert_eq!(
        get(&client, &server.url("/limited"), &h).await.status,
        StatusCode::OK
    );
    assert_eq!(
        get(&client, &server.url("/limited"), &h).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[cfg(feature = "redis")]
mod on_redis {
    use std::time::Instant;

    use flowgate::gate::{FailurePolicy, RedisGate};
    use redis::aio::ConnectionManager;

    use super::*;
    use crate::support::RedisServer;

    async fn manager(server: &RedisServer) -> ConnectionManager {
        server.fast_failing_manager().await
    }

    /// A gate with the default failure policy on `server` (the layers' policies decide).
    async fn plain_gate(server: &RedisServer) -> RedisGate<ConnectionManager> {
        RedisGate::builder(
            manager(server).await,
            Limit::TokenBucket(quota(1, Duration::from_secs(1))),
        )
        .build()
        .await
        .unwrap()
    }

    const TIMEOUT: Duration = Duration::from_millis(300);

    async fn layer(
        conn: &ConnectionManager,
        policy: FailurePolicy,
        prefix: &str,
    ) -> RateLimitLayer<RedisGate<ConnectionManager>> {
        let gate = RedisGate::builder(
            conn.clone(),
            Limit::TokenBucket(quota(1, Duration::from_secs(1))),
        )
        .prefix(prefix)
        .failure_policy(policy)
        .timeout(TIMEOUT)
        .probe_interval(Duration::from_millis(100))
        .build()
        .await
        .unwrap();
        RateLimitLayer::builder(gate)
            .policy(per_client(quota(1000, Duration::from_secs(60))))
            .build()
            .unwrap()
    }

    /// Under `FailurePolicy::Error` a gate that failed answers without asking Redis until its
    /// next probe: the 503's `Retry-After` says when that is (the probe interval, here 10 s,
    /// rounded up), as a fail-closed 503 does; it said 1 s whatever the interval, so clients
    /// came back nine times before the gate would ask Redis again.
    #[tokio::test]
    async fn a_gate_error_503_says_when_the_gate_asks_redis_again() {
        let server = RedisServer::start();
        let conn = manager(&server).await;
        let gate = RedisGate::builder(conn, Limit::TokenBucket(quota(1, Duration::from_secs(1))))
            .failure_policy(FailurePolicy::Error)
            .timeout(TIMEOUT)
            .probe_interval(Duration::from_secs(10))
            .build()
            .await
            .unwrap();
        let layer = RateLimitLayer::builder(gate)
            .policy(per_client(quota(1000, Duration::from_secs(60))))
            .build()
            .unwrap();
        let app = Router::new().route("/", route_get(|| async { "ok" }).layer(layer.clone()));
        let http = Server::start(app).await;
        let client = client();
        let (url, h) = (http.url("/"), [("x-client", "r")]);
        assert_eq!(get(&client, &url, &h).await.status, StatusCode::OK);

        server.kill();
        // The calls that find Redis gone answer its own error (a dropped connection is
        // probed once more at once); then, until the probe 10 s after that failure, no call
        // asks Redis, and each says so.
        let mut asked = 0;
        let mut waits = Vec::new();
        for _ in 0..5 {
            let a = get(&client, &url, &h).await;
            assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE);
            match retry_after(&a.headers) {
                1 if waits.is_empty() => asked += 1,
                secs => waits.push(secs),
            }
        }
        assert!((1..=2).contains(&asked), "{asked} calls asked Redis");
        assert!(
            waits.iter().all(|s| (9..=10).contains(s)),
            "Retry-After: {waits:?}"
        );
        assert_eq!(layer.stats().gate_error, 5);
    }

    /// Two layers on one `RedisGate` with a policy of one name (and one key prefix) but two
    /// quotas, as a `/login` layer of 3 a minute and an `/api` layer of 100 a minute both
    /// called "per-client": their keys are the same Redis keys, one bucket measured in two
    /// units (on a `MemoryGate` the two are apart, each quota its own buckets). Before,
    /// both were built, and after 10 `/api` requests a client had 2 logins left, not 3,
    /// and `/api` showed 22 left of 100 after one more login: the second layer is refused
    /// when built, naming the fix. The same quota shares its buckets, as documented; a key
    /// prefix keeps the two apart; a dropped layer's names are free again.
    #[tokio::test]
    async fn layers_on_one_redis_gate_with_one_policy_name_and_two_quotas_are_refused_when_built() {
        let server = RedisServer::start();
        let gate = plain_gate(&server).await;
        let over = |gate: &RedisGate<ConnectionManager>, burst: u32, prefix: &str| {
            RateLimitLayer::builder(gate.clone())
                .key_prefix(prefix)
                .policy(per_client(quota(burst, Duration::from_secs(60))))
                .build()
        };
        let login = over(&gate, 3, "").unwrap();
        let e = over(&gate, 100, "").unwrap_err();
        assert_eq!(e.field(), "rate_limit.policies");
        assert_eq!(e.kind(), flowgate::ConfigErrorKind::Inconsistent);
        assert!(
            e.reason().contains("\"per-client\"") && e.reason().contains("key_prefix"),
            "{e}"
        );
        // A clone of the gate is the same key space.
        let clone: std::sync::Arc<RedisGate<ConnectionManager>> = std::sync::Arc::new(gate.clone());
        assert!(
            RateLimitLayer::builder(clone)
                .policy(per_client(quota(100, Duration::from_secs(60))))
                .build()
                .is_err()
        );
        let shared = over(&gate, 3, "").expect("the same quota shares its buckets");
        let apart = over(&gate, 100, "api:").expect("a key prefix keeps them apart");
        drop((login, apart));
        assert!(
            over(&gate, 100, "").is_err(),
            "the other layer of 3 still holds the name"
        );
        drop(shared);
        assert!(over(&gate, 100, "").is_ok(), "free once no layer holds it");
    }

    /// A layer without a key prefix whose policy `"a"` is keyed by what the client sends,
    /// and a layer with the prefix `"a:"` whose policy `"b"` is keyed the same way, on one
    /// `RedisGate`: a client keyed `"b:victim"` on the first counts under `a:b:victim`, the
    /// Redis key of `"victim"` on the second, and spends its bucket (one Redis key, one
    /// bucket, whatever the two quotas). Before, both were built (only one head held
    /// exactly with another quota was refused); now the second is refused when built,
    /// and built once the first is gone.
    #[tokio::test]
    async fn layers_whose_key_heads_begin_one_another_are_refused_when_built() {
        let server = RedisServer::start();
        let gate = plain_gate(&server).await;
        let minute = Duration::from_secs(60);
        let outer = RateLimitLayer::builder(gate.clone())
            .policy(Policy::new("a", quota(100, minute), by_client))
            .build()
            .unwrap();
        let inner = || {
            RateLimitLayer::builder(gate.clone())
                .key_prefix("a:")
                .policy(Policy::new("b", quota(1, minute), by_client))
                .build()
        };
        let send = |layer: &RateLimitLayer<RedisGate<ConnectionManager>>, client: &str| {
            let req = Request::builder()
                .header("x-client", client)
                .body(())
                .unwrap();
            layer.layer(tower::service_fn(ok_full)).oneshot(req)
        };
        let built = inner();
        if let Ok(inner) = &built {
            // What the two layers do: another client spends the victim's one request.
            assert_eq!(
                send(&outer, "b:victim").await.unwrap().status(),
                StatusCode::OK
            );
            let status = send(inner, "victim").await.unwrap().status();
            panic!("both built: the victim's first request got {status}");
        }
        let e = built.unwrap_err();
        assert_eq!(e.field(), "rate_limit.policies");
        assert!(
            e.reason().contains("\"a:\"") && e.reason().contains("\"a:b:\""),
            "{e}"
        );
        drop(outer);
        let inner = inner().expect("free once the other layer is gone");
        assert_eq!(
            send(&inner, "victim").await.unwrap().status(),
            StatusCode::OK
        );
    }

    /// A quota Redis cannot compute exactly is refused when the layer is built (before,
    /// every request got a 503 from the gate's `InvalidQuota`).
    #[tokio::test]
    async fn a_quota_redis_cannot_compute_is_refused_when_built() {
        let server = RedisServer::start();
        let conn = manager(&server).await;
        let gate = RedisGate::builder(conn, Limit::TokenBucket(quota(1, Duration::from_secs(1))))
            .build()
            .await
            .unwrap();
        // 100 000 a day with a burst of 100 000: burst × period in µs is far above 2^52.
        let daily = Quota::new(
            Rate::per(100_000, Duration::from_secs(86_400)).unwrap(),
            100_000,
        )
        .unwrap();
        let e = RateLimitLayer::builder(gate.clone())
            .policy(per_client(quota(10, Duration::from_secs(1))))
            .policy(Policy::new("daily", daily, by_client))
            .build()
            .unwrap_err();
        assert_eq!(e.field(), "rate_limit.policies");
        assert!(e.reason().contains("\"daily\""), "{e}");
        assert!(
            RateLimitLayer::builder(gate)
                .policy(per_client(quota(10, Duration::from_secs(1))))
                .build()
                .is_ok()
        );
    }

    /// Under `FailurePolicy::Fallback`, the policies must be decidable by the fallback
    /// `MemoryGate` too: 17 distinct quotas (one more than it decides together) are refused
    /// when built. Before, the layer was built and, once Redis failed, most requests got a
    /// 503 (`KeyspaceFull` from the fallback) instead of a local decision.
    #[tokio::test]
    async fn quotas_the_fallback_gate_cannot_decide_are_refused_when_built() {
        let server = RedisServer::start();
        let conn = manager(&server).await;
        let fallback = MemoryGate::new(Limit::TokenBucket(quota(1, Duration::from_secs(1))));
        let gate = RedisGate::builder(conn, Limit::TokenBucket(quota(1, Duration::from_secs(1))))
            .failure_policy(FailurePolicy::Fallback(fallback))
            .build()
            .await
            .unwrap();
        let policies = |n: u32| {
            (0..n).map(|i| {
                Policy::new(
                    format!("p{i}"),
                    quota(10 + i, Duration::from_secs(60)),
                    by_client,
                )
            })
        };
        let build = |n: u32| {
            policies(n)
                .fold(RateLimitLayer::builder(gate.clone()), |b, p| b.policy(p))
                .build()
        };
        assert!(build(16).is_ok());
        let e = build(17).unwrap_err();
        assert_eq!(e.field(), "rate_limit.policies");
        assert!(e.reason().contains("16"), "{e}");
    }

    /// Layers over one `RedisGate` whose failure policy falls back to a `MemoryGate` share
    /// the fallback's 16 quotas, with the layers built over that `MemoryGate` itself: a
    /// layer that would take them past 16 is refused when built (before, it was built, and
    /// once Redis failed many requests got a 503). Without a fallback, Redis holds any
    /// number of quotas: both layers are built.
    #[tokio::test]
    async fn layers_sharing_a_fallback_gate_are_refused_past_its_16_quotas_together() {
        let server = RedisServer::start();
        let conn = manager(&server).await;
        let limit = Limit::TokenBucket(quota(1, Duration::from_secs(1)));
        let fallback = MemoryGate::new(limit);
        let gate = RedisGate::builder(conn.clone(), limit)
            .failure_policy(FailurePolicy::Fallback(fallback.clone()))
            .build()
            .await
            .unwrap();
        let build = |gate, range| {
            distinct_policies(range)
                .into_iter()
                .fold(RateLimitLayer::builder(gate), |b, p| b.policy(p))
                .build()
        };
        let first = build(gate.clone(), 0..9).unwrap();
        let e = build(gate.clone(), 9..18).unwrap_err();
        assert_eq!(e.field(), "rate_limit.policies");
        assert!(e.reason().contains("18 distinct quotas"), "{e}");
        let on_fallback = layer_over(&fallback, distinct_policies(9..16)).unwrap();
        assert!(build(gate.clone(), 16..17).is_err());
        drop(on_fallback);
        assert!(build(gate.clone(), 9..16).is_ok());
        drop(first);
        let plain = RedisGate::builder(conn, limit).build().await.unwrap();
        let _first = build(plain.clone(), 0..9).unwrap();
        assert!(build(plain, 9..18).is_ok());
    }

    /// A key Redis holds a value of another type under (another tool wrote it there) is the
    /// server's problem, not the client's: a 503 counted as `gate_error`, with nothing of
    /// Redis in the body. Before, it was a 400 counted as `bad_request` whose detail quoted
    /// the gate's error.
    #[tokio::test]
    async fn a_key_redis_cannot_read_is_a_gate_error_not_a_bad_request() {
        let server = RedisServer::start();
        let mut conn = manager(&server).await;
        let limit = layer(&conn, FailurePolicy::Error, "wrong:").await;
        let send = || {
            let req = Request::builder().header("x-client", "w").body(()).unwrap();
            limit.layer(tower::service_fn(ok_full)).oneshot(req)
        };
        assert_eq!(send().await.unwrap().status(), StatusCode::OK);
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg("wrong:*")
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(keys.len(), 1, "{keys:?}");
        let _: () = redis::cmd("DEL")
            .arg(&keys[0])
            .query_async(&mut conn)
            .await
            .unwrap();
        let _: () = redis::cmd("RPUSH")
            .arg(&keys[0])
            .arg("not a bucket")
            .query_async(&mut conn)
            .await
            .unwrap();

        let res = send().await.unwrap();
        assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
        let body = res.into_body().collect().await.unwrap().to_bytes();
        let body = String::from_utf8_lossy(&body).to_lowercase();
        assert!(!body.contains("redis"), "{body}");
        let stats = limit.stats();
        assert_eq!((stats.gate_error, stats.bad_request), (1, 0), "{stats:?}");
    }

    /// On Redis Cluster the keys of one all-or-nothing call must share a hash slot. A layer
    /// of two policies that apply to every request (no `MissingKey::Skip`), whose gate keys
    /// (`<gate prefix><key prefix><policy name>:<key>`) carry no hash tag, has each
    /// request's keys in two slots: the gate refuses every call (`CrossSlot`, before Redis
    /// is asked, whatever its failure policy). Before, the layer was built and answered
    /// every request `503`, counted as a gate error; it is refused when built, naming the
    /// fix, and so is a policy that may skip a request beside one that never does (the two
    /// apply together whenever the first finds a key). A hash tag in the key prefix or in
    /// the gate's prefix, one policy, or policies that may all skip a request (by design
    /// never two on one) build.
    #[tokio::test]
    async fn a_layer_whose_keys_a_cluster_cannot_decide_together_is_refused_when_built() {
        let server = RedisServer::start();
        let conn = manager(&server).await;
        let gate = |prefix: &'static str| {
            RedisGate::builder(
                conn.clone(),
                Limit::TokenBucket(quota(1, Duration::from_secs(1))),
            )
            .prefix(prefix)
            .cluster(true)
            .failure_policy(FailurePolicy::Open)
            .build()
        };
        let user = || Policy::new("per-user", quota(10, Duration::from_secs(60)), by_user);
        let client = || per_client(quota(10, Duration::from_secs(60)));
        let two = |gate: RedisGate<ConnectionManager>, key_prefix: &str| {
            RateLimitLayer::builder(gate)
                .key_prefix(key_prefix)
                .policy(client())
                .policy(user())
                .build()
        };
        let send = |layer: &RateLimitLayer<RedisGate<ConnectionManager>>| {
            let req = Request::builder()
                .header("x-client", "c")
                .header("x-user", "u")
                .body(())
                .unwrap();
            layer.layer(tower::service_fn(ok_full)).oneshot(req)
        };

        let built = two(gate("flowgate:").await.unwrap(), "");
        if let Ok(layer) = &built {
            // What such a layer does: a 503 for every request.
            let status = send(layer).await.unwrap().status();
            let stats = layer.stats();
            panic!(
                "built over a cluster with keys in two slots: {status}, \
                 gate_error {}",
                stats.gate_error
            );
        }
        let e = built.unwrap_err();
        assert_eq!(e.field(), "rate_limit.key_prefix");
        assert!(
            e.reason().contains("hash slot") && e.reason().contains("{rl}"),
            "{e}"
        );

        // A hash tag in the layer's key prefix, or in the gate's prefix: one slot.
        for (gate_prefix, key_prefix) in [("flowgate:", "{rl}"), ("{app}:", "")] {
            let layer = two(gate(gate_prefix).await.unwrap(), key_prefix).unwrap();
            assert_eq!(send(&layer).await.unwrap().status(), StatusCode::OK);
            assert_eq!(layer.stats().admitted, 1);
        }
        // Tags of two slots are two slots.
        let e = RateLimitLayer::builder(gate("").await.unwrap())
            .policy(Policy::new("{a}", client().quota(), by_client))
            .policy(Policy::new("{b}", client().quota(), by_user))
            .build()
            .unwrap_err();
        assert_eq!(e.field(), "rate_limit.key_prefix");
        // A policy that may skip a request applies with one that never does whenever it
        // finds a key: refused too.
        let skip = |p: Policy| p.missing_key(MissingKey::Skip);
        let e = RateLimitLayer::builder(gate("flowgate:").await.unwrap())
            .policy(client())
            .policy(skip(user()))
            .build()
            .unwrap_err();
        assert_eq!(e.field(), "rate_limit.key_prefix");
        // One policy, or policies that may all skip a request (by design never two on one):
        // built.
        assert!(
            RateLimitLayer::builder(gate("flowgate:").await.unwrap())
                .policy(client())
                .build()
                .is_ok()
        );
        assert!(
            RateLimitLayer::builder(gate("flowgate:").await.unwrap())
                .policy(skip(client()))
                .policy(skip(user()))
                .build()
                .is_ok()
        );
    }

    #[tokio::test]
    async fn redis_killed_mid_run_answers_under_the_failure_policy_and_recovers() {
        let server = RedisServer::start();
        let conn = manager(&server).await;
        let open = layer(&conn, FailurePolicy::Open, "open:").await;
        let error = layer(&conn, FailurePolicy::Error, "error:").await;
        let closed = layer(&conn, FailurePolicy::Closed, "closed:").await;
        let app = Router::new()
            .route("/open", route_get(|| async { "ok" }).layer(open.clone()))
            .route("/error", route_get(|| async { "ok" }).layer(error.clone()))
            .route(
                "/closed",
                route_get(|| async { "ok" }).layer(closed.clone()),
            );
        let http = Server::start(app).await;
        let client = client();
        let h = [("x-client", "r")];
        let (open_url, error_url) = (http.url("/open"), http.url("/error"));
        let closed_url = http.url("/closed");

        // On Redis: decided, with fields.
        for url in [&open_url, &error_url, &closed_url] {
            let a = get(&client, url, &h).await;
            assert_eq!(a.status, StatusCode::OK);
            assert_eq!(list(&a.headers, "ratelimit")[0].params["r"], 999);
        }

        server.kill();
        for i in 0..5 {
            let started = Instant::now();
            let a = get(&client, &open_url, &h).await;
            let took = started.elapsed();
            assert!(took < TIMEOUT + Duration::from_millis(700), "{i}: {took:?}");
            assert_eq!(a.status, StatusCode::OK, "fail open");
            assert!(
                a.headers.get("ratelimit").is_none(),
                "fail-open says no quota"
            );
            let started = Instant::now();
            let b = get(&client, &error_url, &h).await;
            assert!(started.elapsed() < TIMEOUT + Duration::from_millis(700));
            assert_eq!(b.status, StatusCode::SERVICE_UNAVAILABLE, "policy Error");
            assert_eq!(retry_after(&b.headers), 1);
            // Fail closed: refused because the server cannot decide, not because this
            // client is over its quota: a 503 that says when to retry, no quota fields,
            // and not a rejection of the client's key.
            let started = Instant::now();
            let c = get(&client, &closed_url, &h).await;
            assert!(started.elapsed() < TIMEOUT + Duration::from_millis(700));
            assert_eq!(c.status, StatusCode::SERVICE_UNAVAILABLE, "policy Closed");
            assert_eq!(retry_after(&c.headers), 1, "the next probe, rounded up");
            assert!(c.headers.get("ratelimit").is_none(), "no quota to show");
            assert!(violated(&c.body).is_empty(), "no policy violated");
        }
        assert_eq!(open.stats().fail_open, 5);
        assert_eq!(error.stats().gate_error, 5);
        let stats = closed.stats();
        assert_eq!((stats.fail_closed, stats.rejected), (5, 0), "{stats:?}");
        assert!(
            closed.top_rejected(10).is_empty(),
            "an outage is not abuse by every key"
        );

        server.restart();
        let started = Instant::now();
        loop {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "not back on Redis"
            );
            let a = get(&client, &open_url, &h).await;
            let b = get(&client, &error_url, &h).await;
            let c = get(&client, &closed_url, &h).await;
            if a.headers.contains_key("ratelimit")
                && b.status == StatusCode::OK
                && c.status == StatusCode::OK
            {
                assert_eq!(a.status, StatusCode::OK);
                assert!(b.headers.contains_key("ratelimit"));
                assert!(c.headers.contains_key("ratelimit"));
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// A key extractor that decides another request on the same thread (here: through a second
/// layer, polled to completion inside `extract`) gets its own keys: both requests are
/// decided, with their own keys and counts. (The extractor's scratch string used to be one
/// thread-local `RefCell` borrowed around `extract`: the inner decision panicked with
/// "already borrowed".)
#[tokio::test]
async fn an_extractor_deciding_another_request_on_the_same_thread_is_decided_too() {
    use futures::FutureExt;
    let inner_layer = RateLimitLayer::builder(gate())
        .inner_body()
        .policy(per_client(quota(1, Duration::from_secs(30))))
        .build()
        .unwrap();
    let nested = inner_layer.clone();
    let by_nested_decision = move |req: &RequestInfo<'_>, key: &mut String| {
        let mut svc = nested.layer(tower::service_fn(ok_full));
        let client = req.headers["x-client"].clone();
        let inner_req = Request::builder()
            .header("x-client", client)
            .body(())
            .unwrap();
        let res = svc
            .call(inner_req)
            .now_or_never()
            .expect("a memory gate decides at once")
            .unwrap();
        key.push_str(if res.status() == StatusCode::OK {
            "first"
        } else {
            "again"
        });
        true
    };
    let outer = RateLimitLayer::builder(gate())
        .inner_body()
        .policy(Policy::new(
            "outer",
            quota(1, Duration::from_secs(30)),
            by_nested_decision,
        ))
        .build()
        .unwrap();
    let mut svc = outer.layer(tower::service_fn(ok_full));
    let mut statuses = Vec::new();
    for _ in 0..3 {
        let req = Request::builder().header("x-client", "c").body(()).unwrap();
        let res = svc.ready().await.unwrap().call(req).await.unwrap();
        let ratelimit = res.headers()["ratelimit"].to_str().unwrap().to_owned();
        statuses.push((res.status(), ratelimit.starts_with("\"outer\"")));
    }
    // Outer keys: "first" (admitted), then "again" twice (one token: admitted, rejected).
    assert_eq!(
        statuses,
        [
            (StatusCode::OK, true),
            (StatusCode::OK, true),
            (StatusCode::TOO_MANY_REQUESTS, true)
        ]
    );
    let (inner, outer) = (inner_layer.stats(), outer.stats());
    assert_eq!((inner.admitted, inner.rejected), (1, 2));
    assert_eq!((outer.admitted, outer.rejected), (2, 1));
}

/// What an operator reads from `flowgate_http_decisions_total{outcome}` agrees with
/// [`RateLimitLayer::stats`] (read through a clone: clones share the counts), for every
/// outcome a `MemoryGate` can give, in the real and the shadow mode: each request counted
/// once, but a shadow request with no key for a `Refuse` policy, which counts `missing_key`
/// and then as the other policies decide it. (Coverage: the metric had no test.)
#[cfg(feature = "metrics")]
#[tokio::test(start_paused = true)]
async fn the_decisions_metric_agrees_with_stats() {
    for shadow in [false, true] {
        let recorder = crate::support::TestRecorder::default();
        let name = if shadow { "shadow" } else { "real" };
        let layer = metrics::with_local_recorder(&recorder, || {
            RateLimitLayer::builder(gate())
                .policy(
                    per_client(quota(2, Duration::from_secs(30))).missing_key(MissingKey::Refuse),
                )
                .policy(Policy::new(
                    "per-user",
                    quota(5, Duration::from_secs(30)),
                    by_user,
                ))
                .cost(|req: &RequestInfo<'_>| if req.uri.path() == "/big" { 3 } else { 1 })
                .shadow(shadow)
                .name(name)
                .build()
                .unwrap()
        });
        let stats_of = layer.clone();
        let mut svc = layer.layer(tower::service_fn(ok_full));
        let requests = [
            ("/", Some("a"), None),      // admitted
            ("/", Some("a"), None),      // admitted
            ("/", Some("a"), None),      // rejected (shadow: shadow_rejected)
            ("/", None, None),           // missing_key (shadow: and admitted)
            ("/", None, Some("u")),      // missing_key (shadow: and admitted on per-user)
            ("/big", Some("b"), None),   // bad_request: above the burst of 2
            ("/", Some("c"), Some("u")), // admitted on both
        ];
        for (path, client, user) in requests {
            let mut req = Request::builder().uri(path);
            if let Some(c) = client {
                req = req.header("x-client", c);
            }
            if let Some(u) = user {
                req = req.header("x-user", u);
            }
            let req = req.body(()).unwrap();
            svc.ready().await.unwrap().call(req).await.unwrap();
        }
        let stats = stats_of.stats();
        let metric = |o: &str| {
            recorder.counter(&format!(
                "flowgate_http_decisions_total{{name={name},outcome={o}}}"
            ))
        };
        let expected = if shadow {
            // admitted, rejected, shadow_rejected, missing_key, bad_request
            (5, 0, 1, 2, 1)
        } else {
            (3, 1, 0, 2, 1)
        };
        assert_eq!(
            (
                stats.admitted,
                stats.rejected,
                stats.shadow_rejected,
                stats.missing_key,
                stats.bad_request
            ),
            expected,
            "{name}: {stats:?}"
        );
        let pairs = [
            ("admitted", stats.admitted),
            ("rejected", stats.rejected),
            ("shadow_rejected", stats.shadow_rejected),
            ("gate_error", stats.gate_error),
            ("fail_open", stats.fail_open),
            ("fail_closed", stats.fail_closed),
            ("missing_key", stats.missing_key),
            ("bad_request", stats.bad_request),
        ];
        for (outcome, counted) in pairs {
            assert_eq!(metric(outcome), counted, "{name}: {outcome}");
        }
    }
}

/// Eight tasks on four worker threads, through clones of one layer: every request is
/// counted under exactly the outcome it had (free, above the burst, without a key,
/// admitted, rejected), and the top rejected keys add up to the rejections with no error
/// (fewer keys than the sketch keeps). (Coverage: the counts were tested on one thread.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_request_counts_once_on_a_multi_thread_runtime() {
    let layer = RateLimitLayer::builder(gate())
        .policy(per_client(quota(5, Duration::from_secs(3600))).missing_key(MissingKey::Refuse))
        .cost(|req: &RequestInfo<'_>| match req.uri.path() {
            "/free" => 0,
            "/huge" => 1000,
            _ => 1,
        })
        .top_rejected(64)
        .build()
        .unwrap();
    let tasks: Vec<_> = (0..8)
        .map(|t| {
            let mut svc = layer.layer(tower::service_fn(ok_full));
            tokio::spawn(async move {
                for i in 0..300usize {
                    let path = match i % 10 {
                        0 => "/free",
                        1 => "/huge",
                        _ => "/",
                    };
                    let mut req = Request::builder().uri(path);
                    if i % 7 != 0 {
                        req = req.header("x-client", format!("k{}", (i + t) % 16));
                    }
                    let req = req.body(()).unwrap();
                    let _ = svc.ready().await.unwrap().call(req).await.unwrap();
                    if i % 3 == 0 {
                        tokio::task::yield_now().await;
                    }
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let s = layer.stats();
    let sum = outcomes(&s);
    assert_eq!(sum, 8 * 300, "{s:?}");
    let top = layer.top_rejected(usize::MAX);
    assert_eq!(top.iter().map(|r| r.count).sum::<u64>(), s.rejected);
    assert_eq!(top.len(), 16);
    assert!(top.iter().all(|r| r.error == 0));
    let (mut free, mut huge, mut keyless, mut decided) = (0, 0, 0, 0);
    for _t in 0..8 {
        for i in 0..300usize {
            match (i % 7 == 0, i % 10) {
                (true, _) => keyless += 1,
                (false, 0) => free += 1,
                (false, 1) => huge += 1,
                _ => decided += 1,
            }
        }
    }
    assert_eq!(
        (s.admitted, s.rejected, s.missing_key, s.bad_request),
        (free + 80, decided - 80, keyless, huge)
    );
}

/// A quota of one per 584 years (a `u64` of nanoseconds) beside a small one, and centuries
/// of paused time between rounds: every field parses as Structured Fields, each `t` of a
/// `429` is within its `Retry-After`, the draft-03 reset is at most `Retry-After`, and the
/// epoch reset is not before it. (Coverage.)
#[tokio::test(start_paused = true)]
async fn fields_of_a_584_year_quota_and_of_centuries_of_paused_time_agree() {
    let huge = Quota::new(Rate::per(1, Duration::from_nanos(u64::MAX)).unwrap(), 1).unwrap();
    let layer = RateLimitLayer::builder(gate())
        .policy(per_client(huge))
        .policy(Policy::new(
            "per-user",
            quota(3, Duration::from_secs(1)),
            by_user,
        ))
        .header_styles(
            HeaderStyles::IETF | HeaderStyles::DRAFT_03 | HeaderStyles::X_RATELIMIT_EPOCH,
        )
        .build()
        .unwrap();
    let mut svc = layer.layer(tower::service_fn(ok_full));
    for step in 0..4 {
        for _ in 0..3 {
            let req = Request::builder()
                .header("x-client", format!("c{step}"))
                .header("x-user", "u")
                .body(())
                .unwrap();
            let res = svc.ready().await.unwrap().call(req).await.unwrap();
            let h = res.headers();
            let rl = list(h, "ratelimit");
            let pol = list(h, "ratelimit-policy");
            assert_eq!(pol.len(), 2, "{h:?}");
            if res.status() == StatusCode::TOO_MANY_REQUESTS {
                let ra = retry_after(h) as i64;
                for m in &rl {
                    if let Some(t) = m.params.get("t") {
                        assert!(*t <= ra, "{h:?}");
                    }
                }
                assert!(
                    integer(h, "ratelimit-reset") <= ra && integer(h, "ratelimit-reset") >= 1,
                    "{h:?}"
                );
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_secs() as i64;
                assert!(integer(h, "x-ratelimit-reset") >= now + ra, "{h:?}");
            }
        }
        tokio::time::advance(Duration::from_secs(200 * 365 * 86_400)).await;
    }
    let stats = layer.stats();
    assert_eq!((stats.admitted, stats.rejected), (4, 8));
}

/// A metrics recorder that panics (user code) as the layer counts a request's outcome: the
/// panic reaches whoever polls the response future, which is then dropped (as a runtime
/// drops a task that panicked). Before, the request was counted twice: as its outcome
/// (counted before the recorder was called) and as `cancelled` when its future was
/// dropped still holding it. Now it is counted once: as `cancelled` (it was not passed
/// on), which the recorder also shows; a recorder that panics counting `cancelled` loses
/// nothing either.
#[cfg(feature = "metrics")]
#[tokio::test]
async fn a_recorder_that_panics_counting_a_decision_counts_the_request_once() {
    use futures::FutureExt;
    let recorder = crate::support::TestRecorder::default();
    let layer = metrics::with_local_recorder(&recorder, || {
        RateLimitLayer::builder(gate())
            .policy(per_client(quota(1, Duration::from_secs(30))))
            .name("p")
            .build()
            .unwrap()
    });
    let id = |o: &str| format!("flowgate_http_decisions_total{{name=p,outcome={o}}}");
    let send = || {
        let req = Request::builder().header("x-client", "a").body(()).unwrap();
        let fut = layer.layer(tower::service_fn(ok_full)).oneshot(req);
        std::panic::AssertUnwindSafe(fut).catch_unwind()
    };
    // The requests sent when each is counted: the third is the second's 429.
    for (outcome, sent) in [("admitted", 1), ("rejected", 3)] {
        recorder.panic_on(&id(outcome), true);
        assert!(
            send().await.is_err(),
            "the recorder's panic reached the caller"
        );
        recorder.panic_on(&id(outcome), false);
        let s = layer.stats();
        let counted = s.admitted + s.rejected + s.cancelled;
        assert_eq!(counted, sent, "{outcome}: {s:?}");
        assert_eq!(recorder.counter(&id("cancelled")), s.cancelled, "{s:?}");
        if outcome == "admitted" {
            // Its cost was charged: the next request is rejected.
            assert!(send().await.is_ok());
        }
    }
    // Counting `cancelled` itself panics (a future dropped unpolled): the count is kept.
    recorder.panic_on(&id("cancelled"), true);
    let req = Request::builder().header("x-client", "a").body(()).unwrap();
    let fut = layer.layer(tower::service_fn(ok_full)).call(req);
    assert!(std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(fut))).is_err());
    assert_eq!(layer.stats().cancelled, 3);
}

/// User code the layer runs for a request panics: a key extractor, the cost closure, an
/// extractor's `missing_reason`. The panic reaches whoever polls the response future; the
/// request is counted once (`cancelled`: it was not passed on), nothing is charged, and
/// the next request on the same thread is decided as usual (the thread's reused keys are
/// not left borrowed or holding the panicked request's keys).
#[tokio::test]
async fn a_panicking_extractor_cost_or_reason_counts_the_request_once_and_charges_nothing() {
    use futures::FutureExt;
    struct Refusing;
    impl KeyExtractor for Refusing {
        fn extract(&self, _: &RequestInfo<'_>, _: &mut String) -> bool {
            false
        }
        fn missing_reason(&self, req: &RequestInfo<'_>) -> Option<String> {
            assert!(req.headers.get("x-reason").is_none(), "reason panics");
            None
        }
    }
    let boom = |req: &RequestInfo<'_>, name: &str| req.headers.get(name).is_some();
    let layer = RateLimitLayer::builder(gate())
        .policy(per_client(quota(2, Duration::from_secs(60))))
        .policy(
            Policy::new(
                "panicky",
                quota(2, Duration::from_secs(60)),
                move |req: &RequestInfo<'_>, key: &mut String| {
                    assert!(!boom(req, "x-key-panic"), "extractor panics");
                    key.push('k');
                    true
                },
            )
            .missing_key(MissingKey::Skip),
        )
        .cost(move |req: &RequestInfo<'_>| {
            assert!(!boom(req, "x-cost-panic"), "cost panics");
            1
        })
        .build()
        .unwrap();
    let send = |extra: &'static str| {
        let mut req = Request::builder().header("x-client", "a");
        if !extra.is_empty() {
            req = req.header(extra, "1");
        }
        let fut = layer
            .layer(tower::service_fn(ok_full))
            .oneshot(req.body(()).unwrap());
        std::panic::AssertUnwindSafe(fut).catch_unwind()
    };
    for (i, panicking) in ["x-key-panic", "x-cost-panic"].into_iter().enumerate() {
        assert!(send(panicking).await.is_err(), "{panicking}");
        let s = layer.stats();
        assert_eq!(
            (s.cancelled, outcomes(&s)),
            (i as u64 + 1, i as u64 + 1),
            "{s:?}"
        );
    }
    // Nothing was charged: the burst of 2 is all there, then a 429.
    for status in [
        StatusCode::OK,
        StatusCode::OK,
        StatusCode::TOO_MANY_REQUESTS,
    ] {
        assert_eq!(send("").await.unwrap().unwrap().status(), status);
    }
    assert_eq!(layer.stats().admitted, 2);

    // A panicking reason, under Refuse: counted once, as cancelled, not also missing_key.
    let refuse = RateLimitLayer::builder(gate())
        .policy(
            Policy::new("refusing", quota(2, Duration::from_secs(60)), Refusing)
                .missing_key(MissingKey::Refuse),
        )
        .build()
        .unwrap();
    let req = Request::builder().header("x-reason", "1").body(()).unwrap();
    let fut = refuse.layer(tower::service_fn(ok_full)).oneshot(req);
    assert!(
        std::panic::AssertUnwindSafe(fut)
            .catch_unwind()
            .await
            .is_err()
    );
    let s = refuse.stats();
    assert_eq!((s.cancelled, outcomes(&s)), (1, 1), "{s:?}");
    let req = Request::builder().body(()).unwrap();
    let res = refuse
        .layer(tower::service_fn(ok_full))
        .oneshot(req)
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    assert_eq!(refuse.stats().missing_key, 1);
}

/// The inner service's `Clone` (user code) runs in `call`, for the clone that stays when
/// the ready service goes with the request (clone-after-ready): if it panics, the panic
/// goes to the caller before the request has a response future to count it. It was
/// counted nowhere, so the outcomes fell short of the requests the layer was called with
/// (as the `ShedLayer`'s did); it is counted `cancelled` (not passed on, nothing charged),
/// and the next request is decided as usual.
#[tokio::test]
async fn an_inner_service_whose_clone_panics_counts_its_request_cancelled() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let layer = RateLimitLayer::builder(gate())
        .policy(per_client(quota(1, Duration::from_secs(60))))
        .build()
        .unwrap();
    let armed = Arc::new(AtomicBool::new(true));
    let mut svc = layer.layer(crate::shed::Armed {
        armed: armed.clone(),
        on_clone: true,
    });
    let req = || {
        Request::builder()
            .header("x-client", "a")
            .body(Empty::<Bytes>::new())
            .unwrap()
    };
    let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| svc.call(req())));
    assert!(unwound.is_err(), "the clone's panic goes to the caller");
    assert!(!armed.load(Ordering::SeqCst));
    let s = layer.stats();
    assert_eq!((s.cancelled, outcomes(&s)), (1, 1), "{s:?}");
    // Nothing was charged: the burst of 1 is all there, then a 429.
    assert_eq!(svc.call(req()).await.unwrap().status(), StatusCode::OK);
    assert_eq!(
        svc.call(req()).await.unwrap().status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    let s = layer.stats();
    assert_eq!((s.admitted, s.rejected, outcomes(&s)), (1, 1, 3), "{s:?}");
}

/// A gate of one's own whose `check_all` answers what the test sets: an error, or one
/// decision per limit (through its future: the layer's remote path).
#[derive(Debug, Clone)]
struct Scripted(std::sync::Arc<std::sync::Mutex<Result<flowgate::Decision, GateError>>>);

impl Gate for Scripted {
    fn check<'a>(&'a self, _: &'a str, _: u32) -> GateFuture<'a> {
        let answer = self.0.lock().unwrap().clone();
        Box::pin(async move { answer })
    }

    fn check_all<'a>(
        &'a self,
        limits: &'a [(&'a str, Quota)],
        _: u32,
    ) -> GateFuture<'a, Vec<flowgate::Decision>> {
        let answer = self.0.lock().unwrap().clone();
        Box::pin(async move { answer.map(|d| vec![d; limits.len()]) })
    }

    fn validate_quotas(&self, _: &[Quota]) -> Result<(), flowgate::ConfigError> {
        Ok(())
    }

    fn limit(&self) -> Limit {
        Limit::TokenBucket(quota(1, Duration::from_secs(1)))
    }
}

/// The failure paths, each in the real mode and in shadow mode, as the layer's docs list
/// them: a gate error is a `503` with `Retry-After` (a degraded gate's wait until it asks
/// its backend again, rounded up), a fail-closed decision a `503` with its `retry_after`
/// rounded up, neither with fields nor a rejected key; a fail-open decision passes without
/// fields. In shadow mode every one of them passes, without `Retry-After`, counted the
/// same.
#[tokio::test]
async fn failure_paths_answer_and_count_as_documented_in_both_modes() {
    let script = Scripted(std::sync::Arc::new(std::sync::Mutex::new(Ok(
        flowgate::Decision::fail_open(),
    ))));
    let layer = |shadow: bool| {
        RateLimitLayer::builder(script.clone())
            .policy(per_client(quota(5, Duration::from_secs(60))))
            .shadow(shadow)
            .build()
            .unwrap()
    };
    let (real, shadow) = (layer(false), layer(true));
    let app = Router::new()
        .route("/real", route_get(|| async { "ok" }).layer(real.clone()))
        .route(
            "/shadow",
            route_get(|| async { "ok" }).layer(shadow.clone()),
        );
    let server = Server::start(app).await;
    let client = client();
    let h = [("x-client", "a")];
    let cases: [(Result<flowgate::Decision, GateError>, u64); 3] = [
        (
            Err(GateError::Degraded {
                next_probe_in: Duration::from_millis(2_500),
            }),
            3,
        ),
        (Err(GateError::Timeout(Duration::from_millis(50))), 1),
        (
            Ok(flowgate::Decision::fail_closed(Duration::from_millis(
                1_200,
            ))),
            2,
        ),
    ];
    for (answer, secs) in cases {
        *script.0.lock().unwrap() = answer.clone();
        let a = get(&client, &server.url("/real"), &h).await;
        assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE, "{answer:?}");
        assert_eq!(retry_after(&a.headers), secs, "{answer:?}");
        assert!(a.headers.get("ratelimit").is_none(), "{answer:?}");
        assert!(violated(&a.body).is_empty(), "{answer:?}");
        let b = get(&client, &server.url("/shadow"), &h).await;
        assert_eq!(b.status, StatusCode::OK, "{answer:?}");
        assert!(b.headers.get("retry-after").is_none(), "{answer:?}");
    }
    *script.0.lock().unwrap() = Ok(flowgate::Decision::fail_open());
    for url in ["/real", "/shadow"] {
        let a = get(&client, &server.url(url), &h).await;
        assert_eq!(a.status, StatusCode::OK);
        assert!(
            a.headers.get("ratelimit").is_none(),
            "fail-open says no quota"
        );
    }
    for layer in [&real, &shadow] {
        let s = layer.stats();
        assert_eq!(
            (s.gate_error, s.fail_closed, s.fail_open, outcomes(&s)),
            (2, 1, 1, 4),
            "{s:?}"
        );
        assert!(layer.top_rejected(5).is_empty());
    }
}
