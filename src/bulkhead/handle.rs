//! `Bulkhead` and its builder.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use crate::adaptive::{AdaptiveLimit, Outcome};
use crate::bulkhead::acquire::{Acquire, AcquireOwned, BulkheadPermit, OwnedBulkheadPermit};
use crate::bulkhead::adaptive::{Adaptive, AdaptiveStats};
use crate::bulkhead::core::{Core, MAX_PERMITS};
use crate::bulkhead::error::{AcquireError, Priority};
use crate::bulkhead::stats::BulkheadStats;
use crate::error::{ConfigError, ConfigErrorKind};
use crate::sync::Arc;

/// A concurrency cap for one dependency: at most `max_in_flight` units of work in flight, a
/// bounded waiting room, load shedding, and a reserve of permits for critical work.
///
/// Cloning is cheap and shares the cap (clones are handles to one bulkhead), so one
/// bulkhead can guard a dependency across tasks and streams.
///
/// # Semantics
///
/// - **Permits** are RAII: a [`BulkheadPermit`] is returned when dropped, which wakes the
///   next waiter. Waiters are served critical first, then FIFO.
/// - **Waiting room**: at most `max_waiting` acquisitions wait; beyond that `acquire` is
///   shed at once with [`AcquireError::WaitingRoomFull`] — load shedding, cheap and early.
///   A critical acquisition at a full room sheds the newest normal waiter instead (with no
///   normal waiter in the room, it is refused too).
/// - **Wait timeout**: a wait longer than `wait_timeout` is shed with
///   [`AcquireError::TimedOut`]. A permit granted, a shed or a close that takes the waiter
///   out of the queue before its timeout does wins, and the wait ends (and is counted) one
///   way only.
/// - **Critical reserve**: normal work cannot take the last `critical_reserve` permits;
///   [`Priority::Critical`] work can.
/// - **Resizing**: [`set_max_in_flight`](Bulkhead::set_max_in_flight) takes effect at once
///   when growing (waiters are woken) and as permits come back when shrinking; work in
///   flight is never revoked.
/// - **Closing**: [`close`](Bulkhead::close) fails every waiter still in the queue and every
///   later acquisition with [`AcquireError::Closed`]; permits in flight stay valid, among
///   them one granted to a waiter before the close, which that waiter still takes (its
///   future may not have been polled since).
/// - **Adaptive**: built with [`adaptive`](BulkheadBuilder::adaptive), the bulkhead lets an
///   [`AdaptiveLimit`] algorithm set `max_in_flight` from each call's round-trip time and
///   outcome (see [`BulkheadPermit`]'s docs and the [`adaptive`](crate::adaptive) module).
///
/// Acquiring and releasing without contention is a single atomic compare-and-swap.
///
/// # Metrics
///
/// Labelled by `name`: `flowgate_bulkhead_in_flight` and `flowgate_bulkhead_waiting`
/// (gauges), `flowgate_bulkhead_rejected_total` by `reason`, and
/// `flowgate_bulkhead_wait_seconds` (histogram of how long the acquisitions that waited in
/// the queue waited for their permit, the stream adapters' included: one sample for each
/// wait [`BulkheadStats::waited`] counts; waits that ended shed, closed or given up are
/// not in it), `flowgate_bulkhead_discarded_total` (items the stream adapters
/// let go of unprocessed: the one each holds waiting for a permit when its bulkhead closes
/// or it is dropped).
/// An adaptive bulkhead adds `flowgate_bulkhead_max_in_flight` (gauge: the `max_in_flight`
/// the algorithm set, its limit plus the critical reserve),
/// `flowgate_bulkhead_rtt_seconds{kind = "min" | "smoothed"}` (gauges: the
/// algorithm's estimates) and `flowgate_bulkhead_samples_total{outcome}` (`ok`,
/// `back_pressure`, `ignored`).
///
/// The same counts, without a metrics recorder: [`stats`](Bulkhead::stats).
///
/// # Examples
///
/// ```
/// use flowgate::bulkhead::{Bulkhead, Priority, AcquireError};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let payments = Bulkhead::builder(2)
///     .max_waiting(0) // no waiting room: shed at once
///     .critical_reserve(1)
///     .name("payments")
///     .build()?;
/// let a = payments.acquire().await?; // normal work may use 2 - 1 = 1 permit
/// assert_eq!(payments.try_acquire().unwrap_err(), AcquireError::NoPermit);
/// assert_eq!(payments.acquire().await.unwrap_err(), AcquireError::WaitingRoomFull);
/// let b = payments.acquire_with(Priority::Critical).await?; // the reserve
/// assert_eq!(payments.in_flight(), 2);
/// drop((a, b));
/// let answer = payments.run(async { 42 }).await?;
/// assert_eq!(answer, 42);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Bulkhead {
    core: Arc<Core>,
}

