//! `retry`: one operation, attempted until it succeeds, fails for good, or the policy
//! gives up; with backoff, a retry budget and an adaptive pacer.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

use crate::error::ConfigError;
use crate::metrics::{Counter, Histogram, Labels};
use crate::pace::AdaptivePacer;
use crate::retry::backoff::{Backoff, GiveUp, Schedule};
use crate::retry::budget::RetryBudget;
use crate::sync::{Arc, Panics};

/// Names of the retry metrics.
mod names {
    pub(super) const ATTEMPTS: &str = "flowgate_retry_attempts_total";
    pub(super) const STOPPED: &str = "flowgate_retry_stopped_total";
    pub(super) const RTT: &str = "flowgate_retry_attempt_seconds";
}

/// What one attempt's outcome means for the operation, as a [`Classify`] sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// Done, and the downstream is fine: stop; a success for the budget and the pacer.
    Success,
    /// Done, but retrying cannot help (a `400`, a `404`): stop. Says nothing about the
    /// downstream's load: neither the budget nor the pacer hears of it.
    Fatal,
    /// A transient failure (a `500`, a reset connection): retry after the backoff's delay,
    /// if the budget allows.
    Retry,
    /// The attempt failed before its request reached the server (a refused connection, a
    /// failed DNS lookup, a connect timeout: hyper-util's `Error::is_connect`): retried as
    /// [`Retry`](Outcome::Retry) is, and by `RetryLayer` whatever the method, a `POST`
    /// included, since nothing can have acted on it (Envoy's `connect-failure`, gRPC's
    /// transparent retries). [`HttpClassify`](crate::retry::HttpClassify) cannot tell a
    /// connect error from another transport error, so a classifier of your own says so.
    Unsent,
    /// The downstream is overloaded or limiting this client (`429`, `503`, a timeout):
    /// the pacer slows down (and pauses until `retry_after`, at most the backoff's
    /// [`max_retry_after`](crate::retry::BackoffBuilder::max_retry_after)), then retry, if
    /// the budget allows, after `retry_after` when the server said, else the backoff's
    /// delay. A zero `retry_after` (`Retry-After: 0`) means now: the retry goes at once
    /// (plus any [`retry_after_jitter`](crate::retry::BackoffBuilder::retry_after_jitter)),
    /// and the pacer is not paused (nor a pause counted), only slowed down.
    BackPressure {
        /// The server's `Retry-After`, if it sent one.
        retry_after: Option<Duration>,
    },
}

/// Decides what each attempt's result means: which outcomes are retryable and which are
/// back-pressure. Called once per attempt, with the attempt's own result.
///
/// Implemented for every `Fn(&Result<T, E>) -> Outcome`.
pub trait Classify<T, E> {
    /// The [`Outcome`] of one attempt.
    fn classify(&self, result: &Result<T, E>) -> Outcome;
}

impl<T, E, F> Classify<T, E> for F
where
    F: Fn(&Result<T, E>) -> Outcome,
{
    fn classify(&self, result: &Result<T, E>) -> Outcome {
        self(result)
    }
}

/// Why [`retry`] (or `RetryLayer`) stopped: in [`Retried`], in `RetryInfo`, and in every
/// [`RetryError`] ([`RetryError::stop`]). The `stop` label of
/// `flowgate_retry_stopped_total` names the same reasons.
///
/// Its `Display` names the reason in lowercase, without a trailing period.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Stop {
    /// The last attempt was a [`Outcome::Success`].
    Success,
    /// The last attempt was [`Outcome::Fatal`].
    Fatal,
    /// The backoff gave up: attempts exhausted, the deadline, a `Retry-After` too long or
    /// past the deadline.
    GaveUp(GiveUp),
    /// The retry budget refused a retry: the downstream fails too often for retries to
    /// help.
    Budget,
    /// The attempt ran past the policy's
    /// [`attempt_timeout`](RetryPolicyBuilder::attempt_timeout) and was not retried (the
    /// backoff gave up, the budget refused, or the request may not be sent twice): there
    /// is no result.
    TimedOut,
    /// The attempt failed in a way worth retrying ([`Outcome::Retry`], or back-pressure
    /// without a response), but the request may not be sent twice: `RetryLayer` resends
    /// only the methods of its `retry_methods` (by default the idempotent ones), so a
    /// `POST` that met a `500` or a reset connection stops here. [`retry`] never stops so.
    NotRetryable,
}

