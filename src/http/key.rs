//! `KeyExtractor`: what a request is counted under, and the built-in extractors.

use std::fmt::{self, Write as _};
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use http::header::HeaderName;
use http::{Extensions, HeaderMap, Method, Uri};

use crate::error::{ConfigError, ConfigErrorKind};
use crate::http::warn_once::WarnOnce;

/// The parts of a request a [`KeyExtractor`] or a classifier reads (everything but the body).
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct RequestInfo<'a> {
    /// The request method.
    pub method: &'a Method,
    /// The request target.
    pub uri: &'a Uri,
    /// The request's header fields.
    pub headers: &'a HeaderMap,
    /// The request's extensions (the peer address lives here).
    pub extensions: &'a Extensions,
}

impl<'a> RequestInfo<'a> {
    /// The parts of `req`.
    pub fn of<B>(req: &'a http::Request<B>) -> RequestInfo<'a> {
        RequestInfo {
            method: req.method(),
            uri: req.uri(),
            headers: req.headers(),
            extensions: req.extensions(),
        }
    }
}

/// What a request is counted under for one policy: an IP, an API key, a tenant.
///
/// `extract` appends the key to `key` (which the layer reuses between requests, so a key
/// costs no allocation) and returns `false` when the request has no key for this policy
/// (no peer address, a missing header); what such a request gets is the policy's
/// [`MissingKey`] choice. An empty key is no key: a request for which `extract` returns
/// `true` without writing anything gets the `MissingKey` choice too. No key is the keyless
/// bucket's: under [`MissingKey::Shared`], a key equal to the shared key (or beginning with
/// `\`) is counted with a `\` before it.
///
/// Any `Fn(&RequestInfo<'_>, &mut String) -> bool + Send + Sync + 'static` is an extractor.
pub trait KeyExtractor: Send + Sync + 'static {
    /// Append this request's key to `key`; `false` when it has none.
    fn extract(&self, req: &RequestInfo<'_>, key: &mut String) -> bool;

    /// Why `req` has no key, for the client: the end of the `detail` of the `400 Bad
    /// Request` that a [`MissingKey::Refuse`] policy answers (`the request has no key for
    /// the policy "per-key": <this>`). Called only then, after [`extract`](Self::extract)
    /// found no key (so it may allocate). The client reads it: say what is wrong with what
    /// it sent, not the value itself (it may be a secret) nor how the server is set up.
    ///
    /// The default, `None`, says nothing more; [`Header`] names its header and what is
    /// wrong with its value (missing, empty, longer than its `max_len`, bytes a key cannot
    /// hold).
    fn missing_reason(&self, req: &RequestInfo<'_>) -> Option<String> {
        let _ = req;
        None
    }
}

impl<F> KeyExtractor for F
where
    F: Fn(&RequestInfo<'_>, &mut String) -> bool + Send + Sync + 'static,
{
    fn extract(&self, req: &RequestInfo<'_>, key: &mut String) -> bool {
        self(req, key)
    }
}

/// What a request without a key (see [`KeyExtractor`]) gets from a policy.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum MissingKey {
    /// All keyless requests share one bucket under this key (the default, `"-"`): they are
    /// limited together, never let through unlimited. The gate key it makes,
    /// `<key prefix><policy name>:<key>`, must fit in 512 bytes, and the key must not begin
    /// with `\` (both checked when the layer is built).
    ///
    /// No request can join this bucket by sending its key: a key a request has that equals
    /// it, or begins with `\`, is counted with a `\` before it (`x-api-key: -` under
    /// `"-"` counts under `<key prefix><policy name>:\-`, its own bucket, as the gate,
    /// `top_rejected` and the logs show it). Every other key is counted as written.
    ///
    /// The escape is each policy's own: layers that count one policy name under one key
    /// prefix on one gate (sharing its buckets on purpose) must give it the same
    /// `MissingKey`, or a request through a layer whose policy has another choice (`Skip`,
    /// `Refuse`, another shared key) and whose key is this one joins this bucket.
    Shared(String),
    /// The policy does not apply to the request.
    Skip,
    /// The request is refused with `400 Bad Request`; the problem body's `detail` names the
    /// policy and, where the extractor can say ([`KeyExtractor::missing_reason`]), what is
    /// wrong with the request.
    Refuse,
}

/// Written before a request's key that is its policy's [`MissingKey::Shared`] key or begins
/// with this escape itself: so no request's key is the keyless bucket's key, and two keys
/// stay two keys.
pub(crate) const SHARED_ESCAPE: char = '\\';

impl Default for MissingKey {
    fn default() -> MissingKey {
        MissingKey::Shared("-".to_owned())
    }
}

/// Reads the peer's socket address from a request's extensions.
type ReadPeer = Arc<dyn Fn(&Extensions) -> Option<SocketAddr> + Send + Sync>;

/// Write `ip` to `key`: the address itself, or its `/64` network when `per_64` and IPv6.
pub(crate) fn write_ip(key: &mut String, ip: IpAddr, per_64: bool) {
    // Writing to a String never fails.
    let _ = match ip {
        IpAddr::V6(v6) if per_64 => {
            let network = Ipv6Addr::from_bits(v6.to_bits() & (u128::MAX << 64));
            write!(key, "{network}/64")
        }
        ip => write!(key, "{ip}"),
    };
}

/// The key is the IP address of the connection's peer: the client itself when nothing
/// stands in between, else the nearest proxy (see [`ClientIp`](super::ClientIp) for
/// clients behind proxies).
///
/// The peer comes from the request's extensions: by default a [`SocketAddr`] extension
/// (insert it per connection with a bare hyper server), or any type the server puts there
/// through [`from_extension`](Self::from_extension) (axum's `ConnectInfo<SocketAddr>`). The
/// address is normalised with [`IpAddr::to_canonical`], so an IPv4 client of a dual-stack
/// listener (`::ffff:192.0.2.1`) has the same key as on an IPv4 listener (`192.0.2.1`),
/// and is never grouped as IPv6 (as `::/64`, one bucket for every IPv4 client). With [`ipv6_per_64`](Self::ipv6_per_64), IPv6 peers are counted per `/64` network (one
/// host usually holds a whole /64, so per-address keys are easy to multiply); the key is
/// then the network, e.g. `2001:db8:1:2::/64`.
///
/// A request without the extension has no key (see [`MissingKey`]).
///
/// # Examples
///
/// ```
/// use std::net::SocketAddr;
/// use flowgate::http::{KeyExtractor, PeerIp, RequestInfo};
///
/// let mut req = http::Request::new(());
/// req.extensions_mut().insert("[::ffff:192.0.2.7]:5000".parse::<SocketAddr>()?);
/// let mut key = String::new();
/// assert!(PeerIp::new().extract(&RequestInfo::of(&req), &mut key));
/// assert_eq!(key, "192.0.2.7");
///
/// // axum: PeerIp::from_extension(|c: &ConnectInfo<SocketAddr>| c.0)
/// #[derive(Clone)]
/// struct Conn(SocketAddr);
/// let peer = PeerIp::from_extension(|c: &Conn| c.0);
/// assert!(!peer.extract(&RequestInfo::of(&req), &mut key)); // no `Conn` extension
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct PeerIp {
    read: ReadPeer,
    source: &'static str,
    ipv6_per_64: bool,
    /// Whether this extractor (or a clone of it) has said it found no address.
    warned: WarnOnce,
}

impl PeerIp {
    /// The peer from a [`SocketAddr`] extension.
    #[must_use]
    pub fn new() -> PeerIp {
        PeerIp::from_extension(|addr: &SocketAddr| *addr)
    }

