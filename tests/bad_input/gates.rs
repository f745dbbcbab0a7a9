//! The in-memory gate with any bound, key and `check_all` list.

use super::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn memory_gate_refuses_bad_bounds_keys_and_costs(
        limit in any_limit(),
        max_keys in any_usize(),
        calls in prop::collection::vec((any_key(), any_u32()), 1..20),
    ) {
        let gate = match MemoryGate::builder(limit).max_keys(max_keys).build() {
            Ok(g) => g,
            Err(e) => {
                sane_config_error(&e);
                prop_assert_eq!(e.field(), "keyed.max_keys");
                prop_assert!(max_keys == 0 || max_keys > usize::MAX - 15);
                return Ok(());
            }
        };
        prop_assert!(gate.max_keys() >= max_keys && gate.max_keys() - max_keys < 16);
        for (key, cost) in &calls {
            match gate.check(key, *cost) {
                Ok(d) => {
                    prop_assert!(!key.is_empty() && key.len() <= 512);
                    prop_assert_eq!(d.capacity, limit.capacity());
                    prop_assert!(d.remaining <= d.capacity);
                    prop_assert!(d.allowed || !d.retry_after.is_zero());
                }
                Err(GateError::InvalidKey(why)) => {
                    prop_assert!(key.is_empty() || key.len() > 512, "{why}");
                }
                Err(GateError::Cost(_)) => {
                    prop_assert!(*cost == 0 || u64::from(*cost) > limit.capacity());
                }
                Err(GateError::KeyspaceFull { .. }) => {}
                Err(e) => panic!("undocumented error {e:?}"),
            }
        }
        prop_assert!(gate.len() <= gate.max_keys());
        let _ = gate.sweep();
    }

    #[test]
    fn memory_gate_check_all_refuses_bad_lists(
        limits in prop::collection::vec((any_key(), any_quota()), 0..40),
        cost in any_u32(),
    ) {
        let gate = MemoryGate::builder(Limit::TokenBucket(Quota::per_second(1).unwrap()))
            .max_keys(64)
            .build()
            .unwrap();
        let list: Vec<(&str, Quota)> = limits.iter().map(|(k, q)| (k.as_str(), *q)).collect();
        match gate.check_all(&list, cost) {
            Ok(ds) => {
                prop_assert_eq!(ds.len(), list.len());
                prop_assert!(!list.is_empty() && list.len() <= 32);
                let allowed = ds[0].allowed;
                for d in &ds {
                    prop_assert_eq!(d.allowed, allowed);
                    prop_assert!(d.remaining <= d.capacity);
                }
            }
            Err(GateError::NoLimits) => prop_assert!(list.is_empty()),
            Err(GateError::TooManyLimits { .. }) => prop_assert!(list.len() > 32),
            Err(
                GateError::Cost(_)
                | GateError::InvalidKey(_)
                | GateError::ConflictingQuotas { .. }
                | GateError::KeyspaceFull { .. },
            ) => {}
            Err(e) => panic!("undocumented error {e:?}"),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// `gated` over items with any key and any cost: every item comes out or goes to the
    /// drop hook (a cost that can never pass, a key the gate refuses): none is lost, and
    /// none waits for ever (paused time jumps ahead).
    #[test]
    fn gated_loses_no_item_whatever_its_key_and_cost(
        quota in any_quota(),
        items in prop::collection::vec((any_key(), any_u32()), 1..8),
    ) {
        let quota = Quota::new(
            Rate::per_second(quota.rate().count()).unwrap(),
            quota.burst_size(),
        )
        .unwrap();
        let n = items.len();
        // The longest a right gate makes them wait, one after the other: each item's cost
        // at the rate (a cost above the burst is dropped at once), a second more each for
        // the timer. A century was too short: 3 153 600 002 at 1/s is two seconds more.
        let longest = Duration::from_secs(
            items
                .iter()
                .map(|(_, cost)| u64::from(*cost).div_ceil(u64::from(quota.rate().count())) + 1)
                .sum(),
        );
        let hooked = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let out = paused().block_on(async {
            let gate = MemoryGate::builder(Limit::TokenBucket(quota))
                .clock(flowgate::clock::Clock::tokio())
                .build()
                .unwrap();
            let counted = hooked.clone();
            let gated = flowgate::gate::Gated::builder(
                futures::stream::iter(items),
                gate,
                |item: &(String, u32)| item.0.clone(),
            )
            .cost(|item: &(String, u32)| item.1)
            .on_drop(move |_, _| {
                counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            })
            .build()
            .unwrap();
            tokio::time::timeout(longest, gated.collect::<Vec<_>>()).await
        });
        let out = out.expect("every item decided within the longest wait its cost allows");
        prop_assert_eq!(out.len() + hooked.load(std::sync::atomic::Ordering::Relaxed), n);
    }
}
