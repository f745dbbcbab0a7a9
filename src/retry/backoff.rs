//! `Backoff`: exponential backoff with the AWS jitters, a deadline over the whole operation,
//! and the server's `Retry-After` winning over the computed delay.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use crate::error::{ConfigError, ConfigErrorKind};

/// How a computed delay is randomised, after Marc Brooker's "Exponential Backoff And
/// Jitter" (the AWS Architecture Blog).
///
/// With `exp = min(cap, base × 2^k)` for the `k`-th retry (`k = 0` for the first):
///
/// | jitter | delay | range |
/// |---|---|---|
/// | [`None`](Jitter::None) | `exp` | exactly `exp` |
/// | [`Full`](Jitter::Full) (default) | `uniform(0, exp)` | `[0, exp]` |
/// | [`Equal`](Jitter::Equal) | `exp/2 + uniform(0, exp/2)` | `[exp/2, exp]` |
/// | [`Decorrelated`](Jitter::Decorrelated) | `min(cap, uniform(base, 3 × previous))` | `[base, cap]`; the first previous is `base` |
///
/// Every draw is made in whole nanoseconds, inclusive at both ends (`exp/2` rounded up
/// where it is a lower end), with saturating arithmetic: an attempt number as large as you
/// like never overflows, the delay just stays at `cap`.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use flowgate::retry::{Backoff, Jitter};
///
/// let backoff = Backoff::builder()
///     .base(Duration::from_millis(100))
///     .jitter(Jitter::None)
///     .build()?;
/// let mut schedule = backoff.start();
/// assert_eq!(schedule.next_delay(None)?, Duration::from_millis(100));
/// assert_eq!(schedule.next_delay(None)?, Duration::from_millis(200));
/// assert_eq!(schedule.next_delay(None)?, Duration::from_millis(400));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Jitter {
    /// No randomness: `exp` itself. Clients that fail together retry together.
    None,
    /// `uniform(0, exp)`: the least work for a contended server (the default).
    #[default]
    Full,
    /// `exp/2 + uniform(0, exp/2)`: never much shorter than `exp`.
    Equal,
    /// `min(cap, uniform(base, 3 × previous delay))`: grows from the last delay rather than
    /// from the attempt number.
    Decorrelated,
}

/// Why a [`Schedule`] gives up: the next attempt would break one of the
/// [`Backoff`]'s bounds.
///
/// # Examples
///
/// ```
/// use flowgate::retry::{Backoff, GiveUp};
///
/// let backoff = Backoff::builder().max_attempts(1).build()?;
/// let mut schedule = backoff.start();
/// let err = schedule.next_delay(None).unwrap_err();
/// assert_eq!(err, GiveUp::Attempts { attempts: 1 });
/// assert_eq!(err.to_string(), "gave up after 1 attempt");
/// # Ok::<(), flowgate::ConfigError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GiveUp {
    /// Every attempt allowed by [`max_attempts`](BackoffBuilder::max_attempts) was made.
    Attempts {
        /// The attempts made, the first included.
        attempts: u32,
    },
    /// The next attempt would not start before the deadline: waiting `delay` from now
    /// (`elapsed` into the operation) reaches or passes `deadline`. Nothing was waited.
    Deadline {
        /// The time since [`Backoff::start`].
        elapsed: Duration,
        /// The deadline ([`BackoffBuilder::deadline`]).
        deadline: Duration,
        /// The delay that would have been waited: the server's hint or the computed one,
        /// or, under a [`RetryPolicy`](crate::retry::RetryPolicy) with a pacer, the
        /// pacer's wait when it is longer.
        delay: Duration,
    },
    /// The server asked to wait longer than [`max_retry_after`](BackoffBuilder::max_retry_after).
    HintTooLong {
        /// The server's hint.
        hint: Duration,
        /// The longest hint honoured.
        max: Duration,
    },
}

impl fmt::Display for GiveUp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GiveUp::Attempts { attempts: 1 } => f.write_str("gave up after 1 attempt"),
            GiveUp::Attempts { attempts } => write!(f, "gave up after {attempts} attempts"),
            GiveUp::Deadline {
                elapsed,
                deadline,
                delay,
            } => write!(
                f,
                "gave up: waiting {delay:?} after {elapsed:?} would reach the deadline of {deadline:?}"
            ),
            GiveUp::HintTooLong { hint, max } => write!(
                f,
                "gave up: the server asked to wait {hint:?}, longer than the {max:?} allowed by BackoffBuilder::max_retry_after"
            ),
        }
    }
}

