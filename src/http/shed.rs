//! `ShedLayer`: a bulkhead in front of a service, answering `503` with `Retry-After` when it
//! is saturated, by request class, and a going-away `503` when it is closed.

use std::fmt;
use std::future::Future;
use std::mem;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode, Version, header};
use pin_project::{pin_project, pinned_drop};
use tower::{Layer, Service};

use crate::adaptive::Outcome;
use crate::bulkhead::{AcquireError, AcquireOwned, Bulkhead, OwnedBulkheadPermit, Priority};
use crate::error::{ConfigError, ConfigErrorKind};
use crate::http::body::ResponseBody;
use crate::http::fields;
use crate::http::key::RequestInfo;
use crate::http::problem::{self, TEMPORARY_REDUCED_CAPACITY};
use crate::http::striped::Striped;
use crate::metrics::{Counter, Labels};
use crate::sync::Arc;

/// Names of the shed layer's metrics.
pub(crate) mod names {
    /// Requests the layer shed with `503` (its bulkhead saturated), by `class`.
    pub(crate) const SHED: &str = "flowgate_http_shed_total";
    /// Requests the layer refused with `503` because its bulkhead was closed, by `class`.
    pub(crate) const CLOSED: &str = "flowgate_http_shed_closed_total";
}

/// The `detail` of the `503` a closed bulkhead answers: the server is going away, which
/// says nothing of its capacity (so not `temporary-reduced-capacity`), and has no more
/// specific type than its status (`about:blank`).
const GOING_AWAY: &str = "The server is shutting down and takes no new requests: send the \
     request again on a new connection";

/// How much a request matters when the bulkhead is saturated: what a [`ShedLayer`]'s
/// classifier answers for each request.
///
/// | class | permit | when no permit is free |
/// |---|---|---|
/// | `Critical` | [`Priority::Critical`]: may take the bulkhead's `critical_reserve` | waits or is refused, as the layer's [`wait`](ShedLayerBuilder::wait) mode says; a waiting critical request is served first and pushes the newest normal waiter out of a full waiting room |
/// | `Normal` | [`Priority::Normal`] | waits or is refused, as the layer's `wait` mode says |
/// | `Sheddable` | [`Priority::Normal`] | refused at once, whatever the mode: never waits |
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Class {
    /// Must get through: health checks, the core path. Uses the bulkhead's critical reserve.
    Critical,
    /// Ordinary work (the default).
    #[default]
    Normal,
    /// Work to drop first (reports, exports, prefetches): never waits for a permit.
    Sheddable,
}

impl Class {
    /// A stable lowercase name, the `class` label of `flowgate_http_shed_total`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Class::Critical => "critical",
            Class::Normal => "normal",
            Class::Sheddable => "sheddable",
        }
    }

    const ALL: [Class; 3] = [Class::Critical, Class::Normal, Class::Sheddable];

    const fn index(self) -> usize {
        match self {
            Class::Critical => 0,
            Class::Normal => 1,
            Class::Sheddable => 2,
        }
    }

    const fn priority(self) -> Priority {
        match self {
            Class::Critical => Priority::Critical,
            Class::Normal | Class::Sheddable => Priority::Normal,
        }
    }
}

