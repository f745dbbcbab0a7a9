//! The pacer, the paced adapters and the adaptive pacer with any rate, burst, cost and
//! server feedback.

use super::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn pacer_takes_any_rate_burst_and_cost(
        rate in any_rate(),
        burst in prop::option::of(any_u32()),
        costs in prop::collection::vec(any_u32(), 1..5),
        new_quota in any_quota(),
        pause in any_duration(),
    ) {
        paused().block_on(async {
            let mut builder = Pacer::builder(rate);
            if let Some(b) = burst {
                builder = builder.burst(b);
            }
            let pacer = match builder.build() {
                Ok(p) => p,
                Err(e) => {
                    assert_eq!(burst, Some(0));
                    assert_eq!(e.field(), "pace.burst");
                    return;
                }
            };
            let capacity = u64::from(pacer.quota().burst_size());
            for &cost in &costs {
                match pacer.check(cost) {
                    Ok(d) => assert!(d.remaining <= d.capacity),
                    Err(_) => assert!(cost == 0 || u64::from(cost) > capacity),
                }
                // A cost that can pass is admitted in the end (paused time jumps ahead);
                // one that never can is refused at once. (At most a century each: the
                // pacer's timeline is 584 years long, see `pacer_past_584_years`.)
                let waited = tokio::time::timeout(CENTURY, pacer.until_ready(cost)).await;
                match waited {
                    Ok(Ok(())) => assert!(cost > 0 && u64::from(cost) <= capacity),
                    Ok(Err(_)) => assert!(cost == 0 || u64::from(cost) > capacity),
                    Err(_) => {} // a century per unit: still waiting, which is right
                }
            }
            if let Some(at) = tokio::time::Instant::now().checked_add(pause) {
                pacer.pause_until(at);
            }
            pacer.set_quota(new_quota);
            let _ = pacer.check(1);
            let _ = tokio::time::timeout(Duration::from_secs(1), pacer.until_ready(1)).await;
            assert_eq!(pacer.waiting(), 0);
        });
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn paced_streams_deliver_every_cost_and_bound_their_queues(
        per_second in prop_oneof![Just(1u32), Just(1_000_000), Just(u32::MAX), 1..1000u32],
        burst in prop_oneof![Just(1u32), Just(u32::MAX), 1..10u32],
        costs in prop::collection::vec(prop_oneof![Just(0u32), Just(1), Just(u32::MAX), 1..5u32], 1..6),
        capacity in any_usize(),
        overflow in any_overflow(),
    ) {
        paused().block_on(async {
            let pacer = Pacer::builder(Rate::per_second(per_second).unwrap())
                .burst(burst)
                .build()
                .unwrap();
            // An item costing more than the burst is paid in chunks; a cost of 0 is free:
            // every item comes out, in order (at most a few thousand seconds of paused time).
            let cheap: Vec<u32> = costs
                .iter()
                .map(|&c| if u64::from(c) > u64::from(burst) * 16 { burst } else { c })
                .collect();
            let out: Vec<u32> = flowgate::pace::Leaky::builder(futures::stream::iter(cheap.clone()), pacer.clone())
                .cost(|c: &u32| *c)
                .build()
                .unwrap()
                .collect()
                .await;
            assert_eq!(out, cheap);
            let built = flowgate::pace::LeakyQueue::builder(futures::stream::iter(0..10u32), pacer, capacity)
                .overflow(overflow)
                .build();
            match built {
                Ok(q) => {
                    let out: Vec<u32> = q.collect().await;
                    assert!(out.len() <= 10);
                    if overflow == Overflow::Backpressure {
                        assert_eq!(out, (0..10).collect::<Vec<_>>());
                    }
                }
                Err(e) => {
                    sane_config_error(&e);
                    assert_eq!(capacity, 0);
                }
            }
        });
    }
}

/// A pacer older than 584 years (the `u64` nanoseconds its schedule was kept in; reachable
/// under paused time) admits a unit per second: its schedule goes on in 128 bits.
#[test]
fn pacer_past_584_years() {
    paused().block_on(async {
        let pacer = Pacer::builder(Rate::per_second(1).unwrap())
            .burst(1)
            .build()
            .unwrap();
        let year = Duration::from_secs(365 * 24 * 60 * 60);
        tokio::time::advance(year * 600).await;
        for _ in 0..3 {
            let waited = tokio::time::timeout(Duration::from_secs(5), pacer.until_ready(1)).await;
            assert!(waited.is_ok(), "a unit per second, none in 5 s");
        }
    });
}

/// A pacer older than a century keeps its line FIFO: the waiter behind the first one does
/// not step over it before the first one's turn (and the 10 ms of grace after it) has come.
#[test]
fn pacer_past_a_century_keeps_its_line() {
    paused().block_on(async {
        let pacer = Pacer::builder(Rate::per_second(1).unwrap())
            .burst(1)
            .build()
            .unwrap();
        tokio::time::advance(CENTURY * 2).await;
        pacer.until_ready(1).await.unwrap();
        let mut first = std::pin::pin!(pacer.until_ready(1));
        let mut second = std::pin::pin!(pacer.until_ready(1));
        assert!(futures::poll!(&mut first).is_pending());
        assert!(futures::poll!(&mut second).is_pending());
        // The first one's turn is in 1 s: nobody steps over it before 1.01 s.
        tokio::time::advance(Duration::from_millis(500)).await;
        assert!(futures::poll!(&mut second).is_pending());
        tokio::time::advance(Duration::from_millis(500)).await;
        assert!(
            futures::poll!(&mut second).is_pending(),
            "the second waiter passed before the first"
        );
        assert!(futures::poll!(&mut first).is_ready());
        assert!(futures::poll!(&mut second).is_pending());
    });
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn adaptive_pacer_takes_any_feedback(
        (ceiling, floor, initial) in (any_rate(), prop::option::of(any_rate()), prop::option::of(any_rate())),
        (decrease, increase) in (any_f64(), any_f64()),
        cooldown in any_duration(),
        feedback in prop::collection::vec(
            (0..4u8, prop::option::of(any_duration()), any_u64(), any_duration()),
            1..12,
        ),
    ) {
        paused().block_on(async {
            let mut builder = AdaptivePacer::builder(ceiling)
                .decrease(decrease)
                .increase(increase)
                .cooldown(cooldown);
            if let Some(f) = floor {
                builder = builder.floor(f);
            }
            if let Some(i) = initial {
                builder = builder.initial(i);
            }
            let pacer = match builder.build() {
                Ok(p) => p,
                Err(e) => {
                    sane_config_error(&e);
                    return;
                }
            };
            for (what, retry_after, n, d) in feedback {
                match what {
                    0 => pacer.on_back_pressure(retry_after),
                    1 => pacer.on_allowance(n, d),
                    2 => pacer.on_policy(n, d),
                    _ => pacer.on_success(),
                }
                let status = pacer.status();
                assert!(status.rate_per_second.is_finite() && status.rate_per_second > 0.0);
                let _ = pacer.rate();
                let _ = tokio::time::timeout(Duration::from_secs(1), pacer.until_ready(1)).await;
            }
        });
    }
}