impl std::error::Error for GiveUp {}

/// An exponential backoff policy: base, cap, jitter, max attempts, an overall deadline, and
/// how long a server's `Retry-After` may be.
///
/// A `Backoff` is the policy; each operation takes its own [`Schedule`] with
/// [`start`](Backoff::start) and asks it, after each failed attempt, how long to wait
/// ([`Schedule::next_delay`]). Cheap to clone; clones share the seed counter (see
/// [`seed`](BackoffBuilder::seed)).
///
/// # The server's hint wins
///
/// A hint given to [`next_delay`](Schedule::next_delay) (a `Retry-After`, parsed for
/// example by `ServerHint` with the `http` feature) **replaces** the computed delay, even
/// when it is shorter: the server knows when it will take the request. It is still bounded:
/// a hint above [`max_retry_after`](BackoffBuilder::max_retry_after) gives up
/// ([`GiveUp::HintTooLong`]), and so does a hint that reaches the deadline
/// ([`GiveUp::Deadline`]), at once, without waiting for it. Clients refused together are
/// told the same hint: [`retry_after_jitter`](BackoffBuilder::retry_after_jitter) adds a
/// random extra to it so that they do not all come back at the same instant.
///
/// # Deadline
///
/// The [`deadline`](BackoffBuilder::deadline) spans the whole operation: every attempt and
/// every wait, from [`start`](Backoff::start). A schedule never hands out a delay after
/// which the next attempt would start at or after the deadline; it gives up instead
/// ([`retry`](crate::retry::retry) and `RetryLayer` count their pacer's wait as it stood
/// then). An attempt in progress is not interrupted by the schedule, nor a shared pacer's
/// wait that grew after it began: bound them with [`Schedule::remaining`] (e.g.
/// `tokio::time::timeout`) to keep the whole operation within the deadline. Time is
/// `tokio::time`, so tests run with paused time.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use flowgate::retry::{Backoff, GiveUp, Jitter};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let backoff = Backoff::builder()
///     .base(Duration::from_millis(50))
///     .cap(Duration::from_secs(2))
///     .jitter(Jitter::Full)
///     .max_attempts(4)
///     .deadline(Duration::from_secs(10))
///     .seed(7)
///     .build()?;
/// let mut schedule = backoff.start();
/// let mut attempts = 0;
/// let outcome: Result<(), GiveUp> = loop {
///     attempts += 1;
///     let failed = true; // call the downstream here
///     if !failed {
///         break Ok(());
///     }
///     match schedule.next_delay(None) {
///         Ok(delay) => tokio::time::sleep(delay).await,
///         Err(give_up) => break Err(give_up),
///     }
/// };
/// assert_eq!(attempts, 4);
/// assert_eq!(outcome, Err(GiveUp::Attempts { attempts: 4 }));
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Backoff {
    base: u64,
    cap: u64,
    jitter: Jitter,
    max_attempts: u32,
    deadline: Option<Duration>,
    max_retry_after: Duration,
    /// The most added to a server's hint, in nanoseconds (see
    /// [`BackoffBuilder::retry_after_jitter`]).
    retry_after_jitter: u64,
    seed: Option<u64>,
    /// How many schedules this backoff (and its clones) started: mixed into the seed.
    started: Arc<AtomicU64>,
}

impl Backoff {
    /// The default base: 100 ms.
    pub const DEFAULT_BASE: Duration = Duration::from_millis(100);
    /// The default cap: 10 s.
    pub const DEFAULT_CAP: Duration = Duration::from_secs(10);
    /// The default number of attempts, the first included: 5.
    pub const DEFAULT_MAX_ATTEMPTS: u32 = 5;
    /// The default longest server hint honoured: 60 s.
    pub const DEFAULT_MAX_RETRY_AFTER: Duration = Duration::from_secs(60);

    /// A builder with the defaults: base 100 ms, cap 10 s, [`Jitter::Full`], 5 attempts,
    /// no deadline, hints up to 60 s waited exactly (no extra), seeded from entropy.
    pub fn builder() -> BackoffBuilder {
        BackoffBuilder {
            base: Backoff::DEFAULT_BASE,
            cap: Backoff::DEFAULT_CAP,
            jitter: Jitter::default(),
            max_attempts: Backoff::DEFAULT_MAX_ATTEMPTS,
            deadline: None,
            max_retry_after: Backoff::DEFAULT_MAX_RETRY_AFTER,
            retry_after_jitter: Duration::ZERO,
            seed: None,
        }
    }

