//! The `Gate` trait.

use std::fmt;
use std::future::Future;
use std::pin::Pin;

use crate::decision::Decision;
use crate::gate::error::GateError;
use crate::gate::limit::Limit;
use crate::gate::quotas::Registration;
use crate::rate::Quota;
use crate::sync::{Arc, Panics};

/// The future of [`Gate::check`] (a [`Decision`]) and of [`Gate::check_all`] (one
/// `Decision` per limit: `GateFuture<'a, Vec<Decision>>`).
pub type GateFuture<'a, T = Decision> =
    Pin<Box<dyn Future<Output = Result<T, GateError>> + Send + 'a>>;

/// A decision made without I/O ([`Gate::check_local_held`]), and the panic of the metrics
/// recorder that counted it, if it panicked: the caller resumes it once it has acted on the
/// decision.
pub(crate) type HeldDecision = (Result<Decision, GateError>, Panics);

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
    /// pass), [`GateError::InvalidKey`], [`GateError::KeyspaceFull`] (a new key at a full
    /// in-memory gate: a [`MemoryGate`](crate::gate::MemoryGate), or a Redis gate falling
    /// back to one); backend errors and timeouts as the gate's failure policy says.
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

    /// [`check_local`](Gate::check_local), with the panic of the metrics recorder that
    /// counted the decision caught and handed over beside it: the decision is made (an
    /// admission charged), so the caller acts on it first and then goes on with the panic,
    /// rather than ask again and be charged again. The stream adapters ask this.
    ///
    /// Crate-internal: the default answers `check_local`, with no panic held.
    #[doc(hidden)]
    fn check_local_held(&self, key: &str, cost: u32) -> Option<HeldDecision> {
        self.check_local(key, cost)
            .map(|decided| (decided, Panics::new()))
    }

    /// All-or-nothing across several token buckets: admitted only if every `(key, quota)`
    /// bucket has room for `cost`, and then charged on all of them; otherwise nothing is
    /// charged anywhere (layered throttling: IP + user + tenant). One decision per limit, in
    /// order; `allowed` is the same in all of them, and the limits that blocked have a
    /// non-zero `retry_after`. Those that had room have none, though rejected too: the
    /// request's wait is the longest `retry_after` of them all, not the first limit's.
    ///
    /// [`MemoryGate`](crate::gate::MemoryGate) and [`RedisGate`](crate::gate::RedisGate)
    /// forward to their inherent `check_all` (the Redis one under the gate's failure
    /// policy). The default, for gates that cannot decide several buckets atomically,
    /// answers [`GateError::InvalidQuota`] for every call: a gate must not pretend to be
    /// all-or-nothing.
    ///
    /// # Errors
    ///
    /// As the inherent `check_all` of each gate: [`GateError::NoLimits`],
    /// [`GateError::TooManyLimits`], [`GateError::Cost`], [`GateError::InvalidKey`],
    /// [`GateError::ConflictingQuotas`], [`GateError::KeyspaceFull`] (in memory), backend
    /// errors as the failure policy says; the default implementation
    /// [`GateError::InvalidQuota`].
    ///
    /// # Cancel safety
    ///
    /// As the gate documents: dropping the future may leave every bucket charged (never
    /// more admitted than the quotas allow).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use flowgate::gate::{Gate, Limit, MemoryGate};
    /// use flowgate::Quota;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let gate: &dyn Gate = &MemoryGate::new(Limit::TokenBucket(Quota::per_second(10)?));
    /// let limits = [("ip:10.0.0.1", Quota::per_second(2)?), ("user:7", Quota::per_second(1)?)];
    /// assert!(gate.check_all(&limits, 1).await?[0].allowed);
    /// let d = gate.check_all(&limits, 1).await?;
    /// assert!(!d[0].allowed && !d[1].allowed);
    /// assert!(d[1].retry_after > Duration::ZERO); // the user's bucket is empty
    /// assert_eq!(d[0].remaining, 1); // and the IP's was not charged
    /// assert_eq!(d[0].retry_after, Duration::ZERO); // nor did it block: wait the longest
    /// let wait = d.iter().map(|d| d.retry_after).max();
    /// assert_eq!(wait, Some(d[1].retry_after));
    /// # Ok(())
    /// # }
    /// ```
    fn check_all<'a>(
        &'a self,
        limits: &'a [(&'a str, Quota)],
        cost: u32,
    ) -> GateFuture<'a, Vec<Decision>> {
        let _ = (limits, cost);
        Box::pin(std::future::ready(Err(GateError::InvalidQuota(
            no_check_all(),
        ))))
    }

    /// [`check_all`](Gate::check_all) without I/O, when this gate can, into `decisions`:
    /// `Some` with exactly what `check_all` would answer (and with the same effect), or
    /// `None` when only `check_all` can decide it; nothing is consumed when it returns
    /// `None`. `decisions` is cleared, and on `Some(Ok(()))` holds one decision per limit,
    /// in order, so a caller deciding many requests (the HTTP layer) reuses one `Vec`.
    ///
    /// The default answers `None`; [`MemoryGate`](crate::gate::MemoryGate) always decides
    /// here, without allocating for a request of at most 4 limits (a key listed twice counts
    /// twice) on keys it holds already (a new key is copied into its map).
    ///
    /// # Errors
    ///
    /// Those of [`check_all`](Gate::check_all), inside the `Some`.
    fn check_all_local(
        &self,
        limits: &[(&str, Quota)],
        cost: u32,
        decisions: &mut Vec<Decision>,
    ) -> Option<Result<(), GateError>> {
        let _ = (limits, cost, decisions);
        None
    }

    /// Whether [`check_all`](Gate::check_all) can decide buckets of these quotas, all of
    /// them in one request. What is built over a gate asks when it is built
    /// ([`RateLimitLayer`](crate::http::RateLimitLayer)'s `build`), so a quota the gate can
    /// never decide is a [`ConfigError`](crate::ConfigError) then, not an error on every
    /// request.
    ///
    /// The default refuses every list, as the default `check_all` refuses every call: a
    /// gate that implements `check_all` implements this too, with the limits of its own.
    /// [`RedisGate`](crate::gate::RedisGate) refuses a quota too large for exact arithmetic
    /// in Redis (and, under `FailurePolicy::Fallback`, what its `MemoryGate` refuses),
    /// [`MemoryGate`](crate::gate::MemoryGate) more distinct quotas than it holds
    /// per shard (16); a `RegionGate` (feature `redis`) has no `check_all` and
    /// refuses every list.
    ///
    /// These quotas alone: a `RateLimitLayer` built over a `MemoryGate` (or a `RedisGate`
    /// falling back to one) is also refused when its quotas and those of the other layers
    /// alive on that gate are more than 16 distinct ones together. flowgate's gates and
    /// the pointers to them (`Arc<G>`, `&G`) pass that count on; a gate of your
    /// own that wraps a `MemoryGate` cannot, so the layers over it are checked one by one.
    ///
    /// # Errors
    ///
    /// [`ConfigError`](crate::ConfigError) naming what the gate cannot decide.
    ///
    /// # Examples
    ///
    /// ```
    /// use flowgate::gate::{Gate, Limit, MemoryGate};
    /// use flowgate::Quota;
    ///
    /// let gate = MemoryGate::new(Limit::TokenBucket(Quota::per_second(10)?));
    /// assert!(gate.validate_quotas(&[Quota::per_second(2)?, Quota::per_second(1)?]).is_ok());
    /// let many: Vec<Quota> = (1..=17).map(Quota::per_second).collect::<Result<_, _>>()?;
    /// assert!(gate.validate_quotas(&many).is_err());
    /// # Ok::<(), flowgate::ConfigError>(())
    /// ```
    fn validate_quotas(&self, quotas: &[Quota]) -> Result<(), crate::ConfigError> {
        let _ = quotas;
        Err(no_check_all())
    }

    /// [`validate_quotas`](Gate::validate_quotas), and register the quotas for what is
    /// built over this gate and calls [`check_all`](Gate::check_all) with them while the
    /// registration returned lives (a [`RateLimitLayer`](crate::http::RateLimitLayer),
    /// its clones and its services). A gate that decides a bounded number of distinct
    /// quotas together ([`MemoryGate`](crate::gate::MemoryGate), or a
    /// [`RedisGate`](crate::gate::RedisGate) falling back to one) refuses quotas that would
    /// take those registered past it, so layers sharing it are refused when built, not
    /// answered `KeyspaceFull` on their requests; once the registration is dropped, the
    /// buckets of the quotas no other registration holds give their room back.
    ///
    /// Crate-internal (its return type cannot be named outside flowgate): the default
    /// validates and registers nothing.
    ///
    /// # Errors
    ///
    /// Those of [`validate_quotas`](Gate::validate_quotas); [`ConfigError`](crate::ConfigError)
    /// naming the count when the quotas registered and these together are too many.
    #[doc(hidden)]
    fn register_quotas(&self, quotas: &[Quota]) -> Result<Registration, crate::ConfigError> {
        self.validate_quotas(quotas).map(|()| Registration::none())
    }

    /// Where one gate key is one bucket whatever the quota it is decided with (Redis: a
    /// key holds one state), an identity of the gate's keys, shared by its clones; `None`
    /// where each quota keeps buckets of its own ([`MemoryGate`](crate::gate::MemoryGate)).
    /// A [`RateLimitLayer`](crate::http::RateLimitLayer)'s `build` refuses a policy whose
    /// gate keys a layer alive over the same keys counts with another quota (one bucket
    /// in two units).
    ///
    /// Crate-internal: the default answers `None`.
    #[doc(hidden)]
    fn key_space(&self) -> Option<usize> {
        None
    }

    /// Whether [`check_all`](Gate::check_all) can decide together keys that begin with
    /// `heads` (one key beginning with each, whatever follows). On Redis Cluster the keys
    /// of one call must share a hash slot, which only a hash tag in their common start can
    /// promise; a gate that decides any keys together answers `Ok`.
    /// A [`RateLimitLayer`](crate::http::RateLimitLayer)'s `build` asks with its policies'
    /// `<key prefix><policy name>:`, so that a layer whose every request would be refused
    /// (`CrossSlot`) is refused when built.
    ///
    /// Crate-internal: the default answers `Ok`.
    ///
    /// # Errors
    ///
    /// [`ConfigError`](crate::ConfigError) saying why the keys cannot be decided together.
    #[doc(hidden)]
    fn validate_key_heads(&self, heads: &[&str]) -> Result<(), crate::ConfigError> {
        let _ = heads;
        Ok(())
    }

    /// The limit enforced per key.
    fn limit(&self) -> Limit;
}

