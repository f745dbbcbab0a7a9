//! [`Clock`]: where the in-memory limiters read the time.
//!
//! Deciding a request is a few integer operations; reading the time can cost more than all
//! of them. On this crate's reference machine `std::time::Instant::now()` (a `clock_gettime`
//! call) costs about 30 ns, while the CPU's time-stamp counter, read through
//! the `quanta` crate and scaled to nanoseconds, costs about 11 ns: most of
//! a token-bucket decision. So the limiters read the counter by default.
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
//! runtime and used in another. `quanta` reads the time-stamp counter on x86-64 when the CPU
//! has an invariant one (and `rdtscp`), and the system counter (`CNTVCT_EL0`) on 64-bit ARM
//! but iOS; elsewhere (an x86-64 CPU without an invariant TSC, 32-bit x86, iOS, other
//! architectures) it falls back to the OS monotonic clock by itself.
//!
//! Every source is monotonic for one clock; readings are durations since the clock was made,
//! so two clocks (even two clones, which share their start) never need to agree on an
//! absolute time.

use std::fmt;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::runtime::{Handle, RuntimeFlavor};

use crate::limit::nanos;

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
    /// The time-stamp counter through `quanta`: its raw reading at the start.
    Counter { clock: quanta::Clock, start: u64 },
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
    ///
    /// Cheap to make: the `quanta` clock is built once per process and copied. Building one
    /// on x86-64 asks the CPU (`cpuid`) whether its counter can be used, which a virtual
    /// machine traps: ~26 µs on a 2-vCPU KVM guest, where copying it takes nanoseconds. The
    /// first one in a process (where there is a counter) also calibrates the counter against
    /// the OS clock: a busy loop in `quanta` of at least 500 rounds, until the two agree, at
    /// most 200 ms. Make the first gate, pacer or clock before serving, not in a task whose
    /// latency matters.
    pub fn counter() -> Clock {
        static COUNTER: OnceLock<quanta::Clock> = OnceLock::new();
        let clock = COUNTER.get_or_init(quanta::Clock::new).clone();
        let start = clock.raw();
        Clock {
            source: Source::Counter { clock, start },
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

    /// [`now`](Clock::now) in whole nanoseconds (saturating after ~584 years), without
    /// building a `Duration`: what [`Limiter::check_nanos`](crate::limit::Limiter::check_nanos)
    /// takes. A `Duration` is seconds and nanoseconds apart, so going through one costs a
    /// division by 10⁹ and a multiplication back, about a quarter of a token-bucket
    /// decision.
    ///
    /// # Examples
    ///
    /// ```
    /// use flowgate::clock::Clock;
    ///
    /// let clock = Clock::counter();
    /// let a = clock.now_nanos();
    /// assert!(clock.now_nanos() >= a);
    /// ```
    #[inline]
    pub fn now_nanos(&self) -> u64 {
        match &self.source {
            Source::Counter { clock, start } => clock.delta_as_nanos(*start, clock.raw()),
            Source::Tokio { start } => {
                nanos(start.get_or_init(tokio::time::Instant::now).elapsed())
            }
        }
    }

    /// The time since this clock was made (or the clock it was cloned from); it does not
    /// saturate (tokio's paused time reaches past the ~584 years of
    /// [`now_nanos`](Clock::now_nanos)).
    #[inline]
    pub fn now(&self) -> Duration {
        match &self.source {
            // A plain `from_nanos`: keeping the whole second of the last reading (so that
            // only a subtraction was left) cost ~10 % more per decision, measured in
            // interleaved rounds against governor (benches/limit). (The counter keeps real
            // time: its `u64` nanoseconds last 584 years.)
            Source::Counter { clock, start } => {
                Duration::from_nanos(clock.delta_as_nanos(*start, clock.raw()))
            }
            Source::Tokio { start } => start.get_or_init(tokio::time::Instant::now).elapsed(),
        }
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