    /// The peer from an extension of type `T`, read with `get`; for axum,
    /// `PeerIp::from_extension(|c: &ConnectInfo<SocketAddr>| c.0)` (with
    /// `into_make_service_with_connect_info::<SocketAddr>()`).
    #[must_use]
    pub fn from_extension<T: Send + Sync + 'static>(get: fn(&T) -> SocketAddr) -> PeerIp {
        PeerIp {
            read: Arc::new(move |ext: &Extensions| ext.get::<T>().map(get)),
            source: std::any::type_name::<T>(),
            ipv6_per_64: false,
            warned: WarnOnce::default(),
        }
    }

    /// Count IPv6 peers per `/64` network instead of per address (default `false`).
    #[must_use]
    pub fn ipv6_per_64(mut self, per_64: bool) -> PeerIp {
        self.ipv6_per_64 = per_64;
        self
    }

    /// The peer's address, canonical (`::ffff:a.b.c.d` becomes `a.b.c.d`); `None` without
    /// the extension (the first time for this extractor and its clones, a warning is
    /// logged: the server is not recording the connection's address where this extractor
    /// reads it, so such requests fall to the policy's [`MissingKey`]).
    #[must_use]
    pub fn peer(&self, req: &RequestInfo<'_>) -> Option<IpAddr> {
        let peer = (self.read)(req.extensions).map(|addr| addr.ip().to_canonical());
        if peer.is_none() && self.warned.first() {
            warn_no_peer(self.source);
        }
        peer
    }
}

