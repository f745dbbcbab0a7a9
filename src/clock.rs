//! [`Clock`]: where the in-memory limiters read the time.
//!
//! Deciding a request is a few integer operations; reading the time can cost more than all
//! of them. On this crate's reference machine `std::time::Instant::now()` (a `clock_gettime`
//! call) costs about 30 ns, while the CPU's time-stamp counter, read through
//! the `quanta` crate and scaled to nanoseconds, costs about 11 ns: most of
//! a token-bucket decision. So the limiters read the counter by default. (Turning the
//! nanoseconds into a `Duration` divides by 10^9; the clock keeps the second of its last
//! reading, so that it only subtracts.)
//!
//! Tests want the other thing: tokio's paused time (`#[tokio::test(start_paused = true)]`,
//! `tokio::time::pause()`), which only tokio's clock follows. A paused clock only exists in
//! a current-thread runtime, so [`Clock::new`] picks:
//!
//! | where the clock is made | source |
//! |---|---|
//! | inside a current-thread tokio runtime (every `#[tokio::test]`) | tokio's clock: paused time works |
//! | inside a multi-thread runtime, or outside any runtime | the time-stamp counter (`quanta`) |
//!
//! [`Clock::tokio`] and [`Clock::counter`] choose explicitly, for a gate built in one
//! runtime and used in another. Where the counter is not usable (no invariant TSC, or not
//! x86), `quanta` falls back to the OS monotonic clock by itself.
//!
//! Every source is monotonic for one clock; readings are durations since the clock was made,
//! so two clocks (even two clones, which share their start) never need to agree on an
//! absolute time.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::runtime::{Handle, RuntimeFlavor};

use crate::rate::NANOS_PER_SEC;

