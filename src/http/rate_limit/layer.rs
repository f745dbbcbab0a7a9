//! `RateLimitLayer`, the state its services share, and the decision every request goes
//! through (its builder is in `builder`).
//!
//! Its parts: the counts in `stats`, a request's keys in `keys`, what the gate's decisions
//! come to in `verdict`, the heads of gate keys a layer holds in `heads`.

mod heads;
mod keys;
mod stats;
mod verdict;

use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::ops::ControlFlow;
use std::pin::Pin;
use std::sync::atomic::AtomicU64;

use bytes::Bytes;
use http::HeaderValue;
use tower::Layer;

use crate::clock::Clock;
use crate::decision::Decision;
use crate::gate::{Gate, GateError, Registration};
use crate::http::body::WrapBody;
use crate::http::fields::{HeaderStyles, Member, PolicyParts};
use crate::http::key::RequestInfo;
use crate::http::rate_limit::policy::Policy;
use crate::http::rate_limit::service::RateLimit;
use crate::http::striped::Striped;
use crate::http::topn::{RejectedKey, TopRejected};
use crate::metrics::Counter;
use crate::sync::Arc;

pub(super) use heads::HeadClaim;
pub(crate) use keys::Keys;
pub(super) use stats::Outcome;
pub use stats::RateLimitStats;
pub(crate) use verdict::{Ruling, Slots};

/// The most policies one layer takes (one all-or-nothing call decides at most 32 limits).
pub(super) const MAX_POLICIES: usize = 32;

/// The metric of the layer's decisions.
pub(super) const DECISIONS: &str = "flowgate_http_decisions_total";