    /// Start one operation: a [`Schedule`] whose clock starts now, with one attempt under
    /// way.
    ///
    /// With a [`seed`](BackoffBuilder::seed), the schedule's random draws are seeded from
    /// the seed and the number of schedules this backoff and its clones started before, so
    /// a program that starts its operations in the same order draws the same delays.
    pub fn start(&self) -> Schedule {
        let rng = match self.seed {
            Some(seed) => {
                let n = self.started.fetch_add(1, Ordering::Relaxed);
                fastrand::Rng::with_seed(mix(seed, n))
            }
            None => fastrand::Rng::new(),
        };
        Schedule {
            backoff: self.clone(),
            start: Instant::now(),
            attempts: 1,
            prev: self.base,
            rng,
        }
    }

    /// The base delay: the first retry's `exp`.
    pub fn base(&self) -> Duration {
        Duration::from_nanos(self.base)
    }

    /// The longest computed delay.
    pub fn cap(&self) -> Duration {
        Duration::from_nanos(self.cap)
    }

    /// The jitter.
    pub fn jitter(&self) -> Jitter {
        self.jitter
    }

    /// The most attempts of one operation, the first included.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// The deadline of one operation, if any.
    pub fn deadline(&self) -> Option<Duration> {
        self.deadline
    }

    /// The longest server hint honoured.
    pub fn max_retry_after(&self) -> Duration {
        self.max_retry_after
    }

    /// The most added to a server's hint at random
    /// ([`BackoffBuilder::retry_after_jitter`]).
    pub fn retry_after_jitter(&self) -> Duration {
        Duration::from_nanos(self.retry_after_jitter)
    }

    /// The `exp` of the `k`-th retry: `min(cap, base × 2^k)`, saturating.
    fn exp(&self, k: u32) -> u64 {
        if k >= 64 || self.base.leading_zeros() < k {
            self.cap
        } else {
            (self.base << k).min(self.cap)
        }
    }
}

impl Default for Backoff {
    /// The defaults of [`Backoff::builder`].
    fn default() -> Backoff {
        Backoff::builder().build_unchecked()
    }
}

/// Builds a [`Backoff`]; from [`Backoff::builder`].
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until it is built"]
pub struct BackoffBuilder {
    base: Duration,
    cap: Duration,
    jitter: Jitter,
    max_attempts: u32,
    deadline: Option<Duration>,
    max_retry_after: Duration,
    retry_after_jitter: Duration,
    seed: Option<u64>,
}

impl BackoffBuilder {
    /// The first retry's `exp` (default 100 ms); each retry doubles it, up to the cap.
    pub fn base(mut self, base: Duration) -> Self {
        self.base = base;
        self
    }

    /// The longest computed delay (default 10 s). A server's hint is bounded by
    /// [`max_retry_after`](BackoffBuilder::max_retry_after) instead.
    pub fn cap(mut self, cap: Duration) -> Self {
        self.cap = cap;
        self
    }

    /// How the delay is randomised (default [`Jitter::Full`]).
    pub fn jitter(mut self, jitter: Jitter) -> Self {
        self.jitter = jitter;
        self
    }

    /// The most attempts of one operation, the first included (default 5; 1 never
    /// retries).
    pub fn max_attempts(mut self, max_attempts: u32) -> Self {
        self.max_attempts = max_attempts;
        self
    }

