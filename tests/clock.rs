//! `Clock`: which source `Clock::new` picks, and that the gate built on it follows tokio's
//! paused time exactly where tests need it.

use std::time::Duration;

use flowgate::Quota;
use flowgate::clock::Clock;
use flowgate::gate::{Limit, MemoryGate};

#[tokio::test(start_paused = true)]
async fn in_a_current_thread_runtime_the_clock_follows_paused_time() {
    let clock = Clock::new();
    assert!(clock.is_tokio(), "{clock:?}");
    assert_eq!(clock.now(), Duration::ZERO);
    tokio::time::advance(Duration::from_millis(1_500)).await;
    assert_eq!(clock.now(), Duration::from_millis(1_500));
    // A clone reads the same timeline.
    assert_eq!(clock.clone().now(), Duration::from_millis(1_500));
}

#[test]
fn outside_a_runtime_and_in_a_multi_thread_one_the_clock_is_the_counter() {
    let clock = Clock::new();
    assert!(!clock.is_tokio(), "{clock:?}");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .unwrap();
    let inside = rt.block_on(async { Clock::new() });
    assert!(!inside.is_tokio(), "{inside:?}");
    assert!(format!("{inside:?}").contains("counter"));
}

#[test]
fn the_counter_is_monotonic_and_keeps_real_time() {
    let clock = Clock::counter();
    let mut last = clock.now();
    for _ in 0..10_000 {
        let now = clock.now();
        assert!(now >= last, "{now:?} < {last:?}");
        last = now;
    }
    // The OS clock's interval lies within [a, d] and contains [b, c] on the counter, however
    // the threads are scheduled; 2 % leaves room for the counter's calibration.
    let a = clock.now();
    let os = std::time::Instant::now();
    let b = clock.now();
    std::thread::sleep(Duration::from_millis(100));
    let c = clock.now();
    let real = os.elapsed();
    let d = clock.now();
    assert!(
        c - b <= real.mul_f64(1.02),
        "counter {:?} inside OS {real:?}",
        c - b
    );
    assert!(
        d - a >= real.mul_f64(0.98),
        "counter {:?} around OS {real:?}",
        d - a
    );
}

#[tokio::test(start_paused = true)]
async fn a_gate_built_in_a_paused_test_refills_with_tokio_time() {
    let gate = MemoryGate::new(Limit::TokenBucket(Quota::per_second(2).unwrap()));
    assert!(gate.check("k", 2).unwrap().allowed);
    let d = gate.check("k", 1).unwrap();
    assert!(!d.allowed);
    assert_eq!(d.retry_after, Duration::from_millis(500));
    tokio::time::advance(Duration::from_millis(499)).await;
    assert!(!gate.check("k", 1).unwrap().allowed);
    tokio::time::advance(Duration::from_millis(1)).await;
    assert!(gate.check("k", 1).unwrap().allowed);
}

#[test]
fn a_gate_given_the_tokio_clock_outside_follows_the_paused_runtime_it_runs_in() {
    // Built outside any runtime (the default there would be the counter).
    let gate = MemoryGate::builder(Limit::TokenBucket(Quota::per_second(1).unwrap()))
        .clock(Clock::tokio())
        .build()
        .unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    rt.block_on(async {
        assert!(gate.check("k", 1).unwrap().allowed);
        assert!(!gate.check("k", 1).unwrap().allowed);
        tokio::time::advance(Duration::from_millis(999)).await;
        assert!(!gate.check("k", 1).unwrap().allowed);
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(gate.check("k", 1).unwrap().allowed);
    });
    assert!(format!("{gate:?}").contains("tokio"));
}

/// Six centuries of paused time: past the end of the u64-nanosecond timeline (584 years).
const SIX_CENTURIES: Duration = Duration::from_secs(600 * 365 * 24 * 60 * 60);

#[tokio::test(start_paused = true)]
async fn the_tokio_clock_reads_past_584_years() {
    let clock = Clock::tokio();
    tokio::time::advance(SIX_CENTURIES).await;
    assert_eq!(clock.now(), SIX_CENTURIES);
    tokio::time::advance(Duration::from_secs(1)).await;
    assert_eq!(clock.now(), SIX_CENTURIES + Duration::from_secs(1));
}

/// A gate on tokio's clock keeps refilling past 584 years, under every algorithm.
#[tokio::test(start_paused = true)]
async fn a_gate_keeps_deciding_past_584_years() {
    let rate = flowgate::Rate::per_second(1).unwrap();
    let gates = [
        Limit::TokenBucket(Quota::from(rate)),
        Limit::FixedWindow(rate),
        Limit::SlidingLog(rate),
        Limit::SlidingWindow(rate),
    ]
    .map(|limit| {
        MemoryGate::builder(limit)
            .clock(Clock::tokio())
            .build()
            .unwrap()
    });
    tokio::time::advance(SIX_CENTURIES).await;
    for gate in &gates {
        for round in 0..3 {
            let d = gate.check("k", 1).unwrap();
            assert!(d.allowed, "{gate:?}, round {round}: {d:?}");
            let d = gate.check("k", 1).unwrap();
            assert!(!d.allowed && !d.retry_after.is_zero(), "{gate:?}: {d:?}");
            tokio::time::advance(d.retry_after).await;
        }
    }
}
