//! `RetryBudget`: a token bucket of retries shared by every clone, after gRPC's
//! `retryThrottling` (`maxTokens`, `tokenRatio`).

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{ConfigError, ConfigErrorKind};
use crate::metrics::{Counter, Gauge, Labels};
use crate::sync::Panics;

/// Metric names.
pub(crate) mod names {
    /// Retries asked of a budget, by `outcome` (`allowed`, `refused`).
    pub(crate) const RETRIES: &str = "flowgate_retry_budget_retries_total";
    /// The tokens in a budget.
    pub(crate) const TOKENS: &str = "flowgate_retry_budget_tokens";
    /// Retries allowed that were never made.
    pub(crate) const ABANDONED: &str = "flowgate_retry_budget_abandoned_total";
}

/// Thousandths of a token: the budget's exact unit (gRPC's `tokenRatio` has at most three
/// decimals).
const MILLI: u64 = 1_000;

/// A retry budget: retries are allowed only while the downstream mostly succeeds, so a
/// struggling downstream is never hit by a retry storm.
///
/// The semantics of gRPC's `retryThrottling` (gRFC A6): the budget holds `max_tokens`
/// tokens to begin with; every failed attempt takes one (never below zero), every success
/// gives back `token_ratio` (never above `max_tokens`); a retry is allowed only while more
/// than `max_tokens / 2` tokens are left. With every attempt failing, a budget allows at
/// most `max_tokens / 2` retries plus `token_ratio` per success since; with a downstream
/// that fails rarely, the tokens stay near the top and no retry is refused.
///
/// Use: after a failed attempt, ask [`try_retry`](RetryBudget::try_retry) (it records
/// the failure and answers); after a success, call [`on_success`](RetryBudget::on_success);
/// after a failure that will not be retried anyway (the last attempt, an error that is not
/// retryable), call [`on_failure`](RetryBudget::on_failure); when a retry it allowed is not
/// made after all (the operation was dropped during its wait), call
/// [`abandon_retry`](RetryBudget::abandon_retry).
///
/// # A retry allowed, then abandoned
///
/// The token [`try_retry`](RetryBudget::try_retry) takes pays for the attempt that failed,
/// as in gRPC, not for the retry: it stays taken when the retry is never made (a caller's
/// timeout or `select!` dropped the operation while it waited), exactly as for a failure
/// that is not retried ([`on_failure`](RetryBudget::on_failure)). Giving it back would
/// hide a real failure from the budget, and a caller that cancels and calls again on every
/// failure would never be held back. Only the count changes:
/// [`abandon_retry`](RetryBudget::abandon_retry) counts the retry as
/// [`abandoned`](RetryBudgetStats::abandoned), so the retries actually made are
/// `allowed − abandoned`. [`retry()`](crate::retry::retry()) and `RetryLayer` call it
/// themselves when they are dropped between allowing a retry and sending it.
///
/// Tokens are counted in thousandths, exactly, in one atomic word updated by
/// compare-and-swap: clones share the budget, every call is lock-free and never waits,
/// and no update is ever lost between threads.
///
/// # Metrics
///
/// Labelled by `name`: `flowgate_retry_budget_retries_total` by `outcome` (`allowed`,
/// `refused`: every answer of [`try_retry`](RetryBudget::try_retry)),
/// `flowgate_retry_budget_abandoned_total` (allowed retries never made), the same counts
/// as [`stats`](RetryBudget::stats), and `flowgate_retry_budget_tokens` (a gauge).
///
/// # Examples
///
/// ```
/// use flowgate::retry::RetryBudget;
///
/// let budget = RetryBudget::new(10, 0.1)?;
/// // A downstream failing every time: 4 retries, then refused (10 → 9, 8, 7, 6 > 5; 5 is not).
/// let allowed = (0..10).filter(|_| budget.try_retry()).count();
/// assert_eq!(allowed, 4);
/// assert_eq!(budget.tokens(), 0.0);
/// // Successes give back 0.1 each.
/// for _ in 0..70 {
///     budget.on_success();
/// }
/// assert_eq!(budget.tokens(), 7.0);
/// assert!(budget.try_retry()); // 7 − 1 = 6 is above 5
/// assert!(!budget.try_retry()); // 6 − 1 = 5 is not
/// assert_eq!(budget.stats().allowed, 5);
/// # Ok::<(), flowgate::ConfigError>(())
/// ```
#[derive(Clone)]
pub struct RetryBudget {
    inner: Arc<Inner>,
}

