//! `ClientIp` on long proxy chains: the walk reads from the right and stops where the
//! rules say, without an allocation per request, whatever a client wrote to the left.

use std::net::SocketAddr;

use flowgate::http::{ClientIp, ForwardedHeader, KeyExtractor, PeerIp, RequestInfo};

use crate::alloc::allocations;

/// The key `extractor` gives a request from the trusted `10.0.0.1` with `lines` of
/// `header`, and the allocations the extraction made.
fn key_and_allocations(
    extractor: &ClientIp,
    header: &'static str,
    lines: &[&str],
) -> (String, u64) {
    key_and_allocations_from(extractor, "10.0.0.1:40000", header, lines)
}

/// The same from the peer `peer`.
fn key_and_allocations_from(
    extractor: &impl KeyExtractor,
    peer: &str,
    header: &'static str,
    lines: &[&str],
) -> (String, u64) {
    let mut req = http::Request::new(());
    req.extensions_mut()
        .insert(peer.parse::<SocketAddr>().unwrap());
    for line in lines {
        req.headers_mut()
            .append(header, http::HeaderValue::from_str(line).unwrap());
    }
    let info = RequestInfo::of(&req);
    let mut key = String::with_capacity(64);
    let before = allocations();
    assert!(extractor.extract(&info, &mut key));
    (key, allocations() - before)
}

#[test]
fn long_chains_are_walked_without_an_allocation() {
    let fwd = ClientIp::builder(ForwardedHeader::Forwarded)
        .trust("10.0.0.0/8")
        .build()
        .unwrap();
    let xff = ClientIp::builder(ForwardedHeader::XForwardedFor)
        .trust("10.0.0.0/8")
        .build()
        .unwrap();
    // Ten thousand elements a client wrote, left of what the proxies appended.
    let spoofed = "for=192.0.2.1;proto=http, ".repeat(10_000);
    let honest = "for=198.51.100.7, for=\"10.0.0.9:1234\"";
    let line = format!("{spoofed}{honest}");
    assert_eq!(
        key_and_allocations(&fwd, "forwarded", &[&line]),
        ("198.51.100.7".to_owned(), 0)
    );
    // Over field lines, and with broken text (an unterminated quote) on the left.
    let broken = format!("for=\"{}", "6.6.6.6\\\", ".repeat(5_000));
    assert_eq!(
        key_and_allocations(&fwd, "forwarded", &[&broken, &spoofed, honest]),
        ("198.51.100.7".to_owned(), 0)
    );
    // Every element a trusted hop: walked to the left-most.
    let trusted = "for=10.1.1.1, ".repeat(10_000) + "for=10.2.2.2";
    assert_eq!(
        key_and_allocations(&fwd, "forwarded", &[&trusted]),
        ("10.1.1.1".to_owned(), 0)
    );
    let line = format!("{}198.51.100.7, 10.0.0.9", "192.0.2.1, ".repeat(10_000));
    assert_eq!(
        key_and_allocations(&xff, "x-forwarded-for", &[&line]),
        ("198.51.100.7".to_owned(), 0)
    );
}