impl Bulkhead {
    /// A bulkhead of `max_in_flight` permits, with an unbounded waiting room, no timeout and
    /// no critical reserve.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] on `bulkhead.max_in_flight` if it is zero or above 2³¹ − 1.
    pub fn new(max_in_flight: usize) -> Result<Bulkhead, ConfigError> {
        Bulkhead::builder(max_in_flight).build()
    }

    /// A builder for a bulkhead of `max_in_flight` permits.
    pub fn builder(max_in_flight: usize) -> BulkheadBuilder {
        BulkheadBuilder {
            max_in_flight,
            max_waiting: usize::MAX,
            wait_timeout: None,
            critical_reserve: 0,
            name: None,
            adaptive: None,
        }
    }

    pub(crate) fn core(&self) -> &Arc<Core> {
        &self.core
    }

    /// Wait for a permit for normal work.
    ///
    /// # Errors
    ///
    /// [`AcquireError::WaitingRoomFull`] at once when the room is full (or later, if shed for
    /// critical work), [`AcquireError::TimedOut`] after `wait_timeout`, [`AcquireError::Closed`].
    ///
    /// # Panics
    ///
    /// With a [`wait_timeout`](BulkheadBuilder::wait_timeout), the future starts a tokio
    /// timer when it has to wait: it panics if it is polled outside a tokio runtime with
    /// timers enabled and finds no free permit. Without a timeout, or with one that ends past
    /// any instant the clock can tell (`Duration::MAX`), it starts none and needs no runtime.
    /// A future that panicked so still waits in the queue: polled again, it panics again
    /// outside a runtime, and in one it times out at the deadline its first wait set;
    /// dropped, it leaves the queue.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: see [`Acquire`].
    pub fn acquire(&self) -> Acquire<'_> {
        Acquire::new(&self.core, Priority::Normal)
    }

    /// Wait for a permit at `priority`.
    ///
    /// # Errors
    ///
    /// As [`acquire`](Bulkhead::acquire).
    ///
    /// # Panics
    ///
    /// As [`acquire`](Bulkhead::acquire).
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: see [`Acquire`].
    pub fn acquire_with(&self, priority: Priority) -> Acquire<'_> {
        Acquire::new(&self.core, priority)
    }

    /// As [`acquire`](Bulkhead::acquire), with a `'static` permit.
    ///
    /// # Errors
    ///
    /// As [`acquire`](Bulkhead::acquire).
    ///
    /// # Panics
    ///
    /// As [`acquire`](Bulkhead::acquire).
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: see [`AcquireOwned`].
    pub fn acquire_owned(&self) -> AcquireOwned {
        AcquireOwned::new(self.core.clone(), Priority::Normal)
    }

    /// As [`acquire_with`](Bulkhead::acquire_with), with a `'static` permit.
    ///
    /// # Errors
    ///
    /// As [`acquire`](Bulkhead::acquire).
    ///
    /// # Panics
    ///
    /// As [`acquire`](Bulkhead::acquire).
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: see [`AcquireOwned`].
    pub fn acquire_owned_with(&self, priority: Priority) -> AcquireOwned {
        AcquireOwned::new(self.core.clone(), priority)
    }

    /// A permit for normal work if one is free now; never waits.
    ///
    /// # Errors
    ///
    /// [`AcquireError::NoPermit`], or [`AcquireError::Closed`].
    #[inline]
    pub fn try_acquire(&self) -> Result<BulkheadPermit<'_>, AcquireError> {
        self.try_acquire_with(Priority::Normal)
    }

    /// A permit at `priority` if one is free now; never waits.
    ///
    /// # Errors
    ///
    /// [`AcquireError::NoPermit`], or [`AcquireError::Closed`].
    #[inline]
    pub fn try_acquire_with(&self, priority: Priority) -> Result<BulkheadPermit<'_>, AcquireError> {
        self.core
            .try_acquire(priority)
            .map(|()| BulkheadPermit::new(&self.core))
    }

    /// An owned permit for normal work if one is free now; never waits. The owned form of
    /// [`try_acquire`](Bulkhead::try_acquire): the permit holds the bulkhead, so it can move
    /// into a spawned task or a response body.
    ///
    /// # Errors
    ///
    /// [`AcquireError::NoPermit`], or [`AcquireError::Closed`].
    pub fn try_acquire_owned(&self) -> Result<OwnedBulkheadPermit, AcquireError> {
        self.try_acquire_owned_with(Priority::Normal)
    }

    /// An owned permit at `priority` if one is free now; never waits.
    ///
    /// # Errors
    ///
    /// [`AcquireError::NoPermit`], or [`AcquireError::Closed`].
    pub fn try_acquire_owned_with(
        &self,
        priority: Priority,
    ) -> Result<OwnedBulkheadPermit, AcquireError> {
        self.core
            .try_acquire(priority)
            .map(|()| OwnedBulkheadPermit::new(self.core.clone()))
    }

    /// Run `work` holding a permit for normal work; the permit is returned when it finishes
    /// (or is dropped). On an adaptive bulkhead, `work` finishing is an [`Outcome::Ok`]
    /// sample and `work` dropped unfinished an [`Outcome::Ignored`] one; to report
    /// back-pressure, take a permit and [`record`](BulkheadPermit::record) the outcome.
    ///
    /// # Errors
    ///
    /// As [`acquire`](Bulkhead::acquire); `work` is not started when shed or closed.
    ///
    /// # Panics
    ///
    /// As [`acquire`](Bulkhead::acquire).
    ///
    /// # Cancel safety
    ///
    /// Dropped while waiting for a permit, it loses its place in the waiting room and `work`
    /// is dropped unstarted; dropped while `work` runs, `work` is dropped where it stands
    /// and the permit returned (an [`Outcome::Ignored`] sample on an adaptive bulkhead).
    pub async fn run<F: Future>(&self, work: F) -> Result<F::Output, AcquireError> {
        self.run_with(Priority::Normal, work).await
    }

    /// As [`run`](Bulkhead::run), at `priority`.
    ///
    /// # Errors
    ///
    /// As [`acquire`](Bulkhead::acquire).
    ///
    /// # Panics
    ///
    /// As [`acquire`](Bulkhead::acquire).
    ///
    /// # Cancel safety
    ///
    /// As [`run`](Bulkhead::run).
    pub async fn run_with<F: Future>(
        &self,
        priority: Priority,
        work: F,
    ) -> Result<F::Output, AcquireError> {
        let permit = self.acquire_with(priority).await?;
        let out = work.await;
        permit.record(Outcome::Ok);
        Ok(out)
    }

    /// Change `max_in_flight` at runtime. Growing wakes waiters at once; shrinking takes
    /// effect as permits come back (work in flight is never revoked). On an adaptive bulkhead
    /// the algorithm owns `max_in_flight`: a value set here lasts until the next sample.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] on `bulkhead.max_in_flight` if it is zero or above 2³¹ − 1, or not
    /// above the critical reserve set at build time (`Inconsistent`: it would leave no
    /// permit for normal work).
    pub fn set_max_in_flight(&self, max_in_flight: usize) -> Result<(), ConfigError> {
        let max = check_max_in_flight(max_in_flight)?;
        let reserve = self.core.reserve();
        if max <= reserve {
            return Err(ConfigError::new(
                "bulkhead.max_in_flight",
                ConfigErrorKind::Inconsistent,
                format!(
                    "{max} is not above the critical reserve of {reserve}, which would leave no permit for normal work; set it to {} or more",
                    reserve + 1
                ),
            ));
        }
        self.core.set_max_in_flight(max);
        Ok(())
    }

    /// Permits in flight (may exceed [`max_in_flight`](Bulkhead::max_in_flight) for a while
    /// after it was lowered).
    pub fn in_flight(&self) -> usize {
        self.core.in_flight() as usize
    }

    /// Acquisitions waiting for a permit.
    pub fn waiting(&self) -> usize {
        self.core.waiting()
    }

    /// The size of the waiting room (`usize::MAX`: unbounded).
    pub fn max_waiting(&self) -> usize {
        self.core.max_waiting()
    }

    /// The current concurrency cap: the most permits in flight at once.
    pub fn max_in_flight(&self) -> usize {
        self.core.max_in_flight() as usize
    }

    /// Fail every waiter still in the queue and every later acquisition with
    /// [`AcquireError::Closed`]. Permits in flight stay valid, a permit already granted to a
    /// waiter too: that waiter takes it (even if it is polled only after the close).
    pub fn close(&self) {
        self.core.close();
    }

    /// Whether [`close`](Bulkhead::close) was called.
    pub fn is_closed(&self) -> bool {
        self.core.is_closed()
    }

    /// How the acquisitions ended so far (admitted, shed by reason, refused by the close,
    /// cancelled), and what the bulkhead holds now; shared by every clone. See
    /// [`BulkheadStats`].
    pub fn stats(&self) -> BulkheadStats {
        self.core.stats()
    }

    /// The bulkhead's name, if it was given one.
    pub fn name(&self) -> Option<&str> {
        self.core.name()
    }

    /// What the adaptive algorithm learnt so far; `None` when the bulkhead is not adaptive.
    pub fn adaptive_stats(&self) -> Option<AdaptiveStats> {
        self.core.adaptive_stats()
    }
}

