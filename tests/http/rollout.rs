//! Rolling a new limit out on an axum API: `RateLimitLayer` in shadow mode first, then
//! enforcing, over loopback with a real client. Two policies per request (the client's IP
//! behind a trusted proxy, an API-key header), a cost closure; the shadow's counts against
//! a replay on an enforcing layer, the top rejected keys with many keys and one abuser, the
//! switch from shadow to enforcing on one gate, and the extremes of cost and key.

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use axum::routing::get as route_get;
use flowgate::gate::{Limit, MemoryGate};
use flowgate::http::{
    ClientIp, ForwardedHeader, Header, MissingKey, PeerIp, Policy, RateLimitLayer, RateLimitStats,
    RequestInfo,
};
use flowgate::{Quota, Rate};
use http::StatusCode;

use crate::harness::{Answer, Server, client, field, get, outcomes};

fn gate() -> MemoryGate {
    MemoryGate::new(Limit::TokenBucket(Quota::per_second(1).unwrap()))
}

/// `burst` at once, refilling `burst` an hour (nothing refills during a test).
fn hourly(burst: u32) -> Quota {
    Quota::new(Rate::per(burst, Duration::from_secs(3600)).unwrap(), burst).unwrap()
}

/// The request's `x-cost` header as its cost (default 1).
fn cost(req: &RequestInfo<'_>) -> u32 {
    req.headers
        .get("x-cost")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(1)
}

/// The rolled-out layer: `per-ip` (burst 3, the client behind the proxy at 127.0.0.1) and
/// `per-key` (burst 5, `x-api-key`, refused without one), each request costing `x-cost`.
fn layer(gate: MemoryGate, shadow: bool, top: usize) -> RateLimitLayer<MemoryGate> {
    let ip = ClientIp::builder(ForwardedHeader::XForwardedFor)
        .trust("127.0.0.0/8")
        .peer(PeerIp::from_extension(|c: &ConnectInfo<SocketAddr>| c.0))
        .build()
        .unwrap();
    RateLimitLayer::builder(gate)
        .policy(Policy::new("per-ip", hourly(3), ip))
        .policy(
            Policy::new("per-key", hourly(5), Header::new("x-api-key").unwrap())
                .missing_key(MissingKey::Refuse),
        )
        .cost(cost)
        .shadow(shadow)
        .top_rejected(top)
        .name(if shadow { "shadow" } else { "enforce" })
        .build()
        .unwrap()
}

fn app(layer: RateLimitLayer<MemoryGate>) -> Router {
    Router::new()
        .route("/", route_get(|| async { "ok" }))
        .layer(layer)
}

/// One request of the journey: client address, API key, cost.
type Req = (String, String, u32);

/// A fixed pseudo-random sequence over 6 client addresses, 4 API keys and costs 0 to 6
/// (6: above both bursts).
fn sequence(n: usize) -> Vec<Req> {
    let mut x: u64 = 0x2545_F491_4F6C_DD1D;
    let mut next = |m: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % m
    };
    (0..n)
        .map(|_| {
            let ip = format!("203.0.113.{}", next(6));
            let key = format!("k-{}", next(4));
            let cost = match next(10) {
                0 => 0,
                1 => 6,
                2 | 3 => 2,
                _ => 1,
            };
            (ip, key, cost)
        })
        .collect()
}

async fn send(
    client: &hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        http_body_util::Empty<bytes::Bytes>,
    >,
    url: &str,
    (ip, key, cost): &Req,
) -> Answer {
    let cost = cost.to_string();
    get(
        client,
        url,
        &[
            ("x-forwarded-for", ip),
            ("x-api-key", key),
            ("x-cost", &cost),
        ],
    )
    .await
}

/// The `RateLimit` field with each `t` value left out (the time to full may round either
/// way between two runs), keeping whether a member has one.
fn fields_without_t(a: &Answer) -> Option<String> {
    field(&a.headers, "ratelimit").map(|f| {
        f.split(", ")
            .map(|m| {
                m.split(';')
                    .map(|p| if p.starts_with("t=") { "t" } else { p })
                    .collect::<Vec<_>>()
                    .join(";")
            })
            .collect::<Vec<_>>()
            .join(", ")
    })
}

fn top_all(layer: &RateLimitLayer<MemoryGate>) -> Vec<(String, u64, u64)> {
    layer
        .top_rejected(usize::MAX)
        .into_iter()
        .map(|r| (r.key, r.count, r.error))
        .collect()
}

