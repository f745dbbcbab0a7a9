//! # flowgate: backpressure for async pipeline stages
//!
//! flowgate keeps each stage of an async pipeline from being overrun. It gives you bounded
//! queues that say exactly what happens when they are full, concurrency caps per
//! dependency, constant-rate outflow to fragile downstreams, demand signalling for batch
//! sources, and token gates that hold one limit across a whole fleet through Redis. Every
//! piece composes as a [`futures::Stream`] / [`futures::Sink`] combinator or hands out
//! permits.
//!
//! ## The map
//!
//! | module | what it gives | status |
//! |---|---|---|
//! | [`rate`] | [`Rate`], [`Quota`]: validated "n per period" values, integers only | ready |
//! | [`overflow`] | [`Overflow`]: the policy of every bounded buffer | ready |
//! | [`limit`] | token bucket (GCRA), fixed window, sliding log, sliding window; [`limit::Keyed`] | ready |
//! | [`metrics`] | metric names; one recording path, free when the feature is off | ready |
//! | [`channel`] | bounded MPMC channel with overflow policies, `Sink`/`Stream`, permits | ready |
//! | [`bulkhead`] | concurrency caps, waiting room, load shedding, critical reserve; stream adapters | ready |
//! | [`pace`] | leaky-bucket pacing: constant outflow from 1/s to 1M/s; stream and sink adapters; [`pace::AdaptivePacer`], a rate that follows the server's feedback (`Retry-After`, 429/503, the `RateLimit` fields) | ready |
//! | [`demand`] | request(n) credit, fetch-by-demand sources, watermarks, commits | ready |
//! | [`gate`] | keyed token gates: in-memory default and Redis (atomic Lua, server clock, failure policy) | ready |
//! | [`clock`] | [`clock::Clock`]: the monotonic clock the in-memory gate reads (a CPU counter, or tokio's clock under paused time) | ready |
//! | [`adaptive`] | adaptive concurrency: an [`adaptive::AdaptiveLimit`] drives a bulkhead's `max_in_flight` from each call's round-trip time and outcome; flowgate's default [`adaptive::Probe`], [`adaptive::Aimd`], [`adaptive::Gradient2`], [`adaptive::Vegas`]; a simulator ([`adaptive::sim`]) and a knee finder ([`adaptive::knee`]) | ready |
//! | [`retry`] | the outbound side: [`retry::Backoff`] (exponential, the AWS jitters, a deadline over every attempt; the server's `Retry-After` wins), [`retry::RetryBudget`] (gRPC `retryThrottling`), [`retry::retry`] with a [`retry::Classify`]; with feature `http`, `ServerHint` (parses `Retry-After` and every rate-limit field style) and a tower client layer | ready |
//! | [`region`] | (feature `redis`) one global quota across regions: each region decides against its local Redis at its share; shares are leases in a home Redis (static, fair-share or proportional-share by demand), with a hard bound on their sum | ready |
//! | `http` | (feature `http`) tower layers: `RateLimitLayer` (429, `Retry-After`, IETF `RateLimit` fields, several policies all-or-nothing, shadow mode) and `ShedLayer` (503 by priority over a bulkhead) | ready |
//!
//! ## Shared concepts
//!
//! - **[`Rate`] / [`Quota`]**: constructors validate and return [`ConfigError`]; nothing
//!   in flowgate panics on user input.
//! - **[`Overflow`]**: `Backpressure` waits, `Reject` hands the item back, `DropNewest` and
//!   `DropOldest` never wait. Every drop is observable and counted.
//! - **[`Decision`]**: what every limiter and gate answers; it maps onto HTTP `Retry-After`
//!   and the IETF `RateLimit` fields.
//! - **Time**: local code uses `tokio::time`, so tests run with paused time; the limiter
//!   math takes `now` explicitly. [`MemoryGate`](gate::MemoryGate) reads a
//!   [`clock::Clock`]: a cheap CPU counter in production, tokio's clock in a current-thread
//!   runtime (every `#[tokio::test]`), so paused time works there too.
//!
//! ## One word, one meaning
//!
//! Every module follows this table; a new name is looked up here first.
//!
//! | word | means | where |
//! |---|---|---|
//! | *check* | decide now, consuming the cost if admitted; never waits for capacity; answers a [`Decision`]. A future only where deciding needs I/O (a gate may ask Redis). | `Limiter::check`, `Keyed::check`, `Gate::check`, `MemoryGate::check` (sync), `RedisGate::check` and `RegionGate::check` (async), `Gate::check_local` (sync), `check_all`, `Pacer::check` |
//! | *until_ready* | wait until admitted (a `CommitTracker`: until it has room to track one more); nothing is given back afterwards | `Pacer::until_ready`, `AdaptivePacer::until_ready`, `CommitTracker::until_ready` |
//! | *acquire* | wait for an RAII permit, given back when it drops | `Bulkhead::acquire`, `acquire_owned` |
//! | *reserve* | wait for a channel slot: a permit to send one item | `Sender::reserve`, `reserve_owned` |
//! | *try_* | the form of a waiting verb that does not wait: an error instead. One exception, named as gRPC names it: `RetryBudget::try_retry` never waits either, but answers a `bool` (whether the budget allows a retry) | `try_send`, `try_recv`, `try_reserve`, `try_acquire`; `try_retry` |
//! | *close* | stop taking new work; what is buffered still drains (`&self` everywhere; a bulkhead's permits in flight, and those granted to waiters before the close, stay valid) | `Sender::close`, `Receiver::close`, `Bulkhead::close` |
//! | *rate* | n per period: [`Rate`] | pacers, windows |
//! | *quota* | a rate with a burst: [`Quota`] | token buckets, pacers (`Pacer::quota`, `set_quota`) |
//! | *capacity* | the most units admitted at once (a quota's burst, a window's count); for a buffer, the most items it holds | `Decision::capacity`, `Limit::capacity`, [`CostError`], `Sender::capacity` |
//! | *limit* | a limiting rule: an algorithm with its numbers ([`gate::Limit`]); the [`limit`] module is those algorithms as pure math. One other meaning, in [`adaptive`] only: the concurrency an [`adaptive::AdaptiveLimit`] learns (within its `min_limit` and `max_limit`), which becomes a bulkhead's `max_in_flight` (plus its critical reserve). Nothing else is called a limit | `gate::Limit`, `Gate::limit`; `AdaptiveLimit`, `min_limit`, `max_limit` |
//! | *max_in_flight* | a bulkhead's concurrency cap | `Bulkhead::max_in_flight`, `set_max_in_flight` |
//! | *cost* | the units one request takes, at least 1 (`leaky_cost` lets an item of cost 0 pass free, and `RateLimitLayerBuilder::cost` a request of cost 0) | every `check`, `until_ready`, `leaky_cost`, `GatedBuilder::cost`, `RateLimitLayerBuilder::cost` |
//! | *reject* | a limiter, gate or buffer refuses a request and answers the caller: a `Decision` with `allowed == false`, or the item handed back ([`Overflow::Reject`]) | `Decision`, `SendError::Full` |
//! | *drop* | an item removed without being delivered: passed to the `on_drop` hook ([`OnDrop`]) with a [`Dropped`] reason and counted: by `dropped()` where a policy drops it (`leaky_queue`, `gated_drop`; a channel reads all its counters together with `stats()`); an adapter that holds one item while it waits (`leaky`, `gated`, the bulkhead adapters) passes it to the hook of its builder as [`Dropped::Discarded`] when it lets go of it, and so does `prefetch` with each item still buffered (the adapters without a `dropped()` count these in their metrics: `flowgate_pace_dropped_total{policy="closed"}`, `flowgate_bulkhead_discarded_total`, `flowgate_demand_discarded_total`) | `Overflow::DropNewest`/`DropOldest`, `Sent::DroppedNewest`/`DroppedOldest`, `gated_drop`, `Dropped::Discarded` |
//! | *shed* | a bulkhead refuses work because it is saturated: waiting room full, waited too long, no permit free, or pushed out by critical work | `bulkhead::AcquireError` |
//! | *stats* | a snapshot of a part's counts since it was built, without the `metrics` feature too (each count exact; read one by one, not all of one instant) | `Sender::stats`/`Receiver::stats` (channel `Stats`), `Bulkhead::stats`, `RetryBudget::stats`, `RateLimitLayer::stats`, `ShedLayer::stats` |
//! | *evict* | remove idle per-key state to bound memory; never items | `MemoryGate`, `Keyed` (`sweep`, `max_keys`) |
//!
//! Builders follow one convention: `X::builder(..) -> XBuilder`, `name(impl Into<String>)`
//! (the `name` label of the metrics) where the part's metrics carry a name of its own, and
//! `build()` that validates everything and returns `Result<X, ConfigError>` (an `async` one
//! where building talks to Redis: the `RedisGateBuilder`'s, and the
//! `RedisStreamSourceBuilder`'s, whose `BuildError` is a `ConfigError` or the Redis error that
//! kept it from creating its group). The builders of the `leaky` and bulkhead adapters
//! have no `name` (they record under their pacer's or bulkhead's), nor do those of parts
//! that record no metrics: [`retry::Backoff`], the adaptive algorithms, the simulator, the
//! knee finder's settings, `http::ClientIp`. Extension methods whose inputs are valid by
//! their types ([`NonZeroUsize`](std::num::NonZeroUsize), [`Rate`], `demand::Levels`)
//! return the adapter itself, so chains stay chains.
//!
//! ## Example
//!
//! ```
//! use std::time::Duration;
//! use flowgate::limit::{Keyed, TokenBucket};
//! use flowgate::Quota;
//!
//! // 5 per second per tenant, bursts of 10, at most 10 000 tenants in memory.
//! let mut per_tenant = Keyed::new(TokenBucket::new(Quota::per_second(5)?.burst(10)?), 10_000)?;
//! let now = Duration::from_secs(1);
//! let decision = per_tenant.check("tenant-a", now, 1)?;
//! assert!(decision.allowed);
//! assert_eq!(decision.remaining, 9);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! ## Features
//!
//! - `redis` (default): the Redis-backed gate and stream source, and the [`region`] module.
//! - `metrics` (default): emit metrics through the `metrics` facade. Off, every recording
//!   call compiles to nothing.
//! - `http`: the tower layers of the `http` module, and on the outbound side
//!   `retry::ServerHint` and the `retry::RetryLayer` client layer (adds `tower`, `http`,
//!   `http-body`, `http-body-util`, `bytes`, `sfv`, `ipnet`, `httpdate`, `itoa`,
//!   `crossbeam-utils`).