/// What the defaults of [`Gate::check_all`] and [`Gate::validate_quotas`] answer.
fn no_check_all() -> crate::ConfigError {
    crate::ConfigError::new(
        "gate.check_all",
        crate::ConfigErrorKind::Inconsistent,
        "this gate does not decide several limits all-or-nothing",
    )
}

/// `Arc<G>` and `&G` are gates: every method forwards to `G`.
macro_rules! forward_gate {
    ($($ty:ty),*) => {$(
        impl<G: Gate + ?Sized> Gate for $ty {
            fn check<'a>(&'a self, key: &'a str, cost: u32) -> GateFuture<'a> {
                (**self).check(key, cost)
            }

            fn check_local(&self, key: &str, cost: u32) -> Option<Result<Decision, GateError>> {
                (**self).check_local(key, cost)
            }

            fn check_local_held(&self, key: &str, cost: u32) -> Option<HeldDecision> {
                (**self).check_local_held(key, cost)
            }

            fn check_all<'a>(
                &'a self,
                limits: &'a [(&'a str, Quota)],
                cost: u32,
            ) -> GateFuture<'a, Vec<Decision>> {
                (**self).check_all(limits, cost)
            }

            fn check_all_local(
                &self,
                limits: &[(&str, Quota)],
                cost: u32,
                decisions: &mut Vec<Decision>,
            ) -> Option<Result<(), GateError>> {
                (**self).check_all_local(limits, cost, decisions)
            }

            fn validate_quotas(&self, quotas: &[Quota]) -> Result<(), crate::ConfigError> {
                (**self).validate_quotas(quotas)
            }

            fn register_quotas(
                &self,
                quotas: &[Quota],
            ) -> Result<Registration, crate::ConfigError> {
                (**self).register_quotas(quotas)
            }

            fn key_space(&self) -> Option<usize> {
                (**self).key_space()
            }

            fn validate_key_heads(&self, heads: &[&str]) -> Result<(), crate::ConfigError> {
                (**self).validate_key_heads(heads)
            }

            fn limit(&self) -> Limit {
                (**self).limit()
            }
        }
    )*};
}

forward_gate!(Arc<G>, &G);