/// (1) Shadow mode admits every request, writes the fields the enforcing layer would, and
/// counts exactly the rejections (per policy, in the top rejected keys) and the `400`s an
/// enforcing layer on a fresh gate gives the same sequence; its log and metrics say so.
#[tokio::test]
async fn shadow_counts_exactly_what_enforcing_refuses() {
    let (logs, _guard) = crate::support::Logs::capture();
    #[cfg(feature = "metrics")]
    let recorder = crate::support::TestRecorder::default();
    #[cfg(feature = "metrics")]
    let build = |shadow| metrics::with_local_recorder(&recorder, || layer(gate(), shadow, 64));
    #[cfg(not(feature = "metrics"))]
    let build = |shadow| layer(gate(), shadow, 64);
    let shadow = build(true);
    let enforce = build(false);
    let seq = sequence(300);
    let client = client();
    let mut answers = Vec::new();
    for l in [&shadow, &enforce] {
        let server = Server::start(app(l.clone())).await;
        let url = server.url("/");
        let mut got = Vec::new();
        for r in &seq {
            got.push(send(&client, &url, r).await);
        }
        answers.push(got);
    }
    let (s, e) = (&answers[0], &answers[1]);
    assert!(
        s.iter().all(|a| a.status == StatusCode::OK),
        "shadow refuses nothing"
    );
    let count = |c: StatusCode| e.iter().filter(|a| a.status == c).count() as u64;
    let (ss, es) = (shadow.stats(), enforce.stats());
    assert!(es.rejected > 20 && es.bad_request > 10, "{es:?}");
    assert_eq!(ss.shadow_rejected, count(StatusCode::TOO_MANY_REQUESTS));
    assert_eq!(es.rejected, count(StatusCode::TOO_MANY_REQUESTS));
    assert_eq!(ss.bad_request, count(StatusCode::BAD_REQUEST));
    assert_eq!(ss.admitted, count(StatusCode::OK));
    assert_eq!((ss.rejected, es.shadow_rejected), (0, 0));
    assert_eq!(outcomes(&ss), seq.len() as u64);
    assert_eq!(outcomes(&es), seq.len() as u64);
    // Per policy and key: the keys that blocked, counted alike (64 keys kept: exact).
    assert_eq!(top_all(&shadow), top_all(&enforce));
    assert_eq!(
        shadow
            .top_rejected(usize::MAX)
            .iter()
            .map(|r| r.count)
            .sum::<u64>() as usize,
        top_all(&enforce)
            .iter()
            .map(|r| r.1 as usize)
            .sum::<usize>()
    );
    // The fields: what the enforcing layer sent, on its 200s and its 429s alike.
    for (i, (a, b)) in s.iter().zip(e).enumerate() {
        assert_eq!(
            fields_without_t(a),
            fields_without_t(b),
            "request {i}: {:?}",
            seq[i]
        );
        if b.status == StatusCode::BAD_REQUEST || seq[i].2 == 0 {
            assert_eq!(field(&a.headers, "ratelimit"), None, "request {i}");
        }
    }
    // The log: one warning each, the first one rejected, marked as shadow or not.
    for (name, shadowed) in [("shadow", "true"), ("enforce", "false")] {
        let warned: Vec<_> = logs
            .containing("requests rejected")
            .into_iter()
            .filter(|l| l.field("layer") == Some(name))
            .collect();
        assert_eq!(warned.len(), 1, "{name}: {warned:?}");
        assert_eq!(warned[0].field("rejected"), Some("1"));
        assert_eq!(warned[0].field("shadow"), Some(shadowed));
    }
    #[cfg(feature = "metrics")]
    for (name, st) in [("shadow", &ss), ("enforce", &es)] {
        let metric = |o: &str| {
            recorder.counter(&format!(
                "flowgate_http_decisions_total{{name={name},outcome={o}}}"
            ))
        };
        assert_eq!(
            [
                metric("admitted"),
                metric("rejected"),
                metric("shadow_rejected"),
                metric("bad_request")
            ],
            [st.admitted, st.rejected, st.shadow_rejected, st.bad_request],
            "{name}"
        );
    }
}