impl Default for PeerIp {
    fn default() -> PeerIp {
        PeerIp::new()
    }
}

impl fmt::Debug for PeerIp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PeerIp")
            .field("extension", &self.source)
            .field("ipv6_per_64", &self.ipv6_per_64)
            .finish()
    }
}

impl KeyExtractor for PeerIp {
    fn extract(&self, req: &RequestInfo<'_>, key: &mut String) -> bool {
        match self.peer(req) {
            Some(ip) => {
                write_ip(key, ip, self.ipv6_per_64);
                true
            }
            None => false,
        }
    }
}

/// Say that a request came without the connection's address where the extractor reads it
/// (an extension of type `source`): the server was not set up to record it there, so every
/// request falls to the policy's [`MissingKey`] choice (by default one bucket for the
/// whole site). Under axum, served with the connect info, the address is in a
/// `ConnectInfo<SocketAddr>`, which only `PeerIp::from_extension` reads.
fn warn_no_peer(source: &'static str) {
    tracing::warn!(
        extension = source,
        "rate limit key: a request has no peer address in the extension the key is read \
         from; requests without one fall to the policy's MissingKey choice (under axum, \
         serve with into_make_service_with_connect_info::<SocketAddr>() and read the \
         address with PeerIp::from_extension(|c: &ConnectInfo<SocketAddr>| c.0), also as \
         ClientIp's peer; on a bare hyper server, insert the connection's SocketAddr in \
         each request's extensions)"
    );
}

/// The key is the value of one request header: an API key, a user or tenant id.
///
/// A request has no key (see [`MissingKey`]) when the header is missing, empty, longer than
/// [`max_len`](Self::max_len) bytes (default 256), or holds anything but visible ASCII and
/// inner spaces. A value longer than `max_len` is most often a secret too long to be a key
/// (a bearer token: a JWT is often 800 bytes and more): the first one this extractor (or
/// a clone of it) meets is logged (a `tracing` warning), as every such request falls to
/// the policy's `MissingKey` choice (by default, one bucket for all of them; under
/// [`MissingKey::Refuse`], a `400` whose detail says which of these it was, without the
/// value). A header sent on several field lines is keyed by its first line: the value the app reads
/// (`HeaderMap::get`, the typed-header extractors), so a client cannot shed its key (and,
/// under [`MissingKey::Skip`], its limit) by sending it twice.
/// Over HTTP/2 a request has no `Host` field (hyper leaves the authority in the URI), so
/// `Header::new("host")` finds no key there: key a virtual host with a closure reading
/// `req.uri.authority()` (then the `Host` field, for HTTP/1).
///
/// The value becomes part of the gate's key (and of the top rejected keys the layer
/// reports and logs): for a secret such as an API key or a bearer token, key by a digest
/// of it with a closure instead. Every instance sharing a Redis gate must compute the same
/// digest, in this release and the next: take a cryptographic one (SHA-256, or an HMAC
/// with a key the fleet shares), not `std`'s `DefaultHasher` (its output may change
/// between Rust releases) nor a fast non-cryptographic hash (a client could find a value
/// whose digest is another client's key, and spend that client's quota). Clients choose
/// these values, so each new value is a new entry in the
/// gate: bound the gate's keys (`MemoryGate`'s `max_keys`, Redis expiry) accordingly.
///
/// # Examples
///
/// ```
/// use flowgate::http::{Header, KeyExtractor, RequestInfo};
///
/// let api_key = Header::new("X-Api-Key")?;
/// let mut req = http::Request::new(());
/// req.headers_mut().insert("x-api-key", "k-123".parse()?);
/// let mut key = String::new();
/// assert!(api_key.extract(&RequestInfo::of(&req), &mut key));
/// assert_eq!(key, "k-123");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct Header {
    name: HeaderName,
    max_len: usize,
    /// Whether this extractor (or a clone of it) has said it met a value too long.
    warned: WarnOnce,
}

