use std::net::SocketAddr;

use http::header::HeaderValue;
use proptest::prelude::*;

use super::*;
use crate::http::key::Header;
use crate::http::key::tests::{key_of, request, warnings};

fn xff() -> ClientIp {
    ClientIp::builder(ForwardedHeader::XForwardedFor)
        .trust("10.0.0.0/8")
        .trust("2001:db8:ffff::/48")
        .build()
        .unwrap()
}

fn fwd() -> ClientIp {
    ClientIp::builder(ForwardedHeader::Forwarded)
        .trust("10.0.0.0/8")
        .trust("2001:db8:ffff::/48")
        .build()
        .unwrap()
}

/// A trusted proxy whose requests come without the header the extractor reads (it writes
/// the other one, or none) makes every client behind it one key: the proxy's own address,
/// one bucket for the whole site. Before, nothing said so; now the first such request (for
/// this extractor and its clones) logs a warning naming the header and the proxy.
#[test]
fn a_trusted_peer_without_the_header_is_logged_once() {
    let c = fwd();
    let xff_only = request(Some("10.0.0.1:1"), &[("x-forwarded-for", b"203.0.113.9")]);
    let logged = warnings(|| {
        assert_eq!(key_of(&c, &xff_only).as_deref(), Some("10.0.0.1"));
        assert_eq!(key_of(&c.clone(), &xff_only).as_deref(), Some("10.0.0.1"));
    });
    assert_eq!(logged.len(), 1, "once per extractor: {logged:?}");
    for part in ["\"Forwarded\"", "10.0.0.1", "X-Forwarded-For"] {
        assert!(logged[0].contains(part), "{part}: {logged:?}");
    }
    // An untrusted peer (the header is not read), or a trusted one with the header.
    let logged = warnings(|| {
        let c = xff();
        assert_eq!(
            key_of(&c, &request(Some("198.51.100.1:1"), &[])).as_deref(),
            Some("198.51.100.1")
        );
        assert_eq!(key_of(&c, &xff_only).as_deref(), Some("203.0.113.9"));
    });
    assert!(logged.is_empty(), "{logged:?}");
}

#[test]
fn xff_walks_right_to_left_over_trusted_hops() {
    let c = xff();
    let get = |peer: &str, lines: &[&[u8]]| {
        let headers: Vec<(&str, &[u8])> = lines.iter().map(|l| ("x-forwarded-for", *l)).collect();
        key_of(&c, &request(Some(peer), &headers)).unwrap()
    };
    // Untrusted peer: the header is ignored.
    assert_eq!(get("198.51.100.1:1", &[b"203.0.113.9"]), "198.51.100.1");
    // Trusted peer, no header: the peer.
    assert_eq!(get("10.0.0.1:1", &[]), "10.0.0.1");
    // The first untrusted from the right, never the spoofed left-most.
    assert_eq!(
        get("10.0.0.1:1", &[b"6.6.6.6, 203.0.113.9, 10.1.1.1"]),
        "203.0.113.9"
    );
    // Across field lines, the last line is the nearest.
    assert_eq!(
        get("10.0.0.1:1", &[b"6.6.6.6", b"203.0.113.9 ,10.9.9.9"]),
        "203.0.113.9"
    );
    // Ports and brackets, IPv4-mapped addresses.
    assert_eq!(
        get("10.0.0.1:1", &[b"[2001:db8::5]:443, 10.0.0.3:8080"]),
        "2001:db8::5"
    );
    assert_eq!(get("10.0.0.1:1", &[b"::ffff:203.0.113.4"]), "203.0.113.4");
    assert_eq!(get("10.0.0.1:1", &[b"203.0.113.4:5"]), "203.0.113.4");
    // Every hop trusted: the left-most.
    assert_eq!(get("10.0.0.1:1", &[b"10.2.2.2, 10.3.3.3"]), "10.2.2.2");
    // A bad entry stops the walk at the nearest trusted hop.
    assert_eq!(
        get("10.0.0.1:1", &[b"203.0.113.9, garbage, 10.3.3.3"]),
        "10.3.3.3"
    );
    assert_eq!(get("10.0.0.1:1", &[b"203.0.113.9, unknown"]), "10.0.0.1");
    assert_eq!(get("10.0.0.1:1", &[b"203.0.113.9", b"\xff"]), "10.0.0.1");
    // Empty elements are skipped.
    assert_eq!(get("10.0.0.1:1", &[b"203.0.113.9,, "]), "203.0.113.9");
    // IPv6 trusted network; dual-stack peer.
    assert_eq!(
        get("[2001:db8:ffff::1]:1", &[b"2001:db8:1::1"]),
        "2001:db8:1::1"
    );
    assert_eq!(get("[::ffff:10.0.0.1]:1", &[b"203.0.113.9"]), "203.0.113.9");
}

