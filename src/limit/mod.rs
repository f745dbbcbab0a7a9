//! Pure, synchronous limiter algorithms with an explicit clock: the reference math.
//!
//! Each algorithm is a state machine: [`Algorithm::check`]`(state, now, cost)` returns a
//! [`Decision`](crate::Decision) and consumes `cost` only when it admits. The algorithm is
//! immutable configuration; the state is a few integers per key ([`Limiter`] bundles one of
//! each). Nothing here reads a clock, sleeps or locks, so the same traces can be replayed in
//! tests, compared against the Redis scripts, and wrapped by the async gates of this crate.
//!
//! | algorithm | memory per key | guarantee |
//! |---|---|---|
//! | [`TokenBucket`] (GCRA) | one integer | cost in any interval `w` ≤ `burst + rate·w`, exactly |
//! | [`FixedWindow`] | two integers | ≤ `count` per aligned window |
//! | [`SlidingLog`] | ≤ `count` entries | ≤ `count` in any interval of length `window`, exactly |
//! | [`SlidingWindow`] | three integers | ≤ `count` per aligned window; < `2·count` in any interval (see its docs) |
//!
//! [`Keyed`] holds one state per key under one algorithm, with bounded memory, and evicts
//! keys whose state is back to neutral.
//!
//! All arithmetic is integer (nanoseconds, scaled where a rate does not divide evenly),
//! so decisions are exact and reproducible. `now` may be any `Duration`: past the ~584
//! years that `u64` nanoseconds hold (tokio's paused time gets there), the algorithms
//! compute in 128 bits, on a branch that earlier times never take.
//!
//! With a real clock, read a [`Clock`](crate::clock::Clock) in whole nanoseconds and decide
//! with [`Limiter::check_nanos`]: `limiter.check_nanos(clock.now_nanos(), cost)` decides as
//! `limiter.check(clock.now(), cost)` without building a `Duration` (a division by 10⁹ and
//! a multiplication back, measured at a quarter of a token-bucket decision). Its `u64`
//! saturates after ~584 years: a clock that may run longer (tokio's, paused) is read with
//! [`Clock::now`](crate::clock::Clock::now), which does not.

mod error;
mod fixed_window;
mod keyed;
mod limiter;
mod sliding_log;
mod sliding_window;
mod token_bucket;

pub use error::KeyedError;
pub use fixed_window::{FixedWindow, FixedWindowState};
pub use keyed::Keyed;
pub(crate) use limiter::nanos;
pub use limiter::{Algorithm, Limiter};
pub use sliding_log::{SlidingLog, SlidingLogState};
pub use sliding_window::{SlidingWindow, SlidingWindowState};
pub use token_bucket::{TokenBucket, TokenBucketState};