struct Inner {
    /// Thousandths of a token.
    tokens: AtomicU64,
    /// `max_tokens`, in thousandths.
    max: u64,
    /// `token_ratio`, in thousandths.
    ratio: u64,
    /// `max_tokens / 2`, in thousandths: retries need more than this.
    threshold: u64,
    allowed: AtomicU64,
    refused: AtomicU64,
    abandoned: AtomicU64,
    allowed_total: Counter,
    refused_total: Counter,
    abandoned_total: Counter,
    tokens_gauge: Gauge,
    name: Option<String>,
}

/// What a [`RetryBudget`] answered so far (shared by every clone).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub struct RetryBudgetStats {
    /// Retries allowed by [`try_retry`](RetryBudget::try_retry).
    pub allowed: u64,
    /// Retries refused by [`try_retry`](RetryBudget::try_retry).
    pub refused: u64,
    /// Retries allowed but never made, reported by
    /// [`abandon_retry`](RetryBudget::abandon_retry): the retries made are
    /// `allowed − abandoned`.
    pub abandoned: u64,
}

impl RetryBudget {
    /// The largest `max_tokens`: 1 000 (gRPC's bound).
    pub const MAX_TOKENS: u32 = 1_000;

    /// The smallest `max_tokens` that can allow a retry: from full, a failure leaves 2 of 3
    /// tokens, above half of them (gRPC accepts 1 and 2, and never retries with them).
    const MIN_TOKENS: u32 = 3;

    /// A budget of `max_tokens` tokens, refilled by `token_ratio` per success.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] on `retry_budget.max_tokens` when it is 0, 1 or 2 (no failure would
    /// leave more than `max_tokens / 2` tokens, so no retry would ever be allowed) or above
    /// [`MAX_TOKENS`](RetryBudget::MAX_TOKENS), on `retry_budget.token_ratio` when it is
    /// not a finite number, rounds to less than 0.001 (it is kept in thousandths, rounded
    /// to the nearest), or is above `max_tokens`.
    pub fn new(max_tokens: u32, token_ratio: f64) -> Result<RetryBudget, ConfigError> {
        RetryBudget::builder()
            .max_tokens(max_tokens)
            .token_ratio(token_ratio)
            .build()
    }

    /// A builder: 10 tokens and a ratio of 0.1 unless told otherwise.
    pub fn builder() -> RetryBudgetBuilder {
        RetryBudgetBuilder {
            max_tokens: 10,
            token_ratio: 0.1,
            name: None,
        }
    }

    /// Record a failed attempt and answer whether it may be retried: takes one token, then
    /// allows the retry only if more than `max_tokens / 2` are left.
    ///
    /// Counted in [`stats`](RetryBudget::stats) and the metrics. Never waits.
    ///
    /// # Panics
    ///
    /// When a metrics recorder (user code) panics as the tokens or the answer are
    /// recorded: the panic goes on once the failure took its token and the retry is counted
    /// refused (its answer never reaches the caller, who does not retry).
    #[must_use = "the answer says whether to retry"]
    pub fn try_retry(&self) -> bool {
        let inner = &*self.inner;
        let (left, moved) = inner.take_unshown(MILLI);
        // The recorders (user code) each run whatever the one before did, and one that
        // panics keeps the answer from the caller: that retry was not allowed, and counts
        // as refused (an allowed count would be neither made nor abandoned), so that
        // `allowed + refused` stays the retries asked. The panic goes on once counted.
        let mut panics = Panics::new();
        let mut answered = true;
        if moved {
            answered = false;
            panics.run(|| {
                inner.show(left);
                answered = true;
            });
        }
        let mut allowed = answered && left > inner.threshold;
        if allowed {
            allowed = false;
            panics.run(|| {
                inner.allowed_total.increment(1);
                allowed = true;
            });
        }
        if allowed {
            inner.allowed.fetch_add(1, Ordering::Relaxed);
        } else {
            inner.refused.fetch_add(1, Ordering::Relaxed);
            panics.run(|| inner.refused_total.increment(1));
        }
        panics.resume();
        allowed
    }

