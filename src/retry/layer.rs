//! `RetryLayer`: a tower client layer that retries HTTP requests with a [`RetryPolicy`]
//! (backoff, retry budget, adaptive pacer) and listens to the server's fields.

use std::cmp::Reverse;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::{Duration, SystemTime};

use bytes::Buf;
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body::Body;
use pin_project::{pin_project, pinned_drop};
use tokio::time::{Instant, Sleep};
use tower::{Layer, Service};

use crate::pace::{AdaptivePacer, UntilReady};
use crate::retry::backoff::{GiveUp, Schedule};
use crate::retry::call::{Classify, Outcome, RetryError, RetryPolicy, Stop};
use crate::retry::hint::{PolicyHint, ServerHint};
use crate::sync::Arc;
use crate::time::capped;

/// The most body bytes read from a retried response (so that its connection can be
/// reused) before it is dropped instead.
const DRAIN_LIMIT: usize = 64 * 1024;
/// The most frames read from a retried response's body before it is dropped instead: a
/// body of endless empty frames (or trailers) adds no bytes, and must not be read for ever.
const DRAIN_FRAMES: u32 = 1024;

/// The methods RFC 9110 (§9.2.2) calls idempotent: sending one twice does what sending it
/// once does.
const IDEMPOTENT: [Method; 6] = [
    Method::GET,
    Method::HEAD,
    Method::OPTIONS,
    Method::TRACE,
    Method::PUT,
    Method::DELETE,
];

/// The default classifier of a [`RetryLayer`]: what an HTTP response (or a transport
/// error) means for the request.
///
/// | result | [`Outcome`] |
/// |---|---|
/// | `1xx`, `2xx`, `3xx` | [`Success`](Outcome::Success) |
/// | `429 Too Many Requests`, `503 Service Unavailable` | [`BackPressure`](Outcome::BackPressure), with the server's [`retry_delay`](ServerHint::retry_delay): its `Retry-After`, else the reset of a `RateLimit` policy with nothing remaining |
/// | `408 Request Timeout`, `500`, `502`, `504` | [`Retry`](Outcome::Retry) |
/// | any other `4xx` or `5xx` | [`Fatal`](Outcome::Fatal) |
/// | a transport error (`Err`) | [`Retry`](Outcome::Retry) |
///
/// The layer retries a [`Retry`](Outcome::Retry) only for the methods it is told are safe
/// to send twice (by default the idempotent ones; see [`RetryLayer::retry_methods`]), so a
/// `POST` that met a `500` is not sent again. Back-pressure in a response is retried for
/// every method: a `429` or `503` refuses the request without acting on it (a custom
/// classifier's back-pressure for an error, such as a client's own timeout, is not: it
/// is retried as a `Retry` is).
///
/// A custom classifier is any `Fn(&Result<Response<B>, E>) -> Outcome` (see
/// [`RetryLayer::classify`]); it can fall back to this one through
/// [`HttpClassify::outcome`].
///
/// # Examples
///
/// ```
/// use flowgate::retry::{HttpClassify, Outcome};
/// use http::{HeaderMap, StatusCode};
///
/// let mut headers = HeaderMap::new();
/// headers.insert("retry-after", "3".parse()?);
/// let classify = HttpClassify::new();
/// assert_eq!(
///     classify.outcome(StatusCode::TOO_MANY_REQUESTS, &headers),
///     Outcome::BackPressure { retry_after: Some(std::time::Duration::from_secs(3)) },
/// );
/// assert_eq!(classify.outcome(StatusCode::BAD_GATEWAY, &headers), Outcome::Retry);
/// assert_eq!(classify.outcome(StatusCode::NOT_FOUND, &headers), Outcome::Fatal);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct HttpClassify {}

impl HttpClassify {
    /// The default classifier.
    pub fn new() -> HttpClassify {
        HttpClassify {}
    }

    /// The outcome of a response with `status` and `headers` (see the table of the type).
    /// A `Retry-After` given as an HTTP-date is measured from `SystemTime::now()`.
    pub fn outcome(&self, status: StatusCode, headers: &HeaderMap) -> Outcome {
        match status.as_u16() {
            429 | 503 => Outcome::BackPressure {
                retry_after: ServerHint::from_headers(headers, SystemTime::now()).retry_delay(),
            },
            408 | 500 | 502 | 504 => Outcome::Retry,
            400.. => Outcome::Fatal,
            _ => Outcome::Success,
        }
    }
}