    /// A deadline for each operation, from [`Backoff::start`], spanning every attempt and
    /// every wait (default none).
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = Some(deadline);
        self
    }

    /// The longest server hint honoured (default 60 s): a longer one gives up with
    /// [`GiveUp::HintTooLong`] rather than wait that long.
    pub fn max_retry_after(mut self, max: Duration) -> Self {
        self.max_retry_after = max;
        self
    }

    /// Wait a server's hint plus a random extra of up to `max_extra`, drawn uniformly
    /// (default zero: the hint exactly).
    ///
    /// A server tells every client it refused in one moment the same `Retry-After`; waited
    /// exactly, they all come back at the same instant, the burst the refusal was there to
    /// avoid. An extra spreads them over `max_extra` (a second or two for hints of
    /// seconds). It only ever adds: no retry comes before the server's hint. The deadline
    /// counts the hint with its extra; [`max_retry_after`](BackoffBuilder::max_retry_after)
    /// bounds the hint alone.
    pub fn retry_after_jitter(mut self, max_extra: Duration) -> Self {
        self.retry_after_jitter = max_extra;
        self
    }

    /// Seed the random draws, for reproducible delays (tests, simulations). Without a
    /// seed each schedule is seeded from entropy.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// Build the backoff.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] on `backoff.base` when it is zero or above `u64::MAX` nanoseconds
    /// (about 584 years), on `backoff.cap` when it is below the base or above `u64::MAX`
    /// nanoseconds, on `backoff.max_attempts` when it is zero, on `backoff.deadline`
    /// when it is zero, and on `backoff.retry_after_jitter` when it is above `u64::MAX`
    /// nanoseconds.
    pub fn build(self) -> Result<Backoff, ConfigError> {
        let base = nanos(self.base, "backoff.base")?;
        if base == 0 {
            return Err(ConfigError::new(
                "backoff.base",
                ConfigErrorKind::Zero,
                "must be at least 1ns",
            ));
        }
        let cap = nanos(self.cap, "backoff.cap")?;
        if cap < base {
            return Err(ConfigError::new(
                "backoff.cap",
                ConfigErrorKind::Inconsistent,
                "must be at least the base",
            ));
        }
        if self.max_attempts == 0 {
            return Err(ConfigError::zero("backoff.max_attempts"));
        }
        nanos(self.retry_after_jitter, "backoff.retry_after_jitter")?;
        if self.deadline == Some(Duration::ZERO) {
            return Err(ConfigError::new(
                "backoff.deadline",
                ConfigErrorKind::Zero,
                "must be longer than zero",
            ));
        }
        Ok(self.build_unchecked())
    }

    fn build_unchecked(self) -> Backoff {
        Backoff {
            base: u64::try_from(self.base.as_nanos()).unwrap_or(u64::MAX),
            cap: u64::try_from(self.cap.as_nanos()).unwrap_or(u64::MAX),
            jitter: self.jitter,
            max_attempts: self.max_attempts,
            deadline: self.deadline,
            max_retry_after: self.max_retry_after,
            retry_after_jitter: u64::try_from(self.retry_after_jitter.as_nanos())
                .unwrap_or(u64::MAX),
            seed: self.seed,
            started: Arc::new(AtomicU64::new(0)),
        }
    }
}

/// A duration in nanoseconds, refused above `u64::MAX`.
fn nanos(d: Duration, field: &'static str) -> Result<u64, ConfigError> {
    u64::try_from(d.as_nanos()).map_err(|_| {
        ConfigError::new(
            field,
            ConfigErrorKind::TooLarge,
            "must be at most u64::MAX nanoseconds",
        )
    })
}