impl fmt::Debug for Bulkhead {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.core.fmt(f)
    }
}

fn check_max_in_flight(n: usize) -> Result<u32, ConfigError> {
    let field = "bulkhead.max_in_flight";
    if n == 0 {
        return Err(ConfigError::zero(field));
    }
    u32::try_from(n)
        .ok()
        .filter(|&n| n <= MAX_PERMITS)
        .ok_or_else(|| {
            ConfigError::new(
                field,
                ConfigErrorKind::TooLarge,
                format!("{n} is above the maximum {MAX_PERMITS}"),
            )
        })
}

/// `reserve` as it was asked for (a `usize`): the message names that number.
fn check_reserve(max: u32, reserve: usize) -> Result<(), ConfigError> {
    if reserve >= max as usize {
        return Err(ConfigError::new(
            "bulkhead.critical_reserve",
            ConfigErrorKind::Inconsistent,
            format!("a reserve of {reserve} out of {max} permits leaves none for normal work"),
        ));
    }
    Ok(())
}

/// Makes a fresh copy of the algorithm for each bulkhead built (the builder is `Clone`).
#[derive(Clone)]
struct Factory {
    make: std::sync::Arc<dyn Fn() -> Box<dyn AdaptiveLimit> + Send + Sync>,
    name: &'static str,
}