impl fmt::Debug for Header {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Header")
            .field("name", &self.name)
            .field("max_len", &self.max_len)
            .finish()
    }
}

impl Header {
    /// The default [`max_len`](Self::max_len): 256 bytes.
    pub const DEFAULT_MAX_LEN: usize = 256;

    /// The value of the header `name` (case-insensitive).
    ///
    /// # Errors
    ///
    /// [`ConfigError`] (field `header.name`) when `name` is not a valid header name.
    pub fn new(name: impl AsRef<str>) -> Result<Header, ConfigError> {
        let name = name.as_ref();
        HeaderName::from_bytes(name.as_bytes())
            .map(Header::from)
            .map_err(|_| {
                ConfigError::new(
                    "header.name",
                    ConfigErrorKind::Inconsistent,
                    format!("{name:?} is not a valid header name"),
                )
            })
    }

    /// The header read.
    #[must_use]
    pub fn name(&self) -> &HeaderName {
        &self.name
    }

    /// Values longer than `max_len` bytes give no key (default
    /// [`DEFAULT_MAX_LEN`](Self::DEFAULT_MAX_LEN)).
    ///
    /// The key goes into a gate key, `<key prefix><policy name>:<key>`, which a gate refuses
    /// above 512 bytes (with the `\` written before a key that begins with one, or equals
    /// the policy's [`MissingKey::Shared`] key): a value that fits `max_len` but makes a
    /// longer gate key gets
    /// `400 Bad Request` from a [`RateLimitLayer`](crate::http::RateLimitLayer) (counted as
    /// `bad_request`). For secrets, key by a digest instead (see the type's docs).
    #[must_use]
    pub fn max_len(mut self, max_len: std::num::NonZeroUsize) -> Header {
        self.max_len = max_len.get();
        self
    }
}

impl From<HeaderName> for Header {
    fn from(name: HeaderName) -> Header {
        Header {
            name,
            max_len: Header::DEFAULT_MAX_LEN,
            warned: WarnOnce::default(),
        }
    }
}

impl KeyExtractor for Header {
    fn extract(&self, req: &RequestInfo<'_>, key: &mut String) -> bool {
        // The first line, as the app reads it (a repeated header is no way out of a key).
        let Some(value) = req.headers.get(&self.name) else {
            return false;
        };
        let bytes = value.as_bytes();
        if bytes.len() > self.max_len {
            // Once per extractor.
            if self.warned.first() {
                warn_too_long(&self.name, bytes.len(), self.max_len);
            }
            return false;
        }
        // Visible ASCII and inner spaces: no tab, no byte above `~`, no space at either end.
        if bytes.first().is_none_or(|&b| b == b' ') || bytes.last() == Some(&b' ') {
            return false;
        }
        // Checked and copied in one pass (a check, then `push_str`, read the value twice).
        let start = key.len();
        key.reserve(bytes.len());
        for &b in bytes {
            if !matches!(b, b' '..=b'~') {
                key.truncate(start);
                return false;
            }
            key.push(char::from(b));
        }
        true
    }

    /// What is wrong with the header: missing, empty, longer than `max_len`, or holding a
    /// byte a key cannot hold (the value is never repeated).
    fn missing_reason(&self, req: &RequestInfo<'_>) -> Option<String> {
        let name = &self.name;
        let Some(value) = req.headers.get(name) else {
            return Some(format!("no {name} header"));
        };
        let bytes = value.as_bytes();
        let what = if bytes.is_empty() {
            "is empty".to_owned()
        } else if bytes.len() > self.max_len {
            format!("is longer than {} bytes", self.max_len)
        } else if bytes.first() == Some(&b' ') || bytes.last() == Some(&b' ') {
            "begins or ends with a space".to_owned()
        } else {
            "holds a byte other than visible ASCII and inner spaces".to_owned()
        };
        Some(format!("the {name} header {what}"))
    }
}

