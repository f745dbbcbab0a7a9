//! `ClientIp`: the client's address behind trusted proxies, read from one proxy header
//! (`X-Forwarded-For` or `Forwarded`), and the parsers of those headers.

use std::fmt;
use std::net::{IpAddr, Ipv6Addr};
use std::ops::ControlFlow;
use std::sync::Arc;

use http::HeaderMap;
use http::header::{FORWARDED, HeaderName};
use ipnet::{IpNet, Ipv6Net};

use crate::error::{ConfigError, ConfigErrorKind};
use crate::http::key::{KeyExtractor, PeerIp, RequestInfo, write_ip};
use crate::http::warn_once::WarnOnce;

/// The one header a [`ClientIp`] reads the proxy chain from.
///
/// Exactly one: a client can write either header itself, and a proxy rewrites at most the
/// one it is configured for, so reading both would let a client inject through the other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ForwardedHeader {
    /// `X-Forwarded-For: client, proxy1, proxy2` (de facto standard): comma-separated
    /// addresses, optionally `ip:port`, `[ipv6]:port` or with an IPv6 zone id
    /// (`fe80::1%eth0`).
    XForwardedFor,
    /// `Forwarded: for=192.0.2.60;proto=http, for="[2001:db8::1]:4711"` (RFC 7239): the
    /// `for` parameter of each element.
    Forwarded,
}

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

/// The key is the IP address of the client behind trusted proxies: the proxy chain in one
/// header is believed only as far as it was written by proxies you trust.
///
/// Built with the trusted proxies' networks (CIDRs such as `10.0.0.0/8`, or single
/// addresses) and one [`ForwardedHeader`]. For each request:
///
/// 1. The peer (the connection's address, read like [`PeerIp`]) is not trusted: the key is
///    the peer, and the header is ignored (anyone can write it).
/// 2. Else the header's entries are walked from the right (the last field line's last entry
///    is the nearest hop), skipping trusted addresses; the first untrusted address is the
///    client. Entries left of it were written by the client or by untrusted hops and are
///    never read: a spoofed left-most entry cannot change the key.
/// 3. An entry that is not an address (`unknown`, an obfuscated `_name`, a missing or
///    repeated `for`, text that does not parse, bytes outside ASCII, `Forwarded` syntax
///    that breaks) stops the walk: the key is the nearest trusted hop to its right (the
///    last address known to be true). Each line is read from the right, entry by entry, so
///    whatever a client writes left of the entries the proxies appended (stray bytes, an
///    unterminated quote) is never reached: nothing left of where the walk stops is parsed,
///    and the walk allocates nothing, however many entries a header holds.
/// 4. Every hop is trusted: the key is the left-most address (the only case the left-most
///    entry is used). A trusted peer that sends no such header at all is the client: its
///    own address is the key. The first such request this extractor (or a clone of it)
///    meets is logged (a `tracing` warning): when it is every request, the proxy writes the
///    other header, or none, and all its clients share one key (the proxy's own requests,
///    such as health checks, come without one too).
///
/// Addresses are compared and written canonical ([`IpAddr::to_canonical`]): an IPv4
/// address written IPv4-mapped (`::ffff:10.0.0.1`, as a dual-stack listener reports its
/// IPv4 peers and some proxies write them) is that IPv4 address, for trust and for the key.
/// So a proxy at `10.0.0.1` reaching a dual-stack listener is in `10.0.0.0/8`; an IPv4
/// client is in no IPv6 network (`::/0` is every IPv6 address, not every address: trust
/// `0.0.0.0/0` too for that); and one client has one key whichever listener it reaches
/// and however a proxy writes it. A trusted network given as IPv4-mapped IPv6
/// (`::ffff:10.0.0.0/104`) is matched as its IPv4 form.
///
/// Ports (`192.0.2.1:4711`, `[2001:db8::1]:4711`, an obfuscated `_port`) are accepted and
/// ignored, and so is an IPv6 zone id (`fe80::1%eth0`, `[fe80::1%2]:4711`: proxies that
/// write a link-local peer's socket address write it so; the zone names an interface of
/// the proxy's host, not the client). A port is one to five digits, as RFC 7239 writes it
/// (`1*5DIGIT`), its value unchecked (`:99999` is ignored as any port is): a port is never
/// part of a key, and an entry is read only when a trusted proxy wrote it. Empty list
/// elements are skipped (RFC 9110 §5.6.1).
/// The number of hops has no limit of its own: the walk stops at the first untrusted
/// address, so it reads no further left than the trusted proxies wrote (unless every hop
/// is trusted), and its cost is the bytes it reads, without an allocation.
///
/// A request without a peer address has no key (see [`MissingKey`](super::MissingKey)).
///
/// # Examples
///
/// ```
/// use std::net::SocketAddr;
/// use flowgate::http::{ClientIp, ForwardedHeader, KeyExtractor, RequestInfo};
///
/// let client_ip = ClientIp::builder(ForwardedHeader::XForwardedFor)
///     .trust("10.0.0.0/8")
///     .build()?;
///
/// let mut req = http::Request::new(());
/// req.extensions_mut().insert("10.0.0.2:40000".parse::<SocketAddr>()?);
/// // The client wrote "6.6.6.6"; the proxy at 10.0.0.1 appended the address it saw.
/// req.headers_mut().insert("x-forwarded-for", "6.6.6.6, 203.0.113.9, 10.0.0.1".parse()?);
/// let mut key = String::new();
/// assert!(client_ip.extract(&RequestInfo::of(&req), &mut key));
/// assert_eq!(key, "203.0.113.9");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct ClientIp {
    peer: PeerIp,
    trusted: Arc<[IpNet]>,
    source: ForwardedHeader,
    ipv6_per_64: bool,
    /// Whether this extractor (or a clone of it) has said a trusted peer sent no header.
    warned: WarnOnce,
}