#[test]
fn forwarded_parses_rfc_7239() {
    let c = fwd();
    let get = |peer: &str, lines: &[&[u8]]| {
        let headers: Vec<(&str, &[u8])> = lines.iter().map(|l| ("forwarded", *l)).collect();
        key_of(&c, &request(Some(peer), &headers)).unwrap()
    };
    assert_eq!(
        get("10.0.0.1:1", &[b"for=192.0.2.43, for=198.51.100.17"]),
        "198.51.100.17"
    );
    assert_eq!(
        get(
            "10.0.0.1:1",
            &[b"for=6.6.6.6;proto=http, For=\"[2001:db8:cafe::17]:4711\";by=10.0.0.1, for=10.0.0.7"]
        ),
        "2001:db8:cafe::17"
    );
    assert_eq!(
        get("10.0.0.1:1", &[b"for=\"192.0.2.60:80\";proto=https"]),
        "192.0.2.60"
    );
    // Quoted commas and semicolons do not split; escapes are undone.
    assert_eq!(
        get(
            "10.0.0.1:1",
            &[b"for=192.0.2.1;ext=\"a,b;c\\\"d\", for=\"\\1\\9\\2.0.2.2\""]
        ),
        "192.0.2.2"
    );
    // unknown, obfuscated, missing `for`, repeated `for`: stop at the nearest trusted hop.
    assert_eq!(
        get("10.0.0.1:1", &[b"for=192.0.2.1, for=unknown"]),
        "10.0.0.1"
    );
    assert_eq!(
        get("10.0.0.1:1", &[b"for=192.0.2.1, for=_hidden, for=10.0.0.5"]),
        "10.0.0.5"
    );
    assert_eq!(
        get("10.0.0.1:1", &[b"for=192.0.2.1, proto=http"]),
        "10.0.0.1"
    );
    assert_eq!(
        get("10.0.0.1:1", &[b"for=192.0.2.1;for=192.0.2.2"]),
        "10.0.0.1"
    );
    // A broken line is one bad entry; lines to its right still count.
    assert_eq!(
        get("10.0.0.1:1", &[b"for=\"6.6.6.6", b"for=192.0.2.3"]),
        "192.0.2.3"
    );
    assert_eq!(
        get("10.0.0.1:1", &[b"for=192.0.2.3, for=\"oops"]),
        "10.0.0.1"
    );
    assert_eq!(get("10.0.0.1:1", &[b"for 192.0.2.3"]), "10.0.0.1");
    // A client's broken text left of a proxy's element does not hide it.
    assert_eq!(
        get("10.0.0.1:1", &[b"for=\"6.6.6.6\\, for=192.0.2.4"]),
        "192.0.2.4"
    );
    assert_eq!(
        get("10.0.0.1:1", &[b"\xff\"\", for=192.0.2.4"]),
        "192.0.2.4"
    );
    assert_eq!(get("10.0.0.1:1", &[b"for=\"\""]), "10.0.0.1");
    // Untrusted peer: ignored.
    assert_eq!(get("192.0.2.200:1", &[b"for=192.0.2.3"]), "192.0.2.200");
    // X-Forwarded-For is not read by a Forwarded extractor.
    let req = request(Some("10.0.0.1:1"), &[("x-forwarded-for", b"192.0.2.3")]);
    assert_eq!(key_of(&c, &req).as_deref(), Some("10.0.0.1"));
}

#[test]
fn a_forwarded_element_of_empty_pairs_has_no_for() {
    // `;` is an element (RFC 7239: `[ forwarded-pair ] *( ";" [ forwarded-pair ] )`)
    // without a `for`, as `proto=http` is: it stops the walk. Only an element with
    // nothing but whitespace is an empty list element, skipped.
    let c = fwd();
    let get =
        |line: &[u8]| key_of(&c, &request(Some("10.0.0.1:1"), &[("forwarded", line)])).unwrap();
    assert_eq!(get(b"for=192.0.2.1, proto=http"), "10.0.0.1");
    assert_eq!(get(b"for=192.0.2.1, ;"), "10.0.0.1");
    assert_eq!(get(b"for=192.0.2.1, ;;, for=10.0.0.5"), "10.0.0.5");
    assert_eq!(get(b"for=192.0.2.1, , for=10.0.0.5"), "192.0.2.1");
    assert_eq!(get(b"for=192.0.2.1;, for=10.0.0.5"), "192.0.2.1");
}