#![warn(
    missing_docs,
    missing_debug_implementations,
    rust_2018_idioms,
    unreachable_pub
)]
#![deny(unused_must_use)]
// `unsafe` is denied everywhere but in one module, `channel::ring` (the lock-free ring of
// items; its blocks carry `SAFETY` comments and it has loom and miri tests).
#![deny(unsafe_code)]
#![doc(test(attr(deny(warnings))))]
#![cfg_attr(docsrs, feature(doc_cfg))]
// The crate docs link to what the default features add (`region`, the Redis gate's
// failure policy); built without them, those links have nothing to point at.
#![cfg_attr(not(feature = "redis"), allow(rustdoc::broken_intra_doc_links))]

pub mod adaptive;
pub mod bulkhead;
pub mod channel;
pub mod clock;
mod decision;
pub mod demand;
mod dropped;
mod error;
mod ext;
pub mod gate;
#[cfg(feature = "http")]
#[cfg_attr(docsrs, doc(cfg(feature = "http")))]
pub mod http;
pub mod limit;
pub mod metrics;
pub mod overflow;
pub mod pace;
pub mod rate;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub mod region;
pub mod retry;
mod sync;
/// The loom models of crate-private primitives, for `tests/loom.rs` (only under
/// `--cfg flowgate_loom`).
#[cfg(flowgate_loom)]
#[doc(hidden)]
pub use sync::loom_models;
mod time;

pub use decision::Decision;
pub use dropped::{Dropped, OnDrop};
pub use error::{ConfigError, ConfigErrorKind, CostError};
pub use ext::{FlowSinkExt, FlowStreamExt};
pub use overflow::Overflow;
pub use rate::{Quota, Rate};

/// The traits and the few types every pipeline needs, in one import.
///
/// The extension traits, the primitives a pipeline shares between its stages, the gate
/// `gated` takes, and the value types they are built from. Everything else (channel handles,
/// errors, the limiter math) is imported from its module, where its name is unambiguous.
pub mod prelude {
    pub use crate::bulkhead::Bulkhead;
    pub use crate::demand::Levels;
    pub use crate::ext::{FlowSinkExt, FlowStreamExt};
    #[cfg(feature = "redis")]
    pub use crate::gate::RedisGate;
    pub use crate::gate::{Gate, Limit, MemoryGate};
    pub use crate::pace::Pacer;
    pub use crate::{ConfigError, Decision, Overflow, Quota, Rate};
}

// The README's Rust examples are compiled and run as doctests (they use the Redis gate).
#[cfg(all(doctest, feature = "redis"))]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