impl<B, E> Classify<Response<B>, E> for HttpClassify {
    fn classify(&self, result: &Result<Response<B>, E>) -> Outcome {
        match result {
            Ok(res) => self.outcome(res.status(), res.headers()),
            Err(_) => Outcome::Retry,
        }
    }
}

/// Tell `pacer` what a response's fields say: the server's sustained rate
/// (`RateLimit-Policy`'s `q` within `w`, the slowest of the policies that allow anything)
/// and its allowance (`RateLimit`'s `r` within `t`), each when the server sent it, the
/// allowance with its own policy's `q` and `w` (which tracking steers it by). A policy of
/// zero quota allows nothing until its reset (its `t`, else its window `w`): an allowance
/// of nothing, which wins over the reported one unless that has nothing left for longer
/// (the rule of [`most_restrictive`](ServerHint::most_restrictive)). A `Retry-After` in the
/// same response takes precedence over the reset, as the draft requires: the allowance ends
/// no later. Call it before reporting the response's outcome, as [`AdaptivePacer`] asks.
///
/// `max_wait` is the longest server hint honoured (the backoff's
/// [`max_retry_after`](crate::retry::BackoffBuilder::max_retry_after)): an allowance
/// slower than one unit per `max_wait` (`r=0;t=86400`) is taken as one unit per `max_wait`,
/// so it holds no later request longer than a `Retry-After` would (a zero `max_wait`, which
/// honours no hint, holds none: the allowance's remaining is still reported). So is a
/// policy slower than that (`q=1;w=86400`, or a window sent in milliseconds by mistake,
/// `q=100;w=60000`): its window is shortened to `q × max_wait`, its quota kept (a zero
/// `max_wait` gives the pacer no policy).
pub(crate) fn feed_hint(pacer: &AdaptivePacer, hint: &ServerHint, max_wait: Duration) {
    if let Some((quota, window)) = hint.sustained_rate_allowing() {
        // One unit per `max_wait` at the slowest: the pacer keeps a policy until another
        // one comes, so a slower one would hold every later request past any hint honoured.
        let units = u32::try_from(quota).unwrap_or(u32::MAX);
        pacer.on_policy(quota, window.min(max_wait.saturating_mul(units)));
    }
    // Of the policy closest to refusing, steered by its own quota (the sustained rate
    // above may be another policy's); a zero quota refills nothing, whatever its window.
    let own = |p: &PolicyHint| match (p.quota, p.window) {
        (Some(0), _) => Some((0, Duration::ZERO)),
        (Some(q), Some(w)) => Some((q, w)),
        _ => None,
    };
    let reported = hint
        .most_restrictive()
        .and_then(|p| Some((p.remaining?, p.reset?, own(p))));
    let closed = hint
        .policies
        .iter()
        .filter(|p| p.quota == Some(0))
        .filter_map(|p| p.reset.or(p.window))
        .max()
        .map(|reset| (0, reset, Some((0, Duration::ZERO))));
    let allowance = reported
        .into_iter()
        .chain(closed)
        .min_by_key(|&(remaining, reset, _)| (remaining, Reverse(reset)));
    if let Some((remaining, reset, of)) = allowance {
        // `Retry-After` takes precedence over a reset (the draft): a sliding window's `t`
        // is when it is full again, its `Retry-After` when the next request fits.
        let reset = hint.retry_after.map_or(reset, |after| reset.min(after));
        // `max(r, 1) / t` is the pacer's cap (see `on_allowance`): at least `1 / max_wait`.
        // A zero `max_wait` honours no hint: a zero reset, which holds nothing.
        let units = u32::try_from(remaining.max(1)).unwrap_or(u32::MAX);
        let reset = reset.min(max_wait.saturating_mul(units));
        pacer.on_allowance_of(remaining, reset, of);
    }
}

/// Which methods a [`Outcome::Retry`] may send again.
#[derive(Debug, Clone)]
enum Methods {
    Any,
    Only(Arc<[Method]>),
}

impl Methods {
    fn allows(&self, method: &Method) -> bool {
        match self {
            Methods::Any => true,
            Methods::Only(methods) => methods.contains(method),
        }
    }
}

