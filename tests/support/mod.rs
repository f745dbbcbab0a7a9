//! Shared helpers for the integration tests.
//!
//! Every integration test file declares `mod support;`, so not every helper is used by
//! every test binary (hence the `dead_code` allowance).
//!
//! - [`RedisServer`]: a private, throw-away `redis-server` (TCP on a free port of
//!   127.0.0.1, or a unix socket) with `kill` / `pause` / `resume` / `restart` controls.
//! - [`RedisCluster`]: a private Redis Cluster built from [`RedisServer`] nodes.
//! - [`DelayProxy`]: a loopback TCP proxy adding one-way latency, with partition controls.
//! - [`TempDir`]: a unique directory under `std::env::temp_dir()`, removed on drop.
//! - [`lockstep`]: two threads acting at the same moments, round after round.
//! - [`drain_checking_hints`], [`alive_until`]: drive a stream to its end checking its
//!   `size_hint`; wait for the runtime's task count.
//! - [`Logs`]: the `tracing` events of a test, with their levels, messages and fields.
//! - `TestRecorder` (feature `metrics`): a `metrics` recorder that remembers every value.
//! - [`jitters`]: a proptest strategy over every backoff `Jitter`.
//! - [`panicking_waker`]: a waker that panics when woken.
//!
//! Everything a helper starts is stopped when its handle is dropped, including while a
//! test unwinds from a panic. A missing `redis-server` (or `redis-cli`, for clusters) is
//! a test failure with one clear line ([`MISSING_REDIS`], [`MISSING_REDIS_CLI`]), never
//! a silent pass.
#![allow(dead_code)]

mod cluster;
mod delay_proxy;
mod drain;
mod lockstep;
mod logs;
#[cfg(feature = "metrics")]
mod recorder;
mod server;
mod tempdir;
mod wakers;

// Not every test binary uses every helper.
#[allow(unused_imports)]
pub use cluster::RedisCluster;
#[allow(unused_imports)]
pub use delay_proxy::DelayProxy;
#[allow(unused_imports)]
pub use drain::{alive_until, drain_checking_hints};
#[allow(unused_imports)]
pub use lockstep::lockstep;
#[allow(unused_imports)]
pub use logs::{Logged, Logs};
#[allow(unused_imports)]
#[cfg(feature = "metrics")]
pub use recorder::TestRecorder;
#[allow(unused_imports)]
pub use server::{MISSING_REDIS, MISSING_REDIS_CLI, RedisServer};
#[allow(unused_imports)]
pub use tempdir::TempDir;
#[allow(unused_imports)]
pub use wakers::panicking_waker;

/// Every `stop` label of `flowgate_retry_stopped_total`.
#[allow(dead_code)]
pub const RETRY_STOPS: [&str; 7] = [
    "success",
    "fatal",
    "gave_up",
    "budget",
    "timed_out",
    "not_retryable",
    "cancelled",
];

/// Polls each future once with a waker that does nothing, asserting it waits: `n` waiters
/// queued, in order (the O(1) cancellation tests then drop them newest first).
pub fn queue_waiters<F: std::future::Future>(
    n: usize,
    mut new: impl FnMut() -> F,
) -> Vec<std::pin::Pin<Box<F>>> {
    let waker = futures::task::noop_waker();
    let mut cx = std::task::Context::from_waker(&waker);
    (0..n)
        .map(|_| {
            let mut f = Box::pin(new());
            assert!(f.as_mut().poll(&mut cx).is_pending(), "expected to wait");
            f
        })
        .collect()
}

/// Every backoff [`Jitter`](flowgate::retry::Jitter), for property tests.
pub fn jitters() -> impl proptest::strategy::Strategy<Value = flowgate::retry::Jitter> {
    use flowgate::retry::Jitter;
    use proptest::prelude::Just;
    proptest::prop_oneof![
        Just(Jitter::None),
        Just(Jitter::Full),
        Just(Jitter::Equal),
        Just(Jitter::Decorrelated),
    ]
}
