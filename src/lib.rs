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
//! | [`pace`] | leaky-bucket pacing: constant outflow from 1/s to 1M/s; stream and sink adapters | ready |
//! | [`demand`] | request(n) credit, fetch-by-demand sources, watermarks, commits | ready |
//! | [`gate`] | keyed token gates: in-memory default and Redis (atomic Lua, server clock, failure policy) | ready |
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
//!   math takes `now` explicitly.
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
//! - `redis` (default): the Redis-backed gate and stream source.
//! - `metrics` (default): emit metrics through the `metrics` facade. Off, every recording
//!   call compiles to nothing.

#![warn(
    missing_docs,
    missing_debug_implementations,
    rust_2018_idioms,
    unreachable_pub
)]
#![deny(unused_must_use)]
#![forbid(unsafe_code)]
#![doc(test(attr(deny(warnings))))]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod bulkhead;
pub mod channel;
mod decision;
pub mod demand;
mod error;
mod ext;
pub mod gate;
pub mod limit;
pub mod metrics;
pub mod overflow;
pub mod pace;
pub mod rate;
mod sync;
mod time;

pub use decision::Decision;
pub use error::{ConfigError, ConfigErrorKind};
pub use ext::{FlowSinkExt, FlowStreamExt};
pub use overflow::Overflow;
pub use rate::{Quota, Rate};

/// The types most pipelines need, in one import.
pub mod prelude {
    pub use crate::bulkhead::{Bulkhead, Priority, Rejected};
    pub use crate::channel::{Receiver, Sender, Sent};
    pub use crate::ext::{FlowSinkExt, FlowStreamExt};
    pub use crate::limit::{Algorithm, Keyed, Limiter};
    pub use crate::pace::Pacer;
    pub use crate::{ConfigError, Decision, Overflow, Quota, Rate};
}

// The README's Rust examples are compiled and run as doctests (they use the Redis gate).
#[cfg(all(doctest, feature = "redis"))]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
