//! A short tour of flowgate on the embedded defaults: no Redis, no network.
//!
//! Run with `cargo run --example quickstart`.

#[path = "support/cli.rs"]
mod cli;

use std::time::Duration;

use flowgate::bulkhead::{AcquireError, Bulkhead};
use flowgate::channel::{self, Sent};
use flowgate::gate::{Limit, MemoryGate};
use flowgate::limit::{FixedWindow, Keyed, Limiter, SlidingLog, SlidingWindow, TokenBucket};
use flowgate::pace::Pacer;
use flowgate::{FlowStreamExt, Overflow, Quota, Rate};
use futures::StreamExt;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    cli::no_arguments(
        "usage: quickstart (no arguments: a tour of flowgate on the in-memory defaults)",
    );
    // 1. Value types validate their input: a typed error, never a panic.
    let quota = Quota::per_second(5)?.burst(10)?;
    println!("quota: {quota}");
    match Rate::per_second(0) {
        Err(e) => println!("Rate::per_second(0) -> error: {e}"),
        Ok(r) => println!("unexpected: {r}"),
    }

    // 2. The limiter math takes time explicitly, so it can be replayed exactly.
    //    Offer 20 requests per second for 3 seconds to a token bucket of 5/s, burst 10.
    let mut bucket = Limiter::new(TokenBucket::new(quota));
    let mut admitted = 0;
    for i in 0..60u64 {
        let now = Duration::from_millis(i * 50);
        let d = bucket.check(now, 1)?;
        if d.allowed {
            admitted += 1;
        } else if i % 10 == 0 {
            println!(
                "  t={:>5?} rejected, retry after {:?}, {}",
                now,
                d.retry_after,
                d.ratelimit_header("tenant")
            );
        }
    }
    println!("token bucket admitted {admitted} of 60 in 3 s (bound: burst 10 + 5/s x 2.95 s = 24)");

    // 3. The four algorithms on the same trace: 10 per second, 30 requests in 1.5 s.
    let rate = Rate::per_second(10)?;
    let trace: Vec<Duration> = (0..30).map(|i| Duration::from_millis(i * 50)).collect();
    println!(
        "same trace, 10/s: token bucket {}, fixed window {}, sliding log {}, sliding window {}",
        run(TokenBucket::new(rate.into()), &trace)?,
        run(FixedWindow::new(rate), &trace)?,
        run(SlidingLog::new(rate), &trace)?,
        run(SlidingWindow::new(rate), &trace)?,
    );

    // 4. Per-key limits in bounded memory: idle keys are evicted when room is needed.
    let mut per_tenant = Keyed::new(TokenBucket::new(Quota::per_second(1)?), 1_000)?;
    for tenant in 0..1_000u32 {
        per_tenant.check(&tenant, Duration::ZERO, 1)?;
    }
    println!("keyed: {} tenants held", per_tenant.len());
    let err = per_tenant.check(&5_000, Duration::ZERO, 1).unwrap_err();
    println!("keyed: a new tenant while all are busy -> {err}");
    per_tenant.check(&5_000, Duration::from_secs(1), 1)?;
    println!(
        "keyed: one second later the idle tenants were evicted, {} held",
        per_tenant.len()
    );

    // 5. A bounded channel that keeps the freshest items: the oldest are dropped, and every
    //    drop is reported, with its reason, and counted.
    let (tx, mut rx) = channel::builder(4)
        .overflow(Overflow::DropOldest)
        .on_drop(|stale: u32, why: &flowgate::Dropped| {
            println!("  dropped stale reading {stale}: {why}")
        })
        .name("readings")
        .build()?;
    for reading in 0..6u32 {
        if tx.send(reading).await? == Sent::DroppedOldest {
            println!("  reading {reading} queued by dropping the oldest");
        }
    }
    drop(tx);
    let mut fresh = Vec::new();
    while let Some(r) = rx.recv().await {
        fresh.push(r);
    }
    let stats = rx.stats();
    println!(
        "channel: received {fresh:?}; sent {} = received {} + dropped {}",
        stats.sent, stats.received, stats.dropped
    );

    // 6. A bulkhead: at most 3 calls in flight to a dependency, one waiting, the rest shed.
    let dependency = Bulkhead::builder(3)
        .max_waiting(1)
        .name("dependency")
        .build()?;
    let held: Vec<_> = (0..3)
        .map(|_| dependency.try_acquire())
        .collect::<Result<_, _>>()?;
    let mut waiting = Box::pin(dependency.acquire());
    assert!(futures::poll!(waiting.as_mut()).is_pending());
    match dependency.acquire().await {
        Err(AcquireError::WaitingRoomFull) => {
            println!("bulkhead: 3 in flight, 1 waiting, the next is shed")
        }
        other => println!("unexpected: {other:?}"),
    }
    drop(held);
    drop(waiting.await?);

    // 7. The same bulkhead as a stream adapter: backpressure, never more than 3 at once.
    let doubled: Vec<u32> = futures::stream::iter(1..=6)
        .bulkhead_map(dependency.clone(), |x| async move { x * 2 })
        .collect()
        .await;
    println!(
        "bulkhead_map (ordered): {doubled:?}, in flight now {}",
        dependency.in_flight()
    );

    // 8. Constant outflow: 20 items at 100/s (the default burst, 2, leaves at once).
    let start = tokio::time::Instant::now();
    let pacer = Pacer::new(Rate::per_second(100)?);
    let n = futures::stream::iter(0..20).leaky_with(pacer).count().await;
    println!("pace: {n} items at 100/s took {:?}", start.elapsed());

    // 9. A keyed gate (the embedded default; RedisGate holds the same limit fleet-wide).
    //    `gated_drop` drops what the gate rejects, and counts it.
    let gate = MemoryGate::new(Limit::TokenBucket(Quota::per_second(5)?));
    let mut gated = futures::stream::iter(0..12).gated_drop(gate, |i: &u32| {
        if i.is_multiple_of(2) { "even" } else { "odd" }
    });
    let passed = gated.by_ref().count().await;
    println!(
        "gate: 12 requests over 2 keys of 5/s each, {passed} passed at once, {} dropped",
        gated.dropped()
    );
    Ok(())
}

fn run<A: flowgate::limit::Algorithm>(
    algorithm: A,
    trace: &[Duration],
) -> Result<usize, flowgate::CostError> {
    let mut limiter = Limiter::new(algorithm);
    let mut admitted = 0;
    for &t in trace {
        admitted += usize::from(limiter.check(t, 1)?.allowed);
    }
    Ok(admitted)
}
