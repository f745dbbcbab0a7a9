//! `MemoryGate::check_all` against a model: one token bucket per (key, quota), every
//! request charged on all of its buckets or on none, in shards full enough that new keys and
//! new quotas are refused (`KeyspaceFull`) and idle ones evicted.

use std::collections::HashMap;
use std::time::Duration;

use flowgate::clock::Clock;
use flowgate::gate::{GateError, Limit, MemoryGate};
use flowgate::limit::{Limiter, TokenBucket};
use flowgate::{Quota, Rate};
use proptest::prelude::*;

/// Quota `i`: 1 to 3 units per 100 ms and a few more, bursts as many.
fn quota(i: u8) -> Quota {
    let units = u32::from(i % 3) + 1;
    let rate = Rate::per(units, Duration::from_millis(100 + u64::from(i))).unwrap();
    Quota::new(rate, units).unwrap()
}

/// A request: a gap in µs before it, its limits (key index, quota index), its cost.
type Step = (u64, Vec<(u8, u8)>, u32);

fn steps() -> impl Strategy<Value = Vec<Step>> {
    let limit = (0u8..7, 0u8..20);
    let step = (0u64..60_000, prop::collection::vec(limit, 1..5), 1u32..4);
    prop::collection::vec(step, 1..200)
}

/// The model's buckets of a request: each distinct key once, with its quota and the sum of
/// its costs; `None` when the gate must refuse it (a key with two quotas, a sum above a
/// burst).
fn merged(limits: &[(String, Quota)], cost: u32) -> Option<Vec<(String, Quota, u32)>> {
    let mut buckets: Vec<(String, Quota, u32)> = Vec::new();
    for (key, q) in limits {
        match buckets.iter_mut().find(|b| &b.0 == key) {
            Some(b) if b.1 != *q => return None,
            Some(b) => b.2 += cost,
            None => buckets.push((key.clone(), *q, cost)),
        }
    }
    buckets
        .iter()
        .all(|b| b.2 <= b.1.burst_size())
        .then_some(buckets)
}

/// Every answer is the model's, on a clock that only moves on; a request the gate refuses
/// (a bad one, or a full keyspace) charges nothing anywhere, or a later answer differs.
async fn agrees(steps: &[Step], max_keys: usize) -> Result<(), TestCaseError> {
    let gate = MemoryGate::builder(Limit::TokenBucket(quota(0)))
        .max_keys(max_keys)
        .clock(Clock::tokio())
        .build()
        .unwrap();
    let mut model: HashMap<(String, Quota), Limiter<TokenBucket>> = HashMap::new();
    let mut now = Duration::ZERO;
    for (gap, limits, cost) in steps {
        tokio::time::advance(Duration::from_micros(*gap)).await;
        now += Duration::from_micros(*gap);
        // Keys 0 to 3 always with one quota; the others with any (two quotas: refused).
        let limits: Vec<(String, Quota)> = limits
            .iter()
            .map(|&(k, q)| (format!("k{k}"), quota(if k < 4 { k } else { q + k })))
            .collect();
        let given: Vec<(&str, Quota)> = limits.iter().map(|(k, q)| (k.as_str(), *q)).collect();
        let decided = gate.check_all(&given, *cost);
        let Some(buckets) = merged(&limits, *cost) else {
            prop_assert!(decided.is_err(), "{given:?} admitted: {decided:?}");
            continue;
        };
        // Each bucket decided on a copy of the model's.
        let trial: Vec<_> = buckets
            .iter()
            .map(|(key, q, total)| {
                let mut bucket = model
                    .get(&(key.clone(), *q))
                    .cloned()
                    .unwrap_or_else(|| Limiter::new(TokenBucket::new(*q)));
                bucket.check(now, *total).unwrap()
            })
            .collect();
        let all = trial.iter().all(|d| d.allowed);
        let decisions = match decided {
            Err(GateError::KeyspaceFull { .. }) => continue,
            Err(e) => return Err(TestCaseError::fail(format!("{given:?}: {e}"))),
            Ok(d) => d,
        };
        prop_assert_eq!(decisions.len(), given.len());
        for ((key, _), d) in limits.iter().zip(&decisions) {
            let i = buckets.iter().position(|b| &b.0 == key).unwrap();
            prop_assert_eq!(d.allowed, all, "{:?} at {:?}: {:?}", given, now, decisions);
            // A bucket with room in a rejected request is not charged: it reports what it
            // holds.
            let uncharged = if !all && trial[i].allowed {
                u64::from(buckets[i].2)
            } else {
                0
            };
            prop_assert_eq!(d.remaining, trial[i].remaining + uncharged, "{:?}", given);
        }
        if all {
            for (key, q, total) in &buckets {
                let bucket = model
                    .entry((key.clone(), *q))
                    .or_insert_with(|| Limiter::new(TokenBucket::new(*q)));
                bucket.check(now, *total).unwrap();
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 300,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// 16 shards of 1 to 4 keys: new keys and new quotas often find no room.
    #[test]
    fn check_all_is_all_or_nothing_against_the_model(s in steps(), per_shard in 1usize..5) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap();
        rt.block_on(agrees(&s, 16 * per_shard))?;
    }
}
