//! The outbound pieces of `flowgate::retry`: backoff schedules under paused time (jitter
//! bounds, determinism, deadlines, server hints), the retry budget (gRPC semantics, exact
//! under concurrency) and, with the `http` feature, the parsing of server hints.

mod support;

#[cfg(feature = "http")]
#[path = "../benches/support/alloc.rs"]
mod alloc;

/// Counts each thread's allocations, for the tests that assert a path allocates nothing
/// (or a bounded number of times).
#[cfg(feature = "http")]
#[global_allocator]
static GLOBAL: alloc::CountingAlloc = alloc::CountingAlloc;

#[path = "retry/backoff.rs"]
mod backoff;

#[path = "retry/budget.rs"]
mod budget;

#[path = "retry/claims.rs"]
mod claims;

#[cfg(feature = "http")]
#[path = "retry/hint.rs"]
mod hint;

#[path = "retry/call.rs"]
mod call;

#[cfg(all(feature = "http", feature = "metrics"))]
#[path = "retry/layer.rs"]
mod layer;

#[cfg(all(feature = "http", feature = "metrics"))]
#[path = "support/raw_http.rs"]
mod raw_http;

#[cfg(all(feature = "http", feature = "metrics"))]
#[path = "retry/journey.rs"]
mod journey;

#[cfg(all(feature = "http", feature = "metrics"))]
#[path = "retry/restart.rs"]
mod restart;

#[path = "retry/why.rs"]
mod why;
