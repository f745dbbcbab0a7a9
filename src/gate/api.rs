//! The `Gate` trait.

use std::fmt;
use std::future::Future;
use std::pin::Pin;

use crate::decision::Decision;
use crate::gate::error::GateError;
use crate::gate::limit::Limit;
use crate::sync::Arc;

/// The future of [`Gate::check`].
pub type GateFuture<'a> = Pin<Box<dyn Future<Output = Result<Decision, GateError>> + Send + 'a>>;

/// An async keyed token gate: decides whether `cost` units for `key` may pass now.
///
/// Object-safe (`Arc<dyn Gate>` works), so pipelines can be written against a gate and run
/// on the embedded [`MemoryGate`](crate::gate::MemoryGate) in tests and the
/// [`RedisGate`](crate::gate::RedisGate) in production.
///
/// Deciding never waits for capacity (a rejection comes back at once, with a
/// `retry_after`), but it may need I/O (a Redis round trip), so [`check`](Gate::check)
/// returns a future. A gate that can decide some requests without I/O says so in
/// [`check_local`](Gate::check_local), which the stream adapters ask first: an in-memory
/// gate then costs no allocation per item.
///
/// # Examples
///
/// ```
/// use flowgate::gate::{Gate, Limit, MemoryGate};
/// use flowgate::Quota;
///
/// // Written against any gate.
/// async fn admit(gate: &dyn Gate, tenant: &str) -> bool {
///     gate.check(tenant, 1).await.is_ok_and(|d| d.allowed)
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let gate = MemoryGate::new(Limit::TokenBucket(Quota::per_second(1)?));
/// assert!(admit(&gate, "tenant-a").await);
/// assert!(!admit(&gate, "tenant-a").await);
/// # Ok(())
/// # }
/// ```
pub trait Gate: Send + Sync + fmt::Debug {
    /// Decide one request now: admitted (and consumed) or rejected with a `retry_after`.
    ///
    /// # Errors
    ///
    /// [`GateError::Cost`] when `cost` is zero or exceeds the capacity (it could never
    /// pass), [`GateError::InvalidKey`]; backend errors and timeouts as the gate's failure
    /// policy says.
    ///
    /// # Cancel safety
    ///
    /// As the gate documents: dropping the future may leave the cost consumed (never more
    /// admitted than the limit allows).
    fn check<'a>(&'a self, key: &'a str, cost: u32) -> GateFuture<'a>;

    /// Decide one request without I/O, when this gate can: `Some` with exactly what
    /// [`check`](Gate::check) would answer (and with the same effect), or `None` when only
    /// `check` can decide it. Nothing is consumed when it returns `None`.
    ///
    /// The default answers `None`. [`MemoryGate`](crate::gate::MemoryGate) always decides
    /// here; [`RedisGate`](crate::gate::RedisGate) decides here what it decides without
    /// Redis (a malformed request, a leased token, a cached rejection).
    ///
    /// # Errors
    ///
    /// Those of [`check`](Gate::check), inside the `Some`.
    fn check_local(&self, key: &str, cost: u32) -> Option<Result<Decision, GateError>> {
        let _ = (key, cost);
        None
    }

    /// The limit enforced per key.
    fn limit(&self) -> Limit;
}

impl<G: Gate + ?Sized> Gate for Arc<G> {
    fn check<'a>(&'a self, key: &'a str, cost: u32) -> GateFuture<'a> {
        (**self).check(key, cost)
    }

    fn check_local(&self, key: &str, cost: u32) -> Option<Result<Decision, GateError>> {
        (**self).check_local(key, cost)
    }

    fn limit(&self) -> Limit {
        (**self).limit()
    }
}

impl<G: Gate + ?Sized> Gate for &G {
    fn check<'a>(&'a self, key: &'a str, cost: u32) -> GateFuture<'a> {
        (**self).check(key, cost)
    }

    fn check_local(&self, key: &str, cost: u32) -> Option<Result<Decision, GateError>> {
        (**self).check_local(key, cost)
    }

    fn limit(&self) -> Limit {
        (**self).limit()
    }
}