impl ClientIp {
    /// A builder reading the proxy chain from `source`; add the trusted proxies with
    /// [`trust`](ClientIpBuilder::trust).
    pub fn builder(source: ForwardedHeader) -> ClientIpBuilder {
        ClientIpBuilder {
            source,
            peer: PeerIp::new(),
            trusted: Vec::new(),
            error: None,
            ipv6_per_64: false,
        }
    }

    /// The header the proxy chain is read from.
    #[must_use]
    pub fn source(&self) -> ForwardedHeader {
        self.source
    }

    /// The trusted proxies' networks.
    #[must_use]
    pub fn trusted(&self) -> &[IpNet] {
        &self.trusted
    }

    /// The client's address (the rules are in the type's docs); `None` without a peer
    /// address.
    #[must_use]
    pub fn client(&self, req: &RequestInfo<'_>) -> Option<IpAddr> {
        let peer = self.peer.peer(req)?;
        Some(self.resolve(req.headers, peer))
    }

    fn is_trusted(&self, ip: IpAddr) -> bool {
        self.trusted.iter().any(|net| net.contains(&ip))
    }

    fn resolve(&self, headers: &HeaderMap, peer: IpAddr) -> IpAddr {
        if !self.is_trusted(peer) {
            return peer;
        }
        // The nearest hop known to be true: where a bad entry stops the walk.
        let mut nearest = peer;
        // Whether the header was there (a local: no second look-up for it).
        let mut sent = false;
        match self.source {
            ForwardedHeader::XForwardedFor => {
                for line in headers.get_all(&X_FORWARDED_FOR).iter().rev() {
                    sent = true;
                    for entry in line.as_bytes().rsplit(|&b| b == b',') {
                        let entry = entry.trim_ascii();
                        if entry.is_empty() {
                            continue;
                        }
                        match parse_node(entry) {
                            Some(ip) if self.is_trusted(ip) => nearest = ip,
                            Some(ip) => return ip,
                            None => return nearest,
                        }
                    }
                }
            }
            ForwardedHeader::Forwarded => {
                for line in headers.get_all(FORWARDED).iter().rev() {
                    sent = true;
                    // Element by element: the walk stops parsing where it stops.
                    let walked = parse_forwarded_rev(line.as_bytes(), |node| match node {
                        Some(ip) if self.is_trusted(ip) => {
                            nearest = ip;
                            ControlFlow::Continue(())
                        }
                        Some(ip) => ControlFlow::Break(ip),
                        None => ControlFlow::Break(nearest),
                    });
                    if let ControlFlow::Break(ip) = walked {
                        return ip;
                    }
                }
            }
        }
        if !sent && self.warned.first() {
            warn_no_header(self.source, peer);
        }
        nearest
    }
}

/// Say that the trusted proxy `peer` sent a request without the `source` header: its key is
/// the proxy's own address.
fn warn_no_header(source: ForwardedHeader, peer: IpAddr) {
    let (header, other) = match source {
        ForwardedHeader::XForwardedFor => ("X-Forwarded-For", "Forwarded"),
        ForwardedHeader::Forwarded => ("Forwarded", "X-Forwarded-For"),
    };
    tracing::warn!(
        header,
        %peer,
        "rate limit key: a request from a trusted proxy has no {header} field, so its key \
         is the proxy's own address; if the proxy's requests all come so, it writes \
         another header ({other}?) or none, and every client behind it shares one key: \
         read the header it writes (ClientIp::builder), or have it write {header} (its own \
         requests, such as health checks, come without one too)"
    );
}