/// A tower layer that retries HTTP requests: backoff, retry budget and adaptive pacing
/// from a [`RetryPolicy`], outcomes from a classifier ([`HttpClassify`] by default).
///
/// It wraps a client: any `Service<Request<B>, Response = Response<ResB>>` whose request
/// body can be sent again, `B: Clone` (`Full<Bytes>`, `Empty<Bytes>`, `String`; a
/// streaming body cannot be retried). Each attempt sends a clone of the request; for each
/// one [`Retry`]'s future:
///
/// 1. waits for the policy's [`AdaptivePacer`], if any (after a `Retry-After` it pauses
///    every request until then, up to the backoff's
///    [`max_retry_after`](crate::retry::BackoffBuilder::max_retry_after)); with a backoff
///    [`deadline`](crate::retry::BackoffBuilder::deadline) the pacer's wait counts
///    against it: a retry the pacer would hold until the deadline is not made (the last
///    response is the answer), nor a first attempt ([`RetryError::NotSent`], at once). A
///    pacer shared with other requests may hold one longer than it said when the wait
///    began, which the deadline does not cut: a tower `TimeoutLayer` around this layer
///    bounds the whole;
/// 2. sends the request (the inner service made ready first), under the policy's
///    [`attempt_timeout`](crate::retry::RetryPolicyBuilder::attempt_timeout) if any (a
///    timed-out attempt is back-pressure; the backoff's deadline is checked only between
///    attempts, so this is what bounds an attempt under way);
/// 3. classifies the result; feeds the response's `RateLimit-Policy` / `RateLimit`
///    fields to the pacer (every response, not only refusals: the server's remaining
///    steers the rate before any `429`; an allowance slower than one unit per the
///    backoff's [`max_retry_after`](crate::retry::BackoffBuilder::max_retry_after), such
///    as `r=0` with a reset of a day, is taken as one unit per `max_retry_after`, so it
///    holds later requests no longer than a `Retry-After` would, and so is a policy
///    slower than that, such as `q=100;w=60000` (a window in milliseconds by mistake),
///    which the pacer would keep until another one came; a policy of zero quota,
///    `q=0`, holds them until its reset, its `t` or else its window, bounded the same
///    way, while the other policies still cap the rate; a `Retry-After` in the same
///    response takes precedence over the reset, as the draft requires, so a refusal is
///    retried after its `Retry-After` even when a `t` is later); reports the outcome and
///    the attempt's own
///    round-trip time to the policy (the budget, the pacer, the metrics): the RTT of
///    that attempt alone, from sending to the response, never the waits before it nor
///    the earlier attempts;
/// 4. stops on success or a fatal outcome; else asks the backoff and the budget, waits
///    (the server's `Retry-After` when it sent one) and goes again, or stops.
///
/// The response is the last attempt's (on giving up after `429`s, the last `429`, its
/// `Retry-After` and fields intact), with a [`RetryInfo`] in its extensions. The error is
/// the last attempt's own error, [`RetryError::Inner`], [`RetryError::TimedOut`] when
/// the last attempt ran past the attempt timeout, or [`RetryError::NotSent`] when none was
/// sent. An error of the inner service's
/// `poll_ready` before a retry ends the request with that error, a [`Stop::Fatal`]. Every
/// error says why the retries stopped and after how many attempts, as a [`RetryInfo`]
/// does for a response: [`RetryError::stop`] (the attempts ran out or the deadline,
/// [`Stop::GaveUp`]; the budget, [`Stop::Budget`]; a method not sent twice,
/// [`Stop::NotRetryable`]; a fatal error, [`Stop::Fatal`]) and [`RetryError::attempts`];
/// the `flowgate_retry_stopped_total` metric counts the same by `stop`.
///
/// A response is classified by its head, and given out as soon as it is a success or
/// final: its body is the caller's to read, and a failure there (a connection reset
/// mid-body, a body cut short) is the error the body gives, never retried. To retry those
/// too, read the body inside the inner service (a `service_fn` that collects it) so that
/// the failure is the attempt's own error.
///
/// An [`Outcome::Retry`] (a `500`, a transport error), a timed-out attempt and an
/// [`Outcome::BackPressure`] the classifier gave an error (a client's own timeout) are
/// retried only for the methods of [`retry_methods`](RetryLayer::retry_methods), by
/// default the idempotent ones (`GET`, `HEAD`, `OPTIONS`, `TRACE`, `PUT`, `DELETE`): the
/// request may have been acted on, so for the others it is final ([`Stop::NotRetryable`];
/// a timeout [`Stop::TimedOut`]; either way the budget counts the failure, and the
/// pacer hears of back-pressure). Back-pressure in a response (a `429` or `503`) is
/// retried for every method: the server refused the request without acting on it.
///
/// The layer, its services and their futures follow tower's rules: `poll_ready` only asks
/// the inner service; the service that was made ready goes with the request (the layer
/// keeps a fresh clone, `mem::replace`); later attempts make that service ready again
/// themselves. Clones share the policy (and so its budget, pacer and metrics).
///
/// A retried response's body is read and dropped during the wait before the next attempt
/// (up to 64 KiB or 1 024 frames; a longer one, or one still arriving when the wait ends,
/// is dropped unread): hyper's client returns a connection to its pool only once its response was read,
/// so refusals do not cost a new connection each.
///
/// # Examples
///
/// ```
/// use std::convert::Infallible;
/// use std::sync::Arc;
/// use std::sync::atomic::{AtomicU32, Ordering};
/// use std::time::Duration;
/// use flowgate::retry::{Backoff, RetryInfo, RetryLayer, RetryPolicy, Stop};
/// use http::{HeaderValue, Request, Response, StatusCode, header::RETRY_AFTER};
/// use tower::{Layer, ServiceExt, service_fn};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// // A server that answers `503` with `Retry-After: 2` twice, then `200`.
/// let calls = Arc::new(AtomicU32::new(0));
/// let server = service_fn(move |_req: Request<String>| {
///     let n = calls.fetch_add(1, Ordering::Relaxed) + 1;
///     async move {
///         let mut res = Response::new(format!("answer {n}"));
///         if n < 3 {
///             *res.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
///             res.headers_mut().insert(RETRY_AFTER, HeaderValue::from_static("2"));
///         }
///         Ok::<_, Infallible>(res)
///     }
/// });
///
/// let policy = RetryPolicy::builder(Backoff::builder().seed(1).build()?).build()?;
/// let client = RetryLayer::new(policy).layer(server);
///
/// let start = tokio::time::Instant::now();
/// let res = client.oneshot(Request::get("/").body(String::new())?).await?;
/// assert_eq!(res.status(), StatusCode::OK);
/// assert_eq!(start.elapsed(), Duration::from_secs(4)); // what the server asked for
/// let info = res.extensions().get::<RetryInfo>().unwrap();
/// assert_eq!((info.attempts, &info.stop), (3, &Stop::Success));
/// assert_eq!(res.into_body(), "answer 3");
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct RetryLayer<C = HttpClassify> {
    policy: RetryPolicy,
    classify: C,
    methods: Methods,
}

