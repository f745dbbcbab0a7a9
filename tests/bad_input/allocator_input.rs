//! The quota allocator of the regions: any names, weights, safe shares, durations, floats.

use std::time::Duration;

use flowgate::region::{Allocation, QuotaAllocator, RegionSpec, SafeShare};
use flowgate::{Quota, Rate};
use proptest::prelude::*;

use proptest::test_runner::TestRunner;

use super::{any_duration, any_f64, any_u64, sane_config_error};
use crate::support::RedisServer;

fn any_safe() -> impl Strategy<Value = SafeShare> {
    prop_oneof![
        Just(SafeShare::Closed),
        Just(SafeShare::StaticWeight),
        any_u64().prop_map(SafeShare::Units),
    ]
}

/// Mostly valid settings, each with a chance of being bad: a property that holds when
/// everything is valid, and when one thing is not.
#[allow(clippy::type_complexity)]
fn settings() -> impl Strategy<
    Value = (
        (u32, u64, u32),
        String,
        Vec<(String, u64, Option<SafeShare>)>,
        SafeShare,
        Allocation,
        (Duration, Option<Duration>, Option<Duration>, Duration),
        f64,
    ),
> {
    let duration = || prop_oneof![3 => Just(Duration::from_secs(10)), 1 => any_duration()];
    (
        (
            prop_oneof![3 => 1..100u32, 1 => 1..u32::MAX],
            prop_oneof![3 => Just(1_000_000u64), 1 => 1..(1u64 << 40)],
            prop_oneof![3 => 1..100u32, 1 => 1..u32::MAX],
        ),
        prop_oneof![
            1 => Just(String::new()),
            1 => Just("a:b".to_string()),
            1 => Just("x".repeat(10_000)),
            6 => "[a-z]{1,8}"
        ],
        prop::collection::vec(
            (
                prop_oneof![
                    1 => Just(String::new()),
                    1 => Just("{r}".to_string()),
                    6 => "[a-z]{1,3}"
                ],
                prop_oneof![3 => 0..10u64, 1 => any_u64()],
                prop::option::weighted(0.2, any_safe()),
            ),
            0..4,
        ),
        prop_oneof![3 => Just(SafeShare::Closed), 1 => any_safe()],
        prop_oneof![
            Just(Allocation::Static),
            Just(Allocation::FairShare),
            Just(Allocation::ProportionalShare)
        ],
        (
            duration(),
            prop::option::weighted(0.2, any_duration()),
            prop::option::weighted(0.2, any_duration()),
            prop_oneof![3 => Just(Duration::from_millis(50)), 1 => any_duration()],
        ),
        prop_oneof![3 => 0.01..=1.0f64, 1 => any_f64()],
    )
}

/// Built, or refused with a `ConfigError`; a built allocator's safe shares fit its rate.
#[test]
fn the_allocator_builder_refuses_bad_settings() {
    let server = RedisServer::start();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let conn = rt.block_on(server.connect());
    let built = std::cell::Cell::new(0);
    let mut runner = TestRunner::new(ProptestConfig::with_cases(256));
    runner
        .run(
            &settings(),
            |((count, period_us, burst), name, regions, safe, policy, durations, smoothing)| {
                let (ttl, refresh, home_timeout, local_timeout) = durations;
                let _guard = rt.enter();
                let rate = Rate::per(count, Duration::from_micros(period_us)).unwrap();
                let quota = Quota::new(rate, burst).unwrap();
                let mut builder = QuotaAllocator::builder(conn.clone(), quota)
                    .name(name)
                    .policy(policy)
                    .safe_share(safe)
                    .lease(ttl)
                    .local_timeout(local_timeout)
                    .smoothing(smoothing);
                for (n, w, s) in regions {
                    let mut spec = RegionSpec::new(n, w);
                    if let Some(s) = s {
                        spec = spec.safe_share(s);
                    }
                    builder = builder.region(spec);
                }
                if let Some(r) = refresh {
                    builder = builder.refresh_every(r);
                }
                if let Some(t) = home_timeout {
                    builder = builder.home_timeout(t);
                }
                match builder.build() {
                    Ok(a) => {
                        built.set(built.get() + 1);
                        prop_assert!(smoothing > 0.0 && smoothing <= 1.0);
                        let safe: u128 = a.safe_shares().iter().map(|&(_, s)| u128::from(s)).sum();
                        prop_assert!(safe <= u128::from(count));
                    }
                    Err(e) => sane_config_error(&e),
                }
                Ok(())
            },
        )
        .unwrap();
    assert!(
        built.get() > 0,
        "no setting was valid: the property says nothing"
    );
}
