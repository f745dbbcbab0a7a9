//! `RateLimitLayer`, the state its services share, and the decision every request goes
//! through (its builder is in `builder`).

use std::cell::RefCell;
use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::ops::ControlFlow;
use std::pin::Pin;
use std::sync::PoisonError;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode};
use tower::Layer;

use crate::clock::Clock;
use crate::decision::Decision;
use crate::error::{ConfigError, ConfigErrorKind};
use crate::gate::{Gate, GateError, Registration};
use crate::http::body::WrapBody;
use crate::http::fields::{self, Fields, HeaderStyles, Member, PolicyParts};
use crate::http::key::{MissingKey, RequestInfo};
use crate::http::problem::{self, QUOTA_EXCEEDED};
use crate::http::rate_limit::policy::Policy;
use crate::http::rate_limit::service::RateLimit;
use crate::http::striped::Striped;
use crate::http::topn::{RejectedKey, TopRejected};
use crate::metrics::Counter;
use crate::rate::Quota;
use crate::sync::{Arc, with_reused};

/// The most policies one layer takes (one all-or-nothing call decides at most 32 limits).
pub(super) const MAX_POLICIES: usize = 32;

/// How often rejections are logged, at most.
const LOG_EVERY_MS: u64 = 60_000;

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
/// per layer.
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
///   holds a value of another type under): `503` with `Retry-After: 1` and a problem body of type
///   `…#temporary-reduced-capacity` with no violated policy. The layer adds no wait and no
///   retry of its own: the gate's timeout and failure policy apply unchanged (a fail-open
///   decision is admitted and counted as `fail_open`; it is left out of the fields, as it
///   says nothing about a quota).
/// - **Fail closed** (a [`Decision::fail_closed`](crate::Decision::fail_closed) from
///   [`FailurePolicy::Closed`](crate::gate::FailurePolicy::Closed): the backend could not
///   decide): `503` as for a gate error, `Retry-After` the time until the gate asks its
///   backend again (rounded up, at least 1), no fields; counted as `fail_closed`, not as a
///   rejection, and no key goes to the top-N sketch (an outage is not abuse by every key).
/// - **No key**, with [`MissingKey::Refuse`]: `400 Bad Request` with a problem body
///   (`about:blank`) whose `detail` names the policy; counted as `missing_key`.
/// - **A request that can never be decided** (its cost above a policy's burst, or a key
///   the gate refuses: longer than 512 bytes): `400 Bad Request` with a problem body whose
///   `detail` says why; counted as `bad_request`. A cost of zero is a free request: it
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
/// | token bucket (`Quota`: rate, burst) | the burst | time to refill from empty to full: ⌈burst × period / count⌉ | remaining | ⌈time to full⌉ | ⌈retry_after⌉ |
/// | fixed window (`Rate`) | count | ⌈period⌉ | remaining | ⌈time to the window's end⌉ | ⌈retry_after⌉ |
/// | sliding log / sliding window (`Rate`) | count | ⌈period⌉ | remaining | ⌈time to full⌉ | ⌈retry_after⌉ |
///
/// A token bucket has no window. It sends `w` = the time the bucket takes to refill from
/// empty, so that `q / w` is its sustained rate (rounded down, which errs on the side the
/// draft asks: a client reading the fields never sends more than the bucket admits). The
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
/// that a [`MissingKey::Refuse`] policy would refuse with `400` is counted once as
/// `missing_key`, and then decided (charged, and counted) on the other policies that apply,
/// so that their fields are written (counted `admitted` when none applies): in shadow mode
/// such a request counts in two outcomes.
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
/// `bad_request`, and `cancelled`: dropped before the gate answered),
/// the same counts as [`stats`](RateLimitLayer::stats). Keys are never labels.
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

