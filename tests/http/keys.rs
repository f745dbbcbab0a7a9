//! A team behind a load balancer and a CDN keys a `RateLimitLayer` on the client IP behind
//! trusted proxies, per API key and per user, over real HTTP/1 and HTTP/2 on loopback (IPv4
//! and IPv6): the key each request is charged under, read back through `top_rejected` and
//! the gate, whatever the spelling of the address, the header lines or the spoofed entries.

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use axum::routing::get as route_get;
use bytes::Bytes;
use flowgate::gate::{Limit, MemoryGate};
use flowgate::http::{
    ClientIp, ForwardedHeader, Header, KeyExtractor, MissingKey, PeerIp, Policy, RateLimitLayer,
};
use flowgate::{Quota, Rate};
use http::{HeaderValue, Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};

use crate::harness::{Server, client, field};

/// One request a minute per key.
fn one_per_minute() -> Quota {
    Quota::new(Rate::per(1, Duration::from_secs(60)).unwrap(), 1).unwrap()
}

fn gate() -> MemoryGate {
    MemoryGate::new(Limit::TokenBucket(Quota::per_second(1).unwrap()))
}

fn connect_info() -> PeerIp {
    PeerIp::from_extension(|c: &ConnectInfo<SocketAddr>| c.0)
}

/// The client IP from `source`, trusting `cidrs`, the peer from axum's connect info.
fn behind(source: ForwardedHeader, cidrs: &[&str]) -> ClientIp {
    let mut b = ClientIp::builder(source).peer(connect_info());
    for cidr in cidrs {
        b = b.trust(cidr);
    }
    b.build().unwrap()
}

/// A layer of one policy `name`, one request a minute per key.
fn layer_of(name: &str, key: impl KeyExtractor) -> RateLimitLayer<MemoryGate> {
    RateLimitLayer::builder(gate())
        .policy(Policy::new(name.to_owned(), one_per_minute(), key))
        .build()
        .unwrap()
}

/// `layer` around a route answering `ok`, served on `bind`.
async fn serve(bind: &str, layer: RateLimitLayer<MemoryGate>) -> Server {
    let app = Router::new()
        .route("/", route_get(|| async { "ok" }))
        .layer(layer);
    Server::start_on(bind, app).await
}

/// A GET with `headers` (several lines of one name stay several lines; values as bytes).
fn request(url: &str, headers: &[(&str, &[u8])]) -> Request<Empty<Bytes>> {
    let mut req = Request::get(url).body(Empty::new()).unwrap();
    for (name, value) in headers {
        req.headers_mut().append(
            http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
            HeaderValue::from_bytes(value).unwrap(),
        );
    }
    req
}