/// Say that a value of the header `name` was `len` bytes, longer than `max_len`: such
/// requests have no key.
fn warn_too_long(name: &HeaderName, len: usize, max_len: usize) {
    tracing::warn!(
        header = name.as_str(),
        len,
        max_len,
        "rate limit key: a request's header value is longer than the Header extractor's \
         max_len: requests with such a value have no key and fall to the policy's MissingKey \
         choice (by default one bucket shared by all of them); for a secret such as a bearer \
         token, key by a digest of it with a closure (SHA-256, or an HMAC), which also keeps \
         the secret out of the gate and the logs"
    );
}

/// The same key for every request: one limit shared by all (a global limit).
///
/// The key should not be empty: an empty key is no key (see [`KeyExtractor`]), so
/// `Constant::new("")` leaves every request to the policy's [`MissingKey`] choice (under
/// [`MissingKey::Skip`], no limit at all).
///
/// # Examples
///
/// ```
/// use flowgate::http::{Constant, KeyExtractor, RequestInfo};
///
/// let req = http::Request::new(());
/// let mut key = String::new();
/// assert!(Constant::new("all").extract(&RequestInfo::of(&req), &mut key));
/// assert_eq!(key, "all");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Constant(String);

impl Constant {
    /// Every request is counted under `key`.
    #[must_use]
    pub fn new(key: impl Into<String>) -> Constant {
        Constant(key.into())
    }

    /// The key.
    #[must_use]
    pub fn key(&self) -> &str {
        &self.0
    }
}

impl Default for Constant {
    /// The key `"all"`.
    fn default() -> Constant {
        Constant::new("all")
    }
}