    /// Record a failed attempt that will not be retried anyway: takes one token.
    pub fn on_failure(&self) {
        self.inner.take(MILLI);
    }

    /// Record that a retry [`try_retry`](RetryBudget::try_retry) allowed will not be made
    /// after all (the operation was dropped, or ended otherwise, before sending it): counted
    /// as [`abandoned`](RetryBudgetStats::abandoned). The token stays taken: it paid for
    /// the failed attempt, which did happen (see the type's docs). Call it at most once per
    /// allowed retry. Never waits.
    ///
    /// # Examples
    ///
    /// ```
    /// use flowgate::retry::RetryBudget;
    ///
    /// let budget = RetryBudget::new(10, 0.1)?;
    /// assert!(budget.try_retry());
    /// // The caller gave up on the operation during the backoff: no retry was made.
    /// budget.abandon_retry();
    /// let stats = budget.stats();
    /// assert_eq!((stats.allowed, stats.abandoned), (1, 1));
    /// assert_eq!(budget.tokens(), 9.0); // the failure still counts
    /// # Ok::<(), flowgate::ConfigError>(())
    /// ```
    pub fn abandon_retry(&self) {
        self.inner.abandoned.fetch_add(1, Ordering::Relaxed);
        self.inner.abandoned_total.increment(1);
    }

    /// Record a success: gives back `token_ratio`, up to `max_tokens`.
    pub fn on_success(&self) {
        let inner = &*self.inner;
        let mut cur = inner.tokens.load(Ordering::Relaxed);
        loop {
            let new = cur.saturating_add(inner.ratio).min(inner.max);
            if new == cur {
                return;
            }
            match inner
                .tokens
                .compare_exchange_weak(cur, new, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => {
                    inner.show(new);
                    return;
                }
                Err(actual) => cur = actual,
            }
        }
    }

    /// Whether a retry would be allowed now, without recording anything: more than
    /// `max_tokens / 2` tokens left after taking one.
    pub fn would_allow(&self) -> bool {
        self.inner
            .tokens
            .load(Ordering::Acquire)
            .saturating_sub(MILLI)
            > self.inner.threshold
    }

    /// The tokens left (to the thousandth).
    pub fn tokens(&self) -> f64 {
        self.inner.tokens.load(Ordering::Acquire) as f64 / MILLI as f64
    }

    /// The most tokens the budget holds.
    pub fn max_tokens(&self) -> u32 {
        u32::try_from(self.inner.max / MILLI).unwrap_or(u32::MAX)
    }

    /// The tokens a success gives back (to the thousandth).
    pub fn token_ratio(&self) -> f64 {
        self.inner.ratio as f64 / MILLI as f64
    }

    /// The retries allowed, refused and abandoned so far.
    pub fn stats(&self) -> RetryBudgetStats {
        RetryBudgetStats {
            allowed: self.inner.allowed.load(Ordering::Relaxed),
            refused: self.inner.refused.load(Ordering::Relaxed),
            abandoned: self.inner.abandoned.load(Ordering::Relaxed),
        }
    }

    /// The `name` label of the budget's metrics, if it was given one.
    pub fn name(&self) -> Option<&str> {
        self.inner.name.as_deref()
    }
}

impl Inner {
    /// Show `tokens` (thousandths) on the gauge, then look again: a thread whose change was
    /// overtaken shows the newer count too, so when threads race the gauge ends at the
    /// tokens left, whatever the order of their sets.
    fn show(&self, mut tokens: u64) {
        loop {
            self.tokens_gauge.set(tokens as f64 / MILLI as f64);
            let now = self.tokens.load(Ordering::Acquire);
            if now == tokens {
                return;
            }
            tokens = now;
        }
    }

    /// Take `n` thousandths (down to zero at most), and show the tokens left.
    fn take(&self, n: u64) {
        let (left, moved) = self.take_unshown(n);
        if moved {
            self.show(left);
        }
    }

