//! `RateLimit`: the service of a [`RateLimitLayer`](crate::http::RateLimitLayer).

use std::fmt;
use std::marker::PhantomData;
use std::mem;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower::Service;

use crate::gate::Gate;
use crate::http::body::{BodyMode, WrapBody};
use crate::http::rate_limit::future::RateLimitFuture;
use crate::http::rate_limit::layer::{RateLimitStats, Shared};
use crate::sync::Arc;

/// The service [`RateLimitLayer`](crate::http::RateLimitLayer) wraps around an inner one.
///
/// `poll_ready` only asks the inner service (a keep-alive connection waiting for its next
/// request holds nothing); the request is decided in the [`RateLimitFuture`], and the inner
/// service that was ready is the one called (clone-after-ready). Clones share the layer's
/// state: policies, counts, top rejected keys.
///
/// `K` is the [`BodyMode`]: [`WrapBody`] (responses have a
/// [`ResponseBody`](crate::http::ResponseBody)) or [`InnerBody`](crate::http::InnerBody).
pub struct RateLimit<S, G, K = WrapBody> {
    inner: S,
    shared: Arc<Shared<G>>,
    body: PhantomData<fn() -> K>,
}

impl<S, G, K> RateLimit<S, G, K> {
    pub(crate) fn new(inner: S, shared: Arc<Shared<G>>) -> RateLimit<S, G, K> {
        RateLimit {
            inner,
            shared,
            body: PhantomData,
        }
    }

    /// The count of each outcome so far (shared with the layer and every clone).
    pub fn stats(&self) -> RateLimitStats {
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

impl<S: Clone, G, K> Clone for RateLimit<S, G, K> {
    fn clone(&self) -> Self {
        RateLimit::new(self.inner.clone(), Arc::clone(&self.shared))
    }
}

impl<S: fmt::Debug, G: fmt::Debug, K> fmt::Debug for RateLimit<S, G, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimit")
            .field("inner", &self.inner)
            .field("layer", &self.shared)
            .finish()
    }
}

impl<S, G, K, B, ResBody> Service<Request<B>> for RateLimit<S, G, K>
where
    S: Service<Request<B>, Response = Response<ResBody>> + Clone,
    G: Gate + 'static,
    K: BodyMode<ResBody>,
{
    type Response = Response<K::Body>;
    type Error = S::Error;
    type Future = RateLimitFuture<S, G, B, K>;

    /// The inner service's readiness, and nothing else.
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> RateLimitFuture<S, G, B, K> {
        // The service that was polled ready goes with the request; a fresh clone stays. The
        // clone is user code: if it panics, the request is counted as it unwinds (it has no
        // future yet to count it).
        let unstarted = Unstarted(&self.shared);
        let clone = self.inner.clone();
        mem::forget(unstarted);
        let inner = mem::replace(&mut self.inner, clone);
        RateLimitFuture::new(Arc::clone(&self.shared), inner, req)
    }
}

/// Counts its request cancelled if dropped: while the inner service's `Clone` runs in
/// `call`, before the request has a [`RateLimitFuture`] to count it.
struct Unstarted<'a, G>(&'a Shared<G>);

impl<G> Drop for Unstarted<'_, G> {
    fn drop(&mut self) {
        self.0.cancelled();
    }
}
