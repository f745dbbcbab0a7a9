//! `ClientIp` on long proxy chains: the walk reads from the right and stops where the
//! rules say, without an allocation per request, whatever a client wrote to the left.

use std::net::SocketAddr;

use flowgate::http::{ClientIp, ForwardedHeader, KeyExtractor, RequestInfo};

use crate::alloc::allocations;

/// The key `extractor` gives a request from the trusted `10.0.0.1` with `lines` of
/// `header`, and the allocations the extraction made.
fn key_and_allocations(
    extractor: &ClientIp,
    header: &'static str,
    lines: &[&str],
) -> (String, u64) {
    let mut req = http::Request::new(());
    req.extensions_mut()
        .insert("10.0.0.1:40000".parse::<SocketAddr>().unwrap());
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