impl Stop {
    fn as_str(&self) -> &'static str {
        match self {
            Stop::Success => "success",
            Stop::Fatal => "fatal",
            Stop::GaveUp(_) => "gave_up",
            Stop::Budget => "budget",
            Stop::TimedOut => "timed_out",
            Stop::NotRetryable => "not_retryable",
        }
    }
}

impl fmt::Display for Stop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Stop::Success => f.write_str("succeeded"),
            Stop::Fatal => f.write_str("fatal, not retried"),
            Stop::GaveUp(give_up) => give_up.fmt(f),
            Stop::Budget => f.write_str("retry budget exhausted"),
            Stop::TimedOut => f.write_str("the last attempt timed out"),
            Stop::NotRetryable => f.write_str("not retried, the request may not be sent twice"),
        }
    }
}

/// What [`retry`] ends with: the last attempt's result, how many attempts were made, and
/// why it stopped.
#[derive(Debug)]
#[non_exhaustive]
pub struct Retried<T, E> {
    /// The last attempt's result; `None` only when the last attempt timed out
    /// ([`Stop::TimedOut`]), or when no attempt was made (`attempts` 0: the policy's pacer
    /// would have held the first one past the backoff's deadline, [`GiveUp::Deadline`]).
    pub result: Option<Result<T, E>>,
    /// Attempts made, the first included.
    pub attempts: u32,
    /// Why it stopped.
    pub stop: Stop,
}

impl<T, E> Retried<T, E> {
    /// Whether the operation ended with an [`Outcome::Success`].
    pub fn is_success(&self) -> bool {
        self.stop == Stop::Success
    }

    /// The last attempt's result.
    ///
    /// # Errors
    ///
    /// [`RetryError::Inner`] with the last attempt's error (and why it was not retried),
    /// [`RetryError::TimedOut`]
    /// when the last attempt timed out, or [`RetryError::NotSent`] when no attempt was
    /// made.
    pub fn into_result(self) -> Result<T, RetryError<E>> {
        match (self.result, self.stop) {
            (Some(Ok(v)), _) => Ok(v),
            (Some(Err(error)), stop) => Err(RetryError::Inner {
                error,
                stop,
                attempts: self.attempts,
            }),
            (None, Stop::GaveUp(give_up)) if self.attempts == 0 => {
                Err(RetryError::NotSent(give_up))
            }
            (None, _) => Err(RetryError::TimedOut {
                attempts: self.attempts,
            }),
        }
    }
}

/// The error of [`Retried::into_result`] and of `RetryLayer`'s service: the last
/// attempt's error (or none), why the retries stopped ([`stop`](RetryError::stop)) and the
/// attempts made ([`attempts`](RetryError::attempts)).
///
/// Its `Display` names the reason in lowercase, without a trailing period, then the
/// attempts and the last attempt's error: `gave up after 5 attempts: connection reset`,
/// `retry budget exhausted (2 attempts): connection reset` (so it says everything for an
/// error that is only `Display`). As an [`Error`](std::error::Error) (when `E` is one) its
/// [`source`](std::error::Error::source) is therefore the last attempt's error's own source,
/// never that error again nor the [`GiveUp`]: a reporter walking the chain prints each
/// message once. Reach the last attempt's error itself with [`inner`](RetryError::inner).
///
/// # Examples
///
/// ```
/// use flowgate::retry::{retry, Backoff, GiveUp, Outcome, RetryPolicy, Stop};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let policy = RetryPolicy::builder(Backoff::builder().max_attempts(3).build()?).build()?;
/// let classify = |_: &Result<(), &str>| Outcome::Retry;
/// let done = retry(&policy, classify, |_| async { Err("connection reset") }).await;
/// let err = done.into_result().unwrap_err();
/// assert_eq!(err.stop(), Stop::GaveUp(GiveUp::Attempts { attempts: 3 }));
/// assert_eq!(err.attempts(), 3);
/// assert_eq!(err.to_string(), "gave up after 3 attempts: connection reset");
/// assert_eq!(err.into_inner(), Some("connection reset"));
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub enum RetryError<E> {
    /// The last attempt's own error.
    Inner {
        /// The error.
        error: E,
        /// Why it was not retried: never [`Stop::TimedOut`].
        stop: Stop,
        /// Attempts made, the first included (0 when `RetryLayer`'s inner service failed
        /// to become ready for the first one).
        attempts: u32,
    },
    /// The last attempt ran past the attempt timeout ([`Stop::TimedOut`]).
    TimedOut {
        /// Attempts made.
        attempts: u32,
    },
    /// No attempt was sent: the policy's pacer would have held the first one until the
    /// backoff's deadline or past it ([`GiveUp::Deadline`], whose `delay` is the pacer's
    /// wait), so the operation ended at once.
    NotSent(GiveUp),
}

