//! `Retry`: the service of a [`RetryLayer`]; `poll_ready` only asks the inner service,
//! and `call` hands the service made ready to the request's future.

use std::fmt;
use std::task::{Context, Poll};

use http::{Request, Response};
use http_body::Body;
use tower::Service;

use crate::sync::Arc;

use super::future::{State, first_state};
use super::*;

/// The service of a [`RetryLayer`]: retries each request; see the layer for what each
/// attempt does. Cheap to clone (the inner service, and an `Arc`).
#[derive(Clone)]
pub struct Retry<S, C = HttpClassify> {
    pub(super) inner: S,
    pub(super) shared: Arc<Shared<C>>,
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
            request: req,
            retryable,
            schedule,
            state,
            sleep: None,
        }
    }
}