impl RetryLayer<HttpClassify> {
    /// A layer retrying with `policy`, classifying with [`HttpClassify`], retrying
    /// [`Outcome::Retry`] for the idempotent methods only.
    pub fn new(policy: RetryPolicy) -> RetryLayer<HttpClassify> {
        RetryLayer {
            policy,
            classify: HttpClassify::new(),
            methods: Methods::Only(Arc::from(IDEMPOTENT.as_slice())),
        }
    }
}

impl<C> RetryLayer<C> {
    /// Classify with `classify` instead: a [`Classify`] of the inner service's result,
    /// such as `|r: &Result<Response<B>, E>| -> Outcome`. It is called once per attempt.
    ///
    /// # Examples
    ///
    /// ```
    /// use flowgate::retry::{Backoff, HttpClassify, Outcome, RetryLayer, RetryPolicy};
    /// use http::{Response, StatusCode};
    ///
    /// let policy = RetryPolicy::builder(Backoff::builder().build()?).build()?;
    /// // Also retry `409 Conflict`; everything else as by default.
    /// let layer = RetryLayer::new(policy).classify(
    ///     |r: &Result<Response<String>, std::io::Error>| match r {
    ///         Ok(res) if res.status() == StatusCode::CONFLICT => Outcome::Retry,
    ///         Ok(res) => HttpClassify::new().outcome(res.status(), res.headers()),
    ///         Err(_) => Outcome::Retry,
    ///     },
    /// );
    /// # let _ = layer;
    /// # Ok::<(), flowgate::ConfigError>(())
    /// ```
    pub fn classify<D>(self, classify: D) -> RetryLayer<D> {
        RetryLayer {
            policy: self.policy,
            classify,
            methods: self.methods,
        }
    }