impl fmt::Display for Class {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What one class of requests met at a [`ShedLayer`]: part of [`ShedStats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct ClassStats {
    /// Requests that got a permit and went on to the inner service.
    pub admitted: u64,
    /// Requests shed with `503` by the saturated bulkhead (no permit free, waiting room
    /// full, waited past the timeout, pushed out by critical work): the server is busy. The
    /// bulkhead's `flowgate_bulkhead_rejected_total{reason}` tells the reasons apart.
    pub shed: u64,
    /// Requests refused with the going-away `503` of a closed bulkhead (the server shutting
    /// down; see [`ShedLayer`'s "Shutting down"](ShedLayer#shutting-down)).
    pub closed: u64,
    /// Requests that ended with neither: their response future was dropped before it got a
    /// permit or was refused (the client went away while the request waited in the
    /// waiting room and the server saw it go, see [`wait`](ShedLayerBuilder::wait), or
    /// before its future was first polled), or the classifier panicked
    /// on it (counted in [`Class::Normal`]), or user code panicked before it had a permit
    /// or its `503` (the panic went to the caller, no `503` was sent): the inner service's
    /// `Clone` as `call` kept a clone, or, refused, the drop of the request or of the
    /// ready inner service it held, or a metrics recorder counting its `503`. A request
    /// dropped once admitted counts as admitted. `admitted + shed + closed + cancelled` is
    /// every request the layer's services were called with (and whose future has ended). A waiter the
    /// bulkhead closed out or pushed out of its waiting room just before it was dropped
    /// sent no `503`: cancelled here, while the bulkhead's own stats count its refusal
    /// (`closed`, `waiting_room_full`).
    pub cancelled: u64,
}

/// Counts of a [`ShedLayer`] (and every service it made) since it was built; from
/// [`ShedLayer::stats`] or [`Shed::stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct ShedStats {
    /// [`Class::Critical`] requests.
    pub critical: ClassStats,
    /// [`Class::Normal`] requests.
    pub normal: ClassStats,
    /// [`Class::Sheddable`] requests.
    pub sheddable: ClassStats,
}

impl ShedStats {
    /// The counts of `class`.
    pub fn class(&self, class: Class) -> ClassStats {
        match class {
            Class::Critical => self.critical,
            Class::Normal => self.normal,
            Class::Sheddable => self.sheddable,
        }
    }

    /// Requests admitted, all classes together.
    pub fn admitted(&self) -> u64 {
        self.critical.admitted + self.normal.admitted + self.sheddable.admitted
    }

    /// Requests shed with `503` (the bulkhead saturated), all classes together.
    pub fn shed(&self) -> u64 {
        self.critical.shed + self.normal.shed + self.sheddable.shed
    }

    /// Requests refused with `503` by the closed bulkhead, all classes together.
    pub fn closed(&self) -> u64 {
        self.critical.closed + self.normal.closed + self.sheddable.closed
    }

    /// Requests given up before a permit or a `503`, all classes together.
    pub fn cancelled(&self) -> u64 {
        self.critical.cancelled + self.normal.cancelled + self.sheddable.cancelled
    }
}

type Classifier = dyn Fn(&RequestInfo<'_>) -> Class + Send + Sync;

/// What every clone of a layer and its services shares.
struct Shared {
    bulkhead: Bulkhead,
    classify: Option<Box<Classifier>>,
    wait: bool,
    retry_after: HeaderValue,
    /// The problem document of every 503 (built once: shedding stays cheap under load).
    body: Bytes,
    name: Option<String>,
    /// Per [`Class`]: admitted, then shed (`3 + class`), then cancelled (`6 + class`), then
    /// closed (`9 + class`), striped by thread.
    counts: Striped<12>,
    shed_metric: [Counter; 3],
    closed_metric: [Counter; 3],
}

impl Shared {
    fn classify(&self, req: &RequestInfo<'_>) -> Class {
        let Some(f) = &self.classify else {
            return Class::Normal;
        };
        // A classifier that panics (user code) ends its request before it has a future to
        // count it: it is counted here as it unwinds, cancelled in the default class.
        let unclassified = Unstarted(self, Class::Normal);
        let class = f(req);
        mem::forget(unclassified);
        class
    }

    fn admitted(&self, class: Class) {
        self.counts.add(class.index(), 1);
    }

    /// A request of `class` given up before a permit or a `503`.
    fn cancelled(&self, class: Class) {
        self.counts.add(6 + class.index(), 1);
    }

    /// The `503` for a request of `class` (over HTTP `version`) the bulkhead refused for
    /// `why`. The recorder (user code) first: if it panics, no `503` is sent and the request
    /// is not counted here; its response future, dropped still waiting, counts it as
    /// cancelled (once).
    fn refused<B>(
        &self,
        class: Class,
        why: AcquireError,
        version: Version,
    ) -> Response<ResponseBody<B>> {
        if why == AcquireError::Closed {
            self.closed_metric[class.index()].increment(1);
            self.counts.add(9 + class.index(), 1);
            return going_away(version).map(ResponseBody::own);
        }
        self.shed_metric[class.index()].increment(1);
        self.counts.add(3 + class.index(), 1);
        problem::response(
            StatusCode::SERVICE_UNAVAILABLE,
            self.body.clone(),
            self.retry_after.clone(),
        )
        .map(ResponseBody::own)
    }

    fn stats(&self) -> ShedStats {
        let of = |c: Class| ClassStats {
            admitted: self.counts.get(c.index()),
            shed: self.counts.get(3 + c.index()),
            closed: self.counts.get(9 + c.index()),
            cancelled: self.counts.get(6 + c.index()),
        };
        ShedStats {
            critical: of(Class::Critical),
            normal: of(Class::Normal),
            sheddable: of(Class::Sheddable),
        }
    }
}

/// Counts its request cancelled in its class if dropped: while user code runs in `call`,
/// before the request has a future to count it (the classifier, as `Normal`; the inner
/// service's `Clone`).
struct Unstarted<'a>(&'a Shared, Class);

impl Drop for Unstarted<'_> {
    fn drop(&mut self) {
        self.0.cancelled(self.1);
    }
}

impl fmt::Debug for Shared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShedLayer")
            .field("name", &self.name)
            .field("bulkhead", &self.bulkhead)
            .field("wait", &self.wait)
            .field("retry_after", &self.retry_after)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

/// A tower [`Layer`] that puts a [`Bulkhead`] in front of a service: each request holds a
/// permit from the moment it is admitted until its response body is sent (or dropped), and
/// a request the saturated bulkhead refuses is answered `503 Service Unavailable` with
/// `Retry-After` and an RFC 9457 problem body, without reaching the inner service.
///
/// "Sent" is when the server took the body's last frame: hyper queues a frame whole (over
/// HTTP/2 past the client's flow-control window), so a body of one frame (`Full`, a `Vec`,
/// a `String`) gives its permit back at once, however slowly the client reads it; a body
/// streamed in frames holds it until the last one is taken, and a client that stops
/// reading holds it until the stream or connection is closed (a reset, a timeout).
///
/// A classifier gives each request a [`Class`]: `Critical` requests may take the bulkhead's
/// critical reserve, so health checks and the core path keep a share when everything else is
/// shed; `Sheddable` requests never wait; `Normal` requests wait or not as the layer's
/// [`wait`](ShedLayerBuilder::wait) mode says.
///
/// # The 503
///
/// Status `503`, `Retry-After` in whole seconds (the configured
/// [`retry_after`](ShedLayerBuilder::retry_after), default 1 s, rounded up), and an
/// `application/problem+json` body of the ratelimit-headers draft's
/// `temporary-reduced-capacity` type:
///
/// ```json
/// {"type":"https://iana.org/assignments/http-problem-types#temporary-reduced-capacity",
///  "title":"Request cannot be satisfied due to temporary server capacity constraints",
///  "status":503,"violated-policies":[]}
/// ```
///
/// `violated-policies` is empty: shedding is about the server's capacity, not a quota policy
/// a client could read in `RateLimit-Policy`.
///
/// A closed bulkhead's refusal is not this `503` but a going-away one: see
/// [Shutting down](#shutting-down).
///
/// # tower semantics
///
/// `poll_ready` only asks the inner service; the permit is taken in the response future, so
/// an idle keep-alive connection holds none. The inner service is cloned after it was ready
/// (`mem::replace`), and a refused request drops its ready clone without calling it. The
/// layer and its services are `Clone` and share the bulkhead and the counts. A waiting
/// request is woken by the bulkhead when a permit frees or its timeout fires; nothing polls
/// in a loop. Dropping the response future gives up the wait (the request counts in
/// [`ClassStats::cancelled`]) or returns the permit.
///
/// # Metrics
///
/// `flowgate_http_shed_total{name, class}`: requests shed with `503` (the bulkhead
/// saturated), by class; `flowgate_http_shed_closed_total{name, class}`: requests refused
/// with the going-away `503` of a closed bulkhead, by class. The bulkhead's own metrics (`flowgate_bulkhead_in_flight`, `..._rejected_total{reason}`,
/// `..._wait_seconds`) carry the bulkhead's name.
///
/// # Adaptive bulkheads
///
/// Over a bulkhead built with [`adaptive`](crate::bulkhead::BulkheadBuilder::adaptive), each
/// admitted request is a sample for its algorithm when the inner service answers (the
/// round-trip time from the permit's grant to the response head; the body still holds the
/// permit): `503`, `504`, `408` and inner errors are back-pressure (a `408` from inside
/// the server is a timeout's answer: axum's `HandleErrorLayer` + `timeout` recipe and
/// tower-http's `TimeoutLayer::new` answer a handler out of time so; one of a request
/// body read too slowly counts too), the other `4xx` are ignored (a `429` among them: it
/// refuses one client over its quota, as a rate-limit layer inside this one or the app's
/// own throttle does, and says nothing of the server's capacity, so one client's excess
/// cannot shrink the limit every client is served under), the rest is a served call; a
/// request dropped before its answer is ignored, and so is the `503` of a
/// [`RateLimitLayer`](crate::http::RateLimitLayer) inside this one whose gate could not
/// decide (Redis away: the service behind it never ran). The layer's own `503`s (shed or
/// closed) never reach the algorithm. Shedding works as above, against the bulkhead's
/// current `max_in_flight`.
///
/// A `500` or a `502` of the inner service is a served call, not a drop: either is most
/// often the application failing (a bug, an input it did not expect, a dependency that is
/// down), not this server out of capacity, and taken as back-pressure one failing route
/// would cut the limit every route is served under to its minimum, and hold it there,
/// shedding sound requests for a bug. Netflix's concurrency-limits does the same on the
/// server side (its gRPC interceptor drops only on `CANCELLED` and `DEADLINE_EXCEEDED`,
/// its servlet filter counts every response a success).
///
/// To classify a response yourself, put an [`Outcome`] in its extensions, in a handler or a
/// layer inside this one; it wins over the status. `Outcome::BackPressure` for a `502` of a
/// handler whose upstream refused it for overload (`res.extensions_mut()
/// .insert(Outcome::BackPressure)`, or `(Extension(Outcome::BackPressure),
/// StatusCode::BAD_GATEWAY)` from an axum handler); `Outcome::Ignored` for a `500` that
/// failed before doing the work, whose round trip, near zero, would otherwise pull a
/// latency-based limit's lowest round trip down (see [`Outcome::Ok`]); `Outcome::Ok` for a
/// `503` the application means as an answer, not as overload. The extension stays in the
/// response (an outer `ShedLayer` reads it too).
///
/// # Examples
///
/// ```
/// use std::convert::Infallible;
/// use std::time::Duration;
///
/// use bytes::Bytes;
/// use flowgate::bulkhead::Bulkhead;
/// use flowgate::http::{Class, ShedLayer};
/// use http::{Request, Response, StatusCode};
/// use http_body_util::Full;
/// use tower::{Layer, ServiceExt, service_fn};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let bulkhead = Bulkhead::builder(64)
///     .critical_reserve(4) // only /health may use the last 4 permits
///     .max_waiting(128)
///     .wait_timeout(Duration::from_millis(250))
///     .name("api")
///     .build()?;
/// let layer = ShedLayer::builder(bulkhead)
///     .classify(|req| match req.uri.path() {
///         "/health" => Class::Critical,
///         path if path.starts_with("/report") => Class::Sheddable,
///         _ => Class::Normal,
///     })
///     .wait(true) // normal requests wait up to 250 ms in the bulkhead's waiting room
///     .retry_after(Duration::from_secs(2))
///     .name("api")
///     .build()?;
///
/// let app = layer.layer(service_fn(|_req: Request<Full<Bytes>>| async {
///     Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
/// }));
/// let res = app.oneshot(Request::get("/health").body(Full::default())?).await?;
/// assert_eq!(res.status(), StatusCode::OK);
/// assert_eq!(layer.stats().critical.admitted, 1);
/// # Ok(())
/// # }
/// ```
///
/// With axum, `Router::layer(layer)` sheds every route and `Router::route_layer(layer)` the
/// matched routes only: an unknown path's 404 passes by it, but a known path asked with a
/// method it does not serve (a 405) goes through it, as axum wraps a path's whole method
/// router. The same holds for [`RateLimitLayer`](crate::http::RateLimitLayer). Around the
/// whole router (`layer.layer(router)`, served through axum's
/// `ServiceExt::into_make_service_with_connect_info`) it sheds what `Router::layer` sheds,
/// without axum's boxing and per-request clone of a layered route (see
/// [`RateLimitLayer`'s "Under axum"](crate::http::RateLimitLayer#under-axum)).
///
/// # Shutting down
///
/// Close the bulkhead ([`Bulkhead::close`](crate::bulkhead::Bulkhead::close)), then start
/// the server's graceful shutdown (axum's `with_graceful_shutdown`): the requests in the
/// waiting room get a going-away `503` at once, new ones too, and the requests in flight
/// finish. Started without the close, the graceful shutdown waits for the waiting room
/// too: each request in it until it gets a permit or its `wait_timeout` runs out.
///
/// The going-away `503` is told apart from a shed (busy) one the ways clients and proxies
/// read:
///
/// - over HTTP/1, `Connection: close`: hyper closes the connection once the `503` is sent,
///   and the client's next request opens a new one (behind a balancer, to another
///   instance). Over HTTP/2 the server's graceful shutdown sends `GOAWAY`, which says the
///   same for the whole connection (the field is not sent: HTTP/2 has none);
/// - no `Retry-After`: the server cannot say when this origin serves again (perhaps never;
///   another instance may serve now), and `Retry-After: 0` would send a client straight
///   back to a listener that may still accept between the close and the shutdown. Without
///   it a client's own backoff decides (the crate's retry layer takes a `503` without it as
///   back-pressure and waits its jittered backoff);
/// - a problem document of `about:blank`, titled "Service Unavailable", with a `detail`
///   saying the server is shutting down, not the `temporary-reduced-capacity` of a shed;
/// - counted apart: [`ClassStats::closed`] and `flowgate_http_shed_closed_total`, not
///   `shed`.
///
/// The refused request never reached the inner service, so resending it (even a `POST`)
/// cannot run it twice.
#[derive(Clone)]
pub struct ShedLayer {
    shared: Arc<Shared>,
}

impl fmt::Debug for ShedLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.shared.fmt(f)
    }
}