/// (2) Many keys (more than the sketch keeps) and one abusive key: the abuser is reported
/// first with a count within the documented bounds, the sketch keeps at most its capacity,
/// and the first log carries the count since the last log and the top keys.
#[tokio::test]
async fn the_abusive_key_is_reported_among_many() {
    let (logs, _guard) = crate::support::Logs::capture();
    let shadow = layer(gate(), true, 8);
    let server = Server::start(app(shadow.clone())).await;
    let url = server.url("/");
    let client = client();
    // 60 API keys, each over its burst of 5 by two; the abuser over by 100, interleaved.
    // Each request from its own address (no per-ip rejection).
    let mut n = 0u32;
    let mut next_ip = || {
        n += 1;
        format!("198.51.{}.{}", n / 250, n % 250)
    };
    for round in 0..7 {
        for k in 0..60 {
            let r = (next_ip(), format!("k-{k}"), 1);
            assert_eq!(send(&client, &url, &r).await.status, StatusCode::OK);
        }
        for _ in 0..if round < 5 { 1 } else { 50 } {
            let r = (next_ip(), "abuser".to_owned(), 1);
            send(&client, &url, &r).await;
        }
    }
    // The abuser: 5 + 2 × 50 requests, 5 admitted.
    let truth = 100u64;
    let st = shadow.stats();
    assert_eq!(st.shadow_rejected, 60 * 2 + truth);
    let top = shadow.top_rejected(usize::MAX);
    assert!(top.len() <= 8, "{top:?}");
    assert_eq!(top[0].key, "per-key:abuser");
    assert!(
        top[0].lower_bound() <= truth && truth <= top[0].count,
        "{top:?}"
    );
    assert!(top.iter().all(|r| !r.key.starts_with("per-ip:")));
    let warned = logs.containing("requests rejected");
    assert_eq!(warned.len(), 1, "{warned:?}");
    assert_eq!(warned[0].field("rejected"), Some("1"));
    assert!(
        warned[0].field("top").unwrap().contains("per-key:k-0"),
        "{warned:?}"
    );
}

/// (3) Switching to enforcing: a new layer built on a clone of the shadow layer's gate with
/// the same policies decides on the same buckets: no burst granted twice, no key starting
/// over; the new layer's counts and top keys start from zero.
#[tokio::test]
async fn switching_to_enforcing_on_the_shared_gate_keeps_the_buckets() {
    let shared = gate();
    let shadow = layer(shared.clone(), true, 64);
    let server = Server::start(app(shadow.clone())).await;
    let url = server.url("/");
    let client = client();
    let req = |ip: &str, key: &str, cost: u32| (ip.to_owned(), key.to_owned(), cost);
    // a: its per-key burst of 5 spent (over two addresses); b: 2 of 5; ip 1 spent 3 of 3.
    for r in [
        req("10.0.0.1", "a", 3),
        req("10.0.0.2", "a", 2),
        req("10.0.0.3", "b", 2),
    ] {
        let a = send(&client, &url, &r).await;
        assert_eq!(a.status, StatusCode::OK);
    }
    let over = send(&client, &url, &req("10.0.0.4", "a", 1)).await;
    assert_eq!(over.status, StatusCode::OK);
    assert_eq!(shadow.stats().shadow_rejected, 1);
    drop(server);
    // The switch, with the shadow layer still alive (a rolling restart).
    let enforce = layer(shared.clone(), false, 64);
    let server = Server::start(app(enforce.clone())).await;
    let url = server.url("/");
    let a = send(&client, &url, &req("10.0.0.5", "a", 1)).await;
    assert_eq!(
        a.status,
        StatusCode::TOO_MANY_REQUESTS,
        "a's burst is not granted twice"
    );
    let ip1 = send(&client, &url, &req("10.0.0.1", "c", 1)).await;
    assert_eq!(ip1.status, StatusCode::TOO_MANY_REQUESTS, "nor ip 1's");
    let b = send(&client, &url, &req("10.0.0.6", "b", 3)).await;
    assert_eq!(b.status, StatusCode::OK, "b had 3 left");
    assert!(
        field(&b.headers, "ratelimit")
            .unwrap()
            .contains("\"per-key\";r=0"),
        "{:?}",
        b.headers
    );
    let b = send(&client, &url, &req("10.0.0.7", "b", 1)).await;
    assert_eq!(b.status, StatusCode::TOO_MANY_REQUESTS);
    let st = enforce.stats();
    assert_eq!(
        (st.admitted, st.rejected, st.shadow_rejected),
        (1, 3, 0),
        "{st:?}"
    );
    assert_eq!(
        shadow.stats().shadow_rejected,
        1,
        "the old layer counts no more"
    );
    let top: Vec<String> = enforce
        .top_rejected(10)
        .into_iter()
        .map(|r| r.key)
        .collect();
    assert_eq!(top, ["per-ip:10.0.0.1", "per-key:a", "per-key:b"]);
}

