//! `RateLimitFuture`: decides a request, then calls the inner service or answers itself.

use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::header::RETRY_AFTER;
use http::{Request, Response, StatusCode};
use pin_project::{pin_project, pinned_drop};
use tower::Service;

use crate::gate::Gate;
use crate::http::body::sealed::Token;
use crate::http::body::{BodyMode, WrapBody};
use crate::http::fields::Fields;
use crate::http::key::RequestInfo;
use crate::http::rate_limit::layer::{Check, Ruling, Shared, Slots};
use crate::sync::Arc;

/// The response future of [`RateLimit`](crate::http::RateLimit).
///
/// On its first poll it takes the request's keys and decides them: on a gate that decides
/// locally ([`MemoryGate`](crate::gate::MemoryGate)) at once, without allocating a future;
/// otherwise through the gate's future (woken by it, never by itself). Then it calls the
/// inner service and adds the rate-limit fields to its response, or answers `429` / `503` /
/// `400` itself.
///
/// While a remote gate decides, the future holds the request and the inner service that
/// was ready for it (clone-after-ready), and with it whatever that service reserved when it
/// was polled ready (a slot of an inner `ConcurrencyLimit`, say): for the gate's round trip,
/// at most a [`RedisGate`](crate::gate::RedisGate)'s timeout. A request the layer answers
/// itself gives both back unused.
///
/// Dropped before the gate answered, the request is not passed on; its cost may already be
/// charged (as the gate documents for a dropped `check_all`). It is counted as
/// [`cancelled`](crate::http::RateLimitStats::cancelled).
///
/// # Panics
///
/// When polled again after it completed.
#[pin_project(PinnedDrop)]
#[must_use = "futures do nothing unless polled"]
pub struct RateLimitFuture<S, G, B, K = WrapBody>
where
    S: Service<Request<B>>,
{
    shared: Arc<Shared<G>>,
    #[pin]
    state: State<S, B>,
    /// The fields for the inner service's response, once the request passed (apart from
    /// `state`, so that entering `Call` moves only the inner future).
    fields: Option<Fields>,
    body: PhantomData<fn() -> K>,
}

#[pin_project(project = StateProj)]
enum State<S, B>
where
    S: Service<Request<B>>,
{
    /// Not polled yet: the request and the ready inner service.
    Decide {
        req: Option<Request<B>>,
        inner: Option<S>,
    },
    /// Waiting for the gate.
    Check {
        check: Check,
        req: Option<Request<B>>,
        inner: Option<S>,
    },
    /// Waiting for the inner service.
    Call {
        #[pin]
        fut: S::Future,
    },
    /// Completed.
    Done,
}

impl<S, G, B, K> RateLimitFuture<S, G, B, K>
where
    S: Service<Request<B>>,
{
    pub(crate) fn new(shared: Arc<Shared<G>>, inner: S, req: Request<B>) -> Self {
        RateLimitFuture {
            shared,
            state: State::Decide {
                req: Some(req),
                inner: Some(inner),
            },
            fields: None,
            body: PhantomData,
        }
    }
}

impl<S, G, B, K> fmt::Debug for RateLimitFuture<S, G, B, K>
where
    S: Service<Request<B>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::Decide { .. } => "Decide",
            State::Check { .. } => "Check",
            State::Call { .. } => "Call",
            State::Done => "Done",
        };
        f.debug_struct("RateLimitFuture")
            .field("state", &state)
            .finish_non_exhaustive()
    }
}

#[pinned_drop]
impl<S, G, B, K> PinnedDrop for RateLimitFuture<S, G, B, K>
where
    S: Service<Request<B>>,
{
    fn drop(self: Pin<&mut Self>) {
        // Still holding the request: not decided (a decision either answers, and the state
        // is `Done`, or passes the request on, taking it out). Counted as given up.
        let undecided = match &self.state {
            State::Decide { req, .. } | State::Check { req, .. } => req.is_some(),
            State::Call { .. } | State::Done => false,
        };
        if undecided {
            self.shared.cancelled();
        }
    }
}

const POLLED_AFTER_DONE: &str = "RateLimitFuture polled after it completed";

impl<S, G, B, K, ResBody> Future for RateLimitFuture<S, G, B, K>
where
    S: Service<Request<B>, Response = Response<ResBody>>,
    G: Gate + 'static,
    K: BodyMode<ResBody>,
{
    type Output = Result<Response<K::Body>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        // The layer's own response, when the verdict is to answer.
        let mut answer = None;
        loop {
            // The verdict is put in `this.fields` and `answer` where it is made; what comes
            // back here is a byte.
            let slots = Slots {
                fields: this.fields,
                answer: &mut answer,
            };
            let fut = match this.state.as_mut().project() {
                StateProj::Decide { req, inner } => {
                    let r = req.as_ref().expect(POLLED_AFTER_DONE);
                    match this.shared.decide(&RequestInfo::of(r), slots) {
                        None if answer.is_none() => call(req, inner),
                        None => {
                            this.state.set(State::Done);
                            return Poll::Ready(Ok(own::<K, ResBody>(answer)));
                        }
                        Some(check) => {
                            let (req, inner) = (req.take(), inner.take());
                            this.state.set(State::Check { check, req, inner });
                            continue;
                        }
                    }
                }
                StateProj::Check { check, req, inner } => {
                    let (keys, decided) = ready!(check.as_mut().poll(cx));
                    match this.shared.conclude(&keys, decided.as_deref()).put(slots) {
                        Ruling::Pass => call(req, inner),
                        Ruling::Answer => {
                            this.state.set(State::Done);
                            return Poll::Ready(Ok(own::<K, ResBody>(answer)));
                        }
                    }
                }
                StateProj::Call { fut } => {
                    let res = ready!(fut.poll(cx));
                    this.state.set(State::Done);
                    let mut res = res?.map(|b| K::inner(b, Token(())));
                    if let Some(fields) = this.fields.take() {
                        // Refused further in (a 429, or a 503 saying when to come back: a
                        // shed, an inner layer's gate error), not by this layer's policies.
                        let status = res.status();
                        let refused = status == StatusCode::TOO_MANY_REQUESTS
                            || (status == StatusCode::SERVICE_UNAVAILABLE
                                && res.headers().contains_key(RETRY_AFTER));
                        fields.write(res.headers_mut(), refused);
                    }
                    return Poll::Ready(Ok(res));
                }
                StateProj::Done => panic!("{POLLED_AFTER_DONE}"),
            };
            this.state.set(State::Call { fut });
        }
    }
}

/// The layer's own response, in the body mode's type: what a verdict to answer put in
/// `answer`.
fn own<K: BodyMode<ResBody>, ResBody>(answer: Option<Response<Bytes>>) -> Response<K::Body> {
    answer
        .expect("a verdict to answer puts its response")
        .map(|b| K::own(b, Token(())))
}

/// The inner service called with the request, both still in the future's state: the
/// request moved out once, straight into the call; the service called where it is (the
/// state is replaced right after).
fn call<S: Service<Request<B>>, B>(
    req: &mut Option<Request<B>>,
    inner: &mut Option<S>,
) -> S::Future {
    match (req.take(), inner.as_mut()) {
        (Some(req), Some(inner)) => inner.call(req),
        _ => panic!("{POLLED_AFTER_DONE}"),
    }
}
