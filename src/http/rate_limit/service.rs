//! `RateLimit`: the service of a [`RateLimitLayer`](crate::http::RateLimitLayer).

use std::fmt;
use std::mem;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower::Service;

use crate::gate::Gate;
use crate::http::body::ResponseBody;
use crate::http::rate_limit::future::RateLimitFuture;
use crate::http::rate_limit::layer::{RateLimitStats, Shared};
use crate::sync::Arc;

/// The service [`RateLimitLayer`](crate::http::RateLimitLayer) wraps around an inner one.
///
/// `poll_ready` only asks the inner service (a keep-alive connection waiting for its next
/// request holds nothing); the request is decided in the [`RateLimitFuture`], and the inner
/// service that was ready is the one called (clone-after-ready). Clones share the layer's
/// state: policies, counts, top rejected keys.
pub struct RateLimit<S, G> {
    inner: S,
    shared: Arc<Shared<G>>,
}

impl<S, G> RateLimit<S, G> {
    pub(crate) fn new(inner: S, shared: Arc<Shared<G>>) -> RateLimit<S, G> {
        RateLimit { inner, shared }
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

impl<S: Clone, G> Clone for RateLimit<S, G> {
    fn clone(&self) -> Self {
        RateLimit {
            inner: self.inner.clone(),
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S: fmt::Debug, G: fmt::Debug> fmt::Debug for RateLimit<S, G> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimit")
            .field("inner", &self.inner)
            .field("layer", &self.shared)
            .finish()
    }
}

impl<S, G, B, ResBody> Service<Request<B>> for RateLimit<S, G>
where
    S: Service<Request<B>, Response = Response<ResBody>> + Clone,
    G: Gate + 'static,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = RateLimitFuture<S, G, B>;

    /// The inner service's readiness, and nothing else.
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> RateLimitFuture<S, G, B> {
        // The service that was polled ready goes with the request; a fresh clone stays.
        let clone = self.inner.clone();
        let inner = mem::replace(&mut self.inner, clone);
        RateLimitFuture::new(Arc::clone(&self.shared), inner, req)
    }
}