/// A monotonic clock reading durations since it was made: the time-stamp counter, or
/// tokio's clock when tokio's paused time must be followed (see the [module
/// docs](crate::clock) for which [`Clock::new`] picks).
///
/// Cheap to clone; clones share the start, so they read the same timeline.
///
/// # Examples
///
/// ```
/// use flowgate::clock::Clock;
///
/// let clock = Clock::counter();
/// let a = clock.now();
/// let b = clock.now();
/// assert!(b >= a);
/// ```
///
/// With tokio's paused time (a current-thread runtime, as `#[tokio::test]` builds):
///
/// ```
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() {
/// use std::time::Duration;
/// use flowgate::clock::Clock;
///
/// let clock = Clock::new(); // follows tokio's clock here
/// assert!(clock.is_tokio());
/// tokio::time::sleep(Duration::from_secs(60)).await; // returns at once, paused
/// assert_eq!(clock.now(), Duration::from_secs(60));
/// # }
/// ```
#[derive(Clone)]
pub struct Clock {
    source: Source,
}

#[derive(Clone)]
enum Source {
    /// The time-stamp counter through `quanta`: its raw reading at the start, and the whole
    /// second the last reading fell in.
    Counter {
        clock: quanta::Clock,
        start: u64,
        second: Second,
    },
    /// tokio's clock (follows paused time), from its first reading inside a runtime (or
    /// from when the clock was made, if that was inside one); shared by clones.
    Tokio {
        start: Arc<OnceLock<tokio::time::Instant>>,
    },
}

impl Clock {
    /// tokio's clock inside a current-thread runtime (where paused time exists), the
    /// time-stamp counter everywhere else.
    pub fn new() -> Clock {
        match Handle::try_current() {
            Ok(handle) if handle.runtime_flavor() != RuntimeFlavor::MultiThread => Clock::tokio(),
            _ => Clock::counter(),
        }
    }

    /// The time-stamp counter (through `quanta`; the OS monotonic clock where there is no
    /// usable counter): the cheap source. It does not follow tokio's paused time.
    pub fn counter() -> Clock {
        let clock = quanta::Clock::new();
        let start = clock.raw();
        Clock {
            source: Source::Counter {
                clock,
                start,
                second: Second::default(),
            },
        }
    }

    /// tokio's clock (`tokio::time::Instant::now()`): follows paused time; costs what the
    /// OS clock costs (with tokio's `test-util` feature, a little more).
    ///
    /// Made inside a runtime, the timeline starts now; made outside any (a gate built before
    /// the runtime its tests pause), it starts at the first reading, so a paused runtime
    /// created in between does not make the first readings saturate at zero.
    pub fn tokio() -> Clock {
        let start = OnceLock::new();
        if Handle::try_current().is_ok() {
            let _ = start.set(tokio::time::Instant::now());
        }
        Clock {
            source: Source::Tokio {
                start: Arc::new(start),
            },
        }
    }

    /// Whether this clock reads tokio's clock.
    pub fn is_tokio(&self) -> bool {
        matches!(self.source, Source::Tokio { .. })
    }

    /// The time since this clock was made (or the clock it was cloned from).
    #[inline]
    pub fn now(&self) -> Duration {
        match &self.source {
            Source::Counter {
                clock,
                start,
                second,
            } => second.duration(clock.delta_as_nanos(*start, clock.raw())),
            Source::Tokio { start } => start.get_or_init(tokio::time::Instant::now).elapsed(),
        }
    }
}

/// The whole second of a clock's last reading, so that turning a reading in nanoseconds into
/// a `Duration` is a subtraction, not a division by 10^9 (a quarter of a reading's cost;
/// the limiters then take the `Duration` apart again, which the compiler folds). A cache
/// only: every reading checks that it falls in the cached second and computes it exactly
/// otherwise, so readings are exact whatever another thread stored meanwhile.
#[derive(Debug, Default)]
struct Second(AtomicU64);

impl Second {
    #[inline]
    fn duration(&self, nanos: u64) -> Duration {
        let secs = self.0.load(Ordering::Relaxed);
        // `secs` came from a reading, so `secs × 10^9` fits. Below the cached second
        // (another thread stored a later one) or past it: computed below.
        if let Some(into) = nanos.checked_sub(secs.wrapping_mul(NANOS_PER_SEC))
            && into < NANOS_PER_SEC
        {
            return Duration::new(secs, into as u32);
        }
        let exact = Duration::from_nanos(nanos);
        self.0.store(exact.as_secs(), Ordering::Relaxed);
        exact
    }
}

impl Clone for Second {
    fn clone(&self) -> Second {
        Second(AtomicU64::new(self.0.load(Ordering::Relaxed)))
    }
}

impl Default for Clock {
    /// [`Clock::new`].
    fn default() -> Clock {
        Clock::new()
    }
}

impl fmt::Debug for Clock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let source = match self.source {
            Source::Counter { .. } => "counter",
            Source::Tokio { .. } => "tokio",
        };
        f.debug_struct("Clock")
            .field("source", &source)
            .field("now", &self.now())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The cached second never changes a reading: forwards, within a second, across a
    /// boundary, backwards past what another thread cached, and at the ends of the range.
    #[test]
    fn the_cached_second_gives_exact_durations_in_any_order() {
        let second = Second::default();
        let readings = [
            0,
            1,
            999_999_999,
            1_000_000_000,
            1_000_000_001,
            5_000_000_007,
            5_999_999_999,
            2_000_000_003,
            u64::MAX - 1,
            u64::MAX,
            7,
            18_446_744_072_999_999_999,
        ];
        for ns in readings {
            assert_eq!(second.duration(ns), Duration::from_nanos(ns), "{ns}");
            assert_eq!(
                second.duration(ns),
                Duration::from_nanos(ns),
                "{ns}, cached"
            );
        }
        let clone = second.clone();
        assert_eq!(clone.duration(3), Duration::from_nanos(3));
    }

    #[test]
    fn counter_readings_never_go_back_across_clones() {
        let clock = Clock::counter();
        let other = clock.clone();
        let mut last = Duration::ZERO;
        for i in 0..100_000 {
            let now = if i % 2 == 0 { clock.now() } else { other.now() };
            assert!(now >= last, "{now:?} < {last:?}");
            last = now;
        }
    }
}
