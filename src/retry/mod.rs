//! The outbound side: calling a downstream that limits you, politely.
//!
//! A server that answers `429 Too Many Requests` or `503 Service Unavailable` asks its
//! clients to back off, often saying for how long (`Retry-After`) and how fast they may
//! come back (the IETF `RateLimit` fields). This module holds the pieces a client needs to
//! listen:
//!
//! | piece | what it does |
//! |---|---|
//! | [`Backoff`] → [`Schedule`] | exponential backoff with the AWS jitters ([`Jitter`]), max attempts and a deadline over the whole operation; the server's `Retry-After` wins, bounded; gives up with a typed [`GiveUp`] |
//! | [`retry()`](retry()) with a [`RetryPolicy`] | the whole loop: waits for the policy's [`AdaptivePacer`](crate::pace::AdaptivePacer), runs the attempt (with a timeout), asks your [`Classify`] what the result means ([`Outcome`]: success, fatal, retry, unsent, back-pressure), tells the budget and the pacer, waits the backoff or the server's `Retry-After`; the round-trip time is each attempt's own; a [`RetryError`] says why it stopped ([`Stop`]) and after how many attempts |
//! | [`RetryBudget`] | gRPC's `retryThrottling`: retries only while the downstream mostly succeeds, shared by every clone, so a struggling downstream sees no retry storm |
//! | `RetryLayer` (feature `http`) | a tower client layer (hyper-util's client, any `Service<Request<B: Clone>>`): retry + backoff + budget + adaptive pacer, statuses classified by `HttpClassify`, the server's fields fed to the pacer on every response |
//! | `ServerHint`, `PolicyHint` (feature `http`) | parse a response's `Retry-After`, IETF `RateLimit` / `RateLimit-Policy`, draft-03 `RateLimit-*` and `X-RateLimit-*` into one value; malformed fields are ignored, no input panics |
//!
//! # A retry loop
//!
//! Each operation starts a [`Schedule`]; after each failed attempt the budget says whether a
//! retry is worth it, and the schedule how long to wait (the server's hint, when it sent
//! one):
//!
//! ```
//! use std::time::Duration;
//! use flowgate::retry::{Backoff, RetryBudget};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let backoff = Backoff::builder().deadline(Duration::from_secs(30)).seed(1).build()?;
//! let budget = RetryBudget::new(10, 0.1)?;
//!
//! let mut schedule = backoff.start();
//! let mut calls = 0;
//! let result = loop {
//!     calls += 1;
//!     // The downstream: fails twice with `Retry-After: 1`, then answers.
//!     let outcome: Result<&str, Option<Duration>> =
//!         if calls < 3 { Err(Some(Duration::from_secs(1))) } else { Ok("done") };
//!     match outcome {
//!         Ok(v) => {
//!             budget.on_success();
//!             break Ok(v);
//!         }
//!         Err(retry_after) => {
//!             // The schedule first: a retry it will not make is a failure for the
//!             // budget, not a retry asked of it.
//!             let delay = match schedule.next_delay(retry_after) {
//!                 Ok(delay) => delay,
//!                 Err(give_up) => {
//!                     budget.on_failure();
//!                     break Err(give_up.to_string());
//!                 }
//!             };
//!             if !budget.try_retry() {
//!                 break Err("retry budget exhausted".to_string());
//!             }
//!             tokio::time::sleep(delay).await;
//!         }
//!     }
//! };
//! assert_eq!(result, Ok("done"));
//! assert_eq!(schedule.elapsed(), Duration::from_secs(2)); // waited what the server said
//! # Ok(())
//! # }
//! ```
//!
//! # Time
//!
//! Schedules measure time with `tokio::time`, so tests run under paused time; a
//! `ServerHint` measures HTTP-dates and Unix times from the response's `Date` (the
//! server's clock), else from the `now` it is given (a `SystemTime`).
//!
//! # Metrics
//!
//! Labelled by the budget's `name`: `flowgate_retry_budget_retries_total` by `outcome`
//! (`allowed`, `refused`), `flowgate_retry_budget_abandoned_total` (retries allowed, then
//! never made: the retries made are `allowed − abandoned`) and
//! `flowgate_retry_budget_tokens`.
//!
//! Labelled by the [`RetryPolicy`]'s `name` ([`retry()`](retry()) and `RetryLayer`):
//! `flowgate_retry_attempts_total` (every attempt sent, one dropped under way included;
//! sent means handed to the operation or the inner service, so an attempt that never
//! reached the server counts too: a connection refused, or one dropped before its request
//! was written, which a server's own count of requests does not see),
//! `flowgate_retry_attempt_seconds` (each attempt's own round-trip time, a histogram, for
//! the attempts that ended: answered, failed or timed out) and
//! `flowgate_retry_stopped_total` by `stop` (`success`, `fatal`, `gave_up`, `budget`,
//! `timed_out`, `not_retryable`, and `cancelled` for an operation dropped before it
//! ended): each operation counts exactly one stop (an operation is a call of
//! [`retry()`](retry()) whose future was polled, or a request given to `Retry::call`; a
//! `retry()` future dropped before its first poll did nothing and counts nothing, as an
//! `async fn` does not start until polled; an error of `Retry`'s own `poll_ready`, before
//! any request, is returned as a `fatal` stop and counted nowhere).
//! The same reason is in what the caller gets, with or without the `metrics` feature:
//! [`Retried::stop`], `RetryInfo::stop` on a response, [`RetryError::stop`] on an error.
//!
//! # Cancellation
//!
//! [`retry()`](retry()) and `RetryFuture` may be dropped at any point (a caller's timeout, a
//! `select!`): the operation ends there, nothing is sent afterwards, and it is counted once,
//! as a `cancelled` stop. A `retry()` future dropped before its first poll (a `select!`
//! whose other branch was ready first) started nothing and counts no stop; a `RetryFuture`
//! never polled counts its `cancelled` stop, as its request was given to `call`. An attempt
//! under way was sent (it counts as an attempt, with no outcome for the budget or the
//! pacer); a retry the budget allowed but not yet sent is counted as abandoned
//! ([`RetryBudget::abandon_retry`]); its token stays taken, because the attempt before it
//! did fail.

mod backoff;
mod budget;
mod call;
#[cfg(feature = "http")]
mod hint;
#[cfg(feature = "http")]
mod layer;

pub use backoff::{Backoff, BackoffBuilder, GiveUp, Jitter, Schedule};
pub use budget::{RetryBudget, RetryBudgetBuilder, RetryBudgetStats};
pub use call::{
    Classify, Outcome, Retried, RetryError, RetryPolicy, RetryPolicyBuilder, Stop, retry,
};
#[cfg(feature = "http")]
#[cfg_attr(docsrs, doc(cfg(feature = "http")))]
pub use hint::{PolicyHint, ServerHint};
#[cfg(feature = "http")]
#[cfg_attr(docsrs, doc(cfg(feature = "http")))]
pub use layer::{HttpClassify, Retry, RetryFuture, RetryInfo, RetryLayer};