    /// Retry an [`Outcome::Retry`], a timed-out attempt or back-pressure without a response
    /// (the classifier's for an error) only for these methods (by default the idempotent
    /// ones: `GET`, `HEAD`, `OPTIONS`, `TRACE`, `PUT`, `DELETE`). For any other method it
    /// is final. Back-pressure in a response (a `429`, a `503`) is retried whatever the
    /// method.
    pub fn retry_methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.methods = Methods::Only(methods.into_iter().collect());
        self
    }

    /// Retry an [`Outcome::Retry`], a timed-out attempt or back-pressure without a response
    /// whatever the method (for a server that makes every request idempotent, say with an
    /// idempotency key).
    pub fn retry_any_method(mut self) -> Self {
        self.methods = Methods::Any;
        self
    }

    /// The policy.
    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }
}

impl<C: fmt::Debug> fmt::Debug for RetryLayer<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryLayer")
            .field("policy", &self.policy)
            .field("classify", &self.classify)
            .field("methods", &self.methods)
            .finish()
    }
}

impl<S, C: Clone> Layer<S> for RetryLayer<C> {
    type Service = Retry<S, C>;

    fn layer(&self, inner: S) -> Retry<S, C> {
        Retry {
            inner,
            shared: Arc::new(Shared {
                policy: self.policy.clone(),
                classify: self.classify.clone(),
                methods: self.methods.clone(),
            }),
        }
    }
}

/// What a layer hands each of its services and their futures.
struct Shared<C> {
    policy: RetryPolicy,
    classify: C,
    methods: Methods,
}

/// The service of a [`RetryLayer`]: retries each request; see the layer for what each
/// attempt does. Cheap to clone (the inner service, and an `Arc`).
#[derive(Clone)]
pub struct Retry<S, C = HttpClassify> {
    inner: S,
    shared: Arc<Shared<C>>,
}

impl<S, C> Retry<S, C> {
    /// The policy.
    pub fn policy(&self) -> &RetryPolicy {
        &self.shared.policy
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

impl<S: fmt::Debug, C: fmt::Debug> fmt::Debug for Retry<S, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Retry")
            .field("inner", &self.inner)
            .field("policy", &self.shared.policy)
            .field("classify", &self.shared.classify)
            .field("methods", &self.shared.methods)
            .finish()
    }
}

impl<S, C, B, ResB> Service<Request<B>> for Retry<S, C>
where
    S: Service<Request<B>, Response = Response<ResB>> + Clone,
    C: Classify<Response<ResB>, S::Error>,
    B: Clone,
    ResB: Body,
{
    type Response = Response<ResB>;
    type Error = RetryError<S::Error>;
    type Future = RetryFuture<S, C, B, ResB>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Before any attempt: the request cannot be sent at all, a stop like a fatal answer.
        self.inner
            .poll_ready(cx)
            .map_err(|error| RetryError::Inner {
                error,
                stop: Stop::Fatal,
                attempts: 0,
            })
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        // The service that was made ready goes with this request; a fresh clone stays.
        let clone = self.inner.clone();
        let service = std::mem::replace(&mut self.inner, clone);
        let retryable = self.shared.methods.allows(req.method());
        let schedule = self.shared.policy.backoff().start();
        let state = match self.shared.policy.first_past_deadline(&schedule) {
            Some(give_up) => State::NotSent(give_up),
            None => first_state(&self.shared.policy),
        };
        RetryFuture {
            shared: self.shared.clone(),
            service,
            ready: true,
            request: req,
            retryable,
            schedule,
            state,
            sleep: None,
        }
    }
}

/// The state an attempt starts in: waiting for the pacer, or sending at once.
fn first_state<F, ResB>(policy: &RetryPolicy) -> State<F, ResB> {
    match policy.pacer() {
        Some(pacer) => State::Pace {
            wait: pacer.until_ready(1),
        },
        None => State::Send,
    }
}

/// What [`Retry`] did for a response: in the response's extensions.
///
/// # Examples
///
/// See [`RetryLayer`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetryInfo {
    /// Attempts made, the first included.
    pub attempts: u32,
    /// Why the retries stopped (with this response).
    pub stop: Stop,
}

