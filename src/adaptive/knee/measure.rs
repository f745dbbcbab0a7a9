//! Measuring one step: `concurrency` closed-loop workers in one task, sharing one tally (see
//! [How a step is measured](super#how-a-step-is-measured)).

use std::sync::{Mutex, PoisonError};
use std::task::Poll;
use std::time::Duration;

use futures::future::join_all;
use hdrhistogram::Histogram;
use tokio::time::Instant;

use super::{KneeConfig, KneeStep, KneeTarget};
use crate::adaptive::sample::Outcome;

/// The histogram's precision: 3 significant figures (a bucket is at most 1/1,024 of the
/// values it holds), over 1 ns to `u64::MAX` ns (584 years: longer than the longest timeout
/// a [`KneeConfig`] takes, a century).
const SIGNIFICANT_FIGURES: u8 = 3;

/// A step's tally, shared by its workers (futures in one task: the lock is never contended
/// and never held across an `.await`).
struct Tally {
    /// Round-trip times of the `Ok` calls started in the window, in nanoseconds: a
    /// histogram of fixed size, whatever the number of calls.
    rtts: Histogram<u64>,
    /// The longest of them, exact (the histogram rounds up to its bucket's top).
    longest: u64,
    /// `Ok` answers that arrived in the window.
    arrived: u64,
    back_pressure: u64,
    ignored: u64,
}

impl Tally {
    fn new() -> Tally {
        let rtts = Histogram::new_with_bounds(1, u64::MAX, SIGNIFICANT_FIGURES)
            .expect("1 to u64::MAX at 3 significant figures is a valid histogram");
        Tally {
            rtts,
            longest: 0,
            arrived: 0,
            back_pressure: 0,
            ignored: 0,
        }
    }

    /// Record an `Ok` call's round trip (longer than `u64::MAX` ns: that).
    fn record_ok(&mut self, rtt: Duration) {
        let ns = u64::try_from(rtt.as_nanos()).unwrap_or(u64::MAX);
        self.rtts.saturating_record(ns);
        self.longest = self.longest.max(ns);
    }

    /// `Ok` calls started in the window: the round trips recorded.
    fn ok(&self) -> u64 {
        self.rtts.len()
    }

    /// The nearest-rank `q` quantile of the recorded round trips (zero when there are
    /// none): the top of its bucket, at most the longest recorded.
    fn quantile(&self, q: f64) -> Duration {
        Duration::from_nanos(self.rtts.value_at_quantile(q).min(self.longest))
    }

    /// The heap bytes the tally holds: the histogram's counters.
    #[cfg(test)]
    fn heap_bytes(&self) -> usize {
        self.rtts.distinct_values() * size_of::<u64>()
    }
}

pub(super) async fn measure<T: KneeTarget + ?Sized>(
    target: &T,
    concurrency: u32,
    config: &KneeConfig,
) -> KneeStep {
    let start = Instant::now();
    let from = start + config.warmup;
    let end = start + config.step_duration;
    let tally = run(target, concurrency, from, end, config.timeout).await;
    let window = (end - from).as_secs_f64();
    KneeStep {
        concurrency,
        throughput: tally.arrived as f64 / window,
        p50: tally.quantile(0.50),
        p99: tally.quantile(0.99),
        ok: tally.ok(),
        back_pressure: tally.back_pressure,
        ignored: tally.ignored,
    }
}

/// Run `concurrency` workers until `end`, measuring from `from`, and answer their tally.
async fn run<T: KneeTarget + ?Sized>(
    target: &T,
    concurrency: u32,
    from: Instant,
    end: Instant,
    timeout: Duration,
) -> Tally {
    let tally = Mutex::new(Tally::new());
    let workers = (0..concurrency).map(|_| worker(target, from, end, timeout, &tally));
    join_all(workers).await;
    tally.into_inner().unwrap_or_else(PoisonError::into_inner)
}