/// A dual-stack listener reports an IPv4 peer as `::ffff:a.b.c.d`: it is the IPv4
/// address for trust and for the key, whatever form the peer or a hop is written in.
#[test]
fn ipv4_mapped_addresses_are_their_ipv4_addresses() {
    let get = |c: &ClientIp, peer: &str, name: &str, line: &[u8]| {
        key_of(c, &request(Some(peer), &[(name, line)])).unwrap()
    };
    let (x, f) = (xff(), fwd());
    // A proxy at 10.0.0.1 seen as ::ffff:10.0.0.1 is in 10.0.0.0/8: its header is read.
    assert_eq!(
        get(&x, "[::ffff:10.0.0.1]:1", "x-forwarded-for", b"203.0.113.9"),
        "203.0.113.9"
    );
    assert_eq!(
        get(&f, "[::ffff:10.0.0.1]:1", "forwarded", b"for=203.0.113.9"),
        "203.0.113.9"
    );
    // ... and so is a mapped hop in the header.
    assert_eq!(
        get(
            &x,
            "10.0.0.1:1",
            "x-forwarded-for",
            b"203.0.113.9, ::ffff:10.0.0.2, [::ffff:10.0.0.3]:80"
        ),
        "203.0.113.9"
    );
    assert_eq!(
        get(
            &f,
            "10.0.0.1:1",
            "forwarded",
            b"for=203.0.113.9, for=\"[::ffff:10.0.0.2]:80\""
        ),
        "203.0.113.9"
    );

    // `::/0` is every IPv6 address, never an IPv4 client of a dual-stack listener.
    let any_v6 = |source| ClientIp::builder(source).trust("::/0").build().unwrap();
    let (x6, f6) = (
        any_v6(ForwardedHeader::XForwardedFor),
        any_v6(ForwardedHeader::Forwarded),
    );
    for peer in ["[::ffff:192.0.2.1]:1", "192.0.2.1:1"] {
        assert_eq!(
            get(&x6, peer, "x-forwarded-for", b"203.0.113.9"),
            "192.0.2.1"
        );
        assert_eq!(get(&f6, peer, "forwarded", b"for=203.0.113.9"), "192.0.2.1");
    }
    // Nor is a mapped hop an IPv6 proxy: it is the client.
    assert_eq!(
        get(
            &x6,
            "[2001:db8::1]:1",
            "x-forwarded-for",
            b"6.6.6.6, ::ffff:192.0.2.2"
        ),
        "192.0.2.2"
    );
    assert_eq!(
        get(&x6, "[2001:db8::1]:1", "x-forwarded-for", b"2001:db8::2"),
        "2001:db8::2"
    );
    // A prefix reaching into ::ffff:0:0/96 without being inside it still matches only
    // IPv6 addresses.
    let wide = ClientIp::builder(ForwardedHeader::XForwardedFor)
        .trust("::ffff:0:0/95")
        .build()
        .unwrap();
    assert_eq!(
        get(
            &wide,
            "[::ffff:10.0.0.1]:1",
            "x-forwarded-for",
            b"203.0.113.9"
        ),
        "10.0.0.1"
    );

    // One client, one key, however it is written and whichever way it arrives.
    let forms: [(&str, &[u8]); 4] = [
        ("192.0.2.7:1", b""),
        ("[::ffff:192.0.2.7]:1", b""),
        ("10.0.0.1:1", b"::ffff:192.0.2.7"),
        ("[::ffff:10.0.0.1]:1", b"[::ffff:192.0.2.7]:4711"),
    ];
    for (peer, line) in forms {
        let headers: &[(&str, &[u8])] = if line.is_empty() {
            &[]
        } else {
            &[("x-forwarded-for", line)]
        };
        let req = request(Some(peer), headers);
        assert_eq!(key_of(&x, &req).as_deref(), Some("192.0.2.7"), "{peer}");
        let per_64 = ClientIp::builder(ForwardedHeader::XForwardedFor)
            .trust("10.0.0.0/8")
            .ipv6_per_64(true)
            .build()
            .unwrap();
        assert_eq!(key_of(&per_64, &req).as_deref(), Some("192.0.2.7"));
        if line.is_empty() {
            assert_eq!(key_of(&PeerIp::new(), &req).as_deref(), Some("192.0.2.7"));
            let per_64 = PeerIp::new().ipv6_per_64(true);
            assert_eq!(key_of(&per_64, &req).as_deref(), Some("192.0.2.7"));
        }
    }
    assert_eq!(
        get(
            &f,
            "[::ffff:10.0.0.1]:1",
            "forwarded",
            b"for=\"[::ffff:192.0.2.7]:4711\""
        ),
        "192.0.2.7"
    );
    assert_eq!(
        x.client(&RequestInfo::of(&request(
            Some("[::ffff:192.0.2.7]:1"),
            &[]
        ))),
        Some(IpAddr::from([192, 0, 2, 7]))
    );
}