impl<E> RetryError<E> {
    /// Why the retries stopped: [`Stop::TimedOut`] for [`RetryError::TimedOut`],
    /// [`Stop::GaveUp`] for [`RetryError::NotSent`].
    pub fn stop(&self) -> Stop {
        match self {
            RetryError::Inner { stop, .. } => *stop,
            RetryError::TimedOut { .. } => Stop::TimedOut,
            RetryError::NotSent(give_up) => Stop::GaveUp(*give_up),
        }
    }

    /// The attempts made, the first included (0 when none was sent).
    pub fn attempts(&self) -> u32 {
        match self {
            RetryError::Inner { attempts, .. } | RetryError::TimedOut { attempts } => *attempts,
            RetryError::NotSent(_) => 0,
        }
    }

    /// The last attempt's own error, if it ended with one.
    pub fn inner(&self) -> Option<&E> {
        match self {
            RetryError::Inner { error, .. } => Some(error),
            RetryError::TimedOut { .. } | RetryError::NotSent(_) => None,
        }
    }

    /// The last attempt's own error, if it ended with one.
    pub fn into_inner(self) -> Option<E> {
        match self {
            RetryError::Inner { error, .. } => Some(error),
            RetryError::TimedOut { .. } | RetryError::NotSent(_) => None,
        }
    }
}

impl<E: fmt::Display> fmt::Display for RetryError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            // The reason says the attempts already.
            RetryError::Inner {
                error,
                stop: stop @ Stop::GaveUp(GiveUp::Attempts { .. }),
                ..
            } => write!(f, "{stop}: {error}"),
            RetryError::Inner {
                error,
                stop,
                attempts: 1,
            } => write!(f, "{stop} (1 attempt): {error}"),
            RetryError::Inner {
                error,
                stop,
                attempts,
            } => write!(f, "{stop} ({attempts} attempts): {error}"),
            RetryError::TimedOut { attempts: 1 } => f.write_str("the only attempt timed out"),
            RetryError::TimedOut { attempts } => {
                write!(f, "the last of {attempts} attempts timed out")
            }
            RetryError::NotSent(give_up) => write!(f, "no attempt was sent: {give_up}"),
        }
    }
}

/// The source is the last attempt's error's own source, not that error: its message is in
/// this one's `Display` already (as the reason's is), and a reporter that walks the chain
/// (anyhow's `{:#}`, eyre) prints every message once. The last attempt's error itself is
/// [`inner`](RetryError::inner).
impl<E: std::error::Error + 'static> std::error::Error for RetryError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            RetryError::Inner { error, .. } => error.source(),
            RetryError::TimedOut { .. } | RetryError::NotSent(_) => None,
        }
    }
}

/// How [`retry`] retries: a [`Backoff`], and optionally a [`RetryBudget`], an
/// [`AdaptivePacer`] every attempt waits for, and a timeout per attempt. Cheap to clone;
/// clones share the budget, the pacer and the metrics.
#[derive(Clone)]
pub struct RetryPolicy {
    inner: Arc<PolicyInner>,
}

struct PolicyInner {
    backoff: Backoff,
    budget: Option<RetryBudget>,
    pacer: Option<AdaptivePacer>,
    attempt_timeout: Option<Duration>,
    name: Option<String>,
    attempts: Counter,
    /// By [`Stop`], in the order of `count_stop`, then `cancelled`.
    stopped: [Counter; 7],
    rtt: Histogram,
}

