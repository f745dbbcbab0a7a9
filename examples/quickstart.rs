//! A short tour of flowgate on the embedded defaults: no Redis, no network.
//!
//! Run with `cargo run --example quickstart`.

use std::time::Duration;

use flowgate::limit::{FixedWindow, Keyed, Limiter, SlidingLog, SlidingWindow, TokenBucket};
use flowgate::{Overflow, Quota, Rate};

fn main() -> Result<(), Box<dyn std::error::Error>> {
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

    // 5. Every bounded buffer in flowgate takes one of these policies.
    for policy in [
        Overflow::Backpressure,
        Overflow::Reject,
        Overflow::DropNewest,
        Overflow::DropOldest,
    ] {
        println!(
            "overflow policy {policy}: sender waits = {}",
            policy.waits()
        );
    }
    Ok(())
}

fn run<A: flowgate::limit::Algorithm>(
    algorithm: A,
    trace: &[Duration],
) -> Result<usize, flowgate::limit::LimitError> {
    let mut limiter = Limiter::new(algorithm);
    let mut admitted = 0;
    for &t in trace {
        admitted += usize::from(limiter.check(t, 1)?.allowed);
    }
    Ok(admitted)
}