/// A request's cost, from its parts.
pub(super) type CostFn = dyn Fn(&RequestInfo<'_>) -> u32 + Send + Sync;

/// A rate-limiting tower layer: decides every request against one or more [`Policy`]s on
/// any [`Gate`] with a [`check_all`](Gate::check_all) (`build` refuses a gate whose
/// [`validate_quotas`](Gate::validate_quotas) refuses the policies' quotas, such as a
/// `RegionGate`), all-or-nothing, and answers `429 Too Many Requests` itself when a policy
/// has no room; every response (admitted or not) carries the rate-limit header fields.
///
/// # Deciding
///
/// Each policy takes the request's key with its [`KeyExtractor`](crate::http::KeyExtractor);
/// the gate key is `<key prefix><policy name>:<key>`. All the policies that apply are
/// decided in one [`Gate::check_all`] call with the request's cost (1, or the
/// [`cost`](crate::http::RateLimitLayerBuilder::cost) closure's): the request is admitted only when every
/// policy has room, and then charged on all of them; a rejected request is charged nowhere
/// by this layer. The policies are token buckets of their own quotas: the gate's own
/// [`Limit`](crate::gate::Limit) (what [`Gate::check`] enforces) plays no part, so a gate
/// built with a window (`Limit::FixedWindow`, as tower's `RateLimit` counts) or with a
/// stricter quota than the policies' does not make the layer count windows or admit less.
/// (Layers stacked one in another decide one after the other: a request the
/// outer one admitted is charged there even when an inner layer, or a
/// [`ShedLayer`](crate::http::ShedLayer), then refuses it. Policies that must be decided
/// together belong in one layer.) On a [`MemoryGate`](crate::gate::MemoryGate) this is a synchronous call in the response
/// future ([`Gate::check_all_local`]): no future is allocated. On a
/// [`RedisGate`](crate::gate::RedisGate) it is one atomic script; on Redis Cluster the keys
/// of one request must share a hash slot: give a [`key_prefix`](crate::http::RateLimitLayerBuilder::key_prefix)
/// with a hash tag (`"{rl}"`; then all the layer's keys live in one slot) or use one policy
/// per layer (`build` refuses several policies without a tag, unless each may skip a request).
///
/// # Responses
///
/// - **Admitted**: the inner service's response, with the fields added.
/// - **Rejected**: `429`, `Retry-After` in whole seconds (the largest `retry_after` of the
///   policies that blocked, rounded up, at least 1), the fields, and an RFC 9457
///   `application/problem+json` body of type `…#quota-exceeded` whose `violated-policies`
///   names the policies that blocked.
/// - **Gate error** (a [`GateError`] the gate's failure policy passes on, such as
///   [`FailurePolicy::Error`](crate::gate::FailurePolicy), a full keyspace, or a key Redis
///   holds a value of another type under): `503` with `Retry-After: 1` (for a gate waiting
///   to ask its backend again, [`GateError::Degraded`], the time until it does, rounded up)
///   and a problem body of type
///   `…#temporary-reduced-capacity` with no violated policy. The layer adds no wait and no
///   retry of its own: the gate's timeout and failure policy apply unchanged (a fail-open
///   decision is admitted and counted as `fail_open`; it is left out of the fields, as it
///   says nothing about a quota).
/// - **Fail closed** (a [`Decision::fail_closed`](crate::Decision::fail_closed) from
///   [`FailurePolicy::Closed`](crate::gate::FailurePolicy::Closed): the backend could not
///   decide): `503` as for a gate error, `Retry-After` the time until the gate asks its
///   backend again (rounded up, at least 1), no fields; counted as `fail_closed`, not as a
///   rejection, and no key goes to the top-N sketch (an outage is not abuse by every key).
/// - **No key**, with [`MissingKey::Refuse`](crate::http::MissingKey::Refuse): `400 Bad Request` with a problem body
///   (`about:blank`) whose `detail` names the policy and, where its extractor says
///   ([`missing_reason`](crate::http::KeyExtractor::missing_reason): a
///   [`Header`](crate::http::Header) missing, empty, too long), why; counted as `missing_key`.
/// - **A request that can never be decided** (its cost above a policy's burst, or a key
///   the gate refuses: longer than 512 bytes): `400 Bad Request` with a problem body whose
///   `detail` says why (for a cost, each policy whose burst it is above, with the burst);
///   counted as `bad_request`. A cost of zero is a free request: it
///   passes without a decision (and without fields).
///
/// # Fields
///
/// One list member per policy applied to the request ([`HeaderStyles`]); the IETF fields
/// follow draft-ietf-httpapi-ratelimit-headers, -10/-11 syntax:
/// `RateLimit-Policy: "per-ip";q=100;w=60` and `RateLimit: "per-ip";r=42;t=17`.
///
/// | limit | `q` | `w` (seconds) | `r` | `t` admitted | `t` rejected |
/// |---|---|---|---|---|---|
/// | token bucket (`Quota`: rate, burst) | what refills in `w`: ⌊count × w / period⌋, at least the burst | time to refill from empty to full: ⌈burst × period / count⌉ | remaining | ⌈time to full⌉ | ⌈retry_after⌉ |
/// | fixed window (`Rate`) | count | ⌈period⌉ | remaining | ⌈time to the window's end⌉ | ⌈retry_after⌉ |
/// | sliding log / sliding window (`Rate`) | count | ⌈period⌉ | remaining | ⌈time to full⌉ | ⌈retry_after⌉ |
///
/// A token bucket has no window. It sends `w` = the time the bucket takes to refill from
/// empty, in whole seconds, and `q` = what it refills in `w` (the burst when the refill
/// takes `w` exactly; more when it is shorter: 10/s with a burst of 1 is `q=10;w=1`), so
/// that `q / w` is its sustained rate (rounded down, by less than one unit per `w`, which
/// errs on the side the draft asks: a client reading the fields never sends more than the
/// bucket admits, and `r` never shows more than the burst). The
/// policies of this layer are token buckets (what [`Gate::check_all`] decides); the rows for
/// the windows are the mapping flowgate uses wherever a gate's own limit is shown.
///
/// On a `429`, every policy is listed with its remaining `r`; only the policies that blocked
/// carry `t` (their `⌈retry_after⌉`), because the time-to-full of the others can be later than
/// `Retry-After`, which the draft forbids. `Retry-After` is thus never earlier than any `t`.
///
/// # Shadow mode
///
/// With [`shadow(true)`](crate::http::RateLimitLayerBuilder::shadow) every request is decided and the
/// fields are written, but nothing is refused: a request that would have been rejected
/// passes, counted as `shadow_rejected` (and recorded in the top rejected keys). Use it to
/// roll a new limit out. A would-be rejection charges nothing, as a real one. A request
/// that a [`MissingKey::Refuse`](crate::http::MissingKey::Refuse) policy would refuse with `400` is counted once as
/// `missing_key`, and then decided (charged, and counted) on the other policies that apply,
/// so that their fields are written (counted `admitted` when none applies): in shadow mode
/// such a request counts in two outcomes (and, charged here and refused there, it leaves its
/// other keys with less than an enforcing layer would: the shadow's later would-be
/// rejections can exceed the enforcing layer's `429`s by that much). A request that can
/// never be decided (`400`, `bad_request`) passes undecided, without fields.
///
/// To enforce, build the layer again with `shadow(false)` over the same gate (a clone of
/// it: a [`MemoryGate`](crate::gate::MemoryGate)'s clones share its buckets) with the same
/// policies and key prefix, and serve it in the shadow layer's place: it decides on the
/// buckets the shadow layer charged, so no key starts over and no burst is granted twice.
/// Its [`stats`](RateLimitLayer::stats) and top rejected keys start from zero. A new gate
/// (or another prefix) starts every bucket full.
///
/// # Abuse visibility
///
/// Each rejection (and shadow rejection) records `<policy name>:<key>` of every policy that
/// blocked in a bounded space-saving sketch ([`TopRejected`]), read with
/// [`top_rejected`](RateLimitLayer::top_rejected), and logged with `tracing` (warn) at most
/// once a minute while rejections happen, with the count since the last log and the top
/// five keys as `top_rejected` gives them: each with its `count` and its `error` (when
/// keys rotate, a key rejected once can show a count of thousands, nearly all error: its
/// rejections are at least `count - error`). The sketch counts from when the layer was
/// built, never reset: the keys logged are the most rejected since then, not in the last
/// minute. No background task.
///
/// Keys are kept and logged as the policies' [`KeyExtractor`](crate::http::KeyExtractor)s
/// wrote them: client addresses (personal data in many jurisdictions), and, for a policy
/// keyed by a secret (an API key, a bearer token), that secret, in the logs, in
/// `top_rejected` and in the gate (on Redis, in key names that `SCAN` or `MONITOR` show).
/// Key such a policy by a digest of the secret (see [`Header`](crate::http::Header)).
///
/// # Metrics
///
/// Labelled by `name`: `flowgate_http_decisions_total` by `outcome` (`admitted`,
/// `rejected`, `shadow_rejected`, `gate_error`, `fail_open`, `fail_closed`, `missing_key`,
/// `bad_request`, and `cancelled`: dropped before the gate answered, or after the recorder
/// panicked counting the outcome, or the inner service's `Clone` panicked in `call`), the
/// same counts as [`stats`](RateLimitLayer::stats),
/// each request in one outcome (but in shadow mode, see above). Keys are never labels.
///
/// # Examples
///
/// ```
/// use flowgate::gate::{Limit, MemoryGate};
/// use flowgate::http::{HeaderStyles, Policy, RateLimitLayer, RequestInfo};
/// use flowgate::Quota;
///
/// // The gate's own limit is not the layer's: the policies' quotas decide.
/// let gate = MemoryGate::new(Limit::TokenBucket(Quota::per_second(1)?));
/// let per_tenant = |req: &RequestInfo<'_>, key: &mut String| {
///     match req.headers.get("x-tenant").and_then(|v| v.to_str().ok()) {
///         Some(t) => { key.push_str(t); true }
///         None => false,
///     }
/// };
/// let layer = RateLimitLayer::builder(gate)
///     .policy(Policy::new("per-tenant", Quota::per_minute(600)?.burst(100)?, per_tenant))
///     .header_styles(HeaderStyles::IETF | HeaderStyles::X_RATELIMIT)
///     .name("api")
///     .build()?;
/// // tower: ServiceBuilder::new().layer(layer); under axum, build it with `.inner_body()`
/// // (responses keep axum's Body), then Router::new().route(..).layer(layer)
/// assert_eq!(layer.stats().admitted, 0);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Body type
///
/// `K` is the [`BodyMode`](crate::http::BodyMode) of the responses: by default
/// ([`WrapBody`]) a [`ResponseBody<B>`](crate::http::ResponseBody) over the inner service's
/// body `B`, which works with any body; with
/// [`inner_body`](crate::http::RateLimitLayerBuilder::inner_body) ([`InnerBody`](crate::http::InnerBody)) the inner body type
/// itself, for bodies made from bytes (axum's `Body`): advised under axum, which boxes any
/// other body type again.
///
/// # Under axum
///
/// - `Router::layer(layer)` decides every request the router answers, an unmatched path's
///   too; `Router::route_layer(layer)` only those that match a route.
/// - Around the whole router, `layer.layer(router)` (with [`tower::Layer`]) served through
///   `axum::ServiceExt::into_make_service_with_connect_info::<SocketAddr>(..)`, it decides
///   every request as under `Router::layer`, for less: axum boxes a layered route once more
///   and clones it for each request, whatever the layer (about 850 instructions a request
///   under callgrind, a quarter of what this layer adds under `Router::layer`; the
///   `flowgate (around router)` row of `benches/http_layer.rs`). `ConnectInfo` reaches the
///   layer all the same.
pub struct RateLimitLayer<G, K = WrapBody> {
    pub(super) shared: Arc<Shared<G>>,
    pub(super) body: PhantomData<fn() -> K>,
}

impl<G, K> Clone for RateLimitLayer<G, K> {
    fn clone(&self) -> Self {
        RateLimitLayer {
            shared: Arc::clone(&self.shared),
            body: PhantomData,
        }
    }
}

impl<G: fmt::Debug, K> fmt::Debug for RateLimitLayer<G, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.shared.fmt(f)
    }
}