impl fmt::Debug for RetryPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p = &*self.inner;
        f.debug_struct("RetryPolicy")
            .field("name", &p.name)
            .field("backoff", &p.backoff)
            .field("budget", &p.budget)
            .field("pacer", &p.pacer)
            .field("attempt_timeout", &p.attempt_timeout)
            .finish()
    }
}

impl RetryPolicy {
    /// A builder for a policy that retries with `backoff`.
    pub fn builder(backoff: Backoff) -> RetryPolicyBuilder {
        RetryPolicyBuilder {
            backoff,
            budget: None,
            pacer: None,
            attempt_timeout: None,
            name: None,
        }
    }

    /// The backoff.
    pub fn backoff(&self) -> &Backoff {
        &self.inner.backoff
    }

    /// The retry budget, if any.
    pub fn budget(&self) -> Option<&RetryBudget> {
        self.inner.budget.as_ref()
    }

    /// The adaptive pacer, if any.
    pub fn pacer(&self) -> Option<&AdaptivePacer> {
        self.inner.pacer.as_ref()
    }

    /// The policy's name, if it was given one.
    pub fn name(&self) -> Option<&str> {
        self.inner.name.as_deref()
    }

    /// Count an attempt as it is sent (so that one dropped under way counts too).
    pub(crate) fn count_attempt(&self) {
        self.inner.attempts.increment(1);
    }

    /// Record an attempt's outcome with the budget (a success: a failure reaches it through
    /// [`next`](Self::next), or as a request not sent again) and the pacer. Its round-trip
    /// time goes to the metrics afterwards, [`record_rtt`](Self::record_rtt).
    ///
    /// Both run metrics recorders (user code): a panic there is caught into `unheard`, to
    /// be resumed once the other, and the budget through [`next`](Self::next), heard of the
    /// attempt.
    pub(crate) fn record(&self, outcome: Outcome, unheard: &mut Panics) {
        let p = &*self.inner;
        match outcome {
            Outcome::Success => {
                if let Some(b) = &p.budget {
                    unheard.run(|| b.on_success());
                }
                if let Some(pacer) = &p.pacer {
                    unheard.run(|| pacer.on_success());
                }
            }
            Outcome::BackPressure { retry_after } => {
                if let Some(pacer) = &p.pacer {
                    // Honoured up to the backoff's `max_retry_after`, as the schedule honours
                    // it: a longer hint must not hold every later attempt for its length. A
                    // zero one (`Retry-After: 0`, "now") pauses nothing: no pause is counted,
                    // and the pacer's burst is not taken by one that ends at once.
                    let max = p.backoff.max_retry_after();
                    let pause = retry_after.map(|d| d.min(max)).filter(|d| !d.is_zero());
                    unheard.run(|| pacer.on_back_pressure(pause));
                }
            }
            Outcome::Fatal | Outcome::Retry | Outcome::Unsent => {}
        }
    }

    /// Record an attempt's `rtt` (the attempt alone, never its wait for the pacer or a
    /// backoff) in the histogram: last, once the budget and the pacer heard of the attempt,
    /// a failure included (after [`next`](Self::next)). A metrics recorder is user code,
    /// and one that panics must not keep the outcome from them.
    pub(crate) fn record_rtt(&self, rtt: Duration) {
        self.inner.rtt.record(rtt.as_secs_f64());
    }

    /// After a failed attempt (`Retry`, `Unsent` / `BackPressure`): the wait before the next one, or
    /// why not to retry. Takes a token from the budget; only a retry the schedule allows
    /// is asked of it (counted as allowed or refused).
    pub(crate) fn next(&self, schedule: &mut Schedule, outcome: Outcome) -> Result<Duration, Stop> {
        let hint = match outcome {
            Outcome::BackPressure { retry_after } => retry_after,
            _ => None,
        };
        let budget = self.inner.budget.as_ref();
        match schedule.next_delay_paced(hint, self.paced()) {
            Err(give_up) => {
                // Not retried anyway: a failure for the budget, not a retry asked of it.
                if let Some(b) = budget {
                    b.on_failure();
                }
                Err(Stop::GaveUp(give_up))
            }
            Ok(_) if budget.is_some_and(|b| !b.try_retry()) => Err(Stop::Budget),
            Ok(delay) => Ok(delay),
        }
    }