/// How many requests ended each way, from [`RateLimitLayer::stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RateLimitStats {
    /// Admitted by every policy that applied (or by none applying).
    pub admitted: u64,
    /// Refused with `429`.
    pub rejected: u64,
    /// Would have been refused; passed because the layer is in shadow mode.
    pub shadow_rejected: u64,
    /// The gate returned an error: answered `503` (passed in shadow mode).
    pub gate_error: u64,
    /// Admitted by the gate's fail-open policy (the backend could not decide).
    pub fail_open: u64,
    /// Refused by the gate's fail-closed policy (the backend could not decide): answered
    /// `503` (passed in shadow mode).
    pub fail_closed: u64,
    /// Refused with `400` because a policy with [`MissingKey::Refuse`] found no key
    /// (once per request, however many policies found none). In shadow mode the request
    /// passes, decided on the other policies that apply, and counted by that decision too.
    pub missing_key: u64,
    /// Refused with `400` because the request itself cannot be decided: its cost is above
    /// a policy's capacity (it could never pass), or a key is not one the gate takes (too
    /// long with the prefix and the policy's name before it). Passed in shadow mode.
    pub bad_request: u64,
    /// Given up before it was decided: its response future was dropped before the gate
    /// answered (the client went away during a remote gate's round trip, or before the
    /// future was first polled). Its cost may be charged all the same (see
    /// [`RateLimitFuture`](crate::http::RateLimitFuture)). A request dropped once passed
    /// on counts as decided (`admitted`, say).
    pub cancelled: u64,
}

/// The outcome of one request.
#[derive(Debug, Clone, Copy)]
pub(super) enum Outcome {
    Admitted,
    Rejected,
    ShadowRejected,
    GateError,
    FailOpen,
    FailClosed,
    MissingKey,
    BadRequest,
    Cancelled,
}

impl Outcome {
    pub(super) const ALL: [Outcome; 9] = [
        Outcome::Admitted,
        Outcome::Rejected,
        Outcome::ShadowRejected,
        Outcome::GateError,
        Outcome::FailOpen,
        Outcome::FailClosed,
        Outcome::MissingKey,
        Outcome::BadRequest,
        Outcome::Cancelled,
    ];

    pub(super) fn as_str(self) -> &'static str {
        match self {
            Outcome::Admitted => "admitted",
            Outcome::Rejected => "rejected",
            Outcome::ShadowRejected => "shadow_rejected",
            Outcome::GateError => "gate_error",
            Outcome::FailOpen => "fail_open",
            Outcome::FailClosed => "fail_closed",
            Outcome::MissingKey => "missing_key",
            Outcome::BadRequest => "bad_request",
            Outcome::Cancelled => "cancelled",
        }
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

/// The keys of one request: for each policy that applies, its index and where its gate key
/// is in `buf`; room for the gate's decisions; and the string a key extractor writes into.
/// A request decided locally borrows the thread's [`Keys`] ([`Keys::with`]): once a thread
/// has decided a request, the next costs no allocation here. A request the gate decides
/// through its future takes a copy of its keys and spans along.
#[derive(Debug, Default)]
pub(crate) struct Keys {
    buf: String,
    spans: Vec<(usize, usize, usize)>,
    decisions: Vec<Decision>,
    /// Where a policy's key extractor writes: its own string, so whatever it does to it
    /// (`*key = ..`, `clear`) cannot touch the other policies' keys in `buf`.
    scratch: String,
}

thread_local! {
    /// The thread's reused [`Keys`].
    static THREAD_KEYS: RefCell<Keys> = const {
        RefCell::new(Keys {
            buf: String::new(),
            spans: Vec::new(),
            decisions: Vec::new(),
            scratch: String::new(),
        })
    };
}

impl Keys {
    /// `f` of the thread's keys, cleared; of new ones when they are in use (a key extractor
    /// or a gate deciding another request on this thread: no panic, an allocation). Buffers
    /// that grew large are let go afterwards, so a thread keeps at most a few KiB.
    fn with<R>(f: impl FnOnce(&mut Keys) -> R) -> R {
        with_reused(&THREAD_KEYS, |keys| {
            keys.buf.clear();
            keys.spans.clear();
            keys.decisions.clear();
            let r = f(keys);
            if keys.buf.capacity() > 4096
                || keys.scratch.capacity() > 4096
                || keys.spans.capacity() > MAX_POLICIES
                || keys.decisions.capacity() > MAX_POLICIES
            {
                *keys = Keys::default();
            }
            r
        })
    }
}

/// A verdict once put in its [`Slots`]: a byte, so that what returns it to the future's
/// match copies nothing (the whole verdict, 144 bytes, was copied on each step). A verdict
/// made at once ([`Shared::decide`]) returns not even that: [`Slots::answer`] tells.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ruling {
    /// Pass to the inner service, adding the fields put in [`Slots::fields`].
    Pass,
    /// Answer with the response put in [`Slots::answer`].
    Answer,
}