/// One closed-loop worker: call, wait for the answer, call again, until `end`.
async fn worker<T: KneeTarget + ?Sized>(
    target: &T,
    from: Instant,
    end: Instant,
    timeout: Duration,
    tally: &Mutex<Tally>,
) {
    // One timer for the worker's every call, moved to each call's deadline: a deadline
    // only ever moves later, which tokio does without touching its timer wheel, where a
    // timer of its own per call (`tokio::time::timeout`) is put in and taken out again.
    let mut deadline = std::pin::pin!(tokio::time::sleep(timeout));
    loop {
        let sent = Instant::now();
        if sent >= end {
            break;
        }
        deadline.as_mut().reset(sent + timeout);
        let mut call = std::pin::pin!(target.call());
        // How often the call was polled: once when it answered within its first poll,
        // without giving the runtime back.
        let mut polls = 0_u32;
        let answer = std::future::poll_fn(|cx| {
            polls = polls.saturating_add(1);
            // The call first: an answer at its deadline is an answer (as `timeout` does).
            if let Poll::Ready(outcome) = call.as_mut().poll(cx) {
                return Poll::Ready(Some(outcome));
            }
            deadline.as_mut().poll(cx).map(|()| None)
        })
        .await;
        let at_once = polls == 1;
        let outcome = answer.unwrap_or(Outcome::BackPressure);
        let answered = Instant::now();
        {
            let mut tally = tally.lock().unwrap_or_else(PoisonError::into_inner);
            if sent >= from {
                match outcome {
                    Outcome::Ok => tally.record_ok(answered - sent),
                    Outcome::BackPressure => tally.back_pressure += 1,
                    _ => tally.ignored += 1,
                }
            }
            if outcome == Outcome::Ok && answered > from && answered <= end {
                tally.arrived += 1;
            }
        }
        if answered == sent {
            // A call that took no time at all (a target that never waits, under paused
            // time) would keep this task busy forever and the clock would never reach
            // `end`: give the clock a millisecond.
            tokio::time::sleep(Duration::from_millis(1)).await;
        } else if at_once {
            // Nor may a call that answered at once keep the task to itself until `end`:
            // the other workers (and the runtime's other tasks) run in between.
            tokio::task::yield_now().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use futures::future::BoxFuture;

    use super::*;

    /// Answers every call at once: under paused time each worker calls once a millisecond.
    struct AtOnce;

    impl KneeTarget for AtOnce {
        fn call(&self) -> BoxFuture<'_, Outcome> {
            Box::pin(std::future::ready(Outcome::Ok))
        }
    }

    /// 64 workers measured for `secs` against [`AtOnce`]: the `Ok` calls recorded and the
    /// heap bytes the step's round-trip times take.
    async fn step_of(secs: u64) -> (u64, usize) {
        let from = Instant::now();
        let end = from + Duration::from_secs(secs);
        let tally = run(&AtOnce, 64, from, end, Duration::from_secs(1)).await;
        (tally.ok(), tally.heap_bytes())
    }

    /// A step holds as much memory for its round-trip times however many calls it makes:
    /// four times the calls (a longer step, a faster target) take no more.
    #[tokio::test(start_paused = true)]
    async fn a_step_holds_the_same_memory_however_many_calls_it_makes() {
        let (short_calls, short) = step_of(1).await;
        let (long_calls, long) = step_of(4).await;
        assert!(
            long_calls >= 4 * short_calls - 64,
            "{short_calls} then {long_calls}"
        );
        assert_eq!(
            long, short,
            "{short} B for {short_calls} calls, {long} B for {long_calls}"
        );
    }

    /// The module docs say how much memory a step's round-trip times take.
    #[test]
    fn a_step_takes_the_memory_the_docs_say() {
        assert_eq!(Tally::new().heap_bytes(), 440 * 1024);
    }

    /// The exact nearest-rank `q` quantile of `sorted`.
    fn nearest_rank(sorted: &[u64], q: f64) -> u64 {
        let rank = (q * sorted.len() as f64).ceil() as usize;
        sorted[rank.clamp(1, sorted.len()) - 1]
    }

    /// p50 and p99 are the exact nearest-rank percentiles rounded up by less than 0.1 %
    /// (exact below 2,048 ns, and never above the longest call), from 1 ns to a century.
    #[test]
    fn p50_and_p99_are_exact_to_a_thousandth() {
        let mut rng = fastrand::Rng::with_seed(7);
        for (n, top) in [
            (1, 10),
            (7, 2_048),
            (1_000, 1_000_000),
            (10_001, u64::MAX >> 1),
        ] {
            let mut tally = Tally::new();
            let mut rtts: Vec<u64> = (0..n)
                .map(|_| {
                    // Log-uniform from 1 ns to `top`.
                    let bits = rng.u32(0..=top.ilog2());
                    rng.u64(1 << bits..=top.min((1 << bits) * 2 - 1))
                })
                .collect();
            for &ns in &rtts {
                tally.record_ok(Duration::from_nanos(ns));
            }
            rtts.sort_unstable();
            for q in [0.5, 0.99] {
                let exact = nearest_rank(&rtts, q);
                let got = u64::try_from(tally.quantile(q).as_nanos()).unwrap();
                assert!(got >= exact, "{q} of {n} up to {top}: {got} < {exact}");
                assert!(got <= rtts[rtts.len() - 1], "{q}: {got} above the longest");
                if exact < 2_048 {
                    assert_eq!(got, exact, "{q} of {n} up to {top}");
                } else {
                    let error = (got - exact) as f64 / exact as f64;
                    assert!(error < 1e-3, "{q} of {n} up to {top}: {got} for {exact}");
                }
            }
        }
    }

    /// A round trip of zero or beyond the histogram's range is recorded, clamped, and
    /// nothing panics; with no call recorded, p50 and p99 are zero.
    #[test]
    fn round_trips_out_of_range_are_clamped() {
        let mut tally = Tally::new();
        assert_eq!(tally.quantile(0.99), Duration::ZERO);
        tally.record_ok(Duration::ZERO);
        tally.record_ok(Duration::MAX);
        assert_eq!(tally.ok(), 2);
        assert_eq!(tally.quantile(0.5), Duration::ZERO);
        // The top of the histogram's last bucket: 584 years, a nanosecond short.
        assert!(tally.quantile(0.99) >= Duration::from_nanos(u64::MAX - 1));
    }
}
