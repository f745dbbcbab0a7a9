//! The `Gate` trait.

use std::fmt;
use std::future::Future;
use std::pin::Pin;

use crate::decision::Decision;
use crate::gate::error::GateError;
use crate::gate::limit::Limit;
use crate::sync::Arc;

/// The future of [`Gate::acquire`].
pub type GateFuture<'a> = Pin<Box<dyn Future<Output = Result<Decision, GateError>> + Send + 'a>>;

/// An async keyed token gate: decides whether `cost` units for `key` may pass now.
///
/// Object-safe (`Arc<dyn Gate>` works), so pipelines can be written against a gate and run
/// on the embedded [`MemoryGate`](crate::gate::MemoryGate) in tests and the
/// [`RedisGate`](crate::gate::RedisGate) in production.
pub trait Gate: Send + Sync + fmt::Debug {
    /// Decide one request: admitted (and consumed) or rejected with a `retry_after`.
    ///
    /// # Errors
    ///
    /// [`GateError::InsufficientCapacity`] when `cost` exceeds the capacity (it could never
    /// pass), [`GateError::ZeroCost`], [`GateError::InvalidKey`]; backend errors and
    /// timeouts as the gate's failure policy says.
    fn acquire<'a>(&'a self, key: &'a str, cost: u32) -> GateFuture<'a>;

    /// The limit enforced per key.
    fn limit(&self) -> Limit;
}

impl<G: Gate + ?Sized> Gate for Arc<G> {
    fn acquire<'a>(&'a self, key: &'a str, cost: u32) -> GateFuture<'a> {
        (**self).acquire(key, cost)
    }

    fn limit(&self) -> Limit {
        (**self).limit()
    }
}

impl<G: Gate + ?Sized> Gate for &G {
    fn acquire<'a>(&'a self, key: &'a str, cost: u32) -> GateFuture<'a> {
        (**self).acquire(key, cost)
    }

    fn limit(&self) -> Limit {
        (**self).limit()
    }
}
