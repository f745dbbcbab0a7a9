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
