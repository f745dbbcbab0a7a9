//! Measuring one step: `concurrency` closed-loop workers in one task (see
//! [How a step is measured](super#how-a-step-is-measured)).

use std::task::Poll;
use std::time::Duration;

use futures::future::join_all;
use tokio::time::Instant;

use super::{KneeConfig, KneeStep, KneeTarget};
use crate::adaptive::sample::Outcome;

/// One worker's tally for a step.
#[derive(Default)]
struct Tally {
    /// Round-trip times of the `Ok` calls started in the window.
    rtts: Vec<Duration>,
    /// `Ok` answers that arrived in the window.
    arrived: u64,
    back_pressure: u64,
    ignored: u64,
}

pub(super) async fn measure<T: KneeTarget + ?Sized>(
    target: &T,
    concurrency: u32,
    config: &KneeConfig,
) -> KneeStep {
    let start = Instant::now();
    let from = start + config.warmup;
    let end = start + config.step_duration;
    let workers = (0..concurrency).map(|_| worker(target, from, end, config.timeout));
    let tallies = join_all(workers).await;

    let mut rtts = Vec::new();
    let (mut arrived, mut back_pressure, mut ignored) = (0, 0, 0);
    for tally in tallies {
        rtts.extend(tally.rtts);
        arrived += tally.arrived;
        back_pressure += tally.back_pressure;
        ignored += tally.ignored;
    }
    rtts.sort_unstable();
    let window = (end - from).as_secs_f64();
    KneeStep {
        concurrency,
        throughput: arrived as f64 / window,
        p50: percentile(&rtts, 0.50),
        p99: percentile(&rtts, 0.99),
        ok: rtts.len() as u64,
        back_pressure,
        ignored,
    }
}

/// Nearest-rank percentile of sorted values (zero when empty).
fn percentile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// One closed-loop worker: call, wait for the answer, call again, until `end`.
async fn worker<T: KneeTarget + ?Sized>(
    target: &T,
    from: Instant,
    end: Instant,
    timeout: Duration,
) -> Tally {
    let mut tally = Tally::default();
    loop {
        let sent = Instant::now();
        if sent >= end {
            break;
        }
        let mut call = std::pin::pin!(tokio::time::timeout(timeout, target.call()));
        // Whether the call answered within its first poll, without giving the runtime back.
        let (answer, at_once) = match futures::poll!(call.as_mut()) {
            Poll::Ready(answer) => (answer, true),
            Poll::Pending => (call.await, false),
        };
        let outcome = answer.unwrap_or(Outcome::BackPressure);
        let answered = Instant::now();
        if sent >= from {
            match outcome {
                Outcome::Ok => tally.rtts.push(answered - sent),
                Outcome::BackPressure => tally.back_pressure += 1,
                _ => tally.ignored += 1,
            }
        }
        if outcome == Outcome::Ok && answered > from && answered <= end {
            tally.arrived += 1;
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
    tally
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
        let workers = (0..64).map(|_| worker(&AtOnce, from, end, Duration::from_secs(1)));
        let tallies = join_all(workers).await;
        let ok = tallies.iter().map(|t| t.rtts.len() as u64).sum();
        let bytes = tallies
            .iter()
            .map(|t| t.rtts.capacity() * size_of::<Duration>())
            .sum();
        (ok, bytes)
    }

    /// A step holds as much memory for its round-trip times however many calls it makes:
    /// four times the calls (a longer step, a faster target) take no more.
    #[tokio::test(start_paused = true)]
    #[ignore = "fault: a step keeps every Ok call's round-trip time (16 B each): 1 MiB for 64,000 calls, 4 MiB for 256,000"]
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
}
