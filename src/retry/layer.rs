//! `RetryLayer`: a tower client layer that retries HTTP requests with a [`RetryPolicy`]
//! (backoff, retry budget, adaptive pacer) and listens to the server's fields.
//!
//! This file holds the layer and what its services share; `service` is the [`Retry`]
//! service, `future` its [`RetryFuture`] (each attempt, the waits between them), and
//! `response` reads a response: the default classifier [`HttpClassify`], and the fields
//! fed to the pacer.

use std::fmt;

use http::Method;
use tower::Layer;

use crate::pace::AdaptivePacer;
use crate::retry::call::{Classify, Outcome, RetryError, RetryPolicy, Stop};
use crate::sync::Arc;

mod future;
mod response;
mod service;

pub use future::{RetryFuture, RetryInfo};
pub use response::HttpClassify;
pub use service::Retry;

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
///    bounds the whole. The pacer is waited for once the inner service is ready for the
///    attempt (the caller made it ready for the first one; a retry makes it ready again
///    first), so the turn it gives is used at once: a retry the service keeps waiting, or
///    fails to get ready for, takes no turn from the other requests, and retries held up
///    together go at the pacer's rate, not all at once;
/// 2. sends the request, under the policy's
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
/// The server's fields count its quota units, and the pacer takes one unit per attempt:
/// against a server that charges a request several units (a
/// [`RateLimitLayer`](crate::http::RateLimitLayer) with a
/// [`cost`](crate::http::RateLimitLayerBuilder::cost) of 5, say) the caps come out that
/// many times too high (`r=4` reads as four more requests), and `429`s come back after
/// the first one, each paused for by its `Retry-After` (one every 5 s for half a minute
/// at a cost of 5 under a quota of 60 a minute). Give such a client a pacer whose
/// [ceiling](crate::pace::AdaptivePacer::builder) is the server's rate divided by the cost.
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
/// the `flowgate_retry_stopped_total` metric counts the same by `stop`, once per request
/// given to [`call`](tower::Service::call). An error of [`Retry`]'s own `poll_ready`
/// (the inner service's, before any request was given) is a [`RetryError::Inner`] with
/// [`Stop::Fatal`] and `attempts` 0 as well, but no request began: no metric counts it,
/// and the budget and the pacer do not hear of it (a caller that polls readiness again
/// after it would otherwise be counted once per poll).
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
/// retried for every method: the server refused the request without acting on it. So is
/// an [`Outcome::Unsent`]: the request never reached the server. [`HttpClassify`] cannot
/// tell a connect error from another transport error (the inner service's error type is
/// any type), so by default a `POST` whose connection was refused is not sent again; a
/// classifier of your own that knows its client's errors says which never left:
///
/// ```
/// use flowgate::retry::{Backoff, HttpClassify, Outcome, RetryLayer, RetryPolicy};
/// use http::Response;
/// use hyper_util::client::legacy::Error;
///
/// let policy = RetryPolicy::builder(Backoff::builder().build()?).build()?;
/// // hyper-util's client: a connect error (refused, DNS, connect timeout) was never sent.
/// let layer = RetryLayer::new(policy).classify(
///     |r: &Result<Response<hyper::body::Incoming>, Error>| match r {
///         Ok(res) => HttpClassify::new().outcome(res.status(), res.headers()),
///         Err(e) if e.is_connect() => Outcome::Unsent,
///         Err(_) => Outcome::Retry,
///     },
/// );
/// # let _ = layer;
/// # Ok::<(), flowgate::ConfigError>(())
/// ```
///
/// The layer, its services and their futures follow tower's rules: `poll_ready` only asks
/// the inner service; the service that was made ready goes with the request (the layer
/// keeps a fresh clone, `mem::replace`); later attempts make that service ready again
/// themselves. Clones share the policy (and so its budget, pacer and metrics).
///
/// Everything inside the layer is the server to it: a [`ShedLayer`](crate::http::ShedLayer)
/// put inside it as an outbound bulkhead answers `503` with `Retry-After` when full, which
/// the layer takes for the server's back-pressure (it pauses and cuts the shared pacer,
/// spends budget and attempts). Bound outbound concurrency outside the layer instead (a
/// [`Bulkhead`](crate::bulkhead::Bulkhead) around the call), knowing its permit is then
/// held through the waits between attempts.
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
    /// is final. Back-pressure in a response (a `429`, a `503`) and an
    /// [`Outcome::Unsent`] (the request never reached the server) are retried whatever the
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
}