impl<G, K> RateLimitLayer<G, K> {
    /// The count of each outcome so far (shared by every clone and every service).
    pub fn stats(&self) -> RateLimitStats {
        self.shared.stats()
    }

    /// The `n` keys rejected most often, as `<policy name>:<key>`, with their counts and
    /// error bounds (see [`TopRejected`]).
    pub fn top_rejected(&self, n: usize) -> Vec<RejectedKey> {
        self.shared.top.top(n)
    }

    /// The `name` label of the layer's metrics, if it was given one.
    pub fn name(&self) -> Option<&str> {
        self.shared.name.as_deref()
    }

    /// Whether the layer is in shadow mode (decides, never refuses).
    pub fn is_shadow(&self) -> bool {
        self.shared.shadow
    }
}

impl<S, G, K> Layer<S> for RateLimitLayer<G, K> {
    type Service = RateLimit<S, G, K>;

    fn layer(&self, inner: S) -> RateLimit<S, G, K> {
        RateLimit::new(inner, Arc::clone(&self.shared))
    }
}

/// A policy with what the layer derived from it at build time.
pub(super) struct Entry {
    pub(super) policy: Policy,
    /// The start of the policy's gate keys: `<key prefix><policy name>:`.
    pub(super) head: String,
    /// Its name, `q` and `w` as the fields show them, serialized once.
    pub(super) parts: PolicyParts,
    /// The problem body of a 429 that this policy alone blocked.
    pub(super) quota_exceeded: Bytes,
}