/// The response future of [`Retry`]: the whole retry sequence of one request.
///
/// It owns everything it needs (a ready clone of the inner service, the request, the
/// backoff schedule, a refused response's body while it is read) and keeps its states in an
/// explicit enum, with one timer reset for every timeout and wait: no allocation beyond the
/// pacer's wait.
///
/// # Panics
///
/// When polled again after it completed; and when a wait (the pacer, a backoff, an attempt
/// timeout) starts outside a tokio runtime with timers enabled. A panic there, or in the
/// classifier or the inner service, is counted as a drop is (see Cancel safety; a retry
/// whose `call` panics was not sent).
///
/// # Cancel safety
///
/// Dropping it ends the request: it drops the attempt under way (and its response) or the
/// wait before the next one (with the refused response's body being read), and the request
/// is not sent again. Nothing is lost unseen: the budget and the pacer have heard of every
/// attempt that ended (an attempt dropped under way has no outcome, so neither hears of
/// it); the drop is counted once as a `cancelled` stop
/// (`flowgate_retry_stopped_total{stop="cancelled"}`); an attempt dropped under way was
/// sent and counts in `flowgate_retry_attempts_total` (not in the round-trip histogram);
/// a retry the budget allowed and the drop prevented (waiting for its `Retry-After` or
/// backoff, for the pacer, or for the inner service to be ready) is counted as
/// [`abandoned`](crate::retry::RetryBudgetStats::abandoned) (its token stays taken: the
/// attempt before it failed). Dropped after it completed, it counts nothing more.
#[pin_project(PinnedDrop)]
#[must_use = "futures do nothing unless polled"]
pub struct RetryFuture<S, C, B, ResB>
where
    S: Service<Request<B>>,
{
    shared: Arc<Shared<C>>,
    /// A clone of the inner service, for this request's attempts.
    service: S,
    /// Whether `service` is known ready (the first attempt: the caller made it ready).
    ready: bool,
    /// The request; each attempt sends a clone.
    request: Request<B>,
    /// Whether an [`Outcome::Retry`] may send this request again (its method).
    retryable: bool,
    schedule: Schedule,
    #[pin]
    state: State<S::Future, ResB>,
    /// The attempt's timeout, or the wait before the next attempt: one timer, reset.
    #[pin]
    sleep: Option<Sleep>,
}

#[pin_project(project = StateProj)]
enum State<F, ResB> {
    /// The pacer would hold the first attempt past the backoff's deadline: none is sent.
    NotSent(GiveUp),
    /// Waiting for the adaptive pacer before an attempt.
    Pace {
        #[pin]
        wait: UntilReady,
    },
    /// Making the service ready (after the first attempt), then sending.
    Send,
    /// An attempt under way.
    Call {
        #[pin]
        fut: F,
        started: Instant,
    },
    /// Waiting before the next attempt, reading the last response's body meanwhile.
    Backoff {
        #[pin]
        drain: Option<ResB>,
        /// Bytes read from `drain`.
        drained: usize,
        /// Frames read from `drain`.
        frames: u32,
    },
    /// The attempt ended (its future is dropped): its outcome is being classified and
    /// reported, within one poll. Seen by a drop only when that poll panicked (the
    /// classifier, or a backoff's timer outside a runtime).
    Ended {
        /// The schedule's attempts when it ended: one more once a retry was allowed.
        attempts: u32,
    },
    /// The result was given out.
    Done,
}

#[pinned_drop]
impl<S, C, B, ResB> PinnedDrop for RetryFuture<S, C, B, ResB>
where
    S: Service<Request<B>>,
{
    fn drop(self: Pin<&mut Self>) {
        let policy = &self.shared.policy;
        match &self.state {
            // Completed: its stop was counted.
            State::Done => {}
            // Sent: counted as an attempt already; no outcome to report. (Or none was sent.)
            State::Call { .. } | State::NotSent(_) => policy.count_cancelled(false),
            // Unwinding from a panic after the attempt ended, before its stop was counted;
            // a retry the budget allowed by then was never sent.
            State::Ended { attempts } => {
                policy.count_cancelled(self.schedule.attempts() > *attempts);
            }
            // Before an attempt: after the first, a retry the budget allowed.
            State::Pace { .. } | State::Send | State::Backoff { .. } => {
                policy.count_cancelled(self.schedule.attempts() > 1);
            }
        }
    }
}

/// Set `sleep` to end at `deadline`, creating the timer on first use.
fn arm(mut sleep: Pin<&mut Option<Sleep>>, deadline: Instant) {
    match sleep.as_mut().as_pin_mut() {
        Some(timer) => timer.reset(deadline),
        None => sleep.set(Some(tokio::time::sleep_until(deadline))),
    }
}

