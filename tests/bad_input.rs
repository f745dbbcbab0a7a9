//! Bad input at every public entry point: zero, one, the largest integers, `Duration::ZERO`
//! and `Duration::MAX`, NaN, infinities, negative and subnormal floats, empty and very long
//! keys, costs above capacity, time going backwards.
//!
//! The crate's rule: bad input gets a clear, typed error (a `ConfigError` naming its field,
//! a `CostError`, a `GateError`), never a panic, a hang or silent loss, and nothing grows
//! without a bound. Each property calls a constructor, setter or entry point with arbitrary
//! values and checks that it either answers sanely or refuses with the documented error.

use std::time::Duration;

use flowgate::adaptive::{
    AdaptiveLimit, Aimd, Gradient2, Outcome, Probe, Sample, Vegas, knee::KneeConfig,
    sim::Downstream,
};
use flowgate::bulkhead::{AcquireError, Bulkhead};
use flowgate::channel;
use flowgate::demand::{CommitTracker, Demanded, IterSource, Levels, Prefetch, TrackError};
use flowgate::gate::{GateError, Limit, MemoryGate};
use flowgate::limit::{
    Algorithm, FixedWindow, Keyed, KeyedError, SlidingLog, SlidingWindow, TokenBucket,
};
use flowgate::pace::{AdaptivePacer, Pacer};
use flowgate::retry::{Backoff, GiveUp, RetryBudget};
use flowgate::{ConfigError, ConfigErrorKind, CostError, Decision, Overflow, Quota, Rate};
use futures::StreamExt;
use proptest::prelude::*;

mod support;

#[path = "bad_input/adaptive_input.rs"]
mod adaptive_input;
#[cfg(feature = "redis")]
#[path = "bad_input/allocator_input.rs"]
mod allocator_input;
#[path = "bad_input/buffers.rs"]
mod buffers;
#[path = "bad_input/gates.rs"]
mod gates;
#[cfg(feature = "http")]
#[path = "bad_input/http_input.rs"]
mod http_input;
#[path = "bad_input/limit_math.rs"]
mod limit_math;
#[path = "bad_input/pacing.rs"]
mod pacing;
#[cfg(feature = "redis")]
#[path = "bad_input/redis_input.rs"]
mod redis_input;
#[cfg(feature = "redis")]
#[path = "bad_input/region_input.rs"]
mod region_input;
#[path = "bad_input/retry_input.rs"]
mod retry_input;

/// About a century, the crate's "forever".
const CENTURY: Duration = Duration::from_secs(100 * 365 * 24 * 60 * 60);

// ---------------------------------------------------------------------------------------
// Strategies: extremes first, then anything.

fn any_u32() -> impl Strategy<Value = u32> {
    prop_oneof![
        Just(0u32),
        Just(1),
        Just(2),
        Just(u32::MAX),
        Just(u32::MAX - 1),
        Just(i32::MAX as u32),
        1..100u32,
        any::<u32>(),
    ]
}

fn any_u64() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        Just(1),
        Just(u64::MAX),
        Just(u64::MAX - 1),
        Just(i64::MAX as u64),
        1..100u64,
        any::<u64>(),
    ]
}

fn any_usize() -> impl Strategy<Value = usize> {
    prop_oneof![
        Just(0usize),
        Just(1),
        Just(usize::MAX),
        Just(usize::MAX - 1),
        Just(usize::MAX >> 2),
        Just((usize::MAX >> 2) + 1),
        Just(i32::MAX as usize),
        1..100usize,
        any::<usize>(),
    ]
}

fn any_duration() -> impl Strategy<Value = Duration> {
    prop_oneof![
        Just(Duration::ZERO),
        Just(Duration::from_nanos(1)),
        Just(Duration::from_nanos(999)),
        Just(Duration::from_micros(1)),
        Just(Duration::from_millis(1)),
        Just(Duration::from_secs(1)),
        Just(CENTURY),
        Just(Duration::from_nanos(u64::MAX)),
        Just(Duration::from_nanos(u64::MAX) + Duration::from_nanos(1)),
        Just(Duration::MAX),
        Just(Duration::new(u64::MAX, 0)),
        (0..u64::MAX).prop_map(Duration::from_nanos),
        (any::<u64>(), 0..1_000_000_000u32).prop_map(|(s, n)| Duration::new(s, n)),
        (0..10_000_000_000u64).prop_map(Duration::from_nanos),
    ]
}

fn any_f64() -> impl Strategy<Value = f64> {
    prop_oneof![
        Just(f64::NAN),
        Just(f64::INFINITY),
        Just(f64::NEG_INFINITY),
        Just(-0.0),
        Just(0.0),
        Just(f64::MIN_POSITIVE),
        Just(5e-324), // the smallest subnormal
        Just(-5e-324),
        Just(-1.0),
        Just(0.5),
        Just(1.0),
        Just(1.0 - f64::EPSILON),
        Just(1.0 + f64::EPSILON),
        Just(10.0),
        Just(f64::MAX),
        Just(f64::MIN),
        0.0..1.0f64,
        0.0..100.0f64,
        any::<f64>(),
    ]
}

fn any_rate() -> impl Strategy<Value = Rate> {
    (
        any_u32().prop_filter("a count of at least 1", |&c| c > 0),
        prop_oneof![
            Just(1u64),
            Just(1_000),
            Just(1_000_000_000),
            Just(u64::MAX),
            1..u64::MAX
        ],
    )
        .prop_map(|(count, ns)| Rate::per(count, Duration::from_nanos(ns)).unwrap())
}

fn any_quota() -> impl Strategy<Value = Quota> {
    (
        any_rate(),
        any_u32().prop_filter("a burst of at least 1", |&b| b > 0),
    )
        .prop_map(|(rate, burst)| Quota::new(rate, burst).unwrap())
}

fn any_limit() -> impl Strategy<Value = Limit> {
    prop_oneof![
        any_quota().prop_map(Limit::TokenBucket),
        any_rate().prop_map(Limit::FixedWindow),
        any_rate().prop_map(Limit::SlidingLog),
        any_rate().prop_map(Limit::SlidingWindow),
    ]
}

/// Keys of every length around the gates' bound of 512 bytes.
fn any_key() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        Just("k".to_string()),
        Just("é".repeat(256)),     // 512 bytes
        Just("x".repeat(512)),     // the longest key
        Just("x".repeat(513)),     // one byte too many
        Just("x".repeat(1 << 16)), // far too long
        Just("\0".to_string()),
        Just("{tag}:key".to_string()),
        "\\PC{0,40}",
    ]
}

/// A paused current-thread runtime: a sleep of any length ends at once.
fn paused() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap()
}

/// A config error names a field and says why, in a lowercase message without a period.
fn sane_config_error(e: &ConfigError) {
    assert!(!e.field().is_empty());
    assert!(!e.reason().is_empty(), "{e:?}");
    let shown = e.to_string();
    assert!(shown.starts_with("invalid "), "{shown}");
    assert!(!shown.ends_with('.'), "{shown}");
}

fn any_overflow() -> impl Strategy<Value = Overflow> {
    prop_oneof![
        Just(Overflow::Backpressure),
        Just(Overflow::Reject),
        Just(Overflow::DropNewest),
        Just(Overflow::DropOldest),
    ]
}