/// The forms proxies and listeners write addresses in (ports, brackets, IPv4-mapped, zone
/// ids, per-/64 keys) cost no allocation either.
#[test]
fn every_written_form_is_read_without_an_allocation() {
    let build = |source, per_64| {
        ClientIp::builder(source)
            .trust("10.0.0.0/8")
            .trust("2001:db8:ffff::/48")
            .ipv6_per_64(per_64)
            .build()
            .unwrap()
    };
    let xff = build(ForwardedHeader::XForwardedFor, false);
    let fwd = build(ForwardedHeader::Forwarded, false);
    let xff_64 = build(ForwardedHeader::XForwardedFor, true);
    let cases: [(&ClientIp, &str, &'static str, &str, &str); 9] = [
        (
            &xff,
            "10.0.0.1:1",
            "x-forwarded-for",
            "192.0.2.7:5678, 10.0.0.2:80",
            "192.0.2.7",
        ),
        (
            &xff,
            "[::ffff:10.0.0.1]:1",
            "x-forwarded-for",
            "::ffff:192.0.2.7",
            "192.0.2.7",
        ),
        (
            &xff,
            "[::ffff:10.0.0.1]:1",
            "x-forwarded-for",
            "[::ffff:192.0.2.7]:4711",
            "192.0.2.7",
        ),
        (
            &xff,
            "[2001:db8:ffff::1]:1",
            "x-forwarded-for",
            "[2001:db8::1]:4711",
            "2001:db8::1",
        ),
        (
            &xff,
            "10.0.0.1:1",
            "x-forwarded-for",
            "fe80::1%eth0, 2001:db8:ffff::2%2",
            "fe80::1",
        ),
        (
            &xff_64,
            "10.0.0.1:1",
            "x-forwarded-for",
            "2001:db8:1:2:3:4:5:6",
            "2001:db8:1:2::/64",
        ),
        (
            &fwd,
            "[::ffff:10.0.0.1]:1",
            "forwarded",
            "for=\"[2001:db8::1]:4711\";proto=https",
            "2001:db8::1",
        ),
        (
            &fwd,
            "10.0.0.1:1",
            "forwarded",
            "for=\"[fe80::1%eth0]:4711\", for=10.0.0.2",
            "fe80::1",
        ),
        (
            &fwd,
            "10.0.0.1:1",
            "forwarded",
            "for=192.0.2.1, for=unknown",
            "10.0.0.1",
        ),
    ];
    for (extractor, peer, header, line, key) in cases {
        assert_eq!(
            key_and_allocations_from(extractor, peer, header, &[line]),
            (key.to_owned(), 0),
            "{line}"
        );
    }
    let peer = PeerIp::new();
    assert_eq!(
        key_and_allocations_from(&peer, "[::ffff:192.0.2.7]:1", "x-forwarded-for", &[]),
        ("192.0.2.7".to_owned(), 0)
    );
    let peer = PeerIp::new().ipv6_per_64(true);
    assert_eq!(
        key_and_allocations_from(&peer, "[2001:db8:1:2::9]:1", "x-forwarded-for", &[]),
        ("2001:db8:1:2::/64".to_owned(), 0)
    );
}

/// A quoted `Forwarded` value with a backslash escape (RFC 7230's quoted-pair), in a
/// parameter the walk does not read or in the `for` it does, costs no allocation either:
/// the walk allocates nothing, whatever the elements it reads hold.
#[test]
fn escaped_forwarded_values_are_read_without_an_allocation() {
    let fwd = ClientIp::builder(ForwardedHeader::Forwarded)
        .trust("10.0.0.0/8")
        .build()
        .unwrap();
    let cases: [(&str, &str); 4] = [
        (r#"for=192.0.2.7;ext="a\"b""#, "192.0.2.7"),
        (r#"for=192.0.2.7, for=10.0.0.2;by="\_p\"roxy""#, "192.0.2.7"),
        (r#"for="\1\9\2.0.2.7:\80""#, "192.0.2.7"),
        (
            r#"for="[2001:db8::7]:4711", for="\1\0.0.0.2""#,
            "2001:db8::7",
        ),
    ];
    for (line, key) in cases {
        assert_eq!(
            key_and_allocations(&fwd, "forwarded", &[line]),
            (key.to_owned(), 0),
            "{line}"
        );
    }
    // Ten thousand trusted elements, each with an escaped value.
    let trusted = r#"for=10.1.1.1;ext="\"", "#.repeat(10_000) + "for=10.2.2.2";
    assert_eq!(
        key_and_allocations(&fwd, "forwarded", &[&trusted]),
        ("10.1.1.1".to_owned(), 0)
    );
}

mod dual_stack {
    //! A real dual-stack listener (an IPv6 socket bound to `::ffff:127.0.0.1`, so only
    //! loopback) reports its IPv4 peers as `::ffff:127.0.0.1`: trust and keys must read them
    //! as the IPv4 addresses they are.

    use std::net::SocketAddr;
    use std::time::Duration;

    use axum::Router;
    use axum::extract::ConnectInfo;
    use axum::routing::get as route_get;
    use flowgate::gate::{Limit, MemoryGate};
    use flowgate::http::{ClientIp, ForwardedHeader, KeyExtractor, PeerIp, Policy, RateLimitLayer};
    use flowgate::{Quota, Rate};
    use http::StatusCode;

    use crate::harness::{self, Answer, client, get};

    /// A server on `bind` answering each request with its peer address as the server saw
    /// it, behind `layer`; stopped when dropped.
    struct Server(harness::Server);

    impl Server {
        async fn start(bind: &str, layer: RateLimitLayer<MemoryGate>) -> Server {
            let app = Router::new()
                .route(
                    "/",
                    route_get(|ConnectInfo(peer): ConnectInfo<SocketAddr>| async move {
                        peer.ip().to_string()
                    }),
                )
                .layer(layer);
            Server(harness::Server::start_on(bind, app).await)
        }

        /// The URL to reach it over IPv4 (both listeners take IPv4 connections).
        fn url(&self) -> String {
            format!("http://127.0.0.1:{}/", self.0.addr.port())
        }
    }

    /// A layer of one policy `name`: one request per minute per key.
    fn one_per_minute(name: &str, key: impl KeyExtractor) -> RateLimitLayer<MemoryGate> {
        let gate = MemoryGate::new(Limit::TokenBucket(Quota::per_second(1).unwrap()));
        let one = Quota::new(Rate::per(1, Duration::from_secs(60)).unwrap(), 1).unwrap();
        RateLimitLayer::builder(gate)
            .policy(Policy::new(name.to_owned(), one, key))
            .build()
            .unwrap()
    }

    fn peer() -> PeerIp {
        PeerIp::from_extension(|c: &ConnectInfo<SocketAddr>| c.0)
    }

    /// The client IP from `source`, trusting the proxies in `cidr`, the peer from the
    /// connection.
    fn behind(source: ForwardedHeader, cidr: &str) -> ClientIp {
        ClientIp::builder(source)
            .trust(cidr)
            .peer(peer())
            .build()
            .unwrap()
    }

    fn ok_from_mapped(a: &Answer) {
        assert_eq!(a.status, StatusCode::OK);
        assert_eq!(
            a.body.as_ref(),
            b"::ffff:127.0.0.1",
            "the peer as the socket saw it"
        );
    }

    /// (a) A proxy at 127.0.0.1, seen as `::ffff:127.0.0.1`, is in `127.0.0.0/8`: its
    /// `X-Forwarded-For` is read.
    #[tokio::test]
    async fn a_mapped_proxy_is_in_its_ipv4_network() {
        let client_ip = behind(ForwardedHeader::XForwardedFor, "127.0.0.0/8");
        let layer = one_per_minute("per-ip", client_ip);
        let server = Server::start("[::ffff:127.0.0.1]:0", layer.clone()).await;
        let (client, url) = (client(), server.url());
        ok_from_mapped(&get(&client, &url, &[("x-forwarded-for", "203.0.113.7")]).await);
        // Another client behind the same proxy has its own bucket.
        ok_from_mapped(&get(&client, &url, &[("x-forwarded-for", "203.0.113.8")]).await);
        let again = get(&client, &url, &[("x-forwarded-for", "203.0.113.7")]).await;
        assert_eq!(again.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(layer.top_rejected(2)[0].key, "per-ip:203.0.113.7");
    }

    /// (b) Trusting `::/0` (every IPv6 address) does not trust an IPv4 client that reaches
    /// a dual-stack socket: its `X-Forwarded-For` is ignored.
    #[tokio::test]
    async fn trusting_all_of_ipv6_does_not_trust_an_ipv4_client() {
        let client_ip = behind(ForwardedHeader::XForwardedFor, "::/0");
        let layer = one_per_minute("per-ip", client_ip);
        let server = Server::start("[::ffff:127.0.0.1]:0", layer.clone()).await;
        let (client, url) = (client(), server.url());
        ok_from_mapped(&get(&client, &url, &[("x-forwarded-for", "203.0.113.7")]).await);
        let spoofed = get(&client, &url, &[("x-forwarded-for", "203.0.113.8")]).await;
        assert_eq!(spoofed.status, StatusCode::TOO_MANY_REQUESTS);
        let rejected = layer.top_rejected(2);
        assert_eq!(rejected.len(), 1);
        assert_eq!(rejected[0].key, "per-ip:127.0.0.1");
    }

    /// (c) One client reaching an IPv4 listener and a dual-stack one, or written plain and
    /// IPv4-mapped by proxies, is one key: one bucket, not two.
    #[tokio::test]
    async fn one_client_is_one_key_through_either_listener() {
        let layer = one_per_minute("per-peer", peer());
        let v4 = Server::start("127.0.0.1:0", layer.clone()).await;
        let dual = Server::start("[::ffff:127.0.0.1]:0", layer.clone()).await;
        let client = client();
        let first = get(&client, &v4.url(), &[]).await;
        assert_eq!(
            (first.status, first.body.as_ref()),
            (StatusCode::OK, &b"127.0.0.1"[..])
        );
        let second = get(&client, &dual.url(), &[]).await;
        assert_eq!(second.status, StatusCode::TOO_MANY_REQUESTS);
        let rejected = layer.top_rejected(2);
        assert_eq!(rejected.len(), 1);
        assert_eq!(rejected[0].key, "per-peer:127.0.0.1");

        // Behind proxies: the same client written plain, mapped, bracketed with a port.
        for source in [ForwardedHeader::XForwardedFor, ForwardedHeader::Forwarded] {
            let client_ip = behind(source, "127.0.0.0/8");
            let layer = one_per_minute("per-ip", client_ip);
            let v4 = Server::start("127.0.0.1:0", layer.clone()).await;
            let dual = Server::start("[::ffff:127.0.0.1]:0", layer.clone()).await;
            let (name, plain, mapped) = match source {
                ForwardedHeader::XForwardedFor => (
                    "x-forwarded-for",
                    "203.0.113.7",
                    "[::ffff:203.0.113.7]:4711",
                ),
                _ => (
                    "forwarded",
                    "for=203.0.113.7",
                    "for=\"[::ffff:203.0.113.7]:4711\"",
                ),
            };
            let first = get(&client, &v4.url(), &[(name, plain)]).await;
            assert_eq!(first.status, StatusCode::OK);
            let second = get(&client, &dual.url(), &[(name, mapped)]).await;
            assert_eq!(second.status, StatusCode::TOO_MANY_REQUESTS, "{source:?}");
            let third = get(&client, &v4.url(), &[(name, mapped)]).await;
            assert_eq!(third.status, StatusCode::TOO_MANY_REQUESTS, "{source:?}");
            let rejected = layer.top_rejected(2);
            assert_eq!(rejected.len(), 1, "{source:?}");
            assert_eq!(rejected[0].key, "per-ip:203.0.113.7");
        }
    }
}