/// What a request got: its status and body.
async fn h1(url: &str, headers: &[(&str, &[u8])]) -> (StatusCode, String) {
    let res = client().request(request(url, headers)).await.unwrap();
    let status = res.status();
    let body = res.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// The same over one HTTP/2 connection (h2c, prior knowledge) to `addr`.
async fn h2(addr: SocketAddr, headers: &[(&str, &[u8])]) -> (StatusCode, String) {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
            .await
            .unwrap();
    tokio::spawn(conn);
    let res = send
        .send_request(request(&format!("http://{addr}/"), headers))
        .await
        .unwrap();
    let status = res.status();
    let body = res.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// The rejected keys and their counts, by key.
fn rejected(layer: &RateLimitLayer<MemoryGate>) -> Vec<(String, u64)> {
    let mut keys: Vec<(String, u64)> = layer
        .top_rejected(16)
        .into_iter()
        .map(|k| (k.key, k.count))
        .collect();
    keys.sort();
    keys
}

fn url(server: &Server) -> String {
    server.url("/")
}

/// Over an IPv6 loopback listener (the proxy at `::1`, a second hop in `fd00::/8`): one
/// IPv6 client written every way proxies write it (case, zeros, brackets and a port, a
/// zone id, several lines, spoofed entries to the left) is one bucket, and the key is its
/// canonical text.
#[tokio::test]
async fn ipv6_spellings_are_one_key_and_spoofing_changes_nothing() {
    let xff = behind(ForwardedHeader::XForwardedFor, &["::1", "fd00::/8"]);
    let layer = layer_of("per-ip", xff);
    let server = serve("[::1]:0", layer.clone()).await;
    let url = url(&server);
    let name = "x-forwarded-for";
    assert_eq!(h1(&url, &[(name, b"2001:db8::7")]).await.0, StatusCode::OK);
    for spelling in [
        &b"2001:DB8:0:0:0:0:0:7"[..],
        b"[2001:db8::7]:4711",
        b"6.6.6.6, 2001:0db8::0007, fd00::2",
        b"unknown, _hidden, [2001:db8::7], [fd00::3]:80,, fd00::2",
        b"2001:db8::7%eth0",
        b"[2001:db8::7%25eth0]:4711",
    ] {
        let (status, _) = h1(&url, &[(name, spelling)]).await;
        assert_eq!(
            status,
            StatusCode::TOO_MANY_REQUESTS,
            "{}",
            String::from_utf8_lossy(spelling)
        );
    }
    // Several lines: the last line's last entry is the nearest hop; whatever the client
    // wrote on its own line (or spoofed as a trusted hop) is left of the client.
    let lines: [(&str, &[u8]); 3] = [
        (name, b"fd00::9"),
        (name, b"9.9.9.9, 2001:db8::7"),
        (name, b"fd00::2"),
    ];
    assert_eq!(h1(&url, &lines).await.0, StatusCode::TOO_MANY_REQUESTS);
    // The other header, written by the client, is never read.
    let mixed: [(&str, &[u8]); 2] = [(name, b"2001:db8::7"), ("forwarded", b"for=1.1.1.1")];
    assert_eq!(h1(&url, &mixed).await.0, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(rejected(&layer), [("per-ip:2001:db8::7".to_owned(), 8)]);
    assert_eq!(layer.stats().admitted, 1);
}

/// `Forwarded` over HTTP/2 on an IPv6 listener: quoted IPv6 with ports, case, obfuscated
/// and `unknown` identifiers, several lines; a client's own `X-Forwarded-For` is never read.
#[tokio::test]
async fn forwarded_over_h2_keys_the_client_behind_the_nearest_hops() {
    let fwd = behind(ForwardedHeader::Forwarded, &["::1", "fd00::/8"]);
    let layer = layer_of("per-ip", fwd);
    let server = serve("[::1]:0", layer.clone()).await;
    let a = server.addr;
    let name = "forwarded";
    let first = h2(
        a,
        &[(name, br#"for="[2001:db8:cafe::17]:4711";proto=https"#)],
    )
    .await;
    assert_eq!(first.0, StatusCode::OK);
    for spelling in [
        &br#"FOR="[2001:DB8:CAFE:0::17]""#[..],
        br#"for=1.2.3.4, for="[2001:db8:cafe::17]:4711";by=_lb, for="[fd00::2]""#,
        br#"for="\"spoof", for=[2001:db8:cafe::17];host=example.com, For=fd00::2"#,
        br#"for="[2001:db8:cafe::17%25eth0]:_port""#,
    ] {
        let (status, _) = h2(a, &[(name, spelling)]).await;
        assert_eq!(
            status,
            StatusCode::TOO_MANY_REQUESTS,
            "{}",
            String::from_utf8_lossy(spelling)
        );
    }
    // An unknown or obfuscated client behind a trusted hop: the key is that hop.
    for (i, hidden) in [
        &b"for=unknown"[..],
        b"for=_gazonk",
        br#"for="_x";proto=http"#,
    ]
    .into_iter()
    .enumerate()
    {
        let lines: [(&str, &[u8]); 2] = [(name, hidden), (name, b"for=\"[fd00::5]:80\"")];
        let (status, _) = h2(a, &lines).await;
        let want = if i == 0 {
            StatusCode::OK
        } else {
            StatusCode::TOO_MANY_REQUESTS
        };
        assert_eq!(status, want, "{}", String::from_utf8_lossy(hidden));
    }
    // No `Forwarded` at all from the trusted peer: the peer itself (its XFF is ignored).
    assert_eq!(
        h2(a, &[("x-forwarded-for", b"2001:db8::1")]).await.0,
        StatusCode::OK
    );
    assert_eq!(
        h2(a, &[("x-forwarded-for", b"2001:db8::2")]).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        rejected(&layer),
        [
            ("per-ip:2001:db8:cafe::17".to_owned(), 4),
            ("per-ip:::1".to_owned(), 1),
            ("per-ip:fd00::5".to_owned(), 2),
        ]
    );
}

/// Every hop trusted: the key is the left-most address (a proxy's own request); a
/// link-local client with a zone id is its address; an IPv4 client written IPv4-mapped by
/// an IPv6 proxy is its IPv4 address, with or without the `/64` grouping.
#[tokio::test]
async fn all_trusted_link_local_and_mapped_clients() {
    let xff = ClientIp::builder(ForwardedHeader::XForwardedFor)
        .trust("::1")
        .trust("fd00::/8")
        .peer(connect_info())
        .ipv6_per_64(true)
        .build()
        .unwrap();
    let layer = layer_of("per-ip", xff);
    let server = serve("[::1]:0", layer.clone()).await;
    let url = url(&server);
    let name = "x-forwarded-for";
    let cases: [(&[u8], StatusCode); 8] = [
        (b"fd00::5, fd00::6", StatusCode::OK),
        (b"fd00::5:1, fd00::7", StatusCode::TOO_MANY_REQUESTS), // same /64 as fd00::5
        (b"fe80::1%eth0", StatusCode::OK),
        (b"[fe80::2%25eth1]:80", StatusCode::TOO_MANY_REQUESTS), // fe80::/64
        (b"::ffff:203.0.113.9", StatusCode::OK),
        (b"203.0.113.9:80, fd00::1", StatusCode::TOO_MANY_REQUESTS),
        (b"[::FFFF:CB00:7109]:443", StatusCode::TOO_MANY_REQUESTS),
        (b"203.0.113.10", StatusCode::OK),
    ];
    for (value, want) in cases {
        let (status, _) = h1(&url, &[(name, value)]).await;
        assert_eq!(status, want, "{}", String::from_utf8_lossy(value));
    }
    assert_eq!(
        rejected(&layer),
        [
            ("per-ip:203.0.113.9".to_owned(), 2),
            ("per-ip:fd00::/64".to_owned(), 1),
            ("per-ip:fe80::/64".to_owned(), 1),
        ]
    );
}

/// Many hops and a long header: four hundred trusted hops after the client, and a client
/// that wrote a long spoofed chain of its own, over HTTP/1 and HTTP/2.
#[tokio::test]
async fn many_hops_and_long_headers() {
    let xff = behind(ForwardedHeader::XForwardedFor, &["127.0.0.0/8"]);
    let layer = layer_of("per-ip", xff);
    let server = serve("127.0.0.1:0", layer.clone()).await;
    let hops: Vec<String> = (0..400)
        .map(|i| format!("127.{}.{}.1", i / 256, i % 256))
        .collect();
    let spoof = "6.6.6.6, ".repeat(500);
    let chain = format!("{spoof}198.51.100.4, {}", hops.join(", "));
    let chain = chain.as_bytes();
    assert_eq!(
        h1(&url(&server), &[("x-forwarded-for", chain)]).await.0,
        StatusCode::OK
    );
    assert_eq!(
        h2(server.addr, &[("x-forwarded-for", chain)]).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(rejected(&layer), [("per-ip:198.51.100.4".to_owned(), 1)]);
}

/// Three policies, three missing-key choices: per IP (shared bucket for keyless), per API
/// key (skipped without one), per user (refused without one). Each bad header gets the
/// documented 400 and charges nothing; a request is charged under exactly the keys it has.
#[tokio::test]
async fn missing_key_choices_per_policy_over_h1_and_h2() {
    let gate = gate();
    let two = Quota::new(Rate::per(2, Duration::from_secs(60)).unwrap(), 2).unwrap();
    let layer = RateLimitLayer::builder(gate.clone())
        .policy(Policy::new(
            "per-ip",
            two,
            behind(ForwardedHeader::XForwardedFor, &["127.0.0.1"]),
        ))
        .policy(
            Policy::new("per-key", two, Header::new("x-api-key").unwrap())
                .missing_key(MissingKey::Skip),
        )
        .policy(
            Policy::new("per-user", two, Header::new("x-user").unwrap())
                .missing_key(MissingKey::Refuse),
        )
        .build()
        .unwrap();
    let server = serve("127.0.0.1:0", layer.clone()).await;
    let ip: (&str, &[u8]) = ("x-forwarded-for", b"203.0.113.5");
    let long = vec![b'u'; 10_000];
    let bad: [(Option<&[u8]>, &str); 4] = [
        (None, "no x-user header"),
        (
            Some(b"caf\xc3\xa9"),
            "the x-user header holds a byte other than",
        ),
        (Some(b"a\tb"), "the x-user header holds a byte other than"),
        (Some(&long), "the x-user header is longer than 256 bytes"),
    ];
    for (i, (user, why)) in bad.iter().enumerate() {
        let mut headers = vec![ip, ("x-api-key", b"k-1")];
        if let Some(user) = user {
            headers.push(("x-user", user));
        }
        let (status, body) = if i % 2 == 0 {
            h1(&url(&server), &headers).await
        } else {
            h2(server.addr, &headers).await
        };
        assert_eq!(status, StatusCode::BAD_REQUEST, "{why}");
        assert!(
            body.contains("the request has no key for the policy \\\"per-user\\\": ")
                && body.contains(why),
            "{why}: {body}"
        );
    }
    assert_eq!(layer.stats().missing_key, 4);
    // No key charged by the refused requests; a keyed one is charged under all three.
    let res = client()
        .request(request(
            &url(&server),
            &[ip, ("x-api-key", b"k-1"), ("x-user", b"u 1")],
        ))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let remaining = field(res.headers(), "ratelimit").unwrap();
    assert_eq!(
        remaining,
        r#""per-ip";r=1;t=30, "per-key";r=1;t=30, "per-user";r=1;t=30"#
    );
    // Without an API key, per-key is skipped: its member is absent.
    let res = client()
        .request(request(&url(&server), &[ip, ("x-user", b"u 2")]))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let remaining = field(res.headers(), "ratelimit").unwrap();
    assert_eq!(remaining, r#""per-ip";r=0;t=60, "per-user";r=1;t=30"#);
    // Read the buckets back through the gate (each check takes one more).
    assert_eq!(
        gate.check_all(&[("per-key:k-1", two)], 1).unwrap()[0].remaining,
        0
    );
    assert_eq!(
        gate.check_all(&[("per-user:u 1", two)], 1).unwrap()[0].remaining,
        0
    );
    assert_eq!(
        gate.check_all(&[("per-user:u 2", two)], 1).unwrap()[0].remaining,
        0
    );
    assert!(!gate.check_all(&[("per-ip:203.0.113.5", two)], 1).unwrap()[0].allowed);
}

/// A trusted proxy written as its scoped link-local address (`fe80::1%eth0`, as `ping`, `ss`
/// and logs show it; `fe80::%eth0/64` with a prefix, RFC 4007 §11.7) is trusted as that
/// address: the zone names an interface of this host, and is dropped as it is from a peer's
/// socket address and from the header's entries. Before, `build` refused it as "neither a
/// CIDR network nor an IP address", while the same text in `X-Forwarded-For` is read as one.
#[test]
fn a_proxy_written_with_its_zone_id_is_trusted() {
    use flowgate::http::RequestInfo;

    for trusted in ["fe80::1%eth0", " fe80::1%25eth0 ", "fe80::%eth0/64"] {
        let client_ip = ClientIp::builder(ForwardedHeader::XForwardedFor)
            .trust(trusted)
            .build()
            .unwrap_or_else(|e| panic!("{trusted:?}: {e}"));
        let mut req = http::Request::new(());
        req.extensions_mut()
            .insert("[fe80::1%2]:40000".parse::<SocketAddr>().unwrap());
        req.headers_mut().insert(
            "x-forwarded-for",
            HeaderValue::from_static("6.6.6.6, 203.0.113.9"),
        );
        let mut key = String::new();
        assert!(client_ip.extract(&RequestInfo::of(&req), &mut key));
        assert_eq!(key, "203.0.113.9", "{trusted:?}");
    }
    // Still refused: an empty zone, a zone on an IPv4 address, a prefix that is no length.
    for bad in [
        "fe80::1%",
        "10.0.0.1%eth0",
        "fe80::%eth0/129",
        "fe80::%eth0/x",
    ] {
        let e = ClientIp::builder(ForwardedHeader::XForwardedFor)
            .trust(bad)
            .build()
            .unwrap_err();
        assert_eq!(e.field(), "client_ip.trusted", "{bad:?}");
    }
}

/// The keyless bucket is no client's to take: a client whose key is the policy's
/// `MissingKey::Shared` key (`x-api-key: -` under the default `"-"`, or a user's own shared
/// key, from a `Header` or a closure) has a bucket of its own, and cannot spend (or be
/// limited with) every keyless request's quota.
#[tokio::test]
async fn a_key_equal_to_the_shared_keyless_key_has_its_own_bucket() {
    let by_closure = |req: &flowgate::http::RequestInfo<'_>, key: &mut String| match req
        .headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
    {
        Some(k) => {
            key.push_str(k);
            true
        }
        None => false,
    };
    let policies = [
        (
            Policy::new(
                "per-key",
                one_per_minute(),
                Header::new("x-api-key").unwrap(),
            ),
            "-",
        ),
        (
            Policy::new("per-key", one_per_minute(), by_closure)
                .missing_key(MissingKey::Shared("anon".to_owned())),
            "anon",
        ),
    ];
    for (policy, shared) in policies {
        let layer = RateLimitLayer::builder(gate())
            .policy(policy)
            .build()
            .unwrap();
        let server = serve("127.0.0.1:0", layer.clone()).await;
        let url = url(&server);
        let keyed: [(&str, &[u8]); 1] = [("x-api-key", shared.as_bytes())];
        assert_eq!(h1(&url, &[]).await.0, StatusCode::OK, "{shared}: keyless");
        assert_eq!(
            h1(&url, &keyed).await.0,
            StatusCode::OK,
            "{shared}: a client sending the shared key has its own bucket"
        );
        assert_eq!(h1(&url, &keyed).await.0, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(h1(&url, &[]).await.0, StatusCode::TOO_MANY_REQUESTS);
        // A key written as the escaped one is a third key, neither of those.
        let escaped = format!("\\{shared}");
        let escaped: [(&str, &[u8]); 1] = [("x-api-key", escaped.as_bytes())];
        assert_eq!(h1(&url, &escaped).await.0, StatusCode::OK, "{shared}");
        let keys = rejected(&layer);
        assert_eq!(keys.len(), 2, "{keys:?}");
        assert!(
            keys.contains(&(format!("per-key:{shared}"), 1)),
            "the keyless bucket: {keys:?}"
        );
        assert!(
            keys.contains(&(format!("per-key:\\{shared}"), 1)),
            "the client's own: {keys:?}"
        );
    }
    // A shared key that could be an escaped request's key is refused.
    let e = RateLimitLayer::builder(gate())
        .policy(
            Policy::new(
                "per-key",
                one_per_minute(),
                Header::new("x-api-key").unwrap(),
            )
            .missing_key(MissingKey::Shared("\\-".to_owned())),
        )
        .build()
        .unwrap_err();
    assert_eq!(e.field(), "rate_limit.policies", "{e}");
}

/// A client's journey behind two layers of proxies (a CDN edge, then a load balancer that
/// is the app's peer), as `X-Forwarded-For`: whatever a client writes (spoofed left-most
/// entries, a trusted-looking address, its own line, garbage), its key is the address the
/// CDN saw; IPv6 clients are counted per `/64` as documented, an IPv4 client written
/// IPv4-mapped is its IPv4 address, and an `unknown` client is the hop that said so.
#[tokio::test]
async fn behind_a_cdn_and_a_load_balancer_the_key_is_the_client_the_cdn_saw() {
    let xff = ClientIp::builder(ForwardedHeader::XForwardedFor)
        .trust("127.0.0.1/32") // the load balancer
        .trust("10.1.0.0/16") // the CDN's edges
        .peer(connect_info())
        .ipv6_per_64(true)
        .build()
        .unwrap();
    let layer = layer_of("per-ip", xff);
    let server = serve("127.0.0.1:0", layer.clone()).await;
    let url = url(&server);
    let name = "x-forwarded-for";
    let cases: [(&[&[u8]], StatusCode); 13] = [
        (&[b"203.0.113.7, 10.1.2.3"], StatusCode::OK),
        (
            &[b"1.1.1.1, 203.0.113.7, 10.1.2.3"],
            StatusCode::TOO_MANY_REQUESTS,
        ),
        // A spoofed CDN address left of the client, the client with a port.
        (
            &[b"10.1.9.9, 203.0.113.7:5555, 10.1.2.3"],
            StatusCode::TOO_MANY_REQUESTS,
        ),
        // The client's own line, then the CDN's.
        (
            &[b"6.6.6.6", b"203.0.113.7, 10.1.2.3"],
            StatusCode::TOO_MANY_REQUESTS,
        ),
        (
            &[b"\"open, ;; =", b"203.0.113.7", b"10.1.2.3"],
            StatusCode::TOO_MANY_REQUESTS,
        ),
        (
            &[b"::ffff:203.0.113.7, 10.1.2.3"],
            StatusCode::TOO_MANY_REQUESTS,
        ),
        // IPv6 clients: per /64.
        (&[b"2001:db8:1:2::5, 10.1.2.3"], StatusCode::OK),
        (
            &[b"[2001:db8:1:2:ffff::9]:443, 10.1.2.3"],
            StatusCode::TOO_MANY_REQUESTS,
        ),
        (&[b"2001:db8:1:3::5, 10.1.2.3"], StatusCode::OK),
        // A client that wrote a whole fake chain: the CDN appended what it saw after it.
        (
            &[b"203.0.113.7, 10.1.2.3, 198.51.100.1, 10.1.2.4"],
            StatusCode::OK,
        ),
        // The CDN could not tell: its own address is the key (nearest true hop).
        (&[b"unknown, 10.1.2.3"], StatusCode::OK),
        (&[b"_hidden, 10.1.2.3"], StatusCode::TOO_MANY_REQUESTS),
        // The load balancer's own request (a health check): its address.
        (&[], StatusCode::OK),
    ];
    for (lines, want) in cases {
        let headers: Vec<(&str, &[u8])> = lines.iter().map(|l| (name, *l)).collect();
        let (status, _) = h1(&url, &headers).await;
        assert_eq!(
            status,
            want,
            "{:?}",
            lines
                .iter()
                .map(|l| String::from_utf8_lossy(l))
                .collect::<Vec<_>>()
        );
    }
    assert_eq!(
        rejected(&layer),
        [
            ("per-ip:10.1.2.3".to_owned(), 1),
            ("per-ip:2001:db8:1:2::/64".to_owned(), 1),
            ("per-ip:203.0.113.7".to_owned(), 5),
        ]
    );
}

/// The same journey as `Forwarded` on a dual-stack listener, reached over IPv4 and IPv6
/// loopback (the load balancer trusted as one address each, `/128`, the IPv4 one written
/// IPv4-mapped), behind a CDN in `fd00::/8`: quoted IPv6 with ports, obfuscated
/// identifiers, several lines, a client's `X-Forwarded-For` never read; then trusted
/// networks at `/0`: `::/0` holds no IPv4 peer, and `0.0.0.0/0` makes every IPv4 address
/// a proxy, so the key is the left-most IPv4 entry, as documented (the client's own).
#[tokio::test]
async fn forwarded_through_two_layers_on_a_dual_stack_listener() {
    let fwd = behind(
        ForwardedHeader::Forwarded,
        &["::ffff:127.0.0.1/128", "::1/128", "fd00::/8"],
    );
    let layer = layer_of("per-ip", fwd);
    let server = serve("[::]:0", layer.clone()).await;
    let port = server.addr.port();
    let v4 = format!("http://127.0.0.1:{port}/");
    let v6 = format!("http://[::1]:{port}/");
    let name = "forwarded";
    /// Where a request goes, its header lines, and what it gets.
    type Case<'a> = (&'a str, &'a [(&'a str, &'a [u8])], StatusCode);
    let cases: [Case<'_>; 10] = [
        (
            &v6,
            &[(
                name,
                br#"for="[2001:db8:cafe::1]:4711";proto=https, for="[fd00::2]""#,
            )],
            StatusCode::OK,
        ),
        (
            &v4,
            &[(name, br#"for=198.51.100.2;by=_cdn, for="[fd00::2]:80""#)],
            StatusCode::OK,
        ),
        // An obfuscated hop on the last line: the walk stops, the key is the peer.
        (
            &v4,
            &[
                (name, br#"for="[2001:db8:cafe::1]""#),
                (name, b"for=_edge-7"),
            ],
            StatusCode::OK,
        ),
        (
            &v6,
            &[
                (name, b"for=6.6.6.6"),
                (name, br#"for="[2001:db8:cafe::1]:4711", for="[fd00::3]""#),
            ],
            StatusCode::TOO_MANY_REQUESTS,
        ),
        (
            &v4,
            &[(
                name,
                br#"for="[fd00::9]", For="[2001:DB8:CAFE::1]", for=fd00::2"#,
            )],
            StatusCode::TOO_MANY_REQUESTS,
        ),
        (
            &v6,
            &[
                ("x-forwarded-for", b"1.2.3.4"),
                (name, br#"for=198.51.100.2, for="[fd00::2]""#),
            ],
            StatusCode::TOO_MANY_REQUESTS,
        ),
        (
            &v4,
            &[(name, b"for=unknown")],
            StatusCode::TOO_MANY_REQUESTS,
        ),
        (
            &v6,
            &[(name, br#"for=unknown, for="[fd00::4]""#)],
            StatusCode::OK,
        ),
        // Every hop trusted: the left-most.
        (
            &v6,
            &[(name, br#"for="[fd00::4]:1""#)],
            StatusCode::TOO_MANY_REQUESTS,
        ),
        (&v6, &[], StatusCode::OK),
    ];
    for (url, headers, want) in cases {
        let (status, _) = h1(url, headers).await;
        assert_eq!(status, want, "{url} {headers:?}");
    }
    assert_eq!(
        rejected(&layer),
        [
            ("per-ip:127.0.0.1".to_owned(), 1),
            ("per-ip:198.51.100.2".to_owned(), 1),
            ("per-ip:2001:db8:cafe::1".to_owned(), 2),
            ("per-ip:fd00::4".to_owned(), 1),
        ]
    );

    // `::/0` trusts every IPv6 address and no IPv4 one: the IPv4 peer is the key.
    let layer = layer_of("per-ip", behind(ForwardedHeader::Forwarded, &["::/0"]));
    let server = serve("[::]:0", layer.clone()).await;
    let v4 = format!("http://127.0.0.1:{}/", server.addr.port());
    let v6 = format!("http://[::1]:{}/", server.addr.port());
    assert_eq!(h1(&v4, &[(name, b"for=192.0.2.1")]).await.0, StatusCode::OK);
    assert_eq!(
        h1(&v4, &[(name, b"for=192.0.2.2")]).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    // Over IPv6, every IPv6 hop is a proxy: the first IPv4 entry is the client.
    let chain: &[u8] = br#"for="[2001:db8::1]", for=192.0.2.3, for="[2001:db8::2]""#;
    assert_eq!(h1(&v6, &[(name, chain)]).await.0, StatusCode::OK);
    assert_eq!(
        h1(&v6, &[(name, b"for=192.0.2.3")]).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        rejected(&layer),
        [
            ("per-ip:127.0.0.1".to_owned(), 1),
            ("per-ip:192.0.2.3".to_owned(), 1),
        ]
    );

    // `0.0.0.0/0`: every IPv4 address is a proxy, so whatever an IPv4 client writes is
    // believed (the left-most IPv4 entry, stopped by an IPv6 one): trust only proxies.
    let layer = layer_of("per-ip", behind(ForwardedHeader::Forwarded, &["0.0.0.0/0"]));
    let server = serve("127.0.0.1:0", layer.clone()).await;
    let url = url(&server);
    assert_eq!(
        h1(&url, &[(name, b"for=192.0.2.9")]).await.0,
        StatusCode::OK
    );
    assert_eq!(
        h1(&url, &[(name, b"for=192.0.2.10")]).await.0,
        StatusCode::OK
    );
    let chain: &[u8] = br#"for=192.0.2.9, for="[2001:db8::5]", for=10.0.0.1"#;
    assert_eq!(h1(&url, &[(name, chain)]).await.0, StatusCode::OK);
    assert_eq!(
        h1(&url, &[(name, b"for=\"[2001:db8::5]:80\"")]).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(rejected(&layer), [("per-ip:2001:db8::5".to_owned(), 1)]);
}