impl<S, C, B, ResB> Future for RetryFuture<S, C, B, ResB>
where
    S: Service<Request<B>, Response = Response<ResB>>,
    C: Classify<Response<ResB>, S::Error>,
    B: Clone,
    ResB: Body,
{
    type Output = Result<Response<ResB>, RetryError<S::Error>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        let policy = &this.shared.policy;
        loop {
            let (result, started) = match this.state.as_mut().project() {
                StateProj::NotSent(give_up) => {
                    let give_up = *give_up;
                    this.state.set(State::Done);
                    policy.count_stop(&Stop::GaveUp(give_up));
                    return Poll::Ready(Err(RetryError::NotSent(give_up)));
                }
                StateProj::Pace { wait } => {
                    // Cost 1 never exceeds a pacer's burst (at least 1): this cannot fail.
                    let _ = ready!(wait.poll(cx));
                    this.state.set(State::Send);
                    continue;
                }
                StateProj::Send => {
                    if !*this.ready
                        && let Err(e) = ready!(this.service.poll_ready(cx))
                    {
                        // The downstream cannot take the request again: a stop like a
                        // fatal answer. (Only a retry makes the service ready here: the
                        // retry the budget allowed is never sent.)
                        policy.abandon_retry();
                        policy.count_stop(&Stop::Fatal);
                        this.state.set(State::Done);
                        return Poll::Ready(Err(RetryError::Inner {
                            error: e,
                            stop: Stop::Fatal,
                            attempts: this.schedule.attempts() - 1,
                        }));
                    }
                    *this.ready = false;
                    let req = this.request.clone();
                    // The round trip starts when the request is handed to the client.
                    let started = Instant::now();
                    let fut = this.service.call(req);
                    // Sent: counted now, so that one dropped under way counts too, and under
                    // way (`Call`) before its timer starts, which panics outside a runtime.
                    // A `call` that panics sent nothing: a retry then is abandoned.
                    policy.count_attempt();
                    this.state.set(State::Call { fut, started });
                    if let Some(limit) = policy.attempt_timeout() {
                        arm(this.sleep.as_mut(), started + capped(limit));
                    }
                    continue;
                }
                StateProj::Call { fut, started } => {
                    let started = *started;
                    match fut.poll(cx) {
                        Poll::Ready(result) => (Some(result), started),
                        Poll::Pending => {
                            // The timer was armed for this attempt when it has a timeout.
                            let timed_out = policy.attempt_timeout().is_some()
                                && this
                                    .sleep
                                    .as_mut()
                                    .as_pin_mut()
                                    .is_some_and(|t| t.poll(cx).is_ready());
                            if !timed_out {
                                return Poll::Pending;
                            }
                            (None, started)
                        }
                    }
                }
                StateProj::Backoff {
                    mut drain,
                    drained,
                    frames,
                } => {
                    // Read the refused response to its end while waiting: hyper's client
                    // reuses a connection only once its response was read.
                    if let Some(body) = drain.as_mut().as_pin_mut() {
                        let done = poll_drain(body, drained, frames, cx);
                        if done {
                            drain.set(None);
                        }
                    }
                    if let Some(timer) = this.sleep.as_mut().as_pin_mut() {
                        ready!(timer.poll(cx));
                    }
                    this.state.set(first_state(policy));
                    continue;
                }
                StateProj::Ended { .. } | StateProj::Done => {
                    panic!("RetryFuture polled after completion")
                }
            };
            // The attempt is over: drop its future (a timed-out one is cancelled).
            this.state.set(State::Ended {
                attempts: this.schedule.attempts(),
            });
            let rtt = started.elapsed();
            let outcome = match &result {
                Some(result) => this.shared.classify.classify(result),
                None => Outcome::BackPressure { retry_after: None },
            };
            // Only a response can say the server refused the request without acting on
            // it: back-pressure from a timeout or an error is not that.
            let unanswered =
                matches!(outcome, Outcome::BackPressure { .. }) && !matches!(result, Some(Ok(_)));
            let not_resent = !*this.retryable && (outcome == Outcome::Retry || unanswered);
            if not_resent {
                // Not sent again (a `Retry`, a timeout, back-pressure without an answer);
                // the downstream failed all the same.
                if let Some(budget) = policy.budget() {
                    budget.on_failure();
                }
            }
            if let (Some(pacer), Some(Ok(res))) = (policy.pacer(), &result) {
                feed_hint(
                    pacer,
                    &ServerHint::from_headers(res.headers(), SystemTime::now()),
                    policy.backoff().max_retry_after(),
                );
            }
            policy.record(outcome, rtt);
            let attempts = this.schedule.attempts();
            let stop = match outcome {
                Outcome::Success => Stop::Success,
                Outcome::Fatal => Stop::Fatal,
                // A timed-out request may have been acted on: only a method safe to send
                // twice is sent again (the pacer still heard of the back-pressure).
                Outcome::BackPressure { .. } if result.is_none() && !*this.retryable => {
                    Stop::TimedOut
                }
                // A `Retry`, or back-pressure from an error (a client's own timeout): not
                // sent twice.
                Outcome::Retry | Outcome::BackPressure { .. } if not_resent => Stop::NotRetryable,
                Outcome::Retry | Outcome::BackPressure { .. } => {
                    match policy.next(this.schedule, outcome) {
                        Ok(delay) => {
                            arm(this.sleep.as_mut(), Instant::now() + capped(delay));
                            let drain = match result {
                                Some(Ok(res)) => Some(res.into_body()),
                                _ => None,
                            };
                            this.state.set(State::Backoff {
                                drain,
                                drained: 0,
                                frames: 0,
                            });
                            continue;
                        }
                        Err(_) if result.is_none() => Stop::TimedOut,
                        Err(stop) => stop,
                    }
                }
            };
            this.state.set(State::Done);
            policy.count_stop(&stop);
            return Poll::Ready(match result {
                Some(Ok(mut res)) => {
                    res.extensions_mut().insert(RetryInfo { attempts, stop });
                    Ok(res)
                }
                Some(Err(error)) => Err(RetryError::Inner {
                    error,
                    stop,
                    attempts,
                }),
                None => Err(RetryError::TimedOut { attempts }),
            });
        }
    }
}