impl KeyExtractor for Constant {
    fn extract(&self, _req: &RequestInfo<'_>, key: &mut String) -> bool {
        key.push_str(&self.0);
        true
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::net::SocketAddr;

    use http::header::HeaderValue;

    use super::*;
    use crate::http::ClientIp;

    pub(crate) fn request(peer: Option<&str>, headers: &[(&str, &[u8])]) -> http::Request<()> {
        let mut req = http::Request::new(());
        if let Some(peer) = peer {
            req.extensions_mut()
                .insert(peer.parse::<SocketAddr>().unwrap());
        }
        for (name, value) in headers {
            req.headers_mut().append(
                HeaderName::from_bytes(name.as_bytes()).unwrap(),
                HeaderValue::from_bytes(value).unwrap(),
            );
        }
        req
    }

    pub(crate) fn key_of(extractor: &impl KeyExtractor, req: &http::Request<()>) -> Option<String> {
        let mut key = String::new();
        extractor
            .extract(&RequestInfo::of(req), &mut key)
            .then_some(key)
    }

    #[test]
    fn peer_ip_is_canonical_and_optionally_grouped() {
        let req = request(Some("[::ffff:192.0.2.7]:1"), &[]);
        assert_eq!(key_of(&PeerIp::new(), &req).as_deref(), Some("192.0.2.7"));
        let req = request(Some("[2001:db8:1:2:3:4:5:6]:1"), &[]);
        assert_eq!(
            key_of(&PeerIp::new(), &req).as_deref(),
            Some("2001:db8:1:2:3:4:5:6")
        );
        assert_eq!(
            key_of(&PeerIp::new().ipv6_per_64(true), &req).as_deref(),
            Some("2001:db8:1:2::/64")
        );
        assert_eq!(key_of(&PeerIp::new(), &request(None, &[])), None);
    }

    #[test]
    fn peer_ip_from_a_custom_extension() {
        #[derive(Clone)]
        struct ConnectInfo<T>(T);
        let peer = PeerIp::from_extension(|c: &ConnectInfo<SocketAddr>| c.0);
        let mut req = request(Some("192.0.2.1:1"), &[]);
        assert_eq!(key_of(&peer, &req), None, "reads only its own extension");
        req.extensions_mut()
            .insert(ConnectInfo("192.0.2.9:80".parse::<SocketAddr>().unwrap()));
        assert_eq!(key_of(&peer, &req).as_deref(), Some("192.0.2.9"));
        assert!(format!("{peer:?}").contains("ConnectInfo"));
    }

    /// Every warning logged while `f` runs, as its message and fields print.
    pub(crate) fn warnings(f: impl FnOnce()) -> Vec<String> {
        use std::sync::Mutex;
        use tracing_subscriber::layer::SubscriberExt;

        #[derive(Clone, Default)]
        struct Warnings(Arc<Mutex<Vec<String>>>);
        impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Warnings {
            fn on_event(
                &self,
                event: &tracing::Event<'_>,
                _: tracing_subscriber::layer::Context<'_, S>,
            ) {
                struct Text(String);
                impl tracing::field::Visit for Text {
                    fn record_debug(
                        &mut self,
                        field: &tracing::field::Field,
                        value: &dyn fmt::Debug,
                    ) {
                        let _ = write!(self.0, "{}={value:?} ", field.name());
                    }
                }
                if *event.metadata().level() == tracing::Level::WARN {
                    let mut text = Text(String::new());
                    event.record(&mut text);
                    self.0.lock().unwrap().push(text.0);
                }
            }
        }
        let seen = Warnings::default();
        let subscriber = tracing_subscriber::registry().with(seen.clone());
        tracing::subscriber::with_default(subscriber, f);
        seen.0.lock().unwrap().clone()
    }

    /// Under axum, served with `into_make_service_with_connect_info::<SocketAddr>()` as the
    /// warning asked, the address is in a `ConnectInfo<SocketAddr>`, which `PeerIp::new()`
    /// (a bare `SocketAddr`) does not read: every request falls to the policy's
    /// `MissingKey` (by default one bucket for the whole site). The warning says how to
    /// read it, once per extractor (before: once per process, asking for the connect info
    /// the server already had, and naming no `from_extension`).
    #[test]
    fn a_peer_ip_that_finds_no_address_says_how_to_read_axums_connect_info() {
        #[derive(Clone)]
        struct ConnectInfo<T>(T);
        let mut req = request(None, &[]);
        req.extensions_mut()
            .insert(ConnectInfo("192.0.2.9:80".parse::<SocketAddr>().unwrap()));
        let peer = PeerIp::new();
        let logged = warnings(|| {
            assert_eq!(key_of(&peer, &req), None);
            assert_eq!(key_of(&peer.clone(), &req), None);
        });
        assert_eq!(logged.len(), 1, "once per extractor: {logged:?}");
        assert!(
            logged[0].contains("PeerIp::from_extension(|c: &ConnectInfo<SocketAddr>| c.0)"),
            "{logged:?}"
        );
        let logged = warnings(|| assert_eq!(key_of(&PeerIp::new(), &req), None));
        assert_eq!(logged.len(), 1, "a new extractor says it again: {logged:?}");
    }

    #[test]
    fn header_values() {
        let h = Header::new("X-Api-Key").unwrap();
        assert_eq!(h.name(), "x-api-key");
        let get = |values: &[&[u8]]| {
            let headers: Vec<(&str, &[u8])> = values.iter().map(|v| ("x-api-key", *v)).collect();
            key_of(&h, &request(None, &headers))
        };
        assert_eq!(get(&[b"k-1"]).as_deref(), Some("k-1"));
        assert_eq!(get(&[b"Bearer abc"]).as_deref(), Some("Bearer abc"));
        assert_eq!(get(&[]), None);
        assert_eq!(get(&[b""]), None);
        assert_eq!(
            get(&[b"a", b"b"]).as_deref(),
            Some("a"),
            "the first line, as the app reads it"
        );
        assert_eq!(get(&[b"caf\xc3\xa9"]), None);
        assert_eq!(get(&[b"a\tb"]), None);
        assert_eq!(get(&[b" a"]), None);
        assert_eq!(get(&[b"a "]), None);
        assert_eq!(get(&[b"a\xff"]), None);
        // A value refused half-way leaves what the string held before.
        let mut key = String::from("per-key:");
        let req = request(None, &[("x-api-key", b"ab\tc")]);
        assert!(!h.extract(&RequestInfo::of(&req), &mut key));
        assert_eq!(key, "per-key:");
        assert_eq!(get(&[&[b'x'; 257]]), None);
        assert!(get(&[&[b'x'; 256]]).is_some());
        let short = h.clone().max_len(std::num::NonZeroUsize::new(2).unwrap());
        assert_eq!(
            key_of(&short, &request(None, &[("x-api-key", b"abc")])),
            None
        );
        assert_eq!(Header::new("bad name").unwrap_err().field(), "header.name");
    }

    /// A bearer token (a JWT is often 800 bytes and more) is longer than the default
    /// `max_len` of 256: the request has no key, and under the default
    /// `MissingKey::Shared` every such client shares one bucket with the keyless ones.
    /// Before, nothing said so; now the first such value (for this extractor and its
    /// clones) logs a warning naming the header, the length, the limit and the remedy.
    #[test]
    fn a_header_value_longer_than_max_len_says_so_once() {
        let h = Header::new("Authorization").unwrap();
        let jwt = format!("Bearer {}", "x".repeat(850));
        let req = request(None, &[("authorization", jwt.as_bytes())]);
        let logged = warnings(|| {
            assert_eq!(key_of(&h, &req), None);
            assert_eq!(key_of(&h.clone(), &req), None);
            assert_eq!(
                key_of(&h, &request(None, &[("authorization", b"short")])).as_deref(),
                Some("short")
            );
        });
        assert_eq!(logged.len(), 1, "once per extractor: {logged:?}");
        for part in ["authorization", "857", "256", "MissingKey", "digest"] {
            assert!(logged[0].contains(part), "{part}: {logged:?}");
        }
        // A value refused for its bytes is not too long: no warning.
        let logged = warnings(|| {
            let h = Header::new("x-api-key").unwrap();
            assert_eq!(key_of(&h, &request(None, &[("x-api-key", b"a\tb")])), None);
        });
        assert!(logged.is_empty(), "{logged:?}");
    }

    /// What `Header` says of a value that gives no key, for a `Refuse` policy's 400: never
    /// the value itself; a closure says nothing.
    #[test]
    fn a_header_says_why_a_value_gives_no_key() {
        let h = Header::new("X-Api-Key").unwrap();
        let why = |value: Option<&[u8]>| {
            let headers: Vec<(&str, &[u8])> = value.map(|v| ("x-api-key", v)).into_iter().collect();
            let req = request(None, &headers);
            assert_eq!(key_of(&h, &req), None);
            h.missing_reason(&RequestInfo::of(&req)).unwrap()
        };
        assert_eq!(why(None), "no x-api-key header");
        assert_eq!(why(Some(b"")), "the x-api-key header is empty");
        assert_eq!(
            why(Some(&[b'k'; 257])),
            "the x-api-key header is longer than 256 bytes"
        );
        assert_eq!(
            why(Some(b" k")),
            "the x-api-key header begins or ends with a space"
        );
        for bad in [&b"k\tk"[..], b"caf\xc3\xa9"] {
            assert_eq!(
                why(Some(bad)),
                "the x-api-key header holds a byte other than visible ASCII and inner spaces"
            );
        }
        let closure = |_: &RequestInfo<'_>, _: &mut String| false;
        assert_eq!(
            closure.missing_reason(&RequestInfo::of(&request(None, &[]))),
            None
        );
    }

    #[test]
    fn constant_and_closure() {
        let req = request(None, &[]);
        assert_eq!(key_of(&Constant::default(), &req).as_deref(), Some("all"));
        let by_method = |req: &RequestInfo<'_>, key: &mut String| {
            key.push_str(req.method.as_str());
            true
        };
        assert_eq!(key_of(&by_method, &req).as_deref(), Some("GET"));
    }

    #[test]
    fn extractors_are_send_sync_clone_debug() {
        fn check<T: KeyExtractor + Clone + fmt::Debug>() {}
        check::<PeerIp>();
        check::<ClientIp>();
        check::<Header>();
        check::<Constant>();
    }
}