impl Entry {
    pub(super) fn member(&self, r: u64, t: Option<u64>) -> Member<'_> {
        Member {
            parts: &self.parts,
            r,
            t,
        }
    }
}

/// The future of a gate call that could not be decided locally; it owns the keys it
/// decides and gives them back.
pub(crate) type Check =
    Pin<Box<dyn Future<Output = (Keys, Result<Vec<Decision>, GateError>)> + Send>>;

/// The state every clone of a layer and its services shares.
pub(crate) struct Shared<G> {
    /// The heads of the policies' gate keys, on a gate whose key is one bucket whatever
    /// the quota, held while the layer, a clone of it or a service made from it lives
    /// (first: given back before the gate, whose address names them, can go).
    pub(super) _heads: Option<HeadClaim>,
    pub(super) gate: G,
    pub(super) policies: Box<[Entry]>,
    pub(super) cost: Option<Arc<CostFn>>,
    pub(super) styles: HeaderStyles,
    pub(super) shadow: bool,
    pub(super) prefix: String,
    /// `RateLimit-Policy` of all the policies, serialized once.
    pub(super) all_policy: Option<HeaderValue>,
    pub(super) gate_error_body: Bytes,
    pub(super) top: TopRejected,
    /// Per [`Outcome`], striped by thread (each request counts once: one cache line all
    /// server threads wrote was the layer's most contended write).
    pub(super) counts: Striped<{ Outcome::ALL.len() }>,
    pub(super) counters: [Counter; Outcome::ALL.len()],
    pub(super) name: Option<String>,
    /// The clock of the rejection log (real time, the cheap time-stamp counter).
    pub(super) log_clock: Clock,
    /// Milliseconds on `log_clock` before which no rejection is logged.
    pub(super) next_log_ms: AtomicU64,
    /// Rejections since the last log.
    pub(super) since_log: AtomicU64,
    /// The policies' quotas, registered on the gate while the layer, a clone of it or a
    /// service made from it lives.
    pub(super) _quotas: Registration,
}