    /// How long the pacer would hold an attempt that joined it now, when a deadline makes
    /// it matter (it counts against the deadline as the backoff's delay does); else zero.
    fn paced(&self) -> Duration {
        match &self.inner.pacer {
            Some(pacer) if self.inner.backoff.deadline().is_some() => pacer.wait_estimate(),
            _ => Duration::ZERO,
        }
    }

    /// Before the first attempt: whether the pacer would hold it until the deadline or
    /// past it (then no attempt is made).
    pub(crate) fn first_past_deadline(&self, schedule: &Schedule) -> Option<GiveUp> {
        self.inner.pacer.as_ref()?;
        schedule.past_deadline(self.paced())
    }

    /// A retry the budget allowed will not be sent: the operation ends before it.
    pub(crate) fn abandon_retry(&self) {
        if let Some(b) = &self.inner.budget {
            b.abandon_retry();
        }
    }

    /// The operation was dropped before it ended: a `cancelled` stop; `retry_pending` when
    /// a retry was allowed and not sent yet (it is abandoned).
    ///
    /// Each count runs whatever the other did (a metrics recorder, a log subscriber: user
    /// code), then the first panic goes on (dropped while the thread already unwinds).
    pub(crate) fn count_cancelled(&self, retry_pending: bool) {
        let mut panics = Panics::new();
        if retry_pending {
            panics.run(|| self.abandon_retry());
        }
        panics.run(|| self.inner.stopped[6].increment(1));
        panics.run(|| {
            tracing::debug!(
                policy = self
                    .inner
                    .name
                    .as_deref()
                    .unwrap_or(crate::metrics::DEFAULT_NAME),
                retry_pending,
                "retry: dropped before it ended",
            );
        });
        panics.resume();
    }

    pub(crate) fn count_stop(&self, stop: &Stop) {
        let i = match stop {
            Stop::Success => 0,
            Stop::Fatal => 1,
            Stop::GaveUp(_) => 2,
            Stop::Budget => 3,
            Stop::TimedOut => 4,
            Stop::NotRetryable => 5,
        };
        self.inner.stopped[i].increment(1);
        if !matches!(stop, Stop::Success | Stop::Fatal) {
            tracing::debug!(
                policy = self.inner.name.as_deref().unwrap_or(crate::metrics::DEFAULT_NAME),
                stop = ?stop,
                "retry: stopped retrying",
            );
        }
    }

    pub(crate) fn attempt_timeout(&self) -> Option<Duration> {
        self.inner.attempt_timeout
    }
}

/// A builder for a [`RetryPolicy`], from [`RetryPolicy::builder`].
#[derive(Debug)]
pub struct RetryPolicyBuilder {
    backoff: Backoff,
    budget: Option<RetryBudget>,
    pacer: Option<AdaptivePacer>,
    attempt_timeout: Option<Duration>,
    name: Option<String>,
}

impl RetryPolicyBuilder {
    /// Retry only while `budget` allows (shared with every clone of it: one budget per
    /// downstream, whoever calls it).
    pub fn budget(mut self, budget: RetryBudget) -> Self {
        self.budget = Some(budget);
        self
    }

    /// Wait for `pacer` before every attempt, and tell it each attempt's outcome (it slows
    /// down on back-pressure, climbs back on success).
    pub fn pacer(mut self, pacer: AdaptivePacer) -> Self {
        self.pacer = Some(pacer);
        self
    }

    /// Give up on an attempt that takes longer than `timeout` (the attempt alone). A
    /// timed-out attempt is back-pressure. The backoff's deadline is checked only between
    /// attempts, so this is what bounds an attempt under way.
    pub fn attempt_timeout(mut self, timeout: Duration) -> Self {
        self.attempt_timeout = Some(timeout);
        self
    }