    /// Take `n` thousandths (down to zero at most), showing nothing (the gauge runs a
    /// recorder: user code); the tokens left afterwards, and whether they moved (then to be
    /// [shown](Inner::show)).
    fn take_unshown(&self, n: u64) -> (u64, bool) {
        let mut cur = self.tokens.load(Ordering::Relaxed);
        loop {
            let new = cur.saturating_sub(n);
            if new == cur {
                return (new, false);
            }
            match self
                .tokens
                .compare_exchange_weak(cur, new, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => return (new, true),
                Err(actual) => cur = actual,
            }
        }
    }
}

impl fmt::Debug for RetryBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryBudget")
            .field("name", &self.inner.name)
            .field("tokens", &self.tokens())
            .field("max_tokens", &self.max_tokens())
            .field("token_ratio", &self.token_ratio())
            .field("stats", &self.stats())
            .finish()
    }
}

/// Builds a [`RetryBudget`]; from [`RetryBudget::builder`].
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until it is built"]
pub struct RetryBudgetBuilder {
    max_tokens: u32,
    token_ratio: f64,
    name: Option<String>,
}

impl RetryBudgetBuilder {
    /// The tokens the budget holds at most, and to begin with (default 10; 3 to 1 000: with
    /// 1 or 2, no failure would leave more than half of them, and no retry would ever be
    /// allowed).
    pub fn max_tokens(mut self, max_tokens: u32) -> Self {
        self.max_tokens = max_tokens;
        self
    }

    /// The tokens a success gives back (default 0.1; kept to the thousandth).
    pub fn token_ratio(mut self, token_ratio: f64) -> Self {
        self.token_ratio = token_ratio;
        self
    }

    /// The `name` label of the budget's metrics.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Build the budget.
    ///
    /// # Errors
    ///
    /// As [`RetryBudget::new`].
    pub fn build(self) -> Result<RetryBudget, ConfigError> {
        if self.max_tokens == 0 {
            return Err(ConfigError::zero("retry_budget.max_tokens"));
        }
        if self.max_tokens < RetryBudget::MIN_TOKENS {
            return Err(ConfigError::new(
                "retry_budget.max_tokens",
                ConfigErrorKind::Inconsistent,
                format!(
                    "{} is below {}: no failure would leave more than max_tokens / 2 tokens, \
                     so every retry would be refused",
                    self.max_tokens,
                    RetryBudget::MIN_TOKENS
                ),
            ));
        }
        if self.max_tokens > RetryBudget::MAX_TOKENS {
            return Err(ConfigError::new(
                "retry_budget.max_tokens",
                ConfigErrorKind::TooLarge,
                "must be at most 1000",
            ));
        }
        let max = u64::from(self.max_tokens) * MILLI;
        if !self.token_ratio.is_finite() {
            return Err(ConfigError::new(
                "retry_budget.token_ratio",
                ConfigErrorKind::Inconsistent,
                "must be a finite number",
            ));
        }
        let milli = (self.token_ratio * MILLI as f64).round();
        if milli < 1.0 {
            return Err(ConfigError::new(
                "retry_budget.token_ratio",
                ConfigErrorKind::Zero,
                "must be at least 0.001",
            ));
        }
        if milli > max as f64 {
            return Err(ConfigError::new(
                "retry_budget.token_ratio",
                ConfigErrorKind::TooLarge,
                "must be at most max_tokens",
            ));
        }
        // In 1..=1_000_000: the cast is exact.
        let ratio = milli as u64;
        let labels = Labels::new(self.name.as_deref());
        let tokens_gauge = labels.gauge(names::TOKENS, &[]);
        tokens_gauge.set(f64::from(self.max_tokens));
        Ok(RetryBudget {
            inner: Arc::new(Inner {
                tokens: AtomicU64::new(max),
                max,
                ratio,
                threshold: max / 2,
                allowed: AtomicU64::new(0),
                refused: AtomicU64::new(0),
                abandoned: AtomicU64::new(0),
                allowed_total: labels.counter(names::RETRIES, &[("outcome", "allowed")]),
                refused_total: labels.counter(names::RETRIES, &[("outcome", "refused")]),
                abandoned_total: labels.counter(names::ABANDONED, &[]),
                tokens_gauge,
                name: self.name,
            }),
        })
    }
}