/// Read `body` without keeping it, while it has frames ready; whether it is done with (its
/// end, an error, more than [`DRAIN_LIMIT`] bytes or [`DRAIN_FRAMES`] frames read).
fn poll_drain<ResB: Body>(
    mut body: Pin<&mut ResB>,
    drained: &mut usize,
    frames: &mut u32,
    cx: &mut Context<'_>,
) -> bool {
    loop {
        match body.as_mut().poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    *drained = drained.saturating_add(data.remaining());
                }
                *frames += 1;
                if *drained > DRAIN_LIMIT || *frames >= DRAIN_FRAMES {
                    return true;
                }
            }
            Poll::Ready(Some(Err(_)) | None) => return true,
            Poll::Pending => return false,
        }
    }
}

impl<S, C, B, ResB> fmt::Debug for RetryFuture<S, C, B, ResB>
where
    S: Service<Request<B>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::NotSent(_) => "not_sent",
            State::Pace { .. } => "pace",
            State::Send => "send",
            State::Call { .. } => "call",
            State::Backoff { .. } => "backoff",
            State::Ended { .. } => "ended",
            State::Done => "done",
        };
        f.debug_struct("RetryFuture")
            .field("method", self.request.method())
            .field("uri", self.request.uri())
            .field("attempts", &self.schedule.attempts())
            .field("state", &state)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn public_types_are_send_sync() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<RetryLayer>();
        send_sync::<HttpClassify>();
        send_sync::<RetryInfo>();
        send_sync::<Retry<(), HttpClassify>>();
    }

    #[test]
    fn idempotent_methods_only_by_default() {
        let methods = Methods::Only(Arc::from(IDEMPOTENT.as_slice()));
        for m in IDEMPOTENT {
            assert!(methods.allows(&m), "{m}");
        }
        for m in [Method::POST, Method::PATCH, Method::CONNECT] {
            assert!(!methods.allows(&m), "{m}");
        }
        assert!(Methods::Any.allows(&Method::POST));
    }

    #[test]
    fn statuses_classify_as_documented() {
        let c = HttpClassify::new();
        let none = HeaderMap::new();
        for (status, want) in [
            (200, Outcome::Success),
            (204, Outcome::Success),
            (301, Outcome::Success),
            (429, Outcome::BackPressure { retry_after: None }),
            (503, Outcome::BackPressure { retry_after: None }),
            (408, Outcome::Retry),
            (500, Outcome::Retry),
            (502, Outcome::Retry),
            (504, Outcome::Retry),
            (400, Outcome::Fatal),
            (404, Outcome::Fatal),
            (501, Outcome::Fatal),
        ] {
            let status = StatusCode::from_u16(status).unwrap();
            assert_eq!(c.outcome(status, &none), want, "{status}");
        }
        let err: Result<Response<()>, ()> = Err(());
        assert_eq!(c.classify(&err), Outcome::Retry);
    }
}