impl fmt::Debug for Factory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}

/// Builds a [`Bulkhead`]; from [`Bulkhead::builder`].
#[derive(Debug, Clone)]
pub struct BulkheadBuilder {
    max_in_flight: usize,
    max_waiting: usize,
    wait_timeout: Option<Duration>,
    critical_reserve: usize,
    name: Option<String>,
    adaptive: Option<Factory>,
}

impl BulkheadBuilder {
    /// The waiting room: how many acquisitions may wait for a permit (default unbounded).
    /// `0` means no waiting at all: an acquisition that finds no free permit is shed at once.
    pub fn max_waiting(mut self, n: usize) -> Self {
        self.max_waiting = n;
        self
    }

    /// The longest an acquisition waits before it is shed with [`AcquireError::TimedOut`]
    /// (default: as long as it takes). The timeout is a tokio timer, so with one set, an
    /// acquisition that has to wait must be polled inside a tokio runtime with timers enabled
    /// (see [`Bulkhead::acquire`]'s `# Panics`); it counts from the acquisition's first poll
    /// that found no permit, and it ends on the timer's 1 ms tick: less than 1 ms after the
    /// deadline (later if the runtime is busy), less than 2 ms after it in paused time, whose
    /// clock jumps from a point between ticks by whole milliseconds (a timeout of 0.5 ms
    /// begun 0.9 ms past a tick sheds after 2 ms). However long, the timeout is kept as
    /// given (tokio's `sleep` would cut one above 30 years to 30); one that ends past any
    /// instant the clock can tell, such as `Duration::MAX`, never sheds and starts no timer.
    /// The stream adapters wait untimed and are not affected.
    pub fn wait_timeout(mut self, timeout: Duration) -> Self {
        self.wait_timeout = Some(timeout);
        self
    }

    /// How many permits only [`Priority::Critical`] work may take (default 0).
    pub fn critical_reserve(mut self, k: usize) -> Self {
        self.critical_reserve = k;
        self
    }