impl ShedLayer {
    /// A builder for a layer over `bulkhead` (a handle: the bulkhead may be shared with other
    /// layers and other work).
    pub fn builder(bulkhead: Bulkhead) -> ShedLayerBuilder {
        ShedLayerBuilder {
            bulkhead,
            classify: None,
            wait: false,
            retry_after: Duration::from_secs(1),
            name: None,
        }
    }

    /// The counts of this layer and every service it made.
    pub fn stats(&self) -> ShedStats {
        self.shared.stats()
    }

    /// The bulkhead the layer takes its permits from.
    pub fn bulkhead(&self) -> &Bulkhead {
        &self.shared.bulkhead
    }
}

impl<S> Layer<S> for ShedLayer {
    type Service = Shed<S>;

    fn layer(&self, inner: S) -> Shed<S> {
        Shed {
            inner,
            shared: self.shared.clone(),
        }
    }
}

/// Builds a [`ShedLayer`]; from [`ShedLayer::builder`].
#[must_use = "a builder does nothing until built"]
pub struct ShedLayerBuilder {
    bulkhead: Bulkhead,
    classify: Option<Box<Classifier>>,
    wait: bool,
    retry_after: Duration,
    name: Option<String>,
}

impl fmt::Debug for ShedLayerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShedLayerBuilder")
            .field("bulkhead", &self.bulkhead)
            .field("classify", &self.classify.as_ref().map(|_| "Fn"))
            .field("wait", &self.wait)
            .field("retry_after", &self.retry_after)
            .field("name", &self.name)
            .finish()
    }
}