/// An IPv6 address with a zone id, as proxies that write the peer's socket address as
/// their platform prints it do for a link-local client (Go's `net/http/httputil`
/// proxies write `fe80::1%eth0`, Rust's `SocketAddrV6` prints `[fe80::1%2]:4711`):
/// the address is the client; the zone (an interface of the proxy's host) is not
/// part of it.
#[test]
fn an_ipv6_zone_id_is_not_part_of_the_address() {
    let (x, f) = (xff(), fwd());
    let get = |c: &ClientIp, name: &str, line: &[u8]| {
        key_of(c, &request(Some("10.0.0.1:1"), &[(name, line)])).unwrap()
    };
    for line in [
        &b"fe80::1%eth0"[..],
        b"[fe80::1%2]:4711",
        b"[fe80::1%eth0]",
        b"6.6.6.6, fe80::1%en0, 10.0.0.2",
    ] {
        assert_eq!(get(&x, "x-forwarded-for", line), "fe80::1");
    }
    assert_eq!(
        get(&f, "forwarded", b"for=\"[fe80::1%eth0]:4711\""),
        "fe80::1"
    );
    assert_eq!(get(&f, "forwarded", b"for=\"[fe80::1%25eth0]\""), "fe80::1");
    // Escaped, it is unescaped on the stack: up to 128 bytes, longer is no address.
    let escaped = |zone: usize| format!("for=\"[fe80::1%\\{}]:80\"", "e".repeat(zone));
    assert_eq!(get(&f, "forwarded", escaped(100).as_bytes()), "fe80::1");
    assert_eq!(get(&f, "forwarded", escaped(200).as_bytes()), "10.0.0.1");
    // A zone on a trusted hop: still the hop, and trusted.
    assert_eq!(
        get(&x, "x-forwarded-for", b"203.0.113.9, 2001:db8:ffff::2%3"),
        "203.0.113.9"
    );
    assert_eq!(
        get(&x, "x-forwarded-for", b"203.0.113.9, ::ffff:10.0.0.2%eth0"),
        "203.0.113.9"
    );
    // Not a zone: an empty one, one on an IPv4 address, bytes outside a zone's.
    for line in [
        &b"fe80::1%"[..],
        b"[fe80::1%]:80",
        b"192.0.2.1%eth0",
        b"192.0.2.1%eth0:80",
        b"fe80::1%eth 0",
        b"fe80::1%eth0]",
        b"[fe80::1%eth0",
        b"fe80::1%%",
        b"fe80::1%eth0%eth1",
    ] {
        assert_eq!(
            get(&x, "x-forwarded-for", line),
            "10.0.0.1",
            "{}",
            String::from_utf8_lossy(line)
        );
    }
}

#[test]
fn client_ip_config_errors() {
    let err = ClientIp::builder(ForwardedHeader::XForwardedFor)
        .trust("10.0.0.0/8")
        .trust("10.0.0.0/33")
        .build()
        .unwrap_err();
    assert_eq!(err.field(), "client_ip.trusted");
    assert!(err.reason().contains("10.0.0.0/33"));
    let err = ClientIp::builder(ForwardedHeader::Forwarded)
        .build()
        .unwrap_err();
    assert_eq!(err.kind(), ConfigErrorKind::Zero);
    // A single address, host bits, a v4-mapped network.
    let c = ClientIp::builder(ForwardedHeader::XForwardedFor)
        .trust("192.0.2.1")
        .trust("10.1.2.3/8")
        .trust("::ffff:172.16.0.0/108")
        .build()
        .unwrap();
    assert_eq!(
        c.trusted()
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>(),
        ["192.0.2.1/32", "10.0.0.0/8", "172.16.0.0/12"]
    );
    let req = request(Some("172.16.5.5:1"), &[("x-forwarded-for", b"203.0.113.1")]);
    assert_eq!(key_of(&c, &req).as_deref(), Some("203.0.113.1"));
}

/// Any bytes a header value may hold (no CR, LF, NUL).
fn value_bytes() -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(any::<u8>(), 0..64).prop_map(|v| {
        v.into_iter()
            .filter(|b| HeaderValue::from_bytes(&[*b]).is_ok())
            .collect()
    })
}

/// Header-ish text: addresses, separators, quotes and keywords, to reach deep paths.
fn chainish() -> impl Strategy<Value = Vec<u8>> {
    let piece = prop_oneof![
        Just(b"10.0.0.1".to_vec()),
        Just(b"203.0.113.5".to_vec()),
        Just(b"[2001:db8::1]:80".to_vec()),
        Just(b"for=".to_vec()),
        Just(b"\"".to_vec()),
        Just(b"\\".to_vec()),
        Just(b",".to_vec()),
        Just(b";".to_vec()),
        Just(b" ".to_vec()),
        Just(b"unknown".to_vec()),
        Just(b"_x".to_vec()),
        Just(b":".to_vec()),
        value_bytes(),
    ];
    proptest::collection::vec(piece, 0..12).prop_map(|v| v.concat())
}