    /// The `name` label of the metrics.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// The policy.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] on `retry_policy.attempt_timeout` when it is zero.
    pub fn build(self) -> Result<RetryPolicy, ConfigError> {
        if self.attempt_timeout.is_some_and(|t| t.is_zero()) {
            return Err(ConfigError::zero_duration("retry_policy.attempt_timeout"));
        }
        let labels = Labels::new(self.name.as_deref());
        let stop = |s: Stop| labels.counter(names::STOPPED, &[("stop", s.as_str())]);
        Ok(RetryPolicy {
            inner: Arc::new(PolicyInner {
                attempts: labels.counter(names::ATTEMPTS, &[]),
                stopped: [
                    stop(Stop::Success),
                    stop(Stop::Fatal),
                    stop(Stop::GaveUp(GiveUp::Attempts { attempts: 0 })),
                    stop(Stop::Budget),
                    stop(Stop::TimedOut),
                    stop(Stop::NotRetryable),
                    labels.counter(names::STOPPED, &[("stop", "cancelled")]),
                ],
                rtt: labels.histogram(names::RTT, &[]),
                backoff: self.backoff,
                budget: self.budget,
                pacer: self.pacer,
                attempt_timeout: self.attempt_timeout,
                name: self.name,
            }),
        })
    }
}