impl ShedLayerBuilder {
    /// The classifier: a [`Class`] for each request, from its method, URI, headers and
    /// extensions (the body is not read). Default: every request is [`Class::Normal`].
    ///
    /// It runs once per request, in `call`, and should be cheap (a path match). If it
    /// panics, the panic goes to the caller of `call` and the request is counted in
    /// [`ClassStats::cancelled`] of [`Class::Normal`] (it got neither a permit nor a `503`).
    pub fn classify<F>(mut self, classify: F) -> Self
    where
        F: Fn(&RequestInfo<'_>) -> Class + Send + Sync + 'static,
    {
        self.classify = Some(Box::new(classify));
        self
    }

    /// Whether `Normal` and `Critical` requests that find no free permit wait for one.
    ///
    /// - `false` (the default): refuse at once with `503` (tower's `LoadShed` behaviour);
    ///   the bulkhead's waiting room is not used.
    /// - `true`: wait in the bulkhead's waiting room (of its
    ///   [`max_waiting`](crate::bulkhead::BulkheadBuilder::max_waiting), unbounded unless
    ///   set), up to its [`wait_timeout`](crate::bulkhead::BulkheadBuilder::wait_timeout); a
    ///   full room or the timeout is a `503`. The bulkhead must have a `wait_timeout` (see
    ///   [`build`](ShedLayerBuilder::build)); one too long to ever end (`Duration::MAX`) is
    ///   taken as given, and requests then wait as long as the bulkhead stays saturated.
    ///
    /// `Sheddable` requests never wait, in either mode.
    ///
    /// A waiting request holds the inner service that was ready for it (clone-after-ready),
    /// and with it whatever that service reserved when it was polled ready (a slot of an
    /// inner `ConcurrencyLimit`, say), until it is served or refused: at most `wait_timeout`.
    ///
    /// A client that goes away while its request waits gives its place back (the request
    /// counts in [`ClassStats::cancelled`]) when the server drops the response future:
    /// hyper does at the stream's reset over HTTP/2, and over HTTP/1 when it reads the
    /// connection's end, which it looks for only once it has read the request's body. A
    /// `GET`, or an upload that came in whole, leaves at once; an upload larger than hyper
    /// reads ahead of the handler keeps its place until it times out (a `503` nobody reads,
    /// counted in [`ClassStats::shed`]) or is served (counted admitted: the handler reads a
    /// body cut short).
    pub fn wait(mut self, wait: bool) -> Self {
        self.wait = wait;
        self
    }

    /// The `Retry-After` of a `503` (default 1 s), sent in whole seconds rounded up
    /// (1.2 s → `Retry-After: 2`), at most 999 999 999 999 999 (the largest integer the
    /// crate writes in a field: `Duration::MAX` is sent as that).
    pub fn retry_after(mut self, retry_after: Duration) -> Self {
        self.retry_after = retry_after;
        self
    }

    /// The `name` label of the layer's metrics.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Build the layer.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] on `shed.retry_after` if it is zero, and on `shed.wait` if waiting
    /// was asked for over a bulkhead without a `wait_timeout` (requests would wait for as
    /// long as the bulkhead stays saturated, and a client's own timeout would fire before
    /// any `503`).
    pub fn build(self) -> Result<ShedLayer, ConfigError> {
        if self.retry_after.is_zero() {
            return Err(ConfigError::zero_duration("shed.retry_after"));
        }
        if self.wait && self.bulkhead.core().wait_timeout().is_none() {
            return Err(ConfigError::new(
                "shed.wait",
                ConfigErrorKind::Inconsistent,
                "waiting needs a bulkhead with a wait_timeout",
            ));
        }
        let secs = self
            .retry_after
            .as_secs()
            .saturating_add(u64::from(self.retry_after.subsec_nanos() > 0));
        let labels = Labels::new(self.name.as_deref());
        let shed_metric = Class::ALL.map(|c| labels.counter(names::SHED, &[("class", c.as_str())]));
        let closed_metric =
            Class::ALL.map(|c| labels.counter(names::CLOSED, &[("class", c.as_str())]));
        Ok(ShedLayer {
            shared: Arc::new(Shared {
                bulkhead: self.bulkhead,
                classify: self.classify,
                wait: self.wait,
                retry_after: fields::integer_value(secs),
                body: problem::document(
                    TEMPORARY_REDUCED_CAPACITY,
                    StatusCode::SERVICE_UNAVAILABLE,
                    &[],
                ),
                name: self.name,
                counts: Striped::new(),
                shed_metric,
                closed_metric,
            }),
        })
    }
}

/// The service of a [`ShedLayer`]: the inner service behind a bulkhead.
///
/// Clones share the layer's bulkhead and counts.
#[derive(Clone)]
pub struct Shed<S> {
    inner: S,
    shared: Arc<Shared>,
}

impl<S> Shed<S> {
    /// The counts of the layer this service came from (shared by all its services).
    pub fn stats(&self) -> ShedStats {
        self.shared.stats()
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The inner service, unwrapped.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: fmt::Debug> fmt::Debug for Shed<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shed")
            .field("inner", &self.inner)
            .field("layer", &self.shared)
            .finish()
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Shed<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ShedFuture<S, ReqBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        // Only the inner service: a permit is taken when a request is there to use it.
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let class = self.shared.classify(&RequestInfo::of(&req));
        // The service that was made ready goes with this request; a fresh clone stays. The
        // clone is user code: if it panics, the request is counted as it unwinds.
        let unstarted = Unstarted(&self.shared, class);
        let clone = self.inner.clone();
        mem::forget(unstarted);
        let inner = mem::replace(&mut self.inner, clone);
        let state = if self.shared.wait && class != Class::Sheddable {
            // Takes nothing until polled.
            State::Wait(self.shared.bulkhead.acquire_owned_with(class.priority()))
        } else {
            State::Try
        };
        ShedFuture {
            state,
            pending: Some((inner, req)),
            class,
            shared: self.shared.clone(),
        }
    }
}

/// The response future of [`Shed`]: takes a permit (or waits for one), then calls the inner
/// service; or answers `503`.
///
/// # Panics
///
/// When polled again after it completed. In the [`wait`](ShedLayerBuilder::wait) mode, a
/// request that finds no free permit starts the bulkhead's tokio timer: polled outside a
/// tokio runtime with timers enabled, it panics then (see
/// [`Bulkhead::acquire`](crate::bulkhead::Bulkhead::acquire)). A panic of the inner
/// service loses no permit: one in its `call` returns it as the stack unwinds, one in its
/// future when this future is dropped (as a runtime drops a task that panicked).
///
/// # Cancel safety
///
/// Dropping it before the permit is taken gives up its place in the waiting room (and
/// counts the request in [`ClassStats::cancelled`]); after, the permit is returned and the
/// inner service's future is dropped with it. Once the response is out, the permit travels
/// in its body ([`ResponseBody::Held`]).
#[pin_project(PinnedDrop)]
#[must_use = "futures do nothing unless polled"]
pub struct ShedFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    #[pin]
    state: State<S::Future>,
    /// The ready inner service and the request, until the permit is there.
    pending: Option<(S, Request<ReqBody>)>,
    class: Class,
    shared: Arc<Shared>,
}