/// The seed of the `n`-th schedule: SplitMix64's finaliser over the seed and `n`, so
/// neighbouring schedules draw unrelated sequences.
fn mix(seed: u64, n: u64) -> u64 {
    let mut z = seed ^ n.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The backoff state of one operation: attempts so far, when it started, the previous
/// delay and its own random generator; from [`Backoff::start`].
///
/// Ask [`next_delay`](Schedule::next_delay) after each failed attempt. A schedule is
/// plain data: dropping it loses nothing, and it never waits itself.
#[derive(Debug, Clone)]
pub struct Schedule {
    backoff: Backoff,
    start: Instant,
    attempts: u32,
    /// The previous computed delay, in nanoseconds (for [`Jitter::Decorrelated`]).
    prev: u64,
    rng: fastrand::Rng,
}

impl Schedule {
    /// How long to wait before the next attempt, called after a failed one; `hint` is the
    /// server's `Retry-After`, if it sent one.
    ///
    /// The delay is the hint when there is one (it replaces the computed delay, even a
    /// longer one: see [`Backoff`]; plus a random extra with
    /// [`retry_after_jitter`](BackoffBuilder::retry_after_jitter)), else the backoff's
    /// jittered delay for this retry. On
    /// `Ok` the next attempt is counted as under way ([`attempts`](Schedule::attempts)
    /// grows by one).
    ///
    /// # Errors
    ///
    /// In this order: [`GiveUp::Attempts`] when [`max_attempts`](BackoffBuilder::max_attempts)
    /// were made; [`GiveUp::HintTooLong`] when the hint is above
    /// [`max_retry_after`](BackoffBuilder::max_retry_after); [`GiveUp::Deadline`] when
    /// the next attempt would start at or after the deadline. A schedule that gave up
    /// stays as it was: asking again answers the same way while nothing changes.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use flowgate::retry::{Backoff, GiveUp};
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let backoff = Backoff::builder().deadline(Duration::from_secs(30)).build()?;
    /// let mut schedule = backoff.start();
    /// // The server's Retry-After wins over the computed delay...
    /// assert_eq!(schedule.next_delay(Some(Duration::from_secs(2)))?, Duration::from_secs(2));
    /// tokio::time::sleep(Duration::from_secs(2)).await;
    /// // ...unless it reaches the deadline: give up at once, without waiting for it.
    /// let err = schedule.next_delay(Some(Duration::from_secs(40))).unwrap_err();
    /// assert!(matches!(err, GiveUp::Deadline { .. }));
    /// # Ok(())
    /// # }
    /// ```
    pub fn next_delay(&mut self, hint: Option<Duration>) -> Result<Duration, GiveUp> {
        self.next_delay_paced(hint, Duration::ZERO)
    }

    /// [`next_delay`](Schedule::next_delay) for an attempt that also waits `paced` for a
    /// pacer (from now, overlapping the delay): the deadline is checked against the longer
    /// of the two waits, and a [`GiveUp::Deadline`] gives that one.
    pub(crate) fn next_delay_paced(
        &mut self,
        hint: Option<Duration>,
        paced: Duration,
    ) -> Result<Duration, GiveUp> {
        let backoff = &self.backoff;
        if self.attempts >= backoff.max_attempts {
            return Err(GiveUp::Attempts {
                attempts: self.attempts,
            });
        }
        if let Some(hint) = hint
            && hint > backoff.max_retry_after
        {
            return Err(GiveUp::HintTooLong {
                hint,
                max: backoff.max_retry_after,
            });
        }
        // Draw even when a hint replaces the delay, so the sequence of draws (and the
        // decorrelated jitter's progression) does not depend on the hints.
        let mut rng = self.rng.clone();
        let computed = draw(backoff, &mut rng, self.attempts - 1, self.prev);
        // The hint's extra, drawn with or without a hint for the same reason.
        let extra = match backoff.retry_after_jitter {
            0 => 0,
            most => rng.u64(0..=most),
        };
        let delay = match hint {
            Some(hint) => hint.saturating_add(Duration::from_nanos(extra)),
            None => Duration::from_nanos(computed),
        };
        if let Some(give_up) = self.past_deadline(delay.max(paced)) {
            return Err(give_up);
        }
        self.rng = rng;
        self.prev = computed;
        self.attempts += 1;
        Ok(delay)
    }

    /// Whether an attempt after waiting `wait` from now would start at or after the
    /// deadline: the [`GiveUp::Deadline`] to give if so.
    pub(crate) fn past_deadline(&self, wait: Duration) -> Option<GiveUp> {
        let deadline = self.backoff.deadline?;
        let elapsed = self.start.elapsed();
        (elapsed.saturating_add(wait) >= deadline).then_some(GiveUp::Deadline {
            elapsed,
            deadline,
            delay: wait,
        })
    }

    /// The attempts made or under way, the first included: 1 after
    /// [`Backoff::start`], one more for each delay handed out.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// The time since [`Backoff::start`].
    pub fn elapsed(&self) -> Duration {
        self.start.elapsed()
    }

    /// The time left before the deadline (zero once it has passed), or `None` without a
    /// deadline: what the attempt under way may still take.
    pub fn remaining(&self) -> Option<Duration> {
        self.backoff
            .deadline
            .map(|deadline| deadline.saturating_sub(self.start.elapsed()))
    }

    /// The policy this schedule follows.
    pub fn backoff(&self) -> &Backoff {
        &self.backoff
    }
}

/// The jittered delay of the `k`-th retry, in nanoseconds.
fn draw(backoff: &Backoff, rng: &mut fastrand::Rng, k: u32, prev: u64) -> u64 {
    match backoff.jitter {
        Jitter::None => backoff.exp(k),
        Jitter::Full => rng.u64(0..=backoff.exp(k)),
        Jitter::Equal => {
            // `exp − ⌊exp/2⌋` is `exp/2` rounded up: the draw then spans `[exp/2, exp]`
            // whole, `exp` included when it is odd (from `⌊exp/2⌋` it never reached `exp`,
            // and an `exp` of 1 ns always drew 0).
            let exp = backoff.exp(k);
            let half = exp / 2;
            (exp - half) + rng.u64(0..=half)
        }
        Jitter::Decorrelated => {
            let upper = prev.saturating_mul(3).max(backoff.base);
            rng.u64(backoff.base..=upper).min(backoff.cap)
        }
    }
}