/// Attempt `op` until `classify` calls an attempt a success or fatal, or `policy` gives
/// up; return the last attempt's result.
///
/// Each attempt first waits for the policy's pacer (if any), then runs `op(attempt)`
/// (`attempt` counts from 1) under the attempt timeout (if any). Its round-trip time is
/// that attempt's alone, never the wait before it. After a [`Outcome::Retry`],
/// [`Outcome::Unsent`] or [`Outcome::BackPressure`], the backoff's schedule is asked, then the budget (which
/// hears of the failure either way): the wait is the server's `Retry-After` when it sent
/// one, else the jittered backoff; the schedule gives up when attempts run out or the
/// deadline would pass (at once, without waiting for a `Retry-After` past it).
///
/// The backoff's deadline is checked before each wait: no attempt starts after a wait that
/// would reach it, the pacer's wait counted (the longer of the backoff's delay and the
/// pacer's wait; a first attempt the pacer would hold that long is not made:
/// [`RetryError::NotSent`]). It does not cut an attempt short, so the operation can end
/// past it; and a pacer shared with other callers may hold an attempt longer than it said
/// when the wait began (its line grew, a `Retry-After` paused it), which is not cut short
/// either. An [`attempt_timeout`](RetryPolicyBuilder::attempt_timeout) bounds each attempt
/// on its own: one started just before the deadline may still run that long. To end the
/// operation by a given time, bound the future returned here with `tokio::time::timeout`
/// (see Cancel safety for what a drop counts).
///
/// # Panics
///
/// The waits are tokio timers (the backoff's delay, the attempt timeout, the pacer's
/// wait): polled outside a tokio runtime with timers enabled, the future panics unless the
/// first attempt ends the operation without a timeout or a wait. A panic of `op` or of the
/// classifier unwinds through the future and is counted as a drop is (see Cancel safety).
///
/// # Cancel safety
///
/// Not cancel-safe in the sense that dropping the future loses the operation: it drops the
/// attempt under way (and its result) or the wait before the next attempt, and nothing is
/// retried afterwards. Nothing is lost unseen: the budget and the pacer have heard of every
/// attempt that ended (an attempt dropped under way has no outcome, so neither hears of
/// it); the drop is counted once as a `cancelled` stop
/// (`flowgate_retry_stopped_total{stop="cancelled"}`), once the future was polled (dropped
/// before its first poll, as a `select!` whose other branch was ready first drops it, it
/// started nothing, and counts nothing: an `async fn` runs none of its body until polled);
/// an attempt dropped under way was made and counts in `flowgate_retry_attempts_total` (not in the round-trip histogram),
/// once `op` returned its future (an `op` that panics before returning it made none: its
/// panic drops the operation as a drop does); a retry the budget allowed and the drop
/// prevented is counted as [`abandoned`](crate::retry::RetryBudgetStats::abandoned) (its
/// token stays taken: the attempt before it failed).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use flowgate::retry::{retry, Backoff, Outcome, RetryPolicy, Stop};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let policy = RetryPolicy::builder(Backoff::builder().seed(7).build()?).build()?;
/// // The downstream answers 503 with `Retry-After: 2` twice, then 200.
/// let classify = |r: &Result<u16, std::io::Error>| match r {
///     Ok(200) => Outcome::Success,
///     Ok(503) => Outcome::BackPressure { retry_after: Some(Duration::from_secs(2)) },
///     Ok(_) => Outcome::Fatal,
///     Err(_) => Outcome::Retry,
/// };
/// let start = tokio::time::Instant::now();
/// let done = retry(&policy, classify, |attempt| async move {
///     Ok(if attempt < 3 { 503 } else { 200 })
/// })
/// .await;
/// assert_eq!((done.attempts, done.stop.clone()), (3, Stop::Success));
/// assert_eq!(start.elapsed(), Duration::from_secs(4)); // what the server asked for
/// assert_eq!(done.into_result()?, 200);
/// # Ok(())
/// # }
/// ```
pub async fn retry<T, E, C, F, Fut>(policy: &RetryPolicy, classify: C, mut op: F) -> Retried<T, E>
where
    C: Classify<T, E>,
    F: FnMut(u32) -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let mut schedule = policy.backoff().start();
    // Counts what a drop leaves unfinished; disarmed when the operation ends.
    let mut unfinished = Unfinished {
        policy,
        retry_pending: false,
        ended: false,
    };
    if let Some(give_up) = policy.first_past_deadline(&schedule) {
        let stop = Stop::GaveUp(give_up);
        unfinished.ended = true;
        policy.count_stop(&stop);
        return Retried {
            result: None,
            attempts: 0,
            stop,
        };
    }
    loop {
        let attempt = schedule.attempts();
        if let Some(pacer) = policy.pacer() {
            // Cost 1 never exceeds a pacer's burst (at least 1): this cannot fail.
            let _ = pacer.until_ready(1).await;
        }
        let started = Instant::now();
        let fut = op(attempt);
        // Sent: counted now, so that one dropped under way counts too. An `op` that panics
        // before returning its future sent nothing: a retry then is abandoned (as
        // `RetryLayer` counts a `call` that panics).
        policy.count_attempt();
        unfinished.retry_pending = false;
        let (result, outcome) = match policy.attempt_timeout() {
            Some(limit) => match tokio::time::timeout(limit, fut).await {
                Ok(result) => {
                    let outcome = classify.classify(&result);
                    (Some(result), outcome)
                }
                Err(_) => (None, Outcome::BackPressure { retry_after: None }),
            },
            None => {
                let result = fut.await;
                let outcome = classify.classify(&result);
                (Some(result), outcome)
            }
        };
        let rtt = started.elapsed();
        let mut unheard = Panics::new();
        policy.record(outcome, &mut unheard);
        let next = match outcome {
            Outcome::Success => Err(Stop::Success),
            Outcome::Fatal => Err(Stop::Fatal),
            Outcome::Retry | Outcome::Unsent | Outcome::BackPressure { .. } => policy
                .next(&mut schedule, outcome)
                // A timed-out attempt not retried ends timed out, whatever stopped it.
                .map_err(|stop| {
                    if result.is_none() {
                        Stop::TimedOut
                    } else {
                        stop
                    }
                }),
        };
        // A retry allowed is pending from here: a panic below abandons it.
        unfinished.retry_pending = next.is_ok();
        // After the budget heard of a failure: see `record_rtt`. A panic of the budget's or
        // the pacer's recorder goes on from here, the retry allowed pending (abandoned).
        policy.record_rtt(rtt);
        unheard.resume();
        match next {
            Ok(delay) => tokio::time::sleep(delay).await,
            Err(stop) => {
                unfinished.ended = true;
                policy.count_stop(&stop);
                return Retried {
                    result,
                    attempts: attempt,
                    stop,
                };
            }
        }
    }
}

/// What a [`retry`] dropped before it ended leaves unfinished, counted when it drops: the
/// `cancelled` stop, and the retry the budget allowed if it was not sent yet.
struct Unfinished<'a> {
    policy: &'a RetryPolicy,
    /// A retry was allowed and is not sent yet (the backoff or the pacer is waited for).
    retry_pending: bool,
    /// The operation ended (its stop is counted): nothing to count on drop.
    ended: bool,
}

impl Drop for Unfinished<'_> {
    fn drop(&mut self) {
        if !self.ended {
            self.policy.count_cancelled(self.retry_pending);
        }
    }
}
