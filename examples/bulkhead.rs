//! A bulkhead in front of a dependency that slows down when overloaded.
//!
//! The simulated downstream answers in 10 ms up to 8 concurrent calls (its "knee"); every
//! call above the knee adds 15 ms to the latency of the calls that start then. At the knee it
//! serves 8 calls / 10 ms = 800 calls per second, and we offer it 2,000 requests at a steady
//! 1,000 per second. The same load runs twice:
//!
//! 1. **No bulkhead**: every request goes straight in, the downstream passes its knee, its
//!    latency feeds on itself and explodes for everyone.
//! 2. **`Bulkhead::builder(8).max_waiting(16)`**: at most 8 calls in the downstream and 16
//!    waiting; the excess is shed at once with `AcquireError::WaitingRoomFull`. The downstream
//!    stays at its knee, so its p99 stays flat at 10 ms and end-to-end p99 is bounded by the
//!    short queue, at the price of the shed requests (which the caller learns about at once).
//!
//! The clock is tokio's paused virtual clock, so the run is deterministic and finishes in
//! well under a second. Run with `cargo run --example bulkhead`.

#[path = "support/cli.rs"]
mod cli;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use flowgate::bulkhead::{AcquireError, Bulkhead};
use tokio::task::JoinSet;
use tokio::time::Instant;

const REQUESTS: u32 = 2_000;
const ARRIVAL_EVERY: Duration = Duration::from_millis(1);
const BASE_LATENCY: Duration = Duration::from_millis(10);
const KNEE: usize = 8;
const PER_CALL_ABOVE_KNEE: Duration = Duration::from_millis(15);

/// The simulated dependency: latency grows with the number of calls in flight.
#[derive(Default)]
struct Downstream {
    in_flight: AtomicUsize,
    peak: AtomicUsize,
}

impl Downstream {
    /// One call; returns how long the downstream took.
    async fn call(&self) -> Duration {
        let n = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.peak.fetch_max(n, Ordering::SeqCst);
        let latency = BASE_LATENCY + PER_CALL_ABOVE_KNEE * n.saturating_sub(KNEE) as u32;
        tokio::time::sleep(latency).await;
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        latency
    }
}

/// What one request saw: the downstream call's latency and its own end-to-end latency,
/// or `None` if it was shed.
type Outcome = Option<(Duration, Duration)>;

async fn request(downstream: Arc<Downstream>, bulkhead: Option<Bulkhead>) -> Outcome {
    let start = Instant::now();
    let call = match &bulkhead {
        None => downstream.call().await,
        Some(b) => match b.run(downstream.call()).await {
            Ok(latency) => latency,
            Err(AcquireError::WaitingRoomFull) => return None,
            Err(other) => panic!("unexpected acquire error: {other}"),
        },
    };
    Some((call, start.elapsed()))
}

/// Offer the load at a steady rate and wait for every request to finish.
async fn run(label: &str, bulkhead: Option<Bulkhead>) {
    let downstream = Arc::new(Downstream::default());
    let start = Instant::now();
    let mut requests = JoinSet::new();
    for i in 0..REQUESTS {
        tokio::time::sleep_until(start + ARRIVAL_EVERY * i).await;
        requests.spawn(request(downstream.clone(), bulkhead.clone()));
    }
    let (mut calls, mut ends, mut shed) = (Vec::new(), Vec::new(), 0);
    while let Some(outcome) = requests.join_next().await {
        match outcome.expect("request task") {
            Some((call, end)) => {
                calls.push(call);
                ends.push(end);
            }
            None => shed += 1,
        }
    }
    println!("{label}");
    println!(
        "  completed {:>5}   shed {shed:>5}   peak downstream concurrency {:>4}   all done after {:?}",
        calls.len(),
        downstream.peak.load(Ordering::SeqCst),
        start.elapsed(),
    );
    println!("  downstream call: {}", percentiles(&mut calls));
    println!("  end to end:      {}", percentiles(&mut ends));
}

/// p50 and p99 (nearest rank) and the maximum.
fn percentiles(v: &mut [Duration]) -> String {
    v.sort_unstable();
    let at = |q: f64| v[((v.len() as f64 * q).ceil() as usize).clamp(1, v.len()) - 1];
    format!(
        "p50 {:>9.1?}   p99 {:>9.1?}   max {:>9.1?}",
        at(0.50),
        at(0.99),
        at(1.0)
    )
}

#[tokio::main(flavor = "current_thread", start_paused = true)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    cli::no_arguments(
        "usage: bulkhead (no arguments: a downstream past its knee, without and with a bulkhead)",
    );
    println!(
        "{REQUESTS} requests, one every {ARRIVAL_EVERY:?}; downstream: {BASE_LATENCY:?} up to \
         {KNEE} concurrent calls, +{PER_CALL_ABOVE_KNEE:?} per call above\n"
    );
    run("without a bulkhead", None).await;

    let bulkhead = Bulkhead::builder(KNEE)
        .max_waiting(16)
        .name("downstream")
        .build()?;
    run(
        "\nwith Bulkhead::builder(8).max_waiting(16)",
        Some(bulkhead),
    )
    .await;
    Ok(())
}