impl fmt::Debug for ClientIp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientIp")
            .field("source", &self.source)
            .field("trusted", &self.trusted)
            .field("peer", &self.peer)
            .field("ipv6_per_64", &self.ipv6_per_64)
            .finish()
    }
}

impl KeyExtractor for ClientIp {
    fn extract(&self, req: &RequestInfo<'_>, key: &mut String) -> bool {
        match self.client(req) {
            Some(ip) => {
                write_ip(key, ip, self.ipv6_per_64);
                true
            }
            None => false,
        }
    }
}

/// Builds a [`ClientIp`]; see [`ClientIp::builder`].
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `build` is called"]
pub struct ClientIpBuilder {
    source: ForwardedHeader,
    peer: PeerIp,
    trusted: Vec<IpNet>,
    error: Option<ConfigError>,
    ipv6_per_64: bool,
}

impl ClientIpBuilder {
    /// Trust the proxies in `cidr`: a network (`10.0.0.0/8`, `2001:db8::/32`) or one
    /// address (`192.0.2.1`). Host bits are ignored (`10.1.2.3/8` is `10.0.0.0/8`). An IPv6
    /// zone id (`fe80::1%eth0`, `fe80::%eth0/64`) is dropped, as it is from the peer's
    /// address and the header's entries. Text that is neither fails [`build`](Self::build).
    ///
    /// An IPv4 network also holds its proxies when a dual-stack listener reports them
    /// IPv4-mapped (`::ffff:10.0.0.1`); an IPv6 network never holds an IPv4 address, not
    /// even `::/0` (see [`ClientIp`]).
    ///
    /// Every host of a trusted network is trusted as a proxy: one in it that is not a proxy
    /// (an internal service calling the app directly) can write any `X-Forwarded-For` and
    /// be charged under any client's key. Trust the proxies' own addresses, or the
    /// narrowest network that holds only proxies: `0.0.0.0/0` (or `::/0`) makes every
    /// IPv4 (IPv6) client a proxy, so the key is whatever such a client writes left-most.
    pub fn trust(mut self, cidr: impl AsRef<str>) -> ClientIpBuilder {
        let text = cidr.as_ref().trim();
        match parse_trusted(text) {
            Some(net) => self.trusted.push(canonical_net(net)),
            None => {
                self.error.get_or_insert_with(|| {
                    ConfigError::new(
                        "client_ip.trusted",
                        ConfigErrorKind::Inconsistent,
                        format!("{text:?} is neither a CIDR network nor an IP address"),
                    )
                });
            }
        }
        self
    }

    /// Trust the proxies in `net`.
    pub fn trust_net(mut self, net: IpNet) -> ClientIpBuilder {
        self.trusted.push(canonical_net(net));
        self
    }

    /// Read the peer address as `peer` does (default [`PeerIp::new`]: a
    /// [`SocketAddr`](std::net::SocketAddr) extension); `peer`'s own `/64` setting is not
    /// used (see [`ipv6_per_64`](Self::ipv6_per_64)).
    pub fn peer(mut self, peer: PeerIp) -> ClientIpBuilder {
        self.peer = peer;
        self
    }

    /// Count IPv6 clients per `/64` network instead of per address (default `false`).
    pub fn ipv6_per_64(mut self, per_64: bool) -> ClientIpBuilder {
        self.ipv6_per_64 = per_64;
        self
    }

    /// The extractor.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] (field `client_ip.trusted`) when a [`trust`](Self::trust) text is
    /// not a network or an address, or when no proxy is trusted (then the header would
    /// never be read: use [`PeerIp`]).
    pub fn build(self) -> Result<ClientIp, ConfigError> {
        if let Some(error) = self.error {
            return Err(error);
        }
        if self.trusted.is_empty() {
            return Err(ConfigError::new(
                "client_ip.trusted",
                ConfigErrorKind::Zero,
                "at least one trusted proxy is needed (with none, use PeerIp)",
            ));
        }
        Ok(ClientIp {
            peer: self.peer,
            trusted: self.trusted.into(),
            source: self.source,
            ipv6_per_64: self.ipv6_per_64,
            warned: WarnOnce::default(),
        })
    }
}

