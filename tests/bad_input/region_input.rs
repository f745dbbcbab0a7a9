//! Regions: the allocation policies and the home's lease protocol as pure math, with any
//! numbers (the model is public: tools replay traces through it).

use flowgate::region::Allocation;
use flowgate::region::model::{Config, Home, Report, Spec};
use proptest::prelude::*;

use super::any_u64;

fn any_policy() -> impl Strategy<Value = Allocation> {
    prop_oneof![
        Just(Allocation::Static),
        Just(Allocation::FairShare),
        Just(Allocation::ProportionalShare),
    ]
}

/// A lease granted near the end of the home's clock ends at its end, not after a wrap
/// to the start (which in a release build is a lease that expired before it began).
#[test]
fn a_lease_near_the_end_of_the_clock_ends_at_its_end() {
    let cfg = Config {
        rate: 100,
        policy: Allocation::FairShare,
        ttl_us: 10_000_000,
        stale_us: 10_000_000,
        regions: vec![Spec { weight: 1, safe: 0 }],
    };
    let mut home = Home::empty();
    let now = u64::MAX - 1;
    let report = Report {
        seq: 0,
        share: 0,
        demand: 50,
    };
    let grant = home.refresh(&cfg, now, 0, &report);
    assert_eq!(grant.until_us, u64::MAX);
    assert_eq!(home.learn_until_us, u64::MAX);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn division_never_gives_more_than_the_capacity(
        policy in any_policy(),
        capacity in any_u64(),
        regions in prop::collection::vec((any_u64(), any_u64()), 0..6),
    ) {
        let (weights, wants): (Vec<u64>, Vec<u64>) = regions.into_iter().unzip();
        let parts = policy.divide(capacity, &weights, &wants);
        prop_assert_eq!(parts.len(), weights.len());
        let total: u128 = parts.iter().map(|&p| u128::from(p)).sum();
        prop_assert!(total <= u128::from(capacity));
    }

    #[test]
    fn the_home_takes_any_numbers(
        policy in any_policy(),
        (rate, ttl_us, stale_us) in (any_u64(), any_u64(), any_u64()),
        specs in prop::collection::vec((any_u64(), any_u64()), 1..4),
        steps in prop::collection::vec(
            (0..3u8, any::<prop::sample::Index>(), any_u64(), (any_u64(), any_u64(), any_u64())),
            1..12,
        ),
    ) {
        let cfg = Config {
            rate,
            policy,
            ttl_us,
            stale_us,
            regions: specs.into_iter().map(|(weight, safe)| Spec { weight, safe }).collect(),
        };
        let n = cfg.regions.len();
        let mut home = Home::empty();
        for (op, region, now_us, (seq, share, demand)) in steps {
            let i = region.index(n);
            let report = Report { seq, share, demand };
            match op {
                0 => {
                    let _ = home.init(&cfg, now_us);
                }
                1 => home.ack(&cfg, now_us, i, &report),
                _ => {
                    let grant = home.refresh(&cfg, now_us, i, &report);
                    // A lease never ends before it is granted, and never grants more
                    // than the whole rate.
                    prop_assert!(grant.until_us >= now_us);
                    prop_assert!(grant.share <= rate);
                }
            }
            let _ = home.learning(now_us);
            let _ = home.targets(&cfg, now_us);
            for j in 0..n {
                let _ = home.held(&cfg, j);
            }
        }
    }
}