#[pin_project(project = StateProj)]
enum State<F> {
    /// Take a permit without waiting, on the first poll.
    Try,
    /// Waiting in the bulkhead's waiting room.
    Wait(#[pin] AcquireOwned),
    /// The inner service runs, holding the permit.
    Call(#[pin] F, Option<OwnedBulkheadPermit>),
    /// The response was given out.
    Done,
}

impl<S, ReqBody, ResBody> Future for ShedFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
{
    type Output = Result<Response<ResponseBody<ResBody>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            let acquired = match this.state.as_mut().project() {
                StateProj::Try => this
                    .shared
                    .bulkhead
                    .try_acquire_owned_with(this.class.priority()),
                StateProj::Wait(acquire) => ready!(acquire.poll(cx)),
                StateProj::Call(fut, permit) => {
                    let res = ready!(fut.poll(cx));
                    let mut permit = permit.take();
                    if let Some(permit) = permit.as_mut() {
                        // An adaptive bulkhead learns from the response head; the body
                        // still holds the permit.
                        permit.note_with(|| outcome(&res));
                    }
                    this.state.set(State::Done);
                    return Poll::Ready(res.map(|res| res.map(|b| ResponseBody::Held(b, permit))));
                }
                StateProj::Done => panic!("ShedFuture polled after completion"),
            };
            let class = *this.class;
            match acquired {
                Ok(permit) => {
                    let (mut inner, req) = this.pending.take().expect("pending until acquired");
                    this.shared.admitted(class);
                    // Counted: out of `Wait`, so that a `call` that panics is not counted
                    // as cancelled too when this future is dropped.
                    this.state.set(State::Done);
                    let fut = inner.call(req);
                    this.state.set(State::Call(fut, Some(permit)));
                }
                Err(why) => {
                    // The ready service and the request are dropped unused, then the
                    // request is counted shed (or closed), both before the state leaves
                    // `Try` / `Wait`: either runs user code (their drops, a recorder), and
                    // one that panics leaves the request to be counted cancelled, once,
                    // when dropped.
                    let version = this
                        .pending
                        .as_ref()
                        .map_or(Version::HTTP_11, |(_, req)| req.version());
                    *this.pending = None;
                    let refused = this.shared.refused(class, why, version);
                    this.state.set(State::Done);
                    return Poll::Ready(Ok(refused));
                }
            }
        }
    }
}