fn untrusted_v4() -> impl Strategy<Value = IpAddr> {
    any::<[u8; 4]>()
        .prop_filter("not trusted", |o| o[0] != 10)
        .prop_map(IpAddr::from)
}

/// One hop of a generated chain: what it is, and how it is written.
#[derive(Debug, Clone)]
enum Hop {
    /// An address (trusted when in 10/8 or 2001:db8:ffff::/48), written in one of the
    /// forms proxies use: `style` picks bare, with a port, bracketed, IPv4-mapped, with
    /// a zone id.
    Addr(IpAddr, u8),
    /// `unknown`, an obfuscated name, or text that is no address.
    Bad(&'static str),
    /// An empty list element (skipped).
    Empty,
}

fn hop() -> impl Strategy<Value = Hop> {
    let v4 = prop_oneof![
        any::<[u8; 3]>().prop_map(|o| IpAddr::from([10, o[0], o[1], o[2]])),
        any::<[u8; 4]>().prop_map(IpAddr::from),
    ];
    let v6 = prop_oneof![
        any::<u64>().prop_map(|lo| IpAddr::V6(Ipv6Addr::from_bits(
            (0x2001_0db8_ffff_u128 << 80) | u128::from(lo)
        ))),
        any::<u128>().prop_map(|bits| IpAddr::V6(Ipv6Addr::from_bits(bits))),
    ];
    let addr = prop_oneof![v4, v6].prop_map(|ip| ip.to_canonical());
    prop_oneof![
        6 => (addr, any::<u8>()).prop_map(|(ip, style)| Hop::Addr(ip, style)),
        1 => prop_oneof![
            Just("unknown"),
            Just("_hidden"),
            Just("garbage"),
            Just("1.2.3"),
            Just("[::1"),
            Just("1.2.3.4:99999x"),
            Just("fe80::1%"),
            Just("1.2.3.4%eth0"),
        ]
        .prop_map(Hop::Bad),
        1 => Just(Hop::Empty),
    ]
}

/// `hop` as an `X-Forwarded-For` entry and as a `Forwarded` element.
fn write_hop(hop: &Hop) -> (String, String) {
    match hop {
        Hop::Addr(ip, style) => {
            let port = u16::from(*style) * 257;
            // A zone id on some IPv6 hops, as proxies write a link-local peer.
            let zone = match style / 64 {
                3 => "%eth0",
                2 => "%2",
                _ => "",
            };
            let node = match (ip, style % 4) {
                (IpAddr::V6(v6), 0) => format!("{v6}{zone}"),
                (_, 0) => ip.to_string(),
                (IpAddr::V4(v4), 1) => format!("{v4}:{port}"),
                (IpAddr::V4(v4), 2) => format!("[{}{zone}]:{port}", v4.to_ipv6_mapped()),
                (IpAddr::V4(v4), _) => v4.to_ipv6_mapped().to_string(),
                (IpAddr::V6(v6), 1 | 2) => format!("[{v6}{zone}]:{port}"),
                (IpAddr::V6(v6), _) => format!("[{v6}{zone}]"),
            };
            let quoted = node.contains([':', '[']) || style % 8 >= 4;
            let element = match (quoted, style % 3) {
                (true, 0) => format!("for=\"{node}\";proto=https"),
                (true, _) => format!("by=\"_p\";For=\"{node}\""),
                (false, 0) => format!("for={node}"),
                (false, _) => format!("host=example.com;for={node}"),
            };
            (node, element)
        }
        Hop::Bad(text) => {
            let quoted = text.contains(['[', ':']);
            let element = if quoted {
                format!("for=\"{text}\"")
            } else {
                format!("for={text}")
            };
            ((*text).to_owned(), element)
        }
        Hop::Empty => (" ".to_owned(), " ".to_owned()),
    }
}

/// The documented rules, over the hops as generated: from the right, skipping trusted
/// ones; a bad hop gives the nearest trusted one; all trusted gives the left-most.
fn expected(c: &ClientIp, peer: IpAddr, hops: &[Hop]) -> IpAddr {
    let mut nearest = peer;
    for hop in hops.iter().rev() {
        match hop {
            Hop::Addr(ip, _) if c.is_trusted(*ip) => nearest = *ip,
            Hop::Addr(ip, _) => return *ip,
            Hop::Bad(_) => return nearest,
            Hop::Empty => {}
        }
    }
    nearest
}

proptest! {
    /// Chains of up to 600 hops in every form, split over field lines anywhere: the
    /// key is what the documented rules give.
    #[test]
    fn long_chains_give_the_documented_key(
        hops in proptest::collection::vec(hop(), 0..600),
        cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..4),
    ) {
        let peer: IpAddr = "10.0.0.1".parse().unwrap();
        let mut cuts: Vec<usize> = cuts.iter().map(|i| i.index(hops.len() + 1)).collect();
        cuts.push(0);
        cuts.push(hops.len());
        cuts.sort_unstable();
        cuts.dedup();
        for (name, c, forwarded) in [("x-forwarded-for", xff(), false), ("forwarded", fwd(), true)] {
            let lines: Vec<Vec<u8>> = cuts
                .windows(2)
                .map(|w| {
                    hops[w[0]..w[1]]
                        .iter()
                        .map(|h| {
                            let (node, element) = write_hop(h);
                            if forwarded { element } else { node }
                        })
                        .collect::<Vec<_>>()
                        .join(",")
                        .into_bytes()
                })
                .collect();
            let headers: Vec<(&str, &[u8])> = lines.iter().map(|l| (name, l.as_slice())).collect();
            let req = request(Some("10.0.0.1:1"), &headers);
            prop_assert_eq!(
                key_of(&c, &req),
                Some(expected(&c, peer, &hops).to_string()),
                "{}: {:?}", name, lines.iter().map(|l| String::from_utf8_lossy(l)).collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn no_panic_on_any_header_bytes(
        lines in proptest::collection::vec(chainish(), 0..4),
        trusted_peer in any::<bool>(),
    ) {
        let peer = if trusted_peer { "10.0.0.1:1" } else { "192.0.2.1:1" };
        for (name, c) in [("x-forwarded-for", xff()), ("forwarded", fwd())] {
            let headers: Vec<(&str, &[u8])> = lines.iter().map(|l| (name, l.as_slice())).collect();
            let req = request(Some(peer), &headers);
            let key = key_of(&c, &req).unwrap();
            prop_assert!(key.parse::<IpAddr>().is_ok());
            let _ = key_of(&Header::new(name).unwrap(), &req);
        }
    }

    /// Whatever a client writes left of the address the trusted proxies saw, the key is
    /// that address.
    #[test]
    fn spoofed_left_most_xff_never_changes_the_key(
        client in untrusted_v4(),
        spoof in proptest::collection::vec(chainish(), 0..3),
        hops in proptest::collection::vec(any::<[u8; 3]>(), 0..4),
    ) {
        let c = xff();
        let hops: Vec<String> = hops.iter().map(|h| format!("10.{}.{}.{}", h[0], h[1], h[2])).collect();
        let honest = std::iter::once(client.to_string()).chain(hops.iter().cloned()).collect::<Vec<_>>().join(", ");
        let plain = request(Some("10.0.0.1:1"), &[("x-forwarded-for", honest.as_bytes())]);
        prop_assert_eq!(key_of(&c, &plain), Some(client.to_string()));
        // Spoofed entries in the same line, left of the client.
        for s in &spoof {
            let mut line = s.clone();
            line.extend_from_slice(b", ");
            line.extend_from_slice(honest.as_bytes());
            let req = request(Some("10.0.0.1:1"), &[("x-forwarded-for", &line)]);
            prop_assert_eq!(key_of(&c, &req), Some(client.to_string()));
            // ... or in earlier field lines.
            let req = request(Some("10.0.0.1:1"), &[("x-forwarded-for", s), ("x-forwarded-for", honest.as_bytes())]);
            prop_assert_eq!(key_of(&c, &req), Some(client.to_string()));
        }
    }

    /// The same for Forwarded: spoofed elements or earlier field lines.
    #[test]
    fn spoofed_left_most_forwarded_never_changes_the_key(
        client in untrusted_v4(),
        spoof in chainish(),
        spoofed_ip in any::<[u8; 4]>(),
    ) {
        let c = fwd();
        let honest = format!("for={client};proto=https, for=\"10.0.0.9:1234\"");
        let line = format!("for={};by=x, {honest}", IpAddr::from(spoofed_ip));
        let req = request(Some("10.0.0.1:1"), &[("forwarded", line.as_bytes())]);
        prop_assert_eq!(key_of(&c, &req), Some(client.to_string()));
        let req = request(Some("10.0.0.1:1"), &[("forwarded", &spoof), ("forwarded", honest.as_bytes())]);
        prop_assert_eq!(key_of(&c, &req), Some(client.to_string()));
        // Any bytes left of the honest elements in the same line.
        let mut line = spoof.clone();
        line.extend_from_slice(b", ");
        line.extend_from_slice(honest.as_bytes());
        let req = request(Some("10.0.0.1:1"), &[("forwarded", &line)]);
        prop_assert_eq!(key_of(&c, &req), Some(client.to_string()));
    }

    #[test]
    fn untrusted_peers_header_is_ignored(
        peer in untrusted_v4(),
        lines in proptest::collection::vec(chainish(), 0..4),
    ) {
        let addr = SocketAddr::new(peer, 443).to_string();
        for (name, c) in [("x-forwarded-for", xff()), ("forwarded", fwd())] {
            let headers: Vec<(&str, &[u8])> = lines.iter().map(|l| (name, l.as_slice())).collect();
            let req = request(Some(&addr), &headers);
            prop_assert_eq!(key_of(&c, &req), Some(peer.to_string()));
        }
    }
}

/// Corners of the proxy headers as proxies and clients write them: an IPv4-mapped hop in
/// brackets with an obfuscated port, `unknown` in any case and with a port, an obfuscated
/// name with a port, a zone written `%25`, whitespace around `,` and `;`, quoted-strings
/// holding `,` and brackets, a bracketed address with escapes; several `Forwarded` lines
/// beside an `X-Forwarded-For` (each extractor reads its own header only); a trusted
/// network given IPv4-mapped. (Coverage.)
#[test]
fn forwarded_corners_as_proxies_write_them() {
    let (x, f) = (xff(), fwd());
    let getf =
        |line: &[u8]| key_of(&f, &request(Some("10.0.0.1:1"), &[("forwarded", line)])).unwrap();
    let getx = |line: &[u8]| {
        key_of(
            &x,
            &request(Some("10.0.0.1:1"), &[("x-forwarded-for", line)]),
        )
        .unwrap()
    };
    let cases: [(&[u8], &str); 12] = [
        (
            b"for=203.0.113.9, for=\"[::ffff:10.0.0.5]:_p\"",
            "203.0.113.9",
        ),
        (b"for=203.0.113.9, for=[::ffff:10.0.0.5]", "203.0.113.9"),
        (b"for=203.0.113.9, for=UNKNOWN", "10.0.0.1"),
        (b"for=203.0.113.9, for=\"unknown:80\"", "10.0.0.1"),
        (
            b"for=203.0.113.9, for=\"_hidden:80\", for=10.0.0.3",
            "10.0.0.3",
        ),
        (
            b"for=203.0.113.9, for=\"[2001:db8:ffff::1%25eth0]:_p\"",
            "203.0.113.9",
        ),
        (
            b"for=203.0.113.9 , for=10.0.0.3 ; proto=https",
            "203.0.113.9",
        ),
        (
            b"for=\"203.0.113.9\";by=\"[2001:db8::1]\";host=\"a,b\"",
            "203.0.113.9",
        ),
        (b"for=\"[2001:db8:cafe::1]\"", "2001:db8:cafe::1"),
        (b"for=\"2001:db8:cafe::1\"", "2001:db8:cafe::1"),
        (b"FOR=203.0.113.9", "203.0.113.9"),
        (b"for=\"\\[2001:db8:cafe::1\\]:80\"", "2001:db8:cafe::1"),
    ];
    for (line, key) in cases {
        assert_eq!(getf(line), key, "{}", String::from_utf8_lossy(line));
    }
    // Several Forwarded lines, XFF ignored.
    let req = request(
        Some("10.0.0.1:1"),
        &[
            ("forwarded", b"for=198.51.100.1"),
            ("x-forwarded-for", b"192.0.2.99"),
            ("forwarded", b"for=10.0.0.4, for=\"[::ffff:10.0.0.3]\""),
        ],
    );
    assert_eq!(key_of(&f, &req).as_deref(), Some("198.51.100.1"));
    assert_eq!(key_of(&x, &req).as_deref(), Some("192.0.2.99"));
    assert_eq!(getx(b"203.0.113.9, [::ffff:10.0.0.5]:_p"), "203.0.113.9");
    assert_eq!(getx(b"203.0.113.9,::ffff:a00:5"), "203.0.113.9");
    // Mapped trusted net.
    let m = ClientIp::builder(ForwardedHeader::XForwardedFor)
        .trust("::ffff:10.0.0.0/104")
        .build()
        .unwrap();
    assert_eq!(
        key_of(
            &m,
            &request(Some("10.1.1.1:1"), &[("x-forwarded-for", b"203.0.113.9")])
        )
        .as_deref(),
        Some("203.0.113.9")
    );
    assert_eq!(m.trusted()[0].to_string(), "10.0.0.0/8");
}

/// A parameter value as RFC 7239 allows it: a token, or a quoted-string of any visible
/// ASCII and spaces (`,` `;` `=` among them), `"` and `\` escaped and other bytes escaped
/// now and then (`\x` is `x`).
fn param_value() -> impl Strategy<Value = String> {
    let token = proptest::collection::vec(
        proptest::sample::select(
            b"abcXYZ019!#$%&'*+-.^_`|~"
                .iter()
                .map(|&b| char::from(b))
                .collect::<Vec<_>>(),
        ),
        1..8,
    )
    .prop_map(|v| v.into_iter().collect::<String>());
    let quoted = proptest::collection::vec(
        prop_oneof![
            4 => proptest::char::range(' ', '~'),
            1 => proptest::sample::select(vec!['"', '\\', ',', ';', '=']),
        ],
        0..10,
    )
    .prop_map(|v| {
        let mut q = String::from("\"");
        for c in v {
            if matches!(c, '"' | '\\' | 'x') {
                q.push('\\');
            }
            q.push(c);
        }
        q.push('"');
        q
    });
    prop_oneof![token, quoted]
}

/// Other parameters of one element, before or after its `for`.
fn params() -> impl Strategy<Value = Vec<String>> {
    proptest::collection::vec(
        (
            proptest::sample::select(vec!["by", "host", "proto", "ext", "BY"]),
            param_value(),
        )
            .prop_map(|(name, value)| format!("{name}={value}")),
        0..3,
    )
}

proptest! {
    /// Well-formed `Forwarded` elements whose other parameters are quoted-strings holding
    /// `,` `;` `=`, escaped quotes and backslashes: read from the right, each element's
    /// `for` is found whole, so the key is the documented one (the first untrusted hop
    /// from the right; every hop trusted: the left-most). (Coverage; passes.)
    #[test]
    fn forwarded_elements_with_quoted_parameters_give_the_documented_key(
        elements in proptest::collection::vec(
            (
                prop_oneof![
                    any::<[u8; 3]>().prop_map(|o| IpAddr::from([10, o[0], o[1], o[2]])),
                    untrusted_v4(),
                ],
                any::<bool>(),
                params(),
                params(),
            ),
            1..6,
        ),
    ) {
        let line = elements
            .iter()
            .map(|(ip, quoted, before, after)| {
                let node = if *quoted { format!("for=\"{ip}\"") } else { format!("for={ip}") };
                let mut pairs = before.clone();
                pairs.push(node);
                pairs.extend(after.iter().cloned());
                pairs.join(";")
            })
            .collect::<Vec<_>>()
            .join(", ");
        let c = fwd();
        let mut expected = elements[0].0;
        for (ip, ..) in elements.iter().rev() {
            if !c.is_trusted(*ip) {
                expected = *ip;
                break;
            }
        }
        let req = request(Some("10.0.0.1:1"), &[("forwarded", line.as_bytes())]);
        prop_assert_eq!(key_of(&c, &req), Some(expected.to_string()), "{}", line);
    }
}

/// A port is one to five digits, as RFC 7239's ABNF has it (`port = 1*5DIGIT`), its value
/// unchecked: `:99999` is a port (ignored), six digits are not (the walk stops at the
/// nearest trusted hop). Not a fault: a port never goes into a key, and the walk reads an
/// entry only when the trusted proxy right of it wrote it, so a client writing an
/// out-of-range port gains nothing.
#[test]
fn a_port_is_up_to_five_digits_its_value_unchecked() {
    let c = xff();
    let f = fwd();
    let get = |c: &ClientIp, name: &str, line: &[u8]| {
        key_of(c, &request(Some("10.0.0.1:1"), &[(name, line)])).unwrap()
    };
    for line in [
        &b"203.0.113.9:99999, 10.0.0.2:65536"[..],
        b"[2001:db8::9]:00080, 203.0.113.9:0",
    ] {
        assert_eq!(get(&c, "x-forwarded-for", line), "203.0.113.9");
    }
    assert_eq!(
        get(&c, "x-forwarded-for", b"203.0.113.9:123456, 10.0.0.2"),
        "10.0.0.2"
    );
    assert_eq!(
        get(
            &f,
            "forwarded",
            br#"for="203.0.113.9:99999", for="[2001:db8:ffff::1]:70000""#
        ),
        "203.0.113.9"
    );
    assert_eq!(
        get(
            &f,
            "forwarded",
            br#"for="203.0.113.9:100000", for=10.0.0.2"#
        ),
        "10.0.0.2"
    );
    // A spoofed entry left of the client, whatever its port, is never read.
    assert_eq!(
        get(
            &c,
            "x-forwarded-for",
            b"10.0.0.9:99999, 203.0.113.9, 10.0.0.2"
        ),
        "203.0.113.9"
    );
}