impl<G: fmt::Debug> fmt::Debug for Shared<G> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let policies: Vec<&Policy> = self.policies.iter().map(|e| &e.policy).collect();
        f.debug_struct("RateLimitLayer")
            .field("name", &self.name)
            .field("gate", &self.gate)
            .field("policies", &policies)
            .field("styles", &self.styles)
            .field("shadow", &self.shadow)
            .field("prefix", &self.prefix)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl<G: Gate + 'static> Shared<G> {
    /// Decide `req`: at once when no policy applies, a key is missing, or the gate decides
    /// without I/O (no allocation on a gate that decides into the reused decisions, as
    /// [`MemoryGate`](crate::gate::MemoryGate) does), the verdict put in `slots`; else
    /// through the gate's future.
    ///
    /// Returns the gate's future when the gate could not decide at once; `None` when the
    /// verdict is in `slots` (an answer in [`Slots::answer`], else a pass). An `Option` of a
    /// boxed future comes back in two registers: an enum of a verdict or the future was
    /// returned through memory, and read back wider than written (a store-forwarding stall)
    /// at every step up from the thread's keys.
    pub(crate) fn decide(
        self: &Arc<Self>,
        req: &RequestInfo<'_>,
        slots: Slots<'_>,
    ) -> Option<Check> {
        Keys::with(|keys| {
            let cost = match self.prepare(req, keys) {
                ControlFlow::Continue(cost) => cost,
                ControlFlow::Break(verdict) => {
                    verdict.put(slots);
                    return None;
                }
            };
            let mut decisions = std::mem::take(&mut keys.decisions);
            let decided = self.with_limits(keys, |limits| {
                self.gate.check_all_local(limits, cost, &mut decisions)
            });
            // Put where it is concluded: an `Option<Verdict>` in between was one more copy.
            let now = decided.map(|d| {
                self.conclude(keys, d.as_ref().map(|()| &decisions[..]))
                    .put(slots);
            });
            keys.decisions = decisions;
            if now.is_some() {
                return None;
            }
            // The future owns what it decides and concludes from: the keys and their spans
            // (an allocation each; a remote decision costs a round trip anyway).
            let keys = Keys {
                buf: keys.buf.clone(),
                spans: keys.spans.clone(),
                ..Keys::default()
            };
            Some(self.check(keys, cost))
        })
    }

    /// Decide `keys` through the gate's future.
    fn check(self: &Arc<Self>, keys: Keys, cost: u32) -> Check {
        let shared = Arc::clone(self);
        Box::pin(async move {
            let limits = shared.limits(&keys);
            let decided = shared.gate.check_all(&limits, cost).await;
            drop(limits);
            (keys, decided)
        })
    }
}

#[cfg(test)]
mod tests;