/// Where a verdict goes: the response future's own places for the fields of the inner
/// service's response and for the layer's answer.
pub(crate) struct Slots<'a> {
    pub(crate) fields: &'a mut Option<Fields>,
    pub(crate) answer: &'a mut Option<Response<Bytes>>,
}

/// What the layer does with a decided request.
pub(crate) enum Verdict {
    /// Pass to the inner service, adding these fields to its response.
    Pass(Option<Fields>),
    /// Answer with this response (429, 503).
    Answer(Response<Bytes>),
}

impl Verdict {
    /// Put the verdict in `slots`; what the future does next.
    pub(crate) fn put(self, slots: Slots<'_>) -> Ruling {
        match self {
            Verdict::Pass(fields) => {
                *slots.fields = fields;
                Ruling::Pass
            }
            Verdict::Answer(res) => {
                *slots.answer = Some(res);
                Ruling::Answer
            }
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

/// One head of gate keys (`<key prefix><policy name>:`) of the layers alive over a gate
/// whose key is one bucket whatever the quota ([`Gate::key_space`]): the quota they count
/// it with, and how many layers hold it.
struct Head {
    space: usize,
    head: String,
    quota: Quota,
    layers: usize,
}

/// Every [`Head`] held, in the process.
static HEADS: std::sync::Mutex<Vec<Head>> = std::sync::Mutex::new(Vec::new());

/// The heads of one layer's gate keys in [`HEADS`], given back when it is dropped.
pub(super) struct HeadClaim {
    space: usize,
    heads: Vec<String>,
}

impl HeadClaim {
    /// Hold `heads` (each with its quota and its policy's name) in the gate keys `space`.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] on `rate_limit.policies` when a layer alive over `space` holds one
    /// of the heads with another quota; nothing is held then.
    pub(super) fn new<'a>(
        space: usize,
        heads: impl Iterator<Item = (String, Quota, &'a str)>,
    ) -> Result<HeadClaim, ConfigError> {
        let heads: Vec<(String, Quota, &str)> = heads.collect();
        let mut held = HEADS.lock().unwrap_or_else(PoisonError::into_inner);
        for (head, quota, name) in &heads {
            if let Some(other) = held
                .iter()
                .find(|h| h.space == space && h.head == *head && h.quota != *quota)
            {
                return Err(ConfigError::new(
                    "rate_limit.policies",
                    ConfigErrorKind::Inconsistent,
                    format!(
                        "policy {name:?} ({quota}) counts under the gate keys {head:?}<key> \
                         that a layer alive on this gate counts with another quota \
                         ({}): one key holds one bucket on this gate; give one of the \
                         layers a key_prefix, or the policy another name (to change a \
                         policy's quota at run time, drop every layer, service and \
                         response future of the old one first)",
                        other.quota
                    ),
                ));
            }
        }
        for (head, quota, _) in &heads {
            match held
                .iter_mut()
                .find(|h| h.space == space && h.head == *head)
            {
                Some(h) => h.layers += 1,
                None => held.push(Head {
                    space,
                    head: head.clone(),
                    quota: *quota,
                    layers: 1,
                }),
            }
        }
        Ok(HeadClaim {
            space,
            heads: heads.into_iter().map(|(head, _, _)| head).collect(),
        })
    }
}

impl Drop for HeadClaim {
    fn drop(&mut self) {
        let mut held = HEADS.lock().unwrap_or_else(PoisonError::into_inner);
        held.retain_mut(|h| {
            if h.space == self.space && self.heads.contains(&h.head) {
                h.layers -= 1;
            }
            h.layers > 0
        });
    }
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

impl<G> Shared<G> {
    fn count(&self, outcome: Outcome) {
        self.counts.add(outcome as usize, 1);
        self.counters[outcome as usize].increment(1);
    }

    pub(crate) fn stats(&self) -> RateLimitStats {
        let c = |o: Outcome| self.counts.get(o as usize);
        RateLimitStats {
            admitted: c(Outcome::Admitted),
            rejected: c(Outcome::Rejected),
            shadow_rejected: c(Outcome::ShadowRejected),
            gate_error: c(Outcome::GateError),
            fail_open: c(Outcome::FailOpen),
            fail_closed: c(Outcome::FailClosed),
            missing_key: c(Outcome::MissingKey),
            bad_request: c(Outcome::BadRequest),
            cancelled: c(Outcome::Cancelled),
        }
    }

    /// A request dropped before it was decided.
    pub(crate) fn cancelled(&self) {
        self.count(Outcome::Cancelled);
    }

    /// Take the request's keys (into `keys`, which [`Keys::with`] cleared): `Continue` with
    /// the cost to ask the gate for, or `Break` with what to do at once when no policy
    /// applies, the request is free, or a key is missing under [`MissingKey::Refuse`].
    fn prepare(&self, req: &RequestInfo<'_>, keys: &mut Keys) -> ControlFlow<Verdict, u32> {
        // In shadow mode: whether a key was missing under `Refuse` already (the request is
        // counted once, as the real mode refuses it once).
        let mut refused = false;
        for (i, entry) in self.policies.iter().enumerate() {
            let start = keys.buf.len();
            keys.buf.push_str(&entry.head);
            keys.scratch.clear();
            if entry.policy.key.extract(req, &mut keys.scratch) && !keys.scratch.is_empty() {
                keys.buf.push_str(&keys.scratch);
            } else {
                match &entry.policy.missing {
                    MissingKey::Shared(k) => keys.buf.push_str(k),
                    MissingKey::Skip => {
                        keys.buf.truncate(start);
                        continue;
                    }
                    _ if self.shadow => {
                        // Shadow mode refuses nothing: count the request that would have
                        // been refused (once, however many policies would refuse it) and go
                        // on with the other policies.
                        if !refused {
                            refused = true;
                            self.count(Outcome::MissingKey);
                        }
                        keys.buf.truncate(start);
                        continue;
                    }
                    _ => {
                        self.count(Outcome::MissingKey);
                        return ControlFlow::Break(Verdict::Answer(problem::bad_request(
                            &format!(
                                "the request has no key for the policy \"{}\"",
                                entry.policy.name
                            ),
                        )));
                    }
                }
            }
            keys.spans.push((i, start, keys.buf.len()));
        }
        if keys.spans.is_empty() {
            self.count(Outcome::Admitted);
            return ControlFlow::Break(Verdict::Pass(None));
        }
        let cost = self.cost.as_ref().map_or(1, |f| f(req));
        if cost == 0 {
            // A free request: nothing to charge, nothing to decide.
            self.count(Outcome::Admitted);
            return ControlFlow::Break(Verdict::Pass(None));
        }
        ControlFlow::Continue(cost)
    }

    /// The `(key, quota)` list of `keys` for the gate.
    fn limits<'k>(&self, keys: &'k Keys) -> Vec<(&'k str, Quota)> {
        keys.spans
            .iter()
            .map(|&(i, start, end)| (&keys.buf[start..end], self.policies[i].policy.quota))
            .collect()
    }

    /// `f` of the `(key, quota)` list of `keys`, held on the stack.
    fn with_limits<R>(&self, keys: &Keys, f: impl FnOnce(&[(&str, Quota)]) -> R) -> R {
        fn fill<'k, const N: usize>(
            limits: &mut [(&'k str, Quota); N],
            keys: &'k Keys,
            policies: &[Entry],
        ) -> usize {
            for (slot, &(i, start, end)) in limits.iter_mut().zip(&keys.spans) {
                *slot = (&keys.buf[start..end], policies[i].policy.quota);
            }
            keys.spans.len().min(N)
        }
        if let [(i, start, end)] = keys.spans[..] {
            // One policy (the common case): nothing to fill.
            return f(&[(&keys.buf[start..end], self.policies[i].policy.quota)]);
        }
        let empty = ("", self.policies[0].policy.quota);
        if keys.spans.len() <= 4 {
            let mut limits = [empty; 4];
            let n = fill(&mut limits, keys, &self.policies);
            f(&limits[..n])
        } else {
            let mut limits = [empty; MAX_POLICIES];
            let n = fill(&mut limits, keys, &self.policies);
            f(&limits[..n])
        }
    }

    /// What to do with a request the gate decided (or failed to).
    pub(crate) fn conclude(
        &self,
        keys: &Keys,
        decided: Result<&[Decision], &GateError>,
    ) -> Verdict {
        let decisions = match decided {
            Ok(d) if d.len() == keys.spans.len() => d,
            // The request itself cannot be decided: a client error, not the gate's. (A key
            // Redis holds a value of another type under is the server's: a gate error.)
            Err(e @ (GateError::Cost(_) | GateError::InvalidKey(_))) => {
                self.count(Outcome::BadRequest);
                if self.shadow {
                    return Verdict::Pass(None);
                }
                return Verdict::Answer(problem::bad_request(&e.to_string()));
            }
            // A gate that answers the wrong number of decisions is as broken as one that
            // errs.
            Ok(_) | Err(_) => {
                if let Err(e) = decided {
                    tracing::debug!(
                        layer = self.name.as_deref().unwrap_or(crate::metrics::DEFAULT_NAME),
                        error = %e,
                        "rate limit: gate error",
                    );
                }
                return self.unavailable(Outcome::GateError, 1);
            }
        };
        // The common case, one policy that admits: nothing blocked or violated to work out,
        // and the fields take one member, not the filtered zip below (measured with
        // callgrind: ~60 instructions a request fewer without fields, ~195 with them).
        if let ([(i, _, _)], [d]) = (&keys.spans[..], decisions)
            && d.allowed
            && d.capacity != u64::MAX
        {
            // Worked out only if a style is on (`Fields::new` looks at the styles first).
            let member = std::iter::once_with(|| {
                self.policies[*i].member(d.remaining, Some(fields::reset_secs(d)))
            });
            let all = self.policies.len() == 1;
            let fields = Fields::new(
                self.styles,
                member,
                self.all_policy.as_ref().filter(|_| all),
                false,
            );
            self.count(Outcome::Admitted);
            return Verdict::Pass(fields);
        }
        let allowed = decisions.iter().all(|d| d.allowed);
        if !allowed && decisions.iter().any(Decision::is_fail_closed) {
            // Refused by the gate's failure policy: the server could not decide, the client
            // is not over a quota. A 503 saying when the backend is asked again, like a gate
            // error; no fields (no quota stands behind it), no rejected key.
            let retry_after = decisions
                .iter()
                .filter(|d| d.is_fail_closed())
                .map(|d| fields::ceil_secs(d.retry_after))
                .fold(1, u64::max);
            return self.unavailable(Outcome::FailClosed, retry_after);
        }
        let fail_open = decisions.iter().any(Decision::is_fail_open);
        // The policies that blocked: a rejection with a retry_after of its own (the others
        // had room but were not charged). If none says so, all of them did.
        let blocked = |d: &Decision| !d.allowed && !d.retry_after.is_zero();
        let any_blocked = decisions.iter().any(blocked);
        let violated = |d: &Decision| !allowed && (blocked(d) || !any_blocked);
        let mut retry_after = 1u64;
        let mut violated_mask = 0u32;
        if !allowed {
            for (&(i, _, _), d) in keys.spans.iter().zip(decisions) {
                if violated(d) {
                    retry_after = retry_after.max(fields::ceil_secs(d.retry_after));
                    violated_mask |= 1 << i;
                }
            }
        }
        // The fields' members: every policy applied, but a fail-open decision.
        let members = keys
            .spans
            .iter()
            .zip(decisions)
            .filter(|(_, d)| d.capacity != u64::MAX)
            .map(|(&(i, _, _), d)| {
                let t = (allowed || violated(d)).then(|| fields::reset_secs(d));
                self.policies[i].member(d.remaining, t)
            });
        // Every policy applied and none failed open: the layer's `RateLimit-Policy`, as built.
        let all = !fail_open && keys.spans.len() == self.policies.len();
        let fields = Fields::new(
            self.styles,
            members,
            self.all_policy.as_ref().filter(|_| all),
            !allowed,
        );
        if allowed {
            self.count(if fail_open {
                Outcome::FailOpen
            } else {
                Outcome::Admitted
            });
            return Verdict::Pass(fields);
        }
        self.record_rejection(keys, violated_mask);
        if self.shadow {
            self.count(Outcome::ShadowRejected);
            return Verdict::Pass(fields);
        }
        self.count(Outcome::Rejected);
        let body = if violated_mask.is_power_of_two() {
            self.policies[violated_mask.trailing_zeros() as usize]
                .quota_exceeded
                .clone()
        } else {
            let names: Vec<&str> = self
                .policies
                .iter()
                .enumerate()
                .filter(|(i, _)| violated_mask & (1 << i) != 0)
                .map(|(_, e)| e.policy.name.as_str())
                .collect();
            problem::document(QUOTA_EXCEEDED, StatusCode::TOO_MANY_REQUESTS, &names)
        };
        let mut res = problem::response(
            StatusCode::TOO_MANY_REQUESTS,
            body,
            fields::integer_value(retry_after),
        );
        if let Some(fields) = fields {
            fields.write(res.headers_mut(), false);
        }
        Verdict::Answer(res)
    }

    /// The gate could not decide (`outcome`): `503` with `Retry-After: retry_after` seconds
    /// and the temporary-reduced-capacity problem body, no fields; passed in shadow mode.
    fn unavailable(&self, outcome: Outcome, retry_after: u64) -> Verdict {
        self.count(outcome);
        if self.shadow {
            return Verdict::Pass(None);
        }
        Verdict::Answer(problem::response(
            StatusCode::SERVICE_UNAVAILABLE,
            self.gate_error_body.clone(),
            fields::integer_value(retry_after),
        ))
    }

    /// Record the blocked keys in the top-N sketch; log at most once a minute.
    fn record_rejection(&self, keys: &Keys, violated_mask: u32) {
        let skip = self.prefix.len();
        for &(i, start, end) in &keys.spans {
            if violated_mask & (1 << i) != 0 {
                self.top.record(&keys.buf[start + skip..end]);
            }
        }
        self.since_log.fetch_add(1, Ordering::Relaxed);
        // The time-stamp counter: a flood of 429s reads it on each (the OS clock cost
        // ~35 ns a read here).
        let now_ms = u64::try_from(self.log_clock.now().as_millis()).unwrap_or(u64::MAX);
        let next = self.next_log_ms.load(Ordering::Relaxed);
        if now_ms >= next
            && self
                .next_log_ms
                .compare_exchange(
                    next,
                    now_ms.saturating_add(LOG_EVERY_MS),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok()
        {
            let since = self.since_log.swap(0, Ordering::Relaxed);
            // With their error bounds: when keys rotate, a count can be nearly all error.
            let top = self.top.top(5);
            tracing::warn!(
                layer = self.name.as_deref().unwrap_or(crate::metrics::DEFAULT_NAME),
                rejected = since,
                shadow = self.shadow,
                top = ?top,
                "rate limit: requests rejected",
            );
        }
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