/// (4) Extremes: a cost of 0, a cost equal to the smaller burst, `u32::MAX`, a key header
/// of 8 KiB, non-ASCII and empty keys; enforcing and in shadow.
#[tokio::test]
async fn extremes_of_cost_and_key() {
    for shadowed in [false, true] {
        let (logs, _guard) = crate::support::Logs::capture();
        let l = layer(gate(), shadowed, 64);
        let server = Server::start(app(l.clone())).await;
        let url = server.url("/");
        let client = client();
        let ok_or = |s: StatusCode| if shadowed { StatusCode::OK } else { s };
        let r = |ip: &str, key: &str, cost: u32| (ip.to_owned(), key.to_owned(), cost);
        // Free: no fields, nothing charged.
        let free = send(&client, &url, &r("10.1.0.1", "x", 0)).await;
        assert_eq!(free.status, StatusCode::OK);
        assert_eq!(field(&free.headers, "ratelimit"), None);
        // A cost of the per-ip burst: admitted once, then nothing is left.
        let all = send(&client, &url, &r("10.1.0.1", "x", 3)).await;
        assert_eq!(all.status, StatusCode::OK);
        let f = field(&all.headers, "ratelimit").unwrap();
        assert!(
            f.contains("\"per-ip\";r=0") && f.contains("\"per-key\";r=2"),
            "{f}"
        );
        let again = send(&client, &url, &r("10.1.0.1", "x", 1)).await;
        assert_eq!(again.status, ok_or(StatusCode::TOO_MANY_REQUESTS));
        // u32::MAX: above both bursts, a 400 naming both.
        let max = send(&client, &url, &r("10.1.0.2", "y", u32::MAX)).await;
        assert_eq!(max.status, ok_or(StatusCode::BAD_REQUEST));
        if !shadowed {
            let body = String::from_utf8_lossy(&max.body);
            assert!(
                body.contains("cost 4294967295 exceeds the burst of")
                    && body.contains("\\\"per-ip\\\" (burst 3)")
                    && body.contains("\\\"per-key\\\" (burst 5)"),
                "{body}"
            );
        }
        // Keys the header cannot give: 8 KiB, non-ASCII (sent as UTF-8), empty.
        let long = "k".repeat(8 * 1024);
        for (key, why) in [
            (long.as_str(), "longer than 256 bytes"),
            ("clé-été", "other than visible ASCII"),
            ("", "is empty"),
        ] {
            let mut req = http::Request::get(&url)
                .header("x-forwarded-for", "10.1.0.3")
                .body(http_body_util::Empty::<bytes::Bytes>::new())
                .unwrap();
            req.headers_mut().insert(
                "x-api-key",
                http::HeaderValue::from_bytes(key.as_bytes()).unwrap(),
            );
            let res = client.request(req).await.unwrap();
            let status = res.status();
            let body = http_body_util::BodyExt::collect(res.into_body())
                .await
                .unwrap()
                .to_bytes();
            assert_eq!(status, ok_or(StatusCode::BAD_REQUEST), "{why}");
            if !shadowed {
                let body = String::from_utf8_lossy(&body);
                assert!(
                    body.contains(why) && body.contains("per-key"),
                    "{why}: {body}"
                );
            }
        }
        // The 8 KiB value is said once, without the value.
        let long_said: Vec<_> = logs
            .events()
            .into_iter()
            .filter(|e| e.level == tracing::Level::WARN)
            .filter(|e| {
                e.fields.iter().any(|(_, v)| v.contains("8192")) || e.message.contains("8192")
            })
            .collect();
        assert_eq!(long_said.len(), 1, "{long_said:?}");
        assert!(!format!("{long_said:?}").contains(&long[..300]));
        let st: RateLimitStats = l.stats();
        assert_eq!(st.missing_key, 3, "{st:?}");
        assert_eq!(st.bad_request, 1, "{st:?}");
        if shadowed {
            // Each keyless request decided on per-ip as well (counted twice, as documented).
            assert_eq!((st.admitted, st.shadow_rejected), (2 + 3, 1), "{st:?}");
        } else {
            assert_eq!((st.admitted, st.rejected), (2, 1), "{st:?}");
        }
        assert_eq!(l.top_rejected(1)[0].key, "per-ip:10.1.0.1");
    }
}

/// As documented: in shadow mode a request without an API key (a `400` when enforcing) is
/// charged on `per-ip`, so that address's later requests are would-be rejections that the
/// enforcing layer admits.
#[tokio::test]
async fn a_keyless_request_charged_in_shadow_is_a_documented_divergence() {
    let client = client();
    let mut stats = Vec::new();
    for shadowed in [true, false] {
        let l = layer(gate(), shadowed, 64);
        let server = Server::start(app(l.clone())).await;
        let url = server.url("/");
        get(&client, &url, &[("x-forwarded-for", "10.2.0.1")]).await;
        for _ in 0..3 {
            let r = ("10.2.0.1".to_owned(), "z".to_owned(), 1);
            send(&client, &url, &r).await;
        }
        stats.push(l.stats());
    }
    let (s, e) = (&stats[0], &stats[1]);
    assert_eq!(
        (s.missing_key, s.admitted, s.shadow_rejected),
        (1, 3, 1),
        "{s:?}"
    );
    assert_eq!((e.missing_key, e.admitted, e.rejected), (1, 3, 0), "{e:?}");
}