#[pinned_drop]
impl<S, ReqBody> PinnedDrop for ShedFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    fn drop(self: Pin<&mut Self>) {
        // Neither admitted nor refused yet: given up. (The acquisition, dropped with the
        // state after this, leaves the waiting room.)
        if matches!(self.state, State::Try | State::Wait(_)) {
            self.shared.cancelled(self.class);
        }
    }
}

/// The `503` of a closed bulkhead: no `Retry-After`, the going-away problem document, and
/// over HTTP/1 `Connection: close`, so that hyper closes the connection once it is sent and
/// the client's next request opens a new one (to another instance, behind a balancer).
/// HTTP/2 has no `Connection` field (hyper strips it); there the server's `GOAWAY` at its
/// graceful shutdown tells the client. Marked [`Outcome::Ignored`], so that an adaptive
/// `ShedLayer` around this one does not read the shutdown as back-pressure and cut its
/// limit.
fn going_away(version: Version) -> Response<Bytes> {
    let mut res = problem::about_blank(StatusCode::SERVICE_UNAVAILABLE, GOING_AWAY);
    res.extensions_mut().insert(Outcome::Ignored);
    if matches!(version, Version::HTTP_10 | Version::HTTP_11) {
        res.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    res
}

/// What the inner service's answer tells an adaptive bulkhead: `503`, `504` and errors (a
/// timeout layer's among them) are back-pressure, and so is `408`, the answer of a timeout
/// layer that answers rather than fails (the request was whole: the server ran out of
/// time); the other `4xx` say nothing about the server's capacity (ignored): a `429` is
/// one client over its own quota; the rest is a served call. An [`Outcome`] in the
/// response's extensions wins over all that: the inner service's, or `Ignored` on the
/// answers of this crate's layers that say nothing of the server's capacity (the `503` of a
/// `RateLimitLayer` whose gate could not decide, the going-away `503` of a closed
/// `ShedLayer`).
fn outcome<B, E>(res: &Result<Response<B>, E>) -> Outcome {
    let res = match res {
        Err(_) => return Outcome::BackPressure,
        Ok(res) => res,
    };
    if let Some(&marked) = res.extensions().get::<Outcome>() {
        return marked;
    }
    match res.status() {
        StatusCode::SERVICE_UNAVAILABLE
        | StatusCode::GATEWAY_TIMEOUT
        | StatusCode::REQUEST_TIMEOUT => Outcome::BackPressure,
        s if s.is_client_error() => Outcome::Ignored,
        _ => Outcome::Ok,
    }
}

impl<S, ReqBody> fmt::Debug for ShedFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::Try => "try",
            State::Wait(_) => "wait",
            State::Call(..) => "call",
            State::Done => "done",
        };
        f.debug_struct("ShedFuture")
            .field("class", &self.class)
            .field("state", &state)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulkhead() -> Bulkhead {
        Bulkhead::new(2).unwrap()
    }

    #[test]
    fn retry_after_is_whole_seconds_rounded_up() {
        for (given, sent) in [(1000, "1"), (1200, "2"), (1, "1"), (3000, "3"), (2999, "3")] {
            let layer = ShedLayer::builder(bulkhead())
                .retry_after(Duration::from_millis(given))
                .build()
                .unwrap();
            assert_eq!(layer.shared.retry_after, sent, "{given} ms");
        }
        let longest = ShedLayer::builder(bulkhead())
            .retry_after(Duration::MAX)
            .build()
            .unwrap();
        assert_eq!(longest.shared.retry_after, "999999999999999");
    }

    #[test]
    fn bad_config_is_an_error() {
        let err = ShedLayer::builder(bulkhead())
            .retry_after(Duration::ZERO)
            .build()
            .unwrap_err();
        assert_eq!(err.field(), "shed.retry_after");
        let err = ShedLayer::builder(bulkhead())
            .wait(true)
            .build()
            .unwrap_err();
        assert_eq!(err.field(), "shed.wait");
        assert_eq!(err.kind(), ConfigErrorKind::Inconsistent);
        let timed = Bulkhead::builder(2)
            .wait_timeout(Duration::from_millis(10))
            .build()
            .unwrap();
        assert!(ShedLayer::builder(timed).wait(true).build().is_ok());
    }

    #[test]
    fn debug_shows_the_layer_once() {
        let layer = ShedLayer::builder(bulkhead()).name("api").build().unwrap();
        let shown = format!("{layer:?}");
        assert!(
            shown.starts_with("ShedLayer { name: Some(\"api\")"),
            "{shown}"
        );
        assert_eq!(shown.matches("ShedLayer").count(), 1, "{shown}");
    }

    #[test]
    fn public_types_are_send_sync() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<ShedLayer>();
        send_sync::<ShedLayerBuilder>();
        send_sync::<Shed<()>>();
        send_sync::<ShedStats>();
    }
}