    /// The `name` label of this bulkhead's metrics.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Let `limit` set `max_in_flight` from the calls' round-trip times and outcomes.
    ///
    /// The builder's `max_in_flight` becomes the ceiling. The algorithm's limit is the share
    /// of normal work, and the `critical_reserve` comes on top: `max_in_flight` is the limit
    /// plus the reserve, within `[critical_reserve + 1, max_in_flight]` (the algorithm is
    /// bounded to `[1, max_in_flight − critical_reserve]` through
    /// [`AdaptiveLimit::bound`], so its limit never runs above a level the bulkhead can
    /// use; an algorithm's `max_limit` left at its default, 1000, gives way to that bound,
    /// so a bulkhead of 10 000 can use them all). Normal work cannot take the reserve: this way it can reach the limit the
    /// algorithm learns (an algorithm grows its limit only from calls that reached it).
    /// Critical calls are samples like any other, and count in flight for normal work too
    /// (a normal call starts only while fewer than the limit are in flight, critical ones
    /// included): a steady critical load takes its part of the limit, the reserve takes
    /// its bursts above it, and the limit is learnt from the downstream's whole load. A
    /// steady critical load at or above the limit leaves normal work nothing until the
    /// limit grows past it, and a doubling of [`Probe`](crate::adaptive::Probe)'s slow
    /// start that admits no more calls does not pay: its trials then raise it a step at a
    /// time.
    /// Every permit then records when it was granted; a call ends with
    /// [`BulkheadPermit::record`] (or [`run`](Bulkhead::run), or a stream adapter's future
    /// completing: [`Outcome::Ok`]), and a permit dropped without an outcome is
    /// [`Outcome::Ignored`]. The round trip ends when the call is seen to finish: in
    /// `bulkhead_map` and `bulkhead_map_unordered`, at the poll of the stream that finds
    /// the future finished, so time the consumer does not poll counts in (see the
    /// [`adaptive`](crate::adaptive) module; `bulkhead_spawn_map` measures the call
    /// alone). The algorithm runs on the thread that ends the call, under its
    /// own lock (never the bulkhead's waiters' lock). Each bulkhead built gets its own copy
    /// of `limit`.
    ///
    /// # Examples
    ///
    /// ```
    /// use flowgate::adaptive::{Outcome, Probe};
    /// use flowgate::bulkhead::Bulkhead;
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let api = Bulkhead::builder(500) // never above 500
    ///     .adaptive(Probe::builder().initial(8).max_limit(500).build()?)
    ///     .name("api")
    ///     .build()?;
    /// assert_eq!(api.max_in_flight(), 8);
    /// let permit = api.acquire().await?;
    /// // ... the call, answered 503 by the downstream:
    /// permit.record(Outcome::BackPressure);
    /// assert_eq!(api.max_in_flight(), 7); // 8 × 0.9, rounded down
    /// # Ok(())
    /// # }
    /// ```
    pub fn adaptive<A: AdaptiveLimit + Clone>(mut self, limit: A) -> Self {
        let name = limit.name();
        let limit = std::sync::Mutex::new(limit);
        self.adaptive = Some(Factory {
            make: std::sync::Arc::new(move || {
                let limit = limit
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                Box::new(limit.clone())
            }),
            name,
        });
        self
    }

    /// Build the bulkhead.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] on `bulkhead.max_in_flight` (zero or above 2³¹ − 1),
    /// `bulkhead.wait_timeout` (zero: use `max_waiting(0)` to never wait), or
    /// `bulkhead.critical_reserve` (not below `max_in_flight`).
    pub fn build(self) -> Result<Bulkhead, ConfigError> {
        let max = check_max_in_flight(self.max_in_flight)?;
        if self.wait_timeout == Some(Duration::ZERO) {
            return Err(ConfigError::new(
                "bulkhead.wait_timeout",
                ConfigErrorKind::Zero,
                "must be longer than zero; use max_waiting(0) to never wait",
            ));
        }
        check_reserve(max, self.critical_reserve)?;
        // Below `max`, so within `u32`.
        let reserve = u32::try_from(self.critical_reserve).unwrap_or(u32::MAX);
        let adaptive = self
            .adaptive
            .map(|f| Adaptive::new((f.make)(), reserve, max, self.name.as_deref()));
        Ok(Bulkhead {
            core: Arc::new(Core::new(
                max,
                reserve,
                self.max_waiting,
                self.wait_timeout,
                self.name,
                adaptive,
            )),
        })
    }
}