/// A trusted network or address as [`ClientIpBuilder::trust`] takes it: an IPv6 one may
/// carry a zone id (`fe80::1%eth0`, `fe80::%eth0/64` as RFC 4007 §11.7 writes a prefix),
/// dropped as [`parse_ipv6`] drops it.
fn parse_trusted(text: &str) -> Option<IpNet> {
    if let Ok(net) = text.parse::<IpNet>() {
        return Some(net);
    }
    if let Ok(ip) = text.parse::<IpAddr>() {
        return Some(IpNet::from(ip));
    }
    let (addr, len) = match text.split_once('/') {
        Some((addr, len)) => (addr, Some(len)),
        None => (text, None),
    };
    if !addr.contains('%') {
        return None;
    }
    let ip = parse_ipv6(addr)?;
    match len {
        None => Some(IpNet::from(IpAddr::V6(ip))),
        Some(len) if !len.is_empty() && len.bytes().all(|b| b.is_ascii_digit()) => {
            Ipv6Net::new(ip, len.parse().ok()?).ok().map(IpNet::V6)
        }
        Some(_) => None,
    }
}

/// `net` without host bits; an IPv4-mapped IPv6 network as its IPv4 form (addresses are
/// compared canonical).
fn canonical_net(net: IpNet) -> IpNet {
    if let IpNet::V6(v6) = net
        && v6.prefix_len() >= 96
        && let IpAddr::V4(v4) = IpAddr::V6(v6.network()).to_canonical()
        && let Ok(v4net) = ipnet::Ipv4Net::new(v4, v6.prefix_len() - 96)
    {
        return IpNet::V4(v4net.trunc());
    }
    net.trunc()
}

/// One node (`for` value or X-Forwarded-For entry): an address, optionally with a port,
/// an IPv6 one optionally with a zone id; `None` for `unknown`, an obfuscated name or
/// anything that does not parse.
fn parse_node(node: &[u8]) -> Option<IpAddr> {
    let text = std::str::from_utf8(node).ok()?;
    if let Ok(ip) = text.parse::<IpAddr>() {
        return Some(ip.to_canonical());
    }
    let (host, port) = if let Some(rest) = text.strip_prefix('[') {
        let (host, after) = rest.split_once(']')?;
        let ip = parse_ipv6(host)?;
        match after {
            "" => return Some(IpAddr::V6(ip).to_canonical()),
            after => (IpAddr::V6(ip), after.strip_prefix(':')?),
        }
    } else if text.contains('%') {
        // A bare IPv6 address with a zone id (a port would need brackets).
        return parse_ipv6(text).map(|ip| IpAddr::V6(ip).to_canonical());
    } else {
        let (host, port) = text.rsplit_once(':')?;
        (IpAddr::V4(host.parse().ok()?), port)
    };
    let port_ok = if let Some(obfuscated) = port.strip_prefix('_') {
        !obfuscated.is_empty()
            && obfuscated
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
    } else {
        (1..=5).contains(&port.len()) && port.bytes().all(|b| b.is_ascii_digit())
    };
    port_ok.then(|| host.to_canonical())
}

/// An IPv6 address, optionally with a zone id (`fe80::1%eth0`, RFC 4007 §11; `%25eth0` as
/// RFC 6874 writes it in a URI), which is dropped: it names an interface of the host that
/// wrote it, not a part of the address. A zone is one or more unreserved characters
/// (letters, digits, `-` `.` `_` `~`).
fn parse_ipv6(text: &str) -> Option<Ipv6Addr> {
    let Some((addr, zone)) = text.split_once('%') else {
        return text.parse().ok();
    };
    let zone_ok = !zone.is_empty()
        && zone
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~'));
    if zone_ok { addr.parse().ok() } else { None }
}

/// The `for` node of each element of one `Forwarded` field line (RFC 7239 §4), read from
/// the right and handed to `visit` right-most first: the address, or `None` for an element
/// whose `for` is missing, repeated, `unknown`, obfuscated or not an address. Where the
/// syntax breaks, a last `None` is handed over and reading stops. Reading also stops, and
/// the break is returned, as soon as `visit` breaks: elements left of it are never parsed.
///
/// Reading from the right means the elements proxies appended are read whatever a client
/// wrote to their left (an unterminated quote, stray bytes). Elements are split on `,` and
/// pairs on `;` outside quoted-strings; a quoted `for` value is unescaped (`\x` is `x`,
/// on the stack: see [`parse_escaped_node`]), other values are only checked; parameter
/// names are case-insensitive; an unquoted value runs to the next `,` `;` `=` `"`
/// or whitespace (leniently: RFC 7239 needs quotes around `:` and `[`, which some proxies
/// leave out). Empty elements (nothing but whitespace) are skipped; an element of bare `;`
/// has no `for`.
fn parse_forwarded_rev<B>(
    line: &[u8],
    mut visit: impl FnMut(Option<IpAddr>) -> ControlFlow<B>,
) -> ControlFlow<B> {
    let b = line;
    let mut end = b.len();
    let last = |end: usize| end.checked_sub(1).map(|i| b[i]);
    let skip_ows = |end: &mut usize| {
        while matches!(last(*end), Some(b' ' | b'\t')) {
            *end -= 1;
        }
    };
    loop {
        // One element: pairs separated by ';', right to left.
        let mut node: Option<Option<IpAddr>> = None;
        let mut repeated = false;
        let mut pairs = 0usize;
        // Whether the element holds anything but whitespace (`;` alone is an element).
        let mut written = false;
        loop {
            skip_ows(&mut end);
            match last(end) {
                None | Some(b',') => break,
                Some(b';') => {
                    written = true;
                    end -= 1;
                    continue;
                }
                _ => {}
            }
            let quoted = last(end) == Some(b'"');
            // The value as written; a quoted one is unescaped only when it is the `for`.
            let (value, escaped): (&[u8], bool) = if quoted {
                let close = end - 1;
                // The opening quote: the first '"' to the left not escaped by an odd run of
                // backslashes.
                let mut j = close;
                let open = loop {
                    if j == 0 {
                        return visit(None);
                    }
                    j -= 1;
                    if b[j] == b'"' {
                        let slashes = b[..j].iter().rev().take_while(|&&c| c == b'\\').count();
                        if slashes % 2 == 0 {
                            break j;
                        }
                    }
                };
                end = open;
                let raw = &b[open + 1..close];
                // A backslash escapes the next byte: an odd run of them at the end has
                // nothing left to escape (the closing quote was escaped).
                if raw.iter().rev().take_while(|&&c| c == b'\\').count() % 2 == 1 {
                    return visit(None);
                }
                (raw, raw.contains(&b'\\'))
            } else {
                let stop = end;
                while !matches!(
                    last(end),
                    None | Some(b',' | b';' | b'"' | b'=' | b' ' | b'\t')
                ) {
                    end -= 1;
                }
                (&b[end..stop], false)
            };
            if (value.is_empty() && !quoted) || last(end) != Some(b'=') {
                return visit(None);
            }
            end -= 1;
            let name_end = end;
            while last(end).is_some_and(is_tchar) {
                end -= 1;
            }
            if end == name_end {
                return visit(None);
            }
            pairs += 1;
            if b[end..name_end].eq_ignore_ascii_case(b"for") {
                repeated |= node.is_some();
                node = Some(if escaped {
                    parse_escaped_node(value)
                } else {
                    parse_forwarded_node(value)
                });
            }
            skip_ows(&mut end);
            match last(end) {
                Some(b';') => end -= 1,
                None | Some(b',') => break,
                Some(_) => {
                    return visit(None);
                }
            }
        }
        if (pairs > 0 || written)
            && let ControlFlow::Break(b) = visit(if repeated { None } else { node.flatten() })
        {
            return ControlFlow::Break(b);
        }
        match last(end) {
            Some(b',') => end -= 1,
            _ => return ControlFlow::Continue(()),
        }
    }
}

/// A `for` value: `unknown` and obfuscated names (`_hidden`) are not addresses.
fn parse_forwarded_node(value: &[u8]) -> Option<IpAddr> {
    if value.eq_ignore_ascii_case(b"unknown") || value.first() == Some(&b'_') {
        return None;
    }
    parse_node(value)
}

/// The most bytes of an escaped `for` value, unescaped: far more than any address takes
/// written with a port and a zone id (`[` 45 `%` zone `]:` port).
const MAX_ESCAPED_NODE: usize = 128;

/// A quoted `for` value with backslash escapes (well-formed: none at the end alone),
/// unescaped on the stack (`\x` is `x`): one longer than [`MAX_ESCAPED_NODE`] unescaped is
/// not an address.
fn parse_escaped_node(raw: &[u8]) -> Option<IpAddr> {
    let mut buf = [0u8; MAX_ESCAPED_NODE];
    let mut len = 0;
    let mut bytes = raw.iter();
    while let Some(&c) = bytes.next() {
        let c = if c == b'\\' { *bytes.next()? } else { c };
        *buf.get_mut(len)? = c;
        len += 1;
    }
    parse_forwarded_node(&buf[..len])
}

/// RFC 9110 `tchar`.
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

#[cfg(test)]
mod tests;
